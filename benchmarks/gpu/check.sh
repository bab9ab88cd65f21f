#!/usr/bin/env bash
# One run on a CUDA machine: the Triton kernels compiled for the device against their torch
# twins, the engine's greedy parity with transformers on CUDA, then the kernel and throughput
# benchmarks. Logs and JSON go to $OUT (default /tmp/gpu-check).
#
#   bash benchmarks/gpu/check.sh
#
# Wheels in .whl/ (packages the machine lacks) are installed to /tmp/site first.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
# kvpager not installed there: a view of the folders under their package names (package-dir)
if ! python3 -c 'import kvpager.kernels' 2>/dev/null; then
    mkdir -p /tmp/kvpager-view/kvpager && cp kvpager/*.py /tmp/kvpager-view/kvpager/
    for d in engine kernels schemas services; do ln -sfn "$PWD/$d" "/tmp/kvpager-view/kvpager/$d"; done
    export PYTHONPATH=/tmp/kvpager-view:$PYTHONPATH
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c \
  'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; \
  lscpu | grep -E "Model name|^CPU\(s\)"; } 2>&1 | tee "$OUT/env.txt"
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name"; local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tail -n 400 > "$OUT/$name.log"
    echo "   rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s: $(grep -E 'passed|failed|error|tok/s|x$' "$OUT/$name.log" | tail -n 3 | tr '\n' ' ')"
}
# the marked tests (the CPU-device ones run Triton interpreted, so not here); kernels.triton checks
# every kernel against its twin on the device too
step kernel_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels
step engine_tests 180 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/worker/test_triton_backend.py tests/engine/worker/test_fp8_cache.py \
    tests/engine/worker/test_kv_cache_dtype.py tests/engine/kv/test_sliding_cache.py \
    tests/engine/model/test_parity.py
step kernel_bench 100 python3 -m benchmarks.kernels.triton --out "$OUT/kernels.json"
step deltanet_bench 60 python3 -m benchmarks.kernels.gated_delta_rule
step mamba2_bench 60 python3 -m benchmarks.kernels.mamba2
step throughput 120 python3 -m benchmarks.gpu.throughput --out "$OUT/gpu_throughput.json"
