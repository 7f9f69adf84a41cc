#!/usr/bin/env bash
# Runs a command as on an AVX2-only x86 CPU (to time what such CI machines run, on an AVX-512 one): torch's
# AVX2 kernels, oneDNN and MKL capped at AVX2, vLLM's AVX2 library and attention paths (sitecustomize.py here, in every
# Python process the command starts). Sparrow's own compiled kernel is still built for this CPU (-march=native).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
