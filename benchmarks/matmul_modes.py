"""Time SmolLM2-135M's float32 matrix products (one decoder layer's projections and the LM head) at 1, 16 and
256 rows, under whatever MKL mode the environment sets: run it plain and with MKL_CBWR=AVX2,STRICT to see what
MKL's reproducible mode costs (BENCHMARKS.md, "Bitwise reproducibility across thread counts")."""

import json
import os
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out): q/o, k/v, up/gate, down, head


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) for inp, out in SHAPES]
    result = {"MKL_CBWR": os.environ.get("MKL_CBWR"), "threads": torch.get_num_threads()}
    for rows in (1, 16, 256):
        inputs = [torch.randn(rows, inp) for inp, _ in SHAPES]
        for _ in range(3):
            for x, w in zip(inputs, weights):
                F.linear(x, w)
        repeats = 20 if rows < 256 else 5
        start = time.perf_counter()
        for _ in range(repeats):
            for x, w in zip(inputs, weights):
                F.linear(x, w)
        result[f"ms_at_{rows}_rows"] = round((time.perf_counter() - start) / repeats * 1000, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
