// The layers' linear and bias addition on CUDA with the bias gradient as a column sum
// (common/column_sum_ops.cpp), as C++ autograd nodes: a backward on autograd's device thread then
// runs no Python (edgedot/ops/column_sum.py says when they are taken). Every other gradient is
// computed as PyTorch's addmm and add give it.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/torch_common.h"

namespace edgedot {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The gradient of a bias broadcast along grad's last dim, in the bias's dtype. A backward that
// records a graph (create_graph) takes the column-sum op, whose autograd PyTorch runs.
Tensor bias_grad(const Tensor& grad, const Tensor& bias) {
  const Tensor rows = grad.reshape({-1, bias.size(0)});
  if (at::GradMode::is_enabled()) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("edgedot::column_sum", "").typed<Tensor(const Tensor&)>();
    return op.call(rows).to(bias.scalar_type());
  }
  return column_sum(rows).to(bias.scalar_type());
}

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

at::Tensor add_bias_autograd(const at::Tensor& x, const at::Tensor& bias) { return AddBiasFunction::apply(x, bias); }

}  // namespace edgedot
