"""Host reads on the decode path, counted on the CPU: every call that would make the host wait for a GPU (`item`,
`tolist`, `bool`/`int`/`float` of a tensor, `cpu`, `numpy`, `nonzero`) during a wave's decode loop. A decode step
reads the device once (its tokens, log-probs, top log-probs and finite flags in one transfer); the forward and the
stop checks read nothing more."""

import contextlib

import pytest
import torch

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero")


@contextlib.contextmanager
def counted_reads():
    """A list that collects the name of every host read made inside the scope (nested reads count once)."""
    calls, depth = [], [0]

    def wrap(name, original):
        def counted(*args, **kwargs):
            if not depth[0]:
                calls.append(name)
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    originals = {name: getattr(torch.Tensor, name) for name in READS}
    torch_nonzero = torch.nonzero
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        torch.nonzero = wrap("torch.nonzero", torch_nonzero)
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = torch_nonzero


def decode_reads(engine: RolloutEngine, prompts, sampling: SamplingParams, schedule, num_samples=2) -> list[str]:
    """The host reads of `generate`'s decode loops (prefill and the final texts left out)."""
    decode_wave, reads = engine.decode_wave, []

    def counting(*args, **kwargs):
        with counted_reads() as calls:
            decode_wave(*args, **kwargs)
        reads.extend(calls)

    engine.decode_wave = counting
    try:
        engine.generate(prompts, sampling, schedule, num_samples=num_samples)
    finally:
        del engine.decode_wave
    return reads


@pytest.mark.parametrize("schedule", [DENSE, const(48)], ids=["dense", "sparse"])
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 1.0, "top_k": 20}],
                         ids=["greedy", "sampled"])
def test_a_decode_step_reads_the_device_once(llama, schedule, settings):
    engine = RolloutEngine(*llama)
    steps = 24
    sampling = SamplingParams(max_new_tokens=steps, seed=3, ignore_eos=True, **settings)
    reads = decode_reads(engine, random_prompts([70, 90], seed=4), sampling, schedule)
    assert len(reads) <= steps, (len(reads), sorted(set(reads)))


def test_stopping_rows_early_adds_no_read(llama):
    """Rows that finish at different steps (a stop string) are dropped from the batch without reading the device."""
    engine = RolloutEngine(*llama)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop=("a", "e"))
    reads = decode_reads(engine, random_prompts([40, 60], seed=6), sampling, const(48), num_samples=3)
    assert len(reads) <= 16, (len(reads), sorted(set(reads)))
