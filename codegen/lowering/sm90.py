"""Hopper (sm_90a): the accumulator lives in registers and T.gemm issues WGMMA
(a warpgroup of 128 threads per 64 rows of the tile)."""

import functools
import operator

import tilelang.language as T

from codegen import tile
from codegen.lowering.common import epilogue_call, pass_factors, prologue_parts, scale_factors
from codegen.rules import options, register
from codegen.tile import Accumulator, emit, require_pass_configs, state


def _policy(acc):
    # 64-row tiles: every warpgroup takes all rows and a slice of the columns (WGMMA's M is 64).
    # Taller tiles: each warpgroup takes 64 rows and every column, so one WGMMA spans the tile's
    # width. (Square split a 128 x 128 tile into 64-column halves: m64n64 instructions that read
    # 64 KB of shared memory per 128-deep K block instead of 48 KB, all of the SM's shared-memory
    # bandwidth at the tensor cores' rate; bench/NOTES.md "GEMM v6".)
    return T.GemmWarpPolicy.FullCol if acc.shape[0] <= 64 else T.GemmWarpPolicy.FullRow


@register("limits", "cuda:sm_90a")
def limits():
    return {"smem_bytes": 227 * 1024, "accumulator_columns": None, "sms": 132}


@register("accumulator", "cuda:sm_90a")
def accumulator(shape, dtype="float32"):
    return Accumulator(T.alloc_fragment(shape, dtype), tuple(shape), dtype)


@register("mma", "cuda:sm_90a")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    return T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=clear, policy=_policy(acc))


@T.macro
def _scale_rows(frag, row_scale):
    for i, j in T.Parallel(frag.shape[0], frag.shape[1]):
        frag[i, j] *= row_scale[i]


@register("mma_rescaled", "cuda:sm_90a")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    _scale_rows(acc.buf, row_scale)  # at step 0 clear_accum discards whatever this produced
    emit(T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=(step == 0), policy=_policy(acc)))


@register("read_accumulator", "cuda:sm_90a")
def read_accumulator(acc):
    return acc.buf


# ---- mma_promoted_loop: one WGMMA group in flight while the previous K step is promoted ----------
# A hand-written producer/consumer pipeline, because TileLang's automatic one releases a stage right
# after the MMA that reads it is issued: with the wait lagging one step (wgmma wait 1), stage s may
# only be released once step s+1 has waited for MMA s.

PRODUCER = 128      # one warpgroup issues the TMA loads
# mma_promoted_loop's barriers (after DeepGEMM's). ELECTED_PRODUCER: one producer warp waits for a
# stage, its elected lane issues the TMA and the warp arrives on the full barrier (count 32; the
# warpgroup's other warps are done after the register shrink); False: all 128 threads wait and arrive.
# LANE_RELEASE: lane 0 of each MMA warp, after the warp's WGMMA wait, arrives on the empty barrier
# (count consumers / 32); False: every MMA thread arrives (count consumers). Measured on the H200
# (profiler kernel times, 3 rounds in rotated order, bench/NOTES.md "Session 27"): the elected
# producer alone took prefill 4096x7168x16384 from 768-770 to 726-728 us and left grouped contiguous
# even (1474-1491 -> 1472-1483); lane-0 release made both slower (prefill 746-748 with it, contiguous
# 1506-1532), so it is off: a warp's arrive is one instruction either way, and predicated on lane 0
# the barrier addresses move from uniform into per-thread registers (the loop's SASS grows by 7%)
ELECTED_PRODUCER = True
LANE_RELEASE = False
PROLOGUE_BAR = 13   # named barrier of the MMA warpgroups after their prologue (TileLang reserves 0-2)
PRODUCER_REGS, CONSUMER_REGS = 24, 240
BURST = 4           # K blocks per iteration of the MMA warpgroups' loop (>= 2): one drain per BURST
COLUMN_BURST = 4    # the same for tiles of column passes (each block drains anyway: this is only unrolling)


def launch_registers(threads: int) -> int:
    """Registers a thread gets at launch under __launch_bounds__(threads, 1): the 64K register file
    split over the block, rounded down to ptxas's allocation unit of 8."""
    return (65536 // threads) // 8 * 8


def check_register_split(threads: int, asks) -> None:
    """setmaxnreg only moves registers between a block's warpgroups: what they ask for, (threads,
    registers) pairs, must fit in the launch allocation, or an .inc waits forever (a hang, not an
    error: session 9 hit it twice)."""
    have = launch_registers(threads) * threads
    need = sum(n * r for n, r in asks)
    if need > have:
        raise ValueError(f"setmaxnreg split {list(asks)} needs {need} registers, the launch of {threads} threads "
                         f"gives {have}")


@register("producer_threads", "cuda:sm_90a")
def producer_threads():
    return PRODUCER


@T.macro
def _fold(acc, p, scale):
    for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
        acc[i, j] += p[i, j] * scale[i]


@T.macro
def _issue(a_s, b_s, full, part, at, stages, policy, mark=None):
    # the MMA of the CTA's K block `at` (a tile's block + the blocks of its tiles before) into its own
    # cleared partial, left in flight. mark: a trace's ("landed", at) once its tiles are there
    T.mbarrier_wait_parity(full[at % stages], (at // stages) % 2)
    if mark is not None:
        mark(("landed", at))
    T.wgmma_gemm(a_s[at % stages, :, :], b_s[at % stages, :, :], part, transpose_B=True, clear_accum=True,
                 policy=policy)


@T.macro
def _prefetch(ahead, scale_of, blk):
    # the factors of block blk's row scales into registers, a block before they are multiplied:
    # loaded at the retire before (or in the prologue), so nothing waits for shared memory between
    # one block's WGMMA issue and the next (ncu: those loads, issued between the WGMMAs, stalled the
    # issuing warps for 1/3 of their samples; bench/NOTES.md "GEMM v6")
    for i in T.Parallel(ahead[0].shape[0]):
        for f, expr in zip(ahead, scale_of(i, blk)):
            f[i] = expr


@T.macro
def _scale_from(scale, ahead):
    for i in T.Parallel(scale.shape[0]):
        scale[i] = functools.reduce(operator.mul, [f[i] for f in ahead])


@T.macro
def _release(empty, slot, share_a):
    # every MMA thread (LANE_RELEASE: lane 0 of each warp, once the warp's WGMMA wait has returned)
    # arrives on its own block's empty[slot]; with A multicast to a cluster of two, lane 0 of each
    # warp also arrives on the other block's: its producer writes A into both
    if LANE_RELEASE:
        if T.get_thread_binding() % 32 == 0:
            T.mbarrier_arrive(empty[slot])
    else:
        T.mbarrier_arrive(empty[slot])
    if share_a > 1:
        if T.get_thread_binding() % 32 == 0:
            T.mbarrier_arrive(empty[slot], cta_id=T.block_rank_in_cluster() ^ 1)


def _arrivals(consumers, share_a):
    """(full, empty) barrier counts of mma_promoted_loop's stages (ELECTED_PRODUCER, LANE_RELEASE)."""
    lanes = consumers // 32
    empty = lanes * share_a if LANE_RELEASE else consumers + (lanes if share_a > 1 else 0)
    return (32 if ELECTED_PRODUCER else PRODUCER), empty


@T.macro
def _retire_fold(empty, acc, part, scale, scale_of, blk, stages, regs, pending, ahead, steps, share_a, base):
    # wait until `pending` MMA groups are left (block blk's is done), free its stage, fold it in with
    # the scale whose factors were loaded a block ago; load the next block's factors meanwhile (steps
    # None: block blk + 1 is one of the loop's, else its index is clamped to the last one)
    T.wait_wgmma(pending)
    _scale_from(scale, ahead)
    _prefetch(ahead, scale_of, _ahead_block(blk, steps))
    _release(empty, (base + blk) % stages, share_a)     # (the last blocks' arrivals are never waited for)
    T.warpgroup_fence_operand(part, 0, num_regs=regs)
    _fold(acc, part, scale)


def _burst(first, count, io):
    """Blocks first .. first + count - 1 (count >= 1, a Python int), leaving no MMA in flight.
    acc a tuple (column passes): _burst_columns.
    Block first + j goes into ping (even j) or pong (odd j) and is issued before block
    first + j - 1 is waited for (wgmma wait 1), so every fold but the burst's last runs under the
    next block's MMA. Unrolled while tracing: each partial has one fixed role, no join or phi."""
    (a_s, b_s, full, empty, ping, pong, acc, scale, scale_of, stages, regs, policy, ahead, steps, share_a, mark,
     base, every) = io
    if isinstance(acc, tuple):
        _burst_columns(first, count, io)
        return
    parts = (ping, pong)
    _issue(a_s, b_s, full, ping, base + first, stages, policy, mark)
    for j in range(1, count):
        _issue(a_s, b_s, full, parts[j % 2], base + first + j, stages, policy, mark)
        _retire_fold(empty, acc, parts[(j - 1) % 2], scale, scale_of, first + j - 1, stages, regs, 1, ahead,
                     steps if every else None, share_a, base)
        if j == 1:
            _mark_first(first, mark)
    _retire_fold(empty, acc, parts[(count - 1) % 2], scale, scale_of, first + count - 1, stages, regs, 0, ahead, steps,
                 share_a, base)
    if count == 1:
        _mark_first(first, mark)


@T.macro
def _mark_first(first, mark):
    # trace: "step 1" once block 0's fold is issued (bench.prof_gemm --trace)
    if mark is not None:
        if first == 0:
            mark("step 1")


def _burst_columns(first, count, io):
    """_burst for a tile of len(acc) column passes (DeepGEMM's schedule): each K block's MMA runs as
    one pass per column slice of B's stage, each into `ping` and waited for (wgmma wait 0), then
    folded into its own acc[p] with that pass's scale; the stage is released after the last pass.
    No second partial: a 128 x 256 tile holds 2 x 64 accumulator registers + 64 a thread, the
    ping-pong's 3 x 128 would not fit. The other MMA warpgroup's passes keep the tensor cores busy
    while this one folds. Per element the same products in the same fold order as the 128-wide
    tiles: the same bits."""
    (a_s, b_s, full, empty, ping, pong, acc, scale, scale_of, stages, regs, policy, ahead, steps, share_a, mark,
     base, every) = io
    width = b_s.shape[1] // len(acc)
    for j in range(count):
        blk = first + j
        at = base + blk
        emit(T.mbarrier_wait_parity(full[at % stages], (at // stages) % 2))
        if mark is not None:
            mark(("landed", at))
        for p, acc_p in enumerate(acc):
            emit(T.wgmma_gemm(a_s[at % stages, :, :], b_s[at % stages, p * width:(p + 1) * width, :], ping,
                              transpose_B=True, clear_accum=True, policy=policy))
            emit(T.wait_wgmma(0))
            _scale_from(scale, pass_factors(ahead, len(acc), p))       # (ahead: a register copy a factor)
            if p == len(acc) - 1:
                _prefetch(ahead, scale_of, _ahead_block(blk, steps if every or j == count - 1 else None))
                _release(empty, at % stages, share_a)
            emit(T.warpgroup_fence_operand(ping, 0, num_regs=regs))
            _fold(acc_p, ping, scale)
        if j == 0:
            _mark_first(first, mark)


def _ahead_block(blk, steps):
    # the block whose scale factors are loaded at block blk's fold. Past the loop's last block they are
    # never used, but the index must stay inside the staged scales; only a burst's last fold can get
    # there (blocks first .. first + count - 1 are all the loop's)
    return blk + 1 if steps is None else T.min(blk + 1, steps - 1)


def _burst_size(acc):
    return COLUMN_BURST if isinstance(acc, tuple) else BURST


def _clear_all(acc):
    # the accumulator, or each column pass's
    for a in (acc if isinstance(acc, tuple) else (acc,)):
        emit(T.clear(a))


@T.macro
def _bursts_of(steps, burst, io, size):
    # the guard is not redundant: where TileLang can bound steps // size by 1 (a split of 4 .. 7
    # steps) it emits the loop's body once, unconditionally, and a shorter last split then waits
    # for tiles that never come (a hang; bench/NOTES.md "MXFP4 v6")
    if steps >= size:
        for q in T.serial(steps // size):
            burst(q * size, size, io)


@T.macro
def _tail(steps, rest, burst, io, size):
    if steps % size == rest:
        burst(steps - rest, rest, io)


def in_bursts(steps, burst, io, size=BURST, tails=True):
    """Steps 0 .. steps - 1 as bursts of `size` (`burst(first, count, io)` emits count steps, a Python
    int, unrolled, and leaves no WGMMA in flight), then the last 1 .. size - 1 as one burst.
    ptxas (13.x) does not follow a WGMMA group across a loop back edge: one still in flight there
    makes it serialize every WGMMA of the kernel (C7514), so nothing may be in flight at the back
    edge or at any join. tails=False: the caller knows steps is a multiple of size, and the size - 1
    tail bursts (as many unrolled steps again as the bursts' own, minus one: 28 more at size 8) are
    not emitted."""
    _bursts_of(steps, burst, io, size)
    if not tails:
        return
    for rest in range(1, size):         # a Python loop: a T.macro would make it a T.serial
        _tail(steps, rest, burst, io, size)


@T.macro
def tma_producer(steps, loads, a_s, b_s, full, empty, stages, share_a=1, ramp=0, elected=False, side=None,
                 mark=None):
    """The TMA warpgroup of a K loop: step s's two tiles (loads(s)) into slot s % stages once the
    MMA warpgroups have released it (empty), each producer thread arriving on full[slot] (TMA adds
    the bytes). share_a = 2: the block pair of a cluster has the same A tiles; rank 0 multicasts
    each to both blocks (TileLang: the other issues nothing for A but still expects its bytes),
    once both blocks' MMA threads have released the slot. ramp > 0: the first `ramp` steps are
    asked for alone, the rest once step 0's tiles have landed (every block's first tiles then
    queue behind fewer bytes at the start; an experiment, bench/NOTES.md "MXFP4 v7").
    elected (full barriers of count 32): only the warpgroup's first warp waits and arrives; its
    elected lane issues the copies (TileLang's tma_copy elects one; it registers the bytes before
    its own arrival, so no phase completes without them); the other warps are done after the
    register shrink. side: mma_promoted_loop's side= (_side_step: its chunks go with the step's
    tiles, on the same full barrier). mark: a trace's ("issued", s) as step s's copies go out."""
    T.set_max_nreg(PRODUCER_REGS, 0)
    if elected:
        if T.get_thread_binding() % PRODUCER < 32:
            _producer_steps(steps, loads, a_s, b_s, full, empty, stages, share_a, ramp, side, mark)
    else:
        _producer_steps(steps, loads, a_s, b_s, full, empty, stages, share_a, ramp, side, mark)


@T.macro
def _side_step(s, side, slot, full):
    # mma_promoted_loop(side=(period, region_of, ring)): a small operand of the promotion (a tile's row
    # scales) in chunks of `period` K blocks, region_of(c) into ring[c % slots] by the producer's TMA:
    # chunks 0 and 1 with block 0's tiles, chunk c + 1 with block c * period's, each on that block's
    # full barrier. So chunk c has landed before any of its blocks' factors are read (a block early),
    # and the slot chunk c + 1 overwrites (chunk c - 2's, with 3 slots) was last read before block
    # (c - 1) * period - 2 was released, which the producer has waited for when period + 2 >= stages
    period, region_of, ring = side
    slots = ring.shape[0]
    if s == 0:
        T.tma_copy(region_of(0), ring[0, :, :], barrier=full[slot])
        T.tma_copy(region_of(1), ring[1, :, :], barrier=full[slot])
    elif s % period == 0:
        T.tma_copy(region_of(s // period + 1), ring[(s // period + 1) % slots, :, :], barrier=full[slot])


@T.macro
def _tma_step(src_a, src_b, a_s, b_s, slot, full, share_a):
    if share_a > 1:
        T.tma_copy(src_a, a_s[slot, :, :], barrier=full[slot], cluster_mask=(1 << share_a) - 1)
    else:
        T.tma_copy(src_a, a_s[slot, :, :], barrier=full[slot])
    T.tma_copy(src_b, b_s[slot, :, :], barrier=full[slot])


@T.macro
def _producer_steps(steps, loads, a_s, b_s, full, empty, stages, share_a, ramp, side, mark=None):
    for s in T.serial(steps):
        slot = s % stages
        if ramp > 0:
            if s == ramp:
                T.mbarrier_wait_parity(full[0], 0)
        T.mbarrier_wait_parity(empty[slot], ((s // stages) % 2) ^ 1)   # step s - stages is done with it
        src_a, src_b = loads(s)
        if mark is not None:
            mark(("issued", s))
        if side is not None:
            _side_step(s, side, slot, full)
        _tma_step(src_a, src_b, a_s, b_s, slot, full, share_a)
        T.mbarrier_arrive(full[slot])


@T.macro
def _overlapped(steps, loads, a_s, b_s, full, empty, start, ping, pong, acc, scale, scale_of, stages, consumers,
                regs, policy, epilogue, prologue, ahead, share_a, mark, side):
    if share_a > 1:
        # both blocks' barriers initialized before either producer multicasts into the other's
        # shared memory or an MMA thread arrives on the other's empty barriers
        tile.cluster_barrier()
    elif len(prologue) > 0:
        T.sync_threads()                # barrier init (and any shared-memory writes) before the split
    # prologue: (), (stage,) or (issue, finish)
    issue, finish = prologue if len(prologue) == 2 else (None, prologue[0] if prologue else None)
    if T.get_thread_binding() >= consumers:
        if issue is not None:
            # the prologue's loads go out before the first TMA: issued behind a grid's worth of
            # tile loads they came back ~8900 cycles later (128x4096x7168, bench/NOTES.md "GEMM v7")
            T.mbarrier_wait_parity(start[0], 0)
        tma_producer(steps, loads, a_s, b_s, full, empty, stages, share_a, elected=ELECTED_PRODUCER, side=side,
                     mark=mark)
    else:
        if issue is not None:
            # before the register grow: that waits for the producer's shrink, which waits for this
            issue()
            T.mbarrier_arrive(start[0])
        T.set_max_nreg(CONSUMER_REGS, 1)
        _clear_all(acc)
        if finish is not None:
            # the MMA warpgroups' own staging (the scales) while the producer's first loads fly;
            # their shared-memory writes are done before any thread of theirs reads them
            finish()
            T.sync_threads(PROLOGUE_BAR, consumers)
        if mark is not None:
            mark("prologue done")
        if steps > 0:
            if side is not None:
                T.mbarrier_wait_parity(full[0], 0)      # block 0's factors come with its tiles
            _prefetch(ahead, scale_of, 0)
        io = (a_s, b_s, full, empty, ping, pong, acc, scale, scale_of, stages, regs, policy, ahead, steps, share_a,
              mark, 0, not CLAMP_LAST_ONLY or side is not None)
        # each iteration is a burst of BURST blocks that drains (wait 0) at its end, with wait 1
        # inside (checked: the same loop fully unrolled keeps wait 1). Fold order and products are
        # those of the v2 loop.
        in_bursts(steps, _burst, io, _burst_size(acc))
        if mark is not None:
            mark("loop done")
        epilogue()
        if share_a > 1:
            # neither block exits while the other may still arrive on its barriers (the producers
            # have exited: exited threads count as arrived)
            tile.cluster_barrier()


# ---- the persistent form (tiles=tile.Tiles): one CTA's tiles back to back ------------------------
# `base` is a local variable (T.alloc_var) in each warpgroup branch: the CTA's K blocks before this
# tile, from which slots and phases continue. TileLang hands a macro a variable as its value unless
# the parameter is annotated T.Ref; plain Python helpers get the value (a read of it).

@T.macro
def _produce_steps(steps, loads, a_s, b_s, full, empty, stages, base: T.Ref):
    # tma_producer's loop for one tile: its block s is the CTA's block base + s
    for s in T.serial(steps):
        at = base + s
        T.mbarrier_wait_parity(empty[at % stages], ((at // stages) % 2) ^ 1)
        src_a, src_b = loads(s)
        _tma_step(src_a, src_b, a_s, b_s, at % stages, full, 1)
        T.mbarrier_arrive(full[at % stages])
    base = base + steps


def _produce_tile(work, a_s, b_s, full, empty, stages, base):
    _produce_steps(work["steps"], work["loads"], a_s, b_s, full, empty, stages, base)


@T.macro
def _tiles_producer(tiles, a_s, b_s, full, empty, stages, start, base: T.Ref):
    T.mbarrier_wait_parity(start[0], 0)      # the first tile's staging copies are issued
    T.set_max_nreg(PRODUCER_REGS, 0)
    base = 0
    if ELECTED_PRODUCER:                     # (tma_producer(elected=True): the first warp only)
        if T.get_thread_binding() % PRODUCER < 32:
            for t in T.serial(tiles.bid, tiles.count, tiles.blocks):
                _produce_tile(tiles.of(t), a_s, b_s, full, empty, stages, base)
    else:
        for t in T.serial(tiles.bid, tiles.count, tiles.blocks):
            _produce_tile(tiles.of(t), a_s, b_s, full, empty, stages, base)


def _then_issue(t, tiles):
    # the next tile's staging copies (cp.async into shared memory, no registers); after the CTA's last
    # tile none (their wait at the next tile's start never comes)
    _issue_if(t + tiles.blocks < tiles.count, tiles.of(T.min(t + tiles.blocks, tiles.count - 1))["prologue"])


@T.macro
def _issue_if(cond, issue):
    if cond:
        issue()


@T.macro
def _set(var: T.Ref, value):
    var = value


@T.macro
def _first_factors(steps, ahead, scale_of):
    if steps > 0:
        _prefetch(ahead, scale_of, 0)


def _consume_tile(t, tiles, loop, c_stage, base, steps, consumers):
    """One tile of a persistent CTA in the MMA warpgroups: wait for its staging copies (issued under
    the last tile), meet, run its bursts from the CTA's block `base`, meet (every fold has read the
    staging), then the next tile's staging copies and this tile's epilogue, in that order where the
    epilogue's tile has memory of its own (tiles.early), else the other way round. base and steps:
    reads of the branch's variables (the tile's step count is set once, here)."""
    a_s, b_s, full, empty, ping, pong, acc, scale, scale_of, stages, regs, policy, ahead = loop
    work = tiles.of(t)
    _set(steps, work["steps"])
    emit(T.ptx_wait_group(0))
    emit(T.sync_threads(PROLOGUE_BAR, consumers))   # everyone's copies landed; the last epilogue is done
    _clear_all(acc)
    _first_factors(steps, ahead, scale_of)
    io = (a_s, b_s, full, empty, ping, pong, acc, scale, scale_of, stages, regs, policy, ahead, steps, 1, None, base,
          not CLAMP_LAST_ONLY)
    in_bursts(steps, _burst, io, _burst_size(acc))
    emit(T.sync_threads(PROLOGUE_BAR, consumers))   # every fold is done with the staging (and the A stages)
    epilogue = epilogue_call(work["epilogue"], c_stage)
    if tiles.early:
        _then_issue(t, tiles)
        epilogue()
    else:
        epilogue()
        emit(T.sync_threads(PROLOGUE_BAR, consumers))   # the epilogue's reads of its tile (over the staging)
        _then_issue(t, tiles)
    _set(base, base + steps)


@T.macro
def _tiles_consumer(tiles, loop, c_stage, start, base: T.Ref, steps: T.Ref, consumers):
    tiles.of(tiles.bid)["prologue"]()         # the first tile's staging copies, before the producer's first TMA
    T.mbarrier_arrive(start[0])
    T.set_max_nreg(CONSUMER_REGS, 1)
    base = 0
    for t in T.serial(tiles.bid, tiles.count, tiles.blocks):
        _consume_tile(t, tiles, loop, c_stage, base, steps, consumers)


@T.macro
def _persistent(tiles, loop, c_stage, start, consumers):
    T.sync_threads()                         # barrier init before the split
    base = T.alloc_var("int32")              # the CTA's K blocks before this tile: slots and phases
    steps = T.alloc_var("int32")             # the MMA warpgroups' current tile's K blocks
    if T.get_thread_binding() >= consumers:
        _tiles_producer(tiles, loop[0], loop[1], loop[2], loop[3], loop[9], start, base)
    else:
        _tiles_consumer(tiles, loop, c_stage, start, base, steps, consumers)


@register("mma_promoted_loop", "cuda:sm_90a")
def mma_promoted_loop(steps, loads, operands, part, acc, scale, scale_of, stages=2, epilogue=None, prologue=None,
                      share_a=1, mark=None, epilogue_stage=None, tiles=None, side=None):
    # the grid was opened with producer_threads() more threads than the MMA warpgroups (and, for
    # share_a = 2, as clusters of two blocks with the same A tiles). mark(event), if given, is called
    # where the MMA warpgroups pass "prologue done", "step 1" and "loop done" (a trace's stamps).
    # epilogue_stage (shape, dtype): epilogue(stage) gets a shared tile of its own layout that TileLang
    # lays over the operand stages (OWN_STAGE_LAYOUT; every TMA write into them has been waited for and
    # every WGMMA reading them has retired before the epilogue runs: the producer loads exactly `steps`
    # blocks).
    # tiles (tile.Tiles): a persistent CTA's tiles, each its own steps, loads, staging copies and
    # epilogue, through one pipeline whose slots and phases carry on from tile to tile. side=(period,
    # region_of, ring): a small operand scale_of reads, loaded by the producer in chunks (_side_step)
    consumers = state()["threads"] - PRODUCER
    if share_a not in (1, 2):
        raise ValueError(f"share_a must be 1 or 2 (blocks of a cluster that share A), got {share_a}")
    if prologue is not None:
        # the prologue runs in the MMA warpgroups' branch, ordered by a named barrier placed here:
        # TileLang's sync pass would put a block-wide one there, which the producer never reaches
        require_pass_configs({"tl.disable_thread_storage_sync": True})
    if side is not None and (tiles is not None or side[0] < 1 or side[0] + 2 < stages or side[2].shape[0] < 3):
        raise ValueError(f"side=(period, region_of, ring) runs in the one-tile loop with period >= 1, period + 2 >= "
                         f"stages and a ring of at least 3 slots, got period={side[0]}, stages={stages}, ring "
                         f"{list(side[2].shape)}, tiles={tiles is not None}")
    if tiles is not None:
        if share_a != 1 or mark is not None or any(x is not None for x in (steps, loads, epilogue, prologue)):
            raise ValueError("mma_promoted_loop(tiles=...) takes each tile's steps, loads, prologue and epilogue from "
                             "tiles.of(t): pass None for those, and no share_a or mark")
        require_pass_configs({"tl.disable_thread_storage_sync": True})
    (a_shape, a_dtype), (b_shape, b_dtype) = operands
    a_s = T.alloc_shared((stages, *a_shape), a_dtype)
    b_s = T.alloc_shared((stages, *b_shape), b_dtype)
    # the producer fills the next tile's stages while a persistent CTA's epilogue runs: there the stage
    # goes over tiles.spare (or is memory of its own); else over the A stages. Either way the MMA
    # threads meet first: the other warpgroup may still read the memory (its last WGMMA, its last
    # scale loads)
    if epilogue_stage is None:
        c_stage = None
    elif tiles is None and OWN_STAGE_LAYOUT:
        c_stage = merged_after_loop(*epilogue_stage)
    else:
        over = _roomiest(a_s, b_s, *epilogue_stage) if tiles is None else (None if tiles.early else tiles.spare)
        c_stage = overlaid(over, *epilogue_stage)
    full_count, empty_count = _arrivals(consumers, share_a)   # TMA adds the bytes to full
    full = T.alloc_barrier([full_count] * stages)
    if share_a > 1:     # the other block's warps arrive too (lane 0 of each)
        empty = T.alloc_cluster_barrier([empty_count] * stages)
    else:
        empty = T.alloc_barrier([empty_count] * stages)
    check_register_split(consumers + PRODUCER, [(PRODUCER, PRODUCER_REGS), (consumers, CONSUMER_REGS)])
    prologue = prologue_parts(prologue)
    # (issue, finish): the MMA threads arrive once their loads are issued; the producer waits for it
    start = T.alloc_barrier([consumers]) if len(prologue) == 2 or tiles is not None else None
    # column passes (acc a tuple: a tile as wide as B's stage, in len(acc) slices) need no second partial
    pong = None if isinstance(acc, tuple) else T.alloc_fragment(part.shape, part.dtype)
    regs = part.shape[0] * part.shape[1] // consumers  # fp32 partial registers per thread
    # scale_of(row, blk) gives the factors of a row's scale; each gets a register copy, a block ahead
    ahead = [T.alloc_fragment(scale.shape, scale.dtype) for _ in scale_factors(scale_of)]
    if tiles is not None:
        loop = (a_s, b_s, full, empty, part.buf, pong, acc, scale, scale_of, stages, regs, _policy(part), ahead)
        _persistent(tiles, loop, c_stage, start, consumers)
        return
    _overlapped(steps, loads, a_s, b_s, full, empty, start, part.buf, pong, acc, scale, scale_of, stages, consumers,
                regs, _policy(part), _met(epilogue_call(epilogue, c_stage), c_stage, consumers), prologue, ahead,
                share_a, mark, side)


def _met(epilogue, c_stage, consumers):
    """The epilogue, after a named barrier of the MMA threads where it has a staging tile (laid over
    memory that the other warpgroup may still be reading)."""
    if c_stage is None:
        return epilogue

    def run():
        emit(T.sync_threads(PROLOGUE_BAR, consumers))
        epilogue()
    return run


def _bytes(shape, dtype) -> int:
    return functools.reduce(operator.mul, shape, 1) * T.dtype(dtype).bits // 8


def _roomiest(a_s, b_s, shape, dtype):
    """The operand stages a staged epilogue tile goes over: A's where it fits (B's are free as well,
    but A's were always chosen), else B's (a 128 x 256 tile's C is more than three A stages)."""
    return a_s if _bytes(shape, dtype) <= _bytes(a_s.shape, a_s.dtype) else b_s


# One tile a CTA: the epilogue's staging tile is a shared buffer of its own that TileLang's aggressive
# shared-memory merge lays over the operand stages (their last use is the K loop), instead of a T.view
# of a stage buffer. A view takes the stage's 128B swizzle, and every staged element then paid ~30
# integer instructions of swizzled address (the prefill's prologue and epilogue: 2263 SASS instructions a
# warp, ~975 without; kernel times -1.6% prefill, -4.4% masked 1 x 1024, up to -7% decode: bench/NOTES.md
# "Session 29")
OWN_STAGE_LAYOUT = True
# the scale loads a block ahead clamp their block index to steps - 1 at a burst's last fold only: the
# others load blocks of the burst. Written at every fold, the clamp's `steps` (an expression of the block
# index: the masked layout's divides by the runtime tile count, partly in 64 bits) was recomputed
# at each: masked 128 x 256's 4-block burst 381 -> 332 SASS instructions, thin 64 x 64 221 -> 201.
# H200 kernel times, bitwise: masked 1x1024x4096x7168 48.75 -> 48.2 us, decode shapes 0-1.3% faster.
# Not with the sfa ring (side=): the prefill's loop then spilled a register and ran 0.9% slower
# (717.5 -> 724 us). Binding steps to a register, or clamping to a static last block, made ptxas spill
# in the masked loop at the MMA warpgroups' 240 registers (bench/NOTES.md "Session 30")
CLAMP_LAST_ONLY = True
# (switches read while a kernel is traced: part of the kernel caches' key, codegen.rules.options)
options(__name__, "ELECTED_PRODUCER", "LANE_RELEASE", "BURST", "COLUMN_BURST", "OWN_STAGE_LAYOUT", "CLAMP_LAST_ONLY")


def merged_after_loop(shape, dtype):
    """A shared tile of its own, plain row-major, whose memory TileLang may share with buffers that are
    dead by its first use (tl.enable_aggressive_shared_memory_merge: liveness in program order). Only for
    a tile first used after the K loop of a one-tile-a-CTA kernel: the producer's last TMA write has been
    waited for and the last WGMMA retired by then (a persistent CTA's next tile is already loading)."""
    require_pass_configs({"tl.enable_aggressive_shared_memory_merge": True})
    return T.alloc_shared(shape, dtype)


def overlaid(buf, shape, dtype):
    """A 1-D shared tile of `shape` (elements,) and `dtype` on the memory of shared buffer `buf` where it
    fits, else (or for buf None) a new one. TileLang gives a view of a buffer the buffer's own layout
    (an operand's swizzle), so the view spans all of `buf`: its elements past `shape` are not used.
    The caller guarantees that nothing uses `buf` any more wherever the tile is used."""
    (count,) = shape
    total = 0 if buf is None else _bytes(buf.shape, buf.dtype)
    if _bytes(shape, dtype) > total:
        return T.alloc_shared(shape, dtype)
    return T.view(buf, (total * 8 // T.dtype(dtype).bits,), dtype)
