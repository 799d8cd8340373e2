#!/usr/bin/env bash
# l2_ahead (session 69, CPU-checked): the MLA producer asks for step k + d's cache bytes in L2 as it issues step k's
# loads. Written before the run: the loaded steps of both our h_q = 128 schedules take ~3700 cycles (default: 3498,
# seesaw: 2955 in CTA 0's traced steady state) and session 24's trace had a loaded 72 KB step land ~3600 cycles after its issue; with
# two stages the lookahead is about one step, so if DRAM's loaded latency (each kv byte comes from DRAM once, on the
# first row tile's miss) is what the loaded steps wait for, prefetching d steps ahead into L2 brings them toward the
# traced steady steps: default -0-6%, persistent seesaw up to -15-20% (128x128x4096 ~309 -> ~260-270 us on an H100;
# FlashMLA 285). If the bound is the SM side (shared memory), nothing changes. The memory-bound h_q = 64 row may
# also gain (its loads are the step). ~5 min; FlashMLA through WAIT_FOR_FILE as in the others.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 180 python3 -m pytest -q -m gpu -n 4 tests/test_mla_decode.py -k "l2_ahead" 2>&1 | tail -3 \
  | tee "$out/tests-l2-ahead.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
timeout 300 python3 -m bench.op mla --shape decode --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-l2p2,tilecraft-l2p4,tilecraft-persistent,tilecraft-persistent-l2p2,flash_mla 2>&1 \
  | grep -vE "^\s*$" | tail -45
