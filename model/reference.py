"""fp32 torch references: for the ops the model needs that ops/ does not have yet, and for the
semantics of one it now calls.

Each has the signature its kernel has (or will have), so model/kernels.py switches in one line:
  moe_route           DeepSeek-V3's gate (= ops.moe_route, which the model now calls; kept as the
                      documented semantics, checked against transformers' router and the op)
  grouped_linear      one GEMM per expert over ops.moe_dispatch's contiguous rows, bf16/fp32 or FP8 weights
  moe_experts_static  the routed experts with routing-independent shapes, for CUDA-graph capture
  fp8_linear          x @ dequant(w).T for e4m3 weights with (128 x 128)-block weight_scale_inv
  mla_prefill         causal attention of the naive (non-absorbed) MLA path, new queries after a cached prefix
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite e4m3fn value


# ---- MoE -------------------------------------------------------------------------------------------

def moe_route(logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None, scoring: str = "sigmoid",
              n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route T tokens to top_k of E experts. logits (T, E) (the gate's fp32 output).

    scores = sigmoid(logits) (or softmax); experts are *chosen* on scores + bias (E,): with
    n_group > 1 each group of E/n_group experts scores the sum of its two best biased scores and
    only the topk_group best groups compete. Weights are the *unbiased* scores of the chosen
    experts, divided by their sum (+1e-20) when renormalize, then times routed_scaling_factor.
    Returns (weights (T, top_k) fp32, ids (T, top_k) int32), best expert first (exact ties: in
    torch.topk's order, where ops.moe_route takes the lower expert id).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a (T, E) tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    t, e = logits.shape
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if n_group < 1 or e % n_group or (n_group > 1 and e // n_group < 2):
        raise ValueError(f"n_group must divide E={e} into groups of >= 2 experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 1 <= top_k <= e // n_group * topk_group:
        raise ValueError(f"top_k must be in [1, {e // n_group * topk_group}], got {top_k}")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"bias must have shape ({e},), got {tuple(bias.shape)}")
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)       # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)                       # [T, G]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)         # [T, E], no host sync
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices                                           # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def grouped_linear(x: torch.Tensor, m_indices: torch.Tensor, weight: torch.Tensor,
                   weight_scale_inv: torch.Tensor | None = None, block_size=(128, 128)) -> torch.Tensor:
    """y[r] = x[r] @ weight[m_indices[r]].T: the m-grouped GEMM over ops.moe_dispatch's contiguous layout.

    x (M, K); m_indices (M,) int32, each expert's rows contiguous, -1 for padding rows (left zero);
    weight (E, N, K) in x's dtype, or e4m3 with weight_scale_inv (E, ceil(N/bn), ceil(K/bk)) fp32.
    Returns (M, N) in x's dtype. Reads the segment bounds on the host (one sync)."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    experts = m_indices.tolist()
    start = 0
    while start < len(experts):
        e, end = experts[start], start + 1
        while end < len(experts) and experts[end] == e:
            end += 1
        if e >= 0:
            w = weight[e] if weight_scale_inv is None else fp8_dequantize(weight[e], weight_scale_inv[e], block_size,
                                                                         x.dtype)
            out[start:end] = F.linear(x[start:end], w)
        start = end
    return out


def moe_experts_static(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                       expert_fn) -> torch.Tensor:
    """Routed experts with shapes that do not depend on the routing (for CUDA-graph capture): every
    expert runs on every token, scaled by the token's weight for it (0 when not chosen).
    x (T, H); weights (T, k) fp32; ids (T, k) int32; expert_fn(e, x) -> (T, H). Returns (T, H) in x's dtype."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        w = (weights * (ids == e)).sum(dim=-1, keepdim=True)                           # [T, 1]
        out = out + w * expert_fn(e, x).float()
    return out.to(x.dtype)


# ---- FP8 block-scaled weights ----------------------------------------------------------------------

def fp8_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size=(128, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w = weight.float() * scale of its (bn x bk) block. weight (..., N, K) e4m3;
    weight_scale_inv (..., ceil(N/bn), ceil(K/bk)); the last blocks may be partial."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    s = weight_scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * s).to(dtype)


def fp8_quantize(w: torch.Tensor, block_size=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 of w (N, K): one scale per block, amax / 448. Returns (weight, weight_scale_inv)."""
    bn, bk = block_size
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.float().new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)                 # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               block_size=(128, 128)) -> torch.Tensor:
    """x (..., K) @ dequant(weight (N, K) e4m3).T -> (..., N) in x's dtype (no activation quantization:
    the kernel may quantize x per (1 x 128) block as DeepGEMM does, within its documented tolerance)."""
    return F.linear(x, fp8_dequantize(weight, weight_scale_inv, block_size, x.dtype))


# ---- MLA prefill (naive path) ----------------------------------------------------------------------

def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Causal attention of L new queries after a cached prefix: query i sees keys [0, ctx - L + i].
    q (L, h, d_qk), k (ctx, h, d_qk), v (ctx, h, d_v), ctx >= L. Returns (L, h, d_v)."""
    n_q, n_kv = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)               # [h, *, d]
    if n_q == n_kv:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=softmax_scale)
    else:
        limit = torch.arange(n_kv - n_q, n_kv, device=q.device)[:, None]
        mask = torch.arange(n_kv, device=q.device)[None, :] <= limit                    # [L, ctx]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    return out.transpose(0, 1)
