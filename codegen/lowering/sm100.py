"""Blackwell (sm_100a): the accumulator lives in tensor memory; tcgen05 MMAs complete on an
mbarrier whose phase the accumulator tracks. A plain T.gemm here would fall back to HMMA."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator


@T.macro
def _wait_and_flip(bar, phase):
    T.mbarrier_wait_parity(bar, phase[0])
    phase[0] = phase[0] ^ 1


@register("accumulator", "cuda:sm_100a")
def accumulator(shape, dtype="float32"):
    buf = T.alloc_tmem(list(shape), dtype)
    bar = T.alloc_barrier(1)
    phase = T.alloc_local((1,), "int32")
    T.fill(phase, 0)
    return Accumulator(buf, tuple(shape), dtype, {"bar": bar, "phase": phase})


@register("mma", "cuda:sm_100a")
def mma(a, b, acc, transpose_b=True, clear=False):
    T.tcgen05_gemm(a, b, acc.buf, False, transpose_b, mbar=acc.extra["bar"], clear_accum=clear)
    _wait_and_flip(acc.extra["bar"], acc.extra["phase"])


@register("read_accumulator", "cuda:sm_100a")
def read_accumulator(acc):
    regs = T.alloc_fragment(acc.shape, acc.dtype)
    T.copy(acc.buf, regs)
    return regs
