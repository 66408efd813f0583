// Phases of the one-launch grouping (a copy of csrc/common/group_edges_cooperative.cu with a
// globaltimer stamp per block at each phase) on a mini-batch: 16,384 seeds x 10, 180,224 rows a side.
//   nvcc -std=c++17 -O3 -arch=sm_90 -I edgedot/csrc -o /tmp/grouping_phases scripts/grouping_phases.cu && /tmp/grouping_phases
#include <cooperative_groups.h>
#include <cub/block/block_radix_rank.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>
#include "common/grouping.cuh"

using namespace edgedot;
namespace cg = cooperative_groups;
#define CK(x) do { cudaError_t s_ = (x); if (s_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(s_)); exit(1);} } while (0)

constexpr int kSortThreads = 512, kDigitBits = 8, kDigits = 256;
__device__ __forceinline__ unsigned long long now() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
struct KeyDigit { uint32_t shift, mask; __device__ __forceinline__ uint32_t Digit(uint32_t key) const { return (key >> shift) & mask; } };
struct SortBuffers { int32_t* keys[2]; int32_t* positions[2]; int32_t* tile_counts; };

template <int KPT>
struct Shapes {
  static constexpr int kTileKeys = kSortThreads * KPT, kWarpKeys = 32 * KPT;
  using DigitRank = cub::BlockRadixRankMatch<kSortThreads, kDigitBits, false>;
  using DigitScan = cub::BlockScan<int32_t, kSortThreads>;
  struct TileShared {
    union { typename DigitRank::TempStorage rank; typename DigitScan::TempStorage scan; int32_t sorted[kSortThreads * KPT]; } temp;
    int32_t tile_prefix[kDigits + 1];
    int32_t tile_sums[2][2][kDigits];
    int32_t digit_base[kDigits];
  };
};

#define STAMP(k) do { __syncthreads(); if (threadIdx.x == 0) stamps[blockIdx.x * 32 + (k)] = now(); } while (0)

// OFFS: 0 binary search, 1 run boundaries. UNROLL: place_tile's loads unrolled.
template <int KPT, int OFFS, bool UNROLL, bool STAGED = false>
__global__ void __launch_bounds__(kSortThreads, 1)
lab_kernel(const long long* __restrict__ row_idx, int32_t num_edges, int sides, int num_bits, int num_tiles,
           SortBuffers buffers, TypedSide<long long> first, TypedSide<long long> second, RangeFlags range_flags,
           unsigned long long* stamps) {
  using S = Shapes<KPT>;
  __shared__ typename S::TileShared shared;
  const cg::grid_group grid = cg::this_grid();
  STAMP(0);
  const int tile = blockIdx.x;
  const bool sorts = tile < num_tiles;
  const int64_t num_keys = int64_t(sides) * num_edges;
  const int64_t tile_start = int64_t(tile) * S::kTileKeys;
  const int valid = sorts ? int(min(num_keys - tile_start, int64_t(S::kTileKeys))) : 0;
  const int first_entry = int(threadIdx.x / 32) * S::kWarpKeys + int(threadIdx.x % 32);
  const long long* second_idx = sides == 2 ? first.other_idx : nullptr;
  const int32_t num_rows = int32_t(first.num_rows), num_second_rows = int32_t(first.num_other);
  const int passes = (num_bits + kDigitBits - 1) / kDigitBits;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * kDigitBits;
    const KeyDigit digit{uint32_t(shift), (1u << min(kDigitBits, num_bits - shift)) - 1};
    uint32_t keys[KPT]; int32_t positions[KPT]; int ranks[KPT];
    if (sorts) {
      const int32_t* in_keys = buffers.keys[(pass + 1) & 1] + tile_start;
      const int32_t* in_positions = buffers.positions[(pass + 1) & 1] + tile_start;
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const int i = first_entry + j * 32;
        keys[j] = ~0u; positions[j] = 0;
        if (i < valid && pass == 0) {
          int32_t key;
          edge_key(row_idx, second_idx, tile_start + i, num_edges, num_rows, num_second_rows, key, positions[j]);
          keys[j] = uint32_t(key);
        } else if (i < valid) {
          keys[j] = uint32_t(__ldcg(in_keys + i)); positions[j] = __ldcg(in_positions + i);
        }
      }
    }
    STAMP(1 + 4 * pass);
    if (sorts) {
      int prefix[S::DigitRank::BINS_TRACKED_PER_THREAD];
      typename S::DigitRank(shared.temp.rank).RankKeys(keys, ranks, digit, prefix);
      if (threadIdx.x < kDigits) shared.tile_prefix[threadIdx.x] = prefix[0];
      if (threadIdx.x == 0) shared.tile_prefix[kDigits] = S::kTileKeys;
      __syncthreads();
      if (threadIdx.x < kDigits) {
        const int d = threadIdx.x;
        buffers.tile_counts[tile * kDigits + d] = min(shared.tile_prefix[d + 1], valid) - min(shared.tile_prefix[d], valid);
      }
    }
    STAMP(2 + 4 * pass);
    grid.sync();
    STAMP(3 + 4 * pass);
    if (sorts) {
      const int d = threadIdx.x % kDigits, half = threadIdx.x / kDigits;
      const int lo = half == 0 ? 0 : num_tiles / 2, hi = half == 0 ? num_tiles / 2 : num_tiles;
      int32_t before = 0, total = 0;
      if (UNROLL) {
#pragma unroll 8
        for (int t = lo; t < hi; ++t) { const int32_t c = __ldcg(buffers.tile_counts + t * kDigits + d); total += c; before += t < tile ? c : 0; }
      } else {
        for (int t = lo; t < hi; ++t) { const int32_t c = __ldcg(buffers.tile_counts + t * kDigits + d); total += c; if (t < tile) before += c; }
      }
      shared.tile_sums[half][0][d] = before; shared.tile_sums[half][1][d] = total;
      __syncthreads();
      const int32_t digit_total = threadIdx.x < kDigits ? shared.tile_sums[0][1][threadIdx.x] + shared.tile_sums[1][1][threadIdx.x] : 0;
      int32_t digit_start;
      typename S::DigitScan(shared.temp.scan).ExclusiveSum(digit_total, digit_start);
      if (threadIdx.x < kDigits) shared.digit_base[d] = digit_start + shared.tile_sums[0][0][d] + shared.tile_sums[1][0][d] - shared.tile_prefix[d];
      __syncthreads();
      int32_t* out_keys = buffers.keys[pass & 1]; int32_t* out_positions = buffers.positions[pass & 1];
      if (STAGED) {
#pragma unroll
        for (int j = 0; j < KPT; ++j) if (first_entry + j * 32 < valid) shared.temp.sorted[ranks[j]] = int32_t(keys[j]);
        __syncthreads();
        int to[KPT];
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
          const int i = int(threadIdx.x) + j * kSortThreads;
          if (i < valid) { const int32_t key = shared.temp.sorted[i]; to[j] = shared.digit_base[digit.Digit(uint32_t(key))] + i; out_keys[to[j]] = key; }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < KPT; ++j) if (first_entry + j * 32 < valid) shared.temp.sorted[ranks[j]] = positions[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < KPT; ++j) { const int i = int(threadIdx.x) + j * kSortThreads; if (i < valid) out_positions[to[j]] = shared.temp.sorted[i]; }
      } else {
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        if (first_entry + j * 32 < valid) {
          const int to = shared.digit_base[digit.Digit(keys[j])] + ranks[j];
          out_keys[to] = int32_t(keys[j]); out_positions[to] = positions[j];
        }
      }
      }
    }
    STAMP(4 + 4 * pass);
    grid.sync();
  }
  STAMP(20);
  const int sorted = (passes + 1) & 1;
  const int32_t* keys = buffers.keys[sorted]; const int32_t* positions = buffers.positions[sorted];
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  if (OFFS == 3) {  // the product's write_groupings (grouping.cuh)
    write_groupings(keys, positions, num_edges, sides, first, second, range_flags, start, stride);
    STAMP(21);
    STAMP(22);
    return;
  }
  const int32_t second_base = int32_t(first.num_rows + 1);
  for (int64_t i = start; i < num_keys; i += stride) {
    if (i < num_edges) group_entry(first, keys[i], positions[i], i, 0);
    else group_entry(second, keys[i], positions[i], i - num_edges, second_base);
  }
  STAMP(21);
  if (OFFS == 0) {
    const int64_t first_offsets = first.num_rows + 1;
    const int64_t num_offsets = first_offsets + (sides == 2 ? second.num_rows + 1 : 0);
    for (int64_t r = start; r < num_offsets; r += stride) {
      if (r < first_offsets) first.offsets[r] = first_at_least(keys, num_edges, r);
      else second.offsets[r - first_offsets] = first_at_least(keys + num_edges, num_edges, r);
    }
  } else if (OFFS == 2) {
    constexpr int R = 8;
    const int64_t first_offsets = first.num_rows + 1;
    const int64_t num_offsets = first_offsets + (sides == 2 ? second.num_rows + 1 : 0);
    for (int64_t r0 = start * R; r0 < num_offsets; r0 += stride * R) {
      int32_t p = -1;
      for (int64_t r = r0; r < min(r0 + R, num_offsets); ++r) {
        const bool one = r < first_offsets;
        if (r == first_offsets) p = -1;  // the second side starts
        const int32_t* k = one ? keys : keys + num_edges;
        int32_t lo, hi;
        if (p < 0) { lo = 0; hi = num_edges; }
        else {  // gallop from p: keys[p - 1] < r - 1 < r
          int32_t step = 1; lo = p; hi = p;
          while (hi < num_edges && k[hi] < r) { lo = hi + 1; hi = min(num_edges, hi + step); step *= 2; }
        }
        while (lo < hi) { const int32_t mid = lo + (hi - lo) / 2; if (k[mid] < r) lo = mid + 1; else hi = mid; }
        p = lo;
        (one ? first.offsets[r] : second.offsets[r - first_offsets]) = p;
      }
    }
  } else {
    // Entry i of a side (0..n): rows (K[i-1], K[i]] start at i.
    for (int64_t x = start; x < num_keys + sides; x += stride) {
      const int s = x <= num_edges ? 0 : 1;
      const int64_t i = s == 0 ? x : x - (num_edges + 1);
      const int32_t* k = keys + (s == 0 ? 0 : num_edges);
      const int32_t base = s == 0 ? 0 : second_base;
      const int64_t rows = s == 0 ? first.num_rows : second.num_rows;
      int64_t* offsets = s == 0 ? first.offsets : second.offsets;
      const int64_t lo = i == 0 ? 0 : int64_t(k[i - 1] - base) + 1;
      const int64_t hi = i == num_edges ? rows : min(int64_t(k[i] - base), rows);
      for (int64_t r = lo; r <= hi; ++r) offsets[r] = i;
    }
  }
  STAMP(22);
}

int main() {
  const int S = 16384, F = 10, N = 11 * S, E = S * F;
  std::vector<long long> dst(E), src(E);
  std::mt19937_64 rng(0);
  for (int i = 0; i < E; ++i) { dst[i] = i / F; src[i] = rng() % N; }
  long long *d_dst, *d_src; CK(cudaMalloc(&d_dst, E * 8)); CK(cudaMalloc(&d_src, E * 8));
  CK(cudaMemcpy(d_dst, dst.data(), E * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(d_src, src.data(), E * 8, cudaMemcpyHostToDevice));
  const int64_t K = 2 * int64_t(E);
  int32_t* scratch; CK(cudaMalloc(&scratch, (4 * K + 1024 * kDigits) * 4));
  SortBuffers buf{{scratch, scratch + K}, {scratch + 2 * K, scratch + 3 * K}, scratch + 4 * K};
  int64_t* order; uint64_t* row_other; int64_t* offsets; int* flags;
  CK(cudaMalloc(&order, K * 8)); CK(cudaMalloc(&row_other, K * 8)); CK(cudaMalloc(&offsets, (2 * N + 2) * 8)); CK(cudaMalloc(&flags, 8));
  TypedSide<long long> first{d_src, N, N, order, row_other, offsets};
  TypedSide<long long> second{d_dst, N, N, order + E, row_other + E, offsets + N + 1};
  RangeFlags rf{flags, flags + 1};
  unsigned long long* stamps; CK(cudaMalloc(&stamps, 2048 * 32 * 8));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int bits = key_bits(N + 1 + N);
  std::vector<int64_t> ref_offsets; std::vector<uint64_t> ref_ro;
  cudaStream_t stream; CK(cudaStreamCreate(&stream));
  auto run_variant = [&](const char* name, auto kernel, int kpt) {
    int occ; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kSortThreads, 0));
    const int blocks = sms * occ;
    const int tiles = int((K + kSortThreads * kpt - 1) / (kSortThreads * kpt));
    if (tiles > blocks) { printf("%s: %d tiles > %d blocks\n", name, tiles, blocks); return; }
    int32_t ne = E; int sides = 2; int nb = bits;
    void* args[] = {&d_dst, &ne, &sides, &nb, (void*)&tiles, &buf, &first, &second, &rf, &stamps};
    std::vector<float> times;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int it = 0; it < 40; ++it) {
      cudaEventRecord(a, stream);
      CK(cudaLaunchCooperativeKernel((void*)kernel, blocks, kSortThreads, args, 0, stream));
      cudaEventRecord(b, stream); CK(cudaStreamSynchronize(stream));
      float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 5) times.push_back(ms * 1000);
    }
    std::sort(times.begin(), times.end());
    std::vector<unsigned long long> st(blocks * 32); CK(cudaMemcpy(st.data(), stamps, st.size() * 8, cudaMemcpyDeviceToHost));
    std::vector<int64_t> off(2 * N + 2); CK(cudaMemcpy(off.data(), offsets, off.size() * 8, cudaMemcpyDeviceToHost));
    std::vector<uint64_t> ro(K); CK(cudaMemcpy(ro.data(), row_other, K * 8, cudaMemcpyDeviceToHost));
    bool same = true;
    if (ref_offsets.empty()) { ref_offsets = off; ref_ro = ro; } else same = off == ref_offsets && ro == ref_ro;
    auto d = [&](int blk, int k0, int k1) { return (st[blk * 32 + k1] - st[blk * 32 + k0]) / 1000.0; };
    printf("%-28s blocks %3d tiles %3d median %6.1f us min %6.1f  same=%d\n", name, blocks, tiles, times[times.size() / 2], times[0], same);
    const int passes = (bits + 7) / 8;
    for (int blk : {0, blocks - 1}) {
      printf("   block %3d: start->load %5.1f", blk, d(blk, 0, 1));
      for (int p = 0; p < passes; ++p)
        printf(" | p%d load %4.1f rank %4.1f sync %4.1f place %4.1f", p, d(blk, 4 * p, 4 * p + 1), d(blk, 4 * p + 1, 4 * p + 2),
               d(blk, 4 * p + 2, 4 * p + 3), d(blk, 4 * p + 3, 4 * p + 4));
      printf(" | sync %4.1f", d(blk, 4 * passes, 20));
      printf(" | write %4.1f offsets %4.1f | total %5.1f\n", d(blk, 20, 21), d(blk, 21, 22), d(blk, 0, 22));
    }
    unsigned long long t0 = ~0ull, t1 = 0;
    for (int blk = 0; blk < blocks; ++blk) { t0 = std::min(t0, st[blk * 32]); t1 = std::max(t1, st[blk * 32 + 22]); }
    printf("   first start -> last end %.1f us\n", (t1 - t0) / 1000.0);
  };
  run_variant("old: kpt16 bsearch", lab_kernel<16, 0, false>, 16);
  run_variant("new: kpt8 staged bsearch", lab_kernel<8, 0, true, true>, 8);
  run_variant("kpt8 staged gallop", lab_kernel<8, 2, true, true>, 8);
  run_variant("kpt16 staged gallop", lab_kernel<16, 2, true, true>, 16);
  run_variant("kpt8 staged, grouping.cuh", lab_kernel<8, 3, true, true>, 8);
  return 0;
}
