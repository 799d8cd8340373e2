"""One benchmark suite per op family: presets of shapes, providers, byte and flop formulas."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

SUITE_MODULES = {"rms_norm": "bench.suites.rms_norm", "mla": "bench.suites.mla", "moe": "bench.suites.moe",
                 "topk": "bench.suites.topk", "gemm": "bench.suites.gemm"}
ALIASES = {"rmsnorm": "rms_norm", "mla_decode": "mla", "topk_select": "topk"}


@dataclass
class Provider:
    name: str
    make: Callable[[dict, dict], Callable[[], Any]]  # (case, inputs) -> thunk to time
    available: Callable[[], str | None] = lambda: None  # None when usable, else why not
    peer: bool = False                                  # an external library (FlashMLA, DeepGEMM)
    calls: int = 1                                      # op calls per timed thunk (times are divided by it)
    experimental: bool = False                          # a kernel variant the op does not choose: run only when named
    nbytes: Callable[[dict], float] | None = None       # bytes it moves when not the suite's (e.g. an FP8 cache)
    graphable: bool = True                              # False: the call syncs with the host (a Python loop over
                                                        # a tensor's values), so --graph times it eagerly


@dataclass
class Suite:
    name: str
    presets: dict[str, list[dict]]
    make_inputs: Callable[[dict, Any], dict]
    nbytes: Callable[[dict], float]
    flops: Callable[[dict], float]
    providers: list[Provider]
    kernels: Callable[[dict, str], list[tuple[Any, dict]]]  # (case, target) -> [(TileProgram, params)] for static stats
    rate: str = "bf16"
    label: Callable[[dict], str] = field(default=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
    reference: str = "torch"                            # the provider ratios are quoted against


def with_switch(make, module, name, value):
    """A provider's make: `make` (its first call, the compile, included) and each call of its thunk run
    with the module-level switch `name` of `module` set to value (put back after), against the default
    in the same run."""
    def switched(fn, *args):
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args)
        finally:
            setattr(module, name, old)

    def provider(case, inputs):
        fn = switched(make, case, inputs)
        return lambda: switched(fn)
    return provider


def get(name: str) -> Suite:
    key = ALIASES.get(name, name)
    if key not in SUITE_MODULES:
        raise ValueError(f"no benchmark for op {name!r}; known: {', '.join(sorted(SUITE_MODULES))}")
    return importlib.import_module(SUITE_MODULES[key]).SUITE
