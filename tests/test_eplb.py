"""ops.eplb_plan: replica counts and rank packing against brute force on small cases, and its bound."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ops


def check_plan(plan, counts, R, S):
    E = len(counts)
    p2l, l2p, reps, loads = plan
    assert p2l.shape == (R * S,) and reps.shape == (E,) and l2p.shape[0] == E
    assert (reps >= 1).all() and int(reps.sum()) == R * S
    assert torch.bincount(p2l, minlength=E).tolist() == reps.tolist()      # the tables agree
    for e in range(E):
        slots = l2p[e][l2p[e] >= 0]
        assert slots.numel() == reps[e] and (p2l[slots] == e).all() and torch.equal(slots, slots.sort().values)
    w = torch.tensor(counts, dtype=torch.float64) / reps
    expect = torch.zeros(R, dtype=torch.float64).index_add_(0, torch.arange(R * S) // S, w[p2l])
    torch.testing.assert_close(loads, expect)
    # the documented bound: max load <= total / R + (largest - smallest replica load)
    assert float(loads.max()) <= sum(counts) / R + float(w.max() - w.min()) + 1e-9
    # hotter experts never get fewer replicas
    for a, b in itertools.combinations(range(E), 2):
        if counts[a] > counts[b]:
            assert reps[a] >= reps[b]
    return w


def best_replicas(counts, slots):
    """min over replica counts (each >= 1, summing to slots) of the largest per-replica load."""
    E = len(counts)
    best = float("inf")
    for extra in itertools.product(range(slots - E + 1), repeat=E):
        if sum(extra) == slots - E:
            best = min(best, max(c / (1 + x) for c, x in zip(counts, extra)))
    return best


def best_packing(weights, R, S):
    """The optimal max rank load for these replica weights, S per rank (brute force, tiny cases)."""
    best = float("inf")
    for assign in itertools.product(range(R), repeat=len(weights)):
        if all(assign.count(r) == S for r in range(R)):
            loads = [0.0] * R
            for w, r in zip(weights, assign):
                loads[r] += w
            best = min(best, max(loads))
    return best


@pytest.mark.parametrize("counts,R,S", [([100, 10, 10, 1, 50, 3], 2, 4), ([5, 5, 5], 3, 1), ([0, 0, 0], 2, 2),
                                        ([7, 1, 1, 1], 2, 3), ([9, 8, 1, 1, 1], 3, 3)])
def test_small_cases_against_brute_force(counts, R, S):
    plan = ops.eplb_plan(torch.tensor(counts), R, S)
    w = check_plan(plan, counts, R, S)
    assert float(w.max()) == pytest.approx(best_replicas(counts, R * S))   # step 1 is optimal
    opt = best_packing(w[plan.physical_to_logical].tolist(), R, S)      # one weight per replica
    assert opt < float("inf")
    assert float(plan.rank_loads.max()) <= 2 * opt + 1e-9
    if counts == [100, 10, 10, 1, 50, 3]:                                   # greedy finds the optimum here
        assert float(plan.rank_loads.max()) == pytest.approx(opt)


@settings(max_examples=40, deadline=None)
@given(E=st.integers(1, 12), R=st.integers(1, 4), extra=st.integers(0, 4), seed=st.integers(0, 9999))
def test_random_plans_keep_the_bound(E, R, extra, seed):
    S = -(-E // R) + extra
    g = torch.Generator().manual_seed(seed)
    counts = (torch.rand(E, generator=g) ** 3 * 1000).round().tolist()
    plan = ops.eplb_plan(counts, R, S)
    check_plan(plan, counts, R, S)
    again = ops.eplb_plan(counts, R, S)                                     # deterministic
    assert all(torch.equal(a, b) for a, b in zip(plan, again))


def test_hot_expert_is_replicated_and_spread():
    counts = torch.tensor([1000] + [10] * 15)
    plan = ops.eplb_plan(counts, 4, 5)
    assert plan.replica_counts[0] == 5 and (plan.replica_counts[1:] == 1).all()
    assert int(plan.replica_counts.sum()) == 20


def test_deepseek_v3_size():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5000, (256,), generator=g)
    counts[:8] *= 20                                                        # a few hot experts
    plan = ops.eplb_plan(counts, 8, 36)
    check_plan(plan, counts.tolist(), 8, 36)
    assert float(plan.rank_loads.max()) <= 1.05 * float(counts.sum()) / 8


def test_invalid_inputs():
    with pytest.raises(ValueError, match=r"2 \* 2 = 4 slots cannot hold 5 experts"):
        ops.eplb_plan(torch.ones(5), 2, 2)
    with pytest.raises(ValueError, match="counts must be finite and >= 0"):
        ops.eplb_plan(torch.tensor([1.0, -1.0]), 1, 2)
    with pytest.raises(ValueError, match="counts must be finite and >= 0"):
        ops.eplb_plan(torch.tensor([1.0, float("nan")]), 1, 2)
    with pytest.raises(ValueError, match=r"counts must have shape \(E,\)"):
        ops.eplb_plan(torch.ones(2, 2), 2, 2)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        ops.eplb_plan(torch.ones(2), 0, 2)
    with pytest.raises(TypeError, match="num_slots_per_rank must be an int"):
        ops.eplb_plan(torch.ones(2), 2, 1.5)
    with pytest.raises(TypeError, match="counts must be an int or float tensor"):
        ops.eplb_plan(torch.ones(2, dtype=torch.bool), 2, 1)
