"""ops.moe_dispatch / ops.moe_combine: layouts the grouped GEMMs take, exact round trips."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.moe_dispatch import moe_reference


def random_ids(T_, E, k, g):
    if T_ == 0:
        return torch.empty(0, k, dtype=torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)]).to(torch.int32)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_identity_experts_reproduce_x(layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 512, generator=g).bfloat16()
    ids = random_ids(37, 16, 4, g)
    xd, sd, m = ops.moe_dispatch(x, ids, 16, layout=layout)
    assert sd is None
    out = ops.moe_combine(xd, m, torch.full((37, 4), 0.25))
    torch.testing.assert_close(out, x, atol=0, rtol=0)


def test_contiguous_layout_is_what_the_grouped_gemm_takes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 128, generator=g).bfloat16()
    ids = random_ids(50, 8, 3, g)
    xd, _, m = ops.moe_dispatch(x, ids, 8, layout="contiguous", align=16)
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    assert m.counts.tolist() == counts.tolist()
    assert xd.shape[0] == int(((counts + 15) // 16 * 16).sum()) == m.m_indices.shape[0]
    start = 0
    for e in range(8):                                     # one 16-aligned segment per expert, in order
        seg = m.m_indices[start:start + int((counts[e] + 15) // 16 * 16)]
        assert (seg[:counts[e]] == e).all() and (seg[counts[e]:] == -1).all()
        start += seg.numel()
    assert (xd[m.m_indices == -1] == 0).all()              # padding rows are zeros
    for t in range(50):
        for j in range(3):
            r = int(m.positions[t, j])
            assert torch.equal(xd[r], x[t]) and int(m.m_indices[r]) == int(ids[t, j])
    # within an expert, tokens keep their order
    for e in range(8):
        rows = m.positions[ids == e]
        assert torch.equal(rows, rows.sort().values)


def test_masked_layout_and_capacity():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 64, generator=g)
    ids = random_ids(20, 4, 2, g)
    xd, _, m = ops.moe_dispatch(x, ids, 4, layout="masked", align=8)
    counts = torch.bincount(ids.flatten().long(), minlength=4)
    assert xd.shape == (4, m.max_m, 64) and m.max_m % 8 == 0 and m.masked_m.tolist() == counts.tolist()
    for e in range(4):
        assert (xd[e, counts[e]:] == 0).all()
    with pytest.raises(ValueError, match="max_m=2 is smaller than the busiest expert"):
        ops.moe_dispatch(x, ids, 4, layout="masked", max_m=2)
    xd2, _, m2 = ops.moe_dispatch(x, ids, 4, layout="masked", max_m=64)
    assert xd2.shape == (4, 64, 64) and torch.equal(xd2[:, :m.max_m], xd)


def test_fp8_rows_travel_with_their_scales():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(10, 256, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.rand(10, 2, generator=g)
    ids = random_ids(10, 4, 2, g)
    xd, sd, m = ops.moe_dispatch(x, ids, 4, x_scales=scales, align=4)
    for t in range(10):
        for j in range(2):
            r = int(m.positions[t, j])
            assert torch.equal(xd[r].view(torch.uint8), x[t].view(torch.uint8)) and torch.equal(sd[r], scales[t])


def test_weighted_experts_match_the_reference():
    g = torch.Generator().manual_seed(4)
    T_, H, E, k = 24, 64, 6, 2
    x = torch.randn(T_, H, generator=g)
    ids = random_ids(T_, E, k, g)
    w = torch.rand(T_, k, generator=g)
    mats = torch.randn(E, H, H, generator=g) / 8
    xd, _, m = ops.moe_dispatch(x, ids, E, align=8)
    y = torch.zeros_like(xd)
    valid = m.m_indices >= 0
    y[valid] = torch.einsum("rh,rhk->rk", xd[valid], mats[m.m_indices[valid].long()])
    out = ops.moe_combine(y, m, w)
    ref = moe_reference(x, ids, w, lambda e, v: v @ mats[e])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_combine_is_batch_invariant():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=g).bfloat16()
    ids = random_ids(16, 8, 4, g)
    w = torch.rand(16, 4, generator=g)
    xd, _, m = ops.moe_dispatch(x, ids, 8)
    full = ops.moe_combine(xd, m, w)
    xd1, _, m1 = ops.moe_dispatch(x[5:6], ids[5:6], 8)
    assert torch.equal(ops.moe_combine(xd1, m1, w[5:6])[0], full[5])


def test_zero_tokens():
    xd, _, m = ops.moe_dispatch(torch.empty(0, 64).bfloat16(), torch.empty(0, 4, dtype=torch.int32), 8)
    assert xd.shape == (0, 64)
    assert ops.moe_combine(xd, m, torch.empty(0, 4)).shape == (0, 64)


@settings(max_examples=12, deadline=None)
@given(T_=st.integers(0, 40), E=st.sampled_from([4, 16]), k=st.integers(1, 4), H=st.sampled_from([64, 200]),
       layout=st.sampled_from(["contiguous", "masked"]), seed=st.integers(0, 9999))
def test_hypothesis_round_trip(T_, E, k, H, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T_, H, generator=g).bfloat16()
    ids = random_ids(T_, E, k, g)
    xd, _, m = ops.moe_dispatch(x, ids, E, layout=layout, align=8)
    out = ops.moe_combine(xd, m, torch.full((T_, k), 1.0 / k))
    torch.testing.assert_close(out.float(), x.float(), atol=1e-2, rtol=1e-2)


def test_invalid_inputs():
    x = torch.randn(4, 64)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, 8\)"):
        ops.moe_dispatch(x, ids + 8, 8)
    with pytest.raises(TypeError, match="ids must have dtype int32"):
        ops.moe_dispatch(x, ids.long(), 8)
    with pytest.raises(ValueError, match="one row per token"):
        ops.moe_dispatch(x, ids[:3], 8)
    with pytest.raises(ValueError, match="layout must be one of"):
        ops.moe_dispatch(x, ids, 8, layout="ragged")
    with pytest.raises(ValueError, match="x is fp8: x_scales"):
        ops.moe_dispatch(x.to(torch.float8_e4m3fn), ids, 8)
    with pytest.raises(ValueError, match="x_scales is only for fp8"):
        ops.moe_dispatch(x, ids, 8, x_scales=torch.ones(4, 1))
    xd, _, m = ops.moe_dispatch(x, ids, 8)
    with pytest.raises(TypeError, match="mapping must be the MoeMapping"):
        ops.moe_combine(xd, {"positions": None}, torch.ones(4, 2))
    with pytest.raises(ValueError, match="weights must have shape"):
        ops.moe_combine(xd, m, torch.ones(4, 3))
    with pytest.raises(ValueError, match="y must have shape"):
        ops.moe_combine(xd[:-1].contiguous(), m, torch.ones(4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_round_trip(layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 7168, generator=g).bfloat16().cuda()
    ids = random_ids(4096, 256, 8, g).cuda()
    xd, _, m = ops.moe_dispatch(x, ids, 256, layout=layout)
    out = ops.moe_combine(xd, m, torch.full((4096, 8), 0.125, device="cuda"))
    torch.testing.assert_close(out, x, atol=0, rtol=0)
