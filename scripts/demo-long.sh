#!/usr/bin/env bash
# The long-answer demo, where Sparrow is meant to pay: GRPO on SmolLM2-135M-Instruct and the long-answer task
# (examples/longanswer-prompts.yaml: ~3.4K-token prompts, answers of up to ~1.3K tokens copying a 128-code manifest,
# temperature 1, top-p 0.9), so decode is most of a rollout. Two steps on sparse rollouts at the paper's rule
# (examples/smollm2-longanswer.yaml: the adaptive schedule from the tau-0.86 calibration, the tail measured every
# step), the same two on dense rollouts, then one report whose "step speed vs dense" is the whole training step's.
# 30-60 minutes on 2 CPU cores; each step prints a line, and on a terminal its rollouts show a progress bar.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SPARROW=.venv/bin/sparrow
OUT=${SPARROW_DEMO_DIR:-runs/demo-long}
rm -rf "$OUT"
mkdir -p "$OUT"
echo "== 1/4 prompts of the long-answer task (128-code manifests; answers of ~1.3K tokens when complete) =="
$SPARROW prompts --config examples/longanswer-prompts.yaml --out "$OUT/train.jsonl"
echo "== 2/4 GRPO on sparse rollouts (2 steps of one prompt x 8 samples) =="
$SPARROW train --config examples/smollm2-longanswer.yaml --data "$OUT/train.jsonl" --output-dir "$OUT/sparse"
echo "== 3/4 the same run on dense rollouts =="
$SPARROW train --config examples/smollm2-longanswer.yaml --data "$OUT/train.jsonl" --schedule dense \
    --output-dir "$OUT/dense"
echo "== 4/4 report =="
$SPARROW report "$OUT/dense" "$OUT/sparse" --out "$OUT"
cat "$OUT/report.md"
echo
echo "Not shown here: whether sparse rollouts learn as well as dense ones (two steps are too few; held-out reward and"
echo "two seeds: SPARROW_TASK=longanswer bash benchmarks/bench-promise.sh, hours on 2 cores), and exact mode's"
echo "speed (docs/exact-mode.md)."
echo "Results: $OUT/report.md (plots beside it), runs in $OUT/sparse and $OUT/dense"
