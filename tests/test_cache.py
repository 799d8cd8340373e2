"""JIT cache: memory hits, disk hits, keys, corruption, and two processes at once."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from codegen import cache, jit
from ops.rms_norm import rmsnorm_program

REPO = Path(__file__).resolve().parents[1]


def entries(root: Path):
    return sorted(p for p in (root / "v1").glob("??/*") if p.is_dir())


def test_miss_then_memory_hit(fresh_cache):
    k1 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert jit.STATS["compile"] == 1
    k2 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert k2 is k1 and jit.STATS["memory_hit"] == 1 and jit.STATS["compile"] == 1
    assert len(entries(fresh_cache)) == 1


def test_disk_hit_after_memory_is_cleared(fresh_cache):
    k1 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    jit.clear_memory()
    k2 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert jit.STATS["disk_hit"] == 1 and jit.STATS["compile"] == 1
    assert k2.key == k1.key and k2.entry == k1.entry
    x, w = torch.randn(3, 64), torch.randn(64)
    y = torch.empty_like(x)
    k2(x, w, y)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_one_kernel_serves_every_row_count(fresh_cache):
    k = rmsnorm_program.compile("cpu", hidden=32, dtype="float32")
    for rows in (1, 5, 130):
        x, w = torch.randn(rows, 32), torch.randn(32)
        y = torch.empty_like(x)
        k(x, w, y)
        torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    assert jit.STATS["compile"] == 1


def test_generated_source_is_kept_on_disk(fresh_cache, monkeypatch):
    """source() keeps its text under the compile key plus "artifact": "source": the same program and
    parameters hit (in another process too: the cache is on disk), other parameters or a changed rule
    (another traced IR) miss; a kernel over the target's shared memory is refused and never kept."""
    from codegen import rules
    from ops.gemm_fp8 import fp8_gemm_program

    src = rmsnorm_program.source("sm_90a", hidden=1024, dtype="bfloat16")
    assert jit.STATS["source_hit"] == 0 and len(entries(fresh_cache)) == 1
    assert rmsnorm_program.source("sm_90a", hidden=1024, dtype="bfloat16") == src and jit.STATS["source_hit"] == 1
    rmsnorm_program.source("sm_90a", hidden=2048, dtype="bfloat16")
    assert jit.STATS["source_hit"] == 1 and len(entries(fresh_cache)) == 2
    from codegen.lowering import cuda

    with rules.override("grid", "cuda:sm_90a", lambda blocks, threads=128: cuda.grid(blocks, threads * 2)):
        assert rmsnorm_program.source("sm_90a", hidden=1024, dtype="bfloat16") != src
    assert jit.STATS["source_hit"] == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="needs \\d+ bytes of shared memory"):
            fp8_gemm_program.source("sm_90a", n=4096, k=7168, block_m=128, block_n=128, stages=8)
    assert len(entries(fresh_cache)) == 3
    monkeypatch.setenv("TILECRAFT_DISABLE_DISK_CACHE", "1")
    assert rmsnorm_program.source("sm_90a", hidden=4096, dtype="bfloat16") and len(entries(fresh_cache)) == 3


def test_key_covers_parameters_target_and_versions(fresh_cache, monkeypatch):
    base = rmsnorm_program.compile("cpu", hidden=64, dtype="float32").key
    assert rmsnorm_program.compile("cpu", hidden=64, dtype="float32", eps=1e-5).key != base
    assert rmsnorm_program.compile("cpu", hidden=128, dtype="float32").key != base
    assert rmsnorm_program.compile("cpu", hidden=64, dtype="float16").key != base
    prim = rmsnorm_program.trace("cpu", hidden=64, dtype="float32")
    from codegen import targets

    inputs = jit.key_inputs(rmsnorm_program, prim, targets.get("cpu"), {})
    assert cache.digest(inputs) == base
    for field, value in (("tilelang", "0.0.0"), ("tilecraft", "9.9"), ("toolchain", "nvcc 13.9.1"),
                         ("target", "cuda:sm_100a"), ("pass_configs", {"tl.disable_tma_lower": "True"})):
        assert cache.digest({**inputs, field: value}) != base, field


def test_key_covers_imported_helper_source(monkeypatch):
    """A program's CUDA helpers (T.import_source) are part of the key: with a changed helper the
    kernel is rebuilt, not served from the cache (the plain IR script only references them)."""
    from codegen import targets
    from ops import gemm_mxfp4

    t = targets.get("cuda:sm_90a")
    params = dict(n=256, k=512, tokens=8)

    def ir_hash():
        prim = gemm_mxfp4.mxfp4_swapped_program.trace(t, **params)
        return jit.key_inputs(gemm_mxfp4.mxfp4_swapped_program, prim, t, {})["ir_sha256"]

    base = ir_hash()
    assert ir_hash() == base
    monkeypatch.setattr(gemm_mxfp4, "E2M1_FRAGMENT_SOURCE", gemm_mxfp4.E2M1_FRAGMENT_SOURCE + "\n// changed\n")
    assert ir_hash() != base


def test_globals_read_while_tracing_are_in_the_in_memory_keys(monkeypatch):
    """Module globals a program reads while it is traced, never passed as parameters (ops.gemm_fp8.SFA_RING_SLOTS,
    ops.gemm_mxfp4.E2M1_FRAGMENT_SOURCE), are declared switches (codegen.rules.options): setting one changes
    rules.state(), which keys both the compile cache in memory and the ops' launcher sets (jit.launchers)."""
    from codegen import rules
    from ops import gemm_fp8, gemm_mxfp4

    base = rules.state()
    monkeypatch.setattr(gemm_fp8, "SFA_RING_SLOTS", 4)
    assert rules.state() != base
    monkeypatch.setattr(gemm_fp8, "SFA_RING_SLOTS", 3)
    assert rules.state() == base
    monkeypatch.setattr(gemm_mxfp4, "E2M1_FRAGMENT_SOURCE", "#define TC_E2M1_NO_DECODE 1\n" +
                        gemm_mxfp4.E2M1_FRAGMENT_SOURCE)
    assert rules.state() != base
    built = []
    key = ("test_globals_read_while_tracing", 1)
    for _ in range(2):
        jit.launchers(key, lambda: built.append(1) or "launchers")
    assert built == [1]                                 # the same state: built once
    monkeypatch.undo()
    jit.launchers(key, lambda: built.append(1) or "launchers")
    assert built == [1, 1]                              # the switch flipped back: another entry


def test_corrupt_entry_is_detected_and_rebuilt(fresh_cache, caplog):
    k = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    lib = k.entry / "kernel.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])  # a truncated write
    jit.clear_memory()
    with caplog.at_level("WARNING"):
        k2 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert "corrupt" in caplog.text and "kernel.so" in caplog.text
    assert jit.STATS["corrupt_rebuild"] == 1 and jit.STATS["compile"] == 2
    assert cache.verify(k2.entry, k2.key) is None
    x, w = torch.randn(2, 64), torch.randn(64)
    y = torch.empty_like(x)
    k2(x, w, y)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("damage", ["delete_manifest", "garbage_manifest", "flip_byte"])
def test_other_damage_is_also_rebuilt(fresh_cache, damage):
    k = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    if damage == "delete_manifest":
        (k.entry / "manifest.json").unlink()
    elif damage == "garbage_manifest":
        (k.entry / "manifest.json").write_text("{not json")
    else:
        data = bytearray((k.entry / "device.src").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (k.entry / "device.src").write_bytes(bytes(data))
    jit.clear_memory()
    k2 = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert jit.STATS["compile"] == 2 and cache.verify(k2.entry, k2.key) is None


def test_manifest_records_key_inputs(fresh_cache):
    k = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    manifest = json.loads((k.entry / "manifest.json").read_text())
    assert manifest["key"] == k.key
    assert manifest["inputs"]["target"] == "cpu" and manifest["inputs"]["program"] == "rmsnorm"
    assert set(manifest["files"]) == set(cache.FILES)


def test_disabled_disk_cache_writes_nothing(fresh_cache, monkeypatch):
    monkeypatch.setenv("TILECRAFT_DISABLE_DISK_CACHE", "1")
    k = rmsnorm_program.compile("cpu", hidden=64, dtype="float32")
    assert k.entry is None and not entries(fresh_cache)


def test_two_processes_compiling_the_same_kernel_both_succeed(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        from ops.rms_norm import rmsnorm_program
        from codegen import jit
        k = rmsnorm_program.compile("cpu", hidden=96, dtype="float32")
        x, w = torch.randn(3, 96), torch.randn(96)
        y = torch.empty_like(x)
        k(x, w, y)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        assert torch.allclose(y, ref, atol=1e-5), (y - ref).abs().max()
        print(dict(jit.STATS))
    """ % str(REPO))
    env = {**os.environ, "TILECRAFT_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    found = entries(tmp_path / "cache")
    assert len(found) == 1 and cache.verify(found[0], found[0].name) is None
    assert not any((tmp_path / "cache" / "v1" / ".staging").glob("*"))


def test_launcher_sets_are_built_once_per_key_and_rule_generation():
    # an op's hot path (jit.launchers): one build per key, rebuilt when a lowering rule changes
    from codegen import rules

    built = []

    def build():
        built.append(1)
        return len(built)

    key = ("test-launchers", object())
    assert jit.launchers(key, build) == 1 and jit.launchers(key, build) == 1
    rules.register("test_launchers_word", "cpu", lambda: None)
    try:
        assert jit.launchers(key, build) == 2
    finally:
        rules.unregister("test_launchers_word", "cpu")
    assert jit.launchers(key, build) == 3 and len(built) == 3


def test_rule_switches_are_part_of_the_kernel_caches_key(monkeypatch):
    # a declared switch of a rule module (codegen.rules.options), flipped at run time, is a new key for the
    # launcher sets and the in-memory compile cache: kernels traced under the old value are not reused
    from codegen import rules
    from codegen.lowering import sm90

    built = []
    key = ("test-switches", object())
    assert jit.launchers(key, lambda: built.append(1) or len(built)) == 1
    before = rules.state()
    monkeypatch.setattr(sm90, "CLAMP_LAST_ONLY", not sm90.CLAMP_LAST_ONLY)
    assert rules.state() != before and rules.generation() == before[0]
    assert jit.launchers(key, lambda: built.append(1) or len(built)) == 2
    monkeypatch.undo()
    assert rules.state() == before
    with pytest.raises(ValueError, match="no switch 'NOT_A_SWITCH'"):
        rules.options(sm90.__name__, "NOT_A_SWITCH")
