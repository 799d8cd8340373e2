"""ops.mla_decode_qreg: the bf16-cache MLA decode with the query in registers (three warpgroup roles), against the
fp32 reference with the production kernel's bounds (tests/test_mla_decode.py's helpers)."""

import collections
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ops.mla_decode_qreg import PV_REGS, WG0_REGS, mla_decode_qreg_program
from tests.test_mla_decode import run_gpu_case

QREG = dict(qreg=True)


def test_lowers_with_q_in_registers_and_asynchronous_mmas():
    """A 32-token step: WG0's scores as 2 x 16 m64n32k16 MMAs with Q's latent from registers (RS) and 4 with its
    rope from shared memory (SS); each P V warpgroup's 2 m64n256k16 (SS, V read MN-major from the slot's latent
    half); one wait for all MMAs in flight a loop (no wait after each MMA), and ptxas neither serializes them nor
    ignores setmaxnreg (no C75xx), with no spills; the registers split WG0_REGS / PV_REGS / PV_REGS."""
    from backends.cuda.sass import compile_cubin, disassemble, sass_stats, wgmma_serialized

    src = mla_decode_qreg_program.source("sm_90a", h_q=128, s_q=1)
    assert "__launch_bounds__(384, 1)" in src
    assert f"warpgroup_reg_alloc<{WG0_REGS}>" in src and src.count(f"warpgroup_reg_dealloc<{PV_REGS}>") == 2
    assert WG0_REGS + 2 * PV_REGS <= 3 * 168
    cubin, log = compile_cubin(src, "sm_90a")
    assert wgmma_serialized(log) == [], wgmma_serialized(log)
    st = sass_stats(cubin, "sm_90a")
    assert st.spill_stores == 0 and st.spill_loads == 0 and st.stack_bytes == 0
    sass = disassemble(cubin)
    counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+)", sass))
    assert counts == {"HGMMA.64x32x16.F32.BF16": 36, "HGMMA.64x256x16.F32.BF16": 4}, counts
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 3
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < WG0_REGS


def test_defer_ready_announces_p_behind_the_next_steps_mmas():
    """defer_ready (default): WG0's arrive on ready for step k - 1 sits between step k's last score MMA batch and
    its wait, and the last step's after the loop; without it, right after P's stores and fence, before the next
    step's MMAs."""
    deferred = mla_decode_qreg_program.source("sm_90a", h_q=64, s_q=1)
    eager = mla_decode_qreg_program.source("sm_90a", h_q=64, s_q=1, defer_ready=False)
    loop = deferred[deferred.index("for (int k = 0; k < n_iter; ++k)"):]
    arrive, commit, wait = loop.index("ready[((k + 4) % 5)].arrive();"), loop.index("tl::wgmma_ss<"), \
        loop.index("tl::wait_wgmma<0>();")
    assert commit < arrive < wait
    assert "ready[((n_iter + 4) % 5)].arrive();" in deferred
    loop = eager[eager.index("for (int k = 0; k < n_iter; ++k)"):]
    assert loop.index("tl::fence_proxy_async();\n      ready[(k % 5)].arrive();") > loop.index("tl::wait_wgmma<0>();")


def test_trace_stamps_each_roles_steps_and_the_tool_reads_them():
    """trace=True: WG0 stamps 6 events a step, each P V warpgroup 5 and WG1 2 more around its reloads, the span 4
    times; the kernel keeps its shape (same MMAs, one wait a loop, no spills, no C75xx), and the default build has no
    stamp. bench.trace_mla_qreg.role_table: a role's period and event offsets after its step's start (32-bit clock
    wrap included)."""
    import torch

    from backends.cuda.sass import compile_cubin, disassemble, sass_stats, wgmma_serialized
    from bench.trace_mla_qreg import role_table
    from ops.mla_decode_qreg import TRACE_EVENTS, TRACE_STEPS

    src = mla_decode_qreg_program.source("sm_90a", h_q=128, s_q=1, trace=True)
    stamps = re.findall(r"\bqreg_stamp\((stamps\w*), k\w*, (\d)\)", src)
    assert collections.Counter(e for _, e in stamps) == {"0": 3, "1": 3, "2": 3, "3": 3, "4": 3, "5": 2, "6": 1}
    assert len(re.findall(r"\bqreg_span\(span, \d", src)) == 4
    cubin, log = compile_cubin(src, "sm_90a")
    assert wgmma_serialized(log) == []
    st = sass_stats(cubin, "sm_90a")
    assert st.spill_stores == 0 and st.spill_loads == 0
    sass = disassemble(cubin)
    assert len(re.findall(r"\bHGMMA\.", sass)) == 40 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 3
    assert "qreg_stamp(" not in mla_decode_qreg_program.source("sm_90a", h_q=128, s_q=1).split("extern \"C\"")[1]
    st = torch.zeros(TRACE_STEPS, 8, dtype=torch.long)
    for k in range(TRACE_STEPS):
        t0 = (2 ** 32 - 5000 + 1300 * k) % 2 ** 32
        for e in range(8):
            st[k, e] = (t0 + 100 * e) % 2 ** 32
    period, events = role_table(st, 1, 2, 20)
    assert period == 1300 and events["P ready"] == (100, 100, 100) and events["reloaded"] == (600, 600, 600)
    assert list(events) == list(TRACE_EVENTS[1][1:])


def test_shapes_it_does_not_take_are_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        mla_decode_qreg_program.source("sm_90a", h_q=16, s_q=1)
    with pytest.raises(ValueError, match="page must be a multiple of 64"):
        mla_decode_qreg_program.source("sm_90a", h_q=64, s_q=1, page=32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mla_decode_qreg_program.source("sm_90a", h_q=64, s_q=1, dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page,dtype", [
    (2, 1, 128, [1000, 64], 64, torch.bfloat16),    # a short last step; one block
    (3, 1, 64, [4096, 1, 0], 64, torch.bfloat16),   # lengths 1 and 0 (zeros, lse -inf)
    (2, 2, 128, [300, 2049], 64, torch.bfloat16),   # causal over 4 row tiles; a last block with one step
    (2, 1, 64, [16384, 8000], 64, torch.bfloat16),  # splits + combine
    (2, 4, 32, [7, 5000], 128, torch.bfloat16),     # causal, 128 rows, pages of 128
    (2, 1, 128, [1000, 33], 256, torch.bfloat16),   # pages of 256; 33 tokens (a second step of one token)
    (1, 1, 64, [160], 64, torch.bfloat16),          # fewer steps than ring slots (5)
    (2, 2, 64, [2000, 77], 64, torch.float16),      # an fp16 query and cache
])
def test_gpu_matches_reference(b, s_q, h_q, lens, page, dtype):
    """Against the fp32 reference (unused pages and tails NaN-poisoned) with the production kernel's bounds."""
    run_gpu_case(b, s_q, h_q, lens, page=page, dtype=dtype, tiling=QREG)


@pytest.mark.gpu
def test_gpu_is_deterministic_and_defer_ready_changes_no_bit():
    """Two runs give the same bits, and so does defer_ready=False (P ready before the next step's MMAs go out: only
    the timing differs)."""
    a = run_gpu_case(2, 1, 128, [3000, 700], tiling=QREG)
    b = run_gpu_case(2, 1, 128, [3000, 700], tiling=QREG)
    c = run_gpu_case(2, 1, 128, [3000, 700], tiling=dict(QREG, defer_ready=False))
    assert all(x.equal(y) and x.equal(z) for x, y, z in zip(a, b, c))


@pytest.mark.gpu
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 4), s_q=st.sampled_from([1, 2]), h_q=st.sampled_from([64, 128]),
       page=st.sampled_from([64, 128]), data=st.data())
def test_gpu_the_op_with_the_switch_on(monkeypatch, b, s_q, h_q, page, data):
    """ops.mla_decode with QREG_BF16 on (the op's schedule, custom op and combine around the kernel): hypothesis over
    batch, s_q, h_q, page size and lengths (0-3000), against the reference."""
    import importlib

    mod = importlib.import_module("ops.mla_decode")
    monkeypatch.setattr(mod, "QREG_BF16", True)
    assert mod.pick_tiling(s_q * h_q, "bf16", "cuda:sm_90a", page) == QREG
    lens = data.draw(st.lists(st.integers(0, 3000), min_size=b, max_size=b))
    run_gpu_case(b, s_q, h_q, lens, page=page, seed=data.draw(st.integers(0, 1000)))


@pytest.mark.gpu
def test_gpu_batch_invariant_with_the_switch_on(monkeypatch):
    """TILECRAFT_BATCH_INVARIANT=1 with QREG_BF16 on: each sequence's output is bitwise the same alone and in a
    batch."""
    import importlib

    from tests.test_mla_decode import assert_batch_invariant

    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "QREG_BF16", True)
    monkeypatch.setenv("TILECRAFT_BATCH_INVARIANT", "1")
    assert_batch_invariant(128)
