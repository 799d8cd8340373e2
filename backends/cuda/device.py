"""What GPU is there, and is there one at all."""

from __future__ import annotations

import functools

from backends import ToolchainError

# compute capability -> Tilecraft's CUDA arch; anything else has no lowering rules yet
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def require_gpu() -> None:
    """Raise ToolchainError naming what was found when no usable CUDA GPU is present."""
    import torch

    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA driver or GPU is visible"
        raise ToolchainError(f"a CUDA GPU is needed to launch this kernel, but {why} (torch {torch.__version__})")


def arch_of_device(device) -> str:
    import torch

    require_gpu()
    idx = torch.device(device).index
    cap = torch.cuda.get_device_capability(idx)
    arch = ARCH_BY_CAPABILITY.get(cap)
    if arch is None:
        name = torch.cuda.get_device_name(idx)
        supported = ", ".join(f"sm_{a}{b}" for a, b in ARCH_BY_CAPABILITY)
        raise ValueError(f"GPU '{name}' is sm_{cap[0]}{cap[1]}; Tilecraft has lowering rules for {supported} only")
    return arch


@functools.lru_cache(maxsize=None)
def _sm_count(index) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(tensor, default: int = 132) -> int:
    """Streaming multiprocessors of the GPU `tensor` lives on (kernels size their grids by it);
    `default` (the H200's count) for tensors elsewhere."""
    return _sm_count(tensor.device.index) if tensor.is_cuda else default


# ---- thread-block clusters ------------------------------------------------------------------------
# How many clusters of a given size the GPU runs at once depends on how its SMs are spread over GPCs
# (a cluster lives in one GPC), which differs from chip to chip of the same model: the driver is
# asked (cuOccupancyMaxActiveClusters) for a kernel of the same threads and shared memory. Kernels
# whose blocks wait on each other across a cluster (split-K folded in the cluster) may only be
# planned that way when all their clusters fit at once.

_PROBE_PTX = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry tilecraft_cluster_probe()\n{\n\tret;\n}\n\0"
_CLUSTER_DIMENSION = 4                   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_MAX_DYNAMIC_SHARED = 8                  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _launch_structs():
    import ctypes

    class Attribute(ctypes.Structure):            # CUlaunchAttribute: id, pad to 8, a 64-byte union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]

    class Config(ctypes.Structure):               # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attribute)), ("num_attrs", ctypes.c_uint)]

    return Attribute, Config


@functools.lru_cache(maxsize=None)
def _max_active_clusters(index: int, cluster: int, threads: int, smem_bytes: int) -> int:
    import ctypes

    import torch

    with torch.cuda.device(index):
        torch.cuda.current_stream().synchronize()     # the device's primary context is current here
        cuda = ctypes.CDLL("libcuda.so.1")

        def call(name, *args):
            rc = getattr(cuda, name)(*args)
            if rc != 0:
                raise RuntimeError(f"{name} failed with CUresult {rc}")

        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(_PROBE_PTX))
        try:
            call("cuModuleGetFunction", ctypes.byref(func), module, b"tilecraft_cluster_probe")
            call("cuFuncSetAttribute", func, _MAX_DYNAMIC_SHARED, ctypes.c_int(smem_bytes))
            Attribute, Config = _launch_structs()
            attr = Attribute(id=_CLUSTER_DIMENSION)
            attr.value[0] = cluster | (1 << 32)         # clusterDim {x = cluster, y = 1} then z = 1
            attr.value[1] = 1
            config = Config(grid=(ctypes.c_uint * 3)(cluster, 1, 1), block=(ctypes.c_uint * 3)(threads, 1, 1),
                            shared=smem_bytes, stream=None, attrs=ctypes.pointer(attr), num_attrs=1)
            n = ctypes.c_int()
            call("cuOccupancyMaxActiveClusters", ctypes.byref(n), func, ctypes.byref(config))
            return n.value
        finally:
            cuda.cuModuleUnload(module)


def max_active_clusters(tensor, cluster: int, threads: int, smem_bytes: int) -> int | None:
    """Clusters of `cluster` blocks (threads each, smem_bytes of dynamic shared memory) that the GPU of
    `tensor` holds at once, from the driver; None off CUDA or where the driver cannot say (the caller
    then plans without clusters)."""
    if not tensor.is_cuda:
        return None
    try:
        return _max_active_clusters(tensor.device.index, cluster, threads, smem_bytes)
    except (OSError, AttributeError, RuntimeError):
        return None
