#!/usr/bin/env bash
# Session 56 (built after its GPU time, CPU-checked only): get_mla_schedule's split knobs (max_splits /
# min_split_blocks above the defaults 32 / 4) and the two-pass combine (mla_combine_program(two_pass=True),
# COMBINE_TWO_PASS off). This call: their GPU tests (test_gpu_wide_schedules_match_the_reference: 5 cases x both
# combines, incl. the FP8 cache), then preset `few` (a batch of one to three 64-row tiles, long contexts) with the
# default, the combine alone, the wider splits with either combine and the FP8 cache, then the decode grid with
# the combine alone (only its split rows can move), then bench.prof_mla. Expectations: bench/NOTES.md "Session 56". ~9.5 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@3:wide_schedules+or+two_pass" DEADLINE=380 TEST_BUDGET=170 bash bench/gpu_session.sh tests \
  "mla few tilecraft,tilecraft-combine2,tilecraft-splits-sm,tilecraft-splits-sm2,tilecraft-splits-sm1,tilecraft-splits-sm2-combine2,tilecraft-fp8,tilecraft-fp8-splits-sm2 --graph --flush read" \
  "mla decode tilecraft,tilecraft-combine2 --flush read"
# then the main kernel against the combine, kernel by kernel (bf16 and FP8 cache), into $OUT/prof-mla-few-*.json
timeout 100 python3 -m bench.prof_mla --out "${OUT:-/tmp/tilecraft-out}" > "${OUT:-/tmp/tilecraft-out}/prof-mla-few-bf16.txt" 2>&1
timeout 60 python3 -m bench.prof_mla --fp8 --paths default sm2-combine2 --out "${OUT:-/tmp/tilecraft-out}" \
  > "${OUT:-/tmp/tilecraft-out}/prof-mla-few-fp8.txt" 2>&1
