// GAT's per-node logits a[n, h] = <x[n, h], att[h]> and their gradients. PyTorch computes them as
// (x * att).sum(-1): an [N, H, C] product in memory, and in the backward another, reduced over the
// N nodes by a reduce kernel with only H * C outputs to spread. Here the forward reads x once, and
// the backward reads x and writes dx in one pass, att's gradient summed per block of rows and then
// over the blocks in a fixed order (bitwise reproducible).
#include <algorithm>

#include "common/common.cuh"

namespace edgedot {

namespace {

// Rows of att's gradient each block sums, and at most this many blocks: a function of N alone, so
// the order of the sums does not depend on the device.
constexpr int64_t kRowsPerBlock = 64;
constexpr int64_t kMaxBlocks = 4096;

// A warp per (n, h): its lanes stride over the channels, then a butterfly sum.
template <typename T>
__global__ void node_logits_kernel(Rows x, int64_t heads, int64_t dim, const accum_t<T>* __restrict__ att,
                                   accum_t<T>* __restrict__ out) {
  using A = accum_t<T>;
  const T* data = static_cast<const T*>(x.data);
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t unit = warp; unit < x.num_rows * heads; unit += warps) {
    const int64_t n = unit / heads, h = unit - n * heads;
    const T* row = data + n * x.row_stride + h * x.head_stride;
    A sum = 0;
    for (int64_t c = lane; c < dim; c += 32) sum += to_accum(row[c]) * att[h * dim + c];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) out[unit] = sum;
  }
}

// Block b takes `rows` rows from b * rows; a thread per (h, c) writes dx = grad * att (dx not null)
// and its share of att's gradient, the sum of grad * x over the block's rows (partial not null).
template <typename T>
__global__ void node_logits_backward_kernel(const accum_t<T>* __restrict__ grad, Rows x, int64_t heads, int64_t dim,
                                            const accum_t<T>* __restrict__ att, T* __restrict__ dx,
                                            accum_t<T>* __restrict__ partial, int64_t rows) {
  using A = accum_t<T>;
  const T* data = static_cast<const T*>(x.data);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows;
  const int64_t last = first + rows < x.num_rows ? first + rows : x.num_rows;
  for (int64_t hc = threadIdx.x; hc < heads * dim; hc += blockDim.x) {
    const int64_t h = hc / dim, c = hc - h * dim;
    const A a = att[hc];
    A sum = 0;
    for (int64_t n = first; n < last; ++n) {
      const A g = grad[n * heads + h];
      if (partial != nullptr) sum += g * to_accum(data[n * x.row_stride + h * x.head_stride + c]);
      if (dx != nullptr) dx[n * heads * dim + hc] = from_accum<T>(g * a);
    }
    if (partial != nullptr) partial[blockIdx.x * heads * dim + hc] = sum;
  }
}

// att's gradient: the blocks' partial sums added in block order.
template <typename A>
__global__ void sum_partials_kernel(const A* __restrict__ partial, A* __restrict__ datt, int64_t blocks,
                                    int64_t width) {
  for (int64_t hc = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; hc < width;
       hc += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A sum = 0;
    for (int64_t b = 0; b < blocks; ++b) sum += partial[b * width + hc];
    datt[hc] = sum;
  }
}

}  // namespace

int64_t node_logits_blocks(int64_t num_rows) {
  return std::max<int64_t>(1, std::min((num_rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxBlocks));
}

void launch_node_logits(const Rows& x, int64_t heads, int64_t dim, const void* att, void* out, ScalarKind scalar,
                        cudaStream_t stream) {
  if (x.num_rows * heads == 0) return;
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    auto kernel = node_logits_kernel<T>;
    kernel<<<grid_blocks(kernel, x.num_rows * heads * 32), kBlockThreads, 0, stream>>>(
        x, heads, dim, static_cast<const A*>(att), static_cast<A*>(out));
  });
}

void launch_node_logits_backward(const void* grad, const Rows& x, int64_t heads, int64_t dim, const void* att,
                                 void* dx, void* partial, void* datt, ScalarKind scalar, cudaStream_t stream) {
  const int64_t width = heads * dim;
  if (width == 0 || x.num_rows == 0 || (dx == nullptr && datt == nullptr)) return;
  const int64_t blocks = node_logits_blocks(x.num_rows);
  const int64_t rows = (x.num_rows + blocks - 1) / blocks;
  const int threads = static_cast<int>(std::min<int64_t>(1024, (width + 31) / 32 * 32));
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    node_logits_backward_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        static_cast<const A*>(grad), x, heads, dim, static_cast<const A*>(att), static_cast<T*>(dx),
        datt != nullptr ? static_cast<A*>(partial) : nullptr, rows);
    if (datt != nullptr) {
      const int64_t sum_blocks = std::min<int64_t>((width + kBlockThreads - 1) / kBlockThreads, 1024);
      sum_partials_kernel<A><<<static_cast<unsigned>(sum_blocks), kBlockThreads, 0, stream>>>(
          static_cast<const A*>(partial), static_cast<A*>(datt), blocks, width);
    }
  });
}

}  // namespace edgedot
