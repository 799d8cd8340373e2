"""Every op the model calls, in one table at the bottom: each line picks an implementation.

Ops from ops/ are used where they exist (rms_norm, mla_decode, moe_route / dispatch / combine, the
FP8 GEMMs); the rest are model/reference.py functions with the signature their kernel will have,
so that when it lands its line changes to ops.X. Where an op's layout does not fit (fp32 MLA,
odd GEMM shapes, the CPU for the FP8 GEMMs) the wrapper falls back to the reference. Each entry
is tagged with its op family, so `profile()` can attribute time (bench.model's decode breakdown).
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
moe_experts_static = ref.moe_experts_static                  # CUDA-graph capture only (never profiled)
silu_mul = _family("act", _silu_mul)
