// The one-launch grouping of csrc/common/group_edges_cooperative.cu on a mini-batch (16,384 seeds x
// `fanout` in-edges, default 10, sources among 180,224 nodes, both sides over 180,224 rows), timed
// with CUDA events (median of 50 after 5) and checked against a stable sort on the host. With `hub`
// edges (default 0), every 97th edge's source is node 0 up to that many: a row longer than the
// counting sort ranks sends the batch to the radix sort.
//   nvcc -std=c++17 -O3 -arch=sm_90 -I edgedot/csrc -o /tmp/grouping_time scripts/grouping_time.cu \
//     && /tmp/grouping_time [fanout [hub]]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "common/group_edges_cooperative.cu"
#include "common/launch.cu"

#define CK(x)                                                                        \
  do {                                                                               \
    const cudaError_t s_ = (x);                                                      \
    if (s_ != cudaSuccess) {                                                         \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(s_));         \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

int main(int argc, char** argv) {
  using namespace edgedot;
  const int64_t seeds = 16384, fanout = argc > 1 ? std::atoi(argv[1]) : 10, nodes = 11 * seeds;
  const int64_t hub = argc > 2 ? std::atoi(argv[2]) : 0;
  const int64_t edges = seeds * fanout, keys = 2 * edges;
  std::vector<int64_t> dst(edges), src(edges);
  std::mt19937_64 rng(0);
  for (int64_t e = 0; e < edges; ++e) {
    dst[e] = e / fanout;
    src[e] = static_cast<int64_t>(rng() % nodes);
  }
  for (int64_t e = 0; e < edges && e / 97 < hub; e += 97) src[e] = 0;
  int64_t *d_dst, *d_src, *packed, *offsets;
  CK(cudaMalloc(&d_dst, edges * 8));
  CK(cudaMalloc(&d_src, edges * 8));
  CK(cudaMemcpy(d_dst, dst.data(), edges * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_src, src.data(), edges * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&packed, 2 * keys * 8));
  CK(cudaMalloc(&offsets, 2 * (nodes + 1) * 8));
  // Side 0: rows dst, others src; side 1: rows src, others dst (as group_edges_both).
  GroupSide first{d_src, IndexKind::i64, nodes, nodes, packed, reinterpret_cast<uint64_t*>(packed + edges), offsets};
  GroupSide second{d_dst, IndexKind::i64, nodes, nodes, packed + 2 * edges,
                   reinterpret_cast<uint64_t*>(packed + 3 * edges), offsets + nodes + 1};
  const int tiles = cooperative_grouping_tiles(keys, IndexKind::i64, IndexKind::i64);
  if (tiles == 0) { std::printf("the batch does not fit one launch\n"); return 1; }
  int32_t* scratch;
  CK(cudaMalloc(&scratch, cooperative_grouping_ints(keys, tiles, first, &second, IndexKind::i64) * 4));
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> times;
  for (int it = 0; it < 55; ++it) {
    CK(cudaEventRecord(a, stream));
    if (!launch_group_edges_cooperative(d_dst, IndexKind::i64, edges, tiles, scratch, first, &second, RangeFlags{},
                                        stream)) {
      std::printf("the cooperative launch was refused\n");
      return 1;
    }
    CK(cudaEventRecord(b, stream));
    CK(cudaStreamSynchronize(stream));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (it >= 5) times.push_back(ms * 1000);
  }
  std::sort(times.begin(), times.end());
  // The host's groupings: a stable sort of each side's edges by row.
  std::vector<int64_t> got_packed(2 * keys), got_offsets(2 * (nodes + 1));
  CK(cudaMemcpy(got_packed.data(), packed, got_packed.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_offsets.data(), offsets, got_offsets.size() * 8, cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (int side = 0; side < 2; ++side) {
    const std::vector<int64_t>& rows = side == 0 ? dst : src;
    const std::vector<int64_t>& others = side == 0 ? src : dst;
    std::vector<int64_t> order(edges);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return rows[x] < rows[y]; });
    const int64_t* p = got_packed.data() + side * 2 * edges;
    for (int64_t i = 0; i < edges; ++i) {
      const uint64_t row_other = static_cast<uint64_t>(rows[order[i]]) << 32 | static_cast<uint32_t>(others[order[i]]);
      wrong += p[i] != order[i] || static_cast<uint64_t>(p[edges + i]) != row_other;
    }
    int64_t at = 0;
    for (int64_t r = 0; r <= nodes; ++r) {
      while (at < edges && rows[order[at]] < r) ++at;
      wrong += got_offsets[side * (nodes + 1) + r] != at;
    }
  }
  std::printf("grouping, %lld keys in %d tiles, hub %lld: median %.1f us, min %.1f us; entries or offsets wrong: "
              "%lld\n", static_cast<long long>(keys), tiles, static_cast<long long>(hub), times[times.size() / 2],
              times[0], static_cast<long long>(wrong));
  return wrong != 0;
}
