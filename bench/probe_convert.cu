// Throughput of the e4m3 -> 16-bit conversions an FP8-cache MLA kernel can use, per SM per clock
// (bench/NOTES.md "Session 34"). One block of 1024 threads per SM, 8 independent chains a thread.
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_convert bench/probe_convert.cu && /tmp/probe_convert
// Variants (each converts two e4m3 values a step):
//   cvt    cvt.rn.f16x2.e4m3x2 (exact; one instruction)
//   bits   PRMT + SHF + LOP3: e4m3 bits moved into an f16's (exact up to a 2^-8 factor, which a
//          kernel folds into its scales; e4m3's NaN becomes a finite value)
//   bf16   cvt.rn.f16x2.e4m3x2, both halves to fp32, times a scale, cvt.rn.bf16x2.f32 (the scaled
//          bf16 operand the unfolded converters write)
//   ffma   two FFMA (a reference rate)
#include <cstdio>
#include <cstdint>
#include <cuda_fp16.h>

#define CHAINS 8

__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t x) {
  uint32_t h;
  asm volatile("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(x));
  return h;
}

__device__ __forceinline__ uint32_t bits_e4m3x2(uint32_t x) {
  uint32_t r = __byte_perm(x, 0u, 0x1404);              // byte 0 -> bits 8-15, byte 1 -> bits 24-31
  uint32_t h;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(h) : "r"(0x80008000u), "r"(r), "r"(r >> 1));
  return h;                                              // (sign of r) | (r >> 1 without its sign)
}

__device__ __forceinline__ uint32_t bf16_e4m3x2(uint32_t x, float s) {
  uint32_t h = cvt_e4m3x2(x);
  __half2 v = *reinterpret_cast<__half2*>(&h);
  float a = __low2float(v) * s, b = __high2float(v) * s;
  uint32_t o;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(o) : "f"(b), "f"(a));
  return o;
}

template <int V>
__global__ void probe(uint32_t seed, int iters, unsigned long long* cycles, uint32_t* sink) {
  uint32_t x[CHAINS];
  float f[CHAINS];
#pragma unroll
  for (int j = 0; j < CHAINS; ++j) { x[j] = seed * (threadIdx.x + 17 * j) + j; f[j] = (float)x[j] * 1e-9f; }
  __syncthreads();
  unsigned long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) {
      if (V == 0) x[j] = cvt_e4m3x2(x[j]) ^ (x[j] >> 16);
      if (V == 1) x[j] = bits_e4m3x2(x[j]) ^ (x[j] >> 16);
      if (V == 2) x[j] = bf16_e4m3x2(x[j], f[j]) ^ (x[j] >> 16);
      if (V == 3) { f[j] = fmaf(f[j], 1.0001f, 0.5f); f[j] = fmaf(f[j], 0.9999f, -0.5f); }
    }
  }
  __syncthreads();
  unsigned long long t1 = clock64();
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < CHAINS; ++j) acc ^= x[j] ^ __float_as_uint(f[j]);
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int V>
void run(const char* name, int sms) {
  const int threads = 1024, iters = 4096;
  unsigned long long* cyc; uint32_t* sink;
  cudaMalloc(&cyc, sms * sizeof(*cyc)); cudaMalloc(&sink, sms * threads * 4);
  probe<V><<<sms, threads>>>(12345u, 64, cyc, sink);           // warm up
  probe<V><<<sms, threads>>>(12345u, iters, cyc, sink);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); return; }
  unsigned long long c[1024]; cudaMemcpy(c, cyc, sms * sizeof(*cyc), cudaMemcpyDeviceToHost);
  unsigned long long mx = 0; for (int i = 0; i < sms; ++i) mx = c[i] > mx ? c[i] : mx;
  double pairs = (double)threads * iters * CHAINS;
  printf("%-5s %8.1f value pairs per SM per clock (%llu cycles)\n", name, pairs / mx, mx);
  cudaFree(cyc); cudaFree(sink);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  run<0>("cvt", sms); run<1>("bits", sms); run<2>("bf16", sms); run<3>("ffma", sms);
  return 0;
}
