#!/usr/bin/env bash
# Set up .venv (first run only) and run the demo. Extra arguments go to `kvpush demo`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh" >&2  # keep stdout for the demo (--json)
exec "$root/.venv/bin/kvpush" demo "$@"
