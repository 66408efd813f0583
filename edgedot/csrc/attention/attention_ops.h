// Graph attention on the torch side (attention/attention_ops.cpp): its forward and backward, and
// the marshalling GAT and GATv2 (attention/gat_ops.cpp) reuse: groupings, chunk schedules,
// partial-row buffers, tensor checks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <vector>

#include "common/edgedot.h"

namespace edgedot {

// ---- Shared with GAT and GATv2 ----

inline at::ScalarType attention_accum(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [rows, heads, dim] with unit stride on dim.
inline Rows attention_rows(const at::Tensor& t) { return Rows{t.data_ptr(), t.size(0), t.stride(0), t.stride(1)}; }

void check_attention_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                            std::initializer_list<int64_t> shape);

AttentionGrouping attention_grouping(const c10::optional<at::Tensor>& group, const at::Tensor& offsets,
                                     const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_edges,
                                     int64_t num_rows, const at::Tensor& q, const char* side);

RowChunks attention_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads, int64_t dim,
                           int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep);

void* attention_partials(const RowChunks& c, int64_t heads, int64_t dim, const at::Tensor& q,
                         std::vector<at::Tensor>& keep);

// ---- The extension's functions ----

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_forward(
    at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double scale, double dropout_p,
    c10::optional<at::Generator> generator, bool return_attention);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad);

}  // namespace edgedot
