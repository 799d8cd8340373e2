"""Quantizers for the block-scaled GEMMs, and their exact dequantizers.

FP8 (e4m3): scale = amax / 448 per group (or the next power of two, UE8M0, when asked), so that
x / scale fits e4m3; the dequantized value is e4m3(x / scale) * scale exactly.
  per_token_group_quant_fp8: activations, one scale per (row, 128 columns)   -> sf (m, ceil(k/128))
  per_block_quant_fp8:       weights, one scale per 128 x 128 block           -> sf (ceil(n/128), ceil(k/128))
MXFP4 (OCP MX, e2m1 with E8M0 scales): one power-of-two scale per 32 values, 2^(floor(log2 amax) - 2)
(e2m1's largest exponent is 2, its largest value 6), values rounded to nearest even e2m1 and
packed two per byte (low nibble first).

Weights are quantized once, as torch ops on any device. Activations are quantized before every
FP8 GEMM of a forward pass, so per_token_group_quant_fp8 on a CUDA tensor (group 128, k % 128 == 0,
no UE8M0) runs one tile program, token_group_quant_program, instead of ~10 torch kernels; its
output is the torch path's, bit for bit (IEEE division, round-to-nearest-even e4m3, clamp to
+-448), except that a NaN does not spread to its whole group (the kernel's absmax skips it: the NaN
stays in its own element).
"""

# no `from __future__ import annotations` here: TileLang evaluates T.Tensor annotations
import math

import tilelang.language as T
import torch

from codegen import targets, tile
from codegen.program import tile_program
from ops import _validate as check

FP8_MAX = 448.0
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes by code 0..7
E8M0_BIAS = 127


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _fp8_scale(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    # a true division (tensor by tensor): CUDA torch turns a division by a Python scalar into a
    # product with its reciprocal (an ulp off at times), which would make devices (and the kernel) differ
    scale = amax.float() / torch.full_like(amax, FP8_MAX, dtype=torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _pow2_ceil(scale) if ue8m0 else scale


QUANT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@tile_program("token_group_quant_fp8", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950"),
              examples={"h7168-bf16": dict(k=7168), "h1536-bf16": dict(k=1536)})
def token_group_quant_program(k: int, dtype: str = "bfloat16", groups_per_block: int = 4, threads: int = 128):
    """Q[r, g*128 + j] = e4m3(clamp(X[r, g*128 + j] / S[r, g])), S[r, g] = absmax(group) / 448 (1 if 0).
    A block takes groups_per_block groups of one row; rows are symbolic (one kernel for every batch)."""
    group = 128
    groups = k // group
    per = groups_per_block
    blocks_per_row = -(-groups // per)
    rows = T.dynamic("rows")
    sdt = tile.storage_dtype(dtype)

    @T.prim_func
    def token_group_quant(X: T.Tensor((rows, k), sdt), Q: T.Tensor((rows, k), "float8_e4m3fn"),
                          S: T.Tensor((rows, groups), "float32")):
        with tile.grid(rows * blocks_per_row, threads) as bid:
            with tile.vector():
                r = bid // blocks_per_row
                g0 = bid % blocks_per_row * per
                x = tile.fragment((per, group), "float32")
                amax = tile.fragment((per,), "float32")
                for i, j in tile.parallel(per, group):
                    x[i, j] = T.if_then_else(g0 + i < groups,
                                             tile.to_f32(X[r, T.min(g0 + i, groups - 1) * group + j], dtype), 0.0)
                tile.row_reduce(x, amax, "absmax", dim=1)
                for i, j in tile.parallel(per, group):
                    if g0 + i < groups:
                        v = x[i, j] / T.if_then_else(amax[i] > 0, amax[i] / FP8_MAX, 1.0)
                        # comparisons, not min/max: a NaN stays NaN
                        Q[r, (g0 + i) * group + j] = T.cast(
                            T.if_then_else(v > FP8_MAX, FP8_MAX, T.if_then_else(v < -FP8_MAX, -FP8_MAX, v)),
                            "float8_e4m3fn")
                for i in tile.parallel(per):
                    if g0 + i < groups:
                        S[r, g0 + i] = T.if_then_else(amax[i] > 0, amax[i] / FP8_MAX, 1.0)

    return token_group_quant


def _quant_kernel_fits(x, group_size, ue8m0) -> bool:
    # (the kernel reads x 16 bytes a thread: a view that does not start 16-byte aligned takes the
    # torch path, the same bits)
    return (x.device.type in ("cuda", "npu") and group_size == 128 and not ue8m0 and x.shape[1] % 128 == 0
            and x.shape[1] > 0 and x.is_contiguous() and x.data_ptr() % 16 == 0)


def per_token_group_quant_fp8(x, group_size=128, ue8m0=False):
    """x (m, k) bf16/fp16/fp32 -> (x_fp8 (m, k) e4m3, sf (m, ceil(k/group_size)) fp32)."""
    check.tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    check.number("group_size", group_size, lo=1, integer=True)
    check.flag("ue8m0", ue8m0)
    if _quant_kernel_fits(x, group_size, ue8m0):
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        sf = torch.empty(m, k // 128, dtype=torch.float32, device=x.device)   # amax * fp32(1/448), or 1
        if m:
            kernel = token_group_quant_program.compile(targets.resolve(x), k=k, dtype=QUANT_DTYPES[x.dtype])
            kernel.launcher()(x, q, sf)
        return q, sf
    targets.resolve(x)          # (TILECRAFT_TARGET naming another device is an error here too)
    return token_group_quant_reference(x, group_size, ue8m0)


def token_group_quant_reference(x, group_size=128, ue8m0=False):
    """per_token_group_quant_fp8 as torch ops (any device; the CPU path)."""
    m, k = x.shape
    groups = math.ceil(k / group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    sf = _fp8_scale(padded.abs().amax(-1), ue8m0)                                   # [m, groups]
    q = (padded / sf[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group_size)[:, :k].contiguous(), sf


def per_block_quant_fp8(w, block=128, ue8m0=False):
    """w (n, k) -> (w_fp8 (n, k) e4m3, sf (ceil(n/block), ceil(k/block)) fp32)."""
    check.tensor("w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    check.number("block", block, lo=1, integer=True)
    check.flag("ue8m0", ue8m0)
    n, k = w.shape
    bn, bk = math.ceil(n / block), math.ceil(k / block)
    padded = torch.nn.functional.pad(w.float(), (0, bk * block - k, 0, bn * block - n))
    blocks = padded.view(bn, block, bk, block)
    sf = _fp8_scale(blocks.abs().amax(dim=(1, 3)), ue8m0)                          # [bn, bk]
    q = (blocks / sf[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bn * block, bk * block)[:n, :k].contiguous(), sf


def dequant_fp8_token_groups(x_fp8, sf, group_size=128):
    """Exact fp32 value of per_token_group_quant_fp8's output: x_fp8 (m, k) e4m3, sf (m, ceil(k/group_size))."""
    check.tensor("x_fp8", x_fp8, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check.tensor("sf", sf, dtypes=(torch.float32,), ndim=2)
    check.number("group_size", group_size, lo=1, integer=True)
    m, k = x_fp8.shape
    check.shape("sf", sf, (m, math.ceil(k / group_size)), "(m, ceil(k/group_size)) fp32")
    check.same_device(x_fp8=x_fp8, sf=sf)
    return x_fp8.float() * sf.repeat_interleave(group_size, dim=1)[:, :k]


def dequant_fp8_blocks(w_fp8, sf, block=128):
    """Exact fp32 value of per_block_quant_fp8's output: w_fp8 (n, k) e4m3, sf (ceil(n/block), ceil(k/block))."""
    check.tensor("w_fp8", w_fp8, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check.tensor("sf", sf, dtypes=(torch.float32,), ndim=2)
    check.number("block", block, lo=1, integer=True)
    n, k = w_fp8.shape
    check.shape("sf", sf, (math.ceil(n / block), math.ceil(k / block)), "(ceil(n/block), ceil(k/block)) fp32")
    check.same_device(w_fp8=w_fp8, sf=sf)
    return w_fp8.float() * sf.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]


def quant_mxfp4(w):
    """w (n, k) with k % 32 == 0 -> (packed (n, k/2) uint8, scales (n, k/32) uint8 E8M0)."""
    check.tensor("w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    n, k = w.shape
    if k % 32:
        raise ValueError(f"w's k ({k}) must be a multiple of 32 (the MX block)")
    blocks = w.float().view(n, k // 32, 32)
    amax = blocks.abs().amax(-1)                                                    # [n, k/32]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    table = FP4_VALUES.to(w.device)
    mag = scaled.abs().clamp(max=6.0)
    # nearest e2m1 magnitude, ties to the even code
    dist = (mag[..., None] - table).abs()
    best = dist.min(-1, keepdim=True).values
    candidates = torch.where(dist == best, torch.arange(8, device=w.device), 99)
    even = torch.where(candidates % 2 == 0, candidates, 99).min(-1).values
    code = torch.where(even < 99, even, candidates.min(-1).values)
    code = code | torch.where((scaled < 0) & (code != 0), 8, 0)                     # sign bit; zero is +0
    code = code.to(torch.uint8).view(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous()
    scales = (exp + E8M0_BIAS).to(torch.uint8)
    return packed, scales


def _e8m0_factor(scales):
    """2^(e - 127) per E8M0 byte, NaN for 0xFF (OCP MX)."""
    return torch.where(scales == 255, float("nan"), torch.exp2(scales.float() - E8M0_BIAS))


def dequant_mx_fp8(x_fp8, scales):
    """Exact fp32 value of e4m3 values with OCP MX scales: x (..., k) float8_e4m3fn, scales (..., k/32)
    uint8 E8M0, one per 32 values along k."""
    check.tensor("x_fp8", x_fp8, dtypes=(torch.float8_e4m3fn,))
    check.tensor("scales", scales, dtypes=(torch.uint8,))
    if x_fp8.dim() == 0:
        raise ValueError("x_fp8 must have at least one dimension (..., k), got a 0-dim tensor")
    k = x_fp8.shape[-1]
    if k % 32:
        raise ValueError(f"x_fp8's last dimension must be a multiple of 32 (one E8M0 scale per 32), got {k}")
    check.shape("scales", scales, (*x_fp8.shape[:-1], k // 32), "(..., k/32) E8M0")
    check.same_device(x_fp8=x_fp8, scales=scales)
    return x_fp8.float() * _e8m0_factor(scales).repeat_interleave(32, dim=-1)


def dequant_mxfp4(packed, scales):
    """Exact fp32 value of quant_mxfp4's output: (n, k)."""
    check.tensor("packed", packed, dtypes=(torch.uint8,), ndim=2)
    check.tensor("scales", scales, dtypes=(torch.uint8,), ndim=2)
    n, half = packed.shape
    k = half * 2
    if k % 32:
        raise ValueError(f"packed must have a multiple of 16 bytes a row (k = 2 x {half} values, a multiple of 32: "
                         f"the MX block), got shape {tuple(packed.shape)}")
    check.shape("scales", scales, (n, k // 32), "(n, k/32)")
    check.same_device(packed=packed, scales=scales)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, k).long()
    table = FP4_VALUES.to(packed.device)
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return values * _e8m0_factor(scales).repeat_interleave(32, dim=1)
