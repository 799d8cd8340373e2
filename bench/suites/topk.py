"""Row-wise top-k: the sparse-attention indexer (k = 2048) and sampling (k = 512).

bytes = rows * N * 4 (each score read once; the kernel's extra passes hit L2)
"""

import torch

import ops
from bench.suites import Provider, Suite
from ops.topk_select import topk_select_program

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
               Provider("torch", lambda c, i: (lambda: torch.topk(i["x"], c["k"], dim=-1)))],
    kernels=lambda c: [(topk_select_program, dict(k=c["k"]))],
    label=lambda c: f"T={c['T']} N={c['N']} k={c['k']}",
)
