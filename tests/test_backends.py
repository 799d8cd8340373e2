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
