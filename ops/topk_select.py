"""Row-wise exact top-k over long rows (sparse-attention indexer, sampling).

indices[r] = the k largest of scores[r, :lengths[r]], ties toward the lower index, returned in
ascending index order; rows shorter than k are padded with -1.

Kernels (radix select on order-preserving 32-bit keys):
- CUDA, rows of up to topk_cluster.MAX_COLS (131072) columns (ops/topk_cluster.py): one
  thread-block cluster per row reads the row once, keeps its keys in shared memory, merges the
  12-bit histograms and gathers the k-th's bucket; then topk_sliced's finish (one block per row:
  the last digits and the ordered write). Two launches.
- CUDA, longer rows (ops/topk_sliced.py): 8192-column slices, one block per slice for the
  histogram and for the gather (the row is read twice), then the same finish.
- CUDA, rows of more than topk_sliced.MAX_SLICES slices (`topk_select_v3`): one block per row, a
  12-bit histogram of the row in shared memory, a gather of the keys in the k-th's bucket
  (warp-aggregated slots), 12- and 8-bit digits over those candidates, then an ordered write.
  Every pass loads float4 straight into registers, one chunk ahead; barriers are placed by hand.
- Ascend and cpu (`topk_select`, v2): the same digits with staged copies, tl.cumsum block scans and
  TileLang's own barriers.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values, topk_cluster, topk_sliced
from ops import _validate as check
from ops._workspace import int32_views

MAX_K = 4096
NB = topk_sliced.NB      # bins of the first (12-bit) digit


def _key(x):
    """float32 -> uint32 with the same order (negative floats reversed; -0.0 and +0.0 equal).
    The branchy form of topk_sliced.key32: v3 at 512 threads spills one register with the selects."""
    bits = T.reinterpret(x, "uint32")
    key = T.if_then_else(x < 0, bits ^ T.uint32(0xFFFFFFFF), bits | T.uint32(0x80000000))
    return T.if_then_else(x == 0, T.uint32(0x80000000), key)


def _configs(t, p):
    # One 256-thread group walks every pass: TileLang's warp specialization would hand the
    # copies to extra producer warps and shift threadIdx, which the block scan (tl::CumSum1D) reads.
    return {"tl.disable_warp_specialized": True} if t.name.startswith("cuda") else {}


# Ascend: the whole row runs in one SIMT vector region; tile.cumsum is a Hillis-Steele scan there
# and the staged copies are guarded per-thread loads (codegen/lowering/ascend.py). Generated Ascend
# C only, no device has run it.
@tile_program("topk_select", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"any-k": dict()}, pass_configs=_configs)
def topk_select_program(lanes: int = 256, stages: int = 2):
    """Exact top-k per row: 12-bit histogram, candidate gather, 12 + 8-bit digits, ordered write. k is Out's
    second dimension, read at launch: one build serves every k (a build is ~10 s on the cpu target)."""
    rows, cols, k = T.dynamic("rows, cols, k")
    SEG = 32                    # contiguous columns per lane in the ordered write (one bit mask)
    chunk = lanes * SEG         # columns staged per step

    @T.macro
    def find_digit(hist, nbins, want, res, part, scan, acc):
        # res[0] = the digit d with count(digit > d) < want <= count(digit >= d); res[1] = want - count(digit > d)
        per = nbins // lanes
        for t in tile.parallel(lanes):
            part[t] = 0
            for j in T.serial(per):
                part[t] = part[t] + hist[nbins - 1 - t * per - j]
        tile.cumsum(part, scan, dim=0)
        for t in tile.parallel(lanes):
            acc[t] = scan[t] - part[t]
            if acc[t] < want and scan[t] >= want:
                for j in T.serial(per):
                    d = nbins - 1 - t * per - j
                    if acc[t] < want and acc[t] + hist[d] >= want:
                        res[0] = d
                        res[1] = want - acc[t]
                    acc[t] = acc[t] + hist[d]

    @T.prim_func
    def topk_select(Scores: T.Tensor((rows, cols), "float32"), Lengths: T.Tensor((rows,), "int32"),
                    Cand: T.Tensor((rows, cols), "int32"), Out: T.Tensor((rows, k), "int32")):
        with tile.grid(rows, lanes) as r:
            with tile.vector():
                stage = tile.stage((chunk,), "float32")     # double-buffered by the pipelined passes
                row = tile.stage((chunk,), "float32")       # the ordered write's own (one buffer per loop)
                hist = tile.stage((NB,), "int32")
                part = tile.stage((lanes,), "int32")
                scan = tile.stage((lanes,), "int32")
                res = tile.stage((4,), "int32")
                acc = tile.fragment((lanes,), "int32")
                mask_gt = tile.fragment((lanes,), "uint32")
                mask_eq = tile.fragment((lanes,), "uint32")
                pos = tile.fragment((lanes,), "int32")
                eqc = tile.fragment((lanes,), "int32")
                n = T.alloc_var("int32")
                want = T.alloc_var("int32")
                m = T.alloc_var("int32")
                thr = T.alloc_var("uint32")      # the k-th largest key
                want_eq = T.alloc_var("int32")   # how many keys equal to thr are taken (lowest indices)
                b1 = T.alloc_var("int32")
                b2 = T.alloc_var("int32")
                gt_base = T.alloc_var("int32")
                eq_base = T.alloc_var("int32")
                n = T.min(T.max(Lengths[r], 0), cols)
                want = T.min(k, n)
                thr = T.uint32(0)                # no key is 0 (NaN excluded): n <= k takes every column
                want_eq = 0
                if n > k:
                    # digit 1 over the whole row: histogram of the top 12 key bits
                    for b in tile.parallel(NB):
                        hist[b] = 0
                    for c in tile.pipelined(T.ceildiv(n, chunk), stages):
                        tile.copy(Scores[r, c * chunk:(c + 1) * chunk], stage)
                        for i in tile.parallel(chunk):
                            if c * chunk + i < n:
                                tile.atomic_add(hist[T.cast(_key(stage[i]) >> T.uint32(20), "int32")], 1)
                    find_digit(hist, NB, want, res, part, scan, acc)
                    b1 = res[0]
                    want = res[1]
                    # the keys in that bucket go to this row of Cand (usually a few thousand)
                    res[2] = 0
                    for c in tile.pipelined(T.ceildiv(n, chunk), stages):
                        tile.copy(Scores[r, c * chunk:(c + 1) * chunk], stage)
                        for i in tile.parallel(chunk):
                            key = _key(stage[i])
                            if c * chunk + i < n and T.cast(key >> T.uint32(20), "int32") == b1:
                                slot = tile.atomic_add(res[2], 1, return_prev=True)
                                Cand[r, slot] = T.reinterpret(key, "int32")
                    m = res[2]
                    # digit 2 (key bits 8..19) and digit 3 (bits 0..7) among the candidates
                    for b in tile.parallel(NB):
                        hist[b] = 0
                    for c in T.serial(T.ceildiv(m, chunk)):
                        for i in tile.parallel(chunk):
                            if c * chunk + i < m:
                                key = T.reinterpret(Cand[r, c * chunk + i], "uint32")
                                tile.atomic_add(hist[T.cast((key >> T.uint32(8)) & T.uint32(0xFFF), "int32")], 1)
                    find_digit(hist, NB, want, res, part, scan, acc)
                    b2 = res[0]
                    want = res[1]
                    for b in tile.parallel(NB):
                        hist[b] = 0
                    for c in T.serial(T.ceildiv(m, chunk)):
                        for i in tile.parallel(chunk):
                            if c * chunk + i < m:
                                key = T.reinterpret(Cand[r, c * chunk + i], "uint32")
                                if T.cast((key >> T.uint32(8)) & T.uint32(0xFFF), "int32") == b2:
                                    tile.atomic_add(hist[T.cast(key & T.uint32(0xFF), "int32")], 1)
                    find_digit(hist, 256, want, res, part, scan, acc)
                    thr = (T.cast(b1, "uint32") << T.uint32(20)) | (T.cast(b2, "uint32") << T.uint32(8)) | T.cast(res[0], "uint32")
                    want_eq = res[1]
                # ordered write: each lane owns 32 contiguous columns of a chunk; one block scan of
                # (above, equal) counts per chunk places them; equal keys are taken lowest index first
                gt_base = 0
                eq_base = 0
                for c in T.serial(T.ceildiv(n, chunk)):  # (TileLang 0.1.15 cannot pipeline a loop holding cumsum)
                    tile.copy(Scores[r, c * chunk:(c + 1) * chunk], row)
                    for t in tile.parallel(lanes):
                        mask_gt[t] = T.uint32(0)
                        mask_eq[t] = T.uint32(0)
                        for j in T.serial(SEG):
                            jj = (j + t) % SEG       # rotated: the 32 lanes of a warp hit 32 banks
                            key = _key(row[t * SEG + jj])
                            live = c * chunk + t * SEG + jj < n
                            mask_gt[t] = mask_gt[t] | T.if_then_else(live and key > thr, T.uint32(1) << T.cast(jj, "uint32"), T.uint32(0))
                            mask_eq[t] = mask_eq[t] | T.if_then_else(live and key == thr, T.uint32(1) << T.cast(jj, "uint32"), T.uint32(0))
                        pos[t] = 0
                        eqc[t] = 0
                        for j in T.serial(SEG):
                            pos[t] = pos[t] + T.cast((mask_gt[t] >> T.cast(j, "uint32")) & T.uint32(1), "int32")
                            eqc[t] = eqc[t] + T.cast((mask_eq[t] >> T.cast(j, "uint32")) & T.uint32(1), "int32")
                        part[t] = pos[t] + eqc[t] * 65536
                    tile.cumsum(part, scan, dim=0)
                    for t in tile.parallel(lanes):
                        eqc[t] = eq_base + ((scan[t] - part[t]) >> 16)
                        pos[t] = gt_base + ((scan[t] - part[t]) & 65535) + T.min(want_eq, eqc[t])
                        for j in T.serial(SEG):
                            if (mask_gt[t] >> T.cast(j, "uint32")) & T.uint32(1) == T.uint32(1):
                                Out[r, T.min(pos[t], k - 1)] = c * chunk + t * SEG + j
                                pos[t] = pos[t] + 1
                            elif (mask_eq[t] >> T.cast(j, "uint32")) & T.uint32(1) == T.uint32(1):
                                if eqc[t] < want_eq:
                                    Out[r, T.min(pos[t], k - 1)] = c * chunk + t * SEG + j
                                    pos[t] = pos[t] + 1
                                eqc[t] = eqc[t] + 1
                    gt_base = gt_base + (scan[lanes - 1] & 65535)
                    eq_base = eq_base + (scan[lanes - 1] >> 16)
                for c in T.serial(T.ceildiv(k, lanes)):      # -1 past a short row
                    for t in tile.parallel(lanes):
                        if c * lanes + t < k and c * lanes + t >= n:
                            Out[r, c * lanes + t] = -1

    return topk_select


# CUDA only (lane shuffles, per-thread code). The v2 program above stays for Ascend and cpu.
@tile_program("topk_select_v3", targets=("cuda:sm_90a", "cuda:sm_100a"),
              examples={"indexer-2048": dict(k=2048), "sampling-512": dict(k=512)},
              pass_configs=topk_sliced.hand_synced_configs)
def topk_select_v3_program(k: int, threads: int = 512, unroll: int = 6):
    """Exact top-k per row, one block per row: register-staged passes, hand-placed barriers.
    The CUDA op runs it for rows longer than topk_sliced.MAX_SLICES slices."""
    rows, quads, ccols = T.dynamic("rows, quads, ccols")   # Scores viewed as (rows, cols / 4, 4): float4 loads
    W = threads // 32                # warps
    WCH = unroll * 128               # contiguous columns a warp owns in a chunk (unroll float4 per lane)
    CH = W * WCH                     # columns per chunk
    V = unroll * 4                   # values per lane per chunk
    assert CH < 32768                # packed (above, equal) counts of a chunk: 16 bits each
    warp_scan, find_digit = topk_sliced.block_scan_words(threads)

    @T.macro
    def load(Scores, x, r, c, n, w, lane):
        # rows are padded to a multiple of 4 columns: a float4 that starts before n is in bounds
        for u in T.unroll(unroll):
            if c * CH + w * WCH + u * 128 + lane * 4 < n:
                for v in T.vectorized(4):
                    x[u * 4 + v] = Scores[r, (c * CH + w * WCH + u * 128) // 4 + lane, v]

    @T.macro
    def next_chunk(Scores, x, y, r, c, n, nch, w, lane):
        # y = chunk c (loaded one step ahead), then issue the loads of chunk c + 1
        for i in T.unroll(V):
            y[i] = x[i]
        if c + 1 < nch:
            load(Scores, x, r, c + 1, n, w, lane)

    @T.prim_func
    def topk_select_v3(Scores: T.Tensor((rows, quads, 4), "float32"), Lengths: T.Tensor((rows,), "int32"),
                       Cand: T.Tensor((rows, ccols), "int32"), Out: T.Tensor((rows, k), "int32")):
        with tile.grid(rows, threads) as r:
            tx = T.get_thread_binding()
            hist = T.alloc_shared((NB,), "int32")
            wtot = T.alloc_shared((2 * W,), "int32")
            res = T.alloc_shared((4,), "int32")
            x = T.alloc_local((V,), "float32")       # the chunk being loaded
            y = T.alloc_local((V,), "float32")       # the chunk being used
            lp = T.alloc_local((unroll,), "int32")
            sc = T.alloc_local((4,), "int32")       # scan scratch
            slot = T.alloc_var("int32")
            mk = T.alloc_var("uint32")
            n = T.alloc_var("int32")
            nch = T.alloc_var("int32")
            want = T.alloc_var("int32")
            m = T.alloc_var("int32")
            thr = T.alloc_var("uint32")
            want_eq = T.alloc_var("int32")
            b1 = T.alloc_var("int32")
            b2 = T.alloc_var("int32")
            pre = T.alloc_var("int32")
            tot = T.alloc_var("int32")
            wrun = T.alloc_var("int32")
            gtb = T.alloc_var("int32")
            eqb = T.alloc_var("int32")
            gt_base = T.alloc_var("int32")
            eq_base = T.alloc_var("int32")
            lane = tx % 32
            w = tx // 32

            n = T.min(T.max(Lengths[r], 0), quads * 4)
            nch = T.ceildiv(n, CH)
            want = T.min(k, n)
            thr = T.uint32(0)                # no key is 0 (NaN excluded): n <= k takes every column
            want_eq = 0
            if n > k:
                for i in T.serial(NB // threads):
                    hist[i * threads + tx] = 0
                tile.barrier()
                # digit 1: histogram of the top 12 key bits over the row
                load(Scores, x, r, 0, n, w, lane)
                for c in T.serial(nch):
                    next_chunk(Scores, x, y, r, c, n, nch, w, lane)
                    for u in T.unroll(unroll):
                        for v in T.unroll(4):
                            if c * CH + w * WCH + u * 128 + lane * 4 + v < n:
                                T.atomic_add(hist[T.cast(_key(y[u * 4 + v]) >> T.uint32(20), "int32")], 1)
                tile.barrier()
                find_digit(hist, wtot, res, sc, NB, want, tx, w, lane)
                b1 = res[0]
                want = res[1]
                if tx == 0:
                    res[2] = 0
                tile.barrier()
                # the keys of that bucket go to this row of Cand
                load(Scores, x, r, 0, n, w, lane)
                for c in T.serial(nch):
                    next_chunk(Scores, x, y, r, c, n, nch, w, lane)
                    for u in T.unroll(unroll):
                        for v in T.unroll(4):
                            # warp-aggregated: one shared atomic per warp and value slot, so a
                            # crowded bucket (an all-equal row) does not serialize on res[2]
                            mk = tile.lane_ballot(c * CH + w * WCH + u * 128 + lane * 4 + v < n and
                                                  T.cast(_key(y[u * 4 + v]) >> T.uint32(20), "int32") == b1)
                            if mk != T.uint32(0):
                                if lane == T.call_extern("int32", "__ffs", mk) - 1:
                                    slot = T.atomic_add(res[2], T.call_extern("int32", "__popc", mk), return_prev=True)
                                slot = tile.lane_shuffle(slot, T.call_extern("int32", "__ffs", mk) - 1)
                                if (mk >> T.cast(lane, "uint32")) & T.uint32(1) == T.uint32(1):
                                    Cand[r, slot + T.call_extern("int32", "__popc", mk & ((T.uint32(1) << T.cast(lane, "uint32")) - T.uint32(1)))] = \
                                        T.reinterpret(_key(y[u * 4 + v]), "int32")
                for i in T.serial(NB // threads):
                    hist[i * threads + tx] = 0
                tile.barrier()                # Cand's writes are visible to the block after this
                m = res[2]
                # digit 2 (key bits 8..19), then digit 3 (bits 0..7) among the candidates
                for i in T.serial(T.ceildiv(m, threads)):
                    if i * threads + tx < m:
                        T.atomic_add(hist[T.cast((T.reinterpret(Cand[r, i * threads + tx], "uint32") >> T.uint32(8)) & T.uint32(0xFFF), "int32")], 1)
                tile.barrier()
                find_digit(hist, wtot, res, sc, NB, want, tx, w, lane)
                b2 = res[0]
                want = res[1]
                for i in T.serial(T.ceildiv(256, threads)):
                    if i * threads + tx < 256:
                        hist[i * threads + tx] = 0
                tile.barrier()
                for i in T.serial(T.ceildiv(m, threads)):
                    if i * threads + tx < m:
                        if T.cast((T.reinterpret(Cand[r, i * threads + tx], "uint32") >> T.uint32(8)) & T.uint32(0xFFF), "int32") == b2:
                            T.atomic_add(hist[T.cast(T.reinterpret(Cand[r, i * threads + tx], "uint32") & T.uint32(0xFF), "int32")], 1)
                tile.barrier()
                find_digit(hist, wtot, res, sc, 256, want, tx, w, lane)
                thr = (T.cast(b1, "uint32") << T.uint32(20)) | (T.cast(b2, "uint32") << T.uint32(8)) | T.cast(res[0], "uint32")
                want_eq = res[1]
            # ordered write: packed (above, equal) counts per float4, warp scans, per-warp totals
            # of each chunk double-buffered in wtot (one barrier per chunk)
            gt_base = 0
            eq_base = 0
            load(Scores, x, r, 0, n, w, lane)
            for c in T.serial(nch):
                next_chunk(Scores, x, y, r, c, n, nch, w, lane)
                wrun = 0
                for u in T.unroll(unroll):
                    sc[0] = 0
                    for v in T.unroll(4):
                        if c * CH + w * WCH + u * 128 + lane * 4 + v < n:
                            if _key(y[u * 4 + v]) > thr:
                                sc[0] = sc[0] + 1
                            elif _key(y[u * 4 + v]) == thr:
                                sc[0] = sc[0] + 65536
                    sc[2] = sc[0]
                    warp_scan(sc, lane)
                    lp[u] = wrun + sc[0] - sc[2]
                    wrun = wrun + tile.lane_shuffle(sc[0], 31)
                if lane == 0:
                    wtot[(c % 2) * W + w] = wrun
                tile.barrier()
                pre = 0
                tot = 0
                for i in T.serial(W):
                    tot = tot + wtot[(c % 2) * W + i]
                    if i < w:
                        pre = pre + wtot[(c % 2) * W + i]
                for u in T.unroll(unroll):
                    gtb = gt_base + ((pre + lp[u]) & 65535)
                    eqb = eq_base + ((pre + lp[u]) >> 16)
                    for v in T.unroll(4):
                        if c * CH + w * WCH + u * 128 + lane * 4 + v < n:
                            if _key(y[u * 4 + v]) > thr:
                                Out[r, T.min(gtb + T.min(want_eq, eqb), k - 1)] = c * CH + w * WCH + u * 128 + lane * 4 + v
                                gtb = gtb + 1
                            elif _key(y[u * 4 + v]) == thr:
                                if eqb < want_eq:
                                    Out[r, T.min(gtb + eqb, k - 1)] = c * CH + w * WCH + u * 128 + lane * 4 + v
                                eqb = eqb + 1
                gt_base = gt_base + (tot & 65535)
                eq_base = eq_base + (tot >> 16)
            for i in T.serial(T.ceildiv(k, threads)):
                if i * threads + tx < k and i * threads + tx >= T.min(k, n):
                    Out[r, i * threads + tx] = -1

    return topk_select_v3


_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate_reference(scores, k, lengths):
    """The op's checks less its kernel limits: scores of any floating dtype and strides, any k >= 1, lengths
    int32 or int64 of any strides. Lengths are clamped to [0, N] as the op clamps them (past N: the whole
    row; negative: an empty row). NaN among the columns a row reads is refused, as by the op (no order to
    pick them by; a value check, skipped where ops/_values.py skips them)."""
    check.tensor("scores", scores, dtypes=_REFERENCE_DTYPES, ndim=2)
    check.number("k", k, lo=1, integer=True)
    if lengths is not None:
        check.tensor("lengths", lengths, dtypes=(torch.int32, torch.int64), ndim=1)
        check.shape("lengths", lengths, (scores.shape[0],), "(rows,)")
        check.same_device(scores=scores, lengths=lengths)
    if _values.enabled(scores, lengths) and scores.numel():
        nan = torch.isnan(scores)
        if lengths is not None:
            nan &= torch.arange(scores.shape[1], device=scores.device)[None, :] < lengths[:, None]
        if bool(nan.any()):
            raise ValueError("scores must not contain NaN (there is no order to pick them by)"
                             + check.offending(scores, nan))


def topk_select_reference(scores, k, *, lengths=None):
    """torch reference: same ordering and padding, ties toward the lower index (stable sort).

    scores (R, N) of any floating dtype (compared in fp32), k an int >= 1 (no kernel limit), lengths None or
    (R,) int32/int64 clamped to [0, N] like the op's; any device, any strides."""
    _validate_reference(scores, k, lengths)
    R, N = scores.shape
    out = torch.full((R, k), -1, dtype=torch.int32, device=scores.device)
    for r in range(R):
        n = N if lengths is None else max(0, min(N, int(lengths[r])))
        if n == 0:
            continue
        top = torch.sort(scores[r, :n].float(), descending=True, stable=True).indices[:min(k, n)]
        out[r, :top.numel()] = top.sort().values.to(torch.int32)
    return out


def _clustered(scores, k, lengths, target, out, cluster, vec):
    """One cluster per row (ops/topk_cluster.py), then topk_sliced's finish: two launches."""
    R, N = scores.shape
    L = topk_sliced.slice_cols(topk_cluster.THREADS, vec)
    if cluster * L < N:
        raise ValueError(f"cluster={cluster} blocks of {L} columns (vec={vec}) do not cover rows of {N} columns")
    KS = min(L, k)
    gather, finish = jit.launchers(("topk-cluster", target.name, k, cluster, vec), lambda: (
        topk_cluster.topk_cluster_program.compile(target, k=k, vec=vec, cluster=cluster).launcher(),
        topk_sliced.topk_finish_program.compile(target, k=k, slice_cols=L).launcher()))
    # the row's histogram (zeroed by the kernel), per slice (selected << 16 | candidates) counts,
    # selected columns, candidate keys and columns, their compacted copies
    ws, cnt, sel, cand, cand_idx, cand_c, cand_idx_c = int32_views(
        scores.device, *((R, c) for c in (topk_sliced.NB, cluster, cluster * KS, N, N, N, N)))
    gather(scores.view(R, -1, 4), lengths, ws, cnt, sel, cand, cand_idx)
    finish(lengths, cnt, sel, cand, cand_idx, cand_c, cand_idx_c, out)
    return out


def _sliced(scores, k, lengths, target, out, threads=512, vec=4):
    """The sliced CUDA kernels (ops/topk_sliced.py): histogram, bucket, gather, finish."""
    R, N = scores.shape
    L = topk_sliced.slice_cols(threads, vec)
    S, KS = -(-N // L), min(L, k)
    sp = dict(k=k, threads=threads, vec=vec)
    hist, bucket, gather, finish = jit.launchers(("topk-sliced", target.name, k, threads, vec), lambda: (
        topk_sliced.topk_hist_program.compile(target, **sp).launcher(),
        topk_sliced.topk_bucket_program.compile(target, k=k).launcher(),
        topk_sliced.topk_gather_program.compile(target, **sp).launcher(),
        topk_sliced.topk_finish_program.compile(target, k=k, slice_cols=L).launcher()))
    ws = torch.zeros(R, topk_sliced.WS_COLS, dtype=torch.int32, device=scores.device)    # histogram, bucket
    cnt, sel, cand, cand_idx, cand_c, cand_idx_c = int32_views(
        scores.device, *((R, c) for c in (S, S * KS, N, N, N, N)))
    quads = scores.view(R, -1, 4)
    hist(quads, lengths, ws)
    bucket(quads, lengths, ws)
    gather(quads, lengths, ws, cnt, sel, cand, cand_idx)
    finish(lengths, cnt, sel, cand, cand_idx, cand_c, cand_idx_c, out)
    return out


def _impl(scores, k, lengths, kernel="auto", **params):
    """The launch behind the op (no argument checks). On CUDA `kernel` picks one cluster per row
    ("cluster", params vec=, cluster=; rows up to topk_cluster.MAX_COLS), the sliced kernels
    ("sliced", params threads=, vec=; rows up to topk_sliced.MAX_SLICES slices), the
    one-block-per-row "v3" (params threads=, unroll=) or "v2"; "auto" takes the first of
    cluster, sliced, v3 that fits the row. The benchmark times them side by side. Ascend and cpu
    run v2."""
    R, N = scores.shape
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    if R == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    if lengths is None:
        lengths = torch.full((R,), N, dtype=torch.int32, device=scores.device)
    if N % 4:
        # rows are read as float4: pad them (the padding is past every length)
        lengths = lengths.clamp(max=N)
        scores = torch.nn.functional.pad(scores, (0, 4 - N % 4))
    if kernel == "auto" and params:
        raise ValueError(f"kernel='auto' takes no kernel parameters (got {sorted(params)}): name the kernel")
    target = targets.resolve(scores)
    if target.name in topk_sliced.CUDA:
        if kernel in ("auto", "cluster"):
            fit = topk_cluster.plan(scores.shape[1])
            if fit is not None or kernel == "cluster":
                if fit is None:
                    raise ValueError(f"the cluster kernel takes rows of at most {topk_cluster.MAX_COLS} columns, "
                                     f"got {N}")
                cluster, vec = params.get("cluster", fit[0]), params.get("vec", fit[1])
                return _clustered(scores, k, lengths, target, out, cluster, vec)
            kernel = "sliced"
        if kernel == "sliced":
            if -(-scores.shape[1] // topk_sliced.slice_cols(**params)) <= topk_sliced.MAX_SLICES:
                return _sliced(scores, k, lengths, target, out, **params)
            kernel, params = "v3", {}       # rows of more than MAX_SLICES slices: one block per row
    cand = torch.empty(scores.shape, dtype=torch.int32, device=scores.device)  # keys of the k-th's bucket
    if target.name in topk_select_v3_program.targets and kernel == "v3":
        topk_select_v3_program.compile(target, k=k, **params).launcher()(scores.view(R, -1, 4), lengths, cand, out)
    else:
        topk_select_program.compile(target).launcher()(scores, lengths, cand, out)
    return out


@torch.library.custom_op("tilecraft::topk_select", mutates_args=())
def _topk_op(scores: torch.Tensor, k: int, lengths: torch.Tensor | None) -> torch.Tensor:
    return _impl(scores, k, lengths)


@_topk_op.register_fake
def _(scores, k, lengths):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


def topk_select(scores, k, *, lengths=None):
    """Indices of the k largest values of each row: (R, k) int32, ascending, -1 past a short row.

    scores (R, N) fp32 (bf16/fp16 are upcast); lengths (R,) int32 limits row r to its first
    lengths[r] columns, clamped to [0, N] (a length past N means the whole row, a negative one an empty row:
    the kernel reads no column outside the row). Exact; ties go to the lower index. NaN scores raise ValueError.
    """
    check.tensor("scores", scores, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    check.number("k", k, lo=1, hi=MAX_K, integer=True)
    if lengths is not None:
        check.tensor("lengths", lengths, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check.shape("lengths", lengths, (scores.shape[0],), "(rows,)")
        check.same_device(scores=scores, lengths=lengths)
    if scores.dtype != torch.float32 or not scores.is_contiguous() or scores.data_ptr() % 16:
        # (the kernels read rows 16 bytes a thread: fp32, contiguous, starting 16-byte aligned)
        scores = torch.empty(scores.shape, dtype=torch.float32, device=scores.device).copy_(scores)
    if _values.enabled(scores) and scores.numel() and bool(torch.isnan(scores).any()):
        raise ValueError("scores must not contain NaN (there is no order to pick them by)")
    return _dispatch.call(_topk_op, _impl, scores, int(k), lengths)
