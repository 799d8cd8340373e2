"""ops.per_token_group_quant_fp8's tile program (token_group_quant_fp8): the activation quantizer
that runs before every FP8 GEMM of a forward pass. On a GPU it must give the torch path's bits."""

import pytest
import torch

import ops
from ops.quant import token_group_quant_program, token_group_quant_reference


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_quant_program_builds_without_spills(target):
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    src = token_group_quant_program.source(target, k=7168)
    assert "token_group_quant" in src
    try:
        stats = sass_stats(build_cubin(src, target), target)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert stats.spill_stores == 0 and stats.spill_loads == 0


def test_quant_program_lowers_for_ascend():
    """ascend:950 (generated Ascend C, no device): the same program as one vector function, a group's absmax
    reduced across 32 lanes, e4m3 stores of 4 values a thread, one scale a group."""
    src = token_group_quant_program.source("ascend", k=7168)
    assert "__simt_vf__" in src and "AscendAllReduce<tl::MaxOp, 32" in src
    assert "fp8_e4_4_t" in src and "__vector__ void token_group_quant_kernel" in src


def test_cpu_path_is_the_reference():
    x = torch.randn(5, 384) * 3
    q, sf = ops.per_token_group_quant_fp8(x)
    rq, rsf = token_group_quant_reference(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sf, rsf)


def cases():
    g = torch.Generator().manual_seed(0)
    yield "randn", torch.randn(64, 7168, generator=g)
    big = torch.randn(33, 1536, generator=g) * 1e4
    big[3] = 0.0                                     # an all-zero row: scale 1, zeros
    big[5, :128] = 0.0                               # one all-zero group
    big[7, 5] = 3e38                                 # one huge value
    yield "edges", big
    yield "k128", torch.randn(3, 128, generator=g)
    yield "odd-groups", torch.randn(9, 128 * 7, generator=g)   # 7 groups: a partial last block of 4
    yield "empty", torch.randn(0, 512, generator=g)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernel_gives_the_reference_bits(dtype):
    for name, x in cases():
        x = x.to(dtype)
        if dtype == torch.float16:
            x = x.clamp(-6e4, 6e4)
        q, sf = ops.per_token_group_quant_fp8(x.cuda())
        rq, rsf = token_group_quant_reference(x.cuda())
        assert q.shape == rq.shape and sf.shape == rsf.shape, name
        assert torch.equal(sf, rsf), name
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), name


@pytest.mark.gpu
def test_gpu_view_off_alignment_takes_the_torch_path(off_alignment):
    """The kernel reads x 16 bytes a thread: a view that starts 4 bytes off takes the torch path, the
    same bits."""
    x = torch.randn(5, 1024, device="cuda")
    q, sf = ops.per_token_group_quant_fp8(x)
    q2, sf2 = ops.per_token_group_quant_fp8(off_alignment(x, 4))
    assert torch.equal(sf2, sf) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_falls_back_where_the_kernel_does_not_fit():
    x = torch.randn(4, 200, device="cuda")                      # k % 128 != 0: torch path, padded groups
    q, sf = ops.per_token_group_quant_fp8(x)
    assert q.shape == (4, 200) and sf.shape == (4, 2)
    q, sf = ops.per_token_group_quant_fp8(x[:, :128].contiguous(), ue8m0=True)
    assert torch.equal(sf, torch.exp2(torch.ceil(torch.log2(sf))))
