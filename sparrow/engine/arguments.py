"""The checks of `generate()`'s arguments that every rollout backend makes before any work (the native engine,
the vLLM backend and the Ray backend call the same function, so the same call is refused with the same words)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from sparrow.errors import SparrowError

from .exact import check_draft_tokens
from .sampling import KEY_LIMIT


def check_generate(prompts: Sequence, num_samples: int, prompt_keys: Sequence[int] | None,
                   draft_tokens: int | None = None) -> list[int]:
    """Refuse a call without prompts, with fewer than one sample per prompt, with bad prompt keys or a bad
    `draft_tokens`; return the key of each prompt (`check_prompt_keys`)."""
    if num_samples < 1:
        raise SparrowError(f"num_samples must be >= 1, got {num_samples}")
    if not prompts:
        raise SparrowError("no prompts given")
    keys = check_prompt_keys(prompt_keys, len(prompts))
    if draft_tokens is not None:
        check_draft_tokens(draft_tokens)
    return keys


def check_prompt_keys(prompt_keys: Sequence[int] | None, count: int) -> list[int]:
    """The key of each prompt: the given ones (distinct integers in [0, 2**32)), else the indices 0..count-1."""
    if prompt_keys is None:
        return list(range(count))
    keys = list(prompt_keys)
    if len(keys) != count:
        raise SparrowError(f"prompt_keys has {len(keys)} keys for {count} prompts: expected one key per prompt")
    seen = set()
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or not 0 <= key < KEY_LIMIT:
            raise SparrowError(f"prompt keys must be integers in [0, 2**32), got {key!r}")
        if key in seen:
            raise SparrowError(f"prompt key {key} is given twice: two prompts with one key would share their "
                               "random streams; expected distinct keys")
        seen.add(key)
    return [int(k) for k in keys]
