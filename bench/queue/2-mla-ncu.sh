#!/usr/bin/env bash
# MLA h_q = 128, where our loaded steps lose to FlashMLA's (session 69 ruled out the L2's output): ncu of our default
# kernel, the persistent seesaw and FlashMLA on 128x128x1x4096, side by side: the stall reasons sampled per SASS
# instruction (bench.ncu_sass), the tensor pipe's, L1/shared and L2 load. Needs flash_mla importable (built beside
# us, see NOTES "Open GPU checks (end of session 69)" item 3; WAIT_FOR_FILE as in the bench scripts). ~5 min.
# (Session 26's ncu of the default and the seesaw, results/mla-ncu-*-20261201T0702Z: L1/TEX throughput 59-63%, SM
# busy 59-61%, 11 warp cycles an issued instruction; whether WGMMA's shared-memory operand reads count in L1/TEX is
# not known, so the per-instruction stall samples are the test: a shared-memory bound shows as waits on the HGMMAs'
# completion and on the full barriers, not as MIO throttle.)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
metrics=gpu__time_duration.sum,dram__bytes_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
metrics=$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
metrics=$metrics,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second
for p in tilecraft tilecraft-persistent flash_mla; do
  timeout 120 ncu --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \
    --section MemoryWorkloadAnalysis --metrics "$metrics" -o "$out/ncu-mla-$p" \
    python3 -m bench.ncu_mla $p 128x128x1x4096 > "$out/ncu-mla-$p.log" 2>&1 || tail -3 "$out/ncu-mla-$p.log"
  ncu -i "$out/ncu-mla-$p.ncu-rep" --page details --csv > "$out/ncu-mla-$p-details.csv" 2>/dev/null
  ncu -i "$out/ncu-mla-$p.ncu-rep" --page source --csv --print-source sass > "$out/ncu-mla-$p-sass.csv" 2>/dev/null
  echo "== $p"; grep -E '"(Duration|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued)' \
    "$out/ncu-mla-$p-details.csv" | cut -d, -f5,13,15 | head -6
  python3 -m bench.ncu_sass "$out/ncu-mla-$p-sass.csv" 2>&1 | head -25
  rm -f "$out/ncu-mla-$p.ncu-rep"        # (large; the CSVs carry what is read)
done
