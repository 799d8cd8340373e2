"""model/: config.json parsing, checkpoint loading and its errors, the MoE / FP8 / rope references,
and prefill logits against transformers' DeepseekV3ForCausalLM on tiny random checkpoints (CPU, fp32)."""

import json
import math

import pytest
import torch

import ops
from safetensors.torch import load_file, save_file

from model import AttentionBatch, CheckpointError, DeepseekV3, config_from_dict, load_config
from model import reference as ref
from model.layers import Experts
from model.make_tiny import YARN, make_tiny
from model.rope import inv_freq_and_attention_factor

transformers = pytest.importorskip("transformers")

# The fields of DeepSeek-V3's own config.json (as shipped on the Hub).
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# Tiny checkpoints compared with transformers (all keep V3's 512 + 64 latent: ops.mla_decode's layout).
CASES = {
    "moe-no-q-lora": dict(q_lora_rank=None),
    "dense-only-q-lora-yarn": dict(first_k_dense_replace=3, rope_scaling=dict(YARN)),
    "moe-yarn-mscale-tied-biased": dict(
        rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=256, mscale=0.8,
                             mscale_all_dim=0.9, rope_theta=5000.0),
        rms_norm_eps=1e-5, rope_interleave=False, attention_bias=True, tie_word_embeddings=True,
        norm_topk_prob=False, n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=2),
    "fp8-moe": dict(fp8=True),
}


@pytest.fixture(scope="session")
def tiny(make_checkpoint):
    """tiny(case) -> (checkpoint dir, dir transformers loads: a dequantized copy for FP8)."""
    return lambda case: make_checkpoint(f"model-{case}", seed=0 + list(CASES).index(case), **CASES[case])


def load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info  # nothing randomly initialized
    return model.eval()


def prefill_logits(model: DeepseekV3, ids: list[int]) -> torch.Tensor:
    """One sequence through the naive prefill path, its pages in reverse order in the cache."""
    n, page = len(ids), 64
    nb = -(-n // page)
    kv = [torch.full(model.cache_shape(nb + 2, page), float("nan")) for _ in model.layers]
    table = torch.arange(nb, 0, -1, dtype=torch.int32)[None]
    pos = torch.arange(n)
    slots = table[0, pos // page].long() * page + pos % page
    batch = AttentionBatch(pos, slots, table, torch.tensor([n], dtype=torch.int32), decode=False,
                           query_lens=[n], context_lens=[n])
    with torch.inference_mode():
        return model.forward(torch.tensor(ids), batch, kv)


# ---- config ------------------------------------------------------------------------------------------

def test_config_reads_deepseek_v3_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_JSON))
    c = load_config(tmp_path)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (7168, 61, 128, 129280)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.latent_dim, c.qk_head_dim) == (512, 64, 576, 192)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
    assert c.q_lora_rank == 1536 and c.eos_token_ids == (1,) and c.rope_interleave
    assert c.rope.rope_type == "yarn" and c.rope.factor == 40 and c.rope.original_max_position_embeddings == 4096
    assert c.fp8.block == (128, 128)
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    mscale = 0.1 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)


def test_config_defaults_are_transformers_defaults():
    ours = config_from_dict({"model_type": "deepseek_v3"})
    hf = transformers.DeepseekV3Config()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
                 "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
                 "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_interleave", "attention_bias"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.rope.rope_type == "default" and ours.rope.theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("change, exc, msg", [
    ({"model_type": "llama"}, ValueError, r"model_type must be one of \('deepseek_v3',\), got 'llama'"),
    ({"model_type": None}, ValueError, "model_type must be one of"),
    ({"hidden_size": "7168"}, ValueError, "'hidden_size' must be an int >= 1, got '7168'"),
    ({"num_hidden_layers": 0}, ValueError, "'num_hidden_layers' must be an int >= 1, got 0"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2}}, ValueError, "rope type 'dynamic' is not supported"),
    ({"rope_scaling": {"type": "yarn"}}, ValueError, "'rope_parameters.factor' must be a number >= 1"),
    ({"quantization_config": {"quant_method": "awq"}}, ValueError, "quant_method 'awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, ValueError, "weight_block_size"),
    ({"hidden_act": "gelu"}, ValueError, "'hidden_act' must be 'silu'"),
    ({"n_group": 7}, ValueError, "'n_group' must be a divisor of n_routed_experts"),
    ({"topk_group": 9}, ValueError, "'topk_group' must be <= n_group"),
    ({"scoring_func": "softmax"}, ValueError, "'scoring_func' must be 'sigmoid'"),
    ({"norm_topk_prob": 1}, ValueError, "'norm_topk_prob' must be true or false"),
])
def test_config_errors_name_the_field(change, exc, msg):
    with pytest.raises(exc, match=msg):
        config_from_dict({**DEEPSEEK_V3_JSON, **change})


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(TypeError, match="config must be a dict"):
        config_from_dict([1, 2])


@pytest.mark.parametrize("rope", [
    dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=1.0),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=256, mscale=0.8, mscale_all_dim=0.9),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, mscale=0.707),
    dict(rope_type="default"),
])
def test_rope_and_softmax_scale_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    d = {**DEEPSEEK_V3_JSON, "rope_scaling": dict(rope), "max_position_embeddings": 8192}
    d.pop("quantization_config")
    hf_cfg = transformers.DeepseekV3Config.from_dict(d)
    ours = config_from_dict(d)
    inv_freq, factor = inv_freq_and_attention_factor(ours)
    if ours.rope.rope_type == "yarn":
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None)
    else:
        hf_inv, hf_factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    torch.testing.assert_close(inv_freq, hf_inv, rtol=0, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(DeepseekV3Attention(hf_cfg, 0).scaling, rel=1e-12)


# ---- references ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("e, k, n_group, topk_group, renorm, scale", [
    (16, 4, 4, 2, True, 2.5), (16, 2, 1, 1, True, 1.0), (32, 8, 8, 4, True, 2.5), (8, 3, 2, 1, False, 1.5)])
def test_moe_route_matches_transformers_router(e, k, n_group, topk_group, renorm, scale):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=e, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                                        topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(e + k)
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))                      # router logits == its input
        router.e_score_correction_bias.copy_(0.5 * torch.randn(e, generator=g))
    logits = 2 * torch.randn(37, e, generator=g)
    with torch.no_grad():
        _, hf_w, hf_ids = router(logits)
    hf_order = hf_ids.sort(-1)
    for route in (ref.moe_route, ops.moe_route):           # our reference, and the op the model calls
        w, ids = route(logits, k, bias=router.e_score_correction_bias, n_group=n_group, topk_group=topk_group,
                       renormalize=renorm, routed_scaling_factor=scale)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (37, k)
        order = ids.long().sort(-1)
        assert torch.equal(order.values, hf_order.values)
        torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices), rtol=1e-6, atol=1e-7)


def test_moe_route_semantics_by_hand():
    # 4 experts in 2 groups. Unbiased, expert 0 is best; the bias makes group {2, 3} win (top-2 sums:
    # group 0: 0.9 + 0.1, group 1: 0.6 + 0.6), so the pick is from {2, 3}, weighted by unbiased scores.
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.4]])
    logits = torch.log(scores / (1 - scores))                 # sigmoid(logits) == scores
    bias = torch.tensor([0.0, 0.0, 0.1, 0.2])
    w, ids = ref.moe_route(logits, 2, bias=bias, n_group=2, topk_group=1, renormalize=True, routed_scaling_factor=2.0)
    assert ids.tolist() == [[3, 2]] or ids.tolist() == [[2, 3]]
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert got[2] == pytest.approx(2.0 * 0.5 / 0.9) and got[3] == pytest.approx(2.0 * 0.4 / 0.9)
    w, ids = ref.moe_route(logits, 1, n_group=1, topk_group=1, renormalize=False)
    assert ids.tolist() == [[0]] and w[0, 0].item() == pytest.approx(0.9)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 2\]"):
        ref.moe_route(logits, 3, bias=bias, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="n_group must divide E=4"):
        ref.moe_route(logits, 1, n_group=3)


def test_moe_experts_match_a_dense_loop():
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 11, 32, 24, 6, 3
    x = torch.randn(t, h, generator=g)
    w1, w3 = torch.randn(e, inter, h, generator=g), torch.randn(e, inter, h, generator=g)
    w2 = torch.randn(e, h, inter, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=g)
    got = Experts(w1, w3, w2)(x, weights, ids)
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            want[i] += weights[i, j] * (torch.nn.functional.silu(w1[ex] @ x[i]) * (w3[ex] @ x[i])) @ w2[ex].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    experts = Experts(w1, w3, w2)                              # the routing-independent form used in CUDA graphs
    static = ref.moe_experts_static(x, weights, ids, e, experts.expert)
    torch.testing.assert_close(static, want, rtol=1e-5, atol=1e-4)
    m = torch.tensor([2, 2, -1, 0, 0, 0, -1], dtype=torch.int32)   # dispatch's contiguous layout, with padding
    y = ref.grouped_linear(x[:7], m, w1)
    assert (y[2] == 0).all() and (y[6] == 0).all()
    torch.testing.assert_close(y[3:6], x[3:6] @ w1[0].T)
    # FP8-kept expert weights (dequantized per call) give what their dequantized copies give
    quantized = [[ref.fp8_quantize(w[i], (16, 16)) for i in range(e)] for w in (w1, w3, w2)]
    q = [torch.stack([p[0] for p in per]) for per in quantized]
    s = [torch.stack([p[1] for p in per]) for per in quantized]
    kept = Experts(*q, *s, block=(16, 16))(x, weights, ids)
    deq = Experts(*(ref.fp8_dequantize(qq, ss, (16, 16)) for qq, ss in zip(q, s)))(x, weights, ids)
    torch.testing.assert_close(kept, deq, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("inter", [128, 64])                    # 64: down_proj's K takes the fallback
def test_sorted_experts_match_the_padded_path_and_read_nothing_on_the_host(inter, monkeypatch):
    """Experts under kernels.moe_path("sorted") (fp8_ops_on_cpu): the padded path's output, and with value
    checks off no host read of tensor data in the model's wiring (dispatch align=1, items, quantization,
    fallback, SiLU, combine). The sorted op's CPU reference loops over the items on the host, so inside
    the guard it is replaced by a sync-free stand-in of the same math (the GPU kernel reads nothing)."""
    from test_moe_dispatch import _NoHostSync

    from model import kernels

    g = torch.Generator().manual_seed(3)
    t, h, e, k = 37, 128, 8, 3
    x = torch.randn(t, h, generator=g)
    quantized = [[ref.fp8_quantize(torch.randn(n, kk, generator=g) / kk ** 0.5) for _ in range(e)]
                 for n, kk in ((inter, h), (inter, h), (h, inter))]
    experts = Experts(*(torch.stack([p[0] for p in per]) for per in quantized),
                      *(torch.stack([p[1] for p in per]) for per in quantized))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=g)
    with kernels.fp8_ops_on_cpu():
        with kernels.moe_path("padded"):
            default = experts(x, weights, ids)
        with kernels.moe_path("sorted"):
            got = experts(x, weights, ids)
            torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)

            def stand_in(a, sfa, b, sfb, items, out=None, out_dtype=torch.bfloat16):
                deq = ops.dequant_fp8_token_groups(a, sfa)
                row = torch.arange(a.shape[0])
                y = torch.zeros(a.shape[0], b.shape[1])
                for i in range(items.shape[0]):                        # items read as tensors, never on the host
                    ex, r0, n = items[i].long().unbind()
                    wb = ref.fp8_dequantize(b, sfb).index_select(0, ex.clamp(min=0).view(1))[0]
                    y = torch.where(((row >= r0) & (row < r0 + n) & (ex >= 0))[:, None], deq @ wb.T, y)
                return y.to(out_dtype)

            monkeypatch.setattr(ops, "m_grouped_fp8_gemm_nt_sorted", stand_in)
            monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "0")
            with _NoHostSync():
                guarded = experts(x, weights, ids)
    torch.testing.assert_close(guarded, got, rtol=1e-5, atol=1e-5)


def test_fp8_gemm_op_plumbing(monkeypatch):
    """The GPU branch of kernels.fp8_linear / grouped_linear (ops' FP8 GEMMs, activations quantized per
    128 columns), run here through the ops' CPU references: shapes, layouts and scales line up."""
    from model import kernels

    monkeypatch.setattr(kernels, "_fp8_gemm_fits", lambda x, w, b: w.shape[-1] % 128 == 0 and w.shape[-2] % 64 == 0)
    monkeypatch.setattr(kernels, "grouped_gemm_align", lambda x, fp8: 128 if fp8 else 1)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 192, 256, generator=g) / 16
    q = [ref.fp8_quantize(w[i]) for i in range(3)]
    wq, ws = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
    x = torch.randn(2, 5, 256, generator=g)
    got = kernels.fp8_linear(x, wq[0], ws[0])
    assert got.shape == (2, 5, 192)
    xq = ops.dequant_fp8_token_groups(*ops.per_token_group_quant_fp8(x.reshape(10, 256)))   # what the op multiplies
    torch.testing.assert_close(got, ref.fp8_linear(xq, wq[0], ws[0]).view(2, 5, 192), rtol=1e-5, atol=1e-5)
    w2 = torch.randn(3, 256, 192, generator=g) / 16
    q2 = [ref.fp8_quantize(w2[i]) for i in range(3)]
    experts = Experts(wq, wq.clone(), torch.stack([a for a, _ in q2]), ws, ws.clone(), torch.stack([b for _, b in q2]))
    xt = torch.randn(9, 256, generator=g)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(9)]).int()
    weights = torch.rand(9, 2, generator=g)
    want = ref.moe_experts_static(xt, weights, ids, 3, experts.expert)     # per expert, same per-row quantization
    torch.testing.assert_close(experts(xt, weights, ids), want, rtol=1e-4, atol=1e-4)


def test_fp8_block_scaling_with_partial_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=g)
    w[:128, :128] *= 100                                      # blocks get their own scales
    q, s = ref.fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = ref.fp8_dequantize(q, s)
    step = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2 ** -9   # e4m3's subnormal step
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + step).all()   # 3 mantissa bits: half an ulp
    x = torch.randn(5, 300, generator=g)
    torch.testing.assert_close(ref.fp8_linear(x, q, s), x @ back.T, rtol=1e-5, atol=1e-4)


# ---- checkpoint loading ------------------------------------------------------------------------------

@pytest.fixture
def small_ckpt(tmp_path):
    return make_tiny(tmp_path / "ckpt", num_hidden_layers=2, n_routed_experts=8, n_group=2, topk_group=1,
                     num_experts_per_tok=2)


def _rewrite(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _shard_of(ckpt, name):
    return ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_tensor_is_named(small_ckpt):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(_shard_of(small_ckpt, name), lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"maps tensor '{name}' to model-0000.-of-00002.safetensors, but that "
                                              "file has no such tensor"):
        DeepseekV3.from_pretrained(small_ckpt)
    index = small_ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing from the checkpoint"):
        DeepseekV3.from_pretrained(small_ckpt)


def test_misshaped_tensor_is_named(small_ckpt):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(_shard_of(small_ckpt, name), lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model-0000.-of-00002.safetensors has shape "
                                              rf"\(191, 128\), expected \(192, 128\)"):
        DeepseekV3.from_pretrained(small_ckpt)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_shard_names_the_file(small_ckpt, damage):
    shard = small_ckpt / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"\x07" * 4096, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        DeepseekV3.from_pretrained(small_ckpt)


def test_checkpoint_layout_errors(small_ckpt, tmp_path):
    (small_ckpt / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="maps '.*' to model-00001-of-00002.safetensors, which does not exist"):
        DeepseekV3.from_pretrained(small_ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((small_ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors shard in"):
        DeepseekV3.from_pretrained(empty)
    with pytest.raises(TypeError, match="dtype must be"):
        DeepseekV3.from_pretrained(small_ckpt, dtype=torch.int8)


def test_fp8_weight_without_its_scale_is_named(tmp_path):
    ckpt = make_tiny(tmp_path / "fp8", fp8=True, num_hidden_layers=1, first_k_dense_replace=1)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite(_shard_of(ckpt, name), lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"'{name}'"):
        DeepseekV3.from_pretrained(ckpt)


def test_unused_tensors_such_as_mtp_layers_are_ignored(small_ckpt):
    shard = small_ckpt / "model-00002-of-00002.safetensors"
    _rewrite(shard, lambda t: t.update({"model.layers.2.eh_proj.weight": torch.zeros(128, 256)}))
    index = small_ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.2.eh_proj.weight"] = shard.name
    index.write_text(json.dumps(data))
    assert len(DeepseekV3.from_pretrained(small_ckpt).layers) == 2


# ---- against transformers ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(tiny, case):
    ckpt, hf_dir = tiny(case)
    model = DeepseekV3.from_pretrained(ckpt, max_positions=256)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (90,), generator=g).tolist()   # crosses a 64-token page
    with torch.no_grad():
        want = load_hf(hf_dir)(torch.tensor([ids])).logits[0]
    got = prefill_logits(model, ids)
    assert got.shape == (90, model.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_kept_fp8_weights_match_dequantized(tiny):
    ckpt, _ = tiny("fp8-moe")
    ids = list(range(2, 40))
    kept = DeepseekV3.from_pretrained(ckpt, max_positions=64, keep_fp8=True)
    assert kept.layers[0].attn.kv_a.weight.dtype == torch.float8_e4m3fn
    deq = DeepseekV3.from_pretrained(ckpt, max_positions=64)
    torch.testing.assert_close(prefill_logits(kept, ids), prefill_logits(deq, ids), rtol=1e-5, atol=1e-5)


def test_yarn_changes_the_logits(tiny, tmp_path):
    """Guards the comparison above: the yarn config really reaches both implementations."""
    ckpt, _ = tiny("dense-only-q-lora-yarn")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert load_config(ckpt).rope.rope_type == "yarn"
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ckpt.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    cfg.pop("rope_scaling")
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = list(range(2, 100))
    a = prefill_logits(DeepseekV3.from_pretrained(ckpt, max_positions=128), ids)
    b = prefill_logits(DeepseekV3.from_pretrained(plain, max_positions=128), ids)
    assert (a - b).abs().max() > 1e-2
