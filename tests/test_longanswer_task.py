"""The long-answer regime: the `manifest` task with 128 codes, its reward, and its example prompts config.

The tiny tokenizer is byte-level (one token a byte), so a ledger entry costs about 47 tokens under it where the
task's estimate (`tokens_per_entry=16`) is SmolLM2's: prompts here run well over `min_tokens` whatever the first
guess, and the tests pin the guess itself (the entry count) besides the lengths it gives.
"""

import functools
import hashlib
import json
import random
import re
from pathlib import Path

import pytest

from sparrow.cli import main
from sparrow.cli.app import build_parser
from sparrow.cli.config import load_config
from sparrow.cli.prompts import PromptsConfig
from sparrow.models import tiny_tokenizer
from sparrow.rewards.answer import number_f1, number_f1_reward
from sparrow.tasks import manifest
from sparrow.tasks.fitting import fit_examples, prompt_length

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "longanswer-prompts.yaml"


def _entries(example: dict) -> int:
    return len(re.findall(r"^Entry \d+: ", example["prompt"][0]["content"], flags=re.M))


def _without_reserve(count: int, min_tokens, seed: int, tokenizer, codes: int) -> list[dict]:
    """The prompt set as it was before `reserved_tokens`: the first guess is `target // 16` entries."""
    return fit_examples(functools.partial(manifest.make_example, codes=codes), count, min_tokens, seed, tokenizer,
                        tokens_per_entry=16, reserved_tokens=0)


def test_a_128_code_manifest_is_the_answer_numbered_in_order_inside_the_ledger():
    tok = tiny_tokenizer()
    examples = manifest.make_prompts(4, 3072, seed=0, tokenizer=tok, codes=128)
    for example in examples:
        text, codes = example["prompt"][0]["content"], example["answer"]
        assert len(codes) == len(set(codes)) == 128 and all(re.fullmatch(r"[1-9]\d{4}", c) for c in codes)
        block = text[text.index("MANIFEST\n"):text.index("END OF MANIFEST")]
        numbered = re.findall(r"^(\d+)\. (\d{5})$", block, flags=re.M)
        assert [int(n) for n, _ in numbered] == list(range(1, 129)) and [c for _, c in numbered] == codes
        lines = text.splitlines()
        entry_lines = [i for i, line in enumerate(lines) if line.startswith("Entry ")]
        assert entry_lines[0] < lines.index("MANIFEST") < entry_lines[-1]  # inside the ledger, not at an end
        assert example["prompt"][1] == {"role": "assistant", "content": "1. "}


def test_the_reserve_starts_a_128_code_prompt_nearer_its_target():
    tok = tiny_tokenizer()
    new = manifest.make_prompts(4, 3072, seed=0, tokenizer=tok, codes=128)
    old = _without_reserve(4, 3072, 0, tok, codes=128)
    new_lengths = [prompt_length(tok, e["prompt"]) for e in new]
    old_lengths = [prompt_length(tok, e["prompt"]) for e in old]
    # The first guess: (3072 - 10 * (128 - 16)) // 16 = 122 entries, against 3072 // 16 = 192 without the reserve;
    # under the byte-level tokenizer both already reach the target, so neither grows.
    assert [_entries(e) for e in new] == [122] * 4 and [_entries(e) for e in old] == [192] * 4
    # Measured: 7164-7210 tokens with the reserve, 10490-10585 without.
    assert all(3072 <= n < 7300 for n in new_lengths) and all(o > 10400 for o in old_lengths)
    assert all(o - n > 3000 for n, o in zip(new_lengths, old_lengths, strict=True))


def test_the_reserve_moves_only_the_first_guess_and_the_ledger_still_grows_to_the_target():
    tok = tiny_tokenizer()
    # Under the byte-level tokenizer every make_prompts guess already overshoots, so the growth loop is exercised
    # with an over-large reserve: the first guess is 1 entry (a 1520-token prompt), and the ledger grows past 3072.
    make = functools.partial(manifest.make_example, codes=128)
    assert prompt_length(tok, make(random.Random(0), 1)["prompt"]) < 3072
    examples = fit_examples(make, 3, 3072, 0, tok, tokens_per_entry=16, reserved_tokens=10**6)
    assert examples == fit_examples(make, 3, 3072, 0, tok, tokens_per_entry=16, reserved_tokens=10**6)
    assert all(prompt_length(tok, e["prompt"]) >= 3072 and len(e["answer"]) == 128 for e in examples)
    assert all(_entries(e) > 1 for e in examples)  # measured: 99 entries, 6069-6088 tokens


def test_128_code_prompt_sets_repeat_with_their_seed():
    tok = tiny_tokenizer()
    first = manifest.make_prompts(3, 3072, seed=0, tokenizer=tok, codes=128)
    assert first == manifest.make_prompts(3, 3072, seed=0, tokenizer=tok, codes=128)
    other = manifest.make_prompts(3, 3072, seed=1, tokenizer=tok, codes=128)
    assert all(a["answer"] != b["answer"] and a["prompt"] != b["prompt"] for a, b in zip(first, other, strict=True))


def test_the_default_16_code_prompt_sets_are_unchanged_by_the_reserve():
    tok = tiny_tokenizer()
    default = manifest.make_prompts(2, 800, seed=2, tokenizer=tok)
    assert default == manifest.make_prompts(2, 800, seed=2, tokenizer=tok, codes=16)
    assert default == _without_reserve(2, 800, 2, tok, codes=16)
    mixed = manifest.make_prompts(3, [500, 900, 1300], seed=7, tokenizer=tok)
    assert mixed == _without_reserve(3, [500, 900, 1300], 7, tok, codes=16)
    # Pinned from commit a5e0786's sparrow/tasks (before the reserve), run on the tiny tokenizer: the same codes,
    # prompt lengths and bytes.
    assert [e["answer"][:3] for e in default] == [["17412", "22004", "21124"], ["14115", "42343", "40470"]]
    assert [prompt_length(tok, e["prompt"]) for e in default] == [2650, 2627]
    assert hashlib.sha256(json.dumps(default).encode()).hexdigest() == (
        "2c616c7a3d985146621ded55f4e33e7065358fae60facd6ece112c18e202d16f")


def test_number_f1_on_hand_made_completions_of_a_128_code_answer():
    [example] = manifest.make_prompts(1, 3072, seed=0, tokenizer=tiny_tokenizer(), codes=128)
    codes = example["answer"]
    # The completion continues the assistant's "1. ": the first code, then "2. ...", numbered to 128.
    perfect = codes[0] + "\n" + "\n".join(f"{i}. {c}" for i, c in enumerate(codes[1:], start=2))
    half = codes[0] + "\n" + "\n".join(f"{i}. {c}" for i, c in enumerate(codes[1:64], start=2))
    # Derailed: prose, list indices and numbers of other lengths (4 and 6 digits), none of them five-digit codes.
    garbage = "\n65. 1234\n66. the ledger says Entry 12: Ann stored 7 bolts in the barn 123456 and so on and on"
    made_up = [str(n) for n in range(10000, 99999) if str(n) not in codes][:16]
    extra = "".join(f"\n{i}. {c}" for i, c in enumerate(made_up, start=65))
    completions = [perfect, half + garbage, "", half + extra, half + "\n" + half]
    scores = number_f1_reward(None, completions, [codes] * len(completions))
    # Perfect; half then garbage: precision 1, recall 64/128 -> 2 * 1 * 0.5 / 1.5 = 2/3; nothing; half plus 16 codes
    # not in the manifest: precision 64/80 = 0.8, recall 0.5 -> 2 * 0.8 * 0.5 / 1.3 = 8/13; half copied twice (a
    # loop): the same distinct codes as half -> 2/3.
    assert scores == pytest.approx([1.0, 2 / 3, 0.0, 8 / 13, 2 / 3], abs=1e-12)
    assert round(scores[1], 4) == 0.6667 and round(scores[3], 4) == 0.6154
    assert number_f1(half + garbage, codes) == scores[1]


def test_the_example_config_loads_into_the_prompts_command():
    args = build_parser().parse_args(["prompts", "--config", str(CONFIG)])
    config = load_config(PromptsConfig, args)  # validates it too
    assert (config.task, config.codes, config.count, config.min_tokens, config.seed) == ("manifest", 128, 16, 3072, 0)
    assert config.max_tokens is None and config.model == "smollm2-135m"


def test_the_example_config_on_the_tiny_model_is_refused_by_name_and_fits_with_a_smaller_min_tokens(tmp_path,
                                                                                                     capsys):
    # The tiny model's 8192 positions do not hold its ~7.2K-token prompts (byte-level tokenizer) plus the
    # 1299-token answer: the command refuses, naming the numbers.
    out = tmp_path / "x.jsonl"
    assert main(["prompts", "--config", str(CONFIG), "--model", "tiny-llama", "--count", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"codes 128 make an answer of 1299 tokens \(the manifest, copied\), which after prompts of up to "
                     r"7\d{3} tokens does not fit model 'tiny-llama''s max_position_embeddings 8192; expected fewer "
                     r"--codes or a smaller min_tokens", err), err
    assert not out.exists()
    # With --min-tokens 2000 the rest of the file (task, codes, seed) still applies and the rows fit.
    assert main(["prompts", "--config", str(CONFIG), "--model", "tiny-llama", "--count", "2", "--min-tokens", "2000",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["answer"]) for r in rows] == [128, 128]
    assert rows == manifest.make_prompts(2, 2000, seed=0, tokenizer=tiny_tokenizer(), codes=128)
