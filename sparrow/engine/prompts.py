"""How a prompt becomes token ids: text, chat messages (always templated) or ids as they are."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from sparrow.errors import SparrowError

Prompt = str | list[dict] | list[int]


def as_chat(prompts: list[Prompt]) -> list[Prompt]:
    """Text prompts as one user message each, so that whatever backend samples them applies the chat template."""
    return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]


def content_keys(prompts: list[Prompt], limit: int = 2**32) -> list[int]:
    """A random-stream key per prompt from its content and the number of identical prompts before it, so that with
    a seed the samples of a prompt do not depend on the other prompts of a file or their order. Distinct keys in
    [0, limit): a hash collision (rare) takes the next free key."""
    keys, copies, taken = [], Counter(), set()
    for prompt in prompts:
        text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(f"{copies[text]}:{text}".encode()).digest()
        copies[text] += 1
        key = int.from_bytes(digest[:8], "big") % limit
        while key in taken:
            key = (key + 1) % limit
        taken.add(key)
        keys.append(key)
    return keys


def chat_template_mode(messages: list[dict]) -> dict:
    """How to template chat messages (TRL's rule): a last message from the assistant is the start of the answer and
    is continued; otherwise the assistant's turn is opened."""
    if messages and messages[-1].get("role") == "assistant":
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def encode_prompt(tokenizer, prompt: Prompt, apply_chat_template: bool = False) -> list[int]:
    """Token ids of a prompt; `apply_chat_template` templates text prompts as one user message. Chat messages are
    always templated, a final assistant message continued (`chat_template_mode`)."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, **chat_template_mode(prompt))
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    elif isinstance(prompt, str) and apply_chat_template:
        return encode_prompt(tokenizer, [{"role": "user", "content": prompt}])
    elif isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        raise SparrowError(f"a prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
    if not ids:
        raise SparrowError("a prompt encodes to no tokens")
    return ids
