"""Rollouts on Ray actors: N workers, each a `NativeBackend` on its own share of CPUs (or one GPU).

A call splits the prompt groups over the workers (`split_groups`: greedy longest-first by prompt tokens plus new
tokens, times samples), gives every prompt its original key, and reassembles the completions in the original
order: with per-sequence random streams (engine.py) the result equals one process's for the same seed.

Weights: `sync_weights` puts the policy's state dict into Ray's object store once and every worker loads it
(a DistillSparse adapter's tensors are part of the state dict). The last published weights stay referenced with
their version; every call carries that version, so a worker that was restarted (it comes back with the weights
of `ModelSpec.load`) reloads them before it runs anything. A worker that dies during a call is restarted by Ray
(`max_restarts`) and re-runs its whole share (`max_retries` times per call); its completions are only ever
taken from a share that finished, so nothing is lost or duplicated.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from tqdm.auto import tqdm

from sparrow.engine import Completion, Prompt, SamplingParams, encode_prompt
from sparrow.engine.arguments import check_generate
from sparrow.errors import SparrowError
from sparrow.models import resolve_dtype
from sparrow.schedules import Schedule
from sparrow.typed_config import check_int

from .model_spec import ModelSpec, check_rollout_workers
from .native import NativeBackend, load_state

CONNECT_TIMEOUT_S = 5.0
RESOURCE_WAIT_S = 3.0
RESUME_HINT = "a training run continues from its last checkpoint with `sparrow train --resume`"


def split_groups(costs: Sequence[float], workers: int) -> list[list[int]]:
    """Prompt indices per worker: longest-first, each prompt to the least loaded worker (ties: lowest index);
    each worker's indices ascending. Pure: the same costs give the same split."""
    loads = [0.0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(workers), key=lambda w: (loads[w], w))
        loads[w] += costs[i]
        shares[w].append(i)
    return [sorted(share) for share in shares]


def pack_state(state: dict[str, torch.Tensor]) -> dict:
    """A state dict with each shared tensor once (tied embeddings appear under two names): {"tensors": {name:
    tensor}, "aliases": {other name: name}}."""
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor
    return {"tensors": tensors, "aliases": aliases}


def unpack_state(packed: dict) -> dict[str, torch.Tensor]:
    """The full state dict of `pack_state`'s result."""
    tensors = packed["tensors"]
    return {**tensors, **{alias: tensors[name] for alias, name in packed["aliases"].items()}}


class RolloutWorker:
    """One rollout actor: the spec's twin of the policy in a `NativeBackend`, on `threads` torch threads.

    A SparrowError while building it (a bad spec) is kept and raised by `ready`, so the driver sees the message
    itself rather than Ray's report of a dead actor."""

    def __init__(self, spec: ModelSpec, threads: int):
        self.backend, self.error, self.version = None, None, None
        torch.set_num_threads(threads)
        try:
            model, tokenizer = spec.load()
            self.backend = NativeBackend(model, tokenizer, spec.sparse, spec.max_batch_size)
        except SparrowError as err:
            self.error = err

    def ready(self) -> int:
        """The worker's process id, once it can serve calls."""
        if self.error is not None:
            raise self.error
        return os.getpid()

    def load(self, version: int, weights: list) -> None:
        """Load weights `version` unless loaded already; `weights` is [ObjectRef], so Ray passes the reference."""
        if self.version != version:
            load_state(self.backend.engine.model, unpack_state(ray.get(weights[0])))
            self.version = version

    def generate(self, version: int, weights: list, prompt_ids: list[list[int]], keys: list[int],
                 sampling: SamplingParams, schedule: Schedule, num_samples: int,
                 adapter: bool, draft_tokens: int | None = None) -> tuple[list[Completion], float]:
        """Completions of one share (prompt_index: position in the share) and the seconds they took."""
        self.load(version, weights)
        began = time.perf_counter()
        out = self.backend.generate(prompt_ids, sampling, schedule, num_samples, prompt_keys=keys, adapter=adapter,
                                    draft_tokens=draft_tokens)
        return out, time.perf_counter() - began


class RayRolloutBackend:
    """A `RolloutBackend` over `workers` Ray actors; see the module docstring.

    ray_address: attach to a running cluster (`ray start --head`; `close` then only disconnects); None starts a
    local Ray with this machine's CPUs (or `workers * cpus_per_worker`) and stops it on `close`. A Ray session
    already open in this process is used as it is. cpus_per_worker: CPUs (and torch threads) of each worker,
    default the available CPUs divided by `workers`. wire_dtype: the dtype of floating tensors in the object
    store (e.g. "bfloat16": half the bytes of float32); None sends the policy's own dtype. The workers compute in
    `spec.dtype` (the rollout dtype) whatever the wire dtype, so bfloat16 on the wire rounds float32 weights to
    bfloat16 before they are cast back, and is exact only where the policy or the rollout dtype is bfloat16.
    max_restarts: Ray restarts of each worker over the backend's life; max_retries: re-runs of one worker's share
    within a call; ready_timeout_s: the longest wait for a worker to start or come back.

    `stats` after each call: rollout/sync_s and rollout/sync_bytes of the last sync, rollout/generate_s (wall time
    of the last generate), rollout/gather_s (that minus its slowest worker's own time: scheduling, transfer and
    reassembly), rollout/retries, and rollout/worker_{i}_tokens_per_s for the workers that had a share.
    """

    def __init__(self, model, tokenizer, spec: ModelSpec, workers: int, ray_address: str | None = None, *,
                 cpus_per_worker: int | None = None, wire_dtype: str | None = None, max_restarts: int = 3,
                 max_retries: int = 2, ready_timeout_s: float = 120.0, log: Callable[[str], None] = print):
        if check_rollout_workers(workers, ray_address, spec.device) < 1:
            raise SparrowError(f"rollout_workers must be an integer >= 1 for Ray rollouts, got {workers!r}")
        if cpus_per_worker is not None:
            check_int("cpus_per_worker", cpus_per_worker, 1)
        self.tokenizer, self.spec, self.log = tokenizer, spec, log
        self.wire_dtype = None if wire_dtype is None else resolve_dtype(wire_dtype)
        self.max_retries, self.ready_timeout_s = max_retries, ready_timeout_s
        self.stats: dict[str, float] = {}
        self._version, self._weights, self._actors, self.pids = 0, None, [], []
        local_cpus = workers * cpus_per_worker if cpus_per_worker else len(os.sched_getaffinity(0))
        self._owns_ray = _connect(ray_address, local_cpus)
        where = f"the Ray cluster at {ray_address}" if ray_address else "the local Ray"
        try:
            cpus = _worker_cpus(workers, cpus_per_worker, spec.gpu, where)
            options = {"num_cpus": cpus, "num_gpus": 1 if spec.gpu else 0, "max_restarts": max_restarts,
                       "max_task_retries": 0}
            actor_class = ray.remote(RolloutWorker).options(**options)
            self._actors = [actor_class.remote(spec, cpus) for _ in range(workers)]
            self.pids = self._ready(range(workers), "start")
            log(f"rollout: {workers} Ray worker(s) on {where}, {cpus} CPU(s){' and 1 GPU' if spec.gpu else ''} each")
            self.sync_weights(model)
        except BaseException:
            self.close()
            raise

    # -- the RolloutBackend protocol ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams, schedule: Schedule,
                 num_samples: int = 1, *, prompt_keys: Sequence[int] | None = None, adapter: bool = True,
                 progress: bool = False, draft_tokens: int | None = None) -> list[Completion]:
        keys = check_generate(prompts, num_samples, prompt_keys, draft_tokens)
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        costs = [(len(ids) + sampling.max_new_tokens) * num_samples for ids in encoded]
        shares = {w: share for w, share in enumerate(split_groups(costs, len(self._actors))) if share}
        version, weights = self._version, [self._weights]
        calls = {w: (lambda actor, share=share: actor.generate.remote(
            version, weights, [encoded[i] for i in share], [keys[i] for i in share], sampling, schedule,
            num_samples, adapter, draft_tokens)) for w, share in shares.items()}
        began = time.perf_counter()
        bar = tqdm(total=len(prompts), desc="rollout workers", unit="prompt", disable=not progress)
        results, retries = self._run(calls, on_done=lambda w: bar.update(len(shares[w])))
        bar.close()
        wall = time.perf_counter() - began
        out = []
        for w, (completions, _) in results.items():
            for c in completions:
                c.prompt_index = shares[w][c.prompt_index]
            out += completions
        out.sort(key=lambda c: (c.prompt_index, c.sample_index))
        self.stats = {k: v for k, v in self.stats.items() if k.startswith("rollout/sync_")}
        self.stats.update({"rollout/generate_s": wall, "rollout/retries": retries,
                           "rollout/gather_s": wall - max(seconds for _, seconds in results.values())})
        for w, (completions, seconds) in sorted(results.items()):
            tokens = sum(len(c.token_ids) for c in completions)
            self.stats[f"rollout/worker_{w}_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        return out

    def sync_weights(self, model) -> None:
        """Publish `model`'s state dict once (in `wire_dtype`) and have every worker load it."""
        began = time.perf_counter()
        with torch.no_grad():
            packed = pack_state(model.state_dict())
            packed["tensors"] = {k: _wire(v, self.wire_dtype) for k, v in packed["tensors"].items()}
        self._weights = ray.put(packed)
        self._version += 1
        version, weights = self._version, [self._weights]
        self._run({w: lambda actor: actor.load.remote(version, weights) for w in range(len(self._actors))})
        self.stats["rollout/sync_s"] = time.perf_counter() - began
        self.stats["rollout/sync_bytes"] = sum(t.numel() * t.element_size() for t in packed["tensors"].values())

    def close(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors, self._weights = [], None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    # -- calls with restarts -----------------------------------------------------------------------------------

    def _run(self, calls: dict[int, Callable], on_done: Callable[[int], None] = lambda w: None) -> tuple[dict, int]:
        """Run `calls[w](actor w)` on every worker w at once; a worker that dies is awaited back and its call
        submitted again, at most `max_retries` times. Returns ({w: result}, retries)."""
        pending = {calls[w](self._actors[w]): w for w in calls}
        failures = dict.fromkeys(calls, 0)
        results = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            w = pending.pop(done[0])
            try:
                results[w] = ray.get(done[0])
                on_done(w)
                continue
            except RayTaskError as err:
                if isinstance(err.cause, SparrowError):
                    raise err.cause from None
                raise
            except RayActorError as err:
                failures[w] += 1
                reason = _reason(err)
                if failures[w] > self.max_retries:
                    raise SparrowError(f"rollout worker {w} died {failures[w]} time(s) in one call, more than "
                                       f"max_retries={self.max_retries} (last: {reason}); the call cannot complete: "
                                       f"{RESUME_HINT}") from None
                self.log(f"rollout: worker {w} died ({reason}); re-running its share "
                         f"({failures[w]}/{self.max_retries})")
            self.pids[w] = self._ready([w], "come back")[0]
            pending[calls[w](self._actors[w])] = w
        return results, sum(failures.values())

    def _ready(self, workers, what: str) -> list[int]:
        """The process ids of `workers` once they serve calls, waiting at most `ready_timeout_s` for them."""
        deadline = time.monotonic() + self.ready_timeout_s
        pids = []
        for w in workers:
            while True:
                try:
                    pids.append(ray.get(self._actors[w].ready.remote(), timeout=max(deadline - time.monotonic(), 0)))
                    break
                except RayTaskError as err:
                    if isinstance(err.cause, SparrowError):
                        raise err.cause from None
                    raise
                except ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise self._late(w, what) from None
                    time.sleep(0.2)
                except GetTimeoutError:
                    raise self._late(w, what) from None
                except ActorDiedError as err:
                    raise SparrowError(f"rollout worker {w} could not {what}: {_reason(err)}; {RESUME_HINT}") \
                        from None
        return pids

    def _late(self, w: int, what: str) -> SparrowError:
        return SparrowError(f"rollout worker {w} did not {what} within {self.ready_timeout_s:g} s: expected the "
                            f"cluster to have its resources free and the worker to load {self.spec.model!r}")


def _reason(err: RayActorError) -> str:
    """One line on why a worker is gone: the exception its constructor raised, else Ray's first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if err.actor_init_failed:
        return f"its constructor raised {lines[-1]}"
    return lines[0] if lines else type(err).__name__


def _wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach().to("cpu")
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _connect(address: str | None, local_cpus: int) -> bool:
    """Open the Ray session: attach to `address` or start a local Ray; True when this call opened it (a session
    already open in this process is kept, once `address` is known to be reachable)."""
    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address is None:
        ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, **quiet)  # never a `ray start` one
        return True
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as err:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else (
            "; a cluster with token authentication (the default of `ray start --head` in Ray 2.60) needs "
            "RAY_AUTH_MODE=token here and its token (`ray get-auth-token` on the head) in RAY_AUTH_TOKEN or "
            "~/.ray/auth_token")
        raise SparrowError(f"cannot attach to the Ray cluster at {address!r}: {str(err).splitlines()[0]}{hint}") \
            from None
    return True


def _check_reachable(address: str) -> None:
    """Fail fast on an address nothing listens at: Ray itself retries such a connection for minutes."""
    if address == "auto":
        return
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port or 6379
    except ValueError:
        host = port = None
    if not host:
        raise SparrowError(f"bad Ray address {address!r}: expected HOST:PORT as `ray start --head` prints it "
                           "(e.g. 10.0.0.1:6379), ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise SparrowError(f"cannot reach a Ray cluster at {address!r} ({err.strerror or err}): expected the "
                           "address `ray start --head` printed on the head node, reachable from here") from None


def _worker_cpus(workers: int, cpus_per_worker: int | None, gpu: bool, where: str) -> int:
    """CPUs per worker, checked against what the cluster has free, so that no actor waits forever. Resources of
    workers killed a moment ago (a closed backend) come back within about 0.1 s: wait up to RESOURCE_WAIT_S."""
    deadline = time.monotonic() + RESOURCE_WAIT_S
    while True:
        free = ray.available_resources()
        cpus, gpus = int(free.get("CPU", 0)), int(free.get("GPU", 0))
        each = cpus_per_worker or cpus // workers
        enough_cpus = each >= 1 and workers * each <= cpus
        if enough_cpus and (gpus >= workers or not gpu):
            return each
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not enough_cpus:
        raise SparrowError(f"{workers} rollout worker(s) need {workers * max(each, 1)} CPU(s), but {where} has "
                           f"{cpus} free: expected fewer --rollout-workers or a larger cluster")
    raise SparrowError(f"{workers} rollout worker(s) on a cuda device need one GPU each, but {where} has {gpus} "
                       "free: expected fewer --rollout-workers, more GPUs, or --device cpu")
