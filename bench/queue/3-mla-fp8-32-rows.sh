#!/usr/bin/env bash
# Session 52 made ops.mla_decode_fp8_rows64's 32-row tile the op's FP8 kernel at 17-32 query rows (ROWS64_FP8 = 32),
# measured on one shape (64 x 32 x 8192: 0.144 ms, 1.12x the swapped kernel it replaced). This call: the op's FP8
# GPU tests with that default (they now run the rows64 kernel at 17-32 rows), then the fp8-32 preset (batch sizes,
# MTP 2 x 16 rows, a long context) against the replaced kernel (tilecraft-fp8-swapped32), the 4-stage v_scaled
# variant and the bf16 cache. ~6 minutes. If a row loses to tilecraft-fp8-swapped32, narrow the switch (NOTES
# "Session 52").
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@2:fp8" DEADLINE=400 TEST_BUDGET=220 bash bench/gpu_session.sh tests \
  "mla fp8-32 tilecraft,tilecraft-fp8,tilecraft-fp8-swapped32,tilecraft-fp8-rows64-vs --graph --flush read"
