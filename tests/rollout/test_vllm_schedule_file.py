"""The plugin's run-time schedule: SPARROW_VLLM_SCHEDULE=@PATH, re-read when the file changes, a bad file refused
with one message while the previous schedule stays in force, the schedule in force reported beside the file.

The first tests drive `active()` directly (what the metadata builder calls once per engine step); the last run a
tiny model in vLLM on CPU, changing the file between generate calls, and stock vLLM beside it.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, const, parse_schedule, write_schedule_json
from sparrow.schedules import runtime as schedule_runtime
from sparrow.vllm import env as plugin_env
from sparrow.vllm import state as plugin_state
from tests.conftest import random_prompts, save_tiny_for_vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def followed(tmp_path):
    """A schedule file at const:64 (version 1), followed by the plugin in this process; restored afterwards."""
    path = tmp_path / "schedule.json"
    write_schedule_json(const(64), path, version=1)
    before = plugin_state.active()
    plugin_state.activate(plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"}))
    yield path
    plugin_state.activate(before)


def _bins(config):
    return list(zip(config.schedule.starts, config.schedule.budgets))


def test_a_written_schedule_is_in_force_at_the_next_step_and_reported_beside_the_file(followed):
    first = plugin_state.active()
    assert (_bins(first), first.version) == ([(0, 64)], 1)
    assert schedule_runtime.read_status(followed)["version"] == 1
    write_schedule_json(parse_schedule("0:64,512:128"), followed, version=2)
    now = plugin_state.active()
    assert (_bins(now), now.version, now.source) == ([(0, 64), (512, 128)], 2, followed)
    status = schedule_runtime.read_status(followed)
    assert (status["version"], status["bins"], status["refused"]) == (
        2, [{"start": 0, "kv_budget": 64}, {"start": 512, "kv_budget": 128}], None)
    write_schedule_json(DENSE, followed, version=3)
    assert plugin_state.active().schedule.is_dense and plugin_state.active().version == 3


def test_a_file_without_a_version_counts_its_changes(followed):
    plugin_state.active()
    followed.write_text(json.dumps([{"start": 0, "kv_budget": 96}]))
    assert (_bins(plugin_state.active()), plugin_state.active().version) == ([(0, 96)], 2)
    os.utime(followed, ns=(1, 1))  # touched, same content: the same schedule and version
    assert plugin_state.active().version == 2


def test_an_unchanged_file_is_not_read_again(followed, monkeypatch):
    plugin_state.active()
    reads = []
    original = schedule_runtime.read_schedule_file
    monkeypatch.setattr(schedule_runtime, "read_schedule_file", lambda *a, **k: reads.append(a) or original(*a, **k))
    for _ in range(5):
        plugin_state.active()
    assert reads == []
    write_schedule_json(const(128), followed, version=2)
    plugin_state.active()
    plugin_state.active()
    assert len(reads) == 1


@pytest.mark.parametrize("bad, named", [
    ('{"bins": [{"start": 0, "kv_budget": 20}]}', "budget 20 is not a positive multiple of the page size 16"),
    ('{"bins": [{"start": 0, "kv_bud', "is not valid JSON"),
    ('{"version": -1, "bins": []}', "version -1 is not an integer >= 0"),
    (None, "does not exist"),
])
def test_a_bad_file_mid_run_is_refused_once_and_the_previous_schedule_stays(followed, caplog, bad, named):
    plugin_state.active()
    if bad is None:
        followed.unlink()
    else:
        followed.write_text(bad)
    with caplog.at_level(logging.WARNING, logger="sparrow.vllm"):
        for _ in range(4):
            kept = plugin_state.active()
    assert (_bins(kept), kept.version) == ([(0, 64)], 1)
    messages = [r.getMessage() for r in caplog.records if r.name == "sparrow.vllm"]
    assert len(messages) == 1 and named in messages[0] and "version 1 (const:64) stays in force" in messages[0]
    assert named in schedule_runtime.read_status(followed)["refused"]
    write_schedule_json(const(256), followed, version=5)  # a good file again: in force, the refusal cleared
    assert (_bins(plugin_state.active()), plugin_state.active().version) == ([(0, 256)], 5)
    assert schedule_runtime.read_status(followed)["refused"] is None


def test_a_bad_file_at_engine_start_stops_with_one_message_naming_it(tmp_path):
    path = tmp_path / "schedule.json"
    path.write_text('{"bins": [{"start": 0, "kv_budget": 20}]}')
    with pytest.raises(SparrowError, match=r"SPARROW_VLLM_SCHEDULE='@.*schedule.json'.*budget 20"):
        plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"})
    with pytest.raises(SparrowError, match="does not exist"):
        plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{tmp_path / 'missing.json'}"})
    with pytest.raises(SparrowError, match="schedule version 'x' is not an integer >= 0"):
        write_schedule_json(const(64), path, version="x")


# -- in vLLM (CPU, tiny model, fresh process: the plugin reads its environment when vLLM loads it) ----------------

_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
from sparrow.schedules import parse_schedule, write_schedule_json
from sparrow.schedules import runtime as schedule_runtime

calls = {"n": 0}
try:
    from sparrow.vllm.cpu_attention import SparrowCPUAttentionImpl
    sparse_decode = SparrowCPUAttentionImpl._sparse_decode

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return sparse_decode(self, *args, **kwargs)

    SparrowCPUAttentionImpl._sparse_decode = counted
except (ImportError, AttributeError):
    calls["n"] = None

if __name__ == "__main__":
    path, prompts = sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048,
              logprobs_mode="processed_logprobs")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    rows = []
    steps = (("const:1024", None), ("const:64", 2), ("bad", None), ("const:1024", 3))
    stock = "SPARROW_VLLM_SCHEDULE" not in os.environ  # the plugin off: one call, no file
    for spec, version in steps[:1] if stock else steps:
        if spec == "bad":
            open(path, "w").write('{"bins": [{"start": 0, "kv_budget": 20}]}')
        elif version is not None:
            write_schedule_json(parse_schedule(spec), path, version=version)
        before = calls["n"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        status = {"version": None, "bins": None, "refused": None} if stock else schedule_runtime.read_status(path)
        rows.append({"logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                  for o in outs],
                     "version": status["version"], "bins": status["bins"], "refused": status["refused"],
                     "sparse_calls": None if before is None else calls["n"] - before})
    print("RESULT" + json.dumps(rows))
"""


def _run_script(tmp_path, plugin: bool) -> list[dict]:
    """The script's rows from a fresh process: with the plugin following a schedule file (covering budget,
    version 1, in force from engine start), or stock vLLM (the plugin's variables unset: one call)."""
    model = save_tiny_for_vllm(tmp_path / "tiny-llama")
    path = tmp_path / "schedule.json"
    write_schedule_json(const(1024), path, version=1)
    script = tmp_path / "follow.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in plugin_env.ENV_NAMES}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    if plugin:
        env.update(plugin_env.environment_for(SparseConfig(), f"@{path}"))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))  # ours only
    prompts = random_prompts([300, 517], seed=3)
    run = subprocess.run([sys.executable, str(script), str(model), str(path), json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("Sparrow's vLLM plugin refused") == plugin
    return json.loads(run.stdout.split("RESULT")[-1])


@pytest.fixture(scope="module")
def followed_in_vllm(tmp_path_factory):
    return _run_script(tmp_path_factory.mktemp("follow"), plugin=True)


def _gap(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"]) for x, y in zip(p, q))


def test_vllm_follows_the_schedule_file_between_generate_calls_and_refuses_a_bad_one(followed_in_vllm):
    """Covering budget (version 1), const:64 (version 2), a bad file (refused, with one message: const:64 stays),
    covering again (version 3): the sparse decode runs exactly in the calls whose schedule is sparse, the log-probs
    of the first and last calls agree, and the status file names the version each call decoded under."""
    covered, sparse, refused, again = followed_in_vllm
    assert [r["version"] for r in (covered, sparse, refused, again)] == [1, 2, 2, 3]
    assert refused["bins"] == [{"start": 0, "kv_budget": 64}] and "budget 20" in refused["refused"]
    assert _gap(covered, sparse) > 1e-3  # const:64 at 300+ tokens decodes sparsely
    assert sparse["logprobs"] == refused["logprobs"]  # the refused file changed nothing
    assert _gap(covered, again) < 1e-4
    if covered["sparse_calls"] is not None:  # the count where the backend still has `_sparse_decode`
        assert covered["sparse_calls"] == again["sparse_calls"] == 0
        assert sparse["sparse_calls"] >= 2 * 15 and refused["sparse_calls"] == sparse["sparse_calls"]


def test_a_covering_budget_gives_stock_vllms_log_probs(followed_in_vllm, tmp_path):
    """Stock vLLM in a fresh process against the plugin's calls above: the covering budget gives stock vLLM's
    log-probs, const:64 does not (the plugin is on in that process)."""
    (stock,) = _run_script(tmp_path, plugin=False)
    covered, sparse = followed_in_vllm[:2]
    assert _gap(stock, covered) < 1e-4
    assert _gap(stock, sparse) > 1e-3
