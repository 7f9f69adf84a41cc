"""What the weight-sync tests compare: vLLM's prompt log-probs against the training model's, on the same tokens."""

import torch

PROMPT = list(range(40, 240))  # 200 byte tokens of the tiny tokenizer


def prompt_logprob_gap(llm, model, ids=PROMPT) -> float:
    """Largest |log p_vLLM - log p_model| over the prompt's tokens (each given the tokens before it), float32."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    theirs = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float((ours - theirs).abs().max())


def completion_logprob_gap(model, prompt_ids, token_ids, logprobs, schedule: str = "dense") -> float:
    """Largest |log p_vLLM - log p_model| over the completion tokens vLLM sampled after `prompt_ids` (temperature
    1), the model teacher-forced under `schedule` as the sparse actor decodes (dense prefill, then each token's
    budget of pages chosen by the landmarks of the cached keys; sparrow.attention.teacher_forced), as the monitor
    runs it (`measuring`)."""
    from sparrow.attention.teacher_forced import sparse_completion_logits
    from sparrow.integrations.monitor import measuring
    from sparrow.schedules import parse_schedule

    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad(), measuring(model):  # eval mode (a cache despite gradient checkpointing), attention restored
        if schedule == "dense":
            logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
        else:
            logits = sparse_completion_logits(model, ids, len(prompt_ids), parse_schedule(schedule))[0].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    return float((ours - torch.tensor(logprobs)).abs().max())


def perturb_every_parameter(model, scale: float = 0.05, seed: int = 0) -> None:
    """Add scale * N(0, 1) to every parameter (a tied embedding once, so the LM head moves with it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)


class FailedLoads:
    """Collects vLLM's "<Layer>: Failed to load weights" warnings of weight reloads (after Sparrow's filter)."""

    def __init__(self):
        import logging

        from sparrow.vllm.weights import RELOAD_LOGGER

        self.logger = logging.getLogger(RELOAD_LOGGER)
        self.layers: list[str] = []
        collected = self.layers

        class Handler(logging.Handler):
            def emit(self, record):
                if "Failed to load weights" in record.getMessage():
                    collected.append(record.getMessage().split(":")[0])

        self.handler = Handler(level=logging.WARNING)

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel("WARNING")
        self.logger.addHandler(self.handler)
        return self.layers

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
