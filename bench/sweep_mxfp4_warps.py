"""The MXFP4 warp kernel (ops.gemm_mxfp4_warps) over its knobs, side by side in one run: each variant's GPU time
(CUDA graph, L2 read-flushed before every call, as bench.op --graph --flush read), its calc_diff against the plan's
kernel, and `loads=1` variants (the kernel's loads alone, no decode or MMA: what the memory system gives that load
pattern, wrong results) beside the whole kernel; `loads=2` its codes alone, `loads=3` the same codes row by row in
512-byte pieces, `loads=4` piece by piece over the 16 rows, `loads=5` each warp's range as one contiguous run (the
order a weight layout tiled by (block, step) would give); what the rows' scatter costs.

    python -m bench.sweep_mxfp4_warps [--case MxNxK ...] [--variant "splits=8,depth=2,quads=1,loads=1" ...] [--csv F]

A variant is comma-separated knobs of launch_warps (splits, depth, ahead, quads, l2) plus
loads; an empty one is the plan. GPU only.
"""

import argparse
import csv
import sys

import torch

from bench.timing import bench_graph, card_identity

CASES = ("1x4096x7168", "1x7168x2048", "8x4096x7168", "8x7168x2048")
VARIANTS = ("", "loads=1", "quads=1", "quads=1,loads=1", "depth=4,quads=1", "depth=4,quads=1,loads=1")


def parse_variant(text: str) -> dict:
    """"splits=8,quads=1" -> {"splits": 8, "quads": True}; "" -> {}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ("splits", "depth", "ahead", "quads", "l2", "loads"):
            raise ValueError(f"variant knob must be splits, depth, ahead, quads, l2 or loads, got {key!r}")
        out[key] = bool(int(value)) if key == "quads" else int(value)
    return out


def calc_diff(x, y) -> float:
    """1 - 2<x,y> / (|x|^2 + |y|^2) in fp64 (DeepGEMM's measure)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-300))


def main(argv=None):
    from ops import quant_mxfp4
    from ops.gemm_mxfp4_warps import launch_warps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", help=f"MxNxK (default {', '.join(CASES)})")
    ap.add_argument("--variant", action="append", help=f"knobs (default {VARIANTS})")
    ap.add_argument("--csv", help="write the rows here too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.sweep_mxfp4_warps needs a CUDA GPU")
    card = card_identity()
    print(f"{torch.cuda.get_device_name()} {card.get('uuid', '')}")
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
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
