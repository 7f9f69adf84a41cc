"""Independent references the tests compare the package with."""

import torch
import torch.nn.functional as F


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


def reference_paged_attention(queries: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              page_table: torch.Tensor, pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                              scale: float) -> torch.Tensor:
    """`triton_decode.paged_sparse_attention` in PyTorch: gather the selected pages of vLLM's paged cache, then SDPA
    with a mask (queries [R, Hkv, G, D], pages [R, Hkv, K] logical page numbers, -1 unused)."""
    requests, kv_heads, _, dim = queries.shape
    slots = pages.shape[-1]
    live = pages >= 0
    logical = pages.clamp(min=0).long()
    phys = page_table.long().gather(1, logical.view(requests, -1)).view(requests, kv_heads, slots)
    per = key_cache.shape[1] // page_size
    block = torch.div(phys, per, rounding_mode="floor").unsqueeze(-1)
    row = (phys % per).unsqueeze(-1) * page_size + torch.arange(page_size, device=queries.device)
    head = torch.arange(kv_heads, device=queries.device).view(1, kv_heads, 1, 1)
    keys, values = key_cache[block, row, head], value_cache[block, row, head]  # [R, Hkv, K, ps, D]
    position = logical.unsqueeze(-1) * page_size + torch.arange(page_size, device=queries.device)
    mask = live.unsqueeze(-1) & (position < seq_lens.view(-1, 1, 1, 1))
    keys = keys.reshape(requests, kv_heads, slots * page_size, dim).to(queries.dtype)
    values = values.reshape(requests, kv_heads, slots * page_size, dim).to(queries.dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.view(requests, kv_heads, 1, -1),
                                          scale=scale)
