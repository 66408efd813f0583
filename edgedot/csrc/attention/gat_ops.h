// GAT and GATv2 attention on the torch side (attention/gat_ops.cpp), on graph attention's
// marshalling (attention/attention_ops.h).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace edgedot {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_forward(
    at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_forward(
    at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward(
    at::Tensor grad_out, at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool a_edge_grad,
    bool src_grad, bool records);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_backward(
    at::Tensor grad_out, at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad,
    bool src_grad, bool records);

// GAT's per-node logits <x[n, h], att[k, h]> for x [N, H, C] and att [H, C] (giving [N, H]) or
// [2, H, C] (both sides of a layer over the same x, giving [2, N, H]), in the promoted dtype; and
// their gradients for grad of that shape: (dx in x's dtype, datt in att's), each an empty tensor
// unless wanted.
at::Tensor node_logits_forward(const at::Tensor& x, const at::Tensor& att);
std::tuple<at::Tensor, at::Tensor> node_logits_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& att, bool x_grad, bool att_grad);
// The same for one or two sides given apart (atts: each of heads x dim elements, any shape): the sides'
// [N, H] logits, and (dx or undefined, each side's att gradient in its att's shape and dtype, or undefined)
// for each side's gradient (undefined: zeros). A defined dx_into (x's shape and dtype, contiguous) has
// dx added to it in place (one rounding) and is returned as dx.
std::vector<at::Tensor> node_logits_sides_forward(const at::Tensor& x, const std::vector<at::Tensor>& atts);
std::tuple<at::Tensor, std::vector<at::Tensor>> node_logits_sides_backward(const std::vector<at::Tensor>& grads,
                                                                           const at::Tensor& x,
                                                                           const std::vector<at::Tensor>& atts,
                                                                           bool x_grad, bool att_grad,
                                                                           const at::Tensor& dx_into = at::Tensor());

}  // namespace edgedot
