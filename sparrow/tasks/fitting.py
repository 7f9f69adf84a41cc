"""Prompt sets of a required length: examples grown entry by entry until the chat-templated prompt is long enough."""

from __future__ import annotations

import random
from collections.abc import Callable

from sparrow.engine.prompts import encode_prompt
from sparrow.errors import SparrowError


def prompt_length(tokenizer, messages: list[dict]) -> int:
    return len(encode_prompt(tokenizer, messages))


def fit_examples(make_example: Callable[[random.Random, int], dict], count: int, min_tokens: int, seed: int,
                 tokenizer, tokens_per_entry: int) -> list[dict]:
    """`count` examples whose chat-templated prompts have at least `min_tokens` tokens under `tokenizer`.

    `make_example(rng, entries)` builds one example from `entries` filler lines; the entry count grows until the
    prompt is long enough, replaying the same random draws, so the result depends only on the seed.
    """
    if count < 1 or min_tokens < 1:
        raise SparrowError(f"count and min_tokens must be >= 1, got {count} and {min_tokens}")
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        entries = max(1, min_tokens // tokens_per_entry)
        while True:
            state = rng.getstate()
            example = make_example(rng, entries)
            length = prompt_length(tokenizer, example["prompt"])
            if length >= min_tokens:
                break
            rng.setstate(state)
            entries += max(1, (min_tokens - length) // tokens_per_entry + 1)
        examples.append(example)
    return examples
