"""Quantizers and the block-scaled FP8 GEMM family (DeepGEMM layouts)."""

import functools
import inspect
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from backends.cuda.sass import wgmma_serialized
from ops.gemm_fp8 import fp8_gemm_program


@pytest.fixture(autouse=True)
def _swapped_mxfp4_tests_on_the_swapped_kernel(request, monkeypatch):
    """The tests of the swapped MXFP4 kernel run it at every m: ops.gemm_mxfp4.WARP_TOKENS = 0 (m <= WARP_TOKENS
    takes the warp kernel otherwise)."""
    if "swapped" in request.node.name:
        from ops import gemm_mxfp4

        monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 0)


def calc_diff(x, y):
    """DeepGEMM's similarity: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


# ---- quantizers (CPU) ----------------------------------------------------------------------------

@pytest.mark.parametrize("ue8m0", [False, True])
def test_token_group_quant_is_exact_and_bounded(ue8m0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * 5
    q, sf = ops.per_token_group_quant_fp8(x, ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and sf.shape == (7, 3)
    if ue8m0:
        assert torch.equal(torch.exp2(torch.log2(sf).round()), sf)        # powers of two
    back = ops.dequant_fp8_token_groups(q, sf)
    amax = x.abs().view(7, -1)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + sf.repeat_interleave(128, 1)[:, :300] * 2 ** -9).all()
    if not ue8m0:  # amax / 448 scales: the block's max maps to 448 exactly, so requantizing is the identity
        q2, sf2 = ops.per_token_group_quant_fp8(back)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sf2, sf)
    del amax


def test_block_quant_shapes_and_error():
    w = torch.randn(200, 300)
    q, sf = ops.per_block_quant_fp8(w)
    assert sf.shape == (2, 3)
    back = ops.dequant_fp8_blocks(q, sf)
    assert calc_diff(back, w) < 1e-3


def test_mxfp4_round_trip_and_format():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    packed, scales = ops.quant_mxfp4(w)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8 and scales.shape == (16, 2)
    back = ops.dequant_mxfp4(packed, scales)
    assert torch.equal(torch.stack(ops.quant_mxfp4(back)[0:1])[0], packed)          # exact codes
    # every value is an e2m1 value times its block's power of two
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    unit = torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    assert torch.isin((back / unit).abs(), grid).all()
    assert calc_diff(back, w) < 2e-2
    one = torch.zeros(1, 32)
    one[0, 3] = -6.0
    p, s = ops.quant_mxfp4(one)
    assert int(s[0, 0]) == 127 and int(p[0, 1] >> 4) == 0xF                     # -6 = sign | code 7


def test_quantizer_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quant_mxfp4(torch.randn(4, 48))
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.per_token_group_quant_fp8(torch.zeros(2, 128, dtype=torch.int32))


def test_quantizer_flags_and_dequant_inputs_are_checked():
    """ue8m0 must be a bool (a string such as 'no' is not taken as True); the exact dequant helpers check their
    scales' shape (too many columns were cut off silently) and dtypes."""
    x = torch.randn(4, 256)
    with pytest.raises(TypeError, match="ue8m0 must be a bool, got str"):
        ops.per_token_group_quant_fp8(x, ue8m0="no")
    with pytest.raises(TypeError, match="ue8m0 must be a bool"):
        ops.per_block_quant_fp8(x, ue8m0=None)
    q, sf = ops.per_token_group_quant_fp8(x)
    with pytest.raises(ValueError, match=r"sf must have shape \(4, 2\)"):
        ops.dequant_fp8_token_groups(q, torch.cat([sf, sf], 1))
    with pytest.raises(TypeError, match="x_fp8 must have dtype float8_e4m3fn"):
        ops.dequant_fp8_token_groups(q.view(torch.uint8), sf)
    qb, sfb = ops.per_block_quant_fp8(torch.randn(256, 128))
    with pytest.raises(ValueError, match=r"sf must have shape \(2, 1\)"):
        ops.dequant_fp8_blocks(qb, sfb[:1])
    with pytest.raises(ValueError, match="at least one dimension"):
        ops.dequant_mx_fp8(torch.zeros((), dtype=torch.float8_e4m3fn), torch.zeros((), dtype=torch.uint8))
    assert torch.equal(ops.dequant_fp8_token_groups(q, sf), q.float() * sf.repeat_interleave(128, 1))


def test_mx_dequant_helpers_check_k_and_device():
    """dequant_mxfp4 refuses a packed row that is not whole MX blocks (k = 2 x bytes a multiple of 32: a broadcast
    error from torch before), and both MX dequant helpers refuse scales on another device than the values."""
    packed, scales = ops.quant_mxfp4(torch.randn(4, 64))
    for half in (8, 24):                               # k = 16, 48
        with pytest.raises(ValueError, match=rf"packed must have a multiple of 16 bytes a row .*got shape \(4, {half}\)"):
            ops.dequant_mxfp4(packed[:, :half].contiguous(), scales[:, :half // 16].contiguous())
    with pytest.raises(ValueError, match="tensors must be on one device, got packed on cpu, scales on meta"):
        ops.dequant_mxfp4(packed, scales.to("meta"))
    x8 = torch.randn(4, 64).to(torch.float8_e4m3fn)
    sx = torch.full((4, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tensors must be on one device, got x_fp8 on cpu, scales on meta"):
        ops.dequant_mx_fp8(x8, sx.to("meta"))


# ---- GEMMs on CPU tensors: the exact-dequant reference ---------------------------------------------

def quantized(m, n, k, g):
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qa, sfa = ops.per_token_group_quant_fp8(a)
    qb, sfb = ops.per_block_quant_fp8(b)
    return a, b, qa, sfa, qb, sfb


def test_dense_cpu_matches_the_real_product():
    a, b, qa, sfa, qb, sfb = quantized(33, 256, 384, torch.Generator().manual_seed(2))
    out = ops.fp8_gemm_nt(qa, sfa, qb, sfb)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 256)
    assert calc_diff(out, a @ b.T) < 1e-3


def test_grouped_equals_per_group_dense_on_cpu():
    g = torch.Generator().manual_seed(3)
    G, n, k = 3, 128, 256
    m_indices = torch.tensor([0] * 128 + [2] * 100 + [-1] * 28 + [1] * 128, dtype=torch.int32)
    a = torch.randn(384, k, generator=g)
    qa, sfa = ops.per_token_group_quant_fp8(a)
    bs = [ops.per_block_quant_fp8(torch.randn(n, k, generator=g)) for _ in range(G)]
    qb = torch.stack([q for q, _ in bs])
    sfb = torch.stack([s for _, s in bs])
    out = ops.m_grouped_fp8_gemm_nt_contiguous(qa, sfa, qb, sfb, m_indices)
    for e in range(G):
        rows = (m_indices == e).nonzero().flatten()
        torch.testing.assert_close(out[rows], ops.fp8_gemm_nt(qa[rows], sfa[rows], qb[e], sfb[e]))
    assert (out[m_indices == -1] == 0).all()
    masked_m = torch.tensor([5, 0, 64], dtype=torch.int32)
    am = qa[:3 * 64].view(3, 64, k).contiguous()
    sm = sfa[:3 * 64].view(3, 64, -1).contiguous()
    outm = ops.m_grouped_fp8_gemm_nt_masked(am, sm, qb, sfb, masked_m, expected_m=32)
    for e in range(G):
        mm = int(masked_m[e])
        torch.testing.assert_close(outm[e, :mm], ops.fp8_gemm_nt(am[e, :mm], sm[e, :mm], qb[e], sfb[e]))
        assert (outm[e, mm:] == 0).all()


def test_custom_op_and_out_buffer():
    a, b, qa, sfa, qb, sfb = quantized(4, 128, 256, torch.Generator().manual_seed(7))
    compiled = torch.compile(lambda *x: ops.fp8_gemm_nt(*x), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(qa, sfa, qb, sfb), ops.fp8_gemm_nt(qa, sfa, qb, sfb))
    out = torch.full((4, 128), float("nan"))
    assert ops.fp8_gemm_nt(qa, sfa, qb, sfb, out=out) is out and not out.isnan().any()
    with pytest.raises(ValueError, match=r"out must have shape \(4, 128\)"):
        ops.fp8_gemm_nt(qa, sfa, qb, sfb, out=torch.empty(4, 127))
    with pytest.raises(TypeError, match="out_dtype must be bf16 or fp32"):
        ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float16)


def test_gemm_errors():
    g = torch.Generator().manual_seed(4)
    a, b, qa, sfa, qb, sfb = quantized(4, 128, 256, g)
    with pytest.raises(TypeError, match="a must have dtype float8_e4m3fn"):
        ops.fp8_gemm_nt(a, sfa, qb, sfb)
    with pytest.raises(ValueError, match="must share k"):
        ops.fp8_gemm_nt(qa, sfa, qb[:, :128].contiguous(), sfb[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"sfa must have shape \(4, 2\)"):
        ops.fp8_gemm_nt(qa, sfa[:, :1].contiguous(), qb, sfb)
    with pytest.raises(ValueError, match="n must be a multiple of 64"):
        ops.fp8_gemm_nt(qa, sfa, qb[:100].contiguous(), sfb)
    with pytest.raises(ValueError, match=r"m_indices must be in \[-1, 1\)"):
        ops.m_grouped_fp8_gemm_nt_contiguous(torch.cat([qa] * 32), torch.cat([sfa] * 32), qb[None], sfb[None],
                                             torch.full((128,), 3, dtype=torch.int32))


def test_gemm_scalars_devices_and_out_dtype_are_checked():
    """expected_m is an int >= 0; m_indices and masked_m must be on a's device (a meta tensor there reads no
    values); out_dtype that disagrees with `out` is refused instead of ignored."""
    g = torch.Generator().manual_seed(5)
    a, b, qa, sfa, qb, sfb = quantized(4, 128, 256, g)
    mm = torch.tensor([4], dtype=torch.int32)
    args = (qa[None], sfa[None], qb[None], sfb[None], mm)
    with pytest.raises(TypeError, match="expected_m must be an int, got str"):
        ops.m_grouped_fp8_gemm_nt_masked(*args, expected_m="64")
    with pytest.raises(ValueError, match=r"expected_m must be >= 0, got -3"):
        ops.m_grouped_fp8_gemm_nt_masked(*args, expected_m=-3)
    with pytest.raises(ValueError, match="masked_m on meta"):
        ops.m_grouped_fp8_gemm_nt_masked(*args[:4], mm.to("meta"))
    pad = torch.zeros(128, 256).to(torch.float8_e4m3fn)
    ids = torch.zeros(128, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="m_indices on meta"):
        ops.m_grouped_fp8_gemm_nt_contiguous(pad, torch.ones(128, 2), qb[None], sfb[None], ids)
    with pytest.raises(ValueError, match="disagrees with out's dtype"):
        ops.fp8_gemm_nt(qa, sfa, qb, sfb, out=torch.empty(4, 128, dtype=torch.bfloat16), out_dtype=torch.float32)
    out = torch.empty(4, 128, dtype=torch.float32)
    assert ops.fp8_gemm_nt(qa, sfa, qb, sfb, out=out) is out


def test_the_fast_operand_check_accepts_exactly_what_the_named_checks_accept():
    """_well_formed (the eager hot path's one-expression check) is True only where every named check
    passes: each broken variant is refused by both, each good layout accepted by both."""
    from ops.gemm_fp8 import _check_operands, _well_formed

    g = torch.Generator().manual_seed(8)
    *_, qa, sfa, qb, sfb = quantized(4, 256, 256, g)
    good = [(qa, sfa, qb, sfb, False, False), (qa, sfa, qb[None], sfb[None], True, False),
            (qa[None], sfa[None], qb[None], sfb[None], True, True)]
    for args in good:
        assert _well_formed(*args) and _check_operands(*args) == (256, 256)
    bad = [(qa.float(), sfa, qb, sfb), (qa, sfa.double(), qb, sfb), (qa, sfa, qb, sfb.half()),
           (qa, sfa[:, :1].contiguous(), qb, sfb), (qa, sfa, qb, sfb[:1].contiguous()),
           (qa, sfa, qb, sfb[:, :1].contiguous()),
           (qa, sfa, qb[:, :128].contiguous(), sfb[:, :1].contiguous()),
           (qa.t().contiguous().t(), sfa, qb, sfb), (qa, sfa.t().contiguous().t(), qb, sfb),
           (qa, sfa, qb.t().contiguous().t(), sfb), (qa, sfa, qb, sfb.t().contiguous().t()),
           (qa[:, :192].contiguous(), torch.ones(4, 2), qb[:, :192].contiguous(), torch.ones(2, 2)),   # k % 128
           (qa[None], sfa, qb, sfb), (qa, sfa, qb, sfb.numpy())]
    for i, (a, fa, b, fb) in enumerate(bad):
        assert not _well_formed(a, fa, b, fb, False, False), i
        with pytest.raises((TypeError, ValueError)):
            _check_operands(a, fa, b, fb, False, False)


# ---- lowering ------------------------------------------------------------------------------------

_LOWERED = {}


def lowered(program, target, **params):
    """program.source(target, **params), lowered once per test session (keyed on the bound parameters,
    defaults filled in): several tests read the same kernel's source, and a v3 split-K lowering takes
    ~6 s of CI. Only for calls that succeed and run with no monkeypatched rules."""
    key = (program.name, target, tuple(sorted(program.bind(params).items())))
    if key not in _LOWERED:
        _LOWERED[key] = program.source(target, **params)
    return _LOWERED[key]


@pytest.mark.parametrize("target,instr", [("sm_90a", "QGMMA"), ("sm_100a", "UTCQMMA")])
def test_lowers_to_fp8_tensor_cores(target, instr):
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    try:
        src = fp8_gemm_program.source(target, n=256, k=512)
        hist = sass_stats(build_cubin(src, target.split(":")[-1]), target).histogram
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert hist.get(instr, 0) > 0


@pytest.mark.parametrize("params", [dict(n=2112, k=7168, block_m=64, block_n=64), dict(n=4096, k=7168, mode="contiguous"),
                                    dict(n=4096, k=7168, mode="masked", block_m=64), dict(n=256, k=1024, block_m=64, splits=2)])
def test_ascend_source_has_the_fp8_cube_mma_and_the_vector_fold(params):
    src = fp8_gemm_program.source("ascend", **params)
    bm, bn = params.get("block_m", 128), params.get("block_n", 128)
    # the Cube multiplies the fp8 tiles straight from L1 into L0C, one 128-wide K block at a time
    assert f"ascend_gemm_l1<{bm}, 128, {bn}, 128, true, float8_e4m3_t>" in src and "ASC_IS_AIC" in src
    assert "asc_copy_l0c2ub" in src and "asc_dual_dst_mode>(1)" in src   # L0C -> both vector cores' UB
    assert f"asc_get_sub_block_id() * {bm // 2}" in src                 # each vector core: half the rows
    # per K block the vector cores wait for the product, then fold it in with its scales
    aiv = src[src.index("if ASC_IS_AIV"):]
    loop = aiv[aiv.index("for ("):]
    calls = re.findall(r"asc_vf_call<(\w+)>", loop[loop.index("asc_sync_intra_wait(PIPE_V"):])
    assert calls, "no vector function after the L0C -> UB handoff"
    fold = src[src.index(f"void {calls[0]}("):]
    fold = fold[:fold.index("\n}\n")]
    assert "__ubuf__ float2" in fold and " + " in fold and " * " in fold  # acc += p * scale, in UB


def test_reduce_lowers_for_ascend():
    from ops.gemm_fp8 import fp8_gemm_reduce_program

    assert "__simt_vf__" in fp8_gemm_reduce_program.source("ascend", n=4096, splits=4)


def test_split_k_fold_is_one_kernel_that_counts_arrivals():
    """fold=True: after storing its partials a block arrives on its tile's counter (fence, atomic);
    the last adds the partials in split order and writes C, so no reduce kernel is built. It needs
    splits > 1 and a target with a rule for tile.last_arrival (the v3 loop's fold: its own test)."""
    from codegen.rules import NoRuleError
    from ops.gemm_fp8 import split_k_launchers

    src = fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, fold=True)
    assert "__threadfence()" in src and "AtomicAddRet(" in src and "Count[" in src
    assert "__threadfence()" not in lowered(fp8_gemm_program, "sm_90a", n=4096, k=7168, splits=4)
    fold = src[src.index("AtomicAddRet("):]
    # P0 + P1 + P2 + P3 as the reduce kernel adds them: four loads of Part, then the adds in order
    assert fold.count("Part_local_cast_") >= 4 and "*(uint2*)(C +" in fold
    with pytest.raises(ValueError, match="fold=True"):
        fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=1, fold=True)
    with pytest.raises(NoRuleError, match="last_arrival"):
        fp8_gemm_program.source("ascend", n=4096, k=7168, splits=4, fold=True)

    # trace=True: six SM-clock stamps a block into Count (bench.prof_gemm --trace) in the v2 loop; the
    # v3 loop stamps five events, "step 1" once: in the main burst. A split's count is 14 or 0 (56 K
    # blocks, 4 even splits; tile.steps_if), so the one tail left (2 steps after 3 bursts of 4) cannot hold
    # step 1; before session 73 three dead tails (1, 2, 3 steps) each stamped it too
    assert fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, trace=True).count("clock()") == 6
    v3 = fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, overlap=True, stages=6, trace=True)
    assert v3.count("clock()") == 5 and v3.count("* (int64_t)8) + (int64_t)2)] = clock()") == 1
    with pytest.raises(ValueError, match="trace=True"):
        fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, fold=True, trace=True)
    # trace_steps=True (bench.prof_gemm --trace-steps): a block's stamps 8 + 2 x 14 K blocks apart; the
    # producer's first thread (after the 256 MMA threads) stamps each block's issue at 8 + s, the MMA
    # warpgroups each landing at 8 + 14 + block, in the main burst (4 a burst) and the one tail (blocks 12, 13)
    steps = fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, overlap=True, stages=6, trace=True,
                                    trace_steps=True)
    issue = steps[:steps.index("+ ((int64_t)s)) + (int64_t)8)] = clock()")]
    assert re.findall(r"threadIdx\.x\) == (\d+)\)", issue)[-1] == "256"
    assert re.findall(r"\* \(int64_t\)36\) \+ \(\(\(int64_t\)\w+\) \* \(int64_t\)4\)\) \+ \(int64_t\)(\d+)\)\] = clock", steps) == \
        ["22", "23", "24", "25"]
    assert re.findall(r"\* \(int64_t\)14\)\) \+ \(int64_t\)(\d+)\)\] = clock", steps) == ["20", "21"]   # 8 + 14 + 12 - 14
    assert steps.count("clock()") == 5 + 1 + 4 + 2              # events, issue, the burst, the tail
    with pytest.raises(ValueError, match="trace_steps=True"):
        fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, overlap=True, trace_steps=True)

    class Kernel:
        def launcher(self):
            return "kernel"
    assert split_k_launchers(Kernel(), "sm_90a", 4096, 4, "bfloat16", fold=True) == ("kernel", None)


@pytest.mark.parametrize("preset", ["grouped", "decode", "prefill"])
def test_bench_static_stats_build_the_ops_plan(monkeypatch, preset):
    """bench.op without a GPU builds, for each FP8 case, the program _launch compiles for it (ops.gemm_fp8.op_plan on
    132 SMs): the parameters are the ones _launch passes to fp8_gemm_program.compile, captured here without a GPU.
    (Session 73's masked 128 x 256 tile spilled; the static stats of the grouped preset now show that tile.)"""
    from bench.suites import gemm as suite
    from codegen import targets
    from ops import gemm_fp8

    class Compiled(Exception):
        pass

    def capture(target, **params):
        raise Compiled(params)

    sm90 = targets.get("cuda:sm_90a")
    monkeypatch.setattr(gemm_fp8.fp8_gemm_program, "compile", capture)
    monkeypatch.setattr(gemm_fp8, "sm_count", lambda a: suite.STATIC_SMS)
    monkeypatch.setattr(gemm_fp8, "max_active_clusters", lambda a, cluster, threads, smem: suite.STATIC_SMS // cluster)
    monkeypatch.setattr(gemm_fp8.targets, "resolve", lambda *a, **kw: sm90)
    for c in suite.PRESETS[preset]:
        G, m, n, k = c.get("groups", 1), c["m"], c["n"], c["k"]
        a2 = torch.empty(G, m, k) if c["kind"] == "masked" else torch.empty(G * m, k)
        out2 = torch.empty(*a2.shape[:-1], n, dtype=torch.bfloat16)
        block_m = 128 if c["kind"] == "contiguous" else 64 if m <= 64 else 128
        with pytest.raises(Compiled) as e:
            gemm_fp8._launch(c["kind"], a2, None, None, None, None, None, out2, n, k, block_m=block_m)
        (prog, params), = suite._kernels(c, "cuda:sm_90a")
        assert prog is fp8_gemm_program and params == e.value.args[0], c
    if preset == "grouped":
        masked = next(c for c in suite.PRESETS[preset] if c["kind"] == "masked")
        assert suite._kernels(masked)[0][1]["block_n"] == 256


def test_op_plan_keeps_a_callers_grid_and_tiles():
    """A caller's sms (the persistent grid) and forced tiles reach the plan: op_plan's own SM count is device_sms, so
    an sms override neither collides with it (session 75: "got multiple values for argument 'sms'") nor replaces it."""
    from codegen import targets
    from ops.gemm_fp8 import op_plan

    sm90 = targets.get("cuda:sm_90a")
    p = op_plan("masked", 64, 4096, 7168, 64, 4, "float32", sm90, 132, None, True, persistent=True, sms=4)
    assert p["persistent"] and p["sms"] == 4
    p = op_plan("dense", 64, 2112, 7168, 64, 1, "bfloat16", sm90, 132, None, True, splits=4, block_n=64, stages=4)
    assert (p["splits"], p["block_n"], p["stages"]) == (4, 64, 4)


def test_masked_wide_tile_builds_without_spills():
    """The masked layout's 128 x 256 one-split tile (the op's plan at 1 x 1024 x 4096 x 7168) keeps its K loop in
    registers. With tile.steps_if's count there nvcc spilled 19 / 38 words a thread (session 74: 51.8 -> 67.8 us on an
    H100), so that tile keeps the if_then_else count; 128-wide masked tiles take steps_if without spilling."""
    src = fp8_gemm_program.source("sm_90a", n=4096, k=7168, mode="masked", block_m=128, block_n=256, splits=1,
                                  stages=4, overlap=True, stage_c=True)
    _, log = _sass_and_ptxas_log(src)
    assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == []


def test_v3_split_k_ready_fold_has_no_fences_and_one_batch_of_loads(monkeypatch):
    """fold=True in the v3 loop (READY_FOLD_ROWS): a split block stores its partial as ready words (tc_ready_value), the
    256 MMA threads arrive on the tile's counter with no fence, and the last block folds the tile with up to 16
    loads a thread in flight (tc_ready_fold4<splits, items>: one batch for 64 x 64 in 4 splits, two for 128 x 128 in
    2); no spills, no serialized WGMMA. bf16 out on sm_90a only. READY_FOLD_ROWS is in the launchers' key."""
    from ops import gemm_fp8
    from test_gemm_fp8 import _sass_and_ptxas_log

    for params, calls in ((dict(n=2112, k=7168, block_m=64, block_n=64, splits=4, stages=6), ["<4, 4>"]),
                          (dict(n=7168, k=16384, block_m=128, block_n=128, splits=2, stages=5), ["<2, 8>"] * 2)):
        src = fp8_gemm_program.source("sm_90a", overlap=True, fold=True, **params)
        body = src.split('extern "C" __global__')[-1]
        assert "__threadfence" not in body and body.count("AtomicAddRet(") == 1
        assert re.search(r"Part\[.*\] = tc_ready_value\(acc", body)
        assert re.findall(r"tc_ready_fold4(<\d+, \d+>)\(", body) == calls
        assert "tl::__sync_thread_partial(11, 256);" in body               # the MMA threads' arrival barrier
        sass, log = _sass_and_ptxas_log(src)
        assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == []
        plain = fp8_gemm_program.source("sm_90a", overlap=True, **params)
        assert "tc_ready" not in plain and "AtomicAddRet(" not in plain
    for bad, match in ((dict(out_dtype="float32"), "out_dtype bfloat16"), (dict(splits=1), "splits > 1")):
        with pytest.raises(ValueError, match=match):
            fp8_gemm_program.source("sm_90a", n=2112, k=7168, block_m=64, block_n=64, **{"splits": 4, **bad},
                                    overlap=True, fold=True)
    with pytest.raises(ValueError, match="cuda:sm_90a"):
        fp8_gemm_program.source("sm_100a", n=2112, k=7168, block_m=64, block_n=64, splits=4, overlap=True, fold=True)

    keys = []

    def launchers(key, build):
        keys.append(key)
        raise StopIteration
    monkeypatch.setattr(gemm_fp8.jit, "launchers", launchers)
    a, sfa = torch.zeros(64, 7168, dtype=torch.float8_e4m3fn), torch.ones(64, 56)
    b, sfb = torch.zeros(1, 2112, 7168, dtype=torch.float8_e4m3fn), torch.ones(1, 17, 56)
    aux = torch.zeros(64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for rows in (0, 64):
        monkeypatch.setattr(gemm_fp8, "READY_FOLD_ROWS", rows)
        with pytest.raises(StopIteration):
            gemm_fp8._launch("dense", a, sfa, b, sfb, *aux, torch.empty(64, 2112, dtype=torch.bfloat16), 2112, 7168,
                             block_m=64)
    assert len(set(keys)) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_split_k_cluster_fold_is_one_kernel_with_a_cluster_barrier(overlap):
    """cluster=True: a tile's split blocks are a thread-block cluster; each stores the partials of the
    others' column slices, waits at one cluster barrier (CUDA's builtins: a compiler barrier too),
    then writes its own slice of C from the partials in split order. No reduce kernel, no arrival
    counters. Splits must be 2, 4 or 8 and cut block_n into 8-column slices; no rule off CUDA."""
    from codegen.rules import NoRuleError

    src = fp8_gemm_program.source("sm_90a", n=4096, k=7168, splits=4, cluster=True, overlap=overlap)
    assert src.count("__cluster_barrier_arrive();") == 1 and src.count("__cluster_barrier_wait();") == 1
    assert "AtomicAddRet(" not in src and "__threadfence()" not in src
    fold = src[src.index("__cluster_barrier_wait();"):]
    assert fold.count("Part_local_cast_") >= 4 and "(C +" in fold and "Part +" in src[:src.index("__cluster_barrier")]
    assert "__cluster_barrier" not in lowered(fp8_gemm_program, "sm_90a", n=4096, k=7168, splits=4, overlap=overlap)
    for bad in (dict(splits=3), dict(splits=1), dict(splits=4, fold=True), dict(splits=8, block_n=32)):
        with pytest.raises(ValueError, match="cluster=True"):
            fp8_gemm_program.source("sm_90a", n=4096, k=7168, cluster=True, **bad)
    with pytest.raises(NoRuleError, match="cluster_grid"):
        fp8_gemm_program.source("ascend", n=4096, k=7168, splits=4, cluster=True)


def test_plan_folds_split_k_in_clusters_only_where_they_all_fit(monkeypatch):
    from ops import gemm_fp8
    from ops.gemm_fp8 import plan

    asked = []

    def room(n):
        def clusters(cluster, threads, smem):
            asked.append((cluster, threads, smem))
            return n
        return clusters
    assert not gemm_fp8.CLUSTER_FOLD       # measured slower (bench/NOTES.md "GEMM v5"): an option
    monkeypatch.setattr(gemm_fp8, "THIN_TILES", False)     # its one-wave tiles replace split-K there
    assert "cluster" not in plan("dense", 128, 4096, 7168, 128, clusters=room(99))
    monkeypatch.setattr(gemm_fp8, "CLUSTER_FOLD", True)
    # 128x4096x7168: 32 tiles x 4 splits; the GPU must hold 32 clusters of 4 at once
    assert plan("dense", 128, 4096, 7168, 128, clusters=room(32))["cluster"] is True
    assert asked[-1][:2] == (4, 384) and 130_000 < asked[-1][2] <= 227 * 1024
    assert "cluster" not in plan("dense", 128, 4096, 7168, 128, clusters=room(31))     # a second wave
    assert "cluster" not in plan("dense", 128, 4096, 7168, 128, clusters=room(None))   # the driver can't say
    assert "cluster" not in plan("dense", 128, 4096, 7168, 128)                         # off CUDA
    n = len(asked)
    assert "cluster" not in plan("dense", 128, 24576, 1536, 128, clusters=room(99))    # no split, never asked
    assert len(asked) == n
    # 2112 = 33 tiles of 64 columns, 4 splits: 16-column slices
    assert plan("dense", 64, 2112, 7168, 64, overlap=True, clusters=room(33))["cluster"] is True


def test_plan_thin_tiles_fill_one_wave_without_split_k(monkeypatch):
    """THIN_TILES: where the default plan splits K and the one-wave thin tiling is 32 or 64 wide,
    DeepGEMM-like thin tiles instead (no split, no reduce kernel, deep pipelines); 16-wide tilings and
    128-wide ones keep split-K (both measured slower); elsewhere nothing changes.
    16-wide tiles (left to split-K by the plan, still a valid launch) compile to m64n8 WGMMAs, no spills."""
    from ops import gemm_fp8
    from ops.gemm_fp8 import fp8_gemm_program, plan, thin_tiles

    assert thin_tiles(128, 4096, 132) == (64, 64)        # 2 x 64 = 128 tiles (128 x 32 ties: 64 rows first)
    assert thin_tiles(64, 4096, 132) == (64, 32)         # 128 tiles
    assert thin_tiles(64, 2112, 132) == (64, 16)         # 132
    assert thin_tiles(128, 2112, 132) == (64, 32)        # 2 x 66
    assert thin_tiles(64, 7168, 132) == (64, 64)         # 112
    assert thin_tiles(64, 24576, 132) is None            # 192 tiles even at 128 wide: more than a wave
    assert thin_tiles(64, 256, 132) is None              # 16 tiles at most: under half the GPU
    monkeypatch.setattr(gemm_fp8, "THIN_TILES", False)
    default = plan("dense", 128, 4096, 7168, 128)
    assert default["splits"] == 4 and default["block_m"] == 128
    split_kept = {args: plan(*args) for args in (("dense", 64, 2112, 7168, 64), ("dense", 128, 7168, 16384, 128))}
    assert all(p["splits"] > 1 for p in split_kept.values())
    monkeypatch.setattr(gemm_fp8, "THIN_TILES", True)
    p = plan("dense", 128, 4096, 7168, 128)
    assert (p["block_m"], p["block_n"], p["splits"]) == (64, 64, 1) and p["stages"] == 12
    fixed, stage = gemm_fp8._smem_layout(64, 64, 56, 1)
    assert fixed + p["stages"] * stage <= gemm_fp8.SMEM_BUDGET < fixed + (p["stages"] + 1) * stage
    assert plan("dense", 64, 4096, 7168, 64)["stages"] == gemm_fp8.THIN_STAGES
    assert (plan("dense", 64, 7168, 16384, 64)["block_n"], plan("dense", 128, 2112, 7168, 128)["block_n"]) == (64, 32)
    assert plan("dense", 128, 4096, 7168, 128, thin=False) == default   # what a launch with its split forced gets
    assert p["threads"] == gemm_fp8.THIN_THREADS == 128                   # one MMA warpgroup a thin tile
    assert "threads" not in default and "threads" not in plan("dense", 64, 7168, 2048, 64)   # not thin: two
    for args, before in split_kept.items():               # 16 wide (64 x 2112) and 128 wide: split-K stays
        assert plan(*args) == before, args
    for args in (("dense", 4096, 7168, 16384, 128), ("dense", 64, 7168, 2048, 64), ("masked", 128, 4096, 7168, 128),
                 ("contiguous", 1024, 4096, 7168, 128)):
        monkeypatch.setattr(gemm_fp8, "THIN_TILES", False)
        before = plan(*args)
        monkeypatch.setattr(gemm_fp8, "THIN_TILES", True)
        assert plan(*args) == before, args                # no split to replace: the same plan
    assert plan("dense", 128, 4096, 7168, 128, overlap=False)["splits"] == 4   # the v2 loop keeps split-K
    src = fp8_gemm_program.source("sm_90a", n=2112, k=7168, block_m=64, block_n=16, stages=16, overlap=True)
    sass, log = _sass_and_ptxas_log(src)
    assert "QGMMA.64x8x32.F32.E4M3.E4M3" in sass and " 0 bytes spill stores" in log


def test_staged_c_writes_whole_rows_from_shared_memory():
    """stage_c=True: the MMA threads put C into shared memory laid over the A stages, meet at a
    named barrier of theirs (the producer has exited), then write 16 bytes a thread out of it;
    every store into C is of that kind. Asked for with split-K or the v2 loop, it is refused."""
    src = lowered(fp8_gemm_program, "sm_90a", n=24576, k=1536, overlap=True, stage_c=True, stages=6)
    epilogue = src[src.rindex("__sync_thread_partial(11, 256)"):]
    assert epilogue.count("*(uint4*)(C + ") == 1 and src.count("C + ") == 1
    assert "*(uint1*)(((bfloat16_t*)" in src[:src.rindex("__sync_thread_partial(11, 256)")]
    # the staging tile is a buffer of its own (plain row-major: a view of a stage took the stage's 128B
    # swizzle, ~30 integer instructions an element) that TileLang's merge lays over the operand stages
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    staged = re.findall(r"\*\(uint1\*\)\(\(\(bfloat16_t\*\)(\w+)\) \+ (.*)\) = ", src)
    assert staged and {name for name, _ in staged} == {"v"}
    assert [b for b, o in offsets.items() if b != "v" and o == offsets["v"]], offsets   # shares its memory
    for _, index in staged:
        assert index.count("threadIdx.x") <= 3, index        # affine: warp, row and column (no swizzle XORs)
    for bad in (dict(splits=2, overlap=True), dict(overlap=False)):
        with pytest.raises(ValueError, match="stage_c=True"):
            fp8_gemm_program.source("sm_90a", n=4096, k=7168, stage_c=True, **bad)


def test_block_ahead_scale_loads_clamp_at_a_bursts_last_fold_only():
    """CLAMP_LAST_ONLY: inside a 4-block burst the scale factors loaded a block ahead are blocks of the
    burst (q * 4 + 1 .. 3), unclamped; only the burst's last fold (q * 4 + 4) clamps its index to the
    tile's last block. (The clamp's bound, an expression of the block index, was recomputed at every
    fold: the masked layout's 4-block burst ran 381 SASS instructions instead of 332.)"""
    from codegen.lowering import sm90

    src = lowered(fp8_gemm_program, "sm_90a", n=24576, k=1536, overlap=True, stage_c=True, stages=6)
    sfb = {blk: clamp for clamp, blk in re.findall(r"\(\(float\*\)sfb_s\)\[(min\()?\(\(q \* 4\) \+ (\d)\)", src)}
    assert sm90.CLAMP_LAST_ONLY and sfb == {"1": "", "2": "", "3": "", "4": "min("}, sfb


def test_192_wide_tiles_plan_and_lowering(monkeypatch):
    """TILES_192: where 128-wide tiles make more than one wave and 192-wide ones one (x24576x1536 at 64 and
    128 rows: 192 -> 128 tiles), the wide plan takes 192-wide tiles, one tile a CTA; each K block's MMA is three
    column passes of 64 (QGMMA 64x64x32), each promoted with the sfb row of its own columns (an odd tile
    starts 64 columns into a block of sfb). Elsewhere the plans stay; persistent CTAs are refused."""
    from ops import gemm_fp8
    from ops.gemm_fp8 import _sfb_row, column_passes, pass_width, plan, widened

    monkeypatch.setattr(gemm_fp8, "TILES_192", True)

    def wide(mode, m, n, k):                      # (block_m as fp8_gemm_nt picks it)
        return widened(plan(mode, m, n, k, 64 if m <= 64 else 128), mode, m, n, k, 1, 132, 2)

    assert wide("dense", 128, 24576, 1536) == dict(block_m=128, block_n=192, splits=1, stages=5, overlap=True)
    assert wide("dense", 64, 24576, 1536) == dict(block_m=64, block_n=192, splits=1, stages=6, overlap=True)
    for shape in ((256, 24576, 1536), (128, 7168, 16384), (64, 4096, 7168), (4096, 7168, 16384)):
        assert wide("dense", *shape)["block_n"] != 192, shape
    monkeypatch.setattr(gemm_fp8, "TILES_192", False)
    assert wide("dense", 128, 24576, 1536)["block_n"] == 128
    assert (column_passes(192), pass_width(192), column_passes(256), pass_width(256)) == (3, 64, 2, 128)
    assert [[_sfb_row(tn, 192, c) for c in range(3)] for tn in range(4)] == [[0, 0, 1], [1, 2, 2], [3, 3, 4],
                                                                            [4, 5, 5]]
    src = lowered(fp8_gemm_program, "sm_90a", n=576, k=1024, block_n=192, overlap=True, stage_c=True, stages=4)
    # B's stage (24576 bytes) in three slices of 8192: the 4 stages' 12 descriptors of one burst (8 K blocks:
    # 2 bursts of 4, no tail: the count is provably 8 or 0, tile.steps_if)
    offsets = [int(x or 0) for x in re.findall(
        r"initialize_wgmma_descriptor<[^>]*>\(desc_b\w*, [^;]*?\[0\]\)\)(?: \+ (\d+)\)\))?\);", src)]
    assert sorted(offsets) == [8192 * i for i in range(12)] and "increase_descriptor_offset<int>(desc_b" not in src
    loop = _innermost_mma_loop(_tma_wgmma_sass(src, "QGMMA"))
    assert {t.split()[0] for t in loop if t.startswith("QGMMA")} == {"QGMMA.64x64x32.F32.E4M3.E4M3"}
    with pytest.raises(ValueError, match="block_n=192"):
        fp8_gemm_program.source("sm_90a", n=576, k=1024, block_n=192, overlap=True, stage_c=True, persistent=True)


def test_persistent_plans_and_refusals():
    """A persistent plan keeps the staged C over the staged sfa where its next scales are copied after the
    epilogue (prefill keeps its 4 stages), else gives up what the tile needs; the program refuses
    layouts and loops it cannot run."""
    from ops.gemm_fp8 import _fit_persistent, early_scales, plan

    assert early_scales(128, 128, 56, 2) and not early_scales(128, 128, 128, 2) and early_scales(128, 128, 128, 4)
    prefill = plan("dense", 4096, 7168, 16384, 128)
    late = {**prefill, "early": early_scales(128, 128, 128, 2)}
    assert prefill["splits"] == 1 and _fit_persistent(late, 16384, 2)["stages"] == prefill["stages"] == 4
    short = plan("dense", 128, 24576, 1536, 128)
    assert short["stages"] == 6 and _fit_persistent({**short, "early": True}, 1536, 2)["stages"] == 5
    for bad in (dict(mode="sorted", block_m=64), dict(splits=2), dict(stage_c=False), dict(overlap=False)):
        params = dict(dict(overlap=True, stage_c=True), **bad)
        with pytest.raises(ValueError, match="persistent=True"):
            fp8_gemm_program.source("sm_90a", n=4096, k=7168, persistent=True, **params)


@pytest.mark.parametrize("overlap", [False, True])
def test_scales_never_hold_the_first_loads(overlap):
    """Staging the scales before the producer/MMA split held the TMA warpgroup ~5000 cycles
    (bench/NOTES.md "GEMM v4"); staged by the MMA warpgroups after the split, their loads queued
    behind the grid's first tile loads (~8900 cycles, "GEMM v7"). v3 now splits its prologue: the MMA
    threads issue the scale loads into registers and arrive on a barrier, the producer waits for that
    arrival (not for the data) before its first TMA, and the registers go to shared memory after the
    MMA threads' register grow, then a named barrier of theirs. The loads' addresses need no 64-bit
    division. v2 loads them a step ahead into registers."""
    src = lowered(fp8_gemm_program, "sm_90a", n=4096, k=7168, splits=4, overlap=overlap)
    body = src[src.index("fence_barrier_init"):]
    split = body.index("warpgroup_reg_alloc")                   # the MMA warpgroups' grow
    if overlap:
        producer = body[:body.index("tma_load")]
        mma = body[body.rindex("} else {", 0, body.index("SFB[")):]   # the MMA warpgroups' branch
        assert producer.index(".wait(0)") < producer.index("warpgroup_reg_dealloc")
        loads = mma[:mma.index(".arrive()")]
        assert "SFA" in loads and "SFB" in loads and "sfa_s" not in loads and "/ (int64_t)" not in loads
        assert (mma.index(".arrive()") < mma.index("warpgroup_reg_alloc") < mma.index("sfa_s")
                < mma.index("__sync_thread_partial(13, 256)") < mma.index("wgmma"))
    else:
        assert body.index("tma_load") < split < body.index("SFA[") and body.index("SFB[") > split
        assert "sfa_s" not in src and "ahead_a" in src


# ---- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=8, deadline=None)
@given(m=st.sampled_from([0, 1, 17, 64, 129, 1000]), nk=st.sampled_from([(2112, 7168), (256, 512), (7168, 2048)]))
def test_gpu_dense(m, nk):
    n, k = nk
    g = torch.Generator().manual_seed(m)
    a, b, qa, sfa, qb, sfb = quantized(m, n, k, g)
    out = ops.fp8_gemm_nt(qa.cuda(), sfa.cuda(), qb.cuda(), sfb.cuda())
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)   # CPU: exact dequant reference
    if m:
        assert calc_diff(out.cpu(), ref) < 1e-3
        assert_elementwise(out.cpu(), ref)


def assert_elementwise(out, ref):
    """Every element within bf16 output rounding plus fp32-accumulation noise of the reference."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("m,n,k,out_dtype", [(1, 2112, 2048, torch.bfloat16), (77, 256, 2048, torch.float32),
                                             (128, 512, 1536, torch.bfloat16)])
def test_gpu_split_k_plans(splits, m, n, k, out_dtype):
    """Every split-K plan (uneven and empty splits included) gives the same answer, bitwise
    reproducibly run to run."""
    from ops.gemm_fp8 import _launch

    g = torch.Generator().manual_seed(m + splits)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb.unsqueeze(0), sfb.unsqueeze(0))]
    runs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        _launch("dense", *dev, torch.empty(m, dtype=torch.int32, device="cuda"),
                torch.empty(1, dtype=torch.int32, device="cuda"), out, n, k,
                block_m=64 if m <= 64 else 128, splits=splits)
        runs.append(out.cpu())
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-3
    assert_elementwise(runs[0], ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 4096, 7168), (128, 4096, 7168), (128, 2112, 7168), (37, 7168, 16384)])
def test_gpu_thin_tiles(monkeypatch, m, n, k):
    """THIN_TILES plans (block_m 64, block_n 32 or 64, up to 16 stages, no split-K) against the exact
    reference, bitwise run to run, and within the bounds of the split-K plan they replace."""
    from ops import gemm_fp8

    g = torch.Generator().manual_seed(m + n)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
    monkeypatch.setattr(gemm_fp8, "THIN_TILES", False)
    split = ops.fp8_gemm_nt(*dev).cpu()
    monkeypatch.setattr(gemm_fp8, "THIN_TILES", True)
    assert gemm_fp8.plan("dense", m, n, k, 64 if m <= 64 else 128)["splits"] == 1
    runs = [ops.fp8_gemm_nt(*dev).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    for out in (runs[0], split):
        assert calc_diff(out, ref) < 1e-3
        assert_elementwise(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 4096, 7168), (128, 4096, 7168), (37, 7168, 16384), (128, 2112, 7168)])
def test_gpu_thin_tiles_one_warpgroup_matches_two(monkeypatch, m, n, k):
    """The thin plans on one MMA warpgroup a tile (THIN_THREADS=128, the default) give the bits of two
    warpgroups each a column half (each output element's products go through the same K-block order
    and the same promotion), bitwise run to run, within the exact reference's bounds."""
    from ops import gemm_fp8

    g = torch.Generator().manual_seed(m + n)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
    monkeypatch.setattr(gemm_fp8, "THIN_THREADS", 256)
    two = ops.fp8_gemm_nt(*dev).cpu()
    monkeypatch.setattr(gemm_fp8, "THIN_THREADS", 128)
    assert gemm_fp8.plan("dense", m, n, k, 64 if m <= 64 else 128)["threads"] == 128
    runs = [ops.fp8_gemm_nt(*dev).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], two)
    assert calc_diff(runs[0], ref) < 1e-3
    assert_elementwise(runs[0], ref)


def _split_k_runner(m, n, k, splits):
    """(the exact-dequant fp32 reference of a seeded (m, n, k) problem, launch(out=None, **plan) ->
    its bf16 result through _launch with `splits`, into `out` or a NaN-filled new tensor)."""
    from ops.gemm_fp8 import _launch

    g = torch.Generator().manual_seed(m + splits)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb.unsqueeze(0), sfb.unsqueeze(0))]
    aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")

    def launch(out=None, **plan):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda") if out is None else out
        block_m = plan.pop("block_m", 64 if m <= 64 else 128)
        _launch("dense", *dev, *aux, out, n, k, block_m=block_m, splits=splits, **plan)
        return out
    return ref, launch


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,splits", [(1, 2112, 2048, 2), (77, 256, 2048, 3), (128, 4096, 7168, 4),
                                          (200, 512, 1536, 5), (64, 7168, 16384, 2)])
def test_gpu_split_k_fold_matches_the_reduce_kernel(m, n, k, splits):
    """The in-kernel fold (the last block of a tile adds the partials) gives the reduce kernel's bits,
    run after run (the counters go back to zero), and inside a CUDA graph."""
    from ops._workspace import arrival_counters

    ref, launch = _split_k_runner(m, n, k, splits)
    run = lambda fold, out=None: launch(out, overlap=False, fold=fold)  # noqa: E731  (the v2 loop's fold)

    reduced = _assert_folds_are_the_reduce_kernel(run, m, n)
    assert not arrival_counters(torch.device("cuda"), 1).any()       # every tile's count is back to 0
    assert calc_diff(reduced, ref) < 1e-3
    assert_elementwise(reduced, ref)


def _assert_folds_are_the_reduce_kernel(run, m, n):
    """run(fold, out=None) -> an (m, n) bf16 result: run(False) (the reduce kernel) once, then run(True) three times,
    each its bits; then run(True, out) captured in a CUDA graph on a stream of its own (a first run there compiles
    and makes that stream's counters and partials), two replays into a NaN-filled out, its bits again. Returns the
    reduce kernel's result (on the CPU)."""
    reduced = run(False).cpu()
    folded = [run(True).cpu() for _ in range(3)]
    for f in folded:
        assert torch.equal(f, reduced)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(True, out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run(True, out)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out.cpu(), reduced)
    torch.cuda.synchronize()
    return reduced


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,splits", [(64, 2112, 7168, 4), (128, 7168, 16384, 2), (77, 256, 2048, 3),
                                          (1, 2112, 2048, 2), (200, 512, 1536, 5)])
def test_gpu_v3_ready_fold_matches_the_reduce_kernel(m, n, k, splits):
    """The v3 loop's fenceless fold (fold=True, overlap=True; READY_FOLD_ROWS) gives the reduce kernel's bits run after
    run and inside a CUDA graph, with every counter 0 and every partials word READY_EMPTY after the runs (eager and
    replayed); a split past the end of K (5 splits of 12 K blocks) adds zeros. (NaN rows: the op-level test.)"""
    from ops import _workspace
    from ops._ready import READY_EMPTY

    ref, launch = _split_k_runner(m, n, k, splits)
    run = lambda fold, out=None: launch(out, overlap=True, fold=fold)  # noqa: E731

    reduced = _assert_folds_are_the_reduce_kernel(run, m, n)
    for counts in _workspace._COUNTERS.values():
        assert not counts.any()
    for buf in _workspace._READY.values():
        assert (buf.view(torch.int32) == READY_EMPTY).all()
    assert calc_diff(reduced, ref) < 1e-3
    assert_elementwise(reduced, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,rows", [(64, 2112, 64), (8, 1536, None), (13, 576, None)])
def test_gpu_v3_ready_fold_is_the_ops_plan_and_keeps_nan_rows(monkeypatch, m, n, rows):
    """ops.fp8_gemm_nt (k = 7168: 4 splits) with READY_FOLD_ROWS `rows` (None: the default, 16) folds in the kernel
    and gives the reduce kernel's bits (READY_FOLD_ROWS 0); a NaN row scale makes that row NaN and no other (a NaN
    partial is stored as a ready value, never waited for). PAIR_HALF_TILES off: at READY_FOLD_ROWS 0 it would
    give 64x2112x7168 its 2-split pairs of 64 x 32 tiles, another split of K, whose sums differ in the last bits
    (session 73 on an H100: this case failed from session 69 on, when that switch came)."""
    from ops import gemm_fp8

    assert gemm_fp8.READY_FOLD_ROWS == 16
    monkeypatch.setattr(gemm_fp8, "PAIR_HALF_TILES", False)
    g = torch.Generator().manual_seed(21 + m)
    k = 7168
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    sfa[5, 3] = float("nan")
    dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
    monkeypatch.setattr(gemm_fp8, "READY_FOLD_ROWS", 0)
    want = ops.fp8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_fp8, "READY_FOLD_ROWS", 16 if rows is None else rows)
    got = ops.fp8_gemm_nt(*dev)
    assert got[5].isnan().all() and not got[:5].isnan().any() and not got[6:].isnan().any()
    assert torch.equal(got[torch.arange(m) != 5], want[torch.arange(m) != 5])


# ---- v3 K loop (overlap: tile.mma_promoted_loop) ------------------------------------------------

OVERLAP_CASES = [dict(n=2112, k=7168, block_m=128, block_n=64, splits=4, stages=6),
                 dict(n=7168, k=2048, block_m=64, block_n=128, stages=6),
                 dict(n=512, k=1024, mode="masked", block_m=64, stages=4),
                 dict(n=256, k=1280, block_m=128, block_n=128, splits=3, stages=3),   # steps known only at run time
                 dict(n=7168, k=16384, block_m=128, block_n=128, stages=4)]          # prefill: 3 x 64 fp32 per thread


def _build_with_ptxas_log(src: str, arch: str = "sm_90a"):
    """(cubin, ptxas -v output) of a source (ptxas reports WGMMA serialization only there:
    backends.cuda.sass.wgmma_serialized reads it)."""
    from backends.cuda.sass import compile_cubin

    return compile_cubin(src, arch)


def _sass_and_ptxas_log(src: str):
    """(SASS text, ptxas -v output) of a sm_90a source; the test skips where the CUDA 13 tools are missing."""
    from backends import ToolchainError
    from backends.cuda.sass import disassemble

    try:
        cubin, log = _build_with_ptxas_log(src)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    return disassemble(cubin), log


def _innermost_mma_loop(sass: str, mma: str = "QGMMA") -> list[str]:
    """The instructions of the smallest range closed by a predicated backward branch that holds an
    `mma` instruction: the MMA warpgroups' K loop (the mbarrier retry trampolines after the kernel's
    code return with unpredicated jumps, which can span less)."""

    ins = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, text in ins:
        m = re.search(r"^@!?U?P\w+\s+BRA\s+(?:`\()?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any(t.startswith(mma) for t in body) and (best is None or len(body) < len(best)):
                best = body
    assert best is not None, f"no loop with a {mma} in the SASS"
    return best


def _tma_wgmma_sass(src: str, mma: str) -> str:
    """The SASS of a TMA-fed WGMMA kernel, checked: `mma` and TMA loads in it, no spills, and no
    C7514 / C7517 from ptxas (WGMMAs serialized, a wait injected)."""
    from backends import ToolchainError
    from backends.cuda.sass import disassemble, histogram

    try:
        cubin, log = _build_with_ptxas_log(src)
        sass = disassemble(cubin)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    hist = histogram(sass)
    assert hist.get(mma, 0) > 0 and hist.get("UTMALDG", 0) > 0
    assert hist.get("STL", 0) == 0 and hist.get("LDL", 0) == 0 and "0 bytes spill stores, 0 bytes spill loads" in log
    assert wgmma_serialized(log) == [], log[-2000:]
    return sass


def _burst_loop_of(src: str, mma: str, burst: int, block_threads: int = 384) -> list[str]:
    """Build a kernel whose K loop keeps one WGMMA group in flight (TMA warpgroup + 2 MMA
    warpgroups, or 4 at block_threads=640; bursts of `burst` steps) and check that ptxas kept it so: `mma` and TMA in the SASS,
    no spills, no C7514 / C7517 (WGMMAs serialized, a wait injected), and the loop waits with
    `WARPGROUP.DEPBAR.LE gsb0, 0x1` (one group left running) between its burst's MMAs, with one
    `0x0` drain per burst. Returns the loop's instructions."""
    assert f"__launch_bounds__({block_threads}, 1)" in src and "tl::wait_wgmma<1>();" in src and "tl::wait_wgmma<0>();" in src
    sass = _tma_wgmma_sass(src, mma)
    loop = _innermost_mma_loop(sass, mma)
    waits = [t.split()[-1] for t in loop if t.startswith("WARPGROUP.DEPBAR")]
    assert waits == ["0x1"] * (burst - 1) + ["0x0"], waits      # burst - 1 waits 1, a drain
    return loop


@pytest.mark.parametrize("params", OVERLAP_CASES)
def test_overlap_loop_on_sm90a_is_qgmma_with_a_producer_warpgroup(params):
    """The v3 loop builds: QGMMA, TMA loads, no spills, a 384-thread block (2 MMA warpgroups + the
    TMA warpgroup), two partials in flight (wgmma wait 1 in the source). And ptxas keeps them in
    flight: no C7514 / C7517 (WGMMAs serialized, a wait injected), and the K loop waits with
    `WARPGROUP.DEPBAR.LE gsb0, 0x1` (one group left running) between its burst's QGMMAs, with one
    `0x0` drain per burst, instead of a DEPBAR 0x0 after every QGMMA. 128-row tiles give each
    warpgroup 64 rows and the whole width (m64n128, not two m64n64 that read a third more shared
    memory: bench/NOTES.md "GEMM v6"); 64-row tiles split the width between the two."""
    from codegen.lowering.sm90 import BURST

    src = fp8_gemm_program.source("sm_90a", overlap=True, **params)
    assert "warpgroup_reg_alloc<240>" in src and "warpgroup_reg_dealloc<24>" in src
    loop = _burst_loop_of(src, "QGMMA", BURST)
    assert sum(t.startswith("QGMMA") for t in loop) >= 2 * BURST
    block_n = params.get("block_n", 128)
    width = block_n if params["block_m"] == 128 else block_n // 2
    assert {t.split()[0] for t in loop if t.startswith("QGMMA")} == {f"QGMMA.64x{width}x32.F32.E4M3.E4M3"}


def test_wide_tiles_plan_column_passes_and_sfa_ring(monkeypatch):
    """WIDE_TILES: one-split plans with more than two waves of 128 x 256 tiles (prefill, grouped
    contiguous, masked with many groups), or one wave of them at long K where 128-wide tiles need two
    (masked 1 x 1024), take them, bf16 out only, with as many stages as fit; thin, split, sorted,
    short-K and one-wave 128-wide plans keep theirs. A 128 x 256 tile runs each K block as two m64n128
    passes over the halves of B's stage (the second at 128 rows = 16 KB in), each waited for (wgmma
    wait 0) and folded, with no spills and no serialized WGMMAs; the staged C goes over the B
    stages. block_n past 128 needs the staged epilogue, bf16 out and no persistence; it is refused
    otherwise, as are widths that neither divide 128 nor are a multiple of it.
    sfa_ring (the prefill plan): the producer's elected lane loads the tile's sfa by TMA in chunks of
    P K blocks into a ring of 3 (chunks 0 and 1 with block 0, chunk c + 1 with block c * P, the last
    chunk clamped) on the stage's full barrier; the MMA threads stage no sfa and wait for block 0's
    barrier before its factors. Refused where no TMA producer loads it, with persistent CTAs, with
    more stages than P + 2 (a slot would be overwritten while read) and with rows or chunks TMA
    cannot address (k // 128 or P not a multiple of 4). ELECTED_PRODUCER: full barriers of count 32
    (one producer warp); LANE_RELEASE: empty ones of count 8 (lane 0 of each MMA warp), else 256."""
    from ops import gemm_fp8
    from ops.gemm_fp8 import plan, widened

    def wide(mode, rows, n, k, groups=1, out_bytes=2):
        return widened(plan(mode, rows, n, k, 128), mode, rows, n, k, groups, 132, out_bytes)

    monkeypatch.setattr(gemm_fp8, "TILES_192", False)              # (its plans: test_192_wide_tiles_plan...)
    # prefill: sfa staged whole (64 KB) would leave 3 stages; in chunks by the producer (SFA_RING), 4
    assert wide("dense", 4096, 7168, 16384) == dict(block_m=128, block_n=256, splits=1, stages=4, overlap=True,
                                                    sfa_ring=8)
    with monkeypatch.context() as mp:                               # staged whole: 3 stages
        mp.setattr(gemm_fp8, "SFA_RING", 0)
        assert wide("dense", 4096, 7168, 16384) == dict(block_m=128, block_n=256, splits=1, stages=3, overlap=True)
    contiguous = wide("contiguous", 32768, 4096, 7168)
    assert contiguous["block_n"] == 256 and contiguous["stages"] == 4
    assert wide("masked", 1024, 4096, 7168, groups=8)["block_n"] == 256
    assert wide("masked", 1024, 4096, 7168) == dict(block_m=128, block_n=256, splits=1, stages=4, overlap=True)
    for narrow in (wide("masked", 512, 4096, 7168), wide("dense", 4096, 7168, 16384, out_bytes=4),
                   wide("dense", 128, 24576, 1536), wide("dense", 64, 7168, 16384), wide("dense", 4096, 2112, 7168)):
        assert narrow["block_n"] <= 128
    src = fp8_gemm_program.source("sm_90a", n=512, k=1024, block_n=256, overlap=True, stage_c=True, stages=3,
                                  sfa_ring=4)
    producer = src[src.index("warpgroup_reg_dealloc"):src.index("warpgroup_reg_alloc")]
    sfa_loads = re.findall(r"tma_load\(SFA_desc, .*", producer)
    assert len(sfa_loads) == 3                                               # block 0 (two chunks), c * P
    assert sfa_loads[2].split("])), ")[1].startswith("4, ")                 # column 4: the last chunk (1) clamped
    consumer = src[src.index("warpgroup_reg_alloc"):]
    assert "SFA[" not in src and "SFA_desc" not in consumer
    inits = re.findall(r"(\w+)\[\d\]\.init\((\d+)\)", src)
    full_bar, empty_bar = list(dict.fromkeys(b for b, _ in inits))[:2]     # allocated in this order
    assert consumer.index(f"{full_bar}[0].wait(0)") < consumer.index("ring)[")   # block 0's chunk landed first
    from codegen.lowering import sm90
    full, empty = ("32" if sm90.ELECTED_PRODUCER else "128"), ("8" if sm90.LANE_RELEASE else "256")
    assert {c for b, c in inits if b == full_bar} == {full} and {c for b, c in inits if b == empty_bar} == {empty}
    ring = dict(n=1024, k=2048, block_n=256, overlap=True, stage_c=True, stages=4, sfa_ring=4)
    for bad in (dict(stages=7), dict(persistent=True, sms=4), dict(k=2176), dict(stages=3, sfa_ring=2)):
        with pytest.raises(ValueError, match="sfa_ring"):
            fp8_gemm_program.source("sm_90a", **dict(ring, **bad))
    with pytest.raises(ValueError, match="sfa_ring"):
        fp8_gemm_program.source("sm_100a", **dict(ring, block_n=128, stage_c=False))
    b_offsets = re.findall(r"increase_descriptor_offset<int>\(desc_b\w*, (.*)\);", src)
    assert len(b_offsets) == 2 * sum(o.endswith(" + 16384)") for o in b_offsets) > 0      # every other pass
    assert "tl::wait_wgmma<1>" not in src
    loop = _innermost_mma_loop(_tma_wgmma_sass(src, "QGMMA"))
    waits = [t.split()[-1] for t in loop if t.startswith("WARPGROUP.DEPBAR")]
    assert {t.split()[0] for t in loop if t.startswith("QGMMA")} == {"QGMMA.64x128x32.F32.E4M3.E4M3"}
    assert waits == ["0x0"] * len(waits) and len(waits) >= 4
    for bad in (dict(stage_c=False), dict(stage_c=True, out_dtype="float32"), dict(stage_c=True, block_n=320, n=1280)):
        with pytest.raises(ValueError, match="block_n"):
            fp8_gemm_program.source("sm_90a", k=1024, overlap=True, **dict(dict(block_n=256, n=768), **bad))
    for bad in (dict(splits=2), dict(mode="sorted", block_m=64), dict(persistent=True, stage_c=True)):
        with pytest.raises(ValueError, match="raster"):
            fp8_gemm_program.source("sm_90a", n=768, k=1024, overlap=True, raster=8, **bad)


@pytest.mark.parametrize("target", ["sm_100a", "ascend"])
def test_overlap_falls_back_to_the_plain_loop_elsewhere(target):
    """Other targets lower mma_promoted_loop as the pipelined loop: the same kernel as overlap=False
    up to names (no producer threads added)."""
    params = dict(n=2112, k=7168, block_m=64, block_n=64, splits=2)
    src = fp8_gemm_program.source(target, overlap=True, **params)
    if target == "ascend":
        assert "ascend_gemm_l1<64, 128, 64, 128, true, float8_e4m3_t>" in src and "asc_get_sub_block_id() * 32" in src
    else:
        assert "tcgen05" in src or "utcqmma" in src.lower() or "UTCQMMA" in src or "tcgen05_mma" in src


@pytest.mark.gpu
@settings(max_examples=8, deadline=None)
@given(m=st.sampled_from([0, 1, 17, 64, 129, 1000]), nk=st.sampled_from([(2112, 7168), (256, 512), (7168, 2048), (256, 128)]))
def test_gpu_dense_overlap(m, nk):
    """v3 K loop: same bounds as v2, and bitwise the v2 result (same products, same fold order). Both loops run
    one forced split-K plan: the op's own plans for v2 and v3 differ at some shapes (v3's PAIR_HALF_TILES 2-split
    pairs at 17-64 rows, its one-split thin tiles at 129 x 2112), and another split count adds in another order.
    The stages are forced too: 64-row plans carry up to 16, which 64-wide tiles' stages do not fit in."""
    from ops.gemm_fp8 import _launch

    n, k = nk
    g = torch.Generator().manual_seed(m)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb.unsqueeze(0), sfb.unsqueeze(0))]
    outs = []
    for overlap in (False, True):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch("dense", *dev, torch.empty(m, dtype=torch.int32, device="cuda"),
                torch.empty(1, dtype=torch.int32, device="cuda"), out, n, k,
                block_m=64 if m <= 64 else 128, overlap=overlap, splits=min(4, k // 128), block_n=64, stages=4)
        outs.append(out.cpu())
    if m:
        assert calc_diff(outs[1], ref) < 1e-3
        assert_elementwise(outs[1], ref)
        assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 6])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("m,n,k,out_dtype", [(1, 2112, 2048, torch.bfloat16), (77, 256, 2048, torch.float32),
                                             (128, 512, 1536, torch.bfloat16), (200, 256, 1280, torch.bfloat16)])
def test_gpu_split_k_plans_overlap(stages, splits, m, n, k, out_dtype):
    """v3 K loop under every split-K plan (odd, even, 1 and 0 K blocks per split) and stage count
    (stage reuse wraps the barrier phases): bounds, bitwise run to run, bitwise equal to v2."""
    from ops.gemm_fp8 import _launch

    g = torch.Generator().manual_seed(m + splits)
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb.unsqueeze(0), sfb.unsqueeze(0))]
    aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")
    runs = []
    for overlap in (True, True, False):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        _launch("dense", *dev, *aux, out, n, k, block_m=64 if m <= 64 else 128, splits=splits, stages=stages,
                overlap=overlap)
        runs.append(out.cpu())
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert calc_diff(runs[0], ref) < 1e-3
    assert_elementwise(runs[0], ref)


@pytest.mark.gpu
def test_gpu_grouped_layouts_v2(monkeypatch):
    """The grouped layouts through the public ops with v2 as the K loop (v3 is the default)."""
    import ops.gemm_fp8 as gemm

    monkeypatch.setattr(gemm, "OVERLAP", False)
    test_gpu_grouped_layouts()


@pytest.mark.parametrize("overlap", [False, True])
def test_smem_fold_exchanges_partials_in_distributed_shared_memory(overlap):
    """cluster_smem=True: no partial goes through global memory (Part is never indexed), each block
    stores the other's half with tile.cluster_store (a generic store through a mapped pointer) between
    two cluster barriers (start, fold); it builds for sm_90a with no spills; only 2 splits."""
    params = dict(n=4096, k=7168, block_m=128, block_n=64, splits=2, stages=4, overlap=overlap, cluster=True)
    src = fp8_gemm_program.source("sm_90a", cluster_smem=True, **params)
    assert "Part" not in src and src.count("tc_cluster_store_f32(") == 2      # the helper and its one call
    assert src.count("__cluster_barrier_wait()") == 2
    # the other block stores into recv while this one may still be in its K loop: recv has memory of
    # its own (v2 once had it merged onto a_s, and the fold raced with the last K steps on the GPU)
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    assert list(offsets.values()).count(offsets["recv"]) == 1, offsets
    assert "Part" in fp8_gemm_program.source("sm_90a", **params)              # the global-memory fold
    sass, log = _sass_and_ptxas_log(src)
    assert "UCGABAR_WAIT" in sass and "0 bytes spill stores, 0 bytes spill loads" in log
    with pytest.raises(ValueError, match="cluster_smem=True"):
        fp8_gemm_program.source("sm_90a", cluster_smem=True, **{**params, "splits": 4})


# (contiguous differs from dense in B's group index only: its multicast runs on the GPU,
# test_gpu_multicast_matches_unicast; a build here is ~25 s of CI)
@pytest.mark.parametrize("mode", ["dense", "masked"])
def test_multicast_loads_a_once_per_cluster_on_sm90a(mode):
    """multicast=True: rank 0 of each cluster of two multicasts A (UTMALDG...MULTICAST in SASS), each
    warp's lane 0 arrives on the other block's empty barrier, within the register budget, no spills."""
    src = fp8_gemm_program.source("sm_90a", n=512, k=1024, mode=mode, overlap=True, stages=4, multicast=True)
    assert "tma_load_multicast" in src and "block_rank_in_cluster() ^ 1" in src
    sass, log = _sass_and_ptxas_log(src)
    assert "UTMALDG.2D.MULTICAST" in sass or "UTMALDG.3D.MULTICAST" in sass
    assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == []
    with pytest.raises(ValueError, match="even number of n tiles"):
        fp8_gemm_program.source("sm_90a", n=384, k=1024, overlap=True, multicast=True)
    with pytest.raises(ValueError, match="overlap=True"):
        fp8_gemm_program.source("sm_90a", n=512, k=1024, multicast=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "contiguous", "masked"])
def test_gpu_multicast_matches_unicast(mode):
    """A multicast in clusters of two n-neighbours: bitwise the unicast v3 result (same tiles, same
    MMAs), for every layout, with row tails, padding rows and an empty group; stage reuse wraps the
    barrier phases many times (56 K blocks over 4 stages)."""
    from ops.gemm_fp8 import _launch

    g = torch.Generator().manual_seed(17)
    G, n, k = 3, 512, 7168
    rows = {"dense": 333, "contiguous": 3 * 256, "masked": 256}[mode]
    a = torch.randn(G * rows if mode == "masked" else rows, k, generator=g)
    qa, sfa = ops.per_token_group_quant_fp8(a)
    groups = G if mode != "dense" else 1
    bs = [ops.per_block_quant_fp8(torch.randn(n, k, generator=g)) for _ in range(groups)]
    qb, sfb = torch.stack([q for q, _ in bs]).cuda(), torch.stack([s for _, s in bs]).cuda()
    if mode == "masked":
        qa, sfa = qa.view(G, rows, k), sfa.view(G, rows, -1)
        aux, m_idx = torch.tensor([200, 0, 256], dtype=torch.int32), torch.empty(1, dtype=torch.int32)
    elif mode == "contiguous":
        m_idx = torch.tensor(sum(([e] * 200 + [-1] * 56 for e in range(G)), []), dtype=torch.int32)
        aux = torch.empty(G, dtype=torch.int32)
    else:
        m_idx, aux = torch.empty(rows, dtype=torch.int32), torch.empty(1, dtype=torch.int32)
    dev = [t.cuda() for t in (qa, sfa)]
    outs = []
    for multicast in (False, True, True):
        out = torch.full((*qa.shape[:-1], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch(mode, *dev, qb, sfb, m_idx.cuda(), aux.cuda(), out, n, k, overlap=True, splits=1, stages=4,
                multicast=multicast)
        outs.append(out.cpu())
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def _forced(monkeypatch, call, **force):
    """call().cpu() with ops.gemm_fp8._launch given the plan keys `force` (over the plan's own)."""
    from ops import gemm_fp8

    launch = gemm_fp8._launch
    monkeypatch.setattr(gemm_fp8, "_launch", lambda *a, **kw: launch(*a, **kw, **force))
    try:
        return call().cpu()
    finally:
        monkeypatch.setattr(gemm_fp8, "_launch", launch)


def _grouped_case(layout, g, out_dtype=torch.bfloat16, expected_m=None):
    """(call, check) on _three_experts, the out NaN-filled: the contiguous layout (check: padding rows
    zero) or the masked one with counts 60, 0, 77 (check: rows past the counts and the empty group
    zero). check(out) asserts, then returns out."""
    G, n, k, m_indices, qa, sfa, qb, sfb = _three_experts(g)
    if layout == "contiguous":
        def call():
            return ops.m_grouped_fp8_gemm_nt_contiguous(
                qa.cuda(), sfa.cuda(), qb, sfb, m_indices.cuda(),
                out=torch.full((m_indices.numel(), n), float("nan"), dtype=out_dtype, device="cuda"))

        def check(out):
            assert (out[m_indices == -1] == 0).all() and not out.isnan().any()
            return out
        return call, check
    assert layout == "masked", layout
    masked_m = torch.tensor([60, 0, 77], dtype=torch.int32).cuda()
    am, sm = qa.view(G, 128, k).cuda(), sfa.view(G, 128, -1).cuda()

    def call():
        return ops.m_grouped_fp8_gemm_nt_masked(am, sm, qb, sfb, masked_m, expected_m=expected_m,
                                                out=torch.full((G, 128, n), float("nan"), dtype=out_dtype,
                                                               device="cuda"))

    def check(out):
        assert (out[1] == 0).all() and (out[0, 60:] == 0).all() and not out.isnan().any()
        return out
    return call, check


def _three_experts(g):
    """(G, n, k, m_indices, qa, sfa, qb, sfb): 3 experts of 100 rows + 28 padding rows each (the
    contiguous layout's 128-aligned segments; as (3, 128, k) the masked layout's), quantized; the
    weights on the GPU."""
    G, n, k = 3, 512, 1024
    m_indices = torch.tensor(sum(([e] * 100 + [-1] * 28 for e in range(G)), []), dtype=torch.int32)
    qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m_indices.numel(), k, generator=g))
    bs = [ops.per_block_quant_fp8(torch.randn(n, k, generator=g)) for _ in range(G)]
    qb, sfb = (torch.stack(t).cuda() for t in zip(*bs))
    return G, n, k, m_indices, qa, sfa, qb, sfb


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense-128", "dense-64", "thin", "contiguous", "masked", "sorted", "fp32"])
def test_gpu_staged_c_matches_register_store(monkeypatch, case):
    """The staged epilogue (STAGE_C, the default) writes the bits the register store wrote, to the same
    elements: padding rows of the contiguous layout as zeros, unlisted rows of the sorted one untouched
    (NaN-filled outs), masked rows past their count as zeros, tails past m not at all."""
    from ops import gemm_fp8

    g = torch.Generator().manual_seed(len(case))
    out_dtype = torch.float32 if case == "fp32" else torch.bfloat16

    def both(call):
        outs = []
        for staged in (False, True):
            monkeypatch.setattr(gemm_fp8, "STAGE_C", staged)
            outs.append(call().cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
        return outs[1]

    if case in ("dense-128", "dense-64", "thin", "fp32"):
        m, n, k = {"dense-128": (1000, 1024, 1536), "dense-64": (37, 7168, 2048), "thin": (100, 4096, 7168),
                   "fp32": (129, 512, 1024)}[case]
        *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
        ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
        dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
        out = both(lambda: ops.fp8_gemm_nt(*dev, out_dtype=out_dtype))
        assert calc_diff(out, ref) < 1e-3
        assert_elementwise(out, ref)
    elif case == "sorted":
        a, sfa, qb, sfb, m, items = moe_case(72, 8, 32, 512, 1024, seed=14)
        dev = [t.cuda() for t in (a, sfa, qb, sfb)]
        keep = (items[:, 0] >= 0) & (items[:, 0] % 2 == 1)
        half = torch.where(keep[:, None], items, torch.tensor([-1, 0, 0], dtype=torch.int32)).cuda()
        out = both(lambda: ops.m_grouped_fp8_gemm_nt_sorted(
            *dev, half, out=torch.full((a.shape[0], 512), float("nan"), dtype=torch.bfloat16, device="cuda")))
        listed = (m.m_indices >= 0) & (m.m_indices % 2 == 1)
        assert out[~listed].isnan().all() and not out[listed].isnan().any()
    else:
        G, n, k, m_indices, qa, sfa, qb, sfb = _three_experts(g)
        if case == "contiguous":
            out = both(lambda: ops.m_grouped_fp8_gemm_nt_contiguous(
                qa.cuda(), sfa.cuda(), qb, sfb, m_indices.cuda(),
                out=torch.full((m_indices.numel(), n), float("nan"), dtype=torch.bfloat16, device="cuda")))
            assert (out[m_indices == -1] == 0).all() and not out.isnan().any()
        else:
            masked_m = torch.tensor([100, 0, 77], dtype=torch.int32).cuda()
            am, sm = qa.view(G, 128, k).cuda(), sfa.view(G, 128, -1).cuda()
            out = both(lambda: ops.m_grouped_fp8_gemm_nt_masked(
                am, sm, qb, sfb, masked_m,
                out=torch.full((G, 128, n), float("nan"), dtype=torch.bfloat16, device="cuda")))
            assert (out[1] == 0).all() and (out[0, 100:] == 0).all() and not out.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "dense-late", "dense-fp32-tail", "128x24576x1536", "contiguous", "masked"])
def test_gpu_persistent_matches_one_tile(monkeypatch, case):
    """Persistent CTAs (PERSISTENT, the default where the tiles make one to two waves; here also forced
    onto a few CTAs, so that each runs many tiles and its stages' phases carry across them, with the
    next scales copied before or after the epilogue) give the bits of one tile a CTA, to the same
    elements: contiguous padding rows as zeros, masked rows past their count as zeros, an empty
    group's tiles too."""
    from ops import gemm_fp8

    run = functools.partial(_forced, monkeypatch)

    g = torch.Generator().manual_seed(len(case))
    if case in ("dense", "dense-late", "dense-fp32-tail", "128x24576x1536"):
        m, n, k, sms = {"dense": (1000, 2112, 7168, 7), "dense-late": (300, 1024, 1536, 3),
                        "dense-fp32-tail": (77, 1024, 1536, 3), "128x24576x1536": (128, 24576, 1536, None)}[case]
        out_dtype = torch.float32 if "fp32" in case else torch.bfloat16
        *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
        ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
        dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
        call = lambda: ops.fp8_gemm_nt(*dev, out_dtype=out_dtype)  # noqa: E731
        if sms is None:     # the default plan with 128-wide tiles (TILES_192 off): 192 tiles on 132 CTAs
            assert gemm_fp8.PERSISTENT
            monkeypatch.setattr(gemm_fp8, "TILES_192", False)
            many = call().cpu()
        else:       # dense-late: the next tile's scales copied after the epilogue (as prefill's)
            many = run(call, persistent=True, sms=sms, **({"early": False} if case == "dense-late" else {}))
        assert calc_diff(many, ref) < 1e-3
        assert_elementwise(many, ref)
    elif case == "contiguous":
        call, check = _grouped_case("contiguous", g)
        many = check(run(call, persistent=True, sms=5))
    else:                   # fp32 out, 64-row tiles: two a group
        call, check = _grouped_case("masked", g, torch.float32, expected_m=64)
        many = check(run(call, persistent=True, sms=4))
    one = run(call, persistent=False)
    torch.testing.assert_close(one, many, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "dense-short", "dense-multicast", "dense-persistent",
                                  "dense-persistent-late", "contiguous", "contiguous-persistent", "masked",
                                  "masked-persistent", "dense-ring", "dense-ring-multicast", "contiguous-ring",
                                  "masked-ring"])
def test_gpu_wide_tiles_match_128_wide(monkeypatch, case):
    """128 x 256 tiles (two column passes, WIDE_TILES; here forced onto small shapes) give the bits of
    128 x 128 tiles, to the same elements: row tails, contiguous padding rows as zeros, masked rows
    past their count and an empty group as zeros; K block counts that leave each burst tail; A
    shared by TMA multicast between n-neighbours; tiles taken in groups of m tiles (raster), the last
    group short; persistent CTAs (a few, each running many tiles), their C staged a column pass at a
    time, the next scales copied before or after the epilogue (late: C over the staged sfa); sfa
    loaded by the producer in chunks (sfa_ring: 4 chunks through a ring of 3 at k = 2048)."""
    run = functools.partial(_forced, monkeypatch)

    g = torch.Generator().manual_seed(len(case))
    if case.startswith("dense"):
        m, n, k = (129, 768, 1792) if case == "dense-short" else (1000, 1024, 2048 if "ring" in case else 1664)
        *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
        ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
        dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
        call = lambda: ops.fp8_gemm_nt(*dev)  # noqa: E731
        if "persistent" in case:
            wide = run(call, block_n=256, stages=3, persistent=True, sms=5, early=case != "dense-persistent-late")
        else:   # (tiles in groups of 3 m tiles: 3, 3 and 2 of the 8; with multicast pairs kept together)
            wide = run(call, **dict(dict(block_n=256, stages=3, persistent=False, multicast="multicast" in case,
                                         raster=3), **_ring(case)))
        assert calc_diff(wide, ref) < 1e-3
        assert_elementwise(wide, ref)
    else:
        call, check = _grouped_case(case.split("-")[0], g)
        wide = check(run(call, **dict(dict(block_n=256, stages=3), **_wide_grid(case))))
    narrow = run(call, block_n=128, persistent=False)
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "dense-short", "dense-64", "128x24576x1536", "64x24576x1536"])
def test_gpu_192_wide_tiles_match_128_wide(monkeypatch, case):
    """128 x 192 tiles (three column passes of 64, TILES_192) give the bits of 128 x 128 tiles, to the same
    elements: even and odd n tiles (an odd one starts 64 columns into a block of sfb), row tails, K block
    counts that leave burst tails; and the op's own plan takes them at 128x24576x1536."""
    from ops import gemm_fp8

    run = functools.partial(_forced, monkeypatch)
    g = torch.Generator().manual_seed(len(case))
    m, n, k = {"dense": (1000, 768, 1664), "dense-short": (129, 1152, 1792), "dense-64": (37, 1152, 1664),
               "128x24576x1536": (128, 24576, 1536), "64x24576x1536": (64, 24576, 1536)}[case]
    *_, qa, sfa, qb, sfb = quantized(m, n, k, g)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    dev = [t.cuda() for t in (qa, sfa, qb, sfb)]
    call = lambda: ops.fp8_gemm_nt(*dev)  # noqa: E731
    if case.endswith("x24576x1536"):
        plans = []
        compile_ = gemm_fp8.fp8_gemm_program.compile
        monkeypatch.setattr(gemm_fp8, "TILES_192", True)
        monkeypatch.setattr(gemm_fp8.fp8_gemm_program, "compile", lambda *a, **p: plans.append(p) or compile_(*a, **p))
        wide = call().cpu()
        assert [(p["block_n"], p["persistent"]) for p in plans] == [(192, False)]
        monkeypatch.setattr(gemm_fp8.fp8_gemm_program, "compile", compile_)
    else:
        wide = run(call, block_n=192, stages=4, persistent=False)
    assert calc_diff(wide, ref) < 1e-3
    assert_elementwise(wide, ref)
    narrow = run(call, block_n=128, persistent=False)
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0, equal_nan=True)


def _wide_grid(case):
    # a few persistent CTAs (every CTA several tiles), or one tile a block in groups of 2 m tiles
    return dict(persistent=True, sms=3) if "persistent" in case else dict(persistent=False, raster=2, **_ring(case))


def _ring(case):
    # sfa in chunks of 4 K blocks by the producer, 4 stages (the most a ring of 4-block chunks allows)
    return dict(sfa_ring=4, stages=4) if "ring" in case else {}


@pytest.mark.gpu
def test_gpu_unaligned_scale_views_are_copied(monkeypatch):
    """Scale views that start 4 bytes past 16-byte alignment (sfa, then sfb) give the bits of the
    aligned tensors, on the same launcher: the wide plan of a long-K grid (1280x7168x12288) whose
    producer loads sfa by TMA in chunks (sfa_ring). A view of a that does not start aligned is a
    ValueError, raised before any kernel runs (the next call still works)."""
    from ops import gemm_fp8
    from ops.quant import dequant_fp8_blocks, dequant_fp8_token_groups

    g = torch.Generator(device="cuda").manual_seed(11)
    m, n, k = 1280, 7168, 12288
    qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g, device="cuda"))
    qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g, device="cuda"))
    plans = []
    compile_ = gemm_fp8.fp8_gemm_program.compile
    monkeypatch.setattr(gemm_fp8.fp8_gemm_program, "compile", lambda *a, **p: plans.append(p) or compile_(*a, **p))
    aligned = ops.fp8_gemm_nt(qa, sfa, qb, sfb)

    def shifted(t):                                                 # the same values, 4 bytes past 16
        return torch.empty(t.numel() + 1, device="cuda")[1:].view_as(t).copy_(t)

    assert shifted(sfa).data_ptr() % 16 == 4
    torch.testing.assert_close(ops.fp8_gemm_nt(qa, shifted(sfa), qb, sfb), aligned, rtol=0, atol=0)
    torch.testing.assert_close(ops.fp8_gemm_nt(qa, sfa, qb, shifted(sfb)), aligned, rtol=0, atol=0)
    assert [(p["block_n"], p["stages"], p.get("sfa_ring", 0)) for p in plans] == [(256, 4, 8)]
    a_off = torch.empty(qa.numel() + 4, dtype=qa.dtype, device="cuda")[4:].view_as(qa).copy_(qa)
    with pytest.raises(ValueError, match="a must start 16-byte aligned"):
        ops.fp8_gemm_nt(a_off, sfa, qb, sfb)
    torch.testing.assert_close(ops.fp8_gemm_nt(qa, sfa, qb, sfb), aligned, rtol=0, atol=0)
    ref = dequant_fp8_token_groups(qa, sfa) @ dequant_fp8_blocks(qb, sfb).T
    assert calc_diff(aligned.float(), ref) < 1e-3


@pytest.mark.gpu
def test_gpu_grouped_layouts():
    g = torch.Generator().manual_seed(5)
    G, n, k = 4, 512, 1024
    m_indices = torch.tensor(sum(([e] * 200 + [-1] * 56 for e in range(G)), []), dtype=torch.int32)
    a = torch.randn(m_indices.numel(), k, generator=g)
    qa, sfa = ops.per_token_group_quant_fp8(a)
    bs = [ops.per_block_quant_fp8(torch.randn(n, k, generator=g)) for _ in range(G)]
    qb, sfb = torch.stack([q for q, _ in bs]), torch.stack([s for _, s in bs])
    out = ops.m_grouped_fp8_gemm_nt_contiguous(qa.cuda(), sfa.cuda(), qb.cuda(), sfb.cuda(), m_indices.cuda())
    ref = ops.m_grouped_fp8_gemm_nt_contiguous(qa, sfa, qb, sfb, m_indices)
    assert calc_diff(out.cpu(), ref) < 1e-3 and (out.cpu()[m_indices == -1] == 0).all()
    masked_m = torch.tensor([200, 0, 37, 256], dtype=torch.int32)
    am, sm = qa.view(G, 256, k).contiguous(), sfa.view(G, 256, -1).contiguous()
    outm = ops.m_grouped_fp8_gemm_nt_masked(am.cuda(), sm.cuda(), qb.cuda(), sfb.cuda(), masked_m.cuda())
    refm = ops.m_grouped_fp8_gemm_nt_masked(am, sm, qb, sfb, masked_m)
    assert calc_diff(outm.cpu(), refm) < 1e-3 and (outm.cpu()[1] == 0).all()


# ---- MXFP4 weights -------------------------------------------------------------------------------

def test_mxfp4_cpu_is_the_exact_dequant_product():
    g = torch.Generator().manual_seed(6)
    a = torch.randn(5, 256, generator=g).bfloat16()
    w = torch.randn(128, 256, generator=g)
    packed, scales = ops.quant_mxfp4(w)
    out = ops.mxfp4_gemm_nt(a, packed, scales)
    ref = a.float() @ ops.dequant_mxfp4(packed, scales).T
    assert out.dtype == torch.bfloat16 and calc_diff(out, ref) < 1e-5
    assert calc_diff(out, a.float() @ w.T) < 1e-2            # the FP4 weight error, DeepGEMM's bound
    with pytest.raises(ValueError, match=r"b must have shape \(128, 128\)"):
        ops.mxfp4_gemm_nt(a, packed[:, :64].contiguous(), scales)
    with pytest.raises(TypeError, match="a must have dtype float8_e4m3fn"):
        ops.mxfp4_gemm_nt(a, packed, scales, sfa=torch.ones(5, 2))


def test_mxfp4_takes_mx_fp8_activations():
    """e4m3 a with OCP MX scales (one E8M0 byte per 32 values): the exact dequantized product, in
    the dense and grouped ops; scales of the wrong shape or dtype name the argument."""
    g = torch.Generator().manual_seed(11)
    m, n, k = 9, 128, 256
    qa = (torch.randn(m, k, generator=g) * 3).to(torch.float8_e4m3fn)
    sfa = torch.randint(110, 140, (m, k // 32), generator=g, dtype=torch.uint8)
    packed, scales = ops.quant_mxfp4(torch.randn(n, k, generator=g))
    exact = ops.dequant_mx_fp8(qa, sfa) @ ops.dequant_mxfp4(packed, scales).T
    assert torch.equal(ops.dequant_mx_fp8(qa, sfa)[0, :32], qa[0, :32].float() * 2.0 ** (int(sfa[0, 0]) - 127))
    assert_elementwise(ops.mxfp4_gemm_nt(qa, packed, scales, sfa=sfa), exact)
    masked = ops.m_grouped_mxfp4_gemm_nt_masked(qa[None].contiguous(), packed[None].contiguous(),
                                                scales[None].contiguous(), torch.tensor([m], dtype=torch.int32),
                                                sfa=sfa[None].contiguous())
    assert_elementwise(masked[0], exact)
    with pytest.raises(ValueError, match="sfa"):
        ops.mxfp4_gemm_nt(qa, packed, scales, sfa=sfa[:, :4].contiguous())
    with pytest.raises((TypeError, ValueError), match="sfa"):
        ops.mxfp4_gemm_nt(qa, packed, scales, sfa=sfa.to(torch.int32))


def test_range_errors_name_the_offending_value_and_where():
    """A grouped GEMM's index out of range says which value, where, and how many such entries there are."""
    a = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    sfa = torch.ones(256, 2)
    b = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    sfb = torch.ones(2, 1, 2)
    idx = torch.zeros(256, dtype=torch.int32)
    idx[130], idx[200] = 5, -3
    with pytest.raises(ValueError, match=r"m_indices must be in \[-1, 2\), got 5 at index 130 \(2 such\)"):
        ops.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, idx)
    masked = torch.tensor([3, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"masked_m must be in \[0, 128\], got 300 at index 1 \(1 such\)"):
        ops.m_grouped_fp8_gemm_nt_masked(a.view(2, 128, 256), sfa.view(2, 128, 2), b, sfb, masked)


def test_contiguous_grouped_ops_refuse_zero_groups_with_rows():
    """The contiguous kernels clamp a row's group into [0, groups): with no groups there is nothing to clamp into
    (it would read b[-1]), so rows with zero groups are refused on every device, even when every row is padding."""
    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    sfa = torch.ones(128, 2)
    pad = torch.full((128,), -1, dtype=torch.int32)
    b = torch.zeros(0, 128, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="b must have at least one group"):
        ops.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, torch.ones(0, 1, 2), pad)
    packed = torch.zeros(0, 128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="b must have at least one group"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a.to(torch.bfloat16), packed, torch.zeros(0, 128, 8, dtype=torch.uint8), pad)
    # no rows, no groups: nothing to compute, an empty result
    empty = ops.m_grouped_fp8_gemm_nt_contiguous(a[:0], sfa[:0], b, torch.ones(0, 1, 2), pad[:0])
    assert empty.shape == (0, 128)


def test_mxfp4_sfa_not_a_tensor_is_named_off_the_cpu():
    """Off the CPU (here the meta device: no values, no kernel) the native-kernel routing read sfa.dtype before
    any check: a list as sfa was an AttributeError; now the named TypeError of the decoded-tile path."""
    a = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device="meta")
    b, sfb = ops.quant_mxfp4(torch.randn(128, 256))
    with pytest.raises(TypeError, match="sfa must be a torch.Tensor, got list"):
        ops.mxfp4_gemm_nt(a, b, sfb, sfa=[1.0])
    with pytest.raises(TypeError, match="sfa must be a torch.Tensor, got list"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a, b[None], sfb[None], torch.zeros(4, dtype=torch.int32), sfa=[1.0])


def test_mxfp4_takes_e4m3_activations_with_their_scales():
    # an e4m3 a with per-token-group scales: within the FP4 operand's error of the exact product
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 384, generator=g)
    qa, sfa = ops.per_token_group_quant_fp8(x)
    packed, scales = ops.quant_mxfp4(torch.randn(128, 384, generator=g))
    exact = ops.dequant_fp8_token_groups(qa, sfa) @ ops.dequant_mxfp4(packed, scales).T
    out = ops.mxfp4_gemm_nt(qa, packed, scales, sfa=sfa)
    assert out.dtype == torch.bfloat16 and calc_diff(out, exact) < 1e-4
    b, sfb = torch.stack([packed, packed]), torch.stack([scales, scales])
    grouped = ops.m_grouped_mxfp4_gemm_nt_masked(qa[None].expand(2, 7, 384).contiguous(), b, sfb,
                                                 torch.tensor([7, 3], dtype=torch.int32),
                                                 sfa=sfa[None].expand(2, 7, 3).contiguous())
    assert torch.equal(grouped[0], out)
    torch.testing.assert_close(grouped[1, :3].float(), out[:3].float(), rtol=2 ** -8, atol=0)   # 3-row product
    assert (grouped[1, 3:] == 0).all()
    with pytest.raises(ValueError, match=r"sfa must have shape \(7, 3\)"):
        ops.mxfp4_gemm_nt(qa, packed, scales, sfa=sfa[:, :2].contiguous())


# (sm_90a's HGMMA, with K split and without: test_mxfp4_decoded_loop_on_sm90a_overlaps_the_decode_with_the_mma
# builds the same program at splits=4 and 1 and finds HGMMA in its K loop, a split's tail steps included; building it
# here too was ~25 s of CI)
@pytest.mark.parametrize("target,instr,splits", [("sm_100a", "UTCHMMA", 1), ("sm_100a", "UTCHMMA", 2)])
def test_mxfp4_lowers_to_bf16_tensor_cores(target, instr, splits):
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import mxfp4_gemm_program

    try:
        src = mxfp4_gemm_program.source(target, n=256, k=512, block_m=64, splits=splits)
        hist = sass_stats(build_cubin(src, target), target).histogram
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert hist.get(instr, 0) > 0


@pytest.mark.parametrize("params", [dict(n=4096, k=7168, block_m=64, splits=4), dict(n=2048, k=7168, block_m=128),
                                    dict(n=4096, k=7168, block_m=64, splits=4, threads=512)])
def test_mxfp4_decoded_loop_on_sm90a_overlaps_the_decode_with_the_mma(params):
    """sm_90a's mma_decoded_loop: a 384-thread block (TMA warpgroup + 2 MMA warpgroups), the WGMMA
    of a step left in flight while the next step decodes (wgmma wait 1 in the source), and ptxas
    keeps it so: no C7514 / C7517, no spills, and a burst's loop waits with DEPBAR 0x1 between its
    HGMMAs and drains once (0x0)."""
    from codegen.lowering.sm90 import BURST
    from ops.gemm_mxfp4 import mxfp4_gemm_program

    _burst_loop_of(mxfp4_gemm_program.source("sm_90a", **params), "HGMMA", BURST, params.get("threads", 256) + 128)


@pytest.mark.parametrize("params", [dict(n=4096, k=7168, tokens=64, splits=4), dict(n=7168, k=2048, tokens=8),
                                    dict(n=4096, k=7168, tokens=32, splits=8, blocks_per_sm=2, stages=4)])
def test_mxfp4_swapped_decodes_into_wgmma_registers(params):
    """The swapped program (tile.mma_register_decoded_loop): WGMMA with A from registers (wgmma_rs),
    no spills; one block an SM: the WGMMA of a step in flight while the next decodes into the other
    fragment; two: __launch_bounds__(384, 2), 80 registers at launch, 104 for the MMA threads, one
    fragment, each step's WGMMA waited for. The K loop holds no shared store, no block or named
    barrier and no proxy fence (checked at one block an SM): the decode goes from the staged codes
    into the fragments, never through shared memory."""
    from codegen.lowering.sm90 import BURST
    from ops.gemm_mxfp4 import mxfp4_swapped_program

    src = mxfp4_swapped_program.source("sm_90a", **params)
    assert "tl::wgmma_rs<" in src and "tc_e2m1_fragment(" in src
    if params.get("blocks_per_sm", 1) == 2:
        assert "__launch_bounds__(384, 2)" in src and "warpgroup_reg_alloc<104>" in src
        _single_fragment_kernel(src)
        return
    loop = _burst_loop_of(src, "HGMMA", BURST)
    ops_in_loop = {t.split()[0] for t in loop}
    assert not {op for op in ops_in_loop if op.startswith(("STS", "BAR", "FENCE"))}, sorted(ops_in_loop)
    assert sum(t.startswith("LDS.128") for t in loop) == 8 * BURST       # a thread's two rows, 64 bytes each


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_mxfp4_warps_lowers_to_mma_sync_on_independent_warps(target):
    """The warp kernel (ops.gemm_mxfp4_warps, m <= 16): mma.sync m16n8k16 (HMMA in SASS, no warpgroup MMA), loads
    straight from global memory into registers (no shared-memory or TMA traffic in the K loop: the one shared
    store and load are the partials' meeting after the loop), one block barrier, no spills; on both CUDA targets."""
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4_warps import mxfp4_warps_program, plan_warps

    for m, n, k in ((1, 4096, 7168), (16, 7168, 2048)):
        src = mxfp4_warps_program.source(target, n=n, k=k, **plan_warps(m, n, k, quads=False))
        assert "tc_mxfp4_warp_mma<" in src and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src
        stats = sass_stats(build_cubin(src, target), target)
        h = stats.histogram
        assert h.get("HMMA", 0) >= 16 and not h.get("HGMMA") and not h.get("UTMALDG") and not h.get("LDGSTS")
        assert h.get("BAR") == 1 and stats.spill_stores == 0 and stats.spill_loads == 0, stats.format()


def test_mxfp4_warps_scale_quads_lower_to_shuffles():
    """quads=True: the scale words four K steps a load (one a lane), a step's taken from its lane by SHFL: fewer
    global loads in the K loop than a word a step, the same HMMA count, no spills; the masked form takes the knob
    too (one helper call a token tile)."""
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4_warps import mxfp4_warps_masked_program, mxfp4_warps_program, plan_warps

    for m, n, k in ((1, 4096, 7168), (9, 7168, 2048)):
        p = plan_warps(m, n, k, quads=False, acts_ring=False)
        src = mxfp4_warps_program.source("sm_90a", n=n, k=k, **{**p, "quads": True})
        assert f"tc_mxfp4_warp_mma<{p['tokens'] // 8}, 2, 0, false, 0, 0, true>(" in src
        quads = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
        plain = sass_stats(build_cubin(mxfp4_warps_program.source("sm_90a", n=n, k=k, **p), "sm_90a"), "sm_90a")
        assert quads.histogram.get("SHFL", 0) > plain.histogram.get("SHFL", 0), (quads.format(), plain.format())
        assert quads.histogram["HMMA"] == plain.histogram["HMMA"], (quads.format(), plain.format())
        assert quads.spill_stores == 0 and quads.spill_loads == 0, quads.format()
    src = mxfp4_warps_masked_program.source("sm_90a", n=4096, k=7168, tokens=8, splits=8, quads=True, acts_ring=False)
    assert src.count("tc_mxfp4_warp_mma<1, 2, 0, false, 0, 0, true>(") == 1


def test_mxfp4_warps_load_probes_drop_what_they_name():
    """The sweep's loads-alone probes (loads_only 1, 6, 7: no decode, no MMA) against each other in SASS: 6 drops the
    scale words' 32-bit loads, 7 the activations' 128-bit ones (the codes' stay), 1 keeps both (static counts: the
    loops unroll differently); none has an HMMA. The default kernel's helper call is unchanged (trailing defaults trimmed)."""
    from backends.cuda.sass import build_cubin, disassemble
    from ops.gemm_mxfp4_warps import mxfp4_warps_program, plan_warps

    p = plan_warps(1, 4096, 7168, quads=False, acts_ring=False)
    assert "tc_mxfp4_warp_mma<1, 2, 0>(" in mxfp4_warps_program.source("sm_90a", n=4096, k=7168, **p)
    loads = {}
    for probe in (1, 6, 7):
        src = mxfp4_warps_program.source("sm_90a", n=4096, k=7168, loads_only=probe, **p)
        assert f"tc_mxfp4_warp_mma<1, 2, 0, false, 0, {probe}>(" in src
        sass = disassemble(build_cubin(src, "sm_90a"))
        assert "HMMA" not in sass
        ldg = [line.split()[1] if line.split()[0].startswith("@") else line.split()[0]
               for line in (x.split("*/", 1)[-1].strip() for x in sass.splitlines() if "LDG" in x)]
        loads[probe] = (sum("LDG" in op and ".128" in op for op in ldg), sum("LDG" in op and ".128" not in op
                                                                            for op in ldg))
    (wide1, narrow1), (wide6, narrow6), (wide7, narrow7) = loads[1], loads[6], loads[7]
    assert narrow1 > 0 and narrow6 == 0 and narrow7 > 0, loads      # the scale words: the only 32-bit loads
    assert wide6 > 0 and wide7 < wide1, loads                       # the activations: 128-bit (their every word used)


def test_mxfp4_warps_acts_ring_lowers():
    """acts_ring=True: the activations ride in the codes' ring, depth steps ahead: the same HMMA and 16-byte
    activation loads as the one-step-ahead kernel, no spills and at most 8 more registers (at depth 2 the ring's
    two slots are the old pair's); the masked form takes it."""
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4_warps import mxfp4_warps_masked_program, mxfp4_warps_program, plan_warps

    for m, n, k in ((1, 4096, 7168), (8, 7168, 2048), (16, 4096, 7168)):
        p = plan_warps(m, n, k, quads=False, acts_ring=False)
        src = mxfp4_warps_program.source("sm_90a", n=n, k=k, **{**p, "acts_ring": True})
        assert f"tc_mxfp4_warp_mma<{p['tokens'] // 8}, 2, 0, false, 0, 0, false, true>(" in src
        ring = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
        plain = sass_stats(build_cubin(mxfp4_warps_program.source("sm_90a", n=n, k=k, **p), "sm_90a"), "sm_90a")
        assert ring.histogram["HMMA"] == plain.histogram["HMMA"], (ring.format(), plain.format())
        assert ring.spill_stores == 0 and ring.registers <= plain.registers + 8, (ring.format(), plain.format())
    assert "tc_mxfp4_warp_mma<1, 2, 0, false, 0, 0, false, true>(" in mxfp4_warps_masked_program.source(
        "sm_90a", n=4096, k=7168, tokens=8, splits=8, quads=False, acts_ring=True)


def test_mxfp4_warps_scales_no_l1_probe_lowers():
    """scales_no_l1 (bench.sweep_mxfp4_warps' probe): the same kernel with its 32-bit scale-word loads not allocated in
    L1 (LDG.E.NA: each misses there, as the codes do), nothing else changed: the same 128-bit loads, HMMA and
    registers; off, the helper's template arguments are the default kernel's."""
    import collections

    from backends.cuda.sass import build_cubin, disassemble, sass_stats
    from ops.gemm_mxfp4_warps import mxfp4_warps_program, plan_warps

    p = plan_warps(1, 4096, 7168)
    builds = {}
    for probe in (False, True):
        src = mxfp4_warps_program.source("sm_90a", n=4096, k=7168, scales_no_l1=probe, **p)
        assert ("tc_mxfp4_warp_mma<1, 2, 0, false, 0, 0, false, true, true>(" in src) == probe
        cubin = build_cubin(src, "sm_90a")
        builds[probe] = (sass_stats(cubin, "sm_90a"), collections.Counter(re.findall(r"\b(LDG\.[A-Z0-9.]+)",
                                                                                      disassemble(cubin))))
    (plain, plain_ldg), (probe, probe_ldg) = builds[False], builds[True]
    assert probe_ldg["LDG.E.NA.CONSTANT"] == plain_ldg["LDG.E.CONSTANT"] > 0 and "LDG.E.CONSTANT" not in probe_ldg
    assert probe_ldg["LDG.E.128.CONSTANT"] == plain_ldg["LDG.E.128.CONSTANT"]
    assert probe.histogram["HMMA"] == plain.histogram["HMMA"] and probe.registers == plain.registers


def test_mxfp4_warps_masked_lowers():
    """The masked form (MoE decode): one helper call a token tile, HMMA, no spills, at most 128 registers a thread
    (two 8-warp blocks an SM: 65536 registers / 512 threads; 106 before the activations rode in the ring, 107 with)."""
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4_warps import mxfp4_warps_masked_program

    src = mxfp4_warps_masked_program.source("sm_90a", n=4096, k=7168, tokens=8, splits=8, quads=False, acts_ring=True)
    assert src.count("tc_mxfp4_warp_mma<1, 2, 0, false, 0, 0, false, true>(") == 1
    stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    assert stats.histogram.get("HMMA", 0) >= 8
    assert stats.spill_stores == 0 and stats.registers <= 128, stats.format()


def test_mxfp4_masked_route_picks_the_warp_tiles(monkeypatch):
    """m_grouped_mxfp4_gemm_nt_masked's tile from expected_m and k: 8- / 16-token warp tiles at expected_m <=
    WARP_TOKENS and k <= MASKED_WARPS_MAX_K (the down projection's 7168x2048, session 60), else the 64-row tile."""
    from ops import _dispatch, gemm_mxfp4

    seen = []
    monkeypatch.setattr(_dispatch, "call", lambda op, impl, mode, a, b, sfb, aux, block_m: seen.append(block_m))

    def block_m(k, expected_m, max_m=16):
        G, n = 2, 128
        a = torch.zeros(G, max_m, k, dtype=torch.bfloat16)
        b, sfb = torch.zeros(G, n, k // 2, dtype=torch.uint8), torch.full((G, n, k // 32), 127, dtype=torch.uint8)
        ops.m_grouped_mxfp4_gemm_nt_masked(a, b, sfb, torch.tensor([1, 0], dtype=torch.int32), expected_m)
        return seen.pop()

    assert gemm_mxfp4.WARP_TOKENS == 8 and gemm_mxfp4.MASKED_WARPS_MAX_K == 2048
    assert [block_m(2048, e) for e in (1, 4, 8, 9)] == [8, 8, 8, 64]
    assert block_m(4096, 4) == 64 and block_m(1024, None, max_m=3) == 8 and block_m(1024, None, max_m=12) == 64
    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 16)
    assert block_m(2048, 12) == 16
    monkeypatch.setattr(gemm_mxfp4, "MASKED_WARPS_MAX_K", 0)
    assert block_m(2048, 4) == 64


def test_mxfp4_warps_trace_stamps_and_summary():
    """trace=True (bench.trace_mxfp4_warps): lane 0 of each warp stamps into its own Trace row (the timer at entry
    and end, the clock at each step's data and issue); the default kernel takes Trace but never touches it, and is
    otherwise the same source. The summary reads made-up stamps: per-step waits and work, the late entries."""
    from bench.trace_mxfp4_warps import summarize
    from ops.gemm_mxfp4_warps import AHEAD, DEPTH, TRACE_STEPS, TRACE_WORDS, mxfp4_warps_program

    plain = mxfp4_warps_program.source("sm_90a", n=256, k=1024, splits=4, quads=False, acts_ring=False)
    traced = mxfp4_warps_program.source("sm_90a", n=256, k=1024, splits=4, quads=False, acts_ring=False, trace=True)
    assert "Trace[" not in plain.split('extern "C" __global__')[-1]
    assert f"tc_mxfp4_warp_mma<1, {DEPTH}, {AHEAD}, true, {TRACE_STEPS}>(" in traced
    assert f"(&(Trace[((((int)blockIdx.x) * {4 * TRACE_WORDS}) + ((((int)threadIdx.x) >> 5) * {TRACE_WORDS}))]))" in traced
    quads = mxfp4_warps_program.source("sm_90a", n=256, k=1024, splits=4, quads=True, acts_ring=False, trace=True)
    assert f"tc_mxfp4_warp_mma<1, {DEPTH}, {AHEAD}, true, {TRACE_STEPS}, 0, true>(" in quads
    # two warps (kb = 4, splits = 2: two steps each); warp 1 enters 5000 ns late; clocks: entry 100, data 300 / 900,
    # issued 500 / 1000, end 1100
    row = [0] * TRACE_WORDS
    row[2:6], row[6:8] = [100, 1100, 300, 500], [900, 1000]
    rows = [[1000, 3000, *row[2:]], [6000, 9000, *row[2:]]]
    text = summarize(rows, 4, 2)
    assert "span 8.00 us over 2 warps" in text and "entries (ns) p50 5000" in text
    for name, p50 in (("first data (entry ->)", 200), ("step: wait for data", 400), ("step: work", 200),
                      ("tail (last issue ->)", 100)):
        assert re.search(re.escape(name) + rf"\s+p50\s+{p50}\s", text), (name, text)


def _probe_offsets(order: int, k: int, splits: int) -> list[int]:
    """Byte offsets into a 16-row block's region (16 rows of k / 2 bytes) that tc_mxfp4_warp_codes_probe<order>
    reads, over the block's warps and lanes: a Python model of its address arithmetic."""
    from ops.gemm_mxfp4_warps import _per

    kb, rs = k // 128, k // 2
    per, seen = _per(kb, splits), []
    for w in range(splits):
        s0 = w * per
        steps = max(min(per, kb - s0), 0)
        length = 64 * steps
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if order == 2:
                at = [r * rs + 64 * (s0 + i) + 16 * t for i in range(steps) for r in (g, g + 8)]
            elif order == 5:
                at = [1024 * s0 + 512 * q + 16 * lane for q in range(2 * steps)]
            else:
                per_row = (length + 511) // 512
                pieces = [(q // per_row, q % per_row) if order == 3 else (q % 16, q // 16) for q in range(16 * per_row)]
                at = [r * rs + 64 * s0 + 512 * c + 16 * lane for r, c in pieces if 512 * c + 16 * lane < length]
            seen += [a + b for a in at for b in range(16)]
    return seen


@pytest.mark.parametrize("k, splits", [(7168, 8), (2048, 4), (7168, 16), (1152, 4)])
def test_mxfp4_warps_probe_orders_read_the_block_once(k, splits):
    """The scatter probe's four orders (loads_only 2..5) read each byte of a block's region exactly once (no byte
    twice, none left out, none past it), so their times compare the same bytes."""
    want = list(range(16 * k // 2))
    for order in (2, 3, 4, 5):
        assert sorted(_probe_offsets(order, k, splits)) == want, order


def test_mxfp4_warps_plan_and_refusals(monkeypatch):
    """plan_warps: the 8- or 16-token tile, about 16 warps an SM over n / 16 blocks (a power of two, at most one a
    K step, at most 16), the module's knobs unless given; the program refuses what it cannot run, naming the
    parameter."""
    from ops import gemm_mxfp4_warps
    from ops.gemm_mxfp4_warps import mxfp4_warps_program, plan_warps

    monkeypatch.setattr(gemm_mxfp4_warps, "QUADS", False)
    monkeypatch.setattr(gemm_mxfp4_warps, "ACTS_RING", False)
    assert plan_warps(1, 4096, 7168) == dict(tokens=8, splits=8, depth=2, ahead=0, quads=False, acts_ring=False)
    assert plan_warps(9, 7168, 2048) == dict(tokens=16, splits=4, depth=2, ahead=0, quads=False, acts_ring=False)
    assert plan_warps(16, 256, 384)["splits"] == 2             # 3 K steps: at most one warp a step (a power of two)
    assert plan_warps(3, 256, 7168)["splits"] == 16
    assert plan_warps(8, 8 * 4096, 7168)["splits"] == 1        # a masked call's 8 x 4096 rows: one warp a block
    monkeypatch.setattr(gemm_mxfp4_warps, "QUADS", True)
    assert plan_warps(1, 4096, 7168)["quads"] and not plan_warps(1, 4096, 7168, quads=False)["quads"]
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"1..16 tokens, got m={bad}"):
            plan_warps(bad, 4096, 7168)
    with pytest.raises(ValueError, match="tokens must be one of"):
        mxfp4_warps_program.source("sm_90a", n=256, k=512, tokens=32)
    with pytest.raises(ValueError, match="splits must be 1..16"):
        mxfp4_warps_program.source("sm_90a", n=256, k=512, splits=32)
    with pytest.raises(ValueError, match="depth must be 1..8 and ahead >= 0, got depth=9"):
        mxfp4_warps_program.source("sm_90a", n=256, k=512, depth=9)
    with pytest.raises(ValueError, match="n must be a multiple of 16 and k of 128"):
        mxfp4_warps_program.source("sm_90a", n=264, k=512)
    with pytest.raises(ValueError, match="loads_only must be 0..7, got 8"):
        mxfp4_warps_program.source("sm_90a", n=256, k=512, loads_only=8)
    with pytest.raises(ValueError, match="has no lowering for ascend:950"):
        mxfp4_warps_program.source("ascend:950", n=256, k=512)
    # the sweep's probes: the codes alone in the kernel's order (2), row by row (3), piece by piece (4), as one run a
    # warp (5), on the same grid
    for probe in (2, 3, 4, 5):
        assert f"tc_mxfp4_warp_codes_probe<{probe}, 2>(" in mxfp4_warps_program.source("sm_90a", n=256, k=512,
                                                                                      loads_only=probe)


def _single_fragment_kernel(src: str) -> None:
    """The two-blocks-an-SM kernel: HGMMA and TMA, no spills or WGMMA serialization, and every
    WGMMA wait a drain (DEPBAR 0x0: a step's WGMMA is done before the next decode writes the one
    fragment)."""
    sass = _tma_wgmma_sass(src, "HGMMA")
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert waits and set(waits) == {"0x0"}, waits


def test_mxfp4_swapped_fold_arrives_among_the_mma_threads():
    """fold=True: the tile's last split block adds the partials in split order inside the kernel.
    The arrival is ordered by a named barrier of the 256 MMA threads (the producer warps have exited:
    a block-wide barrier would never complete), the counter is set back to 0 by the last block, and
    no other barrier is added. No fence (no MEMBAR.*.GPU in SASS): the partials are stored as ready values
    and the last block waits for each word it reads (tc_ready_fold4, four words a load), then empties it.
    The plan folds where a partial tile is at most 16 tokens and K is split; SWAPPED_FOLD forces it; a
    kernel with one split cannot fold."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4 import mxfp4_swapped_program, plan_swapped

    params = dict(n=256, k=1024, tokens=16, splits=2, stages=4)
    plain = mxfp4_swapped_program.source("sm_90a", **params)
    folded = mxfp4_swapped_program.source("sm_90a", **params, fold=True)
    assert "AtomicAddRet" not in plain and folded.count("AtomicAddRet(") == 1
    assert folded.count("tl::__sync_thread_partial(11, 256);") == 2
    assert folded.count("__syncthreads()") == plain.count("__syncthreads()")
    assert re.search(r"Count\[.*?\] = 0;", folded)
    assert "__threadfence" not in folded and "tc_ready" not in plain
    assert re.search(r"Part\[.*\] = tc_ready_value\(", folded) and folded.count("tc_ready_fold4<2, 2>((&(C[") == 1
    assert not re.search(r"MEMBAR\.\w+\.GPU", _sass_and_ptxas_log(folded)[0])
    assert plan_swapped(16, 4096, 7168)["fold"] and plan_swapped(1, 4096, 7168)["fold"]
    assert not plan_swapped(1, 7168, 2048)["fold"] and plan_swapped(1, 7168, 2048)["pair"]   # 2 splits: a pair
    assert not plan_swapped(64, 4096, 7168)["fold"] and not plan_swapped(32, 4096, 7168)["fold"]
    assert not plan_swapped(8, 24576, 1536)["fold"]                   # one split: nothing to fold
    saved = gemm_mxfp4.SWAPPED_FOLD
    try:
        gemm_mxfp4.SWAPPED_FOLD = True
        assert plan_swapped(64, 4096, 7168)["fold"] and not plan_swapped(64, 24576, 1536)["fold"]
        gemm_mxfp4.SWAPPED_FOLD = False
        assert not plan_swapped(16, 4096, 7168)["fold"]
    finally:
        gemm_mxfp4.SWAPPED_FOLD = saved
    assert plan_swapped(64, 4096, 7168, fold=True)["fold"]
    with pytest.raises(ValueError, match="needs splits > 1"):
        mxfp4_swapped_program.source("sm_90a", n=256, k=1024, tokens=16, splits=1, stages=4, fold=True)


def test_mxfp4_swapped_raw_words_a_step_ahead():
    """ahead=True: each MMA thread loads its raw words of step s + 1 into registers (two buffers of 32
    words) before it decodes step s from the ones loaded a step earlier. The buffers stay in
    registers at the largest token tile (no local memory, no spills); a stage of more than one
    128-deep part is refused."""
    from ops.gemm_mxfp4 import mxfp4_swapped_program, plan_swapped

    p = dict(plan_swapped(64, 4096, 7168), ahead=True)
    src = mxfp4_swapped_program.source("sm_90a", n=4096, k=7168, **p)
    assert "tc_e2m1_rows_load(raw" in src and "tc_e2m1_fragment_from<true>(" in src
    assert "tc_e2m1_fragment<" not in src.split("extern \"C\" __global__")[-1]
    sass, log = _sass_and_ptxas_log(src)
    assert "0 bytes spill stores, 0 bytes spill loads" in log and "0 bytes stack frame" in log
    assert not re.search(r"\b(LDL|STL)\b", sass)
    with pytest.raises(ValueError, match="stages of one part"):
        mxfp4_swapped_program.source("sm_90a", n=256, k=1024, tokens=8, stages=2, stage_k=256, ahead=True)


def test_mxfp4_swapped_64_row_blocks_plan_and_lower():
    """block_n = 64: one MMA warpgroup a block and twice the blocks, so the plan splits K half as often (64x7168x2048:
    one split, no reduce kernel; 64x4096x7168: 2 instead of 4); the kernel keeps its MMAs asynchronous with no spills
    at 16 and 64 tokens. Other widths are refused; 128-row plans carry no block_n (their kernels unchanged)."""
    from ops.gemm_mxfp4 import mxfp4_swapped_program, plan_swapped

    assert "block_n" not in plan_swapped(64, 7168, 2048)
    assert plan_swapped(64, 7168, 2048)["splits"] == 2 and plan_swapped(64, 4096, 7168)["splits"] == 4
    p = plan_swapped(64, 7168, 2048, block_n=64)
    assert p["block_n"] == 64 and p["splits"] == 1
    assert plan_swapped(64, 4096, 7168, block_n=64)["splits"] == 2
    for m, n, k in ((64, 7168, 2048), (16, 4096, 7168)):
        q = plan_swapped(m, n, k, block_n=64)
        src = mxfp4_swapped_program.source("sm_90a", n=n, k=k, **q)
        assert "mxfp4_gemm_nt_swapped" in src
        sass, log = _sass_and_ptxas_log(src)
        assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == [], (m, n, k)
        assert not re.search(r"\b(LDL|STL)\b", sass)
    with pytest.raises(ValueError, match="block_n must be 64 or 128"):
        plan_swapped(64, 7168, 2048, block_n=96)


def test_mxfp4_swapped_block_n_rule(monkeypatch):
    """SWAPPED_BLOCK_N = None (the default): 64-row blocks exactly where the 128-row plan ends in the reduce kernel, the
    64-row plan has no split and a block runs <= SWAPPED_BLOCK_N_STEPS steps (32 and 64 tokens at 7168x2048); 128
    where a block would run more (7168x4096: no split either way past the reduce, but 32 steps), where 64 rows still
    split (4096x7168, 2112x7168), where the 128-row plan folds or pairs (16 tokens) or has no split (24576x1536), and
    on other SM counts as their plans say. A forced width wins."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4 import plan_swapped, swapped_block_n

    assert gemm_mxfp4.SWAPPED_BLOCK_N is None and gemm_mxfp4.SWAPPED_BLOCK_N_STEPS == 16
    for m in (32, 64):
        for n, k, width in ((7168, 2048, 64), (7168, 4096, 128)):
            assert swapped_block_n(m, n, k) == width, (m, n, k)
            assert plan_swapped(m, n, k)["splits"] == 2 and plan_swapped(m, n, k, block_n=64)["splits"] == 1
        for n, k in ((4096, 7168), (2112, 7168), (24576, 1536), (4096, 512)):
            assert swapped_block_n(m, n, k) == 128, (m, n, k)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N_STEPS", 32)
    assert swapped_block_n(64, 7168, 4096) == 64
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N_STEPS", 16)
    for n, k in ((7168, 2048), (7168, 4096), (4096, 7168)):
        assert swapped_block_n(16, n, k) == 128                     # folded or paired: no reduce kernel to remove
        assert swapped_block_n(64, n, k, pair=True) == 128           # a forced pair: no reduce kernel either
    assert swapped_block_n(64, 7168, 2048, sms=32) == 128           # 56 tiles fill 32 SMs: no split to remove
    for forced in (64, 128):
        monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", forced)
        assert swapped_block_n(64, 4096, 7168) == forced and swapped_block_n(64, 7168, 2048) == forced


def test_mxfp4_swapped_chains_plan_and_lower(monkeypatch):
    """chains=2 (ops.gemm_mxfp4.SWAPPED_CHAINS, on): 64-row blocks whose two MMA warpgroups take alternate K steps,
    each into its half of a (128, tokens) accumulator. The plan takes it only with one split and makes room for the
    halves' staging tile; the kernel has each chain's steps (full and empty barriers of 128 arrivals, the slot from
    the chain index), no spills and no serialized WGMMA, and the epilogue adds the halves once (a named barrier of the
    256 MMA threads between). The op's rule then has no step limit; the switch is in the launchers' key; other
    shapes, widths, splits and knobs are refused with errors naming them."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4 import mxfp4_swapped_program, plan_swapped, swapped_block_n

    assert gemm_mxfp4.SWAPPED_CHAINS is True and "chains" not in plan_swapped(64, 7168, 2048, block_n=64)
    p = plan_swapped(64, 7168, 2048, block_n=64, chains=2)
    assert p["chains"] == 2 and p["splits"] == 1 and p["stages"] == 8
    q = plan_swapped(64, 4096, 7168, block_n=64, chains=2)         # 2 splits: a cluster pair (SWAPPED_CHAINS_PAIR)
    assert q["chains"] == 2 and q["splits"] == 2 and not q["fold"] and not q["stage_out"] and q["pair"]
    assert not plan_swapped(64, 4096, 7168, block_n=64, chains=2, chains_pair=False)["pair"]  # partials: the reduce
    assert not plan_swapped(64, 2048, 7168, block_n=64, chains=2)["pair"]      # 4 splits: the reduce kernel
    r = plan_swapped(16, 4096, 7168, block_n=64, chains=2, chains_pair="all")  # "all": the chains where it pairs
    assert r["chains"] == 2 and r["pair"] and r["splits"] == 2 and not r["fold"]
    with pytest.raises(ValueError, match="chains_pair must be one of"):
        plan_swapped(64, 4096, 7168, block_n=64, chains=2, chains_pair="yes")
    assert "chains" not in plan_swapped(64, 7168, 2048, block_n=64, chains=2, ahead=True)
    assert "chains" not in plan_swapped(16, 4096, 7168, block_n=64, chains=2)      # a pair at 16 tokens
    assert "chains" not in plan_swapped(16, 2048, 7168, block_n=64, chains=2)      # a fold
    assert swapped_block_n(32, 7168, 4096) == 128 and swapped_block_n(32, 7168, 4096, chains=True) == 64
    assert gemm_mxfp4.SWAPPED_CHAINS_WHERE == "any"
    assert swapped_block_n(64, 4096, 7168, chains=True, where="unsplit") == 128     # the 64-row plan splits
    assert swapped_block_n(16, 7168, 2048, chains=True, where="unsplit") == 128     # the 128-row plan pairs
    assert swapped_block_n(64, 24576, 1536, chains=True, where="unsplit") == 128    # ... has one split
    assert swapped_block_n(64, 4096, 7168, chains=True, where="split") == 64
    assert swapped_block_n(16, 7168, 2048, chains=True, where="split") == 128
    for m, n, k in ((64, 4096, 7168), (16, 7168, 2048), (64, 24576, 1536), (32, 7168, 4096)):
        assert swapped_block_n(m, n, k, chains=True, where="any") == 64, (m, n, k)
    for m, n, k in ((16, 4096, 7168), (16, 2048, 7168)):        # the 64-row plan pairs / folds: no chains
        assert swapped_block_n(m, n, k, chains=True, where="any") == 128, (m, n, k)
    assert swapped_block_n(64, 4096, 7168, where="any") == 128          # without the chains `where` is not read
    assert swapped_block_n(64, 4096, 7168, chains=True, ahead=True) == 128  # knobs that take the chains away
    assert swapped_block_n(64, 4096, 7168, chains=True, fold=True) == 128
    assert swapped_block_n(64, 24576, 1536, chains=True) == 64 and swapped_block_n(16, 4096, 7168, chains=True) == 128
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_WHERE", "split")
    assert swapped_block_n(64, 4096, 7168, chains=True) == 64 and swapped_block_n(16, 7168, 2048, chains=True) == 128
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_WHERE", "any")
    with pytest.raises(ValueError, match="where must be one of"):
        swapped_block_n(64, 4096, 7168, chains=True, where="split-k")
    for m, n, k in ((64, 7168, 2048), (32, 7168, 4096), (16, 7168, 2560), (64, 4096, 7168), (64, 2048, 7168)):
        q = plan_swapped(m, n, k, block_n=64, chains=2)
        src = mxfp4_swapped_program.source("sm_90a", n=n, k=k, **q)
        body = src.split('extern "C" __global__')[-1]
        assert body.count(".init(128);") == 2 * q["stages"] + 1, (m, n, k)    # full, empty, the preload's
        assert "(((int)threadIdx.x) >> 7)" in body and "tl::__sync_thread_partial(11, 256);" in body
        # a split's partial (whole rows), or C: from the pair (2 splits) through the other block's shared memory
        assert ("*(float4*)(Part + " in body) == (q["splits"] > 2), (m, n, k)
        assert body.count("tc_cluster_store_f32(") == (q["splits"] == 2), (m, n, k)
        chain_steps = k // 128 // q["splits"] // 2                            # a burst of 4, the tail it leaves
        assert body.count("tl::wgmma_rs<") >= 4 + chain_steps % 4, (m, n, k)
        sass, log = _sass_and_ptxas_log(src)
        assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == [], (m, n, k)
        assert not re.search(r"\b(LDL|STL)\b", sass)
    traced = mxfp4_swapped_program.source("sm_90a", n=7168, k=2048, trace=True, **p)   # bench.trace_mxfp4 --chains
    assert "% 128) == 0)" in traced.split('extern "C" __global__')[-1]     # a step's stamps by its chain's thread 0
    with pytest.raises(ValueError, match="chains must be 1, or 2 with block_n=64"):
        plan_swapped(64, 7168, 2048, chains=2)
    with pytest.raises(ValueError, match="chains must be 1 or 2; 2 takes block_n=64 and no fold, stage_out"):
        mxfp4_swapped_program.source("sm_90a", n=7168, k=2048, **{**p, "splits": 2, "fold": True})
    with pytest.raises(ValueError, match="ahead=True"):
        mxfp4_swapped_program.source("sm_90a", n=7168, k=2048, **{**p, "ahead": True})
    launched = []
    monkeypatch.setattr(gemm_mxfp4, "_launch_planned", lambda name, launchers, a, b, sfb, out, override, **kw:
                        launched.append(override))
    gemm_mxfp4._launch_swapped(torch.zeros(64, 2048), torch.zeros(7168, 1024), None, None)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS", False)
    gemm_mxfp4._launch_swapped(torch.zeros(64, 2048), torch.zeros(7168, 1024), None, None)
    assert launched[0]["chains"] is True and launched[1]["chains"] is False
    assert launched[0]["chains_pair"] is True       # (SWAPPED_CHAINS_PAIR: in the key too)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_WHERE", "unsplit")
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N_STEPS", 32)
    gemm_mxfp4._launch_swapped(torch.zeros(64, 2048), torch.zeros(7168, 1024), None, None)
    assert launched[0]["chains_where"] == "any" and launched[0]["block_n_steps"] == 16     # every switch the
    assert launched[2]["chains_where"] == "unsplit" and launched[2]["block_n_steps"] == 32  # rule reads: the key


def test_mxfp4_swapped_launchers_plan_by_the_width_rule(monkeypatch):
    """The launchers compile the plan of the width rule the key names (session 66: SWAPPED_CHAINS_SPLIT, read as a
    global but missing from the key, left a provider flipping it on the launchers of the op before it): "unsplit"
    keeps 128 rows at 64x4096x7168 and 16x7168x2048, "split" chains the first, "any" both; a forced width wins."""
    from ops import gemm_mxfp4

    compiled = []
    monkeypatch.setattr(gemm_mxfp4.mxfp4_swapped_program, "compile",
                        lambda target, **plan: compiled.append(plan) or _FakeKernel())
    monkeypatch.setattr("ops.gemm_fp8.split_k_launchers", lambda kernel, target, n, splits, dtype, fold=False:
                        (None, None))
    base = {"scale_tma": None, "decode": None, "fold": None, "ahead": None, "pair": None, "stage_out": None,
            "block_n": None, "chains": True, "block_n_steps": 16}
    want = {("unsplit", 64, 4096, 7168): 128, ("unsplit", 16, 7168, 2048): 128,
            ("split", 64, 4096, 7168): 64, ("split", 16, 7168, 2048): 128,
            ("any", 64, 4096, 7168): 64, ("any", 16, 7168, 2048): 64}
    for (where, m, n, k), rows in want.items():
        compiled.clear()
        gemm_mxfp4._swapped_launchers(torch.zeros(m, k), None, m, n, k, {**base, "chains_where": where})
        assert compiled[0].get("block_n", 128) == rows, (where, m, n, k)
        assert compiled[0].get("chains") == (2 if rows == 64 else None), (where, m, n, k)
    compiled.clear()
    gemm_mxfp4._swapped_launchers(torch.zeros(64, 7168), None, 64, 4096, 7168, {**base, "chains_where": "any",
                                                                               "block_n": 128})
    assert "block_n" not in compiled[0]


class _FakeKernel:
    def launcher(self):
        return None


def test_mxfp4_swapped_pair_folds_in_a_cluster_of_two(monkeypatch):
    """pair=True (2-split plans): the tile's two split blocks are a cluster; each stores the other's
    half of the tokens of its partial into the other's shared memory (tc_cluster_store_f32), one
    cluster barrier at the start and one before the sum, and no partials in global memory. The
    helper comes in the program's own import (one import_source a program). Plans pair only 2-split
    shapes, never fold then, and keep the received half within shared memory."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4 import SMEM_BUDGET, mxfp4_swapped_program, plan_swapped, swapped_scale_box

    p = plan_swapped(64, 7168, 2048, pair=True)
    assert p["pair"] and p["splits"] == 2 and not p["fold"]
    src = mxfp4_swapped_program.source("sm_90a", n=7168, k=2048, **p)
    body = src.split('extern "C" __global__')[-1]
    assert body.count("tc_cluster_store_f32(") == 1 and src.count("__device__ __forceinline__ void tc_cluster_store_f32") == 1
    assert body.count("__cluster_barrier_arrive();") == 2 and body.count("__cluster_barrier_wait();") == 2
    assert "Part[" not in body
    sass, log = _sass_and_ptxas_log(src)
    assert "0 bytes spill stores, 0 bytes spill loads" in log
    for m in (1, 16, 64):
        q = plan_swapped(m, 7168, 2048, pair=True)
        smem = (q["stages"] * (q["tokens"] * 128 * 2 + 128 * 64) + 128 * swapped_scale_box(8, 16) * 4
                + 128 * q["tokens"] // 2 * 4)
        assert q["pair"] and smem <= SMEM_BUDGET, (m, q)
    assert not plan_swapped(16, 4096, 7168, pair=True)["pair"]          # 4 splits: not a pair
    assert not plan_swapped(64, 7168, 2048)["pair"] or gemm_mxfp4.SWAPPED_PAIR
    # the rule (SWAPPED_PAIR None, the default): 2-split plans of <= 16 tokens pair, where they would fold
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_PAIR", None)
    assert all(plan_swapped(m, 7168, 2048)["pair"] for m in (1, 16))
    assert not any(plan_swapped(m, 7168, 2048)["pair"] for m in (17, 64))
    with pytest.raises(ValueError, match="needs splits == 2"):
        mxfp4_swapped_program.source("sm_90a", n=256, k=1024, tokens=16, splits=4, stages=4, pair=True)


def test_mxfp4_swapped_partials_out_through_shared_memory(monkeypatch):
    """stage_out=True (split plans): the partial goes into shared memory token-major (rows padded to
    132 words), one named barrier of the MMA threads (not a block-wide one: the producer warps have
    exited), then 16-byte stores of whole token rows; the plan takes its room from the stages."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4 import SMEM_BUDGET, mxfp4_swapped_program, plan_swapped, swapped_scale_box

    p = plan_swapped(64, 4096, 7168, stage_out=True)
    assert p["stage_out"] and p["stages"] == 7
    assert (p["stages"] * (64 * 256 + 128 * 64) + 128 * swapped_scale_box(14, 56) * 4 + 64 * 132 * 4
            <= SMEM_BUDGET)
    src = mxfp4_swapped_program.source("sm_90a", n=4096, k=7168, **p)
    body = src.split('extern "C" __global__')[-1]
    plain = mxfp4_swapped_program.source("sm_90a", n=4096, k=7168, **dict(p, stage_out=False))
    assert body.count("tl::__sync_thread_partial(11, 256);") == 1 and src.count("__syncthreads()") == plain.count(
        "__syncthreads()")
    assert re.search(r"\*\(float4\*\)\(Part \+ .*\) = \*\(float4\*\)\(\(\(float\*\)staged\)", body)
    sass, log = _sass_and_ptxas_log(src)
    assert "0 bytes spill stores, 0 bytes spill loads" in log
    assert not plan_swapped(64, 24576, 1536, stage_out=True)["stage_out"]      # one split: C is written directly
    # the rule (SWAPPED_STAGE_OUT None, the default): 64-token tiles with K split 4+ ways (measured faster
    # there only)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_STAGE_OUT", None)
    assert plan_swapped(64, 4096, 7168)["stage_out"] and plan_swapped(64, 2112, 7168)["stage_out"]
    assert not plan_swapped(64, 7168, 2048)["stage_out"] and not plan_swapped(32, 4096, 7168)["stage_out"]
    assert not plan_swapped(64, 7168, 2048, stage_out=True, pair=True)["stage_out"]
    with pytest.raises(ValueError, match="needs splits > 1 and pair=False"):
        mxfp4_swapped_program.source("sm_90a", n=256, k=1024, tokens=16, splits=1, stages=4, stage_out=True)


def test_mxfp4_swapped_trace_stamps_only_when_asked():
    """trace=True (bench.trace_mxfp4): the first MMA thread stamps the SM clock at the block's events
    and each step's data arrival and WGMMA issue into Trace[block]; without it no clock is read and
    the kernel is the production one."""
    from ops.gemm_mxfp4 import SWAPPED_TRACE_EVENTS, SWAPPED_TRACE_WORDS, mxfp4_swapped_program

    params = dict(n=256, k=1024, tokens=8, splits=2, stages=4)
    plain = mxfp4_swapped_program.source("sm_90a", **params)
    traced = mxfp4_swapped_program.source("sm_90a", **params, trace=True)
    assert "= clock()" not in plain and "= tc_globaltimer_lo()" not in plain
    stamps = re.findall(r"Trace\[.*?\] = clock\(\);", traced)
    ns = re.findall(r"Trace\[.*?\] = tc_globaltimer_lo\(\);", traced)
    # 4 block events + the epilogue's "scaled" and "sent" + 4 a step (data, decoded, launched, issued; the burst
    # and the tails are separate code paths, each stamped); the global timer at entry and stored
    assert len(stamps) >= 6 + 4 * 4 and len(ns) == 2 and len(SWAPPED_TRACE_EVENTS) == 9, (stamps, ns)
    assert f"* {SWAPPED_TRACE_WORDS})" in traced
    words = SWAPPED_TRACE_WORDS
    for event in ("scaled", "sent"):
        assert f"Trace[((((int)blockIdx.x) * {words}) + {SWAPPED_TRACE_EVENTS.index(event)})] = clock();" in traced
    # the pair fold stamps its exchange (past the cluster barrier) too
    paired = mxfp4_swapped_program.source("sm_90a", **params, pair=True, trace=True)
    for event in ("scaled", "sent", "exchanged"):
        assert f"Trace[((((int)blockIdx.x) * {words}) + {SWAPPED_TRACE_EVENTS.index(event)})] = clock();" in paired


def test_trace_mxfp4_summary_reads_the_stamps():
    """bench.trace_mxfp4's summary on a made-up trace: per-step work (issued - data) and data waits
    (data - previous issued) as medians over the blocks that ran every step, across the 32-bit
    clock's wrap; a block that ran no step is left out."""
    from bench.trace_mxfp4 import summarize
    from ops.gemm_mxfp4 import SWAPPED_STEP_EVENTS, SWAPPED_TRACE_EVENTS, SWAPPED_TRACE_WORDS

    base, per = len(SWAPPED_TRACE_EVENTS), len(SWAPPED_STEP_EVENTS)
    p = dict(stage_k=128, splits=1)

    NS0 = 2 ** 32 - 150

    def block(t0, work, wait, start_ns):
        row = [0] * SWAPPED_TRACE_WORDS
        t = t0
        row[0] = t
        t += 100
        row[1] = t                                  # prologue done
        t += 500                                    # the first data wait
        for s in range(3):
            if s:
                t += wait
            row[base + per * s] = t % 2 ** 32       # data
            row[base + per * s + 1] = (t + work // 2) % 2 ** 32     # decoded
            row[base + per * s + 2] = (t + work // 2 + 14) % 2 ** 32    # launched
            t += work
            row[base + per * s + 3] = t % 2 ** 32   # issued
        row[2] = t % 2 ** 32                        # loop done
        row[3] = (t + 40) % 2 ** 32                 # stored
        row[6] = (t + 5) % 2 ** 32                  # scaled
        row[7] = (t + 25) % 2 ** 32                 # sent (no "exchanged": not the fold's last block)
        row[4] = (NS0 + start_ns) % 2 ** 32         # entry ns: the global timer wraps between blocks
        row[5] = (NS0 + start_ns + (t + 40 - t0) // 2) % 2 ** 32    # stored ns (a 2 GHz SM clock)
        return [v - 2 ** 32 if v >= 2 ** 31 else v for v in row]   # int32 as the kernel writes it

    rows = [block(2 ** 32 - 700, 1000, 10, 60), block(5, 1000, 10, 0), block(9, 1200, 30, 200),
            [0] * SWAPPED_TRACE_WORDS]
    t = summarize(p, rows, k=384)
    assert t["blocks"] == 3 and t["steps"] == 3
    assert t["prologue"] == 100 and t["first data"] == 500 and t["epilogue"] == 40
    assert t["work"] == [1000, 1000, 1000] and t["wait"] == [10, 10]
    assert t["decode"] == [500] * 3 and t["launch"] == [14] * 3 and t["retire"] == [486] * 3
    # ns: block 1 enters first, block 2 last and it is the longest (4300 cycles at 2 GHz)
    assert t["entry spread ns"] == 200 and t["longest block ns"] == 2150 and t["span ns"] == 200 + 2150
    # block by block, by end: (end ns, block, split, first data, loop data waits, epilogue); block 3 ran no step
    assert [x[1] for x in t["block ends"]] == [1, 0, 2] and t["block ends"][-1] == (2350, 2, 0, 500, 60, 40)
    # the epilogue's parts, each over the blocks that stamped both ends (none stamped "exchanged": nan)
    parts = t["epilogue parts"]
    assert parts["loop done -> scaled"] == 5 and parts["scaled -> sent"] == 20
    assert math.isnan(parts["sent -> exchanged"]) and math.isnan(parts["exchanged -> stored"])


def test_mxfp4_swapped_plan_and_targets():
    """The swapped kernel's plans fit in shared memory (the staged scale rows padded to 16 bytes);
    it needs k % 512 (its scale rows are TMA'd: 16-byte strides), and it lowers only where the MMA
    reads an operand from registers (sm_90a)."""
    from ops.gemm_mxfp4 import SMEM_BUDGET, SWAPPED_TOKENS, mxfp4_swapped_program, plan_swapped, swapped_scale_box

    for m in (1, 8, 9, 33, 64):
        for n, k in ((7168, 2048), (4096, 7168), (24576, 1536), (7168, 16384), (128, 512), (24576, 57344)):
            p = plan_swapped(m, n, k)
            assert p["tokens"] == min(t for t in SWAPPED_TOKENS if t >= m)
            parts = p["stage_k"] // 128
            assert k % p["stage_k"] == 0
            per = -(-(k // p["stage_k"]) // p["splits"]) * parts
            smem = (p["stages"] * (p["tokens"] * p["stage_k"] * 2 + 128 * p["stage_k"] // 2)
                    + 128 * swapped_scale_box(per, k // 128) * 4)
            assert smem * p["blocks_per_sm"] <= SMEM_BUDGET, (m, n, k, p)
            assert p["blocks_per_sm"] == 1 and p["stage_k"] == 128
    # scale rows by TMA where a split stages more than 8 words a row
    assert plan_swapped(16, 4096, 7168)["scale_tma"] and not plan_swapped(64, 7168, 2048)["scale_tma"]
    # 32 (n) tiles over 132 SMs: 4 splits at one block an SM, 8 at two; no split where the tiles fill them
    assert plan_swapped(64, 4096, 7168)["splits"] == 4 and plan_swapped(1, 4096, 7168, blocks_per_sm=2)["splits"] == 8
    assert plan_swapped(64, 24576, 1536)["splits"] == 1
    # a K whose scale words would not fit next to two stages is split further, not refused
    long_k = plan_swapped(1, 24576, 57344)
    assert long_k["splits"] > 1 and long_k["stages"] >= 2
    # an asked-for stage depth of which not even two stages fit is refused, not shrunk
    with pytest.raises(ValueError, match="no swapped MXFP4 plan fits for m=64, n=7168, k=16384, stage_k=512"):
        plan_swapped(64, 7168, 16384, blocks_per_sm=2, stage_k=512)
    with pytest.raises(ValueError, match="sm_100a"):
        mxfp4_swapped_program.source("sm_100a", n=256, k=512)
    with pytest.raises(ValueError, match="k % 512 == 0"):
        plan_swapped(8, 256, 1152)
    with pytest.raises(ValueError, match="decode must be one of"):
        plan_swapped(8, 256, 1024, decode="v8")


def test_swapped_ramp_asks_for_the_first_stages_alone():
    """ramp=2 (an experiment): the producer waits for step 0's tiles before it asks for step 2's;
    ramp=0 (the default) leaves the producer loop as it was; a ramp of `stages` or more is refused."""
    from ops.gemm_mxfp4 import mxfp4_swapped_program

    params = dict(n=256, k=2048, tokens=16, splits=2, stages=4)
    plain = mxfp4_swapped_program.source("sm_90a", **params)
    ramped = mxfp4_swapped_program.source("sm_90a", **params, ramp=2)
    assert "if (s == 2)" not in plain
    assert re.search(r"if \(s == 2\) \{\s*v_\d+\[0\]\.wait\(0\);", ramped), ramped[:3000]
    with pytest.raises(ValueError, match="ramp must be in"):
        mxfp4_swapped_program.source("sm_90a", **params, ramp=4)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode) on Python ints: byte i of the result is byte (sel nibble i) & 7 of
    b:a, or that byte's sign bit replicated when the nibble's bit 3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
    return out


def test_v7_decode_bits_equal_v6_for_every_byte_and_place():
    """The v7 fragment decode (one permute in sign mode, a shift, one mask) gives the v6 bits (the
    byte alone, two multiplies, two masks; exact on the GPU) for every code byte at every place c,
    whatever the word's other bytes are: emulated here bit for bit from the helper's C."""
    import random

    rnd = random.Random(0)
    M = 0xFFFFFFFF
    for c in range(4):
        sel = (c * 0x1111 + 0xC480) & 0xFFFF
        for x in range(256):
            for other in (0x00000000, 0xFFFFFFFF, 0x88888888, *(rnd.getrandbits(32) for _ in range(6))):
                w = (other & ~(0xFF << (8 * c)) & M) | (x << (8 * c))
                b = x                                                   # __byte_perm(w, 0, 0x4440 + c)
                v6 = (((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & 0x80008000)) & M
                v7 = ((_prmt((w * 16) & M, w, sel) * 4) & M) & 0x81C081C0
                assert v7 == v6, (c, x, hex(w))
    # and the bits are e2m1 * 2^-126 in bf16 (lane 0 the low code): read back through bf16
    import struct

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for x in range(256):
        v = ((x * 0x40040) & 0x01C001C0) | ((x * 0x1001000) & 0x80008000)
        for lane, code in ((0, x & 0xF), (1, x >> 4)):
            half = (v >> (16 * lane)) & 0xFFFF
            val = struct.unpack(">f", struct.pack(">I", half << 16))[0] * 2.0 ** 126
            assert val == (-1 if code & 8 else 1) * e2m1[code & 7], (x, lane)


def test_swapped_v7_decode_builds_with_fewer_alu_ops():
    """decode="v7" (built, not yet run on a GPU): the swapped kernel's K loop keeps its WGMMAs from
    registers with no spills, and has fewer LOP3 than v6's."""
    from ops.gemm_mxfp4 import mxfp4_swapped_program

    params = dict(n=256, k=1024, tokens=16, splits=1, stages=4)
    counts = {}
    for decode in ("v6", "v7"):
        src = mxfp4_swapped_program.source("sm_90a", **params, decode=decode)
        assert f"tc_e2m1_fragment<{'true' if decode == 'v7' else 'false'}>(" in src
        loop = _innermost_mma_loop(_tma_wgmma_sass(src, "HGMMA"), "HGMMA")
        counts[decode] = sum(t.split()[0].startswith("LOP3") or " LOP3" in t for t in loop)
    assert counts["v7"] < counts["v6"] * 0.7, counts


def test_swapped_scale_boxes_start_aligned_and_stay_in_the_row():
    """Each split's staged scale box (TMA) starts 16-byte aligned in the row (a box starting mid-group
    faulted on the GPU), ends inside it, and holds the split's words: the kernel's start formula."""
    from ops.gemm_mxfp4 import swapped_scale_box

    for kb in (4, 8, 12, 16, 56, 128):
        for splits in range(1, kb + 1):
            per = -(-kb // splits)
            box = swapped_scale_box(per, kb)
            assert box % 4 == 0 and box <= kb, (kb, splits, box)
            for ts in range(splits):
                w0 = ts * per
                steps = max(0, min(per, kb - w0))
                s0 = min(w0 // 4 * 4, kb - box)
                assert s0 % 4 == 0 and 0 <= s0 and s0 + box <= kb, (kb, splits, ts)
                if steps:
                    assert s0 <= w0 and w0 - s0 + steps <= box, (kb, splits, ts, s0, box)


def test_burst_loop_is_guarded_where_a_split_has_no_full_burst():
    """sm90.in_bursts guards its loop of 4-step bursts: 128 x 2048 x 6272 plans 8 splits of 7 K steps
    and an empty last one, and TileLang, bounding steps // 4 by 1, emits the loop's body once; unguarded
    the empty split's MMA threads waited for tiles never loaded (a hang; bench/NOTES.md "MXFP4 v6")."""
    from ops.gemm_mxfp4 import mxfp4_gemm_program, plan

    p = plan(128, 2048, 6272)
    assert p["splits"] == 8 and 49 - 7 * 7 == 0           # the last split has no K step
    lines = mxfp4_gemm_program.source("sm_90a", n=2048, k=6272, **p).splitlines()
    mma = next(i for i, line in enumerate(lines) if "warpgroup_reg_alloc" in line)
    first_wait = next(i for i in range(mma, len(lines)) if re.search(r"\]\.wait\(0\);", lines[i]))
    assert any(line.strip().startswith("if (") for line in lines[first_wait - 2:first_wait]), \
        "\n".join(lines[first_wait - 4:first_wait + 1])


def _assert_block_scaled_sm100a(src):
    """The sm_100a build of a native MXFP4 source: block-scaled tcgen05 MMAs (UTCQMMA), the E8M0 scale words
    copied to tensor memory (UTCCP), no spills."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    try:
        st = sass_stats(build_cubin(src, "sm_100a"), "sm_100a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert st.histogram.get("UTCQMMA", 0) > 0 and st.histogram.get("UTCCP", 0) > 0 and st.spill_stores == 0


def test_mxfp4_native_sm100a_is_block_scaled_tcgen05():
    """The sm_100a native MXFP4 program (tile.mma_block_scaled_loop): e4m3 x e2m1 block-scaled
    tcgen05 MMAs (UTCQMMA) with the E8M0 scale words copied to tensor memory (UTCCP), no spills;
    its instruction descriptor says A e4m3, B e2m1, UE8M0 scales, M = N = 128. Compiled only: no
    sm_100a device has run it. Targets without block-scaled tensor cores refuse it."""

    from ops.gemm_mxfp4_native import mxfp4_native_program

    src = mxfp4_native_program.source("sm_100a", n=4096, k=7168)
    desc = int(re.search(r"tcgen05mma_blockscaled_ss<tl::DataType::kFloat8_e4m3, false>\(.*?static_cast<uint32_t>"
                         r"\(\(\((\d+)", src).group(1))
    assert (desc >> 7) & 7 == 0 and (desc >> 10) & 7 == 5           # A e4m3, B e2m1 (kind::mxf8f6f4)
    assert (desc >> 17) & 63 == 128 >> 3 and (desc >> 27) & 3 == 128 >> 7 and (desc >> 23) & 1 == 1
    with pytest.raises(ValueError, match="sm_100a"):
        mxfp4_native_program.source("sm_90a", n=4096, k=7168)
    _assert_block_scaled_sm100a(src)


def test_mxfp4_native_ascend_is_the_cube_block_scaled_mad():
    """ascend:950 (codegen/lowering/ascend_block_scaled.py; generated Ascend C, no device): the same native
    program on the Cube's block-scaled MAD, e4m3 x e4m3 with the E8M0 scale bytes in L1: A, B and both scale
    tiles go straight from global memory to L1 each step; the epilogue's vector cores store half the rows each.
    Its MAD takes one dtype, and e2m1 cannot be widened on chip there, so e2m1 B is refused by name."""
    from ops.gemm_mxfp4_native import mxfp4_native_program

    src = mxfp4_native_program.source("ascend", n=4096, k=7168, b_format="e4m3")
    assert "ascend_blockscaled_gemm_l1<128, 128, 128, 128, true, 2, float8_e4m3_t, uint8_t, float>" in src
    aic = src[src.index("if ASC_IS_AIC"):src.index("if ASC_IS_AIV")]
    loop = aic[aic.index("for ("):]
    assert loop.count("asc_copy_gm2l1_nd2nz") == 2 and loop.count("asc_copy_gm2l1_dn2nz") == 2   # A, B; SFA, SFB
    assert "asc_get_sub_block_id() * 64" in src
    with pytest.raises(ValueError, match="widen_e2m1_to_e4m3"):
        mxfp4_native_program.source("ascend", n=4096, k=7168)


@pytest.mark.parametrize("mode", ["contiguous", "masked"])
def test_grouped_mxfp4_native_is_block_scaled_on_sm100a_and_ascend(mode):
    """The grouped layouts on block-scaled MMAs (mxfp4_grouped_native_program; compiled only): on sm_100a the
    e4m3 x e2m1 UTCQMMA with UTCCP scale copies, no spills; on ascend:950 the Cube's block-scaled MAD on widened
    weights. A tile whose rows are not computed (padding, past masked_m) stores zeros: the store selects on
    the step count and the row's group or mask."""
    from ops.gemm_mxfp4_native import mxfp4_grouped_native_program

    src = mxfp4_grouped_native_program.source("ascend", n=4096, k=7168, mode=mode, b_format="e4m3")
    assert "ascend_blockscaled_gemm_l1<128, 128, 128, 128, true, 2, float8_e4m3_t, uint8_t, float>" in src
    store = src[src.index("simt_vf"):src.index("__global__")]   # the vector cores' store selects each row
    if mode == "masked":   # against the group's MaskedM, read once into `limit`
        assert "MaskedM[" in src and re.search(r"<\s*limit\b", store)
    else:                  # against its row's group id
        assert "MIdx[" in store
    src = mxfp4_grouped_native_program.source("sm_100a", n=4096, k=7168, mode=mode)
    assert "tcgen05mma_blockscaled_ss<tl::DataType::kFloat8_e4m3" in src
    _assert_block_scaled_sm100a(src)


def test_grouped_mxfp4_native_op_checks_and_fakes():
    """The grouped native path is a custom op with a fake; mx_scale_words keeps the groups' dimension."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ops.gemm_mxfp4_native import _mxfp4_grouped_native_op, mx_scale_words

    s = torch.arange(2 * 3 * 8, dtype=torch.uint8).view(2, 3, 8)
    w = mx_scale_words(s, 4)
    assert w.shape == (2, 2, 4)
    for g in range(2):
        assert torch.equal(w[g], mx_scale_words(s[g].contiguous(), 4))
    with FakeTensorMode():
        out = _mxfp4_grouped_native_op("masked", torch.empty(2, 64, 256, dtype=torch.float8_e4m3fn),
                                       torch.empty(2, 64, 8, dtype=torch.uint8), torch.empty(2, 128, 128, dtype=torch.uint8),
                                       torch.empty(2, 128, 8, dtype=torch.uint8), torch.empty(2, dtype=torch.int32))
    assert out.shape == (2, 64, 128) and out.dtype == torch.bfloat16


def test_plain_decode_is_the_exact_dequant():
    """_decode_rows, the decode the vector cores run on ascend:950 (plain TileLang, no CUDA helpers), run on the
    cpu target: every code of random words, low nibble first, times 2^(E8M0 - 127) of its 32-column block,
    equals dequant_mxfp4 bit for bit (signs and zeros included), E8M0 0 (2^-127), 254 and 255 (NaN) among them."""
    import tilelang.language as T

    from codegen import tile
    from codegen.program import tile_program
    from ops.gemm_mxfp4 import _decode_rows

    rows, block_k, steps = 8, 128, 2

    @tile_program("test_plain_decode", targets=("cpu",))
    def program():
        @T.prim_func
        def main(Raw: T.Tensor((steps, rows, block_k // 8), "int32"), SW: T.Tensor((steps, rows), "int32"),
                 Out: T.Tensor((steps, rows, block_k), "float32")):
            with tile.grid(1, 1):
                sw = tile.stage((steps, rows), "int32")
                dst = tile.stage((rows, block_k), "float32")
                for si, i in tile.parallel(steps, rows):
                    sw[si, i] = SW[si, i]
                for s in T.serial(steps):
                    _decode_rows(lambda i, w: Raw[s, i, w], dst, sw, s, 0, block_k)
                    for i, c in tile.parallel(rows, block_k):
                        Out[s, i, c] = dst[i, c]
        return main

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (rows, steps * block_k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (rows, steps * block_k // 32), dtype=torch.uint8, generator=g)
    scales[0, 0], scales[1, 1], scales[2, 2], scales[3, 3] = 0, 255, 254, 1
    ref = ops.dequant_mxfp4(packed, scales)
    out = torch.zeros(steps, rows, block_k)
    program.compile("cpu")(packed.view(torch.int32).view(rows, steps, block_k // 8).transpose(0, 1).contiguous(),
                           scales.view(torch.int32).view(rows, steps).t().contiguous(), out)
    got = out.transpose(0, 1).reshape(rows, steps * block_k)
    assert torch.equal(got.isnan(), ref.isnan()) and ref.isnan().any()
    assert torch.equal(got.nan_to_num(), ref.nan_to_num()) and torch.equal(got.signbit(), ref.signbit())


@pytest.mark.parametrize("name,params", [("mxfp4_gemm_nt", dict(n=4096, k=7168)),
                                         ("mxfp4_gemm_nt", dict(n=7168, k=2048, block_m=64, splits=2)),
                                         ("mxfp4_gemm_nt_grouped", dict(n=4096, k=7168, mode="contiguous")),
                                         ("mxfp4_gemm_nt_grouped", dict(n=4096, k=7168, mode="masked", block_m=64))])
def test_ascend_mxfp4_decodes_in_the_vector_cores(name, params):
    """ascend:950 (codegen/lowering/ascend_decoded.py; generated Ascend C, no device): the decoded-tile programs
    with bf16 a. Each vector core decodes its 64 of the tile's 128 rows into UB with the plain decode (no CUDA
    helper in the source), a dual copy puts them into L1 (ND -> NZ), and the Cube multiplies in bf16."""
    from codegen import program

    src = program.get(name).source("ascend", **params)
    bm = params.get("block_m", 128)
    assert f"ascend_gemm_l1<{bm}, 128, 128, 128, true, bfloat16_t>" in src
    aiv = src[src.index("if ASC_IS_AIV"):]
    assert "ascend_nd2nz_scatter<64, 128, bfloat16_t, bfloat16_t>" in aiv and "asc_copy_ub2l1" in aiv
    assert "tc_e2m1" not in src and "asc_get_sub_block_id() * 64" in src


def test_widened_e2m1_weights_hold_the_same_values():
    """widen_e2m1_to_e4m3 (the Ascend native path's weights): every packed byte's two codes, low nibble first,
    as e4m3 of the same value and sign (-0 included); the E8M0 scales apply unchanged."""
    from ops.gemm_mxfp4_native import widen_e2m1_to_e4m3

    every = torch.arange(256, dtype=torch.uint8).view(8, 32)
    ref = ops.dequant_mxfp4(every, torch.full((8, 2), 127, dtype=torch.uint8))
    wide = widen_e2m1_to_e4m3(every)
    assert wide.shape == (8, 64) and wide.dtype == torch.float8_e4m3fn
    assert torch.equal(wide.float(), ref) and torch.equal(wide.float().signbit(), ref.signbit())
    b, sfb = ops.quant_mxfp4(torch.randn(128, 256))
    assert torch.equal(ops.dequant_mx_fp8(widen_e2m1_to_e4m3(b), sfb), ops.dequant_mxfp4(b, sfb))
    with pytest.raises(TypeError, match="b"):
        widen_e2m1_to_e4m3(b.view(torch.int8))


def test_mx_scale_words_for_the_native_kernel():
    """Word (s, r) of the native kernel's scales: row r's 4 E8M0 bytes of K step s, little-endian
    (byte j scales K values 128s + 32j ..), step-major; padding rows hold 2^0 (127)."""
    from ops.gemm_mxfp4_native import mx_scale_words

    s = torch.arange(3 * 8, dtype=torch.uint8).view(3, 8)
    w = mx_scale_words(s, 4)
    assert w.shape == (2, 4) and w.dtype == torch.int32
    for step in range(2):
        for r in range(3):
            assert [(int(w[step, r]) >> (8 * j)) & 0xFF for j in range(4)] == s[r, 4 * step:4 * step + 4].tolist()
    assert (w[:, 3] == 0x7F7F7F7F).all()
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        mx_scale_words(torch.zeros(3, 6, dtype=torch.uint8))


def test_mxfp4_native_op_has_a_fake_implementation():
    """The sm_100a native path is a torch custom op like the others: its fake gives the output's
    shape and dtype without running anything (torch.compile traces through it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ops.gemm_mxfp4_native import _mxfp4_native_op

    with FakeTensorMode():
        out = _mxfp4_native_op(torch.empty(5, 256, dtype=torch.float8_e4m3fn), torch.empty(128, 128, dtype=torch.uint8),
                               torch.empty(128, 8, dtype=torch.uint8), torch.empty(5, 8, dtype=torch.uint8))
    assert out.shape == (5, 128) and out.dtype == torch.bfloat16


def test_setmaxnreg_splits_fit_the_launch_allocation(monkeypatch):
    """setmaxnreg moves registers inside the block: every sm_90a rule checks that its warpgroups ask
    for no more than the launch gave (512 MMA threads asking for 120, and the MLA producer at 104,
    hung the H200), and the decoded loop sizes its MMA warpgroups' share from it."""
    import codegen.lowering.sm90_attention as att
    from codegen.lowering.sm90 import check_register_split
    from codegen.lowering.sm90_decoded import consumer_regs
    from ops.mla_decode import mla_decode_program

    assert consumer_regs(256) == 240 and consumer_regs(512) == 112
    check_register_split(640, [(128, 24), (512, 112)])
    with pytest.raises(ValueError, match="needs 64512 registers, the launch of 640 threads gives 61440"):
        check_register_split(640, [(128, 24), (512, 120)])
    mla = dict(h_q=16, s_q=1, page=64, kv_format="fp8", block_n=32, stages=2, raw_stages=3)
    assert "reg_dealloc<80>" in mla_decode_program.source("sm_90a", **mla)
    monkeypatch.setattr(att, "PRODUCER_REGS", 104)
    with pytest.raises(ValueError, match="setmaxnreg split"):
        mla_decode_program.source("sm_90a", **mla)


def test_fp8_views_that_do_not_start_16_byte_aligned(off_alignment):
    """The FP8 kernels TMA a and b and store out 16 bytes a thread: a view of one that starts off 16
    bytes is a ValueError naming it; a scale view is copied to an aligned tensor of the same values."""
    from ops.gemm_fp8 import _aligned_scales

    off = off_alignment
    a = torch.randn(4, 256).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256).to(torch.float8_e4m3fn)
    sfa, sfb, out = torch.rand(4, 2), torch.rand(1, 2), torch.empty(4, 128, dtype=torch.bfloat16)
    sfa2, sfb2 = _aligned_scales(a, off(sfa, 4), b, off(sfb, 8), out)
    assert sfa2.data_ptr() % 16 == 0 and sfb2.data_ptr() % 16 == 0
    assert torch.equal(sfa2, sfa) and torch.equal(sfb2, sfb)
    assert _aligned_scales(a, sfa, b, sfb, out)[0] is sfa
    for name, args in (("a", (off(a, 8), sfa, b, sfb, out)), ("b", (a, sfa, off(b, 1), sfb, out)),
                       ("out", (a, sfa, b, sfb, off(out, 2)))):
        with pytest.raises(ValueError, match=f"^{name} must start 16-byte aligned"):
            _aligned_scales(*args)


def test_mxfp4_scale_words_need_4_byte_alignment():
    from ops.gemm_mxfp4 import _scale_words

    buf = torch.arange(1 + 128 * 4, dtype=torch.int32).to(torch.uint8)
    words = _scale_words(buf[:512].view(128, 4))
    assert words.shape == (128, 1) and int(words[1, 0]) & 0xFF == 4        # byte 0 of row 1, little-endian
    with pytest.raises(ValueError, match="sfb must start 4-byte aligned"):
        _scale_words(buf[1:].view(128, 4))


def test_mxfp4_programs_split_the_decode_evenly():
    """256 MMA threads decode 64 values each a step, 512 decode 32 (four MMA warpgroups, one scale
    group a thread); any other count is an error, not idle or doubled decode work."""
    from ops.gemm_mxfp4 import mxfp4_gemm_program, mxfp4_grouped_program

    for bad in (128, 384, 1024):
        with pytest.raises(ValueError, match=f"threads = 256 or 512\\), got {bad}"):
            mxfp4_gemm_program.source("sm_90a", n=256, k=512, threads=bad)
    with pytest.raises(ValueError, match="got 128"):
        mxfp4_grouped_program.source("sm_90a", n=256, k=512, mode="masked", threads=128)
    src = mxfp4_gemm_program.source("sm_90a", n=256, k=512, block_m=64, threads=512)
    assert "tc_e2m1x32_store(" in src and "tc_e2m1x64_store(" not in src.split("tc_e2m1x32_store(void")[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 7168, 2048), (64, 4096, 7168), (200, 256, 512), (1024, 2048, 7168)])
def test_gpu_mxfp4(m, n, k):
    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, k, generator=g).bfloat16()
    packed, scales = ops.quant_mxfp4(torch.randn(n, k, generator=g))
    out = ops.mxfp4_gemm_nt(a.cuda(), packed.cuda(), scales.cuda())
    ref = a.float() @ ops.dequant_mxfp4(packed, scales).T
    assert calc_diff(out.cpu(), ref) < 1e-5
    assert_elementwise(out.cpu(), ref)


def _extreme_mxfp4_case(m, n, k, seed, big=True):
    """(a, packed, scales, fp32 reference): bf16 activations, every e2m1 code (random bytes) and E8M0 scales from the
    subnormal 2^-127 up (big: some over 2^1, up to 2^27, the two-multiply decode; else at most 2^1 = byte 128, the
    one-factor decode), the last row's last block 2^-127 too."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150 if big else 129, (n, k // 32), generator=g, dtype=torch.uint8)
    scales[0, :3] = torch.tensor([0, 1, 154 if big else 128], dtype=torch.uint8)   # 2^-127 (subnormal), 2^-126, 2^27 or 2^1
    scales[n - 1, -1] = 0
    return a, packed, scales, a.float() @ ops.dequant_mxfp4(packed, scales).T


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,big", [(1, 7168, 2048, True), (5, 256, 1536, True), (16, 4096, 7168, True),
                                       (33, 384, 2048, True), (64, 4096, 7168, True), (64, 24576, 1536, True),
                                       (16, 4096, 7168, False), (64, 512, 2048, False)])
def test_gpu_mxfp4_swapped_register_decode(m, n, k, big, monkeypatch):
    """The swapped kernel (decode-sized m on sm_90a: weights decoded into WGMMA register fragments,
    tokens as N): every e2m1 code (random bytes), scales from the subnormal 2^-127 up (big: some
    over 2^1, the two-multiply decode; else at most 2^1 = byte 128, the one-factor decode), each
    token tile (8 .. 64) with m tails, split-K or not; exact against fp32 and bitwise the same run
    to run; and within the same bounds as the decoded-tile kernel."""
    from backends.cuda.device import sm_count
    from ops import gemm_mxfp4

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 7 + n, big)
    assert gemm_mxfp4.SWAPPED and m <= gemm_mxfp4.SWAPPED_TOKENS[-1]
    args = (a.cuda(), packed.cuda(), scales.cuda())
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)
    # the scale rows by TMA or by the MMA threads (SWAPPED_SCALE_TMA), the v6 or v7 decode
    # (SWAPPED_DECODE): the same bits
    flags = gemm_mxfp4.SWAPPED_SCALE_TMA, gemm_mxfp4.SWAPPED_DECODE
    try:
        for forced in (True, False):
            for decode in gemm_mxfp4.SWAPPED_DECODES:
                gemm_mxfp4.SWAPPED_SCALE_TMA, gemm_mxfp4.SWAPPED_DECODE = forced, decode
                assert torch.equal(ops.mxfp4_gemm_nt(*args).cpu(), runs[0]), (forced, decode)
    finally:
        gemm_mxfp4.SWAPPED_SCALE_TMA, gemm_mxfp4.SWAPPED_DECODE = flags
    # split-K partials added in the kernel (the tile's last block), by the reduce kernel or by a cluster
    # pair (the default for 2-split plans of <= 16 tokens), raw words loaded a step ahead of their decode
    # or not, the partials out through shared memory or not: the same bits
    # (at the default's block width: without fold or pair, the 64-row rule would take a split away, other sums)
    names = "SWAPPED_FOLD", "SWAPPED_AHEAD", "SWAPPED_STAGE_OUT", "SWAPPED_PAIR"
    saved = [getattr(gemm_mxfp4, f) for f in names]
    # (and the chains' sums where the knobs keep them: ahead, or a fold of a split, takes them away, other sums)
    width = gemm_mxfp4.swapped_block_n(m, n, k, sms=sm_count(args[0]), chains=gemm_mxfp4.SWAPPED_CHAINS)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", width)
    chains = 2 if width == 64 and gemm_mxfp4.SWAPPED_CHAINS else 1
    chained = gemm_mxfp4.plan_swapped(m, n, k, sms=sm_count(args[0]), block_n=width, chains=chains).get("chains")
    try:
        for flags in ((True, False, False, False), (False, False, False, False), (None, True, False, None),
                      (False, False, True, False), (True, False, True, False), (None, False, None, None)):
            for f, v in zip(names, flags):
                setattr(gemm_mxfp4, f, v)
            knobs = dict(zip(("fold", "ahead", "stage_out", "pair"), flags))
            p = gemm_mxfp4.plan_swapped(m, n, k, sms=sm_count(args[0]), block_n=width, chains=chains, **knobs)
            got = ops.mxfp4_gemm_nt(*args).cpu()
            if p.get("chains") == chained:
                assert torch.equal(got, runs[0]), flags
            else:
                assert calc_diff(got, ref) < 1e-5 and torch.equal(got, ops.mxfp4_gemm_nt(*args).cpu()), flags
                assert_elementwise(got, ref)
    finally:
        for f, v in zip(names, saved):
            setattr(gemm_mxfp4, f, v)
    gemm_mxfp4.SWAPPED = False
    try:
        tiled = ops.mxfp4_gemm_nt(*args).cpu()
    finally:
        gemm_mxfp4.SWAPPED = True
    assert calc_diff(tiled, ref) < 1e-5
    assert_elementwise(tiled, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (64, 4096, 7168), (16, 4096, 7168), (33, 384, 2048),
                                   (9, 7168, 2048), (32, 7168, 4096)])
def test_gpu_mxfp4_swapped_64_row_blocks(m, n, k, monkeypatch):
    """SWAPPED_BLOCK_N = 64 forced, SWAPPED_CHAINS off (one MMA warpgroup a block; bench provider tilecraft-swapped-n64,
    whose op has the chains on where they apply): one split with no reduce
    kernel (64x7168x2048), 2 splits by the reduce kernel (64x4096x7168) or by a cluster pair (16x4096x7168), m tails:
    exact against fp32 as the 128-row blocks are, and bitwise the same run to run (the sums' order differs from the
    128-row plan's where the split count does, so not bitwise against it). The default (SWAPPED_BLOCK_N None) gives
    these bits where its rule picks 64 rows (64x7168x2048) and not where it picks 128 (64x4096x7168, 32x7168x4096)."""
    from backends.cuda.device import sm_count
    from ops import gemm_mxfp4

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 5 + n)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS", False)       # one warpgroup a 64-row block (chains: their test)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", 64)
    assert gemm_mxfp4.WARP_TOKENS < m <= gemm_mxfp4.SWAPPED_TOKENS[-1]
    args = (a.cuda(), packed.cuda(), scales.cuda())
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", None)
    by_rule = ops.mxfp4_gemm_nt(*args).cpu()
    rule = gemm_mxfp4.swapped_block_n(m, n, k, sms=sm_count(args[0]))
    assert rule == (64 if (m, n, k) == (64, 7168, 2048) else 128), rule
    if rule == 64:
        assert torch.equal(by_rule, runs[0])
    assert calc_diff(by_rule, ref) < 1e-5
    assert_elementwise(by_rule, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (33, 7168, 4096), (40, 7168, 2560), (9, 7168, 2048),
                                   (64, 384, 2048), (16, 4096, 7168)])
def test_gpu_mxfp4_swapped_chains(m, n, k, monkeypatch):
    """SWAPPED_CHAINS on (the default: two MMA warpgroups on alternate K steps of 64-row blocks): where the rule picks
    64 rows (SWAPPED_CHAINS_WHERE "any": 64x7168x2048, 33x7168x4096, 40x7168x2560 whose chains end in a tail burst,
    a 16-token tile at 7168x2048, 384 columns in split chains) the op runs the chains, exact against fp32 with extreme
    scales and bitwise the same run to run; elsewhere (16 tokens at 4096x7168: the 64-row plan pairs) the bits of the
    op with the switch off."""
    from backends.cuda.device import sm_count
    from ops import gemm_mxfp4

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 3 + n)
    args = (a.cuda(), packed.cuda(), scales.cuda())
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS", False)
    want = ops.mxfp4_gemm_nt(*args).cpu()
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS", True)
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)
    chained = gemm_mxfp4.swapped_block_n(m, n, k, sms=sm_count(args[0]), chains=True) == 64
    assert chained == ((m, n, k) != (16, 4096, 7168)), (m, n, k)
    if not chained:
        assert torch.equal(runs[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("where,m,n,k", [("split", 64, 4096, 7168), ("split", 33, 4096, 7168),
                                         ("split", 64, 2048, 7168), ("any", 16, 7168, 2048), ("any", 13, 7168, 2048),
                                         ("any", 64, 24576, 1536), ("any", 40, 24576, 1536)])
def test_gpu_mxfp4_swapped_chains_wider(where, m, n, k, monkeypatch):
    """SWAPPED_CHAINS_WHERE beyond "unsplit": "split", 64-row chained blocks that still split K (2 or 4 splits, m
    tails), their partials summed by the reduce kernel; "any", the chains also where the 128-row plan pairs (16-token
    tiles) or has one split (24576x1536). Exact against fp32 with extreme scales, bitwise the same run to run and the
    same bits as the 64-row width forced (the plan the launchers compile)."""
    from backends.cuda.device import sm_count
    from ops import gemm_mxfp4

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 11 + n)
    args = (a.cuda(), packed.cuda(), scales.cuda())
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_WHERE", where)
    assert gemm_mxfp4.swapped_block_n(m, n, k, sms=sm_count(args[0]), chains=True) == 64
    assert gemm_mxfp4.swapped_block_n(m, n, k, sms=sm_count(args[0]), chains=True, where="unsplit") == 128
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", 64)
    assert torch.equal(ops.mxfp4_gemm_nt(*args).cpu(), runs[0])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)


@pytest.mark.gpu
@pytest.mark.parametrize("value,m,n,k", [(True, 64, 4096, 7168), (True, 33, 4096, 7168), (True, 17, 4096, 7168),
                                         (True, 40, 256, 1024), (True, 24, 512, 1024), ("all", 16, 4096, 7168),
                                         ("all", 5, 4096, 7168)])
def test_gpu_mxfp4_swapped_chains_pair_is_the_reduce(value, m, n, k, monkeypatch):
    """Chained 2-split plans folding in clusters of their two blocks (SWAPPED_CHAINS_PAIR): the bits of the same plan
    with its partials summed by the reduce kernel, the same run to run and in a CUDA graph, exact against fp32 with
    extreme scales; m tails where one of the second block's tokens is a row (17 of a 32-token tile) or some are
    (33, 40 of 64, 24 of 32); scale rows by TMA (k = 7168) and loaded by the MMA threads (k = 1024). "all": the
    chains' pair also at 5-16 tokens, where the 64-row plan pairs (the reference: the same chained plan with the
    pair and fold rules off, through the reduce kernel)."""
    from backends.cuda.device import sm_count
    from ops import gemm_mxfp4

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 7 + n)
    args = (a.cuda(), packed.cuda(), scales.cuda())
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", 64)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_PAIR", value)
    p = gemm_mxfp4.plan_swapped(m, n, k, sms=sm_count(args[0]), block_n=64, chains=2)
    assert p.get("chains") == 2 and p["splits"] == 2 and p["pair"], p
    for name, off in (("SWAPPED_CHAINS_PAIR", False), ("SWAPPED_PAIR", False), ("SWAPPED_FOLD", False)):
        monkeypatch.setattr(gemm_mxfp4, name, off)
    assert gemm_mxfp4.plan_swapped(m, n, k, sms=sm_count(args[0]), block_n=64, chains=2).get("chains") == 2
    want = ops.mxfp4_gemm_nt(*args).cpu()
    for name, on in (("SWAPPED_CHAINS_PAIR", value), ("SWAPPED_PAIR", None), ("SWAPPED_FOLD", None)):
        monkeypatch.setattr(gemm_mxfp4, name, on)
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], want) and torch.equal(runs[1], want)
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)
    _assert_graph_replays(lambda: ops.mxfp4_gemm_nt(*args), want.cuda())


@pytest.mark.gpu
def test_gpu_mxfp4_swapped_fold_in_a_cuda_graph():
    """The in-kernel split-K fold replayed in a CUDA graph: every replay gives the reduce kernel's
    bits (the arrival counters go back to 0 after each run), with the m tail of a 16-token tile."""
    from ops import gemm_mxfp4

    g = torch.Generator().manual_seed(5)
    m, n, k = 13, 4096, 7168
    a = torch.randn(m, k, generator=g).bfloat16().cuda()
    packed, scales = (t.cuda() for t in ops.quant_mxfp4(torch.randn(n, k, generator=g)))
    saved = gemm_mxfp4.SWAPPED_FOLD
    try:
        gemm_mxfp4.SWAPPED_FOLD = False
        want = ops.mxfp4_gemm_nt(a, packed, scales)
        gemm_mxfp4.SWAPPED_FOLD = True
        assert gemm_mxfp4.plan_swapped(m, n, k)["splits"] > 1
        ops.mxfp4_gemm_nt(a, packed, scales)            # compiled outside the capture
        _assert_graph_replays(lambda: ops.mxfp4_gemm_nt(a, packed, scales), want)
    finally:
        gemm_mxfp4.SWAPPED_FOLD = saved


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 7168, 2048), (13, 7168, 2048), (64, 7168, 2048), (5, 256, 1536),
                                   (40, 1024, 1024)])
def test_gpu_mxfp4_swapped_pair_fold(m, n, k, monkeypatch):
    """2-split plans folding in clusters of two (SWAPPED_PAIR): the reduce kernel's bits, exact against
    fp32, every e2m1 code, m tails of each token tile. 128-row blocks (without the pair, the 64-row rule would take
    the split away)."""
    from ops import gemm_mxfp4

    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_BLOCK_N", 128)
    g = torch.Generator().manual_seed(m + n)
    a = torch.randn(m, k, generator=g).bfloat16()
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (n, k // 32), generator=g, dtype=torch.uint8)
    ref = a.float() @ ops.dequant_mxfp4(packed, scales).T
    args = (a.cuda(), packed.cuda(), scales.cuda())
    assert gemm_mxfp4.plan_swapped(m, n, k)["splits"] == 2
    saved = gemm_mxfp4.SWAPPED_PAIR, gemm_mxfp4.SWAPPED_FOLD
    try:
        gemm_mxfp4.SWAPPED_PAIR, gemm_mxfp4.SWAPPED_FOLD = False, False
        want = ops.mxfp4_gemm_nt(*args).cpu()
        gemm_mxfp4.SWAPPED_PAIR = True
        runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    finally:
        gemm_mxfp4.SWAPPED_PAIR, gemm_mxfp4.SWAPPED_FOLD = saved
    assert torch.equal(runs[0], want) and torch.equal(runs[1], want)
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)


@pytest.mark.gpu
def test_gpu_mxfp4_a_off_alignment_is_refused(off_alignment):
    """a is loaded by TMA: a bf16 view that starts off 16 bytes is a ValueError naming a, for the dense
    and the grouped ops, before any kernel runs."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 256, generator=g).bfloat16().cuda()
    packed, scales = ops.quant_mxfp4(torch.randn(128, 256, generator=g))
    packed, scales = packed.cuda(), scales.cuda()
    want = ops.mxfp4_gemm_nt(a, packed, scales)
    with pytest.raises(ValueError, match="^a must start 16-byte aligned"):
        ops.mxfp4_gemm_nt(off_alignment(a, 2), packed, scales)
    with pytest.raises(ValueError, match="^a must start 16-byte aligned"):
        ops.m_grouped_mxfp4_gemm_nt_masked(off_alignment(a.view(1, 4, 256), 2), packed.view(1, 128, 128),
                                          scales.view(1, 128, 8), torch.tensor([4], dtype=torch.int32, device="cuda"), 4)
    assert torch.equal(ops.mxfp4_gemm_nt(a, packed, scales), want)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,big", [(1, 7168, 2048, True), (1, 4096, 7168, False), (5, 256, 384, True),
                                       (8, 4096, 7168, True), (9, 512, 1024, False), (16, 7168, 2048, True),
                                       (16, 4096, 7168, False)])
def test_gpu_mxfp4_warps(m, n, k, big, monkeypatch):
    """The warp kernel (ops.gemm_mxfp4.WARP_TOKENS = 16): every e2m1 code (random bytes), scales from the subnormal
    2^-127 up (big: some over 2^1, the two-multiply decode; else the one-factor one), both token tiles with m tails;
    exact against fp32 and bitwise the same run to run; the same bits at every depth of the codes' register ring
    (1, 2, 8), with an L2 prefetch beyond it (ahead 4), with the scale words four steps a load (quads, also at
    depth 3: the quad and ring turns out of step), with the activations in the codes' ring (acts_ring, also at depth 3),
    with the scale words not allocated in L1 (the scales_no_l1 probe);
    every warp count (1, 2, ..., 16, warps with no K step among them at
    k = 384; with quads, ranges not a multiple of four steps) within the same bounds; and within those bounds of the
    swapped kernel (the op's path before it)."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4_warps import QUADS, launch_warps

    a, packed, scales, ref = _extreme_mxfp4_case(m, n, k, m * 11 + n, big)
    args = (a.cuda(), packed.cuda(), scales.cuda())
    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 16)
    runs = [ops.mxfp4_gemm_nt(*args).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)
    for kw in (dict(depth=1), dict(depth=4), dict(depth=8), dict(ahead=4), dict(quads=True),
               dict(quads=True, depth=3), dict(quads=not QUADS), dict(acts_ring=True), dict(acts_ring=True, depth=3),
               dict(acts_ring=True, quads=True), dict(scales_no_l1=True)):
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        launch_warps(*args, out, **kw)
        assert torch.equal(out.cpu(), runs[0]), kw
    for kw in (dict(splits=1), dict(splits=2), dict(splits=4), dict(splits=16), dict(quads=True, splits=3),
               dict(quads=True, splits=16)):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch_warps(*args, out, **kw)
        assert calc_diff(out.cpu(), ref) < 1e-5, kw
        assert_elementwise(out.cpu(), ref)
    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 0)
    if k % gemm_mxfp4.SWAPPED_K_ALIGN == 0:
        assert_elementwise(ops.mxfp4_gemm_nt(*args).cpu(), runs[0].float())


@pytest.mark.gpu
@pytest.mark.parametrize("max_m,expected_m,k", [(5, 4, 1024), (20, 4, 1024), (16, 12, 7168)])
def test_gpu_mxfp4_warps_masked(max_m, expected_m, k, monkeypatch):
    """The warp kernel's masked form (ops.gemm_mxfp4.MASKED_WARPS_MAX_K, expected_m <= 8 -> 8-row token tiles, <= 16 with
    WARP_TOKENS = 16): groups with 0, a few, and max_m rows (20 rows: three token tiles, the weights read again a
    tile), a's rows past masked_m NaN (never read): the valid rows exact against fp32 within bounds, the rest zeros;
    the scale words a step or four steps a load (QUADS) bitwise the same, run to run; and within bounds of the swapped
    masked kernel."""
    from ops import gemm_mxfp4, gemm_mxfp4_warps

    g = torch.Generator().manual_seed(max_m * 7 + k)
    G, n = 3, 512
    a = torch.randn(G, max_m, k, generator=g).bfloat16()
    packed = torch.randint(0, 256, (G, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 129, (G, n, k // 32), generator=g, dtype=torch.uint8)
    scales[1, 0, :2] = torch.tensor([0, 1], dtype=torch.uint8)
    masked_m = torch.tensor([0, 3, max_m], dtype=torch.int32)
    for gi, mg in enumerate(masked_m.tolist()):
        a[gi, mg:] = float("nan")
    args = (a.cuda(), packed.cuda(), scales.cuda(), masked_m.cuda())
    monkeypatch.setattr(gemm_mxfp4, "MASKED_WARPS_MAX_K", 1 << 30)
    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 16)
    runs = {}
    for quads in (False, True, False):
        monkeypatch.setattr(gemm_mxfp4_warps, "QUADS", quads)
        out = ops.m_grouped_mxfp4_gemm_nt_masked(*args, expected_m).cpu()
        assert runs.setdefault(quads, out) is out or torch.equal(out, runs[quads]), quads
    assert torch.equal(runs[False], runs[True])
    out = runs[False]
    for gi, mg in enumerate(masked_m.tolist()):
        assert torch.equal(out[gi, mg:], torch.zeros_like(out[gi, mg:])), gi
        if mg:
            ref = a[gi, :mg].float() @ ops.dequant_mxfp4(packed[gi], scales[gi]).T
            assert calc_diff(out[gi, :mg], ref) < 1e-5, gi
            assert_elementwise(out[gi, :mg], ref)
    monkeypatch.setattr(gemm_mxfp4, "MASKED_WARPS_MAX_K", 0)
    swapped = ops.m_grouped_mxfp4_gemm_nt_masked(*args, expected_m).cpu()
    for gi, mg in enumerate(masked_m.tolist()):
        assert torch.equal(swapped[gi, mg:], out[gi, mg:]), gi
        if mg:
            assert_elementwise(out[gi, :mg], swapped[gi, :mg].float())


@pytest.mark.gpu
def test_gpu_mxfp4_warps_trace_is_the_plain_kernel():
    """The traced warp kernel (bench.trace_mxfp4_warps), scale words a step or four a load, gives the plain kernel's bits, and
    every warp's stamps run forward: entry <= data(0) <= issued(0) <= data(1) ... <= end on its SM's clock, entry <= end on the timer."""
    from bench.trace_mxfp4_warps import _delta, trace_case
    from ops import quant_mxfp4
    from ops.gemm_mxfp4 import _code_words, _scale_words
    from ops.gemm_mxfp4_warps import TRACE_WORDS, launch_warps, mxfp4_warps_program

    m, n, k = 3, 512, 2048
    rows, p = trace_case(m, n, k)
    assert len(rows) == n // 16 * p["splits"]
    kb, per = k // 128, -(-(k // 128) // p["splits"])
    for w, r in enumerate(rows):
        steps = max(0, min(per, kb - (w % p["splits"]) * per))
        clocks = [r[2]] + [r[4 + j] for j in range(2 * steps)] + [r[3]]
        assert all(_delta(x, y) < 1 << 30 for x, y in zip(clocks, clocks[1:])), (w, clocks)
        assert _delta(r[0], r[1]) < 1 << 30
    g = torch.Generator().manual_seed(m + n + k)      # trace_case's inputs
    a = torch.randn(m, k, generator=g).bfloat16().cuda()
    packed, scales = (t.cuda() for t in quant_mxfp4(torch.randn(n, k, generator=g)))
    plain = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    launch_warps(a, packed, scales, plain, **{key: v for key, v in p.items() if key != "tokens"})
    traced = torch.empty_like(plain)
    trace = torch.zeros(len(rows), TRACE_WORDS, dtype=torch.int32, device="cuda")
    mxfp4_warps_program.compile("cuda:sm_90a", n=n, k=k, trace=True, **p)(
        a, _code_words(packed), _scale_words(scales), traced, trace)
    assert torch.equal(traced, plain)
    rows_q, p_q = trace_case(m, n, k, quads=not p["quads"])          # the other scale-word feed: the same layout
    assert p_q["quads"] != p["quads"] and len(rows_q) == len(rows)
    for w, r in enumerate(rows_q):
        steps = max(0, min(per, kb - (w % p["splits"]) * per))
        clocks = [r[2]] + [r[4 + j] for j in range(2 * steps)] + [r[3]]
        assert all(_delta(x, y) < 1 << 30 for x, y in zip(clocks, clocks[1:])), (w, clocks)
    mxfp4_warps_program.compile("cuda:sm_90a", n=n, k=k, trace=True, **p_q)(
        a, _code_words(packed), _scale_words(scales), traced, trace)
    assert torch.equal(traced, plain)


@pytest.mark.gpu
def test_gpu_mxfp4_warps_in_a_cuda_graph(monkeypatch):
    """The warp kernel replayed in a CUDA graph gives the eager bits every replay."""
    from ops import gemm_mxfp4

    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 16)
    g = torch.Generator().manual_seed(3)
    m, n, k = 3, 4096, 7168
    a = torch.randn(m, k, generator=g).bfloat16().cuda()
    packed, scales = (t.cuda() for t in ops.quant_mxfp4(torch.randn(n, k, generator=g)))
    want = ops.mxfp4_gemm_nt(a, packed, scales)
    _assert_graph_replays(lambda: ops.mxfp4_gemm_nt(a, packed, scales), want)


def _assert_graph_replays(run, want, replays=3):
    """run() (its kernels compiled already) captured in a CUDA graph: every replay, into a zeroed output, gives want
    bit for bit."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(replays):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_gpu_mxfp4_swapped_scale_rows_by_tma():
    """The swapped kernel TMAs its scale rows: a scale view that starts 4- but not 16-byte aligned
    gives the same output as an aligned copy, and k % 512 != 0 (rows of 16-byte strides impossible)
    is computed by the decoded-tile kernel, exactly."""
    g = torch.Generator().manual_seed(11)
    for m, n, k in ((5, 256, 1536), (3, 256, 640)):
        a = torch.randn(m, k, generator=g).bfloat16()
        packed, scales = ops.quant_mxfp4(torch.randn(n, k, generator=g))
        ref = a.float() @ ops.dequant_mxfp4(packed, scales).T
        buf = torch.zeros(scales.numel() + 4, dtype=torch.uint8, device="cuda")
        buf[4:] = scales.flatten().cuda()
        shifted = buf[4:].view(n, k // 32)
        assert shifted.data_ptr() % 16 == 4
        out = ops.mxfp4_gemm_nt(a.cuda(), packed.cuda(), shifted)
        assert torch.equal(out, ops.mxfp4_gemm_nt(a.cuda(), packed.cuda(), scales.cuda()))
        assert calc_diff(out.cpu(), ref) < 1e-5
        assert_elementwise(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_mxfp4_split_k_and_extreme_scales(splits):
    """Split-K plans agree bitwise run to run; every e2m1 code (random bytes) and scales from the
    subnormal 2^-127 up decode exactly."""
    from ops.gemm_mxfp4 import _launch

    g = torch.Generator().manual_seed(splits)
    m, n, k = 5, 128, 1536
    a = torch.randn(m, k, generator=g).bfloat16()
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (n, k // 32), generator=g, dtype=torch.uint8)
    scales[0, :3] = torch.tensor([0, 1, 254 - 100], dtype=torch.uint8)   # 2^-127 (subnormal), 2^-126, 2^27
    ref = a.float() @ ops.dequant_mxfp4(packed, scales).T
    runs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch(a.cuda(), packed.cuda(), scales.cuda(), out, splits=splits)
        runs.append(out.cpu())
    assert torch.equal(runs[0], runs[1])
    assert calc_diff(runs[0], ref) < 1e-5
    assert_elementwise(runs[0], ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,splits,overlap", [(1, 2112, 2048, 2, False), (77, 256, 2048, 2, True),
                                                  (128, 4096, 7168, 4, False), (128, 4096, 7168, 4, True),
                                                  (200, 512, 1536, 4, True), (64, 2112, 7168, 4, True),
                                                  (64, 7168, 16384, 2, False), (100, 2048, 16384, 8, False)])
def test_gpu_split_k_cluster_fold_matches_the_reduce_kernel(m, n, k, splits, overlap):
    """The fold in the cluster gives the reduce kernel's bits (same loop, same splits), run after
    run and inside a CUDA graph; m tails, 16-column slices (block_n 64 or 8 splits) included."""
    ref, launch = _split_k_runner(m, n, k, splits)
    _assert_fold_is_the_reduce(ref, m, n, lambda cluster, out=None: launch(out, overlap=overlap, cluster=cluster))


def _assert_fold_is_the_reduce(ref, m, n, run):
    """run(fold, out=None) -> the bf16 result with the fold (True) or the reduce kernel (False): the
    fold's bits equal the reduce kernel's run after run and inside a CUDA graph, within bounds."""
    reduced = run(False).cpu()
    for _ in range(3):
        assert torch.equal(run(True).cpu(), reduced)
    assert calc_diff(reduced, ref) < 1e-3
    assert_elementwise(reduced, ref)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(True, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reduced)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,block_n,overlap,threads", [(1, 2112, 2048, 64, False, 256),
                                                           (77, 256, 2048, 128, True, 256),
                                                           (128, 4096, 7168, 64, True, 256),
                                                           (128, 4096, 7168, 64, False, 256),
                                                           (200, 512, 1536, 128, True, 256),
                                                           (64, 7168, 16384, 128, True, 256),
                                                           (64, 2112, 7168, 32, True, 128),
                                                           (37, 2112, 7168, 32, True, 128),
                                                           (128, 2112, 7168, 64, True, 128),
                                                           (100, 4096, 7168, 128, True, 128)])
def test_gpu_split_k_smem_fold_matches_the_reduce_kernel(m, n, k, block_n, overlap, threads):
    """2 splits folded through distributed shared memory (cluster_smem=True): the reduce kernel's
    bits, run after run and inside a CUDA graph; m tails and half-width tiles included, and 64-row tiles 32, 64 or
    128 wide on one MMA warpgroup (bench providers tilecraft-pair32/64/128: e.g. 64x2112x7168 as 66 pairs)."""
    ref, launch = _split_k_runner(m, n, k, 2)
    one = {} if threads == 256 else {"threads": threads, "block_m": 64}
    _assert_fold_is_the_reduce(ref, m, n, lambda smem, out=None: launch(out, overlap=overlap, block_n=block_n,
                                                                         cluster=smem, cluster_smem=smem, **one))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 7168, 16384), (50, 2048, 4096), (17, 2048, 4096)])
def test_gpu_dsmem_plan_is_the_reduce_kernel(monkeypatch, m, n, k):
    """CLUSTER_SMEM_FOLD: the op's 2-split plans (128x7168x16384: 56 tiles x 2; 2048x4096 at 17-64 rows: 16 x 2,
    m tails) fold in clusters of two through distributed shared memory where the GPU holds the pairs: the reduce
    kernel's bits, run to run, and within the bounds of the exact reference."""
    from ops import gemm_fp8

    *_, qa, sfa, qb, sfb = quantized(m, n, k, torch.Generator().manual_seed(9))
    args = [t.cuda() for t in (qa, sfa, qb, sfb)]
    monkeypatch.setattr(gemm_fp8, "CLUSTER_SMEM_FOLD", False)
    want = ops.fp8_gemm_nt(*args)
    monkeypatch.setattr(gemm_fp8, "CLUSTER_SMEM_FOLD", True)
    assert gemm_fp8.plan("dense", m, n, k, 64 if m <= 64 else 128, clusters=lambda c, t, smem: 66).get("cluster_smem")
    out = ops.fp8_gemm_nt(*args)
    assert torch.equal(out, want) and torch.equal(ops.fp8_gemm_nt(*args), want)
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    assert calc_diff(out.cpu(), ref) < 1e-3
    assert_elementwise(out.cpu(), ref)


def test_dsmem_plan_takes_2_splits_where_the_pairs_fit(monkeypatch):
    """CLUSTER_SMEM_FOLD (on): 2-split plans of more than READY_FOLD_ROWS rows take cluster_smem (one stage fewer,
    for the received half) only where every pair fits at once; other splits, fewer rows (the in-kernel fold) and the
    switch off keep their paths; the switch is in the key."""
    from ops import gemm_fp8
    from ops.gemm_fp8 import plan

    room = lambda c, t, smem: 66     # noqa: E731
    assert gemm_fp8.CLUSTER_SMEM_FOLD is True
    assert plan("dense", 8, 2048, 4096, 64, clusters=room)["splits"] == 2
    assert "cluster_smem" not in plan("dense", 8, 2048, 4096, 64, clusters=room)          # <= 16 rows: the fold
    assert plan("dense", 64, 2048, 4096, 64, clusters=room)["cluster_smem"]
    p = plan("dense", 128, 7168, 16384, 128, clusters=room)
    assert p["splits"] == 2 and p["cluster"] and p["cluster_smem"] and p["stages"] == 4
    assert "cluster_smem" not in plan("dense", 128, 7168, 16384, 128, clusters=lambda c, t, smem: 55)
    monkeypatch.setattr(gemm_fp8, "PAIR_HALF_TILES", False)
    assert "cluster_smem" not in plan("dense", 64, 2112, 7168, 64, clusters=room)       # 4 splits
    monkeypatch.setattr(gemm_fp8, "PAIR_HALF_TILES", True)
    assert "cluster_smem" not in plan("dense", 128, 7168, 16384, 128)                   # room unknown
    monkeypatch.setattr(gemm_fp8, "CLUSTER_SMEM_FOLD", False)
    assert "cluster_smem" not in plan("dense", 128, 7168, 16384, 128, clusters=room)
    src = inspect.getsource(gemm_fp8._launch)
    assert "CLUSTER_SMEM_FOLD" in src.split("key = (")[1].split(")")[0]


def test_pair_half_tiles_plan_where_the_pairs_make_one_wave(monkeypatch):
    """PAIR_HALF_TILES (on): a 4-split plan of 64 x 64 tiles at 17-64 rows whose 64 x 32 tiles in 2 splits make one
    wave of cluster pairs (2112x7168: 66 x 2 blocks) takes those, on one MMA warpgroup, folding through distributed
    shared memory, where the GPU holds every pair; fewer rows (the in-kernel fold), other widths, too little room
    and the switch off keep the 4-split plan; the switch is in the key."""
    from ops import gemm_fp8
    from ops.gemm_fp8 import plan

    room = lambda c, t, smem: 66     # noqa: E731
    assert gemm_fp8.PAIR_HALF_TILES is True
    for rows in (17, 37, 64):
        p = plan("dense", rows, 2112, 7168, 64, clusters=room)
        assert (p["block_m"], p["block_n"], p["splits"], p["threads"]) == (64, 32, 2, 128), p
        assert p["cluster"] and p["cluster_smem"] and p["stages"] > 6
    assert plan("dense", 16, 2112, 7168, 64, clusters=room)["splits"] == 4             # the in-kernel fold
    assert plan("dense", 64, 576, 7168, 64, clusters=room)["splits"] == 4              # 18 pairs: not a wave
    assert plan("dense", 64, 2112, 7168, 64, clusters=lambda c, t, smem: 60)["splits"] == 4
    assert plan("dense", 64, 2112, 7168, 64)["splits"] == 4                            # room unknown
    monkeypatch.setattr(gemm_fp8, "PAIR_HALF_TILES", False)
    assert plan("dense", 64, 2112, 7168, 64, clusters=room)["splits"] == 4
    src = inspect.getsource(gemm_fp8._launch)
    assert "PAIR_HALF_TILES" in src.split("key = (")[1].split(")")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 37, 17])
def test_gpu_pair_half_tiles_plan_is_the_reduce_kernel(m):
    """The op's PAIR_HALF_TILES plan at 17-64 x 2112 x 7168 (64 x 32 tiles, 2 splits folding in cluster pairs): the
    bits of the same tiles through the reduce kernel, run to run, and within the bounds of the exact reference."""
    from ops import gemm_fp8

    n, k = 2112, 7168
    *_, qa, sfa, qb, sfb = quantized(m, n, k, torch.Generator().manual_seed(11))
    args = [t.cuda() for t in (qa, sfa, qb, sfb)]
    assert gemm_fp8.plan("dense", m, n, k, 64, clusters=lambda c, t, smem: 66).get("cluster_smem")
    out = ops.fp8_gemm_nt(*args)
    ref, launch = _split_k_runner(m, n, k, 2)
    want = launch(block_m=64, block_n=32, threads=128, overlap=True)        # the same tiles, the reduce kernel
    g = torch.Generator().manual_seed(m + 2)
    *_, qa2, sfa2, qb2, sfb2 = quantized(m, n, k, g)
    same = [t.cuda() for t in (qa2, sfa2, qb2, sfb2)]
    assert torch.equal(ops.fp8_gemm_nt(*same), want) and torch.equal(ops.fp8_gemm_nt(*same), want)
    exact = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    assert calc_diff(out.cpu(), exact) < 1e-3
    assert_elementwise(out.cpu(), exact)


@pytest.mark.gpu
def test_gpu_cluster_room_and_the_op_path():
    """The driver's answer is a count the SMs can hold, smaller for bigger clusters; the op then
    folds 128x4096x7168 in clusters exactly when its 32 clusters of 4 fit, and matches the
    reference either way."""
    from backends.cuda.device import max_active_clusters, sm_count
    from ops.gemm_fp8 import GRID_THREADS

    x = torch.empty(1, device="cuda")
    room = {c: max_active_clusters(x, c, GRID_THREADS, 200 << 10) for c in (2, 4, 8)}
    sms = sm_count(x)
    assert all(isinstance(r, int) and 0 < r * c <= sms for c, r in room.items()), room
    assert room[2] >= room[4] >= room[8], room
    m, n, k = 128, 4096, 7168
    *_, qa, sfa, qb, sfb = quantized(m, n, k, torch.Generator().manual_seed(5))
    ref = ops.fp8_gemm_nt(qa, sfa, qb, sfb, out_dtype=torch.float32)
    out = ops.fp8_gemm_nt(qa.cuda(), sfa.cuda(), qb.cuda(), sfb.cuda()).cpu()
    assert calc_diff(out, ref) < 1e-3
    assert_elementwise(out, ref)


def test_plan_splits_k_only_for_small_grids(monkeypatch):
    import ops.gemm_fp8 as gemm
    from ops.gemm_fp8 import plan

    monkeypatch.setattr(gemm, "THIN_TILES", False)   # the split-K rule alone (its one-wave tiles replace it)
    assert plan("dense", 128, 2112, 7168, 128)["splits"] == 4         # 33 tiles: 4 x 33 = 132 blocks
    assert plan("dense", 128, 24576, 1536, 128)["splits"] == 1        # 192 tiles already fill the GPU
    # 56 tiles and 16 K blocks (too few to split): 112 half-width tiles instead
    assert plan("dense", 128, 7168, 2048, 128, overlap=False) == dict(block_m=128, block_n=64, splits=1, stages=4)
    # the default loop is v3 (ops.gemm_fp8.OVERLAP, measured faster on every preset)
    assert plan("dense", 128, 7168, 2048, 128) == dict(block_m=128, block_n=64, splits=1, stages=6, overlap=True)
    assert plan("masked", 64, 4096, 7168, 64)["overlap"] is True
    assert plan("dense", 4096, 7168, 16384, 128, overlap=False) == dict(block_m=128, block_n=128, splits=1, stages=4)
    # v3 (overlap): one stage is held one step longer, so up to 6 where shared memory allows
    assert plan("dense", 128, 2112, 7168, 128, overlap=True) == dict(block_m=128, block_n=64, splits=4, stages=6,
                                                                       overlap=True)
    assert plan("dense", 4096, 7168, 16384, 128, overlap=True)["stages"] == 4     # 66 KB of sfa staging
    # two or more waves of tiles in pairs of n-neighbours: A multicast in clusters of two (v3 only),
    # where MULTICAST is on (off by default: measured slower)
    assert "multicast" not in plan("dense", 4096, 7168, 16384, 128)
    monkeypatch.setattr(gemm, "MULTICAST", True)
    assert plan("dense", 4096, 7168, 16384, 128)["multicast"] is True
    assert plan("contiguous", 32768, 4096, 7168, 128)["multicast"] is True
    assert "multicast" not in plan("dense", 4096, 7168, 16384, 128, overlap=False)
    assert "multicast" not in plan("dense", 128, 24576, 1536, 128)           # 192 tiles: under two waves
    assert "multicast" not in plan("dense", 4096, 7168 - 128, 16384, 128)    # 55 n tiles do not pair
    assert plan("masked", 64, 4096, 7168, 64)["splits"] == 1          # grouped layouts never split
    with pytest.raises(ValueError, match="too long"):
        plan("dense", 4096, 4096, 65536, 128)


def test_mxfp4_dequant_reads_e8m0_255_as_nan():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)            # every code 2: 1.0
    out = ops.dequant_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(out).all()
    assert (ops.dequant_mxfp4(packed, torch.tensor([[0]], dtype=torch.uint8)) == 2.0 ** -127).all()


def test_mxfp4_plan():
    from ops.gemm_mxfp4 import plan

    assert plan(1, 4096, 7168) == dict(block_m=64, splits=4)
    assert plan(64, 7168, 2048) == dict(block_m=64, splits=2)      # 56 tiles: 112 blocks of 8 steps
    assert plan(64, 7168, 1024) == dict(block_m=64, splits=1)      # 8 steps: no split keeps 6
    # enough tiles to fill the GPU: one split while the block's staged scale words fit next to the
    # pipeline (56 K steps: 212 KB), split where they do not (256 steps: 316 KB in one block would
    # be a launch error; 4 splits of 64 steps: 216 KB)
    assert plan(4096, 4096, 7168)["splits"] == 1
    assert plan(4096, 4096, 32768)["splits"] == 4


def test_mxfp4_plans_fit_in_shared_memory():
    from ops.gemm_mxfp4 import SMEM_BUDGET, mxfp4_gemm_program, plan, smem_bytes

    for m in (1, 64, 200, 4096):
        for n, k in ((4096, 7168), (7168, 2048), (2048, 16384), (256, 512), (4096, 32768)):
            p = plan(m, n, k)
            assert smem_bytes(p["block_m"], -(-(k // 128) // p["splits"])) <= SMEM_BUDGET, (m, n, k, p)
    p = plan(4096, 4096, 32768)
    src = mxfp4_gemm_program.source("sm_90a", n=4096, k=32768, **p)
    offsets = sorted(map(int, re.findall(r"buf_dyn_shmem\s*\+\s*(\d+)", src)))
    # the last buffer starts within the estimate, less its smallest possible size (a barrier word)
    assert offsets and offsets[-1] < smem_bytes(128, 256 // p["splits"]) <= SMEM_BUDGET


# ---- sorted rows + work items (MoE decode) ---------------------------------------------------------

def moe_case(T_, k, E, n, kd, seed, skew=True):
    """Routed rows as the MoE decode step makes them: moe_dispatch(align=1) of fp8 tokens, items from
    moe_tile_items, B per expert. skew: expert 0 takes every token (> 64 rows) and the last 4
    experts none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 4, generator=g)[:k] for _ in range(T_)]).to(torch.int32)
    if skew:
        ids[:, 0] = 0
        ids[:, 1:] = torch.where(ids[:, 1:] == 0, torch.full_like(ids[:, 1:], E - 5), ids[:, 1:])
    x = torch.randn(T_, kd, generator=g)
    qx, sx = ops.per_token_group_quant_fp8(x)
    a, sfa, m = ops.moe_dispatch(qx, ids, E, x_scales=sx, align=1)
    items = ops.moe_tile_items(m, E)
    bs = [ops.per_block_quant_fp8(torch.randn(n, kd, generator=g)) for _ in range(E)]
    qb, sfb = torch.stack([q for q, _ in bs]), torch.stack([s for _, s in bs])
    return a, sfa, qb, sfb, m, items


def test_sorted_cpu_is_the_contiguous_reference_on_listed_rows():
    from ops.gemm_fp8 import m_grouped_contiguous_reference

    a, sfa, qb, sfb, m, items = moe_case(16, 4, 12, 128, 256, seed=9)
    assert (m.counts[-4:] == 0).all() and int(m.counts[0]) == 16
    out = ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items, out=torch.full((64, 128), float("nan")))
    ref = m_grouped_contiguous_reference(a, sfa, qb, sfb, m.m_indices, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)  # every row is listed: no NaN left
    # the default output is bf16 of the same values
    torch.testing.assert_close(ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items), ref.bfloat16(), rtol=0, atol=0)
    # rows no item lists are left as they were: drop expert 0's items
    keep = items[:, 0] != 0
    part = torch.cat([items[keep], items[~keep].fill_(-1)])
    out = ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, part, out=torch.full((64, 128), float("nan")))
    mine = m.m_indices == 0
    assert out[mine].isnan().all() and torch.equal(out[~mine], ref[~mine])


def test_sorted_through_the_custom_op(monkeypatch):
    monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "0")           # value checks read items: not traceable
    a, sfa, qb, sfb, m, items = moe_case(4, 2, 8, 128, 128, seed=10, skew=False)
    compiled = torch.compile(lambda *x: ops.m_grouped_fp8_gemm_nt_sorted(*x), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, sfa, qb, sfb, items), ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items))


def test_sorted_errors():
    a, sfa, qb, sfb, m, items = moe_case(4, 2, 8, 128, 128, seed=11, skew=False)
    with pytest.raises(TypeError, match="items must have dtype int32"):
        ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items.long())
    with pytest.raises(ValueError, match=r"items must have shape \(max_items, 3\)"):
        ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items[:, :2].contiguous())
    with pytest.raises(ValueError, match="items must have 2 dimensions"):
        ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items.flatten())
    with pytest.raises(ValueError, match="items must be contiguous"):
        ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items.t().contiguous().t())
    for bad in ([8, 0, 1], [0, 5, 4], [0, 0, 65], [0, -1, 1]):
        wrong = items.clone()
        wrong[0] = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"items\[0\] = .* is not a work item"):
            ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, wrong)
    with pytest.raises(ValueError, match="b must have 3 dimensions"):
        ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb[0], sfb[0], items)


def test_sorted_mode_compiles_to_qgmma_without_spills():
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    try:
        src = fp8_gemm_program.source("sm_90a", n=512, k=1024, mode="sorted", block_m=64)
        stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert stats.histogram.get("QGMMA", 0) > 0 and stats.histogram.get("UTMALDG", 0) > 0
    assert stats.spill_stores == 0 and stats.spill_loads == 0
    # the only stores of C are under `row < limit` (the item's end): no zero fill of other rows
    body = src[src.index("int limit"):]
    assert "< limit" in body and "C_local_cast" in body


def test_sorted_mode_lowers_for_ascend():
    src = fp8_gemm_program.source("ascend", n=4096, k=7168, mode="sorted", block_m=64)
    assert "ascend_gemm_l1<64, 128, 128, 128, true, float8_e4m3_t>" in src and "asc_get_sub_block_id() * 32" in src


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_sorted_matches_the_reference(out_dtype):
    """MoE decode shape: T=72 tokens, k=8 of E=32 experts (expert 0 > 64 rows, 4 experts empty),
    n=512, k_dim=1024. Listed rows match the CPU reference; unlisted rows of a NaN-filled out stay NaN."""
    a, sfa, qb, sfb, m, items = moe_case(72, 8, 32, 512, 1024, seed=12)
    rows = a.shape[0]
    assert int(m.counts.max()) > 64 and int((m.counts == 0).sum()) >= 4
    ref = ops.m_grouped_fp8_gemm_nt_sorted(a, sfa, qb, sfb, items, out=torch.full((rows, 512), float("nan")))
    dev = [t.cuda() for t in (a, sfa, qb, sfb)]
    out = ops.m_grouped_fp8_gemm_nt_sorted(*dev, items.cuda(), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert calc_diff(out.cpu(), ref) < 1e-3
    assert_elementwise(out.cpu(), ref)
    # half the items: the other experts' rows of a NaN out are never written
    keep = (items[:, 0] >= 0) & (items[:, 0] % 2 == 0)
    half = torch.where(keep[:, None], items, torch.tensor([-1, 0, 0], dtype=torch.int32))
    out = torch.full((rows, 512), float("nan"), dtype=out_dtype, device="cuda")
    ops.m_grouped_fp8_gemm_nt_sorted(*dev, half.cuda(), out=out)
    listed = (m.m_indices % 2 == 0)
    out = out.cpu()
    assert out[~listed].isnan().all()
    assert_elementwise(out[listed], ref[listed])
    # a fixed grid: more padding items change nothing
    more = torch.cat([items, torch.tensor([[-1, 0, 0]] * 40, dtype=torch.int32)])
    assert torch.equal(ops.m_grouped_fp8_gemm_nt_sorted(*dev, more.cuda(), out_dtype=out_dtype).cpu(),
                       ops.m_grouped_fp8_gemm_nt_sorted(*dev, items.cuda(), out_dtype=out_dtype).cpu())


@pytest.mark.gpu
def test_gpu_sorted_in_a_cuda_graph():
    """dispatch(align=1) + items + sorted GEMM captured once, replayed with a new routing."""
    a, sfa, qb, sfb, m, items = moe_case(72, 8, 32, 512, 1024, seed=13)
    dev = [t.cuda() for t in (a, sfa, qb, sfb)]
    items_d = items.cuda()
    out = torch.full((a.shape[0], 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    ops.m_grouped_fp8_gemm_nt_sorted(*dev, items_d, out=out)     # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.m_grouped_fp8_gemm_nt_sorted(*dev, items_d, out=out)
    a2, sfa2, _, _, m2, items2 = moe_case(72, 8, 32, 512, 1024, seed=14)
    for d, s in zip((dev[0], dev[1], items_d), (a2, sfa2, items2)):
        d.copy_(s)
    out.fill_(float("nan"))
    graph.replay()
    ref = ops.m_grouped_fp8_gemm_nt_sorted(a2, sfa2, qb, sfb, items2, out=torch.full((a.shape[0], 512), float("nan")))
    assert_elementwise(out.cpu(), ref)


# ---- grouped MXFP4 ---------------------------------------------------------------------------------

def mxfp4_groups(G, n, k, g):
    packed, scales = zip(*(ops.quant_mxfp4(torch.randn(n, k, generator=g)) for _ in range(G)))
    return torch.stack(packed), torch.stack(scales)


def test_grouped_mxfp4_equals_the_per_group_dense_products():
    g = torch.Generator().manual_seed(3)
    G, n, k = 3, 128, 256
    b, sfb = mxfp4_groups(G, n, k, g)
    # contiguous: 128-row segments of experts 2, 0, padding (-1), 1 (partly padding)
    m_idx = torch.tensor([2] * 128 + [0] * 128 + [-1] * 128 + [1] * 100 + [-1] * 28, dtype=torch.int32)
    a = torch.randn(m_idx.numel(), k, generator=g).bfloat16()
    out = ops.m_grouped_mxfp4_gemm_nt_contiguous(a, b, sfb, m_idx)
    for r0, e in ((0, 2), (128, 0), (384, 1)):
        rows = slice(r0, r0 + (100 if e == 1 else 128))
        assert torch.equal(out[rows], ops.mxfp4_gemm_nt(a[rows].contiguous(), b[e], sfb[e]))
    assert (out[256:384] == 0).all() and (out[484:] == 0).all()
    # masked: only the first masked_m[i] rows of group i
    a3 = torch.randn(G, 64, k, generator=g).bfloat16()
    mm = torch.tensor([64, 0, 17], dtype=torch.int32)
    out3 = ops.m_grouped_mxfp4_gemm_nt_masked(a3, b, sfb, mm, expected_m=32)
    assert out3.shape == (G, 64, n)
    for e in range(G):
        m_e = int(mm[e])
        if m_e:
            assert torch.equal(out3[e, :m_e], ops.mxfp4_gemm_nt(a3[e, :m_e].contiguous(), b[e], sfb[e]))
        assert (out3[e, m_e:] == 0).all()


def test_grouped_mxfp4_invalid_inputs():
    g = torch.Generator().manual_seed(4)
    b, sfb = mxfp4_groups(2, 128, 256, g)
    a = torch.randn(128, 256, generator=g).bfloat16()
    m_idx = torch.zeros(128, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"m_indices must be in \[-1, 2\)"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a, b, sfb, m_idx + 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a[:100], b, sfb, m_idx[:100])
    with pytest.raises(ValueError, match="sfb must have shape"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a, b, sfb[:, :, :4].contiguous(), m_idx)
    with pytest.raises(TypeError, match="a must have dtype bf16"):
        ops.m_grouped_mxfp4_gemm_nt_contiguous(a.float(), b, sfb, m_idx)
    with pytest.raises(ValueError, match=r"masked_m must be in \[0, 8\]"):
        ops.m_grouped_mxfp4_gemm_nt_masked(a[:16].view(2, 8, 256), b, sfb, torch.tensor([9, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="one matrix per group"):
        ops.m_grouped_mxfp4_gemm_nt_masked(a[:24].view(3, 8, 256), b, sfb, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="too long for the grouped kernel"):
        big, sbig = mxfp4_groups(1, 128, 65536, g)
        ops.m_grouped_mxfp4_gemm_nt_contiguous(torch.zeros(128, 65536).bfloat16(), big, sbig, m_idx[:128])


# sm_90a builds one mode (~25-40 s of CI each; the modes differ in their row index math only, and
# masked groups of <= 64 rows take the swapped kernel: test_mxfp4_masked_swapped_lowers_to_register_wgmma);
# sm_100a the other (its contiguous build was ~6 s of CI): each mode lowers, each target's MMA is checked
@pytest.mark.parametrize("target,instr,mode", [("sm_90a", "HGMMA", "contiguous"), ("sm_100a", "UTCHMMA", "masked")])
def test_grouped_mxfp4_lowers_to_bf16_tensor_cores(target, instr, mode):
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import SMEM_BUDGET, grouped_smem_bytes, mxfp4_grouped_program

    assert grouped_smem_bytes(7168, 128) <= SMEM_BUDGET
    try:
        src = mxfp4_grouped_program.source(target, n=4096, k=7168, mode=mode, block_m=64 if mode == "masked" else 128)
        hist = sass_stats(build_cubin(src, target), target).histogram
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert hist.get(instr, 0) > 0
    if target == "sm_90a":
        # 56 K steps a live tile (tile.steps_if): one burst of 4 steps, no dead tail bursts (with them: 10 MMA batches
        # and ~55 s of TileLang's layout inference)
        assert src.count("tl::wgmma_ss<") == 4 and "* 56)" in src


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["contiguous", "masked"])
def test_gpu_grouped_mxfp4(mode):
    """The grouped kernels against the CPU path (exact dequant, per group), padding rows included."""
    g = torch.Generator().manual_seed(7)
    G, n, k = 4, 256, 1024
    b, sfb = mxfp4_groups(G, n, k, g)
    if mode == "contiguous":
        aux = torch.tensor([1] * 128 + [3] * 100 + [-1] * 28 + [0] * 128 + [-1] * 128, dtype=torch.int32)
        a = torch.randn(aux.numel(), k, generator=g).bfloat16()
        fn = lambda *x: ops.m_grouped_mxfp4_gemm_nt_contiguous(*x)   # noqa: E731
    else:
        aux = torch.tensor([70, 0, 128, 5], dtype=torch.int32)
        a = torch.randn(G, 128, k, generator=g).bfloat16()
        fn = lambda *x: ops.m_grouped_mxfp4_gemm_nt_masked(*x)       # noqa: E731
    ref = fn(a, b, sfb, aux).float()
    out = fn(a.cuda(), b.cuda(), sfb.cuda(), aux.cuda()).float().cpu()
    assert calc_diff(out, ref) < 1e-5
    assert_elementwise(out, ref)
    assert (out[ref == 0] == 0).all()           # padding rows and rows past masked_m stay zeros


@pytest.mark.gpu
def test_gpu_mxfp4_decode_by_rows_is_the_pairs_decode_bitwise(monkeypatch):
    """DECODE_ROW_WARPS (a warp decodes 32 rows of one half, the raw tile swizzled by TMA) against two threads a row
    (the raw tile plain): the same bits from the shared-memory decode's grouped (contiguous, padding rows included)
    and dense kernels."""
    import ops.gemm_mxfp4 as gm
    from ops.gemm_mxfp4 import _launch

    g = torch.Generator().manual_seed(11)
    G, n, k = 4, 256, 1024
    b, sfb = mxfp4_groups(G, n, k, g)
    aux = torch.tensor([1] * 128 + [3] * 100 + [-1] * 28 + [0] * 128 + [-1] * 128, dtype=torch.int32)
    a = torch.randn(aux.numel(), k, generator=g).bfloat16()
    dense = torch.randn(200, 1536, generator=g).bfloat16(), *ops.quant_mxfp4(torch.randn(384, 1536, generator=g))
    outs = {}
    for rows in (True, False):
        monkeypatch.setattr(gm, "DECODE_ROW_WARPS", rows)
        grouped = ops.m_grouped_mxfp4_gemm_nt_contiguous(a.cuda(), b.cuda(), sfb.cuda(), aux.cuda())
        out = torch.full((200, 384), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch(*(t.cuda() for t in dense), out, splits=1)
        outs[rows] = (grouped, out)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    assert not outs[True][1].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("max_m,masked", [(1, [1, 0, 1, 1]), (37, [37, 0, 5, 20]), (64, [64, 63, 0, 1])])
def test_gpu_grouped_mxfp4_masked_swapped(monkeypatch, max_m, masked):
    """The masked layout on the swapped kernel (ops.gemm_mxfp4.SWAPPED_MASKED): exact per group;
    rows past masked_m (NaN here) never leak into another row and come out zeros; a group with no
    rows is all zeros; either decode and either scale-row path, and C staged or not, give the same bits."""
    from ops import gemm_mxfp4

    g = torch.Generator().manual_seed(max_m)
    G, n, k = 4, 256, 1024
    b, sfb = mxfp4_groups(G, n, k, g)
    aux = torch.tensor(masked, dtype=torch.int32)
    a = torch.randn(G, max_m, k, generator=g).bfloat16()
    for gi, mm in enumerate(masked):
        a[gi, mm:] = float("nan")
    ref = ops.m_grouped_mxfp4_gemm_nt_masked(a, b, sfb, aux).float()
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_MASKED", True)
    monkeypatch.setattr(gemm_mxfp4, "MASKED_WARPS_MAX_K", 0)     # (max_m = 1 at k = 1024: else the warp kernel)
    out = ops.m_grouped_mxfp4_gemm_nt_masked(a.cuda(), b.cuda(), sfb.cuda(), aux.cuda()).float().cpu()
    assert not out.isnan().any()
    assert calc_diff(out, ref) < 1e-5
    assert_elementwise(out, ref)
    for gi, mm in enumerate(masked):
        assert (out[gi, mm:] == 0).all()
    for decode in gemm_mxfp4.SWAPPED_DECODES:       # the same bits with either decode and scale-row path
        for scale_tma in (True, False):
            monkeypatch.setattr(gemm_mxfp4, "SWAPPED_DECODE", decode)
            monkeypatch.setattr(gemm_mxfp4, "SWAPPED_SCALE_TMA", scale_tma)
            again = ops.m_grouped_mxfp4_gemm_nt_masked(a.cuda(), b.cuda(), sfb.cuda(), aux.cuda()).float().cpu()
            assert torch.equal(again, out), (decode, scale_tma)
    monkeypatch.setattr(gemm_mxfp4, "MASKED_STAGED", False)    # C from the accumulator's layout: the same bits
    again = ops.m_grouped_mxfp4_gemm_nt_masked(a.cuda(), b.cuda(), sfb.cuda(), aux.cuda()).float().cpu()
    assert torch.equal(again, out)


def test_mxfp4_masked_swapped_lowers_to_register_wgmma():
    """The masked swapped program builds: WGMMA from registers, TMA, no spills or serialization; its
    plan stages the whole K range of scales next to the pipeline, and a K too long for that is
    refused."""
    from ops.gemm_mxfp4 import SMEM_BUDGET, mxfp4_masked_swapped_program, plan_masked_swapped

    p = plan_masked_swapped(64, 7168)
    assert p == dict(tokens=64, stages=8, decode="v7", scale_tma=True, staged_out=False)   # staging would cost a stage
    assert plan_masked_swapped(16, 1024)["scale_tma"]
    assert p["stages"] * (64 * 256 + 128 * 64) + 128 * 56 * 4 <= SMEM_BUDGET
    q = plan_masked_swapped(64, 2048)
    assert q["stages"] == 8 and q["staged_out"]
    assert q["stages"] * (64 * 256 + 128 * 64) + 128 * 16 * 4 + 64 * 136 * 2 <= SMEM_BUDGET
    assert plan_masked_swapped(1, 2048)["tokens"] == 8 and plan_masked_swapped(0, 2048)["tokens"] == 8
    with pytest.raises(ValueError, match="too long"):
        plan_masked_swapped(64, 128 * 420)
    src = mxfp4_masked_swapped_program.source("sm_90a", n=256, k=1024, tokens=16, stages=4)
    assert "tl::wgmma_rs<" in src and "uint4*)(C + " not in src
    _tma_wgmma_sass(src, "HGMMA")
    # staged_out: C's tile as whole rows, 16-byte stores
    assert "*(uint4*)(C + " in mxfp4_masked_swapped_program.source("sm_90a", n=256, k=1024, tokens=16, stages=4,
                                                                    staged_out=True)


@settings(max_examples=12, deadline=None)
@given(G=st.integers(1, 3), max_m=st.integers(0, 33), k=st.sampled_from([128, 256]), seed=st.integers(0, 2 ** 16),
       segments=st.lists(st.integers(0, 128), min_size=1, max_size=3))
def test_hypothesis_grouped_mxfp4_matches_per_group(G, max_m, k, seed, segments):
    """Grouped results are the per-group dense results (masks, empty groups, zero rows included)."""
    g = torch.Generator().manual_seed(seed)
    b, sfb = mxfp4_groups(G, 128, k, g)
    masks = torch.randint(0, max_m + 1, (G,), generator=g, dtype=torch.int32)
    a3 = torch.randn(G, max_m, k, generator=g).bfloat16()
    out = ops.m_grouped_mxfp4_gemm_nt_masked(a3, b, sfb, masks)
    for e in range(G):
        m_e = int(masks[e])
        if m_e:
            torch.testing.assert_close(out[e, :m_e].float(), ops.mxfp4_gemm_nt(a3[e, :m_e].contiguous(), b[e], sfb[e]).float(),
                                       rtol=2 ** -8, atol=0)
        assert (out[e, m_e:] == 0).all()
    # contiguous: one 128-row segment per entry of `segments` (its live rows first, then padding)
    experts = [i % G for i in range(len(segments))]
    m_idx = torch.cat([torch.tensor([e] * c + [-1] * (128 - c), dtype=torch.int32) for e, c in zip(experts, segments)])
    a = torch.randn(m_idx.numel(), k, generator=g).bfloat16()
    out2 = ops.m_grouped_mxfp4_gemm_nt_contiguous(a, b, sfb, m_idx)
    for s_, (e, c) in enumerate(zip(experts, segments)):
        rows = slice(128 * s_, 128 * s_ + c)
        if c:
            torch.testing.assert_close(out2[rows].float(), ops.mxfp4_gemm_nt(a[rows].contiguous(), b[e], sfb[e]).float(),
                                       rtol=2 ** -8, atol=0)
        assert (out2[128 * s_ + c:128 * (s_ + 1)] == 0).all()
