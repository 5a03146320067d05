#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install kvpush into it.
# Usage: scripts/bootstrap.sh [--test]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
"${pip[@]}" -e ".${extras}"
# NIXL without its dependencies: the plain package pulls a CUDA torch (~6 GB).
"${pip[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
