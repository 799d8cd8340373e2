"""W4A8 on Hopper: C (m, n) bf16 = (A e4m3 x SA) @ (MXFP4 B)^T with FP8 WGMMA, for decode-sized m.

The bf16-activation MXFP4 kernel (ops.gemm_mxfp4, swapped) spends most of a K step decoding e2m1 codes into bf16
pairs (bench/NOTES.md "MXFP4 at 1-16 tokens"). With e4m3 activations the weights can go into an e4m3 WGMMA
instead, and e2m1 -> e4m3 is a byte table: one PRMT turns four 3-bit magnitudes into four e4m3 bytes. A row's
E8M0 block exponent is folded into the table (the table of 2^(e8 - R) x e2m1, R the row's reference), and
2^(R - 127) is applied in the epilogue, with the activations' scale when it is one a token; a scale per (token,
128 columns) (DeepGEMM's sfa) multiplies each 128-deep step's product as it is promoted.

The weights go through `prepare_mxfp4_w4a8` once (they are constants):
- the codes are permuted inside each row's 64-byte K step so that the thread that owns a piece of WGMMA's register
  fragment finds it in one 16-byte chunk, with its signs where one AND puts them (`_w4a8_code_words`);
- each 32-block's E8M0 byte becomes the byte offset of its table in the kernel's 20-entry table (`table_words`):
  d = e8 - rowmax + 6 (the row's largest block gets d = 6: 6 x 2^6 = 384 <= 448), entry d + 13, d clamped to
  [-13, 6];
- row_scale (n,) fp32 = 2^(rowmax - 133).
Exact (every weight the same value as dequant_mxfp4's) where a block's exponent is within 14 binades of its row's
largest (d >= -8: e4m3 subnormals reach 2^-9); further below, the block's values are rounded to e4m3's subnormals
(absolute error <= 2^-10 x 2^(rowmax - 133), i.e. under 2^-16 of the row's largest weight magnitude);
`w4a8_exact` says whether a prepared weight is exact.

Each 128-deep K step's four WGMMAs (k32 each) go into a fresh fp32 temporary that is added to the accumulator once
it has landed (tile.mma_register_decoded_loop's promote): Hopper's FP8 WGMMA keeps fewer bits than fp32.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import gemm_mxfp4 as _mxfp4
from ops import _validate as check
from ops._ready import READY_SOURCE
from ops._workspace import arrival_counters, bound_only, ready_partials
from ops.gemm_fp8 import _touch
from ops.gemm_mxfp4 import (BLOCK_K, MX, SMEM_BUDGET, SWAPPED_K_ALIGN, SWAPPED_STAGE_OUT_TOKENS,
                            SWAPPED_TOKENS, SWAPPED_TRACE_WORDS, _pair_fold_chains, _stage_scale_rows, _store_chains,
                            _store_masked_swapped, _swapped_grid, _tma_scale_words, _trace_stamp, pair_recv_bytes,
                            pair_recv_shape, pair_source, plan_masked_swapped, plan_swapped, swapped_epilogue,
                            swapped_loads, swapped_scale_box)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TABLE_LOW, TABLE_HIGH = -13, 6      # the table's block exponents d (relative to the row's largest, + 6)
TABLE_ENTRIES = TABLE_HIGH - TABLE_LOW + 1
EXACT_LOW = -8                      # d from here up: every e2m1 x 2^d is an e4m3 value


def table_words() -> list:
    """The kernel's table: entry d - TABLE_LOW is two 32-bit words, the e4m3 bytes of e2m1 magnitude 0..7 x 2^d
    (round to nearest even; 0 below e4m3's smallest subnormal)."""
    out = []
    for d in range(TABLE_LOW, TABLE_HIGH + 1):
        b = torch.tensor([v * 2.0 ** d for v in E2M1_VALUES]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        out += [b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24]
    return out


def _table_values() -> torch.Tensor:
    # (TABLE_ENTRIES, 8) fp32: the e4m3 values the table holds
    b = torch.tensor(table_words(), dtype=torch.int64).view(TABLE_ENTRIES, 2)
    by = torch.stack([(b >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(TABLE_ENTRIES, 8)
    return by.to(torch.uint8).view(torch.float8_e4m3fn).float()


W4A8_SOURCE = r"""
#include <tl_templates/cuda/common.h>
__device__ __forceinline__ int tc_globaltimer_lo() {   // ns, low 32 bits (trace=True)
  unsigned t;
  asm volatile("mov.u32 %%0, %%%%globaltimer_lo;" : "=r"(t));
  return (int)t;
}
#include <cuda_fp8.h>
// the table into shared memory, computed (a global load here would queue behind the stages' TMA traffic): word
// tid is entry tid / 2's magnitudes 4 (tid %% 2) .. + 3, each e2m1 x 2^(tid / 2 + %(low)d) rounded to e4m3 (RN)
__device__ __forceinline__ void tc_w4a8_table_fill(void* tbl, int tid) {
  if (tid < %(words)d) {
    const float f = __int_as_float((tid / 2 + %(low)d + 127) << 23);     // 2^d, exactly (normal for every entry)
    const bool h = tid & 1;
    const unsigned a = __nv_cvt_float2_to_fp8x2(make_float2((h ? 2.0f : 0.0f) * f, (h ? 3.0f : 0.5f) * f),
                                                __NV_SATFINITE, __NV_E4M3);
    const unsigned b = __nv_cvt_float2_to_fp8x2(make_float2((h ? 4.0f : 1.0f) * f, (h ? 6.0f : 1.5f) * f),
                                                __NV_SATFINITE, __NV_E4M3);
    reinterpret_cast<unsigned*>(tbl)[tid] = (a & 0xFFFFu) | (b << 16);
  }
}
__device__ __forceinline__ unsigned tc_prmt(unsigned a, unsigned b, unsigned s) {   // sign mode off: s & 0x7777
  unsigned d;
  asm("prmt.b32 %%0, %%1, %%2, %%3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
// One word of the W4A8 layout -> two fragment words of four e4m3 each: nibbles 0-3 hold the first word's
// magnitudes, 4-7 the second's; bit 3 of nibbles 1, 3, 5, 7 the first word's signs (bits 7, 15, 23, 31: in place),
// of nibbles 0, 2, 4, 6 the second's (<< 4 puts them in place). t: the block's table (magnitude -> e4m3 byte).
__device__ __forceinline__ void tc_w4a8_word(unsigned x, uint2 t, unsigned& o0, unsigned& o1) {
  o0 = tc_prmt(t.x, t.y, x & 0x7777u) | (x & 0x80808080u);
  o1 = tc_prmt(t.x, t.y, (x >> 16) & 0x7777u) | ((x << 4) & 0x80808080u);
}
// This thread's e4m3 fragment of a 128-deep step (4 k32 WGMMAs j: words (row r, K 32j + 4c..), (r + 8, same),
// (r, K 32j + 16 + 4c..), (r + 8, same)) from its 16-byte chunk of each of its two rows (wr, wr8: word j is the
// k32 block j) and their table offsets (tw: byte j is block j's entry x 8)
__device__ __forceinline__ void tc_w4a8_fragment(void* dst, const void* wr, const void* wr8, int tw_r, int tw_r8,
                                                 const void* tbl) {
  const uint4 x = *reinterpret_cast<const uint4*>(wr);
  const uint4 y = *reinterpret_cast<const uint4*>(wr8);
  const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
  const char* tb = reinterpret_cast<const char*>(tbl);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint2 t = *reinterpret_cast<const uint2*>(tb + __byte_perm((unsigned)tw_r, 0u, 0x4440u + j));
    const uint2 u = *reinterpret_cast<const uint2*>(tb + __byte_perm((unsigned)tw_r8, 0u, 0x4440u + j));
    tc_w4a8_word(xs[j], t, d[4 * j + 0], d[4 * j + 2]);
    tc_w4a8_word(ys[j], u, d[4 * j + 1], d[4 * j + 3]);
  }
}
"""


def _source() -> str:
    return W4A8_SOURCE % dict(words=2 * TABLE_ENTRIES, low=TABLE_LOW)


@T.macro
def _w4a8_fragment(raw_at, rows, place, step, dst, sw, tbl):
    # this thread's fragment of the step: chunk `place` (16 bytes) of each of its two rows
    r, r8 = rows
    T.evaluate(T.call_extern("handle", "tc_w4a8_fragment", dst, T.access_ptr(raw_at(r, 4 * place), "r", 4),
                             T.access_ptr(raw_at(r8, 4 * place), "r", 4), sw[r, step], sw[r8, step],
                             T.access_ptr(tbl[0], "r", 2 * TABLE_ENTRIES)))


@T.macro
def _fill_table(tbl):
    T.evaluate(T.call_extern("handle", "tc_w4a8_table_fill", T.access_ptr(tbl[0], "w", 2 * TABLE_ENTRIES),
                             T.get_thread_binding()))


@tile_program(
    "mxfp4_w4a8_gemm_nt_swapped",
    targets=("cuda:sm_90a",),
    examples={"decode-4096x7168": dict(n=4096, k=7168, tokens=64, splits=4),
              "decode-7168x2048": dict(n=7168, k=2048, tokens=8, splits=2)},
)
def mxfp4_w4a8_swapped_program(n: int, k: int, tokens: int = 64, stages: int = 6,
                               splits: int = 1, scale_tma: bool = True, fold: bool = False, pair: bool = False,
                               trace: bool = False, group_scales: bool = False, no_offsets: bool = False,
                               stage_out: bool = False, burst: int = 0, block_n: int = 128, chains: int = 1):
    """C^T (n, m) = B @ A^T with B the MMA's M side (as ops.gemm_mxfp4's swapped kernel): each MMA thread turns its
    chunk of its two rows' codes into its e4m3 register fragment (tc_w4a8_fragment), an e4m3 x e4m3 WGMMA (k32)
    per 32-block, each 128-deep step promoted into fp32; A the (tokens, 128) e4m3 shared operand of a step (TMA,
    rows past m zero-filled). TIX (n, k/128) int32: a step's four table offsets of a row; RowScale (n,) and SA
    (m,) fp32 multiply the result (row x token). splits > 1: fp32 partials (already scaled), reduced in order by
    ops.gemm_fp8's reduce kernel, or (fold) by the tile's last split block (without fences, from a READY_EMPTY Part
    as ops.gemm_mxfp4's swapped kernel), or (pair, splits == 2) by a cluster of
    the tile's two split blocks through distributed shared memory, as the bf16 swapped kernel's. trace: its stamps
    (bench.trace_mxfp4 --w4a8; Trace otherwise bound, never touched).
    group_scales=True: SA is (m, k/128), a scale per (token, 128-deep step) (DeepGEMM's sfa, as
    ops.per_token_group_quant_fp8 writes it), staged by TMA for the split's steps and applied when each step's
    product is promoted; the epilogue then multiplies by RowScale alone.
    no_offsets=True (a diagnostic, wrong results: bench.trace_mxfp4 --no-offsets): the table offsets are neither
    loaded nor waited for (all zero), to time the kernel without its wait for them.
    stage_out=True (splits > 1): the split's fp32 partial, or the pair's half of C, goes out through shared memory
    as whole rows instead of from the accumulator's layout. burst: steps between the loop's WGMMA drains (0: the
    target's default).
    chains=2 (block_n=64; no fold or stage_out): two MMA warpgroups take alternate K steps of the block's 64
    rows, each promoting into its half of a (128, tokens) accumulator; the epilogue adds the halves through a
    (tokens, 132) fp32 shared tile, multiplies by the scales and stores C or the split's partial, or with pair (2
    splits) folds the pair's sums through distributed shared memory (as ops.gemm_mxfp4's swapped kernel with chains)."""
    assert k % BLOCK_K == 0 and k % SWAPPED_K_ALIGN == 0 and n % block_n == 0 and tokens in SWAPPED_TOKENS
    if fold and splits == 1:
        raise ValueError("fold=True adds split-K partials inside the kernel: it needs splits > 1")
    if stage_out and splits == 1:
        raise ValueError("stage_out=True stages split-K partials or the pair's half: it needs splits > 1")
    if pair and (splits != 2 or fold):
        raise ValueError(f"pair=True folds the partials of a cluster of 2 splits: it needs splits == 2 and "
                         f"fold=False, got splits={splits}, fold={fold}")
    if block_n not in (64, 128) or chains not in (1, 2) or (block_n == 64) != (chains == 2) or (
            chains == 2 and (fold or stage_out)):
        raise ValueError(f"block_n and chains must be 128 and 1, or 64 and 2 with no fold or stage_out; got "
                         f"block_n={block_n}, chains={chains}, fold={fold}, pair={pair}, stage_out={stage_out}")
    m, counts = T.dynamic("m, counts")
    n_tiles, kb = n // block_n, k // BLOCK_K
    per = -(-kb // splits)
    box = swapped_scale_box(per, kb) if scale_tma else per
    part_shape = (splits, m, n) if splits > 1 and not pair else (1, 1, n)
    abox = swapped_scale_box(per, kb)                   # group_scales: the split's steps of SA (16-byte aligned box)

    @T.prim_func
    def mxfp4_w4a8_gemm_nt_swapped(A: T.Tensor((m, k), "float8_e4m3fn"), B: T.Tensor((n, k // 8), "int32"),
                                   TIX: T.Tensor((n, kb), "int32"), RowScale: T.Tensor((n,), "float32"),
                                   SA: T.Tensor((m, kb) if group_scales else (m,), "float32"),
                                   C: T.Tensor((m, n), "bfloat16"),
                                   Part: T.Tensor(part_shape, "float32"),
                                   Trace: T.Tensor((n_tiles * splits if trace else 1, SWAPPED_TRACE_WORDS), "int32"),
                                   Count: T.Tensor((counts,), "int32")):
        with _swapped_grid(n_tiles * splits, 2 * block_n * chains + tile.producer_threads(), pair) as bid:
            tn, ts = tile.split_index(bid, (n_tiles, splits))    # pair: ts is the block's rank in its cluster
            recv = None
            if pair:   # the other split's partial of this block's half of the tokens
                recv = tile.stage(pair_recv_shape(tokens, block_n, chains), "float32")
                _touch(recv)
                tile.cluster_barrier()            # both blocks started before either stores into the other
            staged = None
            if stage_out:   # the pair's half of C (bf16), or the split's partial (fp32), token-major
                staged = (tile.stage((tokens // 2, block_n + 8), "bfloat16") if pair else
                          tile.stage((tokens, block_n + 4), "float32"))
            if chains > 1:  # the chains' halves, token-major
                staged = tile.stage((tokens, block_n * chains + 4), "float32")
            sw = tile.stage((block_n, box), "int32")          # table offsets of (row, step) of the split
            tbl = tile.stage((2 * TABLE_ENTRIES,), "int32")
            acc = tile.accumulator((block_n * chains, tokens))     # C^T: weight rows x tokens (a chain's rows each)
            w0 = ts * per
            s0 = T.min(w0 // 4 * 4, kb - box) if scale_tma else w0
            steps = T.max(T.min(per, kb - w0), 0)
            T.import_source(_source() + pair_source(pair) + (READY_SOURCE if fold else ""))
            rs = tile.stage((block_n,), "float32")          # the epilogue's factors (TMA: tokens past m are 0)
            if group_scales:          # (token, step) factors of the split's steps, from step a0
                sas = tile.stage((tokens, _bank_spread(abox)), "float32")
                a0 = T.min(w0 // 4 * 4, kb - abox)
                factor = lambda i, j: rs[i]  # noqa: E731
                sa_region = SA[0:tokens, a0:a0 + _bank_spread(abox)]
            else:
                sas = tile.stage((tokens,), "float32")
                factor = lambda i, j: rs[i] * sas[j]  # noqa: E731
                sa_region = SA[0:tokens]
            loads = swapped_loads(A, B, tn, w0, block_n, tokens, BLOCK_K)
            if chains > 1 and pair:
                epilogue = lambda: _pair_fold_chains(acc, C, recv, staged, tn, ts, m, steps,  # noqa: E731
                                                     block_n, tokens, factor=factor)
            elif chains > 1:
                epilogue = lambda: _store_chains(acc, C, Part, staged, tn, ts, m, steps, splits,  # noqa: E731
                                                 block_n, tokens, factor=factor)
            else:
                epilogue = swapped_epilogue(acc, C, Part, Count, recv, tn, ts, m, steps, splits, block_n, tokens,
                                            fold, staged=staged, factor=factor,
                                            mark=(lambda event: _trace_stamp(Trace, bid, event, 0)) if trace
                                            else None)
            tile.mma_register_decoded_loop(
                steps, loads, [((tokens, BLOCK_K), "float8_e4m3fn"), ((block_n, BLOCK_K // 8), "int32"),
                               ((block_n * chains, BLOCK_K), "float8_e4m3fn")], acc,
                lambda raw_at, rows, place, blk, dst: _w4a8_fragment(raw_at, rows, place, blk + w0 - s0, dst, sw,
                                                                     tbl),
                stages=stages, **_burst(burst), **({"chains": chains} if chains > 1 else {}),
                promote=(lambda j, step: sas[j, step + w0 - a0]) if group_scales else True,
                mark=(lambda event, step: _trace_stamp(Trace, bid, event, step, chains)) if trace else None,
                # the epilogue's factors (and the table offsets) by the producer's TMA ahead of the stages: loads
                # by the MMA threads would queue behind the stages' (bench/NOTES.md "Session 43")
                preload=[(RowScale[tn * block_n:(tn + 1) * block_n], rs), (sa_region, sas)]
                + ([(TIX[tn * block_n:(tn + 1) * block_n, s0:s0 + box], sw)] if scale_tma and not no_offsets else []),
                prologue=lambda: _prologue(tbl, None if scale_tma and not no_offsets else sw,
                                           (lambda i, si: 0) if no_offsets else
                                           (lambda i, si: TIX[tn * block_n + i, T.min(w0 + si, kb - 1)])),
                epilogue=epilogue)

    return mxfp4_w4a8_gemm_nt_swapped


@tile_program(
    "mxfp4_w4a8_gemm_nt_masked_swapped",
    targets=("cuda:sm_90a",),
    examples={"decode-8x64x4096x7168": dict(n=4096, k=7168, tokens=64, stages=8),
              "prefill-contiguous-4096x7168": dict(n=4096, k=7168, tokens=128, stages=6, staged_out=True,
                                                   contiguous=True, token_scales_tma=True)},
)
def mxfp4_w4a8_masked_program(n: int, k: int, tokens: int = 64, block_n: int = 128, stages: int = 6,
                              group_scales: bool = False, token_scales_tma: bool = False, staged_out: bool = False,
                              tiles: int = 1, trace: bool = False, burst: int = 0, contiguous: bool = False,
                              temps: int = 2, whole_bursts: bool = False):
    """The masked grouped layout (MoE decode: A (groups, max_m, k) e4m3 with SA (groups, max_m) per-token scales,
    max_m <= tokens <= 64; only the first MaskedM[g] rows of group g are computed, the rest of C is zeros) on the
    W4A8 kernel: a block takes one group's 128 weight rows over the whole K; a group with no rows loads nothing
    and stores zeros. The table offsets of the whole K and the row factors come by TMA ahead of the stages; the
    token factors are read from global memory in the epilogue, or (token_scales_tma: SA's row of the group, which
    needs max_m % 4 == 0 for TMA's 16-byte row stride) come by TMA with them, or (group_scales: SA (groups, max_m,
    k/128)) come by TMA with them and multiply each step's product as it is promoted. staged_out: C's tile goes out
    through shared memory as whole rows (16-byte stores) instead of from the accumulator's layout. tiles > 1: a block
    takes that many consecutive n tiles of its group in one stream of steps (each tile's accumulator stored after its
    last step while the producer streams the next tile's stages), so a grid of several waves runs as one and pays
    its prologue and first data once a block (k / 128 a multiple of burst, the steps between the loop's WGMMA
    drains; 0: the target's default). trace=True (bench.trace_mxfp4 --w4a8 --masked G): a last argument Trace
    (blocks, SWAPPED_TRACE_WORDS) int32 with the swapped kernel's stamps, a row a block (block = group x n tiles /
    tiles + the block's index in the group).
    contiguous=True (MoE prefill: ops.m_grouped_mxfp4_w4a8_gemm_nt_contiguous, tokens 64 or 128): a "group" is a
    chunk of `tokens` rows of the contiguous layout (A, SA and C viewed (chunks, tokens, ...), max_m = tokens), and
    MaskedM is MIdx (chunks, tokens), each row's expert (-1: padding). A chunk lies in one 128-aligned segment: its
    first row's expert picks the weights (B, TIX, RowScale have their own group count, the experts), a chunk whose
    first row is padding is all padding (zeros, nothing loaded), and the chunk's row ids come by TMA with the
    factors so that each padding row stores zeros. temps: the promotion's fp32 temporaries (2: a part's WGMMA
    runs while the one before is added; 1: a third of the registers less, for 128-token tiles). whole_bursts
    (k / 128 a multiple of burst): a block's steps are 0 or tiles x k / 128, so the loop's tail bursts are left
    out."""
    assert k % SWAPPED_K_ALIGN == 0 and n % block_n == 0
    assert tokens in (W4A8_CONTIGUOUS_TOKENS if contiguous else SWAPPED_TOKENS), tokens
    assert tiles >= 1 and (n // block_n) % tiles == 0     # (the loop checks that k / 128 is a multiple of burst)
    if whole_bursts and (not burst or (k // BLOCK_K) % burst):
        raise ValueError(f"whole_bursts needs a burst given and k / 128 a multiple of it, got k={k}, burst={burst}")
    groups, max_m = T.dynamic("groups, max_m")
    wgroups = T.dynamic("experts") if contiguous else groups   # the weights' group count
    n_tiles, kb = n // block_n, k // BLOCK_K
    blocks_per_group = n_tiles // tiles
    # step s: tile tt(s) of the block, K block kk(s) (one tile: s itself, no division in the loop)
    kk = (lambda s: s) if tiles == 1 else (lambda s: s % kb)  # noqa: E731
    tt = (lambda s: 0) if tiles == 1 else (lambda s: s // kb)  # noqa: E731

    @T.macro
    def body(A, B, TIX, RowScale, SA, MaskedM, C, Trace):
        with tile.grid(groups * blocks_per_group, 2 * block_n + tile.producer_threads()) as bid:
            g, tb = tile.split_index(bid, (groups, blocks_per_group))
            tn0 = tb * tiles                                  # the block's first n tile
            sw = tile.stage((tiles, block_n, kb), "int32")    # table offsets of (tile, row, step)
            tbl = tile.stage((2 * TABLE_ENTRIES,), "int32")
            rs = tile.stage((tiles, block_n), "float32")
            acc = tile.accumulator((block_n, tokens))         # C^T of the group: weight rows x tokens
            if contiguous:   # the chunk's expert (clamped: unchecked ids never index past B); its row ids by TMA
                e = T.min(T.max(MaskedM[g, 0], 0), wgroups - 1)
                rows = T.if_then_else(MaskedM[g, 0] >= 0, tokens, 0)
                ids = tile.stage((tokens,), "int32")
                id_region = [(MaskedM[g, 0:tokens], ids)]
                live = lambda j: ids[j] >= 0  # noqa: E731
            else:
                e = g
                rows = MaskedM[g]
                id_region, live = [], None
            steps = tile.steps_if(rows > 0, tiles * kb)   # step s: tile s // kb, K block s % kb
            T.import_source(_source())
            # rows past max_m and words past kb (the row's padding): 0 (TMA)
            if group_scales:
                sas = tile.stage((tokens, _bank_spread(kb)), "float32")
                sa_region = [(SA[g, 0:tokens, 0:_bank_spread(kb)], sas)]
                factor = lambda t: lambda i, j: rs[t, i]  # noqa: E731
            elif token_scales_tma:     # tokens past max_m: 0 (TMA), never stored
                sas = tile.stage((tokens,), "float32")
                sa_region = [(SA[g, 0:tokens], sas)]
                factor = lambda t: lambda i, j: rs[t, i] * sas[j]  # noqa: E731
            else:   # loads by the MMA threads after the loop (they queue behind the grid's stages)
                sas, sa_region = None, []
                factor = lambda t: lambda i, j: rs[t, i] * SA[g, T.min(j, max_m - 1)]  # noqa: E731
            staged = tile.stage((tokens, block_n + 8), "bfloat16") if staged_out else None    # 8: no bank conflicts
            store, epilogue = _masked_stores(acc, C, g, tn0, rows, max_m, block_n, tokens, factor, staged, tiles,
                                             steps, (lambda event: _trace_stamp(Trace, bid, event, 0))
                                             if Trace is not None else None, live)
            tile.mma_register_decoded_loop(
                steps, lambda s: (A[g, 0:tokens, kk(s) * BLOCK_K:(kk(s) + 1) * BLOCK_K],
                                  B[e, (tn0 + tt(s)) * block_n:(tn0 + tt(s) + 1) * block_n,
                                    kk(s) * (BLOCK_K // 8):(kk(s) + 1) * (BLOCK_K // 8)]),
                [((tokens, BLOCK_K), "float8_e4m3fn"), ((block_n, BLOCK_K // 8), "int32"),
                 ((block_n, BLOCK_K), "float8_e4m3fn")], acc,
                lambda raw_at, frows, place, s, dst: _w4a8_fragment(raw_at, frows, place, kk(s), dst,
                                                                    _TileRows(sw, tt(s)), tbl),
                stages=stages, **_burst(burst), **({} if temps == 2 else {"temps": temps}),
                **({"whole_bursts": True} if whole_bursts else {}),
                promote=(lambda j, s: sas[j, kk(s)]) if group_scales else True,
                mark=(lambda event, step: _trace_stamp(Trace, bid, event, step)) if Trace is not None else None,
                preload=[(RowScale[e, (tn0 + t) * block_n:(tn0 + t + 1) * block_n], rs[t, :]) for t in range(tiles)]
                + [(TIX[e, (tn0 + t) * block_n:(tn0 + t + 1) * block_n, 0:kb], sw[t, :, :]) for t in range(tiles)]
                + sa_region + id_region,
                prologue=lambda: _fill_table(tbl),
                tile_done=(kb, store) if tiles > 1 else None,
                epilogue=epilogue)

    # the arguments' types, once for both signatures
    a_t, b_t = T.Tensor((groups, max_m, k), "float8_e4m3fn"), T.Tensor((wgroups, n, k // 8), "int32")
    tix_t, rs_t = T.Tensor((wgroups, n, kb), "int32"), T.Tensor((wgroups, n), "float32")
    sa_t = T.Tensor((groups, max_m, kb) if group_scales else (groups, max_m), "float32")
    mm_t = T.Tensor((groups, max_m) if contiguous else (groups,), "int32")
    c_t = T.Tensor((groups, max_m, n), "bfloat16")
    if trace:       # bench.trace_mxfp4 --w4a8 --masked: Trace as the swapped kernel's (a row a block)
        trace_t = T.Tensor((groups * blocks_per_group, SWAPPED_TRACE_WORDS), "int32")

        @T.prim_func
        def mxfp4_w4a8_gemm_nt_masked_swapped(A: a_t, B: b_t, TIX: tix_t, RowScale: rs_t, SA: sa_t, MaskedM: mm_t,
                                              C: c_t, Trace: trace_t):
            body(A, B, TIX, RowScale, SA, MaskedM, C, Trace)

        return mxfp4_w4a8_gemm_nt_masked_swapped

    @T.prim_func
    def mxfp4_w4a8_gemm_nt_masked_swapped(A: a_t, B: b_t, TIX: tix_t, RowScale: rs_t, SA: sa_t, MaskedM: mm_t,
                                          C: c_t):
        body(A, B, TIX, RowScale, SA, MaskedM, C, None)

    return mxfp4_w4a8_gemm_nt_masked_swapped


def _burst(burst: int) -> dict:
    # the loop's burst= where a plan sets one (0: the target's default)
    return {"burst": burst} if burst else {}


def _masked_stores(acc, C, g, tn0, rows, max_m, block_n, tokens, factor, staged, tiles, steps, mark, live=None):
    """A masked block's (store(t): tile t's accumulator into C, for tile_done; the epilogue: the last tile, and
    before it the other tiles of a group with no rows, zeros: no step ran, so tile_done never stored them). live(j):
    which of the tokens are rows (None: j < rows)."""
    def store(t, mark=None):
        _store_masked_swapped(acc, C, g, tn0 + t, rows, max_m, block_n, tokens, factor=factor(t), staged=staged,
                              mark=mark, again=tiles > 1, live=live)

    def epilogue():
        for t in range(tiles - 1):
            _when(steps == 0, lambda t=t: store(t))
        store(tiles - 1, mark)
    return store, epilogue


class _TileRows:
    """sw[r, step] for _w4a8_fragment over the (tiles, rows, steps) table offsets of a multi-tile block: tile t's."""

    def __init__(self, sw, t):
        self.sw, self.t = sw, t

    def __getitem__(self, index):
        r, step = index
        return self.sw[self.t, r, step]


@T.macro
def _when(cond, body):
    if cond:
        body()


def _bank_spread(words: int) -> int:
    """The row length (fp32 words, a multiple of 4: TMA boxes are whole 16 bytes) of the (token, step) factor tile
    that puts the four token pairs a quad reads at once (tokens 2q, q = 0..3) in four different banks: 2 x row mod 32
    must be 8 or 24, i.e. row = 4 mod 8. With the row's own length (16 steps at k = 2048: 128 bytes between a quad's
    tokens) every read was a 4-way bank conflict, 16 a step, and the per-(token, 128) kernels ran up to 30% slower
    than the per-token ones (bench/NOTES.md "Session 44"). The TMA box reads past the row's end: zeros, never used."""
    return words + (4 - words % 8) % 8


@T.macro
def _prologue(tbl, sw, word_at):
    # the table and, without scale_tma, the table offsets' rows
    _fill_table(tbl)
    if sw is not None:
        _stage_scale_rows(sw, word_at)


# ---- the weights' layout -------------------------------------------------------------------------------------------

PREPARE_ROWS = 4096     # rows prepare_mxfp4_w4a8 permutes at once (~2 GB of int64 temporaries at k = 7168)


def _w4a8_code_words(b: torch.Tensor) -> torch.Tensor:
    """(n, k/2) OCP-packed e2m1 -> (n, k/2) uint8 in the W4A8 layout. K step s of a row (64 bytes) is four 16-byte
    chunks, chunk c for the fragment's thread c of a quad; its word j (k32 block j) holds the codes of K
    128s + 32j + 4c + t (the first fragment word, t = 0..3) and 128s + 32j + 16 + 4c + t (the second): nibble t
    the first's magnitude t, nibble 4 + t the second's; the first's sign t at bit 3 of nibble 2t + 1, the second's
    at bit 3 of nibble 2t."""
    n, half = b.shape
    k = 2 * half
    codes = torch.stack([b & 0xF, b >> 4], -1).reshape(n, k).long()      # code of K index k
    # K = 128 s + 32 j + 16 h + 4 c + t  ->  [n, s, j, h, c, t]
    c6 = codes.view(n, k // 128, 4, 2, 4, 4)
    mag, sign = c6 & 7, c6 >> 3
    first, second = (0, 1)
    word = torch.zeros(n, k // 128, 4, 4, dtype=torch.int64, device=b.device)        # [n, s, c, j]
    for t in range(4):
        word |= mag[:, :, :, first, :, t].transpose(2, 3) << (4 * t)
        word |= mag[:, :, :, second, :, t].transpose(2, 3) << (16 + 4 * t)
        word |= sign[:, :, :, first, :, t].transpose(2, 3) << (8 * t + 7)
        word |= sign[:, :, :, second, :, t].transpose(2, 3) << (8 * t + 3)
    by = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1)   # little-endian bytes of each word
    return by.reshape(n, half).to(torch.uint8)


def prepare_mxfp4_w4a8(b: torch.Tensor, sfb: torch.Tensor):
    """MXFP4 weights (b (n, k/2) uint8 OCP-packed e2m1, sfb (n, k/32) uint8 E8M0, as ops.quant_mxfp4 writes them)
    -> (codes (n, k/2) uint8, table offsets (n, k/32) uint8, row_scale (n,) fp32) for ops.mxfp4_w4a8_gemm_nt, on
    b's device; grouped weights (g, n, k/2) and (g, n, k/32) -> (g, n, k/2), (g, n, k/32), (g, n) for
    ops.m_grouped_mxfp4_w4a8_gemm_nt_masked. Once per weight (a few torch ops; not for the hot path)."""
    check.tensor("b", b, dtypes=(torch.uint8,), ndim=(2, 3))
    check.tensor("sfb", sfb, dtypes=(torch.uint8,), ndim=b.dim())
    k = 2 * b.shape[-1]
    if k % BLOCK_K:
        raise ValueError(f"b must be (..., n, k/2) with k a multiple of {BLOCK_K}, got shape {tuple(b.shape)} (k={k})")
    check.shape("sfb", sfb, (*b.shape[:-1], k // MX), "(..., n, k/32) E8M0")
    check.same_device(b=b, sfb=sfb)
    if b.dim() == 3:        # groups: each row on its own
        codes, offsets, row_scale = prepare_mxfp4_w4a8(b.reshape(-1, b.shape[-1]), sfb.reshape(-1, sfb.shape[-1]))
        return codes.view(b.shape), offsets.view(sfb.shape), row_scale.view(b.shape[:-1])
    n = b.shape[0]
    e = sfb.long()
    rowmax = e.amax(1) if k else torch.zeros(n, dtype=torch.long, device=b.device)
    d = (e - rowmax[:, None] + 6).clamp(TABLE_LOW, TABLE_HIGH)
    offsets = ((d - TABLE_LOW) * 8).to(torch.uint8)
    row_scale = torch.exp2((rowmax - 133).double()).float()
    row_scale[(e == 255).any(1)] = float("nan")          # E8M0 255 is NaN (OCP MX): the row is NaN, as in dequant
    codes = torch.empty_like(b)
    for r in range(0, n, PREPARE_ROWS):     # on b's device, in row chunks (the permutation works in int64)
        codes[r:r + PREPARE_ROWS] = _w4a8_code_words(b[r:r + PREPARE_ROWS])
    return codes, offsets.contiguous(), row_scale


def w4a8_exact(sfb: torch.Tensor) -> bool:
    """Whether prepare_mxfp4_w4a8 keeps every weight of these scales exactly (each block within 14 binades of its
    row's largest): sfb (n, k/32) or grouped (g, n, k/32) uint8 E8M0, as prepare_mxfp4_w4a8 takes them."""
    check.tensor("sfb", sfb, dtypes=(torch.uint8,), ndim=(2, 3))
    e = sfb.long()
    return bool(((e - e.amax(-1, keepdim=True) + 6) >= EXACT_LOW).all()) if e.numel() else True


def dequant_w4a8(codes: torch.Tensor, offsets: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The prepared weights' values, (n, k) fp32: what the kernel multiplies (its table's e4m3 values x row_scale)."""
    check.tensor("codes", codes, dtypes=(torch.uint8,), ndim=2)
    check.tensor("offsets", offsets, dtypes=(torch.uint8,), ndim=2)
    check.tensor("row_scale", row_scale, dtypes=(torch.float32,), ndim=1)
    n, half = codes.shape
    k = 2 * half
    if k % BLOCK_K:
        raise ValueError(f"codes must be (n, k/2) with k a multiple of {BLOCK_K} (as prepare_mxfp4_w4a8 writes them), "
                         f"got shape {tuple(codes.shape)}")
    check.shape("offsets", offsets, (n, k // MX), "(n, k/32) from prepare_mxfp4_w4a8")
    check.shape("row_scale", row_scale, (n,), "(n,) from prepare_mxfp4_w4a8")
    check.same_device(codes=codes, offsets=offsets, row_scale=row_scale)
    _check_offsets(offsets)
    by = codes.cpu().long().view(n, k // 128, 4, 4, 4)            # [n, s, c, j, byte]
    word = sum(by[..., i] << (8 * i) for i in range(4))            # [n, s, c, j]
    mag = torch.zeros(n, k // 128, 4, 2, 4, 4, dtype=torch.long)    # [n, s, j, h, c, t]
    sign = torch.zeros_like(mag)
    for t in range(4):
        mag[:, :, :, 0, :, t] = ((word >> (4 * t)) & 7).transpose(2, 3)
        mag[:, :, :, 1, :, t] = ((word >> (16 + 4 * t)) & 7).transpose(2, 3)
        sign[:, :, :, 0, :, t] = ((word >> (8 * t + 7)) & 1).transpose(2, 3)
        sign[:, :, :, 1, :, t] = ((word >> (8 * t + 3)) & 1).transpose(2, 3)
    entry = (offsets.cpu().long() // 8).repeat_interleave(MX, 1).view(n, k // 128, 4, 2, 4, 4)
    vals = _table_values()[entry, mag] * (1 - 2 * sign).float()
    return vals.view(n, k) * row_scale.cpu().float()[:, None]


# ---- the op ---------------------------------------------------------------------------------------------------------

def _dequant_a(a, sfa):
    # a * sfa in fp32: sfa per token (m,) or per (token, 128 columns) (m, k/128)
    a, sfa = a.float().cpu(), sfa.float().cpu()
    return a * (sfa[:, None] if sfa.dim() == 1 else sfa.repeat_interleave(BLOCK_K, 1)[:, :a.shape[1]])


def mxfp4_w4a8_gemm_nt_reference(a, sfa, codes, offsets, row_scale):
    """fp32 (a * sfa) @ W^T with W the prepared weights' values (dequant_w4a8), bf16 out."""
    w = dequant_w4a8(codes, offsets, row_scale)
    return (_dequant_a(a, sfa) @ w.T).to(torch.bfloat16).to(a.device)


def _check(a, sfa, codes, offsets, row_scale):
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    check.tensor("sfa", sfa, dtypes=(torch.float32,), ndim=(1, 2), contiguous=True)
    check.tensor("codes", codes, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check.tensor("offsets", offsets, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check.tensor("row_scale", row_scale, dtypes=(torch.float32,), ndim=1, contiguous=True)
    m, k = a.shape
    n = codes.shape[0]
    if k % BLOCK_K:
        raise ValueError(f"a must be (m, k) with k a multiple of {BLOCK_K} (as prepare_mxfp4_w4a8's weights), got "
                         f"shape {tuple(a.shape)}")
    check.shape("codes", codes, (n, k // 2), "(n, k/2) from prepare_mxfp4_w4a8, k = a.shape[1]")
    check.shape("offsets", offsets, (n, k // MX), "(n, k/32) from prepare_mxfp4_w4a8")
    check.shape("row_scale", row_scale, (n,), "(n,) from prepare_mxfp4_w4a8")
    if sfa.dim() == 1:
        check.shape("sfa", sfa, (m,), "fp32 per-token scales of a")
    else:
        check.shape("sfa", sfa, (m, k // BLOCK_K), "fp32 scales of a per (token, 128 columns)")
    check.same_device(a=a, sfa=sfa, codes=codes, offsets=offsets, row_scale=row_scale)
    _check_offsets(offsets)


W4A8_MAX_M = max(SWAPPED_TOKENS)


def mxfp4_w4a8_gemm_nt(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor,
                       row_scale: torch.Tensor) -> torch.Tensor:
    """C (m, n) bf16 = (a * sfa) @ W^T: a (m, k) e4m3 with sfa (m,) fp32 per-token scales or (m, k/128) fp32 scales
    per (token, 128 columns) (DeepGEMM's sfa, as per_token_group_quant_fp8 writes it), W the MXFP4 weights
    prepared by prepare_mxfp4_w4a8 (codes, offsets, row_scale). sm_90a: FP8 WGMMA (k % 512 == 0, n % 128 == 0;
    m <= 64 the decode kernel, larger m the contiguous grouped kernel as one expert); CPU: the fp32 reference of the
    prepared weights (slow)."""
    _check(a, sfa, codes, offsets, row_scale)
    m, k = a.shape
    n = codes.shape[0]
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        return mxfp4_w4a8_gemm_nt_reference(a, sfa, codes, offsets, row_scale)
    target = targets.resolve(a)
    if target.name != "cuda:sm_90a":
        raise ValueError(f"mxfp4_w4a8_gemm_nt runs on sm_90a (FP8 WGMMA) and the CPU, got target {target.name}")
    if m > W4A8_MAX_M and not W4A8_DENSE_PREFILL:
        raise ValueError(f"mxfp4_w4a8_gemm_nt takes decode-sized m <= {W4A8_MAX_M}, got m={m} "
                         f"(ops.gemm_w4a8.W4A8_DENSE_PREFILL is off)")
    if k % SWAPPED_K_ALIGN or n % 128:
        raise ValueError(f"mxfp4_w4a8_gemm_nt needs k % {SWAPPED_K_ALIGN} == 0 and n % 128 == 0, got n={n}, k={k}")
    if m > W4A8_MAX_M:
        return _w4a8_dense_prefill(a, sfa, codes, offsets, row_scale)
    return _w4a8_op(a, sfa, codes, offsets, row_scale)


# m > 64 on the contiguous kernel as one expert (rows padded to a multiple of 128 where they are not: a copy of a and
# sfa). Built in session 49; its GPU test (the contiguous op's bits) passed in session 52, on. False: m > 64 refused
W4A8_DENSE_PREFILL = True


def _w4a8_dense_prefill(a, sfa, codes, offsets, row_scale):
    m, k = a.shape
    rows = -(-m // 128) * 128
    if rows != m:       # zero rows past m (their ids -1: never stored but as zeros, sliced off)
        a = torch.cat([a, a.new_zeros(rows - m, k)])
        sfa = torch.cat([sfa, sfa.new_ones(rows - m, *sfa.shape[1:])])
    ids = torch.zeros(rows, dtype=torch.int32, device=a.device)
    ids[m:] = -1
    out = _dispatch.call(_w4a8_contiguous_op, _w4a8_contiguous_impl, a, sfa.contiguous(), codes[None], offsets[None],
                         row_scale[None], ids)
    return out[:m]


@torch.library.custom_op("tilecraft::mxfp4_w4a8_gemm_nt", mutates_args=())
def _w4a8_op(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor,
             row_scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], codes.shape[0], dtype=torch.bfloat16, device=a.device)
    if a.shape[0]:
        _launch(a, sfa, codes, offsets, row_scale, out)
    return out


@_w4a8_op.register_fake
def _(a, sfa, codes, offsets, row_scale):
    return a.new_empty(a.shape[0], codes.shape[0], dtype=torch.bfloat16)


W4A8_FOLD = None    # None: plan_swapped's rule (fold at <= 16 tokens); True / False: every split plan (bench A/B)
W4A8_SCALE_TMA = None   # None: plan_swapped's rule (TMA'd table offsets for splits of > 8 steps); True / False: all
# 2-split plans over 16 tokens fold in a cluster pair too (plan_swapped pairs up to 16 tokens; above, the reduce
# kernel). Session 44: 64x7168x2048 10.8 -> 10.0 us (the reduce kernel's launch gone); False: the reduce kernel (A/B)
W4A8_PAIR_WIDE = True
# Split plans' results out through shared memory as whole rows (the split's fp32 partial, or the pair's half of C in
# bf16) instead of from the accumulator's layout: the masked kernel's stores gained 1.1-11 us that way (session 46).
# None: tiles of >= SWAPPED_STAGE_OUT_TOKENS (64) tokens (session 47: 64x7168x2048 9.9 -> 9.7 us, 64x4096x7168
# 14.5 -> 13.9; at 1 and 16 tokens within 0.1-0.2 us, the 1-token pair slower, so left out); True / False: every
# split plan (bench A/B: provider tilecraft-w4a8-staged)
W4A8_STAGE_OUT = None
# The masked kernel's per-token scales (sfa (g, max_m)) by the producer's TMA ahead of the stages, as the dense
# kernel's, where max_m % 4 == 0; otherwise (and False: bench A/B) loaded from global memory in the epilogue, where
# they queue behind the grid's stages (session 46: the masked epilogue ~3500-5900 cycles against ~1060 dense)
W4A8_MASKED_SA_TMA = True
# The masked kernel's C tile out through shared memory as whole rows (16-byte stores) instead of one 2-byte store a
# value from the accumulator's layout (session 46: the stores took ~4700 cycles a block at 64x7168x2048; False: A/B)
W4A8_MASKED_STAGED = True
# Several n tiles a masked block where the grid would run more than two waves (plan_w4a8_masked's tiles): one wave,
# each block's prologue and first data paid once and its tiles' epilogues under the next tile's stream. Session 46:
# 8x64x7168x2048 34.4 -> 30.9 us (1.79x -> 1.99x torch); at two waves (8x64x4096x7168) it lost, 45.9 -> 47.2 us, so
# the plan leaves those alone. False: one tile a block everywhere (bench A/B: provider tilecraft-w4a8-onetile)
W4A8_MASKED_TILES = True
# Steps between the loop's WGMMA drains on 64-token tiles (elsewhere sm90.BURST, 4). A drain waits for the last step's
# WGMMA before the next decode; at 64 tokens that WGMMA (two warpgroups' m64n64k32 x 4, ~280 cycles of tensor time)
# shows as a ~350-cycle data wait every fourth step (session 46's traces: steps ~480, every fourth ~830). 1-16 token
# tiles measured no faster with 8 (session 44: their WGMMAs are short). Session 47: masked 8x64x4096x7168 46.5 -> 44.9
# us, 8x64x7168x2048 31.4 -> 30.1, dense 64-token rows within 0.2 us (the bf16-activation masked kernel lost 1-5 us
# with it: not there). None: the loop's default, 4 (bench A/B: provider tilecraft-w4a8-burst4)
W4A8_BURST_64 = 8
# The masked and contiguous loops without their tail bursts where k / 128 is a multiple of the burst (a block runs 0 or
# tiles x k / 128 steps, so the tails never run): 8 unrolled steps instead of 36, TileLang's lowering ~4x shorter
# (what a first call compiles), the same executed instructions. Session 52 (H200): the contiguous kernel with its
# tails and the masked kernel without them timed the same as the defaults (NOTES "Session 52"). False: the tails
# again (bench A/B: provider tilecraft-w4a8-tails)
W4A8_WHOLE_BURSTS = True
# mxfp4_w4a8_gemm_nt's 64-row blocks in two K chains (ops.gemm_mxfp4.SWAPPED_CHAINS' kernel with promotion: each
# warpgroup promotes its half of the accumulator): True, where the 128-row plan splits K (its pair, fold or reduce
# kernel goes, or its splits halve) and the 64-row plan neither pairs nor folds; "any", also where the 128-row plan
# has one split (bench provider tilecraft-w4a8-chains-any); False: off (tilecraft-w4a8-nochains). Session 66, H100,
# e4m3 activations, us, off -> "any": 16x7168x2048 8.2 -> 6.7, 32x7168x2048 8.7 -> 6.8, 64x7168x2048 10.6 -> 7.8,
# 64x2048x7168 12.0 -> 10.6, 32/64 x 4096x7168 13.0 / 14.8 -> 12.5 / 14.1; one-split 24576x1536 13.5 -> 14.3 at 16
# tokens (equal at 32, 64): True leaves those out
W4A8_CHAINS = True
W4A8_CHAINS_VALUES = (False, True, "any")
# the chains' least token tile. Session 67, H100, us, 16 -> 8 (the chains in place of the 128-row plan's 2-split pair):
# 1x7168x2048 7.4 -> 6.4, 8x7168x2048 7.4 -> 6.5; 1/8 x 4096x7168 unchanged (the 64-row plan folds there). 16: the
# chains from 16-token tiles only (bench provider tilecraft-w4a8-chains16)
W4A8_CHAINS_TOKENS = 8


def plan_w4a8(m: int, n: int, k: int, sms: int = 132, group_scales: bool = False, chains: bool | None = None) -> dict:
    """The token tile, split-K and stages of plan_swapped's rules with e4m3 activations (one byte a value) and
    128-deep stages; scale_tma, fold and pair as plan_swapped chooses them; the result staged as whole rows per
    W4A8_STAGE_OUT; then as many stages as fit next to this kernel's own tiles (the table, the factors: with
    group_scales a (tokens, steps) block of them). chains (one of W4A8_CHAINS_VALUES; None: W4A8_CHAINS): True,
    64-row blocks in two K chains where the 128-row plan splits K and the 64-row plan neither pairs nor folds; "any",
    wherever the 64-row plan neither pairs nor folds; either only for token tiles of W4A8_CHAINS_TOKENS and more; the
    plan then names block_n=64 and chains=2."""
    chains = W4A8_CHAINS if chains is None else chains
    if chains not in W4A8_CHAINS_VALUES:
        raise ValueError(f"chains must be one of {W4A8_CHAINS_VALUES} (or None: W4A8_CHAINS), got {chains!r}")
    knobs = dict(sms=sms, stage_k=BLOCK_K, a_bytes=1, stage_out=False, fold=W4A8_FOLD,
                 pair=False if W4A8_FOLD is not None else None, scale_tma=W4A8_SCALE_TMA)
    p = plan_swapped(m, n, k, **knobs)
    if chains and p["tokens"] >= W4A8_CHAINS_TOKENS and (p["splits"] > 1 or chains == "any"):
        narrow = plan_swapped(m, n, k, **knobs, block_n=64, chains=2)
        if narrow.get("chains"):
            p = narrow
    chained = "chains" in p     # (then no staged partials: the halves' tile does that job; a pair of 2 splits)
    out = dict(tokens=p["tokens"], splits=p["splits"], stages=p["stages"], scale_tma=p["scale_tma"],
               fold=p["fold"], pair=p["pair"], **({"block_n": 64, "chains": 2} if chained else {}))
    if group_scales:
        out["group_scales"] = True
    if W4A8_PAIR_WIDE and out["splits"] == 2 and not out["pair"] and not chained:
        out.update(pair=True, fold=False)
    stage = out["tokens"] >= SWAPPED_STAGE_OUT_TOKENS if W4A8_STAGE_OUT is None else W4A8_STAGE_OUT
    if stage and out["splits"] > 1 and not chained:
        out["stage_out"] = True
    if out["tokens"] == 64 and W4A8_BURST_64:
        out["burst"] = W4A8_BURST_64
    if w4a8_smem_bytes(n, k, **out) > SMEM_BUDGET:
        out["stages"] -= -(-(w4a8_smem_bytes(n, k, **out) - SMEM_BUDGET) // _stage_bytes(out["tokens"],
                                                                                          out.get("block_n", 128)))
    if out["stages"] < 2:
        raise ValueError(f"no W4A8 plan fits in shared memory for m={m}, n={n}, k={k}")
    return out


def _stage_bytes(tokens: int, block_n: int = 128) -> int:
    return tokens * BLOCK_K + block_n * BLOCK_K // 2      # e4m3 activations + packed weights of a 128-deep step


def w4a8_smem_bytes(n: int, k: int, tokens: int, splits: int, stages: int, scale_tma: bool, fold: bool = False,
                    pair: bool = False, group_scales: bool = False, stage_out: bool = False,
                    block_n: int = 128, burst: int = 0, chains: int = 1) -> int:
    """Dynamic shared memory of mxfp4_w4a8_swapped_program with these parameters (what TileLang allocates, before
    its alignment padding)."""
    kb = k // BLOCK_K
    per = -(-kb // splits)
    box = swapped_scale_box(per, kb) if scale_tma else per
    sa = tokens * _bank_spread(swapped_scale_box(per, kb)) * 4 if group_scales else tokens * 4
    recv = pair_recv_bytes(tokens, block_n, chains if pair else 0)
    out = ((tokens // 2) * (block_n + 8) * 2 if pair else tokens * (block_n + 4) * 4) if stage_out else 0
    if chains > 1:      # the halves' staging tile
        out = tokens * (block_n * chains + 4) * 4
    return (stages * _stage_bytes(tokens, block_n) + block_n * box * 4 + 2 * TABLE_ENTRIES * 4 + block_n * 4 + sa
            + recv + out)


def _launch(a, sfa, codes, offsets, row_scale, out):
    from backends.cuda.device import sm_count
    from ops.gemm_fp8 import launch_split_k, split_k_launchers

    m, k = a.shape
    n = codes.shape[0]
    check.aligned("a", a, 16, "loaded by TMA")
    check.aligned("codes", codes, 16, "loaded by TMA")
    target = targets.resolve(a)

    group = sfa.dim() == 2

    def build():
        p = plan_w4a8(m, n, k, sms=sm_count(a), group_scales=group)
        kernel = mxfp4_w4a8_swapped_program.compile(target, n=n, k=k, **p)
        if p["pair"]:       # no partials in global memory: launched as one split (Part bound, never touched)
            return (1, *split_k_launchers(kernel, target, n, 1, "bfloat16"))
        return (p["splits"], *split_k_launchers(kernel, target, n, p["splits"], "bfloat16", fold=p["fold"]))

    # every switch the plan reads: the W4A8 ones, and the bf16 kernel's that plan_swapped falls back on where a
    # W4A8 switch is None (a provider flipping those must not get launchers planned before it)
    mx = (_mxfp4.SWAPPED_FOLD, _mxfp4.SWAPPED_PAIR, _mxfp4.SWAPPED_SCALE_TMA, _mxfp4.SWAPPED_CHAINS_PAIR)
    splits, kernel, reduce = jit.launchers(("mxfp4_w4a8_gemm_nt", target.name, a.device.index, m, n, k, group,
                                            W4A8_FOLD, W4A8_SCALE_TMA, W4A8_PAIR_WIDE, W4A8_STAGE_OUT, W4A8_BURST_64,
                                            W4A8_CHAINS, W4A8_CHAINS_TOKENS, *mx), build)
    count = arrival_counters(a.device, n // 128) if splits > 1 and reduce is None else bound_only(a.device)
    trace = bound_only(a.device, SWAPPED_TRACE_WORDS).view(1, SWAPPED_TRACE_WORDS)
    args = (a, codes.view(torch.int32), _tma_scale_words(offsets), check.aligned_copy(row_scale), check.aligned_copy(sfa))
    launch_split_k(kernel, reduce, args, out, splits, count=(trace, count),
                   part=ready_partials(a.device, splits, m, n) if splits > 1 and reduce is None else None)


# ---- the masked grouped op (MoE decode) -----------------------------------------------------------------------------

def m_grouped_mxfp4_w4a8_gemm_nt_masked(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor,
                                        offsets: torch.Tensor, row_scale: torch.Tensor,
                                        masked_m: torch.Tensor) -> torch.Tensor:
    """Decode-time grouped W4A8: a (g, max_m, k) e4m3 with sfa (g, max_m) fp32 per-token scales or (g, max_m, k/128)
    per (token, 128 columns); the weights
    (g, n, k/2), (g, n, k/32), (g, n) from prepare_mxfp4_w4a8; only the first masked_m[i] rows of group i are
    computed, the rest of the (g, max_m, n) bf16 output is zeros. sm_90a: max_m <= 64, k % 512 == 0,
    n % 128 == 0; CPU: the fp32 reference."""
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=3, contiguous=True)
    check.tensor("sfa", sfa, dtypes=(torch.float32,), ndim=(2, 3), contiguous=True)
    check.tensor("masked_m", masked_m, dtypes=(torch.int32,), ndim=1, contiguous=True)
    G, max_m, k = a.shape
    if k % BLOCK_K:
        raise ValueError(f"a must be (g, max_m, k) with k a multiple of {BLOCK_K}, got shape {tuple(a.shape)}")
    n = _check_grouped_weights(codes, offsets, row_scale, k, groups=G)
    if sfa.dim() == 2:
        check.shape("sfa", sfa, (G, max_m), "fp32 per-token scales of a")
    else:
        check.shape("sfa", sfa, (G, max_m, k // BLOCK_K), "fp32 scales of a per (token, 128 columns)")
    check.shape("masked_m", masked_m, (G,), "(groups,)")
    check.same_device(a=a, sfa=sfa, codes=codes, offsets=offsets, row_scale=row_scale, masked_m=masked_m)
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        if G and bool(((masked_m < 0) | (masked_m > max_m)).any()):
            raise ValueError(f"masked_m must be in [0, {max_m}]"
                             + check.offending(masked_m, (masked_m < 0) | (masked_m > max_m)))
        out = torch.zeros(G, max_m, n, dtype=torch.bfloat16)
        for gi in range(G):
            rows = int(masked_m[gi])
            out[gi, :rows] = mxfp4_w4a8_gemm_nt_reference(a[gi, :rows], sfa[gi, :rows], codes[gi], offsets[gi],
                                                          row_scale[gi])
        return out
    target = targets.resolve(a)
    if target.name != "cuda:sm_90a":
        raise ValueError(f"m_grouped_mxfp4_w4a8_gemm_nt_masked runs on sm_90a and the CPU, got target {target.name}")
    if max_m > W4A8_MAX_M:
        raise ValueError(f"m_grouped_mxfp4_w4a8_gemm_nt_masked takes max_m <= {W4A8_MAX_M}, got {max_m}")
    if k % SWAPPED_K_ALIGN or n % 128 or k // BLOCK_K * 128 * 4 > SMEM_BUDGET // 2:
        raise ValueError(f"m_grouped_mxfp4_w4a8_gemm_nt_masked needs k % {SWAPPED_K_ALIGN} == 0, n % 128 == 0 and "
                         f"k <= {SMEM_BUDGET // 2 // 4}, got n={n}, k={k}")
    return _w4a8_masked_op(a, sfa, codes, offsets, row_scale, masked_m)


def _check_grouped_weights(codes, offsets, row_scale, k, groups=None):
    """The grouped ops' prepared weights (g, n, k/2), (g, n, k/32), (g, n) against a's k (and groups, where a has its
    own group count); returns n."""
    check.tensor("codes", codes, dtypes=(torch.uint8,), ndim=3, contiguous=True)
    check.tensor("offsets", offsets, dtypes=(torch.uint8,), ndim=3, contiguous=True)
    check.tensor("row_scale", row_scale, dtypes=(torch.float32,), ndim=2, contiguous=True)
    G, n = (codes.shape[0] if groups is None else groups), codes.shape[1]
    check.shape("codes", codes, (G, n, k // 2), "(g, n, k/2) from prepare_mxfp4_w4a8, k = a.shape[-1]")
    check.shape("offsets", offsets, (G, n, k // MX), "(g, n, k/32) from prepare_mxfp4_w4a8")
    check.shape("row_scale", row_scale, (G, n), "(g, n) from prepare_mxfp4_w4a8")
    _check_offsets(offsets)
    return n


def _check_offsets(offsets):
    # the kernels index their e4m3 table (TABLE_ENTRIES entries of 8 bytes) by these bytes: anything else than
    # prepare_mxfp4_w4a8's values would read past it. Offsets are a prepared weight: once a tensor passed, it is
    # marked with its version counter and not read again (no device sync a call) until it is written in place
    # (inference-mode tensors have no counter: read every call)
    if _values.enabled(offsets) and offsets.numel():
        version = None if offsets.is_inference() else offsets._version   # (inference tensors keep no counter)
        if version is not None and getattr(offsets, "_tilecraft_checked", None) == version:
            return
        bad = (offsets % 8 != 0) | (offsets > 8 * (TABLE_ENTRIES - 1))
        if bool(bad.any()):
            v = int(offsets.flatten()[int(bad.flatten().long().argmax())])
            raise ValueError(f"offsets must be prepare_mxfp4_w4a8's table offsets (multiples of 8 up to "
                             f"{8 * (TABLE_ENTRIES - 1)}), got {v}")
        if version is not None:
            offsets._tilecraft_checked = version


def plan_w4a8_masked(max_m: int, k: int, group_scales: bool = False, groups: int = 0, n: int = 0,
                     sms: int = 132) -> dict:
    """The masked kernel's token tile and stages: plan_masked_swapped's with e4m3 activations, then as many stages as
    fit next to the table offsets (and, with group_scales, the (token, step) scales) of the whole K; the per-token
    scales by TMA (token_scales_tma) where SA's rows allow it (max_m % 4 == 0) and W4A8_MASKED_SA_TMA is on; C staged
    as whole rows with W4A8_MASKED_STAGED. tiles (W4A8_MASKED_TILES, given groups and n): where the grid would run
    more than two waves, the fewest n tiles a block (a divisor of n / 128) that put it in one wave of `sms` blocks, if
    their table offsets fit next to 4+ stages; else 1 (session 46: 8x64x7168x2048, 3.4 waves -> 4 tiles a block, 34.4
    -> 30.9 us; 8x64x4096x7168, 2 waves -> 2 tiles, 45.9 -> 47.2 us). burst: W4A8_BURST_64 on 64-token tiles (with
    several tiles a block, where k / 128 is a multiple of it)."""
    p = plan_masked_swapped(max_m, k, a_bytes=1)
    sa_tma = W4A8_MASKED_SA_TMA and not group_scales and max_m % 4 == 0
    staged = W4A8_MASKED_STAGED
    kb = k // BLOCK_K

    def fixed(tiles):   # shared memory besides the stages
        return (tiles * (128 * kb * 4 + 128 * 4) + (p["tokens"] * _bank_spread(kb) * 4 if group_scales else 0)
                + (p["tokens"] * 4 if sa_tma else 0) + (p["tokens"] * 136 * 2 if staged else 0) + 1024)

    tiles = 1
    if W4A8_MASKED_TILES and groups and n and n % 128 == 0 and groups * (n // 128) > 2 * sms:
        n_tiles = n // 128
        fit = [t for t in range(2, n_tiles + 1) if n_tiles % t == 0 and groups * n_tiles // t <= sms
               and fixed(t) + 4 * _stage_bytes(p["tokens"]) <= SMEM_BUDGET]
        tiles = fit[0] if fit else 1
    stages = p["stages"]
    while stages > 2 and stages * _stage_bytes(p["tokens"]) + fixed(tiles) > SMEM_BUDGET:
        stages -= 1           # room for the table offsets (and the token scales, the staged tile) of the whole K
    out = dict(tokens=p["tokens"], stages=stages, token_scales_tma=sa_tma, staged_out=staged, tiles=tiles)
    if p["tokens"] == 64 and W4A8_BURST_64 and (tiles == 1 or kb % W4A8_BURST_64 == 0):
        out["burst"] = W4A8_BURST_64
        if W4A8_WHOLE_BURSTS and kb % W4A8_BURST_64 == 0:
            out["whole_bursts"] = True
    return out


@torch.library.custom_op("tilecraft::m_grouped_mxfp4_w4a8_gemm_nt_masked", mutates_args=())
def _w4a8_masked_op(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor,
                    row_scale: torch.Tensor, masked_m: torch.Tensor) -> torch.Tensor:
    G, max_m, k = a.shape
    n = codes.shape[1]
    out = torch.empty(G, max_m, n, dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0:
        return out
    check.aligned("a", a, 16, "loaded by TMA")
    check.aligned("codes", codes, 16, "loaded by TMA")
    target = targets.resolve(a)
    group = sfa.dim() == 3
    from backends.cuda.device import sm_count

    p = plan_w4a8_masked(max_m, k, group, G, n, sms=sm_count(a))
    kernel = jit.launchers(("mxfp4_w4a8_gemm_nt_masked", target.name, n, k, *p.values(), group),
                           lambda: mxfp4_w4a8_masked_program.compile(target, n=n, k=k, group_scales=group,
                                                                     **p).launcher())
    kernel(a, codes.view(torch.int32), _tma_scale_words(offsets), check.aligned_copy(row_scale),
           check.aligned_copy(sfa), masked_m, out)
    return out


@_w4a8_masked_op.register_fake
def _(a, sfa, codes, offsets, row_scale, masked_m):
    return a.new_empty(*a.shape[:2], codes.shape[1], dtype=torch.bfloat16)


# ---- the contiguous grouped op (MoE prefill) ------------------------------------------------------------------------

# Token tiles of the contiguous kernel (the WGMMA's N): a 128-aligned segment holds whole tiles. At 128 tokens each
# 128-deep step's decode (the same instructions as at 64) feeds twice the MMA work.
W4A8_CONTIGUOUS_TOKENS = (64, 128)
W4A8_CONTIGUOUS_TILE = 128      # the planned tile (bench A/B: provider tilecraft-w4a8-contig64)
# Not kept (session 52, H200, mxfp4-prefill; NOTES "Session 52"): several n tiles a contiguous block at short K, and
# the 128-token promotion as two column halves with a temporary each; both 1-2% slower than one tile and one
# temporary.


def plan_w4a8_contiguous(k: int, group_scales: bool = False, tokens: int = 0) -> dict:
    """The contiguous kernel's plan (mxfp4_w4a8_masked_program(contiguous=True)): W4A8_CONTIGUOUS_TILE tokens a tile
    (or `tokens`), the token scales (or the (token, step) scales) and the chunk's row ids by TMA, C staged as whole
    rows, 8 steps between WGMMA drains where k / 128 allows, one promotion temporary at 128 tokens (registers), and as
    many stages as fit next to the whole K's table offsets (one n tile a block)."""
    tokens = tokens or W4A8_CONTIGUOUS_TILE
    if tokens not in W4A8_CONTIGUOUS_TOKENS:
        raise ValueError(f"the contiguous W4A8 kernel's token tile must be one of {W4A8_CONTIGUOUS_TOKENS}, "
                         f"got {tokens}")
    if k % SWAPPED_K_ALIGN:
        raise ValueError(f"the contiguous W4A8 kernel needs k % {SWAPPED_K_ALIGN} == 0 (TMA'd table offsets), "
                         f"got k={k}")
    kb = k // BLOCK_K

    # shared memory besides the stages: the table offsets and row factors, the token scales, the staged C tile, the
    # row ids, the decode table
    fixed = (128 * kb * 4 + 128 * 4 + (tokens * _bank_spread(kb) * 4 if group_scales else tokens * 4)
             + tokens * (128 + 8) * 2 + tokens * 4 + 2 * TABLE_ENTRIES * 4 + 1024)
    stages = min(8, (SMEM_BUDGET - fixed) // _stage_bytes(tokens))
    if stages < 2:
        raise ValueError(f"k={k} is too long for the contiguous W4A8 kernel's staged table offsets")
    out = dict(tokens=tokens, stages=stages, token_scales_tma=not group_scales, staged_out=True, contiguous=True)
    if group_scales:
        out["group_scales"] = True
    if kb % 8 == 0:
        out["burst"] = 8
        if W4A8_WHOLE_BURSTS:
            out["whole_bursts"] = True
    if tokens == 128:
        out["temps"] = 1
    return out


def m_grouped_mxfp4_w4a8_gemm_nt_contiguous(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor,
                                            offsets: torch.Tensor, row_scale: torch.Tensor,
                                            m_indices: torch.Tensor) -> torch.Tensor:
    """Prefill-time grouped W4A8 (MoE experts): a (M, k) e4m3 in 128-aligned segments per expert (moe_dispatch's
    contiguous layout, M % 128 == 0) with sfa (M,) fp32 per-token scales or (M, k/128) per (token, 128 columns);
    m_indices (M,) int32 each row's expert, -1 for padding rows (their output is zeros; a segment's padding rows
    follow its live ones); the weights (g, n, k/2), (g, n, k/32), (g, n) from prepare_mxfp4_w4a8. Returns (M, n)
    bf16 = (a * sfa) @ W[m_indices[r]]^T row by row. sm_90a: k % 512 == 0, n % 128 == 0, e4m3 WGMMA with the
    weights decoded into registers, 128 rows of a tile the WGMMA's N; CPU: the fp32 reference."""
    check.tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    check.tensor("sfa", sfa, dtypes=(torch.float32,), ndim=(1, 2), contiguous=True)
    check.tensor("m_indices", m_indices, dtypes=(torch.int32,), ndim=1, contiguous=True)
    M, k = a.shape
    if k % BLOCK_K:
        raise ValueError(f"a must be (M, k) with k a multiple of {BLOCK_K}, got shape {tuple(a.shape)}")
    if M % 128:
        raise ValueError(f"a's row count must be a multiple of 128 (the segment alignment), got {M}")
    n = _check_grouped_weights(codes, offsets, row_scale, k)
    G = codes.shape[0]
    if sfa.dim() == 1:
        check.shape("sfa", sfa, (M,), "fp32 per-token scales of a")
    else:
        check.shape("sfa", sfa, (M, k // BLOCK_K), "fp32 scales of a per (token, 128 columns)")
    check.shape("m_indices", m_indices, (M,), "(M,) one per row of a")
    check.same_device(a=a, sfa=sfa, codes=codes, offsets=offsets, row_scale=row_scale, m_indices=m_indices)
    check.some_groups("codes", G, M)
    if ((a.device.type == "cpu" or _values.enabled(m_indices)) and M
            and bool(((m_indices < -1) | (m_indices >= G)).any())):
        raise ValueError(f"m_indices must be in [-1, {G})"
                         + check.offending(m_indices, (m_indices < -1) | (m_indices >= G)))
    if a.device.type == "cpu":
        targets.resolve(a)      # (TILECRAFT_TARGET naming another device is an error here too)
        out = torch.zeros(M, n, dtype=torch.bfloat16)
        for gi in range(G):
            rows = (m_indices == gi).nonzero().flatten()
            if rows.numel():
                out[rows] = mxfp4_w4a8_gemm_nt_reference(a[rows], sfa[rows], codes[gi], offsets[gi], row_scale[gi])
        return out
    target = targets.resolve(a)
    if target.name != "cuda:sm_90a":
        raise ValueError(f"m_grouped_mxfp4_w4a8_gemm_nt_contiguous runs on sm_90a and the CPU, got target "
                         f"{target.name}")
    if k % SWAPPED_K_ALIGN or n % 128:
        raise ValueError(f"m_grouped_mxfp4_w4a8_gemm_nt_contiguous needs k % {SWAPPED_K_ALIGN} == 0 and n % 128 == 0, "
                         f"got n={n}, k={k}")
    if G == 0 and M:
        raise ValueError("codes must hold at least one expert's weights (g >= 1) for rows of a to be computed")
    plan_w4a8_contiguous(k, sfa.dim() == 2)        # k too long for the staged table offsets: its ValueError here
    return _dispatch.call(_w4a8_contiguous_op, _w4a8_contiguous_impl, a, sfa, codes, offsets, row_scale, m_indices)


def _w4a8_contiguous_impl(a, sfa, codes, offsets, row_scale, m_indices):
    M, k = a.shape
    G, n = codes.shape[:2]
    out = torch.empty(M, n, dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0:
        return out
    check.aligned("a", a, 16, "loaded by TMA")
    check.aligned("codes", codes, 16, "loaded by TMA")
    target = targets.resolve(a)
    group = sfa.dim() == 2
    p = plan_w4a8_contiguous(k, group)
    t = p["tokens"]
    kernel = jit.launchers(("mxfp4_w4a8_gemm_nt_contiguous", target.name, n, k, *sorted(p.items())),
                           lambda: mxfp4_w4a8_masked_program.compile(target, n=n, k=k, **p).launcher())
    sfa = check.aligned_copy(sfa)
    kernel(a.view(M // t, t, k), codes.view(torch.int32), _tma_scale_words(offsets), check.aligned_copy(row_scale),
           sfa.view(M // t, t, *sfa.shape[1:]), check.aligned_copy(m_indices).view(M // t, t), out.view(M // t, t, n))
    return out


@torch.library.custom_op("tilecraft::m_grouped_mxfp4_w4a8_gemm_nt_contiguous", mutates_args=())
def _w4a8_contiguous_op(a: torch.Tensor, sfa: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor,
                        row_scale: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    return _w4a8_contiguous_impl(a, sfa, codes, offsets, row_scale, m_indices)


@_w4a8_contiguous_op.register_fake
def _(a, sfa, codes, offsets, row_scale, m_indices):
    return a.new_empty(a.shape[0], codes.shape[1], dtype=torch.bfloat16)
