// Does the W4A8 kernel's weight stream run faster from a tile-contiguous layout (bench/NOTES.md "Open GPU checks
// (end of session 44)", item 1)? Streams the packed MXFP4 codes of an (n, k/2) uint8 weight the way the W4A8
// split-K plan does, with nothing decoded: one CTA a (128-row tile, split), `steps` stages of 128 rows x 64 bytes
// (a 128-deep K step) through a TC_STAGES-deep shared-memory ring (4-16, even; 8 as the plan today), the consumer optionally spinning TC_WORK cycles a stage
// (the kernel's step is ~385 cycles of decode + WGMMA at 1-16 tokens). Two layouts of the same bytes:
//   rows  as the op stages it today: one 2-D TMA box (64 bytes x 128 rows) at the row pitch k/2
//   tile  as a prepared tile-major layout would: each (tile, step) one contiguous 8 KB, one cp.async.bulk
// The L2 is emptied by reading 256 MB before each launch (as bench --flush read).
// TC_RAMP=r: the producer asks for the first r stages alone and the rest once the first has landed.
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_w4a8 bench/probe_w4a8_stream.cu && [TC_WORK=385] [TC_STAGES=8] [TC_RAMP=0] /tmp/probe_w4a8 [n] [k] [splits]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_stream.cuh"

constexpr int ROWS = 128, STEP_BYTES = 64, STAGE_BYTES = ROWS * STEP_BYTES;   // 8 KB a stage

__device__ __forceinline__ void box_load(void* dst, const CUtensorMap* map, int x, int y, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(smem(dst)), "l"(map), "r"(x), "r"(y), "r"(smem(b)) : "memory");
}

// warp 0 lane 0 produces, warp 1 lane 0 consumes; CTA b = tile b / splits, split b % splits
template <int STAGES>
__global__ void __launch_bounds__(64, 1) stream(const unsigned char* w, int kb, int splits, int tile_layout, int work, int ramp,
                                                unsigned long long* span, int* sink,
                                                const __grid_constant__ CUtensorMap rows) {
  extern __shared__ __align__(1024) unsigned char buf[];
  uint64_t* full = reinterpret_cast<uint64_t*>(buf + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  const int tile = blockIdx.x / splits, split = blockIdx.x % splits, per = (kb + splits - 1) / splits;
  const int s0 = split * per, steps = max(0, min(per, kb - s0));
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(&full[s], 1), bar_init(&empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    span[blockIdx.x * 3] = now();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int g = 0; g < steps; ++g) {
      const int slot = g % STAGES;
      if (g >= STAGES) bar_wait(&empty[slot], ((g / STAGES) - 1) & 1);
      if (ramp && g == ramp) bar_wait(&full[0], 0);   // the first `ramp` stages alone, the rest once the first landed
      bar_expect(&full[slot], STAGE_BYTES);
      if (tile_layout)   // tile-major: [tile][step][128 rows][64 bytes]
        bulk_load(buf + slot * STAGE_BYTES, w + (static_cast<size_t>(tile) * kb + s0 + g) * STAGE_BYTES, STAGE_BYTES,
                  &full[slot]);
      else
        box_load(buf + slot * STAGE_BYTES, &rows, (s0 + g) * STEP_BYTES, tile * ROWS, &full[slot]);
    }
  } else if (threadIdx.x == 32) {
    int acc = 0;
    for (int g = 0; g < steps; ++g) {
      const int slot = g % STAGES;
      bar_wait(&full[slot], (g / STAGES) & 1);
      if (g == 0) span[blockIdx.x * 3 + 1] = now();
      acc ^= reinterpret_cast<const int*>(buf + slot * STAGE_BYTES)[g & 255];
      if (work) {
        const long long t0 = clock64();
        while (clock64() - t0 < work) {}
      }
      bar_arrive(&empty[slot]);
    }
    span[blockIdx.x * 3 + 2] = now();
    if (acc == 0x7fffffff) *sink = acc;
  }
}


int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 4096, k = argc > 2 ? atoi(argv[2]) : 7168;
  const int splits = argc > 3 ? atoi(argv[3]) : 4, reps = 15;
  const int stages = getenv("TC_STAGES") ? atoi(getenv("TC_STAGES")) : 8;
  const int work = getenv("TC_WORK") ? atoi(getenv("TC_WORK")) : 0;
  const int ramp = getenv("TC_RAMP") ? atoi(getenv("TC_RAMP")) : 0;
  if (n % ROWS || k % 128) { printf("n must be a multiple of 128 and k of 128, got %d, %d\n", n, k); return 1; }
  const int kb = k / 128, blocks = n / ROWS * splits;
  const size_t bytes = static_cast<size_t>(n) * k / 2;
  unsigned char *w, *flush;
  unsigned long long* span;
  int* sink;
  CK(cudaMalloc(&w, bytes));
  CK(cudaMemset(w, 1, bytes));
  CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMemset(flush, 2, 256 << 20));
  CK(cudaMalloc(&span, blocks * 3 * 8));
  CK(cudaMalloc(&sink, 4));
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  CUtensorMap rows{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k / 2), static_cast<cuuint64_t>(n)}, pitch[1] = {static_cast<cuuint64_t>(k / 2)};
  const cuuint32_t box[2] = {STEP_BYTES, ROWS}, ones[2] = {1, 1};
  const CUresult r = encode(&rows, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, pitch, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", static_cast<int>(r)); return 1; }
  if (ramp < 0 || ramp >= stages) { printf("TC_RAMP must be in [0, TC_STAGES), got %d\n", ramp); return 1; }
  if (stages < 4 || stages > 16 || stages % 2) { printf("TC_STAGES must be 4-16 and even, got %d\n", stages); return 1; }
  auto kernel = stages == 4 ? stream<4> : stages == 6 ? stream<6> : stages == 10 ? stream<10> : stages == 12 ? stream<12>
               : stages == 14 ? stream<14> : stages == 16 ? stream<16> : stream<8>;
  const int smem_bytes = stages * STAGE_BYTES + 16 * stages;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int layout = 0; layout < 2; ++layout) {
    std::vector<float> t;
    std::vector<unsigned long long> sp(blocks * 3);
    for (int rep = 0; rep < reps; ++rep) {
      read_flush<<<1024, 256>>>(reinterpret_cast<const int4*>(flush), (256u << 20) / 16, sink);
      t.push_back(timed_us(e0, e1, [&] {
        kernel<<<blocks, 64, smem_bytes>>>(w, kb, splits, layout, work, ramp, span, sink, rows);
      }));
    }
    CK(cudaGetLastError());
    CK(cudaMemcpy(sp.data(), span, blocks * 3 * 8, cudaMemcpyDeviceToHost));
    unsigned long long t0 = ~0ull;
    for (int i = 0; i < blocks; ++i) t0 = std::min(t0, sp[i * 3]);
    std::vector<double> ends, firsts;
    for (int i = 0; i < blocks; ++i) ends.push_back((sp[i * 3 + 2] - t0) / 1e3), firsts.push_back((sp[i * 3 + 1] - t0) / 1e3);
    std::sort(ends.begin(), ends.end());
    std::sort(firsts.begin(), firsts.end());
    std::sort(t.begin(), t.end());
    printf("%-4s n=%d k=%d splits=%d blocks=%d stages=%d ramp=%d work=%d: median %.2f us (min %.2f) %.0f GB/s; "
           "(us after the first start) first data min %.2f median %.2f max %.2f, consumer ends min %.2f median %.2f "
           "max %.2f\n", layout ? "tile" : "rows", n, k, splits, blocks, stages, ramp, work, t[reps / 2], t[0],
           bytes / t[reps / 2] / 1e3, firsts[0], firsts[blocks / 2], firsts[blocks - 1], ends[0], ends[blocks / 2],
           ends[blocks - 1]);
  }
  return 0;
}
