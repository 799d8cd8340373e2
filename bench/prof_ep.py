"""Host vs device time of each phase of an EP dispatch/combine (torchrun, >= 2 GPUs).

    torchrun --standalone --nproc-per-node 2 -m bench.prof_ep [--transport peer,a2a] [--chunks 4,1] [--pin]

For each chunk count: per phase (the marks the EP path records), the median host time between
marks (h:) and the GPU time between the same marks (g:), plus host_issue (the call's host time)
and gpu_total. Where h: and g: agree and host_issue is close to gpu_total the op is host-bound:
the GPU waits on Python. Same case as `bench.op moe --shape ep` (T=4096 per rank, H=7168, E=256,
k=8, bf16). It first prints each rank's CPU affinity; --pin then moves each rank's main thread
onto its own 1/world share of those cores (NCCL's threads, already started, keep theirs), to see
whether ranks sharing cores is what slows the host. bench/NOTES.md "EP v3" has the H200 numbers.
"""

import argparse
import importlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="4,1", help="EP_CHUNKS values for the a2a transport")
    p.add_argument("--transport", default="peer,a2a")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--pin", action="store_true", help="pin each rank's main thread to its own share of the cores")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("bench.prof_ep needs torchrun with >= 2 GPUs")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    md = importlib.import_module("ops.moe_ep")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    group, r = dist.group.WORLD, dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.barrier()                                   # NCCL is up: its threads have set their affinity
    cpus = sorted(os.sched_getaffinity(0))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (r, len(cpus), f"{cpus[0]}-{cpus[-1]}" if cpus else "none"))
    if r == 0:                                       # ranks sharing cores with each other or NCCL's proxies
        print("cpu affinity per rank (rank, cores, range):", every, flush=True)
    if args.pin:
        share = len(cpus) // dist.get_world_size()
        os.sched_setaffinity(0, cpus[r * share:(r + 1) * share])
        dist.all_gather_object(every, (r, share, f"{cpus[r * share]}-{cpus[(r + 1) * share - 1]}"))
        if r == 0:
            print("pinned main threads (rank, cores, range):", every, flush=True)
    T_, H, E, k = 4096, 7168, 256, 8
    g = torch.Generator().manual_seed(r)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)]).to(torch.int32).to(dev)
    x = torch.randn(T_, H, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(T_, k, generator=g).to(dev)
    mark, host_marks = md._mark, []

    def traced(name, device):
        host_marks.append((name, time.perf_counter()))
        mark(name, device)

    md._mark = traced
    default, default_transport = md.EP_CHUNKS, md.EP_TRANSPORT
    configs = [(t, c) for t in args.transport.split(",") for c in (map(int, args.chunks.split(",")) if t == "a2a" else [1])]
    try:
        for transport, chunks in configs:
            md.EP_CHUNKS, md.EP_TRANSPORT = chunks, transport
            xd, _, m = ops.moe_dispatch(x, ids, E, group=group)
            for _ in range(5):
                xd, _, m = ops.moe_dispatch(x, ids, E, group=group)
                ops.moe_combine(xd, m, w)
            res = {}
            for _ in range(args.reps):
                for op in ("dispatch", "combine"):
                    torch.cuda.synchronize()
                    dist.barrier()
                    host_marks.clear()
                    md._EP_TRACE = []
                    t0 = time.perf_counter()
                    if op == "dispatch":
                        xd, _, m = ops.moe_dispatch(x, ids, E, group=group)
                    else:
                        ops.moe_combine(xd, m, w)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    ev, md._EP_TRACE = md._EP_TRACE, None
                    d = res.setdefault(op, {})
                    d.setdefault("host_issue", []).append((t1 - t0) * 1e3)
                    d.setdefault("gpu_total", []).append(ev[0][1].elapsed_time(ev[-1][1]))
                    for (_, a), (n, b) in zip(host_marks, host_marks[1:]):
                        d.setdefault("h:" + n, []).append((b - a) * 1e3)
                    for (_, a), (n, b) in zip(ev, ev[1:]):
                        d.setdefault("g:" + n, []).append(a.elapsed_time(b))
            lines = [f"rank {r} {transport} chunks={chunks} {op}: " + " ".join(f"{n} {statistics.median(v):.3f}" for n, v in d.items())
                     for op, d in res.items()]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, lines)
            if r == 0:
                print("\n".join(line for rank_lines in every for line in rank_lines), flush=True)
    finally:
        md._mark, md.EP_CHUNKS, md.EP_TRANSPORT = mark, default, default_transport
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
