// Forward: one fused gather-dot per (edge, head); no gathered rows ever reach memory.
#include <cmath>

#include "common/common.cuh"

namespace edgedot {

namespace {

// <src row s, head h> . <dst row d, head h>, summed over the `group` lanes that share the item, each
// lane multiplying up to kVectorsPerLane vectors of the two rows per pass. Every lane of the warp
// must call; a lane without an item (or with an out-of-range index) passes valid = false.
// acc + <x, y> with each product rounded to T first, as PyTorch's `(src * dst).sum(-1)` computes
// in a half type (a product of two halves is exact in float, so this is that rounding alone).
// Pairs convert and round two at a time, which keeps the registers of dot_add's pairs.
__device__ __forceinline__ float2 rounded_products(float2 a, float2 b, __half) {
  return __half22float2(__floats2half2_rn(a.x * b.x, a.y * b.y));
}
__device__ __forceinline__ float2 rounded_products(float2 a, float2 b, __nv_bfloat16) {
  return to_float2(__floats2bfloat162_rn(a.x * b.x, a.y * b.y));
}

template <typename T, int VEC>
__device__ __forceinline__ float dot_add_rounded(float acc, const Vec<T, VEC>& x, const Vec<T, VEC>& y) {
  using P = typename Pair<T>::type;
  if constexpr (VEC % 2 == 0) {
    const P* xp = reinterpret_cast<const P*>(x.v);
    const P* yp = reinterpret_cast<const P*>(y.v);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      const float2 p = rounded_products(to_float2(xp[j]), to_float2(yp[j]), T{});
      acc += p.x;
      acc += p.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += to_accum(from_accum<T>(to_accum(x.v[j]) * to_accum(y.v[j])));
  }
  return acc;
}

// load_vec through the read-only path explicitly: in a kernel that waits for the previous grid
// (wait_for_previous_grid), the compiler no longer infers it.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec_read_only(const T* p) {
  constexpr int kBytes = sizeof(Vec<T, VEC>);
  using Bits = std::conditional_t<kBytes == 16, uint4,
               std::conditional_t<kBytes == 8, uint2, std::conditional_t<kBytes == 4, unsigned, unsigned short>>>;
  const Bits bits = __ldg(reinterpret_cast<const Bits*>(p));
  Vec<T, VEC> v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

template <typename T, int VEC, bool kWholeBlock, bool kRoundProducts, bool kDependent, typename SrcIdx, typename DstIdx>
__device__ __forceinline__ accum_t<T> item_dot(const ForwardArgs& a, SrcIdx s, DstIdx d, int h, bool valid, int lane,
                                               int group, int vectors) {
  accum_t<T> acc = 0;
  if (valid) {
    const T* srow = static_cast<const T*>(a.src.data) + static_cast<int64_t>(s) * a.src.row_stride + h * a.src.head_stride;
    const T* drow = static_cast<const T*>(a.dst.data) + static_cast<int64_t>(d) * a.dst.row_stride + h * a.dst.head_stride;
    for (int base = lane; base < vectors; base += group * kVectorsPerLane) {
      Vec<T, VEC> sv[kVectorsPerLane], dv[kVectorsPerLane];
#pragma unroll
      for (int u = 0; u < kVectorsPerLane; ++u) {
        const int v = base + u * group;
        if (v < vectors) {
          if constexpr (kWholeBlock) {
            sv[u] = load_vec_whole_block<T, VEC>(srow + v * VEC);
            dv[u] = load_vec_whole_block<T, VEC>(drow + v * VEC);
          } else if constexpr (kDependent) {
            sv[u] = load_vec_read_only<T, VEC>(srow + v * VEC);
            dv[u] = load_vec_read_only<T, VEC>(drow + v * VEC);
          } else {
            sv[u] = load_vec<T, VEC>(srow + v * VEC);
            dv[u] = load_vec<T, VEC>(drow + v * VEC);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kVectorsPerLane; ++u) {
        if (base + u * group < vectors) {
          if constexpr (kRoundProducts) {
            acc = dot_add_rounded(acc, sv[u], dv[u]);
          } else {
            acc = dot_add(acc, sv[u], dv[u]);
          }
        }
      }
    }
  }
  return group_sum(acc, group);
}

// out[out_at] = value, or NaN (and the error flag) when an index was out of range.
template <typename T>
__device__ __forceinline__ void write_item(const ForwardArgs& a, int64_t out_at, accum_t<T> value, bool bad_src,
                                           bool bad_dst) {
  T* out = static_cast<T*>(a.out);
  if (bad_src || bad_dst) {
    out[out_at] = from_accum<T>(static_cast<accum_t<T>>(NAN));
    if (a.error_flag) a.error_flag[bad_src ? 0 : 1] = 1;
  } else {
    out[out_at] = from_accum<T>(value);
  }
}

// Whether every item reads exactly one aligned 256-byte block of each row. L2 then fetches the
// block whole on the first miss (load_vec_whole_block). On longer rows the hint would fetch blocks
// before they are needed.
template <typename T>
bool rows_are_256_byte_blocks(const ForwardArgs& a) {
  const auto block_rows = [&](const Rows& r) {
    return reinterpret_cast<uintptr_t>(r.data) % 256 == 0 && r.row_stride * sizeof(T) % 256 == 0;
  };
  return a.heads == 1 && a.dim * static_cast<int64_t>(sizeof(T)) == 256 && block_rows(a.src) && block_rows(a.dst);
}

}  // namespace

// A group of `group` lanes owns one (edge, head) item at a time (item_dot). Each warp takes tiles
// of `tile_items` consecutive items (32 on large graphs), striding over the grid: lane L loads the
// indices of the tile's item L, so a warp waits for indices once per tile rather than once per
// item; the groups then take the tile's items in turn, reading the indices from shared memory
// (shuffles would keep them in registers, which spills), and lane L writes item L's result.
// Consecutive items of a sorted graph share rows, which a warp then finds in L1. With one lane
// per item (group 1) each lane simply loads its own indices: the hand-off would only cost there.
// Edges are visited in order.order when it is used (edge_order.cu). At most 64 registers (four
// blocks per SM): the gather is latency-bound, so occupancy matters more than registers.
// The compiler puts the row loads on the read-only path (ld.global.nc) by itself; .ci/check_cuda_sources
// checks the PTX for it, since sorted graphs run much slower without it.
// kWholeBlock instantiations load rows with load_vec_whole_block instead (rows_are_256_byte_blocks);
// kRoundProducts ones (half types, launch_forward's round_products) round each product (dot_add_rounded).
// kDependent ones, for graphs that one pass of the resident warps covers (launch latency dominates
// there), are launched by launch_dependent and start with wait_for_previous_grid; that wait stops
// the compiler's read-only inference, so their row loads are read-only explicitly.
template <typename T, int VEC, typename SrcIdx, typename DstIdx, bool kOrdered, bool kWholeBlock, bool kRoundProducts,
          bool kDependent>
__global__ void __launch_bounds__(kBlockThreads, 4)
forward_kernel(ForwardArgs a, EdgeOrder order, int group, int tile_items) {
  if constexpr (kDependent) wait_for_previous_grid();
  // With an order, both variants are launched and the one matching the device's decision runs.
  if (order.used != nullptr && (*order.used != 0) != kOrdered) return;
  using A = accum_t<T>;
  const SrcIdx* __restrict__ src_idx = static_cast<const SrcIdx*>(a.src_idx);
  const DstIdx* __restrict__ dst_idx = static_cast<const DstIdx*>(a.dst_idx);
  const int vectors = static_cast<int>(a.dim / VEC);  // below 2**31 (edge_dot/edge_dot_ops.cpp)
  const int64_t items = a.num_edges * a.heads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;

  if (!std::is_same_v<T, double> && group == 1) {  // double would spill registers for this second path
    for (int64_t item = thread; item < items; item += threads) {
      const int64_t visit = a.heads == 1 ? item : item / a.heads;
      const int h = static_cast<int>(item - visit * a.heads);
      const int64_t edge = kOrdered ? order.order[visit] : visit;
      const SrcIdx s = src_idx[edge];
      const DstIdx d = dst_idx[edge];
      const bool valid = in_range(s, a.src.num_rows) && in_range(d, a.dst.num_rows);
      const A dot = item_dot<T, VEC, kWholeBlock, kRoundProducts, kDependent>(a, s, d, h, valid, 0, 1, vectors);
      write_item<T>(a, kOrdered ? edge * a.heads + h : item, dot, !in_range(s, a.src.num_rows),
                    !in_range(d, a.dst.num_rows));
    }
    return;
  }

  __shared__ SrcIdx block_src[kBlockThreads];  // each warp's tile: 32 entries per warp
  __shared__ DstIdx block_dst[kBlockThreads];
  __shared__ int block_head[kBlockThreads];
  SrcIdx* tile_src = block_src + (threadIdx.x & ~31);
  DstIdx* tile_dst = block_dst + (threadIdx.x & ~31);
  int* tile_head = block_head + (threadIdx.x & ~31);
  const int warp_lane = threadIdx.x & 31;
  const int lane = warp_lane & (group - 1);
  const int group_in_warp = warp_lane / group;
  const int groups_per_warp = 32 / group;

  for (int64_t tile = thread / 32 * tile_items; tile < items; tile += threads / 32 * tile_items) {
    const int64_t my_item = tile + warp_lane;
    const bool have_item = warp_lane < tile_items && my_item < items;
    if (have_item) {
      const int64_t visit = a.heads == 1 ? my_item : my_item / a.heads;
      const int64_t edge = kOrdered ? order.order[visit] : visit;
      tile_src[warp_lane] = src_idx[edge];
      tile_dst[warp_lane] = dst_idx[edge];
      tile_head[warp_lane] = static_cast<int>(my_item - visit * a.heads);
    }
    __syncwarp();
    A my_dot = 0;
    for (int first = 0; first < tile_items; first += groups_per_warp) {
      const int holder = first + group_in_warp;
      const SrcIdx s = tile_src[holder];
      const DstIdx d = tile_dst[holder];
      const bool valid = tile + holder < items && in_range(s, a.src.num_rows) && in_range(d, a.dst.num_rows);
      const A dot = item_dot<T, VEC, kWholeBlock, kRoundProducts, kDependent>(a, s, d, tile_head[holder], valid, lane, group, vectors);
      // Lanes first .. first + groups_per_warp - 1 take their items' sums from the groups' first lanes.
      const A sum = __shfl_sync(0xffffffffu, dot, ((warp_lane - first) * group) & 31);
      if (warp_lane >= first && warp_lane < first + groups_per_warp) my_dot = sum;
    }
    if (have_item) {
      int64_t out_at = my_item;
      if constexpr (kOrdered) {  // re-read rather than kept live through the tile
        const int h = tile_head[warp_lane];
        out_at = order.order[(my_item - h) / a.heads] * a.heads + h;
      }
      write_item<T>(a, out_at, my_dot, !in_range(tile_src[warp_lane], a.src.num_rows),
                    !in_range(tile_dst[warp_lane], a.dst.num_rows));
    }
    __syncwarp();  // the tile is read before the next one overwrites it
  }
}

template <typename Kernel>
int64_t resident_warps(Kernel kernel) {
  return static_cast<int64_t>(sm_count()) * blocks_per_sm(reinterpret_cast<const void*>(kernel)) * (kBlockThreads / 32);
}

// Tiles of 32 items, fewer where that would leave resident warps without a tile (small graphs).
// Over an order, one item per group per tile: its buckets need the items in flight close together
// (tiles of 32 spread them apart).
inline int tile_items_for(int64_t items, int group, bool ordered, int64_t resident) {
  int tile_items = ordered ? 32 / group : 32;
  while (tile_items > 32 / group && (items + tile_items - 1) / tile_items < resident) tile_items /= 2;
  return tile_items;
}

template <typename T, int VEC, typename SrcIdx, typename DstIdx, bool kOrdered, bool kWholeBlock = false,
          bool kRoundProducts = false, bool kDependent = false>
void launch(const ForwardArgs& a, const EdgeOrder& order, cudaStream_t stream) {
  const int group = group_size(a.dim / VEC);
  auto kernel = forward_kernel<T, VEC, SrcIdx, DstIdx, kOrdered, kWholeBlock, kRoundProducts, kDependent>;
  const int64_t items = a.num_edges * a.heads;
  const int tile_items = tile_items_for(items, group, kOrdered, resident_warps(kernel));
  const int blocks = grid_blocks(kernel, (items + tile_items - 1) / tile_items * 32);
  if constexpr (kDependent) {
    launch_dependent(kernel, blocks, stream, a, order, group, tile_items);
  } else {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(a, order, group, tile_items);
  }
}

// Whether one pass of the resident warps covers every item: the kernel then takes about as long
// as a launch, and launching it as a dependent launch hides part of that (the seed problem's case).
template <typename T, int VEC, typename SrcIdx, typename DstIdx>
bool one_pass(const ForwardArgs& a) {
  const int group = group_size(a.dim / VEC);
  const int64_t resident = resident_warps(forward_kernel<T, VEC, SrcIdx, DstIdx, false, false, false, true>);
  const int64_t items = a.num_edges * a.heads;
  const int tile_items = tile_items_for(items, group, false, resident);
  return (items + tile_items - 1) / tile_items <= resident;
}

template <typename T, int VEC, typename SrcIdx, typename DstIdx>
void launch_both_orders(const ForwardArgs& a, const EdgeOrder& order, bool round_products, cudaStream_t stream) {
  if constexpr (std::is_same_v<accum_t<T>, float> && !std::is_same_v<T, float>) {
    if (round_products) {  // the seed problem's entry, which never passes an order
      launch<T, VEC, SrcIdx, DstIdx, false, false, true, true>(a, order, stream);
      return;
    }
  }
  if (order.order == nullptr && one_pass<T, VEC, SrcIdx, DstIdx>(a)) {
    launch<T, VEC, SrcIdx, DstIdx, false, false, false, true>(a, order, stream);
    return;
  }
  if constexpr (sizeof(T) * VEC == 16) {
    if (rows_are_256_byte_blocks<T>(a)) {
      launch<T, VEC, SrcIdx, DstIdx, false, true>(a, order, stream);
    } else {
      launch<T, VEC, SrcIdx, DstIdx, false>(a, order, stream);
    }
  } else {
    launch<T, VEC, SrcIdx, DstIdx, false>(a, order, stream);
  }
  // Orders are only made for rows of more than 640 bytes (edge_dot/edge_dot_ops.cpp): plain loads there.
  if (order.order != nullptr) launch<T, VEC, SrcIdx, DstIdx, true>(a, order, stream);
}

void launch_forward(const ForwardArgs& a, const EdgeOrder& order, ScalarKind scalar, IndexKind src_index,
                    IndexKind dst_index, cudaStream_t stream, bool round_products) {
  dispatch_scalar(scalar, [&](auto t) {
    using T = decltype(t);
    dispatch_index(src_index, [&](auto si) {
      dispatch_index(dst_index, [&](auto di) {
        using SrcIdx = decltype(si);
        using DstIdx = decltype(di);
        if (rows_vectorizable<T>(a.src, a.dim) && rows_vectorizable<T>(a.dst, a.dim)) {
          launch_both_orders<T, wide_vec<T>(), SrcIdx, DstIdx>(a, order, round_products, stream);
        } else {
          launch_both_orders<T, 1, SrcIdx, DstIdx>(a, order, round_products, stream);
        }
      });
    });
  });
}

}  // namespace edgedot
