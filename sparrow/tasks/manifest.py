"""The `manifest` task: copy a numbered manifest of five-digit codes hidden at a random depth of a long ledger.

A long-generation task for the default model: the answer is every code of the manifest (16 by default, about
150 tokens), scored by the F1 of the codes found in the completion against the manifest's (`number_f1`), so a
partly right answer earns partial reward. Copying a block from far back in the prompt, line after line, is what
aggressive sparse budgets break. The prompt starts the assistant's answer with "1. " (a final assistant message,
continued by the chat template): without it SmolLM2-135M-Instruct at temperature 1 mostly opens with prose or a
count and never recovers; with it, it copies about half the codes (benchmarks/history/round-2.md, "A long-generation
task for SmolLM2-135M").
"""

from __future__ import annotations

import functools
import random

from .fitting import fit_examples
from .records import ITEMS, NAMES, PLACES

CODES = 16
ANSWER_START = "1. "


def make_example(rng: random.Random, entries: int, codes: int = CODES) -> dict:
    """One prompt (chat messages) with `entries` ledger lines and a manifest of `codes` distinct codes."""
    manifest: list[str] = []
    while len(manifest) < codes:
        code = str(rng.randint(10000, 99999))
        if code not in manifest:
            manifest.append(code)
    rows = [f"Entry {n}: {rng.choice(NAMES)} stored {rng.randint(2, 99)} {rng.choice(ITEMS)} in {rng.choice(PLACES)}."
            for n in range(1, entries + 1)]
    block = "MANIFEST\n" + "\n".join(f"{i}. {c}" for i, c in enumerate(manifest, start=1)) + "\nEND OF MANIFEST"
    rows.insert(rng.randint(entries // 10, entries - entries // 10), block)
    text = ("Here is a storage ledger with a manifest somewhere in it.\n\n" + "\n".join(rows) +
            "\n\nCopy the manifest: write each of its numbered codes on its own line.")
    return {"prompt": [{"role": "user", "content": text}, {"role": "assistant", "content": ANSWER_START}],
            "answer": manifest}


def make_prompts(count: int, min_tokens: int | list[int], seed: int, tokenizer, codes: int = CODES) -> list[dict]:
    """`count` examples whose chat-templated prompts have at least `min_tokens` tokens under `tokenizer` (one
    length, or one per example), each with a manifest of `codes` codes (about 9 answer tokens a code).

    The ledger's first guess leaves room for the codes beyond the default 16 (about 10 prompt tokens each), so a
    large manifest does not push the prompt far over `min_tokens`; the default's prompt sets are unchanged."""
    return fit_examples(functools.partial(make_example, codes=codes), count, min_tokens, seed, tokenizer,
                        tokens_per_entry=16, reserved_tokens=10 * max(0, codes - CODES))
