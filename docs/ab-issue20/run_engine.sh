#!/bin/bash
# A/B of the product path through real vLLM (CPU): the same engine bench, the code before
# issue 20's deletions (824361f) and after, alternating per round. Usage: run_engine.sh ROUNDS AFTER_TREE AFTER_CLI
set -u
ROUNDS=$1; AFTER=$2; AFTER_CLI=$3
BEFORE=/work/ab-before; BEFORE_CLI="kvpush.cli"
for r in $(seq 1 "$ROUNDS"); do
  for v in before after; do
    if [ $v = before ]; then T=$BEFORE; C=$BEFORE_CLI; else T=$AFTER; C=$AFTER_CLI; fi
    echo "$(date -u +%T) round $r $v ($T, load $(cut -d' ' -f1 /proc/loadavg))"
    (cd "$T" && PYTHONPATH="$T" /work/main/.venv/bin/python -m $C bench --parts engine \
        --configs kvpush --rounds 1 --json /work/ab/engine-$v-$r.json \
        --plots /work/ab/plots-$v-$r --workdir /work/ab/logs-$v-$r > /work/ab/engine-$v-$r.log 2>&1)
    echo "  rc=$?"
  done
done
