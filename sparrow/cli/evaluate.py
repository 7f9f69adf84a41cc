"""`sparrow eval`: mean@k and unbiased pass@k of dense or sparse rollouts, with the training rewards."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from sparrow.datasets import DataSpec, load_examples
from sparrow.errors import SparrowError
from sparrow.evaluation import evaluate, interval_text
from sparrow.options import AdaptedModelSection, DataSection, RolloutSection, SamplingSection, ScheduledSparseSection
from sparrow.rewards.scoring import check_reward_functions
from sparrow.typed_config import check_int, option, section

from .config import add_config_options, load_config
from .progress import phase_log


@dataclass
class EvalConfig:
    model: AdaptedModelSection = section(AdaptedModelSection)
    sparse: ScheduledSparseSection = section(ScheduledSparseSection)
    sampling: SamplingSection = section(SamplingSection)
    data: DataSection = section(DataSection)
    rollout: RolloutSection = section(RolloutSection)
    k: int = option(16, "samples per prompt")
    threshold: float = option(1.0, "total reward at which a sample counts as passing")
    seed: int = option(0, "sampling seed")
    json: bool = option(False, "print one JSON object")

    def validate(self) -> None:
        for part in (self.model, self.sparse, self.sampling, self.data):
            part.validate()
        self.rollout.validate(self.model.device, self.sparse.exact, self.sparse.draft)
        self.sampling.check_exact_rule(self.sparse.exact)
        check_int("k", self.k, 1)
        check_int("seed", self.seed, 0)
        if not math.isfinite(self.threshold):
            raise SparrowError(f"threshold must be a finite total reward, got {self.threshold}")
        self.data.check_answers(("data", self.data.path))


def run(args) -> int:
    config = load_config(EvalConfig, args)
    log = phase_log("eval")  # stderr: stdout holds only the result (its lines, or --json)
    data = config.data
    examples = load_examples(DataSpec(data.path, data.prompt_field, data.answer_field))
    check_reward_functions(data.parsed, examples)
    model, tokenizer = config.model.load()
    backend = config.rollout.make_backend(config.model, config.sparse, model, tokenizer)
    log(f"sampling {len(examples)} prompts x {config.k} ({config.sparse.rollout_mode} rollouts, schedule "
        f"{config.sparse.schedule}), then scoring with {', '.join(data.names)}")
    try:
        result = evaluate(backend, examples, data.parsed, config.sparse.parsed_schedule,
                          config.sampling.params(config.seed, num_logprobs=1), config.k, config.threshold,
                          progress=True, draft_tokens=config.sparse.draft)
    finally:
        backend.close()
    result["schedule"] = config.sparse.schedule
    result["rollout_mode"] = config.sparse.rollout_mode
    if config.json:
        print(json.dumps(result))
        return 0
    for key, value in result.items():
        if key == "mean_low":
            print(f"{'interval':>20}: {interval_text(result)}")
        elif key != "mean_high":
            print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("eval", help="mean@k and pass@k of dense or sparse rollouts")
    add_config_options(parser, EvalConfig)
    parser.set_defaults(run=run)
