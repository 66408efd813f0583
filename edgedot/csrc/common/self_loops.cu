// PyG's remove_self_loops then add_self_loops of a [2, E] edge index, as the fused kernels take the
// graph, in one launch: every edge keeps its place, a self-loop's destination becomes `dropped` (a
// row the kernels leave out, so it adds to no output or gradient), and the loops of nodes
// 0 .. num_nodes - 1 follow. The GAT layers do this on every CUDA call (nn/gat_conv.py); as tensor
// operations it took five launches and their host work a training step. The input's range check
// may ride along (the layer's check of edge_index, which would read every index again).
#include "common/common.cuh"

namespace edgedot {
namespace {

template <typename Idx>
__global__ void __launch_bounds__(kBlockThreads)
self_looped_kernel(const Idx* __restrict__ src, int64_t src_stride, const Idx* __restrict__ dst, int64_t dst_stride,
                   int64_t num_edges, int64_t num_nodes, Idx dropped, Idx* __restrict__ out_src,
                   Idx* __restrict__ out_dst, RangeFlags range_flags, int64_t num_src, int64_t num_dst) {
  const int64_t total = num_edges + num_nodes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    if (i < num_edges) {
      const Idx s = src[i * src_stride], d = dst[i * dst_stride];
      out_src[i] = s;
      out_dst[i] = s == d ? dropped : d;
      if (range_flags.other_out != nullptr && !in_range(s, num_src)) *range_flags.other_out = 1;
      if (range_flags.row_out != nullptr && !in_range(d, num_dst)) *range_flags.row_out = 1;
    } else {
      const Idx node = static_cast<Idx>(i - num_edges);
      out_src[i] = node;
      out_dst[i] = node;
    }
  }
}

}  // namespace

void launch_self_looped(const SelfLoopArgs& args, IndexKind index, cudaStream_t stream) {
  const int64_t total = args.num_edges + args.num_nodes;
  if (total == 0) return;
  dispatch_index(index, [&](auto zero) {
    using Idx = decltype(zero);
    auto kernel = self_looped_kernel<Idx>;
    kernel<<<grid_blocks(kernel, total), kBlockThreads, 0, stream>>>(
        static_cast<const Idx*>(args.src), args.src_stride, static_cast<const Idx*>(args.dst), args.dst_stride,
        args.num_edges, args.num_nodes, static_cast<Idx>(args.dropped), static_cast<Idx*>(args.out_src),
        static_cast<Idx*>(args.out_dst), args.range_flags, args.num_src, args.num_dst);
  });
}

}  // namespace edgedot
