"""Scratch tensors for an op's kernels: carved from one allocation, or kept when never touched.

An eager call's host time is mostly allocations, launches and tensor-view ops (bench/NOTES.md
"eager host cost"), so ops that need several int32 scratch tensors take them from one torch.empty
and cut each with a single as_strided (split + slice + view cost three times as much per view).
"""

import math

import torch

_LAYOUTS: dict = {}


def _layout(shapes):
    """(total elements, [(shape, strides, offset)]) with every offset a multiple of 4 elements."""
    out, at = [], 0
    for s in shapes:
        s = (s,) if isinstance(s, int) else tuple(s)
        strides = tuple(math.prod(s[i + 1:]) for i in range(len(s)))
        out.append((s, strides, at))
        at += (math.prod(s) + 3) // 4 * 4
    return max(at, 1), out


def int32_views(device, *shapes):
    """Contiguous int32 tensors of these shapes (ints or tuples), views of one allocation, each
    starting 16-byte aligned (kernels may read them as int4)."""
    lay = _LAYOUTS.get(shapes)
    if lay is None:
        if len(_LAYOUTS) > 1024:        # shapes that vary call to call (prefill lengths)
            _LAYOUTS.clear()
        lay = _LAYOUTS[shapes] = _layout(shapes)
    total, views = lay
    buf = torch.empty(total, dtype=torch.int32, device=device)
    return [buf.as_strided(s, st, off) for s, st, off in views]


_BOUND_ONLY: dict = {}


def bound_only(device, size=1, dtype=torch.int32):
    """A tensor a kernel binds but never reads or writes in this call's mode, for the launch path
    only (real tensors, never under tracing): one per (device, size, dtype) is kept, so an eager
    call allocates nothing for it (an allocation is ~5 us of host time on the H200 host)."""
    key = (device, size, dtype)
    t = _BOUND_ONLY.get(key)
    if t is None:
        if len(_BOUND_ONLY) >= 256:
            _BOUND_ONLY.clear()
        t = _BOUND_ONLY[key] = torch.empty(size, dtype=dtype, device=device)
    return t


def _per_stream(table: dict, device, size: int, make):
    """table[(device, stream)] when it has at least `size` elements, else make(the one it replaces, or None) put
    there. Under CUDA graph capture on a stream that has
    none large enough, the device's largest that is large enough is shared instead: making one there would put its
    fill into the graph, run on every replay (so such a graph must not replay while an eager call that uses the
    same buffer runs on another stream)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    t = table.get(key)
    if t is not None and t.numel() >= size:
        return t
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        shared = [b for (d, _), b in table.items() if d == device and b.numel() >= size]
        if shared:
            return max(shared, key=lambda b: b.numel())
    t = table[key] = make(t)
    return t


_COUNTERS: dict = {}


def arrival_counters(device, size):
    """At least `size` int32 zeros for kernels that count block arrivals (tile.last_arrival) and set
    each count back to 0 before they end: one tensor per (device, stream), zeroed once, so calls on
    one stream, which run one after another, share it; calls on other streams get their own (under CUDA graph
    capture: _per_stream)."""
    def make(old):
        if len(_COUNTERS) >= 256:
            _COUNTERS.clear()
        return torch.zeros(max(size, 1024), dtype=torch.int32, device=device)

    return _per_stream(_COUNTERS, device, size, make)


_READY: dict = {}
_READY_KEPT: list = []


def ready_partials(device, splits, rows, n):
    """A (splits, rows, n) fp32 view of a buffer whose every word holds ops._ready.READY_EMPTY, for the
    swapped kernels' fenceless split-K fold, which sets each word it reads back to READY_EMPTY before it ends:
    one buffer per (device, stream), as arrival_counters (under CUDA graph capture: _per_stream). A buffer
    outgrown by a larger call is kept, not freed (a CUDA graph captured with it still points there)."""
    from ops._ready import READY_EMPTY

    size = splits * rows * n

    def make(old):
        if old is not None:
            _READY_KEPT.append(old)
        return torch.full((max(size, 1 << 16),), READY_EMPTY, dtype=torch.int32, device=device).view(torch.float32)

    return _per_stream(_READY, device, size, make)[:size].view(splits, rows, n)
