"""Rotary embedding for MLA's 64-wide rope part: plain or YaRN frequencies, cos/sin tables.

YaRN (as DeepSeek-V3 configures it): frequencies blend interpolated (1/factor) and original ones
over a linear ramp between the correction dims of beta_fast and beta_slow; cos/sin are multiplied
by the attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim); the softmax scale
gets mscale(factor, mscale_all_dim)^2 (ModelConfig.softmax_scale).
"""

from __future__ import annotations

import math

import torch

from model.config import ModelConfig, yarn_mscale


def inv_freq_and_attention_factor(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (d/2,) fp32, factor applied to cos and sin) for d = qk_rope_head_dim."""
    rope, dim = config.rope, config.qk_rope_head_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp                                     # 1: extrapolate (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep_original) + (1.0 / pos_freqs) * keep_original
    return inv_freq, float(attention_factor)


def cos_sin_table(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_positions, d/2) fp32, attention factor included."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(config)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x (T, ..., d) by cos/sin (T, d/2) (broadcast over the middle dims).

    interleave=True rotates the pairs (x[2i], x[2i+1]) (DeepSeek's layout) and returns them
    de-interleaved, [rotated evens | rotated odds], as transformers does: q and k get the same
    permutation, so their dot products are those of DeepSeek's own rope.
    interleave=False rotates (x[i], x[i + d/2]) (rotate_half)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
