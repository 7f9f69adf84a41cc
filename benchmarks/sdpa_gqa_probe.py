"""Which SDPA path a GQA causal prefill takes on a CUDA GPU, at SmolLM2's attention shape (9 query heads, 3 KV
heads, head_dim 64): `enable_gqa=True` (what sparrow's prefill_attention and the dense teacher-forced path pass)
against K/V repeated to 9 heads, in float32 and bfloat16, at 8K and 32K tokens. Prints one JSON line per case (the
median of 3 timed calls after one untimed, and the peak memory beyond the inputs) and writes $OUT/sdpa_probe.json.

In float32 no fused backend takes enable_gqa (flash needs 16-bit; memory-efficient and cuDNN need equal head
counts), so SDPA falls back to the math backend, which materialises the [heads, T, T] scores: see BENCHMARKS.md,
"GPU: first run on an H200". Run: python3 benchmarks/sdpa_gqa_probe.py (about 10 s on an H200).
"""

import json
import os
import time

import torch
import torch.nn.functional as F


def main() -> None:
    out = []
    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for T in (8192, 32768):
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, 9, T, 64, device=dev, dtype=dtype, generator=g)
            k = torch.randn(1, 3, T, 64, device=dev, dtype=dtype, generator=g)
            v = torch.randn(1, 3, T, 64, device=dev, dtype=dtype, generator=g)
            for mode in ("enable_gqa", "repeat_kv"):
                rec = {"dtype": str(dtype), "T": T, "mode": mode}
                try:
                    def f():
                        if mode == "enable_gqa":
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        return F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                              is_causal=True)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    ref = f()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(3):
                        t = time.perf_counter()
                        f()
                        torch.cuda.synchronize()
                        ts.append(time.perf_counter() - t)
                    rec["ms"] = 1000 * sorted(ts)[1]
                    rec["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                    del ref
                except Exception as e:  # noqa: BLE001 - an OOM is a result
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.empty_cache()
                print(json.dumps(rec), flush=True)
                out.append(rec)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sdpa_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
