"""One W4A8 MXFP4 call (dense or masked grouped) inside a profiler range, with ops.gemm_w4a8's switches set from the
command line, for ncu's per-SASS stall samples:

    ncu --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \\
        -o rep python -m bench.ncu_w4a8 64x4096x7168 --groups 8 [--group-scales] [W4A8_BURST_64=None] [--calls 1]
    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv && python -m bench.ncu_sass k.csv

--groups G: the masked grouped op over G groups of m tokens (all rows live), else the dense op. --group-scales: sfa
per (token, 128 columns) from per_token_group_quant_fp8, else per token. The op is compiled and run once before the
range opens (the range holds only its kernels), then called --calls times inside it. GPU only.
"""

import argparse

import torch

import ops
from bench.ncu_call import profile_calls, switch
from ops import gemm_w4a8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", help="MxNxK (m <= 64)")
    ap.add_argument("flags", nargs="*", help="NAME=VALUE switches of ops.gemm_w4a8 (e.g. W4A8_BURST_64=None)")
    ap.add_argument("--groups", type=int, default=0, help="masked grouped op over this many groups (0: dense)")
    ap.add_argument("--group-scales", action="store_true", help="sfa per (token, 128 columns)")
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_intermixed_args()   # switches may follow the options
    m, n, k = (int(x) for x in args.shape.lower().split("x"))
    for name, value in (switch(gemm_w4a8, f) for f in args.flags):
        setattr(gemm_w4a8, name, value)
    if not torch.cuda.is_available():
        raise SystemExit("bench.ncu_w4a8 needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    groups = max(args.groups, 1)
    packed, scales = ops.quant_mxfp4(torch.randn(groups * n, k, generator=g))
    a = torch.randn(groups * m, k, generator=g)
    if args.group_scales:
        a8, sfa = ops.per_token_group_quant_fp8(a)
    else:
        sfa = (a.abs().amax(-1) / 448).clamp(min=2 ** -120)
        a8 = (a / sfa[:, None]).to(torch.float8_e4m3fn)
    if args.groups:
        codes, offsets, row_scale = gemm_w4a8.prepare_mxfp4_w4a8(packed.view(groups, n, k // 2),
                                                                 scales.view(groups, n, k // 32))
        masked = torch.full((groups,), m, dtype=torch.int32)
        dev = [t.cuda() for t in (a8.view(groups, m, k), sfa.view(groups, m, *sfa.shape[1:]), codes, offsets,
                                  row_scale, masked)]
        call = lambda: ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*dev)  # noqa: E731
    else:
        dev = [t.cuda() for t in (a8, sfa, *gemm_w4a8.prepare_mxfp4_w4a8(packed, scales))]
        call = lambda: ops.mxfp4_w4a8_gemm_nt(*dev)  # noqa: E731
    profile_calls(call, args.calls)


if __name__ == "__main__":
    main()
