"""Where a step of the register-converted FP8 MLA kernel (ops.mla_decode_fp8_rs) spends its cycles: CTA 0's SM
clock at each of its TRACE_EVENTS for its first steps, unsplit, h_q = 16, 4096 tokens a sequence.

    python -m bench.trace_mla_rs [--blocks 1|2]      # GPU

b = 2 x SMs (two CTAs on every SM, as the op runs them) and b = SMs (one an SM). Printed: the step period
and each event's cycles after the step's start, medians over steps 8-55 (min, max beside).
"""

import argparse
import sys

import torch

import ops
from ops.mla_decode import D_QK, D_V, LOG2E
from ops.mla_decode_fp8_rs import TRACE_EVENTS, TRACE_STEPS, mla_decode_fp8_rs_program

H_Q, SEQLEN, PAGE = 16, 4096, 64


def run(b, blocks):
    g = torch.Generator().manual_seed(0)
    pages = SEQLEN // PAGE
    kv = torch.randn(b * pages, PAGE, 1, D_QK, generator=g).bfloat16().cuda()
    cache = ops.quantize_mla_kv_fp8(kv).view(b * pages, PAGE, -1).view(torch.float8_e4m3fn)
    q = (torch.randn(b, H_Q, D_QK, generator=g) / 4).bfloat16().cuda()
    table = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
    lens = torch.full((b,), SEQLEN, dtype=torch.int32, device="cuda")
    splits = torch.ones(b, dtype=torch.int32, device="cuda")
    out = torch.empty(b, H_Q, D_V, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, H_Q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(1, 64, D_V, dtype=torch.float32, device="cuda")
    lse_part = torch.empty(1, 64, dtype=torch.float32, device="cuda")
    kernel = mla_decode_fp8_rs_program.compile("sm_90a", h_q=H_Q, s_q=1, page=PAGE, blocks_per_sm=blocks, trace=True)
    for _ in range(3):
        kernel.launcher()(q, cache, cache.view(torch.float32), cache.view(torch.bfloat16), table, lens, splits, out,
                          lse, o_part, lse_part, 1, float(D_QK ** -0.5 * LOG2E))
    torch.cuda.synchronize()
    st = o_part.view(-1)[:8 * TRACE_STEPS].contiguous().view(torch.int32).long().cpu().view(TRACE_STEPS, 8)
    st = st & 0xFFFFFFFF
    steps = range(8, min(56, SEQLEN // 64 - 1))
    period = sorted(int(st[k + 1, 0] - st[k, 0]) for k in steps)
    print(f"== b={b}, blocks_per_sm={blocks}: step period (cycles) median {period[len(period) // 2]}, "
          f"min {period[0]}, max {period[-1]}")
    for e, name in enumerate(TRACE_EVENTS[1:], 1):
        d = sorted(int(st[k, e] - st[k, 0]) for k in steps)
        print(f"  {name:12s} +{d[len(d) // 2]:6d} (min {d[0]}, max {d[-1]})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.trace_mla_rs needs a CUDA GPU (sm_90a): none found", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b in (args.blocks * sms, sms):
        run(b, args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
