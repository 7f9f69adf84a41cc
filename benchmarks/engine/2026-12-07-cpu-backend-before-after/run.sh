#!/usr/bin/env bash
# Decode at 8K cached tokens x 8 rows before and after the CPU speed paths moved into sparrow/cpu/ (the "before" is
# cbabf1d, a worktree at /tmp/old with its own kernel build), alternated twice in one run on an idle machine.
#   git worktree add /tmp/old cbabf1d && bash benchmarks/engine/2026-12-07-cpu-backend-before-after/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/engine/2026-12-07-cpu-backend-before-after
ARGS=(--model smollm2-135m --context 8150 --batch 8 --schedule const:1024 --steps 16 --repeats 3 --no-hf --json)
lscpu | grep -o 'avx[0-9a-z_]*' | sort -u | tr '\n' ' ' > "$OUT/cpu.txt"
for round in 1 2; do
    TORCH_EXTENSIONS_DIR=/tmp/old-ext .venv/bin/python benchmarks/at_worktree.py /tmp/old sparrow bench "${ARGS[@]}" \
        > "$OUT/before-$round.json"
    .venv/bin/sparrow bench "${ARGS[@]}" > "$OUT/after-$round.json"
done
