#!/usr/bin/env bash
# Session 49's masked whole-burst plans and the dense W4A8 prefill path (items 3-4): their GPU tests (bitwise the
# default / the contiguous op), then the grouped A/B. ~6 minutes. Turn each switch on only if its test passes and it
# is faster in the same run.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_gemm_w4a8.py:masked_whole tests/test_gemm_w4a8.py:dense_prefill" DEADLINE=400 TEST_BUDGET=240 \
  bash bench/gpu_session.sh tests \
  "gemm mxfp4-grouped tilecraft-w4a8,tilecraft-w4a8-mwhole,torch --graph --flush read"
