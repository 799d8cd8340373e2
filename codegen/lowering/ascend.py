"""Ascend 950 (dav-3510): a 1-D grid of AI cores; vector work runs inside T.SimtVF regions with
their own thread count; matrix operands sit in L1 and the Cube accumulates into L0C."""

import tilelang.ascend.language as A
from tvm import ir, tirx
from tilelang.ascend.language.kernel import _get_current_simtvf

from codegen.rules import register
from codegen.tile import Accumulator, emit, split_index, state


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
    # Each vector region becomes its own SIMT function, so registers do not outlive one: a fragment
    # allocated outside a region (read by several) lives in UB, the memory they all share.
    if _get_current_simtvf() is None:
        return A.alloc_shared(shape, dtype)
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


@register("split_rows", "ascend")
def split_rows(rows):
    # an accumulator read gives each of the AI core's two vector cores half the rows (dual copy)
    if rows % 2:
        raise ValueError(f"on Ascend a tile split over the two vector cores needs an even row count, got {rows}")
    half = rows // 2
    return half, A.call_extern("int32", "asc_get_sub_block_id") * half


@register("mma_promoted", "ascend")
def mma_promoted(a, b, part, acc, scale, transpose_b=True, step=0):
    # The Cube writes each product into L0C (cleared), the FixPipe hands each vector core its half
    # of the rows in UB, and vector code folds it into `acc` (split_rows rows) with the row scales.
    rows = part.shape[0]
    if tuple(acc.shape) != (rows // 2, *part.shape[1:]) or tuple(scale.shape) != (rows // 2,):
        raise ValueError(f"mma_promoted on Ascend folds into a tile of split_rows({rows}) rows: acc must be "
                         f"{(rows // 2, *part.shape[1:])} and scale {(rows // 2,)}, got {tuple(acc.shape)} and {tuple(scale.shape)}")
    if "tmp" not in part.extra:
        part.extra["tmp"] = A.alloc_shared((rows // 2, *part.shape[1:]), part.dtype)
    tmp = part.extra["tmp"]
    emit(A.gemm(a, b, part.buf, transpose_B=transpose_b, clear_accum=True), A.dual_copy(part.buf, tmp))
    _promote(acc, tmp, scale, state().get("threads", 128))


@A.macro
def _promote(acc, tmp, scale, threads):
    with A.SimtVF(threads=threads):
        for i, j in A.Parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] += tmp[i, j] * scale[i]


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
    if _get_current_simtvf() is not None:
        regions = _simt_copy_regions(src, dst)
        if regions is not None:
            _simt_copy(*regions)
            return None
    return A.copy(src, dst)


def _simt_copy_regions(src, dst):
    # Inside a vector region a copy is per-thread loads and stores. TileLang's own SIMT copy
    # cannot match a source region clipped against a symbolic tensor shape (Scores[r, c*n:(c+1)*n]
    # with dynamic columns), so the rule writes the guarded loop itself when both sides are regions
    # with the same static non-unit extents.
    from tilelang.utils.language import to_buffer_region

    try:
        s, d = to_buffer_region(src), to_buffer_region(dst)
    except ValueError:
        return None
    s_axes = [i for i, r in enumerate(s.region) if _const(r.extent) != 1]
    d_axes = [i for i, r in enumerate(d.region) if _const(r.extent) != 1]
    extents = [_const(d.region[i].extent) for i in d_axes]
    if len(s_axes) != len(d_axes) or None in extents:
        return None
    if any(_const(s.region[a].extent) not in (None, e) for a, e in zip(s_axes, extents)):
        return None
    return s, s_axes, d, d_axes, extents


def _const(e):
    if isinstance(e, int):
        return e
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def _region_index(region, axes, idx):
    out = [r.min for r in region.region]
    for ax, i in zip(axes, idx):
        out[ax] = out[ax] + i
    return out


def _in_bounds(region, axes, idx):
    index = _region_index(region, axes, idx)
    conds = [index[ax] < region.buffer.shape[ax] for ax in axes]
    cond = conds[0]
    for c in conds[1:]:
        cond = tirx.And(cond, c)
    return cond


def _simt_copy(s, s_axes, d, d_axes, extents):
    total = 1
    for e in extents:
        total *= e
    _simt_copy_loop(s, s_axes, d, d_axes, tuple(extents), total)


@A.macro
def _simt_copy_loop(s, s_axes, d, d_axes, extents, total):
    for e in A.Parallel(total):
        idx = split_index(e, extents)
        if _in_bounds(d, d_axes, idx):
            d.buffer[tuple(_region_index(d, d_axes, idx))] = A.if_then_else(
                _in_bounds(s, s_axes, idx), s.buffer[tuple(_region_index(s, s_axes, idx))], A.cast(0, d.buffer.dtype))


@register("row_reduce", "ascend")
def row_reduce(src, dst, op="sum", dim=-1, clear=True):
    fn = {"sum": A.reduce_sum, "max": A.reduce_max, "min": A.reduce_min, "absmax": A.reduce_absmax}.get(op)
    if fn is None:
        raise ValueError(f"row_reduce op must be sum, max, min or absmax, got {op!r}")
    return fn(src, dst, dim=dim % len(src.shape), clear=clear)


@register("cumsum", "ascend")
def cumsum(src, dst=None, dim=0):
    # TileLang has no tl.cumsum for Ascend: a Hillis-Steele scan over UB inside the vector region
    # (log2(n) rounds, each a parallel step into a scratch tile and back)
    if len(src.shape) != 1 or dim not in (0, -1):
        raise ValueError(f"cumsum on Ascend handles 1-D tiles only, got shape {tuple(src.shape)}, dim={dim}")
    if _get_current_simtvf() is None:
        raise ValueError("cumsum on Ascend runs inside a vector region (with tile.vector():)")
    n = int(src.shape[0])
    dst = src if dst is None else dst
    tmp = A.alloc_shared((n,), dst.dtype)
    offsets = []
    off = 1
    while off < n:
        offsets.append(off)
        off *= 2
    _scan(src, dst, tmp, n, offsets)


@A.macro
def _scan(src, dst, tmp, n, offsets):
    for t in A.Parallel(n):
        tmp[t] = src[t]
    for off in offsets:  # unrolled while tracing: each round reads the last one's tile
        for t in A.Parallel(n):
            dst[t] = A.if_then_else(t >= off, tmp[t] + tmp[A.max(t - off, 0)], tmp[t])
        for t in A.Parallel(n):
            tmp[t] = dst[t]
    if len(offsets) == 0:
        for t in A.Parallel(n):
            dst[t] = tmp[t]


@register("atomic_add", "ascend")
def atomic_add(dst, value, return_prev=False):
    # TileLang's Ascend codegen prints an index that needs statements (a select over a reinterpret,
    # say) inside the call's argument list, which is not C: compute such an index first.
    if isinstance(dst, tirx.BufferLoad) and not all(isinstance(i, (tirx.Var, tirx.IntImm)) for i in dst.indices):
        slots = []
        for i in dst.indices:
            if isinstance(i, (tirx.Var, tirx.IntImm)):
                slots.append(i)
                continue
            var = A.alloc_local((1,), i.dtype)
            emit(tirx.BufferStore(var, i, [0]))
            slots.append(tirx.BufferLoad(var, [0]))
        dst = tirx.BufferLoad(dst.buffer, slots)
    return A.atomic_add(dst, value, return_prev=return_prev)


@register("fill_operands", "ascend")
def fill_operands(tiles, row_of, values, vector=1):
    # L1 takes no stores from vector code: each vector core computes its half of the rows in UB, and a
    # dual copy puts both halves into the L1 tile
    rows = int(tiles[0].shape[0])
    half, first = split_rows(rows)
    threads = state().get("threads", 128)
    for t, value in zip(tiles, values):
        ub = A.alloc_shared((half, *t.shape[1:]), t.dtype)
        _fill_half(ub, row_of, value, first, threads)
        emit(A.dual_copy(ub, t))


@A.macro
def _fill_half(ub, row_of, value, first, threads):
    with A.SimtVF(threads=threads):
        for i, j in A.Parallel(ub.shape[0], ub.shape[1]):
            ub[i, j] = value(row_of(first + i), j)


@register("import_cuda_helpers", "ascend")
def import_cuda_helpers(text):
    # CUDA helper text has no place in Ascend C: a program that imports it calls those helpers only on its
    # CUDA paths (e.g. a decode whose Ascend form is plain TileLang)
    return None


def narrow(region, axis, start, extent):
    """The region with axis `axis` narrowed to [start, start + extent) of its own range (rules that copy part of a
    tile's rows or columns: each vector core's half)."""
    ranges = list(region.region)
    ranges[axis] = ir.Range.from_min_extent(ranges[axis].min + start, extent)
    return tirx.BufferRegion(region.buffer, ranges)
