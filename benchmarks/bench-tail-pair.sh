#!/usr/bin/env bash
# Issue 19 part 6, a within-task pair for "tail or mean?": two sparse configurations of SmolLM2 on the passkey task
# whose mean acceptance agrees while their p5 does not, trained as the threshold runs are (10 GRPO steps of 2
# prompts x 8, held-out mean@4 before and after), with a dense baseline; about 6 minutes a run on 2 cores.
#   - the release's 2 dense layers at const:256, and
#   - 22 of the 30 layers dense at const:64: fewer layers perturbed (the mean recovers), but the few sparse layers
#     see 4 pages of a 64-page prompt (the tail stays low).
# The pair came from profiles of 8 training prompts x 8 samples (BENCHMARKS):
#   sparrow profile --prompts <8 passkey prompts> --chat --schedules const:64,const:128 --samples-per-prompt 8 \
#       --max-new-tokens 24 --temperature 1.0 --bin-size 4096 --dense-layers 0,1,...,21 --out profile-dl22
# SEED (default 0) picks the run seed. A finished run is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${SEED:-0}
OUT=${SPARROW_PAIR_DIR:-runs/bench/pair}/seed$SEED
DL22=0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21
run() {
  local name=$1; shift
  if [ -s "$OUT/$name/eval.jsonl" ] && grep -q '"step": 10' "$OUT/$name/eval.jsonl"; then return 0; fi
  echo "== seed $SEED: $name =="
  .venv/bin/sparrow train --config examples/smollm2-passkey.yaml --steps 10 --save-every 10 \
    --eval-data examples/passkey-heldout.jsonl --eval-every 10 --eval-generations 4 --seed "$SEED" \
    --output-dir "$OUT/$name" "$@"
}
run dense --schedule dense
run const-256 --schedule const:256
run const-64-dl22 --schedule const:64 --dense-layers $DL22
.venv/bin/python benchmarks/tail_vs_mean.py "$OUT/const-256=$OUT/dense=passkey const:256 seed $SEED" \
  "$OUT/const-64-dl22=$OUT/dense=passkey const:64 22 dense layers seed $SEED"
