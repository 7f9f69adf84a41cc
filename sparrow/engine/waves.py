"""The scheduler of waves: a `generate` call's prompts split into batches of at most `max_batch_size` rows, the
`num_samples` rows of a prompt always in one wave; each wave is prefilled and decoded to its end before the next."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .sampling import SamplingParams
from .sequence import Completion


@dataclass
class Wave:
    """One batch of a call. Row r of its cache holds `seqs[r]`: the `samples` rows of the prompt `prompt_ids[0]`,
    then those of `prompt_ids[1]`, ...; `capacity` is the cache's positions (the longest prompt plus
    max_new_tokens)."""

    prompt_ids: list[list[int]]
    samples: int
    seqs: list[Completion]
    capacity: int


def prompts_per_wave(num_samples: int, max_batch_size: int) -> int:
    """Whole prompts a wave holds: as many as `max_batch_size` rows allow, at least one."""
    return max(1, max_batch_size // num_samples)


def plan_waves(encoded: Sequence[list[int]], keys: Sequence[int], num_samples: int, max_batch_size: int,
               sampling: SamplingParams) -> Iterator[Wave]:
    """The waves of a call, in prompt order: as many whole prompts per wave as `max_batch_size` rows hold (at least
    one); `encoded` the prompts' token ids, `keys` their random keys."""
    per_wave = prompts_per_wave(num_samples, max_batch_size)
    for start in range(0, len(encoded), per_wave):
        prompts = range(start, min(start + per_wave, len(encoded)))
        seqs = [Completion(i, s, encoded[i], keys[i], sampling=sampling) for i in prompts for s in range(num_samples)]
        yield Wave([encoded[i] for i in prompts], num_samples, seqs,
                   max(len(encoded[i]) for i in prompts) + sampling.max_new_tokens)
