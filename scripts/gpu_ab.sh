#!/usr/bin/env bash
# A/B of the one-GPU KV-ready latency: an earlier commit against the working tree, alternating
# in one run (lent machines differ too much to compare figures across sessions).
#   here:            scripts/gpu_ab.sh prepare REV   # git archive of REV into abtest/old (ignored)
#   on the GPU host: scripts/gpu_ab.sh run [ROUNDS] # device tool: carry [".whl", "abtest"]
# Results: $OUT/ab_{old,new}_N.json; one line per version and round on stdout.
# REV must have the top-level kvpush_bench package (the harness moved there in issue 20).
set -euo pipefail
case "${1:-}" in
prepare)
    rm -rf abtest && mkdir -p abtest/old
    git archive "${2:?commit}" kvpush kvpush_bench | tar -x -C abtest/old
    cp kvpush_bench/gpu/bench.py abtest/old/kvpush_bench/gpu/bench.py # the same driver for both
    ;;
run)
    L="python3 -m kvpush_bench.gpu.bench --unbound 0 --sizes 64K --total 64M --reps 1 --backends="
    L="$L --only ipc-inline --lat-reps 40 --lat-tunes 0:5e-5,0:5e-5:spin"
    for i in $(seq "${2:-3}"); do
        for v in old new; do
            src=$PWD
            [ "$v" = old ] && src=$PWD/abtest/old
            (cd "$src" && PYTHONPATH="/tmp/site:$src" $L --json "$OUT/ab_${v}_$i.json" 2>&1 |
                grep -E "^ipc-inline|^raw:" | sed "s/^/$v$i /")
        done
    done
    ;;
*)
    echo "usage: $0 prepare REV | run [ROUNDS]" >&2
    exit 2
    ;;
esac
