"""Linear (bf16/fp32 or FP8 block-scaled), RMSNorm, the dense MLP and DeepSeekMoE.

Layers are plain objects holding tensors (inference only); every op goes through model.kernels.
"""

from __future__ import annotations

import torch

from model import kernels
from model.reference import fp8_dequantize


class Linear:
    """y = x @ W.T (+ b). W (out, in) in the model dtype, or e4m3 with weight_scale_inv (FP8 kept)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 block=(128, 128)):
        self.weight, self.scale, self.bias, self.block = weight, scale, bias, tuple(block)

    @classmethod
    def load(cls, ckpt, prefix, out_features, in_features, dtype, device, *, bias=False, block=(128, 128),
             keep_fp8=False):
        w, s = ckpt.get_weight(prefix, (out_features, in_features), dtype, device, block=block, keep_fp8=keep_fp8)
        b = ckpt.get_float(prefix + ".bias", (out_features,), dtype, device) if bias else None
        return cls(w, s, b, block)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype` (FP8 weights expanded): for the absorbed MLA projections."""
        if self.scale is None:
            return self.weight.to(dtype)
        return fp8_dequantize(self.weight, self.scale, self.block, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return kernels.linear(x, self.weight, self.bias)
        y = kernels.fp8_linear(x, self.weight, self.scale, self.block)
        return y if self.bias is None else y + self.bias


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), self.weight, self.eps)


class MLP:
    """down(silu(gate(x)) * up(x)): the dense layers' MLP and the shared experts."""

    def __init__(self, gate: Linear, up: Linear, down: Linear):
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def load(cls, ckpt, prefix, hidden, inter, dtype, device, **kw):
        return cls(*(Linear.load(ckpt, f"{prefix}.{n}", o, i, dtype, device, **kw)
                     for n, o, i in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter))))

    def __call__(self, x):
        return self.down(kernels.silu_mul(self.gate(x), self.up(x)))


class Experts:
    """The routed experts of one layer, stacked: w1 (gate) and w3 (up) (E, I, H), w2 (down) (E, H, I),
    each with its (E, ceil(N/128), ceil(K/128)) scales when FP8 is kept."""

    def __init__(self, w1, w3, w2, s1=None, s3=None, s2=None, block=(128, 128)):
        self.w1, self.w3, self.w2, self.s1, self.s3, self.s2, self.block = w1, w3, w2, s1, s3, s2, tuple(block)
        self.num_experts = w1.shape[0]

    @classmethod
    def load(cls, ckpt, prefix, num_experts, hidden, inter, dtype, device, *, block=(128, 128), keep_fp8=False):
        w, s = {}, {}
        for key, name, shape in (("1", "gate_proj", (inter, hidden)), ("3", "up_proj", (inter, hidden)),
                                 ("2", "down_proj", (hidden, inter))):
            parts = [ckpt.get_weight(f"{prefix}.{e}.{name}", shape, dtype, device, block=block, keep_fp8=keep_fp8)
                     for e in range(num_experts)]
            w[key] = torch.stack([p[0] for p in parts])
            s[key] = torch.stack([p[1] for p in parts]) if parts[0][1] is not None else None
        return cls(w["1"], w["3"], w["2"], s["1"], s["3"], s["2"], block)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on every row of x, with no host sync (the CUDA-graph path)."""
        def lin(v, w, s):
            return kernels.linear(v, w[e]) if s is None else kernels.fp8_linear(v, w[e], s[e], self.block)

        return lin(kernels.silu_mul(lin(x, self.w1, self.s1), lin(x, self.w3, self.s3)), self.w2, self.s2)

    def _mlp(self, rows: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
        gate = kernels.grouped_linear(rows, m_indices, self.w1, self.s1, self.block)
        up = kernels.grouped_linear(rows, m_indices, self.w3, self.s3, self.block)
        return kernels.grouped_linear(kernels.silu_mul(gate, up), m_indices, self.w2, self.s2, self.block)

    def _sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """kernels.MOE_PATH == "sorted": rows sorted by expert without padding, the sorted FP8 grouped GEMM
        over 64-row work items, combine. No host sync (eager and graph capture alike)."""
        rows, mapping, items = kernels.moe_dispatch_sorted(x, ids, self.num_experts)
        m_idx, q = mapping.m_indices, kernels.quant_rows(rows)            # one quantization for gate and up
        gate = kernels.sorted_grouped_linear(q, m_idx, items, self.w1, self.s1, self.block)
        up = kernels.sorted_grouped_linear(q, m_idx, items, self.w3, self.s3, self.block)
        h = kernels.quant_rows(kernels.silu_mul(gate, up))
        return kernels.moe_combine(kernels.sorted_grouped_linear(h, m_idx, items, self.w2, self.s2, self.block),
                                   mapping, weights)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), weights (T, k) fp32, ids (T, k) int32 -> (T, H): dispatch, grouped GEMMs, combine."""
        if kernels.moe_sorted_on(x, fp8=self.s1 is not None):
            return self._sorted(x, weights, ids)
        if kernels.capturing(x):
            # dispatch sizes its output from the routing (a host sync); graphs get the static form
            return kernels.moe_experts_static(x, weights, ids, self.num_experts, self.expert)
        align = kernels.grouped_gemm_align(x, fp8=self.s1 is not None)
        rows, _, mapping = kernels.moe_dispatch(x, ids, self.num_experts, align=align)
        return kernels.moe_combine(self._mlp(rows, mapping.m_indices), mapping, weights)


class MoE:
    """DeepSeekMoE: sigmoid router with bias-corrected, group-limited top-k; routed experts + shared expert."""

    def __init__(self, config, gate_weight, bias, experts: Experts, shared: MLP | None):
        self.config, self.gate_weight, self.bias, self.experts, self.shared = config, gate_weight, bias, experts, shared

    @classmethod
    def load(cls, ckpt, prefix, config, dtype, device, *, block=(128, 128), keep_fp8=False):
        e, h, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        gate = ckpt.get_float(f"{prefix}.gate.weight", (e, h), torch.float32, device)     # the router runs in fp32
        bias = ckpt.get_float(f"{prefix}.gate.e_score_correction_bias", (e,), torch.float32, device)
        experts = Experts.load(ckpt, f"{prefix}.experts", e, h, inter, dtype, device, block=block, keep_fp8=keep_fp8)
        shared = None
        if config.n_shared_experts:
            shared = MLP.load(ckpt, f"{prefix}.shared_experts", h, inter * config.n_shared_experts, dtype, device,
                              block=block, keep_fp8=keep_fp8)
        return cls(config, gate, bias, experts, shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        logits = kernels.linear(x.float(), self.gate_weight)                              # [T, E] fp32
        weights, ids = kernels.moe_route(logits, c.num_experts_per_tok, bias=self.bias, scoring=c.scoring_func,
                                         n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                         routed_scaling_factor=c.routed_scaling_factor)
        y = self.experts(x, weights, ids)
        return y if self.shared is None else y + self.shared(x)
