# Seed 0 of the long-answer GRPO runs with `schedule: adaptive` from the calibrated 0:2048 (twelfth session,
# 2026-12-06, AMD EPYC with AVX-512, idle machine): 6 steps from scratch with the monitor every step (the adaptive
# controller moves a bin only on steps it measures), then the dense policy's held-out reward of its last
# checkpoint on run.sh's held-out prompts. Compare with run.sh's dense and 0:2048 runs of the same seed.
set -e  # from the repository root
S=".venv/bin/sparrow"
$S prompts --config examples/longanswer-prompts.yaml --out /tmp/la0/train.jsonl
$S prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/la0/heldout.jsonl
$S train --config examples/smollm2-longanswer.yaml --data /tmp/la0/train.jsonl --seed 0 --steps 6 \
    --schedule adaptive --adaptive-start 0:2048 --monitor-every 1 --output-dir /tmp/la0/adaptive
$S eval --model /tmp/la0/adaptive/checkpoint-6 --data /tmp/la0/heldout.jsonl --k 2 --max-new-tokens 1400 \
    --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json > /tmp/la0/heldout-eval-adaptive.json
