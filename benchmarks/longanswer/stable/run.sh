# GRPO on the long-answer task at the paper's rule: examples/smollm2-longanswer.yaml as shipped (schedule adaptive
# from 0:2048,3584:4096, the calibration at tau 0.86 with the 0.9 reward floor and --unreached dense; the monitor
# every step), 6 steps from scratch, seeds 0 and 1; then the dense policy's held-out reward of the last checkpoint
# (4 prompts of seed 2 x 2 samples). Code at a904c95 (a worktree, benchmarks/at_worktree.py), AVX-512 EPYC,
# 2026-12-07 (other processes ran at nice 19 beside it; see BENCHMARKS). Seed 0 was killed by the kernel's OOM
# killer after step 3 (a helper process's compile) and resumed from checkpoint-3 (resumes are bitwise).
# The dense arm is the 2026-12-06 runs (../grpo-2026-12-06/seed*/): dense-check/ re-ran its seed 0 for 2 steps at
# a904c95: the same rewards and answer lengths on both steps (the same tokens), the update's grad norm equal to
# 6 digits (the shared-prompt attention split since changes its float rounding).
set -e  # from the repository root
S=".venv/bin/sparrow"
$S prompts --config examples/longanswer-prompts.yaml --out /tmp/la/train.jsonl
$S prompts --config examples/longanswer-prompts.yaml --seed 2 --count 4 --out /tmp/la/heldout.jsonl
$S train --config examples/smollm2-longanswer.yaml --data /tmp/la/train.jsonl --seed 0 --steps 2 --schedule dense \
    --output-dir /tmp/la/dense-check
for SEED in 0 1; do
  $S train --config examples/smollm2-longanswer.yaml --data /tmp/la/train.jsonl --seed $SEED --steps 6 --save-every 1 \
      --output-dir /tmp/la/seed$SEED/tau-adaptive
  $S eval --model /tmp/la/seed$SEED/tau-adaptive/checkpoint-6 --data /tmp/la/heldout.jsonl --k 2 --max-new-tokens 1400 \
      --temperature 1 --top-p 0.9 --reward number_f1 --schedule dense --seed 0 --json \
      > benchmarks/longanswer/stable/seed$SEED/heldout-eval-tau-adaptive.json
done
.venv/bin/python benchmarks/longanswer/stable/summarize.py benchmarks/longanswer/stable
