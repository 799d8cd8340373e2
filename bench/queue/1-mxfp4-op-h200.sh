#!/usr/bin/env bash
# Two things, one call (~6 min with the start; any card for the A/B, an H200 for the top table):
# 1. SWAPPED_BLOCK_N = 64 (session 64, built and CPU-checked, never run): the swapped kernel with 64 weight rows a
#    block (one MMA warpgroup, twice the blocks, half the splits). Its GPU test first (exact against fp32, bitwise
#    run to run), then the op with it (provider tilecraft-swapped-n64) beside the default. Predicted, from session 20's
#    counts (a 64-token step ~1050 cycles with two warpgroups, ~800 with one; the reduce kernel, its gap and the
#    partial stores ~3 us): 64x7168x2048 (112 blocks of 16 steps, no reduce kernel, instead of 2 splits of 8 + the
#    reduce) 13.5 -> ~12-12.5 us on an H100; 64x4096x7168 (2 splits instead of 4) -0.5 to -1.5 us; 16 tokens
#    +-5%. Risk: every block reads the activations of its K range, so their L2 -> SM bytes double (29 MB at
#    64x7168x2048): if that binds, slower. If it wins by >= 5% at 64 tokens on both shapes: SWAPPED_BLOCK_N = 64
#    where m > 16 (a token rule in plan_swapped's caller).
# 2. The op's MXFP4 rows on the issue's card, an H200, for bench/NOTES.md's top table (sessions 63 and 64 got only
#    H100s; the H200 rows are session 62's, before ACTS_RING). Predicted from session 62's H200 sweep: 1x4096x7168
#    8.9 -> ~8.8 us, 8x4096x7168 10.1 -> ~9.8, 8x7168x2048 7.7 -> ~7.0, the rest within 3%.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gemm_fp8.py -k "swapped_64_row_blocks" \
  > "$out/tests-n64.log" 2>&1; echo "tests rc $?"; tail -1 "$out/tests-n64.log"
grep -E "^(FAILED|ERROR)" "$out/tests-n64.log" | cut -c1-200
timeout 200 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,tilecraft-swapped-n64,torch --graph \
  --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
