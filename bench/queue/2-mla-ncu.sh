#!/usr/bin/env bash
# MLA h_q = 128, where our loaded steps lose to FlashMLA's (session 69 ruled out the L2's output): ncu of our default
# kernel, the persistent seesaw and FlashMLA on 128x128x1x4096, side by side: where each role's warps stall (warp-state
# sampling), the tensor pipe's and shared memory's load. Needs flash_mla importable (built beside us, see NOTES
# "Open GPU checks (end of session 69)" item 3; WAIT_FOR_FILE as in the bench scripts). ~4 min with the build.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg
metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active
metrics=$metrics,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,gpu__time_duration.sum
for p in tilecraft tilecraft-persistent flash_mla; do
  timeout 150 ncu --profile-from-start off --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --metrics "$metrics" --csv --page details \
    python3 -m bench.ncu_mla $p 128x128x1x4096 > "$out/ncu-mla-$p.csv" 2> "$out/ncu-mla-$p.err"
  echo "$p: $(grep -c . "$out/ncu-mla-$p.csv") lines; $(grep -E 'gpu__time_duration|hmma_cycles_active|Stall' \
    "$out/ncu-mla-$p.csv" | head -3 | cut -c1-160)"
done
