"""GPU timing: CUDA events around each run, L2 flushed before each, median reported."""

from __future__ import annotations

import statistics

import torch

L2_FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2


def bench_cuda(fn, *, warmup_ms: float = 50.0, rep_ms: float = 300.0, min_reps: int = 10, max_reps: int = 2000,
               flush_l2: bool = True) -> dict:
    """Median / min / p20 / p80 milliseconds of fn() on the current stream."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush_l2 else None
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    reps = max(min_reps, min(max_reps, int(rep_ms / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return {"median_ms": statistics.median(times), "min_ms": times[0], "p20_ms": q[0], "p80_ms": q[-1], "reps": reps}


def measure_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    r = bench_cuda(lambda: dst.copy_(src), flush_l2=False)
    return 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9
