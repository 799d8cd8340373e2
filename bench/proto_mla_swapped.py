"""Probe for MLA decode at few heads with the operands swapped (bench/NOTES.md "MLA v8 probe").

    python -m bench.proto_mla_swapped            # GPU: correctness vs fp32 torch and time (bf16, h_q = 16)
    python -m bench.proto_mla_swapped --source   # no GPU: the sm_90a source's WGMMA shapes, registers, spills

With h_q = 16 the production kernel pads the heads to WGMMA's M = 64. Here the tokens are M instead:
S^T = K Q^T is (64 tokens x 16 heads), the softmax runs down its columns (through a 4 KB shared
transpose), and O^T (512 x 16) += V^T P^T takes V^T straight from the cache tile (an MN-major A).
Plain TileLang (T.Pipelined, T.gemm), contiguous KV, one block a batch row, no paging, splits or
FP8: it checks that the formulation lowers and is right, not its speed.
"""

import argparse
import sys

import tilelang
import tilelang.language as T

H, D_QK, D_V, BLOCK_N = 16, 576, 512, 64


def swapped_program(threads=256, stages=2, scale=D_QK ** -0.5):
    b, n = T.dynamic("b, n")
    scale_log2 = scale * 1.4426950408889634

    @T.prim_func
    def mla_swapped(Q: T.Tensor((b, H, D_QK), "bfloat16"), KV: T.Tensor((b, n, D_QK), "bfloat16"),
                    O: T.Tensor((b, H, D_V), "bfloat16")):
        with T.Kernel(b, threads=threads) as bi:
            q_s = T.alloc_shared((H, D_QK), "bfloat16")
            kv_s = T.alloc_shared((BLOCK_N, D_QK), "bfloat16")
            st_s = T.alloc_shared((BLOCK_N, H), "float32")        # S^T, read back transposed
            p_s = T.alloc_shared((H, BLOCK_N), "bfloat16")
            alpha_s = T.alloc_shared((H,), "float32")
            s_t = T.alloc_fragment((BLOCK_N, H), "float32")
            sc = T.alloc_fragment((H, BLOCK_N), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            rs = T.alloc_fragment((H,), "float32")
            o_t = T.alloc_fragment((D_V, H), "float32")           # O^T: latent rows x heads
            T.copy(Q[bi, :, :], q_s)
            T.fill(o_t, 0.0)
            T.fill(m, -T.infinity("float32"))
            T.fill(l, 0.0)
            for kb in T.Pipelined(T.ceildiv(n, BLOCK_N), num_stages=stages):
                T.copy(KV[bi, kb * BLOCK_N:(kb + 1) * BLOCK_N, :], kv_s)
                T.gemm(kv_s, q_s, s_t, transpose_B=True, clear_accum=True)            # S^T = K Q^T
                T.copy(s_t, st_s)
                for h, t in T.Parallel(H, BLOCK_N):
                    sc[h, t] = T.if_then_else(kb * BLOCK_N + t < n, st_s[t, h] * scale_log2, -T.infinity("float32"))
                T.copy(m, m_prev)
                T.reduce_max(sc, m, dim=1, clear=False)
                for h, t in T.Parallel(H, BLOCK_N):
                    sc[h, t] = T.exp2(sc[h, t] - m[h])
                T.reduce_sum(sc, rs, dim=1)
                for h in T.Parallel(H):
                    alpha_s[h] = T.exp2(m_prev[h] - m[h])
                    l[h] = l[h] * T.exp2(m_prev[h] - m[h]) + rs[h]
                T.copy(sc, p_s)
                for d, h in T.Parallel(D_V, H):
                    o_t[d, h] = o_t[d, h] * alpha_s[h]
                T.gemm(kv_s[:, 0:D_V], p_s, o_t, transpose_A=True, transpose_B=True)  # O^T += V^T P^T
            for d, h in T.Parallel(D_V, H):
                O[bi, h, d] = T.cast(o_t[d, h] / l[h], "bfloat16")

    return mla_swapped


def main(argv=None):
    from codegen import jit, targets

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="store_true", help="static stats of the sm_90a build only (no GPU)")
    args = ap.parse_args(argv)
    t = targets.get("cuda:sm_90a")
    if args.source:
        from backends.cuda.sass import build_cubin, sass_stats

        with t.tvm() as tv:
            src = tilelang.lower(swapped_program(), target=tv).kernel_source
        st = sass_stats(build_cubin(src, "sm_90a"), "sm_90a")
        print(f"HGMMA {st.histogram.get('HGMMA', 0)}, registers {st.registers}, spill stores {st.spill_stores}")
        return
    import torch

    from bench.timing import bench_cuda

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --source for the static build")
    kern = tilelang.compile(swapped_program(), target=t.tvm(), execution_backend=jit._execution_backend(t))
    for b, n in ((4, 300), (128, 4096)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, H, D_QK, generator=g).bfloat16().cuda()
        kv = torch.randn(b, n, D_QK, generator=g).bfloat16().cuda()
        o = torch.empty(b, H, D_V, dtype=torch.bfloat16, device="cuda")
        kern(q, kv, o)
        s = torch.einsum("bhd,bnd->bhn", q.float(), kv.float()) * D_QK ** -0.5
        ref = torch.einsum("bhn,bnd->bhd", torch.softmax(s, -1), kv[..., :D_V].float())
        err = float((o.float() - ref).abs().max())
        ms = bench_cuda(lambda: kern(q, kv, o))["median_ms"]
        nbytes = b * n * D_QK * 2 + b * H * (D_QK + D_V) * 2
        print(f"b={b} n={n}: max abs err {err:.2e}; {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
