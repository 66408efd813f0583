// Pieces shared by the kernels: element types, vector loads, thread groups, launch sizing.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "edgedot.h"

namespace edgedot {

constexpr int kBlockThreads = 256;
// Vectors of one row a lane holds per pass: with up to 32 lanes a group covers 128 vectors
// (512 floats) in one pass, so common rows sit in registers whole.
constexpr int kVectorsPerLane = 4;

// Half types accumulate in float, the others in their own type.
template <typename T> struct Accum { using type = T; };
template <> struct Accum<__half> { using type = float; };
template <> struct Accum<__nv_bfloat16> { using type = float; };
template <typename T> using accum_t = typename Accum<T>::type;

template <typename T> __device__ __forceinline__ accum_t<T> to_accum(T x) { return x; }
template <> __device__ __forceinline__ float to_accum(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_accum(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_accum(accum_t<T> x) { return x; }
template <> __device__ __forceinline__ __half from_accum<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_accum<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// VEC consecutive elements moved as one aligned load or store (16 bytes when VEC is the widest).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}

// Elements per 16-byte vector.
template <typename T> constexpr int wide_vec() { return 16 / sizeof(T); }

// Rows can be read as 16-byte vectors when every row and head starts 16-byte aligned.
template <typename T>
inline bool rows_vectorizable(const Rows& r, int64_t dim) {
  constexpr int v = wide_vec<T>();
  return reinterpret_cast<uintptr_t>(r.data) % 16 == 0 && r.row_stride % v == 0 &&
         r.head_stride % v == 0 && dim % v == 0;
}

template <typename Idx>
__device__ __forceinline__ bool in_range(Idx i, int64_t n) {
  return static_cast<uint64_t>(static_cast<int64_t>(i)) < static_cast<uint64_t>(n);
}

// Lanes per row: the fewest (a power of two up to 32) that cover `vectors` in one pass.
inline int group_size(int64_t vectors) {
  int g = 1;
  while (g < 32 && static_cast<int64_t>(g) * kVectorsPerLane < vectors) g *= 2;
  return g;
}

// Sum over the `group` lanes of an aligned power-of-two group; every lane of the warp must call.
template <typename A>
__device__ __forceinline__ A group_sum(A x, int group) {
  for (int offset = group >> 1; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

int sm_count();
int blocks_per_sm(const void* kernel);

// Blocks for `threads` threads: enough to fill every SM at the kernel's occupancy, no more,
// since the kernels stride over their work.
template <typename Kernel>
inline int grid_blocks(Kernel kernel, int64_t threads) {
  const int64_t needed = (threads + kBlockThreads - 1) / kBlockThreads;
  const int64_t full = static_cast<int64_t>(sm_count()) * blocks_per_sm(reinterpret_cast<const void*>(kernel));
  return static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full);
}

// Calls f(T{}) with the CUDA element type of `kind`.
template <typename F>
inline void dispatch_scalar(ScalarKind kind, F&& f) {
  switch (kind) {
    case ScalarKind::f32: f(float{}); break;
    case ScalarKind::f64: f(double{}); break;
    case ScalarKind::f16: f(__half{}); break;
    case ScalarKind::bf16: f(__nv_bfloat16{}); break;
  }
}

template <typename F>
inline void dispatch_index(IndexKind kind, F&& f) {
  if (kind == IndexKind::i32) f(int32_t{}); else f(int64_t{});
}

}  // namespace edgedot
