"""The built-in `records` and `passkey` prompts: long enough, reproducible, and answerable from the ledger."""

import json
import re

import pytest

from sparrow.cli import main
from sparrow.models import tiny_tokenizer
from sparrow.tasks import passkey
from sparrow.tasks.fitting import prompt_length
from sparrow.tasks.records import make_prompts


def test_prompts_reach_the_requested_length_and_repeat_with_the_seed():
    tok = tiny_tokenizer()
    first = make_prompts(3, 600, seed=4, tokenizer=tok)
    assert first == make_prompts(3, 600, seed=4, tokenizer=tok)
    assert first != make_prompts(3, 600, seed=5, tokenizer=tok)
    for example in first:
        ids = tok.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True)
        assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) >= 600


def test_the_answer_is_the_count_of_the_entry_asked_about():
    example = make_prompts(1, 300, seed=1, tokenizer=tiny_tokenizer())[0]
    text = example["prompt"][0]["content"]
    number, item, name, place = re.search(r"entry (\d+), how many (\w+) did (\w+) store in (the \w+)", text).groups()
    line = re.search(rf"Entry {number}: {name} stored (\d+) {item} in {place}\.", text)
    assert line and line.group(1) == example["answer"]


def test_the_command_writes_jsonl(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["prompts", "--model", "tiny-llama", "--count", "2", "--min-tokens", "200", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all({"prompt", "answer"} <= set(r) for r in rows)


def test_passkey_prompts_hide_the_key_inside_the_ledger():
    tok = tiny_tokenizer()
    examples = passkey.make_prompts(4, 500, seed=2, tokenizer=tok)
    assert examples == passkey.make_prompts(4, 500, seed=2, tokenizer=tok)
    for example in examples:
        lines = example["prompt"][0]["content"].splitlines()
        key_lines = [i for i, line in enumerate(lines) if line == f"The pass key is {example['answer']}."]
        entries = [i for i, line in enumerate(lines) if line.startswith("Entry ")]
        assert len(key_lines) == 1 and re.fullmatch(r"\d{5}", example["answer"])
        assert entries[0] < key_lines[0] < entries[-1]  # never at the very start or end: not in sink/recent pages
        assert prompt_length(tok, example["prompt"]) >= 500


def test_the_command_writes_passkey_prompts(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["prompts", "--task", "passkey", "--model", "tiny-llama", "--count", "3", "--min-tokens", "300",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["answer"] in r["prompt"][0]["content"] for r in rows)


def test_unknown_task_is_named(capsys):
    assert main(["prompts", "--task", "riddles", "--model", "tiny-llama"]) == 2
    assert "unknown task 'riddles': expected one of records, passkey" in capsys.readouterr().err


def test_manifest_prompts_hold_the_codes_of_their_answer_in_order_inside_the_ledger():
    from sparrow.tasks import manifest

    tok = tiny_tokenizer()
    examples = manifest.make_prompts(3, 800, seed=2, tokenizer=tok)
    assert examples == manifest.make_prompts(3, 800, seed=2, tokenizer=tok)
    for example in examples:
        text, codes = example["prompt"][0]["content"], example["answer"]
        assert len(codes) == len(set(codes)) == manifest.CODES
        block = text[text.index("MANIFEST\n"):text.index("END OF MANIFEST")]
        assert re.findall(r"\d+\. (\d{5})", block) == codes
        assert text.index("MANIFEST") > text.index("Entry 1:") and prompt_length(tok, example["prompt"]) >= 800
        assert example["prompt"][1] == {"role": "assistant", "content": "1. "}


def test_codes_sets_the_manifest_length_and_only_the_manifest_task_takes_it(tmp_path, capsys):
    from sparrow.tasks import manifest

    tok = tiny_tokenizer()
    [example] = manifest.make_prompts(1, 800, seed=2, tokenizer=tok, codes=64)
    text, codes = example["prompt"][0]["content"], example["answer"]
    block = text[text.index("MANIFEST\n"):text.index("END OF MANIFEST")]
    assert len(codes) == len(set(codes)) == 64 and re.findall(r"\d+\. (\d{5})", block) == codes
    out = tmp_path / "long.jsonl"
    assert main(["prompts", "--task", "manifest", "--codes", "40", "--model", "tiny-llama", "--count", "2",
                 "--min-tokens", "300", "--out", str(out)]) == 0
    assert [len(json.loads(line)["answer"]) for line in out.read_text().splitlines()] == [40, 40]
    assert main(["prompts", "--task", "passkey", "--codes", "40", "--model", "tiny-llama"]) == 2
    assert "codes 40: expected 1 to 1000, with --task manifest (got task 'passkey')" in capsys.readouterr().err


def test_number_f1_gives_partial_credit_and_costs_extra_numbers():
    from sparrow.rewards.answer import number_f1_reward

    gold = ["11111", "22222", "33333", "44444"]
    scores = number_f1_reward(None, ["11111\n22222\n33333\n44444", "1. 11111\n2. 22222", "11111 99999 88888",
                                     "no codes", "11,111 and 7"], [gold] * 5)
    # all; half the codes (the list indices are not candidates): 2/3; one hit of three found: p 1/3, r 1/4 -> 2/7;
    # none; "11,111" is 11111 and 7 is too short to count: p 1, r 1/4 -> 0.4
    assert scores == pytest.approx([1.0, 2 / 3, 2 * (1 / 3) * (1 / 4) / (1 / 3 + 1 / 4), 0.0, 0.4])


def test_mixed_lengths_spread_evenly_between_the_bounds_in_a_seeded_order():
    from sparrow.tasks.fitting import length_targets

    spread = length_targets(5, 200, 600, seed=3)
    assert sorted(spread) == [200, 300, 400, 500, 600] and spread == length_targets(5, 200, 600, seed=3)
    assert spread != sorted(spread) or length_targets(5, 200, 600, seed=4) != spread
    assert length_targets(3, 200, None, seed=0) == [200, 200, 200]
    with pytest.raises(Exception, match="max_tokens 100 is below min_tokens 200"):
        length_targets(3, 200, 100, seed=0)


def test_the_command_writes_mixed_length_prompts_and_one_length_stays_as_before(tmp_path):
    from sparrow.models import load_model
    from sparrow.tasks import manifest

    out = tmp_path / "mixed.jsonl"
    assert main(["prompts", "--model", "tiny-llama", "--count", "3", "--min-tokens", "300", "--max-tokens", "900",
                 "--out", str(out)]) == 0
    tok = load_model("tiny-llama")[1]
    lengths = sorted(prompt_length(tok, json.loads(line)["prompt"]) for line in out.read_text().splitlines())
    # the first guess of ledger entries is tuned for SmolLM2 and overshoots on the tiny tokenizer; order still holds
    assert lengths[0] >= 300 and lengths[1] >= 600 and lengths[2] >= 900 and lengths[0] < lengths[1] < lengths[2]
    tiny = tiny_tokenizer()
    assert manifest.make_prompts(2, [300, 300], 1, tiny) == manifest.make_prompts(2, 300, 1, tiny)
