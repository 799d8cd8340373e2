#!/usr/bin/env bash
# MLA h_q = 128 with each kv part multicast to the cluster pair of a sequence's two row tiles (share=2, session 69;
# CPU-checked only). ~6 min with the start. Written before the run:
# - Floor: 128x128x4096 is 82.5 TFLOP at ~660 TFLOP/s sustained = ~125 us of tensor work; FlashMLA 262 us, ours
#   (seesaw / persistent) ~290. Under load a seesaw step is ~3680 cycles against 2955 for a lone CTA (NOTES
#   "MLA persistent seesaw"), and each kv byte leaves L2 twice (both row tiles): ~4.5 TB/s L2 -> SM.
# - Prediction if L2 -> SM bandwidth is what slows the loaded steps: seesaw-mc / persistent-mc 290 -> ~240-255 us
#   (the default's loaded step is only ~6% above its lone one: tilecraft-mc -0-6%)
#   (128x128x4096), s_q 2 ~560 -> ~470-500, 32x128x16384 ~275 -> ~235-250. If shared memory's rate is the bound
#   (session 24's reading), no gain, or 1-3% lost to the pair's coupling (each CTA waits for the slower one).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_mla_decode.py -k "share_is_the_same_bits" 2>&1 | tail -4 \
  | tee "$out/tests-share.txt"
# WAIT_FOR_FILE: a peer built beside us in the background (FlashMLA) writes it when importable or failed
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
timeout 300 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --jobs 8 --rounds 2 \
  --providers tilecraft,tilecraft-mc,tilecraft-seesaw,tilecraft-seesaw-mc,tilecraft-persistent,tilecraft-persistent-mc,flash_mla 2>&1 \
  | grep -vE "^\s*$" | tail -25
