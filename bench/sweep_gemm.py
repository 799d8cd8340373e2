"""Time every split-K / pipeline plan of the FP8 GEMM on the decode shapes, to check the planner.

    python -m bench.sweep_gemm [--splits 1,2,4,8] [--out DIR]

Prints, per shape, the time of each plan, the plan `ops.gemm_fp8.plan` picks, and GB/s against
the weight bytes; writes the rows as JSON when --out is given. GPU only.
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
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for m in map(int, args.ms.split(",")):
        for n, k in DECODE_NK:
            g = torch.Generator().manual_seed(0)
            qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g).cuda())
            qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g).cuda())
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")
            block_m = 64 if m <= 64 else 128
            chosen = plan("dense", m, n, k, block_m)
            nbytes = m * k + n * k + m * n * 2
            line = []
            for s in map(int, args.splits.split(",")):
                fn = lambda s=s: _launch("dense", qa, sfa, qb[None], sfb[None], *aux, out, n, k, block_m=block_m, splits=s)
                us = bench_cuda(fn)["median_ms"] * 1e3
                rows.append(dict(m=m, n=n, k=k, splits=s, us=us, gbps=nbytes / us / 1e3, chosen=chosen["splits"]))
                line.append(f"s{s}={us:6.1f}us/{nbytes / us / 1e3:5.0f}GB/s")
            print(f"{m:4d}x{n:5d}x{k:5d} plan s{chosen['splits']}: " + "  ".join(line), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep_gemm.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
