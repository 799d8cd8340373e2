"""Row-wise top-k: the sparse-attention indexer (k = 2048) and sampling (k = 512).

bytes = rows * N * 4 (each score read once; the kernel's extra passes hit L2)

"tilecraft" is the public op (its NaN check reads the scores again and syncs the host unless
TILECRAFT_CHECK_VALUES=0); "kernel" is the launch alone; "kernel-256x16" and "kernel-256x8" are
other (threads, float4 per lane) configurations of the same CUDA kernel (default 512 x 6, the
fastest of the three on the H200: bench/NOTES.md "topk v3"); "kernel-512x6-h4" and "-h8" are the
default with 4 or 8 copies of pass 1's histogram in shared memory (64 / 128 KB; warp w adds into
copy w % copies), to see whether contention on the hot bins is what limits pass 1;
"kernel-v2" is the previous CUDA kernel.
"""

import torch

import ops
from bench.suites import Provider, Suite
from ops.topk_select import _impl, topk_select_v3_program

PRESETS = {
    "indexer": [dict(T=64, N=131072, k=2048)],
    "sampling": [dict(T=128, N=65536, k=512)],
}


def make_inputs(case, device):
    return {"x": torch.randn(case["T"], case["N"], device=device)}


SUITE = Suite(
    name="topk",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=lambda c: c["T"] * c["N"] * 4,
    flops=lambda c: 0,
    providers=[Provider("tilecraft", lambda c, i: (lambda: ops.topk_select(i["x"], c["k"]))),
               Provider("kernel", lambda c, i: (lambda: _impl(i["x"], c["k"], None))),
               Provider("kernel-512x6-h4", lambda c, i: (lambda: _impl(i["x"], c["k"], None, hist_copies=4))),
               Provider("kernel-512x6-h8", lambda c, i: (lambda: _impl(i["x"], c["k"], None, hist_copies=8))),
               Provider("kernel-256x16", lambda c, i: (lambda: _impl(i["x"], c["k"], None, threads=256, unroll=16))),
               Provider("kernel-256x8", lambda c, i: (lambda: _impl(i["x"], c["k"], None, threads=256, unroll=8))),
               Provider("kernel-v2", lambda c, i: (lambda: _impl(i["x"], c["k"], None, v2=True))),
               Provider("torch", lambda c, i: (lambda: torch.topk(i["x"], c["k"], dim=-1)))],
    kernels=lambda c: [(topk_select_v3_program, dict(k=c["k"]))],
    label=lambda c: f"T={c['T']} N={c['N']} k={c['k']}",
)
