// Edge dot products on the torch side: tensor checks, layouts, allocation, streams, index errors
// (edge_dot_forward.cu, edge_dot_backward_atomic.cu, edge_dot_backward_sorted.cu, and the visit
// order of common/edge_order.cu). Shapes and dtypes were validated in Python (edgedot/runtime/checks.py)
// before these are called.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>

#include "common/tensor_memo.h"
#include "common/torch_common.h"
#include "edge_dot/edge_dot_ops.h"

namespace edgedot {
namespace {

// Launches launch_edge_order: returns [num_edges] positions followed by its workspace, whose first
// int is the used flag.
at::Tensor edge_order_buffer(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows, int shift,
                             cudaStream_t stream) {
  const int64_t num_edges = row_idx.size(0);
  const int buckets = static_cast<int>(((num_rows - 1) >> shift) + 1);
  at::Tensor buffer = at::empty({num_edges + edge_order_workspace_ints(buckets)}, row_idx.options().dtype(at::kInt));
  int32_t* order = buffer.data_ptr<int32_t>();
  launch_edge_order(row_idx.data_ptr(), index_kind(row_idx, "row_idx"), other_idx.data_ptr(),
                    index_kind(other_idx, "other_idx"), num_edges, num_rows, shift, order, order + num_edges, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return buffer;
}

// Shuffled edges read both sides' rows once per edge. Grouped by row range of the side with more
// row bytes (edge_order.cu), that side's rows come from DRAM about once each, for the cost of the
// grouping passes, of one more load in each edge's chain of dependent loads, and of index reads and
// output writes scattered by the new order. That pays only when the saving is large and the per-edge
// arrays (indices, output, order) stay near L2: it is taken when that side overflows half of L2,
// saves more than kOrderMinSavedBytes per edge, and the per-edge arrays fit in twice the L2.
constexpr int64_t kOrderMinSavedBytes = 640;
constexpr int64_t kOrderMinEdges = int64_t{1} << 16;

struct OrderChoice {
  bool by_src;
  int shift;  // buckets of 2**shift rows
};

c10::optional<OrderChoice> choose_edge_order(const at::Tensor& src_feat, const at::Tensor& dst_feat,
                                             const at::Tensor& src_idx, const at::Tensor& dst_idx,
                                             const at::Tensor& out) {
  const int64_t num_edges = src_idx.size(0);
  if (num_edges < kOrderMinEdges || num_edges >= std::numeric_limits<int32_t>::max()) return c10::nullopt;
  const int64_t dim_bytes = src_feat.size(-1) * src_feat.element_size();
  const int64_t src_row_bytes = heads_of(src_feat) * dim_bytes, dst_row_bytes = heads_of(dst_feat) * dim_bytes;
  const bool by_src = src_feat.size(0) * src_row_bytes >= dst_feat.size(0) * dst_row_bytes;
  const int64_t num_rows = by_src ? src_feat.size(0) : dst_feat.size(0);
  const int64_t row_bytes = by_src ? src_row_bytes : dst_row_bytes;
  const int64_t l2 = l2_cache_bytes();
  const int64_t saved_bytes = row_bytes * (num_edges - num_rows);  // at most one read per row instead of per edge
  const int64_t edge_array_bytes =
      src_idx.nbytes() + dst_idx.nbytes() + out.nbytes() + num_edges * static_cast<int64_t>(sizeof(int32_t));
  if (2 * num_rows * row_bytes <= l2 || saved_bytes <= kOrderMinSavedBytes * num_edges || edge_array_bytes > 2 * l2) {
    return c10::nullopt;
  }
  // Buckets of about 1/16 of L2: the edges in flight span at most a few buckets.
  int shift = 0;
  while ((row_bytes << shift) < l2 / 16 || ((num_rows - 1) >> shift) + 1 > kMaxOrderBuckets) ++shift;
  return OrderChoice{by_src, shift};
}

}  // namespace

// Widest float32 rows (features per head) whose atomic backward accumulates in double.
constexpr int64_t kDoubleAccumMaxDim = 16;

// Outcome codes of forward, turned into exceptions in Python (edgedot/ops/edge_dot.py).
constexpr int64_t kOk = 0, kBadSrcIndex = 1, kBadDstIndex = 2, kInvalidInputs = 3;

// Returns the output and an outcome code: kBadSrcIndex / kBadDstIndex when src_idx / dst_idx
// held an out-of-range index (checked calls only), kInvalidInputs (and an undefined output) when
// the arguments break the rules of check_inputs, in which case nothing was launched.
std::tuple<at::Tensor, int64_t> forward(at::Tensor src_feat, at::Tensor dst_feat, at::Tensor src_idx,
                                        at::Tensor dst_idx, bool check_indices) {
  if (!valid_inputs(src_feat, dst_feat, src_idx, dst_idx)) return {at::Tensor(), kInvalidInputs};
  TORCH_CHECK_VALUE(src_feat.size(-1) <= std::numeric_limits<int32_t>::max() &&
                        std::max(heads_of(src_feat), heads_of(dst_feat)) <= std::numeric_limits<int32_t>::max(),
                    "edgedot: more than 2**31 - 1 features or heads per row are not supported on CUDA");
  const c10::cuda::CUDAGuard guard(src_feat.device());
  InRangeMemo& memo = in_range_memo();
  const at::Tensor given_src_idx = src_idx, given_dst_idx = dst_idx;
  check_indices = check_indices && !(memo.covers(src_idx, src_feat.size(0)) && memo.covers(dst_idx, dst_feat.size(0)));
  src_feat = unit_stride_last(src_feat);
  dst_feat = unit_stride_last(dst_feat);
  src_idx = src_idx.contiguous();
  dst_idx = dst_idx.contiguous();
  const int64_t num_edges = src_idx.size(0);
  const bool flat = src_feat.dim() == 2 && dst_feat.dim() == 2;
  const int64_t heads = std::max(heads_of(src_feat), heads_of(dst_feat));
  at::Tensor out = flat ? at::empty({num_edges}, src_feat.options()) : at::empty({num_edges, heads}, src_feat.options());
  if (out.numel() == 0) return {out, kOk};

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Checking needs the kernel's verdict on the host: it waits for the stream. Capture can't wait.
  int* flags = check_indices && !stream_capturing(stream) ? host_error_flags() : nullptr;
  int* device_flags = nullptr;
  if (flags != nullptr) {
    flags[0] = flags[1] = 0;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flags), flags, 0));
  }
  ForwardArgs args{rows_of(src_feat), rows_of(dst_feat), src_idx.data_ptr(), dst_idx.data_ptr(), out.data_ptr(),
                   num_edges, heads, src_feat.size(-1), device_flags};
  at::Tensor order_buffer;
  EdgeOrder order{nullptr, nullptr};
  if (const auto choice = choose_edge_order(src_feat, dst_feat, src_idx, dst_idx, out)) {
    order_buffer = choice->by_src ? edge_order_buffer(src_idx, dst_idx, src_feat.size(0), choice->shift, stream)
                                  : edge_order_buffer(dst_idx, src_idx, dst_feat.size(0), choice->shift, stream);
    order.order = order_buffer.data_ptr<int32_t>();
    order.used = order.order + num_edges;
  }
  launch_forward(args, order, scalar_kind(src_feat.scalar_type()), index_kind(src_idx, "src_idx"),
                 index_kind(dst_idx, "dst_idx"), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (flags != nullptr) {
    // c10's wait, so that torch.cuda.set_sync_debug_mode sees it.
    c10::cuda::stream_synchronize(stream);
    const volatile int* seen = flags;
    if (seen[0] != 0) return {out, kBadSrcIndex};
    if (seen[1] != 0) return {out, kBadDstIndex};
    memo.put(given_src_idx, src_feat.size(0));
    memo.put(given_dst_idx, dst_feat.size(0));
  }
  return {out, kOk};
}

// The forward's visit order grouped by buckets of 2**shift rows of row_idx, for tests: the
// positions, and whether they were written (a sample found neither index mostly sorted).
std::tuple<at::Tensor, bool> edge_order(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows,
                                        int64_t shift) {
  const int64_t num_edges = row_idx.size(0);
  TORCH_CHECK_VALUE(is_index(row_idx) && is_index(other_idx) && other_idx.size(0) == num_edges && num_edges >= 2 &&
                        num_edges < std::numeric_limits<int32_t>::max() && num_rows > 0 && shift >= 0 &&
                        shift < 63 && ((num_rows - 1) >> shift) + 1 <= kMaxOrderBuckets,
                    message("edgedot: edge_order needs two index vectors of 2 to 2**31 - 1 edges and at most ",
                            kMaxOrderBuckets, " buckets"));
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const at::Tensor buffer = edge_order_buffer(row_idx.contiguous(), other_idx.contiguous(), num_rows,
                                              static_cast<int>(shift), c10::cuda::getCurrentCUDAStream());
  return {buffer.narrow(0, 0, num_edges), buffer[num_edges].item<int32_t>() != 0};
}

// One side's gradient: over the plan's sorted edges if one is given, else by `reduction`:
//   "atomic"   edges as given, atomics into the gradient;
//   "sorted"   row_idx is non-decreasing: each row written once, bitwise reproducible;
//   "sort"     edges sorted stably by row here (sort_by_row), then as "sorted".
at::Tensor grad_rows(at::Tensor grad_out, at::Tensor row_feat, at::Tensor other_feat, at::Tensor row_idx,
                     at::Tensor other_idx, c10::optional<at::Tensor> plan, const std::string& reduction) {
  TORCH_CHECK_VALUE(reduction == "atomic" || reduction == "sorted" || reduction == "sort",
                    message("edgedot: unknown reduction '", reduction, "' (atomic, sorted or sort)"));
  const bool sort_here = !plan.has_value() && reduction == "sort";
  const bool sorted = plan.has_value() || sort_here || reduction == "sorted";
  const c10::cuda::CUDAGuard guard(row_feat.device());
  grad_out = grad_out.to(row_feat.scalar_type()).contiguous();
  other_feat = unit_stride_last(other_feat);
  if (!plan.has_value()) {  // a plan holds the rows itself: the index tensors are not read
    row_idx = row_idx.contiguous();
    other_idx = other_idx.contiguous();
  }
  const int64_t num_rows = row_feat.size(0);
  const int64_t row_heads = heads_of(row_feat);
  const int64_t dim = row_feat.size(-1);
  const int64_t num_edges = row_idx.size(0);
  const at::ScalarType dtype = row_feat.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  // Narrow float32 rows accumulate their atomics in double: float atomics over a long row lose
  // precision against a sorted sum. At this width the double buffer and its atomics cost little.
  const bool double_accum = dtype == at::kFloat && dim <= kDoubleAccumMaxDim;
  const at::ScalarType accum = half ? at::kFloat : double_accum ? at::kDouble : dtype;
  const auto options = row_feat.options();
  if (num_edges == 0 || row_feat.numel() == 0) return at::zeros(row_feat.sizes(), options);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GradArgs args{grad_out.data_ptr(), rows_of(other_feat), row_idx.data_ptr(), other_idx.data_ptr(),
                num_rows, row_heads, num_edges, grad_out.dim() == 2 ? grad_out.size(1) : 1, dim};
  if (sorted) {
    at::Tensor pairs;  // defined when the sort packed each edge's other row and gradient
    if (sort_here && packable_sort(args, grad_out.element_size())) {
      std::tie(row_idx, pairs) = sort_packed_by_row(args, row_idx, other_idx, grad_out, stream);
    } else if (sort_here) {
      std::tie(grad_out, row_idx, other_idx) = sort_by_row(grad_out, row_idx, other_idx, num_rows, stream);
    }
    args.grad_out = grad_out.data_ptr();
    args.row_idx = row_idx.data_ptr();
    args.other_idx = other_idx.data_ptr();
    const int64_t chunk_edges = sorted_chunk_edges(args, scalar_kind(dtype));
    // No memset: the kernel writes every row, rows without edges as zeros.
    at::Tensor grad = at::empty({num_rows, row_heads, dim}, options);
    at::Tensor workspace = at::empty({sorted_workspace_slots(args, chunk_edges), row_heads, dim},
                                     options.dtype(half ? at::kFloat : dtype));
    if (plan.has_value()) {
      // Layout checked in Python (edgedot/runtime/plan.py): [order | row_other], num_edges each.
      const int64_t* p = plan->data_ptr<int64_t>();
      launch_grad_planned(args, PlanSide{p, reinterpret_cast<const uint64_t*>(p + num_edges)}, grad.data_ptr(),
                          workspace.data_ptr(), chunk_edges, scalar_kind(dtype), stream);
    } else {
      const auto* packed = pairs.defined() ? reinterpret_cast<const uint64_t*>(pairs.data_ptr<int64_t>()) : nullptr;
      launch_grad_sorted(args, packed, grad.data_ptr(), workspace.data_ptr(), chunk_edges, scalar_kind(dtype),
                         index_kind(row_idx, "row_idx"), index_kind(other_idx, "other_idx"), stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return grad.view(row_feat.sizes());
  }
  // A memset, not at::zeros: a fill kernel costs several microseconds more host time per call.
  at::Tensor grad = at::empty({num_rows, row_heads, dim}, options.dtype(accum));
  C10_CUDA_CHECK(cudaMemsetAsync(grad.data_ptr(), 0, grad.nbytes(), stream));
  launch_grad_atomic(args, grad.data_ptr(), scalar_kind(dtype), double_accum, index_kind(row_idx, "row_idx"),
                     index_kind(other_idx, "other_idx"), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return (accum != dtype ? grad.to(dtype) : grad).view(row_feat.sizes());
}

}  // namespace edgedot
