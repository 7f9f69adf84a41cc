"""The monitor under several processes: two gloo processes on CPU, each holding part of a step's measured tokens,
reach the verdict and the adaptive move one process reaches on all of them; only rank 0 writes the schedule file."""

import json
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.monitor import gather_rows, verdict
from sparrow.integrations.schedule_file import RunTimeSchedule

CONFIG = {"schedule": "adaptive", "tau": 0.9, "bin_size": 256, "adaptive_start": "const:128",
          "adaptive_patience": 1, "adaptive_min_tokens": 10, "adaptive_margin": 0.0}


def step_values(seed: int = 0) -> np.ndarray:
    """[tokens, 3]: acceptance under the schedule in force, one rung cheaper, and the position."""
    gen = np.random.default_rng(seed)
    positions = np.concatenate([gen.integers(0, 256, 300), gen.integers(256, 512, 500)])
    current = np.where(positions < 256, gen.uniform(0.6, 1.0, 800), gen.uniform(0.97, 1.0, 800))
    cheaper = current - gen.uniform(0.0, 0.02, 800)
    return np.stack([current, cheaper, positions.astype(np.float64)], axis=1)


def one_step(table: np.ndarray, path) -> dict:
    """What the trainer does with the gathered table: the verdict, then the adaptive move (rank 0 writes)."""
    metrics, warnings = verdict(table[:, 0], table[:, -1], SparrowConfig(**CONFIG).monitor)
    runtime = RunTimeSchedule(SparrowConfig(**CONFIG), path, 512,
                              writer=not dist.is_initialized() or dist.get_rank() == 0)
    moved = runtime.update(table[:, 0], table[:, 1], table[:, -1])
    return {"metrics": metrics, "warnings": warnings, "moved": moved, "budgets": runtime.state.budgets,
            "tokens": int(table.shape[0])}


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        values = step_values()
        mine = values[:500] if rank == 0 else values[500:]  # unequal shares: the padding of the gather is exercised
        table = gather_rows(torch.from_numpy(mine)).numpy()
        result = one_step(table, os.path.join(out_dir, f"schedule-{rank}.json"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_reach_the_one_process_verdict_and_only_rank_0_writes(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    single = json.loads(json.dumps(one_step(step_values(), tmp_path / "single.json")))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert result == single
    assert single["tokens"] == 800 and single["moved"]  # the values move the schedule: the write is exercised
    assert single["metrics"]["mismatch/exact/tokens"] == 800
    assert single["budgets"] == [256, 64]
    assert (tmp_path / "schedule-0.json").exists() and not (tmp_path / "schedule-1.json").exists()


def test_gather_rows_in_one_process_is_the_identity():
    table = torch.arange(6.0).view(3, 2)
    assert gather_rows(table) is table
