"""Hopper (sm_90a): the accumulator lives in registers and T.gemm issues WGMMA
(a warpgroup of 128 threads per 64 rows of the tile)."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator, emit


def _policy(acc):
    # 64-row tiles: every warpgroup takes all rows and a slice of the columns (WGMMA's M is 64)
    return T.GemmWarpPolicy.FullCol if acc.shape[0] <= 64 else T.GemmWarpPolicy.Square


@register("limits", "cuda:sm_90a")
def limits():
    return {"smem_bytes": 227 * 1024, "accumulator_columns": None, "sms": 132}


@register("accumulator", "cuda:sm_90a")
def accumulator(shape, dtype="float32"):
    return Accumulator(T.alloc_fragment(shape, dtype), tuple(shape), dtype)


@register("mma", "cuda:sm_90a")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    return T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=clear, policy=_policy(acc))


@T.macro
def _scale_rows(frag, row_scale):
    for i, j in T.Parallel(frag.shape[0], frag.shape[1]):
        frag[i, j] *= row_scale[i]


@register("mma_rescaled", "cuda:sm_90a")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    _scale_rows(acc.buf, row_scale)  # at step 0 clear_accum discards whatever this produced
    emit(T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=(step == 0), policy=_policy(acc)))


@register("read_accumulator", "cuda:sm_90a")
def read_accumulator(acc):
    return acc.buf
