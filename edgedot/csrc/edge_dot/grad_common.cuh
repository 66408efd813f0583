// Shared by the backward kernels: the grid loop over units of work, a lane's slice of a gradient
// row in registers, and the walk over edges that sums each run of one row.
#pragma once

#include <cstring>

#include "common/common.cuh"

namespace edgedot {

// (edge, head) items a lane loads, indices and rows, before it adds any: the gather is
// latency-bound. With kVectorsPerLane vectors each, two items take about 128 registers.
constexpr int kGradItemsInFlight = 2;

// Units of work strided over the grid, one per aligned group of `group` lanes.
struct GroupUnits {
  int64_t first, count, stride;
  int lane;

  __device__ GroupUnits(int group, int64_t units)
      : first((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / group),
        count(units),
        stride(static_cast<int64_t>(gridDim.x) * blockDim.x / group),
        lane(threadIdx.x & (group - 1)) {}
};

// One pass of a lane over a row of T: vectors base + u * group for u < kVectorsPerLane. The
// accumulator (of type A) holds that slice of the gradient row.
template <typename T, int VEC, typename A = accum_t<T>>
struct RowSlice {
  using Vectors = Vec<T, VEC>[kVectorsPerLane];
  A acc[kVectorsPerLane][VEC];
  int64_t base;
  int group;
  int64_t vectors;

  __device__ RowSlice(int64_t base, int group, int64_t vectors) : base(base), group(group), vectors(vectors) {
    zero();
  }

  __device__ __forceinline__ bool has(int u) const { return base + static_cast<int64_t>(u) * group < vectors; }
  __device__ __forceinline__ int64_t offset(int u) const { return (base + static_cast<int64_t>(u) * group) * VEC; }

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] = 0;
  }

  // The slice of `row`, loaded without being added.
  __device__ __forceinline__ void load(Vectors& x, const T* row) const {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
      if (has(u)) x[u] = load_vec<T, VEC>(row + offset(u));
  }

  // acc += g * x.
  __device__ __forceinline__ void add(accum_t<T> g, const Vectors& x) {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
      if (has(u)) add_scaled_vec(acc[u], g, x[u]);
  }

  __device__ __forceinline__ void add_scaled(accum_t<T> g, const T* row) {
    Vectors x;
    load(x, row);
    add(g, x);
  }

  // Writes the slice to `row` as S: the gradient's type, or the accumulation type for workspace.
  template <typename S>
  __device__ __forceinline__ void store(S* row) const {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
      if (has(u)) store_vec(row + offset(u), acc[u]);
  }

  // acc += the slice of a workspace row P of partial sums.
  template <typename P>
  __device__ __forceinline__ void add_part(const P* part) {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u) {
      if (has(u)) {
        const Vec<P, VEC> x = load_vec<P, VEC>(part + offset(u));
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[u][j] += static_cast<A>(x.v[j]);
      }
    }
  }

  // Writes zeros over the slice of `row`.
  __device__ __forceinline__ void store_zero(T* row) const {
    Vec<T, VEC> zero;
#pragma unroll
    for (int j = 0; j < VEC; ++j) zero.v[j] = from_accum<T>(accum_t<T>(0));
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
      if (has(u)) *reinterpret_cast<Vec<T, VEC>*>(row + offset(u)) = zero;
  }

  // One vector of accumulators written as S.
  template <typename S>
  __device__ __forceinline__ static void store_vec(S* p, const A (&x)[VEC]) {
    Vec<S, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_accum<S>(static_cast<accum_t<S>>(x[j]));
    *reinterpret_cast<Vec<S, VEC>*>(p) = out;
  }
};

// The sources of edges a reduction walks. Position i of an edge source has a row (compared as
// stored), an other row (out of range when the edge adds nothing) and grad_out values per head.

// Edges in the order given: position i is edge i.
template <typename T, typename RowIdx, typename OtherIdx>
struct GivenEdges {
  using Row = RowIdx;
  const T* __restrict__ grad_out;
  const RowIdx* __restrict__ rows;
  const OtherIdx* __restrict__ others;
  int64_t heads;

  static GivenEdges of(const GradArgs& a) {
    return {static_cast<const T*>(a.grad_out), static_cast<const RowIdx*>(a.row_idx),
            static_cast<const OtherIdx*>(a.other_idx), a.heads};
  }
  __device__ __forceinline__ Row row(int64_t i) const { return rows[i]; }
  __device__ __forceinline__ int64_t other(int64_t i) const { return static_cast<int64_t>(others[i]); }
  __device__ __forceinline__ accum_t<T> grad(int64_t i, int64_t h) const { return to_accum(grad_out[i * heads + h]); }
};

// Edges sorted here with their pack_edge pairs (launch_sort_packed_by_row): position i has row
// keys[i]; its other row and gradient come from pairs[i], read in sequence.
template <typename T>
struct PackedEdges {
  using Row = int32_t;
  const int32_t* __restrict__ keys;
  const uint64_t* __restrict__ pairs;

  __device__ __forceinline__ Row row(int64_t i) const { return keys[i]; }
  __device__ __forceinline__ int64_t other(int64_t i) const { return static_cast<int32_t>(pairs[i]); }
  __device__ __forceinline__ accum_t<T> grad(int64_t i, int64_t h) const {
    static_assert(sizeof(T) <= 4, "a packed gradient holds at most 4 bytes");
    const uint32_t bits = static_cast<uint32_t>(pairs[i] >> 32) >> (8 * sizeof(T) * h);
    T x;
    memcpy(&x, &bits, sizeof(T));  // the low bytes: head h's value
    return to_accum(x);
  }
};

// Edges of an EdgePlan side (PlanSide in edgedot.h): position i has the row and other row packed
// in row_other[i] and the gradient of edge order[i], gathered; an order outside [0, num_edges)
// adds nothing.
template <typename T>
struct PlannedEdges {
  using Row = int32_t;
  const int64_t* __restrict__ order;
  const uint64_t* __restrict__ row_other;
  const T* __restrict__ grad_out;
  int64_t heads, num_edges;

  __device__ __forceinline__ Row row(int64_t i) const { return static_cast<int32_t>(row_other[i] >> 32); }
  __device__ __forceinline__ int64_t other(int64_t i) const { return static_cast<int32_t>(row_other[i]); }
  __device__ __forceinline__ accum_t<T> grad(int64_t i, int64_t h) const {
    const int64_t e = order[i];
    return in_range(e, num_edges) ? to_accum(grad_out[e * heads + h]) : accum_t<T>(0);
  }
};

// Item n of a walk over positions from `begin`, head_count heads each from first_head: head
// first_head + n % head_count of position begin + n / head_count.
struct WalkItem {
  int64_t i, h;

  __device__ __forceinline__ WalkItem(int64_t begin, int64_t n, int64_t first_head, int64_t head_count) {
    const int64_t step = head_count == 1 ? n : n / head_count;
    i = begin + step;
    h = first_head + (n - step * head_count);
  }
};

// The other row item n adds, or null when its other row is out of range.
template <typename T, typename Edges>
__device__ __forceinline__ const T* other_row(const GradArgs& a, const Edges& edges, const WalkItem& item) {
  const int64_t o = edges.other(item.i);
  return in_range(o, a.other.num_rows)
             ? static_cast<const T*>(a.other.data) + o * a.other.row_stride + item.h * a.other.head_stride
             : nullptr;
}

// Walks positions [begin, end) of `edges` in order for one slice of a gradient row, adding heads
// first_head .. first_head + head_count - 1 of each edge: sums g * other_row over each run of
// equal rows in `slice`, and at each change of row calls on_run_end(row, next_row) before the
// slice is cleared. Rows are compared as stored, so out-of-range rows form runs of their own;
// an edge with an out-of-range index adds nothing. Returns the last run's row, whose sum stays in
// `slice`. Needs begin < end.
// The gather waits on the other rows' indices. With kPrefetch, the next batch's are loaded while
// this batch's rows are in flight (one memory latency per batch instead of two), at the cost of
// two more pointers per item in registers.
template <bool kPrefetch, typename T, int VEC, typename Edges, typename OnRunEnd>
__device__ __forceinline__ typename Edges::Row sum_runs(const GradArgs& a, const Edges& edges, int64_t begin,
                                                        int64_t end, int64_t first_head, int64_t head_count,
                                                        RowSlice<T, VEC>& slice, OnRunEnd&& on_run_end) {
  using Row = typename Edges::Row;
  Row current = edges.row(begin);
  const int64_t items = (end - begin) * head_count;
  const T* others[kGradItemsInFlight];
  auto find_others = [&](int64_t first) {
#pragma unroll
    for (int k = 0; k < kGradItemsInFlight; ++k) {
      if (first + k < items) others[k] = other_row<T>(a, edges, WalkItem(begin, first + k, first_head, head_count));
    }
  };
  if constexpr (kPrefetch) find_others(0);
  for (int64_t first = 0; first < items; first += kGradItemsInFlight) {
    Row rows[kGradItemsInFlight];
    bool adds[kGradItemsInFlight];
    accum_t<T> g[kGradItemsInFlight];
    typename RowSlice<T, VEC>::Vectors x[kGradItemsInFlight];
#pragma unroll
    for (int k = 0; k < kGradItemsInFlight; ++k) {
      adds[k] = false;
      if (first + k < items) {
        const WalkItem item(begin, first + k, first_head, head_count);
        if constexpr (!kPrefetch) others[k] = other_row<T>(a, edges, item);
        rows[k] = edges.row(item.i);
        adds[k] = others[k] != nullptr;
        if (adds[k]) {
          slice.load(x[k], others[k]);
          g[k] = edges.grad(item.i, item.h);
        }
      }
    }
    if constexpr (kPrefetch) find_others(first + kGradItemsInFlight);
#pragma unroll
    for (int k = 0; k < kGradItemsInFlight; ++k) {
      if (first + k >= items) break;
      if (rows[k] != current) {
        on_run_end(current, rows[k]);
        slice.zero();
        current = rows[k];
      }
      if (adds[k] && in_range(rows[k], a.num_rows)) slice.add(g[k], x[k]);
    }
  }
  return current;
}

}  // namespace edgedot
