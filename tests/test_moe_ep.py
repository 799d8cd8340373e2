"""ops.moe_dispatch / ops.moe_combine with group= (expert parallelism), on gloo in 2 and 4 processes.

Each process group runs every scenario below and checks, bitwise, that the EP path equals the
single-device path on the concatenation of all ranks' tokens: the combined output of this rank's
tokens, and the local layout (the slice of the single-device layout for the rank's experts).
The expert function is elementwise in fp32 (y = x * a[e] + b[e]), so it gives the same bits for a
row whatever rows share its batch. The parent compiles the kernels first into the session's cache
directory (conftest), which the children load. One spawn of 4 processes covers both world sizes
(the whole group, then two groups of 2 at once).
"""

import importlib
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

import ops

# name: (E, k, H, dtype, tokens of rank r given W, routing)
SCENARIOS = {
    "random": (16, 4, 128, "bf16", lambda r, W: 5 + 3 * r, "random"),
    "hot_rank0": (16, 4, 128, "bf16", lambda r, W: 6, "rank0"),      # other ranks' experts get nothing
    "empty_rank": (16, 8, 128, "bf16", lambda r, W: 0 if r == 1 else 9, "random"),
    "fp8_scales": (16, 4, 128, "fp8", lambda r, W: 4 + r, "random"),
    "k1_e64": (64, 1, 128, "bf16", lambda r, W: 7, "random"),
    "k8_e64": (64, 8, 128, "bf16", lambda r, W: 5 + r, "random"),
    "one_token": (16, 8, 128, "bf16", lambda r, W: 1 + (r == 1), "random"),   # fewer tokens than chunks
}
# extra scenarios for the chunk-boundary test only (EP_CHUNKS 1, 3 and 16 on 2 ranks)
CHUNK_SCENARIOS = {
    "all_empty": (16, 4, 128, "bf16", lambda r, W: 0, "random"),               # every chunk of every rank empty
    "hot_rank0_fp8": (16, 4, 128, "fp8", lambda r, W: 7 + r, "rank0"),       # rank 1's experts get nothing
}
# the two-rank groups of the 4-process test: every expert on (group) rank 0, rank 1 with no tokens, fp8 rows
PAIR_SCENARIOS = ("hot_rank0", "empty_rank", "fp8_scales")
CHUNKS = (1, 3, 16)
TRANSPORTS = ("a2a", "peer")        # on gloo: all_to_all_single, and peer memory over shared files
# (transport, moe_ep_peer.FIXED_MASKED): the peer transport with the synced and the fixed-grid masked path
CONFIGS = (("a2a", False), ("peer", False), ("peer", True))
FIXED_DEFAULT = importlib.import_module("ops.moe_ep_peer").FIXED_MASKED
LAYOUTS = [("contiguous", dict(align=8)), ("contiguous", dict(align=128)), ("masked", dict(align=4)),
           ("masked", dict(align=4, max_m=64))]


def make_case(name, W, seed=0):
    """A scenario's tokens on W ranks (seed: other values, the same shapes)."""
    E, k, H, dtype, tokens, routing = {**SCENARIOS, **CHUNK_SCENARIOS}[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) + W + 1000 * seed)
    sizes = [tokens(r, W) for r in range(W)]
    T_ = sum(sizes)
    span = E // W if routing == "rank0" else E
    ids = torch.stack([torch.randperm(span, generator=g)[:k] for _ in range(T_)]).to(torch.int32) if T_ else \
        torch.empty(0, k, dtype=torch.int32)
    x = torch.randn(T_, H, generator=g) * 4
    scales = None
    if dtype == "fp8":
        x, scales = x.to(torch.float8_e4m3fn), torch.rand(T_, H // 128, generator=g) + 0.5
    else:
        x = x.bfloat16()
    w = torch.rand(T_, k, generator=g)
    a, b = torch.randn(E, generator=g), torch.randn(E, generator=g)
    return dict(E=E, sizes=sizes, x=x, scales=scales, ids=ids, w=w, a=a, b=b)


def experts(xd, sd, m, offset, a, b):
    """y = x * a[e] + b[e] per row in fp32 (elementwise: batch-independent bits); unused rows NaN."""
    a, b = a.to(xd.device), b.to(xd.device)
    xf = xd.float()
    if sd is not None:
        xf = xf * sd.repeat_interleave(128, -1)
    if m.layout == "contiguous":
        valid = m.m_indices >= 0
        e = torch.where(valid, m.m_indices.long() + offset, 0)
        y = xf * a[e][:, None] + b[e][:, None]
        y[~valid] = float("nan")
    else:
        e = torch.arange(m.num_experts, device=xd.device) + offset
        y = xf * a[e][:, None, None] + b[e][:, None, None]
        y[torch.arange(m.max_m, device=xd.device)[None, :] >= m.masked_m[:, None].long()] = float("nan")
    return y.bfloat16()


def single_device(case, layout, kw):
    xd, sd, m = ops.moe_dispatch(case["x"], case["ids"], case["E"], x_scales=case["scales"], layout=layout, **kw)
    out = ops.moe_combine(experts(xd, sd, m, 0, case["a"], case["b"]), m, case["w"])
    return xd, sd, m, out


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


def on(case, device):
    return {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in case.items()}


# a worker's single-device results by (scenario, W, device, layout, kw): the same for every transport
# and masked-path config it checks (only read)
_SINGLE = {}


def check_scenario(name, rank, W, group, device="cpu"):
    case = on(make_case(name, W), device)
    E, sizes = case["E"], case["sizes"]
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    n_loc, e0 = E // W, rank * (E // W)
    mine = {key: None if case[key] is None else case[key][lo:hi].contiguous() for key in ("x", "scales", "ids", "w")}
    for layout, kw in LAYOUTS:
        where = f"{name} W={W} rank={rank} {layout} {kw}"
        key = (name, W, device, layout, tuple(sorted(kw.items())))
        if key not in _SINGLE:
            _SINGLE[key] = single_device(case, layout, kw)
        xd_g, sd_g, m_g, out_g = _SINGLE[key]
        xd, sd, m = ops.moe_dispatch(mine["x"], mine["ids"], E, x_scales=mine["scales"], layout=layout, group=group,
                                     **kw)
        assert m.ep is not None and m.num_experts == n_loc and m.num_tokens == hi - lo, where
        assert m.counts.tolist() == m_g.counts[e0:e0 + n_loc].tolist(), where
        if layout == "contiguous":                 # the slice of the single-device layout for my experts
            padded = (m_g.counts.long() + kw["align"] - 1) // kw["align"] * kw["align"]
            start, stop = int(padded[:e0].sum()), int(padded[:e0 + n_loc].sum())
            assert torch.equal(bits(xd), bits(xd_g[start:stop])), where
            ref_idx = m_g.m_indices[start:stop]
            assert torch.equal(m.m_indices, torch.where(ref_idx >= 0, ref_idx - e0, -1)), where
            if sd is not None:
                assert torch.equal(sd, sd_g[start:stop]), where
        else:
            assert m.masked_m.tolist() == m_g.masked_m[e0:e0 + n_loc].tolist(), where
            rows = min(m.max_m, m_g.max_m)
            assert torch.equal(bits(xd[:, :rows]), bits(xd_g[e0:e0 + n_loc, :rows])), where
            assert not bits(xd[:, rows:]).any(), where
            if sd is not None:
                assert torch.equal(sd[:, :rows], sd_g[e0:e0 + n_loc, :rows]), where
        y = experts(xd, sd, m, e0, case["a"], case["b"])
        out = ops.moe_combine(y, m, mine["w"])
        assert out.shape == (hi - lo, xd.shape[-1]) and torch.equal(bits(out), bits(out_g[lo:hi])), where


def check_chunks(rank, W, group, chunks):
    """With EP_CHUNKS = chunks: the chunk bookkeeping of a mapping (token ranges cover the tokens, a
    chunk's rows are all its tokens' choices, empty chunks included) and the phase marks."""
    md = importlib.import_module("ops.moe_ep")

    case = make_case("random", W)
    lo, hi = sum(case["sizes"][:rank]), sum(case["sizes"][:rank + 1])
    x, ids = case["x"][lo:hi].contiguous(), case["ids"][lo:hi].contiguous()
    md._EP_TRACE = []
    try:
        xd, _, m = ops.moe_dispatch(x, ids, case["E"], group=group, align=8)
        ops.moe_combine(xd, m, case["w"][lo:hi].contiguous())
        marks = [name for name, _ in md._EP_TRACE]
    finally:
        md._EP_TRACE = None
    ep, T_, k = m.ep, hi - lo, ids.shape[1]
    assert ep.chunks == chunks and ep.token_bounds[0] == 0 and ep.token_bounds[-1] == T_
    assert all(a <= b for a, b in zip(ep.token_bounds, ep.token_bounds[1:]))
    for c in range(chunks):
        assert sum(ep.send_chunk_splits[c]) == (ep.token_bounds[c + 1] - ep.token_bounds[c]) * k
        assert sum(ep.recv_chunk_splits[c]) == ep.recv_bounds[c + 1] - ep.recv_bounds[c]
    assert sum(map(sum, ep.send_chunk_splits)) == sum(ep.send_splits) == T_ * k
    chunk_marks = [f"chunk{c}" for c in range(chunks)]
    assert marks == ["start", "header", "prep", "synced", "issued", "layout", *chunk_marks, "end", "start", "gather", *chunk_marks, "end"]


def check_reuse(rank, W, group, device="cpu", layout=("contiguous", dict(align=8))):
    """Back-to-back dispatches and combines with no sync between them, sizes that grow (the peer
    pools grow; a fixed-grid masked dispatch some rank cannot stage is done again by the synced
    path) and shrink, two mappings alive at once: every result still bitwise the single-device one."""
    cases = [on(make_case(name, W), device) for name in ("one_token", "k8_e64", "random", "k8_e64")]
    done = []
    for case in cases:
        lo, hi = sum(case["sizes"][:rank]), sum(case["sizes"][:rank + 1])
        xd, sd, m = ops.moe_dispatch(case["x"][lo:hi].contiguous(), case["ids"][lo:hi].contiguous(), case["E"],
                                     group=group, layout=layout[0], **layout[1])
        done.append((case, lo, hi, xd, m))
    for case, lo, hi, xd, m in done:                   # combined in dispatch order, after every dispatch
        out = ops.moe_combine(experts(xd, None, m, rank * (case["E"] // W), case["a"], case["b"]), m,
                              case["w"][lo:hi].contiguous())
        ref = single_device(case, *layout)[3][lo:hi]
        assert torch.equal(bits(out), bits(ref)), f"reuse W={W} rank={rank} E={case['E']} {layout}"


def check_unchecked_fixed(rank, W, group, device="cpu"):
    """The fixed-grid masked dispatch with value checks off reads nothing on the host; its combine
    reads the row counts then: bitwise the single-device result, pools already big enough."""
    md, peer = importlib.import_module("ops.moe_ep"), importlib.import_module("ops.moe_ep_peer")
    md.EP_TRANSPORT, peer.FIXED_MASKED = "peer", True
    os.environ["TILECRAFT_CHECK_VALUES"] = "0"
    try:
        for name in ("random", "k8_e64"):
            case = on(make_case(name, W), device)
            lo, hi = sum(case["sizes"][:rank]), sum(case["sizes"][:rank + 1])
            xd, _, m = ops.moe_dispatch(case["x"][lo:hi].contiguous(), case["ids"][lo:hi].contiguous(), case["E"],
                                        group=group, layout="masked", align=4, max_m=64)
            assert m.ep.recv_splits is None, "value checks off: nothing read on the host"
            out = ops.moe_combine(experts(xd, None, m, rank * (case["E"] // W), case["a"], case["b"]), m,
                                  case["w"][lo:hi].contiguous())
            ref = single_device(case, "masked", dict(align=4, max_m=64))[3][lo:hi]
            assert torch.equal(bits(out), bits(ref)), f"unchecked fixed {name} W={W} rank={rank}"
    finally:
        del os.environ["TILECRAFT_CHECK_VALUES"]


def check_graph(rank, W, group, device):
    """A decode step's dispatch (masked, max_m given), experts and combine captured in one CUDA graph
    (under capture the peer transport takes the fixed-grid dispatch and its device-table combine by
    itself), after one eager step that sizes the pools; replayed on new tokens of the same shapes:
    bitwise the single-GPU result every time."""
    md = importlib.import_module("ops.moe_ep")
    md.EP_TRANSPORT = "peer"
    kw = dict(layout="masked", align=4, max_m=64)
    cases = [on(make_case("k8_e64", W, seed), device) for seed in range(4)]
    lo, hi = sum(cases[0]["sizes"][:rank]), sum(cases[0]["sizes"][:rank + 1])
    E, e0 = cases[0]["E"], rank * (cases[0]["E"] // W)
    x, ids, w = (cases[0][key][lo:hi].clone() for key in ("x", "ids", "w"))

    def step():
        xd, _, m = ops.moe_dispatch(x, ids, E, group=group, **kw)
        e = torch.arange(m.num_experts, device=device) + e0
        y = xd.float() * cases[0]["a"][e][:, None, None] + cases[0]["b"][e][:, None, None]
        unused = torch.arange(m.max_m, device=device)[None, :, None] >= m.masked_m[:, None, None].long()
        return ops.moe_combine(torch.where(unused, float("nan"), y).bfloat16(), m, w)

    step()                                       # eager: sizes the pools
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, case in enumerate(cases):
        for key, buf in (("x", x), ("ids", ids), ("w", w)):
            buf.copy_(case[key][lo:hi])
        case = dict(case, a=cases[0]["a"], b=cases[0]["b"])
        graph.replay()
        ref = single_device(case, "masked", dict(align=4, max_m=64))[3][lo:hi]
        assert torch.equal(bits(out), bits(ref)), f"graph replay seed={seed} W={W} rank={rank}"


def check_errors(rank, W, group, device="cpu"):
    x, ids = torch.randn(3, 128).bfloat16().to(device), torch.zeros(3, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"num_experts={2 * W + 1} must be a multiple of the group's world size {W}"):
        ops.moe_dispatch(x, ids, 2 * W + 1, group=group)
    # one rank's bad arguments (not fp8 but scales given): every rank raises after the header, no hang
    scales = torch.ones(3, 1, device=device) if rank == W - 1 else None
    match = "x_scales is only for fp8 x" if rank == W - 1 else rf"rank\(s\) \[{W - 1}\] of the group"
    with pytest.raises(ValueError, match=match):
        ops.moe_dispatch(x, ids, 4 * W, x_scales=scales, group=group)
    # masked max_m too small on the receiving rank: it raises after every exchange, the others return
    hot = torch.zeros(3, 1, dtype=torch.int32, device=device)           # all to expert 0, on rank 0
    if rank == 0:
        with pytest.raises(ValueError, match=r"max_m=2 is smaller than the busiest expert's \d+ tokens"):
            ops.moe_dispatch(x, hot, 4 * W, layout="masked", max_m=2, group=group)
    else:
        ops.moe_dispatch(x, hot, 4 * W, layout="masked", max_m=2, group=group)
    # one rank's bad ids: it raises its own error, the others learn it in the header exchange (no hang)
    bad = ids + (4 * W if rank == 0 else 0)
    match = r"ids must be expert ids in \[0, " if rank == 0 else r"rank\(s\) \[0\] of the group got invalid arguments"
    with pytest.raises(ValueError, match=match):
        ops.moe_dispatch(x, bad, 4 * W, group=group)
    xd, _, m = ops.moe_dispatch(x, ids, 4 * W, group=group)
    with pytest.raises(ValueError, match="weights must have shape"):
        ops.moe_combine(torch.zeros_like(xd), m, torch.ones(3, 3, device=device))


def check_bench_dry_run(W, group):
    """bench.suites.moe's ep timing on gloo with a tiny case: every rank's rows, consistent bytes."""
    import torch.distributed as dist

    from bench.suites.moe import time_ep

    second = dist.new_group(list(range(W)))          # a variant group of the same ranks (bench: high priority)
    rows = time_ep(dict(T=6, H=128, num_experts=16, top_k=8), group, "cpu", warmup=1, reps=2, sweep=(1, 3),
                   phase_reps=2, variants={"g2": second}, transports=("peer",), fixed_max_m=64)
    assert len(rows) == 14 * W and all(r["median_ms"] > 0 for r in rows)
    by = {(r["provider"], r["rank"]): r for r in rows}
    for r in range(W):
        assert by["dispatch", r]["bytes"] == by["a2a-dispatch", r]["bytes"]
        assert by["combine", r]["bytes"] == by["a2a-combine", r]["bytes"]
        assert by["dispatch", r]["ratio_vs_a2a"] > 0 and by["combine-c3", r]["ratio_vs_a2a"] > 0
        assert by["dispatch-c1", r]["chunks"] == 1 and by["combine-c3", r]["bytes"] == by["combine", r]["bytes"]
        assert by["dispatch-g2", r]["ratio_vs_a2a"] > 0 and by["combine-g2", r]["bytes"] == by["combine", r]["bytes"]
        assert by["dispatch-peer", r]["transport"] == "peer" and by["combine-peer", r]["bytes"] == by["combine", r]["bytes"]
        assert by["dispatch", r]["transport"] == "a2a" and by["dispatch-c3", r]["transport"] == "a2a"
        assert by["dispatch-fixed", r]["transport"] == "peer-fixed" and by["combine-fixed", r]["ratio_vs_a2a"] > 0
        phases = by["dispatch", r]["phases_ms"].split()[::2]
        assert phases == ["header", "prep", "synced", "issued", "layout", *[f"chunk{c}" for c in range(4)], "end"], phases
        assert by["combine", r]["phases_ms"].split()[::2][0] == "gather"
    remote = [sum(by[p, r]["bytes"] for r in range(W)) for p in ("dispatch", "combine")]
    assert remote[0] == remote[1] > 0                # what leaves the ranks in dispatch comes back in combine


def gloo_init(rank, store, cache_dir, world):
    """A spawned CPU worker joins the gloo group, loading the kernels the parent compiled."""
    import torch.distributed as dist

    os.environ["TILECRAFT_CACHE_DIR"] = cache_dir
    os.environ["TILECRAFT_DISABLE_DISK_CACHE"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))


def worker(rank, store, cache_dir):
    """4 processes: every check over the whole group (W=4), then over two groups of 2 at once ([0, 1]
    and [2, 3]: in the second, group ranks differ from global ranks; PAIR_SCENARIOS)."""
    import torch.distributed as dist

    md = importlib.import_module("ops.moe_ep")
    peer = importlib.import_module("ops.moe_ep_peer")
    gloo_init(rank, store, cache_dir, 4)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for group in (dist.group.WORLD, pairs[rank // 2]):
            W, me = dist.get_world_size(group), dist.get_rank(group)
            # the pairs check the group-rank mapping: the scenarios whose routing depends on a rank
            names = SCENARIOS if group is dist.group.WORLD else PAIR_SCENARIOS
            for transport, fixed in CONFIGS:
                md.EP_TRANSPORT, peer.FIXED_MASKED = transport, fixed
                for name in names:
                    check_scenario(name, me, W, group)
                check_errors(me, W, group)
                check_reuse(me, W, group)
                check_reuse(me, W, group, layout=("masked", dict(align=4, max_m=64)))
            check_unchecked_fixed(me, W, group)
        md.EP_TRANSPORT, peer.FIXED_MASKED = None, FIXED_DEFAULT
        check_bench_dry_run(4, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def chunk_worker(rank, store, cache_dir):
    """2 processes: scenarios and bookkeeping with EP_CHUNKS 1, 3 and 16 (16 > every rank's tokens:
    empty chunks everywhere; all_empty: no rows at all)."""
    import torch.distributed as dist

    md = importlib.import_module("ops.moe_ep")

    gloo_init(rank, store, cache_dir, 2)
    try:
        for chunks in CHUNKS:
            md.EP_CHUNKS = chunks
            for name in ("one_token", "empty_rank", *CHUNK_SCENARIOS):
                check_scenario(name, rank, 2, dist.group.WORLD)
            check_chunks(rank, 2, dist.group.WORLD, chunks)
    finally:
        dist.destroy_process_group()


def reinit_worker(rank, store, cache_dir):
    """2 processes, peer transport: a group destroyed and made again (same ranks, same group name)
    gets pools of its own, not the old group's; then a group of a different size under that name."""
    import torch.distributed as dist

    md = importlib.import_module("ops.moe_ep")
    peer = importlib.import_module("ops.moe_ep_peer")
    for i, world in enumerate((2, 2)):
        gloo_init(rank, store + str(i), cache_dir, world)
        try:
            if i == 1:   # fresh pools with tiny slots: fixed-grid dispatches some rank cannot stage are redone
                peer.MIN_SLOT_BYTES, peer.FIXED_MASKED, md.EP_TRANSPORT = 4096, True, "peer"
                check_scenario("one_token", rank, world, dist.group.WORLD)          # makes the pools
                check_reuse(rank, world, dist.group.WORLD, layout=("masked", dict(align=4, max_m=64)))
                key = peer._key(dist.group.WORLD, torch.device("cpu"), "dispatch")
                assert peer._pool(key).slot_bytes > 4096, "the pool grew through the synced path"
                peer.MIN_SLOT_BYTES, peer.FIXED_MASKED = 1 << 20, FIXED_DEFAULT
            # the transport: auto on gloo is a2a; a setting outside TRANSPORTS is a clear error
            md.EP_TRANSPORT = None
            os.environ.pop("TILECRAFT_EP_TRANSPORT", None)
            assert md.ep_transport(dist.group.WORLD) == "a2a"
            assert md._peer_capable(dist.group.WORLD) is False          # no CUDA device: never auto-peer
            md.EP_TRANSPORT = "nvshmem"
            with pytest.raises(ValueError, match="EP transport must be one of"):
                md.ep_transport(dist.group.WORLD)
            md.EP_TRANSPORT = "peer"
            assert dist.group.WORLD.group_name == "0"
            check_scenario("random", rank, world, dist.group.WORLD)
            check_reuse(rank, world, dist.group.WORLD)
        finally:
            dist.destroy_process_group()
    if rank == 0:                               # a one-rank group named "0" again: nothing of the pair is reused
        gloo_init(0, store + "solo", cache_dir, 1)
        try:
            check_scenario("random", 0, 1, dist.group.WORLD)
        finally:
            dist.destroy_process_group()
        for suffix in ("0", "1", "solo"):
            if os.path.exists(store + suffix):
                os.unlink(store + suffix)


def nccl_worker(rank, store, cache_dir, world):
    """One process per GPU over NCCL: every scenario and the error paths on the whole group."""
    import torch.distributed as dist

    os.environ["TILECRAFT_CACHE_DIR"] = cache_dir
    os.environ["NCCL_NVLS_ENABLE"] = "0"        # never NVLink multicast
    import faulthandler

    faulthandler.dump_traceback_later(200)      # a hung rank prints where it waits (NCCL times out at 90 s)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90), device_id=torch.device("cuda", rank))
    md = importlib.import_module("ops.moe_ep")
    peer = importlib.import_module("ops.moe_ep_peer")
    dev = f"cuda:{rank}"
    try:
        for transport, fixed in CONFIGS[::-1]:  # peer first: torch symmetric memory over NVLink / P2P
            md.EP_TRANSPORT, peer.FIXED_MASKED = transport, fixed
            for name in SCENARIOS:
                check_scenario(name, rank, world, dist.group.WORLD, device=dev)
            check_errors(rank, world, dist.group.WORLD, device=dev)
            check_reuse(rank, world, dist.group.WORLD, device=dev)
            check_reuse(rank, world, dist.group.WORLD, device=dev, layout=("masked", dict(align=4, max_m=64)))
        check_unchecked_fixed(rank, world, dist.group.WORLD, device=dev)
        check_graph(rank, world, dist.group.WORLD, dev)
    except BaseException:
        # say why now and leave: the peers are blocked in their next collective, and tearing NCCL
        # down under them would hang this rank too (the parent then only sees a peer's timeout)
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def spawn(fn=worker, nprocs=4, extra=(), deadline_s=150):
    from tilecraft import env

    store = tempfile.NamedTemporaryFile(prefix="tilecraft-ep-", delete=False)
    store.close()
    os.unlink(store.name)                       # the file store must not exist yet
    ctx = mp.start_processes(fn, args=(store.name, str(env.cache_dir()), *extra), nprocs=nprocs, join=False,
                             start_method="spawn")
    t0 = time.monotonic()
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() - t0 > deadline_s:
                pytest.fail(f"EP workers still running after {deadline_s} s: a collective is hanging")
    finally:
        for p in ctx.processes:                 # only the workers this test started
            if p.is_alive():
                p.kill()
        if os.path.exists(store.name):
            os.unlink(store.name)


def compile_ep_kernels(chunk_counts, names=SCENARIOS):
    """Compile, here, the kernels the EP path adds to the single-device ones (the send plan's count over
    C*E keys, the unpadded scatter, the return gather), so the workers load them from the cache."""
    from ops.moe_dispatch import gather_rows_program, plan_count_program, scatter_rows_program

    scenarios = {**SCENARIOS, **CHUNK_SCENARIOS}
    for E in sorted({scenarios[n][0] for n in names}):
        for chunks in chunk_counts:
            plan_count_program.compile("cpu", num_experts=E * chunks)
    for bits, hidden in (("int16", 128), ("uint8", 128), ("int32", 1)):    # bf16 rows, fp8 rows, their scales
        for pad in (False, True):
            scatter_rows_program.compile("cpu", hidden=hidden, bits=bits, pad=pad)
    gather_rows_program.compile("cpu", hidden=128, bits="int16")
    from ops.moe_dispatch import combine_program
    from ops.moe_ep_peer import copy_rows_program, pull_rows_program, push_rows_program

    for k in sorted({scenarios[n][1] for n in names} | {8}):           # the peer combine (8: check_reuse)
        for split in (True, "info"):
            combine_program.compile("cpu", hidden=128, top_k=k, split=split)

    for bits, hidden in (("int16", 128), ("uint8", 128), ("int32", 1)):
        for pad in (False, True):
            copy_rows_program.compile("cpu", hidden=hidden, bits=bits, pad=pad)
            pull_rows_program.compile("cpu", hidden=hidden, bits=bits, pad=pad)
    push_rows_program.compile("cpu", hidden=128, bits="int16")


def test_ep_matches_single_device_bitwise_on_2_and_4_ranks():
    md = importlib.import_module("ops.moe_ep")

    for name in SCENARIOS:                      # compile every kernel once, here, into the shared cache
        for layout, kw in LAYOUTS:
            single_device(make_case(name, 2), layout, kw)
    compile_ep_kernels((md.EP_CHUNKS,))
    spawn()


def test_ep_chunk_boundaries_bitwise():
    """Chunk counts 1, 3 and 16 (more chunks than tokens), a rank with no tokens, no rows at all, a rank
    receiving nothing, fp8 rows: bitwise the single-device path, and the chunk bookkeeping adds up."""
    names = ("one_token", "empty_rank", *CHUNK_SCENARIOS)
    for name in names:
        for layout, kw in LAYOUTS:
            single_device(make_case(name, 2), layout, kw)
    compile_ep_kernels(CHUNKS, names)
    spawn(chunk_worker, 2)


def test_peer_pools_follow_the_group_not_its_name():
    for W in (1, 2):
        for layout, kw in LAYOUTS:
            single_device(make_case("random", W), layout, kw)
    single_device(make_case("random", 2), "contiguous", dict(align=8))
    for name in ("one_token", "k8_e64"):
        single_device(make_case(name, 2), "contiguous", dict(align=8))
    compile_ep_kernels((1,), ("random", "one_token", "k8_e64"))
    spawn(reinit_worker, 2)


def test_token_bounds_cover_every_token():
    from ops.moe_ep import _token_bounds

    assert _token_bounds(0, 4) == [0, 0, 0, 0, 0]
    assert _token_bounds(2, 4) == [0, 0, 1, 1, 2]
    assert _token_bounds(10, 3) == [0, 3, 6, 10]
    for T_ in range(0, 40):
        for C in (1, 2, 3, 4, 7, 16):
            b = _token_bounds(T_, C)
            assert b[0] == 0 and b[-1] == T_ and all(x <= y for x, y in zip(b, b[1:]))
            # the send plan's key uses chunk(t) = ((t + 1) * C - 1) // T: the same ranges
            for t in range(T_):
                c = ((t + 1) * C - 1) // T_
                assert b[c] <= t < b[c + 1]


def test_ep_chunks_must_be_a_positive_int(monkeypatch):
    md = importlib.import_module("ops.moe_ep")

    for bad in (0, -1, 2.0, True):
        monkeypatch.setattr(md, "EP_CHUNKS", bad)
        with pytest.raises(ValueError, match="EP_CHUNKS must be an int >= 1"):
            md._ep_chunks()


@pytest.mark.gpu
def test_ep_over_nccl_matches_single_gpu_bitwise():
    """The same checks on real GPUs, one process each over NCCL: the EP layouts and combined outputs
    equal the single-GPU kernels' results bitwise (W = every visible GPU)."""
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs for NCCL, found {world}")
    for name in SCENARIOS:                      # compile the kernels once, here, into the shared cache
        for layout, kw in LAYOUTS:
            single_device(on(make_case(name, world), "cuda"), layout, kw)
    spawn(nccl_worker, world, (world,), deadline_s=300)


def test_group_without_distributed_is_a_clear_error():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process already has a process group")
    x, ids = torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        ops.moe_dispatch(x, ids, 8, group=object())


def test_bench_ep_bookkeeping_and_no_torchrun_message():
    from bench.suites import moe

    t = moe.ep_traffic([3, 5], [4, 2], 0, 10)
    assert t == dict(dispatch_sent=80, dispatch_recv=60, dispatch_remote=50, combine_sent=60, combine_recv=80,
                     combine_remote=20)
    with pytest.raises(ValueError, match="splits of one length"):
        moe.ep_traffic([1], [1, 2], 0, 4)
    case = moe.PRESETS["ep"][0]
    assert (case["T"], case["H"], case["num_experts"], case["top_k"]) == (4096, 7168, 256, 8)
    assert moe.SUITE.nbytes(case) == 4096 * 8 * 7168 * 2 and "torchrun" in moe.SUITE.label(case)
    with pytest.raises(SystemExit, match="needs torch.distributed with >= 2 GPUs"):
        moe.make_inputs(case, torch.device("cpu"))


def test_single_device_mapping_has_no_ep():
    x, ids = torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.int32)
    _, _, m = ops.moe_dispatch(x, ids, 8)
    assert m.ep is None and m.num_tokens == 2
