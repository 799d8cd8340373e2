"""Ascend 950 mma_decoded_loop: a GEMM whose B operand is decoded on chip, by the vector cores.

Per step: A (block_m, block_k) goes from global memory straight into L1; each vector core copies its half of the
raw B rows (tile.split_rows) into UB and decodes them there into its half of the B tile; a dual copy puts both
halves into the L1 operand tile (ND -> NZ on the way, 16-bit B: the Cube's bf16/fp16 MMA); the Cube multiplies
into L0C. The decode is called as decode(raw_at, tile, step, rows=(count, first)): raw_at(i, j) reads this core's
raw row i (the B tile's row first + i), tile is this core's (count, block_k) part of the decoded tile in UB.
prologue() runs once in a vector region (staging what the decode reads, in each core's UB). Generated Ascend C
only: no Ascend device has run it."""

import tilelang.ascend.language as A
import tilelang.language as T

from codegen.lowering.ascend import narrow, split_rows
from codegen.rules import register
from codegen.tile import state


@register("mma_decoded_loop", "ascend")
def mma_decoded_loop(steps, loads, operands, acc, decode, stages=2, prologue=None, epilogue=None, swizzle_raw=False):
    (a_shape, a_dtype), (raw_shape, raw_dtype), (b_shape, b_dtype) = operands
    if str(b_dtype) not in ("bfloat16", "float16"):
        raise ValueError(f"mma_decoded_loop on ascend:950 decodes into a 16-bit B tile (the vector cores' UB -> L1 "
                         f"copy converts ND to NZ for 16- and 32-bit types), got {b_dtype}")
    threads = state().get("threads", 128)
    a_l1 = A.alloc_l1(tuple(a_shape), a_dtype)
    b_l1 = A.alloc_l1(tuple(b_shape), b_dtype)
    count, first = split_rows(int(b_shape[0]))
    raw = A.alloc_shared((count, int(raw_shape[1])), raw_dtype)
    tile_ub = A.alloc_shared((count, int(b_shape[1])), b_dtype)
    if prologue is not None:
        _in_vector(prologue, threads)
    # the step's copies as (source region, destination), built in Python (the loop's DSL would bind regions)
    copies = [lambda s: (loads(s)[0], a_l1), lambda s: (narrow(loads(s)[1], -2, first, count), raw)]
    _loop(steps, copies, lambda s: decode(lambda i, j: raw[i, j], tile_ub, s, rows=(count, first)), tile_ub, a_l1,
          b_l1, acc.buf, stages, threads)
    if epilogue is not None:
        epilogue()


@T.macro
def _in_vector(fn, threads):
    with A.SimtVF(threads=threads):
        fn()


@T.macro
def _loop(steps, copies, decode_step, tile_ub, a_l1, b_l1, acc, stages, threads):
    for s in A.Pipelined(steps, num_stages=stages):
        for copy in copies:
            A.copy(*copy(s))
        with A.SimtVF(threads=threads):
            decode_step(s)
        A.dual_copy(tile_ub, b_l1)
        A.gemm(a_l1, b_l1, acc, transpose_B=True, clear_accum=(s == 0))
