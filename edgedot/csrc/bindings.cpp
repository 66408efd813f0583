// PyTorch side of the CUDA path: tensor checks, layouts, allocation, streams, index errors.
// Shapes and dtypes were validated in Python (edgedot/_checks.py) before these are called.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <unordered_map>
#include <mutex>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/edgedot.h"

namespace edgedot {
namespace {

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::f32;
    case at::kDouble: return ScalarKind::f64;
    case at::kHalf: return ScalarKind::f16;
    case at::kBFloat16: return ScalarKind::bf16;
    default: TORCH_CHECK_TYPE(false, "edgedot: unsupported feature dtype ", t);
  }
}

IndexKind index_kind(const at::Tensor& idx, const char* name) {
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, name,
                   " must be int32 or int64, got ", idx.scalar_type());
  return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
}

at::Tensor unit_stride_last(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

int64_t heads_of(const at::Tensor& feat) { return feat.dim() == 3 ? feat.size(1) : 1; }

// Node and head strides of a [N, D] or [N, H, D] tensor; one head broadcasts with stride 0.
Rows rows_of(const at::Tensor& feat) {
  const bool one_head = heads_of(feat) == 1;
  return Rows{feat.data_ptr(), feat.size(0), feat.stride(0), one_head ? 0 : feat.stride(1)};
}

// Two host ints the kernel can write (mapped, pinned), one pair per thread: each checked call
// zeroes them, launches, and reads them after synchronising, so calls never share a pair.
int* host_error_flags() {
  thread_local int* flags = nullptr;
  if (flags == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags), 2 * sizeof(int),
                                 cudaHostAllocMapped | cudaHostAllocPortable));
  }
  return flags;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

bool is_feature_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool is_index(const at::Tensor& idx) {
  return (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong) && idx.dim() == 1;
}

// The argument rules of edgedot/_checks.py:check_inputs, as a predicate: the eager path asks
// here first (cheaper than Python), and Python's check_inputs words the error when it fails.
bool valid_inputs(const at::Tensor& src_feat, const at::Tensor& dst_feat, const at::Tensor& src_idx,
                  const at::Tensor& dst_idx) {
  const auto device = src_feat.device();
  const int64_t src_heads = heads_of(src_feat), dst_heads = heads_of(dst_feat);
  return (src_feat.dim() == 2 || src_feat.dim() == 3) && (dst_feat.dim() == 2 || dst_feat.dim() == 3) &&
         is_feature_dtype(src_feat.scalar_type()) && src_feat.scalar_type() == dst_feat.scalar_type() &&
         src_feat.size(-1) == dst_feat.size(-1) &&
         (src_heads == dst_heads || src_heads == 1 || dst_heads == 1) && is_index(src_idx) && is_index(dst_idx) &&
         src_idx.size(0) == dst_idx.size(0) && dst_feat.device() == device && src_idx.device() == device &&
         dst_idx.device() == device;
}

// Host ints the graph check's flags are copied into (pinned, so the copy is a plain DMA), one set
// per thread.
int* host_graph_flags() {
  thread_local int* flags = nullptr;
  if (flags == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags), kGraphCheckFlags * sizeof(int),
                                 cudaHostAllocPortable));
  }
  return flags;
}

IndexKind kind_of(const at::Tensor& idx) { return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64; }

}  // namespace

// Every condition of edgedot/_checks.py:check_graph on the device in one kernel, then one copy of
// the flags to the host and one wait for the stream: bit k of the result is set when condition k
// of GraphCheckFlag fails (the pointer's bits only with dst_ptr, the ranges' only when asked).
int64_t check_graph(const at::Tensor& src_idx, int64_t num_src, const at::Tensor& dst_idx, int64_t num_dst,
                    const c10::optional<at::Tensor>& dst_ptr, bool check_src, bool check_dst) {
  TORCH_CHECK_VALUE(is_index(src_idx) && is_index(dst_idx) && src_idx.size(0) == dst_idx.size(0) && src_idx.is_cuda() &&
                        dst_idx.device() == src_idx.device(),
                    "edgedot: check_graph needs src_idx and dst_idx 1-D int32 or int64 of one length on one CUDA "
                    "device");
  TORCH_CHECK_VALUE(num_src >= 0 && num_dst >= 0, "edgedot: check_graph needs non-negative node counts");
  if (dst_ptr.has_value()) {
    TORCH_CHECK_VALUE(is_index(*dst_ptr) && dst_ptr->size(0) == num_dst + 1 && dst_ptr->device() == src_idx.device(),
                      "edgedot: check_graph needs dst_ptr 1-D int32 or int64 of num_dst + 1 elements on the indices' "
                      "device");
  }
  const c10::cuda::CUDAGuard guard(src_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(!stream_capturing(stream), "edgedot: check_graph waits for the device, which CUDA graph capture forbids");
  at::Tensor flags = at::empty({kGraphCheckFlags}, src_idx.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(flags.data_ptr<int>(), 0, kGraphCheckFlags * sizeof(int), stream));
  const bool has_ptr = dst_ptr.has_value();
  GraphCheckArgs args{src_idx.data_ptr(),
                      dst_idx.data_ptr(),
                      has_ptr ? dst_ptr->data_ptr() : nullptr,
                      src_idx.stride(0),
                      dst_idx.stride(0),
                      has_ptr ? dst_ptr->stride(0) : 1,
                      src_idx.size(0),
                      num_src,
                      num_dst,
                      check_src,
                      check_dst,
                      flags.data_ptr<int>()};
  launch_check_graph(args, kind_of(src_idx), kind_of(dst_idx), has_ptr ? kind_of(*dst_ptr) : IndexKind::i64, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  int* host = host_graph_flags();
  C10_CUDA_CHECK(cudaMemcpyAsync(host, flags.data_ptr<int>(), kGraphCheckFlags * sizeof(int), cudaMemcpyDeviceToHost,
                                 stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t mask = 0;
  for (int k = 0; k < kGraphCheckFlags; ++k) {
    if (host[k] != 0) mask |= int64_t{1} << k;
  }
  return mask;
}

namespace {

// Index tensors a checked forward found in range, each remembered until its memory changes, by the
// rule of edgedot/_checks.py:TensorMemo: keyed on the tensor's base (itself, or the tensor a view
// views, which shares its version counter) and the view's place in it, so edge_index[0], a new
// view every call, finds the previous call's entry; valid while that base lives, keeps its memory
// and its version. Repeated calls on one graph then neither check nor wait. Here rather than in
// Python, where the lookup cost as much host time as a quarter of a small call.
class InRangeMemo {
 public:
  // Whether idx was found in range for at most num_rows rows and is unchanged since.
  bool covers(const at::Tensor& idx, int64_t num_rows) {
    if (idx.is_inference()) return false;  // no version counter: checked every call
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(key_of(idx, base));
    return it != entries_.end() && !it->second.base.expired() && it->second.version == idx._version() &&
           it->second.data == idx.data_ptr() && it->second.num_rows <= num_rows;
  }

  void add(const at::Tensor& idx, int64_t num_rows) {
    if (idx.is_inference()) return;
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() >= sweep_at_) {
      for (auto it = entries_.begin(); it != entries_.end();) it = it->second.base.expired() ? entries_.erase(it) : ++it;
      sweep_at_ = std::max<size_t>(kFirstSweep, 2 * entries_.size());
    }
    // The weak reference keeps a dead base's TensorImpl, part of the key, from being reused until
    // its entry is swept: a new tensor in freed memory never matches.
    entries_.insert_or_assign(key_of(idx, base),
                              Entry{WeakImpl(base.getIntrusivePtr()), idx._version(), idx.data_ptr(), num_rows});
  }

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // (base, storage offset, length, stride, dtype): index tensors are 1-D (valid_inputs).
  using Key = std::tuple<const c10::TensorImpl*, int64_t, int64_t, int64_t, int>;
  struct KeyHash {
    size_t operator()(const Key& k) const {
      size_t h = std::hash<const void*>()(std::get<0>(k));
      for (const int64_t x : {std::get<1>(k), std::get<2>(k), std::get<3>(k), int64_t{std::get<4>(k)}}) {
        h = h * 1000003u ^ std::hash<int64_t>()(x);
      }
      return h;
    }
  };
  struct Entry {
    WeakImpl base;
    int64_t version;
    const void* data;
    int64_t num_rows;
  };
  static const at::TensorBase& base_of(const at::Tensor& idx) { return idx.is_view() ? idx._base() : idx; }
  static Key key_of(const at::Tensor& idx, const at::TensorBase& base) {
    return {base.unsafeGetTensorImpl(), idx.storage_offset(), idx.size(0), idx.stride(0),
            static_cast<int>(idx.scalar_type())};
  }
  static constexpr size_t kFirstSweep = 1024;
  std::mutex mutex_;
  std::unordered_map<Key, Entry, KeyHash> entries_;
  size_t sweep_at_ = kFirstSweep;
};

InRangeMemo& in_range_memo() {
  static InRangeMemo memo;
  return memo;
}

// Launches launch_edge_order: returns [num_edges] positions followed by its workspace, whose first
// int is the used flag.
at::Tensor edge_order_buffer(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows, int shift,
                             cudaStream_t stream) {
  const int64_t num_edges = row_idx.size(0);
  const int buckets = static_cast<int>(((num_rows - 1) >> shift) + 1);
  at::Tensor buffer = at::empty({num_edges + edge_order_workspace_ints(buckets)}, row_idx.options().dtype(at::kInt));
  int32_t* order = buffer.data_ptr<int32_t>();
  launch_edge_order(row_idx.data_ptr(), index_kind(row_idx, "row_idx"), other_idx.data_ptr(),
                    index_kind(other_idx, "other_idx"), num_edges, num_rows, shift, order, order + num_edges, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return buffer;
}

// Shuffled edges read both sides' rows once per edge. Grouped by row range of the side with more
// row bytes (edge_order.cu), that side's rows come from DRAM about once each, for the cost of the
// grouping passes, of one more load in each edge's chain of dependent loads, and of index reads and
// output writes scattered by the new order. Measured on an H200 (NOTES.md): 7-23% faster with 880
// to 3800 bytes saved per edge while the per-edge arrays (indices, output, order) fit in twice the
// L2; no faster with 490 saved; no faster, or up to 22% slower, on larger arrays. Taken when that
// side overflows half of L2, saves more than kOrderMinSavedBytes per edge, and the per-edge arrays
// fit in twice the L2.
constexpr int64_t kOrderMinSavedBytes = 640;
constexpr int64_t kOrderMinEdges = int64_t{1} << 16;

struct OrderChoice {
  bool by_src;
  int shift;  // buckets of 2**shift rows
};

c10::optional<OrderChoice> choose_edge_order(const at::Tensor& src_feat, const at::Tensor& dst_feat,
                                             const at::Tensor& src_idx, const at::Tensor& dst_idx,
                                             const at::Tensor& out) {
  const int64_t num_edges = src_idx.size(0);
  if (num_edges < kOrderMinEdges || num_edges >= std::numeric_limits<int32_t>::max()) return c10::nullopt;
  const int64_t dim_bytes = src_feat.size(-1) * src_feat.element_size();
  const int64_t src_row_bytes = heads_of(src_feat) * dim_bytes, dst_row_bytes = heads_of(dst_feat) * dim_bytes;
  const bool by_src = src_feat.size(0) * src_row_bytes >= dst_feat.size(0) * dst_row_bytes;
  const int64_t num_rows = by_src ? src_feat.size(0) : dst_feat.size(0);
  const int64_t row_bytes = by_src ? src_row_bytes : dst_row_bytes;
  const int64_t l2 = l2_cache_bytes();
  const int64_t saved_bytes = row_bytes * (num_edges - num_rows);  // at most one read per row instead of per edge
  const int64_t edge_array_bytes =
      src_idx.nbytes() + dst_idx.nbytes() + out.nbytes() + num_edges * static_cast<int64_t>(sizeof(int32_t));
  if (2 * num_rows * row_bytes <= l2 || saved_bytes <= kOrderMinSavedBytes * num_edges || edge_array_bytes > 2 * l2) {
    return c10::nullopt;
  }
  // Buckets of about 1/16 of L2: the edges in flight span at most a few buckets.
  int shift = 0;
  while ((row_bytes << shift) < l2 / 16 || ((num_rows - 1) >> shift) + 1 > kMaxOrderBuckets) ++shift;
  return OrderChoice{by_src, shift};
}

}  // namespace

// Widest float32 rows (features per head) whose atomic backward accumulates in double.
constexpr int64_t kDoubleAccumMaxDim = 16;

// Outcome codes of forward, turned into exceptions in Python (edgedot/ops.py).
constexpr int64_t kOk = 0, kBadSrcIndex = 1, kBadDstIndex = 2, kInvalidInputs = 3;

// Returns the output and an outcome code: kBadSrcIndex / kBadDstIndex when src_idx / dst_idx
// held an out-of-range index (checked calls only), kInvalidInputs (and an undefined output) when
// the arguments break the rules of check_inputs, in which case nothing was launched.
std::tuple<at::Tensor, int64_t> forward(at::Tensor src_feat, at::Tensor dst_feat, at::Tensor src_idx,
                                        at::Tensor dst_idx, bool check_indices) {
  if (!valid_inputs(src_feat, dst_feat, src_idx, dst_idx)) return {at::Tensor(), kInvalidInputs};
  TORCH_CHECK_VALUE(src_feat.size(-1) <= std::numeric_limits<int32_t>::max() &&
                        std::max(heads_of(src_feat), heads_of(dst_feat)) <= std::numeric_limits<int32_t>::max(),
                    "edgedot: more than 2**31 - 1 features or heads per row are not supported on CUDA");
  const c10::cuda::CUDAGuard guard(src_feat.device());
  InRangeMemo& memo = in_range_memo();
  const at::Tensor given_src_idx = src_idx, given_dst_idx = dst_idx;
  check_indices = check_indices && !(memo.covers(src_idx, src_feat.size(0)) && memo.covers(dst_idx, dst_feat.size(0)));
  src_feat = unit_stride_last(src_feat);
  dst_feat = unit_stride_last(dst_feat);
  src_idx = src_idx.contiguous();
  dst_idx = dst_idx.contiguous();
  const int64_t num_edges = src_idx.size(0);
  const bool flat = src_feat.dim() == 2 && dst_feat.dim() == 2;
  const int64_t heads = std::max(heads_of(src_feat), heads_of(dst_feat));
  at::Tensor out = flat ? at::empty({num_edges}, src_feat.options()) : at::empty({num_edges, heads}, src_feat.options());
  if (out.numel() == 0) return {out, kOk};

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Checking needs the kernel's verdict on the host: it waits for the stream. Capture can't wait.
  int* flags = check_indices && !stream_capturing(stream) ? host_error_flags() : nullptr;
  int* device_flags = nullptr;
  if (flags != nullptr) {
    flags[0] = flags[1] = 0;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flags), flags, 0));
  }
  ForwardArgs args{rows_of(src_feat), rows_of(dst_feat), src_idx.data_ptr(), dst_idx.data_ptr(), out.data_ptr(),
                   num_edges, heads, src_feat.size(-1), device_flags};
  at::Tensor order_buffer;
  EdgeOrder order{nullptr, nullptr};
  if (const auto choice = choose_edge_order(src_feat, dst_feat, src_idx, dst_idx, out)) {
    order_buffer = choice->by_src ? edge_order_buffer(src_idx, dst_idx, src_feat.size(0), choice->shift, stream)
                                  : edge_order_buffer(dst_idx, src_idx, dst_feat.size(0), choice->shift, stream);
    order.order = order_buffer.data_ptr<int32_t>();
    order.used = order.order + num_edges;
  }
  launch_forward(args, order, scalar_kind(src_feat.scalar_type()), index_kind(src_idx, "src_idx"),
                 index_kind(dst_idx, "dst_idx"), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (flags != nullptr) {
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    const volatile int* seen = flags;
    if (seen[0] != 0) return {out, kBadSrcIndex};
    if (seen[1] != 0) return {out, kBadDstIndex};
    memo.add(given_src_idx, src_feat.size(0));
    memo.add(given_dst_idx, dst_feat.size(0));
  }
  return {out, kOk};
}

// The edges sorted stably by row: grad_out, row_idx (out-of-range rows moved to the ends) and
// other_idx reordered.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_by_row(const at::Tensor& grad_out, const at::Tensor& row_idx,
                                                           const at::Tensor& other_idx, int64_t num_rows,
                                                           cudaStream_t stream) {
  const int64_t num_edges = row_idx.size(0);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  at::Tensor rows, order;
  if (num_edges < kMax32 && num_rows < kMax32) {
    const auto int32 = row_idx.options().dtype(at::kInt);
    at::Tensor keys = at::empty({2, num_edges}, int32);
    at::Tensor positions = at::empty({2, num_edges}, int32);
    const size_t temp_bytes = sort_by_row_temp_bytes(num_edges, num_rows, /*packed=*/false);
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, row_idx.options().dtype(at::kByte));
    const int buffer = launch_sort_by_row(row_idx.data_ptr(), index_kind(row_idx, "row_idx"), num_edges, num_rows,
                                          keys.data_ptr<int32_t>(), positions.data_ptr<int32_t>(), temp.data_ptr(),
                                          temp_bytes, stream);
    TORCH_CHECK(buffer >= 0, "edgedot: sorting the edges by row failed");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    rows = keys[buffer];
    order = positions[buffer];
  } else {
    // Clamped first, so that no huge index wraps onto a real row in a narrower key.
    std::tie(rows, order) = at::sort(row_idx.clamp(-1, num_rows), /*stable=*/true, 0, /*descending=*/false);
  }
  return {grad_out.index_select(0, order), rows, other_idx.index_select(0, order)};
}

// The edges sorted stably by row as keys (row_idx, out-of-range rows as num_rows) and pack_edge
// pairs, when packable_sort(args) holds.
std::tuple<at::Tensor, at::Tensor> sort_packed_by_row(const GradArgs& args, const at::Tensor& row_idx,
                                                      const at::Tensor& other_idx, const at::Tensor& grad_out,
                                                      cudaStream_t stream) {
  const int64_t num_edges = args.num_edges;
  at::Tensor keys = at::empty({2, num_edges}, row_idx.options().dtype(at::kInt));
  at::Tensor pairs = at::empty({2, num_edges}, row_idx.options().dtype(at::kLong));
  const size_t temp_bytes = sort_by_row_temp_bytes(num_edges, args.num_rows, /*packed=*/true);
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, row_idx.options().dtype(at::kByte));
  const int buffer = launch_sort_packed_by_row(args, index_kind(row_idx, "row_idx"), index_kind(other_idx, "other_idx"),
                                               static_cast<int>(grad_out.element_size()), keys.data_ptr<int32_t>(),
                                               reinterpret_cast<uint64_t*>(pairs.data_ptr<int64_t>()), temp.data_ptr(),
                                               temp_bytes, stream);
  TORCH_CHECK(buffer >= 0, "edgedot: sorting the edges by row failed");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {keys[buffer], pairs[buffer]};
}

// Whether the sort can carry each edge's other row and gradient in 64 bits: every count below
// 2**31 and at most 4 bytes of gradient per edge (float32, or half types with up to two heads).
bool packable_sort(const GradArgs& args, int64_t grad_bytes) {
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  return args.num_edges < kMax32 && args.num_rows < kMax32 && args.other.num_rows < kMax32 &&
         args.heads * grad_bytes <= 4;
}

// The forward's visit order grouped by buckets of 2**shift rows of row_idx, for tests: the
// positions, and whether they were written (a sample found neither index mostly sorted).
std::tuple<at::Tensor, bool> edge_order(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows,
                                        int64_t shift) {
  const int64_t num_edges = row_idx.size(0);
  TORCH_CHECK_VALUE(is_index(row_idx) && is_index(other_idx) && other_idx.size(0) == num_edges && num_edges >= 2 &&
                        num_edges < std::numeric_limits<int32_t>::max() && num_rows > 0 && shift >= 0 &&
                        shift < 63 && ((num_rows - 1) >> shift) + 1 <= kMaxOrderBuckets,
                    "edgedot: edge_order needs two index vectors of 2 to 2**31 - 1 edges and at most ",
                    kMaxOrderBuckets, " buckets");
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const at::Tensor buffer = edge_order_buffer(row_idx.contiguous(), other_idx.contiguous(), num_rows,
                                              static_cast<int>(shift), c10::cuda::getCurrentCUDAStream());
  return {buffer.narrow(0, 0, num_edges), buffer[num_edges].item<int32_t>() != 0};
}

// edgedot.plan.build_side(row_idx, other_idx, num_rows, num_other) and its group_offsets, bit for
// bit: (packed [2E] = order | row_other, offsets [num_rows + 1]), by one radix sort and one kernel
// instead of a dozen tensor operations. Never waits for the device.
std::tuple<at::Tensor, at::Tensor> group_edges(at::Tensor row_idx, at::Tensor other_idx, int64_t num_rows,
                                               int64_t num_other) {
  // The messages hold no streamed torch values: on the H200 machine (torch 2.11) streaming a
  // shape into a failing check's message crashed the process (NOTES.md).
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_TYPE(is_index(row_idx), "edgedot: row_idx must be a 1-D int32 or int64 tensor");
  TORCH_CHECK_TYPE(is_index(other_idx), "edgedot: other_idx must be a 1-D int32 or int64 tensor");
  const IndexKind row_index = row_idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
  const IndexKind other_index = other_idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
  TORCH_CHECK_VALUE(row_idx.dim() == 1 && other_idx.dim() == 1 && row_idx.size(0) == other_idx.size(0),
                    "edgedot: row_idx and other_idx must be 1-D of one length");
  TORCH_CHECK_VALUE(row_idx.is_cuda() && other_idx.device() == row_idx.device(),
                    "edgedot: row_idx and other_idx must be on one CUDA device");
  const int64_t num_edges = row_idx.size(0);
  TORCH_CHECK_VALUE(num_edges < kMax32, "edgedot: group_edges takes fewer than 2**31 - 1 edges");
  TORCH_CHECK_VALUE(num_rows >= 0 && num_rows <= kMax32 && num_other >= 0 && num_other <= kMax32,
                    "edgedot: num_rows and num_other must lie in [0, 2**31 - 1]");
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = row_idx.options();
  at::Tensor packed = at::empty({2 * num_edges}, options.dtype(at::kLong));
  at::Tensor offsets = at::empty({num_rows + 1}, options.dtype(at::kLong));
  at::Tensor keys, positions;
  int buffer = 0;
  if (num_edges > 0) {
    keys = at::empty({2, num_edges}, options.dtype(at::kInt));
    positions = at::empty({2, num_edges}, options.dtype(at::kInt));
    const size_t temp_bytes = sort_by_row_temp_bytes(num_edges, num_rows, /*packed=*/false);
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, options.dtype(at::kByte));
    const at::Tensor rows = row_idx.contiguous();
    buffer = launch_sort_by_row(rows.data_ptr(), row_index, num_edges, num_rows, keys.data_ptr<int32_t>(),
                                positions.data_ptr<int32_t>(), temp.data_ptr(), temp_bytes, stream);
    TORCH_CHECK(buffer >= 0, "edgedot: sorting the edges by row failed");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor other = other_idx.contiguous();
  int64_t* p = packed.data_ptr<int64_t>();
  launch_group_edges(num_edges > 0 ? keys.data_ptr<int32_t>() + buffer * num_edges : nullptr,
                     num_edges > 0 ? positions.data_ptr<int32_t>() + buffer * num_edges : nullptr, other.data_ptr(),
                     other_index, num_edges, num_rows, num_other, p, reinterpret_cast<uint64_t*>(p + num_edges),
                     offsets.data_ptr<int64_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {packed, offsets};
}

// One side's gradient: over the plan's sorted edges if one is given, else by `reduction`:
//   "atomic"   edges as given, atomics into the gradient;
//   "sorted"   row_idx is non-decreasing: each row written once, bitwise reproducible;
//   "sort"     edges sorted stably by row here (sort_by_row), then as "sorted".
at::Tensor grad_rows(at::Tensor grad_out, at::Tensor row_feat, at::Tensor other_feat, at::Tensor row_idx,
                     at::Tensor other_idx, c10::optional<at::Tensor> plan, const std::string& reduction) {
  TORCH_CHECK_VALUE(reduction == "atomic" || reduction == "sorted" || reduction == "sort",
                    "edgedot: unknown reduction '", reduction, "' (atomic, sorted or sort)");
  const bool sort_here = !plan.has_value() && reduction == "sort";
  const bool sorted = plan.has_value() || sort_here || reduction == "sorted";
  const c10::cuda::CUDAGuard guard(row_feat.device());
  grad_out = grad_out.to(row_feat.scalar_type()).contiguous();
  other_feat = unit_stride_last(other_feat);
  if (!plan.has_value()) {  // a plan holds the rows itself: the index tensors are not read
    row_idx = row_idx.contiguous();
    other_idx = other_idx.contiguous();
  }
  const int64_t num_rows = row_feat.size(0);
  const int64_t row_heads = heads_of(row_feat);
  const int64_t dim = row_feat.size(-1);
  const int64_t num_edges = row_idx.size(0);
  const at::ScalarType dtype = row_feat.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  // Narrow float32 rows accumulate their atomics in double: on a row of some 350k edges, float
  // atomics measured 10-20x the error of PyTorch's sorted sum. At this width the double buffer
  // and its atomics cost little.
  const bool double_accum = dtype == at::kFloat && dim <= kDoubleAccumMaxDim;
  const at::ScalarType accum = half ? at::kFloat : double_accum ? at::kDouble : dtype;
  const auto options = row_feat.options();
  if (num_edges == 0 || row_feat.numel() == 0) return at::zeros(row_feat.sizes(), options);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GradArgs args{grad_out.data_ptr(), rows_of(other_feat), row_idx.data_ptr(), other_idx.data_ptr(),
                num_rows, row_heads, num_edges, grad_out.dim() == 2 ? grad_out.size(1) : 1, dim};
  if (sorted) {
    at::Tensor pairs;  // defined when the sort packed each edge's other row and gradient
    if (sort_here && packable_sort(args, grad_out.element_size())) {
      std::tie(row_idx, pairs) = sort_packed_by_row(args, row_idx, other_idx, grad_out, stream);
    } else if (sort_here) {
      std::tie(grad_out, row_idx, other_idx) = sort_by_row(grad_out, row_idx, other_idx, num_rows, stream);
    }
    args.grad_out = grad_out.data_ptr();
    args.row_idx = row_idx.data_ptr();
    args.other_idx = other_idx.data_ptr();
    const int64_t chunk_edges = sorted_chunk_edges(args, scalar_kind(dtype));
    // No memset: the kernel writes every row, rows without edges as zeros.
    at::Tensor grad = at::empty({num_rows, row_heads, dim}, options);
    at::Tensor workspace = at::empty({sorted_workspace_slots(args, chunk_edges), row_heads, dim},
                                     options.dtype(half ? at::kFloat : dtype));
    if (plan.has_value()) {
      // Layout checked in Python (edgedot/plan.py): [order | row_other], num_edges each.
      const int64_t* p = plan->data_ptr<int64_t>();
      launch_grad_planned(args, PlanSide{p, reinterpret_cast<const uint64_t*>(p + num_edges)}, grad.data_ptr(),
                          workspace.data_ptr(), chunk_edges, scalar_kind(dtype), stream);
    } else {
      const auto* packed = pairs.defined() ? reinterpret_cast<const uint64_t*>(pairs.data_ptr<int64_t>()) : nullptr;
      launch_grad_sorted(args, packed, grad.data_ptr(), workspace.data_ptr(), chunk_edges, scalar_kind(dtype),
                         index_kind(row_idx, "row_idx"), index_kind(other_idx, "other_idx"), stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return grad.view(row_feat.sizes());
  }
  // A memset, not at::zeros: a fill kernel costs several microseconds more host time per call.
  at::Tensor grad = at::empty({num_rows, row_heads, dim}, options.dtype(accum));
  C10_CUDA_CHECK(cudaMemsetAsync(grad.data_ptr(), 0, grad.nbytes(), stream));
  launch_grad_atomic(args, grad.data_ptr(), scalar_kind(dtype), double_accum, index_kind(row_idx, "row_idx"),
                     index_kind(other_idx, "other_idx"), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return (accum != dtype ? grad.to(dtype) : grad).view(row_feat.sizes());
}

}  // namespace edgedot

namespace edgedot {
at::Tensor kernelbench_forward(at::Tensor src_feat, at::Tensor dst_feat, at::Tensor src_idx, at::Tensor dst_idx);
}  // namespace edgedot (kernelbench/csrc/kernelbench.cpp)

namespace edgedot {
namespace {

// Dropout of the fused kernels (edgedot/_dropout.py, csrc/dropout.cuh). A forward draws its (seed,
// offset) from a CUDA generator the way torch's fused dropout does (philox_cuda_state: plain values,
// or device pointers while a CUDA graph is captured, so that every replay moves the offset on) and
// its kernel records the pair it used in an int64 [2] tensor, rng_state; the backward reads the
// pair from there on the device. Nothing waits for the device. A new op adopts it with dropout_of,
// draw_dropout_rng in its forward and recorded_dropout_rng in its backward.

// Offsets a call takes from the generator's stream. The mask hashes the offset whole, so any step
// keeps calls apart; philox_cuda_state wants a multiple of 4.
constexpr uint64_t kDropoutOffsetStep = 4;

// threshold and keep_scale of dropout_p; rng to be filled in by one of the functions below.
Dropout dropout_of(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, "edgedot: dropout_p must lie in [0, 1], got ", dropout_p);
  // threshold = min(floor(p * 2**32), 2**32): p * 2**32 is exact in double.
  const double scaled = std::floor(dropout_p * 4294967296.0);
  const uint64_t threshold = scaled >= 4294967296.0 ? uint64_t{1} << 32 : static_cast<uint64_t>(scaled);
  const double keep_scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
  return Dropout{DropoutRng{}, threshold, keep_scale};
}

// A forward's (seed, offset) for tensors on `like`'s device, from `generator` (default: that
// device's default CUDA generator), and rng_state, the int64 [2] tensor its kernel records them in.
DropoutRng draw_dropout_rng(const c10::optional<at::Generator>& generator, const at::Tensor& like,
                            at::Tensor& rng_state) {
  if (generator.has_value()) {
    // torch.Generator("cuda") names no index: it draws for the current device.
    const c10::Device on = generator->device();
    const bool same =
        on.is_cuda() && (on.has_index() ? on.index() : c10::cuda::current_device()) == like.device().index();
    TORCH_CHECK_VALUE(same, "edgedot: the dropout generator is on ", on, " but the inputs are on ", like.device(),
                      "; pass a generator of their device");
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(kDropoutOffsetStep);
  }
  rng_state = at::empty({2}, like.options().dtype(at::kLong));
  DropoutRng r{};
  if (philox.captured_) {
    r.seed_ptr = philox.seed_.ptr;
    r.offset_ptr = philox.offset_.ptr;
    r.offset_add = philox.offset_intragraph_;
  } else {
    r.seed = philox.seed_.val;
    r.offset = philox.offset_.val;
  }
  r.record = rng_state.data_ptr<int64_t>();
  return r;
}

// A backward's (seed, offset): read by its kernels from the rng_state its forward returned.
DropoutRng recorded_dropout_rng(const c10::optional<at::Tensor>& rng_state, const at::Tensor& like) {
  TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->scalar_type() == at::kLong && rng_state->dim() == 1 &&
                        rng_state->numel() == 2 && rng_state->is_contiguous() && rng_state->device() == like.device(),
                    "edgedot: dropout needs rng_state, the contiguous int64 [2] tensor the forward returned, on ",
                    like.device());
  const int64_t* p = rng_state->data_ptr<int64_t>();
  DropoutRng r{};
  r.seed_ptr = p;
  r.offset_ptr = p + 1;
  return r;
}

// Graph attention (csrc/attention_forward.cu, csrc/attention_backward.cu). Shapes and dtypes were
// validated in Python (edgedot/_attention_ops.py); these checks keep the kernels inside their
// tensors whatever they are given.

at::ScalarType attention_accum(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [rows, heads, dim] with unit stride on dim.
Rows attention_rows(const at::Tensor& t) { return Rows{t.data_ptr(), t.size(0), t.stride(0), t.stride(1)}; }

void check_attention_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                            std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.device() == q.device(), "edgedot: ", name, " is on ", t.device(), " but q is on ", q.device());
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), "edgedot: ", name, " must have shape ",
                    at::IntArrayRef(shape), ", got ", t.sizes());
}

IndexKind index_kind(const at::Tensor& idx) { return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64; }

// A grouping built by edgedot.plan.build_side (group given), or edges given grouped by the rows of
// row_idx with offsets their CSR pointer (group absent): position i is then edge i.
AttentionGrouping attention_grouping(const c10::optional<at::Tensor>& group, const at::Tensor& offsets,
                                     const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_edges,
                                     int64_t num_rows, const at::Tensor& q, const char* side) {
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == num_rows + 1 &&
                        offsets.is_contiguous() && offsets.device() == q.device(),
                    "edgedot: ", side, "_offsets must be a contiguous int64 tensor of ", num_rows + 1,
                    " elements on q's device, got ", offsets.scalar_type(), " of shape ", offsets.sizes());
  if (!group.has_value()) {
    for (const at::Tensor* idx : {&row_idx, &other_idx}) {
      TORCH_CHECK_VALUE(is_index(*idx) && idx->numel() == num_edges && idx->is_contiguous() &&
                            idx->device() == q.device(),
                        "edgedot: edges given grouped need contiguous int32 or int64 index tensors of E = ",
                        num_edges, " elements on q's device");
    }
    return AttentionGrouping{nullptr, nullptr, offsets.data_ptr<int64_t>(), row_idx.data_ptr(), other_idx.data_ptr(),
                             index_kind(row_idx), index_kind(other_idx)};
  }
  TORCH_CHECK_VALUE(group->scalar_type() == at::kLong && group->dim() == 1 && group->numel() == 2 * num_edges &&
                        group->is_contiguous() && group->device() == q.device(),
                    "edgedot: ", side, "_group must be a contiguous int64 tensor of 2 * E = ", 2 * num_edges,
                    " elements on q's device (edgedot.plan.build_side), got ", group->scalar_type(), " of shape ",
                    group->sizes());
  const int64_t* p = group->data_ptr<int64_t>();
  return AttentionGrouping{p, reinterpret_cast<const uint64_t*>(p + num_edges), offsets.data_ptr<int64_t>(),
                           nullptr, nullptr, IndexKind::i64, IndexKind::i64};
}

// The chunk schedule of a grouping's long rows (RowChunks), its tensors appended to `keep` (alive
// until the kernels are queued; the caching allocator orders their reuse on the stream). None when
// no row can be long.
RowChunks attention_chunks(const at::Tensor& offsets, int64_t num_rows, int64_t num_edges, int64_t heads, int64_t dim,
                           int64_t dim_v, ScalarKind scalar, std::vector<at::Tensor>& keep) {
  const int64_t chunk = attention_chunk_edges(num_edges, heads, dim, dim_v, scalar);
  if (num_edges <= chunk || num_rows == 0) return RowChunks{chunk, nullptr, nullptr, nullptr, 0, nullptr};
  const auto options = offsets.options();
  at::Tensor first_chunk = at::empty({num_rows + 1}, options.dtype(at::kLong));
  at::Tensor long_rows = at::empty({num_rows + 1}, options.dtype(at::kInt));  // the last entry: their count
  const size_t temp_bytes = attention_schedule_temp_bytes(num_rows);
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, options.dtype(at::kByte));
  int32_t* rows = long_rows.data_ptr<int32_t>();
  const cudaError_t status =
      launch_attention_schedule(offsets.data_ptr<int64_t>(), num_rows, num_edges, chunk,
                                first_chunk.data_ptr<int64_t>(), rows, rows + num_rows, temp.data_ptr(), temp_bytes,
                                c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "edgedot: building the chunk schedule failed: ", cudaGetErrorString(status));
  keep.insert(keep.end(), {first_chunk, long_rows, temp});
  const int32_t* row_order = nullptr;
  if (attention_orders_rows(num_edges, heads)) {
    at::Tensor keys = at::empty({2 * num_rows}, options.dtype(at::kByte));
    at::Tensor order = at::empty({2 * num_rows}, options.dtype(at::kInt));  // row ids, then their order
    const size_t sort_bytes = attention_row_order_temp_bytes(num_rows);
    at::Tensor sort_temp = at::empty({static_cast<int64_t>(sort_bytes)}, options.dtype(at::kByte));
    int32_t* ids = order.data_ptr<int32_t>();
    const cudaError_t sorted = launch_attention_row_order(offsets.data_ptr<int64_t>(), num_rows, num_edges, chunk,
                                                          keys.data_ptr<uint8_t>(), ids, ids + num_rows,
                                                          sort_temp.data_ptr(), sort_bytes,
                                                          c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(sorted == cudaSuccess, "edgedot: ordering the rows by degree failed: ", cudaGetErrorString(sorted));
    keep.insert(keep.end(), {keys, order, sort_temp});
    row_order = ids + num_rows;
  }
  return RowChunks{chunk, first_chunk.data_ptr<int64_t>(), rows, rows + num_rows,
                   attention_max_slots(num_edges, chunk), row_order};
}

// An accumulation-type buffer of `slots` x heads x dim partial rows (none without slots).
void* attention_partials(const RowChunks& c, int64_t heads, int64_t dim, const at::Tensor& q,
                         std::vector<at::Tensor>& keep) {
  if (c.max_slots == 0) return nullptr;
  keep.push_back(at::empty({c.max_slots, heads, dim}, q.options().dtype(attention_accum(q.scalar_type()))));
  return keep.back().data_ptr();
}

// q, k, v (and edge_feat) with unit stride on the last dim, checked against each other; dropout
// without its rng.
AttentionInputs attention_inputs(at::Tensor& q, at::Tensor& k, at::Tensor& v, c10::optional<at::Tensor>& edge_feat,
                                 int64_t num_edges, double scale, double dropout_p) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || q.scalar_type() == at::kHalf ||
                       q.scalar_type() == at::kBFloat16,
                   "edgedot: q must be float32, float64, float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
                    "edgedot: q, k and v must be 3-D CUDA tensors [rows, heads, dim]");
  const int64_t heads = q.size(1), dim = q.size(2), dim_v = v.size(2);
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "edgedot: q, k and v must have one dtype");
  check_attention_tensor(k, "k", q, {k.size(0), heads, dim});
  check_attention_tensor(v, "v", q, {k.size(0), heads, dim_v});
  TORCH_CHECK_VALUE(dim >= 1 && dim <= kAttentionMaxDim && dim_v >= 1 && dim_v <= kAttentionMaxDim,
                    "edgedot: graph attention on CUDA takes head dims of 1 to ", kAttentionMaxDim, ", got ", dim,
                    " and ", dim_v);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(num_edges < kMax32 && q.size(0) <= kMax32 && k.size(0) <= kMax32,
                    "edgedot: graph attention takes fewer than 2**31 edges and at most 2**31 - 1 rows a side");
  q = unit_stride_last(q);
  k = unit_stride_last(k);
  v = unit_stride_last(v);
  Rows ef{nullptr, 0, 0, 0};
  if (edge_feat.has_value()) {
    TORCH_CHECK_VALUE(edge_feat->scalar_type() == q.scalar_type() && edge_feat->dim() == 3,
                      "edgedot: edge_feat must be 3-D with q's dtype");
    check_attention_tensor(*edge_feat, "edge_feat", q, {num_edges, heads, dim});
    TORCH_CHECK_VALUE(dim_v == dim, "edgedot: edge_feat needs v's head dim equal to q's, got ", dim_v, " and ", dim);
    edge_feat = unit_stride_last(*edge_feat);
    ef = attention_rows(*edge_feat);
  }
  return AttentionInputs{attention_rows(q), attention_rows(k), attention_rows(v), ef, num_edges, heads, dim, dim_v,
                         scale, dropout_of(dropout_p)};
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
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionInputs in = attention_inputs(q, k, v, edge_feat, num_edges, scale, dropout_p);
  at::Tensor rng_state = at::empty({0}, q.options().dtype(at::kLong));
  if (dropout_p > 0.0) in.dropout.rng = draw_dropout_rng(generator, q, rng_state);
  const int64_t num_dst = q.size(0);
  const ScalarKind scalar = scalar_kind(q.scalar_type());
  std::vector<at::Tensor> keep;
  AttentionForwardArgs args{};
  args.in = in;
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, num_edges, num_dst, q, "dst");
  args.dst_chunks = attention_chunks(dst_offsets, num_dst, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  // No memset: the kernels write every element (rows without edges as zeros, lse -inf).
  at::Tensor out = at::empty({num_dst, in.heads, in.dim_v}, q.options());
  at::Tensor lse = at::empty({num_dst, in.heads}, q.options().dtype(attention_accum(q.scalar_type())));
  const std::vector<int64_t> alpha_shape = return_attention ? std::vector<int64_t>{num_edges, in.heads}
                                                            : std::vector<int64_t>{0};
  at::Tensor alpha = at::empty(alpha_shape, q.options());
  args.out = out.data_ptr();
  args.lse = lse.data_ptr();
  args.alpha = return_attention ? alpha.data_ptr() : nullptr;
  args.part_acc = attention_partials(args.dst_chunks, in.heads, in.dim_v, q, keep);
  args.part_ml = attention_partials(args.dst_chunks, in.heads, 2, q, keep);
  launch_attention_forward(args, scalar, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, alpha, rng_state};
}

// Its gradients by recomputation from lse: (dq, dk, dv in the inputs' dtype, d_edge_feat [E, H, D]
// with edge_feat_grad, else an empty [0] tensor). The dst pass writes dq, d_edge_feat and
// delta = <grad_out, out> per (n, h); the src pass then writes dk and dv, unless kv_grad is false
// (then dk and dv are empty [0] tensors and src_group, src_offsets are not read). With dropout,
// rng_state is the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double scale, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad, bool kv_grad) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionInputs in = attention_inputs(q, k, v, edge_feat, num_edges, scale, dropout_p);
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
  args.lse = lse.data_ptr();
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, num_edges, num_dst, q, "dst");
  args.dst_chunks = attention_chunks(dst_offsets, num_dst, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  if (kv_grad) {
    args.src = attention_grouping(src_group, *src_offsets, src_idx, dst_idx, num_edges, num_src, q, "src");
    args.src_chunks = attention_chunks(*src_offsets, num_src, num_edges, in.heads, in.dim, in.dim_v, scalar, keep);
  }
  // No memsets: every row is written by one team or merge (rows without edges as zeros).
  at::Tensor delta = at::empty({num_dst, in.heads}, q.options().dtype(accum));
  at::Tensor dq = at::empty({num_dst, in.heads, in.dim}, q.options());
  at::Tensor dk = kv_grad ? at::empty({num_src, in.heads, in.dim}, q.options()) : at::empty({0}, q.options());
  at::Tensor dv = kv_grad ? at::empty({num_src, in.heads, in.dim_v}, q.options()) : at::empty({0}, q.options());
  const std::vector<int64_t> d_edge_feat_shape =
      edge_feat_grad ? std::vector<int64_t>{num_edges, in.heads, in.dim} : std::vector<int64_t>{0};
  at::Tensor d_edge_feat = at::empty(d_edge_feat_shape, q.options());
  args.delta = delta.data_ptr();
  args.dq = dq.data_ptr();
  args.dk = dk.data_ptr();
  args.dv = dv.data_ptr();
  args.d_edge_feat = edge_feat_grad ? d_edge_feat.data_ptr() : nullptr;
  args.part_dq = attention_partials(args.dst_chunks, in.heads, in.dim, q, keep);
  args.part_dk = attention_partials(args.src_chunks, in.heads, in.dim, q, keep);
  args.part_dv = attention_partials(args.src_chunks, in.heads, in.dim_v, q, keep);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_attention_backward_dst(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (kv_grad) {
    launch_attention_backward_src(args, scalar, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dq, dk, dv, d_edge_feat};
}

}  // namespace edgedot

namespace edgedot {
namespace {

// Fused GAT and GATv2 attention (csrc/gat_forward.cu, csrc/gat_backward_dst.cu,
// csrc/gat_backward_src.cu) on graph attention's groupings, chunk schedules and dropout (drawn with
// draw_dropout_rng, read back with recorded_dropout_rng, the mask graph attention's). Shapes and
// dtypes were validated in Python (edgedot/_gat_ops.py); these checks keep the kernels inside their
// tensors whatever they are given.

void check_gat_tensor(const at::Tensor& t, const char* name, const at::Tensor& x, std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.scalar_type() == x.scalar_type(), "edgedot: ", name, " must have the dtype of the features (",
                    x.scalar_type(), "), got ", t.scalar_type());
  check_attention_tensor(t, name, x, shape);
}

// Per-node scalars [rows, heads], any strides: Rows of dim 1.
Rows gat_scalars(const at::Tensor& t) { return Rows{t.data_ptr(), t.size(0), t.stride(0), t.stride(1)}; }

const Rows kNoRows{nullptr, 0, 0, 0};

// What GAT and GATv2 share: x [num_src, heads, dim] (made unit stride on dim), sizes, dropout
// without its rng.
GatInputs gat_common(at::Tensor& x, const char* name, int64_t num_dst, int64_t num_edges, double negative_slope,
                     double dropout_p) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kHalf ||
                       x.scalar_type() == at::kBFloat16,
                   "edgedot: ", name, " must be float32, float64, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 3, "edgedot: ", name, " must be a 3-D CUDA tensor [rows, heads, dim]");
  const int64_t dim = x.size(2);
  TORCH_CHECK_VALUE(dim >= 1 && dim <= kAttentionMaxDim, "edgedot: GAT attention on CUDA takes head dims of 1 to ",
                    kAttentionMaxDim, ", got ", dim);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(num_edges < kMax32 && x.size(0) <= kMax32 && num_dst <= kMax32,
                    "edgedot: GAT attention takes fewer than 2**31 edges and at most 2**31 - 1 rows a side");
  x = unit_stride_last(x);
  GatInputs in{};
  in.x = attention_rows(x);
  in.a_src = in.a_dst = in.a_edge = in.x_dst = in.att = in.edge_feat = kNoRows;
  in.num_dst = num_dst;
  in.num_edges = num_edges;
  in.heads = x.size(1);
  in.dim = dim;
  in.negative_slope = negative_slope;
  in.dropout = dropout_of(dropout_p);
  return in;
}

GatInputs gat_inputs(at::Tensor& x, const at::Tensor& a_src, const at::Tensor& a_dst,
                     const c10::optional<at::Tensor>& a_edge, int64_t num_edges, double negative_slope,
                     double dropout_p) {
  TORCH_CHECK_VALUE(a_dst.dim() == 2, "edgedot: a_dst must be 2-D [num_dst, heads], got shape ", a_dst.sizes());
  GatInputs in = gat_common(x, "x", a_dst.size(0), num_edges, negative_slope, dropout_p);
  check_gat_tensor(a_src, "a_src", x, {x.size(0), in.heads});
  check_gat_tensor(a_dst, "a_dst", x, {in.num_dst, in.heads});
  in.v2 = false;
  in.a_src = gat_scalars(a_src);
  in.a_dst = gat_scalars(a_dst);
  if (a_edge.has_value()) {
    check_gat_tensor(*a_edge, "a_edge", x, {num_edges, in.heads});
    in.a_edge = gat_scalars(*a_edge);
  }
  return in;
}

// x_src, x_dst, att and edge_feat made unit stride on dim.
GatInputs gatv2_inputs(at::Tensor& x_src, at::Tensor& x_dst, at::Tensor& att, c10::optional<at::Tensor>& edge_feat,
                       int64_t num_edges, double negative_slope, double dropout_p) {
  TORCH_CHECK_VALUE(x_dst.dim() == 3, "edgedot: x_dst must be 3-D [num_dst, heads, dim], got shape ", x_dst.sizes());
  GatInputs in = gat_common(x_src, "x_src", x_dst.size(0), num_edges, negative_slope, dropout_p);
  check_gat_tensor(x_dst, "x_dst", x_src, {in.num_dst, in.heads, in.dim});
  check_gat_tensor(att, "att", x_src, {in.heads, in.dim});
  in.v2 = true;
  x_dst = unit_stride_last(x_dst);
  att = unit_stride_last(att);
  in.x_dst = attention_rows(x_dst);
  in.att = Rows{att.data_ptr(), 1, 0, att.stride(0)};
  if (edge_feat.has_value()) {
    check_gat_tensor(*edge_feat, "edge_feat", x_src, {num_edges, in.heads, in.dim});
    edge_feat = unit_stride_last(*edge_feat);
    in.edge_feat = attention_rows(*edge_feat);
  }
  return in;
}

// (out, lse, alpha, rng_state) of either model; x the values' tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_forward_run(
    GatInputs in, const at::Tensor& x, const at::Tensor& src_idx, const at::Tensor& dst_idx,
    const c10::optional<at::Tensor>& dst_group, const at::Tensor& dst_offsets, double dropout_p,
    const c10::optional<at::Generator>& generator, bool return_attention) {
  at::Tensor rng_state = at::empty({0}, x.options().dtype(at::kLong));
  if (dropout_p > 0.0) in.dropout.rng = draw_dropout_rng(generator, x, rng_state);
  const ScalarKind scalar = scalar_kind(x.scalar_type());
  std::vector<at::Tensor> keep;
  GatForwardArgs args{};
  args.in = in;
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, in.num_edges, in.num_dst, x, "dst");
  args.dst_chunks = attention_chunks(dst_offsets, in.num_dst, in.num_edges, in.heads, in.dim, in.dim, scalar, keep);
  // No memset: the kernels write every element (rows without edges as zeros, lse -inf).
  at::Tensor out = at::empty({in.num_dst, in.heads, in.dim}, x.options());
  at::Tensor lse = at::empty({in.num_dst, in.heads}, x.options().dtype(attention_accum(x.scalar_type())));
  const std::vector<int64_t> alpha_shape = return_attention ? std::vector<int64_t>{in.num_edges, in.heads}
                                                            : std::vector<int64_t>{0};
  at::Tensor alpha = at::empty(alpha_shape, x.options());
  args.out = out.data_ptr();
  args.lse = lse.data_ptr();
  args.alpha = return_attention ? alpha.data_ptr() : nullptr;
  args.part_acc = attention_partials(args.dst_chunks, in.heads, in.dim, x, keep);
  args.part_ml = attention_partials(args.dst_chunks, in.heads, 2, x, keep);
  launch_gat_forward(args, scalar, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, alpha, rng_state};
}

// Gradients of either model by recomputation from lse: (dx, da_src, dst_grad, datt, edge_grad),
// GAT's da_src and dst_grad [rows, heads] and edge_grad [E, H], GATv2's dst_grad (dx_dst) [Nd, H, C],
// datt [H, C] and edge_grad [E, H, C]; what a model lacks, what is not wanted (edge_grad without
// edge_grad_wanted, dx and da_src without src_grad), are empty [0] tensors. The dst pass writes
// delta and the dst and edge gradients, the src pass (src_grad only) dx and da_src. With dropout,
// rng_state is the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward_run(
    GatInputs in, const at::Tensor& x, at::Tensor grad_out, at::Tensor out, at::Tensor lse,
    const at::Tensor& src_idx, const at::Tensor& dst_idx, const c10::optional<at::Tensor>& dst_group,
    const at::Tensor& dst_offsets, const c10::optional<at::Tensor>& src_group,
    const c10::optional<at::Tensor>& src_offsets, double dropout_p, const c10::optional<at::Tensor>& rng_state,
    bool edge_grad_wanted, bool src_grad) {
  if (dropout_p > 0.0) in.dropout.rng = recorded_dropout_rng(rng_state, x);
  TORCH_CHECK_VALUE(!src_grad || (src_group.has_value() && src_offsets.has_value()),
                    "edgedot: src_grad needs src_group and src_offsets");
  const int64_t num_dst = in.num_dst, num_src = in.x.num_rows, heads = in.heads, dim = in.dim;
  const at::ScalarType accum = attention_accum(x.scalar_type());
  const ScalarKind scalar = scalar_kind(x.scalar_type());
  check_attention_tensor(grad_out, "grad_out", x, {num_dst, heads, dim});
  check_attention_tensor(out, "out", x, {num_dst, heads, dim});
  check_attention_tensor(lse, "lse", x, {num_dst, heads});
  grad_out = grad_out.to(x.scalar_type()).contiguous();
  out = unit_stride_last(out.to(x.scalar_type()));
  lse = lse.to(accum).contiguous();
  std::vector<at::Tensor> keep;
  GatBackwardArgs args{};
  args.in = in;
  args.grad_out = attention_rows(grad_out);
  args.out = attention_rows(out);
  args.lse = lse.data_ptr();
  args.dst = attention_grouping(dst_group, dst_offsets, dst_idx, src_idx, in.num_edges, num_dst, x, "dst");
  args.dst_chunks = attention_chunks(dst_offsets, num_dst, in.num_edges, heads, dim, dim, scalar, keep);
  if (src_grad) {
    args.src = attention_grouping(src_group, *src_offsets, src_idx, dst_idx, in.num_edges, num_src, x, "src");
    args.src_chunks = attention_chunks(*src_offsets, num_src, in.num_edges, heads, dim, dim, scalar, keep);
  }
  const auto options = x.options();
  // Absent outputs: an empty tensor each (outputs of an op must not alias one another).
  const auto none = [&options] { return at::empty({0}, options); };
  // No memsets: every row is written by one team or merge (rows without edges as zeros).
  at::Tensor delta = at::empty({num_dst, heads}, options.dtype(accum));
  at::Tensor dst_grad = in.v2 ? at::empty({num_dst, heads, dim}, options) : at::empty({num_dst, heads}, options);
  at::Tensor datt_rows = in.v2 ? at::empty({num_dst, heads, dim}, options.dtype(accum)) : none();
  at::Tensor edge_grad = !edge_grad_wanted ? none()
                         : in.v2           ? at::empty({in.num_edges, heads, dim}, options)
                                           : at::empty({in.num_edges, heads}, options);
  at::Tensor dx = src_grad ? at::empty({num_src, heads, dim}, options) : none();
  at::Tensor da_src = src_grad && !in.v2 ? at::empty({num_src, heads}, options) : none();
  args.delta = delta.data_ptr();
  args.dst_grad = dst_grad.data_ptr();
  args.datt_rows = in.v2 ? datt_rows.data_ptr() : nullptr;
  args.edge_grad = edge_grad_wanted ? edge_grad.data_ptr() : nullptr;
  args.dx = src_grad ? dx.data_ptr() : nullptr;
  args.da_src = src_grad && !in.v2 ? da_src.data_ptr() : nullptr;
  args.part_dst_grad = attention_partials(args.dst_chunks, heads, in.v2 ? dim : 1, x, keep);
  args.part_datt = in.v2 ? attention_partials(args.dst_chunks, heads, dim, x, keep) : nullptr;
  args.part_dx = attention_partials(args.src_chunks, heads, dim, x, keep);
  args.part_da_src = in.v2 ? nullptr : attention_partials(args.src_chunks, heads, 1, x, keep);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_gat_backward_dst(args, scalar, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (src_grad) {
    launch_gat_backward_src(args, scalar, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // datt: the destinations' shares summed in a fixed order (a reduction, never atomics).
  at::Tensor datt = in.v2 ? datt_rows.sum(0).to(x.scalar_type()) : none();
  return {dx, da_src, dst_grad, datt, edge_grad};
}

}  // namespace

// Fused GAT forward (PyG GATConv's attention) over the dst grouping, which is given as for
// attention_forward: (out [Nd, H, C] in x's dtype, lse [Nd, H] in the accumulation dtype, alpha
// [E, H] before dropout in x's dtype, or an empty [0] tensor without return_attention, rng_state:
// the dropout (seed, offset) drawn from generator, int64 [2], or an empty [0] tensor without dropout).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_forward(
    at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const GatInputs in = gat_inputs(x, a_src, a_dst, a_edge, num_edges, negative_slope, dropout_p);
  return gat_forward_run(in, x, src_idx, dst_idx, dst_group, dst_offsets, dropout_p, generator, return_attention);
}

// Fused GATv2 forward (PyG GATv2Conv's attention): the same outputs, the values x_src.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_forward(
    at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat, at::Tensor src_idx,
    at::Tensor dst_idx, c10::optional<at::Tensor> dst_group, at::Tensor dst_offsets, double negative_slope,
    double dropout_p, c10::optional<at::Generator> generator, bool return_attention) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x_src.device());
  const GatInputs in = gatv2_inputs(x_src, x_dst, att, edge_feat, num_edges, negative_slope, dropout_p);
  return gat_forward_run(in, x_src, src_idx, dst_idx, dst_group, dst_offsets, dropout_p, generator,
                         return_attention);
}

// Its gradients by recomputation from lse: (dx, da_src, da_dst, da_edge) in x's dtype; da_edge is
// an empty [0] tensor without a_edge_grad, dx and da_src without src_grad (then src_group and
// src_offsets are not read). With dropout, rng_state is the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward(
    at::Tensor grad_out, at::Tensor x, at::Tensor a_src, at::Tensor a_dst, c10::optional<at::Tensor> a_edge,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool a_edge_grad,
    bool src_grad) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const GatInputs in = gat_inputs(x, a_src, a_dst, a_edge, num_edges, negative_slope, dropout_p);
  TORCH_CHECK_VALUE(!a_edge_grad || a_edge.has_value(), "edgedot: a_edge_grad needs a_edge");
  const auto grads = gat_backward_run(in, x, grad_out, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                                      src_offsets, dropout_p, rng_state, a_edge_grad, src_grad);
  return {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), std::get<4>(grads)};
}

// GATv2's gradients: (dx_src, dx_dst, datt, d_edge_feat) in x_src's dtype; d_edge_feat is an empty
// [0] tensor without edge_feat_grad, dx_src without src_grad. With dropout, rng_state is the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_backward(
    at::Tensor grad_out, at::Tensor x_src, at::Tensor x_dst, at::Tensor att, c10::optional<at::Tensor> edge_feat,
    at::Tensor out, at::Tensor lse, at::Tensor src_idx, at::Tensor dst_idx, c10::optional<at::Tensor> dst_group,
    at::Tensor dst_offsets, c10::optional<at::Tensor> src_group, c10::optional<at::Tensor> src_offsets,
    double negative_slope, double dropout_p, c10::optional<at::Tensor> rng_state, bool edge_feat_grad,
    bool src_grad) {
  const int64_t num_edges = src_idx.dim() == 1 ? src_idx.numel() : 0;
  const c10::cuda::CUDAGuard guard(x_src.device());
  const GatInputs in = gatv2_inputs(x_src, x_dst, att, edge_feat, num_edges, negative_slope, dropout_p);
  TORCH_CHECK_VALUE(!edge_feat_grad || edge_feat.has_value(), "edgedot: edge_feat_grad needs edge_feat");
  const auto grads = gat_backward_run(in, x_src, grad_out, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                                      src_group, src_offsets, dropout_p, rng_state, edge_feat_grad, src_grad);
  return {std::get<0>(grads), std::get<2>(grads), std::get<3>(grads), std::get<4>(grads)};
}

}  // namespace edgedot

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &edgedot::forward, "edge dot products (CUDA)");
  m.def("kernelbench_forward", &edgedot::kernelbench_forward,
        "the seed problem's forward with KernelBench's contract: any index dtype, reference rounding (CUDA)");
  m.def("edge_order", &edgedot::edge_order, "the forward's visit order of the edges, for tests (CUDA)");
  m.def("group_edges", &edgedot::group_edges,
        "edgedot.plan.build_side and group_offsets in one sort and one kernel: (packed, offsets) (CUDA)");
  m.def("check_graph", &edgedot::check_graph,
        "src_idx, dst_idx and dst_ptr validated in one kernel and one wait: a bitmask of failed conditions (CUDA)");
  m.def("grad_rows", &edgedot::grad_rows, "gradient of edge dot products for one side (CUDA)");
  m.def("attention_forward", &edgedot::attention_forward,
        "fused graph attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("attention_backward", &edgedot::attention_backward,
        "gradients of fused graph attention by recomputation: (dq, dk, dv, d_edge_feat) (CUDA)");
  m.def("gat_forward", &edgedot::gat_forward,
        "fused GAT attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gatv2_forward", &edgedot::gatv2_forward,
        "fused GATv2 attention over the dst grouping: (out, lse, alpha, rng_state) (CUDA)");
  m.def("gat_backward", &edgedot::gat_backward,
        "gradients of fused GAT attention by recomputation: (dx, da_src, da_dst, da_edge) (CUDA)");
  m.def("gatv2_backward", &edgedot::gatv2_backward,
        "gradients of fused GATv2 attention by recomputation: (dx_src, dx_dst, datt, d_edge_feat) (CUDA)");
}
