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


def test_wgmma_serialization_warnings_are_read_from_the_ptxas_log():
    """backends.cuda.sass.wgmma_serialized: ptxas's C75xx performance warnings (the C7513 line as CUDA 13.0's ptxas
    printed it for session 51's FP8 MLA kernel; C7512, which says "for the function" and was missed until session
    53; C7507, setmaxnreg ignored, which names no function), one entry per warning naming the code and the
    function."""
    from backends.cuda.sass import wgmma_serialized

    log = """ptxas info    : 0 bytes gmem
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage in the function 'mla_decode_fp8_rows64_kernel'
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator registers of a wgmma between start and end of the pipeline stage in the function 'k2'
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'mla_decode_fp8_rows64_kernel'
ptxas info    : (C7507) Potential Performance Loss: 'setmaxnreg' ignored to maintain minimum register requirements.
ptxas info    : Used 168 registers, used 10 barriers, 1024 bytes smem"""
    found = wgmma_serialized(log)
    assert [f.split(":")[0] for f in found] == ["C7513 in mla_decode_fp8_rows64_kernel", "C7514 in k2",
                                                "C7512 in mla_decode_fp8_rows64_kernel", "C7507"], found
    assert "insufficient register resources" in found[2] and "setmaxnreg" in found[3]
    assert wgmma_serialized("ptxas info    : Used 168 registers") == []


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
