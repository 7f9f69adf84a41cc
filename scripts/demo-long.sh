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
$SPARROW prompts --task manifest --count 32 --min-tokens 4096 --seed 0 --out "$OUT/manifest-train.jsonl"
$SPARROW prompts --task manifest --count 2 --min-tokens 4096 --seed 2 --out "$OUT/manifest-heldout.jsonl"
echo "== GRPO on sparse rollouts (schedule calibrated on manifest prompts for retention 0.9: 0:3072) =="
$SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/manifest-train.jsonl" \
    --eval-data "$OUT/manifest-heldout.jsonl" --output-dir "$OUT/sparse"
echo "== the same run on dense rollouts =="
$SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/manifest-train.jsonl" --schedule dense \
    --eval-data "$OUT/manifest-heldout.jsonl" --output-dir "$OUT/dense"
echo "== report =="
$SPARROW report "$OUT/dense" "$OUT/sparse" --out "$OUT"
cat "$OUT/report.md"
