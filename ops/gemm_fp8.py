"""Block-scaled FP8 GEMMs in DeepGEMM's layouts (NT: both operands K-major).

C = (A * sfa) @ (B * sfb)^T with A (m, k) e4m3 scaled per (row, 128 columns) and B (n, k) e4m3
scaled per 128 x 128 block. One tile program serves four layouts:
  dense                       A (m, k), B (1, n, k)
  m-grouped contiguous        A (M, k) in 128-aligned expert segments, m_indices (M,) -> B (g, n, k);
                              rows whose m_indices is -1 (padding) come out as zeros
  m-grouped masked            A (g, max_m, k), only the first masked_m[g] rows of group g computed;
                              the other rows come out as zeros
  m-grouped sorted            A (rows, k) sorted by expert with no padding (moe_dispatch align=1),
                              Items (max_items, 3) work items (expert, first row, row count) from
                              ops.moe_tile_items: one block per (item, n tile), only the item's
                              rows are stored (rows no item lists are left as they were)
The MMA of each 128-wide K block goes into a fresh accumulator and is promoted into fp32 registers
with its two scales (DeepGEMM's two-level accumulation, tile.mma_promoted), so fp8 products never
sum across scales. On Ascend the promotion runs on the vector cores, each over half the tile's rows
(tile.split_rows), with the running sum in UB.
On CPU tensors every op runs the exact-dequant fp32 reference.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import functools
import math
import operator

import tilelang.language as T
import torch

from backends.cuda.device import max_active_clusters, sm_count
from codegen import jit, rules, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import _validate as check
from ops._ready import READY_SOURCE, ready_fold, ready_value
from ops._workspace import arrival_counters, bound_only, ready_partials
from ops.quant import dequant_fp8_blocks, dequant_fp8_token_groups

GROUP = 128
MODES = ("dense", "contiguous", "masked", "sorted")
SORTED_BLOCK_M = 64   # rows per work item of the sorted layout (moe_tile_items' block_m)
OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ALIGN_N, ALIGN_K = 64, 128
C_PAD = 8       # stage_c: elements of padding a staged row of C (16 bytes in bf16)


@tile_program(
    "fp8_gemm_nt",
    # Ascend: the Cube multiplies fp8 into L0C, each vector core folds in its half of the rows
    # (tile.split_rows, tile.mma_promoted); generated Ascend C only, no device has run it
    targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950"),
    examples={"prefill-7168x16384": dict(n=7168, k=16384), "decode-2112x7168": dict(n=2112, k=7168, block_m=64, block_n=64),
              "grouped-4096x7168": dict(n=4096, k=7168, mode="contiguous"),
              "sorted-4096x7168": dict(n=4096, k=7168, mode="sorted", block_m=64)},
)
def fp8_gemm_program(n: int, k: int, mode: str = "dense", out_dtype: str = "bfloat16", block_m: int = 128,
                     block_n: int = 128, stages: int = 4, threads: int = 256, splits: int = 1, overlap: bool = False,
                     fold: bool = False, cluster: bool = False, trace: bool = False,
                     multicast: bool = False, cluster_smem: bool = False, stage_c: bool = False,
                     persistent: bool = False, sms: int = 132, early: bool = True, raster: int = 1,
                     sfa_ring: int = 0, trace_steps: bool = False):
    """A tile of C per block: fp8 MMAs per 128-wide K block, promoted with sfa[row] * sfb[block].

    splits > 1 (dense only): split-K for grids too small to fill the GPU (decode). Block (tile, s)
    sums K blocks [s * per, (s + 1) * per) into fp32 partials Part[s]; fp8_gemm_reduce_program adds
    them in the order s = 0, 1, ... (deterministic) and casts. fold=True (CUDA): no
    second kernel; the last of a tile's blocks to finish (tile.last_arrival on Count[tile], a zeroed
    int32 per tile that it sets back to 0) adds the tile's partials in that same order and casts:
    the same bits as the reduce kernel. In the v2 loop with fences; in the v3 loop (sm_90a, bf16 out)
    without (ops._ready): Part must then hold READY_EMPTY in every word (ops._workspace.ready_partials),
    and is left so.

    cluster=True (CUDA, splits > 1, either loop): a tile's `splits` blocks are one thread-block
    cluster (tile.cluster_grid; the hardware runs them at once, so they may wait on each other). Each
    stores the partials of the other blocks' column slices, all meet at a cluster barrier, then block
    ts writes columns [ts * w, (ts + 1) * w) of the tile (w = block_n / splits) as the reduce kernel
    would: its own partial from registers, the others' from Part, added in split order. No second
    kernel and 1/splits fewer partial stores, with the same bits.

    cluster_smem=True (with cluster=True, 2 splits): the pair exchanges the partials through
    distributed shared memory instead of Part: each block stores the other's column half into that
    block's `recv` buffer (tile.cluster_store), one cluster barrier, then each adds its own partial
    and the received one (P0 + P1: the reduce kernel's bits) and stores C. No partials in global
    memory, no second kernel (bench/NOTES.md "GEMM v6", the decode split-K count).

    trace=True (fold=False; bench.prof_gemm): the SM clock when block b's first thread reaches each of
    TRACE_EVENTS goes to Count[b * 8 + event] (int32 bits). The v3 loop stamps V3_TRACE_EVENTS (its
    bursts have no single "last step"). trace_steps=True (with trace, the v3 loop, one tile a CTA): a
    block's stamps are 8 + 2 * steps apart, the events' 8 followed by the clock when the producer issued
    each K block's loads, then the clock when the MMA warpgroups found each one landed
    (bench.prof_gemm --trace-steps: a stream's loaded latency and period, block by block).

    mode "sorted": MIdx is the (items, 3) work list; block (item, tn) computes the block_m rows from
    the item's first row (rows past its count belong to the next expert, or are TMA's zero fill
    past the end: computed, never stored) and stores only the item's rows. Items with a negative
    expert or no rows run no K steps and store nothing.

    multicast=True (the v3 loop, one split, an even number of n tiles; not the sorted layout): blocks
    run as clusters of two n-neighbours of one m tile, and each A tile is loaded once by TMA
    multicast into both (mma_promoted_loop share_a=2): a quarter fewer bytes from L2 per K step.

    stage_c=True (one split, no cluster; CUDA: it orders the MMA threads with tile.barrier): the
    epilogue writes the tile of C (zeros and all, as the layout wants) into a shared staging tile,
    then copies it out row by row, 16 bytes a thread, instead of storing 4-byte pieces of rows from
    the accumulator's register layout. The staging rows are padded by C_PAD elements, so that the
    accumulator layout's eight rows a warp write land in different banks.

    persistent=True (sm_90a, the v3 loop, one split, stage_c, not sorted): min(tiles, sms) CTAs, CTA c
    computing tiles c, c + sms, ... (tile.mma_promoted_loop tiles=tile.Tiles): the producer loads a
    tile's K blocks while the MMA warpgroups fold the last tile's and store its C, so the first loads'
    latency and the epilogue are paid about once a CTA, not once a tile. The staged tile of C then goes
    over the staged sfa where that is as large, else into memory of its own (the A stages are being
    refilled). Same products, same fold order: the bits of the one-tile-a-CTA kernel. early: the next
    tile's scales are copied (cp.async) before this tile's epilogue, else after it (early_scales). With
    column passes the staged C holds one pass's columns at a time (staged_columns).

    block_n > 128 (sm_90a, the v3 loop's one-split tiles, staged C in bf16): each K block's MMA in
    column passes (pass_width: 128 for multiples of 128, 64 for block_n = 192, whose odd tiles start
    64 columns into a block of sfb), each promoted with its own columns' sfb and folded into its own
    accumulator: per element the products and fold order of 128-wide tiles.

    raster > 1 (one split, not sorted or persistent): blocks take their tiles in groups of `raster` m
    tiles, down the group's m tiles first, then across n (n-neighbours of a multicast pair stay
    consecutive), so that a wave's blocks read fewer distinct A and B tiles from L2 and DRAM; the last
    group has the m tiles that are left. raster=1: row-major (n fastest).

    sfa_ring = P > 0 (sm_90a, the v3 loop, one split, one tile a CTA): the tile's sfa is not staged
    whole in the prologue (128 rows x kb fp32: 64 KB at k = 16384, a pipeline stage's worth) but
    loaded by the producer's TMA in chunks of P K blocks into a ring of SFA_RING_SLOTS (mma_promoted_loop
    side=): 12 KB at P = 8. The same factors, so the same bits.

    overlap: the K loop is tile.mma_promoted_loop (sm_90a: a producer warpgroup and the MMA of
    block s in flight while block s-1 is promoted, in bursts of 4 blocks that drain at their end;
    same products, same order of folding, so the same bits as overlap=False); otherwise the
    pipelined loop with one tile.mma_promoted per step.
    """
    assert mode in MODES, mode
    assert k % GROUP == 0 and n % block_n == 0 and block_m in (64, 128)
    columns = column_passes(block_n)
    if (block_n % GROUP and block_n != 192) if columns > 1 else GROUP % block_n:
        raise ValueError(f"block_n must divide {GROUP}, be a multiple of it or be 192, got {block_n}")
    if columns > 1 and (not stage_c or out_dtype != "bfloat16"):
        # (stage_c: the v3 loop, one split, no cluster; its bf16 tile of C fits over 3 B stages, fp32's would not)
        raise ValueError(f"block_n={block_n} (column passes) runs in the v3 loop's one-split tiles with the staged "
                         f"epilogue and bf16 out: it needs stage_c=True and out_dtype bfloat16, got "
                         f"stage_c={stage_c}, out_dtype={out_dtype!r}")
    assert splits == 1 or mode == "dense", "split-K is for the dense layout"
    if trace and fold:
        raise ValueError("trace=True stamps a block's events into Count: not with fold=True, whose arrivals it holds")
    if trace_steps and not (trace and overlap and not persistent):
        raise ValueError(f"trace_steps=True stamps the v3 loop's K blocks of one tile a CTA: it needs trace=True, "
                         f"overlap=True and persistent=False, got trace={trace}, overlap={overlap}, "
                         f"persistent={persistent}")
    if fold and splits == 1:
        raise ValueError(f"fold=True adds split-K partials inside the kernel: it needs splits > 1, got splits={splits}")
    if fold and overlap and (out_dtype != "bfloat16" or tile.producer_threads() == 0):
        raise ValueError(f"fold=True in the v3 loop (overlap=True) is the fenceless fold of bf16 tiles on sm_90a's "
                         f"MMA threads: it needs out_dtype bfloat16 and a TMA producer warpgroup (cuda:sm_90a), got "
                         f"out_dtype={out_dtype!r}, producer threads {tile.producer_threads()}")
    if cluster and (splits not in (2, 4, 8) or fold or block_n % (8 * splits)):
        raise ValueError(f"cluster=True folds split-K partials in a cluster of the splits: it needs splits of 2, 4 "
                         f"or 8 dividing block_n into 8-column slices and fold=False, got splits={splits}, "
                         f"block_n={block_n}, fold={fold}")
    if cluster_smem and (not cluster or splits != 2):
        raise ValueError(f"cluster_smem=True exchanges the partials of a cluster of 2 splits: it needs cluster=True "
                         f"and splits=2, got cluster={cluster}, splits={splits}")
    if persistent and block_n == 192:
        raise ValueError("block_n=192 runs one tile a CTA (its column passes' rows of sfb are not one slice of "
                         "SFB, which a persistent CTA copies by cp.async): persistent=False")
    if persistent and (not overlap or splits > 1 or cluster or multicast or trace or fold or not stage_c
                       or mode == "sorted"):
        raise ValueError(f"persistent=True runs the v3 loop's one-split tiles back to back: it needs overlap=True, "
                         f"splits=1, stage_c=True, no cluster, multicast, trace or fold and a layout other than "
                         f"sorted, got overlap={overlap}, splits={splits}, stage_c={stage_c}, cluster={cluster}, "
                         f"multicast={multicast}, trace={trace}, fold={fold}, mode={mode!r}")
    if raster > 1 and (splits > 1 or persistent or mode == "sorted"):
        raise ValueError(f"raster={raster} groups one-split tiles of a one-tile-a-block grid: it needs splits=1, "
                         f"persistent=False and a layout other than sorted, got splits={splits}, "
                         f"persistent={persistent}, mode={mode!r}")
    if sfa_ring and (not overlap or splits > 1 or persistent or cluster or sfa_ring + 2 < stages
                     or (k // GROUP) % 4 or sfa_ring % 4):
        raise ValueError(f"sfa_ring={sfa_ring} loads sfa in chunks by the v3 loop's producer's TMA: it needs "
                         f"overlap=True, splits=1, persistent=False, cluster=False, stages <= sfa_ring + 2 and "
                         f"16-byte rows and chunks (k // 128 and sfa_ring multiples of 4), got overlap={overlap}, "
                         f"splits={splits}, persistent={persistent}, cluster={cluster}, stages={stages}, k={k}")
    if stage_c and (splits > 1 or cluster or not overlap):
        raise ValueError(f"stage_c=True stages C in the v3 loop's epilogue: it needs splits=1, cluster=False and "
                         f"overlap=True, got splits={splits}, cluster={cluster}, overlap={overlap}")
    if multicast and (not overlap or splits > 1 or cluster or mode == "sorted" or (n // block_n) % 2):
        raise ValueError(f"multicast=True shares A between two n tiles in the v3 loop: it needs overlap=True, "
                         f"splits=1, an even number of n tiles and a layout other than sorted, got overlap={overlap}, "
                         f"splits={splits}, n tiles={n // block_n}, mode={mode!r}")
    if sfa_ring and tile.producer_threads() == 0:
        raise ValueError(f"sfa_ring={sfa_ring} needs a TMA producer warpgroup that loads the tile's rows "
                         f"(cuda:sm_90a); this target has none")
    kb, nb = k // GROUP, -(-n // GROUP)
    per = -(-kb // splits)                                      # K blocks per split
    stride = 8 + 2 * per if trace_steps else 8                  # a block's stamps in Count (trace)
    n_tiles = n // block_n
    rows, groups, max_m = T.dynamic("rows, groups, max_m")
    masked = mode == "masked"
    by_items = mode == "sorted"
    items = T.dynamic("items") if by_items else None
    midx_shape = (items, 3) if by_items else (rows,)
    # masked: A, SFA and C are (groups, max_m, .); otherwise (rows, .) and the group comes from MIdx
    a_shape = (groups, max_m, k) if masked else (rows, k)
    sfa_shape = (groups, max_m, kb) if masked else (rows, kb)
    c_shape = (groups, max_m, n) if masked else (rows, n)
    part_shape = (splits, rows, n) if splits > 1 else (1, 1, n)  # fp32 partials (split-K only)
    counts = T.dynamic("counts")                                # fold: arrivals per (m, n) tile
    @T.prim_func
    def fp8_gemm_nt(
        A: T.Tensor(a_shape, "float8_e4m3fn"),
        SFA: T.Tensor(sfa_shape, "float32"),
        B: T.Tensor((groups, n, k), "float8_e4m3fn"),
        SFB: T.Tensor((groups, nb, kb), "float32"),
        MIdx: T.Tensor(midx_shape, "int32"),    # contiguous: expert of each row; sorted: work items
        MaskedM: T.Tensor((groups,), "int32"),  # masked: valid rows per group; otherwise unused
        C: T.Tensor(c_shape, out_dtype),
        Part: T.Tensor(part_shape, "float32"),  # split-K partials; unused when splits == 1
        Count: T.Tensor((counts,), "int32"),    # fold: >= m_tiles * n_tiles zeros; otherwise unused
    ):
        height = max_m if masked else rows                     # rows a group's tiles walk over
        per_group = T.max(T.ceildiv(height, block_m), 1)       # m tiles per group (never 0: it divides)
        m_tiles = per_group * groups if masked else (items if by_items else per_group)
        if persistent:                                         # min(tiles, sms) CTAs, tiles back to back
            _persistent_grid((A, SFA, B, SFB, MIdx, MaskedM, C, Part), mode, out_dtype, block_m, block_n, kb, n_tiles,
                             stages, threads, sms, early, height, per_group, rows, groups)
        else:
            extra = tile.producer_threads() if overlap else 0           # sm_90a: the TMA warpgroup
            # clusters: a tile's split blocks (cluster), or two n-neighbours sharing A (multicast)
            with _grid(m_tiles * n_tiles * splits, threads + extra,
                       splits if cluster else (2 if multicast else 1)) as bid:
                if fold and overlap:
                    # (TileLang's common header first: the helpers' bf16 types)
                    tile.import_cuda_helpers("#include <tl_templates/cuda/common.h>\n" + READY_SOURCE)
                if raster > 1:
                    (tm, tn), ts = _rastered(bid, m_tiles, n_tiles, raster, 2 if multicast else 1), 0
                else:
                    tm, tn, ts = tile.split_index(bid, (m_tiles, n_tiles, splits))
                recv = None                           # cluster_smem: the other block's partial half
                if cluster_smem:
                    recv = tile.stage((block_m, block_n // 2), "float32")
                    # a store the compiler sees before the K loop: the other block writes recv through a
                    # mapped pointer while this one may still be in its loop, so recv must not share
                    # memory with the loop's tiles (TileLang merges buffers whose visible uses do not
                    # overlap: v2 put recv on a_s, and the fold raced with the last K steps)
                    _touch(recv)
                    tile.cluster_barrier()            # both blocks started before either stores into the other
                # vector code holds rows [first, first + mine) of the tile (all of them except on Ascend,
                # where each vector core gets half of every accumulator read)
                mine, first = tile.split_rows(block_m)
                if not overlap:                                     # mma_promoted_loop makes its own
                    a_s = tile.operand((block_m, GROUP), "float8_e4m3fn")
                    b_s = tile.operand((block_n, GROUP), "float8_e4m3fn")
                if overlap:
                    split_prologue = tile.producer_threads() > 0
                    # the block's row scales for its K range (sfa_ring: a ring of chunks the producer fills)
                    sfa_s = tile.stage((SFA_RING_SLOTS, block_m, sfa_ring) if sfa_ring else (mine, per), "float32")
                    sfb_s = tile.stage(_sfb_shape(columns, kb), "float32")  # the tile's 128-row block(s) of sfb
                    # where a producer warpgroup loads the tiles (sm_90a), the scales pass through
                    # registers: the prologue's loads all issue before the producer's first TMA
                    sfa_r = tile.fragment((mine, _pow2(per))) if split_prologue and not sfa_ring else None
                    sfb_r = tile.fragment(_sfb_shape(columns, kb)) if split_prologue else None
                scale = tile.fragment((mine,))                      # sfa[row] * sfb[block], in registers
                if not overlap:                                     # the next step's sfa and sfb, loaded a step early
                    ahead_a = tile.fragment((mine,))
                    ahead_b = tile.fragment((mine,))
                part, acc = _accumulators(block_m, block_n, mine)
                if masked:
                    g = tm // per_group
                    row0 = (tm % per_group) * block_m                  # within the group
                    limit = MaskedM[g]                                 # rows at or past this are not computed
                elif mode == "contiguous":
                    row0 = tm * block_m
                    g = T.min(T.max(MIdx[T.min(row0, rows - 1)], 0), groups - 1)   # unchecked ids stay inside B
                    limit = rows
                elif by_items:
                    g = T.min(T.max(MIdx[tm, 0], 0), groups - 1)
                    row0 = T.max(MIdx[tm, 1], 0)
                    # rows at or past this are not stored (the item's rows, at most block_m; none for padding)
                    limit = T.if_then_else(MIdx[tm, 0] >= 0, T.min(row0 + T.min(MIdx[tm, 2], block_m), rows), 0)
                else:
                    row0 = tm * block_m
                    g = 0
                    limit = rows
                k0 = ts * per
                if per * splits == kb and not (mode == "masked" and block_n > 128):
                    # every split has per steps: a count the simplifier can divide. (Not the masked 256-wide
                    # tile: there nvcc keeps the narrowed index math in registers and spills 19/38 words a
                    # thread, 51.8 -> 67.8 us at 1 x 1024 x 4096 x 7168 on an H100, bench/NOTES.md "Session 74".)
                    steps = tile.steps_if(row0 < limit, per)
                else:                       # the last split has fewer (an uneven split of kb)
                    steps = T.if_then_else(row0 < limit, T.max(T.min(per, kb - k0), 0), 0)
                if trace:
                    _stamp(Count, bid, "entry", stride)
                # Staged before the first loads, the scales held every thread, the TMA thread too, for
                # ~5000 cycles (bench/NOTES.md "GEMM v4"). v3 stages them once in the MMA warpgroups
                # while the producer's first loads fly (mma_promoted_loop's prologue); the v2 loop reads
                # them from global memory one step ahead (step s loads step s + 1's into registers).
                if not overlap:
                    with tile.vector():                              # mma_promoted_loop clears it
                        for i, j in tile.parallel(mine, block_n):
                            acc[i, j] = 0.0
                        for i in tile.parallel(mine):
                            _load_scales(ahead_a, ahead_b, i, SFA, SFB, masked, g,
                                         T.min(row0 + first + i, height - 1), k0, kb, tn, block_n)
                if trace and not overlap:                        # (mma_promoted_loop marks v3's)
                    _stamp(Count, bid, "prologue done")
                mark = (lambda event: _mark(Count, bid, event, stride, per, threads)) if trace else None

                if overlap:
                    where = (C, Part, MIdx, row0, first, limit, height, g, tn, ts)
                    # one step's tiles of A and B (TMA zero-fills rows past the end)
                    # (lambda parameters are named apart from every loop variable: the DSL tracks names)
                    loads = lambda blk: (  # noqa: E731
                        A[g, row0:row0 + block_m, (k0 + blk) * GROUP:(k0 + blk + 1) * GROUP] if masked
                        else A[row0:row0 + block_m, (k0 + blk) * GROUP:(k0 + blk + 1) * GROUP],
                        B[g, tn * block_n:(tn + 1) * block_n, (k0 + blk) * GROUP:(k0 + blk + 1) * GROUP])
                    scales = (SFA, SFB, None if sfa_ring else sfa_s, sfb_s, sfa_r, sfb_r, masked, g, row0, first,
                              height, k0, kb, tn, block_n)
                    chunk = lambda c: _sfa_chunk(SFA, masked, g, row0, block_m, kb, sfa_ring, c)  # noqa: E731
                    store = ((lambda: _cluster_fold(acc, where, mine, splits, out_dtype, block_n, mark, recv))
                             if cluster
                             else (lambda: _store_ready(acc, where, mine, splits, block_m, block_n, Count,
                                                        tm * n_tiles + tn, threads, mark))
                             if fold
                             else (lambda c_s: _store_staged(acc, c_s, where, mine, mode, out_dtype, block_n, threads,
                                                             mark))
                             if stage_c
                             else (lambda: _store_marked(acc, where, mine, mode, splits, out_dtype, block_n, mark)))
                    operands = [((block_m, GROUP), "float8_e4m3fn"), ((block_n, GROUP), "float8_e4m3fn")]
                    tile.mma_promoted_loop(steps, loads, operands, part, acc, scale,
                                           lambda row, blk: _scale_factors(sfa_s, sfb_s, row, k0, blk, columns,
                                                                           sfa_ring),
                                           stages=stages,
                                           epilogue=store,
                                           prologue=((lambda: _scales_into(scales, mine, per, sfa_r, sfb_r),
                                                      lambda: _finish_scales(scales, mine, per)) if split_prologue
                                                     else lambda: _scales_into(scales, mine, per, sfa_s, sfb_s)),
                                           share_a=2 if multicast else 1, mark=mark,
                                           side=(sfa_ring, chunk, sfa_s) if sfa_ring else None,
                                           # the tile of C in the out dtype, rows padded (stage_c)
                                           epilogue_stage=(((block_m * (block_n + C_PAD),), out_dtype) if stage_c
                                                           else None))
                else:
                    for s in tile.pipelined(steps, stages=stages):
                        kk = k0 + s
                        if trace:
                            if s == 1:
                                _stamp(Count, bid, "step 1")
                            if s == steps - 1:
                                _stamp(Count, bid, "last step")
                        if masked:
                            tile.copy(A[g, row0, kk * GROUP], a_s)
                        else:
                            tile.copy(A[row0, kk * GROUP], a_s)
                        tile.copy(B[g, tn * block_n, kk * GROUP], b_s)
                        with tile.vector():
                            for i in tile.parallel(mine):
                                scale[i] = ahead_a[i] * ahead_b[i]
                                _load_scales(ahead_a, ahead_b, i, SFA, SFB, masked, g,
                                             T.min(row0 + first + i, height - 1), kk + 1, kb, tn, block_n)
                        tile.mma_promoted(a_s, b_s, part, acc, scale, step=s)
                    if trace:
                        _stamp(Count, bid, "loop done")
                    where = (C, Part, MIdx, row0, first, limit, height, g, tn, ts)
                    if cluster:
                        _cluster_fold(acc, where, mine, splits, out_dtype, block_n, mark, recv)
                    else:
                        _store(acc, where, mine, mode, splits, out_dtype, block_n)
                        if trace:
                            _stamp(Count, bid, "stored")
                    if fold:
                        if tile.last_arrival(Count, tm * n_tiles + tn, splits):
                            _fold_partials(C, Part, row0, first, height, tn, mine, splits, out_dtype, block_n)

    return fp8_gemm_nt


@T.macro
def _persistent_grid(tensors, mode, out_dtype, block_m, block_n, kb, n_tiles, stages, threads, sms, early, height,
                     per_group, rows, groups):
    """fp8_gemm_program(persistent=True)'s kernel: min(tiles, sms) CTAs each running its tiles through
    one tile.mma_promoted_loop(tiles=...)."""
    count = (per_group * groups if mode == "masked" else per_group) * n_tiles     # tiles of the whole grid
    blocks = T.min(count, sms)
    with tile.grid(blocks, threads + tile.producer_threads()) as bid:
        mine, first = tile.split_rows(block_m)
        columns = column_passes(block_n)
        sfa_s = tile.stage((mine, kb), "float32")            # the current tile's row scales, all K blocks
        sfb_s = tile.stage(_sfb_shape(columns, kb), "float32")   # its 128-row block(s) of sfb
        scale = tile.fragment((mine,))
        part, acc = _accumulators(block_m, block_n, mine)
        of = _tile_work(mode, out_dtype, block_m, block_n, kb, n_tiles, threads, per_group, height, mine, first,
                        tensors, (sfa_s, sfb_s, acc), rows, groups)
        operands = [((block_m, GROUP), "float8_e4m3fn"), ((block_n, GROUP), "float8_e4m3fn")]
        tile.mma_promoted_loop(None, None, operands, part, acc, scale,
                               lambda row, blk: _scale_factors(sfa_s, sfb_s, row, 0, blk, columns), stages=stages,
                               epilogue_stage=((block_m * (staged_columns(block_n) + C_PAD),), out_dtype),
                               # (sms: the stride wherever one CTA has two tiles or more)
                               tiles=tile.Tiles(count, bid, sms, of, spare=sfa_s, early=early))


def _tile_work(mode, out_dtype, block_m, block_n, kb, n_tiles, threads, per_group, height, mine, first, tensors, bufs,
               rows, groups):
    """The persistent program's tile.Tiles.of: tile t's steps, loads, scale staging (cp.async) and
    staged epilogue, as the one-tile kernel builds them for its block."""
    A, SFA, B, SFB, MIdx, MaskedM, C, Part = tensors
    sfa_s, sfb_s, acc = bufs
    masked = mode == "masked"

    def of(t):
        tm, tn = t // n_tiles, t % n_tiles
        g, row0, limit = _locate(mode, tm, per_group, block_m, MIdx, MaskedM, rows, groups)
        where = (C, Part, MIdx, row0, first, limit, height, g, tn, 0)
        return {"steps": tile.steps_if(row0 < limit, kb),
                "loads": lambda blk: (
                    A[g, row0:row0 + block_m, blk * GROUP:(blk + 1) * GROUP] if masked
                    else A[row0:row0 + block_m, blk * GROUP:(blk + 1) * GROUP],
                    B[g, tn * block_n:(tn + 1) * block_n, blk * GROUP:(blk + 1) * GROUP]),
                "prologue": lambda: _scales_async(SFA, SFB, sfa_s, sfb_s, masked, g, row0, tn, block_m, block_n, kb),
                "epilogue": lambda c_s: _store_staged(acc, c_s, where, mine, mode, out_dtype, block_n, threads, None,
                                                      by_pass=True)}
    return of


@T.macro
def _scales_async(SFA, SFB, sfa_s, sfb_s, masked, g, row0, tn, block_m, block_n, kb):
    """A persistent tile's scales into shared memory by cp.async (no registers; waited for at the tile's
    start): its rows' sfa for every K block and its block of sfb. Rows past the tensor's are not read."""
    if masked:
        T.async_copy(SFA[g, row0:row0 + block_m, 0:kb], sfa_s)
    else:
        T.async_copy(SFA[row0:row0 + block_m, 0:kb], sfa_s)
    if block_n > GROUP:                                  # column passes: a row of sfb each
        T.async_copy(SFB[g, tn * (block_n // GROUP):(tn + 1) * (block_n // GROUP), 0:kb], sfb_s)
    else:
        T.async_copy(SFB[g, (tn * block_n) // GROUP, 0:kb], sfb_s)


def early_scales(block_m: int, block_n: int, kb: int, out_bytes: int) -> bool:
    """Whether a persistent CTA copies the next tile's scales into shared memory before this tile's
    epilogue (under it): where the staged C cannot go over the staged sfa anyway (k < 8704 at 128 x
    128 bf16). Else after the epilogue, the C tile over the sfa: one stage more (prefill keeps 4)."""
    return block_m * kb * 4 < block_m * (staged_columns(block_n) + C_PAD) * out_bytes


def staged_columns(block_n: int) -> int:
    """Columns of C a persistent CTA stages at once: the tile's, or one column pass's (the staged C of a
    128 x 256 tile would not fit beside the stages being refilled)."""
    return pass_width(block_n) if block_n > GROUP else block_n


def _locate(mode, tm, per_group, block_m, MIdx, MaskedM, rows, groups):
    """(group, first row within it, rows at or past which nothing is computed) of m tile tm, as
    expressions (the dense, contiguous and masked layouts)."""
    if mode == "masked":
        g = tm // per_group
        return g, (tm % per_group) * block_m, MaskedM[g]
    row0 = tm * block_m
    if mode == "contiguous":
        return T.min(T.max(MIdx[T.min(row0, rows - 1)], 0), groups - 1), row0, rows   # unchecked ids stay inside B
    return 0, row0, rows


def _rastered(bid, m_tiles, n_tiles, raster, pair):
    """(m tile, n tile) of block bid in groups of `raster` m tiles (fp8_gemm_program raster): units of
    `pair` n-neighbours (consecutive blocks), down the group's m tiles first."""
    unit, j = bid // pair, bid % pair
    per = raster * (n_tiles // pair)                     # units a whole group
    first = (unit // per) * raster                       # the group's first m tile
    rows = T.min(raster, m_tiles - first)                # its m tiles (fewer in the last group)
    r = unit % per
    return first + r % rows, (r // rows) * pair + j


def _grid(blocks, threads, cluster):
    # a tile's split-K blocks are consecutive ids (split index innermost): clusters of them
    return tile.cluster_grid(blocks, threads, cluster) if cluster > 1 else tile.grid(blocks, threads)


def column_passes(block_n: int) -> int:
    """MMA passes a K block of a tile takes: one per pass_width columns of a wide tile (block_n > 128),
    else 1."""
    return block_n // pass_width(block_n) if block_n > GROUP else 1


def pass_width(block_n: int) -> int:
    """Columns of a wide tile's column pass: 128, one block of sfb, where the tile is a multiple of 128;
    64 for a 192-wide tile (an odd tile starts 64 columns into a block of sfb, so a pass of 64 still lies
    inside one block whichever tile it is)."""
    return GROUP if block_n % GROUP == 0 else GROUP // 2


def _accumulators(block_m, block_n, mine):
    """(the MMA's partial, the promoted accumulator): (block_m, block_n) and (mine, block_n) fragments, or
    for column passes a (block_m, w) partial and one (mine, w) accumulator a pass (a tuple; w = pass_width)."""
    columns = column_passes(block_n)
    width = pass_width(block_n) if columns > 1 else block_n
    part = tile.accumulator((block_m, width))
    if columns == 1:
        return part, tile.fragment((mine, block_n))
    return part, tuple(tile.fragment((mine, width)) for _ in range(columns))


def _sfb_row(tn, block_n, c):
    # the row of sfb (128-row block of B) of column pass c of n tile tn (the general form equals the first
    # for multiples of 128; those keep the index expression their kernels were measured with)
    if block_n % GROUP == 0:
        return tn * (block_n // GROUP) + c
    return (tn * block_n + c * pass_width(block_n)) // GROUP


def _sfb_shape(columns: int, kb: int) -> tuple:
    # the tile's sfb: (kb,) for one 128-row block of B, (columns, kb) for column passes
    return (kb,) if columns == 1 else (columns, kb)


def _scale_factors(sfa_s, sfb_s, row, k0, blk, columns, ring=0):
    """mma_promoted_loop's scale_of: (sfa, sfb) of K block k0 + blk; with column passes (sfa, then each
    pass's sfb). ring = P: sfa_s is the ring of P-block chunks (fp8_gemm_program sfa_ring; k0 is 0)."""
    sfa = sfa_s[(blk // ring) % SFA_RING_SLOTS, row, blk % ring] if ring else sfa_s[row, blk]
    if columns == 1:
        return sfa, sfb_s[k0 + blk]
    return (sfa, *[sfb_s[c, k0 + blk] for c in range(columns)])


def _sfa_chunk(SFA, masked, g, row0, block_m, kb, ring, c):
    """sfa_ring's chunk c: the tile's rows of sfa for K blocks [c * ring, (c + 1) * ring), c clamped to
    the last chunk (rows and blocks past the tensor's are TMA's zero fill, never used)."""
    c0 = T.min(c, (kb - 1) // ring) * ring
    return SFA[g, row0:row0 + block_m, c0:c0 + ring] if masked else SFA[row0:row0 + block_m, c0:c0 + ring]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@T.macro
def _scales_into(scales, mine, per, sfa_dst, sfb_dst):
    """v3's prologue loads: the tile's block of sfb (all K blocks) and its rows' sfa for the block's
    K range, from global memory into sfb_dst / sfa_dst: registers (the first half of the split
    prologue, sm_90a) or shared memory (in one piece, targets without a producer warpgroup). The K
    range is padded to a power of two: a thread's (row, block) by shifts, not the 64-bit divisions
    by `per` that took ~340 instructions a thread before the loads could issue (bench/NOTES.md
    "GEMM v7")."""
    SFA, SFB, sfa_s, sfb_s, sfa_r, sfb_r, masked, g, row0, first, height, k0, kb, tn, block_n = scales
    with tile.vector():
        if block_n > GROUP:                                  # column passes: one row of sfb each
            for c, kk in tile.parallel(column_passes(block_n), kb):
                sfb_dst[c, kk] = SFB[g, _sfb_row(tn, block_n, c), kk]
        else:
            for kk in tile.parallel(kb):
                sfb_dst[kk] = SFB[g, (tn * block_n) // GROUP, kk]
        if sfa_dst is not None:                              # (None: the producer loads sfa, sfa_ring)
            for i, t in tile.parallel(mine, _pow2(per)):
                if t < per:
                    r = T.min(row0 + first + i, height - 1)
                    kk = T.min(k0 + t, kb - 1)
                    sfa_dst[i, t] = SFA[g, r, kk] if masked else SFA[r, kk]


@T.macro
def _finish_scales(scales, mine, per):
    """v3's prologue, second half: the registers into shared memory (the same loops, so each thread
    stores what it loaded)."""
    SFA, SFB, sfa_s, sfb_s, sfa_r, sfb_r, masked, g, row0, first, height, k0, kb, tn, block_n = scales
    with tile.vector():
        if block_n > GROUP:
            for c, kk in tile.parallel(column_passes(block_n), kb):
                sfb_s[c, kk] = sfb_r[c, kk]
        else:
            for kk in tile.parallel(kb):
                sfb_s[kk] = sfb_r[kk]
        if sfa_s is not None:
            for i, t in tile.parallel(mine, _pow2(per)):
                if t < per:
                    sfa_s[i, t] = sfa_r[i, t]


@T.macro
def _load_scales(sa, sb, i, SFA, SFB, masked, g, r, kk, kb, tn, block_n):
    """sa[i] = sfa[r, kk], sb[i] = sfb[the tile's block, kk]: loads only, multiplied a step later so
    that nothing waits for them now. K block clamped inside the scales (the step after the last
    reads the last one, never used)."""
    sa[i] = SFA[g, r, T.min(kk, kb - 1)] if masked else SFA[r, T.min(kk, kb - 1)]
    sb[i] = SFB[g, (tn * block_n) // GROUP, T.min(kk, kb - 1)]


# "prologue done": the acc clear and the first scale loads issued (before session 13's change the
# scales were staged here: "scales staged" in older trace files); "step 1": step 0's tiles have
# landed and been multiplied and folded; "last step": its start; "stored": the partials (or C) issued;
# "folded" (cluster=True only): past the cluster barrier, the block's slice of C issued
TRACE_EVENTS = ("entry", "prologue done", "step 1", "last step", "loop done", "stored", "folded")
# v3 (mma_promoted_loop): "prologue done" once the MMA warpgroups have staged the scales; "step 1"
# once block 0's fold is issued (its tiles landed, its MMA done, block 1's in flight); "loop done"
# after the last fold (the drain included)
V3_TRACE_EVENTS = ("entry", "prologue done", "step 1", "loop done", "stored", "folded")


def _stamp(count, bid, event, stride=8):
    # the SM clock (32-bit) when the block's first thread gets here (bench.prof_gemm --trace)
    _stamp_at(count, bid * stride + TRACE_EVENTS.index(event), 0)


def _mark(count, bid, event, stride, per, threads):
    # mma_promoted_loop's mark: an event name, or ("issued", K block) from the producer (its first
    # thread follows the `threads` MMA threads) and ("landed", K block) from the MMA warpgroups, stamped
    # only with trace_steps (stride > 8)
    if isinstance(event, str):
        _stamp(count, bid, event, stride)
    elif stride > 8:
        kind, blk = event
        _stamp_at(count, bid * stride + 8 + (per if kind == "landed" else 0) + blk, threads if kind == "issued" else 0)


@T.macro
def _stamp_at(count, at, thread):
    if T.get_thread_binding() == thread:
        count[at] = T.call_extern("int32", "clock")


@T.macro
def _fold_partials(C, Part, row0, first, height, tn, mine, splits, out_dtype, block_n):
    """The tile's rows of C = cast(((Part[0] + Part[1]) + ...) in split order), as the reduce kernel."""
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            if r < height:
                C[r, tn * block_n + j] = T.cast(_in_order([Part[s, r, tn * block_n + j] for s in range(splits)]),
                                                out_dtype)


def _in_order(partials):
    """((P0 + P1) + P2) + ...: one expression built while tracing, always in this order (the reduce
    kernel and the in-kernel fold both add this way, so they give the same bits)."""
    return functools.reduce(operator.add, partials)


@T.macro
def _store(acc, where, mine, mode, splits, out_dtype, block_n):
    """The tile's rows of acc into C (or Part[ts] for split-K), as each layout wants them."""
    C, Part, MIdx, row0, first, limit, height, g, tn, ts = where
    by_items = mode == "sorted"
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            # sorted: one condition (limit <= rows), not an if nested in this one: TileLang
            # would move the nested if's global store out of it
            if r < (limit if by_items else height):
                if splits > 1:
                    Part[ts, r, tn * block_n + j] = acc[i, j]
                elif by_items:                             # other experts' rows stay untouched
                    C[r, tn * block_n + j] = T.cast(acc[i, j], out_dtype)
                else:
                    keep = r < limit and (MIdx[r] >= 0 if mode == "contiguous" else True)
                    value = T.if_then_else(keep, T.cast(acc[i, j], out_dtype), T.cast(0, out_dtype))
                    if mode == "masked":
                        C[g, r, tn * block_n + j] = value
                    else:
                        C[r, tn * block_n + j] = value


def _store_staged(acc, c_s, where, mine, mode, out_dtype, block_n, threads, mark, by_pass=False):
    """_store for one split through the staging tile c_s (stage_c=True): every value C gets, in the
    accumulator's layout (each column pass's accumulator at its columns), into c_s; the `threads` MMA
    threads meet; then whole rows out, 16 bytes a thread (TileLang vectorizes the row loop: its
    condition does not depend on the column). by_pass (column passes of a persistent CTA): c_s holds
    one pass's columns; each pass is staged and copied out in turn, the threads meeting between."""
    parts = _column_parts(acc)
    if by_pass and len(parts) > 1:
        cols = parts[0][1].shape[1]
        width = cols + C_PAD
        for p, (col0, part_acc) in enumerate(parts):
            if p > 0:
                tile.emit(tile.barrier(threads=threads))   # every read of the last pass's rows is done
            _stage_rows(part_acc, c_s, where, mine, mode, out_dtype, width, 0)
            _copy_rows_out(c_s, where, mine, mode, block_n, width, threads, col0, cols)
    else:
        width = block_n + C_PAD                            # c_s: (block_m, width) row-major, flat
        for col0, part_acc in parts:
            _stage_rows(part_acc, c_s, where, mine, mode, out_dtype, width, col0)
        _copy_rows_out(c_s, where, mine, mode, block_n, width, threads, 0, block_n)
    if mark is not None:
        mark("stored")


@T.macro
def _copy_rows_out(c_s, where, mine, mode, block_n, width, threads, col0, cols):
    # columns [col0, col0 + cols) of the tile, staged from column 0 of c_s's rows
    C, Part, MIdx, row0, first, limit, height, g, tn, ts = where
    tile.barrier(threads=threads)
    with tile.vector():
        for i, j in tile.parallel(mine, cols):
            r = row0 + first + i
            if r < (limit if mode == "sorted" else height):
                if mode == "masked":
                    C[g, r, tn * block_n + col0 + j] = c_s[(first + i) * width + j]
                else:
                    C[r, tn * block_n + col0 + j] = c_s[(first + i) * width + j]


def _column_parts(acc):
    # (first column, fragment) of each column pass's accumulator, or of the one accumulator
    if isinstance(acc, tuple):
        return [(p * a.shape[1], a) for p, a in enumerate(acc)]
    return [(0, acc)]


@T.macro
def _stage_rows(acc, c_s, where, mine, mode, out_dtype, width, col0):
    # acc's columns of every value C gets (zeros for rows past the limit and padding rows) into the
    # staging tile from column col0, in the accumulator's layout
    C, Part, MIdx, row0, first, limit, height, g, tn, ts = where
    with tile.vector():
        for i, j in tile.parallel(mine, acc.shape[1]):
            r = row0 + first + i
            if mode == "sorted":                           # rows past the item's are never copied out
                c_s[(first + i) * width + col0 + j] = T.cast(acc[i, j], out_dtype)
            else:
                keep = r < limit and (MIdx[T.min(r, limit - 1)] >= 0 if mode == "contiguous" else True)
                c_s[(first + i) * width + col0 + j] = T.if_then_else(keep, T.cast(acc[i, j], out_dtype),
                                                                     T.cast(0, out_dtype))


@T.macro
def _store_ready(acc, where, mine, splits, block_m, block_n, Count, index, threads, mark):
    """fold=True in the v3 loop: the split's partial into Part as ready words (ops._ready), the `threads` MMA
    threads' arrival on Count[index] without fences, then the tile's last block to arrive adds the tile's
    partials in split order (the reduce kernel's bits) into C, waiting for each word, and empties them."""
    C, Part, MIdx, row0, first, limit, height, g, tn, ts = where
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            if r < height:
                Part[ts, r, tn * block_n + j] = ready_value(acc[i, j])
    if mark is not None:
        mark("stored")
    if tile.last_arrival(Count, index, splits, threads=threads, ordered=False):
        # up to 16 loads a thread in flight: the accumulators are dead by now
        ready_fold(C, Part, splits, block_m, block_n, tn * block_n, T.min(height, row0 + block_m), height, threads,
                   row0=row0, in_flight=16)


@T.macro
def _store_marked(acc, where, mine, mode, splits, out_dtype, block_n, mark):
    _store(acc, where, mine, mode, splits, out_dtype, block_n)
    if mark is not None:
        mark("stored")


@T.macro
def _touch(buf):
    buf[0, 0] = T.float32(0)


@T.macro
def _cluster_fold(acc, where, mine, splits, out_dtype, block_n, mark, recv=None):
    """Split-K folded in the tile's cluster (cluster=True): partials of the other blocks' column slices
    to their owners, the cluster barrier, then this block's slice of C = cast(((P0 + P1) + ...) in
    split order) with its own partial read from registers. Column slices: every thread of the WGMMA
    layout holds columns of each slice, so all of them work on both halves.
    The partials go through Part in global memory, or (recv, cluster_smem=True, 2 splits) straight
    into the owner's recv in distributed shared memory (tile.cluster_store)."""
    C, Part, MIdx, row0, first, limit, height, g, tn, ts = where
    width = block_n // splits
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            if r < height and j // width != ts:
                if recv is None:
                    Part[ts, r, tn * block_n + j] = acc[i, j]
                else:
                    tile.cluster_store(recv[first + i, j % width], j // width, acc[i, j])
    if mark is not None:
        mark("stored")
    tile.cluster_barrier()
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            if r < height and j // width == ts:
                theirs = [Part[s, r, tn * block_n + j] if recv is None else recv[first + i, j % width]
                          for s in range(splits)]
                C[r, tn * block_n + j] = T.cast(_in_order([T.if_then_else(ts == s, acc[i, j], theirs[s])
                                                           for s in range(splits)]), out_dtype)
    if mark is not None:
        mark("folded")


@tile_program("fp8_gemm_reduce", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950"),
              examples={"decode-4096": dict(n=4096, splits=4)})
def fp8_gemm_reduce_program(n: int, splits: int, out_dtype: str = "bfloat16", block: int = 1024, threads: int = 128):
    """C = cast(sum over s in order of Part[s]): the second half of split-K (fixed order, deterministic)."""
    rows = T.dynamic("rows")

    @T.prim_func
    def fp8_gemm_reduce(Part: T.Tensor((splits, rows, n), "float32"), C: T.Tensor((rows, n), out_dtype)):
        with tile.grid(T.ceildiv(rows * n, block), threads) as bid, tile.vector():
            for e in tile.parallel(block):
                flat = bid * block + e
                if flat < rows * n:
                    r = flat // n
                    c = flat % n
                    C[r, c] = T.cast(_in_order([Part[s, r, c] for s in range(splits)]), out_dtype)

    return fp8_gemm_reduce


# ---- references ------------------------------------------------------------------------------------

def fp8_gemm_nt_reference(a, sfa, b, sfb, out_dtype=torch.bfloat16):
    """Exact dequant, fp32 product."""
    return (dequant_fp8_token_groups(a, sfa) @ dequant_fp8_blocks(b, sfb).T).to(out_dtype)


def m_grouped_contiguous_reference(a, sfa, b, sfb, m_indices, out_dtype=torch.bfloat16):
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    deq_a = dequant_fp8_token_groups(a, sfa)
    for g in range(b.shape[0]):
        rows = (m_indices == g).nonzero().flatten()
        if rows.numel():
            out[rows] = deq_a[rows] @ dequant_fp8_blocks(b[g], sfb[g]).T
    return out.to(out_dtype)


def m_grouped_masked_reference(a, sfa, b, sfb, masked_m, out_dtype=torch.bfloat16):
    G, max_m, _ = a.shape
    out = torch.zeros(G, max_m, b.shape[1], dtype=torch.float32, device=a.device)
    for g in range(G):
        m = int(masked_m[g])
        if m:
            out[g, :m] = dequant_fp8_token_groups(a[g, :m], sfa[g, :m]) @ dequant_fp8_blocks(b[g], sfb[g]).T
    return out.to(out_dtype)


def m_grouped_sorted_reference(a, sfa, b, sfb, items, out, block_m=SORTED_BLOCK_M):
    """Into `out` (rows, n): for each item (g, row0, nrows) with g >= 0, the rows
    [row0, min(row0 + min(nrows, block_m), rows)) get dequant(a) @ dequant(b[g])^T (fp32 product,
    cast to out's dtype); rows no item lists are left as they were. A loop over the items (host)."""
    deq_a = dequant_fp8_token_groups(a, sfa)
    deq_b = {}
    for g, row0, nrows in items.tolist():
        end = min(row0 + min(nrows, block_m), a.shape[0])
        if g < 0 or row0 < 0 or row0 >= end:
            continue
        if g not in deq_b:
            deq_b[g] = dequant_fp8_blocks(b[g], sfb[g])
        out[row0:end] = (deq_a[row0:end] @ deq_b[g].T).to(out.dtype)
    return out


# ---- validation and launch ----------------------------------------------------------------------

def _check_operands(a, sfa, b, sfb, grouped: bool, masked: bool):
    if _well_formed(a, sfa, b, sfb, grouped, masked):       # the usual call, in a few attribute reads
        return b.shape[-2], a.shape[-1]
    # something is off: the checks below find it and name the argument
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=3 if masked else 2, contiguous=True)
    check.tensor("b", b, dtypes=(torch.float8_e4m3fn,), ndim=3 if grouped else 2, contiguous=True)
    k = a.shape[-1]
    n = b.shape[-2]
    if b.shape[-1] != k:
        raise ValueError(f"a and b must share k (both K-major): a has k={k}, b has shape {tuple(b.shape)}")
    if k % ALIGN_K:
        raise ValueError(f"k must be a multiple of {ALIGN_K}, got {k}")
    if n % ALIGN_N:
        raise ValueError(f"n must be a multiple of {ALIGN_N}, got {n} (b's shape {tuple(b.shape)})")
    check.tensor("sfa", sfa, dtypes=(torch.float32,), contiguous=True)
    check.shape("sfa", sfa, (*a.shape[:-1], math.ceil(k / GROUP)), "per (row, 128 columns) of a")
    check.tensor("sfb", sfb, dtypes=(torch.float32,), contiguous=True)
    check.shape("sfb", sfb, (*b.shape[:-2], math.ceil(n / GROUP), math.ceil(k / GROUP)), "per 128x128 block of b")
    check.same_device(a=a, sfa=sfa, b=b, sfb=sfb)
    return n, k


def _well_formed(a, sfa, b, sfb, grouped, masked) -> bool:
    """Every condition _check_operands checks, as one expression: an eager decode call is host-bound,
    and this takes _check_operands from ~4.8 to ~2.7 us on the CPU machine. False sends the call
    through the named checks, which raise."""
    T_ = torch.Tensor
    if not (type(a) is T_ and type(b) is T_ and type(sfa) is T_ and type(sfb) is T_):
        return False                                 # (subclasses and fakes take the named checks)
    if not (a.dtype is torch.float8_e4m3fn and b.dtype is torch.float8_e4m3fn and sfa.dtype is torch.float32
            and sfb.dtype is torch.float32 and a.dim() == (3 if masked else 2) and b.dim() == (3 if grouped else 2)):
        return False
    sa, sb = a.shape, b.shape
    k, n = sa[-1], sb[-2]
    kb = -(-k // GROUP)
    return (sb[-1] == k and k % ALIGN_K == 0 and n % ALIGN_N == 0 and sfa.shape == (*sa[:-1], kb)
            and sfb.shape == (*sb[:-2], -(-n // GROUP), kb) and a.is_contiguous() and b.is_contiguous()
            and sfa.is_contiguous() and sfb.is_contiguous() and a.device == b.device == sfa.device == sfb.device)


SMEM_BUDGET = 220 * 1024
# the persistent plans' budget: nearer the 227 KB a block may have (less the ~2 KB of static shared
# memory: barriers): 5 stages at k = 7168 with the staged C in memory of its own, as one tile a CTA has
PERSISTENT_SMEM = 224 * 1024


# The K loop: True = v3 (tile.mma_promoted_loop, its scales staged under the first loads), False = v2
# (a wait 0 per step). v3 measured faster on the H200 (bench/NOTES.md "GEMM v5", same runs): 9 of the
# 10 decode shapes (4% in sum, two runs), prefill 815 vs 743 TFLOP/s, grouped contiguous +5%, masked +42%
OVERLAP = True
OVERLAP_STAGES = 6     # v3 releases a stage one step later: up to this many stages where they fit
# CUDA split-K: the last block of a tile adds the partials instead of a reduce kernel. Off: measured
# 1-5 us slower on every split decode shape (bench/NOTES.md "GEMM v4": one block a tile folds it)
FOLD_IN_KERNEL = False
# sm_90a, the v3 loop's split plans (dense, bf16 out): the tile's last split block adds the partials, without
# fences (fp8_gemm_program fold=True with overlap=True; ops._ready: the partials' words say when they have landed),
# instead of the reduce kernel, whose launch and pass a CUDA graph pays after the GEMM (the MXFP4 swapped kernels'
# split plans: 1.5-2 us of reduce kernel and ~3 us more of graph time, bench/NOTES.md "Session 66"), where the GEMM has
# at most READY_FOLD_ROWS rows (0: nowhere). Session 67, H100, CUDA graphs: slower at 64 and 128 rows, whose 64 x 64
# x 4-split and 128 x 128 x 2-split tiles one block reads back (and empties) alone: 64x2112x7168 11.5 -> 13.1 us,
# 128x7168x16384 55.0 -> 56.0; faster at 1-16 rows, whose partials are a few rows (preset decode-few: 1-32 rows x
# 2112 / 1536 / 576 x 7168, two runs): 0-19%, e.g. 8x1536x7168 10.9 -> 9.9 us (1x2112x7168 3% slower in one run, 11%
# faster in the other); even at 32 (bench provider tilecraft-nofold: 0)
READY_FOLD_ROWS = 16
# CUDA split-K: a tile's split blocks form a cluster and fold the partials among themselves
# (fp8_gemm_program cluster=True), where the GPU holds all the grid's clusters at once. Off: measured
# slower on every shape it could take (bench/NOTES.md "GEMM v5": the H200 holds 30 clusters of 4,
# not the 32-33 of the 4-split shapes; the 2-split fold took ~8300 cycles, latency-bound)
CLUSTER_FOLD = False
# CUDA, 2-split plans of more than READY_FOLD_ROWS rows (128x7168x16384: 56 tiles x 2): the pair of a tile's split
# blocks exchanges the partials' halves through distributed shared memory (fp8_gemm_program cluster=True,
# cluster_smem=True: no partials in global memory, no reduce kernel; the received half takes a stage's room: 5 -> 4),
# where the GPU holds every pair at once. Session 16 measured it only on half-width tiles (slower loops). Session 68,
# H100, CUDA graphs, same run (bench provider tilecraft-nodsmem: off): 128x7168x16384 52.7 -> 50.3 us; no other
# decode row is a 2-split plan. False: the reduce kernel
CLUSTER_SMEM_FOLD = True
# CUDA, 4-split plans of 64 x 64 tiles at READY_FOLD_ROWS+1..64 rows whose 64 x 32 tiles in 2 splits make one wave of
# cluster pairs (2112x7168: 66 tiles x 2 = 132 blocks): those pairs instead, on one MMA warpgroup with up to
# THIN_STAGES stages, each folding through distributed shared memory (no partials in global memory, no reduce
# kernel; twice the K blocks a block). Session 69, H100, CUDA graphs, same run (provider tilecraft-pair32 then, off
# now: tilecraft-no-pair-half): 64x2112x7168 11.5 -> 10.4 us. False: the 4-split plan and the reduce kernel
PAIR_HALF_TILES = True
# v3, one split, at least two waves of tiles: clusters of two n-neighbours load each A tile once, by
# TMA multicast (fp8_gemm_program multicast=True). Off: bitwise the same results but measured slower
# on the H200 (bench/NOTES.md "GEMM v6": prefill -6%, grouped contiguous -5%, masked -14%; L2 bytes
# only -10%, and each block of a pair now waits for the slower one)
MULTICAST = False
# both K loops run 256 MMA threads + a TMA warpgroup (v2's added by TileLang); the thin plans run 128
# MMA threads (THIN_THREADS; PAIR_HALF_TILES asks room for THIN_THREADS + 128), the one use of this count
GRID_THREADS = 384
# v3, dense, where the default plan would split K: thin tiles instead (block_m 64, block_n 32 or 64,
# chosen so that the tiles fill one wave of SMs as fully as they can) with up to THIN_STAGES stages, no
# split-K and no reduce kernel: what DeepGEMM's sm_90 heuristic picks for the decode shapes. Measured
# on the H200 (CUDA graphs, write / read flush, bench/NOTES.md "THIN_TILES measured"): 64x4096x7168
# 16.1/15.4 -> 14.1/13.5 us, 128x4096x7168 18.4/19.1 -> 17.3/16.7, 64x7168x16384 42.7/37.1 ->
# 40.7/33.5, 128x2112x7168 12.6/13.6 -> 13.1/13.1 (even). Where the one-wave tiling is 16 wide (64x2112:
# 9.6 -> 12.1) or 128 wide at 128 rows (128x7168x16384: 47.5 -> 49.8) it lost, so split-K stays there
THIN_TILES = True
THIN_WIDTHS = (32, 64)
THIN_STAGES = 16
# the thin plans' MMA threads: one warpgroup takes the whole 64-row tile (128) rather than two taking a
# column half each (256), which both read the tile's A from shared memory: a quarter fewer shared-memory
# bytes a K block at 64 x 64 (32 KB against 40 with the TMA writes). Measured on the H200 against
# DeepGEMM in the same run (bench/NOTES.md "Session 24"), read flush: 64x4096x7168
# 13.3 -> 11.3 us (DeepGEMM 11.8), 128x2112x7168 13.0 -> 11.0 (11.0), 128x4096x7168 15.9 -> 14.3 (13.1),
# 64x7168x16384 even. Not for the other 64-row tiles (64x24576x1536 18.1 -> 19.2, 64x7168x2048 7.9 ->
# 8.3: short K, twice the promotion work a thread), nor with A multicast between n-neighbours (slower
# on every shape, with one warpgroup or two)
THIN_THREADS = 128
# CUDA, the v3 loop, one split, no cluster fold: the epilogue stages the tile of C in shared memory (over
# the operand stages, free by then; a plain padded layout, the rule's OWN_STAGE_LAYOUT) and writes whole
# rows, 16 bytes a thread (fp8_gemm_program stage_c=True),
# instead of 4-byte pieces of 8 rows a warp from the accumulator layout: the trace of 128x24576x1536
# spent 5296 of a 128 x 128 tile's ~22.4K cycles storing C that way (bench/NOTES.md "Session 24")
STAGE_C = True
# sm_90a, staged C (STAGE_C), one split, not the sorted layout, more tiles than SMs but at most
# PERSISTENT_WAVES waves of them: min(tiles, SMs) persistent CTAs run their tiles back to back
# (fp8_gemm_program persistent=True), a tile's first loads going out under the last tile's folds and
# epilogue, its scales copied into shared memory by cp.async (early_scales). Measured on the H200
# against one tile a CTA (bench/NOTES.md "Session 25", profiler): 128x24576x1536 22.5 -> 19.5 us,
# masked 1x1024x4096x7168 67.6 -> 62.5 us (both under 2 waves); over many waves 1-2% slower
# (contiguous 4x8192x4096x7168 1760 -> 1792 us, 62 waves; prefill 875 -> 886, 13.6 waves)
PERSISTENT = True
PERSISTENT_WAVES = 2
# sm_90a, the v3 loop, one split, n % 256 == 0 and more than PERSISTENT_WAVES waves of 128 x 256 tiles
# (prefill, grouped contiguous): 128 x 256 tiles, each K block's MMA in two column passes of 128
# (fp8_gemm_program block_n=256; DeepGEMM's schedule: a pass waited for and folded while the other
# warpgroup's runs, no ping-pong partial). A quarter fewer operand bytes from L2 a flop than 128 x 128
# tiles, whose prefill ran the L2 at ~81% of its throughput (bench/NOTES.md "GEMM v6"). Stages as
# fit in WIDE_SMEM (the staged C goes over the B stages)
WIDE_TILES = True
WIDE_SMEM = 224 * 1024
# ... and where one wave of 128 x 256 tiles replaces two of 128 x 128 at long K: masked 1x1024x4096x7168
# 62.5 -> 51.5 us, 2x512 62.8 -> 52.4 (profiler, H200); at k = 1536 it lost (128x24576x1536 19.1 -> 19.9)
WIDE_ONE_WAVE_K = 4096
# wide tiles as persistent CTAs (PERSISTENT) whatever their waves, a 128 x 256 tile's staged C one
# column pass at a time, over the staged sfa (prefill) or in memory of its own. Off: no faster than one
# tile a CTA (H200 profiler kernel times, bench/NOTES.md "Session 26": prefill 762 vs 764 us; contiguous
# 1534 us on 3 stages vs 1471 for one tile a CTA, whose 4 stages fit)
WIDE_PERSISTENT = False
# sm_90a, the v3 loop, one split: 192-wide tiles (three column passes of 64, fp8_gemm_program block_n=192)
# where they make one wave and 128-wide tiles more than one (widened): DeepGEMM's plan for 128x24576x1536
# (128 tiles instead of 192, which ran persistent CTAs at 0.89x DeepGEMM's time), and 64 x 192 at
# 64x24576x1536. Measured on the H200 (bench/NOTES.md "Session 31", bitwise): kernel times 128x24576x1536
# 19.3 -> 17.75 us, 64x24576x1536 17.0 -> 16.6; CUDA graphs beside DeepGEMM 18.5 -> 16.4 us (DeepGEMM 16.5)
TILES_192 = True
# wide one-tile-a-CTA plans whose sfa staged whole (128 rows x kb fp32) costs a pipeline stage: the
# producer loads sfa in chunks of SFA_RING K blocks into a ring of SFA_RING_SLOTS (fp8_gemm_program
# sfa_ring; 12 KB instead of 64 KB at k = 16384: 4 stages instead of 3). 0: staged whole
SFA_RING = 8
SFA_RING_SLOTS = 3
# (read while the program is traced: part of the kernel and launcher caches' key, codegen.rules.options)
rules.options(__name__, "SFA_RING_SLOTS")
# one tile a block, one split, not sorted, more tiles than SMs: blocks take their tiles in groups of
# RASTER m tiles, down each group's m tiles first (fp8_gemm_program raster), instead of row-major
# order, in which a wave reads every n tile of B. 1 (row-major): at 8, prefill read 656 MB from DRAM
# instead of 905 (DeepGEMM 579) but ran no faster (1102 vs 1092 TFLOP/s, same run) and contiguous
# 1058 vs 1134 (noise-sized), so L2 misses are not what holds the wide tiles back (bench/NOTES.md
# "Session 26")
RASTER = 1


def plan(mode: str, rows: int, n: int, k: int, block_m: int, sms: int = 132, overlap: bool | None = None,
         clusters=None, thin: bool | None = None) -> dict:
    """Tile sizes, pipeline depth and split-K for one call (a pure function of the shapes, so the
    same shapes always take the same path: deterministic and batch-invariant per shape).

    Split-K only where the (m, n) tiles leave most SMs idle (decode; where K is too short to split,
    half-width n tiles instead): every split re-reads nothing
    but writes rows * n fp32 partials that the reduce pass reads back, so it is used when the
    tiles cover less than half the GPU and each split keeps at least 12 K blocks (measured on the
    H200, bench/NOTES.md: 8-block splits lost to no split on 64x7168x2048).

    overlap (default OVERLAP): the v3 K loop (tile.mma_promoted_loop, bench/NOTES.md "GEMM v3"),
    with up to OVERLAP_STAGES stages; the key is returned only when it is on, so v2 plans are the
    same dicts as before. With it, grids of two or more waves whose n tiles pair up take
    "multicast" (MULTICAST): the two n-neighbours of a tile share its A loads in a cluster.

    THIN_TILES (thin, default THIN_TILES): where split-K would be used and the one-wave thin tiling
    (thin_tiles: block_m 64 even for 128 rows) is THIN_WIDTHS wide, those tiles instead, with up to
    THIN_STAGES stages and THIN_THREADS MMA threads ("threads" in the plan when not 256).

    clusters(cluster, threads, smem_bytes): how many clusters of `cluster` such blocks the GPU runs at
    once (backends.cuda.device.max_active_clusters), None where unknown. With CLUSTER_FOLD a split-K
    plan folds its partials inside clusters of its splits ("cluster": True, no reduce kernel) when
    every tile's cluster fits at once: the blocks of a cluster wait for each other, so a grid that
    needed a second wave of clusters would run twice as long.
    """
    overlap = OVERLAP if overlap is None else overlap
    thin = THIN_TILES if thin is None else thin
    block_n = 128 if n % 128 == 0 else 64
    kb = k // GROUP
    tiles = -(-rows // block_m) * (n // block_n)
    splits = split_k_count(tiles, kb, sms) if mode == "dense" else 1
    if mode == "dense" and splits == 1 and block_n == 128 and tiles * 2 <= sms:
        # a grid under half the GPU whose K is too short to split: twice the blocks instead (H200,
        # bench/NOTES.md "FP8 decode tiles": 128x7168x2048 18.0 -> 15.2 us, 64x7168x2048 14.0 -> 13.0)
        block_n = 64
    most, thin_plan = (OVERLAP_STAGES if overlap else 4), False
    if thin and overlap and mode == "dense" and splits > 1:
        one_wave = thin_tiles(rows, n, sms)
        if one_wave is not None and one_wave[1] in THIN_WIDTHS:
            (block_m, block_n), splits, most, thin_plan = one_wave, 1, THIN_STAGES, True
    fixed, stage_bytes = _smem_layout(block_m, block_n, kb, splits)
    stages = max(2, min(most, (SMEM_BUDGET - fixed) // stage_bytes))
    if fixed + stages * stage_bytes > SMEM_BUDGET:
        raise ValueError(f"k={k} is too long for one pass of this kernel's scale staging "
                         f"({fixed} bytes of scales); split the GEMM along k")
    p = dict(block_m=block_m, block_n=block_n, splits=splits, stages=stages)
    if thin_plan and THIN_THREADS != 256:
        p["threads"] = THIN_THREADS
    if overlap:
        p["overlap"] = True
        if MULTICAST and splits == 1 and mode != "sorted" and (n // block_n) % 2 == 0 and tiles >= 2 * sms:
            p["multicast"] = True
    if CLUSTER_FOLD and splits > 1 and clusters is not None and block_n % (8 * splits) == 0:
        room = clusters(splits, GRID_THREADS, fixed + stages * stage_bytes + 4096)   # + barriers, small buffers
        if room is not None and room >= tiles:
            p["cluster"] = True
    if CLUSTER_SMEM_FOLD and splits == 2 and rows > READY_FOLD_ROWS and not p.get("cluster") and clusters is not None:
        q = _fit_exchange({**p, "cluster": True, "cluster_smem": True}, k)
        room = clusters(2, GRID_THREADS, _exchange_smem(q, k))
        if room is not None and room >= tiles:
            p = q
    if (PAIR_HALF_TILES and overlap and mode == "dense" and READY_FOLD_ROWS < rows <= 64 and splits == 4
            and (block_m, block_n) == (64, 64) and not p.get("cluster") and clusters is not None
            and sms // 2 < 2 * (n // 32) <= sms):
        q = _fit_exchange(dict(block_m=64, block_n=32, splits=2, stages=THIN_STAGES, threads=THIN_THREADS,
                               overlap=True, cluster=True, cluster_smem=True), k)
        room = clusters(2, THIN_THREADS + 128, _exchange_smem(q, k))     # (+ the TMA warpgroup)
        if room is not None and room >= n // 32:
            p = q
    return p


def thin_tiles(rows: int, n: int, sms: int) -> tuple[int, int] | None:
    """(block_m, block_n) whose tiles fill one wave of `sms` SMs most fully (at least half of it), with
    block_n dividing 128 (one sfb block a tile) and n; ties go to block_m 64, then the wider block_n.
    None where no such tiling exists (the plan keeps split-K)."""
    best = None
    for bm in (64,) if rows <= 64 else (64, 128):
        for bn in (128, 64, 32, 16):
            tiles = -(-rows // bm) * (n // bn)
            if n % bn == 0 and sms // 2 <= tiles <= sms and (best is None or tiles > best[0]):
                best = (tiles, bm, bn)
    return None if best is None else best[1:]


def _smem_layout(block_m: int, block_n: int, kb: int, splits: int) -> tuple[int, int]:
    """(bytes a block stages once: sfb and its rows' sfa; bytes per pipeline stage: the A and B tiles)."""
    per = -(-kb // splits)
    return kb * 4 + block_m * per * 4, (block_m + block_n) * GROUP


def _fit_exchange(p: dict, k: int) -> dict:
    """A cluster_smem plan also holds the received half partial (block_m x block_n / 2 fp32) in shared
    memory: as many stages as still fit."""
    fixed, stage_bytes = _smem_layout(p["block_m"], p["block_n"], k // GROUP, p["splits"])
    fixed += _exchange_bytes(p["block_m"], p["block_n"])
    return {**p, "stages": max(2, min(p["stages"], (SMEM_BUDGET - fixed) // stage_bytes))}


def _exchange_smem(p: dict, k: int) -> int:
    """A cluster_smem plan's shared memory as cluster room asks for it: the scales, the received half, its stages and
    4 KB for the barriers and small buffers."""
    fixed, stage_bytes = _smem_layout(p["block_m"], p["block_n"], k // GROUP, p["splits"])
    return fixed + _exchange_bytes(p["block_m"], p["block_n"]) + p["stages"] * stage_bytes + 4096


def _exchange_bytes(block_m: int, block_n: int) -> int:
    """A cluster_smem block's recv: the other split's half of the tile's partial (block_m x block_n / 2 fp32)."""
    return block_m * block_n // 2 * 4


def widened(p: dict, mode: str, rows: int, n: int, k: int, groups: int, sms: int, out_bytes: int) -> dict:
    """TILES_192 (the caller checks for sm_90a): a one-split v3 plan of 128-wide tiles (two MMA
    warpgroups) takes 192-wide tiles where those make one wave and the 128-wide ones more (the dense
    layout, n a multiple of 192, bf16 out, no multicast; at least 3 stages in WIDE_SMEM). Otherwise
    WIDE_TILES: 128 x 256 tiles where they make more than PERSISTENT_WAVES waves, or, with K at least
    WIDE_ONE_WAVE_K, one wave at least half full while the 128-wide tiles need more than one; with as
    many stages as fit in WIDE_SMEM (at least 3, else the plan stays). bf16 out only: its staged C
    (67.6 KB) fits over 3 B stages, fp32's would not. A multicast plan (A shared by n-neighbours)
    stays one where the wide n tiles pair up. Where sfa staged whole costs a stage, the producer loads
    it in chunks instead ("sfa_ring": SFA_RING; TMA needs 16-byte rows: k a multiple of 512; _run
    copies an sfa view that does not start 16-byte aligned)."""
    narrow, thirds = (-(-rows // p["block_m"]) * (n // w) * groups for w in (128, 192))
    if (TILES_192 and p.get("overlap") and p["splits"] == 1 and p["block_n"] == 128 and "threads" not in p
            and not p.get("multicast") and n % 192 == 0 and mode == "dense" and out_bytes == 2
            and thirds <= sms < narrow):
        kb = k // GROUP
        stages = min(OVERLAP_STAGES, (WIDE_SMEM - (column_passes(192) + p["block_m"]) * kb * 4)
                     // ((p["block_m"] + 192) * GROUP))
        if stages >= 3:
            return {**p, "block_n": 192, "stages": stages}
    wide = -(-rows // 128) * (n // 256) * groups
    one_wave = sms // 2 < wide <= sms < 2 * wide and k >= WIDE_ONE_WAVE_K
    if not (WIDE_TILES and p.get("overlap") and p["splits"] == 1 and p["block_m"] == 128 and p["block_n"] == 128
            and n % (512 if p.get("multicast") else 256) == 0 and mode != "sorted" and out_bytes == 2
            and (wide > PERSISTENT_WAVES * sms or one_wave)):
        return p
    kb = k // GROUP
    stage_bytes = (p["block_m"] + 256) * GROUP
    fits = lambda sfa_bytes: min(OVERLAP_STAGES, (WIDE_SMEM - column_passes(256) * kb * 4 - sfa_bytes)  # noqa: E731
                                 // stage_bytes)                   # (both sfb rows staged whole)
    stages = fits(p["block_m"] * kb * 4)                           # the rows' sfa staged whole
    if stages < 3:
        return p
    ringed = (fits(SFA_RING_SLOTS * p["block_m"] * SFA_RING * 4)
              if SFA_RING and kb % 4 == 0 and not WIDE_PERSISTENT else 0)
    if ringed > stages and ringed <= SFA_RING + 2:
        return {**p, "block_n": 256, "stages": ringed, "sfa_ring": SFA_RING}
    return {**p, "block_n": 256, "stages": stages}


def _fit_persistent(p: dict, k: int, out_bytes: int) -> dict:
    """A persistent plan also holds its staged tile of C (the A stages are refilled under the epilogue):
    over the staged sfa where the next tile's scales are copied after the epilogue (p["early"] False),
    else memory of its own. As many stages as still fit."""
    kb = k // GROUP
    fixed, stage_bytes = _smem_layout(p["block_m"], p["block_n"], kb, p["splits"])
    fixed += (column_passes(p["block_n"]) - 1) * kb * 4             # column passes: a row of sfb each
    c_bytes = p["block_m"] * (staged_columns(p["block_n"]) + C_PAD) * out_bytes
    fixed += c_bytes if p.get("early", True) else max(0, c_bytes - p["block_m"] * kb * 4)
    return {**p, "stages": max(2, min(p["stages"], (PERSISTENT_SMEM - fixed) // stage_bytes))}


def split_k_count(tiles: int, k_steps: int, sms: int, min_steps: int = 12) -> int:
    """Splits of K (a power of two) for a grid of `tiles` (m, n) tiles: doubled while the blocks
    still cover at most the SMs and every split keeps at least `min_steps` K steps."""
    splits = 1
    while tiles * splits * 2 <= sms and k_steps // (splits * 2) >= min_steps:
        splits *= 2
    return splits


def split_k_launchers(kernel, target, n: int, splits: int, out_dtype: str, fold: bool = False):
    """(the GEMM kernel's launcher, the fixed-order reduce's launcher, or None for splits == 1 or a
    kernel that folds its partials itself: fold=True for fold or cluster plans)."""
    reduce = (fp8_gemm_reduce_program.compile(target, n=n, splits=splits, out_dtype=out_dtype).launcher()
              if splits > 1 and not fold else None)
    return kernel.launcher(), reduce


def launch_split_k(kernel, reduce, args, out, splits: int, count=None, part=None):
    """Run a GEMM launcher that takes (*args, out, its fp32 partials (splits, rows, n)[, count: or
    any last argument(s) the kernel takes, e.g. a trace buffer; a tuple for several]),
    then, for splits > 1 (2-D outputs only) with a reduce launcher, the reduce into `out` (rows, n);
    without one the kernel folds its partials (count: the fold's zeroed per-tile arrival counters,
    unused by a cluster fold). With
    one split the kernel never touches the partials, so a kept (1, 1, n) tensor is bound. part: the partials
    tensor to bind (ops._workspace.ready_partials for the swapped kernels' fenceless fold), else a new one."""
    n = out.shape[-1]
    tail = () if count is None else count if isinstance(count, tuple) else (count,)
    if splits == 1:
        kernel(*args, out, bound_only(out.device, n, torch.float32).view(1, 1, n), *tail)
        return
    if part is None:
        part = torch.empty(splits, out.shape[0], n, dtype=torch.float32, device=out.device)
    kernel(*args, out, part, *tail)
    if reduce is not None:
        reduce(part, out)


def op_plan(mode: str, rows: int, n: int, k: int, block_m: int, groups: int, out_dtype: str, target, device_sms: int,
            clusters=None, overlap: bool | None = None, **override) -> dict:
    """The parameters _launch compiles fp8_gemm_program with for one call (all but n, k, mode and out_dtype): plan()'s
    tiles and split, a caller's overrides, then sm_90a's widening, staged C, persistent tiles, raster and the fold.
    rows: a's rows (masked: rows a group); groups: masked groups, else 1; out_dtype "bfloat16" or "float32"; target a
    codegen target; device_sms the device's SM count (an override's sms sets the persistent grid instead);
    clusters(cluster, threads, smem) -> clusters that fit at once, or None.
    A pure function of its arguments: bench.op's static stats (no GPU) build the op's own plan through it."""
    overlap = OVERLAP if overlap is None else overlap
    out_bytes = 2 if out_dtype == "bfloat16" else 4
    # a caller that sets the tiles or the split gets them on the split-K plan (its block_m and
    # stages), not on the thin one-wave plan
    forced = {"splits", "block_n", "stages"} & override.keys()
    p = plan(mode, rows, n, k, block_m, sms=device_sms, overlap=overlap, clusters=clusters,
             thin=False if forced else None)
    if "cluster" not in override and forced:
        p.pop("cluster", None)          # chosen for the plan's own grid: not carried to another
        p.pop("cluster_smem", None)
    p.update(override)
    if not (p.get("cluster") and p["splits"] == 2) and "cluster_smem" not in override:
        p.pop("cluster_smem", None)     # (the plan's pair exchange, gone with a caller's cluster=False or splits)
    if p.get("cluster_smem"):
        p = _fit_exchange(p, k)
    if not forced and target.name == "cuda:sm_90a":
        p = widened(p, mode, rows, n, k, groups, device_sms, out_bytes)
    p.setdefault("stage_c", STAGE_C and target.vendor == "cuda" and bool(p.get("overlap")) and p["splits"] == 1
                 and not p.get("cluster"))
    # one to two waves of tiles (sm_90a, staged C): persistent CTAs, each running its tiles back to back
    tiles = -(-rows // p["block_m"]) * (n // p["block_n"]) * groups
    waves = device_sms < tiles <= PERSISTENT_WAVES * device_sms or (p["block_n"] > GROUP and WIDE_PERSISTENT)
    p.setdefault("persistent", PERSISTENT and target.name == "cuda:sm_90a" and p["stage_c"] and waves
                 and not p.get("multicast") and mode != "sorted")
    if p["persistent"]:
        p.pop("sfa_ring", None)         # (one tile a CTA only; _fit_persistent sets the stages)
        p.setdefault("sms", device_sms)
        p.setdefault("early", early_scales(p["block_m"], p["block_n"], k // GROUP, out_bytes))
        p = _fit_persistent(p, k, out_bytes)
    if (RASTER > 1 and not p["persistent"] and p["splits"] == 1 and mode != "sorted" and tiles > device_sms
            and -(-rows // p["block_m"]) * groups > RASTER):
        p.setdefault("raster", RASTER)
    split = p["splits"] > 1 and not p.get("cluster")
    if p.get("overlap"):        # the v3 loop: the fenceless fold (READY_FOLD_ROWS)
        p.setdefault("fold", rows <= READY_FOLD_ROWS and split and target.name == "cuda:sm_90a"
                     and out_dtype == "bfloat16")
    else:
        p.setdefault("fold", FOLD_IN_KERNEL and split and target.vendor == "cuda")
    return p


def _launch(mode, a2, sfa2, b3, sfb3, m_idx, masked_m, out2, n, k, block_m=128, overlap=None, **override):
    target = targets.resolve(a2)
    rows = a2.shape[0] if mode != "masked" else a2.shape[1]
    if rows == 0:               # nothing to compute (and TMA descriptors cannot describe an empty tensor)
        return
    overlap = OVERLAP if overlap is None else overlap
    # the plan, both compile lookups and the SM count once per shape: an eager call's host time is
    # what a decode-sized GEMM waits on (bench/NOTES.md "eager host cost")
    def build():
        room = (lambda c, t, smem: max_active_clusters(a2, c, t, smem)) if target.vendor == "cuda" else None
        out_dtype = OUT_DTYPES[out2.dtype]
        p = op_plan(mode, rows, n, k, block_m, a2.shape[0] if mode == "masked" else 1, out_dtype, target,
                    sm_count(a2), room, overlap, **override)
        kernel = fp8_gemm_program.compile(target, n=n, k=k, mode=mode, out_dtype=out_dtype, **p)
        counters = -(-rows // p["block_m"]) * (n // p["block_n"]) if p["fold"] else 0
        folded = p["fold"] or p.get("cluster", False)
        ready = p["fold"] and bool(p.get("overlap"))
        return (p["splits"], counters, ready, *split_k_launchers(kernel, target, n, p["splits"], out_dtype, folded))

    key = ("fp8_gemm", mode, target.name, a2.device.index, rows, n, k, block_m, overlap, THIN_TILES, THIN_THREADS,
           STAGE_C, PERSISTENT, PERSISTENT_WAVES, WIDE_TILES, TILES_192, WIDE_PERSISTENT, RASTER, MULTICAST,
           CLUSTER_FOLD, CLUSTER_SMEM_FOLD, PAIR_HALF_TILES, FOLD_IN_KERNEL, READY_FOLD_ROWS, SFA_RING,
           tuple(sorted(override.items())) if override else (), out2.dtype)
    splits, counters, ready, kernel, reduce = jit.launchers(key, build)
    count = arrival_counters(a2.device, counters) if counters else bound_only(a2.device)
    launch_split_k(kernel, reduce, (a2, sfa2, b3, sfb3, m_idx, masked_m), out2, splits, count,
                   part=ready_partials(a2.device, splits, rows, n) if ready else None)


def _check_out(out, shape, device):
    check.tensor("out", out, dtypes=OUT_DTYPES, ndim=len(shape), contiguous=True)
    check.shape("out", out, shape)
    if out.device != device:
        raise ValueError(f"out must be on {device} like a, got {out.device}")
    return out


def _run(mode, a, sfa, b, sfb, aux, out, block_m):
    """Compute into `out`: the exact-dequant reference on CPU tensors, the tile program elsewhere."""
    n, k = b.shape[-2], b.shape[-1]
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        if mode == "sorted":
            return m_grouped_sorted_reference(a, sfa, b, sfb, aux, out, block_m)
        if mode == "dense":
            ref = fp8_gemm_nt_reference(a, sfa, b[0], sfb[0], torch.float32)
        elif mode == "contiguous":
            ref = m_grouped_contiguous_reference(a, sfa, b, sfb, aux, torch.float32)
        else:
            ref = m_grouped_masked_reference(a, sfa, b, sfb, aux, torch.float32)
        return out.copy_(ref)
    if a.shape[0] == 0 or (mode == "sorted" and aux.shape[0] == 0):
        return out
    # MIdx is (rows,) in the kernel (sorted: the (items, 3) work list): dense binds rows to a's rows,
    # masked leaves it free
    m_idx = aux if mode in ("contiguous", "sorted") else bound_only(a.device, a.shape[0] if mode == "dense" else 1)
    masked_m = aux if mode == "masked" else bound_only(a.device, b.shape[0])
    if (a.data_ptr() | sfa.data_ptr() | b.data_ptr() | sfb.data_ptr() | out.data_ptr()) % 16:
        sfa, sfb = _aligned_scales(a, sfa, b, sfb, out)
    _launch(mode, a, sfa, b, sfb, m_idx, masked_m, out, n, k, block_m=block_m)
    return out


def _aligned_scales(a, sfa, b, sfb, out):
    """The kernels load a and b by TMA and store out 16 bytes a thread: a view of one that does not
    start 16-byte aligned is an error. The scales are staged by 16-byte copies (and TMA): a view of
    them that does not start aligned is copied (the copy is; they are k/128 of the operands' size)."""
    for name, t in (("a", a), ("b", b), ("out", out)):
        check.aligned(name, t, 16, "loaded by TMA" if name != "out" else "stored 16 bytes a thread")
    return check.aligned_copy(sfa), check.aligned_copy(sfb)


def _fp8_gemm_impl(mode, a, sfa, b, sfb, aux, out_dtype, block_m):
    out = torch.empty(*a.shape[:-1], b.shape[-2], dtype=out_dtype, device=a.device)
    return _run(mode, a, sfa, b, sfb, aux, out, block_m)


@torch.library.custom_op("tilecraft::fp8_gemm", mutates_args=())
def _fp8_gemm_op(mode: str, a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                 aux: torch.Tensor | None, out_dtype: torch.dtype, block_m: int) -> torch.Tensor:
    return _fp8_gemm_impl(mode, a, sfa, b, sfb, aux, out_dtype, block_m)


@_fp8_gemm_op.register_fake
def _(mode, a, sfa, b, sfb, aux, out_dtype, block_m):
    return a.new_empty(*a.shape[:-1], b.shape[-2], dtype=out_dtype)


def _call(mode, a, sfa, b, sfb, aux, out, out_dtype, block_m):
    """Into the caller's `out` (eager), or a new tensor through the custom op (traceable). out_dtype None: out's
    dtype, or bf16."""
    if out is not None:
        if out_dtype is not None and isinstance(out, torch.Tensor) and out.dtype != out_dtype:
            raise ValueError(f"out_dtype={out_dtype} disagrees with out's dtype {out.dtype}: give one of them")
        return _run(mode, a, sfa, b, sfb, aux, _check_out(out, (*a.shape[:-1], b.shape[-2]), a.device), block_m)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    return _dispatch.call(_fp8_gemm_op, _fp8_gemm_impl, mode, a, sfa, b, sfb, aux, out_dtype, block_m)


def fp8_gemm_nt(a, sfa, b, sfb, out=None, out_dtype=None):
    """C (m, n) = dequant(a) @ dequant(b)^T. a (m, k) e4m3, sfa (m, ceil(k/128)) fp32 (UE8M0 powers
    of two welcome); b (n, k) e4m3, sfb (ceil(n/128), ceil(k/128)) fp32. k % 128 == 0, n % 64 == 0,
    any m >= 0. `out` (m, n) bf16/fp32 is written in place when given; out_dtype (bf16 or fp32; default
    out's dtype, or bf16) must agree with it."""
    _check_operands(a, sfa, b, sfb, grouped=False, masked=False)
    m = a.shape[0]
    return _call("dense", a, sfa, b.unsqueeze(0), sfb.unsqueeze(0), None, out, out_dtype, 64 if m <= 64 else 128)


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, m_indices, out=None, out_dtype=None):
    """Expert-grouped rows: a (M, k) in 128-aligned segments per expert, m_indices (M,) int32 giving
    each row's expert (-1: padding rows, whose output is zeros); b (g, n, k), sfb (g, n/128, k/128)."""
    _check_operands(a, sfa, b, sfb, grouped=True, masked=False)
    check.tensor("m_indices", m_indices, dtypes=(torch.int32,), ndim=1, contiguous=True)
    check.shape("m_indices", m_indices, (a.shape[0],), "(M,) one per row of a")
    check.same_device(a=a, m_indices=m_indices)
    M = a.shape[0]
    if M % GROUP:
        raise ValueError(f"a's row count must be a multiple of {GROUP} (the segment alignment), got {M}")
    check.some_groups("b", b.shape[0], M)
    if _values.enabled(m_indices) and M and bool(((m_indices < -1) | (m_indices >= b.shape[0])).any()):
        raise ValueError(f"m_indices must be in [-1, {b.shape[0]})"
                         + check.offending(m_indices, (m_indices < -1) | (m_indices >= b.shape[0])))
    return _call("contiguous", a, sfa, b, sfb, m_indices, out, out_dtype, 128)


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, masked_m, expected_m=None, out=None, out_dtype=None):
    """Decode-time grouped GEMM: a (g, max_m, k), sfa (g, max_m, k/128); only the first masked_m[i]
    rows of group i are computed (the rest are zeros). expected_m is a tiling hint: <= 64 picks
    64-row tiles."""
    _check_operands(a, sfa, b, sfb, grouped=True, masked=True)
    G, max_m, _ = a.shape
    if b.shape[0] != G:
        raise ValueError(f"b must have one matrix per group of a ({G}), got shape {tuple(b.shape)}")
    check.tensor("masked_m", masked_m, dtypes=(torch.int32,), ndim=1, contiguous=True)
    check.shape("masked_m", masked_m, (G,), "(groups,)")
    check.same_device(a=a, masked_m=masked_m)
    if expected_m is not None:
        check.number("expected_m", expected_m, lo=0, integer=True)
    if _values.enabled(masked_m) and bool(((masked_m < 0) | (masked_m > max_m)).any()):
        raise ValueError(f"masked_m must be in [0, {max_m}]"
                         + check.offending(masked_m, (masked_m < 0) | (masked_m > max_m)))
    block_m = 64 if (expected_m or max_m) <= 64 else 128
    return _call("masked", a, sfa, b, sfb, masked_m, out, out_dtype, block_m)


def m_grouped_fp8_gemm_nt_sorted(a, sfa, b, sfb, items, out=None, out_dtype=None):
    """MoE decode's grouped GEMM over compact rows: a (rows, k) e4m3 sorted by expert with no padding
    (moe_dispatch(layout="contiguous", align=1)), sfa (rows, k/128); b (g, n, k), sfb (g, n/128, k/128);
    items (max_items, 3) int32 work items (expert, first row, row count) from
    ops.moe_tile_items(..., block_m=64): each item's rows [row0, row0 + count) (count <= 64) get
    dequant(a) @ dequant(b[expert])^T; items with expert -1 or no rows do nothing. Returns (rows, n).

    Rows no item lists are not written: they keep what `out` held, or are uninitialized memory when
    out is None. One GPU block per (item, n tile): the grid is fixed by max_items, not by the
    routing, so the call can be captured in a CUDA graph. Value checks on items (experts in range,
    rows inside a, counts <= 64) run when value checks are on and not capturing.
    """
    _check_operands(a, sfa, b, sfb, grouped=True, masked=False)
    check.tensor("items", items, dtypes=(torch.int32,), ndim=2, contiguous=True)
    if items.shape[1] != 3:
        raise ValueError(f"items must have shape (max_items, 3) (expert, first row, row count), got {tuple(items.shape)}")
    check.same_device(a=a, items=items)
    rows, G = a.shape[0], b.shape[0]
    if _values.enabled(items) and items.numel():
        g, row0, nrows = items.long().unbind(1)
        live = (g >= 0) & (nrows != 0)
        bad = live & ((g >= G) | (row0 < 0) | (nrows < 0) | (nrows > SORTED_BLOCK_M) | (row0 + nrows > rows))
        if bool(bad.any()):
            i = int(bad.long().argmax())
            raise ValueError(f"items[{i}] = {items[i].tolist()} is not a work item of this call: need expert in "
                             f"[0, {G}), 0 <= first row, 0 <= count <= {SORTED_BLOCK_M}, first row + count <= {rows}")
    return _call("sorted", a, sfa, b, sfb, items, out, out_dtype, SORTED_BLOCK_M)
