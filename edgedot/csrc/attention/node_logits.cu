// GAT's per-node logits out[k, n, h] = <x[n, h], att[k, h]> for one or two attention vectors (a
// layer's source and destination sides over the same features) and their gradients. PyTorch
// computes each side as (x * att).sum(-1): an [N, H, C] product in memory, and in the backward
// another, reduced over the N nodes by a reduce kernel with only H * C outputs to spread, then the
// two sides' dx added. Here the forward reads x once for both sides, and the backward reads x and
// writes dx once, att's gradient summed per block of rows and then over the blocks in a fixed
// order (bitwise reproducible).
#include <algorithm>

#include "common/column_sum.cuh"

namespace edgedot {

namespace {

// Rows of att's gradient each block sums, and at most this many blocks: a function of N alone, so
// the order of the sums does not depend on the device.
constexpr int64_t kRowsPerBlock = 64;
constexpr int64_t kMaxBlocks = 4096;

// The sides' pointers, in R (the logits' type: x's, or its accumulation type).
template <typename R>
struct SidePointers {
  const R* in[2];
  R* out[2];
};

// A team of `group` lanes per (n, h) unit, 32 / group units a warp: the lanes stride over the
// unit's VEC-element vectors (16-byte loads where x allows), then a butterfly sum per side. Every
// lane of a warp takes the same trip counts (the shuffles need all 32): units past the end are
// computed on the last unit and not written. Sums in the accumulation type, written in R.
template <typename T, typename R, int VEC, int Sides>
__global__ void node_logits_kernel(Rows x, int64_t heads, int64_t dim, SidePointers<R> sides, int group) {
  using A = accum_t<T>;
  const T* data = static_cast<const T*>(x.data);
  const int lane = threadIdx.x & 31, team_lane = lane & (group - 1), per_warp = 32 / group;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t units = x.num_rows * heads, vectors = dim / VEC;
  for (int64_t first = warp * per_warp; first < units; first += warps * per_warp) {
    const int64_t unit = first + lane / group < units ? first + lane / group : units - 1;
    const int64_t n = unit / heads, h = unit - n * heads;
    const T* row = data + n * x.row_stride + h * x.head_stride;
    A sum[Sides];
#pragma unroll
    for (int k = 0; k < Sides; ++k) sum[k] = 0;
#pragma unroll 4
    for (int64_t v = team_lane; v < vectors; v += group) {
      const Vec<T, VEC> values = load_vec<T, VEC>(row + v * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A value = to_accum(values.v[j]);
#pragma unroll
        for (int k = 0; k < Sides; ++k) sum[k] += value * to_accum(__ldg(sides.in[k] + h * dim + v * VEC + j));
      }
    }
#pragma unroll
    for (int k = 0; k < Sides; ++k) {
      sum[k] = group_sum(sum[k], group);
      if (team_lane == 0 && first + lane / group < units) sides.out[k][unit] = from_accum<R>(sum[k]);
    }
  }
}

// Block b takes `rows` rows from b * rows; a thread per (h, c) writes dx = sum over sides of
// grad * att (dx not null; added to dx's values where accumulate, rounded once) and its share of
// each side's att gradient, the sum of grad * x over the block's rows (partial not null). A side
// whose gradient is absent (null) adds nothing.
template <typename T, typename R, int Sides>
__global__ void node_logits_backward_kernel(SidePointers<R> grads, const R* att0, const R* att1, Rows x,
                                            int64_t heads, int64_t dim, T* __restrict__ dx, bool accumulate,
                                            accum_t<T>* __restrict__ partial, int64_t rows) {
  using A = accum_t<T>;
  const T* data = static_cast<const T*>(x.data);
  const int64_t width = heads * dim;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows;
  const int64_t last = first + rows < x.num_rows ? first + rows : x.num_rows;
  const R* att[2] = {att0, att1};
  for (int64_t hc = threadIdx.x; hc < width; hc += blockDim.x) {
    const int64_t h = hc / dim, c = hc - h * dim;
    A a[Sides], sum[Sides];
#pragma unroll
    for (int k = 0; k < Sides; ++k) {
      a[k] = to_accum(att[k][hc]);
      sum[k] = 0;
    }
#pragma unroll 4
    for (int64_t n = first; n < last; ++n) {
      A g[Sides];
#pragma unroll
      for (int k = 0; k < Sides; ++k) g[k] = grads.in[k] != nullptr ? to_accum(grads.in[k][n * heads + h]) : A(0);
      if (partial != nullptr) {
        const A value = to_accum(data[n * x.row_stride + h * x.head_stride + c]);
#pragma unroll
        for (int k = 0; k < Sides; ++k) sum[k] += g[k] * value;
      }
      if (dx != nullptr) {
        A d = g[0] * a[0];
#pragma unroll
        for (int k = 1; k < Sides; ++k) d += g[k] * a[k];
        T& target = dx[n * width + hc];
        target = from_accum<T>(accumulate ? to_accum(target) + d : d);
      }
    }
    if (partial != nullptr) {
#pragma unroll
      for (int k = 0; k < Sides; ++k) partial[(blockIdx.x * Sides + k) * width + hc] = sum[k];
    }
  }
}

// sides is 1 or 2 (checked by the caller).
template <typename F>
void dispatch_sides(int64_t sides, F&& f) {
  if (sides == 1) {
    f(std::integral_constant<int, 1>());
  } else {
    f(std::integral_constant<int, 2>());
  }
}

// Calls f(T{}, R{}) for x's element type T and the logits' type R: T, or T's accumulation type
// where accum_result (the two are one type for float and double).
template <typename F>
void dispatch_logits(ScalarKind scalar, bool accum_result, F&& f) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, accum_t<T>>) {
      f(zero, zero);
    } else if (accum_result) {
      f(zero, accum_t<T>{});
    } else {
      f(zero, zero);
    }
  });
}

}  // namespace

int64_t node_logits_blocks(int64_t num_rows) {
  return std::max<int64_t>(1, std::min((num_rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxBlocks));
}

void launch_node_logits(const Rows& x, int64_t heads, int64_t dim, const LogitSides& sides, ScalarKind scalar,
                        bool accum_result, cudaStream_t stream) {
  if (x.num_rows * heads == 0) return;
  dispatch_logits(scalar, accum_result, [&](auto x_zero, auto result_zero) {
    using T = decltype(x_zero);
    using R = decltype(result_zero);
    const SidePointers<R> pointers{{static_cast<const R*>(sides.in[0]), static_cast<const R*>(sides.in[1])},
                                   {static_cast<R*>(sides.out[0]), static_cast<R*>(sides.out[1])}};
    const bool wide = rows_vectorizable<T>(x, dim);
    const int group = group_size(wide ? dim / wide_vec<T>() : dim);
    const int64_t warps = (x.num_rows * heads + 32 / group - 1) / (32 / group);
    dispatch_sides(sides.count, [&](auto sides_constant) {
      constexpr int kSides = decltype(sides_constant)::value;
      auto launch = [&](auto kernel) {
        kernel<<<grid_blocks(kernel, warps * 32), kBlockThreads, 0, stream>>>(x, heads, dim, pointers, group);
      };
      if (wide) {
        launch(node_logits_kernel<T, R, wide_vec<T>(), kSides>);
      } else {
        launch(node_logits_kernel<T, R, 1, kSides>);
      }
    });
  });
}

void launch_node_logits_backward(const LogitSides& grads, const void* const att[2], const Rows& x, int64_t heads,
                                 int64_t dim, void* dx, bool accumulate, void* partial, void* datt,
                                 ScalarKind scalar, bool accum_result, cudaStream_t stream) {
  const int64_t width = heads * dim;
  if (width == 0 || x.num_rows == 0 || (dx == nullptr && datt == nullptr)) return;
  const int64_t blocks = node_logits_blocks(x.num_rows);
  const int64_t rows = (x.num_rows + blocks - 1) / blocks;
  const int threads = static_cast<int>(std::min<int64_t>(1024, (width + 31) / 32 * 32));
  dispatch_logits(scalar, accum_result, [&](auto x_zero, auto result_zero) {
    using T = decltype(x_zero);
    using R = decltype(result_zero);
    using A = accum_t<T>;
    const SidePointers<R> pointers{{static_cast<const R*>(grads.in[0]), static_cast<const R*>(grads.in[1])},
                                   {nullptr, nullptr}};
    dispatch_sides(grads.count, [&](auto sides_constant) {
      node_logits_backward_kernel<T, R, decltype(sides_constant)::value>
          <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
              pointers, static_cast<const R*>(att[0]), static_cast<const R*>(att[1]), x, heads, dim,
              static_cast<T*>(dx), accumulate, datt != nullptr ? static_cast<A*>(partial) : nullptr, rows);
    });
    if (datt != nullptr) {
      launch_sum_partials<A, R>(static_cast<const A*>(partial), static_cast<R*>(datt), blocks, grads.count * width,
                                stream);
    }
  });
}

}  // namespace edgedot
