#!/usr/bin/env bash
# Session 65's chains, second call (after 1-chains-h200.sh; ~5 min with the start; an H200 for the top table):
# 1. The op's MXFP4 rows for bench/NOTES.md's top table, beside tilecraft-swapped-n64 (64-row blocks forced: with the
#    chains on, at 16x7168x2048 that is the chains with one split in place of the 128-row pair). If the chains win
#    there too, the rule's exclusion of folded / paired plans ("no reduce kernel to remove") goes.
# 2. Why the chains beat their prediction 3-4x: traces of the chains and of the lockstep 128-row kernel at 64x7168x4096
#    (read flush). Expected if the chains overlap one's decode with the other's WGMMA: a chain's work a step well
#    under the 128-row kernel's ~1050 cycles at 64 tokens.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-swapped-n64,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
{ timeout 60 python3 -m bench.trace_mxfp4 --flush read --block-n 64 --chains --case 64x7168x4096 32x7168x4096
  timeout 60 python3 -m bench.trace_mxfp4 --flush read --case 64x7168x4096; } 2>&1 | tee "$out/trace-chains.txt" \
  | grep -E "^[0-9]+x|global timer|work a step|data wait" | cut -c1-300
