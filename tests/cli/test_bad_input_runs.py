"""Bad input around runs and outputs: damaged or changed run directories, a full disk
during a checkpoint, unwritable outputs, schedules calibrate writes, and SPARROW_VLLM_* variables against the
command's options. Each ends as `sparrow CMD: error: MESSAGE` on one stderr line with exit code 2."""

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from sparrow import models
from sparrow.attention import SparseConfig
from sparrow.cli import main
from sparrow.errors import SparrowError
from sparrow.io import atomic_write_text
from sparrow.rl.run_dir import check_resume_data, repair_metrics
from sparrow.schedules import DENSE, const
from sparrow.vllm import env as plugin_env

ROWS = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(4)]
TRAIN = ["train", "--model", "tiny-qwen3", "--reward", "first_number", "--steps", "2", "--save-every", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4", "--schedule", "const:48"]


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train(*extra: str) -> list[str]:
    """Relative paths, so that a copied run is the same run (run from the folder holding it)."""
    return [*TRAIN, "--data", "data.jsonl", "--output-dir", "run", *extra]


def _one_error(capsys, command: str) -> str:
    """The single stderr line of a refused command, without its `sparrow CMD: error: ` prefix."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    prefix = f"sparrow {command}: error: "
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0][len(prefix):]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A two-step tiny run with checkpoints 1 and 2, copied by each test that changes it."""
    root = tmp_path_factory.mktemp("finished")
    _write_rows(root / "data.jsonl", ROWS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert main(_train()) == 0
    return root


@pytest.fixture
def run_copy(finished_run, tmp_path, monkeypatch) -> Path:
    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded, though the bad input was known before")

    original = models.load_model
    for module in [m for name, m in sys.modules.items() if name.startswith("sparrow") and m is not None]:
        if getattr(module, "load_model", None) is original:
            monkeypatch.setattr(module, "load_model", refuse)


# 1. binary bytes in metrics.jsonl

def test_binary_bytes_inside_the_metrics_log_are_one_message_naming_file_and_line(run_copy, capsys):
    metrics = Path("run/metrics.jsonl")
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0] + b"\x00\xff\xfe\x9c binary\n" + lines[1])
    assert main(_train("--resume")) == 2
    assert _one_error(capsys, "train") == "run/metrics.jsonl:2: not UTF-8 text"


def test_a_binary_torn_tail_of_the_metrics_log_is_cut_off_as_any_torn_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1}\n{"step": 2}\n' + b"\xff\xfe\x00\x9c{\"st")  # no newline: a write cut short
    assert repair_metrics(metrics, 2) == 1
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_torn_metrics_line_is_one_warning_line_in_report(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/m')
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"warning: {run / 'metrics.jsonl'}:1: skipped a torn last line (a write cut short, e.g. by a kill)"
    assert err[1].startswith("sparrow report: error: ") and len(err) == 2


@pytest.mark.parametrize("steps, message", [((1, 2, 2), ":3: step 2 comes after step 2"),
                                            ((-1,), ":1: step -1 is negative")])
def test_report_refuses_a_log_whose_steps_repeat_or_go_below_0(tmp_path, capsys, steps, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps))
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


# 2. a full disk while a checkpoint is written

def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes_from_the_previous(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    _write_rows(Path("data.jsonl"), ROWS)
    real_save = torch.save

    def disk_full_at_checkpoint_2(obj, f, *args, **kwargs):
        if ".checkpoint-2." in str(f):
            Path(f).write_bytes(b"PK\x03\x04 half")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_checkpoint_2)
    assert main(_train()) == 2
    run = Path("run")
    assert _one_error(capsys, "train") == (f"no space left on device while writing {run / 'checkpoint-2'}; nothing "
                                           "of it was kept: free some space, then --resume continues from the last "
                                           "complete checkpoint")
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    monkeypatch.setattr(torch, "save", real_save)
    assert main(_train("--resume")) == 0
    assert f"resumed from {run / 'checkpoint-1'} at step 1" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# 3. a data file changed between a run and its resume

@pytest.mark.parametrize("change, what", [
    (lambda rows: rows[::-1], "same size and rows, but rows reordered or edited"),
    (lambda rows: rows + [{"prompt": "9 + 1 =", "answer": "10"}], "bytes 148 -> 186, rows 4 -> 5"),
], ids=["reordered", "added"])
def test_a_resume_on_changed_data_is_refused_naming_the_file(run_copy, change, what, capsys, no_model_loading):
    _write_rows(Path("data.jsonl"), change(ROWS))
    assert main(_train("--resume", "--steps", "3")) == 2
    assert _one_error(capsys, "train") == (
        f"data file 'data.jsonl' changed since run/checkpoint-2 was saved ({what}); a resumed "
        "run would draw other prompts than the run so far: restore the file, or pass --allow-changes to continue "
        "on the changed data")


def test_allow_changes_accepts_changed_data_and_says_so(run_copy, capsys):
    _write_rows(Path("data.jsonl"), ROWS[::-1])
    assert main(_train("--resume", "--allow-changes")) == 0
    assert ("resuming with a changed option: data file 'data.jsonl': same size and rows, but rows reordered or "
            "edited") in capsys.readouterr().out
    saved = {"path": "d.jsonl", "bytes": 1, "rows": 1, "sha256": "a"}
    assert check_resume_data(saved, dict(saved), False) == []
    assert check_resume_data(None, saved, False) == []  # a checkpoint from before fingerprints


# 4. outputs in a directory that cannot be written

@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A directory this process cannot write in (as root, where permissions do not bind, access(2) says so)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != folder and real(p, mode, **kw))
    yield folder
    folder.chmod(0o755)


PROFILE = {"meta": {"bin_size": 16, "sparse": {"page_size": 16, "sink_pages": 1, "recent_pages": 2}},
           "schedules": {"dense": {"bins": [{"bin": k, "start": 16 * k, "end": 16 * k + 16, "count": 100, "p5": 1.0}
                                            for k in range(4)]}}}


@pytest.mark.parametrize("command", ["prompts", "calibrate"])
def test_an_output_in_a_read_only_directory_is_refused_before_the_work(command, read_only, tmp_path, capsys,
                                                                       no_model_loading):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    out = read_only / "out.json"
    argv = {"prompts": ["prompts", "--model", "tiny-qwen3", "--count", "1", "--min-tokens", "8", "--out", str(out)],
            "calibrate": ["calibrate", "--profile", str(tmp_path / "profile.json"), "--out", str(out)]}[command]
    assert main(argv) == 2
    assert _one_error(capsys, command) == (f"output file {str(out)!r} cannot be written: directory {str(read_only)!r}"
                                           " is not writable (read-only or no permission); expected a path in a "
                                           "writable directory")


def test_a_failed_write_names_the_output_not_its_hidden_temporary_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    out = tmp_path / "s.json"

    def denied(dir, prefix, suffix):
        raise PermissionError(errno.EACCES, "Permission denied", f"{dir}/{prefix}x1y2{suffix}")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(PermissionError) as caught:
        atomic_write_text(out, "x")
    assert caught.value.filename == str(out)
    assert main(["calibrate", "--profile", str(tmp_path / "profile.json"), "--out", str(out)]) == 2
    assert _one_error(capsys, "calibrate") == f"{str(out)!r}: Permission denied"


# 5. calibrate on short bins

def test_calibrate_on_16_token_bins_writes_a_schedule_every_command_accepts(tmp_path, capsys):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    out = tmp_path / "s.json"
    assert main(["calibrate", "--profile", str(tmp_path / "profile.json"), "--out", str(out)]) == 0
    assert "schedule: 0:48, 48:64" in capsys.readouterr().out
    assert main(["schedule", "show", str(out)]) == 0


def test_a_refused_schedule_says_which_rule_it_breaks(capsys):
    assert main(["schedule", "show", "0:16,16:32"]) == 2
    assert _one_error(capsys, "schedule") == (
        "schedule '0:16,16:32': bin 0 budget 16 is below 48 tokens (the 3 always-kept pages of 16 tokens); every "
        "budget must cover the pages each sparse step keeps (sink and recent)")
    with pytest.raises(SparrowError, match="every budget must be whole pages"):
        const(50).validate(16, 3)


# 6. SPARROW_VLLM_* variables against --backend vllm's options

@pytest.mark.parametrize("env, message", [
    ({"SPARROW_VLLM_PAGE_SIZE": "32"}, ("SPARROW_VLLM_PAGE_SIZE='32' disagrees with the command's --page-size 16: "
     "with --backend vllm the command's options configure Sparrow's vLLM plugin; unset SPARROW_VLLM_PAGE_SIZE or "
     "pass --page-size 32")),
    ({"SPARROW_VLLM_PAGE_SIZE": "x"}, "SPARROW_VLLM_PAGE_SIZE='x': expected a positive integer"),
    ({"SPARROW_VLLM_SCHEDULE": "bogus"}, "SPARROW_VLLM_SCHEDULE='bogus': unknown schedule 'bogus'"),
    ({"SPARROW_VLLM_LANDMARK": "quest"}, ("SPARROW_VLLM_LANDMARK='quest' disagrees with the command's --landmark "
     "'centroid'")),
], ids=["page-size-disagrees", "page-size-invalid", "schedule-invalid", "landmark-disagrees"])
def test_a_users_plugin_variable_that_is_bad_or_disagrees_is_refused(env, message):
    with pytest.raises(SparrowError) as caught:
        plugin_env.check_environment(SparseConfig(), env)
    assert str(caught.value).startswith(message)


def test_a_users_plugin_schedule_must_be_the_commands():
    assert plugin_env.check_environment(SparseConfig(), {"SPARROW_VLLM_PAGE_SIZE": "16"}) is None
    wanted = plugin_env.check_environment(SparseConfig(), {"SPARROW_VLLM_SCHEDULE": "const:64"})
    plugin_env.check_schedule(wanted, const(64))
    with pytest.raises(SparrowError, match="SPARROW_VLLM_SCHEDULE='const:64' disagrees with the command's schedule "
                                           "'dense'"):
        plugin_env.check_schedule(wanted, DENSE)


def test_generate_with_backend_vllm_refuses_a_disagreeing_variable_before_vllm_starts(tmp_path, monkeypatch, capsys):
    model, tokenizer = models.load_model("tiny-qwen3")
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("SPARROW_VLLM_PAGE_SIZE", "32")
    monkeypatch.setattr("sparrow.rollout.vllm_backend.check_vllm", lambda: pytest.fail("vLLM was started"))
    assert main(["generate", "--backend", "vllm", "--model", str(tmp_path / "hf"), "--prompt", "x"]) == 2
    assert _one_error(capsys, "generate").startswith("SPARROW_VLLM_PAGE_SIZE='32' disagrees with the command's "
                                                     "--page-size 16")


ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    """A script of scripts/ as a module, to run its main() in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def records(tmp_path) -> Path:
    """A copy of the records scripts/plots.py reads."""
    plots = _script("plots")
    copy = tmp_path / "records"
    for name in [*plots.ENGINE_RECORDS, *plots.VLLM_RECORDS, plots.PROFILE]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "benchmarks" / name, copy / name)
    for run in plots.LONG_TASK_RUNS.values():
        shutil.copytree(ROOT / "benchmarks" / run, copy / run)
    return copy


def _plots_error(capsys, *argv: str) -> str:
    assert _script("plots").main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plots: error: ") and "Traceback" not in err, err
    return lines[0][len("plots: error: "):]


def test_plots_say_what_is_wrong_with_their_records_and_output_in_one_line(records, tmp_path, capsys):
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    assert _plots_error(capsys, "--records", str(missing), "--out", str(tmp_path / "img")) == (
        f"records folder {str(missing)!r} does not exist")
    assert _plots_error(capsys, "--records", str(empty), "--out", str(tmp_path / "img")).startswith(
        f"records folder {str(empty)!r} holds none of the records the figures read")
    (tmp_path / "a-file").write_text("x")
    assert _plots_error(capsys, "--records", str(records), "--out", str(tmp_path / "a-file")) == (
        f"--out {str(tmp_path / 'a-file')!r} is an existing file; expected a directory (existing or new)")
    engine = records / _script("plots").ENGINE_RECORDS[0]
    engine.write_text(engine.read_text() + '{"config": "dense", "batch\n')
    assert _plots_error(capsys, "--records", str(records), "--out", str(tmp_path / "img")).startswith(
        f"{engine}:")
    assert not (tmp_path / "img" / "decode-speed.png").exists()


def test_plots_on_a_full_disk_end_in_one_line_naming_the_file(records, tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    def full(self, path, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "img"
    assert _plots_error(capsys, "--records", str(records), "--out", str(out)) == (
        f"{str(out / 'decode-speed.png')!r}: No space left on device")


def test_the_release_check_on_a_file_that_is_not_a_wheel_is_one_line(tmp_path, capsys):
    fake = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    fake.write_text("not a zip archive")
    assert _script("check_vllm_release").main([str(fake)]) == 2
    assert capsys.readouterr().err == (f"check_vllm_release: error: {str(fake)!r} is not a wheel (not a zip "
                                       "archive); expected a vLLM .whl file\n")
    assert _script("check_vllm_release").main([str(tmp_path / "missing.whl")]) == 2
    assert capsys.readouterr().err == (f"check_vllm_release: error: {str(tmp_path / 'missing.whl')!r} does not "
                                       "exist\n")


def test_sigterm_ends_a_long_generate_as_ctrl_c_does_keeping_every_finished_line(tmp_path):
    """`generate --json` over many prompts, terminated once its first two calls are done: exit 143, one line, and
    the finished completions on stdout, each a whole JSON line."""
    import signal
    import subprocess
    import time

    prompts = tmp_path / "prompts.jsonl"
    _write_rows(prompts, [{"prompt": f"{i} + 1 ="} for i in range(400)])
    run = subprocess.Popen([sys.executable, "-m", "sparrow.cli", "generate", "--model", "tiny-qwen3", "--prompts",
                            str(prompts), "--json", "--max-new-tokens", "4", "--max-batch-size", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    err = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sum("prompts done" in line for line in err) < 2:  # the first call printed
        err.append(run.stderr.readline())
        if not err[-1]:
            break
    run.send_signal(signal.SIGTERM)
    out, rest = run.communicate(timeout=300)
    err = "".join(err) + rest
    assert run.returncode == 143, err
    assert err.endswith("sparrow generate: terminated\n") and "Traceback" not in err, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert 16 <= len(rows) < 400 and out.endswith("\n")
    assert [row["prompt_index"] for row in rows] == list(range(len(rows)))
