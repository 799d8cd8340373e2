"""Ascend 950 (dav-3510): a 1-D grid of AI cores; vector work runs inside T.SimtVF regions with
their own thread count; matrix operands sit in L1 and the Cube accumulates into L0C."""

import tilelang.ascend.language as A

from codegen.rules import register
from codegen.tile import Accumulator, emit, state


@register("grid", "ascend")
def grid(blocks, threads=128):
    state()["threads"] = threads  # used by vector(): Ascend sets threads per vector region
    return A.Kernel(blocks)


@register("vector", "ascend")
def vector():
    return A.SimtVF(threads=state().get("threads", 128))


@register("persistent", "ascend")
def persistent(total, blocks, bid):
    return A.Persistent([total], blocks, bid)


@register("fragment", "ascend")
def fragment(shape, dtype="float32"):
    return A.alloc_fragment(shape, dtype)


@register("stage", "ascend")
def stage(shape, dtype):
    return A.alloc_shared(shape, dtype)  # Unified Buffer


@register("operand", "ascend")
def operand(shape, dtype):
    return A.alloc_l1(shape, dtype)


@register("accumulator", "ascend")
def accumulator(shape, dtype="float32"):
    return Accumulator(A.alloc_l0c(shape, dtype), tuple(shape), dtype)


@register("mma", "ascend")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    return A.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=clear)


@register("limits", "ascend")
def limits():
    return {"smem_bytes": 248 * 1024, "accumulator_columns": None, "sms": 32, "l0c_bytes": 256 * 1024}


@register("mma_rescaled", "ascend")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    # The Cube cannot rescale L0C, so the running sum lives in the vector cores' UB (half the rows
    # each); every step's product lands in L0C and is folded in by vector code.
    rows = acc.shape[0]
    if "ub" not in acc.extra:
        acc.extra["ub"] = A.alloc_shared((rows // 2, *acc.shape[1:]), acc.dtype)
        acc.extra["tmp"] = A.alloc_shared((rows // 2, *acc.shape[1:]), acc.dtype)
    ub, tmp = acc.extra["ub"], acc.extra["tmp"]
    emit(A.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=True), A.dual_copy(acc.buf, tmp))
    _fold(ub, tmp, row_scale, step, state().get("threads", 128))


@A.macro
def _fold(ub, tmp, row_scale, step, threads):
    with A.SimtVF(threads=threads):
        for i, j in A.Parallel(ub.shape[0], ub.shape[1]):
            ub[i, j] = A.if_then_else(step == 0, tmp[i, j], ub[i, j] * row_scale[i] + tmp[i, j])


@register("read_accumulator", "ascend")
def read_accumulator(acc):
    if "ub" in acc.extra:  # a rescaled accumulator already lives in UB
        state().setdefault("split_tiles", set()).add(acc.extra["ub"].name)
        return acc.extra["ub"]
    # L0C -> UB goes through the FixPipe to both vector cores of the AI core: each gets half the
    # rows. Vector code sees a (rows/2, cols) tile; `store` puts the halves back together.
    rows = acc.shape[0]
    if rows % 2:
        raise ValueError(f"on Ascend an accumulator read by vector code needs an even row count, got {rows}")
    ub = A.alloc_shared((rows // 2, *acc.shape[1:]), acc.dtype)
    emit(A.dual_copy(acc.buf, ub))
    state().setdefault("split_tiles", set()).add(ub.name)
    return ub


@register("store", "ascend")
def store(src, dst):
    if src.name in state().get("split_tiles", ()):
        return A.dual_copy(src, dst)
    return A.copy(src, dst)


@register("copy", "ascend")
def copy(src, dst):
    return A.copy(src, dst)


@register("row_reduce", "ascend")
def row_reduce(src, dst, op="sum", dim=-1, clear=True):
    fn = {"sum": A.reduce_sum, "max": A.reduce_max, "min": A.reduce_min, "absmax": A.reduce_absmax}.get(op)
    if fn is None:
        raise ValueError(f"row_reduce op must be sum, max, min or absmax, got {op!r}")
    return fn(src, dst, dim=dim % len(src.shape), clear=clear)
