#!/usr/bin/env bash
# Session 51's FP8-cache MLA kernel at 64 rows a CTA (ops/mla_decode_fp8_rows64.py; bench/NOTES.md "Session 51"),
# never run: its GPU tests first (against the fp32 reference on the dequantized cache, determinism, splits, the
# first step's scores and P), then the fp8-64 rows beside the op's FP8 kernel and the bf16 cache, both variants
# (v_scaled: three stages), then the traces. ~9.5 minutes. If the tests fail, read the failing shapes and the
# first-step diagnosis before timing anything (the bench's "dist" column says how far each provider is from the first).
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode_fp8_rows64.py@3" DEADLINE=410 TEST_BUDGET=230 bash bench/gpu_session.sh tests \
  "mla fp8-64 tilecraft,tilecraft-fp8,tilecraft-fp8-rows64,tilecraft-fp8-rows64-vs --graph --flush read"
# where a step goes (CTA 0's per-warpgroup events, every CTA's span), both variants at 64 rows and the 32-row tile
for c in "--case 128x64x4096" "--case 128x64x4096 --v-scaled" "--case 64x32x8192"; do
  timeout 40 python3 -m bench.trace_mla_rows64 $c > "${OUT:-/tmp}/trace-rows64-$(echo $c | tr -c 'a-z0-9' '-').log" 2>&1
done
tail -n 20 "${OUT:-/tmp}"/trace-rows64-*.log
