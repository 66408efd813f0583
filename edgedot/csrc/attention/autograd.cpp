// Eager autograd on CUDA of the attention ops (attention/autograd.h): one torch::autograd::Function
// serves graph attention, GAT and GATv2, whose forward and backward take the same arguments; each
// op is a traits struct naming its extension functions and its source-side inputs.
#include "attention/autograd.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>

#include "attention/attention_ops.h"
#include "attention/gat_ops.h"
#include "common/torch_common.h"

namespace edgedot {
namespace {

using at::Tensor;
using OptionalTensor = c10::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;

using ForwardFn = Outputs (*)(Tensor, Tensor, Tensor, OptionalTensor, Tensor, Tensor, OptionalTensor, Tensor, double,
                              double, c10::optional<at::Generator>, bool);
using BackwardFn = Outputs (*)(Tensor, Tensor, Tensor, Tensor, OptionalTensor, Tensor, Tensor, Tensor, Tensor,
                               OptionalTensor, Tensor, OptionalTensor, OptionalTensor, double, double, OptionalTensor,
                               bool, bool, bool);
// The backward op's schema (edgedot/ops/attention.py, gat.py), for a backward that records a graph.
using BackwardOp = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                           const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, double, double,
                           const OptionalTensor&, bool, bool);

// The forward's arguments (AttentionAutograd's), and the positions of those saved for the backward
// (an op's own intermediates follow, from kKept).
constexpr size_t kNumArguments = 16;
constexpr size_t kResidualArgument = 15;
enum Saved { kA, kB, kC, kEdge, kOut, kLse, kSrcIdx, kDstIdx, kDstGroup, kDstOffsets, kSrcGroup, kSrcOffsets, kRng,
             kResidual, kKept };

OptionalTensor present(const Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

// The position of the residual among the forward's tensor inputs, the index needs_input_grad takes:
// absent optional tensors are not inputs of the node.
size_t residual_input(const OptionalTensor& edge, const OptionalTensor& dst_group, const OptionalTensor& dst_offsets,
                      const OptionalTensor& src_group, const OptionalTensor& src_offsets) {
  size_t inputs = 5;  // a, b, c, src_idx, dst_idx
  for (const OptionalTensor* t : {&edge, &dst_group, &dst_offsets, &src_group, &src_offsets}) {
    if (t->has_value() && (*t)->defined()) ++inputs;
  }
  return inputs;
}

// The three feature tensors the kernels take, and the intermediates made for them (saved).
struct KernelInputs {
  Tensor a, b, c;
  std::vector<Tensor> kept;
};

// The gradients of two logit sides over one x (each side's gradient undefined: zeros) through the
// [2, H, C] backward op, whose backward PyTorch records (create_graph): (dx, [datt_src, datt_dst]),
// each undefined unless wanted.
std::tuple<Tensor, std::vector<Tensor>> recorded_sides_grads(const Tensor& grad_src, const Tensor& grad_dst,
                                                             const Tensor& x, const Tensor& att_src,
                                                             const Tensor& att_dst, bool x_grad, bool att_grad) {
  const int64_t heads = x.size(1), dim = x.size(2);
  const Tensor att = at::stack({att_src.reshape({heads, dim}), att_dst.reshape({heads, dim})});
  const Tensor& any = grad_src.defined() ? grad_src : grad_dst;
  const Tensor grad = at::stack({grad_src.defined() ? grad_src : at::zeros_like(any),
                                 grad_dst.defined() ? grad_dst : at::zeros_like(any)});
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("edgedot::gat_node_logits_backward", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, bool, bool)>();
  auto [dx, datt] = op.call(grad, x, att, x_grad, att_grad);
  std::vector<Tensor> datts(2);
  if (att_grad) datts = {datt[0].view(att_src.sizes()), datt[1].view(att_dst.sizes())};
  return {x_grad ? dx : Tensor(), datts};
}

// The op's kernels run on its inputs as given; the kernels' gradients are the inputs'. An op whose
// kernels take tensors made from its inputs (GatLayerFunction) declares these three itself.
struct InputsAsGiven {
  static KernelInputs forward_inputs(const Tensor& a, const Tensor& b, const Tensor& c) { return {a, b, c, {}}; }
  static KernelInputs backward_inputs(const variable_list& s) { return {s[kA], s[kB], s[kC], {}}; }
  static Outputs input_grads(AutogradContext*, const variable_list&, Outputs grads, bool) { return grads; }
};

template <class Op>
struct AttentionFunction : torch::autograd::Function<Op>, InputsAsGiven {
  static variable_list forward(AutogradContext* ctx, Tensor a, Tensor b, Tensor c, OptionalTensor edge,
                               Tensor src_idx, Tensor dst_idx, OptionalTensor dst_group, OptionalTensor dst_offsets,
                               OptionalTensor src_group, OptionalTensor src_offsets, double score_arg,
                               double dropout_p, c10::optional<at::Generator> generator, bool return_attention,
                               bool records, OptionalTensor residual) {
    // Every caller (ops/attention.py's edge_groupings) has grouped the edges by destination.
    TORCH_CHECK(dst_offsets.has_value(), "edgedot: the CUDA autograd path needs the destination grouping");
    const Tensor offsets = dst_offsets->to(at::kLong).contiguous();  // a dst_ptr may be int32
    KernelInputs in = Op::forward_inputs(a, b, c);
    const DstScheduleScope schedule;  // kept for the backward, which takes it instead of building it again
    const ResidualScope epilogue(residual.value_or(Tensor()));  // out = attention + residual, stored at once
    auto [out, lse, alpha, rng_state] = Op::kForward(in.a, in.b, in.c, edge, src_idx.contiguous(),
                                                     dst_idx.contiguous(), dst_group, offsets, score_arg, dropout_p,
                                                     generator, return_attention);
    ctx->saved_data["dst_schedule"] = schedule.schedule();
    ctx->saved_data["dst_chunk"] = schedule.chunk();
    ctx->mark_non_differentiable({lse, alpha, rng_state});
    ctx->set_materialize_grads(false);  // no zeros of E x H for alpha's absent gradient
    variable_list saved{a, b, c, edge.value_or(Tensor()), out, lse, src_idx, dst_idx, dst_group.value_or(Tensor()),
                        offsets, src_group.value_or(Tensor()), src_offsets.value_or(Tensor()), rng_state,
                        residual.value_or(Tensor())};
    saved.insert(saved.end(), in.kept.begin(), in.kept.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["score_arg"] = score_arg;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["records"] = records;
    ctx->saved_data["residual_input"] =
        static_cast<int64_t>(residual_input(edge, dst_group, dst_offsets, src_group, src_offsets));
    return {out, lse, alpha, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kNumArguments);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;  // out's gradient is undefined: so are the inputs'
    const variable_list s = ctx->get_saved_variables();
    const bool edge_grad = s[kEdge].defined() && ctx->needs_input_grad(kEdge);
    bool source_grad = false;
    for (const size_t input : Op::kSourceInputs) source_grad = source_grad || ctx->needs_input_grad(input);
    const double score_arg = ctx->saved_data["score_arg"].toDouble();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const KernelInputs in = Op::backward_inputs(s);
    const bool recorded = at::GradMode::is_enabled();
    Outputs grads_in;
    Tensor epilogue_grad;  // the residual's gradient where the backward wrote it beside the inputs'
    if (recorded) {
      // A backward recording a graph (create_graph): the backward op, with PyTorch's autograd for it.
      static const auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow(Op::kBackwardOp, "").template typed<BackwardOp>();
      // The op's out is the attention's own: without the residual.
      const Tensor& residual = s[kResidual];
      const Tensor out = !residual.defined() ? s[kOut]
                         : residual.dim() == 3 ? s[kOut] - residual
                                               : s[kOut] - residual.reshape({s[kOut].size(1), s[kOut].size(2)});
      grads_in = op.call(grad_out, in.a, in.b, in.c, present(s[kEdge]), out, s[kLse], s[kSrcIdx], s[kDstIdx],
                         present(s[kDstGroup]), s[kDstOffsets], present(s[kSrcGroup]), present(s[kSrcOffsets]),
                         score_arg, dropout_p, s[kRng], edge_grad, source_grad);
    } else {
      OptionalTensor src_group = present(s[kSrcGroup]);
      Tensor src_offsets = s[kSrcOffsets];
      if (source_grad && !src_offsets.defined()) {
        std::tie(src_group, src_offsets) = group_edges(s[kSrcIdx], s[kDstIdx], Op::sources(in.a, in.b, in.c).size(0),
                                                       Op::destinations(in.a, in.b, in.c).size(0));
      }
      const PackedGradsScope packed;  // the gradients go to autograd only
      const DstScheduleScope schedule(ctx->saved_data["dst_schedule"].toTensor(), ctx->saved_data["dst_chunk"].toInt());
      const ResidualScope epilogue(s[kResidual]);  // out holds the attention plus it
      grads_in = Op::kBackward(grad_out, in.a, in.b, in.c, present(s[kEdge]), s[kOut], s[kLse],
                               s[kSrcIdx].contiguous(), s[kDstIdx].contiguous(), present(s[kDstGroup]),
                               s[kDstOffsets], src_group, present(src_offsets), score_arg, dropout_p, s[kRng],
                               edge_grad, source_grad, ctx->saved_data["records"].toBool());
      epilogue_grad = epilogue.grad();
    }
    grads_in = Op::input_grads(ctx, s, std::move(grads_in), recorded);
    const Tensor* wanted[] = {&std::get<0>(grads_in), &std::get<1>(grads_in), &std::get<2>(grads_in),
                              &std::get<3>(grads_in)};
    for (size_t i = 0; i < 4; ++i) {
      if (i < kEdge || s[kEdge].defined()) result[i] = ctx->needs_input_grad(i) ? *wanted[i] : Tensor();
    }
    const Tensor& residual = s[kResidual];
    if (residual.defined() && ctx->needs_input_grad(ctx->saved_data["residual_input"].toInt())) {
      result[kResidualArgument] = residual.dim() != 3         ? bias_grad(grad_out, residual)
                                  : epilogue_grad.defined() ? epilogue_grad
                                                            : grad_out;
    }
    return result;
  }
};

// Each op: its extension functions, its source-side inputs (whose gradients walk the edges by
// source), and which inputs have a row per source and per destination node.
struct GraphAttentionFunction : AttentionFunction<GraphAttentionFunction> {  // q, k, v, edge_feat
  static constexpr ForwardFn kForward = attention_forward;
  static constexpr BackwardFn kBackward = attention_backward;
  static constexpr const char* kBackwardOp = "edgedot::graph_attention_backward";
  static constexpr size_t kSourceInputs[] = {kB, kC};
  static const Tensor& sources(const Tensor&, const Tensor& k, const Tensor&) { return k; }
  static const Tensor& destinations(const Tensor& q, const Tensor&, const Tensor&) { return q; }
};

struct GatAttentionFunction : AttentionFunction<GatAttentionFunction> {  // x, a_src, a_dst, a_edge
  static constexpr ForwardFn kForward = gat_forward;
  static constexpr BackwardFn kBackward = gat_backward;
  static constexpr const char* kBackwardOp = "edgedot::gat_attention_backward";
  static constexpr size_t kSourceInputs[] = {kA, kB};
  static const Tensor& sources(const Tensor& x, const Tensor&, const Tensor&) { return x; }
  static const Tensor& destinations(const Tensor&, const Tensor&, const Tensor& a_dst) { return a_dst; }
};

struct Gatv2AttentionFunction : AttentionFunction<Gatv2AttentionFunction> {  // x_src, x_dst, att, edge_feat
  static constexpr ForwardFn kForward = gatv2_forward;
  static constexpr BackwardFn kBackward = gatv2_backward;
  static constexpr const char* kBackwardOp = "edgedot::gatv2_attention_backward";
  static constexpr size_t kSourceInputs[] = {kA};
  static const Tensor& sources(const Tensor& x_src, const Tensor&, const Tensor&) { return x_src; }
  static const Tensor& destinations(const Tensor&, const Tensor& x_dst, const Tensor&) { return x_dst; }
};

// GATConv's logits and attention in one node: the logits of att_src and att_dst over x (read once),
// then GAT attention with x as values; its backward adds the logits' dx into the attention's in the
// logits' kernel. (x, att_src, att_dst, a_edge): one x for both sides, all of one dtype.
struct GatLayerFunction : AttentionFunction<GatLayerFunction> {
  static constexpr ForwardFn kForward = gat_forward;
  static constexpr BackwardFn kBackward = gat_backward;
  static constexpr const char* kBackwardOp = "edgedot::gat_attention_backward";
  static constexpr size_t kSourceInputs[] = {kA, kB};  // x, and att_src through a_src
  static const Tensor& sources(const Tensor& x, const Tensor&, const Tensor&) { return x; }
  static const Tensor& destinations(const Tensor& x, const Tensor&, const Tensor&) { return x; }

  static KernelInputs forward_inputs(const Tensor& x, const Tensor& att_src, const Tensor& att_dst) {
    const std::vector<Tensor> logits = node_logits_sides_forward(x, {att_src, att_dst});
    return {x, logits[0], logits[1], logits};
  }

  static KernelInputs backward_inputs(const variable_list& s) { return {s[kA], s[kKept], s[kKept + 1], {}}; }

  // (dx, da_src, da_dst, da_edge) -> (dx, datt_src, datt_dst, da_edge).
  static Outputs input_grads(AutogradContext* ctx, const variable_list& s, Outputs grads, bool recorded) {
    auto& [dx, da_src, da_dst, da_edge] = grads;
    const bool x_grad = ctx->needs_input_grad(kA), att_grad = ctx->needs_input_grad(kB) || ctx->needs_input_grad(kC);
    if (!x_grad && !att_grad) return {Tensor(), Tensor(), Tensor(), da_edge};
    // Without source_grad (neither x nor att_src wants a gradient) da_src is an empty tensor.
    const Tensor grad_src = ctx->needs_input_grad(kA) || ctx->needs_input_grad(kB) ? da_src : Tensor();
    Tensor logits_dx;
    std::vector<Tensor> datts;
    if (recorded) {
      std::tie(logits_dx, datts) = recorded_sides_grads(grad_src, da_dst, s[kA], s[kB], s[kC], x_grad, att_grad);
      if (x_grad) logits_dx = dx + logits_dx;
    } else {
      std::tie(logits_dx, datts) =
          node_logits_sides_backward({grad_src, da_dst}, s[kA], {s[kB], s[kC]}, x_grad, att_grad, x_grad ? dx : Tensor());
    }
    return {logits_dx, att_grad ? datts[0] : Tensor(), att_grad ? datts[1] : Tensor(), da_edge};
  }
};

struct NodeLogitsFunction : torch::autograd::Function<NodeLogitsFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& att) {
    ctx->save_for_backward({x, att});
    return node_logits_forward(x, att);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const bool x_grad = ctx->needs_input_grad(0), att_grad = ctx->needs_input_grad(1);
    std::tuple<Tensor, Tensor> grads_in;
    if (at::GradMode::is_enabled()) {  // create_graph: the backward op, as for the attention ops
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("edgedot::gat_node_logits_backward", "")
                                 .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, bool,
                                                                   bool)>();
      grads_in = op.call(grads[0], s[0], s[1], x_grad, att_grad);
    } else {
      grads_in = node_logits_backward(grads[0], s[0], s[1], x_grad, att_grad);
    }
    return {x_grad ? std::get<0>(grads_in) : Tensor(), att_grad ? std::get<1>(grads_in) : Tensor()};
  }
};

// GATConv's logits of its two sides over one x, each side's att given apart (any shape of H x C
// elements, the layer's [1, H, C] parameters): no [2, H, C] concatenation in the forward nor stacking
// of the sides' gradients in the backward.
struct NodeLogitsSidesFunction : torch::autograd::Function<NodeLogitsSidesFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& att_src, const Tensor& att_dst) {
    ctx->save_for_backward({x, att_src, att_dst});
    ctx->set_materialize_grads(false);  // a side without a gradient adds nothing
    return node_logits_sides_forward(x, {att_src, att_dst});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() && !grads[1].defined()) return {Tensor(), Tensor(), Tensor()};
    const variable_list s = ctx->get_saved_variables();
    const bool x_grad = ctx->needs_input_grad(0), att_grad = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    Tensor dx;
    std::vector<Tensor> datts(2);
    if (at::GradMode::is_enabled()) {
      std::tie(dx, datts) = recorded_sides_grads(grads[0], grads[1], s[0], s[1], s[2], x_grad, att_grad);
    } else {
      std::tie(dx, datts) = node_logits_sides_backward({grads[0], grads[1]}, s[0], {s[1], s[2]}, x_grad, att_grad);
    }
    return {x_grad ? dx : Tensor(), ctx->needs_input_grad(1) ? datts[0] : Tensor(),
            ctx->needs_input_grad(2) ? datts[1] : Tensor()};
  }
};

// The extension's entry point of each op: its Function applied.
template <class Function>
std::vector<Tensor> apply_attention(Tensor a, Tensor b, Tensor c, OptionalTensor edge, Tensor src_idx, Tensor dst_idx,
                                    OptionalTensor dst_group, OptionalTensor dst_offsets, OptionalTensor src_group,
                                    OptionalTensor src_offsets, double score_arg, double dropout_p,
                                    c10::optional<at::Generator> generator, bool return_attention, bool records,
                                    OptionalTensor residual) {
  return Function::apply(a, b, c, edge, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets, score_arg,
                         dropout_p, generator, return_attention, records, residual);
}

}  // namespace

AttentionAutograd* const graph_attention_autograd = apply_attention<GraphAttentionFunction>;
AttentionAutograd* const gat_attention_autograd = apply_attention<GatAttentionFunction>;
AttentionAutograd* const gatv2_attention_autograd = apply_attention<Gatv2AttentionFunction>;
AttentionAutograd* const gat_layer_attention_autograd = apply_attention<GatLayerFunction>;

at::Tensor node_logits_autograd(const at::Tensor& x, const at::Tensor& att) {
  return NodeLogitsFunction::apply(x, att);
}

std::vector<at::Tensor> node_logits_sides_autograd(const at::Tensor& x, const at::Tensor& att_src,
                                                   const at::Tensor& att_dst) {
  return NodeLogitsSidesFunction::apply(x, att_src, att_dst);
}

}  // namespace edgedot
