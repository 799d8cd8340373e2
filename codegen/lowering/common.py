"""Rules that emit the same TileLang on every target ("*")."""

import contextlib

import tilelang.language as T

from codegen import tile
from codegen.rules import register

_REDUCERS = {"sum": "reduce_sum", "max": "reduce_max", "min": "reduce_min", "absmax": "reduce_absmax"}


@register("row_reduce", "*")
def row_reduce(src, dst, op="sum", dim=-1, clear=True):
    if op not in _REDUCERS:
        raise ValueError(f"row_reduce op must be one of {sorted(_REDUCERS)}, got {op!r}")
    dim = dim % len(src.shape)
    return getattr(T, _REDUCERS[op])(src, dst, dim=dim, clear=clear)


@register("atomic_add", "*")
def atomic_add(dst, value, return_prev=False):
    return T.atomic_add(dst, value, return_prev=return_prev)


@register("cumsum", "*")
def cumsum(src, dst=None, dim=0):
    return T.cumsum(src, dst, dim=dim)


@register("vector", "*")
def vector():
    return contextlib.nullcontext()


@register("storage_dtype", "*")
def storage_dtype(dtype):
    return dtype


@register("to_f32", "*")
def to_f32(x, dtype):
    return T.cast(x, "float32")


@register("from_f32", "*")
def from_f32(x, dtype):
    return T.cast(x, dtype)


@register("copy", "*")
def copy(src, dst):
    return T.copy(src, dst)


@register("store", "*")
def store(src, dst):
    return T.copy(src, dst)


@register("parallel", "*")
def parallel(*extents):
    return T.Parallel(*extents)


@register("pipelined", "*")
def pipelined(n, stages=2):
    return T.Pipelined(n, num_stages=stages)


@register("persistent", "*")
def persistent(total, blocks, bid):
    return T.serial(bid, total, blocks)


@register("split_rows", "*")
def split_rows(rows):
    return rows, 0  # one set of threads holds every row of a tile


@T.macro
def _promote(acc, part, scale):
    p = tile.read_accumulator(part)
    with tile.vector():
        for i, j in tile.parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] += p[i, j] * scale[i]


@register("mma_promoted", "*")
def mma_promoted(a, b, part, acc, scale, transpose_b=True, step=0):
    # DeepGEMM's two-level accumulation: each product lands in a fresh accumulator and is folded
    # into `acc` (a fragment of split_rows rows) with its per-row scale, so low-precision products
    # never sum across scales
    stmt = tile.mma(a, b, part, transpose_b=transpose_b, clear=True, step=step)
    if stmt is not None:
        tile.emit(stmt)
    _promote(acc, part, scale)


@register("producer_threads", "*")
def producer_threads():
    return 0  # the compiler's own pipelining adds any producer threads it wants


@T.macro
def _promoted_loop(steps, loads, tiles, part, acc, scale, scale_of, stages, epilogue):
    with tile.vector():
        for i, j in tile.parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] = 0.0
    for s in tile.pipelined(steps, stages=stages):
        for src, dst in zip(loads(s), tiles):
            tile.copy(src, dst)
        with tile.vector():
            for i in tile.parallel(scale.shape[0]):
                scale[i] = scale_of(i, s)
        tile.mma_promoted(tiles[0], tiles[1], part, acc, scale, step=s)
    epilogue()


@register("mma_promoted_loop", "*")
def mma_promoted_loop(steps, loads, operands, part, acc, scale, scale_of, stages=2, epilogue=None):
    # the plain pipelined loop: each step's MMA is waited for before its promotion; acc starts at 0
    tiles = [tile.operand(shape, dtype) for shape, dtype in operands]
    _promoted_loop(steps, loads, tiles, part, acc, scale, scale_of, stages, epilogue or (lambda: None))
