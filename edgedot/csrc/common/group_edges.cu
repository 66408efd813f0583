// The groupings of edgedot.runtime.plan.build_side and group_offsets from the keys and positions of
// launch_sort_by_row, for one side or both, in one kernel: order, row_other and the row offsets,
// bit for bit as the tensor operations build them.
#include "common/common.cuh"

namespace edgedot {
namespace {

// The first of keys[0..num_keys) (non-decreasing) that is >= key: torch.searchsorted's left side.
// A binary search per row rather than a scan of the run boundaries, which would leave a whole gap
// of rows without edges (say the last hop's nodes of a sampled subgraph) to one thread.
__device__ __forceinline__ int32_t first_at_least(const int32_t* __restrict__ keys, int32_t num_keys, int64_t key) {
  int32_t lo = 0, hi = num_keys;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// One side's outputs, its other ends typed.
template <typename OtherIdx>
struct TypedSide {
  const OtherIdx* __restrict__ other_idx;
  int64_t num_rows, num_other;
  int64_t* __restrict__ order;
  uint64_t* __restrict__ row_other;
  int64_t* __restrict__ offsets;
};

template <typename OtherIdx>
TypedSide<OtherIdx> typed(const GroupSide& s) {
  return {static_cast<const OtherIdx*>(s.other_idx), s.num_rows, s.num_other, s.order, s.row_other, s.offsets};
}

// Entry i of a side's sorted keys (its rows offset by key_base) and positions.
template <typename OtherIdx>
__device__ __forceinline__ void group_entry(const TypedSide<OtherIdx>& side, int32_t key, int32_t e, int64_t i,
                                            int32_t key_base) {
  const OtherIdx o = side.other_idx[e];
  const int32_t other = in_range(o, side.num_other) ? static_cast<int32_t>(o) : -1;
  side.order[i] = e;
  // Rows lie in [0, num_rows]: out-of-range rows were sorted as num_rows.
  side.row_other[i] = static_cast<uint64_t>(static_cast<uint32_t>(key - key_base)) << 32 | static_cast<uint32_t>(other);
}

// sides is 1 or 2: entries [0, num_edges) are the first side's, [num_edges, 2 num_edges) the second's,
// whose keys start at first.num_rows + 1.
template <typename FirstOther, typename SecondOther>
__global__ void __launch_bounds__(kBlockThreads)
group_edges_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ positions, int32_t num_edges,
                   int sides, TypedSide<FirstOther> first, TypedSide<SecondOther> second) {
  // 64-bit counters: num_rows + 1 reaches 2**31.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int32_t second_base = static_cast<int32_t>(first.num_rows + 1);
  const int64_t num_keys = static_cast<int64_t>(sides) * num_edges;
  for (int64_t i = start; i < num_keys; i += stride) {
    if (i < num_edges) {
      group_entry(first, keys[i], positions[i], i, 0);
    } else {
      group_entry(second, keys[i], positions[i], i - num_edges, second_base);
    }
  }
  const int64_t first_offsets = first.num_rows + 1;
  const int64_t num_offsets = first_offsets + (sides == 2 ? second.num_rows + 1 : 0);
  for (int64_t r = start; r < num_offsets; r += stride) {
    if (r < first_offsets) {
      first.offsets[r] = first_at_least(keys, num_edges, r);
    } else {
      second.offsets[r - first_offsets] = first_at_least(keys + num_edges, num_edges, r);
    }
  }
}

}  // namespace

void launch_group_edges(const int32_t* keys, const int32_t* positions, int64_t num_edges, const GroupSide& first,
                        const GroupSide* second, cudaStream_t stream) {
  const int sides = second == nullptr ? 1 : 2;
  const GroupSide& other_side = second == nullptr ? first : *second;
  dispatch_index(first.other_index, [&](auto fo) {
    dispatch_index(other_side.other_index, [&](auto so) {
      using FirstOther = decltype(fo);
      using SecondOther = decltype(so);
      auto kernel = group_edges_kernel<FirstOther, SecondOther>;
      const int64_t offsets = first.num_rows + 1 + (sides == 2 ? other_side.num_rows + 1 : 0);
      const int64_t entries = sides * num_edges;
      const int64_t threads = entries > offsets ? entries : offsets;
      kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(
          keys, positions, static_cast<int32_t>(num_edges), sides, typed<FirstOther>(first),
          typed<SecondOther>(other_side));
    });
  });
}

}  // namespace edgedot
