"""The `records` task: a long ledger of made-up entries and a question about one of them.

Every prompt is generated from a seed, so no data has to be downloaded, and its length is set by the number of
entries, so prompts can be made as long as sparse attention needs (thousands of tokens). Answering needs the
model to find one entry among many: the kind of long-range retrieval that aggressive sparsity can break.
"""

from __future__ import annotations

import random

from sparrow.tasks.fitting import fit_examples

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Keiko", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
ITEMS = ["apples", "books", "candles", "coins", "lamps", "maps", "pencils", "plates", "ropes", "shells", "stamps",
         "tiles"]
PLACES = ["the attic", "the barn", "the cellar", "the garage", "the library", "the office", "the shed",
          "the studio", "the tower", "the workshop"]


def make_example(rng: random.Random, entries: int) -> dict:
    """One prompt (chat messages) with `entries` ledger lines and the integer answer as a string."""
    rows = []
    for number in range(1, entries + 1):
        rows.append((number, rng.choice(NAMES), rng.randint(2, 99), rng.choice(ITEMS), rng.choice(PLACES)))
    number, name, count, item, place = rng.choice(rows)
    ledger = "\n".join(f"Entry {n}: {who} stored {c} {what} in {where}." for n, who, c, what, where in rows)
    question = (f"Here is a storage ledger.\n\n{ledger}\n\nAccording to entry {number}, how many {item} did "
                f"{name} store in {place}? Answer with the number in \\boxed{{}}.")
    return {"prompt": [{"role": "user", "content": question}], "answer": str(count)}


def make_prompts(count: int, min_tokens: int | list[int], seed: int, tokenizer) -> list[dict]:
    """`count` examples whose chat-templated prompts have at least `min_tokens` tokens under `tokenizer` (one
    length, or one per example)."""
    return fit_examples(make_example, count, min_tokens, seed, tokenizer, tokens_per_entry=14)
