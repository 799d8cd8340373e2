#!/usr/bin/env bash
# Session 76 (FlashMLA build prefix; ~9 min): the persistent kernel's cut deal (sequences cut at the parts' equal
# shares, the pieces merged in the kernel by the last to finish; bench/NOTES.md "Session 76").
# 1. Its GPU tests (reference bounds, bits run to run and from a CUDA graph, counters back at 0, batch-invariant
#    mode), own_p / lazy over it, and session 75's three fp8 reruns (op_plan's device_sms, dense_overlap's stages).
# 2. The h128 and balance presets with FlashMLA in the same run. Written before the run: b = 128 x 4096 0.962x ->
#    ~0.98x (the costliest part ~131.8 -> ~129.7 block-times, less the merges); 64 x 8192 0.941x -> ~0.96x (no idle
#    parts); 66 x 8192 unchanged (no cuts: 1.034x); 32 x 16384 (no combine kernel now) 0.951x -> ~0.98x.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "persistent_pieces or invariant_mode_at_128" > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-300 | tail -12; tail -c 300 "$out/tests.txt"
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 balance; do
  timeout 120 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-plain,flash_mla > "$out/$shape.txt" 2>&1; tail -8 "$out/$shape.txt" | cut -c1-120
done
