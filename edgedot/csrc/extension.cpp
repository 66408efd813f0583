// The extension's module: the functions of each op family (common/, edge_dot/, attention/), which
// turn tensors into the plain arguments of the CUDA kernels (common/edgedot.h).
#include <torch/extension.h>

#include "attention/attention_ops.h"
#include "attention/autograd.h"
#include "attention/gat_ops.h"
#include "common/torch_common.h"
#include "edge_dot/edge_dot_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &edgedot::forward, "edge dot products (CUDA)");
  m.def("edge_order", &edgedot::edge_order, "the forward's visit order of the edges, for tests (CUDA)");
  m.def("group_edges", &edgedot::group_edges,
        "edgedot.runtime.plan.build_side and group_offsets in one sort and one kernel: (packed, offsets) (CUDA)");
  m.def("group_edges_both", &edgedot::group_edges_both,
        "group_edges by row_idx and by other_idx from one sort: (packed, offsets, other_packed, other_offsets) (CUDA)");
  m.def("graph_flags", &edgedot::graph_flags,
        "src_idx, dst_idx and dst_ptr validated in one kernel, no wait: int32 flags of failed conditions (CUDA)");
  m.def("graph_check_launch", &edgedot::graph_check_launch,
        "the deferred check of the parts of a graph not remembered, its flags written into pinned host_flags: "
        "the parts launched as bits 1 (src_idx), 2 (dst_idx), 4 (dst_ptr) (CUDA)");
  m.def("group_edges_checked", &edgedot::group_edges_checked,
        "group_edges(dst_idx, src_idx, ...) (group_edges_both with both) whose kernel also runs graph_check_launch's "
        "range checks into pinned host_flags: (groupings, parts checked as graph_check_launch's bits) (CUDA)");
  m.def("self_looped_checked", &edgedot::self_looped_checked,
        "edge_index [2, E] with each self-loop's destination set to `dropped` and the loops of nodes 0 .. "
        "num_nodes - 1 appended, as the kernels take it, its kernel also running graph_check_launch's range checks "
        "of the two rows into pinned host_flags: (src, dst [E + num_nodes], parts checked) (CUDA)");
  m.def("graph_check_forget", &edgedot::graph_check_forget,
        "forgets the parts of a graph graph_check_launch remembered, for a bad verdict (CUDA)");
  m.def("column_sum", [](const at::Tensor& x) { return edgedot::column_sum(x); },
        "x [rows, width] summed over rows in an order fixed by the shape: [width] in x's dtype (CUDA)");
  m.def("linear_autograd", &edgedot::linear_autograd,
        "F.linear with a C++ autograd node whose bias gradient is column_sum (CUDA)");
  m.def("linear_sides_autograd", &edgedot::linear_sides_autograd,
        "one GEMM of x by several weights, each weight's column block a [rows, heads, width / heads] view; "
        "gradients joined without a copy where they are one buffer's column blocks (CUDA)");
  m.def("add_bias_autograd", &edgedot::add_bias_autograd,
        "x + bias with a C++ autograd node whose bias gradient is column_sum (CUDA)");
  m.def("grad_rows", &edgedot::grad_rows, "gradient of edge dot products for one side (CUDA)");
  m.def("attention_forward", &edgedot::attention_forward,
        "fused graph attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("attention_backward", &edgedot::attention_backward,
        "gradients of fused graph attention: (dq, dk, dv, d_edge_feat) (CUDA)");
  m.def("agnn_forward", &edgedot::agnn_forward,
        "fused AGNN attention (cosine score, learned per-head scale): (out, lse, alpha) (CUDA)");
  m.def("agnn_backward", &edgedot::agnn_backward,
        "gradients of fused AGNN attention: (d_x_norm, dx, d_beta) (CUDA)");
  m.def("gat_forward", &edgedot::gat_forward,
        "fused GAT attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gatv2_forward", &edgedot::gatv2_forward,
        "fused GATv2 attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gat_backward", &edgedot::gat_backward,
        "gradients of fused GAT attention: (dx, da_src, da_dst, da_edge) (CUDA)");
  m.def("graph_attention_autograd", edgedot::graph_attention_autograd,
        "edgedot::graph_attention's forward with a C++ autograd node: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gat_attention_autograd", edgedot::gat_attention_autograd,
        "edgedot::gat_attention's forward with a C++ autograd node: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gatv2_attention_autograd", edgedot::gatv2_attention_autograd,
        "edgedot::gatv2_attention's forward with a C++ autograd node: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gat_layer_attention_autograd", edgedot::gat_layer_attention_autograd,
        "gat_attention_autograd taking (x, att_src, att_dst, a_edge): GATConv's two sides' logits over x and its "
        "attention in one C++ autograd node (CUDA)");
  m.def("node_logits_autograd", &edgedot::node_logits_autograd,
        "edgedot::gat_node_logits with a C++ autograd node (CUDA)");
  m.def("node_logits_sides_autograd", &edgedot::node_logits_sides_autograd,
        "GATConv's [a_src, a_dst] logits over one x, att_src and att_dst given apart, with a C++ autograd node "
        "(CUDA)");
  m.def("node_logits_forward", &edgedot::node_logits_forward,
        "GAT's per-node logits <x[n, h], att[k, h]>: [N, H] or [2, N, H] in the promoted dtype (CUDA)");
  m.def("node_logits_backward", &edgedot::node_logits_backward,
        "gradients of GAT's per-node logits: (dx, datt), each empty unless wanted (CUDA)");
  m.def("gatv2_backward", &edgedot::gatv2_backward,
        "gradients of fused GATv2 attention: (dx_src, dx_dst, datt, d_edge_feat) (CUDA)");
}
