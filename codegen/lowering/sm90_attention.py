"""Hopper (sm_90a) attention_loop: a hand-written producer warpgroup and two MMA warpgroups.

    WG0 (threads   0-127)  S = sum_p Q_p K_p^T of step k, the online softmax, O_0 += P V_0
    WG1 (threads 128-255)  O_1 += P V_1 with the P and row scales WG0 leaves in shared memory,
                           while WG0 goes on to the scores of step k + 1
    WG2 (threads 256-383)  TMA loads of each step into `stages` slots; when a step needs fixing
                           after it lands (rows past the valid ones zeroed, or a raw staging format
                           such as an FP8 cache converted to the MMA dtype) it does that too, so the
                           MMA warpgroups never spend instructions on it

Registers: the launch gives 168 a thread at 384 threads; setmaxnreg moves them between warpgroups
(the producer gives some up, the MMA warpgroups take them), and ptxas allocates up to the raised count
in the code a setmaxnreg.inc dominates (tests/test_backends.py checks this). The pool is the launch's
168 x 384, so the counts must add up (check_register_split). There is one producer warpgroup: a
512-thread variant (two producers for the FP8 conversion, 128 registers a thread at launch) failed in
ptxas (C7602) on the 64x256 fp32 accumulators; it was built before the point above was checked, and
has not been retried with setmaxnreg moving the producers' registers to the MMA warpgroups.

TileLang's automatic warp specialization gives the producer only the copies: a fix-up written in
the loop lands in the MMA warps, serialized with both MMAs (FP8 cache at 0.43x the bf16 cache's
speed), and the guarded tail zeroing did not compile for multi-tile causal queries. Softmax in one
warpgroup also needs no cross-warpgroup reduction through shared memory.

Every barrier is placed here by hand: the rule turns TileLang's thread-storage-sync pass off for
the program that uses it (tile.require_pass_configs). With it on, the pass
cannot tell the merged shared buffers apart and puts a producer-wide barrier inside every
iteration of the conversion loop (measured: FP8 decode 0.445 -> 0.402 ms without them).

swapped=True (few query rows, e.g. MLA decode at s_q * h_q <= 32; bench/NOTES.md "MLA v9"): the
tokens are WGMMA's M instead of the query rows. WG0 computes S^T = K Q^T (block_n x rows), moves it
through shared memory into a row-major tile for the same online softmax, and both warpgroups
accumulate O^T += V^T P^T (their value part's columns x rows; V^T read MN-major from the cache
tile), scaled per column by alpha. The epilogue gets O^T and the row statistics in shared memory.
With a raw format staged in chunks (raw_rows, either operand order), two warpgroups convert: the
producer the first half of each step's chunks, WG1 the second half one step ahead of its own O
update. Each converter reloads a raw slot as soon as it has read it (stage_raw: read into registers
first, then converted under the reload).

seesaw=True (plain staging, not swapped; bench/NOTES.md "MLA v13"): the two MMA warpgroups take
turns over the steps, as FlashMLA's "seesaw" schedule does. In each pair of steps (e0, e1) WG0 scores
step e0 and WG1 step e1; the running row max passes WG0 -> WG1 -> WG0 (each softmax starts from the
other's last max), so one warpgroup's softmax runs while the other's MMAs keep the tensor cores busy.
Each warpgroup still owns half of O's columns and updates it with both steps' P: O *= alpha_e0,
O += P_e0 V_e0, O *= alpha_e1, O += P_e1 V_e1. A step's P is written over that step's last kv part
(the rope: read only by the scores, so free once they are done), which must be block_m x block_n.
Each warpgroup keeps its own row sum; the two are added at the end.

Barriers (all mbarriers; parity = use number % 2):
    full[slot]   producer arrivals (+ TMA bytes): the step's operand tiles are ready (swapped with
                 raw chunks: producer + WG1 arrivals, one per converter and step)
    tail         a plain step's rows past the valid ones were zeroed (at most one per CTA: the last)
    raw[r]       arrivals of the warpgroup that loads raw staging slot r + its TMA bytes
    empty[slot]  both MMA warpgroups are done reading the slot
    p_ready / p_free   WG0 -> WG1 hand-off of P and the row scales (one buffer)
    stats        WG0's final row max and sum are in shared memory for WG1's epilogue
    seesaw: full / empty per kv part and slot (a part reloads as soon as its last reader is done);
    ready[0] / ready[1]: step e0's (resp. e1's) P, alpha and row max are written; scored: WG0's
    scores of e0 are done (one use each per pair of steps); named barrier SEESAW_BAR joins both MMA
    warpgroups for the final row sums.
"""

from dataclasses import dataclass
from typing import Any

import tilelang.language as T

from codegen.lowering.common import online_softmax
from codegen.lowering.cuda import reciprocal
from codegen.lowering.sm90 import check_register_split
from codegen.rules import register
from codegen.tile import emit, require_pass_configs, state

WG = 128
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}   # what a program using this rule compiles with
PRODUCER = 128
SCORE_REGS, OUT_REGS, PRODUCER_REGS = 240, 168, 80   # 128 * (240 + 168 + 80) <= 64K registers
NEG_INF = float("-inf")
# named barriers of our own: TileLang reserves 0-2 and numbers any it inserts from 3 up
WG0_BAR, PRODUCER_BAR, WG1_BAR, SEESAW_BAR = 15, 14, 13, 12
# seesaw: both MMA warpgroups hold a 64 x 256 accumulator and a score tile; the producer only issues TMA
SEESAW_REGS, SEESAW_PRODUCER_REGS = 216, 56
FULL_ROW = T.GemmWarpPolicy.FullRow


# trace=: the SM clock (int32 bits) when each warpgroup's first thread reaches an event of step k,
# stored at trace[0, k, EVENTS.index(event)] by CTA 0 for steps < 64 (bench/trace_mla.py reads them).
# The producer's events: its first wait (empty, or the raw bytes when converting), the second (loads
# issued / empty), and the conversion done.
# Swapped with chunked raw staging: WG1 converts too ("wg1 raw": its first raw wait of the step done,
# "wg1 convert": its half converted); the producer's "prod wait1" is then its first raw wait.
# Persistent units (the hand-over from a unit to the next): "wg0 sums" (both warpgroups' last P V done) and "wg0
# stored" (its epilogue issued) at the unit's last pair; "wg0 q_full" (the next query landed) and "prod q issue"
# (the producer issued it) at the next unit's first pair.
EVENTS = ("wg0 ready", "wg0 S", "wg0 softmax", "wg0 p_free", "wg0 p_ready", "wg0 PV+empty",
          "wg1 p_ready", "wg1 PV+free", "prod wait1", "prod wait2/issue", "prod convert", "wg1 raw", "wg1 convert",
          "wg1 landed", "wg0 sums", "wg0 stored", "wg0 q_full", "prod q issue")
UNIT_EVENTS = EVENTS[-4:]   # the persistent hand-over's (units=) only


# tc_exp2(x): 2^x in one MUFU.EX2 (ex2.approx.ftz: ~2 ulp, results below 2^-126 flushed to 0). CUDA's
# exp2f adds a range test, a select and two multiplies a value around it: ~4 instructions a score
# on the softmax, the step's critical path (bench/NOTES.md "MLA v13").
EXP2_SOURCE = r"""
__device__ __forceinline__ float tc_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def _exp2(x):
    return T.call_extern("float32", "tc_exp2", x)


@dataclass(frozen=True)
class _Visible:
    """visible(k, i, j), plus all_visible(k) (or None): every score of step k is visible."""

    at: Any
    whole: Any

    def __call__(self, k, i, j):
        return self.at(k, i, j)


def _softmax(k, s, visible, scale, m_i, m_prev, alpha, row_sum, l_i):
    online_softmax(k, s, visible, scale, m_i, m_prev, alpha, row_sum, l_i, exp2=_exp2,
                   all_visible=visible.whole if isinstance(visible, _Visible) else None, lazy=state().get("lazy", 0.0))


# tc_warp_any(p): whether any lane of the warp has p != 0 (attention_loop(lazy=): the O rescale's branch)
LAZY_SOURCE = r"""
__device__ __forceinline__ int tc_warp_any(int p) { return __any_sync(0xffffffffu, p); }
"""


# tc_timeline(dst): the global timer (ns), the SM clock and the SM id, as 32-bit words at dst[0..4]
TIMELINE_SOURCE = r"""
__device__ __forceinline__ void tc_timeline(float* dst) {
  unsigned long long t, c = clock64();
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  d[0] = unsigned(t); d[1] = unsigned(t >> 32); d[2] = unsigned(c); d[3] = unsigned(c >> 32); d[4] = sm;
}
"""
# trace= also records every CTA's timeline: event 0 when its warpgroups start (its query tile
# loaded), event 1 when WG0's epilogue is done; 8 words an event from column TIMELINE_COL of
# trace[0], TIMELINE_PER_ROW events a row (bench/trace_mla.py reads them)
TIMELINE_COL, TIMELINE_PER_ROW = 20, 60   # (the step stamps: columns 0 .. len(EVENTS) - 1)


@T.macro
def _timeline(trace, event):
    if trace is not None:
        if T.get_thread_binding() == 0:
            T.call_extern("handle", "tc_timeline", T.address_of(
                trace[0, (T.get_block_binding() * 2 + event) // TIMELINE_PER_ROW,
                      TIMELINE_COL + ((T.get_block_binding() * 2 + event) % TIMELINE_PER_ROW) * 8]))


def _stamp(trace, k, event):
    # the SM clock when a warpgroup reaches `event` of step k (k < 64): CTA 0 into rows 0-63 of
    # trace[0], and where trace[0] has 128+ rows (two 64-row tiles of query rows) CTA 1, CTA 0's
    # sibling tile of the same sequence, into rows 64-127
    if trace is not None:
        _stamp_ctas(trace, k, EVENTS.index(event), 2 if int(trace.shape[1]) >= 128 else 1)


@T.macro
def _stamp_ctas(trace, k, event, ctas):
    if T.get_thread_binding() % WG == 0 and T.get_block_binding() < ctas and k < 64:
        trace[0, T.get_block_binding() * 64 + k, event] = T.reinterpret(T.call_extern("int32", "clock"), "float32")


def _issue_loads(loads, k, dst, slot, bar):
    # the copies that stage step k; every producer thread then arrives (TMA adds the bytes)
    for src, part, row0, rows in loads(k):
        emit(T.tma_copy(src, dst[part][slot, row0:row0 + rows, :], barrier=bar))
    emit(T.mbarrier_arrive(bar))


def _empty_barriers(n):
    # n empty barriers, each of both MMA warpgroups' arrivals
    return T.alloc_barrier([2 * WG] * n)


def _release_slot(empty, slot):
    # an MMA warpgroup is done with the slot (after the WGMMA wait of its reads)
    emit(T.mbarrier_arrive(empty[slot]))


def _scores(q, kv, slot, acc_s):
    for p, (qt, kt) in enumerate(zip(q, kv)):
        emit(T.wgmma_gemm(qt, kt[slot, :, :], acc_s, transpose_B=True, clear_accum=(p == 0), policy=FULL_ROW))
    emit(T.wait_wgmma(0))


def _pv(p_s, v, slot, acc):
    emit(T.wgmma_gemm(p_s, v[slot, :, :], acc, transpose_B=False, clear_accum=False, policy=FULL_ROW),
         T.wait_wgmma(0))


def _scores_t(q, kv, slot, acc_st, fold=None):
    # S^T = sum_p K_p Q_p^T: the step's tokens are M, the query rows N. fold (_Fold): the parts with a
    # row scale go to their scale's own accumulator, all issued before the one wait, then
    # S^T += sum_b acc_b * scale_b (per token: the rows of S^T)
    cleared = set()
    for p, (qt, kt) in enumerate(zip(q, kv)):
        b = None if fold is None else fold.part_scale[p]
        acc = acc_st if b is None else fold.acc[b]
        emit(T.wgmma_gemm(kt[slot, :, :], qt, acc, transpose_B=True, clear_accum=b not in cleared, policy=FULL_ROW))
        cleared.add(b)
    emit(T.wait_wgmma(0))
    if fold is not None:
        _fold_scores(acc_st, fold.acc, fold.ss, slot, None in cleared)


@T.macro
def _fold_scores(acc_st, acc, ss, slot, has_plain):
    for i, j in T.Parallel(acc_st.shape[0], acc_st.shape[1]):
        if has_plain:
            acc_st[i, j] += _scaled_sum(acc, ss, slot, i, j)
        else:
            acc_st[i, j] = _scaled_sum(acc, ss, slot, i, j)


def _scaled_sum(acc, ss, slot, i, j):
    # sum_b acc[b][i, j] * ss[slot, b, i]: token i's partial scores, each times its row scale
    total = acc[0][i, j] * ss[slot, 0, i]
    for b in range(1, len(acc)):
        total = total + acc[b][i, j] * ss[slot, b, i]
    return total


def _pv_t(p_tiles, v, slot, outs):
    # O^T += V^T P^T for each value part: V^T from the cache tile (MN-major A), P (rows x tokens, the
    # part's own copy when the parts carry row scales) as a K-major B; one wait for all
    for p_t, vt, acc_t in zip(p_tiles, v, outs):
        emit(T.wgmma_gemm(vt[slot, :, :], p_t, acc_t, transpose_A=True, transpose_B=True, clear_accum=False,
                          policy=FULL_ROW))
    emit(T.wait_wgmma(0))


@T.macro
def _scale_cols(acc_t, scale_s):
    for i, j in T.Parallel(acc_t.shape[0], acc_t.shape[1]):
        acc_t[i, j] *= scale_s[j]


def _scale_cols_all(outs, scale_s):
    for acc_t in outs:
        _scale_cols(acc_t, scale_s)


def _zero_rows(kv, v_parts, slot, valid):
    # rows past `valid` hold whatever the cache had (NaN in the tests): P is 0 there, but 0 * NaN
    # in P @ V is not
    for p in v_parts:
        _zero_part(kv[p], slot, valid)


@T.macro
def _zero_part(buf, slot, valid):
    for i, j in T.Parallel(buf.shape[1], buf.shape[2]):
        buf[slot, i, j] = T.if_then_else(i < valid, buf[slot, i, j], T.cast(0, buf.dtype))


CHUNK = 8        # values a producer thread converts at once: one 16-byte store of the bf16 tile


def _convert(kv, raw, value, slot, r, valid, vals, row0=0, rows=None, wg=2, direct=()):
    # raw slot r -> rows [row0, row0 + rows) of each converted tile (default: all of it), raw rows 0..,
    # by the 128 threads of warpgroup `wg` (2: the producer); parts in `direct` are loaded as they are
    def read(part, i, j):               # element (i, j) of raw staging part `part`, slot r
        return raw[part][r, i, j]

    tid = T.get_thread_binding() - wg * WG
    for p, buf in enumerate(kv):
        if p not in direct:
            _convert_part(buf, p, read, value, slot, valid, tid, vals, row0, rows)


def _chunks(buf, rows=None):
    # a thread's chunks of a (rows, cols) tile (or of its first `rows` rows): chunk c covers row i,
    # columns j..j+CHUNK of flat index (c * PRODUCER + tid) * CHUNK, so a warp's stores are whole
    # 128-byte rows of the swizzled tile
    rows, cols = buf.shape[1] if rows is None else rows, buf.shape[2]
    if (rows * cols) % (PRODUCER * CHUNK) or cols % CHUNK:
        raise ValueError(f"attention_loop: a converted tile of {rows} x {cols} does not split into "
                         f"{PRODUCER} threads x {CHUNK}-value chunks")
    return rows * cols // (PRODUCER * CHUNK), cols


def _at(buf, c, tid, row0=0):
    # (row, first column) of chunk c of this producer thread in a converted tile (rows from row0)
    flat = (c * PRODUCER + tid) * CHUNK
    if row0 == 0:
        return flat // _chunks(buf)[1], flat % _chunks(buf)[1]
    return row0 + flat // _chunks(buf)[1], flat % _chunks(buf)[1]


@T.macro
def _convert_part(buf, p, read, value, slot, valid, tid, vals, row0, rows):
    # Two passes: every value of the thread's chunks into registers, then the stores. In one pass
    # (T.Parallel) each chunk's shared loads waited for the previous chunk's store, because the raw
    # and converted tiles are one shared allocation to the compiler: ~16 dependent load -> store
    # round trips a step, 2550 of a 32-token step's ~3150 cycles (bench.trace_mla, session 6).
    # Raw row i lands in tile row row0 + i (row0 > 0: a step staged in raw chunks).
    for c in T.unroll(_chunks(buf, rows)[0]):
        for e in T.vectorized(CHUNK):
            if valid is None:
                vals[c * CHUNK + e] = value(p, _at(buf, c, tid)[0], _at(buf, c, tid)[1] + e, read)
            else:
                vals[c * CHUNK + e] = T.if_then_else(_at(buf, c, tid, row0)[0] < valid,
                                                     value(p, _at(buf, c, tid)[0], _at(buf, c, tid)[1] + e, read),
                                                     T.cast(0, buf.dtype))
    for c in T.unroll(_chunks(buf, rows)[0]):
        for e in T.vectorized(CHUNK):
            buf[slot, _at(buf, c, tid, row0)[0], _at(buf, c, tid)[1] + e] = vals[c * CHUNK + e]


@T.macro
def _convert_step(kv, raw, value, slot, r, valid, vals):
    # only the sequence's last step has rows to zero: every other step converts without a select
    if valid >= kv[0].shape[1]:
        _convert(kv, raw, value, slot, r, None, vals)
    else:
        _convert(kv, raw, value, slot, r, valid, vals)


def _valid(valid_rows, k, kv):
    return valid_rows - k * kv[0].shape[1]      # rows of step k that hold data (>= block_n: all)


@T.macro
def _producer_plain(steps, loads, kv, v_parts, valid_rows, full, empty, tail, stages, trace):
    for k in T.serial(steps):
        slot = k % stages
        T.mbarrier_wait_parity(empty[slot], ((k // stages) % 2) ^ 1)    # step k - stages is done
        _stamp(trace, k, "prod wait1")
        _issue_loads(loads, k, kv, slot, full[slot])
        _stamp(trace, k, "prod wait2/issue")
        if _valid(valid_rows, k, kv) < kv[0].shape[1]:
            T.mbarrier_wait_parity(full[slot], (k // stages) % 2)
            _zero_rows(kv, v_parts, slot, _valid(valid_rows, k, kv))
            T.fence_proxy_async()                                       # generic stores -> WGMMA reads
            T.mbarrier_arrive(tail[0])


@T.macro
def _producer_convert(steps, loads, kv, raw, value, valid_rows, full, empty, raw_full, stages, raw_stages, trace,
                      vals):
    for k in T.serial(T.min(steps, raw_stages)):
        _issue_loads(loads, k, raw, k, raw_full[k])
    for k in T.serial(steps):
        slot = k % stages
        r = k % raw_stages
        T.mbarrier_wait_parity(raw_full[r], (k // raw_stages) % 2)
        _stamp(trace, k, "prod wait1")
        T.mbarrier_wait_parity(empty[slot], ((k // stages) % 2) ^ 1)
        _stamp(trace, k, "prod wait2/issue")
        _convert_step(kv, raw, value, slot, r, _valid(valid_rows, k, kv), vals)
        T.fence_proxy_async()
        T.mbarrier_arrive(full[slot])
        _stamp(trace, k, "prod convert")
        T.sync_threads(PRODUCER_BAR, PRODUCER)                          # every producer thread read raw[r]
        if k + raw_stages < steps:
            _issue_loads(loads, k + raw_stages, raw, r, raw_full[r])


def _raw_slot(k, c, pieces, raw_stages):
    # chunk c of step k (raw staging in `pieces` chunks a step): its raw slot and that slot's use
    # parity. Slot r always holds chunk r % pieces of some step, so one warpgroup owns it.
    depth = raw_stages // pieces
    return (k % depth) * pieces + c, (k // depth) % 2


@dataclass(frozen=True)
class _Chunked:
    """What the two converters share when raw staging comes in `pieces` chunks a step."""

    loads: Any
    raw: Any            # raw staging buffers, raw_stages slots each
    value: Any
    valid_rows: Any
    full: Any
    raw_full: Any
    raw_stages: int
    pieces: int
    direct: Any         # None, or k -> copies of operand parts loaded without conversion
    stage_raw: bool
    fold: Any = None    # None, or the _Fold whose row scales the converters also store


class _Window:
    """Entries [off, off + n) of a 1-D shared tile, indexed like a tile of their own (the swapped
    kernel's row statistics); a T.copy destination through dst()."""

    def __init__(self, buf, off, n):
        self.buf, self.off, self.n = buf, off, n

    def __getitem__(self, i):
        return self.buf[self.off + i]


def dst(tile_or_window):
    # T.copy's destination: the tile, or a window's region of its tile
    w = tile_or_window
    return w.buf[w.off:w.off + w.n] if isinstance(w, _Window) else w


@dataclass(frozen=True)
class _Fold:
    """Row scales folded into the MMAs (swapped, a tile.RawValue with row_scales): the converters
    store each step's scales, WG0 applies them to the partial scores and to one copy of P per value
    part; the converted operand tiles hold the unscaled values."""

    ss: Any             # (stages, count, block_n) float32: step k's row scales in slot k % stages (tokens
                        # innermost: a thread's 4 tokens of P are one 16-byte load; tokens x scales was
                        # an 8-way bank conflict, ~900 cycles a step, ncu "MLA v11")
    scale: Any          # (b, i, read) -> row i's scale b, read from raw staging
    part_scale: tuple   # kv part -> its scale index, or None
    acc: Any            # WG0's partial score accumulators, one per scale (block_n x block_m)
    p_parts: Any        # value part -> its copy of P (block_m x block_n), times that part's scale
    p_regs: Any         # the copies in WG0's registers before they are stored


@T.macro
def _first_pieces(steps, h, ck):
    # converter h (of two) issues the loads of its chunks of the first raw_stages / pieces steps
    for d in T.serial(T.min(steps, ck.raw_stages // ck.pieces)):
        for c in T.unroll(ck.pieces // 2):
            _issue_loads(ck.loads, d * ck.pieces + h * (ck.pieces // 2) + c, ck.raw,
                         d * ck.pieces + h * (ck.pieces // 2) + c, ck.raw_full[d * ck.pieces + h * (ck.pieces // 2) + c])


def _staging(kv, ck):
    # stage_raw: registers for a converter's share of one raw chunk, per operand part and per load of
    # value.loads(part): the thread's chunk elements (CHUNK per chunk), in the load's dtype
    if not ck.stage_raw:
        return None

    def read0(part, i, j):
        return ck.raw[part][0, i, j]

    rows = kv[0].shape[1] // ck.pieces
    return [[] if p in _direct_parts(ck.direct) else
            [T.alloc_local((_chunks(buf, rows)[0] * CHUNK,), load(0, 0, read0).dtype) for load in ck.value.loads(p)]
            for p, buf in enumerate(kv)]


def _stage(kv, raw, value, r, stg, rows, wg):
    # raw slot r -> the staging registers (every raw element this thread's chunks need)
    def read(part, i, j):
        return raw[part][r, i, j]

    tid = T.get_thread_binding() - wg * WG
    for p, buf in enumerate(kv):
        for n, load in enumerate(value.loads(p) if stg[p] else []):
            _stage_part(buf, stg[p][n], load, read, tid, rows)


@T.macro
def _stage_part(buf, dst, load, read, tid, rows):
    for c in T.unroll(_chunks(buf, rows)[0]):
        for e in T.vectorized(CHUNK):
            dst[c * CHUNK + e] = load(_at(buf, c, tid)[0], _at(buf, c, tid)[1] + e, read)


def _combine(kv, value, slot, valid, stg, row0, rows, wg):
    # the staging registers -> rows [row0, row0 + rows) of each converted tile (no shared-memory reads)
    tid = T.get_thread_binding() - wg * WG
    for p, buf in enumerate(kv):
        if stg[p]:
            _combine_part(buf, slot, valid, tid, row0, rows,
                          lambda idx, part=p: value.combine(part, [s[idx] for s in stg[part]]))


@T.macro
def _combine_part(buf, slot, valid, tid, row0, rows, made):
    for c in T.unroll(_chunks(buf, rows)[0]):
        for e in T.vectorized(CHUNK):
            if valid is None:
                buf[slot, _at(buf, c, tid, row0)[0], _at(buf, c, tid)[1] + e] = made(c * CHUNK + e)
            else:
                buf[slot, _at(buf, c, tid, row0)[0], _at(buf, c, tid)[1] + e] = T.if_then_else(
                    _at(buf, c, tid, row0)[0] < valid, made(c * CHUNK + e), T.cast(0, buf.dtype))


@T.macro
def _convert_share(steps, k, h, ck, kv, empty, stages, vals, stg, wg, bar, trace):
    # converter h's half of step k: chunks h * pieces / 2.. (raw_rows = block_n / pieces tokens each)
    # -> their rows of the step's converted slot, by warpgroup wg; each freed raw slot at once takes
    # the same chunk of step k + raw_stages / pieces. stg: None, or the stage_raw registers.
    slot = k % stages
    raw_rows = kv[0].shape[1] // ck.pieces
    valid = _valid(ck.valid_rows, k, kv)
    T.mbarrier_wait_parity(empty[slot], ((k // stages) % 2) ^ 1)
    if ck.direct is not None and h == 0:                               # the parts TMA fills as they are
        _issue_direct(ck.direct, k, kv, slot, ck.full[slot])
    for c in T.unroll(ck.pieces // 2):
        chunk = h * (ck.pieces // 2) + c
        r, parity = _raw_slot(k, chunk, ck.pieces, ck.raw_stages)
        T.mbarrier_wait_parity(ck.raw_full[r], parity)
        if c == 0:
            _stamp(trace, k, ("prod wait1", "wg1 raw")[h])
        if stg is None:                                                 # convert straight from the raw slot
            if valid >= kv[0].shape[1]:
                _convert(kv, ck.raw, ck.value, slot, r, None, vals, chunk * raw_rows, raw_rows, wg,
                         _direct_parts(ck.direct))
                _store_scales(ck.fold, ck.raw, slot, r, None, chunk * raw_rows, raw_rows, wg)
            else:
                _convert(kv, ck.raw, ck.value, slot, r, valid, vals, chunk * raw_rows, raw_rows, wg,
                         _direct_parts(ck.direct))
                _store_scales(ck.fold, ck.raw, slot, r, valid, chunk * raw_rows, raw_rows, wg)
            if c == ck.pieces // 2 - 1:
                _share_done(ck.full, slot, trace, k, h)
        else:                                                           # stage_raw: the raw slot -> registers
            _stage(kv, ck.raw, ck.value, r, stg, raw_rows, wg)
        T.sync_threads(bar, WG)                                         # every thread read this raw slot
        if k + ck.raw_stages // ck.pieces < steps:
            _issue_loads(ck.loads, (k + ck.raw_stages // ck.pieces) * ck.pieces + chunk, ck.raw, r, ck.raw_full[r])
        if stg is not None:                                             # convert from registers under the reload
            if valid >= kv[0].shape[1]:
                _combine(kv, ck.value, slot, None, stg, chunk * raw_rows, raw_rows, wg)
            else:
                _combine(kv, ck.value, slot, valid, stg, chunk * raw_rows, raw_rows, wg)
            if c == ck.pieces // 2 - 1:
                _share_done(ck.full, slot, trace, k, h)


def _store_scales(fold, raw, slot, r, valid, row0, rows, wg):
    # fold: raw slot r's row scales -> rows [row0, row0 + rows) of the step's scale tile, 0 past
    # `valid` (a tail's scales are whatever the cache holds, NaN in the tests; P is 0 there)
    if fold is not None:
        def read(part, i, j):
            return raw[part][r, i, j]

        count = fold.ss.shape[1]
        if (rows * count) % WG:
            raise ValueError(f"attention_loop: {rows} rows x {count} row scales do not split over {WG} threads")

        def value(b, i):                # scale b of raw row i; 0 past the valid rows
            s = fold.scale(b, i, read)
            return s if valid is None else T.if_then_else(row0 + i < valid, s, T.float32(0))

        _store_scales_m(fold.ss, value, slot, row0, rows, count, T.get_thread_binding() - wg * WG)


@T.macro
def _store_scales_m(ss, value, slot, row0, rows, count, tid):
    # flat index f: scale f // rows of row f % rows (consecutive threads, consecutive tokens)
    for c in T.unroll(rows * count // WG):
        ss[slot, (c * WG + tid) // rows, row0 + (c * WG + tid) % rows] = value((c * WG + tid) // rows,
                                                                               (c * WG + tid) % rows)


def _share_values(kv, ck):
    # values a converter thread holds for one part of one chunk (the conversion's register buffer)
    return max(_chunks(b, b.shape[1] // ck.pieces)[0] for b in kv) * CHUNK


def _producer_converts(steps, kv, ck, empty, stages, trace):
    # the producer's share of chunked raw staging: the first half of every step's chunks
    vals = T.alloc_local((_share_values(kv, ck),), kv[0].dtype)
    stg = _staging(kv, ck)
    _first_pieces(steps, 0, ck)
    _producer_converts_loop(steps, kv, ck, empty, stages, vals, stg, trace)


@T.macro
def _producer_converts_loop(steps, kv, ck, empty, stages, vals, stg, trace):
    for k in T.serial(steps):
        _convert_share(steps, k, 0, ck, kv, empty, stages, vals, stg, 2, PRODUCER_BAR, trace)


def _direct_parts(direct):
    # the operand parts that `direct` (k -> [(src, part, row0, rows)]) loads without conversion
    return () if direct is None else tuple(sorted({part for _, part, _, _ in direct(0)}))


def _issue_direct(direct, k, kv, slot, bar):
    # step k's directly loaded parts into its slot; their bytes count on `bar` (the step's full)
    for src, part, row0, rows in direct(k):
        emit(T.tma_copy(src, kv[part][slot, row0:row0 + rows, :], barrier=bar))


@T.macro
def _share_done(full, slot, trace, k, h):
    # a converter's half of the step is in the slot: make the stores visible to WGMMA and say so
    T.fence_proxy_async()
    T.mbarrier_arrive(full[slot])
    _stamp(trace, k, ("prod convert", "wg1 convert")[h])


@T.macro
def _wait_step(k, kv, valid_rows, full, tail, stages, plain):
    if plain:
        if _valid(valid_rows, k, kv) < kv[0].shape[1]:
            T.mbarrier_wait_parity(tail[0], 0)
        else:
            T.mbarrier_wait_parity(full[k % stages], (k // stages) % 2)
    else:
        T.mbarrier_wait_parity(full[k % stages], (k // stages) % 2)


def _scale_rows(acc, scale):
    # acc *= scale per row; lazy (attention_loop(lazy=)) with the factors in a fragment (the rows this thread
    # holds): skipped by a warp none of whose rows has a factor other than exactly 1 (a warp vote, so that the
    # branch is the warp's and the multiplies are not issued; a per-element test would only predicate them)
    if state().get("lazy", 0.0) and scale.scope() == "local.fragment":
        _scale_changed_rows(acc, scale, T.alloc_local((1,), "int32"))
    else:
        _scale_all_rows(acc, scale)


def _scale_rows_from(acc, scale_s, spare):
    # acc *= the row factors WG0 left in shared memory; lazy: through `spare` (a row fragment free here) so that
    # each thread holds its own rows' factors for the warp's skip test
    if state().get("lazy", 0.0):
        emit(T.copy(scale_s, spare))
        _scale_rows(acc, spare)
    else:
        _scale_rows(acc, scale_s)


@T.macro
def _scale_all_rows(acc, scale):
    for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
        acc[i, j] *= scale[i]


@T.macro
def _scale_changed_rows(acc, scale, need):
    need[0] = 0
    for i in T.Parallel(scale.shape[0]):
        if scale[i] != 1.0:
            need[0] = 1
    if T.call_extern("int32", "tc_warp_any", need[0]) != 0:
        for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] *= scale[i]


@T.macro
def _wg0_start(m_i, l_i, o0):
    T.set_max_nreg(SCORE_REGS, 1)
    T.fill(m_i, NEG_INF)
    T.fill(l_i, 0.0)
    T.fill(o0, 0.0)


@T.macro
def _softmax_and_hand_off(k, s, slot, v0, visible, scale, p_s, alpha_s, o0, m_i, m_prev, alpha, row_sum, l_i, empty,
                          p_ready, p_free, trace):
    # step k's scores s -> P, handed to WG1; then O_0 += P V_0 (its wgmma wait also completes any
    # scores left in flight) and the slot is released
    _hand_off_p(k, s, visible, scale, p_s, alpha_s, m_i, m_prev, alpha, row_sum, l_i, p_ready, p_free, trace)
    _scale_rows(o0, alpha)
    _pv(p_s, v0, slot, o0)
    _release_slot(empty, slot)
    _stamp(trace, k, "wg0 PV+empty")


@T.macro
def _hand_off_p(k, s, visible, scale, p_s, alpha_s, m_i, m_prev, alpha, row_sum, l_i, p_ready, p_free, trace,
                fold=None, slot=None):
    # step k's scores s (rows x tokens) -> P, written to p_s (fold: one copy per value part, times
    # that part's row scales) with the row scales for WG1 once it is done with step k - 1's
    _softmax(k, s, visible, scale, m_i, m_prev, alpha, row_sum, l_i)
    _stamp(trace, k, "wg0 softmax")
    if k > 0:
        T.mbarrier_wait_parity(p_free[0], (k - 1) % 2)             # WG1 is done with P of step k - 1
    _stamp(trace, k, "wg0 p_free")
    if fold is None:
        T.copy(s, p_s)
    else:
        _scaled_p_copies(s, fold, slot)
    T.copy(alpha, dst(alpha_s))
    T.fence_proxy_async()
    T.sync_threads(WG0_BAR, WG)                                     # all of P is written (and S^T read)
    T.mbarrier_arrive(p_ready[0])
    _stamp(trace, k, "wg0 p_ready")


def _scaled_p_copies(s, fold, slot):
    # every copy into registers first, then the stores: one pass (load scale, multiply, store) per
    # element serialized each scale load behind the previous store (one shared allocation to the
    # compiler), ~2000 cycles of WG0's step (bench.trace_mla, "MLA v11")
    for (part, _), p_r in zip(fold.p_parts, fold.p_regs):
        _scaled_p(s, p_r, fold.ss, slot, fold.part_scale[part])
    for (_, p_t), p_r in zip(fold.p_parts, fold.p_regs):
        emit(T.copy(p_r, p_t))


@T.macro
def _scaled_p(s, p_r, ss, slot, b):
    for i, j in T.Parallel(s.shape[0], s.shape[1]):
        p_r[i, j] = T.cast(s[i, j] * ss[slot, b, j], p_r.dtype)


@T.macro
def _wg0_finish(m_i, l_i, stats_s, stats, o0, epilogue):
    # the final row max and sum for WG1's epilogue, then WG0's own
    for i in T.Parallel(m_i.shape[0]):
        stats_s[0, i] = m_i[i]
        stats_s[1, i] = l_i[i]
    T.mbarrier_arrive(stats[0])
    epilogue(o0, 0, l_i, m_i, True)


@T.macro
def _mma_wg0(steps, q, kv, v0, valid_rows, visible, scale, acc_s, p_s, alpha_s, stats_s, o0, m_i, m_prev, alpha,
             row_sum, l_i, full, tail, empty, p_ready, p_free, stats, stages, plain, epilogue, trace):
    _wg0_start(m_i, l_i, o0)
    for k in T.serial(steps):
        slot = k % stages
        _wait_step(k, kv, valid_rows, full, tail, stages, plain)
        _stamp(trace, k, "wg0 ready")
        _scores(q, kv, slot, acc_s)
        _stamp(trace, k, "wg0 S")
        _softmax_and_hand_off(k, acc_s, slot, v0, visible, scale, p_s, alpha_s, o0, m_i, m_prev, alpha, row_sum, l_i,
                              empty, p_ready, p_free, trace)
    _wg0_finish(m_i, l_i, stats_s, stats, o0, epilogue)


@T.macro
def _wg1_converts_first(steps, ck, kv, empty, stages, vals, stg, trace):
    # ck (_Chunked) or None: WG1 converts the second half of every step's raw chunks, one step ahead
    # of its own P V update (bench/NOTES.md "MLA v9"): its loads and step 0's half come first
    if ck is not None:
        _first_pieces(steps, 1, ck)
        if steps > 0:
            _convert_share(steps, 0, 1, ck, kv, empty, stages, vals, stg, 1, WG1_BAR, trace)


@T.macro
def _wg1_converts_next(k, steps, ck, kv, empty, stages, vals, stg, trace):
    # before WG1's P V update of step k: its half of step k + 1
    if ck is not None:
        if k + 1 < steps:
            _convert_share(steps, k + 1, 1, ck, kv, empty, stages, vals, stg, 1, WG1_BAR, trace)


@T.macro
def _mma_wg1(steps, kv, v1, col1, p_s, alpha_s, stats_s, o1, m1, l1, empty, p_ready, p_free, stats, stages,
             epilogue, ck, vals, stg, trace):
    T.set_max_nreg(OUT_REGS, 1)
    T.fill(o1, 0.0)
    _wg1_converts_first(steps, ck, kv, empty, stages, vals, stg, trace)
    for k in T.serial(steps):
        slot = k % stages
        _wg1_converts_next(k, steps, ck, kv, empty, stages, vals, stg, trace)
        T.mbarrier_wait_parity(p_ready[0], k % 2)
        _stamp(trace, k, "wg1 p_ready")
        _scale_rows_from(o1, alpha_s, m1)
        _pv(p_s, v1, slot, o1)
        T.mbarrier_arrive(p_free[0])
        _release_slot(empty, slot)
        _stamp(trace, k, "wg1 PV+free")
    T.mbarrier_wait_parity(stats[0], 0)
    for i in T.Parallel(m1.shape[0]):
        m1[i] = stats_s[0, i]
        l1[i] = stats_s[1, i]
    epilogue(o1, col1, l1, m1, False)


@T.macro
def _mma_wg0_t(steps, q, kv, v0, valid_rows, visible, scale, acc_st, st_s, sc, p_s, alpha_s, l_s, m_s, o0, m_i,
               m_prev, alpha, row_sum, l_i, full, tail, empty, p_ready, p_free, stats, stages, plain, epilogue, trace,
               fold, p0, cols0):
    # v0, o0, p0, cols0: WG0's value parts (tiles, O^T fragments, the P tile each reads, first columns)
    _wg0_start_t(m_i, l_i, o0)
    for k in T.serial(steps):
        slot = k % stages
        _wait_step(k, kv, valid_rows, full, tail, stages, plain)
        _stamp(trace, k, "wg0 ready")
        _scores_t(q, kv, slot, acc_st, fold)
        _stamp(trace, k, "wg0 S")
        for i, j in T.Parallel(acc_st.shape[0], acc_st.shape[1]):
            st_s[i * (acc_st.shape[1] + 1) + j] = acc_st[i, j]
        T.sync_threads(WG0_BAR, WG)                                     # all of S^T is in shared memory
        for i, j in T.Parallel(sc.shape[0], sc.shape[1]):
            sc[i, j] = st_s[j * (acc_st.shape[1] + 1) + i]
        _hand_off_p(k, sc, visible, scale, p_s, alpha_s, m_i, m_prev, alpha, row_sum, l_i, p_ready, p_free, trace,
                    fold, slot)
        _scale_cols_all(o0, alpha_s)
        _pv_t(p0, v0, slot, o0)
        T.mbarrier_arrive(empty[slot])
        _stamp(trace, k, "wg0 PV+empty")
    T.copy(m_i, dst(m_s))
    T.copy(l_i, dst(l_s[0]))
    T.sync_threads(WG0_BAR, WG)
    # 1 / l once a row for both warpgroups' epilogues (0 where a row saw no token), a thread a row: per
    # element, each division or reciprocal is a sequence with its own slow-path call (64 a thread at 16 rows;
    # bench/NOTES.md "Session 80")
    l_sum, l_inv = l_s                                                # (windows of st_s)
    for i in T.Parallel(l_sum.n):
        st_s[l_inv.off + i] = T.if_then_else(l_sum[i] > 0.0, reciprocal(l_sum[i]), 0.0)
    T.sync_threads(WG0_BAR, WG)
    T.mbarrier_arrive(stats[0])
    _epilogues(epilogue, o0, cols0, l_s, m_s, True)


@T.macro
def _wg0_start_t(m_i, l_i, o0):
    T.set_max_nreg(SCORE_REGS, 1)
    T.fill(m_i, NEG_INF)
    T.fill(l_i, 0.0)
    _fill_all(o0)


def _fill_all(outs):
    for o in outs:
        emit(T.fill(o, 0.0))


def _epilogues(epilogue, outs, cols, l_s, m_s, stats):
    # one epilogue per value part; the row statistics go out with the first part only
    for n, (o, col) in enumerate(zip(outs, cols)):
        epilogue(o, col, l_s, m_s, stats and n == 0)


@T.macro
def _mma_wg1_t(steps, kv, v1, cols1, p1, alpha_s, l_s, m_s, o1, empty, p_ready, p_free, stats, stages, epilogue,
               ck, vals, stg, trace):
    # ck: None, or the chunked raw staging (_Chunked) that WG1 helps convert
    T.set_max_nreg(OUT_REGS, 1)
    _fill_all(o1)
    _wg1_converts_first(steps, ck, kv, empty, stages, vals, stg, trace)
    for k in T.serial(steps):
        slot = k % stages
        _wg1_converts_next(k, steps, ck, kv, empty, stages, vals, stg, trace)
        T.mbarrier_wait_parity(p_ready[0], k % 2)
        _stamp(trace, k, "wg1 p_ready")
        _scale_cols_all(o1, alpha_s)
        _pv_t(p1, v1, slot, o1)
        T.mbarrier_arrive(p_free[0])
        _release_slot(empty, slot)
        _stamp(trace, k, "wg1 PV+free")
    T.mbarrier_wait_parity(stats[0], 0)
    _epilogues(epilogue, o1, cols1, l_s, m_s, False)


@register("scalar", "cuda:sm_90a")
def scalar(value, dtype="int32"):
    # TileLang substitutes let-bound index arithmetic into every buffer index that uses it, widened to
    # int64: each TMA issue of the producer recomputed the block's (batch, split) with int64 divisions
    # by a runtime value, ~1500 cycles per step (measured with trace=True). A variable is computed once.
    return T.alloc_var(dtype, init=value)


@register("attention_loop", "cuda:sm_90a")
def attention_loop(steps, q, kv, v, loads, visible, scale, epilogue, *, valid_rows, raw=None, value=None, stages=2,
                   raw_stages=2, zero_every_step=False, trace=None, swapped=False, raw_rows=None, stage_raw=False,
                   direct=None, seesaw=False, all_visible=None, units=None, own_p=False, lazy=0.0):
    threads = state()["threads"]
    if lazy and (raw is not None or swapped or not lazy > 0):
        raise ValueError(f"attention_loop(lazy={lazy}) (the running max kept until a row's max grows by more than "
                         "lazy, O rescaled only in rows whose factor is not 1) is built for plain staging, "
                         "swapped=False and lazy > 0")
    state()["lazy"] = float(lazy)
    if own_p and not seesaw:
        raise ValueError("attention_loop(own_p=True) (each warpgroup's own P V with P from registers) is built for "
                         "seesaw=True")
    if units is not None and not seesaw:
        raise ValueError("attention_loop(units=...) (a persistent CTA's work list) is built for seesaw=True")
    visible = _Visible(visible, all_visible)
    if threads != 2 * WG + PRODUCER:
        raise ValueError(f"attention_loop on sm_90a needs a grid of {2 * WG} + producer_threads() threads, "
                         f"got {threads}")
    if seesaw:
        check_register_split(threads, [(WG, SEESAW_REGS), (WG, SEESAW_REGS), (PRODUCER, SEESAW_PRODUCER_REGS)])
    else:
        check_register_split(threads, [(WG, SCORE_REGS), (WG, OUT_REGS), (PRODUCER, PRODUCER_REGS)])
    require_pass_configs(PASS_CONFIGS)
    if not state().get("exp2_source"):          # the helpers, once per program (TileLang takes one source)
        T.import_source(EXP2_SOURCE + (TIMELINE_SOURCE if trace is not None else "") +
                        (LAZY_SOURCE if lazy else ""))
        state()["exp2_source"] = True
    if len(v) != 2 and not (swapped and len(v) % 2 == 0 and v):
        raise ValueError(f"attention_loop on sm_90a splits the output over two warpgroups: v must name two "
                         f"parts (swapped: an even number, half for each), got {v}")
    fold = getattr(value, "row_scales", None) is not None
    block_m = q[0].shape[0]
    block_n = kv[0][0]
    kv_s = [T.alloc_shared((stages, rows, d), dt) for rows, d, dt in kv]
    plain = raw is None
    raw_s = None if plain else [T.alloc_shared((raw_stages, *shape), dt) for shape, dt in raw]
    if seesaw:                          # P over the step's last kv part: no P or alpha tile of its own
        _seesaw(steps, loads, q, kv, kv_s, raw, v, valid_rows, visible, scale, stages, swapped, epilogue, trace,
                units, own_p)
        return
    p_s = None if fold else T.alloc_shared((block_m, block_n), kv[v[0]][2])   # fold: one P per value part
    # (swapped: alpha lives in the spare words of _swapped's S^T tile)
    alpha_s = None if swapped else T.alloc_shared((block_m,), "float32")
    pieces = 1 if raw_rows is None else block_n // raw_rows
    if pieces != 1 and (plain or pieces % 2 or raw_stages % pieces):
        raise ValueError(f"attention_loop: raw_rows={raw_rows} (raw staging in parts of a {block_n}-token step) "
                         "is built for a raw format only, in an even number of chunks a step (the producer "
                         "converts the first half, WG1 the second) and raw_stages a multiple of that number")
    if direct is not None and pieces == 1:
        raise ValueError("attention_loop(direct=...) (operand parts loaded without conversion) is built for raw "
                         "staging in chunks (raw_rows)")
    if stage_raw and (pieces == 1 or not hasattr(value, "loads")):
        raise ValueError("attention_loop(stage_raw=True) needs raw staging in chunks (raw_rows) and a value that is "
                         f"a tile.RawValue (loads + combine), got raw_rows={raw_rows}, value={value!r}")
    if fold and not (swapped and pieces > 1 and not stage_raw):
        raise ValueError("attention_loop: a value with row_scales (folded into the MMAs) is built for swapped=True "
                         "with raw staging in chunks (raw_rows) and stage_raw=False")
    if swapped:
        _swapped(steps, loads, q, kv, kv_s, raw_s, value, v, valid_rows, visible, scale, p_s, alpha_s, stages,
                 raw_stages, plain, epilogue, pieces, trace, stage_raw, direct)
        return
    stats_s = T.alloc_shared((2, block_m), "float32")
    acc_s = T.alloc_fragment((block_m, block_n), "float32")
    o0 = T.alloc_fragment((block_m, kv[v[0]][1]), "float32")
    o1 = T.alloc_fragment((block_m, kv[v[1]][1]), "float32")
    m_i, m_prev, alpha, row_sum, l_i, m1, l1 = (T.alloc_fragment((block_m,), "float32") for _ in range(7))
    full, empty, tail, raw_full, p_ready, p_free, stats = _barriers(stages, raw_stages, plain,
                                                                    PRODUCER + (WG if pieces > 1 else 0))
    ck = (_Chunked(loads, raw_s, value, valid_rows, full, raw_full, raw_stages, pieces, direct, stage_raw)
          if pieces > 1 else None)
    _warpgroups(steps, loads, q, kv_s, raw_s, value, v, valid_rows, visible, scale, acc_s, p_s, alpha_s, stats_s, o0,
                o1, m_i, m_prev, alpha, row_sum, l_i, m1, l1, full, tail, empty, raw_full, p_ready, p_free, stats,
                stages, raw_stages, plain, epilogue, trace, ck)


def _barriers(stages, raw_stages, plain, full_arrivals=PRODUCER):
    """full, empty, tail, raw_full (None when plain), p_ready, p_free, stats (module docstring)."""
    full = T.alloc_barrier([full_arrivals] * stages)
    return (full, _empty_barriers(stages), T.alloc_barrier([PRODUCER]),
            None if plain else T.alloc_barrier([PRODUCER] * raw_stages), T.alloc_barrier([WG]), T.alloc_barrier([WG]),
            T.alloc_barrier([WG]))


@T.macro
def _warpgroups(steps, loads, q, kv_s, raw_s, value, v, valid_rows, visible, scale, acc_s, p_s, alpha_s, stats_s, o0,
                o1, m_i, m_prev, alpha, row_sum, l_i, m1, l1, full, tail, empty, raw_full, p_ready, p_free, stats,
                stages, raw_stages, plain, epilogue, trace, ck):
    _timeline(trace, 0)
    T.sync_threads()                    # the program's own shared-memory writes (the query tiles) are done
    tx = T.get_thread_binding()
    if tx < WG:
        _mma_wg0(steps, q, kv_s, kv_s[v[0]], valid_rows, visible, scale, acc_s, p_s, alpha_s, stats_s, o0, m_i,
                 m_prev, alpha, row_sum, l_i, full, tail, empty, p_ready, p_free, stats, stages, plain, epilogue,
                 trace)
        _timeline(trace, 1)
    elif tx < 2 * WG:
        if ck is None:
            _mma_wg1(steps, kv_s, kv_s[v[1]], kv_s[v[0]].shape[2], p_s, alpha_s, stats_s, o1, m1, l1, empty, p_ready,
                     p_free, stats, stages, epilogue, None, None, None, trace)
        else:
            vals1 = T.alloc_local((_share_values(kv_s, ck),), kv_s[0].dtype)
            _mma_wg1(steps, kv_s, kv_s[v[1]], kv_s[v[0]].shape[2], p_s, alpha_s, stats_s, o1, m1, l1, empty, p_ready,
                     p_free, stats, stages, epilogue, ck, vals1, _staging(kv_s, ck), trace)
    else:
        T.set_max_nreg(PRODUCER_REGS, 0)
        if plain:
            _producer_plain(steps, loads, kv_s, v, valid_rows, full, empty, tail, stages, trace)
        elif ck is None:
            vals = T.alloc_local((max(_chunks(b)[0] for b in kv_s) * CHUNK,), kv_s[0].dtype)
            _producer_convert(steps, loads, kv_s, raw_s, value, valid_rows, full, empty, raw_full, stages, raw_stages,
                              trace, vals)
        else:
            _producer_converts(steps, kv_s, ck, empty, stages, trace)


def _swapped(steps, loads, q, kv, kv_s, raw_s, value, v, valid_rows, visible, scale, p_s, alpha_s, stages,
             raw_stages, plain, epilogue, pieces, trace, stage_raw, direct):
    block_m, block_n = q[0].shape[0], kv[0][0]
    acc_st = T.alloc_fragment((block_n, block_m), "float32")         # S^T: tokens x query rows
    # S^T through shared memory, rows padded by one word: unpadded, the transposed read (a thread's
    # consecutive tokens of one query row, 16 words apart) hit one bank ("MLA v11"). Flat, and a
    # whole number of KB: TileLang 0.1.15 places the next buffers right after it, and the WGMMA
    # operand tiles among them must stay 1 KB aligned (a 64 x 17 tile put P 256 bytes off: wrong P V)
    # The row statistics WG0 hands over (alpha, l, m: 3 x block_m words) follow S^T in the same tile,
    # in words the KB rounding leaves spare at 16 and 32 rows: tiles of their own would take a KB each
    # (TileLang 0.1.15 starts every buffer on one), and the FP8 cache's kernel at 32 rows would not fit
    # (bench/NOTES.md "Session 34"; attention_loop allocates no alpha tile for this kernel)
    # (and 1 / l: 4 x block_m words, the same KB count at 16 and 32 rows)
    hand = block_n * (block_m + 1)
    st_s = T.alloc_shared((-(-(hand + 4 * block_m) // 256) * 256,), "float32")
    sc = T.alloc_fragment((block_m, block_n), "float32")             # S (rows x tokens) for the softmax
    alpha_s, l_sum, m_s, l_inv = (_Window(st_s, hand + n * block_m, block_m) for n in range(4))
    l_s = (l_sum, l_inv)                                             # l and 1 / l, both read by the epilogues
    # the value parts: the first half WG0's, the second WG1's; O^T of each
    halves = (v[:len(v) // 2], v[len(v) // 2:])
    o0, o1 = ([T.alloc_fragment((kv[p][1], block_m), "float32") for p in h] for h in halves)
    cols = [sum(kv[u][1] for u in v[:n]) for n in range(len(v))]
    m_i, m_prev, alpha, row_sum, l_i = (T.alloc_fragment((block_m,), "float32") for _ in range(5))
    fold = _fold(value, kv, v, stages, block_m, block_n)
    p_of = dict(fold.p_parts) if fold is not None else {p: p_s for p in v}
    # chunked raw staging: the producer converts chunk 0 of each step and WG1 chunk 1
    full, empty, tail, raw_full, p_ready, p_free, stats = _barriers(stages, raw_stages, plain,
                                                                    PRODUCER + (WG if pieces > 1 else 0))
    col_of = dict(zip(v, cols))
    wg = [([kv_s[p] for p in h], [p_of[p] for p in h], [col_of[p] for p in h]) for h in halves]
    _warpgroups_t(steps, loads, q, kv_s, raw_s, value, valid_rows, visible, scale, acc_st, st_s, sc, p_s, alpha_s,
                  l_s, m_s, o0, o1, m_i, m_prev, alpha, row_sum, l_i, full, tail, empty, raw_full, p_ready, p_free,
                  stats, stages, raw_stages, plain, epilogue, pieces, trace, stage_raw, direct, fold, wg, v)


def _fold(value, kv, v, stages, block_m, block_n):
    # value.row_scales -> a _Fold (scale tile, WG0's partial score accumulators, the P copies)
    if getattr(value, "row_scales", None) is None:
        return None
    count, scale_of, part_scale = value.row_scales
    if len(part_scale) != len(kv) or any(part_scale[p] is None for p in v):
        raise ValueError(f"attention_loop: row_scales names a scale (or None) for each of the {len(kv)} kv parts and "
                         f"a scale for every value part {list(v)}, got {part_scale}")
    return _Fold(T.alloc_shared((stages, count, block_n), "float32"), scale_of, tuple(part_scale),
                 [T.alloc_fragment((block_n, block_m), "float32") for _ in range(count)],
                 tuple((p, T.alloc_shared((block_m, block_n), kv[p][2])) for p in v),
                 [T.alloc_fragment((block_m, block_n), kv[p][2]) for p in v])


@T.macro
def _warpgroups_t(steps, loads, q, kv_s, raw_s, value, valid_rows, visible, scale, acc_st, st_s, sc, p_s, alpha_s,
                  l_s, m_s, o0, o1, m_i, m_prev, alpha, row_sum, l_i, full, tail, empty, raw_full, p_ready, p_free,
                  stats, stages, raw_stages, plain, epilogue, pieces, trace, stage_raw, direct, fold, wg, v):
    # wg[n]: warpgroup n's value parts as (tiles, the P tile each reads, first output columns)
    _timeline(trace, 0)
    T.sync_threads()                    # the program's own shared-memory writes (the query tiles) are done
    tx = T.get_thread_binding()
    if tx < WG:
        _mma_wg0_t(steps, q, kv_s, wg[0][0], valid_rows, visible, scale, acc_st, st_s, sc, p_s, alpha_s, l_s, m_s,
                   o0, m_i, m_prev, alpha, row_sum, l_i, full, tail, empty, p_ready, p_free, stats, stages, plain,
                   epilogue, trace, fold, wg[0][1], wg[0][2])
        _timeline(trace, 1)
    elif tx < 2 * WG:
        if pieces > 1:
            ck = _Chunked(loads, raw_s, value, valid_rows, full, raw_full, raw_stages, pieces, direct, stage_raw, fold)
            vals1 = T.alloc_local((_share_values(kv_s, ck),), kv_s[0].dtype)
            _mma_wg1_t(steps, kv_s, wg[1][0], wg[1][2], wg[1][1], alpha_s, l_s, m_s, o1, empty, p_ready, p_free,
                       stats, stages, epilogue, ck, vals1, _staging(kv_s, ck), trace)
        else:
            _mma_wg1_t(steps, kv_s, wg[1][0], wg[1][2], wg[1][1], alpha_s, l_s, m_s, o1, empty, p_ready, p_free,
                       stats, stages, epilogue, None, None, None, trace)
    else:
        T.set_max_nreg(PRODUCER_REGS, 0)
        if plain:
            _producer_plain(steps, loads, kv_s, v, valid_rows, full, empty, tail, stages, trace)
        elif pieces == 1:
            vals = T.alloc_local((max(_chunks(b)[0] for b in kv_s) * CHUNK,), kv_s[0].dtype)
            _producer_convert(steps, loads, kv_s, raw_s, value, valid_rows, full, empty, raw_full, stages, raw_stages,
                              trace, vals)
        else:
            _producer_converts(steps, kv_s, _Chunked(loads, raw_s, value, valid_rows, full, raw_full, raw_stages,
                                                     pieces, direct, stage_raw, fold), empty, stages, trace)


# ---- seesaw (module docstring): the two MMA warpgroups take turns over the steps -----------------------
#
# Each kv part of each slot has its own full and empty barrier, so a part is reloaded as soon as its
# last reader is done with it, and the scores of a step start on its first part while the others
# land: with two slots and a pair of steps in them, whole-slot release left the next pair's loads
# exposed (first GPU run: 8% slower than the one-scorer loop). Empty barriers take 2 * WG arrivals;
# a part only one warpgroup reads gets both of that warpgroup's.
#   step e0's slot: part 0 (V_0) WG0 (scores, P V); part 1 (V_1) WG0 (scores) + WG1 (P V);
#                   the P part: WG0 (scores, then P written, P V) + WG1 (P V)
#   step e1's slot: part 0 WG1 (scores) + WG0 (P V); part 1 WG1 (scores, P V); the P part: both (P V)
# WG1 scores e1 only once WG0's scores of e0 are done (`scored`).

@dataclass(frozen=True)
class _Seesaw:
    """What the two warpgroups of the seesaw schedule and the producer share."""

    p_part: int         # the kv part each step's P is written over (the rope: read only by the scores)
    parts: int          # kv parts a step has
    alpha: Any          # (2, block_m) float32: alpha of steps e0 (row 0) and e1 (row 1) of the pair
    m: Any              # (2, block_m) float32: the running row max after step e0 / e1
    l: Any              # (4, block_m) float32: each warpgroup's final row sum (rows 2b, 2b + 1: unit parity b)
    ready: Any          # ready[0]: step e0's P, alpha, max are written (WG0 -> WG1); ready[1]: e1's (WG1 -> WG0)
    scored: Any         # WG0's scores of e0 are done: WG1 issues e1's only then, so that e0's (the head of
                        # the pair's chain) get the tensor cores alone (trace: 1650-2500 cycles shared, 1265 alone)
    full: Any           # full[slot * parts + part]: the part's TMA bytes landed
    empty: Any          # empty[slot * parts + part]: its readers are done
    tail: Any           # the last step's rows past the valid ones are zeroed (in the value parts)
    q_full: Any         # units: the unit's query tiles landed (producer arrivals + TMA bytes)
    q_empty: Any        # units: both MMA warpgroups are done with the unit's query (after its last P V; with
                        # Units.early_query right after each one's last scores)


@dataclass(frozen=True)
class _SeesawRegs:
    """One seesaw warpgroup's fragments."""

    acc_s: Any          # its step's scores, then P (block_m x block_n)
    o: Any              # its half of O (block_m x value part width)
    m_i: Any            # the running row max
    m_prev: Any
    alpha: Any          # the factor of its own step (WG1: of step e1)
    alpha0: Any         # WG1: the factor of step e0 (from WG0)
    row_sum: Any
    l_i: Any            # its own running row sum
    p: Any = None       # own_p: its step's P in the MMA dtype, the A operand of its own P V (wgmma RS)


@dataclass(frozen=True)
class _At:
    """Where a unit's steps sit in the CTA's run of steps (units=): step k of the unit is global step
    g + k (its slot and barrier phases); its pairs are the CTA's pairs from J (ready[0], scored), its
    whole pairs from F (ready[1]); tp: tail barrier phases used before. Without units, all 0."""

    g: Any = 0
    J: Any = 0
    F: Any = 0
    tp: Any = 0


@dataclass(frozen=True)
class _Unit:
    """One unit's work as the seesaw's roles see it (attention_loop's arguments, or a tile.Units
    binding's)."""

    steps: Any
    loads: Any
    valid_rows: Any
    visible: Any
    epilogue: Any
    prefetch: Any = None    # prefetch(k): what step k's copies index by, into registers, before the waits


def _seesaw(steps, loads, q, kv, kv_s, raw, v, valid_rows, visible, scale, stages, swapped, epilogue, trace,
            units=None, own_p=False):
    block_m, block_n = q[0].shape[0], kv[0][0]
    rest = [p for p in range(len(kv)) if p not in v]
    if swapped or raw is not None or len(v) != 2 or not rest or stages % 2:
        raise ValueError("attention_loop(seesaw=True) is built for plain staging (no raw format), swapped=False, two "
                         f"value parts, a kv part that is not a value part, and an even number of stages; got "
                         f"swapped={swapped}, raw={'set' if raw is not None else None}, v={v}, stages={stages}")
    p_part = rest[-1]
    if (kv[p_part][0], kv[p_part][1], kv[p_part][2]) != (block_m, block_n, kv[v[0]][2]):
        raise ValueError(f"attention_loop(seesaw=True) writes P ({block_m} x {block_n}, {kv[v[0]][2]}) over kv part "
                         f"{p_part}, which is {kv[p_part]}: they must match")
    # each warpgroup its own fragments: TileLang lays a fragment out over the threads of the branch that
    # first uses it, so one shared between the two warpgroups' branches gets no code in the other
    f = [_SeesawRegs(T.alloc_fragment((block_m, block_n), "float32"),
                     T.alloc_fragment((block_m, kv[v[0]][1]), "float32"),
                     *(T.alloc_fragment((block_m,), "float32") for _ in range(6)),
                     T.alloc_fragment((block_m, block_n), kv[v[0]][2]) if own_p else None) for _ in range(2)]
    n = stages * len(kv)
    empty = _empty_barriers(n)
    sw = _Seesaw(p_part, len(kv), T.alloc_shared((2, block_m), "float32"), T.alloc_shared((2, block_m), "float32"),
                 T.alloc_shared((4, block_m), "float32"), (T.alloc_barrier([WG]), T.alloc_barrier([WG])),
                 T.alloc_barrier([WG]), T.alloc_barrier([PRODUCER] * n), empty,
                 T.alloc_barrier([PRODUCER]),
                 *((T.alloc_barrier([PRODUCER]), T.alloc_barrier([2 * WG])) if units is not None else (None, None)))
    if units is not None and units.early_query and units.query_staging:
        raise ValueError("attention_loop(units=...): early_query (the next query loaded under the last P V) and "
                         "query_staging (the epilogue writes the query tiles) exclude each other")
    if units is not None and units.steps_first and not units.query_staging:
        raise ValueError("attention_loop(units=...): steps_first (the next unit's first steps before its query) is "
                         "built for query_staging (the query waits for the epilogue)")
    if units is None:
        unit = _Unit(steps, loads, valid_rows, visible, epilogue)
        _seesaw_warpgroups(unit, q, kv_s, v, scale, f[0], f[1], sw, stages, kv[v[0]][1], trace)
        return
    # one set of scalars serves every role (each thread runs one role's code on its own registers)
    u = units.bind()
    cnt = _Counts(*(T.alloc_var("int32", init=0) for _ in range(5)))
    unit = _Unit(u.steps, u.loads, u.valid_rows, _Visible(u.visible, u.all_visible), u.epilogue,
                 getattr(u, "prefetch", None))
    _seesaw_units(units, u, unit, q, kv_s, v, scale, f[0], f[1], sw, stages, kv[v[0]][1], block_n, cnt, trace)


@T.macro
def _seesaw_warpgroups(unit, q, kv, v, scale, f0, f1, sw, stages, col1, trace):
    _timeline(trace, 0)
    T.sync_threads()                    # the program's own shared-memory writes (the query tiles) are done
    tx = T.get_thread_binding()
    if tx < WG:
        T.set_max_nreg(SEESAW_REGS, 1)
        _seesaw_wg0(unit, _At(), q, kv, v, scale, f0.acc_s, f0.o, f0.m_i, f0.m_prev, f0.alpha, f0.row_sum, f0.l_i,
                    sw, stages, trace, f0.p)
        _seesaw_finish(0, f0.o, 0, f0.l_i, f0.m_i, sw, unit.epilogue, 0)
        _timeline(trace, 1)
    elif tx < 2 * WG:
        T.set_max_nreg(SEESAW_REGS, 1)
        _seesaw_wg1(unit, _At(), q, kv, v, scale, f1.acc_s, f1.o, f1.m_i, f1.m_prev, f1.alpha, f1.alpha0,
                    f1.row_sum, f1.l_i, sw, stages, trace, f1.p)
        _seesaw_finish(1, f1.o, col1, f1.l_i, f1.m_i, sw, unit.epilogue, 0)
    else:
        T.set_max_nreg(SEESAW_PRODUCER_REGS, 0)
        _seesaw_producer(unit, _At(), kv, v, sw, stages, trace, 0, unit.steps)


# ---- units (tile.Units): a persistent CTA runs the seesaw over a list of units back to back ----------
#
# Every step-indexed barrier takes the CTA's global step g + k (slot (g + k) % stages, its parity), the
# pair barriers the CTA's pair count, the tail barrier the count of earlier units with a partial last
# step. The query comes by TMA (q_full), issued once both MMA warpgroups are done with the last unit's
# (q_empty): by default after its last P V, so the next unit's query and first steps load under the
# last one's epilogue; with Units.early_query right after each warpgroup's last scores, so the query
# loads under the last P V too and the next unit's steps follow as their slots are released; with
# Units.query_staging after the epilogue, which used the query tiles to stage its output (with steps_first the
# next unit's first whole steps, at most `stages`, are issued before it, loading under the epilogue: _ahead).

@dataclass(frozen=True)
class _Counts:
    """A persistent CTA's running counts (int32 variables, each thread its own role's): steps, pairs and
    whole pairs of the units before, tail phases used, units done."""

    g: Any
    J: Any
    F: Any
    tp: Any
    done: Any


def _unit_at(cnt):
    return _At(cnt.g[0], cnt.J[0], cnt.F[0], cnt.tp[0])


def _advance(unit, block_n, cnt):
    _advance_counts(unit.steps, unit.valid_rows, block_n, cnt.g, cnt.J, cnt.F, cnt.tp, cnt.done)


@T.macro
def _seesaw_units(units, u, unit, q, kv, v, scale, f0, f1, sw, stages, col1, block_n, cnt, trace):
    # trace: the stamps go by the CTA's pair (producer: step) count, across its units
    _timeline(trace, 0)
    T.sync_threads()                    # barrier initialization is visible to every role
    tx = T.get_thread_binding()
    if tx < WG:
        _seesaw_units_mma(0, units, u, unit, q, kv, v, scale, f0, sw, stages, 0, block_n, cnt, trace)
        _timeline(trace, 1)
    elif tx < 2 * WG:
        _seesaw_units_mma(1, units, u, unit, q, kv, v, scale, f1, sw, stages, col1, block_n, cnt, trace)
    else:
        T.set_max_nreg(SEESAW_PRODUCER_REGS, 0)
        for x in T.serial(units.end - units.begin):
            u.load(units.begin + x)
            if units.steps_first:       # (the steps before the query: _ahead)
                _seesaw_producer(unit, _unit_at(cnt), kv, v, sw, stages, trace, 0, _ahead(units, unit, stages, block_n))
            T.mbarrier_wait_parity(sw.q_empty[0], (cnt.done[0] % 2) ^ 1)          # the last unit's query is read
            _issue_query(u.query(), q, sw.q_full[0])
            _stamp(trace, cnt.J[0], "prod q issue")
            _seesaw_producer(unit, _unit_at(cnt), kv, v, sw, stages, trace, _ahead(units, unit, stages, block_n),
                             unit.steps)
            _advance(unit, block_n, cnt)


@T.macro
def _seesaw_units_mma(n, units, u, unit, q, kv, v, scale, f, sw, stages, col, block_n, cnt, trace):
    # MMA warpgroup n's units: each once its query has landed; q_empty once the unit is done
    # (units.early_query: each warpgroup arrives on q_empty right after its last scores, inside its loop, so the
    # producer loads the next unit's query under the last P V and the epilogue)
    T.set_max_nreg(SEESAW_REGS, 1)
    early = sw.q_empty if units.early_query else None
    for x in T.serial(units.end - units.begin):
        u.load(units.begin + x)
        T.mbarrier_wait_parity(sw.q_full[0], cnt.done[0] % 2)
        if n == 0:
            _stamp(trace, cnt.J[0], "wg0 q_full")
            _seesaw_wg0(unit, _unit_at(cnt), q, kv, v, scale, f.acc_s, f.o, f.m_i, f.m_prev, f.alpha, f.row_sum,
                        f.l_i, sw, stages, trace, f.p, early)
        else:
            _seesaw_wg1(unit, _unit_at(cnt), q, kv, v, scale, f.acc_s, f.o, f.m_i, f.m_prev, f.alpha, f.alpha0,
                        f.row_sum, f.l_i, sw, stages, trace, f.p, early)
        if early is None and not units.query_staging:
            T.mbarrier_arrive(sw.q_empty[0])
        if n == 0:   # (the trace's hand-over stamps at the unit's last pair)
            _seesaw_finish(n, f.o, col, f.l_i, f.m_i, sw, unit.epilogue, cnt.done[0] % 2, trace,
                           cnt.J[0] + T.ceildiv(unit.steps, 2) - 1)
            _stamp(trace, cnt.J[0] + T.ceildiv(unit.steps, 2) - 1, "wg0 stored")
        else:
            _seesaw_finish(n, f.o, col, f.l_i, f.m_i, sw, unit.epilogue, cnt.done[0] % 2)
        if units.query_staging:     # the epilogue's reads of its staging (the query tiles) are done
            T.mbarrier_arrive(sw.q_empty[0])
        _advance(unit, block_n, cnt)


def _ahead(units, unit, stages, block_n):
    # how many of the unit's first steps the producer issues before its query: none, or with Units.steps_first (the
    # query tiles are free only after the last unit's epilogue) its first whole steps, at most `stages`, loading under
    # that epilogue (their slots are released by the last P V). Not a tail step: its arrival on the one tail barrier
    # could complete the phase after the one that the last unit's tail step has not been waited on yet (q_empty
    # comes after that wait)
    return T.max(T.min(T.min(unit.steps, stages), unit.valid_rows // block_n), 0) if units.steps_first else 0


def _issue_query(copies, q, bar):
    # the unit's query tiles by TMA; every producer thread then arrives (TMA adds the bytes)
    for src, part in copies:
        emit(T.tma_copy(src, q[part][0:q[part].shape[0], :], barrier=bar))
    emit(T.mbarrier_arrive(bar))


@T.macro
def _advance_counts(steps, valid_rows, block_n, g, J, F, tp, done):
    # the unit is done: move every role's count past its steps, pairs and tail phase (a unit whose last
    # step is partial used one)
    tp = tp + T.if_then_else(T.And(steps > 0, valid_rows < steps * block_n), 1, 0)
    g = g + steps
    J = J + T.ceildiv(steps, 2)
    F = F + steps // 2
    done = done + 1


@T.macro
def _seesaw_producer(unit, at, kv, v, sw, stages, trace, k0, k1):
    # steps k0 .. k1 - 1 of the unit, part by part, in order, each as soon as its readers have released it
    for kk in T.serial(k1 - k0):
        k = k0 + kk
        if unit.prefetch is not None:
            unit.prefetch(k)
        _issue_parts(unit.loads, k, at.g, kv, stages, sw)
        _stamp(trace, at.g + k, "prod wait2/issue")
        if _valid(unit.valid_rows, k, kv) < kv[0].shape[1]:
            _wait_full(sw, at.g + k, stages, v)
            _zero_rows(kv, v, (at.g + k) % stages, _valid(unit.valid_rows, k, kv))
            T.fence_proxy_async()                                       # generic stores -> WGMMA reads
            T.mbarrier_arrive(sw.tail[0])


def _issue_parts(loads, k, g, kv, stages, sw):
    # step k's copies (the CTA's step g + k) part by part, each once its slot's part is released; every
    # producer thread arrives on the part's full barrier (TMA adds the bytes)
    for part in range(len(kv)):
        bar = sw.full[_part(sw, g + k, stages, part)]
        emit(T.mbarrier_wait_parity(sw.empty[_part(sw, g + k, stages, part)], (((g + k) // stages) % 2) ^ 1))
        for src, p, row0, rows in loads(k):
            if p == part:
                emit(T.tma_copy(src, kv[p][(g + k) % stages, row0:row0 + rows, :], barrier=bar))
        emit(T.mbarrier_arrive(bar))


def _part(sw, k, stages, p):
    # the index of step k's kv part p in the per-part barriers (full, empty)
    return (k % stages) * sw.parts + p


def _wait_full(sw, k, stages, parts):
    for p in parts:
        emit(T.mbarrier_wait_parity(sw.full[_part(sw, k, stages, p)], (k // stages) % 2))


def _seesaw_scores(q, kv, k, stages, sw, acc_s, landed=None):
    # S = sum_p Q_p K_p^T of step k, each part's MMAs issued once its bytes landed; one wait;
    # landed: (trace, index, event) stamped once the last part has landed
    for p, (qt, kt) in enumerate(zip(q, kv)):
        _wait_full(sw, k, stages, [p])
        if landed is not None and p == len(q) - 1:
            _stamp(*landed)
        emit(T.wgmma_gemm(qt, kt[k % stages, :, :], acc_s, transpose_B=True, clear_accum=(p == 0), policy=FULL_ROW))
    emit(T.wait_wgmma(0))


def _issue_pv(kv, sw, v_w, k, stages, acc):
    # acc += P V_w with step k's P (written over its slot's P part), left in flight
    emit(T.wgmma_gemm(kv[sw.p_part][k % stages, :, :], v_w[k % stages, :, :], acc, transpose_B=False,
                      clear_accum=False, policy=FULL_ROW))


def _issue_pv_regs(p_r, v_w, k, stages, acc):
    # acc += P V_w with P from this warpgroup's registers (wgmma RS), left in flight
    emit(T.wgmma_gemm(p_r, v_w[k % stages, :, :], acc, transpose_B=False, clear_accum=False, policy=FULL_ROW))


def _release(sw, k, stages, parts, times=1):
    # this warpgroup is done with kv parts `parts` of step k's slot (every call site follows the WGMMA wait
    # of the reads it releases, as _release_slot needs)
    for p in parts:
        for _ in range(times):
            _release_slot(sw.empty, _part(sw, k, stages, p))


@T.macro
def _wait_tail(k, kv, valid_rows, sw, tp):
    # before a P V of the last step: its value rows past the valid ones are zeroed (P is 0 there,
    # 0 * NaN is not); tp: the tail phases used before
    if _valid(valid_rows, k, kv) < kv[0].shape[1]:
        T.mbarrier_wait_parity(sw.tail[0], tp % 2)


@T.macro
def _publish(k, acc_s, kv, sw, stages, alpha, m_i, n, bar):
    # step k's P over its slot's P part, its alpha and the running max into row n; all of this
    # warpgroup's threads have written before ready[n] and before its own P V reads P (acc_s: the
    # scores, or own_p's P already in the MMA dtype)
    T.copy(acc_s, kv[sw.p_part][k % stages, :, :])
    for i in T.Parallel(alpha.shape[0]):
        sw.alpha[n, i] = alpha[i]
        sw.m[n, i] = m_i[i]
    T.fence_proxy_async()
    T.sync_threads(bar, WG)
    T.mbarrier_arrive(sw.ready[n][0])


@T.macro
def _seesaw_wg0(unit, at, q, kv, v, scale, acc_s, o, m_i, m_prev, alpha, row_sum, l_i, sw, stages, trace, p_r=None,
                q_done=None):
    # pair j = steps (e0, e1) = (2j, 2j + 1): score e0 and take its softmax from WG1's last max, hand
    # P over, O_0 += P V_0 of e0, then, once WG1 has handed e1 over, of e1 (steps local to the unit;
    # slots and barrier phases from `at`). p_r (own_p): e0's P V reads P from registers (the
    # shared-memory copy is WG1's only). q_done: a barrier to arrive on once the query's last read is done
    T.fill(m_i, NEG_INF)
    T.fill(l_i, 0.0)
    T.fill(o, 0.0)
    if q_done is not None:
        if unit.steps == 0:
            T.mbarrier_arrive(q_done[0])
    for j in T.serial(T.ceildiv(unit.steps, 2)):
        _stamp(trace, at.J + j, "wg0 ready")
        _seesaw_scores(q, kv, at.g + 2 * j, stages, sw, acc_s)
        T.mbarrier_arrive(sw.scored[0])
        if q_done is not None:
            if 2 * j + 2 >= unit.steps:                             # WG0's last scores of the unit
                T.mbarrier_arrive(q_done[0])
        _release(sw, at.g + 2 * j, stages, [v[1]])                  # WG0's read of V_1 of e0 (its scores)
        _stamp(trace, at.J + j, "wg0 S")
        _softmax(2 * j, acc_s, unit.visible, scale, m_i, m_prev, alpha, row_sum, l_i)
        _stamp(trace, at.J + j, "wg0 softmax")
        if p_r is None:
            _publish(at.g + 2 * j, acc_s, kv, sw, stages, alpha, m_i, 0, WG0_BAR)
            _stamp(trace, at.J + j, "wg0 p_ready")
            _wait_tail(2 * j, kv, unit.valid_rows, sw, at.tp)
            _scale_rows(o, alpha)
            _issue_pv(kv, sw, kv[v[0]], at.g + 2 * j, stages, o)
        else:
            # (the hand-off's copy of P first: PTX leaves reading an in-flight WGMMA's A registers undefined)
            T.copy(acc_s, p_r)
            _publish(at.g + 2 * j, p_r, kv, sw, stages, alpha, m_i, 0, WG0_BAR)
            _stamp(trace, at.J + j, "wg0 p_ready")
            _wait_tail(2 * j, kv, unit.valid_rows, sw, at.tp)
            _scale_rows(o, alpha)
            _issue_pv_regs(p_r, kv[v[0]], at.g + 2 * j, stages, o)
        # released before waiting for WG1's step: V_0 of e0 then reloads ~1300 cycles earlier, under
        # WG1's softmax, and the next pair's scores start on it (trace: they waited for the bytes)
        T.wait_wgmma(0)
        _release(sw, at.g + 2 * j, stages, [v[0]], 2)               # V_0 of e0: WG0 is its only reader
        _release(sw, at.g + 2 * j, stages, [sw.p_part])
        _stamp(trace, at.J + j, "wg0 PV+empty")
        if 2 * j + 1 < unit.steps:
            T.mbarrier_wait_parity(sw.ready[1][0], (at.F + j) % 2)
            _stamp(trace, at.J + j, "wg0 p_free")
            for i in T.Parallel(alpha.shape[0]):
                alpha[i] = sw.alpha[1, i]
                m_i[i] = sw.m[1, i]
                l_i[i] *= sw.alpha[1, i]
            _wait_tail(2 * j + 1, kv, unit.valid_rows, sw, at.tp)
            _scale_rows(o, alpha)
            _issue_pv(kv, sw, kv[v[0]], at.g + 2 * j + 1, stages, o)
            T.wait_wgmma(0)
            _release(sw, at.g + 2 * j + 1, stages, [v[0], sw.p_part])


@T.macro
def _seesaw_wg1(unit, at, q, kv, v, scale, acc_s, o, m_i, m_prev, alpha, alpha0, row_sum, l_i, sw, stages, trace,
                p_r=None, q_done=None):
    # pair j: score e1 (under WG0's softmax of e0); once WG0 hands e0 over, O_1 += P V_1 of e0 in
    # flight under the softmax of e1 (from WG0's max), hand e1 over, then O_1 += P V_1 of e1
    T.fill(m_i, NEG_INF)
    T.fill(l_i, 0.0)
    T.fill(o, 0.0)
    if q_done is not None:
        if unit.steps < 2:                                          # no scores of its own in this unit
            T.mbarrier_arrive(q_done[0])
    for j in T.serial(T.ceildiv(unit.steps, 2)):
        if 2 * j + 1 < unit.steps:
            T.mbarrier_wait_parity(sw.scored[0], (at.J + j) % 2)
            _seesaw_scores(q, kv, at.g + 2 * j + 1, stages, sw, acc_s, (trace, at.J + j, "wg1 landed"))
            if q_done is not None:
                if 2 * j + 3 >= unit.steps:                         # WG1's last scores of the unit
                    T.mbarrier_arrive(q_done[0])
            _release(sw, at.g + 2 * j + 1, stages, [v[0]])          # WG1's read of V_0 of e1 (its scores)
            _stamp(trace, at.J + j, "wg1 raw")
        T.mbarrier_wait_parity(sw.ready[0][0], (at.J + j) % 2)
        # (already complete: orders e0's TMA bytes before this warpgroup's own reads)
        _wait_full(sw, at.g + 2 * j, stages, [v[1]])
        _wait_tail(2 * j, kv, unit.valid_rows, sw, at.tp)
        _stamp(trace, at.J + j, "wg1 p_ready")
        for i in T.Parallel(alpha0.shape[0]):
            alpha0[i] = sw.alpha[0, i]
            m_i[i] = sw.m[0, i]
            l_i[i] *= sw.alpha[0, i]
        _scale_rows(o, alpha0)
        _issue_pv(kv, sw, kv[v[1]], at.g + 2 * j, stages, o)
        if 2 * j + 1 < unit.steps:
            _softmax(2 * j + 1, acc_s, unit.visible, scale, m_i, m_prev, alpha, row_sum, l_i)
            if p_r is None:
                _publish(at.g + 2 * j + 1, acc_s, kv, sw, stages, alpha, m_i, 1, WG1_BAR)
            else:                           # (own_p: P kept in registers for e1's P V)
                T.copy(acc_s, p_r)
                _publish(at.g + 2 * j + 1, p_r, kv, sw, stages, alpha, m_i, 1, WG1_BAR)
            _stamp(trace, at.J + j, "wg1 convert")
        T.wait_wgmma(0)
        _release(sw, at.g + 2 * j, stages, [v[1], sw.p_part])
        if 2 * j + 1 < unit.steps:
            _wait_tail(2 * j + 1, kv, unit.valid_rows, sw, at.tp)
            _scale_rows(o, alpha)
            if p_r is None:
                _issue_pv(kv, sw, kv[v[1]], at.g + 2 * j + 1, stages, o)
            else:
                _issue_pv_regs(p_r, kv[v[1]], at.g + 2 * j + 1, stages, o)
            T.wait_wgmma(0)
            _release(sw, at.g + 2 * j + 1, stages, [v[1]], 2)       # V_1 of e1: WG1 is its only reader
            _release(sw, at.g + 2 * j + 1, stages, [sw.p_part])
        _stamp(trace, at.J + j, "wg1 PV+free")


@T.macro
def _seesaw_finish(n, o, col, l_i, m_i, sw, epilogue, b, trace=None, pair=0):
    # both warpgroups end on the same running max; the row sum is the sum of their two (rows of
    # parity b: a warpgroup a unit ahead writes the other pair of rows); trace: "wg0 sums" at `pair`
    for i in T.Parallel(l_i.shape[0]):
        sw.l[2 * b + n, i] = l_i[i]
    T.sync_threads(SEESAW_BAR, 2 * WG)
    _stamp(trace, pair, "wg0 sums")
    for i in T.Parallel(l_i.shape[0]):
        l_i[i] = sw.l[2 * b, i] + sw.l[2 * b + 1, i]
    epilogue(o, col, l_i, m_i, n == 0)
