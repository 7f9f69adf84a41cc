#!/usr/bin/env bash
# The threshold in miniature on SmolLM2/passkey (BENCHMARKS.md): 10 GRPO steps per fixed budget and a dense
# baseline, held-out evaluation before and after; about 6 minutes per run on 2 cores. SEED (default 0) picks the
# run seed; SCHEDULES the budgets to run.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${SEED:-0}
OUT=${SPARROW_THRESHOLD_DIR:-runs/bench/threshold}
[ "$SEED" = 0 ] || OUT="$OUT/seed-$SEED"
mkdir -p "$OUT"
for schedule in ${SCHEDULES:-const:64 const:128 const:256 const:512 dense}; do
    name=${schedule/:/-}
    .venv/bin/sparrow train --config examples/smollm2-passkey.yaml --schedule "$schedule" --steps 10 --save-every 10 \
        --eval-data examples/passkey-heldout.jsonl --eval-every 10 --eval-generations 4 --seed "$SEED" \
        --output-dir "$OUT/$name"
done
if [ -d "$OUT/dense" ]; then .venv/bin/sparrow report "$OUT/dense" "$OUT"/const-*/ --out "$OUT"; fi
