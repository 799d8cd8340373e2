"""sm_90a MLA decode for the FP8 cache with the query in registers: ops.mla_decode_qreg's three roles, the cache
converted to fp16 operand tiles by the P V warpgroups (64 query rows a CTA: h_q = 64 and 128, and any other row
count with its last tile padded; bench/NOTES.md "Session 54: the FP8 cache with Q in registers").

Why: above 32 query rows the FP8 cache runs today through converted bf16 tiles at 0.7-0.8x the bf16 cache's speed
(its conversion sits in the MMA warpgroups' critical path). With Q in WG0's registers the P V warpgroups have issue
slots to spare (a step is the tensor pipe's ~1250 cycles; each of their warps issues ~140 instructions of it in
the bf16 kernel), so they convert the raw steps two ahead of their use, and WG0 sees fp16 tiles as
ops.mla_decode_qreg sees bf16 ones:

    WG1 (producer too), WG2   raw step k + 2 (e4m3 latent half w, its group scales) -> fp16 tile half w of the
                              converted slot; then the P V of step k on that half (V = the converted half, MN-major)
    WG0                       Q's latent in fp16 registers; S = Q_lat K_lat^T (RS, fp16 tiles) + Q_rope K_rope^T
                              (SS, bf16: the cache's rope straight from the raw slot); the softmax; P (fp16)

e4m3 -> fp16 is exact; the group scale multiplies in fp16 (a product rounded to 11 bits, against bf16's 8 for the
bf16 cache's own values). fp16 tiles hold cache values up to 65504 in magnitude (larger give inf); the scales
(quantize_mla_kv_fp8: a group's largest magnitude / 448) are then in fp16's range, subnormal (fewer bits: ~0.6% at
a largest magnitude of 0.0045) for groups whose values all lie below ~0.027. Q's latent is rounded to fp16 (|q|
above 65504 gives inf, as the <= 16-row FP8 kernel documents). P in fp16.

Shared memory: a raw ring of 5 steps (32 tokens: two e4m3 halves 2 x 8 KB, the scales 512 B, the rope 4 KB) and a
converted ring of 3 (two fp16 halves 2 x 16 KB, P 4 KB, the factors): 219.5 KB.

Synchronization: raw_full[r] (TMA bytes, WG1's 128 arrivals); conv_full[c] (the converters' 256, after their fp16
stores and a proxy fence): WG0 may read the slot's tiles and write its P and factors (both P V warpgroups have
finished the step three before, whose P sat there); raw_empty[r] (the converters' 256 after their reads, WG0's 128
after the rope MMA retired): WG1 reloads it; ready[c] (WG0's 128) as ops.mla_decode_qreg. A converted half is
rewritten only by its own warpgroup after its P V of the step before retired and after it passed that step's ready
(WG0's score MMAs on the slot retired before it arrived there).

Status: right on the GPU (its tests, H100, session 55); 1.04-1.06x the op's FP8 kernel at h_q 128 (128 x 128 x 4096
0.393 ms against 0.410), 0.92x at 64 rows, so the op does not take it (QREG_FP8 off: the fp16 range limits for
~5%); WG0's step is serial as in ops.mla_decode_qreg (bench/NOTES.md "Session 55"). Bench provider
tilecraft-fp8-qreg.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T

from codegen.program import tile_program
from ops.mla_decode_fp8_rs import _rs2_page, _split_range
from ops.mla_decode_qreg import (BLOCK, D_QK, D_ROPE, D_V, HALF, HELPER_SOURCE, ROWS, SPAN_ROW, STEP, TRACE_STEPS,
                                 _row_sums, _softmax, _span, _stamp, _store)

TOKEN_BYTES = 656                # the FP8 cache's token: 512 e4m3, 4 fp32 scales, 64 bf16 (ops.quantize_mla_kv_fp8)
SCALE_WORD = D_V // 4            # the scales as 32-bit words of the token
ROPE_HALF = (D_V + 16) // 2      # the rope as 16-bit words of the token
GROUP = 128                      # latent columns a scale
RAW_RING, RING, AHEAD = 5, 3, 2  # raw steps in flight, converted slots, steps the converters run ahead of the P V
# setmaxnreg: WG0 (scores, softmax), WG1 (converter, P V, producer), WG2 (converter, P V); 504 = 3 x 168 in all
REGS = (176, 160, 168)
RESCALE_SOURCE = r"""
// lazy_rescale: whether a row of this thread's warp has a factor other than 1 this step (a warp of a warpgroup holds
// the accumulator rows 16 w + lane / 4 and those + 8); where none has, O times the factors would change no bit
__device__ __forceinline__ int qreg_rescale_needed(const float* al) {
  const int r = ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2);
  return __any_sync(0xffffffffu, al[r] != 1.0f || al[r + 8] != 1.0f);
}
"""
TRACE_EVENTS = {0: ("start", "converted", "scores issued", "scores done", "softmax", "P ready"),
                1: ("start", "converted ahead", "P ready", "P V issued", "P V done", "raw free", "reloaded"),
                2: ("start", "converted ahead", "P ready", "P V issued", "P V done")}


def _check(rows, page, dtype, raw_ring, ring, ahead):
    if rows < 1:
        raise ValueError(f"mla_decode_fp8_qreg needs query rows (s_q * h_q >= 1), got {rows}")
    if page < BLOCK or page % BLOCK:
        raise ValueError(f"mla_decode_fp8_qreg steps inside one page: page must be a multiple of {BLOCK}, got {page}")
    if dtype != "bfloat16":
        raise ValueError(f"the FP8 cache's rope is bf16: the query must be bfloat16, got {dtype}")
    if not (1 <= ahead < ring and ahead < raw_ring):
        raise ValueError(f"mla_decode_fp8_qreg: the converters run 1 to ring - 1 steps ahead (and fewer than "
                         f"raw_ring), got ahead={ahead}, ring={ring}, raw_ring={raw_ring}")


@T.macro
def _issue_raw(KV, KVf, KVh, BlockTable, bi, tok, page, max_blocks, num_pages, r0_s, r1_s, sc_s, rr_s, raw_full,
               rslot):
    # the raw step of tokens [tok, tok + STEP) (inside one page) into raw slot rslot: the e4m3 halves, the scales,
    # the bf16 rope; every producer thread arrives on raw_full[rslot]
    pidx = _rs2_page(BlockTable, bi, tok // BLOCK, page, max_blocks, num_pages)
    off = tok % page
    T.tma_copy(KV[pidx, off:off + STEP, 0:HALF], r0_s[rslot, :, :], barrier=raw_full[rslot])
    T.tma_copy(KV[pidx, off:off + STEP, HALF:D_V], r1_s[rslot, :, :], barrier=raw_full[rslot])
    T.tma_copy(KVf[pidx, off:off + STEP, SCALE_WORD:SCALE_WORD + D_V // GROUP], sc_s[rslot, :, :],
               barrier=raw_full[rslot])
    T.tma_copy(KVh[pidx, off:off + STEP, ROPE_HALF:ROPE_HALF + D_ROPE], rr_s[rslot, :, :], barrier=raw_full[rslot])
    T.mbarrier_arrive(raw_full[rslot])


@T.macro
def _convert(w, k, t0, seqlen, raw_ring, ring, r_s, sc_s, c_s, raw_full, raw_empty, conv_full):
    # converter w (WG1: 0, WG2: 1): raw step k's latent half w -> fp16 (e4m3 exactly, times its group's scale in
    # fp16) into converted slot k % ring; tokens at or past the sequence's end as zeros (the cache may hold NaN there:
    # their P is 0, and 0 x NaN would not be)
    rslot = k % raw_ring
    T.mbarrier_wait_parity(raw_full[rslot], (k // raw_ring) % 2)
    for j, c in T.Parallel(STEP, HALF):
        c_s[k % ring, j, c] = T.cast(r_s[rslot, j, c], "float16") * \
            T.cast(sc_s[rslot, j, w * (HALF // GROUP) + c // GROUP], "float16")
    if t0 + STEP > seqlen:           # a sequence's short last step: its tokens past the end zeroed (the same threads
        for j, c in T.Parallel(STEP, HALF):      # wrote them above: the same loop's layout)
            if t0 + j >= seqlen:
                c_s[k % ring, j, c] = T.cast(0, "float16")
    T.fence_proxy_async()            # (the tile is read by WGMMA: the async proxy)
    T.mbarrier_arrive(raw_empty[rslot])
    T.mbarrier_arrive(conv_full[k % ring])


@T.macro
def _pv_loop(w, n_iter, tok0, seqlen, raw_ring, ring, ahead, r_s, sc_s, c_s, raw_full, raw_empty, conv_full, ready,
             al_s, p_s, o, lazy_rescale, produce, stamps=None):
    # P V warpgroup w: each step k converts raw step k + ahead into its half of the converted ring, then
    # O_w = alpha * O_w + P V_w (V_w: its converted half of step k, read MN-major); produce(k) (WG1's): once step k's
    # raw slot is released by both converters and WG0, the raw step k + raw_ring into it
    T.set_max_nreg(REGS[1 + w], 0)
    T.clear(o)
    for k in T.serial(T.min(n_iter, ahead)):
        _convert(w, k, tok0 + k * STEP, seqlen, raw_ring, ring, r_s, sc_s, c_s, raw_full, raw_empty, conv_full)
    for k in T.serial(n_iter):
        _stamp(stamps, k, 0)
        if k + ahead < n_iter:
            _convert(w, k + ahead, tok0 + (k + ahead) * STEP, seqlen, raw_ring, ring, r_s, sc_s, c_s, raw_full,
                     raw_empty, conv_full)
        _stamp(stamps, k, 1)
        slot = k % ring
        T.mbarrier_wait_parity(ready[slot], (k // ring) % 2)
        _stamp(stamps, k, 2)
        if lazy_rescale:
            if T.call_extern("int32", "qreg_rescale_needed", T.access_ptr(al_s[slot, 0], "r", ROWS)) != 0:
                for i, j in T.Parallel(ROWS, HALF):
                    o[i, j] = o[i, j] * al_s[slot, i]
        else:
            for i, j in T.Parallel(ROWS, HALF):
                o[i, j] = o[i, j] * al_s[slot, i]
        T.wgmma_gemm(p_s[slot, :, :], c_s[slot, :, :], o)
        _stamp(stamps, k, 3)
        T.wait_wgmma(0)
        _stamp(stamps, k, 4)
        if produce is not None:
            if k + raw_ring < n_iter:
                T.mbarrier_wait_parity(raw_empty[k % raw_ring], (k // raw_ring) % 2)
                _stamp(stamps, k, 5)
                produce(k)
                _stamp(stamps, k, 6)


@tile_program(
    "mla_decode_fp8_qreg",
    targets=("cuda:sm_90a",),
    examples={"h128": dict(h_q=128, s_q=1)},
    pass_configs=lambda t, params: {"tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                                      "tl.disable_safe_memory_legalize": True, "tl.enable_fast_math": True},
)
def mla_decode_fp8_qreg_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                                raw_ring: int = RAW_RING, ring: int = RING, ahead: int = AHEAD,
                                defer_ready: bool = True, lazy_rescale: bool = True, trace: bool = False):
    """The FP8-cache MLA decode with Q in registers (this module's docstring): mla_decode_program's grid, arguments
    and outputs with kv_format="fp8" (KV the e4m3 view of the 656-byte tokens, KVf its 32-bit words, KVh its 16-bit
    words). raw_ring / ring: raw and converted 32-token slots; ahead: steps the converters run ahead of their P V.
    defer_ready and trace as ops.mla_decode_qreg's (its bench.trace_mla_qreg reads the stamps with --fp8).
    lazy_rescale (default): a P V warp skips O *= the step's factors where all its rows' factors are 1 (the running
    maxima did not move: most steps after the first few), 128 multiplies a thread of the step's ~360 instructions;
    the same bits either way."""
    rows = s_q * h_q
    _check(rows, page, dtype, raw_ring, ring, ahead)
    causal = causal and s_q > 1
    m_tiles = -(-rows // ROWS)
    rows_pad = m_tiles * ROWS          # a last tile past s_q * h_q: its rows read zeros and store nothing
    batch, num_pages, max_blocks, slots = T.dynamic("batch, num_pages, max_blocks, slots")
    neg_inf = -T.infinity("float32")

    @T.prim_func
    def mla_decode_fp8_qreg(
        Q: T.Tensor((batch, rows, D_QK), "bfloat16"),
        KV: T.Tensor((num_pages, page, TOKEN_BYTES), "float8_e4m3fn"),
        KVf: T.Tensor((num_pages, page, TOKEN_BYTES // 4), "float32"),
        KVh: T.Tensor((num_pages, page, TOKEN_BYTES // 2), "bfloat16"),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), "bfloat16"),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, rows_pad, D_V), "float32"),
        LsePart: T.Tensor((slots, rows_pad), "float32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(batch * max_splits * m_tiles, threads=3 * 128) as bid:
            stamps = [T.access_ptr(OPart[bid, r, 0], "w", 8 * TRACE_STEPS) if trace else None for r in range(3)]
            span = T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8) if trace else None
            r0_s = T.alloc_shared((raw_ring, STEP, HALF), "float8_e4m3fn")       # raw latent columns 0..255
            r1_s = T.alloc_shared((raw_ring, STEP, HALF), "float8_e4m3fn")       # raw latent columns 256..511
            sc_s = T.alloc_shared((raw_ring, STEP, D_V // GROUP), "float32")    # the raw tokens' group scales
            rr_s = T.alloc_shared((raw_ring, STEP, D_ROPE), "bfloat16")         # the rope (read by WG0's MMAs)
            c0_s = T.alloc_shared((ring, STEP, HALF), "float16")               # converted half 0 (WG1's V)
            c1_s = T.alloc_shared((ring, STEP, HALF), "float16")               # converted half 1 (WG2's V)
            qr_s = T.alloc_shared((ROWS, D_ROPE), "bfloat16")
            p_s = T.alloc_shared((ring, ROWS, STEP), "float16")
            al_s = T.alloc_shared((ring, ROWS), "float32")
            l_s = T.alloc_shared((ROWS,), "float32")
            raw_full = T.alloc_barrier([128] * raw_ring)
            raw_empty = T.alloc_barrier([384] * raw_ring)
            conv_full = T.alloc_barrier([256] * ring)
            ready = T.alloc_barrier([128] * ring)
            q0 = T.alloc_fragment((ROWS, HALF), "float16")
            q1 = T.alloc_fragment((ROWS, HALF), "float16")
            s = T.alloc_fragment((ROWS, STEP), "float32")
            m = T.alloc_fragment((ROWS,), "float32")
            m_new = T.alloc_fragment((ROWS,), "float32")
            l = T.alloc_fragment((ROWS,), "float32")
            ls = T.alloc_fragment((ROWS,), "float32")
            o0 = T.alloc_fragment((ROWS, HALF), "float32")
            o1 = T.alloc_fragment((ROWS, HALF), "float32")

            mt = bid % m_tiles
            si = (bid // m_tiles) % max_splits
            bi = bid // (m_tiles * max_splits)
            row0 = mt * ROWS
            splits = Splits[bi]
            seqlen = SeqLens[bi]
            tx = T.get_thread_binding()
            T.import_source(HELPER_SOURCE + RESCALE_SOURCE)
            _span(span, 0, 0, 0)
            split_v = T.alloc_local((2,), "int32")
            split_v[0], split_v[1] = _split_range(si, splits, T.ceildiv(seqlen, BLOCK))
            tok0 = split_v[0] * BLOCK
            n_iter = T.max(T.min(split_v[1] * (BLOCK // STEP), T.ceildiv(seqlen - tok0, STEP)), 0)
            base = seqlen - s_q + 1 if causal else seqlen

            if tx >= 128 and tx < 256:                                # WG1: the raw ring's first steps
                for k in T.serial(T.min(n_iter, raw_ring)):
                    _issue_raw(KV, KVf, KVh, BlockTable, bi, tok0 + k * STEP, page, max_blocks, num_pages, r0_s, r1_s,
                               sc_s, rr_s, raw_full, k)
            if rows == rows_pad:
                T.copy(Q[bi, row0:row0 + ROWS, D_V:D_QK], qr_s)
            else:
                for i, j in T.Parallel(ROWS, D_ROPE):
                    qr_s[i, j] = T.if_then_else(row0 + i < rows, Q[bi, T.min(row0 + i, rows - 1), D_V + j],
                                                T.cast(0, "bfloat16"))
            T.fence_proxy_async()
            T.sync_threads()
            if tx < 128:
                T.set_max_nreg(REGS[0], 1)
                if rows == rows_pad:
                    for i, j in T.Parallel(ROWS, HALF):
                        q0[i, j] = T.cast(Q[bi, row0 + i, j], "float16")
                    for i, j in T.Parallel(ROWS, HALF):
                        q1[i, j] = T.cast(Q[bi, row0 + i, HALF + j], "float16")
                else:
                    for i, j in T.Parallel(ROWS, HALF):
                        q0[i, j] = T.if_then_else(row0 + i < rows, T.cast(Q[bi, T.min(row0 + i, rows - 1), j],
                                                                          "float16"), T.cast(0, "float16"))
                    for i, j in T.Parallel(ROWS, HALF):
                        q1[i, j] = T.if_then_else(row0 + i < rows,
                                                  T.cast(Q[bi, T.min(row0 + i, rows - 1), HALF + j], "float16"),
                                                  T.cast(0, "float16"))
                T.fill(m, neg_inf)
                T.fill(l, 0.0)
                _span(span, 1, 0, 0)
                for k in T.serial(n_iter):
                    slot = k % ring
                    rslot = k % raw_ring
                    _stamp(stamps[0], k, 0)
                    T.mbarrier_wait_parity(conv_full[slot], (k // ring) % 2)
                    T.mbarrier_wait_parity(raw_full[rslot], (k // raw_ring) % 2)    # (the rope: long since landed)
                    _stamp(stamps[0], k, 1)
                    t0 = tok0 + k * STEP
                    T.wgmma_gemm(q0, c0_s[slot, :, :], s, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(q1, c1_s[slot, :, :], s, transpose_B=True)
                    T.wgmma_gemm(qr_s, rr_s[rslot, :, :], s, transpose_B=True)
                    _stamp(stamps[0], k, 2)
                    if defer_ready:
                        if k > 0:
                            T.mbarrier_arrive(ready[(k + ring - 1) % ring])
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(raw_empty[rslot])
                    _stamp(stamps[0], k, 3)
                    _softmax(s, m, m_new, l, ls, al_s, p_s, slot, t0, base, row0, h_q, seqlen, causal, scale_log2,
                             stamps[0], k)
                    _stamp(stamps[0], k, 5)
                    if not defer_ready:
                        T.mbarrier_arrive(ready[slot])
                _span(span, 2, 0, 0)
                if defer_ready:
                    if n_iter > 0:
                        T.mbarrier_arrive(ready[(n_iter - 1) % ring])
                _row_sums(l, m, l_s, Lse, LsePart, bi, si, splits, max_splits, row0, rows, h_q)
            elif tx < 256:                # WG1: converter of half 0, its P V, the producer of the raw ring
                _pv_loop(0, n_iter, tok0, seqlen, raw_ring, ring, ahead, r0_s, sc_s, c0_s, raw_full, raw_empty,
                         conv_full, ready, al_s, p_s, o0, lazy_rescale,
                         lambda k: _issue_raw(KV, KVf, KVh, BlockTable, bi, tok0 + (k + raw_ring) * STEP, page,
                                              max_blocks, num_pages, r0_s, r1_s, sc_s, rr_s, raw_full, k % raw_ring),
                         stamps[1])
            else:                         # WG2: converter of half 1, its P V
                _pv_loop(1, n_iter, tok0, seqlen, raw_ring, ring, ahead, r1_s, sc_s, c1_s, raw_full, raw_empty,
                         conv_full, ready, al_s, p_s, o1, lazy_rescale, None, stamps[2])
            T.sync_threads()
            if si < splits:
                if tx >= 128 and tx < 256:
                    _store(o0, 0, l_s, Out, OPart, bi, si, splits, max_splits, row0, rows)
                elif tx >= 256:
                    _store(o1, HALF, l_s, Out, OPart, bi, si, splits, max_splits, row0, rows)
            if trace:
                T.sync_threads()
                _span(span, 3, n_iter, 0)

    return mla_decode_fp8_qreg
