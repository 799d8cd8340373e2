#!/usr/bin/env bash
# Session 77 (FlashMLA build prefix; ~7 min; not run: the session's device time ran out). The persistent kernel's
# epilogue with 1 / l once a row: session 77's trace put ~11-12K cycles between both warpgroups' last P V ("wg0 sums")
# and WG0's epilogue issued ("wg0 stored"), at 128 sequences and at 32 alike (the CTA's own work, not a DRAM burst).
# Its SASS had 128 reciprocal sequences a thread, each with a slow-path branch; now 8 in the kernel, 4608
# instructions against 8464, 0 spills.
# Written before the run: the hand-over ~12K -> ~8K cycles (the division sequences were ~3-4K of it), and every CTA's
# last epilogue as much: 128x128x1x4096 (two units a CTA) 280.5 -> ~276 us, 32x16384 273.8 -> ~272, s_q 2 534.7 ->
# ~530 (session 77 call 2, H200); against FlashMLA ~0.97x. early_q again: with a shorter epilogue the next query
# (issued after the last P V, ~74 KB) may now be what the first pair waits for.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
(timeout 200 python3 -m bench.trace_mla bf16-128-persistent bf16-128-persistent-earlyq > "$out/trace.txt" 2>&1) &
timeout 200 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_matches_seesaw or persistent_pieces or invariant_mode_at_128 or gpu_matches_reference" \
  > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12
wait
grep -E "^==|persistent, pairs|wg0 (sums|stored|q_full|ready) .*pairs 29|timeline" "$out/trace.txt" | cut -c1-250
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 balance; do
  timeout 150 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-persistent-earlyq,flash_mla > "$out/$shape.txt" 2>&1
  grep -E "^b=" "$out/$shape.txt" | cut -c1-150
done
