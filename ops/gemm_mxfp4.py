"""MXFP4-weight GEMM: C (m, n) = A (m, k) bf16 @ dequant(B)^T, B packed e2m1 (n, k/2) uint8 with
E8M0 scales (n, k/32) uint8 (OCP MX, as quant_mxfp4 writes them).

Hopper has no FP4 tensor cores: each K step stages the packed bytes, the compute warps decode
them into a bf16 tile (e2m1 x 2^e is exact in bf16) and a bf16 WGMMA consumes it. Decode-sized m
is bound by the weight bytes, which are a quarter of bf16's: that is the point.

The K loop is tile.mma_decoded_loop (on sm_90a the decode of step s+1 runs under the WGMMA of
step s); the decode is a CUDA helper that places the codes' bits into bf16x2 words, and the E8M0
scales are read as 32-bit words, the 4 bytes of a row's K step (bench/NOTES.md "MXFP4 v4"). On
ascend:950 the vector cores decode with plain TileLang (_decode_rows) and the Cube multiplies in bf16.

e4m3 activations with OCP MX scales take block-scaled MMAs where a target has them (sm_100a's
UTCQMMA, ascend:950's block-scaled MAD): ops/gemm_mxfp4_native.py.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import jit, rules, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops._ready import READY_EMPTY as READY_EMPTY  # (re-exported: ops.gemm_mxfp4.READY_EMPTY)
from ops._ready import READY_SOURCE, ready_fold, ready_value
from ops._workspace import arrival_counters, bound_only, ready_partials
from ops import _validate as check
from ops.gemm_fp8 import _touch
from ops.quant import dequant_fp8_token_groups, dequant_mx_fp8, dequant_mxfp4

MX = 32


# CUDA helpers for the decode (T.import_source): a byte of two e2m1 codes -> one bf16x2 word by
# integer multiplies that place the bits (no branches, no fp32 round trip), scaled in bf16x2:
# ~3.8 instructions a value in SASS (the fp32 form, bits placed per value, two FMULs and a
# conversion, took ~6.9). e2m1 x 2^k is exact in bf16 down to its subnormals, so the tile holds the
# exact dequantized weights. The E8M0 scales arrive as the 4 bytes of one K step of a row in one
# 32-bit word and become bf16x2 factors where they are used.
E2M1_SOURCE = r"""
#include <tl_templates/cuda/common.h>
__device__ __forceinline__ unsigned tc_e8m0_bf16x2(unsigned e8) {
  // 2^(e8 - 127) in both lanes: the byte is the bf16 exponent field; e8 = 0 is the subnormal
  // 2^-127 (mantissa 0x40), e8 = 255 is NaN (OCP MX)
  unsigned h = e8 == 0u ? 0x0040u : (e8 == 255u ? 0x7FC0u : e8 << 7);
  return h | (h << 16);
}
__device__ __forceinline__ unsigned tc_e2m1x2_bits_v6(unsigned w, int p) {
  // codes 2p (low nibble of byte p) and 2p+1 -> the bits of bf16 lanes 0 and 1 of e2m1 * 2^-126:
  // b * 0x40040 puts code & 7 at bits 6-8 and 22-24 (exponent lsbs + mantissa msb of each lane),
  // b * 0x1001000 puts the sign bits at 15 and 31; e = 0, m = 1 lands on the subnormal 0.5 * 2^-126
  unsigned b = __byte_perm(w, 0u, 0x4440u + (unsigned)p);
  return ((b * 0x40040u) & 0x01C001C0u) | ((b * 0x1001000u) & 0x80008000u);
}
__device__ __forceinline__ unsigned tc_e2m1x2_scaled(unsigned v, unsigned scale2) {
  // the bits of e2m1 * 2^-126 -> e2m1 * 2^(e8-127), in two exact multiplies
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&v);
  x = __hmul2(x, __floats2bfloat162_rn(0x1p126f, 0x1p126f));   // exact: a power of two
  x = __hmul2(x, *reinterpret_cast<__nv_bfloat162*>(&scale2));  // exact: 2^(e8-127), subnormals kept
  return *reinterpret_cast<unsigned*>(&x);
}
__device__ __forceinline__ unsigned tc_e2m1x2_bf16x2(unsigned w, int p, unsigned scale2) {
  return tc_e2m1x2_scaled(tc_e2m1x2_bits_v6(w, p), scale2);
}
__device__ __forceinline__ void tc_e2m1x8_store(void* dst, int w, unsigned scale2) {
  // the 8 codes of word w (low nibble first) -> 8 bf16 values at dst (16 bytes)
  uint4 o = make_uint4(tc_e2m1x2_bf16x2((unsigned)w, 0, scale2), tc_e2m1x2_bf16x2((unsigned)w, 1, scale2),
                       tc_e2m1x2_bf16x2((unsigned)w, 2, scale2), tc_e2m1x2_bf16x2((unsigned)w, 3, scale2));
  *reinterpret_cast<uint4*>(dst) = o;
}
// 8 code words = 64 values = scale groups 2q and 2q+1 of the step (bytes of the scale word sw);
// d0..d7: the 16-byte destinations (the swizzled tile puts them apart)
__device__ __forceinline__ void tc_e2m1x64_store(void* d0, void* d1, void* d2, void* d3, void* d4, void* d5,
                                                 void* d6, void* d7, int w0, int w1, int w2, int w3, int w4,
                                                 int w5, int w6, int w7, int sw, int q) {
  unsigned s0 = tc_e8m0_bf16x2(((unsigned)sw >> (16 * q)) & 0xFFu);
  unsigned s1 = tc_e8m0_bf16x2(((unsigned)sw >> (16 * q + 8)) & 0xFFu);
  tc_e2m1x8_store(d0, w0, s0); tc_e2m1x8_store(d1, w1, s0); tc_e2m1x8_store(d2, w2, s0);
  tc_e2m1x8_store(d3, w3, s0); tc_e2m1x8_store(d4, w4, s1); tc_e2m1x8_store(d5, w5, s1);
  tc_e2m1x8_store(d6, w6, s1); tc_e2m1x8_store(d7, w7, s1);
}
// 4 code words = 32 values = scale group q of the step (byte q of sw)
__device__ __forceinline__ void tc_e2m1x32_store(void* d0, void* d1, void* d2, void* d3, int w0, int w1, int w2,
                                                 int w3, int sw, int q) {
  unsigned s = tc_e8m0_bf16x2(((unsigned)sw >> (8 * q)) & 0xFFu);
  tc_e2m1x8_store(d0, w0, s); tc_e2m1x8_store(d1, w1, s); tc_e2m1x8_store(d2, w2, s);
  tc_e2m1x8_store(d3, w3, s);
}
"""
# The swapped kernel's helper: one thread's A fragment of a 128-deep K step (WGMMA's register
# layout: 4 words per k16 WGMMA j = (row r, K 16j + 2c..), (r + 8, same), (r, K 16j + 8 + 2c..),
# (r + 8, same)) from the 16 code words of each of its two rows (w: row r's, four 16-byte pieces;
# v: row r + 8's): byte c of words 2j and 2j + 1, scaled by byte j / 2 of the row's scale word.
# When no scale byte of the warp's rows exceeds 128 (real weights: scales ~ max|w| / 6, so e8 <=
# 127), 2^126 and the scale are one factor 2^(e8 - 1), a bf16 whose exponent field is e8 + 126:
# one multiply a pair, and the four factors of a row come from one add (no byte carries) and a
# permute each. Otherwise each pair is multiplied twice (tc_e2m1x2_bf16x2).
E2M1_FRAGMENT_SOURCE = r"""
__device__ __forceinline__ int tc_globaltimer_lo() {   // ns, low 32 bits (trace=True)
  unsigned t;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t));
  return (int)t;
}
__device__ __forceinline__ unsigned tc_scale_over_128(unsigned sw) {
  // a byte > 128 has its top bit and a low bit set
  return sw & 0x80808080u & ((sw & 0x7F7F7F7Fu) + 0x7F7F7F7Fu);
}
// The bf16x2 bit pattern of codes 2c and 2c + 1 (byte c of w) as e2m1 * 2^-126, before scaling.
// kPrmtSign ("v7"): one permute P = [byte c of w << 4, its sign replicated, byte c of w, its sign
// replicated] (prmt's sign mode), then << 2 puts the low code's magnitude at bits 6-8 and its sign
// at 15, the high code's at 22-24 and 31: one mask (5 instructions a pair with the multiply, ALU 2).
// Otherwise ("v6", tc_e2m1x2_bits_v6): the byte alone, two multiplies place magnitudes and signs,
// two masks (6 instructions, ALU 3).
template <bool kPrmtSign>
__device__ __forceinline__ unsigned tc_e2m1x2_bits(unsigned w, int c, unsigned sel) {
  if (!kPrmtSign) return tc_e2m1x2_bits_v6(w, c);
  unsigned p;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p) : "r"(w * 16u), "r"(w), "r"(sel));
  return (p * 4u) & 0x81C081C0u;
}
__device__ __forceinline__ unsigned tc_bf16x2_mul(unsigned x, unsigned y) {
  __nv_bfloat162 z = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&x), *reinterpret_cast<__nv_bfloat162*>(&y));
  return *reinterpret_cast<unsigned*>(&z);
}
// A thread's two rows of a 128-deep step, 16 code words each (4 x 16 bytes a row, shared memory),
// into raw[0..15] (row r) and raw[16..31] (row r + 8): registers, one step ahead of their decode
__device__ __forceinline__ void tc_e2m1_rows_load(void* raw, const void* w0, const void* w1, const void* w2,
                                                  const void* w3, const void* v0, const void* v1, const void* v2,
                                                  const void* v3) {
  const void* at[8] = {w0, w1, w2, w3, v0, v1, v2, v3};
  unsigned* r = reinterpret_cast<unsigned*>(raw);   // word stores: raw is a plain int[32]
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const uint4 x = *reinterpret_cast<const uint4*>(at[q]);
    r[4 * q] = x.x, r[4 * q + 1] = x.y, r[4 * q + 2] = x.z, r[4 * q + 3] = x.w;
  }
}
template <bool kPrmtSign>
__device__ __forceinline__ void tc_e2m1_fragment_of(void* dst, const unsigned* wr, const unsigned* vr, int sw_r,
                                                    int sw_r8, int c);
// this thread's fragment of a step from raw words already in registers (tc_e2m1_rows_load)
template <bool kPrmtSign>
__device__ __forceinline__ void tc_e2m1_fragment_from(void* dst, const void* raw, int sw_r, int sw_r8, int c) {
  const unsigned* r = reinterpret_cast<const unsigned*>(raw);
  tc_e2m1_fragment_of<kPrmtSign>(dst, r, r + 16, sw_r, sw_r8, c);
}
template <bool kPrmtSign>
__device__ __forceinline__ void tc_e2m1_fragment(void* dst, const void* w0, const void* w1, const void* w2,
                                                 const void* w3, const void* v0, const void* v1, const void* v2,
                                                 const void* v3, int sw_r, int sw_r8, int c) {
  const uint4 wq[4] = {*reinterpret_cast<const uint4*>(w0), *reinterpret_cast<const uint4*>(w1),
                       *reinterpret_cast<const uint4*>(w2), *reinterpret_cast<const uint4*>(w3)};
  const uint4 vq[4] = {*reinterpret_cast<const uint4*>(v0), *reinterpret_cast<const uint4*>(v1),
                       *reinterpret_cast<const uint4*>(v2), *reinterpret_cast<const uint4*>(v3)};
  tc_e2m1_fragment_of<kPrmtSign>(dst, reinterpret_cast<const unsigned*>(wq), reinterpret_cast<const unsigned*>(vq),
                                 sw_r, sw_r8, c);
}
// wr, vr: the 16 code words of rows r and r + 8
template <bool kPrmtSign>
__device__ __forceinline__ void tc_e2m1_fragment_of(void* dst, const unsigned* wr, const unsigned* vr, int sw_r,
                                                    int sw_r8, int c) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  const unsigned sel = (unsigned)c * 0x1111u + 0xC480u;   // v7's selector: c, c | 8, 4 + c, (4 + c) | 8
#ifdef TC_E2M1_NO_DECODE
  // bench.prof_mxfp4 --no-decode (a diagnostic, wrong results): the raw words go into the
  // fragments as they are, mixed with the scale words so that nothing is optimized away
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    d[4 * j + 0] = wr[2 * j] ^ (unsigned)sw_r;
    d[4 * j + 1] = vr[2 * j] ^ (unsigned)sw_r8;
    d[4 * j + 2] = wr[2 * j + 1] ^ (unsigned)c;
    d[4 * j + 3] = vr[2 * j + 1] ^ sel;
  }
  return;
#endif
  if (__all_sync(0xFFFFFFFFu, (tc_scale_over_128((unsigned)sw_r) | tc_scale_over_128((unsigned)sw_r8)) == 0u)) {
    const unsigned er = (unsigned)sw_r + 0x7E7E7E7Eu, er8 = (unsigned)sw_r8 + 0x7E7E7E7Eu;   // e8 + 126
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const unsigned bsel = 0x4040u | (unsigned)(j >> 1) * 0x0101u;   // byte j / 2 into both lanes
      const unsigned s = __byte_perm(er, 0u, bsel) << 7, t = __byte_perm(er8, 0u, bsel) << 7;
      d[4 * j + 0] = tc_bf16x2_mul(tc_e2m1x2_bits<kPrmtSign>(wr[2 * j], c, sel), s);
      d[4 * j + 1] = tc_bf16x2_mul(tc_e2m1x2_bits<kPrmtSign>(vr[2 * j], c, sel), t);
      d[4 * j + 2] = tc_bf16x2_mul(tc_e2m1x2_bits<kPrmtSign>(wr[2 * j + 1], c, sel), s);
      d[4 * j + 3] = tc_bf16x2_mul(tc_e2m1x2_bits<kPrmtSign>(vr[2 * j + 1], c, sel), t);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const unsigned s = tc_e8m0_bf16x2(((unsigned)sw_r >> (8 * (j >> 1))) & 0xFFu);
      const unsigned t = tc_e8m0_bf16x2(((unsigned)sw_r8 >> (8 * (j >> 1))) & 0xFFu);
      d[4 * j + 0] = tc_e2m1x2_scaled(tc_e2m1x2_bits<kPrmtSign>(wr[2 * j], c, sel), s);
      d[4 * j + 1] = tc_e2m1x2_scaled(tc_e2m1x2_bits<kPrmtSign>(vr[2 * j], c, sel), t);
      d[4 * j + 2] = tc_e2m1x2_scaled(tc_e2m1x2_bits<kPrmtSign>(wr[2 * j + 1], c, sel), s);
      d[4 * j + 3] = tc_e2m1x2_scaled(tc_e2m1x2_bits<kPrmtSign>(vr[2 * j + 1], c, sel), t);
    }
  }
}
"""
# (bench.prof_mxfp4 --no-decode edits it: part of the kernel and launcher caches' key, codegen.rules.options)
rules.options(__name__, "E2M1_FRAGMENT_SOURCE")
BLOCK_K = 128     # K per step: 4 scale groups, i.e. one 32-bit word of E8M0 bytes per row and step
DECODE_WORDS = (8, 4)   # 32-bit code words a thread decodes a step: 64 values at 256 MMA threads, 32 at 512


def _decode_words(raw_at, b_at, i, q, scale_word, words):
    """Words [words*q, words*(q+1)) of row i of the staged codes (raw_at(i, w)) -> the decoded tile's
    row i, columns 8*words*q.. (b_at(i, c)), one 16-byte store per word, scaled by the scale bytes of
    those columns (2q and 2q+1 of the row's scale word for the step at 8 words, q at 4). One call:
    the pointers carry their write intent, so TileLang's barriers see the stores, and its sync pass
    put a barrier between any two such calls (it cannot tell the 16-byte regions apart)."""
    ws = [q * words + c for c in range(words)]
    T.evaluate(T.call_extern("handle", f"tc_e2m1x{8 * words}_store",
                             *[T.access_ptr(b_at(i, w * 8), "w", 8) for w in ws], *[raw_at(i, w) for w in ws],
                             scale_word, q))


def _decode_split(threads, block_n, block_k):
    """Code words a thread decodes a step: every MMA thread decodes the same share of the tile, 8 or
    4 words (256 or 512 MMA threads at 128 x 128; 512 runs four MMA warpgroups, their setmaxnreg
    split checked against the launch allocation at trace time: sm90_decoded.consumer_regs)."""
    words = block_n * block_k // (8 * threads) if threads > 0 else 0
    if words not in DECODE_WORDS or words * 8 * threads != block_n * block_k:
        raise ValueError(f"threads must give every MMA thread {' or '.join(map(str, DECODE_WORDS))} code words of "
                         f"the {block_n} x {block_k} tile (threads = {block_n * block_k // 64} or "
                         f"{block_n * block_k // 32}), got {threads}")
    return words


@T.macro
def _stage_scales(sw, word_at):
    # sw (steps, block_n): the block's E8M0 scale words, step-major (word_at(step, row) in global)
    for si, i in tile.parallel(sw.shape[0], sw.shape[1]):
        sw[si, i] = word_at(si, i)


@T.macro
def _stage_scale_rows(sw, word_at):
    # sw (block_n, steps): the block's E8M0 scale words, row-major (word_at(row, step) in global)
    for i, si in tile.parallel(sw.shape[0], sw.shape[1]):
        sw[i, si] = word_at(i, si)


# The shared-memory decode's threads (tile.mma_decoded_loop): True, a warp takes 32 consecutive rows of one column
# range (the raw tile swizzled to match, swizzle_raw); False, 16 rows x both halves (two threads a row). The decoded
# tile is 128B-swizzled for the WGMMA, so a quarter-warp's 16-byte stores of 4 rows x 2 halves hit 4 bank groups twice
# (ncu, contiguous 4x1024x4096x7168: 23% of shared wavefronts excessive, 8 extra on each STS.128 and raw LDS.128;
# bench/NOTES.md "Session 48"); 8 consecutive rows of one half hit 8.
DECODE_ROW_WARPS = True


def _decode_tile(raw_at, b_at, sw, step, block_n, block_k, words, row_warps):
    # a (block_n, block_k) tile: each thread decodes 8 * words values of one row
    (_decode_by_rows if row_warps else _decode_by_pairs)(raw_at, b_at, sw, step, block_n, block_k, words)


@T.macro
def _decode_by_rows(raw_at, b_at, sw, step, block_n, block_k, words):
    for q, i in tile.parallel(block_k // (8 * words), block_n):
        _decode_words(raw_at, b_at, i, q, sw[step, i], words)


@T.macro
def _decode_by_pairs(raw_at, b_at, sw, step, block_n, block_k, words):
    for i, q in tile.parallel(block_n, block_k // (8 * words)):
        _decode_words(raw_at, b_at, i, q, sw[step, i], words)


@tile_program(
    "mxfp4_gemm_nt",
    targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950"),
    examples={"decode-7168x2048": dict(n=7168, k=2048, block_m=64, splits=2),
              "prefill-4096x7168": dict(n=4096, k=7168)},
)
def mxfp4_gemm_program(n: int, k: int, block_m: int = 128, block_n: int = 128, block_k: int = BLOCK_K,
                       stages: int = 3, threads: int = 256, splits: int = 1, row_warps: bool = True):
    """bf16 A tiles by TMA; packed B tiles decoded to bf16 in shared memory; bf16 MMA: the K loop is
    tile.mma_decoded_loop (on sm_90a a TMA warpgroup, and the decode of step s+1 runs under the
    WGMMA of step s).

    The block's E8M0 scale words (its K range x block_n rows) are staged once, before the loop.
    splits > 1: split-K into fp32 partials, summed in order by ops.gemm_fp8.fp8_gemm_reduce_program
    (decode grids are too small to fill the GPU otherwise).
    """
    assert k % block_k == 0 and n % block_n == 0 and block_k == BLOCK_K
    words = _decode_split(threads, block_n, block_k)
    m = T.dynamic("m")
    n_tiles = n // block_n
    kb = k // block_k
    per = -(-kb // splits)                       # K steps per split
    part_shape = (splits, m, n) if splits > 1 else (1, 1, n)

    @T.prim_func
    def mxfp4_gemm_nt(A: T.Tensor((m, k), "bfloat16"), B: T.Tensor((n, k // 8), "int32"),
                      SFB: T.Tensor((n, kb), "int32"), C: T.Tensor((m, n), "bfloat16"),
                      Part: T.Tensor(part_shape, "float32")):
        with tile.grid(T.ceildiv(m, block_m) * n_tiles * splits, threads + tile.producer_threads()) as bid:
            tm, tn, ts = tile.split_index(bid, (T.ceildiv(m, block_m), n_tiles, splits))
            sw = tile.stage((per, block_n), "int32")      # E8M0 bytes of (step, row), step-major
            acc = tile.accumulator((block_m, block_n))
            k0 = ts * per
            steps = T.max(T.min(per, kb - k0), 0)
            tile.import_cuda_helpers(E2M1_SOURCE)
            # one step's tiles: A (TMA zero-fills rows past m) and the packed codes as 32-bit words
            # (lambda parameters are named apart from every loop variable: the DSL tracks names)
            loads = lambda blk: (  # noqa: E731
                A[tm * block_m:(tm + 1) * block_m, (k0 + blk) * block_k:(k0 + blk + 1) * block_k],
                B[tn * block_n:(tn + 1) * block_n, (k0 + blk) * (block_k // 8):(k0 + blk + 1) * (block_k // 8)])
            tile.mma_decoded_loop(
                steps, loads, [((block_m, block_k), "bfloat16"), ((block_n, block_k // 8), "int32"),
                               ((block_n, block_k), "bfloat16")], acc,
                _decoder(sw, block_n, block_k, words, row_warps),
                stages=stages,
                swizzle_raw=row_warps,
                # the block's scale words staged once (one 32-bit load per row and step), under the first loads
                prologue=lambda: _stage_scales(sw, lambda si, i: SFB[tn * block_n + i, T.min(k0 + si, kb - 1)]),
                epilogue=lambda: _store(acc, C, Part, tm, tn, ts, m, steps, splits, block_m, block_n))

    return mxfp4_gemm_nt


def _decoder(sw, block_n, block_k, words, row_warps):
    """The decoded-tile programs' decode(raw_at, b_at, step): the CUDA helpers' (_decode_tile); called with rows=
    (a target whose vector cores each decode part of the tile into their own: ascend:950), plain TileLang's."""
    def decode(raw_at, b_at, blk, rows=None):
        if rows is None:
            return _decode_tile(raw_at, b_at, sw, blk, block_n, block_k, words, row_warps)
        return _decode_rows(raw_at, b_at, sw, blk, rows[1], block_k)
    return decode


@T.macro
def _decode_rows(raw_at, dst, sw, step, first, block_k):
    """The decode in plain TileLang (no CUDA helpers): dst (rows, block_k) = this core's rows of the step's tile,
    row i being the tile's row first + i: code c % 8 of raw word (i, c / 8), times 2^(E8M0 byte c / 32 of the row's
    scale word - 127), exact in fp32 and in the 16-bit result."""
    for i, c in tile.parallel(dst.shape[0], block_k):
        dst[i, c] = T.cast(_e2m1_value(T.shift_right(raw_at(i, c // 8), 4 * (c % 8)) & 15) *
                           _e8m0_value(T.shift_right(sw[step, first + i], 8 * (c // MX)) & 255), dst.dtype)


def _e2m1_value(code):
    # magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: from 2 up, (2 + odd) * 2^(code / 2 - 2); bit 3 the sign
    mag = code & 7
    value = T.if_then_else(mag < 2, T.cast(mag, "float32") * 0.5,
                           T.cast(2 + mag % 2, "float32") * T.cast(T.shift_left(1, mag // 2), "float32") * 0.25)
    return T.if_then_else(code >= 8, -value, value)


def _e8m0_value(e):
    # 2^(e - 127) as fp32 bits (e = 0: the subnormal 2^-127), NaN for 255 (OCP MX)
    return T.reinterpret(T.if_then_else(e == 255, 0x7FC00000, T.if_then_else(e == 0, 0x00400000, T.shift_left(e, 23))),
                         "float32")


@T.macro
def _store(acc, C, Part, tm, tn, ts, m, steps, splits, block_m, block_n):
    # the rows of the tile this core's vector code holds: all, or a half on Ascend (tile.split_rows)
    out = tile.read_accumulator(acc)
    mine, first = tile.split_rows(block_m)
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = tm * block_m + first + i
            if r < m:
                if splits > 1:   # a split past the end of K (steps == 0) contributes zeros
                    Part[ts, r, tn * block_n + j] = T.if_then_else(steps > 0, out[i, j], 0.0)
                else:
                    C[r, tn * block_n + j] = T.cast(out[i, j], "bfloat16")


SWAPPED_TOKENS = (8, 16, 32, 64)   # token tiles (the WGMMA's N) of the swapped kernel; m up to 64
SWAPPED_K_ALIGN = 512   # the swapped kernels TMA their scale rows: k / 128 words a row, 16-byte strides
SWAPPED_STAGE_K = (128, 256, 512)  # K depths of a swapped pipeline stage, most preferred first (128: measured best)


SWAPPED_DECODES = ("v6", "v7")


def swapped_loads(A, B, tn, k0, block_n, tokens, stage_k):
    """The swapped kernels' loads(blk): stage k0 + blk's (tokens, stage_k) activations and the raw words of tile
    tn's block_n weight rows. (Lambda parameters are named apart from every loop variable: the DSL tracks names.)"""
    return lambda blk: (A[0:tokens, (k0 + blk) * stage_k:(k0 + blk + 1) * stage_k],
                        B[tn * block_n:(tn + 1) * block_n, (k0 + blk) * (stage_k // 8):(k0 + blk + 1) * (stage_k // 8)])


def masked_swapped_loads(A, B, g, tn, block_n, tokens):
    """swapped_loads for the masked grouped layout: group g's, 128-deep steps over the whole K."""
    return lambda blk: (A[g, 0:tokens, blk * BLOCK_K:(blk + 1) * BLOCK_K],
                        B[g, tn * block_n:(tn + 1) * block_n, blk * (BLOCK_K // 8):(blk + 1) * (BLOCK_K // 8)])


@T.macro
def _decode_fragment(raw_at, rows, place, step, dst, sw, decode="v7"):
    # this thread's A fragment of the step: byte `place` of every code word of its two rows
    r, r8 = rows
    T.evaluate(T.call_extern("handle", _fragment_helper("tc_e2m1_fragment", decode), dst,
                             *[T.access_ptr(raw_at(row, 4 * q), "r", 4) for row in (r, r8) for q in range(4)],
                             sw[r, step], sw[r8, step], place))


@T.macro
def _load_rows(raw_at, rows, buf):
    # this thread's two rows of the step's raw words into registers (buf: 32 words), a step ahead
    r, r8 = rows
    T.evaluate(T.call_extern("handle", "tc_e2m1_rows_load", buf,
                             *[T.access_ptr(raw_at(row, 4 * q), "r", 4) for row in (r, r8) for q in range(4)]))


@T.macro
def _decode_from(raw, rows, place, step, dst, sw, decode="v7"):
    # _decode_fragment from the raw words _load_rows put in registers
    r, r8 = rows
    T.evaluate(T.call_extern("handle", _fragment_helper("tc_e2m1_fragment_from", decode), dst, raw, sw[r, step],
                             sw[r8, step], place))


def _fragment_helper(name, decode):
    # the decode helper's instance: v7 is its prmt sign-mode bit placement
    return f"{name}<{'true' if decode == 'v7' else 'false'}>"


@tile_program(
    "mxfp4_gemm_nt_swapped",
    targets=("cuda:sm_90a",),
    examples={"decode-4096x7168": dict(n=4096, k=7168, tokens=64, splits=4),
              "decode-7168x2048": dict(n=7168, k=2048, tokens=8, splits=2)},
)
def mxfp4_swapped_program(n: int, k: int, tokens: int = 64, block_n: int = 128, stages: int = 6,
                          splits: int = 1, blocks_per_sm: int = 1, stage_k: int = BLOCK_K, trace: bool = False,
                          scale_tma: bool = True, ramp: int = 0, decode: str = "v7", fold: bool = False,
                          ahead: bool = False, pair: bool = False, stage_out: bool = False, chains: int = 1):
    """Decode-sized m (<= tokens <= 64): C^T (n, m) = dequant(B) @ A^T, the weights as the MMA's
    M side. Each MMA thread decodes its own fragment rows of a 128-deep K step from shared memory
    straight into registers, and WGMMA takes them from there (tile.mma_register_decoded_loop): no
    decoded tile, no barrier between the decode and the MMA. A is the (tokens, 128) shared operand
    of a step, loaded by TMA (rows past m zero-filled). splits > 1: fp32 partials per split,
    summed in order by ops.gemm_fp8.fp8_gemm_reduce_program, or (fold=True) by the last of a tile's
    split blocks to arrive on Count[tile] (tile.last_arrival): the same order, the same bits, no
    reduce kernel. Count: >= n / block_n zeros, each set back to 0 by its tile's last block. The fold
    has no fences: Part must hold READY_EMPTY in every word (ops._workspace.ready_partials) and is
    left so (see READY_SOURCE).
    ahead=True: each MMA thread loads its raw words of step s + 1 into registers before it decodes
    step s (the loads' latency under the decode; stage_k = 128 only).
    pair=True (splits == 2): a tile's two split blocks are a cluster; each stores the half of its
    partial that the other owns (half of the tokens) into the other's `recv` in distributed shared
    memory, then one cluster barrier, then each adds and stores its half of C: no Part, no reduce
    kernel, the reduce kernel's bits (P0 + P1 == P1 + P0 in fp32). Part is then bound, never touched.
    stage_out=True (split plans): the fp32 partial goes through shared memory (token-major, rows padded
    to 132 words against bank conflicts) and out as 16-byte stores of whole token rows, instead of
    4-byte stores from the accumulator layout.
    chains=2 (block_n 64; no fold, stage_out or ahead): two MMA warpgroups take alternate K steps of the
    block's 64 rows, each into its own half of a (128, tokens) accumulator (tile.mma_register_decoded_loop(chains=2));
    the halves go through shared memory and are added, chain 0's plus chain 1's, as C (or a split's partial, for the
    reduce kernel) is stored; with pair (2 splits), the sums of the other block's tokens go to its token-major recv
    and each block stores its tokens' C. Two decoding warpgroups an SM, as 128-row blocks have, on half the rows.

    trace=True (bench.trace_mxfp4): the SM clock (32-bit) when block b's first MMA thread reaches
    each of SWAPPED_TRACE_EVENTS goes to Trace[b, event] (the global timer's ns for "entry ns" and
    "stored ns"); step s's SWAPPED_STEP_EVENTS (s < 64: "data", "decoded", "launched", "issued") to
    Trace[b, 6 + 4s + e].
    Without it, Trace is bound but never touched."""
    assert k % stage_k == 0 and stage_k % BLOCK_K == 0 and n % block_n == 0 and tokens in SWAPPED_TOKENS
    assert k % SWAPPED_K_ALIGN == 0 and decode in SWAPPED_DECODES
    if fold and splits == 1:
        raise ValueError("fold=True adds split-K partials inside the kernel: it needs splits > 1")
    if pair and (splits != 2 or fold):
        raise ValueError(f"pair=True folds the partials of a cluster of 2 splits: it needs splits == 2 and "
                         f"fold=False, got splits={splits}, fold={fold}")
    if stage_out and (splits == 1 or pair):
        raise ValueError(f"stage_out=True writes split-K partials: it needs splits > 1 and pair=False, got "
                         f"splits={splits}, pair={pair}")
    if chains not in (1, 2) or (chains == 2 and (block_n != 64 or fold or stage_out or ahead)):
        raise ValueError(f"chains must be 1 or 2; 2 takes block_n=64 and no fold, stage_out or ahead, got "
                         f"chains={chains!r}, block_n={block_n}, fold={fold}, pair={pair}, stage_out={stage_out}, "
                         f"ahead={ahead}")
    m, counts = T.dynamic("m, counts")
    n_tiles, kb, sk = n // block_n, k // BLOCK_K, k // stage_k
    per = -(-sk // splits) * (stage_k // BLOCK_K)       # 128-deep steps of a split (its scale words)
    box = swapped_scale_box(per, kb) if scale_tma else per     # scale words a block stages
    part_shape = (splits, m, n) if splits > 1 and not pair else (1, 1, n)

    @T.prim_func
    def mxfp4_gemm_nt_swapped(A: T.Tensor((m, k), "bfloat16"), B: T.Tensor((n, k // 8), "int32"),
                              SFB: T.Tensor((n, kb), "int32"), C: T.Tensor((m, n), "bfloat16"),
                              Part: T.Tensor(part_shape, "float32"),
                              Trace: T.Tensor((n_tiles * splits if trace else 1, SWAPPED_TRACE_WORDS), "int32"),
                              Count: T.Tensor((counts,), "int32")):
        with _swapped_grid(n_tiles * splits, 2 * block_n * chains + tile.producer_threads(), pair) as bid:
            tn, ts = tile.split_index(bid, (n_tiles, splits))    # pair: ts is the block's rank in its cluster
            recv = None
            if pair:   # the other split's partial of this block's half of the tokens
                recv = tile.stage(pair_recv_shape(tokens, block_n, chains), "float32")
                _touch(recv)      # a live range of its own (see ops.gemm_fp8: the peer stores during our loop)
                tile.cluster_barrier()            # both blocks started before either stores into the other
            staged = None
            if stage_out or chains > 1:    # the partial, token-major, for whole-row stores; the chains' halves
                staged = tile.stage((tokens, block_n * chains + 4), "float32")
            sw = tile.stage((block_n, box), "int32")      # E8M0 bytes of (row, step) of the split
            acc = tile.accumulator((block_n * chains, tokens))     # C^T: weight rows x tokens (a chain's rows each)
            spl = per * BLOCK_K // stage_k                # stages of stage_k a split
            k0 = ts * spl
            w0 = ts * per                                 # the split's first scale word (128-deep step)
            s0 = T.min(w0 // 4 * 4, kb - box) if scale_tma else w0    # where its staged words start
            steps = T.max(T.min(spl, sk - k0), 0)
            T.import_source(E2M1_SOURCE + E2M1_FRAGMENT_SOURCE + pair_source(pair) + (READY_SOURCE if fold else ""))
            # (lambda parameters are named apart from every loop variable: the DSL tracks names)
            loads = swapped_loads(A, B, tn, k0, block_n, tokens, stage_k)
            if ahead:     # (raw words to registers a step ahead, decode from them)
                decoder = (lambda raw_at, rows, buf: _load_rows(raw_at, rows, buf),
                           lambda raw, rows, place, blk, dst: _decode_from(raw, rows, place, blk + w0 - s0, dst, sw,
                                                                           decode))
            else:
                decoder = lambda raw_at, rows, place, blk, dst: _decode_fragment(  # noqa: E731
                    raw_at, rows, place, blk + w0 - s0, dst, sw, decode)
            if chains > 1 and pair:
                epilogue = lambda: _pair_fold_chains(acc, C, recv, staged, tn, ts, m, steps,  # noqa: E731
                                                     block_n, tokens)
            elif chains > 1:
                epilogue = lambda: _store_chains(acc, C, Part, staged, tn, ts, m, steps, splits, block_n,  # noqa: E731
                                                 tokens)
            else:
                epilogue = swapped_epilogue(acc, C, Part, Count, recv, tn, ts, m, steps, splits, block_n, tokens, fold,
                                            mark=(lambda event: _trace_stamp(Trace, bid, event, 0)) if trace else None,
                                            staged=staged)
            tile.mma_register_decoded_loop(
                steps, loads, [((tokens, stage_k), "bfloat16"), ((block_n, stage_k // 8), "int32"),
                               ((block_n * chains, BLOCK_K), "bfloat16")], acc, decoder,
                stages=stages, blocks_per_sm=blocks_per_sm, ramp=ramp, **({"chains": chains} if chains > 1 else {}),
                mark=(lambda event, step: _trace_stamp(Trace, bid, event, step, chains)) if trace else None,
                # the split's scale words by TMA ahead of the stages (`box` words from s0, 16-byte
                # aligned), or loaded by the MMA threads while the first stages fly
                preload=[(SFB[tn * block_n:(tn + 1) * block_n, s0:s0 + box], sw)] if scale_tma else (),
                prologue=None if scale_tma else lambda: _stage_scale_rows(
                    sw, lambda i, si: SFB[tn * block_n + i, T.min(w0 + si, kb - 1)]),
                epilogue=epilogue)

    return mxfp4_gemm_nt_swapped


@tile_program(
    "mxfp4_gemm_nt_masked_swapped",
    targets=("cuda:sm_90a",),
    examples={"decode-8x4096x7168": dict(n=4096, k=7168, tokens=64, stages=7)},
)
def mxfp4_masked_swapped_program(n: int, k: int, tokens: int = 64, block_n: int = 128, stages: int = 6,
                                 decode: str = "v7", scale_tma: bool = True, staged_out: bool = False):
    """The masked grouped layout (decode MoE: A (groups, max_m, k), max_m <= tokens <= 64; only the
    first MaskedM[g] rows of group g are computed, the rest of C is zeros) on the swapped kernel:
    a block takes one group's 128 weight rows over the whole K (the groups fill the GPU, no
    split-K). A group with no rows loads nothing and stores zeros. scale_tma: the scale rows by TMA
    ahead of the stages, or by the MMA threads (as mxfp4_gemm_nt_swapped's). staged_out: C's tile
    goes out through shared memory as whole rows (16-byte stores)."""
    assert k % SWAPPED_K_ALIGN == 0 and n % block_n == 0 and tokens in SWAPPED_TOKENS and decode in SWAPPED_DECODES
    groups, max_m = T.dynamic("groups, max_m")
    n_tiles, kb = n // block_n, k // BLOCK_K

    @T.prim_func
    def mxfp4_gemm_nt_masked_swapped(A: T.Tensor((groups, max_m, k), "bfloat16"),
                                     B: T.Tensor((groups, n, k // 8), "int32"),
                                     SFB: T.Tensor((groups, n, kb), "int32"), MaskedM: T.Tensor((groups,), "int32"),
                                     C: T.Tensor((groups, max_m, n), "bfloat16")):
        with tile.grid(groups * n_tiles, 2 * block_n + tile.producer_threads()) as bid:
            g, tn = tile.split_index(bid, (groups, n_tiles))
            sw = tile.stage((block_n, kb), "int32")       # E8M0 bytes of (row, step)
            acc = tile.accumulator((block_n, tokens))     # C^T of the group: weight rows x tokens
            rows = MaskedM[g]
            steps = tile.steps_if(rows > 0, kb)
            T.import_source(E2M1_SOURCE + E2M1_FRAGMENT_SOURCE)
            loads = masked_swapped_loads(A, B, g, tn, block_n, tokens)
            staged = tile.stage((tokens, block_n + 8), "bfloat16") if staged_out else None    # 8: no bank conflicts
            tile.mma_register_decoded_loop(
                steps, loads, [((tokens, BLOCK_K), "bfloat16"), ((block_n, BLOCK_K // 8), "int32"),
                               ((block_n, BLOCK_K), "bfloat16")], acc,
                lambda raw_at, frows, place, blk, dst: _decode_fragment(raw_at, frows, place, blk, dst, sw, decode),
                stages=stages,
                preload=[(SFB[g, tn * block_n:(tn + 1) * block_n, 0:kb], sw)] if scale_tma else (),
                prologue=None if scale_tma else lambda: _stage_scale_rows(
                    sw, lambda i, si: SFB[g, tn * block_n + i, si]),
                epilogue=lambda: _store_masked_swapped(acc, C, g, tn, rows, max_m, block_n, tokens, staged=staged))

    return mxfp4_gemm_nt_masked_swapped


@T.macro
def _store_masked_swapped(acc, C, g, tn, rows, max_m, block_n, tokens, factor=None, mark=None, staged=None,
                          again=False, live=None):
    # rows: the group's row count (token j is live below it), or live(j) instead (ops.gemm_w4a8's contiguous layout:
    # a chunk's padding rows); factor(i, j), mark(event): as _store_swapped's; staged ((tokens, block_n + 8) bf16 in
    # shared memory): the tile
    # goes out token-major through it, as whole 256-byte rows of C (16-byte stores), instead of one 2-byte store a
    # value from the accumulator's layout (4 scattered sectors a warp store). again: staged may still be read by
    # the block's previous tile's stores (several tiles a block): wait for them first
    out = _scaled(tile.read_accumulator(acc), factor, block_n, tokens)
    if live is None:
        live = lambda j: j < rows  # noqa: E731
    if mark is not None:
        mark("scaled")
    if staged is not None:
        if again:
            tile.barrier(threads=2 * block_n)
        for i, j in tile.parallel(block_n, tokens):
            staged[j, i] = T.if_then_else(live(j), T.cast(out[i, j], "bfloat16"), T.cast(0, "bfloat16"))
        tile.barrier(threads=2 * block_n)
        for j, i in tile.parallel(tokens, block_n):
            if j < max_m:
                C[g, j, tn * block_n + i] = staged[j, i]
    else:
        for i, j in tile.parallel(block_n, tokens):
            if j < max_m:   # tokens past masked_m (and every token of a group with none) are zeros
                C[g, j, tn * block_n + i] = T.if_then_else(live(j), T.cast(out[i, j], "bfloat16"),
                                                           T.cast(0, "bfloat16"))
    if mark is not None:
        mark("sent")


def swapped_scale_box(per: int, kb: int) -> int:
    """Scale words a row the swapped kernel stages for a split of `per` 128-deep steps (k / 128 = kb
    words a row, kb % 4 == 0): TMA boxes start 16-byte aligned in the row (a box starting
    elsewhere faulted on the H200: illegal instruction) and end inside it, so a split whose words
    start mid-group takes up to 3 words before them, and the last split's box ends at the row's end."""
    return per if per % 4 == 0 else min(kb, -(-(per + 3) // 4) * 4)


def plan_masked_swapped(max_m: int, k: int, a_bytes: int = 2) -> dict:
    """The masked swapped kernel's token tile and stages (the block stages its whole K range of
    scale words: k / 128 x 128 words); a_bytes: bytes an activation (1: ops.gemm_w4a8's e4m3)."""
    if k % SWAPPED_K_ALIGN:
        raise ValueError(f"the masked swapped kernel needs k % {SWAPPED_K_ALIGN} == 0 (TMA'd scale rows), got k={k}")
    if SWAPPED_DECODE not in SWAPPED_DECODES:
        raise ValueError(f"ops.gemm_mxfp4.SWAPPED_DECODE must be one of {SWAPPED_DECODES}, got {SWAPPED_DECODE!r}")
    tokens = next(t for t in SWAPPED_TOKENS if t >= max(max_m, 1))
    stage = tokens * BLOCK_K * a_bytes + 128 * BLOCK_K // 2
    stages = min(8, (SMEM_BUDGET - 128 * (k // BLOCK_K) * 4) // stage)
    # C staged as whole rows where that costs no stage (k = 7168: 8 -> 7 stages, 74 -> 80 us; session 46); ops.gemm_w4a8
    # plans its own (W4A8_MASKED_STAGED)
    staged = (MASKED_STAGED and a_bytes == 2
              and (SMEM_BUDGET - 128 * (k // BLOCK_K) * 4 - tokens * 136 * 2) // stage >= stages)
    if stages < 2:
        raise ValueError(f"k={k} is too long for the masked swapped kernel's staged scales")
    # scale rows by TMA (the path measured, -042253Z) unless SWAPPED_SCALE_TMA is False
    scale_tma = True if SWAPPED_SCALE_TMA is None else SWAPPED_SCALE_TMA
    return dict(tokens=tokens, stages=stages, decode=SWAPPED_DECODE, scale_tma=scale_tma, staged_out=staged)


# SM clock at each event, then the global timer (ns, low 32 bits) at entry and stored; then each
# traced step's SWAPPED_STEP_EVENTS (SM clock)
SWAPPED_TRACE_EVENTS = ("entry", "prologue done", "loop done", "stored", "entry ns", "stored ns",
                        # inside the epilogue (swapped_epilogue's mark): the accumulator read and scaled; the partial
                        # sent (pair: stored into the other block; split: stored to Part); the exchange done (pair:
                        # past the cluster barrier; fold: the tile's last block, past its arrival)
                        "scaled", "sent", "exchanged")
# each traced step's stamps: its tiles landed, decoded into the fragment, WGMMAs issued, the step before's retired
SWAPPED_STEP_EVENTS = ("data", "decoded", "launched", "issued")
SWAPPED_TRACE_STEPS = 64
SWAPPED_TRACE_WORDS = len(SWAPPED_TRACE_EVENTS) + len(SWAPPED_STEP_EVENTS) * SWAPPED_TRACE_STEPS


def _trace_stamp(Trace, bid, event, step, chains=1):
    # chains=2: a step's events by the first thread of the chain that runs it (steps alternate between the chains)
    if event in SWAPPED_TRACE_EVENTS:
        if event + " ns" in SWAPPED_TRACE_EVENTS:
            _stamp_clock(Trace, bid, SWAPPED_TRACE_EVENTS.index(event + " ns"), 1, "tc_globaltimer_lo", 0)
        _stamp_clock(Trace, bid, SWAPPED_TRACE_EVENTS.index(event), 1, "clock", 0)
    else:
        _stamp_clock(Trace, bid, len(SWAPPED_TRACE_EVENTS) + len(SWAPPED_STEP_EVENTS) * step
                     + SWAPPED_STEP_EVENTS.index(event), step < SWAPPED_TRACE_STEPS, "clock", 128 if chains > 1 else 0)


@T.macro
def _stamp_clock(Trace, bid, at, keep, timer, span):
    # the SM clock (or the global timer) when the block's first MMA thread gets here (span > 0: the first thread of
    # each span of MMA threads, a chain)
    if (T.get_thread_binding() % span if span else T.get_thread_binding()) == 0:
        if keep:
            Trace[bid, at] = T.call_extern("int32", timer)


def _swapped_grid(blocks, threads, pair):
    # pair: a tile's two split blocks (consecutive ids, split innermost) are a cluster
    return tile.cluster_grid(blocks, threads, 2) if pair else tile.grid(blocks, threads)


def _scaled(out, factor, block_n, tokens):
    # the accumulator's values multiplied in place by factor(row, token) (ops.gemm_w4a8's row and token scales)
    if factor is not None:
        _scale_in_place(out, factor, block_n, tokens)
    return out


@T.macro
def _scale_in_place(out, factor, block_n, tokens):
    for i, j in tile.parallel(block_n, tokens):
        out[i, j] = out[i, j] * factor(i, j)


def pair_source(pair: bool) -> str:
    """The device helpers a swapped program's pair fold imports (none without the pair)."""
    return tile.helper_source("cluster_store") if pair else ""


def pair_recv_words(tokens: int) -> int:
    """The row length (fp32 words) of the pair fold's recv tile (block_n rows x the other block's half of the tokens).
    A warp's store or load of accumulator elements touches 8 rows x 4 token pairs at once: with rows of 16 or 32
    words, every row starts in bank 0 or 16 (4- and 8-way bank conflicts on both sides of the DSMEM exchange); 8
    more words put rows 0-3 and 4-7 in distinct banks (2-way, the least for 4-byte accesses at 2-word token
    spacing). Measured (bench/NOTES.md "Session 45"): the 64-token W4A8 pair epilogue ~6300 -> ~5450 cycles in the
    traces, the op's time unchanged (the rest of that epilogue is not the exchange)."""
    half = tokens // 2
    return half + 8 if half % 16 == 0 else half


def pair_recv_shape(tokens: int, block_n: int, chains: int = 1) -> tuple[int, int]:
    """The pair fold's recv tile (fp32): (block_n, pair_recv_words(tokens)) weight-row-major, or with chains=2
    token-major (tokens / 2, block_n + 4), the other block's sums of this block's tokens as whole rows."""
    return (tokens // 2, block_n + 4) if chains > 1 else (block_n, pair_recv_words(tokens))


def pair_recv_bytes(tokens: int, block_n: int, chains: int = 1) -> int:
    """Shared memory of pair_recv_shape (chains=0: no pair, 0 bytes)."""
    if not chains:
        return 0
    rows, words = pair_recv_shape(tokens, block_n, chains)
    return rows * words * 4


@T.macro
def _pair_fold_swapped(acc, C, recv, tn, ts, m, steps, block_n, tokens, factor=None, mark=None, staged=None):
    # block ts of the pair owns tokens [ts * half, (ts + 1) * half) of the tile; a split past the end
    # of K (steps == 0) contributes zeros; factor as _store_swapped's; staged ((half, block_n + 8) bf16): the
    # block's half goes out token-major through shared memory, as whole rows of C (16-byte stores)
    half = tokens // 2
    out = _scaled(tile.read_accumulator(acc), factor, block_n, tokens)
    if mark is not None:
        mark("scaled")
    for i, j in tile.parallel(block_n, tokens):
        if j < m and j // half != ts:
            tile.cluster_store(recv[i, j % half], j // half, T.if_then_else(steps > 0, out[i, j], 0.0))
    if mark is not None:
        mark("sent")
    tile.cluster_barrier()
    if mark is not None:
        mark("exchanged")
    if staged is not None:
        for i, j in tile.parallel(block_n, tokens):
            if j // half == ts:     # rows past m are staged too (never stored)
                staged[j % half, i] = T.cast(T.if_then_else(steps > 0, out[i, j], 0.0) + recv[i, j % half],
                                             "bfloat16")
        tile.barrier(threads=2 * block_n)
        for jj, i in tile.parallel(half, block_n):
            if ts * half + jj < m:
                C[ts * half + jj, tn * block_n + i] = staged[jj, i]
    else:
        for i, j in tile.parallel(block_n, tokens):
            if j < m and j // half == ts:
                C[j, tn * block_n + i] = T.cast(T.if_then_else(steps > 0, out[i, j], 0.0) + recv[i, j % half],
                                                "bfloat16")


def swapped_epilogue(acc, C, Part, Count, recv, tn, ts, m, steps, splits, block_n, tokens, fold, staged=None,
                     factor=None, mark=None):
    """The swapped kernels' epilogue (bf16 and ops.gemm_w4a8's): with recv (pair), the cluster pair's fold;
    otherwise C, or the split's partial (then the fold or the reduce kernel); staged: a shared tile the result goes
    out through as whole rows (split partials: (tokens, block_n + 4) fp32; the pair's C: (tokens / 2, block_n + 8)
    bf16). mark(event), if given, stamps the
    trace's epilogue events ("scaled", "sent", "exchanged": SWAPPED_TRACE_EVENTS)."""
    if recv is not None:    # staged: the pair's (half, block_n + 8) bf16 tile of C
        return lambda: _pair_fold_swapped(acc, C, recv, tn, ts, m, steps, block_n, tokens, factor=factor, mark=mark,
                                          staged=staged)
    return lambda: _store_swapped(acc, C, Part, Count, tn, ts, m, steps, splits, block_n, tokens, fold, staged,
                                  factor=factor, mark=mark)


@T.macro
def _store_swapped(acc, C, Part, Count, tn, ts, m, steps, splits, block_n, tokens, fold, staged=None, factor=None,
                   mark=None):
    # factor(i, j): what accumulator element (row i, token j) is multiplied by before it is stored (None: 1)
    out = _scaled(tile.read_accumulator(acc), factor, block_n, tokens)
    if mark is not None:
        mark("scaled")
    if staged is not None:   # through shared memory, then whole token rows of the tile
        for i, j in tile.parallel(block_n, tokens):
            staged[j, i] = T.if_then_else(steps > 0, out[i, j], 0.0)
        tile.barrier(threads=2 * block_n)
        for j, i in tile.parallel(tokens, block_n):
            if j < m:
                Part[ts, j, tn * block_n + i] = ready_value(staged[j, i]) if fold else staged[j, i]
    else:
        for i, j in tile.parallel(block_n, tokens):
            if j < m:
                if splits > 1:   # a split past the end of K (steps == 0) contributes zeros
                    Part[ts, j, tn * block_n + i] = (ready_value(T.if_then_else(steps > 0, out[i, j], 0.0))
                                                     if fold else T.if_then_else(steps > 0, out[i, j], 0.0))
                else:
                    C[j, tn * block_n + i] = T.cast(out[i, j], "bfloat16")
    if mark is not None:
        mark("sent")
    if fold:   # the tile's last split block adds the partials in split order (the reduce kernel's bits)
        if tile.last_arrival(Count, tn, splits, threads=2 * block_n, ordered=False):
            if mark is not None:
                mark("exchanged")
            ready_fold(C, Part, splits, tokens, block_n, tn * block_n, m, m, 2 * block_n)


@T.macro
def _store_chains(acc, C, Part, staged, tn, ts, m, steps, splits, block_n, tokens, factor=None):
    # chains=2: the accumulator's two halves (rows i and block_n + i: one weight row's sums over the two chains'
    # steps) through shared memory, token-major, then whole token rows of their sums (chain 0's plus chain 1's, times
    # factor(row, token) if given: ops.gemm_w4a8's scales): C, or the split's partial for the reduce kernel (zeros
    # from a split past the end of K)
    out = tile.read_accumulator(acc)
    for i, j in tile.parallel(2 * block_n, tokens):
        staged[j, i] = out[i, j]
    tile.barrier(threads=4 * block_n)
    for j, i in tile.parallel(tokens, block_n):
        if j < m:
            if splits > 1:
                Part[ts, j, tn * block_n + i] = T.if_then_else(steps > 0, _chain_sum(staged, block_n, factor, i, j),
                                                               0.0)
            else:
                C[j, tn * block_n + i] = T.cast(_chain_sum(staged, block_n, factor, i, j), "bfloat16")


@T.macro
def _pair_fold_chains(acc, C, recv, staged, tn, ts, m, steps, block_n, tokens, factor=None):
    # chains=2 with pair (2 splits, a cluster of the tile's two blocks): the halves added as _store_chains adds them
    # (times factor), then block ts keeps tokens [ts * half, (ts + 1) * half) and stores the other half's sums into the
    # other block's recv (token-major, whole rows) through distributed shared memory; after one cluster barrier it adds
    # the received split's sums to its own (P0 + P1 == P1 + P0 in fp32: the reduce kernel's bits) and stores C. A
    # split past the end of K (steps == 0) contributes zeros
    half = tokens // 2
    out = tile.read_accumulator(acc)
    for i, j in tile.parallel(2 * block_n, tokens):
        staged[j, i] = out[i, j]
    tile.barrier(threads=4 * block_n)
    for j, i in tile.parallel(tokens, block_n):
        if j < m and j // half != ts:
            tile.cluster_store(recv[j % half, i], j // half,
                               T.if_then_else(steps > 0, _chain_sum(staged, block_n, factor, i, j), 0.0))
    tile.cluster_barrier()
    # (every token again, the other half's predicated off: factor's parameters are the loop's own names, which the
    # DSL tracks). The sum as __fadd_rn: a plain + after factor's multiply is contracted into one FFMA (one rounding
    # where the reduce kernel's path rounds the scaled partial first: other bits, seen on the GPU)
    for j, i in tile.parallel(tokens, block_n):
        if j < m and j // half == ts:
            C[j, tn * block_n + i] = T.cast(T.call_extern(
                "float32", "__fadd_rn", T.if_then_else(steps > 0, _chain_sum(staged, block_n, factor, i, j), 0.0),
                recv[j % half, i]), "bfloat16")


def _chain_sum(staged, block_n, factor, i, j):
    # weight row i's sum for token j over both chains' steps (the halves' staging tile, token-major), times factor
    return _times(staged[j, i] + staged[j, block_n + i], factor, i, j)


def _times(x, factor, i, j):
    # x, times factor(i, j) if given
    return x if factor is None else x * factor(i, j)


GROUPED_MODES = ("contiguous", "masked")


@tile_program(
    "mxfp4_gemm_nt_grouped",
    targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950"),
    examples={"contiguous-4096x7168": dict(n=4096, k=7168, mode="contiguous"),
              "masked-4096x7168": dict(n=4096, k=7168, mode="masked", block_m=64)},
)
def mxfp4_grouped_program(n: int, k: int, mode: str, block_m: int = 128, block_n: int = 128, block_k: int = BLOCK_K,
                          stages: int = 3, threads: int = 256, row_warps: bool = True):
    """Expert-grouped MXFP4 GEMM in fp8_gemm_nt's two grouped layouts: contiguous (rows of A in
    128-aligned expert segments, MIdx the expert of each row, -1 for padding rows: zeros out) or
    masked (A (groups, max_m, k), only the first MaskedM[g] rows of group g: zeros past them).
    B (groups, n, k/8) int32 words, SFB (groups, n, k/128) int32 words of E8M0 bytes (4 a K step).
    A block walks the whole K range (no split-K), so it stages its scale words (k/128 x block_n)
    once; they become bf16x2 factors where the decode uses them."""
    assert mode in GROUPED_MODES, mode
    assert k % block_k == 0 and n % block_n == 0 and block_k == BLOCK_K
    words = _decode_split(threads, block_n, block_k)
    rows, groups, max_m = T.dynamic("rows, groups, max_m")
    masked = mode == "masked"
    kb, n_tiles = k // block_k, n // block_n
    a_shape = (groups, max_m, k) if masked else (rows, k)
    c_shape = (groups, max_m, n) if masked else (rows, n)

    @T.prim_func
    def mxfp4_gemm_grouped(A: T.Tensor(a_shape, "bfloat16"), B: T.Tensor((groups, n, k // 8), "int32"),
                           SFB: T.Tensor((groups, n, kb), "int32"),
                           MIdx: T.Tensor((rows,), "int32"),       # contiguous: expert of each row
                           MaskedM: T.Tensor((groups,), "int32"),  # masked: valid rows per group
                           C: T.Tensor(c_shape, "bfloat16")):
        height = max_m if masked else rows                     # rows a group's tiles walk over
        per_group = T.max(T.ceildiv(height, block_m), 1)
        m_tiles = per_group * groups if masked else per_group
        with tile.grid(m_tiles * n_tiles, threads + tile.producer_threads()) as bid:
            tm, tn = tile.split_index(bid, (m_tiles, n_tiles))
            sw = tile.stage((kb, block_n), "int32")        # E8M0 bytes of (step, row), step-major
            acc = tile.accumulator((block_m, block_n))
            if masked:
                g = tm // per_group
                row0 = (tm % per_group) * block_m                  # within the group
                limit = MaskedM[g]                                 # rows at or past this are zeros
            else:
                row0 = tm * block_m
                # a 128-aligned segment is one expert; clamped: unchecked ids never index past B
                g = T.min(T.max(MIdx[T.min(row0, rows - 1)], 0), groups - 1)
                limit = rows
            # a segment's padding rows come after its live ones: a tile whose first row is padding
            # is all padding, and only zeros are stored for it
            live = row0 < limit if masked else row0 < limit and MIdx[T.min(row0, rows - 1)] >= 0
            steps = tile.steps_if(live, kb)
            tile.import_cuda_helpers(E2M1_SOURCE)
            # (lambda parameters are named apart from every loop variable: the DSL tracks names)
            loads = lambda blk: (  # noqa: E731
                A[g, row0:row0 + block_m, blk * block_k:(blk + 1) * block_k] if masked
                else A[row0:row0 + block_m, blk * block_k:(blk + 1) * block_k],
                B[g, tn * block_n:(tn + 1) * block_n, blk * (block_k // 8):(blk + 1) * (block_k // 8)])
            where = (C, MIdx, row0, height, limit, g, tn, steps)
            tile.mma_decoded_loop(
                steps, loads, [((block_m, block_k), "bfloat16"), ((block_n, block_k // 8), "int32"),
                               ((block_n, block_k), "bfloat16")], acc,
                _decoder(sw, block_n, block_k, words, row_warps),
                stages=stages,
                swizzle_raw=row_warps,
                prologue=lambda: _stage_scales(sw, lambda si, i: SFB[g, tn * block_n + i, si]),
                epilogue=lambda: _store_grouped(acc, where, mode, block_m, block_n))

    return mxfp4_gemm_grouped


@T.macro
def _store_grouped(acc, where, mode, block_m, block_n):
    # the rows of the tile this core's vector code holds: all, or a half on Ascend (tile.split_rows)
    C, MIdx, row0, height, limit, g, tn, steps = where
    out = tile.read_accumulator(acc)
    mine, first = tile.split_rows(block_m)
    with tile.vector():
        for i, j in tile.parallel(mine, block_n):
            r = row0 + first + i
            if r < height:
                # no K step ran (a tile past MaskedM): zeros, whatever the accumulator holds
                keep = steps > 0 and r < limit and (MIdx[r] >= 0 if mode == "contiguous" else True)
                value = T.if_then_else(keep, T.cast(out[i, j], "bfloat16"), T.cast(0, "bfloat16"))
                if mode == "masked":
                    C[g, r, tn * block_n + j] = value
                else:
                    C[r, tn * block_n + j] = value


def grouped_smem_bytes(k: int, block_m: int, block_n: int = 128, block_k: int = BLOCK_K, stages: int = 3) -> int:
    """Shared memory of one grouped block: the pipeline, two decoded tiles (sm_90a decodes the next
    step while the MMA reads the last) and the K range's scale words."""
    return stages * (block_m * block_k * 2 + block_n * block_k // 2) + 2 * block_n * block_k * 2 + block_n * (k // block_k) * 4


def mxfp4_gemm_nt_reference(a, b, sfb):
    return (a.float() @ dequant_mxfp4(b, sfb).T).to(torch.bfloat16)


def _a_as_bf16(a, sfa, ndim):
    """a as the kernels take it: bf16 as given, or e4m3 with its scales dequantized to bf16 first
    (one pass over a): sfa fp32 per (row, 128 columns) (per_token_group_quant_fp8's; the product
    then rounds each dequantized value to bf16: ~2^-9 relative, well inside the FP4 operand's
    error), or uint8 E8M0 per (row, 32 columns) (OCP MX: exact in bf16)."""
    if sfa is None:
        return a
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=ndim, contiguous=True)
    check.tensor("sfa", sfa, dtypes=(torch.float32, torch.uint8), ndim=ndim, contiguous=True)
    k = a.shape[-1]
    check.same_device(a=a, sfa=sfa)
    if sfa.dtype == torch.uint8:
        check.shape("sfa", sfa, (*a.shape[:-1], k // MX), "E8M0 per (row, 32 columns) of a")
        return dequant_mx_fp8(a, sfa).to(torch.bfloat16)
    check.shape("sfa", sfa, (*a.shape[:-1], -(-k // 128)), "per (row, 128 columns) of a")
    flat = dequant_fp8_token_groups(a.reshape(-1, k), sfa.reshape(-1, sfa.shape[-1]))
    return flat.to(torch.bfloat16).view(a.shape)


def mxfp4_gemm_nt(a, b, sfb, sfa=None):
    """C (m, n) bf16 = a (m, k) @ dequant(b, sfb)^T; b (n, k/2) uint8 packed e2m1 (low nibble
    first), sfb (n, k/32) uint8 E8M0. a is bf16, or e4m3 with sfa: (m, ceil(k/128)) fp32
    per-token-group scales (per_token_group_quant_fp8's) or (m, k/32) uint8 E8M0 (OCP MX),
    dequantized to bf16 first. k % 128 == 0, n % 128 == 0, any m.
    On sm_90a, m <= WARP_TOKENS (8) takes the warp kernel (mxfp4_gemm_nt_warps: bf16 mma.sync on
    independent warps), m <= 64 with k % 512 == 0 the swapped register-decode kernel
    (mxfp4_gemm_nt_swapped), other shapes the decoded-tile kernel: all multiply the exactly
    dequantized weights in fp32 accumulators (their sums may differ in the last bits).
    On sm_100a, e4m3 a with MX scales takes the native block-scaled kernel (mxfp4_gemm_nt_native:
    compiled, never run on a device); on ascend:950 too (the Cube's block-scaled MAD, with the weights
    widened to e4m3 first), and there the other forms of a take the decoded-tile kernel (the vector cores
    decode B into UB, the Cube multiplies in bf16): generated Ascend C, never run on a device."""
    from ops.gemm_mxfp4_native import _mxfp4_native, _native_target

    if _native_target(a, sfa) is not None:
        return _mxfp4_native(a, b, sfb, sfa)
    a = _a_as_bf16(a, sfa, 2)
    _check_dense(a, torch.bfloat16, b, sfb)
    return _dispatch.call(_mxfp4_op, _mxfp4_impl, a, b, sfb)


def _check_dense(a, a_dtype, b, sfb):
    """The dense op's a (m, k) of a_dtype, b (n, k/2) and sfb (n, k/32): (m, n, k)."""
    check.tensor("a", a, dtypes=(a_dtype,), ndim=2, contiguous=True)
    check.tensor("b", b, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    m, k = a.shape
    n = b.shape[0]
    check.shape("b", b, (n, k // 2), "(n, k/2): two e2m1 values per byte")
    check.tensor("sfb", sfb, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check.shape("sfb", sfb, (n, k // MX), "(n, k/32) E8M0")
    if k % 128 or n % 128:
        raise ValueError(f"k and n must be multiples of 128, got k={k}, n={n}")
    check.same_device(a=a, b=b, sfb=sfb)
    return m, n, k


def m_grouped_mxfp4_reference(a, b, sfb, aux, mode):
    """Exact dequant, fp32 products per group, bf16 out; zeros where no group's rows are."""
    if mode == "contiguous":
        out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        for g in range(b.shape[0]):
            rows = (aux == g).nonzero().flatten()
            if rows.numel():
                out[rows] = a[rows].float() @ dequant_mxfp4(b[g], sfb[g]).T
    else:
        out = torch.zeros(*a.shape[:2], b.shape[1], dtype=torch.float32, device=a.device)
        for g in range(b.shape[0]):
            mm = int(aux[g])
            if mm:
                out[g, :mm] = a[g, :mm].float() @ dequant_mxfp4(b[g], sfb[g]).T
    return out.to(torch.bfloat16)


def _check_grouped(a, b, sfb, a_ndim, native=False):
    # native: e4m3 a for the block-scaled kernels (their scales ride in the MMA: no staged-scale limit on k)
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn if native else torch.bfloat16,), ndim=a_ndim, contiguous=True)
    check.tensor("b", b, dtypes=(torch.uint8,), ndim=3, contiguous=True)
    check.tensor("sfb", sfb, dtypes=(torch.uint8,), ndim=3, contiguous=True)
    G, n = b.shape[:2]
    k = a.shape[-1]
    check.shape("b", b, (G, n, k // 2), "(groups, n, k/2): two e2m1 values per byte")
    check.shape("sfb", sfb, (G, n, k // MX), "(groups, n, k/32) E8M0")
    if k % 128 or n % 128:
        raise ValueError(f"k and n must be multiples of 128, got k={k}, n={n}")
    if not native and grouped_smem_bytes(k, 128) > SMEM_BUDGET:
        raise ValueError(f"k={k} is too long for the grouped kernel's staged scales (at most "
                         f"{(SMEM_BUDGET - grouped_smem_bytes(0, 128)) // 128 * MX} columns)")
    return G, n, k


def m_grouped_mxfp4_gemm_nt_contiguous(a, b, sfb, m_indices, sfa=None):
    """Expert-grouped rows: a (M, k) bf16 in 128-aligned segments per expert (moe_dispatch's
    contiguous layout), m_indices (M,) int32 giving each row's expert, -1 for padding rows (their
    output is zeros); b (g, n, k/2) uint8 packed e2m1, sfb (g, n, k/32) uint8 E8M0. Returns (M, n)
    bf16 = a @ dequant(b[m_indices[r]])^T row by row. a may be e4m3 with sfa (M, ceil(k/128)) fp32
    or (M, k/32) uint8 E8M0, as in mxfp4_gemm_nt (on sm_100a and ascend:950 the latter takes the native
    block-scaled kernel, mxfp4_grouped_native_program)."""
    from ops.gemm_mxfp4_native import _grouped_native, _native_target

    native = _native_target(a, sfa) is not None
    a = a if native else _a_as_bf16(a, sfa, 2)
    G, n, k = _check_grouped(a, b, sfb, 2, native)
    check.tensor("m_indices", m_indices, dtypes=(torch.int32,), ndim=1, contiguous=True)
    check.shape("m_indices", m_indices, (a.shape[0],), "(M,) one per row of a")
    if a.shape[0] % 128:
        raise ValueError(f"a's row count must be a multiple of 128 (the segment alignment), got {a.shape[0]}")
    check.same_device(a=a, b=b, sfb=sfb, m_indices=m_indices)
    check.some_groups("b", G, a.shape[0])
    if _values.enabled(m_indices) and a.shape[0] and bool(((m_indices < -1) | (m_indices >= G)).any()):
        raise ValueError(f"m_indices must be in [-1, {G})"
                         + check.offending(m_indices, (m_indices < -1) | (m_indices >= G)))
    if native:
        return _grouped_native("contiguous", a, sfa, b, sfb, m_indices)
    return _dispatch.call(_mxfp4_grouped_op, _mxfp4_grouped_impl, "contiguous", a, b, sfb, m_indices, 128)


def m_grouped_mxfp4_gemm_nt_masked(a, b, sfb, masked_m, expected_m=None, sfa=None):
    """Decode-time grouped GEMM: a (g, max_m, k) bf16; only the first masked_m[i] rows of group i
    are computed (the rest are zeros); b (g, n, k/2) uint8, sfb (g, n, k/32) uint8. Returns
    (g, max_m, n) bf16. expected_m (default max_m) is a tiling hint: <= 64 picks 64-row tiles (on sm_90a at
    <= WARP_TOKENS and k <= MASKED_WARPS_MAX_K: the warp kernel, ops.gemm_mxfp4_warps, token tiles of 8 / 16 rows, a
    group's further tiles reading its weights again). a may be e4m3 with
    sfa (g, max_m, ceil(k/128)) fp32 or (g, max_m, k/32) uint8 E8M0, as in mxfp4_gemm_nt (on sm_100a and
    ascend:950 the latter takes the native block-scaled kernel)."""
    from ops.gemm_mxfp4_native import _grouped_native, _native_target

    native = _native_target(a, sfa) is not None
    a = a if native else _a_as_bf16(a, sfa, 3)
    G, n, k = _check_grouped(a, b, sfb, 3, native)
    if a.shape[0] != G:
        raise ValueError(f"a must have one matrix per group of b ({G}), got shape {tuple(a.shape)}")
    check.tensor("masked_m", masked_m, dtypes=(torch.int32,), ndim=1, contiguous=True)
    check.shape("masked_m", masked_m, (G,), "(groups,)")
    check.same_device(a=a, b=b, sfb=sfb, masked_m=masked_m)
    if expected_m is not None:
        check.number("expected_m", expected_m, lo=0, integer=True)
    max_m = a.shape[1]
    if _values.enabled(masked_m) and G and bool(((masked_m < 0) | (masked_m > max_m)).any()):
        raise ValueError(f"masked_m must be in [0, {max_m}]"
                         + check.offending(masked_m, (masked_m < 0) | (masked_m > max_m)))
    if native:
        return _grouped_native("masked", a, sfa, b, sfb, masked_m)
    hint = expected_m or max_m
    # block_m 8 / 16: the warp kernel's token tile (sm_90a, expected_m <= WARP_TOKENS); else the row tile
    warps = hint <= WARP_TOKENS and a.shape[-1] <= MASKED_WARPS_MAX_K
    block_m = next((t for t in (8, 16) if t >= hint), 64) if warps else 64 if hint <= 64 else 128
    return _dispatch.call(_mxfp4_grouped_op, _mxfp4_grouped_impl, "masked", a, b, sfb, masked_m, block_m)


SWAPPED_MASKED = True    # masked groups of <= 64 rows on the swapped kernel (bench provider tilecraft-masked-tile: off)
# expected_m <= WARP_TOKENS and k <= this on the warp kernel's masked form (0: never). Session 60, 8 experts x 4
# tokens against the swapped kernel, same runs: 7168x2048 16% (H200) / 8% (H100) faster, 4096x7168 1% / 9% slower
# (bench/NOTES.md "Session 60"; bench provider tilecraft-masked-warps sets it past any k)
MASKED_WARPS_MAX_K = 2048
# its C tile out through shared memory as whole rows (16-byte stores) instead of one 2-byte store a value from the
# accumulator's layout, where the staging costs no stage (plan_masked_swapped); session 46: 8x64x7168x2048 59.2 ->
# 48.9 us; at k = 7168 it would cost a stage: 74.3 -> 79.8 us, so not there. False: bench A/B
MASKED_STAGED = True


def _mxfp4_grouped_impl(mode, a, b, sfb, aux, block_m):
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        return m_grouped_mxfp4_reference(a, b, sfb, aux, mode)
    out = torch.empty(*a.shape[:-1], b.shape[1], dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0:
        return out
    check.aligned("a", a, 16, "loaded by TMA")
    target = targets.resolve(a)
    G, n, k = b.shape[0], b.shape[1], a.shape[-1]
    if mode == "masked" and block_m < 64:
        if target.name == "cuda:sm_90a" and k % BLOCK_K == 0 and n % 16 == 0:
            from ops.gemm_mxfp4_warps import launch_warps_masked

            launch_warps_masked(a, b, sfb, aux, out, tokens=block_m)
            return out
        block_m = 64
    if (mode == "masked" and SWAPPED_MASKED and a.shape[1] <= SWAPPED_TOKENS[-1] and k % SWAPPED_K_ALIGN == 0
            and target.name == "cuda:sm_90a" and k // BLOCK_K * 128 * 4 <= SMEM_BUDGET // 2):
        p = plan_masked_swapped(a.shape[1], k)
        kernel = jit.launchers(("mxfp4_gemm_nt_masked_swapped", target.name, n, k, *sorted(p.items())), lambda: (
            mxfp4_masked_swapped_program.compile(target, n=n, k=k, **p).launcher()))
        kernel(a, _code_words(b), _tma_scale_words(sfb), aux, out)
        return out
    kernel = jit.launchers(("mxfp4_gemm_nt_grouped", target.name, mode, n, k, block_m, DECODE_ROW_WARPS), lambda: (
        mxfp4_grouped_program.compile(target, n=n, k=k, mode=mode, block_m=block_m, row_warps=DECODE_ROW_WARPS)
        .launcher()))
    m_idx = aux if mode == "contiguous" else bound_only(a.device, 1)
    masked_m = aux if mode == "masked" else bound_only(a.device, G)
    kernel(a, _code_words(b), _scale_words(sfb), m_idx, masked_m, out)
    return out


@torch.library.custom_op("tilecraft::mxfp4_gemm_nt_grouped", mutates_args=())
def _mxfp4_grouped_op(mode: str, a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, aux: torch.Tensor,
                      block_m: int) -> torch.Tensor:
    return _mxfp4_grouped_impl(mode, a, b, sfb, aux, block_m)


@_mxfp4_grouped_op.register_fake
def _(mode, a, b, sfb, aux, block_m):
    return a.new_empty(*a.shape[:-1], b.shape[1], dtype=torch.bfloat16)


def _mxfp4_impl(a, b, sfb):
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        return mxfp4_gemm_nt_reference(a, b, sfb)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        sm90 = targets.resolve(a).name == "cuda:sm_90a"
        if sm90 and m <= WARP_TOKENS:
            from ops.gemm_mxfp4_warps import launch_warps

            launch_warps(a, b, sfb, out)
        elif sm90 and SWAPPED and m <= SWAPPED_TOKENS[-1] and k % SWAPPED_K_ALIGN == 0:
            _launch_swapped(a, b, sfb, out)
        else:
            _launch(a, b, sfb, out)
    return out


# m <= WARP_TOKENS on sm_90a takes the warp kernel (ops.gemm_mxfp4_warps: mma.sync on independent
# warps, every warp its own loads and decode). Measured against the swapped kernel (bench/NOTES.md "Session 58", same
# runs, CUDA graphs): 1-8 tokens 1.14-1.25x faster on two H100s (the first build 1.1-1.35x at 1 token on an H200);
# 16 tokens 0.73-1.0x; again with the activations ring (session 64, H100) 0.84x / 0.92x at 16x7168x2048 / 16x4096x7168,
# so 8 (0: off; bench providers tilecraft-swapped sets 0, tilecraft-warps 16)
WARP_TOKENS = 8
SWAPPED = True   # decode-sized m on sm_90a takes mxfp4_gemm_nt_swapped (bench provider tilecraft-tile: off)
# its scale rows by TMA ahead of the stages, or by its MMA threads while the first stages fly. None:
# by TMA where a split stages more than 8 words a row (measured 0.4-0.5 us faster at k = 7168, 14
# words; at k = 2048, 8 words, 0.2-1.8 us slower: bench/NOTES.md "MXFP4 v7"); True / False force it
SWAPPED_SCALE_TMA = None
# split-K partials added by the tile's last split block in the kernel, not by the reduce kernel. None:
# where the token tile is at most SWAPPED_FOLD_TOKENS (its fold reads splits x 8 KB: 0.2-0.3 us
# faster in CUDA graphs; at 64 tokens 0.7-1.3 us slower, bench/NOTES.md "MXFP4 v8"); True / False
# force it for every split plan
SWAPPED_FOLD = None
SWAPPED_FOLD_TOKENS = 16
# each MMA thread loads its raw words of step s + 1 into registers before it decodes step s (built
# session 21, measured in "MXFP4 v8"); True / False: on / off for every swapped plan
SWAPPED_AHEAD = False
# a 2-split plan's two blocks a cluster, folding their partials through distributed shared memory (no
# partials in global memory, no reduce kernel). None: where the token tile is at most
# SWAPPED_FOLD_TOKENS (in place of the fold: 0.5-1.0 us faster in CUDA graphs with the read flush,
# 0.1-0.3 us slower with the write flush; at 64 tokens 1.3 us slower with the write flush, bench/NOTES.md
# "MXFP4 v9"); True / False force it for every 2-split plan
SWAPPED_PAIR = None
# split plans write their fp32 partial through shared memory as whole token rows (16-byte stores)
# instead of 4-byte stores from the accumulator layout. None: where the token tile is at least
# SWAPPED_STAGE_OUT_TOKENS and K is split 4+ ways (64x4096x7168: 0.5-0.6 us faster, both flushes; at
# 2 splits 0.2-0.7 us slower, "MXFP4 v9"); True / False force it for every split plan without a pair
SWAPPED_STAGE_OUT = None
SWAPPED_STAGE_OUT_TOKENS = 64
SWAPPED_DECODE = "v7"   # one permute, one mask a pair: 0.1-0.7 us faster than "v6", same bits ("MXFP4 v8")
# weight rows a swapped block: 128 (two MMA warpgroups) or 64 (one warpgroup, twice the blocks, so half the splits).
# None: swapped_block_n's rule, 64 only where that takes the reduce kernel away and a block runs at most
# SWAPPED_BLOCK_N_STEPS 128-deep steps (session 65, H200: 64x7168x2048 12.7 -> 11.7 us, 32x7168x2048 10.6 -> 9.2;
# at 32 steps 64x7168x4096 19.2 -> 18.0 but 32x7168x4096 15.4 -> 18.6; where both widths split, 64x4096x7168 4 splits
# -> 2, a block's steps double and 64 loses, 17.1 -> 22.3). 128 / 64 force one width
SWAPPED_BLOCK_N = None
SWAPPED_BLOCK_N_STEPS = 16
# where the width rule picks 64 rows (then with no step limit): two MMA warpgroups take alternate K steps of the
# block's rows (mxfp4_swapped_program chains=2), so an SM decodes with two warpgroups as 128-row blocks do, with no
# split. Measured on an H100 against the rule without it (session 65; bench provider tilecraft-nochains): 64x7168x2048
# 12.0 -> 8.6 us, 64x7168x4096 20.1 -> 14.4, 32x7168x2048 9.6 -> 8.4, 32x7168x4096 16.1 -> 13.0; False: off
SWAPPED_CHAINS = True
# where the width rule gives the chains their 64 rows (with SWAPPED_CHAINS): "unsplit", where the 128-row plan ends
# in the reduce kernel (a split, neither folded nor paired) and the 64-row plan has one split (32-64 tokens at 7168 x
# 2048 / 4096); "split", also where the 64-row plan still splits K (its partials summed by the reduce kernel, as the
# 128-row plan's are: 32-64 tokens at 4096x7168, 2048x7168; bench provider tilecraft-chains-split); "any" (the
# default), wherever the 64-row plan takes the chains (no pair, fold or ahead): also where the 128-row plan pairs
# (16-token tiles at 7168 x 2048) or has one split (24576x1536: 1.45 waves of 128-row blocks, 2.9 of 64-row ones).
# Session 66, H100, "unsplit" -> "any" (no shape slower; bench provider tilecraft-chains-unsplit): 16x7168x2048
# 8.7 -> 7.6 us, 32x4096x7168 15.3 -> 13.9, 64x4096x7168 18.1 -> 16.3, 64x2048x7168 13.6 -> 11.7, 64x24576x1536
# 24.0 -> 20.9, 16x24576x1536 17.6 -> 16.7; 16 tokens at 4096x7168 / 2048x7168 keep 128 rows (the 64-row plan pairs
# or folds)
SWAPPED_CHAINS_WHERE = "any"
SWAPPED_CHAINS_WHERES = ("unsplit", "split", "any")
# chained plans of 2 splits (32-64 tokens at 4096x7168) fold in clusters of their two blocks (mxfp4_swapped_program
# chains=2, pair=True: the halves' sums of the other block's tokens through distributed shared memory, one cluster
# barrier) instead of writing fp32 partials for the reduce kernel; the reduce kernel's bits. Session 66's profile put
# the reduce path (partials, reduce kernel, its dependent launch) at several us of a 2-split op in a CUDA graph.
# False: the reduce kernel (bench provider tilecraft-chains-reduce); "all": also where the 64-row plan without chains
# would pair (tiles of <= SWAPPED_FOLD_TOKENS: 1-16 tokens at 4096x7168), which otherwise keeps the one-warpgroup pair
# (bench providers tilecraft-chains-pair-all, tilecraft-w4a8-chains-pair-all)
SWAPPED_CHAINS_PAIR = True
SWAPPED_CHAINS_PAIRS = (False, True, "all")


def plan_swapped(m: int, n: int, k: int, sms: int = 132, blocks_per_sm: int = 1,
                 stage_k: int | None = None, scale_tma: bool | None = None, ramp: int = 0,
                 decode: str | None = None, fold: bool | None = None, ahead: bool | None = None,
                 pair: bool | None = None, stage_out: bool | None = None, a_bytes: int = 2,
                 block_n: int = 128, chains: int = 1, chains_pair: bool | str | None = None) -> dict:
    """The swapped kernel's token tile (m rounded up to one of SWAPPED_TOKENS), blocks an SM (1;
    2 runs one fragment in 104 registers, for up to 32 tokens), the K depth of a pipeline stage
    (the first of SWAPPED_STAGE_K that divides k and fits), split-K (split while the blocks fit on
    the SMs at once and keep 4 128-deep steps) and as many stages as fit in the block's share of
    shared memory, up to 8. Deeper stages and two blocks an SM were measured slower or no faster
    (bench/NOTES.md "MXFP4 v6"). scale_tma: the scale rows by TMA (None: SWAPPED_SCALE_TMA's rule);
    ramp: the producer's first stages asked for alone (an experiment, 0: off; measured 0.0-0.4 us
    slower, "MXFP4 v8"); decode: one of SWAPPED_DECODES (None: SWAPPED_DECODE); fold: split-K
    partials added in the kernel (None: SWAPPED_FOLD's rule; never without a split); ahead: raw words
    loaded a step ahead of their decode (None: SWAPPED_AHEAD); pair: a 2-split plan folds in clusters
    of its two blocks (None: SWAPPED_PAIR's rule, tiles of <= SWAPPED_FOLD_TOKENS; only where
    splits == 2, and then no fold; the received half partial, 128 x tokens / 2 fp32, takes its room
    from the stages); stage_out: a split plan's partial goes out through shared memory (None:
    SWAPPED_STAGE_OUT's rule, tiles of >= SWAPPED_STAGE_OUT_TOKENS with 4+ splits; tokens x 132 fp32
    taken from the stages: TileLang does not overlap it with the pipeline's tiles); a_bytes: bytes an activation
    (2: bf16, 1: e4m3 for ops.gemm_w4a8); block_n: weight rows a block, 128 (two MMA warpgroups) or 64 (one: twice
    the blocks, so fewer splits). The returned plan names block_n only when it is 64, so 128-row plans compile as
    before; ops.gemm_w4a8 always plans 128. chains=2 (block_n 64): two MMA warpgroups on alternate K steps, where the
    plan has no ahead or fold, nor a pair from the pair rule unless chains_pair is "all" (else the plan is the 64-row
    one without chains); the halves' (tokens, 132) fp32 staging tile takes its room from the stages;
    the plan names chains only when it is 2. chains_pair (one of SWAPPED_CHAINS_PAIRS; None: SWAPPED_CHAINS_PAIR): a
    chained plan of 2 splits folds in clusters of its two blocks (pair=True; the received half, tokens / 2 x 68 fp32,
    takes its room from the stages); "all": the chains also where the pair rule pairs the plan (else it drops them)."""
    from ops.gemm_fp8 import split_k_count

    if k % SWAPPED_K_ALIGN:
        raise ValueError(f"the swapped kernel needs k % {SWAPPED_K_ALIGN} == 0 (TMA'd scale rows), got k={k}")
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    if chains not in (1, 2) or (chains == 2 and block_n != 64):
        raise ValueError(f"chains must be 1, or 2 with block_n=64, got chains={chains!r}, block_n={block_n}")
    decode = decode or SWAPPED_DECODE
    if decode not in SWAPPED_DECODES:
        raise ValueError(f"decode must be one of {SWAPPED_DECODES} (or None: SWAPPED_DECODE), got {decode!r}")
    tokens = next(t for t in SWAPPED_TOKENS if t >= m)
    budget = SMEM_BUDGET if blocks_per_sm == 1 else SMEM_BUDGET // 2 - 1024
    for depth in [stage_k] if stage_k else SWAPPED_STAGE_K:
        if k % depth:
            continue
        parts = depth // BLOCK_K
        sk = k // depth
        stage = tokens * depth * a_bytes + block_n * depth // 2
        if 2 * stage + block_n * 4 * 4 > budget:
            continue            # not even two stages (and the least scale rows) fit: a shallower stage

        def scale_bytes(splits):    # the split's scale words, staged
            return block_n * swapped_scale_box(-(-sk // splits) * parts, k // BLOCK_K) * 4

        splits = split_k_count(n // block_n, sk, sms * blocks_per_sm, min_steps=max(1, 4 // parts))
        while (budget - scale_bytes(splits)) // stage < 2:
            splits += 1         # a block stages its K range's scale words: split a long K until they fit
        stages = min(8, (budget - scale_bytes(splits)) // stage)
        stage_k = depth
        break
    else:
        raise ValueError(f"no swapped MXFP4 plan fits for m={m}, n={n}, k={k}, stage_k={stage_k}")
    if scale_tma is None:
        scale_tma = -(-sk // splits) * parts > 8 if SWAPPED_SCALE_TMA is None else SWAPPED_SCALE_TMA
    if pair is None:
        pair = tokens <= SWAPPED_FOLD_TOKENS if SWAPPED_PAIR is None else SWAPPED_PAIR
    pair = pair and splits == 2
    if pair:
        stages = min(stages, (budget - scale_bytes(splits) - block_n * pair_recv_words(tokens) * 4) // stage)
    if fold is None:
        fold = tokens <= SWAPPED_FOLD_TOKENS if SWAPPED_FOLD is None else SWAPPED_FOLD
    fold = fold and splits > 1 and not pair
    ahead = SWAPPED_AHEAD if ahead is None else ahead
    chains_pair = SWAPPED_CHAINS_PAIR if chains_pair is None else chains_pair
    if chains_pair not in SWAPPED_CHAINS_PAIRS:
        raise ValueError(f"chains_pair must be one of {SWAPPED_CHAINS_PAIRS} (or None: SWAPPED_CHAINS_PAIR), got "
                         f"{chains_pair!r}")
    chains = chains if not ahead and not fold and (not pair or chains_pair == "all") else 1
    if chains > 1:      # the halves' staging tile (token-major; split plans' partials leave from it too)
        pair = splits == 2 and bool(chains_pair)
        stages = min(stages, (budget - scale_bytes(splits) - tokens * (2 * block_n + 4) * 4
                              - pair_recv_bytes(tokens, block_n, chains if pair else 0)) // stage)
    if stage_out is None:
        stage_out = (tokens >= SWAPPED_STAGE_OUT_TOKENS and splits >= 4 if SWAPPED_STAGE_OUT is None
                     else SWAPPED_STAGE_OUT)
    stage_out = stage_out and splits > 1 and not pair and chains == 1
    if stage_out:
        stages = min(stages, (budget - scale_bytes(splits) - tokens * 132 * 4) // stage)
    return dict(tokens=tokens, splits=splits, stages=stages, blocks_per_sm=blocks_per_sm, stage_k=stage_k,
                scale_tma=scale_tma, ramp=ramp, decode=decode, fold=fold,
                ahead=ahead, pair=pair, stage_out=stage_out,
                **({} if block_n == 128 else {"block_n": block_n}), **({"chains": chains} if chains > 1 else {}))


def swapped_block_n(m: int, n: int, k: int, sms: int = 132, chains: bool = False, where: str | None = None,
                    **override) -> int:
    """SWAPPED_BLOCK_N's rule (None): 64 weight rows a block where the 128-row plan ends in the reduce kernel (split
    K, neither folded nor paired), the 64-row plan needs no split at all and its blocks run at most
    SWAPPED_BLOCK_N_STEPS steps (one warpgroup decodes a block's weights: twice the steps of a 128-row split's);
    128 everywhere else. chains: for the two-chain kernel (SWAPPED_CHAINS), whose chains run half the steps: no
    step limit, and `where` (one of SWAPPED_CHAINS_WHERES; None: SWAPPED_CHAINS_WHERE) widens where 64 rows go:
    "split" also where the 64-row plan splits, "any" (the default) wherever the 64-row plan takes the chains.
    override: the plan's other knobs, as the launcher plans with them. A 64-row answer never folds (no split, or the
    chains' pair fold or reduce kernel), so it never needs the split-K arrival counters (which are counted in 128-row
    tiles)."""
    where = SWAPPED_CHAINS_WHERE if where is None else where
    if where not in SWAPPED_CHAINS_WHERES:
        raise ValueError(f"where must be one of {SWAPPED_CHAINS_WHERES} (or None: SWAPPED_CHAINS_WHERE), got {where!r}")
    if SWAPPED_BLOCK_N is not None:
        return SWAPPED_BLOCK_N
    if chains and where == "any":
        return 64 if plan_swapped(m, n, k, sms=sms, block_n=64, chains=2, **override).get("chains") else 128
    wide = plan_swapped(m, n, k, sms=sms, **override)
    if wide["splits"] == 1 or wide["fold"] or wide["pair"] or (not chains and k // BLOCK_K > SWAPPED_BLOCK_N_STEPS):
        return 128
    narrow = plan_swapped(m, n, k, sms=sms, block_n=64, chains=2 if chains else 1, **override)
    if chains and where == "split" and narrow.get("chains"):
        return 64           # the chains, whatever the split
    return 64 if narrow["splits"] == 1 else 128


def _launch_swapped(a, b, sfb, out, **override):
    """mxfp4_gemm_nt_swapped (decode-sized m on sm_90a), planned by plan_swapped (+ override); its
    Trace is bound, never touched (trace=False)."""
    trace = bound_only(a.device, SWAPPED_TRACE_WORDS).view(1, SWAPPED_TRACE_WORDS)
    override = {"scale_tma": SWAPPED_SCALE_TMA, "decode": SWAPPED_DECODE, "fold": SWAPPED_FOLD,
                "ahead": SWAPPED_AHEAD, "pair": SWAPPED_PAIR, "stage_out": SWAPPED_STAGE_OUT,
                "block_n": SWAPPED_BLOCK_N, "chains": SWAPPED_CHAINS, "chains_where": SWAPPED_CHAINS_WHERE,
                "block_n_steps": SWAPPED_BLOCK_N_STEPS, "chains_pair": SWAPPED_CHAINS_PAIR,
                **override}     # every switch the plan reads: the launchers' key
    _launch_planned("mxfp4_gemm_nt_swapped", _swapped_launchers, a, b, sfb, out, override, tail=(trace,),
                    scale_words=_tma_scale_words, counts=True)


def _swapped_launchers(a, target, m, n, k, override):
    from backends.cuda.device import sm_count
    from ops.gemm_fp8 import split_k_launchers

    rule = ("block_n", "chains", "chains_where", "block_n_steps")     # the width rule's (steps: read as the global)
    knobs = {key: v for key, v in override.items() if key not in rule}
    chains = bool(override.get("chains"))
    block_n = override.get("block_n") or swapped_block_n(m, n, k, sms=sm_count(a), chains=chains,
                                                         where=override.get("chains_where"), **knobs)
    p = plan_swapped(m, n, k, sms=sm_count(a), block_n=block_n, chains=2 if chains and block_n == 64 else 1, **knobs)
    kernel = mxfp4_swapped_program.compile(target, n=n, k=k, **p)
    if p["pair"]:       # no partials in global memory: launched as one split (Part bound, never touched)
        return (1, *split_k_launchers(kernel, target, n, 1, "bfloat16"))
    return (p["splits"], *split_k_launchers(kernel, target, n, p["splits"], "bfloat16", fold=p["fold"]))


SMEM_BUDGET = 227 * 1024 - 4096    # dynamic shared memory a block may use on sm_90a, less static and slack


def smem_bytes(block_m: int, per: int, block_n: int = 128, block_k: int = BLOCK_K, stages: int = 3) -> int:
    """Shared memory of one block: the pipeline (A bf16 + packed B per stage), two decoded B tiles
    (sm_90a's mma_decoded_loop double-buffers them) and the E8M0 scale words of its `per` K steps."""
    return stages * (block_m * block_k * 2 + block_n * block_k // 2) + 2 * block_n * block_k * 2 + block_n * per * 4


def plan(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Tile and split-K choice (a pure function of the shapes). Split-K when the (m, n) tiles
    cover under half the GPU and every split keeps at least 6 K steps: a step here (decode a
    128 x 128 tile, then its MMA) costs ~1.5 us on the H200, several times an FP8 step, so filling
    the SMs pays for the partials' round trip sooner than in ops.gemm_fp8.plan (12 steps); and
    split further where a block's staged scales would not fit in shared memory."""
    from ops.gemm_fp8 import split_k_count

    block_m = 64 if m <= 64 else 128
    kb = k // 128
    splits = split_k_count(-(-m // block_m) * (n // 128), kb, sms, min_steps=6)
    # a block stages the scales of its whole K range: a long range would not fit next to the
    # pipeline (a launch error), so K is split until it does (prefill-sized k)
    while smem_bytes(block_m, -(-kb // splits)) > SMEM_BUDGET:
        splits += 1
    return dict(block_m=block_m, splits=splits)


def _code_words(b):
    """The packed codes as the kernels read them: (..., k/8) int32 words, 8 codes each, loaded by TMA."""
    if b.data_ptr() % 16:
        raise ValueError("b must start 16-byte aligned (its rows are loaded by TMA as 32-bit words)")
    return b.view(torch.int32)


def _scale_words(sfb):
    """The E8M0 scales as the kernels read them: (..., k/128) int32 words, the 4 bytes of a K step."""
    if sfb.data_ptr() % 4:
        raise ValueError("sfb must start 4-byte aligned (its rows are read as 32-bit words)")
    return sfb.view(torch.int32)


def _tma_scale_words(sfb):
    """_scale_words for the swapped kernels, which load them by TMA: a view that does not start
    16-byte aligned is copied (the copy is)."""
    return check.aligned_copy(_scale_words(sfb))


def _launch(a, b, sfb, out, **override):
    """mxfp4_gemm_program, planned by plan (+ override; the decode's thread layout per DECODE_ROW_WARPS)."""
    _launch_planned("mxfp4_gemm_nt", _launchers, a, b, sfb, out, {"row_warps": DECODE_ROW_WARPS, **override})


def _launch_planned(name, launchers, a, b, sfb, out, override, tail=(), scale_words=_scale_words, counts=False):
    """b (n, k/2) uint8 goes to the kernel as (n, k/8) int32 words (8 codes each); the plan and both
    launchers are kept per call shape (an eager decode call is otherwise host-bound). tail: the
    kernel's last arguments; counts: and then its split-K arrival counters (one a tile of the override's block_n,
    else 128 columns: zeros where the kernel folds its own partials, no reduce launcher; otherwise bound only)."""
    from ops.gemm_fp8 import launch_split_k

    m, k = a.shape
    n = b.shape[0]
    check.aligned("a", a, 16, "loaded by TMA")
    target = targets.resolve(a)
    key = (name, target.name, a.device.index, m, n, k, tuple(sorted(override.items())))
    splits, kernel, reduce = jit.launchers(key, lambda: launchers(a, target, m, n, k, override))
    fold = counts and splits > 1 and reduce is None
    if counts:
        tiles = n // (override.get("block_n") or 128)   # None (the rule): 64 only where nothing folds, so 128 here
        tail = (*tail, arrival_counters(a.device, tiles) if fold else bound_only(a.device))
    launch_split_k(kernel, reduce, (a, _code_words(b), scale_words(sfb)), out, splits, count=tail or None,
                   part=ready_partials(a.device, splits, m, n) if fold else None)


def _launchers(a, target, m, n, k, override):
    from backends.cuda.device import sm_count
    from ops.gemm_fp8 import split_k_launchers

    p = {**plan(m, n, k, sms=sm_count(a)), **override}
    kernel = mxfp4_gemm_program.compile(target, n=n, k=k, **p)
    return (p["splits"], *split_k_launchers(kernel, target, n, p["splits"], "bfloat16"))


@torch.library.custom_op("tilecraft::mxfp4_gemm_nt", mutates_args=())
def _mxfp4_op(a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    return _mxfp4_impl(a, b, sfb)


@_mxfp4_op.register_fake
def _(a, b, sfb):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)
