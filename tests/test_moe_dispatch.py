"""ops.moe_dispatch / ops.moe_combine: layouts the grouped GEMMs take, exact round trips."""

import dataclasses

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
    # a mapping whose positions point past y (not moe_dispatch's): refused, never read
    bad = dataclasses.replace(m, positions=m.positions + xd.shape[0])
    with pytest.raises(ValueError, match=r"mapping.positions must be rows of y's dispatch layout"):
        ops.moe_combine(xd, bad, torch.ones(4, 2))


def test_combine_refuses_negative_positions_and_dispatch_a_stray_max_m():
    """moe_combine's value check covers positions below 0 too (the kernel clamps them to y's row 0: a silently
    wrong sum before); moe_dispatch refuses max_m outside the masked layout (it was ignored)."""
    x = torch.randn(4, 64)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ids[:, 1] = 1
    # (the mapping moe_dispatch(x, ids, 2, align=4) returns, by hand: both checks raise before any kernel runs)
    m = ops.MoeMapping("contiguous", 2, 2, positions=torch.arange(8, dtype=torch.int32).view(2, 4).T.contiguous(),
                       counts=torch.tensor([4, 4], dtype=torch.int32),
                       m_indices=torch.arange(2, dtype=torch.int32).repeat_interleave(4), masked_m=None, max_m=None)
    bad = dataclasses.replace(m, positions=m.positions - 1)           # token 0's first choice now points at -1
    with pytest.raises(ValueError, match=r"mapping.positions must be rows of y's dispatch layout \(in \[0, 8\)\), "
                                         r"got values -1\.\.6"):
        ops.moe_combine(torch.zeros(8, 64), bad, torch.ones(4, 2))
    for align in (128, 1):
        with pytest.raises(ValueError, match="max_m is only for layout='masked'.*layout is 'contiguous'"):
            ops.moe_dispatch(x, ids, 8, align=align, max_m=16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_round_trip(layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 7168, generator=g).bfloat16().cuda()
    ids = random_ids(4096, 256, 8, g).cuda()
    xd, _, m = ops.moe_dispatch(x, ids, 256, layout=layout)
    out = ops.moe_combine(xd, m, torch.full((4096, 8), 0.125, device="cuda"))
    torch.testing.assert_close(out, x, atol=0, rtol=0)



@pytest.mark.gpu
def test_gpu_views_off_alignment_are_refused(off_alignment):
    """Rows are read 16 bytes a thread: x and y views that start off 16 bytes are a ValueError naming
    them, before any kernel runs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g).bfloat16().cuda()
    ids = random_ids(64, 16, 2, g).cuda()
    with pytest.raises(ValueError, match="^x must start 16-byte aligned"):
        ops.moe_dispatch(off_alignment(x, 8), ids, 16)
    xd, _, m = ops.moe_dispatch(x, ids, 16)
    with pytest.raises(ValueError, match="^y must start 16-byte aligned"):
        ops.moe_combine(off_alignment(xd, 8), m, torch.full((64, 2), 0.5, device="cuda"))
    torch.testing.assert_close(ops.moe_combine(xd, m, torch.full((64, 2), 0.5, device="cuda")), x, atol=0, rtol=0)

# ---- compact sorted rows (align=1) and the GEMM work items ----------------------------------------

def _padded_plan(ids, E, align):
    """The contiguous plan as moe_dispatch built it before align=1 skipped the host: bincount,
    padded segments sized on the host, rows scattered into them."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    order = torch.sort(flat, stable=True).indices
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel()) - first[flat[order]]
    padded = (counts + align - 1) // align * align
    seg = torch.cumsum(padded, 0) - padded
    rows = int(padded.sum())
    row_of = seg[flat[order]] + rank
    m_indices = torch.full((rows,), -1, dtype=torch.int32)
    m_indices[row_of] = flat[order].to(torch.int32)
    positions = torch.empty(flat.numel(), dtype=torch.long)
    positions[order] = row_of
    src = torch.full((rows,), -1, dtype=torch.int32)
    src[row_of] = (order // k).to(torch.int32)
    return positions.view(ids.shape).to(torch.int32), counts.to(torch.int32), m_indices, src


def skewed_ids(T_, E, k):
    """Every token picks experts 0..k-1: expert 0 gets all T rows, experts >= k none."""
    return torch.arange(k, dtype=torch.int32).repeat(T_, 1) % E


@pytest.mark.parametrize("T_,E,k,skew", [(0, 8, 2, False), (1, 8, 8, False), (37, 16, 4, False), (64, 32, 8, False),
                                         (5, 64, 3, False), (100, 16, 4, True)])
def test_align_1_is_the_padded_plan_without_padding(T_, E, k, skew):
    g = torch.Generator().manual_seed(T_ + E)
    ids = skewed_ids(T_, E, k) if skew else random_ids(T_, E, k, g)
    x = torch.randn(T_, 64, generator=g).bfloat16()
    xd, _, m = ops.moe_dispatch(x, ids, E, align=1)
    positions, counts, m_indices, src = _padded_plan(ids, E, 1)
    assert xd.shape == (T_ * k, 64) and m.m_indices.shape == (T_ * k,)
    assert torch.equal(m.positions, positions) and torch.equal(m.counts, counts)
    assert torch.equal(m.m_indices, m_indices) and (m.m_indices >= 0).all()
    assert torch.equal(m.m_indices, m.m_indices.sort().values)             # rows sorted by expert
    assert torch.equal(xd, x[src.long()])
    # the padded layouts are unchanged by the new counting
    for align in (8, 128):
        xp, _, mp = ops.moe_dispatch(x, ids, E, align=align)
        positions, counts, m_indices, src = _padded_plan(ids, E, align)
        assert torch.equal(mp.positions, positions) and torch.equal(mp.m_indices, m_indices)
        assert torch.equal(xp[m_indices >= 0], x[src[src >= 0].long()])


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every aten op that reads device data on the host or sizes its output from values."""

    aten = torch.ops.aten
    DENY = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero, aten.bincount,
            aten.masked_select, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
            aten.allclose, aten._assert_async}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pkt = func.overloadpacket
        bad = pkt in self.DENY
        bad |= pkt is self.aten.repeat_interleave and kwargs.get("output_size") is None
        bad |= pkt in (self.aten.index, self.aten.index_put, self.aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        bad |= pkt is self.aten._to_copy and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        if bad:
            raise AssertionError(f"host sync: {func}")
        return func(*args, **kwargs)


@pytest.fixture
def no_host_sync(monkeypatch):
    """A context in which host reads of tensor data raise: the dispatch mode above, plus tolist /
    numpy, which read CPU tensors without going through the dispatcher."""
    import contextlib

    monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "0")           # value checks are the one allowed sync

    @contextlib.contextmanager
    def guard():
        def refuse(*a, **kw):
            raise AssertionError("host sync: tolist/numpy")
        with monkeypatch.context() as mp:
            for name in ("tolist", "numpy", "__array__"):
                mp.setattr(torch.Tensor, name, refuse)
            with _NoHostSync():
                yield

    return guard


def test_the_guard_catches_syncs(no_host_sync):
    t = torch.arange(4)
    for fn in (lambda: int(t.sum()), lambda: t.tolist(), lambda: t.nonzero(), lambda: bool(t.any()),
               lambda: torch.bincount(t), lambda: t[t > 1], lambda: t.repeat_interleave(t)):
        with pytest.raises(AssertionError, match="host sync"), no_host_sync():
            fn()


def test_align_1_dispatch_and_tile_items_read_nothing_on_the_host(no_host_sync):
    g = torch.Generator().manual_seed(7)
    T_, E, k = 24, 16, 4
    x = torch.randn(T_, 128, generator=g).bfloat16()
    ids = random_ids(T_, E, k, g)
    ref_xd, _, ref_m = ops.moe_dispatch(x, ids, E, align=1)
    with no_host_sync():
        xd, _, m = ops.moe_dispatch(x, ids, E, align=1)
        items = ops.moe_tile_items(m, E)
        items_c = ops.moe_tile_items(m.counts, E, max_items=items.shape[0])
    assert torch.equal(xd, ref_xd) and torch.equal(m.m_indices, ref_m.m_indices)
    assert torch.equal(items, items_c)
    with pytest.raises(AssertionError, match="host sync"), no_host_sync():
        ops.moe_dispatch(x, ids, E, align=8)                     # padded: sized on the host


def test_align_1_plan_and_tile_items_trace_with_fake_tensors():
    """Under FakeTensorMode (no data, static shapes) any data-dependent op raises: the plan's and the
    items' shapes follow from the input shapes alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ops.moe_dispatch import _plan
    from ops.moe_tiles import _items

    with FakeTensorMode() as mode:
        ids = mode.from_tensor(torch.zeros(64, 8, dtype=torch.int32))
        mapping, src, rows = _plan(ids, 32, "contiguous", 1, None)
        items = _items(mapping.counts, 64 * 8 // 64 + 32, 64)
    assert rows == 512 and src.shape == (512,) and mapping.m_indices.shape == (512,)
    assert items.shape == (40, 3) and items.dtype == torch.int32
    with FakeTensorMode() as mode, pytest.raises(Exception):
        _plan(mode.from_tensor(torch.zeros(4, 2, dtype=torch.int32)), 8, "contiguous", 8, None)


@pytest.mark.parametrize("counts,block_m", [([0, 0, 0], 64), ([5, 0, 130, 64, 0, 1], 64), ([0, 200, 0], 64),
                                            ([64, 64, 0, 63], 64), ([3, 1, 2], 2), ([0], 16), ([7], 16)])
def test_tile_items_match_the_python_loop(counts, block_m):
    from ops.moe_tiles import moe_tile_items_reference

    c = torch.tensor(counts, dtype=torch.int32)
    R = sum(counts)
    items = ops.moe_tile_items(c, len(counts), block_m=block_m, rows=R)
    max_items = -(-R // block_m) + len(counts)
    assert items.shape == (max_items, 3) and items.dtype == torch.int32 and items.is_contiguous()
    assert torch.equal(items, moe_tile_items_reference(counts, block_m, max_items))
    live = items[items[:, 0] >= 0]
    assert int(live[:, 2].sum()) == R and (live[:, 2] > 0).all() and (live[:, 2] <= block_m).all()
    covered = torch.cat([torch.arange(r0, r0 + n) for _, r0, n in live.tolist()]) if R else torch.empty(0)
    assert torch.equal(covered, torch.arange(R))                # every row once, in order
    assert (items[items[:, 0] < 0] == torch.tensor([-1, 0, 0], dtype=torch.int32)).all()


@settings(max_examples=20, deadline=None)
@given(T_=st.integers(0, 70), E=st.sampled_from([1, 4, 32]), k=st.integers(1, 4), block_m=st.sampled_from([1, 8, 64]),
       seed=st.integers(0, 9999))
def test_tile_items_from_a_dispatch(T_, E, k, block_m, seed):
    from ops.moe_tiles import moe_tile_items_reference

    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = random_ids(T_, E, k, g)
    _, _, m = ops.moe_dispatch(torch.zeros(T_, 64), ids, E, align=1)
    items = ops.moe_tile_items(m, E, block_m=block_m)
    max_items = -(-(T_ * k) // block_m) + E
    assert torch.equal(items, moe_tile_items_reference(m.counts.tolist(), block_m, max_items))
    for e, r0, n in items.tolist():                              # each item's rows are its expert's
        if e >= 0:
            assert (m.m_indices[r0:r0 + n] == e).all()


def test_tile_items_errors():
    c = torch.tensor([100, 0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="give rows="):
        ops.moe_tile_items(c, 3)
    with pytest.raises(ValueError, match="max_items=2 is smaller than the 3 items"):
        ops.moe_tile_items(c, 3, max_items=2)
    with pytest.raises(ValueError, match=r"counts must have shape \(4,\)"):
        ops.moe_tile_items(c, 4, max_items=8)
    with pytest.raises(TypeError, match="counts must have dtype"):
        ops.moe_tile_items(c.float(), 3, max_items=8)
    with pytest.raises(ValueError, match="more than rows=50"):
        ops.moe_tile_items(c, 3, rows=50, max_items=8)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ids[:, 1] = 1
    _, _, m = ops.moe_dispatch(torch.zeros(4, 64), ids, 4, align=8)
    with pytest.raises(ValueError, match="use align=1"):
        ops.moe_tile_items(m, 4)
    _, _, m = ops.moe_dispatch(torch.zeros(4, 64), ids, 4, layout="masked")
    with pytest.raises(ValueError, match="layout='contiguous', align=1"):
        ops.moe_tile_items(m, 4)
    _, _, m = ops.moe_dispatch(torch.zeros(4, 64), ids, 4, align=1)
    with pytest.raises(ValueError, match="does not match the mapping's 4"):
        ops.moe_tile_items(m, 8)
    # with value checks off, a too short list just stops (no error, no out-of-bounds write)
    import os
    os.environ["TILECRAFT_CHECK_VALUES"] = "0"
    try:
        assert ops.moe_tile_items(c, 3, max_items=2).tolist() == [[0, 0, 64], [0, 64, 36]]
    finally:
        del os.environ["TILECRAFT_CHECK_VALUES"]


@pytest.mark.gpu
def test_gpu_align_1_dispatch_and_items_do_not_sync():
    """On the GPU: no host sync (torch's sync debug mode set to error), the same rows as the CPU,
    and the whole dispatch + items capturable in a CUDA graph."""
    g = torch.Generator().manual_seed(8)
    T_, E, k = 64, 256, 8
    x = torch.randn(T_, 7168, generator=g).bfloat16()
    ids = random_ids(T_, E, k, g)
    xd_ref, _, m_ref = ops.moe_dispatch(x, ids, E, align=1)
    items_ref = ops.moe_tile_items(m_ref, E)
    xc, ic = x.cuda(), ids.cuda()
    ops.moe_dispatch(xc, ic, E, align=1)                         # compile the gather kernel first
    torch.cuda.synchronize()
    import os
    os.environ["TILECRAFT_CHECK_VALUES"] = "0"
    torch.cuda.set_sync_debug_mode("error")
    try:
        xd, _, m = ops.moe_dispatch(xc, ic, E, align=1)
        items = ops.moe_tile_items(m, E)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        del os.environ["TILECRAFT_CHECK_VALUES"]
    assert torch.equal(xd.cpu(), xd_ref) and torch.equal(m.positions.cpu(), m_ref.positions)
    assert torch.equal(m.m_indices.cpu(), m_ref.m_indices) and torch.equal(items.cpu(), items_ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xd_g, _, m_g = ops.moe_dispatch(xc, ic, E, align=1)
        items_g = ops.moe_tile_items(m_g, E)
    ic.copy_(ic.roll(1, 0))                                      # new routing, same shapes
    graph.replay()
    xd2, _, m2 = ops.moe_dispatch(x, ids.roll(1, 0), E, align=1)
    assert torch.equal(xd_g.cpu(), xd2) and torch.equal(m_g.positions.cpu(), m2.positions)
    assert torch.equal(m_g.m_indices.cpu(), m2.m_indices) and torch.equal(items_g.cpu(), ops.moe_tile_items(m2, E))


# ---- dispatch v2: the plan and scatter kernels against the torch plan -----------------------------

def _same_plan(ids, E, layout, align, max_m):
    """The kernel plan and _plan_reference agree bit for bit (sizes, positions, src, counts, rows)."""
    from ops.moe_dispatch import _plan, _plan_reference

    (m, src, rows), (mr, srcr, rowsr) = _plan(ids, E, layout, align, max_m), _plan_reference(ids, E, layout, align, max_m)
    assert rows == rowsr and m.max_m == mr.max_m
    assert torch.equal(m.positions, mr.positions) and m.positions.dtype == torch.int32
    assert torch.equal(m.counts, mr.counts) and torch.equal(src, srcr)
    if layout == "contiguous":
        assert torch.equal(m.m_indices, mr.m_indices) and m.m_indices.shape == (rows,)
    else:
        assert torch.equal(m.masked_m, mr.masked_m)
    return m, src, rows


@settings(max_examples=40, deadline=None)
@given(T_=st.integers(0, 300), E=st.sampled_from([1, 3, 8, 64, 256]), k=st.integers(1, 8),
       layout=st.sampled_from(["contiguous", "masked"]), align=st.sampled_from([1, 4, 128]),
       fixed_max_m=st.booleans(), skew=st.booleans(), seed=st.integers(0, 9999))
def test_hypothesis_plan_kernels_equal_the_torch_plan(T_, E, k, layout, align, fixed_max_m, skew, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = skewed_ids(T_, E, k) if skew else random_ids(T_, E, k, g)
    max_m = max(T_, 1) if layout == "masked" and fixed_max_m else None
    _same_plan(ids, E, layout, align, max_m)


@pytest.mark.parametrize("T_,E,k", [(4096, 256, 8), (1100, 256, 8), (8193, 7, 1)])   # several 8192-id chunks
@pytest.mark.parametrize("layout,align,max_m", [("contiguous", 128, None), ("contiguous", 1, None),
                                                ("masked", 64, None), ("masked", 1, 9000)])
def test_plan_kernels_equal_the_torch_plan_at_v3_size(T_, E, k, layout, align, max_m):
    g = torch.Generator().manual_seed(T_)
    _same_plan(random_ids(T_, E, k, g), E, layout, align, max_m)


def _reference_dispatch(x, ids, E, layout, align, max_m):
    from ops.moe_dispatch import _plan_reference

    m, src, rows = _plan_reference(ids, E, layout, align, max_m)
    out = torch.zeros(rows, *x.shape[1:], dtype=x.dtype)
    live = src >= 0
    out.view(torch.uint8 if x.element_size() == 1 else x.dtype)[live] = \
        x.view(torch.uint8 if x.element_size() == 1 else x.dtype)[src[live].long()]
    return out, m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout,align,max_m", [("contiguous", 16, None), ("contiguous", 1, None), ("masked", 8, None),
                                                ("masked", 1, 40)])
def test_scatter_is_the_gather_of_the_torch_plan(dtype, layout, align, max_m):
    """Every output row bitwise: chosen rows from their token, padding rows zero (fp8 with scales)."""
    g = torch.Generator().manual_seed(11)
    T_, E, k, H = 40, 16, 4, 136
    x = (torch.randn(T_, H, generator=g) * 4).to(dtype)
    scales = torch.rand(T_, 2, generator=g) if dtype == torch.float8_e4m3fn else None
    ids = random_ids(T_, E, k, g)
    xd, sd, m = ops.moe_dispatch(x, ids, E, x_scales=scales, layout=layout, align=align, max_m=max_m)
    ref, mr = _reference_dispatch(x, ids, E, layout, align, max_m)
    u8 = lambda t: t.reshape(-1, t.shape[-1]).view(torch.uint8)
    assert torch.equal(u8(xd), u8(ref)) and torch.equal(m.positions, mr.positions)
    if scales is not None:
        sref, _ = _reference_dispatch(scales, ids, E, layout, align, max_m)
        assert torch.equal(sd.reshape(-1, 2), sref)


def test_live_scatter_writes_only_the_live_rows():
    """The contiguous dispatch scatters into a bound-sized buffer before the host knows the row
    count: rows at or past Live[0] (their Src is never written by the plan) stay untouched."""
    from codegen import targets
    from ops.moe_dispatch import scatter_rows_program

    g = torch.Generator().manual_seed(3)
    T_, k, H, live, bound = 5, 2, 64, 16, 24
    x = torch.randn(T_, H, generator=g).to(torch.bfloat16)
    pos = torch.randperm(12, generator=g)[:T_ * k].view(T_, k).to(torch.int32)    # rows < 12
    src = torch.full((bound,), -1, dtype=torch.int32)
    src.view(-1)[pos.view(-1).long()] = torch.arange(T_, dtype=torch.int32).repeat_interleave(k)
    y = torch.full((bound, H), 7.0, dtype=torch.bfloat16)
    kern = scatter_rows_program.compile(targets.get("cpu"), hidden=H, bits="int16", pad=True, live=True)
    kern.launcher()(x.view(torch.int16), pos, src, y.view(torch.int16), torch.tensor([live], dtype=torch.int32))
    for r in range(bound):
        if r >= live:
            assert torch.all(y[r] == 7.0), r                     # past the live rows: untouched
        elif src[r] >= 0:
            assert torch.equal(y[r], x[src[r]]), r
        else:
            assert torch.all(y[r] == 0), r                     # live padding rows: zeros


@pytest.mark.parametrize("layout,align,max_m", [("contiguous", 128, None), ("contiguous", 1, None),
                                                ("masked", 4, None), ("masked", 4, 64)])
def test_out_of_range_ids_raise_in_every_layout(layout, align, max_m, monkeypatch):
    x = torch.randn(6, 64)
    ids = torch.zeros(6, 2, dtype=torch.int32)
    ids[:, 1] = 1
    for bad in (8, -1):
        ids2 = ids.clone()
        ids2[3, 0] = bad
        with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, 8\)"):
            ops.moe_dispatch(x, ids2, 8, layout=layout, align=align, max_m=max_m)
    # checks off: no error and nothing out of bounds (the kernels clamp: a bad id counts as 0 or E-1)
    monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "0")
    ids2 = ids.clone()
    ids2[3, 0] = 99
    xd, _, m = ops.moe_dispatch(x, ids2, 8, layout=layout, align=align, max_m=max_m)
    assert int(m.counts.sum()) == 12 and int(m.counts[7]) == 1


def test_masked_with_max_m_reads_nothing_on_the_host(no_host_sync):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(24, 128, generator=g).bfloat16()
    ids = random_ids(24, 16, 4, g)
    ref, _, mref = ops.moe_dispatch(x, ids, 16, layout="masked", max_m=24)
    with no_host_sync():
        xd, _, m = ops.moe_dispatch(x, ids, 16, layout="masked", max_m=24)
    assert torch.equal(xd, ref) and torch.equal(m.positions, mref.positions)


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_dispatch_kernels_build_for_cuda(target):
    """The plan and scatter programs compile to cubins; the scatter moves 16-byte vectors and the
    place kernel fits two blocks an SM (E=256 experts in one wave on 132 SMs)."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.moe_dispatch import plan_count_program, plan_place_program, scatter_rows_program

    try:
        stats = {name: sass_stats(build_cubin(prog.source(target, **p), target), target) for name, prog, p in [
            ("count", plan_count_program, dict(num_experts=256)),
            ("contiguous", plan_place_program, dict(layout="contiguous")),
            ("masked", plan_place_program, dict(layout="masked")),
            ("scatter", scatter_rows_program, dict(hidden=7168, bits="int16"))]}
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert stats["count"].histogram.get("ATOMS", 0) > 0                  # the histogram is in shared memory
    if target == "sm_90a":                     # masked: 66 on sm_90a (one block an SM); sm_100a: 80
        assert stats["contiguous"].registers <= 64
    assert all(s.spill_stores == 0 for s in stats.values())
    assert "int4" in scatter_rows_program.source(target, hidden=7168, bits="int16")
    # the count kernel loads its ids before counting them: no load between two shared atomics
    assert stats["count"].histogram.get("LDG", 0) >= 32


@pytest.mark.parametrize("hidden,top_k", [(128, 4), (7168, 8)])
def test_combine_kernels_round_alike_on_sm_90a(hidden, top_k):
    """The one-source combine and the two-source ones of the peer EP transport accumulate with FFMA
    only: a multiply-add nvcc leaves unfused (FMUL + FADD) rounds differently, and the EP combine
    must give the single-device bits (a multiply-add in each branch of the two-source kernel did)."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.moe_dispatch import combine_program

    try:
        stats = [sass_stats(build_cubin(combine_program.source("sm_90a", hidden=hidden, top_k=top_k, split=split),
                                        "sm_90a"), "sm_90a") for split in (False, True, "info")]
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    for st in stats:
        ops_ = {k: v for k, v in st.histogram.items() if k.startswith(("FFMA", "FMUL", "FADD"))}
        assert set(ops_) == {"FFMA"}, ops_
        assert st.spill_stores == 0


def test_dispatch_programs_lower_for_ascend():
    """Ascend C for the whole single-device dispatch (no device has run it): the plan kernels as one
    SIMT region each, the row copies on 32-bit words (row_words)."""
    from ops.moe_dispatch import gather_rows_program, plan_count_program, plan_place_program, scatter_rows_program

    count = plan_count_program.source("ascend", num_experts=256)
    assert count.count("__simt_vf__") == 1 and "asc_atomic_add" in count
    for layout in ("contiguous", "masked"):
        assert "__simt_vf__" in plan_place_program.source("ascend", layout=layout)
    for live in (False, True):
        src = scatter_rows_program.source("ascend", hidden=3584, bits="int32", live=live)
        assert "__simt_vf__" in src and ("Live[0]" in src) == live
    assert "__simt_vf__" in gather_rows_program.source("ascend", hidden=3584, bits="int32")


def test_row_words():
    from codegen import targets
    from ops.moe_dispatch import row_words

    x = torch.zeros(2, 6, dtype=torch.bfloat16)
    assert row_words(x, targets.get("cpu")) == torch.int16
    assert row_words(x.to(torch.float8_e4m3fn), targets.get("sm_90a")) == torch.uint8
    assert row_words(x, targets.get("ascend")) == torch.int32
    with pytest.raises(ValueError, match="multiple of 4 bytes, got 3 x torch.bfloat16 = 6 bytes"):
        row_words(x[:, :3], targets.get("ascend"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,align,max_m", [("contiguous", 128, None), ("contiguous", 1, None), ("masked", 1, None),
                                                ("masked", 64, 4096)])
def test_gpu_v2_dispatch_equals_the_cpu(layout, align, max_m):
    """T=4096, H=7168, k=8, E=256 on the GPU: mapping and rows bitwise the CPU's."""
    g = torch.Generator().manual_seed(13)
    T_, E, k = 4096, 256, 8
    x = torch.randn(T_, 7168, generator=g).bfloat16()
    ids = random_ids(T_, E, k, g)
    from ops.moe_dispatch import _plan_reference

    mr, srcr, rowsr = _plan_reference(ids, E, layout, align, max_m)
    xd, _, m = ops.moe_dispatch(x.cuda(), ids.cuda(), E, layout=layout, align=align, max_m=max_m)
    assert torch.equal(m.positions.cpu(), mr.positions) and torch.equal(m.counts.cpu(), mr.counts)
    if layout == "contiguous":
        assert torch.equal(m.m_indices.cpu(), mr.m_indices)
    xd = xd.reshape(-1, 7168).cpu()
    live = srcr >= 0
    assert xd.shape[0] == rowsr and torch.equal(xd[live], x[srcr[live].long()]) and (xd[~live] == 0).all()
    with pytest.raises(ValueError, match="ids must be expert ids"):
        ops.moe_dispatch(x.cuda(), (ids + 1).cuda(), E, layout=layout, align=align, max_m=max_m)


@pytest.mark.gpu
def test_gpu_v2_masked_max_m_is_capturable():
    g = torch.Generator().manual_seed(14)
    T_, E, k = 64, 256, 8
    x, ids = torch.randn(T_, 7168, generator=g).bfloat16().cuda(), random_ids(T_, E, k, g).cuda()
    ops.moe_dispatch(x, ids, E, layout="masked", max_m=64)
    torch.cuda.synchronize()
    import os
    os.environ["TILECRAFT_CHECK_VALUES"] = "0"
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.moe_dispatch(x, ids, E, layout="masked", max_m=64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            xd_g, _, m_g = ops.moe_dispatch(x, ids, E, layout="masked", max_m=64)
    finally:
        del os.environ["TILECRAFT_CHECK_VALUES"]
    ids.copy_(ids.roll(1, 0))
    graph.replay()
    xd, _, m = ops.moe_dispatch(x, ids, E, layout="masked", max_m=64)
    assert torch.equal(xd_g, xd) and torch.equal(m_g.positions, m.positions) and torch.equal(m_g.masked_m, m.masked_m)
