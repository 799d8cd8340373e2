#!/usr/bin/env bash
# Session 77 (FlashMLA build prefix; ~9 min). The h_q = 128 default (session 76's final form, merge=False: never
# measured) and early_q (the next unit's query loaded once both MMA warpgroups have done the unit's last scores, not
# after its last P V), with FlashMLA in the same run, and a trace of CTA 0 across its two units.
# Floor (128x128x1x4096, H100): 146 GFLOP at ~660 TFLOP/s of dense bf16 MMA = ~221 us; FlashMLA ~280 us.
# Written before the run: b = 66 x 8192 (one unit a part) is 1.034x FlashMLA and b = 128 x 4096 (two) 0.958x: one
# more unit costs ~12 us (~6 blocks) a part. With every part switching units at the same time, every CTA then loads
# the next query and two steps (221 KB) at once after its last P V: ~28 MB in one burst, ~9 us at 3 TB/s. The trace
# says how long the hand-over is (pair 31 -> 32). early_q moves the query's 74 KB under the last P V and epilogue:
# expected a third of the hand-over (~4 us, 1.5% at 128 x 4096 and 132 x 4096, ~0 at 66 x 8192).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
(timeout 240 python3 -m bench.trace_mla bf16-128-persistent bf16-128-persistent-earlyq > "$out/trace.txt" 2>&1) &
timeout 200 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_pieces or persistent_matches_seesaw or invariant_mode_at_128" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12; tail -c 200 "$out/tests.txt"
wait
cat "$out/trace.txt" | cut -c1-400
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 balance; do
  timeout 160 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-persistent-earlyq,tilecraft-persistent-merge,flash_mla > "$out/$shape.txt" 2>&1
  grep -E "tilecraft|flash" "$out/$shape.txt" | cut -c1-110
done
