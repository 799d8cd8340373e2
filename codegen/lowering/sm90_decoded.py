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

from codegen.rules import register
from codegen.tile import emit, require_pass_configs, state
from codegen.lowering.sm90 import (CONSUMER_REGS, PRODUCER, PRODUCER_REGS, _policy, check_register_split, in_bursts,
                                   launch_registers, tma_producer)

DECODE_BAR = 13        # named barrier id (TileLang reserves 0-2)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


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
def mma_decoded_loop(steps, loads, operands, acc, decode, stages=2, prologue=None, epilogue=None):
    # the grid was opened with producer_threads() more threads than the MMA warpgroups
    consumers = state()["threads"] - PRODUCER
    check_register_split(consumers + PRODUCER, [(PRODUCER, PRODUCER_REGS), (consumers, consumer_regs(consumers))])
    require_pass_configs(PASS_CONFIGS)
    (a_shape, a_dtype), (raw_shape, raw_dtype), (b_shape, b_dtype) = operands
    a_s = T.alloc_shared((stages, *a_shape), a_dtype)
    r_s = T.alloc_shared((stages, *raw_shape), raw_dtype)
    b_s = T.alloc_shared((2, *b_shape), b_dtype)
    full = T.alloc_barrier([PRODUCER] * stages)        # every producer thread arrives; TMA adds the bytes
    empty = T.alloc_barrier([consumers] * stages)
    _warpgroups(steps, loads, a_s, r_s, b_s, full, empty, acc.buf, decode, stages, consumers, _policy(acc),
                prologue or (lambda: None), epilogue or (lambda: None))
