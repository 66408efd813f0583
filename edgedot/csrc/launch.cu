// Launch sizing, cached: these queries cost microseconds, and small problems are launch-bound.
#include <mutex>
#include <unordered_map>

#include "common.cuh"

namespace edgedot {

int sm_count() {
  static std::mutex mutex;
  static std::unordered_map<int, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 1;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return cache[device] = sms;
}

int blocks_per_sm(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second;
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kBlockThreads, 0);
  return cache[kernel] = blocks > 0 ? blocks : 1;
}

}  // namespace edgedot
