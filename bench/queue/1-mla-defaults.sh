#!/usr/bin/env bash
# Session 57: the new defaults (no split cap below the SM count, the wide combine above 8 splits a sequence, the bf16
# kernel's split partials without padding rows) against the op before (tilecraft-s56: cap 32, three-pass combine).
# The MLA GPU tests (4 processes), then presets few and fp8-32 (graphs) and the decode grid, then bench.prof_mla.
# Expectations: bench/NOTES.md "Session 57". ~9 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@4" DEADLINE=420 TEST_BUDGET=230 bash bench/gpu_session.sh tests \
  "mla few tilecraft,tilecraft-s56,tilecraft-fp8,tilecraft-fp8-s56,tilecraft-splits-2,tilecraft-fp8-splits-2 --graph --flush read" \
  "mla fp8-32 tilecraft,tilecraft-s56,tilecraft-fp8,tilecraft-fp8-s56 --graph --flush read" \
  "mla decode tilecraft,tilecraft-s56 --flush read"
timeout 60 python3 -m bench.prof_mla --paths default s56 --out "${OUT:-/tmp/tilecraft-out}" \
  > "${OUT:-/tmp/tilecraft-out}/prof-mla-few-bf16.txt" 2>&1
