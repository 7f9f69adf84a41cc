"""Built-in prompt sets generated from a seed (no download), by name: `records` (profiling), `passkey` (RL) and
`manifest` (RL with long answers).

Each task is `make_prompts(count, min_tokens, seed, tokenizer) -> list of {"prompt": messages, "answer": ...}`,
where min_tokens is one length or one per example (`fitting.length_targets` spreads them for mixed lengths).
"""

from __future__ import annotations

from collections.abc import Callable

from sparrow.errors import SparrowError

from . import manifest, passkey, records

TASKS: dict[str, Callable[..., list[dict]]] = {"records": records.make_prompts, "passkey": passkey.make_prompts,
                                               "manifest": manifest.make_prompts}


def get_task(name: str) -> Callable[..., list[dict]]:
    """The `make_prompts` of the task called `name`."""
    if name not in TASKS:
        raise SparrowError(f"unknown task {name!r}: expected one of {', '.join(TASKS)}")
    return TASKS[name]
