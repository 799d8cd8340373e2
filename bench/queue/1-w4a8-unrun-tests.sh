#!/usr/bin/env bash
# Session 56 ran bench/queue's W4A8 call: 43 of the 51 W4A8 GPU tests passed, none failed, and the three test
# processes reached their 200 s budget while compiling the contiguous-grouped kernels, so these never ran: the
# contiguous grouped product (3 of 4 cases, one in a CUDA graph), the masked whole-bursts bits (W4A8_WHOLE_BURSTS,
# the shipped default, against the loop with its tail bursts) and the dense prefill through the contiguous kernel.
# This call runs only them, four processes, with the compile time they need. ~6 minutes on a fresh machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_gemm_w4a8.py@4:contiguous+or+dense_prefill+or+whole_bursts" DEADLINE=480 TEST_BUDGET=460 \
  bash bench/gpu_session.sh tests
