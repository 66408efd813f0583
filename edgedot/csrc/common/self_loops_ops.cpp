// The GAT layers' self-loop handling on CUDA (common/self_loops.cu), for nn/gat_conv.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "common/torch_common.h"

namespace edgedot {

// edge_index [2, E] (row 0 the sources), int32 or int64, any strides: (src, dst), each
// [E + num_nodes] contiguous in its dtype, edge e's destination `dropped` where it is a self-loop;
// range_flags as SelfLoopArgs takes them, against num_src and num_dst.
std::tuple<at::Tensor, at::Tensor> self_looped(const at::Tensor& edge_index, int64_t num_nodes, int64_t dropped,
                                               RangeFlags range_flags, int64_t num_src, int64_t num_dst) {
  const bool int32 = edge_index.scalar_type() == at::kInt;
  TORCH_CHECK_VALUE(edge_index.is_cuda() && edge_index.dim() == 2 && edge_index.size(0) == 2 &&
                        (int32 || edge_index.scalar_type() == at::kLong),
                    "edgedot: self_looped needs edge_index a [2, E] int32 or int64 CUDA tensor");
  const int64_t largest = int32 ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
  TORCH_CHECK_VALUE(num_nodes >= 0 && dropped >= 0 && num_nodes <= largest && dropped <= largest,
                    "edgedot: self_looped's num_nodes and dropped must be non-negative and fit edge_index's dtype");
  const c10::cuda::CUDAGuard guard(edge_index.device());
  const int64_t num_edges = edge_index.size(1);
  at::Tensor src = at::empty({num_edges + num_nodes}, edge_index.options());
  at::Tensor dst = at::empty({num_edges + num_nodes}, edge_index.options());
  const at::Tensor rows_src = edge_index.select(0, 0), rows_dst = edge_index.select(0, 1);
  const SelfLoopArgs args{rows_src.data_ptr(), rows_dst.data_ptr(), rows_src.stride(0), rows_dst.stride(0),
                          num_edges, num_nodes, dropped, src.data_ptr(), dst.data_ptr(),
                          range_flags, num_src, num_dst};
  launch_self_looped(args, int32 ? IndexKind::i32 : IndexKind::i64, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {src, dst};
}

}  // namespace edgedot
