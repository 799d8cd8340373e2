"""The matrix words (operand, accumulator, mma, read_accumulator, pipelined) on every target,
through a small GEMM tile program written once."""

import pytest
import tilelang.language as T
import torch

from codegen import tile
from codegen.program import TileProgram


def _gemm_builder(m: int, n: int, k: int, dtype: str = "bfloat16", bm: int = 64, bn: int = 64, bk: int = 32):
    """C = A @ B^T with A (m, k), B (n, k): the tile words' matrix path."""
    sdt = tile.storage_dtype(dtype)
    tiles_n = n // bn

    @T.prim_func
    def gemm_nt(A: T.Tensor((m, k), sdt), B: T.Tensor((n, k), sdt), C: T.Tensor((m, n), "float32")):
        with tile.grid((m // bm) * tiles_n, 128) as bid:
            tm, tn = tile.split_index(bid, (m // bm, tiles_n))
            a = tile.operand((bm, bk), sdt)
            b = tile.operand((bn, bk), sdt)
            acc = tile.accumulator((bm, bn))
            for kk in tile.pipelined(k // bk, stages=2):
                tile.copy(A[tm * bm, kk * bk], a)
                tile.copy(B[tn * bn, kk * bk], b)
                tile.mma(a, b, acc, transpose_b=True, clear=(kk == 0), step=kk)
            out = tile.read_accumulator(acc)
            tile.store(out, C[tm * bm, tn * bn])

    return gemm_nt


GEMM = TileProgram("test_gemm_nt", _gemm_builder)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gemm_words_run_on_cpu(dtype):
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    a, b = torch.randn(128, 64, dtype=tdt), torch.randn(64, 64, dtype=tdt)
    c = torch.full((128, 64), float("nan"))
    GEMM.compile("cpu", m=128, n=64, k=64, dtype=dtype)(a, b, c)
    torch.testing.assert_close(c, a.float() @ b.float().T, atol=1e-3, rtol=1e-3)


def _sass(target, **params):
    from backends import ToolchainError
    from backends.cuda.sass import build_cubin, sass_stats

    try:
        return sass_stats(build_cubin(GEMM.source(target, **params), target.split(":")[-1]), target).histogram
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")


def test_gemm_words_use_wgmma_on_sm_90a():
    hist = _sass("sm_90a", m=256, n=256, k=256)
    assert hist.get("HGMMA", 0) > 0 and hist.get("HMMA", 0) == 0


def test_gemm_words_use_tcgen05_on_sm_100a():
    hist = _sass("sm_100a", m=256, n=256, k=256)
    assert hist.get("UTCHMMA", 0) > 0 and hist.get("HMMA", 0) == 0


def test_gemm_words_use_the_cube_on_ascend():
    src = GEMM.source("ascend", m=256, n=256, k=256)
    assert "ascend_gemm_l1" in src and "ASC_IS_AIC" in src  # the Cube core runs the MMA
    assert "asc_copy_ub2gm" in src  # the vector cores write their halves of C


def _promoted_builder(m: int, n: int, k: int, bm: int = 64, bn: int = 64, bk: int = 32):
    """C = sum over K blocks kb of (A_kb @ B_kb^T) * S[:, kb]: two-level accumulation with row scales,
    through split_rows (the rows this core's vector code holds) and mma_promoted."""
    kb = k // bk
    tiles_n = n // bn

    @T.prim_func
    def promoted(A: T.Tensor((m, k), "float32"), B: T.Tensor((n, k), "float32"), S: T.Tensor((m, kb), "float32"),
                 C: T.Tensor((m, n), "float32")):
        with tile.grid((m // bm) * tiles_n, 128) as bid:
            tm, tn = tile.split_index(bid, (m // bm, tiles_n))
            mine, first = tile.split_rows(bm)
            a = tile.operand((bm, bk), "float32")
            b = tile.operand((bn, bk), "float32")
            part = tile.accumulator((bm, bn))
            scale = tile.fragment((mine,))
            acc = tile.fragment((mine, bn))
            with tile.vector():
                for i, j in tile.parallel(mine, bn):
                    acc[i, j] = 0.0
            for kk in tile.pipelined(kb, stages=2):
                tile.copy(A[tm * bm, kk * bk], a)
                tile.copy(B[tn * bn, kk * bk], b)
                with tile.vector():
                    for i in tile.parallel(mine):
                        scale[i] = S[tm * bm + first + i, kk]
                tile.mma_promoted(a, b, part, acc, scale, step=kk)
            with tile.vector():
                for i, j in tile.parallel(mine, bn):
                    C[tm * bm + first + i, tn * bn + j] = acc[i, j]

    return promoted


PROMOTED = TileProgram("test_mma_promoted", _promoted_builder)


def test_mma_promoted_runs_on_cpu():
    torch.manual_seed(0)
    a, b, s = torch.randn(128, 64), torch.randn(64, 64), torch.rand(128, 2) + 0.5
    c = torch.full((128, 64), float("nan"))
    PROMOTED.compile("cpu", m=128, n=64, k=64)(a, b, s, c)
    ref = sum((a[:, i * 32:(i + 1) * 32] @ b[:, i * 32:(i + 1) * 32].T) * s[:, i:i + 1] for i in range(2))
    torch.testing.assert_close(c, ref, atol=1e-4, rtol=1e-4)


def test_mma_promoted_folds_half_rows_on_ascend():
    src = PROMOTED.source("ascend", m=256, n=256, k=256)
    assert "ascend_gemm_l1" in src and "ASC_IS_AIC" in src               # the Cube computes each product
    assert "asc_copy_l0c2ub" in src and "asc_dual_dst_mode>(1)" in src   # L0C -> both vector cores' UB
    assert "asc_get_sub_block_id() * 32" in src                          # each folds its 32 of 64 rows
    aiv = src[src.index("if ASC_IS_AIV"):]
    loop = aiv[aiv.index("for ("):]
    assert "asc_sync_intra_wait(PIPE_V" in loop and "asc_vf_call<" in loop  # a fold per product


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemm_words_run_on_gpu(dtype):
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    a = torch.randn(256, 512, dtype=tdt, device="cuda")
    b = torch.randn(192, 512, dtype=tdt, device="cuda")
    c = torch.full((256, 192), float("nan"), device="cuda")
    GEMM.compile("sm_90a", m=256, n=192, k=512, dtype=dtype)(a, b, c)
    torch.testing.assert_close(c, a.float() @ b.float().T, atol=2e-2, rtol=2e-3)


def _fill_builder(rows: int = 8, width: int = 16, valid: int = 5):
    """Two operand tiles written by tile.fill_operands (row i holds source row rows - 1 - i, zero past `valid`),
    then copied out."""
    @T.prim_func
    def fill(X: T.Tensor((valid, 2 * width), "float32"), Y: T.Tensor((2, rows, width), "float32")):
        with tile.grid(1, 1):
            t0 = tile.operand((rows, width), "float32")
            t1 = tile.operand((rows, width), "float32")
            value = lambda c: (lambda r, j: T.if_then_else(  # noqa: E731
                r < valid, X[T.min(r, valid - 1), c + j], T.float32(0)))
            tile.fill_operands([t0, t1], lambda i: rows - 1 - i, [value(0), value(width)], vector=4)
            for i, j in tile.parallel(rows, width):
                Y[0, i, j] = t0[i, j]
                Y[1, i, j] = t1[i, j]
    return fill


def test_fill_operands_runs_on_cpu_and_checks_its_tiles():
    """tile.fill_operands (the MLA query tiles' word): two tiles of one shape in one loop, `vector` columns at a
    time, each row from row_of(row), on the cpu target; and its checks of the tiles it is given."""
    from types import SimpleNamespace

    from codegen.lowering.common import fill_operands

    x = torch.randn(5, 32)
    y = torch.full((2, 8, 16), float("nan"))
    TileProgram("test_fill_operands", _fill_builder, ("cpu",)).compile("cpu")(x, y)
    ref = torch.zeros(2, 8, 16)
    ref[0, 3:], ref[1, 3:] = x[:, :16].flip(0), x[:, 16:].flip(0)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="multiple of vector=8"):
        fill_operands([SimpleNamespace(shape=(64, 12))], None, [None], vector=8)
    with pytest.raises(ValueError, match="one or two tiles"):
        fill_operands([SimpleNamespace(shape=(64, 16))] * 3, None, [None] * 3, vector=8)
