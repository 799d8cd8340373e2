"""Where a swapped MXFP4 block's time goes (mxfp4_gemm_nt_swapped with trace=True): the SM clock
of each block's first MMA thread at entry, prologue done, each K step's data arrival ("data": its
tiles are in shared memory) and WGMMA issue ("issued": decoded and issued), loop done and stored.

    python -m bench.trace_mxfp4 [--case MxNxK ...] [--no-decode] [--warm] [--decode v6|v7]
                                [--scale-tma auto|on|off] [--ramp N] [--block-n 64|128] [--quantized] [--chains]

The traced run follows an L2 flush (--flush write, the default, or read as bench.op --flush read; as in a model;
--warm: the weights are in L2 from the runs before). Per case it prints, from the global timer (ns):
the kernel's span (first block's entry to last block's stored), the spread of the blocks' entries
and the longest block; then, as medians over the blocks, in SM cycles: the prologue, the wait for the first
step's data, then per step the wait for data (data of step s - issued of step s-1: the tiles came
later than the MMA threads were ready for them) and the work (issued - data: the decode and the
WGMMA issue, including the wait for the step before's WGMMA; split as decode = decoded - data,
launch = launched - decoded, retire = issued - launched), and the
epilogue. A block that
waits for data is fed too slowly; one whose work is the step is bound by its own MMA threads.
--no-decode swaps the decode out (bench.prof_mxfp4's diagnostic; wrong results). GPU only.
"""

import argparse
import statistics

import torch

from bench.timing import FLUSH_MODES, _flusher
from ops import gemm_mxfp4
from ops.gemm_mxfp4 import SWAPPED_STEP_EVENTS, SWAPPED_TRACE_EVENTS, SWAPPED_TRACE_STEPS, SWAPPED_TRACE_WORDS

CASES = ("1x7168x2048", "16x4096x7168", "64x4096x7168")


def _delta(a, b):
    return (int(b) - int(a)) & 0xFFFFFFFF       # 32-bit clock: wraps


def _run_traced(kern, inputs, m, n, splits, blocks, warm, flush_mode="write"):
    """Three runs of a traced swapped kernel (kern(*inputs, out, part, trace, count)), the L2 flushed before each
    unless warm; the last run's per-block trace rows as lists of ints. splits: the partials' (1 where none)."""
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    # every word READY_EMPTY, as the fenceless fold wants them (and leaves them): ops._workspace.ready_partials
    part = torch.full((splits, m if splits > 1 else 1, n), gemm_mxfp4.READY_EMPTY, dtype=torch.int32,
                      device="cuda").view(torch.float32)
    trace = torch.zeros(blocks, SWAPPED_TRACE_WORDS, dtype=torch.int32, device="cuda")
    count = torch.zeros(n // 128, dtype=torch.int32, device="cuda")     # fold: arrivals, back to 0 after each run
    _three_runs(lambda: kern(*inputs, out, part, trace, count), warm, flush_mode)
    return trace.cpu().tolist()


def _three_runs(run, warm, flush_mode):
    # the traced kernel three times, the L2 flushed before each unless warm (the trace keeps the last run's stamps)
    flush = None if warm else _flusher(True, flush_mode)
    for _ in range(3):
        if flush is not None:
            flush()
        run()
    torch.cuda.synchronize()


def trace_case_w4a8(m, n, k, warm=False, flush_mode="write", scale_tma=None, no_offsets=False, pair_wide=None):
    """trace_case for ops.gemm_w4a8's kernel (e4m3 activations, FP8 WGMMA), planned by plan_w4a8 (scale_tma:
    W4A8_SCALE_TMA's override; pair_wide: W4A8_PAIR_WIDE's; no_offsets: the diagnostic without the table offsets,
    wrong results)."""
    from ops import gemm_w4a8

    old = gemm_w4a8.W4A8_SCALE_TMA, gemm_w4a8.W4A8_PAIR_WIDE
    gemm_w4a8.W4A8_SCALE_TMA = scale_tma
    gemm_w4a8.W4A8_PAIR_WIDE = old[1] if pair_wide is None else pair_wide
    try:
        p = gemm_w4a8.plan_w4a8(m, n, k)
    finally:
        gemm_w4a8.W4A8_SCALE_TMA, gemm_w4a8.W4A8_PAIR_WIDE = old
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    codes, offsets, row_scale = gemm_w4a8.prepare_mxfp4_w4a8(
        b, torch.randint(117, 127, (n, k // 32), dtype=torch.uint8, device="cuda"))
    kern = gemm_w4a8.mxfp4_w4a8_swapped_program.compile(gemm_mxfp4.targets.resolve(a), n=n, k=k, trace=True,
                                                        **p, **({"no_offsets": True} if no_offsets else {})).launcher()
    inputs = (a, codes.view(torch.int32), offsets.view(torch.int32), row_scale, torch.ones(m, device="cuda"))
    blocks = n // p.get("block_n", 128) * p["splits"]     # (W4A8_CHAINS: 64-row blocks)
    rows = _run_traced(kern, inputs, m, n, 1 if p["pair"] else p["splits"], blocks, warm, flush_mode)
    return {**p, "stage_k": 128, **({"no_offsets": True} if no_offsets else {})}, rows


def trace_case_w4a8_masked(groups, m, n, k, warm=False, flush_mode="write"):
    """The W4A8 masked kernel (ops.m_grouped_mxfp4_w4a8_gemm_nt_masked's, as planned) over `groups` groups of m tokens
    each (every group full): its stamps, a row a block (group-major)."""
    from ops import gemm_w4a8

    p = gemm_w4a8.plan_w4a8_masked(m, k, groups=groups, n=n)
    a = torch.randn(groups, m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, device="cuda")
    codes, offsets, row_scale = gemm_w4a8.prepare_mxfp4_w4a8(
        b, torch.randint(117, 127, (groups, n, k // 32), dtype=torch.uint8, device="cuda"))
    kern = gemm_w4a8.mxfp4_w4a8_masked_program.compile(gemm_mxfp4.targets.resolve(a), n=n, k=k, trace=True,
                                                       **p).launcher()
    blocks = groups * n // 128 // p["tiles"]
    out = torch.empty(groups, m, n, dtype=torch.bfloat16, device="cuda")
    trace = torch.zeros(blocks, gemm_mxfp4.SWAPPED_TRACE_WORDS, dtype=torch.int32, device="cuda")
    masked = torch.full((groups,), m, dtype=torch.int32, device="cuda")
    sa = torch.ones(groups, m, device="cuda")
    _three_runs(lambda: kern(a, codes.view(torch.int32), offsets.view(torch.int32), row_scale, sa, masked, out, trace),
                warm, flush_mode)
    return {**p, "splits": 1, "stage_k": 128, "groups": groups, "pair": False}, trace.cpu().tolist()


def trace_case_w4a8_contiguous(groups, m, n, k, warm=False, flush_mode="write"):
    """The W4A8 contiguous kernel (ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous's, as planned) over `groups` experts of
    m rows each (m a multiple of 128, no padding): its stamps, a row a block (chunk-major)."""
    from ops import gemm_w4a8

    if m % 128:
        raise SystemExit(f"--contiguous takes m (rows an expert) a multiple of 128, got {m}")
    p = gemm_w4a8.plan_w4a8_contiguous(k)
    t = p["tokens"]
    rows = groups * m
    a = torch.randn(rows // t, t, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, device="cuda")
    codes, offsets, row_scale = gemm_w4a8.prepare_mxfp4_w4a8(
        b, torch.randint(117, 127, (groups, n, k // 32), dtype=torch.uint8, device="cuda"))
    kern = gemm_w4a8.mxfp4_w4a8_masked_program.compile(gemm_mxfp4.targets.resolve(a), n=n, k=k, trace=True,
                                                       **p).launcher()
    blocks = rows // t * (n // 128) // p.get("tiles", 1)
    out = torch.empty(rows // t, t, n, dtype=torch.bfloat16, device="cuda")
    trace = torch.zeros(blocks, gemm_mxfp4.SWAPPED_TRACE_WORDS, dtype=torch.int32, device="cuda")
    ids = torch.arange(groups, dtype=torch.int32, device="cuda").repeat_interleave(m).view(rows // t, t)
    sa = torch.ones(rows // t, t, device="cuda")
    _three_runs(lambda: kern(a, codes.view(torch.int32), offsets.view(torch.int32), row_scale, sa, ids, out, trace),
                warm, flush_mode)
    return {**p, "splits": 1, "stage_k": 128, "groups": groups, "pair": False}, trace.cpu().tolist()


def trace_case(m, n, k, warm=False, flush_mode="write", block_n=128, quantized=False, chains=1, **plan):
    """(plan, per-block trace rows as lists of ints) for one run of the traced swapped kernel with blocks of block_n
    weight rows. The weights: random code bytes and scales 2^-17 .. 2^-1, or (quantized) bench.op's own inputs,
    ops.quant_mxfp4 of standard normal weights."""
    p = gemm_mxfp4.plan_swapped(m, n, k, block_n=block_n, chains=chains, **plan)
    a = torch.randn(m, k, device="cuda").bfloat16()
    if quantized:
        import ops

        b, s = ops.quant_mxfp4(torch.randn(n, k, device="cuda").bfloat16())
    else:
        b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        s = torch.randint(110, 127, (n, k // 32), dtype=torch.uint8, device="cuda")
    kern = gemm_mxfp4.mxfp4_swapped_program.compile(gemm_mxfp4.targets.resolve(a), n=n, k=k, trace=True,
                                                    **p).launcher()
    rows = _run_traced(kern, (a, b.view(torch.int32), s.view(torch.int32)), m, n, max(p["splits"], 1),
                       n // block_n * p["splits"], warm, flush_mode)
    return p, rows


def summarize(p, rows, k):
    e = {name: i for i, name in enumerate(SWAPPED_TRACE_EVENTS)}
    base = len(SWAPPED_TRACE_EVENTS)
    steps = min(-(-(k // p["stage_k"]) // p["splits"]), SWAPPED_TRACE_STEPS)
    per = len(SWAPPED_STEP_EVENTS)
    at = lambda s, ev: base + per * s + SWAPPED_STEP_EVENTS.index(ev)     # noqa: E731
    full = [r for r in rows if r[at(steps - 1, "issued")] != 0]          # blocks that ran every step
    med = lambda xs: statistics.median(xs) if xs else float("nan")      # noqa: E731
    out = {"blocks": len(full), "steps": steps,
           "prologue": med([_delta(r[e["entry"]], r[e["prologue done"]]) for r in full]),
           "first data": med([_delta(r[e["prologue done"]], r[base]) for r in full]),
           "epilogue": med([_delta(r[e["loop done"]], r[e["stored"]]) for r in full]),
           "total": med([_delta(r[e["entry"]], r[e["stored"]]) for r in full])}
    # the epilogue's parts (its stamps: "scaled", "sent", "exchanged"; each median over the blocks that stamped both
    # ends: "exchanged" only by a fold's last block)
    marks = ("loop done", "scaled", "sent", "exchanged", "stored")
    out["epilogue parts"] = {
        f"{a} -> {b}": med([_delta(r[e[a]], r[e[b]]) for r in full if r[e[a]] and r[e[b]]])
        for a, b in zip(marks, marks[1:])}
    # the global timer's low 32 bits, as offsets from the first block's entry (wrap-safe: the blocks'
    # stamps lie within 2^31 ns of each other)
    ref = full[0][e["entry ns"]] if full else 0
    signed = lambda v: (_delta(ref, v) + 2 ** 31) % 2 ** 32 - 2 ** 31     # noqa: E731
    first = min((signed(r[e["entry ns"]]) for r in full), default=0)
    ns = lambda r, ev: signed(r[e[ev]]) - first     # noqa: E731
    out["span ns"] = max((ns(r, "stored ns") for r in full), default=float("nan"))
    out["entry spread ns"] = max((ns(r, "entry ns") for r in full), default=float("nan"))
    out["longest block ns"] = max((_delta(r[e["entry ns"]], r[e["stored ns"]]) for r in full), default=float("nan"))
    span = lambda a, b: [med([_delta(r[at(i, a)], r[at(i, b)]) for r in full]) for i in range(steps)]  # noqa: E731
    out["work"] = span("data", "issued")
    out["decode"] = span("data", "decoded")           # the fragment's decode (and its raw loads)
    out["launch"] = span("decoded", "launched")       # issuing the step's WGMMAs
    out["retire"] = span("launched", "issued")        # waiting for the step before's WGMMAs
    back = p.get("chains", 1)       # the step before on the same warpgroups (chains: two back)
    out["wait"] = [med([_delta(r[at(i - back, "issued")], r[at(i, "data")]) for r in full]) for i in range(back, steps)]
    # block by block (--blocks): when each ends (ns after the first entry), its split (block id % splits: split
    # innermost), its wait for the first data, its data waits in the loop and its epilogue (cycles)
    ids = [b for b, r in enumerate(rows) if r[at(steps - 1, "issued")] != 0]
    out["block ends"] = sorted(
        (ns(r, "stored ns"), b, b % max(p.get("splits", 1), 1), _delta(r[e["prologue done"]], r[base]),
         sum(_delta(r[at(i - back, "issued")], r[at(i, "data")]) for i in range(back, steps)),
         _delta(r[e["loop done"]], r[e["stored"]])) for b, r in zip(ids, full))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="*", default=list(CASES), help="MxNxK (m <= 64; with --contiguous, rows an expert)")
    ap.add_argument("--no-decode", action="store_true", help="the kernel without its decode (wrong results)")
    ap.add_argument("--warm", action="store_true", help="no L2 flush before the traced run")
    ap.add_argument("--decode", choices=gemm_mxfp4.SWAPPED_DECODES, default=None, help="the fragment decode")
    ap.add_argument("--scale-tma", choices=("auto", "on", "off"), default="auto", help="scale rows by TMA")
    ap.add_argument("--ramp", type=int, default=0, help="stages the producer asks for alone first (0: off)")
    ap.add_argument("--fold", choices=("auto", "on", "off"), default="auto", help="split-K partials added in the kernel")
    ap.add_argument("--ahead", choices=("auto", "on", "off"), default="auto", help="raw words a step ahead")
    ap.add_argument("--pair", choices=("auto", "on", "off"), default="auto", help="2-split plans fold in clusters of 2")
    ap.add_argument("--stage-out", choices=("auto", "on", "off"), default="auto", help="partials out through smem")
    ap.add_argument("--block-n", type=int, choices=(64, 128), default=128, help="weight rows a swapped block")
    ap.add_argument("--quantized", action="store_true", help="the weights bench.op times (quant_mxfp4 of randn)")
    ap.add_argument("--chains", action="store_true", help="with --block-n 64: two MMA warpgroups on alternate steps")
    ap.add_argument("--w4a8", action="store_true", help="ops.gemm_w4a8's kernel (e4m3 activations), as planned")
    ap.add_argument("--no-offsets", action="store_true", help="w4a8: no table offsets loaded (wrong results)")
    ap.add_argument("--masked", type=int, default=0, help="w4a8: the masked kernel over this many groups of m tokens")
    ap.add_argument("--contiguous", type=int, default=0, help="w4a8: the contiguous kernel over this many experts of m "
                    "rows (m a multiple of 128; MoE prefill)")
    ap.add_argument("--sa-ldg", action="store_true", help="w4a8 --masked: token scales loaded in the epilogue "
                    "(W4A8_MASKED_SA_TMA off)")
    ap.add_argument("--one-tile", action="store_true", help="w4a8 --masked: one n tile a block "
                    "(W4A8_MASKED_TILES off)")
    ap.add_argument("--unstaged", action="store_true", help="w4a8 --masked: C stored from the accumulator's layout "
                    "(W4A8_MASKED_STAGED off)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="write", help="how the L2 is flushed before each run")
    ap.add_argument("--blocks", action="store_true", help="also when the blocks end: percentiles, the last eight")
    args = ap.parse_args(argv)
    if args.sa_ldg:
        from ops import gemm_w4a8

        gemm_w4a8.W4A8_MASKED_SA_TMA = False
    if args.unstaged:
        from ops import gemm_w4a8

        gemm_w4a8.W4A8_MASKED_STAGED = False
    if args.one_tile:
        from ops import gemm_w4a8

        gemm_w4a8.W4A8_MASKED_TILES = False
    if args.no_decode:
        from bench.prof_mxfp4 import no_decode

        no_decode()
    for case in args.case:
        m, n, k = map(int, case.split("x"))
        if args.w4a8 and args.contiguous:
            p, rows = trace_case_w4a8_contiguous(args.contiguous, m, n, k, warm=args.warm, flush_mode=args.flush)
        elif args.w4a8 and args.masked:
            p, rows = trace_case_w4a8_masked(args.masked, m, n, k, warm=args.warm, flush_mode=args.flush)
        elif args.w4a8:
            p, rows = trace_case_w4a8(m, n, k, warm=args.warm, flush_mode=args.flush, no_offsets=args.no_offsets,
                                      scale_tma={"auto": None, "on": True, "off": False}[args.scale_tma],
                                      pair_wide={"auto": None, "on": True, "off": False}[args.pair])
        else:
            p, rows = trace_case(m, n, k, warm=args.warm, flush_mode=args.flush, block_n=args.block_n,
                                 quantized=args.quantized, chains=2 if args.chains else 1,
                                 decode=args.decode, ramp=args.ramp,
                                 scale_tma={"auto": None, "on": True, "off": False}[args.scale_tma],
                                 fold={"auto": None, "on": True, "off": False}[args.fold],
                                 ahead={"auto": None, "on": True, "off": False}[args.ahead],
                                 pair={"auto": None, "on": True, "off": False}[args.pair],
                                 stage_out={"auto": None, "on": True, "off": False}[args.stage_out])
        t = summarize(p, rows, k)
        tags = "".join(t for t, on in ((" no-decode", args.no_decode), (" warm", args.warm), (" w4a8", args.w4a8)) if on)
        print(f"{case} {p}{tags}: {t['blocks']} blocks, {t['steps']} steps; "
              f"cycles (median over blocks): total {t['total']:.0f}, prologue {t['prologue']:.0f}, "
              f"first data {t['first data']:.0f}, epilogue {t['epilogue']:.0f}")
        print(f"  global timer: span {t['span ns']} ns, entries spread over {t['entry spread ns']} ns, "
              f"longest block {t['longest block ns']} ns")
        print("  epilogue: " + ", ".join(f"{name} {c:.0f}" for name, c in t["epilogue parts"].items()))
        print(f"  work a step:  {' '.join(f'{w:.0f}' for w in t['work'])}")
        print(f"  data wait:    {' '.join(f'{w:.0f}' for w in t['wait'])}")
        for part in ("decode", "launch", "retire"):
            print(f"  {part + ':':<13} {' '.join(f'{w:.0f}' for w in t[part])}")
        if args.blocks and t["block ends"]:
            ends = [x[0] for x in t["block ends"]]
            pct = [ends[min(len(ends) - 1, int(q * len(ends)))] for q in (0, 0.1, 0.5, 0.9)] + [ends[-1]]
            print(f"  block ends (ns; min p10 p50 p90 max): {' '.join(map(str, pct))}")
            by_split = {}
            for end, b, split, first, waits, epi in t["block ends"]:
                by_split.setdefault(split, []).append((end, epi))
            print("  by split (median end ns, median epilogue cycles): " + ", ".join(
                f"{sp}: {statistics.median(x[0] for x in v):.0f} / {statistics.median(x[1] for x in v):.0f}"
                for sp, v in sorted(by_split.items())))
            for end, b, split, first, waits, epi in t["block ends"][-8:]:
                print(f"    block {b} (split {split}): ends {end} ns; first data {first}, "
                      f"loop data waits {waits}, epilogue {epi} cycles")


if __name__ == "__main__":
    main()
