"""A rollout backend without an engine: it replays completions it was given. It proves the seam (a GRPO step
needs nothing of a backend but the protocol) and lets runs with and without an adapter see one batch."""

import copy

from sparrow.rollout import RolloutBackend


class ReplayBackend:
    def __init__(self, completions):
        self.completions = completions
        self.synced, self.closed, self.calls = [], False, []

    def generate(self, prompts, sampling, schedule, num_samples=1, *, prompt_keys=None, adapter=True,
                 progress=False, draft_tokens=None):
        self.calls.append((len(prompts), num_samples, schedule))
        assert len(self.completions) == len(prompts) * num_samples
        return copy.deepcopy(self.completions)

    def sync_weights(self, model):
        self.synced.append(model)

    def close(self):
        self.closed = True


assert isinstance(ReplayBackend([]), RolloutBackend)
