"""Compile tile programs once per (program, parameters, target, flags) and keep the result.

An in-memory dict sits in front of the disk cache (codegen.cache). The disk key hashes the traced
IR itself (so any change to a program or to a lowering rule changes it), the target, pass configs,
the toolchain's version (nvcc / bisheng / the C compiler), TileLang's and Tilecraft's versions.
Dynamic dimensions are symbolic in the IR, so one kernel serves every batch size.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegen import cache, rules, targets
from tilecraft import __version__, env

log = logging.getLogger("tilecraft.jit")
_memory: dict[tuple, "Kernel"] = {}
_lock = threading.Lock()
_key_locks: dict[tuple, threading.Lock] = {}
STATS: Counter = Counter()  # memory_hit, disk_hit, compile, corrupt_rebuild


def _tilelang():
    """Import TileLang with our toolchain in place and its own caches off (ours replace them)."""
    import tilelang

    if not getattr(_tilelang, "done", False):
        tilelang.disable_cache()
        level = logging.INFO if env.flag("TILECRAFT_VERBOSE") else logging.WARNING
        for name in ("TileLang", "tilelang"):
            logging.getLogger(name).setLevel(level)
        _tilelang.done = True
    return tilelang


def _execution_backend(t: targets.Target) -> str:
    return {"cuda": "tvm_ffi", "cpu": "cython", "ascend": "tvm_ffi"}[t.vendor]


def toolchain_version(t: targets.Target) -> str:
    if t.vendor == "cuda":
        from backends.cuda.toolchain import find_toolchain

        return f"nvcc {find_toolchain().version}"
    if t.vendor == "ascend":
        from backends.ascend.toolchain import bisheng_version

        return bisheng_version() or "bisheng absent"
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except OSError:
        return "cc unknown"


def _freeze(v: Any):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


@dataclass
class Kernel:
    """A compiled tile program, callable on tensors in the program's argument order."""

    program: str
    target: targets.Target
    params: dict
    key: str
    compiled: Any                       # TileLang JITKernel
    source: str                         # device source (CUDA C++ / C)
    entry: Path | None = None           # its disk-cache directory, if any
    _bf16_as_u16: tuple = field(default=())

    def __post_init__(self):
        # On the cpu target bf16 tensors travel as uint16 (see codegen/lowering/cpu.py).
        if self.target.vendor == "cpu":
            self._bf16_as_u16 = tuple(i for i, p in enumerate(self.compiled.params) if str(p.dtype) == "uint16")

    def launcher(self):
        """The cheapest callable that runs the kernel on tensors already on the right device."""
        if self.target.vendor == "cuda" and not self._bf16_as_u16:
            return self.compiled.adapter._get_executable()
        return self

    def __call__(self, *args):
        if self._bf16_as_u16:
            import torch

            args = list(args)
            for i in self._bf16_as_u16:
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].dtype == torch.bfloat16:
                    args[i] = args[i].view(torch.uint16)
        return self.compiled(*args)


def _write_entry(tl_kernel, prim, backend: str):
    def write(d: Path):
        from tilelang.engine.param import dump_kernel_params

        if backend == "tvm_ffi":
            tl_kernel.export_library(str(d / "kernel.so"))
        else:
            shutil.copyfile(tl_kernel.adapter.libpath, d / "kernel.so")
        (d / "device.src").write_text(tl_kernel.get_kernel_source() or "")
        (d / "host.src").write_text(tl_kernel.adapter.get_host_source() or "")
        (d / "params.json").write_text(dump_kernel_params(tl_kernel.params))
        (d / "program.tir").write_text(prim.script())

    return write


def _load_entry(entry: cache.Entry, prim, t: targets.Target, pass_configs: dict):
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit.adapter.base import CachedTextSource
    from tilelang.jit.kernel import JITKernel

    return JITKernel.from_database(
        func=prim,
        host_kernel_source=CachedTextSource(path=str(entry.file("host.src"))),
        device_kernel_source=CachedTextSource(path=str(entry.file("device.src"))),
        kernel_lib_path=str(entry.file("kernel.so")),
        params=load_kernel_params(entry.file("params.json").read_text()),
        target=t.tvm(),
        target_host=None,
        out_idx=None,
        execution_backend=_execution_backend(t),
        pass_configs=pass_configs or None,
        compile_flags=None,
    )


def key_inputs(program, prim, t: targets.Target, pass_configs: dict) -> dict:
    import tilelang

    # with its metadata: an imported CUDA helper's text (T.import_source) and annotated layouts are
    # only references in the plain script, so a changed helper would hit the old kernel
    ir = prim.script(show_meta=True)
    return {
        "program": program.name,
        "ir_sha256": cache.hashlib.sha256(ir.encode()).hexdigest(),
        "target": t.name,
        "tvm_target": str(t.tvm()),
        "pass_configs": {str(k): str(v) for k, v in sorted(pass_configs.items(), key=lambda kv: str(kv[0]))},
        "toolchain": toolchain_version(t),
        "tilelang": tilelang.__version__,
        "tilecraft": __version__,
        "python": sys.version.split()[0],
    }


_fast: dict[tuple, Kernel] = {}


_launch_sets: dict = {}


def launchers(key, build):
    """build() once per key and rules.state() (rule changes, rule switches): an op's hot path keeps the
    kernel launchers it needs under a plain tuple key, so an eager call pays one dict lookup instead of a
    compile-cache lookup per kernel (keyword binding, a sorted key; bench/NOTES.md "eager host cost").
    The key must name everything build() depends on (target, kernel parameters)."""
    full = (key, rules.state())             # (a switch flipped back and forth by a bench provider: two entries)
    hit = _launch_sets.get(full)
    if hit is None:
        if len(_launch_sets) >= 4096:       # keys that vary call to call (a GEMM's m)
            _launch_sets.clear()
        hit = _launch_sets[full] = build()
    return hit


def compile(program, target, **params) -> Kernel:
    """The compiled kernel for `program` on `target` with these parameters (cached)."""
    fkey = (program.name, target, tuple(sorted(params.items())), rules.state())
    hit = _fast.get(fkey)
    if hit is not None:  # the per-call path: no signature binding, no tracing
        STATS["memory_hit"] += 1
        return hit
    kernel = _compile_bound(program, target, params)
    _fast[fkey] = kernel
    return kernel


def _compile_bound(program, target, params: dict) -> Kernel:
    t = program.check_target(target)
    bound = program.bind(params)
    mkey = (program.name, t.name, _freeze(bound), rules.state())
    hit = _memory.get(mkey)
    if hit is not None:
        STATS["memory_hit"] += 1
        return hit
    with _lock:
        key_lock = _key_locks.setdefault(mkey, threading.Lock())
    with key_lock:  # one compile per key inside a process; other threads wait for it
        hit = _memory.get(mkey)
        if hit is not None:
            STATS["memory_hit"] += 1
            return hit
        kernel = _compile_uncached(program, t, bound)
        _memory[mkey] = kernel
        return kernel


def _compile_uncached(program, t: targets.Target, bound: dict) -> Kernel:
    tilelang = _tilelang()
    if t.vendor == "ascend":
        from backends.ascend.toolchain import find_bisheng

        find_bisheng()  # a clear ToolchainError naming bisheng when CANN is absent
    prim, rule_configs = program.traced(t, bound)
    pass_configs = program.configs(t, bound, rule_configs)
    inputs = key_inputs(program, prim, t, pass_configs)
    key = cache.digest(inputs)
    use_disk = not env.flag("TILECRAFT_DISABLE_DISK_CACHE")
    if use_disk:
        entry = cache.lookup(key, on_corrupt=lambda problem: STATS.update(["corrupt_rebuild"]))
        if entry is not None:
            try:
                tlk = _load_entry(entry, prim, t, pass_configs)
                STATS["disk_hit"] += 1
                log.info("tilecraft: %s on %s loaded from %s", program.name, t.name, entry.path)
                return Kernel(program.name, t, bound, key, tlk, tlk.get_kernel_source() or "", entry.path)
            except Exception as e:  # a library that fails to load is as bad as a corrupt one
                log.warning("tilecraft: cache entry %s failed to load (%s); rebuilding", entry.path, e)
                STATS["corrupt_rebuild"] += 1
                cache._discard(entry.path)
    t0 = time.perf_counter()
    backend = _execution_backend(t)
    tlk = tilelang.compile(prim, target=t.tvm(), execution_backend=backend, pass_configs=pass_configs or None)
    artifact = getattr(tlk, "artifact", None)
    if artifact is not None and getattr(artifact, "device_mod", None) is not None:
        check_shared_memory(program, t, bound, artifact.device_mod)
    STATS["compile"] += 1
    log.info("tilecraft: compiled %s on %s in %.1f s", program.name, t.name, time.perf_counter() - t0)
    path = None
    if use_disk:
        path = cache.publish(key, inputs, _write_entry(tlk, prim, backend)).path
    return Kernel(program.name, t, bound, key, tlk, tlk.get_kernel_source() or "", path)


def lower_source(program, target, **params) -> str:
    """Generated device source for the target, with no compiler or device needed. Kept in the disk
    cache under the compile key's inputs plus an "artifact" tag (TileLang's lowering of an
    overlapped GEMM loop takes ~15-30 s; the key holds the traced IR, so a changed rule misses)."""
    tilelang = _tilelang()
    t = program.check_target(target)
    bound = program.bind(params)
    prim, rule_configs = program.traced(t, bound)
    configs = program.configs(t, bound, rule_configs)
    use_disk = not env.flag("TILECRAFT_DISABLE_DISK_CACHE")
    if use_disk:
        inputs = {**key_inputs(program, prim, t, configs), "artifact": "source-smem2"}
        key = cache.digest(inputs)
        entry = cache.lookup(key, on_corrupt=lambda problem: STATS.update(["corrupt_rebuild"]))
        if entry is not None:
            STATS["source_hit"] += 1
            _check_smem_bytes(program, t, bound, json.loads(entry.file("params.json").read_text())["smem_bytes"])
            return entry.file("device.src").read_text()
    with t.tvm() as tv:
        from tilelang.transform import PassConfigKey  # noqa: F401  (registers pass-config keys)
        import tvm

        with tvm.transform.PassContext(config=configs):
            art = tilelang.lower(prim, target=tv)
    smem = block_shared_memory(art.device_mod)
    _check_smem_bytes(program, t, bound, smem)
    source = art.kernel_source
    if use_disk:
        def write(d: Path):
            (d / "device.src").write_text(source)
            (d / "params.json").write_text(json.dumps({"smem_bytes": smem}))
            (d / "program.tir").write_text(prim.script())
        cache.publish(key, inputs, write)
    return source


_DYN_SMEM = re.compile(r'alloc_buffer\(\((\d+),\), "uint8", scope="shared\.dyn"\)')
_STATIC_SMEM = re.compile(r'alloc_buffer\(\((\d+),\), "(u?int|float)(\d+)", scope="shared\.barrier"\)')
DYN_SMEM_ALIGN = 1024       # TileLang 0.1.15 declares the dynamic buffer __align__(1024)


def block_shared_memory(device_mod) -> int:
    """Bytes of shared memory a block of the lowered kernel needs: the dynamic buffer (TileLang merges
    a kernel's shared tiles into one `shared.dyn` buffer) plus the static one (the mbarriers), which
    the 1 KB-aligned dynamic buffer starts after: any static byte costs 1 KB of the 227 (the swapped
    FP8 MLA kernel at 231,808 dynamic bytes failed its launch; bench/NOTES.md "Session 34")."""
    script = device_mod.script()
    dynamic = sum(int(n) for n in _DYN_SMEM.findall(script))
    static = sum(-(-int(n) * int(bits) // 8 // 16) * 16 for n, _, bits in _STATIC_SMEM.findall(script))
    if static and dynamic:
        static = -(-static // DYN_SMEM_ALIGN) * DYN_SMEM_ALIGN
    return dynamic + static


def check_shared_memory(program, t: targets.Target, bound: dict, device_mod) -> None:
    """A kernel over the target's shared memory fails only at its first launch, with the driver's
    "Failed to set the allowed dynamic shared memory size" (bench/NOTES.md "MLA v12"): say so at
    build time instead, with the program and its parameters."""
    _check_smem_bytes(program, t, bound, block_shared_memory(device_mod))


def _check_smem_bytes(program, t: targets.Target, bound: dict, need: int) -> None:
    limit = rules.lookup("limits", t).fn().get("smem_bytes")
    if limit is not None and need > limit:
        raise ValueError(f"tile program {program.name!r} with {bound} needs {need} bytes of shared memory on "
                         f"{t.name}, which allows {limit} (tile.limits()['smem_bytes']); choose fewer stages or "
                         "smaller tiles")


def clear_memory() -> None:
    with _lock:
        _memory.clear()
        _fast.clear()
