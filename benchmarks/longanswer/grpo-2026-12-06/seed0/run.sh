# Seed 0 of the long-answer GRPO runs (BENCHMARKS, "The long-answer regime") re-run without the sampler bug:
# 2026-12-06 at 1e7c30f, AMD EPYC with AVX-512, idle machine, 6 steps each from scratch; then the dense policy's
# held-out reward (4 prompts of seed 2 x 2 dense samples) of the base model and of both runs' last checkpoints.
set -e  # from the repository root
S=".venv/bin/sparrow"
$S prompts --config examples/longanswer-prompts.yaml --out /tmp/la0/train.jsonl
$S prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/la0/heldout.jsonl
E="--data /tmp/la0/heldout.jsonl --k 2 --max-new-tokens 1400 --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json"
C="--config examples/smollm2-longanswer.yaml --data /tmp/la0/train.jsonl --seed 0 --steps 6"
$S train $C --output-dir /tmp/la0/sparse
$S train $C --schedule dense --output-dir /tmp/la0/dense
$S eval --model smollm2-135m $E > heldout-eval-base.json
$S eval --model /tmp/la0/dense/checkpoint-6 $E > heldout-eval-dense.json
$S eval --model /tmp/la0/sparse/checkpoint-6 $E > heldout-eval-sparse.json
$S report /tmp/la0/dense /tmp/la0/sparse --out /tmp/la0/report
# Exact mode, the same seed, 2 steps (drafts at 0:1024, K 2): rewards and answer lengths equal the dense run's.
$S train --config examples/smollm2-longanswer.yaml --data /tmp/la0/train.jsonl --seed 0 --steps 2 \
    --rollout-mode exact --schedule 0:1024 --draft-tokens 2 --output-dir /tmp/la0/exact
