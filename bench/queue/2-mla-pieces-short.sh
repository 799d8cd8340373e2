#!/usr/bin/env bash
# Session 76, call 2 (no FlashMLA build: ~5 min): the piece epilogue's row read once (call 1's kernel reloaded it
# for every store behind bounds checks: 807 loads, 2.3x the code; every row ~20% slower, b = 66 with no cuts too).
# Written before the run: tilecraft back under tilecraft-plain on every row (session 75: 0.96-0.98x plain's time),
# b = 128 x 4096 a further ~2% under (the cut deal), b = 66 unchanged from session 75 (no cuts).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_pieces or invariant_mode_at_128" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12; tail -c 200 "$out/tests.txt"
for shape in h128 balance; do
  timeout 100 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-plain > "$out/$shape.txt" 2>&1; grep -E "tilecraft" "$out/$shape.txt" | cut -c1-100
done
