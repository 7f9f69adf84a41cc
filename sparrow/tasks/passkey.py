"""The `passkey` task: a five-digit pass key hidden at a random depth of a long storage ledger.

It is the built-in RL task for the default model. SmolLM2-135M-Instruct finds the key often enough to learn
from (BENCHMARKS.md, "Training on the passkey task") and not
so often that there is nothing left to learn. The key sits anywhere between the first and last tenth of the
ledger, so the decode steps must attend back to a page far from the sink and recent pages: exactly what an
aggressive sparse budget can miss. Scored by the `first_number` reward.
"""

from __future__ import annotations

import random

from sparrow.tasks.fitting import fit_examples
from sparrow.tasks.records import ITEMS, NAMES, PLACES


def make_example(rng: random.Random, entries: int) -> dict:
    """One prompt (chat messages) with `entries` ledger lines plus the pass key line; the answer is the key."""
    key = str(rng.randint(10000, 99999))
    rows = [f"Entry {n}: {rng.choice(NAMES)} stored {rng.randint(2, 99)} {rng.choice(ITEMS)} in {rng.choice(PLACES)}."
            for n in range(1, entries + 1)]
    rows.insert(rng.randint(entries // 10, entries - entries // 10), f"The pass key is {key}.")
    text = "Here is a storage ledger.\n\n" + "\n".join(rows) + "\n\nWhat is the pass key written in the ledger?"
    return {"prompt": [{"role": "user", "content": text}], "answer": key}


def make_prompts(count: int, min_tokens: int | list[int], seed: int, tokenizer) -> list[dict]:
    """`count` examples whose chat-templated prompts have at least `min_tokens` tokens under `tokenizer` (one
    length, or one per example)."""
    return fit_examples(make_example, count, min_tokens, seed, tokenizer, tokens_per_entry=16)
