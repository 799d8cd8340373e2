#!/usr/bin/env bash
# CLUSTER_SMEM_FOLD on by default (session 68): the dense FP8 GPU tests that reach split plans through the op, then
# the runtime's GPU tests (FP8 GEMMs in the model, CUDA graphs).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -n 8 tests/test_gemm_fp8.py \
  -k "not mxfp4 and not w4a8 and (dense or split or fold or cluster or dsmem or graph or decode or op)" 2>&1 \
  | tee "$out/tests-gpu-dsmem-default-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -5
timeout 90 python3 -m pytest -q -m gpu -n 4 tests/test_runtime.py 2>&1 \
  | tee "$out/tests-gpu-runtime-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -4
