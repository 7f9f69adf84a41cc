"""Stop rules: when a completion ends (an end-of-sequence token unless ignored, a stop string in its text, or
max_new_tokens) and its final text, cut before the first stop string."""

from __future__ import annotations

from collections.abc import Sequence

from .sampling import SamplingParams
from .sequence import Completion


def eos_ids(tokenizer, model) -> set[int]:
    """The end-of-sequence token ids: the tokenizer's and those of the model's generation config."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids


def finish_reason(seq: Completion, eos: set[int], sampling: SamplingParams, tokenizer) -> str | None:
    """Why `seq` ends at its last token: "stop" (an end-of-sequence token unless `sampling.ignore_eos`, or a stop
    string in its text), "length" (`sampling.max_new_tokens` reached), or None while it goes on."""
    if (seq.token_ids[-1] in eos and not sampling.ignore_eos) or _hit_stop(seq, sampling, tokenizer):
        return "stop"
    if len(seq.token_ids) >= sampling.max_new_tokens:
        return "length"
    return None


def _hit_stop(seq: Completion, sampling: SamplingParams, tokenizer) -> bool:
    if not sampling.stop:
        return False
    window = max(len(s) for s in sampling.stop) + 1  # tokens hold at least one character each
    tail = tokenizer.decode(seq.token_ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in sampling.stop)


def final_text(tokenizer, token_ids: Sequence[int], stop: Sequence[str]) -> str:
    """A completion's text: its tokens decoded without special tokens, cut before the first stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
