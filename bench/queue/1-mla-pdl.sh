#!/usr/bin/env bash
# Session 57 (built after its GPU time, CPU-checked only): the combine launched programmatically behind the main kernel
# (COMBINE_PDL off: mla_combine_program(pdl=True) waits with griddepcontrol.wait, the bf16 kernel with
# launch_dependents=True lets it start at once). Its GPU test, with the MLA tests session 57 left unrun (the
# experimental swapped-FP8 sweeps: swapped_fp8_cache 11 of 16, fp8_two_converters 1 of 3, swapped_fp8_fold_scales 5),
# then few and the decode grid with and without it, in CUDA graphs. Expectations: bench/NOTES.md "Session 57",
# "Built after the GPU time". ~7 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@4:programmatic+or+swapped_fp8+or+two_converters" DEADLINE=420 TEST_BUDGET=250 \
  bash bench/gpu_session.sh tests \
  "mla few tilecraft,tilecraft-pdl,tilecraft-fp8,tilecraft-fp8-pdl --graph --flush read" \
  "mla decode tilecraft,tilecraft-pdl --graph --flush read"
