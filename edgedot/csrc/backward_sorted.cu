// Backward over edges sorted by row: each group walks a chunk of consecutive edges, sums each run
// of one row in registers and writes the row once; no float atomics. A run cut by a chunk
// boundary is parked in a workspace slot, and the chunk where its row starts sums the slots in
// chunk order. The result depends only on the edge order: bitwise reproducible.
#include <algorithm>

#include "grad_common.cuh"

namespace edgedot {

// Workspace cap: chunks grow past the shortest useful length rather than need more.
constexpr int64_t kWorkspaceBytes = int64_t{64} << 20;
constexpr int64_t kMinChunkEdges = 8;
constexpr int64_t kMaxChunkEdges = 256;
// Each group keeps one edge in flight, so residency is the memory parallelism: at most 128
// registers (2 blocks of 256 threads per SM) instead of the 150 the widest rows would take; a cap
// of 80 (3 blocks) spilled.
constexpr int kSortedBlocksPerSM = 2;

// Row of position i, with every out-of-range index folded onto -1 or num_rows: sorted stays
// sorted, and those runs belong to no row.
template <typename Idx>
__device__ __forceinline__ int64_t row_at(const Idx* rows, int64_t i, int64_t num_rows) {
  const int64_t r = static_cast<int64_t>(rows[i]);
  return r < 0 ? -1 : (r > num_rows ? num_rows : r);
}

// Workspace slots of chunk c: 2c holds its first run when that run continues the previous
// chunk's row, 2c + 1 its last run when that run starts the row and the next chunk continues it.
template <typename T, int VEC, typename RowIdx, typename OtherIdx>
__global__ void __launch_bounds__(kBlockThreads, kSortedBlocksPerSM)
grad_sorted_kernel(GradArgs a, T* __restrict__ grad, accum_t<T>* __restrict__ workspace, int group,
                   int64_t chunk_edges) {
  using A = accum_t<T>;
  const T* __restrict__ grad_out = static_cast<const T*>(a.grad_out);
  const T* __restrict__ other = static_cast<const T*>(a.other.data);
  const RowIdx* __restrict__ row_idx = static_cast<const RowIdx*>(a.row_idx);
  const OtherIdx* __restrict__ other_idx = static_cast<const OtherIdx*>(a.other_idx);

  const int64_t vectors = a.dim / VEC;
  const int64_t chunks = (a.num_edges + chunk_edges - 1) / chunk_edges;
  const int64_t units = chunks * a.row_heads;
  const int lane = threadIdx.x & (group - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / group;
  // A broadcast row head collects every head of the edge; otherwise only its own.
  const int64_t heads_per_row_head = a.row_heads == 1 ? a.heads : 1;

  for (int64_t unit = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / group; unit < units;
       unit += stride) {
    const int64_t chunk = unit / a.row_heads;
    const int64_t row_head = unit - chunk * a.row_heads;
    const int64_t first_head = a.row_heads == 1 ? 0 : row_head;
    const int64_t begin = chunk * chunk_edges;
    const int64_t end = min(a.num_edges, begin + chunk_edges);
    const int64_t row_before = begin > 0 ? row_at(row_idx, begin - 1, a.num_rows) : -2;
    const int64_t row_after = end < a.num_edges ? row_at(row_idx, end, a.num_rows) : -2;
    for (int64_t base = lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC> slice;
      slice.zero();
      int64_t current = row_at(row_idx, begin, a.num_rows);
      bool first_run = true;
      auto flush = [&](bool last_run) {
        if (!in_range(current, a.num_rows)) return;
        const bool continues = first_run && current == row_before;
        if (continues || (last_run && current == row_after)) {
          const int64_t slot = 2 * chunk + (continues ? 0 : 1);
          store_slice<A>(workspace + (slot * a.row_heads + row_head) * a.dim, slice.acc, base, group, vectors);
        } else {
          store_slice<T>(grad + (current * a.row_heads + row_head) * a.dim, slice.acc, base, group, vectors);
        }
      };
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = row_at(row_idx, i, a.num_rows);
        if (r != current) {
          flush(false);
          slice.zero();
          current = r;
          first_run = false;
        }
        const OtherIdx o = other_idx[i];
        if (!in_range(r, a.num_rows) || !in_range(o, a.other.num_rows)) continue;
        for (int64_t h = first_head; h < first_head + heads_per_row_head; ++h) {
          const A g = to_accum(grad_out[i * a.heads + h]);
          slice.add_scaled(g, other + static_cast<int64_t>(o) * a.other.row_stride + h * a.other.head_stride, base,
                           group, vectors);
        }
      }
      flush(true);
    }
  }
}

// For each row cut by chunk boundaries, the chunk where it starts sums its own slot and the
// continuing chunks' slots in chunk order, in double (a hot row spans thousands of chunks).
template <typename T, int VEC, typename RowIdx>
__global__ void __launch_bounds__(kBlockThreads)
combine_chunks_kernel(GradArgs a, T* __restrict__ grad, const accum_t<T>* __restrict__ workspace, int group,
                      int64_t chunk_edges) {
  const RowIdx* __restrict__ row_idx = static_cast<const RowIdx*>(a.row_idx);
  const int64_t vectors = a.dim / VEC;
  const int64_t chunks = (a.num_edges + chunk_edges - 1) / chunk_edges;
  const int64_t units = chunks * a.row_heads;
  const int lane = threadIdx.x & (group - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / group;

  for (int64_t unit = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / group; unit < units;
       unit += stride) {
    const int64_t chunk = unit / a.row_heads;
    const int64_t row_head = unit - chunk * a.row_heads;
    const int64_t begin = chunk * chunk_edges;
    const int64_t end = min(a.num_edges, begin + chunk_edges);
    if (end >= a.num_edges) continue;
    const int64_t row = row_at(row_idx, end - 1, a.num_rows);
    if (!in_range(row, a.num_rows) || row_at(row_idx, end, a.num_rows) != row) continue;
    // The chunk's last run is a continuation (slot 2c) when the row fills the chunk and began before.
    if (row_at(row_idx, begin, a.num_rows) == row && begin > 0 && row_at(row_idx, begin - 1, a.num_rows) == row) {
      continue;
    }
    for (int64_t base = lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      double acc[kVectorsPerLane][VEC] = {};
      auto add_slot = [&](int64_t slot) {
        add_slice(acc, workspace + (slot * a.row_heads + row_head) * a.dim, base, group, vectors);
      };
      add_slot(2 * chunk + 1);
      for (int64_t next = chunk + 1; next < chunks && row_at(row_idx, next * chunk_edges, a.num_rows) == row; ++next) {
        add_slot(2 * next);
      }
      store_slice<T>(grad + (row * a.row_heads + row_head) * a.dim, acc, base, group, vectors);
    }
  }
}

template <typename T, int VEC, typename RowIdx, typename OtherIdx>
void launch(const GradArgs& a, T* grad, void* workspace, int64_t chunk_edges, cudaStream_t stream) {
  using A = accum_t<T>;
  const int group = group_size(a.dim / VEC);
  const int64_t units = (a.num_edges + chunk_edges - 1) / chunk_edges * a.row_heads;
  auto* w = static_cast<A*>(workspace);
  auto reduce = grad_sorted_kernel<T, VEC, RowIdx, OtherIdx>;
  reduce<<<grid_blocks(reduce, units * group), kBlockThreads, 0, stream>>>(a, grad, w, group, chunk_edges);
  auto combine = combine_chunks_kernel<T, VEC, RowIdx>;
  combine<<<grid_blocks(combine, units * group), kBlockThreads, 0, stream>>>(a, grad, w, group, chunk_edges);
}

int64_t sorted_chunk_edges(const GradArgs& a, ScalarKind scalar) {
  const int64_t accum_bytes = scalar == ScalarKind::f64 ? 8 : 4;
  const int64_t slot_bytes = std::max<int64_t>(1, 2 * a.row_heads * a.dim * accum_bytes);
  const int64_t max_chunks = std::max<int64_t>(1, kWorkspaceBytes / slot_bytes);
  // About four chunks per 8-lane group a full SM could hold, so that every SM has work on small
  // graphs; at most kMaxChunkEdges, so that no group walks far alone.
  const int64_t resident_groups = static_cast<int64_t>(sm_count()) * 2048 / 8;
  const int64_t balanced = std::clamp<int64_t>(a.num_edges / (4 * resident_groups), kMinChunkEdges, kMaxChunkEdges);
  return std::max(balanced, (a.num_edges + max_chunks - 1) / max_chunks);
}

int64_t sorted_workspace_slots(const GradArgs& a, int64_t chunk_edges) {
  return 2 * ((a.num_edges + chunk_edges - 1) / chunk_edges);
}

void launch_grad_sorted(const GradArgs& a, void* grad, void* workspace, int64_t chunk_edges, ScalarKind scalar,
                        IndexKind row_index, IndexKind other_index, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    auto* g = static_cast<T*>(grad);
    dispatch_index(row_index, [&](auto ri) {
      dispatch_index(other_index, [&](auto oi) {
        using RowIdx = decltype(ri);
        using OtherIdx = decltype(oi);
        if (rows_vectorizable<T>(a.other, a.dim)) {
          launch<T, wide_vec<T>(), RowIdx, OtherIdx>(a, g, workspace, chunk_edges, stream);
        } else {
          launch<T, 1, RowIdx, OtherIdx>(a, g, workspace, chunk_edges, stream);
        }
      });
    });
  });
}

}  // namespace edgedot
