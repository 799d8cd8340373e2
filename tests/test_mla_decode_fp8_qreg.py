"""ops.mla_decode_fp8_qreg: the FP8-cache MLA decode with the query in registers (ops.mla_decode_qreg's roles, the
cache converted to fp16 tiles by the P V warpgroups), against the fp32 reference on the cache as the kernel rounds it
(tests/test_mla_decode.py's run_fp8_case, fp16_scaled_dequant)."""

import collections
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ops.mla_decode_fp8_qreg import REGS, mla_decode_fp8_qreg_program
from tests.test_mla_decode import fp16_scaled_dequant, run_fp8_case

FP8_QREG = dict(qreg=True, kv_format="fp8")


def test_lowers_with_fp16_tiles_converted_by_the_p_v_warpgroups():
    """WG0's scores: 2 x 16 m64n32k16 fp16 MMAs with Q from registers and 4 bf16 ones for the rope (the raw slot's);
    each P V warpgroup's 2 m64n256k16 fp16 MMAs; the conversion as paired e4m3 -> fp16 conversions and fp16
    multiplies; the lazy rescale's vote; one wait for all MMAs in flight a loop; ptxas neither serializes the MMAs nor
    ignores setmaxnreg, and nothing is spilled in a role's code (one predicate is kept in local memory from the
    prologue, before the roles part, to the epilogue)."""
    from backends.cuda.sass import compile_cubin, disassemble, wgmma_serialized

    src = mla_decode_fp8_qreg_program.source("sm_90a", h_q=128, s_q=1)
    assert sum(REGS) <= 3 * 168 and f"warpgroup_reg_alloc<{REGS[0]}>" in src
    assert f"warpgroup_reg_dealloc<{REGS[1]}>" in src and f"warpgroup_reg_dealloc<{REGS[2]}>" in src
    assert "__tl_cvt_fp8x2_to_half2" in src and "tl::mul2" in src and src.count("qreg_rescale_needed(") == 3
    cubin, log = compile_cubin(src, "sm_90a")
    assert wgmma_serialized(log) == [], wgmma_serialized(log)
    sass = disassemble(cubin)
    counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+)", sass))
    assert counts == {"HGMMA.64x32x16.F32": 32, "HGMMA.64x32x16.F32.BF16": 4, "HGMMA.64x256x16.F32": 4}, counts
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 3
    lines = sass.splitlines()
    roles = min(n for n, line in enumerate(lines) if "USETMAXREG" in line)
    stores = [n for n, line in enumerate(lines) if re.search(r"\bSTL\b", line)]
    assert len(stores) <= 1 and all(n < roles for n in stores), stores
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < REGS[0]


def test_fp16_scaled_dequant_rounds_the_products_to_fp16():
    """The test reference's emulation: within fp16's rounding of the exact dequantized cache, and exactly it where
    the scale is a power of two."""
    import ops

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 64, 576, generator=g)
    kv[1] *= 40
    kv = kv.bfloat16()
    cache = ops.quantize_mla_kv_fp8(kv)
    exact, emulated = ops.dequantize_mla_kv_fp8(cache), fp16_scaled_dequant(cache)
    assert torch.equal(exact[..., 512:], emulated[..., 512:])
    err = (emulated[..., :512] - exact[..., :512]).abs()
    assert (err <= 2 * 2.0 ** -11 * exact[..., :512].abs() + 1e-7).all()
    assert err.max() > 0
    raw = cache.view(torch.uint8).clone()
    raw[..., 512:528] = torch.tensor([2.0 ** -4] * 4).view(torch.uint8).repeat(3, 64, 1)
    assert torch.equal(fp16_scaled_dequant(raw)[..., :512], ops.dequantize_mla_kv_fp8(raw)[..., :512])


def test_a_last_row_tile_past_the_rows_reads_zeros():
    """s_q * h_q not a multiple of 64: the last tile's rows past it read zeros for Q's latent (and rope) and store
    nothing; a multiple of 64 keeps the unguarded loads."""
    zero_fill = "make_uint1(__pack_half2(broadcast_var"            # Q's latent fragments: zeros past the rows
    assert mla_decode_fp8_qreg_program.source("sm_90a", h_q=32, s_q=1).count(zero_fill) == 2
    assert mla_decode_fp8_qreg_program.source("sm_90a", h_q=64, s_q=1).count(zero_fill) == 0


def test_shapes_it_does_not_take_are_refused():
    with pytest.raises(ValueError, match="query rows"):
        mla_decode_fp8_qreg_program.source("sm_90a", h_q=0, s_q=1)
    with pytest.raises(ValueError, match="page must be a multiple of 64"):
        mla_decode_fp8_qreg_program.source("sm_90a", h_q=64, s_q=1, page=32)
    with pytest.raises(ValueError, match="bfloat16"):
        mla_decode_fp8_qreg_program.source("sm_90a", h_q=64, s_q=1, dtype="float16")
    with pytest.raises(ValueError, match="ahead"):
        mla_decode_fp8_qreg_program.source("sm_90a", h_q=64, s_q=1, ahead=3)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [
    (2, 1, 128, [1000, 64], 64),      # a short last step; one block
    (3, 1, 64, [4096, 1, 0], 64),     # lengths 1 and 0 (zeros, lse -inf)
    (2, 2, 128, [300, 2049], 64),     # causal over 4 row tiles; a last block with one step
    (2, 1, 64, [16384, 8000], 64),    # splits + combine
    (2, 4, 32, [7, 5000], 128),       # causal, 128 rows, pages of 128
    (2, 1, 128, [1000, 33], 256),     # pages of 256; a sequence of 33 tokens (two steps, the second of one token)
    (1, 1, 64, [96], 64),             # fewer steps (3) than raw slots (5), as many as converted slots
    (1, 1, 64, [40], 64),             # fewer steps (2) than the converters run ahead of their P V
    (2, 1, 32, [1000, 64], 64),       # 32 rows: one tile, half of it padding
    (2, 2, 16, [300, 2049], 64),      # MTP, 32 rows, causal
    (2, 3, 16, [500, 70], 128),       # 48 rows, causal over three query tokens
])
def test_gpu_matches_reference(b, s_q, h_q, lens, page):
    """Against the fp32 reference on the cache as the kernel rounds it (unused pages and tails NaN-poisoned)."""
    run_fp8_case(b, s_q, h_q, lens, page, tiling=FP8_QREG)


@pytest.mark.gpu
def test_gpu_is_deterministic_and_defer_ready_or_lazy_rescale_change_no_bit():
    """Two runs give the same bits, and so do defer_ready=False and lazy_rescale=False (O always rescaled)."""
    import ops
    from ops.mla_decode import _mla_decode_impl
    from tests.test_mla_decode import make_inputs

    q, kv, table, seqlens = make_inputs(2, 1, 128, [3000, 700], device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    runs = [_mla_decode_impl(q, cache, table, seqlens, 576 ** -0.5, True, None, tiling=t, kv_format="fp8")
            for t in (FP8_QREG, FP8_QREG, dict(FP8_QREG, defer_ready=False), dict(FP8_QREG, lazy_rescale=False))]
    assert all(all(x.equal(y) for y in others) for x, *others in zip(*runs))


@pytest.mark.gpu
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 4), s_q=st.sampled_from([1, 2]), h_q=st.sampled_from([24, 64, 128]),
       page=st.sampled_from([64, 128]), data=st.data())
def test_gpu_the_op_with_the_switch_on(monkeypatch, b, s_q, h_q, page, data):
    """ops.mla_decode(kv_format="fp8") with QREG_FP8 on (the op's schedule, custom op and combine around the kernel):
    hypothesis over batch, s_q, h_q, page size and lengths (0-3000), against the reference on the cache as the
    kernel rounds it."""
    import importlib

    mod = importlib.import_module("ops.mla_decode")
    monkeypatch.setattr(mod, "QREG_FP8", True)
    if s_q * h_q > mod.ROWS64_FP8:
        assert mod.pick_tiling(s_q * h_q, "fp8", "cuda:sm_90a", page) == FP8_QREG
    lens = data.draw(st.lists(st.integers(0, 3000), min_size=b, max_size=b))
    run_fp8_case(b, s_q, h_q, lens, page)


@pytest.mark.gpu
def test_gpu_batch_invariant_with_the_switch_on(monkeypatch):
    """TILECRAFT_BATCH_INVARIANT=1 with QREG_FP8 on: each sequence's output is bitwise the same alone and in a batch."""
    import importlib

    from tests.test_mla_decode import assert_batch_invariant

    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "QREG_FP8", True)
    monkeypatch.setenv("TILECRAFT_BATCH_INVARIANT", "1")
    assert_batch_invariant(128, kv_format="fp8")
