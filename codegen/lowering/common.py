"""Rules that emit the same TileLang on every target ("*")."""

import contextlib
import functools
import operator

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


@register("reciprocal", "*")
def reciprocal(x):
    return 1.0 / x


@register("scalar", "*")
def scalar(value, dtype="int32"):
    # the compiler's automatic warp specialization needs no variable here (a local defined before
    # its producer/consumer split even stops it from rebalancing registers): keep the expression
    return value


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
                scale[i] = functools.reduce(operator.mul, scale_of(i, s))
        tile.mma_promoted(tiles[0], tiles[1], part, acc, scale, step=s)
    epilogue()


@T.macro
def _promoted_columns_loop(steps, loads, tiles, part, acc, scale, scale_of, stages, epilogue):
    # _promoted_loop for a tile of len(acc) column passes: B's stage in len(acc) slices, each
    # multiplied into `part` and promoted into its own acc[p] with that pass's scale
    _zero_all(acc)
    for s in tile.pipelined(steps, stages=stages):
        for src, dst in zip(loads(s), tiles):
            tile.copy(src, dst)
        _column_passes(tiles, part, acc, scale, scale_of, s)
    epilogue()


def _zero_all(acc):
    for a in acc:
        _zero(a)


@T.macro
def _zero(acc):
    with tile.vector():
        for i, j in tile.parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] = 0.0


def _column_passes(tiles, part, acc, scale, scale_of, s):
    a_s, b_s = tiles
    width = b_s.shape[0] // len(acc)
    for p, acc_p in enumerate(acc):
        _pass_scale(scale, scale_of, s, len(acc), p)
        tile.mma_promoted(a_s, b_s[p * width:(p + 1) * width, :], part, acc_p, scale, step=s)


@T.macro
def _pass_scale(scale, scale_of, s, columns, p):
    with tile.vector():
        for i in tile.parallel(scale.shape[0]):
            scale[i] = functools.reduce(operator.mul, pass_factors(scale_of(i, s), columns, p))


def pass_factors(factors, columns: int, p: int) -> list:
    """The factors of column pass p's scale, of scale_of's factors where a tile runs `columns` column
    passes: the common ones (all but the last `columns`) and pass p's own (the last `columns`, one a
    pass)."""
    common = len(factors) - columns
    return [*factors[:common], factors[common + p]]


def epilogue_call(epilogue, stage):
    """mma_promoted_loop's epilogue as a no-argument callable: epilogue(stage) where the loop was asked
    for an epilogue_stage (stage is its tile), epilogue() otherwise, nothing for None."""
    if epilogue is None:
        return lambda: None
    return epilogue if stage is None else (lambda: epilogue(stage))


def scale_factors(scale_of):
    """mma_promoted_loop's scale_of(row, blk) returns the factors of a row's scale for K block blk
    (a tuple; their product is the scale). Calls it once with placeholder indices to count them."""
    factors = scale_of(0, 0)
    if not isinstance(factors, (tuple, list)) or not factors:
        raise TypeError(f"mma_promoted_loop's scale_of(row, blk) must return a tuple of the scale's factors, got "
                        f"{type(factors).__name__}")
    return factors


def prologue_parts(prologue) -> tuple:
    """mma_promoted_loop's prologue: None, a callable, or (issue, finish): issue() starts the
    prologue's global loads (into registers), finish() uses them (stores into shared memory)."""
    if prologue is None:
        return ()
    if callable(prologue):
        return (prologue,)
    if isinstance(prologue, tuple) and len(prologue) == 2 and all(callable(f) for f in prologue):
        return prologue
    raise TypeError(f"mma_promoted_loop's prologue must be a callable or a pair (issue, finish) of callables, "
                    f"got {prologue!r}")


@register("mma_promoted_loop", "*")
def mma_promoted_loop(steps, loads, operands, part, acc, scale, scale_of, stages=2, epilogue=None, prologue=None,
                      share_a=1, mark=None, epilogue_stage=None, side=None):
    # the plain pipelined loop: each step's MMA is waited for before its promotion; acc starts at 0.
    # share_a (blocks of a cluster with the same A tiles) only lets sm_90a multicast them: each block
    # loads its own here. mark (a trace's stamps): sm_90a's rule only. epilogue_stage: a tile of its
    # own here (sm_90a lays it over the operand stages)
    if side is not None:
        raise ValueError("mma_promoted_loop(side=...) loads by a TMA producer (cuda:sm_90a); this target has none: "
                         "stage the operand in the prologue instead")
    for part_of in prologue_parts(prologue):
        part_of()                       # every thread, before the loop (the sync pass orders it)
    tiles = [tile.operand(shape, dtype) for shape, dtype in operands]
    # acc a tuple: column passes over B's stage (one slice a fragment)
    loop = _promoted_columns_loop if isinstance(acc, tuple) else _promoted_loop
    loop(steps, loads, tiles, part, acc, scale, scale_of, stages,
         epilogue_call(epilogue, None if epilogue_stage is None else tile.stage(*epilogue_stage)))


# ---- mma_decoded_loop: a GEMM whose B tile is decoded on chip from a raw staged one ----------------

@T.macro
def _decoded_loop(steps, loads, a_s, raw, b_s, acc, decode, raw_at, b_at, stages, epilogue):
    for s in tile.pipelined(steps, stages=stages):
        src_a, src_raw = loads(s)
        tile.copy(src_a, a_s)
        tile.copy(src_raw, raw)
        decode(raw_at, b_at, s)
        # clear at the first step (a TMEM accumulator on sm_100a cannot be zero-filled by stores)
        tile.mma(a_s, b_s, acc, transpose_b=True, clear=(s == 0), step=s)
    epilogue()


@register("mma_decoded_loop", "*")
def mma_decoded_loop(steps, loads, operands, acc, decode, stages=2, prologue=None, epilogue=None, swizzle_raw=False):
    # the plain pipelined loop: decode, then the MMA, then the next step's decode (swizzle_raw: sm_90a's TMA layout)
    if prologue is not None:
        prologue()                      # every thread, before the loop (the sync pass orders it)
    (a_shape, a_dtype), (raw_shape, raw_dtype), (b_shape, b_dtype) = operands
    a_s = tile.operand(a_shape, a_dtype)
    raw = tile.stage(raw_shape, raw_dtype)
    b_s = tile.operand(b_shape, b_dtype)
    _decoded_loop(steps, loads, a_s, raw, b_s, acc, decode, lambda i, j: raw[i, j], lambda i, j: b_s[i, j], stages,
                  epilogue or (lambda: None))


# ---- import_cuda_helpers: device helper source for CUDA targets ------------------------------------

@register("import_cuda_helpers", "*")
def import_cuda_helpers(text):
    return T.import_source(text)


# ---- mma_block_scaled_loop: only where tensor cores take block scales --------------------------

@register("mma_block_scaled_loop", "*")
def mma_block_scaled_loop(steps, loads, scale_loads, operands, acc, scale_k=32, stages=2, epilogue=None,
                          scale_dtype="int32"):
    raise ValueError("mma_block_scaled_loop needs block-scaled tensor cores (cuda:sm_100a, ascend:950); this "
                     "target has none: decode the operands instead (tile.mma_decoded_loop)")


# ---- mma_register_decoded_loop: only where the MMA takes an operand from registers ---------------

@register("mma_register_decoded_loop", "*")
def mma_register_decoded_loop(steps, loads, operands, acc, decode, **options):
    raise ValueError("mma_register_decoded_loop needs an MMA that reads an operand from registers in a fixed "
                     "fragment layout (cuda:sm_90a); elsewhere decode into a tile (tile.mma_decoded_loop)")


# ---- fill_operands: operand tiles written value by value -------------------------------------------

@register("fill_operands", "*")
def fill_operands(tiles, row_of, values, vector=1):
    # the threads write the tiles, `vector` columns at once; two tiles of one shape share the loop
    rows, width = (int(e) for e in tiles[0].shape)
    if width % vector or len(tiles) not in (1, 2) or len(values) != len(tiles):
        raise ValueError(f"fill_operands takes one or two tiles with a value each and a width that is a multiple of "
                         f"vector={vector}; got {len(tiles)} tiles, {len(values)} values, width {width}")
    if len(tiles) == 1:
        _fill_one(tiles[0], row_of, values[0], rows, width, vector)
    else:
        _fill_pair(tiles[0], tiles[1], row_of, values[0], values[1], rows, width, vector)


@T.macro
def _fill_one(t, row_of, value, rows, w, vec):
    for i, jv in tile.parallel(rows, w // vec):
        r = row_of(i)
        for v in T.vectorized(vec):
            t[i, jv * vec + v] = value(r, jv * vec + v)


@T.macro
def _fill_pair(t0, t1, row_of, value0, value1, rows, w, vec):
    for i, jv in tile.parallel(rows, w // vec):
        r = row_of(i)
        for v in T.vectorized(vec):
            t0[i, jv * vec + v] = value0(r, jv * vec + v)
            t1[i, jv * vec + v] = value1(r, jv * vec + v)


# ---- attention_loop: online-softmax attention over staged KV steps --------------------------------

def _emit_maybe(stmt):
    if stmt is not None:  # some rules emit their statements themselves and return None
        tile.emit(stmt)


def _stage_step(loads, k, dst):
    for src, part, row0, rows in loads(k):
        tile.emit(tile.copy(src, dst[part][row0:row0 + rows, :]))


@T.macro
def _zero_tail(buf, valid, every_step):
    # rows past `valid` hold whatever the cache had (NaN in the tests): P is 0 there, but 0 * NaN in
    # P @ V is not. A select that reads the staged tile, so it lands after the copy in the MMA warps
    if every_step:
        # TileLang 0.1.15 cannot place the barriers of the guarded form below in some programs
        # ([ThreadSync] divergent region): the caller asks for the select every step there
        for i in T.serial(buf.shape[0]):
            for j in tile.parallel(buf.shape[1]):
                buf[i, j] = T.if_then_else(i < valid, buf[i, j], T.cast(0, buf.dtype))
    else:
        if valid < buf.shape[0]:
            for i in T.serial(buf.shape[0]):
                for j in tile.parallel(buf.shape[1]):
                    buf[i, j] = T.if_then_else(i < valid, buf[i, j], T.cast(0, buf.dtype))


@T.macro
def _convert_part(buf, p, read, value, valid):
    for i, j in tile.parallel(buf.shape[0], buf.shape[1]):
        buf[i, j] = T.if_then_else(i < valid, value(p, i, j, read), T.cast(0, buf.dtype))


def _prepare_step(loads, k, kv, raw, value, v, valid, every_step):
    if raw is None:
        _stage_step(loads, k, kv)
        for p in v:
            _zero_tail(kv[p], valid, every_step)
    else:
        _stage_step(loads, k, raw)

        def read(part, i, j):
            return raw[part][i, j]

        for p, buf in enumerate(kv):
            _convert_part(buf, p, read, value, valid)


def _score_mmas(q, kv, acc_s, k):
    for p, (qt, kt) in enumerate(zip(q, kv)):
        _emit_maybe(tile.mma(qt, kt, acc_s, transpose_b=True, clear=(p == 0), step=len(q) * k + p))


def _pv_mmas(p_s, kv, v, outs, alpha, k):
    for idx, p in enumerate(v):
        _emit_maybe(tile.mma_rescaled(p_s, kv[p], outs[idx], alpha, transpose_b=False, step=k))


def _factor(m_old, m_new, exp2, lazy):
    # what rescales the accumulated row when its max goes from m_old to m_new; lazy: exactly 1 when it stayed
    e = exp2(m_old - m_new)
    return T.if_then_else(m_new == m_old, 1.0, e) if lazy > 0 else e


@T.macro
def online_softmax(k, s, visible, scale, m_i, m_prev, alpha, row_sum, l_i, exp2=T.exp2, all_visible=None, lazy=0.0):
    """Scores s (rows, cols) of step k -> P in place, with the running row max m_i, the factor alpha
    that rescales what was accumulated before, and the running row sum l_i (log2 domain; scale > 0).
    Shared by every attention_loop rule; exp2: a target's own (e.g. sm_90a's one-instruction
    approximation); all_visible(k): a condition under which every score of step k is visible (no
    mask at all: most steps of a decode); lazy > 0: the running max moves only when a row's max grows by more
    than lazy (log2 units), so most steps keep it and their alpha is exactly 1 (the P of those steps are up to
    2^lazy, the same products in another scale: FlashAttention-4's conditional rescaling)."""
    # the scale goes into the exponent's FMA (max(s) * scale is the max of the scaled scores), and a
    # step that all_visible says is whole skips the mask's compare and select: bench/NOTES.md "MLA v13"
    if all_visible is None:
        _mask(k, s, visible)
    else:
        _mask_unless(k, s, visible, all_visible(k))
    T.copy(m_i, m_prev)
    tile.row_reduce(s, row_sum, "max", dim=1)
    for i in tile.parallel(s.shape[0]):
        m_i[i] = T.max(m_prev[i], row_sum[i] * scale)
    if lazy > 0:
        # (-inf - -inf is NaN: a row with nothing visible yet keeps -inf)
        for i in tile.parallel(s.shape[0]):
            m_i[i] = T.if_then_else(m_i[i] - m_prev[i] > lazy, m_i[i], m_prev[i])
    # m_prev becomes the max to subtract: a row with no visible score yet (max -inf, every score -inf)
    # subtracts 0, so exp2 gives 0 without a select per score (on sm_90a that select was a branch
    # around every pair of MUFU.EX2, on WG0's critical path)
    for i in tile.parallel(s.shape[0]):
        alpha[i] = T.if_then_else(m_i[i] == -T.infinity("float32"), 0.0, _factor(m_prev[i], m_i[i], exp2, lazy))
        m_prev[i] = T.if_then_else(m_i[i] == -T.infinity("float32"), 0.0, m_i[i])
    for i, j in tile.parallel(s.shape[0], s.shape[1]):
        s[i, j] = exp2(s[i, j] * scale - m_prev[i])
    tile.row_reduce(s, row_sum, "sum", dim=1)
    for i in tile.parallel(s.shape[0]):
        l_i[i] = l_i[i] * alpha[i] + row_sum[i]


@T.macro
def _mask_unless(k, s, visible, whole):
    # (an empty then-branch: `not whole` is no condition TileLang's macros turn into a runtime if)
    if whole:
        T.evaluate(0)
    else:
        _mask(k, s, visible)


@T.macro
def _mask(k, s, visible):
    for i, j in tile.parallel(s.shape[0], s.shape[1]):
        s[i, j] = T.if_then_else(visible(k, i, j), s[i, j], -T.infinity("float32"))


@T.macro
def _softmax(k, acc_s, visible, scale, m_i, m_prev, alpha, row_sum, l_i, p_s):
    s = tile.read_accumulator(acc_s)
    online_softmax(k, s, visible, scale, m_i, m_prev, alpha, row_sum, l_i)
    tile.copy(s, p_s)


def _finish(outs, kv, v, l_i, m_i, epilogue):
    col = 0
    for idx, p in enumerate(v):
        epilogue(tile.read_accumulator(outs[idx]), col, l_i, m_i, idx == 0)
        col += kv[p].shape[1]


@T.macro
def _attention(steps, loads, q, kv, raw, value, v, valid, visible, scale, acc_s, p_s, outs, m_i, m_prev, alpha,
               row_sum, l_i, stages, every_step, epilogue):
    T.fill(m_i, -T.infinity("float32"))
    T.fill(l_i, 0.0)
    T.fill(alpha, 0.0)
    for k in tile.pipelined(steps, stages=stages):
        _prepare_step(loads, k, kv, raw, value, v, valid(k), every_step)
        _score_mmas(q, kv, acc_s, k)
        _softmax(k, acc_s, visible, scale, m_i, m_prev, alpha, row_sum, l_i, p_s)
        _pv_mmas(p_s, kv, v, outs, alpha, k)
    _finish(outs, kv, v, l_i, m_i, epilogue)


@T.macro
def _set_first(buf, value):
    buf[0] = value


@register("attention_loop", "*")
def attention_loop(steps, q, kv, v, loads, visible, scale, epilogue, *, valid_rows, raw=None, value=None, stages=2,
                   raw_stages=2, zero_every_step=False, trace=None, swapped=False, raw_rows=None, stage_raw=False,
                   direct=None, all_visible=None, seesaw=False, own_p=False, units=None, lazy=0.0):
    # the compiler's pipelined loop: copies (and any conversion) then S, softmax, O += P V per step;
    # `trace` (per-step clock stamps) is recorded only by the hand-written sm_90a pipeline;
    # all_visible is a hint this loop does not need (it masks every step)
    if (swapped or raw_rows is not None or stage_raw or direct is not None or seesaw or own_p or units is not None
            or lazy):
        raise ValueError("attention_loop(swapped=True, raw_rows=, stage_raw=, direct=, seesaw=True, own_p=True, units=, "
                         "lazy=) is lowered on cuda:sm_90a only")
    if getattr(value, "row_scales", None) is not None:
        raise ValueError("attention_loop: a value with row_scales (folded into the MMAs) is lowered on cuda:sm_90a "
                         "with swapped=True only")
    block_m, block_n = q[0].shape[0], kv[0][0]
    # the count in registers: the zeroing that reads it then lands in the MMA warps, after the copy
    # (a count computed from a global read is given to the producer warps, before the data lands)
    valid_s = tile.fragment((1,), "int32")
    _set_first(valid_s, valid_rows)
    kv_t = [tile.operand((rows, d), dt) for rows, d, dt in kv]
    raw_t = None if raw is None else [tile.stage(shape, dt) for shape, dt in raw]
    p_s = tile.operand((block_m, block_n), kv[v[0]][2])
    acc_s = tile.accumulator((block_m, block_n))
    outs = [tile.accumulator((block_m, kv[p][1])) for p in v]
    m_i, m_prev, alpha, row_sum, l_i = (tile.fragment((block_m,)) for _ in range(5))
    _attention(steps, loads, q, kv_t, raw_t, value, v, lambda k: valid_s[0] - k * block_n, visible, scale, acc_s, p_s,
               outs, m_i, m_prev, alpha, row_sum, l_i, stages, zero_every_step, epilogue)
