// Shared by the backward kernels: accumulating g * other_row into a register row, and writing it.
#pragma once

#include "common.cuh"

namespace edgedot {

// One pass of a lane over a row: vectors lane + u * group for u < kVectorsPerLane, starting at
// `base`. The accumulator holds that slice of the gradient row.
template <typename T, int VEC>
struct RowSlice {
  using A = accum_t<T>;
  A acc[kVectorsPerLane][VEC];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] = 0;
  }

  // acc += g * row[base + u * group] for the vectors that exist.
  __device__ __forceinline__ void add_scaled(A g, const T* row, int64_t base, int group, int64_t vectors) {
    Vec<T, VEC> x[kVectorsPerLane];
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u) {
      const int64_t v = base + static_cast<int64_t>(u) * group;
      if (v < vectors) x[u] = load_vec<T, VEC>(row + v * VEC);
    }
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u) {
      if (base + static_cast<int64_t>(u) * group < vectors) add_scaled_vec(acc[u], g, x[u]);
    }
  }
};

// Writes a lane's slice of a row (the vectors a RowSlice covers). S is the gradient's type or,
// for workspace slots, the accumulation type (for which from_accum is the identity).
template <typename S, typename A, int VEC>
__device__ __forceinline__ void store_slice(S* row, const A (&acc)[kVectorsPerLane][VEC], int64_t base, int group,
                                            int64_t vectors) {
#pragma unroll
  for (int u = 0; u < kVectorsPerLane; ++u) {
    const int64_t v = base + static_cast<int64_t>(u) * group;
    if (v < vectors) {
      Vec<S, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = from_accum<S>(static_cast<accum_t<S>>(acc[u][j]));
      *reinterpret_cast<Vec<S, VEC>*>(row + v * VEC) = out;
    }
  }
}

// Writes one vector of accumulators as S (the gradient's type or the accumulation type).
template <typename S, typename A, int VEC>
__device__ __forceinline__ void store_vec(S* p, const A (&acc)[VEC]) {
  Vec<S, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.v[j] = from_accum<S>(static_cast<accum_t<S>>(acc[j]));
  *reinterpret_cast<Vec<S, VEC>*>(p) = out;
}

// acc += a lane's slice of a workspace row, in double: a hot row sums thousands of partial rows.
template <typename A, int VEC>
__device__ __forceinline__ void add_slice(double (&acc)[kVectorsPerLane][VEC], const A* part, int64_t base, int group,
                                          int64_t vectors) {
#pragma unroll
  for (int u = 0; u < kVectorsPerLane; ++u) {
    const int64_t v = base + static_cast<int64_t>(u) * group;
    if (v < vectors) {
      const Vec<A, VEC> x = load_vec<A, VEC>(part + v * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] += static_cast<double>(x.v[j]);
    }
  }
}

}  // namespace edgedot
