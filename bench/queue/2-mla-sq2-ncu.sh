#!/usr/bin/env bash
# Session 70: why is 128x128x2x4096 our worst h_q = 128 row (0.87x FlashMLA, H100; 0.96x at s_q 1, same run)?
# FlashMLA does 2x the work of s_q 1 in 1.75x the time, we in 1.93x. Written before the run: if our 4 row tiles of a
# sequence fetch its kv from DRAM more than once at s_q 2, dram__bytes_read is above s_q 1's 2 x 646 MB for us and
# not for FlashMLA (then: the CTA order); if equal, the loss is on the SM side like s_q 1's. Metrics only (~3 min).
# Session 71: with the lazy variants too (their instruction counts against the eager ones; ~5 min). Session 74:
# tilecraft is the persistent seesaw with lazy rescaling at 128 rows now; tilecraft-plain the two-warpgroup schedule.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
# (session 75 ran this script's tests, balance and h128 runs: bench/NOTES.md "Session 75"; its ncu summary cut the
# csv at the commas inside kernel names and printed nothing: parsed as csv now)
m=gpu__time_duration.sum,dram__bytes_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
m=$m,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second
m=$m,lts__t_sectors_srcunit_tex_op_read.sum,smsp__inst_executed.sum,sm__cycles_active.avg
for p in tilecraft-plain tilecraft flash_mla; do
  [ $p = flash_mla ] && [ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
  for c in 128x128x2x4096; do
    timeout 100 ncu --profile-from-start off --clock-control none --metrics "$m" -o "$out/m-$p-$c" \
      python3 -m bench.ncu_mla $p $c > "$out/m-$p-$c.log" 2>&1 || tail -3 "$out/m-$p-$c.log"
    echo "== $p $c"
    # (the csv's kernel names hold commas: parsed as csv, kernel name cut to 40 characters)
    ncu -i "$out/m-$p-$c.ncu-rep" --page details --csv 2>/dev/null | python3 -c 'import csv, sys
for r in csv.DictReader(sys.stdin): print(r["Kernel Name"][:40], r["Metric Name"], r["Metric Unit"], r["Metric Value"])'
    rm -f "$out/m-$p-$c.ncu-rep"
  done
done
