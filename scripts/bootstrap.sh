#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install kvpush with vLLM (CPU) into it.
# Usage: scripts/bootstrap.sh [--test]   (--test adds pytest, hypothesis, ruff, mypy, vllm-router)
# Idempotent: a second run only re-checks what is installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
# vLLM for CPU (and NIXL without its CUDA torch): the demo and the end-to-end tests run it.
scripts/install_vllm.sh .venv
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
