// The dropout mask of the fused kernels: element c of a call is kept when a hash of the call's
// (seed, offset) and c clears the threshold. The same function as edgedot/runtime/dropout.py's on the CPU,
// so a mask depends on neither the device nor the order the elements are visited in.
#pragma once

#include <cstdint>

#include "common/edgedot.h"

namespace edgedot {

// Multiply-xorshift integer hashes: 32 bits for the per-element rounds, 64 (splitmix64's finaliser)
// for the key.
__host__ __device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// One 64-bit key per call: calls that differ only in the offset get unrelated masks.
__host__ __device__ __forceinline__ uint64_t dropout_key(uint64_t seed, uint64_t offset) {
  return mix64(seed ^ mix64(offset + 0x9e3779b97f4a7c15ull));
}

// The key of r, unpacked on the device (torch's at::cuda::philox::unpack, for DropoutRng). With
// r.record set, the grid's first thread writes the (seed, offset) it read there, for the backward.
__device__ __forceinline__ uint64_t unpack_dropout_key(const DropoutRng& r) {
  uint64_t seed = r.seed, offset = r.offset;
  if (r.seed_ptr != nullptr) {
    seed = static_cast<uint64_t>(*r.seed_ptr);
    offset = static_cast<uint64_t>(*r.offset_ptr) + r.offset_add;
  }
  if (r.record != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    r.record[0] = static_cast<int64_t>(seed);
    r.record[1] = static_cast<int64_t>(offset);
  }
  return dropout_key(seed, offset);
}

// Whether element c survives under key; threshold = floor(p * 2**32).
__host__ __device__ __forceinline__ bool dropout_keep(uint64_t key, uint64_t c, uint64_t threshold) {
  uint32_t u = mix32(static_cast<uint32_t>(c) ^ static_cast<uint32_t>(key));
  u = mix32(u ^ static_cast<uint32_t>(c >> 32) ^ static_cast<uint32_t>(key >> 32));
  return static_cast<uint64_t>(u) >= threshold;
}

// keep / (1 - p) for element c: 1 without dropout.
template <typename A>
__device__ __forceinline__ A dropout_weight(const Dropout& d, uint64_t key, uint64_t c) {
  if (d.threshold == 0) return A(1);
  return dropout_keep(key, c, d.threshold) ? static_cast<A>(d.keep_scale) : A(0);
}

}  // namespace edgedot
