"""A toy reward for smoke tests on random tiny models: it differs between almost any two completions."""


def byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]
