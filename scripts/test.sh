#!/usr/bin/env bash
# Set up .venv with the test tools (first run only), lint, type-check, check the import
# layering and run every test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/bootstrap.sh --test
.venv/bin/ruff check kvpush kvpush_bench tests
.venv/bin/mypy
# The layering contracts in pyproject.toml ([tool.importlinter]); no cache dir in the tree.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q "$@"
