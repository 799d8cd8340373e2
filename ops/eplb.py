"""Expert placement for expert parallelism (EPLB-style): replicate hot experts, balance ranks.

eplb_plan(counts, num_ranks, num_slots_per_rank) takes observed tokens per logical expert (E,) and
fills num_ranks * num_slots_per_rank >= E physical expert slots:
  1. replicas: every expert gets one; each remaining slot goes to the expert whose tokens per
     replica, count / replicas, is largest (ties: more tokens, then fewer replicas, then lower id).
     This greedy minimises the largest per-replica load, and a hotter expert never ends with fewer
     replicas than a colder one.
  2. packing: the replicas, each carrying count / replicas, are sorted heaviest first (ties: lower
     expert id, then lower replica index) and packed two ways, keeping the one with the lower
     maximum rank load (ties: the first):
     a. rounds: dealt in rounds of num_ranks, the heaviest replica of a round to the lightest rank
        (ties: lower rank), the next to the next lightest, so every rank gets one per round.
        Bound (induction over rounds): the spread between the most and least loaded rank is at
        most max over rounds of (heaviest - lightest replica in the round) <= w_max - w_min;
     b. greedy (EPLB's balanced packing): each replica to the lightest rank that has a free slot.
     Hence, with w the per-replica loads:
         max rank load <= total / num_ranks + (w_max - w_min) <= 2 * optimum,
     since any placement's maximum is at least total / num_ranks and at least the smallest possible
     largest replica load, which step 1 achieves (w_max). Greedy b is usually the better one.
  Inside a rank, slots are ordered by expert id. Replicas of one expert may share a rank when a
  round boundary splits them (balance is unaffected; it only wastes a slot's weights).
Everything runs on the host in exact, deterministic order; the result is on the CPU.
Dispatch to replicas (choosing a physical slot per (token, choice)) is future work: moe_dispatch's
group= path places logical experts contiguously, E/W per rank.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import torch


class EplbPlan(NamedTuple):
    physical_to_logical: torch.Tensor  # (num_ranks * num_slots_per_rank,) int64: slot r*S + i -> logical expert
    logical_to_physical: torch.Tensor  # (E, max replicas) int64: each expert's slots, ascending, -1 padding
    replica_counts: torch.Tensor       # (E,) int64: replicas per logical expert, >= 1, sums to the slot count
    rank_loads: torch.Tensor           # (num_ranks,) float64: tokens each rank is expected to serve


def _replica_counts(counts: list[float], slots: int) -> list[int]:
    reps = [1] * len(counts)
    heap = [(-c, -c, 1, e) for e, c in enumerate(counts)]          # (-(c / r), -c, r, e)
    heapq.heapify(heap)
    for _ in range(slots - len(counts)):
        _, neg_c, r, e = heapq.heappop(heap)
        reps[e] = r + 1
        heapq.heappush(heap, (neg_c / (r + 1), neg_c, r + 1, e))
    return reps


def _pack_rounds(items, R):
    loads, per_rank = [0.0] * R, [[] for _ in range(R)]
    for start in range(0, len(items), R):
        lightest_first = sorted(range(R), key=lambda r: (loads[r], r))
        for (w, e, _), r in zip(items[start:start + R], lightest_first):
            loads[r] += w
            per_rank[r].append(e)
    return loads, per_rank


def _pack_greedy(items, R, S):
    loads, per_rank = [0.0] * R, [[] for _ in range(R)]
    for w, e, _ in items:
        r = min((r for r in range(R) if len(per_rank[r]) < S), key=lambda r: (loads[r], r))
        loads[r] += w
        per_rank[r].append(e)
    return loads, per_rank


def eplb_plan(counts, num_ranks: int, num_slots_per_rank: int) -> EplbPlan:
    """Replicate and place E logical experts on num_ranks ranks of num_slots_per_rank slots each.

    counts: (E,) observed tokens per logical expert, int or float tensor (or a list), >= 0 and finite.
    Returns EplbPlan(physical_to_logical, logical_to_physical, replica_counts, rank_loads); see the
    module docstring for the algorithm and its bound.
    """
    for name, v in (("num_ranks", num_ranks), ("num_slots_per_rank", num_slots_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not isinstance(counts, torch.Tensor):
        try:
            counts = torch.tensor(counts, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"counts must be a (E,) tensor or a list of numbers, got {type(counts).__name__}") from e
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must have shape (E,) with E >= 1, got {tuple(counts.shape)}")
    if counts.dtype == torch.bool or counts.is_complex():
        raise TypeError(f"counts must be an int or float tensor, got {counts.dtype}")
    c = counts.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(c).all()) or bool((c < 0).any()):
        raise ValueError(f"counts must be finite and >= 0, got min {float(c.min())}, max {float(c.max())}")
    E, R, S = c.numel(), num_ranks, num_slots_per_rank
    slots = R * S
    if slots < E:
        raise ValueError(f"num_ranks * num_slots_per_rank = {R} * {S} = {slots} slots cannot hold {E} experts")
    cl = c.tolist()
    reps = _replica_counts(cl, slots)
    items = sorted(((cl[e] / reps[e], e, i) for e in range(E) for i in range(reps[e])),
                   key=lambda t: (-t[0], t[1], t[2]))
    loads, per_rank = min(_pack_rounds(items, R), _pack_greedy(items, R, S), key=lambda p: max(p[0]))
    p2l = torch.tensor([e for r in range(R) for e in sorted(per_rank[r])], dtype=torch.int64)
    l2p = torch.full((E, max(reps)), -1, dtype=torch.int64)
    fill = [0] * E
    for p, e in enumerate(p2l.tolist()):
        l2p[e, fill[e]] = p
        fill[e] += 1
    assert fill == reps and math.isclose(sum(loads), sum(cl), rel_tol=1e-9, abs_tol=1e-9)
    return EplbPlan(p2l, l2p, torch.tensor(reps, dtype=torch.int64), torch.tensor(loads, dtype=torch.float64))
