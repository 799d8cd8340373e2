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
