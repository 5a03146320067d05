#!/usr/bin/env bash
# The load benchmark (scripts/load_bench_gpu.py) on the lent H200, in device calls of at most
# 10 minutes, each within 30 s of the last (the machine keeps /root and /tmp only while warm).
# The vLLM bundle (../shared/tools/gpu-vllm/bundle.sh) is re-cut into three pieces so that
# each call stays under 64 MiB with the working tree: .vl1/part.00, .vl2/part.01 and
# .lb/part.02, with vllm-router 0.1.17 + orjson (cp312 wheels unpacked, xz) as .lb/vr.tar.xz.
#
#   here, once:          ../shared/tools/gpu-vllm/bundle.sh && scripts/load_bench_device.sh prep
#   call 1 (carry .vl1): scripts/load_bench_device.sh one    piece 1, GPU and MPS binary check
#   call 2 (carry .vl2): scripts/load_bench_device.sh two    piece 2, the model (bench shape)
#   call 3 (carry .lb):  scripts/load_bench_device.sh unpack     (then `again` / `mps` in it)
#                   or:  BUDGET=580 scripts/load_bench_device.sh run [load_bench_gpu flags]
#                        unpack, then (default) mix A and mix B, every contender, as tag
#                        `shared`, until the call's budget
#   later calls (warm):  scripts/load_bench_device.sh again TAG DEADLINE LIMIT [load_bench_gpu flags]
#                        scripts/load_bench_device.sh mps TAG DEADLINE LIMIT [flags]  (P, D under MPS)
# Results come back as $OUT/<tag>.tgz (vLLM's JSONs, summary.json, logs) and $OUT/<tag>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:/tmp/vr:$PWD TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 KVPUSH_DEVICE=cuda
MODEL=/root/lbmodel
OUT=${OUT:-/tmp/out}
# Mix A as in issue 38; mix B the longer prompts (fewer requests, lower rates).
MIXES=(--mix A:2048:128:160:8,24,48,96 --mix B:8192:256:32:2,4,8)

pack() {  # $1: tag; the run's results and server logs (no model), small enough to come back
    tar -C "/tmp/$1" --exclude=model -czf "$OUT/$1.tgz" . 2>/dev/null
    ls -la "$OUT"
}

sweep() {  # $1: tag, $2: seconds until no bench run starts, $3: hard limit, then flags
    local tag=$1 deadline=$2 limit=$3
    shift 3
    rm -rf "/tmp/$tag"
    mkdir -p "/tmp/$tag"
    timeout -s TERM "$limit" python3 scripts/load_bench_gpu.py --out "/tmp/$tag" --model "$MODEL" \
        --deadline "$deadline" --run-limit "${RUN_LIMIT:-90}" "$@" 2>&1 | tee "$OUT/$tag.log" | grep -E '^\[|Error|error' | cut -c1-300
    python3 scripts/load_report.py "/tmp/$tag" --plot >"/tmp/$tag/report.md" 2>&1
    tail -40 "/tmp/$tag/report.md"
    pack "$tag"
}

case "${1:-}" in
prep)  # here, not on the device: .vl1/.vl2 from bundle.sh re-cut in three, vllm-router packed
    printf '/.vl1/\n/.vl2/\n/.lb/\n' >>.git/info/exclude
    tmp=$(mktemp -d)
    cat .vl1/part.* .vl2/part.* | split -b 44M -d - "$tmp/piece." || exit 1
    rm -rf .vl1 .vl2 .lb && mkdir -p .vl1 .vl2 .lb/site
    mv "$tmp/piece.00" .vl1/part.00 && mv "$tmp/piece.01" .vl2/part.01 && mv "$tmp/piece.02" .lb/part.02
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" \
        vllm-router==0.1.17 orjson==3.13.0 || exit 1
    for w in "$tmp"/*.whl; do (cd .lb/site && python3 -m zipfile -e "$w" .); done
    tar -C .lb/site -cf - . | xz -9 -T0 >.lb/vr.tar.xz && rm -rf .lb/site "$tmp"
    du -sh .vl1 .vl2 .lb
    ;;
one)
    mkdir -p /root/vl && cp .vl1/part.* /root/vl/ || exit 1
    nvidia-smi -L; nproc; free -g | head -2
    which nvidia-cuda-mps-control nvidia-smi
    ;;
two)
    [ -e /root/vl/part.00 ] || { echo NOT-WARM; exit 3; }
    cp .vl2/part.* /root/vl/ && ls -la /root/vl
    # Not `kvpush tiny-model`: kvpush.cli imports the router, whose msgspec is in the bundle.
    python3 -c "from kvpush.tiny_model import make_tiny_model as m; print(m('$MODEL', 0, 'bench'))"
    ;;
unpack | run)
    [ -e /root/vl/part.01 ] || { echo NOT-WARM; exit 3; }
    cp .lb/part.* /root/vl/ || exit 1
    t=$(date +%s)
    cat /root/vl/part.* | python3 -c "import lzma,sys,tarfile;tarfile.open(fileobj=lzma.open(sys.stdin.buffer),mode='r|').extractall('/tmp/site')" || exit 1
    mkdir -p /tmp/vr && tar -C /tmp/vr -xJf .lb/vr.tar.xz || exit 1
    echo "unpacked in $(($(date +%s) - t)) s"
    python3 -c "import vllm, nixl, vllm_router_rs; print(vllm.__version__)" || exit 1
    [ "$1" = run ] || exit 0
    # Whatever time the call has left after unpacking: no run starts later than that allows.
    left=$((${BUDGET:-585} - ($(date +%s) - t)))
    shift
    [ $# -gt 0 ] || set -- "${MIXES[@]}"
    sweep shared $((left - 75)) $((left - 25)) "$@"
    ;;
again)
    [ -d /tmp/site/vllm ] || { echo NOT-WARM; exit 3; }
    shift
    sweep "$@"
    ;;
mps)
    [ -d /tmp/site/vllm ] || { echo NOT-WARM; exit 3; }
    shift
    mkdir -p /tmp/kvpush-mps
    # Only P and D (load_bench_gpu.py --mps puts the pipe dir in their environment) join
    # this daemon; the plain server, the fronts and the client run outside MPS.
    CUDA_MPS_PIPE_DIRECTORY=/tmp/kvpush-mps CUDA_MPS_LOG_DIRECTORY=/tmp/kvpush-mps \
        nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 4; }
    tag=$1 deadline=$2 limit=$3
    shift 3
    sweep "$tag" "$deadline" "$limit" --mps "${MPS_SHARES:-50,50}" --mps-dir /tmp/kvpush-mps "$@"
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/kvpush-mps nvidia-cuda-mps-control
    tar -C /tmp/kvpush-mps -czf "$OUT/$tag-daemon.tgz" --exclude=control --exclude=control_privileged .
    ;;
*)
    echo "usage: $0 prep|one|two|unpack|run|again|mps" >&2
    exit 2
    ;;
esac
