"""One-pass top-k for CUDA rows of up to MAX_COLS columns: one thread-block cluster per row.

A row is cut into `cluster` slices of `threads * vec * 4` columns, one block each; the blocks of a
cluster run at the same time (on one GPC) and wait on each other with cluster barriers. One
launch, `topk_cluster`, does what topk_sliced's hist + bucket + gather do in three:
1. every block loads its slice once (vec float4 per thread, all in flight), keeps the slice's keys
   in shared memory, builds its 12-bit histogram there, and zeroes its share of the row's Ws[r];
2. cluster barrier; nonzero bins are added into Ws[r] (global atomics); cluster barrier;
3. every block reads the row's histogram (L2), finds the k-th's bucket b1 itself, and writes its
   slice's hits from shared memory into the per-slice regions of Sel / Cand / CandIdx and the
   counts into Cnt[r, s]: exactly what topk_sliced.topk_finish reads.
So the scores cross HBM once (the sliced path reads them twice), the op is two launches (this,
then topk_finish) and no workspace is zeroed by a separate launch. Rows longer than MAX_COLS
keep the sliced path.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T

from codegen import tile
from codegen.program import tile_program
from ops import topk_sliced as ts

MAX_CLUSTER = 8          # blocks per cluster: the portable limit on sm_90a and sm_100a
MAX_VEC = 8              # float4 per thread: 32 values, tracked in one 32-bit hit mask
THREADS = 512
MAX_COLS = MAX_CLUSTER * ts.slice_cols(THREADS, MAX_VEC)      # 131072


def plan(n: int, threads: int = THREADS):
    """(cluster, vec) for rows of n columns: the fewest blocks (a power of two up to MAX_CLUSTER)
    and then the fewest float4 per thread (a power of two) that cover the row; None past MAX_COLS."""
    q = max(1, -(-n // ts.slice_cols(threads, 1)))            # slices of one float4 per thread
    cluster = min(MAX_CLUSTER, 1 << (q - 1).bit_length())
    vec = 1 << (-(-q // cluster) - 1).bit_length()
    return (cluster, vec) if vec <= MAX_VEC else None


@tile_program("topk_cluster", targets=ts.CUDA,
              examples={"indexer-2048": dict(k=2048), "sampling-512": dict(k=512, vec=4)},
              pass_configs=ts.hand_synced_configs)
def topk_cluster_program(k: int, threads: int = THREADS, vec: int = MAX_VEC, cluster: int = MAX_CLUSTER):
    """Histogram, bucket and gather of one row per cluster (see the module docstring)."""
    rows, quads, ccols, scols = T.dynamic("rows, quads, ccols, scols")
    L = ts.slice_cols(threads, vec)
    KS = min(L, k)                       # a slice's region of Sel: it never selects more than k
    V = vec * 4
    W = threads // 32
    ZB = ts.NB // cluster                # bins of Ws[r] each block zeroes
    assert V <= 32, "a thread's values are tracked in one 32-bit mask"
    assert ts.NB % (cluster * threads) == 0 or ZB < threads
    warp_scan, find_digit = ts.block_scan_words(threads)

    def launch(blocks):
        return tile.cluster_grid(blocks, threads, cluster) if cluster > 1 else tile.grid(blocks, threads)

    def row_barrier():
        # a one-block "cluster" is the block itself
        return tile.cluster_barrier() if cluster > 1 else tile.barrier()

    @T.prim_func
    def topk_cluster(Scores: T.Tensor((rows, quads, 4), "float32"), Lengths: T.Tensor((rows,), "int32"),
                     Ws: T.Tensor((rows, ts.NB), "int32"), Cnt: T.Tensor((rows, cluster), "int32"),
                     Sel: T.Tensor((rows, scols), "int32"), Cand: T.Tensor((rows, ccols), "int32"),
                     CandIdx: T.Tensor((rows, ccols), "int32")):
        with launch(rows * cluster) as bid:
            tx = T.get_thread_binding()
            keys = T.alloc_shared((L,), "uint32")          # the slice's keys, 0 past the row
            hist = T.alloc_shared((ts.NB,), "int32")
            wtot = T.alloc_shared((W,), "int32")
            res = T.alloc_shared((4,), "int32")
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
            hits = T.alloc_var("uint32")
            nhit = T.alloc_var("int32")
            bit = T.alloc_var("int32")
            col = T.alloc_var("int32")
            lane = tx % 32
            w = tx // 32
            r = bid // cluster
            s = bid % cluster
            c0 = s * L
            n = T.min(T.max(Lengths[r], 0), quads * 4)
            ts.load_slice(Scores, x, r, c0, n, tx, threads, vec)
            for i in T.serial(ts.NB // threads):
                hist[i * threads + tx] = 0
            if n > k:                            # rows with n <= k take every column: no histogram
                for i in T.serial(T.ceildiv(ZB, threads)):
                    if i * threads + tx < ZB:
                        Ws[r, s * ZB + i * threads + tx] = 0
            tile.barrier()
            ts.slice_keys(x, kx, c0, n, tx, threads, vec)
            for u in T.unroll(vec):
                for v in T.vectorized(4):
                    keys[(u * threads + tx) * 4 + v] = kx[u * 4 + v]
            if n > k:
                for i in T.unroll(V):
                    if kx[i] != T.uint32(0):
                        T.atomic_add(hist[T.cast(kx[i] >> T.uint32(20), "int32")], 1)
            tile.barrier()
            row_barrier()                        # every share of Ws[r] is zero
            if n > k:
                for i in T.serial(ts.NB // threads):
                    if hist[i * threads + tx] != 0:
                        T.atomic_add(Ws[r, i * threads + tx], hist[i * threads + tx])
            row_barrier()                        # Ws[r] is the row's histogram
            b1 = -1                              # every key is above it: all columns taken
            if n > k:
                for i in T.unroll(ts.NB // threads):
                    # L2 loads (__ldcg): the bins were summed by atomics of other blocks
                    hist[i * threads + tx] = T.call_extern("int32", "__ldcg", T.address_of(Ws[r, i * threads + tx]))
                tile.barrier()
                find_digit(hist, wtot, res, sc, ts.NB, k, tx, w, lane)
                b1 = res[0]
            # the slice's hits, from the keys in shared memory (each thread reads its own values)
            above = T.uint32(0)
            inb = T.uint32(0)
            for u in T.unroll(vec):
                for v in T.vectorized(4):
                    kx[u * 4 + v] = keys[(u * threads + tx) * 4 + v]
            for i in T.unroll(V):
                above = above | T.Select(kx[i] != T.uint32(0) and T.cast(kx[i] >> T.uint32(20), "int32") > b1,
                                         T.uint32(1) << T.cast(i, "uint32"), T.uint32(0))
                inb = inb | T.Select(kx[i] != T.uint32(0) and T.cast(kx[i] >> T.uint32(20), "int32") == b1,
                                     T.uint32(1) << T.cast(i, "uint32"), T.uint32(0))
            # this thread's selected (high 16 bits) and candidate (low 16 bits) counts, placed by a block scan
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
            # only this thread's hits, lowest value first: a warp runs as many rounds as its busiest
            # lane has hits (a loop over all V values cost ~10 instructions per value, hit or not)
            hits = above | inb
            nhit = T.call_extern("int32", "__popc", hits)         # a variable: the loop clears hits' bits
            for _ in T.serial(nhit):
                bit = T.call_extern("int32", "__ffs", hits) - 1
                col = ((bit >> 2) * threads + tx) * 4 + (bit & 3)         # the value's column in the slice
                if (above >> T.cast(bit, "uint32")) & T.uint32(1) != T.uint32(0):
                    Sel[r, T.min(pa, scols - 1)] = c0 + col
                    pa = pa + 1
                if (inb >> T.cast(bit, "uint32")) & T.uint32(1) != T.uint32(0):
                    Cand[r, T.min(pc, ccols - 1)] = T.reinterpret(keys[col], "int32")
                    CandIdx[r, T.min(pc, ccols - 1)] = c0 + col
                    pc = pc + 1
                hits = hits & (hits - T.uint32(1))

    return topk_cluster
