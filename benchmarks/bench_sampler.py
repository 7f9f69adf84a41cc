"""The sampler's top-p draw on SmolLM2's own logits: the nucleus found among the top-ranked candidates with Gumbel
noise made for them alone (the default, `sparrow.engine.sampling.NUCLEUS_CANDIDATES`), against noise for the whole
vocabulary, and against sorting every row's whole vocabulary, alternated in one process over the same rollout.

    .venv/bin/python benchmarks/bench_sampler.py --context 3400 --tokens 256 --rows 8 --top-p 0.9

Decodes one manifest-task prompt (`sparrow.bench.task_prompt`, real text) densely, `--rows` samples at
temperature 1 with top-p, once per setting and repeat. Prints one JSON line per run (the engine's sample phase
per decode step in ms, the whole call's tokens/s, the share of row-steps whose nucleus was larger than the
candidates) and whether the three settings drew the same tokens, with the CPU's vector extensions.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3400, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per row")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sparrow.bench import cpu_flags, machine_info, task_prompt
    from sparrow.engine import RolloutEngine, SamplingParams, sampling
    from sparrow.models import load_model
    from sparrow.schedules import DENSE

    model, tokenizer = load_model("smollm2-135m")
    engine = RolloutEngine(model, tokenizer)
    prompt = task_prompt(tokenizer, args.context, seed=0)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, top_p=args.top_p, seed=0, ignore_eos=True)
    candidates, find, noise = sampling.NUCLEUS_CANDIDATES, sampling.nucleus_candidates, engine.noise
    wide, rows = [], []

    def counted(allowed, top_p):
        found = find(allowed, top_p)
        wide.append(len(found[2]))
        rows.append(len(allowed))
        return found

    sampling.nucleus_candidates = counted
    settings = (("candidates", candidates, False), ("vocabulary noise", candidates, True),
                ("full sort", engine.model.config.vocab_size, True))
    tokens = {}
    for _ in range(args.repeats):
        for setting, ranked, whole in settings:
            sampling.NUCLEUS_CANDIDATES = ranked
            engine.noise = (lambda *a, **k: noise(*a, **k).full()) if whole else noise  # numbers for every token
            wide.clear(), rows.clear()
            completions = engine.generate([prompt], params, DENSE, num_samples=args.rows)
            seconds, per_step = sum(engine.timing.values()), 1e3 / args.tokens
            tokens.setdefault(setting, [c.token_ids for c in completions])
            print(json.dumps({"setting": setting, "sample_ms_per_step": round(engine.timing["sample"] * per_step, 2),
                              "decode_ms_per_step": round(engine.timing["decode"] * per_step, 1),
                              "tokens_per_s": round(args.rows * args.tokens / seconds, 1),
                              "nucleus_past_candidates": round(sum(wide) / max(sum(rows), 1), 4)}), flush=True)
    print(json.dumps({"same_tokens": tokens["candidates"] == tokens["vocabulary noise"] == tokens["full sort"],
                      "candidates": candidates,
                      "cpu_flags": cpu_flags(("avx", "amx", "fma")), "machine": machine_info(torch.device("cpu"))}))


if __name__ == "__main__":
    main()
