"""Row-wise top-k: the sparse-attention indexer (k = 2048) and sampling (k = 512).

bytes = rows * N * 4 (each score read once; the sliced kernels read them twice, and the second
read mostly misses L2: bench/NOTES.md "topk sliced")

"tilecraft" is the public op (its NaN check reads the scores again and syncs the host unless
TILECRAFT_CHECK_VALUES=0); "kernel" is the launch alone, as the op picks it: one cluster per row
(ops/topk_cluster.py) for rows up to 131072 columns; "kernel-sliced" is the two-pass sliced path
that longer rows take (ops/topk_sliced.py, 8192 columns per block); "kernel-v3" is the
one-block-per-row kernel (the fallback for rows of more than 512 slices).
"""

import torch

import ops
from bench.suites import Provider, Suite
from ops.topk_select import _impl
from ops.topk_cluster import THREADS, plan, topk_cluster_program
from ops.topk_sliced import slice_cols, topk_finish_program

PRESETS = {
    "indexer": [dict(T=64, N=131072, k=2048)],
    "sampling": [dict(T=128, N=65536, k=512)],
}


def _kernels(case):
    cluster, vec = plan(case["N"])
    return [(topk_cluster_program, dict(k=case["k"], cluster=cluster, vec=vec)),
            (topk_finish_program, dict(k=case["k"], slice_cols=slice_cols(THREADS, vec)))]


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
               Provider("kernel-sliced", lambda c, i: (lambda: _impl(i["x"], c["k"], None, kernel="sliced"))),
               Provider("kernel-v3", lambda c, i: (lambda: _impl(i["x"], c["k"], None, kernel="v3"))),
               Provider("torch", lambda c, i: (lambda: torch.topk(i["x"], c["k"], dim=-1)))],
    kernels=lambda c, t: _kernels(c),
    label=lambda c: f"T={c['T']} N={c['N']} k={c['k']}",
)
