#!/usr/bin/env bash
# Session 75, with ~260 s of device time left: script 4 cut to the new deal's GPU check (~220 s, no FlashMLA build):
# the persistent bitwise tests and the op's reference cases, then the balance preset against tilecraft-plain (even with
# FlashMLA at b = 132 in session 75's call 2: 305.5 vs 304.9 us). Written before the run: b = 132 382.4 -> ~295 us,
# under tilecraft-plain; the other rows unchanged.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 130 python3 -m pytest -q -m gpu -n 8 -rf --tb=line -p no:cacheprovider tests/test_mla_decode.py \
  -k "persistent_matches_seesaw or gpu_matches_reference" > "$out/tests-mla.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests-mla.txt" | cut -c1-300 | tail -6
timeout 80 python3 -m bench.op mla --shape balance --out "$out" --graph --flush read --jobs 4 \
  --providers tilecraft,tilecraft-plain > "$out/balance.txt" 2>&1; tail -12 "$out/balance.txt" | cut -c1-120
