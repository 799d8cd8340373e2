"""DeepSeek-V3: embedding, decoder layers (MLA + dense MLP for the first layers, DeepSeekMoE after),
final norm, LM head. Weight names are those of DeepSeek's Hugging Face checkpoints; multi-token
prediction layers (index >= num_hidden_layers) are ignored.
"""

from __future__ import annotations

import torch

from model import kernels
from model.config import ModelConfig, load_config
from model.layers import MLP, Linear, MoE, RMSNorm
from model.mla import MLA, AttentionBatch
from model.rope import cos_sin_table
from model.weights import Checkpoint

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DecoderLayer:
    def __init__(self, attn: MLA, mlp, input_norm: RMSNorm, post_attention_norm: RMSNorm):
        self.attn, self.mlp, self.input_norm, self.post_attention_norm = attn, mlp, input_norm, post_attention_norm

    def __call__(self, h, cos, sin, batch, kv_cache):
        h = h + self.attn(self.input_norm(h), cos, sin, batch, kv_cache)
        return h + self.mlp(self.post_attention_norm(h))


class DeepseekV3:
    """The model on one device, in one dtype (the router and its bias stay fp32)."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: Linear, max_positions: int):
        self.config, self.embed, self.layers, self.norm, self.lm_head = config, embed, layers, norm, lm_head
        self.dtype, self.device = embed.dtype, embed.device
        cos, sin = cos_sin_table(config, max_positions)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.max_positions = max_positions

    @classmethod
    def from_pretrained(cls, model_dir, device="cpu", dtype: torch.dtype = torch.float32, *,
                        max_positions: int | None = None, keep_fp8: bool = False) -> "DeepseekV3":
        """Load config.json and the safetensors shards of `model_dir`.

        FP8 weights are dequantized to `dtype` here unless keep_fp8 (then linears call fp8_linear).
        max_positions sizes the rope tables (default: max_position_embeddings)."""
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
        device = torch.device(device)
        config = load_config(model_dir)
        if max_positions is None:
            max_positions = config.max_position_embeddings
        if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
        ckpt = Checkpoint(model_dir)
        kw = dict(block=config.fp8.block if config.fp8 else (128, 128), keep_fp8=keep_fp8)
        c, hd = config, config.hidden_size
        embed = ckpt.get_float("model.embed_tokens.weight", (c.vocab_size, hd), dtype, device)
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = MLA.load(ckpt, f"{p}.self_attn", c, dtype, device, **kw)
            if c.is_moe_layer(i):
                mlp = MoE.load(ckpt, f"{p}.mlp", c, dtype, device, **kw)
            else:
                mlp = MLP.load(ckpt, f"{p}.mlp", hd, c.intermediate_size, dtype, device, **kw)
            norms = [RMSNorm(ckpt.get_float(f"{p}.{n}.weight", (hd,), dtype, device), c.rms_norm_eps)
                     for n in ("input_layernorm", "post_attention_layernorm")]
            layers.append(DecoderLayer(attn, mlp, *norms))
        norm = RMSNorm(ckpt.get_float("model.norm.weight", (hd,), dtype, device), c.rms_norm_eps)
        lm_head = Linear(embed) if c.tie_word_embeddings else Linear.load(ckpt, "lm_head", c.vocab_size, hd, dtype,
                                                                           device, **kw)
        return cls(config, embed, layers, norm, lm_head, max_positions)

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches: list[torch.Tensor],
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (T,) int64 -> logits (len(logits_index) or T, vocab) fp32.

        kv_caches: one (num_blocks, page, 1, kv_lora_rank + qk_rope_head_dim) tensor per layer, in
        the model's dtype; this step's latents are written into them at batch.slot_mapping."""
        c = self.config
        if batch.decode and batch.sched is None:
            max_blocks = batch.block_table.shape[1] * kv_caches[0].shape[1] // 64
            batch.sched = kernels.mla_schedule(batch.cache_seqlens, 1, c.num_attention_heads, max_blocks, self.dtype,
                                               c.kv_lora_rank, c.qk_rope_head_dim)
        h = torch.nn.functional.embedding(input_ids, self.embed)                         # [T, hidden]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]                  # [T, dr/2]
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, batch, kv)
        if logits_index is not None:
            h = h[logits_index]
        return self.lm_head(self.norm(h)).float()

    def cache_shape(self, num_blocks: int, page: int) -> tuple[int, ...]:
        """Shape of one layer's latent cache."""
        return (num_blocks, page, 1, self.config.latent_dim)


def load_model(model_dir, device="cpu", dtype=torch.float32, **kw) -> DeepseekV3:
    return DeepseekV3.from_pretrained(model_dir, device, dtype, **kw)


__all__ = ["DeepseekV3", "DecoderLayer", "load_model", "load_config"]
