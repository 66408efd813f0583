// Forward: one fused gather-dot per (edge, head); no gathered rows ever reach memory.
#include <cmath>

#include "common.cuh"

namespace edgedot {

// A group of `group` lanes owns one (edge, head) item at a time: each lane multiplies up to
// kVectorsPerLane vectors of the two rows per pass, then the group sums across its lanes.
// Items stride over the grid; the loop bound is kept uniform across the warp so that every lane
// reaches the shuffles. Edges are visited in a.order when it is used (edge_order.cu). At most 64
// registers (four blocks per SM): the gather is latency-bound, and half types measured 25% faster
// at that occupancy.
template <typename T, int VEC, typename SrcIdx, typename DstIdx, bool kOrdered>
__global__ void __launch_bounds__(kBlockThreads, 4)
forward_kernel(ForwardArgs a, EdgeOrder order, int group) {
  // With an order, both variants are launched and the one matching the device's decision runs.
  if (order.used != nullptr && (*order.used != 0) != kOrdered) return;
  using A = accum_t<T>;
  const T* __restrict__ src = static_cast<const T*>(a.src.data);
  const T* __restrict__ dst = static_cast<const T*>(a.dst.data);
  const SrcIdx* __restrict__ src_idx = static_cast<const SrcIdx*>(a.src_idx);
  const DstIdx* __restrict__ dst_idx = static_cast<const DstIdx*>(a.dst_idx);
  T* __restrict__ out = static_cast<T*>(a.out);

  const int64_t vectors = a.dim / VEC;
  const int64_t items = a.num_edges * a.heads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & (group - 1);
  const int group_in_warp = (threadIdx.x & 31) / group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / group;

  for (int64_t item = thread / group; item - group_in_warp < items; item += stride) {
    A acc = 0;
    bool bad_src = false, bad_dst = false;
    if (item < items) {
      const int64_t visit = a.heads == 1 ? item : item / a.heads;
      const int64_t h = item - visit * a.heads;
      const int64_t e = kOrdered ? order.order[visit] : visit;
      const SrcIdx s = src_idx[e];
      const DstIdx d = dst_idx[e];
      bad_src = !in_range(s, a.src.num_rows);
      bad_dst = !in_range(d, a.dst.num_rows);
      if (!bad_src && !bad_dst) {
        const T* srow = src + static_cast<int64_t>(s) * a.src.row_stride + h * a.src.head_stride;
        const T* drow = dst + static_cast<int64_t>(d) * a.dst.row_stride + h * a.dst.head_stride;
        for (int64_t base = lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
          Vec<T, VEC> sv[kVectorsPerLane], dv[kVectorsPerLane];
#pragma unroll
          for (int u = 0; u < kVectorsPerLane; ++u) {
            const int64_t v = base + static_cast<int64_t>(u) * group;
            if (v < vectors) {
              sv[u] = load_vec<T, VEC>(srow + v * VEC);
              dv[u] = load_vec<T, VEC>(drow + v * VEC);
            }
          }
#pragma unroll
          for (int u = 0; u < kVectorsPerLane; ++u) {
            if (base + static_cast<int64_t>(u) * group < vectors) acc = dot_add(acc, sv[u], dv[u]);
          }
        }
      }
    }
    acc = group_sum(acc, group);
    if (item < items && lane == 0) {
      int64_t out_at = item;
      if constexpr (kOrdered) {  // recomputed rather than kept live through the row loop, which spills
        const int64_t visit = a.heads == 1 ? item : item / a.heads;
        out_at = order.order[visit] * a.heads + (item - visit * a.heads);
      }
      if (bad_src || bad_dst) {
        out[out_at] = from_accum<T>(static_cast<A>(NAN));
        if (a.error_flag) a.error_flag[bad_src ? 0 : 1] = 1;
      } else {
        out[out_at] = from_accum<T>(acc);
      }
    }
  }
}

template <typename T, int VEC, typename SrcIdx, typename DstIdx, bool kOrdered>
void launch(const ForwardArgs& a, const EdgeOrder& order, cudaStream_t stream) {
  const int group = group_size(a.dim / VEC);
  auto kernel = forward_kernel<T, VEC, SrcIdx, DstIdx, kOrdered>;
  const int blocks = grid_blocks(kernel, a.num_edges * a.heads * group);
  kernel<<<blocks, kBlockThreads, 0, stream>>>(a, order, group);
}

template <typename T, int VEC, typename SrcIdx, typename DstIdx>
void launch_both_orders(const ForwardArgs& a, const EdgeOrder& order, cudaStream_t stream) {
  launch<T, VEC, SrcIdx, DstIdx, false>(a, order, stream);
  if (order.order != nullptr) launch<T, VEC, SrcIdx, DstIdx, true>(a, order, stream);
}

void launch_forward(const ForwardArgs& a, const EdgeOrder& order, ScalarKind scalar, IndexKind src_index,
                    IndexKind dst_index, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    dispatch_index(src_index, [&](auto si) {
      dispatch_index(dst_index, [&](auto di) {
        using SrcIdx = decltype(si);
        using DstIdx = decltype(di);
        if (rows_vectorizable<T>(a.src, a.dim) && rows_vectorizable<T>(a.dst, a.dim)) {
          launch_both_orders<T, wide_vec<T>(), SrcIdx, DstIdx>(a, order, stream);
        } else {
          launch_both_orders<T, 1, SrcIdx, DstIdx>(a, order, stream);
        }
      });
    });
  });
}

}  // namespace edgedot
