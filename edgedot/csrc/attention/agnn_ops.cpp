// AGNN on the attention engine's CosineScore: graph attention with x_norm as queries and keys, x as
// values and a learned per-head scale beta (attention/attention_ops.cpp does the marshalling).
#include "attention/attention_ops.h"

namespace edgedot {

std::tuple<at::Tensor, at::Tensor, at::Tensor> agnn_forward(at::Tensor x_norm, at::Tensor x, at::Tensor beta,
                                                            at::Tensor src_idx, at::Tensor dst_idx,
                                                            c10::optional<at::Tensor> dst_group,
                                                            at::Tensor dst_offsets, bool return_attention) {
  const auto result = attention_forward_scaled(x_norm, x_norm, x, c10::nullopt, src_idx, dst_idx, dst_group,
                                               dst_offsets, 1.0, 0.0, c10::nullopt, return_attention, beta);
  return {std::get<0>(result), std::get<1>(result), std::get<2>(result)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> agnn_backward(
    at::Tensor grad_out, at::Tensor x_norm, at::Tensor x, at::Tensor beta, at::Tensor out, at::Tensor lse,
    at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets,
    at::Tensor src_group, at::Tensor src_offsets, bool records) {
  const auto grads = attention_backward_scaled(grad_out, x_norm, x_norm, x, c10::nullopt, out, lse, src_idx, dst_idx,
                                               dst_group, dst_offsets, src_group, src_offsets, 1.0, 0.0,
                                               c10::nullopt, false, true, records, beta);
  // x_norm is both the queries and the keys: its gradient is the sum of theirs.
  return {std::get<0>(grads) + std::get<1>(grads), std::get<2>(grads), std::get<4>(grads)};
}

}  // namespace edgedot
