"""Environment variables are read strictly: a value that is not understood is refused with one line naming
the variable, the value and what is accepted; on the command line with exit code 2 before any model loads.
"""

import json

import pytest

from sparrow.attention import SparseConfig
from sparrow.cpu import huge_pages
from sparrow.errors import SparrowError
from sparrow.io import env_flag, env_int
from sparrow.schedules import const, parse_schedule, read_schedule_file, write_schedule_json
from sparrow.vllm import env as plugin_env
from sparrow.vllm.checks import check_layers
from tests.cli.test_bad_input import check_refused, no_model_loading  # noqa: F401 (the fixture)

YES_NO = "or 0 (or true/false, yes/no, on/off)"
GEN = ["generate", "--model", "tiny-qwen3", "--prompt", "x", "--max-new-tokens", "2"]


def test_a_flag_takes_the_usual_words_for_yes_and_no_and_refuses_anything_else():
    for word, value in (("1", True), (" TRUE ", True), ("yes", True), ("On", True), ("0", False), ("false", False),
                        ("no", False), ("OFF", False)):
        assert env_flag("SPARROW_X", not value, environ={"SPARROW_X": word}) is value
    assert env_flag("SPARROW_X", True, environ={}) is True
    assert env_flag("SPARROW_X", False, environ={"SPARROW_X": " "}) is False
    with pytest.raises(SparrowError) as caught:
        env_flag("SPARROW_X", True, "do it", environ={"SPARROW_X": "2"})
    assert str(caught.value) == f"SPARROW_X='2': expected 1 (do it) {YES_NO}"


def test_an_integer_variable_is_an_integer_at_least_its_minimum():
    assert env_int("SPARROW_N", 16, minimum=1, environ={"SPARROW_N": " 32 "}) == 32
    assert env_int("SPARROW_N", 16, minimum=1, environ={}) == 16
    for value, expected in (("x", "a positive integer"), ("0", "a positive integer"), ("1.5", "a positive integer")):
        with pytest.raises(SparrowError) as caught:
            env_int("SPARROW_N", 16, minimum=1, environ={"SPARROW_N": value})
        assert str(caught.value) == f"SPARROW_N={value!r}: expected {expected}"
    with pytest.raises(SparrowError, match=r"^SPARROW_N='-3': expected an integer >= 0$"):
        env_int("SPARROW_N", 1, minimum=0, environ={"SPARROW_N": "-3"})


def test_huge_pages_off_in_words_turns_them_off(monkeypatch):
    for word in ("off", "false", "no", "0"):
        monkeypatch.setenv("SPARROW_HUGE_PAGES", word)
        assert not huge_pages.enabled()
    monkeypatch.setenv("SPARROW_HUGE_PAGES", "maybe")
    with pytest.raises(SparrowError, match="SPARROW_HUGE_PAGES='maybe': expected 1"):
        huge_pages.enabled()


@pytest.mark.parametrize("name, value, message", [
    ("SPARROW_HUGE_PAGES", "maybe", f"SPARROW_HUGE_PAGES='maybe': expected 1 (huge pages for KV caches) {YES_NO}"),
    ("SPARROW_CPU_KERNEL", "maybe",
     f"SPARROW_CPU_KERNEL='maybe': expected 1 (the compiled CPU decode kernel) {YES_NO}"),
    ("SPARROW_PACKED_LINEAR", "of",
     f"SPARROW_PACKED_LINEAR='of': expected 1 (oneDNN-packed linear weights) {YES_NO}"),
    ("SPARROW_FUSED_LAYERS", "fused",
     f"SPARROW_FUSED_LAYERS='fused': expected 1 (the fused decoder layers) {YES_NO}"),
    ("SPARROW_UNSAFE_CODE_REWARD", "sure",
     f"SPARROW_UNSAFE_CODE_REWARD='sure': expected 1 (allow code rewards without a sandbox) {YES_NO}"),
    ("SPARROW_CACHE", "{tmp}/a-file", "SPARROW_CACHE='{tmp}/a-file': not a directory; expected a directory"),
], ids=["huge-pages", "cpu-kernel", "packed-linear", "fused-layers", "unsafe-code-reward", "cache-is-a-file"])
def test_a_variable_not_understood_is_refused_before_the_model_loads(name, value, message, tmp_path, monkeypatch,
                                                                     capsys, request):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv(name, value.format(tmp=tmp_path))
    check_refused(GEN, message.format(tmp=tmp_path), True, tmp_path, tmp_path, monkeypatch, capsys, request)


# SPARROW_VLLM_*: read by the plugin in each vLLM process, and by --backend vllm before vLLM starts

def _refused(env: dict) -> str:
    with pytest.raises(SparrowError) as caught:
        plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": "const:256", **env})
    return str(caught.value)


def test_plugin_variables_not_understood_are_refused_by_name(tmp_path, monkeypatch):
    for layers in ("-1", "0,-2", "a"):
        assert _refused({"SPARROW_VLLM_DENSE_LAYERS": layers}) == (
            f"SPARROW_VLLM_DENSE_LAYERS={layers!r}: expected comma-separated layer indices >= 0, e.g. '0,1' "
            "(empty: no dense layer)")
    assert _refused({"SPARROW_VLLM_PAGE_SIZE": "0"}) == "SPARROW_VLLM_PAGE_SIZE='0': expected a positive integer"
    assert plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": "const:256",
                                           "SPARROW_VLLM_DENSE_LAYERS": ""}).sparse.dense_layers == ()
    assert _refused({"SPARROW_VLLM_SCHEDULE": "@"}) == (
        "SPARROW_VLLM_SCHEDULE='@': expected @PATH, the path of a JSON schedule file to follow, after the @")
    (tmp_path / "a-dir").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _refused({"SPARROW_VLLM_SCHEDULE": "@a-dir"}) == (
        "SPARROW_VLLM_SCHEDULE='@a-dir': schedule file 'a-dir' is a directory; expected a file")
    assert _refused({"SPARROW_VLLM_SCHEDULE": "@missing"}) == (
        "SPARROW_VLLM_SCHEDULE='@missing': schedule file 'missing' does not exist")
    write_schedule_json(parse_schedule("const:64"), tmp_path / "plain", version=1)
    followed = plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": "@plain"})  # a name without .json or /
    assert (followed.schedule.budgets, followed.version) == ((64,), 1)


def test_backend_vllm_refuses_a_followed_file_it_would_overwrite(tmp_path):
    path = tmp_path / "schedule.json"
    write_schedule_json(parse_schedule("const:64"), path, version=1)
    with pytest.raises(SparrowError) as caught:
        plugin_env.check_environment(SparseConfig(), {"SPARROW_VLLM_SCHEDULE": f"@{path}"})
    assert str(caught.value) == (
        f"SPARROW_VLLM_SCHEDULE='@{path}' asks the plugin to follow a schedule file, which --backend vllm does not "
        "do: the command's --schedule sets the plugin's schedule; unset SPARROW_VLLM_SCHEDULE (to run the file's "
        f"schedule, pass --schedule {path})")


def test_a_schedule_file_the_plugin_would_refuse_is_refused_when_written(tmp_path):
    with pytest.raises(SparrowError) as caught:
        write_schedule_json(parse_schedule("const:32", 16, 0), tmp_path / "schedule.json", version=1)
    assert str(caught.value).startswith("schedule 'const:32': bin 0 budget 32 is below 48 tokens (the 3 always-kept "
                                        "pages of 16 tokens)")
    assert not (tmp_path / "schedule.json").exists()


def test_a_schedule_version_going_backwards_is_refused(tmp_path):
    path = tmp_path / "schedule.json"
    write_schedule_json(const(64), path, version=5)
    with pytest.raises(SparrowError) as caught:
        write_schedule_json(const(128), path, version=3)
    assert str(caught.value) == (
        f"schedule file {str(path)!r} holds version 5; refusing to write version 3 over it: versions only go up (the "
        "plugin reports the version in force), so write the next one")
    assert read_schedule_file(path) == (const(64), 5)  # the refused write left the file as it was
    write_schedule_json(const(128), path, version=6)
    assert read_schedule_file(path) == (const(128), 6)


def test_plugin_dense_layers_past_the_models_layers_are_refused_at_engine_start():
    with pytest.raises(SparrowError) as caught:
        check_layers(SparseConfig(dense_layers=(0, 5)), 4, {"SPARROW_VLLM_DENSE_LAYERS": "0,5"})
    assert str(caught.value) == ("SPARROW_VLLM_DENSE_LAYERS='0,5' names layer 5, but the model's layer count is 4; "
                                 "expected dense layer indices from 0 to 3")
    with pytest.raises(SparrowError, match=r"^SPARROW_VLLM_DENSE_LAYERS='0,1' names layer 1, but the model's layer "
                                           r"count is 1; expected dense layer indices from 0 to 0$"):
        check_layers(SparseConfig(), 1, {})  # unset: its default
    check_layers(SparseConfig(dense_layers=(0, 3)), 4, {})


@pytest.mark.parametrize("version, bins, message", [
    (1, [{"start": 0, "kv_budget": 64}], "version 1 is below version 2 in force; versions only go up"),
    (2, [{"start": 0, "kv_budget": 128}], "bins differ from those of version 2 in force under the same version; a "
                                          "change of bins takes a version above 2"),
    (3, [{"start": 0, "kv_budget": 16 * 10**18}], "bin 0 budget 16000000000000000000 is out of range"),
])
def test_a_followed_file_whose_version_goes_back_or_stays_with_other_bins_is_refused(version, bins, message,
                                                                                     tmp_path, caplog):
    """The plugin's follower: a rewrite must raise the version with any change of bins; the schedule in force
    stays, with one logged line naming the file."""
    from sparrow.vllm.state import PluginState

    path = tmp_path / "schedule.json"
    write_schedule_json(const(256), path, version=2)
    state = PluginState()
    state.activate(plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"}))
    assert state.active().version == 2
    path.write_text(json.dumps({"version": version, "bins": bins}))
    with caplog.at_level("WARNING", logger="sparrow.vllm"):
        kept = state.active()
    assert (kept.schedule.budgets, kept.version) == ((256,), 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "sparrow.vllm"]
    assert len(lines) == 1 and f"schedule file {str(path)!r}: " in lines[0] and message in lines[0], lines
    path.write_text(json.dumps({"version": 2, "bins": [{"start": 0, "kv_budget": 256}]}))  # those in force: no change
    assert (state.active().schedule.budgets, state.active().version) == ((256,), 2)
    write_schedule_json(const(128), path, version=3)
    assert (state.active().schedule.budgets, state.active().version) == ((128,), 3)


def test_every_reader_of_a_schedule_file_goes_through_the_one_check(tmp_path, monkeypatch, capsys):
    """The command line's --schedule FILE, `schedule show`, cost, calibrate (exact mode parses each profiled schedule,
    here one given as a file), the vLLM plugin's follower and TRL's run-time schedule (the plugin's report) each call
    check_schedule_file."""
    from sparrow.cli import main
    from sparrow.integrations import schedule_file
    from sparrow.integrations.config import SparrowConfig
    from sparrow.schedules import files as schedule_files
    from sparrow.schedules import runtime
    from sparrow.vllm.state import PluginState

    seen = []
    original = schedule_files.check_schedule_file

    def spy(data, where, *args, **kwargs):
        seen.append(where)
        return original(data, where, *args, **kwargs)

    monkeypatch.setattr(schedule_files, "check_schedule_file", spy)
    monkeypatch.setattr(runtime, "check_schedule_file", spy)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    write_schedule_json(const(64), good, version=1)
    bad.write_text(json.dumps({"bins": [{"start": 0, "kv_budget": 64, "topk": 1}]}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"meta": {"model": "tiny-qwen3"}, "schedules": {"file": {"spec": str(bad), "bins": [
        {"bin": 0, "start": 0, "end": 256, "count": 100, "p5": 0.95, "mean": 0.97}]}}}))
    commands = {
        "generate": ["generate", "--model", "tiny-qwen3", "--prompt", "x", "--schedule", str(bad)],
        "schedule show": ["schedule", "show", str(bad)],
        "cost": ["cost", "--schedule", str(bad)],
        "calibrate": ["calibrate", "--rollout-mode", "exact", "--profile", str(profile), "--out",
                      str(tmp_path / "s.json")],
    }
    for name, argv in commands.items():
        seen.clear()
        assert main(argv) == 2, name
        assert seen == [f"schedule file {str(bad)!r}"], name
        assert "bin 0 has unknown key 'topk'" in capsys.readouterr().err, name
    seen.clear()
    state = PluginState()
    state.activate(plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{good}"}))
    state.active()
    assert seen == [f"schedule file {str(good)!r}"] * 2  # at engine start and at its first step
    seen.clear()
    written = schedule_file.RunTimeSchedule(SparrowConfig(schedule="const:64"), good, 512, writer=True)
    runtime.write_status(good, const(64), 1, None)
    assert written.in_force()[:2] == (const(64), 1)
    assert len(seen) == 1 and seen[0].startswith("status file ")
