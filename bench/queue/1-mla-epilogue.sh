#!/usr/bin/env bash
# Session 77 (FlashMLA build prefix; ~4 min, lean: the session's device time was nearly gone). The persistent kernel's
# epilogue with 1 / l once a row: session 77's trace put ~11-12K cycles between both warpgroups' last P V ("wg0 sums")
# and WG0's epilogue issued ("wg0 stored"), at 128 sequences and at 32 alike (not a DRAM burst: the CTA's own work).
# Its SASS: 128 reciprocals a thread, each with a slow-path call; now 8 in the kernel, 4608 instructions against 8464.
# Written before the run: the hand-over ~12K -> ~3-4K cycles (~5 us), and the kernel's last epilogue too:
# 128x128x1x4096 ~280 -> ~270 us (2 units a CTA), 32x16384 ~274 -> ~270 (1 unit), 128x128x2x4096 ~535 -> ~525.
# The bench first (alone on the GPU), FlashMLA when its build is done, then the bitwise tests in what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --providers tilecraft \
  > "$out/h128.txt" 2>&1; grep -E "^b=" "$out/h128.txt" | cut -c1-150
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 90); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
timeout 60 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --providers flash_mla \
  > "$out/h128-fm.txt" 2>&1; grep -E "^b=" "$out/h128-fm.txt" | cut -c1-150
timeout 100 python3 -m pytest -q -m gpu -n 6 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "(persistent_matches_seesaw and variant0) or invariant_mode_at_128" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12
