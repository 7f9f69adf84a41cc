# Seed 1 of the long-answer GRPO runs (BENCHMARKS, "The long-answer regime"). Steps 1-2 ran first (2026-12-05,
# the config's default --steps 2); steps 3-6 resumed from their checkpoints with --steps 6 --resume (fc69d18, idle
# machine). The held-out set: 4 prompts of seed 2, 2 dense samples each, before (base) and after 6 steps.
set -e  # from the repository root
.venv/bin/sparrow prompts --config examples/longanswer-prompts.yaml --out /tmp/demo-long/train.jsonl
C="--config examples/smollm2-longanswer.yaml --data /tmp/demo-long/train.jsonl --seed 1"
.venv/bin/sparrow train $C --output-dir /tmp/seed1/sparse
.venv/bin/sparrow train $C --schedule dense --output-dir /tmp/seed1/dense
.venv/bin/sparrow train $C --steps 6 --resume --output-dir /tmp/seed1/sparse
.venv/bin/sparrow train $C --steps 6 --resume --schedule dense --output-dir /tmp/seed1/dense
.venv/bin/sparrow prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/seed1/heldout.jsonl
E="--data /tmp/seed1/heldout.jsonl --k 2 --max-new-tokens 1400 --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json"
.venv/bin/sparrow eval --model smollm2-135m $E > heldout-eval-base.json
.venv/bin/sparrow eval --model /tmp/seed1/dense/checkpoint-6 $E > heldout-eval-dense.json
.venv/bin/sparrow eval --model /tmp/seed1/sparse/checkpoint-6 $E > heldout-eval-sparse.json
.venv/bin/sparrow report /tmp/seed1/dense /tmp/seed1/sparse --out /tmp/seed1
