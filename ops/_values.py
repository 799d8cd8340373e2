"""Checks that read tensor values. Each costs a device sync, so they are skipped while a CUDA graph
is being captured and when TILECRAFT_CHECK_VALUES=0; kernels still clamp the indices they read through (block
tables, MoE positions). The W4A8 table offsets are not clamped in the kernels' decode loop: they are
a prepared weight, checked once per tensor (ops.gemm_w4a8._check_offsets)."""

import torch

from tilecraft import env


def enabled(*tensors) -> bool:
    if not env.flag("TILECRAFT_CHECK_VALUES"):
        return False
    if any(t is not None and t.is_meta for t in tensors):     # shapes only (tracing, fake tensors): no values
        return False
    if any(t is not None and t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True
