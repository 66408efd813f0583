// Shared by the two backward kernels: accumulating g * other_row into a register row.
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

}  // namespace edgedot
