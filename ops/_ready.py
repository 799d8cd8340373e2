"""The fenceless split-K fold (CUDA): partials whose words say themselves whether they have landed.

Part starts as READY_EMPTY in every word (ops._workspace.ready_partials) and goes back to it as the tile's last
block reads it. A split block stores its partial (a value with READY_EMPTY's bits is stored as the canonical NaN:
arithmetic never makes it) and arrives on the tile's counter with no fence (tile.last_arrival ordered=False); the
last to arrive reads each split's words with relaxed loads, again until none is READY_EMPTY, adds them in split
order (the reduce kernel's bits) and sets them back. Its path after its loop is then the counter's round trip and one
read of the partials, where a fenced fold (threadFenceReduction's) waits for its own stores, then the counter, then
the reads: ~2500 cycles at 1x4096x7168 in the session-43 traces (bench/NOTES.md "Session 44").

Used by the MXFP4 swapped kernels (ops.gemm_mxfp4, ops.gemm_w4a8) and the FP8 v3 loop's split plans
(ops.gemm_fp8 fold=True with overlap=True). A program imports READY_SOURCE (T.import_source or
tile.import_cuda_helpers) and calls ready_value / ready_fold.
"""

# no `from __future__ import annotations`: TileLang evaluates annotations itself
import tilelang.language as T

READY_EMPTY = -1            # 0xFFFFFFFF: a NaN with every payload bit set
READY_SOURCE = r"""
__device__ __forceinline__ float tc_ready_value(float v) {   // v, or the canonical NaN if v has READY_EMPTY's bits
  return __float_as_uint(v) == 0xFFFFFFFFu ? __uint_as_float(0x7FFFFFFFu) : v;
}
__device__ __forceinline__ uint4 tc_ready_load4(const float* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ bool tc_ready_empty4(uint4 v) {
  return (v.x == 0xFFFFFFFFu) | (v.y == 0xFFFFFFFFu) | (v.z == 0xFFFFFFFFu) | (v.w == 0xFFFFFFFFu);
}
// For each of the first `valid` of kItems items i: C[i * item + 0..3] (bf16) = ((P0 + P1) + P2) + ... of the four
// fp32 words at part + i * item + s * stride. Every item's and split's words are loaded at once (one round trip, not
// kItems x kSplits), then any still READY_EMPTY loaded again until it is not; each is set back to READY_EMPTY (the
// next launch finds every word empty).
template <int kSplits, int kItems>
__device__ __forceinline__ void tc_ready_fold4(void* c, float* part, long stride, long item, int valid) {
  uint4 v[kItems][kSplits];
#pragma unroll
  for (int i = 0; i < kItems; ++i)
#pragma unroll
    for (int s = 0; s < kSplits; ++s)
      if (i < valid) v[i][s] = tc_ready_load4(part + i * item + s * stride);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (i >= valid) break;
#pragma unroll
    for (int s = 0; s < kSplits; ++s) {
      float* p = part + i * item + s * stride;
      while (tc_ready_empty4(v[i][s])) v[i][s] = tc_ready_load4(p);
      *reinterpret_cast<uint4*>(p) = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
    }
    float4 acc = make_float4(__uint_as_float(v[i][0].x), __uint_as_float(v[i][0].y), __uint_as_float(v[i][0].z),
                             __uint_as_float(v[i][0].w));
#pragma unroll
    for (int s = 1; s < kSplits; ++s) {
      acc.x = __fadd_rn(acc.x, __uint_as_float(v[i][s].x)), acc.y = __fadd_rn(acc.y, __uint_as_float(v[i][s].y));
      acc.z = __fadd_rn(acc.z, __uint_as_float(v[i][s].z)), acc.w = __fadd_rn(acc.w, __uint_as_float(v[i][s].w));
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
    reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(c) + i * item)[0] =
        make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
  }
}
"""


def ready_value(v):
    """A partial's value as stored for the fold (never READY_EMPTY's bits)."""
    return T.call_extern("float32", "tc_ready_value", v)


def ready_fold(C, Part, splits, rows, cols, col0, end, part_rows, threads, row0=0, in_flight=8):
    """The tile's rows [row0, end) x columns [col0, col0 + cols) of C (bf16, 2-D) = the in-order sum of Part[s]
    (splits, part_rows, n) at the same places, by `threads` threads (0 .. threads - 1 of the block), four columns a
    thread at a time: threads / (cols / 4) rows a pass, up to `in_flight` loads a thread at once (rows: the tile's
    row count, which bounds the passes)."""
    per_row = cols // 4
    step = threads // per_row                       # rows a pass
    items = -(-rows // step)
    batch = max(1, min(items, in_flight // splits))
    for b in range(-(-items // batch)):
        # (the bounds go in as a tuple: a macro parameter bound to a kernel's Var renames it in the source)
        _ready_fold_batch(C, Part, splits, per_row, step, col0, (row0, end, part_rows), b * batch,
                          min(batch, items - b * batch))


@T.macro
def _ready_fold_batch(C, Part, splits, per_row, step, col0, bounds, first, count):
    # bounds (row0, end, part_rows), read in place: a name given to a kernel's Var in a macro renames it in the source
    tid = T.get_thread_binding()
    j = (first * step + tid // per_row) if isinstance(bounds[0], int) and bounds[0] == 0 else (
        bounds[0] + first * step + tid // per_row)
    if j < bounds[1]:
        col = col0 + tid % per_row * 4
        T.evaluate(T.call_extern("handle", f"tc_ready_fold4<{splits}, {count}>", T.address_of(C[j, col]),
                                 T.address_of(Part[0, j, col]), T.cast(bounds[2], "int64") * Part.shape[2],
                                 T.cast(step, "int64") * Part.shape[2],
                                 T.min((bounds[1] - j + step - 1) // step, count)))
