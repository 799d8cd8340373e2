"""Time every split-K / pipeline plan of the FP8 GEMM on the decode shapes, to check the planner.

    python -m bench.sweep_gemm [--splits 1,2,4,8] [--overlap 0,1] [--stages 0] [--ms 64,128] [--out DIR]
    python -m bench.sweep_gemm --prefill --overlap 0,1

Prints, per shape, the time of each plan (split count s, K loop v2 = wait 0 per step or v3 =
--overlap 1, tile.mma_promoted_loop), the plan `ops.gemm_fp8.plan` picks, and GB/s against the
weight bytes (TFLOP/s for --prefill); --stages N forces N pipeline stages (0: the planner's);
writes the rows as JSON when --out is given. GPU only.
"""

import argparse
import json
from pathlib import Path

import torch

import ops
from bench.suites.gemm import DECODE_NK
from bench.timing import bench_cuda
from ops.gemm_fp8 import _launch, plan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--ms", default="64,128")
    p.add_argument("--overlap", default="0,1", help="K loops to time: 0 = v2, 1 = v3")
    p.add_argument("--stages", type=int, default=0, help="force this many stages (0: the planner's)")
    p.add_argument("--block-n", default="0", help="block_n values to time, e.g. 64,128 (0: the planner's)")
    p.add_argument("--prefill", action="store_true", help="time 4096x7168x16384 (splits 1) instead")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    shapes = ([(4096, 7168, 16384)] if args.prefill else
              [(m, n, k) for m in map(int, args.ms.split(",")) for n, k in DECODE_NK])
    splits = [1] if args.prefill else list(map(int, args.splits.split(",")))
    for m, n, k in shapes:
        g = torch.Generator().manual_seed(0)
        qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g).cuda())
        qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g).cuda())
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")
        block_m = 64 if m <= 64 else 128
        chosen = plan("dense", m, n, k, block_m)
        nbytes = m * k + n * k + m * n * 2
        line = []
        for ov, bn, s in [(o, b, s) for o in map(int, args.overlap.split(",")) for b in map(int, args.block_n.split(","))
                          for s in splits]:
            if bn and n % bn:
                continue
            force = {"stages": args.stages} if args.stages else {}
            if bn:
                force["block_n"] = bn
            fn = lambda s=s, ov=ov, force=force: _launch("dense", qa, sfa, qb[None], sfb[None], *aux, out, n, k,
                                                        block_m=block_m, splits=s, overlap=bool(ov), **force)
            us = bench_cuda(fn)["median_ms"] * 1e3
            stages = args.stages or plan("dense", m, n, k, block_m, overlap=bool(ov))["stages"]
            rows.append(dict(m=m, n=n, k=k, splits=s, overlap=ov, block_n=bn or chosen["block_n"], stages=stages, us=us,
                             gbps=nbytes / us / 1e3, tflops=2 * m * n * k / us / 1e6, chosen=chosen["splits"]))
            rate = f"{2 * m * n * k / us / 1e6:5.0f}TF/s" if args.prefill else f"{nbytes / us / 1e3:5.0f}GB/s"
            line.append(f"{'v3' if ov else 'v2'}/n{bn or chosen['block_n']}/st{stages}/s{s}={us:7.1f}us/{rate}")
        print(f"{m:4d}x{n:5d}x{k:5d} plan s{chosen['splits']}: " + "  ".join(line), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep_gemm.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
