// Graph attention on the torch side (attention/attention_ops.cpp): its forward and backward, and
// the marshalling GAT and GATv2 (attention/gat_ops.cpp) reuse: groupings, chunk schedules,
// partial-row buffers, tensor checks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <vector>

#include "common/edgedot.h"

namespace edgedot {

// ---- Shared with GAT and GATv2 ----

inline at::ScalarType attention_accum(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [rows, heads, dim] with unit stride on dim.
inline Rows attention_rows(const at::Tensor& t) { return Rows{t.data_ptr(), t.size(0), t.stride(0), t.stride(1)}; }

void check_attention_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                            std::initializer_list<int64_t> shape);

AttentionGrouping attention_grouping(const c10::optional<at::Tensor>& group, const at::Tensor& offsets,
                                     const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_edges,
                                     int64_t num_rows, const at::Tensor& q, const char* side);

RowChunks attention_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads, int64_t dim,
                           int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep);
// attention_chunks of the destination grouping, through the thread's DstScheduleScope (below).
RowChunks attention_dst_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads,
                               int64_t dim, int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep);

// While one lives on a thread, the destination schedule built there is handed to it (the
// default scope), or, one given, taken instead of built again where it is of the same layout: the
// eager autograd node's forward keeps its schedule for its backward (attention/autograd.cpp), which
// would build the same one from the same grouping, and saves a launch and an allocation.
class DstScheduleScope {
 public:
  DstScheduleScope();
  DstScheduleScope(at::Tensor schedule, int64_t chunk);
  ~DstScheduleScope();
  DstScheduleScope(const DstScheduleScope&) = delete;
  DstScheduleScope& operator=(const DstScheduleScope&) = delete;
  // The schedule built (undefined where none was: no long rows) and its chunk length.
  const at::Tensor& schedule() const { return schedule_; }
  int64_t chunk() const { return chunk_; }

 private:
  friend RowChunks attention_dst_chunks(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, ScalarKind,
                                        std::vector<at::Tensor>&);
  at::Tensor schedule_;
  int64_t chunk_ = 0;
  bool given_;
  DstScheduleScope* outer_;
};

// A buffer of partial rows of a schedule's slots, `width` accumulation-type values a (slot, head).
struct PartialRows {
  const RowChunks* chunks;
  int64_t width;
};

std::vector<void*> attention_partials(std::initializer_list<PartialRows> parts, int64_t heads, const at::Tensor& q,
                                      std::vector<at::Tensor>& keep);

// The buffer in which the dst pass hands the src pass its records (state_bytes, beginning with
// num_edges * heads EdgeRecords), or an undefined tensor where it does not fit in memory: the src
// pass then recomputes what they hold, with the same gradients. With edges given grouped (an
// invalid pointer may leave edges unvisited by the dst pass) the records are filled to read NaN,
// as recomputing gives.
at::Tensor backward_records(int64_t state_bytes, int64_t num_edges, int64_t heads, bool given_grouped,
                            const at::Tensor& q, cudaStream_t stream);

// Whether `sides` are the consecutive sides of one [rows, sides, heads, dim] tensor, as a layer's
// one projection GEMM unbinds them; and one buffer of that layout, of `like`'s dtype and device, as
// its sides. Gradients written so reach the GEMM's backward without a copy
// (linear_sides_autograd, common/linear_autograd.cpp).
bool packed_sides(std::initializer_list<at::Tensor> sides);
std::vector<at::Tensor> packed_grads(const at::Tensor& like, int64_t sides);

// While one lives on a thread, the attention backwards there return the gradients of packed sides
// (graph attention's q, k and v; GATv2's x_src and x_dst) packed the same way: the eager autograd
// node's calls (attention/autograd.cpp), whose results only autograd sees. The registered ops never
// do: an op's outputs must not alias one another.
class PackedGradsScope {
 public:
  PackedGradsScope();
  ~PackedGradsScope();
  PackedGradsScope(const PackedGradsScope&) = delete;
  PackedGradsScope& operator=(const PackedGradsScope&) = delete;
  static bool active();

 private:
  bool outer_;
};

// While one lives on a thread, the attention forwards there add `residual` to their output as they
// store it (rounded once), and the backwards take their `out` to hold that sum (delta = <grad_out,
// out - residual>): the eager autograd node's calls (attention/autograd.cpp), whose outputs only
// autograd sees. An undefined residual adds nothing.
class ResidualScope {
 public:
  explicit ResidualScope(at::Tensor residual);
  ~ResidualScope();
  ResidualScope(const ResidualScope&) = delete;
  ResidualScope& operator=(const ResidualScope&) = delete;
  // The thread's residual as the kernels' rows for an output [num_dst, heads, dim] of `like`'s
  // dtype and device (data null: none). It must be [num_dst, heads, dim], or [heads, dim] or
  // [heads * dim] (added to every row: a bias), with unit stride on the last dim.
  static Rows rows(const at::Tensor& like, int64_t num_dst, int64_t heads, int64_t dim);
  // The thread's residual (undefined: none).
  static const at::Tensor& residual();
  // A backward that wrote the residual's gradient (grad_out) into a buffer of its own, beside q, k
  // and v's as the fourth side of their packed gradients (attention_backward_scaled), hands it to
  // the thread's scope; grad() is it, or undefined.
  static void set_grad(at::Tensor grad);
  const at::Tensor& grad() const { return grad_; }

 private:
  at::Tensor residual_, grad_;
  ResidualScope* outer_;
};

// ---- The extension's functions ----

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_forward(
    at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double scale, double dropout_p,
    c10::optional<at::Generator> generator, bool return_attention);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad,
    bool records);

// The same with a learned per-head scale scale_heads ([heads] or [1], any float dtype) in place of
// scale (CosineScore); the backward's fifth output is its gradient [heads], accumulation dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_forward_scaled(
    at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double scale, double dropout_p,
    c10::optional<at::Generator> generator, bool return_attention, c10::optional<at::Tensor> scale_heads);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_scaled(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad,
    bool records, c10::optional<at::Tensor> scale_heads);

// AGNN (PyG's AGNNConv): attention of x_norm = x / |x| (normalised by the caller) as queries and
// keys and x as values, under beta ([heads] or [1]); (out, lse, alpha or an empty [0] tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> agnn_forward(at::Tensor x_norm, at::Tensor x, at::Tensor beta,
                                                            at::Tensor src_idx, at::Tensor dst_idx,
                                                            c10::optional<at::Tensor> dst_group,
                                                            at::Tensor dst_offsets, bool return_attention);

// Its gradients: (d_x_norm, dx, d_beta [heads] in the accumulation dtype); records as for
// attention_backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> agnn_backward(
    at::Tensor grad_out, at::Tensor x_norm, at::Tensor x, at::Tensor beta, at::Tensor out, at::Tensor lse,
    at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets,
    at::Tensor src_group, at::Tensor src_offsets, bool records);

}  // namespace edgedot
