// The checks of a graph's index tensors on the device: check_graph (edgedot/runtime/checks.py:check_graph
// in one kernel and one wait), and the memo of index tensors a checked forward found in range.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/in_range_memo.h"
#include "common/torch_common.h"

namespace edgedot {
namespace {

// Host ints the graph check's flags are copied into (pinned, so the copy is a plain DMA), one set
// per thread.
int* host_graph_flags() {
  thread_local int* flags = nullptr;
  if (flags == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags), kGraphCheckFlags * sizeof(int),
                                 cudaHostAllocPortable));
  }
  return flags;
}

IndexKind kind_of(const at::Tensor& idx) { return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64; }

}  // namespace

// Every condition of edgedot/runtime/checks.py:check_graph on the device in one kernel, then one copy of
// the flags to the host and one wait for the stream: bit k of the result is set when condition k
// of GraphCheckFlag fails (the pointer's bits only with dst_ptr, the ranges' only when asked).
int64_t check_graph(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                    const c10::optional<at::Tensor>& dst_ptr, bool check_src, bool check_dst) {
  TORCH_CHECK_VALUE(is_index(src_idx) && is_index(dst_idx) && src_idx.size(0) == dst_idx.size(0) && src_idx.is_cuda() &&
                        dst_idx.device() == src_idx.device(),
                    "edgedot: check_graph needs src_idx and dst_idx 1-D int32 or int64 of one length on one CUDA "
                    "device");
  TORCH_CHECK_VALUE(num_src >= 0 && num_dst >= 0, "edgedot: check_graph needs non-negative node counts");
  if (dst_ptr.has_value()) {
    TORCH_CHECK_VALUE(is_index(*dst_ptr) && dst_ptr->size(0) == num_dst + 1 && dst_ptr->device() == src_idx.device(),
                      "edgedot: check_graph needs dst_ptr 1-D int32 or int64 of num_dst + 1 elements on the indices' "
                      "device");
  }
  const c10::cuda::CUDAGuard guard(src_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(!stream_capturing(stream), "edgedot: check_graph waits for the device, which CUDA graph capture forbids");
  at::Tensor flags = at::empty({kGraphCheckFlags}, src_idx.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(flags.data_ptr<int>(), 0, kGraphCheckFlags * sizeof(int), stream));
  const bool has_ptr = dst_ptr.has_value();
  GraphCheckArgs args{src_idx.data_ptr(),
                      dst_idx.data_ptr(),
                      has_ptr ? dst_ptr->data_ptr() : nullptr,
                      src_idx.stride(0),
                      dst_idx.stride(0),
                      has_ptr ? dst_ptr->stride(0) : 1,
                      src_idx.size(0),
                      num_src,
                      num_dst,
                      check_src,
                      check_dst,
                      flags.data_ptr<int>()};
  launch_check_graph(args, kind_of(src_idx), kind_of(dst_idx), has_ptr ? kind_of(*dst_ptr) : IndexKind::i64, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  int* host = host_graph_flags();
  C10_CUDA_CHECK(cudaMemcpyAsync(host, flags.data_ptr<int>(), kGraphCheckFlags * sizeof(int), cudaMemcpyDeviceToHost,
                                 stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t mask = 0;
  for (int k = 0; k < kGraphCheckFlags; ++k) {
    if (host[k] != 0) mask |= int64_t{1} << k;
  }
  return mask;
}

InRangeMemo& in_range_memo() {
  static InRangeMemo memo;
  return memo;
}

}  // namespace edgedot
