"""Scratch tensors for an op's kernels, carved from one allocation.

An eager call's host time is mostly allocations and launches (bench/NOTES.md "eager host cost"),
so ops that need several int32 scratch tensors take them from one torch.empty.
"""

import math

import torch


def int32_views(device, *shapes):
    """Contiguous int32 tensors of these shapes (ints or tuples), views of one allocation, each
    starting 16-byte aligned (kernels may read them as int4)."""
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    step = [(c + 3) // 4 * 4 for c in sizes]
    buf = torch.empty(sum(step), dtype=torch.int32, device=device)
    return [part[:c].view(s) for part, c, s in zip(buf.split(step), sizes, shapes)]
