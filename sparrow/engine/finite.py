"""The error for logits that are not finite: it names the sequence and token, and tells a temperature too small for
float32 from a model that produced NaN or inf."""

from __future__ import annotations

import torch

from sparrow.errors import SparrowError

from .sampling import HostSample, SamplingParams
from .sequence import Completion


def check_logits_finite(host: HostSample, logits: torch.Tensor, live: list[Completion],
                        sampling: SamplingParams) -> None:
    """Stop with a message naming the first row of `live` whose logits (after temperature) were not all finite
    (`host.finite`, read with the step's tokens: the device is read again only to describe a failure)."""
    if all(host.finite):
        return
    bad = [row for row, finite in enumerate(host.finite) if not finite]
    row, seq = bad[0], live[bad[0]]
    token = len(seq.token_ids) + 1
    where = (f"prompt {seq.prompt_index} (key {seq.prompt_key}), sample {seq.sample_index}, generated token {token} "
             f"(position {len(seq.prompt_token_ids) + token - 1}, logits of "
             f"{'the prefill' if token == 1 else f'decode step {token - 1}'})")
    others = f"; {len(bad) - 1} other sequence(s) of the batch too" if len(bad) > 1 else ""
    values = logits[row].float()
    if bool(torch.isfinite(values).all()):
        raise SparrowError(f"temperature {sampling.temperature} is too small: the model's logits divided by it "
                           f"overflow float32 at {where}{others}; expected a larger temperature, or 0 for greedy")
    kinds = [name for name, hit in (("NaN", values.isnan().any()), ("inf", values.isinf().any())) if bool(hit)]
    raise SparrowError(f"the model's logits contain {' and '.join(kinds)} (before sampling) at {where}{others}; "
                       "expected finite logits: check the model's weights and dtype")
