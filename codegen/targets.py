"""Compilation targets: what Tilecraft can lower to, how to name them, how to pick one.

A target is chosen, in order: the `target=` argument, $TILECRAFT_TARGET, then the tensors' device
(a CUDA GPU's compute capability, an Ascend NPU, or the CPU). A target that cannot run on the
tensors' device is an error that names both.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from tilecraft import env


@dataclass(frozen=True)
class Target:
    name: str          # canonical name, e.g. "cuda:sm_90a"
    vendor: str        # "cuda" | "ascend" | "cpu": the rule family it falls back to
    arch: str          # "sm_90a" | "sm_100a" | "dav-3510" | "c"
    device_type: str   # the torch device type its kernels run on
    description: str

    def tvm(self):
        """The TVM/TileLang target object."""
        from tvm.target import Target as TvmTarget

        if self.vendor == "cuda":
            return TvmTarget({"kind": "cuda", "arch": self.arch})
        if self.vendor == "ascend":
            return TvmTarget("ascend")
        return TvmTarget("c")

    @property
    def lang(self):
        """The TileLang dialect module that this target's lowering rules emit into."""
        if self.vendor == "ascend":
            import tilelang.ascend.language as lang
        else:
            import tilelang.language as lang
        return lang

    def __str__(self) -> str:
        return self.name


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cuda:sm_90a", "cuda", "sm_90a", "cuda", "NVIDIA Hopper (H100/H200/H800): WGMMA, TMA"),
        Target("cuda:sm_100a", "cuda", "sm_100a", "cuda", "NVIDIA Blackwell (B200/B300): tcgen05, tensor memory"),
        Target("ascend:950", "ascend", "dav-3510", "npu", "Huawei Ascend 950 (dav-3510): Cube + Vector cores, CANN 9.2"),
        Target("cpu", "cpu", "c", "cpu", "TileLang's C target, run through its cython backend (a subset of words)"),
    )
}

ALIASES = {
    "sm_90a": "cuda:sm_90a", "sm90a": "cuda:sm_90a", "sm_90": "cuda:sm_90a", "hopper": "cuda:sm_90a",
    "sm_100a": "cuda:sm_100a", "sm100a": "cuda:sm_100a", "sm_100": "cuda:sm_100a", "blackwell": "cuda:sm_100a",
    "ascend": "ascend:950", "950": "ascend:950", "dav-3510": "ascend:950", "ascend950": "ascend:950",
    "c": "cpu",
}


def get(name: str | Target) -> Target:
    """Look a target up by canonical name or alias; ValueError lists what exists."""
    if isinstance(name, Target):
        return name
    if not isinstance(name, str):
        raise TypeError(f"target must be a str or codegen.targets.Target, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in TARGETS:
        known = ", ".join(list(TARGETS) + sorted(ALIASES))
        raise ValueError(f"unknown target {name!r}; known targets and aliases: {known}")
    return TARGETS[key]


_by_device: dict = {}


def for_device(device) -> Target:
    """The target whose kernels run on this torch device (cached per device)."""
    hit = _by_device.get(device)
    if hit is not None:
        return hit
    t = _for_device(device)
    _by_device[device] = t
    return t


def _for_device(device) -> Target:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        from backends.cuda.device import arch_of_device

        return TARGETS[f"cuda:{arch_of_device(device)}"]
    if device.type == "npu":
        return TARGETS["ascend:950"]
    if device.type == "cpu":
        return TARGETS["cpu"]
    raise ValueError(f"no Tilecraft target for device type '{device.type}'; supported: cuda, npu, cpu")


def resolve(*tensors, target: str | Target | None = None) -> Target:
    """Pick the target for a call on these tensors, and check that it can run there."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop() if devices else None
    chosen = target if target is not None else (env.get("TILECRAFT_TARGET") or None)
    if chosen is None:
        if device is None:
            raise ValueError("no tensors and no target given: cannot tell where to run")
        return for_device(device)
    t = get(chosen)
    if device is not None and device.type != t.device_type:
        source = "target=" if target is not None else "TILECRAFT_TARGET="
        raise ValueError(f"{source}{t.name} runs on '{t.device_type}' devices, but the tensors are on '{device}'")
    if device is not None and t.vendor == "cuda":
        found = for_device(device)
        if found != t:
            raise ValueError(f"target {t.name} was asked for, but the tensors are on a {found.arch} GPU ({device})")
    return t


# The target a tile program is being traced for; read by codegen.tile's words.
_CURRENT: contextvars.ContextVar[Target | None] = contextvars.ContextVar("tilecraft_target", default=None)


def current() -> Target:
    t = _CURRENT.get()
    if t is None:
        raise RuntimeError("no target is active: tile words are only valid while a tile program is traced "
                           "(TileProgram.trace / compile set it)")
    return t


@contextlib.contextmanager
def using(target: str | Target):
    token = _CURRENT.set(get(target))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
