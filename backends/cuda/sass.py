"""Build a cubin from generated CUDA source and summarize its SASS, with no GPU needed."""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from backends import ToolchainError
from backends.cuda.toolchain import find_tool, find_toolchain

# Instruction families worth counting in a kernel's SASS, by opcode prefix (before the first '.').
TRACKED = {
    "HGMMA": "Hopper warpgroup MMA, fp16/bf16 (wgmma)",
    "QGMMA": "Hopper warpgroup MMA, fp8 (wgmma)",
    "IGMMA": "Hopper warpgroup MMA, int8",
    "HMMA": "warp-level MMA (mma.sync), pre-Hopper path",
    "UTCHMMA": "Blackwell tcgen05 MMA, fp16/bf16",
    "UTCQMMA": "Blackwell tcgen05 MMA, fp8/fp4 block-scaled",
    "UTCOMMA": "Blackwell tcgen05 MMA, other kinds",
    "UTMALDG": "TMA tensor load global->shared",
    "UTMASTG": "TMA tensor store shared->global",
    "UBLKCP": "bulk copy",
    "LDGSTS": "async copy global->shared (cp.async)",
    "LDG": "global load",
    "STG": "global store",
    "LDS": "shared load",
    "STS": "shared store",
    "LDSM": "shared load matrix (ldmatrix)",
    "LDL": "local-memory load (spill or indexed array)",
    "STL": "local-memory store (spill or indexed array)",
    "SHFL": "warp shuffle",
    "BAR": "barrier",
}


@dataclass
class SassStats:
    arch: str
    histogram: dict[str, int] = field(default_factory=dict)
    registers: int | None = None
    shared_bytes: int | None = None
    stack_bytes: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None

    def format(self) -> str:
        lines = [f"SASS summary ({self.arch})"]
        lines.append(f"  registers/thread: {self.registers}   static shared: {self.shared_bytes} B   "
                     f"stack: {self.stack_bytes} B   spills (st/ld): {self.spill_stores}/{self.spill_loads}")
        lines.append("  instruction histogram:")
        width = max((len(k) for k in TRACKED), default=8)
        for op in TRACKED:
            n = self.histogram.get(op, 0)
            if n:
                lines.append(f"    {op:<{width}} {n:6d}  {TRACKED[op]}")
        if not any(self.histogram.get(op) for op in TRACKED):
            lines.append("    (none of the tracked instructions)")
        return "\n".join(lines)


def _gencode(arch: str) -> list[str]:
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    num, suffix = m.groups()
    return ["-gencode", f"arch=compute_{num}{suffix},code=sm_{num}{suffix}"]


def compile_cubin(source: str, arch: str, flags: list[str] | None = None) -> tuple[bytes, str]:
    """Compile CUDA source (as TileLang emits it) to a cubin for `arch` with our nvcc; returns the cubin and what
    nvcc printed, ptxas's verbose log included (registers, spills, its performance warnings: wgmma_serialized)."""
    from tilelang import env as tl_env  # template and CUTLASS include dirs ship with TileLang

    tc = find_toolchain()
    with tempfile.TemporaryDirectory(prefix="tilecraft-cubin-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(source)
        cmd = [str(tc.nvcc), "--cubin", "-O3", "-lineinfo", "-std=c++20", *_gencode(arch),
               f"-I{tl_env.TILELANG_TEMPLATE_PATH}", f"-I{tl_env.CUTLASS_INCLUDE_DIR}",
               f"-I{tc.cuda_home / 'include'}", "-Xptxas", "-v", *(flags or []), "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolchainError(f"nvcc failed ({' '.join(cmd[:6])} ...):\n{proc.stdout}{proc.stderr}")
        return out.read_bytes(), proc.stdout + proc.stderr


def build_cubin(source: str, arch: str, flags: list[str] | None = None) -> bytes:
    """Compile CUDA source (as TileLang emits it) to a cubin for `arch` with our nvcc."""
    return compile_cubin(source, arch, flags)[0]


# "... in the function 'f'" (C7513-C7515: operands mid-pipeline) or "... for the function 'f'" (C7512: insufficient
# registers); C7507 ("'setmaxnreg' ignored to maintain minimum register requirements") names no function
_SERIALIZED = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: ([^\n]*?)(?: (?:in|for) the function '(\w+)'|\.?$)", re.MULTILINE)


def wgmma_serialized(ptxas_log: str) -> list[str]:
    """ptxas's performance warnings in a compile_cubin log, one "CODE in FUNCTION: text" each ("(C75xx) Potential
    Performance Loss: ..."): C7512 WGMMAs serialized for insufficient registers, C7513 input registers, C7514 and
    C7515 accumulator registers defined or read mid-pipeline; C7507 setmaxnreg ignored (the kernel keeps its launch
    registers in every warpgroup). Where ptxas cannot prove a WGMMA pipeline safe anywhere in a kernel it waits
    after every WGMMA of that kernel (WARPGROUP.DEPBAR after each HGMMA): session 51's FP8 MLA kernel lost 2-3x to
    one loop entered with MMAs in flight (bench/NOTES.md "Session 52"). Before session 53 the pattern wanted "in
    the function" and missed C7512's "for the function" (bench/NOTES.md "Session 53")."""
    return [f"{code} in {fn}: {text}" if fn else f"{code}: {text}" for code, text, fn in _SERIALIZED.findall(ptxas_log)]


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    tool = find_tool(name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([str(tool), *args, f.name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolchainError(f"{name} failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def disassemble(cubin: bytes) -> str:
    return _run_tool("cuobjdump", ["--dump-sass"], cubin)


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?")


def histogram(sass: str) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for m in _OPCODE.finditer(sass):
        counts[m.group(1)] += 1
    return dict(counts)


def sass_stats(cubin: bytes, arch: str) -> SassStats:
    hist = histogram(disassemble(cubin))
    stats = SassStats(arch=arch, histogram=hist)
    usage = _run_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    for key, attr in (("REG", "registers"), ("SHARED", "shared_bytes"), ("STACK", "stack_bytes")):
        m = re.search(rf"\b{key}:(\d+)", usage)
        if m:
            setattr(stats, attr, int(m.group(1)))
    # spills are not in cuobjdump's resource dump; count the local-memory instructions instead
    stats.spill_stores = hist.get("STL", 0)
    stats.spill_loads = hist.get("LDL", 0)
    return stats
