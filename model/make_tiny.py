"""Write a random DeepSeek-V3 checkpoint (config.json + sharded safetensors) for tests, demos and benchmarks.

    python -m model.make_tiny OUT_DIR --arch deepseek_v3 [--preset tiny|v3] [--fp8] [--seed 0] [--layers N]
                              [--dense-layers K] [--experts E] [--q-lora-rank R (0: no q_lora)] [--yarn]
                              [--dtype bfloat16] [--set key=json_value ...] [--threads T] [--shard-gb 4]

--preset tiny (default): small widths, every tensor built in memory (tests).
--preset v3: DeepSeek-V3's real widths (hidden 7168, 128 heads, 256 routed experts + 1 shared, top-8 of
8 groups / 4, vocab 129280, YaRN factor 40 over 4096; first_k_dense_replace 1 here), written by a
streaming writer: tensors go chunk by chunk straight into preallocated safetensors shards from several
threads, so memory stays bounded (~1 GB) whatever the size (4 layers with --fp8: ~39 GB on disk).
Its random values are cheap: FP8 weights are random e4m3 bytes (NaN codes remapped to +-448) taken
from a shared random pool at random offsets, with a per-tensor weight_scale_inv chosen so that every
projection has E[w^2] = 1/fan_in (unit-variance outputs for unit-variance inputs; each block's scale
also varies by +-25%). `--set hidden_size=512` etc. shrink any width (tests).

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
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
# DeepSeek-V3's real widths (its config.json; the rest as in the tiny preset), except
# first_k_dense_replace (3 there): 1 here, so that a few-layer checkpoint is mostly MoE layers.
# No multi-token-prediction layer is written.
V3_DEEPSEEK_V3 = dict(
    TINY_DEEPSEEK_V3,
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
    num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
    max_position_embeddings=163840,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
)
PRESETS = {"tiny": TINY_DEEPSEEK_V3, "v3": V3_DEEPSEEK_V3}
YARN = dict(type="yarn", factor=32.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)   # DeepSeek-V3's rope_scaling (40 over 4096), shrunk to a 64-token context


def tiny_config(arch: str = "deepseek_v3", preset: str = "tiny", **overrides) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    cfg = json.loads(json.dumps(PRESETS[preset]))     # a deep copy
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
              dtype: str = "bfloat16", preset: str = "tiny", streaming: bool | None = None,
              shard_bytes: int = 4 << 30, threads: int | None = None, progress: bool = False, **overrides) -> Path:
    """Write config.json, safetensors shards and their index into out_dir. Returns out_dir.

    preset "tiny": `shards` files, every tensor built in memory. preset "v3" (or streaming=True): the
    streaming writer (write_streaming), shards of about shard_bytes each."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    cfg = tiny_config(arch, preset, dtype=dtype, **overrides)
    if streaming or (streaming is None and preset != "tiny"):
        config_from_dict(cfg)                                                          # fail on a bad config first
        return write_streaming(out_dir, cfg, fp8=fp8, seed=seed, shard_bytes=shard_bytes, threads=threads,
                               progress=progress)
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


# ---- the streaming writer (real widths) ---------------------------------------------------------------

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}
_CHUNK = 32 << 20            # bytes generated and written per work item
_POOL = 256 << 20            # bytes of the shared random pools


class _Spec:
    """One tensor of the plan: name, shape, dtype and how its values are made.

    kind: "fp8" (e4m3 bytes from the pool; `scale` = the per-tensor weight_scale_inv level),
    "scale" (the weight_scale_inv of an fp8 tensor), "pool" (bf16/fp32 values from the unit pool times
    `scale`), "small" (made in memory: norms, router bias)."""

    def __init__(self, name, shape, dtype, kind, scale=1.0, make=None):
        self.name, self.shape, self.dtype, self.kind, self.scale, self.make = name, tuple(shape), dtype, kind, scale, make
        self.nbytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()


def _tensor_plan(cfg: dict, fp8: bool) -> list[list[_Spec]]:
    """The checkpoint's tensors in groups that share a shard (a weight and its scale), without any values."""
    c = config_from_dict(cfg)
    store = getattr(torch, cfg.get("dtype", "bfloat16"))
    hd, h = c.hidden_size, c.num_attention_heads
    groups: list[list[_Spec]] = []

    def lin(name, out_f, in_f, gain=1.0, quantize=True):
        if fp8 and quantize:
            grid = (-(-out_f // FP8_BLOCK[0]), -(-in_f // FP8_BLOCK[1]))
            level = gain / math.sqrt(in_f * _FP8_POOL_M2)                       # E[w^2] = gain^2 / in_f
            groups.append([_Spec(name + ".weight", (out_f, in_f), torch.float8_e4m3fn, "fp8"),
                           _Spec(name + ".weight_scale_inv", grid, torch.float32, "scale", level)])
        else:
            groups.append([_Spec(name + ".weight", (out_f, in_f), store, "pool", gain / math.sqrt(in_f))])

    def small(name, n, fn, dtype=store):
        groups.append([_Spec(name, (n,), dtype, "small", make=fn)])

    def norm(g, n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    def bias(g, n):
        return 0.1 * torch.randn(n, generator=g)

    groups.append([_Spec("model.embed_tokens.weight", (c.vocab_size, hd), store, "pool", 1.0)])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if c.q_lora_rank is None:
            lin(f"{a}.q_proj", h * c.qk_head_dim, hd)
        else:
            lin(f"{a}.q_a_proj", c.q_lora_rank, hd)
            small(f"{a}.q_a_layernorm.weight", c.q_lora_rank, norm)
            lin(f"{a}.q_b_proj", h * c.qk_head_dim, c.q_lora_rank)
        lin(f"{a}.kv_a_proj_with_mqa", c.latent_dim, hd)
        small(f"{a}.kv_a_layernorm.weight", c.kv_lora_rank, norm)
        lin(f"{a}.kv_b_proj", h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        lin(f"{a}.o_proj", hd, h * c.v_head_dim)
        if c.attention_bias:
            for n, size in (("q_a_proj", c.q_lora_rank), ("kv_a_proj_with_mqa", c.latent_dim), ("o_proj", hd)):
                if size:
                    small(f"{a}.{n}.bias", size, bias)
        mlps = []
        if c.is_moe_layer(i):
            lin(f"{p}.mlp.gate", c.n_routed_experts, hd, quantize=False)               # the router: never FP8
            small(f"{p}.mlp.gate.e_score_correction_bias", c.n_routed_experts, bias, torch.float32)
            mlps += [(f"{p}.mlp.experts.{e}", c.moe_intermediate_size) for e in range(c.n_routed_experts)]
            if c.n_shared_experts:
                mlps.append((f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts))
        else:
            mlps.append((f"{p}.mlp", c.intermediate_size))
        for m, inter in mlps:
            lin(f"{m}.gate_proj", inter, hd)
            lin(f"{m}.up_proj", inter, hd)
            lin(f"{m}.down_proj", hd, inter)
        small(f"{p}.input_layernorm.weight", hd, norm)
        small(f"{p}.post_attention_layernorm.weight", hd, norm)
    small("model.norm.weight", hd, norm)
    if not c.tie_word_embeddings:
        lin("lm_head", c.vocab_size, hd, gain=2.0, quantize=False)                    # DeepSeek ships it in bf16
    return groups


def _fp8_pool_bytes(n: int, g: torch.Generator) -> torch.Tensor:
    """n random e4m3 bytes (uint8), the two NaN codes (0x7F, 0xFF) remapped to +-448 (0x7E, 0xFE)."""
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    b[(b & 0x7F) == 0x7F] ^= 1
    return b


def _e4m3_m2() -> float:
    """E[v^2] of uniform random e4m3 bytes after the NaN remap (what the pool holds, up to sampling)."""
    v = torch.arange(256, dtype=torch.int32)
    v = torch.where((v & 0x7F) == 0x7F, v ^ 1, v).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return float((v * v).mean())


_FP8_POOL_M2 = _e4m3_m2()
_SCALE_JITTER_M2 = 0.75 ** 2 + 0.75 * 0.5 + 0.25 / 3          # E[(0.75 + 0.5 u)^2], u ~ U(0, 1)


def _safetensors_header(specs: list[_Spec]) -> tuple[bytes, dict[str, int]]:
    """The header bytes of a shard holding `specs` in order, and each tensor's data offset in the file."""
    meta, at = {"__metadata__": {"format": "pt"}}, 0
    for sp in specs:
        meta[sp.name] = {"dtype": _ST_DTYPE[sp.dtype], "shape": list(sp.shape), "data_offsets": [at, at + sp.nbytes]}
        at += sp.nbytes
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)                                              # data starts 8-byte aligned
    start = 8 + len(head)
    prefix = len(head).to_bytes(8, "little") + head
    offsets, at = {}, start
    for sp in specs:
        offsets[sp.name] = at
        at += sp.nbytes
    return prefix, offsets


def plan_bytes(cfg: dict, fp8: bool) -> int:
    """Bytes of tensor data a checkpoint of config `cfg` holds (headers and index excluded)."""
    return sum(sp.nbytes for g in _tensor_plan(cfg, fp8) for sp in g)


def write_streaming(out_dir, cfg: dict, *, fp8: bool, seed: int = 0, shard_bytes: int = 4 << 30,
                    threads: int | None = None, progress: bool = True) -> Path:
    """Write cfg's checkpoint without holding it in memory: the shard files are laid out first (headers
    known from the shapes), then work items of <= 32 MB each are generated and pwrite()n by `threads`
    threads. Values are deterministic in `seed` (not in the thread count's timing)."""
    out = Path(out_dir)
    groups = _tensor_plan(cfg, fp8)
    total = sum(sp.nbytes for g in groups for sp in g)
    # shards: consecutive groups, about shard_bytes each; within a shard, wider dtypes first (alignment)
    shards, cur, cur_bytes = [], [], 0
    for g in groups:
        size = sum(sp.nbytes for sp in g)
        if cur and cur_bytes + size > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur += g
        cur_bytes += size
    if cur:
        shards.append(cur)
    shards = [sorted(sh, key=lambda sp: -torch.empty((), dtype=sp.dtype).element_size()) for sh in shards]
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    need = total + (64 << 20)
    say = print if progress else (lambda *a, **k: None)
    say(f"make_tiny: {len(groups)} tensor groups, {total / 1e9:.2f} GB in {len(shards)} shards -> {out} "
        f"({free / 1e9:.1f} GB free)", flush=True)
    if free < need:
        raise ValueError(f"not enough disk space in {out}: the checkpoint needs {need / 1e9:.2f} GB, "
                         f"{free / 1e9:.2f} GB free")
    cfg = dict(cfg)
    if fp8:
        cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                          weight_block_size=list(FP8_BLOCK))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    g = torch.Generator().manual_seed(seed)
    pool_bytes = min(_POOL, max(1 << 22, total))                  # small checkpoints: small pools (fast tests)
    chunk = min(_CHUNK, pool_bytes // 2)
    fp8_pool = _fp8_pool_bytes(pool_bytes, g) if fp8 else None
    unit_pool = (torch.rand(pool_bytes // 4, generator=g) * 2 - 1) * math.sqrt(3.0)      # uniform, variance 1
    pools = {torch.float32: unit_pool, torch.bfloat16: unit_pool.to(torch.bfloat16),
             torch.float16: unit_pool.to(torch.float16)}

    files, weight_map, items, fds = [], {}, [], []
    n = len(shards)
    for s, specs in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        prefix, offsets = _safetensors_header(specs)
        path = out / file
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        fds.append(fd)
        os.pwrite(fd, prefix, 0)
        os.ftruncate(fd, len(prefix) + sum(sp.nbytes for sp in specs))
        for sp in specs:
            weight_map[sp.name] = file
            elem = torch.empty((), dtype=sp.dtype).element_size()
            step = max(chunk // elem, 1)
            count = math.prod(sp.shape)
            for lo in range(0, count, step):
                items.append((fd, offsets[sp.name] + lo * elem, sp, lo, min(count, lo + step)))
        files.append(file)

    def fill(item, index):
        fd, pos, sp, lo, hi = item
        r = torch.Generator().manual_seed(seed * 1_000_003 + index)
        if sp.kind == "fp8":
            start = int(torch.randint(0, fp8_pool.numel() - (hi - lo) + 1, (1,), generator=r))
            data = fp8_pool[start:start + hi - lo]
        elif sp.kind == "scale":
            jitter = 0.75 + 0.5 * torch.rand(hi - lo, generator=r)
            data = (sp.scale / math.sqrt(_SCALE_JITTER_M2)) * jitter
        elif sp.kind == "pool":
            pool = pools[sp.dtype]
            start = int(torch.randint(0, pool.numel() - (hi - lo) + 1, (1,), generator=r))
            data = pool[start:start + hi - lo]
            if sp.scale != 1.0:
                data = data * sp.scale
        else:
            data = sp.make(r, math.prod(sp.shape)).to(sp.dtype)[lo:hi]
        raw = data.contiguous().view(torch.uint8).numpy()
        done = 0
        while done < raw.nbytes:
            done += os.pwrite(fd, memoryview(raw)[done:], pos + done)
        return raw.nbytes

    lock, state = threading.Lock(), {"bytes": 0, "shown": 0.0}
    t0 = time.perf_counter()

    def work(args):
        nbytes = fill(*args)
        with lock:
            state["bytes"] += nbytes
            now = time.perf_counter()
            if now - state["shown"] > 5 or state["bytes"] == total:
                state["shown"] = now
                el = now - t0
                say(f"  {state['bytes'] / 1e9:7.2f} / {total / 1e9:.2f} GB  {el:6.1f} s  "
                    f"{state['bytes'] / 1e9 / max(el, 1e-9):.2f} GB/s", flush=True)

    threads = threads or min(16, os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(work, [(it, i) for i, it in enumerate(items)]):
                pass
    finally:
        for fd in fds:
            os.close(fd)
    (out / INDEX_FILE_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    say(f"make_tiny: wrote {total / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


INDEX_FILE_NAME = "model.safetensors.index.json"


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


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.make_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="deepseek_v3", choices=ARCHS)
    ap.add_argument("--preset", default="tiny", choices=tuple(PRESETS),
                    help="tiny: small widths (default); v3: DeepSeek-V3's real widths, streamed to disk")
    ap.add_argument("--fp8", action="store_true", help="e4m3 projection weights with 128x128 weight_scale_inv")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (tiny: 3, v3: 4)")
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="first_k_dense_replace: layers before it use the dense MLP (default 1)")
    ap.add_argument("--experts", type=int, default=None, help="n_routed_experts (tiny: 16, v3: 256)")
    ap.add_argument("--q-lora-rank", type=int, default=None, help="0: no q_lora (q_proj); tiny: 96, v3: 1536")
    ap.add_argument("--yarn", action="store_true", help="tiny preset: yarn rope_scaling like DeepSeek-V3's (factor 32 "
                                                        "over a 64-token original context); v3 always has its own")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--shards", type=int, default=2, help="tiny preset: number of shard files")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="v3 preset: about this many GB per shard file")
    ap.add_argument("--threads", type=int, default=None, help="v3 preset: writer threads (default: min(16, cores))")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="any config.json field (VALUE parsed as JSON), e.g. --set hidden_size=512; repeatable")
    args = ap.parse_args(argv)
    overrides = {}
    for flag, key in (("layers", "num_hidden_layers"), ("dense_layers", "first_k_dense_replace"),
                      ("experts", "n_routed_experts")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.q_lora_rank is not None:
        overrides["q_lora_rank"] = args.q_lora_rank or None
    if args.yarn and args.preset == "tiny":
        overrides["rope_scaling"] = dict(YARN)
    for kv in args.sets:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            ap.error(f"--set expects KEY=VALUE, got {kv!r}")
        overrides[key] = _json_value(value)
    try:
        out = make_tiny(args.out_dir, args.arch, fp8=args.fp8, seed=args.seed, shards=args.shards, dtype=args.dtype,
                        preset=args.preset, shard_bytes=int(args.shard_gb * (1 << 30)), threads=args.threads,
                        progress=True, **overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    shown = files if len(files) <= 8 else files[:3] + ["..."] + files[-3:]
    print(f"wrote {out}: {', '.join(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
