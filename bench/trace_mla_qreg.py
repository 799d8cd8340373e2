"""Where a step of the MLA kernels with Q in registers (ops.mla_decode_qreg, --fp8 ops.mla_decode_fp8_qreg) spends
its cycles.

    python -m bench.trace_mla_qreg [--case 66x128x4096] [--fp8] [--no-defer] [--flush read|write] [--reps 20]   # GPU

One unsplit launch of b sequences (a CTA per 64-row tile: 66 x 128 heads is one wave of 132 CTAs), the bf16 cache
(--fp8: the FP8 cache) in 64-token pages. Printed:
- the kernel's time with and without trace=True (CUDA events, the L2 flushed before each launch): the trace's cost;
- CTA 0, per role (WG0: scores and softmax; WG1: its half of P V and the ring's reloads, with --fp8 also the
  conversion of its half two steps ahead; WG2: the other half): the
  period of its 32-token steps and each of its TRACE_EVENTS in cycles after its step's start, medians over steps
  8 .. 55 (min and max beside);
- every CTA's span: prologue, loop and epilogue (global timer, ns), WG0's loop cycles a step and the SM clock.
What to read first (bench/NOTES.md "Session 53"): the design's step is ~1250-1350 cycles (the tensor pipe: ~730 for
the scores, ~512 for the two P V). WG0's "data" after "start" is the ring's wait (the producer, WG1, is late);
"scores done" after "scores issued" the tensor pipe's queue; the P V warpgroups' "P ready" after "start" is the wait
for WG0, "P V done" after "P V issued" their MMAs behind WG0's.
"""

import argparse

import torch

import ops
from bench.timing import FLUSH_MODES, _flusher
from bench.trace_mla_rs import _stats, _timed, _u32
from ops.mla_decode import D_QK, D_V, LOG2E
from ops.mla_decode_fp8_qreg import TRACE_EVENTS as FP8_TRACE_EVENTS
from ops.mla_decode_fp8_qreg import mla_decode_fp8_qreg_program
from ops.mla_decode_qreg import ROWS, SPAN_ROW, TRACE_EVENTS, TRACE_STEPS, mla_decode_qreg_program

PAGE = 64


def _inputs(b, seqlen, h_q):
    g = torch.Generator().manual_seed(0)
    pages = -(-seqlen // PAGE)
    kv = torch.randn(b * pages, PAGE, D_QK, generator=g).bfloat16().cuda()
    q = (torch.randn(b, h_q, D_QK, generator=g) / 4).bfloat16().cuda()
    table = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
    lens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
    return q, kv, table, lens


def role_table(st, role, first, last, events=TRACE_EVENTS):
    """One role's stamps (TRACE_STEPS x 8 SM clocks, uint32) -> (step period, {event: (median, min, max) cycles after
    the step's start}) over its steps first <= k < last; events: the kernel's TRACE_EVENTS."""
    ks = list(range(first, min(last, TRACE_STEPS - 1)))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    period = med([int((st[k + 1, 0] - st[k, 0]) & 0xFFFFFFFF) for k in ks])
    offsets = {name: (med(d), min(d), max(d)) for e, name in enumerate(events[role][1:], 1)
               for d in [[int((st[k, e] - st[k, 0]) & 0xFFFFFFFF) for k in ks]]}
    return period, offsets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="66x128x4096", help="BxH_QxSEQLEN (s_q = 1; h_q a multiple of 64)")
    ap.add_argument("--fp8", action="store_true", help="the FP8 cache (ops.mla_decode_fp8_qreg)")
    ap.add_argument("--no-defer", action="store_true", help="defer_ready=False (P ready before the next step's MMAs)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read", help="how the L2 is flushed before each launch")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    b, h_q, seqlen = (int(x) for x in args.case.split("x"))
    if h_q % ROWS or seqlen < 2 * 32 * 8:
        raise SystemExit(f"--case: h_q must be a multiple of {ROWS} and seqlen at least 512, got {args.case}")
    q, kv, table, lens = _inputs(b, seqlen, h_q)
    program, events = mla_decode_qreg_program, TRACE_EVENTS
    if args.fp8:
        kv = ops.quantize_mla_kv_fp8(kv).view(torch.float8_e4m3fn)
        program, events = mla_decode_fp8_qreg_program, FP8_TRACE_EVENTS
    m_tiles = h_q // ROWS
    out = torch.empty(b, h_q, D_V, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h_q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(b * m_tiles, h_q, D_V, dtype=torch.float32, device="cuda")   # CTA bid's stamps: slot bid
    lse_part = torch.empty(b * m_tiles, h_q, dtype=torch.float32, device="cuda")    # (slots: OPart's)
    splits = torch.ones(b, dtype=torch.int32, device="cuda")
    launch_args = (q, kv, kv.view(torch.float32), kv.view(torch.bfloat16), table, lens, splits, out, lse, o_part,
                   lse_part, 1, float(D_QK ** -0.5 * LOG2E))
    flush = _flusher(True, args.flush)
    line = (f"== {args.case}{' FP8 cache' if args.fp8 else ''}{' defer_ready=False' if args.no_defer else ''}, "
            f"{args.flush} flush, {b * m_tiles} CTAs:")
    outs = []
    for trace in (False, True):
        kernel = program.compile("sm_90a", h_q=h_q, s_q=1, page=PAGE, defer_ready=not args.no_defer, trace=trace)
        line += _timed(kernel.launcher(), launch_args, flush, args.reps, "traced" if trace else "plain")
        outs.append(out.clone())
    print(line)
    if not outs[0].equal(outs[1]):
        print("  WARNING: the traced kernel's output differs from the plain kernel's")
    steps = -(-seqlen // 32)
    for role in (0, 1, 2):
        st = _u32(o_part[0, role, :8 * TRACE_STEPS].contiguous()).cpu().view(TRACE_STEPS, 8)
        period, offsets = role_table(st, role, 8, min(56, steps - 1), events)
        print(f"  CTA 0, {('WG0 (scores, softmax)', 'WG1 (P V, reloads)', 'WG2 (P V)')[role]}: a step {period} "
              f"cycles; after its step's start:")
        for name, (m, lo, hi) in offsets.items():
            print(f"    {name:14s} +{m:6d} (min {lo}, max {hi})")
    sp = _u32(o_part[:, SPAN_ROW, :8].contiguous()).cpu()
    t0 = int(sp[:, 0].min())
    rel = (sp[:, :4] - t0) & 0xFFFFFFFF
    loop_ns = (rel[:, 2] - rel[:, 1]).double()
    loop_cyc = ((sp[:, 5] - sp[:, 4]) & 0xFFFFFFFF).double()
    n = sp[:, 7].double()
    busy = n > 0
    print(f"  span {int(rel[:, 3].max()) / 1e3:.1f} us; per CTA (ns): "
          f"prologue {_stats((rel[:, 1] - rel[:, 0]).tolist())}; loop {_stats(loop_ns.tolist())}; "
          f"epilogue {_stats((rel[:, 3] - rel[:, 2]).tolist())}")
    print(f"  WG0's loop cycles a 32-token step {_stats((loop_cyc[busy] / n[busy]).tolist())}; SM MHz over the loop "
          f"{_stats((loop_cyc[busy] / loop_ns[busy] * 1e3).tolist())}; SMs used {len(set(sp[:, 6].tolist()))}")


if __name__ == "__main__":
    main()
