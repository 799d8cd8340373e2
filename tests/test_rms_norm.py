"""ops.rms_norm: one tile program, every target."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops.rms_norm import _rms_norm_op, rmsnorm_program, rms_norm_reference

# fp32 math either way; the only difference is the order of the sum and one final rounding
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def reference64(x, w, eps=1e-6):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def check(y, x, w, eps=1e-6):
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), reference64(x, w, eps).to(x.dtype).double(), **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (3, 7168), (2, 3, 1536), (5, 100), (4, 1)])
def test_cpu_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    check(ops.rms_norm(x, w), x, w)


def test_bf16_rounding_is_nearest_even_on_cpu():
    # the cpu target carries bf16 as uint16 and rounds by bit arithmetic: it must agree with torch's cast
    torch.manual_seed(1)
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    w = torch.ones(512, dtype=torch.bfloat16)
    y = ops.rms_norm(x, w)
    ref = rms_norm_reference(x, w)
    assert (y != ref).float().mean() < 0.01  # only sum-order ties may differ


def test_a_repeated_call_takes_its_launcher_from_the_op_cache(monkeypatch):
    """The op keeps its launcher per (target, hidden, dtype, eps): a second call compiles nothing,
    and a different eps is its own kernel."""
    x, w = torch.randn(3, 96), torch.randn(96)
    first = ops.rms_norm(x, w, eps=1e-5)

    def no_compile(*a, **k):
        raise AssertionError("compiled on a repeated call")

    monkeypatch.setattr(rmsnorm_program, "compile", no_compile)
    assert torch.equal(ops.rms_norm(x, w, eps=1e-5), first)
    with pytest.raises(AssertionError, match="compiled on a repeated call"):
        ops.rms_norm(x, w, eps=1e-3)


def test_eps_is_honoured():
    x = torch.full((2, 64), 1e-3)
    w = torch.ones(64)
    check(ops.rms_norm(x, w, eps=1.0), x, w, eps=1.0)


def test_zero_rows_and_nan_passthrough():
    w = torch.randn(64)
    assert ops.rms_norm(torch.empty(0, 64), w).shape == (0, 64)
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    y = ops.rms_norm(x, w)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 40), hidden=st.sampled_from([8, 96, 512, 576]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_hypothesis_shapes(rows, hidden, dtype):
    x = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    check(ops.rms_norm(x, w), x, w)


def test_invalid_inputs_name_the_argument():
    x, w = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.rms_norm(x.numpy(), w)
    with pytest.raises(TypeError, match="x must have dtype bf16 or fp16 or fp32, got fp64"):
        ops.rms_norm(x.double(), w)
    with pytest.raises(TypeError, match="weight must have dtype fp32, got bf16"):
        ops.rms_norm(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        ops.rms_norm(x, torch.randn(65))
    with pytest.raises(ValueError, match="weight must have 1 dimensions"):
        ops.rms_norm(x, torch.randn(1, 64))
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.rms_norm(torch.randn(64, 2).t(), w)
    with pytest.raises(ValueError, match="eps must be >= 0.0"):
        ops.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ops.rms_norm(torch.tensor(1.0), torch.randn(1))


def test_non_finite_eps_is_refused():
    """eps NaN or inf gave all-NaN or all-zero rows; it must be a finite number >= 0."""
    x, w = torch.randn(2, 64), torch.randn(64)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number"):
            ops.rms_norm(x, w, eps=bad)


_X, _W = torch.randn(2, 64), torch.randn(64)


@pytest.mark.parametrize("args,kw,exc,msg", [
    ((_X.numpy(), _W), {}, TypeError, "x must be a torch.Tensor, got ndarray"),
    ((_X.int(), _W), {}, TypeError, "x must have dtype fp16 or bf16 or fp32 or fp64, got int32"),
    ((torch.tensor(1.0), torch.randn(1)), {}, ValueError, "x must have at least 1 dimension"),
    ((_X, [1.0] * 64), {}, TypeError, "weight must be a torch.Tensor, got list"),
    ((_X, _W.long()), {}, TypeError, "weight must have dtype fp16 or bf16 or fp32 or fp64, got int64"),
    ((_X, torch.randn(1, 64)), {}, ValueError, "weight must have 1 dimensions"),
    ((_X, torch.randn(1)), {}, ValueError, r"weight must have shape \(64,\) \(\(hidden,\) matching x's last dimension\), got \(1,\)"),
    ((_X, torch.randn(65)), {}, ValueError, r"weight must have shape \(64,\)"),
    ((_X, _W.to("meta")), {}, ValueError, "tensors must be on one device, got x on cpu, weight on meta"),
    ((_X, _W), dict(eps=-1.0), ValueError, "eps must be >= 0.0, got -1.0"),
    ((_X, _W), dict(eps=float("nan")), ValueError, "eps must be a finite number"),
    ((_X, _W), dict(eps="1e-6"), TypeError, "eps must be a number, got str"),
])
def test_reference_refuses_bad_inputs(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        rms_norm_reference(*args, **kw)


def test_reference_takes_any_float_dtype_and_strides():
    """The oracle is more permissive than the kernel: fp64, mixed dtypes, non-contiguous views, eps = 0."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, dtype=torch.float64, generator=g).t()          # (6, 64), strided
    w = torch.randn(128, dtype=torch.float64, generator=g)[::2]           # (64,), strided
    y = rms_norm_reference(x, w)
    assert y.dtype == torch.float64 and y.shape == (6, 64)
    torch.testing.assert_close(y, reference64(x, w), atol=1e-5, rtol=1e-5)
    yb = rms_norm_reference(x.bfloat16(), w.float(), eps=0)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), reference64(x.bfloat16(), w.float(), 0), **TOL[torch.bfloat16])


def test_custom_op_contract():
    x, w = torch.randn(3, 64), torch.randn(64)
    torch.library.opcheck(_rms_norm_op, (x, w, 1e-6))
    compiled = torch.compile(lambda a, b: ops.rms_norm(a, b) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), 2 * ops.rms_norm(x, w))


@pytest.mark.parametrize("target,markers", [
    ("sm_90a", ["__global__", "rsqrtf"]),
    ("sm_100a", ["__global__", "rsqrtf"]),
    ("ascend", ["__simt_vf__", "AscendAllReduce", "asc_vf_call"]),
    ("cpu", ["rmsnorm"]),
])
def test_lowers_on_every_target(target, markers):
    src = rmsnorm_program.source(target, hidden=7168, dtype="bfloat16")
    for m in markers:
        assert m in src, f"{m!r} missing from the {target} source"


def test_builds_a_cubin_for_both_cuda_arches():
    from backends import ToolchainError

    try:
        k90 = rmsnorm_program.compile("sm_90a", hidden=7168, dtype="bfloat16")
        k100 = rmsnorm_program.compile("sm_100a", hidden=7168, dtype="bfloat16")
    except ToolchainError as e:
        pytest.skip(f"no CUDA 13 toolchain: {e}")
    assert k90.entry is not None and (k90.entry / "kernel.so").stat().st_size > 0
    assert k90.key != k100.key


def test_ascend_compile_without_cann_names_bisheng(monkeypatch):
    from backends import ToolchainError
    from backends.ascend.toolchain import bisheng_version

    if bisheng_version() is not None:
        pytest.skip("bisheng is installed")
    with pytest.raises(ToolchainError, match="needs `bisheng` from CANN 9.2"):
        rmsnorm_program.compile("ascend", hidden=512)


# ---- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7168), (4096, 7168), (33, 1536), (7, 512), (3, 100)])
def test_gpu_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype, device="cuda") * 3
    w = torch.randn(shape[-1], dtype=dtype, device="cuda")
    check(ops.rms_norm(x, w).cpu(), x.cpu(), w.cpu())


@pytest.mark.gpu
def test_gpu_views_that_do_not_start_16_byte_aligned(off_alignment):
    """The kernel reads rows 16 bytes a thread: a weight view off alignment is copied (the same bits), an
    x view is a ValueError naming x (not a misaligned-address fault that ends the process's CUDA)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 4096, generator=g, device="cuda").bfloat16()
    w = torch.randn(4096, generator=g, device="cuda").bfloat16()
    want = ops.rms_norm(x, w)
    assert torch.equal(ops.rms_norm(x, off_alignment(w, 2)), want)
    with pytest.raises(ValueError, match="^x must start 16-byte aligned"):
        ops.rms_norm(off_alignment(x, 2), w)
    assert torch.equal(ops.rms_norm(x, w), want)


@pytest.mark.gpu
def test_gpu_output_fully_written_and_graph_capturable():
    x = torch.randn(64, 7168, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, dtype=torch.bfloat16, device="cuda")
    ops.rms_norm(x, w)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.rms_norm(x, w)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check(y.cpu(), x.cpu(), w.cpu())


@pytest.mark.gpu
def test_gpu_runs_on_the_current_stream():
    x = torch.randn(256, 7168, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, dtype=torch.bfloat16, device="cuda")
    ops.rms_norm(x, w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x2 = x * 2
        y = ops.rms_norm(x2, w)
    s.synchronize()
    check(y.cpu(), x2.cpu(), w.cpu())
