#!/usr/bin/env bash
# Session 53 (no GPU lent): W4A8_WHOLE_BURSTS now leaves the dead tail bursts out of the masked loop too (session 52
# timed W4A8_MASKED_WHOLE the same as the default, its bits-test passed), and the losing switches are gone. This
# call: the W4A8 GPU tests (the masked whole-bursts test now compares against the loop with its tails), then
# mxfp4-prefill with the two new dense rows (m = 4096: mxfp4_w4a8_gemm_nt runs the contiguous kernel as one expert;
# never timed) against torch's bf16 GEMM and the tails build. Expected (written before any run): the grouped rows as
# session 52 (251.7 / 2030 / 329.7 us); dense 4096x4096x7168 ~ the 4x1024 grouped row's 956 TFLOP/s, ~250 us, ~1.3x
# torch; 4096x7168x2048 ~ the down projection's ~730 TFLOP/s, ~165 us. ~6 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_gemm_w4a8.py@3" DEADLINE=420 TEST_BUDGET=200 bash bench/gpu_session.sh tests \
  "gemm mxfp4-prefill tilecraft-w4a8,tilecraft-w4a8-tails,torch --graph --flush read"
