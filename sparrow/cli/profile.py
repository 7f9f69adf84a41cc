"""`sparrow profile`: per-bin tail acceptance of sparse rollouts against the dense policy, for many schedules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from sparrow.datasets import DataSpec, load_examples, read_prompts
from sparrow.engine import SamplingParams, as_chat, encode_prompt
from sparrow.engine.exact import parse_draft_tokens
from sparrow.errors import SparrowError
from sparrow.io import check_output, require_file
from sparrow.measure.profiling import LENGTH_ORIGINS, answers_hash, check_resumable, prompts_hash, run_profile
from sparrow.options import (
    ANSWER_REWARDS,
    AdaptedModelSection,
    RewardSection,
    RolloutSection,
    SamplingSection,
    SparseSection,
    refuse_draft_tokens,
)
from sparrow.rewards.scoring import score_examples
from sparrow.schedules import Schedule, split_schedules
from sparrow.typed_config import check_int, option, section

from .config import add_config_options, load_config
from .progress import phase_log


@dataclass
class ProfileSampling(SamplingSection):
    ignore_eos: bool = option(False, "keep sampling past end-of-sequence so every completion has max_new_tokens "
                              "tokens (more tokens per bin from short-answering models; the tokens after EOS are off "
                              "the task's distribution)")

    def params(self, seed: int, **extra) -> SamplingParams:
        return super().params(seed, ignore_eos=self.ignore_eos, num_logprobs=1, **extra)


@dataclass
class ProfileConfig:
    model: AdaptedModelSection = section(AdaptedModelSection)
    sparse: SparseSection = section(SparseSection)
    sampling: ProfileSampling = section(ProfileSampling)
    rewards: RewardSection = section(RewardSection)
    rollout: RolloutSection = section(RolloutSection, max_batch_size=16)
    prompts: str | None = option(None, "JSONL file with a 'prompt' field per line (text or chat messages)")
    schedules: str = option("const:256,const:512,const:1024,dense", "schedules to profile, comma-separated (or "
                            "';'-separated), e.g. const:256,const:1024,dense")
    samples_per_prompt: int = option(2, "completions sampled per prompt and schedule")
    seed: int = option(0, "sampling seed")
    bin_size: int = option(256, "tokens per length bin")
    length_origin: str = option("total", "bin by 'total' cached length (prompt + generated, as schedules do) or "
                                "'generated' position")
    chat: bool = option(False, "apply the chat template to text prompts")
    rollout_mode: str = option("sparse", "sparse: teacher-force each schedule's rollouts through the sparse actor; "
                               "exact: sample in exact mode and keep the acceptance each drafted token had while "
                               "decoding (the drafter's, for `calibrate --rollout-mode exact`)")
    draft_tokens: int | str = option(4, "exact mode: tokens drafted per dense verification, or auto (also 0)")
    out: str = option("runs/profile", "output directory (profile.json, profile.csv, plots, raw per-token values)")
    parsed_schedules: dict[str, Schedule] | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        for part in (self.model, self.sparse, self.sampling):
            part.validate()
        self.rewards.validate(default=())
        if self.rollout_mode not in ("sparse", "exact"):
            raise SparrowError(f"unknown rollout mode {self.rollout_mode!r}: expected sparse or exact")
        self.draft_tokens = parse_draft_tokens(self.draft_tokens)
        self.rollout.validate(self.model.device, self.rollout_mode == "exact", self.draft_tokens)
        if self.rollout_mode == "exact" and self.rollout.backend == "vllm":
            raise SparrowError("profile --rollout-mode exact keeps each draft's acceptance from decoding, and vLLM "
                               "keeps its drafts' distributions inside: use --backend native (or sparse mode)")
        self.sampling.check_exact_rule(self.rollout_mode == "exact")
        if self.prompts is None:
            raise SparrowError("give --prompts FILE.jsonl (make long ones with 'sparrow prompts')")
        require_file(self.prompts, "prompts file")
        check_output(self.out, "output directory", directory=True)
        for name in ("samples_per_prompt", "bin_size"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        if self.length_origin not in LENGTH_ORIGINS:
            raise SparrowError(f"length_origin must be one of {', '.join(LENGTH_ORIGINS)}, got {self.length_origin!r}")
        specs = split_schedules(self.schedules)
        if not specs:
            raise SparrowError("give at least one schedule in --schedules")
        if len(set(specs)) != len(specs):
            raise SparrowError(f"--schedules names a schedule twice: {self.schedules!r}")
        self.parsed_schedules = {spec: self.sparse.parse(spec) for spec in specs}

    def check_given(self, given: dict) -> None:
        """Refuse --draft-tokens given explicitly, even at its default, without exact mode."""
        if "draft_tokens" in given and self.rollout_mode != "exact":
            refuse_draft_tokens(given["draft_tokens"])


def check_answers(rewards: list[str], examples: list, path: str) -> None:
    """Rewards that compare with a reference answer need one in every row (null or empty counts as none), as train
    and eval require: checked before any model loads, not found as rewards of 0 after sampling."""
    needs = [name for name in rewards if name in ANSWER_REWARDS]
    missing = [ex.index for ex in examples if ex.answer is None or ex.answer == ""]
    if needs and missing:
        raise SparrowError(f"reward {needs[0]!r} compares with each row's 'answer', but {len(missing)} row(s) of "
                           f"prompts file {path!r} have none (first: row {missing[0]}, counted from 0); give every "
                           "row an answer or another --reward")


def format_retention(retention: dict) -> str:
    """'0.950 [0.900, 1.000]' from Retention.to_json(), with n/a where undefined."""
    value, low, high = (retention[k] for k in ("value", "low", "high"))
    if value is None:
        return "n/a (dense mean reward is 0)"
    return f"{value:.3f} " + (f"[{low:.3f}, {high:.3f}]" if low is not None else "[n/a: one prompt]")


def run(args) -> int:
    config = load_config(ProfileConfig, args)
    prompts = read_prompts(config.prompts)
    rewards = config.rewards.parsed
    examples = load_examples(DataSpec(config.prompts)) if rewards else []
    check_answers(config.rewards.names, examples, config.prompts)
    check_resumable(Path(config.out), config.parsed_schedules, bool(rewards))
    log = phase_log("profile")  # stderr: stdout holds only the result (the tables and where they are written)
    model, tokenizer = config.model.load()
    sparse, sampling = config.sparse.config(), config.sampling
    backend = config.rollout.make_backend(config.model, config.sparse, model, tokenizer)
    meta = {
        "model": config.model.name, "adapter": config.model.adapter, "prompts_file": config.prompts,
        "prompts_hash": prompts_hash(prompts),
        "num_prompts": len(prompts), "samples_per_prompt": config.samples_per_prompt, "chat": config.chat,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": config.seed,
                     "max_new_tokens": sampling.max_new_tokens, "ignore_eos": sampling.ignore_eos},
        "sparse": dataclasses.asdict(sparse), "dtype": config.model.dtype,
        "prompt_tokens_mean": sum(len(encode_prompt(tokenizer, p, config.chat)) for p in prompts) / len(prompts),
        **({"reward": config.rewards.names, "answers_hash": answers_hash(examples)} if rewards else {}),
        **({"rollout": {"mode": "exact", "draft_tokens": config.draft_tokens}}
           if config.rollout_mode == "exact" else {}),
    }
    if sampling.top_k:
        meta["sampling"]["top_k"] = sampling.top_k
    if config.chat:
        prompts = as_chat(prompts)
    reward = (lambda done: score_examples(rewards, examples, done).totals) if rewards else None
    try:
        profile = run_profile(backend, model, prompts, config.parsed_schedules, sampling.params(config.seed),
                              config.samples_per_prompt, sparse, config.bin_size, config.length_origin,
                              Path(config.out), meta, log=log, reward=reward)
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
        print(f"reward {'+'.join(config.rewards.names)}: dense policy mean {first['dense_mean']:.4f} over {first['pairs']} "
              f"paired completions of {first['prompts']} prompts")
        print(f"{'schedule':<22} {'reward':>7}  retention [95% interval]")
        for name, stats in profile["schedules"].items():
            print(f"{name:<22} {stats['reward']['mean']:>7.4f}  {format_retention(stats['reward']['retention'])}")
    print(f"wrote {config.out}/profile.json, profile.csv, p5_vs_length.png, alpha_hist.png")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("profile", help="measure per-bin tail acceptance of sparse schedules vs dense")
    add_config_options(parser, ProfileConfig)
    parser.set_defaults(run=run)
