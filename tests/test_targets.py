import pytest
import torch

from backends import ToolchainError
from codegen import targets


def test_canonical_names_and_aliases():
    assert targets.get("sm_90a").name == "cuda:sm_90a"
    assert targets.get("Hopper").name == "cuda:sm_90a"
    assert targets.get("sm_100a").name == "cuda:sm_100a"
    assert targets.get("ascend").name == "ascend:950"
    assert targets.get("dav-3510").arch == "dav-3510"
    assert targets.get("cpu").vendor == "cpu"
    assert set(targets.TARGETS) == {"cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"}


def test_unknown_target_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown target 'sm_75'.*cuda:sm_90a"):
        targets.get("sm_75")
    with pytest.raises(TypeError, match="target must be a str"):
        targets.get(90)


def test_detected_from_tensor_device(monkeypatch):
    monkeypatch.delenv("TILECRAFT_TARGET", raising=False)
    assert targets.resolve(torch.zeros(2)).name == "cpu"


def test_env_var_overrides_detection_and_is_checked(monkeypatch):
    monkeypatch.setenv("TILECRAFT_TARGET", "cpu")
    assert targets.resolve(torch.zeros(2)).name == "cpu"
    monkeypatch.setenv("TILECRAFT_TARGET", "sm_90a")
    with pytest.raises(ValueError, match=r"TILECRAFT_TARGET=cuda:sm_90a runs on 'cuda' devices, but the tensors are on 'cpu'"):
        targets.resolve(torch.zeros(2))
    monkeypatch.setenv("TILECRAFT_TARGET", "riscv")
    with pytest.raises(ValueError, match="unknown target 'riscv'"):
        targets.resolve(torch.zeros(2))


def test_every_op_checks_the_env_var_on_cpu_tensors(monkeypatch):
    """The ops whose CPU tensors run a torch reference check TILECRAFT_TARGET as the compiled ops do: a target for
    another device, or an unknown one, is an error rather than silently ignored; cpu is accepted."""
    import ops

    g = torch.Generator().manual_seed(0)
    qa, sfa = ops.per_token_group_quant_fp8(torch.randn(4, 256, generator=g))
    qb, sfb = ops.per_block_quant_fp8(torch.randn(128, 256, generator=g))
    packed, scales = ops.quant_mxfp4(torch.randn(128, 256, generator=g))
    prep = ops.prepare_mxfp4_w4a8(packed, scales)
    x = torch.randn(4, 256, generator=g)
    calls = [lambda: ops.fp8_gemm_nt(qa, sfa, qb, sfb), lambda: ops.per_token_group_quant_fp8(x),
             lambda: ops.mxfp4_gemm_nt(x.bfloat16(), packed, scales),
             lambda: ops.mxfp4_w4a8_gemm_nt(qa, sfa[:, 0].contiguous(), *prep)]
    monkeypatch.setenv("TILECRAFT_TARGET", "cpu")
    for call in calls:
        call()
    for bad, match in (("sm_90a", "TILECRAFT_TARGET=cuda:sm_90a runs on 'cuda' devices"), ("riscv", "unknown target")):
        monkeypatch.setenv("TILECRAFT_TARGET", bad)
        for call in calls:
            with pytest.raises(ValueError, match=match):
                call()


def test_explicit_target_beats_env(monkeypatch):
    monkeypatch.setenv("TILECRAFT_TARGET", "sm_90a")
    assert targets.resolve(torch.zeros(2), target="cpu").name == "cpu"
    with pytest.raises(ValueError, match=r"target=ascend:950 runs on 'npu' devices"):
        targets.resolve(torch.zeros(2), target="ascend")


def test_tensors_on_two_devices_rejected():
    a = torch.zeros(2)
    b = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="one device"):
        targets.resolve(a, b)


def test_unavailable_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ToolchainError, match="CUDA GPU is needed"):
        targets.for_device("cuda")


def test_current_target_only_inside_a_trace():
    with pytest.raises(RuntimeError, match="no target is active"):
        targets.current()
    with targets.using("sm_100a") as t:
        assert targets.current() is t
    with pytest.raises(RuntimeError):
        targets.current()


def test_over_the_targets_shared_memory_is_a_build_time_error():
    """A kernel that allocates more shared memory than the target has fails at build time, naming
    the program and its parameters (the driver's launch error was the first sign before: a 32-row
    FP8 fold MLA kernel needed 247,936 bytes, bench/NOTES.md "MLA v12")."""
    from ops.gemm_fp8 import fp8_gemm_program

    # (the pipelined loop: it lowers in seconds where the overlapped one takes ~30 s of CI)
    with pytest.raises(ValueError, match=r"fp8_gemm_nt.*'stages': 8.*needs \d+ bytes of shared memory on cuda:sm_90a"):
        fp8_gemm_program.source("sm_90a", n=4096, k=7168, block_m=128, block_n=128, stages=8)
    # the same program at a depth that fits
    assert "wgmma" in fp8_gemm_program.source("sm_90a", n=4096, k=7168, block_m=128, block_n=128, stages=6)
