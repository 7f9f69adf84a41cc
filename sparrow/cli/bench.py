"""`sparrow bench`: decode throughput of dense vs sparse attention, and of transformers' generate."""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass

from sparrow.bench import machine_info, run_benchmark
from sparrow.engine import RolloutEngine
from sparrow.errors import SparrowError

from .common import MODEL_HELP, ModelOptions
from .config import add_config_options, load_config


@dataclass
class BenchConfig(ModelOptions):
    schedule: str = "const:1024"
    context: int = 8192
    batch: int = 8
    steps: int = 32
    warmup: int = 4
    repeats: int = 3
    hf: bool = True
    seed: int = 0
    json: bool = False

    def validate(self) -> None:
        super().validate()
        for name in ("context", "batch", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.seed < 0:
            raise SparrowError(f"warmup and seed must be >= 0, got {self.warmup} and {self.seed}")
        if self.parsed_schedule().is_dense:
            raise SparrowError("bench compares dense with a sparse schedule; give --schedule other than 'dense'")


HELP = {
    **MODEL_HELP,
    "context": "cached tokens (prompt length) at which decode is timed",
    "batch": "sequences decoded together (they share one prefill)",
    "steps": "timed decode steps per repeat",
    "warmup": "untimed decode steps before the first repeat",
    "repeats": "timed repeats; the median is reported",
    "hf": "also time transformers' generate (dense SDPA) from the same prefill",
    "json": "print one JSON object with the results",
}


def run(args) -> int:
    config = load_config(BenchConfig, args)
    model, tokenizer = config.load()
    engine = RolloutEngine(model, tokenizer, config.sparse_config(), max_batch_size=config.batch)
    log = (lambda *_: None) if config.json else print
    result = run_benchmark(engine, config.parsed_schedule(), config.context, config.batch, config.steps,
                           config.warmup, config.repeats, config.hf, config.seed, log=log)
    record = {**dataclasses.asdict(result), "config": dataclasses.asdict(config),
              "machine": machine_info(engine.device), "date": datetime.date.today().isoformat()}
    if config.json:
        print(json.dumps(record))
    else:
        print(f"sparse / dense: {result.sparse_over_dense:.2f}x", end="")
        print(f"   dense / transformers generate: {result.dense_over_hf:.2f}x" if result.hf_tokens_per_s else "")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="measure decode throughput, dense vs sparse vs transformers")
    add_config_options(parser, BenchConfig, HELP)
    parser.set_defaults(run=run)
