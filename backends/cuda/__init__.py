"""CUDA 13 backend: nvcc discovery and version check, cubin builds, SASS statistics, device checks."""

from backends.cuda.toolchain import Toolchain, find_toolchain, prepare_tilelang_env
from backends.cuda.sass import SassStats, build_cubin, disassemble, sass_stats
from backends.cuda.device import arch_of_device, require_gpu

__all__ = [
    "Toolchain",
    "find_toolchain",
    "prepare_tilelang_env",
    "SassStats",
    "build_cubin",
    "disassemble",
    "sass_stats",
    "arch_of_device",
    "require_gpu",
]
