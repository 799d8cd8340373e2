"""Built-in lowering rules, one module per rule family.

common   "*" rules that are the same TileLang on every target
cuda     rules shared by sm_90a and sm_100a
sm90     Hopper: register accumulators, T.gemm -> WGMMA
sm90_attention  Hopper attention_loop: hand-written producer + two MMA warpgroups
sm90_decoded    Hopper mma_decoded_loop: TMA producer + MMA warpgroups decoding under the previous WGMMA
sm100    Blackwell: tensor-memory accumulators, tcgen05 MMA completing on an mbarrier
ascend   Ascend 950: 1-D core grid, SimtVF vector regions, L1/L0C cube buffers
ascend_attention Ascend attention_loop: the vector cores stage and convert a step and run the softmax on
                 half the rows each; the Cube multiplies
ascend_block_scaled  Ascend mma_block_scaled_loop: the Cube's MX MAD on one 8-bit dtype
ascend_decoded   Ascend mma_decoded_loop: each vector core decodes half of B's rows into UB, a dual copy
                 into L1, the Cube's MMA
cpu      TileLang's C target: one thread, local buffers, serial loops, bf16 by bit arithmetic
"""

from codegen.lowering import (  # noqa: F401
    common, cuda, sm90, sm90_attention, sm90_decoded, sm100, ascend, ascend_attention, ascend_block_scaled,
    ascend_decoded, cpu)
