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
# SPARROW_TASK=longanswer runs the same experiment in the long-answer regime (issue 40): examples/longanswer-prompts.yaml
# and examples/smollm2-longanswer.yaml (answers of ~1.3K tokens), 6 steps, held-out mean@4 on 4 prompts, the reward
# check every 3rd step; about 14 minutes a dense step on 2 cores, so its four runs take most of a day.
# SPARROW_EXACT=1 adds an exact-mode run per seed (issue 38: the schedule drafts SPARROW_DRAFT_TOKENS tokens, default
# 4, the dense policy verifies): its rollouts are the dense policy's own samples, so its rewards and losses should
# equal the dense run's step for step; the report sets its step time against dense's.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
TASK=${SPARROW_TASK:-manifest}
case "$TASK" in
  manifest)
    CONFIG=examples/smollm2-manifest.yaml; STEPS=${SPARROW_STEPS:-10}; CHECK=4; SAVE=5
    TRAIN_PROMPTS=(--task manifest --count 32 --min-tokens 4096 --seed 0)
    HELDOUT_PROMPTS=(--task manifest --count 8 --min-tokens 4096 --seed 2) ;;
  longanswer)
    CONFIG=examples/smollm2-longanswer.yaml; STEPS=${SPARROW_STEPS:-6}; CHECK=3; SAVE=1
    TRAIN_PROMPTS=(--config examples/longanswer-prompts.yaml)
    HELDOUT_PROMPTS=(--config examples/longanswer-prompts.yaml --count 4 --seed 2) ;;
  *) echo "SPARROW_TASK $TASK: expected manifest or longanswer" >&2; exit 2 ;;
esac
OUT=${SPARROW_BENCH_DIR:-runs/bench/promise$( [ "$TASK" = manifest ] || echo "-$TASK" )}
# the config's own (calibrated) schedule unless SPARROW_SCHEDULE names another
SCHEDULE=${SPARROW_SCHEDULE:-$(.venv/bin/python -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["sparse"]["schedule"])' "$CONFIG")}
SEEDS=${SPARROW_SEEDS:-0 1}
DISTILL=()
SUFFIX=
if [ "${SPARROW_DISTILL:-0}" = 1 ]; then
  DISTILL=(--distill --distill-kl forward --distill-lambda 1.0 --distill-lr 5e-4 --gradient-checkpointing)
  SUFFIX=-distill
fi
mkdir -p "$OUT"
[ -s "$OUT/train.jsonl" ] || $SPARROW prompts "${TRAIN_PROMPTS[@]}" --out "$OUT/train.jsonl"
[ -s "$OUT/heldout.jsonl" ] || $SPARROW prompts "${HELDOUT_PROMPTS[@]}" --out "$OUT/heldout.jsonl"
KINDS=(dense sparse)
[ "${SPARROW_EXACT:-0}" = 1 ] && KINDS+=(exact)
K=${SPARROW_DRAFT_TOKENS:-4}
RUNS=()
for SEED in $SEEDS; do
  for KIND in "${KINDS[@]}"; do
    S=$( [ "$KIND" = dense ] && echo dense || echo "$SCHEDULE" )
    case "$KIND" in
      dense) NAME=dense-seed$SEED ;;
      sparse) NAME="sparse-${S//:/-}$SUFFIX-seed$SEED" ;;
      exact) NAME="exact-${S//:/-}-k$K-seed$SEED" ;;
    esac
    NAME=${NAME// /}
    # the held-out set before training is the same for every run of one seed: the dense run scores it
    EXTRA=(--eval-at-start)
    [ "$KIND" = sparse ] && EXTRA=(--no-eval-at-start "${DISTILL[@]}")
    [ "$KIND" = exact ] && EXTRA=(--no-eval-at-start --rollout-mode exact --draft-tokens "$K")
    RUNS+=("$OUT/$NAME")
    if [ -s "$OUT/$NAME/eval.jsonl" ] && grep -q "\"step\": $STEPS" "$OUT/$NAME/eval.jsonl"; then continue; fi
    RESUME=$( [ -d "$OUT/$NAME" ] && ls -d "$OUT/$NAME"/checkpoint-* >/dev/null 2>&1 && echo --resume || true )
    echo "== $NAME =="
    $SPARROW train --config "$CONFIG" --data "$OUT/train.jsonl" --eval-data "$OUT/heldout.jsonl" \
        --schedule "$S" --steps "$STEPS" --num-generations 8 --eval-every "$STEPS" --reward-check-every "$CHECK" \
        --save-every "$SAVE" --keep-last 1 --seed "$SEED" \
        --output-dir "$OUT/$NAME" "${EXTRA[@]}" $RESUME
  done
done
$SPARROW report "${RUNS[@]}" --out "$OUT"
