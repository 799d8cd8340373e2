"""The portable tile vocabulary: the only words an op's tile program uses for anything that
differs between targets.

Write a program once with these words plus target-neutral TileLang (`T.prim_func`, `T.Tensor`,
arithmetic, `T.cast`, `T.serial`, indexing). Each word is resolved while the program is traced,
by the lowering rule registered for the target being compiled (see codegen.rules and
codegen/lowering/). `tile.<name>` also reaches any word a kernel author registered later.

| word | sm_90a | sm_100a | ascend:950 | cpu |
| --- | --- | --- | --- | --- |
| grid(blocks, threads) | T.Kernel 1-D | T.Kernel 1-D | T.Kernel (cores) | T.Kernel, 1 thread |
| cluster_grid(blocks, threads, cluster) | T.ClusterKernel (cluster_dims 1-8) | same | not lowered | not lowered |
| vector() | (nothing) | (nothing) | T.SimtVF region | (nothing) |
| persistent(total, blocks, bid) | stepped serial | stepped serial | T.Persistent | stepped serial |
| fragment(shape, dtype) | registers | registers | vector registers (UB when made outside a vector region) | alloc_local |
| stage(shape, dtype) | shared memory | shared memory | UB | alloc_local |
| operand(shape, dtype) | shared memory | shared memory | L1 | alloc_local |
| accumulator(shape) | registers (WGMMA) | tensor memory | L0C | alloc_local |
| mma(a, b, acc, step=) | T.gemm -> WGMMA | tcgen05, wait parity step % 2 | Cube T.gemm | T.gemm / serial loops |
| mma_rescaled(a, b, acc, scale, step=) | scale registers, WGMMA | TMEM -> regs -> TMEM, tcgen05 | Cube into L0C scratch, vector update in UB | loops |
| mma_promoted(a, b, part, acc, scale, step=) | mma into part, read, fold in registers | tcgen05 into TMEM, TMEM -> regs, fold | Cube into L0C, L0C -> UB half rows, vector fold | mma + loops |
| mma_promoted_loop(steps, loads, operands, part, acc, scale, scale_of, stages=, epilogue=, prologue=, epilogue_stage=, tiles=) | producer warpgroup (TMA, mbarriers) + consumers: bursts of 4 K blocks, WGMMA of step s in flight while s-1 is promoted (wgmma wait 1); epilogue_stage a plain tile that TileLang lays over the operand stages; tiles=tile.Tiles: persistent CTAs, the pipeline carried across tiles, staging by cp.async; side=(period, region_of, ring): a small operand loaded by the producer's TMA in chunks of `period` K blocks into a ring of 3+ slots (chunk c + 1 with block c * period's tiles); acc a tuple (column passes): each K block as one WGMMA pass per column slice of B's stage, waited for (wait 0) and folded into its acc[p] | pipelined copies + mma_promoted (one a column pass for a tuple acc); epilogue_stage its own tile; no side= (ValueError) | same as sm_100a | same |
| mma_decoded_loop(steps, loads, operands, acc, decode, stages=, prologue=, epilogue=, swizzle_raw=) | producer warpgroup (TMA) + MMA warpgroups that decode step s+1 while the WGMMA of step s is in flight (decoded tile double-buffered); the MMA warpgroups run prologue() under the first loads; swizzle_raw: the raw tile TMA-swizzled (a decode whose warps walk rows) | pipelined copies + decode + mma per step | A into L1; each vector core decodes half of B's rows in UB (decode(..., rows=)), dual copy into L1; Cube MMA | same as sm_100a |
| mma_register_decoded_loop(steps, loads, operands, acc, decode, stages=, prologue=, epilogue=, preload=, ramp=, promote=, tile_done=, burst=, temps=, whole_bursts=, chains=) | producer warpgroup (TMA; preload's tiles first, on their own barrier) + MMA warpgroups that decode their own fragment rows into registers (two fragments) and issue WGMMA with A from registers (a quad's threads read the same raw words, each decodes its byte); chains=2: the two MMA warpgroups take alternate steps of the same raw rows, each into its half of acc | not lowered | not lowered | not lowered |
| mma_block_scaled_loop(steps, loads, scale_loads, operands, acc, scale_k=, stages=, epilogue=, scale_dtype=) | not lowered (no block-scaled tensor cores) | one warp TMA, one warp scale copies to TMEM (UTCCP) + block-scaled tcgen05 MMA (UTCQMMA), one warp transposing the scale words; 128 threads | the Cube's block-scaled MAD (A and B of one 8-bit dtype, the scale words' E8M0 bytes in L1), every copy global -> L1 | not lowered |
| attention_loop(steps, q, kv, v, loads, visible, scale, epilogue, valid_rows=, raw=, value=, swapped=, raw_rows=, stage_raw=, direct=, seesaw=, all_visible=) | producer warpgroup (TMA; zeroes tail rows / converts raw staging) + two MMA warpgroups: WG0 scores, softmax and O_0, WG1 O_1; swapped: S^T and O^T (tokens as M); raw staging in raw_rows chunks converted by the producer and WG1 (stage_raw: through registers); seesaw: the two MMA warpgroups score alternate steps (FlashMLA's schedule); units: a persistent CTA's unit list, the next unit's query and steps loading under the last one's output (Units.query_staging: the query after the epilogue, which stages its output in the query tiles; steps_first: the next unit's first whole steps before it) | pipelined copies + mma + mma_rescaled per step | vector cores stage (and convert) half of each step's tokens in UB, dual copy into L1; Cube scores into L0C; softmax on each vector core's half of the rows in UB; P by dual copy into L1; Cube P V folded in UB (mma_rescaled) | same as sm_100a |
| fill_operands(tiles, row_of, values, vector=) | threads write shared memory (`vector` wide) | same | UB half rows per vector core, dual copy into L1 | serial loops |
| scalar(value, dtype) | a register variable (T.alloc_var), set once | the expression itself | same | same |
| producer_threads() | 128 (the TMA warpgroup of mma_promoted_loop / mma_decoded_loop / mma_register_decoded_loop, added to the grid) | 0 | 0 | 0 |
| split_rows(rows) | (rows, 0) | (rows, 0) | (rows/2, sub-block id * rows/2) | (rows, 0) |
| limits() | 227 KB smem | 227 KB smem, 512 TMEM columns | UB / L1 / L0C sizes | no limits |
| read_accumulator(acc) | (same buffer) | tmem -> registers | L0C -> UB, half the rows per vector core | (same buffer) |
| store(tile, dst) | T.copy | T.copy | dual copy for split tiles | T.copy |
| copy(src, dst) | T.copy (TMA / vector) | T.copy | DMA T.copy; guarded per-thread loop in a vector region | serial loops |
| parallel(*extents) | T.Parallel | T.Parallel | T.Parallel | T.grid |
| pipelined(n, stages) | T.Pipelined | T.Pipelined | T.Pipelined | T.serial |
| row_reduce(src, dst, op, dim) | T.reduce_* | T.reduce_* | T.reduce_* | T.reduce_* on locals |
| atomic_add(dst, value) | T.atomic_add | T.atomic_add | T.atomic_add (index computed first) | T.atomic_add (serial) |
| cumsum(src, dst, dim) | T.cumsum | T.cumsum | Hillis-Steele scan in the vector region (1-D) | serial loop (1-D) |
| storage_dtype(dtype) | dtype | dtype | dtype | bf16 stored as uint16 |
| to_f32(x, dtype) / from_f32(x, dtype) | T.cast | T.cast | T.cast | bf16 by bit arithmetic |
| reciprocal(x) | __frcp_rn (1 / x correctly rounded) | same | 1 / x | 1 / x |
| lane_shuffle(value, src, xor=) | __shfl_sync / __shfl_xor_sync | same | not lowered | not lowered |
| lane_first(pred) | __ffs(__ballot_sync) - 1 | same | not lowered | not lowered |
| lane_shuffle_up(value, delta) | __shfl_up_sync | same | not lowered | not lowered |
| lane_ballot(pred) | __ballot_sync (uint32) | same | not lowered | not lowered |
| barrier(threads=None, group=0) | __syncthreads (threads: bar.sync of the first threads, or of group g of them) | same | not lowered | nothing (one thread) |
| last_arrival(count, index, arrivals, threads=None, ordered=True, group=0) | __syncthreads (threads: bar.sync of the first threads; group g: of threads g * threads .., barrier 11 - g); the group's thread 0: __threadfence (ordered), atomicAdd, reset by the last; the same barrier | same | not lowered | not lowered |
| cluster_barrier() | barrier.cluster arrive (release) + wait (acquire), CUDA's builtins (a compiler barrier too) | same | not lowered | not lowered |
| cluster_store(dst, rank, value) | a store through __cluster_map_shared_rank (distributed shared memory) | same | not lowered | not lowered |
| import_cuda_helpers(text) | T.import_source | T.import_source | nothing (no CUDA helpers in Ascend C) | T.import_source |
| helper_source(*words) | the device helper text those words' rules import (cluster_store), for a program with its own import_source | same | not lowered | not lowered |

The lane words are for warp-per-item programs (one warp = 32 lanes owns an item, no shared memory):
every lane of the warp must reach them together. They have no rule on the cpu target (one thread
per block) or on Ascend, so programs that use them list only CUDA targets and keep a block-wide
program for the rest (ops/moe_route.py). The cluster words are the same kind: thread-block
clusters exist on sm_90a and sm_100a only (ops/topk_cluster.py; other targets take
ops/topk_select.py's block-per-row program; ops/gemm_fp8.py's split-K cluster fold is planned only
where backends.cuda.device.max_active_clusters says every cluster of the grid fits at once).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from codegen import rules, targets

# Per-trace facts that later words need (the grid's thread count, for Ascend's vector regions).
_STATE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tilecraft_trace_state", default=None)


def state() -> dict:
    s = _STATE.get()
    if s is None:
        raise RuntimeError("tile words are only valid while a tile program is traced")
    return s


def new_state():
    """Begin a fresh trace (codegen.program does this)."""
    return _STATE.set({})


def end_state(token) -> None:
    _STATE.reset(token)


@dataclass
class Accumulator:
    """A matrix accumulator: where it lives depends on the target (registers, TMEM, L0C)."""

    buf: Any
    shape: tuple
    dtype: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RawValue:
    """How attention_loop makes operand part `part`'s element (i, j) from raw staging:
    combine(part, [load(i, j, read) for load in loads(part)]), read(raw_part, i, j) reading the staged
    raw bytes. Split in two so that a target may read every raw element of a step into registers
    first and free the staging before it computes (sm_90a's stage_raw); calling it does both.

    row_scales: None, or (count, scale, part_scale): part p's row i is further multiplied by
    scale(part_scale[p], i, read) (float32; part_scale[p] None: not scaled), one of `count` per-row
    scales. A target may fold them into the MMAs instead of the values (sm_90a swapped: into the
    scores and into one scaled copy of P per value part), so combine() can stay an exact conversion."""

    loads: Any      # part -> [(i, j, read) -> raw expression]
    combine: Any    # (part, [values, one per load]) -> the operand element (before any row scale)
    row_scales: Any = None

    def __call__(self, part, i, j, read):
        return self.combine(part, [load(i, j, read) for load in self.loads(part)])


@dataclass(frozen=True)
class Units:
    """attention_loop(units=...): a persistent CTA's list of work units [begin, end), each a whole
    attention loop of its own (steps, loads, mask, query tiles and epilogue), run back to back so that
    a target may keep its pipeline full across them (sm_90a seesaw: the next unit's query and first
    steps load while the last unit's output is written).

    bind() is called once where the loop is built (before any warpgroup branch); it allocates the
    per-unit scalars and returns a binding with: load(u) (a T.macro setting them to unit u's),
    steps, valid_rows (expressions of them), loads(k), visible(k, i, j), all_visible(k),
    epilogue(o, col0, l, m, stats) as attention_loop takes them, and query() -> [(src, q part)], the
    copies that stage the unit's query tiles (the q tiles passed to attention_loop are then not
    written by the program); optionally prefetch(k), which reads what step k's copies index by (a
    cache page) into registers: a target's producer calls it before it waits for step k's slots."""

    begin: Any
    end: Any
    bind: Any
    early_query: bool = False   # the next unit's query loads once the last scores that read the query are done,
                                # not after the unit's last P V (a target may ignore it: the same results)
    query_staging: bool = False  # the epilogue may write the unit's query tiles (staging for its output, after
                                 # tile.barrier of its threads): the next unit's query loads after the epilogue
    steps_first: bool = False   # with query_staging: the next unit's first steps load before its query (under the
                                # last unit's epilogue), the query once the epilogue is done


@dataclass(frozen=True)
class Tiles:
    """mma_promoted_loop(tiles=...): a persistent CTA's tiles, bid, bid + blocks, ... below count (blocks: a
    Python int, the grid's CTAs wherever a CTA has more than one tile), each a whole K loop of its own,
    run back to back so that a target may keep its pipeline full across them (sm_90a: the producer
    loads the next tile's K blocks while the MMA warpgroups store the last). of(t) (called while
    tracing, once in each warpgroup's branch) gives tile t's {"steps", "loads", "prologue",
    "epilogue"}: steps, loads and epilogue as mma_promoted_loop takes them, prologue() issuing
    asynchronous copies (T.async_copy: cp.async) of what the tile's scale_of reads into shared
    memory; the target waits for them (and meets) before the tile's first block. scale_of must not
    depend on the tile."""

    count: Any
    bid: Any
    blocks: Any
    of: Any
    spare: Any = None   # the shared buffer the prologues fill: a target may lay epilogue_stage over it
    early: bool = True  # the next tile's prologue before this tile's epilogue (its copies land under it;
                        # the epilogue's tile then has memory of its own), else after it


def _dispatch(word: str, *args, **kwargs):
    return rules.lookup(word, targets.current()).fn(*args, **kwargs)


def _word(name: str, doc: str):
    rules.declare(name, doc)

    def call(*args, **kwargs):
        return _dispatch(name, *args, **kwargs)

    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = doc
    return call


grid = _word("grid", "Launch a 1-D grid of `blocks` blocks of `threads` threads; `with tile.grid(n, threads) as bid:`.")
cluster_grid = _word("cluster_grid", "tile.grid whose consecutive blocks form clusters of `cluster` that run at once and can wait on each other (cluster_barrier); `blocks` is a multiple of `cluster`.")
vector = _word("vector", "A region of per-thread vector work (a SIMT vector function on Ascend, nothing on CUDA).")
persistent = _word("persistent", "Iterate tile ids bid, bid+blocks, ... below total: a persistent schedule.")
fragment = _word("fragment", "A register tile spread over the block's threads, for elementwise and reduction work.")
stage = _word("stage", "An on-chip staging tile that copies fill from global memory (shared memory / UB).")
operand = _word("operand", "An on-chip tile that feeds the matrix unit (shared memory / L1).")
accumulator = _word("accumulator", "A matrix-multiply accumulator (registers / tensor memory / L0C).")
mma = _word("mma", "acc (+)= a @ b^T (transpose_b=True) or a @ b; `step` = MMAs into acc before this one.")
read_accumulator = _word("read_accumulator", "The accumulator's values as a tile that vector code can read.")
mma_rescaled = _word("mma_rescaled", "acc = acc * row_scale[:, None] + a @ b (acc is taken as 0 at step 0): online-softmax accumulate.")
mma_promoted = _word("mma_promoted", "acc += (a @ b^T) * scale[:, None] through the scratch accumulator `part`: two-level (promoted) accumulation.")
mma_promoted_loop = _word("mma_promoted_loop", "The whole K loop of a promoted GEMM: for s < steps, copy loads(s) into operand tiles of `operands` (shape, dtype), acc += (a @ b^T) * (the product of the factors scale_of(row, s) returns), then epilogue(); prologue=: a callable run before the first step, or (issue, finish): issue() starts global loads into registers (on sm_90a before the producer's first TMA), finish() uses them; epilogue_stage=(shape, dtype) of a 1-D tile: epilogue(stage) gets such an on-chip tile for staging its output (sm_90a: over the operand stages, free by then); threads: see producer_threads; share_a=2 (sm_90a, a grid of clusters of two blocks with the same A tiles): A is loaded once, by TMA multicast; tiles=tile.Tiles (sm_90a): a persistent CTA's tiles, each with its own steps, loads, prologue and epilogue (those arguments then None); side=(period, region_of, ring) (sm_90a, one tile a CTA, period + 2 >= stages): region_of(c), the chunk of a small operand scale_of reads for K blocks [c * period, (c + 1) * period), is loaded into ring[c % slots] (ring (slots >= 3, *chunk) in shared memory) by the producer: chunks 0 and 1 with block 0's tiles, chunk c + 1 with block c * period's; acc a tuple of P fragments: column passes, B's stage in P slices of part's width, slice p's product promoted into acc[p], scale_of returning the common factors then one per pass.")
mma_decoded_loop = _word("mma_decoded_loop", "The K loop of a GEMM whose B operand is decoded on chip: for s < steps, copy loads(s) = (A region, raw B region) into tiles of operands[0] and operands[1], decode(raw_at, b_at, s) writes the B tile of operands[2] from the raw one (raw_at(i, j), b_at(i, j): elements of this step's tiles), acc (+)= a @ b^T; prologue() before the first step (staging the decode reads; on sm_90a by the MMA threads while the first loads fly), epilogue() after the last step; swizzle_raw=True: the raw tile in a bank-swizzled layout (sm_90a: by TMA), for a decode whose quarter-warps read the same bytes of 8 consecutive rows; threads: see producer_threads. A target whose vector cores each hold part of the B tile (ascend:950) calls decode(raw_at, tile, s, rows=(count, first)) instead: raw_at(i, j) reads that core's raw row i (the tile's row first + i), tile is its (count, cols) part of the decoded tile.")
mma_register_decoded_loop = _word("mma_register_decoded_loop", "The K loop of a GEMM whose decoded operand feeds the MMA from registers (sm_90a: WGMMA with A in registers): for s < steps, copy loads(s) = (shared operand region, raw region) into tiles of operands[0] ((cols, 128 * parts), parts 1, 2 or 4) and operands[1] ((rows, 16 * parts) int32 words), then for each 128-deep part decode(raw_at, rows, place, step, dst) writes this thread's WGMMA fragment of the decoded tile operands[2] ((rows, 128): rows (r, r + 8), byte `place` of each raw word of the two rows) at dst (or decode = (load(raw_at, rows, buf), decode_from(buf, rows, place, step, dst)): the raw words go into registers a step ahead of their decode), acc (+)= decoded @ shared^T; prologue() before the first step, epilogue() after the last; preload: (global region, shared buffer) pairs copied once before the first step (sm_90a: by the producer's TMA, ahead of the stages); ramp: the first `ramp` stages asked for alone; blocks_per_sm (1, or 2 with one fragment); promote=True: each part's product into a fresh fp32 temporary added to acc once it retired (FP8 MMAs), or promote=factor(j, step): added times a per-(column, step) factor; mark(event, step) for traces; tile_done=(period, fn): several output tiles a block in one stream of steps, fn(t) stores tile t's accumulator after its last step and it is cleared (the last tile is the epilogue's); burst: steps between the MMA pipeline's drains (sm_90a; default 4); temps: the promotion's temporaries (2, or 1: a third fewer registers, each part's product added just before the next part's MMAs); whole_bursts=True: steps is always a multiple of burst (no tail bursts emitted); chains=2 (two MMA warpgroups, R raw rows, a decoded operand and acc of 2R rows): warpgroup w takes steps w, w + 2, ... of the same R rows into acc rows [w * R, (w + 1) * R), and the epilogue adds the halves; 16 rows a warp; threads: see producer_threads.")
attention_loop = _word("attention_loop", "Online-softmax attention over `steps` staged KV steps: S = sum_p q[p] @ kv[p]^T (kv: (rows, d, dtype) parts, staged by loads(k) -> [(src, part, row0, rows)], or into `raw` parts converted by value(part, i, j, read)), masked by visible(k, i, j) and scaled by `scale` (log2 domain), O_i = softmax(S) @ kv[v[i]]; rows past valid_rows (counted from step 0's first) are zeroed; epilogue(o, col0, l, m, stats) per output part. swapped=True (sm_90a): the tokens are the MMA's M, o is O^T and l, m are in shared memory; raw_rows: the raw staging holds raw_rows tokens, loads(j) stages chunk j; raw_rows (sm_90a, both operand orders): the producer and WG1 each convert half of a step's chunks; stage_raw=True (sm_90a, with raw_rows; value a tile.RawValue): a chunk's raw elements go to registers first and its staging is reloaded before the conversion; direct (sm_90a, with raw_rows): k -> copies of step k straight into operand parts, which are then not converted; a value with row_scales (tile.RawValue; sm_90a swapped with raw_rows, no stage_raw): the scales go into the scores and into one P copy per value part instead of the converted values; swapped value parts: an even number, half per MMA warpgroup; all_visible (optional): k -> a condition under which every score of step k is visible (sm_90a then skips the mask); seesaw=True (sm_90a, plain staging, two value parts, a further kv part of block_m x block_n): the two MMA warpgroups score alternate steps; units=tile.Units (sm_90a, seesaw): steps, loads, visible, valid_rows, epilogue and the query tiles' contents come per unit from the binding, and one CTA runs its units back to back (steps/loads/visible/epilogue/valid_rows arguments then None).")
fill_operands = _word("fill_operands", "Write operand tiles (one shape) value by value: tiles[n][i, j] = values[n](row_of(i), j), `vector` columns a thread at once where the target's threads write the tile (a multiple of the tile's width); on Ascend each vector core computes its half of the rows in UB and a dual copy moves them into L1.")
scalar = _word("scalar", "A per-block scalar computed once and kept in a register; returns what expressions use in its place.")
mma_block_scaled_loop = _word("mma_block_scaled_loop", "The K loop of a GEMM on block-scaled tensor cores: for s < steps, copy loads(s) = (A region, B region) into tiles of operands[0] and operands[1] and scale_loads(s) = (A's, B's scale words: one 32-bit word (scale_dtype) of 4 E8M0 bytes per row, each byte scale_k K values) into scale tiles, acc (+)= (a * sfa) @ (b * sfb)^T; epilogue() after the last step; a grid of 128 threads.")
producer_threads = _word("producer_threads", "Extra threads mma_promoted_loop, mma_decoded_loop and mma_register_decoded_loop need in the grid beyond the MMA threads (0 but on sm_90a).")
split_rows = _word("split_rows", "(count, first): the rows of a `rows`-row tile that this core's vector code holds (all of them, or half on Ascend).")
limits = _word("limits", "Facts about the target that shape a program: {'accumulator_columns': ..., 'smem_bytes': ...}; "
               "a kernel whose dynamic shared memory exceeds smem_bytes is refused when it is built (codegen.jit).")
store = _word("store", "Write a tile produced by read_accumulator (or any on-chip tile) to global memory.")
copy = _word("copy", "Copy a tile or region between global memory and on-chip buffers.")
parallel = _word("parallel", "Elementwise map: a loop nest whose iterations are spread over the threads.")
pipelined = _word("pipelined", "A loop whose copies are software-pipelined `stages` deep.")
row_reduce = _word("row_reduce", "Reduce a tile along `dim` (sum, max, min, absmax) into a smaller tile.")
atomic_add = _word("atomic_add", "Atomically add `value` to one element of an on-chip or global buffer.")
cumsum = _word("cumsum", "Inclusive prefix sum of a tile along `dim` (into `dst`, or in place).")
storage_dtype = _word("storage_dtype", "The dtype a tensor of `dtype` has inside the kernel on this target.")
to_f32 = _word("to_f32", "Load-side conversion of a storage value of `dtype` to float32.")
from_f32 = _word("from_f32", "Store-side conversion of a float32 value to storage of `dtype` (round to nearest even).")
lane_shuffle = _word("lane_shuffle", "`value` as held by lane `src` of this warp (lane ^ src with xor=True); all lanes take part.")
reciprocal = _word("reciprocal", "1 / x (float32, correctly rounded). A row factor used across a tile's columns is worth computing once a row into a fragment and multiplying: per element, CUDA compilers expand every occurrence (sm_90a: a reciprocal sequence with a slow-path call each).")
lane_first = _word("lane_first", "The lowest lane of this warp whose `pred` holds, -1 if none; all lanes take part.")
lane_shuffle_up = _word("lane_shuffle_up", "`value` as held by lane - delta of this warp (its own below delta); all lanes take part.")
lane_ballot = _word("lane_ballot", "uint32 mask of this warp's lanes whose `pred` holds; all lanes take part.")
barrier = _word("barrier", "A block-wide barrier, for programs built with TileLang's thread-sync pass off; threads=: only the block's first `threads` (whole warps) take part; with group=g (0 or 1) threads g * threads .. g * threads + threads - 1 (one MMA warpgroup of two, on a barrier of its own).")
last_arrival = _word("last_arrival", "1 in the last of `arrivals` blocks to arrive on int32 count[index] (each arrives once, after its global stores; the last sees every earlier arriver's stores and sets the count back to 0), else 0; every thread of the block takes part, or its first `threads` (whole warps: a named barrier, for warp-specialized kernels whose producer warps have exited), or with group=g (0 or 1) threads g * threads .. g * threads + threads - 1 (one MMA warpgroup: each group counts on its own counters). ordered=False: no fences, the last block knows it is last but not that the others' stores have landed (its reads must wait for each word).")
cluster_barrier = _word("cluster_barrier", "Every thread of the block's cluster (cluster_grid) waits here; memory written before it is visible to the whole cluster after it.")
cluster_store = _word("cluster_store", "Store fp32 `value` into element `dst` of block `rank`'s copy of a shared buffer (its cluster's distributed shared memory); it sees the value after the next cluster_barrier. Every block of the cluster must have passed a cluster_barrier before any stores into it.")
import_cuda_helpers = _word("import_cuda_helpers", "Import CUDA device helper source (T.import_source) for a program's call_extern helpers; on targets of another vendor nothing (the program's paths there must not call them).")
helper_source = _word("helper_source", "The device helper source the rules of these words import, as text, for a program that imports its own source (TileLang takes one import_source a program): put it in that import, and the words' rules import nothing.")


def emit(*stmts) -> None:
    """Emit TileLang statements from a rule written as a plain Python function.

    Inside a T.prim_func body, a bare call such as `T.copy(a, b)` becomes a statement because the
    DSL evaluates it; inside a rule function it is just a returned value. A rule that produces one
    statement may return it; a rule that produces several passes each to emit().
    """
    from tilelang.language.eager.builder import Builder

    builder = Builder.current()
    if builder is None:
        raise RuntimeError("tile.emit is only valid while a tile program is traced")
    for stmt in stmts:
        builder.eval(stmt)


def require_pass_configs(configs: dict) -> None:
    """From a rule, while tracing: compile this program with these TileLang pass configs (they join the
    program's own and the cache key), e.g. a rule that places all its barriers itself turns off
    TileLang's thread-storage-sync pass. Op files never need to know."""
    state().setdefault("pass_configs", {}).update(configs)


def split_index(index, extents: tuple[int, ...]):
    """Unflatten a 1-D block index into len(extents) indices (row-major); pure arithmetic."""
    out = []
    for ext in reversed(extents[1:]):
        out.append(index % ext)
        index = index // ext
    out.append(index)
    return tuple(reversed(out))


def steps_if(cond, steps):
    """A K loop's trip count: `steps` where `cond` holds, else 0; pure arithmetic (cast(cond) * steps).

    Not T.if_then_else(cond, steps, 0): TileLang's simplifier keeps that call opaque, so it cannot prove
    that the count is a multiple of a loop's burst (sm90.in_bursts), and every tail burst (up to
    size - 1 more unrolled copies of the step) is emitted and laid out although it never runs. The
    product keeps steps' divisibility (56 K blocks: 4 | cast(live) * 56): the dead tails go, and
    LayoutInference over the smaller program is 5-10x faster (the grouped MXFP4 kernel: 52 -> 7 s of
    lowering; bench/NOTES.md "Session 72"). The K loop itself is the same.
    Not for a count that is itself clamped split arithmetic (an uneven split-K's last part in fp8_gemm_nt:
    max(min(per, kb - k0), 0)): TileLang 0.1.15's interval analysis then fails ("Cannot match type int32 vs
    handle", LegalizeNegativeIndex). Even splits (per * splits == kb) give every split `per` steps: that count
    is steps_if's (fp8_gemm_nt: 192-wide 2189 -> 662 source lines, 28 -> 7 s; bench/NOTES.md "Session 73")."""
    import tilelang.language as T

    return T.cast(cond, "int32") * steps


def __getattr__(name: str):
    # Words registered by kernel authors after import: tile.<word>(...) dispatches like the rest.
    if name.startswith("_"):
        raise AttributeError(name)
    if name in rules.words():
        return lambda *args, **kwargs: _dispatch(name, *args, **kwargs)
    raise AttributeError(f"codegen.tile has no word {name!r}; known: {', '.join(rules.words())}")
