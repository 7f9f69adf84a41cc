"""`sparrow profile`: per-bin tail acceptance of sparse rollouts against the dense policy, for many schedules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from sparrow.datasets import read_prompts
from sparrow.engine import SamplingParams, as_chat, encode_prompt
from sparrow.errors import SparrowError
from sparrow.measure.profiling import LENGTH_ORIGINS, prompts_hash, run_profile
from sparrow.schedules import Schedule, parse_schedule, split_schedules

from .common import MODEL_HELP, ROLLOUT_HELP, ModelOptions, RolloutOptions, check_output, require_file
from .config import add_config_options, load_config


@dataclass
class ProfileConfig(ModelOptions, RolloutOptions):
    prompts: str | None = None
    schedules: str = "const:256,const:512,const:1024,dense"
    samples_per_prompt: int = 2
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    bin_size: int = 256
    length_origin: str = "total"
    chat: bool = False
    ignore_eos: bool = False
    max_batch_size: int = 16
    out: str = "runs/profile"

    def validate(self) -> None:
        ModelOptions.validate(self)
        RolloutOptions.validate(self)
        if self.prompts is None:
            raise SparrowError("give --prompts FILE.jsonl (make long ones with 'sparrow prompts')")
        require_file(self.prompts, "prompts file")
        check_output(self.out, "output directory", directory=True)
        for name in ("samples_per_prompt", "max_new_tokens", "bin_size", "max_batch_size"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_origin not in LENGTH_ORIGINS:
            raise SparrowError(f"length_origin must be one of {', '.join(LENGTH_ORIGINS)}, got {self.length_origin!r}")
        self.parsed_schedules()
        self.sampling()

    def parsed_schedules(self) -> dict[str, Schedule]:
        sparse = self.sparse_config()
        specs = split_schedules(self.schedules)
        if not specs:
            raise SparrowError("give at least one schedule in --schedules")
        if len(set(specs)) != len(specs):
            raise SparrowError(f"--schedules names a schedule twice: {self.schedules!r}")
        return {spec: parse_schedule(spec, sparse.page_size, sparse.always_kept_pages) for spec in specs}

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, num_logprobs=1, ignore_eos=self.ignore_eos)


HELP = {
    **MODEL_HELP,
    **ROLLOUT_HELP,
    "prompts": "JSONL file with a 'prompt' field per line (text or chat messages)",
    "schedules": "schedules to profile, comma-separated (or ';'-separated), e.g. const:256,const:1024,dense",
    "samples_per_prompt": "completions sampled per prompt and schedule",
    "bin_size": "tokens per length bin",
    "length_origin": "bin by 'total' cached length (prompt + generated, as schedules do) or 'generated' position",
    "chat": "apply the chat template to text prompts",
    "ignore_eos": "keep sampling past end-of-sequence so every completion has max_new_tokens tokens (more tokens "
                  "per bin from short-answering models; the tokens after EOS are off the task's distribution)",
    "out": "output directory (profile.json, profile.csv, plots, raw per-token values)",
}


def run(args) -> int:
    config = load_config(ProfileConfig, args)
    prompts = read_prompts(config.prompts)
    model, tokenizer = config.load()
    sparse = config.sparse_config()
    backend = config.make_backend(config, model, tokenizer, config.max_batch_size)
    meta = {
        "model": config.model, "adapter": config.adapter, "prompts_file": config.prompts,
        "prompts_hash": prompts_hash(prompts),
        "num_prompts": len(prompts), "samples_per_prompt": config.samples_per_prompt, "chat": config.chat,
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "seed": config.seed,
                     "max_new_tokens": config.max_new_tokens, "ignore_eos": config.ignore_eos},
        "sparse": dataclasses.asdict(sparse), "dtype": config.dtype,
        "prompt_tokens_mean": sum(len(encode_prompt(tokenizer, p, config.chat)) for p in prompts) / len(prompts),
    }
    if config.chat:
        prompts = as_chat(prompts)
    try:
        profile = run_profile(backend, model, prompts, config.parsed_schedules(), config.sampling(),
                              config.samples_per_prompt, sparse, config.bin_size, config.length_origin,
                              Path(config.out), meta)
    finally:
        backend.close()
    print(f"{'schedule':<22} {'tokens':>7} {'mean':>7} {'>0.999':>7} {'p5':>7}   p5 per bin")
    for name, stats in profile["schedules"].items():
        overall = stats["overall"]
        per_bin = " ".join(f"{b['p5']:.3f}" for b in stats["bins"])
        print(f"{name:<22} {stats['tokens']:>7} {overall['mean']:>7.4f} {overall['frac_above_tail']:>7.3f} "
              f"{overall['p5']:>7.4f}   {per_bin}")
    print(f"wrote {config.out}/profile.json, profile.csv, p5_vs_length.png, alpha_hist.png")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("profile", help="measure per-bin tail acceptance of sparse schedules vs dense")
    add_config_options(parser, ProfileConfig, HELP, skip=("schedule",))
    parser.set_defaults(run=run)
