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

// The sides' gradients as one [rows, sides * width] matrix: a view of their buffer where they are its
// consecutive column blocks (the attention ops' packed gradients, attention/attention_ops.h), else
// stacked, zeros for a side without one.
Tensor joined_sides(const variable_list& grads, int64_t rows, int64_t width, const Tensor& like) {
  const int64_t sides = static_cast<int64_t>(grads.size());
  const Tensor& first = grads[0];
  bool packed = rows > 0 && width > 0;
  for (int64_t i = 0; i < sides && packed; ++i) {
    const Tensor& g = grads[i];
    packed = g.defined() && g.dim() == 2 && g.size(0) == rows && g.size(1) == width &&
             g.scalar_type() == first.scalar_type() && g.stride(0) == sides * width && g.stride(1) == 1 &&
             g.storage().is_alias_of(first.storage()) && g.storage_offset() == first.storage_offset() + i * width;
  }
  if (packed) return first.as_strided({rows, sides * width}, {sides * width, 1});
  std::vector<Tensor> filled;
  for (const Tensor& g : grads) filled.push_back(g.defined() ? g : at::zeros({rows, width}, like.options()));
  return at::stack(filled, 1).view({rows, sides * width});
}

// F.linear split into `sides` equal column blocks, returned as [rows, width] views of its result: the
// layers' projections of one input by one GEMM (TransformerConv's query, key and value, GATv2Conv's
// two sides). Its backward takes their gradients joined (joined_sides), so that gradients the
// attention ops wrote into one buffer reach the GEMMs without the copy unbind's backward makes.
struct LinearSidesFunction : torch::autograd::Function<LinearSidesFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               int64_t sides) {
    ctx->save_for_backward({x, weight, bias});
    ctx->saved_data["sides"] = sides;
    ctx->set_materialize_grads(false);  // a side without a gradient: zeros in joined_sides
    const Tensor y = at::linear(x, weight, bias);
    return y.view({y.size(0), sides, y.size(1) / sides}).unbind(1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const int64_t sides = ctx->saved_data["sides"].toInt();
    const Tensor grad = joined_sides(grads, s[0].size(0), s[1].size(0) / sides, s[0]);
    return {ctx->needs_input_grad(0) ? grad.mm(s[1]) : Tensor(),
            ctx->needs_input_grad(1) ? grad.t().mm(s[0]) : Tensor(),
            ctx->needs_input_grad(2) ? bias_grad(grad, s[2]) : Tensor(), Tensor()};
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

std::vector<at::Tensor> linear_sides_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                              int64_t sides) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && sides >= 1 && weight.size(0) % sides == 0,
                    message("edgedot: linear_sides needs a 2-D x and a weight whose rows split into ", sides,
                            " sides"));
  return LinearSidesFunction::apply(x, weight, bias, sides);
}

at::Tensor add_bias_autograd(const at::Tensor& x, const at::Tensor& bias) { return AddBiasFunction::apply(x, bias); }

}  // namespace edgedot
