"""Options shared by the commands that load a model and build a sparse engine."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.attention import SparseConfig
from sparrow.attention.landmarks import LANDMARKS
from sparrow.errors import SparrowError
from sparrow.lora import check_adapter_dir, load_adapter
from sparrow.models import resolve_device, resolve_dtype
from sparrow.schedules import Schedule, parse_schedule
from sparrow.typed_config import check_int

MODEL_HELP = {
    "model": "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local Hugging Face model directory",
    "schedule": "dense, const:N, steps:BIN:b1,b2,..., start:budget,..., a preset name or a JSON schedule file",
    "page_size": "tokens per KV page",
    "landmark": "page landmark: " + " or ".join(LANDMARKS),
    "dense_layers": "comma-separated layer indices that always attend densely",
    "dtype": "float32, bfloat16 or float16",
    "device": "cpu, cuda, cuda:N or auto (cuda when available)",
    "adapter": "peft LoRA adapter directory loaded onto the model (e.g. checkpoint-N/adapter of a DistillSparse run); "
               "profile measures the actor with it against the dense model without it",
}


@dataclass
class ModelOptions:
    """The model, its sparse attention and where it runs."""

    model: str = "smollm2-135m"
    schedule: str = "dense"
    page_size: int = 16
    landmark: str = "centroid"
    dense_layers: str = "0,1"
    dtype: str = "float32"
    device: str = "auto"
    adapter: str | None = None

    def validate(self) -> None:
        resolve_dtype(self.dtype)
        self.sparse_config()
        self.parsed_schedule()
        self.torch_device()
        if self.adapter is not None:
            check_adapter_dir(self.adapter)

    def sparse_config(self) -> SparseConfig:
        return SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    def parsed_schedule(self) -> Schedule:
        sparse = self.sparse_config()
        return parse_schedule(self.schedule, sparse.page_size, sparse.always_kept_pages)

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def load(self):
        """(model, tokenizer) on the chosen device and dtype, with the `--adapter` loaded onto the model if given."""
        from sparrow.models import load_model

        model, tokenizer = load_model(self.model, dtype=resolve_dtype(self.dtype), device=self.torch_device())
        if self.adapter is not None:
            model = load_adapter(model, self.adapter)
        return model, tokenizer


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # stdout may be a command's --json output


@dataclass
class RolloutOptions:
    """Where rollouts run: in this process (the default), or on `rollout_workers` Ray workers (a local Ray
    started and stopped by the command, or the cluster at `ray_address`)."""

    backend: str = "native"
    rollout_workers: int = 0
    ray_address: str | None = None
    cpus_per_worker: int | None = None

    def validate(self) -> None:
        from sparrow.rollout.factory import check_backend, check_rollout_workers

        check_rollout_workers(self.rollout_workers, self.ray_address, self.device)  # `device`: of ModelOptions
        if self.cpus_per_worker is not None:
            check_int("cpus_per_worker", self.cpus_per_worker, 1)
        check_backend(self.backend, self.rollout_workers, self.ray_address)

    def make_backend(self, options: ModelOptions, model, tokenizer, max_batch_size: int = 64):
        """The rollout backend for `model` (see sparrow.rollout.factory)."""
        from sparrow.rollout.factory import ModelSpec, create_backend

        spec = ModelSpec(options.model, options.dtype, options.device, options.sparse_config(), max_batch_size,
                         adapter=options.adapter)
        return create_backend(model, tokenizer, spec, self.rollout_workers, self.ray_address, log=_to_stderr,
                              cpus_per_worker=self.cpus_per_worker, backend=self.backend)


ROLLOUT_HELP = {
    "backend": "rollout backend: native (our engine) or vllm (stock vLLM with Sparrow's plugin; pip install "
               "'sparrow-rl[vllm]')",
    "rollout_workers": "rollout workers on Ray (0: rollouts in this process, nothing of Ray imported)",
    "ray_address": "attach to a Ray cluster (started with `ray start --head`; `auto` on its head node) instead of "
                   "starting a local one",
    "cpus_per_worker": "CPUs and torch threads of each Ray worker (default: the free CPUs divided by the workers)",
}


def require_file(path: str | None, what: str) -> Path:
    """`path` as a Path if it is an existing file; a SparrowError saying it is missing or a directory otherwise."""
    if path is None:
        raise SparrowError(f"give the {what}")
    found = Path(path)
    if not found.exists():
        raise SparrowError(f"{what} {path!r} does not exist")
    if not found.is_file():
        raise SparrowError(f"{what} {path!r} is a directory; expected a file" if found.is_dir()
                           else f"{what} {path!r} is not a regular file")
    return found


def check_output(path: str, what: str, directory: bool) -> None:
    """Refuse, before any work, an output that cannot be made: an existing file where a directory goes (or an
    existing directory where a file goes), a path under an existing file, or one whose nearest existing directory
    this process cannot write in."""
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise SparrowError(f"{what} {path!r} is an existing file; expected a directory (existing or new)")
    if not directory and target.is_dir():
        raise SparrowError(f"{what} {path!r} is a directory; expected a file name")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SparrowError(f"{what} {path!r} lies under {str(parent)!r}, which is a file, not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise SparrowError(f"{what} {path!r} cannot be written: directory {str(parent)!r} is not writable "
                                   "(read-only or no permission); expected a path in a writable directory")
            return
