"""ops.moe_route / ops.moe_hash_route: DeepSeek's gate, exact ids, one kernel written once."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.moe_route import moe_route_program, moe_route_reference, moe_route_warp_program, warp_path_fits

V3 = dict(n_group=8, topk_group=4, scoring="sigmoid", routed_scaling_factor=2.5)


def choice_scores(logits, bias, scoring, n_group, topk_group):
    """The reference's eligible choice scores (-inf for experts of dropped groups)."""
    x = logits.float()
    s = {"sigmoid": torch.sigmoid, "softmax": lambda v: torch.softmax(v, -1),
         "sqrtsoftplus": lambda v: torch.nn.functional.softplus(v).sqrt()}[scoring](x)
    return s + (bias.float() if bias is not None else 0)


def assert_same_routing(w, ids, rw, rids, logits, bias, top_k, scoring="sigmoid", n_group=1, topk_group=1, **_):
    """ids equal except where the reference itself sees a tie within 1e-6; weights to 1e-6 relative."""
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == rids.shape
    same = (ids == rids).all(1)
    if not bool(same.all()):
        choice = choice_scores(logits, bias, scoring, n_group, topk_group)
        for t in (~same).nonzero().flatten().tolist():
            mine = choice[t, ids[t].long()].sort(descending=True).values
            ref = choice[t, rids[t].long()].sort(descending=True).values
            torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-6, msg=f"token {t}: not a tie")
    torch.testing.assert_close(w[same], rw[same], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("kw", [
    dict(V3, top_k=8),
    dict(scoring="softmax", top_k=6),
    dict(scoring="sqrtsoftplus", top_k=4, n_group=4, topk_group=2),
    dict(scoring="sigmoid", top_k=2, renormalize=False),
])
def test_matches_reference_on_cpu(kw):
    torch.manual_seed(0)
    E = 256 if kw.get("n_group", 1) == 8 else 64
    logits = torch.randn(33, E)
    bias = torch.randn(E) * 0.05 if kw["scoring"] != "softmax" else None
    w, ids = ops.moe_route(logits, bias=bias, **kw)
    rw, rids = moe_route_reference(logits, bias=bias, **kw)
    assert_same_routing(w, ids, rw, rids, logits, bias, **kw)


def test_bias_steers_choice_but_not_weights():
    logits = torch.zeros(1, 8)
    logits[0, 0] = 3.0
    bias = torch.zeros(8)
    bias[5] = 10.0
    w, ids = ops.moe_route(logits, 2, bias=bias, renormalize=False)
    assert ids.tolist() == [[5, 0]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[0.0, 3.0]])))


def test_ties_go_to_the_lower_expert_and_group():
    logits = torch.zeros(2, 16)                 # every score ties
    w, ids = ops.moe_route(logits, 4, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2   # groups 0 and 1 win the group tie, then experts 0..3
    torch.testing.assert_close(w, torch.full((2, 4), 0.25))


def test_bf16_logits_and_zero_tokens():
    logits = torch.randn(7, 64).bfloat16()
    w, ids = ops.moe_route(logits, 6, scoring="softmax")
    rw, rids = moe_route_reference(logits, 6, scoring="softmax")
    assert_same_routing(w, ids, rw, rids, logits, None, 6, "softmax")
    w0, i0 = ops.moe_route(torch.empty(0, 64), 6)
    assert w0.shape == (0, 6) and i0.shape == (0, 6)


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(0, 20), groups=st.sampled_from([(1, 1), (4, 2), (8, 4), (8, 8)]),
       E=st.sampled_from([32, 64]), k=st.integers(1, 8), scoring=st.sampled_from(["sigmoid", "softmax", "sqrtsoftplus"]),
       with_bias=st.booleans(), seed=st.integers(0, 10_000))
def test_hypothesis(tokens, groups, E, k, scoring, with_bias, seed):
    n_group, topk_group = groups
    k = min(k, topk_group * E // n_group)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.1 if with_bias else None
    kw = dict(top_k=k, scoring=scoring, n_group=n_group, topk_group=topk_group)
    w, ids = ops.moe_route(logits, bias=bias, **kw)
    rw, rids = moe_route_reference(logits, bias=bias, **kw)
    assert_same_routing(w, ids, rw, rids, logits, bias, **kw)


def test_invalid_inputs():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="divisible by n_group=5"):
        ops.moe_route(x, 4, n_group=5)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 64\]"):
        ops.moe_route(x, 65)
    with pytest.raises(ValueError, match=r"topk_group must be in \[1, 4\]"):
        ops.moe_route(x, 4, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="exceeds the experts"):
        ops.moe_route(x, 20, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="scoring must be one of"):
        ops.moe_route(x, 4, scoring="relu")
    with pytest.raises(TypeError, match="logits must have dtype fp32 or bf16, got fp16"):
        ops.moe_route(x.half(), 4)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        ops.moe_route(x, 4, bias=torch.zeros(63))
    bad = x.clone()
    bad[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"logits must be finite; found nan at \[2, 7\]"):
        ops.moe_route(bad, 4)
    bad[2, 7] = float("inf")
    with pytest.raises(ValueError, match="logits must be finite"):
        ops.moe_route(bad, 4)


def test_flags_and_factors_are_checked():
    """renormalize must be a bool ('no' was taken as True), routed_scaling_factor a finite number, in both
    routers."""
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        ops.moe_route(x, 4, renormalize="no")
    with pytest.raises(ValueError, match="routed_scaling_factor must be a finite number"):
        ops.moe_route(x, 4, routed_scaling_factor=float("nan"))
    ids = torch.zeros(4, dtype=torch.int32)
    table = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="routed_scaling_factor must be a number, got str"):
        ops.moe_hash_route(x, ids, table, routed_scaling_factor="2")
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        ops.moe_hash_route(x, ids, table, renormalize=1)


_L = torch.randn(4, 64)
_NONFINITE = _L.clone().index_put_((torch.tensor([2]), torch.tensor([7])), torch.tensor(float("nan")))


@pytest.mark.parametrize("args,kw,exc,msg", [
    ((_L.numpy(), 4), {}, TypeError, "logits must be a torch.Tensor, got ndarray"),
    ((_L.long(), 4), {}, TypeError, "logits must have dtype fp16 or bf16 or fp32 or fp64, got int64"),
    ((_L[0], 4), {}, ValueError, r"logits must have 2 dimensions, got shape \(64,\)"),
    ((torch.empty(4, 0), 1), {}, ValueError, "logits must have at least 1 expert"),
    ((_L, 0), {}, ValueError, r"top_k must be in \[1, 64\], got 0"),
    ((_L, 65), {}, ValueError, r"top_k must be in \[1, 64\], got 65"),
    ((_L, 4.0), {}, TypeError, "top_k must be an int, got float"),
    ((_L, 4), dict(n_group=0), ValueError, r"n_group must be in \[1, 64\], got 0"),
    ((_L, 4), dict(n_group=5), ValueError, "the expert count 64 must be divisible by n_group=5"),
    ((_L, 4), dict(n_group=4, topk_group=0), ValueError, r"topk_group must be in \[1, 4\], got 0"),
    ((_L, 4), dict(n_group=4, topk_group=5), ValueError, r"topk_group must be in \[1, 4\], got 5"),
    ((_L, 20), dict(n_group=4, topk_group=1), ValueError, r"top_k=20 exceeds the experts .* \(1 x 16\)"),
    ((_L, 4), dict(scoring="relu"), ValueError, "scoring must be one of .*, got 'relu'"),
    ((_L, 4), dict(renormalize="no"), TypeError, "renormalize must be a bool, got str"),
    ((_L, 4), dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor must be a finite number"),
    ((_L, 4), dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor must be a number, got str"),
    ((_L, 4), dict(bias=[0.0] * 64), TypeError, "bias must be a torch.Tensor, got list"),
    ((_L, 4), dict(bias=torch.zeros(64, dtype=torch.int32)), TypeError, "bias must have dtype fp16 or bf16 or fp32 or fp64, got int32"),
    ((_L, 4), dict(bias=torch.zeros(1, 64)), ValueError, "bias must have 1 dimensions"),
    ((_L, 4), dict(bias=torch.zeros(1)), ValueError, r"bias must have shape \(64,\) \(\(num_experts,\)\), got \(1,\)"),
    ((_L, 4), dict(bias=torch.zeros(64, device="meta")), ValueError, "tensors must be on one device, got logits on cpu, bias on meta"),
    ((_NONFINITE, 4), {}, ValueError, r"logits must be finite; found nan at \[2, 7\]"),
    ((_NONFINITE.nan_to_num(nan=float("-inf")), 4), {}, ValueError, r"logits must be finite; found -inf at \[2, 7\]"),
])
def test_reference_refuses_bad_inputs(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        moe_route_reference(*args, **kw)


def test_reference_takes_any_float_dtype_and_strides():
    """The oracle is more permissive than the op: fp64 / fp16 logits and bias, strided views, E past MAX_EXPERTS."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 9, dtype=torch.float64, generator=g).t()     # (9, 64), strided
    bias = (torch.randn(128, dtype=torch.float64, generator=g) * 0.05)[::2]
    kw = dict(top_k=6, n_group=4, topk_group=2, scoring="sqrtsoftplus", routed_scaling_factor=2)
    w, ids = moe_route_reference(logits, bias=bias, **kw)
    rw, rids = moe_route_reference(logits.float().contiguous(), bias=bias.float().contiguous(), **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (9, 6)
    assert torch.equal(ids, rids) and torch.equal(w, rw)
    wh, idh = moe_route_reference(logits.half(), 2, bias=bias.half(), scoring="softmax")
    assert wh.shape == idh.shape == (9, 2)
    wide = torch.randn(3, 2048, generator=g)                              # over the kernels' 1024 experts
    assert moe_route_reference(wide, 8, n_group=8, topk_group=4)[1].shape == (3, 8)


def test_hash_route():
    logits = torch.randn(5, 16)
    tid2eid = torch.randint(0, 16, (100, 3), dtype=torch.int32)
    input_ids = torch.tensor([3, 99, 0, 3, 50])
    w, ids = ops.moe_hash_route(logits, input_ids, tid2eid, scoring="sigmoid", routed_scaling_factor=1.5)
    assert torch.equal(ids, tid2eid[input_ids])
    s = torch.sigmoid(logits).gather(1, ids.long())
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 1.5)
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 100\)"):
        ops.moe_hash_route(logits, torch.tensor([0, 1, 2, 3, 100]), tid2eid)
    with pytest.raises(ValueError, match=r"tid2eid entries must be expert ids in \[0, 16\)"):
        ops.moe_hash_route(logits, input_ids, tid2eid + 16)


# (the block program on sm_90a: test_padded_tile_lowers_for_sm_90a lowers it and finds its __global__ kernel, at a
# padded shape; a second sm_90a lowering here was ~14 s of CI)
def test_lowers_for_ascend():
    assert "__simt_vf__" in moe_route_program.source("ascend", num_experts=64, top_k=6, n_group=8, topk_group=4)


# counts that are not powers of two: the block program pads its (groups, experts a group) tile
PADDED = [
    dict(E=100, top_k=6, scoring="softmax"),                                          # 100 -> 128
    dict(E=60, top_k=4, n_group=3, topk_group=2, scoring="sigmoid"),                  # 3 x 20 -> 4 x 32
    dict(E=160, top_k=6, n_group=5, topk_group=3, scoring="sqrtsoftplus"),            # 5 x 32 -> 8 x 32
]


@pytest.mark.parametrize("kw", PADDED, ids=lambda kw: f"E{kw['E']}")
def test_padded_tile_matches_reference_on_cpu(kw):
    """The cpu target runs the block program: padding slots score 0 and are never picked."""
    kw = dict(kw)
    E = kw.pop("E")
    assert not warp_path_fits(E, kw["top_k"], kw.get("n_group", 1))
    g = torch.Generator().manual_seed(E)
    logits = torch.randn(19, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.1
    w, ids = ops.moe_route(logits, bias=bias, **kw)
    rw, rids = moe_route_reference(logits, bias=bias, **kw)
    assert_same_routing(w, ids, rw, rids, logits, bias, **kw)
    assert int(ids.max()) < E


def test_padded_tile_lowers_for_sm_90a():
    """TileLang's cross-thread reductions need power-of-two widths: 3 groups of 20 lowered before padding
    as a layout error, 100 experts as a butterfly over 100 threads."""
    src = moe_route_program.source("sm_90a", num_experts=60, top_k=4, n_group=3, topk_group=2)
    assert "__global__" in src and "AllReduce" in src


def test_deepseek_shapes_take_the_warp_path():
    assert warp_path_fits(256, 8, 8) and warp_path_fits(256, 8, 1)      # V3 grouping, ungrouped
    assert warp_path_fits(64, 6, 1) and warp_path_fits(512, 16, 16) and warp_path_fits(32, 3, 8)
    assert not warp_path_fits(16, 4, 4)        # fewer experts than lanes: block program
    assert not warp_path_fits(256, 8, 64)      # a group smaller than a lane's 8 experts
    assert not warp_path_fits(96, 4, 3)        # 32-expert groups over 3-expert lanes
    assert not warp_path_fits(1024, 8, 1)      # 32 experts a lane: block program


@pytest.mark.parametrize("params", [
    dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid", has_bias=True, scaling=2.5),
    dict(num_experts=256, top_k=8, n_group=1, scoring="softmax", has_bias=False, dtype="bfloat16"),
    dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sqrtsoftplus"),
])
def test_warp_path_compiles_for_sm_90a_without_smem_or_spills(params):
    """The fast path: one warp per token, lane shuffles only (no shared memory, no barrier), no spills."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    src = moe_route_warp_program.source("sm_90a", **params)
    assert "__shfl_xor_sync" in src and "__ballot_sync" in src and "__syncthreads" not in src
    try:
        stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert stats.histogram.get("SHFL", 0) >= 60 and not stats.histogram.get("BAR")
    assert stats.shared_bytes == 0 and stats.spill_stores == 0 and stats.spill_loads == 0
    assert stats.registers <= 64


def test_warp_path_has_no_cpu_rule():
    """The cpu target runs the block program (test_matches_reference_on_cpu); the warp program is CUDA only."""
    assert "cpu" not in moe_route_warp_program.targets
    with pytest.raises(ValueError, match="no lowering for cpu"):
        moe_route_warp_program.source("cpu", num_experts=256, top_k=8)


def _gpu_check(tokens, E, k, *, dtype=torch.float32, ties=False, seed=0, with_bias=True, **kw):
    g = torch.Generator().manual_seed(seed)
    if ties:      # few distinct logits: many exact ties among experts and among groups
        logits = torch.randint(-2, 3, (tokens, E), generator=g).float()
    else:
        logits = torch.randn(tokens, E, generator=g) * 2
    logits = logits.to(dtype).cuda()
    bias = (torch.randn(E, generator=g) * 0.05).cuda() if with_bias and not ties else None
    if with_bias and ties:
        bias = torch.zeros(E, device="cuda")
    w, ids = ops.moe_route(logits, k, bias=bias, **kw)
    rw, rids = moe_route_reference(logits, k, bias=bias, **kw)
    if ties:      # exact: the reference's stable sorts and the kernel's tie rule agree bit for bit
        assert torch.equal(ids.cpu(), rids.cpu())
        torch.testing.assert_close(w.cpu(), rw.cpu(), atol=1e-7, rtol=1e-6)
    else:
        assert_same_routing(w.cpu(), ids.cpu(), rw.cpu(), rids.cpu(), logits.cpu(), None if bias is None else bias.cpu(),
                            k, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 128, 4096, 16387])
def test_gpu_matches_reference(tokens):
    assert warp_path_fits(256, 8, 8)
    _gpu_check(tokens, 256, 8, **V3)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    dict(V3),                                                             # DeepSeek-V3 grouping
    dict(n_group=1, topk_group=1, scoring="sigmoid", routed_scaling_factor=2.5),
    dict(n_group=1, topk_group=1, scoring="softmax", with_bias=False),
    dict(n_group=8, topk_group=4, scoring="sqrtsoftplus", routed_scaling_factor=1.5),
    dict(n_group=8, topk_group=4, scoring="sigmoid", renormalize=False),
])
@pytest.mark.parametrize("tokens", [1, 128, 4096])
def test_gpu_warp_path_scorings_and_ties(kw, tokens):
    _gpu_check(tokens, 256, 8, **kw)
    _gpu_check(tokens, 256, 8, ties=True, seed=1, **kw)


@pytest.mark.gpu
def test_gpu_bf16_and_other_expert_counts():
    _gpu_check(77, 256, 8, dtype=torch.bfloat16, **V3)
    _gpu_check(77, 64, 6, n_group=1, topk_group=1, scoring="softmax", with_bias=False)     # warp path, 2 a lane
    _gpu_check(77, 512, 16, n_group=16, topk_group=8, scoring="sigmoid")                # warp path, 16 a lane
    _gpu_check(77, 16, 4, n_group=4, topk_group=2, scoring="sigmoid")                   # block program
    _gpu_check(77, 256, 8, n_group=64, topk_group=8, scoring="sigmoid")                 # block program
    _gpu_check(9, 16, 4, n_group=4, topk_group=2, scoring="sigmoid", ties=True)
    for kw in PADDED:                                                                   # block program, padded
        kw = dict(kw)
        _gpu_check(77, kw.pop("E"), kw.pop("top_k"), **kw)


@pytest.mark.gpu
def test_gpu_views_off_alignment_are_copied(off_alignment):
    """logits and bias are read up to 16 bytes a thread: views that start 4 bytes off give the results of
    aligned ones (the warp path of 256 experts and the block path of 100)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    assert not warp_path_fits(100, 6, 1)
    for E, top_k, kw in ((256, 8, V3), (100, 6, dict(scoring="softmax"))):
        logits = torch.randn(33, E, generator=g, device="cuda")
        bias = torch.randn(E, generator=g, device="cuda")
        w, ids = ops.moe_route(logits, top_k, bias=bias, **kw)
        w2, ids2 = ops.moe_route(off_alignment(logits, 4), top_k, bias=off_alignment(bias, 4), **kw)
        assert torch.equal(ids2, ids) and torch.equal(w2, w)


@pytest.mark.gpu
def test_gpu_nonfinite_logits_raise():
    x = torch.randn(4, 256, device="cuda")
    x[3, 200] = float("nan")
    with pytest.raises(ValueError, match=r"logits must be finite; found nan at \[3, 200\]"):
        ops.moe_route(x, 8, n_group=8, topk_group=4)
