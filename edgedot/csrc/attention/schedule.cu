// The chunk schedule of a grouping's long rows (RowChunks in edgedot.h), from its row offsets, in
// one scan and no host synchronisation: an exclusive scan of each row's (chunk count, is long)
// gives each row's first slot and each long row's place in the list of long rows; and the order the
// kernels take the other rows in (a radix sort by degree). The scan is one cooperative kernel (each
// block sums its rows, a grid sync, then each block scans its rows after the sums of the blocks
// before it) where the device takes one, else CUB's (two launches): a mini-batch step builds three
// schedules, and its launches cost the host more than the scans cost the device.
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "attention/engine.cuh"

namespace edgedot {

namespace {

// Edges of row r, clamped as the kernels clamp them (row_positions).
struct RowEdges {
  const int64_t* offsets;
  int64_t num_rows, num_edges;

  __device__ __forceinline__ int64_t operator()(int64_t r) const {
    const PositionRange p = clamped_positions(offsets[r], offsets[r + 1], num_edges);
    return p.end - p.begin;
  }
};

// Slots and long rows counted together in one 64-bit integer (slots << 32 | long rows), so that one
// plain sum serves both (a scan of a struct of the two took 13.3 us at 180k rows on the H200, this
// one 9.9). Neither field carries into the other: every slot holds an edge and every long row is a
// row, so both counts stay below 2**31.
constexpr int kSlotShift = 32;

__host__ __device__ __forceinline__ uint64_t slot_count(int64_t slots, int64_t long_rows) {
  return static_cast<uint64_t>(slots) << kSlotShift | static_cast<uint64_t>(long_rows);
}

// Row r's chunks (ceil(edges / chunk)) and 1 for a long row, else 0; 0 for r = num_rows, the
// scan's end.
struct RowSlotCount {
  RowEdges edges;
  int64_t chunk;

  __device__ __forceinline__ uint64_t operator()(int64_t r) const {
    if (r >= edges.num_rows) return 0;
    const int64_t d = edges(r);
    return is_long_row(d, chunk) ? slot_count((d + chunk - 1) / chunk, 1) : 0;
  }
};

// Writes the scan's value at row r: first_chunk[r], and r's place in long_rows if r is long; at
// r = num_rows the totals (all slots, the number of long rows).
struct WriteSchedule {
  RowSlotCount count;
  int64_t* first_chunk;
  int32_t* long_rows;
  int32_t* num_long;

  __device__ __forceinline__ void operator()(int64_t r, uint64_t before) const {
    first_chunk[r] = static_cast<int64_t>(before >> kSlotShift);
    const int32_t long_before = static_cast<int32_t>(before & 0xffffffffu);
    if (r == count.edges.num_rows) *num_long = long_before;
    else if (count(r) != 0) long_rows[long_before] = static_cast<int32_t>(r);
  }
};

// CUB's scan; with temp null, only the bytes it needs.
cudaError_t cub_schedule(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk,
                         int64_t* first_chunk, int32_t* long_rows, int32_t* num_long, void* temp, size_t& temp_bytes,
                         cudaStream_t stream) {
  const RowSlotCount count{RowEdges{offsets, num_rows, num_edges}, chunk};
  auto counts = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), count);
  auto out = thrust::make_tabulate_output_iterator(WriteSchedule{count, first_chunk, long_rows, num_long});
  return cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, out, static_cast<int32_t>(num_rows + 1), stream);
}

constexpr int kScanThreads = 512;
using SlotScan = cub::BlockScan<uint64_t, kScanThreads>;

// The same scan in one launch: block b scans the b-th of gridDim.x equal runs of the num_rows + 1
// entries, after the sums of the runs before it (block_sums, gridDim.x entries).
__global__ void __launch_bounds__(kScanThreads)
cooperative_schedule_kernel(WriteSchedule write, uint64_t* __restrict__ block_sums) {
  __shared__ typename SlotScan::TempStorage scan;
  const int64_t entries = write.count.edges.num_rows + 1;
  const int64_t run = (entries + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(entries, static_cast<int64_t>(blockIdx.x) * run);
  const int64_t end = min(entries, begin + run);
  uint64_t own = 0;
  for (int64_t r = begin + threadIdx.x; r < end; r += kScanThreads) own += write.count(r);
  uint64_t unused, run_sum;
  SlotScan(scan).ExclusiveSum(own, unused, run_sum);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = run_sum;
  cooperative_groups::this_grid().sync();
  uint64_t earlier = 0;
  for (unsigned b = threadIdx.x; b < blockIdx.x; b += kScanThreads) earlier += __ldcg(block_sums + b);
  uint64_t carry;
  __syncthreads();  // (scan's storage is used again)
  SlotScan(scan).ExclusiveSum(earlier, unused, carry);
  // Runs of kScanThreads entries, one a thread, each after the ones before.
  for (int64_t tile = begin; tile < end; tile += kScanThreads) {
    const int64_t r = tile + threadIdx.x;
    const uint64_t c = r < end ? write.count(r) : 0;
    uint64_t before, tile_sum;
    __syncthreads();
    SlotScan(scan).ExclusiveSum(c, before, tile_sum);
    if (r < end) write(r, carry + before);
    carry += tile_sum;
  }
}

// Blocks of the one-launch scan for num_rows, or 0 where the device takes no cooperative launch.
int cooperative_schedule_blocks(int64_t num_rows) {
  if (!cooperative_launch()) return 0;
  const int64_t wanted = (num_rows + 1 + kScanThreads - 1) / kScanThreads;
  const int64_t resident = static_cast<int64_t>(sm_count()) *
                           blocks_per_sm(reinterpret_cast<const void*>(cooperative_schedule_kernel), kScanThreads);
  return static_cast<int>(wanted < resident ? wanted : resident);
}

// The scan, one launch or CUB's; with temp null, only the bytes it needs (enough for either, so
// that a cooperative launch the device refuses falls back to CUB's).
cudaError_t schedule(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk, int64_t* first_chunk,
                     int32_t* long_rows, int32_t* num_long, void* temp, size_t& temp_bytes, cudaStream_t stream) {
  const int blocks = cooperative_schedule_blocks(num_rows);
  if (temp == nullptr) {
    const cudaError_t status =
        cub_schedule(offsets, num_rows, num_edges, chunk, first_chunk, long_rows, num_long, nullptr, temp_bytes, stream);
    const size_t sums_bytes = static_cast<size_t>(blocks) * sizeof(uint64_t);
    if (temp_bytes < sums_bytes) temp_bytes = sums_bytes;
    return status;
  }
  if (blocks > 0) {
    const RowSlotCount count{RowEdges{offsets, num_rows, num_edges}, chunk};
    const cudaError_t status = launch_cooperative(cooperative_schedule_kernel, blocks, kScanThreads, stream,
                                                  WriteSchedule{count, first_chunk, long_rows, num_long},
                                                  static_cast<uint64_t*>(temp));
    if (status == cudaSuccess) return status;
    (void)cudaGetLastError();  // not started: CUB's scan instead
  }
  return cub_schedule(offsets, num_rows, num_edges, chunk, first_chunk, long_rows, num_long, temp, temp_bytes,
                      stream);
}

// Degree key of each row (0 for a long row, which its chunks serve) and the rows' ids, to be sorted:
// the degree itself below kExactDegrees, so that the rows of one warp's teams have equal lengths
// (classes of 2^k .. 2^(k+1) - 1 edges leave a warp's teams idle in about 7% of their batches on a
// uniform graph of mean degree 12), and above it kExactDegrees + floor(log2(degree)).
constexpr int64_t kExactDegrees = 240;

__global__ void row_key_kernel(RowEdges edges, int64_t chunk, uint8_t* keys, int32_t* rows) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < edges.num_rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = edges(r);
    // d <= chunk <= 4096 outside long rows: keys up to 240 + 12 fit a byte.
    const int64_t log2_d = 63 - __clzll(static_cast<unsigned long long>(d));
    const int64_t key = d == 0 || is_long_row(d, chunk) ? 0 : d < kExactDegrees ? d : kExactDegrees + log2_d;
    keys[r] = static_cast<uint8_t>(key);
    rows[r] = static_cast<int32_t>(r);
  }
}

constexpr int kRowKeyBits = 8;

// The sort's temporary bytes (temp null) or the sort itself.
cudaError_t sort_rows(uint8_t* keys, int32_t* rows, int32_t* row_order, int64_t num_rows, void* temp,
                      size_t& temp_bytes, cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, keys, keys + num_rows, rows, row_order,
                                                   static_cast<int32_t>(num_rows), 0, kRowKeyBits, stream);
}

}  // namespace

size_t attention_row_order_temp_bytes(int64_t num_rows) {
  size_t bytes = 0;
  sort_rows(nullptr, nullptr, nullptr, num_rows, nullptr, bytes, nullptr);
  return bytes;
}

cudaError_t launch_attention_row_order(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk,
                                       uint8_t* keys, int32_t* rows, int32_t* row_order, void* temp,
                                       size_t temp_bytes, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((num_rows + 255) / 256, static_cast<int64_t>(sm_count()) * 8);
  row_key_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(RowEdges{offsets, num_rows, num_edges}, chunk,
                                                                     keys, rows);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  return sort_rows(keys, rows, row_order, num_rows, temp, temp_bytes, stream);
}

int64_t attention_chunk_edges(int64_t num_edges, int64_t heads, int64_t dim, int64_t dim_v, ScalarKind scalar) {
  const int64_t bytes = scalar == ScalarKind::f64 ? 8 : scalar == ScalarKind::f32 ? 4 : 2;
  const int64_t widest = dim > dim_v ? dim : dim_v;
  const int64_t team = attention_team((widest * bytes + 15) / 16).group;
  // Teams resident on the device (2048 threads an SM), and each one's share of the edges' heads.
  const int64_t teams = static_cast<int64_t>(sm_count()) * 2048 / team;
  const int64_t share = num_edges * heads / teams;
  int64_t chunk = 128;
  while (chunk < share && chunk < 4096) chunk *= 2;
  return chunk;
}

size_t attention_schedule_temp_bytes(int64_t num_rows) {
  size_t bytes = 0;
  schedule(nullptr, num_rows, 0, 1, nullptr, nullptr, nullptr, nullptr, bytes, nullptr);
  return bytes;
}

cudaError_t launch_attention_schedule(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk,
                                      int64_t* first_chunk, int32_t* long_rows, int32_t* num_long, void* temp,
                                      size_t temp_bytes, cudaStream_t stream) {
  return schedule(offsets, num_rows, num_edges, chunk, first_chunk, long_rows, num_long, temp, temp_bytes, stream);
}

}  // namespace edgedot
