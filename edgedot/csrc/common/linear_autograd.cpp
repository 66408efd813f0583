// The layers' linear and bias addition on CUDA with the bias gradient as a column sum
// (common/column_sum_ops.cpp), as C++ autograd nodes: a backward on autograd's device thread then
// runs no Python (edgedot/ops/column_sum.py says when they are taken). Every other gradient is
// computed as PyTorch's addmm and add give it.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "common/torch_common.h"

namespace edgedot {

// A backward that records a graph (create_graph) takes the column-sum op, whose autograd PyTorch runs.
at::Tensor bias_grad(const at::Tensor& grad, const at::Tensor& bias) {
  const at::Tensor rows = grad.reshape({-1, bias.numel()});
  at::Tensor sum;
  if (at::GradMode::is_enabled()) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("edgedot::column_sum", "")
                               .typed<at::Tensor(const at::Tensor&)>();
    sum = op.call(rows).to(bias.scalar_type());
  } else {
    sum = column_sum(rows, bias.scalar_type());  // summed in float32 before any rounding to bias's dtype
  }
  return sum.view(bias.sizes());
}

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias) {
    ctx->save_for_backward({x, weight, bias});
    return at::linear(x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor& grad = grads[0];
    return {ctx->needs_input_grad(0) ? grad.mm(s[1]) : Tensor(),
            ctx->needs_input_grad(1) ? grad.t().mm(s[0]) : Tensor(),
            ctx->needs_input_grad(2) ? bias_grad(grad, s[2]) : Tensor()};
  }
};

// The sides' gradients ([rows, width] or [rows, heads, width / heads] each) as one [rows, sides * width]
// matrix: a view of their buffer where they are its consecutive column blocks (the attention ops'
// packed gradients, attention/attention_ops.h), else stacked, zeros for a side without one.
Tensor joined_sides(const variable_list& grads, int64_t rows, int64_t width, const Tensor& like) {
  const int64_t sides = static_cast<int64_t>(grads.size());
  std::vector<Tensor> flat;
  for (const Tensor& g : grads) flat.push_back(g.defined() ? g.reshape({rows, width}) : Tensor());
  const Tensor& first = flat[0];
  bool packed = rows > 0 && width > 0;
  for (int64_t i = 0; i < sides && packed; ++i) {
    const Tensor& g = flat[i];
    packed = g.defined() && g.scalar_type() == first.scalar_type() && g.stride(0) == sides * width &&
             g.stride(1) == 1 && g.storage().is_alias_of(first.storage()) &&
             g.storage_offset() == first.storage_offset() + i * width;
  }
  if (packed) return first.as_strided({rows, sides * width}, {sides * width, 1});
  for (Tensor& g : flat) {
    if (!g.defined()) g = at::zeros({rows, width}, like.options());
  }
  return at::stack(flat, 1).view({rows, sides * width});
}

// Several F.linear of one x, each weight [width, in] (and its bias [width]) a column block of one
// GEMM's result [rows, sides, heads, width / heads], returned as the blocks' [rows, heads, width /
// heads] views: the layers' projections of one input (TransformerConv's query, key, value and skip,
// GATv2Conv's two sides). The weights are joined inside the node, so that autograd sees no
// concatenation nor views; the backward takes the blocks' gradients joined (joined_sides), without
// a copy where the attention ops wrote them into one buffer, and hands each weight and bias its
// block of the GEMM's and the column sum's result. With cast (autocast), the joined weight and bias
// take x's dtype and their gradients come back in the parameters' own.
struct LinearSidesFunction : torch::autograd::Function<LinearSidesFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, at::TensorList weights, at::TensorList biases,
                               int64_t heads, bool cast) {
    Tensor weight = weights.size() == 1 ? weights[0] : at::cat(weights);
    Tensor bias = biases.empty() ? Tensor() : biases.size() == 1 ? biases[0] : at::cat(biases);
    if (cast) {
      weight = weight.to(x.scalar_type());
      if (bias.defined()) bias = bias.to(x.scalar_type());
    }
    // The parameters themselves too, for a backward that records a graph (create_graph) and must
    // reach them through the concatenation.
    variable_list saved{x, weight, bias};
    saved.insert(saved.end(), weights.begin(), weights.end());
    saved.insert(saved.end(), biases.begin(), biases.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["sides"] = static_cast<int64_t>(weights.size());
    ctx->saved_data["cast"] = cast;
    ctx->set_materialize_grads(false);  // a side without a gradient: zeros in joined_sides
    const int64_t sides = static_cast<int64_t>(weights.size());
    const Tensor y = at::linear(x, weight, bias);
    return y.view({y.size(0), sides, heads, y.size(1) / (sides * heads)}).unbind(1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const int64_t sides = ctx->saved_data["sides"].toInt();
    const bool cast = ctx->saved_data["cast"].toBool(), has_bias = s[2].defined();
    const Tensor& x = s[0];
    const int64_t width = s[1].size(0) / sides;
    Tensor weight = s[1], bias = s[2];
    if (at::GradMode::is_enabled()) {  // create_graph: the joined parameters as recorded ops of the inputs
      weight = at::cat(variable_list(s.begin() + 3, s.begin() + 3 + sides));
      if (has_bias) bias = at::cat(variable_list(s.begin() + 3 + sides, s.end()));
      if (cast) {
        weight = weight.to(x.scalar_type());
        if (has_bias) bias = bias.to(x.scalar_type());
      }
    }
    const Tensor grad = joined_sides(grads, x.size(0), width, x);
    variable_list result(1 + sides * (has_bias ? 2 : 1) + 2);
    if (ctx->needs_input_grad(0)) result[0] = grad.mm(weight);
    bool weight_grad = false, bias_grad_wanted = false;
    for (int64_t i = 0; i < sides; ++i) {
      weight_grad = weight_grad || ctx->needs_input_grad(1 + i);
      bias_grad_wanted = bias_grad_wanted || (has_bias && ctx->needs_input_grad(1 + sides + i));
    }
    // Each parameter's block, in its own dtype (a view where no cast is needed).
    const auto block = [&](const Tensor& joined, int64_t i, const Tensor& param) {
      const Tensor b = joined.narrow(0, i * width, width);
      return b.scalar_type() == param.scalar_type() ? b : b.to(param.scalar_type());
    };
    if (weight_grad) {
      const Tensor dweight = grad.t().mm(x);
      for (int64_t i = 0; i < sides; ++i) {
        if (ctx->needs_input_grad(1 + i)) result[1 + i] = block(dweight, i, s[3 + i]);
      }
    }
    if (bias_grad_wanted) {
      const Tensor dbias = bias_grad(grad, bias);
      for (int64_t i = 0; i < sides; ++i) {
        if (ctx->needs_input_grad(1 + sides + i)) result[1 + sides + i] = block(dbias, i, s[3 + sides + i]);
      }
    }
    return result;
  }
};

struct AddBiasFunction : torch::autograd::Function<AddBiasFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias) {
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->save_for_backward({bias});
    return x + bias;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& grad = grads[0];
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    return {ctx->needs_input_grad(0) ? grad.to(x_dtype) : Tensor(),
            ctx->needs_input_grad(1) ? bias_grad(grad, ctx->get_saved_variables()[0]) : Tensor()};
  }
};

}  // namespace

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return LinearFunction::apply(x, weight, bias);
}

std::vector<at::Tensor> linear_sides_autograd(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                              const std::vector<at::Tensor>& biases, int64_t heads, bool cast) {
  TORCH_CHECK_VALUE(x.dim() == 2, message("edgedot: linear_sides needs a 2-D x, got ", x.sizes()));
  TORCH_CHECK_VALUE(!weights.empty() && heads >= 1, "edgedot: linear_sides needs at least one weight and heads >= 1");
  const at::Tensor& first = weights[0];
  for (const at::Tensor& w : weights) {
    TORCH_CHECK_VALUE(w.dim() == 2 && w.sizes() == first.sizes() && w.size(1) == x.size(1) && w.size(0) % heads == 0,
                      message("edgedot: linear_sides needs weights of one shape [width, ", x.size(1),
                              "] with width a multiple of heads = ", heads, ", got ", w.sizes()));
  }
  TORCH_CHECK_VALUE(biases.empty() || biases.size() == weights.size(),
                    message("edgedot: linear_sides needs no bias or one per weight (", weights.size(), "), got ",
                            biases.size()));
  for (const at::Tensor& b : biases) {
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == first.size(0),
                      message("edgedot: linear_sides needs biases [", first.size(0), "], got ", b.sizes()));
  }
  return LinearSidesFunction::apply(x, at::TensorList(weights), at::TensorList(biases), heads, cast);
}

at::Tensor add_bias_autograd(const at::Tensor& x, const at::Tensor& bias) { return AddBiasFunction::apply(x, bias); }

}  // namespace edgedot
