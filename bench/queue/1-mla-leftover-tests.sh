#!/usr/bin/env bash
# Session 57 left these GPU tests of tests/test_mla_decode.py unrun (its four processes stopped at their budget inside
# the experimental swapped-FP8 sweeps; every op-path test ran and passed): test_gpu_swapped_fp8_cache (11 of 16),
# test_gpu_fp8_two_converters (1 of 3), test_gpu_swapped_fp8_fold_scales (5). They run the FP8 variants the op does
# not pick, now behind the uncapped schedule and the wide combine. ~4 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_mla_decode.py@4:swapped_fp8+or+two_converters" DEADLINE=290 TEST_BUDGET=280 bash bench/gpu_session.sh tests
