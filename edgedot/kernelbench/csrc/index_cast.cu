// Floating-point index tensors to int32, both sides in one launch (the seed problem's inputs as
// KernelBench casts them; the library itself accepts integer indices only).
#include <cmath>

#include "common/common.cuh"

namespace edgedot {

namespace {

// Tensor.long() truncates toward zero; what no int32 holds (NaN, inf, |x| >= 2**31) becomes -1,
// an out-of-range row for every kernel.
template <typename T>
__device__ __forceinline__ int32_t truncated_index(T value) {
  const double x = static_cast<double>(to_accum(value));
  return (x > -2147483649.0 && x < 2147483648.0) ? static_cast<int32_t>(x) : -1;
}

template <typename T>
__global__ void cast_indices_kernel(const T* __restrict__ src_idx, const T* __restrict__ dst_idx, int64_t num_edges,
                                    int32_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_edges; i += stride) {
    if (src_idx != nullptr) out[i] = truncated_index(src_idx[i]);
    if (dst_idx != nullptr) out[num_edges + i] = truncated_index(dst_idx[i]);
  }
}

}  // namespace

void launch_cast_indices(const void* src_idx, const void* dst_idx, ScalarKind kind, int64_t num_edges, int32_t* out,
                         cudaStream_t stream) {
  if (num_edges == 0) return;
  dispatch_scalar(kind, [&](auto t) {
    using T = decltype(t);
    auto kernel = cast_indices_kernel<T>;
    kernel<<<grid_blocks(kernel, num_edges), kBlockThreads, 0, stream>>>(
        static_cast<const T*>(src_idx), static_cast<const T*>(dst_idx), num_edges, out);
  });
}

}  // namespace edgedot
