"""Ascend 950 mma_block_scaled_loop: the Cube's block-scaled MAD (OCP MX scales, one E8M0 byte per 32 K values,
riding in the MAD as on sm_100a's UTCQMMA). Per step, everything goes straight from global memory to L1:

    A (block_m, 128) and B (block_n, 128) of one 8-bit dtype, SFA (block_m, 4) and SFB (block_n, 4) E8M0
    acc (L0C) += (A * SFA) @ (B * SFB)^T           (Cube, ascend_blockscaled_gemm_l1)

TileLang 0.1.15's Ascend block-scaled MAD takes A and B of one dtype, and its UB -> L1 copies convert ND to the
Cube's NZ order for 16- and 32-bit types only, so e2m1 B cannot be widened to e4m3 on chip: a program with e4m3 A
passes its MXFP4 weights widened to e4m3 once (exact: every e2m1 value is an e4m3 value, the E8M0 scales
unchanged; ops.gemm_mxfp4_native.widen_e2m1_to_e4m3). The scales arrive as sm_100a's scale words (a step's 4
E8M0 bytes of a row in one int32, step-major) and are read as bytes. Generated Ascend C only: no Ascend device
has run it."""

import tilelang.ascend.language as A
import tilelang.language as T

from codegen.rules import register

MX = 32   # K values per E8M0 scale


def _is_fp4(dtype) -> bool:
    return "float4_e2m1" in str(dtype)   # float4_e2m1fn, or sm_100a's shared-memory form float4_e2m1_unpacked


@register("mma_block_scaled_loop", "ascend")
def mma_block_scaled_loop(steps, loads, scale_loads, operands, acc, scale_k=32, stages=2, epilogue=None,
                          scale_dtype="int32"):
    (a_shape, a_dtype), (b_shape, b_dtype) = operands
    if scale_k != MX:
        raise ValueError(f"mma_block_scaled_loop on ascend:950 takes OCP MX scales (scale_k={MX}), got {scale_k}")
    if str(scale_dtype) != "int32":
        raise ValueError(f"mma_block_scaled_loop on ascend:950 reads int32 scale words, got scale_dtype="
                         f"{scale_dtype}")
    if _is_fp4(b_dtype) and not _is_fp4(a_dtype):
        raise ValueError(f"mma_block_scaled_loop on ascend:950: the Cube's block-scaled MAD takes A and B of one "
                         f"dtype (TileLang 0.1.15), got {a_dtype} and {b_dtype}, and e2m1 cannot be widened on chip "
                         "(no 8-bit UB -> L1 copy): pass B widened to e4m3 (exact, "
                         "ops.gemm_mxfp4_native.widen_e2m1_to_e4m3)")
    if str(a_dtype) != str(b_dtype):
        raise ValueError(f"mma_block_scaled_loop on ascend:950: A and B must have one dtype, got {a_dtype} and "
                         f"{b_dtype}")
    depth = int(a_shape[1])
    a_l1 = A.alloc_l1(tuple(a_shape), a_dtype)
    b_l1 = A.alloc_l1(tuple(b_shape), b_dtype)
    sfa_l1 = A.alloc_l1((int(a_shape[0]), depth // MX), "uint8")
    sfb_l1 = A.alloc_l1((int(b_shape[0]), depth // MX), "uint8")
    # the step's copies as (source region, L1 tile), built in Python (the loop's DSL would bind regions to variables)
    copies = [lambda s: (loads(s)[0], a_l1), lambda s: (loads(s)[1], b_l1),
              lambda s: (_scale_bytes(scale_loads(s)[0]), sfa_l1), lambda s: (_scale_bytes(scale_loads(s)[1]), sfb_l1)]
    _loop(steps, copies, a_l1, b_l1, sfa_l1, sfb_l1, acc.buf, stages)
    if epilogue is not None:
        epilogue()


def _scale_bytes(region):
    """One step's region of int32 scale words (..., steps, rows) as its (rows, 4) E8M0 bytes."""
    buf = region.buffer
    *lead, c = region.region
    if any(int(r.extent) != 1 for r in lead):
        raise ValueError(f"a scale region is one step's row range of scale words (..., steps, rows), got {region}")
    view = T.view(buf, (*buf.shape, 4), "uint8")
    return view[(*(r.min for r in lead), slice(c.min, c.min + c.extent), slice(0, 4))]


@T.macro
def _loop(steps, copies, a_l1, b_l1, sfa_l1, sfb_l1, acc, stages):
    for s in A.Pipelined(steps, num_stages=stages):
        for copy in copies:
            A.copy(*copy(s))
        A.gemm_blockscaled(a_l1, b_l1, acc, sfa_l1, sfb_l1, transpose_B=True, clear_accum=(s == 0))
