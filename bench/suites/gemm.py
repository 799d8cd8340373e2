"""Block-scaled FP8 GEMMs (DeepGEMM layouts, NT) and MXFP4-weight GEMMs.

dense/grouped: flops = 2*m*n*k; bytes = m*k + n*k (fp8) + m*n*2 (bf16 out) + scales
mxfp4 (bf16 a, e2m1 weights + an E8M0 byte per 32): the torch provider runs the bf16 GEMMs of the
same shapes (per group for the grouped presets), what an engine without FP4 kernels runs; tilecraft-w4a8 the
same weights against e4m3 activations (ops.mxfp4_w4a8_gemm_nt).
"""

import torch

import ops
from bench.suites import Provider, Suite, with_switch
from ops.gemm_fp8 import fp8_gemm_program
from ops.gemm_mxfp4 import (SWAPPED_K_ALIGN, SWAPPED_TOKENS, mxfp4_gemm_program, mxfp4_grouped_program,
                            mxfp4_masked_swapped_program, mxfp4_swapped_program, plan_masked_swapped)
from ops.gemm_mxfp4 import plan as mxfp4_plan, plan_swapped

DECODE_NK = [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
PRESETS = {
    "prefill": [dict(kind="dense", m=4096, n=7168, k=16384)],
    "decode": [dict(kind="dense", m=m, n=n, k=k) for m in (64, 128) for n, k in DECODE_NK],
    # a few tokens (small-batch decode) on the split plans of the MLA down projections (q_a 1536, kv_a 576, fused 2112)
    "decode-few": [dict(kind="dense", m=m, n=n, k=7168) for m in (1, 8, 16, 32) for n in (2112, 1536, 576)],
    # ops.gemm_fp8.PAIR_HALF_TILES' rows: 17-64 tokens on the fused MLA down projection (2112 = 1536 + 576)
    "pair-half": [dict(kind="dense", m=m, n=2112, k=7168) for m in (17, 32, 48, 64)],
    "grouped": [dict(kind="contiguous", groups=4, m=8192, n=4096, k=7168),
                dict(kind="masked", groups=1, m=1024, n=4096, k=7168)],
    "mxfp4": [dict(kind="mxfp4", m=m, n=n, k=k) for m in (1, 8, 16, 64) for n, k in ((7168, 2048), (4096, 7168))],
    # 32 and 64 tokens, where ops.gemm_mxfp4.swapped_block_n picks 64-row blocks (7168x2048, 7168x4096) and not
    # (4096x7168): for the width A/Bs (providers tilecraft-swapped-n64 / -n128)
    "mxfp4-block-n": [dict(kind="mxfp4", m=m, n=n, k=k) for m in (32, 64)
                      for n, k in ((7168, 2048), (7168, 4096), (4096, 7168))],
    # where the chains' width rule ops.gemm_mxfp4.SWAPPED_CHAINS_WHERE ("any") differs from "unsplit" / "split"
    # (providers tilecraft-chains-unsplit / -split): split 64-row plans (4096x7168, 2048x7168), 128-row pairs (16
    # tokens) and one-split plans (24576x1536)
    "mxfp4-chains": [dict(kind="mxfp4", m=m, n=n, k=k) for m in (16, 32, 64)
                     for n, k in ((7168, 2048), (4096, 7168), (2048, 7168), (24576, 1536))],
    # the rows the warp kernel takes (ops.gemm_mxfp4.WARP_TOKENS), for its A/Bs
    "mxfp4-warps": [dict(kind="mxfp4", m=m, n=n, k=k) for m in (1, 8) for n, k in ((7168, 2048), (4096, 7168))],
    # m rows per group: MoE prefill (contiguous, 128-aligned segments) and decode (masked)
    "mxfp4-grouped": [dict(kind="mxfp4-contiguous", groups=4, m=1024, n=4096, k=7168),
                      dict(kind="mxfp4-masked", groups=8, m=64, n=4096, k=7168),
                      dict(kind="mxfp4-masked", groups=8, m=64, n=7168, k=2048)],   # an expert's down projection
    # MoE decode with a few tokens an expert (masked, expected_m = m): the up and down projections
    "mxfp4-moe-decode": [dict(kind="mxfp4-masked", groups=8, m=4, n=4096, k=7168),
                         dict(kind="mxfp4-masked", groups=8, m=4, n=7168, k=2048)],
    # MoE prefill alone (contiguous): the up projection at two sizes (the larger one the FP8 grouped preset's) and the
    # down projection; then dense prefill GEMMs (one weight, m > 64: mxfp4_w4a8_gemm_nt runs the contiguous kernel)
    "mxfp4-prefill": [dict(kind="mxfp4-contiguous", groups=4, m=1024, n=4096, k=7168),
                      dict(kind="mxfp4-contiguous", groups=4, m=8192, n=4096, k=7168),
                      dict(kind="mxfp4-contiguous", groups=8, m=1024, n=7168, k=2048),
                      dict(kind="mxfp4", m=4096, n=4096, k=7168),
                      dict(kind="mxfp4", m=4096, n=7168, k=2048)],
}
MXFP4_KINDS = ("mxfp4", "mxfp4-contiguous", "mxfp4-masked")


def make_inputs(case, device):
    g = torch.Generator().manual_seed(0)
    if case["kind"] in MXFP4_KINDS:
        G = case.get("groups", 1)
        a = torch.randn(G, case["m"], case["k"], generator=g).bfloat16().to(device)
        w = torch.randn(G, case["n"], case["k"], generator=g).bfloat16().to(device)
        packed, scales = map(torch.stack, zip(*(ops.quant_mxfp4(w[e]) for e in range(G))))
        out = {"a": a, "w": w, "packed": packed, "scales": scales}
        if case["kind"] == "mxfp4-contiguous":
            out["a"] = a.view(G * case["m"], case["k"])
            out["m_indices"] = torch.arange(G, device=device, dtype=torch.int32).repeat_interleave(case["m"])
        if case["kind"] == "mxfp4-masked":
            out["masked_m"] = torch.full((G,), case["m"], dtype=torch.int32, device=device)
        return out
    G = case.get("groups", 1)
    m, n, k = case["m"], case["n"], case["k"]
    rows = m * G
    a = torch.randn(rows, k, generator=g).to(device)
    qa, sfa = ops.per_token_group_quant_fp8(a)
    bs = [ops.per_block_quant_fp8(torch.randn(n, k, generator=g).to(device)) for _ in range(G)]
    qb, sfb = torch.stack([q for q, _ in bs]), torch.stack([s for _, s in bs])
    out = {"qa": qa, "sfa": sfa, "qb": qb, "sfb": sfb}
    if case["kind"] == "contiguous":
        out["m_indices"] = torch.arange(G, device=device, dtype=torch.int32).repeat_interleave(m)
    if case["kind"] == "masked":
        out["qa"], out["sfa"] = qa.view(G, m, k), sfa.view(G, m, -1)
        out["masked_m"] = torch.full((G,), m, dtype=torch.int32, device=device)
    return out


def flops(case):
    return 2 * case.get("groups", 1) * case["m"] * case["n"] * case["k"]


def nbytes(case):
    G = case.get("groups", 1)
    if case["kind"] in MXFP4_KINDS:  # bf16 a, 4-bit weights + one scale byte per 32, bf16 out
        return G * (case["m"] * case["k"] * 2 + case["n"] * case["k"] // 2 + case["n"] * case["k"] // 32
                    + case["m"] * case["n"] * 2)
    return G * (case["m"] * case["k"] + case["n"] * case["k"] + case["m"] * case["n"] * 2)


def tilecraft(case, i):
    if case["kind"] == "mxfp4":
        return lambda: ops.mxfp4_gemm_nt(i["a"][0], i["packed"][0], i["scales"][0])
    if case["kind"] == "mxfp4-contiguous":
        return lambda: ops.m_grouped_mxfp4_gemm_nt_contiguous(i["a"], i["packed"], i["scales"], i["m_indices"])
    if case["kind"] == "mxfp4-masked":
        return lambda: ops.m_grouped_mxfp4_gemm_nt_masked(i["a"], i["packed"], i["scales"], i["masked_m"], case["m"])
    if case["kind"] == "dense":
        return lambda: ops.fp8_gemm_nt(i["qa"], i["sfa"], i["qb"][0], i["sfb"][0])
    if case["kind"] == "contiguous":
        return lambda: ops.m_grouped_fp8_gemm_nt_contiguous(i["qa"], i["sfa"], i["qb"], i["sfb"], i["m_indices"])
    return lambda: ops.m_grouped_fp8_gemm_nt_masked(i["qa"], i["sfa"], i["qb"], i["sfb"], i["masked_m"], case["m"])


def tilecraft_w4a8(case, i, group=False):
    """ops.mxfp4_w4a8_gemm_nt (mxfp4), ops.m_grouped_mxfp4_w4a8_gemm_nt_masked (mxfp4-masked) or
    ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous (mxfp4-contiguous) on the same weights (prepared once, outside the
    timing) and the activations as e4m3 with a per-token scale, or (group, the tilecraft-w4a8-group provider) per
    (token, 128 columns) from per_token_group_quant_fp8 (quantized outside the timing, as an engine's previous kernel
    would hand them over)."""
    if case["kind"] not in MXFP4_KINDS:
        raise ValueError(f"tilecraft-w4a8 runs the mxfp4 cases (MXFP4 weights), got kind {case['kind']!r}")
    a = i["a"].float()                                   # (groups, m, k)
    if group:
        a8, sa = ops.per_token_group_quant_fp8(a.view(-1, a.shape[-1]))
        a8, sa = a8.view(a.shape), sa.view(*a.shape[:-1], -1)
    else:
        sa = (a.abs().amax(-1) / 448).clamp(min=2 ** -120)
        a8 = (a / sa[..., None]).to(torch.float8_e4m3fn)
    if case["kind"] == "mxfp4":
        prep = ops.prepare_mxfp4_w4a8(i["packed"][0], i["scales"][0])
        return lambda: ops.mxfp4_w4a8_gemm_nt(a8[0], sa[0], *prep)
    prep = ops.prepare_mxfp4_w4a8(i["packed"], i["scales"])
    if case["kind"] == "mxfp4-contiguous":
        return lambda: ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a8, sa, *prep, i["m_indices"])
    return lambda: ops.m_grouped_mxfp4_w4a8_gemm_nt_masked(a8, sa, *prep, i["masked_m"])


def tilecraft_w4a8_with(flag, value=True):
    """tilecraft-w4a8 with ops.gemm_w4a8.<flag> = value: W4A8_FOLD (every split plan folds its partials in the
    kernel; False: none does, the reduce kernel instead), W4A8_SCALE_TMA (the table offsets by TMA on every plan),
    W4A8_PAIR_WIDE False (2-split plans over 16 tokens through the reduce kernel), W4A8_MASKED_SA_TMA False (the
    masked kernel's token scales loaded in its epilogue), W4A8_MASKED_STAGED False (its C tile stored from the
    accumulator's layout), W4A8_MASKED_TILES False (one n tile a masked block),
    W4A8_STAGE_OUT (True: every split plan's partials, or the pair's C, out through shared memory as whole rows;
    False: none; the default stages 64-token tiles'), W4A8_BURST_64 None (64-token tiles drain the WGMMA pipeline
    every 4 steps, the loop's default, instead of 8), W4A8_CONTIGUOUS_TILE 64 (the contiguous kernel's 64-token
    tiles, two promotion temporaries), W4A8_WHOLE_BURSTS False (the masked and contiguous loops with their tail
    bursts, which never run), W4A8_CHAINS False (no 64-row blocks in two K chains; "any": the chains also where the
    128-row plan has one split), W4A8_CHAINS_TOKENS 16 (the chains from 16-token tiles only)."""
    def make(case, i):
        from ops import gemm_w4a8

        return with_switch(tilecraft_w4a8, gemm_w4a8, flag, value)(case, i)
    return make


def tilecraft_w4a8_chains_pair(value):
    """tilecraft-w4a8 with ops.gemm_mxfp4.SWAPPED_CHAINS_PAIR = value: False, chained 2-split plans (32-64 tokens at
    4096x7168) write partials for the reduce kernel instead of folding in a cluster pair; "all", the chains' pair also
    where the 64-row plan pairs (1-16 tokens at 4096x7168)."""
    def make(case, i):
        from ops import gemm_mxfp4

        return with_switch(tilecraft_w4a8, gemm_mxfp4, "SWAPPED_CHAINS_PAIR", value)(case, i)
    return make


def _with_flag(module, name, value):
    """A provider: the op (tilecraft) with the module-level switch `name` of `module` set to value."""
    return with_switch(tilecraft, module, name, value)


def tilecraft_loop(overlap):
    """The op with its K loop forced (ops.gemm_fp8.OVERLAP): v2 or v3 against the default choice."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "OVERLAP", overlap)


def tilecraft_split(case, i):
    """The op with ops.gemm_fp8.THIN_TILES off: split-K wherever the tiles leave most SMs idle (the
    plans before session 23), against the default's one-wave thin tiles in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "THIN_TILES", False)(case, i)


def tilecraft_thin2wg(case, i):
    """The op with its thin plans on two MMA warpgroups a tile (ops.gemm_fp8.THIN_THREADS = 256, the
    plans of session 23), against the default's one in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "THIN_THREADS", 256)(case, i)


def tilecraft_regstore(case, i):
    """The op with ops.gemm_fp8.STAGE_C off: C stored from the accumulator's registers (the epilogue
    before session 25), against the default's staged rows in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "STAGE_C", False)(case, i)


def tilecraft_onetile(case, i):
    """The op with ops.gemm_fp8.PERSISTENT off: one tile a CTA, against the default's persistent CTAs
    in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "PERSISTENT", False)(case, i)


def tilecraft_narrow(case, i):
    """The op with ops.gemm_fp8.WIDE_TILES off: 128 x 128 tiles where the default takes 128 x 256 (two
    column passes), against the default in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "WIDE_TILES", False)(case, i)


def tilecraft_128wide(case, i):
    """The op with ops.gemm_fp8.TILES_192 off: 128-wide tiles (persistent CTAs over 1.45 waves at
    x24576x1536) where the default takes 192-wide ones in one wave, against the default in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "TILES_192", False)(case, i)


def tilecraft_multicast(case, i):
    """The op with ops.gemm_fp8.MULTICAST on: clusters of two n-neighbours share each A tile by TMA
    multicast (where the plan has two waves of tiles or more), against the default in the same run."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "MULTICAST", True)(case, i)


def tilecraft_pairs(block_n):
    """The dense op (at most 128 rows) forced onto 64-row tiles block_n wide on one MMA warpgroup in 2 splits, each
    tile's pair folding through distributed shared memory, up to 16 stages (ops.gemm_fp8._launch overrides): e.g.
    64x2112x7168 at 32 wide (66 tiles x 2 = 132 blocks in 66 clusters of two), 128x2112x7168 at 64, 128x4096x7168 at
    128, against their plans (4 splits and the reduce kernel; thin tiles reading A or B from L2 once a tile each).
    Shapes whose pairs do not fit in one wave run slower (expected)."""
    def make(case, i):
        from ops.gemm_fp8 import _fit_exchange, _launch

        m, n, k = case["m"], case["n"], case["k"]
        if case["kind"] != "dense" or m > 128 or n % block_n:
            raise ValueError(f"tilecraft-pair{block_n} times dense GEMMs of at most 128 rows with n a multiple of "
                             f"{block_n}")
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        aux = torch.empty(m, dtype=torch.int32, device="cuda"), torch.empty(1, dtype=torch.int32, device="cuda")
        args = (i["qa"], i["sfa"], i["qb"], i["sfb"], *aux, out, n, k)      # (b and sfb stacked: one group)
        stages = _fit_exchange(dict(block_m=64, block_n=block_n, splits=2, stages=16), k)["stages"]

        def run():
            _launch("dense", *args, block_m=64, block_n=block_n, splits=2, stages=stages, threads=128, cluster=True,
                    cluster_smem=True)
            return out
        return run
    return make


def _with_flag_lazy(name, value):
    """A provider: the op with ops.gemm_fp8's switch `name` set to value (imported when it runs)."""
    def make(case, i):
        from ops import gemm_fp8

        return _with_flag(gemm_fp8, name, value)(case, i)
    return make


def tilecraft_raster8(case, i):
    """The op with ops.gemm_fp8.RASTER = 8: blocks take their tiles in groups of 8 m tiles (the prefill
    read 656 MB from DRAM instead of 905 in session 26, at about the same speed), against the default's
    row-major order in the same run: under the eager loop's power limit, fewer DRAM bytes may buy clock."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "RASTER", 8)(case, i)


def tilecraft_wide_persistent(case, i):
    """The op with ops.gemm_fp8.WIDE_PERSISTENT on: 128 x 256 tiles on persistent CTAs (the next tile's
    loads under the last one's epilogue, 3 stages) against the default's one tile a CTA (4 stages)."""
    from ops import gemm_fp8

    return _with_flag(gemm_fp8, "WIDE_PERSISTENT", True)(case, i)


def tilecraft_tile(case, i):
    """The op with decode-sized m kept on the decoded-tile kernel (ops.gemm_mxfp4.SWAPPED off): the
    previous MXFP4 decode path, against the swapped register-decode kernel in the same run."""
    from ops import gemm_mxfp4

    return _with_flag(gemm_mxfp4, "SWAPPED", False)(case, i)


def _warp_knobs(make, knobs):
    """make with ops.gemm_mxfp4_warps' module knobs (name -> value) set around each call."""
    from ops import gemm_mxfp4_warps

    for name, value in knobs.items():
        make = with_switch(make, gemm_mxfp4_warps, name, value)
    return make


def tilecraft_warps(**knobs):
    """The op with m <= 16 on the warp kernel (ops.gemm_mxfp4.WARP_TOKENS = 16) and ops.gemm_mxfp4_warps' module
    knobs set (WARPS_PER_SM, DEPTH, AHEAD, QUADS, ACTS_RING), against the swapped kernel in the same run."""
    from ops import gemm_mxfp4

    return _warp_knobs(_with_flag(gemm_mxfp4, "WARP_TOKENS", 16), knobs)


def tilecraft_swapped(case, i):
    """The op with every m <= 64 on the swapped kernel (ops.gemm_mxfp4.WARP_TOKENS = 0: before session 58)."""
    from ops import gemm_mxfp4

    return _with_flag(gemm_mxfp4, "WARP_TOKENS", 0)(case, i)


def tilecraft_swapped_rows(block_n):
    """The op with the swapped kernel's blocks forced to block_n weight rows (ops.gemm_mxfp4.SWAPPED_BLOCK_N: 64 is one
    MMA warpgroup, twice the blocks, half the splits, or with SWAPPED_CHAINS where that leaves one split two on
    alternate K steps; 128 two) against the op's rule in the same run (m 9-64)."""
    from ops import gemm_mxfp4

    return _with_flag(gemm_mxfp4, "SWAPPED_BLOCK_N", block_n)


def tilecraft_masked_tile(case, i):
    """The op with masked groups of <= 64 rows kept on the decoded-tile kernel
    (ops.gemm_mxfp4.SWAPPED_MASKED off): the previous path, against the swapped kernel in the same run."""
    from ops import gemm_mxfp4

    return _with_flag(gemm_mxfp4, "SWAPPED_MASKED", False)(case, i)


def tilecraft_masked_warps(**knobs):
    """The masked op with expected_m <= WARP_TOKENS on the warp kernel's masked form at every k
    (ops.gemm_mxfp4.MASKED_WARPS_MAX_K past any k), ops.gemm_mxfp4_warps' module knobs set (QUADS)."""
    from ops import gemm_mxfp4

    return _warp_knobs(_with_flag(gemm_mxfp4, "MASKED_WARPS_MAX_K", 1 << 30), knobs)


def tilecraft_mxfp4_with(flag, value):
    """The op with the swapped MXFP4 kernel's switch ops.gemm_mxfp4.<flag> set to value, against the
    default in the same run: SWAPPED_FOLD (split-K partials added in the kernel, True, or by the
    reduce kernel, False), SWAPPED_AHEAD (raw words a step ahead of their decode), SWAPPED_PAIR
    (2-split plans folding in clusters of two), SWAPPED_STAGE_OUT (partials out through shared memory
    as whole rows), MASKED_STAGED (the masked kernel's C tile out through shared memory as whole rows),
    DECODE_ROW_WARPS False (the shared-memory decode's old thread layout: two threads a row). True
    forces a switch on every plan it can apply to; the op's defaults follow rules (bench/NOTES.md "MXFP4 v8",
    "MXFP4 v9")."""
    def make(case, i):
        from ops import gemm_mxfp4

        return _with_flag(gemm_mxfp4, flag, value)(case, i)
    return make


def torch_scaled_mm(case, i):
    """torch.nn.functional.scaled_mm with BlockWise1x128 (a) and BlockWise128x128 (b); for mxfp4
    rows, the bf16 GEMM of the same shape (what an engine without FP4 kernels runs) on the weights before their
    MXFP4 quantization (its rel err is that quantization's)."""
    if case["kind"] == "mxfp4":
        return lambda: i["a"][0] @ i["w"][0].T
    if case["kind"] in MXFP4_KINDS:
        a = i["a"].view(case["groups"], case["m"], case["k"])
        if case["kind"] == "mxfp4-contiguous":     # the op's (groups x m, n) rows (a view)
            return lambda: torch.bmm(a, i["w"].transpose(1, 2)).view(-1, case["n"])
        return lambda: torch.bmm(a, i["w"].transpose(1, 2))
    if case["kind"] != "dense":
        raise ValueError("torch has no grouped block-scaled GEMM")
    F = torch.nn.functional
    a, b, sfa, sfb = i["qa"], i["qb"][0], i["sfa"], i["sfb"][0]
    # cuBLAS (torch 2.11) takes scale_b as (k/128, n/128): b's block scales seen through b.t()
    sfa_mn = sfa.t().contiguous().t()
    # MN-major with the row count padded to 4 (16-byte columns): cuBLAS refused m = 1 in both layouts above (session 67)
    pad = -(-sfa.shape[0] // 4) * 4
    sfa_pad = sfa.new_zeros(sfa.shape[1], pad)[:, :sfa.shape[0]].t()
    sfa_pad.copy_(sfa)
    attempts = [(sa, sb) for sa in (sfa, sfa_mn, sfa_pad) for sb in (sfb.t(), sfb.t().contiguous(), sfb)]
    last = None
    for sa, sb in attempts:  # cuBLAS wants particular scale layouts; take the first that runs
        try:
            F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                        output_dtype=torch.bfloat16)
            return lambda sa=sa, sb=sb: F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb,
                                                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001
            last = e
    raise RuntimeError(f"scaled_mm refused every scale layout: {last}")


def _deep_gemm_missing():
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        return "deep_gemm is not importable"
    return None


def deep_gemm(case, i):
    """DeepGEMM's FP8 GEMMs on the same inputs. Its sm_90 kernels read sfa MN-major and TMA-aligned: an
    engine's quantizer writes that layout, so it is converted once here, outside the timing (given
    row-major, DeepGEMM would transpose it on every call)."""
    import deep_gemm as dg

    if case["kind"] not in ("dense", "contiguous", "masked"):
        raise ValueError(f"deep_gemm has no {case['kind']} GEMM (its FP4 path is sm_100's)")
    a, b, sfb = i["qa"], i["qb"], i["sfb"]
    sfa = dg.get_mn_major_tma_aligned_tensor(i["sfa"])
    n = case["n"]
    if case["kind"] == "dense":
        out = torch.empty(case["m"], n, dtype=torch.bfloat16, device=a.device)
        return lambda: (dg.fp8_gemm_nt((a, sfa), (b[0], sfb[0]), out), out)[1]
    if case["kind"] == "contiguous":
        out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device=a.device)
        return lambda: (dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), out, i["m_indices"]), out)[1]
    out = torch.empty(*a.shape[:2], n, dtype=torch.bfloat16, device=a.device)
    return lambda: (dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), out, i["masked_m"], case["m"]), out)[1]


STATIC_SMS = 132    # the SM count bench.op's static stats plan for (H100 SXM, H200)


def _kernels(c, t="cuda:sm_90a"):
    """The tile programs a case runs, with their parameters (static stats without a GPU)."""
    from ops import gemm_mxfp4
    from ops.gemm_mxfp4_warps import mxfp4_warps_masked_program, mxfp4_warps_program, plan_warps

    swapped = c["m"] <= SWAPPED_TOKENS[-1] and c["k"] % SWAPPED_K_ALIGN == 0 and t == "cuda:sm_90a"
    if c["kind"] == "mxfp4" and c["m"] <= gemm_mxfp4.WARP_TOKENS and t == "cuda:sm_90a":
        return [(mxfp4_warps_program, dict(n=c["n"], k=c["k"], **plan_warps(c["m"], c["n"], c["k"])))]
    if (c["kind"] == "mxfp4-masked" and 0 < c["m"] <= gemm_mxfp4.WARP_TOKENS
            and c["k"] <= gemm_mxfp4.MASKED_WARPS_MAX_K and t == "cuda:sm_90a"):     # (the op's expected_m: the case's m)
        p = plan_warps(next(x for x in (8, 16) if x >= c["m"]), c["groups"] * c["n"], c["k"])
        return [(mxfp4_warps_masked_program, dict(n=c["n"], k=c["k"], **p))]
    if c["kind"] == "mxfp4" and swapped:
        return [(mxfp4_swapped_program, dict(n=c["n"], k=c["k"], **plan_swapped(c["m"], c["n"], c["k"])))]
    if c["kind"] == "mxfp4-masked" and swapped:
        return [(mxfp4_masked_swapped_program, dict(n=c["n"], k=c["k"], **plan_masked_swapped(c["m"], c["k"])))]
    if c["kind"] == "mxfp4":
        return [(mxfp4_gemm_program, dict(n=c["n"], k=c["k"], **mxfp4_plan(c["m"], c["n"], c["k"])))]
    if c["kind"] in MXFP4_KINDS:
        mode = c["kind"].split("-")[1]
        return [(mxfp4_grouped_program, dict(n=c["n"], k=c["k"], mode=mode,
                                             block_m=64 if mode == "masked" and c["m"] <= 64 else 128))]
    # the FP8 op's own plan (ops.gemm_fp8.op_plan, as _launch resolves it) on a 132-SM card, a cluster of c CTAs
    # counted as fitting on every c SMs (the device's occupancy query needs a GPU); its split-K reduce kernel, where
    # the plan has one, is not listed
    from codegen import targets
    from ops.gemm_fp8 import SORTED_BLOCK_M, op_plan

    kind, groups = c["kind"], c.get("groups", 1)
    rows = c["m"] * groups if kind == "contiguous" else c["m"]
    block_m = {"contiguous": 128, "sorted": SORTED_BLOCK_M}.get(kind, 64 if c["m"] <= 64 else 128)
    target = targets.get(t)
    room = (lambda cluster, threads, smem: STATIC_SMS // cluster) if target.vendor == "cuda" else None
    p = op_plan(kind, rows, c["n"], c["k"], block_m, groups if kind == "masked" else 1, "bfloat16", target,
                STATIC_SMS, room)
    return [(fp8_gemm_program, dict(n=c["n"], k=c["k"], mode=kind, out_dtype="bfloat16", **p))]


SUITE = Suite(
    name="gemm",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=nbytes,
    flops=flops,
    providers=[Provider("tilecraft", tilecraft), Provider("torch", torch_scaled_mm),
               Provider("tilecraft-v2", tilecraft_loop(False), experimental=True),
               Provider("tilecraft-v3", tilecraft_loop(True), experimental=True),
               Provider("tilecraft-split", tilecraft_split, experimental=True),
               Provider("tilecraft-thin2wg", tilecraft_thin2wg, experimental=True),
               Provider("tilecraft-regstore", tilecraft_regstore, experimental=True),
               Provider("tilecraft-onetile", tilecraft_onetile, experimental=True),
               Provider("tilecraft-narrow", tilecraft_narrow, experimental=True),
               Provider("tilecraft-128", tilecraft_128wide, experimental=True),
               Provider("tilecraft-multicast", tilecraft_multicast, experimental=True),
               Provider("tilecraft-raster8", tilecraft_raster8, experimental=True),
               # the v3 loop's split plans folding in the tile's last block at every row count / at none
               # (ops.gemm_fp8.READY_FOLD_ROWS), against the default (<= 16 rows) in the same run
               Provider("tilecraft-readyfold", _with_flag_lazy("READY_FOLD_ROWS", 1 << 30), experimental=True),
               Provider("tilecraft-nofold", _with_flag_lazy("READY_FOLD_ROWS", 0), experimental=True),
               # 2-split plans through the reduce kernel instead of folding in clusters of their two blocks through
               # distributed shared memory (ops.gemm_fp8.CLUSTER_SMEM_FOLD, on)
               Provider("tilecraft-nodsmem", _with_flag_lazy("CLUSTER_SMEM_FOLD", False), experimental=True),
               # the 4-split plan and the reduce kernel at 17-64 x 2112 x 7168 (ops.gemm_fp8.PAIR_HALF_TILES off)
               Provider("tilecraft-no-pair-half", _with_flag_lazy("PAIR_HALF_TILES", False), experimental=True),
               *[Provider(f"tilecraft-pair{w}", tilecraft_pairs(w), experimental=True) for w in (32, 64, 128)],
               Provider("tilecraft-wide-persistent", tilecraft_wide_persistent, experimental=True),
               Provider("tilecraft-tile", tilecraft_tile, experimental=True),
               # m <= 16 on the warp kernel (ops.gemm_mxfp4.WARP_TOKENS), with 32 / 8 warps an SM, with 1 / 3 steps of
               # codes in registers, with an L2 prefetch 4 steps beyond (ops.gemm_mxfp4_warps.WARPS_PER_SM, DEPTH, AHEAD);
               # every m <= 64 on the swapped kernel (WARP_TOKENS = 0: the op before session 58)
               Provider("tilecraft-warps", tilecraft_warps(), experimental=True),
               Provider("tilecraft-warps-32", tilecraft_warps(WARPS_PER_SM=32), experimental=True),
               Provider("tilecraft-warps-8", tilecraft_warps(WARPS_PER_SM=8), experimental=True),
               Provider("tilecraft-warps-d1", tilecraft_warps(DEPTH=1), experimental=True),
               Provider("tilecraft-warps-d3", tilecraft_warps(DEPTH=3), experimental=True),
               Provider("tilecraft-warps-a4", tilecraft_warps(AHEAD=4), experimental=True),
               # the warp kernel's scale words four steps a load (ops.gemm_mxfp4_warps.QUADS)
               Provider("tilecraft-quads", tilecraft_warps(QUADS=True), experimental=True),
               # ... the activations one step ahead, not in the codes' ring (ops.gemm_mxfp4_warps.ACTS_RING off: the
               # kernel before session 62)
               Provider("tilecraft-acts-1", tilecraft_warps(ACTS_RING=False), experimental=True),
               Provider("tilecraft-swapped", tilecraft_swapped, experimental=True),
               # the swapped kernel's blocks forced to 64 or 128 weight rows (ops.gemm_mxfp4.SWAPPED_BLOCK_N; m 9-64)
               Provider("tilecraft-swapped-n64", tilecraft_swapped_rows(64), experimental=True),
               Provider("tilecraft-swapped-n128", tilecraft_swapped_rows(128), experimental=True),
               Provider("tilecraft-masked-tile", tilecraft_masked_tile, experimental=True),
               Provider("tilecraft-masked-warps", tilecraft_masked_warps(), experimental=True),
               Provider("tilecraft-masked-quads", tilecraft_masked_warps(QUADS=True), experimental=True),
               Provider("tilecraft-w4a8", tilecraft_w4a8, experimental=True),
               Provider("tilecraft-w4a8-fold", tilecraft_w4a8_with("W4A8_FOLD"), experimental=True),
               # the W4A8 kernel without its 64-row blocks in two K chains, or with them also where the 128-row plan has
               # one split (ops.gemm_w4a8.W4A8_CHAINS)
               Provider("tilecraft-w4a8-nochains", tilecraft_w4a8_with("W4A8_CHAINS", False), experimental=True),
               Provider("tilecraft-w4a8-chains-any", tilecraft_w4a8_with("W4A8_CHAINS", "any"), experimental=True),
               Provider("tilecraft-w4a8-chains16", tilecraft_w4a8_with("W4A8_CHAINS_TOKENS", 16), experimental=True),
               Provider("tilecraft-w4a8-tma", tilecraft_w4a8_with("W4A8_SCALE_TMA"), experimental=True),
               Provider("tilecraft-w4a8-group", lambda case, i: tilecraft_w4a8(case, i, group=True), experimental=True),
               Provider("tilecraft-w4a8-nopair", tilecraft_w4a8_with("W4A8_PAIR_WIDE", False), experimental=True),
               Provider("tilecraft-w4a8-reduce", tilecraft_w4a8_with("W4A8_FOLD", False), experimental=True),
               Provider("tilecraft-w4a8-saldg", tilecraft_w4a8_with("W4A8_MASKED_SA_TMA", False), experimental=True),
               Provider("tilecraft-w4a8-unstaged", tilecraft_w4a8_with("W4A8_MASKED_STAGED", False),
                        experimental=True),
               Provider("tilecraft-w4a8-staged", tilecraft_w4a8_with("W4A8_STAGE_OUT", True), experimental=True),
               Provider("tilecraft-w4a8-nostage", tilecraft_w4a8_with("W4A8_STAGE_OUT", False), experimental=True),
               Provider("tilecraft-w4a8-burst4", tilecraft_w4a8_with("W4A8_BURST_64", None), experimental=True),
               Provider("tilecraft-w4a8-onetile", tilecraft_w4a8_with("W4A8_MASKED_TILES", False),
                        experimental=True),
               Provider("tilecraft-w4a8-contig64", tilecraft_w4a8_with("W4A8_CONTIGUOUS_TILE", 64), experimental=True),
               Provider("tilecraft-w4a8-tails", tilecraft_w4a8_with("W4A8_WHOLE_BURSTS", False), experimental=True),
               # W4A8's chained 2-split plans through the reduce kernel (ops.gemm_mxfp4.SWAPPED_CHAINS_PAIR off)
               Provider("tilecraft-w4a8-chains-reduce", tilecraft_w4a8_chains_pair(False), experimental=True),
               Provider("tilecraft-w4a8-chains-pair-all", tilecraft_w4a8_chains_pair("all"), experimental=True),
               *[Provider(name, tilecraft_mxfp4_with(flag, value), experimental=True)
                 for name, flag, value in (("tilecraft-masked-unstaged", "MASKED_STAGED", False),
                                           ("tilecraft-fold", "SWAPPED_FOLD", True),
                                           ("tilecraft-reduce", "SWAPPED_FOLD", False),
                                           ("tilecraft-ahead", "SWAPPED_AHEAD", True),
                                           # 64-row blocks without the two chains: one MMA warpgroup a block
                                           ("tilecraft-nochains", "SWAPPED_CHAINS", False),
                                           # ... and the chains where 64-row blocks still split K
                                           # the chains' 64 rows only where their plan has one split (the op
                                           # before session 66), or also where it splits K (the op, "any": also
                                           # where the 128-row plan pairs or has one split)
                                           ("tilecraft-chains-unsplit", "SWAPPED_CHAINS_WHERE", "unsplit"),
                                           ("tilecraft-chains-split", "SWAPPED_CHAINS_WHERE", "split"),
                                           # chained 2-split plans through the reduce kernel, not a cluster pair
                                           ("tilecraft-chains-reduce", "SWAPPED_CHAINS_PAIR", False),
                                           # ... and the chains' pair also where the 64-row plan pairs (<= 16 tokens)
                                           ("tilecraft-chains-pair-all", "SWAPPED_CHAINS_PAIR", "all"),
                                           ("tilecraft-pair", "SWAPPED_PAIR", True),
                                           ("tilecraft-staged", "SWAPPED_STAGE_OUT", True),
                                           ("tilecraft-decode-pairs", "DECODE_ROW_WARPS", False))],
               Provider("deep_gemm", deep_gemm, available=_deep_gemm_missing, peer=True)],
    kernels=_kernels,
    rate="fp8",
    label=lambda c: f"{c['kind']} {'%dx' % c['groups'] if 'groups' in c else ''}{c['m']}x{c['n']}x{c['k']}",
)
