"""MoE glue: the router (DeepSeek-V3 gate), dispatch and combine.

route:    bytes = T*E*4 (logits) + T*k*8 (weights + ids); flops ~ 0 (latency-bound at small T)
dispatch: bytes = 2 * T*k*H*2 (each chosen row read and written, bf16)
combine:  bytes = T*k*H*2 + T*H*2 (expert rows read, token rows written)
"""

import torch

import ops
from bench.suites import Provider, Suite
from ops.moe_dispatch import combine_program, gather_rows_program
from ops.moe_route import _moe_route_impl, moe_route_warp_program

V3 = dict(num_experts=256, top_k=8, n_group=8, topk_group=4)

PRESETS = {
    "route": [dict(kind="route", T=t, **V3) for t in (1, 128, 4096, 16384)],
    "dispatch": [dict(kind="dispatch", T=4096, H=7168, **V3)],
    "combine": [dict(kind="combine", T=4096, H=7168, **V3)],
}


def make_inputs(case, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    T_, E, k = case["T"], case["num_experts"], case["top_k"]
    out = {"logits": torch.randn(T_, E, generator=g).to(device), "bias": (torch.randn(E, generator=g) * 0.05).to(device)}
    if case["kind"] != "route":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)]).to(torch.int32).to(device)
        x = torch.randn(T_, case["H"], dtype=torch.bfloat16, device=device)
        xd, _, mapping = ops.moe_dispatch(x, ids, E)
        out.update(ids=ids, x=x, y=xd, mapping=mapping, weights=torch.rand(T_, k, device=device))
    return out


def nbytes(case):
    T_, k = case["T"], case["top_k"]
    if case["kind"] == "route":
        return T_ * case["num_experts"] * 4 + T_ * k * 8
    if case["kind"] == "dispatch":
        return 2 * T_ * k * case["H"] * 2
    return T_ * k * case["H"] * 2 + T_ * case["H"] * 2


def torch_router(logits, bias, top_k, n_group, topk_group, scaling=2.5):
    """The eager torch gate engines use (DeepSeek's reference inference code)."""
    scores = logits.sigmoid()
    choice = scores + bias
    grouped = choice.view(logits.shape[0], n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(topk_group, -1).indices, True)
    choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ids = choice.topk(top_k, -1).indices
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scaling, ids


def tilecraft(case, i):
    if case["kind"] == "route":
        return lambda: ops.moe_route(i["logits"], case["top_k"], bias=i["bias"], n_group=case["n_group"],
                                     topk_group=case["topk_group"], routed_scaling_factor=2.5)
    if case["kind"] == "dispatch":
        return lambda: ops.moe_dispatch(i["x"], i["ids"], case["num_experts"])
    return lambda: ops.moe_combine(i["y"], i["mapping"], i["weights"])


def tilecraft_unchecked(case, i):
    """The route kernel without the NaN/inf check's device sync: what a CUDA-graph replay runs."""
    if case["kind"] != "route":
        raise ValueError("only the router has a value check to skip")
    return lambda: _moe_route_impl(i["logits"], i["bias"], case["top_k"], "sigmoid", case["n_group"],
                                   case["topk_group"], True, 2.5)


def torch_provider(case, i):
    if case["kind"] == "route":
        return lambda: torch_router(i["logits"], i["bias"], case["top_k"], case["n_group"], case["topk_group"])
    if case["kind"] == "dispatch":
        src = torch.arange(case["T"], device=i["x"].device).repeat_interleave(case["top_k"])
        return lambda: i["x"].index_select(0, src)           # the permutation alone (ANCHORS' torch row)
    pos = i["mapping"].positions.long()
    return lambda: (i["y"][pos].float() * i["weights"][..., None]).sum(1).to(i["y"].dtype)


def kernels(case):
    if case["kind"] == "route":
        return [(moe_route_warp_program, dict(V3, scoring="sigmoid", has_bias=True, scaling=2.5))]
    if case["kind"] == "dispatch":
        return [(gather_rows_program, dict(hidden=case["H"], bits="int16"))]
    return [(combine_program, dict(hidden=case["H"], top_k=case["top_k"]))]


SUITE = Suite(
    name="moe",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=nbytes,
    flops=lambda c: 0,
    providers=[Provider("tilecraft", tilecraft), Provider("tilecraft-unchecked", tilecraft_unchecked),
               Provider("torch", torch_provider)],
    kernels=kernels,
    label=lambda c: f"{c['kind']} T={c['T']}" + (f" H={c['H']}" if "H" in c else "") + f" E={c['num_experts']} k={c['top_k']}",
)
