"""Ascend 950 attention_loop: the Cube scores and multiplies, the two vector cores of the AI core do the
rest, each on its half of the rows (tile.split_rows).

The Cube takes a B operand from L1 only as an (N, K) tile (trans_B, "NT"), and L1 lays a tile out for the
one MMA that reads it: so K is one L1 tile (tokens x columns) and V^T another (columns x tokens). Per step
k (block_n tokens):
  1. staging. The cache's own dtype: K goes straight from the cache into L1 (rows past the end may hold
     anything, NaN in the tests: their scores are masked to -inf); each vector core copies its half of
     each value part's columns, every token, into UB, transposes it with the rows past the end zeroed
     (0 * NaN in P @ V is NaN), and a dual copy puts both halves of V^T into L1. Raw bytes (value=, the
     FP8 cache): each vector core copies the whole raw step into UB and converts its half of the tokens
     for K and its half of the columns for V^T (zeroed past the end), both into L1 by dual copies;
  2. the Cube scores S = sum_p q[p] @ K[p]^T into L0C; a dual copy gives each vector core its half of the
     query rows of S in UB;
  3. each vector core runs the online softmax (common.online_softmax) on its rows, the row statistics in
     UB; P (its rows, in the operand dtype) goes into L1 by a dual copy;
  4. the Cube multiplies P by each V^T part into L0C and the vector cores fold the product into the
     running output in UB (the mma_rescaled rule), which the epilogue reads.
The scheduling between the Cube and the vector cores (flags, buffers) is TileLang's Ascend auto-schedule
of the pipelined loop. Generated Ascend C only: no Ascend device has run it."""

import tilelang.ascend.language as A
from codegen import tile
from codegen.lowering.ascend import narrow
from codegen.lowering.common import online_softmax
from codegen.rules import register
from codegen.tile import emit, state


@register("attention_loop", "ascend")
def attention_loop(steps, q, kv, v, loads, visible, scale, epilogue, *, valid_rows, raw=None, value=None, stages=2,
                   raw_stages=2, zero_every_step=False, trace=None, swapped=False, raw_rows=None, stage_raw=False,
                   direct=None, all_visible=None, seesaw=False, own_p=False, units=None, lazy=0.0):
    if (swapped or raw_rows is not None or stage_raw or direct is not None or seesaw or own_p or trace is not None
            or units is not None or lazy):
        raise ValueError("attention_loop(swapped=True, raw_rows=, stage_raw=, direct=, seesaw=True, own_p=True, "
                         "trace=, units=, lazy=) is lowered on cuda:sm_90a only, not on "
                         "ascend:950")
    if getattr(value, "row_scales", None) is not None:
        raise ValueError("attention_loop: a value with row_scales (folded into the MMAs) is lowered on cuda:sm_90a "
                         "with swapped=True only")
    block_m, block_n = int(q[0].shape[0]), int(kv[0][0])
    mine, first = tile.split_rows(block_m)           # this vector core's query rows
    toks, tok0 = tile.split_rows(block_n)            # its tokens of a step (the scores' B operand)
    threads = state().get("threads", 128)
    # L1 takes B operands as (N, K) tiles (the Cube's NT form): K itself for the scores, V^T for P @ V
    k_l1 = [tile.operand((rows, d), dt) for rows, d, dt in kv]
    vt_l1 = [tile.operand((kv[p][1], block_n), kv[p][2]) for p in v]
    # V^T by rows: each vector core transposes its half of each value part's columns, for every token
    halves = [tile.split_rows(kv[p][1]) for p in v]
    vt_ub = [tile.stage((h, block_n), kv[p][2]) for (h, _), p in zip(halves, v)]
    if raw is None:   # this core's columns of the value parts, every token
        v_ub = [tile.stage((block_n, h), kv[p][2]) for (h, _), p in zip(halves, v)]
    else:             # the raw step, every token; K converted by token halves
        raw_ub = [tile.stage((block_n, shape[1]), dt) for shape, dt in raw]
        k_ub = [tile.stage((toks, d), dt) for _, d, dt in kv]
    acc_s = tile.accumulator((block_m, block_n))
    s_ub = tile.stage((mine, block_n), "float32")
    p_dt = kv[v[0]][2]
    p_ub = tile.stage((mine, block_n), p_dt)
    p_l1 = tile.operand((block_m, block_n), p_dt)
    outs = []
    tmp = {}
    for p in v:   # the running outputs live in UB (mma_rescaled's rule), allocated here, outside the loop;
        # the parts' products land in UB one after the other: one scratch tile per width
        acc = tile.accumulator((block_m, kv[p][1]))
        acc.extra["ub"] = A.alloc_shared((mine, kv[p][1]), acc.dtype)
        if kv[p][1] not in tmp:
            tmp[kv[p][1]] = A.alloc_shared((mine, kv[p][1]), acc.dtype)
        acc.extra["tmp"] = tmp[kv[p][1]]
        outs.append(acc)
    m_i, m_prev, alpha, row_sum, l_i = (tile.fragment((mine,)) for _ in range(5))   # UB: outside any region

    def prepare(k):
        valid = valid_rows - k * block_n
        if raw is None:
            # K straight into L1: rows past the end may hold anything (NaN), their scores are masked
            # to -inf; V^T through UB, where those rows are zeroed (0 * NaN in P @ V is NaN)
            for src, part, row0, rows in loads(k):
                emit(A.copy(src, k_l1[part][row0:row0 + rows, :]))
                if part in v:
                    idx = v.index(part)
                    h, c0 = halves[idx]
                    emit(A.copy(narrow(src, -1, c0, h), v_ub[idx][row0:row0 + rows, :]))
            for idx in range(len(v)):
                _transpose(vt_ub[idx], _reader(v_ub[idx]), valid, threads)
        else:
            for src, part, row0, rows in loads(k):
                emit(A.copy(src, raw_ub[part][row0:row0 + rows, :]))

            def read(raw_part, i, j):
                return raw_ub[raw_part][i, j]

            for p in range(len(kv)):
                _convert_rows(k_ub[p], p, read, value, tok0, threads)
                emit(A.dual_copy(k_ub[p], k_l1[p]))
            for idx, p in enumerate(v):
                _transpose(vt_ub[idx], _converted(value, p, read, halves[idx][1]), valid, threads)
        for idx in range(len(v)):
            emit(A.dual_copy(vt_ub[idx], vt_l1[idx]))

    def scores():
        for p, (qt, kt) in enumerate(zip(q, k_l1)):
            emit(A.gemm(qt, kt, acc_s.buf, transpose_B=True, clear_accum=(p == 0)))
        emit(A.dual_copy(acc_s.buf, s_ub))

    def values_mma(k):
        for idx in range(len(v)):
            tile.mma_rescaled(p_l1, vt_l1[idx], outs[idx], alpha, transpose_b=True, step=k)

    _init(m_i, l_i, alpha, threads)
    _loop(steps, stages, prepare, scores, values_mma, s_ub, p_ub, p_l1, lambda k, i, j: visible(k, first + i, j),
          scale, m_i, m_prev, alpha, row_sum, l_i, threads)
    col = 0
    for idx, p in enumerate(v):
        epilogue(tile.read_accumulator(outs[idx]), col, l_i, m_i, idx == 0)
        col += kv[p][1]


def _reader(buf):
    return lambda i, j: buf[i, j]


def _converted(value, part, read, c0):
    # (token, column) of this core's columns (from c0) of operand part `part`, converted from the raw step
    return lambda i, j: value(part, i, c0 + j, read)


@A.macro
def _init(m_i, l_i, alpha, threads):
    with A.SimtVF(threads=threads):
        for i in A.Parallel(m_i.shape[0]):
            m_i[i] = -A.infinity("float32")
            l_i[i] = 0.0
            alpha[i] = 0.0


@A.macro
def _transpose(vt, at, valid, threads):
    # vt (columns, tokens) = at(token, column)^T, tokens past `valid` zeroed
    with A.SimtVF(threads=threads):
        for j, i in A.Parallel(vt.shape[0], vt.shape[1]):
            vt[j, i] = A.if_then_else(i < valid, at(i, j), A.cast(0, vt.dtype))


@A.macro
def _convert_rows(dst, part, read, value, tok0, threads):
    # this core's tokens (from tok0) of operand part `part`, converted from the raw step (rows past the end:
    # whatever the conversion gives, their scores are masked)
    with A.SimtVF(threads=threads):
        for i, j in A.Parallel(dst.shape[0], dst.shape[1]):
            dst[i, j] = value(part, tok0 + i, j, read)


@A.macro
def _loop(steps, stages, prepare, scores, values_mma, s_ub, p_ub, p_l1, visible, scale, m_i, m_prev, alpha, row_sum,
          l_i, threads):
    for k in A.Pipelined(steps, num_stages=stages):
        prepare(k)
        scores()
        with A.SimtVF(threads=threads):
            online_softmax(k, s_ub, visible, scale, m_i, m_prev, alpha, row_sum, l_i)
            for i, j in A.Parallel(p_ub.shape[0], p_ub.shape[1]):
                p_ub[i, j] = A.cast(s_ub[i, j], p_ub.dtype)
        A.dual_copy(p_ub, p_l1)
        values_mma(k)
