"""DistillSparse's switch probes: the exact acceptance of the sparse actor under a candidate schedule on held-out
prompts (`probe`), the evidence the switch controller (`sparrow.schedules.controllers.SwitchSchedule`) decides on;
`switch_schedule` builds that controller for a run.
"""

from __future__ import annotations

import torch

from sparrow.attention import SparseConfig
from sparrow.measure.acceptance import teacher_forced_acceptance
from sparrow.metrics.tail import tail_stats
from sparrow.schedules import Schedule
from sparrow.schedules.controllers import SwitchSchedule

from .config import TrainConfig
from .step_state import Policy

PROBE_SEED = 2**40  # probe sampling seeds stay apart from the rollout seeds (seed * 1_000_003 + step)


def probe(backend, model, prompts: list, schedule: Schedule, sampling, num_samples: int, sparse: SparseConfig,
          bin_size: int, pad_id: int = 0) -> tuple[list[float], dict]:
    """Exact acceptance of the current sparse actor under `schedule` against the dense policy on `prompts`: the
    backend samples with the adapter on, then `teacher_forced_acceptance` measures every token (adapter on for
    the sparse actor, off for the dense policy). Returns the per-bin 5th percentiles (bins by total cached
    length) and `probe/...` metrics."""
    completions = backend.generate(prompts, sampling, schedule, num_samples)
    alphas = teacher_forced_acceptance(model, completions, schedule, sparse, sampling.logprob_temperature,
                                       pad_id=pad_id)
    alpha = torch.tensor([a for values in alphas for a in values], dtype=torch.float64)
    positions = torch.tensor([len(c.prompt_token_ids) + i for c in completions for i in range(len(c.token_ids))])
    stats = tail_stats(alpha, positions, bin_size)
    metrics = {"probe/acceptance/p5": stats["overall"]["p5"], "probe/acceptance/mean": stats["overall"]["mean"]}
    for b in stats["bins"]:
        metrics[f"probe/bin_{b['start']}/acceptance_p5"] = b["p5"]
        metrics[f"probe/bin_{b['start']}/acceptance_mean"] = b["mean"]
    return [b["p5"] for b in stats["bins"]], metrics


def switch_schedule(config: TrainConfig, policy: Policy, backend, probes: list) -> SwitchSchedule:
    """The run's switch controller: the configured schedule until the probes (`probe` on the `probes` examples,
    every `probe_every` steps, sampled with seeds of their own) hold tau under `switch_schedule`."""
    distill, prompts = config.distill, [ex.prompt for ex in probes]

    def probe_at(step: int) -> tuple[list[float], dict]:
        sampling = config.sampling.params(seed=PROBE_SEED + config.run.seed * 1_000_003 + step)
        return probe(backend, policy.model, prompts, config.parsed.switch_schedule, sampling,
                     config.grpo.num_generations, config.sparse.config(), config.monitor.bin_size, policy.pad_id)

    return SwitchSchedule(config.parsed.schedule, config.parsed.switch_schedule, probe_at, every=distill.probe_every,
                          patience=distill.probe_patience, tau=config.monitor.tau, named=distill.switch_schedule)
