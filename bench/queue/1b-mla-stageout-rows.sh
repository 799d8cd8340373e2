#!/usr/bin/env bash
# Session 79, call 4 (FlashMLA build prefix; ~6 min; after 1-mla-stageout-default.sh): the decode and balance presets
# with the op (stage_out), the direct stores, kv_first, out_tma, both, the cut deal merged in the kernel (tilecraft-merge,
# with stage_out; lost 7-10% in session 76) and FlashMLA (call 1 of session 79, H100: decode h_q 64
# stage_out 220.5 vs the direct 223.3 vs FlashMLA 233.2 us; balance 1.062 / 0.973 / 1.069x FlashMLA). Ask for an H200:
# the issue's rows there (the top table holds session 77's H200 numbers).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; log=/tmp/q; mkdir -p "$out" $log
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in decode balance h128; do
  timeout 170 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 6 \
    --providers tilecraft,tilecraft-direct,tilecraft-kvfirst,tilecraft-outtma,tilecraft-kvfirst-outtma,tilecraft-merge,flash_mla > $log/$shape.txt 2>&1
  grep -E "^b=" $log/$shape.txt | cut -c1-150
done
# the FP8 cache at 64 / 128 heads (the default operand order) with stage_out (its GPU test passed in session 79)
timeout 150 python3 -m bench.op mla --shape decode --out "$out" --graph --flush read --jobs 4 \
  --providers tilecraft-fp8,tilecraft-fp8-stageout > $log/fp8.txt 2>&1
grep -E "^b=.*h_q=(64|128)" $log/fp8.txt | cut -c1-150
