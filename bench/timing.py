"""GPU timing: CUDA events around each run, L2 flushed before each, median reported (eager launches,
or replays of a CUDA graph: bench_graph)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time

import torch

L2_FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
# How the L2 is flushed before each timed call: "write" zero-fills the buffer (as every committed
# result so far, and triton's do_bench); it leaves up to an L2 of dirty lines that are written back
# during the timed call (measured +10 us on a 148 us memory-bound MLA decode; bench/NOTES.md "flush
# methodology"). "read" sums the buffer instead: the L2 holds only clean lines of it.
FLUSH_MODES = ("write", "read")


def _flusher(flush_l2, mode):
    """A function that evicts the L2 (None: no flush)."""
    if not flush_l2:
        return None
    if mode not in FLUSH_MODES:
        raise ValueError(f"flush mode must be one of {FLUSH_MODES}, got {mode!r}")
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    if mode == "write":
        return buf.zero_
    words, sink = buf.view(torch.int64), torch.empty((), dtype=torch.int64, device="cuda")
    return lambda: torch.sum(words, dim=0, out=sink)


def bench_cuda(fn, *, warmup_ms: float = 50.0, rep_ms: float = 300.0, min_reps: int = 10, max_reps: int = 2000,
               flush_l2: bool = True, flush_mode: str = "write") -> dict:
    """Median / min / p20 / p80 milliseconds of fn() on the current stream, and host_bound: whether the host took
    as long to issue a rep (flush, events, fn's Python and launches: host_ms) as the GPU took to run it (gpu_rep_ms).
    Then the GPU waits for fn's kernels inside the timed span and the times include host gaps (bench/NOTES.md
    "Session 42": an FP8 MLA kernel of 0.088 ms measured with a bimodal median of 0.099); time such calls in
    CUDA graphs (bench_graph)."""
    flush = _flusher(flush_l2, flush_mode)
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
    torch.cuda.synchronize()        # the warm-up drained: the timed reps' issue starts with an empty queue
    reps = max(min_reps, min(max_reps, int(rep_ms / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    first = torch.cuda.Event(enable_timing=True)
    first.record()
    # the host's time a rep over the first HOST_REPS only: past a full launch queue the host waits for the GPU
    # and would look as slow as it
    watched = min(reps, HOST_REPS)
    t0 = time.perf_counter()
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
        if i == watched - 1:
            host_ms = (time.perf_counter() - t0) * 1e3 / watched
    torch.cuda.synchronize()
    gpu_rep_ms = first.elapsed_time(ends[-1]) / reps
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return {"median_ms": statistics.median(times), "min_ms": times[0], "p20_ms": q[0], "p80_ms": q[-1], "reps": reps,
            "host_ms": host_ms, "gpu_rep_ms": gpu_rep_ms, "host_bound": host_bound(host_ms, gpu_rep_ms)}


HOST_REPS = 32      # bench_cuda's reps whose issue the host is timed on (a few launches each: the queue holds them)


def host_bound(host_ms: float, gpu_rep_ms: float) -> bool:
    """The host issued reps about as fast as the GPU ran them (within 10%): it, not the GPU, set the pace."""
    return host_ms >= 0.9 * gpu_rep_ms


def bench_graph(fn, *, calls: int = 16, rep_ms: float = 300.0, min_reps: int = 5, max_reps: int = 200,
                flush_l2: bool = True, flush_mode: str = "write") -> dict:
    """bench_cuda's numbers with no host in the loop: `calls` x (L2 flush, fn()) captured in one CUDA
    graph and replayed, minus a graph of the `calls` flushes alone; each quantile is (replay quantile
    - flush-only quantile) / calls. The GPU time of a call as a model's decode graph sees it, apart
    from launch jitter on the host (bench/NOTES.md "GEMM v5"). fn must be capturable: no host sync,
    no allocation outside the graph's pool."""
    flush = _flusher(flush_l2, flush_mode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # compile, and make any per-stream workspace, outside capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def capture(with_fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if flush is not None:
                    flush()
                if with_fn:
                    fn()
        return graph

    def replays(graph, reps):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in events)

    work = capture(True)
    est = max(statistics.median(replays(work, 3)), 1e-3)
    reps = max(min_reps, min(max_reps, int(rep_ms / est)))
    times = replays(work, reps)
    base = replays(capture(False), reps) if flush is not None else [0.0] * reps

    def quantiles(ts):
        q = statistics.quantiles(ts, n=5) if len(ts) >= 5 else [ts[0]] * 4
        return ts[0], q[0], statistics.median(ts), q[-1]

    (w0, w20, w50, w80), (b0, b20, b50, b80) = quantiles(times), quantiles(base)
    return {"median_ms": (w50 - b50) / calls, "min_ms": (w0 - b0) / calls, "p20_ms": (w20 - b20) / calls,
            "p80_ms": (w80 - b80) / calls, "reps": reps * calls}


CARD_FIELDS = ("uuid", "power.limit", "clocks.max.sm", "temperature.gpu", "driver_version")


def card_identity(device: int = 0) -> dict:
    """Which physical card a run used, as nvidia-smi names it ({} where it cannot say): its UUID, power limit (W),
    top SM clock (MHz), temperature at the start (C) and driver. Two H200s ran the same FP8 MLA kernel at
    1.55-1.59x and 1.62-1.67x the bf16 cache (bench/NOTES.md "Session 42"): the card held the FP8 kernel's clock
    or did not, so every result names its card."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "-i", smi_index(device), f"--query-gpu={','.join(CARD_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    values = [v.strip() for v in lines[0].split(",")] if lines else []
    if len(values) != len(CARD_FIELDS):
        return {}
    return {f"gpu_{f.replace('.', '_')}": v for f, v in zip(CARD_FIELDS, values) if v not in ("", "[N/A]")}


def smi_index(device: int) -> str:
    """nvidia-smi's name (index or UUID) for torch's CUDA device `device`, through CUDA_VISIBLE_DEVICES."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[device] if device < len(visible) else str(device)


class SmClock:
    """The SM clock (MHz) and board power (W) while a block runs: `nvidia-smi --loop-ms` samples both every
    `period_ms` in the background; median() and median_watts() are their medians, None where nvidia-smi
    is missing or gave nothing. The eager bench's back-to-back FP8 prefill runs the H200 at its power
    limit, 1440-1515 MHz against ~1.75 GHz under the profiler's 20 calls (bench/NOTES.md "Session 31"):
    the clock each provider ran at is what tells a slower kernel from a slower GPU, and its power what
    the kernel costs under that limit."""

    def __init__(self, device: int = 0, period_ms: int = 50):
        self.gpu = smi_index(device)
        self.period_ms = period_ms
        self.samples: list[int] = []
        self.watts: list[float] = []
        self._proc = None

    _power_field: str | None = None       # found once a process: see _power()

    @classmethod
    def _power(cls, exe: str) -> str:
        """power.draw.instant where the driver has it: plain power.draw is a one-second average on recent
        drivers, so the first provider timed after an idle stretch (the bench's compile-ahead) read ~210 W
        while it ran at the power limit (session 32)."""
        if cls._power_field is None:
            try:
                probe = subprocess.run([exe, "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"],
                                       capture_output=True, text=True, timeout=10)
                ok = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            cls._power_field = "power.draw.instant" if ok else "power.draw"
        return cls._power_field

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            query = [exe, "-i", self.gpu, f"--query-gpu=clocks.sm,{self._power(exe)}", "--format=csv,noheader,nounits",
                     f"--loop-ms={self.period_ms}"]
            self._proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate()
            for line in out.splitlines():                  # "1755, 412.33" ([N/A] where a field is unknown)
                mhz, _, watts = (f.strip() for f in line.partition(","))
                if mhz.isdigit():
                    self.samples.append(int(mhz))
                    try:
                        self.watts.append(float(watts))
                    except ValueError:
                        pass
        return False

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def median_watts(self) -> float | None:
        return statistics.median(self.watts) if self.watts else None


def measure_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    r = bench_cuda(lambda: dst.copy_(src), flush_l2=False)
    return 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9


def profiled_kernels(fn, reps: int, warmup: int = 1):
    """The CUDA kernel events of reps calls of fn (torch profiler), each call after an L2 flush (the
    flush's own kernel included: callers filter by name), after warmup unprofiled calls."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def mean_kernel_times(fn, reps: int = 30, warmup: int = 3) -> dict:
    """{kernel name (60 characters): mean GPU microseconds per call} over reps calls of fn, each after an L2
    flush (profiled_kernels; the flush's own kernel left out)."""
    total: dict = {}
    for ev in profiled_kernels(fn, reps, warmup=warmup):
        if "elementwise" not in ev.name:        # the L2 flush
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            total[ev.name[:60]] = total.get(ev.name[:60], 0.0) + t
    return {name: t / reps for name, t in total.items()}
