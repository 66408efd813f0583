// Forward: one fused gather-dot per (edge, head); no gathered rows ever reach memory.
#include <cmath>

#include "common.cuh"

namespace edgedot {

// A group of `group` lanes owns one (edge, head) item at a time: each lane multiplies up to
// kVectorsPerLane vectors of the two rows per pass, then the group sums across its lanes.
// A warp walks a contiguous run of items, its groups side by side, so index loads and output
// stores stay coalesced; a repeated source row (edges sorted by source) is shared by the groups
// of one load and, when a group meets it again, kept in registers. The next item's indices are
// fetched while the current rows load. Every group of a warp runs the same number of steps, so
// all lanes reach the shuffles.
template <typename T, int VEC, typename SrcIdx, typename DstIdx>
__global__ void __launch_bounds__(kBlockThreads)
forward_kernel(ForwardArgs a, int group) {
  using A = accum_t<T>;
  const T* __restrict__ src = static_cast<const T*>(a.src.data);
  const T* __restrict__ dst = static_cast<const T*>(a.dst.data);
  const SrcIdx* __restrict__ src_idx = static_cast<const SrcIdx*>(a.src_idx);
  const DstIdx* __restrict__ dst_idx = static_cast<const DstIdx*>(a.dst_idx);
  T* __restrict__ out = static_cast<T*>(a.out);

  const int64_t vectors = a.dim / VEC;
  const int64_t items = a.num_edges * a.heads;
  const int groups_per_warp = 32 / group;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t steps = (items + warps * groups_per_warp - 1) / (warps * groups_per_warp);
  const int64_t warp_first = warp * steps * groups_per_warp;
  const int64_t first = warp_first + (threadIdx.x & 31) / group;
  const int64_t last = min(items, warp_first + steps * groups_per_warp);
  const int lane = threadIdx.x & (group - 1);
  // One pass holds the whole row when it fits: then a repeated source row is not reloaded.
  const bool row_in_registers = vectors <= static_cast<int64_t>(group) * kVectorsPerLane;

  SrcIdx next_s = 0;
  DstIdx next_d = 0;
  if (first < last) {
    next_s = src_idx[first / a.heads];
    next_d = dst_idx[first / a.heads];
  }
  const T* held_row = nullptr;
  Vec<T, VEC> sv[kVectorsPerLane];
  for (int64_t step = 0, item = first; step < steps; ++step, item += groups_per_warp) {
    const bool active = item < last;
    const SrcIdx s = next_s;
    const DstIdx d = next_d;
    if (item + groups_per_warp < last) {
      next_s = src_idx[(item + groups_per_warp) / a.heads];
      next_d = dst_idx[(item + groups_per_warp) / a.heads];
    }
    const bool bad_src = active && !in_range(s, a.src.num_rows);
    const bool bad_dst = active && !in_range(d, a.dst.num_rows);
    A acc = 0;
    if (active && !bad_src && !bad_dst) {
      const int64_t h = item % a.heads;
      const T* srow = src + static_cast<int64_t>(s) * a.src.row_stride + h * a.src.head_stride;
      const T* drow = dst + static_cast<int64_t>(d) * a.dst.row_stride + h * a.dst.head_stride;
      for (int64_t base = lane; base < vectors; base += static_cast<int64_t>(group) * kVectorsPerLane) {
        Vec<T, VEC> dv[kVectorsPerLane];
        const bool load_src = !row_in_registers || srow != held_row;
#pragma unroll
        for (int u = 0; u < kVectorsPerLane; ++u) {
          const int64_t v = base + static_cast<int64_t>(u) * group;
          if (v < vectors) {
            if (load_src) sv[u] = load_vec<T, VEC>(srow + v * VEC);
            dv[u] = load_vec<T, VEC>(drow + v * VEC);
          }
        }
#pragma unroll
        for (int u = 0; u < kVectorsPerLane; ++u) {
          if (base + static_cast<int64_t>(u) * group < vectors) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc += to_accum(sv[u].v[j]) * to_accum(dv[u].v[j]);
          }
        }
      }
      held_row = srow;
    }
    acc = group_sum(acc, group);
    if (active && lane == 0) {
      if (bad_src || bad_dst) {
        out[item] = from_accum<T>(static_cast<A>(NAN));
        if (a.error_flag) a.error_flag[bad_src ? 0 : 1] = 1;
      } else {
        out[item] = from_accum<T>(acc);
      }
    }
  }
}

template <typename T, int VEC, typename SrcIdx, typename DstIdx>
void launch(const ForwardArgs& a, cudaStream_t stream) {
  const int group = group_size(a.dim / VEC);
  auto kernel = forward_kernel<T, VEC, SrcIdx, DstIdx>;
  const int blocks = grid_blocks(kernel, a.num_edges * a.heads * group);
  kernel<<<blocks, kBlockThreads, 0, stream>>>(a, group);
}

void launch_forward(const ForwardArgs& a, ScalarKind scalar, IndexKind src_index, IndexKind dst_index,
                    cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    dispatch_index(src_index, [&](auto si) {
      dispatch_index(dst_index, [&](auto di) {
        using SrcIdx = decltype(si);
        using DstIdx = decltype(di);
        if (rows_vectorizable<T>(a.src, a.dim) && rows_vectorizable<T>(a.dst, a.dim)) {
          launch<T, wide_vec<T>(), SrcIdx, DstIdx>(a, stream);
        } else {
          launch<T, 1, SrcIdx, DstIdx>(a, stream);
        }
      });
    });
  });
}

}  // namespace edgedot
