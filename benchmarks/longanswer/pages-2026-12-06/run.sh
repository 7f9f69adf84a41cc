# KV pages of 64 tokens instead of 16 on the long-answer task (twelfth session, 2026-12-06, AMD EPYC with AVX-512,
# idle machine): this CPU reads scattered 4 KiB pages at about half its streaming rate (BENCHMARKS, "Decode speed in
# our engine"), and a 64-token page is 16 KiB. The rollout phase (one prompt x 8 samples, configurations one after
# another in one process, same seeds) and the profile of const:2048 on the calibration prompts at page 64.
set -e  # from the repository root
S=".venv/bin/sparrow"
O=benchmarks/longanswer/pages-2026-12-06
$S prompts --config examples/longanswer-prompts.yaml --out /tmp/lap/train.jsonl
.venv/bin/python benchmarks/bench_rollout_phase.py --prompts /tmp/lap/train.jsonl --count 1 --samples 8 \
    --max-new-tokens 1400 --top-p 0.9 --configs dense,0:2048,0:2048+page64,0:1024+page64 --reward number_f1 \
    > $O/rollout-phase.jsonl
$S prompts --config examples/longanswer-prompts.yaml --seed 1 --count 2 --out /tmp/lap/calib.jsonl
$S profile --model smollm2-135m --prompts /tmp/lap/calib.jsonl --reward number_f1 --schedules "const:2048" \
    --page-size 64 --samples-per-prompt 4 --max-new-tokens 1400 --top-p 0.9 --bin-size 512 --temperature 1.0 \
    --seed 0 --out /tmp/lap/profile-page64
