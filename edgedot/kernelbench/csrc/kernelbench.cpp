// The seed problem's entry point, with KernelBench's contract: whatever the reference
// `(src_feat[src_idx.long()] * dst_feat[dst_idx.long()]).sum(-1)` accepts for [N, D] CUDA features,
// it accepts, and it returns what the reference returns. KernelBench's evaluator casts every input,
// the index tensors included, to the precision of the run, so indices may arrive as float32,
// float16 or bfloat16: they are truncated like .long() in one launch (index_cast.cu). In half
// types each product is rounded before the sum, as the reference does. The indices are trusted,
// as in the seed problem: nothing checks them on the host and the call never waits for the GPU;
// the kernel still reads nothing outside the features, and an edge with an out-of-range index
// (negative ones included, which the reference would wrap) gets NaN.
//
// `python -m edgedot.kernelbench --export` inlines this file, after the kernels it calls, into one
// self-contained problem file; the extension exposes it as kernelbench_forward.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

#include "common/edgedot.h"

namespace edgedot {

namespace {

c10::optional<ScalarKind> scalar_kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::f32;
    case at::kDouble: return ScalarKind::f64;
    case at::kHalf: return ScalarKind::f16;
    case at::kBFloat16: return ScalarKind::bf16;
    default: return c10::nullopt;
  }
}

bool is_integer_index(const torch::Tensor& idx) {
  return idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong;
}

IndexKind integer_index_kind(const torch::Tensor& idx) {
  return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
}

}  // namespace

torch::Tensor kernelbench_forward(torch::Tensor src_feat, torch::Tensor dst_feat, torch::Tensor src_idx,
                                  torch::Tensor dst_idx) {
  TORCH_CHECK(src_feat.is_cuda(), "kernelbench_forward: the inputs must be CUDA tensors");
  TORCH_CHECK(dst_feat.device() == src_feat.device() && src_idx.device() == src_feat.device() &&
                  dst_idx.device() == src_feat.device(),
              "kernelbench_forward: all inputs must be on one device");
  TORCH_CHECK(src_feat.dim() == 2 && dst_feat.dim() == 2 && src_feat.size(1) == dst_feat.size(1),
              "kernelbench_forward: features must be [Ns, D] and [Nd, D]");
  const auto feature_kind = scalar_kind_of(src_feat.scalar_type());
  TORCH_CHECK_TYPE(feature_kind.has_value(),
                   "kernelbench_forward: features must be float32, float64, float16 or bfloat16");
  TORCH_CHECK_TYPE(dst_feat.scalar_type() == src_feat.scalar_type(),
                   "kernelbench_forward: src_feat and dst_feat must have the same dtype");
  TORCH_CHECK(src_idx.dim() == 1 && dst_idx.dim() == 1 && src_idx.size(0) == dst_idx.size(0),
              "kernelbench_forward: src_idx and dst_idx must be 1-D of the same length");
  const auto src_float_kind = scalar_kind_of(src_idx.scalar_type());
  const auto dst_float_kind = scalar_kind_of(dst_idx.scalar_type());
  // Messages of strings only: a streamed dtype crashed a failing check of this extension's
  // sibling on the H200 machine (NOTES.md, 2026-12-01).
  TORCH_CHECK_TYPE(src_float_kind || is_integer_index(src_idx),
                   "kernelbench_forward: src_idx must be int32, int64 or a float type");
  TORCH_CHECK_TYPE(dst_float_kind || is_integer_index(dst_idx),
                   "kernelbench_forward: dst_idx must be int32, int64 or a float type");
  const c10::cuda::CUDAGuard guard(src_feat.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  src_feat = src_feat.stride(1) == 1 ? src_feat : src_feat.contiguous();
  dst_feat = dst_feat.stride(1) == 1 ? dst_feat : dst_feat.contiguous();
  src_idx = src_idx.contiguous();
  dst_idx = dst_idx.contiguous();
  const int64_t num_edges = src_idx.size(0);
  torch::Tensor out = at::empty({num_edges}, src_feat.options());
  if (num_edges == 0) return out;

  // Floating-point indices become int32 in one launch (two when the sides differ in dtype).
  torch::Tensor cast;
  const void* src_rows = src_idx.data_ptr();
  const void* dst_rows = dst_idx.data_ptr();
  IndexKind src_kind = src_float_kind ? IndexKind::i32 : integer_index_kind(src_idx);
  IndexKind dst_kind = dst_float_kind ? IndexKind::i32 : integer_index_kind(dst_idx);
  if (src_float_kind || dst_float_kind) {
    cast = at::empty({2 * num_edges}, src_idx.options().dtype(at::kInt));
    int32_t* cast_rows = cast.data_ptr<int32_t>();
    if (src_float_kind && dst_float_kind && *src_float_kind == *dst_float_kind) {
      launch_cast_indices(src_rows, dst_rows, *src_float_kind, num_edges, cast_rows, stream);
    } else {
      if (src_float_kind) launch_cast_indices(src_rows, nullptr, *src_float_kind, num_edges, cast_rows, stream);
      if (dst_float_kind) launch_cast_indices(nullptr, dst_rows, *dst_float_kind, num_edges, cast_rows, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (src_float_kind) src_rows = cast_rows;
    if (dst_float_kind) dst_rows = cast_rows + num_edges;
  }

  const ForwardArgs args{Rows{src_feat.data_ptr(), src_feat.size(0), src_feat.stride(0), /*head_stride=*/0},
                   Rows{dst_feat.data_ptr(), dst_feat.size(0), dst_feat.stride(0), /*head_stride=*/0},
                   src_rows,
                   dst_rows,
                   out.data_ptr(),
                   num_edges,
                   /*heads=*/1,
                   src_feat.size(1),
                   /*error_flag=*/nullptr};
  const bool round_products = *feature_kind == ScalarKind::f16 || *feature_kind == ScalarKind::bf16;
  launch_forward(args, EdgeOrder{nullptr, nullptr}, *feature_kind, src_kind, dst_kind, stream, round_products);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace edgedot
