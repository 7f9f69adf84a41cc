"""A fix to vLLM's CPU build that exact mode needs, applied by the plugin (plugin.py) in every vLLM process.

vLLM 0.32's CPU stand-in for the Triton `expand_kernel` (`vllm/utils/cpu_triton_utils.py: _expand_kernel_impl`)
casts its output to int64 when it is not, lets the C++ op write into that copy and never copies it back. The
rejection sampler expands each request's temperature (float32), top-k (int32) and top-p over its draft tokens with
it (`expand_batch_to_tokens`), so under speculative decoding on CPU the target's logits are divided by uninitialised
memory: at temperature > 0 the committed tokens do not follow the target's distribution (a chi-square test on the
tiny model: p 7e-228; with this fix 0.25, and an identical draft is kept every time). CUDA runs Triton's kernel and
is not affected. `fix_expand_kernel` replaces the stand-in with one that writes in place, in the output's dtype;
vLLM reads it when the worker registers its CPU kernel overrides, after the plugins are loaded.
"""

from __future__ import annotations

import torch


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:  # noqa: N803 - vLLM's keyword
    """Triton `expand_kernel`'s contract: request i's value (`replace_from` replaced by `replace_to`) written over
    its tokens, `cu_num_tokens` their cumulative counts, into `output` in place and in its own dtype."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total].copy_(values.repeat_interleave(counts, output_size=total))


def fix_expand_kernel() -> bool:
    """Put `expand` in place of vLLM's CPU stand-in where this vLLM has it (False where it does not)."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return False
    cpu_triton_utils._expand_kernel_impl = expand
    return True
