#!/usr/bin/env bash
# Session 76 (FlashMLA build prefix; ~8 min): the h_q = 128 default after session 76's rework. The persistent kernel
# now takes a table of pieces; the op's default (merge=False) deals the schedule's splits whole and leaves split
# sequences to the combine kernel, as session 75's kernel did (its SASS: 8464 instructions against 8744, 21 global
# loads against 18). Not measured in this form: session 76's GPU time ran out.
# 1. The GPU tests: the default bitwise the seesaw under 4-132 SMs and from a CUDA graph; the cut deal with the
#    in-kernel merge (merge=True) against the reference; batch-invariant mode at 128 rows.
# 2. The h128 and balance presets with FlashMLA in the same run. Written before the run: session 75's numbers
#    (128x4096 ~0.96x FlashMLA, 132 x 4096 ~1.03x, 66 x 8192 ~1.03x); if not, the epilogue's piece reads are the
#    first suspect (session 76's call 1: as expressions they cost ~20%). tilecraft-persistent-merge: the cut deal
#    with its cut heads moved to the front of their parts (not measured: session 76's calls ran them last, where the
#    merges read from DRAM, 17 us for 64); expected between session 76's call 2 and the default.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_pieces or persistent_matches_seesaw or invariant_mode_at_128" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12; tail -c 200 "$out/tests.txt"
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 balance; do
  timeout 150 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-plain,tilecraft-persistent-merge,flash_mla > "$out/$shape.txt" 2>&1; grep -E "tilecraft|flash" "$out/$shape.txt" | cut -c1-110
done
