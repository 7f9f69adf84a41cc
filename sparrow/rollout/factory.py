"""Choosing a rollout backend from the run's options: our engine in this process, or Ray rollout workers.

`ModelSpec` is what a worker in another process needs to build the policy's twin by itself (the same model
name, dtype, sparse settings and adapter); the trainer then keeps the twin's weights equal to the policy's with
`sync_weights`. Without workers or an address nothing of Ray is imported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.typed_config import check_int

from .backend import RolloutBackend
from .native import NativeBackend

if TYPE_CHECKING:
    from sparrow.rl.distill import DistillConfig


@dataclass(frozen=True)
class ModelSpec:
    """How to build the rollout model in a worker process.

    model, dtype, device: as `sparrow.models.load_model` and the `--model/--dtype/--device` options take them
    (dtype is the rollout dtype: the workers' weights are cast to it on every sync). distill: the DistillSparse
    config when the policy carries its LoRA adapter (the twin gets the same adapter, so that `sync_weights` loads
    the adapter's weights too). adapter: a peft adapter directory loaded onto the model (`--adapter`); it must be
    readable at the same path on every worker's machine. distill and adapter exclude each other.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    sparse: SparseConfig = field(default_factory=SparseConfig)
    max_batch_size: int = 64
    distill: DistillConfig | None = None
    adapter: str | None = None

    def __post_init__(self):
        from sparrow.models import resolve_dtype

        resolve_dtype(self.dtype)
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) \
                or self.max_batch_size < 1:
            raise SparrowError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.distill is not None and self.adapter is not None:
            raise SparrowError(f"a model spec takes a DistillSparse config or an adapter directory, not both "
                               f"(got adapter {self.adapter!r} with distill)")

    @property
    def gpu(self) -> bool:
        """Whether each worker takes one GPU (see `uses_gpu`)."""
        return uses_gpu(self.device)

    def load(self):
        """(model, tokenizer) as the policy was built: the model in eval mode, with its adapter if any. A worker
        with a GPU sees only its own, as `cuda`."""
        from sparrow.models import load_model, resolve_dtype

        model, tokenizer = load_model(self.model, resolve_dtype(self.dtype), "cuda" if self.gpu else "cpu")
        if self.distill is not None:
            from sparrow.rl.distill import attach_adapter

            model = attach_adapter(model, self.distill)
        elif self.adapter is not None:
            from sparrow.rl.distill import load_adapter

            model = load_adapter(model, self.adapter)
        return model.eval(), tokenizer


BACKENDS = ("native", "vllm")


def uses_gpu(device: str) -> bool:
    """Whether a rollout worker on `device` takes one GPU: a cuda device, or `auto` where this process sees CUDA."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def check_rollout_workers(workers, ray_address: str | None, device: str) -> int:
    """`workers` as an int, refused unless it is an integer >= 0 that a local Ray (no `ray_address`) can place:
    at least one CPU of this process each, and one GPU each on a cuda device. Checked before Ray starts, which
    otherwise takes half a minute to say so; a cluster's resources, or those of a Ray session this process has
    open already, are checked once attached (ray_backend)."""
    workers = check_int("rollout_workers", workers, 0)
    ray = sys.modules.get("ray")  # an open session is used as it is, whatever its size
    if ray_address is None and workers and not (ray is not None and ray.is_initialized()):
        cpus = len(os.sched_getaffinity(0))
        if workers > cpus:
            raise SparrowError(f"rollout_workers {workers} exceeds the {cpus} CPU(s) available here: each local "
                               f"Ray worker needs one; expected at most {cpus}, or --ray-address of a larger cluster")
        if uses_gpu(device):
            import torch

            gpus = torch.cuda.device_count()
            if workers > gpus:
                raise SparrowError(f"rollout_workers {workers} on device {device!r} exceeds the {gpus} GPU(s) here: "
                                   f"each worker takes one; expected at most {gpus}, or --device cpu")
    return workers


def check_backend(backend: str, workers: int, ray_address: str | None) -> None:
    """Refuse an unknown backend, or vLLM together with Ray workers, with one message."""
    if backend not in BACKENDS:
        raise SparrowError(f"unknown rollout backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "vllm" and (workers or ray_address is not None):
        raise SparrowError("--backend vllm runs one vLLM engine in this process; Ray rollout workers "
                           "(--rollout-workers, --ray-address) hold native engines: use one or the other")


def create_backend(model, tokenizer, spec: ModelSpec, workers: int = 0, ray_address: str | None = None, log=print,
                   *, cpus_per_worker: int | None = None, wire_dtype: str | None = None,
                   backend: str = "native") -> RolloutBackend:
    """The rollout backend for `--backend` / `--rollout-workers N` / `--ray-address ADDR`.

    backend vllm: a `VLLMBackend` in this process on the model's Hugging Face directory, synced to `model`.
    native with workers 0 and no address: `NativeBackend` on `model` itself (Ray is not imported). Otherwise a
    `RayRolloutBackend` with `workers` actors (1 when only an address is given), each starting from `spec` and
    synced to `model`'s weights before this returns; see ray_backend.py for `cpus_per_worker` and `wire_dtype`.
    """
    check_rollout_workers(workers, ray_address, spec.device)
    check_backend(backend, workers, ray_address)
    if backend == "vllm":
        return _vllm_backend(model, tokenizer, spec, log)
    if workers == 0 and ray_address is None:
        return NativeBackend(model, tokenizer, spec.sparse, spec.max_batch_size)
    from .ray_backend import RayRolloutBackend

    return RayRolloutBackend(model, tokenizer, spec, max(workers, 1), ray_address, log=log,
                             cpus_per_worker=cpus_per_worker, wire_dtype=wire_dtype)


def _vllm_backend(model, tokenizer, spec: ModelSpec, log) -> RolloutBackend:
    """A vLLM engine for `spec`, refusing what it cannot do with one message before it starts."""
    if spec.distill is not None or spec.adapter is not None:
        raise SparrowError("--backend vllm cannot put a LoRA adapter in the sparse actor only (DistillSparse, "
                           "--adapter): use --backend native for runs with an adapter")
    if spec.device not in ("cpu", "auto"):
        raise SparrowError(f"--backend vllm runs on the CPU build of vLLM here, not on device {spec.device!r}")
    from sparrow.rollout.vllm_backend import VLLMBackend, model_directory

    directory = model_directory(spec.model)
    backend = VLLMBackend(directory, tokenizer, spec.sparse, dtype=spec.dtype,
                          max_model_len=model.config.max_position_embeddings, log=log)
    backend.sync_weights(model)
    return backend
