# Seed 0 of the long-answer GRPO runs (BENCHMARKS, "The long-answer regime"), 6 steps from scratch (2026-12-05,
# 9647014; the sparse run's steps 3-4 overlapped a test run and a kernel build, so their times are left out), then
# the dense policy's held-out reward on seed 1's held-out set (4 prompts of seed 2, 2 dense samples each; its base
# figure is seed 1's heldout-eval-base.json). sparse-0-1024 is the earlier 2-step run (the long demo's seed).
set -e  # from the repository root
.venv/bin/sparrow prompts --config examples/longanswer-prompts.yaml --out /tmp/demo-long/train.jsonl
C="--config examples/smollm2-longanswer.yaml --data /tmp/demo-long/train.jsonl --seed 0 --steps 6"
.venv/bin/sparrow train $C --output-dir /tmp/seed0/sparse
.venv/bin/sparrow train $C --schedule dense --output-dir /tmp/seed0/dense
.venv/bin/sparrow prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/seed1/heldout.jsonl
E="--data /tmp/seed1/heldout.jsonl --k 2 --max-new-tokens 1400 --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json"
.venv/bin/sparrow eval --model /tmp/seed0/dense/checkpoint-6 $E > heldout-eval-dense.json
.venv/bin/sparrow eval --model /tmp/seed0/sparse/checkpoint-6 $E > heldout-eval-sparse.json
.venv/bin/sparrow report /tmp/seed0/dense /tmp/seed0/sparse --out /tmp/seed0
# Exact mode, the same seed, 2 steps (95371d6; drafts at 0:1024, K 4): tokens, rewards and losses equal the dense run's.
.venv/bin/sparrow train --config examples/smollm2-longanswer.yaml --data /tmp/demo-long/train.jsonl --seed 0 \
    --rollout-mode exact --schedule 0:1024 --draft-tokens 4 --output-dir /tmp/exact0
