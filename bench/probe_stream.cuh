// The stream probes' shared pieces (bench/probe_steal_stream.cu, bench/probe_w4a8_stream.cu): mbarriers, 1-D bulk
// copies, the global timer, the L2 read flush and the CUDA error check.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, int parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               :: "r"(smem(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* b, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(b)) : "memory");
}
__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// the L2 emptied by reading 256 MB (probe_steal_stream's TC_FLUSH=read, probe_w4a8_stream always: nothing dirty left to write back during the timed launch, as
// bench --flush read) or by writing it (the default, session 39's runs: up to an L2 of dirty lines written back
// during the launch, which is what spread the CTAs' ends: bench/NOTES.md "Session 40")
__global__ void read_flush(const int4* p, size_t n, int* sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    acc ^= p[i].x ^ p[i].y ^ p[i].z ^ p[i].w;
  if (acc == 0x7fffffff) *sink = acc;                   // (keeps the loads)
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// Microseconds from e0 to e1 around one launch (launch() enqueues it on the default stream), waited for
template <class Launch>
float timed_us(cudaEvent_t e0, cudaEvent_t e1, Launch&& launch) {
  CK(cudaEventRecord(e0));
  launch();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  return ms * 1000.f;
}
