"""ops.mxfp4_w4a8_gemm_nt: e4m3 activations x MXFP4 weights through an e4m3 WGMMA (sm_90a), the weights prepared
once by ops.prepare_mxfp4_w4a8."""

import re

import pytest
import torch

import ops
from ops import gemm_w4a8
from ops.gemm_w4a8 import (EXACT_LOW, TABLE_ENTRIES, TABLE_LOW, dequant_w4a8, mxfp4_w4a8_masked_program,
                           mxfp4_w4a8_swapped_program, plan_w4a8, plan_w4a8_masked, prepare_mxfp4_w4a8, table_words,
                           w4a8_exact)


def calc_diff(x, y):
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def weights(n, k, g, lo=117, hi=130):
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scales


def activations(m, k, g):
    a = (torch.randn(m, k, generator=g) * 3).to(torch.float8_e4m3fn)
    sa = torch.rand(m, generator=g) + 0.5
    return a, sa


def test_table_holds_e2m1_times_two_to_the_d():
    """Entry d of the table is e2m1 magnitude x 2^d in e4m3, exactly for d >= EXACT_LOW (e4m3 subnormals reach
    2^-9), rounded to nearest below and 0 at the lowest entry."""
    words = table_words()
    assert len(words) == 2 * TABLE_ENTRIES
    vals = gemm_w4a8._table_values()
    e2m1 = torch.tensor(gemm_w4a8.E2M1_VALUES)
    for i in range(TABLE_ENTRIES):
        d = TABLE_LOW + i
        want = e2m1 * 2.0 ** d
        if d >= EXACT_LOW:
            assert torch.equal(vals[i], want), d
        else:
            assert torch.equal(vals[i], want.to(torch.float8_e4m3fn).float()), d
    assert (vals[0] == 0).all() and vals[-1, -1] == 384      # 6 x 2^6, the row's largest block


def _fragment_word(x, lo, hi):
    # the CUDA decode (tc_w4a8_word) in Python: prmt with a sign-free selector picks table bytes
    table = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]

    def prmt(sel):
        return sum(table[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))
    o0 = prmt(x & 0x7777) | (x & 0x80808080)
    o1 = prmt((x >> 16) & 0x7777) | ((x << 4) & 0x80808080 & 0xFFFFFFFF)
    return o0, o1


def test_layout_gives_each_thread_its_wgmma_fragment():
    """Emulating the kernel's decode on the prepared words: thread c of a quad, word j of its 16-byte chunk of a
    row's K step gives the e4m3 bytes of K 32j + 4c + t (first fragment word) and 32j + 16 + 4c + t (second), each
    equal to the original code's value x 2^(e8 - rowmax + 6) (signs included: -0 stays a zero)."""
    g = torch.Generator().manual_seed(3)
    n, k = 4, 256
    packed, scales = weights(n, k, g, lo=118, hi=128)
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    words = table_words()
    ref = ops.dequant_mxfp4(packed, scales)              # (n, k)
    by = codes.view(n, k // 128, 4, 4, 4).long()         # [row, step, c, j, byte]
    for row in range(n):
        for s in range(k // 128):
            for c in range(4):
                for j in range(4):
                    x = sum(int(by[row, s, c, j, i]) << (8 * i) for i in range(4))
                    e = int(offsets[row, (128 * s + 32 * j) // 32]) // 8
                    o0, o1 = _fragment_word(x, words[2 * e], words[2 * e + 1])
                    for w, base in ((o0, 32 * j + 4 * c), (o1, 32 * j + 16 + 4 * c)):
                        got = torch.tensor([(w >> (8 * t)) & 0xFF for t in range(4)], dtype=torch.uint8)
                        got = got.view(torch.float8_e4m3fn).float() * row_scale[row]
                        want = ref[row, 128 * s + base:128 * s + base + 4]
                        assert torch.equal(got, want), (row, s, c, j)


def test_prepare_in_row_chunks_is_the_same(monkeypatch):
    """prepare_mxfp4_w4a8 permutes the codes in chunks of PREPARE_ROWS rows (bounded temporaries on b's device):
    any chunking gives the same prepared weights, 2-D and grouped."""
    g = torch.Generator().manual_seed(8)
    packed, scales = weights(300, 512, g)
    whole = prepare_mxfp4_w4a8(packed, scales)
    monkeypatch.setattr(gemm_w4a8, "PREPARE_ROWS", 64)
    assert all(torch.equal(x, y) for x, y in zip(whole, prepare_mxfp4_w4a8(packed, scales)))
    grouped3 = prepare_mxfp4_w4a8(packed.view(3, 100, 256), scales.view(3, 100, 16))
    assert all(torch.equal(x.reshape(y.shape), y) for x, y in zip(grouped3, whole))


def test_prepared_weights_are_exact_within_14_binades():
    """dequant_w4a8 of the prepared weights equals dequant_mxfp4 bitwise when every block is within 14 binades of
    its row's largest (the subnormal 2^-127 block and a NaN block included); further below, the values are
    rounded to e4m3's subnormals, within 2^-10 of the row's unit 2^(rowmax - 133)."""
    g = torch.Generator().manual_seed(1)
    n, k = 6, 1024
    packed, scales = weights(n, k, g, lo=113, hi=128)
    scales[1, :] = 1
    scales[1, 3] = 0                 # 2^-127, the subnormal scale, one binade below the row's others
    assert w4a8_exact(scales)
    prepared = prepare_mxfp4_w4a8(packed, scales)
    assert torch.equal(dequant_w4a8(*prepared), ops.dequant_mxfp4(packed, scales))
    scales[2, 5] = 255               # NaN (OCP MX): the whole row is NaN in the prepared weights
    prepared = prepare_mxfp4_w4a8(packed, scales)
    assert dequant_w4a8(*prepared)[2].isnan().all() and not dequant_w4a8(*prepared)[3].isnan().any()
    scales[2, 5] = 120
    scales[4, 7] = 100               # 27 binades below the row's largest
    assert not w4a8_exact(scales)
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    got, want = dequant_w4a8(codes, offsets, row_scale), ops.dequant_mxfp4(packed, scales)
    assert torch.equal(got[:4], want[:4]) and torch.equal(got[5], want[5])
    assert float((got[4] - want[4]).abs().max()) <= 2.0 ** -10 * float(row_scale[4])


def test_cpu_op_is_the_fp32_product_and_matches_the_mxfp4_op():
    """On CPU tensors the op is (a x sa) @ W^T in fp32, rounded to bf16; against ops.mxfp4_gemm_nt on the dequantized activations
    it agrees to bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    m, n, k = 5, 256, 512
    packed, scales = weights(n, k, g)
    a, sa = activations(m, k, g)
    out = ops.mxfp4_w4a8_gemm_nt(a, sa, *prepare_mxfp4_w4a8(packed, scales))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    x, w = a.float() * sa[:, None], ops.dequant_mxfp4(packed, scales)
    want = x @ w.T
    # bf16 rounding, plus fp32 summation-order noise on the sum of |terms| (cancellation)
    assert ((out.float() - want).abs() <= 2 ** -8 * want.abs() + 2 ** -18 * (x.abs() @ w.abs().T)).all()
    other = ops.mxfp4_gemm_nt((a.float() * sa[:, None]).bfloat16(), packed, scales).float()
    assert calc_diff(out.float(), other) < 1e-4


def group_activations(m, k, g):
    """e4m3 activations with DeepGEMM's per-(token, 128 columns) fp32 scales, from per_token_group_quant_fp8."""
    return ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g) * 3)


def activations_and_product(m, k, g, group, packed, scales):
    """(a, sa, the fp32 product of the dequantized activations and weights): per-(token, 128) scales if group,
    else per-token ones."""
    a, sa = group_activations(m, k, g) if group else activations(m, k, g)
    x = ops.dequant_fp8_token_groups(a, sa) if group else a.float() * sa[:, None]
    return a, sa, x @ ops.dequant_mxfp4(packed, scales).T


def test_cpu_op_with_per_group_activation_scales():
    """sfa (m, k/128): each 128-column block of a row has its own scale (DeepGEMM's layout); the CPU op is the fp32
    product of the dequantized activations; a per-token sfa given as (m, k/128) of one repeated value is the
    per-token op to bf16 rounding."""
    g = torch.Generator().manual_seed(6)
    m, n, k = 4, 256, 1024
    packed, scales = weights(n, k, g)
    a, sfa = group_activations(m, k, g)
    assert sfa.shape == (m, k // 128)
    prep = prepare_mxfp4_w4a8(packed, scales)
    out = ops.mxfp4_w4a8_gemm_nt(a, sfa, *prep)
    x, w = ops.dequant_fp8_token_groups(a, sfa), ops.dequant_mxfp4(packed, scales)
    want = x @ w.T
    assert ((out.float() - want).abs() <= 2 ** -8 * want.abs() + 2 ** -18 * (x.abs() @ w.abs().T)).all()
    sa = torch.rand(m, generator=g) + 0.5
    torch.testing.assert_close(ops.mxfp4_w4a8_gemm_nt(a, sa[:, None].repeat(1, k // 128).contiguous(), *prep),
                               ops.mxfp4_w4a8_gemm_nt(a, sa, *prep), rtol=2 ** -7, atol=1e-5)
    with pytest.raises(ValueError, match="sfa must have shape"):
        ops.mxfp4_w4a8_gemm_nt(a, sfa[:, :3].contiguous(), *prep)


def test_group_scale_programs_promote_with_the_staged_factors(monkeypatch):
    """group_scales=True: the (token, step) factors come by TMA with the preloaded tiles and each step's product is
    added times its factor (FFMA in SASS), dense and masked; the plans leave room for them; no spills."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import SMEM_BUDGET
    from ops.gemm_w4a8 import w4a8_smem_bytes

    for m, n, k in ((1, 4096, 7168), (64, 7168, 2048), (64, 7168, 16384)):
        p = plan_w4a8(m, n, k, group_scales=True)
        assert p["group_scales"] and w4a8_smem_bytes(n, k, **p) <= SMEM_BUDGET
        src = mxfp4_w4a8_swapped_program.source("sm_90a", n=n, k=k, **p)
        assert "tl::tma_load(SA_desc" in src and re.search(r"\* \(\(float\*\)sas\)\[", src)
        stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
        assert stats.spill_stores == 0 and stats.histogram.get("FFMA", 0) >= 8
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=4096, k=7168, tokens=64, stages=7, group_scales=True)
    assert "tl::tma_load(SA_desc" in src
    assert sass_stats(build_cubin(src, "sm_90a"), "sm_90a").spill_stores == 0


def test_group_scale_rows_spread_a_quads_reads_over_the_banks():
    """The (token, step) factor tile's rows are padded so that the tokens a quad reads at once (2q, q = 0..3) sit
    in four different banks (unpadded, 16 steps at k = 2048 made every read a 4-way conflict): whole 16-byte TMA
    rows, never shorter than the steps; the masked kernel at k = 2048 reads its factors 20 words apart a token."""
    from ops.gemm_w4a8 import _bank_spread

    for words in range(4, 260, 4):
        row = _bank_spread(words)
        assert words <= row < words + 8 and row % 4 == 0
        assert len({2 * q * row % 32 // 1 for q in range(4)}) == 4, (words, row)
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=7168, k=2048, tokens=64, stages=6, group_scales=True)
    reads = re.findall(r"\(\(float\*\)sas\)\[[^\]]*\]", src)
    reads = [r for r in reads if "threadIdx" in r]      # (the TMA's destination is sas[0])
    # (int64 or int32 index math, as the simplifier can bound the loop's step)
    assert reads and all(re.search(r"\* (\(int64_t\))?20\)", r) and not re.search(r"\* (\(int64_t\))?16\)", r)
                         for r in reads)


def test_errors_name_the_argument():
    g = torch.Generator().manual_seed(4)
    packed, scales = weights(256, 512, g)
    a, sa = activations(3, 512, g)
    prep = prepare_mxfp4_w4a8(packed, scales)
    with pytest.raises(TypeError, match="a must have dtype"):
        ops.mxfp4_w4a8_gemm_nt(a.float(), sa, *prep)
    with pytest.raises(TypeError, match="sfa must have dtype"):
        ops.mxfp4_w4a8_gemm_nt(a, sa.double(), *prep)
    with pytest.raises(ValueError, match="sfa must have shape"):
        ops.mxfp4_w4a8_gemm_nt(a, sa[:2], *prep)
    with pytest.raises(ValueError, match="codes must have shape"):
        ops.mxfp4_w4a8_gemm_nt(a[:, :256].contiguous(), sa, *prep)
    with pytest.raises(ValueError, match="offsets must have shape"):
        ops.mxfp4_w4a8_gemm_nt(a, sa, prep[0], prep[1][:, :8].contiguous(), prep[2])
    with pytest.raises(ValueError, match="row_scale must have shape"):
        ops.mxfp4_w4a8_gemm_nt(a, sa, prep[0], prep[1], prep[2][:7])
    with pytest.raises(ValueError, match="k a multiple of 128"):
        ops.mxfp4_w4a8_gemm_nt(a[:, :200].contiguous(), sa, prep[0][:, :100].contiguous(), prep[1], prep[2])
    with pytest.raises(ValueError, match="sfb must have shape"):
        prepare_mxfp4_w4a8(packed, scales[:, :3])
    with pytest.raises(TypeError, match="b must have dtype"):
        prepare_mxfp4_w4a8(packed.int(), scales)


def test_dequant_w4a8_and_w4a8_exact_check_their_inputs():
    """dequant_w4a8 names a wrong dtype, shape, k or table offset (raw view / index errors, or a floored offset,
    before); w4a8_exact takes uint8 E8M0 scales (n, k/32) or grouped (g, n, k/32), a row being the last dimension
    (grouped scales were taken row-wise along n)."""
    g = torch.Generator().manual_seed(8)
    packed, scales = weights(16, 256, g)
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    with pytest.raises(TypeError, match="codes must have dtype uint8, got fp32"):
        dequant_w4a8(codes.float(), offsets, row_scale)
    with pytest.raises(ValueError, match="codes must have 2 dimensions"):
        dequant_w4a8(codes[None], offsets, row_scale)
    with pytest.raises(ValueError, match=r"codes must be \(n, k/2\) with k a multiple of 128"):
        dequant_w4a8(codes[:, :32].contiguous(), offsets[:, :2].contiguous(), row_scale)
    with pytest.raises(ValueError, match=r"offsets must have shape \(16, 8\)"):
        dequant_w4a8(codes, offsets[:, :4].contiguous(), row_scale)
    with pytest.raises(ValueError, match=r"row_scale must have shape \(16,\)"):
        dequant_w4a8(codes, offsets, row_scale[:3])
    with pytest.raises(TypeError, match="row_scale must have dtype fp32"):
        dequant_w4a8(codes, offsets, row_scale.double())
    for bad in (255, 3):
        with pytest.raises(ValueError, match=f"offsets must be prepare_mxfp4_w4a8's table offsets.*got {bad}"):
            dequant_w4a8(codes, torch.full_like(offsets, bad), row_scale)
    with pytest.raises(TypeError, match="sfb must have dtype uint8, got fp32"):
        w4a8_exact(scales.float())
    with pytest.raises(ValueError, match="sfb must have 2 or 3 dimensions"):
        w4a8_exact(scales[0])
    with pytest.raises(TypeError, match="sfb must be a torch.Tensor"):
        w4a8_exact(None)
    rows = torch.full((2, 3, 8), 127, dtype=torch.uint8)
    rows[0, 0] = 160                                   # every row's blocks alike: exact, whatever the other rows hold
    assert w4a8_exact(rows) and all(w4a8_exact(r) for r in rows)
    rows[1, 2, 5] = 100                                # 27 binades below its row's largest
    assert not w4a8_exact(rows) and w4a8_exact(rows[0]) and not w4a8_exact(rows[1])


def test_offsets_outside_the_table_are_refused():
    """The kernels index their e4m3 table by the offsets' bytes: a value prepare_mxfp4_w4a8 never writes (past the
    table, or not a multiple of 8) is refused by name, dense and grouped, before it reaches a kernel."""
    g = torch.Generator().manual_seed(6)
    packed, scales = weights(256, 512, g)
    a, sa = activations(3, 512, g)
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    for bad in (255, 8 * TABLE_ENTRIES, 4):
        off = offsets.clone()
        off[1, 2] = bad
        with pytest.raises(ValueError, match=f"offsets must be prepare_mxfp4_w4a8's table offsets.*got {bad}"):
            ops.mxfp4_w4a8_gemm_nt(a, sa, codes, off, row_scale)
        with pytest.raises(ValueError, match="offsets must be prepare_mxfp4_w4a8's table offsets"):
            ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(a[None], sa[None], codes[None], off[None], row_scale[None],
                                                     torch.tensor([3], dtype=torch.int32))


def test_offsets_are_read_once_until_written_in_place():
    """A tensor of offsets that passed is not read again (no device sync an eager call), but writing it in place
    (its version counter moves) brings the check back."""
    g = torch.Generator().manual_seed(7)
    packed, scales = weights(256, 512, g)
    a, sa = activations(3, 512, g)
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    ops.mxfp4_w4a8_gemm_nt(a, sa, codes, offsets, row_scale)
    assert offsets._tilecraft_checked == offsets._version
    offsets[1, 2] = 255
    with pytest.raises(ValueError, match="got 255"):
        ops.mxfp4_w4a8_gemm_nt(a, sa, codes, offsets, row_scale)
    with torch.inference_mode():              # no version counter: checked every call
        codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
        ops.mxfp4_w4a8_gemm_nt(a, sa, codes, offsets, row_scale)
        offsets[1, 2] = 255
        with pytest.raises(ValueError, match="got 255"):
            ops.mxfp4_w4a8_gemm_nt(a, sa, codes, offsets, row_scale)


def test_ops_have_fake_implementations():
    """Both GPU paths are torch custom ops whose fakes give the output's shape and dtype without running anything
    (torch.compile traces through them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ops.gemm_w4a8 import _w4a8_contiguous_op, _w4a8_masked_op, _w4a8_op

    u8, f32 = torch.uint8, torch.float32
    with FakeTensorMode():
        out = _w4a8_op(torch.empty(5, 512, dtype=torch.float8_e4m3fn), torch.empty(5, 4, dtype=f32),
                       torch.empty(256, 256, dtype=u8), torch.empty(256, 16, dtype=u8), torch.empty(256, dtype=f32))
        grouped = _w4a8_masked_op(torch.empty(3, 8, 512, dtype=torch.float8_e4m3fn), torch.empty(3, 8, dtype=f32),
                                  torch.empty(3, 256, 256, dtype=u8), torch.empty(3, 256, 16, dtype=u8),
                                  torch.empty(3, 256, dtype=f32), torch.empty(3, dtype=torch.int32))
        contiguous = _w4a8_contiguous_op(torch.empty(256, 512, dtype=torch.float8_e4m3fn), torch.empty(256, dtype=f32),
                                         torch.empty(3, 384, 256, dtype=u8), torch.empty(3, 384, 16, dtype=u8),
                                         torch.empty(3, 384, dtype=f32), torch.empty(256, dtype=torch.int32))
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16
    assert grouped.shape == (3, 8, 256) and grouped.dtype == torch.bfloat16
    assert contiguous.shape == (256, 384) and contiguous.dtype == torch.bfloat16


def test_program_lowers_to_e4m3_register_wgmma_with_promotion(monkeypatch):
    """sm_90a: the fragment goes from registers into e4m3 x e4m3 WGMMAs (QGMMA in SASS, k32 each, four a step),
    each step's product lands in a temporary that is added to the accumulator; no spills."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from backends.cuda.sass import build_cubin, sass_stats

    for m, n, k in ((1, 4096, 7168), (64, 7168, 2048)):
        p = plan_w4a8(m, n, k)
        src = mxfp4_w4a8_swapped_program.source("sm_90a", n=n, k=k, **p)
        assert "tl::wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32" in src
        assert src.count("tc_w4a8_fragment(") >= 4 and "tc_w4a8_table_fill(" in src
        assert re.search(r"\(v_\.x\+v__1\.x\)", src), "the promotion's adds"
        stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
        assert stats.histogram.get("QGMMA", 0) >= 8 and stats.spill_stores == 0 and stats.stack_bytes == 0
    assert plan_w4a8(64, 4096, 7168)["stages"] >= plan_w4a8(64, 4096, 7168)["stages"]


def test_wide_pair_plan(monkeypatch):
    """W4A8_PAIR_WIDE (the default): a 2-split plan over 16 tokens folds in a cluster pair (the received half
    partial, 128 x 32 fp32, taken from the stages where needed) instead of the reduce kernel; 4-split plans are left
    alone; False: the reduce kernel."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import SMEM_BUDGET
    from ops.gemm_w4a8 import w4a8_smem_bytes

    monkeypatch.setattr(gemm_w4a8, "W4A8_PAIR_WIDE", False)
    assert not plan_w4a8(64, 7168, 2048)["pair"]
    monkeypatch.setattr(gemm_w4a8, "W4A8_PAIR_WIDE", True)
    p = plan_w4a8(64, 7168, 2048)
    assert p["pair"] and not p["fold"] and p["splits"] == 2 and w4a8_smem_bytes(7168, 2048, **p) <= SMEM_BUDGET
    assert not plan_w4a8(64, 4096, 7168)["pair"]
    src = mxfp4_w4a8_swapped_program.source("sm_90a", n=7168, k=2048, **p)
    assert src.count("tc_cluster_store_f32(") >= 2
    assert sass_stats(build_cubin(src, "sm_90a"), "sm_90a").spill_stores == 0


def test_launchers_key_names_the_bf16_switches_the_plan_reads(monkeypatch):
    """plan_w4a8 leaves fold, pair and scale_tma to plan_swapped's rules where the W4A8 switches are None (the
    default), and those read ops.gemm_mxfp4's SWAPPED_FOLD / SWAPPED_PAIR / SWAPPED_SCALE_TMA: the launchers' key
    names them (and W4A8_CHAINS, W4A8_CHAINS_TOKENS), so flipping one (bench providers tilecraft-fold / -reduce / -pair) plans anew."""
    from ops import gemm_mxfp4

    keys = []

    def launchers(key, build):
        keys.append(key)
        raise StopIteration
    monkeypatch.setattr(gemm_w4a8.jit, "launchers", launchers)
    g = torch.Generator().manual_seed(3)
    a, sa = activations(16, 7168, g)
    packed, scales = weights(4096, 7168, g)
    prep = gemm_w4a8.prepare_mxfp4_w4a8(packed, scales)
    plans = []
    for module, flag, value in ((gemm_mxfp4, "SWAPPED_FOLD", None), (gemm_mxfp4, "SWAPPED_FOLD", False),
                                (gemm_mxfp4, "SWAPPED_PAIR", True), (gemm_mxfp4, "SWAPPED_SCALE_TMA", False),
                                (gemm_w4a8, "W4A8_CHAINS", False), (gemm_w4a8, "W4A8_CHAINS_TOKENS", 16)):
        monkeypatch.setattr(module, flag, value)
        with pytest.raises(StopIteration):
            gemm_w4a8._launch(a, sa, *prep, torch.empty(16, 4096, dtype=torch.bfloat16))
        plans.append(plan_w4a8(16, 4096, 7168))
    assert len(set(keys)) == len(keys) == 6
    assert plans[0]["fold"] and not plans[1]["fold"] and plans[2]["scale_tma"] != plans[3]["scale_tma"]


def grouped(G, max_m, n, k, g, masked):
    packed, scales = weights(G * n, k, g)
    a, sa = activations(G * max_m, k, g)
    a, sa = a.view(G, max_m, k), sa.view(G, max_m).contiguous()
    for gi, mm in enumerate(masked):
        a[gi, mm:] = float("nan")     # rows past masked_m are never read
        sa[gi, mm:] = float("nan")
    return a, sa, packed.view(G, n, k // 2), scales.view(G, n, k // 32), torch.tensor(masked, dtype=torch.int32)


def test_masked_grouped_cpu_equals_the_per_group_dense_op():
    """The masked grouped op on CPU: group i's first masked_m[i] rows are the dense op's on them, the rest zeros;
    grouped prepared weights are each group's own (row by row)."""
    g = torch.Generator().manual_seed(5)
    a, sa, packed, scales, masked = grouped(3, 5, 256, 512, g, [5, 0, 2])
    prep = prepare_mxfp4_w4a8(packed, scales)
    assert prep[0].shape == packed.shape and prep[1].shape == scales.shape and prep[2].shape == (3, 256)
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(a, sa, *prep, masked)
    assert out.shape == (3, 5, 256) and not out.isnan().any()
    for gi, mm in enumerate(masked.tolist()):
        one = prepare_mxfp4_w4a8(packed[gi], scales[gi])
        assert all(torch.equal(x, y[gi]) for x, y in zip(one, prep))
        assert torch.equal(out[gi, :mm], ops.mxfp4_w4a8_gemm_nt(a[gi, :mm], sa[gi, :mm].contiguous(), *one))
        assert (out[gi, mm:] == 0).all()
    with pytest.raises(ValueError, match="masked_m must be in"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(a, sa, *prep, torch.tensor([6, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="sfa must have shape"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(a, sa[:, :4].contiguous(), *prep, masked)


def contiguous(segments, n, k, g, group_scales=False):
    """MoE prefill rows: expert e's segments[e] rows padded to a multiple of 128 (ids -1, a and sa NaN there: never
    read into a live row's output), the weights of len(segments) experts."""
    G = len(segments)
    packed, scales = weights(G * n, k, g)
    ids = torch.cat([torch.cat([torch.full((rows,), e), torch.full((-rows % 128,), -1)])
                     for e, rows in enumerate(segments)]).int()
    a, sa = activations(ids.numel(), k, g)
    if group_scales:
        sa = torch.rand(ids.numel(), k // 128, generator=g) + 0.5
    a.view(torch.uint8)[ids < 0] = 0x7F            # e4m3fn NaN
    sa[ids < 0] = float("nan")
    return a, sa, packed.view(G, n, k // 2), scales.view(G, n, k // 32), ids


def test_contiguous_grouped_cpu_equals_the_per_expert_dense_op():
    """The contiguous grouped op on CPU: each expert's rows are the dense op's on them (any sfa layout), padding rows
    zeros; bad ids, row counts and scale shapes raise, naming the argument."""
    g = torch.Generator().manual_seed(7)
    for group_scales in (False, True):
        a, sa, packed, scales, ids = contiguous([130, 0, 64], 256, 512, g, group_scales)
        prep = prepare_mxfp4_w4a8(packed, scales)
        out = ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a, sa, *prep, ids)
        assert out.shape == (a.shape[0], 256) and not out.isnan().any()
        for e in range(3):
            rows = (ids == e).nonzero().flatten()
            one = prepare_mxfp4_w4a8(packed[e], scales[e])
            assert torch.equal(out[rows], ops.mxfp4_w4a8_gemm_nt(a[rows], sa[rows], *one))
        assert (out[ids < 0] == 0).all()
    bad = ids.clone()
    bad[3] = 3
    with pytest.raises(ValueError, match="m_indices must be in"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a, sa, *prep, bad)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a[:200], sa[:200], *prep, ids[:200])
    with pytest.raises(ValueError, match="sfa must have shape"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a, sa[:, :2].contiguous(), *prep, ids)
    with pytest.raises(ValueError, match="m_indices must have shape"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a, sa, *prep, ids[:128])
    with pytest.raises(TypeError, match="m_indices"):
        ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a, sa, *prep, ids.long())


def test_contiguous_program_lowers_to_128_token_register_wgmma():
    """The contiguous plan: 128-token tiles (e4m3 register WGMMA, N = 128) with one promotion temporary, the chunk's
    row ids and token scales by TMA with the table offsets, C staged as whole rows, no tail bursts (k / 128 a
    multiple of 8; elsewhere whole_bursts is refused); no spills at k = 7168."""
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_w4a8 import plan_w4a8_contiguous

    p = plan_w4a8_contiguous(7168)
    assert p["tokens"] == 128 and p["temps"] == 1 and p["stages"] >= 5 and p["burst"] == 8 and p["whole_bursts"]
    assert plan_w4a8_contiguous(7168, group_scales=True)["stages"] >= 4
    assert "temps" not in plan_w4a8_contiguous(2048, tokens=64)
    with pytest.raises(ValueError, match="token tile"):
        plan_w4a8_contiguous(2048, tokens=32)
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=4096, k=7168, **p)
    assert "tl::wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128" in src
    assert "tl::tma_load(MaskedM_desc" in src and "tl::tma_load(SA_desc" in src
    # whole bursts: 8 unrolled steps (a fragment decode each, plus the helper's definition), no tails of 1 .. 7
    assert src.count("tc_w4a8_fragment(") == 9
    with pytest.raises(ValueError, match="whole_bursts needs"):
        mxfp4_w4a8_masked_program.source("sm_90a", n=256, k=2560, **p)
    stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    assert stats.histogram.get("QGMMA", 0) >= 4 and stats.spill_stores == 0 and stats.stack_bytes == 0


def test_masked_whole_bursts_plan(monkeypatch):
    """W4A8_WHOLE_BURSTS (on): 64-token masked plans whose k / 128 is a multiple of the burst leave the tail bursts
    out (8 unrolled steps); other K and the shorter token tiles keep them; off, every plan keeps them."""
    from ops.gemm_w4a8 import plan_w4a8_contiguous

    p = plan_w4a8_masked(64, 2048, groups=8, n=7168)
    assert p["whole_bursts"] and p["tiles"] == 4
    assert "whole_bursts" not in plan_w4a8_masked(64, 2560) and "whole_bursts" not in plan_w4a8_masked(8, 7168)
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=7168, k=2048, **p)
    assert src.count("tc_w4a8_fragment(") == 9
    monkeypatch.setattr(gemm_w4a8, "W4A8_WHOLE_BURSTS", False)
    assert "whole_bursts" not in plan_w4a8_masked(64, 2048, groups=8, n=7168)
    assert "whole_bursts" not in plan_w4a8_contiguous(7168)





def test_masked_program_lowers_to_e4m3_register_wgmma():
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import plan_masked_swapped

    p = plan_masked_swapped(64, 7168, a_bytes=1)
    assert p["stages"] == 8 and p["tokens"] == 64
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=4096, k=7168, tokens=64, stages=p["stages"])
    assert "tl::wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in src
    stats = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    assert stats.histogram.get("QGMMA", 0) >= 4 and stats.spill_stores == 0


def test_masked_program_traces_only_when_asked():
    """mxfp4_w4a8_masked_program(trace=True) (bench.trace_mxfp4 --w4a8 --masked): a last Trace argument with the
    swapped kernel's stamps (entry, prologue, each step's events, loop done, stored); without it, no clock is read and
    the kernel has no Trace argument."""
    from ops.gemm_mxfp4 import SWAPPED_TRACE_WORDS

    p = plan_w4a8_masked(64, 2048)
    plain = mxfp4_w4a8_masked_program.source("sm_90a", n=256, k=2048, **p)
    traced = mxfp4_w4a8_masked_program.source("sm_90a", n=256, k=2048, trace=True, **p)
    assert "clock()" not in plain and "Trace" not in plain
    assert traced.count("= clock();") >= 4 + 4 and f"{SWAPPED_TRACE_WORDS})] = clock();" in traced


def test_masked_token_scales_by_tma_where_the_rows_allow(monkeypatch):
    """The masked kernel's per-token scales come by the producer's TMA (SA_desc, before the stages) where sfa's rows
    are 16-byte strided (max_m % 4 == 0) and per-token; otherwise, and with W4A8_MASKED_SA_TMA off, the epilogue
    loads them from global memory (an SA[...] read in the source, no SA descriptor)."""
    assert plan_w4a8_masked(64, 2048)["token_scales_tma"] and plan_w4a8_masked(8, 7168)["token_scales_tma"]
    assert not plan_w4a8_masked(33, 2048)["token_scales_tma"]
    assert not plan_w4a8_masked(64, 2048, group_scales=True)["token_scales_tma"]
    tma = mxfp4_w4a8_masked_program.source("sm_90a", n=256, k=2048, **plan_w4a8_masked(64, 2048))
    ldg = mxfp4_w4a8_masked_program.source("sm_90a", n=256, k=2048, **plan_w4a8_masked(33, 2048))
    assert "tma_load(SA_desc" in tma and "SA[" not in tma
    assert "SA_desc" not in ldg and "SA[" in ldg
    monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_SA_TMA", False)
    assert not plan_w4a8_masked(64, 2048)["token_scales_tma"]


def test_masked_tile_out_through_shared_memory_as_whole_rows(monkeypatch):
    """W4A8_MASKED_STAGED: the masked kernel's C tile is staged token-major in shared memory and stored as 16-byte
    vectors (uint4 stores to C, no 2-byte ones); off, one 2-byte store a value from the accumulator's layout."""
    from backends.cuda.sass import build_cubin, sass_stats

    p = plan_w4a8_masked(64, 2048)
    assert p["staged_out"] and p["stages"] == 8
    src = mxfp4_w4a8_masked_program.source("sm_90a", n=7168, k=2048, **p)
    assert "*(uint4*)(C + " in src and "staged" in src
    st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    assert st.histogram.get("STG", 0) == 4 and st.spill_stores == 0
    monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_STAGED", False)
    p = plan_w4a8_masked(64, 2048)
    assert not p["staged_out"]
    assert "uint4*)(C + " not in mxfp4_w4a8_masked_program.source("sm_90a", n=7168, k=2048, **p)


def test_masked_tiles_plan_and_build(monkeypatch):
    """W4A8_MASKED_TILES: the fewest n tiles a block (a divisor of n / 128) that put the masked grid in one wave, only
    where the grid would run more than two waves and the tiles' table offsets fit; the multi-tile kernel builds without
    spills and stores each tile as whole rows (4 vector stores a tile: 3 mid-loop tiles' in tile_done + the epilogue's
    4 tiles, the first 3 only for a group with no rows)."""
    from backends.cuda.sass import build_cubin, sass_stats

    assert plan_w4a8_masked(64, 2048, groups=8, n=7168)["tiles"] == 4          # 448 tiles (3.4 waves) -> 112 blocks
    assert plan_w4a8_masked(64, 7168, groups=8, n=4096)["tiles"] == 1          # 256 tiles: two waves, left alone
    assert plan_w4a8_masked(64, 7168, groups=12, n=4096)["tiles"] == 4         # 384 -> 96 (2 would be 192 > 132)
    assert plan_w4a8_masked(64, 2048, groups=2, n=7168)["tiles"] == 1          # 112 blocks: one wave already
    assert plan_w4a8_masked(64, 2048)["tiles"] == 1                            # no grid given
    p = plan_w4a8_masked(64, 2048, groups=8, n=7168)
    st = sass_stats(build_cubin(mxfp4_w4a8_masked_program.source("sm_90a", n=7168, k=2048, **p), "sm_90a"), "sm_90a")
    assert st.spill_stores == 0 and st.histogram.get("STG", 0) == 4 + 4 * 4 and st.histogram.get("QGMMA", 0) >= 4


def test_stage_out_plans_and_builds(monkeypatch):
    """W4A8_STAGE_OUT: by default (None) the split plans of 64-token tiles stage their result as whole rows -- the
    pair its half of C as 16-byte bf16 stores, the split its fp32 partial as 16-byte stores -- within the
    shared-memory budget, no spills; smaller tiles do not (True: all of them); a one-split plan is refused."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from backends.cuda.sass import build_cubin, sass_stats
    from ops.gemm_mxfp4 import SMEM_BUDGET
    from ops.gemm_w4a8 import w4a8_smem_bytes

    assert gemm_w4a8.W4A8_STAGE_OUT is None
    assert plan_w4a8(64, 7168, 2048)["stage_out"] and plan_w4a8(33, 4096, 7168)["stage_out"]
    assert "stage_out" not in plan_w4a8(16, 7168, 2048) and "stage_out" not in plan_w4a8(1, 4096, 7168)
    monkeypatch.setattr(gemm_w4a8, "W4A8_STAGE_OUT", True)
    assert plan_w4a8(16, 7168, 2048)["stage_out"]
    for (m, n, k), vector in (((64, 7168, 2048), "*(uint4*)(C + "), ((64, 4096, 7168), "*(float4*)(Part + ")):
        p = plan_w4a8(m, n, k)
        assert p["stage_out"] and w4a8_smem_bytes(n, k, **p) <= SMEM_BUDGET
        src = mxfp4_w4a8_swapped_program.source("sm_90a", n=n, k=k, **p)
        assert vector in src, (m, n, k)
        assert sass_stats(build_cubin(src, "sm_90a"), "sm_90a").spill_stores == 0
    with pytest.raises(ValueError, match="stage_out=True"):
        mxfp4_w4a8_swapped_program.source("sm_90a", n=256, k=1024, splits=1, stage_out=True)


def test_chains_plan_and_lower(monkeypatch):
    """W4A8_CHAINS (True): 64-row blocks whose two MMA warpgroups take alternate K steps, each promoting its own half
    of a (128, tokens) accumulator, where the 128-row plan splits K and the 64-row plan neither pairs nor folds
    (16-token tiles at 4096x7168 keep 128 rows; one-split 24576x1536 too, unless "any"). The kernel has each chain's steps (barriers of 128 arrivals), the group scales' factor
    read at the chain's own step, no spills and no serialized WGMMA; the epilogue adds the halves once; the switch
    is in the launchers' key; bad combinations are refused."""
    from backends.cuda.sass import wgmma_serialized
    from ops.gemm_mxfp4 import SMEM_BUDGET
    from ops.gemm_w4a8 import w4a8_smem_bytes
    from test_gemm_fp8 import _sass_and_ptxas_log

    assert gemm_w4a8.W4A8_CHAINS is True and plan_w4a8(64, 7168, 2048)["chains"] == 2
    assert "chains" not in plan_w4a8(16, 4096, 7168, chains="any")         # the 64-row plan pairs or folds
    assert "chains" not in plan_w4a8(64, 24576, 1536)                      # the 128-row plan has one split
    assert plan_w4a8(8, 7168, 2048).get("chains") == 2                    # 8-token tiles too (W4A8_CHAINS_TOKENS)
    assert "chains" not in plan_w4a8(1, 4096, 7168, chains="any")          # the 64-row plan folds
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS_TOKENS", 16)
    assert "chains" not in plan_w4a8(8, 7168, 2048, chains="any")
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS_TOKENS", 8)
    for m, n, k, splits, where in ((64, 7168, 2048, 1, True), (16, 7168, 2048, 1, True), (33, 4096, 7168, 2, True),
                                   (64, 24576, 1536, 1, "any")):
        p = plan_w4a8(m, n, k, chains=where)
        assert (p["block_n"], p["chains"], p["splits"]) == (64, 2, splits), (m, n, k)
        # 2 splits fold in a cluster pair (ops.gemm_mxfp4.SWAPPED_CHAINS_PAIR), never in the last block
        assert not p["fold"] and p["pair"] == (splits == 2) and "stage_out" not in p
        assert w4a8_smem_bytes(n, k, **p) <= SMEM_BUDGET
    assert "chains" not in plan_w4a8(64, 7168, 2048, chains=False)
    with pytest.raises(ValueError, match="chains must be one of"):
        plan_w4a8(64, 7168, 2048, chains="split")
    for m, n, k, group in ((64, 7168, 2048, False), (33, 4096, 7168, True)):
        p = plan_w4a8(m, n, k, group_scales=group)
        src = mxfp4_w4a8_swapped_program.source("sm_90a", n=n, k=k, **p)
        body = src.split('extern "C" __global__')[-1]
        assert body.count(".init(128);") == 2 * p["stages"] + 1, (m, n, k)
        assert "tl::__sync_thread_partial(11, 256);" in body
        assert "*(float4*)(Part + " not in body         # one split, or the pair: no partials in global memory
        assert body.count("tc_cluster_store_f32(") == (p["splits"] == 2)
        assert body.count("__cluster_barrier_wait();") == 2 * (p["splits"] == 2)   # both started; the exchange
        if group:       # promote step 2s + chain: the factor's column moves by 2 a step, plus the chain
            assert "(((int)threadIdx.x) >> 7)) + 2)]" in body
        sass, log = _sass_and_ptxas_log(src)
        assert "0 bytes spill stores, 0 bytes spill loads" in log and wgmma_serialized(log) == [], (m, n, k)
        assert sass.count("QGMMA") >= 4
    with pytest.raises(ValueError, match="block_n and chains must be"):
        mxfp4_w4a8_swapped_program.source("sm_90a", n=7168, k=2048, **{**p, "chains": 1})
    with pytest.raises(ValueError, match="block_n and chains must be"):
        mxfp4_w4a8_swapped_program.source("sm_90a", n=7168, k=2048, **{**p, "splits": 2, "fold": True, "pair": False})


# ---- GPU -------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (1, 7168, 2048), (16, 4096, 7168), (33, 384, 2048),
                                   (64, 4096, 7168), (64, 7168, 2048), (9, 24576, 1536), (5, 256, 512)])
def test_gpu_matches_the_fp32_product(m, n, k):
    """Against the fp32 product of the same e4m3 activations and prepared weights: calc_diff < 1e-5 and every
    element within bf16 rounding (promotion per 128-deep step keeps the sum fp32-accurate); the prepared weights
    are exact here, so it is also the product with dequant_mxfp4's weights. Split-K plans folded or reduced as
    planned; scale rows by TMA or by the MMA threads; repeated runs bitwise equal."""
    g = torch.Generator().manual_seed(m * 7 + n)
    packed, scales = weights(n, k, g)
    scales[0, :3] = torch.tensor([0, 1, 5], dtype=torch.uint8)    # the subnormal 2^-127 and neighbours: a row of
    scales[0, 3:] = torch.randint(0, 9, (k // 32 - 3,), generator=g, dtype=torch.uint8)   # tiny weights
    a, sa = activations(m, k, g)
    prep = prepare_mxfp4_w4a8(packed, scales)
    assert w4a8_exact(scales)
    ref = (a.float() * sa[:, None]) @ ops.dequant_mxfp4(packed, scales).T
    dev = [t.cuda() for t in (a, sa, *prep)]
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    again = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert torch.equal(out, again)
    out = out.float().cpu()
    assert not out.isnan().any()
    assert calc_diff(out, ref) < 1e-5
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,group", [(64, 7168, 2048, False), (16, 7168, 2048, False), (33, 4096, 7168, False),
                                         (40, 24576, 1536, False), (64, 384, 2048, False), (64, 4096, 7168, True),
                                         (13, 7168, 2048, True), (1, 7168, 2048, False), (8, 7168, 2048, True)])
def test_gpu_chains_match_the_fp32_product(m, n, k, group, monkeypatch):
    """W4A8_CHAINS "any" (64-row blocks in two K chains, one split or partials for the reduce kernel; 8-token tiles
    too): against the fp32 product (calc_diff < 1e-5, every element within bf16 rounding),
    per-token or per-group activation scales, m tails, tiny weight scales; repeated runs bitwise equal."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", "any")
    assert plan_w4a8(m, n, k, group_scales=group).get("chains") == 2
    g = torch.Generator().manual_seed(m * 5 + n)
    packed, scales = weights(n, k, g)
    scales[0, :3] = torch.tensor([0, 1, 5], dtype=torch.uint8)
    a, sa, ref = activations_and_product(m, k, g, group, packed, scales)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert torch.equal(out, ops.mxfp4_w4a8_gemm_nt(*dev))
    out = out.float().cpu()
    assert not out.isnan().any()
    assert calc_diff(out, ref) < 1e-5
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (16, 4096, 7168), (64, 7168, 2048), (33, 384, 2048),
                                   (9, 24576, 1536)])
def test_gpu_per_group_activation_scales(m, n, k):
    """sfa (m, k/128) from per_token_group_quant_fp8: against the fp32 product of the dequantized activations and
    the weights (calc_diff < 1e-5, elementwise to bf16), every split plan; repeated runs bitwise equal."""
    g = torch.Generator().manual_seed(m * 3 + n)
    packed, scales = weights(n, k, g)
    a, sfa = group_activations(m, k, g)
    ref = ops.dequant_fp8_token_groups(a, sfa) @ ops.dequant_mxfp4(packed, scales).T
    dev = [t.cuda() for t in (a, sfa, *prepare_mxfp4_w4a8(packed, scales))]
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert torch.equal(out, ops.mxfp4_w4a8_gemm_nt(*dev))
    out = out.float().cpu()
    assert calc_diff(out, ref) < 1e-5
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (50, 6144, 1024), (17, 256, 1024), (20, 8192, 1024)])
def test_gpu_wide_pair_is_the_reduce_bitwise(monkeypatch, m, n, k):
    """W4A8_PAIR_WIDE (the default): the pair adds the two scaled partials as the reduce kernel does (P0 + P1 ==
    P1 + P0 in fp32): the same bits as W4A8_PAIR_WIDE False."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    g = torch.Generator().manual_seed(m + k)
    packed, scales = weights(n, k, g)
    a, sa = activations(m, k, g)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    monkeypatch.setattr(gemm_w4a8, "W4A8_PAIR_WIDE", False)
    assert plan_w4a8(m, n, k)["splits"] == 2 and not plan_w4a8(m, n, k)["pair"]
    want = ops.mxfp4_w4a8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_w4a8, "W4A8_PAIR_WIDE", True)
    assert plan_w4a8(m, n, k)["pair"]
    assert torch.equal(ops.mxfp4_w4a8_gemm_nt(*dev), want)


@pytest.mark.gpu
@pytest.mark.parametrize("value,m,n,k,group", [(True, 64, 4096, 7168, False), (True, 33, 4096, 7168, True),
                                               (True, 17, 4096, 7168, False), (True, 40, 256, 1024, False),
                                               (True, 24, 512, 1024, True), ("all", 16, 4096, 7168, False),
                                               ("all", 1, 4096, 7168, True)])
def test_gpu_chains_pair_is_the_reduce_bitwise(monkeypatch, value, m, n, k, group):
    """Chained 2-split plans folding in a cluster pair (ops.gemm_mxfp4.SWAPPED_CHAINS_PAIR, the default): each block
    scales its halves' sums as the split's partial is scaled and adds the other block's, as the reduce kernel adds
    them: the same bits as the switch off (partials and the reduce kernel), per-token or per-group scales, m tails
    (one row of the second block's tokens at 17, none past 64 at 64), against the fp32 product too. "all": the
    chains' pair also at 1-16 tokens (the reference: the same chained plan with W4A8_FOLD off, which turns the
    64-row plan's pair and fold rules off, through the reduce kernel)."""
    from ops import gemm_mxfp4

    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_PAIR", value)
    p = plan_w4a8(m, n, k, group_scales=group)
    assert (p.get("chains"), p["splits"], p["pair"]) == (2, 2, True), p
    g = torch.Generator().manual_seed(m * 13 + n)
    packed, scales = weights(n, k, g)
    a, sa, ref = activations_and_product(m, k, g, group, packed, scales)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_PAIR", False)
    monkeypatch.setattr(gemm_w4a8, "W4A8_FOLD", False)
    q = plan_w4a8(m, n, k, group_scales=group)
    assert (q.get("chains"), q["splits"], q["pair"], q["fold"]) == (2, 2, False, False), q
    want = ops.mxfp4_w4a8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS_PAIR", value)
    monkeypatch.setattr(gemm_w4a8, "W4A8_FOLD", None)
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert torch.equal(out, want) and torch.equal(ops.mxfp4_w4a8_gemm_nt(*dev), want)
    out = out.float().cpu()
    assert calc_diff(out, ref) < 1e-5
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))


def test_long_bursts_at_64_tokens_plan_and_build(monkeypatch):
    """W4A8_BURST_64: 64-token tiles (dense and masked) drain the WGMMA pipeline every 8 steps instead of 4 -- the
    loop unrolls 8 steps (twice the QGMMAs between drains), no spills -- smaller tiles keep the default; several
    tiles a block take it only where k / 128 is a multiple of it (tiles end where bursts do)."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from backends.cuda.sass import build_cubin, disassemble, sass_stats

    assert gemm_w4a8.W4A8_BURST_64 == 8
    assert plan_w4a8(64, 7168, 2048)["burst"] == 8 and plan_w4a8(40, 4096, 7168)["burst"] == 8
    assert "burst" not in plan_w4a8(16, 4096, 7168) and "burst" not in plan_w4a8(1, 7168, 2048)
    assert plan_w4a8_masked(64, 2048, groups=8, n=7168)["burst"] == 8                   # 4 tiles, 16 steps each
    assert "burst" not in plan_w4a8_masked(64, 1536, groups=8, n=7168)                  # 4 tiles of 12 steps
    assert plan_w4a8_masked(64, 1536)["burst"] == 8                                    # one tile: any k
    assert "burst" not in plan_w4a8_masked(8, 2048)
    # (the masked plan with its tail bursts: whole_bursts needs a burst given)
    masked = {**plan_w4a8_masked(64, 2048, groups=8, n=7168), "whole_bursts": False}
    for prog, nk, p in ((mxfp4_w4a8_masked_program, dict(n=7168, k=2048), masked),
                        (mxfp4_w4a8_swapped_program, dict(n=7168, k=2048), plan_w4a8(64, 7168, 2048))):
        counts = {}
        for burst in (0, 8):
            cubin = build_cubin(prog.source("sm_90a", **nk, **{**p, "burst": burst}), "sm_90a")
            assert sass_stats(cubin, "sm_90a").spill_stores == 0
            counts[burst] = disassemble(cubin).count("QGMMA")
        assert counts == {0: 16, 8: 32}, counts
    monkeypatch.setattr(gemm_w4a8, "W4A8_BURST_64", None)
    assert "burst" not in plan_w4a8(64, 7168, 2048) and "burst" not in plan_w4a8_masked(64, 2048, groups=8, n=7168)
    with pytest.raises(ValueError, match="burst must be"):
        mxfp4_w4a8_swapped_program.source("sm_90a", n=256, k=1024, tokens=64, burst=17)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (64, 4096, 7168), (37, 1024, 5632)])
def test_gpu_long_bursts_give_the_same_bits(monkeypatch, m, n, k):
    """W4A8_BURST_64 (8 steps between the WGMMA pipeline's drains at 64 tokens) against the loop's default (4):
    the same bits on the pair, reduce and tail-burst plans (steps % 8 != 0)."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    g = torch.Generator().manual_seed(m * n + k)
    packed, scales = weights(n, k, g)
    a, sa = activations(m, k, g)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    assert plan_w4a8(m, n, k)["burst"] == 8
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_w4a8, "W4A8_BURST_64", None)
    assert not out.isnan().any() and torch.equal(ops.mxfp4_w4a8_gemm_nt(*dev), out)


@pytest.mark.gpu
@pytest.mark.parametrize("G,n,k", [(34, 1024, 2048), (5, 384, 7168)])
def test_gpu_masked_long_bursts_give_the_same_bits(monkeypatch, G, n, k):
    """The masked kernel with W4A8_BURST_64 (with several tiles a block, and one tile over a long K) against the
    default burst: the same bits, groups of 0, 1, partial and full rows."""
    g = torch.Generator().manual_seed(G + n + k + 8)
    max_m = 64
    masked = torch.randint(0, max_m + 1, (G,), generator=g)
    masked[:4] = torch.tensor([0, 1, max_m, 17])
    a, sa, packed, scales, mm = grouped(G, max_m, n, k, g, masked.tolist())
    args = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales), mm)]
    assert plan_w4a8_masked(max_m, k, groups=G, n=n)["burst"] == 8
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    monkeypatch.setattr(gemm_w4a8, "W4A8_BURST_64", None)
    assert not out.isnan().any() and out[2].abs().sum() > 0
    assert torch.equal(ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args), out)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 7168, 2048), (50, 6144, 1024), (64, 4096, 7168), (13, 4096, 7168),
                                   (1, 7168, 2048), (33, 384, 2048)])
def test_gpu_stage_out_gives_the_same_bits(monkeypatch, m, n, k):
    """W4A8_STAGE_OUT (the pair's half of C, or the split's partial, out through shared memory as whole rows): the
    same bits as the stores from the accumulator's layout, on pair, reduce and fold plans and odd token counts."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    g = torch.Generator().manual_seed(m + n + k)
    packed, scales = weights(n, k, g)
    a, sa = activations(m, k, g)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    monkeypatch.setattr(gemm_w4a8, "W4A8_STAGE_OUT", False)
    want = ops.mxfp4_w4a8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_w4a8, "W4A8_STAGE_OUT", True)
    assert bool(plan_w4a8(m, n, k).get("stage_out")) == (plan_w4a8(m, n, k)["splits"] > 1)
    got = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (13, 4096, 7168), (16, 1024, 5632), (7, 512, 8192)])
def test_gpu_fenceless_fold_is_the_reduce_and_empties_its_partials(monkeypatch, m, n, k):
    """The fold plans (4 splits and more, <= 16 tokens) of both swapped kernels, W4A8 and bf16, fold without fences:
    the reduce kernel's bits (W4A8_FOLD / SWAPPED_FOLD False), a NaN scale's row NaN and no other (a NaN partial
    is stored as a ready value: no wait for it), repeated calls equal, and every partials word READY_EMPTY again
    after the calls (ops._workspace.ready_partials: the next call finds them empty)."""
    monkeypatch.setattr(gemm_w4a8, "W4A8_CHAINS", False)    # the 128-row plans (the chains: their tests)
    from ops import _workspace, gemm_mxfp4

    monkeypatch.setattr(gemm_mxfp4, "WARP_TOKENS", 0)       # the bf16 op on its swapped kernel at every m
    # the bf16 op's 128-row plans: with SWAPPED_FOLD off its 64-row chains would take these shapes (another sum order)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_CHAINS", False)
    g = torch.Generator().manual_seed(m * 7 + k)
    packed, scales = weights(n, k, g)
    scales[5, 2] = 255
    a, sa = activations(m, k, g)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    p = plan_w4a8(m, n, k)
    assert p["fold"] and p["splits"] > 1
    def same(x, y):     # bitwise, NaN where NaN
        return torch.equal(x.view(torch.int16), y.view(torch.int16))

    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert same(ops.mxfp4_w4a8_gemm_nt(*dev), out)
    assert out[:, 5].isnan().all() and not out[:, :5].isnan().any() and not out[:, 6:].isnan().any()
    a16 = (a.float() * sa[:, None]).bfloat16().cuda()
    pk, sc = packed.cuda(), scales.cuda()
    assert gemm_mxfp4.plan_swapped(m, n, k)["fold"]
    out16 = ops.mxfp4_gemm_nt(a16, pk, sc)
    torch.cuda.synchronize()
    for buf in _workspace._READY.values():
        assert (buf.view(torch.int32) == gemm_mxfp4.READY_EMPTY).all()
    monkeypatch.setattr(gemm_w4a8, "W4A8_FOLD", False)
    monkeypatch.setattr(gemm_mxfp4, "SWAPPED_FOLD", False)
    assert same(ops.mxfp4_w4a8_gemm_nt(*dev), out)
    assert same(ops.mxfp4_gemm_nt(a16, pk, sc), out16)


@pytest.mark.gpu
def test_gpu_every_table_entry_is_the_prepared_value():
    """One-hot activations read single weights back: out[t, n] = W[n, k_t] exactly (one product, no sum), for
    blocks at every table entry (d from -13 to 6, rounded ones and the round-to-even tie 3 x 2^-10 included): the
    kernel's table (computed on the GPU) holds what dequant_w4a8 says."""
    g = torch.Generator().manual_seed(12)
    m, n, k = 64, 256, 1024
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = (130 - 6 + torch.randint(-15, 7, (n, k // 32), generator=g)).to(torch.uint8)
    scales[:, 0] = 130                        # each row's largest block: d = 6 there
    codes, offsets, row_scale = prepare_mxfp4_w4a8(packed, scales)
    assert not w4a8_exact(scales)
    cols = torch.randperm(k, generator=g)[:m]
    a = torch.zeros(m, k)
    a[torch.arange(m), cols] = 1.0
    out = ops.mxfp4_w4a8_gemm_nt(a.to(torch.float8_e4m3fn).cuda(), torch.ones(m).cuda(),
                                 codes.cuda(), offsets.cuda(), row_scale.cuda()).cpu()
    want = dequant_w4a8(codes, offsets, row_scale)[:, cols].T
    assert torch.equal(out, want.bfloat16())


@pytest.mark.gpu
def test_gpu_nan_rows_and_cuda_graphs():
    """A NaN scale makes its row's output NaN and no other; the op replays in a CUDA graph with the same bits."""
    g = torch.Generator().manual_seed(9)
    m, n, k = 3, 512, 1024
    packed, scales = weights(n, k, g)
    scales[7, 11] = 255
    a, sa = activations(m, k, g)
    dev = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales))]
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert out[:, 7].isnan().all() and not out[:, :7].isnan().any() and not out[:, 8:].isnan().any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = ops.mxfp4_w4a8_gemm_nt(*dev)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again[:, 8:], out[:, 8:])


@pytest.mark.gpu
@pytest.mark.parametrize("max_m,masked", [(64, [64, 0, 17, 1]), (8, [3, 8, 0, 5]), (33, [33, 32, 0, 9])])
def test_gpu_masked_grouped_matches_the_fp32_product(max_m, masked):
    """Each group's first masked_m rows against the fp32 product of its rows and prepared weights (calc_diff <
    1e-5, elementwise to bf16); the rest of the output zeros, with NaN in the rows past masked_m never read."""
    g = torch.Generator().manual_seed(max_m)
    G, n, k = len(masked), 256, 2048
    a, sa, packed, scales, mm = grouped(G, max_m, n, k, g, masked)
    prep = prepare_mxfp4_w4a8(packed, scales)
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*[t.cuda() for t in (a, sa, *prep, mm)]).float().cpu()
    assert not out.isnan().any()
    w = ops.dequant_mxfp4(packed.view(G * n, k // 2), scales.view(G * n, k // 32)).view(G, n, k)
    for gi, rows in enumerate(masked):
        ref = (a[gi, :rows].float() * sa[gi, :rows, None]) @ w[gi].T
        if rows:
            assert calc_diff(out[gi, :rows], ref) < 1e-5
            torch.testing.assert_close(out[gi, :rows], ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))
        assert (out[gi, rows:] == 0).all()


@pytest.mark.gpu
def test_gpu_masked_epilogue_options_give_the_same_bits(monkeypatch):
    """W4A8_MASKED_SA_TMA (the token scales by TMA ahead of the stages) and W4A8_MASKED_STAGED (C's tile out through
    shared memory as whole rows), each on and off: the same bits; NaN scales in the rows past masked_m never reach the
    output."""
    g = torch.Generator().manual_seed(46)
    G, max_m, n, k, masked = 4, 64, 256, 2048, [64, 0, 17, 1]
    a, sa, packed, scales, mm = grouped(G, max_m, n, k, g, masked)
    for gi, rows in enumerate(masked):
        sa[gi, rows:] = float("nan")
    args = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales), mm)]
    p = plan_w4a8_masked(max_m, k)
    assert p["token_scales_tma"] and p["staged_out"]
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    assert not out.isnan().any() and out[0].abs().sum() > 0
    for sa_tma, staged in ((False, True), (True, False), (False, False)):
        monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_SA_TMA", sa_tma)
        monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_STAGED", staged)
        assert torch.equal(ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args), out), (sa_tma, staged)


@pytest.mark.gpu
@pytest.mark.parametrize("G,n,k,tiles", [(80, 512, 512, 4), (45, 768, 512, 3), (34, 1024, 2048, 4)])
def test_gpu_masked_tiles_give_the_same_bits(monkeypatch, G, n, k, tiles):
    """W4A8_MASKED_TILES (several n tiles a block, each stored after its last step while the next streams): the same
    bits as one tile a block, with groups of 0, 1, partial and full rows (a group with no rows: every tile zeros)."""
    g = torch.Generator().manual_seed(G + n + k)
    max_m = 64
    masked = torch.randint(0, max_m + 1, (G,), generator=g)
    masked[:4] = torch.tensor([0, 1, max_m, 17])
    a, sa, packed, scales, mm = grouped(G, max_m, n, k, g, masked.tolist())
    args = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales), mm)]
    monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_TILES", False)
    one = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    monkeypatch.setattr(gemm_w4a8, "W4A8_MASKED_TILES", True)
    assert plan_w4a8_masked(max_m, k, groups=G, n=n)["tiles"] == tiles
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    assert not out.isnan().any() and out[2].abs().sum() > 0
    assert torch.equal(out, one)
    assert (out[0] == 0).all()


@pytest.mark.gpu
def test_gpu_masked_grouped_per_group_activation_scales():
    """The masked op with sfa (g, max_m, k/128): each group's rows against the fp32 product of its dequantized
    activations; rows past masked_m zeros."""
    g = torch.Generator().manual_seed(11)
    G, max_m, n, k, masked = 3, 40, 256, 2048, [40, 0, 7]
    packed, scales = weights(G * n, k, g)
    a, sfa = group_activations(G * max_m, k, g)
    a, sfa = a.view(G, max_m, k), sfa.view(G, max_m, k // 128)
    mm = torch.tensor(masked, dtype=torch.int32)
    prep = prepare_mxfp4_w4a8(packed.view(G, n, k // 2), scales.view(G, n, k // 32))
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*[t.cuda() for t in (a, sfa, *prep, mm)]).float().cpu()
    w = ops.dequant_mxfp4(packed, scales).view(G, n, k)
    for gi, rows in enumerate(masked):
        if rows:
            ref = ops.dequant_fp8_token_groups(a[gi, :rows], sfa[gi, :rows]) @ w[gi].T
            assert calc_diff(out[gi, :rows], ref) < 1e-5
            torch.testing.assert_close(out[gi, :rows], ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))
        assert (out[gi, rows:] == 0).all()


def test_ready_partials_start_empty_and_are_kept():
    """ops._workspace.ready_partials: every word READY_EMPTY, one buffer per device and stream, views of it for
    smaller calls, a larger call gets a new one and the old one is kept (a captured graph may point there)."""
    from ops import _workspace
    from ops.gemm_mxfp4 import READY_EMPTY

    cpu = torch.device("cpu")
    _workspace._READY.pop((cpu, 0), None)
    p = _workspace.ready_partials(cpu, 4, 3, 4096)
    assert p.shape == (4, 3, 4096) and p.dtype == torch.float32
    assert (p.view(torch.int32) == READY_EMPTY).all() and p.isnan().all()
    q = _workspace.ready_partials(cpu, 2, 1, 128)
    assert q.data_ptr() == p.data_ptr()
    kept = len(_workspace._READY_KEPT)
    big = _workspace.ready_partials(cpu, 8, 16, 7168)
    assert big.data_ptr() != p.data_ptr() and len(_workspace._READY_KEPT) == kept + 1
    assert (big.view(torch.int32) == READY_EMPTY).all()


def test_ncu_w4a8_flags_parse_and_refuse_unknown_switches():
    """The ncu drivers' NAME=VALUE switches (bench.ncu_call.switch): None / True / False / ints parsed, an unknown
    name refused by name."""
    from bench.ncu_call import switch

    assert switch(gemm_w4a8, "W4A8_BURST_64=None") == ("W4A8_BURST_64", None)
    assert switch(gemm_w4a8, "W4A8_BURST_64=4") == ("W4A8_BURST_64", 4)
    assert switch(gemm_w4a8, "W4A8_MASKED_TILES=False") == ("W4A8_MASKED_TILES", False)
    with pytest.raises(SystemExit, match="no switch 'NOPE'"):
        switch(gemm_w4a8, "NOPE=1")


@pytest.mark.gpu
@pytest.mark.parametrize("segments,n,k", [([130, 0, 64, 300], 256, 2048), ([256, 17], 384, 7168)])
@pytest.mark.parametrize("group_scales", [False, True])
def test_gpu_contiguous_grouped_matches_the_fp32_product(monkeypatch, segments, n, k, group_scales):
    """The contiguous W4A8 kernel: each expert's rows against the fp32 product of its rows and prepared weights
    (calc_diff < 1e-5, elementwise to bf16), padding rows zeros with NaN in their a and sa never read into a live
    row; 128- and 64-token tiles (one and two promotion temporaries) give the same bits; empty experts and an expert
    whose segment ends in padding mid-tile included."""
    g = torch.Generator().manual_seed(n + k + group_scales)
    a, sa, packed, scales, ids = contiguous(segments, n, k, g, group_scales)
    prep = prepare_mxfp4_w4a8(packed, scales)
    args = [t.cuda() for t in (a, sa, *prep, ids)]
    out = ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(*args)
    got = out.float().cpu()
    assert not got.isnan().any() and (got[ids < 0] == 0).all()
    G = len(segments)
    w = ops.dequant_mxfp4(packed.view(G * n, k // 2), scales.view(G * n, k // 32)).view(G, n, k)
    scale = sa[:, :, None].expand(-1, -1, 128).reshape(sa.shape[0], k) if group_scales else sa[:, None]
    for e in range(G):
        rows = (ids == e).nonzero().flatten()
        if rows.numel():
            ref = (a[rows].float() * scale[rows]) @ w[e].T
            assert calc_diff(got[rows], ref) < 1e-5
            torch.testing.assert_close(got[rows], ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))
    monkeypatch.setattr(gemm_w4a8, "W4A8_CONTIGUOUS_TILE", 64)
    assert torch.equal(ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(*args), out)


@pytest.mark.gpu
def test_gpu_contiguous_grouped_in_a_cuda_graph():
    """The contiguous op replays in a CUDA graph with the same bits, ids and activations changed between replays
    read anew (nothing about the segments is planned on the host)."""
    g = torch.Generator().manual_seed(31)
    a, sa, packed, scales, ids = contiguous([200, 56], 256, 2048, g)
    args = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales), ids)]
    want = ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, want)
    flipped = torch.where(args[-1] >= 0, 1 - args[-1], args[-1])      # the two experts swapped
    args[-1].copy_(flipped)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(*args))
    assert not torch.equal(again, want)


@pytest.mark.gpu
@pytest.mark.parametrize("G,n,k", [(8, 7168, 2048), (3, 512, 7168)])
def test_gpu_masked_whole_bursts_give_the_same_bits(monkeypatch, G, n, k):
    """W4A8_WHOLE_BURSTS (on: the masked loop built without its tail bursts, which never run): the same bits as the
    loop with them, with several tiles a block (8 groups at n = 7168) and one (k = 7168), groups of 0, 1, partial
    and full rows."""
    g = torch.Generator().manual_seed(G * n + k)
    max_m = 64
    masked = [0, 1, max_m, 17] + [max_m] * (G - 4) if G > 4 else [0, 1, max_m][:G]
    a, sa, packed, scales, mm = grouped(G, max_m, n, k, g, masked)
    args = [t.cuda() for t in (a, sa, *prepare_mxfp4_w4a8(packed, scales), mm)]
    assert plan_w4a8_masked(max_m, k, groups=G, n=n).get("whole_bursts")
    got = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    monkeypatch.setattr(gemm_w4a8, "W4A8_WHOLE_BURSTS", False)
    assert not plan_w4a8_masked(max_m, k, groups=G, n=n).get("whole_bursts")
    want = ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(*args)
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 200])
def test_gpu_dense_prefill_is_the_contiguous_op(monkeypatch, m):
    """W4A8_DENSE_PREFILL (on): m > 64 runs the contiguous kernel as one expert (rows padded to 128 where needed):
    the contiguous op's bits on the same rows, near the fp32 product; off, m > 64 is refused."""
    g = torch.Generator().manual_seed(m)
    n, k = 256, 2048
    packed, scales = weights(n, k, g)
    a, sa = activations(m, k, g)
    prep = prepare_mxfp4_w4a8(packed, scales)
    dev = [t.cuda() for t in (a, sa, *prep)]
    assert gemm_w4a8.W4A8_DENSE_PREFILL
    monkeypatch.setattr(gemm_w4a8, "W4A8_DENSE_PREFILL", False)
    with pytest.raises(ValueError, match="decode-sized"):
        ops.mxfp4_w4a8_gemm_nt(*dev)
    monkeypatch.setattr(gemm_w4a8, "W4A8_DENSE_PREFILL", True)
    out = ops.mxfp4_w4a8_gemm_nt(*dev)
    assert out.shape == (m, n) and not out.isnan().any()
    rows = -(-m // 128) * 128
    a_pad = torch.cat([dev[0], torch.zeros(rows - m, k, device="cuda").to(torch.float8_e4m3fn)])
    sa_pad = torch.cat([dev[1], torch.ones(rows - m, device="cuda")])
    ids = torch.tensor([0] * m + [-1] * (rows - m), dtype=torch.int32, device="cuda")
    want = ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a_pad, sa_pad, *(t[None] for t in dev[2:]), ids)[:m]
    assert torch.equal(out, want)
    ref = (a.float() * sa[:, None]) @ ops.dequant_mxfp4(packed, scales).T
    assert calc_diff(out.float().cpu(), ref) < 1e-5
