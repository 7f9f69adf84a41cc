#!/usr/bin/env bash
# Issue 19's full experiment ("the promise, end to end"): GRPO on the long task (`manifest`, ~4.6K-token prompts,
# answers up to 200 tokens at temperature 1), sparse rollouts at the schedule the reward-aware calibration picks
# (`sparrow calibrate --profile examples/manifest-reward-profile.json --tau 0.75 --margin 0.02 --min-retention 0.9`:
# 0:3072) against dense rollouts, 10 steps of one prompt x 8 samples, seeds 0 and 1, held-out mean@4 of the dense
# policy on 8 prompts before and after; then one report (reward vs cumulative rollout seconds, throughput, tail).
# About 80 minutes on 2 idle CPU cores; a killed run continues where its last checkpoint left it.
# SPARROW_SCHEDULE overrides the sparse schedule, SPARROW_SEEDS the seeds; SPARROW_DISTILL=1 trains the sparse runs
# with DistillSparse (a LoRA adapter in the sparse actor, exact forward KL at lambda 1, lr 5e-4: the settings of
# examples/smollm2-distill.yaml), for a more aggressive schedule than tau and the retention level allow alone,
# with --gradient-checkpointing: without it the updates on the 4.6K-token prompts need more than 24 GiB. At 0:1024
# with DistillSparse both seeds ended level with dense (BENCHMARKS, round 3 session 6); ~43 min a sparse run.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_BENCH_DIR:-runs/bench/promise}
SCHEDULE=${SPARROW_SCHEDULE:-0:3072}
SEEDS=${SPARROW_SEEDS:-0 1}
DISTILL=()
SUFFIX=
if [ "${SPARROW_DISTILL:-0}" = 1 ]; then
  DISTILL=(--distill --distill-kl forward --distill-lambda 1.0 --distill-lr 5e-4 --gradient-checkpointing)
  SUFFIX=-distill
fi
mkdir -p "$OUT"
[ -s "$OUT/train.jsonl" ] || $SPARROW prompts --task manifest --count 32 --min-tokens 4096 --seed 0 --out "$OUT/train.jsonl"
[ -s "$OUT/heldout.jsonl" ] || $SPARROW prompts --task manifest --count 8 --min-tokens 4096 --seed 2 --out "$OUT/heldout.jsonl"
RUNS=()
for SEED in $SEEDS; do
  for S in dense "$SCHEDULE"; do
    NAME="$( [ "$S" = dense ] && echo dense || echo "sparse-${S//:/-}$SUFFIX" )-seed$SEED"
    # the held-out set before training is the same for every run of one seed: the dense run scores it
    EXTRA=(--eval-at-start)
    [ "$S" = dense ] || EXTRA=(--no-eval-at-start "${DISTILL[@]}")
    RUNS+=("$OUT/$NAME")
    if [ -s "$OUT/$NAME/eval.jsonl" ] && grep -q '"step": 10' "$OUT/$NAME/eval.jsonl"; then continue; fi
    RESUME=$( [ -d "$OUT/$NAME" ] && ls -d "$OUT/$NAME"/checkpoint-* >/dev/null 2>&1 && echo --resume || true )
    echo "== $NAME =="
    $SPARROW train --config examples/smollm2-manifest.yaml --data "$OUT/train.jsonl" --eval-data "$OUT/heldout.jsonl" \
        --schedule "$S" --steps 10 --num-generations 8 --eval-every 10 --reward-check-every 4 \
        --save-every 5 --keep-last 1 --seed "$SEED" \
        --output-dir "$OUT/$NAME" "${EXTRA[@]}" $RESUME
  done
done
$SPARROW report "${RUNS[@]}" --out "$OUT"
