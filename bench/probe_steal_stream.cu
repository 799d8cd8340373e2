// Does moving 64-token steps between SMs close the FP8-cache stream's spread (bench/NOTES.md "Session 39")?
// Streams an FP8 MLA cache's bytes (pages of 64 tokens x 656 bytes, one page a step, pages in a random order)
// through a 4-stage shared-memory ring, one CTA an SM a sequence, with nothing computed:
//   own    each CTA streams its own sequence, front to back (the op's rs2 kernel without its compute)
//   steal  the same, then each CTA that is done takes steps from the back of the sequence with the most left:
//          a sequence's claim word holds its front (owner) and back (thieves) counts, so every step is streamed
//          exactly once (checked: visits) whoever claims it
//   pace S  each CTA streams its own sequence, but waits before issuing a step while its share done is more than
//          S steps ahead of the whole grid's share (a grid-wide count of the steps whose data arrived): the
//          fast SMs are held to the average, so the slow ones get the DRAM they leave (bench/NOTES.md "Session 40")
// A page is 4 contiguous cp.async.bulk copies (41,984 bytes) on an mbarrier, as a 1D stream; TC_COPY=boxes issues
// it as the op's rs2 kernel does instead (bench/NOTES.md "Session 41"): six 2-D TMA boxes of 64 tokens at the
// 656-byte token stride, the four latent groups and the rope 128 bytes wide (128-byte swizzle), the scales 16,
// with TC_PROMO's L2 promotion (0-3: none, 64, 128, 256 bytes; default 2).
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_steal bench/probe_steal_stream.cu && [TC_FLUSH=read] [TC_STAGES=4] [TC_COPY=boxes] /tmp/probe_steal [batch] [steps] [S...]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "probe_stream.cuh"

constexpr int COPIES = 4, MIN_STEAL = 2;
__constant__ int PAGE_BYTES;               // a step's bytes: TC_PAGE_BYTES, default 64 x 656 (the FP8 cache's page)

// one 3-D TMA box (x bytes into the token, token 0, page z) on an mbarrier
__device__ __forceinline__ void box_load(void* dst, const CUtensorMap* map, int x, int z, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(smem(dst)), "l"(map), "r"(x), "r"(0), "r"(z), "r"(smem(b)) : "memory");
}
template <int STAGES>
struct Ring {
  uint64_t full[STAGES], empty[STAGES];
  int meta[STAGES];                        // sequence * 65536 + step, or -1: no more
};

// warp 0 produces (lane 0 issues; all lanes scan for a victim), warp 1 consumes (lane 0)
template <int STAGES>
__global__ void __launch_bounds__(64, 1) stream(const unsigned char* pool, const int* table, const int* steps, int batch,
                                                int max_steps, int steal, int pace, unsigned* claim, unsigned* exits,
                                                unsigned* arrived, int* visits, unsigned long long* span,
                                                const __grid_constant__ CUtensorMap wide, const __grid_constant__ CUtensorMap narrow,
                                                int boxes) {
  extern __shared__ __align__(1024) unsigned char buf[];
  Ring<STAGES>* ring = reinterpret_cast<Ring<STAGES>*>(buf + STAGES * PAGE_BYTES);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, bi = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(&ring->full[s], 1), bar_init(&ring->empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    span[bi * 4 + 0] = now();
  }
  __syncthreads();
  if (warp == 0) {
    int g = 0, own = 0, stolen = 0;
    auto issue = [&](int seq, int step) {               // lane 0 only
      const int slot = g % STAGES;
      if (g >= STAGES) bar_wait(&ring->empty[slot], ((g / STAGES) - 1) & 1);
      ring->meta[slot] = step < 0 ? -1 : seq * 65536 + step;
      if (step < 0) {
        bar_arrive(&ring->full[slot]);
      } else {
        bar_expect(&ring->full[slot], PAGE_BYTES);
        const int pg = table[seq * max_steps + step];
        unsigned char* dst = buf + slot * PAGE_BYTES;
        if (boxes) {                                    // rs2's stage: latent groups, rope, scales
          for (int g = 0; g < 4; ++g) box_load(dst + g * 8192, &wide, g * 128, pg, &ring->full[slot]);
          box_load(dst + 32768, &wide, 528, pg, &ring->full[slot]);
          box_load(dst + 40960, &narrow, 512, pg, &ring->full[slot]);
        } else {
          const unsigned char* src = pool + static_cast<size_t>(pg) * PAGE_BYTES;
          for (int c = 0; c < COPIES; ++c)
            bulk_load(dst + c * (PAGE_BYTES / COPIES), src + c * (PAGE_BYTES / COPIES), PAGE_BYTES / COPIES,
                      &ring->full[slot]);
        }
      }
      ++g;
    };
    if (lane == 0 && pace > 0) {                        // own steps, held to the grid's progress
      const int n = steps[bi];
      const long long total = static_cast<long long>(batch) * max_steps;   // (equal lengths in this probe)
      unsigned seen = 0;
      for (int f = 0; f < n; ++f) {
        // ahead when f / n > seen / total + pace / n: re-read the count only while it says so
        while (static_cast<long long>(f) * total > static_cast<long long>(seen) * n + static_cast<long long>(pace) * total) {
          seen = *reinterpret_cast<volatile unsigned*>(arrived);
          if (static_cast<long long>(f) * total > static_cast<long long>(seen) * n + static_cast<long long>(pace) * total)
            __nanosleep(200);
        }
        issue(bi, f), ++own;
      }
    } else if (lane == 0) {
      const int n = steps[bi];
      unsigned old = atomicAdd(&claim[bi], 1u);
      for (;;) {                                        // the owner: steps from the front while any are left
        const int f = old & 0xFFFF, bk = old >> 16;
        if (f + bk >= n) break;
        const unsigned next = atomicAdd(&claim[bi], 1u);  // the next claim in flight while this step waits
        issue(bi, f), ++own;
        old = next;
      }
    }
    __syncwarp();
    while (steal && !pace) {                                     // a thief: half of what the busiest sequence has left
      int best = -1, rem = 0;
      for (int v = lane; v < batch; v += 32) {
        const unsigned w = *reinterpret_cast<volatile unsigned*>(&claim[v]);
        const int r = steps[v] - static_cast<int>(w & 0xFFFF) - static_cast<int>(w >> 16);
        if (r > rem) rem = r, best = v;
      }
      for (int o = 16; o; o >>= 1) {
        const int r2 = __shfl_xor_sync(0xFFFFFFFFu, rem, o), b2 = __shfl_xor_sync(0xFFFFFFFFu, best, o);
        if (r2 > rem || (r2 == rem && b2 > best)) rem = r2, best = b2;
      }
      if (rem < MIN_STEAL) break;
      if (lane == 0) {
        const int c = (rem + 1) / 2, n = steps[best];
        const unsigned old = atomicAdd(&claim[best], static_cast<unsigned>(c) << 16);
        const int f = old & 0xFFFF, bk = old >> 16, hi = n - bk, lo = max(f, hi - c);
        for (int s = lo; s < hi; ++s) issue(best, s), ++stolen;
      }
      __syncwarp();
    }
    if (lane == 0) {
      issue(0, -1);
      span[bi * 4 + 2] = static_cast<unsigned long long>(own) << 32 | static_cast<unsigned>(stolen);
    }
  } else if (lane == 0) {
    for (int g = 0;; ++g) {
      const int slot = g % STAGES;
      bar_wait(&ring->full[slot], (g / STAGES) & 1);
      const int m = ring->meta[slot];
      if (m < 0) break;
      if (pace) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(arrived) : "memory");
      atomicAdd(&visits[(m >> 16) * max_steps + (m & 0xFFFF)], 1);
      bar_arrive(&ring->empty[slot]);
    }
    span[bi * 4 + 1] = now();
  }
  __syncthreads();
  if (threadIdx.x == 0) {                               // the last CTA out sets the claims back to zero
    __threadfence();
    if (atomicAdd(exits, 1u) == gridDim.x - 1) {
      for (int v = 0; v < batch; ++v) claim[v] = 0;
      *exits = 0, *arrived = 0;
      __threadfence();
    }
  }
}


int main(int argc, char** argv) {
  const int batch = argc > 1 ? atoi(argv[1]) : 128, n = argc > 2 ? atoi(argv[2]) : 64, reps = 9;
  const size_t pages = static_cast<size_t>(batch) * n;
  // a step's bytes (TC_PAGE_BYTES, a multiple of 64; 64 x 1152 = 73728 is the bf16 cache's page)
  const int page_bytes = getenv("TC_PAGE_BYTES") ? atoi(getenv("TC_PAGE_BYTES")) : 64 * 656;
  CK(cudaMemcpyToSymbol(PAGE_BYTES, &page_bytes, sizeof page_bytes));
  std::vector<int> table(pages), steps(batch, n);
  for (size_t i = 0; i < pages; ++i) table[i] = static_cast<int>(i);
  std::shuffle(table.begin(), table.end(), std::mt19937(0));
  unsigned char *pool, *flush;
  int *d_table, *d_steps, *visits;
  unsigned *claim, *exits, *arrived;
  unsigned long long* span;
  CK(cudaMalloc(&pool, pages * page_bytes));
  CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMemset(pool, 1, pages * page_bytes));
  CK(cudaMalloc(&d_table, pages * 4));
  CK(cudaMalloc(&d_steps, batch * 4));
  CK(cudaMalloc(&visits, pages * 4));
  CK(cudaMalloc(&claim, batch * 4));
  CK(cudaMalloc(&exits, 4));
  CK(cudaMalloc(&arrived, 4));
  CK(cudaMemset(arrived, 0, 4));
  CK(cudaMalloc(&span, batch * 4 * 8));
  CK(cudaMemcpy(d_table, table.data(), pages * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_steps, steps.data(), batch * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(claim, 0, batch * 4));
  CK(cudaMemset(exits, 0, 4));
  // the ring's depth: TC_STAGES (2 to 5; default 4, the op's rs2 kernel)
  const int stages = getenv("TC_STAGES") ? atoi(getenv("TC_STAGES")) : 4;
  const bool read_mode = getenv("TC_FLUSH") && std::string(getenv("TC_FLUSH")) == "read";
  auto kernel = stages == 2 ? stream<2> : stages == 3 ? stream<3> : stages == 5 ? stream<5> : stream<4>;
  const int boxes = getenv("TC_COPY") && std::string(getenv("TC_COPY")) == "boxes";
  if (boxes && page_bytes != 64 * 656) {
    printf("TC_COPY=boxes needs the FP8 cache's page (TC_PAGE_BYTES = %d), got %d\n", 64 * 656, page_bytes);
    return 1;
  }
  const int promo = getenv("TC_PROMO") ? atoi(getenv("TC_PROMO")) : 2;
  CUtensorMap wide{}, narrow{};
  if (boxes) {                                          // the pool as [pages][64 tokens][656 bytes]
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    const cuuint64_t dims[3] = {656, 64, pages}, strides[2] = {656, 656 * 64};
    const cuuint32_t wide_box[3] = {128, 64, 1}, narrow_box[3] = {16, 64, 1}, ones[3] = {1, 1, 1};
    for (int m = 0; m < 2; ++m) {
      CUtensorMap* map = m == 0 ? &wide : &narrow;
      const cuuint32_t* box = m == 0 ? wide_box : narrow_box;
      const CUtensorMapSwizzle swz = m == 0 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE;
      const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, pool, dims, strides, box, ones,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, swz, static_cast<CUtensorMapL2promotion>(promo),
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", static_cast<int>(r)); return 1; }
    }
  }
  const int smem_bytes = stages * page_bytes + 64 * stages;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const double bytes = static_cast<double>(pages) * page_bytes;
  std::vector<std::pair<int, int>> modes = {{0, 0}, {1, 0}};       // (steal, pace)
  for (int a = 3; a < argc; ++a) modes.push_back({0, atoi(argv[a])});
  for (auto [steal, pace] : modes) {
    CK(cudaMemset(visits, 0, pages * 4));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      if (read_mode)
        read_flush<<<1024, 256>>>(reinterpret_cast<const int4*>(flush), (256u << 20) / 16, reinterpret_cast<int*>(pool));
      else
        CK(cudaMemsetAsync(flush, r, 256 << 20));
      t.push_back(timed_us(e0, e1, [&, steal = steal, pace = pace] {   // (structured bindings: by copy)
        kernel<<<batch, 64, smem_bytes>>>(pool, d_table, d_steps, batch, n, steal, pace, claim, exits, arrived,
                                          visits, span, wide, narrow, boxes);
      }));
    }
    CK(cudaGetLastError());
    std::vector<int> vis(pages);
    std::vector<unsigned long long> sp(batch * 4);
    CK(cudaMemcpy(vis.data(), visits, pages * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sp.data(), span, batch * 4 * 8, cudaMemcpyDeviceToHost));
    unsigned left = 0;
    CK(cudaMemcpy(&left, arrived, 4, cudaMemcpyDeviceToHost));
    const bool once = left == 0 && std::all_of(vis.begin(), vis.end(), [&](int v) { return v == reps; });
    std::sort(t.begin(), t.end());
    unsigned long long t0 = ~0ull;
    for (int i = 0; i < batch; ++i) t0 = std::min(t0, sp[i * 4]);
    std::vector<double> ends;
    long stolen = 0, thieves = 0;
    for (int i = 0; i < batch; ++i) {
      ends.push_back((sp[i * 4 + 1] - t0) / 1e3);
      const long s = static_cast<long>(sp[i * 4 + 2] & 0xFFFFFFFFu);
      stolen += s, thieves += s > 0;
    }
    std::sort(ends.begin(), ends.end());
    char mode[16];
    snprintf(mode, sizeof mode, pace ? "pace %d" : steal ? "steal" : "own", pace);
    printf("%s%s flush page=%d stages=%d b=%d steps=%d %-7s: median %.1f us (min %.1f) %.0f GB/s; every step once: %s; consumer ends (us after the "
           "first start) min %.1f median %.1f max %.1f; last launch %ld steps stolen by %ld CTAs\n",
           boxes ? "boxes, " : "", read_mode ? "read" : "write", page_bytes, stages, batch, n, mode, t[reps / 2], t[0], bytes / t[reps / 2] / 1e3, once ? "yes" : "NO",
           ends[0], ends[batch / 2], ends[batch - 1], stolen, thieves);
  }
  return 0;
}
