#!/usr/bin/env bash
# lazy=8 (session 70, CPU-checked): the online softmax keeps a row's running max until the row's max grows by more
# than 2^8, and each O rescale sits behind a warp vote that skips it when no row of the warp changed. Written before
# the run: session 70's ncu had 260 + 260 FMULs a pair of steps in our seesaw's MMA warps against FlashMLA's 292 + 132
# (ours 1786 instructions a pair per warp, FlashMLA 1481); with lazy almost every rescale after a unit's first step
# is skipped (~-14% of those instructions). If the pair period follows the instruction stream on the warpgroups'
# paths (WG1: P V of e0 waited, O rescaled, P V of e1 issued), the persistent seesaw gains 3-8% and the default
# schedule 2-5% at h_q = 128 (128x128x4096 on an H100: persistent ~300 -> ~280 us, FlashMLA ~281); nothing if the
# FMULs were hidden under the MMAs. ~5 min; FlashMLA through WAIT_FOR_FILE.
# Session 71 adds rescale_once (CPU-checked): the seesaw's WG1 rescales O once a pair (by both factors) and issues
# its two P V batches back to back, WG0 writes e0's P again at the pair's max (FlashMLA's schedule). Written before
# the run: per pair WG1 loses 128 FMULs a thread and one WGMMA wait, WG0 gains ~32 FMULs + an 8 KB P store; WG1
# releases e0's V_1 one P V later. Expected: persistent-once 1-4% under persistent (eager), within +-2% of
# persistent-lazy with lazy on too (lazy already skips most rescales); slower if e0's later release delays the
# next pair's loads.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_mla_decode.py -k "lazy or rescale_once" 2>&1 | tail -4 | tee "$out/tests-lazy.txt"
if [ -n "${WAIT_FOR_FILE:-}" ]; then for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done; fi
p=tilecraft,tilecraft-lazy,tilecraft-persistent,tilecraft-persistent-lazy,tilecraft-persistent-once
p=$p,tilecraft-persistent-once-lazy,flash_mla
timeout 280 python3 -m bench.op mla --shape h128 --out "$out" --graph --flush read --jobs 8 --rounds 2 --providers $p \
  2>&1 | grep -vE "^\s*$" | tail -24
