"""MXFP4-weight GEMM: C (m, n) = A (m, k) bf16 @ dequant(B)^T, B packed e2m1 (n, k/2) uint8 with
E8M0 scales (n, k/32) uint8 (OCP MX, as quant_mxfp4 writes them).

Hopper has no FP4 tensor cores: each K step stages the packed bytes, the compute warps decode
them into a bf16 tile (e2m1 x 2^e is exact in bf16) and a bf16 WGMMA consumes it. Decode-sized m
is bound by the weight bytes, which are a quarter of bf16's: that is the point.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import targets, tile
from codegen.program import tile_program
from ops import _dispatch
from ops import _validate as check
from ops.quant import dequant_mxfp4

MX = 32


def _e2m1(code):
    """4-bit e2m1 code -> float32: sign | exponent (2 bits) | mantissa (1 bit), bias 1."""
    e = (code >> T.uint32(1)) & T.uint32(3)
    m = T.cast(code & T.uint32(1), "float32")
    mag = T.if_then_else(e == T.uint32(0), m * 0.5, (1.0 + m * 0.5) * T.cast(T.shift_left(T.uint32(1), e - T.uint32(1)), "float32"))
    return T.if_then_else((code & T.uint32(8)) != T.uint32(0), -mag, mag)


@tile_program(
    "mxfp4_gemm_nt",
    targets=("cuda:sm_90a", "cuda:sm_100a"),
    examples={"decode-7168x2048": dict(n=7168, k=2048, block_m=64), "prefill-4096x7168": dict(n=4096, k=7168)},
)
def mxfp4_gemm_program(n: int, k: int, block_m: int = 128, block_n: int = 128, block_k: int = 128, stages: int = 3,
                       threads: int = 256):
    """bf16 A tiles by TMA; packed B tiles decoded to bf16 in shared memory; bf16 MMA."""
    assert k % block_k == 0 and n % block_n == 0 and block_k % MX == 0
    m = T.dynamic("m")
    n_tiles = n // block_n

    @T.prim_func
    def mxfp4_gemm_nt(A: T.Tensor((m, k), "bfloat16"), B: T.Tensor((n, k // 2), "uint8"),
                      SFB: T.Tensor((n, k // MX), "uint8"), C: T.Tensor((m, n), "bfloat16")):
        with tile.grid(T.ceildiv(m, block_m) * n_tiles, threads) as bid:
            tm, tn = tile.split_index(bid, (T.ceildiv(m, block_m), n_tiles))
            a_s = tile.operand((block_m, block_k), "bfloat16")
            raw = tile.stage((block_n, block_k // 2), "uint8")
            b_s = tile.operand((block_n, block_k), "bfloat16")
            acc = tile.accumulator((block_m, block_n))
            for kk in tile.pipelined(k // block_k, stages=stages):
                tile.copy(A[tm * block_m, kk * block_k], a_s)
                tile.copy(B[tn * block_n, kk * (block_k // 2)], raw)
                for i, j in tile.parallel(block_n, block_k):
                    byte = T.cast(raw[i, j // 2], "uint32")
                    code = (byte >> T.cast(4 * (j % 2), "uint32")) & T.uint32(0xF)
                    e8 = T.cast(SFB[tn * block_n + i, (kk * block_k + j) // MX], "int32")
                    b_s[i, j] = T.cast(_e2m1(code) * T.exp2(T.cast(e8 - 127, "float32")), "bfloat16")
                tile.mma(a_s, b_s, acc, transpose_b=True, clear=(kk == 0), step=kk)
            out = tile.read_accumulator(acc)
            for i, j in tile.parallel(block_m, block_n):
                r = tm * block_m + i
                if r < m:
                    C[r, tn * block_n + j] = T.cast(out[i, j], "bfloat16")

    return mxfp4_gemm_nt


def mxfp4_gemm_nt_reference(a, b, sfb):
    return (a.float() @ dequant_mxfp4(b, sfb).T).to(torch.bfloat16)


def mxfp4_gemm_nt(a, b, sfb, sfa=None):
    """C (m, n) bf16 = a (m, k) bf16 @ dequant(b, sfb)^T; b (n, k/2) uint8 packed e2m1 (low nibble
    first), sfb (n, k/32) uint8 E8M0. k % 128 == 0, n % 128 == 0, any m. (e4m3 a with sfa: not yet.)"""
    if sfa is not None:
        raise ValueError("sfa (an e4m3 a) is not supported yet: pass a as bf16")
    check.tensor("a", a, dtypes=(torch.bfloat16,), ndim=2, contiguous=True)
    check.tensor("b", b, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    m, k = a.shape
    n = b.shape[0]
    check.shape("b", b, (n, k // 2), "(n, k/2): two e2m1 values per byte")
    check.tensor("sfb", sfb, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check.shape("sfb", sfb, (n, k // MX), "(n, k/32) E8M0")
    if k % 128 or n % 128:
        raise ValueError(f"k and n must be multiples of 128, got k={k}, n={n}")
    check.same_device(a=a, b=b, sfb=sfb)
    return _dispatch.call(_mxfp4_op, _mxfp4_impl, a, b, sfb)


def _mxfp4_impl(a, b, sfb):
    if a.device.type == "cpu":
        return mxfp4_gemm_nt_reference(a, b, sfb)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        kernel = mxfp4_gemm_program.compile(targets.resolve(a), n=n, k=k, block_m=64 if m <= 64 else 128)
        kernel.launcher()(a, b, sfb, out)
    return out


@torch.library.custom_op("tilecraft::mxfp4_gemm_nt", mutates_args=())
def _mxfp4_op(a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    return _mxfp4_impl(a, b, sfb)


@_mxfp4_op.register_fake
def _(a, b, sfb):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)
