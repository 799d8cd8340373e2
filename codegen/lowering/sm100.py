"""Blackwell (sm_100a): the accumulator lives in tensor memory; each tcgen05 MMA completes on the
accumulator's mbarrier, waited on with parity `step % 2` (step = MMAs into it before this one).
A plain T.gemm here would fall back to the old HMMA path."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator, emit


@register("accumulator", "cuda:sm_100a")
def accumulator(shape, dtype="float32"):
    buf = T.alloc_tmem(list(shape), dtype)
    bar = T.alloc_barrier(1)
    return Accumulator(buf, tuple(shape), dtype, {"bar": bar})


@register("mma", "cuda:sm_100a")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    emit(T.tcgen05_gemm(a, b, acc.buf, False, transpose_b, mbar=acc.extra["bar"], clear_accum=clear),
         T.mbarrier_wait_parity(acc.extra["bar"], step % 2))


@register("limits", "cuda:sm_100a")
def limits():
    return {"smem_bytes": 227 * 1024, "accumulator_columns": 512, "sms": 148}


@T.macro
def _rescale_tmem(tmem, regs, row_scale, step):
    if step > 0:
        T.copy(tmem, regs)
        for i, j in T.Parallel(regs.shape[0], regs.shape[1]):
            regs[i, j] *= row_scale[i]
        T.copy(regs, tmem)


@register("mma_rescaled", "cuda:sm_100a")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    # the accumulator lives in TMEM: bring it through registers to scale it (FA4-style correction)
    regs = acc.extra.get("regs")
    if regs is None:
        regs = acc.extra["regs"] = T.alloc_fragment(acc.shape, acc.dtype)
    _rescale_tmem(acc.buf, regs, row_scale, step)
    emit(T.tcgen05_gemm(a, b, acc.buf, False, transpose_b, mbar=acc.extra["bar"], clear_accum=(step == 0)),
         T.mbarrier_wait_parity(acc.extra["bar"], step % 2))


@register("read_accumulator", "cuda:sm_100a")
def read_accumulator(acc):
    regs = T.alloc_fragment(acc.shape, acc.dtype)
    emit(T.copy(acc.buf, regs))
    return regs
