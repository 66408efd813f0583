// Backward without a plan: edges in the order given, atomics into the gradient.
#include <algorithm>

#include "edge_dot/grad_common.cuh"

namespace edgedot {

// Most consecutive edges a group walks; runs of equal rows inside a tile cost one atomic flush.
// Small graphs get shorter tiles so that every SM has work.
constexpr int64_t kMaxTileEdges = 16;

// float4 atomics exist from sm_90 on: a quarter of the atomic instructions.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kFloat4Atomics = true;
#else
constexpr bool kFloat4Atomics = false;
#endif

template <int VEC>
__device__ __forceinline__ void atomic_add_vec(float* p, const float (&x)[VEC]) {
  if constexpr (kFloat4Atomics && VEC % 4 == 0) {
#pragma unroll
    for (int k = 0; k < VEC / 4; ++k)
      atomicAdd(reinterpret_cast<float4*>(p) + k, make_float4(x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) atomicAdd(p + j, x[j]);
  }
}

template <int VEC, typename A>
__device__ __forceinline__ void atomic_add_vec(double* p, const A (&x)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) atomicAdd(p + j, static_cast<double>(x[j]));
}

// A group owns a (tile, head) unit. It keeps the running row's partial gradient in registers and
// flushes it with atomics into `grad` (of type Acc) when the row changes, so input sorted by row
// is nearly atomic-free.
template <typename T, typename Acc, int VEC, typename Edges>
__global__ void __launch_bounds__(kBlockThreads)
grad_atomic_kernel(GradArgs a, Edges edges, Acc* __restrict__ grad, int group, int64_t tile_edges) {
  using Row = typename Edges::Row;
  const int64_t vectors = a.dim / VEC;
  const GroupUnits units(group, (a.num_edges + tile_edges - 1) / tile_edges * a.heads);

  for (int64_t unit = units.first; unit < units.count; unit += units.stride) {
    const int64_t tile = unit / a.heads;
    const int64_t h = unit - tile * a.heads;
    Acc* grad_head = grad + (a.row_heads == 1 ? 0 : h) * a.dim;
    const int64_t e_begin = tile * tile_edges;
    const int64_t e_end = min(a.num_edges, e_begin + tile_edges);
    for (int64_t base = units.lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC> slice(base, group, vectors);
      auto flush = [&](Row row) {
        if (!in_range(row, a.num_rows)) return;
        Acc* p = grad_head + static_cast<int64_t>(row) * a.row_heads * a.dim;
#pragma unroll
        for (int u = 0; u < kVectorsPerLane; ++u) {
          if (slice.has(u)) atomic_add_vec<VEC>(p + slice.offset(u), slice.acc[u]);
        }
      };
      const Row last = sum_runs<true>(a, edges, e_begin, e_end, h, 1, slice, [&](Row row, Row) { flush(row); });
      flush(last);
    }
  }
}

template <typename T, typename Acc, int VEC, typename RowIdx, typename OtherIdx>
void launch(const GradArgs& a, Acc* grad, cudaStream_t stream) {
  const int group = group_size(a.dim / VEC);
  auto kernel = grad_atomic_kernel<T, Acc, VEC, GivenEdges<T, RowIdx, OtherIdx>>;
  // Four tiles per resident group at least, before tiles grow towards kMaxTileEdges.
  const int64_t resident_groups =
      static_cast<int64_t>(sm_count()) * blocks_per_sm(reinterpret_cast<const void*>(kernel)) * kBlockThreads / group;
  const int64_t tile_edges = std::max<int64_t>(1, std::min(kMaxTileEdges, a.num_edges / (4 * resident_groups)));
  const int64_t units = (a.num_edges + tile_edges - 1) / tile_edges * a.heads;
  kernel<<<grid_blocks(kernel, units * group), kBlockThreads, 0, stream>>>(
      a, GivenEdges<T, RowIdx, OtherIdx>::of(a), grad, group, tile_edges);
}

template <typename T, typename Acc>
void launch_with_index(const GradArgs& a, void* grad_acc, IndexKind row_index, IndexKind other_index,
                       cudaStream_t stream) {
  auto* grad = static_cast<Acc*>(grad_acc);
  dispatch_index(row_index, [&](auto ri) {
    dispatch_index(other_index, [&](auto oi) {
      using RowIdx = decltype(ri);
      using OtherIdx = decltype(oi);
      if (rows_vectorizable<T>(a.other, a.dim)) {
        launch<T, Acc, wide_vec<T>(), RowIdx, OtherIdx>(a, grad, stream);
      } else {
        launch<T, Acc, 1, RowIdx, OtherIdx>(a, grad, stream);
      }
    });
  });
}

void launch_grad_atomic(const GradArgs& a, void* grad_acc, ScalarKind scalar, bool double_accum,
                        IndexKind row_index, IndexKind other_index, cudaStream_t stream) {
  if (scalar == ScalarKind::f32 && double_accum) {
    launch_with_index<float, double>(a, grad_acc, row_index, other_index, stream);
    return;
  }
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    launch_with_index<T, accum_t<T>>(a, grad_acc, row_index, other_index, stream);
  });
}

}  // namespace edgedot
