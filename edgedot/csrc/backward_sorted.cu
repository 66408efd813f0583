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
// Each lane carries one vector of the row and loads the next kItemsInFlight (edge, head) items'
// indices, then their rows, before adding any: the gather is latency-bound. Measured on an H200
// (2**24 sorted edges, 128 floats): one item in flight per group and 2 blocks per SM took 3.29
// ms, 2 items and 4 blocks (64 registers) 2.84, 4 items and 3 blocks 2.85, 8 items and 2 blocks
// 3.23.
constexpr int kItemsInFlight = 2;
constexpr int kSortedBlocksPerSM = 4;

// Row of position i, with every out-of-range index folded onto -1 or num_rows: sorted stays
// sorted, and those runs belong to no row.
template <typename Idx>
__device__ __forceinline__ int64_t row_at(const Idx* rows, int64_t i, int64_t num_rows) {
  const int64_t r = static_cast<int64_t>(rows[i]);
  return r < 0 ? -1 : (r > num_rows ? num_rows : r);
}

// Lanes per (chunk, head) unit: one vector each, up to a warp; wider rows take several passes.
inline int sorted_group_size(int64_t vectors) {
  int g = 1;
  while (g < 32 && g < vectors) g *= 2;
  return g;
}

// Workspace slots of chunk c: 2c holds its first run when that run continues the previous
// chunk's row, 2c + 1 its last run when that run starts the row and the next chunk continues it.
// Rows without edges are zeroed by the chunk holding the first edge after them (the last chunk
// zeroes the rows after its last run), so the gradient needs no memset.
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
    // Rows are compared as stored: out-of-range ones sort below 0 or from num_rows on, and no
    // flush or zeroing touches them.
    const int64_t row_before = begin > 0 ? static_cast<int64_t>(row_idx[begin - 1]) : -1;
    const int64_t row_after = end < a.num_edges ? static_cast<int64_t>(row_idx[end]) : -2;
    T* grad_head = grad + row_head * a.dim;
    for (int64_t v = lane; v < vectors; v += group) {
      // Zeroes the rows strictly between two consecutive rows of the edge order (no edge has them).
      auto zero_rows_between = [&](int64_t prev, int64_t next) {
        if (prev >= a.num_rows) return;  // also keeps prev + 1 from overflowing
        Vec<T, VEC> zero;
#pragma unroll
        for (int j = 0; j < VEC; ++j) zero.v[j] = from_accum<T>(A(0));
        for (int64_t r = prev < 0 ? 0 : prev + 1; r < min(next, a.num_rows); ++r) {
          *reinterpret_cast<Vec<T, VEC>*>(grad_head + r * a.row_heads * a.dim + v * VEC) = zero;
        }
      };
      A acc[VEC] = {};
      RowIdx current = row_idx[begin];
      bool first_run = true;
      auto flush = [&](bool last_run) {
        if (!in_range(current, a.num_rows)) return;
        const bool continues = first_run && current == row_before;
        if (continues || (last_run && current == row_after)) {
          const int64_t slot = 2 * chunk + (continues ? 0 : 1);
          store_vec(workspace + (slot * a.row_heads + row_head) * a.dim + v * VEC, acc);
        } else {
          store_vec(grad_head + static_cast<int64_t>(current) * a.row_heads * a.dim + v * VEC, acc);
        }
      };
      zero_rows_between(row_before, current);
      const T* other_v = other + first_head * a.other.head_stride + v * VEC;
      const T* grad_out_h = grad_out + first_head;
      // Items (edge e, head h of the edge), edge-major; a broadcast row head walks every head.
      int64_t e = begin;
      int64_t h = 0;
      while (e < end) {
        RowIdx rows[kItemsInFlight];
        bool live[kItemsInFlight], adds[kItemsInFlight];
        A g[kItemsInFlight];
        Vec<T, VEC> x[kItemsInFlight];
#pragma unroll
        for (int k = 0; k < kItemsInFlight; ++k) {
          live[k] = e < end;
          adds[k] = false;
          if (live[k]) {
            rows[k] = row_idx[e];
            const OtherIdx o = other_idx[e];
            adds[k] = in_range(rows[k], a.num_rows) && in_range(o, a.other.num_rows);
            if (adds[k]) {
              g[k] = to_accum(grad_out_h[e * a.heads + h]);
              x[k] = load_vec<T, VEC>(other_v + static_cast<int64_t>(o) * a.other.row_stride + h * a.other.head_stride);
            }
            if (++h == heads_per_row_head) {
              h = 0;
              ++e;
            }
          }
        }
#pragma unroll
        for (int k = 0; k < kItemsInFlight; ++k) {
          if (live[k] && rows[k] != current) {
            flush(false);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] = 0;
            zero_rows_between(current, rows[k]);
            current = rows[k];
            first_run = false;
          }
          if (adds[k]) add_scaled_vec(acc, g[k], x[k]);
        }
      }
      flush(true);
      if (end == a.num_edges) zero_rows_between(current, a.num_rows);
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
  const int64_t units = (a.num_edges + chunk_edges - 1) / chunk_edges * a.row_heads;
  auto* w = static_cast<A*>(workspace);
  const int reduce_group = sorted_group_size(a.dim / VEC);
  auto reduce = grad_sorted_kernel<T, VEC, RowIdx, OtherIdx>;
  reduce<<<grid_blocks(reduce, units * reduce_group), kBlockThreads, 0, stream>>>(a, grad, w, reduce_group,
                                                                                chunk_edges);
  const int combine_group = group_size(a.dim / VEC);
  auto combine = combine_chunks_kernel<T, VEC, RowIdx>;
  combine<<<grid_blocks(combine, units * combine_group), kBlockThreads, 0, stream>>>(a, grad, w, combine_group,
                                                                                   chunk_edges);
}

int64_t sorted_chunk_edges(const GradArgs& a, ScalarKind scalar) {
  const int64_t accum_bytes = scalar == ScalarKind::f64 ? 8 : 4;
  const int64_t slot_bytes = std::max<int64_t>(1, 2 * a.row_heads * a.dim * accum_bytes);
  const int64_t max_chunks = std::max<int64_t>(1, kWorkspaceBytes / slot_bytes);
  // About four chunks per group a full GPU holds, so that every SM has work on small graphs; at
  // most kMaxChunkEdges, so that no group walks far alone.
  int64_t vec = 1;
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    if (rows_vectorizable<T>(a.other, a.dim)) vec = wide_vec<T>();
  });
  const int64_t resident_groups =
      static_cast<int64_t>(sm_count()) * kSortedBlocksPerSM * kBlockThreads / sorted_group_size(a.dim / vec);
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
