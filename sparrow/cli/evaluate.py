"""`sparrow eval`: mean@k and unbiased pass@k of dense or sparse rollouts, with the training rewards."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from sparrow.datasets import DataSpec, load_examples
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.evaluation import evaluate
from sparrow.rewards import load_reward
from sparrow.rewards.sandbox import require_sandbox

from .common import MODEL_HELP, ROLLOUT_HELP, ModelOptions, RolloutOptions, require_file
from .config import add_config_options, load_config


@dataclass
class EvalConfig(ModelOptions, RolloutOptions):
    data: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    reward: list[str] | None = None
    k: int = 16
    threshold: float = 1.0
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    json: bool = False
    unsafe_code_reward: bool = False

    def validate(self) -> None:
        ModelOptions.validate(self)
        RolloutOptions.validate(self)
        if self.data is None:
            raise SparrowError("give the prompt data: --data FILE.jsonl|.parquet")
        require_file(self.data, "data file")
        if self.k < 1:
            raise SparrowError(f"k must be >= 1, got {self.k}")
        if not math.isfinite(self.threshold):
            raise SparrowError(f"threshold must be a finite total reward, got {self.threshold}")
        self.rewards()
        if "code" in (self.reward or []):
            require_sandbox(allow_unsafe=self.unsafe_code_reward)
        self.sampling()

    def rewards(self) -> list:
        return [(name, load_reward(name), 1.0) for name in (self.reward or ["math"])]

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, num_logprobs=1)


HELP = {**MODEL_HELP, **ROLLOUT_HELP, "data": "prompt set (.jsonl or .parquet)", "reward": "reward function(s), as for train",
        "k": "samples per prompt", "threshold": "total reward at which a sample counts as passing",
        "json": "print one JSON object",
        "unsafe_code_reward": "let the code reward run without a sandbox where none is available (dangerous)"}


def run(args) -> int:
    config = load_config(EvalConfig, args)
    examples = load_examples(DataSpec(config.data, config.prompt_field, config.answer_field))
    model, tokenizer = config.load()
    backend = config.make_backend(config, model, tokenizer)
    try:
        result = evaluate(backend, examples, config.rewards(), config.parsed_schedule(), config.sampling(), config.k,
                          config.threshold, progress=not config.json)
    finally:
        backend.close()
    result["schedule"] = config.schedule
    if config.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("eval", help="mean@k and pass@k of dense or sparse rollouts")
    add_config_options(parser, EvalConfig, HELP)
    parser.set_defaults(run=run)
