"""The one place that knows LoRA adapters: their shape, how one is attached or loaded, which parameters are its,
and how it is switched off (the dense policy is the model without it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.errors import SparrowError

ADAPTER_MARK = "lora_"  # peft's marker in the names of an adapter's parameters


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank, alpha (scaling numerator), targets ("all-linear" or comma-separated module
    names such as "q_proj,v_proj") and dropout."""

    rank: int
    alpha: float
    targets: str = "all-linear"
    dropout: float = 0.0

    def target_modules(self) -> str | list[str]:
        if self.targets.strip() == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.targets.split(",") if name.strip()]


def has_adapter(model) -> bool:
    return hasattr(model, "disable_adapter")


def without_adapter(model) -> contextlib.AbstractContextManager:
    """peft's `disable_adapter()` for a model with a LoRA adapter, else a no-op context."""
    return model.disable_adapter() if has_adapter(model) else contextlib.nullcontext()


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if ADAPTER_MARK in name]


def base_parameters(model) -> list[torch.nn.Parameter]:
    """The policy's own parameters (everything but LoRA's): what the policy optimizer may hold."""
    return [p for name, p in model.named_parameters() if ADAPTER_MARK not in name]


def attach_adapter(model, spec: LoraSpec, seed: int = 0):
    """Wrap `model` in a peft LoRA model; its base weights stay trainable for the dense policy update.

    peft's get_peft_model freezes the base; we unfreeze it, so give the policy optimizer `base_parameters` only.
    The adapter's random init (A; B starts at zero) is drawn under `seed`, leaving the global RNG as it was.
    """
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules(),
                      lora_dropout=spec.dropout, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, lora)
        except ValueError as err:
            raise SparrowError(f"distill_targets {spec.targets!r} do not fit the model: {err}") from None
    for p in peft_model.parameters():
        p.requires_grad_(True)
    return peft_model


def check_adapter_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise SparrowError(f"adapter {str(path)!r} is not a peft adapter directory: expected an adapter_config.json "
                           "in it (as in <run>/checkpoint-N/adapter)")
    return path


def load_adapter(model, path: str | Path):
    """`model` with the peft adapter saved in directory `path` (e.g. checkpoint-N/adapter), in eval mode."""
    from peft import PeftModel

    path = check_adapter_dir(path)
    try:
        return PeftModel.from_pretrained(model, str(path)).eval()
    except (ValueError, RuntimeError, KeyError, OSError) as err:
        raise SparrowError(f"adapter {str(path)!r} does not fit the model: {err}") from None
