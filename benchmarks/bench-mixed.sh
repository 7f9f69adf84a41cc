#!/usr/bin/env bash
# Issue 19 part 5, the paper's design claim in miniature: on prompts spanning ~1K to ~7K tokens (the built-in
# passkey task at mixed lengths), GRPO with sparse rollouts at the schedule calibrated per length bin (p5 held flat
# across bins) against a constant budget of equal predicted rollout cost (`sparrow cost --prompt-lens`) and against
# dense rollouts; two seeds, 10 steps of 1 prompt x 8 samples, held-out mean@4 of the dense policy on 8 mixed-length
# prompts before and after. The report gives exact p5/p1 per length bin and reward per prompt-length bucket.
# SPARROW_CALIBRATED and SPARROW_CONSTANT override the two schedules. The defaults came from (BENCHMARKS, about an
# hour on 2 cores):
#   sparrow prompts --task passkey --count 8 --min-tokens 1024 --max-tokens 7168 --seed 5 --out probe.jsonl
#   sparrow profile --model smollm2-135m --prompts probe.jsonl --schedules const:128,const:256,const:512,const:1024,const:2048 \
#       --samples-per-prompt 4 --max-new-tokens 24 --bin-size 1024 --temperature 1.0 --seed 0 --reward first_number --out profile
#   sparrow calibrate --profile profile/profile.json --tau 0.75 --margin 0.02          # 0:512, 3072:1024, 5120:2048
#   sparrow cost --model smollm2-135m --schedule "0:512, 3072:1024, 5120:2048" --gen-len 24 --samples 8 \
#       --prompt-lens <the 32 training prompts' lengths, 1123..7898>                  # const:1280
# A killed run continues where its last checkpoint left it.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_BENCH_DIR:-runs/bench/mixed}
CALIBRATED=${SPARROW_CALIBRATED:-"0:512, 3072:1024, 5120:2048"}
CONSTANT=${SPARROW_CONSTANT:-const:1280}
SEEDS=${SPARROW_SEEDS:-0 1}
mkdir -p "$OUT"
[ -s "$OUT/train.jsonl" ] || $SPARROW prompts --task passkey --count 32 --min-tokens 1024 --max-tokens 7168 --seed 0 --out "$OUT/train.jsonl"
[ -s "$OUT/heldout.jsonl" ] || $SPARROW prompts --task passkey --count 8 --min-tokens 1024 --max-tokens 7168 --seed 2 --out "$OUT/heldout.jsonl"
RUNS=()
for SEED in $SEEDS; do
  for S in dense "$CALIBRATED" "$CONSTANT"; do
    case "$S" in
      dense) NAME=dense ;;
      "$CALIBRATED") NAME=calibrated ;;
      *) NAME=constant ;;
    esac
    NAME="$NAME-seed$SEED"
    RUNS+=("$OUT/$NAME")
    if [ -s "$OUT/$NAME/eval.jsonl" ] && grep -q '"step": 10' "$OUT/$NAME/eval.jsonl"; then continue; fi
    # the held-out set before training is the same for every run of one seed: the dense run scores it
    AT_START=$( [ "$S" = dense ] && echo --eval-at-start || echo --no-eval-at-start )
    RESUME=$( [ -d "$OUT/$NAME" ] && ls -d "$OUT/$NAME"/checkpoint-* >/dev/null 2>&1 && echo --resume || true )
    echo "== $NAME: $S =="
    $SPARROW train --config examples/smollm2-passkey-mixed.yaml --data "$OUT/train.jsonl" --eval-data "$OUT/heldout.jsonl" \
        --schedule "$S" --seed "$SEED" $AT_START --output-dir "$OUT/$NAME" $RESUME
  done
done
$SPARROW report "${RUNS[@]}" --out "$OUT"
