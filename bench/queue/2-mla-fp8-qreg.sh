#!/usr/bin/env bash
# Session 54's FP8-cache MLA kernel with Q in registers (ops/mla_decode_fp8_qreg.py; bench/NOTES.md "Session 54"),
# built without a GPU, never run: call 1's roles, the P V warpgroups converting each raw step (e4m3 halves and their
# group scales) into fp16 tiles two steps ahead. Run it after call 1: if call 1's qreg tests failed, fix that kernel
# first (this one shares its roles). Its GPU tests (against the fp32 reference on the cache as it rounds it, 11
# shapes incl. padded row tiles; determinism, defer_ready and lazy_rescale bits; the op with QREG_FP8 on under
# hypothesis; batch invariance); then, unless a test process hung, the fp8-64 preset against the op's FP8 kernel and
# the bf16 cache, fp8-32 against the rows64 tile, and the trace. Expected (written before any run): the step as call
# 1's bf16 kernel (~1250-1350 cycles a 32-token step if the conversion, ~230 instructions a P V warp a step, hides
# under the tensor pipe): 128 x 64 x 4096 0.208 -> ~0.11-0.13 ms (1.3-1.5x the bf16 cache's 0.164), 128 x 128 x 4096
# 0.40 -> ~0.22-0.27 ms; 64 x 32 x 8192 (one row tile, half padding) 0.144 -> ~0.10-0.11 ms if the padded tile's
# compute hides under the bytes (344 MB: 81 us at copy). ~9 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}
mkdir -p "$out"
# the tests first, in their own session (a kernel that hangs would hang the bench and the trace too)
OUT=$out/tests TESTS="tests/test_mla_decode_fp8_qreg.py@4" DEADLINE=240 TEST_BUDGET=210 bash bench/gpu_session.sh tests \
  | tee "$out/tests-summary.txt"
if grep -E "^test_.*\.log: " "$out/tests-summary.txt" | grep -v -E " in [0-9.]+s" | grep -q .; then
  echo "a test process ended without pytest's summary (killed at its budget: a hang?): no bench, no trace"
  exit 0
fi
OUT=$out/bench DEADLINE=260 bash bench/gpu_session.sh none \
  "mla fp8-64 tilecraft,tilecraft-fp8,tilecraft-fp8-qreg --graph --flush read" \
  "mla fp8-32 tilecraft-fp8,tilecraft-fp8-qreg --graph --flush read"
timeout 90 python3 -m bench.trace_mla_qreg --fp8 2>&1 | tee -a "$out/trace-mla-fp8-qreg.txt" | tail -30
