"""Probe (CPU, no GPU needed): does a bf16 MLA decode with the query in registers fit the register file? (bench/NOTES.md
"Session 53: the bf16 cache at h_q = 128, a design with Q in registers").

    python -m bench.probe_mla_qreg                 # each register split: max register index, spills, HGMMA, C75xx

The design, for the compute-bound rows (64 query rows a CTA, 64-token steps, bf16 cache): three warpgroups, no
producer warpgroup. WG0 holds the tile's query (64 rows x 576, bf16) as WGMMA's register operand for the whole
loop (9 fragments of 64 columns: 144 registers a thread) and does every step's scores (S = Q K^T, wgmma RS: only
K is read from shared memory) and softmax, writing P (bf16) and the step's factors to shared memory. WG1 and WG2
each hold half of O (64 rows x 256 latent columns fp32: 128 registers a thread) and run the P V MMAs (SS: P and V
from shared memory). A step moves ~232 KB through shared memory (K 72 read, V 64, P 8 + 16, the TMA's 72) against
~296 KB in today's kernel, where Q is read from shared memory by every score MMA.

Registers: 384 threads launch at 168 a thread (64,512 of 65,536); setmaxnreg gives WG0 `wg0` and WG1/WG2 `pv`
each (wg0 + 2 pv <= 504). This kernel has that live set with stand-ins for the rest (no TMA, no paging, no
barriers between the roles, a lean softmax; wrong results on purpose) and reports what ptxas allocates, warpgroup
by warpgroup (each built alone: the SASS's largest register index is then that warpgroup's). A spilled Q fragment
is fatal: ptxas reloads it between the MMAs that read it and waits for each MMA (a wait for 0 in flight after
every HGMMA, no C75xx warning). Session 53's answer: Q's rope and one latent part from shared memory, the other 7
parts in registers (WG0 176: R167; P V 160: R151; no spills, one wait a loop)."""

import argparse
import re

import tilelang
import tilelang.language as T

from codegen.tile import emit

ROWS, STEP, PART, PARTS, V_PARTS = 64, 64, 64, 9, 8     # 8 latent parts of 64 columns + the rope


# the softmax of a 64 x 64 step in WGMMA's accumulator layout (rows r = 16 warp + lane / 4 and r + 8; columns
# 8 nb + 2 (lane % 4) + e at s[4 nb + 2 rv + e]): row maxima over the quad, P = exp2(s - max) written as bf16
# pairs, the factors of the two rows by lanes 0 of each quad, the running sums kept
SOFTMAX_SOURCE = r"""
__device__ __forceinline__ void qreg_softmax(float* s, float* ml, void* p, float* al) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, r = 16 * w + lane / 4, c = lane & 3;
#pragma unroll
  for (int rv = 0; rv < 2; ++rv) {
    float mx = ml[rv];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) mx = fmaxf(mx, fmaxf(s[4 * nb + 2 * rv], s[4 * nb + 2 * rv + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float alpha = exp2f(ml[rv] - mx);
    float sum = 0.f;
    unsigned short* row = reinterpret_cast<unsigned short*>(p) + (r + 8 * rv) * 64;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      const float a = exp2f(s[4 * nb + 2 * rv] - mx), b = exp2f(s[4 * nb + 2 * rv + 1] - mx);
      sum += a + b;
      unsigned pk;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(b), "f"(a));
      *reinterpret_cast<unsigned*>(row + 8 * nb + 2 * c) = pk;
    }
    ml[2 + rv] = ml[2 + rv] * alpha + sum;
    ml[rv] = mx;
    if (c == 0) al[r + 8 * rv] = alpha;
  }
}
"""


def build(wg0=200, pv=(152, 152), stages=3, roles=(0, 1, 2), reg_parts=PARTS, pv_parts=(4, 4)):
    """wg0, pv: setmaxnreg of WG0 and of each P V warpgroup; reg_parts: Q's 64-column parts (of 9, the rope last)
    that WG0 holds in registers, the rest read from shared memory by their MMAs; pv_parts: the 64-column latent
    parts of O each P V warpgroup holds (4 + 4, or 3 + 3 + 2 with a fourth warpgroup); roles: the warpgroups built
    (0: WG0)."""
    starts = [sum(pv_parts[:i]) for i in range(len(pv_parts))]
    launch = 65536 // (128 * (1 + len(pv_parts))) // 8 * 8

    @T.prim_func
    def probe(Q: T.Tensor((ROWS, PARTS * PART), "bfloat16"), KV: T.Tensor((1024, STEP, PARTS * PART), "bfloat16"),
              O: T.Tensor((ROWS, V_PARTS * PART), "float32"), n: T.int32):
        with T.Kernel(132, threads=128 * (1 + len(pv_parts))):
            q_s = T.alloc_shared((PARTS, ROWS, PART), "bfloat16")
            kv = [T.alloc_shared((stages, STEP, PART), "bfloat16") for _ in range(PARTS)]
            p_s = T.alloc_shared((ROWS, STEP), "bfloat16")
            al_s = T.alloc_shared((ROWS,), "float32")
            qf = [T.alloc_fragment((ROWS, PART), "bfloat16") for _ in range(reg_parts)]
            s = T.alloc_fragment((ROWS, STEP), "float32")
            ml = T.alloc_local((4,), "float32")          # the thread's two rows' running max and sum
            o = [[T.alloc_fragment((ROWS, PART), "float32") for _ in range(c)] for c in pv_parts]
            tx = T.get_thread_binding()
            for p, h, c in T.Parallel(PARTS, ROWS, PART):
                q_s[p, h, c] = Q[h, p * PART + c]
            T.sync_threads()
            if tx < 128 and 0 in roles:
                T.set_max_nreg(wg0, int(wg0 > launch))
                _load_q(q_s, qf)
                T.import_source(SOFTMAX_SOURCE)
                for i in T.unroll(4):
                    ml[i] = T.if_then_else(i < 2, -T.infinity("float32"), 0.0)
                for k in T.serial(n):
                    slot = k % stages
                    _scores(q_s, qf, kv, slot, s)
                    T.wait_wgmma(0)
                    T.evaluate(T.call_extern("handle", "qreg_softmax", s.data, ml.data,
                                             T.access_ptr(p_s[0, 0], "w", ROWS * STEP),
                                             T.access_ptr(al_s[0], "w", ROWS)))
                O[T.get_thread_binding(), 0] = ml[0] + ml[1] + ml[2] + ml[3]
            elif tx >= 128 and tx < 256 and 1 in roles:
                T.set_max_nreg(pv[0], int(pv[0] > launch))
                _pv(starts[0], n, stages, kv, p_s, al_s, o[0], O)
            elif tx >= 256 and tx < 384 and 2 in roles:
                T.set_max_nreg(pv[1], int(pv[1] > launch))
                _pv(starts[1], n, stages, kv, p_s, al_s, o[1], O)
            elif tx >= 384 and 3 in roles:
                T.set_max_nreg(pv[-1], int(pv[-1] > launch))
                _pv(starts[-1], n, stages, kv, p_s, al_s, o[-1], O)
    return probe


def _load_q(q_s, qf):
    for p in range(len(qf)):
        emit(T.copy(q_s[p, :, :], qf[p]))


def _scores(q_s, qf, kv, slot, s):
    # Q's parts past len(qf) from shared memory (SS), the others from registers (RS)
    for p in range(PARTS):
        a = q_s[p, :, :] if p >= len(qf) else qf[p]
        emit(T.wgmma_gemm(a, kv[p][slot, :, :], s, transpose_B=True, clear_accum=(p == 0)))


@T.macro
def _pv(first, n, stages, kv, p_s, al_s, o, O):
    # this warpgroup's latent parts first .. first + len(o) - 1 of O
    _clear(o)
    for k in T.serial(n):
        _pv_step(first, k % stages, kv, p_s, al_s, o)
        T.wait_wgmma(0)
    _store(first, o, O)


def _clear(o):
    for t in range(len(o)):
        emit(T.clear(o[t]))


def _pv_step(first, slot, kv, p_s, al_s, o):
    for t in range(len(o)):
        _rescale(o[t], al_s)
    for t in range(len(o)):
        emit(T.wgmma_gemm(p_s, kv[first + t][slot, :, :], o[t], transpose_B=False))


@T.macro
def _rescale(o, al_s):
    for i, j in T.Parallel(ROWS, PART):
        o[i, j] *= al_s[i]


def _store(first, o, O):
    for t in range(len(o)):
        _store_part(o[t], O, (first + t) * PART)


@T.macro
def _store_part(o, O, col0):
    for i, j in T.Parallel(ROWS, PART):
        O[i, col0 + j] = o[i, j]


# name: (wg0, the P V warpgroups' registers, Q's parts in registers, parts of O a P V warpgroup)
PLANS = {"3 warpgroups, WG0 200 / P V 152, Q in registers": (200, (152, 152), 9, (4, 4)),
         "3 warpgroups, WG0 184 / P V 160, the rope's Q from shared memory": (184, (160, 160), 8, (4, 4)),
         "3 warpgroups, WG0 192 / P V 152, the rope's Q from shared memory": (192, (152, 152), 8, (4, 4)),
         "3 warpgroups, WG0 168 / P V 168, 6 of Q's 9 parts in registers": (168, (168, 168), 6, (4, 4)),
         "3 warpgroups, WG0 176 / P V 160, 7 of Q's 9 parts in registers": (176, (160, 160), 7, (4, 4)),
         "4 warpgroups, WG0 192 / P V 112, 112, 96 (parts 3, 3, 2), the rope's Q from shared memory":
             (192, (112, 112, 96), 8, (3, 3, 2))}


def sass_of(wg0, pv, reg_parts, pv_parts, roles):
    """(max register index in the SASS, spill stores, spill loads, HGMMA count, WGMMA waits of 0 in flight,
    ptxas's C75xx warnings) of the plan's sm_90a build with the warpgroups `roles`."""
    from tvm.target import Target

    from backends.cuda.sass import compile_cubin, disassemble, wgmma_serialized

    config = {"tl.disable_warp_specialized": True, "tl.enable_fast_math": True, "tl.disable_buffer_init_check": True,
              "tl.disable_thread_storage_sync": True}
    with tilelang.transform.PassContext(config=config), Target({"kind": "cuda", "arch": "sm_90a"}) as t:
        prim = build(wg0, pv, roles=roles, reg_parts=reg_parts, pv_parts=pv_parts)
        src = tilelang.lower(prim, target=t).kernel_source
    cubin, log = compile_cubin(src, "sm_90a")
    sass = disassemble(cubin)
    return (max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)), sass.count("STL"), sass.count("LDL"),
            sass.count("HGMMA"), sass.count("DEPBAR.LE gsb0, 0x0"), wgmma_serialized(log))


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for name, (wg0, pv, reg_parts, pv_parts) in PLANS.items():
        for roles in [(0,)] + [(w,) for w in range(1, len(pv_parts) + 1) if w == 1 or pv_parts[w - 1] != pv_parts[0]]:
            top, stl, ldl, hgmma, drains, serial = sass_of(wg0, pv, reg_parts, pv_parts, roles)
            print(f"{name}, warpgroup {roles[0]} alone: max R{top}, spill stores {stl}, loads {ldl}, HGMMA {hgmma}, "
                  f"waits for 0 in flight {drains}, C75xx: {serial or 'none'}")


if __name__ == "__main__":
    main()
