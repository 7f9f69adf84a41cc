"""Every bad input ends the same way: exit code 2, one line `sparrow CMD: error: ...` on stderr,
no traceback, and, where the bad value is known before the model is needed, no model loaded at all.

TRAIN_CASES are the `sparrow train` options its config checks before any model loads.
"""

import json
import os
import sys
from pathlib import Path

import pytest

import sparrow
from sparrow import models
from sparrow.cli import main
from sparrow.cli.app import EXIT_BROKEN_PIPE
from sparrow.engine import RolloutEngine
from sparrow.errors import SparrowError

LATIN1 = "caf\xe9".encode("latin-1")  # not UTF-8


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """One folder of bad (and a few good) input files, shared by the whole table."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                                             for i in range(4)))
    (root / "no-answers.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(4)))
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "' + LATIN1 + b'"}\n')
    (root / "latin1.yaml").write_bytes(b"model: tiny-qwen3\nprompt: " + LATIN1 + b"\n")
    (root / "latin1.json").write_bytes(b'{"schedules": "' + LATIN1 + b'"}')
    (root / "list.json").write_text("[1, 2]")
    (root / "no-bins.json").write_text(json.dumps({"schedules": {"const:64": {"spec": "const:64"}}}))
    (root / "a-dir").mkdir()
    (root / "a-file").write_text("x")
    run = root / "run-missing-fields"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')

    gguf = models.smollm2_gguf_path()
    with gguf.open("rb") as handle:
        head = handle.read(3_000_000)
    (root / "truncated-header.gguf").write_bytes(head[:100_000])  # cut inside the tensor index
    (root / "truncated-data.gguf").write_bytes(head)  # complete index, tensor data cut short
    (root / "empty.gguf").write_bytes(b"")
    (root / "garbage.gguf").write_bytes(b"not a gguf file " * 64)

    model, tokenizer = models.load_model("tiny-qwen3")
    good = root / "hf-good"
    model.save_pretrained(good)
    tokenizer.save_pretrained(good)
    weights = (good / "model.safetensors").read_bytes()
    config = json.loads((good / "config.json").read_text())
    for name, change in {
        "hf-truncated": lambda d: (d / "model.safetensors").write_bytes(weights[: len(weights) // 2]),
        "hf-garbage": lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 100),
        "hf-bad-config": lambda d: (d / "config.json").write_text("{not json"),
        "hf-no-weights": lambda d: (d / "model.safetensors").unlink(),
        "hf-unknown-arch": lambda d: (d / "config.json").write_text(
            json.dumps({**config, "model_type": "no-such-arch", "architectures": ["NoSuchForCausalLM"]})),
    }.items():
        target = root / name
        target.mkdir()
        for item in good.iterdir():
            (target / item.name).write_bytes(item.read_bytes())
        change(target)
    return root


GEN = ["generate", "--model", "tiny-qwen3"]
TRAIN = ["train", "--model", "tiny-qwen3", "--data", "{files}/data.jsonl", "--reward", "first_number", "--steps", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4", "--schedule", "const:48",
         "--output-dir", "{tmp}/run"]

# (id, argv, text the message must hold, refused before any model is loaded)
CASES = [
    ("prompts-not-utf8", GEN + ["--prompts", "{files}/latin1.jsonl"], "not UTF-8", True),
    ("profile-prompts-not-utf8", ["profile", "--model", "tiny-qwen3", "--prompts", "{files}/latin1.jsonl",
                                  "--out", "{tmp}/profile"], "not UTF-8", True),
    ("eval-data-not-utf8", ["eval", "--model", "tiny-qwen3", "--data", "{files}/latin1.jsonl"], "not UTF-8", True),
    ("train-data-not-utf8", [*TRAIN[:4], "{files}/latin1.jsonl", *TRAIN[5:]], "not UTF-8", True),
    ("config-not-utf8", ["generate", "--config", "{files}/latin1.yaml"], "not UTF-8", True),
    ("calibrate-profile-not-utf8", ["calibrate", "--profile", "{files}/latin1.json", "--out", "{tmp}/s.json"],
     "not UTF-8", True),
    ("gguf-garbage", GEN[:1] + ["--model", "{files}/garbage.gguf", "--prompt", "x"], "GGUF", False),
    ("gguf-truncated-header", GEN[:1] + ["--model", "{files}/truncated-header.gguf", "--prompt", "x"],
     "cannot load model", False),
    ("gguf-truncated-data", GEN[:1] + ["--model", "{files}/truncated-data.gguf", "--prompt", "x"],
     "cannot load model", False),
    ("gguf-empty", GEN[:1] + ["--model", "{files}/empty.gguf", "--prompt", "x"], "is empty", False),
    ("safetensors-truncated", GEN[:1] + ["--model", "{files}/hf-truncated", "--prompt", "x"],
     "cannot load model", False),
    ("safetensors-garbage", GEN[:1] + ["--model", "{files}/hf-garbage", "--prompt", "x"], "cannot load model", False),
    ("config-json-invalid", GEN[:1] + ["--model", "{files}/hf-bad-config", "--prompt", "x"], "config", False),
    ("weights-missing", GEN[:1] + ["--model", "{files}/hf-no-weights", "--prompt", "x"], "model.safetensors", False),
    ("architecture-unknown", GEN[:1] + ["--model", "{files}/hf-unknown-arch", "--prompt", "x"], "no-such-arch",
     False),
    ("cost-architecture-unknown", ["cost", "--model", "{files}/hf-unknown-arch", "--schedule", "const:64"],
     "no-such-arch", True),
    ("prompts-out-is-directory", ["prompts", "--model", "tiny-qwen3", "--count", "1", "--min-tokens", "8",
                                  "--out", "{files}/a-dir"], "is a directory", True),
    ("prompts-out-under-file", ["prompts", "--model", "tiny-qwen3", "--count", "1", "--min-tokens", "8",
                                "--out", "{files}/a-file/p.jsonl"], "which is a file", True),
    ("calibrate-out-is-directory", ["calibrate", "--profile", "{files}/no-bins.json", "--out", "{files}/a-dir"],
     "is a directory", True),
    ("profile-out-is-file", ["profile", "--model", "tiny-qwen3", "--prompts", "{files}/prompts.jsonl",
                             "--out", "{files}/a-file"], "is an existing file", True),
    ("report-out-is-file", ["report", "{files}/run-missing-fields", "--out", "{files}/a-file"],
     "is an existing file", True),
    ("calibrate-schedule-without-bins", ["calibrate", "--profile", "{files}/no-bins.json", "--out", "{tmp}/s.json"],
     "no 'bins'", True),
    ("calibrate-profile-is-list", ["calibrate", "--profile", "{files}/list.json", "--out", "{tmp}/s.json"],
     "holds a JSON list", True),
    ("report-run-missing-fields", ["report", "{files}/run-missing-fields", "--out", "{tmp}/report"],
     "metrics.jsonl:1: no number under 'reward/mean'", True),
    ("generate-temperature-inf", GEN + ["--prompt", "x", "--temperature", "inf"], "temperature", True),
    ("generate-seed-negative", GEN + ["--prompt", "x", "--seed", "-1"], "seed", True),
    ("eval-threshold-nan", ["eval", "--model", "tiny-qwen3", "--data", "{files}/data.jsonl", "--reward",
                            "first_number", "--threshold", "nan"], "threshold", True),
    ("cost-kv-bytes-inf", ["cost", "--schedule", "const:64", "--kv-bytes", "inf"],
     "kv_bytes must be a finite number > 0 and <= 64, got inf", True),
    ("prompts-file-is-directory", GEN + ["--prompts", "{files}/a-dir"], "is a directory", True),
    ("profile-prompts-is-directory", ["profile", "--model", "tiny-qwen3", "--prompts", "{files}/a-dir"],
     "is a directory", True),
]

TRAIN_CASES = [
    ("train-learning-rate-nan", TRAIN + ["--learning-rate", "nan"], "learning_rate", True),
    ("train-weight-decay-negative", TRAIN + ["--weight-decay", "-1"], "weight_decay", True),
    ("train-tau-above-one", TRAIN + ["--tau", "2"], "tau", True),
    ("train-one-generation", TRAIN + ["--num-generations", "1"], "num_generations", True),
    ("train-mini-batches-above-batch", TRAIN + ["--mini-batches", "8"], "mini_batches", True),
    ("train-tis-mode-unknown", TRAIN + ["--tis-mode", "bogus"], "tis_mode", True),
    ("train-tis-cap-negative", TRAIN + ["--tis-cap", "-1"], "tis_cap", True),
    ("train-tis-cap-zero", TRAIN + ["--tis-cap", "0"], "tis_cap", True),
    ("train-tis-cap-nan", TRAIN + ["--tis-cap", "nan"], "tis_cap", True),
    ("train-clip-low-negative", TRAIN + ["--clip-low", "-1"], "clip_low", True),
    ("train-clip-low-nan", TRAIN + ["--clip-low", "nan"], "clip_low", True),
    ("train-clip-high-negative", TRAIN + ["--clip-high", "-1"], "clip_high", True),
    ("train-dual-clip-below-one", TRAIN + ["--dual-clip", "0.5"], "dual_clip", True),
    ("train-temperature-zero", TRAIN + ["--temperature", "0"], "temperature", True),
    ("train-reward-weight-nan", TRAIN + ["--reward-weights", "nan"], "weight", True),
    ("train-math-reward-without-answers", [*TRAIN[:4], "{files}/no-answers.jsonl", "--reward", "math", *TRAIN[7:]],
     "answer", True),
    ("train-output-dir-is-file", TRAIN + ["--output-dir", "{files}/a-file"], "a-file", True),
]

def _param(case):
    return pytest.param(*case[1:], id=case[0])


@pytest.fixture
def no_model_loading(monkeypatch):
    """Make every reference to the model loader fail the test if called."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the model was loaded ({args}), though the bad input was known before")

    original = models.load_model
    for module in [m for name, m in sys.modules.items() if name.startswith("sparrow") and m is not None]:
        if getattr(module, "load_model", None) is original:
            monkeypatch.setattr(module, "load_model", refuse)
    assert sparrow.load_model is refuse


def check_refused(argv, message, before_load, files, tmp_path, monkeypatch, capsys, request) -> None:
    """Run `argv` ({files} and {tmp} filled in) in `tmp_path`: it must end in exit code 2 and one line
    `sparrow CMD: error: ...` holding `message` ({files} filled in), no traceback, and no model loaded when
    `before_load`."""
    monkeypatch.chdir(tmp_path)
    if before_load:
        request.getfixturevalue("no_model_loading")
    code = main([a.format(files=files, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"sparrow {argv[0]}: error: "), err
    assert message.replace("{files}", str(files)) in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, message, before_load", [_param(c) for c in CASES + TRAIN_CASES])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, before_load, files, tmp_path, monkeypatch, capsys,
                                               request):
    check_refused(argv, message, before_load, files, tmp_path, monkeypatch, capsys, request)


def test_an_error_during_generation_starts_on_a_fresh_line_after_the_progress_bar(monkeypatch, capsys):
    def fails(*args, **kwargs):
        raise SparrowError("non-finite logits at decode step 1")

    monkeypatch.setattr(RolloutEngine, "decode_step", fails)
    assert main(GEN + ["--prompt", "hello", "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "generating" in err  # the bar was drawn (progress is on without --json)
    assert err.endswith("\nsparrow generate: error: non-finite logits at decode step 1\n"), err


def test_a_failed_write_is_one_line_naming_the_file(files, tmp_path, monkeypatch, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schedules": {"const:64": {
        "budgets": [{"start": 0, "kv_budget": 64}],
        "bins": [{"bin": 0, "start": 0, "end": 256, "count": 100, "p5": 0.95}]}}}))

    def disk_full(schedule, path, page_size):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("sparrow.cli.calibrate.write_schedule_json", disk_full)
    out = tmp_path / "s.json"
    assert main(["calibrate", "--profile", str(profile), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"sparrow calibrate: error: {str(out)!r}: No space left on device\n"


def test_a_closed_stdout_ends_quietly(monkeypatch, capsys):
    """`sparrow generate --json | head -c 10`: the reader goes away; no traceback and no message, the exit code
    a shell shows for SIGPIPE, and the interpreter's last flush at exit cannot fail either."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(GEN + ["--prompt", "hi", "--num-samples", "2", "--max-new-tokens", "4", "--json"]) == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""
    stdout.write("more output at exit\n")
    stdout.close()  # flushes into /dev/null now instead of raising BrokenPipeError
