"""Where a warp of the MXFP4 warp kernel spends its time (mxfp4_gemm_nt_warps with trace=True): per warp the
global timer at entry and end, and the SM clock at entry, at each K step's data (the step's scale words in
registers: its loads landed) and issue (its MMAs issued), and at the end.

    python -m bench.trace_mxfp4_warps [--case MxNxK ...] [--splits S] [--depth D] [--ahead A] [--quads]
                                      [--acts-ring 0|1] [--flush read|write]

The traced run follows an L2 flush (read by default, as bench.op --flush read). Per case it prints, from the
global timer (ns, relative to the first warp's entry): the span, the entries' spread (a second wave of blocks shows
as late entries) and the ends' spread; then, medians and 90th percentiles over warps (SM cycles): the wait for
the first step's data, per step the wait for data (data of step s - issue of step s - 1) and the work (issue -
data: decode and MMA issue), and the tail after the last step (the partials' meeting). A warp whose steps are
waits is fed too slowly; one whose steps are work is bound by its own issue. GPU only.
"""

import argparse
import statistics

import torch

from bench.timing import FLUSH_MODES, _flusher
from ops.gemm_mxfp4_warps import TRACE_STEPS, TRACE_WORDS, mxfp4_warps_program, plan_warps

CASES = ("1x4096x7168", "1x7168x2048", "8x4096x7168")


def _delta(a, b):
    return (int(b) - int(a)) & 0xFFFFFFFF       # 32-bit clock / timer: wraps


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def trace_case(m, n, k, flush_mode="read", **override):
    """The traced kernel's rows (one per warp: TRACE_WORDS ints) and its plan, after three runs (flushed before each)."""
    from backends.cuda.device import sm_count
    from ops import quant_mxfp4
    from ops.gemm_mxfp4 import _code_words, _scale_words

    p = plan_warps(m, n, k, sms=sm_count(torch.empty(0, device="cuda")), **override)
    kern = mxfp4_warps_program.compile("cuda:sm_90a", n=n, k=k, trace=True, **p)
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g).bfloat16().cuda()
    packed, scales = (t.cuda() for t in quant_mxfp4(torch.randn(n, k, generator=g)))
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    trace = torch.zeros(n // 16 * p["splits"], TRACE_WORDS, dtype=torch.int32, device="cuda")
    flush = _flusher(True, flush_mode)
    for _ in range(3):
        flush()
        kern(a, _code_words(packed), _scale_words(scales), out, trace)
    torch.cuda.synchronize()
    return trace.cpu().tolist(), p


def summarize(rows, kb, splits):
    per = -(-kb // splits)
    t0 = min(r[0] for r in rows)
    entry = [_delta(t0, r[0]) for r in rows]
    end = [_delta(t0, r[1]) for r in rows]
    first, wait, work, tail = [], [], [], []
    for w, r in enumerate(rows):
        steps = max(0, min(per, kb - (w % splits) * per))
        stamped = min(steps, TRACE_STEPS)
        if not stamped:
            continue
        data = [r[4 + 2 * i] for i in range(stamped)]
        issued = [r[5 + 2 * i] for i in range(stamped)]
        first.append(_delta(r[2], data[0]))
        work += [_delta(d, i) for d, i in zip(data, issued)]
        wait += [_delta(issued[i - 1], data[i]) for i in range(1, stamped)]
        tail.append(_delta(issued[-1], r[3]))

    def line(name, xs):
        return f"  {name:<22} p50 {_pct(xs, 0.5):>7}  p90 {_pct(xs, 0.9):>7}  max {max(xs) if xs else 0:>7}"

    out = [f"  span {max(end) / 1000:.2f} us over {len(rows)} warps; entries (ns) p50 {_pct(entry, 0.5)} p90 "
           f"{_pct(entry, 0.9)} max {max(entry)}; ends (ns) p10 {_pct(end, 0.1)} p50 {_pct(end, 0.5)} max {max(end)}",
           "  SM cycles:",
           line("first data (entry ->)", first), line("step: wait for data", wait), line("step: work", work),
           line("tail (last issue ->)", tail)]
    if statistics.median(entry) > 0:
        late = sum(e > 2 * statistics.median(entry) + 1000 for e in entry)
        out.append(f"  warps entering after twice the median entry + 1 us: {late} (a second wave of blocks)")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", help=f"MxNxK (default {', '.join(CASES)})")
    ap.add_argument("--splits", type=int, default=None, help="warps a block (default plan_warps')")
    ap.add_argument("--depth", type=int, default=None, help="K steps of codes in registers (default DEPTH)")
    ap.add_argument("--ahead", type=int, default=None, help="L2 prefetch steps beyond them (default AHEAD)")
    ap.add_argument("--quads", action="store_true", help="the scale words four steps a load (default QUADS)")
    ap.add_argument("--acts-ring", type=int, choices=(0, 1), default=None,
                    help="the activations depth steps ahead (1) or one step ahead (0) (default ACTS_RING)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.trace_mxfp4_warps needs a CUDA GPU")
    override = {k: v for k, v in (("splits", args.splits), ("depth", args.depth), ("ahead", args.ahead),
                                  ("quads", args.quads or None),
                                  ("acts_ring", None if args.acts_ring is None else bool(args.acts_ring)))
                if v is not None}
    for case in args.case or CASES:
        m, n, k = map(int, case.split("x"))
        rows, p = trace_case(m, n, k, args.flush, **override)
        print(f"{case} {p} (flush {args.flush})")
        print(summarize(rows, k // 128, p["splits"]))


if __name__ == "__main__":
    main()
