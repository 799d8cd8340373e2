"""DeepSeek-V3 configuration, read from a Hugging Face config.json (model_type "deepseek_v3").

Missing fields take transformers' DeepseekV3Config defaults, so a config.json means the same
model here and there. Rope settings may come as `rope_parameters` (transformers 5) or
`rope_scaling` + `rope_theta` (as DeepSeek ships them); "default" and "yarn" rope are supported.
One difference: `moe_layer_freq` is honoured as DeepSeek's code does (MoE where i >= first_k_dense_replace
and i % moe_layer_freq == 0); transformers ignores it. DeepSeek-V3 ships 1, where the two agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MODEL_TYPES = ("deepseek_v3",)
ROPE_TYPES = ("default", "yarn")

# transformers' DeepseekV3Config defaults (the full-size model)
_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    moe_layer_freq=1, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, rope_interleave=True,
    attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc",
)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
                  "moe_layer_freq")
_NON_NEGATIVE_INTS = ("n_shared_experts", "qk_nope_head_dim", "first_k_dense_replace")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Fp8Config:
    """FP8 e4m3 weights with one fp32 `weight_scale_inv` per (block[0] x block[1]) weight tile."""

    block: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    norm_topk_prob: bool
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    rope_interleave: bool
    attention_bias: bool
    scoring_func: str
    rope: RopeConfig = field(default_factory=RopeConfig)
    fp8: Fp8Config | None = None
    torch_dtype: str | None = None
    model_type: str = "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: the kv_lora_rank latent + the shared rope key (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim)^2 when rope is scaled."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _bad(name: str, expected: str, got) -> ValueError:
    return ValueError(f"config.json field {name!r} must be {expected}, got {got!r}")


def _int(d: dict, name: str, lo: int | None = None, optional: bool = False):
    v = d.get(name, _DEFAULTS.get(name))
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise _bad(name, "an int" + (f" >= {lo}" if lo is not None else ""), v)
    return v


def _float(d: dict, name: str, lo: float | None = None) -> float:
    v = d.get(name, _DEFAULTS.get(name))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (lo is not None and v < lo):
        raise _bad(name, "a number" + (f" >= {lo}" if lo is not None else ""), v)
    return float(v)


def _bool(d: dict, name: str) -> bool:
    v = d.get(name, _DEFAULTS.get(name))
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _rope(d: dict) -> RopeConfig:
    # transformers: rope_scaling wins over rope_parameters; a theta inside the dict wins over the top level
    raw = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise _bad("rope_parameters", "an object", raw)
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope type {rope_type!r} is not supported (expected one of {ROPE_TYPES})")
    theta = raw.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise _bad("rope_theta", "a number > 1", theta)
    if rope_type == "default":
        return RopeConfig("default", float(theta))
    factor = raw.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise _bad("rope_parameters.factor", "a number >= 1 for yarn rope", factor)
    orig = d.get("original_max_position_embeddings",
                 raw.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096)))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise _bad("rope_parameters.original_max_position_embeddings", "a positive int", orig)

    def num(key, default=None):
        v = raw.get(key, default)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise _bad(f"rope_parameters.{key}", "a number", v)
        return None if v is None else float(v)

    return RopeConfig("yarn", float(theta), float(factor), orig,
                      beta_fast=num("beta_fast") or 32.0, beta_slow=num("beta_slow") or 1.0,
                      mscale=num("mscale"), mscale_all_dim=num("mscale_all_dim"),
                      attention_factor=num("attention_factor"), truncate=bool(raw.get("truncate", True)))


def _fp8(d: dict) -> Fp8Config | None:
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        got = q.get("quant_method") if isinstance(q, dict) else q
        raise ValueError(f"config.json quantization_config.quant_method {got!r} is not supported (expected 'fp8')")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _bad("quantization_config.fmt", "'e4m3'", fmt)
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _bad("quantization_config.weight_block_size", "two positive ints", block)
    return Fp8Config(tuple(block), str(q.get("activation_scheme", "dynamic")))


def config_from_dict(d: dict) -> ModelConfig:
    """Parse a config.json dict; every error names the field, what came and what was expected."""
    if not isinstance(d, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    ints = {n: _int(d, n, lo=1) for n in _POSITIVE_INTS}
    ints.update({n: _int(d, n, lo=0) for n in _NON_NEGATIVE_INTS})
    n_routed = _int(d, "n_routed_experts", lo=0, optional=True) or 0
    q_lora = _int(d, "q_lora_rank", lo=1, optional=True)
    n_group = _int(d, "n_group", lo=1, optional=True) or 1
    topk_group = _int(d, "topk_group", lo=1, optional=True) or 1
    top_k = _int(d, "num_experts_per_tok", lo=1, optional=True) or 1
    if n_routed:
        if n_routed % n_group:
            raise _bad("n_group", f"a divisor of n_routed_experts ({n_routed})", n_group)
        if n_group > 1 and n_routed // n_group < 2:
            raise _bad("n_group", "small enough to leave >= 2 experts per group (group score = top-2 sum)", n_group)
        if topk_group > n_group:
            raise _bad("topk_group", f"<= n_group ({n_group})", topk_group)
        if top_k > n_routed // n_group * topk_group:
            raise _bad("num_experts_per_tok", f"<= the experts of topk_group groups ({n_routed // n_group * topk_group})",
                       top_k)
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise _bad("hidden_act", "'silu'", hidden_act)
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise _bad("scoring_func", "'sigmoid' (DeepSeek-V3's gate)", scoring)
    topk_method = d.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise _bad("topk_method", "'noaux_tc' (DeepSeek-V3's gate)", topk_method)
    eos = d.get("eos_token_id", _DEFAULTS["eos_token_id"])
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise _bad("eos_token_id", "an int, a list of ints or null", eos)
    if ints["qk_rope_head_dim"] % 2:
        raise _bad("qk_rope_head_dim", "even", ints["qk_rope_head_dim"])
    return ModelConfig(
        **ints,
        n_routed_experts=n_routed,
        routed_scaling_factor=_float(d, "routed_scaling_factor", lo=0.0),
        q_lora_rank=q_lora,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        norm_topk_prob=_bool(d, "norm_topk_prob"),
        hidden_act=hidden_act,
        rms_norm_eps=_float(d, "rms_norm_eps", lo=0.0),
        bos_token_id=_int(d, "bos_token_id", lo=0, optional=True),
        eos_token_ids=eos_ids,
        tie_word_embeddings=_bool(d, "tie_word_embeddings"),
        rope_interleave=_bool(d, "rope_interleave"),
        attention_bias=_bool(d, "attention_bias"),
        scoring_func=scoring,
        rope=_rope(d),
        fp8=_fp8(d),
        torch_dtype=d.get("dtype", d.get("torch_dtype")),
        model_type=model_type,
    )


def load_config(model_dir) -> ModelConfig:
    """Read MODEL_DIR/config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir} (expected a Hugging Face checkpoint directory)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return config_from_dict(d)
