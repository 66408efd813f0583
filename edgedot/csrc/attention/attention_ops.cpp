// Graph attention (csrc/attention/: the engine and its score policies). Shapes and dtypes were
// validated in Python (edgedot/ops/attention.py); these checks keep the kernels inside their
// tensors whatever they are given.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

#include "attention/attention_ops.h"
#include "attention/dropout_rng.h"
#include "common/torch_common.h"

namespace edgedot {

void check_attention_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                            std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.device() == q.device(), message("edgedot: ", name, " is on ", t.device(), " but q is on ",
                                                      q.device()));
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), message("edgedot: ", name, " must have shape ",
                                                                 at::IntArrayRef(shape), ", got ", t.sizes()));
}

namespace {

IndexKind index_kind(const at::Tensor& idx) { return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64; }

}  // namespace

bool packed_sides(std::initializer_list<at::Tensor> sides) {
  const at::Tensor& first = *sides.begin();
  if (first.dim() != 3 || first.numel() == 0) return false;
  const int64_t count = static_cast<int64_t>(sides.size()), dim = first.size(2), width = first.size(1) * dim;
  int64_t i = 0;
  for (const at::Tensor& t : sides) {
    if (t.sizes() != first.sizes() || t.scalar_type() != first.scalar_type() || t.stride(0) != count * width ||
        t.stride(1) != dim || t.stride(2) != 1 || !t.storage().is_alias_of(first.storage()) ||
        t.storage_offset() != first.storage_offset() + i * width) {
      return false;
    }
    ++i;
  }
  return true;
}

std::vector<at::Tensor> packed_grads(const at::Tensor& like, int64_t sides) {
  return at::empty({like.size(0), sides, like.size(1), like.size(2)}, like.options()).unbind(1);
}

namespace {
thread_local bool packed_grads_scope = false;
}  // namespace

PackedGradsScope::PackedGradsScope() : outer_(packed_grads_scope) { packed_grads_scope = true; }
PackedGradsScope::~PackedGradsScope() { packed_grads_scope = outer_; }
bool PackedGradsScope::active() { return packed_grads_scope; }

namespace {
thread_local ResidualScope* residual_scope = nullptr;
}  // namespace

ResidualScope::ResidualScope(at::Tensor residual) : residual_(std::move(residual)), outer_(residual_scope) {
  residual_scope = this;
}
ResidualScope::~ResidualScope() { residual_scope = outer_; }

const at::Tensor& ResidualScope::residual() {
  static const at::Tensor none;
  return residual_scope != nullptr ? residual_scope->residual_ : none;
}

void ResidualScope::set_grad(at::Tensor grad) {
  if (residual_scope != nullptr) residual_scope->grad_ = std::move(grad);
}

Rows ResidualScope::rows(const at::Tensor& like, int64_t num_dst, int64_t heads, int64_t dim) {
  if (residual_scope == nullptr || !residual_scope->residual_.defined()) return Rows{};
  const at::Tensor& r = residual_scope->residual_;
  TORCH_CHECK_VALUE(r.scalar_type() == like.scalar_type() && r.device() == like.device(),
                    message("edgedot: residual must be ", like.scalar_type(), " on ", like.device(), ", got ",
                            r.scalar_type(), " on ", r.device()));
  const bool shaped = r.sizes() == at::IntArrayRef({num_dst, heads, dim}) ||
                      r.sizes() == at::IntArrayRef({heads, dim}) || r.sizes() == at::IntArrayRef({heads * dim});
  TORCH_CHECK_VALUE(shaped && (r.stride(-1) == 1 || r.size(-1) == 1),
                    message("edgedot: residual must be [", num_dst, ", ", heads, ", ", dim, "], [", heads, ", ", dim,
                            "] or [", heads * dim, "] with unit stride on the last dim, got ", r.sizes(), " strides ",
                            r.strides()));
  if (r.dim() == 3) return attention_rows(r);
  return Rows{r.data_ptr(), num_dst, 0, r.dim() == 2 ? r.stride(0) : dim};  // a bias: one row for all
}

// A grouping built by edgedot.runtime.plan.build_side (group given), or edges given grouped by the rows of
// row_idx with offsets their CSR pointer (group absent): position i is then edge i.
AttentionGrouping attention_grouping(const c10::optional<at::Tensor>& group, const at::Tensor& offsets,
                                     const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_edges,
                                     int64_t num_rows, const at::Tensor& q, const char* side) {
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == num_rows + 1 &&
                        offsets.is_contiguous() && offsets.device() == q.device(),
                    message("edgedot: ", side, "_offsets must be a contiguous int64 tensor of ", num_rows + 1,
                            " elements on q's device, got ", offsets.scalar_type(), " of shape ", offsets.sizes()));
  if (!group.has_value()) {
    for (const at::Tensor* idx : {&row_idx, &other_idx}) {
      TORCH_CHECK_VALUE(is_index(*idx) && idx->numel() == num_edges && idx->is_contiguous() &&
                            idx->device() == q.device(),
                        message("edgedot: edges given grouped need contiguous int32 or int64 index tensors of E = ",
                                num_edges, " elements on q's device"));
    }
    return AttentionGrouping{nullptr, nullptr, offsets.data_ptr<int64_t>(), row_idx.data_ptr(), other_idx.data_ptr(),
                             index_kind(row_idx), index_kind(other_idx)};
  }
  TORCH_CHECK_VALUE(group->scalar_type() == at::kLong && group->dim() == 1 && group->numel() == 2 * num_edges &&
                        group->is_contiguous() && group->device() == q.device(),
                    message("edgedot: ", side, "_group must be a contiguous int64 tensor of 2 * E = ", 2 * num_edges,
                            " elements on q's device (edgedot.runtime.plan.build_side), got ", group->scalar_type(),
                            " of shape ", group->sizes()));
  const int64_t* p = group->data_ptr<int64_t>();
  return AttentionGrouping{p, reinterpret_cast<const uint64_t*>(p + num_edges), offsets.data_ptr<int64_t>(),
                           nullptr, nullptr, IndexKind::i64, IndexKind::i64};
}

namespace {

// Where each part of a schedule's buffer lies (one allocation, carved).
struct ScheduleLayout {
  int64_t first_chunk, long_rows, temp, keys, order, sort_temp, size;
};

ScheduleLayout schedule_layout(int64_t num_rows, bool ordered, size_t temp_bytes, size_t sort_bytes) {
  Carving carving;
  ScheduleLayout at{};
  at.first_chunk = carving.add((num_rows + 1) * sizeof(int64_t));
  at.long_rows = carving.add((num_rows + 1) * sizeof(int32_t));  // the last entry: their count
  at.temp = carving.add(static_cast<int64_t>(temp_bytes));
  at.keys = ordered ? carving.add(2 * num_rows) : 0;
  at.order = ordered ? carving.add(2 * num_rows * sizeof(int32_t)) : 0;  // row ids, then their order
  at.sort_temp = ordered ? carving.add(static_cast<int64_t>(sort_bytes)) : 0;
  at.size = carving.size();
  return at;
}

// The schedule a buffer of that layout holds.
RowChunks chunks_in(uint8_t* base, const ScheduleLayout& at, int64_t num_rows, int64_t num_edges, int64_t chunk,
                    bool ordered) {
  const int32_t* rows = reinterpret_cast<const int32_t*>(base + at.long_rows);
  const int32_t* row_order = ordered ? reinterpret_cast<const int32_t*>(base + at.order) + num_rows : nullptr;
  return RowChunks{chunk,     reinterpret_cast<const int64_t*>(base + at.first_chunk),
                   rows,      rows + num_rows,
                   attention_max_slots(num_edges, chunk), row_order};
}

thread_local DstScheduleScope* dst_schedule_scope = nullptr;

}  // namespace

// The chunk schedule of a grouping's long rows (RowChunks), its buffer appended to `keep` (alive
// until the kernels are queued; the caching allocator orders its reuse on the stream). None when
// no row can be long.
RowChunks attention_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads, int64_t dim,
                           int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep) {
  const int64_t chunk = attention_chunk_edges(num_edges, heads, dim, dim_v, scalar);
  if (num_edges <= chunk || num_rows == 0) return RowChunks{chunk, nullptr, nullptr, nullptr, 0, nullptr};
  const bool ordered = attention_orders_rows(num_edges, heads);
  const size_t temp_bytes = attention_schedule_temp_bytes(num_rows);
  const size_t sort_bytes = ordered ? attention_row_order_temp_bytes(num_rows) : 0;
  const ScheduleLayout at = schedule_layout(num_rows, ordered, temp_bytes, sort_bytes);
  at::Tensor buffer = at::empty({at.size}, offsets.options().dtype(at::kByte));
  keep.push_back(buffer);
  uint8_t* base = buffer.data_ptr<uint8_t>();
  int64_t* first_chunk = reinterpret_cast<int64_t*>(base + at.first_chunk);
  int32_t* rows = reinterpret_cast<int32_t*>(base + at.long_rows);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t status = launch_attention_schedule(offsets.data_ptr<int64_t>(), num_rows, num_edges, chunk,
                                                       first_chunk, rows, rows + num_rows, base + at.temp, temp_bytes,
                                                       stream);
  TORCH_CHECK(status == cudaSuccess, message("edgedot: building the chunk schedule failed: ",
                                             cudaGetErrorString(status)));
  if (ordered) {
    int32_t* ids = reinterpret_cast<int32_t*>(base + at.order);
    const cudaError_t sorted = launch_attention_row_order(offsets.data_ptr<int64_t>(), num_rows, num_edges, chunk,
                                                          base + at.keys, ids, ids + num_rows, base + at.sort_temp,
                                                          sort_bytes, stream);
    TORCH_CHECK(sorted == cudaSuccess, message("edgedot: ordering the rows by degree failed: ",
                                               cudaGetErrorString(sorted)));
  }
  return chunks_in(base, at, num_rows, num_edges, chunk, ordered);
}

RowChunks attention_dst_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads,
                               int64_t dim, int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep) {
  DstScheduleScope* scope = dst_schedule_scope;
  if (scope != nullptr && scope->given_) {
    const at::Tensor& given = scope->schedule_;
    const int64_t chunk = attention_chunk_edges(num_edges, heads, dim, dim_v, scalar);
    if (given.defined() && chunk == scope->chunk_ && num_edges > chunk && num_rows > 0) {
      const bool ordered = attention_orders_rows(num_edges, heads);
      const ScheduleLayout at =
          schedule_layout(num_rows, ordered, attention_schedule_temp_bytes(num_rows),
                          ordered ? attention_row_order_temp_bytes(num_rows) : 0);
      if (given.numel() == at.size && given.device() == offsets.device()) {
        keep.push_back(given);
        return chunks_in(given.data_ptr<uint8_t>(), at, num_rows, num_edges, chunk, ordered);
      }
    }
  }
  const size_t kept = keep.size();
  RowChunks built = attention_chunks(offsets, num_rows, num_edges, heads, dim, dim_v, scalar, keep);
  if (scope != nullptr && !scope->given_ && keep.size() > kept) {
    scope->schedule_ = keep.back();
    scope->chunk_ = built.chunk;
  }
  return built;
}

DstScheduleScope::DstScheduleScope() : given_(false), outer_(dst_schedule_scope) { dst_schedule_scope = this; }
DstScheduleScope::DstScheduleScope(at::Tensor schedule, int64_t chunk)
    : schedule_(std::move(schedule)), chunk_(chunk), given_(true), outer_(dst_schedule_scope) {
  dst_schedule_scope = this;
}
DstScheduleScope::~DstScheduleScope() { dst_schedule_scope = outer_; }

// Accumulation-type buffers of max_slots x heads x width partial rows, one per part (null where
// its width is 0 or its schedule has no slots), carved out of one allocation.
std::vector<void*> attention_partials(std::initializer_list<PartialRows> parts, int64_t heads, const at::Tensor& q,
                                      std::vector<at::Tensor>& keep) {
  const at::ScalarType accum = attention_accum(q.scalar_type());
  const int64_t element = static_cast<int64_t>(c10::elementSize(accum));
  Carving carving;
  std::vector<int64_t> offsets;
  for (const PartialRows& part : parts) {
    const int64_t bytes = part.chunks->max_slots * heads * part.width * element;
    offsets.push_back(bytes > 0 ? carving.add(bytes) : -1);
  }
  std::vector<void*> buffers(offsets.size(), nullptr);
  if (carving.size() == 0) return buffers;
  keep.push_back(at::empty({carving.size()}, q.options().dtype(at::kByte)));
  uint8_t* base = keep.back().data_ptr<uint8_t>();
  for (size_t i = 0; i < offsets.size(); ++i)
    if (offsets[i] >= 0) buffers[i] = base + offsets[i];
  return buffers;
}

at::Tensor backward_records(int64_t state_bytes, int64_t num_edges, int64_t heads, bool given_grouped,
                            const at::Tensor& q, cudaStream_t stream) {
  at::Tensor state;
  if (state_bytes <= 0) return state;
  try {
    state = at::empty({state_bytes}, q.options().dtype(at::kByte));
  } catch (const c10::OutOfMemoryError&) {
    return state;
  }
  if (given_grouped) {
    const size_t record_bytes =
        static_cast<size_t>(num_edges * heads) * 2 * c10::elementSize(attention_accum(q.scalar_type()));
    C10_CUDA_CHECK(cudaMemsetAsync(state.data_ptr(), 0xFF, record_bytes, stream));
  }
  return state;
}

namespace {

// q, k, v (and edge_feat) with unit stride on the last dim, checked against each other; dropout
// without its rng.
AttentionInputs attention_inputs(at::Tensor& q, at::Tensor& k, at::Tensor& v, c10::optional<at::Tensor>& edge_feat,
                                 int64_t num_edges, double scale, double dropout_p,
                                 c10::optional<at::Tensor>& scale_heads) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || q.scalar_type() == at::kHalf ||
                       q.scalar_type() == at::kBFloat16,
                   message("edgedot: q must be float32, float64, float16 or bfloat16, got ", q.scalar_type()));
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
                    "edgedot: q, k and v must be 3-D CUDA tensors [rows, heads, dim]");
  const int64_t heads = q.size(1), dim = q.size(2), dim_v = v.size(2);
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "edgedot: q, k and v must have one dtype");
  check_attention_tensor(k, "k", q, {k.size(0), heads, dim});
  check_attention_tensor(v, "v", q, {k.size(0), heads, dim_v});
  TORCH_CHECK_VALUE(dim >= 1 && dim <= kAttentionMaxDim && dim_v >= 1 && dim_v <= kAttentionMaxDim,
                    message("edgedot: graph attention on CUDA takes head dims of 1 to ", kAttentionMaxDim, ", got ",
                            dim, " and ", dim_v));
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  // Below 2**31 - 1 rows: the schedule scans num_rows + 1 entries with int32 counts.
  TORCH_CHECK_VALUE(num_edges < kMax32 && q.size(0) < kMax32 && k.size(0) < kMax32,
                    "edgedot: graph attention takes fewer than 2**31 - 1 edges and rows a side");
  q = unit_stride_last(q);
  k = unit_stride_last(k);
  v = unit_stride_last(v);
  Rows ef{nullptr, 0, 0, 0};
  if (edge_feat.has_value()) {
    TORCH_CHECK_VALUE(edge_feat->scalar_type() == q.scalar_type() && edge_feat->dim() == 3,
                      "edgedot: edge_feat must be 3-D with q's dtype");
    check_attention_tensor(*edge_feat, "edge_feat", q, {num_edges, heads, dim});
    TORCH_CHECK_VALUE(dim_v == dim, message("edgedot: edge_feat needs v's head dim equal to q's, got ", dim_v, " and ",
                                            dim));
    edge_feat = unit_stride_last(*edge_feat);
    ef = attention_rows(*edge_feat);
  }
  const void* heads_scale = nullptr;
  if (scale_heads.has_value()) {
    TORCH_CHECK_VALUE(scale_heads->numel() == 1 || (scale_heads->dim() == 1 && scale_heads->size(0) == heads),
                      message("edgedot: beta must hold one value or one per head (", heads, "), got shape ",
                              scale_heads->sizes()));
    TORCH_CHECK_VALUE(scale_heads->device() == q.device(), "edgedot: beta must be on q's device");
    scale_heads = scale_heads->reshape({-1}).expand({heads}).to(q.scalar_type()).contiguous();
    heads_scale = scale_heads->data_ptr();
  }
  return AttentionInputs{attention_rows(q), attention_rows(k), attention_rows(v), ef, num_edges, heads, dim, dim_v,
                         scale, dropout_of(dropout_p), heads_scale};
}

}  // namespace

// Fused graph attention forward over the dst grouping (dst_group absent: edges given sorted by
// destination, dst_offsets their CSR pointer): (out [Nd, H, Dv] in q's dtype, lse [Nd, H] in the
// accumulation dtype (float64 for float64 inputs, else float32), alpha [E, H] before dropout in q's
// dtype, or an empty [0] tensor without return_attention, rng_state: the dropout (seed, offset) drawn
// from generator, int64 [2], or an empty [0] tensor without dropout).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_forward(
    at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double scale, double dropout_p,
    c10::optional<at::Generator> generator, bool return_attention) {
  return attention_forward_scaled(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, scale, dropout_p,
                                  generator, return_attention, c10::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_forward_scaled(
    at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double scale, double dropout_p,
    c10::optional<at::Generator> generator, bool return_attention, c10::optional<at::Tensor> scale_heads) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionInputs in = attention_inputs(q, k, v, edge_feat, num_edges, scale, dropout_p, scale_heads);
  at::Tensor rng_state = at::empty({0}, q.options().dtype(at::kLong));
  if (dropout_p > 0.0) in.dropout.rng = draw_dropout_rng(generator, q, rng_state);
  const int64_t num_dst = q.size(0);
  const ScalarKind scalar = scalar_kind(q.scalar_type());
  std::vector<at::Tensor> keep;
  AttentionForwardArgs args{};
  args.in = in;
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, num_edges, num_dst, q, "dst");
  args.dst_chunks = attention_dst_chunks(dst_offsets, num_dst, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  // No memset: the kernels write every element (rows without edges as zeros, lse -inf).
  at::Tensor out = at::empty({num_dst, in.heads, in.dim_v}, q.options());
  at::Tensor lse = at::empty({num_dst, in.heads}, q.options().dtype(attention_accum(q.scalar_type())));
  const std::vector<int64_t> alpha_shape = return_attention ? std::vector<int64_t>{num_edges, in.heads}
                                                            : std::vector<int64_t>{0};
  at::Tensor alpha = at::empty(alpha_shape, q.options());
  args.out = out.data_ptr();
  args.lse = lse.data_ptr();
  args.alpha = return_attention ? alpha.data_ptr() : nullptr;
  args.residual = ResidualScope::rows(q, num_dst, in.heads, in.dim_v);
  const std::vector<void*> parts = attention_partials({{&args.dst_chunks, in.dim_v}, {&args.dst_chunks, 2}},
                                                      in.heads, q, keep);
  args.part_acc = parts[0];
  args.part_ml = parts[1];
  launch_attention_forward(args, scalar, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, alpha, rng_state};
}

// Its gradients by recomputation from lse: (dq, dk, dv in the inputs' dtype, d_edge_feat [E, H, D]
// with edge_feat_grad, else an empty [0] tensor). The dst pass writes dq, d_edge_feat and
// delta = <grad_out, out> per (n, h); the src pass then writes dk and dv, unless kv_grad is false
// (then dk and dv are empty [0] tensors and src_group, src_offsets are not read). With dropout,
// rng_state is the forward's. records: the dst pass hands the src pass each edge's alpha and ds
// where they fit in memory (else, and without records, the src pass recomputes them; the same
// gradients).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad,
    bool records) {
  const auto grads = attention_backward_scaled(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group,
                                               dst_offsets, src_group, src_offsets, scale, dropout_p, rng_state,
                                               edge_feat_grad, kv_grad, records, c10::nullopt);
  return {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), std::get<3>(grads)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_scaled(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad,
    bool records, c10::optional<at::Tensor> scale_heads) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(q.device());
  // q, k and v's gradients packed as their inputs were (one GEMM's sides); a residual of rows that
  // is the fourth side (TransformerConv's skip connection) gets its gradient, grad_out, beside them.
  const at::Tensor& residual = ResidualScope::residual();
  const bool packed_residual = kv_grad && PackedGradsScope::active() && residual.defined() &&
                               residual.dim() == 3 && !scale_heads.has_value() && packed_sides({q, k, v, residual});
  const bool packed = packed_residual || (kv_grad && PackedGradsScope::active() && packed_sides({q, k, v}));
  AttentionInputs in = attention_inputs(q, k, v, edge_feat, num_edges, scale, dropout_p, scale_heads);
  if (dropout_p > 0.0) in.dropout.rng = recorded_dropout_rng(rng_state, q);
  TORCH_CHECK_VALUE(!edge_feat_grad || edge_feat.has_value(), "edgedot: edge_feat_grad needs edge_feat");
  TORCH_CHECK_VALUE(!kv_grad || (src_group.has_value() && src_offsets.has_value()),
                    "edgedot: kv_grad needs src_group and src_offsets");
  const int64_t num_dst = q.size(0), num_src = k.size(0);
  const at::ScalarType accum = attention_accum(q.scalar_type());
  const ScalarKind scalar = scalar_kind(q.scalar_type());
  check_attention_tensor(grad_out, "grad_out", q, {num_dst, in.heads, in.dim_v});
  check_attention_tensor(out, "out", q, {num_dst, in.heads, in.dim_v});
  check_attention_tensor(lse, "lse", q, {num_dst, in.heads});
  grad_out = grad_out.to(q.scalar_type()).contiguous();
  out = unit_stride_last(out.to(q.scalar_type()));
  lse = lse.to(accum).contiguous();
  std::vector<at::Tensor> keep;
  AttentionBackwardArgs args{};
  args.in = in;
  args.grad_out = attention_rows(grad_out);
  args.out = attention_rows(out);
  args.residual = ResidualScope::rows(q, num_dst, in.heads, in.dim_v);
  args.lse = lse.data_ptr();
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, num_edges, num_dst, q, "dst");
  args.dst_chunks = attention_dst_chunks(dst_offsets, num_dst, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  if (kv_grad) {
    args.src = attention_grouping(src_group, *src_offsets, src_idx, dst_idx, num_edges, num_src, q, "src");
    args.src_chunks = attention_chunks(*src_offsets, num_src, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  }
  // No memsets: every row is written by one team or merge (rows without edges as zeros).
  at::Tensor delta = at::empty({num_dst, in.heads}, q.options().dtype(accum));
  at::Tensor dq, dk, dv;
  if (packed) {
    const std::vector<at::Tensor> sides = packed_grads(q, packed_residual ? 4 : 3);
    dq = sides[0];
    dk = sides[1];
    dv = sides[2];
    args.grad_pack = static_cast<int32_t>(sides.size());
    if (packed_residual) {  // the dst pass copies grad_out into it
      args.residual_grad = sides[3].data_ptr();
      ResidualScope::set_grad(sides[3]);
    }
  } else {
    dq = at::empty({num_dst, in.heads, in.dim}, q.options());
    dk = kv_grad ? at::empty({num_src, in.heads, in.dim}, q.options()) : at::empty({0}, q.options());
    dv = kv_grad ? at::empty({num_src, in.heads, in.dim_v}, q.options()) : at::empty({0}, q.options());
  }
  const std::vector<int64_t> d_edge_feat_shape =
      edge_feat_grad ? std::vector<int64_t>{num_edges, in.heads, in.dim} : std::vector<int64_t>{0};
  at::Tensor d_edge_feat = at::empty(d_edge_feat_shape, q.options());
  args.delta = delta.data_ptr();
  args.dq = dq.data_ptr();
  args.dk = dk.data_ptr();
  args.dv = dv.data_ptr();
  args.d_edge_feat = edge_feat_grad ? d_edge_feat.data_ptr() : nullptr;
  const std::vector<void*> parts = attention_partials(
      {{&args.dst_chunks, in.dim}, {&args.src_chunks, in.dim}, {&args.src_chunks, in.dim_v}}, in.heads, q, keep);
  args.part_dq = parts[0];
  args.part_dk = parts[1];
  args.part_dv = parts[2];
  // A learned scale's gradient: per-unit sums (whole rows, then chunk slots), zero where no unit
  // writes, summed over rows in a fixed order below.
  at::Tensor d_scale_rows = in.scale_heads != nullptr
                                ? at::zeros({num_dst + args.dst_chunks.max_slots, in.heads}, q.options().dtype(accum))
                                : at::empty({0}, q.options().dtype(accum));
  args.d_scale_rows = in.scale_heads != nullptr ? d_scale_rows.data_ptr() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor src_state =
      backward_records(records && kv_grad ? attention_src_state_bytes(args, scalar) : 0, num_edges, in.heads,
                       args.dst.order == nullptr, q, stream);
  args.src_state = src_state.defined() ? src_state.data_ptr() : nullptr;
  launch_attention_backward_dst(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (kv_grad) {
    launch_attention_backward_src(args, scalar, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_attention_backward_merges(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor d_scale = in.scale_heads != nullptr ? d_scale_rows.sum(0) : at::empty({0}, q.options().dtype(accum));
  return {dq, dk, dv, d_edge_feat, d_scale};
}

}  // namespace edgedot
