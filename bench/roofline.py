"""The card's ceilings and each case's floor: max(bytes / bandwidth, flops / rate)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    gpu: str
    copy_gbps: float      # device-to-device copy, bytes read + written
    bf16_tflops: float    # large bf16 GEMM through torch
    fp8_tflops: float     # large fp8 GEMM through torch._scaled_mm
    source: str


# Measured on the lent GPU; see ../shared/ANCHORS.md (2026-11-29).
KNOWN = {
    "NVIDIA H200": Ceilings("NVIDIA H200", 4257.0, 791.0, 1447.0, "ANCHORS.md, measured 2026-11-29"),
}
REFERENCE_GPU = "NVIDIA H200"  # what floors are quoted against when no GPU is present


def ceilings_for(gpu_name: str | None) -> Ceilings:
    if gpu_name in KNOWN:
        return KNOWN[gpu_name]
    return KNOWN[REFERENCE_GPU]


def floor_ms(nbytes: float, flops: float, ceil: Ceilings, rate: str = "bf16") -> tuple[float, str]:
    """The fastest any kernel could run, and which term sets it ('memory' or 'compute')."""
    t_mem = nbytes / (ceil.copy_gbps * 1e9) * 1e3
    tflops = ceil.fp8_tflops if rate == "fp8" else ceil.bf16_tflops
    t_flop = flops / (tflops * 1e12) * 1e3
    return (t_mem, "memory") if t_mem >= t_flop else (t_flop, "compute")
