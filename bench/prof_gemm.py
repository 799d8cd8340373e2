"""Where an FP8 decode GEMM's time goes: each kernel's own GPU time (profiler), the gap between the
GEMM and its split-K reduce, and a fit of kernel time = fixed + per step over K.

    python -m bench.prof_gemm [--ms 64,128] [--variants v2,v3,v2-cluster,v3-cluster] [--out DIR]
    python -m bench.prof_gemm --trace      # where a block's cycles go (fp8_gemm_program trace=True)
    python -m bench.prof_gemm --trace-steps    # each K block's issue and landing, block by block

Per decode shape and variant (v2: the K loop that waits for each step's MMA, with the split-K
reduce kernel; v2-fold: the same, the last block of a tile adding the partials; v3: the overlapped
loop, tile.mma_promoted_loop; -cluster: a tile's split blocks fold the partials in their cluster,
no reduce kernel): the plan, the op's eager time (CUDA events, as bench.op), the GEMM
kernel's and the reduce kernel's mean GPU time and the idle gap between them (torch profiler, L2
flushed before every call). Then, at m = 128, n = 4096 with 4 splits (128 blocks), the GEMM
kernel's time over K = 2048 .. 16384 (4 .. 32 steps a block) and its least-squares line: the
intercept is the fixed cost a block pays whatever its K, the slope one K step. GPU only.
"""

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import ops
from bench.suites.gemm import DECODE_NK
from bench.timing import bench_cuda, profiled_kernels
from backends.cuda.device import max_active_clusters
from ops.gemm_fp8 import (GRID_THREADS, TRACE_EVENTS, V3_TRACE_EVENTS, _fit_exchange, _launch, fp8_gemm_program,
                          fp8_gemm_reduce_program, plan)

REPS = 30
SWEEP_K = (2048, 4096, 8192, 16384)
VARIANTS = {"v2": dict(overlap=False, fold=False, cluster=False), "v2-fold": dict(overlap=False, fold=True, cluster=False),
            "v3": dict(overlap=True, fold=False, cluster=False),
            # one split only: the epilogue staged through shared memory (ops.gemm_fp8.STAGE_C, stage_c=True)
            "v3-stagec": dict(overlap=True, fold=False, cluster=False, stage_c=True),
            "v2-cluster": dict(overlap=False, fold=False, cluster=True),
            "v3-cluster": dict(overlap=True, fold=False, cluster=True),
            # 2 splits of half-width tiles, the pair's partials exchanged in distributed shared memory
            "v3-dsmem": dict(overlap=True, fold=False, cluster=True, cluster_smem=True)}


def _plan(m, n, k, variant, **override):
    """What _launch compiles for this call (the H200's 132 SMs), or None where the variant does not
    apply (a fold without splits)."""
    v = VARIANTS[variant]
    p = {**plan("dense", m, n, k, 64 if m <= 64 else 128, sms=132, overlap=v["overlap"]), **override}
    if v.get("cluster_smem"):
        # 2 splits of the widest tiles whose 2 x tiles blocks fit in one wave (half-width ones first)
        for block_n in (64, 128):
            if n % block_n == 0 and -(-m // p["block_m"]) * (n // block_n) * 2 <= 132 and k // 128 >= 4:
                return _fit_exchange({**p, "block_n": block_n, "splits": 2, "fold": False, "cluster": True,
                                      "cluster_smem": True}, k)
        return None
    if (v["fold"] or v["cluster"]) and p["splits"] == 1 or v.get("stage_c") and p["splits"] > 1:
        return None
    return {**p, "fold": v["fold"], "cluster": v["cluster"], **({"stage_c": True} if v.get("stage_c") else {})}


def _compile(n, k, p):
    fp8_gemm_program.compile("sm_90a", n=n, k=k, mode="dense", out_dtype="bfloat16", **p)
    if p["splits"] > 1 and not (p["fold"] or p["cluster"]):
        fp8_gemm_reduce_program.compile("sm_90a", n=n, splits=p["splits"], out_dtype="bfloat16")


def warm(calls, jobs=14):
    """Compile every (n, k, plan) into the disk cache in parallel processes (one compile is
    single-threaded; the timing loop then only loads them)."""
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in [pool.submit(_compile, n, k, p) for n, k, p in calls]:
            f.result()


def _tilelang_version():
    import tilelang

    return tilelang.__version__


def _operands(m, n, k):
    """The kernel's leading arguments for a dense (m, n, k) call: A, SFA, B (1, n, k), SFB, MIdx,
    MaskedM (the last two unused by dense), and a bf16 C."""
    g = torch.Generator().manual_seed(0)
    qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g).cuda())
    qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g).cuda())
    aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")
    return (qa, sfa, qb[None], sfb[None], *aux), torch.empty(m, n, dtype=torch.bfloat16, device="cuda")


def _tiles(variant, p):
    """The plan keys a variant overrides beyond its flags (v3-dsmem: half-width tiles, 2 splits)."""
    return {"block_n": p["block_n"], "splits": p["splits"]} if VARIANTS[variant].get("cluster_smem") else {}


def _inputs(m, n, k):
    args, out = _operands(m, n, k)
    return lambda **kw: _launch("dense", *args, out, n, k, block_m=64 if m <= 64 else 128, **kw)


def kernel_times(fn, reps=REPS):
    """{'gemm': us, 'reduce': us or None, 'gap': us or None, 'span': us}: means over reps, each call
    after an L2 flush, from the profiler's kernel records."""
    kernels = sorted((e for e in profiled_kernels(fn, reps) if "fp8_gemm" in e.name), key=lambda e: e.time_range.start)
    calls = []
    for e in kernels:
        if "reduce" in e.name:
            calls[-1].append(e)
        else:
            calls.append([e])
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    gemm = mean([c[0].time_range.elapsed_us() for c in calls])
    red = [c[1] for c in calls if len(c) > 1]
    return dict(gemm=gemm, reduce=mean([r.time_range.elapsed_us() for r in red]),
                gap=mean([c[1].time_range.start - c[0].time_range.end for c in calls if len(c) > 1]),
                span=mean([c[-1].time_range.end - c[0].time_range.start for c in calls]), calls=len(calls))


TRACE_CASES = [(128, 4096, 2048, 4), (128, 4096, 7168, 4), (128, 7168, 16384, 2)]


TRACEABLE = ("v2", "v2-cluster", "v3", "v3-stagec", "v3-cluster", "v3-dsmem")


def trace(out_dir, variants=("v2", "v2-cluster", "v3")):
    """Per traced case and variant: the GEMM kernel's time (profiler) and, over its blocks, the
    median SM cycles between the block's events (fp8_gemm_program trace=True; the split variants
    with the reduce kernel, -cluster with the fold in the cluster and its "folded" event; v3 stamps
    V3_TRACE_EVENTS: its bursts have no single "last step")."""
    rows = []
    for m, n, k, case_splits in TRACE_CASES:
        for v in variants:
            p = _plan(m, n, k, v, splits=case_splits)
            if p is None:
                continue
            p = {**p, "trace": True}
            p.pop("fold")
            splits = p["splits"]                                  # (v3-dsmem plans its own)
            events = V3_TRACE_EVENTS if p.get("overlap") else TRACE_EVENTS
            events = events if p["cluster"] else events[:-1]
            at = [TRACE_EVENTS.index(e) for e in events]          # their slots in a block's 8 stamps
            kernel = fp8_gemm_program.compile("sm_90a", n=n, k=k, mode="dense", out_dtype="bfloat16", **p).launcher()
            args, out = _operands(m, n, k)
            blocks = -(-m // p["block_m"]) * (n // p["block_n"]) * splits
            part = torch.empty(*((splits, m, n) if splits > 1 else (1, 1, n)), dtype=torch.float32, device="cuda")
            count = torch.zeros(blocks * 8, dtype=torch.int32, device="cuda")
            fn = lambda: kernel(*args, out, part, count)  # noqa: E731
            t = kernel_times(fn)
            stamps = count.view(blocks, 8)[:, at].cpu().long()
            deltas = ((stamps[:, 1:] - stamps[:, :-1]) % (1 << 32)).double().median(0).values.tolist()
            steps = -(-(k // 128) // splits)
            names = [f"{a} -> {b}" for a, b in zip(events, events[1:])]
            # v2: "step 1" -> "last step" spans steps - 2 steps; v3: "step 1" -> "loop done", steps - 1
            middle = deltas[2] / max(steps - (1 if p.get("overlap") else 2), 1)
            print(f"{m}x{n}x{k} {v} splits {splits} ({blocks} blocks, {steps} steps): kernel {t['gemm']:.1f} us; "
                  "median cycles " + ", ".join(f"{nm} {d:.0f}" for nm, d in zip(names, deltas))
                  + f"; per middle step {middle:.0f}", flush=True)
            rows.append(dict(m=m, n=n, k=k, variant=v, splits=splits, kernel_us=t["gemm"], events=list(events),
                             median_cycles=dict(zip(names, deltas))))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prof_gemm_trace.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tilelang": _tilelang_version(),
             "rows": rows}, indent=1))


STEP_TRACE_SHAPES = [(128, 4096, 7168), (64, 4096, 7168), (128, 2112, 7168), (64, 7168, 16384)]


def trace_steps(out_dir, shapes=STEP_TRACE_SHAPES):
    """Per shape, the op's own one-split plan traced K block by K block (fp8_gemm_program
    trace_steps=True; the SM clock, so only differences inside a block mean anything): for each block,
    when the producer issued each K block's loads and when the MMA warpgroups found them landed. Printed
    as medians over blocks: the first K block's latency (issue -> landed), the steady latency (median
    over K blocks past the pipeline's depth), the landing period, how long the producer waited for a
    free slot (issue of block s after the landing of block s - stages: the slot is released after its
    MMA), and entry -> first issue."""
    rows = []
    for m, n, k in shapes:
        p = plan("dense", m, n, k, 64 if m <= 64 else 128, sms=132)
        if p["splits"] != 1 or not p.get("overlap"):
            print(f"{m}x{n}x{k}: the plan splits K ({p}); not traced", flush=True)
            continue
        p = {**p, "stage_c": True, "trace": True, "trace_steps": True}
        kernel = fp8_gemm_program.compile("sm_90a", n=n, k=k, mode="dense", out_dtype="bfloat16", **p).launcher()
        args, out = _operands(m, n, k)
        blocks, kb, stages = -(-m // p["block_m"]) * (n // p["block_n"]), k // 128, p["stages"]
        stride = 8 + 2 * kb
        part = torch.empty(1, 1, n, dtype=torch.float32, device="cuda")
        count = torch.zeros(blocks * stride, dtype=torch.int32, device="cuda")
        t = kernel_times(lambda: kernel(*args, out, part, count))
        st = count.view(blocks, stride).cpu().long()
        issued, landed = st[:, 8:8 + kb], st[:, 8 + kb:]
        cyc = lambda x: (x % (1 << 32)).double()  # noqa: E731  (32-bit clock differences)
        latency, period = cyc(landed - issued), cyc(landed[:, 1:] - landed[:, :-1])
        slot_wait = cyc(issued[:, stages:] - landed[:, :-stages])
        med = lambda x: float(x.median())  # noqa: E731
        at = [TRACE_EVENTS.index(e) for e in V3_TRACE_EVENTS[:-1]]       # entry .. stored (no cluster fold)
        ev = st[:, at]
        span = cyc(ev[:, -1] - ev[:, 0])                                  # a block's entry -> stored
        # The SM clock is not shared between SMs, but one wave's blocks all run for about the kernel's
        # time: the longest block's cycles over the profiler's kernel time is a lower bound of the clock.
        mhz = float(span.max()) / t["gemm"]
        # the bytes a K block brings from DRAM over the whole grid: B's n rows and A's m rows, 128 columns
        unique = (n + m) * 128
        row = dict(m=m, n=n, k=k, plan={k_: v for k_, v in p.items() if k_ not in ("trace", "trace_steps")},
                   kernel_us=t["gemm"], blocks=blocks,
                   first_latency=med(latency[:, 0]), steady_latency=med(latency[:, stages:].median(1).values),
                   period=med(period.median(1).values), slot_wait=med(slot_wait.median(1).values),
                   entry_to_first_issue=med(cyc(issued[:, 0] - st[:, 0])),
                   latency_by_block=[round(float(x)) for x in latency.median(0).values],
                   events=list(V3_TRACE_EVENTS[:-1]),
                   event_cycles=[med(cyc(ev[:, j + 1] - ev[:, j])) for j in range(len(at) - 1)],
                   span_cycles=dict(median=med(span), max=float(span.max()), min=float(span.min())),
                   clock_mhz_at_least=mhz,
                   last_landing_to_stored=med(cyc(ev[:, -1] - landed[:, -1])))
        # landings come in bursts (the median gap understates the average): the steady rate from the mean
        # gap past the pipeline's depth, block by block, then the median over blocks
        steady = max(kb - 1 - stages, 1)
        row["mean_period"] = med(cyc(landed[:, -1] - landed[:, min(stages, kb - 1)]) / steady)
        row["steady_dram_gbs_at_that_clock"] = unique / (row["mean_period"] / mhz) / 1e3
        rows.append(row)
        print(f"{m}x{n}x{k} ({p['block_m']}x{p['block_n']}, {stages} stages, {blocks} blocks): kernel "
              f"{t['gemm']:.1f} us; median cycles: entry -> first issue {row['entry_to_first_issue']:.0f}, first "
              f"latency {row['first_latency']:.0f}, steady latency {row['steady_latency']:.0f}, landing period "
              f"{row['period']:.0f}, issue after the slot's last landing {row['slot_wait']:.0f}, last landing -> "
              f"stored {row['last_landing_to_stored']:.0f}; entry -> stored median {row['span_cycles']['median']:.0f}, "
              f"max {row['span_cycles']['max']:.0f} cycles: clock >= {mhz:.0f} MHz, so the steady mean landing period "
              f"({row['mean_period']:.0f}) moves >= {row['steady_dram_gbs_at_that_clock']:.0f} GB/s from DRAM; events "
              + ", ".join(f"{a} -> {b} {c:.0f}" for a, b, c in zip(row["events"], row["events"][1:],
                                                                  row["event_cycles"])), flush=True)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prof_gemm_trace_steps.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tilelang": _tilelang_version(),
             "rows": rows}, indent=1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="64,128")
    p.add_argument("--variants", default="v2,v3,v2-cluster,v3-cluster", help=f"of {sorted(VARIANTS)}")
    p.add_argument("--out", type=Path)
    p.add_argument("--warm-only", action="store_true", help="compile into the disk cache and stop (no GPU needed)")
    p.add_argument("--trace", action="store_true", help="only the per-event cycle trace of TRACE_CASES")
    p.add_argument("--trace-steps", action="store_true",
                   help="only the per-K-block trace (issue and landing) of the op's plans at STEP_TRACE_SHAPES")
    args = p.parse_args(argv)
    if not args.warm_only and not torch.cuda.is_available():
        print("bench.prof_gemm times kernels on a CUDA GPU (sm_90a): none found (--warm-only compiles without one)",
              file=sys.stderr)
        return 2
    if not args.warm_only:
        probe = torch.empty(1, device="cuda")
        room = {(c, smem): max_active_clusters(probe, c, GRID_THREADS, smem) for c in (2, 4, 8)
                for smem in (140 << 10, 210 << 10)}
        print(f"clusters the GPU runs at once, of {GRID_THREADS}-thread blocks (cluster, smem bytes): {room}", flush=True)
    if args.trace:
        return trace(args.out, [v for v in args.variants.split(",") if v in TRACEABLE])
    if args.trace_steps:
        return trace_steps(args.out)
    rows, fit = [], []
    ms, variants = list(map(int, args.ms.split(","))), args.variants.split(",")
    plans = [(n, k, _plan(m, n, k, v)) for m in ms for n, k in DECODE_NK for v in variants]
    swept = [v for v in variants if not VARIANTS[v].get("cluster_smem") and not VARIANTS[v].get("stage_c")]  # (4 splits)
    plans += [(4096, k, _plan(128, 4096, k, v, splits=4)) for k in SWEEP_K for v in swept]
    warm([(n, k, dict(p)) for n, k, p in sorted({(n, k, tuple(sorted(p.items()))) for n, k, p in plans if p})])
    if args.warm_only:
        return
    fmt = lambda x: "   -  " if x is None else f"{x:6.1f}"  # noqa: E731
    print("m x n x k          variant plan           eager  gemm  reduce   gap   span (us)")
    for m in ms:
        for n, k in DECODE_NK:
            run = _inputs(m, n, k)
            for v in variants:
                pl = _plan(m, n, k, v)
                if pl is None:
                    continue
                fn = lambda v=v, pl=pl: run(**VARIANTS[v], **_tiles(v, pl))  # noqa: E731
                eager = bench_cuda(fn)["median_ms"] * 1e3
                t = kernel_times(fn)
                rows.append(dict(m=m, n=n, k=k, variant=v, plan=pl, eager_us=eager, **t))
                print(f"{m:4d}x{n:5d}x{k:5d}  {v:7s} n{pl['block_n']}/s{pl['splits']}/st{pl['stages']:<2d}"
                      f"   {eager:6.1f} {fmt(t['gemm'])} {fmt(t['reduce'])} {fmt(t['gap'])} {fmt(t['span'])}", flush=True)
    print("\nGEMM kernel alone vs K (m=128, n=4096, 4 splits = 128 blocks):")
    for v in swept:
        pts = []
        for k in SWEEP_K:
            run = _inputs(128, 4096, k)
            t = kernel_times(lambda: run(splits=4, **VARIANTS[v]))
            steps = k // 128 // 4
            pts.append((steps, t["gemm"]))
            print(f"  {v:7s} k={k:5d} steps/block={steps:2d}: gemm {t['gemm']:6.1f} us", flush=True)
        xs, ys = zip(*pts)
        xm, ym = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - xm) * (y - ym) for x, y in pts) / sum((x - xm) ** 2 for x in xs)
        fit.append(dict(variant=v, fixed_us=ym - slope * xm, step_us=slope, points=pts))
        print(f"  {v:7s} fit: fixed {ym - slope * xm:5.2f} us + {slope:5.3f} us a step "
              f"(a step moves 128 x 16 KB of B: {128 * 16384 / slope / 1e3:5.0f} GB/s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prof_gemm.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tilelang": _tilelang_version(),
             "rows": rows, "fit": fit}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
