#!/usr/bin/env bash
# Session 77 (FlashMLA build prefix; ~9 min). Where the persistent kernel's hand-over from one unit to the next goes,
# and a fix. Session 77's first trace (H200, 128 x 4096, two units a CTA) put ~14K cycles (~8 us) more into pair
# 31 -> 32 than into a steady pair (~9.2K); early_q (the next query loaded under the last P V) gained nothing.
# The stamps now say when both warpgroups' last P V is done ("wg0 sums"), WG0's epilogue is issued ("wg0 stored"),
# the producer issued the next query ("prod q issue") and it landed ("wg0 q_full").
# Written before the run: if the hand-over is the DRAM burst of all 128 CTAs switching at once (a query and two
# steps each: ~19 MB of reads, ~4.5 us at ~4.2 TB/s, while no CTA computes), the time goes to q_full, and 32
# sequences (32 CTAs) hand over in a third of the cycles; if it is the CTA's own work, "wg0 stored" - "wg0 sums" is
# large and b = 32 hands over as slowly. warm=4/8 prefetches the next unit's query and first two steps into L2
# 4/8 steps ahead (cp.async.bulk.prefetch, one producer thread): expected, if the burst is it, the hand-over down to
# ~5K cycles, ~2% at 128 x 4096 and 132 x 4096, nothing at 64 / 66 x 8192 (one unit a part).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
(timeout 260 python3 -m bench.trace_mla bf16-128-persistent bf16-128-persistent-b32 bf16-128-persistent-warm4 \
  > "$out/trace.txt" 2>&1) &
timeout 230 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_matches_seesaw" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12
wait
grep -E "^==|persistent, pairs|pairs 29-34|timeline|Error|error" "$out/trace.txt" | cut -c1-330
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 balance; do
  timeout 150 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-persistent-warm4,tilecraft-persistent-warm8,flash_mla > "$out/$shape.txt" 2>&1
  grep -E "^b=" "$out/$shape.txt" | cut -c1-100
done
