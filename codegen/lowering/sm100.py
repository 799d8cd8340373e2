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


@register("read_accumulator", "cuda:sm_100a")
def read_accumulator(acc):
    regs = T.alloc_fragment(acc.shape, acc.dtype)
    emit(T.copy(acc.buf, regs))
    return regs
