#!/usr/bin/env bash
# The long-generation demo: GRPO on SmolLM2-135M-Instruct and the built-in manifest task (~4.5K-token prompts,
# answers of ~150-200 tokens at temperature 1), sparse rollouts at the reward-aware calibrated schedule (0:3072) vs
# dense rollouts, then one report comparing them (reward, length, tail acceptance per bin, reward retention, time
# per phase, reward against rollout seconds). About 20 minutes on 2 CPU cores; benchmarks/bench-promise.sh is the full
# experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_DEMO_DIR:-runs/demo-long}
rm -rf "$OUT"
mkdir -p "$OUT"
echo "== 1/4 prompts of the manifest task: 32 for training, 2 held out (too few for an interval on held-out reward) =="
$SPARROW prompts --task manifest --count 32 --min-tokens 4096 --seed 0 --out "$OUT/manifest-train.jsonl"
$SPARROW prompts --task manifest --count 2 --min-tokens 4096 --seed 2 --out "$OUT/manifest-heldout.jsonl"
echo "== 2/4 GRPO on sparse rollouts (schedule calibrated on manifest prompts for retention 0.9: 0:3072) =="
$SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/manifest-train.jsonl" \
    --eval-data "$OUT/manifest-heldout.jsonl" --output-dir "$OUT/sparse"
echo "== 3/4 the same run on dense rollouts =="
$SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/manifest-train.jsonl" --schedule dense \
    --eval-data "$OUT/manifest-heldout.jsonl" --output-dir "$OUT/dense"
echo "== 4/4 report =="
$SPARROW report "$OUT/dense" "$OUT/sparse" --out "$OUT"
cat "$OUT/report.md"
echo
echo "Results: $OUT/report.md (plots beside it), runs in $OUT/sparse and $OUT/dense; the full experiment (8 held-out"
echo "prompts, two seeds): benchmarks/bench-promise.sh, BENCHMARKS.md ('Training on the long task: reward at parity')"
