#!/usr/bin/env bash
# Queue scripts 4 and 3 in one call (session 70, GPU starts scarce): the l2_ahead and rope_regs bit tests, then one
# h_q = 128 A/B beside FlashMLA. Predictions as written in 4-mla-l2-ahead.sh and 3-mla-rope-regs.sh (before any run):
# l2_ahead: persistent seesaw up to -15-20%, default -0-6%, nothing if the bound is the SM side; rope_regs: <= 2-3%.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 170 python3 -m pytest -q -m gpu -n 4 tests/test_mla_decode.py -k "l2_ahead or rope_regs" 2>&1 | tail -4 \
  | tee "$out/tests-l2-rope.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
timeout 280 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --jobs 8 --rounds 2 \
  --providers tilecraft,tilecraft-l2p2,tilecraft-persistent,tilecraft-persistent-l2p2,tilecraft-persistent-rope,flash_mla \
  2>&1 | grep -vE "^\s*$" | tail -30
