"""`sparrow generate`: sample completions with a sparse schedule and print them (or JSON lines)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from sparrow.datasets import read_prompts
from sparrow.engine import SamplingParams, as_chat, content_keys
from sparrow.errors import SparrowError

from .common import MODEL_HELP, ROLLOUT_HELP, ModelOptions, RolloutOptions, require_file
from .config import add_config_options, load_config


@dataclass
class GenerateConfig(ModelOptions, RolloutOptions):
    prompt: str | None = None
    prompts: str | None = None
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_samples: int = 1
    stop: list[str] | None = None
    chat: bool = False
    num_logprobs: int = 20
    max_batch_size: int = 64
    json: bool = False

    def validate(self) -> None:
        super().validate()
        RolloutOptions.validate(self)
        if (self.prompt is None) == (self.prompts is None):
            raise SparrowError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if self.prompts is not None:
            require_file(self.prompts, "prompts file")
        if self.num_samples < 1:
            raise SparrowError(f"num_samples must be >= 1, got {self.num_samples}")
        self.sampling()

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=tuple(self.stop or ()),
                              num_logprobs=self.num_logprobs)


HELP = {
    **MODEL_HELP,
    **ROLLOUT_HELP,
    "prompt": "one prompt text",
    "prompts": "JSONL file, one object per line with a 'prompt' field (text or chat messages)",
    "temperature": "sampling temperature; 0 = greedy",
    "top_k": "keep the k most likely tokens; 0 = off",
    "stop": "stop string",
    "chat": "apply the tokenizer's chat template to text prompts",
    "num_logprobs": "top log-probs kept per generated token",
    "json": "print one JSON object per completion",
}


def run(args) -> int:
    config = load_config(GenerateConfig, args)
    prompts = [config.prompt] if config.prompt is not None else read_prompts(config.prompts)
    model, tokenizer = config.load()
    backend = config.make_backend(config, model, tokenizer, config.max_batch_size)
    try:
        completions = backend.generate(as_chat(prompts) if config.chat else prompts, config.sampling(),
                                       config.parsed_schedule(), config.num_samples, progress=not config.json,
                                       prompt_keys=content_keys(prompts))
    finally:
        backend.close()
    for c in completions:
        if config.json:
            print(json.dumps(c.to_json()))
        else:
            print(f"=== prompt {c.prompt_index} sample {c.sample_index}: {len(c.token_ids)} tokens, "
                  f"{c.finish_reason} ===\n{c.text}")
    sys.stdout.flush()
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate completions with sparse attention")
    add_config_options(parser, GenerateConfig, HELP)
    parser.set_defaults(run=run)
