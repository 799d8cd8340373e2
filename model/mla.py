"""Multi-head latent attention over a paged latent KV cache.

Each cached token is one row of kv_lora_rank + qk_rope_head_dim values (576 for V3): the
normalized latent c_kv and the roped shared key k_pe. Prefill takes the naive path (the latents
of the whole context are expanded through kv_b_proj into per-head keys and values); decode takes
the absorbed path: q_nope is multiplied into the latent space by W_UK, attention runs over the
576-wide rows directly (ops.mla_decode), and the 512-wide result is projected out by W_UV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import kernels
from model.layers import Linear, RMSNorm

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the default eps, not rms_norm_eps (as DeepSeek/transformers)


@dataclass
class AttentionBatch:
    """Where one step's T tokens sit in the paged cache (built by the runtime).

    positions (T,) int64; slot_mapping (T,) int64: block * page + offset where each token's latent is
    written; block_table (B, max_blocks) int32; cache_seqlens (B,) int32: each sequence's cached
    tokens after this step. decode: one new token per sequence (T == B). Prefill: the tokens are
    sequence 0's query_lens[0] new tokens, then sequence 1's, ...; sequence i attends over its
    first context_lens[i] cached tokens (host ints, == cache_seqlens).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    decode: bool
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    sched: object = None          # the MLA decode schedule of this step, shared by every layer


class MLA:
    def __init__(self, config, q_proj, q_a, q_norm, q_b, kv_a, kv_norm, kv_b, o_proj, dtype):
        self.config = config
        self.q_proj, self.q_a, self.q_norm, self.q_b = q_proj, q_a, q_norm, q_b
        self.kv_a, self.kv_norm, self.kv_b, self.o_proj = kv_a, kv_norm, kv_b, o_proj
        c = config
        self.heads, self.dn, self.dr, self.dv, self.rank = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                            c.v_head_dim, c.kv_lora_rank)
        self.scale = c.softmax_scale
        w = kv_b.dequantized(dtype).view(self.heads, self.dn + self.dv, self.rank)
        self.w_uk = w[:, :self.dn].contiguous()                                          # [h, dn, R]
        self.w_uv_t = w[:, self.dn:].transpose(1, 2).contiguous()                        # [h, R, dv]

    @classmethod
    def load(cls, ckpt, prefix, config, dtype, device, **kw):
        c, hd = config, config.hidden_size
        h, qk = c.num_attention_heads, c.qk_head_dim
        bias = c.attention_bias
        q_proj = q_a = q_norm = q_b = None
        if c.q_lora_rank is None:
            q_proj = Linear.load(ckpt, f"{prefix}.q_proj", h * qk, hd, dtype, device, **kw)
        else:
            q_a = Linear.load(ckpt, f"{prefix}.q_a_proj", c.q_lora_rank, hd, dtype, device, bias=bias, **kw)
            q_norm = RMSNorm(ckpt.get_float(f"{prefix}.q_a_layernorm.weight", (c.q_lora_rank,), dtype, device),
                             LATENT_NORM_EPS)
            q_b = Linear.load(ckpt, f"{prefix}.q_b_proj", h * qk, c.q_lora_rank, dtype, device, **kw)
        kv_a = Linear.load(ckpt, f"{prefix}.kv_a_proj_with_mqa", c.latent_dim, hd, dtype, device, bias=bias, **kw)
        kv_norm = RMSNorm(ckpt.get_float(f"{prefix}.kv_a_layernorm.weight", (c.kv_lora_rank,), dtype, device),
                          LATENT_NORM_EPS)
        kv_b = Linear.load(ckpt, f"{prefix}.kv_b_proj", h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
                           dtype, device, **kw)
        o_proj = Linear.load(ckpt, f"{prefix}.o_proj", hd, h * c.v_head_dim, dtype, device, bias=bias, **kw)
        return cls(config, q_proj, q_a, q_norm, q_b, kv_a, kv_norm, kv_b, o_proj, dtype)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, dr/2), kv_cache (num_blocks, page, 1, R + dr). Returns (T, hidden)."""
        t = x.shape[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(t, self.heads, self.dn + self.dr)
        q_nope, q_pe = q[..., :self.dn], q[..., self.dn:]
        kv = self.kv_a(x)                                                                # [T, R + dr]
        latent = self.kv_norm(kv[:, :self.rank])
        interleave = self.config.rope_interleave
        q_pe = kernels.rope(q_pe, cos, sin, interleave)
        k_pe = kernels.rope(kv[:, self.rank:], cos, sin, interleave)
        kv_cache.view(-1, self.rank + self.dr).index_copy_(0, batch.slot_mapping, torch.cat([latent, k_pe], dim=-1))
        if batch.decode:
            out = self._decode(q_nope, q_pe, batch, kv_cache)
        else:
            out = self._prefill(q_nope, q_pe, batch, kv_cache)
        return self.o_proj(out.reshape(t, self.heads * self.dv))

    def _prefill(self, q_nope, q_pe, batch, kv_cache):
        """Naive path: per sequence, expand its cached latents into keys/values and attend causally."""
        page = kv_cache.shape[1]
        flat = kv_cache.view(-1, self.rank + self.dr)
        q = torch.cat([q_nope, q_pe], dim=-1)                                            # [T, h, dn + dr]
        outs, start = [], 0
        for i, (n_q, n_ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            pos = torch.arange(n_ctx, device=q.device)
            rows = flat[batch.block_table[i, pos // page].long() * page + pos % page]    # [ctx, R + dr]
            kv = self.kv_b(rows[:, :self.rank]).view(n_ctx, self.heads, self.dn + self.dv)
            k = torch.cat([kv[..., :self.dn], rows[:, None, self.rank:].expand(-1, self.heads, -1)], dim=-1)
            outs.append(kernels.mla_prefill(q[start:start + n_q], k, kv[..., self.dn:], self.scale))
            start += n_q
        return torch.cat(outs)                                                           # [T, h, dv]

    def _decode(self, q_nope, q_pe, batch, kv_cache):
        """Absorbed path: scores over the latent rows directly, one query token per sequence."""
        q_latent = kernels.bmm(q_nope.transpose(0, 1), self.w_uk)                        # [h, B, R]
        q = torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1).unsqueeze(1).contiguous()  # [B, 1, h, R + dr]
        o = kernels.mla_decode(q, kv_cache, batch.block_table, batch.cache_seqlens, self.scale, self.rank, batch.sched)
        return kernels.bmm(o[:, 0].transpose(0, 1), self.w_uv_t).transpose(0, 1)        # [B, h, dv]
