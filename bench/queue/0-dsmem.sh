#!/usr/bin/env bash
# CLUSTER_SMEM_FOLD on by default (session 68): the op-level DSMEM bit tests (3 shapes), the dense op tests
# (hypothesis, through the planner), the cluster-room test, ~3 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -n 8 tests/test_gemm_fp8.py \
  -k "dsmem_plan or test_gpu_dense or cluster_room or thin_tiles" 2>&1 \
  | tee "$out/tests-gpu-dsmem-default-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -5
