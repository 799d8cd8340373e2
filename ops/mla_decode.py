"""Multi-head latent attention decode over a paged latent KV cache (FlashMLA's interface).

Each query row (s_q * h_q rows per sequence, packed as row = s * h_q + h) attends over its
sequence's cache of 576-wide latent vectors (512 latent + 64 rope); V is the first 512 columns
of the same cache rows. One CTA owns 64 query rows of one sequence and one split of its KV
blocks; splits are combined by a second kernel. Written once with codegen.tile words: the KV
loop is tile.attention_loop (on sm_90a a hand-written producer warpgroup and two MMA warpgroups,
codegen/lowering/sm90_attention.py; on Ascend the Cube and the two vector cores of an AI core,
codegen/lowering/ascend_attention.py; elsewhere the compiler's pipelined loop).

Cost per sequence (bf16): bytes ~ seqlen * 576 * 2 (the cache, read once per 64-row tile),
flops = 2 * s_q * h_q * seqlen * (576 + 512).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import operator
from dataclasses import dataclass, field

import tilelang.language as T
import torch

from codegen import targets, tile
from codegen.program import ALL_TARGETS, tile_program
from ops import _dispatch, _values
from ops import _validate as check
from ops._workspace import arrival_counters
from tilecraft import env

D_QK, D_V, D_ROPE = 576, 512, 64
BLOCK_M = 64       # query rows per CTA: WGMMA's M
# query-tile rows (WGMMA's N) with swapped operands: the first >= s_q * h_q. 64 rows would not fit in
# shared memory (Q^T 72 KB + 2 x 72 KB steps + the S^T transpose) and gain nothing over the default
# tiling. The FP8 cache's raw staging leaves room for 16 rows with the bf16 rope staged, and for 32 with
# the rope loaded straight into its operand tile (rope_direct; the lowering keeps the row statistics in
# spare words of the S^T tile, bench/NOTES.md "Session 34"); the fold (fp16 operands) fits 16 rows.
SWAPPED_TILES = {"bf16": (16, 32), "fp8": (16,), "fp8-rope-direct": (16, 32), "fp8-fold": (16,)}
SWAPPED_RAW_ROWS = 32  # swapped FP8: tokens per raw staging chunk (two a 64-token step)
BLOCK_N = 64       # cache tokens per step (the schedule's unit; the kernel may step in halves)
MAX_HEADS = 128
MAX_S_Q = 8
PAGE_SIZES = (16, 32, 64, 128, 256)
# FP8 cache, FlashMLA's 656-byte token: 512 e4m3 latent | 4 fp32 scales (one per 128) | 64 bf16 rope
FP8_TOKEN_BYTES = 656
FP8_SCALE_WORD = D_V // 4                # the scales as 32-bit words of the token
FP8_ROPE_HALF = (D_V + 16) // 2          # the rope as 16-bit words of the token
FP8_MAX = 448.0
FP8_BLOCK = 128                          # latent values per FP8 scale
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_FORMATS = ("bf16", "fp8")
# the FP8 cache at <= 16 query rows on sm_90a: ops.mla_decode_fp8_rs's two-chain kernel (the e4m3 latent straight
# into WGMMA's register operand, two MMA warpgroups on alternate steps, one CTA an SM; bench/NOTES.md "Session 38")
REGISTER_FP8_ROWS = 16
REGISTER_FP8 = dict(register_fp8=True, kv_format="fp8", chains=2)
# the FP8 cache above 16 query rows on sm_90a: ops.mla_decode_fp8_rows64 (rows as WGMMA's N, 32 or 64 a CTA, the
# e4m3 latent into the register operand, two MMA warpgroups in a seesaw; bench/NOTES.md "Session 51") for s_q * h_q
# up to ROWS64_FP8 (0: never). Measured (NOTES "Session 52", "Session 56", H200): at 17-32 rows (its 32-row tile)
# 1.02-1.16x the swapped kernel it replaced on the six fp8-32 rows, 0.87-1.12x the bf16 cache (below it only at
# b = 8 and 1); at 64 rows a tile 0.9x and less, so those stay on the 32-token-step kernel (bench providers
# tilecraft-fp8-rows64, -vs time them)
ROWS64_FP8 = 32
# the wide combine (mla_combine_program(lanes=combine_lanes_for(max_splits)): a block a row and column chunk, its
# threads across the splits too) for a schedule of more than COMBINE_AHEAD splits a sequence; the three-pass one at
# fewer and in batch-invariant mode. Measured (bench/NOTES.md "Session 57", H100): the combine of 32 splits 5.1-5.8 us
# -> 3.1-4.4 us, of 64-132 splits 8-17 us -> 3.3-7 us; at 2 splits a sequence (the decode grid) it was slower
COMBINE_WIDE = True
# the swapped kernel with the scales folded into the MMAs: the op's choice there before (a bench provider)
FP8_FOLD = dict(block_n=BLOCK_N, stages=2, raw_stages=2, kv_format="fp8", swapped=True, rope_direct=True,
                fold_scales=True)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
GPU_TARGETS = ("cuda:sm_90a", "cuda:sm_100a", "ascend:950")


def _page_copies(BlockTable, bi, blk, page, block_n, num_pages, parts, pidx=None):
    """The copies that stage cache tokens [blk*block_n, (blk+1)*block_n) of sequence bi:
    [(src, part, row0, rows)] for every (tensor, first column, width, part) in `parts`; pidx (pages
    of block_n tokens or more): the page's index read beforehand (_load_page), else read here."""
    out = []
    if page >= block_n:
        if pidx is None:
            pidx = _page_index(BlockTable, bi, blk, page, block_n, num_pages)
        off = (blk * block_n) % page
        for src, c0, width, part in parts:
            out.append((src[pidx, off:off + block_n, c0:c0 + width], part, 0, block_n))
    else:
        for sub in range(block_n // page):
            pidx = T.min(T.max(BlockTable[bi, blk * (block_n // page) + sub], 0), num_pages - 1)
            for src, c0, width, part in parts:
                out.append((src[pidx, 0:page, c0:c0 + width], part, sub * page, page))
    return out


def _page_index(BlockTable, bi, blk, page, block_n, num_pages):
    # the cache page holding tokens [blk * block_n, (blk + 1) * block_n) of sequence bi (page >= block_n)
    return T.min(T.max(BlockTable[bi, (blk * block_n) // page], 0), num_pages - 1)


@T.macro
def _load_page(BlockTable, bi, blk, page, num_pages, pidx):
    # the step's page index into a register before the producer waits for the step's slots: a global
    # load after those waits (compiler barriers) was issued after them, once per kv part, between a
    # slot's release and its reload (~300 cycles of the ~900 there under load, bench/NOTES.md "Session 24")
    pidx = _page_index(BlockTable, bi, blk, page, BLOCK_N, num_pages)


def _query_tiles(q_at, row_of, block_m, rows, parts):
    """The query tile, one operand tile per (first column, width, dtype) part: row i holds query row
    row_of(i) (q_at(row, column) reads it), zero past the sequence's rows. Written by tile.fill_operands
    QV values wide (8- and 16-byte loads where there were 2-byte ones: a CTA's 72 KB at h_q = 128 took
    ~36K cycles in 43 dependent rounds, "MLA v12"), two neighbouring parts of one shape in one loop
    (twice the loads in flight a thread). q_at and row_of are closures so that the loops use the
    kernel's own scalars: macro arguments become copies, which cost the two-converter FP8 kernel 6
    spilled registers."""
    tiles = [tile.operand((block_m, w), dt) for _, w, dt in parts]
    n = 0
    while n < len(parts):
        pair = n + 1 < len(parts) and parts[n][1:] == parts[n + 1][1:]
        tile.fill_operands(tiles[n:n + 1 + pair], row_of,
                           [_query_value(q_at, rows, parts[n + u][0], parts[n][2]) for u in range(1 + pair)],
                           vector=QV)
        n += 1 + pair
    return tiles


def _query_value(q_at, rows, c, dt):
    # (r, j) -> the query's row r, column c + j (as dt), 0 past the last row
    return lambda r, j: T.if_then_else(r < rows, _as(q_at(T.min(r, rows - 1), c + j), dt), T.cast(0, dt))


def _as(x, dt):
    return x if x.dtype == dt else T.cast(x, dt)


# stage_out: a warpgroup's output tile (BLOCK_M x w, fp32, normalized) goes to Dst[d, r0 + i, c0 + j] through
# `staging`, its own latent query tile (BLOCK_M x w, the storage dtype; nothing reads the query any more): the
# accumulator's layout stores 4 (bf16) or 8 (fp32) bytes of 8 rows a warp instruction, from shared memory a warp
# writes 512 bytes of one row an instruction (bench/NOTES.md "Session 78"). fp32 goes in two passes of w / 2
# columns through a float32 view (the tile's swizzle kept: its float2 stores are two wavefronts a warp). rows: write
# rows r0 + i < rows only (None: all). The threads are warpgroup `group`'s (tile.barrier(group=)). tma: whole tiles
# leave by TMA stores (out_tma; not for partials that the same kernel merges: the issuing thread waits only until
# the stores have read shared memory, not until other CTAs can see them).
@T.macro
def _stage_store(o, staging, group, Dst, d, r0, c0, rows, tma):
    if Dst.dtype == "float32":
        cols = o.shape[1] // 2
        wide = T.view(staging, (BLOCK_M, cols), "float32")
        for h in T.unroll(2):
            for i, j in tile.parallel(BLOCK_M, cols):
                wide[i, j] = o[i, h * cols + j]
            _staged(wide, group, Dst, d, r0, c0 + h * cols, rows, tma)
            tile.barrier(threads=WG_THREADS, group=group)     # (the next pass writes over it)
    else:
        for i, j in tile.parallel(BLOCK_M, o.shape[1]):
            staging[i, j] = T.cast(o[i, j], Dst.dtype)
        _staged(staging, group, Dst, d, r0, c0, rows, tma)


# the staged tile out, once the warpgroup's writes are done: by its threads 16 bytes each, or (tma, whole tiles) as
# TMA stores of the tile's 128-byte-swizzled boxes, issued by one thread, which waits until they have read it (T.copy
# shared -> global on sm_90a: tma_store + wait_group.read); every writer fences its generic-proxy stores first
@T.macro
def _staged(src, group, Dst, d, r0, c0, rows, tma):
    if tma and rows is None:
        T.fence_proxy_async()
        tile.barrier(threads=WG_THREADS, group=group)
        tile.copy(src, Dst[d, r0:r0 + BLOCK_M, c0:c0 + src.shape[1]])
    else:
        tile.barrier(threads=WG_THREADS, group=group)
        _copy_rows(src, Dst, d, r0, c0, rows)


@T.macro
def _copy_rows(src, Dst, d, r0, c0, rows):
    if rows is None:
        for i, j in tile.parallel(BLOCK_M, src.shape[1]):
            Dst[d, r0 + i, c0 + j] = src[i, j]
    else:
        for i, j in tile.parallel(BLOCK_M, src.shape[1]):
            if r0 + i < rows:
                Dst[d, r0 + i, c0 + j] = src[i, j]


QV = 8  # query values a thread loads at once (16 bytes of bf16; TileLang may split it in two 8-byte loads)


@tile_program(
    "mla_decode",
    targets=GPU_TARGETS,
    examples={
        "h16": dict(h_q=16, s_q=1, page=64),
        "h128": dict(h_q=128, s_q=1, page=64),
        "h128-mtp": dict(h_q=128, s_q=2, page=64),
    },
    pass_configs=lambda t, p: ({"tl.enable_fast_math": True, "tl.disable_buffer_init_check": True,
                                **({} if p["warp_specialized"] else {"tl.disable_warp_specialized": True})}
                               if t.vendor == "cuda" else {"tl.disable_buffer_init_check": True}),
)
def mla_decode_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                       block_n: int = 64, stages: int = 2, threads: int = 256, warp_specialized: bool = True,
                       kv_format: str = "bf16", raw_stages: int = 2, trace: bool = False, swapped: bool = False,
                       raw_rows: int | None = None, stage_raw: bool = False, rope_direct: bool = False,
                       fold_scales: bool = False, seesaw: bool = False, persistent: bool = False,
                       own_p: bool = False, lazy: float = 0.0, merge: bool = True, early_q: bool = False,
                       stage_out: bool = False, kv_first: bool = False, out_tma: bool = False):
    """Split-KV MLA decode: partial (O, lse) per split, or the final output when unsplit.

    Each CTA walks its split of 64-token schedule blocks in steps of `block_n` tokens with
    tile.attention_loop (`stages` staged steps; with the FP8 cache, `raw_stages` steps of raw
    bytes ahead of the converted ones where the target converts in a producer warpgroup).
    The cache is split in three operand parts (latent columns 0-255, 256-511, rope), so that a
    target may give each half of the output to its own warpgroup.

    trace=True (debugging, sm_90a): CTA 0 writes SM clock stamps of its first 64 steps into
    OPart[0, step, event] (as int32 bits; events in lowering/sm90_attention.py); run unsplit.

    swapped=True (sm_90a, s_q * h_q <= 32 with the bf16 cache, <= 16 with FP8; bench/NOTES.md
    "MLA v9"): the query tile has 16 or 32 rows and attention_loop swaps the operands (the tokens
    are WGMMA's M), so the heads are not padded to 64. The FP8 cache's raw bytes arrive in chunks of
    `raw_rows` tokens (default 32), half converted by the producer, half by WG1. pick_tiling chooses
    it for pages of 64+ tokens. Two FP8 options the op does not take yet (not run on a GPU so far):
    stage_raw (a converter reads its raw chunk into registers and reloads the staging before it
    converts, so the next chunk's load overlaps the conversion) and rope_direct (the bf16 rope goes
    by TMA straight into the operand tile: no raw copy, no conversion, 8 KB less shared memory).

    fold_scales=True (swapped FP8; bench/NOTES.md "MLA v11"): the e4m3 latent is converted exactly to
    fp16 (one instruction per two values, no multiply) and each 128-column block's per-token scale is
    applied where it costs little: to that block's partial scores (four K = 128 MMAs, summed with
    the scales as the FP8 GEMM promotes) and to a copy of P per 128 output columns. The latent
    query is rounded to fp16 for those MMAs: |q| and the cache scales must stay below 65504.

    seesaw=True (sm_90a, the bf16 cache, not swapped; bench/NOTES.md "MLA v13"): the two MMA
    warpgroups score alternate steps and pass the running row max to each other, so one's softmax
    runs under the other's MMAs (FlashMLA's schedule); P goes over the step's rope tile.

    persistent=True (with seesaw, the bf16 cache, s_q * h_q a multiple of 64; bench/NOTES.md "MLA
    persistent seesaw"): one wave of CTAs, m_tiles per part; each runs its part's pieces (runs of a
    sequence's 64-token blocks, a table made by MlaSchedule.persistent_pieces) back to back, the query by
    TMA, so that the next piece's query and first steps load while the last one's output is written. With
    the schedule's splits as pieces, each computes exactly what the CTA of that (sequence, split) computes
    without persistent.

    own_p=True (with seesaw): each warpgroup's P V of its own step reads P from its registers (wgmma
    RS), as FlashMLA does; the copy of P in shared memory is the other warpgroup's only, and its
    step's P V still reads it there. The same products in the same order.

    lazy=t (the bf16 cache, not swapped; any schedule): the online softmax keeps a row's running max until the
    row's max grows by more than t (log2 units; 8.0: P up to 256), so most steps' alpha is exactly 1 and the O
    rescale skips those rows (FlashAttention-4's conditional rescaling). Not the bits of lazy=0: the same
    products scaled by another power of the exponent, within the reference's bounds (bench/NOTES.md "Session 70").

    merge=True (persistent): the pieces of a split or cut sequence count their arrivals and the last merges them
    in the kernel (MlaSchedule.persistent_pieces(cut=True); no combine kernel); merge=False: each piece leaves its
    partial for the combine kernel (the schedule's splits dealt whole: the op's default, bench/NOTES.md "Session 76":
    on an H100 the cut deal's merges and extra pieces cost more than its balance gains).

    early_q=True (persistent): the next piece's query loads as soon as both MMA warpgroups have done the piece's
    last scores (tile.Units.early_query), not after its last P V. The same products in the same order.

    stage_out=True (CUDA's two MMA warpgroups, not swapped, not with early_q): the output (or a split's fp32
    partial) goes through shared memory, each warpgroup's half written into its own latent query tile (read by
    nobody once the epilogue runs) and copied out 16 bytes a thread, a warp a 512-byte row an instruction, where the
    accumulator's layout stores 4 (8) bytes of 8 rows a warp instruction (_stage_store); persistent, the next
    piece's query loads after it (tile.Units.query_staging). Without seesaw the fp32 partials are stored as before
    (its 168 registers a thread spilled 304 bytes with their two passes). The same bits.

    kv_first=True (persistent with stage_out): the next piece's first steps load before its query, under the
    epilogue (tile.Units.steps_first), the query once the epilogue has read its staging. The same bits.

    out_tma=True (with stage_out): a whole staged tile leaves by TMA stores (tile.copy shared -> global: its
    128-byte-swizzled boxes, one thread issuing them and waiting until they have read the tile) instead of 16 bytes
    a thread; tiles with padding rows (rows not a multiple of 64) keep the threads' stores. The same bits."""
    assert BLOCK_N % block_n == 0 and block_n % 16 == 0
    if persistent and not (seesaw and kv_format == "bf16" and not swapped and (s_q * h_q) % BLOCK_M == 0
                           and block_n == BLOCK_N and page >= BLOCK_N):
        # (pages under 64 tokens: TileLang 0.1.15 cannot TMA a page into part of the swizzled step tile)
        raise ValueError("persistent=True is built for seesaw=True with the bf16 cache, swapped=False, 64-token steps, "
                         f"pages of 64+ tokens and s_q * h_q a multiple of {BLOCK_M}; got seesaw={seesaw}, "
                         f"kv_format={kv_format!r}, swapped={swapped}, block_n={block_n}, page={page}, "
                         f"s_q * h_q={s_q * h_q}")
    if early_q and not persistent:
        raise ValueError("early_q=True (the next piece's query loaded under the last P V) is built for persistent=True")
    if stage_out and (early_q or swapped or threads != 256 or not warp_specialized
                      or targets.current().vendor != "cuda"):
        raise ValueError("stage_out=True (the output staged in the query tiles) is built for CUDA's two MMA "
                         "warpgroups (threads=256, warp_specialized), swapped=False and without early_q (which loads "
                         f"the next query into them during the epilogue); got target {targets.current().name}, "
                         f"threads={threads}, warp_specialized={warp_specialized}, swapped={swapped}, "
                         f"early_q={early_q}")
    if out_tma and not stage_out:
        raise ValueError("out_tma=True (the staged output out by TMA stores) is built for stage_out=True")
    if kv_first and not (persistent and stage_out):
        raise ValueError("kv_first=True (the next piece's first steps before its query) is built for persistent=True "
                         f"with stage_out=True, got persistent={persistent}, stage_out={stage_out}")
    if own_p and not seesaw:
        raise ValueError("own_p=True (each warpgroup's own P V from registers) is built for seesaw=True")
    if lazy and not (kv_format == "bf16" and not swapped and lazy > 0):
        raise ValueError(f"lazy={lazy} (the running max kept until a row's max grows by more than lazy) is built for "
                         f"the bf16 cache, swapped=False and lazy > 0; got kv_format={kv_format!r}, swapped={swapped}")
    if fold_scales and not (swapped and kv_format == "fp8" and not stage_raw):
        raise ValueError("fold_scales=True (the FP8 scales folded into the MMAs) is built for swapped=True with "
                         "kv_format='fp8' and stage_raw=False")
    if rope_direct and not (swapped and kv_format == "fp8"):
        raise ValueError("rope_direct=True (the FP8 cache's bf16 rope loaded straight into the operand tile) is built "
                         "for swapped=True with kv_format='fp8'")
    tiles = SWAPPED_TILES["fp8-fold" if fold_scales else "fp8-rope-direct" if rope_direct else kv_format]
    if swapped and s_q * h_q > tiles[-1]:
        raise ValueError(f"swapped=True with the {kv_format} cache takes at most {tiles[-1]} query rows "
                         f"(s_q * h_q), got {s_q * h_q}")
    # the query tile's rows (the output keeps BLOCK_M padding)
    block_m = next(n for n in tiles if n >= s_q * h_q) if swapped else BLOCK_M
    causal = causal and s_q > 1  # with one query token per sequence the causal limit is the length
    fp8 = kv_format == "fp8"
    rows = s_q * h_q
    m_tiles = (rows + BLOCK_M - 1) // BLOCK_M
    rows_pad = m_tiles * BLOCK_M
    whole_rows = None if rows % BLOCK_M == 0 else rows      # stage_out: a tile's padding rows stay unwritten
    sdt = tile.storage_dtype(dtype)
    # the cache three ways (the same bytes): as stored, as 32-bit floats (FP8 scales), as 16-bit (FP8 rope)
    kv_dt, width = ("float8_e4m3fn", FP8_TOKEN_BYTES) if fp8 else (sdt, D_QK)
    batch, num_pages, max_blocks, slots = T.dynamic("batch, num_pages, max_blocks, slots")
    neg_inf = -T.infinity("float32")
    half = D_V // 2
    kv_parts = [(block_n, half, sdt), (block_n, half, sdt), (block_n, D_ROPE, sdt)]
    # (first column, width, dtype) of each query part; the cache parts match them column for column
    q_parts = [(0, half, sdt), (half, half, sdt), (D_V, D_ROPE, sdt)]
    if fold_scales:   # one fp16 part per scale block, then the rope
        q_parts = [(b * FP8_BLOCK, FP8_BLOCK, "float16") for b in range(D_V // FP8_BLOCK)] + [(D_V, D_ROPE, sdt)]
        kv_parts = [(block_n, w, dt) for _, w, dt in q_parts]
    n_lat = len(q_parts) - 1          # the latent parts; the rope is the last
    # swapped FP8: 64-token steps (WGMMA's M) whose raw bytes arrive in 32-token chunks (shared memory)
    raw_rows = raw_rows or (SWAPPED_RAW_ROWS if swapped and fp8 else block_n)
    raw_parts = ([((raw_rows, half), kv_dt), ((raw_rows, half), kv_dt), ((raw_rows, 4), "float32")] +
                 ([] if rope_direct else [((raw_rows, D_ROPE), sdt)])) if fp8 else None

    def bf16_parts(KV):        # (tensor, first column, width, operand part)
        return [(KV, 0, half, 0), (KV, half, half, 1), (KV, D_V, D_ROPE, 2)]

    def fp8_parts(KV, KVf, KVh):  # raw staging parts: e4m3 halves, the 4 scales, the bf16 rope (unless direct)
        return [(KV, 0, half, 0), (KV, half, half, 1), (KVf, FP8_SCALE_WORD, 4, 2)] + \
            ([] if rope_direct else [(KVh, FP8_ROPE_HALF, D_ROPE, 3)])

    fp8_value = tile.RawValue(  # FP8 cache -> operand part: e4m3 * its 128-column scale; rope as is
        loads=lambda part: ([lambda i, j, read: read(3, i, j)] if part == 2 else
                            [lambda i, j, read: read(part, i, j), lambda i, j, read: read(2, i, part * 2 + j // 128)]),
        combine=lambda part, v: v[0] if part == 2 else T.cast(T.cast(v[0], "float32") * v[1], sdt))
    # fold_scales: latent part b (columns 128b..) is e4m3 -> fp16 exactly; its scale is row scale b
    blocks_per_half = half // FP8_BLOCK
    fp8_folded = tile.RawValue(
        loads=lambda part: ([lambda i, j, read: read(3, i, j)] if part == n_lat else
                            [lambda i, j, read: read(part // blocks_per_half, i,
                                                      (part % blocks_per_half) * FP8_BLOCK + j)]),
        combine=lambda part, v: v[0] if part == n_lat else T.cast(v[0], "float16"),
        row_scales=(n_lat, lambda b, i, read: read(2, i, b), tuple(range(n_lat)) + (None,)))

    def limit(causal_base, mt, i):  # causal: query token q sees the cache up to seqlen - s_q + q + 1
        return causal_base + (mt * BLOCK_M + i) // h_q if causal else causal_base

    @T.macro
    def epilogue(o, col0, l, m, stats, Out, Lse, OPart, LsePart, bi, mt, si, splits, max_splits, q_tiles):
        # o: columns col0.. of the output tile (unnormalized); l, m: row sums and maxima (log2 domain), of
        # the rows this core's vector code holds (tile.split_rows: all 64, or a half on Ascend)
        mine, first = tile.split_rows(BLOCK_M)
        group = col0 // half                        # stage_out: the warpgroup of these columns (sm_90a)
        with tile.vector():
            for i, j in tile.parallel(mine, o.shape[1]):
                o[i, j] = T.if_then_else(l[i] > 0.0, o[i, j] * tile.reciprocal(l[i]), 0.0)
            if si < splits:
                if splits == 1:
                    if stage_out:
                        _stage_store(o, q_tiles[group], group, Out, bi, mt * BLOCK_M, col0, whole_rows, out_tma)
                    else:
                        for i, j in tile.parallel(mine, o.shape[1]):
                            r = mt * BLOCK_M + first + i
                            if r < rows:
                                Out[bi, r, col0 + j] = T.cast(o[i, j], sdt)
                    if stats:
                        for i in tile.parallel(mine):
                            r = mt * BLOCK_M + first + i
                            if r < rows:
                                Lse[bi, r % h_q, r // h_q] = T.if_then_else(l[i] > 0.0, (m[i] + T.log2(l[i])) * LN2,
                                                                            neg_inf)
                else:
                    slot = bi * max_splits + si
                    if stage_out and seesaw:   # (the plain schedule's 168 registers a thread: its passes spilled)
                        _stage_store(o, q_tiles[group], group, OPart, slot, mt * BLOCK_M, col0, whole_rows, out_tma)
                    elif rows % BLOCK_M == 0:
                        for i, j in tile.parallel(mine, o.shape[1]):
                            OPart[slot, mt * BLOCK_M + first + i, col0 + j] = o[i, j]
                    else:   # a tile's padding rows stay unwritten (no combine reads them): 16 of 64 at s_q * h_q = 48
                        for i, j in tile.parallel(mine, o.shape[1]):
                            if mt * BLOCK_M + first + i < rows:
                                OPart[slot, mt * BLOCK_M + first + i, col0 + j] = o[i, j]
                    if stats:
                        for i in tile.parallel(mine):
                            LsePart[slot, mt * BLOCK_M + first + i] = T.if_then_else(l[i] > 0.0, m[i] + T.log2(l[i]),
                                                                                     neg_inf)  # base 2

    @T.macro
    def epilogue_t(o_t, col0, l_pair, m_s, stats, Out, Lse, OPart, LsePart, bi, si, splits, max_splits):
        # swapped: o_t (columns col0.., query rows) unnormalized; l_pair the row sums and their reciprocals (0
        # where a row saw no token), m_s the maxima, in shared memory (log2 domain); one tile of block_m rows
        # (mt = 0). o * (1 / l): the bits of epilogue()'s
        l_s, inv_s = l_pair
        for j, i in tile.parallel(o_t.shape[0], block_m):
            o_t[j, i] = T.if_then_else(l_s[i] > 0.0, o_t[j, i] * inv_s[i], 0.0)
        if si < splits:
            if splits == 1:
                for j, i in tile.parallel(o_t.shape[0], block_m):
                    if i < rows:
                        Out[bi, i, col0 + j] = T.cast(o_t[j, i], sdt)
                if stats:
                    for i in tile.parallel(block_m):
                        if i < rows:
                            Lse[bi, i % h_q, i // h_q] = T.if_then_else(l_s[i] > 0.0, (m_s[i] + T.log2(l_s[i])) * LN2,
                                                                        neg_inf)
            else:
                slot = bi * max_splits + si
                for j, i in tile.parallel(o_t.shape[0], block_m):
                    OPart[slot, i, col0 + j] = o_t[j, i]
                if stats:
                    for i in tile.parallel(block_m):
                        LsePart[slot, i] = T.if_then_else(l_s[i] > 0.0, m_s[i] + T.log2(l_s[i]), neg_inf)

    @T.macro
    def epilogue_piece(o, col0, l, m, stats, Out, Lse, OPart, LsePart, Counters, u, mt, q_tiles):
        # persistent: this CTA's rows of piece u.slot, a run of sequence u.out_bi's 64-token blocks (u.pieces of
        # them, partial slots u.idx0 ..). A whole sequence writes its output; a piece writes its partial (O / l,
        # lse in base 2) to slot u.own, and with merge counts itself on the sequence's counter of this
        # warpgroup's columns, and the last of the pieces to arrive merges all of them, in piece order (the bits
        # do not depend on which is last), and writes the output (without merge the combine kernel does). l and
        # m are the unit's row statistics, free once the partial is written.
        group = col0 // half                        # the warpgroup (its columns) counts on its own counter
        # the row statistics first (they read l); then l holds 1 / l, computed once a row (as o * (1 / l) per
        # element, each a reciprocal with its slow-path call, the epilogue took ~11K cycles a unit on an H200:
        # bench/NOTES.md "Session 77"), and scales o: the bits of epilogue()'s o * reciprocal(l)
        if u.pieces == 1:
            if stats:
                for i in tile.parallel(BLOCK_M):
                    r = mt * BLOCK_M + i
                    Lse[u.out_bi, r % h_q, r // h_q] = T.if_then_else(l[i] > 0.0, (m[i] + T.log2(l[i])) * LN2, neg_inf)
        else:
            # (both warpgroups write the lse, the same bits: each merges after its own group's arrivals)
            for i in tile.parallel(BLOCK_M):
                LsePart[u.own, mt * BLOCK_M + i] = T.if_then_else(l[i] > 0.0, m[i] + T.log2(l[i]), neg_inf)
        for i in tile.parallel(BLOCK_M):
            l[i] = T.if_then_else(l[i] > 0.0, tile.reciprocal(l[i]), 0.0)
        for i, j in tile.parallel(BLOCK_M, o.shape[1]):
            o[i, j] = T.if_then_else(l[i] > 0.0, o[i, j] * l[i], 0.0)
        if u.pieces == 1:
            if stage_out:       # (through this warpgroup's latent query columns, as wide as o: _stage_store)
                _stage_store(o, q_tiles[group], group, Out, u.out_bi, mt * BLOCK_M, col0, None, out_tma)
            else:
                for i, j in tile.parallel(BLOCK_M, o.shape[1]):
                    Out[u.out_bi, mt * BLOCK_M + i, col0 + j] = T.cast(o[i, j], sdt)
        elif stage_out:
            _stage_store(o, q_tiles[group], group, OPart, u.own, mt * BLOCK_M, col0, None, out_tma and not merge)
        else:
            for i, j in tile.parallel(BLOCK_M, o.shape[1]):
                OPart[u.own, mt * BLOCK_M + i, col0 + j] = o[i, j]
        if u.pieces != 1:
            if merge:
                if tile.last_arrival(Counters, (u.out_bi * m_tiles + mt) * 2 + group, u.pieces, threads=WG_THREADS,
                                     group=group):
                    _merge_pieces(Out, Lse, OPart, LsePart, u, mt * BLOCK_M, col0, half, h_q, sdt, stats)

    if persistent:
        parts1, unit_slots, counters = T.dynamic("parts1, unit_slots, counters")

        @T.prim_func
        def mla_decode_persistent(
            Q: T.Tensor((batch, rows, D_QK), sdt),
            KV: T.Tensor((num_pages, page, width), kv_dt),
            KVf: T.Tensor((num_pages, page, width * 2 // 4), "float32"),
            KVh: T.Tensor((num_pages, page, width), sdt),
            BlockTable: T.Tensor((batch, max_blocks), "int32"),
            SeqLens: T.Tensor((batch,), "int32"),
            Splits: T.Tensor((batch,), "int32"),
            Out: T.Tensor((batch, rows, D_V), sdt),
            Lse: T.Tensor((batch, h_q, s_q), "float32"),
            OPart: T.Tensor((slots, rows_pad, D_V), "float32"),
            LsePart: T.Tensor((slots, rows_pad), "float32"),
            Pieces: T.Tensor((unit_slots, PIECE_FIELDS), "int32"),
            PartStart: T.Tensor((parts1,), "int32"),
            Counters: T.Tensor((counters,), "int32"),
            max_splits: T.int32,
            scale_log2: T.float32,
        ):
            with tile.grid((parts1 - 1) * m_tiles, threads + tile.producer_threads()) as bid:
                mt = tile.scalar(bid % m_tiles)
                begin = tile.scalar(PartStart[bid // m_tiles])
                end = tile.scalar(PartStart[bid // m_tiles + 1])
                q_tiles = [tile.operand((block_m, w), dt) for _, w, dt in q_parts]
                tile.attention_loop(
                    None, q_tiles, kv_parts, list(range(n_lat)), None, None, scale_log2, None, valid_rows=None,
                    stages=stages, seesaw=True, trace=OPart if trace else None, own_p=own_p,
                    **({"lazy": float(lazy)} if lazy > 0 else {}),
                    units=tile.Units(begin, end, lambda: _MlaPiece(
                        Pieces, SeqLens, s_q, causal,
                        loads=lambda u, k: _page_copies(BlockTable, u.bi, u.first + k, page, BLOCK_N, num_pages,
                                                        bf16_parts(KV), pidx=u.page_index),
                        prefetch=lambda u, k: _load_page(BlockTable, u.bi, u.first + k, page, num_pages,
                                                         u.page_var),
                        limit=lambda base, i: limit(base, mt, i),
                        epilogue=lambda u, o, col0, l, m, stats: epilogue_piece(
                            o, col0, l, m, stats, Out, Lse, OPart, LsePart, Counters, u, mt, q_tiles),
                        query=lambda u: [(Q[u.bi, mt * BLOCK_M:(mt + 1) * BLOCK_M, c0:c0 + w], n)
                                         for n, (c0, w, _) in enumerate(q_parts)]), early_query=early_q,
                        query_staging=stage_out, steps_first=kv_first))

        return mla_decode_persistent

    @T.prim_func
    def mla_decode(
        Q: T.Tensor((batch, rows, D_QK), sdt),
        KV: T.Tensor((num_pages, page, width), kv_dt),
        KVf: T.Tensor((num_pages, page, width * (1 if fp8 else 2) // 4), "float32"),
        KVh: T.Tensor((num_pages, page, width // (2 if fp8 else 1)), sdt),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), sdt),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, rows_pad, D_V), "float32"),
        LsePart: T.Tensor((slots, rows_pad), "float32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with tile.grid(batch * max_splits * m_tiles, threads + tile.producer_threads()) as bid:
            # per-CTA scalars: registers where the target's attention_loop wants them (tile.scalar)
            mt = tile.scalar(bid % m_tiles)
            si = tile.scalar((bid // m_tiles) % max_splits)
            bi = tile.scalar(bid // (m_tiles * max_splits))

            splits = tile.scalar(Splits[bi])
            seqlen = tile.scalar(SeqLens[bi])
            chunk = T.ceildiv(T.ceildiv(seqlen, BLOCK_N), T.max(splits, 1)) * (BLOCK_N // block_n)
            first = tile.scalar(si * chunk)
            n_iter = tile.scalar(T.if_then_else(si < splits,
                                                T.max(T.min(T.ceildiv(seqlen, block_n), first + chunk) - first, 0), 0))
            causal_base = seqlen - s_q + 1 if causal else seqlen
            q_tiles = _query_tiles(lambda r, c: Q[bi, r, c], lambda i: mt * BLOCK_M + i, block_m, rows, q_parts)

            tile.attention_loop(
                n_iter, q_tiles, kv_parts, list(range(n_lat)),
                # (raw chunks of raw_rows tokens: chunk j of this CTA starts at token first * block_n + j * raw_rows)
                lambda k: _page_copies(BlockTable, bi, first * (block_n // raw_rows) + k, page, raw_rows, num_pages,
                                       fp8_parts(KV, KVf, KVh) if fp8 else bf16_parts(KV)),
                lambda k, i, j: (first + k) * block_n + j < limit(causal_base, mt, i),
                scale_log2,
                (lambda o, col0, l, m, stats: epilogue_t(o, col0, l, m, stats, Out, Lse, OPart, LsePart, bi, si,
                                                         splits, max_splits)) if swapped else
                (lambda o, col0, l, m, stats: epilogue(o, col0, l, m, stats, Out, Lse, OPart, LsePart, bi, mt, si,
                                                       splits, max_splits, q_tiles)),
                valid_rows=seqlen - first * block_n, raw=raw_parts,
                value=(fp8_folded if fold_scales else fp8_value) if fp8 else None,
                stages=stages, raw_stages=raw_stages, trace=OPart if trace else None,
                seesaw=seesaw, own_p=own_p,
                **({"lazy": float(lazy)} if lazy > 0 else {}),
                # no mask on a step whose last token every row sees (limit() >= causal_base)
                all_visible=lambda k: (first + k + 1) * block_n <= causal_base,
                # see common._zero_tail: TileLang 0.1.15 rejects the guarded zeroing when a CTA owns one
                # of several 64-row tiles of a causal multi-token query
                zero_every_step=causal and m_tiles > 1,
                swapped=swapped, raw_rows=raw_rows if raw_rows != block_n else None, stage_raw=stage_raw,
                # rope_direct: step k's bf16 rope goes by TMA straight into operand part 2
                direct=(lambda k: _page_copies(BlockTable, bi, first + k, page, block_n, num_pages,
                                               [(KVh, FP8_ROPE_HALF, D_ROPE, n_lat)])) if rope_direct else None)

    return mla_decode


# a persistent piece: (sequence, first 64-token block, blocks, its sequence's first partial slot, pieces, its own
# partial slot); a sequence's pieces have consecutive slots
PIECE_FIELDS = 6
WG_THREADS = 128    # an MMA warpgroup of the seesaw (the piece epilogue's arrival group)


class _MlaPiece:
    """A persistent CTA's binding of its current piece (tile.Units.bind): a run of one sequence's 64-token
    blocks (MlaSchedule.persistent_pieces), its attention loop's copies, mask, epilogue and query copies from
    the program's own closures (each taking the binding first)."""

    def __init__(self, Pieces, SeqLens, s_q, causal, *, loads, prefetch, limit, epilogue, query):
        vars_ = [T.alloc_var("int32", init=0) for _ in range(5)]
        # the scalars as expressions (reads of the variables that load() sets)
        self.bi, self.first, self.steps, self.seqlen, self.slot = (v[0] for v in vars_)
        # what only the epilogue reads, into registers with the rest (one load each: as expressions, every use
        # reloaded it behind bounds checks, 800 loads and 2.3x the kernel's code); loaded in the epilogue, its
        # first branch waited ~an L2 round trip for them. out_bi: the output's sequence (the piece's)
        epi = [T.alloc_var("int32") for _ in range(3)]
        self.idx0, self.pieces, self.own = (v[0] for v in epi)
        self.out_bi = self.bi
        # the merge's (_merge_pieces): a lane's sums (8 rows x 4 columns), the 8 rows' lse, maxima, weight sums
        self.merge = (T.alloc_local((MERGE_ROWS // 2, 4), "float32"),
                      *(T.alloc_local((MERGE_ROWS // 2,), "float32") for _ in range(3)))
        # the current step's page index, set by prefetch(k) before the step's copies read it
        self.page_var = T.alloc_var("int32", init=0)
        self.page_index = self.page_var[0]
        self.prefetch = lambda k: prefetch(self, k)
        self.valid_rows = self.seqlen - self.first * BLOCK_N
        base = self.seqlen - s_q + 1 if causal else self.seqlen
        self.load = lambda u: _load_piece(Pieces, SeqLens, u, *vars_, *epi)
        self.loads = lambda k: loads(self, k)
        self.visible = lambda k, i, j: (self.first + k) * BLOCK_N + j < limit(base, i)
        self.all_visible = lambda k: (self.first + k + 1) * BLOCK_N <= base
        self.epilogue = lambda o, col0, l, m, stats: epilogue(self, o, col0, l, m, stats)
        self.query = lambda: query(self)


MERGE_ROWS = BLOCK_M // 4  # the merge: the rows of a warp (four warps a warpgroup)


@T.macro
def _merge_pieces(Out, Lse, OPart, LsePart, u, row0, col0, cols, h_q, sdt, stats):
    """The last piece's warpgroup (its threads g * 128 ..): rows row0 .. row0 + 63, columns col0 .. col0 + cols - 1
    of sequence u.out_bi's output = the sum over its pieces s, in order, of exp2(lse_s - lse) O_s, lse = log2 of the sum
    of exp2(lse_s) (-inf, and 0 out, where every piece's is). A warp takes 16 rows, 8 at a time: a pass over the
    pieces for their lse (every lane computes them: broadcast loads), then one for each 128-column chunk's sums, four
    columns a lane (a row of a partial read whole). Each pass takes two pieces a trip to memory (the second's index
    clamped, weight 0 past the last: no branch between the loads), in order: at two pieces, 6 trips a warp. All rows
    or chunks at once spilled within the seesaw's 216 registers (16 x 8 sums a lane; 16 rows' arrays went to local
    memory)."""
    neg_inf = -T.infinity("float32")
    acc, lse, mx, tot = u.merge
    half = MERGE_ROWS // 2
    tid = T.get_thread_binding() % WG_THREADS
    lane = tid % 32
    for h in T.serial(2):
        r0 = row0 + (tid // 32) * MERGE_ROWS + h * half
        for rr in T.unroll(half):
            mx[rr] = neg_inf
            tot[rr] = 0.0
        for s2 in T.serial(T.ceildiv(u.pieces, 2)):         # pieces 2 s2 and 2 s2 + 1: their loads at once
            for rr in T.unroll(half):
                xa = LsePart[u.idx0 + 2 * s2, r0 + rr]
                xb = T.Select(2 * s2 + 1 < u.pieces, LsePart[u.idx0 + T.min(2 * s2 + 1, u.pieces - 1), r0 + rr],
                              neg_inf)
                ma = T.max(mx[rr], xa)
                ta = T.if_then_else(mx[rr] == neg_inf, 0.0, tot[rr] * T.exp2(mx[rr] - ma)) + \
                    T.if_then_else(xa == neg_inf, 0.0, T.exp2(xa - ma))
                mb = T.max(ma, xb)
                tot[rr] = T.if_then_else(ma == neg_inf, 0.0, ta * T.exp2(ma - mb)) + \
                    T.if_then_else(xb == neg_inf, 0.0, T.exp2(xb - mb))
                mx[rr] = mb
        for rr in T.unroll(half):
            lse[rr] = T.if_then_else(tot[rr] > 0.0, mx[rr] + T.log2(tot[rr]), neg_inf)
        for c in T.serial(cols // 128):
            for rr in T.unroll(half):
                for v in T.vectorized(4):
                    acc[rr, v] = 0.0
            for s2 in T.serial(T.ceildiv(u.pieces, 2)):
                for rr in T.unroll(half):
                    sb = u.idx0 + T.min(2 * s2 + 1, u.pieces - 1)
                    wa = T.if_then_else(lse[rr] == neg_inf, 0.0, T.exp2(LsePart[u.idx0 + 2 * s2, r0 + rr] - lse[rr]))
                    wb = T.Select(T.And(2 * s2 + 1 < u.pieces, lse[rr] != neg_inf),
                                  T.exp2(LsePart[sb, r0 + rr] - lse[rr]), 0.0)
                    for v in T.vectorized(4):
                        acc[rr, v] = acc[rr, v] + wa * OPart[u.idx0 + 2 * s2, r0 + rr, col0 + c * 128 + lane * 4 + v]
                    for v in T.vectorized(4):
                        acc[rr, v] = acc[rr, v] + wb * OPart[sb, r0 + rr, col0 + c * 128 + lane * 4 + v]
            for rr in T.unroll(half):
                for v in T.vectorized(4):
                    Out[u.out_bi, r0 + rr, col0 + c * 128 + lane * 4 + v] = T.cast(acc[rr, v], sdt)
        if stats:
            if lane == 0:
                for rr in T.unroll(half):
                    Lse[u.out_bi, (r0 + rr) % h_q, (r0 + rr) // h_q] = lse[rr] * LN2


@T.macro
def _load_piece(Pieces, SeqLens, u, bi, first, steps, seqlen, slot, idx0, pieces, own):
    bi = Pieces[u, 0]
    first = Pieces[u, 1]
    steps = Pieces[u, 2]
    seqlen = SeqLens[bi]
    slot = u
    idx0 = Pieces[u, 3]
    pieces = Pieces[u, 4]
    own = Pieces[u, 5]


@tile_program(
    "mla_combine",
    targets=ALL_TARGETS,
    examples={"h16": dict(h_q=16, s_q=1), "h128": dict(h_q=128, s_q=1), "h16-lanes8": dict(h_q=16, s_q=1, lanes=8)},
    # the wide combine clamps every split index into its sequence's slots, so TileLang's bounds checks (branches
    # between the loads of a trip on CUDA) are off there
    pass_configs=lambda t, p: {"tl.disable_safe_memory_legalize": True} if t.vendor == "cuda" and p["lanes"] else {},
)
def mla_combine_program(h_q: int, s_q: int, dtype: str = "bfloat16", threads: int = 128, lanes: int = 0):
    """Merge the splits of each sequence that was split: weights exp2(lse_split - lse).

    lanes = 0: a block a query row, its threads across the 512 output columns, three serial passes over the
    splits (their maximum, the sum of weights, the weighted outputs; nvcc unrolls them 16, 4 and 4 splits a
    trip to memory). lanes = 1, 2, 4 or 8 (the wide combine, for many splits): a block per (row, column chunk of
    512 / lanes), its threads `lanes` split lanes x the chunk's columns, 4 a thread; the lse of COMBINE_LSE_TILE
    splits a round, reduced across the block, then lane g folds splits g, g + lanes, ... COMBINE_AHEAD rounds a
    trip to memory, and the lanes are summed at the end."""
    rows = s_q * h_q
    rows_pad = (rows + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    sdt = tile.storage_dtype(dtype)
    batch, slots = T.dynamic("batch, slots")
    neg_inf = -T.infinity("float32")
    if lanes not in (0, 1, 2, 4, 8):
        raise ValueError(f"lanes must be 0 (the three-pass combine) or 1, 2, 4, 8, got {lanes!r}")
    cols = D_V // max(lanes, 1)
    chunks = D_V // cols

    @T.prim_func
    def mla_combine(
        Splits: T.Tensor((batch,), "int32"),
        OPart: T.Tensor((slots, rows_pad, D_V), "float32"),
        LsePart: T.Tensor((slots, rows_pad), "float32"),
        Out: T.Tensor((batch, rows, D_V), sdt),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        max_splits: T.int32,
    ):
        with tile.grid(batch * rows * chunks, threads) as bid:
            bi, r, c = tile.split_index(bid, (batch, rows, chunks))
            with tile.vector():
                lse_max = T.alloc_var("float32")
                total = T.alloc_var("float32")
                lse = T.alloc_var("float32")
                splits = Splits[bi]
                if lanes:
                    lt = tile.fragment((1, COMBINE_LSE_TILE))
                    red = tile.fragment((1,))
                    acc = tile.fragment((lanes, cols))
                    merged = tile.fragment((cols,))
                    _combine_wide(splits, bi, r, c, lt, red, acc, merged, LsePart, OPart, Out, Lse, max_splits, h_q,
                                  sdt, lanes, cols)
                elif splits > 1:
                    acc = tile.fragment((D_V,))
                    lse_max = neg_inf
                    total = 0.0
                    for s in T.serial(splits):
                        lse_max = T.max(lse_max, LsePart[bi * max_splits + s, r])
                    for s in T.serial(splits):
                        total += T.if_then_else(lse_max == neg_inf, 0.0, T.exp2(LsePart[bi * max_splits + s, r] - lse_max))
                    lse = T.if_then_else(total > 0.0, lse_max + T.log2(total), neg_inf)
                    for j in tile.parallel(D_V):
                        acc[j] = 0.0
                    for s in T.serial(splits):
                        for j in tile.parallel(D_V):
                            acc[j] += T.if_then_else(lse == neg_inf, 0.0,
                                                     T.exp2(LsePart[bi * max_splits + s, r] - lse)
                                                     * OPart[bi * max_splits + s, r, j])
                    for j in tile.parallel(D_V):
                        Out[bi, r, j] = T.cast(acc[j], sdt)
                    Lse[bi, r % h_q, r // h_q] = lse * LN2

    return mla_combine


def combine_lanes_for(max_splits: int) -> int:
    """The wide combine's split lanes for a schedule of up to max_splits splits a sequence: enough that one trip
    to memory (COMBINE_AHEAD splits a lane) covers them, 1 to 8 (8: 64 output columns a block)."""
    lanes = 1
    while lanes < 8 and lanes * COMBINE_AHEAD < max_splits:
        lanes *= 2
    return lanes


COMBINE_LSE_TILE = 128  # the wide combine: split lse values reduced together (a round of the lse passes)
COMBINE_AHEAD = 8       # ... and rounds of `lanes` splits whose outputs one trip to memory loads


@T.macro
def _combine_wide(splits, bi, r, c, lt, red, acc, merged, LsePart, OPart, Out, Lse, max_splits, h_q, sdt, lanes, cols):
    """mla_combine_program(lanes=...): sequence bi's row r, output columns [c * cols, (c + 1) * cols). The maximum m
    of the splits' lse and the sum of exp2(lse_s - m) come from block-wide reductions over COMBINE_LSE_TILE splits a
    round; lse = m + log2(sum) (-inf when every split is empty); lane g then adds exp2(lse_s - lse) O_s for its
    splits s = g + lanes * k, COMBINE_AHEAD of them a trip (indices past the last split clamped to it, weight 0: no
    branch between the loads), and the lanes' sums are added. A sequence of one split is left as the main kernel
    wrote it."""
    neg_inf = -T.infinity("float32")
    m = T.alloc_var("float32")
    total = T.alloc_var("float32")
    lse = T.alloc_var("float32")
    base = bi * max_splits
    if splits > 1:
        m = neg_inf
        for t in T.serial(T.ceildiv(splits, COMBINE_LSE_TILE)):
            for i, u in tile.parallel(1, COMBINE_LSE_TILE):
                s = t * COMBINE_LSE_TILE + u
                lt[i, u] = T.if_then_else(s < splits, LsePart[base + T.min(s, splits - 1), r], neg_inf)
            tile.row_reduce(lt, red, "max", dim=1)
            m = T.max(m, red[0])
        total = 0.0
        for t in T.serial(T.ceildiv(splits, COMBINE_LSE_TILE)):
            for i, u in tile.parallel(1, COMBINE_LSE_TILE):
                s = t * COMBINE_LSE_TILE + u
                lt[i, u] = T.if_then_else(s < splits and m != neg_inf,
                                          T.exp2(LsePart[base + T.min(s, splits - 1), r] - m), 0.0)
            tile.row_reduce(lt, red, "sum", dim=1)
            total = total + red[0]
        lse = T.if_then_else(total > 0.0, m + T.log2(total), neg_inf)
        for g, j in tile.parallel(lanes, cols):
            acc[g, j] = 0.0
        for t in T.serial(T.ceildiv(splits, lanes * COMBINE_AHEAD)):
            for k in T.unroll(COMBINE_AHEAD):
                for g, j in tile.parallel(lanes, cols):
                    s = (t * COMBINE_AHEAD + k) * lanes + g
                    slot = base + T.min(s, splits - 1)
                    # (Select, not if_then_else: both sides evaluated, no branch around the lse load)
                    acc[g, j] += T.exp2(T.Select(s < splits and lse != neg_inf, LsePart[slot, r] - lse, neg_inf)) \
                        * OPart[slot, r, c * cols + j]
        tile.row_reduce(acc, merged, "sum", dim=0)
        for j in tile.parallel(cols):
            Out[bi, r, c * cols + j] = T.cast(merged[j], sdt)
        if c == 0:
            Lse[bi, r % h_q, r // h_q] = lse * LN2


# ---- the schedule: computed once per decode step, reused by every layer ----------------------------

@dataclass
class MlaSchedule:
    """How each sequence's KV blocks are split across CTAs (FlashMLA's 'metadata').

    Built on the device from cache_seqlens with no host sync, so it can live inside a CUDA graph.
    Reuse it for every layer of a step: it depends only on the lengths and the shapes.
    """

    splits: torch.Tensor        # (b,) int32: splits per sequence
    max_splits: int
    rows: int
    batch_invariant: bool
    cache_seqlens: torch.Tensor | None = None
    _units: dict = field(default_factory=dict, repr=False)

    def check(self, b: int, rows: int) -> None:
        if self.splits.shape != (b,) or self.rows != rows:
            raise ValueError(f"sched was made for batch {tuple(self.splits.shape)} and {self.rows} query rows, "
                             f"but this call has batch ({b},) and {rows} rows (s_q * h_q)")

    def persistent_units(self, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(unit_list (b * max_splits,) int32, part_start (parts + 1,) int32): the schedule's splits (units,
        ids bi * max_splits + si, the splits that exist, in order) dealt whole to `parts` contiguous runs, a unit
        costing its 64-token blocks + UNIT_COST (FlashMLA's cost model: a unit's fixed work is worth ~5 blocks),
        so that the costliest run is within 1/(PART_CAPS - 1) of a unit of the least possible
        (_persistent_units). Part p runs unit_list[part_start[p]:part_start[p + 1]]. On the device, no host
        sync (CUDA graphs)."""
        key = ("units", parts)
        if key not in self._units:
            if self.cache_seqlens is None:
                raise ValueError("this MlaSchedule has no cache_seqlens (make it with get_mla_schedule)")
            self._units[key] = _persistent_units(self.splits, self.max_splits, self.cache_seqlens, parts)
        return self._units[key]

    def persistent_pieces(self, parts: int, cut: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(pieces (n, PIECE_FIELDS) int32, part_start (parts + 1,) int32) for the persistent kernel, made once
        per schedule, part count and deal: part p runs pieces[part_start[p]:part_start[p + 1]], each a row
        (sequence, first 64-token block, blocks, its sequence's first partial slot, the sequence's pieces, its own
        partial slot); a sequence's pieces have consecutive slots. By default the schedule's splits, dealt whole
        (persistent_units), their partials where the combine kernel reads them. cut=True (the kernel's in-kernel
        merge, mla_decode_program(merge=True)): the sequences cut where the parts' equal shares of the cost end
        (_cut_pieces: FlashMLA's deal), except in batch-invariant mode, where a sequence's bits must not depend on
        the batch (the splits, dealt whole). On the device, no host sync (CUDA graphs)."""
        key = ("pieces", parts, bool(cut))
        if key not in self._units:
            if self.cache_seqlens is None:
                raise ValueError("this MlaSchedule has no cache_seqlens (make it with get_mla_schedule)")
            if self.batch_invariant or not cut:
                unit_list, part_start = self.persistent_units(parts)
                self._units[key] = (_split_pieces(unit_list, self.splits, self.max_splits, self.cache_seqlens),
                                    part_start)
            else:
                self._units[key] = _cut_pieces(self.cache_seqlens, parts)
        return self._units[key]


PIECE_COST = 2  # a piece's fixed cost in 64-token blocks for the cut deal (~1.9 fit for whole units in session 75;
                # a cut sequence's second piece measured ~6 and its merge ~8 more on an H100, "Session 76")


def _cut_pieces(seqlens, parts, fixed=PIECE_COST):
    """The sequences, each costing its 64-token blocks + `fixed`, laid end to end and cut into `parts` runs of
    equal cost ceil(total / parts) (a cut that falls in a sequence's fixed cost moves to its start): (pieces
    (b + parts, PIECE_FIELDS) int32, part_start (parts + 1,) int32), as MlaSchedule.persistent_pieces; partial
    slots in sequence order, a part's head piece of a cut sequence moved to its front. A part's work is its share
    plus one piece's fixed cost at most. Rows past part_start[parts] are -1."""
    dev, b = seqlens.device, seqlens.shape[0]
    nblk = (seqlens.long() + BLOCK_N - 1) // BLOCK_N                                   # (b,)
    end = torch.cumsum(nblk + fixed, 0)
    start = end - nblk - fixed
    cap = (end[-1] + parts - 1) // parts
    x = cap * torch.arange(parts + 1, device=dev)                                       # the parts' cost bounds
    # bound p = (sequence, block): the sequence whose cost span holds x (b past the end), the block it cuts at
    seq = torch.searchsorted(end, x, right=True)
    blk = torch.where(seq < b, x - start[seq.clamp(max=b - 1)] - fixed, 0).clamp(min=0)
    # part p: sequences seq[p] .. seq[p + 1] (the last only where bound p + 1 cuts into it)
    last = torch.where(blk[1:] > 0, seq[1:], seq[1:] - 1)
    count = (last - seq[:-1] + 1).clamp(min=0)
    part_start = torch.cat([count.new_zeros(1), torch.cumsum(count, 0)])
    n = b + parts
    k = torch.arange(n, device=dev)
    valid = k < part_start[-1]
    p = torch.searchsorted(part_start[1:], k, right=True).clamp(max=parts - 1)          # each entry's part
    sk = torch.where(valid, seq[p] + k - part_start[p], b)                              # its sequence (b: none)
    skc = sk.clamp(max=b - 1)
    first = torch.where(sk == seq[p], blk[p], 0)
    stop = torch.where(sk == seq[p + 1], blk[p + 1], nblk[skc])
    idx0 = torch.searchsorted(sk, sk)                                                   # sk is non-decreasing
    pieces = torch.searchsorted(sk, sk, right=True) - idx0
    table = torch.stack([sk, first, stop - first, idx0, pieces, k], 1)
    table = torch.where(valid[:, None], table, -1)
    # a part that ends with the head of a cut sequence runs it first instead: both pieces of every cut sequence
    # then run early on their parts (the tail is first or second on the next), so that the merge reads a partial
    # still in L2 and is not at a part's end (session 76: there it read from DRAM, ~17 us for 64 merges)
    e = part_start[1:] - 1
    ec = e.clamp(min=0)
    rotate = (count >= 2) & (table[ec, 4] > 1) & (table[ec, 1] == 0)
    src = torch.where(rotate[p] & valid, torch.where(k == part_start[p], e[p], k - 1), k)
    table = table[src]
    return table.to(torch.int32).contiguous(), part_start.to(torch.int32).contiguous()


def _split_pieces(unit_list, splits, max_splits, seqlens):
    """The pieces table (MlaSchedule.persistent_pieces) of a whole-split deal (persistent_units' unit list):
    piece = the schedule's split si, its partial slot bi * max_splits + si (where the combine kernel reads it).
    Rows of no unit (-1 in unit_list) are -1."""
    u = unit_list.long()
    valid = u >= 0
    bi = torch.where(valid, u // max_splits, 0)
    si = torch.where(valid, u % max_splits, 0)
    nblk = (seqlens.long()[bi] + BLOCK_N - 1) // BLOCK_N
    sp = splits.long()[bi].clamp(min=1)
    chunk = (nblk + sp - 1) // sp
    first = si * chunk
    steps = (torch.minimum(nblk, first + chunk) - first).clamp(min=0)
    table = torch.stack([bi, first, steps, bi * max_splits, sp, bi * max_splits + si], 1)
    table = torch.where(valid[:, None], table, -1)
    return table.to(torch.int32).contiguous()


UNIT_COST = 5   # a unit's fixed cost in 64-token blocks (query, pipeline fill, epilogue), as FlashMLA counts it
PART_CAPS = 32  # the caps _persistent_units tries, from the least possible run cost up by a unit's cost


def _persistent_units(splits, max_splits, seqlens, parts):
    """The units' contiguous runs: the greedy deal (fill a part up to a cap, then the next) under the least of
    PART_CAPS caps that needs no more than `parts` runs. The caps go from max(total / parts, costliest unit),
    which no deal beats, to that plus the costliest unit, which the greedy deal always meets, so the costliest
    run is within (costliest unit) / (PART_CAPS - 1) of the least possible. (Session 75: dealing each unit to
    the part its cost midpoint falls in put 3 units in one part and 1 in another at 132 equal sequences on 66
    parts: 1.31x the time of 2 a part.) Vectorized over the caps with pointer doubling: no host sync."""
    dev, b = splits.device, splits.shape[0]
    n = b * max_splits
    nblk = (seqlens.long() + BLOCK_N - 1) // BLOCK_N                                  # (b,)
    sp = splits.long().clamp(min=1)
    chunk = (nblk + sp - 1) // sp
    si = torch.arange(max_splits, device=dev)
    first = si[None, :] * chunk[:, None]                                               # (b, max_splits)
    blocks = (torch.minimum(nblk[:, None], first + chunk[:, None]) - first).clamp(min=0)
    valid = (si[None, :] < splits.long()[:, None]).reshape(-1)
    cost = torch.where(valid, blocks.reshape(-1) + UNIT_COST, 0)
    # the existing units, compacted in order (invalid ones go to a dump slot n; their cost 0 at the tail)
    dst = torch.where(valid, torch.cumsum(valid.long(), 0) - 1, n)
    ids = torch.arange(n, device=dev, dtype=torch.int32)
    unit_list = torch.full((n + 1,), -1, dtype=torch.int32, device=dev).scatter_(0, dst, ids)[:n]
    ccost = torch.zeros(n + 1, dtype=torch.long, device=dev).scatter_(0, dst, cost)[:n]
    end = torch.cumsum(ccost, 0)                                                       # (n,)
    start = end - ccost
    most = ccost.max()
    least = torch.maximum((end[-1] + parts - 1) // parts, most)
    caps = least + (most * torch.arange(PART_CAPS, device=dev)) // (PART_CAPS - 1)      # (C,) rising
    # step[c, i]: where cap c's run that starts at unit i ends (the first unit past its cap; n stays n)
    step = torch.searchsorted(end, start[None, :] + caps[:, None], right=True)         # (C, n)
    step = torch.cat([step, step.new_full((PART_CAPS, 1), n)], 1)                      # (C, n + 1)
    # at[c, p]: the first unit of run p under cap c, step^p(0), by the bits of p (step^(2^t) by doubling)
    bits = parts.bit_length()
    p = torch.arange(parts + 1, device=dev)
    on = ((p[None, :] >> torch.arange(bits, device=dev)[:, None]) & 1).bool()          # (bits, parts + 1)
    at = torch.zeros(PART_CAPS, parts + 1, dtype=torch.long, device=dev)
    power = step
    for t in range(bits):
        if t:
            power = torch.gather(power, 1, power)
        at = torch.where(on[t], torch.gather(power, 1, at), at)
    # the least cap whose `parts` runs reach the end (the largest cap always does)
    at = at[torch.argmax((at[:, parts] >= n).int())]
    part_start = torch.minimum(at, valid.sum()).to(torch.int32)
    return unit_list.contiguous(), part_start.contiguous()


# get_mla_schedule's default max_splits: None, no cap below the SM count (32 until session 57: a lone sequence
# then ran on 32 SMs; lifted with the wide combine, bench/NOTES.md "Session 57")
SPLIT_CAP = None
SPLIT_MIN_BLOCKS = 4    # ... and min_split_blocks: at least this many 64-token blocks a split


def get_mla_schedule(cache_seqlens: torch.Tensor, s_q: int, h_q: int, max_blocks: int, *,
                     num_sms: int | None = None, batch_invariant: bool | None = None,
                     kv_format: str = "bf16", max_splits: int | None = None,
                     min_split_blocks: int | None = None) -> MlaSchedule:
    """Split each sequence so that b * m_tiles * splits CTAs fill the GPU.

    num_sms: the CTAs that run at once (default: the device's SMs; every default kernel runs one CTA an SM).
    kv_format is checked and kept for callers that make one schedule a cache format; a schedule made for
    another format or CTA count is still right, only less balanced. A sequence of n 64-token blocks gets
    min(ceil(n / min_split_blocks), num_sms // (b * m_tiles), max_splits) splits (at least 1; defaults
    SPLIT_MIN_BLOCKS = 4 and no max_splits (SPLIT_CAP = None): a lone sequence of 64 rows or fewer and 33+ blocks
    runs on every SM). Batch-invariant mode (TILECRAFT_BATCH_INVARIANT=1) splits every sequence into
    fixed 16-block chunks instead, so a sequence's result never depends on what else is in the batch;
    max_splits and min_split_blocks are refused there.
    """
    check.tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    check.number("s_q", s_q, lo=1, hi=MAX_S_Q, integer=True)
    check.number("h_q", h_q, lo=1, hi=MAX_HEADS, integer=True)
    try:
        max_blocks = operator.index(max_blocks)
    except TypeError:
        raise TypeError(f"max_blocks must be an int, got {type(max_blocks).__name__}") from None
    check.number("max_blocks", max_blocks, lo=0, integer=True)
    if num_sms is not None:
        check.number("num_sms", num_sms, lo=1, integer=True)
    for name, v in (("max_splits", max_splits), ("min_split_blocks", min_split_blocks)):
        if v is not None:
            check.number(name, v, lo=1, integer=True)
    if batch_invariant is None:
        batch_invariant = env.flag("TILECRAFT_BATCH_INVARIANT")
    check.flag("batch_invariant", batch_invariant)
    if batch_invariant and (max_splits is not None or min_split_blocks is not None):
        raise ValueError("max_splits and min_split_blocks have no effect in batch-invariant mode (fixed 16-block "
                         "splits; batch_invariant=True or TILECRAFT_BATCH_INVARIANT=1): leave them None")
    b = cache_seqlens.shape[0]
    rows = s_q * h_q
    m_tiles = -(-rows // BLOCK_M)
    max_blocks = max(1, int(max_blocks))
    nblk = (cache_seqlens + (BLOCK_N - 1)) // BLOCK_N
    if batch_invariant:
        chunk = 16
        max_splits = -(-max_blocks // chunk)
        splits = ((nblk + chunk - 1) // chunk).clamp_(min=1)
    else:
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(cache_seqlens.device).multi_processor_count
                       if cache_seqlens.is_cuda else 132)
        ctas = max(1, b * m_tiles)
        least = SPLIT_MIN_BLOCKS if min_split_blocks is None else min_split_blocks
        cap = SPLIT_CAP if max_splits is None else max_splits
        max_splits = max(1, min(num_sms // ctas if ctas < num_sms else 1, max_blocks // least, cap or num_sms))
        # shorter sequences get fewer splits: at least `least` blocks a split
        splits = ((nblk + (least - 1)) // least).clamp_(min=1, max=max_splits)
    return MlaSchedule(splits.to(torch.int32).contiguous(), int(max_splits), rows, bool(batch_invariant),
                       cache_seqlens)


# ---- reference ---------------------------------------------------------------------------------------

_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _validate_reference(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    """The op's checks less its kernel limits: q and kv_cache of any floating dtype (not necessarily the same)
    and strides, any head_dim d with head_dim_v <= d, any page size, batch, s_q and h_q; block_table and
    cache_seqlens int32 or int64. The values are always checked (the reference reads cache_seqlens on the host
    anyway and, unlike the kernels, clamps no index): a negative block index would wrap around the cache."""
    check.tensor("q", q, dtypes=_REFERENCE_DTYPES, ndim=4)
    b, s_q, h_q, d = q.shape
    if d < 1:
        raise ValueError(f"q's last dimension (head_dim) must be at least 1, got shape {tuple(q.shape)}")
    check.tensor("kv_cache", kv_cache, dtypes=_REFERENCE_DTYPES, ndim=4)
    if kv_cache.shape[1] < 1 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != d:
        raise ValueError(f"kv_cache must have shape (num_blocks, page_size >= 1, 1, {d}) (q's head_dim), "
                         f"got {tuple(kv_cache.shape)}")
    check.tensor("block_table", block_table, dtypes=_INDEX_DTYPES, ndim=2)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must have {b} rows (q's batch), got shape {tuple(block_table.shape)}")
    check.tensor("cache_seqlens", cache_seqlens, dtypes=_INDEX_DTYPES, ndim=1)
    check.shape("cache_seqlens", cache_seqlens, (b,), "(batch,)")
    check.same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    check.number("head_dim_v", head_dim_v, lo=1, hi=d, integer=True)
    check.number("softmax_scale", softmax_scale)
    if softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    check.flag("causal", causal)
    if cache_seqlens.is_meta or block_table.is_meta:     # (shapes only: no values)
        return
    page, num_blocks = kv_cache.shape[1], kv_cache.shape[0]
    capacity = block_table.shape[1] * page
    lens = cache_seqlens.long()
    bad_len = (lens < 0) | (lens > capacity)
    if bool(bad_len.any()):
        raise ValueError(f"cache_seqlens must be in [0, {capacity}] (block_table's {block_table.shape[1]} blocks "
                         f"x page {page})" + check.offending(cache_seqlens, bad_len))
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < ((lens + page - 1) // page)[:, None]
    bad_idx = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad_idx.any()):
        raise ValueError(f"block_table entries used by cache_seqlens must be in [0, {num_blocks}) (kv_cache's blocks)"
                         + check.offending(block_table, bad_idx))


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, head_dim_v=D_V, *, softmax_scale, causal=True):
    """fp32 torch reference (float64 where asked by passing float64 inputs). Returns (out, lse).

    q (b, s_q, h_q, d) and kv_cache (num_blocks, page, 1, d) of any floating dtype, any d and page;
    block_table (b, max_blocks) and cache_seqlens (b,) int32/int64, lengths in [0, max_blocks * page] and the
    table entries they use in [0, num_blocks); head_dim_v in [1, d]; softmax_scale > 0; any device, any strides."""
    _validate_reference(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
    b, s_q, h_q, d = q.shape
    page = kv_cache.shape[1]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h_q, s_q), float("-inf"), dtype=acc_dtype, device=q.device)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    for i in range(b):
        n = int(cache_seqlens[i])
        if n == 0:
            continue
        nblk = -(-n // page)
        pages = block_table[i, :nblk].long()
        idx = (pages[:, None] * page + torch.arange(page, device=q.device)[None, :]).reshape(-1)[:n]
        kv = flat[idx].to(acc_dtype)                                     # [n, 576]
        qi = q[i].to(acc_dtype).reshape(s_q * h_q, d)                    # [s_q*h_q, 576]
        scores = (qi @ kv.T) * softmax_scale                             # [s_q*h_q, n]
        if causal:
            qpos = torch.arange(s_q, device=q.device).repeat_interleave(h_q)
            limit = n - s_q + qpos + 1
            scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= limit[:, None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)                        # -inf for fully masked rows
        p = torch.exp(scores - row_lse[:, None]).nan_to_num(0.0)
        out[i] = (p @ kv[:, :head_dim_v]).reshape(s_q, h_q, head_dim_v)
        lse[i] = row_lse.reshape(s_q, h_q).T
    return out, lse


# ---- the public op -------------------------------------------------------------------------------------

def _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_format):
    check.tensor("q", q, dtypes=DTYPES, ndim=4, contiguous=True)
    b, s_q, h_q, d = q.shape
    if d != D_QK:
        raise ValueError(f"q's last dimension must be {D_QK} (512 latent + 64 rope), got {d}")
    if not 1 <= h_q <= MAX_HEADS:
        raise ValueError(f"q's head count h_q must be in [1, {MAX_HEADS}], got {h_q}")
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"q's s_q must be in [1, {MAX_S_Q}], got {s_q}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "fp8":
        if q.dtype != torch.bfloat16:
            raise TypeError(f"with kv_format='fp8', q must be bf16 (the cache's rope part is bf16), got {q.dtype}")
        check.tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4, contiguous=True)
        width = FP8_TOKEN_BYTES
    else:
        check.tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=4, contiguous=True)
        width = D_QK
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != width:
        raise ValueError(f"kv_cache ({kv_format}) must have shape (num_blocks, page_size, 1, {width}), "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.shape[1] not in PAGE_SIZES:
        raise ValueError(f"kv_cache's page size must be one of {PAGE_SIZES}, got {kv_cache.shape[1]}")
    if kv_cache.device.type == "cuda":
        check.aligned("kv_cache", kv_cache, 16, "its pages are loaded by TMA")
    check.tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, contiguous=True)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must have {b} rows (q's batch), got shape {tuple(block_table.shape)}")
    check.tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1, contiguous=True)
    check.shape("cache_seqlens", cache_seqlens, (b,), "(batch,)")
    check.same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    if head_dim_v != D_V:
        raise ValueError(f"head_dim_v must be {D_V}, got {head_dim_v}")
    check.number("softmax_scale", softmax_scale, lo=1e-12)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def _validate_values(kv_cache, block_table, cache_seqlens):
    """Checks that read tensor values (one device sync; see ops/_values.py)."""
    if not _values.enabled(block_table):
        return
    page, num_blocks = kv_cache.shape[1], kv_cache.shape[0]
    capacity = block_table.shape[1] * page
    lens = cache_seqlens.long()
    needed = (lens + page - 1) // page                                          # [b]
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < needed[:, None]
    bad_len = ((lens < 0) | (lens > capacity)).any()
    bad_idx = (used & ((block_table < 0) | (block_table >= num_blocks))).any()
    bad_len, bad_idx = bool(bad_len), bool(bad_idx)
    if bad_len:
        raise ValueError(f"cache_seqlens must be in [0, {capacity}] (block_table's {block_table.shape[1]} blocks "
                         f"x page {page}), got values {cache_seqlens.min().item()}..{cache_seqlens.max().item()}")
    if bad_idx:
        raise ValueError(f"block_table entries used by cache_seqlens must be in [0, {num_blocks}) (kv_cache's blocks)"
                         + check.offending(block_table, used & ((block_table < 0) | (block_table >= num_blocks))))


def pick_tiling(rows: int, kv_format: str = "bf16", target: str = "cuda:sm_90a", page: int = 64) -> dict:
    """Per-step tokens and staging depth. bf16: on sm_90a 64-token steps, 2 deep (measured best on H200;
    32 x 4 paid twice the per-step softmax overhead, see bench/NOTES.md), elsewhere with 128 threads
    (with 256 the tiles do not fit sm_100a's shared memory); on sm_90a a step is at most a page
    (TileLang 0.1.15 cannot TMA a page into part of a swizzled tile). On sm_90a with pages of 64+
    tokens and few query rows (s_q * h_q <= 32) the operands are swapped: the heads are WGMMA's N, not
    padded to 64 rows (bench/NOTES.md "MLA v9"); the FP8 cache then stages its raw bytes in 32-token
    chunks that the producer and WG1 convert, and its bf16 rope goes by TMA straight into the operand
    tile (rope_direct: 3-4% faster on the H200, "MLA v10"); up to 16 rows the FP8 cache goes to
    ops.mla_decode_fp8_rs instead (REGISTER_FP8: the e4m3 latent converted exactly to fp16 straight into
    WGMMA's register operand, the scales folded into the scores and P, two MMA warpgroups a CTA on alternate
    steps, "Session 38"; the same step two CTAs an SM is provider tilecraft-fp8-rs, "Session 36"), at 17-32
    rows to ops.mla_decode_fp8_rows64 (ROWS64_FP8: its 32-row tile, 1.02-1.16x the swapped kernel that converts
    to bf16 operand tiles, "Session 56"). Otherwise fp8: the raw bytes and the bf16 operand tiles must both
    fit in shared memory: on sm_90a 32-token steps, 2 converted + 3 raw (the producer warpgroup converts); on
    sm_100a 64-token steps one stage deep, 128 threads. The bf16 cache at 128+ rows (a multiple of 64) on sm_90a
    with pages of 64+ tokens: the persistent seesaw with lazy rescaling (H100: 0.92-0.96x FlashMLA where the
    two-warpgroup schedule was 0.86-0.95x, bench/NOTES.md "Session 73" and "Session 74"). The bf16 cache in the
    default operand order on sm_90a with pages of 64+ tokens stages its output through the query tiles (stage_out;
    H100, session 79: at h_q 128 0.995 / 0.944 / 0.971x FlashMLA where the direct stores were 0.968 / 0.918 /
    0.946x, 1.3% faster at h_q 64).
    On ascend:950 (codegen/lowering/ascend_attention.py) 64-token steps, 32 with the FP8 cache (the vector
    cores' UB)."""
    if targets.get(target).vendor == "ascend":
        # ascend:950 (generated Ascend C, never run): 64-token steps for the bf16 cache; the FP8 cache's raw
        # step, its converted K halves and V^T halves fit the vector cores' UB at 32 tokens (64 need 227 KB of
        # the 152 KB that TileLang's schedule leaves them)
        return dict(block_n=32, stages=2, threads=128, kv_format="fp8") if kv_format == "fp8" else \
            dict(block_n=BLOCK_N, stages=2, threads=128)
    sm90 = targets.get(target).name == "cuda:sm_90a"
    most = SWAPPED_TILES["fp8-rope-direct" if kv_format == "fp8" else "bf16"][-1]
    swapped = sm90 and page >= BLOCK_N and rows <= most
    if kv_format == "fp8" and swapped and rows <= REGISTER_FP8_ROWS:
        return dict(REGISTER_FP8)
    if kv_format == "fp8" and sm90 and rows <= ROWS64_FP8 and page >= BLOCK_N:
        return dict(kv_format="fp8", rows64=True)
    if kv_format != "fp8":
        if not sm90:
            # the generic loop with 256 threads needs 233,472 bytes of shared memory on sm_100a (the
            # row reductions' workspaces included), over its 227 KB (codegen.jit.check_shared_memory)
            return dict(block_n=BLOCK_N, stages=2, threads=128)
        if sm90 and page >= BLOCK_N and rows >= 2 * BLOCK_M and rows % BLOCK_M == 0:
            # 128+ rows (h_q = 128: compute-bound): the persistent seesaw with lazy rescaling (the docstring's
            # numbers; the same distance from an fp64 reference within 0.4%, bench/NOTES.md "Session 74")
            return dict(block_n=BLOCK_N, stages=2, seesaw=True, persistent=True, lazy=8.0, merge=False,
                        stage_out=True)
        # the output through the query tiles (stage_out) where the operands are not swapped, with pages of 64+
        # tokens (measured there: bench/NOTES.md "Session 79", 1.3% at h_q 64 on an H100)
        staged = {"stage_out": True} if page >= BLOCK_N and not swapped else {}
        return dict(block_n=min(BLOCK_N, page), stages=2, **({"swapped": True} if swapped else staged))
    if swapped:   # the fold where it fits (16 rows), else e4m3 -> bf16 in the converters (32 rows)
        fold = rows <= SWAPPED_TILES["fp8-fold"][-1]
        return dict(block_n=BLOCK_N, stages=2, raw_stages=2, kv_format="fp8", swapped=True, rope_direct=True,
                    **({"fold_scales": True} if fold else {}))
    if sm90:
        return dict(block_n=32, stages=2, raw_stages=3, kv_format="fp8")
    # sm_100a (compiled, never run): TileLang 0.1.15's tcgen05 MMA takes no 32-token step ("TCGEN05
    # meta not initialized"), and 64-token steps fit its shared memory only one stage deep
    return dict(block_n=BLOCK_N, stages=1, threads=128, kv_format="fp8")


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _persistent_parts(q, m_tiles):
    """Parts of persistent CTAs (m_tiles CTAs each) that run at once: one CTA an SM."""
    return _sm_count(q.device) // m_tiles


def _mla_decode_impl(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, sched, tiling=None,
                     kv_format="bf16", combine_lanes=None):
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    out = torch.empty(b, s_q, h_q, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    target = targets.resolve(q, kv_cache)
    page = kv_cache.shape[1]
    if sched is None:
        sched = get_mla_schedule(cache_seqlens, s_q, h_q, block_table.shape[1] * page // BLOCK_N,
                                 kv_format=kv_format)
    sched.check(b, rows)
    rows_pad = -(-rows // BLOCK_M) * BLOCK_M
    dtype = DTYPES[q.dtype]
    tiling = tiling or pick_tiling(rows, kv_format, target, page)
    # the splits' partials (the persistent kernel's merged pieces have their own, below)
    merged = bool(tiling.get("persistent") and tiling.get("merge", True))
    slots = b * sched.max_splits if sched.max_splits > 1 and not merged else 1
    o_part = torch.empty(slots, rows_pad, D_V, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(slots, rows_pad, dtype=torch.float32, device=q.device)
    if tiling.get("register_fp8"):   # sm_90a, FP8 cache, <= 16 rows: ops.mla_decode_fp8_rs
        from ops.mla_decode_fp8_rs import mla_decode_fp8_rs2_program, mla_decode_fp8_rs_program

        opts = {k: v for k, v in tiling.items() if k not in ("register_fp8", "kv_format", "chains")}
        program = mla_decode_fp8_rs2_program if tiling.get("chains", 1) == 2 else mla_decode_fp8_rs_program
        main = program.compile(target, h_q=h_q, s_q=s_q, page=page, dtype=dtype, causal=causal, **opts)
    elif tiling.get("rows64"):       # sm_90a, FP8 cache, rows as WGMMA's N: ops.mla_decode_fp8_rows64 (17-32 rows)
        from ops.mla_decode_fp8_rows64 import mla_decode_fp8_rows64_program

        opts = {k: v for k, v in tiling.items() if k not in ("rows64", "kv_format")}
        main = mla_decode_fp8_rows64_program.compile(target, h_q=h_q, s_q=s_q, page=page, dtype=dtype, causal=causal,
                                                     **opts)
    else:
        main = mla_decode_program.compile(target, h_q=h_q, s_q=s_q, page=page, dtype=dtype, causal=causal, **tiling)
    kv = kv_cache.view(kv_cache.shape[0], page, kv_cache.shape[-1])
    q = check.aligned_copy(q)           # (read 16 bytes a thread: a view that does not start aligned is copied)
    if kv_format == "fp8":
        kv = kv.view(torch.float8_e4m3fn)
    # the same bytes as 32-bit floats (FP8 scales) and as 16-bit values (FP8 rope; bf16 cache as is)
    kv_f32, kv_16 = kv.view(torch.float32), kv.view(q.dtype)
    units = ()
    if tiling.get("register_fp8") and tiling.get("chains", 1) == 2:     # the pace's two counters
        units = (arrival_counters(q.device, 2),)
    if tiling.get("persistent"):
        m_tiles = rows_pad // BLOCK_M
        pieces, part_start = sched.persistent_pieces(_persistent_parts(q, m_tiles), cut=merged)
        if merged:    # merged in the kernel (no combine): the cut deal's slots are its list entries
            n = max(pieces.shape[0], b * sched.max_splits)
            o_part = torch.empty(n, rows_pad, D_V, dtype=torch.float32, device=q.device)
            lse_part = torch.empty(n, rows_pad, dtype=torch.float32, device=q.device)
        units = (pieces, part_start, arrival_counters(q.device, b * m_tiles * 2))
    main.launcher()(q.view(b, rows, D_QK), kv, kv_f32, kv_16, block_table, cache_seqlens,
                    sched.splits, out.view(b, rows, D_V), lse, o_part, lse_part, *units, sched.max_splits,
                    float(softmax_scale * LOG2E))
    if sched.max_splits > 1 and not merged:
        if combine_lanes is None:
            wide = COMBINE_WIDE and sched.max_splits > COMBINE_AHEAD and not sched.batch_invariant
            combine_lanes = combine_lanes_for(sched.max_splits) if wide else 0
        combine = mla_combine_program.compile(target, h_q=h_q, s_q=s_q, dtype=dtype,
                                              **({"lanes": combine_lanes} if combine_lanes else {}))
        combine.launcher()(sched.splits, o_part, lse_part, out.view(b, rows, D_V), lse, sched.max_splits)
    return out, lse


@torch.library.custom_op("tilecraft::mla_decode", mutates_args=())
def _mla_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   softmax_scale: float, causal: bool, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _mla_decode_impl(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, None, kv_format=kv_format)


@_mla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, kv_format):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, D_V), q.new_empty(b, h_q, s_q, dtype=torch.float32)


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=D_V, *, softmax_scale, causal=True,
               kv_format="bf16", sched=None):
    """MLA decode attention over a paged latent cache. Returns (out, lse).

    q (b, s_q, h_q, 576) bf16/fp16; kv_cache (num_blocks, page, 1, 576) in q's dtype, page in
    {16, 32, 64, 128, 256}; or with kv_format="fp8" (bf16 q) (num_blocks, page, 1, 656) uint8 written
    by quantize_mla_kv_fp8 and dequantized inside the kernel: to bf16 before the MMAs, or, on sm_90a
    with s_q * h_q <= 32 (ROWS64_FP8) and pages of 64+, exactly to fp16 with the per-128 scales folded
    into the scores and P (the latent q is then rounded to fp16: |q| above 65504 gives inf/NaN, not a
    silent error);
    block_table (b, max_blocks) int32; cache_seqlens (b,) int32 (0 allowed).
    With causal, query token i sees the cache up to cache_seqlens - s_q + i + 1.
    out (b, s_q, h_q, 512) in q's dtype; lse (b, h_q, s_q) fp32 (natural log; -inf for rows that
    see nothing, whose output is 0). `sched` = get_mla_schedule(..., kv_format=kv_format) computed once per step.
    On CPU tensors this runs the fp32 torch reference (slow, for running models anywhere).
    """
    _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_format)
    _validate_values(kv_cache, block_table, cache_seqlens)
    if sched is not None and not isinstance(sched, MlaSchedule):
        raise TypeError(f"sched must be an MlaSchedule from get_mla_schedule (or None), got {type(sched).__name__}")
    if q.device.type == "cpu":
        targets.resolve(q)      # (TILECRAFT_TARGET naming another device is an error here too)
        cache = dequantize_mla_kv_fp8(kv_cache) if kv_format == "fp8" else kv_cache
        out, lse = mla_decode_reference(q, cache, block_table, cache_seqlens, head_dim_v,
                                        softmax_scale=softmax_scale, causal=causal)
        return out.to(q.dtype), lse.float()
    if sched is not None:
        return _mla_decode_impl(q, kv_cache, block_table, cache_seqlens, float(softmax_scale), causal, sched,
                                kv_format=kv_format)
    return _dispatch.call(_mla_decode_op, lambda *a: _mla_decode_impl(*a[:6], None, kv_format=a[6]), q, kv_cache,
                          block_table, cache_seqlens, float(softmax_scale), causal, kv_format)


# ---- the FP8 cache ------------------------------------------------------------------------------------

def quantize_mla_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """bf16 latent cache (..., 576) -> FlashMLA's FP8 token layout (..., 656) uint8.

    Per token: 512 e4m3 latent values | 4 fp32 scales, one per 128 values (amax / 448) | the 64
    rope values kept in bf16. Works on any device (torch ops); write new tokens with it.
    """
    check.tensor("kv", kv, dtypes=(torch.bfloat16,), contiguous=True)
    if kv.dim() == 0 or kv.shape[-1] != D_QK:
        raise ValueError(f"kv's last dimension must be {D_QK}, got {tuple(kv.shape)}")
    lead = kv.shape[:-1]
    latent = kv[..., :D_V].float().reshape(*lead, 4, 128)
    scale = latent.abs().amax(-1, keepdim=True) / FP8_MAX                        # [..., 4, 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (latent / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(*lead, D_V)
    out = torch.empty(*lead, FP8_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    out[..., :D_V] = q8.view(torch.uint8)
    out[..., D_V:D_V + 16] = scale.reshape(*lead, 4).contiguous().view(torch.uint8)
    out[..., D_V + 16:] = kv[..., D_V:].contiguous().view(torch.uint8)
    return out


def dequantize_mla_kv_fp8(cache: torch.Tensor) -> torch.Tensor:
    """FP8 token layout (..., 656) uint8 -> (..., 576) float32, exactly (fp8 * scale, rope as is)."""
    check.tensor("cache", cache, dtypes=(torch.uint8,), contiguous=True)
    if cache.dim() == 0 or cache.shape[-1] != FP8_TOKEN_BYTES:
        raise ValueError(f"cache's last dimension must be {FP8_TOKEN_BYTES}, got {tuple(cache.shape)}")
    lead = cache.shape[:-1]
    q8 = cache[..., :D_V].contiguous().view(torch.float8_e4m3fn).float().reshape(*lead, 4, 128)
    scale = cache[..., D_V:D_V + 16].contiguous().view(torch.float32).reshape(*lead, 4, 1)
    rope = cache[..., D_V + 16:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q8 * scale).reshape(*lead, D_V), rope], dim=-1)
