"""Sliced exact top-k for CUDA: every row is cut into slices of `threads * vec * 4` columns, one
block per slice, so a few long rows still fill the GPU (64 rows of 131072 columns: 1024 blocks).

Four launches after one zeroed workspace `Ws` (rows, 4096 + 1) int32:
1. `topk_hist`   (block per slice): a 12-bit histogram of the order-preserving keys of the
   slice in shared memory, added into the row's Ws[r, :4096] with global atomics.
2. `topk_bucket` (block per row): the bucket b1 of the k-th largest key, from that histogram.
3. `topk_gather` (block per slice): keys above b1 are selected (their column goes to the slice's
   region of Sel), keys in b1 are candidates (key and column to the slice's region of Cand /
   CandIdx); one block scan places them, and the slice's two counts go to Cnt[r, s]. No atomics.
4. `topk_finish` (block per row): a block scan of the row's Cnt places every slice's hits and
   warps copy them together; 12- and 8-bit digits over the candidates give the exact k-th key
   `thr`; when several keys equal `thr` and only some are taken, three digits over their column
   indices find the lowest ones. The chosen columns are marked in a shared bitmap whose block scan
   writes them in ascending order, -1 past a short row.

Every slice's values are loaded at once (vec float4 per thread, all in flight), so no pass waits on
one chunk at a time as the one-block-per-row kernel (topk_select_v3) did. Barriers are placed by
hand (TileLang's thread-sync pass is off). CUDA only: lane shuffles and ballots.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T

from codegen import tile
from codegen.program import tile_program

RADIX_BITS = 12          # first digit: the top 12 key bits (sign, exponent, 3 mantissa bits)
NB = 1 << RADIX_BITS     # bins of the 12-bit digits
BUCKET = NB              # Ws column of the row's bucket b1 (-1: every column is taken)
WS_COLS = NB + 1
MAX_SLICES = 512         # slices per row that topk_finish's one block scan places (its thread count)
CUDA = ("cuda:sm_90a", "cuda:sm_100a")
EXAMPLES = {"indexer-2048": dict(k=2048), "sampling-512": dict(k=512)}


def slice_cols(threads=512, vec=4, **_):
    """Columns per slice of the histogram / gather kernels with these parameters."""
    return threads * vec * 4


def key32(x):
    """float32 -> uint32 with the same order (negative floats reversed; -0.0 and +0.0 equal).
    Selects, not branches: every pass computes it once per value."""
    bits = T.reinterpret(x, "uint32")
    flip = T.Select(x < T.float32(0), T.uint32(0xFFFFFFFF), T.uint32(0x80000000))
    return T.Select(x == T.float32(0), T.uint32(0x80000000), bits ^ flip)


@T.macro
def load_slice(Scores, x, r, c0, n, tx, threads, vec):
    # issue the slice's loads: value (u, v) of this thread is column c0 + (u * threads + tx) * 4 + v
    for u in T.unroll(vec):
        if c0 + (u * threads + tx) * 4 < n:
            for v in T.vectorized(4):
                x[u * 4 + v] = Scores[r, c0 // 4 + u * threads + tx, v]


@T.macro
def slice_keys(x, kx, c0, n, tx, threads, vec):
    # columns at or past n get key 0, which no float has (NaN excluded) and every pass skips
    for u in T.unroll(vec):
        for v in T.unroll(4):
            kx[u * 4 + v] = T.Select(c0 + (u * threads + tx) * 4 + v < n, key32(x[u * 4 + v]), T.uint32(0))


def hand_synced_configs(t, p):
    # hand-placed barriers (TileLang's sync pass would put one before every shared atomic);
    # every index is checked by the program itself
    return {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True,
            "tl.disable_safe_memory_legalize": True}


def block_scan_words(threads: int):
    """Macros for block-wide counting with `threads` threads (a multiple of 32)."""
    W = threads // 32

    @T.macro
    def warp_scan(sc, lane):
        # sc[0] = inclusive prefix over the warp's lanes of sc[0] (sc[1] is scratch)
        for i in T.unroll(5):
            sc[1] = tile.lane_shuffle_up(sc[0], 1 << i)
            if lane >= (1 << i):
                sc[0] = sc[0] + sc[1]

    @T.macro
    def find_digit(hist, wtot, res, sc, nbins, want, tx, w, lane):
        # res[0] = the bin d with count(bins > d) < want <= count(bins >= d); res[1] = want - count(> d).
        # Ends with a barrier; hist is only read.
        per = (nbins + threads - 1) // threads
        sc[2] = 0
        for j in T.serial(per):
            if nbins - 1 - tx * per - j >= 0:
                sc[2] = sc[2] + hist[nbins - 1 - tx * per - j]
        sc[0] = sc[2]
        warp_scan(sc, lane)
        if lane == 31:
            wtot[w] = sc[0]
        tile.barrier()
        sc[3] = 0
        for i in T.serial(W):
            if i < w:
                sc[3] = sc[3] + wtot[i]
        sc[2] = sc[3] + sc[0] - sc[2]        # count of the bins above this thread's first bin
        if sc[2] < want and sc[3] + sc[0] >= want:
            for j in T.serial(per):
                if nbins - 1 - tx * per - j >= 0:
                    if sc[2] < want and sc[2] + hist[nbins - 1 - tx * per - j] >= want:
                        res[0] = nbins - 1 - tx * per - j
                        res[1] = want - sc[2]
                    sc[2] = sc[2] + hist[nbins - 1 - tx * per - j]
        tile.barrier()

    return warp_scan, find_digit


def _slice_grid(quads, L):
    return T.ceildiv(quads * 4, L)        # slices per row


@tile_program("topk_hist", targets=CUDA, examples=EXAMPLES, pass_configs=hand_synced_configs)
def topk_hist_program(k: int, threads: int = 512, vec: int = 4):
    """Pass 1: each slice's 12-bit key histogram, added into the row's Ws[r, :4096]."""
    rows, quads = T.dynamic("rows, quads")         # Scores viewed as (rows, cols / 4, 4)
    L = threads * vec * 4

    @T.prim_func
    def topk_hist(Scores: T.Tensor((rows, quads, 4), "float32"), Lengths: T.Tensor((rows,), "int32"),
                  Ws: T.Tensor((rows, WS_COLS), "int32")):
        with tile.grid(rows * _slice_grid(quads, L), threads) as bid:
            tx = T.get_thread_binding()
            hist = T.alloc_shared((NB,), "int32")
            x = T.alloc_local((vec * 4,), "float32")
            kx = T.alloc_local((vec * 4,), "uint32")
            r = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            n = T.alloc_var("int32")
            r = bid // _slice_grid(quads, L)
            c0 = (bid % _slice_grid(quads, L)) * L
            n = T.min(T.max(Lengths[r], 0), quads * 4)
            if n > k and c0 < n:                 # rows with n <= k take every column: no histogram
                load_slice(Scores, x, r, c0, n, tx, threads, vec)
                for i in T.serial(NB // threads):
                    hist[i * threads + tx] = 0
                tile.barrier()
                slice_keys(x, kx, c0, n, tx, threads, vec)
                for i in T.unroll(vec * 4):
                    if kx[i] != T.uint32(0):
                        T.atomic_add(hist[T.cast(kx[i] >> T.uint32(20), "int32")], 1)
                tile.barrier()
                for i in T.serial(NB // threads):
                    if hist[i * threads + tx] != 0:
                        T.atomic_add(Ws[r, i * threads + tx], hist[i * threads + tx])

    return topk_hist


@tile_program("topk_bucket", targets=CUDA, examples=EXAMPLES, pass_configs=hand_synced_configs)
def topk_bucket_program(k: int, threads: int = 512):
    """Between the passes, block per row: the bucket b1 of the k-th largest key from the row's
    histogram, into Ws[r, BUCKET] (-1 when the row has at most k columns: all are taken)."""
    rows, quads = T.dynamic("rows, quads")
    W = threads // 32
    _, find_digit = block_scan_words(threads)

    @T.prim_func
    def topk_bucket(Scores: T.Tensor((rows, quads, 4), "float32"), Lengths: T.Tensor((rows,), "int32"),
                    Ws: T.Tensor((rows, WS_COLS), "int32")):      # (Scores: only its shape is read)
        with tile.grid(rows, threads) as r:
            tx = T.get_thread_binding()
            hist = T.alloc_shared((NB,), "int32")
            wtot = T.alloc_shared((W,), "int32")
            res = T.alloc_shared((4,), "int32")
            sc = T.alloc_local((4,), "int32")
            lane = tx % 32
            w = tx // 32
            if T.min(Lengths[r], quads * 4) > k:       # the row's histogram exists (topk_hist)
                for i in T.unroll(NB // threads):
                    hist[i * threads + tx] = Ws[r, i * threads + tx]
                tile.barrier()
                find_digit(hist, wtot, res, sc, NB, k, tx, w, lane)
                if tx == 0:
                    Ws[r, BUCKET] = res[0]
            elif tx == 0:
                Ws[r, BUCKET] = -1

    return topk_bucket


@tile_program("topk_gather", targets=CUDA, examples=EXAMPLES, pass_configs=hand_synced_configs)
def topk_gather_program(k: int, threads: int = 512, vec: int = 4):
    """Pass 2, block per slice: the slice's keys above the row's bucket b1 to its region of Sel, the
    keys in b1 (key, column) to its region of Cand / CandIdx, and its two counts to Cnt[r, s]."""
    rows, quads, ccols, nsl, scols = T.dynamic("rows, quads, ccols, nsl, scols")
    L = threads * vec * 4
    KS = min(L, k)                       # a slice's region of Sel: it never selects more than k
    V = vec * 4
    assert V <= 32, "a thread's values are tracked in one 32-bit mask"
    W = threads // 32
    warp_scan, _ = block_scan_words(threads)

    @T.prim_func
    def topk_gather(Scores: T.Tensor((rows, quads, 4), "float32"), Lengths: T.Tensor((rows,), "int32"),
                    Ws: T.Tensor((rows, WS_COLS), "int32"), Cnt: T.Tensor((rows, nsl), "int32"),
                    Sel: T.Tensor((rows, scols), "int32"), Cand: T.Tensor((rows, ccols), "int32"),
                    CandIdx: T.Tensor((rows, ccols), "int32")):
        with tile.grid(rows * _slice_grid(quads, L), threads) as bid:
            tx = T.get_thread_binding()
            wtot = T.alloc_shared((W,), "int32")
            x = T.alloc_local((V,), "float32")
            kx = T.alloc_local((V,), "uint32")
            sc = T.alloc_local((4,), "int32")
            r = T.alloc_var("int32")
            s = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            n = T.alloc_var("int32")
            b1 = T.alloc_var("int32")
            above = T.alloc_var("uint32")        # bit i: value i of this thread is above b1
            inb = T.alloc_var("uint32")          # bit i: value i is in b1
            cnt = T.alloc_var("int32")
            pa = T.alloc_var("int32")
            pc = T.alloc_var("int32")
            lane = tx % 32
            w = tx // 32
            r = bid // _slice_grid(quads, L)
            s = bid % _slice_grid(quads, L)
            c0 = s * L
            n = T.min(T.max(Lengths[r], 0), quads * 4)
            if c0 >= n and tx == 0:
                Cnt[r, s] = 0
            if c0 < n:
                load_slice(Scores, x, r, c0, n, tx, threads, vec)
                b1 = Ws[r, BUCKET]
                slice_keys(x, kx, c0, n, tx, threads, vec)
                above = T.uint32(0)
                inb = T.uint32(0)
                for i in T.unroll(V):
                    above = above | T.Select(kx[i] != T.uint32(0) and T.cast(kx[i] >> T.uint32(20), "int32") > b1,
                                             T.uint32(1) << T.cast(i, "uint32"), T.uint32(0))
                    inb = inb | T.Select(kx[i] != T.uint32(0) and T.cast(kx[i] >> T.uint32(20), "int32") == b1,
                                         T.uint32(1) << T.cast(i, "uint32"), T.uint32(0))
                # this thread's selected (high 16 bits) and candidate (low 16 bits) counts
                cnt = T.call_extern("int32", "__popc", above) * 65536 + T.call_extern("int32", "__popc", inb)
                sc[0] = cnt
                warp_scan(sc, lane)
                if lane == 31:
                    wtot[w] = sc[0]
                tile.barrier()
                sc[2] = 0
                sc[3] = 0
                for i in T.serial(W):
                    sc[3] = sc[3] + wtot[i]
                    if i < w:
                        sc[2] = sc[2] + wtot[i]
                if tx == 0:
                    Cnt[r, s] = sc[3]
                pa = s * KS + ((sc[2] + sc[0] - cnt) >> 16)
                pc = c0 + ((sc[2] + sc[0] - cnt) & 65535)
                if (above | inb) != T.uint32(0):
                    for u in T.unroll(vec):
                        for v in T.unroll(4):
                            if (above >> T.cast(u * 4 + v, "uint32")) & T.uint32(1) != T.uint32(0):
                                Sel[r, T.min(pa, scols - 1)] = c0 + (u * threads + tx) * 4 + v
                                pa = pa + 1
                            if (inb >> T.cast(u * 4 + v, "uint32")) & T.uint32(1) != T.uint32(0):
                                Cand[r, T.min(pc, ccols - 1)] = T.reinterpret(kx[u * 4 + v], "int32")
                                CandIdx[r, T.min(pc, ccols - 1)] = c0 + (u * threads + tx) * 4 + v
                                pc = pc + 1

    return topk_gather


@tile_program("topk_finish", targets=CUDA, examples=EXAMPLES, pass_configs=hand_synced_configs)
def topk_finish_program(k: int, threads: int = 512, words: int = 8192, staged: int = 4096, slice_cols: int = 8192):
    """Pass 3, block per row: the slices' hits gathered (a block scan of Cnt places each slice's
    region; a warp copies a region), the exact k-th key among the candidates, the lowest columns
    among its ties, then the chosen columns marked in a shared bitmap (`words` x 32 columns per
    window) whose block scan writes them in ascending order. Up to `staged` candidates are kept in
    shared memory; a row with more compacts them into CandC / CandIdxC. A row has at most `threads`
    slices of `slice_cols` columns (the op checks)."""
    rows, ccols, nsl, scols = T.dynamic("rows, ccols, nsl, scols")
    KS = min(slice_cols, k)
    W = threads // 32
    WPT = words // threads                       # bitmap words per thread (contiguous: scan order)
    assert words % threads == 0 and staged % threads == 0
    warp_scan, find_digit = block_scan_words(threads)

    def pick(m, in_shared, in_global):
        # a candidate's key or column: from shared memory when the row's candidates fit there
        return T.if_then_else(m <= staged, in_shared, in_global)

    @T.macro
    def clear(buf, nbins, tx):
        for i in T.serial((nbins + threads - 1) // threads):
            if i * threads + tx < nbins:
                buf[i * threads + tx] = 0
        tile.barrier()

    @T.prim_func
    def topk_finish(Lengths: T.Tensor((rows,), "int32"), Cnt: T.Tensor((rows, nsl), "int32"),
                    Sel: T.Tensor((rows, scols), "int32"), Cand: T.Tensor((rows, ccols), "int32"),
                    CandIdx: T.Tensor((rows, ccols), "int32"), CandC: T.Tensor((rows, ccols), "int32"),
                    CandIdxC: T.Tensor((rows, ccols), "int32"), Out: T.Tensor((rows, k), "int32")):
        with tile.grid(rows, threads) as r:
            tx = T.get_thread_binding()
            hist = T.alloc_shared((NB,), "int32")
            bits = T.alloc_shared((words,), "uint32")
            skey = T.alloc_shared((staged,), "uint32")
            scol = T.alloc_shared((staged,), "int32")
            ssel = T.alloc_shared((k,), "int32")
            acnt = T.alloc_shared((threads,), "int32")      # per slice: selected, candidates, and where
            ccnt = T.alloc_shared((threads,), "int32")      # they go (exclusive prefixes)
            aoff = T.alloc_shared((threads,), "int32")
            coff = T.alloc_shared((threads,), "int32")
            wtot = T.alloc_shared((2 * W,), "int32")
            res = T.alloc_shared((4,), "int32")
            sc = T.alloc_local((4,), "int32")
            sd = T.alloc_local((4,), "int32")
            tk = T.alloc_local((4,), "int32")
            tc = T.alloc_local((4,), "int32")
            n = T.alloc_var("int32")
            kk = T.alloc_var("int32")
            a = T.alloc_var("int32")
            m = T.alloc_var("int32")
            want = T.alloc_var("int32")
            thr = T.alloc_var("uint32")
            eq = T.alloc_var("int32")
            icut = T.alloc_var("int32")
            ipre = T.alloc_var("int32")
            key = T.alloc_var("uint32")
            col = T.alloc_var("int32")
            sl = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            pos = T.alloc_var("int32")
            base = T.alloc_var("int32")
            wd = T.alloc_var("uint32")
            nset = T.alloc_var("int32")
            lane = tx % 32
            w = tx // 32
            n = T.min(T.max(Lengths[r], 0), ccols)
            kk = T.min(k, n)
            # one block scan of the slices' (selected, candidate) counts: thread t holds slice t
            sc[0] = T.if_then_else(tx < nsl, Cnt[r, T.min(tx, nsl - 1)], 0)
            acnt[tx] = sc[0] >> 16
            ccnt[tx] = sc[0] & 65535
            sc[0] = acnt[tx]
            sd[0] = ccnt[tx]
            warp_scan(sc, lane)
            warp_scan(sd, lane)
            if lane == 31:
                wtot[w] = sc[0]
                wtot[W + w] = sd[0]
            tile.barrier()
            sc[2] = 0
            sd[2] = 0
            a = 0
            m = 0
            for i in T.serial(W):
                if i < w:
                    sc[2] = sc[2] + wtot[i]
                    sd[2] = sd[2] + wtot[W + i]
                a = a + wtot[i]
                m = m + wtot[W + i]
            aoff[tx] = sc[2] + sc[0] - acnt[tx]
            coff[tx] = sd[2] + sd[0] - ccnt[tx]
            a = T.min(a, kk)
            tile.barrier()
            # warp w copies the regions of slices w, w + W, ...: candidates to shared memory (or to
            # CandC when there are too many), selected columns to ssel; 4 loads per lane in flight
            for it in T.serial(T.ceildiv(nsl, W)):
                sl = it * W + w
                if sl < nsl:
                    for i in T.serial(T.ceildiv(ccnt[sl], 128)):
                        for u in T.unroll(4):
                            if (i * 4 + u) * 32 + lane < ccnt[sl]:
                                tk[u] = Cand[r, sl * slice_cols + (i * 4 + u) * 32 + lane]
                                tc[u] = CandIdx[r, sl * slice_cols + (i * 4 + u) * 32 + lane]
                        for u in T.unroll(4):
                            if (i * 4 + u) * 32 + lane < ccnt[sl]:
                                if m <= staged:
                                    skey[coff[sl] + (i * 4 + u) * 32 + lane] = T.reinterpret(tk[u], "uint32")
                                    scol[coff[sl] + (i * 4 + u) * 32 + lane] = tc[u]
                                else:
                                    CandC[r, coff[sl] + (i * 4 + u) * 32 + lane] = tk[u]
                                    CandIdxC[r, coff[sl] + (i * 4 + u) * 32 + lane] = tc[u]
                    for i in T.serial(T.ceildiv(acnt[sl], 128)):
                        for u in T.unroll(4):
                            if (i * 4 + u) * 32 + lane < acnt[sl]:
                                tk[u] = Sel[r, sl * KS + (i * 4 + u) * 32 + lane]
                        for u in T.unroll(4):
                            if (i * 4 + u) * 32 + lane < acnt[sl] and aoff[sl] + (i * 4 + u) * 32 + lane < k:
                                ssel[aoff[sl] + (i * 4 + u) * 32 + lane] = tk[u]
            tile.barrier()
            want = kk - a                         # taken from the candidates
            thr = T.uint32(0xFFFFFFFF)            # above every key: none taken
            icut = 0x7FFFFFFF
            if want > 0 and m > 0:
                # digit 2 (key bits 8..19) among the candidates (they share bits 20..31)
                clear(hist, NB, tx)
                for i in T.serial(T.ceildiv(m, threads)):
                    if i * threads + tx < m:
                        T.atomic_add(hist[T.cast((pick(m, skey[i * threads + tx], T.reinterpret(CandC[r, i * threads + tx], "uint32")) >> T.uint32(8)) & T.uint32(0xFFF), "int32")], 1)
                tile.barrier()
                find_digit(hist, wtot, res, sc, NB, want, tx, w, lane)
                want = res[1]
                thr = (pick(m, skey[0], T.reinterpret(CandC[r, 0], "uint32")) & T.uint32(0xFFF00000)) | (T.cast(res[0], "uint32") << T.uint32(8))
                # digit 3 (bits 0..7) among those in b2
                clear(hist, 256, tx)
                for i in T.serial(T.ceildiv(m, threads)):
                    if i * threads + tx < m:
                        key = pick(m, skey[i * threads + tx], T.reinterpret(CandC[r, i * threads + tx], "uint32"))
                        if (key >> T.uint32(8)) == (thr >> T.uint32(8)):
                            T.atomic_add(hist[T.cast(key & T.uint32(0xFF), "int32")], 1)
                tile.barrier()
                find_digit(hist, wtot, res, sc, 256, want, tx, w, lane)
                thr = thr | T.cast(res[0], "uint32")
                want = res[1]                     # keys equal to thr that are taken
                eq = hist[res[0]]                 # keys equal to thr
                tile.barrier()
                if want < eq:
                    # the `want` lowest columns among the keys equal to thr: digits of the column
                    # (bits 20..30, 10..19, 0..9), bins mirrored so the digit search counts from below
                    ipre = 0
                    for d in T.unroll(3):
                        clear(hist, NB, tx)
                        for i in T.serial(T.ceildiv(m, threads)):
                            if i * threads + tx < m:
                                col = pick(m, scol[i * threads + tx], CandIdxC[r, i * threads + tx])
                                if pick(m, skey[i * threads + tx], T.reinterpret(CandC[r, i * threads + tx], "uint32")) == thr:
                                    if d == 0 or (col >> (30 - d * 10)) == ipre:
                                        T.atomic_add(hist[2047 - ((col >> (20 - d * 10)) & T.if_then_else(d == 0, 2047, 1023))], 1)
                        tile.barrier()
                        find_digit(hist, wtot, res, sc, 2048, want, tx, w, lane)
                        ipre = (ipre << T.if_then_else(d == 0, 11, 10)) | (2047 - res[0])
                        want = res[1]
                    icut = ipre
            # the chosen columns (Sel[r, :a] and the winning candidates) marked in a bitmap, one
            # window of words * 32 columns at a time (an add sets the bit: every column comes once;
            # TileLang's atomic_or is global-only); a block scan of popcounts writes them in order
            base = 0
            for win in T.serial(T.ceildiv(n, words * 32)):
                lo = win * (words * 32)
                clear(bits, words, tx)
                for i in T.unroll((k + threads - 1) // threads):
                    if i * threads + tx < a:
                        col = ssel[i * threads + tx] - lo
                        if col >= 0 and col < words * 32:
                            T.atomic_add(bits[col >> 5], T.uint32(1) << T.cast(col & 31, "uint32"))
                for i in T.serial(T.ceildiv(m, threads)):
                    if i * threads + tx < m:
                        key = pick(m, skey[i * threads + tx], T.reinterpret(CandC[r, i * threads + tx], "uint32"))
                        col = pick(m, scol[i * threads + tx], CandIdxC[r, i * threads + tx]) - lo
                        if (key > thr or (key == thr and col + lo <= icut)) and col >= 0 and col < words * 32:
                            T.atomic_add(bits[col >> 5], T.uint32(1) << T.cast(col & 31, "uint32"))
                tile.barrier()
                sc[0] = 0
                for j in T.unroll(WPT):
                    sc[0] = sc[0] + T.call_extern("int32", "__popc", bits[tx * WPT + j])
                sc[2] = sc[0]
                warp_scan(sc, lane)
                if lane == 31:
                    wtot[w] = sc[0]
                tile.barrier()
                pos = base + sc[0] - sc[2]
                for i in T.serial(W):
                    if i < w:
                        pos = pos + wtot[i]
                    base = base + wtot[i]
                for j in T.serial(WPT):
                    wd = bits[tx * WPT + j]
                    nset = T.call_extern("int32", "__popc", wd)   # a variable: the loop clears wd's bits
                    for t in T.serial(nset):
                        Out[r, T.min(pos, k - 1)] = lo + (tx * WPT + j) * 32 + T.call_extern("int32", "__ffs", wd) - 1
                        pos = pos + 1
                        wd = wd & (wd - T.uint32(1))
                tile.barrier()
            for i in T.serial(T.ceildiv(k, threads)):
                if i * threads + tx < k and i * threads + tx >= kk:
                    Out[r, i * threads + tx] = -1

    return topk_finish
