"""Find nvcc (and cuobjdump / nvdisasm) and check that it is CUDA 13.

Search order for nvcc: $TILECRAFT_NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, then the
`nvidia-cuda-nvcc` wheel (site-packages/nvidia/cu13), so a machine with no CUDA toolkit can
still build and inspect kernels after `pip install tilecraft[cuda]`.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from backends import ToolchainError
from tilecraft import env

REQUIRED_MAJOR = 13


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    cuda_home: Path
    version: str  # "13.0.88"

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def _wheel_roots() -> list[Path]:
    roots = []
    for key in ("purelib", "platlib"):
        base = Path(sysconfig.get_paths()[key]) / "nvidia"
        for sub in ("cu13", "cuda_nvcc"):
            if (base / sub).is_dir() and base / sub not in roots:
                roots.append(base / sub)
    return roots


def _resolve_real(path: Path) -> Path:
    """A shell wrapper such as /usr/local/bin/nvcc -> the real binary it execs, when it says so."""
    try:
        if path.stat().st_size < 4096:
            text = path.read_text(errors="replace")
            m = re.search(r"exec\s+(\S*nvcc)\b", text)
            if m and Path(m.group(1)).is_file():
                return Path(m.group(1)).resolve()
    except OSError:
        pass
    return path.resolve()


def _nvcc_candidates() -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    forced = env.get("TILECRAFT_NVCC")
    if forced:
        return [("TILECRAFT_NVCC", Path(forced))]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            out.append((var, Path(home) / "bin" / "nvcc"))
    which = shutil.which("nvcc")
    if which:
        out.append(("PATH", _resolve_real(Path(which))))
    for root in _wheel_roots():
        out.append(("nvidia-cuda-nvcc wheel", root / "bin" / "nvcc"))
    return out


def _version_of(nvcc: Path) -> str:
    try:
        text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"could not run {nvcc} --version: {e}") from e
    m = re.search(r"V(\d+\.\d+\.\d+)", text)
    if not m:
        raise ToolchainError(f"could not read a version from `{nvcc} --version`: {text.strip()[:200]!r}")
    return m.group(1)


@functools.lru_cache(maxsize=None)
def find_toolchain() -> Toolchain:
    """The nvcc Tilecraft compiles with; ToolchainError names every place it looked."""
    tried = []
    for where, nvcc in _nvcc_candidates():
        if not nvcc.is_file():
            tried.append(f"{where}: {nvcc} (missing)")
            continue
        version = _version_of(nvcc)
        if int(version.split(".")[0]) != REQUIRED_MAJOR:
            tried.append(f"{where}: {nvcc} is CUDA {version}, Tilecraft needs {REQUIRED_MAJOR}.x")
            continue
        return Toolchain(nvcc=nvcc, cuda_home=nvcc.parent.parent, version=version)
    looked = "; ".join(tried) if tried else "TILECRAFT_NVCC, CUDA_HOME, CUDA_PATH, PATH and the nvidia-cuda-nvcc wheel are all empty"
    raise ToolchainError(
        f"no CUDA {REQUIRED_MAJOR}.x nvcc found ({looked}). Install the CUDA 13 toolkit, or "
        "`pip install 'tilecraft[cuda]'` for the nvcc wheel, or point TILECRAFT_NVCC at nvcc."
    )


def find_tool(name: str) -> Path:
    """cuobjdump / nvdisasm: next to nvcc, on PATH, or from their pip wheels."""
    places = []
    try:
        places.append(find_toolchain().cuda_home / "bin" / name)
    except ToolchainError:
        pass
    which = shutil.which(name)
    if which:
        places.append(Path(which))
    places += [root / "bin" / name for root in _wheel_roots()]
    for p in places:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise ToolchainError(
        f"`{name}` not found (looked next to nvcc, on PATH and in the nvidia-cuda-{name} wheel); "
        f"`pip install 'tilecraft[cuda]'` installs it"
    )


def prepare_tilelang_env() -> Toolchain | None:
    """Point TileLang at our nvcc (it reads CUDA_HOME when first imported). None when absent."""
    try:
        tc = find_toolchain()
    except ToolchainError:
        return None
    os.environ.setdefault("CUDA_HOME", str(tc.cuda_home))
    return tc
