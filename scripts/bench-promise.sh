#!/usr/bin/env bash
# Issue 19's full experiment ("the promise, end to end"): GRPO on the long task (`manifest`, ~4.6K-token prompts,
# answers up to 200 tokens at temperature 1), sparse rollouts at the schedule the reward-aware calibration picks
# (`sparrow calibrate --profile examples/manifest-reward-profile.json --tau 0.75 --margin 0.02 --min-retention 0.9`:
# 0:3072) against dense rollouts, 10 steps of one prompt x 8 samples, seeds 0 and 1, held-out mean@4 of the dense
# policy on 8 prompts before and after; then one report (reward vs cumulative rollout seconds, throughput, tail).
# About 80 minutes on 2 idle CPU cores; a killed run continues where its last checkpoint left it.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_BENCH_DIR:-runs/bench/promise}
SCHEDULE=${SPARROW_SCHEDULE:-0:3072}
mkdir -p "$OUT"
[ -s "$OUT/train.jsonl" ] || $SPARROW prompts --task manifest --count 32 --min-tokens 4096 --seed 0 --out "$OUT/train.jsonl"
[ -s "$OUT/heldout.jsonl" ] || $SPARROW prompts --task manifest --count 8 --min-tokens 4096 --seed 2 --out "$OUT/heldout.jsonl"
RUNS=()
for SEED in 0 1; do
  for S in dense "$SCHEDULE"; do
    NAME="$( [ "$S" = dense ] && echo dense || echo "sparse-${S//:/-}" )-seed$SEED"
    RUNS+=("$OUT/$NAME")
    if [ -s "$OUT/$NAME/eval.jsonl" ] && grep -q '"step": 10' "$OUT/$NAME/eval.jsonl"; then continue; fi
    RESUME=$( [ -d "$OUT/$NAME" ] && ls -d "$OUT/$NAME"/checkpoint-* >/dev/null 2>&1 && echo --resume || true )
    echo "== $NAME =="
    $SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/train.jsonl" --eval-data "$OUT/heldout.jsonl" \
        --schedule "$S" --steps 10 --num-generations 8 --eval-every 10 --reward-check-every 4 \
        --save-every 5 --keep-last 1 --seed "$SEED" \
        --output-dir "$OUT/$NAME" $RESUME
  done
done
$SPARROW report "${RUNS[@]}" --out "$OUT"
