"""Write a small random DeepSeek-V3 checkpoint (config.json + sharded safetensors) for tests and demos.

    python -m model.make_tiny OUT_DIR --arch deepseek_v3 [--fp8] [--seed 0] [--layers 3] [--dense-layers 1]
                              [--experts 16] [--q-lora-rank 96 (0: no q_lora)] [--yarn] [--dtype bfloat16]

Tensor names and dtypes are DeepSeek's (per-expert weights, fp32 e_score_correction_bias; with
--fp8, every projection weight is e4m3 with a 128x128-block weight_scale_inv), so transformers'
DeepseekV3ForCausalLM loads the same files. The MLA widths stay those of V3 (kv_lora_rank 512,
qk_rope_head_dim 64: the 576-wide latent cache of ops.mla_decode); everything else is small.
Weights are scaled so that logits are well separated (greedy decoding is not decided by rounding).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.config import config_from_dict
from model.reference import fp8_quantize

ARCHS = ("deepseek_v3",)
FP8_BLOCK = (128, 128)

TINY_DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=512, hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5, num_experts_per_tok=4,
    n_group=4, topk_group=2, first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc",
    kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True,
    attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    initializer_range=0.02, dtype="bfloat16",
)
YARN = dict(type="yarn", factor=32.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)   # DeepSeek-V3's rope_scaling (40 over 4096), shrunk to a 64-token context


def tiny_config(arch: str = "deepseek_v3", **overrides) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cfg = dict(TINY_DEEPSEEK_V3)
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights for every tensor of a DeepSeek-V3 checkpoint of config `cfg`."""
    c = config_from_dict(cfg)
    g = torch.Generator().manual_seed(seed)

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    hd, h = c.hidden_size, c.num_attention_heads
    w = {"model.embed_tokens.weight": torch.randn(c.vocab_size, hd, generator=g)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if c.q_lora_rank is None:
            w[f"{a}.q_proj.weight"] = lin(h * c.qk_head_dim, hd)
        else:
            w[f"{a}.q_a_proj.weight"] = lin(c.q_lora_rank, hd)
            w[f"{a}.q_a_layernorm.weight"] = norm(c.q_lora_rank)
            w[f"{a}.q_b_proj.weight"] = lin(h * c.qk_head_dim, c.q_lora_rank)
        w[f"{a}.kv_a_proj_with_mqa.weight"] = lin(c.latent_dim, hd)
        w[f"{a}.kv_a_layernorm.weight"] = norm(c.kv_lora_rank)
        w[f"{a}.kv_b_proj.weight"] = lin(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        w[f"{a}.o_proj.weight"] = lin(hd, h * c.v_head_dim)
        if c.attention_bias:
            for n, size in (("q_a_proj", c.q_lora_rank), ("kv_a_proj_with_mqa", c.latent_dim), ("o_proj", hd)):
                if size:
                    w[f"{a}.{n}.bias"] = 0.1 * torch.randn(size, generator=g)
        mlps = []
        if c.is_moe_layer(i):
            w[f"{p}.mlp.gate.weight"] = lin(c.n_routed_experts, hd)
            w[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(c.n_routed_experts, generator=g)
            mlps += [(f"{p}.mlp.experts.{e}", c.moe_intermediate_size) for e in range(c.n_routed_experts)]
            if c.n_shared_experts:
                mlps.append((f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts))
        else:
            mlps.append((f"{p}.mlp", c.intermediate_size))
        for m, inter in mlps:
            w[f"{m}.gate_proj.weight"] = lin(inter, hd)
            w[f"{m}.up_proj.weight"] = lin(inter, hd)
            w[f"{m}.down_proj.weight"] = lin(hd, inter)
        w[f"{p}.input_layernorm.weight"] = norm(hd)
        w[f"{p}.post_attention_layernorm.weight"] = norm(hd)
    w["model.norm.weight"] = norm(hd)
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = 2.0 * lin(c.vocab_size, hd)
    return w


def is_fp8_weight(name: str) -> bool:
    """The tensors DeepSeek ships in FP8: every projection inside the decoder layers (not the router)."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and "_proj" in parts[-2]


def make_tiny(out_dir, arch: str = "deepseek_v3", *, fp8: bool = False, seed: int = 0, shards: int = 2,
              dtype: str = "bfloat16", **overrides) -> Path:
    """Write config.json, `shards` safetensors files and their index into out_dir. Returns out_dir."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    cfg = tiny_config(arch, dtype=dtype, **overrides)
    weights = random_weights(cfg, seed)
    store = getattr(torch, dtype)
    tensors = {}
    for name, t in weights.items():
        if fp8 and is_fp8_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = fp8_quantize(t, FP8_BLOCK)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = t.float()
        else:
            tensors[name] = t.to(store)
    if fp8:
        cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                          weight_block_size=list(FP8_BLOCK))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    groups = [[n] + ([n + "_scale_inv"] if n + "_scale_inv" in tensors else [])
              for n in sorted(tensors) if not n.endswith("_scale_inv")]        # a weight and its scale share a shard
    per = -(-len(groups) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = {n: tensors[n].contiguous() for g in groups[s * per:(s + 1) * per] for n in g}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return out


def dequantize_checkpoint(src, dst, dtype: torch.dtype = torch.float32) -> Path:
    """Write a copy of FP8 checkpoint `src` with every e4m3 weight dequantized (and no
    quantization_config): what transformers on a CPU without accelerate can load."""
    from safetensors.torch import load_file

    from model.reference import fp8_dequantize
    from model.weights import FP8_DTYPE, INDEX_FILE

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config", {}).get("weight_block_size", FP8_BLOCK))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shards = {f: load_file(str(f)) for f in sorted(src.glob("*.safetensors"))}
    every = {k: v for t in shards.values() for k, v in t.items()}
    for f, t in shards.items():
        out = {k: fp8_dequantize(v, every[k + "_scale_inv"], block, dtype) if v.dtype == FP8_DTYPE else v
               for k, v in t.items() if not k.endswith("_scale_inv")}
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.make_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="deepseek_v3", choices=ARCHS)
    ap.add_argument("--fp8", action="store_true", help="e4m3 projection weights with 128x128 weight_scale_inv")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=TINY_DEEPSEEK_V3["num_hidden_layers"])
    ap.add_argument("--dense-layers", type=int, default=TINY_DEEPSEEK_V3["first_k_dense_replace"],
                    help="first_k_dense_replace: layers before it use the dense MLP")
    ap.add_argument("--experts", type=int, default=TINY_DEEPSEEK_V3["n_routed_experts"])
    ap.add_argument("--q-lora-rank", type=int, default=TINY_DEEPSEEK_V3["q_lora_rank"], help="0: no q_lora (q_proj)")
    ap.add_argument("--yarn", action="store_true", help="yarn rope_scaling like DeepSeek-V3's (factor 32 over a 64-token "
                                                        "original context)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--shards", type=int, default=2)
    args = ap.parse_args(argv)
    overrides = dict(num_hidden_layers=args.layers, first_k_dense_replace=args.dense_layers,
                     n_routed_experts=args.experts, q_lora_rank=args.q_lora_rank or None)
    if args.yarn:
        overrides["rope_scaling"] = dict(YARN)
    try:
        out = make_tiny(args.out_dir, args.arch, fp8=args.fp8, seed=args.seed, shards=args.shards, dtype=args.dtype,
                        **overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
