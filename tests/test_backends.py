"""Toolchain discovery: found where expected, and clear errors where not."""

import stat

import pytest
import torch

from backends import ToolchainError
from backends.cuda import toolchain


@pytest.fixture(autouse=True)
def _fresh_discovery():
    toolchain.find_toolchain.cache_clear()
    yield
    toolchain.find_toolchain.cache_clear()


def fake_nvcc(tmp_path, version):
    p = tmp_path / "bin" / "nvcc"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {version}, V{version}.1'\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def test_forced_nvcc_is_used(tmp_path, monkeypatch):
    nvcc = fake_nvcc(tmp_path, "13.0")
    monkeypatch.setenv("TILECRAFT_NVCC", str(nvcc))
    tc = toolchain.find_toolchain()
    assert tc.nvcc == nvcc and tc.version == "13.0.1" and tc.cuda_home == tmp_path


def test_wrong_major_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TILECRAFT_NVCC", str(fake_nvcc(tmp_path, "12.4")))
    with pytest.raises(ToolchainError, match=r"is CUDA 12.4.1, Tilecraft needs 13.x"):
        toolchain.find_toolchain()


def test_missing_nvcc_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("TILECRAFT_NVCC", str(tmp_path / "nope" / "nvcc"))
    with pytest.raises(ToolchainError, match=r"TILECRAFT_NVCC: .*nope/nvcc \(missing\).*tilecraft\[cuda\]"):
        toolchain.find_toolchain()


def test_cuda_home_is_searched(tmp_path, monkeypatch):
    fake_nvcc(tmp_path, "13.0")
    monkeypatch.delenv("TILECRAFT_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert toolchain.find_toolchain().nvcc == tmp_path / "bin" / "nvcc"


def test_missing_bisheng_is_named(monkeypatch):
    from backends.ascend import toolchain as asc

    monkeypatch.setenv("TILECRAFT_BISHENG", "/nonexistent/bisheng")
    with pytest.raises(ToolchainError, match="needs `bisheng` from CANN 9.2"):
        asc.find_bisheng()


def test_no_gpu_is_a_clear_error():
    from backends.cuda.device import require_gpu

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ToolchainError, match="CUDA GPU is needed.*torch"):
        require_gpu()


def test_sass_histogram_parser():
    from backends.cuda.sass import histogram

    sass = """
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/               @!P0 LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0030*/                   UTMALDG.2D [UR8], [UR10] ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
    """
    assert histogram(sass) == {"HGMMA": 2, "LDG": 1, "UTMALDG": 1}


SETMAXNREG_PROBE = r"""
extern "C" __global__ void __launch_bounds__(384, 1) probe(const float* __restrict__ in, float* __restrict__ out,
                                                           int n) {
  if (threadIdx.x >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 256) out[0] = 1.f;
  } else {
    INC
    float v[200];
#pragma unroll
    for (int i = 0; i < 200; ++i) v[i] = in[threadIdx.x + i * 256];
    for (int it = 0; it < n; ++it) {
#pragma unroll
      for (int i = 0; i < 200; ++i) v[i] = v[i] * v[(i + 1) % 200] + 1.0f;
    }
#pragma unroll
    for (int i = 0; i < 200; ++i) out[threadIdx.x + i * 256] = v[i];
  }
}
"""


def test_ptxas_allocates_the_setmaxnreg_count_in_the_code_it_dominates():
    """The sm_90a rules launch 384 threads (168 registers a thread at launch) and raise the MMA
    warpgroups to 240 with setmaxnreg.inc (the producer gives its registers up with .dec). ptxas
    allocates up to the raised count in the code that instruction dominates: 200 live fp32 values a
    thread spill without it and fit with it, while the kernel still reports the launch's 168."""
    from backends.cuda.sass import build_cubin, sass_stats

    def spills(inc):
        s = sass_stats(build_cubin(SETMAXNREG_PROBE.replace("INC", inc), "sm_90a"), "sm_90a")
        return s.registers, s.spill_stores + s.spill_loads

    assert spills('asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\\n");') == (168, 0)
    registers, spilled = spills("")
    assert registers == 168 and spilled > 0


def _tma_copy_kernel():
    """A kernel that loads a 128-row box of a 256-column tensor by TMA (a 2-D descriptor) on sm_90a."""
    import tilelang.language as T

    from codegen import jit

    jit._tilelang()

    @T.prim_func
    def tma_copy(A: T.Tensor((256, 256), "float16"), B: T.Tensor((256, 128), "float16")):
        with T.Kernel(2, threads=128) as bx:
            s = T.alloc_shared((128, 128), "float16")
            full = T.alloc_barrier([1])
            if T.get_thread_binding() == 0:
                T.tma_copy(A[bx * 128:(bx + 1) * 128, 0:128], s, barrier=full[0])
                T.mbarrier_arrive(full[0])
            T.mbarrier_wait_parity(full[0], 0)
            T.copy(s, B[bx * 128, 0])

    return tma_copy


def _tma_copy_host_module():
    """The host module TileLang lowers for _tma_copy_kernel (no compiler run)."""
    import tilelang
    import tvm

    from codegen import targets

    with targets.get("cuda:sm_90a").tvm() as tv:
        with tvm.transform.PassContext():
            return tilelang.lower(_tma_copy_kernel(), target=tv).host_mod


def _promotions(host_mod) -> list[int]:
    # the tiled descriptor create calls' L2 promotion argument (second to last)
    import re

    calls = re.findall(r'call_packed\("__tvm_tensormap_create_tiled", ([^)]*)\)', host_mod.script())
    return [int(c.split(",")[-2]) for c in calls]


def test_tma_descriptors_take_the_configured_l2_promotion(monkeypatch):
    """backends.cuda.tma: TileLang builds its TMA descriptors with 128-byte L2 promotion; promote() sets
    L2_PROMOTION's on every tiled descriptor of a copy of the host module; install() applies it where
    TileLang generates host code; the compile key and the in-memory caches' state carry the value."""
    import importlib

    from backends.cuda import tma
    from codegen import jit, rules, targets

    tl_lower = importlib.import_module("tilelang.engine.lower")
    host = _tma_copy_host_module()
    assert _promotions(host) and set(_promotions(host)) == {2}          # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
    assert set(_promotions(tma.promote(host, 256))) == {3} and set(_promotions(host)) == {2}
    assert set(_promotions(tma.promote(host, 64))) == {1}
    with pytest.raises(ValueError, match="L2_PROMOTION must be one of"):
        tma.promote(host, 96)
    seen = []
    monkeypatch.setattr(tl_lower, "host_codegen", lambda mod, *a, **k: seen.append(_promotions(mod)))
    tma.install()
    tma.install()                                      # once only
    monkeypatch.setattr(tma, "L2_PROMOTION", 256)
    tl_lower.host_codegen(host, None)
    monkeypatch.setattr(tma, "L2_PROMOTION", 128)
    tl_lower.host_codegen(host, None)
    assert seen == [[3] * len(_promotions(host)), [2] * len(_promotions(host))]
    state_128 = rules.state()
    monkeypatch.setattr(tma, "L2_PROMOTION", 256)
    assert rules.state() != state_128

    class Program:
        name = "p"

    prim = type("Prim", (), {"script": lambda self, show_meta=False: "ir"})()
    t = targets.get("cuda:sm_90a")
    key_256 = jit.key_inputs(Program, prim, t, {})
    monkeypatch.setattr(tma, "L2_PROMOTION", 128)
    assert key_256["tma_l2_promotion"] == 256 and jit.key_inputs(Program, prim, t, {})["tma_l2_promotion"] == 128


def test_tilelang_compile_generates_host_code_through_the_promotion(monkeypatch):
    """TileLang's own compile path (tvm_ffi, what codegen.jit uses for CUDA) reaches the wrapped host code
    generation: the host module it generates code from has the promoted descriptors (nvcc runs, no GPU)."""
    import tilelang

    from backends import ToolchainError
    from backends.cuda import tma
    from codegen import jit, targets

    jit._tilelang()
    seen = []
    promote = tma.promote
    monkeypatch.setattr(tma, "promote", lambda mod, nbytes: seen.append(_promotions(promote(mod, nbytes))) or
                        promote(mod, nbytes))
    monkeypatch.setattr(tma, "L2_PROMOTION", 256)
    try:
        tilelang.compile(_tma_copy_kernel(), target=targets.get("cuda:sm_90a").tvm(), execution_backend="tvm_ffi")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert seen == [[3]]
