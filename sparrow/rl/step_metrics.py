"""A step's metrics (TRL/verl-style names) and the monitor's warnings, from its filled `StepBatch`.

`bound_metrics` (top-K acceptance bounds per length bin), `exact_metrics` (the exact acceptance's p5 with its
interval, p1 and mean per bin) and `reward_check_metrics` (the reward check's retention) each return their
metrics and the warnings they raise; `step_metrics` gathers them with the reward, length, importance-sampling and
timing figures of the step.
"""

from __future__ import annotations

import numpy as np
import torch

from sparrow.engine.exact import draft_rounds, exact_summary
from sparrow.measure.retention import reward_retention
from sparrow.metrics.tail import bin_tails, tail_stats

from .config import MonitorSection, StepConfig
from .losses import tis_stats
from .step import StepBatch, check_samples

PRACTICAL_RATIO = 1000  # an undecided bin needing more than this many times its tokens sits at tau


def bound_metrics(bounds: torch.Tensor, positions: torch.Tensor, monitor: MonitorSection,
                  sparse: bool = True) -> tuple[dict, list[str]]:
    """Per length bin: the 5th percentile and mean of the acceptance lower and upper bounds ([N, 2]); a warning
    for each bin whose tail is below tau (upper bound's p5 < tau) or, for sparse rollouts, may be (only the lower
    bound's is). Dense rollouts differ from the dense policy only by numerics, where the loose lower bound of a
    flat distribution would warn for nothing."""
    metrics, warnings, tails = {}, [], {}
    for column, side in enumerate(("lower", "upper")):
        stats = tail_stats(bounds[:, column].cpu(), positions.cpu(), monitor.bin_size)
        metrics[f"mismatch/acceptance_{side}/p5"] = stats["overall"]["p5"]
        metrics[f"mismatch/acceptance_{side}/mean"] = stats["overall"]["mean"]
        for b in stats["bins"]:
            metrics[f"mismatch/bin_{b['start']}/acceptance_{side}_p5"] = b["p5"]
            metrics[f"mismatch/bin_{b['start']}/acceptance_{side}_mean"] = b["mean"]
            tails.setdefault((b["start"], b["end"], b["count"]), []).append(b["p5"])
    tau = monitor.tau
    for (start, end, count), (low, high) in tails.items():
        if high < tau:
            warnings.append(f"length bin [{start}, {end}): 5th percentile of acceptance is below tau {tau} "
                            f"(bounds {low:.3f}..{high:.3f} over {count} tokens)")
        elif low < tau and sparse:
            warnings.append(f"length bin [{start}, {end}): 5th percentile of acceptance may be below tau {tau} "
                            f"(bounds {low:.3f}..{high:.3f} over {count} tokens; more top-K log-probs per token "
                            "(num_logprobs) or --monitor exact decide it)")
    return metrics, warnings


def exact_metrics(alpha: torch.Tensor, positions: torch.Tensor, monitor: MonitorSection) -> tuple[dict, list[str]]:
    """Per length bin: the exact p5 with its 95% interval, mean and share > 0.999; a warning for each bin whose
    interval lies below tau, and for each undecided one with the number of tokens that would decide it (or that it
    sits at tau, when no run would measure that many)."""
    tails = bin_tails(alpha.cpu().numpy(), positions.cpu().numpy(), monitor.bin_size, monitor.tau)
    a = alpha.double()
    metrics = {"mismatch/exact/p5": float(torch.quantile(a, 0.05)), "mismatch/exact/p1": float(torch.quantile(a, 0.01)),
               "mismatch/exact/mean": float(a.mean()),
               "mismatch/exact/tokens": int(a.numel()), "mismatch/exact/frac_above_0999": float((a > 0.999).double().mean())}
    warnings = []
    for t in tails:
        prefix = f"mismatch/bin_{t.start}/exact"
        metrics.update({f"{prefix}_p1": t.p1, f"{prefix}_p5": t.p5, f"{prefix}_p5_low": t.p5_low,
                        f"{prefix}_p5_high": t.p5_high, f"{prefix}_mean": t.mean, f"{prefix}_tokens": t.count})
        where = f"length bin [{t.start}, {t.end}): 5th percentile of exact acceptance"
        interval = f"{t.p5:.3f} (95% interval {t.p5_low:.3f}..{t.p5_high:.3f}, {t.count} tokens)"
        if t.verdict == "below":
            warnings.append(f"{where} is below tau {monitor.tau}: {interval}")
        elif t.verdict == "undecided":
            if t.tokens_to_decide is None:
                more = "it sits at tau"
            elif t.tokens_to_decide > PRACTICAL_RATIO * t.count:
                more = f"it sits at tau (over {PRACTICAL_RATIO} times the tokens measured would decide it)"
            else:
                more = f"about {t.tokens_to_decide} more tokens would decide it"
            warnings.append(f"{where} is undecided against tau {monitor.tau}: {interval}; {more}")
    return metrics, warnings


def reward_check_metrics(totals: list[float], dense: list[float], group_size: int, samples: int,
                         level: float) -> tuple[dict, list[str]]:
    """The reward check's retention (the mean reward of the rollouts' first `samples` samples of each checked
    prompt, in groups of `group_size` in `totals`, over that of their `dense` twins) with its 95% interval, NaN
    where undefined (dense mean 0), and a warning when the whole interval lies below `level`. Pairs are
    clustered by prompt when there are several prompts; one prompt's pairs are the units themselves."""
    prompts = len(dense) // samples
    sparse = [totals[p * group_size + s] for p in range(prompts) for s in range(samples)]
    kept = reward_retention(sparse, dense, [i // samples for i in range(len(dense))] if prompts > 1 else None)
    value, low, high = (float("nan") if v is None else v for v in (kept.value, kept.low, kept.high))
    metrics = {"mismatch/reward_retention": value, "mismatch/reward_retention_low": low,
               "mismatch/reward_retention_high": high, "mismatch/reward_check_sparse_mean": kept.sparse_mean,
               "mismatch/reward_check_dense_mean": kept.dense_mean}
    warnings = []
    if kept.verdict(level) == "lost":
        warnings.append(f"reward retention {value:.3f} (95% interval {low:.3f}..{high:.3f}, {kept.pairs} paired "
                        f"samples of {prompts} prompt(s)) is below min_retention {level}")
    return metrics, warnings


def _status_counts(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts


def exact_rollout_metrics(completions, draft_tokens: int | None = None, bin_size: int = 512) -> dict:
    """Exact mode's rollout: tokens per dense verification (the mean accepted length) and the share of tokens that
    were accepted drafts (nothing for other modes). With a fixed draft length, from what the verifications kept
    (all vLLM reports of its drafts): the share of rounds that kept their first i drafts
    (`rollout/kept_first_<i>`), and per length bin of the cached length at the verification the share of the
    drafts judged that were kept (`mismatch/bin_<start>/drafts_kept`, a draft is judged up to the first rejection)
    and the rounds behind it."""
    if not any(c.verifies for c in completions):
        return {}
    summary = exact_summary(completions)
    metrics = {"rollout/tokens_per_verify": summary["tokens_per_verify"],
               "rollout/drafted_share": summary["drafted_share"]}
    if not draft_tokens:
        return metrics
    rounds = [r for c in completions for r in draft_rounds(c, draft_tokens)]
    if not rounds:
        return metrics
    kept = np.array([k for _, k in rounds])
    for i in range(draft_tokens):
        metrics[f"rollout/kept_first_{i + 1}"] = float((kept > i).mean())
    starts = np.array([length for length, _ in rounds]) // bin_size * bin_size
    judged = kept + (kept < draft_tokens)
    for start in np.unique(starts):
        here = starts == start
        metrics[f"mismatch/bin_{int(start)}/drafts_kept"] = float(kept[here].sum() / judged[here].sum())
        metrics[f"mismatch/bin_{int(start)}/rounds"] = int(here.sum())
    return metrics


def step_metrics(step: StepBatch, cfg: StepConfig) -> dict:
    """The step's metrics: plain floats with TRL/verl-style names, plus the lists `mismatch/warnings`,
    `rewards/failures`, `reward/per_prompt` and `prompts/length` (each group's mean reward and prompt length, for
    rewards by prompt length) and the dict `rewards/records`."""
    batch, completions, rewards = step.batch, step.completions, step.rewards
    valid = batch.mask.bool()
    mismatch, warnings = bound_metrics(step.bounds, batch.positions[valid], cfg.monitor,
                                       sparse=not step.schedule.is_dense)
    if step.exact is not None and step.exact.numel():
        exact, warnings = exact_metrics(step.exact, step.exact_at, cfg.monitor)
        mismatch.update(exact)
    if step.dense_rewards is not None:
        checked, lost = reward_check_metrics(step.scored.totals, step.dense_rewards, cfg.grpo.num_generations,
                                             check_samples(cfg), cfg.monitor.min_retention)
        mismatch.update(checked)
        warnings = warnings + lost
    diff = (batch.rollout_logprobs - step.logp_old)[valid].abs()
    ratio = tis_stats(step.logp_old, batch.rollout_logprobs, batch.mask, cfg.grpo.tis_cap)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    records = step.scored.records
    group = rewards.shape[1]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/per_prompt": rewards.mean(dim=1).tolist(),
        "prompts/length": [len(completions[g * group].prompt_token_ids) for g in range(rewards.shape[0])],
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/frac_zero_std_groups": float((rewards.std(dim=1, unbiased=False) == 0).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
        **step.update,
        "sampling/importance_sampling_ratio/min": ratio["ratio_min"],
        "sampling/importance_sampling_ratio/mean": ratio["ratio_mean"],
        "sampling/importance_sampling_ratio/max": ratio["ratio_max"],
        "sampling/importance_sampling_ratio/frac_truncated": ratio["frac_above_cap"],
        "sampling/sampling_logp_difference/mean": float(diff.mean()),
        "sampling/sampling_logp_difference/max": float(diff.max()),
        "rewards/records": {name: _status_counts(rows) for name, rows in records.items()},
        "rewards/failures": [{"reward": name, "sample": i, "prompt_index": completions[i].prompt_index, **row}
                             for name, rows in records.items() for i, row in enumerate(rows)
                             if row["status"] != "ok"][:8],
        "rollout/kv_budget_mean": float(batch.kv_budget[valid].float().mean()),
        **exact_rollout_metrics(completions, cfg.draft_tokens, cfg.monitor.bin_size),
        "rollout/tokens_per_s": float(lengths.sum()) / step.timing["time/rollout_s"],
        **step.timing,
        **mismatch,
        "mismatch/warnings": warnings + step.warnings,
    }
