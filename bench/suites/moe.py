"""MoE glue: the router (DeepSeek-V3 gate), dispatch and combine.

route:    bytes = T*E*4 (logits) + T*k*8 (weights + ids); flops ~ 0 (latency-bound at small T).
          Providers: tilecraft (the op, with its NaN/inf check), tilecraft-unchecked (the launch
          alone), tilecraft-graph (16 calls in one CUDA graph, time per call), torch.
dispatch: bytes = 2 * T*k*H*2 (each chosen row read and written, bf16)
combine:  bytes = T*k*H*2 + T*H*2 (expert rows read, token rows written)

ep (expert parallelism, moe_dispatch/moe_combine with group=): needs torchrun and >= 2 GPUs, e.g.

    torchrun --standalone --nproc-per-node 8 -m bench.op moe --shape ep

  Each rank routes T=4096 tokens (H=7168 bf16, k=8, E=256 placed E/W per rank). The ranks time in
  lockstep (the same number of calls each, a barrier before each timed call; bench.timing's adaptive
  rep count differs per rank, which would deadlock the collectives): dispatch, combine, and a raw
  all_to_all_single of the same bytes with the same splits (uint8 rows, both directions). GB/s per
  GPU = bytes this GPU sends to the other GPUs / time (dispatch: its (token, choice) rows owned by
  other ranks; combine: the rows it returns), the same bytes for the raw all-to-all, so the ratio
  op / raw is the fraction of the fabric's all-to-all speed the op reaches. Rank 0 prints every
  rank's numbers and writes bench/results/moe-ep-*.json/.csv, then the run ends (the generic
  per-provider table is not used for this preset). NCCL_NVLS_ENABLE is forced to 0 before NCCL starts.
  Without torchrun (or a GPU) the preset says so; with no GPU bench.op builds its kernels statically.
  The default rows use the default transport (TILECRAFT_EP_TRANSPORT: auto = peer memory on one
  host); dispatch-a2a / combine-a2a are the all_to_all_single transport, and dispatch-cN / combine-cN
  the same with ops.moe_ep.EP_CHUNKS = N row chunks. dispatch-fixed / combine-fixed: the peer
  transport's fixed-grid masked dispatch (ops.moe_ep_peer.FIXED_MASKED, max_m = EP_FIXED_MAX_M: no
  host read before the rows move; its combine reads its tables on the device), and
  dispatch-fixed-graph / combine-fixed-graph the same captured in CUDA graphs with value checks off,
  timed by their replays (the host out of the loop; the combine graph holds two calls, one a slot). phases_ms on the dispatch/combine rows: median
  ms between the phase marks the EP path records (CUDA events on the compute stream, in a few extra
  traced calls after the timing), each named by where it ends:
    peer dispatch: header (count kernel, header all-gather), staged (place kernel, x staged in the
      pool), synced (the host waits for the header), layout (receive layout uploaded and expanded,
      the pool barrier), end (one pull per source rank);
    peer combine: push (one push per destination rank), barrier (the pool's device barrier), end
      (the combine kernel);
    a2a dispatch: header (send count kernel + header all-gather), prep (send plan + chunk 0's send
      rows), synced (the host sync), issued (later chunks' send rows, the exchanges issued), layout
      (the receive layout on the host, uploaded), chunk<c> (until chunk c's rows have arrived and
      chunk c-1 is placed), end (placement of the last chunk);
    a2a combine: gather (every chunk's return rows gathered, exchanges issued), chunk<c> (until
      chunk c is back and chunk c-1 combined), end (the last chunk's combine).
  A phase that grows when the transfer does not is local work the exchange fails to hide.
"""

import importlib
import os
import statistics
import sys
import time

import torch

import ops
from bench.suites import Provider, Suite
from ops.moe_dispatch import (combine_program, gather_rows_program, plan_count_program, plan_place_program,
                               scatter_rows_program)
from ops.moe_route import _moe_route_impl, moe_route_warp_program

V3 = dict(num_experts=256, top_k=8, n_group=8, topk_group=4)

PRESETS = {
    "route": [dict(kind="route", T=t, **V3) for t in (1, 128, 4096, 16384)],
    "dispatch": [dict(kind="dispatch", T=4096, H=7168, **V3)],
    "combine": [dict(kind="combine", T=4096, H=7168, **V3)],
    "ep": [dict(kind="ep", T=4096, H=7168, num_experts=256, top_k=8)],
}
EP_SWEEP = (1, 2, 8)       # EP_CHUNKS values also timed under torchrun (the default, 4, is the main row)
EP_FIXED_MAX_M = 384       # max_m of the fixed-grid masked providers (T=4096, k=8 over 256 experts: ~256 a rank's expert)
EP_NEEDS = ("moe --shape ep needs torch.distributed with >= 2 GPUs: launch it with "
            "torchrun --standalone --nproc-per-node N -m bench.op moe --shape ep (N >= 2)")


def ep_traffic(send_splits, recv_splits, rank, row_bytes):
    """Bytes one rank moves in an EP dispatch (combine is the reverse): all rows, and the remote ones."""
    if len(send_splits) != len(recv_splits) or not 0 <= rank < len(send_splits):
        raise ValueError(f"splits of one length and a rank inside them, got {len(send_splits)}, "
                         f"{len(recv_splits)}, rank {rank}")
    sent, recv = sum(send_splits) * row_bytes, sum(recv_splits) * row_bytes
    return dict(dispatch_sent=sent, dispatch_recv=recv,
                dispatch_remote=sent - send_splits[rank] * row_bytes,      # what crosses the fabric
                combine_sent=recv, combine_recv=sent,
                combine_remote=recv - recv_splits[rank] * row_bytes)


def lockstep_ms(fn, group, device, warmup=3, reps=20):
    """Median ms of fn() on this rank, every rank making the same calls (fn runs collectives)."""
    import torch.distributed as dist

    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)                   # start together: the op waits for its slowest peer
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:                                       # CPU dry runs (gloo): wall time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ep_phases(fn, group, device, reps=5):
    """Median ms of each phase of fn (one EP dispatch or combine), from the marks the EP path records
    while ops.moe_ep._EP_TRACE is a list; every rank makes the same calls."""
    import torch.distributed as dist

    md = importlib.import_module("ops.moe_ep")

    cuda = torch.device(device).type == "cuda"
    per = {}
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        md._EP_TRACE = []
        try:
            fn()
        finally:
            marks, md._EP_TRACE = md._EP_TRACE, None
        if cuda:
            torch.cuda.synchronize()
        for (_, t0), (name, t1) in zip(marks, marks[1:]):
            per.setdefault(name, []).append(t0.elapsed_time(t1) if cuda else (t1 - t0) * 1e3)
    return {name: statistics.median(v) for name, v in per.items()}


def capture_graph(fn, device):
    """fn captured in a CUDA graph (one uncaptured call first, on a side stream, as capture wants)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return graph


def fixed_providers(x, ids, E, w, group, device, max_m):
    """The peer transport's fixed-grid masked dispatch (moe_ep_peer.FIXED_MASKED) and its combine,
    eager; on CUDA also both captured in CUDA graphs (fixed_graphs: their replays are what engines
    run). {name: (fn, traffic key[, calls a fn() call])}."""
    md, peer = importlib.import_module("ops.moe_ep"), importlib.import_module("ops.moe_ep_peer")

    def fixed(fn):
        def call():
            saved = md.EP_TRANSPORT, peer.FIXED_MASKED
            md.EP_TRANSPORT, peer.FIXED_MASKED = "peer", True       # the same on every rank, in lockstep
            try:
                return fn()
            finally:
                md.EP_TRANSPORT, peer.FIXED_MASKED = saved
        return call

    dispatch = fixed(lambda: ops.moe_dispatch(x, ids, E, layout="masked", max_m=max_m, group=group))
    dispatch()                                   # the pools exist: the next calls take the fixed grid
    xd, _, m = dispatch()
    out = {"dispatch-fixed": (dispatch, "dispatch_remote"),
           "combine-fixed": (lambda: ops.moe_combine(xd, m, w), "combine_remote")}
    if torch.device(device).type == "cuda":
        out.update(fixed_graphs(dispatch, lambda: ops.moe_combine(xd, m, w), group, device))
    return out


def fixed_graphs(dispatch, combine, group, device):
    """dispatch-fixed-graph (one fixed-grid dispatch, value checks off) and combine-fixed-graph (two
    combines of its mapping: the two pool slots, so that back-to-back replays are ordered by the
    pool barriers; a replay of one combine alone would reuse its slot while a peer may still read
    it) captured in CUDA graphs: {name: (replay, traffic key, calls a replay)}. A capture that
    fails is reported, and that provider is dropped on every rank."""
    import torch.distributed as dist

    from tilecraft import env

    out = {}
    for name, fn, key, calls in (("dispatch-fixed-graph", dispatch, "dispatch_remote", 1),
                                 ("combine-fixed-graph", lambda: (combine(), combine()), "combine_remote", 2)):
        saved, graph = env.get("TILECRAFT_CHECK_VALUES"), None
        env.set("TILECRAFT_CHECK_VALUES", "0")
        try:
            graph = capture_graph(fn, device)
        except Exception as e:                   # noqa: BLE001 (reported, and the provider dropped everywhere)
            print(f"{name}: capture failed on rank {dist.get_rank(group)}: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            env.set("TILECRAFT_CHECK_VALUES", saved)
        ok = torch.tensor([int(graph is not None)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)       # every rank times the same providers
        if ok.item():
            out[name] = (graph.replay, key, calls)
    return out


def time_ep(case, group, device, warmup=3, reps=20, sweep=(), phase_reps=5, variants=None, transports=(),
            fixed_max_m=None):
    """Every rank's ms and GB/s for dispatch, combine (the default EP transport) and the raw
    all-to-alls (a list of rows); transports: also dispatch-<t> / combine-<t> with
    ops.moe_ep.EP_TRANSPORT = t; sweep: also dispatch-cN / combine-cN, the "a2a" transport with N
    row chunks (ops.moe_ep.EP_CHUNKS) for N in sweep; variants {name: process group}: also
    dispatch-<name> / combine-<name> over that group (the same ranks, e.g. NCCL on a high-priority
    stream), against the same raw all-to-all."""
    import torch.distributed as dist

    md = importlib.import_module("ops.moe_ep")

    W, me = dist.get_world_size(group), dist.get_rank(group)
    sweep = tuple(dict.fromkeys(sweep))
    T_, H, E, k = case["T"], case["H"], case["num_experts"], case["top_k"]
    g = torch.Generator(device="cpu").manual_seed(me)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)]).to(torch.int32).to(device)
    x = torch.randn(T_, H, generator=g).to(torch.bfloat16).to(device)
    w = torch.rand(T_, k, generator=g).to(device)
    xd, _, m = ops.moe_dispatch(x, ids, E, group=group)
    send, recv = m.ep.send_splits, m.ep.recv_splits
    row = H * x.element_size()
    traffic = ep_traffic(send, recv, me, row)
    a = torch.empty(sum(send), row, dtype=torch.uint8, device=device)
    b = torch.empty(sum(recv), row, dtype=torch.uint8, device=device)
    timed = {
        "dispatch": (lambda: ops.moe_dispatch(x, ids, E, group=group), "dispatch_remote"),
        "combine": (lambda: ops.moe_combine(xd, m, w), "combine_remote"),
        "a2a-dispatch": (lambda: dist.all_to_all_single(b, a, recv, send, group=group), "dispatch_remote"),
        "a2a-combine": (lambda: dist.all_to_all_single(a, b, send, recv, group=group), "combine_remote"),
    }
    default, default_transport = md.EP_CHUNKS, md.EP_TRANSPORT

    def setting(fn, chunks=default, transport=default_transport):
        def call():
            md.EP_CHUNKS, md.EP_TRANSPORT = chunks, transport   # the same module values on every rank, in lockstep
            try:
                return fn()
            finally:
                md.EP_CHUNKS, md.EP_TRANSPORT = default, default_transport
        return call

    runs = [(f"-{t}", dict(transport=t)) for t in transports]
    runs += [(f"-c{chunks}", dict(chunks=chunks, transport="a2a")) for chunks in sweep]
    for suffix, kw in runs:
        xd_c, _, m_c = setting(timed["dispatch"][0], **kw)()
        timed[f"dispatch{suffix}"] = (setting(timed["dispatch"][0], **kw), "dispatch_remote")
        timed[f"combine{suffix}"] = (lambda xd_c=xd_c, m_c=m_c: ops.moe_combine(xd_c, m_c, w), "combine_remote")
    if fixed_max_m is not None:
        timed.update(fixed_providers(x, ids, E, w, group, device, fixed_max_m))
    for name, vg in (variants or {}).items():
        xd_v, _, m_v = ops.moe_dispatch(x, ids, E, group=vg)
        timed[f"dispatch-{name}"] = (lambda vg=vg: ops.moe_dispatch(x, ids, E, group=vg), "dispatch_remote")
        timed[f"combine-{name}"] = (lambda xd_v=xd_v, m_v=m_v: ops.moe_combine(xd_v, m_v, w), "combine_remote")
    mine = torch.zeros(len(timed), W, dtype=torch.float64, device=device)
    for i, (fn, *rest) in enumerate(timed.values()):       # (fn, traffic key[, calls per fn()])
        mine[i, me] = lockstep_ms(fn, group, device, warmup, reps) / (rest[1] if len(rest) > 1 else 1)
    phases = {name: ep_phases(timed[name][0], group, device, phase_reps) for name in ("dispatch", "combine")}
    every = [None] * W
    dist.all_gather_object(every, phases, group=group)
    nbytes = torch.zeros(len(timed), W, dtype=torch.float64, device=device)
    for i, (_, key, *_calls) in enumerate(timed.values()):
        nbytes[i, me] = traffic[key]
    dist.all_reduce(mine, group=group)               # every rank's numbers everywhere (zeros elsewhere)
    dist.all_reduce(nbytes, group=group)
    rows = []
    for i, name in enumerate(timed):
        for r in range(W):
            ms, nb = float(mine[i, r]), float(nbytes[i, r])
            rows.append(dict(case=f"ep T={T_}/rank H={H} E={E} k={k} W={W}", provider=name, rank=r, median_ms=ms,
                             bytes=nb, gbps=nb / (ms * 1e-3) / 1e9 if ms > 0 else None))
            if name in phases:
                rows[-1]["transport"] = m.ep.transport
                rows[-1]["chunks"] = m.ep.chunks
                rows[-1]["phases_ms"] = " ".join(f"{p} {v:.4f}" for p, v in every[r][name].items())
            elif name.startswith(("dispatch-c", "combine-c")):
                rows[-1]["transport"] = "a2a"
                rows[-1]["chunks"] = int(name.rsplit("-c", 1)[1])
            elif "-fixed" in name:
                rows[-1]["transport"] = "peer-fixed"
                rows[-1]["chunks"] = 1
            elif name.startswith(("dispatch-", "combine-")):
                t = name.split("-", 1)[1]
                rows[-1]["transport"] = t if t in transports else m.ep.transport
                rows[-1]["chunks"] = 1 if rows[-1]["transport"] == "peer" else default
    for rw in rows:                                  # op / raw all-to-all of the same bytes, same rank
        op_name = rw["provider"].split("-")[0]
        raw = "a2a-" + op_name if op_name in ("dispatch", "combine") else None
        if raw is not None:
            ref = next(q for q in rows if q["provider"] == raw and q["rank"] == rw["rank"])
            rw["ratio_vs_a2a"] = ref["median_ms"] / rw["median_ms"]
    return rows


def print_ep(rows):
    print(f"{'case':34s} {'provider':13s} {'rank':>4s} {'ms':>9s} {'GB/s/GPU':>9s} {'vs a2a':>7s}")
    for r in rows:
        ratio = r.get("ratio_vs_a2a")
        print(f"{r['case'][:34]:34s} {r['provider']:13s} {r['rank']:4d} {r['median_ms']:9.4f} "
              f"{r['gbps'] or 0:9.1f} {'' if ratio is None else format(ratio, '7.2f')}")
    for r in rows:
        if r.get("phases_ms"):
            print(f"phases (ms) {r['provider']} rank {r['rank']}, {r['transport']}, {r['chunks']} chunks: "
                  f"{r['phases_ms']}")


def run_ep(case, device):
    """The ep preset under torchrun: time, print and write on rank 0, then end the run."""
    import torch.distributed as dist

    if torch.device(device).type != "cuda":
        raise SystemExit(EP_NEEDS)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise SystemExit(EP_NEEDS)
        os.environ["NCCL_NVLS_ENABLE"] = "0"          # never NVLink multicast (NVLS)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    if dist.get_world_size() < 2:
        raise SystemExit(EP_NEEDS)
    device = torch.device("cuda", torch.cuda.current_device())
    # the default transport (peer memory on one host), next to the all-to-all transport and its chunk counts
    rows = time_ep(case, dist.group.WORLD, device, sweep=EP_SWEEP, transports=("a2a",), fixed_max_m=EP_FIXED_MAX_M)
    if dist.get_rank() == 0:
        from bench import op as bench_op

        print_ep(rows)
        meta = {"gpu": torch.cuda.get_device_name(), "world_size": dist.get_world_size(), **bench_op.versions()}
        base = bench_op.write_results(rows, meta, SUITE, f"ep-w{dist.get_world_size()}", bench_op.RESULTS, False)
        print(f"\nwrote {base}.csv and .json", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0)                               # the generic per-provider loop would deadlock on collectives


def make_inputs(case, device):
    if case["kind"] == "ep":
        run_ep(case, device)                          # does not return
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
    if case["kind"] == "ep":                          # nominal: every (token, choice) row sent once (bf16)
        return T_ * k * case["H"] * 2
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


GRAPH_CALLS = 16


def tilecraft_graph(case, i):
    """GRAPH_CALLS router calls captured in one CUDA graph (as in a decode step's graph), one replay
    timed: the per-call time without the per-launch event gaps (the value check is skipped in capture)."""
    if case["kind"] != "route":
        raise ValueError("only the router is timed in a graph")
    call = tilecraft(case, i)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    return graph.replay


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
        return [(plan_count_program, dict(num_experts=case["num_experts"])),
                (plan_place_program, dict(layout="contiguous")),
                (scatter_rows_program, dict(hidden=case["H"], bits="int16"))]
    if case["kind"] == "ep":
        from ops.moe_dispatch import EP_CHUNKS

        return [(plan_count_program, dict(num_experts=case["num_experts"] * EP_CHUNKS)),
                (plan_place_program, dict(layout="contiguous")),
                (scatter_rows_program, dict(hidden=case["H"], bits="int16", pad=False)),
                (scatter_rows_program, dict(hidden=case["H"], bits="int16")),
                (gather_rows_program, dict(hidden=case["H"], bits="int16")),
                (combine_program, dict(hidden=case["H"], top_k=case["top_k"]))]
    return [(combine_program, dict(hidden=case["H"], top_k=case["top_k"]))]


SUITE = Suite(
    name="moe",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=nbytes,
    flops=lambda c: 0,
    providers=[Provider("tilecraft", tilecraft), Provider("tilecraft-unchecked", tilecraft_unchecked),
               Provider("tilecraft-graph", tilecraft_graph, calls=GRAPH_CALLS), Provider("torch", torch_provider)],
    kernels=lambda c, t: kernels(c),
    label=lambda c: f"{c['kind']} T={c['T']}" + (f" H={c['H']}" if "H" in c else "") + f" E={c['num_experts']} k={c['top_k']}"
    + (" (per rank; needs torchrun, >= 2 GPUs)" if c["kind"] == "ep" else ""),
)
