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

Expert parallelism (group=): ops/moe_ep.py, on the same kernels.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
from dataclasses import dataclass


import tilelang.language as T
import torch

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import _validate as check
from ops._workspace import int32_views

LAYOUTS = ("contiguous", "masked")
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
    transport: str = "a2a"                   # "a2a" (all_to_all_single) or "peer" (peer memory)
    send_rows: list | None = None            # peer: every rank's send rows (T*k of that rank)
    peer_offsets: list | None = None         # peer: where this rank's rows start in each rank's send order
    header: torch.Tensor | None = None       # peer, fixed-grid dispatch: the all-gathered headers (W, E + tail)
                                             # int32 on the device, for the lists above when they were not read
    info: torch.Tensor | None = None         # peer, fixed-grid dispatch: (W, 4) int32 on the device, per source
                                             # rank [rows it sent here, their start in its send order, their
                                             # start in this rank's receive order, 0] (the combine's tables)

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


def zero_padding_macro(hidden: int, bits: str, zero_rows: int):
    """A T.macro for the padding blocks of a row-copy kernel: padding block j zeroes the rows
    r in [j*zero_rows, (j+1)*zero_rows), r < rows, whose Valid[r] < 0."""

    @T.macro
    def zero_padding(Y, Valid, j, rows):
        for i in T.serial(zero_rows):
            if j * zero_rows + i < rows:
                if Valid[j * zero_rows + i] < 0:
                    for c in tile.parallel(hidden):
                        Y[j * zero_rows + i, c] = T.cast(0, bits)

    return zero_padding


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
    zero_padding = zero_padding_macro(hidden, bits, zero_rows)

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
                zero_padding(Y, Src, b - tokens, live_rows)

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


@tile_program("moe_combine", examples={"h7168-k8": dict(hidden=7168, top_k=8)})
def combine_program(hidden: int, top_k: int, dtype: str = "bfloat16", threads: int = 128, split=False):
    """Out[t, :] = sum_j W[t, j] * Y[Pos[t, j], :], j in order, in fp32. split (expert parallel, peer
    transport): the rows Pos[t, j] in [lo, lo + nloc) are read from Y at row Loc[base + Pos[t, j] - lo]
    (this rank's own experts' rows, never copied), every other row from Ret at row Pos[t, j].
    split=True takes lo and nloc as arguments (base 0); split="info" reads them on the device,
    Info (4,) int32 = [nloc, lo, base, -] (no host read: capturable in a CUDA graph)."""
    rows, tokens = T.dynamic("rows, tokens")
    sdt = tile.storage_dtype(dtype)
    if split not in (False, True, "info"):
        raise ValueError(f"split must be False, True or 'info', got {split!r}")

    if not split:
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
                            # (clamped into y: a position past it, from a mapping not moe_dispatch's, reads no
                            # memory outside y; moe_combine refuses it where value checks run)
                            acc[c] += W[t, j] * tile.to_f32(Y[T.min(T.max(Pos[t, j], 0), rows - 1), c], dtype)
                    for c in tile.parallel(hidden):
                        Out[t, c] = tile.from_f32(acc[c], dtype)

        return combine

    ret_rows, nl = T.dynamic("ret_rows, nl")

    @T.macro
    def two_sources(t, Ret, Pos, W, Out, Y, Loc, lo, nloc, base):
        acc = tile.fragment((hidden,))
        val = tile.fragment((hidden,))
        for c in tile.parallel(hidden):
            acc[c] = 0.0
        for j in T.serial(top_k):
            q = T.if_then_else(Pos[t, j] >= lo, Pos[t, j] - lo, nloc)      # index in Loc (from base), or nloc
            if q < nloc:
                for c in tile.parallel(hidden):
                    val[c] = tile.to_f32(Y[Loc[base + q], c], dtype)
            else:
                for c in tile.parallel(hidden):
                    val[c] = tile.to_f32(Ret[T.min(T.max(Pos[t, j], 0), ret_rows - 1), c], dtype)
            # one multiply-add, as in the one-source kernel: nvcc fuses both into the same FFMA
            # (a multiply-add in each branch was left as FMUL + FADD: other bits)
            for c in tile.parallel(hidden):
                acc[c] += W[t, j] * val[c]
        for c in tile.parallel(hidden):
            Out[t, c] = tile.from_f32(acc[c], dtype)

    if split == "info":
        @T.prim_func
        def combine_split_info(Ret: T.Tensor((ret_rows, hidden), sdt), Pos: T.Tensor((tokens, top_k), "int32"),
                               W: T.Tensor((tokens, top_k), "float32"), Out: T.Tensor((tokens, hidden), sdt),
                               Y: T.Tensor((rows, hidden), sdt), Loc: T.Tensor((nl,), "int32"),
                               Info: T.Tensor((4,), "int32")):
            with tile.grid(tokens, threads) as t:
                with tile.vector():
                    two_sources(t, Ret, Pos, W, Out, Y, Loc, Info[1], Info[0], Info[2])

        return combine_split_info

    @T.prim_func
    def combine_split(Ret: T.Tensor((ret_rows, hidden), sdt), Pos: T.Tensor((tokens, top_k), "int32"),
                      W: T.Tensor((tokens, top_k), "float32"), Out: T.Tensor((tokens, hidden), sdt),
                      Y: T.Tensor((rows, hidden), sdt), Loc: T.Tensor((nl,), "int32"), lo: T.int32,
                      nloc: T.int32):
        with tile.grid(tokens, threads) as t:
            with tile.vector():
                two_sources(t, Ret, Pos, W, Out, Y, Loc, lo, nloc, 0)

    return combine_split


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
    scatter_launcher(target, hidden, bits, pad, has_live)(xw, positions, src, out.view(bits),
                                                         *(() if live is None else (live,)))
    return out


def scatter_launcher(target, hidden: int, bits: torch.dtype, pad: bool, live: bool = False):
    """moe_scatter_rows' launcher for rows of `hidden` words of `bits` (one per key: jit.launchers)."""
    return jit.launchers(("moe_scatter_rows", target.name, hidden, bits, pad, live), lambda: (
        scatter_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits], pad=pad, live=live).launcher()))


def plan_launchers(target, num_experts: int, layout: str):
    """(moe_plan_count, moe_plan_place) launchers for this expert count and layout."""
    return jit.launchers(("moe_plan", target.name, num_experts, layout), lambda: (
        plan_count_program.compile(target, num_experts=num_experts).launcher(),
        plan_place_program.compile(target, layout=layout).launcher()))


def combine_launcher(target, hidden: int, top_k: int, dtype: torch.dtype, split=False):
    """moe_combine's launcher for y rows of `hidden` values of `dtype`, top_k choices a token (split:
    the two-source variants of the peer EP transport: True or "info", see combine_program)."""
    name = Y_DTYPES[dtype]
    return jit.launchers(("moe_combine", target.name, hidden, top_k, name, split), lambda: (
        combine_program.compile(target, hidden=hidden, top_k=top_k, dtype=name, split=split).launcher()))


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
    count, place = plan_launchers(target, E, layout)
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
        if layout != "masked":
            raise ValueError(f"max_m is only for layout='masked' (the rows each expert gets there); layout is {layout!r}")
        check.number("max_m", max_m, lo=1, integer=True)
    if x.dtype == torch.float8_e4m3fn:
        if x_scales is None:
            raise ValueError("x is fp8: x_scales (T, ceil(H/128)) fp32 must be given")
        check.tensor("x_scales", x_scales, dtypes=(torch.float32,), ndim=2, contiguous=True)
        check.shape("x_scales", x_scales, (x.shape[0], -(-x.shape[1] // 128)), "(T, ceil(H/128))")
    elif x_scales is not None:
        raise ValueError(f"x_scales is only for fp8 x; x is {x.dtype}")
    check.same_device(x=x, ids=ids, x_scales=x_scales)
    if x.device.type == "cuda":         # (rows are read up to 16 bytes a thread)
        check.aligned("x", x, 16, "its rows are read 16 bytes a thread")
        if x_scales is not None:
            check.aligned("x_scales", x_scales, 16, "its rows may be read 16 bytes a thread")
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
        from ops import moe_ep

        return moe_ep.ep_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group)
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


def _combine_impl(y, positions, weights):
    T_, k = positions.shape
    out = torch.empty(T_, y.shape[-1], dtype=y.dtype, device=y.device)
    if T_ == 0:
        return out
    y2 = y.reshape(-1, y.shape[-1])
    combine_launcher(targets.resolve(y), y.shape[-1], k, y.dtype)(y2, positions, weights, out)
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
    single-device one. y must have the same dtype and width on every rank (rows cross as raw bytes).
    Unlike moe_dispatch (whose header exchange carries every rank's argument errors to all), a rank
    whose arguments fail these checks raises before the exchange, and the other ranks then wait in it,
    as with any collective that some ranks do not call.
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
    if ep is None and _values.enabled(pos) and pos.numel() and bool(((pos < 0) | (pos >= rows)).any()):
        raise ValueError(f"mapping.positions must be rows of y's dispatch layout (in [0, {rows})), got values "
                         f"{int(pos.min())}..{int(pos.max())}: pass the mapping moe_dispatch returned with these rows")
    if y.device.type == "cuda":
        check.aligned("y", y, 16, "its rows are read 16 bytes a thread")
    if ep is not None:
        from ops import moe_ep

        return moe_ep.ep_combine(y, mapping, weights)
    return _dispatch.call(_combine_op, _combine_impl, y, pos, weights)


def moe_reference(x, ids, weights, expert_fn):
    """out[t] = sum_j weights[t, j] * expert_fn(ids[t, j], x[t]) in fp32: the dispatch+combine contract."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * expert_fn(int(ids[t, j]), x[t:t + 1].float())[0]
    return out
