"""Every op the model calls, in one table at the bottom: each line picks an implementation.

Ops from ops/ are used where they exist (rms_norm, mla_decode, moe_route / dispatch / combine, the
FP8 GEMMs); the rest are model/reference.py functions with the signature their kernel will have,
so that when it lands its line changes to ops.X. Where an op's layout does not fit (fp32 MLA,
odd GEMM shapes, the CPU for the FP8 GEMMs) the wrapper falls back to the reference. Each entry
is tagged with its op family, so `profile()` can attribute time (bench.model's decode breakdown).

MOE_PATH picks how the routed experts of keep_fp8 models run (model.layers.Experts):
  "sorted" (the default; measured on the H200 at V3 widths, bench/NOTES.md "model decode"):  eager and capture alike run moe_dispatch(layout="contiguous", align=1) -> moe_tile_items
             (block_m=64) -> quantize the rows per 128 once -> gate and up through
             ops.m_grouped_fp8_gemm_nt_sorted on the stacked w1 / w3 (no w13 copy) -> silu_mul ->
             quantize -> down (w2) the same way -> moe_combine. No host syncs once value checks are
             off or a graph is being captured. A GEMM whose shape the FP8 op does not take
             (K % 128, N % 64) runs sorted_grouped_linear's sync-free exact-dequant fallback.
             Experts without FP8 scales, or outside a GPU / fp8_ops_on_cpu(), take the padded path.
  "padded":  eager runs moe_dispatch(align=128) + grouped_linear (ops.m_grouped_fp8_gemm_nt_contiguous)
             + moe_combine; CUDA-graph capture runs moe_experts_static (every expert on every token,
             ops.fp8_gemm_nt): the first path, kept as the sorted one's check.
Set it with `kernels.MOE_PATH = "padded"`, or for a block with `with kernels.moe_path("padded"):`.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import ops
from model import reference as ref
from model.rope import apply_rope

_profile: dict | None = None     # family -> [seconds, calls] while profiling
_sync = None
_simulated_capture = 0           # > 0 inside simulated_capture()
_fp8_ops_on_cpu = 0              # > 0 inside fp8_ops_on_cpu()
MOE_PATHS = ("sorted", "padded")
MOE_PATH = "sorted"              # the routed experts' path for FP8-kept weights (see the docstring)


def _family(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if _profile is None:
            return fn(*args, **kwargs)
        _sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        slot = _profile[name]
        slot[0] += time.perf_counter() - t0
        slot[1] += 1
        return out

    timed.family = name
    return timed


@contextmanager
def profile(device: torch.device):
    """Time every op call by family (synchronizing the device around each: use on eager runs only).
    Yields the dict family -> [seconds, calls], filled as the ops run."""
    global _profile, _sync
    result: dict = defaultdict(lambda: [0.0, 0])
    dev = torch.device(device)
    _sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    _profile = result
    try:
        yield result
    finally:
        _profile, _sync = None, None


def capturing(x: torch.Tensor) -> bool:
    """Whether work on x's device is being recorded into a graph (no host syncs, routing-independent
    shapes): a CUDA graph capture on the current stream, or simulated_capture() (tests, any device)."""
    return _simulated_capture > 0 or (x.is_cuda and torch.cuda.is_current_stream_capturing())


@contextmanager
def simulated_capture():
    """Make capturing() true (runtime.cuda_graph.ReplayRecorder: the graph path on a CPU)."""
    global _simulated_capture
    _simulated_capture += 1
    try:
        yield
    finally:
        _simulated_capture -= 1


def _kernel_layout(dtype, latent_dim, rope_dim, h_q) -> bool:
    return dtype in (torch.bfloat16, torch.float16) and (latent_dim, rope_dim) == (512, 64) and h_q <= 128


def _mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, latent_dim, sched=None):
    """Absorbed MLA decode over the paged latent cache; returns out (b, s_q, h_q, latent_dim) in q's dtype.

    Tilecraft's kernel where its layout applies (bf16/fp16, 512 + 64, h_q <= 128); otherwise (fp32
    models, other widths) the op's own torch reference, so both run the same math."""
    if _kernel_layout(q.dtype, latent_dim, q.shape[-1] - latent_dim, q.shape[2]):
        out, _ = ops.mla_decode(q, kv_cache, block_table, cache_seqlens, 512, softmax_scale=softmax_scale,
                                causal=True, sched=sched)
        return out
    out, _ = ops.mla_decode_reference(q, kv_cache, block_table, cache_seqlens, latent_dim,
                                      softmax_scale=softmax_scale, causal=True)
    return out.to(q.dtype)


def mla_schedule(cache_seqlens, s_q, h_q, max_blocks, q_dtype, latent_dim, rope_dim):
    """The split schedule of one decode step (shared by every layer), or None where not needed."""
    if cache_seqlens.is_cuda and _kernel_layout(q_dtype, latent_dim, rope_dim, h_q):
        return ops.get_mla_schedule(cache_seqlens, s_q, h_q, max_blocks)
    return None


@contextmanager
def fp8_ops_on_cpu():
    """Run keep_fp8 models' GEMMs through the FP8 ops on CPU tensors too (tests): activations are
    quantized per (row, 128 columns) and ops.fp8_gemm_nt / m_grouped_fp8_gemm_nt_contiguous run their
    exact-dequant CPU references, so the CPU computes what the GPU kernels compute (W8A8), wiring included."""
    global _fp8_ops_on_cpu
    _fp8_ops_on_cpu += 1
    try:
        yield
    finally:
        _fp8_ops_on_cpu -= 1


def _fp8_ops_device(x) -> bool:
    return x.is_cuda or (_fp8_ops_on_cpu > 0 and x.device.type == "cpu")


def _fp8_gemm_fits(x, weight, block_size) -> bool:
    """Where Tilecraft's FP8 GEMMs apply: a GPU (or the CPU inside fp8_ops_on_cpu()), 128x128 weight
    blocks, K % 128 == 0, N % 64 == 0."""
    n, k = weight.shape[-2:]
    return (_fp8_ops_device(x) and tuple(block_size) == (128, 128) and k % 128 == 0 and n % 64 == 0
            and x.dtype in (torch.bfloat16, torch.float32))


def _fp8_linear(x, weight, weight_scale_inv, block_size=(128, 128)):
    """x (..., K) @ dequant(weight (N, K) e4m3).T -> (..., N) in x's dtype.

    ops.fp8_gemm_nt where it fits, x quantized per (row, 128 columns) first (DeepGEMM's operand,
    as DeepSeek's own inference does); elsewhere the exact-dequant reference (no activation rounding)."""
    if not _fp8_gemm_fits(x, weight, block_size):
        return ref.fp8_linear(x, weight, weight_scale_inv, block_size)
    n, k = weight.shape
    a, sfa = ops.per_token_group_quant_fp8(x.reshape(-1, k), 128)
    return ops.fp8_gemm_nt(a, sfa, weight, weight_scale_inv, out_dtype=x.dtype).reshape(*x.shape[:-1], n)


def _grouped_linear(x, m_indices, weight, weight_scale_inv=None, block_size=(128, 128)):
    """The m-grouped GEMM over moe_dispatch's contiguous rows (see reference.grouped_linear): FP8 experts
    on a GPU take ops.m_grouped_fp8_gemm_nt_contiguous where it fits, the rest the reference."""
    if weight_scale_inv is not None and _fp8_gemm_fits(x, weight, block_size) and x.shape[0] % 128 == 0:
        a, sfa = ops.per_token_group_quant_fp8(x, 128)
        return ops.m_grouped_fp8_gemm_nt_contiguous(a, sfa, weight, weight_scale_inv, m_indices, out_dtype=x.dtype)
    return ref.grouped_linear(x, m_indices, weight, weight_scale_inv, block_size)


def grouped_gemm_align(x, fp8: bool) -> int:
    """Rows per expert segment that moe_dispatch must pad to: 128 for the FP8 grouped GEMM, else 1."""
    return 128 if fp8 and _fp8_ops_device(x) else 1


@contextmanager
def moe_path(path: str):
    """Run the block with MOE_PATH = path ("sorted" or "padded"), restoring it after."""
    global MOE_PATH
    if path not in MOE_PATHS:
        raise ValueError(f"moe path must be one of {MOE_PATHS}, got {path!r}")
    saved, MOE_PATH = MOE_PATH, path
    try:
        yield
    finally:
        MOE_PATH = saved


def moe_sorted_on(x, fp8: bool) -> bool:
    """Whether the routed experts take the sorted path: MOE_PATH == "sorted", FP8 experts, and the FP8
    ops' device (a GPU, or the CPU inside fp8_ops_on_cpu())."""
    if MOE_PATH not in MOE_PATHS:
        raise ValueError(f"kernels.MOE_PATH must be one of {MOE_PATHS}, got {MOE_PATH!r}")
    return MOE_PATH == "sorted" and fp8 and _fp8_ops_device(x) and x.dtype in (torch.bfloat16, torch.float32)


def _moe_dispatch_sorted(x, ids, num_experts):
    """moe_dispatch(layout="contiguous", align=1) (exactly T*k rows sorted by expert, no host sync) and
    the (expert, first row, count) work items of its 64-row chunks: (rows, mapping, items)."""
    rows, _, mapping = ops.moe_dispatch(x, ids, num_experts, layout="contiguous", align=1)
    items = ops.moe_tile_items(mapping, num_experts, block_m=ops.gemm_fp8.SORTED_BLOCK_M)
    return rows, mapping, items


def _quant_rows(x):
    """(x, (e4m3, per-128 scales)) for the sorted GEMMs (one quantization shared by gate and up)."""
    return (x, ops.per_token_group_quant_fp8(x, 128)) if x.shape[-1] % 128 == 0 else (x, None)


def _sorted_grouped_linear(xq, m_indices, items, weight, weight_scale_inv, block_size=(128, 128)):
    """The grouped GEMM over moe_dispatch(align=1)'s sorted rows, xq = quant_rows(rows): the FP8 sorted
    op (ops.m_grouped_fp8_gemm_nt_sorted over `items`) where it fits, else the exact-dequant product
    per expert masked to its rows (every expert on every row: shape-static, no host sync). (M, N)."""
    x, q = xq
    if q is not None and _fp8_gemm_fits(x, weight, block_size):
        return ops.m_grouped_fp8_gemm_nt_sorted(q[0], q[1], weight, weight_scale_inv, items, out_dtype=x.dtype)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        w = ref.fp8_dequantize(weight[e], weight_scale_inv[e], block_size, x.dtype)
        out = torch.where((m_indices == e)[:, None], F.linear(x, w), out)
    return out


def _silu_mul(gate, up):
    return F.silu(gate) * up


# ---- the table ---------------------------------------------------------------------------------------
rms_norm = _family("rms_norm", ops.rms_norm)
linear = _family("gemm", F.linear)
bmm = _family("gemm", torch.bmm)
fp8_linear = _family("fp8_gemm", _fp8_linear)                 # ops.fp8_gemm_nt where it fits
rope = _family("rope", apply_rope)
mla_decode = _family("mla_decode", _mla_decode)
mla_prefill = _family("mla_prefill", ref.mla_prefill)
moe_route = _family("moe_route", ops.moe_route)               # reference: model.reference.moe_route
moe_dispatch = _family("moe_dispatch", ops.moe_dispatch)
grouped_linear = _family("moe_gemm", _grouped_linear)         # ops.m_grouped_fp8_gemm_nt_contiguous for FP8
moe_combine = _family("moe_combine", ops.moe_combine)
moe_dispatch_sorted = _family("moe_dispatch", _moe_dispatch_sorted)  # MOE_PATH "sorted": align=1 + items
quant_rows = _family("moe_gemm", _quant_rows)                 # MOE_PATH "sorted": per-128 row quantization
sorted_grouped_linear = _family("moe_gemm", _sorted_grouped_linear)  # ops.m_grouped_fp8_gemm_nt_sorted
moe_experts_static = ref.moe_experts_static                  # CUDA-graph capture only (never profiled)
silu_mul = _family("act", _silu_mul)
