"""Probe: the FP8-cache MLA decode with both GEMMs' cache operand converted into registers (bench/NOTES.md
"Session 34: an FP8 kernel with no converted tiles").

    python -m bench.proto_mla_fp8_rs              # GPU: error vs fp32 torch, time beside the op's kernels
    python -m bench.proto_mla_fp8_rs --source     # no GPU: the sm_90a build's WGMMA kinds, registers, spills

The op's swapped FP8 kernel (h_q <= 16) converts each step's e4m3 latent into fp16 operand tiles in
shared memory, which both WGMMAs then read: ~310 KB of shared-memory traffic a 64-token step against
~42 KB of cache bytes, which binds it at ~62% of copy bandwidth. Here the cache tile is the A operand
of both GEMMs (tokens are M for S^T = K Q^T; latent columns are M for O^T = V^T P^T), and A may come
from registers (wgmma RS): each thread loads the raw e4m3 bytes of its fragment and converts them
(F2FP.F16.E4M3.UNPACK_B, exact), so no converted tile is written or read. The per-128 scales fold as in
the op's kernel: into the partial scores (S^T = rope + sum_g scale_g * K_g Q_g^T) and into one P copy
per 128 latent columns. Plain TileLang (T.Pipelined, T.gemm, one warpgroup of MMA threads), contiguous
cache arrays (latent e4m3, scales, bf16 rope: 656 bytes a token as in the op), splits combined in torch:
it checks that the formulation lowers, is right, and what it could be worth, not the op's interface.

Status (session 34, results/proto-mla-fp8-rs-*): right (max abs error 1.7e-5 against fp32), but slow
(486 us at b=128 x 4096 against the op's ~135): one warpgroup of MMA threads a CTA with nothing to
overlap its chain, V^T gathered one byte and one conversion a value. The softmax runs down S^T's
columns in its accumulator layout (T.reduce_max / reduce_sum over dim 0: TileLang reduces across the
warpgroup through a shared workspace); through a transposed copy the softmax tile was inferred 8x
replicated (844 us). What the production form needs is in bench/NOTES.md "Session 34".

v2/v3 (session 35, --variants; bench/NOTES.md "Session 35"): hand-written fragment fills from 128-byte-swizzled
group tiles (v2-sync 239 us), the groups issued on two fragments in turn (v2-async 221), two CTAs an SM
(v2-async-2cta 144 with 2 splits), the softmax by hand (v3). ops/mla_decode_fp8_rs.py is v3 for the op.
"""

import argparse
import sys

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from ops.mla_decode_fp8_rs import HELPER_SOURCE, _k_fill, _v_fill, latent_column, q_column

H, DL, DR, G, BLOCK_N = 16, 512, 64, 128, 64
NG = DL // G
LOG2E = 1.4426950408889634


@T.macro
def _scores_group(g, kl_s, ql_s, ks_s, a_k, acc_g, s_t):
    # s_t += scale_g[token] * K_g Q_g^T, K_g converted into the A fragment
    for i, j in T.Parallel(BLOCK_N, G):
        a_k[i, j] = T.cast(kl_s[i, g * G + j], "float16")
    T.gemm(a_k, ql_s[g, :, :], acc_g, transpose_B=True, clear_accum=True)
    for i, j in T.Parallel(BLOCK_N, H):
        s_t[i, j] += acc_g[i, j] * ks_s[i, g]


@T.macro
def _p_copy(g, p_t, ks_s, p_s):
    # (P * scale_g[token])^T in fp16 from P^T's accumulator layout: the B operand of group g's P V
    for t, h in T.Parallel(BLOCK_N, H):
        p_s[g, h, t] = T.cast(p_t[t, h] * ks_s[t, g], "float16")


@T.macro
def _pv_group(g, kl_s, p_s, a_v, o_g, alpha_s):
    # o_g (latent columns g*G.. x heads) = o_g * alpha + V_g^T (P * scale_g)^T, V_g^T converted into A
    for d, h in T.Parallel(G, H):
        o_g[d, h] *= alpha_s[h]
    for d, t in T.Parallel(G, BLOCK_N):
        a_v[d, t] = T.cast(kl_s[t, g * G + d], "float16")
    T.gemm(a_v, p_s[g, :, :], o_g, transpose_B=True)


@T.macro
def _store_group(g, o_g, l, OP, bi, si):
    for d, h in T.Parallel(G, H):
        OP[bi, si, h, g * G + d] = o_g[d, h] / l[h]


def rs_program(splits=1, stages=2, threads=128, scale=576 ** -0.5):
    b, n = T.dynamic("b, n")
    scale_log2 = scale * LOG2E

    @T.prim_func
    def mla_fp8_rs(QL: T.Tensor((b, NG, H, G), "float16"), QR: T.Tensor((b, H, DR), "bfloat16"),
                   KL: T.Tensor((b, n, DL), "float8_e4m3"), KS: T.Tensor((b, n, NG), "float32"),
                   KR: T.Tensor((b, n, DR), "bfloat16"), OP: T.Tensor((b, splits, H, DL), "float32"),
                   LP: T.Tensor((b, splits, H), "float32")):
        with T.Kernel(b, splits, threads=threads) as (bi, si):
            ql_s = T.alloc_shared((NG, H, G), "float16")
            qr_s = T.alloc_shared((H, DR), "bfloat16")
            kl_s = T.alloc_shared((BLOCK_N, DL), "float8_e4m3")
            ks_s = T.alloc_shared((BLOCK_N, NG), "float32")
            kr_s = T.alloc_shared((BLOCK_N, DR), "bfloat16")
            p_s = T.alloc_shared((NG, H, BLOCK_N), "float16")       # P * scale_g, one copy per group
            alpha_s = T.alloc_shared((H,), "float32")
            l_s = T.alloc_shared((H,), "float32")
            m_s = T.alloc_shared((H,), "float32")
            a_k = T.alloc_fragment((BLOCK_N, G), "float16")
            a_v = T.alloc_fragment((G, BLOCK_N), "float16")
            acc_g = T.alloc_fragment((BLOCK_N, H), "float32")
            s_t = T.alloc_fragment((BLOCK_N, H), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            rs = T.alloc_fragment((H,), "float32")
            o0 = T.alloc_fragment((G, H), "float32")
            o1 = T.alloc_fragment((G, H), "float32")
            o2 = T.alloc_fragment((G, H), "float32")
            o3 = T.alloc_fragment((G, H), "float32")
            T.copy(QL[bi, :, :, :], ql_s)
            T.copy(QR[bi, :, :], qr_s)
            T.fill(o0, 0.0)
            T.fill(o1, 0.0)
            T.fill(o2, 0.0)
            T.fill(o3, 0.0)
            T.fill(m, -T.infinity("float32"))
            T.fill(l, 0.0)
            per = T.ceildiv(n, BLOCK_N * splits)                    # steps of this split (n % (64 splits) == 0)
            for kb in T.Pipelined(per, num_stages=stages):
                t0 = (si * per + kb) * BLOCK_N
                T.copy(KL[bi, t0:t0 + BLOCK_N, :], kl_s)
                T.copy(KS[bi, t0:t0 + BLOCK_N, :], ks_s)
                T.copy(KR[bi, t0:t0 + BLOCK_N, :], kr_s)
                T.gemm(kr_s, qr_s, s_t, transpose_B=True, clear_accum=True)     # the rope's scores
                _scores_group(0, kl_s, ql_s, ks_s, a_k, acc_g, s_t)
                _scores_group(1, kl_s, ql_s, ks_s, a_k, acc_g, s_t)
                _scores_group(2, kl_s, ql_s, ks_s, a_k, acc_g, s_t)
                _scores_group(3, kl_s, ql_s, ks_s, a_k, acc_g, s_t)
                # the softmax down S^T's columns in its accumulator layout (TileLang reduces across the
                # warpgroup through a shared workspace): no transposed copy, no replicated tile
                for t, h in T.Parallel(BLOCK_N, H):
                    s_t[t, h] = s_t[t, h] * scale_log2
                T.copy(m, m_prev)
                T.reduce_max(s_t, m, dim=0, clear=False)
                for t, h in T.Parallel(BLOCK_N, H):
                    s_t[t, h] = T.exp2(s_t[t, h] - m[h])
                T.reduce_sum(s_t, rs, dim=0)
                for h in T.Parallel(H):
                    alpha_s[h] = T.exp2(m_prev[h] - m[h])
                    l[h] = l[h] * T.exp2(m_prev[h] - m[h]) + rs[h]
                _p_copy(0, s_t, ks_s, p_s)
                _p_copy(1, s_t, ks_s, p_s)
                _p_copy(2, s_t, ks_s, p_s)
                _p_copy(3, s_t, ks_s, p_s)
                _pv_group(0, kl_s, p_s, a_v, o0, alpha_s)
                _pv_group(1, kl_s, p_s, a_v, o1, alpha_s)
                _pv_group(2, kl_s, p_s, a_v, o2, alpha_s)
                _pv_group(3, kl_s, p_s, a_v, o3, alpha_s)
            for h in T.Parallel(H):             # (through shared memory: the outputs' layout is not the
                l_s[h] = l[h]                   # softmax's; an LP store in this loop was dropped)
                m_s[h] = m[h]
            for h in T.Parallel(H):
                LP[bi, si, h] = (m_s[h] + T.log2(l_s[h])) / LOG2E      # natural-log lse of the split
            _store_group(0, o0, l_s, OP, bi, si)
            _store_group(1, o1, l_s, OP, bi, si)
            _store_group(2, o2, l_s, OP, bi, si)
            _store_group(3, o3, l_s, OP, bi, si)

    return mla_fp8_rs

# (the v2/v3 fragment fills and softmax helpers are the op kernel's, ops/mla_decode_fp8_rs.py; the probe has no
# sequence tails: every V fill passes 64 valid tokens)
def q_permuted(ql):
    """Q^T's latent columns in the order of tc_e4m3_k_fragment's K (ql: (..., 128) per group)."""
    import torch

    return ql[..., q_column(torch.arange(G))]


@T.macro
def _fold(g, acc, s_t, ks_s):
    for i, j in T.Parallel(BLOCK_N, H):
        s_t[i, j] += acc[i, j] * ks_s[i, g]


@T.macro
def _store_group_v2(g, o_g, l, OP, bi, si):
    for d, h in T.Parallel(G, H):
        OP[bi, si, h, g * G + latent_column(d)] = o_g[d, h] / l[h]


def rs_program_v2(splits=1, stages=2, issue="async", blocks=1, softmax="tl", threads=128, scale=576 ** -0.5):
    """The probe with hand-written fragment fills from a 128-byte-swizzled raw tile (one 64 x 128 tile a
    latent group): K's by 16-byte loads (Q^T's columns permuted to match, q_permuted), V^T's by 32-bit loads
    of four latent columns a token (the M order permuted, latent_column); issue="async": each GEMM's four
    groups issued on two fragments in turn (T.wgmma_gemm, wait 1), so a group's fill runs under the
    previous group's MMA; blocks=2: two CTAs an SM (their chains overlap)."""
    assert issue in ("sync", "async") and blocks in (1, 2) and softmax in ("tl", "hand")
    b, n = T.dynamic("b, n")
    scale_log2 = scale * LOG2E

    @T.prim_func
    def mla_fp8_rs2(QL: T.Tensor((b, NG, H, G), "float16"), QR: T.Tensor((b, H, DR), "bfloat16"),
                    KL: T.Tensor((b, n, DL), "float8_e4m3"), KS: T.Tensor((b, n, NG), "float32"),
                    KR: T.Tensor((b, n, DR), "bfloat16"), OP: T.Tensor((b, splits, H, DL), "float32"),
                    LP: T.Tensor((b, splits, H), "float32")):
        with T.Kernel(b, splits, threads=threads) as (bi, si):
            if blocks == 2:
                T.annotate_min_blocks_per_sm(2)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(224)
            ql_s = T.alloc_shared((NG, H, G), "float16")
            qr_s = T.alloc_shared((H, DR), "bfloat16")
            kl_s = T.alloc_shared((NG, BLOCK_N, G), "float8_e4m3")
            ks_s = T.alloc_shared((BLOCK_N, NG), "float32")
            kr_s = T.alloc_shared((BLOCK_N, DR), "bfloat16")
            p_s = T.alloc_shared((NG, H, BLOCK_N), "float16")       # P * scale_g, one copy per group
            alpha_s = T.alloc_shared((H,), "float32")
            l_s = T.alloc_shared((H,), "float32")
            m_s = T.alloc_shared((H,), "float32")
            a_k0 = T.alloc_fragment((BLOCK_N, G), "float16")
            a_k1 = T.alloc_fragment((BLOCK_N, G), "float16")
            a_v0 = T.alloc_fragment((G, BLOCK_N), "float16")
            a_v1 = T.alloc_fragment((G, BLOCK_N), "float16")
            acc0 = T.alloc_fragment((BLOCK_N, H), "float32")
            acc1 = T.alloc_fragment((BLOCK_N, H), "float32")
            s_t = T.alloc_fragment((BLOCK_N, H), "float32")
            if softmax == "tl":
                m = T.alloc_fragment((H,), "float32")
                m_prev = T.alloc_fragment((H,), "float32")
                l = T.alloc_fragment((H,), "float32")
                rs = T.alloc_fragment((H,), "float32")
            o0 = T.alloc_fragment((G, H), "float32")
            o1 = T.alloc_fragment((G, H), "float32")
            o2 = T.alloc_fragment((G, H), "float32")
            o3 = T.alloc_fragment((G, H), "float32")
            red = T.alloc_shared((128,), "float32")     # softmax="hand": the warps' column maxima, two parities
            m_t = T.alloc_local((4,), "float32")         # softmax="hand": the thread's 4 heads (slots)
            l_t = T.alloc_local((4,), "float32")
            alpha_t = T.alloc_local((4,), "float32")
            T.annotate_layout({kl_s: make_full_bank_swizzled_layout(kl_s)})
            T.import_source(HELPER_SOURCE)
            T.copy(QL[bi, :, :, :], ql_s)
            T.copy(QR[bi, :, :], qr_s)
            T.fill(o0, 0.0)
            T.fill(o1, 0.0)
            T.fill(o2, 0.0)
            T.fill(o3, 0.0)
            if softmax == "tl":
                T.fill(m, -T.infinity("float32"))
                T.fill(l, 0.0)
            else:
                for i in T.serial(4):
                    m_t[i] = -T.infinity("float32")
                    l_t[i] = 0.0
            per = T.ceildiv(n, BLOCK_N * splits)                    # steps of this split (n % (64 splits) == 0)
            for kb in T.Pipelined(per, num_stages=stages):
                t0 = (si * per + kb) * BLOCK_N
                T.copy(KL[bi, t0:t0 + BLOCK_N, 0:G], kl_s[0, :, :])
                T.copy(KL[bi, t0:t0 + BLOCK_N, G:2 * G], kl_s[1, :, :])
                T.copy(KL[bi, t0:t0 + BLOCK_N, 2 * G:3 * G], kl_s[2, :, :])
                T.copy(KL[bi, t0:t0 + BLOCK_N, 3 * G:4 * G], kl_s[3, :, :])
                T.copy(KS[bi, t0:t0 + BLOCK_N, :], ks_s)
                T.copy(KR[bi, t0:t0 + BLOCK_N, :], kr_s)
                if issue == "sync":
                    T.gemm(kr_s, qr_s, s_t, transpose_B=True, clear_accum=True)     # the rope's scores
                    _k_fill(kl_s, None, 0, a_k0)
                    T.gemm(a_k0, ql_s[0, :, :], acc0, transpose_B=True, clear_accum=True)
                    _fold(0, acc0, s_t, ks_s)
                    _k_fill(kl_s, None, 1, a_k1)
                    T.gemm(a_k1, ql_s[1, :, :], acc1, transpose_B=True, clear_accum=True)
                    _fold(1, acc1, s_t, ks_s)
                    _k_fill(kl_s, None, 2, a_k0)
                    T.gemm(a_k0, ql_s[2, :, :], acc0, transpose_B=True, clear_accum=True)
                    _fold(2, acc0, s_t, ks_s)
                    _k_fill(kl_s, None, 3, a_k1)
                    T.gemm(a_k1, ql_s[3, :, :], acc1, transpose_B=True, clear_accum=True)
                    _fold(3, acc1, s_t, ks_s)
                else:
                    T.wgmma_gemm(kr_s, qr_s, s_t, transpose_B=True, clear_accum=True)
                    _k_fill(kl_s, None, 0, a_k0)
                    T.wgmma_gemm(a_k0, ql_s[0, :, :], acc0, transpose_B=True, clear_accum=True)
                    _k_fill(kl_s, None, 1, a_k1)
                    T.wgmma_gemm(a_k1, ql_s[1, :, :], acc1, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)                                 # the rope's and group 0's
                    _fold(0, acc0, s_t, ks_s)
                    _k_fill(kl_s, None, 2, a_k0)
                    T.wgmma_gemm(a_k0, ql_s[2, :, :], acc0, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    _fold(1, acc1, s_t, ks_s)
                    _k_fill(kl_s, None, 3, a_k1)
                    T.wgmma_gemm(a_k1, ql_s[3, :, :], acc1, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    _fold(2, acc0, s_t, ks_s)
                    T.wait_wgmma(0)
                    _fold(3, acc1, s_t, ks_s)
                if softmax == "tl":
                    for t, h in T.Parallel(BLOCK_N, H):
                        s_t[t, h] = s_t[t, h] * scale_log2
                    T.copy(m, m_prev)
                    T.reduce_max(s_t, m, dim=0, clear=False)
                    for t, h in T.Parallel(BLOCK_N, H):
                        s_t[t, h] = T.exp2(s_t[t, h] - m[h])
                    T.reduce_sum(s_t, rs, dim=0)
                    for h in T.Parallel(H):
                        alpha_s[h] = T.exp2(m_prev[h] - m[h])
                        l[h] = l[h] * T.exp2(m_prev[h] - m[h]) + rs[h]
                else:
                    T.evaluate(T.call_extern("handle", "tc_softmax_t", s_t.data, m_t.data, l_t.data, alpha_t.data,
                                             T.access_ptr(red[0], "rw", 128), kb % 2, scale_log2))
                _p_copy(0, s_t, ks_s, p_s)
                _p_copy(1, s_t, ks_s, p_s)
                _p_copy(2, s_t, ks_s, p_s)
                _p_copy(3, s_t, ks_s, p_s)
                if softmax == "tl":
                    for d, h in T.Parallel(G, H):
                        o0[d, h] *= alpha_s[h]
                        o1[d, h] *= alpha_s[h]
                        o2[d, h] *= alpha_s[h]
                        o3[d, h] *= alpha_s[h]
                else:
                    T.evaluate(T.call_extern("handle", "tc_rescale_t", o0.data, alpha_t.data))
                    T.evaluate(T.call_extern("handle", "tc_rescale_t", o1.data, alpha_t.data))
                    T.evaluate(T.call_extern("handle", "tc_rescale_t", o2.data, alpha_t.data))
                    T.evaluate(T.call_extern("handle", "tc_rescale_t", o3.data, alpha_t.data))
                if issue == "sync":
                    _v_fill(kl_s, None, 0, a_v0)
                    T.gemm(a_v0, p_s[0, :, :], o0, transpose_B=True)
                    _v_fill(kl_s, None, 1, a_v1)
                    T.gemm(a_v1, p_s[1, :, :], o1, transpose_B=True)
                    _v_fill(kl_s, None, 2, a_v0)
                    T.gemm(a_v0, p_s[2, :, :], o2, transpose_B=True)
                    _v_fill(kl_s, None, 3, a_v1)
                    T.gemm(a_v1, p_s[3, :, :], o3, transpose_B=True)
                else:
                    _v_fill(kl_s, None, 0, a_v0)
                    T.wgmma_gemm(a_v0, p_s[0, :, :], o0, transpose_B=True)
                    _v_fill(kl_s, None, 1, a_v1)
                    T.wgmma_gemm(a_v1, p_s[1, :, :], o1, transpose_B=True)
                    T.wait_wgmma(1)
                    _v_fill(kl_s, None, 2, a_v0)
                    T.wgmma_gemm(a_v0, p_s[2, :, :], o2, transpose_B=True)
                    T.wait_wgmma(1)
                    _v_fill(kl_s, None, 3, a_v1)
                    T.wgmma_gemm(a_v1, p_s[3, :, :], o3, transpose_B=True)
                    T.wait_wgmma(0)
            if softmax == "tl":
                for h in T.Parallel(H):
                    l_s[h] = l[h]
                    m_s[h] = m[h]
            else:
                T.evaluate(T.call_extern("handle", "tc_softmax_t_finish", m_t.data, l_t.data,
                                         T.access_ptr(red[0], "rw", 128), T.access_ptr(l_s[0], "w", H),
                                         T.access_ptr(m_s[0], "w", H)))
            for h in T.Parallel(H):
                LP[bi, si, h] = (m_s[h] + T.log2(l_s[h])) / LOG2E
            _store_group_v2(0, o0, l_s, OP, bi, si)
            _store_group_v2(1, o1, l_s, OP, bi, si)
            _store_group_v2(2, o2, l_s, OP, bi, si)
            _store_group_v2(3, o3, l_s, OP, bi, si)

    return mla_fp8_rs2


VARIANTS = {   # name: rs_program_v2 keywords (v1: rs_program, the session-34 probe)
    "v2-sync": dict(issue="sync"),
    "v2-async": dict(issue="async"),
    "v2-async-2cta": dict(issue="async", blocks=2),
    "v2-sync-2cta": dict(issue="sync", blocks=2),
    "v3": dict(issue="async", softmax="hand"),
    "v3-2cta": dict(issue="async", blocks=2, softmax="hand"),
}


def build(variant, splits):
    return rs_program(splits) if variant == "v1" else rs_program_v2(splits, **VARIANTS[variant])



def _source(splits=1, variant="v1"):
    from codegen import targets

    t = targets.get("cuda:sm_90a")
    with t.tvm() as tv:
        return tilelang.lower(build(variant, splits), target=tv).kernel_source


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="store_true", help="static stats of the sm_90a build only (no GPU)")
    ap.add_argument("--splits", default="2", help="comma-separated split counts (b=128 rows)")
    ap.add_argument("--profile", action="store_true",
                    help="one launch of the first variant at b=128 n=4096 (first split count) between "
                         "cudaProfilerStart/Stop, for ncu --profile-from-start off")
    ap.add_argument("--variants", default="v1," + ",".join(VARIANTS), help="comma-separated: v1, " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    splits_list = [int(x) for x in args.splits.split(",")]
    if args.source:
        from backends.cuda.sass import build_cubin, sass_stats

        for v in variants:
            src = _source(splits_list[0], v)
            st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
            h = st.histogram
            print(f"{v}: HGMMA {h.get('HGMMA', 0)}, F2FP {sum(x for k, x in h.items() if k.startswith('F2FP'))}, "
                  f"LDS {sum(x for k, x in h.items() if k.startswith('LDS'))}, registers {st.registers}, "
                  f"spill stores {st.spill_stores}; wgmma kinds: "
                  f"{sorted(set(x for x in ('wgmma_rs', 'wgmma_ss') if x in src))}")
        return
    import torch

    import ops
    from bench.timing import bench_cuda
    from ops.mla_decode import _mla_decode_impl
    from codegen import jit, targets

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --source for the static build")
    t = targets.get("cuda:sm_90a")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, tilelang {tilelang.__version__}")
    shapes = ((128, 4096),) if args.profile else ((4, 512), (128, 4096), (128, 8192))
    if args.profile:
        variants, splits_list = variants[:1], splits_list[:1]
    for b, n in shapes:
        g = torch.Generator().manual_seed(0)
        q = (torch.randn(b, 1, H, DL + DR, generator=g) / 4).bfloat16().cuda()
        kv = torch.randn(b * n // 64, 64, 1, DL + DR, generator=g).bfloat16().cuda()
        cache = ops.quantize_mla_kv_fp8(kv)                                  # (pages, 64, 1, 656) bytes
        flat = cache.view(b, n, -1)
        kl = flat[..., :DL].contiguous().view(torch.float8_e4m3fn)
        ks = flat[..., DL:DL + 16].contiguous().view(torch.float32)
        kr = flat[..., DL + 16:].contiguous().view(torch.bfloat16)
        ql = q[:, 0, :, :DL].float().reshape(b, H, NG, G).permute(0, 2, 1, 3).contiguous().half()
        qlp = q_permuted(ql).contiguous()
        qr = q[:, 0, :, DL:].contiguous()
        deq = ops.dequantize_mla_kv_fp8(cache).view(b, n, DL + DR).float()
        scale = (DL + DR) ** -0.5
        s = torch.einsum("bhd,bnd->bhn", q[:, 0].float(), deq) * scale
        ref = torch.einsum("bhn,bnd->bhd", torch.softmax(s, -1), deq[..., :DL])
        nbytes = b * n * 656 + b * H * (DL + DR) * 2
        for v in variants:
            for splits in (splits_list if b == 128 else [2]):
                try:
                    kern = tilelang.compile(build(v, splits), target=t.tvm(), execution_backend=jit._execution_backend(t))
                except Exception as e:     # noqa: BLE001 (a probe: report and go on)
                    print(f"{v} splits={splits}: build failed: {str(e)[:300]}", flush=True)
                    continue
                op = torch.empty(b, splits, H, DL, device="cuda")
                lp = torch.empty(b, splits, H, device="cuda")
                qa = ql if v == "v1" else qlp
                kern(qa, qr, kl, ks, kr, op, lp)
                w = torch.softmax(lp, 1)                                      # combine the splits
                out = (op * w[..., None]).sum(1)
                err = float((out - ref).abs().max())
                if args.profile:
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    kern(qa, qr, kl, ks, kr, op, lp)
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    print(f"{v} splits={splits}: profiled one launch, max abs err {err:.2e}")
                    return
                ms = bench_cuda(lambda: kern(qa, qr, kl, ks, kr, op, lp))["median_ms"]
                print(f"b={b} n={n} {v} splits={splits}: max abs err {err:.2e}; kernel {ms * 1e3:.1f} us, "
                      f"{nbytes / ms / 1e6:.0f} GB/s", flush=True)
        if b == 128:                                                          # the op, same inputs, paged
            table = torch.arange(b * n // 64, dtype=torch.int32, device="cuda").view(b, n // 64)
            lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            sched = ops.get_mla_schedule(lens, 1, H, n // 64)
            for fmt, c in (("bf16", kv), ("fp8", cache)):    # as bench.op's providers call it (no checks)
                ms_op = bench_cuda(lambda: _mla_decode_impl(q, c, table, lens, scale, True, sched,
                                                            kv_format=fmt))["median_ms"]
                print(f"b={b} n={n} op {fmt}: {ms_op * 1e3:.1f} us (with its combine)", flush=True)
    print("(the probe's kernels alone, their splits combined outside the timing)")


if __name__ == "__main__":
    main()
