#!/usr/bin/env bash
# Session 79, call 2 (FlashMLA build prefix; ~6 min). Call 1 (H100): tilecraft-stageout 278.7 us vs FlashMLA 276.7
# (0.993x) at 128x128x1x4096, but the op's default (the same persistent tiling without stage_out) took 456.9 us at
# 1980 MHz and ~689 W where it took 288.6 in session 78's call 1; early_q (the same code but where q_empty arrives)
# 285.5. Is it the kernel (tilecraft-persistent-lazy: the op's tiling through the variant path) or the op's path
# (ops.mla_decode's own pick)? Nothing else runs beside the bench this time (call 1 ran the trace and pytest's
# xdist workers, which outlived their timeout, beside it). Then the two GPU tests that call 1 cut off, by name.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; log=/tmp/q; mkdir -p "$out" $log
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader
python3 - <<'PY'
import torch, ops
from codegen import targets
from ops.mla_decode import pick_tiling
q = torch.zeros(1, 1, 128, 576, dtype=torch.bfloat16, device="cuda"); kv = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
t = targets.resolve(q, kv); print("resolve:", t, "| pick:", pick_tiling(128, "bf16", t, 64))
PY
timeout 300 python3 -m pytest -q -m gpu -n 8 -v --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py tests/test_gemm_fp8.py \
  -k "persistent_matches_seesaw or stage_out_is_the_direct or dense_overlap or persistent_matches_one_tile or wide_tiles_match_128_wide" \
  > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-200 | tail -12
pkill -f "pytest" ; sleep 1
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
timeout 200 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --jobs 4 \
  --providers tilecraft,tilecraft-persistent-lazy,tilecraft-persistent-earlyq,tilecraft-stageout,flash_mla > $log/h128.txt 2>&1
grep -E "^b=" $log/h128.txt | cut -c1-150
timeout 150 python3 -m bench.trace_mla bf16-128-persistent bf16-128-persistent-stageout > $log/trace.txt 2>&1
grep -E "^==|persistent, pairs|wg0 (ready|sums|stored|q_full) .*pairs 29|timeline" $log/trace.txt | cut -c1-250
