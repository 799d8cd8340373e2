#!/usr/bin/env bash
# Session 57: the wide combine (mla_combine_program(lanes=combine_lanes_for(max_splits)), COMBINE_WIDE off), CPU-checked
# only. Its GPU tests (the wide schedules with either combine, the wide combine at the default schedule's 1, 2 and 4
# lanes), then preset `few` with the default, the wide combine alone and under the wider splits (bf16 and FP8 cache),
# the decode grid with the wide combine, then bench.prof_mla (main kernel vs combine). Expectations: bench/NOTES.md
# "Session 57". ~6 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@3:wide_schedules+or+wide_combine" DEADLINE=330 TEST_BUDGET=150 bash bench/gpu_session.sh tests \
  "mla few tilecraft,tilecraft-cw,tilecraft-splits-sm,tilecraft-splits-sm-cw,tilecraft-splits-sm2-cw,tilecraft-splits-sm1-cw,tilecraft-fp8,tilecraft-fp8-cw,tilecraft-fp8-splits-sm-cw,tilecraft-fp8-splits-sm2-cw --graph --flush read" \
  "mla decode tilecraft,tilecraft-cw --flush read"
timeout 70 python3 -m bench.prof_mla --out "${OUT:-/tmp/tilecraft-out}" > "${OUT:-/tmp/tilecraft-out}/prof-mla-few-bf16.txt" 2>&1
timeout 60 python3 -m bench.prof_mla --fp8 --paths default cw sm-cw sm2-cw --out "${OUT:-/tmp/tilecraft-out}" \
  > "${OUT:-/tmp/tilecraft-out}/prof-mla-few-fp8.txt" 2>&1
