#!/usr/bin/env bash
# Session 65, call 7: is the op-vs-span gap at 32x7168x4096 with 64-row blocks (4.4 us against ~2 elsewhere, H100)
# in the inputs? The traces so far used random code bytes; bench.op times quant_mxfp4(randn) weights. Trace both
# (64 rows; 32x7168x4096 and, as the control, 64x7168x4096), read flush. Expected if the inputs matter: the
# quantized span ~2.4 us longer at 32 tokens only; otherwise equal spans, and the gap is in the timing harness.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
{ timeout 100 python3 -m bench.trace_mxfp4 --flush read --block-n 64 --case 32x7168x4096 64x7168x4096
  timeout 100 python3 -m bench.trace_mxfp4 --flush read --block-n 64 --quantized --case 32x7168x4096 64x7168x4096
} 2>&1 | tee "$out/trace-quantized.txt" | grep -E "^[0-9]+x|global timer|work a step" | cut -c1-300
