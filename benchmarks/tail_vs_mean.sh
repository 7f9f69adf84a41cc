#!/usr/bin/env bash
# Tail or mean over every sparse run with a matching dense run (BENCHMARKS.md, "Tail or mean"): the run directories
# kept under benchmarks/ (the long-answer runs of 2026-12-05 carry the sampler bug, the same in both runs of a
# pair), and the summaries of earlier runs whose logs were not kept (earlier-threshold-runs.json). The worst length
# bin's p5 comes from the monitor's per-bin figures (--min-bin-tokens, default 200 a step). The exact-mode runs
# (longanswer/*/exact-*) are left out: they sample the dense policy, so their reward says nothing of acceptance.
set -euo pipefail
cd "$(dirname "$0")/.."
G=benchmarks/longanswer/grpo
F=benchmarks/longanswer/grpo-2026-12-06  # both seeds again without the sampler bug
.venv/bin/python benchmarks/tail_vs_mean.py \
    benchmarks/promise/seed0/sparse-0-3072-seed0=benchmarks/promise/seed0/dense-seed0 \
    benchmarks/promise/seed1/sparse-0-3072-seed1=benchmarks/promise/seed1/dense-seed1 \
    benchmarks/mixed/seed0/calibrated-seed0=benchmarks/mixed/seed0/dense-seed0 \
    benchmarks/mixed/seed0/constant-seed0=benchmarks/mixed/seed0/dense-seed0 \
    benchmarks/mixed/seed1/calibrated-seed1=benchmarks/mixed/seed1/dense-seed1 \
    benchmarks/mixed/seed1/constant-seed1=benchmarks/mixed/seed1/dense-seed1 \
    benchmarks/promise-distill/seed0/sparse-0-1024-distill-seed0=benchmarks/promise/seed0/dense-seed0 \
    benchmarks/promise-distill/seed1/sparse-0-1024-distill-seed1=benchmarks/promise/seed1/dense-seed1 \
    benchmarks/pair/seed0/const-256=benchmarks/pair/seed0/dense="passkey const:256, seed 0" \
    benchmarks/pair/seed0/const-64-dl22=benchmarks/pair/seed0/dense="passkey const:64 + 22 dense layers, seed 0" \
    benchmarks/pair/seed1/const-256=benchmarks/pair/seed1/dense="passkey const:256, seed 1" \
    benchmarks/pair/seed1/const-64-dl22=benchmarks/pair/seed1/dense="passkey const:64 + 22 dense layers, seed 1" \
    "$G/seed0/sparse-0-2048=$G/seed0/dense=long answers 0:2048, seed 0" \
    "$G/seed0/sparse-0-1024=$G/seed0/dense=long answers 0:1024, seed 0" \
    "$G/seed1/sparse-0-2048=$G/seed1/dense=long answers 0:2048, seed 1" \
    "$F/seed0/sparse-0-2048=$F/seed0/dense=long answers 0:2048, seed 0 (2026-12-06)" \
    "$F/seed1/sparse-0-2048=$F/seed1/dense=long answers 0:2048, seed 1 (2026-12-06)" \
    "$F/seed0/adaptive-from-0-2048=$F/seed0/dense=long answers adaptive from 0:2048, seed 0 (2026-12-06)" \
    "$@" --extra benchmarks/earlier-threshold-runs.json
