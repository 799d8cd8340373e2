"""Argument checks shared by the public ops: every failure names the argument, what came in and
what was expected (ValueError for values/shapes, TypeError for types)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8"}


def dtype_name(d: torch.dtype) -> str:
    return _SHORT.get(d, str(d).replace("torch.", ""))


def tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | tuple[int, ...] | None = None,
           contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {' or '.join(dtype_name(d) for d in dtypes)}, got {dtype_name(t.dtype)}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides {t.stride()}")
    return t


def aligned(name: str, t: torch.Tensor, nbytes: int, why: str) -> torch.Tensor:
    """t must start nbytes-aligned (a view at an odd storage offset may not)."""
    if t.data_ptr() % nbytes:
        raise ValueError(f"{name} must start {nbytes}-byte aligned ({why}), got an address {t.data_ptr() % nbytes} "
                         f"bytes past it (a view at storage offset {t.storage_offset()}); pass a copy")
    return t


def aligned_copy(t: torch.Tensor, nbytes: int = 16) -> torch.Tensor:
    """t where it starts nbytes-aligned, else a copy of it (a fresh allocation is): for small inputs a
    kernel reads in 16-byte pieces, where a view at an odd storage offset is cheaper copied than refused."""
    return t if t.data_ptr() % nbytes == 0 else t.clone()


def same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError("tensors must be on one device, got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return next(iter(devices.values()))


def shape(name: str, t: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def offending(t: torch.Tensor, bad: torch.Tensor) -> str:
    """', got <value> at index <i> (<n> such)': the first entry of t where the bool tensor bad holds, for a range
    error's message."""
    idx = bad.flatten().nonzero()
    if not idx.numel():
        return ""
    first = int(idx[0])
    where = tuple(int(x) for x in torch.unravel_index(torch.tensor(first), t.shape)) if t.dim() != 1 else first
    return f", got {t.flatten()[first].item()} at index {where} ({idx.numel()} such)"


def some_groups(name: str, groups: int, rows: int) -> None:
    """A contiguous grouped GEMM with rows to compute needs at least one group: its kernels clamp a row's group
    index into [0, groups), and there is none to clamp into."""
    if rows and not groups:
        raise ValueError(f"{name} must have at least one group (its first dimension) when a has rows, got 0 groups "
                         f"for {rows} rows")


def number(name: str, v, *, lo=None, hi=None, integer=False):
    """v must be an int (integer=True) or a finite number (NaN and infinities pass no range check), within
    [lo, hi] where those are given."""
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(v).__name__}")
    if not integer and not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}, got {v}")
    return v


def flag(name: str, v) -> bool:
    """v must be a bool (a string such as 'no' is not taken as True)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
    return v
