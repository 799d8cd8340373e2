"""Where a step of the register-converted FP8 MLA kernel (ops.mla_decode_fp8_rs) spends its cycles: CTA 0's SM
clock at each of its TRACE_EVENTS for its first steps, unsplit, h_q = 16, 4096 tokens a sequence.

    python -m bench.trace_mla_rs [--blocks 1|2]                     # GPU
    python -m bench.trace_mla_rs --spans [--csv DIR]                # GPU
    python -m bench.trace_mla_rs --rs2 [--warm] [--csv DIR] [--variant JSON]   # GPU

b = 2 x SMs (two CTAs on every SM, as the op runs them) and b = SMs (one an SM). Printed: the step period
and each event's cycles after the step's start, medians over steps 8-55 (min, max beside).

--rs2: the same spans for the two-chain kernel (mla_decode_fp8_rs2, the op's; b = 128 and 132 unsplit) beside the
two-CTA kernel (b = 128, 2 splits), then CTA 0's per-step events of both chains (RS2_TRACE_EVENTS: wait for the
stage, its data landed, scores, P ready, P V done), medians over steps 8-55 per chain. --warm: then b = 128 once
more without writing over the L2 between launches (what the cold prologue costs). --variant '{"probe": "stream"}':
then b = 128 once more with those keyword arguments of mla_decode_fp8_rs2_program (its timing probes, pace, ...).

--spans: every CTA's span (global timer at entry, loop start, loop end, exit; SM clock over the loop; its SM)
for b = 264 unsplit, b = 128 in 2 splits and b = 128/132 at one CTA an SM, beside the kernel's time with and
without the trace (CUDA events, L2 written over between launches): whether the step period CTA 0 shows is
the kernel's.
"""

import argparse
import json
import sys

import torch

import ops
from bench.timing import FLUSH_MODES, _flusher
from ops.mla_decode import D_QK, D_V, LOG2E
from ops.mla_decode_fp8_rs import (RS2_TRACE_EVENTS, SPAN_ROW, TRACE_EVENTS, TRACE_ROW, TRACE_STEPS,
                                   mla_decode_fp8_rs2_program, mla_decode_fp8_rs_program)

H_Q, SEQLEN, PAGE = 16, 4096, 64


def _inputs(b, seqlen, h_q=H_Q):
    g = torch.Generator().manual_seed(0)
    pages = -(-seqlen // PAGE)
    kv = torch.randn(b * pages, PAGE, 1, D_QK, generator=g).bfloat16().cuda()
    cache = ops.quantize_mla_kv_fp8(kv).view(b * pages, PAGE, -1).view(torch.float8_e4m3fn)
    q = (torch.randn(b, h_q, D_QK, generator=g) / 4).bfloat16().cuda()
    table = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
    lens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
    return q, cache, table, lens


def _u32(x):
    return x.view(torch.int32).long() & 0xFFFFFFFF


def _timed(launch, args, flush, reps, name):
    """' NAME median us (min us)' of reps CUDA-event-timed launches, each after flush() (None: the L2 left warm)."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch(*args)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return f" {name} {sorted(times)[reps // 2]:.1f} us (min {min(times):.1f})"


def _stats(v):
    v = sorted(v)
    return f"min {v[0]:.0f}, median {v[len(v) // 2]:.0f}, max {v[-1]:.0f}"


def run(b, blocks):
    q, cache, table, lens = _inputs(b, SEQLEN)
    splits = torch.ones(b, dtype=torch.int32, device="cuda")
    out = torch.empty(b, H_Q, D_V, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, H_Q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(b, 64, D_V, dtype=torch.float32, device="cuda")
    lse_part = torch.empty(1, 64, dtype=torch.float32, device="cuda")
    kernel = mla_decode_fp8_rs_program.compile("sm_90a", h_q=H_Q, s_q=1, page=PAGE, blocks_per_sm=blocks, trace=True)
    for _ in range(3):
        kernel.launcher()(q, cache, cache.view(torch.float32), cache.view(torch.bfloat16), table, lens, splits, out,
                          lse, o_part, lse_part, 1, float(D_QK ** -0.5 * LOG2E))
    torch.cuda.synchronize()
    st = o_part[0, TRACE_ROW, :8 * TRACE_STEPS].contiguous().view(torch.int32).long().cpu().view(TRACE_STEPS, 8)
    st = st & 0xFFFFFFFF
    steps = range(8, min(56, SEQLEN // 64 - 1))
    period = sorted(int(st[k + 1, 0] - st[k, 0]) for k in steps)
    print(f"== b={b}, blocks_per_sm={blocks}: step period (cycles) median {period[len(period) // 2]}, "
          f"min {period[0]}, max {period[-1]}")
    for e, name in enumerate(TRACE_EVENTS[1:], 1):
        d = sorted(int(st[k, e] - st[k, 0]) for k in steps)
        print(f"  {name:12s} +{d[len(d) // 2]:6d} (min {d[0]}, max {d[-1]})")


def _compile(blocks, trace, variant=None):
    if blocks == "rs2":
        return mla_decode_fp8_rs2_program.compile("sm_90a", h_q=H_Q, s_q=1, page=PAGE, trace=trace, **(variant or {}))
    return mla_decode_fp8_rs_program.compile("sm_90a", h_q=H_Q, s_q=1, page=PAGE, blocks_per_sm=blocks, trace=trace)


def spans(b, splits, blocks, reps, csv_dir=None, flush_l2=True, flush_mode="read", variant=None):
    """Times the kernel with and without trace=True, then prints every CTA's span from the last traced launch
    (blocks: CTAs an SM of the rs kernel, or "rs2" for the two-chain kernel; flush_l2=False: the L2 keeps the
    previous launch's lines, the kernel's code included)."""
    q, cache, table, lens = _inputs(b, SEQLEN)
    nsplits = torch.full((b,), splits, dtype=torch.int32, device="cuda")
    out = torch.empty(b, H_Q, D_V, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, H_Q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(b * splits, 64, D_V, dtype=torch.float32, device="cuda")
    lse_part = torch.empty(b * splits, 64, dtype=torch.float32, device="cuda")
    # flush_mode "read" (a sum, the L2 left clean, as bench --flush read) or "write" (a zero-fill: up to an L2 of
    # dirty lines written back during the launch; sessions 38-40 spans before this argument; bench/NOTES.md
    # "Session 40": those write-backs are what spread the CTAs' ends)
    flush = _flusher(flush_l2, flush_mode)
    pace = (torch.zeros(2, dtype=torch.int32, device="cuda"),) if blocks == "rs2" else ()   # rs2's pace counters
    args = (q, cache, cache.view(torch.float32), cache.view(torch.bfloat16), table, lens, nsplits, out, lse, o_part,
            lse_part, *pace, splits, float(D_QK ** -0.5 * LOG2E))
    line = (f"== b={b}, splits={splits}, blocks_per_sm={blocks}{f', {flush_mode} flush' if flush_l2 else ', L2 warm'}"
            f"{f', {json.dumps(variant)}' if variant else ''}:")
    for trace in (False, True):
        line += _timed(_compile(blocks, trace, variant).launcher(), args, flush, reps, "traced" if trace else "plain")
    print(line)
    sp = _u32(o_part[:, SPAN_ROW, :8].contiguous()).cpu()
    t0 = int(sp[:, 0].min())
    rel = (sp[:, :4] - t0) & 0xFFFFFFFF                     # ns after the first CTA's entry
    loop_ns = (rel[:, 2] - rel[:, 1]).double()
    loop_cyc = ((sp[:, 5] - sp[:, 4]) & 0xFFFFFFFF).double()
    steps = sp[:, 7].double()
    sm = sp[:, 6]
    busy = steps > 0
    print(f"  span {int(rel[:, 3].max()) / 1e3:.1f} us; entries {_stats(rel[:, 0].tolist())} ns after the first")
    print(f"  per CTA (ns): prologue {_stats((rel[:, 1] - rel[:, 0]).tolist())}; loop {_stats(loop_ns.tolist())}; "
          f"epilogue {_stats((rel[:, 3] - rel[:, 2]).tolist())}")
    # when the CTAs get there (the kernel ends with the last exit; a spread of loop ends is work left unbalanced)
    print(f"  after the first entry (ns): loop starts {_stats(rel[:, 1].tolist())}; loop ends "
          f"{_stats(rel[:, 2].tolist())}; exits {_stats(rel[:, 3].tolist())}")
    print(f"  steps a CTA {_stats(steps.tolist())}; loop cycles a step {_stats((loop_cyc[busy] / steps[busy]).tolist())}; "
          f"SM MHz over the loop {_stats((loop_cyc[busy] / loop_ns[busy] * 1e3).tolist())}")
    per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
    late = int((rel[:, 0] > 5000).sum())
    print(f"  CTAs an SM: {_stats(per_sm[per_sm > 0].tolist())} over {int((per_sm > 0).sum())} SMs; "
          f"{late} CTAs entered > 5 us after the first")
    st = _u32(o_part[0, TRACE_ROW, :8 * TRACE_STEPS].contiguous()).cpu().view(TRACE_STEPS, 8)
    n0 = int(steps[0])
    if blocks == "rs2":
        _rs2_events(st, n0)
        tail = rs2_tail(st, n0)
        if tail:
            print("  CTA 0's last steps (step: data wait, P V done after the step's start, cycles): "
                  + "; ".join(f"{k}: {wait}, {done}" for k, wait, done in tail))
    elif n0 > 3:
        period = [int(st[k + 1, 0] - st[k, 0]) & 0xFFFFFFFF for k in range(1, min(n0, TRACE_STEPS) - 1)]
        print(f"  CTA 0's step period (cycles) {_stats(period)}; mean {sum(period) / len(period):.0f}")
    if csv_dir:
        import os
        os.makedirs(csv_dir, exist_ok=True)
        with open(os.path.join(csv_dir, f"spans-b{b}-s{splits}-c{blocks}{'-variant' if variant else ''}.csv"), "w") as f:
            f.write("cta,sm,steps,entry_ns,loop_start_ns,loop_end_ns,exit_ns,loop_cycles\n")
            for i in range(sp.shape[0]):
                f.write(f"{i},{int(sm[i])},{int(steps[i])},{int(rel[i, 0])},{int(rel[i, 1])},{int(rel[i, 2])},"
                        f"{int(rel[i, 3])},{int(loop_cyc[i])}\n")


def rs2_tail(st, n0, last=4):
    """CTA 0's last `last` steps of the two-chain kernel (when they are among the traced ones): (step, cycles from
    the step's start to its data, to its P V done). Long data waits here are the end of the stream arriving late
    (with the pace, every CTA's last stages are released together), not the chains."""
    if n0 > TRACE_STEPS or n0 < 1:
        return []
    return [(k, int(st[k, 1] - st[k, 0]) & 0xFFFFFFFF, int(st[k, 4] - st[k, 0]) & 0xFFFFFFFF)
            for k in range(max(0, n0 - last), n0)]


def _rs2_events(st, n0):
    """CTA 0's steps of the two-chain kernel: per chain, the period and each event after the step's start."""
    for w in (0, 1):
        ks = [k for k in range(8, min(n0, TRACE_STEPS) - 2) if k % 2 == w][:24]
        if not ks:
            return
        period = [int(st[k + 2, 0] - st[k, 0]) & 0xFFFFFFFF for k in ks]
        line = f"  chain {w}: step period (cycles) {_stats(period)}"
        for e, name in enumerate(RS2_TRACE_EVENTS[1:], 1):
            line += f"; {name} +{sorted(int(st[k, e] - st[k, 0]) & 0xFFFFFFFF for k in ks)[len(ks) // 2]}"
        print(line)
    lag = [int(st[k + 1, 0] - st[k, 0]) & 0xFFFFFFFF for k in range(8, min(n0, TRACE_STEPS) - 2, 2)]
    print(f"  chain 1's step start after chain 0's: {_stats(lag)} cycles")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--spans", action="store_true", help="every CTA's span, and the kernel timed")
    ap.add_argument("--rs2", action="store_true", help="the two-chain kernel's spans and steps beside the op's")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--csv", default=None, help="--spans: write each run's spans as CSV into this directory")
    ap.add_argument("--warm", action="store_true", help="--rs2: also b = 128 with the L2 not written over between launches")
    ap.add_argument("--variant", default=None, help="--rs2: also b = 128 with these mla_decode_fp8_rs2_program kwargs (JSON)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read",
                    help="how the L2 is emptied before each launch (bench.timing's modes; write leaves dirty lines)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.trace_mla_rs needs a CUDA GPU (sm_90a): none found", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.rs2:
        for b, splits, blocks in ((128, 2, 2), (128, 1, "rs2"), (sms, 1, "rs2")):
            spans(b, splits, blocks, args.reps, args.csv, flush_mode=args.flush)
        if args.warm:
            spans(128, 1, "rs2", args.reps, args.csv, flush_l2=False)
        if args.variant:
            spans(128, 1, "rs2", args.reps, args.csv, flush_mode=args.flush, variant=json.loads(args.variant))
        return 0
    if args.spans:
        for b, splits, blocks in ((2 * sms, 1, 2), (128, 2, 2), (sms, 1, 1), (128, 1, 1), (128, 2, 1)):
            spans(b, splits, blocks, args.reps, args.csv, flush_mode=args.flush)
        return 0
    for b in (args.blocks * sms, sms):
        run(b, args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
