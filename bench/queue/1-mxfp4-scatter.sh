#!/usr/bin/env bash
# Session 60 (built after its last device call was refused): two questions about the MXFP4 warp kernel's load path,
# whose loads alone run at ~2.5 TB/s (bench/NOTES.md "Session 60", "Open GPU checks (end of session 60)").
# 1. The L2 prefetch size (ops.gemm_mxfp4_warps.L2: the weights' loads as ld.global.nc.L1::no_allocate.L2::<n>B):
#    predicted, if 64-byte requests scattered over rows cost DRAM efficiency, loads alone at 1x4096x7168 6.3 -> ~4.5
#    us on an H200 and the kernel 8.5 -> ~7; else +-3%. Its GPU tests after (bitwise the plain loads').
# 2. The scatter probe: the codes alone in the kernel's order (loads=2) against row by row (3) and piece by piece (4)
#    in 512-byte pieces and as one contiguous run a warp (5: a weight layout tiled by (block, step), "Session 61").
#    If 3 / 4 / 5 beat 2 clearly, the order matters, not the engine.
# Then the op's mxfp4 preset with the l2 providers. ~5 min (session 61: sweep first, after failed starts left
# little device time).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 \
  --variant "" --variant l2=256 --variant loads=1 --variant loads=1,l2=256 \
  --variant loads=2 --variant loads=3 --variant loads=4 --variant loads=5 2>&1 | tee "$out/sweep.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps and (1-7168 or 1-4096 or 5-256)" a &
run "test_gpu_mxfp4_warps and (8-4096 or 9-512 or 16-7168 or 16-4096)" b &
wait
for f in a b; do echo "== $f"; grep -E "passed|failed|^FAILED|^rc" "$out/tests-$f.log"; done
timeout 90 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,tilecraft-l2-256,torch \
  --graph --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
