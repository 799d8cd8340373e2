"""Where a step of the FP8 MLA kernel at up to 64 query rows a CTA (ops.mla_decode_fp8_rows64) spends its cycles.

    python -m bench.trace_mla_rows64 [--case 128x64x4096] [--v-scaled] [--k-scaled] [--flush read|write] [--reps 20]   # GPU

One unsplit launch of b sequences (b CTAs a row tile), the cache as the op would hold it. Printed:
- the kernel's time with and without trace=True (CUDA events, the L2 flushed before each launch): the trace's cost;
- CTA 0, per MMA warpgroup: the period of its own steps (two steps of the CTA) and each of TRACE_EVENTS in cycles
  after its step's start, medians over its steps 4 .. 27 (min and max beside);
- every CTA's span: prologue, loop and epilogue (global timer, ns), loop cycles a step and the SM clock.
What to read first (bench/NOTES.md "Session 51"): a step pair of a warpgroup is ~3200 cycles of its own work plus
what it waits for; "data" after "start" is the ring's wait (two stages at 64 rows), "other's P V issued" after
"scores" includes the wait for the other warpgroup's P, "P free" after "softmax" the wait for its P V.
"""

import argparse

import torch

from bench.timing import FLUSH_MODES, _flusher
from bench.trace_mla_rs import _inputs, _stats, _timed, _u32
from ops.mla_decode import BLOCK_M, D_QK, D_V, LOG2E
from ops.mla_decode_fp8_rows64 import TRACE_EVENTS, TRACE_STEPS, mla_decode_fp8_rows64_program

PAGE = 64     # (bench.trace_mla_rs's inputs: 64-token pages)


def step_table(st, first, last):
    """CTA 0's stamps (TRACE_STEPS x 8 SM clocks, uint32) -> per warpgroup w: (period of its own steps, {event:
    cycles after the step's start}) as medians over its steps k with first <= k < last (k % 2 == w)."""
    rows = {}
    for w in (0, 1):
        ks = [k for k in range(first, min(last, TRACE_STEPS - 2)) if k % 2 == w]
        if not ks:
            continue
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        period = med([int((st[k + 2, 0] - st[k, 0]) & 0xFFFFFFFF) for k in ks])
        events = {name: (med(d), min(d), max(d)) for e, name in enumerate(TRACE_EVENTS[1:], 1)
                  for d in [[int((st[k, e] - st[k, 0]) & 0xFFFFFFFF) for k in ks]]}
        rows[w] = (period, events)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="128x64x4096", help="BxH_QxSEQLEN (s_q = 1)")
    ap.add_argument("--v-scaled", action="store_true", help="the three-stage variant (scales in V's fragment)")
    ap.add_argument("--k-scaled", action="store_true", help="the scales in K's fragments (one drain for the scores)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read", help="how the L2 is flushed before each launch")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    b, h_q, seqlen = (int(x) for x in args.case.split("x"))
    q, cache, table, lens = _inputs(b, seqlen, h_q)
    rows_pad = -(-h_q // BLOCK_M) * BLOCK_M
    m_tiles = -(-h_q // (32 if h_q <= 32 else 64))
    out = torch.empty(b, h_q, D_V, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h_q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(b * m_tiles, rows_pad, D_V, dtype=torch.float32, device="cuda")   # bid's stamps: slot bid
    lse_part = torch.empty(b * m_tiles, rows_pad, dtype=torch.float32, device="cuda")
    splits = torch.ones(b, dtype=torch.int32, device="cuda")
    launch_args = (q, cache, cache.view(torch.float32), cache.view(torch.bfloat16), table, lens, splits, out, lse,
                   o_part, lse_part, 1, float(D_QK ** -0.5 * LOG2E))
    flush = _flusher(True, args.flush)
    variant = "".join(f" {n}" for n, on in (("v_scaled", args.v_scaled), ("k_scaled", args.k_scaled)) if on)
    line = f"== {args.case}{variant}, {args.flush} flush, {m_tiles} row tile(s) a sequence:"
    for trace in (False, True):
        kernel = mla_decode_fp8_rows64_program.compile("sm_90a", h_q=h_q, s_q=1, page=PAGE, v_scaled=args.v_scaled,
                                                       k_scaled=args.k_scaled, trace=trace)
        line += _timed(kernel.launcher(), launch_args, flush, args.reps, "traced" if trace else "plain")
    print(line)
    st = _u32(o_part[0, 0, :8 * TRACE_STEPS].contiguous()).cpu().view(TRACE_STEPS, 8)
    for w, (period, events) in step_table(st, 4, 28).items():
        print(f"  CTA 0, WG{w}: its step pair {period} cycles (two of the CTA's steps); after its step's start:")
        for name, (m, lo, hi) in events.items():
            print(f"    {name:22s} +{m:6d} (min {lo}, max {hi})")
    sp = _u32(o_part[:, 1, :8].contiguous()).cpu()
    t0 = int(sp[:, 0].min())
    rel = (sp[:, :4] - t0) & 0xFFFFFFFF
    loop_ns = (rel[:, 2] - rel[:, 1]).double()
    loop_cyc = ((sp[:, 5] - sp[:, 4]) & 0xFFFFFFFF).double()
    steps = sp[:, 7].double()
    busy = steps > 0
    print(f"  span {int(rel[:, 3].max()) / 1e3:.1f} us; per CTA (ns): prologue {_stats((rel[:, 1] - rel[:, 0]).tolist())}; "
          f"loop {_stats(loop_ns.tolist())}; epilogue {_stats((rel[:, 3] - rel[:, 2]).tolist())}")
    print(f"  loop cycles a step {_stats((loop_cyc[busy] / steps[busy]).tolist())}; SM MHz over the loop "
          f"{_stats((loop_cyc[busy] / loop_ns[busy] * 1e3).tolist())}")


if __name__ == "__main__":
    main()
