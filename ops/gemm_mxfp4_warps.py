"""MXFP4-weight GEMM for a handful of tokens (m <= 16) on independent warps: C (m, n) bf16 = A (m, k) bf16 @
dequant(B)^T, B packed e2m1 (n, k/2) with E8M0 scales (n, k/32), as ops.gemm_mxfp4.

At m <= 16 the GEMM is a stream of weight bytes, and on Hopper (no FP4 tensor cores) the decode of those
bytes sets the pace: the swapped WGMMA kernel (ops.gemm_mxfp4.mxfp4_swapped_program) decodes on the
two MMA warpgroups of one block an SM, whose ~700-cycle steps are a dependency chain more than an issue
bound (bench/NOTES.md "Session 45"). Here every warp is on its own: a block is 16 weight rows and `splits`
warps, each warp a contiguous range of 128-deep K steps. A warp loads its codes, scales and activations
straight from global memory into registers (codes and activations `depth` steps ahead: ACTS_RING, session 62),
decodes its rows into the A fragments of mma.sync m16n8k16 (bf16, fp32 accumulate) and multiplies them
by the tokens as B: no shared memory, no barrier in the loop, 8-16 independent warps an SM. The warps'
fp32 partials meet in shared memory once and are summed in warp order (the same bits run to run).

The K order inside an MMA is permuted so that a lane's codes are one MX block: lane (g, t) (g = lane / 4,
t = lane % 4) holds rows g and g + 8 of block 4s + t of step s, i.e. 16 contiguous bytes a row, and MMA i of
the step takes codes 4i .. 4i + 3 of every lane's block; the activations go in with the same permutation
(lane (g, t) loads token g's 32 values of block t). The decode is ops.gemm_mxfp4's exact one (e2m1 x 2^e in
bf16, subnormals kept), so the products are exact and only the fp32 sums' order differs from the other kernels.

The codes' loads alone (bench.sweep_mxfp4_warps loads=1) take 70-85% of the kernel's time (~2.0-2.5 TB/s);
session 59's bulk-copy feed into shared memory was slower still (bench/NOTES.md "Session 60") and is gone. QUADS
loads the scale words four steps at a time (a quarter of their line requests: the loads alone were no faster). The
weights' loads asking L2 for 256 bytes around each request (ld.global.nc.L1::no_allocate.L2::256B) were 6-38% slower
(session 62) and are gone, as are the codes and scale words through a per-warp shared ring by cp.async (session
63: 19-52% slower; its warps' first data came later and their steps' issue stretched under the LDGSTS), and a
queue kernel whose warps took (tile, step) items from a block's counter (session 63: its warps ended together, but
each step waited ~2.4x longer for its data; 15-36% slower in every layout tried;
`git show a8dbfac:ops/gemm_mxfp4_warps.py` has it). The
masked grouped form (mxfp4_gemm_nt_warps_masked, MoE decode) runs the same warps a (group, 16-row tile) block over
token tiles.

ops.mxfp4_gemm_nt takes it on sm_90a at m <= ops.gemm_mxfp4.WARP_TOKENS (measured there: bench/NOTES.md "Session
58"); ops.m_grouped_mxfp4_gemm_nt_masked at expected_m <= WARP_TOKENS and k <= ops.gemm_mxfp4.MASKED_WARPS_MAX_K
(session 60). The programs also compile for sm_100a (HMMA in SASS), where the ops keep their other paths.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _validate as check
from ops._workspace import bound_only
from ops.gemm_mxfp4 import BLOCK_K, E2M1_FRAGMENT_SOURCE, E2M1_SOURCE, _code_words, _scale_words

ROWS = 16            # weight rows a block (the MMA's M)
TRACE_STEPS = 64     # trace=True: K steps a warp stamps (data, issued); words a warp: 4 + 2 * TRACE_STEPS
TRACE_WORDS = 4 + 2 * TRACE_STEPS
TOKENS = (8, 16)     # token tiles (one or two MMA N = 8 columns)
MAX_SPLITS = 16      # warps a block
WARPS_PER_SM = 16    # what plan_warps aims for: enough independent warps to keep the weight stream in flight
DEPTH = 2            # K steps of a warp's codes in flight in its registers (session 58, 1x4096x7168 on two H100s:
                     # 2 steps 8.6 / 9.5 us, 1 step 10.5, 3 11.1, 4 10.9, 6 11.0; session 63, H100s, with ACTS_RING,
                     # twice each: 3 steps (119 registers) -5% at 8x7168x2048, +5-6% at 8x4096x7168, +-3% elsewhere)
AHEAD = 0            # ... and further steps asked of L2 by prefetch (0: none; session 58: 4 was slower at 1 token)
QUADS = False        # the scale words loaded four K steps at a time (one a lane, shuffled to the step). Session 60
                     # (H100): the loads alone unchanged (8.07 / 8.38 us at 1x4096x7168), the kernel -11% to +17%

ACTS_RING = True     # the activations kDepth steps ahead in the codes' ring (False: one step ahead, the kernel before
                     # session 62). Session 62, H200, same run: 1x4096x7168 8.44 -> 8.39 us, 8x4096x7168 9.58 -> 9.25,
                     # 8x7168x2048 7.65 -> 6.95 (their latency, not their bytes or L1: bench/NOTES.md "Session 62")
LOADS_ONLY = (0, 1, 2, 3, 4, 5, 6, 7)   # mxfp4_warps_program's loads_only probes (0: the kernel)

WARP_SOURCE = r"""
__device__ __forceinline__ void tc_mma_16816_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                  unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void tc_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
// A lane's codes of one step: its 16-byte block of rows g and g + 8 and their scale words (byte t is the
// block's E8M0); and the activations of a step: `tiles` tokens' 32 values of the block (64 bytes each; zeros past m)
struct TcWarpCodes {
  uint4 w, v;
  unsigned sw, sv;
};
template <int kTiles>
struct TcWarpActs {
  uint4 x[kTiles][4];
};
__device__ __forceinline__ unsigned tc_ldg_no_l1(const unsigned* p) {   // read-only, not allocated in L1
  unsigned v;
  asm("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// kScales false: the step's scale words come otherwise (kQuads, or none: a probe), zeros here; kScalesNoL1 (a probe):
// the scale words not allocated in L1, so that each misses there as the codes do
template <bool kScales, bool kScalesNoL1 = false>
__device__ __forceinline__ void tc_warp_codes_load(TcWarpCodes& d, const uint4* bw, const uint4* bv,
                                                   const unsigned* sw, const unsigned* sv, int s) {
  d.w = __ldg(bw + 4 * s);
  d.v = __ldg(bv + 4 * s);
  d.sw = !kScales ? 0u : kScalesNoL1 ? tc_ldg_no_l1(sw + s) : __ldg(sw + s);
  d.sv = !kScales ? 0u : kScalesNoL1 ? tc_ldg_no_l1(sv + s) : __ldg(sv + s);
}
__device__ __forceinline__ unsigned tc_warp_codes_fold(const TcWarpCodes& c) {
  return c.w.x ^ c.w.y ^ c.w.z ^ c.w.w ^ c.v.x ^ c.v.y ^ c.v.z ^ c.v.w ^ c.sw ^ c.sv;
}
template <int kTiles, bool kNone = false>   // kNone (a probe): zeros, nothing loaded
__device__ __forceinline__ void tc_warp_acts_load(TcWarpActs<kTiles>& d, const uint4* const* xa, const bool* live,
                                                  int s) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int q = 0; q < 4; ++q) d.x[i][q] = live[i] && !kNone ? __ldg(xa[i] + 16 * s + q) : make_uint4(0u, 0u, 0u, 0u);
  }
}
// codes c0 .. c0 + 3 of a lane's block (byte pair c0 / 2 of word c0 / 8) of rows g, g + 8 -> the A fragment
template <bool kFast>
__device__ __forceinline__ void tc_warp_fragment(unsigned* a, unsigned w, unsigned v, int p, unsigned fw,
                                                 unsigned fv) {
  const unsigned s0 = (unsigned)p * 0x1111u + 0xC480u, s1 = (unsigned)(p + 1) * 0x1111u + 0xC480u;
  if (kFast) {
    a[0] = tc_bf16x2_mul(tc_e2m1x2_bits<true>(w, p, s0), fw);
    a[1] = tc_bf16x2_mul(tc_e2m1x2_bits<true>(v, p, s0), fv);
    a[2] = tc_bf16x2_mul(tc_e2m1x2_bits<true>(w, p + 1, s1), fw);
    a[3] = tc_bf16x2_mul(tc_e2m1x2_bits<true>(v, p + 1, s1), fv);
  } else {
    a[0] = tc_e2m1x2_scaled(tc_e2m1x2_bits<true>(w, p, s0), fw);
    a[1] = tc_e2m1x2_scaled(tc_e2m1x2_bits<true>(v, p, s0), fv);
    a[2] = tc_e2m1x2_scaled(tc_e2m1x2_bits<true>(w, p + 1, s1), fw);
    a[3] = tc_e2m1x2_scaled(tc_e2m1x2_bits<true>(v, p + 1, s1), fv);
  }
}
template <bool kFast, int kTiles>
__device__ __forceinline__ void tc_warp_step_mma(float (*acc)[4], const TcWarpCodes& c, const TcWarpActs<kTiles>& d,
                                                 unsigned fw, unsigned fv) {
  const unsigned w[4] = {c.w.x, c.w.y, c.w.z, c.w.w}, v[4] = {c.v.x, c.v.y, c.v.z, c.v.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {       // MMA i: codes 4i .. 4i + 3 of the block, activations 4i .. 4i + 3
    unsigned a[4];
    tc_warp_fragment<kFast>(a, w[i >> 1], v[i >> 1], 2 * (i & 1), fw, fv);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      const unsigned* x = reinterpret_cast<const unsigned*>(d.x[j]);
      tc_mma_16816_bf16(acc[j], a[0], a[1], a[2], a[3], x[2 * i], x[2 * i + 1]);
    }
  }
}
// a step's MMAs with the lane's scale bytes ew, ev (rows g, g + 8) applied: when no byte of the warp's rows exceeds
// 128 (fast), 2^(e8 - 1) in both bf16 lanes (exponent field e8 + 126), one exact multiply of the bits placed as
// e2m1 * 2^-126; else two multiplies
template <int kTiles>
__device__ __forceinline__ void tc_warp_step_scaled(float (*acc)[4], const TcWarpCodes& c, const TcWarpActs<kTiles>& d,
                                                    unsigned ew, unsigned ev, bool fast) {
  if (fast) {
    const unsigned fw = ((ew + 126u) << 7) * 0x10001u, fv = ((ev + 126u) << 7) * 0x10001u;
    tc_warp_step_mma<true, kTiles>(acc, c, d, fw, fv);
  } else {
    tc_warp_step_mma<false, kTiles>(acc, c, d, tc_e8m0_bf16x2(ew), tc_e8m0_bf16x2(ev));
  }
}
// lane (g, t)'s activation rows (token 8i + g of tile i; live: below m, else row 0, never loaded) at step s0
template <int kTiles>
__device__ __forceinline__ void tc_warp_acts_at(const uint4** xa, bool* live, const void* A, int m, int k, int s0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int tok = 8 * i + g;
    live[i] = tok < m;
    xa[i] = reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(A) + (size_t)(live[i] ? tok : 0) * k)
            + 4 * t + 16 * s0;
  }
}
// the warp's fp32 partial (16 rows x 8 kTiles tokens, the MMA's C layout) into red, token-major (red[token * 16 + row])
template <int kTiles>
__device__ __forceinline__ void tc_warp_partials_store(float* red, const float (*acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int tok = 8 * i + 2 * t;
    red[tok * 16 + g] = acc[i][0];
    red[(tok + 1) * 16 + g] = acc[i][1];
    red[tok * 16 + g + 8] = acc[i][2];
    red[(tok + 1) * 16 + g + 8] = acc[i][3];
  }
}
// A warp's K range [s0, s0 + steps) of the block's 16 rows: its fp32 partial (16 rows x 8 kTiles tokens) into
// red, token-major (red[token * 16 + row]). B: the block's first row's code words (k / 8 a row); SFB: its
// scale words (k / 128 a row); A: token 0's activations (k a row); m tokens. The codes of kDepth steps are in
// flight in registers (a step's slot reloaded kDepth steps ahead once its MMAs are issued), the activations one
// step ahead or with them (kActsRing); kAhead > 0: the codes also asked of L2 kAhead steps beyond the registers.
// kQuads: the scale words come four steps a load: lane (g, t) holds rows g and g + 8's words of steps 4c + t of the
// quad c (the row's four lanes one 16-byte piece: a quarter of the scale loads' line requests), the next quad in
// flight behind it, and step s takes its words from lane (g, s % 4) by a shuffle. Else each step's words ride in
// the ring with its codes.
// kTrace (bench.trace_mxfp4_warps): lane 0 writes the warp's stamps into trace[0 ..]: the global timer's ns at
// entry and end, the SM clock at entry, at each step's data (its scale words in registers: its loads landed) and
// issue (its MMAs issued), and at end (steps past kTraceSteps: not stamped)
// kLoadsOnly (bench.sweep_mxfp4_warps, wrong results): the loads alone, the decode and MMAs replaced by a fold of the
// words: 1 all of them, 6 all but the scale words, 7 all but the activations (0: the kernel).
// kActsRing: the activations ride in the ring with their step's codes (loaded kDepth steps ahead; the same
// registers as the one-step-ahead pair at kDepth 2)
template <int kTiles, int kDepth, int kAhead, bool kTrace = false, int kTraceSteps = 0, int kLoadsOnly = 0,
          bool kQuads = false, bool kActsRing = false, bool kScalesNoL1 = false>
__device__ __forceinline__ void tc_mxfp4_warp_mma(float* red, const int* B, const int* SFB, const void* A, int m,
                                                  int k, int s0, int steps, int* trace = nullptr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr bool kWordScales = !kQuads && kLoadsOnly != 6, kActs = kLoadsOnly != 7;
  if (kTrace && lane == 0) { trace[0] = tc_globaltimer_lo(); trace[2] = (int)clock(); }
  const int kw = k / 8, kb = k / 128;
  const uint4* bw = reinterpret_cast<const uint4*>(B + (size_t)g * kw) + t + 4 * s0;
  const uint4* bv = reinterpret_cast<const uint4*>(B + (size_t)(g + 8) * kw) + t + 4 * s0;
  const unsigned* sw = reinterpret_cast<const unsigned*>(SFB + (size_t)g * kb) + s0;
  const unsigned* sv = reinterpret_cast<const unsigned*>(SFB + (size_t)(g + 8) * kb) + s0;
  const uint4* xa[kTiles];
  bool live[kTiles];
  tc_warp_acts_at<kTiles>(xa, live, A, m, k, s0);
  float acc[kTiles][4];
#pragma unroll
  for (int i = 0; i < kTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  unsigned qw = 0u, qv = 0u, nqw = 0u, nqv = 0u;   // kQuads: this quad's scale words and the next one's
  if (kQuads && kLoadsOnly != 6) {
    if (t < steps) { qw = __ldg(sw + t); qv = __ldg(sv + t); }
    if (4 + t < steps) { nqw = __ldg(sw + 4 + t); nqv = __ldg(sv + 4 + t); }
  }
  TcWarpCodes ring[kDepth];
#pragma unroll
  for (int j = 0; j < kDepth; ++j) {
    if (j < steps) tc_warp_codes_load<kWordScales, kScalesNoL1>(ring[j], bw, bv, sw, sv, j);
  }
  if (kAhead > 0) {
#pragma unroll
    for (int j = kDepth; j < kDepth + kAhead; ++j) {
      if (j < steps) { tc_prefetch_l2(bw + 4 * j); tc_prefetch_l2(bv + 4 * j); }
    }
  }
  TcWarpActs<kTiles> cur, nxt;           // one step ahead (!kActsRing)
  TcWarpActs<kTiles> aring[kDepth];       // kActsRing: a slot a step, beside its codes
  if (kActsRing) {
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      if (j < steps) tc_warp_acts_load<kTiles, !kActs>(aring[j], xa, live, j);
    }
  } else if (steps > 0) {
    tc_warp_acts_load<kTiles, !kActs>(cur, xa, live, 0);
  }
  for (int base = 0; base < steps; base += kDepth) {
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      const int i = base + j;
      if (i < steps) {
        if (!kActsRing && i + 1 < steps) tc_warp_acts_load<kTiles, !kActs>(nxt, xa, live, i + 1);
        const TcWarpActs<kTiles>& x = kActsRing ? aring[j] : cur;
        if (kAhead > 0 && i + kDepth + kAhead < steps) {
          tc_prefetch_l2(bw + 4 * (i + kDepth + kAhead));
          tc_prefetch_l2(bv + 4 * (i + kDepth + kAhead));
        }
        unsigned wsw = ring[j].sw, wsv = ring[j].sv;
        if (kQuads) {
          const int src = (lane & ~3) | (i & 3);
          wsw = __shfl_sync(0xFFFFFFFFu, qw, src);
          wsv = __shfl_sync(0xFFFFFFFFu, qv, src);
        }
        const unsigned ew = (wsw >> (8 * t)) & 0xFFu, ev = (wsv >> (8 * t)) & 0xFFu;
        const bool fast = __all_sync(0xFFFFFFFFu, ew <= 128u && ev <= 128u);
        if (kTrace && lane == 0 && i < kTraceSteps) trace[4 + 2 * i] = (int)clock();
        if (kLoadsOnly) {
          unsigned f = tc_warp_codes_fold(ring[j]) ^ wsw ^ wsv;
#pragma unroll
          for (int q = 0; q < kTiles; ++q) {   // every word, so that the activations stay 16-byte loads
#pragma unroll
            for (int r = 0; r < 4; ++r) f ^= x.x[q][r].x ^ x.x[q][r].y ^ x.x[q][r].z ^ x.x[q][r].w;
          }
          acc[0][0] += __uint_as_float(f & 0x807FFFFFu);
        } else {
          tc_warp_step_scaled<kTiles>(acc, ring[j], x, ew, ev, fast);
        }
        if (kTrace && lane == 0 && i < kTraceSteps) trace[5 + 2 * i] = (int)clock();   // (mma.sync: the warp's)
        if (i + kDepth < steps) tc_warp_codes_load<kWordScales, kScalesNoL1>(ring[j], bw, bv, sw, sv, i + kDepth);
        if (kQuads && kLoadsOnly != 6 && (i & 3) == 3) {   // the next quad current, the one after it asked for
          qw = nqw;
          qv = nqv;
          if (i + 5 + t < steps) { nqw = __ldg(sw + i + 5 + t); nqv = __ldg(sv + i + 5 + t); }
        }
        if (kActsRing) {
          if (i + kDepth < steps) tc_warp_acts_load<kTiles, !kActs>(aring[j], xa, live, i + kDepth);
        } else {
          cur = nxt;
        }
      }
    }
  }
  tc_warp_partials_store<kTiles>(red, acc);
  if (kTrace && lane == 0) { trace[3] = (int)clock(); trace[1] = tc_globaltimer_lo(); }
}
// loads_only 2 .. 5 (bench.sweep_mxfp4_warps, wrong results): the warp's codes alone (no scale words, no
// activations), the same bytes, grid and warps as the kernel, in four orders: 2, the kernel's (a step's 64 bytes of
// each of the 16 rows, kDepth steps in flight); 3, row by row (a row's range as consecutive 512-byte pieces, lane i
// bytes 16 i, 2 kDepth pieces in flight: the same bytes in flight when a range is 512 bytes); 4, piece by piece (the
// 16 rows' first 512-byte pieces, then their second ...: what a pipeline of 8-step chunks would read); 5, pre-tiled
// (the warp's range as one contiguous run of steps x 1 KB of the block's 16-row region, 512 bytes a load: the order a
// weight layout tiled by (block, step) would give, bench/NOTES.md "Session 61"). What the rows' scatter costs the
// stream.
template <int kOrder, int kDepth>
__device__ __forceinline__ void tc_mxfp4_warp_codes_probe(float* red, const int* B, const int* SFB, const void* A,
                                                          int m, int k, int s0, int steps) {
  const int lane = threadIdx.x & 31;
  const unsigned char* base = reinterpret_cast<const unsigned char*>(B) + 64 * s0;
  const int rs = k / 2, len = 64 * steps;
  unsigned f = 0u;
  if (kOrder == 2) {
    const int g = lane >> 2, t = lane & 3;
    const uint4* bw = reinterpret_cast<const uint4*>(base + (size_t)g * rs) + t;
    const uint4* bv = reinterpret_cast<const uint4*>(base + (size_t)(g + 8) * rs) + t;
    uint4 ring[kDepth][2];
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      if (j < steps) { ring[j][0] = __ldg(bw + 4 * j); ring[j][1] = __ldg(bv + 4 * j); }
    }
    for (int b0 = 0; b0 < steps; b0 += kDepth) {
#pragma unroll
      for (int j = 0; j < kDepth; ++j) {
        const int i = b0 + j;
        if (i < steps) {
          f ^= ring[j][0].x ^ ring[j][0].w ^ ring[j][1].x ^ ring[j][1].w;
          if (i + kDepth < steps) {
            ring[j][0] = __ldg(bw + 4 * (i + kDepth));
            ring[j][1] = __ldg(bv + 4 * (i + kDepth));
          }
        }
      }
    }
  } else {
    constexpr int kRing = 2 * kDepth;
    const int per_row = (len + 511) / 512, pieces = kOrder == 5 ? 2 * steps : 16 * per_row;
    // piece q: (row, 512-byte piece) = (q / per_row, q % per_row) row by row, (q % 16, q / 16) piece by piece;
    // pre-tiled: bytes 512 q of the warp's run (1 KB a step from the block's byte 1024 s0: two pieces a step)
    auto row_of = [&](int q) { return kOrder == 3 ? q / per_row : q % 16; };
    auto off_of = [&](int q) { return 512 * (kOrder == 3 ? q % per_row : q / 16) + 16 * lane; };
    auto live = [&](int q) { return q < pieces && (kOrder == 5 || off_of(q) < len); };
    auto at = [&](int q) {
      return reinterpret_cast<const uint4*>(kOrder == 5 ? reinterpret_cast<const unsigned char*>(B) + 1024 * s0
                                                              + 512 * q + 16 * lane
                                                        : base + (size_t)row_of(q) * rs + off_of(q));
    };
    uint4 ring[kRing];
#pragma unroll
    for (int j = 0; j < kRing; ++j) {
      if (live(j)) ring[j] = __ldg(at(j));
    }
    for (int b0 = 0; b0 < pieces; b0 += kRing) {
#pragma unroll
      for (int j = 0; j < kRing; ++j) {
        const int q = b0 + j, r = q + kRing;
        if (live(q)) f ^= ring[j].x ^ ring[j].w;
        if (live(r)) ring[j] = __ldg(at(r));
      }
    }
  }
  red[lane] = __uint_as_float(f & 0x807FFFFFu);
}
"""


def _check_params(n, k, tokens, splits, depth, ahead):
    if tokens not in TOKENS:
        raise ValueError(f"tokens must be one of {TOKENS}, got {tokens}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1..{MAX_SPLITS} warps a block, got {splits}")
    if not 1 <= depth <= 8 or ahead < 0:
        raise ValueError(f"depth must be 1..8 and ahead >= 0, got depth={depth}, ahead={ahead}")
    if n % ROWS or k % BLOCK_K:
        raise ValueError(f"n must be a multiple of {ROWS} and k of {BLOCK_K}, got n={n}, k={k}")


def _per(kb: int, splits: int) -> int:
    """K steps of a full warp range."""
    return -(-kb // splits)


def _helper(tokens, depth, ahead, quads, acts_ring=False, trace=False, loads_only=0, scales_no_l1=False) -> str:
    """The device helper (with its template arguments) one warp calls for its K range (arguments past the last one
    set left at their defaults, so that the default kernel's source stays the same)."""
    if loads_only in (2, 3, 4, 5):
        return f"tc_mxfp4_warp_codes_probe<{int(loads_only)}, {depth}>"
    b = lambda v: "true" if v else "false"   # noqa: E731
    args = [str(tokens // 8), str(depth), str(ahead), b(trace), str(TRACE_STEPS if trace else 0), str(int(loads_only)),
            b(quads), b(acts_ring), b(scales_no_l1)]
    defaults = [None, None, None, "false", "0", "0", "false", "false", "false"]
    while len(args) > 3 and args[-1] == defaults[len(args) - 1]:
        args.pop()
    return f"tc_mxfp4_warp_mma<{', '.join(args)}>"


@T.macro
def _sum_partials(red, C, g, j0, col0, m, tid, threads, splits, outs):
    """The block's output tile from the warps' fp32 partials red (splits, tokens, ROWS), summed in warp order (the
    same bits run to run): token j < m, row r into C[j0 + j, col0 + r] (C[g, ...] for the masked form's 3-D C)."""
    total = T.alloc_var("float32")
    for it in T.serial(-(-outs // threads)):
        o = it * threads + tid
        j = o // ROWS
        r = o % ROWS
        if o < outs and j < m:
            total = red[0, j, r]
            for s in T.serial(1, splits):
                total = total + red[s, j, r]
            if g is None:
                C[j0 + j, col0 + r] = T.cast(total, "bfloat16")
            else:
                C[g, j0 + j, col0 + r] = T.cast(total, "bfloat16")


@tile_program(
    "mxfp4_gemm_nt_warps",
    targets=("cuda:sm_90a", "cuda:sm_100a"),
    examples={"decode-4096x7168": dict(n=4096, k=7168, tokens=8, splits=8),
              "decode-7168x2048": dict(n=7168, k=2048, tokens=16, splits=4)},
)
def mxfp4_warps_program(n: int, k: int, tokens: int = 8, splits: int = 8, depth: int = DEPTH, ahead: int = AHEAD,
                        quads: bool = QUADS, acts_ring: bool = ACTS_RING, trace: bool = False, loads_only: int = 0,
                        scales_no_l1: bool = False):
    """C (m, n) = A (m, k) @ dequant(B)^T for m <= tokens (8 or 16): a block a 16-row tile of B, `splits` warps
    each a contiguous range of the 128-deep K steps (ceil(k / 128 / splits) of them, the last ones shorter or
    empty), their partials summed in warp order in shared memory. depth: K steps of a warp's codes in flight in
    registers (1..8); ahead: further steps of its codes asked of L2 by prefetch (0: none); quads: the scale words
    loaded four steps at a time, one a lane (else a step's with its codes); acts_ring: the activations loaded depth
    steps ahead with their step's codes (else one step ahead).
    trace=True (bench.trace_mxfp4_warps): warp w of block b writes its stamps into Trace[b * splits + w] (TRACE_WORDS:
    ns at entry and end, SM clock at entry and end, then per step its data and issue clocks); without it, Trace is
    bound but never touched. loads_only (bench.sweep_mxfp4_warps): the kernel's loads without its decode and MMAs,
    wrong results: what the memory system gives this load pattern (1 or True: all of them; 2: its codes alone; 3: the
    same codes read row by row in 512-byte pieces; 4: piece by piece over the 16 rows; 5: the warp's range as one
    contiguous run of the block's region, the order of a weight layout tiled by (block, step); 6: all but the scale
    words; 7: all but the activations). scales_no_l1 (a probe, the same results): the scale words loaded without an
    L1 allocation, so that each one misses there (a warp's next seven steps' words otherwise come from L1)."""
    _check_params(n, k, tokens, splits, depth, ahead)
    if loads_only not in LOADS_ONLY:
        raise ValueError(f"loads_only must be 0..7, got {loads_only!r}")
    m = T.dynamic("m")
    kb = k // BLOCK_K
    per = _per(kb, splits)
    threads = 32 * splits
    outs = ROWS * tokens
    helper = _helper(tokens, depth, ahead, quads, acts_ring, trace, loads_only, scales_no_l1)

    @T.prim_func
    def mxfp4_gemm_nt_warps(A: T.Tensor((m, k), "bfloat16"), B: T.Tensor((n, k // 8), "int32"),
                            SFB: T.Tensor((n, kb), "int32"), C: T.Tensor((m, n), "bfloat16"),
                            Trace: T.Tensor((n // ROWS * splits if trace else 1, TRACE_WORDS), "int32")):
        with tile.grid(n // ROWS, threads) as bid:
            red = tile.stage((splits, tokens, ROWS), "float32")
            T.import_source(E2M1_SOURCE + E2M1_FRAGMENT_SOURCE + WARP_SOURCE)
            tid = T.get_thread_binding()
            w = tid // 32
            s0 = w * per
            T.evaluate(T.call_extern(
                "handle", helper, T.access_ptr(red[w, 0, 0], "w", tokens * ROWS),
                T.access_ptr(B[bid * ROWS, 0], "r", ROWS * k // 8), T.access_ptr(SFB[bid * ROWS, 0], "r", ROWS * kb),
                T.access_ptr(A[0, 0], "r", k), m, k, s0, T.max(T.min(per, kb - s0), 0),
                *([T.access_ptr(Trace[bid * splits + w, 0], "w", TRACE_WORDS)] if trace else [])))
            tile.barrier()
            _sum_partials(red, C, None, 0, bid * ROWS, m, tid, threads, splits, outs)

    return mxfp4_gemm_nt_warps


@tile_program(
    "mxfp4_gemm_nt_warps_masked",
    targets=("cuda:sm_90a", "cuda:sm_100a"),
    examples={"moe-decode-4096x7168": dict(n=4096, k=7168, tokens=8, splits=2)},
)
def mxfp4_warps_masked_program(n: int, k: int, tokens: int = 8, splits: int = 8, depth: int = DEPTH,
                               ahead: int = AHEAD, quads: bool = QUADS, acts_ring: bool = ACTS_RING):
    """The masked grouped form (MoE decode): C[g, :masked_m[g]] = A[g, :masked_m[g]] @ dequant(B[g])^T and zeros in
    C[g]'s other rows. A block is (group, 16-row tile of B[g]) and runs the dense kernel's warps over its token tiles
    (`tokens` rows each; more than one only where masked_m is above the tile, an expected_m that was too low: the
    weights are then read again a tile); a group with masked_m = 0 reads no weights. masked_m is clamped to
    [0, max_m]."""
    _check_params(n, k, tokens, splits, depth, ahead)
    g_n, max_m = T.dynamic("g"), T.dynamic("max_m")
    kb = k // BLOCK_K
    per = _per(kb, splits)
    threads = 32 * splits
    outs = ROWS * tokens
    nb = n // ROWS
    helper = _helper(tokens, depth, ahead, quads, acts_ring)

    @T.prim_func
    def mxfp4_gemm_nt_warps_masked(A: T.Tensor((g_n, max_m, k), "bfloat16"), B: T.Tensor((g_n, n, k // 8), "int32"),
                                   SFB: T.Tensor((g_n, n, kb), "int32"), Masked: T.Tensor((g_n,), "int32"),
                                   C: T.Tensor((g_n, max_m, n), "bfloat16")):
        with tile.grid(g_n * nb, threads) as bid:
            red = tile.stage((splits, tokens, ROWS), "float32")
            T.import_source(E2M1_SOURCE + E2M1_FRAGMENT_SOURCE + WARP_SOURCE)
            tid = T.get_thread_binding()
            w = tid // 32
            s0 = w * per
            gi = bid // nb
            row0 = (bid % nb) * ROWS
            mg = T.max(T.min(Masked[gi], max_m), 0)
            for tt in T.serial(T.ceildiv(max_m, tokens)):
                if tt * tokens < mg:
                    live = T.min(mg - tt * tokens, tokens)
                    steps = T.max(T.min(per, kb - s0), 0)
                    T.evaluate(T.call_extern(
                        "handle", helper, T.access_ptr(red[w, 0, 0], "w", tokens * ROWS),
                        T.access_ptr(B[gi, row0, 0], "r", ROWS * k // 8),
                        T.access_ptr(SFB[gi, row0, 0], "r", ROWS * kb),
                        T.access_ptr(A[gi, tt * tokens, 0], "r", k), live, k, s0, steps))
                    tile.barrier()
                    _sum_partials(red, C, gi, tt * tokens, row0, live, tid, threads, splits, outs)
                    tile.barrier()
            for it in T.serial(T.ceildiv(max_m * ROWS, threads)):
                o = it * threads + tid
                j = o // ROWS
                if j < max_m and j >= mg:
                    C[gi, j, row0 + o % ROWS] = T.cast(0, "bfloat16")

    return mxfp4_gemm_nt_warps_masked


def plan_warps(m: int, n: int, k: int, sms: int = 132, splits: int | None = None, depth: int | None = None,
               ahead: int | None = None, quads: bool | None = None, acts_ring: bool | None = None) -> dict:
    """The token tile (8 or 16) and the warps a block (splits, a power of two): about WARPS_PER_SM warps an SM over
    n / 16 blocks, at most one a K step; depth, ahead, quads, acts_ring: the module's defaults unless given."""
    if not 0 < m <= TOKENS[-1]:
        raise ValueError(f"the warp kernel takes 1..{TOKENS[-1]} tokens, got m={m}")
    kb = k // BLOCK_K
    if splits is None:
        want = sms * WARPS_PER_SM * ROWS / n
        splits = 1
        while splits * 2 <= min(want, MAX_SPLITS, kb):
            splits *= 2
    return dict(tokens=next(t for t in TOKENS if t >= m), splits=splits, depth=DEPTH if depth is None else depth,
                ahead=AHEAD if ahead is None else ahead, quads=QUADS if quads is None else quads,
                acts_ring=ACTS_RING if acts_ring is None else acts_ring)


def launch_warps_masked(a, b, sfb, masked_m, out, tokens: int, **override):
    """mxfp4_gemm_nt_warps_masked on a (g, max_m, k) bf16, b (g, n, k/2) uint8, sfb (g, n, k/32) uint8, masked_m (g,)
    int32 into out (g, max_m, n) bf16, with token tiles of `tokens` rows (8 or 16: the op's expected_m), planned by
    plan_warps over the g * n rows of all groups (+ override); the launcher kept per call shape."""
    from backends.cuda.device import sm_count

    G, max_m, k = a.shape
    n = b.shape[1]
    check.aligned("a", a, 16, "read 16 bytes a lane")
    target = targets.resolve(a)
    key = ("mxfp4_gemm_nt_warps_masked", target.name, a.device.index, G, n, k, tokens, WARPS_PER_SM, DEPTH, AHEAD,
           QUADS, ACTS_RING, tuple(sorted(override.items())))
    launch = jit.launchers(key, lambda: mxfp4_warps_masked_program.compile(
        target, n=n, k=k, **plan_warps(tokens, G * n, k, sms=sm_count(a), **override)).launcher())
    launch(a, _code_words(b), _scale_words(sfb), masked_m, out)


def launch_warps(a, b, sfb, out, loads_only: int = 0, scales_no_l1: bool = False, **override):
    """mxfp4_gemm_nt_warps on a (m, k) bf16, b (n, k/2) uint8, sfb (n, k/32) uint8 into out (m, n) bf16, planned by
    plan_warps (+ override: splits, depth, ahead, quads, acts_ring); loads_only, scales_no_l1: mxfp4_warps_program's
    probes; the launcher kept per call shape."""
    from backends.cuda.device import sm_count

    m, k = a.shape
    n = b.shape[0]
    check.aligned("a", a, 16, "read 16 bytes a lane")
    target = targets.resolve(a)
    key = ("mxfp4_gemm_nt_warps", target.name, a.device.index, m, n, k, WARPS_PER_SM, DEPTH, AHEAD, QUADS,
           ACTS_RING, loads_only, scales_no_l1, tuple(sorted(override.items())))
    launch = jit.launchers(key, lambda: mxfp4_warps_program.compile(
        target, n=n, k=k, loads_only=loads_only, scales_no_l1=scales_no_l1,
        **plan_warps(m, n, k, sms=sm_count(a), **override)).launcher())
    launch(a, _code_words(b), _scale_words(sfb), out, bound_only(a.device, TRACE_WORDS).view(1, TRACE_WORDS))
