"""Rules shared by every CUDA target (sm_90a, sm_100a)."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import emit, state


@register("grid", "cuda")
def grid(blocks, threads=128):
    state()["threads"] = threads
    return T.Kernel(blocks, threads=threads)


@register("cluster_grid", "cuda")
def cluster_grid(blocks, threads, cluster):
    # cudaLaunchKernelEx with a cluster dimension; 8 is the portable limit on sm_90a and sm_100a
    if cluster not in (1, 2, 4, 8):
        raise ValueError(f"cluster must be 1, 2, 4 or 8 blocks on CUDA, got {cluster}")
    state()["threads"] = threads
    return T.ClusterKernel(blocks, cluster_dims=cluster, threads=threads)


@register("fragment", "cuda")
def fragment(shape, dtype="float32"):
    return T.alloc_fragment(shape, dtype)


@register("stage", "cuda")
def stage(shape, dtype):
    return T.alloc_shared(shape, dtype)


@register("operand", "cuda")
def operand(shape, dtype):
    return T.alloc_shared(shape, dtype)


@register("lane_shuffle", "cuda")
def lane_shuffle(value, src, xor=False):
    return T.shfl_xor(value, src) if xor else T.shfl_sync(value, src)


@register("reciprocal", "cuda")
def reciprocal(x):
    # (the same bits as 1.0f / x; nvcc expands either into a reciprocal sequence with a slow-path call at every
    # occurrence and merges none across a row's unrolled elements, so a caller computes it once a row:
    # ops/mla_decode.py's persistent epilogue, bench/NOTES.md "Session 77")
    return T.call_extern("float32", "__frcp_rn", x)


@register("lane_first", "cuda")
def lane_first(pred):
    votes = T.cast(T.ballot_sync(pred), "int32")  # CUDA's 32-lane ballot, zero-extended by TileLang
    return T.call_extern("int32", "__ffs", votes) - 1


@register("lane_shuffle_up", "cuda")
def lane_shuffle_up(value, delta):
    return T.shfl_up(value, delta)


@register("lane_ballot", "cuda")
def lane_ballot(pred):
    return T.cast(T.ballot_sync(pred), "uint32")  # zero-extended by TileLang: the low 32 bits are the warp


# named barrier of the block's first `threads`: barrier(threads=), last_arrival(threads=) (TileLang
# reserves 0-2; the sm90 loops use 12-15); last_arrival(group=g) takes FIRST_THREADS_BAR - g (g = 0 or 1)
FIRST_THREADS_BAR = 11
ARRIVAL_GROUPS = 2


@register("barrier", "cuda")
def barrier(threads=None, group=0):
    if group not in range(ARRIVAL_GROUPS) or (group and threads is None):
        raise ValueError(f"barrier: group must be 0 .. {ARRIVAL_GROUPS - 1} (with threads= for group > 0: threads "
                         f"group * threads .. take part), got group={group!r}, threads={threads!r}")
    if threads is None:
        return T.sync_threads()
    _check_threads("barrier", threads)
    return T.sync_threads(FIRST_THREADS_BAR - group, threads)


def _check_threads(word, threads):
    if threads % 32 or not 0 < threads <= 1024:
        raise ValueError(f"{word}: threads must be whole warps (a multiple of 32 up to 1024), got {threads}")


@T.macro
def _arrive(count, index, arrivals, last, threads, ordered, group):
    _arrive_barrier(threads, group)                     # every thread's global stores are issued
    if T.get_thread_binding() == group * threads:
        if ordered:
            # release: the fence is cumulative, so it orders the whole block's stores (seen by thread 0
            # through the barrier) before the arrival
            T.evaluate(T.call_extern("handle", "__threadfence"))
        prev = T.atomic_add(count[index], 1, return_prev=True)
        last[0] = T.if_then_else(prev == arrivals - 1, 1, 0)
        if prev == arrivals - 1:
            count[index] = 0                            # the next launch counts from zero again
            if ordered:
                T.evaluate(T.call_extern("handle", "__threadfence"))   # acquire: the others' stores
    _arrive_barrier(threads, group)


def _arrive_barrier(threads, group=0):
    # the whole block, or its first `threads` (a warp-specialized kernel's MMA threads, once its
    # producer warps have exited: they would never reach a block-wide barrier), or group g of
    # `threads` (threads g * threads .. : one MMA warpgroup of several, its own named barrier)
    emit(T.sync_threads(FIRST_THREADS_BAR - group, threads) if threads else T.sync_threads())


@register("last_arrival", "cuda")
def last_arrival(count, index, arrivals, threads=None, ordered=True, group=0):
    # the pattern of CUDA's threadFenceReduction sample and CUTLASS's split-K semaphore; ordered=False
    # drops both fences (the last block learns it is last, not that the others' stores have landed: its
    # reads must wait for each word themselves, e.g. ops.gemm_mxfp4's ready partials)
    if threads is not None:
        _check_threads("last_arrival", threads)
    if group not in range(ARRIVAL_GROUPS) or (group and threads is None):
        raise ValueError(f"last_arrival: group must be 0 .. {ARRIVAL_GROUPS - 1} (with threads= for group > 0: "
                         f"threads group * threads .. take part), got group={group!r}, threads={threads!r}")
    last = T.alloc_shared((1,), "int32")
    _arrive(count, index, arrivals, last, threads or 0, ordered, group)
    return last[0]


# tc_cluster_store_f32(local, rank, v): *local, in block `rank` of the cluster, = v
CLUSTER_STORE_SOURCE = r"""
__device__ __forceinline__ void tc_cluster_store_f32(float* local, unsigned rank, float v) {
  *static_cast<float*>(__cluster_map_shared_rank(static_cast<void*>(local), rank)) = v;
}
"""


@register("cluster_store", "cuda")
def cluster_store(dst, rank, value):
    if dst.buffer.dtype != "float32" or dst.buffer.scope() not in ("shared", "shared.dyn"):
        raise TypeError(f"cluster_store writes fp32 shared memory, got {dst.buffer.dtype} in {dst.buffer.scope()}")
    if not state().get("cluster_store_source"):        # the helper, once per program
        T.import_source(CLUSTER_STORE_SOURCE)
        state()["cluster_store_source"] = True
    emit(T.call_extern("handle", "tc_cluster_store_f32", T.address_of(dst), rank, value))


_HELPER_SOURCES = {"cluster_store": CLUSTER_STORE_SOURCE}


@register("helper_source", "cuda")
def helper_source(*words):
    unknown = [w for w in words if w not in _HELPER_SOURCES]
    if unknown:
        raise ValueError(f"helper_source: no CUDA helper source for {unknown}; known: {sorted(_HELPER_SOURCES)}")
    for w in words:                 # the program's own import_source carries them: the rules import nothing
        state()[f"{w}_source"] = True
    return "".join(_HELPER_SOURCES[w] for w in words)


@register("cluster_barrier", "cuda")
def cluster_barrier():
    # barrier.cluster.arrive (release) + barrier.cluster.wait (acquire): global and shared writes
    # made before it are visible to every block of the cluster after it. CUDA's builtins rather than
    # T.cluster_sync: TileLang's asm has no memory clobber, so nvcc may move a load across it; the
    # builtins are barriers to the compiler too. Exited threads count as arrived (PTX ISA).
    emit(T.call_extern("handle", "__cluster_barrier_arrive"), T.call_extern("handle", "__cluster_barrier_wait"))
