// The checks of a graph's index tensors on the device: graph_flags (the conditions of
// edgedot/runtime/checks.py:check_graph in one kernel, read back by the caller when it likes), the
// deferred check with its memos (graph_check_launch), and the memo of index tensors edge_dot's
// checked forward found in range.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstring>

#include "common/tensor_memo.h"
#include "common/torch_common.h"

namespace edgedot {
namespace {

IndexKind kind_of(const at::Tensor& idx) { return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64; }

// The arguments of graph_flags checked, and its kernel launched on the current stream, writing into
// `flags` (device-visible, zeroed): the conditions of edgedot/runtime/checks.py:check_graph.
void launch_graph_check(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                        const c10::optional<at::Tensor>& dst_ptr, bool check_src, bool check_dst, int* flags) {
  TORCH_CHECK_VALUE(is_index(src_idx) && is_index(dst_idx) && src_idx.size(0) == dst_idx.size(0) && src_idx.is_cuda() &&
                        dst_idx.device() == src_idx.device(),
                    "edgedot: graph_flags needs src_idx and dst_idx 1-D int32 or int64 of one length on one CUDA "
                    "device");
  TORCH_CHECK_VALUE(num_src >= 0 && num_dst >= 0, "edgedot: graph_flags needs non-negative node counts");
  if (dst_ptr.has_value()) {
    TORCH_CHECK_VALUE(is_index(*dst_ptr) && dst_ptr->size(0) == num_dst + 1 && dst_ptr->device() == src_idx.device(),
                      "edgedot: graph_flags needs dst_ptr 1-D int32 or int64 of num_dst + 1 elements on the indices' "
                      "device");
  }
  const c10::cuda::CUDAGuard guard(src_idx.device());
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
                      flags};
  launch_check_graph(args, kind_of(src_idx), kind_of(dst_idx), has_ptr ? kind_of(*dst_ptr) : IndexKind::i64,
                     c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// Every condition of edgedot/runtime/checks.py:check_graph on the device in one kernel, without a wait:
// int32 [kGraphCheckFlags] on the indices' device, entry k nonzero when condition k of GraphCheckFlag
// fails (the pointer's entries only with dst_ptr, the ranges' only when asked). The caller copies
// it to the host when it is ready to (no host wait here, so a call may queue more work first).
at::Tensor graph_flags(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                       const c10::optional<at::Tensor>& dst_ptr, bool check_src, bool check_dst) {
  at::Tensor flags = at::zeros({kGraphCheckFlags}, src_idx.options().dtype(at::kInt));
  launch_graph_check(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst, flags.data_ptr<int>());
  return flags;
}

namespace {

// What the deferred check (graph_check_launch) has found, or is finding, right: indices in range,
// and pointers agreeing with their dst_idx, each pair sharing a token. Apart from edge_dot's
// memo, whose check waits for its verdict, so that a verdict still pending never spares it.
InRangeMemo& checked_ranges() {
  static InRangeMemo memo;
  return memo;
}
TensorMemo<uint64_t>& checked_pointers() {
  static TensorMemo<uint64_t> memo;
  return memo;
}
TensorMemo<uint64_t>& checked_pointer_targets() {
  static TensorMemo<uint64_t> memo;
  return memo;
}

bool pointer_agrees(const at::Tensor& dst_ptr, const at::Tensor& dst_idx) {
  const std::optional<uint64_t> token = checked_pointers().get(dst_ptr);
  return token.has_value() && checked_pointer_targets().get(dst_idx) == token;
}

}  // namespace

namespace {

// The parts of a graph (kGraphCheck* bits) that no deferred check has found, or is finding, right.
int64_t unchecked_parts(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                        const c10::optional<at::Tensor>& dst_ptr) {
  return (checked_ranges().covers(src_idx, num_src) ? 0 : kGraphCheckSrc) |
         (checked_ranges().covers(dst_idx, num_dst) ? 0 : kGraphCheckDst) |
         (dst_ptr.has_value() && !pointer_agrees(*dst_ptr, dst_idx) ? kGraphCheckPtr : 0);
}

// The device's view of a deferred check's flags, host_flags (pinned int32 [kGraphCheckFlags] CPU
// memory, whose previous check has completed: the caller waited for its event), zeroed.
int* zeroed_device_flags(const at::Tensor& host_flags, const char* caller) {
  TORCH_CHECK_VALUE(host_flags.device().is_cpu() && host_flags.scalar_type() == at::kInt &&
                        host_flags.numel() == kGraphCheckFlags && host_flags.is_contiguous(),
                    message("edgedot: ", caller, " needs host_flags a contiguous pinned int32 CPU tensor of ",
                            static_cast<int>(kGraphCheckFlags), " elements"));
  void* device_view = nullptr;
  const cudaError_t mapped = cudaHostGetDevicePointer(&device_view, host_flags.data_ptr(), 0);
  if (mapped != cudaSuccess) {
    (void)cudaGetLastError();  // not a launch's error: clear it for the checks that follow
    TORCH_CHECK_VALUE(false, message("edgedot: ", caller, " needs host_flags in pinned memory the device can write: ",
                                     cudaGetErrorString(mapped)));
  }
  std::memset(host_flags.data_ptr(), 0, kGraphCheckFlags * sizeof(int));
  return static_cast<int*>(device_view);
}

// Where a kernel that reads both ends of a graph writes its range check of the `parts` no earlier check
// covers (kGraphCheck* bits): host_flags' device view, zeroed (nothing when parts is 0). row_out is the
// destinations' flag, other_out the sources'.
RangeFlags range_flags_of(int64_t parts, const at::Tensor& host_flags, const char* caller) {
  RangeFlags range_flags;
  if (parts != 0) {
    int* flags = zeroed_device_flags(host_flags, caller);
    if (parts & kGraphCheckDst) range_flags.row_out = flags + kDstOutOfRange;
    if (parts & kGraphCheckSrc) range_flags.other_out = flags + kSrcOutOfRange;
  }
  return range_flags;
}

// Remembers the parts of a graph just launched, as if found right (see graph_check_launch).
void remember_parts(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                    const c10::optional<at::Tensor>& dst_ptr, int64_t parts) {
  if (parts & kGraphCheckSrc) checked_ranges().put(src_idx, num_src);
  if (parts & kGraphCheckDst) checked_ranges().put(dst_idx, num_dst);
  if (parts & kGraphCheckPtr) {
    static std::atomic<uint64_t> next_token{0};
    const uint64_t token = ++next_token;
    checked_pointers().put(*dst_ptr, token);
    checked_pointer_targets().put(dst_idx, token);
  }
}

}  // namespace

// The deferred check of edgedot/runtime/checks.py:check_graph: the parts of the graph no earlier
// check covers (src_idx's range, dst_idx's, dst_ptr against dst_idx) checked by one kernel that
// writes graph_flags straight into host_flags, pinned int32 [kGraphCheckFlags] CPU memory (zeroed
// here; the caller reads it once an event recorded after this call has completed): no device
// buffer to zero and no copy back. The parts checked are remembered at once, as if found right (a
// call passing the graph again before the verdict is read needs no check of its own); the caller
// forgets them (graph_check_forget) if the verdict is bad. Returns the parts launched as
// kGraphCheck* bits, 0 when every part was remembered and nothing was launched.
int64_t graph_check_launch(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                           const c10::optional<at::Tensor>& dst_ptr, const at::Tensor& host_flags) {
  const int64_t parts = unchecked_parts(src_idx, num_src, dst_idx, num_dst, dst_ptr);
  if (parts == 0) return 0;
  int* flags = zeroed_device_flags(host_flags, "graph_check_launch");
  launch_graph_check(src_idx, num_src, dst_idx, num_dst, (parts & kGraphCheckPtr) ? dst_ptr : c10::nullopt,
                     (parts & kGraphCheckSrc) != 0, (parts & kGraphCheckDst) != 0, flags);
  remember_parts(src_idx, num_src, dst_idx, num_dst, dst_ptr, parts);
  return parts;
}

// group_edges(dst_idx, src_idx, num_dst, num_src) (group_edges_both with both) with graph_check_launch's
// deferred check of the two ranges folded in: the grouping kernel, which reads every index of both
// ends anyway, writes the flags of the parts no earlier check covers into host_flags. Returns the
// groupings and the parts checked (0: the graph was remembered, host_flags untouched).
std::tuple<std::vector<at::Tensor>, int64_t> group_edges_checked(const at::Tensor& dst_idx, const at::Tensor& src_idx,
                                                                 int64_t num_dst, int64_t num_src, bool both,
                                                                 const at::Tensor& host_flags) {
  const int64_t parts = unchecked_parts(src_idx, num_src, dst_idx, num_dst, c10::nullopt);
  const RangeFlags range_flags = range_flags_of(parts, host_flags, "group_edges_checked");
  std::vector<at::Tensor> groups = group_sides(dst_idx, src_idx, num_dst, num_src, both, range_flags);
  remember_parts(src_idx, num_src, dst_idx, num_dst, c10::nullopt, parts);
  return {std::move(groups), parts};
}

// self_looped(edge_index, num_nodes, dropped) (sources in row 0) with graph_check_launch's deferred
// check of the rows' ranges (edge_index[0] against num_src, edge_index[1] against num_dst) folded
// into its kernel, which reads every index anyway. Returns (src, dst, the parts checked), the parts
// remembered as graph_check_launch's of the two rows.
std::tuple<at::Tensor, at::Tensor, int64_t> self_looped_checked(const at::Tensor& edge_index, int64_t num_nodes,
                                                                int64_t dropped, int64_t num_src, int64_t num_dst,
                                                                const at::Tensor& host_flags) {
  TORCH_CHECK_VALUE(edge_index.dim() == 2 && edge_index.size(0) == 2,
                    "edgedot: self_looped_checked needs edge_index a [2, E] tensor");
  TORCH_CHECK_VALUE(num_src >= 0 && num_dst >= 0, "edgedot: self_looped_checked needs non-negative node counts");
  const at::Tensor rows_src = edge_index.select(0, 0), rows_dst = edge_index.select(0, 1);
  const int64_t parts = unchecked_parts(rows_src, num_src, rows_dst, num_dst, c10::nullopt);
  const RangeFlags range_flags = range_flags_of(parts, host_flags, "self_looped_checked");
  auto [src, dst] = self_looped(edge_index, num_nodes, dropped, range_flags, num_src, num_dst);
  remember_parts(rows_src, num_src, rows_dst, num_dst, c10::nullopt, parts);
  return {src, dst, parts};
}

// Forgets what graph_check_launch remembered for the parts `launched` of a graph found bad.
void graph_check_forget(const at::Tensor& src_idx, const at::Tensor& dst_idx, const c10::optional<at::Tensor>& dst_ptr,
                        int64_t launched) {
  if (launched & kGraphCheckSrc) checked_ranges().forget(src_idx);
  if (launched & kGraphCheckDst) checked_ranges().forget(dst_idx);
  if ((launched & kGraphCheckPtr) && dst_ptr.has_value()) {
    checked_pointers().forget(*dst_ptr);
    checked_pointer_targets().forget(dst_idx);
  }
}

InRangeMemo& in_range_memo() {
  static InRangeMemo memo;
  return memo;
}

}  // namespace edgedot
