#!/usr/bin/env bash
# Session 53's bf16-cache MLA kernel with Q in registers (ops/mla_decode_qreg.py; bench/NOTES.md "Session 53"), built
# without a GPU, never run: WG0 holds Q's latent as WGMMA's register operand and does the scores and softmax of
# 32-token steps, WG1/WG2 the P V of their O halves; a ring of five 36 KB slots. Its GPU tests (against the fp32
# reference over 8 shapes incl. fp16, NaN-poisoned pages; determinism; the op with QREG_BF16 on under hypothesis;
# batch invariance); then, unless a test process hung, the decode grid against the op's kernel (h_q 64
# and 128 rows; the h_q 16/32 rows say why they cannot take it). Expected (written before any run): a step's tensor
# floor ~2490 cycles for 64 tokens against FlashMLA's measured ~3140 and ours ~3700: 128 x 128 x 4096 from 0.29 ms
# to ~0.22-0.26 if the roles overlap (FlashMLA 0.262); the h_q 64 row (memory-bound, 0.164 today) about even.
# tilecraft-qreg-nodefer: P ready before the next step's score MMAs are issued (WG0's softmax then leaves the tensor
# pipe idle): expected ~10-15% slower than the default (defer_ready). If a test fails: the first suspects are the RS
# score MMAs' N = 32 B tiles, V read MN-major from 32-token slots, and the tail zeroing. Then, where each role's
# step goes (bench.trace_mla_qreg, one wave of 132 CTAs, defer_ready on and off): read it against the expected
# ~1250-1350 cycles a 32-token step before changing anything. ~7.5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}
mkdir -p "$out"
# the tests first, in their own session (a kernel that hangs would hang the bench and the trace too)
OUT=$out/tests TESTS="tests/test_mla_decode_qreg.py@4" DEADLINE=240 TEST_BUDGET=210 bash bench/gpu_session.sh tests \
  | tee "$out/tests-summary.txt"
if grep -E "^test_.*\.log: " "$out/tests-summary.txt" | grep -v -E " in [0-9.]+s" | grep -q .; then
  echo "a test process ended without pytest's summary (killed at its budget: a hang?): no bench, no trace"
  exit 0
fi
# WAIT_FOR_FILE: a file a background peer build touches when it ends (the bench waits for it, at most 180 s)
if [[ -n "${WAIT_FOR_FILE:-}" ]]; then
  for _ in $(seq 90); do [[ -e "$WAIT_FOR_FILE" ]] && break; sleep 2; done
fi
# EXTRA_PROVIDERS: e.g. ",flash_mla" where FlashMLA was built beside us (its provider is skipped when not importable)
OUT=$out/bench DEADLINE=230 bash bench/gpu_session.sh none \
  "mla decode tilecraft,tilecraft-qreg,tilecraft-qreg-nodefer${EXTRA_PROVIDERS:-} --flush read --rounds 2"
timeout 75 python3 -m bench.trace_mla_qreg 2>&1 | tee -a "$out/trace-mla-qreg.txt" | tail -30
if [[ "${TRACE_NODEFER:-1}" == 1 ]]; then      # (0: only the default's trace, where the call's time is short)
  timeout 75 python3 -m bench.trace_mla_qreg --no-defer 2>&1 | tee -a "$out/trace-mla-qreg.txt" | tail -30
fi
