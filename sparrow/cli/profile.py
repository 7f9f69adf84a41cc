"""`sparrow profile`: per-bin tail acceptance of sparse rollouts against the dense policy, for many schedules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from sparrow.datasets import DataSpec, load_examples, read_prompts
from sparrow.engine import SamplingParams, as_chat, encode_prompt
from sparrow.errors import SparrowError
from sparrow.measure.profiling import LENGTH_ORIGINS, prompts_hash, run_profile
from sparrow.rewards import load_reward
from sparrow.rewards.sandbox import require_sandbox
from sparrow.rewards.scoring import score_examples
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
    reward: list[str] | None = None
    unsafe_code_reward: bool = False

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
        self.rewards()
        if "code" in (self.reward or []):
            require_sandbox(allow_unsafe=self.unsafe_code_reward)

    def rewards(self) -> list:
        """[(name, function, 1.0), ...] of --reward (none without it)."""
        return [(name, load_reward(name), 1.0) for name in self.reward or []]

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
    "reward": "reward function(s), as for train; each schedule's completions and the dense policy's paired ones "
              "(same seed and sample) are scored, for the reward retention (the prompts' rows carry its fields)",
    "unsafe_code_reward": "let the code reward run without a sandbox where none is available (dangerous)",
}


def format_retention(retention: dict) -> str:
    """'0.950 [0.900, 1.000]' from Retention.to_json(), with n/a where undefined."""
    value, low, high = (retention[k] for k in ("value", "low", "high"))
    if value is None:
        return "n/a (dense mean reward is 0)"
    return f"{value:.3f} " + (f"[{low:.3f}, {high:.3f}]" if low is not None else "[n/a: one prompt]")


def run(args) -> int:
    config = load_config(ProfileConfig, args)
    prompts = read_prompts(config.prompts)
    rewards = config.rewards()
    examples = load_examples(DataSpec(config.prompts)) if rewards else []
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
        **({"reward": config.reward} if rewards else {}),
    }
    if config.chat:
        prompts = as_chat(prompts)
    reward = (lambda done: score_examples(rewards, examples, done).totals) if rewards else None
    try:
        profile = run_profile(backend, model, prompts, config.parsed_schedules(), config.sampling(),
                              config.samples_per_prompt, sparse, config.bin_size, config.length_origin,
                              Path(config.out), meta, reward=reward)
    finally:
        backend.close()
    print(f"{'schedule':<22} {'tokens':>7} {'mean':>7} {'>0.999':>7} {'p5':>7}   p5 per bin")
    for name, stats in profile["schedules"].items():
        overall = stats["overall"]
        per_bin = " ".join(f"{b['p5']:.3f}" for b in stats["bins"])
        print(f"{name:<22} {stats['tokens']:>7} {overall['mean']:>7.4f} {overall['frac_above_tail']:>7.3f} "
              f"{overall['p5']:>7.4f}   {per_bin}")
    if rewards:
        first = next(iter(profile["schedules"].values()))["reward"]["retention"]
        print(f"reward {'+'.join(config.reward)}: dense policy mean {first['dense_mean']:.4f} over {first['pairs']} "
              f"paired completions of {first['prompts']} prompts")
        print(f"{'schedule':<22} {'reward':>7}  retention [95% interval]")
        for name, stats in profile["schedules"].items():
            print(f"{name:<22} {stats['reward']['mean']:>7.4f}  {format_retention(stats['reward']['retention'])}")
    print(f"wrote {config.out}/profile.json, profile.csv, p5_vs_length.png, alpha_hist.png")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("profile", help="measure per-bin tail acceptance of sparse schedules vs dense")
    add_config_options(parser, ProfileConfig, HELP, skip=("schedule",))
    parser.set_defaults(run=run)
