// Edges sorted and grouped by row on the device: the backward's per-call sorts (sort_by_row.cu) and
// the attention grouping of edgedot.runtime.plan.build_side (group_edges.cu).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>
#include <vector>

#include "common/torch_common.h"

namespace edgedot {

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

namespace {

IndexKind checked_index(const at::Tensor& idx, const char* error) {
  TORCH_CHECK_TYPE(is_index(idx), error);
  return idx.scalar_type() == at::kInt ? IndexKind::i32 : IndexKind::i64;
}

}  // namespace

// The groupings of group_edges (by row_idx) and, with both, group_edges_both (also by other_idx):
// one sort of the edges' keys on every side, then one kernel; a small batch's in one cooperative
// kernel. range_flags: where the kernel reports indices out of range.
std::vector<at::Tensor> group_sides(const at::Tensor& row_idx, const at::Tensor& other_idx, int64_t num_rows,
                                    int64_t num_other, bool both, RangeFlags range_flags) {
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  const IndexKind row_index = checked_index(row_idx, "edgedot: row_idx must be a 1-D int32 or int64 tensor");
  const IndexKind other_index = checked_index(other_idx, "edgedot: other_idx must be a 1-D int32 or int64 tensor");
  TORCH_CHECK_VALUE(row_idx.dim() == 1 && other_idx.dim() == 1 && row_idx.size(0) == other_idx.size(0),
                    "edgedot: row_idx and other_idx must be 1-D of one length");
  TORCH_CHECK_VALUE(row_idx.is_cuda() && other_idx.device() == row_idx.device(),
                    "edgedot: row_idx and other_idx must be on one CUDA device");
  const int64_t num_edges = row_idx.size(0);
  TORCH_CHECK_VALUE(num_edges < kMax32, "edgedot: group_edges takes fewer than 2**31 - 1 edges");
  TORCH_CHECK_VALUE(num_rows >= 0 && num_rows <= kMax32 && num_other >= 0 && num_other <= kMax32,
                    "edgedot: num_rows and num_other must lie in [0, 2**31 - 1]");
  // Keys of both sides share one int32 range: [0, num_rows] then num_rows + 1 + [0, num_other].
  TORCH_CHECK_VALUE(!both || (2 * num_edges < kMax32 && num_rows + num_other + 1 < kMax32),
                    "edgedot: group_edges_both takes fewer than 2**30 edges and 2**31 - 2 rows on both sides");
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = row_idx.options();
  const at::Tensor rows = row_idx.contiguous();
  const at::Tensor others = other_idx.contiguous();
  // A side's outputs: packed [2E] = order | row_other, and offsets [side_rows + 1].
  std::vector<at::Tensor> out;
  std::vector<GroupSide> group;
  auto add_side = [&](const at::Tensor& other, IndexKind kind, int64_t side_rows, int64_t side_other) {
    at::Tensor packed = at::empty({2 * num_edges}, options.dtype(at::kLong));
    at::Tensor offsets = at::empty({side_rows + 1}, options.dtype(at::kLong));
    int64_t* p = packed.data_ptr<int64_t>();
    group.push_back({other.data_ptr(), kind, side_rows, side_other, p, reinterpret_cast<uint64_t*>(p + num_edges),
                     offsets.data_ptr<int64_t>()});
    out.push_back(packed);
    out.push_back(offsets);
  };
  add_side(others, other_index, num_rows, num_other);
  if (both) add_side(rows, row_index, num_other, num_rows);
  const GroupSide* second = both ? &group[1] : nullptr;
  const int64_t num_keys = (both ? 2 : 1) * num_edges;
  // A batch that one wave of blocks sorts: one launch in all.
  if (const int tiles = cooperative_grouping_tiles(num_keys, row_index, other_index)) {
    at::Tensor scratch = at::empty({cooperative_grouping_ints(num_keys, tiles, group[0], second, row_index)},
                                   options.dtype(at::kInt));
    if (launch_group_edges_cooperative(rows.data_ptr(), row_index, num_edges, tiles, scratch.data_ptr<int32_t>(),
                                       group[0], second, range_flags, stream)) {
      return out;
    }
  }
  // The sort's keys and positions (two buffers each) and its temporary storage, in one allocation.
  at::Tensor sort_buffer;
  int32_t* keys = nullptr;
  int32_t* positions = nullptr;
  if (num_edges > 0) {
    const int64_t key_rows = both ? num_rows + 1 + num_other : num_rows;
    const size_t temp_bytes = sort_by_row_temp_bytes(num_keys, key_rows, /*packed=*/false);
    Carving carving;
    const int64_t at_keys = carving.add(2 * num_keys * sizeof(int32_t));
    const int64_t at_positions = carving.add(2 * num_keys * sizeof(int32_t));
    const int64_t at_temp = carving.add(static_cast<int64_t>(temp_bytes));
    sort_buffer = at::empty({carving.size()}, options.dtype(at::kByte));
    uint8_t* base = sort_buffer.data_ptr<uint8_t>();
    keys = reinterpret_cast<int32_t*>(base + at_keys);
    positions = reinterpret_cast<int32_t*>(base + at_positions);
    const int buffer = launch_sort_by_row(rows.data_ptr(), row_index, num_edges, num_rows, keys, positions,
                                          base + at_temp, temp_bytes, stream, both ? others.data_ptr() : nullptr,
                                          other_index, num_other);
    TORCH_CHECK(buffer >= 0, "edgedot: sorting the edges by row failed");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    keys += buffer * num_keys;
    positions += buffer * num_keys;
  }
  launch_group_edges(keys, positions, num_edges, group[0], second, range_flags, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// edgedot.runtime.plan.build_side(row_idx, other_idx, num_rows, num_other) and its group_offsets, bit for
// bit: (packed [2E] = order | row_other, offsets [num_rows + 1]), by one radix sort and one kernel
// instead of a dozen tensor operations. Never waits for the device.
std::tuple<at::Tensor, at::Tensor> group_edges(at::Tensor row_idx, at::Tensor other_idx, int64_t num_rows,
                                               int64_t num_other) {
  std::vector<at::Tensor> out = group_sides(row_idx, other_idx, num_rows, num_other, /*both=*/false, RangeFlags{});
  return {out[0], out[1]};
}

// group_edges(row_idx, other_idx, num_rows, num_other) and group_edges(other_idx, row_idx, num_other,
// num_rows), bit for bit, by one sort (of both sides' keys) and one kernel: a call that needs both
// groupings (a forward whose backward walks the edges by source) launches half as many kernels.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_edges_both(at::Tensor row_idx, at::Tensor other_idx,
                                                                            int64_t num_rows, int64_t num_other) {
  std::vector<at::Tensor> out = group_sides(row_idx, other_idx, num_rows, num_other, /*both=*/true, RangeFlags{});
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace edgedot
