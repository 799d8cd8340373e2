#!/usr/bin/env bash
# Session 66: SWAPPED_CHAINS_SPLIT was missing from the launchers' key, so session 65's provider tilecraft-chains-split
# (and call 1 of this session) measured the op's own launchers. Replaced by SWAPPED_CHAINS_WHERE ("unsplit" default,
# "split", "any"), in the key. ~6 min with the start:
# 1. The chains' GPU tests (the wider rules: exact, run-to-run bits, the forced 64-row bits).
# 2. The A/B on mxfp4-chains: the op ("unsplit") against "split" and "any". Predicted from call 2's forced 64 rows
#    (H100): 64x4096x7168 18.4 -> ~16.5 us ("split", "any"), 16x7168x2048 8.7 -> ~7.6 ("any"); 24576x1536 ("any",
#    1.45 waves of 128-row blocks -> 2.9 of 64-row chained ones): ~-20%.
# 3. Where the split plans' time goes, kernel by kernel (profiler): the reduce kernel beside the GEMM, 128 rows
#    forced against the op, on mxfp4-block-n. Call 2's traces put 4.6 us of the 128-row op at 64x7168x4096 outside
#    the GEMM's span (the chains' op: 2.0 us); a reduce of 2 x 64 x 7168 fp32 partials should take ~1.5 us.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "swapped_chains" \
  > "$out/tests-chains.log" 2>&1
echo "tests: $(tail -1 "$out/tests-chains.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-chains.log" | cut -c1-200 | head
timeout 200 python3 -m bench.op gemm --shape mxfp4-chains --out "$out" --graph --flush read --rounds 2 --jobs 8 \
  --providers tilecraft,tilecraft-chains-split,tilecraft-chains-any,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
timeout 120 python3 -m bench.prof_mxfp4 --preset mxfp4-block-n --paths swapped-1 swapped-n128 --out "$out" 2>&1 \
  | tee "$out/prof.txt" | cut -c1-150
