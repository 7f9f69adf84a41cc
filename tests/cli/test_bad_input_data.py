"""Bad data and silent no-ops, each ending as tests/cli/test_bad_input.py requires (exit code 2,
one line `sparrow CMD: error: ...`, no traceback), before any model loads: prompts that are not Unicode text (a lone
surrogate), a resumed profile's damaged files, and options that would be cut down or do nothing without a word."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.measure.profiling import ScheduleSample, read_dense_rewards
from tests.cli.test_bad_input import check_refused, no_model_loading  # noqa: F401 (the fixture)

SURROGATE = "lone surrogate '\\ud800' at character 3; expected Unicode text"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-data")
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(3)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    broken = rows[:1] + [{"prompt": "ab \ud800 c", "answer": "2"}] + rows[2:]
    (root / "surrogate.jsonl").write_text("".join(json.dumps(row) + "\n" for row in broken))  # "\ud800" escaped
    chat = {"prompt": [{"role": "user", "content": "hi \ud800"}], "answer": "1"}
    (root / "surrogate-chat.jsonl").write_text(json.dumps(chat) + "\n")
    (root / "null-answer.jsonl").write_text("".join(json.dumps({**row, "answer": None} if i == 1 else row) + "\n"
                                                    for i, row in enumerate(rows)))
    (root / "no-answers.jsonl").write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in rows))
    long = rows + [{"prompt": "x " * 9000, "answer": "1"}]
    (root / "too-long.jsonl").write_text("".join(json.dumps(row) + "\n" for row in long))
    return root


TRAIN = ["train", "--model", "tiny-qwen3", "--data", "{files}/data.jsonl", "--reward", "first_number", "--steps", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4", "--schedule", "const:48",
         "--output-dir", "{tmp}/run"]
GEN = ["generate", "--model", "tiny-qwen3"]
PROFILE = ["profile", "--model", "tiny-qwen3", "--out", "{tmp}/profile", "--schedules", "const:64",
           "--max-new-tokens", "4", "--prompts"]
LINE_2 = f"surrogate.jsonl:2: prompt holds a {SURROGATE}"

# (id, argv, text the message must hold); every one but prompts' is refused before any model loads
CASES = [
    ("generate-prompt-arg", GEN + ["--prompt", "ab \ud800 c"], f"--prompt holds a {SURROGATE}"),
    ("generate-prompts-file", GEN + ["--prompts", "{files}/surrogate.jsonl"], LINE_2),
    ("generate-chat-content", GEN + ["--prompts", "{files}/surrogate-chat.jsonl"],
     "surrogate-chat.jsonl:1: prompt message 0's content holds a lone surrogate '\\ud800' at character 3"),
    ("profile-prompts-file", PROFILE + ["{files}/surrogate.jsonl"], LINE_2),
    ("eval-data", ["eval", "--model", "tiny-qwen3", "--data", "{files}/surrogate.jsonl", "--reward", "first_number"],
     LINE_2),
    ("train-data", [*TRAIN[:4], "{files}/surrogate.jsonl", *TRAIN[5:]], LINE_2),
    ("train-eval-data", TRAIN + ["--eval-data", "{files}/surrogate.jsonl"], LINE_2),
    ("profile-reward-null-answer", PROFILE + ["{files}/null-answer.jsonl", "--reward", "first_number"],
     "reward 'first_number' compares with each row's 'answer', but 1 row(s) of prompts file "
     "'{files}/null-answer.jsonl' have none (first: row 1, counted from 0); give every row an answer or another "
     "--reward"),
    ("profile-reward-no-answers", PROFILE + ["{files}/no-answers.jsonl", "--reward", "math"],
     "reward 'math' compares with each row's 'answer', but 3 row(s) of prompts file"),
    ("prompts-codes-500", ["prompts", "--model", "tiny-qwen3", "--task", "manifest", "--count", "1", "--codes", "500",
                           "--out", "{tmp}/p.jsonl"],
     "codes 500 make an answer of 5391 tokens (the manifest, copied), which after prompts of up to 5612 tokens does "
     "not fit model 'tiny-qwen3''s max_position_embeddings 8192; expected fewer --codes"),  # not min_tokens
    ("prompts-codes-1000", ["prompts", "--model", "tiny-qwen3", "--task", "manifest", "--count", "1", "--codes", "1000",
                            "--min-tokens", "100", "--out", "{tmp}/p.jsonl"],
     "codes 1000 make an answer of 10892 tokens"),
    ("train-reward-check-samples-above-group", TRAIN + ["--reward-check-samples", "100"],
     "reward_check_samples 100 exceeds num_generations 2: the reward check pairs dense samples with the samples of "
     "a rollout group; expected at most 2"),
    ("train-reward-check-prompts-above-step", TRAIN + ["--reward-check-prompts", "100"],
     "reward_check_prompts 100 exceeds prompts_per_step 2: the reward check draws from the prompts of a step; "
     "expected at most 2"),
    ("train-reward-check-one-pair", TRAIN + ["--reward-check-samples", "1"],
     "the reward check with reward_check_samples 1 of reward_check_prompts 1 compares one pair of samples, which "
     "gives no interval"),
    ("train-min-retention-above-one", TRAIN + ["--min-retention", "2"], "min_retention must be in (0, 1] as "
                                                                        "calibrate's, got 2.0"),
    ("train-eval-at-start-without-eval-data", TRAIN + ["--eval-at-start"],
     "eval_at_start scores the held-out set before the first step, and there is none: give --eval-data FILE as "
     "well, or drop --eval-at-start"),
    ("train-cpus-per-worker-without-workers", TRAIN + ["--cpus-per-worker", "1000"],
     "cpus_per_worker 1000 applies to Ray rollout workers, and there are none: give --rollout-workers N as well"),
    ("generate-cpus-per-worker-without-workers", GEN + ["--prompt", "x", "--cpus-per-worker", "2"],
     "cpus_per_worker 2 applies to Ray rollout workers, and there are none"),
    ("train-cpus-per-worker-above-cpus", TRAIN + ["--rollout-workers", "1", "--cpus-per-worker", "1000"],
     f"rollout_workers 1 x cpus_per_worker 1000 exceeds the {len(os.sched_getaffinity(0))} CPU(s) available here"),
    ("train-wire-dtype-without-workers", TRAIN + ["--wire-dtype", "bfloat16"],
     "wire_dtype 'bfloat16' is how weights travel to Ray rollout workers, and there are none"),
]


@pytest.mark.parametrize("argv, message", [
    pytest.param([*TRAIN[:4], "{files}/too-long.jsonl", *TRAIN[5:]], "data '{files}/too-long.jsonl': row 3", id="data"),
    pytest.param(TRAIN + ["--eval-data", "{files}/too-long.jsonl"], "eval_data '{files}/too-long.jsonl': row 3",
                 id="eval-data"),
])
def test_a_row_past_the_context_stops_training_before_the_first_step(argv, message, files, tmp_path, monkeypatch,
                                                                     capsys, request):
    check_refused(argv, message + " (counted from 0) has 18000 prompt tokens; with max_new_tokens 4 that exceeds the "
                  "model's 8192 positions; shorten or drop the row, or lower --max-new-tokens", False, files, tmp_path,
                  monkeypatch, capsys, request)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


@pytest.mark.parametrize("argv, message", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_data_or_option_is_one_line_and_exit_code_2(argv, message, files, tmp_path, monkeypatch, capsys,
                                                        request):
    before_load = argv[0] != "prompts"  # prompts measure their length with the model's tokenizer
    check_refused(argv, message, before_load, files, tmp_path, monkeypatch, capsys, request)
    if argv[0] == "prompts":
        assert not (tmp_path / "p.jsonl").exists()


def test_the_data_report_names_the_line_and_the_character(files):
    from sparrow.datasets import DataSpec, load_examples

    with pytest.raises(SparrowError) as caught:
        load_examples(DataSpec(str(files / "surrogate.jsonl")))
    assert str(caught.value) == (f"{files}/{LINE_2} (surrogates \\ud800-\\udfff only in pairs; command-line text in "
                                 "UTF-8)")
    assert len(load_examples(DataSpec(str(files / "data.jsonl")))) == 3


def test_a_paired_surrogate_escape_is_ordinary_text(tmp_path):
    from sparrow.datasets import read_prompts

    path = tmp_path / "emoji.jsonl"
    path.write_text('{"prompt": "smile \\ud83d\\ude00"}\n')
    assert read_prompts(str(path)) == ["smile \U0001f600"]


# -- a resumed profile's damaged files: refused by name, before the model loads ---------------------------------

def _sample(rewards: bool = True) -> ScheduleSample:
    n = 6
    return ScheduleSample(np.full(n, 0.9), np.arange(n) + 3, np.arange(n) % 3, np.full(n, 64),
                          np.ones(2) if rewards else None)


def _resume(files, tmp_path, monkeypatch, capsys, request, damage, message, reward=True):
    out = tmp_path / "profile"
    out.mkdir()
    damage(out)
    argv = PROFILE + ["{files}/data.jsonl"] + (["--reward", "first_number"] if reward else [])
    check_refused(argv, message.format(out=out), True, files, tmp_path, monkeypatch, capsys, request)


def test_a_truncated_tokens_file_is_refused_by_name(files, tmp_path, monkeypatch, capsys, request):
    def truncate(out):
        _sample().save(out / "tokens-const_64.npz")
        data = (out / "tokens-const_64.npz").read_bytes()
        (out / "tokens-const_64.npz").write_bytes(data[: len(data) // 2])

    _resume(files, tmp_path, monkeypatch, capsys, request, truncate,
            "{out}/tokens-const_64.npz is damaged: it cannot be read (BadZipFile: ")
    capsys.readouterr()
    err = None
    try:
        ScheduleSample.load(tmp_path / "profile" / "tokens-const_64.npz")
    except SparrowError as caught:
        err = str(caught)
    assert err is not None and err.endswith("; remove it to profile that schedule again (the other files of the "
                                            "profile are kept)")


def test_a_damaged_dense_rewards_file_is_refused_by_name(files, tmp_path, monkeypatch, capsys, request):
    _resume(files, tmp_path, monkeypatch, capsys, request,
            lambda out: (out / "dense-rewards.json").write_text("[1.0, 0.5, "),
            "{out}/dense-rewards.json is damaged: it is not valid JSON (Expecting value: line 1 column 12 (char 11)); "
            "remove it to sample the dense policy's rewards again")


def test_a_damaged_run_key_is_refused_before_the_model_loads(files, tmp_path, monkeypatch, capsys, request):
    _resume(files, tmp_path, monkeypatch, capsys, request, lambda out: (out / "run_key.json").write_text("{"),
            "{out}/run_key.json is damaged (Expecting property name enclosed in double quotes", reward=False)


def test_saved_profile_files_are_checked_whole(tmp_path):
    path = tmp_path / "tokens.npz"
    np.savez(path, alpha=np.ones(3), total_position=np.arange(3), generated_position=np.arange(3))
    with pytest.raises(SparrowError, match=r"tokens.npz is damaged: it lacks the array\(s\) kv_budget; remove it"):
        ScheduleSample.load(path)
    _sample(rewards=False).save(path)
    with pytest.raises(SparrowError, match=r"lacks the array\(s\) rewards"):
        ScheduleSample.load(path, with_rewards=True)
    assert ScheduleSample.load(path).alpha.size == 6
    np.savez(path, alpha=np.ones(3), total_position=np.arange(4), generated_position=np.arange(3),
             kv_budget=np.arange(3))
    with pytest.raises(SparrowError, match="holds arrays of different shapes"):
        ScheduleSample.load(path)
    dense = tmp_path / "dense-rewards.json"
    for text, problem in (('{"a": 1}', "is not a list of finite numbers"), ("[1, NaN]", "is not a list of finite "
                                                                                         "numbers"),
                          ("[1, 0.5]", "holds 2 rewards; expected 3 (one per paired completion)")):
        dense.write_text(text)
        with pytest.raises(SparrowError) as caught:
            read_dense_rewards(dense, 3)
        assert str(caught.value) == (f"{dense} is damaged: it {problem}; remove it to sample the dense policy's "
                                     "rewards again")
    assert read_dense_rewards(dense).tolist() == [1.0, 0.5]


def test_calibrate_does_not_advise_larger_budgets_when_the_dense_reward_is_zero():
    from sparrow.measure.calibration import calibrate
    from tests.measure.test_reward_calibration import TABLE, _profile

    profile = _profile(TABLE, {budget: (None, None, None) for budget in TABLE})
    for spec in profile["schedules"].values():
        spec["reward"]["dense_mean"] = spec["reward"]["retention"]["dense_mean"] = 0.0
    with pytest.raises(SparrowError) as caught:
        calibrate(profile, 0.86, min_retention=0.9)
    assert str(caught.value) == (
        "the profile's dense policy has mean reward 0.0, so no retention is defined (n/a for every schedule) and "
        "larger budgets cannot help: profile prompts the dense policy solves sometimes, or a reward that scores "
        "them, or calibrate without --min-retention")


def test_generate_json_shows_progress_on_a_terminal_and_none_in_a_pipe(tmp_path, monkeypatch, capsys):
    import sys

    from sparrow.cli import main

    argv = ["generate", "--model", "tiny-qwen3", "--prompt", "hello", "--max-new-tokens", "3", "--json"]
    assert main(argv) == 0
    assert "generating" not in capsys.readouterr().err  # stderr read by a script: quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "generating" in err and len(out.splitlines()) == 1 and json.loads(out)["prompt_index"] == 0
