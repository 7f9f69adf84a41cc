"""Ray rollout workers: the same completions as one process, weight sync (adapter included), a worker killed
mid-call, bounded failures; and no Ray at all without workers. One local Ray session (2 CPUs) for the module."""

import copy
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from sparrow.datasets import Example
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.lora import adapter_parameters, attach_adapter
from sparrow.models import load_model
from sparrow.rl.distill import DistillConfig, Distiller
from sparrow.rl.step import Policy, StepConfig
from sparrow.rollout import NativeBackend
from sparrow.rollout.factory import ModelSpec, create_backend
from sparrow.schedules import const
from sparrow.typed_config import build
from tests.conftest import random_prompts
from tests.steps import grpo_step

ray = pytest.importorskip("ray")
from sparrow.rollout.ray_backend import pack_state, split_groups, unpack_state

DISTILL = DistillConfig(enabled=True, rank=4)
SPEC = ModelSpec("tiny-llama", max_batch_size=4, lora=DISTILL.lora())
SCHEDULE = const(48)
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
PROMPTS = [*random_prompts([5, 60, 17, 41, 9], seed=3), "A text prompt", [{"role": "user", "content": "chat"}]]


def _policy():
    """tiny-llama with a DistillSparse adapter whose B matrices are non-zero, so the adapter changes samples."""
    model, tokenizer = load_model("tiny-llama")
    model = attach_adapter(model, DISTILL.lora()).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, tokenizer


def _changed(model, scale=0.5, seed=1):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


def _native(model, tokenizer, prompts=PROMPTS, **kwargs):
    return NativeBackend(model, tokenizer, SPEC.sparse, SPEC.max_batch_size).generate(
        prompts, kwargs.pop("sampling", SAMPLING), SCHEDULE, kwargs.pop("num_samples", 4), **kwargs)


def _assert_same(got, want, atol=1e-6):
    """Same prompts, keys, tokens and budgets; log-probs to `atol`. With 4 samples a wave holds one prompt
    (max_batch_size 4), in a worker as in one process, so the floats are the same. Where a wave holds several
    prompts, a share's waves differ from the whole call's, and their padded lengths change float reduction orders:
    one process run with another max_batch_size differs from itself by up to ~4e-5 as well (the tokens never)."""
    assert [(c.prompt_index, c.sample_index, c.prompt_key) for c in got] == \
        [(c.prompt_index, c.sample_index, c.prompt_key) for c in want]
    for a, b in zip(got, want):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.token_ids == b.token_ids
        assert a.kv_budget == b.kv_budget and a.finish_reason == b.finish_reason and a.text == b.text
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def pool():
    """Two workers on a local Ray that the backend starts (all 2 CPUs) and stops on close. The native references
    run on one thread too: beside two busy workers, more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = _policy()
    messages = []
    backend = create_backend(model, tokenizer, SPEC, workers=2, log=messages.append, cpus_per_worker=1)
    yield backend, model, tokenizer, messages
    backend.close()
    torch.set_num_threads(threads)
    assert not ray.is_initialized()


def test_split_is_greedy_longest_first_and_balanced():
    assert split_groups([10, 50, 20, 40, 30], 2) == [[0, 1, 2], [3, 4]]  # loads 80 and 70
    assert split_groups([5, 5], 3) == [[0], [1], []]
    assert split_groups([7, 7, 7, 7], 2) == [[0, 2], [1, 3]]


def test_two_workers_equal_one_process_with_and_without_the_adapter(pool):
    backend, model, tokenizer, messages = pool
    assert messages[0] == "rollout: 2 Ray worker(s) on the local Ray, 1 CPU(s) each"
    _assert_same(backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4), _native(model, tokenizer))
    assert {"rollout/worker_0_tokens_per_s", "rollout/worker_1_tokens_per_s"} <= set(backend.stats)
    assert backend.stats["rollout/retries"] == 0 and backend.stats["rollout/gather_s"] > 0
    assert backend.stats["rollout/worker_0_tokens_per_s"] > 0 and backend.stats["rollout/worker_1_tokens_per_s"] > 0
    dense = backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4, adapter=False)
    _assert_same(dense, _native(model, tokenizer, adapter=False))
    keys = [900, 3, 41, 7, 2**32 - 1, 0, 12]
    _assert_same(backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4, prompt_keys=keys),
                 _native(model, tokenizer, prompt_keys=keys))
    with pytest.raises(SparrowError, match="prompt key 5 is given twice"):
        backend.generate(PROMPTS[:2], SAMPLING, SCHEDULE, prompt_keys=[5, 5])


def test_tied_tensors_travel_once():
    shared, own = torch.arange(6.0).view(2, 3), torch.ones(4)
    packed = pack_state({"embed.weight": shared, "lm_head.weight": shared, "norm.weight": own})
    assert list(packed["tensors"]) == ["embed.weight", "norm.weight"]
    assert packed["aliases"] == {"lm_head.weight": "embed.weight"}
    full = unpack_state(packed)
    assert set(full) == {"embed.weight", "lm_head.weight", "norm.weight"} and full["lm_head.weight"] is shared


def test_sync_weights_moves_the_workers_to_the_new_policy(pool):
    backend, model, tokenizer, _ = pool
    before = backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4)
    other = _changed(model)
    backend.sync_weights(other)
    after = backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    _assert_same(after, _native(other, tokenizer))
    f32_bytes = sum(t.numel() * 4 for t in pack_state(other.state_dict())["tensors"].values())
    assert backend.stats["rollout/sync_bytes"] == f32_bytes and backend.stats["rollout/sync_s"] > 0
    backend.wire_dtype = torch.bfloat16  # half the bytes; the workers then hold the bf16-rounded weights
    try:
        backend.sync_weights(other)
        assert backend.stats["rollout/sync_bytes"] == f32_bytes // 2
        rounded = copy.deepcopy(other)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(torch.bfloat16))
        _assert_same(backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4), _native(rounded, tokenizer))
    finally:
        backend.wire_dtype = None
        backend.sync_weights(model)


def _byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


def test_grpo_steps_on_two_workers_equal_steps_in_one_process(pool):
    """Two DistillSparse GRPO steps: rollouts, the policy and adapter updates, and the sync of both to the
    workers. One prompt a wave (see `_assert_same`), so metrics and final weights are exactly equal."""
    backend, model, tokenizer, _ = pool
    examples = [Example(0, "the cat sat on the mat " * 4, "1", {}), Example(1, "a b c d e f g " * 6, "2", {})]
    cfg = build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 4,
                             "mini_batches": 2})
    runs = []
    for rollouts in (backend, None):
        policy_model = copy.deepcopy(model)
        rollouts = rollouts or NativeBackend(policy_model, tokenizer, SPEC.sparse, SPEC.max_batch_size)
        rollouts.sync_weights(policy_model)
        policy = Policy(policy_model, torch.optim.AdamW(policy_model.parameters(), lr=1e-2, weight_decay=0.0),
                        tokenizer.pad_token_id, distiller=Distiller(policy_model, DISTILL, SPEC.sparse))
        metrics = [grpo_step(policy, rollouts, examples, [("bytes", _byte_mean, 1.0)], SCHEDULE, cfg, seed=s,
                             number=s) for s in (0, 1)]
        runs.append((metrics, policy_model.state_dict()))
    (ray_metrics, ray_state), (native_metrics, native_state) = runs
    for got, want in zip(ray_metrics, native_metrics):
        timing = {k for k in want if k.startswith("time/") or k == "rollout/tokens_per_s"}
        assert set(got) >= set(want) - timing and len(want) - len(timing) > 30  # the native engine adds its split
        assert {k: got[k] for k in want if k not in timing} == {k: v for k, v in want.items() if k not in timing}
    assert ray_metrics[0]["grad_norm"] > 0 and ray_metrics[1]["distill/loss"] != 0
    moved = [k for k in native_state if not torch.equal(native_state[k], model.state_dict()[k])]
    assert any("lora_" in k for k in moved) and any("lora_" not in k for k in moved)
    assert all(torch.equal(ray_state[k], native_state[k]) for k in native_state)
    backend.sync_weights(model)


def _kill_during(backend, worker, call):
    """Run `call()` and SIGKILL worker `worker` 0.5 s into it (each share below takes over a second)."""
    victim = backend.pids[worker]
    killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
    killer.start()
    try:
        return call()
    finally:
        killer.join()


def test_a_worker_killed_mid_call_is_restarted_resynced_and_reruns_its_share(pool):
    backend, model, tokenizer, messages = pool
    other = _changed(model, seed=2)  # weights a restarted worker can only have from the last sync
    backend.sync_weights(other)
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, seed=11, ignore_eos=True)
    prompts = random_prompts([30, 45, 20, 50, 25, 40, 35, 15], seed=4)
    call = lambda: backend.generate(prompts, sampling, SCHEDULE, 2)
    backend.max_retries = 0
    try:
        with pytest.raises(SparrowError, match=r"rollout worker 0 died 1 time\(s\) in one call, more than "
                                               r"max_retries=0 .*--resume"):
            _kill_during(backend, 0, call)
    finally:
        backend.max_retries = 2
    # Ray restarts the worker between calls; it reloads the last weights before its next share
    _assert_same(backend.generate(PROMPTS, SAMPLING, SCHEDULE, 4), _native(other, tokenizer))
    victim = backend.pids[0]
    got = _kill_during(backend, 0, call)
    assert backend.stats["rollout/retries"] == 1 and backend.pids[0] != victim
    assert any(m.startswith("rollout: worker 0 died") and m.endswith("re-running its share (1/2)") for m in messages)
    _assert_same(got, _native(other, tokenizer, prompts, sampling=sampling, num_samples=2), atol=1e-4)  # 2 a wave
    backend.sync_weights(model)


def test_a_worker_error_arrives_as_one_sparrow_error(pool):
    backend, *_ = pool
    with pytest.raises(SparrowError, match="exceeds the model's 8192 positions") as err:
        backend.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8190, seed=0), SCHEDULE)
    assert type(err.value) is SparrowError


def test_too_many_workers_and_bad_addresses_fail_at_once(pool):
    backend, model, tokenizer, _ = pool
    for kwargs, message in [({"workers": 3}, r"3 rollout worker\(s\) need 3 CPU\(s\), but the local Ray has 0 free"),
                            ({"ray_address": "127.0.0.1:9"}, "cannot reach a Ray cluster at '127.0.0.1:9'"),
                            ({"ray_address": "head:port"}, "bad Ray address 'head:port'")]:
        began = time.monotonic()
        with pytest.raises(SparrowError, match=message):
            create_backend(model, tokenizer, SPEC, log=lambda m: None, **kwargs)
        assert time.monotonic() - began < 10
    assert ray.is_initialized() and len(backend.pids) == 2  # the pool's session is untouched


def test_no_workers_means_no_ray():
    script = ("import sys\n"
              "from sparrow.models import load_model\n"
              "from sparrow.engine import SamplingParams\n"
              "from sparrow.rollout.factory import ModelSpec, create_backend\n"
              "from sparrow.rollout import NativeBackend\n"
              "model, tok = load_model('tiny-llama')\n"
              "backend = create_backend(model, tok, ModelSpec('tiny-llama'))\n"
              "assert type(backend) is NativeBackend\n"
              "from sparrow.schedules import DENSE\n"
              "out = backend.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, seed=0), DENSE)\n"
              "assert len(out[0].token_ids) >= 1\n"
              "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
