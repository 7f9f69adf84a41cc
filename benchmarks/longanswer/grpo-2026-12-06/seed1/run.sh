# Seed 1 of the long-answer GRPO runs (BENCHMARKS, "The long-answer regime") re-run without the sampler bug:
# 2026-12-06 at f9ce771, AMD EPYC with AVX-512, idle machine, 6 steps each from scratch; then the dense policy's
# held-out reward (4 prompts of seed 2 x 2 dense samples) of both runs' last checkpoints. The base model's held-out
# reward is seed 0's (../seed0/heldout-eval-base.json): the same prompts, model and sampling seed.
set -e  # from the repository root
S=".venv/bin/sparrow"
$S prompts --config examples/longanswer-prompts.yaml --out /tmp/la1/train.jsonl
$S prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/la1/heldout.jsonl
E="--data /tmp/la1/heldout.jsonl --k 2 --max-new-tokens 1400 --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json"
C="--config examples/smollm2-longanswer.yaml --data /tmp/la1/train.jsonl --seed 1 --steps 6"
$S train $C --output-dir /tmp/la1/sparse
$S train $C --schedule dense --output-dir /tmp/la1/dense
$S eval --model /tmp/la1/dense/checkpoint-6 $E > /tmp/la1/heldout-eval-dense.json
$S eval --model /tmp/la1/sparse/checkpoint-6 $E > /tmp/la1/heldout-eval-sparse.json
$S report /tmp/la1/dense /tmp/la1/sparse --out /tmp/la1/report
