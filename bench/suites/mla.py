"""MLA decode (FlashMLA's shapes): the ANCHORS.md grid, varlen seqlen + 2*i, page 64, causal.

bytes = (sum(seqlen) * 576 + b*s_q*h_q*576 + b*s_q*h_q*512) * 2   (cache + q + out, bf16)
        the FP8 cache's providers: sum(seqlen) * 656 for the cache (their GB/s, %ceil and floor)
flops = 2 * s_q * sum(seqlen) * h_q * (576 + 512)
"""

import math

import torch

import ops
from bench.suites import Provider, Suite
from ops.mla_decode import FP8_FOLD, FP8_TOKEN_BYTES, _mla_decode_impl, combine_lanes_for, get_mla_schedule, mla_combine_program, mla_decode_program, pick_tiling

PAGE = 64
D = 576


def _cases(rows):
    return [dict(b=b, h_q=h, s_q=s, seqlen=n) for b, h, s, n in rows]


PRESETS = {
    "decode": _cases([(128, 16, 1, 4096), (128, 16, 1, 8192), (64, 32, 1, 8192), (128, 64, 1, 4096),
                      (128, 128, 1, 4096), (128, 128, 2, 4096), (32, 128, 1, 16384)]),
    "sweep": _cases([(128, 128, 1, n) for n in (1024, 2048, 4096, 8192, 16384, 32768)]),
    # the compute-bound rows of "decode" (h_q = 128: two 64-row tiles a sequence, both reading every kv byte)
    "h128": _cases([(128, 128, 1, 4096), (128, 128, 2, 4096), (32, 128, 1, 16384)]),
    # h_q = 128 where the persistent parts (66 on 132 SMs, two 64-row CTAs each) hold whole sequences evenly (132 and
    # 66 sequences) or not (128: 64 parts run two, 2 idle; 64: 2 parts idle): the cost of whole-unit balancing
    "balance": _cases([(128, 128, 1, 4096), (132, 128, 1, 4096), (64, 128, 1, 8192), (66, 128, 1, 8192)]),
    "small": _cases([(2, 16, 1, 1024), (2, 128, 2, 300)]),
    "fp8": _cases([(128, 16, 1, 4096), (128, 16, 1, 8192)]),   # the rows of the FP8 cache's 1.6x target
    # the FP8 cache above 16 query rows (ops.mla_decode_fp8_rows64 against the op's kernel and the bf16 cache)
    "fp8-64": _cases([(64, 32, 1, 8192), (128, 64, 1, 4096), (8, 64, 1, 8192), (128, 128, 1, 4096),
                      (128, 128, 2, 4096), (32, 128, 1, 16384)]),
    # the FP8 cache's <= 16-row kernel across batch sizes (splits), MTP (2 x 8 rows) and a long context
    "fp8-16": _cases([(1, 16, 1, 8192), (8, 16, 1, 8192), (32, 16, 1, 4096), (64, 16, 1, 8192), (128, 16, 1, 4096),
                      (128, 8, 2, 4096), (16, 16, 1, 32768)]),
    # a batch of one to three 64-row tiles, long contexts: where get_mla_schedule's split cap (SPLIT_CAP, 32 until
    # session 57) bound and the combine's many splits count (the tilecraft-splits-* and *-cw providers)
    "few": _cases([(1, 16, 1, 16384), (1, 32, 1, 16384), (1, 64, 1, 32768), (1, 128, 1, 16384), (2, 16, 1, 32768),
                   (2, 128, 1, 8192), (3, 32, 1, 16384), (1, 16, 2, 65536)]),
    # 17-32 rows (ops.mla_decode.ROWS64_FP8: the 64-row kernel's 32-row tile since session 52) across batch sizes,
    # MTP (2 x 16 rows) and a long context; tilecraft-fp8-swapped32 is the kernel it replaced
    "fp8-32": _cases([(64, 32, 1, 8192), (128, 32, 1, 4096), (8, 32, 1, 8192), (1, 32, 1, 16384), (128, 16, 2, 4096),
                      (16, 32, 1, 32768)]),
}


def seqlens(case):
    return [case["seqlen"] + 2 * i for i in range(case["b"])]


def make_inputs(case, device):
    b, h_q, s_q = case["b"], case["h_q"], case["s_q"]
    lens = seqlens(case)
    max_blocks = math.ceil(max(lens) / PAGE)
    g = torch.Generator(device="cpu").manual_seed(0)
    table = torch.randperm(b * max_blocks, generator=g).view(b, max_blocks).to(torch.int32)
    kv = torch.randn(b * max_blocks, PAGE, 1, D, dtype=torch.bfloat16, device=device)
    q = torch.randn(b, s_q, h_q, D, dtype=torch.bfloat16, device=device) / 4
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return {"q": q, "kv": kv, "table": table.to(device), "lens": lens_t, "scale": D ** -0.5}


def nbytes(case):
    rows = case["b"] * case["s_q"] * case["h_q"]
    return (sum(seqlens(case)) * 576 + rows * 576 + rows * 512) * 2


def nbytes_fp8(case):
    """The FP8 cache's providers: 656 bytes a token (ops.mla_decode.FP8_TOKEN_BYTES) instead of 1152."""
    rows = case["b"] * case["s_q"] * case["h_q"]
    return sum(seqlens(case)) * FP8_TOKEN_BYTES + (rows * 576 + rows * 512) * 2


def flops(case):
    return 2 * case["s_q"] * sum(seqlens(case)) * case["h_q"] * (576 + 512)


def combine_lanes(combine, max_splits):
    """_mla_decode_impl's combine_lanes for a provider's (or bench.prof_mla path's) combine: None, the op's choice;
    "wide", the wide combine with combine_lanes_for's lanes at any split count (the *-cw providers); "3pass", the
    three-pass combine (the *-s56 providers: the op before session 57)."""
    return {None: None, "wide": combine_lanes_for(max_splits), "3pass": 0}[combine]


def tilecraft(case, i, combine=None, **knobs):
    # the schedule is computed once per decode step, like FlashMLA's metadata, outside the timing;
    # knobs: get_mla_schedule's max_splits / min_split_blocks (the tilecraft-splits-* providers)
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1], **knobs)
    ops.mla_decode(i["q"], i["kv"], i["table"], i["lens"], softmax_scale=i["scale"], sched=sched)  # validates once
    return lambda: _mla_decode_impl(i["q"], i["kv"], i["table"], i["lens"], i["scale"], True, sched,
                                    combine_lanes=combine_lanes(combine, sched.max_splits))


def tilecraft_fp8(case, i, combine=None, **knobs):
    """The same rows over the FP8 cache (656 bytes a token instead of 1152; its GB/s counts those)."""
    if "kv8" not in i:
        i["kv8"] = ops.quantize_mla_kv_fp8(i["kv"])
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1], kv_format="fp8", **knobs)
    ops.mla_decode(i["q"], i["kv8"], i["table"], i["lens"], softmax_scale=i["scale"], sched=sched, kv_format="fp8")
    return lambda: _mla_decode_impl(i["q"], i["kv8"], i["table"], i["lens"], i["scale"], True, sched, kv_format="fp8",
                                    combine_lanes=combine_lanes(combine, sched.max_splits))


def fp8_staged(case, i):
    """The FP8 cache through the op's tiling with stage_out=True (the output through the query tiles, 16 bytes a thread;
    bench/NOTES.md "Session 79"), where that tiling is the default operand order (> 32 rows: h_q 64 and 128), with the
    op's FP8 schedule; its GPU test passed at 64 rows, never benched."""
    tiling = pick_tiling(case["s_q"] * case["h_q"], "fp8", "sm_90a", PAGE)
    if tiling.get("swapped") or tiling.get("rows64") or tiling.get("register_fp8"):
        raise ValueError(f"the FP8 cache at {case['s_q'] * case['h_q']} rows is not in the default operand order")
    if "kv8" not in i:
        i["kv8"] = ops.quantize_mla_kv_fp8(i["kv"])
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1], kv_format="fp8")
    run = lambda: _mla_decode_impl(i["q"], i["kv8"], i["table"], i["lens"], i["scale"], True, sched,  # noqa: E731
                                   tiling=dict(tiling, stage_out=True), kv_format="fp8")
    run()                                        # compiles (or says why this shape cannot take it)
    return run


def tilecraft_variant(case, i, tiling):
    """A kernel variant the op does not choose yet (bench/NOTES.md "MLA v9"), forced by its tiling;
    the FP8 cache when tiling says kv_format="fp8"."""
    fmt = tiling.get("kv_format", "bf16")
    if fmt == "fp8" and "kv8" not in i:
        i["kv8"] = ops.quantize_mla_kv_fp8(i["kv"])
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1])
    run = lambda: _mla_decode_impl(i["q"], i["kv8" if fmt == "fp8" else "kv"], i["table"], i["lens"],  # noqa: E731
                                   i["scale"], True, sched, tiling=tiling, kv_format=fmt)
    run()                                        # compiles (or says why this shape cannot take it)
    return run


def fp8_register(case, i, **options):
    """The FP8 cache through ops.mla_decode_fp8_rs (the e4m3 latent converted straight into WGMMA's
    register operand, two CTAs an SM; s_q * h_q <= 16), with a schedule that counts two CTAs an SM
    (chains=2: mla_decode_fp8_rs2, two MMA warpgroups in one CTA an SM, the schedule counts one)."""
    if "kv8" not in i:
        i["kv8"] = ops.quantize_mla_kv_fp8(i["kv"])
    blocks = 1 if options.get("chains") == 2 else options.get("blocks_per_sm", 2)
    sms = torch.cuda.get_device_properties(i["q"].device).multi_processor_count
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1], num_sms=blocks * sms)
    tiling = dict(register_fp8=True, kv_format="fp8", **options)
    run = lambda: _mla_decode_impl(i["q"], i["kv8"], i["table"], i["lens"], i["scale"], True, sched,  # noqa: E731
                                   tiling=tiling, kv_format="fp8")
    run()                                        # compiles (or says why this shape cannot take it)
    return run


def fp8_rows64(case, i, **options):
    """The FP8 cache through ops.mla_decode_fp8_rows64 (64 query rows a CTA, the e4m3 latent converted into WGMMA's
    register operand, the two MMA warpgroups in a seesaw; the op's at 17-32 rows since session 52). options:
    v_scaled=True (the scales in V's fragment, one P copy, three stages), k_scaled=True (the scales in K's fragments
    as ratios to each token's largest: one drain for the scores)."""
    if "kv8" not in i:
        i["kv8"] = ops.quantize_mla_kv_fp8(i["kv"])
    sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1])
    run = lambda: _mla_decode_impl(i["q"], i["kv8"], i["table"], i["lens"], i["scale"], True, sched,  # noqa: E731
                                   tiling=dict(kv_format="fp8", rows64=True, **options), kv_format="fp8")
    run()                                        # compiles (or says why this shape cannot take it)
    return run


# the FP8 cache's kernel at 17-32 rows before session 52 (ops.mla_decode.ROWS64_FP8 = 0 gives it back)
FP8_SWAPPED_32 = dict(block_n=64, stages=2, raw_stages=2, kv_format="fp8", swapped=True, rope_direct=True)


def fp8_swapped_with(case, i, **options):
    """The FP8 cache through the swapped fold kernel (FP8_FOLD) with its options changed:
    stage_raw (the converters read a raw chunk into registers and reload its staging before
    converting), rope_direct=False (the bf16 rope staged raw and copied, as before "MLA v10");
    s_q * h_q <= 16."""
    if case["s_q"] * case["h_q"] > 16:
        raise ValueError(f"{sorted(options)} are built for the swapped kernel (s_q * h_q <= 16), got "
                         f"{case['s_q'] * case['h_q']} rows")
    tiling = dict(FP8_FOLD, **options)
    if tiling.get("stage_raw"):          # built for the bf16-operand converters only
        tiling["fold_scales"] = False
    return tilecraft_variant(case, i, tiling)


def plain_tiling(case):
    """pick_tiling's bf16 tiling without its schedule (seesaw, persistent, lazy: the op's choice at 128+ rows) and
    without stage_out (the output through the query tiles, the op's choice in the default operand order since
    session 79), so that the providers below name each choice themselves."""
    t = pick_tiling(case["s_q"] * case["h_q"], "bf16", "sm_90a", PAGE)
    return {k: v for k, v in t.items() if k not in ("seesaw", "persistent", "lazy", "stage_out")}


def seesaw(case, i, **options):
    """The bf16 cache through the seesaw schedule (bench/NOTES.md "MLA v13"): the two MMA warpgroups
    score alternate steps; s_q * h_q above the swapped kernel's rows. options: own_p=True (each
    warpgroup's own P V from registers)."""
    tiling = dict(plain_tiling(case), seesaw=True, **options)
    if tiling.get("swapped"):
        raise ValueError(f"seesaw is built for the default operand order, not for {case['s_q'] * case['h_q']} rows "
                         "(swapped)")
    return tilecraft_variant(case, i, tiling)


def op_variant(case, i, needs, without=(), **options):
    """The op's own bf16 tiling where it holds `needs` ("stage_out": the default operand order, > 32 rows;
    "persistent": 128+ rows), less the keys `without`, plus `options` (bench/NOTES.md "Session 79"): without
    stage_out, the op before session 79 (each thread stores its accumulator's values); out_tma (the staged tiles out
    by TMA stores); kv_first (the next piece's first steps load under the epilogue, its query after it); merge (the
    cut deal, merged in the kernel)."""
    tiling = pick_tiling(case["s_q"] * case["h_q"], "bf16", "sm_90a", PAGE)
    if not tiling.get(needs):
        raise ValueError(f"the op's tiling at {case['s_q'] * case['h_q']} rows has no {needs} ({tiling})")
    return tilecraft_variant(case, i, {**{k: v for k, v in tiling.items() if k not in without}, **options})


def persistent(case, i, **options):
    """The seesaw in one wave of persistent CTAs (bench/NOTES.md "MLA persistent seesaw"): each part's
    units back to back, the next unit's query and first steps loading under the last one's output; the
    schedule's splits dealt whole and merged by the combine kernel unless merge=True (the cut deal, merged in
    the kernel: bench/NOTES.md "Session 76")."""
    tiling = dict(plain_tiling(case), seesaw=True, persistent=True, **{"merge": False, **options})
    return tilecraft_variant(case, i, tiling)   # (the program says which shapes it is built for)


# two converters: FP8 in the default operand order, WG1 converting half of every step (16-token chunks)
FP8_TWO_CONVERTERS = dict(kv_format="fp8", block_n=32, stages=2, raw_rows=16, raw_stages=4)


def torch_reference(case, i):
    return lambda: ops.mla_decode_reference(i["q"], i["kv"], i["table"], i["lens"], softmax_scale=i["scale"])


def _flash_mla_missing():
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return "flash_mla is not importable (build FlashMLA beside Tilecraft to compare in the same run)"
    return None


def flash_mla(case, i):
    import flash_mla as fm

    s_q, h_q = case["s_q"], case["h_q"]
    meta, splits = fm.get_mla_metadata(i["lens"], s_q * h_q, 1)
    return lambda: fm.flash_mla_with_kvcache(i["q"], i["kv"], i["table"], i["lens"], 512, meta, splits,
                                             softmax_scale=i["scale"], causal=True)


SUITE = Suite(
    name="mla",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=nbytes,
    flops=flops,
    providers=[
        Provider("tilecraft", tilecraft),
        Provider("tilecraft-fp8", tilecraft_fp8, nbytes=nbytes_fp8),
        Provider("tilecraft-seesaw", seesaw, experimental=True),
        # the op before session 57: at most 32 splits a sequence, the three-pass combine at any split count
        Provider("tilecraft-s56", lambda c, i: tilecraft(c, i, combine="3pass", max_splits=32), experimental=True),
        Provider("tilecraft-fp8-s56", lambda c, i: tilecraft_fp8(c, i, combine="3pass", max_splits=32),
                 experimental=True, nbytes=nbytes_fp8),
        # the wide combine at any split count (the op takes it above 8 splits a sequence)
        Provider("tilecraft-cw", lambda c, i: tilecraft(c, i, combine="wide"), experimental=True),
        # get_mla_schedule(min_split_blocks=) below the default 4: splits of 2 / 1 blocks (preset `few`)
        Provider("tilecraft-splits-2", lambda c, i: tilecraft(c, i, min_split_blocks=2), experimental=True),
        Provider("tilecraft-splits-1", lambda c, i: tilecraft(c, i, min_split_blocks=1), experimental=True),
        Provider("tilecraft-fp8-splits-2", lambda c, i: tilecraft_fp8(c, i, min_split_blocks=2), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-persistent", persistent, experimental=True),
        Provider("tilecraft-seesaw-own-p", lambda c, i: seesaw(c, i, own_p=True), experimental=True),
        Provider("tilecraft-persistent-own-p", lambda c, i: persistent(c, i, own_p=True), experimental=True),
        # the running max kept until a row's max grows by 2^8, O rescaled only where alpha != 1 (NOTES "Session 70")
        Provider("tilecraft-lazy", lambda c, i: tilecraft_variant(c, i, dict(plain_tiling(c), lazy=8.0)),
                 experimental=True),
        # the two-warpgroup schedule (one scores, one multiplies by V), the op's default below 128 rows
        Provider("tilecraft-plain", lambda c, i: tilecraft_variant(c, i, plain_tiling(c)), experimental=True),
        Provider("tilecraft-seesaw-lazy", lambda c, i: seesaw(c, i, lazy=8.0), experimental=True),
        Provider("tilecraft-persistent-lazy", lambda c, i: persistent(c, i, lazy=8.0), experimental=True),
        # the sequences cut at the parts' shares, the pieces merged in the kernel (NOTES "Session 76")
        Provider("tilecraft-persistent-merge", lambda c, i: persistent(c, i, lazy=8.0, merge=True),
                 experimental=True),
        # the next piece's query loaded once the last scores are done, not after the last P V (NOTES "Session 77")
        Provider("tilecraft-persistent-earlyq", lambda c, i: persistent(c, i, lazy=8.0, early_q=True),
                 experimental=True),
        # the op's tiling with the accumulator stored directly, not staged in the query tiles (NOTES "Session 79")
        Provider("tilecraft-direct", lambda c, i: op_variant(c, i, "stage_out", without=("stage_out",)),
                 experimental=True),
        # ... and the next piece's first steps issued before its query, under the epilogue (NOTES "Session 79")
        Provider("tilecraft-kvfirst", lambda c, i: op_variant(c, i, "persistent", kv_first=True), experimental=True),
        # ... or the staged output out by TMA stores (NOTES "Session 79")
        Provider("tilecraft-outtma", lambda c, i: op_variant(c, i, "stage_out", out_tma=True), experimental=True),
        Provider("tilecraft-kvfirst-outtma", lambda c, i: op_variant(c, i, "persistent", kv_first=True, out_tma=True),
                 experimental=True),
        # the op's tiling over the cut deal, merged in the kernel (NOTES "Session 76"; re-measured with stage_out)
        Provider("tilecraft-merge", lambda c, i: op_variant(c, i, "persistent", merge=True), experimental=True),
        Provider("tilecraft-fp8-stageout", fp8_staged, experimental=True, nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-staged", lambda c, i: fp8_swapped_with(c, i, stage_raw=True), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-raw-rope", lambda c, i: fp8_swapped_with(c, i, rope_direct=False), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-unfolded", lambda c, i: fp8_swapped_with(c, i, fold_scales=False), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rs", fp8_register, experimental=True, nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-fold", lambda c, i: tilecraft_variant(c, i, FP8_FOLD), experimental=True,
                 nbytes=nbytes_fp8),
        # two MMA warpgroups a CTA on alternate steps: the op's kernel since session 37 (tilecraft-fp8 runs it)
        Provider("tilecraft-fp8-rows64", fp8_rows64, experimental=True, nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rows64-vs", lambda c, i: fp8_rows64(c, i, v_scaled=True), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rows64-vks", lambda c, i: fp8_rows64(c, i, v_scaled=True, k_scaled=True),
                 experimental=True, nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-swapped32", lambda c, i: tilecraft_variant(c, i, FP8_SWAPPED_32), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rs2", lambda c, i: fp8_register(c, i, chains=2), experimental=True, nbytes=nbytes_fp8),
        # the same without its pace (ops.mla_decode_fp8_rs.RS2_PACE: every CTA streams as fast as the DRAM serves its SM)
        Provider("tilecraft-fp8-rs2-nopace", lambda c, i: fp8_register(c, i, chains=2, pace=0), experimental=True,
                 nbytes=nbytes_fp8),
        # the same with K on two register fragments (ops.mla_decode_fp8_rs.RS2_THIRD_FRAGMENT: the op's has three)
        Provider("tilecraft-fp8-rs2-two-fragments", lambda c, i: fp8_register(c, i, chains=2, third_fragment=None),
                 experimental=True, nbytes=nbytes_fp8),
        # the same with each stage six 2-D TMA boxes (RS2_STAGE: the op's is one bulk copy of the step's 41,984 bytes)
        Provider("tilecraft-fp8-rs2-boxes", lambda c, i: fp8_register(c, i, chains=2, stage="boxes"),
                 experimental=True, nbytes=nbytes_fp8),
        # the two-CTA rs kernel with split 0 (the older CTA on its SM) taking 33 or 34 of 64 steps (NOTES "Session 36")
        Provider("tilecraft-fp8-rs-w33", lambda c, i: fp8_register(c, i, older_64ths=33), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rs-w34", lambda c, i: fp8_register(c, i, older_64ths=34), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-rs-1cta", lambda c, i: fp8_register(c, i, blocks_per_sm=1), experimental=True,
                 nbytes=nbytes_fp8),
        Provider("tilecraft-fp8-two-converters", lambda c, i: tilecraft_variant(c, i, FP8_TWO_CONVERTERS),
                 experimental=True, nbytes=nbytes_fp8),
        Provider("flash_mla", flash_mla, available=_flash_mla_missing, peer=True),
        Provider("torch", torch_reference, graphable=False),   # (a host sync a sequence: int(cache_seqlens[i]))
    ],
    kernels=lambda c, t: [(mla_decode_program, dict(h_q=c["h_q"], s_q=c["s_q"], page=PAGE,
                                                     **pick_tiling(c["h_q"] * c["s_q"], "bf16", t, PAGE))),
                       (mla_combine_program, dict(h_q=c["h_q"], s_q=c["s_q"]))],
    label=lambda c: f"b={c['b']} h_q={c['h_q']} s_q={c['s_q']} seqlen={c['seqlen']}",
    reference="torch",
)
