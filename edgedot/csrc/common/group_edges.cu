// The groupings of edgedot.runtime.plan.build_side and group_offsets from the keys and positions of
// launch_sort_by_row, for one side or both, in one kernel: order, row_other and the row offsets,
// bit for bit as the tensor operations build them.
#include "common/grouping.cuh"

namespace edgedot {
namespace {

template <typename FirstOther, typename SecondOther>
__global__ void __launch_bounds__(kBlockThreads)
group_edges_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ positions, int32_t num_edges,
                   int sides, TypedSide<FirstOther> first, TypedSide<SecondOther> second, RangeFlags range_flags) {
  write_groupings(keys, positions, num_edges, sides, first, second, range_flags,
                  static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace

void launch_group_edges(const int32_t* keys, const int32_t* positions, int64_t num_edges, const GroupSide& first,
                        const GroupSide* second, RangeFlags range_flags, cudaStream_t stream) {
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
          typed<SecondOther>(other_side), range_flags);
    });
  });
}

}  // namespace edgedot
