#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

#include "attention/attention_ops.h"
#include "attention/dropout_rng.h"
#include "attention/gat_ops.h"
#include "common/torch_common.h"

namespace edgedot {
namespace {

// Fused GAT and GATv2 attention (csrc/gat_forward.cu, csrc/gat_backward_dst.cu,
// csrc/gat_backward_src.cu) on graph attention's groupings, chunk schedules and dropout (drawn with
// draw_dropout_rng, read back with recorded_dropout_rng, the mask graph attention's). Shapes and
// dtypes were validated in Python (edgedot/ops/gat.py); these checks keep the kernels inside their
// tensors whatever they are given.

void check_gat_tensor(const at::Tensor& t, const char* name, const at::Tensor& x, std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.scalar_type() == x.scalar_type(),
                    message("edgedot: ", name, " must have the dtype of the features (", x.scalar_type(), "), got ",
                            t.scalar_type()));
  check_attention_tensor(t, name, x, shape);
}

// Per-node scalars [rows, heads], any strides: Rows of dim 1.
Rows gat_scalars(const at::Tensor& t) { return Rows{t.data_ptr(), t.size(0), t.stride(0), t.stride(1)}; }

const Rows kNoRows{nullptr, 0, 0, 0};

// What GAT and GATv2 share: x [num_src, heads, dim] (made unit stride on dim), sizes, dropout
// without its rng.
GatInputs gat_common(at::Tensor& x, const char* name, int64_t num_dst, int64_t num_edges, double negative_slope,
                     double dropout_p) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kHalf ||
                       x.scalar_type() == at::kBFloat16,
                   message("edgedot: ", name, " must be float32, float64, float16 or bfloat16, got ", x.scalar_type()));
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 3, message("edgedot: ", name,
                                                         " must be a 3-D CUDA tensor [rows, heads, dim]"));
  const int64_t dim = x.size(2);
  TORCH_CHECK_VALUE(dim >= 1 && dim <= kAttentionMaxDim,
                    message("edgedot: GAT attention on CUDA takes head dims of 1 to ", kAttentionMaxDim, ", got ",
                            dim));
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  // Below 2**31 - 1 rows: the schedule scans num_rows + 1 entries with int32 counts.
  TORCH_CHECK_VALUE(num_edges < kMax32 && x.size(0) < kMax32 && num_dst < kMax32,
                    "edgedot: GAT attention takes fewer than 2**31 - 1 edges and rows a side");
  x = unit_stride_last(x);
  GatInputs in{};
  in.x = attention_rows(x);
  in.a_src = in.a_dst = in.a_edge = in.x_dst = in.att = in.edge_feat = kNoRows;
  in.num_dst = num_dst;
  in.num_edges = num_edges;
  in.heads = x.size(1);
  in.dim = dim;
  in.negative_slope = negative_slope;
  in.dropout = dropout_of(dropout_p);
  return in;
}

GatInputs gat_inputs(at::Tensor& x, const at::Tensor& a_src, const at::Tensor& a_dst,
                     const c10::optional<at::Tensor>& a_edge, int64_t num_edges, double negative_slope,
                     double dropout_p) {
  TORCH_CHECK_VALUE(a_dst.dim() == 2, message("edgedot: a_dst must be 2-D [num_dst, heads], got shape ",
                                              a_dst.sizes()));
  GatInputs in = gat_common(x, "x", a_dst.size(0), num_edges, negative_slope, dropout_p);
  check_gat_tensor(a_src, "a_src", x, {x.size(0), in.heads});
  check_gat_tensor(a_dst, "a_dst", x, {in.num_dst, in.heads});
  in.v2 = false;
  in.a_src = gat_scalars(a_src);
  in.a_dst = gat_scalars(a_dst);
  if (a_edge.has_value()) {
    check_gat_tensor(*a_edge, "a_edge", x, {num_edges, in.heads});
    in.a_edge = gat_scalars(*a_edge);
  }
  return in;
}

// x_src, x_dst, att and edge_feat made unit stride on dim.
GatInputs gatv2_inputs(at::Tensor& x_src, at::Tensor& x_dst, at::Tensor& att, c10::optional<at::Tensor>& edge_feat,
                       int64_t num_edges, double negative_slope, double dropout_p) {
  TORCH_CHECK_VALUE(x_dst.dim() == 3, message("edgedot: x_dst must be 3-D [num_dst, heads, dim], got shape ",
                                              x_dst.sizes()));
  GatInputs in = gat_common(x_src, "x_src", x_dst.size(0), num_edges, negative_slope, dropout_p);
  check_gat_tensor(x_dst, "x_dst", x_src, {in.num_dst, in.heads, in.dim});
  check_gat_tensor(att, "att", x_src, {in.heads, in.dim});
  in.v2 = true;
  x_dst = unit_stride_last(x_dst);
  att = unit_stride_last(att);
  in.x_dst = attention_rows(x_dst);
  in.att = Rows{att.data_ptr(), 1, 0, att.stride(0)};
  if (edge_feat.has_value()) {
    check_gat_tensor(*edge_feat, "edge_feat", x_src, {num_edges, in.heads, in.dim});
    edge_feat = unit_stride_last(*edge_feat);
    in.edge_feat = attention_rows(*edge_feat);
  }
  return in;
}

// (out, lse, alpha, rng_state) of either model; x the values' tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_forward_run(
    GatInputs in, const at::Tensor& x, const at::Tensor& src_idx, const at::Tensor& dst_idx,
    const c10::optional<at::Tensor>& dst_group, const at::Tensor& dst_offsets, double dropout_p,
    const c10::optional<at::Generator>& generator, bool return_attention) {
  at::Tensor rng_state = at::empty({0}, x.options().dtype(at::kLong));
  if (dropout_p > 0.0) in.dropout.rng = draw_dropout_rng(generator, x, rng_state);
  const ScalarKind scalar = scalar_kind(x.scalar_type());
  std::vector<at::Tensor> keep;
  GatForwardArgs args{};
  args.in = in;
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, in.num_edges, in.num_dst, x, "dst");
  args.dst_chunks = attention_dst_chunks(dst_offsets, in.num_dst, in.num_edges, in.heads, in.dim, in.dim, scalar, keep);
  // No memset: the kernels write every element (rows without edges as zeros, lse -inf).
  at::Tensor out = at::empty({in.num_dst, in.heads, in.dim}, x.options());
  at::Tensor lse = at::empty({in.num_dst, in.heads}, x.options().dtype(attention_accum(x.scalar_type())));
  const std::vector<int64_t> alpha_shape = return_attention ? std::vector<int64_t>{in.num_edges, in.heads}
                                                            : std::vector<int64_t>{0};
  at::Tensor alpha = at::empty(alpha_shape, x.options());
  args.out = out.data_ptr();
  args.lse = lse.data_ptr();
  args.alpha = return_attention ? alpha.data_ptr() : nullptr;
  args.residual = ResidualScope::rows(x, in.num_dst, in.heads, in.dim);
  const std::vector<void*> parts = attention_partials({{&args.dst_chunks, in.dim}, {&args.dst_chunks, 2}}, in.heads,
                                                      x, keep);
  args.part_acc = parts[0];
  args.part_ml = parts[1];
  launch_gat_forward(args, scalar, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, alpha, rng_state};
}

// Gradients of either model by recomputation from lse: (dx, da_src, dst_grad, datt, edge_grad),
// GAT's da_src and dst_grad [rows, heads] and edge_grad [E, H], GATv2's dst_grad (dx_dst) [Nd, H, C],
// datt [H, C] and edge_grad [E, H, C]; what a model lacks, what is not wanted (edge_grad without
// edge_grad_wanted, dx and da_src without src_grad), are empty [0] tensors. The dst pass writes
// delta and the dst and edge gradients, the src pass (src_grad only) dx and da_src. With dropout,
// rng_state is the forward's. packed (GATv2 with src_grad): dx and dst_grad as the two sides of one
// [rows, 2, heads, dim] buffer (packed_grads).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward_run(
    GatInputs in, const at::Tensor& x, at::Tensor grad_out, at::Tensor out, at::Tensor lse,
    const at::Tensor& src_idx, const at::Tensor& dst_idx, const c10::optional<at::Tensor>& dst_group,
    const at::Tensor& dst_offsets, const c10::optional<at::Tensor>& src_group,
    const c10::optional<at::Tensor>& src_offsets, double dropout_p, const c10::optional<at::Tensor>& rng_state,
    bool edge_grad_wanted, bool src_grad, bool records, bool packed) {
  if (dropout_p > 0.0) in.dropout.rng = recorded_dropout_rng(rng_state, x);
  TORCH_CHECK_VALUE(!src_grad || (src_group.has_value() && src_offsets.has_value()),
                    "edgedot: src_grad needs src_group and src_offsets");
  const int64_t num_dst = in.num_dst, num_src = in.x.num_rows, heads = in.heads, dim = in.dim;
  const at::ScalarType accum = attention_accum(x.scalar_type());
  const ScalarKind scalar = scalar_kind(x.scalar_type());
  check_attention_tensor(grad_out, "grad_out", x, {num_dst, heads, dim});
  check_attention_tensor(out, "out", x, {num_dst, heads, dim});
  check_attention_tensor(lse, "lse", x, {num_dst, heads});
  grad_out = grad_out.to(x.scalar_type()).contiguous();
  out = unit_stride_last(out.to(x.scalar_type()));
  lse = lse.to(accum).contiguous();
  std::vector<at::Tensor> keep;
  GatBackwardArgs args{};
  args.in = in;
  args.grad_out = attention_rows(grad_out);
  args.out = attention_rows(out);
  args.residual = ResidualScope::rows(x, num_dst, heads, dim);
  args.lse = lse.data_ptr();
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, in.num_edges, num_dst, x, "dst");
  args.dst_chunks = attention_dst_chunks(dst_offsets, num_dst, in.num_edges, heads, dim, dim, scalar, keep);
  if (src_grad) {
    args.src = attention_grouping(src_group, *src_offsets, src_idx, dst_idx, in.num_edges, num_src, x, "src");
    args.src_chunks = attention_chunks(*src_offsets, num_src, in.num_edges, heads, dim, dim, scalar, keep);
  }
  const auto options = x.options();
  // Absent outputs: an empty tensor each (outputs of an op must not alias one another).
  const auto none = [&options] { return at::empty({0}, options); };
  // No memsets: every row is written by one team or merge (rows without edges as zeros).
  at::Tensor delta = at::empty({num_dst, heads}, options.dtype(accum));
  at::Tensor dst_grad, dx;
  if (packed) {
    const std::vector<at::Tensor> sides = packed_grads(x, 2);
    dx = sides[0];
    dst_grad = sides[1];
    args.grad_pack = 2;
  } else {
    dst_grad = in.v2 ? at::empty({num_dst, heads, dim}, options) : at::empty({num_dst, heads}, options);
    dx = src_grad ? at::empty({num_src, heads, dim}, options) : none();
  }
  at::Tensor edge_grad = !edge_grad_wanted ? none()
                         : in.v2           ? at::empty({in.num_edges, heads, dim}, options)
                                           : at::empty({in.num_edges, heads}, options);
  at::Tensor da_src = src_grad && !in.v2 ? at::empty({num_src, heads}, options) : none();
  args.delta = delta.data_ptr();
  args.dst_grad = dst_grad.data_ptr();
  args.edge_grad = edge_grad_wanted ? edge_grad.data_ptr() : nullptr;
  args.dx = src_grad ? dx.data_ptr() : nullptr;
  args.da_src = src_grad && !in.v2 ? da_src.data_ptr() : nullptr;
  const std::vector<void*> parts =
      attention_partials({{&args.dst_chunks, in.v2 ? dim : 1}, {&args.src_chunks, dim},
                          {&args.src_chunks, in.v2 ? 0 : 1}},
                         heads, x, keep);
  args.part_dst_grad = parts[0];
  args.part_dx = parts[1];
  args.part_da_src = parts[2];
  // GATv2's datt: a row per team of the dst pass, summed below in a fixed order (never atomics).
  at::Tensor datt_teams =
      in.v2 ? at::empty({gat_dst_pass_teams(args, scalar) / heads, heads * dim}, options.dtype(accum)) : none();
  args.datt_teams = in.v2 ? datt_teams.data_ptr() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor src_state = backward_records(records ? gat_src_state_bytes(args, scalar) : 0, in.num_edges, heads,
                                                args.dst.order == nullptr, x, stream);
  args.src_state = src_state.defined() ? src_state.data_ptr() : nullptr;
  launch_gat_backward_dst(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (src_grad) {
    launch_gat_backward_src(args, scalar, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_gat_backward_merges(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor datt = in.v2 ? column_sum(datt_teams, x.scalar_type()).view({heads, dim}) : none();
  return {dx, da_src, dst_grad, datt, edge_grad};
}

}  // namespace

// Fused GAT forward (PyG GATConv's attention) over the dst grouping, which is given as for
// attention_forward: (out [Nd, H, C] in x's dtype, lse [Nd, H] in the accumulation dtype, alpha
// [E, H] before dropout in x's dtype, or an empty [0] tensor without return_attention, rng_state:
// the dropout (seed, offset) drawn from generator, int64 [2], or an empty [0] tensor without dropout).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_forward(
    at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const GatInputs in = gat_inputs(x, a_src, a_dst, a_edge, num_edges, negative_slope, dropout_p);
  return gat_forward_run(in, x, src_idx, dst_idx, dst_group, dst_offsets, dropout_p, generator, return_attention);
}

// Fused GATv2 forward (PyG GATv2Conv's attention): the same outputs, the values x_src.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_forward(
    at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x_src.device());
  const GatInputs in = gatv2_inputs(x_src, x_dst, att, edge_feat, num_edges, negative_slope, dropout_p);
  return gat_forward_run(in, x_src, src_idx, dst_idx, dst_group, dst_offsets, dropout_p, generator,
                         return_attention);
}

// Its gradients by recomputation from lse: (dx, da_src, da_dst, da_edge) in x's dtype; da_edge is
// an empty [0] tensor without a_edge_grad, dx and da_src without src_grad (then src_group and
// src_offsets are not read). With dropout, rng_state is the forward's. records: the dst pass hands
// the src pass each edge's alpha and dz where they fit in memory (else, and without records, the
// src pass recomputes them; the same gradients).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward(
    at::Tensor grad_out, at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool a_edge_grad,
    bool src_grad, bool records) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const GatInputs in = gat_inputs(x, a_src, a_dst, a_edge, num_edges, negative_slope, dropout_p);
  TORCH_CHECK_VALUE(!a_edge_grad || a_edge.has_value(), "edgedot: a_edge_grad needs a_edge");
  const auto grads = gat_backward_run(in, x, grad_out, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                                      src_offsets, dropout_p, rng_state, a_edge_grad, src_grad, records, false);
  return {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), std::get<4>(grads)};
}

// GATv2's gradients: (dx_src, dx_dst, datt, d_edge_feat) in x_src's dtype; d_edge_feat is an empty
// [0] tensor without edge_feat_grad, dx_src without src_grad. With dropout, rng_state is the forward's.
// records: the dst pass hands the src pass each edge's alpha, ds and signs of m where they fit in
// memory (else, and without records, the src pass recomputes them; the same gradients).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_backward(
    at::Tensor grad_out, at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad,
    bool src_grad, bool records) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x_src.device());
  const bool packed = src_grad && PackedGradsScope::active() && packed_sides({x_src, x_dst});
  const GatInputs in = gatv2_inputs(x_src, x_dst, att, edge_feat, num_edges, negative_slope, dropout_p);
  TORCH_CHECK_VALUE(!edge_feat_grad || edge_feat.has_value(), "edgedot: edge_feat_grad needs edge_feat");
  const auto grads = gat_backward_run(in, x_src, grad_out, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                                      src_group, src_offsets, dropout_p, rng_state, edge_feat_grad, src_grad,
                                      records, packed);
  return {std::get<0>(grads), std::get<2>(grads), std::get<3>(grads), std::get<4>(grads)};
}

namespace {

// x as the kernels read it: x itself, or x in float64 where the logits are float64 (the kernels
// accumulate each x type in its own accumulation type).
at::Tensor logits_x(const at::Tensor& x, at::ScalarType result) {
  return unit_stride_last(result == at::kDouble ? x.to(at::kDouble) : x);
}

// The logits' type, PyTorch's promotion of x's and every att's (that of (x * att).sum(-1)).
at::ScalarType logits_type(const at::Tensor& x, const std::vector<at::Tensor>& atts) {
  at::ScalarType result = x.scalar_type();
  for (const at::Tensor& att : atts) result = c10::promoteTypes(result, att.scalar_type());
  return result;
}

// A side's att (any shape of heads * dim elements on x's device) as [heads, dim] in the logits' type,
// contiguous: itself unless another dtype or layout.
at::Tensor side_att(const at::Tensor& att, const at::Tensor& x, at::ScalarType result) {
  const int64_t heads = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(att.numel() == heads * dim && att.device() == x.device(),
                    message("edgedot: each att must hold heads x dim = ", heads, " x ", dim,
                            " elements on x's device, got shape ", att.sizes(), " on ", att.device()));
  return att.to(result).contiguous().view({heads, dim});
}

std::vector<at::Tensor> sides_of(const at::Tensor& att) {
  TORCH_CHECK_VALUE(att.dim() == 2 || (att.dim() == 3 && (att.size(0) == 1 || att.size(0) == 2)),
                    message("edgedot: att must be [H, C] or [2, H, C], got ", att.sizes()));
  return att.dim() == 2 ? std::vector<at::Tensor>{att} : att.unbind(0);
}

// Each side's logits, [sides, N, H] stacked (one tensor) or as `sides` [N, H] tensors.
std::vector<at::Tensor> logits_of_sides(const at::Tensor& x_in, const std::vector<at::Tensor>& atts, bool stacked) {
  TORCH_CHECK_VALUE(x_in.is_cuda() && x_in.dim() == 3, "edgedot: x must be a 3-D CUDA tensor [N, H, C]");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::ScalarType result = logits_type(x_in, atts);
  const at::Tensor x = logits_x(x_in, result);
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), count = static_cast<int64_t>(atts.size());
  LogitSides sides{count, {nullptr, nullptr}, {nullptr, nullptr}};
  std::vector<at::Tensor> kept_atts, outs;
  const at::TensorOptions options = x.options().dtype(result);
  const at::Tensor buffer = stacked ? at::empty({count, rows, heads}, options) : at::Tensor();
  for (int64_t k = 0; k < count; ++k) {
    kept_atts.push_back(side_att(atts[k], x, result));
    sides.in[k] = kept_atts.back().data_ptr();
    const at::Tensor out = stacked ? buffer[k] : at::empty({rows, heads}, options);
    sides.out[k] = out.data_ptr();
    if (!stacked) outs.push_back(out);
  }
  launch_node_logits(rows_of(x), heads, dim, sides, scalar_kind(x.scalar_type()), result != x.scalar_type(),
                     c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stacked ? std::vector<at::Tensor>{buffer} : outs;
}

// (dx in x's dtype or undefined, the sides' att gradients [sides, H, C] in the logits' type or undefined)
// for grads[k] side k's [N, H] logits' gradient (undefined: zeros). A defined dx_into (x's shape and
// dtype, contiguous) is added to and returned as dx.
std::tuple<at::Tensor, at::Tensor> logits_grads(const std::vector<at::Tensor>& grads, const at::Tensor& x_in,
                                                const std::vector<at::Tensor>& atts, bool x_grad, bool att_grad,
                                                const at::Tensor& dx_into) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::ScalarType result = logits_type(x_in, atts);
  const at::Tensor x = logits_x(x_in, result);
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), count = static_cast<int64_t>(atts.size());
  LogitSides sides{count, {nullptr, nullptr}, {nullptr, nullptr}};
  const void* att_data[2] = {nullptr, nullptr};
  std::vector<at::Tensor> kept;
  for (int64_t k = 0; k < count; ++k) {
    kept.push_back(side_att(atts[k], x, result));
    att_data[k] = kept.back().data_ptr();
    if (grads[k].defined()) {
      TORCH_CHECK_VALUE(grads[k].numel() == rows * heads,
                        message("edgedot: the logits' gradient must be [N, H] = [", rows, ", ", heads, "], got ",
                                grads[k].sizes()));
      kept.push_back(grads[k].to(result).contiguous());
      sides.in[k] = kept.back().data_ptr();
    }
  }
  const at::TensorOptions accum = x.options().dtype(result == at::kDouble ? at::kDouble : at::kFloat);
  const bool accumulate = x_grad && dx_into.defined();
  TORCH_CHECK(!accumulate || (dx_into.scalar_type() == x.scalar_type() && dx_into.sizes() == x.sizes() &&
                              dx_into.is_contiguous() && dx_into.device() == x.device()),
              "edgedot: the logits' dx is added to a contiguous tensor of x's shape and dtype");
  at::Tensor dx = accumulate ? dx_into : x_grad ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor datt = att_grad ? at::empty({count, heads, dim}, x.options().dtype(result)) : at::Tensor();
  const at::Tensor partial = att_grad ? at::empty({node_logits_blocks(rows), count, heads, dim}, accum) : at::Tensor();
  if (att_grad && rows == 0) datt.zero_();
  launch_node_logits_backward(sides, att_data, rows_of(x), heads, dim, x_grad ? dx.data_ptr() : nullptr, accumulate,
                              att_grad ? partial.data_ptr() : nullptr, att_grad ? datt.data_ptr() : nullptr,
                              scalar_kind(x.scalar_type()), result != x.scalar_type(),
                              c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {x_grad ? dx.to(x_in.scalar_type()) : dx, datt};
}

}  // namespace

at::Tensor node_logits_forward(const at::Tensor& x, const at::Tensor& att) {
  const at::Tensor out = logits_of_sides(x, sides_of(att), true)[0];
  return att.dim() == 2 ? out.squeeze(0) : out;
}

std::vector<at::Tensor> node_logits_sides_forward(const at::Tensor& x, const std::vector<at::Tensor>& atts) {
  TORCH_CHECK_VALUE(atts.size() == 1 || atts.size() == 2, "edgedot: node logits take one or two sides");
  return logits_of_sides(x, atts, false);
}

std::tuple<at::Tensor, at::Tensor> node_logits_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& att, bool x_grad, bool att_grad) {
  const std::vector<at::Tensor> atts = sides_of(att);
  const std::vector<at::Tensor> grads = att.dim() == 2 ? std::vector<at::Tensor>{grad} : grad.unbind(0);
  auto [dx, datt] = logits_grads(grads, x, atts, x_grad, att_grad, at::Tensor());
  return {x_grad ? dx : x.new_empty({0}), att_grad ? datt.view(att.sizes()).to(att.scalar_type()) : att.new_empty({0})};
}

std::tuple<at::Tensor, std::vector<at::Tensor>> node_logits_sides_backward(const std::vector<at::Tensor>& grads,
                                                                           const at::Tensor& x,
                                                                           const std::vector<at::Tensor>& atts,
                                                                           bool x_grad, bool att_grad,
                                                                           const at::Tensor& dx_into) {
  TORCH_CHECK_VALUE(grads.size() == atts.size() && (atts.size() == 1 || atts.size() == 2),
                    "edgedot: node logits take one or two sides, a gradient each");
  auto [dx, datt] = logits_grads(grads, x, atts, x_grad, att_grad, dx_into);
  std::vector<at::Tensor> datts(atts.size());
  for (size_t k = 0; k < atts.size() && att_grad; ++k) {
    datts[k] = datt[static_cast<int64_t>(k)].view(atts[k].sizes()).to(atts[k].scalar_type());
  }
  return {dx, datts};
}

}  // namespace edgedot
