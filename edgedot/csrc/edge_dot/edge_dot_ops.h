// Edge dot products (SDDMM) on the torch side: the forward, its visit order and one side's gradient
// (edge_dot/edge_dot_ops.cpp), called from Python through edgedot/ops/edge_dot.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace edgedot {

std::tuple<at::Tensor, int64_t> forward(at::Tensor src_feat, at::Tensor dst_feat, at::Tensor src_idx,
                                        at::Tensor dst_idx, bool check_indices);

std::tuple<at::Tensor, bool> edge_order(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows,
                                        int64_t shift);

at::Tensor grad_rows(at::Tensor grad_out, at::Tensor row_feat, at::Tensor other_feat, at::Tensor row_idx,
                     at::Tensor other_idx, c10::optional<at::Tensor> plan, const std::string& reduction);

}  // namespace edgedot
