"""Blackwell (sm_100a): the accumulator lives in tensor memory; each tcgen05 MMA completes on the
accumulator's mbarrier, waited on with parity `step % 2` (step = MMAs into it before this one).
A plain T.gemm here would fall back to the old HMMA path.

mma_block_scaled_loop: block-scaled tcgen05 MMA (kind::mxf8f6f4.block_scale, UTCQMMA) with the
E8M0 scale words moved into tensor memory (UTCCP), in a 128-thread block:
    warp 0  TMA loads of A, B and both scale tiles of a step into slot s % stages (`loaded`)
    warp 2  transposes each scale tile in shared memory into the layout UTCCP takes (`scales`)
    warp 1  copies the scale tiles to TMEM and issues the step's MMA, which frees the slot when it
            completes (`consumed`); after the last, the accumulator's barrier
    all     the epilogue, once the last MMA has completed
Compiled and checked in SASS only: no sm_100a device has run it."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator, emit, state


@register("accumulator", "cuda:sm_100a")
def accumulator(shape, dtype="float32"):
    buf = T.alloc_tmem(list(shape), dtype)
    bar = T.alloc_barrier(1)
    return Accumulator(buf, tuple(shape), dtype, {"bar": bar})


@register("mma", "cuda:sm_100a")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    emit(T.tcgen05_gemm(a, b, acc.buf, False, transpose_b, mbar=acc.extra["bar"], clear_accum=clear),
         T.mbarrier_wait_parity(acc.extra["bar"], step % 2))


@register("limits", "cuda:sm_100a")
def limits():
    return {"smem_bytes": 227 * 1024, "accumulator_columns": 512, "sms": 148}


@T.macro
def _rescale_tmem(tmem, regs, row_scale, step):
    if step > 0:
        T.copy(tmem, regs)
        for i, j in T.Parallel(regs.shape[0], regs.shape[1]):
            regs[i, j] *= row_scale[i]
        T.copy(regs, tmem)


@register("mma_rescaled", "cuda:sm_100a")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    # the accumulator lives in TMEM: bring it through registers to scale it (FA4-style correction)
    regs = acc.extra.get("regs")
    if regs is None:
        regs = acc.extra["regs"] = T.alloc_fragment(acc.shape, acc.dtype)
    _rescale_tmem(acc.buf, regs, row_scale, step)
    emit(T.tcgen05_gemm(a, b, acc.buf, False, transpose_b, mbar=acc.extra["bar"], clear_accum=(step == 0)),
         T.mbarrier_wait_parity(acc.extra["bar"], step % 2))


@register("read_accumulator", "cuda:sm_100a")
def read_accumulator(acc):
    regs = T.alloc_fragment(acc.shape, acc.dtype)
    emit(T.copy(acc.buf, regs))
    return regs


@register("mma_block_scaled_loop", "cuda:sm_100a")
def mma_block_scaled_loop(steps, loads, scale_loads, operands, acc, scale_k=32, stages=2, epilogue=None,
                          scale_dtype="int32"):
    if state()["threads"] != 128:
        raise ValueError(f"mma_block_scaled_loop runs in a 128-thread block on sm_100a, the grid has "
                         f"{state()['threads']}")
    (a_shape, a_dtype), (b_shape, b_dtype) = operands
    a_s = T.alloc_shared((stages, *a_shape), a_dtype)
    b_s = T.alloc_shared((stages, *b_shape), b_dtype)
    sfa_s = T.alloc_shared((stages, a_shape[0]), scale_dtype)       # the scale words as the global ones
    sfb_s = T.alloc_shared((stages, b_shape[0]), scale_dtype)
    sfa_t = T.alloc_tmem([128, a_shape[0] // 128 * 4], "uint32")
    sfb_t = T.alloc_tmem([128, b_shape[0] // 128 * 4], "uint32")
    loaded = T.alloc_barrier([32] * stages)
    scales = T.alloc_barrier([32] * stages)
    consumed = T.alloc_barrier([1] * stages)
    _block_scaled_warps(steps, loads, scale_loads, a_s, b_s, sfa_s, sfb_s, sfa_t, sfb_t, acc.buf, acc.extra["bar"],
                        loaded, scales, consumed, stages, a_shape[1], scale_k)
    (epilogue or (lambda: None))()


@T.macro
def _block_scaled_warps(steps, loads, scale_loads, a_s, b_s, sfa_s, sfb_s, sfa_t, sfb_t, acc, done, loaded, scales,
                        consumed, stages, block_k, scale_k):
    tx = T.get_thread_binding()
    if tx < 32:
        for s in T.serial(steps):
            slot = s % stages
            T.mbarrier_wait_parity(consumed[slot], ((s // stages) & 1) ^ 1)
            a_src, b_src = loads(s)
            sfa_src, sfb_src = scale_loads(s)
            T.tma_copy(a_src, a_s[slot, :, :], barrier=loaded[slot])
            T.tma_copy(b_src, b_s[slot, :, :], barrier=loaded[slot])
            T.tma_copy(sfa_src, sfa_s[slot, :], barrier=loaded[slot])
            T.tma_copy(sfb_src, sfb_s[slot, :], barrier=loaded[slot])
            T.mbarrier_arrive(loaded[slot])
    elif tx < 64:
        for s in T.serial(steps):
            slot = s % stages
            T.mbarrier_wait_parity(scales[slot], (s // stages) & 1)
            T.tcgen05_cp_warpx4(sfa_s[slot, :], sfa_t)
            T.tcgen05_cp_warpx4(sfb_s[slot, :], sfb_t)
            T.tcgen05_gemm_blockscaled(a_s[slot, :, :], b_s[slot, :, :], acc, sfa_t, sfb_t, transpose_B=True,
                                       mbar=consumed[slot], clear_accum=s == 0, k_start=0,
                                       sf_a_granularity_k=scale_k, sf_b_granularity_k=scale_k)
        T.tcgen05_mma_arrive(done)
    elif tx < 96:
        for s in T.serial(steps):
            slot = s % stages
            T.mbarrier_wait_parity(loaded[slot], (s // stages) & 1)
            T.tcgen05_sf_warp_transpose(sfa_s[slot, :])
            T.tcgen05_sf_warp_transpose(sfb_s[slot, :])
            T.fence_proxy_async()
            T.mbarrier_arrive(scales[slot])
    T.mbarrier_wait_parity(done, 0)
