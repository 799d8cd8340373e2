"""ops.mla_decode_fp8_rs: the FP8-cache MLA decode with the e4m3 latent converted straight into WGMMA's register
operand (sm_90a, up to 16 query rows), against the reference on the exactly dequantized cache."""

import collections
import re

import pytest
import torch

from ops.mla_decode_fp8_rs import (RS2_PACE, TRACE_STEPS, latent_column, mla_decode_fp8_rs2_program,
                                   mla_decode_fp8_rs_program, q_column)
from tests.test_mla_decode import run_fp8_case

RS = dict(register_fp8=True, kv_format="fp8")


def test_fragment_orders_are_permutations():
    """Q^T's column order (K's fragment) and V^T's row order are permutations of a group's 128 columns, and
    V^T's puts a thread's four rows (mt * 64 + 16w + 8hi + q) on four consecutive columns (one 32-bit word)."""
    assert sorted(q_column(k) for k in range(128)) == list(range(128))
    assert sorted(latent_column(d) for d in range(128)) == list(range(128))
    for w in range(4):
        for q in range(8):
            cols = [latent_column(mt * 64 + 16 * w + 8 * hi + q) for mt in (0, 1) for hi in (0, 1)]
            assert cols == [4 * (8 * w + q) + i for i in range(4)]
    # K's fragment: thread place c reads bytes 32c .. 32c + 31 of a row, in K order 16j + {2c, 2c+1, 2c+8, 2c+9}
    for c in range(4):
        ks = [16 * j + 2 * c + o for j in range(8) for o in (0, 1, 8, 9)]
        assert [q_column(k) for k in ks] == list(range(32 * c, 32 * c + 32))


def test_lowers_to_register_operand_wgmma_without_spills():
    """Each 64-token step: the rope's S^T MMA from shared memory (bf16), the latent's 4 + 4 groups from
    registers (fp16 from e4m3, 8 k16 instructions each: 64); K's fragment by 16-byte loads (4 a group), one
    F2FP unpack a value pair (256 a step); two CTAs an SM in 128 registers, no spills; one 128-byte-swizzled
    raw tile a group (1 KB aligned)."""
    from backends.cuda.sass import build_cubin, disassemble, sass_stats

    src = mla_decode_fp8_rs_program.source("sm_90a", h_q=16, s_q=1)
    assert "__launch_bounds__(256, 2)" in src and "warpgroup_reg_alloc<224>" in src
    kinds = collections.Counter(re.findall(r"wgmma_(rs|ss)<tl::DataType::(\w+),", src))
    assert kinds == {("ss", "kBFloat16"): 1, ("rs", "kFloat16"): 8}, kinds
    offset = int(re.search(r"kl_s = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src).group(1))
    assert offset % 1024 == 0
    cubin = build_cubin(src, "sm_90a")
    st = sass_stats(cubin, "sm_90a")
    assert st.registers <= 128 and st.spill_stores == 0, (st.registers, st.spill_stores)
    sass = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|LDS\.128|F2FP\.F16\.E4M3\.UNPACK_B)\b", disassemble(cubin)))
    assert sass["HGMMA.64x16x16.F32"] == 64 and sass["HGMMA.64x16x16.F32.BF16"] == 4, sass
    assert sass["LDS.128"] >= 16 and sass["F2FP.F16.E4M3.UNPACK_B"] == 256, sass


def test_two_chains_lower_without_spills_and_load_the_query_in_one_round_trip():
    """The op's FP8 kernel at <= 16 rows (two MMA warpgroups a CTA, one CTA an SM): both chains' 2 x (64 RS + 4 SS)
    WGMMAs and 2 x 256 F2FP unpacks a step, no spills at the launch's 168 registers; the latent query is staged
    by 3 x 16-byte loads a thread (one round trip; loaded straight into its permuted tile by 384 threads it
    was 11 guarded loads in a row, a 14-us prologue: bench/NOTES.md "Session 37"); the split's range is divided
    out once, before the chains (inlined, it was a signed division a step in each chain's loop: "Session 38")."""
    from backends.cuda.sass import build_cubin, disassemble, sass_stats

    src = mla_decode_fp8_rs2_program.source("sm_90a", h_q=16, s_q=1)
    assert "__launch_bounds__(384, 1)" in src and "warpgroup_reg_alloc<224>" in src
    assert "/ max(splits" not in src[src.index("warpgroup_reg_alloc<224>"):]
    cubin = build_cubin(src, "sm_90a")
    st = sass_stats(cubin, "sm_90a")
    assert st.registers <= 168 and st.spill_stores == 0, (st.registers, st.spill_stores)
    sass = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|LDG\.E\.128[\w.]*|F2FP\.F16\.E4M3\.UNPACK_B)\b",
                                          disassemble(cubin)))
    assert sass["HGMMA.64x16x16.F32"] == 128 and sass["HGMMA.64x16x16.F32.BF16"] == 8, sass
    assert sass["F2FP.F16.E4M3.UNPACK_B"] == 512 and sass["LDG.E.128.CONSTANT"] == 3, sass
    # the pace: the producer's warp holds a stage, each chain counts its stages, chain 0 leaves last
    assert src.count("tc_pace((") == 1 and src.count("tc_pace_count((") == 2 and src.count("tc_pace_exit((") == 1


def test_refuses_what_it_is_not_built_for():
    for bad, msg in ((dict(h_q=32), "at most 16 query rows"), (dict(page=32), "multiple of 64"),
                     (dict(blocks_per_sm=3), "blocks_per_sm"), (dict(dtype="float16"), "bfloat16"),
                     (dict(older_64ths=64), "older_64ths")):
        with pytest.raises(ValueError, match=msg):
            mla_decode_fp8_rs_program.source("sm_90a", **{**dict(h_q=16, s_q=1), **bad})
    with pytest.raises(ValueError, match="no lowering for cuda:sm_100a"):
        mla_decode_fp8_rs_program.source("sm_100a", h_q=16, s_q=1)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_sm", [2, 1])
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 16, [1000, 64], 64), (3, 1, 16, [53, 1, 0], 64),
                                                 (2, 1, 16, [16384, 8000], 64), (2, 2, 8, [700, 33], 128),
                                                 (4, 1, 1, [4096, 77, 130, 2], 256), (2, 4, 4, [65, 3], 64),
                                                 (3, 1, 7, [129, 64, 4000], 64)])
def test_gpu_matches_reference(b, s_q, h_q, lens, page, blocks_per_sm):
    """Against the reference on the exactly dequantized cache (fp32), with the bf16 kernels' bounds (the
    values are e4m3 exactly; P is rounded to fp16 after its scale, as the fold kernel's): NaN tails and
    NaN pages (their scales too) must not leak; lengths 0 and 1; causal s_q > 1; splits and the combine."""
    run_fp8_case(b, s_q, h_q, lens, page, exact=True, tiling=dict(RS, blocks_per_sm=blocks_per_sm))


@pytest.mark.gpu
def test_gpu_splits_and_two_ctas_an_sm_with_the_schedule():
    """A schedule that counts two CTAs an SM (more splits), as bench's provider makes it: the same answer."""
    from ops.mla_decode import _mla_decode_impl, get_mla_schedule
    from tests.test_mla_decode import D, make_inputs
    import ops

    q, kv, table, seqlens = make_inputs(4, 1, 16, [5000, 64, 1, 9000], page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    sched = get_mla_schedule(seqlens, 1, 16, table.shape[1], num_sms=2 * torch.cuda.get_device_properties(0).multi_processor_count)
    assert sched.max_splits > 1
    out, lse = _mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, sched, tiling=RS, kv_format="fp8")
    ref, ref_lse = _mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, None,
                                    tiling=dict(kv_format="fp8", block_n=64, stages=2, raw_stages=2, swapped=True,
                                                rope_direct=True, fold_scales=True), kv_format="fp8")
    assert not out.isnan().any()
    # the fold kernel computes the same products in another order: close, not bitwise
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("older_64ths", [34, 20])
def test_gpu_weighted_splits_match_the_reference(older_64ths):
    """older_64ths (the grid split-major, split 0 of a 2-split sequence longer or shorter): every step is
    still covered once; every sequence in two splits whatever its length (0, 1, 64: splits of one step or
    none), against the reference on the exactly dequantized cache with run_fp8_case's bounds."""
    from ops.mla_decode import MlaSchedule, _mla_decode_impl, mla_decode_reference
    from tests.test_mla_decode import D, make_inputs, p_rounding_term
    import ops

    lens = [5000, 0, 1, 64, 9000, 129]
    q, kv, table, seqlens = make_inputs(len(lens), 1, 16, lens, page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    sched = MlaSchedule(torch.full((len(lens),), 2, dtype=torch.int32, device="cuda"), 2, 16, False, seqlens)
    out, lse = _mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, sched,
                                tiling=dict(RS, older_64ths=older_64ths), kv_format="fp8")
    deq = ops.dequantize_mla_kv_fp8(cache)
    ref, ref_lse = mla_decode_reference(q, deq, table, seqlens, softmax_scale=D ** -0.5)
    assert not out.isnan().any()
    bound = 8e-4 + (2.01 / 128) * ref.abs() + 6 * 2.0 ** -8 / 3 ** 0.5 * p_rounding_term(q, deq, table, seqlens,
                                                                                        D ** -0.5, True)
    assert ((out.float() - ref).abs() <= bound).all()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
    assert (lse[~finite] == float("-inf")).all()


def test_page_stages_lower_to_bulk_copies_without_spills():
    """rs2's stage="page": each stage is bulk copies of contiguous bytes (UBLKCP, no TMA boxes), the same WGMMAs
    (the rope's 8 now take A from registers) and F2FP unpacks as the op's kernel, no spills."""
    from backends.cuda.sass import build_cubin, disassemble, sass_stats

    cubin = build_cubin(mla_decode_fp8_rs2_program.source("sm_90a", h_q=16, s_q=1, stage="page"), "sm_90a")
    st = sass_stats(cubin, "sm_90a")
    assert st.registers <= 168 and st.spill_stores == 0, (st.registers, st.spill_stores)
    sass = collections.Counter(re.findall(r"\b(HGMMA\.[\w.]+|UBLKCP[\w.]*|UTMALDG[\w.]*|F2FP\.F16\.E4M3\.UNPACK_B)\b",
                                          disassemble(cubin)))
    assert sass["HGMMA.64x16x16.F32"] == 128 and sass["HGMMA.64x16x16.F32.BF16"] == 8, sass
    assert sass["F2FP.F16.E4M3.UNPACK_B"] == 512 and sass["UBLKCP.S.G"] > 0 and sass["UTMALDG.3D"] == 0, sass
    with pytest.raises(ValueError, match="stage must be"):
        mla_decode_fp8_rs2_program.source("sm_90a", h_q=16, s_q=1, stage="rows")


def test_trace_rs2_tail_reads_the_last_steps():
    """bench.trace_mla_rs.rs2_tail: CTA 0's last steps' data wait and P V done after each step's start (32-bit
    clock wrap included); nothing when the range is longer than the traced steps or empty."""
    from bench.trace_mla_rs import rs2_tail

    st = torch.zeros(TRACE_STEPS, 8, dtype=torch.long)
    for k in range(10):
        t0 = (2 ** 32 - 500 + 1000 * k) % 2 ** 32
        st[k, 0], st[k, 1], st[k, 4] = t0, (t0 + 10 * k) % 2 ** 32, (t0 + 900) % 2 ** 32
    assert rs2_tail(st, 10) == [(6, 60, 900), (7, 70, 900), (8, 80, 900), (9, 90, 900)]
    assert rs2_tail(st, 2, last=4) == [(0, 0, 900), (1, 10, 900)]
    assert rs2_tail(st, TRACE_STEPS + 1) == [] and rs2_tail(st, 0) == []


def test_removed_rs2_knobs_are_refused():
    """The knobs measured and removed in sessions 42 and 43 (lag, q_copy, merge, desc_add, one_body, pace_tail) are
    not keyword arguments any more: a caller who still passes one is told so, not silently given the op's kernel."""
    for kw in (dict(lag=8.0), dict(q_copy="bulk"), dict(merge="split"), dict(desc_add="u64"), dict(one_body=True),
               dict(pace_tail=4)):
        with pytest.raises(TypeError):
            mla_decode_fp8_rs2_program.source("sm_90a", h_q=16, s_q=1, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 16, [1000, 64], 64), (3, 1, 16, [53, 1, 0], 64),
                                                 (2, 1, 16, [16384, 8000], 64), (2, 2, 8, [700, 33], 128),
                                                 (4, 1, 1, [4096, 77, 130, 2], 256), (3, 1, 7, [129, 64, 4000], 64)])
def test_gpu_two_chains_match_the_reference(b, s_q, h_q, lens, page):
    """mla_decode_fp8_rs2 (two MMA warpgroups on alternate steps, merged at the end): as test_gpu_matches_reference,
    including a chain with no step (lengths 1 and 64: one step, WG1 idle) and none at all (length 0)."""
    run_fp8_case(b, s_q, h_q, lens, page, exact=True, tiling=dict(RS, chains=2))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(3, 1, 16, [53, 1, 0], 64), (2, 2, 8, [700, 33], 128),
                                                 (2, 1, 16, [16384, 8000], 64)])
def test_gpu_two_chains_on_page_stages_match_the_reference(b, s_q, h_q, lens, page):
    """rs2 with stage="page" (a step's 41,984 contiguous bytes in bulk copies, the fills reading the token rows as
    the cache holds them, the rope from registers): as test_gpu_two_chains_match_the_reference, with a short last
    step (its tokens' latent and scales zeroed in the stage), 64-token steps at row 64 of 128-token pages, s_q = 2."""
    run_fp8_case(b, s_q, h_q, lens, page, exact=True, tiling=dict(RS, chains=2, stage="page"))


def _late_jumps(q, kv, table):
    # two tokens of sequence 0 with 24x / 48x its values: scores with a spread of ~9 and ~17 (log2 units; the
    # others ~0.4), so that some columns jump far above their running max late in the sequence
    for t, f in ((2500, 24), (3900, 48)):
        kv[table[0, t // 64], t % 64] *= f


def _huge_last_group(q, kv, table):
    # the last latent group 2^22 larger where q is zero: the same scores, scales ~2^15 (P * scale in fp16 only
    # while P <= ~2), q at full size
    q *= 4
    q[..., 384:512] = 0
    kv[..., 384:512] *= 2.0 ** 22


@pytest.mark.gpu
@pytest.mark.parametrize("edit", [_late_jumps, _huge_last_group])
def test_gpu_two_chains_follow_late_jumps_and_large_scales(edit):
    """rs2 with a score far above the running max late in a sequence (O and l rescaled after many steps at one
    max), and with scales near fp16's limit for P * scale. Against the reference with run_fp8_case's bounds, no
    inf or NaN."""
    run_fp8_case(2, 1, 16, [4000, 3000], 64, exact=True, tiling=dict(RS, chains=2), edit=edit)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{"third_fragment": None}, {"third_fragment": "v"}, {"stage": "boxes"}])
def test_gpu_rs2_variants_are_bitwise_the_op(extra):
    """rs2's knobs that must not change a bit (bench/NOTES.md "Session 40", "Session 41"): the number of register
    fragments (the op's third for K, none, one for V) changes when groups are converted, not what; so does how a
    stage is loaded and
    laid out (the op's stage="page" or TMA boxes: the same values into the same fragments, the rope's MMA from
    registers or shared memory). The same bits as the op's kernel on mixed lengths and splits."""
    from ops.mla_decode import _mla_decode_impl
    from tests.test_mla_decode import D, make_inputs
    import ops

    q, kv, table, seqlens = make_inputs(5, 1, 16, [4096, 0, 1, 700, 9000], page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    outs = [_mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, None,
                             tiling=dict(RS, chains=2, **kw), kv_format="fp8") for kw in ({}, extra)]
    assert not outs[0][0].isnan().any()
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("stale", [False, True])
def test_gpu_pace_changes_nothing_computed_and_leaves_its_counters(stale):
    """rs2's pace (tc_pace) only holds stages back: bitwise the outputs of pace=0 on unequal lengths (0, 1, long)
    in more CTAs than SMs (later CTAs join the counts as earlier ones leave), and the launch leaves its two
    counters as it found them. stale: counters left wrong (a started count so large that every CTA is "ahead" at
    every step): each step is held at most TC_PACE_WAIT_CYCLES, the launch ends with the same outputs."""
    from ops._workspace import arrival_counters
    from ops.mla_decode import _mla_decode_impl
    from tests.test_mla_decode import D, make_inputs
    import ops

    g = torch.Generator().manual_seed(7)
    lens = [0, 1, 64, 4096] + torch.randint(1, 3000, (296,), generator=g).tolist()
    q, kv, table, seqlens = make_inputs(len(lens), 1, 16, lens, page=64, device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    counters = arrival_counters(q.device, 2)
    outs = []
    for pace in (0, RS2_PACE):
        before = [0, 1 << 30] if stale and pace else [0, 0]
        counters[:2] = torch.tensor(before, dtype=torch.int32)
        outs.append(_mla_decode_impl(q, cache, table, seqlens, D ** -0.5, True, None,
                                     tiling=dict(RS, chains=2, pace=pace), kv_format="fp8"))
        assert counters[:2].tolist() == before, (pace, counters[:2].tolist())
    counters[:2] = 0
    assert not outs[0][0].isnan().any()
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])


@pytest.mark.gpu
def test_gpu_paced_kernel_in_a_cuda_graph():
    """The op's FP8 kernel (rs2 with its pace) captured in a CUDA graph: its counters are the eager stream's,
    shared (ops._workspace.arrival_counters under capture: no zero fill in the graph), the replay gives the eager
    call's bits on a new query, and every counter is back at 0 after both."""
    from ops._workspace import arrival_counters
    from tests.test_mla_decode import make_inputs
    import ops

    q, kv, table, lens = make_inputs(3, 1, 16, [5000, 1, 2000], device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv)
    sched = ops.get_mla_schedule(lens, 1, 16, max_blocks=table.shape[1], kv_format="fp8")
    ops.mla_decode(q, cache, table, lens, softmax_scale=0.05, sched=sched, kv_format="fp8")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = ops.mla_decode(q, cache, table, lens, softmax_scale=0.05, sched=sched, kv_format="fp8")
        counters = arrival_counters(q.device, 2)
    q.copy_(torch.randn_like(q) / 4)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    eager, eager_lse = ops.mla_decode(q, cache, table, lens, softmax_scale=0.05, sched=sched, kv_format="fp8")
    assert not out.isnan().any()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    assert counters[:2].tolist() == [0, 0] and arrival_counters(q.device, 2)[:2].tolist() == [0, 0]
