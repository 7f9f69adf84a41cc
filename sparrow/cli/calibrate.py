"""`sparrow calibrate`: the cheapest schedule holding the 5th-percentile acceptance at or above tau per bin."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sparrow.errors import SparrowError
from sparrow.io import check_output, require_file
from sparrow.measure.calibration import (
    UNREACHED_ACTIONS,
    always_kept_pages,
    calibrate,
    eligible_schedules,
    exact_candidates,
    profile_retention,
    retention_floor,
)
from sparrow.measure.cost_model import compare
from sparrow.measure.profiling import read_profile
from sparrow.model_shapes import model_dims
from sparrow.schedules import parse_schedule, write_schedule_json
from sparrow.typed_config import option, section

from .config import add_config_options, load_config
from .machine import MachineSection
from .profile import format_retention


@dataclass
class CalibrateConfig:
    profile: str | None = option(None, "profile.json written by 'sparrow profile'")
    tau: float = option(0.86, "target 5th percentile of the acceptance rate in every bin")
    margin: float = option(0.0, "extra headroom above tau against measurement noise")
    min_tokens: int = option(50, "tokens a bin needs before its percentile is trusted")
    out: str = option("schedule.json", "schedule file to write (JSON; any command's --schedule accepts it)")
    machine: MachineSection = section(MachineSection)
    samples: int = option(8, "samples per prompt assumed by the predicted speedup")
    rollout_mode: str = option("sparse", "sparse: the cheapest schedule holding tau; exact: the schedule and draft "
                               "length the cost model predicts fastest in exact mode (the budget then sets speed only)")
    min_retention: float | None = option(None, "least reward retention (sparse mean reward / dense, from 'sparrow "
                                               "profile --reward') a schedule must keep to be a candidate; every bin "
                                               "gets at least the cheapest such one's budget")
    unreached: str = option("fail", "a bin where no profiled budget reaches tau + margin: fail (naming the budgets to "
                            "profile) or dense (a budget covering the bin, reported as such)")

    def validate(self) -> None:
        if self.profile is None:
            raise SparrowError("give --profile DIR/profile.json (made by 'sparrow profile')")
        require_file(self.profile, "profile")
        check_output(self.out, "output file", directory=False)
        if os.path.exists(self.out) and os.path.samefile(self.out, self.profile):
            raise SparrowError(f"--out {self.out!r} is the profile itself: writing the schedule there would replace "
                               "the profile; give another --out (e.g. schedule.json)")
        if self.min_tokens < 1 or self.samples < 1:
            raise SparrowError(f"min_tokens and samples must be >= 1, got {self.min_tokens} and {self.samples}")
        self.machine.validate()
        if self.unreached not in UNREACHED_ACTIONS:
            raise SparrowError(f"unknown --unreached {self.unreached!r}: expected one of {', '.join(UNREACHED_ACTIONS)}")
        if self.rollout_mode not in ("sparse", "exact"):
            raise SparrowError(f"unknown rollout mode {self.rollout_mode!r}: expected sparse or exact")
        if self.rollout_mode == "exact" and self.unreached != "fail":
            raise SparrowError("--unreached picks budgets against tau for sparse rollouts; exact mode needs no tau, "
                               "so it takes no --unreached")
        if self.rollout_mode == "exact" and self.min_retention is not None:
            raise SparrowError("--min-retention guards sparse rollouts' reward; exact mode keeps the dense reward, "
                               "so it takes no --min-retention")


def print_candidates(profile: dict, min_retention: float, page_size: int) -> None:
    """Per profiled schedule: its reward retention with interval and verdict, eligibility and p5 per bin."""
    eligible = eligible_schedules(profile, min_retention)
    print(f"candidates (eligible: retention estimate >= {min_retention}; verdict: its 95% interval against it):")
    print(f"{'schedule':<22} {'retention [95% interval]':<28} {'verdict':<10} {'eligible':<8}  p5 per bin")
    for name, retention in profile_retention(profile).items():
        per_bin = " ".join(f"{b['p5']:.3f}" for b in profile["schedules"][name]["bins"])
        print(f"{name:<22} {format_retention(retention.to_json()):<28} {retention.verdict(min_retention):<10} "
              f"{'yes' if name in eligible else 'no':<8}  {per_bin}")
    print(f"every bin gets at least the budget of {retention_floor(profile, min_retention, page_size)}, the "
          "cheapest eligible schedule")


def run_exact(config: CalibrateConfig, profile: dict, page_size: int) -> int:
    """Exact mode: every profiled schedule's predicted speed with its best draft length; the fastest is written."""
    meta = profile.get("meta", {})
    if "model" not in meta:
        raise SparrowError(f"{config.profile} names no model: the cost model needs its shape")
    hw = config.machine.spec()
    rows = exact_candidates(profile, model_dims(meta["model"]), hw, config.samples,
                            pricing=config.machine.pricing(page_size=page_size))
    print(f"exact mode on {hw.name} (cost model; acceptance: each schedule's mean alpha per bin of the profile, an "
          "estimate of the coupled acceptance at each length; alpha: its mean over the trajectory):")
    print(f"{'schedule':<22} {'alpha':>6} {'K':>3} {'tokens/verify':>14} {'exact/dense':>12} {'sparse/dense':>13}")
    for row in rows:
        print(f"{row['schedule']:<22} {row['acceptance']:>6.3f} {row['draft_tokens']:>3} "
              f"{row['tokens_per_verify']:>14.2f} {row['exact_over_dense']:>11.2f}x {row['sparse_over_dense']:>12.2f}x")
    best = rows[0]
    entry = profile["schedules"][best["schedule"]]
    schedule = parse_schedule(entry["spec"], page_size, always_kept_pages(meta))
    write_schedule_json(schedule, config.out, page_size)
    print(f"fastest: {best['schedule']} with --draft-tokens {best['draft_tokens']}; wrote {config.out} "
          f"(use: --rollout-mode exact --schedule {config.out} --draft-tokens {best['draft_tokens']})")
    if best["exact_over_dense"] < 1:
        print(f"note: on {hw.name} every schedule's exact mode is predicted slower than dense decoding (best "
              f"{best['exact_over_dense']:.2f}x); its rollouts are dense sampling's tokens, so --schedule dense gives "
              "the same rollouts faster here")
    return 0


def run(args) -> int:
    config = load_config(CalibrateConfig, args)
    profile = read_profile(config.profile)
    meta = profile.get("meta", {})
    page_size = meta.get("sparse", {}).get("page_size", 16)
    if config.rollout_mode == "exact":
        return run_exact(config, profile, page_size)
    schedule, choices = calibrate(profile, config.tau, config.margin, config.min_tokens, page_size,
                                  config.min_retention, config.unreached)
    if config.min_retention is not None:
        print_candidates(profile, config.min_retention, page_size)
    print(f"calibrated for tau = {config.tau} (margin {config.margin}), bins of {meta.get('bin_size')} tokens:")
    print(f"{'bin (cached tokens)':>22} {'tokens':>7} {'p5':>7} {'cheapest':>9} {'schedule':>9}  {'bound by':<22} "
          "measured with")
    for c in choices:
        print(f"{f'[{c.start}, {c.end})':>22} {c.tokens:>7} {c.p5:>7.4f} {c.budget:>9} "
              f"{schedule.budget_at(c.start):>9}  {c.bound_by:<22} {c.source}")
    print("(cheapest: the smallest budget reaching tau + margin in the bin; schedule: after making budgets "
          "non-decreasing in length and, with --min-retention, at least the reward floor's; bound by: what set the "
          "schedule's budget: tau (a cheaper profiled budget missed it), reward floor, non-decreasing (a shorter "
          "bin's budget), smallest profiled (every profiled budget holds tau), dense: tau unreached)")
    dense = [c for c in choices if schedule.budget_at(c.start) >= c.end]
    if dense:
        print("dense in " + ", ".join(f"[{c.start}, {c.end})" for c in dense) + ": the budget covers every cached "
              "length of the bin")
    print("schedule: " + ", ".join(f"{s}:{b}" for s, b in zip(schedule.starts, schedule.budgets)))
    write_schedule_json(schedule, config.out, page_size)
    print(f"wrote {config.out}")
    if schedule.budgets and "model" in meta:
        hw = config.machine.spec()
        prompt_len = max(1, round(meta.get("prompt_tokens_mean", 1)))
        gen_len = meta.get("sampling", {}).get("max_new_tokens", 1)
        result = compare(model_dims(meta["model"]), hw, schedule, prompt_len, gen_len, config.samples,
                         pricing=config.machine.pricing(page_size=page_size))
        print(f"predicted speedup on {hw.name} (cost model, {prompt_len}-token prompts, {gen_len} generated, "
              f"{config.samples} samples): {result['predicted_speedup']:.2f}x")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("calibrate", help="pick the cheapest schedule that holds tau in every length bin")
    add_config_options(parser, CalibrateConfig)
    parser.set_defaults(run=run)
