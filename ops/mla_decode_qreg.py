"""sm_90a MLA decode for the bf16 cache with the query in registers: the compute-bound rows (64 query rows a CTA,
h_q = 64 and 128), where today's kernels read Q from shared memory in every score MMA (bench/NOTES.md "Session 53:
the bf16 cache at h_q = 128, a design with Q in registers"; bench/probe_mla_qreg.py checked its register plan).

Three warpgroups, no producer warpgroup, one 32-token step a ring slot:

    WG0  (Q's latent in registers, 2 x 64 x 256 bf16: 128 registers a thread)
         S (64 rows x 32 tokens) = Q_lat K_lat^T (wgmma RS: only K from shared memory) + Q_rope K_rope^T (SS)
         mask, online softmax (running max m and sum l a row), P (bf16) and the step's factors into the slot
    WG1, WG2  (half of O each: 64 rows x 256 latent columns fp32, 128 registers a thread)
         O_w = alpha * O_w + P V_w (SS: P and the slot's latent half w as V, MN-major)
         WG1 then reloads the slot it released with the step `RING` ahead (TMA, all 128 threads as a producer)

A step moves 2 x 16 KB of latent and 4 KB of rope into shared memory, reads K (36 KB) once for the scores and V
(2 x 16 KB) and P (2 x 4 KB) for the P V MMAs: Q is never read from shared memory but its rope (8 KB a step).
The scores run as m64n32k16 (a 32-token step keeps S at 16 registers and the ring five slots deep: with each slot's
P and factors and Q's rope, 214.5 KB of shared memory; a slot's loads go out ~4 steps before its use).

Synchronization: full[slot] (TMA bytes; 128 producer arrivals), ready[slot] (WG0's 128 threads, after P and the
factors are written and fenced for the async proxy), empty[slot] (WG1 and WG2's 256 threads after their P V MMAs
of the slot retired). WG0 cannot overwrite a slot's P or factors before both P V warpgroups read them: the slot is
refilled only after empty, and WG0 waits for its full.

Registers: 384 threads launch at 168 a thread; setmaxnreg gives WG0 WG0_REGS and each P V warpgroup PV_REGS
(WG0_REGS + 2 PV_REGS = 504). Pages of 64 tokens or more (a step inside one page), s_q * h_q a multiple of 64,
bf16 query and cache. Outputs as mla_decode_program's: Out/Lse unsplit, OPart/LsePart per (sequence, split).

Status: right on the GPU (its tests, H100, session 55) but slower than the op's kernel: 128 x 128 x 4096 0.333 ms
against 0.299 (FlashMLA 0.279), because issuing the RS score MMAs holds WG0 for as long as they run and its softmax
(~880 cycles a step) then runs alone (bench/NOTES.md "Session 55"). The op does not take it (QREG_BF16 off; bench
provider tilecraft-qreg).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T

from codegen.program import tile_program
from ops.mla_decode_fp8_rs import _rs2_page, _split_range

D_QK, D_V, D_ROPE = 576, 512, 64
HALF = D_V // 2                  # the latent columns of a P V warpgroup (and of each Q register fragment)
ROWS = 64                        # query rows a CTA
STEP = 32                        # tokens a step (a ring slot)
BLOCK = 64                       # the schedule's blocks (mla_decode's splits count 64-token blocks)
RING = 5                         # slots: 5 x 36 KB
WG0_REGS, PV_REGS = 184, 160     # 184 + 2 x 160 = 504 = 3 x 168 (the launch's registers a thread)
LN2 = 0.6931471805599453
BAR_WG0 = 1                      # WG0's named barrier (bar 0 is __syncthreads)
HELPER_SOURCE = r"""
// the 128 threads of one warpgroup meet (a named barrier)
__device__ __forceinline__ void qreg_bar(int id) { asm volatile("bar.sync %0, 128;" :: "r"(id) : "memory"); }
// trace=True: the warpgroup's first thread writes the SM clock of event e of its step k into stamps[8 k + e]
__device__ __forceinline__ void qreg_stamp(void* stamps, int k, int e) {
  if ((threadIdx.x & 127) == 0 && k < 64) {
    int t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t) :: "memory");
    reinterpret_cast<int*>(stamps)[8 * k + e] = t;
  }
}
// trace=True: the CTA's span (thread `by` writes): global timer at entry (e 0), WG0's loop start (1) and end (2), the
// exit (3) in span[e]; the SM clock at loop start and end in span[4], span[5]; at exit the SM's id and the CTA's steps
// in span[6], span[7]
__device__ __forceinline__ void qreg_span(void* at, int e, int steps, int by) {
  if ((int)threadIdx.x != by) return;
  unsigned* span = reinterpret_cast<unsigned*>(at);
  unsigned g, c, sm;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(g) :: "memory");
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory");
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  span[e] = g;
  if (e == 1 || e == 2) span[4 + e - 1] = c;
  if (e == 3) { span[6] = sm; span[7] = (unsigned)steps; }
}
"""
# trace=True (bench.trace_mla_qreg): per role (0 WG0, 1 WG1, 2 WG2) the events of its first TRACE_STEPS steps, SM
# clocks into OPart[bid, role, 8 k + e]; the CTA's span (qreg_span) into OPart[bid, SPAN_ROW, 0:8]
TRACE_STEPS = 64
TRACE_EVENTS = {0: ("start", "data", "scores issued", "scores done", "softmax", "P ready"),
                1: ("start", "P ready", "rescaled", "P V issued", "P V done", "slot free", "reloaded"),
                2: ("start", "P ready", "rescaled", "P V issued", "P V done")}
SPAN_ROW = 3


@T.macro
def _stamp(stamps, k, e):
    if stamps is not None:
        T.evaluate(T.call_extern("handle", "qreg_stamp", stamps, k, e))


@T.macro
def _span(span, e, steps, by):
    if span is not None:
        T.evaluate(T.call_extern("handle", "qreg_span", span, e, steps, by))


def _check(rows, page, dtype, ring):
    if rows < ROWS or rows % ROWS:
        raise ValueError(f"mla_decode_qreg takes query tiles of {ROWS} rows: s_q * h_q must be a multiple of {ROWS}, "
                         f"got {rows}")
    if page < BLOCK or page % BLOCK:
        raise ValueError(f"mla_decode_qreg steps inside one page: page must be a multiple of {BLOCK}, got {page}")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"mla_decode_qreg takes a bfloat16 or float16 cache and query, got {dtype}")
    if not 2 <= ring <= 6:
        raise ValueError(f"mla_decode_qreg: ring must be 2 to 6 slots of {STEP} tokens, got {ring}")


@T.macro
def _issue(KV, BlockTable, bi, tok, page, max_blocks, num_pages, k0_s, k1_s, kr_s, full, slot):
    # the step of tokens [tok, tok + STEP) (inside one page) into `slot`, on full[slot]; every producer thread arrives
    pidx = _rs2_page(BlockTable, bi, tok // BLOCK, page, max_blocks, num_pages)
    off = tok % page
    T.tma_copy(KV[pidx, off:off + STEP, 0:HALF], k0_s[slot, :, :], barrier=full[slot])
    T.tma_copy(KV[pidx, off:off + STEP, HALF:D_V], k1_s[slot, :, :], barrier=full[slot])
    T.tma_copy(KV[pidx, off:off + STEP, D_V:D_QK], kr_s[slot, :, :], barrier=full[slot])
    T.mbarrier_arrive(full[slot])


@tile_program(
    "mla_decode_qreg",
    targets=("cuda:sm_90a",),
    examples={"h128": dict(h_q=128, s_q=1), "h64-s2": dict(h_q=64, s_q=2)},
    pass_configs=lambda t, params: {"tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                                      "tl.disable_safe_memory_legalize": True, "tl.enable_fast_math": True},
)
def mla_decode_qreg_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                            ring: int = RING, defer_ready: bool = True, trace: bool = False):
    """The bf16-cache MLA decode with Q in registers (this module's docstring), one CTA per (sequence, split, row
    tile) as mla_decode_program's grid (bid = (bi * max_splits + si) * m_tiles + mt); its arguments and outputs are
    mla_decode_program's (KVf and KVh are taken and not read). ring: the 32-token slots (5 fit).

    defer_ready (default): WG0 tells the P V warpgroups that step k - 1's P is ready only after it has issued step
    k's score MMAs, so their P V of step k - 1 enters the tensor pipe behind those and is still running while WG0
    does step k's softmax (which otherwise leaves the pipe idle, ~200-250 cycles a step: S is single-buffered). The
    same products in the same order; False: ready as soon as P is written.

    trace (bench.trace_mla_qreg; unsplit launches, OPart with a slot per CTA): each role's first thread writes the SM
    clock at its TRACE_EVENTS of its first TRACE_STEPS steps into OPart[bid, role], and the CTA's span into
    OPart[bid, SPAN_ROW]; the outputs are the same."""
    rows = s_q * h_q
    _check(rows, page, dtype, ring)
    causal = causal and s_q > 1
    m_tiles = rows // ROWS
    batch, num_pages, max_blocks, slots = T.dynamic("batch, num_pages, max_blocks, slots")
    neg_inf = -T.infinity("float32")

    @T.prim_func
    def mla_decode_qreg(
        Q: T.Tensor((batch, rows, D_QK), dtype),
        KV: T.Tensor((num_pages, page, D_QK), dtype),
        KVf: T.Tensor((num_pages, page, D_QK // 2), "float32"),
        KVh: T.Tensor((num_pages, page, D_QK), dtype),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), dtype),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, rows, D_V), "float32"),
        LsePart: T.Tensor((slots, rows), "float32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(batch * max_splits * m_tiles, threads=3 * 128) as bid:
            stamps = [T.access_ptr(OPart[bid, r, 0], "w", 8 * TRACE_STEPS) if trace else None for r in range(3)]
            span = T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8) if trace else None
            k0_s = T.alloc_shared((ring, STEP, HALF), dtype)     # latent columns 0..255 (WG1's V)
            k1_s = T.alloc_shared((ring, STEP, HALF), dtype)     # latent columns 256..511 (WG2's V)
            kr_s = T.alloc_shared((ring, STEP, D_ROPE), dtype)   # the rope
            qr_s = T.alloc_shared((ROWS, D_ROPE), dtype)         # Q's rope (the score MMAs' one SS part)
            p_s = T.alloc_shared((ring, ROWS, STEP), dtype)      # P of the slot's step
            al_s = T.alloc_shared((ring, ROWS), "float32")           # the step's factors exp2(m_old - m_new)
            l_s = T.alloc_shared((ROWS,), "float32")                 # 1 / the row sums, for the P V warpgroups
            full = T.alloc_barrier([128] * ring)
            empty = T.alloc_barrier([256] * ring)
            ready = T.alloc_barrier([128] * ring)
            q0 = T.alloc_fragment((ROWS, HALF), dtype)
            q1 = T.alloc_fragment((ROWS, HALF), dtype)
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
            T.import_source(HELPER_SOURCE)
            _span(span, 0, 0, 0)
            split_v = T.alloc_local((2,), "int32")
            split_v[0], split_v[1] = _split_range(si, splits, T.ceildiv(seqlen, BLOCK))
            tok0 = split_v[0] * BLOCK                                 # the split's first token
            # its 32-token steps: none past the sequence's end (a split's last block may hold one)
            n_iter = T.max(T.min(split_v[1] * (BLOCK // STEP), T.ceildiv(seqlen - tok0, STEP)), 0)
            base = seqlen - s_q + 1 if causal else seqlen             # query token i sees tokens < base + i

            if tx >= 128 and tx < 256:                                # WG1: the ring's first slots
                for k in T.serial(T.min(n_iter, ring)):
                    _issue(KV, BlockTable, bi, tok0 + k * STEP, page, max_blocks, num_pages, k0_s, k1_s, kr_s, full,
                           k)
            T.copy(Q[bi, row0:row0 + ROWS, D_V:D_QK], qr_s)
            T.fence_proxy_async()         # (qr_s is read by the score MMAs: the async proxy)
            T.sync_threads()
            if tx < 128:
                T.set_max_nreg(WG0_REGS, 1)
                for i, j in T.Parallel(ROWS, HALF):
                    q0[i, j] = Q[bi, row0 + i, j]
                for i, j in T.Parallel(ROWS, HALF):
                    q1[i, j] = Q[bi, row0 + i, HALF + j]
                T.fill(m, neg_inf)
                T.fill(l, 0.0)
                _span(span, 1, 0, 0)
                for k in T.serial(n_iter):
                    slot = k % ring
                    _stamp(stamps[0], k, 0)
                    T.mbarrier_wait_parity(full[slot], (k // ring) % 2)
                    _stamp(stamps[0], k, 1)
                    t0 = tok0 + k * STEP
                    if t0 + STEP > seqlen:        # the sequence's short last step: V's rows past its end zeroed
                        for j, c in T.Parallel(STEP, HALF):
                            if t0 + j >= seqlen:
                                k0_s[slot, j, c] = T.cast(0, dtype)
                                k1_s[slot, j, c] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.evaluate(T.call_extern("handle", "qreg_bar", BAR_WG0))
                    T.wgmma_gemm(q0, k0_s[slot, :, :], s, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(q1, k1_s[slot, :, :], s, transpose_B=True)
                    T.wgmma_gemm(qr_s, kr_s[slot, :, :], s, transpose_B=True)
                    _stamp(stamps[0], k, 2)
                    if defer_ready:          # step k - 1's P (written and fenced last iteration), behind these MMAs
                        if k > 0:
                            T.mbarrier_arrive(ready[(k + ring - 1) % ring])
                    T.wait_wgmma(0)
                    _stamp(stamps[0], k, 3)
                    _softmax(s, m, m_new, l, ls, al_s, p_s, slot, t0, base, row0, h_q, seqlen, causal, scale_log2,
                             stamps[0], k)
                    _stamp(stamps[0], k, 5)
                    if not defer_ready:
                        T.mbarrier_arrive(ready[slot])
                _span(span, 2, 0, 0)
                if defer_ready:                  # the last step's P
                    if n_iter > 0:
                        T.mbarrier_arrive(ready[(n_iter - 1) % ring])
                _row_sums(l, m, l_s, Lse, LsePart, bi, si, splits, max_splits, row0, rows, h_q)
            elif tx < 256:                # WG1: its P V, and the producer of the ring
                _pv_loop(n_iter, ring, ready, empty, al_s, p_s, k0_s, o0,
                         lambda k, slot: _issue(KV, BlockTable, bi, tok0 + (k + ring) * STEP, page, max_blocks,
                                                num_pages, k0_s, k1_s, kr_s, full, slot), stamps[1])
            else:                         # WG2: its P V
                _pv_loop(n_iter, ring, ready, empty, al_s, p_s, k1_s, o1, None, stamps[2])
            T.sync_threads()                # l_s written; every loop done
            if si < splits:
                if tx >= 128 and tx < 256:
                    _store(o0, 0, l_s, Out, OPart, bi, si, splits, max_splits, row0, rows)
                elif tx >= 256:
                    _store(o1, HALF, l_s, Out, OPart, bi, si, splits, max_splits, row0, rows)
            if trace:
                T.sync_threads()
                _span(span, 3, n_iter, 0)

    return mla_decode_qreg


@T.macro
def _pv_loop(n_iter, ring, ready, empty, al_s, p_s, v_s, o, produce, stamps=None):
    # a P V warpgroup: O_w = alpha * O_w + P V_w a step (V_w: the slot's latent half v_s, read MN-major), the slot
    # released on empty; produce(k, slot) (WG1's): once both warpgroups have released the slot, its step k + ring
    T.set_max_nreg(PV_REGS, 0)
    T.clear(o)
    for k in T.serial(n_iter):
        slot = k % ring
        _stamp(stamps, k, 0)
        T.mbarrier_wait_parity(ready[slot], (k // ring) % 2)
        _stamp(stamps, k, 1)
        for i, j in T.Parallel(ROWS, HALF):
            o[i, j] = o[i, j] * al_s[slot, i]
        _stamp(stamps, k, 2)
        T.wgmma_gemm(p_s[slot, :, :], v_s[slot, :, :], o)
        _stamp(stamps, k, 3)
        T.wait_wgmma(0)
        _stamp(stamps, k, 4)
        T.mbarrier_arrive(empty[slot])
        if produce is not None:
            if k + ring < n_iter:
                T.mbarrier_wait_parity(empty[slot], (k // ring) % 2)
                _stamp(stamps, k, 5)
                produce(k, slot)
                _stamp(stamps, k, 6)


@T.macro
def _softmax(s, m, m_new, l, ls, al_s, p_s, slot, t0, base, row0, h_q, seqlen, causal, scale_log2, stamps, k):
    # WG0, a step's scores S (retired): mask (past the end, causal), the online softmax in the log2 domain (running
    # max m and sum l a row), the step's factors into al_s[slot] and P into p_s[slot] (fenced for the async proxy)
    neg_inf = -T.infinity("float32")
    for i, j in T.Parallel(ROWS, STEP):
        lim = T.min(base + (row0 + i) // h_q, seqlen) if causal else seqlen
        s[i, j] = T.if_then_else(t0 + j < lim, s[i, j] * scale_log2, neg_inf)
    T.reduce_max(s, m_new, dim=1, clear=True)
    for i in T.Parallel(ROWS):
        m_new[i] = T.max(m_new[i], m[i])
    for i, j in T.Parallel(ROWS, STEP):
        s[i, j] = T.if_then_else(m_new[i] == neg_inf, 0.0, T.exp2(s[i, j] - m_new[i]))
    T.reduce_sum(s, ls, dim=1, clear=True)
    for i in T.Parallel(ROWS):
        alpha = T.if_then_else(m_new[i] == neg_inf, 1.0, T.exp2(m[i] - m_new[i]))
        l[i] = l[i] * alpha + ls[i]
        al_s[slot, i] = alpha
        m[i] = m_new[i]
    _stamp(stamps, k, 4)
    for i, j in T.Parallel(ROWS, STEP):
        p_s[slot, i, j] = T.cast(s[i, j], p_s.dtype)
    T.fence_proxy_async()


@T.macro
def _row_sums(l, m, l_s, Lse, LsePart, bi, si, splits, max_splits, row0, rows, h_q):
    # WG0 after its loop: 1 / the row sums (0 where a row saw nothing) for the P V warpgroups, and the lse (natural
    # log into Lse unsplit; log2 into LsePart for the combine); rows past s_q * h_q store nothing
    neg_inf = -T.infinity("float32")
    for i in T.Parallel(ROWS):
        l_s[i] = T.if_then_else(l[i] > 0.0, 1.0 / l[i], 0.0)
    if si < splits:
        for i in T.Parallel(ROWS):
            lse2 = T.if_then_else(l[i] > 0.0, m[i] + T.log2(l[i]), neg_inf)
            if splits == 1:
                if row0 + i < rows:
                    Lse[bi, (row0 + i) % h_q, (row0 + i) // h_q] = lse2 * LN2
            else:
                LsePart[bi * max_splits + si, row0 + i] = lse2


@T.macro
def _store(o, col0, l_s, Out, OPart, bi, si, splits, max_splits, row0, rows):
    # O's columns col0.. times 1 / l (l_s; 0 where a row saw nothing): bf16 into Out unsplit, fp32 into OPart
    if splits == 1:
        for i, j in T.Parallel(ROWS, HALF):
            if row0 + i < rows:
                Out[bi, row0 + i, col0 + j] = T.cast(o[i, j] * l_s[i], Out.dtype)
    else:
        for i, j in T.Parallel(ROWS, HALF):
            OPart[bi * max_splits + si, row0 + i, col0 + j] = o[i, j] * l_s[i]
