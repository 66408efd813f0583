// Launch sizing, cached: these queries cost microseconds, and small problems are launch-bound.
#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/common.cuh"

namespace edgedot {

namespace {

int device_attribute(cudaDeviceAttr attr) {
  static std::mutex mutex;
  static std::unordered_map<int64_t, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  const int64_t key = static_cast<int64_t>(device) << 32 | static_cast<int64_t>(attr);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int value = 0;
  cudaDeviceGetAttribute(&value, attr, device);
  return cache[key] = value;
}

}  // namespace

int sm_count() { return std::max(device_attribute(cudaDevAttrMultiProcessorCount), 1); }

int64_t l2_cache_bytes() { return device_attribute(cudaDevAttrL2CacheSize); }

bool cooperative_launch() { return device_attribute(cudaDevAttrCooperativeLaunch) != 0; }

int blocks_per_sm(const void* kernel, int block_threads) {
  // Per (kernel, device): the occupancy depends on the device's registers and shared memory, and
  // a process may drive devices of different kinds. A kernel always runs with one block size.
  struct KeyHash {
    size_t operator()(const std::pair<const void*, int>& k) const {
      return std::hash<const void*>()(k.first) ^ (std::hash<int>()(k.second) * 0x9e3779b97f4a7c15ull);
    }
  };
  static std::mutex mutex;
  static std::unordered_map<std::pair<const void*, int>, int, KeyHash> cache;
  int device = 0;
  cudaGetDevice(&device);
  const std::pair<const void*, int> key{kernel, device};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, 0);
  return cache[key] = blocks > 0 ? blocks : 1;
}

}  // namespace edgedot
