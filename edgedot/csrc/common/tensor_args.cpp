// Tensor arguments turned into the kernels' plain types, host flags, streams and the argument
// predicates, shared by the op families (declared in common/torch_common.h, with the one-liners).
#include <c10/cuda/CUDAException.h>

#include "common/torch_common.h"

namespace edgedot {

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::f32;
    case at::kDouble: return ScalarKind::f64;
    case at::kHalf: return ScalarKind::f16;
    case at::kBFloat16: return ScalarKind::bf16;
    default: TORCH_CHECK_TYPE(false, message("edgedot: unsupported feature dtype ", t));
  }
}

IndexKind index_kind(const at::Tensor& idx, const char* name) {
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong,
                   message(name, " must be int32 or int64, got ", idx.scalar_type()));
  return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
}

// Two host ints the kernel can write (mapped, pinned), one pair per thread: each checked call
// zeroes them, launches, and reads them after synchronising, so calls never share a pair.
int* host_error_flags() {
  thread_local int* flags = nullptr;
  if (flags == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags), 2 * sizeof(int),
                                 cudaHostAllocMapped | cudaHostAllocPortable));
  }
  return flags;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The argument rules of edgedot/runtime/checks.py:check_inputs, as a predicate: the eager path asks
// here first (cheaper than Python), and Python's check_inputs words the error when it fails.
bool valid_inputs(const at::Tensor& src_feat, const at::Tensor& dst_feat, const at::Tensor& src_idx,
                  const at::Tensor& dst_idx) {
  const auto device = src_feat.device();
  const int64_t src_heads = heads_of(src_feat), dst_heads = heads_of(dst_feat);
  return (src_feat.dim() == 2 || src_feat.dim() == 3) && (dst_feat.dim() == 2 || dst_feat.dim() == 3) &&
         is_feature_dtype(src_feat.scalar_type()) && src_feat.scalar_type() == dst_feat.scalar_type() &&
         src_feat.size(-1) == dst_feat.size(-1) &&
         (src_heads == dst_heads || src_heads == 1 || dst_heads == 1) && is_index(src_idx) && is_index(dst_idx) &&
         src_idx.size(0) == dst_idx.size(0) && dst_feat.device() == device && src_idx.device() == device &&
         dst_idx.device() == device;
}

}  // namespace edgedot
