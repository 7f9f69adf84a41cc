"""Options shared by the commands that load a model and build a sparse engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.models import resolve_device, resolve_dtype
from sparrow.schedules import Schedule, parse_schedule

MODEL_HELP = {
    "model": "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local Hugging Face model directory",
    "schedule": "dense, const:N, steps:BIN:b1,b2,..., start:budget,..., a preset name or a JSON schedule file",
    "page_size": "tokens per KV page",
    "landmark": "page landmark: centroid or quest",
    "dense_layers": "comma-separated layer indices that always attend densely",
    "dtype": "float32, bfloat16 or float16",
    "device": "cpu, cuda, cuda:N or auto (cuda when available)",
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

    def validate(self) -> None:
        resolve_dtype(self.dtype)
        self.sparse_config()
        self.parsed_schedule()
        self.torch_device()

    def sparse_config(self) -> SparseConfig:
        try:
            layers = tuple(int(x) for x in str(self.dense_layers).split(",") if x.strip())
        except ValueError:
            raise SparrowError(f"dense_layers must be comma-separated integers, got {self.dense_layers!r}") from None
        return SparseConfig(page_size=self.page_size, landmark=self.landmark, dense_layers=layers)

    def parsed_schedule(self) -> Schedule:
        sparse = self.sparse_config()
        return parse_schedule(self.schedule, sparse.page_size, sparse.always_kept_pages)

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def load(self):
        """(model, tokenizer) on the chosen device and dtype."""
        from sparrow.models import load_model

        return load_model(self.model, dtype=resolve_dtype(self.dtype), device=self.torch_device())
