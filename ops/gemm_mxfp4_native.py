"""MXFP4 weights on block-scaled MMAs: e4m3 activations with OCP MX scales (E8M0 per 32 values) times e2m1
weights with theirs, the scales riding in the MMA (no decode). sm_100a: tcgen05 kind::mxf8f6f4.block_scale
(UTCQMMA, scales copied to tensor memory by UTCCP); ascend:950: the Cube's block-scaled MAD, which takes A and B of
one dtype, so the weights are widened to e4m3 first (exact). ops.gemm_mxfp4's ops take these paths for that form
of `a` on those targets; compiled only: no sm_100a or Ascend device has run them.

    mxfp4_native_program           C (m, n) = (A * SFA) @ (B * SFB)^T                 (mxfp4_gemm_nt)
    mxfp4_grouped_native_program   the contiguous and masked grouped layouts        (m_grouped_mxfp4_gemm_nt_*)
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch
from ops import _validate as check
from ops._workspace import bound_only
from ops.gemm_mxfp4 import BLOCK_K, GROUPED_MODES, MX, _check_dense, _scale_words, _store, _store_grouped


@tile_program(
    "mxfp4_gemm_nt_native",
    targets=("cuda:sm_100a", "ascend:950"),
    examples={"4096x7168": dict(n=4096, k=7168), "ascend-4096x7168": dict(n=4096, k=7168, b_format="e4m3")},
)
def mxfp4_native_program(n: int, k: int, block_m: int = 128, block_n: int = 128, stages: int = 4,
                         b_format: str = "e2m1"):
    """C (m, n) bf16 = (A * SFA) @ (B * SFB)^T on block-scaled tensor cores (sm_100a: tcgen05
    kind::mxf8f6f4.block_scale; ascend:950: the Cube's block-scaled MAD): A (m, k) e4m3 and B (n, k)
    e2m1 (packed global, loaded by TMA into the tensor cores' unpacked shared-memory form), or with
    b_format="e4m3" B widened to e4m3 (ascend:950, whose MAD takes A and B of one dtype:
    widen_e2m1_to_e4m3), each with one E8M0 scale per 32 values of K.
    SFA (k/128, m rounded up to 4) and SFB (k/128, n) int32 (mx_scale_words): a K step's 4 scale
    bytes of a row in one word, step-major (what the scale copies to tensor memory read). No decode:
    the scales ride in the MMA. Compiled only: no sm_100a or Ascend device has run it."""
    assert k % BLOCK_K == 0 and n % block_n == 0 and block_m == 128 and block_n % 128 == 0
    if b_format not in ("e2m1", "e4m3"):
        raise ValueError(f"b_format must be 'e2m1' or 'e4m3', got {b_format!r}")
    m, m_pad = T.dynamic("m, m_pad")       # SFA's rows are padded to a multiple of 4 (TMA's 16-byte strides)
    kb, n_tiles = k // BLOCK_K, n // block_n
    b_dtype, b_tile = (("float4_e2m1fn", T.float4_e2m1_unpacked) if b_format == "e2m1" else
                       ("float8_e4m3fn", "float8_e4m3fn"))

    @T.prim_func
    def mxfp4_gemm_nt_native(A: T.Tensor((m, k), "float8_e4m3fn"), B: T.Tensor((n, k), b_dtype),
                             SFA: T.Tensor((kb, m_pad), "int32"), SFB: T.Tensor((kb, n), "int32"),
                             C: T.Tensor((m, n), "bfloat16")):
        with tile.grid(T.ceildiv(m, block_m) * n_tiles, 128) as bid:
            tm, tn = tile.split_index(bid, (T.ceildiv(m, block_m), n_tiles))
            acc = tile.accumulator((block_m, block_n))
            # (lambda parameters are named apart from every loop variable: the DSL tracks names)
            loads = lambda blk: (A[tm * block_m:(tm + 1) * block_m, blk * BLOCK_K:(blk + 1) * BLOCK_K],  # noqa: E731
                                 B[tn * block_n:(tn + 1) * block_n, blk * BLOCK_K:(blk + 1) * BLOCK_K])
            scale_loads = lambda blk: (SFA[blk, tm * block_m:(tm + 1) * block_m],  # noqa: E731
                                       SFB[blk, tn * block_n:(tn + 1) * block_n])
            tile.mma_block_scaled_loop(
                kb, loads, scale_loads, [((block_m, BLOCK_K), "float8_e4m3fn"),
                                         ((block_n, BLOCK_K), b_tile)], acc,
                scale_k=MX, stages=stages,
                epilogue=lambda: _store(acc, C, C, tm, tn, 0, m, kb, 1, block_m, block_n))

    return mxfp4_gemm_nt_native


@tile_program(
    "mxfp4_gemm_nt_grouped_native",
    targets=("cuda:sm_100a", "ascend:950"),
    examples={"contiguous-4096x7168": dict(n=4096, k=7168, mode="contiguous"),
              "masked-4096x7168": dict(n=4096, k=7168, mode="masked"),
              "ascend-contiguous-4096x7168": dict(n=4096, k=7168, mode="contiguous", b_format="e4m3")},
)
def mxfp4_grouped_native_program(n: int, k: int, mode: str = "contiguous", block_m: int = 128, block_n: int = 128,
                                 stages: int = 4, b_format: str = "e2m1"):
    """The grouped layouts of mxfp4_native_program (block-scaled MMAs, e4m3 A with MX scales): one 128-row tile of
    A a block, against the weights of its group.
    contiguous: A (M, k), M % 128 == 0, rows in 128-aligned segments per group; MIdx (M,) the rows' groups (-1:
    padding, stored as zeros); a tile's group is its first row's (a tile whose first row is padding computes nothing
    and stores zeros); SFA (k/128, M) scale words; C (M, n).
    masked: A (G, max_m, k); only the first MaskedM[g] rows of group g are computed, the rest stored as zeros (tiles
    past them compute nothing); SFA (G, k/128, max_m rounded up to 4); C (G, max_m, n).
    B (G, n, k) e2m1 (or e4m3 with b_format="e4m3": ascend:950), SFB (G, k/128, n) scale words (mx_scale_words).
    Compiled only: no sm_100a or Ascend device has run it."""
    assert k % BLOCK_K == 0 and n % block_n == 0 and block_m == 128 and block_n % 128 == 0
    if mode not in GROUPED_MODES or b_format not in ("e2m1", "e4m3"):
        raise ValueError(f"mode must be one of {GROUPED_MODES} and b_format 'e2m1' or 'e4m3', got {mode!r}, "
                         f"{b_format!r}")
    G, rows, max_m, m_pad = T.dynamic("G, rows, max_m, m_pad")
    kb, n_tiles = k // BLOCK_K, n // block_n
    b_dtype, b_tile = (("float4_e2m1fn", T.float4_e2m1_unpacked) if b_format == "e2m1" else
                       ("float8_e4m3fn", "float8_e4m3fn"))
    masked = mode == "masked"
    a_shape = (G, max_m, k) if masked else (rows, k)
    sfa_shape = (G, kb, m_pad) if masked else (kb, rows)
    c_shape = (G, max_m, n) if masked else (rows, n)
    row_tiles = T.ceildiv(max_m, block_m) if masked else rows // block_m

    @T.prim_func
    def mxfp4_gemm_nt_grouped_native(A: T.Tensor(a_shape, "float8_e4m3fn"), B: T.Tensor((G, n, k), b_dtype),
                                     SFA: T.Tensor(sfa_shape, "int32"), SFB: T.Tensor((G, kb, n), "int32"),
                                     MIdx: T.Tensor((rows,), "int32"), MaskedM: T.Tensor((G,), "int32"),
                                     C: T.Tensor(c_shape, "bfloat16")):
        with tile.grid((G if masked else 1) * row_tiles * n_tiles, 128) as bid:
            gm, tm, tn = tile.split_index(bid, (G if masked else 1, row_tiles, n_tiles))
            row0 = tm * block_m
            g = gm if masked else T.min(T.max(MIdx[row0], 0), G - 1)
            live = row0 < MaskedM[gm] if masked else MIdx[row0] >= 0
            steps = tile.steps_if(live, kb)
            acc = tile.accumulator((block_m, block_n))
            # (lambda parameters are named apart from every loop variable: the DSL tracks names)
            loads = lambda blk: (  # noqa: E731
                (A[gm, row0:row0 + block_m, blk * BLOCK_K:(blk + 1) * BLOCK_K] if masked else
                 A[row0:row0 + block_m, blk * BLOCK_K:(blk + 1) * BLOCK_K]),
                B[g, tn * block_n:(tn + 1) * block_n, blk * BLOCK_K:(blk + 1) * BLOCK_K])
            scale_loads = lambda blk: (  # noqa: E731
                SFA[gm, blk, row0:row0 + block_m] if masked else SFA[blk, row0:row0 + block_m],
                SFB[g, blk, tn * block_n:(tn + 1) * block_n])
            tile.mma_block_scaled_loop(
                steps, loads, scale_loads, [((block_m, BLOCK_K), "float8_e4m3fn"), ((block_n, BLOCK_K), b_tile)], acc,
                scale_k=MX, stages=stages,
                # the decoded-tile program's store: zeros wherever no step ran or the row is padding / past MaskedM
                epilogue=lambda: _store_grouped(acc, (C, MIdx, row0, max_m if masked else rows,
                                                      MaskedM[gm] if masked else rows, gm, tn, steps),
                                                mode, block_m, block_n))

    return mxfp4_gemm_nt_grouped_native


def mx_scale_words(scales, rows_pad=None):
    """(..., rows, k/32) uint8 E8M0 -> (..., k/128, rows_pad) int32, as the native kernels read them: word (s, r)
    holds row r's 4 scales of K step s (byte j: K values 128s + 32j ..), step-major; rows past `rows`
    (up to rows_pad, default rows) hold 127 (2^0). Leading dimensions (groups) are kept."""
    check.tensor("scales", scales, dtypes=(torch.uint8,), ndim=(2, 3), contiguous=True)
    *lead, rows, groups = scales.shape
    if groups % 4:
        raise ValueError(f"scales must have a multiple of 4 columns (k % 128 == 0), got {groups}")
    rows_pad = rows if rows_pad is None else rows_pad
    words = torch.full((*lead, groups // 4, rows_pad), 0x7F7F7F7F, dtype=torch.int32, device=scales.device)
    words[..., :rows] = _scale_words(scales if scales.data_ptr() % 4 == 0 else scales.clone()).transpose(-1, -2)
    return words


NATIVE_TARGETS = ("cuda:sm_100a", "ascend:950")   # block-scaled MMAs: mxfp4_native_program
# e2m1 code -> the e4m3 byte of the same value (every e2m1 value is an e4m3 value): 0, 0.5, 1, 1.5, 2, 3, 4, 6, signed
E2M1_AS_E4M3 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C, 0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC)


def widen_e2m1_to_e4m3(b):
    """b (n, k/2) uint8, two e2m1 codes a byte (low nibble first) -> (n, k) float8_e4m3fn holding the same values,
    exactly (the E8M0 scales apply unchanged). ascend:950's block-scaled MAD takes A and B of one dtype, so its
    native MXFP4 path multiplies e4m3 activations by the widened weights (twice the bytes of the packed ones)."""
    check.tensor("b", b, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    lut = torch.tensor(E2M1_AS_E4M3, dtype=torch.uint8, device=b.device)
    codes = torch.stack((lut[(b & 15).long()], lut[(b >> 4).long()]), dim=-1)    # [n, k/2, 2]: low nibble first
    return codes.reshape(b.shape[0], 2 * b.shape[1]).view(torch.float8_e4m3fn)


def _mxfp4_native(a, b, sfb, sfa):
    """mxfp4_gemm_nt on block-scaled tensor cores (sm_100a, ascend:950): e4m3 a with MX scales sfa (m, k/32)."""
    m, n, k = _check_dense(a, torch.float8_e4m3fn, b, sfb)
    check.tensor("sfa", sfa, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check.shape("sfa", sfa, (m, k // MX), "E8M0 per (row, 32 columns) of a")
    check.same_device(a=a, sfa=sfa)
    return _dispatch.call(_mxfp4_native_op, _mxfp4_native_impl, a, b, sfb, sfa)


def _mxfp4_native_impl(a, b, sfb, sfa):
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        for name, t in (("a", a), ("b", b)):
            check.aligned(name, t, 16, "loaded by TMA")
        target = targets.resolve(a)
        b_format = "e4m3" if target.vendor == "ascend" else "e2m1"
        launch = jit.launchers(("mxfp4_gemm_nt_native", target.name, n, k, b_format),
                               lambda: mxfp4_native_program.compile(target, n=n, k=k, b_format=b_format).launcher())
        weights = widen_e2m1_to_e4m3(b) if b_format == "e4m3" else b.view(torch.float4_e2m1fn_x2)
        launch(a, weights, mx_scale_words(sfa, -(-m // 4) * 4), mx_scale_words(sfb), out)
    return out


def _native_target(a, sfa):
    """The target whose block-scaled MMAs take this call (e4m3 a with OCP MX sfa on sm_100a or ascend:950), or None
    (the decoded-tile kernels: bf16 a, or a dequantized to bf16 first)."""
    if (not isinstance(a, torch.Tensor) or a.device.type == "cpu" or not isinstance(sfa, torch.Tensor)
            or sfa.dtype != torch.uint8 or a.dtype != torch.float8_e4m3fn):
        return None         # (anything else takes the named checks of the decoded-tile path)
    target = targets.resolve(a)
    return target if target.name in NATIVE_TARGETS else None


def _grouped_native(mode, a, sfa, b, sfb, aux):
    check.tensor("sfa", sfa, dtypes=(torch.uint8,), ndim=a.dim(), contiguous=True)
    check.shape("sfa", sfa, (*a.shape[:-1], a.shape[-1] // MX), "E8M0 per (row, 32 columns) of a")
    check.same_device(a=a, sfa=sfa)
    return _dispatch.call(_mxfp4_grouped_native_op, _mxfp4_grouped_native_impl, mode, a, sfa, b, sfb, aux)


def _mxfp4_grouped_native_impl(mode, a, sfa, b, sfb, aux):
    out = torch.empty(*a.shape[:-1], b.shape[1], dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0:
        return out
    for name, t in (("a", a), ("b", b)):
        check.aligned(name, t, 16, "loaded by TMA")
    target = targets.resolve(a)
    G, n, k = b.shape[0], b.shape[1], a.shape[-1]
    b_format = "e4m3" if target.vendor == "ascend" else "e2m1"
    kernel = jit.launchers(("mxfp4_gemm_nt_grouped_native", target.name, mode, n, k, b_format), lambda: (
        mxfp4_grouped_native_program.compile(target, n=n, k=k, mode=mode, b_format=b_format).launcher()))
    weights = (widen_e2m1_to_e4m3(b.view(G * n, k // 2)).view(G, n, k) if b_format == "e4m3" else
               b.view(torch.float4_e2m1fn_x2))
    sfa_words = mx_scale_words(sfa) if mode == "contiguous" else mx_scale_words(sfa, -(-a.shape[1] // 4) * 4)
    m_idx = aux if mode == "contiguous" else bound_only(a.device, 1)
    masked_m = aux if mode == "masked" else bound_only(a.device, G)
    kernel(a, weights, sfa_words, mx_scale_words(sfb), m_idx, masked_m, out)
    return out


@torch.library.custom_op("tilecraft::mxfp4_gemm_nt_grouped_native", mutates_args=())
def _mxfp4_grouped_native_op(mode: str, a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                             aux: torch.Tensor) -> torch.Tensor:
    return _mxfp4_grouped_native_impl(mode, a, sfa, b, sfb, aux)


@_mxfp4_grouped_native_op.register_fake
def _(mode, a, sfa, b, sfb, aux):
    return a.new_empty(*a.shape[:-1], b.shape[1], dtype=torch.bfloat16)


@torch.library.custom_op("tilecraft::mxfp4_gemm_nt_native", mutates_args=())
def _mxfp4_native_op(a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    return _mxfp4_native_impl(a, b, sfb, sfa)


@_mxfp4_native_op.register_fake
def _(a, b, sfb, sfa):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)
