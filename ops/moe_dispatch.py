"""MoE dispatch and combine on one device: move each token to its experts, bring results back.

dispatch: rows grouped by expert, in token order within an expert (stable, deterministic), either
  "contiguous": (M, H) with each expert's segment padded to `align` rows and m_indices (M,) giving
              each row's expert, -1 for padding rows (DeepGEMM's m-grouped contiguous layout), or
  "masked":     (E, max_m, H) with masked_m (E,) valid rows per expert (DeepGEMM's masked layout).
  Padding rows are zeros. The row bookkeeping is two tile programs (moe_plan_count: one block
  counts each expert and its aligned offset; moe_plan_place: one block per expert compacts its
  assignments in token order), bitwise _plan_reference (the torch sort it replaced); the data moves
  in moe_scatter_rows: one block per token reads its row once and writes it to its k rows, extra
  blocks zero the padding rows (raw bits: bf16 or fp8 alike).
combine: out[t] = sum_j weights[t, j] * y[row of (t, j)], j in order, accumulated in fp32: the
  same summation order whatever else is in the batch (batch-invariant, deterministic).

Expert parallelism (group=ProcessGroup of W ranks): rank r owns experts [r*E/W, (r+1)*E/W).
  dispatch: every (token, choice) is sent once to the rank owning its expert (one row per choice, not
    one per destination rank: k rows per token cross the fabric, but each returns as its own row, so
    combine can sum in the single-device order). A rank's tokens are cut into C = EP_CHUNKS token
    ranges; its send order is (chunk, global expert, token): the single-device plan kernels on the key
    chunk*E + expert, so each chunk is grouped by destination rank and, inside, by local expert. One
    (C*E + 8,) int32 header per rank goes first with all_gather_into_tensor (the count kernel's rows
    per (chunk, global expert), then an error flag, row sizes and the ids' range) and is read on the
    host (the one sync). From it each receiver knows its whole layout before any row arrives: expert
    e's rows are, in the single-device order, rank 0's chunks 0..C-1, then rank 1's...; so every
    received row's output row follows from two small host tables (per segment, per expert), which one
    kernel (moe_ep_layout) expands on the device: no ids exchange. Then, per chunk, the send rows are
    scattered from x (token-major: each token read once), exchanged with all_to_all_single on raw bytes (uint8 views:
    any dtype, NCCL or gloo; fp8 scales as a second exchange), issued async on CUDA (the process
    group's stream), and placed into the final layout as soon as they arrive, while the next chunk
    transfers. The result is exactly the slice of the single-device layout for the local experts
    (rows in global token order inside each expert, the same padding, zeros included).
  combine: per chunk, this rank's expert rows are gathered in their arrival order and go back to their
    tokens' ranks (all_to_all_single, async on CUDA); as chunk c returns, its tokens (exactly the rows
    of chunk c) run the single-device combine kernel: same values, same order, same fp32 accumulation,
    so the output is bitwise the single-device result on the concatenated tokens.
  Every rank runs the same collectives in the same order (C chunk exchanges even when they are
  empty), so uneven loads, empty ranks and empty experts cannot deadlock.
  The EP path reads the header on the host (split sizes), so it is eager only: no CUDA-graph capture,
  no torch.compile. This module sets no NCCL environment; launchers should keep NCCL_NVLS_ENABLE=0.
  Future work: send a token once per destination rank (DeepEP-style) and return per-choice rows;
  dispatch to EPLB replicas (ops.eplb_plan) by choosing a physical slot per (token, choice).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import time
from dataclasses import dataclass

import numpy as np

import tilelang.language as T
import torch
import torch.distributed as dist

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import _validate as check
from ops._workspace import int32_views

LAYOUTS = ("contiguous", "masked")
EP_CHUNKS = 4        # row exchanges per EP dispatch/combine (token ranges); must be the same on every rank
_EP_TRACE = None     # bench hook (bench/suites/moe.py): a list collecting (phase, CUDA event or wall time)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
BITS_NAME = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
Y_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class MoeMapping:
    """What the grouped GEMMs and moe_combine need to know about a dispatch."""

    layout: str
    num_experts: int
    top_k: int
    positions: torch.Tensor          # (T, k) int32: output row of each (token, choice)
    counts: torch.Tensor             # (E,) int32: tokens routed to each expert
    m_indices: torch.Tensor | None   # contiguous: (M,) int32 expert of each row, -1 for padding
    masked_m: torch.Tensor | None    # masked: (E,) int32 valid rows per expert (= counts)
    max_m: int | None                # masked: rows per expert in the output
    ep: "EpMapping | None" = None    # expert parallel: the fields above describe the rows this rank
                                     # received, over its local experts (top_k 1, positions (N_recv, 1))

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank: the rows moe_combine returns."""
        return (self.ep.send_positions if self.ep is not None else self.positions).shape[0]


@dataclass
class EpMapping:
    """Where this rank's (token, choice) rows went in an expert-parallel dispatch, for moe_combine."""

    group: object                    # the torch.distributed ProcessGroup
    world_size: int
    rank: int
    num_experts: int                 # global E; this rank owns [rank * E/W, (rank + 1) * E/W)
    send_splits: list                # rows sent to each rank (combine receives as many back)
    recv_splits: list                # rows received from each rank (combine sends them back)
    send_positions: torch.Tensor     # (T, k) int32: row of each (token, choice) in the send buffer
    chunks: int = 1                  # row exchanges per dispatch/combine (EP_CHUNKS when dispatched)
    token_bounds: list | None = None         # (C+1,): chunk c is this rank's tokens [b[c], b[c+1])
    send_chunk_splits: list | None = None    # [C][W] rows sent to each rank in chunk c
    recv_chunk_splits: list | None = None    # [C][W] rows received from each rank in chunk c
    recv_bounds: list | None = None          # (C+1,): chunk c's rows in the receive order

    @property
    def local_experts(self) -> range:
        n = self.num_experts // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)


# Ascend: rows move as 32-bit words (row_words): its SIMT vector code has no 8- or 16-bit vector types
@tile_program("moe_gather_rows", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"h7168-bf16": dict(hidden=7168, bits="int16")})
def gather_rows_program(hidden: int, bits: str = "int16", threads: int = 128):
    """Y[r, :] = X[src[r], :] (zeros where src[r] < 0): a row gather on raw bits."""
    rows, tokens = T.dynamic("rows, tokens")

    @T.prim_func
    def gather_rows(X: T.Tensor((tokens, hidden), bits), Src: T.Tensor((rows,), "int32"),
                    Y: T.Tensor((rows, hidden), bits)):
        with tile.grid(rows, threads) as r:
            with tile.vector():
                for j in tile.parallel(hidden):
                    src = Src[r]
                    Y[r, j] = T.if_then_else(src >= 0, X[T.max(src, 0), j], T.cast(0, bits))

    return gather_rows


def _plan_configs(t, p):
    # the block scans (tl::CumSum1D) read threadIdx: no producer warps may shift it (see topk_select)
    return {"tl.disable_warp_specialized": True} if t.name.startswith("cuda") else {}


@tile_program("moe_plan_count", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"e256": dict(num_experts=256)}, pass_configs=_plan_configs)
def plan_count_program(num_experts: int, threads: int = 1024, per_thread: int = 32):
    """One block: Counts[e] = assignments to e, Offsets[e] = sum of align-padded counts below e,
    Stats = (padded total, busiest expert's count, out-of-range ids, 0). Out-of-range ids count
    toward the clamped expert, so the place kernel (which clamps too) never writes out of bounds."""
    n = T.dynamic("n")
    E = num_experts
    EP = -(-E // threads) * threads
    CH = threads * per_thread

    @T.prim_func
    def plan_count(Ids: T.Tensor((n,), "int32"), Counts: T.Tensor((E,), "int32"),
                   Offsets: T.Tensor((E + 1,), "int32"), Stats: T.Tensor((4,), "int32"), align: T.int32):
        with tile.grid(1, threads) as _b:
            with tile.vector():
                hist = tile.stage((EP,), "int32")
                padc = tile.stage((EP,), "int32")
                scan = tile.stage((EP,), "int32")
                cnt = tile.fragment((EP,), "int32")
                mx = tile.fragment((1,), "int32")
                bad = tile.fragment((threads,), "int32")     # out-of-range ids seen by each thread
                nbad = tile.fragment((1,), "int32")
                vals = tile.fragment((threads, per_thread), "int32")
                for e in tile.parallel(EP):
                    hist[e] = 0
                for t in tile.parallel(threads):
                    bad[t] = 0
                # each thread loads its per_thread ids of a chunk into registers first, then
                # counts them: loads between shared atomics were issued one at a time (16.5 us
                # for 32768 ids on an H200)
                for c in T.serial(T.ceildiv(n, CH)):
                    for t, j in tile.parallel(threads, per_thread):
                        vals[t, j] = Ids[T.min(c * CH + j * threads + t, n - 1)]
                    for t in tile.parallel(threads):
                        for j in T.unroll(per_thread):     # unrolled: vals stays in registers
                            if c * CH + j * threads + t < n:
                                bad[t] = bad[t] + T.if_then_else(vals[t, j] < 0 or vals[t, j] >= E, 1, 0)
                                tile.atomic_add(hist[T.min(T.max(vals[t, j], 0), E - 1)], 1)
                for e in tile.parallel(EP):
                    cnt[e] = hist[e]
                    padc[e] = (hist[e] + align - 1) // align * align
                tile.cumsum(padc, scan, dim=0)
                tile.row_reduce(cnt, mx, "max", dim=0)
                tile.row_reduce(bad, nbad, "sum", dim=0)
                for e in tile.parallel(EP):
                    if e < E:
                        Counts[e] = hist[e]
                        Offsets[e + 1] = scan[e]
                    if e == 0:
                        Offsets[0] = 0
                        Stats[0] = scan[EP - 1]
                        Stats[1] = mx[0]
                        Stats[2] = nbad[0]
                        Stats[3] = 0

    return plan_count


@tile_program("moe_plan_place", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"contiguous": dict(layout="contiguous"), "masked": dict(layout="masked")},
              pass_configs=_plan_configs)
def plan_place_program(layout: str, lanes: int = 512, seg: int = 16):
    """One block per expert e: its (token, choice) assignments in token order, compacted by one
    block scan per chunk of lanes*seg ids (each lane owns seg contiguous ids as a bit mask; 512 x 16:
    63 registers on sm_90a, two blocks an SM, so E=256 experts run in one wave).
    contiguous: rows Offsets[e] + rank, Src/MIdx -1 on the padding rows up to Offsets[e + 1];
    masked: rows e*max_m + min(rank, max_m - 1) (the last overflowing assignment owns the last row,
    as torch's sequential index_put gives), Src -1 past the expert's rows."""
    n, experts, offs, rows, max_m = T.dynamic("n, experts, offs, rows, max_m")
    chunk = lanes * seg

    @T.macro
    def match_chunk(Ids, c, e, row, part, scan, mask, pos):
        # mask[t]: which of lane t's seg ids in chunk c are expert e; scan: inclusive counts by lane
        for i in tile.parallel(chunk):
            g = c * chunk + i
            row[i] = T.if_then_else(g < n, T.min(T.max(Ids[T.min(g, n - 1)], 0), experts - 1), -1)
        for t in tile.parallel(lanes):
            mask[t] = T.uint32(0)
            pos[t] = 0
            for j in T.serial(seg):
                jj = (j + t) % seg      # rotated: the lanes of a warp read different banks
                hit = row[t * seg + jj] == e
                mask[t] = mask[t] | T.if_then_else(hit, T.uint32(1) << T.cast(jj, "uint32"), T.uint32(0))
                pos[t] = pos[t] + T.if_then_else(hit, 1, 0)
            part[t] = pos[t]
        tile.cumsum(part, scan, dim=0)

    if layout == "contiguous":
        @T.prim_func
        def plan_place(Ids: T.Tensor((n,), "int32"), Counts: T.Tensor((experts,), "int32"),
                       Offsets: T.Tensor((offs,), "int32"), Pos: T.Tensor((n,), "int32"),
                       Src: T.Tensor((rows,), "int32"), MIdx: T.Tensor((rows,), "int32"), k: T.int32):
            with tile.grid(experts, lanes) as e:
                with tile.vector():
                    row = tile.stage((chunk,), "int32")
                    part = tile.stage((lanes,), "int32")
                    scan = tile.stage((lanes,), "int32")
                    mask = tile.fragment((lanes,), "uint32")
                    pos = tile.fragment((lanes,), "int32")
                    base = T.alloc_var("int32")
                    start = T.alloc_var("int32")
                    first = T.alloc_var("int32")
                    end = T.alloc_var("int32")
                    base = 0
                    start = Offsets[e]
                    for c in T.serial(T.ceildiv(n, chunk)):
                        match_chunk(Ids, c, e, row, part, scan, mask, pos)
                        for t in tile.parallel(lanes):
                            if mask[t] != T.uint32(0):
                                pos[t] = start + base + scan[t] - part[t]
                                for j in T.serial(seg):
                                    if (mask[t] >> T.cast(j, "uint32")) & T.uint32(1) == T.uint32(1):
                                        Pos[c * chunk + t * seg + j] = pos[t]
                                        Src[pos[t]] = (c * chunk + t * seg + j) // k
                                        MIdx[pos[t]] = e
                                        pos[t] = pos[t] + 1
                        base = base + scan[lanes - 1]
                    first = start + base
                    end = Offsets[e + 1]
                    for p in T.serial(T.ceildiv(end - first, lanes)):
                        for t in tile.parallel(lanes):
                            if first + p * lanes + t < end:
                                Src[first + p * lanes + t] = -1
                                MIdx[first + p * lanes + t] = -1
    elif layout == "masked":
        @T.prim_func
        def plan_place(Ids: T.Tensor((n,), "int32"), Counts: T.Tensor((experts,), "int32"),
                       Pos: T.Tensor((n,), "int32"), Src: T.Tensor((experts, max_m), "int32"), k: T.int32):
            with tile.grid(experts, lanes) as e:
                with tile.vector():
                    row = tile.stage((chunk,), "int32")
                    part = tile.stage((lanes,), "int32")
                    scan = tile.stage((lanes,), "int32")
                    mask = tile.fragment((lanes,), "uint32")
                    pos = tile.fragment((lanes,), "int32")
                    base = T.alloc_var("int32")
                    last = T.alloc_var("int32")
                    first = T.alloc_var("int32")
                    base = 0
                    last = Counts[e] - 1
                    for c in T.serial(T.ceildiv(n, chunk)):
                        match_chunk(Ids, c, e, row, part, scan, mask, pos)
                        for t in tile.parallel(lanes):
                            if mask[t] != T.uint32(0):
                                pos[t] = base + scan[t] - part[t]
                                for j in T.serial(seg):
                                    if (mask[t] >> T.cast(j, "uint32")) & T.uint32(1) == T.uint32(1):
                                        Pos[c * chunk + t * seg + j] = e * max_m + T.min(pos[t], max_m - 1)
                                        if pos[t] < max_m - 1 or pos[t] == last:
                                            Src[e, T.min(pos[t], max_m - 1)] = (c * chunk + t * seg + j) // k
                                        pos[t] = pos[t] + 1
                        base = base + scan[lanes - 1]
                    first = T.min(base, max_m)
                    for p in T.serial(T.ceildiv(max_m - first, lanes)):
                        for t in tile.parallel(lanes):
                            if first + p * lanes + t < max_m:
                                Src[e, first + p * lanes + t] = -1
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return plan_place


@tile_program("moe_scatter_rows", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"h7168-bf16": dict(hidden=7168, bits="int16"),
                        "h7168-bf16-sorted": dict(hidden=7168, bits="int16", pad=False)})
def scatter_rows_program(hidden: int, bits: str = "int16", pad: bool = True, threads: int = 128,
                         zero_rows: int = 8, live: bool = False):
    """Y[Pos[t, j], :] = X[t, :] for every choice j (each token's row read once), and with pad,
    Y[r, :] = 0 where Src[r] < 0 (blocks past the tokens, zero_rows rows each). live=True adds an
    input Live (1,) int32: only rows below Live[0] are live (Y and Src are sized by a bound; the
    plan's row count stays on the device, so the host reads it after this kernel is queued)."""
    tokens, k, rows = T.dynamic("tokens, k, rows")
    extra = T.ceildiv(rows, zero_rows) if pad else 0

    @T.macro
    def scatter(X, Pos, Src, Y, b, live_rows):
        # block b: token b's row to its k rows, or (past the tokens) zero_rows padding rows
        with tile.vector():
            buf = tile.fragment((hidden,), bits)
            if b < tokens:
                for c in tile.parallel(hidden):
                    buf[c] = X[b, c]
                for j in T.serial(k):
                    for c in tile.parallel(hidden):
                        Y[Pos[b, j], c] = buf[c]
            else:
                for i in T.serial(zero_rows):
                    if (b - tokens) * zero_rows + i < live_rows:
                        if Src[(b - tokens) * zero_rows + i] < 0:
                            for c in tile.parallel(hidden):
                                Y[(b - tokens) * zero_rows + i, c] = T.cast(0, bits)

    if live:
        @T.prim_func
        def scatter_rows(X: T.Tensor((tokens, hidden), bits), Pos: T.Tensor((tokens, k), "int32"),
                         Src: T.Tensor((rows,), "int32"), Y: T.Tensor((rows, hidden), bits),
                         Live: T.Tensor((1,), "int32")):
            with tile.grid(tokens + extra, threads) as b:
                scatter(X, Pos, Src, Y, b, T.min(rows, Live[0]))     # Live is read on the device
    else:
        @T.prim_func
        def scatter_rows(X: T.Tensor((tokens, hidden), bits), Pos: T.Tensor((tokens, k), "int32"),
                         Src: T.Tensor((rows,), "int32"), Y: T.Tensor((rows, hidden), bits)):
            with tile.grid(tokens + extra, threads) as b:
                scatter(X, Pos, Src, Y, b, rows)

    return scatter_rows


@tile_program("moe_ep_layout", targets=("cuda:sm_90a", "cuda:sm_100a", "cpu"), examples={"default": {}})
def ep_layout_program(threads: int = 256):
    """An EP receiver's layout from two small host tables (one block per segment or expert):
    Pos[Seg[s,0] + j] = Seg[s,2] + min(Seg[s,3] + j, cap) for j < Seg[s,1] (segment s: the rows one
    source rank sent from one chunk to one local expert: receive start, length, the expert's first
    output row, the segment's first index inside its expert); Rows[Exp[e,0] + j] = Exp[e,3] if
    j < Exp[e,1] else -1 for j < Exp[e,2] (contiguous: m_indices; masked: 0 / -1 row validity)."""
    nseg, el, n, rows = T.dynamic("nseg, el, n, rows")

    @T.prim_func
    def ep_layout(Seg: T.Tensor((nseg, 4), "int32"), Exp: T.Tensor((el, 4), "int32"), cap: T.int32,
                  Pos: T.Tensor((n,), "int32"), Rows: T.Tensor((rows,), "int32")):
        with tile.grid(nseg + el, threads) as b:
            with tile.vector():
                if b < nseg:
                    for p in T.serial(T.ceildiv(Seg[b, 1], threads)):
                        for t in tile.parallel(threads):
                            if p * threads + t < Seg[b, 1]:
                                Pos[Seg[b, 0] + p * threads + t] = Seg[b, 2] + T.min(Seg[b, 3] + p * threads + t, cap)
                else:
                    for p in T.serial(T.ceildiv(Exp[b - nseg, 2], threads)):
                        for t in tile.parallel(threads):
                            if p * threads + t < Exp[b - nseg, 2]:
                                Rows[Exp[b - nseg, 0] + p * threads + t] = T.if_then_else(
                                    p * threads + t < Exp[b - nseg, 1], Exp[b - nseg, 3], -1)

    return ep_layout


@tile_program("moe_combine", examples={"h7168-k8": dict(hidden=7168, top_k=8)})
def combine_program(hidden: int, top_k: int, dtype: str = "bfloat16", threads: int = 128):
    """Out[t, :] = sum_j W[t, j] * Y[Pos[t, j], :], j in order, in fp32."""
    rows, tokens = T.dynamic("rows, tokens")
    sdt = tile.storage_dtype(dtype)

    @T.prim_func
    def combine(Y: T.Tensor((rows, hidden), sdt), Pos: T.Tensor((tokens, top_k), "int32"),
                W: T.Tensor((tokens, top_k), "float32"), Out: T.Tensor((tokens, hidden), sdt)):
        with tile.grid(tokens, threads) as t:
            with tile.vector():
                acc = tile.fragment((hidden,))
                for c in tile.parallel(hidden):
                    acc[c] = 0.0
                for j in T.serial(top_k):
                    for c in tile.parallel(hidden):
                        acc[c] += W[t, j] * tile.to_f32(Y[T.max(Pos[t, j], 0), c], dtype)
                for c in tile.parallel(hidden):
                    Out[t, c] = tile.from_f32(acc[c], dtype)

    return combine


def _scatter_rows(x: torch.Tensor, positions: torch.Tensor, src: torch.Tensor, rows: int, pad: bool,
                  live: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, H): x[t] to rows positions[t, :] (each token read once); with pad, zeros where src < 0.
    live (1,) int32 on the device: only rows below live[0] are written (rows is a bound)."""
    out = torch.empty(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if x.shape[0] == 0 or type(x) is not torch.Tensor:  # nothing to read: every row is padding
        return out.zero_()
    target, has_live = targets.resolve(x), live is not None
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    scatter = jit.launchers(("moe_scatter_rows", target.name, hidden, bits, pad, has_live), lambda: (
        scatter_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits], pad=pad, live=has_live).launcher()))
    scatter(xw, positions, src, out.view(bits), *(() if live is None else (live,)))
    return out


def row_words(x: torch.Tensor, target) -> torch.dtype:
    """The word the row-copy kernels move x's rows in: its element's width (bf16 and fp8 rows
    alike), or 32-bit words on Ascend, whose SIMT vector code has no 8- or 16-bit vector types
    (there a row must hold a multiple of 4 bytes)."""
    if target.vendor == "ascend":
        row_bytes = x.shape[-1] * x.element_size()
        if row_bytes % 4:
            raise ValueError(f"on {target.name} rows are copied as 32-bit words: a row of x must be a multiple of "
                             f"4 bytes, got {x.shape[-1]} x {x.dtype} = {row_bytes} bytes")
        return torch.int32
    return BITS[x.element_size()]


def _plan(ids: torch.Tensor, num_experts: int, layout: str, align: int, max_m):
    """(mapping, src, rows): _plan_queued with its host read done."""
    mapping, src, rows, pending = _plan_queued(ids, num_experts, layout, align, max_m)
    if pending is not None:
        rows = _settle(mapping, pending)
        src = src[:rows]
    return mapping, src, rows


def _settle(mapping, pending):
    """The contiguous plan's one host read (the padded row count and the value checks), then its
    bound-sized m_indices cut to the rows (in place: the mapping is this call's own). Returns rows.
    Kept short: after the read the GPU is idle until the caller's next launch."""
    read, _, ids, checking = pending
    rows = _read_stats(read, ids, mapping.num_experts, checking, None)[0]
    mapping.m_indices = mapping.m_indices[:rows]
    return rows


def _plan_queued(ids: torch.Tensor, num_experts: int, layout: str, align: int, max_m):
    """Row of every (token, choice) and the source token of every output row: two tile programs.

    moe_plan_count (one block) counts each expert's assignments and its aligned offset, and folds
    the value checks in (out-of-range ids, the busiest expert); moe_plan_place (one block per
    expert) writes the rows in token order. Same tensors as _plan_reference, bit for bit.
    Host reads: contiguous align>1 and masked without max_m read Stats once (the output's size and
    the value checks together); align=1 and masked with max_m read it only for the value checks
    (skipped with TILECRAFT_CHECK_VALUES=0 and during CUDA-graph capture), so they can be captured.
    The contiguous layout leaves its read to the caller: it returns rows = the bound T*k +
    E*(align-1) (src and m_indices have that many rows, the live ones first) and pending = (the
    queued read of Stats, the live row count on the device (1,), ids, checking) for _settle, so the
    caller can queue the row scatter first (pending is None when nothing needs reading: align=1
    with the checks off).
    """
    T_, k = ids.shape
    n = T_ * k
    if n == 0 or type(ids) is not torch.Tensor or ids.device.type == "meta":
        return (*_plan_reference(ids, num_experts, layout, align, max_m), None)
    E = num_experts
    device = ids.device
    target = targets.resolve(ids)
    flat = ids.view(-1)
    bound = n + E * (align - 1) if layout == "contiguous" else 0   # rows of src / m_indices
    # one allocation (an eager call's host time is mostly allocations and launches);
    # stats: padded rows, busiest expert, bad ids, 0
    counts, offsets, stats, positions, src, m_indices = int32_views(device, E, E + 1, 4, (T_, k), bound, bound)
    count, place = jit.launchers(("moe_plan", target.name, E, layout), lambda: (
        plan_count_program.compile(target, num_experts=E).launcher(),
        plan_place_program.compile(target, layout=layout).launcher()))
    count(flat, counts, offsets, stats, align if layout == "contiguous" else 1)
    checking = _values.enabled(ids)
    if layout == "contiguous":
        # sized by the bound T*k + E*(align-1), so the place kernel runs before the host reads;
        # the read itself is queued right behind the count kernel
        read = _queue_read(stats) if align > 1 or checking else None
        place(flat, counts, offsets, positions.view(-1), src, m_indices, k)
        mapping = MoeMapping(layout, E, k, positions, counts, m_indices=m_indices, masked_m=None, max_m=None)
        pending = (read, offsets[E:], ids, checking) if read is not None else None
        return mapping, src, bound, pending
    if max_m is None or checking:
        need = _read_stats((stats, None), ids, E, checking, max_m)[1]
        if max_m is None:
            max_m = max(align, (need + align - 1) // align * align)
    src = torch.empty(E, max_m, dtype=torch.int32, device=device)
    place(flat, counts, positions.view(-1), src, k)
    mapping = MoeMapping(layout, E, k, positions, counts, m_indices=None, masked_m=counts, max_m=int(max_m))
    return mapping, src.view(-1), E * max_m, None


def _queue_read(stats):
    """Start the host read of the plan's Stats: (tensor to read, event or None). On CUDA a copy
    into pinned memory and an event behind it, so the host waits for the count kernel only, not
    for the row scatter queued after it (the host returns while the scatter runs)."""
    if stats.device.type != "cuda":
        return stats, None
    stream = torch.cuda.current_stream(stats.device)    # the stream the copy runs on (stats' device)
    host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(stream)
    return host, ready


def _read_stats(read, ids, num_experts, checking, max_m):
    """The plan's one host read, read = _queue_read(stats) or (stats, None): (padded rows,
    busiest expert's count), raising on bad values."""
    stats, ready = read
    if ready is not None:
        ready.synchronize()
    rows, busiest, bad, _ = stats.tolist()
    if checking and bad:
        raise ValueError(f"ids must be expert ids in [0, {num_experts}), got values {int(ids.min())}..{int(ids.max())}")
    if checking and max_m is not None and busiest > max_m:
        raise ValueError(f"max_m={max_m} is smaller than the busiest expert's {busiest} tokens")
    return rows, busiest


def _plan_reference(ids: torch.Tensor, num_experts: int, layout: str, align: int, max_m):
    """The plan as a chain of torch ops (the kernels' reference; also what fake tensors and T=0 take).

    Contiguous with align=1 reads nothing on the host (the output has exactly T*k rows), so it can
    be captured in a CUDA graph; the other layouts size their output from the counts (one sync).
    """
    T_, k = ids.shape
    device = ids.device
    flat = ids.reshape(-1).long()                                          # [T*k], token-major
    expert, order = torch.sort(flat, stable=True)                          # assignments grouped by expert
    # counts from the sorted ids (torch.bincount reads its max on the host on CUDA)
    bounds = torch.searchsorted(expert, torch.arange(num_experts + 1, device=device))
    counts = bounds.diff()                                                 # [E]
    first = bounds[:-1]                                                    # start of each expert in `order`
    if layout == "contiguous" and align == 1:
        # no padding: the sorted order is the row order (row of order[i] is i)
        rows = flat.numel()
        row_of = torch.arange(rows, device=device)
        positions = torch.empty(rows, dtype=torch.long, device=device).scatter_(0, order, row_of)
        src = (order // k).to(torch.int32)
        mapping = MoeMapping(layout, num_experts, k, positions.view(T_, k).to(torch.int32), counts.to(torch.int32),
                             m_indices=expert.to(torch.int32), masked_m=None, max_m=None)
        return mapping, src, rows
    rank = torch.arange(flat.numel(), device=device) - first[expert]       # position within its expert
    if layout == "contiguous":
        padded = (counts + align - 1) // align * align
        seg = torch.cumsum(padded, 0) - padded
        rows = int(padded.sum())                                           # one sync: the output's size
        row_of = seg[expert] + rank
        m_indices = torch.full((rows,), -1, dtype=torch.int32, device=device)
        m_indices[row_of] = expert.to(torch.int32)
        extra = dict(m_indices=m_indices, masked_m=None, max_m=None)
    else:
        if max_m is None:
            need = int(counts.max()) if flat.numel() else 0                # one sync: the output's size
            max_m = max(align, (need + align - 1) // align * align)
        elif _values.enabled(ids) and flat.numel() and int(counts.max()) > max_m:
            raise ValueError(f"max_m={max_m} is smaller than the busiest expert's {int(counts.max())} tokens")
        rows = num_experts * max_m
        # rank is clamped so that an unchecked overflow (value checks off) can never write out of
        # bounds: the overflowing tokens would then share the expert's last row
        row_of = expert * max_m + rank.clamp(max=max_m - 1)
        extra = dict(m_indices=None, masked_m=counts.to(torch.int32), max_m=int(max_m))
    positions = torch.empty(flat.numel(), dtype=torch.long, device=device)
    positions[order] = row_of
    src = torch.full((rows,), -1, dtype=torch.int32, device=device)
    src[row_of] = (order // k).to(torch.int32)
    mapping = MoeMapping(layout, num_experts, k, positions.view(T_, k).to(torch.int32), counts.to(torch.int32), **extra)
    return mapping, src, rows


def _check_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, values=False):
    """Argument checks; values=True also checks the ids' range here (one sync; the EP path needs it
    before its header exchange; the local path reads it with the plan's Stats instead)."""
    check.tensor("x", x, dtypes=X_DTYPES, ndim=2, contiguous=True)
    check.tensor("ids", ids, dtypes=(torch.int32,), ndim=2, contiguous=True)
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids must have one row per token of x ({x.shape[0]}), got shape {tuple(ids.shape)}")
    check.number("num_experts", num_experts, lo=1, integer=True)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check.number("align", align, lo=1, integer=True)
    if max_m is not None:
        check.number("max_m", max_m, lo=1, integer=True)
    if x.dtype == torch.float8_e4m3fn:
        if x_scales is None:
            raise ValueError("x is fp8: x_scales (T, ceil(H/128)) fp32 must be given")
        check.tensor("x_scales", x_scales, dtypes=(torch.float32,), ndim=2, contiguous=True)
        check.shape("x_scales", x_scales, (x.shape[0], -(-x.shape[1] // 128)), "(T, ceil(H/128))")
    elif x_scales is not None:
        raise ValueError(f"x_scales is only for fp8 x; x is {x.dtype}")
    check.same_device(x=x, ids=ids, x_scales=x_scales)
    if values and _values.enabled(ids) and ids.numel() and bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError(f"ids must be expert ids in [0, {num_experts}), got values {int(ids.min())}..{int(ids.max())}")


def moe_dispatch(x, ids, num_experts, *, x_scales=None, layout="contiguous", align=128, max_m=None, group=None):
    """Send each token's hidden state to each of its experts.

    x (T, H) bf16/fp16/fp32, or fp8 e4m3 with x_scales (T, S) fp32 (per-128 scales; S = ceil(H/128));
    ids (T, k) int32 expert ids in [0, num_experts). Returns (x_dispatched, scales_dispatched or None,
    mapping): contiguous (M, H) with mapping.m_indices, or masked (E, max_m, H) with mapping.masked_m.
    Sizing the output reads the expert counts on the host (one sync), except where the size is
    known: layout="contiguous" with align=1 (exactly T*k rows, sorted by expert, m_indices has no
    -1 rows; ops.moe_tile_items turns it into the work list of m_grouped_fp8_gemm_nt_sorted) and
    layout="masked" with a fixed max_m (the capacity check is a value check, skipped during
    CUDA-graph capture). Those two read nothing on the host, so the dispatch can be captured. With the check off, an expert given more than max_m
    tokens would have its extra tokens share its last row (never an out-of-bounds write): keep
    max_m >= T when each token's experts are distinct (as moe_route's are).

    group: a torch.distributed ProcessGroup of W ranks for expert parallelism (None: one device).
    Every rank calls with its own tokens and the same num_experts (a multiple of W), layout, align.
    The result is this rank's E/W local experts' rows from every rank, in the same layout over local
    expert ids 0..E/W-1 ((M, H) + m_indices, or (E/W, max_m, H) + masked_m; max_m, when not given,
    is sized per rank); mapping.ep holds what moe_combine needs to send results back. Eager only.
    """
    if group is not None:
        return _ep_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group)
    _check_dispatch(x, ids, num_experts, x_scales, layout, align, max_m)
    return _local_dispatch(x, ids, num_experts, x_scales, layout, align, max_m)


def _local_dispatch(x, ids, num_experts, x_scales, layout, align, max_m):
    # n = T*k: rows == n means no padding rows; the contiguous layout's rows is a bound until settled
    mapping, src, rows, pending = _plan_queued(ids, num_experts, layout, align, max_m)
    if pending is None:
        pad, live = rows != mapping.positions.numel(), None
    else:
        # the rows are scattered into buffers sized by the bound, up to the count on the device;
        # the host reads it after both scatters are queued (the GPU does not wait for the host)
        pad, live = align > 1, pending[1]
    xd = _scatter_rows(x, mapping.positions, src, rows, pad, live)
    sd = _scatter_rows(x_scales, mapping.positions, src, rows, pad, live) if x_scales is not None else None
    if pending is not None:
        rows = _settle(mapping, pending)
        xd, sd = xd[:rows], (sd[:rows] if sd is not None else None)
    if layout == "masked":
        xd = xd.view(num_experts, mapping.max_m, x.shape[1])
        sd = sd.view(num_experts, mapping.max_m, -1) if sd is not None else None
    return xd, sd, mapping


def _group_size_rank(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first, or pass group=None for one device")
    try:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__} ({e})") from e
    if rank < 0:
        raise ValueError("this process is not a member of group")
    return world, rank


def _a2a(out, inp, out_splits, in_splits, group):
    """all_to_all_single of rows as raw bytes (uint8 views: any dtype crosses any backend; gloo has no
    fp8). On CUDA it is issued async on the process group's stream and the handle is returned (wait()
    makes the current stream wait); on CPU it runs now and None is returned."""
    o, i = out.view(torch.uint8), inp.view(torch.uint8)               # 2-D (rows, row bytes)
    cuda = out.device.type == "cuda"
    work = dist.all_to_all_single(o, i, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                                  group=group, async_op=cuda)
    return work if cuda else None


def _mark(name, device):
    """Bench hook: with _EP_TRACE a list, record a phase boundary (a CUDA event on the current stream,
    or the wall time on CPU). Costs nothing when off."""
    if _EP_TRACE is None:
        return
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        _EP_TRACE.append((name, ev))
    else:
        _EP_TRACE.append((name, time.perf_counter()))


def _ep_chunks():
    c = EP_CHUNKS
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"ops.moe_dispatch.EP_CHUNKS must be an int >= 1 (the same on every rank), got {c!r}")
    return c


def _token_bounds(tokens, chunks):
    """Chunk c of a rank's tokens is [c*T//C, (c+1)*T//C): some chunks are empty when T < C."""
    return [c * tokens // chunks for c in range(chunks + 1)]


def _scatter_into(y, x, positions, src, pad):
    """y[positions[t, j]] = x[t] for the rows of x (raw bits), and with pad zeros where src < 0 (src
    covers y's rows). x, positions may be row slices: the kernel reads whole rows, so a slice keeps
    the alignment of its base."""
    target = targets.resolve(x)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    scatter = jit.launchers(("moe_scatter_rows", target.name, hidden, bits, pad, False), lambda: (
        scatter_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits], pad=pad).launcher()))
    scatter(xw, positions, src, y.view(bits))


def _gather_into(y, x, src):
    """y[r] = x[src[r]] for every row of y (a row slice of a larger buffer), on raw bits."""
    target = targets.resolve(x)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    gather = jit.launchers(("moe_gather_rows", target.name, hidden, bits), lambda: (
        gather_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits]).launcher()))
    gather(xw, src, y.view(bits))


_CHUNK_BASES = {}


def _chunk_base(tokens, chunks, num_experts, device):
    """(T, 1) int32: chunk(t) * E, chunk(t) = ((t + 1) * C - 1) // T (the chunk of _token_bounds
    holding token t); kept for the last few shapes (five small ops fewer per call)."""
    key = (tokens, chunks, num_experts, device)
    base = _CHUNK_BASES.get(key)
    if base is None:
        t = torch.arange(1, tokens + 1, device=device, dtype=torch.int32)
        base = ((t * chunks - 1) // tokens * num_experts).view(tokens, 1)
        if len(_CHUNK_BASES) >= 16:
            _CHUNK_BASES.clear()
        _CHUNK_BASES[key] = base
    return base


def _ep_send_plan(ids, num_experts, chunks, counts):
    """Send order of an EP dispatch: every (token, choice) sorted by (chunk, global expert), token order
    inside, i.e. by (chunk, destination rank, local expert, token). It is the single-device plan
    (contiguous, align=1) on the key chunk(t)*E + ids[t, j] over C*E keys: chunk c's rows are exactly
    rows [c0*k, c1*k) of the send buffer. The count runs now, into `counts` (C*E,) int32 (the
    header's first part); the place step is returned, to run later (under the header exchange): it
    gives positions (T, k) int32 and the source token of every send row."""
    T_, k = ids.shape
    E, device = num_experts * chunks, ids.device
    # [T, k] chunk(t)*E + expert; ids clamped like the single-device kernels (the range check, when
    # on, reads the raw ids): a chunk's rows then always fill exactly its own rows of the send buffer
    key = ids.clamp(0, num_experts - 1) + _chunk_base(T_, chunks, num_experts, device)
    flat = key.view(-1)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=device)
    stats = torch.empty(4, dtype=torch.int32, device=device)
    target = targets.resolve(ids)
    plan_count_program.compile(target, num_experts=E).launcher()(flat, counts, offsets, stats, 1)

    def place():
        positions = torch.empty(T_, k, dtype=torch.int32, device=device)
        src = torch.empty(T_ * k, dtype=torch.int32, device=device)      # source token of each send row
        m_idx = torch.empty(T_ * k, dtype=torch.int32, device=device)    # (the key of each row: unused)
        plan_place_program.compile(target, layout="contiguous").launcher()(flat, counts, offsets, positions.view(-1),
                                                                             src, m_idx, k)
        return positions, src

    return place


def _recv_layout(cnt, layout, align, max_m):
    """This rank's dispatch layout from the header alone (no received ids), as two small tables for
    ep_layout_program (one launch expands them on the device: the ~25 small device ops this replaced
    took 0.58 ms of host time per dispatch on the H200 host, numpy over every row 0.45 ms here).

    cnt (W, C, El) int64 numpy: rows each source rank sends from each of its chunks to each local
    expert. In the single-device layout on the concatenated tokens, expert e's rows are in global
    token order: source rank 0's chunks 0..C-1, then rank 1's...; the receive buffer holds
    chunk-major segments (c, s, e). So a received row's index in its expert is (rows of e from
    earlier (s, c)) + its index in its segment."""
    W, C, El = cnt.shape
    tot = cnt.sum((0, 1))                                                # [El] rows per local expert
    n = int(tot.sum())
    busiest = int(tot.max()) if n else 0
    flat = cnt.reshape(W * C, El)
    before = (np.cumsum(flat, 0) - flat).reshape(W, C, El)              # rows of e in earlier (s, c)
    seg_len = cnt.transpose(1, 0, 2).reshape(-1)                         # receive order: (c, s, e)
    seg = np.empty((seg_len.size, 4), dtype=np.int64)
    seg[:, 0] = np.cumsum(seg_len) - seg_len
    seg[:, 1] = seg_len
    seg[:, 3] = before.transpose(1, 0, 2).reshape(-1)
    exp = np.empty((El, 4), dtype=np.int64)
    exp[:, 1] = tot
    if layout == "contiguous":
        padded = (tot + align - 1) // align * align
        rows = int(padded.sum())
        exp[:, 0] = np.cumsum(padded) - padded                           # expert segment starts
        exp[:, 2] = padded
        exp[:, 3] = np.arange(El)                                        # m_indices: the expert, -1 on padding
        cap, out_max_m, pad_rows = 2**31 - 1, None, rows - n
    else:
        out_max_m = int(max_m) if max_m is not None else max(align, (busiest + align - 1) // align * align)
        rows = El * out_max_m
        exp[:, 0] = np.arange(El) * out_max_m
        exp[:, 2] = out_max_m
        exp[:, 3] = 0                                                    # valid rows 0, padding -1
        # clamped like the single-device plan: an unchecked overflow never writes out of bounds
        cap, pad_rows = out_max_m - 1, rows - int(np.minimum(tot, out_max_m).sum())
    seg[:, 2] = np.tile(exp[:, 0], W * C)
    return dict(counts=tot, seg=seg, exp=exp, cap=cap, n=n, rows=rows, pad_rows=pad_rows, busiest=busiest,
                max_m=out_max_m)


def _expand_layout(device, lay):
    """(positions (N, 1), rows (M,), counts (El,)) int32 on the device: the tables uploaded in one
    copy, expanded by one ep_layout_program launch."""
    seg, exp, counts = _to_device(device, lay["seg"], lay["exp"], lay["counts"])
    pos = torch.empty(lay["n"], dtype=torch.int32, device=device)
    rows = torch.empty(lay["rows"], dtype=torch.int32, device=device)
    if seg.numel() + exp.numel():
        kernel = ep_layout_program.compile(targets.resolve(pos))
        kernel.launcher()(seg.view(-1, 4), exp.view(-1, 4), lay["cap"], pos, rows)
    return pos.view(-1, 1), rows, counts


def _to_device(device, *arrays):
    """int32 device copies of host int arrays through one pinned buffer and one copy."""
    sizes = [a.size for a in arrays]
    host = torch.empty(max(1, sum(sizes)), dtype=torch.int32, pin_memory=device.type == "cuda")
    flat = host.numpy()
    o = 0
    for a, n in zip(arrays, sizes):
        flat[o:o + n] = a.reshape(-1)
        o += n
    dev = host.to(device, non_blocking=True)
    out, o = [], 0
    for n in sizes:
        out.append(dev[o:o + n])
        o += n
    return out


# header tail (int32 after the C*E counts): [bad arguments, x bytes per row, scale bytes per row,
# ids checked, ids min, ids max, 0, 0]
_TAIL = 8
_TAILS = {}


def _tail(values, device):
    """The header tail as a device tensor, kept per value (a device copy, not an upload, per call)."""
    key = (tuple(values), device)
    t = _TAILS.get(key)
    if t is None:
        if len(_TAILS) >= 64:
            _TAILS.clear()
        t = _TAILS[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return t


def _ep_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group):
    """Expert-parallel dispatch: one header all-gather (with its host sync), then C row chunks whose
    send scatter, all-to-all and placement overlap (see the module docstring and bench/NOTES.md)."""
    world, me = _group_size_rank(group)
    check.number("num_experts", num_experts, lo=1, integer=True)
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the group's world size {world} "
                         "(experts are placed contiguously, E/W per rank)")
    e_local = num_experts // world
    chunks = _ep_chunks()
    # A rank whose arguments fail the checks still joins the header exchange with an error flag, so
    # the other ranks raise too instead of waiting in the next collective.
    try:
        _check_dispatch(x, ids, num_experts, x_scales, layout, align, max_m)
        bad = None
    except (TypeError, ValueError) as e:
        bad = e
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    cuda = device.type == "cuda"
    _mark("start", device)
    # header: this rank's rows per (chunk, global expert) straight from the plan's count kernel,
    # then the tail; all-gathered, so every rank reads what it sends and what it receives on the host
    ce = chunks * num_experts
    tail = [1, 0, 0, 0, 0, 0, 0, 0]
    checking = False
    if bad is None:
        T_, k = ids.shape
        bounds = _token_bounds(T_, chunks)
        checking = _values.enabled(ids)
        tail = [0, x.shape[1] * x.element_size(), 0 if x_scales is None else x_scales.shape[1] * 4,
                int(checking), 0, 0, 0, 0]
    header = (torch.empty if bad is None and T_ else torch.zeros)(ce + _TAIL, dtype=torch.int32, device=device)
    header[ce:].copy_(_tail(tail, device))
    if bad is None and T_:
        place = _ep_send_plan(ids, num_experts, chunks, header[:ce])
        if checking:                                  # read with the header: no extra sync
            torch.aminmax(ids.view(-1), out=(header[ce + 4], header[ce + 5]))
    gathered = torch.empty(world * (ce + _TAIL), dtype=torch.int32, device=device)   # flat: gloo wants it so
    dist.all_gather_into_tensor(gathered, header, group=group)
    gathered = gathered.view(world, ce + _TAIL)
    if cuda:                                                            # read back without waiting for what follows
        host = torch.empty(world, ce + _TAIL, dtype=torch.int32, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    _mark("header", device)
    send_x = send_s = None
    if bad is None:
        # work that needs no header: the send order and chunk 0's send rows (under the header's round trip)
        positions, src = place() if T_ else (torch.empty(0, k, dtype=torch.int32, device=device), None)
        send_x = torch.empty(T_ * k, x.shape[1], dtype=x.dtype, device=device)
        send_s = None if x_scales is None else torch.empty(T_ * k, x_scales.shape[1], dtype=torch.float32,
                                                           device=device)

        def send_rows(c):
            a, b = bounds[c], bounds[c + 1]
            if b > a:
                _scatter_into(send_x, x[a:b], positions[a:b], src, pad=False)
                if send_s is not None:
                    _scatter_into(send_s, x_scales[a:b], positions[a:b], src, pad=False)

        send_rows(0)
    _mark("prep", device)
    if cuda:
        ready.synchronize()                                             # the one host sync: split sizes
    else:
        host = gathered
    _mark("synced", device)
    if bad is not None:
        raise bad
    h = host.numpy().astype(np.int64)
    tails = h[:, ce:]
    bad_ids = [bool(t[3]) and (t[4] < 0 or t[5] >= num_experts) for t in tails]    # ranks that checked theirs
    if bad_ids[me]:
        raise ValueError(f"ids must be expert ids in [0, {num_experts}), got values {int(tails[me, 4])}.."
                         f"{int(tails[me, 5])}")
    failed = [r for r in range(world) if tails[r, 0] or bad_ids[r]]
    if failed:
        raise ValueError(f"moe_dispatch: rank(s) {failed} of the group got invalid arguments (see their errors); "
                         "no rows were exchanged")
    sizes = sorted({(int(t[1]), int(t[2])) for t in tails})
    if len(sizes) > 1:
        raise ValueError(f"every rank must send rows of one size: got (x bytes, x_scales bytes) per row "
                         f"{sizes} across the group (same H and dtype everywhere)")
    every = h[:, :ce].reshape(world, chunks, world, e_local)            # [source, chunk, destination, expert]
    cnt_send = every[me]                                                # [C, W, El] what this rank sends
    cnt_recv = every[:, :, me]                                          # [W, C, El] what it receives
    send_chunks = cnt_send.sum(2).tolist()                              # [C][W] rows to each rank per chunk
    recv_chunks = cnt_recv.sum(2).T.tolist()                            # [C][W] rows from each rank per chunk
    recv_bounds = [0]
    for c in range(chunks):
        recv_bounds.append(recv_bounds[-1] + sum(recv_chunks[c]))
    recv_x = torch.empty(recv_bounds[-1], x.shape[1], dtype=x.dtype, device=device)
    recv_s = None if x_scales is None else torch.empty(recv_bounds[-1], x_scales.shape[1], dtype=torch.float32,
                                                       device=device)
    works = []
    for c in range(chunks):                                             # same collectives, same order, every rank
        if c:
            send_rows(c)
        a, b, ra, rb = bounds[c] * k, bounds[c + 1] * k, recv_bounds[c], recv_bounds[c + 1]
        works.append(_a2a(recv_x[ra:rb], send_x[a:b], recv_chunks[c], send_chunks[c], group))
        if recv_s is not None:
            works.append(_a2a(recv_s[ra:rb], send_s[a:b], recv_chunks[c], send_chunks[c], group))
    _mark("issued", device)
    lay = _recv_layout(cnt_recv, layout, align, max_m)
    overflow = None
    if layout == "masked" and max_m is not None and checking and lay["busiest"] > max_m:
        overflow = ValueError(f"max_m={max_m} is smaller than the busiest expert's {lay['busiest']} tokens")
    rows = lay["rows"]
    pos, src_rows, counts = _expand_layout(device, lay)
    xd = torch.empty(rows, x.shape[1], dtype=x.dtype, device=device)
    sd = None if x_scales is None else torch.empty(rows, x_scales.shape[1], dtype=torch.float32, device=device)
    if recv_bounds[-1] == 0 and rows:                                   # nothing arrives: every row is padding
        xd.zero_()
        if sd is not None:
            sd.zero_()
    _mark("layout", device)
    zero_pending = lay["pad_rows"] > 0
    per_chunk = 1 if recv_s is None else 2
    for c in range(chunks):
        for w in works[c * per_chunk:(c + 1) * per_chunk]:
            if w is not None:
                w.wait()
        _mark(f"chunk{c}", device)
        ra, rb = recv_bounds[c], recv_bounds[c + 1]
        if rb > ra:                                  # placed while chunk c+1 transfers
            _scatter_into(xd, recv_x[ra:rb], pos[ra:rb], src_rows, pad=zero_pending)
            if sd is not None:
                _scatter_into(sd, recv_s[ra:rb], pos[ra:rb], src_rows, pad=zero_pending)
            zero_pending = False
    _mark("end", device)
    if overflow is not None:                         # after every collective: the peers are not left waiting
        raise overflow
    contiguous = layout == "contiguous"
    mapping = MoeMapping(layout, e_local, 1, pos, counts, m_indices=src_rows if contiguous else None,
                         masked_m=None if contiguous else counts, max_m=lay["max_m"])
    mapping.ep = EpMapping(group, world, me, num_experts, cnt_send.sum((0, 2)).tolist(),
                           cnt_recv.sum((1, 2)).tolist(), positions, chunks, bounds, send_chunks, recv_chunks,
                           recv_bounds)
    if layout == "masked":
        xd = xd.view(e_local, mapping.max_m, x.shape[1])
        sd = sd.view(e_local, mapping.max_m, -1) if sd is not None else None
    return xd, sd, mapping


def _ep_combine(y, mapping, weights):
    """Each expert row back to its token's rank, chunk by chunk (the chunks of the dispatch), and the
    combine kernel on a chunk's tokens as soon as their rows are back: the same kernel over the same
    rows in the same order as one device, so the same bits."""
    ep = mapping.ep
    device = y.device
    _mark("start", device)
    H = y.shape[-1]
    y2 = y.reshape(-1, H)
    T_, k = ep.send_positions.shape
    back = torch.empty(ep.recv_bounds[-1], H, dtype=y.dtype, device=device)   # rows in the order they came
    ret = torch.empty(T_ * k, H, dtype=y.dtype, device=device)                 # this rank's rows, send order
    out = torch.empty(T_, H, dtype=y.dtype, device=device)
    src = mapping.positions.view(-1)
    works = []
    for c in range(ep.chunks):
        ra, rb = ep.recv_bounds[c], ep.recv_bounds[c + 1]
        if rb > ra:
            _gather_into(back[ra:rb], y2, src[ra:rb])
        a, b = ep.token_bounds[c] * k, ep.token_bounds[c + 1] * k
        works.append(_a2a(ret[a:b], back[ra:rb], ep.send_chunk_splits[c], ep.recv_chunk_splits[c], ep.group))
    _mark("gather", device)
    kernel = None
    for c in range(ep.chunks):
        if works[c] is not None:
            works[c].wait()
        _mark(f"chunk{c}", device)
        a, b = ep.token_bounds[c], ep.token_bounds[c + 1]
        if b > a:                                    # summed while chunk c+1 returns
            if kernel is None:
                kernel = combine_program.compile(targets.resolve(y), hidden=H, top_k=k, dtype=Y_DTYPES[y.dtype])
            kernel.launcher()(ret, ep.send_positions[a:b], weights[a:b], out[a:b])
    _mark("end", device)
    return out


def _combine_impl(y, positions, weights):
    T_, k = positions.shape
    out = torch.empty(T_, y.shape[-1], dtype=y.dtype, device=y.device)
    if T_ == 0:
        return out
    y2 = y.reshape(-1, y.shape[-1])
    kernel = combine_program.compile(targets.resolve(y), hidden=y.shape[-1], top_k=k, dtype=Y_DTYPES[y.dtype])
    kernel.launcher()(y2, positions, weights, out)
    return out


@torch.library.custom_op("tilecraft::moe_combine", mutates_args=())
def _combine_op(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _combine_impl(y, positions, weights)


@_combine_op.register_fake
def _(y, positions, weights):
    return y.new_empty(positions.shape[0], y.shape[-1])


def moe_combine(y, mapping, weights):
    """Weighted sum of each token's expert outputs: (T, H) in y's dtype, fp32 accumulation.

    y: the experts' outputs in the dispatch layout ((M, H) or (E, max_m, H)); mapping from
    moe_dispatch; weights (T, k) fp32 (from moe_route). With an expert-parallel mapping (dispatched
    with group=), y is this rank's local layout, weights are for this rank's T tokens, and every
    rank of the group must call: rows go back to their tokens' ranks, and the sum is bitwise the
    single-device one.
    """
    if not isinstance(mapping, MoeMapping):
        raise TypeError(f"mapping must be the MoeMapping returned by moe_dispatch, got {type(mapping).__name__}")
    check.tensor("y", y, dtypes=Y_DTYPES, ndim=(2, 3), contiguous=True)
    rows = mapping.m_indices.shape[0] if mapping.layout == "contiguous" else mapping.num_experts * mapping.max_m
    expected = (rows, y.shape[-1]) if mapping.layout == "contiguous" else (mapping.num_experts, mapping.max_m, y.shape[-1])
    check.shape("y", y, expected, f"the {mapping.layout} dispatch layout")
    check.tensor("weights", weights, dtypes=(torch.float32,), ndim=2, contiguous=True)
    ep = mapping.ep
    pos = mapping.positions if ep is None else ep.send_positions
    check.shape("weights", weights, tuple(pos.shape), "(T, k) like the routing")
    check.same_device(y=y, weights=weights, positions=pos)
    if ep is not None:
        return _ep_combine(y, mapping, weights)
    return _dispatch.call(_combine_op, _combine_impl, y, pos, weights)


def moe_reference(x, ids, weights, expert_fn):
    """out[t] = sum_j weights[t, j] * expert_fn(ids[t, j], x[t]) in fp32: the dispatch+combine contract."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * expert_fn(int(ids[t, j]), x[t:t + 1].float())[0]
    return out
