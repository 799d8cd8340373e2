"""ops.topk_select: exact row-wise top-k, ties toward the lower index, lengths, padding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.topk_select import topk_select_program, topk_select_reference, topk_select_v3_program


def test_matches_torch_topk_sets(off_alignment):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=g)
    out = ops.topk_select(x, 64)
    ref = torch.topk(x, 64).indices.sort(-1).values.to(torch.int32)
    assert torch.equal(out, ref)
    assert torch.equal(ops.topk_select(off_alignment(x, 4), 64), ref)   # (a view off 16 bytes: copied)


def test_ties_lengths_and_padding():
    x = torch.zeros(4, 300)
    x[1, 200:] = 1.0                       # 100 equal maxima: take the 8 lowest indices
    x[2] = torch.arange(300.0)
    lengths = torch.tensor([300, 300, 50, 5], dtype=torch.int32)
    out = ops.topk_select(x, 8, lengths=lengths)
    assert out[0].tolist() == list(range(8))              # all tie: lowest indices
    assert out[1].tolist() == list(range(200, 208))
    assert out[2].tolist() == list(range(42, 50))         # the length cuts the row
    assert out[3].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]  # shorter than k: -1 padding
    assert torch.equal(out, topk_select_reference(x, 8, lengths=lengths))


def test_negative_values_signed_zero_and_extremes():
    # k = 8 throughout: 4 or 5 larger keys appended put the signed zeros at the threshold
    x = torch.tensor([[-1.0, -0.5, -3.0, float("-inf"), 2.0, float("inf"), -0.0, 0.0]])
    assert ops.topk_select(x, 8).tolist() == [list(range(8))]
    x4 = torch.cat([x, torch.tensor([[5.0, 6.0, 7.0, 8.0]])], 1)
    assert ops.topk_select(x4, 8).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]       # inf, 2, the two zeros
    x5 = torch.cat([x, torch.tensor([[5.0, 6.0, 7.0, 8.0, 9.0]])], 1)
    assert ops.topk_select(x5, 8).tolist() == [[4, 5, 6, 8, 9, 10, 11, 12]]      # -0.0 == +0.0: the lower index wins


def test_all_equal_rows_and_ties_at_the_threshold():
    # every key lands in one bucket (candidate set = the whole row); ties go to the lowest indices
    x = torch.full((5, 5000), 0.5)
    x[1:4, ::7] = 0.75                    # 715 above, then ties at 0.5
    x[2, 4998] = 0.5                      # 714 above: k = 715 takes one tie at 0.5 (column 1)
    x[3, 1] = 0.75                        # 716 above: k = 715 leaves one tie at 0.75 out
    x[4, 4000:] = float("inf")
    x[4, :10] = float("-inf")
    lengths = torch.tensor([5000, 4999, 5000, 4999, 5000], dtype=torch.int32)
    # around the threshold by the count above it (714, 715, 716 keys) at one k; and past them
    for k in (1, 715, 4096):
        assert torch.equal(ops.topk_select(x, k, lengths=lengths), topk_select_reference(x, k, lengths=lengths)), k


def test_short_rows_and_k_equal_n():
    # k = 715: rows of 715 and 716 columns, neither a multiple of the 4-column vector width
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 715, generator=g)
    lengths = torch.tensor([0, 1, 7, 715, 500], dtype=torch.int32)
    assert torch.equal(ops.topk_select(x, 715, lengths=lengths), topk_select_reference(x, 715, lengths=lengths))
    # k = n - 1: rows cut below k padded, the full row a real selection; then on every row
    x = torch.randn(5, 716, generator=g)
    lengths = torch.tensor([0, 1, 7, 716, 500], dtype=torch.int32)
    assert torch.equal(ops.topk_select(x, 715, lengths=lengths), topk_select_reference(x, 715, lengths=lengths))
    assert torch.equal(ops.topk_select(x, 715), topk_select_reference(x, 715))


def test_many_candidates_in_the_threshold_bucket():
    # values that share their top 12 key bits: the k-th largest is found on the low 20 bits
    g = torch.Generator().manual_seed(4)
    x = 1.0 + torch.rand(2, 20000, generator=g) * 0.1     # [1, 1.1): one 12-bit bucket
    x[1] = (x[1] * 64).round() / 64                      # and many exact ties
    for k in (1, 715, 4096):
        assert torch.equal(ops.topk_select(x, k), topk_select_reference(x, k)), k


# any k: the cpu and Ascend program reads k from Out's shape at launch (one build for all of them)
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, 4), n=st.integers(0, 3000), k=st.integers(1, 4096),
       dup=st.booleans(), use_len=st.booleans(), seed=st.integers(0, 9999))
def test_hypothesis(rows, n, k, dup, use_len, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if dup:
        x = (x * 4).round() / 4                            # many exact ties
    lengths = torch.randint(0, n + 1, (rows,), generator=g, dtype=torch.int32) if use_len else None
    assert torch.equal(ops.topk_select(x, k, lengths=lengths), topk_select_reference(x, k, lengths=lengths))


def test_bf16_is_upcast():
    x = torch.randn(2, 500).bfloat16()
    assert torch.equal(ops.topk_select(x, 8), topk_select_reference(x.float(), 8))


def test_invalid_inputs():
    x = torch.randn(2, 100)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4096\]"):
        ops.topk_select(x, 0)
    with pytest.raises(ValueError, match=r"lengths must have shape \(2,\)"):
        ops.topk_select(x, 4, lengths=torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="lengths must have dtype int32"):
        ops.topk_select(x, 4, lengths=torch.ones(2, dtype=torch.int64))
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="must not contain NaN"):
        ops.topk_select(x, 4)


_S = torch.randn(2, 100)
_NAN = torch.randn(2, 100).index_put_((torch.tensor([1]), torch.tensor([5])), torch.tensor(float("nan")))


@pytest.mark.parametrize("args,kw,exc,msg", [
    ((_S.numpy(), 4), {}, TypeError, "scores must be a torch.Tensor, got ndarray"),
    ((_S.int(), 4), {}, TypeError, "scores must have dtype fp16 or bf16 or fp32 or fp64, got int32"),
    ((_S[0], 4), {}, ValueError, r"scores must have 2 dimensions, got shape \(100,\)"),
    ((_S, 0), {}, ValueError, "k must be >= 1, got 0"),
    ((_S, 4.0), {}, TypeError, "k must be an int, got float"),
    ((_S, True), {}, TypeError, "k must be an int, got bool"),
    ((_S, 4), dict(lengths=[100, 100]), TypeError, "lengths must be a torch.Tensor, got list"),
    ((_S, 4), dict(lengths=torch.full((2,), 100.0)), TypeError, "lengths must have dtype int32 or int64, got fp32"),
    ((_S, 4), dict(lengths=torch.ones(2, 1, dtype=torch.int32)), ValueError, "lengths must have 1 dimensions"),
    ((_S, 4), dict(lengths=torch.ones(3, dtype=torch.int32)), ValueError, r"lengths must have shape \(2,\) \(\(rows,\)\)"),
    ((_S, 4), dict(lengths=torch.ones(2, dtype=torch.int32, device="meta")), ValueError,
     "tensors must be on one device, got scores on cpu, lengths on meta"),
    ((_NAN, 4), {}, ValueError, r"scores must not contain NaN .*, got nan at index \(1, 5\) \(1 such\)"),
    ((_NAN, 4), dict(lengths=torch.tensor([100, 6])), ValueError, "scores must not contain NaN"),
])
def test_reference_refuses_bad_inputs(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        topk_select_reference(*args, **kw)


def test_reference_takes_any_float_dtype_strides_and_the_ops_length_clamping():
    """The oracle is more permissive than the op (fp64, strided scores, int64 lengths, k past N or MAX_K) and
    clamps lengths to [0, N] as the op does; NaN past a row's length is never read, so it is not refused."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 3, dtype=torch.float64, generator=g).t()          # (3, 40), strided
    want = torch.topk(x, 5).indices.sort(-1).values.to(torch.int32)
    assert torch.equal(topk_select_reference(x, 5), want)
    assert torch.equal(topk_select_reference(x.contiguous(), 5), want)
    lengths = torch.tensor([[-3, 99, 7]]).t()[:, 0]                        # int64, strided
    out = topk_select_reference(x, 5, lengths=lengths)
    assert out[0].tolist() == [-1] * 5                                     # negative: an empty row
    assert torch.equal(out[1], want[1])                                    # past N: the whole row
    assert torch.equal(out[2], torch.topk(x[2, :7], 5).indices.sort().values.to(torch.int32))
    assert torch.equal(out, topk_select_reference(x.float(), 5, lengths=lengths.clamp(0, 40).int()))
    wide = topk_select_reference(x, 5000)                                  # k > N and > MAX_K: -1 padding
    assert wide.shape == (3, 5000) and torch.equal(wide[:, :40], torch.arange(40, dtype=torch.int32).expand(3, 40))
    assert (wide[:, 40:] == -1).all()
    y = x.clone()
    y[2, 7:] = float("nan")                                                # only past row 2's length
    assert torch.equal(topk_select_reference(y, 5, lengths=lengths), out)
    assert topk_select_reference(torch.empty(0, 0), 3).shape == (0, 3)


def test_lowers_for_gpu_targets():
    # (the one-block-per-row v2 program, which CUDA runs only when asked for: sm_90a only, ~25 s of CI a
    # target; the kernels CUDA runs build for both targets below)
    assert "__global__" in topk_select_program.source("sm_90a")


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_v3_builds_without_spills_and_with_few_barriers(target):
    # the CUDA kernel: float4 loads into registers, hand-placed barriers (TileLang's sync pass off)
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    src = topk_select_v3_program.source(target, k=2048)
    assert "float4" in src and "__shfl_up_sync" in src and "__ballot_sync" in src
    try:
        st = sass_stats(build_cubin(src, target), target)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert st.spill_stores == 0 and st.spill_loads == 0, st.format()
    assert st.histogram.get("BAR", 0) <= 20, st.format()           # v2 had ~220 (one per shared atomic)
    assert st.histogram.get("LDGSTS", 0) == 0                     # no shared staging of the scores


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_sliced_kernels_build_without_spills(target):
    # the default CUDA path: block per slice (float4 loads, all in flight), block per row to finish
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.topk_sliced import topk_bucket_program, topk_finish_program, topk_gather_program, topk_hist_program

    srcs = {p.name: p.source(target, k=2048) for p in (topk_hist_program, topk_bucket_program, topk_gather_program,
                                                         topk_finish_program)}
    assert "float4" in srcs["topk_hist"] and "float4" in srcs["topk_gather"]
    assert "__shfl_up_sync" in srcs["topk_gather"] and "__shfl_up_sync" in srcs["topk_finish"]
    for name, src in srcs.items():
        try:
            st = sass_stats(build_cubin(src, target), target)
        except ToolchainError as e:
            pytest.skip(f"CUDA 13 tools missing: {e}")
        assert st.spill_stores == 0 and st.spill_loads == 0, (name, st.format())
        assert st.histogram.get("BAR", 0) <= (40 if name == "topk_finish" else 6), (name, st.format())


@pytest.mark.parametrize("n,expect", [(131072, (8, 8)), (65536, (8, 4)), (100000, (8, 8)), (4096, (2, 1)),
                                      (1000, (1, 1)), (2049, (2, 1)), (131073, None), (300001, None)])
def test_cluster_plan_covers_the_row_with_the_fewest_blocks(n, expect):
    from ops.topk_cluster import plan
    from ops.topk_sliced import slice_cols

    assert plan(n) == expect
    if expect is not None:
        cluster, vec = expect
        assert cluster * slice_cols(512, vec) >= n


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("params", [dict(k=2048, cluster=8, vec=8), dict(k=512, cluster=8, vec=4),
                                    dict(k=2048, cluster=1, vec=1)])
def test_cluster_kernel_builds_for_two_blocks_per_sm(target, params):
    # one HBM pass: the slice stays in shared memory (64 KB at vec=8), so two 512-thread blocks per
    # SM need <= 64 registers; the write loop is rolled for that (unrolled: 127 registers)
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.topk_cluster import topk_cluster_program

    src = topk_cluster_program.source(target, **params)
    assert "float4" in src and "__ldcg" in src
    assert ("__cluster_barrier_wait()" in src) == (params["cluster"] > 1)
    try:
        st = sass_stats(build_cubin(src, target), target)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert st.spill_stores == 0 and st.spill_loads == 0, st.format()
    assert st.registers <= 64, st.format()
    assert st.histogram.get("BAR", 0) <= 10, st.format()


def test_workspace_views_are_contiguous_aligned_and_disjoint():
    # the op's scratch tensors (ops/_workspace.py): one allocation, each view 16-byte aligned
    from ops._workspace import int32_views

    views = int32_views("cpu", (3, 4097), 5, (3, 2), 0, 7)
    assert [tuple(v.shape) for v in views] == [(3, 4097), (5,), (3, 2), (0,), (7,)]
    base = views[0].untyped_storage().data_ptr()
    for v in views:
        assert v.is_contiguous() and v.dtype == torch.int32 and (v.data_ptr() - base) % 16 == 0
        assert v.untyped_storage().data_ptr() == base
    for v, i in zip(views, range(1, 6)):
        v.fill_(i)
    assert [int(v.min()) if v.numel() else i for v, i in zip(views, range(1, 6))] == [1, 2, 3, 4, 5]
    assert [int(v.max()) if v.numel() else i for v, i in zip(views, range(1, 6))] == [1, 2, 3, 4, 5]


def test_cluster_words_have_no_rule_off_cuda():
    from codegen import rules, targets

    for t in ("cpu", "ascend:950"):
        with pytest.raises(rules.NoRuleError):
            rules.lookup("cluster_barrier", targets.get(t))
    with pytest.raises(ValueError, match="cluster must be 1, 2, 4 or 8"):
        rules.lookup("cluster_grid", targets.get("sm_90a")).fn(64, 512, 16)


def test_lowers_for_ascend_as_one_vector_function():
    src = topk_select_program.source("ascend")
    assert src.count("__simt_vf__") == 1 and "asc_vf_call" in src  # the whole row in one SIMT region
    assert "asc_atomic_add" in src                                  # the histograms
    # tile.cumsum over the 256 lanes: a Hillis-Steele scan, one round per power of two below 256
    for off in (1, 2, 4, 8, 16, 32, 64, 128):
        assert f"if (({off} <= ((int32_t)threadIdx.x)))" in src
    assert "asc_atomic_add(  " not in src  # the histogram index is computed before the call (valid C)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(64, 131072, 2048), (128, 65536, 512), (3, 1000, 2048)])
def test_gpu_matches_reference(rows, n, k):
    x = torch.randn(rows, n, device="cuda")
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    assert torch.equal(ops.topk_select(x, k, lengths=lengths).cpu(), topk_select_reference(x.cpu(), k, lengths=lengths.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(4, 131072, 2048), (3, 65537, 512), (2, 1001, 1001)])
def test_gpu_ties_and_crowded_buckets(rows, n, k):
    # row 0 all equal, row 1 one crowded 12-bit bucket with ties, the rest random with ties
    x = torch.randn(rows, n, device="cuda")
    x[0] = 0.25
    x[1] = ((1.0 + torch.rand(n, device="cuda") * 0.1) * 256).round() / 256
    x[2:] = (x[2:] * 8).round() / 8
    lengths = torch.tensor([n, n - 3, n // 2, 1][:rows], dtype=torch.int32, device="cuda")
    for ln in (None, lengths):
        got = ops.topk_select(x, k, lengths=ln).cpu()
        assert torch.equal(got, topk_select_reference(x.cpu(), k, lengths=None if ln is None else ln.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(2, 300001, 4096), (3, 16385, 2048), (4, 4096, 4096), (2, 7, 3)])
def test_gpu_long_rows_chunk_edges_and_k_at_n(rows, n, k):
    # rows longer than the indexer's, lengths on and off chunk boundaries (16384 columns), n <= k
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, n, device="cuda", generator=g)
    x[0, ::3] = (x[0, ::3] * 4).round() / 4                      # ties near the threshold
    lengths = torch.tensor([n, 16384, n - 1, k][:rows], dtype=torch.int32, device="cuda").clamp(max=n)
    for ln in (None, lengths):
        got = ops.topk_select(x, k, lengths=ln).cpu()
        assert torch.equal(got, topk_select_reference(x.cpu(), k, lengths=None if ln is None else ln.cpu()))


@pytest.mark.gpu
def test_gpu_scores_off_alignment_are_copied(off_alignment):
    """The kernels read rows 16 bytes a thread: a scores view that starts 4 bytes off gives the aligned
    result (the cluster kernel's rows and the sliced kernels')."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for n in (3000, 200000):
        x = torch.randn(3, n, generator=g, device="cuda")
        assert torch.equal(ops.topk_select(off_alignment(x, 4), 64), ops.topk_select(x, 64)), n


@pytest.mark.gpu
def test_gpu_signed_zero_infinities_and_ties_across_chunks():
    n = 40000
    x = torch.full((3, n), float("-inf"), device="cuda")
    x[0, ::5] = 0.0
    x[0, 1::10] = -0.0                                           # equal to +0.0: the lower index wins
    x[1, 100:] = float("inf")                                    # ties everywhere: the first k columns of inf
    x[2] = torch.arange(n, device="cuda").float() % 3            # ties at 2.0, spread over three chunks
    for k in (1, 2048, 4096):
        assert torch.equal(ops.topk_select(x, k).cpu(), topk_select_reference(x.cpu(), k)), k


@pytest.mark.gpu
@pytest.mark.parametrize("params", [dict(kernel="sliced"), dict(kernel="sliced", threads=128, vec=2),
                                    dict(kernel="cluster", cluster=8, vec=8), dict(kernel="cluster", cluster=4, vec=8),
                                    dict(kernel="v3"), dict(kernel="v2")])
def test_gpu_benchmarked_variants_match(params):
    # the configurations bench/suites/topk.py times next to the default must be right too
    from ops.topk_select import _impl

    x = torch.randn(3, 50001, device="cuda")
    x[1] = (x[1] * 8).round() / 8
    lengths = torch.tensor([50001, 12289, 2047], dtype=torch.int32, device="cuda")
    got = _impl(x, 2048, lengths, **params).cpu()
    assert torch.equal(got, topk_select_reference(x.cpu(), 2048, lengths=lengths.cpu()))


@pytest.mark.gpu
def test_gpu_rows_beyond_the_slice_limit_fall_back():
    # more than MAX_SLICES slices of 8192 columns: the one-block-per-row kernel takes the row
    from ops.topk_sliced import MAX_SLICES, slice_cols

    n = MAX_SLICES * slice_cols() + 5
    x = torch.randn(1, n, device="cuda")
    assert torch.equal(ops.topk_select(x, 2048).cpu(), topk_select_reference(x.cpu(), 2048))
