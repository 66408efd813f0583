// Device pieces of the edge groupings, shared by the sort's key kernel (sort_by_row.cu), the
// grouping kernel that follows CUB's sort (group_edges.cu) and the one-launch grouping of small
// batches (group_edges_cooperative.cu).
#pragma once

#include "common/common.cuh"

namespace edgedot {

// Bits of a key up to max_key (at least 1): an LSD radix sort sorts only these.
inline int key_bits(int64_t max_key) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) <= max_key) ++bits;
  return bits;
}

// Key of an edge: its row, or num_rows for an out-of-range row, which sorts last and is skipped
// by the reduction.
template <typename RowIdx>
__device__ __forceinline__ int32_t row_key(RowIdx r, int32_t num_rows) {
  return in_range(r, num_rows) ? static_cast<int32_t>(r) : num_rows;
}

// Entry i of the sort's keys: i < num_edges keys row_idx[i]; with second_idx, num_edges + e keys
// second_idx[e] after every first-side key (num_rows + 1 + its key among num_second_rows), so that
// one sort groups the edges by both sides. position: the entry's edge.
template <typename RowIdx, typename SecondIdx>
__device__ __forceinline__ void edge_key(const RowIdx* __restrict__ row_idx, const SecondIdx* __restrict__ second_idx,
                                         int64_t i, int32_t num_edges, int32_t num_rows, int32_t num_second_rows,
                                         int32_t& key, int32_t& position) {
  if (i < num_edges) {
    key = row_key(row_idx[i], num_rows);
    position = static_cast<int32_t>(i);
  } else {
    const int64_t e = i - num_edges;
    key = num_rows + 1 + row_key(second_idx[e], num_second_rows);
    position = static_cast<int32_t>(e);
  }
}

// The first of keys[0..num_keys) (non-decreasing) that is >= key: torch.searchsorted's left side.
// A binary search per row rather than a scan of the run boundaries, which would leave a whole gap
// of rows without edges (say the last hop's nodes of a sampled subgraph) to one thread.
__device__ __forceinline__ int32_t first_at_least(const int32_t* keys, int32_t num_keys, int64_t key) {
  int32_t lo = 0, hi = num_keys;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// One side's outputs (GroupSide), its other ends typed.
template <typename OtherIdx>
struct TypedSide {
  const OtherIdx* __restrict__ other_idx;
  int64_t num_rows, num_other;
  int64_t* __restrict__ order;
  uint64_t* __restrict__ row_other;
  int64_t* __restrict__ offsets;
};

template <typename OtherIdx>
TypedSide<OtherIdx> typed(const GroupSide& s) {
  return {static_cast<const OtherIdx*>(s.other_idx), s.num_rows, s.num_other, s.order, s.row_other, s.offsets};
}

// Entry i of a side's sorted keys (its rows offset by key_base) and positions; returns whether its
// other end is out of range.
template <typename OtherIdx>
__device__ __forceinline__ bool group_entry(const TypedSide<OtherIdx>& side, int32_t key, int32_t e, int64_t i,
                                            int32_t key_base) {
  const OtherIdx o = side.other_idx[e];
  const bool other_in = in_range(o, side.num_other);
  const int32_t other = other_in ? static_cast<int32_t>(o) : -1;
  side.order[i] = e;
  // Rows lie in [0, num_rows]: out-of-range rows were sorted as num_rows.
  side.row_other[i] = static_cast<uint64_t>(static_cast<uint32_t>(key - key_base)) << 32 | static_cast<uint32_t>(other);
  return !other_in;
}

// Raises the range flags a block's threads found (row_out, other_out: each thread's own), called
// by every thread of the block.
__device__ __forceinline__ void publish_range_flags(RangeFlags range_flags, bool row_out, bool other_out) {
  if (range_flags.row_out == nullptr && range_flags.other_out == nullptr) return;  // the same for the whole grid
  // One store per block and failed condition, each writing 1: their order is irrelevant.
  const int any_row_out = __syncthreads_or(row_out);
  const int any_other_out = __syncthreads_or(other_out);
  if (threadIdx.x == 0) {
    if (any_row_out && range_flags.row_out != nullptr) *range_flags.row_out = 1;
    if (any_other_out && range_flags.other_out != nullptr) *range_flags.other_out = 1;
  }
}

// The groupings' entries (order, row_other) from the sorted keys and positions (sides * num_edges of
// each; sides 1 or 2: entries [0, num_edges) are the first side's, [num_edges, 2 num_edges) the
// second's, whose keys start at first.num_rows + 1) and the range flags, for threads start, start +
// stride, ... of a grid, every thread of each block (range_flags are set once per block). Not
// __restrict__: the cooperative kernel wrote them itself, so they must not be read through the
// read-only path.
template <typename FirstOther, typename SecondOther>
__device__ __forceinline__ void write_entries(const int32_t* keys, const int32_t* positions, int32_t num_edges,
                                              int sides, const TypedSide<FirstOther>& first,
                                              const TypedSide<SecondOther>& second, RangeFlags range_flags,
                                              int64_t start, int64_t stride) {
  // 64-bit counters: num_rows + 1 reaches 2**31.
  const int32_t second_base = static_cast<int32_t>(first.num_rows + 1);
  const int32_t row_out_key = static_cast<int32_t>(first.num_rows);  // out-of-range rows' key
  const int64_t num_keys = static_cast<int64_t>(sides) * num_edges;
  bool row_out = false, other_out = false;
  for (int64_t i = start; i < num_keys; i += stride) {
    if (i < num_edges) {
      const int32_t key = keys[i];
      row_out |= key == row_out_key;
      other_out |= group_entry(first, key, positions[i], i, 0);
    } else {
      group_entry(second, keys[i], positions[i], i - num_edges, second_base);
    }
  }
  publish_range_flags(range_flags, row_out, other_out);
}

// Each side's offsets from the sorted keys, by a binary search a row.
template <typename FirstOther, typename SecondOther>
__device__ __forceinline__ void write_searched_offsets(const int32_t* keys, int32_t num_edges, int sides,
                                                       const TypedSide<FirstOther>& first,
                                                       const TypedSide<SecondOther>& second, int64_t start,
                                                       int64_t stride) {
  const int64_t first_offsets = first.num_rows + 1;
  const int64_t num_offsets = first_offsets + (sides == 2 ? second.num_rows + 1 : 0);
  for (int64_t r = start; r < num_offsets; r += stride) {
    if (r < first_offsets) {
      first.offsets[r] = first_at_least(keys, num_edges, r);
    } else {
      second.offsets[r - first_offsets] = first_at_least(keys + num_edges, num_edges, r);
    }
  }
}

// The groupings' entries (write_entries), then each side's offsets (write_searched_offsets).
template <typename FirstOther, typename SecondOther>
__device__ __forceinline__ void write_groupings(const int32_t* keys, const int32_t* positions, int32_t num_edges,
                                                int sides, const TypedSide<FirstOther>& first,
                                                const TypedSide<SecondOther>& second, RangeFlags range_flags,
                                                int64_t start, int64_t stride) {
  write_entries(keys, positions, num_edges, sides, first, second, range_flags, start, stride);
  write_searched_offsets(keys, num_edges, sides, first, second, start, stride);
}

}  // namespace edgedot
