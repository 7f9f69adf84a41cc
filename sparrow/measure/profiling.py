"""Measure how far sparse rollouts drift from the dense policy, per length bin, for several schedules.

For each schedule, `profile_schedule` samples completions with that schedule from a rollout backend, then
teacher-forces their tokens through the sparse actor and the dense policy (`sparrow.measure.acceptance`), so every
generated token gets its exact acceptance rate against the dense policy on the same prefix. The raw per-token values
are kept (one .npz per schedule) so statistics can be recomputed with any bin size; `run_profile` skips schedules
whose values are already on disk, which makes an interrupted run resume. `read_profile` reads a written profile.json
back, checked to have the shape `sparrow calibrate` needs.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.engine.exact import check_draft_tokens, exact_summary
from sparrow.errors import SparrowError
from sparrow.io import atomic_write_json, atomic_write_text, save_figure
from sparrow.measure.acceptance import teacher_forced_acceptance
from sparrow.measure.calibration import check_profile
from sparrow.measure.retention import reward_retention
from sparrow.metrics.tail import tail_stats
from sparrow.schedules import DENSE, Schedule

LENGTH_ORIGINS = ("total", "generated")


@dataclass
class ScheduleSample:
    """Per generated token: exact acceptance, cached length when produced, index in its completion, budget;
    with a reward, also the reward of each completion (ordered by prompt, then sample index)."""

    alpha: np.ndarray
    total_position: np.ndarray
    generated_position: np.ndarray
    kv_budget: np.ndarray
    rewards: np.ndarray | None = None

    def positions(self, origin: str) -> np.ndarray:
        return self.total_position if origin == "total" else self.generated_position

    def sequences(self) -> np.ndarray:
        """The completion each token belongs to (each completion starts at generated position 0)."""
        return np.cumsum(self.generated_position == 0) - 1

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        rewards = {} if self.rewards is None else {"rewards": self.rewards}
        np.savez(tmp, alpha=self.alpha, total_position=self.total_position,
                 generated_position=self.generated_position, kv_budget=self.kv_budget, **rewards)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, with_rewards: bool = False) -> ScheduleSample:
        """A saved sample; a SparrowError naming the file when it is damaged (a truncated or foreign file, arrays
        missing or of different lengths, rewards missing when `with_rewards`)."""
        fields = ("alpha", "total_position", "generated_position", "kv_budget")
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = [k for k in fields + ("rewards",) * with_rewards if k not in data.files]
                sample = None if missing else cls(**{k: data[k] for k in fields}, rewards=data.get("rewards"))
        except (OSError, ValueError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            problem = f"cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        else:
            if missing:
                problem = f"lacks the array(s) {', '.join(missing)}"
            elif len({a.shape for a in (sample.alpha, sample.total_position, sample.generated_position,
                                        sample.kv_budget)}) != 1 or sample.alpha.ndim != 1:
                problem = "holds arrays of different shapes"
            else:
                return sample
        raise SparrowError(f"{path} is damaged: it {problem}; remove it to profile that schedule again (the other "
                           "files of the profile are kept)")


def read_dense_rewards(path: Path, count: int | None = None) -> np.ndarray:
    """The dense policy's rewards saved by an earlier run: finite numbers, `count` of them when given; a
    SparrowError naming the file when it is damaged."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problem = f"is not valid JSON ({err})"
    else:
        numbers = isinstance(data, list) and all(type(x) in (int, float) and np.isfinite(x) for x in data)
        if not numbers:
            problem = "is not a list of finite numbers"
        elif count is not None and len(data) != count:
            problem = f"holds {len(data)} rewards; expected {count} (one per paired completion)"
        else:
            return np.asarray(data, dtype=np.float64)
    raise SparrowError(f"{path} is damaged: it {problem}; remove it to sample the dense policy's rewards again")


def _read_run_key(path: Path) -> dict:
    """The settings an earlier profile in this folder was made with; a SparrowError naming the file if damaged."""
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problem = f"({err})"
    else:
        if isinstance(previous, dict):
            return previous
        problem = "(not a JSON object)"
    raise SparrowError(f"{path} is damaged {problem}; remove it (and the profile beside it) or use another --out")


def check_resumable(out_dir: Path, schedules, with_rewards: bool) -> None:
    """Read what an interrupted profile in `out_dir` left (each schedule's tokens .npz, the dense rewards), so that
    a file damaged beyond use is refused by name before any model loads (`run_profile` checks the rest, once it
    knows the earlier run had the same settings)."""
    if (Path(out_dir) / "run_key.json").exists():
        _read_run_key(Path(out_dir) / "run_key.json")
    for name in schedules:
        path = Path(out_dir) / f"tokens-{_file_name(name)}.npz"
        if path.exists():
            ScheduleSample.load(path)
    dense_path = Path(out_dir) / "dense-rewards.json"
    if with_rewards and dense_path.exists():
        read_dense_rewards(dense_path)


def prompts_hash(prompts: list) -> str:
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]


def answers_hash(examples: list) -> str:
    """What the rewards score against (each example's answer and other columns): a resumed profile whose stored
    rewards were scored against other answers is refused."""
    rows = [[e.answer, e.columns] for e in examples]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_schedule(backend, model, prompts: list, schedule: Schedule, sampling: SamplingParams,
                     samples_per_prompt: int, sparse: SparseConfig, progress: bool = False,
                     reward=None, draft_tokens: int | None = None, log=print) -> ScheduleSample:
    """Sample with `schedule` from `backend`, then measure each token's exact acceptance against the dense policy
    by teacher-forcing the tokens through `model` (sparse actor with its adapter, dense policy without).
    `reward` (completions -> one reward each), when given, scores the completions too. `draft_tokens`: exact mode
    instead (the schedule drafts, the dense policy verifies), whose drafted tokens carry the acceptance of the
    draft against the dense distribution from decoding itself: those are the values kept, no teacher-forced pass."""
    exact = draft_tokens is not None and not schedule.is_dense
    completions = backend.generate(prompts, sampling, schedule, samples_per_prompt, progress=progress,
                                   draft_tokens=draft_tokens if exact else None)
    if exact:
        summary = exact_summary(completions)
        log(f"    exact mode: {summary['tokens_per_verify']:.2f} tokens per verification, coupled acceptance "
            f"{summary['coupled_acceptance']:.3f}")
        alphas = [c.draft_acceptance for c in completions]
    else:
        log(f"    measuring acceptance: teacher-forcing {sum(len(c.token_ids) for c in completions)} tokens through "
            "the sparse actor and the dense policy")
        alphas = teacher_forced_acceptance(model, completions, schedule, sparse, sampling.logprob_temperature,
                                           progress=progress)
    alpha, total, generated, budget = [], [], [], []
    for c, values in zip(completions, alphas):
        kept = np.array([v is not None for v in values], dtype=bool)
        n = len(c.token_ids)
        alpha.append(np.asarray([v for v in values if v is not None], dtype=np.float64))
        generated.append(np.arange(n)[kept])
        total.append((len(c.prompt_token_ids) + np.arange(n))[kept])
        budget.append(np.asarray(c.kv_budget)[kept])
    rewards = None if reward is None else np.asarray(reward(completions), dtype=np.float64)
    return ScheduleSample(*(np.concatenate(parts) for parts in (alpha, total, generated, budget)), rewards)


def dense_rewards(backend, prompts: list, sampling: SamplingParams, samples_per_prompt: int, reward,
                  progress: bool = False) -> np.ndarray:
    """The rewards of the dense policy's completions (no adapter, dense attention) of the same prompts, seed and
    sample indices, so completion j pairs with completion j of every profiled schedule (same random stream)."""
    completions = backend.generate(prompts, sampling, DENSE, samples_per_prompt, adapter=False, progress=progress)
    return np.asarray(reward(completions), dtype=np.float64)


def summarize(samples: dict[str, ScheduleSample], bin_size: int, origin: str, fit_beta: bool = True) -> dict:
    """Per schedule: token count, mean, share above 0.999 and per-bin tail statistics (with completion minima)."""
    out = {}
    for name, sample in samples.items():
        stats = tail_stats(sample.alpha, sample.positions(origin), bin_size, fit_beta=fit_beta,
                           sequences=sample.sequences())
        out[name] = {"tokens": int(sample.alpha.size), **stats}
    return out


def reward_summary(sparse: np.ndarray, dense: np.ndarray, samples_per_prompt: int) -> dict:
    """{mean, dense_mean, retention} of paired sparse and dense rewards, the samples of a prompt as one cluster."""
    retention = reward_retention(sparse, dense, np.arange(len(dense)) // samples_per_prompt)
    return {"mean": retention.sparse_mean, "dense_mean": retention.dense_mean, "retention": retention.to_json()}


def write_csv(path: Path, summary: dict) -> None:
    lines = ["schedule,bin,start,end,count,mean,p1,p5,p50,frac_above_0.999,sequences,seq_min_mean,seq_min_p5"]
    for name, stats in summary.items():
        for b in stats["bins"]:
            lines.append(f"{name},{b['bin']},{b['start']},{b['end']},{b['count']},{b['mean']:.6f},{b['p1']:.6f},"
                         f"{b['p5']:.6f},{b['p50']:.6f},{b['frac_above_tail']:.6f},{b['sequences']},"
                         f"{b['seq_min_mean']:.6f},{b['seq_min_p5']:.6f}")
    atomic_write_text(path, "\n".join(lines) + "\n")


def plot_profile(out_dir: Path, summary: dict, samples: dict[str, ScheduleSample], origin: str) -> list[Path]:
    """The 5th percentile vs length for every schedule (paper figure 3, top) and alpha histograms (figure 1b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, stats in summary.items():
        centers = [(b["start"] + b["end"]) / 2 for b in stats["bins"]]
        ax.plot(centers, [b["p5"] for b in stats["bins"]], marker="o", label=name)
    ax.set_xlabel("cached tokens (prompt + generated)" if origin == "total" else "generated tokens")
    ax.set_ylabel("5th percentile of acceptance rate")
    ax.set_title("Tail acceptance vs length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p5_path = out_dir / "p5_vs_length.png"
    save_figure(fig, p5_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    edges = np.linspace(0, 1, 51)
    for name, sample in samples.items():
        ax.hist(sample.alpha, bins=edges, histtype="step", label=f"{name} (mean {sample.alpha.mean():.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("per-token acceptance rate")
    ax.set_ylabel("tokens")
    ax.set_title("Distribution of acceptance rates")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist_path = out_dir / "alpha_hist.png"
    save_figure(fig, hist_path, dpi=120)
    plt.close(fig)
    return [p5_path, hist_path]


def run_profile(backend, model, prompts: list, schedules: dict[str, Schedule], sampling: SamplingParams,
                samples_per_prompt: int, sparse: SparseConfig, bin_size: int, origin: str, out_dir: Path,
                meta: dict, log=print, reward=None) -> dict:
    """Profile every schedule (resuming finished ones), then write profile.json, profile.csv and the plots.
    With `reward` (completions -> one reward each; its names in meta["reward"]) each schedule's completions are
    scored, and so are the dense policy's paired completions (sampled once), for each schedule's retention."""
    if origin not in LENGTH_ORIGINS:
        raise SparrowError(f"unknown length origin {origin!r}: expected one of {', '.join(LENGTH_ORIGINS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    key = json.loads(json.dumps({**{k: meta[k] for k in ("model", "prompts_hash", "sampling", "samples_per_prompt",
                                                        "sparse", "chat", "dtype")}, "adapter": meta.get("adapter"),
                      "reward": meta.get("reward"), "answers_hash": meta.get("answers_hash"),
                      "rollout": meta.get("rollout")}))
    key_path = out_dir / "run_key.json"
    if key_path.exists():
        previous = _read_run_key(key_path)
        changed = sorted(k for k in key if previous.get(k) != key[k])
        if changed:
            raise SparrowError(f"{out_dir} holds a profile made with other settings ({', '.join(changed)} "
                               "differ); use another --out or remove it")
    else:
        atomic_write_json(key_path, key)
    samples = {}
    for number, (name, schedule) in enumerate(schedules.items(), start=1):
        path = out_dir / f"tokens-{_file_name(name)}.npz"
        if path.exists():
            log(f"[{number}/{len(schedules)}] {name}: done earlier, reusing {path.name}")
            samples[name] = ScheduleSample.load(path, reward is not None)
            continue
        log(f"[{number}/{len(schedules)}] {name}: sampling {len(prompts) * samples_per_prompt} completions")
        samples[name] = profile_schedule(backend, model, prompts, schedule, sampling, samples_per_prompt, sparse,
                                         draft_tokens=meta.get("rollout", {}).get("draft_tokens"), log=log,
                                         progress=True, reward=reward)
        samples[name].save(path)
        log(f"    mean alpha {samples[name].alpha.mean():.4f} over {samples[name].alpha.size} tokens")
    log(f"per-bin statistics of {len(samples)} schedules (bins of {bin_size} tokens)")
    summary = summarize(samples, bin_size, origin)
    if reward is not None:
        dense_path = out_dir / "dense-rewards.json"
        if dense_path.exists():
            dense = read_dense_rewards(dense_path, len(prompts) * samples_per_prompt)
        else:
            log(f"dense policy: sampling {len(prompts) * samples_per_prompt} paired completions for the reward")
            dense = dense_rewards(backend, prompts, sampling, samples_per_prompt, reward, progress=True)
            atomic_write_json(dense_path, dense.tolist())
        for name, sample in samples.items():
            summary[name]["reward"] = reward_summary(sample.rewards, dense, samples_per_prompt)
    profile = {
        "meta": {**meta, "bin_size": bin_size, "length_origin": origin,
                 "date": datetime.datetime.now().isoformat(timespec="seconds")},
        "schedules": {name: {"spec": name, "budgets": schedules[name].to_json(), **summary[name]}
                      for name in schedules},
    }
    log(f"writing {out_dir}: profile.json, profile.csv and the plots")
    atomic_write_json(out_dir / "profile.json", profile)
    write_csv(out_dir / "profile.csv", summary)
    plot_profile(out_dir, summary, samples, origin)
    return profile


def read_profile(path: str) -> dict:
    """The profile.json at `path`, checked to have the shape 'sparrow profile' writes."""
    try:
        profile = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise SparrowError(f"profile {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise SparrowError(f"profile {path!r} is not valid JSON: {err}") from None
    check_profile(profile, f"profile {path!r}")
    return profile


def _file_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
