"""What a rollout worker in another process needs to build the policy's twin by itself (`ModelSpec`: the same model
name, dtype, sparse settings and adapter), and whether this machine can place the workers asked for. The trainer
then keeps the twin's weights equal to the policy's with `sync_weights`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.typed_config import check_int

if TYPE_CHECKING:
    from sparrow.lora import LoraSpec


@dataclass(frozen=True)
class ModelSpec:
    """How to build the rollout model in a worker process.

    model, dtype, device: as `sparrow.models.load_model` and the `--model/--dtype/--device` options take them
    (dtype is the rollout dtype: the workers' weights are cast to it on every sync). lora: the shape of the
    DistillSparse adapter when the policy carries one (the twin gets the same adapter, so that `sync_weights` loads
    the adapter's weights too). adapter: a peft adapter directory loaded onto the model (`--adapter`); it must be
    readable at the same path on every worker's machine. lora and adapter exclude each other.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    sparse: SparseConfig = field(default_factory=SparseConfig)
    max_batch_size: int = 64
    lora: LoraSpec | None = None
    adapter: str | None = None

    def __post_init__(self):
        from sparrow.models import resolve_dtype

        resolve_dtype(self.dtype)
        check_int("max_batch_size", self.max_batch_size, 1)
        if self.lora is not None and self.adapter is not None:
            raise SparrowError(f"a model spec takes a DistillSparse adapter shape or an adapter directory, not both "
                               f"(got adapter {self.adapter!r} with lora)")

    @property
    def gpu(self) -> bool:
        """Whether each worker takes one GPU (see `uses_gpu`)."""
        return uses_gpu(self.device)

    def load(self):
        """(model, tokenizer) as the policy was built: the model in eval mode, with its adapter if any. A worker
        with a GPU sees only its own, as `cuda`."""
        from sparrow.models import load_model, resolve_dtype

        model, tokenizer = load_model(self.model, resolve_dtype(self.dtype), "cuda" if self.gpu else "cpu")
        if self.lora is not None:
            from sparrow.lora import attach_adapter

            model = attach_adapter(model, self.lora)
        elif self.adapter is not None:
            from sparrow.lora import load_adapter

            model = load_adapter(model, self.adapter)
        return model.eval(), tokenizer


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
