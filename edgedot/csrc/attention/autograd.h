// Eager autograd on CUDA of graph attention, GAT, GATv2 and GAT's node logits (attention/autograd.cpp):
// C++ autograd nodes whose backward runs no Python. A backward on autograd's device thread (every
// loss.backward() of a CUDA loss) then neither takes the GIL nor touches the caller's Python
// objects, which cost several times the backward's own host work there.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace edgedot {

// The forward op's arguments (edgedot::graph_attention, gat_attention, gatv2_attention, in that
// order; check_indices replaced by `records`, BACKWARD_RECORDS of edgedot/ops/attention.py), then
// `residual`, added to out as it is stored ([Nd, H, C], or a bias [H, C] or [H * C] for every row, of
// the features' dtype; ResidualScope of attention/attention_ops.h): (out, lse, alpha, rng_state), out
// differentiable in the four feature tensors and the residual.
using AttentionAutograd = std::vector<at::Tensor>(
    at::Tensor a, at::Tensor b, at::Tensor c, c10::optional<at::Tensor> edge, at::Tensor src_idx, at::Tensor dst_idx,
    c10::optional<at::Tensor> dst_group, c10::optional<at::Tensor> dst_offsets, c10::optional<at::Tensor> src_group,
    c10::optional<at::Tensor> src_offsets, double score_arg, double dropout_p, c10::optional<at::Generator> generator,
    bool return_attention, bool records, c10::optional<at::Tensor> residual);

extern AttentionAutograd* const graph_attention_autograd;
extern AttentionAutograd* const gat_attention_autograd;
extern AttentionAutograd* const gatv2_attention_autograd;
// GATConv's logits and attention as one node, (x, att_src, att_dst, a_edge) in the place of (x, a_src,
// a_dst, a_edge): a_src and a_dst are the logits <x[n, h], att[h]> of each side over the one x.
extern AttentionAutograd* const gat_layer_attention_autograd;

// edgedot::gat_node_logits with its gradients.
at::Tensor node_logits_autograd(const at::Tensor& x, const at::Tensor& att);
// A layer's two sides' logits [a_src, a_dst] over one x, each att given apart, with their gradients.
std::vector<at::Tensor> node_logits_sides_autograd(const at::Tensor& x, const at::Tensor& att_src,
                                                   const at::Tensor& att_dst);

}  // namespace edgedot
