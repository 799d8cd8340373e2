"""Programmatic dependent launch (PDL) inside CUDA graphs.

A kernel node normally starts once the kernel before it has finished and its writes are visible; the launch
itself, the blocks' start and whatever they load before their first real work (barrier setup, the weights' first
stages: ~1.5 us a decode GEMM, bench/NOTES.md "Session 46") then sit on the critical path. With a programmatic
edge the next kernel may start while the previous one is still running: as soon as every block of the previous
kernel has executed `griddepcontrol.launch_dependents` or exited. It then does what does not depend on the previous
kernel and executes `griddepcontrol.wait`, which returns once the previous kernel has completed and its memory
operations are visible.

That is only safe for kernels written for it: every read of an earlier kernel's output and every global write
after the wait (sm90.pdl_producer). Such kernels register their device function names here (`register`), and
`programmatic_edges` turns the edges of a captured graph into them, and only into them, into programmatic ones.
Our launches (TileLang's tvm_ffi runtime) carry no launch attribute for it, so this is done on the captured graph:

    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        ...
    programmatic_edges(g)
    g.instantiate()

Launched outside such an edge (eagerly, or behind a normal edge), both instructions return at once.
"""

from __future__ import annotations

import ctypes
import functools

KERNELS: set[str] = set()       # device functions safe behind a programmatic edge (register)

_NODE_KERNEL = 0                # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1          # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_TYPE_PROGRAMMATIC = 1          # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


def register(name: str) -> None:
    """Declare the device function `name` (as compiled: TileLang's `<prim_func>_kernel`) safe behind a programmatic
    edge: nothing it reads that an earlier kernel writes, and nothing it writes, is touched before its
    griddepcontrol.wait."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a kernel's name (a non-empty str), got {name!r}")
    KERNELS.add(name)


class _EdgeData(ctypes.Structure):          # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):      # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"programmatic_edges needs the CUDA driver (libcuda.so.1): {e}") from None


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUresult {result} ({(text.value or b'?').decode()})")


def _edges(graph: int):
    d = _driver()
    n = ctypes.c_size_t(0)
    _check(d.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges")
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (_EdgeData * n.value)()
    _check(d.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "cuGraphGetEdges")
    return [(src[i], dst[i], data[i]) for i in range(n.value)]


def kernel_name(node: int) -> str | None:
    """The device function a graph node launches (None: not a kernel node)."""
    d = _driver()
    kind = ctypes.c_int(-1)
    _check(d.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _NODE_KERNEL:
        return None
    params = _KernelParams()
    _check(d.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func:
        _check(d.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    elif params.kern:
        _check(d.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return (name.value or b"").decode() or None


def _handle(graph) -> int:
    handle = graph.raw_cuda_graph() if hasattr(graph, "raw_cuda_graph") else graph
    if not isinstance(handle, int) or handle == 0:
        raise TypeError(f"graph must be a torch.cuda.CUDAGraph captured with keep_graph=True or a CUgraph handle, "
                        f"got {graph!r}")
    return handle


def describe(graph) -> list[str]:
    """The graph's edges as text, one a line: 'upstream -> downstream' with each node's kernel name (or its node
    type) and the edge's (port, type) where it is not a plain one."""
    handle = _handle(graph)
    d = _driver()
    out = []
    for u, v, data in _edges(handle):
        ends = []
        for node in (u, v):
            name = kernel_name(node)
            if name is None:
                kind = ctypes.c_int(-1)
                _check(d.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
                name = f"<node type {kind.value}>"
            ends.append(name)
        note = f" (port {data.from_port}, type {data.type})" if data.type or data.from_port else ""
        out.append(f"{ends[0]} -> {ends[1]}{note}")
    return out


def programmatic_edges(graph, kernels=None) -> int:
    """Make every plain edge of `graph` from a kernel node to a node of one of `kernels` (device function names;
    default: the registered ones) programmatic. graph: a torch.cuda.CUDAGraph captured with keep_graph=True (call
    its instantiate() afterwards), or a raw CUgraph handle. Returns how many edges changed."""
    handle = _handle(graph)
    wanted = set(KERNELS if kernels is None else kernels)
    d = _driver()
    names: dict[int, str | None] = {}

    def name(node):
        if node not in names:
            names[node] = kernel_name(node)
        return names[node]

    changed = 0
    for u, v, data in _edges(handle):
        if data.type != 0 or data.from_port != 0 or name(v) not in wanted or name(u) is None:
            continue
        one = lambda x: (ctypes.c_void_p * 1)(x)  # noqa: E731
        _check(d.cuGraphRemoveDependencies_v2(ctypes.c_void_p(handle), one(u), one(v), (_EdgeData * 1)(data), 1),
               "cuGraphRemoveDependencies")
        edge = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=_TYPE_PROGRAMMATIC)
        _check(d.cuGraphAddDependencies_v2(ctypes.c_void_p(handle), one(u), one(v), (_EdgeData * 1)(edge), 1),
               "cuGraphAddDependencies")
        changed += 1
    return changed
