"""Hopper (sm_90a): the accumulator lives in registers and T.gemm issues WGMMA
(a warpgroup of 128 threads per 64 rows of the tile)."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator


@register("accumulator", "cuda:sm_90a")
def accumulator(shape, dtype="float32"):
    return Accumulator(T.alloc_fragment(shape, dtype), tuple(shape), dtype)


@register("mma", "cuda:sm_90a")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    return T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=clear)


@register("read_accumulator", "cuda:sm_90a")
def read_accumulator(acc):
    return acc.buf
