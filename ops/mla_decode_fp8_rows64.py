"""sm_90a MLA decode for the FP8 cache at 64 query rows a CTA: the e4m3 latent converted in registers into WGMMA's
A operand (wgmma RS, as ops/mla_decode_fp8_rs.py at <= 16 rows), with the 64 rows as WGMMA's N and the two MMA
warpgroups in a seesaw (bench/NOTES.md "Open GPU checks (end of session 45)" item 5, "Session 51").

Operands swapped (tokens are M), one 64-token step:

    S^T (64 tokens x 64 rows)   = rope K Q_r^T + sum_g scale_g[token] * (K_g Q_g^T)      g: 128-column groups
    O_g^T (128 latent x 64)     = alpha * O_g^T + V_g^T (P * scale_g[token])^T            one P copy per group

WG w holds O^T of groups 2w and 2w + 1 (256 latent x 64 rows fp32, 128 registers a thread) for every step, and
scores the steps k with k % 2 == w (S^T: 32 registers, one group's partial: 32, K's fragment in two 64-column
halves: 2 x 16). The running column maxima pass between the warpgroups through shared memory, so each step's
softmax waits for the previous step's and nothing else: WG w's scores of step k are issued before it waits for
step k - 1's P, and its P V of step k - 1 (the other's P, read from shared memory) runs before its own softmax.
Per warpgroup and step pair: 36 + 32 m64n64k16 WGMMAs; both warpgroups ~2450 tensor cycles a step against ~2575
cycles of the step's 41,984 bytes at the copy rate (128 x 64 x 4096 on an H200), so the step is balanced between
the two if the conversions (K once, V once a step: 32K value pairs, ~520 ALU cycles) stay under them.

Synchronization (named barriers, 256 threads unless noted):
- P_READY[w]: WG w has written step k's P copies (p_s[w]), its running maxima (m_s[w]) and factors (al_s[w]);
  arrived by WG w, waited by the other before its P V of step k (and its softmax of step k + 1).
- P_FREE[w]: the other warpgroup's P V of step k is done with p_s[w]; WG w waits before writing step k + 2's.
- each warpgroup's 128 threads: its 4 warps' step maxima (a parity-buffered exchange), a short step's zeroing.
- full[s] (the producer's bulk copies) and empty[s] (256 arrivals: each warpgroup after its last read of the stage).

The row sums: each thread keeps two (columns 8q + 2c + {0, 1}: the step's sums over its two token rows
reduce-scattered over the 8 lanes of its column place), rescaled by every step's factor; the 8 partials of a
column (4 warps x 2 warpgroups) are added in a fixed order at the end (deterministic, batch-invariant).

Where s_q * h_q <= 32 the tile is 32 rows (rows_tile=32: WGMMA's N 32, O^T 64 registers a thread, ~200 in all
with the MMAs' operands live while they run), and the ring takes three stages (four with v_scaled) instead of two.

Status (session 52, H200; bench/NOTES.md "Session 52"): GPU tests pass. The op takes it for s_q * h_q in 17-32
(ops.mla_decode.ROWS64_FP8 = 32): 0.144 ms at 64 x 32 x 8192, 1.12x the swapped kernel it replaces and 1.09x the
bf16 cache. At 64 rows a tile it is slower than the op's 32-token-step kernel (0.24 against 0.22 ms at 128 x 64 x
4096 with v_scaled), so larger row counts stay there. The first build ran 2-3x slower: ptxas serialized every WGMMA
(C7513) because the group loop was entered with the rope's MMAs in flight; `_scores` peels group 0 and a CPU test
checks ptxas's log. Tiling dict(kv_format="fp8", rows64=True) through ops.mla_decode._mla_decode_impl and bench
providers tilecraft-fp8-rows64(-vs, -vks) run it at any row count. Options: v_scaled (three stages), k_scaled (the
scales in K's fragments, one drain for the scores; built after session 52's GPU time, not run), rows_tile,
k_fragments, debug (the first step's S^T and P dumped), trace (bench.trace_mla_rows64).

Pages of 64 tokens or more (a step inside one page); the query must be bfloat16 (the cache's rope is bf16); the
latent query is rounded to fp16, so |q| and the cache scales must stay below 65504 (as the <= 16-row kernel's).
Outputs as mla_decode_program's: Out/Lse unsplit, OPart/LsePart per (sequence, split), 64 rows a row tile.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from codegen.program import tile_program
from ops.mla_decode_fp8_rs import (D_QK, D_ROPE, D_V, GROUP, GROUPS, HELPER_SOURCE, LN2, STEP, TOKEN_BYTES,
                                   _rs2_issue, _rs2_page, _split_range)

ROWS = 64                        # query rows a CTA (a row tile): WGMMA's N; 32 where s_q * h_q <= 32
BLOCK_M = 64                     # the op's row padding (OPart, LsePart; mla_decode_program's tiles)
SMEM_BYTES = 232448              # an H200 CTA's shared memory (227 KB)
MMA_REGS, PRODUCER_REGS = 240, 24   # 128 x (2 x 240 + 24) = 64,512 of 65,536 registers
# named barriers: P_READY 1 + w, P_FREE 3 + w, the step maxima 5 + w, a short step's zeroing 7 + w, both MMA
# warpgroups 9 (TileLang's own sync pass is off for this program; bar 0 is __syncthreads)
BAR_P_READY, BAR_P_FREE, BAR_MAX, BAR_TAIL, BAR_BOTH = 1, 3, 5, 7, 9

HELPER64_SOURCE = r"""
// ---- 64 query rows (ops/mla_decode_fp8_rows64.py) ----
// S^T (64 tokens x 64 rows) in WGMMA's accumulator layout: s[nb * 4 + rv * 2 + e] is token row r + 8 rv
// (r = 16 warp + lane / 4) and query row (column) 8 nb + 2c + e (c = lane % 4): column slot hs = 2 nb + e.
// O^T (128 latent x 64 rows, two m64 tiles): o[mt * 32 + nb * 4 + hi * 2 + e], column slot 2 nb + e.

// K's fragment of half H (64 columns) of a group, rows r and r + 8, quad place c: one 16-byte load a row
// (tc_e4m3_k_fragment's words 4H .. 4H + 3; its B operand is Q^T's permuted columns 64H .. 64H + 63)
template <int H>
__device__ __forceinline__ void tc64_k_half(void* dst, const void* base, int r, int c) {
  const uint4 a = *reinterpret_cast<const uint4*>(tc_lat<1>(base, r, 32 * c + 16 * H));
  const uint4 b = *reinterpret_cast<const uint4*>(tc_lat<1>(base, r + 8, 32 * c + 16 * H));
  const unsigned w[4] = {a.x, a.y, a.z, a.w};
  const unsigned v[4] = {b.x, b.y, b.z, b.w};
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    d[4 * j + 0] = tc_e4m3x2_f16x2(w[j]);
    d[4 * j + 1] = tc_e4m3x2_f16x2(v[j]);
    d[4 * j + 2] = tc_e4m3x2_f16x2_hi(w[j]);
    d[4 * j + 3] = tc_e4m3x2_f16x2_hi(v[j]);
  }
}
// The query's N rows of a row tile (rows_here of them real, the rest zeros) in 16-byte chunks, every load issued
// before any conversion (one round trip; a loop of loads each stored before the next is one round trip a load):
// chunk i < LI of this thread is latent chunk idx = 384 i + t of 64 N (row idx / 64, columns 8 (idx % 64) ..),
// converted to fp16 into ql[8i ..]; chunk i < RI of the rope is idx = 384 i + t of 8 N (row idx / 8, rope columns
// 8 (idx % 8) ..) into qr[8i ..] as it is. Q: the tile's row 0, column 0 (576 bf16 a row).
template <int N>
__device__ __forceinline__ void tc64_query_chunks(void* ql, void* qr, const void* Q, int rows_here) {
  constexpr int LI = (64 * N + 383) / 384, RI = (8 * N + 383) / 384;
  const int t = threadIdx.x;
  const unsigned short* at = reinterpret_cast<const unsigned short*>(Q);
  uint4 raw[LI + RI];
#pragma unroll
  for (int i = 0; i < LI + RI; ++i) {
    const int idx = i < LI ? 384 * i + t : 384 * (i - LI) + t;
    const bool in = i < LI ? idx < 64 * N : idx < 8 * N;
    const int h = i < LI ? idx >> 6 : idx >> 3;
    const int col = i < LI ? 8 * (idx & 63) : 512 + 8 * (idx & 7);
    raw[i] = in && h < rows_here ? *reinterpret_cast<const uint4*>(at + h * 576 + col) : make_uint4(0u, 0u, 0u, 0u);
  }
  unsigned* dl = reinterpret_cast<unsigned*>(ql);
#pragma unroll
  for (int i = 0; i < LI; ++i) {
    const unsigned w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      unsigned r;        // bf16 pair -> two floats (exact) -> an fp16 pair, the first value in the low half
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(__uint_as_float(w[p] & 0xFFFF0000u)), "f"(__uint_as_float(w[p] << 16)));
      dl[4 * i + p] = r;
    }
  }
#pragma unroll
  for (int i = 0; i < RI; ++i) reinterpret_cast<uint4*>(qr)[i] = raw[LI + i];
}
// the scales of group g of this thread's token rows r, r + 8 (stage bytes 512.. of each 656-byte token)
__device__ __forceinline__ float2 tc64_scales(const void* stage, int g) {
  const int r = ((threadIdx.x >> 5) & 3) * 16 + (threadIdx.x & 31) / 4;
  const float* at = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(stage) + 512) + g;
  return make_float2(at[r * 164], at[(r + 8) * 164]);
}
// S^T += scale_g[token] * (K_g Q_g^T)
template <int N>
__device__ __forceinline__ void tc64_fold(float* s, const float* acc, const void* stage, int g) {
  const float2 sc = tc64_scales(stage, g);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s[i] = fmaf(acc[i], (i >> 1) & 1 ? sc.y : sc.x, s[i]);
}
// k_scaled: this thread's tokens' largest group scale (r, r + 8), the factor taken out of K's fragments
__device__ __forceinline__ float2 tc64_max_scale(const void* stage) {
  float2 m = tc64_scales(stage, 0);
#pragma unroll
  for (int g = 1; g < 4; ++g) {
    const float2 v = tc64_scales(stage, g);
    m.x = fmaxf(m.x, v.x), m.y = fmaxf(m.y, v.y);
  }
  return m;
}
// k_scaled: tc64_k_half with each token's values times scale_g / (its largest group scale), in fp16 (at most 448
// in magnitude: no overflow; a group whose scale is below 2^-14 of the largest loses precision only far below the
// token's largest values); a token whose scales are all zero (a zeroed tail) gets zeros
template <int H>
__device__ __forceinline__ void tc64_k_half_scaled(void* dst, const void* base, const void* stage, int g, int r,
                                                   int c) {
  tc64_k_half<H>(dst, base, r, c);
  const float2 sc = tc64_scales(stage, g), mx = tc64_max_scale(stage);
  const float q0 = mx.x > 0.f ? sc.x / mx.x : 0.f, q8 = mx.y > 0.f ? sc.y / mx.y : 0.f;
  unsigned f0, f8;
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(f0) : "f"(q0));
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(f8) : "f"(q8));
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int i = 0; i < 16; ++i) asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(d[i]) : "r"(i & 1 ? f8 : f0));
}
// k_scaled: S^T += (largest group scale)[token] * acc (the four groups' sum, each already in its ratio)
template <int N>
__device__ __forceinline__ void tc64_fold_max(float* s, const float* acc, const void* stage) {
  const float2 sc = tc64_max_scale(stage);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s[i] = fmaf(acc[i], (i >> 1) & 1 ? sc.y : sc.x, s[i]);
}
// scores of tokens at or past a column's limit become -inf: limit = min(base + row / h_q (causal), end), row =
// row0 + the column (row0: the row tile's first row)
template <int N>
__device__ __forceinline__ void tc64_mask(float* s, int tok0, int base, int end, int h_q, int causal, int row0) {
  const int lane = threadIdx.x & 31, r = ((threadIdx.x >> 5) & 3) * 16 + lane / 4, c = lane & 3;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int row = row0 + (i >> 2) * 8 + 2 * c + (i & 1);
    const int lim = causal ? min(base + row / h_q, end) : end;
    if (tok0 + r + 8 * ((i >> 1) & 1) >= lim) s[i] = -INFINITY;
  }
}
// the step's column maxima over its 64 tokens, in two parts so that nothing is held in registers between them:
// tc64_max_put, a max over the thread's two token rows and a shuffle over its 8 quads, written by lanes 0-3 of each
// warp into red (parity buffered: 2 x 4 warps x 4 places x N / 4 slots), then the warpgroup's named barrier;
// tc64_max_get, the 4 warps' maxima read back (the same in every thread of a column)
template <int N>
__device__ __forceinline__ void tc64_max_put(const float* s, float* red, int parity, int bar) {
  constexpr int SL = N / 4;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float mx[SL];
#pragma unroll
  for (int hs = 0; hs < SL; ++hs) mx[hs] = fmaxf(s[(hs >> 1) * 4 + (hs & 1)], s[(hs >> 1) * 4 + 2 + (hs & 1)]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
    for (int hs = 0; hs < SL; ++hs) mx[hs] = fmaxf(mx[hs], __shfl_xor_sync(0xFFFFFFFFu, mx[hs], off));
  }
  float* buf = red + parity * 16 * SL;
  if (lane < 4) {
#pragma unroll
    for (int i = 0; i < SL / 4; ++i)
      *reinterpret_cast<float4*>(buf + warp * 4 * SL + lane * SL + 4 * i) = make_float4(mx[4 * i], mx[4 * i + 1], mx[4 * i + 2], mx[4 * i + 3]);
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
}
template <int N>
__device__ __forceinline__ void tc64_max_get(float* mx, const float* red, int parity) {
  constexpr int SL = N / 4;
  const float* buf = red + parity * 16 * SL + (threadIdx.x & 3) * SL;
#pragma unroll
  for (int i = 0; i < SL / 4; ++i) {
    float4 m = *reinterpret_cast<const float4*>(buf + 4 * i);
#pragma unroll
    for (int w = 1; w < 4; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(buf + w * 4 * SL + 4 * i);
      m.x = fmaxf(m.x, v.x), m.y = fmaxf(m.y, v.y), m.z = fmaxf(m.z, v.z), m.w = fmaxf(m.w, v.w);
    }
    mx[4 * i] = m.x, mx[4 * i + 1] = m.y, mx[4 * i + 2] = m.z, mx[4 * i + 3] = m.w;
  }
}
// the softmax of a step on its maxima mx: the running maxima m_prev (N columns, log2 domain, written by the
// previous step's warpgroup) become m_next, alpha[hs] = exp2(m_old - m_new) (1 where the column has seen only
// -inf), written to al_out for the other warpgroup (by warp 0's lanes 0-3: one column each a slot); s becomes
// P = exp2(s * scale_log2 - m_new) (0 in a column that has seen only -inf)
template <int N>
__device__ __forceinline__ void tc64_softmax(float* s, const float* mx, const float* m_prev, float* m_next,
                                             float* al_out, float* alpha, float scale_log2) {
  const int lane = threadIdx.x & 31, c = lane & 3;
  const bool writer = ((threadIdx.x >> 5) & 3) == 0 && lane < 4;
#pragma unroll
  for (int hs = 0; hs < N / 4; ++hs) {
    const int col = (hs >> 1) * 8 + 2 * c + (hs & 1);
    const float mo = m_prev[col], mn = fmaxf(mo, mx[hs] * scale_log2);
    alpha[hs] = mn == -INFINITY ? 1.0f : tc_ex2(mo - mn);
    const float use = mn == -INFINITY ? 0.0f : mn;
    const int i0 = (hs >> 1) * 4 + (hs & 1);
    s[i0] = tc_ex2(fmaf(s[i0], scale_log2, -use));
    s[i0 + 2] = tc_ex2(fmaf(s[i0 + 2], scale_log2, -use));
    if (writer) m_next[col] = mn, al_out[col] = alpha[hs];
  }
}
// alpha[hs] of this thread's column slots from a factor row (N columns) in shared memory
template <int N>
__device__ __forceinline__ void tc64_alpha_of(const float* al, float* alpha) {
  const int c = threadIdx.x & 3;
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb) {
    const float2 v = *reinterpret_cast<const float2*>(al + nb * 8 + 2 * c);
    alpha[2 * nb] = v.x, alpha[2 * nb + 1] = v.y;
  }
}
// The row sums are kept as N / 32 values a thread: those of its column slots q (N / 32) + i (q = lane / 4), the
// slots that a halving over q's bits 2, 1, 0 keeps (an upper half where the bit is set). tc64_pick: v[N / 4] ->
// those slots by selects (no local memory); the column of slot hs is 8 (hs / 2) + 2c + hs % 2.
template <int N>
__device__ __forceinline__ void tc64_pick(const float* v, float* out) {
  constexpr int SL = N / 4;
  const int q = (threadIdx.x & 31) >> 2;
  float a[SL];
#pragma unroll
  for (int i = 0; i < SL; ++i) a[i] = v[i];
#pragma unroll
  for (int i = 0; i < SL / 2; ++i) a[i] = (q & 4) ? a[SL / 2 + i] : a[i];
#pragma unroll
  for (int i = 0; i < SL / 4; ++i) a[i] = (q & 2) ? a[SL / 4 + i] : a[i];
#pragma unroll
  for (int i = 0; i < SL / 8; ++i) out[i] = (q & 1) ? a[SL / 8 + i] : a[i];
}
// l = l * alpha + (P's column sums over the warp's 16 token rows) for the kept slots: the sums of the thread's two
// token rows reduce-scattered over the 8 lanes of its column place (the same halving, each half's other side sent
// to the lane across: 7 N / 32 shuffles)
template <int N>
__device__ __forceinline__ void tc64_sums(const float* s, const float* alpha, float* l) {
  constexpr int SL = N / 4;
  const int lane = threadIdx.x & 31;
  float v[SL], al[SL / 8];
#pragma unroll
  for (int hs = 0; hs < SL; ++hs) v[hs] = s[(hs >> 1) * 4 + (hs & 1)] + s[(hs >> 1) * 4 + 2 + (hs & 1)];
#pragma unroll
  for (int i = 0; i < SL / 2; ++i) {
    const bool up = lane & 16;
    const float send = up ? v[i] : v[SL / 2 + i];
    v[i] = (up ? v[SL / 2 + i] : v[i]) + __shfl_xor_sync(0xFFFFFFFFu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < SL / 4; ++i) {
    const bool up = lane & 8;
    const float send = up ? v[i] : v[SL / 4 + i];
    v[i] = (up ? v[SL / 4 + i] : v[i]) + __shfl_xor_sync(0xFFFFFFFFu, send, 8);
  }
  tc64_pick<N>(alpha, al);
#pragma unroll
  for (int i = 0; i < SL / 8; ++i) {
    const bool up = lane & 4;
    const float send = up ? v[i] : v[SL / 8 + i];
    l[i] = fmaf(l[i], al[i], (up ? v[SL / 8 + i] : v[i]) + __shfl_xor_sync(0xFFFFFFFFu, send, 4));
  }
}
// l *= alpha for the kept slots (a step the other warpgroup scored)
template <int N>
__device__ __forceinline__ void tc64_rescale_l(float* l, const float* alpha) {
  float al[N / 32];
  tc64_pick<N>(alpha, al);
#pragma unroll
  for (int i = 0; i < N / 32; ++i) l[i] *= al[i];
}
// (P * scale_g[token])^T into group g's N x 64 fp16 tile of the buffer p (row h, 128-byte rows, TMA's 128-byte
// swizzle): a warp's 16 tokens x N rows are N / 16 stmatrix.x4.trans of four 8 x 8 matrices (token half rv, row
// block nb); lane l gives the address of row l % 8 of matrix l / 8
// (SCALED = 0, v_scaled: P itself, the one tile g = 0)
template <int N, int SCALED>
__device__ __forceinline__ void tc64_p_store(void* p, const float* s, const void* stage, int g) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, mi = lane >> 3;
  const float2 sc = SCALED ? tc64_scales(stage, g) : make_float2(1.f, 1.f);
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(p)) + g * N * 128;
#pragma unroll
  for (int nbp = 0; nbp < N / 16; ++nbp) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rv = i & 1, nb = 2 * nbp + (i >> 1);
      const float f = rv ? sc.y : sc.x;
      if (SCALED)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r[i]) : "f"(s[nb * 4 + rv * 2 + 1] * f), "f"(s[nb * 4 + rv * 2] * f));
      else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r[i]) : "f"(s[nb * 4 + rv * 2 + 1]), "f"(s[nb * 4 + rv * 2]));
    }
    const int h = 16 * nbp + 8 * (mi >> 1) + (lane & 7), chunk = 2 * w + (mi & 1);
    const unsigned addr = base + h * 128 + ((chunk ^ (h & 7)) << 4);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  }
}
// v_scaled: tc_e4m3_v_fragment<1> (V^T's fragment of a group from the stage's token rows) with each token's group scale
// applied in fp16 (mul.f16x2 on the token pairs the fragment holds: (t, t + 1) and (t + 8, t + 9)), so that P needs
// one unscaled copy. The dequantized values must stay below 65504 in magnitude (fp16), the scaled-P kernels' bound
// is the scale's. scales: the stage's byte 512 + 4g of token 0.
__device__ __forceinline__ void tc64_v_fragment_scaled(void* dst, const void* base, const void* scales, int cw, int c) {
  tc_e4m3_v_fragment<1>(dst, base, cw, c);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  const unsigned char* sc = reinterpret_cast<const unsigned char*>(scales);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 16 * j + 2 * c;      // d[8j ..] holds tokens (t, t + 1) and (t + 8, t + 9) as fp16 pairs
    unsigned f01, f89;                 // the token pairs' scales, the first token in the low half
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(f01) : "f"(*reinterpret_cast<const float*>(sc + (t + 1) * 656)),
                                                    "f"(*reinterpret_cast<const float*>(sc + t * 656)));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(f89) : "f"(*reinterpret_cast<const float*>(sc + (t + 9) * 656)),
                                                    "f"(*reinterpret_cast<const float*>(sc + (t + 8) * 656)));
#pragma unroll
    for (int i = 0; i < 8; ++i) asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(d[8 * j + i]) : "r"((i >> 1) & 1 ? f89 : f01));
  }
}
// O^T (two groups, N values a thread each) *= alpha, skipped where none of this thread's columns changed its max
// (alpha = 1 exactly)
template <int N>
__device__ __forceinline__ void tc64_rescale_o(float* o0, float* o1, const float* alpha) {
  bool same = true;
#pragma unroll
  for (int hs = 0; hs < N / 4; ++hs) same = same && alpha[hs] == 1.f;
  if (same) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float a = alpha[((i >> 2) & (N / 8 - 1)) * 2 + (i & 1)];
    o0[i] *= a, o1[i] *= a;
  }
}
// bar.arrive: this warpgroup's share of a 256-thread named barrier that the other warpgroup waits on
__device__ __forceinline__ void tc64_arrive(int bar) {
  asm volatile("bar.arrive %0, 256;" :: "r"(bar) : "memory");
}
// P's copies written: visible to WGMMA (async proxy) and written by all four warps before this warpgroup's own P V
// (its named barrier own), then the other warpgroup told (bar.arrive on its P_READY)
__device__ __forceinline__ void tc64_p_ready(int own, int bar) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync %0, 128;" :: "r"(own) : "memory");
  asm volatile("bar.arrive %0, 256;" :: "r"(bar) : "memory");
}
// debug: S^T (or P) of this thread into dump[token * 512 + col0 + column] (fp32), WGMMA's accumulator layout read as
// the other helpers read it
template <int N>
__device__ __forceinline__ void tc64_dump(void* dump, const float* s, int col0) {
  const int lane = threadIdx.x & 31, r = ((threadIdx.x >> 5) & 3) * 16 + lane / 4, c = lane & 3;
  float* d = reinterpret_cast<float*>(dump);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[(r + 8 * ((i >> 1) & 1)) * 512 + col0 + (i >> 2) * 8 + 2 * c + (i & 1)] = s[i];
}
// trace=True: the warpgroup's first thread writes the SM clock of event e of step k into stamps[8 k + e] (int32 bits;
// each warpgroup stamps only its own steps)
__device__ __forceinline__ void tc64_stamp(void* at, int k, int e) {
  if ((threadIdx.x & 127) == 0 && k < 64) {
    int t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t) :: "memory");
    reinterpret_cast<int*>(at)[8 * k + e] = t;
  }
}
// the end: this thread's kept row sums into lpart[(4 wg + warp) * N + column]
template <int N>
__device__ __forceinline__ void tc64_put_sums(float* lpart, const float* l, int wg) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, q = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < N / 32; ++i) {
    const int hs = q * (N / 32) + i;
    lpart[(4 * wg + warp) * N + 8 * (hs >> 1) + 2 * c + (hs & 1)] = l[i];
  }
}
// O = O^T's columns / l, row-major: a thread's four values of a (group, column) are four consecutive latent columns
// (V^T's permuted M order): one 16-byte (fp32) or 8-byte (bf16) store each. Columns at or past `rows` are not
// stored; a column with l = 0 stores zeros. out, first_row: the output and the tile's row 0 in it (the row
// computed here, not kept in registers through the loop); g0: the warpgroup's first group.
template <int N, typename OutT>
__device__ __forceinline__ void tc64_store_o(OutT* out, int first_row, const float* o0, const float* o1, int g0,
                                             const float* l_s, int rows) {
  OutT* row0 = out + static_cast<long long>(first_row) * 512;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, q = lane >> 2, c = lane & 3;
  const float* o[2] = {o0, o1};
#pragma unroll
  for (int hs = 0; hs < N / 4; ++hs) {
    const int nb = hs >> 1, e = hs & 1, h = 8 * nb + 2 * c + e;
    if (h >= rows) continue;
    const float l = l_s[h], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int gg = 0; gg < 2; ++gg) {
      const float* v = o[gg] + nb * 4 + e;
      OutT* at = row0 + h * 512 + (g0 + gg) * 128 + 4 * (8 * w + q);
      if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float4*>(at) = make_float4(v[0] * inv, v[2] * inv, v[N / 2] * inv, v[N / 2 + 2] * inv);
      } else {
        unsigned lo, hi;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v[2] * inv), "f"(v[0] * inv));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v[N / 2 + 2] * inv), "f"(v[N / 2] * inv));
        *reinterpret_cast<uint2*>(at) = make_uint2(lo, hi);
      }
    }
  }
}
"""


def _lat(kl_s, slot, g):
    """Group g's latent in stage `slot` (64 tokens x 656 bytes as the cache holds them): byte 128 g of token 0."""
    return T.access_ptr(kl_s[slot, 0, g * GROUP], "r", STEP * TOKEN_BYTES - g * GROUP)


def _stage(kl_s, slot):
    return T.access_ptr(kl_s[slot, 0, 0], "r", STEP * TOKEN_BYTES)


@T.macro
def _k_half(kl_s, slot, g, h, a_k):
    tid = T.get_thread_binding() % 128
    T.evaluate(T.call_extern("handle", f"tc64_k_half<{h}>", a_k.data, _lat(kl_s, slot, g),
                             tid // 32 * 16 + tid % 32 // 4, tid % 4))


@T.macro
def _group(kl_s, slot, ql_s, a_k0, a_k1, acc, s_t, k_fragments, g):
    # latent group g's two 64-column halves into acc, drained, then folded into S^T with the group's token scales
    if k_fragments == 2:
        _k_half(kl_s, slot, g, 0, a_k0)
        T.wgmma_gemm(a_k0, ql_s[g, :, 0:64], acc, transpose_B=True, clear_accum=True)
        _k_half(kl_s, slot, g, 1, a_k1)
        T.wgmma_gemm(a_k1, ql_s[g, :, 64:128], acc, transpose_B=True)
    else:
        _k_half(kl_s, slot, g, 0, a_k0)
        T.wgmma_gemm(a_k0, ql_s[g, :, 0:64], acc, transpose_B=True, clear_accum=True)
        T.wait_wgmma(0)
        _k_half(kl_s, slot, g, 1, a_k0)
        T.wgmma_gemm(a_k0, ql_s[g, :, 64:128], acc, transpose_B=True)
    T.wait_wgmma(0)
    T.evaluate(T.call_extern("handle", f"tc64_fold<{acc.shape[1]}>", s_t.data, acc.data, _stage(kl_s, slot), g))


@T.macro
def _rope(kl_s, slot, qr_s, a_r, s_t):
    # S^T = the rope's K Q_r^T: bf16 from the stage's token rows into registers, its MMAs issued (not drained)
    tid = T.get_thread_binding() % 128
    T.evaluate(T.call_extern("handle", "tc_rope_fragment", a_r.data,
                             T.access_ptr(kl_s[slot, 0, D_V + 16], "r", STEP * TOKEN_BYTES - D_V - 16),
                             tid // 32 * 16 + tid % 32 // 4, tid % 4))
    T.wgmma_gemm(a_r, qr_s, s_t, transpose_B=True, clear_accum=True)


@T.macro
def _k_scaled_half(kl_s, slot, ql_s, a_k, acc, g, h, first):
    # k_scaled: group g's half h, its tokens' scale ratios in the fragment, into acc (no drain)
    tid = T.get_thread_binding() % 128
    T.evaluate(T.call_extern("handle", f"tc64_k_half_scaled<{h}>", a_k.data, _lat(kl_s, slot, g),
                             _stage(kl_s, slot), g, tid // 32 * 16 + tid % 32 // 4, tid % 4))
    T.wgmma_gemm(a_k, ql_s[g, :, h * 64:(h + 1) * 64], acc, transpose_B=True, clear_accum=first)


@T.macro
def _scores_k_scaled(kl_s, slot, ql_s, qr_s, a_r, a_k0, a_k1, acc, s_t):
    # S^T = the rope's K Q_r^T + (largest group scale)[token] * sum_g (K_g * ratio_g) Q_g^T: the eight halves into
    # acc on two alternating fragments, each refilled once the MMA before the last is done (wait 1: the fills run
    # under the MMAs), one drain, one fold
    _rope(kl_s, slot, qr_s, a_r, s_t)
    _k_scaled_half(kl_s, slot, ql_s, a_k0, acc, 0, 0, True)
    _k_scaled_half(kl_s, slot, ql_s, a_k1, acc, 0, 1, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k0, acc, 1, 0, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k1, acc, 1, 1, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k0, acc, 2, 0, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k1, acc, 2, 1, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k0, acc, 3, 0, False)
    T.wait_wgmma(1)
    _k_scaled_half(kl_s, slot, ql_s, a_k1, acc, 3, 1, False)
    T.wait_wgmma(0)
    T.evaluate(T.call_extern("handle", f"tc64_fold_max<{acc.shape[1]}>", s_t.data, acc.data, _stage(kl_s, slot)))


@T.macro
def _scores(kl_s, slot, ql_s, qr_s, a_r, a_k0, a_k1, acc, s_t, k_fragments):
    # S^T = the rope's K Q_r^T (bf16 from the stage's token rows into registers), then each group's two 64-column
    # halves into acc, folded into S^T with the group's token scales. Group 0 is peeled: its fill overlaps the rope's
    # MMAs and its drain covers them, so nothing is in flight when the loop of groups 1-3 begins. Entered with the
    # rope's MMAs in flight, the loop (whose fold writes S^T, the rope's accumulator) made ptxas serialize every
    # WGMMA of the kernel (C7513), and unrolling it spills (bench/NOTES.md "Session 52").
    _rope(kl_s, slot, qr_s, a_r, s_t)
    _group(kl_s, slot, ql_s, a_k0, a_k1, acc, s_t, k_fragments, 0)
    for g in T.serial(1, GROUPS):
        _group(kl_s, slot, ql_s, a_k0, a_k1, acc, s_t, k_fragments, g)


@T.macro
def _pv(w, kl_s, slot, p_s, pw, a_v, o0, o1):
    # O^T of groups 2w, 2w + 1 += V^T (P * scale_g)^T, P from p_s[pw] (its copy of the group; v_scaled, one P copy
    # and the scales in V's fragment); one V fragment, each group's MMA waited for before the next fill (two would
    # not fit beside O^T and a live S^T)
    _v_fill(kl_s, slot, 2 * w, a_v, p_s.shape[1] == 1)
    T.wgmma_gemm(a_v, p_s[pw, 0 if p_s.shape[1] == 1 else 2 * w, :, :], o0, transpose_B=True)
    T.wait_wgmma(0)
    _v_fill(kl_s, slot, 2 * w + 1, a_v, p_s.shape[1] == 1)
    T.wgmma_gemm(a_v, p_s[pw, 0 if p_s.shape[1] == 1 else 2 * w + 1, :, :], o1, transpose_B=True)


@T.macro
def _v_fill(kl_s, slot, g, a_v, scaled):
    tid = T.get_thread_binding() % 128
    if scaled:
        T.evaluate(T.call_extern("handle", "tc64_v_fragment_scaled", a_v.data, _lat(kl_s, slot, g),
                                 T.access_ptr(kl_s[slot, 0, D_V + 4 * g], "r", STEP * TOKEN_BYTES - D_V - 4 * g),
                                 tid // 4, tid % 4))
    else:
        T.evaluate(T.call_extern("handle", "tc_e4m3_v_fragment<1>", a_v.data, _lat(kl_s, slot, g), tid // 4, tid % 4))


@T.macro
def _other_pv(w, k, kl_s, p_s, al_s, full, empty, a_v, o0, o1, l_t, alpha):
    # the P V of step k, scored by the other warpgroup: its P, maxima and factors are ready (P_READY); the stage's
    # barrier phase is still k's (neither warpgroup has released it), so the wait returns at once and orders the
    # stage's bytes for this warpgroup too
    T.evaluate(T.call_extern("handle", "tc_bar", BAR_P_READY + (1 - w), 256))
    T.mbarrier_wait_parity(full[k % kl_s.shape[0]], (k // kl_s.shape[0]) % 2)
    n = al_s.shape[1]
    T.evaluate(T.call_extern("handle", f"tc64_alpha_of<{n}>", T.access_ptr(al_s[1 - w, 0], "r", n), alpha.data))
    T.evaluate(T.call_extern("handle", f"tc64_rescale_o<{n}>", o0.data, o1.data, alpha.data))
    T.evaluate(T.call_extern("handle", f"tc64_rescale_l<{n}>", l_t.data, alpha.data))
    _pv(w, kl_s, k % kl_s.shape[0], p_s, 1 - w, a_v, o0, o1)
    T.mbarrier_arrive(empty[k % kl_s.shape[0]])


TRACE_STEPS = 64
TRACE_EVENTS = ("start", "data", "scores", "other's P V issued", "softmax", "P free", "P ready", "own P V issued")


@T.macro
def _stamp(stamps, k, e):
    # trace=True: the warpgroup's first thread writes the SM clock at event e of its step k (TRACE_EVENTS)
    if stamps is not None:
        T.evaluate(T.call_extern("handle", "tc64_stamp", stamps, k, e))


@T.macro
def _chain(w, n_iter, first, seqlen, base, h_q, causal, scale_log2, row0, ql_s, qr_s, kl_s, p_s, red, m_s, al_s,
           full, empty, a_r, a_k0, a_k1, a_v, acc, s_t, o0, o1, mx, alpha, l_t, dump=None, k_fragments=2,
           k_scaled=False, stamps=None):
    # MMA warpgroup w: its own steps k = w, w + 2, ... (scores, softmax, P), and the P V of every step
    n = m_s.shape[1]                 # rows a tile (WGMMA's N)
    T.set_max_nreg(MMA_REGS, 1)
    T.fill(o0, 0.0)
    T.fill(o1, 0.0)
    T.fill(l_t, 0.0)
    for j in T.serial((n_iter + 1 - w) // 2):
        k = 2 * j + w
        slot = k % kl_s.shape[0]
        _stamp(stamps, k, 0)
        T.mbarrier_wait_parity(full[slot], (k // kl_s.shape[0]) % 2)
        _stamp(stamps, k, 1)
        valid = seqlen - (first + k) * STEP
        if valid < STEP:       # the sequence's short last step: its tokens past the end zeroed (latent, scales)
            T.evaluate(T.call_extern("handle", "tc_zero_tail<1>", _stage(kl_s, slot), _stage(kl_s, slot), valid,
                                     BAR_TAIL + w))
        if k_scaled:
            _scores_k_scaled(kl_s, slot, ql_s, qr_s, a_r, a_k0, a_k1, acc, s_t)
        else:
            _scores(kl_s, slot, ql_s, qr_s, a_r, a_k0, a_k1, acc, s_t, k_fragments)
        _stamp(stamps, k, 2)
        if dump is not None and w == 0:     # debug: the CTA's first step's scores as folded (dump columns 0..)
            if j == 0:
                T.evaluate(T.call_extern("handle", f"tc64_dump<{n}>", dump, s_t.data, 0))
        T.evaluate(T.call_extern("handle", f"tc64_mask<{n}>", s_t.data, (first + k) * STEP, base, seqlen, h_q, int(causal),
                                 row0))
        T.evaluate(T.call_extern("handle", f"tc64_max_put<{n}>", s_t.data, T.access_ptr(red[w, 0], "r", 8 * n), j % 2,
                                 BAR_MAX + w))
        if k >= 1:             # step k - 1 (the other warpgroup's): its P V, and its maxima for this softmax
            _other_pv(w, k - 1, kl_s, p_s, al_s, full, empty, a_v, o0, o1, l_t, alpha)
        _stamp(stamps, k, 3)
        T.evaluate(T.call_extern("handle", f"tc64_max_get<{n}>", mx.data, T.access_ptr(red[w, 0], "r", 8 * n), j % 2))
        T.evaluate(T.call_extern("handle", f"tc64_softmax<{n}>", s_t.data, mx.data, T.access_ptr(m_s[1 - w, 0], "r", n),
                                 T.access_ptr(m_s[w, 0], "w", n), T.access_ptr(al_s[w, 0], "w", n), alpha.data,
                                 scale_log2))
        T.evaluate(T.call_extern("handle", f"tc64_sums<{n}>", s_t.data, alpha.data, l_t.data))
        if dump is not None and w == 0:     # debug: its P (dump columns 64..)
            if j == 0:
                T.evaluate(T.call_extern("handle", f"tc64_dump<{n}>", dump, s_t.data, 64))
        _stamp(stamps, k, 4)
        if k >= 2:             # the other warpgroup's P V of step k - 2 is done with p_s[w]
            T.evaluate(T.call_extern("handle", "tc_bar", BAR_P_FREE + w, 256))
        _stamp(stamps, k, 5)
        for g in range(p_s.shape[1]):      # the scaled copies (v_scaled: P)
            T.evaluate(T.call_extern("handle", f"tc64_p_store<{n}, {int(p_s.shape[1] > 1)}>",
                                     T.access_ptr(p_s[w, 0, 0, 0], "w", p_s.shape[1] * n * STEP), s_t.data,
                                     _stage(kl_s, slot), g))
        T.evaluate(T.call_extern("handle", "tc64_p_ready", BAR_MAX + w, BAR_P_READY + w))
        _stamp(stamps, k, 6)
        T.wait_wgmma(0)        # step k - 1's P V: O^T complete for the rescale, p_s[1 - w] read
        if k >= 1 and k + 1 < n_iter:
            T.evaluate(T.call_extern("handle", "tc64_arrive", BAR_P_FREE + (1 - w)))
        T.evaluate(T.call_extern("handle", f"tc64_rescale_o<{n}>", o0.data, o1.data, alpha.data))
        _pv(w, kl_s, slot, p_s, w, a_v, o0, o1)
        T.wait_wgmma(0)        # V's fragment free before the next step's fills (in flight into them: spills)
        T.mbarrier_arrive(empty[slot])
        _stamp(stamps, k, 7)
    if n_iter >= 1 and (n_iter - 1) % 2 != w:     # the last step is the other warpgroup's: its P V
        T.wait_wgmma(0)
        _other_pv(w, n_iter - 1, kl_s, p_s, al_s, full, empty, a_v, o0, o1, l_t, alpha)
    T.wait_wgmma(0)


@T.macro
def _epilogue(w, frags, lpart, l_s, m_s, Out, Lse, OPart, LsePart, bi, si, splits, max_splits, n_iter, row0, rows, h_q):
    # both MMA warpgroups: the row sums' 8 partials added in a fixed order (WG0's first n threads), the lse from the
    # last step's maxima, then each warpgroup's two groups of O stored
    n = l_s.shape[0]
    o0, o1, l_t = frags[6], frags[7], frags[10]
    T.evaluate(T.call_extern("handle", f"tc64_put_sums<{n}>", T.access_ptr(lpart[0, 0], "w", 8 * n), l_t.data, w))
    T.evaluate(T.call_extern("handle", "tc_bar", BAR_BOTH, 256))
    if w == 0:
        tx = T.get_thread_binding()
        if tx < n:
            total = (((lpart[0, tx] + lpart[1, tx]) + (lpart[2, tx] + lpart[3, tx])) +
                     ((lpart[4, tx] + lpart[5, tx]) + (lpart[6, tx] + lpart[7, tx])))
            l_s[tx] = total
            if si < splits:
                lse2 = T.if_then_else(total > 0.0, m_s[(n_iter + 1) % 2, tx] + T.log2(total), -T.infinity("float32"))
                if splits == 1:
                    if row0 + tx < rows:
                        Lse[bi, (row0 + tx) % h_q, (row0 + tx) // h_q] = lse2 * LN2
                else:
                    LsePart[bi * max_splits + si, row0 + tx] = lse2
    T.evaluate(T.call_extern("handle", "tc_bar", BAR_BOTH, 256))
    if si < splits:
        if splits == 1:
            T.evaluate(T.call_extern("handle", f"tc64_store_o<{n}>", T.access_ptr(Out[0, 0, 0], "w", 1),
                                     bi * rows + row0, o0.data, o1.data, 2 * w, T.access_ptr(l_s[0], "r", n),
                                     T.min(rows - row0, n)))
        else:
            T.evaluate(T.call_extern("handle", f"tc64_store_o<{n}>", T.access_ptr(OPart[0, 0, 0], "w", 1),
                                     (bi * max_splits + si) * (T.int32(OPart.shape[1])) + row0,
                                     o0.data, o1.data, 2 * w, T.access_ptr(l_s[0], "r", n), n))


@T.macro
def _load_query(Q, bi, row0, rows, ql_s, qr_s, ql_loc, qr_loc):
    # Q^T's latent in fp16 with its columns permuted (q_column), its rope in bf16; rows past s_q * h_q zero. The
    # loads are one helper's (all in flight at once), the stores TileLang's (ql_s's layout is the WGMMA's)
    n = qr_s.shape[0]
    tx = T.get_thread_binding()
    T.evaluate(T.call_extern("handle", f"tc64_query_chunks<{n}>", ql_loc.data, qr_loc.data,
                             T.access_ptr(Q[bi, row0, 0], "r", n * D_QK), T.min(rows - row0, n)))
    for i in T.unroll(ql_loc.shape[0] // 8):
        if i * 384 + tx < n * D_V // 8:
            h = (i * 384 + tx) // 64
            m = (i * 384 + tx) % 64
            for p in T.unroll(4):
                # source column s (in the group) = 32c + 4j + 2u is fragment K index 16j + 8u + 2c (q_column)
                sc = (m % 16) * 8 + 2 * p
                k = 16 * ((sc % 32) // 4) + 8 * ((sc % 4) // 2) + 2 * (sc // 32)
                ql_s[m // 16, h, k] = ql_loc[8 * i + 2 * p]
                ql_s[m // 16, h, k + 1] = ql_loc[8 * i + 2 * p + 1]
    for i in T.unroll(qr_loc.shape[0] // 8):
        if i * 384 + tx < n * D_ROPE // 8:
            for e in T.unroll(8):
                qr_s[(i * 384 + tx) // 8, (i * 384 + tx) % 8 * 8 + e] = qr_loc[8 * i + e]


@T.macro
def _produce(KV, KVf, KVh, kl_s, full, empty, BlockTable, bi, first, n_iter, page, max_blocks, num_pages):
    # the producer warpgroup past the ring's first stages: each stage once both MMA warpgroups have released its slot
    T.set_max_nreg(PRODUCER_REGS, 0)
    stages = kl_s.shape[0]
    for k in T.serial(T.max(n_iter - stages, 0)):
        kk = k + stages
        pidx = _rs2_page(BlockTable, bi, first + kk, page, max_blocks, num_pages)   # before the wait
        T.mbarrier_wait_parity(empty[kk % stages], ((kk // stages) % 2) ^ 1)
        _rs2_issue(KV, KVf, KVh, kl_s, kl_s, kl_s, full, kk % stages, pidx, (first + kk) * STEP % page, True)


def _stages(rt, copies):
    """The 64-token stages that fit beside everything else in shared memory (at most four)."""
    other = (GROUPS * rt * GROUP * 2 + rt * D_ROPE * 2 + 2 * copies * rt * STEP * 2 + 2 * 8 * rt * 4 + 2 * 2 * rt * 4
             + 8 * rt * 4 + rt * 4 + 1024)
    return min(4, (SMEM_BYTES - other) // (STEP * TOKEN_BYTES))


def _check(rows, page, dtype):
    if rows < 1:
        raise ValueError(f"mla_decode_fp8_rows64 needs at least one query row (s_q * h_q), got {rows}")
    if page < STEP or page % STEP:
        raise ValueError(f"mla_decode_fp8_rows64 steps 64 tokens inside one page: page must be a multiple of 64, "
                         f"got {page}")
    if dtype != "bfloat16":
        raise ValueError(f"the FP8 cache's rope is bf16: the query must be bfloat16, got {dtype}")


@tile_program(
    "mla_decode_fp8_rows64",
    targets=("cuda:sm_90a",),
    examples={"h64": dict(h_q=64, s_q=1), "h128": dict(h_q=128, s_q=1), "h32-s2": dict(h_q=32, s_q=2)},
    pass_configs=lambda t, params: {"tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                                      "tl.disable_safe_memory_legalize": True},
)
def mla_decode_fp8_rows64_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                                  v_scaled: bool = False, rows_tile: int | None = None, debug: bool = False,
                                  k_fragments: int = 2, trace: bool = False, k_scaled: bool = False):
    """The FP8-cache MLA decode at up to 64 query rows a CTA (this module's docstring), one CTA per (sequence,
    split, row tile) as mla_decode_program's grid (bid = (bi * max_splits + si) * m_tiles + mt); its arguments and
    outputs are mla_decode_program's with kv_format="fp8".

    rows_tile (WGMMA's N): 64, or 32 where s_q * h_q <= 32 (the default there: half the accumulators and P, so a
    third stage fits with the scaled copies and a fourth with v_scaled). The ring takes as many 41,984-byte stages
    as shared memory leaves, at most four.

    k_fragments: K's groups as two 64-column register fragments, the second filled under the first's MMA (2), or
    one, each half's MMA waited for before the next fill (1: 16 registers fewer).

    k_scaled=True (bench/NOTES.md "Session 52"): the group scales go into K's fp16 fragments as ratios to each
    token's largest group scale (at most 1, so the values stay below 448), the eight halves accumulate with no drain
    between groups, and the largest scale multiplies the sum once; the fp16 products round K (2^-11 relative),
    where the default kernel's K is e4m3 exactly. Takes two fragments (k_fragments 2).

    trace=True (bench.trace_mla_rows64; unsplit launches with OPart of batch slots): each warpgroup's first thread
    writes the SM clock at TRACE_EVENTS of its own steps among the first TRACE_STEPS into OPart[bid, 0] (int32 bits,
    8 a step), and WG0 its span (tc_span: global timer at entry, loop start, loop end, exit; SM clock over the
    loop; its SM; its steps) into OPart[bid, 1, 0:8].

    debug=True (a GPU test's diagnosis, unsplit launches only): WG0 writes its CTA's first step's S^T as folded
    (before the mask) and its P into OPart[bid] (rows: tokens; columns 0.. and 64..: query rows), so that a wrong
    result can be placed in the scores, the softmax or after.

    v_scaled=True: the group scales go into V^T's fragment (fp16 multiplies of the converted token pairs) instead of
    four scaled copies of P, so P is one unscaled 8 KB tile a warpgroup and the ring has three stages instead of
    two (a warpgroup's next step can be in flight while it computes). The dequantized cache values must then stay
    below 65504 in magnitude (they become fp16 operands); the default kernel's bound is on the scales (P * scale)."""
    rows = s_q * h_q
    _check(rows, page, dtype)
    rt = rows_tile or (32 if rows <= 32 else ROWS)
    if trace and debug:
        raise ValueError("mla_decode_fp8_rows64: trace and debug both write OPart[bid]: take one")
    if k_fragments not in (1, 2):
        raise ValueError(f"mla_decode_fp8_rows64: k_fragments must be 1 or 2, got {k_fragments}")
    if k_scaled and k_fragments != 2:
        raise ValueError("mla_decode_fp8_rows64: k_scaled fills two K fragments alternately (k_fragments=2)")
    if rt not in (32, 64) or (rt == 32 and rows > 32):
        raise ValueError(f"mla_decode_fp8_rows64: rows_tile must be 64, or 32 with s_q * h_q <= 32; got {rows_tile} "
                         f"for {rows} rows")
    copies = 1 if v_scaled else GROUPS
    stages = _stages(rt, copies)
    causal = causal and s_q > 1
    m_tiles = -(-rows // rt)
    rows_pad = -(-rows // BLOCK_M) * BLOCK_M
    li, ri = -(-64 * rt // 384), -(-8 * rt // 384)     # the query's 16-byte chunks a thread: latent, rope
    batch, num_pages, max_blocks, slots = T.dynamic("batch, num_pages, max_blocks, slots")

    @T.prim_func
    def mla_decode_fp8_rows64(
        Q: T.Tensor((batch, rows, D_QK), "bfloat16"),
        KV: T.Tensor((num_pages, page, TOKEN_BYTES), "float8_e4m3fn"),
        KVf: T.Tensor((num_pages, page, TOKEN_BYTES // 4), "float32"),
        KVh: T.Tensor((num_pages, page, TOKEN_BYTES // 2), "bfloat16"),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), "bfloat16"),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, rows_pad, D_V), "float32"),
        LsePart: T.Tensor((slots, rows_pad), "float32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(batch * max_splits * m_tiles, threads=3 * 128) as bid:
            ql_s = T.alloc_shared((GROUPS, rt, GROUP), "float16")          # Q^T's latent, fp16, columns permuted
            qr_s = T.alloc_shared((rt, D_ROPE), "bfloat16")
            kl_s = T.alloc_shared((stages, STEP, TOKEN_BYTES), "float8_e4m3fn")   # a step's tokens as the cache holds them
            p_s = T.alloc_shared((2, copies, rt, STEP), "float16")          # P * scale_g (or P): p_s[w] written by WG w
            red = T.alloc_shared((2, 8 * rt), "float32")                    # each warpgroup's step-max exchange
            m_s = T.alloc_shared((2, rt), "float32")                        # running maxima after WG w's last step
            al_s = T.alloc_shared((2, rt), "float32")                       # the factors of WG w's last step
            lpart = T.alloc_shared((8, rt), "float32")                      # the row sums' 8 partials
            l_s = T.alloc_shared((rt,), "float32")
            full = T.alloc_barrier([128] * stages)
            empty = T.alloc_barrier([256] * stages)
            frags = [(T.alloc_fragment((STEP, D_ROPE), "bfloat16"), T.alloc_fragment((STEP, 64), "float16"),
                      T.alloc_fragment((STEP, 64), "float16"), T.alloc_fragment((GROUP, STEP), "float16"),
                      T.alloc_fragment((STEP, rt), "float32"), T.alloc_fragment((STEP, rt), "float32"),
                      T.alloc_fragment((GROUP, rt), "float32"), T.alloc_fragment((GROUP, rt), "float32"),
                      T.alloc_local((rt // 4,), "float32"), T.alloc_local((rt // 4,), "float32"),
                      T.alloc_local((rt // 32,), "float32")) for _ in range(2)]
            ql_loc = T.alloc_local((8 * li,), "float16")                  # the query's chunks in flight
            qr_loc = T.alloc_local((8 * ri,), "bfloat16")
            T.annotate_layout({p_s: make_full_bank_swizzled_layout(p_s)})
            T.import_source(HELPER_SOURCE + HELPER64_SOURCE)

            if trace:
                if T.get_thread_binding() == 0:
                    T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, 1, 0], "w", 8), 0, 0))
            mt = bid % m_tiles
            si = (bid // m_tiles) % max_splits
            bi = bid // (m_tiles * max_splits)
            row0 = mt * rt
            splits = Splits[bi]
            seqlen = SeqLens[bi]
            tx = T.get_thread_binding()
            split_v = T.alloc_local((2,), "int32")
            split_v[0], split_v[1] = _split_range(si, splits, T.ceildiv(seqlen, STEP))
            first, n_iter = split_v[0], split_v[1]
            base = seqlen - s_q + 1 if causal else seqlen
            # the ring's first stages, then the query (permuted fp16 latent, bf16 rope; rows past s_q * h_q zero)
            if tx >= 256 and n_iter > 0:
                for k in T.serial(T.min(n_iter, stages)):
                    _rs2_issue(KV, KVf, KVh, kl_s, kl_s, kl_s, full, k,
                               _rs2_page(BlockTable, bi, first + k, page, max_blocks, num_pages),
                               (first + k) * STEP % page, True)
            _load_query(Q, bi, row0, rows, ql_s, qr_s, ql_loc, qr_loc)
            for w, h in T.Parallel(2, rt):
                m_s[w, h] = -T.infinity("float32")
            T.sync_threads()
            if tx < 128:
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, 1, 0], "w", 8), 1, 0))
                _chain(0, n_iter, first, seqlen, base, h_q, causal, scale_log2, row0, ql_s, qr_s, kl_s, p_s, red, m_s,
                       al_s, full, empty, *frags[0], k_fragments=k_fragments, k_scaled=k_scaled,
                       dump=T.access_ptr(OPart[bid, 0, 0], "w", STEP * D_V) if debug else None,
                       stamps=T.access_ptr(OPart[bid, 0, 0], "w", 8 * TRACE_STEPS) if trace else None)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, 1, 0], "w", 8), 2, 0))
                _epilogue(0, frags[0], lpart, l_s, m_s, Out, Lse, OPart, LsePart, bi, si, splits, max_splits, n_iter,
                          row0, rows, h_q)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, 1, 0], "w", 8), 3, n_iter))
            elif tx < 256:
                _chain(1, n_iter, first, seqlen, base, h_q, causal, scale_log2, row0, ql_s, qr_s, kl_s, p_s, red, m_s,
                       al_s, full, empty, *frags[1], k_fragments=k_fragments, k_scaled=k_scaled,
                       stamps=T.access_ptr(OPart[bid, 0, 0], "w", 8 * TRACE_STEPS) if trace else None)
                _epilogue(1, frags[1], lpart, l_s, m_s, Out, Lse, OPart, LsePart, bi, si, splits, max_splits, n_iter,
                          row0, rows, h_q)
            else:
                _produce(KV, KVf, KVh, kl_s, full, empty, BlockTable, bi, first, n_iter, page, max_blocks, num_pages)

    return mla_decode_fp8_rows64
