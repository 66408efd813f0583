// Column sums out[c] = sum over r of x[r, c] (a bias's gradient, GATv2's att gradient): PyTorch's
// x.sum(0) spreads a tall [rows, width] reduction with few outputs poorly (about 0.6 TB/s on an
// H200 for [180224, 128]). Here a block of 32 x kRowLanes threads sums a slab of rows for 32
// vectors of columns (16-byte loads where x allows), its row lanes added in lane order into one
// partial row per block; the partial rows are then added in block order (column_sum.cuh). The slabs
// are a function of the shape alone, so the result is bitwise the same on every run and device.
#include <algorithm>

#include "common/column_sum.cuh"

namespace edgedot {

namespace {

constexpr int kRowLanes = 8;
constexpr int64_t kMinRowsPerBlock = 64;
constexpr int64_t kMaxBlocks = 1024;

template <typename T, int VEC>
__global__ void __launch_bounds__(32 * kRowLanes)
    column_partials_kernel(const T* __restrict__ x, int64_t rows, int64_t width, int64_t row_stride,
                           int64_t rows_per_block, accum_t<T>* __restrict__ partial) {
  using A = accum_t<T>;
  __shared__ A sums[kRowLanes][32 * VEC];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  A sum[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum[j] = 0;
  if (col < width) {
#pragma unroll 4
    for (int64_t r = first + threadIdx.y; r < last; r += kRowLanes) {
      const Vec<T, VEC> values = load_vec<T, VEC>(x + r * row_stride + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[j] += to_accum(values.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) sums[threadIdx.y][threadIdx.x * VEC + j] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A total = 0;
      for (int lane = 0; lane < kRowLanes; ++lane) total += sums[lane][threadIdx.x * VEC + j];
      partial[static_cast<int64_t>(blockIdx.y) * width + col + j] = total;
    }
  }
}

}  // namespace

int64_t column_sum_blocks(int64_t rows) {
  return std::clamp<int64_t>((rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock, 1, kMaxBlocks);
}

void launch_column_sum(const void* x, int64_t rows, int64_t width, int64_t row_stride, void* partial, void* out,
                       ScalarKind scalar, ScalarKind out_scalar, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  const int64_t blocks = column_sum_blocks(rows);
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    constexpr int kWide = wide_vec<T>();
    const bool wide = width % kWide == 0 && row_stride % kWide == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    auto launch = [&](auto kernel, int vec) {
      const dim3 grid(static_cast<unsigned>((width / vec + 31) / 32), static_cast<unsigned>(blocks));
      kernel<<<grid, dim3(32, kRowLanes), 0, stream>>>(static_cast<const T*>(x), rows, width, row_stride,
                                                       rows_per_block, static_cast<A*>(partial));
    };
    if (wide) {
      launch(column_partials_kernel<T, kWide>, kWide);
    } else {
      launch(column_partials_kernel<T, 1>, 1);
    }
    dispatch_scalar(out_scalar, [&](auto out_zero) {
      using Out = decltype(out_zero);
      launch_sum_partials<A, Out>(static_cast<const A*>(partial), static_cast<Out*>(out), blocks, width, stream);
    });
  });
}

}  // namespace edgedot
