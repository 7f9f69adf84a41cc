"""`sparrow generate`: sample completions with a sparse schedule (or in exact mode) and print them (or JSON lines)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from sparrow.datasets import read_prompts, text_problem
from sparrow.engine import Completion, SamplingParams, as_chat, content_keys
from sparrow.engine.exact import exact_summary
from sparrow.engine.waves import prompts_per_wave
from sparrow.errors import SparrowError
from sparrow.io import require_file, write_whole
from sparrow.options import (
    AdaptedModelSection,
    RolloutSection,
    SamplingSection,
    ScheduledSparseSection,
)
from sparrow.typed_config import check_int, option, section

from .config import add_config_options, load_config
from .progress import phase_log


@dataclass
class GenerateSampling(SamplingSection):
    stop: list[str] | None = option(None, "stop string")
    num_logprobs: int = option(20, "top log-probs kept per generated token")

    def params(self, seed: int, **extra) -> SamplingParams:
        return super().params(seed, stop=tuple(self.stop or ()), num_logprobs=self.num_logprobs, **extra)


@dataclass
class GenerateConfig:
    model: AdaptedModelSection = section(AdaptedModelSection)
    sparse: ScheduledSparseSection = section(ScheduledSparseSection)
    sampling: GenerateSampling = section(GenerateSampling, max_new_tokens=128)
    rollout: RolloutSection = section(RolloutSection)
    prompt: str | None = option(None, "one prompt text")
    prompts: str | None = option(None, "JSONL file, one object per line with a 'prompt' field (text or chat "
                                 "messages)")
    seed: int = option(0, "sampling seed")
    num_samples: int = option(1, "completions per prompt")
    chat: bool = option(False, "apply the tokenizer's chat template to text prompts")
    json: bool = option(False, "print one JSON object per completion")

    def validate(self) -> None:
        for part in (self.model, self.sparse, self.sampling):
            part.validate()
        self.rollout.validate(self.model.device, self.sparse.exact, self.sparse.draft)
        self.sampling.check_exact_rule(self.sparse.exact)
        if (self.prompt is None) == (self.prompts is None):
            raise SparrowError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if self.prompts is not None:
            require_file(self.prompts, "prompts file")
        if self.prompt is not None and (problem := text_problem(self.prompt)) is not None:
            raise SparrowError(f"--prompt {problem}")
        check_int("num_samples", self.num_samples, 1)
        check_int("seed", self.seed, 0)


CALL_WAVES = 16
"""Waves per generate call of a --json run without a progress bar (see `_calls`)."""


def _progress(json_output: bool) -> bool:
    """Whether to draw the progress bar (on stderr): always without --json; with it, when stderr is a terminal, so
    a long --json run into a file or pipe is not silent for minutes (scripts reading stderr still get none)."""
    return not json_output or sys.stderr.isatty()


def _calls(config: GenerateConfig, count: int, progress: bool) -> list[range]:
    """The prompt ranges generated one backend call each. One call, except for a --json run without a progress bar
    on our engine in this process: calls of CALL_WAVES whole waves (`prompts_per_wave`), so that completions are
    printed as they finish and a long run reports each call on stderr. Its waves, and with them every token and log-prob, are the ones a single call would decode."""
    rollout = config.rollout
    if progress or rollout.backend != "native" or rollout.workers or rollout.ray_address is not None:
        return [range(count)]
    size = CALL_WAVES * prompts_per_wave(config.num_samples, rollout.max_batch_size)
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def _generate(backend, config: GenerateConfig, prompts: list, calls: list[range], log) -> Iterator[list[Completion]]:
    """The completions of each call in turn, `prompt_index` counted over all prompts; `log` reports each call."""
    inputs, keys = as_chat(prompts) if config.chat else prompts, content_keys(prompts)
    log(f"generating {len(prompts)} prompt(s) x {config.num_samples} sample(s) in {len(calls)} calls")
    for part in calls:
        completions = backend.generate([inputs[i] for i in part], config.sampling.params(config.seed),
                                       config.sparse.parsed_schedule, config.num_samples, progress=_progress(config.json),
                                       prompt_keys=[keys[i] for i in part], draft_tokens=config.sparse.draft)
        for c in completions:
            c.prompt_index += part.start
        log(f"{part.stop}/{len(prompts)} prompts done")
        yield completions


def run(args) -> int:
    config = load_config(GenerateConfig, args)
    prompts = [config.prompt] if config.prompt is not None else read_prompts(config.prompts)
    calls = _calls(config, len(prompts), _progress(config.json))
    log = phase_log("generate") if len(calls) > 1 else lambda _: None  # a short run's stderr stays as it was
    log(f"read {len(prompts)} prompts; loading {config.model.name}")
    model, tokenizer = config.model.load()
    backend = config.rollout.make_backend(config.model, config.sparse, model, tokenizer)
    completions = []
    try:
        for part in _generate(backend, config, prompts, calls, log):
            if config.json:  # printed as each call finishes, whole: an interrupt leaves whole lines
                write_whole(sys.stdout, "".join(json.dumps(c.to_json()) + "\n" for c in part))
            completions += part
    finally:
        backend.close()
    if config.json:
        return 0
    if config.sparse.exact:
        summary = exact_summary(completions)
        print(f"exact mode: {summary['tokens_per_verify']:.2f} tokens per dense verification, "
              f"{summary['drafted_share']:.0%} of tokens drafted by {config.sparse.schedule} and accepted",
              file=sys.stderr)
    for c in completions:
        print(f"=== prompt {c.prompt_index} sample {c.sample_index}: {len(c.token_ids)} tokens, "
              f"{c.finish_reason} ===\n{c.text}")
    sys.stdout.flush()
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate completions with sparse attention")
    add_config_options(parser, GenerateConfig)
    parser.set_defaults(run=run)
