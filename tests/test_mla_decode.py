"""ops.mla_decode: FlashMLA's interface and thresholds, one tile program for every GPU target."""

import importlib
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ops
from ops.mla_decode import FP8_FOLD, get_mla_schedule, mla_combine_program, mla_decode_program, mla_decode_reference, pick_tiling

D, DV = 576, 512


def make_inputs(b, s_q, h_q, seqlens, page=64, dtype=torch.bfloat16, device="cpu", seed=0, extra_blocks=2):
    """A paged cache whose unused tails, unused pages and unused table slots are all NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor(seqlens, dtype=torch.int32)
    max_blocks = max(1, int(math.ceil(max(int(seqlens.max()), 1) / page))) + extra_blocks
    used = [int(math.ceil(int(n) / page)) for n in seqlens]
    total_pages = sum(used) + 3
    nan_page = total_pages - 1
    kv = torch.randn(total_pages, page, 1, D, generator=g).to(dtype)
    perm = torch.randperm(total_pages - 3, generator=g)
    table = torch.full((b, max_blocks), nan_page, dtype=torch.int32)
    at = 0
    for i, n in enumerate(used):
        table[i, :n] = perm[at:at + n].to(torch.int32)
        # poison the tail of the last page beyond the sequence
        if n:
            tail = int(seqlens[i]) - (n - 1) * page
            kv[table[i, n - 1], tail:] = float("nan")
        at += n
    kv[total_pages - 3:] = float("nan")
    q = (torch.randn(b, s_q, h_q, D, generator=g) / 4).to(dtype)
    return q.to(device), kv.to(device), table.to(device), seqlens.to(device)


def naive64(q, kv, table, seqlens, scale, causal):
    """Row by row in float64: an independent check of the reference."""
    b, s_q, h_q, _ = q.shape
    page = kv.shape[1]
    out = torch.zeros(b, s_q, h_q, DV, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), float("-inf"), dtype=torch.float64)
    for i in range(b):
        n = int(seqlens[i])
        toks = torch.stack([kv[table[i, t // page], t % page, 0] for t in range(n)]).double() if n else None
        for s in range(s_q):
            visible = n - s_q + s + 1 if causal else n
            visible = max(0, min(n, visible))
            if visible == 0:
                continue
            for h in range(h_q):
                sc = toks[:visible] @ q[i, s, h].double() * scale
                lse[i, h, s] = torch.logsumexp(sc, 0)
                out[i, s, h] = torch.softmax(sc, 0) @ toks[:visible, :DV]
    return out, lse


# ---- CPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_naive_float64(causal):
    q, kv, table, lens = make_inputs(3, 2, 4, [70, 0, 1], page=16, dtype=torch.float32)
    out, lse = mla_decode_reference(q.double(), kv.double(), table, lens, softmax_scale=D ** -0.5, causal=causal)
    n_out, n_lse = naive64(q, kv, table, lens, D ** -0.5, causal)
    torch.testing.assert_close(out, n_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, n_lse, atol=1e-10, rtol=1e-10)


def test_cpu_op_runs_the_reference():
    q, kv, table, lens = make_inputs(2, 1, 16, [130, 5])
    out, lse = ops.mla_decode(q, kv, table, lens, 512, softmax_scale=D ** -0.5, causal=True)
    ref, ref_lse = mla_decode_reference(q, kv, table, lens, softmax_scale=D ** -0.5, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 16, 512) and lse.shape == (2, 16, 1)
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float())
    torch.testing.assert_close(lse, ref_lse)


def test_zero_length_sequences_give_zeros_and_minus_inf():
    q, kv, table, lens = make_inputs(2, 1, 8, [0, 3])
    out, lse = ops.mla_decode(q, kv, table, lens, softmax_scale=0.1)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert not out.isnan().any()


def test_invalid_inputs_name_the_argument():
    q, kv, table, lens = make_inputs(2, 1, 16, [10, 20])
    kw = dict(softmax_scale=0.1)
    cases = [
        ((q[..., :512].contiguous(), kv, table, lens), ValueError, "q's last dimension must be 576"),
        ((torch.zeros(2, 1, 129, D, dtype=torch.bfloat16), kv, table, lens), ValueError, r"h_q must be in \[1, 128\]"),
        ((torch.zeros(2, 9, 16, D, dtype=torch.bfloat16), kv, table, lens), ValueError, r"s_q must be in \[1, 8\]"),
        ((q.float(), kv, table, lens), TypeError, "q must have dtype bf16 or fp16, got fp32"),
        ((q, kv.half(), table, lens), TypeError, "kv_cache must have dtype bf16, got fp16"),
        ((q, kv[:, :48].contiguous(), table, lens), ValueError, "page size must be one of"),
        ((q, kv, table[:1], lens), ValueError, "block_table must have 2 rows"),
        ((q, kv, table.long(), lens), TypeError, "block_table must have dtype int32"),
        ((q, kv, table, lens[:1]), ValueError, r"cache_seqlens must have shape \(2,\)"),
        ((q, kv, table, lens.long()), TypeError, "cache_seqlens must have dtype int32"),
        ((torch.cat([q, q], -1)[..., :D], kv, table, lens), ValueError, "q must be contiguous"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            ops.mla_decode(*args, **kw)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        ops.mla_decode(q, kv, table, lens, 256, **kw)
    with pytest.raises(ValueError, match="softmax_scale must be >= 1e-12"):
        ops.mla_decode(q, kv, table, lens, softmax_scale=0.0)
    with pytest.raises(ValueError, match="kv_format must be"):
        ops.mla_decode(q, kv, table, lens, softmax_scale=0.1, kv_format="int4")


def test_schedule_and_scalars_are_checked():
    """get_mla_schedule's scalars are ints in range (s_q, h_q as the op's), batch_invariant a bool; the op's
    sched must be an MlaSchedule; a non-finite softmax_scale is refused (it gave zeros and a NaN lse); the FP8
    cache helpers take at least one dimension."""
    lens = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(TypeError, match="s_q must be an int, got str"):
        get_mla_schedule(lens, "1", 16, 4)
    with pytest.raises(ValueError, match=r"s_q must be in \[1, 8\], got 0"):
        get_mla_schedule(lens, 0, 16, 4)
    with pytest.raises(ValueError, match=r"h_q must be in \[1, 128\], got -4"):
        get_mla_schedule(lens, 1, -4, 4)
    with pytest.raises(TypeError, match="max_blocks must be an int, got float"):
        get_mla_schedule(lens, 1, 16, 2.7)
    with pytest.raises(ValueError, match="max_blocks must be >= 0, got -5"):
        get_mla_schedule(lens, 1, 16, -5)
    with pytest.raises(ValueError, match="num_sms must be >= 1, got 0"):
        get_mla_schedule(lens, 1, 16, 4, num_sms=0)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        get_mla_schedule(lens, 1, 16, 4, batch_invariant="no")
    q, kv, table, lens = make_inputs(2, 1, 16, [10, 20])
    with pytest.raises(TypeError, match="sched must be an MlaSchedule"):
        ops.mla_decode(q, kv, table, lens, softmax_scale=0.1, sched="garbage")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
            ops.mla_decode(q, kv, table, lens, softmax_scale=bad)
    with pytest.raises(ValueError, match="kv's last dimension must be 576"):
        ops.quantize_mla_kv_fp8(torch.zeros((), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cache's last dimension must be 656"):
        ops.dequantize_mla_kv_fp8(torch.zeros((), dtype=torch.uint8))


def test_out_of_range_values_are_caught():
    q, kv, table, lens = make_inputs(2, 1, 16, [10, 20])
    bad = table.clone()
    bad[1, 0] = kv.shape[0]
    with pytest.raises(ValueError, match=r"block_table entries used by cache_seqlens must be in \[0, "):
        ops.mla_decode(q, kv, bad, lens, softmax_scale=0.1)
    too_long = torch.tensor([10, table.shape[1] * 64 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens must be in"):
        ops.mla_decode(q, kv, table, too_long, softmax_scale=0.1)


def _small_reference_inputs(dtype=torch.float64):
    """d = 40, head_dim_v 24, pages of 5 tokens: shapes no kernel takes, which the reference must."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 2, 3, 40, dtype=dtype, generator=g)
    kv = torch.randn(6, 5, 1, 40, dtype=dtype, generator=g)
    table = torch.tensor([[4, 1, 2], [0, 5, 5]], dtype=torch.int32)
    lens = torch.tensor([12, 0], dtype=torch.int32)
    return q, kv, table, lens


def _bad_reference_args(name, value):
    q, kv, table, lens = _small_reference_inputs()
    args = dict(q=q, kv_cache=kv, block_table=table, cache_seqlens=lens, head_dim_v=24, softmax_scale=0.1, causal=True)
    args[name] = value(args) if callable(value) else value
    return args


@pytest.mark.parametrize("name,value,exc,msg", [
    ("q", lambda a: a["q"].numpy(), TypeError, "q must be a torch.Tensor, got ndarray"),
    ("q", lambda a: a["q"].int(), TypeError, "q must have dtype fp16 or bf16 or fp32 or fp64, got int32"),
    ("q", lambda a: a["q"][0], ValueError, r"q must have 4 dimensions, got shape \(2, 3, 40\)"),
    ("q", lambda a: a["q"][..., :0], ValueError, "q's last dimension \\(head_dim\\) must be at least 1"),
    ("kv_cache", lambda a: a["kv_cache"].to(torch.uint8), TypeError, "kv_cache must have dtype fp16 or bf16 or fp32 or fp64, got uint8"),
    ("kv_cache", lambda a: a["kv_cache"][:, :, 0], ValueError, "kv_cache must have 4 dimensions"),
    ("kv_cache", lambda a: a["kv_cache"][..., :32], ValueError,
     r"kv_cache must have shape \(num_blocks, page_size >= 1, 1, 40\) \(q's head_dim\), got \(6, 5, 1, 32\)"),
    ("kv_cache", lambda a: a["kv_cache"].expand(6, 5, 2, 40), ValueError, r"kv_cache must have shape .*, got \(6, 5, 2, 40\)"),
    ("kv_cache", lambda a: a["kv_cache"][:, :0], ValueError, r"kv_cache must have shape .*, got \(6, 0, 1, 40\)"),
    ("block_table", lambda a: a["block_table"].float(), TypeError, "block_table must have dtype int32 or int64, got fp32"),
    ("block_table", lambda a: a["block_table"][0], ValueError, "block_table must have 2 dimensions"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, r"block_table must have 2 rows \(q's batch\)"),
    ("cache_seqlens", [12, 0], TypeError, "cache_seqlens must be a torch.Tensor, got list"),
    ("cache_seqlens", lambda a: a["cache_seqlens"].double(), TypeError, "cache_seqlens must have dtype int32 or int64, got fp64"),
    ("cache_seqlens", lambda a: a["cache_seqlens"][:1], ValueError, r"cache_seqlens must have shape \(2,\) \(\(batch,\)\)"),
    ("cache_seqlens", lambda a: a["cache_seqlens"].to("meta"), ValueError, "tensors must be on one device, got .*cache_seqlens on meta"),
    ("head_dim_v", 41, ValueError, r"head_dim_v must be in \[1, 40\], got 41"),
    ("head_dim_v", 0, ValueError, r"head_dim_v must be in \[1, 40\], got 0"),
    ("head_dim_v", 24.0, TypeError, "head_dim_v must be an int, got float"),
    ("softmax_scale", 0.0, ValueError, "softmax_scale must be > 0, got 0.0"),
    ("softmax_scale", -0.1, ValueError, "softmax_scale must be > 0, got -0.1"),
    ("softmax_scale", float("nan"), ValueError, "softmax_scale must be a finite number"),
    ("softmax_scale", None, TypeError, "softmax_scale must be a number, got NoneType"),
    ("causal", 1, TypeError, "causal must be a bool, got int"),
    # values: a length past the table's capacity (3 blocks x 5), a negative one, used table entries out of [0, 6)
    ("cache_seqlens", torch.tensor([16, 0], dtype=torch.int32), ValueError,
     r"cache_seqlens must be in \[0, 15\] \(block_table's 3 blocks x page 5\), got 16 at index 0 \(1 such\)"),
    ("cache_seqlens", torch.tensor([12, -1], dtype=torch.int32), ValueError, r"cache_seqlens must be in \[0, 15\].*got -1 at index 1"),
    ("block_table", torch.tensor([[4, -1, 2], [0, 5, 5]], dtype=torch.int32), ValueError,
     r"block_table entries used by cache_seqlens must be in \[0, 6\) \(kv_cache's blocks\), got -1 at index \(0, 1\)"),
    ("block_table", torch.tensor([[4, 1, 6], [0, 5, 5]], dtype=torch.int64), ValueError,
     r"block_table entries used by cache_seqlens must be in \[0, 6\).*got 6 at index \(0, 2\) \(1 such\)"),
])
def test_reference_refuses_bad_inputs(name, value, exc, msg):
    with pytest.raises(exc, match=msg):
        mla_decode_reference(**_bad_reference_args(name, value))


def test_reference_takes_any_float_dtype_head_dim_page_and_strides():
    """The oracle is more permissive than the op: fp64 (and mixed) dtypes, any d and head_dim_v <= d, any page
    size, int64 table and lengths, strided views; table entries past a sequence's blocks are never read."""
    q, kv, table, lens = _small_reference_inputs()
    table[0, :] = torch.tensor([4, 1, 2])
    table[1, :] = -7                                     # lens[1] = 0: no block used, any value
    out, lse = mla_decode_reference(q, kv, table, lens, 24, softmax_scale=0.1, causal=False)
    assert out.dtype == lse.dtype == torch.float64 and out.shape == (2, 2, 3, 24) and lse.shape == (2, 3, 2)
    toks = torch.cat([kv[4, :, 0], kv[1, :, 0], kv[2, :2, 0]])              # sequence 0's 12 tokens
    sc = q[0].reshape(6, 40) @ toks.T * 0.1
    torch.testing.assert_close(out[0].reshape(6, 24), torch.softmax(sc, -1) @ toks[:, :24], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[0], torch.logsumexp(sc, -1).reshape(2, 3).T, atol=1e-12, rtol=1e-12)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == float("-inf")).all()
    # strided views, int64 indices: the same result
    qs = torch.cat([q, q], -1)[..., :40]
    kvs = kv.transpose(0, 1).contiguous().transpose(0, 1)
    tbl = torch.stack([table.long(), table.long()], -1)[..., 0]
    out2, lse2 = mla_decode_reference(qs, kvs, tbl, lens.long()[:, None][:, 0], 24, softmax_scale=0.1, causal=False)
    assert not qs.is_contiguous() and not kvs.is_contiguous() and not tbl.is_contiguous()
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    # a bf16 q with an fp32 cache (the op's CPU path over a dequantized FP8 cache): fp32 math
    out3, _ = mla_decode_reference(q.bfloat16(), kv.float(), table, lens, 40, softmax_scale=0.1)
    assert out3.dtype == torch.float32 and out3.shape == (2, 2, 3, 40)


def test_pick_tiling_takes_the_persistent_seesaw_with_lazy_at_128_rows():
    """The bf16 cache at 128+ query rows (a multiple of 64) on sm_90a with pages of 64+ tokens: the persistent seesaw
    with lazy rescaling (bench/NOTES.md "Session 73"); fewer rows, other row counts, smaller pages, the FP8 cache and
    the other targets keep their tilings; the schedule's splits dealt whole, merged by the combine kernel (merge=False:
    the in-kernel merge of cut sequences lost on an H100, "Session 76"). The bf16 cache in the default operand order
    on sm_90a with pages of 64+ tokens stages its output through the query tiles ("Session 79"); swapped (<= 32 rows),
    smaller pages, the FP8 cache and the other targets do not. The program takes it (traced: no lowering)."""
    full = dict(block_n=64, stages=2, seesaw=True, persistent=True, lazy=8.0, merge=False, stage_out=True)
    assert pick_tiling(128, "bf16", "sm_90a", 64) == full and pick_tiling(512, "bf16", "sm_90a", 256) == full
    for rows, page in ((64, 64), (160, 64), (48, 64), (96, 256)):
        assert pick_tiling(rows, "bf16", "sm_90a", page) == dict(block_n=64, stages=2, stage_out=True), (rows, page)
    for rows, page in ((128, 32), (32, 16)):        # (pages under 64 tokens: stage_out not measured there)
        assert pick_tiling(rows, "bf16", "sm_90a", page) == dict(block_n=page, stages=2), (rows, page)
    assert pick_tiling(32, "bf16", "sm_90a", 64) == dict(block_n=64, stages=2, swapped=True)
    for fmt, target in (("fp8", "sm_90a"), ("bf16", "sm_100a"), ("bf16", "ascend:950")):
        t = pick_tiling(128, fmt, target, 64)
        assert "persistent" not in t and "stage_out" not in t, (fmt, target, t)
    mla_decode_program.traced("sm_90a", dict(h_q=128, s_q=1, **full))


def test_schedule_shapes_and_batch_invariance():
    lens = torch.tensor([0, 64, 4096, 100000], dtype=torch.int32)
    s = get_mla_schedule(lens, 1, 16, max_blocks=2000, num_sms=132)
    assert s.splits.dtype == torch.int32 and s.splits.shape == (4,)
    assert int(s.splits.min()) >= 1 and int(s.splits.max()) <= s.max_splits
    inv_a = get_mla_schedule(lens, 1, 16, max_blocks=2000, batch_invariant=True)
    inv_b = get_mla_schedule(lens[2:], 1, 16, max_blocks=2000, batch_invariant=True)
    assert torch.equal(inv_a.splits[2:], inv_b.splits) and inv_a.max_splits == inv_b.max_splits
    with pytest.raises(ValueError, match="sched was made for batch"):
        s.check(3, 16)
    # every default kernel runs one CTA an SM (the FP8 cache's at <= 16 rows: two MMA chains in it)
    b128 = torch.full((128,), 4096, dtype=torch.int32)
    assert get_mla_schedule(b128, 1, 16, 64).max_splits == 1
    assert get_mla_schedule(b128, 1, 16, 64, kv_format="fp8").max_splits == 1
    assert get_mla_schedule(torch.full((64,), 4096, dtype=torch.int32), 1, 16, 64, kv_format="fp8").max_splits == 2
    assert pick_tiling(16, "fp8", "sm_90a", 64) == dict(register_fp8=True, kv_format="fp8", chains=2)
    with pytest.raises(ValueError, match="kv_format must be one of"):
        get_mla_schedule(b128, 1, 16, 64, kv_format="e4m3")


def test_schedule_split_knobs():
    """max_splits / min_split_blocks: by default (no cap: SPLIT_CAP None; SPLIT_MIN_BLOCKS 4) a lone long sequence
    is split over every SM in splits of 4+ blocks; a cap or smaller splits change that; bad values and
    batch-invariant mode are refused."""
    from ops.mla_decode import SPLIT_CAP, SPLIT_MIN_BLOCKS

    one = torch.tensor([16384], dtype=torch.int32)                    # 256 blocks of 64 tokens
    s = get_mla_schedule(one, 1, 32, 256, num_sms=132)
    assert (SPLIT_CAP, SPLIT_MIN_BLOCKS) == (None, 4) and s.max_splits == 64 and s.splits.tolist() == [64]
    assert get_mla_schedule(one, 1, 32, 256, num_sms=132, max_splits=32).splits.tolist() == [32]
    assert get_mla_schedule(torch.tensor([65536], dtype=torch.int32), 1, 16, 1024, num_sms=132).max_splits == 132
    wide = get_mla_schedule(one, 1, 32, 256, num_sms=132, max_splits=132, min_split_blocks=2)
    assert wide.max_splits == 128 and wide.splits.tolist() == [128]  # 2 blocks a split
    assert get_mla_schedule(one, 1, 32, 256, num_sms=132, max_splits=132).splits.tolist() == [64]
    assert get_mla_schedule(one, 1, 128, 256, num_sms=132, max_splits=132, min_split_blocks=1).max_splits == 66
    short = torch.tensor([16384, 100], dtype=torch.int32)             # 256 and 2 blocks
    assert get_mla_schedule(short, 1, 16, 256, num_sms=132, max_splits=132,
                            min_split_blocks=2).splits.tolist() == [66, 1]
    b128 = torch.full((128,), 4096, dtype=torch.int32)                # a full batch: no split either way
    assert get_mla_schedule(b128, 1, 16, 64, max_splits=132, min_split_blocks=1).max_splits == 1
    with pytest.raises(ValueError, match="max_splits must be >= 1, got 0"):
        get_mla_schedule(one, 1, 32, 256, max_splits=0)
    with pytest.raises(TypeError, match="min_split_blocks must be an int, got float"):
        get_mla_schedule(one, 1, 32, 256, min_split_blocks=1.5)
    with pytest.raises(ValueError, match="no effect in batch-invariant mode"):
        get_mla_schedule(one, 1, 32, 256, batch_invariant=True, max_splits=64)


@pytest.mark.parametrize("fmt,h_q,s_q", [("bf16", 16, 1), ("fp8", 16, 1), ("bf16", 64, 1)])
def test_sm_90a_pipeline_structure(fmt, h_q, s_q):
    """tile.attention_loop on sm_90a: one TMA producer warpgroup (registers 80) and two MMA warpgroups
    (240 / 168), only the rule's own named barriers (the thread-sync pass is off), the per-CTA
    indices in registers (no int64 divisions by the split count in the TMA issue), no spills and
    no WGMMA serialization (ptxas's C75xx warnings). (The two-warpgroup schedule at 64+ rows:
    test_lazy_builds_and_says_what_it_needs checks the same structure on its 256-row build.)"""
    from backends import ToolchainError
    from backends.cuda.sass import disassemble, histogram, wgmma_serialized
    from test_gemm_fp8 import _build_with_ptxas_log

    # (fp8 at 16 rows: ops.mla_decode_fp8_rs)
    tiling = FP8_FOLD if fmt == "fp8" else pick_tiling(h_q * s_q, fmt, "sm_90a")
    src = mla_decode_program.source("sm_90a", h_q=h_q, s_q=s_q, **tiling)
    assert_sm90_roles(src)
    try:
        cubin, log = _build_with_ptxas_log(src)
        sass = disassemble(cubin)
        hist = histogram(sass)
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert hist.get("HGMMA", 0) > 0 and hist.get("UTMALDG", 0) > 0 and hist.get("HMMA", 0) == 0
    assert wgmma_serialized(log) == [], wgmma_serialized(log)
    assert hist.get("STL", 0) == 0 and "0 bytes spill stores" in log
    # stage_out (the default operand order, bf16): the output leaves through shared memory, 16 bytes a thread
    assert ("STG.E.128" in sass) == bool(tiling.get("stage_out")), tiling


def assert_sm90_roles(src):
    """The warp-specialized roles of an sm_90a MLA source: 384 threads, registers 240 / 168 / 80 by warpgroup, only
    the rule's own named barriers (and stage_out's tile.barrier of each MMA warpgroup, 11 and 10), no int64 division
    by the split count in the TMA issue."""
    assert "__launch_bounds__(384, 1)" in src
    assert all(f"warpgroup_reg_{k}<{n}>" in src for k, n in (("alloc", 240), ("alloc", 168), ("dealloc", 80)))
    partial = set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src))
    own = {("13", "128"), ("14", "128"), ("15", "128")}     # 13: WG1 converting (swapped FP8)
    assert partial <= own | {("10", "128"), ("11", "128")}, partial
    assert "% ((int64_t)max_splits)" not in src and "/ ((int64_t)max_splits)" not in src


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_trace_stamps_every_event(fmt):
    from codegen.lowering.sm90_attention import EVENTS, UNIT_EVENTS

    # the default operand order: no conversion event without a raw format, no WG1 conversion, no
    # seesaw-only "wg1 landed", no persistent hand-over events
    src = mla_decode_program.source("sm_90a", h_q=16, s_q=1, trace=True, **pick_tiling(64, fmt, "sm_90a"))
    assert src.count("clock()") == len(EVENTS) - len(UNIT_EVENTS) - 3 - (fmt == "bf16")
    # swapped: the FP8 producer has one raw wait a step; WG1's conversion events appear twice (the
    # first step's conversion before the loop)
    swapped = mla_decode_program.source("sm_90a", h_q=16, s_q=1, trace=True, swapped=True, block_n=64,
                                        **(dict(kv_format="fp8", raw_stages=2) if fmt == "fp8" else {}))
    assert swapped.count("clock()") == (14 if fmt == "fp8" else 10)
    # and every CTA's timeline: when its warpgroups start, when WG0's epilogue is done (the helper's
    # definition is the third occurrence)
    assert src.count("tc_timeline(") == 3 and swapped.count("tc_timeline(") == 3
    plain = mla_decode_program.source("sm_90a", h_q=16, s_q=1, **(FP8_FOLD if fmt == "fp8" else pick_tiling(16, fmt, "sm_90a")))
    assert "clock()" not in plain and "tc_timeline" not in plain


def test_fp8_two_converters_build():
    """Chunked raw staging in the default operand order: WG1 converts too (its named barrier 13
    appears), within shared memory and with no spills."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    src = mla_decode_program.source("sm_90a", h_q=128, s_q=1, kv_format="fp8", block_n=32, stages=2, raw_rows=16,
                                    raw_stages=4)
    assert "__sync_thread_partial(13, 128)" in src
    assert max(int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)) < 220 * 1024
    with pytest.raises(ValueError, match="even number of chunks"):
        mla_decode_program.source("sm_90a", h_q=128, s_q=1, kv_format="fp8", block_n=32, stages=2, raw_rows=16,
                                  raw_stages=3)
    try:
        st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert st.histogram.get("HGMMA", 0) > 0 and st.spill_stores == 0


@pytest.mark.parametrize("kv_format,h_q,page", [("bf16", 16, 64), ("bf16", 128, 16), ("fp8", 64, 64)])
def test_ascend_source_splits_the_step_between_cube_and_vector_cores(kv_format, h_q, page):
    """ascend:950 (codegen/lowering/ascend_attention.py; generated Ascend C, no device): the Cube scores the
    three query parts against K and multiplies P by V^T (the Cube's NT form), both from L1; the vector cores
    run the softmax on half the query rows each and hand P and V^T (and the FP8 cache's converted K) to L1."""
    tiling = pick_tiling(h_q, kv_format, "ascend:950", page)
    n = tiling["block_n"]
    assert n == (32 if kv_format == "fp8" else 64)
    src = mla_decode_program.source("ascend", h_q=h_q, s_q=1, page=page, **tiling)
    gemms = re.findall(r"ascend_gemm_l1<([^>]*)>", src)
    assert sorted(set(gemms)) == sorted({f"64, 256, {n}, 256, true, bfloat16_t",     # S += Q_latent K_latent^T
                                         f"64, 64, {n}, 64, true, bfloat16_t",       # S += Q_rope K_rope^T
                                         f"64, {n}, 256, {n}, true, bfloat16_t"})    # O_part = P V_part
    assert len(gemms) == 5
    aic, aiv = src[src.index("if ASC_IS_AIC"):src.index("if ASC_IS_AIV")], src[src.index("if ASC_IS_AIV"):]
    assert "asc_get_sub_block_id() * 32" in aiv                      # half of the 64 query rows a vector core
    loop = aiv[aiv.index("for ("):]
    # each step: P and both V^T halves (and with FP8 the three converted K parts) into L1
    assert loop.count("asc_copy_ub2l1") == (1 + 2 + (3 if kv_format == "fp8" else 0))
    if kv_format == "fp8":   # the raw step comes into UB, K and V^T are converted there (e4m3 -> bf16 * scale)
        assert "asc_copy_gm2l1" not in src and "e4m3" in src
    else:                    # K straight from the cache into L1; V's columns into UB to be zeroed past the end
        assert aic.count("asc_copy_gm2l1_nd2nz") == 3 * (64 // min(page, 64))
        assert "exp2f" in src
    with pytest.raises(ValueError, match="cuda:sm_90a only"):
        mla_decode_program.source("ascend", h_q=128, s_q=1, page=64, seesaw=True)


def test_ascend_combine_lowers():
    assert "mla_combine" in mla_combine_program.source("ascend", h_q=16, s_q=1)


def test_rules_ask_for_their_pass_configs():
    """The sm_90a attention_loop places its own barriers and asks for TileLang's sync pass to be off
    (tile.require_pass_configs); the generic loop on sm_100a asks for nothing."""
    _, on90 = mla_decode_program.traced("sm_90a", dict(h_q=16, s_q=1))
    _, on100 = mla_decode_program.traced("sm_100a", dict(h_q=16, s_q=1, **pick_tiling(16, "bf16", "sm_100a")))
    assert on90 == {"tl.disable_thread_storage_sync": True} and on100 == {}
    assert mla_decode_program.configs("sm_90a", dict(h_q=16, s_q=1), on90)["tl.disable_thread_storage_sync"]


def test_sm_90a_attention_loop_needs_its_warpgroups():
    with pytest.raises(ValueError, match="producer_threads"):
        mla_decode_program.source("sm_90a", h_q=16, s_q=1, threads=128)


def test_lowers_to_tcgen05_on_sm_100a():
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    try:
        src = mla_decode_program.source("sm_100a", h_q=16, s_q=1, **pick_tiling(16, "bf16", "sm_100a"))
        hist = sass_stats(build_cubin(src, "sm_100a"), "sm_100a").histogram
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert hist.get("UTCHMMA", 0) > 0 and hist.get("HMMA", 0) == 0
    # every tiling the op picks there lowers within the target's shared memory (both cache formats)
    for rows, h_q, s_q, fmt in [(16, 16, 1, "fp8"), (128, 128, 1, "bf16")]:
        assert "tcgen05" in mla_decode_program.source("sm_100a", h_q=h_q, s_q=s_q, **pick_tiling(rows, fmt, "sm_100a"))


def _combine_reference(splits, opart, lpart, max_splits, rows):
    """The merge in float64: out = sum_s exp2(l_s) O_s / sum_s exp2(l_s), lse = log2(sum_s exp2(l_s)) * ln 2 over
    each split sequence's splits (-inf lse: weight 0); None for a sequence of one split (the combine leaves it)."""
    outs = []
    for bi, n in enumerate(splits.tolist()):
        if n <= 1:
            outs.append(None)
            continue
        l = lpart[bi * max_splits: bi * max_splits + n, :rows].double()          # (n, rows)
        o = opart[bi * max_splits: bi * max_splits + n, :rows].double()          # (n, rows, 512)
        m = l.max(0).values
        w = torch.where(torch.isfinite(l), torch.exp2(l - torch.where(torch.isfinite(m), m, 0)), 0)
        total = w.sum(0)
        out = torch.where(total[:, None] > 0, (w[..., None] * o).sum(0) / total.clamp(min=1e-300)[:, None], 0)
        lse = torch.where(total > 0, (m + torch.log2(total.clamp(min=1e-300))) * math.log(2), -math.inf)
        outs.append((out, lse))
    return outs


@pytest.mark.parametrize("lanes", [0, 1, 2, 8])
def test_combine_on_the_cpu_target_matches_float64(lanes):
    """Both combines (three passes; the wide one with 1, 2 or 8 split lanes: 8, 16 or 64 splits a trip, clamped
    indices) run on TileLang's C target: against a float64 merge, with 150, 40, 23 and 17 splits (two rounds of the
    lse reduction, whole and partial trips), empty splits (lse -inf, zero output), a row whose every split is empty
    (zeros, lse -inf), a sequence of one split left untouched, and the slots past each sequence's splits poisoned
    with NaN (never read into a result)."""
    g = torch.Generator().manual_seed(1)
    h_q, s_q, max_splits = 8, 2, 150
    rows = h_q * s_q
    splits = torch.tensor([40, 1, 23, 17, 150], dtype=torch.int32)
    b = splits.numel()
    opart = torch.randn(b * max_splits, 64, 512, generator=g)
    lpart = torch.randn(b * max_splits, 64, generator=g) * 6
    for bi, n in enumerate(splits.tolist()):                       # unused slots: NaN
        opart[bi * max_splits + n:(bi + 1) * max_splits] = float("nan")
        lpart[bi * max_splits + n:(bi + 1) * max_splits] = float("nan")
    lpart[5], opart[5] = -math.inf, 0.0                           # an empty split (every row)
    lpart[2 * max_splits: 2 * max_splits + 23, 3] = -math.inf      # sequence 2, row 3: every split empty
    opart[2 * max_splits: 2 * max_splits + 23, 3] = 0.0
    k = mla_combine_program.compile("cpu", h_q=h_q, s_q=s_q, dtype="float32", **({"lanes": lanes} if lanes else {}))
    out = torch.full((b, rows, 512), 7.0)
    lse = torch.full((b, h_q, s_q), 7.0)
    k.launcher()(splits, opart, lpart, out, lse, max_splits)
    for bi, ref in enumerate(_combine_reference(splits, opart, lpart, max_splits, rows)):
        if ref is None:
            assert (out[bi] == 7.0).all() and (lse[bi] == 7.0).all()
            continue
        got_lse = lse[bi].transpose(0, 1).reshape(rows)             # (h_q, s_q) -> row r = s * h_q + h
        torch.testing.assert_close(out[bi].double(), ref[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isfinite(got_lse), torch.isfinite(ref[1]))
        torch.testing.assert_close(got_lse.double()[torch.isfinite(ref[1])], ref[1][torch.isfinite(ref[1])],
                                   atol=1e-5, rtol=1e-6)
    assert (out[2, 3] == 0).all() and lse[2, 3, 0] == -math.inf


def test_wide_combine_loads_a_trip_of_splits_at_once():
    """mla_combine_program(lanes=8) on sm_90a: each trip's COMBINE_AHEAD output loads (128-bit) and their lse loads
    sit in one branch-free loop body (the split index clamped, the weight selected: no branch between the loads),
    and the program lowers for sm_100a and Ascend too; combine_lanes_for covers a schedule's splits in one trip."""
    from backends.cuda.sass import build_cubin, disassemble
    from ops.mla_decode import COMBINE_AHEAD, combine_lanes_for

    src = mla_combine_program.source("sm_90a", h_q=32, s_q=1, lanes=8)
    sass = disassemble(build_cubin(src.split("\n", 1)[1] if src.startswith("//") else src, "sm_90a"))
    wide, bodies = 0, []
    for line in sass.splitlines():
        wide += "LDG.E.128" in line
        jump = re.search(r"/\*([0-9a-f]{4})\*/\s+(@!?P\d\s+)?BRA\s+0x([0-9a-f]+)", line)
        if jump:
            if int(jump.group(3), 16) < int(jump.group(1), 16):
                bodies.append(wide)
            wide = 0
    assert max(bodies) >= COMBINE_AHEAD, bodies
    assert "__global__" in mla_combine_program.source("sm_100a", h_q=128, s_q=2, lanes=4)
    assert "mla_combine" in mla_combine_program.source("ascend", h_q=16, s_q=1, lanes=8)
    assert [combine_lanes_for(n) for n in (2, 8, 9, 16, 32, 33, 64, 132, 1000)] == [1, 1, 2, 2, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="lanes"):
        mla_combine_program.source("sm_90a", h_q=16, s_q=1, lanes=3)


def test_prof_mla_paths_name_their_schedule_and_combine():
    """bench.prof_mla's paths: the knobs each hands get_mla_schedule and the combine lanes it asks for."""
    from bench.prof_mla import PATHS
    from bench.suites.mla import combine_lanes

    assert PATHS["default"] == ({}, None) and PATHS["s56"] == (dict(max_splits=32), "3pass")
    assert [combine_lanes(PATHS[p][1], 132) for p in ("default", "s56", "cw")] == [None, 0, 8]
    assert combine_lanes("wide", 2) == 1 and PATHS["splits-1"][0] == dict(min_split_blocks=1)


def test_combine_lowers_on_both_cuda_arches():
    for t in ("sm_90a", "sm_100a"):
        assert "__global__" in mla_combine_program.source(t, h_q=128, s_q=2)


# ---- GPU ---------------------------------------------------------------------------------------

def p_rounding_term(q, kv, table, lens, scale, causal):
    """sqrt(sum_j p_j^2 v_j^2) / sum_j p_j per output element, in fp32.

    The kernel (like FlashMLA) rounds the softmax numerator P to the input dtype before P @ V:
    each p_j carries a relative error of at most u = 2^-8 (bf16), so the output error has a
    standard deviation near u / sqrt(3) times this term. Over thousands of tokens it vanishes
    beside FlashMLA's thresholds; over the handful of tokens a causal row may see, it does not.
    """
    b, s_q, h_q, _ = q.shape
    page = kv.shape[1]
    term = torch.zeros(b, s_q, h_q, DV, device=q.device)
    flat = kv.reshape(-1, D)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        idx = (table[i, :(n + page - 1) // page].long()[:, None] * page + torch.arange(page, device=q.device)).reshape(-1)[:n]
        v = flat[idx].float()
        sc = q[i].float().reshape(s_q * h_q, D) @ v.T * scale
        if causal:
            limit = n - s_q + torch.arange(s_q, device=q.device).repeat_interleave(h_q) + 1
            sc = sc.masked_fill(torch.arange(n, device=q.device)[None] >= limit[:, None], float("-inf"))
        p = torch.softmax(sc, -1).nan_to_num(0.0)
        term[i] = ((p ** 2) @ (v[:, :DV] ** 2)).sqrt().reshape(s_q, h_q, DV)
    return term


def run_gpu_case(b, s_q, h_q, lens, page=64, causal=True, dtype=torch.bfloat16, seed=0, tiling=None):
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, dtype=dtype, device="cuda", seed=seed)
    scale = D ** -0.5
    if tiling is None:
        out, lse = ops.mla_decode(q, kv, table, seqlens, 512, softmax_scale=scale, causal=causal)
    else:                                       # a program variant the op does not choose
        from ops.mla_decode import _mla_decode_impl

        out, lse = _mla_decode_impl(q, kv, table, seqlens, scale, causal, None, tiling=tiling)
    assert_matches_reference(out, lse, q, kv, table, seqlens, scale, causal)
    return out, lse


def assert_matches_reference(out, lse, q, kv, table, seqlens, scale, causal=True):
    ref, ref_lse = mla_decode_reference(q, kv, table, seqlens, softmax_scale=scale, causal=causal)
    assert not out.isnan().any(), "NaN leaked from poisoned cache pages"
    # FlashMLA's thresholds (atol 8e-4, rtol 2.01/128) plus a 6-sigma allowance for P's rounding
    u = 2.0 ** -8 if q.dtype == torch.bfloat16 else 2.0 ** -11
    bound = 8e-4 + (2.01 / 128) * ref.abs() + 6 * u / 3 ** 0.5 * p_rounding_term(q, kv, table, seqlens, scale, causal)
    err = (out.float() - ref).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (f"{int((err > bound).sum())} elements out of bound; worst at flat index {worst}: "
                                  f"err {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)


def assert_option_within_bounds(b, s_q, h_q, lens, page, base, extra, gain=1):
    """The tiling base + extra (an option that may change the rounding, not the result) on NaN-poisoned inputs:
    within the reference's bounds, lse within 1e-5 of base's alone, the same bits run to run and from a CUDA graph.
    gain > 1 multiplies each sequence's last page (exact for a power of two), so that its max jumps late."""
    mla = importlib.import_module("ops.mla_decode")
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, device="cuda")
    for bi, n in enumerate(lens):
        if n and gain != 1:
            kv[int(table[bi, (n - 1) // page])] *= gain
    scale = D ** -0.5
    sched = mla.get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64)
    run = lambda: mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched,  # noqa: E731
                                       tiling={**base, **extra})
    out, lse = run()
    assert_matches_reference(out, lse, q, kv, table, seqlens, scale)
    ref_out, ref_lse = mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched, tiling=base)
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite())
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-5
    again_out, again_lse = run()
    assert torch.equal(again_out, out) and torch.equal(again_lse, lse)
    assert_graph_replay_gives(run, out, lse)


def assert_graph_replay_gives(run, out, lse):
    """run() captured in a CUDA graph and replayed gives exactly (out, lse)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_lse = run()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens", [
    (2, 1, 16, [1000, 64]),
    (3, 1, 128, [4096, 1, 0]),
    (2, 2, 128, [300, 2049]),
    (4, 4, 32, [7, 128, 129, 5000]),
    (1, 1, 1, [65]),
    (2, 3, 7, [200, 3]),
    (2, 1, 64, [16384, 8000]),  # few sequences, long contexts: splits + combine
])
def test_gpu_matches_reference(b, s_q, h_q, lens):
    run_gpu_case(b, s_q, h_q, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,kv_format,knobs", [
    (1, 1, 32, [16384], "bf16", dict(max_splits=132, min_split_blocks=1)),   # 132 splits, 4 of them empty
    (2, 1, 128, [8192, 1], "bf16", dict(max_splits=132, min_split_blocks=2)),  # 2 sequences x 2 row tiles: 33
    (1, 2, 64, [5001], "bf16", dict(max_splits=132, min_split_blocks=1)),     # causal MTP, a tail step
    (1, 1, 16, [16385], "fp8", dict(max_splits=132, min_split_blocks=2)),     # the <= 16-row FP8 kernel
    (1, 2, 16, [9000], "fp8", dict(max_splits=132, min_split_blocks=1)),      # the 32-row FP8 tile
])
@pytest.mark.parametrize("wide", [False, True])
def test_gpu_wide_schedules_match_the_reference(monkeypatch, b, s_q, h_q, lens, kv_format, knobs, wide):
    """A lone long sequence split over every SM (get_mla_schedule's max_splits / min_split_blocks above their
    defaults: splits of one or two blocks, empty trailing splits, the combine over up to 132 partials) stays
    within the reference's bounds, bf16 and FP8 cache, with either combine (COMBINE_WIDE)."""
    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "COMBINE_WIDE", wide)
    if kv_format == "fp8":
        run_fp8_case(b, s_q, h_q, lens, 64, split_knobs=knobs)
        return
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, device="cuda")
    sched = get_mla_schedule(seqlens, s_q, h_q, table.shape[1], **knobs)
    assert sched.max_splits > 32
    out, lse = ops.mla_decode(q, kv, table, seqlens, softmax_scale=D ** -0.5, sched=sched)
    assert_matches_reference(out, lse, q, kv, table, seqlens, D ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,lanes", [
    (16, 1, 64, [3000] * 15 + [0], 1),      # 8 splits a sequence, one empty sequence
    (8, 2, 32, [4000, 1, 77, 5000, 2, 3000, 64, 65], 2),   # 16 splits; causal MTP; one-block sequences
    (5, 1, 16, [8000, 3, 0, 4096, 700], 4),  # 26 splits; padding rows (48 of a 64-row tile)
    (2, 1, 128, [16384, 8000], 8),          # 33 splits; two row tiles
    (1, 4, 7, [9001], 8),                   # 35 splits; causal MTP, 28 rows
])
def test_gpu_wide_combine_at_the_default_splits(b, s_q, h_q, lens, lanes):
    """The wide combine forced at the default schedule's split counts, with each lane count combine_lanes_for picks
    (the op itself takes it above 8 splits: 2 lanes and more), stays within the reference's bounds."""
    from ops.mla_decode import _mla_decode_impl, combine_lanes_for

    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, device="cuda")
    sched = get_mla_schedule(seqlens, s_q, h_q, table.shape[1])
    assert combine_lanes_for(sched.max_splits) == lanes
    out, lse = _mla_decode_impl(q, kv, table, seqlens, D ** -0.5, True, sched, combine_lanes=lanes)
    assert_matches_reference(out, lse, q, kv, table, seqlens, D ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 128, 256])
def test_gpu_page_sizes(page):
    run_gpu_case(3, 1, 16, [page * 3 + 5, 1, 700], page=page)
    run_gpu_case(3, 1, 128, [page * 3 + 5, 1, 700], page=page)    # (128+: the persistent-lazy default)


@pytest.mark.gpu
def test_gpu_fp16_and_non_causal():
    run_gpu_case(2, 2, 16, [300, 77], dtype=torch.float16)
    run_gpu_case(2, 2, 16, [300, 77], causal=False)
    run_gpu_case(2, 2, 128, [300, 77], dtype=torch.float16)       # the persistent-lazy default (session 74)
    run_gpu_case(2, 2, 128, [300, 77], causal=False)


@pytest.mark.gpu
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 5), s_q=st.sampled_from([1, 2, 4]), h_q=st.sampled_from([1, 16, 128]),
       page=st.sampled_from([16, 64]), data=st.data())
def test_gpu_hypothesis(b, s_q, h_q, page, data):
    lens = data.draw(st.lists(st.integers(0, 3000), min_size=b, max_size=b))
    run_gpu_case(b, s_q, h_q, lens, page=page, seed=data.draw(st.integers(0, 1000)))


@pytest.mark.gpu
def test_gpu_views_off_alignment(off_alignment):
    """q is read 16 bytes a thread: a view that starts 4 bytes off is copied (the same bits); the cache is
    loaded by TMA: a view of it off alignment is a ValueError naming kv_cache."""
    q, kv, table, seqlens = make_inputs(2, 1, 16, [300, 77], device="cuda")
    scale = D ** -0.5
    out, lse = ops.mla_decode(q, kv, table, seqlens, 512, softmax_scale=scale)
    out2, lse2 = ops.mla_decode(off_alignment(q, 4), kv, table, seqlens, 512, softmax_scale=scale)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    with pytest.raises(ValueError, match="^kv_cache must start 16-byte aligned"):
        ops.mla_decode(q, off_alignment(kv, 2), table, seqlens, 512, softmax_scale=scale)


@pytest.mark.gpu
def test_gpu_deterministic():
    q, kv, table, lens = make_inputs(2, 1, 64, [9000, 3000], device="cuda")
    a = ops.mla_decode(q, kv, table, lens, softmax_scale=0.05)
    b = ops.mla_decode(q, kv, table, lens, softmax_scale=0.05)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_gpu_batch_invariant_mode(monkeypatch):
    monkeypatch.setenv("TILECRAFT_BATCH_INVARIANT", "1")
    q, kv, table, lens = make_inputs(4, 1, 16, [5000, 300, 9000, 64], device="cuda")
    full, full_lse = ops.mla_decode(q, kv, table, lens, softmax_scale=0.05)
    for i in range(4):
        one, one_lse = ops.mla_decode(q[i:i + 1], kv, table[i:i + 1], lens[i:i + 1], softmax_scale=0.05)
        assert torch.equal(one[0], full[i]) and torch.equal(one_lse[0], full_lse[i]), i


@pytest.mark.gpu
def test_gpu_batch_invariant_mode_at_128_rows(monkeypatch):
    """The same at h_q = 128, where the op runs the persistent seesaw with lazy rescaling (session 74): a CTA runs
    several units back to back, and what it carries from one unit to the next must not change a unit's bits."""
    assert pick_tiling(128, "bf16", "cuda:sm_90a", 64).get("persistent")
    monkeypatch.setenv("TILECRAFT_BATCH_INVARIANT", "1")
    assert_batch_invariant(128, lens=(5000, 300, 9000, 64, 1100))


@pytest.mark.gpu
def test_gpu_cuda_graph_with_schedule():
    q, kv, table, lens = make_inputs(4, 1, 16, [5000, 300, 9000, 64], device="cuda")
    sched = get_mla_schedule(lens, 1, 16, max_blocks=table.shape[1])
    ops.mla_decode(q, kv, table, lens, softmax_scale=0.05, sched=sched)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = ops.mla_decode(q, kv, table, lens, softmax_scale=0.05, sched=sched)
    q.copy_(torch.randn_like(q) / 4)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    # the replay computes what an eager call on the new query does, bit for bit, and both are within
    # the bound of every GPU case (FlashMLA's thresholds plus the allowance for P's bf16 rounding: at
    # 64 tokens an exactly rounded P alone comes within 2e-5 of the plain 8e-4, bench/NOTES.md "MLA v13")
    eager, eager_lse = ops.mla_decode(q, kv, table, lens, softmax_scale=0.05, sched=sched)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    assert_matches_reference(out, lse, q, kv, table, lens, 0.05)


# ---- FP8 cache -------------------------------------------------------------------------------------

def test_fp8_layout_and_round_trip():
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(3, 64, 1, D, generator=g) * 2).bfloat16()
    kv[0, 0, 0, :128] = 0                                  # an all-zero block keeps a usable scale
    cache = ops.quantize_mla_kv_fp8(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (3, 64, 1, 656)
    # bytes 528.. are the rope values, bit for bit
    assert torch.equal(cache[..., 528:].contiguous().view(torch.bfloat16), kv[..., 512:])
    back = ops.dequantize_mla_kv_fp8(cache)
    assert back.shape == (3, 64, 1, D) and back.dtype == torch.float32
    latent, ref = back[..., :512].reshape(-1, 4, 128), kv[..., :512].float().reshape(-1, 4, 128)
    amax = ref.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: error <= 2^-4 of the value, or the subnormal step of the block
    assert ((latent - ref).abs() <= ref.abs() * 2 ** -4 + amax / 448 * 2 ** -9 + 1e-12).all()
    assert torch.equal(back[0, 0, 0, :128], torch.zeros(128))


def test_fp8_cpu_op_uses_the_dequantized_cache():
    q, kv, table, lens = make_inputs(2, 1, 16, [100, 7])
    kv = kv.nan_to_num(0.0)
    cache = ops.quantize_mla_kv_fp8(kv)
    out, lse = ops.mla_decode(q, cache, table, lens, softmax_scale=0.1, kv_format="fp8")
    ref, ref_lse = mla_decode_reference(q, ops.dequantize_mla_kv_fp8(cache), table, lens, softmax_scale=0.1)
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float())
    torch.testing.assert_close(lse, ref_lse)


def test_fp8_invalid_inputs():
    q, kv, table, lens = make_inputs(2, 1, 16, [10, 20])
    cache = ops.quantize_mla_kv_fp8(kv.nan_to_num(0.0))
    with pytest.raises(TypeError, match="kv_cache must have dtype uint8"):
        ops.mla_decode(q, kv, table, lens, softmax_scale=0.1, kv_format="fp8")
    with pytest.raises(TypeError, match="with kv_format='fp8', q must be bf16"):
        ops.mla_decode(q.half(), cache, table, lens, softmax_scale=0.1, kv_format="fp8")
    with pytest.raises(ValueError, match=r"must have shape \(num_blocks, page_size, 1, 656\)"):
        ops.mla_decode(q, cache[..., :600].contiguous(), table, lens, softmax_scale=0.1, kv_format="fp8")
    with pytest.raises(TypeError, match="kv must have dtype bf16"):
        ops.quantize_mla_kv_fp8(kv.float())


def test_seesaw_builds_and_says_what_it_needs():
    """The seesaw schedule lowers on sm_90a within its registers (no spills) and shared memory, with
    each kv part's own barriers; it names what it needs everywhere else."""
    from tests.test_gemm_fp8 import _sass_and_ptxas_log

    src = mla_decode_program.source("sm_90a", h_q=64, s_q=1, block_n=64, stages=2, seesaw=True)
    assert "tc_exp2" in src and src.count("wgmma_ss") >= 10
    _, log = _sass_and_ptxas_log(src.split("\n", 1)[1] if src.startswith("//") else src)
    assert "0 bytes spill stores" in log, log
    with pytest.raises(ValueError, match="seesaw"):        # P over a 32-token step's rope does not fit
        mla_decode_program.source("sm_90a", h_q=64, s_q=1, block_n=32, stages=2, seesaw=True)
    with pytest.raises(ValueError, match="seesaw"):        # no raw (FP8) staging
        mla_decode_program.source("sm_90a", h_q=64, s_q=1, block_n=32, stages=2, seesaw=True, kv_format="fp8")
    with pytest.raises(ValueError, match="sm_90a only"):
        mla_decode_program.source("sm_100a", h_q=64, s_q=1, block_n=64, stages=1, threads=128, seesaw=True)


def _unit_cost(sched, lens):
    # (bi, si) -> 64-token blocks + UNIT_COST of each split that exists, as the kernel splits
    from ops.mla_decode import UNIT_COST

    costs = {}
    for bi, n in enumerate(lens):
        sp = int(sched.splits[bi])
        nblk = -(-int(n) // 64)
        chunk = -(-nblk // max(sp, 1))
        for si in range(sp):
            costs[bi * sched.max_splits + si] = max(min(nblk, si * chunk + chunk) - si * chunk, 0) + UNIT_COST
    return costs


def _least_makespan(costs, parts):
    # the least cost of the costliest run over every deal of the units in order to `parts` contiguous runs
    # (binary search on the cap; the greedy fill is the fewest runs under a cap)
    def runs(cap):
        n, load = 1, 0
        for c in costs:
            n, load = (n + 1, c) if load and load + c > cap else (n, load + c)
        return n
    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) <= parts else (mid + 1, hi)
    return lo


@pytest.mark.parametrize("lens,s_q,h_q,invariant", [
    ([4096] * 128, 1, 128, False),                   # one unit a sequence, ~2 a part
    ([4096 + 2 * i for i in range(132)], 1, 128, False),   # 2 a part (the cost midpoints dealt 3 to one)
    ([16384] * 32, 1, 128, False),                   # split sequences
    ([4096] * 128, 2, 128, False),
    ([1024 + 2 * i for i in range(206)], 1, 128, False),
    ([0, 1, 65, 4097, 300, 64, 0, 9000, 2049], 1, 64, False),
    ([0, 1, 65, 4097, 300, 64, 0, 9000, 2049], 1, 128, True),   # batch-invariant 16-block chunks
])
def test_persistent_units_cover_every_split_once_in_balanced_runs(lens, s_q, h_q, invariant):
    """MlaSchedule.persistent_units: every split that exists (zero-length sequences included) exactly
    once, in order, dealt to parts as contiguous runs whose costs stay within one unit of the even share and
    whose costliest is within 1/(PART_CAPS - 1) of the costliest unit of the least possible (brute force here); uniform b=128 lengths give at most two units
    a part (FlashMLA's 64 parts x 2 sequences), and so do 132 sequences of near-equal length."""
    from ops.mla_decode import PART_CAPS, get_mla_schedule

    t = torch.tensor(lens, dtype=torch.int32)
    sched = get_mla_schedule(t, s_q, h_q, max(1, -(-max(lens) // 64)), num_sms=132, batch_invariant=invariant)
    costs = _unit_cost(sched, lens)
    expected = sorted(costs)
    for parts in (132 // -(-(s_q * h_q) // 64), 7, 1, 64):
        unit_list, start = sched.persistent_units(parts)
        assert unit_list.dtype == start.dtype == torch.int32 and start.shape == (parts + 1,)
        assert start[0] == 0 and start[-1] == len(expected) and bool((start[1:] >= start[:-1]).all())
        assert unit_list[:len(expected)].tolist() == expected
        share, most = sum(costs.values()) / parts, max(costs.values())
        least = _least_makespan([costs[u] for u in expected], parts)
        for p in range(parts):
            run = unit_list[int(start[p]):int(start[p + 1])].tolist()
            assert sum(costs[u] for u in run) <= share + most, (p, run)
            assert sum(costs[u] for u in run) <= least + -(-most // (PART_CAPS - 1)), (p, run, least)
        if len(lens) in (128, 132) and s_q == 1 and parts == 66:
            assert int((start[1:] - start[:-1]).max()) == 2
    assert sched.persistent_units(7)[0] is sched.persistent_units(7)[0]      # made once per part count


@pytest.mark.parametrize("lens,s_q,h_q,invariant", [
    ([4096] * 128, 1, 128, False),                   # ~1.94 sequences a part: about every other one cut
    ([4096] * 66, 1, 128, False),                    # one a part exactly: no cuts
    ([4096 + 2 * i for i in range(132)], 1, 128, False),
    ([16384] * 32, 1, 128, False),                   # each sequence over ~2 parts
    ([4096] * 128, 2, 128, False),
    ([0, 1, 65, 4097, 300, 64, 0, 9000, 2049], 1, 64, False),
    ([0], 1, 128, False),
    ([0, 1, 65, 4097, 300, 64, 0, 9000, 2049], 1, 128, True),   # batch-invariant: the 16-block splits, whole
])
@pytest.mark.parametrize("cut", [True, False])
def test_persistent_pieces_cover_every_block_once(lens, s_q, h_q, invariant, cut):
    """MlaSchedule.persistent_pieces: every sequence's 64-token blocks exactly once, in order, by consecutive
    entries that name the sequence's first partial slot and piece count (what the kernel's merge reads) and their
    own slots, consecutive from it in block order. The cut deal's pieces are non-empty unless the sequence is; it
    runs a part's head piece of a cut sequence first (the merge early, its partials in L2); the cut deal (cut=True, not
    batch-invariant) takes a sequence at most once a part, its slots are its list entries, and it keeps every part
    within its equal share of the cost plus one piece's fixed cost; b = 66 equal sequences on 66 parts are not cut
    at all. Otherwise the schedule's splits dealt whole, as persistent_units does, each at slot bi * max_splits + si
    (where the combine kernel reads it)."""
    from ops.mla_decode import PIECE_COST, PIECE_FIELDS, get_mla_schedule

    t = torch.tensor(lens, dtype=torch.int32)
    sched = get_mla_schedule(t, s_q, h_q, max(1, -(-max(lens) // 64)), num_sms=132, batch_invariant=invariant)
    nblk = [-(-n // 64) for n in lens]
    cutting = cut and not invariant
    for parts in (132 // -(-(s_q * h_q) // 64), 7, 1, 64):
        pieces, start = sched.persistent_pieces(parts, cut=cut)
        assert pieces.dtype == start.dtype == torch.int32 and start.shape == (parts + 1,)
        assert pieces.shape[1] == PIECE_FIELDS and start[0] == 0 and bool((start[1:] >= start[:-1]).all())
        n = int(start[-1])
        assert bool((pieces[n:] == -1).all())
        rows = pieces[:n].tolist()
        by_seq = {}
        for k, (bi, first, steps, slot0, count, own) in enumerate(rows):
            by_seq.setdefault(bi, []).append((k, first, steps, slot0, count, own))
        assert sorted(by_seq) == list(range(len(lens)))
        if cutting:         # the slots: the entries in sequence order (before a part's cut head moved to its front)
            assert sorted(r[5] for r in rows) == list(range(n))
        for bi, entries in by_seq.items():
            entries.sort(key=lambda e: e[5])
            slot0 = entries[0][5] if cutting else bi * sched.max_splits
            assert all(e[3] == slot0 and e[4] == len(entries) for e in entries), (bi, entries)
            assert [e[5] for e in entries] == list(range(slot0, slot0 + len(entries))), (bi, entries)
            if not cutting:     # the whole deal keeps a sequence's splits in order, consecutive entries
                ks = [e[0] for e in entries]
                assert ks == list(range(ks[0], ks[0] + len(ks))), (bi, ks)
            pos = 0
            for _, first, steps, _, _, _ in entries:
                if steps == 0 and not cutting:      # (the schedule's splits may end in empty ones past the blocks)
                    continue
                assert first == pos and (steps > 0 or len(entries) == 1), (bi, entries)
                pos += steps
            assert pos == nblk[bi], (bi, entries)
        for p in range(parts):
            seqs = [rows[k][0] for k in range(int(start[p]), int(start[p + 1]))]
            if cutting:       # (a whole-split deal may give a part several splits of a sequence)
                assert len(set(seqs)) == len(seqs)
                # no part ends with the head of a cut sequence where it has other work to do first
                last = rows[int(start[p + 1]) - 1] if seqs else None
                assert not (len(seqs) > 1 and last[4] > 1 and last[1] == 0), (p, seqs)
                # each part's pieces in their sequences' order but for a cut head moved to the front
                body = [rows[k] for k in range(int(start[p]), int(start[p + 1]))]
                if len(body) > 1 and body[0][4] > 1 and body[0][1] == 0:
                    body = body[1:] + body[:1]
                assert [r[5] for r in body] == sorted(r[5] for r in body), (p, body)
                share = -(-(sum(nblk) + PIECE_COST * len(lens)) // parts)
                work = sum(rows[k][2] + PIECE_COST for k in range(int(start[p]), int(start[p + 1])))
                assert work <= share + PIECE_COST, (p, work, share)
        if not cutting:
            unit_list, ustart = sched.persistent_units(parts)
            assert torch.equal(ustart, start)
            assert [r[5] for r in rows] == unit_list[:n].tolist()
        if len(lens) == 66 and parts == 66 and cutting:
            assert n == 66 and all(r[4] == 1 for r in rows)
    assert sched.persistent_pieces(7, cut=cut)[0] is sched.persistent_pieces(7, cut=cut)[0]   # made once


def test_own_p_is_for_the_seesaw():
    with pytest.raises(ValueError, match="own_p=True .* is built for seesaw=True"):
        mla_decode_program.source("sm_90a", h_q=64, s_q=1, block_n=64, stages=2, own_p=True)


def test_persistent_builds_and_says_what_it_needs():
    """persistent=True lowers on sm_90a within the seesaw's registers (no spills, no serialized MMAs): one wave of
    CTAs each running its units back to back, the query by TMA (no query stores by the threads); its trace build
    stamps across units; it names what it is built for everywhere else. Built as the op runs it at 128 rows
    (pick_tiling: with lazy=8, whose four O rescales each sit behind a warp vote; without lazy it is the same
    program less those votes, built by the GPU tests)."""
    from backends.cuda.sass import wgmma_serialized
    from tests.test_gemm_fp8 import _sass_and_ptxas_log

    tiling = pick_tiling(128, "bf16", "sm_90a", 64)
    assert tiling["persistent"] and tiling["lazy"] == 8.0
    src = mla_decode_program.source("sm_90a", h_q=128, s_q=1, **tiling)
    assert "Q_desc" in src and "PartStart" in src and "Pieces" in src
    assert "AtomicAddRet(" not in src          # merge=False: the split pieces' partials go to the combine kernel
    body = src[src.index("mla_decode_persistent_kernel("):]
    assert body.count("__syncthreads()") == 2          # barrier init, then the roles: none inside a unit loop
    assert src.count("if (tc_warp_any(") == 4 and "if ((0x1p+3f/*8.000000e+00*/ < (" in src
    _, log = _sass_and_ptxas_log(src.split("\n", 1)[1] if src.startswith("//") else src)
    assert "0 bytes spill stores" in log and not wgmma_serialized(log), log
    traced = mla_decode_program.source("sm_90a", h_q=128, s_q=1, seesaw=True, persistent=True, trace=True)
    assert "tc_timeline" in traced and traced.count("clock()") > 8       # bench.trace_mla's persistent case
    for bad in (dict(seesaw=False), dict(kv_format="fp8", block_n=32), dict(h_q=16), dict(page=32)):
        with pytest.raises(ValueError, match="persistent=True is built for"):
            mla_decode_program.source("sm_90a", **{**dict(h_q=128, s_q=1, seesaw=True, persistent=True), **bad})
    for target, bad in (("sm_90a", dict(early_q=True)), ("sm_90a", dict(persistent=False, seesaw=False, h_q=16,
                                                                         swapped=True)),
                        ("ascend", dict(persistent=False, seesaw=False))):   # the output staged in the query tiles
        with pytest.raises(ValueError, match="stage_out=True .* is built for CUDA's two MMA warpgroups"):
            mla_decode_program.source(target, **{**dict(h_q=128, s_q=1, seesaw=True, persistent=True,
                                                        stage_out=True), **bad})
    with pytest.raises(ValueError, match="out_tma=True .* is built for stage_out=True"):
        mla_decode_program.source("sm_90a", h_q=64, s_q=1, out_tma=True)
    for bad in (dict(stage_out=False), dict(persistent=False)):     # the next steps before the query
        with pytest.raises(ValueError, match="kv_first=True .* is built for persistent=True with stage_out=True"):
            mla_decode_program.source("sm_90a", **{**dict(h_q=128, s_q=1, seesaw=True, persistent=True,
                                                          stage_out=True, kv_first=True), **bad})


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 16, [1000, 64], 64), (3, 2, 128, [4096, 1, 0], 64),
                                                  (2, 1, 64, [16384, 8000], 64), (3, 1, 16, [53, 1, 700], 16)])
def test_gpu_fp8_cache(b, s_q, h_q, lens, page):
    run_fp8_case(b, s_q, h_q, lens, page)


# the FP8 cache's swapped kernel at 17-32 rows: the op's until session 52, now its fallback with ROWS64_FP8 = 0
SWAPPED_FP8_32 = dict(block_n=64, stages=2, raw_stages=2, kv_format="fp8", swapped=True, rope_direct=True)


@pytest.mark.gpu
def test_gpu_fp8_swapped_32_rows(monkeypatch):
    """The FP8 kernel at 17-32 query rows with ops.mla_decode.ROWS64_FP8 = 0: swapped, e4m3 -> bf16 in the
    converters, the rope direct (its row statistics in the S^T tile's spare words, or it would not fit). 32 heads,
    and 2 tokens x 16 heads (causal), against the reference; lengths 0 and 1, NaN tails."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ops.mla_decode"), "ROWS64_FP8", 0)
    assert pick_tiling(32, "fp8", "sm_90a", 64) == SWAPPED_FP8_32
    run_fp8_case(3, 1, 32, [1000, 1, 0], 64)
    run_fp8_case(2, 2, 16, [700, 64], 64)


def test_fp8_swapped_kernel_fits_at_32_rows(monkeypatch):
    """The swapped FP8 kernel at 32 rows (the op's with ROWS64_FP8 = 0) needs all of sm_90a's 227 KB of shared memory: 231,424 dynamic bytes
    plus the mbarriers' static ones, which cost a whole KB (the dynamic buffer starts 1 KB aligned after
    them). codegen.jit counts both (at 231,808 + 1 KB the launch failed on the H200, "Session 34"); the
    row statistics kept in the S^T tile's spare words bring it under. Operand tiles 1 KB aligned, no spills."""
    import codegen.jit as jit

    needs = []
    real = jit.block_shared_memory
    monkeypatch.setattr(jit, "block_shared_memory", lambda device_mod: needs.append(real(device_mod)) or needs[-1])
    monkeypatch.setenv("TILECRAFT_DISABLE_DISK_CACHE", "1")       # lowered here, not read from the cache
    src = mla_decode_program.source("sm_90a", h_q=32, s_q=1, **SWAPPED_FP8_32)
    assert needs == [227 * 1024], needs
    assert "extern __shared__ __align__(1024)" in src and "__shared__ __align__(16) uint64_t" in src
    _assert_operand_tiles_1kb_aligned(src)
    _, log = _sass_and_log(src)
    assert " 0 bytes spill stores" in log, log


def k_scaled_dequant(cache):
    """The FP8 cache as ops.mla_decode_fp8_rows64(k_scaled=True) multiplies its latent: each token's e4m3 values times
    fp16(scale_g / the token's largest scale), rounded to fp16, times the largest scale (fp32); the rope as it is."""
    deq = ops.dequantize_mla_kv_fp8(cache)
    raw = cache.view(torch.uint8)
    codes = raw[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[..., 512:528].contiguous().view(torch.float32)                  # (..., 4): a token's group scales
    top = scales.amax(-1, keepdim=True)
    ratio = torch.where(top > 0, scales / top, torch.zeros_like(scales)).half().float()
    lat = (codes.unflatten(-1, (4, 128)) * ratio[..., None]).half().float().flatten(-2) * top
    return torch.cat([lat, deq[..., 512:]], dim=-1)


def assert_batch_invariant(h_q, kv_format="bf16", lens=(5000, 300, 1100)):
    """TILECRAFT_BATCH_INVARIANT=1 must be set by the caller: each sequence's output (and lse) is bitwise the same
    decoded alone and in a batch of len(lens)."""
    q, kv, table, seqlens = make_inputs(len(lens), 1, h_q, list(lens), device="cuda")
    cache = ops.quantize_mla_kv_fp8(kv) if kv_format == "fp8" else kv
    full, full_lse = ops.mla_decode(q, cache, table, seqlens, softmax_scale=0.05, kv_format=kv_format)
    for i in range(len(lens)):
        one, one_lse = ops.mla_decode(q[i:i + 1], cache, table[i:i + 1], seqlens[i:i + 1], softmax_scale=0.05,
                                      kv_format=kv_format)
        assert torch.equal(one, full[i:i + 1]) and torch.equal(one_lse, full_lse[i:i + 1])


def run_fp8_case(b, s_q, h_q, lens, page, tiling=None, exact=False, edit=None, split_knobs=None):
    """exact=False: the reference reads the dequantized cache rounded to bf16, as the kernels that
    convert to bf16 multiply it; exact=True: the dequantized cache in fp32 (fold_scales: fp16
    values exactly e4m3, the scales applied in fp32 and to P); k_scaled tilings: the latent as that
    variant rounds it (k_scaled_dequant). edit(q, kv, table) changes the inputs in place before the cache is
    quantized. split_knobs: get_mla_schedule's max_splits / min_split_blocks for the op's schedule."""
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, device="cuda")
    if edit is not None:
        edit(q, kv, table)
    cache = ops.quantize_mla_kv_fp8(kv)                     # NaN tails stay NaN bytes: must not leak
    scale = D ** -0.5
    if tiling is None:
        sched = None if split_knobs is None else \
            get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64, kv_format="fp8", **split_knobs)
        out, lse = ops.mla_decode(q, cache, table, seqlens, softmax_scale=scale, kv_format="fp8", sched=sched)
    else:                                       # a program variant the op does not choose
        from ops.mla_decode import _mla_decode_impl

        out, lse = _mla_decode_impl(q, cache, table, seqlens, scale, True, None, tiling=tiling, kv_format="fp8")
    assert not out.isnan().any()
    chosen = tiling or pick_tiling(s_q * h_q, "fp8", "sm_90a", page)
    exact = exact or any(chosen.get(k, False) for k in ("fold_scales", "register_fp8", "rows64"))
    # the kernel multiplies the dequantized cache rounded to bf16 (or, exact, unrounded): compare with exactly that
    deq = k_scaled_dequant(cache) if chosen.get("k_scaled") else ops.dequantize_mla_kv_fp8(cache)
    deq = deq if exact else deq.to(torch.bfloat16)
    ref, ref_lse = mla_decode_reference(q, deq, table, seqlens, softmax_scale=scale)
    bound = 8e-4 + (2.01 / 128) * ref.abs() + 6 * 2.0 ** -8 / 3 ** 0.5 * p_rounding_term(q, deq, table, seqlens, scale, True)
    assert ((out.float() - ref).abs() <= bound).all()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)


def test_swapped_operand_probe_lowers_to_wgmma_with_a_transposed_v():
    """bench/proto_mla_swapped.py (the few-heads plan, bench/NOTES.md "MLA v8 probe") keeps building:
    S^T = K Q^T and O^T = V^T P^T lower to WGMMA with 8 heads a warpgroup, the second with its A
    (V^T) read MN-major from the cache tile."""
    import tilelang

    from bench.proto_mla_swapped import swapped_program
    from codegen import targets

    with targets.get("cuda:sm_90a").tvm() as tv:
        src = tilelang.lower(swapped_program(), target=tv).kernel_source
    shapes = set(re.findall(r"wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, "
                            r"(\d+), (\d+), (\d+), (true|false), (true|false)", src))
    assert ("64", "8", "16", "false", "false") in shapes and ("64", "8", "16", "true", "false") in shapes, shapes


def test_swapped_mla_program_lowers_on_sm90a_only():
    """mla_decode_program(swapped=True) (the op's choice for bf16 caches with s_q * h_q <= 32): S^T
    and O^T on WGMMA m64n16 (the PV with an MN-major A) or m64n32 for 17-32 rows, no spills; more
    rows than fit in shared memory (32 with a bf16 cache; 16 with an FP8 one, 32 with its rope direct),
    or a target without
    the swapped rule, is a clear error. The epilogue takes 1 / l once a row (one reciprocal in the source,
    no IEEE division's FCHK in the SASS: it divided each element before session 80)."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    def wgmma_shapes(src):
        return set(re.findall(r"wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, "
                              r"(\d+), (\d+), (\d+), (true|false), (true|false)", src))

    src = mla_decode_program.source("sm_90a", h_q=16, s_q=1, swapped=True)
    assert wgmma_shapes(src) == {("64", "16", "16", "false", "false"), ("64", "16", "16", "true", "false")}
    src32 = mla_decode_program.source("sm_90a", h_q=16, s_q=2, swapped=True)
    assert wgmma_shapes(src32) == {("64", "32", "16", "false", "false"), ("64", "32", "16", "true", "false")}
    with pytest.raises(ValueError, match="bf16 cache takes at most 32 query rows"):
        mla_decode_program.source("sm_90a", h_q=48, s_q=1, swapped=True)
    with pytest.raises(ValueError, match="fp8 cache takes at most 16 query rows"):
        mla_decode_program.source("sm_90a", h_q=32, s_q=1, swapped=True, kv_format="fp8", block_n=64)
    with pytest.raises(ValueError, match="fp8 cache takes at most 32 query rows"):
        mla_decode_program.source("sm_90a", h_q=48, s_q=1, swapped=True, kv_format="fp8", block_n=64,
                                  rope_direct=True)
    fp8 = mla_decode_program.source("sm_90a", h_q=16, s_q=1, swapped=True, kv_format="fp8", block_n=64, stages=2,
                                    raw_stages=2)           # raw bytes in two 32-token chunks a step: 214 KB
    assert max(int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", fp8)) < 220 * 1024
    with pytest.raises(ValueError, match="sm_90a only"):
        mla_decode_program.source("sm_100a", h_q=16, s_q=1, swapped=True)
    try:
        st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    st8 = sass_stats(build_cubin(fp8, "sm_90a"), "sm_90a")
    st32 = sass_stats(build_cubin(src32, "sm_90a"), "sm_90a")
    for text, stats in ((src, st), (fp8, st8), (src32, st32)):
        assert stats.histogram.get("HGMMA", 0) > 0 and stats.spill_stores == 0
        assert text.count("__frcp_rn(") == 1 and stats.histogram.get("FCHK", 0) == 0, stats.histogram


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens", [
    (2, 1, 16, [1000, 64]),
    (3, 1, 16, [4096, 1, 0]),
    (1, 1, 1, [65]),
    (2, 2, 7, [200, 3]),
    (2, 1, 16, [16384, 8000]),  # splits + combine
    (2, 2, 16, [300, 77]),      # 32 rows (m64n32), causal
    (3, 1, 32, [9000, 64, 0]),
])
def test_gpu_swapped_matches_reference(b, s_q, h_q, lens):
    """The experimental swapped-operand program (mla_decode_program(swapped=True)) against the
    reference, with the same bounds as the production kernel."""
    run_gpu_case(b, s_q, h_q, lens, tiling=dict(block_n=64, stages=2, swapped=True))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [
    (2, 1, 128, [1000, 64], 64),      # a tail step; a sequence of one step (no second step in the pair)
    (3, 1, 64, [4096, 1, 0], 64),     # lengths 1 and 0
    (2, 2, 128, [300, 2049], 64),     # causal over 4 row tiles; an odd number of steps
    (2, 1, 64, [16384, 8000], 64),    # splits + combine
    (1, 3, 16, [129], 64),            # 48 rows: one padded row tile
    (2, 4, 32, [7, 5000], 128),       # causal, 128 rows, pages of 128
    (2, 1, 128, [1000, 300], 256),
])
def test_gpu_seesaw_matches_reference(b, s_q, h_q, lens, page):
    """The seesaw schedule (the two MMA warpgroups score alternate steps) against the reference, with
    the production kernel's bounds."""
    run_gpu_case(b, s_q, h_q, lens, page=page, tiling=dict(block_n=64, stages=2, seesaw=True))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page,persistent", [
    (2, 1, 128, [1000, 64], 64, False),      # a tail step; a sequence of one step
    (2, 2, 128, [300, 2049], 64, False),     # causal over 4 row tiles; an odd number of steps
    (2, 1, 64, [16384, 8000], 64, False),    # splits + combine
    (9, 1, 128, [1000, 64, 0, 1, 4097, 65, 128, 3000, 2049], 64, True),
    (2, 4, 32, [7, 5000], 128, True),
])
def test_gpu_seesaw_own_p_is_the_seesaw_bitwise(b, s_q, h_q, lens, page, persistent):
    """own_p (each warpgroup's own P V with P from registers, wgmma RS; the other's still from shared
    memory): the bits of the seesaw, persistent or not, and HGMMA with a register A operand in SASS."""
    from backends.cuda.sass import build_cubin, disassemble

    mla = importlib.import_module("ops.mla_decode")
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, device="cuda")
    scale = D ** -0.5
    sched = mla.get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64)
    tiling = dict(block_n=64, stages=2, seesaw=True, persistent=persistent)
    ref_out, ref_lse = mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched, tiling=tiling)
    out, lse = mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched, tiling={**tiling, "own_p": True})
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    src = mla_decode_program.source("sm_90a", h_q=h_q, s_q=s_q, page=page, **tiling, own_p=True)
    assert src.count("wgmma_rs") == 2                       # one own P V a warpgroup
    sass = disassemble(build_cubin(src.split("\n", 1)[1] if src.startswith("//") else src, "sm_90a"))
    assert re.search(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"early_q": True}, {"stage_out": True}, {"stage_out": True, "kv_first": True},
                                     {"stage_out": True, "out_tma": True}],
                         ids=["direct", "early_q", "stage_out", "kv_first", "out_tma"])
@pytest.mark.parametrize("b,s_q,h_q,lens,page,sms", [
    (9, 1, 128, [1000, 64, 0, 1, 4097, 65, 128, 3000, 2049], 64, 16),   # ~2-3 units a part, odd steps, tails
    (3, 2, 64, [300, 2049, 7], 64, 4),          # causal, two row tiles, every unit on one part
    (2, 1, 64, [16384, 8000], 64, 132),         # splits + combine
    (5, 1, 128, [129, 4096, 1, 777, 64], 128, 10),
    (4, 1, 64, [1000, 300, 5000, 63], 256, 6),
])
def test_gpu_persistent_matches_seesaw_bitwise(monkeypatch, b, s_q, h_q, lens, page, sms, variant):
    """The persistent seesaw without the in-kernel merge (the op's default: merge=False, the splits dealt whole)
    gives each unit exactly the bits of the seesaw CTA of that (sequence, split), however its units are dealt to
    parts (the part count forced low through the SM count, so a CTA runs several units back to back), within the
    reference's bounds, and the same from a CUDA graph; so does early_q (the next unit's query loaded once the last
    scores are done: zero-length and one-step units arrive before their loops), and stage_out (a whole sequence's
    output through the query tiles, the next query loaded after it; with kv_first the next unit's first steps issued
    before that query; with out_tma the staged tiles out by TMA stores)."""
    mla = importlib.import_module("ops.mla_decode")     # (ops.mla_decode is also the op's name)
    monkeypatch.setattr(mla, "_sm_count", lambda device: sms)
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, device="cuda")
    scale = D ** -0.5
    sched = mla.get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64)
    tiling = dict(block_n=64, stages=2, seesaw=True)
    ref_out, ref_lse = mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched, tiling=tiling)
    run = lambda: mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched,  # noqa: E731
                                       tiling={**tiling, "persistent": True, "merge": False, **variant})
    out, lse = run()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert_matches_reference(out, lse, q, kv, table, seqlens, scale)
    run()                                          # warm (no compile inside the capture)
    assert_graph_replay_gives(run, ref_out, ref_lse)


def test_kv_first_issues_the_next_steps_before_the_query():
    """kv_first (tile.Units.steps_first): the producer issues a unit's first steps, then waits for the last unit's
    epilogue (q_empty) and issues the query, then the rest; without it the query goes first (traced, no lowering)."""
    def producer_order(**extra):
        prim, _ = mla_decode_program.traced("sm_90a", dict(h_q=128, s_q=1, **pick_tiling(128, "bf16", "sm_90a", 64),
                                                           **extra))
        ir = prim.script()
        return [m.group(1) for m in re.finditer(r"T\.tma_copy\(T\.region\((KV|Q)\[", ir)]

    assert producer_order() == ["Q"] * 3 + ["KV"] * 3
    assert producer_order(kv_first=True) == ["KV"] * 3 + ["Q"] * 3 + ["KV"] * 3


def test_out_tma_stores_whole_tiles_by_tma():
    """out_tma: a whole staged tile leaves by TMA stores of the query tile's boxes, one elected thread issuing them and
    waiting until they have read it, after every writer's proxy fence and the warpgroup's barrier (a tile with padding
    rows keeps the threads' stores: test_gpu_stage_out_is_the_direct_stores_bitwise at 48 rows)."""
    src = mla_decode_program.source("sm_90a", h_q=64, s_q=1, **dict(pick_tiling(64, "bf16", "sm_90a", 64), out_tma=True))
    assert src.count("tl::tma_store(Out_desc") == 2 and src.count("tl::tma_store_wait<0, true>()") == 2
    assert re.search(r"fence_proxy_async\(\);\s+tl::__sync_thread_partial\(1[01], 128\);\s+if \(tl::tl_shuffle_elect<128>",
                     src), "the writers' fence, the warpgroup's barrier, then one thread's stores"


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,tiling", [
    (3, 1, 64, [4096, 1, 700], dict(block_n=64, stages=2)),             # the plain schedule, whole sequences
    (2, 1, 64, [16384, 8000], dict(block_n=64, stages=2)),              # ... split: fp32 partials stored as before
    (3, 3, 16, [300, 2049, 7], dict(block_n=64, stages=2)),             # 48 rows: a tile's padding rows unwritten
    (2, 1, 128, [16384, 65], dict(block_n=64, stages=2, seesaw=True)),  # seesaw: fp32 partials staged in two passes
    (3, 1, 64, [4096, 1, 700], dict(block_n=32, stages=2, raw_stages=3, kv_format="fp8")),   # the FP8 cache
])
def test_gpu_stage_out_is_the_direct_stores_bitwise(b, s_q, h_q, lens, tiling):
    """stage_out (each warpgroup's output through its latent query tile, 16 bytes a thread) writes the bits the direct
    stores write, outputs and partials, in the non-persistent kernels (the persistent one: its bitwise test)."""
    mla = importlib.import_module("ops.mla_decode")
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, device="cuda")
    fmt = tiling.get("kv_format", "bf16")
    if fmt == "fp8":
        kv = ops.quantize_mla_kv_fp8(kv)
    run = lambda **o: mla._mla_decode_impl(q, kv, table, seqlens, D ** -0.5, True, None,  # noqa: E731
                                           tiling={**tiling, **o}, kv_format=fmt)
    ref_out, ref_lse = run()
    out, lse = run(stage_out=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not out.isnan().any()
    out, lse = run(stage_out=True, out_tma=True)     # whole tiles out by TMA stores (48 rows: the threads' stores)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page,sms,invariant", [
    (9, 1, 128, [1000, 64, 0, 1, 4097, 65, 128, 3000, 2049], 64, 16, False),   # 8 parts: cuts, 3+ pieces
    (3, 2, 64, [300, 2049, 7], 64, 4, False),   # causal, two row tiles, 2 parts
    (2, 1, 64, [16384, 8000], 64, 132, False),  # 66 parts: ~45 pieces a sequence
    (5, 1, 128, [129, 4096, 1, 777, 64], 128, 10, False),
    (4, 1, 64, [1000, 300, 5000, 63], 256, 6, False),
    (128, 1, 128, [4096] * 128, 64, 132, False),   # the issue row's deal (every other sequence cut in two)
    (5, 1, 128, [5000, 300, 9000, 64, 1100], 64, 132, True),   # batch-invariant: the 16-block splits merged
])
@pytest.mark.parametrize("variant", [{}, {"stage_out": True, "out_tma": True}], ids=["direct", "out_tma"])
def test_gpu_persistent_pieces_match_the_reference(monkeypatch, b, s_q, h_q, lens, page, sms, invariant, variant):
    """The persistent seesaw over the cut deal (pieces of sequences merged in the kernel by the last to finish),
    the part count forced through the SM count: within the reference's bounds on NaN-poisoned inputs, the same
    bits run to run and from a CUDA graph, every arrival counter back at 0 after the launch. A sequence dealt as
    one piece has the bits of the seesaw CTA that runs it unsplit (the same products and epilogue). The same with
    the output staged (stage_out; out_tma: whole pieces out by TMA stores, the merged partials by the threads')."""
    mla = importlib.import_module("ops.mla_decode")     # (ops.mla_decode is also the op's name)
    from ops._workspace import arrival_counters

    monkeypatch.setattr(mla, "_sm_count", lambda device: sms)
    q, kv, table, seqlens = make_inputs(b, s_q, h_q, lens, page=page, device="cuda")
    scale = D ** -0.5
    sched = mla.get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64, batch_invariant=invariant)
    tiling = dict(block_n=64, stages=2, seesaw=True, persistent=True, merge=True, **variant)
    run = lambda: mla._mla_decode_impl(q, kv, table, seqlens, scale, True, sched, tiling=tiling)  # noqa: E731
    out, lse = run()
    assert_matches_reference(out, lse, q, kv, table, seqlens, scale)
    m_tiles = -(-s_q * h_q // 64)
    assert not arrival_counters(q.device, 2 * b * m_tiles)[:2 * b * m_tiles].any()
    again = run()
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    pieces, start = sched.persistent_pieces(sms // m_tiles, cut=True)
    whole = [int(r[0]) for r in pieces[:int(start[-1])].cpu() if int(r[4]) == 1]
    if whole and not invariant:
        unsplit = mla.get_mla_schedule(seqlens, s_q, h_q, table.shape[1] * page // 64, max_splits=1)
        ref_out, ref_lse = mla._mla_decode_impl(q, kv, table, seqlens, scale, True, unsplit,
                                                tiling=dict(block_n=64, stages=2, seesaw=True))
        assert torch.equal(out[whole], ref_out[whole]) and torch.equal(lse[whole], ref_lse[whole])
    assert_graph_replay_gives(run, out, lse)


def test_lazy_builds_and_says_what_it_needs():
    """lazy=t (the running max kept until a row's max grows by more than t): each O rescale of the default schedule
    (WG0's, and WG1's through a row fragment) and of the seesaw (two a warpgroup) sits behind a warp vote that skips
    it when none of the warp's rows has a factor other than 1; no spills, no serialized MMAs; lazy=0 gives the
    program without it. It names what it is built for, and the other targets refuse it. (The persistent seesaw's
    four votes: test_persistent_builds_and_says_what_it_needs, which builds the op's lazy persistent program.)"""
    from backends.cuda.sass import wgmma_serialized
    from tests.test_gemm_fp8 import _sass_and_ptxas_log

    src = mla_decode_program.source("sm_90a", h_q=128, s_q=2, block_n=64, stages=2, lazy=8.0)   # (causal, 4 row tiles)
    assert_sm90_roles(src)
    assert src.count("if (tc_warp_any(") == 2 and "__any_sync" in src
    assert "if ((0x1p+3f/*8.000000e+00*/ < (" in src, "the threshold 8 in the max update"
    _, log = _sass_and_ptxas_log(src.split("\n", 1)[1] if src.startswith("//") else src)
    assert "0 bytes spill stores" in log and not wgmma_serialized(log), log
    assert "tc_warp_any" not in mla_decode_program.traced("sm_90a", dict(h_q=128, s_q=1))[0].script()   # (no lowering)
    for bad in (dict(kv_format="fp8", block_n=32), dict(swapped=True, h_q=16), dict(lazy=-1.0)):
        with pytest.raises(ValueError, match="lazy"):
            mla_decode_program.source("sm_90a", **{**dict(h_q=128, s_q=1, lazy=8.0), **bad})
    for target in ("sm_100a", "ascend"):
        with pytest.raises(ValueError, match="lazy=\\) is lowered on cuda:sm_90a only"):
            mla_decode_program.source(target, h_q=128, s_q=1, block_n=64, stages=1, threads=128, lazy=8.0)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page,tiling,gain", [
    (3, 1, 128, [4096, 1, 0], 64, dict(), 1),                            # the default schedule; lengths 1 and 0
    (2, 2, 128, [300, 2049], 64, dict(), 4),                             # causal over 4 row tiles, max jumps
    (2, 1, 64, [16384, 8000], 64, dict(seesaw=True), 4),                 # splits + combine
    (9, 1, 128, [1000, 64, 0, 1, 4097, 65, 128, 3000, 2049], 64, dict(seesaw=True, persistent=True), 1),
    (2, 2, 128, [300, 2049], 128, dict(seesaw=True, persistent=True), 4),
])
def test_gpu_lazy_rescale_matches_the_reference(b, s_q, h_q, lens, page, tiling, gain):
    """lazy=8 (O rescaled only where a row's max grew by more than 2^8): within the reference's bounds on
    NaN-poisoned inputs, the same bits run to run and from a CUDA graph, and lse within 1e-5 of lazy=0's. gain > 1
    multiplies the cache rows of each sequence's last page (exact, a power of two), so that its scores jump past the
    threshold late in the sequence and the rescale path runs as well as the skip."""
    assert_option_within_bounds(b, s_q, h_q, lens, page, {"block_n": 64, "stages": 2, **tiling}, {"lazy": 8.0}, gain)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens", [(2, 1, 128, [1000, 64]), (3, 2, 128, [4096, 1, 0]), (2, 1, 64, [33, 97])])
def test_gpu_fp8_two_converters(b, s_q, h_q, lens):
    """The default operand order over the FP8 cache with WG1 converting half of every 32-token step
    (raw staging in 16-token chunks, two a converter in flight; not yet the op's choice)."""
    run_fp8_case(b, s_q, h_q, lens, 64, tiling=dict(kv_format="fp8", block_n=32, stages=2, raw_rows=16, raw_stages=4))


@pytest.mark.gpu
@pytest.mark.parametrize("stage_raw,rope_direct", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 16, [1000, 64], 64), (3, 1, 16, [53, 1, 0], 64),
                                                 (2, 1, 16, [16384, 8000], 64), (2, 2, 8, [700, 33], 128)])
def test_gpu_swapped_fp8_cache(b, s_q, h_q, lens, page, stage_raw, rope_direct):
    """The swapped program over the FP8 cache: 64-token steps whose raw bytes arrive in two 32-token
    chunks (attention_loop raw_rows=32) that the producer and WG1 convert, straight from shared
    memory or (stage_raw) through registers; rope_direct: the rope by TMA straight into the operand
    tile. Against the reference on the dequantized cache (NaN tails must not leak)."""
    run_fp8_case(b, s_q, h_q, lens, page, tiling=dict(kv_format="fp8", block_n=64, stages=2, raw_stages=2,
                                                      swapped=True, stage_raw=stage_raw, rope_direct=rope_direct))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q,lens,page", [(2, 1, 16, [1000, 64], 64), (3, 1, 16, [53, 1, 0], 64),
                                                 (2, 1, 16, [16384, 8000], 64), (2, 2, 8, [700, 33], 128),
                                                 (4, 1, 1, [4096, 77, 130, 2], 256)])
def test_gpu_swapped_fp8_fold_scales(b, s_q, h_q, lens, page):
    """fold_scales: the e4m3 latent converted exactly to fp16 and the per-128 scales applied to the
    partial scores and to one P per 128 output columns. Against the reference on the exactly
    dequantized cache (fp32), with the bf16 kernels' bounds; NaN tails (their scales too) must not
    leak."""
    run_fp8_case(b, s_q, h_q, lens, page, exact=True,
                 tiling=dict(kv_format="fp8", block_n=64, stages=2, raw_stages=2, swapped=True, rope_direct=True,
                             fold_scales=True))


def test_fold_scales_converts_without_multiplies():
    """fold_scales (swapped FP8): the converters' step is one e4m3 -> fp16x2 unpack per two values
    and 16-byte stores, no scale multiply and no repacking (the plain FP8 kernel: unpack, two
    half -> float, two multiplies and a bf16 pack); the latent MMAs are fp16 WGMMAs, the rope's bf16;
    no spills; it refuses the layouts it is not built for."""
    import collections

    kw = dict(h_q=16, s_q=1, swapped=True, kv_format="fp8", block_n=64, stages=2, raw_stages=2, rope_direct=True)
    src = mla_decode_program.source("sm_90a", fold_scales=True, **kw)
    _assert_operand_tiles_1kb_aligned(src)                  # (test_wgmma_operand_tiles_are_1kb_aligned)
    kinds = collections.Counter(re.findall(r"wgmma_ss<tl::DataType::(\w+), tl::DataType::\w+, tl::DataType::kFloat32, "
                                           r"64, 16, 16, (true|false)", src))
    assert kinds == {("kFloat16", "false"): 4, ("kBFloat16", "false"): 1, ("kFloat16", "true"): 4}, kinds
    sass, log = _sass_and_log(src)
    assert "spill" not in log or " 0 bytes spill stores" in log
    unpacks = sass.count("F2FP.F16.E4M3.UNPACK_B")
    plain_src = mla_decode_program.source("sm_90a", **kw)
    _assert_operand_tiles_1kb_aligned(plain_src)
    plain = _sass_and_log(plain_src)[0]
    assert unpacks >= 64 and sass.count("F2FP.BF16.F32.PACK_AB") < plain.count("F2FP.BF16.F32.PACK_AB") // 4
    assert sass.count("HADD2.F32") < plain.count("HADD2.F32") // 4
    for bad in (dict(kw, stage_raw=True), dict(kw, swapped=False, block_n=32, raw_stages=3, rope_direct=False),
                dict(kw, kv_format="bf16", rope_direct=False)):
        with pytest.raises(ValueError, match="fold_scales=True"):
            mla_decode_program.source("sm_90a", fold_scales=True, **bad)


# (the swapped FP8 kernels with rope_direct, with and without fold_scales, are checked by
# test_fold_scales_converts_without_multiplies, which lowers both anyway)
@pytest.mark.parametrize("kw", [dict(h_q=16, swapped=True, block_n=64),
                                dict(h_q=16, swapped=True, kv_format="fp8", block_n=64, raw_stages=2),
                                dict(h_q=64, kv_format="fp8", block_n=32, raw_stages=3)])
def test_wgmma_operand_tiles_are_1kb_aligned(kw):
    """Every shared tile a WGMMA descriptor reads starts on a 1 KB boundary (its 128-byte swizzle
    repeats every 1 KB). TileLang 0.1.15 packs the dynamic shared buffers without knowing that: a
    64 x 17 S^T tile once put the swapped FP8 kernel's P 256 bytes off, and P V came out wrong."""
    _assert_operand_tiles_1kb_aligned(mla_decode_program.source("sm_90a", s_q=1, stages=2, **kw))


def _assert_operand_tiles_1kb_aligned(src):
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    operands = set(re.findall(r"initialize_wgmma_descriptor<\d+, \d+, \d+>\(\w+, \(&\(\(\(\w+\*\)(\w+)\)\[0\]\)\)\)", src))
    assert operands and operands <= set(offsets), (operands, offsets)
    assert all(int(offsets[b]) % 1024 == 0 for b in operands), {b: int(offsets[b]) for b in operands}


def _sass_and_log(src):
    from tests.test_gemm_fp8 import _sass_and_ptxas_log

    return _sass_and_ptxas_log(src)


def test_stage_raw_and_rope_direct_build_and_say_what_they_need():
    """stage_raw (the swapped FP8 converters read a chunk into registers, reload its staging, then
    convert): it compiles with no spills within the producer's 80 registers, the reload comes before
    the conversion's first bf16 stores, and it refuses a layout without chunks. rope_direct needs
    less shared memory and only exists for the swapped FP8 kernel."""
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    kw = dict(h_q=16, s_q=1, swapped=True, kv_format="fp8", block_n=64, stages=2, raw_stages=2)
    def first_in_producer_loop(src):        # what the producer's step loop does first: reload or convert
        loop = src[src.index("warpgroup_reg_dealloc<80>"):]
        loop = loop[loop.index("for (int k"):]
        return "reload" if loop.index("tma_load") < loop.index("__float22bfloat162_rn") else "convert"

    src = mla_decode_program.source("sm_90a", stage_raw=True, **kw)
    assert first_in_producer_loop(src) == "reload"
    assert first_in_producer_loop(mla_decode_program.source("sm_90a", **kw)) == "convert"
    # rope_direct: the rope is one TMA a step into the operand tile, no raw copy (8 KB less shared memory)
    direct = mla_decode_program.source("sm_90a", rope_direct=True, **kw)
    smem = lambda s: max(int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", s))  # noqa: E731
    assert smem(direct) <= smem(src) - 4096
    with pytest.raises(ValueError, match="rope_direct=True"):
        mla_decode_program.source("sm_90a", h_q=16, s_q=1, rope_direct=True)
    with pytest.raises(ValueError, match="stage_raw=True\\) needs raw staging in chunks"):
        mla_decode_program.source("sm_90a", h_q=16, s_q=1, kv_format="fp8", block_n=32, stages=2, raw_stages=3,
                                  stage_raw=True)
    try:
        st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")
    assert st.histogram.get("HGMMA", 0) > 0 and st.spill_stores == 0


def test_ncu_mla_names_what_it_cannot_run():
    """bench.ncu_mla (one provider's call in a profiler range, for ncu): an unknown provider or one that is not
    importable here exits naming it, before any input is made."""
    from bench import ncu_mla

    with pytest.raises(SystemExit, match="no mla provider 'nope'.*tilecraft-persistent"):
        ncu_mla.main(["nope", "1x1x1x1"])
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="flash_mla: flash_mla is not importable"):
            ncu_mla.main(["flash_mla", "1x1x1x1"])
