"""Prompt sets of a required length: examples grown entry by entry until the chat-templated prompt is long enough."""

from __future__ import annotations

import random
from collections.abc import Callable

from sparrow.engine.prompts import encode_prompt
from sparrow.errors import SparrowError


def prompt_length(tokenizer, messages: list[dict]) -> int:
    return len(encode_prompt(tokenizer, messages))


def length_targets(count: int, min_tokens: int, max_tokens: int | None, seed: int) -> list[int]:
    """Each example's minimum prompt length: `min_tokens` for all, or, with `max_tokens`, `count` lengths spread
    evenly from `min_tokens` to `max_tokens` in a seeded order (a mixed-length task whose every length range is
    covered, whatever rows a user takes first)."""
    if max_tokens is None:
        return [min_tokens] * count
    if max_tokens < min_tokens:
        raise SparrowError(f"max_tokens {max_tokens} is below min_tokens {min_tokens}; expected max_tokens >= "
                           "min_tokens")
    spread = [min_tokens + round((max_tokens - min_tokens) * i / max(1, count - 1)) for i in range(count)]
    random.Random(f"lengths-{seed}").shuffle(spread)
    return spread


def fit_examples(make_example: Callable[[random.Random, int], dict], count: int, min_tokens: int | list[int],
                 seed: int, tokenizer, tokens_per_entry: int, reserved_tokens: int = 0) -> list[dict]:
    """`count` examples whose chat-templated prompts have at least `min_tokens` tokens under `tokenizer` (one
    length for all, or one per example, as `length_targets` gives).

    `make_example(rng, entries)` builds one example from `entries` filler lines; the entry count grows until the
    prompt is long enough, replaying the same random draws, so the result depends only on the seed. The first
    guess is `(target - reserved_tokens) // tokens_per_entry` entries: `reserved_tokens` estimates what the prompt
    holds besides its entries (a large manifest), so that the prompt does not start far over its target.
    """
    targets = [min_tokens] * count if isinstance(min_tokens, int) else list(min_tokens)
    if count < 1 or len(targets) != count or min(targets) < 1:
        raise SparrowError(f"count and min_tokens must be >= 1 (one length, or one per example), got {count} and "
                           f"{min_tokens}")
    rng = random.Random(seed)
    examples = []
    for target in targets:
        entries = max(1, (target - reserved_tokens) // tokens_per_entry)
        while True:
            state = rng.getstate()
            example = make_example(rng, entries)
            length = prompt_length(tokenizer, example["prompt"])
            if length >= target:
                break
            rng.setstate(state)
            entries += max(1, (target - length) // tokens_per_entry + 1)
        examples.append(example)
    return examples
