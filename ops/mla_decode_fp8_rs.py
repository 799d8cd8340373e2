"""sm_90a MLA decode for the FP8 cache with up to 16 query rows: the e4m3 latent goes from shared memory
straight into WGMMA's register operand (wgmma RS); no converted tile is written (bench/NOTES.md "Session 35").

With the operands swapped (tokens are WGMMA's M), the cache tile is the A operand of both GEMMs:

    S^T (64 tokens x 16 rows) = rope K Q_r^T + sum_g scale_g[token] * (K_g Q_g^T)       g: 128-column groups
    O_g^T (128 latent x 16)  = alpha * O_g^T + V_g^T (P * scale_g[token])^T             one P copy per group

Each MMA thread loads the raw bytes of its own fragment and converts them with one `cvt.rn.f16x2.e4m3x2` a
pair (exact). K's fragment takes two 16-byte loads a row because Q^T's latent columns are permuted to match
(q column 32c + 4j + 2u + e is fragment K 16j + 8u + 2c + e); V^T's takes one 32-bit load a token because its
M order is permuted (fragment row mt * 64 + 16w + 8hi + q is latent column 4(8w + q) + 2mt + hi; undone when
O is stored). The raw tile of a group is 64 x 128 bytes in TMA's 128-byte swizzle, so both loads are free of
bank conflicts. Each GEMM's four groups run on two register fragments in turn (a group's conversion under the
previous group's MMA). The softmax runs down S^T's columns in the accumulator layout: one exchange between the
four warps a step, the row sums kept per thread until the end. Two CTAs an SM (launch bounds 2, 224 registers
for the MMA warpgroup): the two CTAs' chains overlap.

The step's helpers are written for issue count (bench/NOTES.md "Session 36": 1143 instructions a warp a step,
from 1659): the high half of a word converted in place (R.H1, no shift), a sequence's partial last step zeroed
once in shared memory (tc_zero_tail) instead of a guard a value, the four scaled P copies by stmatrix, the
scales of a thread's two tokens loaded once a step.

Two programs share that step: mla_decode_fp8_rs (one MMA warpgroup a CTA, two CTAs an SM) and
mla_decode_fp8_rs2 (two MMA warpgroups a CTA on alternate steps from one ring, one CTA an SM, merged at the end).

Status (H200, bench/NOTES.md "Session 38"): mla_decode_fp8_rs2 is mla_decode's FP8 kernel at s_q * h_q <= 16 on
sm_90a (pick_tiling's REGISTER_FP8, chains=2): 0.0982 ms at 128x16x4096, 1.55x the bf16 cache, 86% of copy
bandwidth (its split range computed once, one barrier a stage, exp2 as one MUFU: 0.1070 -> 0.0982); the
two-CTA program (bench provider `tilecraft-fp8-rs`) 0.1123 ms in the same run, the fold kernel before them
(`tilecraft-fp8-fold`) ~0.135.

The latent query is rounded to fp16 (as the fold kernel's): |q| and the cache scales must stay below 65504.

One CTA per (sequence, split) of the op's schedule (get_mla_schedule counts one CTA an SM; give the two-CTA
program a schedule made with twice the SMs); pages of 64 tokens or more (a 64-token step inside one page); the
same outputs as mla_decode_program (Out/Lse unsplit, OPart/LsePart for mla_combine_program).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from codegen.program import tile_program

D_QK, D_V, D_ROPE = 576, 512, 64
TOKEN_BYTES = 656                # FlashMLA's FP8 token: 512 e4m3 | 4 fp32 scales | 64 bf16
SCALE_WORD = D_V // 4            # the scales as 32-bit words of the token
ROPE_HALF = (D_V + 16) // 2      # the rope as 16-bit words of the token
ROWS = 16                        # query rows (s_q * h_q) a CTA: WGMMA's N
STEP = 64                        # tokens a step: WGMMA's M of S^T, K of O^T
GROUP = 128                      # latent columns per FP8 scale
GROUPS = D_V // GROUP
ROWS_PAD = 64                    # OPart / LsePart rows (mla_decode_program's 64-row padding)
LN2 = 0.6931471805599453
MMA_REGS = 224                   # setmaxnreg of the MMA warpgroup at two CTAs an SM (+ 24 for the producer)

TRACE_STEPS = 64
TRACE_ROW = 32                   # trace=True: the stamps go into OPart rows no output uses (ROWS <= 32 < ROWS_PAD)
SPAN_ROW = ROWS_PAD - 1
TRACE_EVENTS = ("step", "rope issued", "scores", "softmax", "P copied", "P V issued", "P V done")
HELPER_SOURCE = f"#define TC_TRACE_STEPS {TRACE_STEPS}\n" + r"""
__device__ __forceinline__ unsigned tc_e4m3x2_f16x2(unsigned v) {       // the low 16 bits of v: two e4m3
  unsigned r;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ unsigned tc_e4m3x2_f16x2_hi(unsigned v) {    // the high 16 bits (read as R.H1: no shift)
  unsigned r;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(r) : "r"(v));
  return r;
}
// A 64 x 128 e4m3 tile, 128-byte rows, TMA's 128-byte swizzle (16-byte chunk k of row t at chunk k ^ t % 8)
__device__ __forceinline__ const unsigned char* tc_sw128(const void* base, int t, int byte) {
  return reinterpret_cast<const unsigned char*>(base) + t * 128 + ((((byte >> 4) ^ (t & 7)) << 4) | (byte & 15));
}
// Byte `byte` of token t of a latent group: in TMA's 128-byte-swizzled 64 x 128 tile (PAGE = 0), or in a stage
// that holds the cache's 64 tokens as they are, 656 bytes apart (PAGE = 1: rs2's stage="page", one bulk copy a
// step; base is the group's byte 0 of token 0). 656 bytes are 164 words, 4 banks on a row: the fills' loads
// below stay conflict-free (a quarter-warp's 16-byte loads: rows q, q + 1 x bytes 32c, 4q + 8c words apart).
template <int PAGE>
__device__ __forceinline__ const unsigned char* tc_lat(const void* base, int t, int byte) {
  if constexpr (PAGE) return reinterpret_cast<const unsigned char*>(base) + t * 656 + byte;
  else return tc_sw128(base, t, byte);
}
// S^T = K Q^T, K's fragment of one 128-column group: rows r and r + 8 (tokens), quad place c. Byte 32c + 4j + e
// of a row is fragment K 16j + 2c + e (e < 2) or 16j + 8 + 2c + e - 2 (Q^T's columns are permuted to match):
// two 16-byte loads a row, one cvt a value pair.
template <int PAGE = 0>
__device__ __forceinline__ void tc_e4m3_k_fragment(void* dst, const void* base, int r, int c) {
  const uint4 a0 = *reinterpret_cast<const uint4*>(tc_lat<PAGE>(base, r, 32 * c));
  const uint4 a1 = *reinterpret_cast<const uint4*>(tc_lat<PAGE>(base, r, 32 * c + 16));
  const uint4 b0 = *reinterpret_cast<const uint4*>(tc_lat<PAGE>(base, r + 8, 32 * c));
  const uint4 b1 = *reinterpret_cast<const uint4*>(tc_lat<PAGE>(base, r + 8, 32 * c + 16));
  const unsigned w[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const unsigned v[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    d[4 * j + 0] = tc_e4m3x2_f16x2(w[j]);
    d[4 * j + 1] = tc_e4m3x2_f16x2(v[j]);
    d[4 * j + 2] = tc_e4m3x2_f16x2_hi(w[j]);
    d[4 * j + 3] = tc_e4m3x2_f16x2_hi(v[j]);
  }
}
// O^T = V^T P^T, V^T's fragment of one group (128 latent rows x 64 tokens, two m64 tiles). The M order is
// permuted: fragment row mt * 64 + 16w + 8hi + q is latent column 4(8w + q) + 2mt + hi, so a thread's four
// rows are one 32-bit word of a token: 16 word loads (tokens 16j + 2c + {0, 1, 8, 9}), byte pairs across two
// tokens by prmt, one cvt a pair. (A step's tokens past the sequence's end were zeroed by tc_zero_tail.)
template <int PAGE = 0>
__device__ __forceinline__ void tc_e4m3_v_fragment(void* dst, const void* base, int cw, int c) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 16 * j + 2 * c;
    const unsigned w0 = *reinterpret_cast<const unsigned*>(tc_lat<PAGE>(base, t, 4 * cw));
    const unsigned w1 = *reinterpret_cast<const unsigned*>(tc_lat<PAGE>(base, t + 1, 4 * cw));
    const unsigned w8 = *reinterpret_cast<const unsigned*>(tc_lat<PAGE>(base, t + 8, 4 * cw));
    const unsigned w9 = *reinterpret_cast<const unsigned*>(tc_lat<PAGE>(base, t + 9, 4 * cw));
    const unsigned lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
    const unsigned lo89 = __byte_perm(w8, w9, 0x5140), hi89 = __byte_perm(w8, w9, 0x7362);
    d[8 * j + 0] = tc_e4m3x2_f16x2(lo01);
    d[8 * j + 1] = tc_e4m3x2_f16x2_hi(lo01);
    d[8 * j + 2] = tc_e4m3x2_f16x2(lo89);
    d[8 * j + 3] = tc_e4m3x2_f16x2_hi(lo89);
    d[8 * j + 4] = tc_e4m3x2_f16x2(hi01);
    d[8 * j + 5] = tc_e4m3x2_f16x2_hi(hi01);
    d[8 * j + 6] = tc_e4m3x2_f16x2(hi89);
    d[8 * j + 7] = tc_e4m3x2_f16x2_hi(hi89);
  }
}
// A step with fewer than 64 tokens left (its sequence's last): the raw latent rows (4 groups x 64 x 128 bytes)
// and the scale rows (64 x 4 fp32) of tokens at or past `valid` become zeros, so that neither the fills nor P's
// scaled copies need a guard a value (the cache past the end may hold anything, NaN included; the rope's
// scores there are masked to -inf by tc_mask_t, a select). The MMA warpgroup's named barrier 10 then.
// (PAGE = 1: kl is the stage, tokens 656 bytes apart; their latent and scales, bytes 0-527, become zeros; ks unused)
template <int PAGE = 0>
__device__ __forceinline__ void tc_zero_tail(void* kl, void* ks, int valid, int bar = 10) {
  const int t = threadIdx.x & 127;
  unsigned char* raw = reinterpret_cast<unsigned char*>(kl);
  if constexpr (PAGE) {
#pragma unroll 1
    for (int i = valid * 33 + t; i < 64 * 33; i += 128)   // 16-byte chunks: token i / 33, chunk i % 33
      *reinterpret_cast<uint4*>(raw + (i / 33) * 656 + (i % 33) * 16) = make_uint4(0u, 0u, 0u, 0u);
  } else {
#pragma unroll 1
    for (int i = t; i < 4 * 64 * 8; i += 128) {      // 16-byte chunks: group i / 512, row i / 8 % 64
      if ((i >> 3 & 63) >= valid) *reinterpret_cast<uint4*>(raw + i * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
    if (t < 64 && t >= valid) *reinterpret_cast<float4*>(reinterpret_cast<float*>(ks) + 4 * t) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
}
// The 4 group scales of this thread's two token rows r, r + 8 of S^T (r = 16 warp + lane / 4): ks[4 rv + g]
// (PAGE = 1: ks_s is the stage's byte 512 of token 0, tokens 656 bytes apart)
template <int PAGE = 0>
__device__ __forceinline__ void tc_token_scales(const void* ks_s, float* ks) {
  const int r = ((threadIdx.x >> 5) & 3) * 16 + (threadIdx.x & 31) / 4;
  const unsigned char* at = reinterpret_cast<const unsigned char*>(ks_s);
  const float4 a = *reinterpret_cast<const float4*>(at + r * (PAGE ? 656 : 16));
  const float4 b = *reinterpret_cast<const float4*>(at + (r + 8) * (PAGE ? 656 : 16));
  ks[0] = a.x, ks[1] = a.y, ks[2] = a.z, ks[3] = a.w, ks[4] = b.x, ks[5] = b.y, ks[6] = b.z, ks[7] = b.w;
}
// stage="page": S^T += K_rope Q_rope^T from registers, K_rope's bf16 fragment (rows r, r + 8, quad place c; 4 k-steps
// of 16 in WGMMA's A order) read from the stage's token rows (base: byte 528 of token 0, tokens 656 bytes apart)
__device__ __forceinline__ void tc_rope_fragment(void* dst, const void* base, int r, int c) {
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  const unsigned char* at = reinterpret_cast<const unsigned char*>(base);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    d[4 * k + 0] = *reinterpret_cast<const unsigned*>(at + r * 656 + 32 * k + 4 * c);
    d[4 * k + 1] = *reinterpret_cast<const unsigned*>(at + (r + 8) * 656 + 32 * k + 4 * c);
    d[4 * k + 2] = *reinterpret_cast<const unsigned*>(at + r * 656 + 32 * k + 16 + 4 * c);
    d[4 * k + 3] = *reinterpret_cast<const unsigned*>(at + (r + 8) * 656 + 32 * k + 16 + 4 * c);
  }
}
// stage="page": a step's 64 tokens (41,984 contiguous bytes of the cache) in four bulk copies on the stage's barrier,
// issued by the warpgroup's first thread (the warpgroup then arrives as after TMA boxes)
template <typename Bar>
__device__ __forceinline__ void tc_bulk_page(void* dst, const void* src, Bar& bar) {
  if ((threadIdx.x & 127) == 0) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(b), "r"(64 * 656) : "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(d + k * 16 * 656), "l"(reinterpret_cast<const unsigned char*>(src) + k * 16 * 656),
                      "r"(16 * 656), "r"(b) : "memory");
  }
}
// S^T += scale_g[token] * (K_g Q_g^T): acc is group g's accumulator, in S^T's layout (s[nb * 4 + rv * 2 + e])
__device__ __forceinline__ void tc_fold(float* s, const float* acc, const float* ks, int g) {
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = fmaf(acc[i], ks[((i >> 1) & 1) * 4 + g], s[i]);
}
// (P * scale_g[token])^T into group g's 16 x 64 fp16 tile (row h, 128-byte rows, TMA's 128-byte swizzle): the
// warp's 16 tokens x 16 rows are four 8 x 8 matrices (token half rv, row half nb), stored transposed by one
// stmatrix.x4.trans; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void tc_p_store(void* p, const float* s, const float* ks, int g) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  unsigned r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int rv = i & 1, nb = i >> 1;
    const float sc = ks[rv * 4 + g];
    // the even row (e = 0) in the low half
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r[i]) : "f"(s[nb * 4 + rv * 2 + 1] * sc), "f"(s[nb * 4 + rv * 2] * sc));
  }
  const int mi = lane >> 3, h = 8 * (mi >> 1) + (lane & 7), chunk = 2 * w + (mi & 1);
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p)) + g * 2048 + h * 128 + ((chunk ^ (h & 7)) << 4);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// S^T's accumulator layout: s[nb * 4 + rv * 2 + e] is token row r + 8 rv (r = 16 warp + lane / 4) and query
// row (column) 8 nb + 2c + e, i.e. column slot hs = 2 nb + e of this thread (c = lane % 4).
// Scores of tokens at or past a row's limit become -inf: limit = base + row / h_q (causal, s_q > 1) or base.
__device__ __forceinline__ void tc_mask_t(float* s, int tok0, int base, int h_q, int causal) {
  const int lane = threadIdx.x & 31, r = ((threadIdx.x >> 5) & 3) * 16 + lane / 4, c = lane & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = (i >> 2) * 8 + 2 * c + (i & 1);
    const int lim = causal ? base + row / h_q : base;
    if (tok0 + r + 8 * ((i >> 1) & 1) >= lim) s[i] = -INFINITY;
  }
}
// 2^x by one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to zero); exp2f adds a range check and a
// squaring around it (four dependent instructions)
__device__ __forceinline__ float tc_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// The softmax of one step down S^T's columns: a max over the thread's two token rows, a warp shuffle over its
// 8 quads, one exchange between the 4 warps through red (2 parities x 4 warps x 4 places x 4 slots; one named
// barrier a step). m: the running maxima (log2 domain, the same in every thread of a column), l: this thread's
// partial sums of its two token rows (summed over the warpgroup at the end: tc_softmax_t_finish), alpha:
// exp2(m_old - m_new). A column that has seen only -inf keeps m = -inf, p = 0, alpha = 1.
__device__ __forceinline__ void tc_softmax_t(float* s, float* m, float* l, float* alpha, float* red, int parity,
                                             float scale_log2, int bar = 9) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float mx[4];
#pragma unroll
  for (int hs = 0; hs < 4; ++hs) mx[hs] = fmaxf(s[(hs >> 1) * 4 + (hs & 1)], s[(hs >> 1) * 4 + 2 + (hs & 1)]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
    for (int hs = 0; hs < 4; ++hs) mx[hs] = fmaxf(mx[hs], __shfl_xor_sync(0xFFFFFFFFu, mx[hs], off));
  }
  float* buf = red + parity * 64;
  if (lane < 4) *reinterpret_cast<float4*>(buf + warp * 16 + lane * 4) = make_float4(mx[0], mx[1], mx[2], mx[3]);
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(buf + w * 16 + (lane & 3) * 4);
    mx[0] = fmaxf(mx[0], v.x), mx[1] = fmaxf(mx[1], v.y), mx[2] = fmaxf(mx[2], v.z), mx[3] = fmaxf(mx[3], v.w);
  }
  float use[4];
#pragma unroll
  for (int hs = 0; hs < 4; ++hs) {
    const float mn = fmaxf(m[hs], mx[hs] * scale_log2);
    alpha[hs] = mn == -INFINITY ? 1.0f : tc_ex2(m[hs] - mn);
    use[hs] = mn == -INFINITY ? 0.0f : mn;
    m[hs] = mn;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = tc_ex2(fmaf(s[i], scale_log2, -use[(i >> 2) * 2 + (i & 1)]));
#pragma unroll
  for (int hs = 0; hs < 4; ++hs)
    l[hs] = fmaf(l[hs], alpha[hs], s[(hs >> 1) * 4 + (hs & 1)] + s[(hs >> 1) * 4 + 2 + (hs & 1)]);
}
// O^T (a 128 x 16 group accumulator, two m64 tiles: value mt * 8 + nb * 4 + hi * 2 + e is column slot 2 nb + e)
__device__ __forceinline__ void tc_rescale_t(float* o, const float* alpha) {
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] *= alpha[((i >> 2) & 1) * 2 + (i & 1)];
}
// the four groups' O^T, skipped where none of this thread's columns changed its max (alpha = 1 exactly: the
// product would be the same bits); once the maxima settle, most steps
__device__ __forceinline__ void tc_rescale_all_t(float* o0, float* o1, float* o2, float* o3, const float* alpha) {
  if (alpha[0] == 1.f && alpha[1] == 1.f && alpha[2] == 1.f && alpha[3] == 1.f) return;
  tc_rescale_t(o0, alpha), tc_rescale_t(o1, alpha), tc_rescale_t(o2, alpha), tc_rescale_t(o3, alpha);
}
// trace=True: CTA 0's first MMA thread writes the SM clock of event e of step k into stamps[k * 8 + e]
__device__ __forceinline__ void tc_stamp(void* at, int k, int e) {
  int* stamps = reinterpret_cast<int*>(at);
  if (blockIdx.x == 0 && (threadIdx.x & 127) == 0 && k < TC_TRACE_STEPS) {
    int t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t) :: "memory");
    stamps[k * 8 + e] = t;
  }
}
// trace=True: every CTA's first MMA thread writes span[e] = the global timer's low 32 bits (ns) at point e
// (0 entry, 1 loop start, 2 loop end, 3 exit), span[4 + e / 2] = the SM clock at points 1 and 2, span[6] = its
// SM, span[7] = its steps
__device__ __forceinline__ void tc_span(void* at, int e, int steps) {
  unsigned* span = reinterpret_cast<unsigned*>(at);
  if ((threadIdx.x & 127) == 0) {
    unsigned g, c, sm;
    asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(g) :: "memory");
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory");
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    span[e] = g;
    if (e == 1 || e == 2) span[4 + e - 1] = c;
    if (e == 3) { span[6] = sm; span[7] = (unsigned)steps; }
  }
}
// O = O^T's columns / l, stored row-major: a thread's four values of a (group, column) are four consecutive latent
// columns (V^T's permuted M order), so one 16-byte (fp32) or 8-byte (bf16) store each; a warp's store covers four
// rows x 128 contiguous bytes. Rows at or past `rows` are not stored; a column with l = 0 stores zeros.
template <typename OutT>
__device__ __forceinline__ void tc_store_o(OutT* row0, const float* o0, const float* o1, const float* o2,
                                           const float* o3, const float* l_s, int rows) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, q = lane >> 2, c = lane & 3;
  const float* o[4] = {o0, o1, o2, o3};
#pragma unroll
  for (int hs = 0; hs < 4; ++hs) {
    const int nb = hs >> 1, e = hs & 1, h = 8 * nb + 2 * c + e;
    if (h >= rows) continue;
    const float l = l_s[h], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float* v = o[g] + nb * 4 + e;
      OutT* at = row0 + h * 512 + g * 128 + 4 * (8 * w + q);
      if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float4*>(at) = make_float4(v[0] * inv, v[2] * inv, v[8] * inv, v[10] * inv);
      } else {
        unsigned lo, hi;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v[2] * inv), "f"(v[0] * inv));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v[10] * inv), "f"(v[8] * inv));
        *reinterpret_cast<uint2*>(at) = make_uint2(lo, hi);
      }
    }
  }
}
// ---- two MMA warpgroups a CTA (mla_decode_fp8_rs2_program) ----
// P's copies written: visible to the WGMMA (async proxy) of the whole warpgroup
__device__ __forceinline__ void tc_p_ready(int bar) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void tc_bar(int bar, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(bar), "r"(threads) : "memory");
}
// WG1's O^T (4 groups x 16 values a thread) into shared memory in its own register order, value i of thread t at
// float4 [i / 4][t]: WG0's thread t reads the same positions (the same fragment layout), conflict-free
__device__ __forceinline__ void tc_stage_o(void* staging, const float* o0, const float* o1, const float* o2,
                                           const float* o3) {
  float4* st = reinterpret_cast<float4*>(staging);
  const int t = threadIdx.x & 127;
  const float* o[4] = {o0, o1, o2, o3};
#pragma unroll
  for (int g = 0; g < 4; ++g) {
#pragma unroll
    for (int i = 0; i < 4; ++i) st[(g * 4 + i) * 128 + t] = make_float4(o[g][4 * i], o[g][4 * i + 1], o[g][4 * i + 2], o[g][4 * i + 3]);
  }
}
// WG0, column t < 16: the two chains' maxima m[w * 16 + t] and sums l[w * 16 + t] merged into m[t], l[t]; the
// factors that scale each chain's O^T column into the normalized output into fab[t], fab[16 + t]
__device__ __forceinline__ void tc_merge_stats(float* m, float* l, float* fab, int bar) {
  const int t = threadIdx.x & 127;
  if (t < 16) {
    const float m0 = m[t], m1 = m[16 + t], mx = fmaxf(m0, m1);
    const float a = mx == -INFINITY ? 0.f : exp2f(m0 - mx), b = mx == -INFINITY ? 0.f : exp2f(m1 - mx);
    const float sum = l[t] * a + l[16 + t] * b, inv = sum > 0.f ? 1.f / sum : 0.f;
    m[t] = mx, l[t] = sum, fab[t] = a * inv, fab[16 + t] = b * inv;
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
}
// WG0: O = O^T_0 * fab[h] + O^T_1 (staged) * fab[16 + h], stored row-major as tc_store_o does
template <typename OutT>
__device__ __forceinline__ void tc_merge_store(OutT* row0, const float* o0, const float* o1, const float* o2,
                                               const float* o3, const void* staging, const float* fab, int rows) {
  const float4* st = reinterpret_cast<const float4*>(staging);
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, q = lane >> 2, c = lane & 3, t = threadIdx.x & 127;
  const float* o[4] = {o0, o1, o2, o3};
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    float v1[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 x = st[(g * 4 + i) * 128 + t];
      v1[4 * i] = x.x, v1[4 * i + 1] = x.y, v1[4 * i + 2] = x.z, v1[4 * i + 3] = x.w;
    }
#pragma unroll
    for (int hs = 0; hs < 4; ++hs) {
      const int nb = hs >> 1, e = hs & 1, h = 8 * nb + 2 * c + e;
      if (h >= rows) continue;
      const float fa = fab[h], fb = fab[16 + h];
      const int i0 = nb * 4 + e;                                  // (mt, hi) = (0,0) (0,1) (1,0) (1,1): +0 +2 +8 +10
      const float r0 = o[g][i0] * fa + v1[i0] * fb, r1 = o[g][i0 + 2] * fa + v1[i0 + 2] * fb;
      const float r2 = o[g][i0 + 8] * fa + v1[i0 + 8] * fb, r3 = o[g][i0 + 10] * fa + v1[i0 + 10] * fb;
      OutT* at = row0 + h * 512 + g * 128 + 4 * (8 * w + q);
      if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float4*>(at) = make_float4(r0, r1, r2, r3);
      } else {
        unsigned lo, hi;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(r3), "f"(r2));
        *reinterpret_cast<uint2*>(at) = make_uint2(lo, hi);
      }
    }
  }
}
// the warpgroup's column sums and maxima into l_out[row], m_out[row] (shared, 16 each)
__device__ __forceinline__ void tc_softmax_t_finish(const float* m, const float* l, float* red, float* l_out,
                                                    float* m_out, int bar = 9) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, t = threadIdx.x & 127;
  float v[4];
#pragma unroll
  for (int hs = 0; hs < 4; ++hs) v[hs] = l[hs];
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
    for (int hs = 0; hs < 4; ++hs) v[hs] += __shfl_xor_sync(0xFFFFFFFFu, v[hs], off);
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");       // every warp is past its last step's reads of red
  if (lane < 4) *reinterpret_cast<float4*>(red + warp * 16 + lane * 4) = make_float4(v[0], v[1], v[2], v[3]);
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
  if (t < 16) {   // row t: quad place (t % 8) / 2, slot (t / 8) * 2 + t % 2
    const int at = ((t & 7) >> 1) * 4 + (t >> 3) * 2 + (t & 1);
    l_out[t] = red[at] + red[16 + at] + red[32 + at] + red[48 + at];
  }
  if (warp == 0 && lane < 4) {
#pragma unroll
    for (int hs = 0; hs < 4; ++hs) m_out[(hs >> 1) * 8 + 2 * lane + (hs & 1)] = m[hs];
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar) : "memory");
}
// ---- the ring held to the grid's pace (mla_decode_fp8_rs2_program's pace; bench/NOTES.md "Session 40") ----
// counters (int32, zero between launches): [0] the steps whose stage has arrived, [1] the steps of the CTAs that have
// started, both over the CTAs that run: each CTA adds its own and takes them out again as it leaves (no returning
// atomic, no fence: the launch ends with the counters as it found them)
#define TC_PACE_WAIT_CYCLES 4096   // the longest a step is held (~2 us): a stale or foreign count never blocks
// the producer's first warp, at its start: the CTA's steps join the started count (no round trip: the counts
// seen start as (0 arrived, 1 started), which says "wait" at the first step past the slack, and that reads them)
__device__ __forceinline__ void tc_pace_start(int* counters, int* seen, int steps) {
  if ((threadIdx.x & 31) == 0 && steps > 0)
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" :: "l"(counters + 1), "r"(steps) : "memory");
  seen[0] = 0, seen[1] = 1;
}
// the producer's first warp, before issuing step f of its `steps`: wait while the CTA's share issued is more than
// `slack` steps ahead of the grid's share arrived, f / steps > arrived / started + slack / steps (the counts are
// re-read only while the ones seen say so: a stale count only errs towards a read)
__device__ __forceinline__ void tc_pace(const int* counters, int* seen, int f, int steps, int slack) {
  if ((threadIdx.x & 31) == 0) {
    long long arrived = seen[0], started = seen[1];
    const long long t0 = clock64();
    while (static_cast<long long>(f - slack) * started > arrived * steps && clock64() - t0 < TC_PACE_WAIT_CYCLES) {
      int a, b;
      asm volatile("ld.relaxed.gpu.global.v2.s32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(counters) : "memory");
      seen[0] = a, seen[1] = b, arrived = a, started = b;
      __nanosleep(128);
    }
  }
  __syncwarp();
}
// a chain's thread 0, once a stage has arrived
__device__ __forceinline__ void tc_pace_count(int* counters) {
  if ((threadIdx.x & 127) == 0) asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" :: "l"(counters) : "memory");
}
// chain 0's thread 0, last: the CTA's steps out of both counts (its chains counted all `steps` of them)
__device__ __forceinline__ void tc_pace_exit(int* counters, int steps) {
  if ((threadIdx.x & 127) == 0 && steps > 0) {
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" :: "l"(counters), "r"(-steps) : "memory");
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" :: "l"(counters + 1), "r"(-steps) : "memory");
  }
}
"""


def q_column(k):
    """The latent query column (within a group) at fragment K index k of tc_e4m3_k_fragment's order."""
    j, u, c, e = k // 16, k % 16 // 8, k % 8 // 2, k % 2
    return 32 * c + 4 * j + 2 * u + e


def latent_column(d):
    """The latent column (within a group) of V^T's fragment row d (tc_e4m3_v_fragment's M order)."""
    return (d % 64 // 16 * 8 + d % 8) * 4 + d // 64 * 2 + d % 16 // 8


def _scale_rows(ks_s, slot, page=False):
    """The step's 64 x 4 scale rows: ks_s (T.Pipelined's current stage) or ks_s[slot]; page (rs2's stage="page"):
    byte 512 of the stage's token 0 (ks_s is the stage ring). (Access pointers are built where they are used: one
    passed into a macro becomes a variable bound at the macro's entry, and T.Pipelined then releases the stage
    there.)"""
    if page:
        return T.access_ptr(ks_s[slot, 0, D_V], "r", STEP * TOKEN_BYTES - D_V)
    return T.access_ptr(ks_s[0, 0] if slot is None else ks_s[slot, 0, 0], "r", STEP * GROUPS)


def _raw_tile(kl_s, slot, g, page=False):
    """Group g's 64 x 128 raw tile: kl_s[g] (T.Pipelined's current stage) or kl_s[slot, g] (a stage ring); page:
    byte 128 g of the stage's token 0 (kl_s[slot]: 64 tokens x 656 bytes as the cache holds them)."""
    if page:
        return T.access_ptr(kl_s[slot, 0, g * GROUP], "r", STEP * TOKEN_BYTES - g * GROUP)
    return T.access_ptr(kl_s[g, 0, 0] if slot is None else kl_s[slot, g, 0, 0], "r", STEP * GROUP)


def _page_variant(name, page):
    """The helper's name, or its instance for stages that hold the cache's token rows (tc_lat's PAGE = 1)."""
    return f"{name}<1>" if page else name


@T.macro
def _k_fill(kl_s, slot, g, a_k, page=False):
    tid = T.get_thread_binding() % 128
    T.evaluate(T.call_extern("handle", _page_variant("tc_e4m3_k_fragment", page), a_k.data,
                             _raw_tile(kl_s, slot, g, page), tid // 32 * 16 + tid % 32 // 4, tid % 4))


@T.macro
def _v_fill(kl_s, slot, g, a_v, page=False):
    tid = T.get_thread_binding() % 128
    T.evaluate(T.call_extern("handle", _page_variant("tc_e4m3_v_fragment", page), a_v.data,
                             _raw_tile(kl_s, slot, g, page), tid // 4, tid % 4))


@T.macro
def _fold(g, acc, s_t, ks_t):
    T.evaluate(T.call_extern("handle", "tc_fold", s_t.data, acc.data, ks_t.data, g))


@T.macro
def _k_phase(kl_s, ks_s, slot, ql_s, a_k0, a_k1, acc0, acc1, s_t, ks_t, a_k2=None, page=False):
    # S^T += the four groups' K Q^T (after the rope's MMA), on two fragments in turn, each folded with its scales;
    # a_k2 (rs2's third_fragment "k"): group 2's fill does not wait for group 0's MMA, group 3's for group 1's
    _k_fill(kl_s, slot, 0, a_k0, page)
    T.wgmma_gemm(a_k0, ql_s[0, :, :], acc0, transpose_B=True, clear_accum=True)
    _k_fill(kl_s, slot, 1, a_k1, page)
    T.wgmma_gemm(a_k1, ql_s[1, :, :], acc1, transpose_B=True, clear_accum=True)
    if a_k2 is not None:
        _k_fill(kl_s, slot, 2, a_k2, page)
    T.wait_wgmma(1)                                 # the rope's and group 0's
    T.evaluate(T.call_extern("handle", _page_variant("tc_token_scales", page), _scale_rows(ks_s, slot, page),
                             ks_t.data))
    _fold(0, acc0, s_t, ks_t)
    if a_k2 is None:
        _k_fill(kl_s, slot, 2, a_k0, page)
        T.wgmma_gemm(a_k0, ql_s[2, :, :], acc0, transpose_B=True, clear_accum=True)
    else:
        T.wgmma_gemm(a_k2, ql_s[2, :, :], acc0, transpose_B=True, clear_accum=True)
        _k_fill(kl_s, slot, 3, a_k0, page)
    T.wait_wgmma(1)
    _fold(1, acc1, s_t, ks_t)
    if a_k2 is None:
        _k_fill(kl_s, slot, 3, a_k1, page)
        T.wgmma_gemm(a_k1, ql_s[3, :, :], acc1, transpose_B=True, clear_accum=True)
    else:
        T.wgmma_gemm(a_k0, ql_s[3, :, :], acc1, transpose_B=True, clear_accum=True)
    T.wait_wgmma(1)
    _fold(2, acc0, s_t, ks_t)
    T.wait_wgmma(0)
    _fold(3, acc1, s_t, ks_t)


@T.macro
def _v_phase(kl_s, slot, p_s, w, a_v0, a_v1, o0, o1, o2, o3, empty, a_v2=None, page=False):
    # O^T += V^T (P * scale_g)^T, the four groups on two fragments in turn (p_s[g], or p_s[w, g] per chain);
    # with a stage ring, empty[slot] is arrived on once the slot's last words are read; a_v2 (rs2's
    # third_fragment "v"): group 2 on its own fragment, group 3 into group 0's once its MMA is done
    _v_fill(kl_s, slot, 0, a_v0, page)
    T.wgmma_gemm(a_v0, p_s[0, :, :] if w is None else p_s[w, 0, :, :], o0, transpose_B=True)
    _v_fill(kl_s, slot, 1, a_v1, page)
    T.wgmma_gemm(a_v1, p_s[1, :, :] if w is None else p_s[w, 1, :, :], o1, transpose_B=True)
    if a_v2 is None:
        T.wait_wgmma(1)
        _v_fill(kl_s, slot, 2, a_v0, page)
        T.wgmma_gemm(a_v0, p_s[2, :, :] if w is None else p_s[w, 2, :, :], o2, transpose_B=True)
        T.wait_wgmma(1)
    else:
        _v_fill(kl_s, slot, 2, a_v2, page)
        T.wgmma_gemm(a_v2, p_s[2, :, :] if w is None else p_s[w, 2, :, :], o2, transpose_B=True)
        T.wait_wgmma(2)
    _v_fill(kl_s, slot, 3, a_v1 if a_v2 is None else a_v0, page)      # (no local name: it would rename the fragment)
    if empty is not None:
        T.mbarrier_arrive(empty[slot])
    T.wgmma_gemm(a_v1 if a_v2 is None else a_v0, p_s[3, :, :] if w is None else p_s[w, 3, :, :], o3, transpose_B=True)


@T.macro
def _load_query(Q, bi, rows, ql_s, qr_s):
    # Q^T's latent in fp16 with its columns permuted (q_column), its rope in bf16; rows past s_q * h_q zero
    for g, h, k in T.Parallel(GROUPS, ROWS, GROUP):
        ql_s[g, h, k] = T.if_then_else(h < rows, T.cast(Q[bi, T.min(h, rows - 1), g * GROUP + q_column(k)],
                                                        "float16"), T.cast(0, "float16"))
    for h, j in T.Parallel(ROWS, D_ROPE):
        qr_s[h, j] = T.if_then_else(h < rows, Q[bi, T.min(h, rows - 1), D_V + j], T.cast(0, "bfloat16"))


def _split_range(si, splits, nblk, older_64ths=32):
    """(first step, steps) of split si of a sequence of nblk steps in `splits` even chunks; older_64ths != 32:
    split 0 of a 2-split sequence takes older_64ths / 64 of the steps (mla_decode_fp8_rs_program)."""
    chunk = T.ceildiv(nblk, T.max(splits, 1))
    first = si * chunk
    n_iter = T.if_then_else(si < splits, T.max(T.min(nblk, first + chunk) - first, 0), 0)
    if older_64ths != 32:
        n0 = T.min(T.max((nblk * older_64ths + 32) // 64, 1), T.max(nblk - 1, 0))    # 0 <= n0 <= nblk
        first = T.if_then_else(splits == 2, si * n0, first)
        n_iter = T.if_then_else(splits == 2, T.if_then_else(si == 0, n0, T.if_then_else(si == 1, nblk - n0, 0)),
                                n_iter)
    return first, n_iter


def _check_shape(name, rows, page, dtype):
    if rows > ROWS:
        raise ValueError(f"{name} takes at most {ROWS} query rows (s_q * h_q), got {rows}")
    if page < STEP or page % STEP:
        raise ValueError(f"{name} steps 64 tokens inside one page: page must be a multiple of 64, got {page}")
    if dtype != "bfloat16":
        raise ValueError(f"the FP8 cache's rope is bf16: the query must be bfloat16, got {dtype}")


@tile_program(
    "mla_decode_fp8_rs",
    targets=("cuda:sm_90a",),
    examples={"h16": dict(h_q=16, s_q=1), "h8-s2": dict(h_q=8, s_q=2)},
)
def mla_decode_fp8_rs_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                              stages: int = 2, blocks_per_sm: int = 2, trace: bool = False, older_64ths: int = 32):
    """The FP8-cache MLA decode with register-converted cache operands (this module's docstring), the
    op's arguments and outputs: mla_decode_program's with kv_format="fp8".

    older_64ths (experiment, bench/NOTES.md "Session 36"; 32 = off): with two CTAs an SM the warp schedulers
    favour the older CTA, which ends its steps ~8% sooner. Other values order the grid split-major (every
    sequence's split 0 is dispatched in the first wave, so it is the older CTA on its SM) and give split 0
    of a 2-split sequence older_64ths / 64 of its steps (rounded; at least one step each side where it has two).

    trace=True (bench.trace_mla_rs): CTA 0 writes the SM clock (int32 bits) of each of TRACE_EVENTS of its
    first TRACE_STEPS steps into OPart[0, TRACE_ROW], 8 words a step, and CTA i its span (tc_span) into
    OPart[i, SPAN_ROW, 0:8]; OPart needs batch * max_splits slots then."""
    rows = s_q * h_q
    _check_shape("mla_decode_fp8_rs", rows, page, dtype)
    if blocks_per_sm not in (1, 2):
        raise ValueError(f"blocks_per_sm must be 1 or 2, got {blocks_per_sm}")
    if not 1 <= older_64ths <= 63:
        raise ValueError(f"older_64ths must be in [1, 63] (32: even splits), got {older_64ths}")
    causal = causal and s_q > 1
    batch, num_pages, max_blocks, slots = T.dynamic("batch, num_pages, max_blocks, slots")
    neg_inf = -T.infinity("float32")

    @T.prim_func
    def mla_decode_fp8_rs(
        Q: T.Tensor((batch, rows, D_QK), "bfloat16"),
        KV: T.Tensor((num_pages, page, TOKEN_BYTES), "float8_e4m3fn"),
        KVf: T.Tensor((num_pages, page, TOKEN_BYTES // 4), "float32"),
        KVh: T.Tensor((num_pages, page, TOKEN_BYTES // 2), "bfloat16"),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), "bfloat16"),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, ROWS_PAD, D_V), "float32"),
        LsePart: T.Tensor((slots, ROWS_PAD), "float32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(batch * max_splits, threads=128) as bid:
            if blocks_per_sm == 2:
                T.annotate_min_blocks_per_sm(2)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(MMA_REGS)
            ql_s = T.alloc_shared((GROUPS, ROWS, GROUP), "float16")    # Q^T's latent, fp16, columns permuted
            qr_s = T.alloc_shared((ROWS, D_ROPE), "bfloat16")
            kl_s = T.alloc_shared((GROUPS, STEP, GROUP), "float8_e4m3fn")
            ks_s = T.alloc_shared((STEP, GROUPS), "float32")
            kr_s = T.alloc_shared((STEP, D_ROPE), "bfloat16")
            p_s = T.alloc_shared((GROUPS, ROWS, STEP), "float16")      # P * scale_g, one copy per group
            red = T.alloc_shared((128,), "float32")                    # the warps' column maxima, two parities
            l_s = T.alloc_shared((ROWS,), "float32")
            m_s = T.alloc_shared((ROWS,), "float32")
            a_k0 = T.alloc_fragment((STEP, GROUP), "float16")
            a_k1 = T.alloc_fragment((STEP, GROUP), "float16")
            a_v0 = T.alloc_fragment((GROUP, STEP), "float16")
            a_v1 = T.alloc_fragment((GROUP, STEP), "float16")
            acc0 = T.alloc_fragment((STEP, ROWS), "float32")
            acc1 = T.alloc_fragment((STEP, ROWS), "float32")
            s_t = T.alloc_fragment((STEP, ROWS), "float32")
            o0 = T.alloc_fragment((GROUP, ROWS), "float32")
            o1 = T.alloc_fragment((GROUP, ROWS), "float32")
            o2 = T.alloc_fragment((GROUP, ROWS), "float32")
            o3 = T.alloc_fragment((GROUP, ROWS), "float32")
            m_t = T.alloc_local((4,), "float32")          # this thread's 4 query-row columns (slots)
            l_t = T.alloc_local((4,), "float32")
            ks_t = T.alloc_local((8,), "float32")        # this thread's two tokens' 4 group scales
            alpha_t = T.alloc_local((4,), "float32")
            T.annotate_layout({kl_s: make_full_bank_swizzled_layout(kl_s), p_s: make_full_bank_swizzled_layout(p_s)})
            T.import_source(HELPER_SOURCE)

            if trace:
                T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 0, 0))
            bi = bid // max_splits if older_64ths == 32 else bid % batch
            si = bid % max_splits if older_64ths == 32 else bid // batch
            splits = Splits[bi]
            seqlen = SeqLens[bi]
            nblk = T.ceildiv(seqlen, STEP)
            first, n_iter = _split_range(si, splits, nblk, older_64ths)
            base = seqlen - s_q + 1 if causal else seqlen

            _load_query(Q, bi, rows, ql_s, qr_s)
            T.fill(o0, 0.0)
            T.fill(o1, 0.0)
            T.fill(o2, 0.0)
            T.fill(o3, 0.0)
            for i in T.serial(4):
                m_t[i] = neg_inf
                l_t[i] = 0.0

            if trace:
                T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 1, 0))
            for k in T.Pipelined(n_iter, num_stages=stages):
                blk = first + k
                pidx = T.min(T.max(BlockTable[bi, blk * STEP // page], 0), num_pages - 1)
                off = blk * STEP % page
                T.copy(KV[pidx, off:off + STEP, 0:GROUP], kl_s[0, :, :])
                T.copy(KV[pidx, off:off + STEP, GROUP:2 * GROUP], kl_s[1, :, :])
                T.copy(KV[pidx, off:off + STEP, 2 * GROUP:3 * GROUP], kl_s[2, :, :])
                T.copy(KV[pidx, off:off + STEP, 3 * GROUP:4 * GROUP], kl_s[3, :, :])
                T.copy(KVf[pidx, off:off + STEP, SCALE_WORD:SCALE_WORD + GROUPS], ks_s)
                T.copy(KVh[pidx, off:off + STEP, ROPE_HALF:ROPE_HALF + D_ROPE], kr_s)
                valid = seqlen - blk * STEP
                if valid < STEP:
                    T.evaluate(T.call_extern("handle", "tc_zero_tail", T.access_ptr(kl_s[0, 0, 0], "r", GROUPS * STEP * GROUP),
                                             T.access_ptr(ks_s[0, 0], "r", STEP * GROUPS), valid))
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 0))
                # S^T: the rope's MMA, then the four groups on two fragments in turn
                T.wgmma_gemm(kr_s, qr_s, s_t, transpose_B=True, clear_accum=True)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 1))
                _k_phase(kl_s, ks_s, None, ql_s, a_k0, a_k1, acc0, acc1, s_t, ks_t)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 2))
                T.evaluate(T.call_extern("handle", "tc_mask_t", s_t.data, blk * STEP, base, h_q, int(causal)))
                T.evaluate(T.call_extern("handle", "tc_softmax_t", s_t.data, m_t.data, l_t.data, alpha_t.data,
                                         # ("r": TileLang then adds no barriers around the call; the
                                         # helper orders its own accesses with its named barrier)
                                         T.access_ptr(red[0], "r", 128), k % 2, scale_log2))
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 3))
                for g in range(GROUPS):
                    T.evaluate(T.call_extern("handle", "tc_p_store", T.access_ptr(p_s[0, 0, 0], "w", GROUPS * ROWS * STEP),
                                             s_t.data, ks_t.data, g))
                T.evaluate(T.call_extern("handle", "tc_rescale_all_t", o0.data, o1.data, o2.data, o3.data, alpha_t.data))
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 4))
                _v_phase(kl_s, None, p_s, None, a_v0, a_v1, o0, o1, o2, o3, None)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 5))
                T.wait_wgmma(0)
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, 6))

            if trace:
                T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 2, 0))
            T.evaluate(T.call_extern("handle", "tc_softmax_t_finish", m_t.data, l_t.data,
                                     T.access_ptr(red[0], "rw", 128), T.access_ptr(l_s[0], "w", ROWS),
                                     T.access_ptr(m_s[0], "w", ROWS)))
            if si < splits:
                if splits == 1:
                    for h in T.Parallel(ROWS):
                        if h < rows:
                            Lse[bi, h % h_q, h // h_q] = T.if_then_else(l_s[h] > 0.0, (m_s[h] + T.log2(l_s[h])) * LN2,
                                                                        neg_inf)
                    T.evaluate(T.call_extern("handle", "tc_store_o", T.access_ptr(Out[bi, 0, 0], "w", rows * D_V),
                                             o0.data, o1.data, o2.data, o3.data, T.access_ptr(l_s[0], "r", ROWS), rows))
                else:
                    slot = bi * max_splits + si
                    for h in T.Parallel(ROWS):
                        LsePart[slot, h] = T.if_then_else(l_s[h] > 0.0, m_s[h] + T.log2(l_s[h]), neg_inf)
                    T.evaluate(T.call_extern("handle", "tc_store_o", T.access_ptr(OPart[slot, 0, 0], "w", ROWS * D_V),
                                             o0.data, o1.data, o2.data, o3.data, T.access_ptr(l_s[0], "r", ROWS), ROWS))
            if trace:
                T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 3, n_iter))

    return mla_decode_fp8_rs


# ---- two MMA warpgroups a CTA on alternate steps (built, CPU-checked; bench/NOTES.md "Session 36") ----------------

RS2_STAGES = 4
RS2_REGS, RS2_PRODUCER_REGS = 224, 56       # 128 x (2 x 224 + 56) <= 64K registers
# named barriers (TileLang's own sync pass is off for this program): per chain w the softmax 9 + w, the tail
# zeroing 11 + w, P ready 13 + w; both chains 15
RS2_BAR_SOFTMAX, RS2_BAR_TAIL, RS2_BAR_P, RS2_BAR_BOTH = 9, 11, 13, 15
# pace: a CTA's producer holds its next stage while the CTA's share of its steps issued is more than this many steps
# ahead of the grid's share taken by the chains (tc_pace): the SMs that the DRAM serves first are held to the
# average, and the ones it serves last get what they leave, so the CTAs end closer together. bench/NOTES.md
# "Session 40": at b = 128 x 4096, -3.4% while an L2 of dirty lines is written back during the kernel (slack 2
# best; 1 and 3-4 worse), no change on a clean L2 (the bench's condition). 0: off.
RS2_PACE = 2
# K's four groups on three register fragments (groups 2 and 3 filled without waiting for an MMA; 0 spills): on a
# clean L2, -0.7 to -1.3% at b = 128 / 64 (bench/NOTES.md "Session 41"); None: two fragments, as before
RS2_THIRD_FRAGMENT = "k"
# how a stage is loaded: "boxes", six 2-D TMA boxes (the four latent groups and the rope 128 bytes wide at the
# token's 656-byte stride, 128-byte swizzled, and the scales), or "page", the step's 41,984 contiguous bytes in
# bulk copies, the fills reading the token rows as they are (tc_lat). bench/NOTES.md "Session 41": the boxes cost a
# compute-free stream ~7% (82.9 -> 89.2-89.8 us at 128 x 64 steps); "page" is the op's kernel 2.5-3.3% faster
# (interleaved A/B through the op, clean L2), the same bits
RS2_STAGE = "page"


def _rs2_fragments():
    return (T.alloc_fragment((STEP, GROUP), "float16"), T.alloc_fragment((STEP, GROUP), "float16"),
            T.alloc_fragment((GROUP, STEP), "float16"), T.alloc_fragment((GROUP, STEP), "float16"),
            T.alloc_fragment((STEP, ROWS), "float32"), T.alloc_fragment((STEP, ROWS), "float32"),
            T.alloc_fragment((STEP, ROWS), "float32"),
            T.alloc_fragment((GROUP, ROWS), "float32"), T.alloc_fragment((GROUP, ROWS), "float32"),
            T.alloc_fragment((GROUP, ROWS), "float32"), T.alloc_fragment((GROUP, ROWS), "float32"),
            T.alloc_local((4,), "float32"), T.alloc_local((4,), "float32"), T.alloc_local((4,), "float32"),
            T.alloc_local((8,), "float32"))


def _rs2_stamp(OPart, k, e):
    # trace: CTA 0's SM clock at event e of step k (RS2_TRACE_EVENTS); the chains' steps are disjoint
    if OPart is not None:
        T.evaluate(T.call_extern("handle", "tc_stamp", T.access_ptr(OPart[0, TRACE_ROW, 0], "w", 8 * TRACE_STEPS), k, e))


RS2_TRACE_EVENTS = ("wait", "data", "scores", "P ready", "P V done")


def _staging(kl_s, raw):
    """Where WG1 stages its O^T for the merge (32 KB): stage 0 of the ring (free once both chains' loops are done)."""
    return T.access_ptr(kl_s[0, 0, 0] if raw else kl_s[0, 0, 0, 0], "r", GROUPS * STEP * GROUP)


def _compute_unless_streaming(probe, seqlen):
    """True, or for probe "stream" a condition that never holds at run time (the fragments keep their layouts)."""
    return seqlen < 0 if probe == "stream" else True


@T.macro
def _rs2_chain(w, n_iter, first, seqlen, base, h_q, causal, scale_log2, ql_s, qr_s, kl_s, ks_s, kr_s, p_s, red, l_s,
               m_s, full, empty, a_k0, a_k1, a_v0, a_v1, acc0, acc1, s_t, o0, o1, o2, o3, m_t, l_t, alpha_t, ks_t,
               OPart=None, Pace=None, a_k2=None, a_v2=None, probe=None, a_r=None):
    T.set_max_nreg(RS2_REGS, 1)
    T.fill(o0, 0.0)
    T.fill(o1, 0.0)
    T.fill(o2, 0.0)
    T.fill(o3, 0.0)
    for i in T.serial(4):
        m_t[i] = -T.infinity("float32")
        l_t[i] = 0.0
    for j in T.serial((n_iter + 1 - w) // 2):
        k = 2 * j + w
        slot = k % RS2_STAGES
        parity = (k // RS2_STAGES) % 2
        _rs2_stamp(OPart, k, 0)
        T.mbarrier_wait_parity(full[slot], parity)        # the stage: rope, scales and the four groups
        if Pace is not None:
            T.evaluate(T.call_extern("handle", "tc_pace_count", T.access_ptr(Pace[0], "rw", 2)))
        _rs2_stamp(OPart, k, 1)
        if probe is not None:             # timing probes (mla_decode_fp8_rs2_program's probe): wrong outputs
            T.mbarrier_arrive(empty[slot])
        blk = first + k
        valid = seqlen - blk * STEP
        if valid < STEP:
            if a_r is None:
                T.evaluate(T.call_extern("handle", "tc_zero_tail", T.access_ptr(kl_s[slot, 0, 0, 0], "r", GROUPS * STEP * GROUP),
                                         T.access_ptr(ks_s[slot, 0, 0], "r", STEP * GROUPS), valid, RS2_BAR_TAIL + w))
            else:
                T.evaluate(T.call_extern("handle", "tc_zero_tail<1>", T.access_ptr(kl_s[slot, 0, 0], "r", STEP * TOKEN_BYTES),
                                         T.access_ptr(kl_s[slot, 0, 0], "r", STEP * TOKEN_BYTES), valid, RS2_BAR_TAIL + w))
        if _compute_unless_streaming(probe, seqlen):
            if a_r is None:
                T.wgmma_gemm(kr_s[slot, :, :], qr_s, s_t, transpose_B=True, clear_accum=True)
            else:                       # stage="page": the rope from the stage's token rows into registers
                tid = T.get_thread_binding() % 128
                T.evaluate(T.call_extern("handle", "tc_rope_fragment", a_r.data,
                                         T.access_ptr(kl_s[slot, 0, D_V + 16], "r", STEP * TOKEN_BYTES - D_V - 16),
                                         tid // 32 * 16 + tid % 32 // 4, tid % 4))
                T.wgmma_gemm(a_r, qr_s, s_t, transpose_B=True, clear_accum=True)
            _k_phase(kl_s, ks_s, slot, ql_s, a_k0, a_k1, acc0, acc1, s_t, ks_t, a_k2=a_k2, page=a_r is not None)
            _rs2_stamp(OPart, k, 2)
            T.evaluate(T.call_extern("handle", "tc_mask_t", s_t.data, blk * STEP, base, h_q, int(causal)))
            T.evaluate(T.call_extern("handle", "tc_softmax_t", s_t.data, m_t.data, l_t.data, alpha_t.data,
                                     T.access_ptr(red[w, 0], "r", 128), j % 2, scale_log2, RS2_BAR_SOFTMAX + w))
            for g in range(GROUPS):
                T.evaluate(T.call_extern("handle", "tc_p_store", T.access_ptr(p_s[w, 0, 0, 0], "r", GROUPS * ROWS * STEP),
                                         s_t.data, ks_t.data, g))
            T.evaluate(T.call_extern("handle", "tc_p_ready", RS2_BAR_P + w))
            _rs2_stamp(OPart, k, 3)
            T.evaluate(T.call_extern("handle", "tc_rescale_all_t", o0.data, o1.data, o2.data, o3.data, alpha_t.data))
            _v_phase(kl_s, slot, p_s, w, a_v0, a_v1, o0, o1, o2, o3, empty if probe is None else None, a_v2=a_v2,
                     page=a_r is not None)
            T.wait_wgmma(0)
        _rs2_stamp(OPart, k, 4)
    T.evaluate(T.call_extern("handle", "tc_softmax_t_finish", m_t.data, l_t.data, T.access_ptr(red[w, 0], "r", 128),
                             T.access_ptr(l_s[w, 0], "r", ROWS), T.access_ptr(m_s[w, 0], "r", ROWS),
                             RS2_BAR_SOFTMAX + w))


def _rs2_page(BlockTable, bi, blk, page, max_blocks, num_pages):
    """The page (clamped into the pool) of 64-token block blk of sequence bi (its first row: blk * STEP % page)."""
    return T.min(T.max(BlockTable[bi, T.min(blk * STEP // page, max_blocks - 1)], 0), num_pages - 1)


@T.macro
def _rs2_issue(KV, KVf, KVh, kl_s, ks_s, kr_s, full, slot, pidx, off, page=False):
    # one stage on one barrier, full[slot]: the rope, the scales and the four latent groups (a barrier a group,
    # each waited for just before its fill, measured 1.5% slower: bench/NOTES.md "Session 38"); page: the 64
    # tokens' 41,984 contiguous bytes as they are (tc_bulk_page)
    if page:
        T.evaluate(T.call_extern("handle", "tc_bulk_page", T.access_ptr(kl_s[slot, 0, 0], "w", STEP * TOKEN_BYTES),
                                 T.access_ptr(KV[pidx, off, 0], "r", STEP * TOKEN_BYTES), full[slot]))
    else:
        T.tma_copy(KVh[pidx, off:off + STEP, ROPE_HALF:ROPE_HALF + D_ROPE], kr_s[slot, :, :], barrier=full[slot])
        T.tma_copy(KVf[pidx, off:off + STEP, SCALE_WORD:SCALE_WORD + GROUPS], ks_s[slot, :, :], barrier=full[slot])
        for g in range(GROUPS):
            T.tma_copy(KV[pidx, off:off + STEP, g * GROUP:(g + 1) * GROUP], kl_s[slot, g, :, :], barrier=full[slot])
    T.mbarrier_arrive(full[slot])


@T.macro
def _rs2_lse(Lse, LsePart, m_buf, m_row, l_buf, l_row, bi, si, max_splits, rows, h_q, part):
    # the merged lse of the CTA's rows (m, l in log2 units; l = 0: -inf), into Lse (one split) or LsePart (part)
    if not part:
        for h in T.Parallel(ROWS):
            if h < rows:
                Lse[bi, h % h_q, h // h_q] = T.if_then_else(l_buf[l_row, h] > 0.0,
                                                            (m_buf[m_row, h] + T.log2(l_buf[l_row, h])) * LN2,
                                                            -T.infinity("float32"))
    else:
        for h in T.Parallel(ROWS):
            LsePart[bi * max_splits + si, h] = T.if_then_else(l_buf[l_row, h] > 0.0,
                                                              m_buf[m_row, h] + T.log2(l_buf[l_row, h]),
                                                              -T.infinity("float32"))


@T.macro
def _rs2_epilogue_0(OPart, Pace, Lse, LsePart, Out, kl_s, m_s, l_s, fab, frags, n_iter, bid, bi, si, splits,
                    max_splits, rows, h_q, raw, trace, pace):
    # WG0 after its loop: the merge with WG1 (all of WG1's O^T staged, merged and stored here), the lse, the exit
    if trace:
        T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 2, 0))
    o0, o1, o2, o3 = frags[7:11]
    T.evaluate(T.call_extern("handle", "tc_bar", RS2_BAR_BOTH, 256))     # both chains' loops are done
    T.evaluate(T.call_extern("handle", "tc_bar", RS2_BAR_BOTH, 256))     # WG1's O^T is staged
    T.evaluate(T.call_extern("handle", "tc_merge_stats", T.access_ptr(m_s[0, 0], "r", 2 * ROWS),
                             T.access_ptr(l_s[0, 0], "r", 2 * ROWS), T.access_ptr(fab[0], "r", 2 * ROWS),
                             RS2_BAR_SOFTMAX))
    if si < splits:
        if splits == 1:
            _rs2_lse(Lse, LsePart, m_s, 0, l_s, 0, bi, si, max_splits, rows, h_q, False)
            T.evaluate(T.call_extern("handle", "tc_merge_store", T.access_ptr(Out[bi, 0, 0], "w", rows * D_V),
                                     o0.data, o1.data, o2.data, o3.data, _staging(kl_s, raw),
                                     T.access_ptr(fab[0], "r", 2 * ROWS), rows))
        else:
            _rs2_lse(Lse, LsePart, m_s, 0, l_s, 0, bi, si, max_splits, rows, h_q, True)
            T.evaluate(T.call_extern("handle", "tc_merge_store",
                                     T.access_ptr(OPart[bi * max_splits + si, 0, 0], "w", ROWS * D_V),
                                     o0.data, o1.data, o2.data, o3.data, _staging(kl_s, raw),
                                     T.access_ptr(fab[0], "r", 2 * ROWS), ROWS))
    if trace:
        T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 3, n_iter))
    if pace:
        T.evaluate(T.call_extern("handle", "tc_pace_exit", T.access_ptr(Pace[0], "rw", 2), n_iter))


@T.macro
def _rs2_epilogue_1(kl_s, frags, raw):
    # WG1 after its loop: all of its O^T staged for WG0
    T.evaluate(T.call_extern("handle", "tc_bar", RS2_BAR_BOTH, 256))     # both chains' loops are done
    T.evaluate(T.call_extern("handle", "tc_stage_o", _staging(kl_s, raw),
                             frags[7].data, frags[8].data, frags[9].data, frags[10].data))
    T.evaluate(T.call_extern("handle", "tc_bar", RS2_BAR_BOTH, 256))


@T.macro
def _rs2_produce(KV, KVf, KVh, kl_s, ks_s, kr_s, full, empty, BlockTable, bi, first, n_iter, page, max_blocks, num_pages,
                 tx, Pace, pace_seen, pace, raw):
    # the producer warpgroup past the ring's first stages: each stage once its slot is free (held to the grid's
    # pace first when pace > 0)
    T.set_max_nreg(RS2_PRODUCER_REGS, 0)
    for k in T.serial(T.max(n_iter - RS2_STAGES, 0)):
        kk = k + RS2_STAGES
        pidx = _rs2_page(BlockTable, bi, first + kk, page, max_blocks, num_pages)   # before the wait
        if pace and tx < 288:       # the warp whose elected thread issues the stage
            T.evaluate(T.call_extern("handle", "tc_pace", T.access_ptr(Pace[0], "r", 2), pace_seen.data,
                                     kk, n_iter, pace))
        T.mbarrier_wait_parity(empty[kk % RS2_STAGES], ((kk // RS2_STAGES) % 2) ^ 1)
        _rs2_issue(KV, KVf, KVh, kl_s, ks_s, kr_s, full, kk % RS2_STAGES, pidx, (first + kk) * STEP % page, raw)


@tile_program(
    "mla_decode_fp8_rs2",
    targets=("cuda:sm_90a",),
    examples={"h16": dict(h_q=16, s_q=1)},
    pass_configs=lambda t, params: {"tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                                      "tl.disable_safe_memory_legalize": True},
)
def mla_decode_fp8_rs2_program(h_q: int, s_q: int, page: int = 64, dtype: str = "bfloat16", causal: bool = True,
                               trace: bool = False, pace: int = RS2_PACE,
                               third_fragment: str | None = RS2_THIRD_FRAGMENT, probe: str | None = None,
                               stage: str = RS2_STAGE):
    """mla_decode_fp8_rs_program's kernel with two MMA warpgroups in one CTA taking alternate 64-token steps of
    the CTA's range from one ring of RS2_STAGES stages (one producer warpgroup), each with its own running max,
    sums and O^T, merged at the end (WG1's O^T through the freed stages). Two chains an SM as with two CTAs, but
    they cannot drift apart by more than the ring (two CTAs: the older ends ~8% sooner), the query is loaded
    once, and one CTA an SM means fewer splits (b = 128: none, no combine). Same arguments and outputs.
    trace=True (bench.trace_mla_rs --rs2): CTA 0 stamps RS2_TRACE_EVENTS of its first TRACE_STEPS steps (both
    chains) into OPart[0, TRACE_ROW], and every CTA its span (chain 0's loop) into OPart[bid, SPAN_ROW]; OPart needs
    batch * max_splits slots then. The op's FP8 kernel at <= 16 rows (bench/NOTES.md "Session 38": ~2340 cycles
    a step an SM against ~2170 of DRAM share at b = 128, without the two-CTA kernel's splits, combine and
    older/younger imbalance).
    pace > 0 (RS2_PACE): the ring is held to the grid's pace (tc_pace) through Pace, two int32 counters that are
    0 at the launch and that the launch leaves as it found them (ops._workspace.arrival_counters); it changes
    when stages are issued, never what is computed (bitwise the same as pace=0).
    stage ("page": RS2_STAGE, the op's; "boxes"): how the producer fills a stage, one bulk copy of the step's 64
    tokens as the cache holds them (the fills read 656-byte token rows, the rope through registers), or six 2-D
    TMA boxes into 128-byte-swizzled tiles (2.5-3.3% slower on a clean L2; the same bits).
    third_fragment ("k": RS2_THIRD_FRAGMENT, the op's; None, "v", "kv"): that phase's four groups on three register
    fragments instead of two (groups 2 and 3 filled without waiting for an MMA; session 39's change 2, measured on a
    clean L2 in session 41: "k" -0.7 to -1.3%, "v" -0.1 to -0.6%); None is the two-fragment kernel.
    Measured and removed (bench/NOTES.md "Session 39", "Session 41", "Session 42"): a running max allowed to lag
    behind the scores (lag), the query by one bulk copy ahead of the stages (q_copy), each chain merging half of O
    from its own last stage (merge="split"), 64-bit WGMMA descriptor adds (desc_add), both chains in one loop body
    (one_body): none faster by 1%; in session 43, a CTA's last stages issued without the pace's hold (pace_tail):
    no gain, and CTA 0's last data waits were short with the hold or without.
    probe (None: the op's; timing probes that compute wrong outputs, for bench.ab_mla_rs2 only): "release" frees each
    stage as soon as it arrives (the ring's bytes in flight without the chains' hold; the chains then read a
    stage the producer may be refilling), "stream" also skips the chains' MMAs and softmax (the kernel's own
    stream, prologue and epilogue)."""
    if pace < 0:
        raise ValueError(f"mla_decode_fp8_rs2: pace is a number of steps >= 0 (0: off), got {pace}")
    rows = s_q * h_q
    _check_shape("mla_decode_fp8_rs2", rows, page, dtype)
    if stage not in ("boxes", "page"):
        raise ValueError(f"mla_decode_fp8_rs2: stage must be 'boxes' or 'page', got {stage!r}")
    raw = stage == "page"
    if probe not in (None, "release", "stream"):
        raise ValueError(f"mla_decode_fp8_rs2: probe must be None, 'release' or 'stream', got {probe!r}")
    if third_fragment not in (None, "k", "v", "kv"):
        raise ValueError(f"mla_decode_fp8_rs2: third_fragment must be None, 'k', 'v' or 'kv', got {third_fragment!r}")
    causal = causal and s_q > 1
    batch, num_pages, max_blocks, slots, counters = T.dynamic("batch, num_pages, max_blocks, slots, counters")

    @T.prim_func
    def mla_decode_fp8_rs2(
        Q: T.Tensor((batch, rows, D_QK), "bfloat16"),
        KV: T.Tensor((num_pages, page, TOKEN_BYTES), "float8_e4m3fn"),
        KVf: T.Tensor((num_pages, page, TOKEN_BYTES // 4), "float32"),
        KVh: T.Tensor((num_pages, page, TOKEN_BYTES // 2), "bfloat16"),
        BlockTable: T.Tensor((batch, max_blocks), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        Splits: T.Tensor((batch,), "int32"),
        Out: T.Tensor((batch, rows, D_V), "bfloat16"),
        Lse: T.Tensor((batch, h_q, s_q), "float32"),
        OPart: T.Tensor((slots, ROWS_PAD, D_V), "float32"),
        LsePart: T.Tensor((slots, ROWS_PAD), "float32"),
        Pace: T.Tensor((counters,), "int32"),
        max_splits: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(batch * max_splits, threads=3 * 128) as bid:
            ql_s = T.alloc_shared((GROUPS, ROWS, GROUP), "float16")
            qr_s = T.alloc_shared((ROWS, D_ROPE), "bfloat16")
            q_stage = T.alloc_shared((ROWS, D_QK), "bfloat16")
            if raw:                     # stage="page": each stage holds a step's 64 tokens as the cache does
                kl_s = T.alloc_shared((RS2_STAGES, STEP, TOKEN_BYTES), "float8_e4m3fn")
                ks_s = kr_s = kl_s
            else:
                kl_s = T.alloc_shared((RS2_STAGES, GROUPS, STEP, GROUP), "float8_e4m3fn")
                ks_s = T.alloc_shared((RS2_STAGES, STEP, GROUPS), "float32")
                kr_s = T.alloc_shared((RS2_STAGES, STEP, D_ROPE), "bfloat16")
            p_s = T.alloc_shared((2, GROUPS, ROWS, STEP), "float16")
            red = T.alloc_shared((2, 128), "float32")
            l_s = T.alloc_shared((2, ROWS), "float32")
            m_s = T.alloc_shared((2, ROWS), "float32")
            fab = T.alloc_shared((2 * ROWS,), "float32")
            full = T.alloc_barrier([128] * RS2_STAGES)
            empty = T.alloc_barrier([128] * RS2_STAGES)
            # each warpgroup's own fragments and registers
            frags = (_rs2_fragments(), _rs2_fragments())
            third = [{} for _ in frags]                        # third_fragment's fragments, per warpgroup
            for x in third:
                if raw:
                    x.update(a_r=T.alloc_fragment((STEP, D_ROPE), "bfloat16"))
                if third_fragment in ("k", "kv"):
                    x.update(a_k2=T.alloc_fragment((STEP, GROUP), "float16"))
                if third_fragment in ("v", "kv"):
                    x.update(a_v2=T.alloc_fragment((GROUP, STEP), "float16"))
            if raw:
                T.annotate_layout({p_s: make_full_bank_swizzled_layout(p_s)})
            else:
                T.annotate_layout({kl_s: make_full_bank_swizzled_layout(kl_s), p_s: make_full_bank_swizzled_layout(p_s)})
            T.import_source(HELPER_SOURCE)

            bi = bid // max_splits
            si = bid % max_splits
            splits = Splits[bi]
            seqlen = SeqLens[bi]
            tx = T.get_thread_binding()
            if trace and tx == 0:
                T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 0, 0))
            # one round trip for the lengths, the query and (split 0, which starts at block 0 whatever the length)
            # the ring's first page indices: nothing that waits for a length comes before the query's loads
            pages = T.alloc_local((RS2_STAGES,), "int32")
            if tx >= 256 and si == 0 and max_blocks > 0:
                for k in T.unroll(RS2_STAGES):
                    pages[k] = _rs2_page(BlockTable, bi, k, page, max_blocks, num_pages)
            # the query: staged raw with 9216 = 384 x 24 values (no partial iteration: one round trip; the
            # permuted fp16 copy straight from Q took 11 round trips, one a guarded iteration, ~14 us)
            for h, j in T.Parallel(ROWS, D_QK):
                q_stage[h, j] = T.if_then_else(h < rows, Q[bi, T.min(h, rows - 1), j], T.cast(0, "bfloat16"))
            # the split's range computed once into registers (as expressions, TileLang inlines them at every
            # use: a division a step in each chain's loop)
            split_v = T.alloc_local((2,), "int32")
            split_v[0], split_v[1] = _split_range(si, splits, T.ceildiv(seqlen, STEP))
            first, n_iter = split_v[0], split_v[1]
            base = seqlen - s_q + 1 if causal else seqlen
            if tx >= 256 and si > 0 and n_iter > 0:      # later splits: their page indices after the lengths
                for k in T.unroll(RS2_STAGES):
                    pages[k] = _rs2_page(BlockTable, bi, first + k, page, max_blocks, num_pages)
            T.sync_threads()
            # then the ring's first stages (issued before the query's loads, their 164 KB a CTA queued the query
            # behind them: a 9.9 us prologue; issued after the permute instead, the chains wait for them longer:
            # bench/NOTES.md "Session 38")
            pace_seen = T.alloc_local((2,), "int32")
            if pace and 256 <= tx < 288:
                T.evaluate(T.call_extern("handle", "tc_pace_start", T.access_ptr(Pace[0], "rw", 2), pace_seen.data,
                                         n_iter))
            if tx >= 256 and n_iter > 0:
                for k in T.serial(T.min(n_iter, RS2_STAGES)):
                    _rs2_issue(KV, KVf, KVh, kl_s, ks_s, kr_s, full, k, pages[k], (first + k) * STEP % page, raw)
            for g, h, k in T.Parallel(GROUPS, ROWS, GROUP):
                ql_s[g, h, k] = T.cast(q_stage[h, g * GROUP + q_column(k)], "float16")
            for h, j in T.Parallel(ROWS, D_ROPE):
                qr_s[h, j] = q_stage[h, D_V + j]
            T.sync_threads()
            if tx < 128:
                if trace:
                    T.evaluate(T.call_extern("handle", "tc_span", T.access_ptr(OPart[bid, SPAN_ROW, 0], "w", 8), 1, 0))
                _rs2_chain(0, n_iter, first, seqlen, base, h_q, causal, scale_log2, ql_s, qr_s, kl_s, ks_s, kr_s, p_s,
                           red, l_s, m_s, full, empty, *frags[0], OPart=OPart if trace else None,
                           Pace=Pace if pace else None, probe=probe, **third[0])
                _rs2_epilogue_0(OPart, Pace, Lse, LsePart, Out, kl_s, m_s, l_s, fab, frags[0], n_iter, bid, bi, si, splits,
                                max_splits, rows, h_q, raw, trace, pace)
            elif tx < 256:
                _rs2_chain(1, n_iter, first, seqlen, base, h_q, causal, scale_log2, ql_s, qr_s, kl_s, ks_s, kr_s, p_s,
                           red, l_s, m_s, full, empty, *frags[1], OPart=OPart if trace else None,
                           Pace=Pace if pace else None, probe=probe, **third[1])
                _rs2_epilogue_1(kl_s, frags[1], raw)
            else:
                _rs2_produce(KV, KVf, KVh, kl_s, ks_s, kr_s, full, empty, BlockTable, bi, first, n_iter, page, max_blocks,
                             num_pages, tx, Pace, pace_seen, pace, raw)

    return mla_decode_fp8_rs2
