#!/usr/bin/env bash
# The one-call plan (bench/NOTES.md "Open GPU checks (end of session 54)"), for a session that may get a single
# device call: both Q-in-registers kernels' first run (ops/mla_decode_qreg.py, ops/mla_decode_fp8_qreg.py: their
# GPU tests in one session, 4 processes each), then, unless a test process hung, the decode grid against the op and
# FlashMLA (built beside us in the background meanwhile, from .devbundle/peers/, when that is there) and fp8-64
# against the op's FP8 kernel and the bf16 cache. Expected (written before any run): 128 x 128 x 4096 bf16
# 0.29 -> ~0.22-0.26 ms (FlashMLA ~0.26); FP8 128 x 64 x 4096 0.208 -> ~0.11-0.13 ms. ~9.5 minutes.
# Afterwards, if this ran instead of 1-mla-qreg.sh and 2-mla-fp8-qreg.sh, those still hold the traces and fp8-32.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}
mkdir -p "$out"
fm_done=/tmp/fm-done
if [[ -f .devbundle/peers/fm.tar.xz ]]; then
  mkdir -p build/peers && tar xJf .devbundle/peers/fm.tar.xz -C build/peers
  export PYTHONPATH=$PYTHONPATH:$PWD/build/peers/fm
  (nice -n 5 python3 .devbundle/peers/flashmla_build.py build/peers/fm --jobs 4 > "$out/fm-build.log" 2>&1
   touch "$fm_done") &
else
  touch "$fm_done"
fi
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
OUT=$out/tests TESTS="tests/test_mla_decode_qreg.py@4 tests/test_mla_decode_fp8_qreg.py@4" DEADLINE=250 \
  TEST_BUDGET=225 bash bench/gpu_session.sh tests | tee "$out/tests-summary.txt"
if grep -E "^test_.*\.log: " "$out/tests-summary.txt" | grep -v -E " in [0-9.]+s" | grep -q .; then
  echo "a test process ended without pytest's summary (killed at its budget: a hang?): no bench"
  exit 0
fi
for _ in $(seq 60); do [[ -e "$fm_done" ]] && break; sleep 2; done
OUT=$out/bench DEADLINE=290 bash bench/gpu_session.sh none \
  "mla decode tilecraft,tilecraft-qreg,flash_mla --flush read --rounds 2" \
  "mla fp8-64 tilecraft,tilecraft-fp8,tilecraft-fp8-qreg --graph --flush read"
