// Backward over edges sorted by row (as given, sorted per call, or from an EdgePlan): each group
// walks a chunk of consecutive edges, sums each run of one row in registers and writes the row
// once; no float atomics. A run cut by a chunk boundary is parked in a workspace slot, and the
// chunk where its row starts sums the slots in chunk order. The result depends only on the edge
// order: bitwise reproducible.
#include <algorithm>

#include "edge_dot/grad_common.cuh"

namespace edgedot {

// Workspace cap: chunks grow past the shortest useful length rather than need more.
constexpr int64_t kWorkspaceBytes = int64_t{64} << 20;
constexpr int64_t kMinChunkEdges = 8;
constexpr int64_t kMaxChunkEdges = 256;
// Two items of kVectorsPerLane vectors in flight per lane at 2 blocks per SM (128 registers): more
// bytes in flight beat more resident warps here (the shapes tried are in NOTES.md).
constexpr int kSortedBlocksPerSM = 2;
// Prefetched gather addresses (sum_runs) fit in those 128 registers for float32 only: the half
// types' row slices take twice the registers as float accumulators, and would spill.
template <typename T>
constexpr bool kSortedPrefetch = std::is_same_v<T, float>;

// Row of position i, with every out-of-range index folded onto -1 or num_rows: sorted stays
// sorted, and those runs belong to no row.
template <typename Edges>
__device__ __forceinline__ int64_t row_at(const Edges& edges, int64_t i, int64_t num_rows) {
  const int64_t r = static_cast<int64_t>(edges.row(i));
  return r < 0 ? -1 : (r > num_rows ? num_rows : r);
}

// Workspace slots of chunk c: 2c holds its first run when that run continues the previous
// chunk's row, 2c + 1 its last run when that run starts the row and the next chunk continues it.
// Rows without edges are zeroed by the chunk holding the first edge after them (the last chunk
// zeroes the rows after its last run), so the gradient needs no memset.
template <typename T, int VEC, typename Edges>
__global__ void __launch_bounds__(kBlockThreads, kSortedBlocksPerSM)
grad_sorted_kernel(GradArgs a, Edges edges, T* __restrict__ grad, accum_t<T>* __restrict__ workspace, int group,
                   int64_t chunk_edges) {
  using Row = typename Edges::Row;
  const int64_t vectors = a.dim / VEC;
  const int64_t row_elems = a.row_heads * a.dim;
  const GroupUnits units(group, (a.num_edges + chunk_edges - 1) / chunk_edges * a.row_heads);
  // A broadcast row head collects every head of the edge; otherwise only its own.
  const int64_t heads_per_row_head = a.row_heads == 1 ? a.heads : 1;

  for (int64_t unit = units.first; unit < units.count; unit += units.stride) {
    const int64_t chunk = unit / a.row_heads;
    const int64_t row_head = unit - chunk * a.row_heads;
    const int64_t begin = chunk * chunk_edges;
    const int64_t end = min(a.num_edges, begin + chunk_edges);
    // Rows are compared as stored: out-of-range ones sort below 0 or from num_rows on, and no
    // flush or zeroing touches them.
    const int64_t row_before = begin > 0 ? static_cast<int64_t>(edges.row(begin - 1)) : -1;
    const int64_t row_after = end < a.num_edges ? static_cast<int64_t>(edges.row(end)) : -2;
    T* grad_head = grad + row_head * a.dim;
    accum_t<T>* slots = workspace + row_head * a.dim;
    for (int64_t base = units.lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC> slice(base, group, vectors);
      // Zeroes the rows strictly between two consecutive rows of the edge order (no edge has them).
      auto zero_rows_between = [&](int64_t prev, int64_t next) {
        if (prev >= a.num_rows) return;  // also keeps prev + 1 from overflowing
        for (int64_t r = prev < 0 ? 0 : prev + 1; r < min(next, a.num_rows); ++r) {
          slice.store_zero(grad_head + r * row_elems);
        }
      };
      bool first_run = true;
      auto flush = [&](int64_t row, bool last_run) {
        if (!in_range(row, a.num_rows)) return;
        const bool continues = first_run && row == row_before;
        if (continues || (last_run && row == row_after)) {
          slice.store(slots + (2 * chunk + (continues ? 0 : 1)) * row_elems);
        } else {
          slice.store(grad_head + row * row_elems);
        }
      };
      zero_rows_between(row_before, edges.row(begin));
      const int64_t first_head = a.row_heads == 1 ? 0 : row_head;
      auto on_run_end = [&](Row row, Row next) {
        flush(row, false);
        first_run = false;
        zero_rows_between(row, next);
      };
      const Row last = sum_runs<kSortedPrefetch<T>>(a, edges, begin, end, first_head, heads_per_row_head, slice,
                                                    on_run_end);
      flush(last, true);
      if (end == a.num_edges) zero_rows_between(last, a.num_rows);
    }
  }
}

// For each row cut by chunk boundaries, the chunk where it starts sums its own slot and the
// continuing chunks' slots in chunk order, in double (a hot row spans thousands of chunks).
template <typename T, int VEC, typename Edges>
__global__ void __launch_bounds__(kBlockThreads)
combine_chunks_kernel(GradArgs a, Edges edges, T* __restrict__ grad, const accum_t<T>* __restrict__ workspace,
                      int group, int64_t chunk_edges) {
  const int64_t vectors = a.dim / VEC;
  const int64_t row_elems = a.row_heads * a.dim;
  const int64_t chunks = (a.num_edges + chunk_edges - 1) / chunk_edges;
  const GroupUnits units(group, chunks * a.row_heads);

  for (int64_t unit = units.first; unit < units.count; unit += units.stride) {
    const int64_t chunk = unit / a.row_heads;
    const int64_t row_head = unit - chunk * a.row_heads;
    const int64_t begin = chunk * chunk_edges;
    const int64_t end = min(a.num_edges, begin + chunk_edges);
    if (end >= a.num_edges) continue;
    const int64_t row = row_at(edges, end - 1, a.num_rows);
    if (!in_range(row, a.num_rows) || row_at(edges, end, a.num_rows) != row) continue;
    // The chunk's last run is a continuation (slot 2c) when the row fills the chunk and began before.
    if (row_at(edges, begin, a.num_rows) == row && begin > 0 && row_at(edges, begin - 1, a.num_rows) == row) {
      continue;
    }
    const accum_t<T>* slots = workspace + row_head * a.dim;
    for (int64_t base = units.lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC, double> sum(base, group, vectors);
      sum.add_part(slots + (2 * chunk + 1) * row_elems);
      for (int64_t next = chunk + 1; next < chunks && row_at(edges, next * chunk_edges, a.num_rows) == row; ++next) {
        sum.add_part(slots + 2 * next * row_elems);
      }
      sum.store(grad + row * row_elems + row_head * a.dim);
    }
  }
}

template <typename T, int VEC, typename Edges>
void launch(const GradArgs& a, const Edges& edges, T* grad, void* workspace, int64_t chunk_edges,
            cudaStream_t stream) {
  const int64_t units = (a.num_edges + chunk_edges - 1) / chunk_edges * a.row_heads;
  auto* w = static_cast<accum_t<T>*>(workspace);
  const int group = group_size(a.dim / VEC);
  auto reduce = grad_sorted_kernel<T, VEC, Edges>;
  reduce<<<grid_blocks(reduce, units * group), kBlockThreads, 0, stream>>>(a, edges, grad, w, group, chunk_edges);
  auto combine = combine_chunks_kernel<T, VEC, Edges>;
  combine<<<grid_blocks(combine, units * group), kBlockThreads, 0, stream>>>(a, edges, grad, w, group, chunk_edges);
}

template <typename T, typename Edges>
void launch_with_vec(const GradArgs& a, const Edges& edges, T* grad, void* workspace, int64_t chunk_edges,
                     cudaStream_t stream) {
  if (rows_vectorizable<T>(a.other, a.dim)) {
    launch<T, wide_vec<T>()>(a, edges, grad, workspace, chunk_edges, stream);
  } else {
    launch<T, 1>(a, edges, grad, workspace, chunk_edges, stream);
  }
}

int64_t sorted_chunk_edges(const GradArgs& a, ScalarKind scalar) {
  const int64_t accum_bytes = scalar == ScalarKind::f64 ? 8 : 4;
  const int64_t slot_bytes = std::max<int64_t>(1, 2 * a.row_heads * a.dim * accum_bytes);
  const int64_t max_chunks = std::max<int64_t>(1, kWorkspaceBytes / slot_bytes);
  // About sixteen chunks per group a full GPU holds, so that every SM has work on small graphs and
  // the groups finish together (with four, some groups walked on alone at the end); at
  // most kMaxChunkEdges, so that no group walks far alone, unless the workspace cap needs more.
  int64_t vec = 1;
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    if (rows_vectorizable<T>(a.other, a.dim)) vec = wide_vec<T>();
  });
  const int64_t resident_groups =
      static_cast<int64_t>(sm_count()) * kSortedBlocksPerSM * kBlockThreads / group_size(a.dim / vec);
  const int64_t balanced = std::clamp<int64_t>(a.num_edges / (16 * resident_groups), kMinChunkEdges, kMaxChunkEdges);
  const int64_t chunk_edges = std::max(balanced, (a.num_edges + max_chunks - 1) / max_chunks);
  // Whole waves: chunks lengthened until their count is at most a multiple of the resident groups,
  // so that no group walks one chunk more than the others at the end, if they grow by at most an
  // eighth (longer chunks cost more than the ragged last wave).
  const int64_t waves = (a.num_edges + chunk_edges - 1) / chunk_edges * a.row_heads / resident_groups;
  if (waves == 0) return chunk_edges;
  const int64_t whole = waves * resident_groups;
  const int64_t even = (a.num_edges * a.row_heads + whole - 1) / whole;
  return even <= chunk_edges + chunk_edges / 8 ? std::max(chunk_edges, even) : chunk_edges;
}

int64_t sorted_workspace_slots(const GradArgs& a, int64_t chunk_edges) {
  return 2 * ((a.num_edges + chunk_edges - 1) / chunk_edges);
}

void launch_grad_sorted(const GradArgs& a, const uint64_t* pairs, void* grad, void* workspace,
                        int64_t chunk_edges, ScalarKind scalar, IndexKind row_index, IndexKind other_index,
                        cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    auto* g = static_cast<T*>(grad);
    if constexpr (sizeof(T) <= 4) {
      if (pairs != nullptr) {
        const PackedEdges<T> edges{static_cast<const int32_t*>(a.row_idx), pairs};
        launch_with_vec<T>(a, edges, g, workspace, chunk_edges, stream);
        return;
      }
    }
    dispatch_index(row_index, [&](auto ri) {
      dispatch_index(other_index, [&](auto oi) {
        const auto edges = GivenEdges<T, decltype(ri), decltype(oi)>::of(a);
        launch_with_vec<T>(a, edges, g, workspace, chunk_edges, stream);
      });
    });
  });
}

void launch_grad_planned(const GradArgs& a, const PlanSide& plan, void* grad, void* workspace,
                         int64_t chunk_edges, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    const PlannedEdges<T> edges{plan.order, plan.row_other, static_cast<const T*>(a.grad_out), a.heads, a.num_edges};
    launch_with_vec<T>(a, edges, static_cast<T*>(grad), workspace, chunk_edges, stream);
  });
}

}  // namespace edgedot
