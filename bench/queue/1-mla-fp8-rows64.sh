#!/usr/bin/env bash
# Session 51's FP8-cache MLA kernel at 64 rows a CTA (ops/mla_decode_fp8_rows64.py; bench/NOTES.md "Session 51"),
# never run: its GPU tests first (against the fp32 reference on the dequantized cache, determinism, splits), then
# the fp8-64 rows beside the op's FP8 kernel and the bf16 cache, both variants (v_scaled: three stages). ~8 minutes. If the tests fail, read the failing
# shapes before timing anything (the bench's "dist" column says how far each provider is from the first).
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode_fp8_rows64.py@2" DEADLINE=480 TEST_BUDGET=240 bash bench/gpu_session.sh tests \
  "mla fp8-64 tilecraft,tilecraft-fp8,tilecraft-fp8-rows64,tilecraft-fp8-rows64-vs --graph --flush read"
