"""Environment variables are read strictly (issue 36): a value that is not understood is refused with one line naming
the variable, the value and what is accepted; on the command line with exit code 2 before any model loads.
"""

import pytest

from sparrow import huge_pages
from sparrow.attention import SparseConfig
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
        "SPARROW_VLLM_SCHEDULE='@a-dir': schedule file 'a-dir' is a directory; expected a JSON schedule file")
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


def test_a_schedule_version_going_backwards_is_refused_unless_a_new_run_starts_the_file_over(tmp_path):
    path = tmp_path / "schedule.json"
    write_schedule_json(const(64), path, version=5)
    with pytest.raises(SparrowError) as caught:
        write_schedule_json(const(128), path, version=3)
    assert str(caught.value) == (
        f"schedule file {str(path)!r} holds version 5; refusing to write version 3 over it: versions only go up (the "
        "plugin reports the version in force), so write the next one, or pass restart=True to start the file over "
        "for a new run")
    assert read_schedule_file(path) == (const(64), 5)  # the refused write left the file as it was
    write_schedule_json(const(128), path, version=1, restart=True)
    assert read_schedule_file(path) == (const(128), 1)


def test_plugin_dense_layers_past_the_models_layers_are_refused_at_engine_start():
    with pytest.raises(SparrowError) as caught:
        check_layers(SparseConfig(dense_layers=(0, 5)), 4, {"SPARROW_VLLM_DENSE_LAYERS": "0,5"})
    assert str(caught.value) == ("SPARROW_VLLM_DENSE_LAYERS='0,5' names layer 5, but the model's layer count is 4; "
                                 "expected dense layer indices from 0 to 3")
    with pytest.raises(SparrowError, match=r"^SPARROW_VLLM_DENSE_LAYERS='0,1' names layer 1, but the model's layer "
                                           r"count is 1; expected dense layer indices from 0 to 0$"):
        check_layers(SparseConfig(), 1, {})  # unset: its default
    check_layers(SparseConfig(dense_layers=(0, 3)), 4, {})
