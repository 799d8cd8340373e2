"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, rounded once.

One tile program lowers to every target (cuda:sm_90a, cuda:sm_100a, ascend:950, cpu): a block
normalizes one row; the row lives in a register fragment spread over the block's threads.
Memory-bound: bytes = 2 * rows * hidden * elem_size (+ the weight, read from L2).
"""

# no `from __future__ import annotations` here: TileLang evaluates T.Tensor annotations
# against the builder's locals, which postponed annotations would hide
import tilelang.language as T
import torch

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch
from ops import _validate as check

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
MAX_HIDDEN_GPU = 16384  # the row must fit in registers: hidden / threads fp32 values per thread


def pick_threads(hidden: int) -> int:
    """The widest block whose threads each get a whole number of 8-element vectors, else 128."""
    for threads in (256, 128, 64, 32):
        if hidden % (threads * 8) == 0 and hidden // threads <= 64:
            return threads
    return 128 if hidden >= 1024 else 32


@tile_program(
    "rmsnorm",
    examples={"v3-hidden": dict(hidden=7168), "q-lora": dict(hidden=1536), "kv-lora": dict(hidden=512)},
)
def rmsnorm_program(hidden: int, dtype: str = "bfloat16", eps: float = 1e-6, threads: int = 0):
    """RMSNorm over rows of length `hidden`; the row count is symbolic (one kernel for every batch).

    The row tile is padded to a multiple of the thread count (zeros past `hidden`), so any hidden
    size gets a register layout."""
    threads = threads or pick_threads(hidden)
    padded = -(-hidden // threads) * threads
    rows = T.dynamic("rows")
    sdt = tile.storage_dtype(dtype)

    @T.prim_func
    def rmsnorm(X: T.Tensor((rows, hidden), sdt), W: T.Tensor((hidden,), sdt), Y: T.Tensor((rows, hidden), sdt)):
        with tile.grid(rows, threads) as r:
            with tile.vector():
                x = tile.fragment((padded,), "float32")
                sq = tile.fragment((padded,), "float32")
                total = tile.fragment((1,), "float32")
                for j in tile.parallel(padded):
                    x[j] = T.if_then_else(j < hidden, tile.to_f32(X[r, T.min(j, hidden - 1)], dtype), 0.0)
                for j in tile.parallel(padded):
                    sq[j] = x[j] * x[j]
                tile.row_reduce(sq, total, "sum", dim=0)
                for j in tile.parallel(padded):
                    if j < hidden:
                        Y[r, j] = tile.from_f32(x[j] * T.rsqrt(total[0] / hidden + eps) * tile.to_f32(W[j], dtype), dtype)

    return rmsnorm


_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate_reference(x, weight, eps):
    """The reference's checks: the op's, less its kernel limits (any floating dtype, weight's may differ
    from x's, any device, any strides, any hidden size)."""
    check.tensor("x", x, dtypes=_REFERENCE_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., hidden), got shape {tuple(x.shape)}")
    check.tensor("weight", weight, dtypes=_REFERENCE_DTYPES, ndim=1)
    check.shape("weight", weight, (x.shape[-1],), "(hidden,) matching x's last dimension")
    check.same_device(x=x, weight=weight)
    check.number("eps", eps, lo=0.0)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 torch reference (rounded once to x's dtype). x (..., hidden) and weight (hidden,) of any floating
    dtype (fp16, bf16, fp32, fp64), on one device, any strides; eps a number >= 0."""
    _validate_reference(x, weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _validate(x, weight, eps):
    check.tensor("x", x, dtypes=DTYPES, contiguous=True)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., hidden), got shape {tuple(x.shape)}")
    check.tensor("weight", weight, dtypes=(x.dtype,), ndim=1, contiguous=True)
    check.shape("weight", weight, (x.shape[-1],), "(hidden,) matching x's last dimension")
    check.same_device(x=x, weight=weight)
    check.number("eps", eps, lo=0.0)
    hidden = x.shape[-1]
    if hidden < 1:
        raise ValueError("x's last dimension (hidden) must be at least 1, got 0")
    if x.device.type == "cuda" and hidden > MAX_HIDDEN_GPU:
        raise ValueError(f"x's hidden size {hidden} exceeds the GPU kernel's limit of {MAX_HIDDEN_GPU}")
    if x.device.type == "cuda":
        check.aligned("x", x, 16, "the kernel reads its rows 16 bytes a thread")


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // hidden
    if rows == 0:
        return out
    target = targets.resolve(x, weight)
    dtype = DTYPES[x.dtype]
    launch = jit.launchers(("rmsnorm", target.name, hidden, dtype, float(eps)), lambda: (
        rmsnorm_program.compile(target, hidden=hidden, dtype=dtype, eps=float(eps)).launcher()))
    weight = check.aligned_copy(weight)  # (read 16 bytes a thread; hidden elements: copied)
    launch(x.view(rows, hidden), weight, out.view(rows, hidden))
    return out


@torch.library.custom_op("tilecraft::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_impl(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x (..., hidden) with weight (hidden,), both bf16, fp16 or fp32, same dtype.

    Returns a tensor like x. Runs Tilecraft's kernel for the tensors' device (CUDA sm_90a /
    sm_100a, Ascend 950, or the CPU through TileLang's C target).
    """
    _validate(x, weight, eps)
    return _dispatch.call(_rms_norm_op, _rms_norm_impl, x, weight, float(eps))
