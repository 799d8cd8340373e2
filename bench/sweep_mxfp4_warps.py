"""The MXFP4 warp kernel (ops.gemm_mxfp4_warps) over its knobs, side by side in one run: each variant's GPU time
(CUDA graph, L2 read-flushed before every call, as bench.op --graph --flush read), its calc_diff against the plan's
kernel, and `loads=1` variants (the kernel's loads alone, no decode or MMA: what the memory system gives that load
pattern, wrong results) beside the whole kernel; `loads=2` its codes alone, `loads=3` the same codes row by row in
512-byte pieces, `loads=4` piece by piece over the 16 rows, `loads=5` each warp's range as one contiguous run (the
order a weight layout tiled by (block, step) would give); what the rows' scatter costs; `loads=6` the kernel's loads
without the scale words, `loads=7` without the activations (where loads=1's time beyond the codes' goes). Check a
probe's registers against the kernel's before reading its time (bench/NOTES.md "Session 62": at k = 7168 ptxas
unrolls loads=1's loop to 206 registers, one block an SM where the kernel runs two; loads=6 / 7 stay at 50-80).

    python -m bench.sweep_mxfp4_warps [--case MxNxK ...] [--variant "splits=8,depth=2,quads=1,loads=1" ...] [--csv F]
                                      [--jobs N]

A variant is comma-separated knobs of launch_warps (splits, depth, ahead, quads, acts_ring) plus the probes loads
and scales_no_l1 (the scale words not allocated in L1, the same results); an empty one is the plan. Every (case,
variant) kernel is compiled first in --jobs spawned processes (8; through the disk cache, so not with
TILECRAFT_DISABLE_DISK_CACHE), then timed one after another. GPU only.
"""

import argparse
import csv
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.timing import bench_graph, card_identity

CASES = ("1x4096x7168", "1x7168x2048", "8x4096x7168", "8x7168x2048")
VARIANTS = ("", "loads=1", "quads=1", "quads=1,loads=1", "depth=4,quads=1", "depth=4,quads=1,loads=1")


def parse_variant(text: str) -> dict:
    """"splits=8,quads=1" -> {"splits": 8, "quads": True}; "" -> {}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        flags = ("quads", "acts_ring", "scales_no_l1")
        if key not in ("splits", "depth", "ahead", "loads") + flags:
            raise ValueError(f"variant knob must be splits, depth, ahead, quads, acts_ring, scales_no_l1 or loads, "
                             f"got {key!r}")
        out[key] = bool(int(value)) if key in flags else int(value)
    return out


def _compile_one(task: tuple) -> str | None:
    # in a spawned worker: (case, variant text, device) -> None, or the error the timed run will meet again
    case, text, device = task
    try:
        from ops.gemm_mxfp4_warps import launch_warps

        m, n, k = map(int, case.split("x"))
        knobs = parse_variant(text)
        loads = knobs.pop("loads", False)
        dev = torch.device(device)
        a = torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
        packed = torch.zeros(n, k // 2, dtype=torch.uint8, device=dev)
        scales = torch.full((n, k // 32), 127, dtype=torch.uint8, device=dev)
        launch_warps(a, packed, scales, torch.empty(m, n, dtype=torch.bfloat16, device=dev), loads_only=loads, **knobs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def compile_ahead(cases, variants, jobs: int, device: str = "cuda") -> list:
    """Each (case, variant)'s kernel launched once with zeros in `jobs` spawned processes, so that the timed run
    loads it from the disk cache: [(case, variant, error or None)]. Nothing (an empty list) with jobs < 2 or the
    disk cache off."""
    from tilecraft import env

    if jobs < 2 or env.flag("TILECRAFT_DISABLE_DISK_CACHE"):
        return []
    tasks = [(case, text, device) for case in cases for text in variants]
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return [(case, text, err) for (case, text, _), err in zip(tasks, pool.map(_compile_one, tasks))]


def calc_diff(x, y) -> float:
    """1 - 2<x,y> / (|x|^2 + |y|^2) in fp64 (DeepGEMM's measure)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-300))


def main(argv=None):
    from bench.op import versions
    from ops import quant_mxfp4
    from ops.gemm_mxfp4_warps import launch_warps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", help=f"MxNxK (default {', '.join(CASES)})")
    ap.add_argument("--variant", action="append", help=f"knobs (default {VARIANTS})")
    ap.add_argument("--csv", help="write the rows here too")
    ap.add_argument("--jobs", type=int, default=8, help="compile the kernels first in this many processes (8)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.sweep_mxfp4_warps needs a CUDA GPU")
    meta = {"gpu": torch.cuda.get_device_name(), **card_identity(), "timing": "cuda graph", "l2_flush": "read",
            **versions()}
    print(f"{meta['gpu']} {meta.get('gpu_uuid', '')} (torch {meta['torch']}, tilelang {meta['tilelang']})")
    t0 = time.perf_counter()
    done = compile_ahead(args.case or CASES, args.variant or VARIANTS, args.jobs)
    if done:
        print(f"compiled ahead in {args.jobs} processes: {len(done)} kernels in {time.perf_counter() - t0:.0f} s")
        for case, text, err in done:
            if err:
                print(f"  {case} {text or 'plan'}: {err}")
    rows = []
    for case in args.case or CASES:
        m, n, k = map(int, case.split("x"))
        g = torch.Generator().manual_seed(m + n + k)
        a = torch.randn(m, k, generator=g).bfloat16().cuda()
        packed, scales = (t.cuda() for t in quant_mxfp4(torch.randn(n, k, generator=g)))
        want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        launch_warps(a, packed, scales, want)
        for text in args.variant or VARIANTS:
            knobs = parse_variant(text)
            loads = knobs.pop("loads", False)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            r = bench_graph(lambda: launch_warps(a, packed, scales, out, loads_only=loads, **knobs), flush_mode="read")
            diff = float("nan") if loads else calc_diff(out.float(), want.float())
            us = r["median_ms"] * 1e3
            rows.append(dict(case=case, variant=text or "plan", us=round(us, 2), min_us=round(r["min_ms"] * 1e3, 2),
                             diff=diff, gpu=torch.cuda.get_device_name()))
            print(f"{case:<14} {text or 'plan':<28} {us:7.2f} us (min {r['min_ms'] * 1e3:6.2f})  diff {diff:.1e}",
                  flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            f.write("".join(f"# {k}: {v}\n" for k, v in meta.items()))     # as bench.op's CSVs
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
