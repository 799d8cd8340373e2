#!/usr/bin/env bash
# rope_regs (session 69, CPU-checked): the persistent seesaw with the query's rope scored from each warpgroup's
# registers (wgmma RS): 8 KB a step less through shared memory per warpgroup (~2.6% of a pair's ~617 KB). Written
# before the run: if the SM's shared-memory port bounds the loaded steps (session 69's multicast ruled out the L2),
# up to ~2-3% on the h_q = 128 rows (128x128x4096 ~309 -> ~300 us on an H100); the RS issue of the 4 rope MMAs
# could cost part of it (session 55: an RS MMA holds its warp until the tensor pipe takes it). ~4 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -n 3 tests/test_mla_decode.py -k "rope_regs" 2>&1 | tail -3 \
  | tee "$out/tests-rope-regs.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
timeout 240 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --jobs 8 --rounds 2 \
  --providers tilecraft,tilecraft-persistent,tilecraft-persistent-rope,tilecraft-persistent-own-p,flash_mla 2>&1 \
  | grep -vE "^\s*$" | tail -18
