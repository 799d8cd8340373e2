#!/usr/bin/env bash
# Session 52's k_scaled variant of the 64-row FP8 kernel (ops/mla_decode_fp8_rows64.py; bench/NOTES.md "Session 52"),
# built after the GPU time, never run: its GPU tests (vk_scaled: against the fp32 reference on the dequantized
# cache over the 11 shapes, late max jumps), then fp8-64 against v_scaled alone and the op's kernel, then the trace.
# Expected (written before any run): the scores phase 4085 -> ~2000 cycles a period, 128 x 64 x 4096 0.238 -> ~0.19
# ms (the op's FP8 0.216, the bf16 cache 0.164). ~6 minutes. If it wins at 64+ rows, raise ROWS64_FP8 for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode_fp8_rows64.py@2:vk_scaled" DEADLINE=360 TEST_BUDGET=180 bash bench/gpu_session.sh tests \
  "mla fp8-64 tilecraft,tilecraft-fp8,tilecraft-fp8-rows64-vs,tilecraft-fp8-rows64-vks --graph --flush read"
timeout 40 python3 -m bench.trace_mla_rows64 --case 128x64x4096 --v-scaled --k-scaled \
  > "${OUT:-/tmp}/trace-rows64-vks.log" 2>&1
tail -n 20 "${OUT:-/tmp}/trace-rows64-vks.log"
