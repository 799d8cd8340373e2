"""MoE routing: DeepSeek's gate (scores, optional bias, grouped selection, top-k, renormalize,
scale) in one kernel launch, and hash routing for DeepSeek-V4's first layers.

Semantics (DeepSeek-V3 inference): scores = f(logits) with f in {sigmoid, softmax, sqrtsoftplus};
choice = scores + bias (the bias only steers the choice); with n_group > 1 a group's score is the
sum of its two best choice scores and only the topk_group best groups stay eligible (the rest are
-inf); the top_k eligible experts by choice score are picked, ties toward the lower expert id;
weights are the unbiased scores of the picked experts, renormalized (if asked) and multiplied by
routed_scaling_factor.

Kernels: on CUDA, shapes that fit warp_path_fits (DeepSeek's E=256 with n_group 8 or 1 among them)
take moe_route_warp: one warp per token, the token's experts in registers (E/32 a lane), every
"best of" a butterfly of lane shuffles, no shared memory and no block barrier. Other shapes, the
cpu target and Ascend take moe_route: one token per block, a (groups, experts per group) tile, every
"best of" two block-wide row reductions (value, then lowest index holding it). Both pick the same
experts, ties toward the lower id.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import torch
import tilelang.language as T

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import _validate as check

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
LOGIT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
MAX_EXPERTS = 1024


@tile_program(
    "moe_route",
    examples={
        "v3": dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid", has_bias=True),
        "softmax-64": dict(num_experts=64, top_k=6, scoring="softmax", has_bias=False),
    },
)
def moe_route_program(num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
                       has_bias: bool = True, renormalize: bool = True, scaling: float = 1.0,
                       dtype: str = "float32", threads: int = 128):
    """One token per block: scores, grouped masking, top-k by repeated (max, lowest index) reductions.
    The (groups, experts a group) tile is padded to powers of two (TileLang's cross-thread reductions are
    butterflies): a padding slot scores 0 and is never picked."""
    E, G = num_experts, n_group
    GS = E // G
    GP, GSP = _pow2_at_least(G), _pow2_at_least(GS)   # the tile: (GP, GSP) >= (G, GS)
    padded = (GP, GSP) != (G, GS)

    def real(g, e):
        return T.And(g < G, e < GS) if padded else True

    def or_at_padding(g, e, value, fill):
        """value at a real slot, fill at a padding slot (no select where nothing is padded)"""
        return T.if_then_else(real(g, e), value, fill) if padded else value
    sdt = tile.storage_dtype(dtype)
    tokens = T.dynamic("tokens")
    neg_inf = -T.infinity("float32")

    @T.macro
    def best_of(vals, g_best, best, cand, g_cand, where):
        """best[0] = max of vals; where[0] = the lowest flat index g * GS + e holding it."""
        tile.row_reduce(vals, g_best, "max", dim=1)
        tile.row_reduce(g_best, best, "max", dim=0)
        for g, e in tile.parallel(GP, GSP):
            cand[g, e] = T.if_then_else(vals[g, e] == best[0], g * GS + e, E)
        tile.row_reduce(cand, g_cand, "min", dim=1)
        tile.row_reduce(g_cand, where, "min", dim=0)

    @T.prim_func
    def moe_route(
        Logits: T.Tensor((tokens, E), sdt),
        Bias: T.Tensor((E,), "float32"),
        Weights: T.Tensor((tokens, top_k), "float32"),
        Ids: T.Tensor((tokens, top_k), "int32"),
    ):
        with tile.grid(tokens, threads) as tok:
            with tile.vector():
                score = tile.fragment((GP, GSP))      # unbiased scores
                choice = tile.fragment((GP, GSP))     # what experts are picked by: score + bias, masked
                cand = tile.fragment((GP, GSP), "int32")
                g_best = tile.fragment((GP,))
                g_cand = tile.fragment((GP,), "int32")
                best = tile.fragment((1,))
                where = tile.fragment((1,), "int32")
                total = tile.fragment((1,))
                picked_id = T.alloc_local((top_k,), "int32")
                picked_w = T.alloc_local((top_k,), "float32")

                for g, e in tile.parallel(GP, GSP):   # padding: -inf, which every scoring takes to 0
                    score[g, e] = or_at_padding(g, e, tile.to_f32(Logits[tok, g * GS + e], dtype), neg_inf)
                if scoring == "softmax":
                    tile.row_reduce(score, g_best, "max", dim=1)
                    tile.row_reduce(g_best, best, "max", dim=0)
                    for g, e in tile.parallel(GP, GSP):
                        score[g, e] = T.exp(score[g, e] - best[0])
                    tile.row_reduce(score, g_best, "sum", dim=1)
                    tile.row_reduce(g_best, total, "sum", dim=0)
                    for g, e in tile.parallel(GP, GSP):
                        score[g, e] = score[g, e] / total[0]
                elif scoring == "sigmoid":
                    for g, e in tile.parallel(GP, GSP):
                        score[g, e] = 1.0 / (1.0 + T.exp(-score[g, e]))
                else:  # sqrtsoftplus, in the form that does not overflow for large logits
                    for g, e in tile.parallel(GP, GSP):
                        x = score[g, e]
                        score[g, e] = T.sqrt(T.max(x, 0.0) + T.log(1.0 + T.exp(-T.max(x, -x))))
                for g, e in tile.parallel(GP, GSP):
                    choice[g, e] = or_at_padding(g, e, score[g, e] + (Bias[g * GS + e] if has_bias else 0.0), neg_inf)

                if G > 1:
                    # a group's score: its best plus its second best choice score (the second best is
                    # the max without the group's lowest-index best, so a tie counts twice)
                    g_first_at = tile.fragment((GP,), "int32")
                    g_second = tile.fragment((GP,))
                    others = tile.fragment((GP, GSP))
                    group_score = tile.fragment((GP,))
                    alive = tile.fragment((GP,))
                    tile.row_reduce(choice, g_best, "max", dim=1)
                    for g, e in tile.parallel(GP, GSP):
                        cand[g, e] = T.if_then_else(choice[g, e] == g_best[g], e, GS)
                    tile.row_reduce(cand, g_first_at, "min", dim=1)
                    for g, e in tile.parallel(GP, GSP):
                        others[g, e] = T.if_then_else(e == g_first_at[g], neg_inf, choice[g, e])
                    tile.row_reduce(others, g_second, "max", dim=1)
                    for g in tile.parallel(GP):
                        group_score[g] = g_best[g] + g_second[g]
                        alive[g] = 0.0
                    for _ in tuple(range(topk_group)):  # unrolled while tracing
                        tile.row_reduce(group_score, best, "max", dim=0)
                        for g in tile.parallel(GP):
                            g_cand[g] = T.if_then_else(group_score[g] == best[0], g, G)
                        tile.row_reduce(g_cand, where, "min", dim=0)
                        for g in tile.parallel(GP):
                            alive[g] = T.if_then_else(g == where[0], 1.0, alive[g])
                            group_score[g] = T.if_then_else(g == where[0], neg_inf, group_score[g])
                    for g, e in tile.parallel(GP, GSP):
                        choice[g, e] = T.if_then_else(alive[g] > 0.5, choice[g, e], neg_inf)

                gathered = tile.fragment((GP, GSP))
                for r in tuple(range(top_k)):  # unrolled while tracing
                    best_of(choice, g_best, best, cand, g_cand, where)
                    for g, e in tile.parallel(GP, GSP):
                        hit = T.And(real(g, e), g * GS + e == where[0]) if padded else g * GS + e == where[0]
                        gathered[g, e] = T.if_then_else(hit, score[g, e], 0.0)
                        choice[g, e] = T.if_then_else(hit, neg_inf, choice[g, e])
                    tile.row_reduce(gathered, g_best, "sum", dim=1)
                    tile.row_reduce(g_best, best, "sum", dim=0)
                    picked_id[r] = where[0]
                    picked_w[r] = best[0]
                total_w = T.alloc_local((1,), "float32")
                total_w[0] = 0.0
                for r in tuple(range(top_k)):
                    total_w[0] = total_w[0] + picked_w[r]
                for r in tuple(range(top_k)):
                    Ids[tok, r] = picked_id[r]
                    if renormalize:
                        Weights[tok, r] = picked_w[r] / (total_w[0] + 1e-20) * scaling
                    else:
                        Weights[tok, r] = picked_w[r] * scaling

    return moe_route


WARP = 32


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _halvings(lanes: int) -> tuple:
    """Butterfly offsets over `lanes` lanes: lanes/2, lanes/4, ..., 1."""
    return tuple(1 << i for i in reversed(range(lanes.bit_length() - 1)))


def warp_path_fits(num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether the warp-per-token program covers this shape: E a multiple of 32 with at most 16
    experts per lane, every group made of whole lanes (a power-of-two count of them), k <= 32."""
    E, G = num_experts, n_group
    if E % WARP or E // WARP > 16 or top_k > WARP or G > WARP:
        return False
    V, GS = E // WARP, E // G
    lanes_per_group = GS // V if GS % V == 0 else 0
    return lanes_per_group > 0 and lanes_per_group & (lanes_per_group - 1) == 0


@tile_program(
    "moe_route_warp",
    targets=("cuda:sm_90a", "cuda:sm_100a"),
    examples={
        "v3": dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid", has_bias=True, scaling=2.5),
        "ungrouped-256": dict(num_experts=256, top_k=8, scoring="softmax", has_bias=False),
    },
)
def moe_route_warp_program(num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                            scoring: str = "sigmoid", has_bias: bool = True, renormalize: bool = True,
                            scaling: float = 1.0, dtype: str = "float32", warps: int = 4):
    """One token per warp, `warps` tokens per block. Lane l holds experts [l*V, l*V + V) in registers
    (V = E/32), so a group is LPG = 32/G neighbouring lanes; every "best of" is a few register
    compares and a butterfly of lane shuffles, with no shared memory and no block barrier."""
    E, G, K = num_experts, n_group, top_k
    assert warp_path_fits(E, K, G), (E, K, G)
    V = E // WARP
    LPG = WARP // G                       # lanes per group
    sdt = tile.storage_dtype(dtype)
    tokens = T.dynamic("tokens")
    neg_inf = -T.infinity("float32")

    @T.macro
    def butterfly(x, op, lanes):
        """x[0] = op over `lanes` neighbouring lanes (an aligned power-of-two span), on every one of them."""
        for off in _halvings(lanes):       # unrolled while tracing
            if op == "max":
                x[0] = T.max(x[0], tile.lane_shuffle(x[0], off, xor=True))
            else:
                x[0] = x[0] + tile.lane_shuffle(x[0], off, xor=True)

    @T.macro
    def lane_best(c, s, best, best_j, best_s):
        """This lane's best choice score, its lowest local index and its unbiased score."""
        best[0] = c[0]
        best_j[0] = 0
        best_s[0] = s[0]
        for j in tuple(range(1, V)):
            take = c[j] > best[0]          # strict: a tie keeps the lower index
            best_s[0] = T.if_then_else(take, s[j], best_s[0])
            best_j[0] = T.if_then_else(take, j, best_j[0])
            best[0] = T.if_then_else(take, c[j], best[0])

    @T.prim_func
    def moe_route_warp(
        Logits: T.Tensor((tokens, E), sdt),
        Bias: T.Tensor((E,), "float32"),
        Weights: T.Tensor((tokens, K), "float32"),
        Ids: T.Tensor((tokens, K), "int32"),
    ):
        with tile.grid(T.ceildiv(tokens, warps), WARP * warps) as bx:
            tx = T.get_thread_binding()
            lane = tx % WARP
            tok = bx * warps + tx // WARP
            raw = T.alloc_local((V,), sdt)
            b = T.alloc_local((V,), "float32")
            s = T.alloc_local((V,), "float32")     # unbiased scores
            c = T.alloc_local((V,), "float32")     # choice scores: s + bias, -inf once dropped or picked
            x = T.alloc_local((1,), "float32")
            y = T.alloc_local((1,), "float32")
            o1 = T.alloc_local((1,), "float32")
            o2 = T.alloc_local((1,), "float32")
            rank = T.alloc_local((1,), "int32")
            best = T.alloc_local((1,), "float32")
            best_j = T.alloc_local((1,), "int32")
            best_s = T.alloc_local((1,), "float32")
            win = T.alloc_local((1,), "int32")
            pick_id = T.alloc_local((1,), "int32")
            pick_w = T.alloc_local((1,), "float32")
            my_id = T.alloc_local((1,), "int32")
            my_w = T.alloc_local((1,), "float32")
            total = T.alloc_local((1,), "float32")
            if tok < tokens:                 # uniform across the warp: shuffles see all 32 lanes
                for j in T.vectorized(V):
                    raw[j] = Logits[tok, lane * V + j]
                if has_bias:
                    for j in T.vectorized(V):
                        b[j] = Bias[lane * V + j]
                for j in tuple(range(V)):
                    s[j] = tile.to_f32(raw[j], dtype)
                if scoring == "softmax":
                    x[0] = s[0]
                    for j in tuple(range(1, V)):
                        x[0] = T.max(x[0], s[j])
                    butterfly(x, "max", WARP)
                    y[0] = 0.0
                    for j in tuple(range(V)):
                        s[j] = T.exp(s[j] - x[0])
                        y[0] = y[0] + s[j]
                    butterfly(y, "sum", WARP)
                    for j in tuple(range(V)):
                        s[j] = s[j] / y[0]
                elif scoring == "sigmoid":
                    for j in tuple(range(V)):
                        s[j] = 1.0 / (1.0 + T.exp(-s[j]))
                else:  # sqrtsoftplus, in the form that does not overflow for large logits
                    for j in tuple(range(V)):
                        s[j] = T.sqrt(T.max(s[j], 0.0) + T.log(1.0 + T.exp(-T.max(s[j], -s[j]))))
                for j in tuple(range(V)):
                    c[j] = s[j] + b[j] if has_bias else s[j]

                if G > 1:
                    # group score = best + second best choice score of the group (a tie counts
                    # twice): a running top-2 over this lane's values, then merged across the
                    # group's LPG lanes
                    x[0] = c[0]
                    y[0] = neg_inf
                    for j in tuple(range(1, V)):
                        y[0] = T.max(y[0], T.min(x[0], c[j]))
                        x[0] = T.max(x[0], c[j])
                    for off in _halvings(LPG):
                        o1[0] = tile.lane_shuffle(x[0], off, xor=True)
                        o2[0] = tile.lane_shuffle(y[0], off, xor=True)
                        y[0] = T.max(T.min(x[0], o1[0]), T.max(y[0], o2[0]))
                        x[0] = T.max(x[0], o1[0])
                    x[0] = x[0] + y[0] if E // G > 1 else x[0]
                    # a group stays eligible if fewer than topk_group groups beat it (higher score,
                    # or equal score and lower group id)
                    rank[0] = 0
                    for h in tuple(range(G)):
                        o1[0] = tile.lane_shuffle(x[0], h * LPG)
                        rank[0] = rank[0] + T.if_then_else(
                            (o1[0] > x[0]) | ((o1[0] == x[0]) & (h < lane // LPG)), 1, 0)
                    for j in tuple(range(V)):
                        c[j] = T.if_then_else(rank[0] < topk_group, c[j], neg_inf)

                lane_best(c, s, best, best_j, best_s)
                total[0] = 0.0
                my_id[0] = 0
                my_w[0] = 0.0
                for r in tuple(range(K)):  # unrolled while tracing
                    x[0] = best[0]
                    butterfly(x, "max", WARP)
                    # lanes hold ascending expert ranges: the lowest lane holding the max has the
                    # lowest expert id among the ties
                    win[0] = tile.lane_first(best[0] == x[0])
                    pick_id[0] = tile.lane_shuffle(lane * V + best_j[0], win[0])
                    pick_w[0] = tile.lane_shuffle(best_s[0], win[0])
                    total[0] = total[0] + pick_w[0]
                    my_id[0] = T.if_then_else(lane == r, pick_id[0], my_id[0])
                    my_w[0] = T.if_then_else(lane == r, pick_w[0], my_w[0])
                    if r + 1 < K:
                        for j in tuple(range(V)):
                            c[j] = T.if_then_else((lane == win[0]) & (best_j[0] == j), neg_inf, c[j])
                        lane_best(c, s, best, best_j, best_s)
                if lane < K:
                    Ids[tok, lane] = my_id[0]
                    if renormalize:
                        Weights[tok, lane] = my_w[0] / (total[0] + 1e-20) * scaling
                    else:
                        Weights[tok, lane] = my_w[0] * scaling

    return moe_route_warp


# ---- reference -------------------------------------------------------------------------------------

def _scores_reference(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.float()
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    return torch.sqrt(torch.nn.functional.softplus(x))


_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_choice(E, top_k, n_group, topk_group, scoring):
    """The routing choice's arguments against E experts (the op's and the reference's common checks)."""
    check.number("top_k", top_k, lo=1, hi=E, integer=True)
    check.number("n_group", n_group, lo=1, hi=E, integer=True)
    if E % n_group:
        raise ValueError(f"the expert count {E} must be divisible by n_group={n_group}")
    check.number("topk_group", topk_group, lo=1, hi=n_group, integer=True)
    if top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k={top_k} exceeds the experts of the topk_group={topk_group} groups that stay eligible "
                         f"({topk_group} x {E // n_group})")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def _validate_reference(logits, top_k, bias, scoring, n_group, topk_group, renormalize, routed_scaling_factor):
    """The op's checks less its kernel limits: logits and bias of any floating dtype and strides, any expert
    count. Non-finite logits are refused as by the op (a value check, skipped where ops/_values.py skips them)."""
    check.tensor("logits", logits, dtypes=_REFERENCE_DTYPES, ndim=2)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must have at least 1 expert (column), got shape {tuple(logits.shape)}")
    _check_choice(E, top_k, n_group, topk_group, scoring)
    check.flag("renormalize", renormalize)
    check.number("routed_scaling_factor", routed_scaling_factor)
    if bias is not None:
        check.tensor("bias", bias, dtypes=_REFERENCE_DTYPES, ndim=1)
        check.shape("bias", bias, (E,), "(num_experts,)")
        check.same_device(logits=logits, bias=bias)
    if _values.enabled(logits) and logits.numel():
        _check_finite(logits, torch.isfinite(logits).all())


def moe_route_reference(logits, top_k, *, bias=None, scoring="sigmoid", n_group=1, topk_group=1, renormalize=True,
                        routed_scaling_factor=1.0):
    """fp32 torch reference with the same tie rule (lower expert id, lower group id wins).

    logits (T, E) and bias (E,) or None of any floating dtype, any device, any strides; the scalars as the op's."""
    _validate_reference(logits, top_k, bias, scoring, n_group, topk_group, renormalize, routed_scaling_factor)
    T_, E = logits.shape
    scores = _scores_reference(logits, scoring)                          # [T, E]
    choice = scores + (bias.float() if bias is not None else 0.0)
    if n_group > 1:
        grouped = choice.view(T_, n_group, E // n_group)
        # stable descending sort: among equal values the lower index comes first
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)   # [T, G]
        order = torch.sort(top2, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        alive = torch.zeros(T_, n_group, dtype=torch.bool, device=logits.device).scatter_(1, order, True)
        choice = choice.masked_fill(~alive.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * routed_scaling_factor).float(), ids.to(torch.int32)


# ---- the public ops --------------------------------------------------------------------------------

def _validate(logits, top_k, bias, scoring, n_group, topk_group, routed_scaling_factor):
    check.tensor("logits", logits, dtypes=LOGIT_DTYPES, ndim=2, contiguous=True)
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"logits must have 1 to {MAX_EXPERTS} experts (columns), got {E}")
    _check_choice(E, top_k, n_group, topk_group, scoring)
    check.number("routed_scaling_factor", routed_scaling_factor)
    if bias is not None:
        check.tensor("bias", bias, dtypes=(torch.float32, torch.bfloat16), ndim=1, contiguous=True)
        check.shape("bias", bias, (E,), "(num_experts,)")
        check.same_device(logits=logits, bias=bias)


def _check_finite(logits, finite):
    """Raise for NaN/inf logits. `finite` was queued before the kernel: the one device sync then
    waits for both, so the kernel launch is not held behind the host's round trip."""
    if finite is not None and not bool(finite):
        bad = (~torch.isfinite(logits)).nonzero()[0].tolist()
        raise ValueError(f"logits must be finite; found {logits[bad[0], bad[1]].item()} at [{bad[0]}, {bad[1]}]")


def _moe_route_impl(logits, bias, top_k, scoring, n_group, topk_group, renormalize, routed_scaling_factor):
    T_, E = logits.shape
    weights = torch.empty(T_, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T_, top_k, dtype=torch.int32, device=logits.device)
    if T_ == 0:
        return weights, ids
    target = targets.resolve(logits)
    program = moe_route_program
    if target.name in moe_route_warp_program.targets and warp_path_fits(E, top_k, n_group):
        program = moe_route_warp_program
    params = dict(num_experts=E, top_k=top_k, n_group=n_group, topk_group=topk_group, scoring=scoring,
                  has_bias=bias is not None, renormalize=renormalize, scaling=float(routed_scaling_factor),
                  dtype=LOGIT_DTYPES[logits.dtype])
    launch = jit.launchers((program.name, target.name, *params.values()),
                           lambda: program.compile(target, **params).launcher())
    b = bias.float().contiguous() if bias is not None else torch.zeros(E, dtype=torch.float32, device=logits.device)
    # (both read up to 16 bytes a thread: a view that does not start 16-byte aligned is copied, a row
    # of logits and the bias are E values)
    logits, b = check.aligned_copy(logits), check.aligned_copy(b)
    launch(logits, b, weights, ids)
    return weights, ids


@torch.library.custom_op("tilecraft::moe_route", mutates_args=())
def _moe_route_op(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, n_group: int,
                  topk_group: int, renormalize: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _moe_route_impl(logits, bias, top_k, scoring, n_group, topk_group, renormalize, routed_scaling_factor)


@_moe_route_op.register_fake
def _(logits, bias, top_k, scoring, n_group, topk_group, renormalize, routed_scaling_factor):
    T_ = logits.shape[0]
    return logits.new_empty(T_, top_k, dtype=torch.float32), logits.new_empty(T_, top_k, dtype=torch.int32)


def moe_route(logits, top_k, *, bias=None, scoring="sigmoid", n_group=1, topk_group=1, renormalize=True,
              routed_scaling_factor=1.0):
    """Choose each token's experts. logits (T, E) fp32/bf16; bias (E,) or None.

    Returns weights (T, top_k) fp32 and ids (T, top_k) int32, best first. One kernel launch.
    NaN or inf logits raise ValueError (the check reads the values; see TILECRAFT_CHECK_VALUES).
    """
    _validate(logits, top_k, bias, scoring, n_group, topk_group, routed_scaling_factor)
    check.flag("renormalize", renormalize)
    finite = torch.isfinite(logits).all() if _values.enabled(logits) and logits.numel() else None
    out = _dispatch.call(_moe_route_op, _moe_route_impl, logits, bias, int(top_k), scoring, int(n_group),
                         int(topk_group), bool(renormalize), float(routed_scaling_factor))
    _check_finite(logits, finite)
    return out


def moe_hash_route(logits, input_ids, tid2eid, *, scoring="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.0):
    """DeepSeek-V4 hash routing: ids = tid2eid[input_ids] (a frozen table), weights from the scores.

    logits (T, E); input_ids (T,) int32/int64; tid2eid (vocab, k) int32 with ids in [0, E).
    Returns weights (T, k) fp32 and ids (T, k) int32.
    """
    check.tensor("logits", logits, dtypes=LOGIT_DTYPES, ndim=2, contiguous=True)
    check.tensor("input_ids", input_ids, dtypes=(torch.int32, torch.int64), ndim=1)
    check.tensor("tid2eid", tid2eid, dtypes=(torch.int32, torch.int64), ndim=2)
    check.shape("input_ids", input_ids, (logits.shape[0],), "(T,) matching logits")
    check.same_device(logits=logits, input_ids=input_ids, tid2eid=tid2eid)
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    check.flag("renormalize", renormalize)
    check.number("routed_scaling_factor", routed_scaling_factor)
    E = logits.shape[1]
    if _values.enabled(logits) and input_ids.numel():
        if bool(((input_ids < 0) | (input_ids >= tid2eid.shape[0])).any()):
            raise ValueError(f"input_ids must be in [0, {tid2eid.shape[0]}) (tid2eid's rows)"
                             + check.offending(input_ids, (input_ids < 0) | (input_ids >= tid2eid.shape[0])))
        if bool(((tid2eid < 0) | (tid2eid >= E)).any()):
            raise ValueError(f"tid2eid entries must be expert ids in [0, {E})")
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("logits must be finite")
    ids = tid2eid[input_ids.long()].to(torch.int32)                       # [T, k]
    weights = _scores_reference(logits, scoring).gather(1, ids.long())
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * routed_scaling_factor).float(), ids
