"""ops.mla_decode_fp8_rows64: the FP8-cache MLA decode at 64 query rows a CTA (the e4m3 latent converted into WGMMA's
register operand, two MMA warpgroups in a seesaw), against the reference on the exactly dequantized cache."""

import collections
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ops.mla_decode_fp8_rows64 import mla_decode_fp8_rows64_program
from tests.test_mla_decode import run_fp8_case

ROWS64 = dict(kv_format="fp8", rows64=True)


def test_lowers_to_register_operand_wgmma_kept_asynchronous():
    """Each warpgroup's step: the rope's 4 m64n64k16 MMAs (bf16, A from registers), each latent group's two
    64-column halves (2 x 4 fp16 RS MMAs; group 0 peeled, nvcc unrolls groups 1-3: 32), the P V of a step (2 groups
    x 2 m64 tiles x 4: 16) at its three sites (own step, the other's, the last step's); 64 F2FP unpacks a group's V
    fragment, 16 a K half; one stmatrix.x4 a 16-row block of P (4 a group copy, the copies' loop unrolled); a
    bar.arrive each for P_READY and P_FREE. Entering the group loop with the rope's MMAs in flight made ptxas
    serialize every WGMMA of the kernel (C7513; session 51's kernel measured 2-3x slow for it): gone. But at 64 rows
    ptxas still serializes them, for registers (C7512, "insufficient register resources": a wait after each of the
    168 HGMMA), which the log check missed until session 53 (bench/NOTES.md "Session 53"); this test pins that
    state: the op takes only the 32-row tile (below), which ptxas keeps asynchronous. Two MMA warpgroups at
    setmaxnreg 240; 3 words go to local memory; the op's 32-row tile spills nothing."""
    from backends.cuda.sass import compile_cubin, disassemble, sass_stats, wgmma_serialized

    src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1)
    assert "__launch_bounds__(384, 1)" in src and "warpgroup_reg_alloc<240>" in src
    cubin, log = compile_cubin(src, "sm_90a")
    found = wgmma_serialized(log)
    assert [f.split(":")[0] for f in found] == ["C7512 in mla_decode_fp8_rows64_kernel"], found
    st = sass_stats(cubin, "sm_90a")
    assert st.spill_stores <= 3, (st.spill_stores, st.spill_loads)
    sass = disassemble(cubin)
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == sass.count("HGMMA") == 168
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < 240
    counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|F2FP\.F16\.E4M3\.UNPACK_B|STSM[\w.]*|BAR\.ARV)\b",
                                            sass))
    assert counts["HGMMA.64x64x16.F32"] == 2 * (32 + 3 * 16) and counts["HGMMA.64x64x16.F32.BF16"] == 2 * 4, counts
    assert counts["F2FP.F16.E4M3.UNPACK_B"] == 2 * (8 * 16 + 3 * 64), counts
    assert counts["STSM.16.MT88.4"] == 2 * 16 and counts["BAR.ARV"] == 2 * 2, counts


def test_32_row_tiles_halve_the_accumulators_and_take_a_third_stage():
    """s_q * h_q <= 32 (the op's tile): WGMMA's N is 32 (the same MMA sites at m64n32k16, 2 stmatrix.x4 a P copy),
    ~200 registers (the MMAs' operands live while they run: 151 when ptxas serialized them) and no spills, three
    stages (four with v_scaled) beside Q^T and the P copies, and no WGMMA serialized by ptxas."""
    from backends.cuda.sass import compile_cubin, disassemble, sass_stats, wgmma_serialized

    for v_scaled, stages in ((False, 3), (True, 4)):
        src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=32, s_q=1, v_scaled=v_scaled)
        assert f"full[{stages - 1}].init(128);" in src and f"full[{stages}]" not in src
        cubin, log = compile_cubin(src, "sm_90a")
        assert wgmma_serialized(log) == [], wgmma_serialized(log)
        st = sass_stats(cubin, "sm_90a")
        assert st.spill_stores == 0 and st.spill_loads == 0, (st.spill_stores, st.spill_loads)
        sass = disassemble(cubin)
        assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < 208
        counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|STSM[\w.]*)\b", sass))
        assert counts["HGMMA.64x32x16.F32"] == 2 * (32 + 3 * 16) and counts["HGMMA.64x32x16.F32.BF16"] == 2 * 4, counts
        assert counts["STSM.16.MT88.4"] == 2 * (2 if v_scaled else 8), counts
    with pytest.raises(ValueError, match="rows_tile must be 64, or 32"):
        mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, rows_tile=32)


def test_v_scaled_takes_the_scales_into_v_and_three_stages():
    """v_scaled: the scales multiply V^T's converted token pairs (mul.f16x2: 32 a group's fragment, 3 sites x 2
    groups), P is one tile (4 stmatrix.x4 a step), and the third stage fits (three full and three empty barriers).
    ptxas keeps one word in local memory (the thread's quad place, reloaded twice a step), nothing else."""
    from backends.cuda.sass import build_cubin, disassemble, sass_stats

    src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, v_scaled=True)
    assert "full[2].init(128);" in src and "empty[2].init(256);" in src and "full[3]" not in src
    cubin = build_cubin(src, "sm_90a")
    st = sass_stats(cubin, "sm_90a")
    assert st.spill_stores <= 1, (st.spill_stores, st.spill_loads)
    counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|HMUL2|STSM[\w.]*)\b", disassemble(cubin)))
    assert counts["HMUL2"] == 2 * 3 * 2 * 32 and counts["STSM.16.MT88.4"] == 2 * 4, counts
    assert counts["HGMMA.64x64x16.F32"] == 2 * (32 + 3 * 16), counts


def test_k_scaled_takes_the_scales_into_k_and_drains_the_scores_once():
    """k_scaled: each K half's fragment times its tokens' scale ratios (mul.f16x2: 16 a half, 8 halves a step), the
    eight halves' MMAs on two alternating fragments with a wait for all but the last between them (no drain per
    group: one wgmma.wait_group 0 for the scores, against four), the same MMA and unpack counts as the default.
    ptxas serializes them for registers (C7512) as it does the default 64-row tile (bench/NOTES.md "Session 53"), so
    the queued GPU timing of this option measures a serialized kernel. Alone it spills nothing; with v_scaled a few
    words (stored before the loop). It needs the two fragments."""
    from backends.cuda.sass import compile_cubin, disassemble, sass_stats, wgmma_serialized

    for v_scaled, most_spills, hmul2 in ((False, 0, 2 * 8 * 16), (True, 8, 2 * 8 * 16 + 2 * 3 * 2 * 32)):
        src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, v_scaled=v_scaled, k_scaled=True)
        assert src.count("tc64_k_half_scaled<0>(") == 2 * 4 and src.count("tl::wait_wgmma<1>();") == 2 * 6
        assert src.count("tc64_fold_max<64>(") == 2 and "tc64_fold<64>(v" not in src
        cubin, log = compile_cubin(src, "sm_90a")
        assert [f.split(":")[0] for f in wgmma_serialized(log)] == ["C7512 in mla_decode_fp8_rows64_kernel"]
        st = sass_stats(cubin, "sm_90a")
        assert st.spill_stores <= most_spills, (v_scaled, st.spill_stores, st.spill_loads)
        counts = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|F2FP\.F16\.E4M3\.UNPACK_B|HMUL2)\b",
                                                disassemble(cubin)))
        assert counts["HGMMA.64x64x16.F32"] == 2 * (32 + 3 * 16) and counts["HGMMA.64x64x16.F32.BF16"] == 2 * 4, counts
        assert counts["F2FP.F16.E4M3.UNPACK_B"] == 2 * (8 * 16 + 3 * 64) and counts["HMUL2"] == hmul2, counts
    with pytest.raises(ValueError, match="k_scaled fills two K fragments"):
        mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, k_scaled=True, k_fragments=1)


def test_shared_memory_and_the_swizzled_tiles_are_aligned():
    """The stages, Q^T and the P copies fit one SM's 227 KB, and the 128-byte-swizzled P tiles (written by
    stmatrix with the swizzle computed from their offset) and Q^T start on 1 KB boundaries."""
    src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=128, s_q=1)
    offsets = {m.group(1): int(m.group(2)) for m in
               re.finditer(r"(\w+) = \(\(\w+\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)}
    assert offsets["p_s"] % 1024 == 0 and offsets["ql_s"] % 1024 == 0, offsets
    assert offsets["kl_s"] % 16 == 0, offsets


def test_refuses_what_it_is_not_built_for():
    for bad, msg in ((dict(page=32), "multiple of 64"), (dict(dtype="float16"), "bfloat16")):
        with pytest.raises(ValueError, match=msg):
            mla_decode_fp8_rows64_program.source("sm_90a", **{**dict(h_q=64, s_q=1), **bad})
    with pytest.raises(ValueError, match="no lowering for cuda:sm_100a"):
        mla_decode_fp8_rows64_program.source("sm_100a", h_q=64, s_q=1)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 64, [1000, 64], 64), (3, 1, 64, [53, 1, 0], 64),
                                                 (2, 1, 128, [4096, 3000], 64), (2, 2, 32, [700, 33], 128),
                                                 (3, 1, 48, [129, 4000, 2], 256), (1, 4, 32, [5000], 64),
                                                 (2, 1, 64, [16384, 130], 64), (4, 1, 20, [191, 192, 193, 65], 64),
                                                 (2, 1, 32, [8192, 1000], 64), (2, 2, 16, [700, 2], 128),
                                                 (3, 1, 17, [129, 0, 4000], 64)])
@pytest.mark.parametrize("variant", [{}, {"v_scaled": True}, {"v_scaled": True, "k_scaled": True}],
                         ids=["plain", "v_scaled", "vk_scaled"])
def test_gpu_matches_reference(b, s_q, h_q, lens, page, variant):
    """Against the reference on the exactly dequantized cache (fp32) with the bf16 kernels' bounds (the values are
    e4m3 exactly; P is rounded to fp16 after its scale): NaN tails and NaN pages must not leak; lengths 0, 1, 2 and
    odd and even step counts (the last step scored by either warpgroup, the other taking its P V after its loop);
    two row tiles (h_q = 128, s_q = 4); padding rows (48, 20); causal s_q > 1; splits and the combine; 32-row tiles
    (s_q * h_q <= 32: 32, 2 x 16, 17, 20). k_scaled rounds its scaled K to fp16: the reference reads the cache as
    it rounds it (k_scaled_dequant; against the exact cache the lse differed by 1.6e-5 in a CPU emulation, bound
    1e-5)."""
    run_fp8_case(b, s_q, h_q, lens, page, exact=True, tiling=dict(ROWS64, **variant))


def _late_jumps(q, kv, table):
    # tokens of sequence 0 with 24x / 48x its values: some columns jump far above their running max late, in a step
    # scored by either warpgroup (the factors then cross between them)
    for t, f in ((2500, 24), (3900, 48), (3960, 64)):
        kv[table[0, t // 64], t % 64] *= f


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"v_scaled": True}, {"v_scaled": True, "k_scaled": True}],
                         ids=["plain", "v_scaled", "vk_scaled"])
def test_gpu_follows_late_jumps(variant):
    run_fp8_case(2, 1, 64, [4000, 3000], 64, exact=True, tiling=dict(ROWS64, **variant), edit=_late_jumps)


@pytest.mark.gpu
def test_gpu_is_deterministic_and_unsplit_matches_split():
    """Two runs give the same bits (the row sums' partials are added in a fixed order); one split (the output written
    by the kernel) and eight (partials and the combine) agree to the combine's rounding."""
    from ops.mla_decode import MlaSchedule, _mla_decode_impl
    from tests.test_mla_decode import D, make_inputs
    import ops

    lens = [3000, 700]
    q, kv, table, seqlens = make_inputs(2, 1, 64, lens, page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)

    def run(splits):
        sched = MlaSchedule(torch.full((2,), splits, dtype=torch.int32, device="cuda"), splits, 64, False, seqlens)
        return _mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, sched, tiling=ROWS64, kv_format="fp8")

    a, a_lse = run(8)
    b, b_lse = run(8)
    assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
    one, one_lse = run(1)
    torch.testing.assert_close(one.float(), a.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(one_lse, a_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,v_scaled", [(64, False), (64, True), (32, False)])
def test_gpu_first_step_scores_and_p(h_q, v_scaled):
    """Diagnosis for the tests above (debug=True): each CTA's first step's S^T as folded (the rope's bf16 product
    plus each group's fp16 product times its token scale) and its P, against fp32 from the same rounded operands.
    A failure here puts an error in the query, the K fragments or the fold (S) or the softmax (P); a pass beside a
    failing output puts it after them (P's copies, V's fragments, O, the row sums)."""
    from codegen import targets
    from ops.mla_decode import LOG2E
    from tests.test_mla_decode import D, make_inputs
    import ops

    b, lens = 2, [300, 64]                     # a full first step in both sequences
    q, kv, table, seqlens = make_inputs(b, 1, h_q, lens, page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    kernel = mla_decode_fp8_rows64_program.compile(targets.resolve(q, cache), h_q=h_q, s_q=1, page=64,
                                                   dtype="bfloat16", causal=True, v_scaled=v_scaled, debug=True)
    kv8 = cache.view(cache.shape[0], 64, cache.shape[-1]).view(torch.float8_e4m3fn)
    out = torch.empty(b, h_q, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h_q, 1, dtype=torch.float32, device="cuda")
    o_part = torch.zeros(b, 64, 512, dtype=torch.float32, device="cuda")
    lse_part = torch.empty(b, 64, dtype=torch.float32, device="cuda")
    splits = torch.ones(b, dtype=torch.int32, device="cuda")
    scale_log2 = D ** -0.5 * LOG2E
    kernel.launcher()(q.view(b, h_q, D), kv8, kv8.view(torch.float32), kv8.view(torch.bfloat16), table, seqlens, splits,
                      out, lse, o_part, lse_part, 1, float(scale_log2))
    deq = ops.dequantize_mla_kv_fp8(cache).view(-1, 64, D)
    for i in range(b):
        k = deq[table[i, 0].long()]                                                       # (64 tokens, 576)
        qi = q[i, 0].float()
        s = qi[:, :512].half().float() @ k[:, :512].T + qi[:, 512:] @ k[:, 512:].T       # (h_q, 64)
        s_t = s.T                                                                         # (tokens, rows)
        got = o_part[i, :, :h_q]
        torch.testing.assert_close(got, s_t, atol=1e-3 * float(s_t.abs().max()), rtol=1e-4,
                                   msg=lambda m: f"sequence {i}: the first step's scores: {m}")
        p = torch.exp2(s_t * scale_log2 - (s_t * scale_log2).max(0).values)
        torch.testing.assert_close(o_part[i, :, 64:64 + h_q], p, atol=1e-4, rtol=1e-3,
                                   msg=lambda m: f"sequence {i}: the first step's P: {m}")


def test_the_op_takes_it_up_to_its_switchs_rows(monkeypatch):
    """ops.mla_decode.ROWS64_FP8 (32, measured): sm_90a FP8 caches with 64+-token pages above 16 rows and up to that
    many get this kernel; 16 rows keep the two-chain kernel, 32-token pages, more rows and other targets what they
    had; 0 turns it off, 128 gives it every row count above 16."""
    import importlib

    m = importlib.import_module("ops.mla_decode")      # (ops.mla_decode is also the op's name)
    cases = [(r, p, t) for r in (16, 32, 64, 128) for p in (32, 64) for t in ("sm_90a", "sm_100a")]
    assert m.ROWS64_FP8 == 32
    rows64 = dict(kv_format="fp8", rows64=True)
    default = {c: m.pick_tiling(c[0], "fp8", c[2], c[1]) for c in cases}
    monkeypatch.setattr(m, "ROWS64_FP8", 0)
    before = {c: m.pick_tiling(c[0], "fp8", c[2], c[1]) for c in cases}
    assert all(not x.get("rows64") for x in before.values())
    for limit in (32, 128):
        monkeypatch.setattr(m, "ROWS64_FP8", limit)
        for (r, p, t), was in before.items():
            now = m.pick_tiling(r, "fp8", t, p)
            assert now == (rows64 if t == "sm_90a" and 16 < r <= limit and p >= 64 else was), (limit, r, p, t)
            if limit == 32:
                assert default[(r, p, t)] == now
    assert not m.pick_tiling(128, "bf16", "sm_90a", 64).get("rows64")
    with pytest.raises(ValueError, match="k_fragments must be 1 or 2"):
        mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, k_fragments=3)


def test_trace_stamps_each_warpgroups_steps_and_the_tool_reads_them():
    """trace=True: 8 stamps a step in each warpgroup's loop, the span by WG0 (entry, loop start, loop end, exit), no
    spills added; refused with debug (both write OPart[bid]). bench.trace_mla_rows64.step_table: each warpgroup's
    own steps (k % 2 == w), its period over two of the CTA's steps, event offsets after the step's start (32-bit
    clock wrap included)."""
    import re

    from backends.cuda.sass import build_cubin, sass_stats
    from bench.trace_mla_rows64 import step_table
    from ops.mla_decode_fp8_rows64 import TRACE_EVENTS, TRACE_STEPS

    src = mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, trace=True)
    assert len(re.findall(r"\btc64_stamp\(stamps", src)) == 2 * 8 and len(re.findall(r"\btc_span\(\(", src)) == 4
    st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    assert st.spill_stores == 0, st.spill_stores
    assert not re.findall(r"\btc64_stamp\(stamps", mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1))
    with pytest.raises(ValueError, match="trace and debug"):
        mla_decode_fp8_rows64_program.source("sm_90a", h_q=64, s_q=1, trace=True, debug=True)
    stamps = torch.zeros(TRACE_STEPS, 8, dtype=torch.long)
    for k in range(TRACE_STEPS):
        t0 = (2 ** 32 - 3000 + 1500 * k + (100 if k % 2 else 0)) % 2 ** 32
        for e in range(8):
            stamps[k, e] = (t0 + (10 * e if k % 2 == 0 else 20 * e)) % 2 ** 32
    rows = step_table(stamps, 4, 28)
    assert rows[0][0] == 3000 and rows[1][0] == 3000
    assert rows[0][1][TRACE_EVENTS[1]] == (10, 10, 10) and rows[1][1][TRACE_EVENTS[7]] == (140, 140, 140)


@pytest.mark.gpu
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 4), s_q=st.sampled_from([1, 2]), h_q=st.sampled_from([32, 64, 128]),
       page=st.sampled_from([64, 128]), data=st.data())
def test_gpu_the_op_with_the_switch_on(monkeypatch, b, s_q, h_q, page, data):
    """ops.mla_decode(kv_format="fp8") with ROWS64_FP8 at 128 (every row count of 17-128 on this kernel; the op's schedule,
    custom op and combine around it): hypothesis over batch, s_q, h_q, page size and lengths (0-3000), against the
    reference with run_fp8_case's bounds. s_q * h_q = 256 stays on the op's bf16-converting FP8 kernel, so the
    reference's cache is whatever pick_tiling's choice multiplies (run_fp8_case derives it; forcing the exact cache
    failed there on lse, by the bf16 rounding of K: session 64, b 1, s_q 2, h_q 128, one token)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "ROWS64_FP8", 128)
    lens = data.draw(st.lists(st.integers(0, 3000), min_size=b, max_size=b))
    run_fp8_case(b, s_q, h_q, lens, page)


@pytest.mark.gpu
def test_gpu_batch_invariant_with_the_switch_on(monkeypatch):
    """TILECRAFT_BATCH_INVARIANT=1 with ROWS64_FP8 at 128: each sequence's output is bitwise the same alone and in a batch."""
    import importlib

    from tests.test_mla_decode import assert_batch_invariant

    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "ROWS64_FP8", 128)
    monkeypatch.setenv("TILECRAFT_BATCH_INVARIANT", "1")
    assert_batch_invariant(64, kv_format="fp8")
