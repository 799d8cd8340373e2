"""Hopper (sm_90a) mma_decoded_loop: the decode of K step s+1 runs while the WGMMA of step s is in flight.

    producer (the last 128 threads)  TMA loads of A and of the raw B tile of each step into `stages` slots
    MMA warpgroups (the rest)        decode the raw tile of step s into decoded buffer s % 2, then issue
                                     the WGMMA of step s and wait for the one of step s-1 (wgmma wait 1)

TileLang's own pipeline waits for every gemm right after issuing it, and its decoded tile is single-
buffered, so the decode and the MMA of a step ran one after the other (bench/NOTES.md "MXFP4 v4":
12-15% of the warp samples on that wait). Here the decoded tile has two buffers: step s writes
buffer s % 2 while the MMA of step s-1 reads the other one.

As in mma_promoted_loop, the steps run in unrolled bursts that drain (wgmma wait 0) at their end
(sm90.in_bursts: ptxas C7514).

Barriers are placed here by hand (the rule turns TileLang's thread-storage-sync pass off, which would
otherwise put block-wide barriers inside the MMA warpgroups' branch):
    full[slot]   producer arrivals + TMA bytes: A and the raw tile of the step are in slot
    empty[slot]  the MMA warpgroups are done with slot (the WGMMA that read A has completed)
    DECODE_BAR   named barrier of the MMA warpgroups: before a decode (every warpgroup has waited for
                 the MMA that read this buffer two steps ago; before the first, the prologue's writes
                 are done) and after it (the whole tile is written)
The MMA warpgroups run the caller's prologue (staging the decode reads, e.g. the scales) after the
block's first barrier, so the producer's first loads are in flight meanwhile.
"""

import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout, make_half_bank_swizzled_layout

from codegen.rules import register
from codegen.tile import emit, require_pass_configs, state
from codegen.lowering.sm90 import (BURST, CONSUMER_REGS, PRODUCER, PRODUCER_REGS, _policy, check_register_split,
                                   in_bursts, launch_registers, tma_producer)

DECODE_BAR = 13        # named barrier id (TileLang reserves 0-2)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def _full_barriers(stages):
    # every producer thread arrives (TMA adds the bytes). The FP8 loops' elected producer (one warp
    # arriving, sm90.ELECTED_PRODUCER) measured no faster here: bitwise, kernel times within 1% on 8
    # MXFP4 shapes (bench/NOTES.md "Session 31")
    return T.alloc_barrier([PRODUCER] * stages)


def _step(j, first, io):
    """Step first + j of a burst (j a Python int): wait for its tiles, decode, issue its WGMMA, and
    retire the previous step's (wait 1) when there is one in this burst."""
    a_s, r_s, b_s, full, empty, acc, decode, stages, consumers, policy = io
    s = first + j
    slot = s % stages
    buf = s % 2
    emit(T.sync_threads(DECODE_BAR, consumers))             # buffer `buf`'s last reader (step s-2) is done
    emit(T.mbarrier_wait_parity(full[slot], (s // stages) % 2))
    decode(lambda i, w: r_s[slot, i, w], lambda i, c: b_s[buf, i, c], s)
    emit(T.fence_proxy_async())                             # generic stores -> WGMMA reads
    emit(T.sync_threads(DECODE_BAR, consumers))             # the whole decoded tile is written
    emit(T.wgmma_gemm(a_s[slot, :, :], b_s[buf, :, :], acc, transpose_B=True, clear_accum=False, policy=policy))
    if j > 0:
        emit(T.wait_wgmma(1))                               # step s-1's WGMMA is done
        emit(T.mbarrier_arrive(empty[(s - 1) % stages]))


def _burst(first, count, io):
    empty, stages = io[4], io[7]
    for j in range(count):
        _step(j, first, io)
    emit(T.wait_wgmma(0))
    emit(T.mbarrier_arrive(empty[(first + count - 1) % stages]))


def consumer_regs(consumers: int) -> int:
    """Registers a thread of the MMA warpgroups asks for (setmaxnreg.inc): at most CONSUMER_REGS, and
    only what the producer gives back from the launch allocation (sm90.check_register_split; 120 at
    512 MMA threads hung the H200 in session 9, 112 is the most there)."""
    threads = consumers + PRODUCER
    share = (launch_registers(threads) * threads - PRODUCER_REGS * PRODUCER) // consumers
    return min(CONSUMER_REGS, share // 8 * 8)


@T.macro
def _warpgroups(steps, loads, a_s, r_s, b_s, full, empty, acc, decode, stages, consumers, policy, prologue, epilogue):
    T.sync_threads()                    # the program's own shared-memory writes before the loop are done
    if T.get_thread_binding() >= consumers:
        tma_producer(steps, loads, a_s, r_s, full, empty, stages)
    else:
        T.set_max_nreg(consumer_regs(consumers), 1)
        T.clear(acc)
        # the MMA warpgroups' own staging (e.g. scales) while the first loads fly; the first step's
        # DECODE_BAR orders its shared-memory writes before any decode reads them
        prologue()
        io = (a_s, r_s, b_s, full, empty, acc, decode, stages, consumers, policy)
        in_bursts(steps, _burst, io)
        epilogue()


@register("mma_decoded_loop", "cuda:sm_90a")
def mma_decoded_loop(steps, loads, operands, acc, decode, stages=2, prologue=None, epilogue=None, swizzle_raw=False):
    # the grid was opened with producer_threads() more threads than the MMA warpgroups
    # swizzle_raw: the raw tile swizzled by TMA (64-byte rows: 64-byte swizzle), so that a quarter-warp reading the
    # same 16 bytes of 8 consecutive rows hits 8 different bank groups (a decode whose warps walk rows)
    consumers = state()["threads"] - PRODUCER
    check_register_split(consumers + PRODUCER, [(PRODUCER, PRODUCER_REGS), (consumers, consumer_regs(consumers))])
    require_pass_configs(PASS_CONFIGS)
    (a_shape, a_dtype), (raw_shape, raw_dtype), (b_shape, b_dtype) = operands
    a_s = T.alloc_shared((stages, *a_shape), a_dtype)
    r_s = T.alloc_shared((stages, *raw_shape), raw_dtype)
    if swizzle_raw:
        T.annotate_layout({r_s: (make_half_bank_swizzled_layout if raw_shape[1] * 4 == 64
                                 else make_full_bank_swizzled_layout)(r_s)})
    b_s = T.alloc_shared((2, *b_shape), b_dtype)
    full = _full_barriers(stages)
    empty = T.alloc_barrier([consumers] * stages)
    _warpgroups(steps, loads, a_s, r_s, b_s, full, empty, acc.buf, decode, stages, consumers, _policy(acc),
                prologue or (lambda: None), epilogue or (lambda: None))


# ---- mma_register_decoded_loop: the decoded operand goes from registers into the WGMMA ---------
# The decoded tile is the WGMMA's A operand, read from registers (wgmma ... RS): no decoded tile in
# shared memory, no fence.proxy.async or named barrier between the decode and the MMA, and each
# warpgroup runs on its own (bench/NOTES.md "MXFP4 v6").
#
# A thread's fragment of a 128-deep K step (WGMMA's register layout) is, for each k16 WGMMA j, the
# value pairs at K 16j + 2c and 16j + 8 + 2c (c: the thread's place in its quad) of its two rows r
# and r + 8. With two e2m1 codes a byte, that is byte c of the raw row's 32-bit words 2j and 2j + 1:
# each thread reads all 16 words of its two rows (a quad's four threads read the same 16 bytes at
# once, a broadcast) and decodes the bytes at its place. So the other operand keeps its natural K
# order. The raw tile is swizzled by TMA (64-byte rows: 64-byte swizzle, longer rows: 128-byte), so
# that the 8 rows a warp reads at once fall in different banks.

FRAGMENT_K = 128


def _reg_step(j, first, io):
    """Stage first + j of a burst: wait for its tiles, then for each 128-deep part of it decode into a
    fragment, issue the WGMMA and retire the previous part's (wait 1: the fragment's last reader, two
    parts back, is then done; the previous stage's slot is free once its last part is). One fragment
    (two blocks an SM): each part waits for its own WGMMA (wait 0) before the next decode overwrites
    the registers. Raw words a step ahead (regs): first wait for stage s + 1 and load its raw words
    into the other register buffer, then decode stage s from the words loaded a step earlier (the
    loads' latency under this decode; measured no faster on the MXFP4 kernel, bench/NOTES.md "MXFP4 v8")."""
    s_s, r_s, frags, full, empty, acc, decode, stages, rows, place, policy, mark, regs, steps, (temps, pfactor), \
        _tile_done, (chain, chains) = io
    one_temp = temps is not None and len(temps) == 1
    parts = int(s_s.shape[2]) // FRAGMENT_K
    s = first + j               # this chain's step
    if chains > 1:              # the loop's: chain c takes steps c, c + chains, ...
        s = s * chains + chain
    slot = s % stages
    if regs is None:
        emit(T.mbarrier_wait_parity(full[slot], (s // stages) % 2))
    else:   # first is a multiple of BURST (even): buffer j % 2 holds step s
        _fetch_raw(s + 1, steps, full, r_s, stages, regs[(j + 1) % 2], decode[0], rows)
    if mark is not None:
        mark("data", s)
    for u in range(parts):
        idx = j * parts + u
        frag = frags[idx % len(frags)]
        if regs is None:
            decode(lambda i, w, u=u: r_s[slot, i, u * FRAGMENT_K // 8 + w], rows, place, s * parts + u, frag.data)
        else:
            decode[1](regs[j % 2].data, rows, place, s, frag.data)
        if mark is not None:
            mark("decoded", s)
        before = s - chains if u == 0 else s      # the step of this chain's part before (a factor's step)
        if one_temp and idx > 0:
            # one temporary: the part before (still in it) retires and is added before this part's WGMMAs reuse it
            emit(T.wait_wgmma(0))
            if u == 0:
                emit(T.mbarrier_arrive(empty[(s - 1) % stages]))
            _promote(acc, temps[0], pfactor, before)
        if temps is None:
            emit(T.wgmma_gemm(frag, s_s[slot, :, u * FRAGMENT_K:(u + 1) * FRAGMENT_K], acc, transpose_B=True,
                              clear_accum=False, policy=policy))
        else:   # promote: this part's product into a fresh temporary, added to acc once it has landed
            emit(T.wgmma_gemm(frag, s_s[slot, :, u * FRAGMENT_K:(u + 1) * FRAGMENT_K], temps[idx % len(temps)],
                              transpose_B=True, clear_accum=True, policy=policy))
        if mark is not None:
            mark("launched", s)
        if one_temp:
            pass            # retired and added before the next part's WGMMAs (above) or at the burst's drain
        elif len(frags) == 1:
            emit(T.wait_wgmma(0))
            if u == parts - 1:
                emit(T.mbarrier_arrive(empty[slot]))
        elif idx > 0:
            emit(T.wait_wgmma(1))
            if u == 0:
                emit(T.mbarrier_arrive(empty[(s - chains) % stages]))   # this chain's step before
            if temps is not None:
                _promote(acc, temps[(idx - 1) % 2], pfactor, before)
    if mark is not None:
        mark("issued", s)


def _fetch_raw(s, steps, full, r_s, stages, buf, load, rows):
    # stage s's raw words of this thread's rows into registers `buf`, once its tiles have landed
    _when(s < steps, lambda: _fetch_raw_now(s, full, r_s, stages, buf, load, rows))


def _fetch_raw_now(s, full, r_s, stages, buf, load, rows):
    emit(T.mbarrier_wait_parity(full[s % stages], (s // stages) % 2))
    load(lambda i, w: r_s[s % stages, i, w], rows, buf.data)


@T.macro
def _when(cond, body):
    if cond:
        body()


@T.macro
def _promote(acc, temp, factor, step):
    # acc += a part's product (promote=True: FP8 WGMMAs keep fewer bits than fp32 over a long K), times
    # factor(j, step) for column j when promote is a callable
    if factor is None:
        for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] += temp[i, j]
    else:
        for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
            acc[i, j] += temp[i, j] * factor(j, step)


def _reg_burst(first, count, io):
    frags, empty, stages, (temps, pfactor), tile_done, (chain, chains) = io[2], io[4], io[7], io[14], io[15], io[16]
    parts = int(io[0].shape[2]) // FRAGMENT_K
    for j in range(count):
        _reg_step(j, first, io)
    if len(frags) > 1:
        emit(T.wait_wgmma(0))
        last = first + count - 1
        last = last if chains == 1 else last * chains + chain      # the loop's step
        emit(T.mbarrier_arrive(empty[last % stages]))
        if temps is not None:
            _promote(io[5], temps[(count * parts - 1) % len(temps)], pfactor, last)
    if tile_done is not None:   # nothing in flight here (the burst drained): a tile's accumulator is complete
        _tile_boundary(first + count, tile_done[0], io[13], tile_done[1], io[5])


@T.macro
def _tile_boundary(done, period, steps, fn, acc):
    # tile_done: after the burst that ends tile done / period - 1 (not the last: the epilogue stores that one), its
    # accumulator goes out and is cleared for the next tile, while the producer keeps streaming the next one's stages
    if done % period == 0 and done < steps:
        fn(done // period - 1)
        T.clear(acc)


def _preload(preload, pre):
    # the producer's first TMA copies, ahead of the stages (they reach the memory system first)
    for src, dst in preload:
        emit(T.tma_copy(src, dst, barrier=pre[0]))
    emit(T.mbarrier_arrive(pre[0]))


@T.macro
def _reg_warpgroups(steps, loads, s_s, r_s, frags, full, empty, acc, decode, stages, consumers, grow, policy,
                    prologue, epilogue, mark, preload, pre, ramp, regs, temps, tile_done, burst, tails, chains):
    T.sync_threads()                    # barrier init (and any shared-memory writes) before the split
    if T.get_thread_binding() >= consumers:
        if pre is not None:
            _preload(preload, pre)
        tma_producer(steps, loads, s_s, r_s, full, empty, stages, ramp=ramp)
    else:
        T.set_max_nreg(grow, 1)
        if mark is not None:
            mark("entry", 0)
        T.clear(acc)
        if prologue is not None:
            prologue()
            T.sync_threads(DECODE_BAR, consumers)      # the prologue's shared-memory writes are done
        if pre is not None:
            T.mbarrier_wait_parity(pre[0], 0)           # the preloaded tiles are in shared memory
        if mark is not None:
            mark("prologue done", 0)
        tid = T.get_thread_binding()
        # the thread's fragment rows (warp w holds rows 16w .. 16w + 15) and its place in the quad; with chains, the
        # raw rows of its chain's block (each chain decodes all of them) and the chain's share of the steps
        span = consumers // chains
        chain = tid // span
        r = (tid if chains == 1 else tid % span) // 32 * 16 + tid % 32 // 4
        io = (s_s, r_s, frags, full, empty, acc, decode, stages, (r, r + 8), tid % 4, policy, mark, regs, steps,
              temps, tile_done, (chain, chains))
        if regs is not None:
            _fetch_raw(0, steps, full, r_s, stages, regs[0], decode[0], (r, r + 8))
        in_bursts(steps if chains == 1 else (steps + chains - 1 - chain) // chains, _reg_burst, io, burst, tails=tails)
        if mark is not None:
            mark("loop done", 0)
        epilogue()
        if mark is not None:
            mark("stored", 0)


@register("mma_register_decoded_loop", "cuda:sm_90a")
def mma_register_decoded_loop(steps, loads, operands, acc, decode, stages=4, prologue=None, epilogue=None,
                              blocks_per_sm=1, mark=None, preload=(), ramp=0, promote=False, tile_done=None,
                              burst=BURST, temps=2, whole_bursts=False, chains=1):
    # decode: decode(raw_at, rows, place, step, dst) reads the raw words from shared memory itself; or
    # a pair (load(raw_at, rows, buf), decode_from(buf, rows, place, step, dst)): the raw words of a
    # thread's rows go into registers (buf, 2 * raw row words) one step ahead of their decode
    # (stages of one part, one block an SM)
    # operands: the shared operand (cols, parts * FRAGMENT_K), the raw tile (rows, parts *
    # FRAGMENT_K / 8) int32 words (two e2m1 codes a byte) and the decoded tile (rows, FRAGMENT_K),
    # in registers; a stage's parts are decoded and multiplied one after the other.
    # blocks_per_sm = 2: twice the warps an SM to hide the decode's latencies, in half the registers
    # (one fragment, each step's WGMMA waited for before the next decode).
    # mark(event, step), if given, is called by the MMA threads at "entry", "prologue done", each
    # step's "data" (its tiles have arrived), "decoded" (its fragment is in registers; with parts > 1,
    # the last part's), "launched" (its
    # WGMMAs issued) and "issued" (the step before's WGMMAs retired, its stage released), "loop done"
    # and "stored" (after the epilogue).
    # preload: (global region, shared buffer) pairs the producer copies by TMA before the first
    # stage, so that their requests reach memory ahead of the stages' (a prologue's loads by the MMA
    # threads queue behind them: bench/NOTES.md "MXFP4 v7"); the MMA threads wait for them after
    # the prologue.
    # ramp > 0 (< stages): the producer asks for the first `ramp` stages alone, the rest once the
    # first has landed (sm90.tma_producer)
    # promote=True (one block an SM): each part's WGMMAs go into a fresh fp32 temporary (two, alternating), added
    # to acc once they have retired: FP8 WGMMA accumulates in fewer bits than fp32 (DeepSeek-V3's report, ~14),
    # so a long K is summed in fp32 a 128-deep part at a time; promote=factor (a callable, stages of one part):
    # acc[i, j] += temp[i, j] * factor(j, step), e.g. an operand's per-(column, K block) scale
    # tile_done=(period, fn) (several output tiles a block, one after the other in one stream of steps; period a
    # multiple of burst): after the burst that completes steps t * period .. (t + 1) * period - 1, fn(t) stores the
    # accumulator and it is cleared, unless that was the last step (the epilogue's tile); the producer never stops
    # temps (promote): 2 temporaries, a part's WGMMA into one while the part before is added from the other; 1: a
    # third fewer registers (wide token tiles: 128 tokens, acc + 2 temps + 2 fragments would be 224 a thread): the
    # part before is waited for and added just before the next part's WGMMAs are issued, after its decode
    # whole_bursts=True: the caller promises steps % burst == 0 (e.g. steps is 0 or k / 128 with k / 128 a multiple of
    # burst): the tail bursts of 1 .. burst - 1 steps are not emitted (a third to a fifth of the code to lower and run)
    # chains=2: the MMA warpgroups take alternate K steps of the same rows (warpgroup w steps w, w + 2, ...), each
    # into its own half of acc (rows [w * R, (w + 1) * R) for R = the raw tile's rows; the caller adds the halves
    # in its epilogue): two decoding warpgroups an SM on R = 64 weight rows, without a split. Two MMA warpgroups,
    # one block an SM, a decode from shared memory, no tile_done, promote with two temporaries (each warpgroup
    # promotes its own half, a factor given the loop's step); the raw tile has R rows and the decoded operand 2R
    # (its rows R + i are raw row i of the other chain's steps); mark's steps are the loop's (each chain marks its
    # own)
    # burst: steps between the loop's WGMMA drains (sm90.in_bursts; unrolled, plus tails of 1 .. burst - 1). Each drain
    # waits for the last step's WGMMA before the next decode starts: at 64 tokens ~350 cycles (bench/NOTES.md
    # "Session 47")
    consumers = state()["threads"] - PRODUCER
    (s_shape, s_dtype), (raw_shape, raw_dtype), (d_shape, d_dtype) = operands
    parts = s_shape[1] // FRAGMENT_K
    if chains not in (1, 2) or (chains == 2 and (consumers != 256 or blocks_per_sm != 1 or isinstance(decode, tuple)
                                                  or (promote is not False and temps != 2)
                                                  or tile_done is not None)):
        raise ValueError(f"chains must be 1 or 2; 2 takes two MMA warpgroups, one block an SM, a decode from shared "
                         f"memory, no tile_done and with promote two temporaries: got chains={chains!r} at "
                         f"{consumers} MMA threads, blocks_per_sm={blocks_per_sm}, temps={temps!r}")
    if (parts not in (1, 2, 4) or s_shape[1] != parts * FRAGMENT_K or d_shape[1] != FRAGMENT_K
            or tuple(raw_shape) != (d_shape[0] // chains, parts * FRAGMENT_K // 8) or d_shape[0] != consumers // 2):
        raise ValueError(f"mma_register_decoded_loop takes K stages of 1, 2 or 4 parts of {FRAGMENT_K}, raw rows "
                         f"of {FRAGMENT_K // 8} words a part and 16 rows a warp: operands {operands} at "
                         f"{consumers} MMA threads")
    if blocks_per_sm not in (1, 2):
        raise ValueError(f"blocks_per_sm must be 1 or 2, got {blocks_per_sm}")
    if promote is not False and (blocks_per_sm != 1 or isinstance(decode, tuple) or (callable(promote) and parts != 1)):
        raise ValueError(f"promote takes one block an SM and a decode from shared memory (a factor: stages of one "
                         f"part), got blocks_per_sm={blocks_per_sm}, {parts} parts")
    if temps not in (1, 2) or (temps == 1 and promote is False):
        raise ValueError(f"temps (the promotion's temporaries) must be 1 or 2, with promote, got temps={temps!r}, "
                         f"promote={promote!r}")
    if not 0 <= ramp < stages:
        raise ValueError(f"ramp must be in [0, stages={stages}), got {ramp}")
    if not isinstance(burst, int) or not 2 <= burst <= 16:
        raise ValueError(f"burst must be an int in [2, 16] (steps between WGMMA drains), got {burst!r}")
    if tile_done is not None and (blocks_per_sm != 1 or isinstance(decode, tuple) or tile_done[0] % burst):
        raise ValueError(f"tile_done takes one block an SM, a decode from shared memory and a period that is a "
                         f"multiple of burst={burst} (tiles end where bursts do), got blocks_per_sm={blocks_per_sm}, "
                         f"period {tile_done[0]}")
    threads = consumers + PRODUCER
    have = launch_registers(threads * blocks_per_sm)
    grow = min(CONSUMER_REGS, (have * threads - PRODUCER_REGS * PRODUCER) // consumers // 8 * 8)
    check_register_split(threads * blocks_per_sm, [(PRODUCER * blocks_per_sm, PRODUCER_REGS),
                                                   (consumers * blocks_per_sm, grow)])
    require_pass_configs(PASS_CONFIGS)
    if blocks_per_sm > 1:
        emit(T.annotate_min_blocks_per_sm(blocks_per_sm))   # __launch_bounds__(threads, 2)
    s_s = T.alloc_shared((stages, *s_shape), s_dtype)
    r_s = T.alloc_shared((stages, *raw_shape), raw_dtype)
    # a warp reads 8 rows' same 16 bytes at once: swizzled (TMA), they fall in different banks
    swizzle = make_half_bank_swizzled_layout if parts == 1 else make_full_bank_swizzled_layout
    T.annotate_layout({r_s: swizzle(r_s)})
    frags = [T.alloc_fragment(d_shape, d_dtype) for _ in range(3 - blocks_per_sm)]
    regs = None
    if isinstance(decode, tuple):
        if parts != 1 or blocks_per_sm != 1 or burst % 2:
            raise ValueError(f"raw words a step ahead need stages of one part and one block an SM (an even burst), "
                             f"got {parts} parts, blocks_per_sm={blocks_per_sm}")
        regs = [T.alloc_local((2 * raw_shape[1],), raw_dtype) for _ in range(2)]
    temps = [T.alloc_fragment(acc.shape, "float32") for _ in range(temps)] if promote is not False else None
    pfactor = promote if callable(promote) else None
    full = _full_barriers(stages)
    empty = T.alloc_barrier([consumers // chains] * stages)      # a slot's step is one chain's
    pre = T.alloc_barrier([PRODUCER]) if preload else None
    _reg_warpgroups(steps, loads, s_s, r_s, frags, full, empty, acc.buf, decode, stages, consumers, grow,
                    T.GemmWarpPolicy.FullRow, prologue, epilogue or (lambda: None), mark, tuple(preload), pre,
                    ramp, regs, (temps, pfactor), tile_done, burst, not whole_bursts, chains)
