// Probe: what the e4m3 -> fp16 unpack costs an SM (bench/NOTES.md "Session 37").
//
//     nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe_cvt bench/probe_cvt.cu && /tmp/probe_cvt
//
// The FP8 MLA decode kernel (ops/mla_decode_fp8_rs.py) converts each latent byte twice a step (K's fragment and
// V^T's): 1024 F2FP.F16.E4M3.UNPACK_B warp instructions an SM a 64-token step. If the unpack issues at a quarter of
// the ALU rate, that alone is ~2050 SM cycles a step against ~2300 of DRAM share, and the kernel cannot reach
// its floor by scheduling. Measured here, every SM busy, 8 warps a scheduler:
//   cvt    one `cvt.rn.f16x2.e4m3x2` a value pair (F2FP.F16.E4M3.UNPACK_B), 8 dependent chains a thread
//   bits   the same pairs by integer ops: a byte's sign kept, its 7 magnitude bits moved down one place into
//          fp16's exponent and mantissa (exact: the value times 2^-8, subnormals included; 0x7f/0xff, e4m3's
//          NaN, become 1.875 * 2^0 instead), 4 bytes -> 2 words in 7 instructions
//   fmul   one FMUL a thread a chain (the ALU's rate, for scale)
// and then every 16-bit pattern's `bits` result against cvt's.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>

__device__ __forceinline__ uint32_t cvt_lo(uint32_t x) {
  uint32_t y;
  asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t cvt_hi(uint32_t x) {
  uint32_t y;
  asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "=r"(y) : "r"(x));
  return y;
}
// bytes 1 and 3 of x (the upper byte of each half) -> f16x2 of value * 2^-8
__device__ __forceinline__ uint32_t bits_odd(uint32_t x) {
  uint32_t m = (x & 0x7f007f00u) >> 1;
  return m | (x & 0x80008000u);
}
// bytes 0 and 2 of x -> f16x2 of value * 2^-8
__device__ __forceinline__ uint32_t bits_even(uint32_t x) {
  uint32_t e = __byte_perm(x, 0, 0x2404);   // byte 0 -> byte 1, byte 2 -> byte 3, zeros below
  return bits_odd(e);
}

constexpr int CHAINS = 8;

__global__ void __launch_bounds__(1024) k_cvt(uint32_t* out, long long* cycles, int iters, uint32_t seed) {
  uint32_t v[CHAINS];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) v[c] = seed * (threadIdx.x + 1) * (c + 3) | 0x01010101u;
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) v[c] = cvt_lo(v[c]);
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) v[c] = cvt_lo(v[c]);   // (cvt_hi here lowers to a PRMT + F2FP)
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) acc ^= v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__global__ void __launch_bounds__(1024) k_bits(uint32_t* out, long long* cycles, int iters, uint32_t seed) {
  uint32_t v[CHAINS];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) v[c] = seed * (threadIdx.x + 1) * (c + 3) | 0x01010101u;
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
    // two words out of each word: the same 4 bytes -> 2 pairs, as cvt_lo + cvt_hi do
#pragma unroll
    for (int c = 0; c < CHAINS; c += 2) {
      uint32_t a = bits_even(v[c]), b = bits_odd(v[c]);
      uint32_t d = bits_even(v[c + 1]), e = bits_odd(v[c + 1]);
      v[c] = a ^ e;          // keep the chains dependent (one LOP3 a pair: counted)
      v[c + 1] = b ^ d;
    }
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) acc ^= v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__global__ void __launch_bounds__(1024) k_fmul(uint32_t* out, long long* cycles, int iters, uint32_t seed) {
  float v[CHAINS];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) v[c] = 1.0f + 1e-7f * (seed + threadIdx.x + c);
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) v[c] = v[c] * 0.9999999f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) v[c] = v[c] * 1.0000001f;
  }
  __syncthreads();
  long long t1 = clock64();
  float acc = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) acc += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = __float_as_uint(acc);
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// every pair of e4m3 bytes (lo, hi): bits' f16x2 times 256 against cvt's, through both byte positions
__device__ __forceinline__ bool same_x256(uint32_t ref, uint32_t got, uint32_t lo, uint32_t hi) {
  for (int half = 0; half < 2; ++half) {
    uint32_t byte = half ? hi : lo;
    if ((byte & 0x7f) == 0x7f) continue;               // e4m3's NaN: bits gives 480 * 2^-8
    __half_raw r, g;
    r.x = (ref >> (16 * half)) & 0xffff;
    g.x = (got >> (16 * half)) & 0xffff;
    float rf = __half2float(__half(r)), gf = __half2float(__half(g)) * 256.0f;
    if (rf != gf || ((r.x ^ g.x) & 0x8000)) return false;
  }
  return true;
}
__global__ void k_check(int* bad, int* nan_pairs) {
  uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= 65536) return;
  uint32_t lo = p & 0xff, hi = p >> 8;
  if ((lo & 0x7f) == 0x7f || (hi & 0x7f) == 0x7f) atomicAdd(nan_pairs, 1);
  uint32_t ref = cvt_lo(lo | (hi << 8));
  if (!same_x256(ref, bits_even(lo | (hi << 16)), lo, hi)) atomicAdd(bad, 1);        // bytes 0 and 2
  if (!same_x256(ref, bits_odd((lo << 8) | (hi << 24)), lo, hi)) atomicAdd(bad, 1);  // bytes 1 and 3
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int threads = 1024, iters = 4096;
  uint32_t* out; long long* cyc; int* flags;
  cudaMalloc(&out, sizeof(uint32_t) * sms * threads);
  cudaMalloc(&cyc, sizeof(long long) * sms);
  cudaMalloc(&flags, 2 * sizeof(int));
  long long h[1024];
  struct { const char* name; void (*k)(uint32_t*, long long*, int, uint32_t); double ops_per_iter; } runs[] = {
      {"cvt  (F2FP a pair)", k_cvt, 2.0 * CHAINS},
      {"bits (7 int ops + 1 LOP3 per 4 bytes)", k_bits, 2.0 * CHAINS},
      {"fmul", k_fmul, 2.0 * CHAINS},
  };
  for (auto& r : runs) {
    r.k<<<sms, threads>>>(out, cyc, 64, 1u);          // warm-up
    r.k<<<sms, threads>>>(out, cyc, iters, 7u);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { printf("%s: %s\n", r.name, cudaGetErrorString(err)); return 1; }
    cudaMemcpy(h, cyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
    double mean = 0;
    for (int i = 0; i < sms; ++i) mean += h[i];
    mean /= sms;
    // pairs (two values) an SM a cycle: threads x iters x pairs / cycles
    double pairs = double(threads) * iters * r.ops_per_iter;
    printf("%-40s %10.0f cycles  %6.2f pairs/clk/SM  %6.2f cycles/warp-op/scheduler\n", r.name, mean,
           pairs / mean, mean / (double(threads) / 32 / 4 * iters * r.ops_per_iter));
  }
  cudaMemset(flags, 0, 2 * sizeof(int));
  k_check<<<256, 256>>>(flags, flags + 1);
  int hf[2];
  cudaMemcpy(hf, flags, sizeof(hf), cudaMemcpyDeviceToHost);
  printf("bits vs cvt over all 65536 byte pairs, both positions: %d mismatches (NaN bytes skipped in %d pairs)\n", hf[0], hf[1]);
  return hf[0] != 0;
}
