// The validation of a graph's index tensors (edgedot/runtime/checks.py:check_graph) in one pass: every
// condition lands in its own device flag, which the binding reads back with a single wait.
#include "common/common.cuh"

namespace edgedot {
namespace {

template <typename Src, typename Dst, typename Ptr>
__global__ void __launch_bounds__(kBlockThreads) check_graph_kernel(GraphCheckArgs a) {
  const Src* __restrict__ src = static_cast<const Src*>(a.src_idx);
  const Dst* __restrict__ dst = static_cast<const Dst*>(a.dst_idx);
  const Ptr* __restrict__ ptr = static_cast<const Ptr*>(a.dst_ptr);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n = a.num_edges > a.num_dst ? a.num_edges : a.num_dst;
  bool src_out = false, dst_out = false, decreases = false, disagrees = false;
  for (int64_t i = first; i < n; i += stride) {
    if (i < a.num_edges) {
      if (a.check_src && !in_range(src[i * a.src_stride], a.num_src)) src_out = true;
      const int64_t d = static_cast<int64_t>(dst[i * a.dst_stride]);
      const bool d_in = in_range(d, a.num_dst);
      if (a.check_dst && !d_in) dst_out = true;
      // Edge i must lie in its destination's range [ptr[d], ptr[d + 1]); with a pointer that
      // starts at 0, ends at E and never decreases, these ranges tile [0, E) without overlap.
      if (ptr != nullptr && (!d_in || i < static_cast<int64_t>(ptr[d * a.ptr_stride]) ||
                             i >= static_cast<int64_t>(ptr[(d + 1) * a.ptr_stride]))) {
        disagrees = true;
      }
    }
    if (ptr != nullptr && i < a.num_dst && ptr[(i + 1) * a.ptr_stride] < ptr[i * a.ptr_stride]) decreases = true;
  }
  const bool ends_wrong = ptr != nullptr && first == 0 &&
                          (ptr[0] != 0 || static_cast<int64_t>(ptr[a.num_dst * a.ptr_stride]) != a.num_edges);
  // One store per block and failed condition; every store writes 1, so their order is irrelevant.
  const int any_src_out = __syncthreads_or(src_out);
  const int any_dst_out = __syncthreads_or(dst_out);
  const int any_ends_wrong = __syncthreads_or(ends_wrong);
  const int any_decreases = __syncthreads_or(decreases);
  const int any_disagrees = __syncthreads_or(disagrees);
  if (threadIdx.x == 0) {
    if (any_src_out) a.flags[kSrcOutOfRange] = 1;
    if (any_dst_out) a.flags[kDstOutOfRange] = 1;
    if (any_ends_wrong) a.flags[kPtrEndsWrong] = 1;
    if (any_decreases) a.flags[kPtrDecreases] = 1;
    if (any_disagrees) a.flags[kPtrDisagrees] = 1;
  }
}

}  // namespace

void launch_check_graph(const GraphCheckArgs& args, IndexKind src_index, IndexKind dst_index, IndexKind ptr_index,
                        cudaStream_t stream) {
  const int64_t threads = args.num_edges > args.num_dst ? args.num_edges : args.num_dst;
  dispatch_index(src_index, [&](auto si) {
    dispatch_index(dst_index, [&](auto di) {
      dispatch_index(ptr_index, [&](auto pi) {
        auto kernel = check_graph_kernel<decltype(si), decltype(di), decltype(pi)>;
        kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(args);
      });
    });
  });
}

}  // namespace edgedot
