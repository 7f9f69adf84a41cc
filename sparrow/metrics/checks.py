"""Input checks shared by the measurement functions (`divergence`, `bounds`, `tail`).

They turn bad input into a SparrowError that names the argument, the position and what was expected, instead of
a NaN or a shape error deep inside torch. Positions are reported in the caller's leading dims, not flat indices.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparrow.errors import SparrowError


def check_logits(x, name: str) -> tuple[tuple[int, ...], int]:
    """The leading dims and vocabulary size of a floating-point [..., vocab] tensor."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise SparrowError(f"{name} must be a floating-point torch.Tensor [..., vocab], got {describe(x)}")
    if x.dim() < 1:
        raise SparrowError(f"{name} is a 0-dim tensor: expected shape [..., vocab] with at least 1 dim")
    if x.shape[-1] == 0:
        raise SparrowError(f"{name} has shape {tuple(x.shape)} with an empty vocab dim: expected vocab >= 1")
    return tuple(x.shape[:-1]), x.shape[-1]


def check_int_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise SparrowError(f"{name} must be an integer torch.Tensor of token ids, got {describe(x)}")
    return x


def check_temperature(temperature) -> float:
    t = check_number(temperature, "temperature")
    if not (t > 0 and math.isfinite(t)):
        raise SparrowError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def check_number(value, name: str) -> float:
    if isinstance(value, bool):
        raise SparrowError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise SparrowError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(out):
        raise SparrowError(f"{name} must be a number, got NaN")
    return out


def raise_bad_rows(bad: torch.Tensor, offset: int, first, second, lead, temp: float) -> None:
    """Explain the first row whose log-normalizer is not finite: NaN, +inf, all -inf, or overflow.

    `first` and `second` are (flat [rows, vocab] logits, name) pairs; `second` may be None; `offset` is the row
    of bad[0] in them."""
    if not bad.any():
        return
    row = offset + first_index(bad)
    where = position_name(row, lead)
    for flat, name in (first, second) if second is not None else (first,):
        x = flat[row]
        nan = torch.isnan(x)
        if nan.any():
            raise SparrowError(f"{name} has NaN at {where} (vocab index {first_index(nan)}): expected real-valued "
                               f"logits (-inf allowed for masked tokens)")
        pos_inf = torch.isposinf(x)
        if pos_inf.any():
            raise SparrowError(f"{name} has +inf at {where} (vocab index {first_index(pos_inf)}): expected finite "
                               f"logits or -inf for masked tokens")
        if torch.isneginf(x).all():
            raise SparrowError(f"{name} is -inf for every token at {where}: expected at least one unmasked token")
    names = first[1] if second is None else f"{first[1]} or {second[1]}"
    raise SparrowError(f"{names} at {where} overflow float32 after dividing by temperature {temp}: expected "
                       f"logits within float32 range")


def as_float_tensor(values, name: str) -> torch.Tensor:
    """A tensor view of values (tensor, numpy array or list); integers become float64."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(np.asarray(values))
        except (TypeError, ValueError, RuntimeError):
            raise SparrowError(f"{name} must be a tensor or array of numbers, got {describe(values)}") from None
    if values.dtype == torch.bool or values.is_complex():
        raise SparrowError(f"{name} must hold real numbers, got dtype {values.dtype}")
    if values.dtype not in (torch.float32, torch.float64):
        values = values.to(torch.float64)
    return values


def as_positions(positions) -> torch.Tensor:
    """Integer positions as a CPU int64 tensor; floats are accepted only when integral."""
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(np.asarray(positions))
        except (TypeError, ValueError, RuntimeError):
            raise SparrowError(f"positions must be a tensor or array of integers, got {describe(positions)}") \
                from None
    positions = positions.detach().cpu()
    if positions.dtype == torch.bool or positions.is_complex():
        raise SparrowError(f"positions must be integers, got dtype {positions.dtype}")
    if positions.is_floating_point():
        frac = ~torch.isfinite(positions) | (positions != torch.round(positions))
        if frac.any():
            i = first_index(frac.reshape(-1))
            raise SparrowError(f"positions[{i}] = {float(positions.reshape(-1)[i])} is not an integer: "
                               f"expected integer positions")
    return positions.to(torch.int64)


def first_index(mask: torch.Tensor) -> int:
    """Index of the first True in a bool tensor, flattened."""
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def position_name(flat_index: int, lead: tuple[int, ...]) -> str:
    """'position i' or 'position (i, j, ...)' for a flat index into the leading dims."""
    if len(lead) == 0:
        return "position ()"
    idx = tuple(int(i) for i in np.unravel_index(flat_index, lead))
    return f"position {idx[0]}" if len(idx) == 1 else f"position {idx}"


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"
