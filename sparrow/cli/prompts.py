"""`sparrow prompts`: write a built-in prompt set (no download) as JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_text, check_output
from sparrow.tasks import get_task
from sparrow.tasks.fitting import length_targets, prompt_length
from sparrow.typed_config import option

from .config import add_config_options, load_config


@dataclass
class PromptsConfig:
    task: str = option("records", "records: a long storage ledger and a question about one entry (answer: an integer, "
                                  "math reward); passkey: a pass key hidden in a long ledger (answer: five digits, "
                                  "first_number reward); manifest: copy a numbered list of 16 codes hidden in a long "
                                  "ledger, the answer started with '1. ' (answer: the codes, number_f1 reward; a "
                                  "long-generation task)")
    count: int = option(8, "number of prompts")
    codes: int | None = option(None, "manifest only: codes in each manifest (default 16, about 150 answer tokens; "
                                     "64 makes answers of about 600)")
    min_tokens: int = option(3000, "minimum prompt length in tokens, chat template included (a prompt may run up "
                                   "to about a quarter over its target: its ledger starts from a per-task estimate "
                                   "of whole entries, which seeded prompt sets keep)")
    max_tokens: int | None = option(None, "with it, the prompts' minimum lengths spread evenly from min_tokens to "
                                          "max_tokens (a mixed-length set; a target, not a cap)")
    seed: int = option(0, "")
    model: str = option("smollm2-135m", "whose tokenizer measures the length")
    out: str | None = option(None, "output JSONL file (default: standard output)")

    def validate(self) -> None:
        get_task(self.task)
        if self.codes is not None and (self.task != "manifest" or not 1 <= self.codes <= 1000):
            raise SparrowError(f"codes {self.codes}: expected 1 to 1000, with --task manifest (got task "
                               f"{self.task!r})")
        if self.count < 1 or self.min_tokens < 1:
            raise SparrowError(f"count and min_tokens must be >= 1, got {self.count} and {self.min_tokens}")
        length_targets(self.count, self.min_tokens, self.max_tokens, self.seed)
        if self.seed < 0:
            raise SparrowError(f"seed must be >= 0, got {self.seed}")
        if self.out:
            check_output(self.out, "output file", directory=False)


def run(args) -> int:
    config = load_config(PromptsConfig, args)
    from sparrow.models import load_model

    model, tokenizer = load_model(config.model)
    context = model.config.max_position_embeddings
    targets = length_targets(config.count, config.min_tokens, config.max_tokens, config.seed)
    _check_fits(config, "at least", max(targets), context)  # before building prompts that long
    extra = {} if config.codes is None else {"codes": config.codes}
    rows = get_task(config.task)(config.count, targets, config.seed, tokenizer, **extra)
    if config.codes is not None:
        _check_answer_fits(config, rows, tokenizer, context)
    _check_fits(config, "up to", max(prompt_length(tokenizer, row["prompt"]) for row in rows), context)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if config.out:
        atomic_write_text(config.out, text)
    else:
        print(text, end="")
    return 0


def _check_answer_fits(config: PromptsConfig, rows: list[dict], tokenizer, context: int) -> None:
    """Refuse manifests whose answer (the codes again, numbered) no longer fits after the prompt: --codes sets both
    the prompt's manifest and the answer's length, so only fewer codes help once the manifest alone fills half."""
    answer = max(len(tokenizer("\n".join(f"{i}. {c}" for i, c in enumerate(row["answer"], start=1)),
                               add_special_tokens=False)["input_ids"]) for row in rows)
    longest = max(prompt_length(tokenizer, row["prompt"]) for row in rows)
    if longest + answer > context and not (longest >= context and 2 * answer < context):  # else: min_tokens
        asked = "max_tokens" if config.max_tokens is not None else "min_tokens"
        hint = "fewer --codes" if 2 * answer >= context else f"fewer --codes or a smaller {asked}"
        raise SparrowError(f"codes {config.codes} make an answer of {answer} tokens (the manifest, copied), which "
                           f"after prompts of up to {longest} tokens does not fit model {config.model!r}'s "
                           f"max_position_embeddings {context}; expected {hint}")


def _check_fits(config: PromptsConfig, bound: str, tokens: int, context: int) -> None:
    """Refuse prompts of `tokens` tokens that fill the model's `context` positions, leaving none for an answer."""
    if tokens >= context:
        asked = "max_tokens" if config.max_tokens is not None else "min_tokens"
        value = config.max_tokens if config.max_tokens is not None else config.min_tokens
        raise SparrowError(f"{asked} {value} makes prompts of {bound} {tokens} tokens (whole ledger "
                           f"entries, question and chat template included), but model {config.model!r} has "
                           f"max_position_embeddings {context}, which must also hold the answer; expected a smaller "
                           f"{asked}")


def add_parser(sub) -> None:
    parser = sub.add_parser("prompts", help="write a built-in long-prompt set as JSONL")
    add_config_options(parser, PromptsConfig)
    parser.set_defaults(run=run)
