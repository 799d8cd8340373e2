"""Probe (CPU, no GPU needed): does the FP8-cache MLA design at 64 query rows fit the register file? (bench/NOTES.md
"Open GPU checks (end of session 45)" item 5, "Session 50").

    python -m bench.probe_mla_fp8_rows64            # the three fragment plans: max register index, spills, HGMMA

The design (tokens as WGMMA's M, the 64 query rows as N; the e4m3 cache converted into register fragments, wgmma
RS): each of two MMA warpgroups holds half of O^T (256 latent x 64 rows fp32: 128 registers a thread) for every
step, and on its own steps S^T (64 tokens x 64 rows: 32) plus one 128-column group's partial (32) and the K
fragment(s) being filled. This kernel has exactly that live set (two warpgroups at setmaxnreg 240, a producer at
24: 128 x (2 x 240 + 24) = 64,512 registers), with stand-ins for everything else (no TMA, no softmax, wrong
results on purpose), and reports what ptxas allocates in the MMA branch. The softmax state (a row's max and sum
for the thread's 16 row columns) is not in it: what is left under 240 is what it may use."""

import argparse
import re

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

ROWS, STEP, GROUP, GROUPS = 64, 64, 128, 4


@T.macro
def _chain(w, n, kfrag, two, kl_s, ks_s, ql_s, p_s, O, o0, o1, s_t, acc, a_k, a_v, a_k2):
    T.clear(o0)
    T.clear(o1)
    for step in T.serial(n):
        T.clear(s_t)
        for g in T.unroll(GROUPS):
            if two:   # two half-group fragments: the second's fill under the first's MMA
                for i, j in T.Parallel(STEP, 64):
                    a_k[i, j] = T.cast(kl_s[i, g * GROUP + j], "float16")
                T.wgmma_gemm(a_k, ql_s[g, :, 0:64], acc, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(STEP, 64):
                    a_k2[i, j] = T.cast(kl_s[i, g * GROUP + 64 + j], "float16")
                T.wgmma_gemm(a_k2, ql_s[g, :, 64:128], acc, transpose_B=True)
                T.wait_wgmma(0)
            else:
                for c in T.unroll(GROUP // kfrag):
                    for i, j in T.Parallel(STEP, kfrag):
                        a_k[i, j] = T.cast(kl_s[i, g * GROUP + c * kfrag + j], "float16")
                    T.wgmma_gemm(a_k, ql_s[g, :, c * kfrag:(c + 1) * kfrag], acc, transpose_B=True,
                                 clear_accum=(c == 0))
                    T.wait_wgmma(0)
            for i, j in T.Parallel(STEP, ROWS):
                s_t[i, j] += acc[i, j] * ks_s[i, g]
        for g, h, t in T.Parallel(GROUPS, ROWS, STEP):
            p_s[w, g, h, t] = T.cast(T.exp2(s_t[t, h]) * ks_s[t, g], "float16")
        for i, j in T.Parallel(GROUP, STEP):
            a_v[i, j] = T.cast(kl_s[j, (2 * w) * GROUP + i], "float16")
        T.wgmma_gemm(a_v, p_s[w, 2 * w, :, :], o0, transpose_B=True)
        T.wait_wgmma(0)
        for i, j in T.Parallel(GROUP, STEP):
            a_v[i, j] = T.cast(kl_s[j, (2 * w + 1) * GROUP + i], "float16")
        T.wgmma_gemm(a_v, p_s[w, 2 * w + 1, :, :], o1, transpose_B=True)
        T.wait_wgmma(0)
    for i, j in T.Parallel(GROUP, ROWS):
        O[w, i, j] = o0[i, j] + o1[i, j]


def _frags(kfrag):
    return (T.alloc_fragment((GROUP, ROWS), "float32"), T.alloc_fragment((GROUP, ROWS), "float32"),
            T.alloc_fragment((STEP, ROWS), "float32"), T.alloc_fragment((STEP, ROWS), "float32"),
            T.alloc_fragment((STEP, kfrag), "float16"), T.alloc_fragment((GROUP, STEP), "float16"),
            T.alloc_fragment((STEP, 64), "float16"))


def build(kfrag=128, two=False):
    @T.prim_func
    def probe(KV: T.Tensor((1024, STEP, 512), "float8_e4m3fn"), KS: T.Tensor((1024, STEP, GROUPS), "float32"),
              Q: T.Tensor((ROWS, 512), "float16"), O: T.Tensor((2, 256, ROWS), "float32"), n: T.int32):
        with T.Kernel(132, threads=384) as bid:
            kl_s = T.alloc_shared((STEP, 512), "float8_e4m3fn")
            ks_s = T.alloc_shared((STEP, GROUPS), "float32")
            ql_s = T.alloc_shared((GROUPS, ROWS, GROUP), "float16")
            p_s = T.alloc_shared((2, GROUPS, ROWS, STEP), "float16")
            T.annotate_layout({p_s: make_full_bank_swizzled_layout(p_s)})
            f0 = _frags(kfrag)
            f1 = _frags(kfrag)
            tx = T.get_thread_binding()
            for g, h, k in T.Parallel(GROUPS, ROWS, GROUP):
                ql_s[g, h, k] = Q[h, g * GROUP + k]
            T.sync_threads()
            if tx < 128:
                T.set_max_nreg(240, 1)
                _chain(0, n, kfrag, two, kl_s, ks_s, ql_s, p_s, O, *f0)
            elif tx < 256:
                T.set_max_nreg(240, 1)
                _chain(1, n, kfrag, two, kl_s, ks_s, ql_s, p_s, O, *f1)
            else:
                T.set_max_nreg(24, 0)
    return probe


with tilelang.tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}) as t:
    pass


PLANS = {"one 128-column K fragment, waited": (128, False), "one 64-column K fragment, waited": (64, False),
         "two 64-column K fragments, the second filled under the first's MMA": (64, True)}


def sass_of(kfrag, two):
    """(max register index in the SASS, spill stores, spill loads, HGMMA count) of the plan's sm_90a build."""
    from tvm.target import Target

    from backends.cuda.sass import build_cubin, disassemble

    config = {"tl.disable_warp_specialized": True, "tl.enable_fast_math": True, "tl.disable_buffer_init_check": True}
    with tilelang.transform.PassContext(config=config), Target({"kind": "cuda", "arch": "sm_90a"}) as t:
        src = tilelang.lower(build(kfrag, two), target=t).kernel_source
    sass = disassemble(build_cubin(src, "sm_90a"))
    return (max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)), sass.count("STL"), sass.count("LDL"),
            sass.count("HGMMA"))


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for name, (kfrag, two) in PLANS.items():
        top, stl, ldl, hgmma = sass_of(kfrag, two)
        print(f"{name}: max R{top} (of 240), spill stores {stl}, loads {ldl}, HGMMA {hgmma}")


if __name__ == "__main__":
    main()
