#!/usr/bin/env bash
# One device call's worth of checks: every GPU test, then every benchmark, logs under $OUT.
# Usage on the GPU host (after unpacking the TileLang bundle and setting PYTHONPATH):
#   bash bench/gpu_session.sh [pytest -k expression]
set -uo pipefail
out=${OUT:-/tmp/tilecraft-out}
mkdir -p "$out"
export TILECRAFT_CACHE_DIR=${TILECRAFT_CACHE_DIR:-/tmp/tc-cache}
python3 -m codegen.warmup all --target sm_90a > "$out/warmup.log" 2>&1 &   # fill the cache meanwhile
python3 -m pytest -q -m gpu tests ${1:+-k "$1"} 2>&1 | tee "$out/gpu_tests.log" | tail -20
wait
for job in "mla decode" "rms_norm model" "moe route" "moe dispatch" "moe combine" "topk indexer" \
           "topk sampling" "gemm prefill" "gemm decode" "gemm grouped" "gemm mxfp4"; do
  set -- $job
  timeout 240 python3 -m bench.op "$1" --shape "$2" --out "$out" 2>&1 | tee "$out/bench-$1-$2.log" | tail -12
done
python3 -m model.make_tiny /tmp/tiny-v3 > /dev/null && \
  timeout 240 python3 -m bench.model /tmp/tiny-v3 --batch 8 --input-len 128 --output-len 32 2>&1 | tee "$out/bench-model.log" | tail -15
