"""Choosing a rollout backend from the run's options: our engine in this process, vLLM, or Ray rollout workers
(built from a `ModelSpec`, model_spec.py). Without workers or an address nothing of Ray is imported.
"""

from __future__ import annotations

from sparrow.errors import SparrowError

from .backend import RolloutBackend
from .model_spec import ModelSpec, check_rollout_workers
from .native import NativeBackend

BACKENDS = ("native", "vllm")


def check_backend(backend: str, workers: int, ray_address: str | None) -> None:
    """Refuse an unknown backend, or vLLM together with Ray workers, with one message."""
    if backend not in BACKENDS:
        raise SparrowError(f"unknown rollout backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "vllm" and (workers or ray_address is not None):
        raise SparrowError("--backend vllm runs one vLLM engine in this process; Ray rollout workers "
                           "(--rollout-workers, --ray-address) hold native engines: use one or the other")


def create_backend(model, tokenizer, spec: ModelSpec, workers: int = 0, ray_address: str | None = None, log=print,
                   *, cpus_per_worker: int | None = None, wire_dtype: str | None = None,
                   backend: str = "native", draft_tokens: int | None = None) -> RolloutBackend:
    """The rollout backend for `--backend` / `--rollout-workers N` / `--ray-address ADDR`.

    backend vllm: a `VLLMBackend` in this process on the model's Hugging Face directory, synced to `model`; in exact
    mode (`draft_tokens`, fixed for the engine) drafting that many tokens a round.
    native with workers 0 and no address: `NativeBackend` on `model` itself (Ray is not imported). Otherwise a
    `RayRolloutBackend` with `workers` actors (1 when only an address is given), each starting from `spec` and
    synced to `model`'s weights before this returns; see ray_backend.py for `cpus_per_worker` and `wire_dtype`.
    """
    check_rollout_workers(workers, ray_address, spec.device)
    check_backend(backend, workers, ray_address)
    if backend == "vllm":
        return _vllm_backend(model, tokenizer, spec, log, draft_tokens)
    if workers == 0 and ray_address is None:
        return NativeBackend(model, tokenizer, spec.sparse, spec.max_batch_size)
    from .ray_backend import RayRolloutBackend

    return RayRolloutBackend(model, tokenizer, spec, max(workers, 1), ray_address, log=log,
                             cpus_per_worker=cpus_per_worker, wire_dtype=wire_dtype)


def check_vllm_exact(draft_tokens: int | None) -> None:
    """vLLM drafts a fixed number of tokens a round: exact mode there needs K, not `auto` (0)."""
    if draft_tokens == 0:
        raise SparrowError("--backend vllm fixes the draft length when the engine starts: give --draft-tokens K "
                           "(1-64), not auto")


def _vllm_backend(model, tokenizer, spec: ModelSpec, log, draft_tokens: int | None = None) -> RolloutBackend:
    """A vLLM engine for `spec`, refusing what it cannot do with one message before it starts."""
    check_vllm_exact(draft_tokens)
    if spec.lora is not None or spec.adapter is not None:
        raise SparrowError("--backend vllm cannot put a LoRA adapter in the sparse actor only (DistillSparse, "
                           "--adapter): use --backend native for runs with an adapter")
    if spec.device not in ("cpu", "auto"):
        raise SparrowError(f"--backend vllm runs on the CPU build of vLLM here, not on device {spec.device!r}")
    from sparrow.rollout.vllm_backend import VLLMBackend, model_directory

    directory = model_directory(spec.model)
    backend = VLLMBackend(directory, tokenizer, spec.sparse, dtype=spec.dtype,
                          max_model_len=model.config.max_position_embeddings, log=log, draft_tokens=draft_tokens)
    backend.sync_weights(model)
    return backend
