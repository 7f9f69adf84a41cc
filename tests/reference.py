"""Independent references the tests compare the package with."""

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                   chunk: int = 1024) -> torch.Tensor:
    """log softmax(logits / T) of the next tokens: logits [B, T, V] -> [B, T-1], in float32, chunked over T."""
    targets = input_ids[:, 1:]
    out = []
    for start in range(0, targets.shape[1], chunk):
        stop = min(start + chunk, targets.shape[1])
        lp = torch.log_softmax(logits[:, start:stop].float() / temperature, dim=-1)
        out.append(lp.gather(-1, targets[:, start:stop, None]).squeeze(-1))
    return torch.cat(out, dim=1)
