"""Find CANN's bisheng compiler and an NPU; say exactly what is missing."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from backends import ToolchainError
from tilecraft import env

CANN_VERSION = "9.2"


def _candidates() -> list[Path]:
    forced = env.get("TILECRAFT_BISHENG")
    if forced:
        return [Path(forced)]
    out = []
    for var, sub in (("BISHENG_HOME", "bin"), ("ASCEND_HOME_PATH", "compiler/ccec_compiler/bin")):
        base = os.environ.get(var)
        if base:
            out.append(Path(base) / sub / "bisheng")
    which = shutil.which("bisheng")
    if which:
        out.append(Path(which))
    return out


def find_bisheng() -> Path:
    for p in _candidates():
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise ToolchainError(
        f"compiling for ascend:950 needs `bisheng` from CANN {CANN_VERSION}, which was not found "
        "(looked at TILECRAFT_BISHENG, BISHENG_HOME/bin, ASCEND_HOME_PATH and PATH). Ascend C source "
        "needs no compiler: `python -m codegen.show OP --target ascend` prints it."
    )


@functools.lru_cache(maxsize=None)
def bisheng_version() -> str | None:
    try:
        path = find_bisheng()
    except ToolchainError:
        return None
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
    return out.strip().split("\n")[0] or "bisheng (unknown version)"


def require_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError as e:
        raise ToolchainError("launching on Ascend needs torch_npu, which is not installed") from e
    import torch

    if not torch.npu.is_available():
        raise ToolchainError("torch_npu is installed but no Ascend NPU is visible")
