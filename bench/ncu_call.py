"""What the one-call ncu drivers (bench.ncu_gemm, bench.ncu_w4a8) share: an op module's switches from the command
line, and a call inside a profiler range (ncu --profile-from-start off sees only its kernels)."""

import torch


def switch(module, text: str):
    """NAME=VALUE -> (NAME, value) for an upper-case switch of `module`: None / True / False / an int, else the
    string; an unknown name exits naming it."""
    name, _, value = text.partition("=")
    if not hasattr(module, name) or not name.isupper():
        raise SystemExit(f"{module.__name__} has no switch {name!r}")
    parsed = {"None": None, "True": True, "False": False}.get(value, value)
    return name, int(parsed) if isinstance(parsed, str) and parsed.lstrip("-").isdigit() else parsed


def profile_calls(call, calls: int) -> None:
    """call() once outside the range (compilation, first launch), then `calls` times inside it."""
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
