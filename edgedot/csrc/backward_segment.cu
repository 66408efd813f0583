// Backward with a plan: each row reduced in registers over its sorted edges; no float atomics.
#include "grad_common.cuh"

namespace edgedot {

// A group owns a (piece, row head) unit: it sums g * other_row over the piece's edges in sorted
// order and writes the row once, or parks the partial sum in the piece's workspace slot when the
// row was split. One item in flight: two, as in the sorted reduction, measured 13% slower here
// (2**24 edges, 128 floats, H200).
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
grad_segment_kernel(GradArgs a, PlanArgs p, T* __restrict__ grad, accum_t<T>* __restrict__ workspace, int group) {
  const T* __restrict__ grad_out = static_cast<const T*>(a.grad_out);
  const T* __restrict__ other = static_cast<const T*>(a.other.data);
  const int64_t vectors = a.dim / VEC;
  const int64_t row_elems = a.row_heads * a.dim;
  const GroupUnits units(group, p.num_pieces * a.row_heads);
  // A broadcast row head collects every head of the edge; otherwise only its own.
  const int64_t heads_per_row_head = a.row_heads == 1 ? a.heads : 1;

  for (int64_t unit = units.first; unit < units.count; unit += units.stride) {
    const int64_t piece = unit / a.row_heads;
    const int64_t row_head = unit - piece * a.row_heads;
    const int64_t row = p.piece_row[piece];
    if (row < 0) continue;
    const int64_t begin = p.piece_begin[piece];
    const int64_t end = p.piece_end[piece];
    const int64_t slot = p.piece_slot[piece];
    const int64_t first_head = a.row_heads == 1 ? 0 : row_head;
    for (int64_t base = units.lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC> slice(base, group, vectors);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t e = p.order[i];
        const int64_t o = p.other_sorted[i];
        if (!in_range(e, a.num_edges) || !in_range(o, a.other.num_rows)) continue;
        for (int64_t h = first_head; h < first_head + heads_per_row_head; ++h) {
          slice.add_scaled(to_accum(grad_out[e * a.heads + h]),
                           other + o * a.other.row_stride + h * a.other.head_stride);
        }
      }
      if (slot < 0) {
        slice.store(grad + row * row_elems + row_head * a.dim);
      } else {
        slice.store(workspace + slot * row_elems + row_head * a.dim);
      }
    }
  }
}

// Sums the pieces of each split row in slot order, which fixes the rounding: deterministic. The
// sum runs in double: a hot row of a large graph has thousands of pieces, and a float running
// sum over them would lose the accuracy each piece kept.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
combine_pieces_kernel(GradArgs a, PlanArgs p, T* __restrict__ grad, const accum_t<T>* __restrict__ workspace,
                      int group) {
  const int64_t vectors = a.dim / VEC;
  const int64_t row_elems = a.row_heads * a.dim;
  const GroupUnits units(group, a.num_rows * a.row_heads);

  for (int64_t unit = units.first; unit < units.count; unit += units.stride) {
    const int64_t row = unit / a.row_heads;
    const int64_t pieces = p.row_pieces[row];
    if (pieces <= 1) continue;
    const int64_t row_head = unit - row * a.row_heads;
    const accum_t<T>* slots = workspace + p.row_slot_begin[row] * row_elems + row_head * a.dim;
    for (int64_t base = units.lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
      RowSlice<T, VEC, double> sum(base, group, vectors);
      for (int64_t k = 0; k < pieces; ++k) sum.add_part(slots + k * row_elems);
      sum.store(grad + row * row_elems + row_head * a.dim);
    }
  }
}

template <typename T, int VEC>
void launch(const GradArgs& a, const PlanArgs& p, T* grad, accum_t<T>* workspace, cudaStream_t stream) {
  const int group = group_size(a.dim / VEC);
  auto segment = grad_segment_kernel<T, VEC>;
  segment<<<grid_blocks(segment, p.num_pieces * a.row_heads * group), kBlockThreads, 0, stream>>>(
      a, p, grad, workspace, group);
  auto combine = combine_pieces_kernel<T, VEC>;
  combine<<<grid_blocks(combine, a.num_rows * a.row_heads * group), kBlockThreads, 0, stream>>>(
      a, p, grad, workspace, group);
}

void launch_grad_segment(const GradArgs& a, const PlanArgs& p, void* grad, void* workspace, ScalarKind scalar,
                         cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    auto* g = static_cast<T*>(grad);
    auto* w = static_cast<accum_t<T>*>(workspace);
    if (rows_vectorizable<T>(a.other, a.dim)) {
      launch<T, wide_vec<T>()>(a, p, g, w, stream);
    } else {
      launch<T, 1>(a, p, g, w, stream);
    }
  });
}

}  // namespace edgedot
