// The torch side shared by the op families (edge_dot/, attention/): tensor arguments turned into
// the kernels' plain types (edgedot.h), host flags and streams, the argument predicates, and the
// graph ops of common/ that the extension exposes (check_graph, group_edges) or a family calls
// (the per-call sorts by row). Shapes and dtypes were validated in Python (edgedot/runtime/checks.py)
// before these are called.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "common/check_message.h"
#include "common/edgedot.h"

namespace edgedot {

// ---- Tensor arguments (common/tensor_args.cpp; the one-liners here, inline) ----

ScalarKind scalar_kind(at::ScalarType t);

IndexKind index_kind(const at::Tensor& idx, const char* name);

inline at::Tensor unit_stride_last(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

inline int64_t heads_of(const at::Tensor& feat) { return feat.dim() == 3 ? feat.size(1) : 1; }

// Node and head strides of a [N, D] or [N, H, D] tensor; one head broadcasts with stride 0.
inline Rows rows_of(const at::Tensor& feat) {
  const bool one_head = heads_of(feat) == 1;
  return Rows{feat.data_ptr(), feat.size(0), feat.stride(0), one_head ? 0 : feat.stride(1)};
}

// Buffers carved out of one byte allocation (one call of the caching allocator instead of one
// each: small calls are bound by the host), each at a 256-byte boundary as CUB's temporary
// storage wants: add() returns a buffer's offset, size() the bytes to allocate.
class Carving {
 public:
  int64_t add(int64_t bytes) {
    const int64_t at = size_;
    size_ += (bytes + 255) / 256 * 256;
    return at;
  }
  int64_t size() const { return size_; }

 private:
  int64_t size_ = 0;
};

int* host_error_flags();

bool stream_capturing(cudaStream_t stream);

inline bool is_feature_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline bool is_index(const at::Tensor& idx) {
  return (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong) && idx.dim() == 1;
}

bool valid_inputs(const at::Tensor& src_feat, const at::Tensor& dst_feat, const at::Tensor& src_idx,
                  const at::Tensor& dst_idx);

// ---- Graph checks (common/graph_checks.cpp) ----

at::Tensor graph_flags(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                       const c10::optional<at::Tensor>& dst_ptr, bool check_src, bool check_dst);
// The parts of a graph graph_check_launch checked (its result), and graph_check_forget forgets.
constexpr int64_t kGraphCheckSrc = 1, kGraphCheckDst = 2, kGraphCheckPtr = 4;
int64_t graph_check_launch(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                           const c10::optional<at::Tensor>& dst_ptr, const at::Tensor& host_flags);
void graph_check_forget(const at::Tensor& src_idx, const at::Tensor& dst_idx, const c10::optional<at::Tensor>& dst_ptr,
                        int64_t launched);
std::tuple<std::vector<at::Tensor>, int64_t> group_edges_checked(const at::Tensor& dst_idx, const at::Tensor& src_idx,
                                                                 int64_t num_dst, int64_t num_src, bool both,
                                                                 const at::Tensor& host_flags);
std::tuple<at::Tensor, at::Tensor, int64_t> self_looped_checked(const at::Tensor& edge_index, int64_t num_nodes,
                                                                int64_t dropped, int64_t num_src, int64_t num_dst,
                                                                const at::Tensor& host_flags);

// ---- Column sums (common/column_sum_ops.cpp) ----

// x [rows, width] summed over its rows in an order fixed by the shape: [width] in x's dtype, or in
// out_dtype (rounded once, at the end).
at::Tensor column_sum(const at::Tensor& x, c10::optional<at::ScalarType> out_dtype = c10::nullopt);
// The gradient of a bias (any shape) added to every row of grad's last bias.numel() elements: their
// column sum, in the bias's shape and dtype (common/linear_autograd.cpp).
at::Tensor bias_grad(const at::Tensor& grad, const at::Tensor& bias);

// F.linear(x, weight, bias) and x + bias with C++ autograd nodes whose bias gradient is column_sum
// (common/linear_autograd.cpp).
at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// One GEMM of x by several weights of one shape [width, in] (each bias [width], or none): each
// weight's column block as a [rows, heads, width / heads] view of one result, whose gradients reach
// the GEMM without a copy where they share one buffer as its column blocks. With cast (autocast),
// the weights and biases are taken in x's dtype.
std::vector<at::Tensor> linear_sides_autograd(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                              const std::vector<at::Tensor>& biases, int64_t heads, bool cast);
at::Tensor add_bias_autograd(const at::Tensor& x, const at::Tensor& bias);

// ---- Edges grouped and sorted by row (common/grouping_ops.cpp) ----

std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_by_row(const at::Tensor& grad_out, const at::Tensor& row_idx,
                                                           const at::Tensor& other_idx, int64_t num_rows,
                                                           cudaStream_t stream);

std::tuple<at::Tensor, at::Tensor> sort_packed_by_row(const GradArgs& args, const at::Tensor& row_idx,
                                                      const at::Tensor& other_idx, const at::Tensor& grad_out,
                                                      cudaStream_t stream);

bool packable_sort(const GradArgs& args, int64_t grad_bytes);

// group_edges' and group_edges_both's work (both: also by other_idx), range_flags reported.
std::vector<at::Tensor> group_sides(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows,
                                    int64_t num_other, bool both, RangeFlags range_flags);

std::tuple<at::Tensor, at::Tensor> group_edges(at::Tensor row_idx, at::Tensor other_idx, int64_t num_rows,
                                               int64_t num_other);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_edges_both(at::Tensor row_idx, at::Tensor other_idx,
                                                                            int64_t num_rows, int64_t num_other);

// ---- The layers' self-loops (common/self_loops_ops.cpp) ----

// (src, dst) of edge_index [2, E] with self-loops replaced and loops appended, edge_index's range
// checked into range_flags (launch_self_looped).
std::tuple<at::Tensor, at::Tensor> self_looped(const at::Tensor& edge_index, int64_t num_nodes, int64_t dropped,
                                               RangeFlags range_flags, int64_t num_src, int64_t num_dst);

}  // namespace edgedot
