// Pieces shared by the kernels: element types, vector loads, thread groups, launch sizing.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/edgedot.h"

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

// load_vec of 16 bytes through the read-only path that asks L2 to fetch the whole aligned 256-byte
// block on a miss. Inline asm can stop the compiler from putting the rest of a kernel's loads on the
// read-only path (NOTES.md), so this lives in kernel instantiations of its own.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec_whole_block(const T* p) {
  static_assert(sizeof(Vec<T, VEC>) == 16, "16-byte vectors only");
  uint4 bits;
  asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(bits.x), "=r"(bits.y), "=r"(bits.z), "=r"(bits.w)
      : "l"(p));
  Vec<T, VEC> v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

// Two half-type elements as one word, for conversions two at a time.
template <typename T> struct Pair { using type = void; };
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
// bf16 is the high half of a float: two bit operations per pair.
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) {
  const unsigned bits = *reinterpret_cast<const unsigned*>(&x);
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

// acc + <x, y> over one vector of each row. Half types convert pairs, which keeps fewer
// registers live than converting element by element.
template <typename T, int VEC>
__device__ __forceinline__ accum_t<T> dot_add(accum_t<T> acc, const Vec<T, VEC>& x, const Vec<T, VEC>& y) {
  using P = typename Pair<T>::type;
  if constexpr (!std::is_void_v<P> && VEC % 2 == 0) {
    const P* xp = reinterpret_cast<const P*>(x.v);
    const P* yp = reinterpret_cast<const P*>(y.v);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      const float2 a = to_float2(xp[j]);
      const float2 b = to_float2(yp[j]);
      acc = fmaf(a.x, b.x, acc);
      acc = fmaf(a.y, b.y, acc);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += to_accum(x.v[j]) * to_accum(y.v[j]);
  }
  return acc;
}

// acc += g * x over one vector, converting half types in pairs like dot_add.
template <typename T, int VEC>
__device__ __forceinline__ void add_scaled_vec(accum_t<T> (&acc)[VEC], accum_t<T> g, const Vec<T, VEC>& x) {
  using P = typename Pair<T>::type;
  if constexpr (!std::is_void_v<P> && VEC % 2 == 0) {
    const P* xp = reinterpret_cast<const P*>(x.v);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      const float2 a = to_float2(xp[j]);
      acc[2 * j] = fmaf(g, a.x, acc[2 * j]);
      acc[2 * j + 1] = fmaf(g, a.y, acc[2 * j + 1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += g * to_accum(x.v[j]);
  }
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
// Blocks of block_threads threads of kernel that one SM holds at once (at least 1).
int blocks_per_sm(const void* kernel, int block_threads = kBlockThreads);
// Whether the current device takes cooperative launches (grid-wide syncs).
bool cooperative_launch();

// Blocks for `threads` threads: enough to fill every SM at the kernel's occupancy, no more,
// since the kernels stride over their work.
template <typename Kernel>
inline int grid_blocks(Kernel kernel, int64_t threads) {
  const int64_t needed = (threads + kBlockThreads - 1) / kBlockThreads;
  const int64_t full = static_cast<int64_t>(sm_count()) * blocks_per_sm(reinterpret_cast<const void*>(kernel));
  return static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full);
}

// kernel<<<blocks, threads, 0, stream>>>(args...) launched with one launch attribute; the launch's
// status.
template <typename... KernelArgs, typename... Args>
inline cudaError_t launch_with(cudaLaunchAttribute attribute, void (*kernel)(KernelArgs...), int blocks, int threads,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Launches kernel<<<blocks, kBlockThreads, 0, stream>>>(args...) as a programmatic dependent launch:
// its blocks may be scheduled while the previous kernel of the stream finishes, and the kernel
// must call wait_for_previous_grid() before it touches memory. Small graphs are bound by launch
// latency, and the overlap hides part of it.
template <typename... KernelArgs, typename... Args>
inline void launch_dependent(void (*kernel)(KernelArgs...), int blocks, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  launch_with(attribute, kernel, blocks, kBlockThreads, stream, std::forward<Args>(args)...);
}

// Launches kernel<<<blocks, threads, 0, stream>>>(args...) with every block resident at once, so
// that it may sync the whole grid (cooperative_groups' grid.sync). Returns the launch's status: a
// device without cooperative launches, or a grid larger than it holds at once, refuses it.
template <typename... KernelArgs, typename... Args>
inline cudaError_t launch_cooperative(void (*kernel)(KernelArgs...), int blocks, int threads, cudaStream_t stream,
                                      Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  return launch_with(attribute, kernel, blocks, threads, stream, std::forward<Args>(args)...);
}

// First statement of a kernel started by launch_dependent: waits until the previous kernel of the
// stream has completed and its writes are visible (the ordering of a plain launch), then lets the
// next dependent launch be scheduled, which in turn waits here before reading anything.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
#endif
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
