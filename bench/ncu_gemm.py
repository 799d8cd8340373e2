"""One FP8 GEMM call inside a profiler range, with ops.gemm_fp8's switches set from the command line, for ncu:

    ncu --profile-from-start off --metrics lts__t_requests.sum,lts__t_sectors.sum,dram__bytes_read.sum \\
        python -m bench.ncu_gemm 128x4096x7168 RASTER=2 [--peer deep_gemm] [--calls 2]

The GEMM is compiled and run once before the range opens (so the range holds only its kernels), then
called --calls times inside it. `--peer deep_gemm` runs DeepGEMM's kernel on the same inputs instead.
"""

import argparse

import torch

import ops
from bench.ncu_call import profile_calls, switch
from ops import gemm_fp8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", help="MxNxK")
    ap.add_argument("flags", nargs="*", help="NAME=VALUE switches of ops.gemm_fp8 (e.g. RASTER=8 MULTICAST=1)")
    ap.add_argument("--peer", choices=["deep_gemm"], default=None)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_intermixed_args()   # switches may follow the options
    m, n, k = (int(x) for x in args.shape.lower().split("x"))
    for name, value in (switch(gemm_fp8, f) for f in args.flags):
        setattr(gemm_fp8, name, value)
    g = torch.Generator().manual_seed(0)
    qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g))
    qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g))
    qa, sfa, qb, sfb = (t.cuda() for t in (qa, sfa, qb, sfb))
    if args.peer == "deep_gemm":
        import deep_gemm as dg

        sfa_mn = dg.get_mn_major_tma_aligned_tensor(sfa)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        call = lambda: dg.fp8_gemm_nt((qa, sfa_mn), (qb, sfb), out)  # noqa: E731
    else:
        call = lambda: ops.fp8_gemm_nt(qa, sfa, qb, sfb)  # noqa: E731
    profile_calls(call, args.calls)


if __name__ == "__main__":
    main()
