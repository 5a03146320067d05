#!/usr/bin/env bash
# The load benchmark (scripts/load_bench_gpu.py) on the lent H200, in device calls of at most
# 10 minutes, each within 30 s of the last (the machine keeps /root and /tmp only while warm).
# The vLLM bundle (../shared/tools/gpu-vllm/bundle.sh) is re-cut into three pieces so that
# each call stays under 64 MiB with the working tree: .vl1/part.00, .vl2/part.01 and
# .lb/part.02, with vllm-router 0.1.17 + orjson (cp312 wheels unpacked, xz) as .lb/vr.tar.xz.
#
#   call 1 (carry .vl1): scripts/load_bench_device.sh one     piece 1, the model, MPS binary?
#   call 2 (carry .vl2): scripts/load_bench_device.sh two     piece 2
#   call 3 (carry .lb):  scripts/load_bench_device.sh run     unpack, the shared-GPU sweep
#   call 4:              scripts/load_bench_device.sh mps     the same under MPS (mix A)
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
        --deadline "$deadline" --run-limit 90 "$@" 2>&1 | tee "$OUT/$tag.log" | grep -E '^\[|Error|error' | cut -c1-300
    python3 scripts/load_report.py "/tmp/$tag" --plot >"/tmp/$tag/report.md" 2>&1
    tail -40 "/tmp/$tag/report.md"
    pack "$tag"
}

case "${1:-}" in
one)
    mkdir -p /root/vl && cp .vl1/part.* /root/vl/ || exit 1
    nvidia-smi -L; nproc; free -g | head -2
    which nvidia-cuda-mps-control nvidia-smi
    t=$(date +%s)
    python3 -m kvpush.cli tiny-model "$MODEL" --shape bench && du -sh "$MODEL"
    echo "model built in $(($(date +%s) - t)) s"
    ;;
two)
    [ -e /root/vl/part.00 ] || { echo NOT-WARM; exit 3; }
    cp .vl2/part.* /root/vl/ && ls -la /root/vl
    ;;
run)
    [ -e /root/vl/part.01 ] || { echo NOT-WARM; exit 3; }
    cp .lb/part.* /root/vl/ || exit 1
    t=$(date +%s)
    cat /root/vl/part.* | python3 -c "import lzma,sys,tarfile;tarfile.open(fileobj=lzma.open(sys.stdin.buffer),mode='r|').extractall('/tmp/site')" || exit 1
    mkdir -p /tmp/vr && tar -C /tmp/vr -xJf .lb/vr.tar.xz || exit 1
    echo "unpacked in $(($(date +%s) - t)) s"
    python3 -c "import vllm, nixl, vllm_router_rs; print(vllm.__version__)" || exit 1
    # Whatever time the call has left after unpacking: no run starts later than that allows.
    left=$((${BUDGET:-585} - ($(date +%s) - t)))
    sweep shared $((left - 75)) $((left - 25)) "${MIXES[@]}"
    ;;
mps)
    [ -d /tmp/site/vllm ] || { echo NOT-WARM; exit 3; }
    mkdir -p /tmp/kvpush-mps && export CUDA_MPS_PIPE_DIRECTORY=/tmp/kvpush-mps \
        CUDA_MPS_LOG_DIRECTORY=/tmp/kvpush-mps
    nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 4; }
    # Only P and D (whose environment names the pipe dir) join it; the plain server, the
    # routers and the client do not.
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    sweep mps $((${BUDGET:-585} - 75)) $((${BUDGET:-585} - 25)) --mps "${MPS_SHARES:-50,50}" \
        --mps-dir /tmp/kvpush-mps --mix A:2048:128:160:8,24,48,96
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/kvpush-mps nvidia-cuda-mps-control
    tar -C /tmp/kvpush-mps -czf "$OUT/mps-daemon-logs.tgz" . 2>/dev/null
    ;;
*)
    echo "usage: $0 one|two|run|mps" >&2
    exit 2
    ;;
esac
