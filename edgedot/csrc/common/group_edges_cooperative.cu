// The groupings of a small batch in one launch: the keys of launch_sort_by_row, sorted, then
// launch_group_edges' groupings, all in one cooperative kernel whose phases are separated by
// grid-wide syncs. CUB's sort takes a histogram, a scan and one launch per 8-bit pass between the
// key kernel and the grouping kernel; on a mini-batch those launches cost the host more than the
// sort costs the device.
//
// Where the key space is small beside the keys (a mini-batch's rows), a counting sort serves: each
// row's count, a scan of the counts (the offsets, and each row's first place), each entry placed at
// its row's cursor by an atomic, then each entry's place within its row recomputed as its rank by
// edge position: four short phases where a mini-batch's radix sort takes three passes of two, and
// the ranks give the stable sort's order. A row longer than kRankedRowMax (a hub, or many
// out-of-range indices) would make the ranks quadratic: the grid sees it after the scan and sorts
// by radix.
//
// The radix sort is a stable LSD sort, so its groupings are the same bits as well. Each block ranks
// one tile of keys per pass (cub::BlockRadixRankMatch, stable over the tile's warp-striped order),
// writes its digit counts, and after a grid sync reads every tile's counts to place its keys: every
// key's place follows from counts alone, so no block waits on another's progress but at the syncs.
// A tile's keys go out through shared memory in their sorted order, so that the keys of one digit
// leave as contiguous runs (coalesced) rather than one scattered word each: the grid's syncs wait
// for every block's writes. Small batches take tiles of half the keys, so that more blocks share
// each pass.
#include <cooperative_groups.h>

#include <initializer_list>

#include <cub/block/block_radix_rank.cuh>
#include <cub/block/block_scan.cuh>

#include "common/grouping.cuh"

namespace edgedot {
namespace {

namespace cg = cooperative_groups;

constexpr int kSortThreads = 512;
constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;
static_assert(kSortThreads == 2 * kDigits, "two threads per digit sum the tiles' counts");
// Tiles past which the CUB sort serves: each block reads every tile's counts once a pass, which
// grows with the square of the tiles.
constexpr int kMaxTiles = 128;
// Keys per thread: the small tiles where the grid holds enough of them, else the large.
constexpr int kSmallKeysPerThread = 8;
constexpr int kLargeKeysPerThread = 16;

using DigitRank = cub::BlockRadixRankMatch<kSortThreads, kDigitBits, /*IS_DESCENDING=*/false>;
using DigitScan = cub::BlockScan<int32_t, kSortThreads>;

__host__ __device__ constexpr int64_t tile_keys(int keys_per_thread) { return int64_t{kSortThreads} * keys_per_thread; }

int64_t tiles_of(int64_t num_keys, int keys_per_thread) {
  return (num_keys + tile_keys(keys_per_thread) - 1) / tile_keys(keys_per_thread);
}

// The keys per thread of a batch of num_keys keys in `tiles` tiles (cooperative_grouping_tiles).
int keys_per_thread(int64_t num_keys, int tiles) {
  return tiles == tiles_of(num_keys, kSmallKeysPerThread) ? kSmallKeysPerThread : kLargeKeysPerThread;
}

// Bits [shift, shift + bits) of a key.
struct KeyDigit {
  uint32_t shift, mask;
  __device__ __forceinline__ uint32_t Digit(uint32_t key) const { return (key >> shift) & mask; }
};

struct SortBuffers {
  int32_t* keys[2];  // a pass reads one buffer and writes the other
  int32_t* positions[2];
  int32_t* tile_counts;  // [tiles][kDigits]: the keys of each digit in each tile, this pass
  int32_t* row_counts;   // [key space]: each key's count, then its cursor (the counting sort)
  int32_t* block_sums;   // [grid]: the sum of each block's run of row_counts
  int32_t* block_maxes;  // [grid]: the largest count of each block's run
};

// Key spaces up to which the counting sort (and its scan of the counts for the offsets) serves,
// beyond the keys' count: past it, rows far outnumber edges, and the radix sort with a binary search
// a row costs less than a buffer and a scan of the key space.
constexpr int64_t kScanSlack = 1 << 20;

// Rows up to which the counting sort ranks a row's entries (each entry reads every entry of its row).
constexpr int32_t kRankedRowMax = 512;

bool sorts_by_count(int64_t num_keys, int64_t key_space) { return key_space <= 4 * num_keys + kScanSlack; }

struct MaxOp {
  __device__ __forceinline__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

// The first and last key of a block's run of the key space.
struct KeyRun {
  int64_t begin, end;
};

__device__ __forceinline__ KeyRun key_run(int64_t key_space) {
  const int64_t run = (key_space + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(key_space, static_cast<int64_t>(blockIdx.x) * run);
  return {begin, min(key_space, begin + run)};
}

// A block's shared memory: the rank's, the scan's and the tile's keys (or positions) in sorted
// order, used in turn, and what a pass keeps per digit.
template <int KPT>
struct TileShared {
  union {
    typename DigitRank::TempStorage rank;
    typename DigitScan::TempStorage scan;
    int32_t sorted[kSortThreads * KPT];
  } temp;
  int32_t tile_prefix[kDigits + 1];  // this tile's keys of smaller digits (padding included)
  int32_t tile_sums[2][2][kDigits];  // [half of the tiles][tiles before this one, all tiles][digit]
  int32_t digit_base[kDigits];       // where this tile's keys of a digit go, less their rank
};

// One pass's first half for a tile of `valid` keys (the rest padding): ranks the keys by digit
// within the tile and writes the tile's count of each digit.
template <int KPT>
__device__ __forceinline__ void rank_tile(TileShared<KPT>& shared, uint32_t (&keys)[KPT], int (&ranks)[KPT],
                                          KeyDigit digit, int valid, int32_t* __restrict__ counts) {
  int prefix[DigitRank::BINS_TRACKED_PER_THREAD];
  DigitRank(shared.temp.rank).RankKeys(keys, ranks, digit, prefix);
  if (threadIdx.x < kDigits) shared.tile_prefix[threadIdx.x] = prefix[0];
  if (threadIdx.x == 0) shared.tile_prefix[kDigits] = static_cast<int32_t>(tile_keys(KPT));
  __syncthreads();
  if (threadIdx.x < kDigits) {
    // Padding keys hold the largest digit and rank after every real key.
    const int d = threadIdx.x;
    const int below = min(shared.tile_prefix[d], valid);
    const int through = min(shared.tile_prefix[d + 1], valid);
    counts[d] = through - below;
  }
}

// One pass's second half, after every tile's counts are written: where this tile's keys of each
// digit start (the keys of smaller digits in all tiles, plus those of its digit in earlier tiles).
template <int KPT>
__device__ __forceinline__ void place_tile(TileShared<KPT>& shared, const int32_t* __restrict__ tile_counts, int tile,
                                           int num_tiles) {
  // Two threads per digit, each summing half of the tiles.
  const int d = threadIdx.x % kDigits;
  const int half = threadIdx.x / kDigits;
  const int lo = half == 0 ? 0 : num_tiles / 2;
  const int hi = half == 0 ? num_tiles / 2 : num_tiles;
  int32_t before = 0, total = 0;
#pragma unroll 8
  for (int t = lo; t < hi; ++t) {
    const int32_t count = __ldcg(tile_counts + t * kDigits + d);
    total += count;
    before += t < tile ? count : 0;
  }
  shared.tile_sums[half][0][d] = before;
  shared.tile_sums[half][1][d] = total;
  __syncthreads();
  const int32_t digit_total =
      threadIdx.x < kDigits ? shared.tile_sums[0][1][threadIdx.x] + shared.tile_sums[1][1][threadIdx.x] : 0;
  int32_t digit_start;
  DigitScan(shared.temp.scan).ExclusiveSum(digit_total, digit_start);
  if (threadIdx.x < kDigits) {
    shared.digit_base[d] =
        digit_start + shared.tile_sums[0][0][d] + shared.tile_sums[1][0][d] - shared.tile_prefix[d];
  }
  __syncthreads();
}

// One pass's writes of a tile's valid keys and their positions, ranked (ranks: each entry's place in
// the tile's sorted order; the valid entries take places [0, valid)): each goes to shared memory at
// its place, then thread i writes places i, i + kSortThreads, ..., whose keys of one digit go to
// consecutive addresses.
template <int KPT>
__device__ __forceinline__ void write_tile(TileShared<KPT>& shared, const uint32_t (&keys)[KPT],
                                           const int32_t (&positions)[KPT], const int (&ranks)[KPT], int first_entry,
                                           int valid, KeyDigit digit, int32_t* __restrict__ out_keys,
                                           int32_t* __restrict__ out_positions) {
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    if (first_entry + j * 32 < valid) shared.temp.sorted[ranks[j]] = static_cast<int32_t>(keys[j]);
  }
  __syncthreads();
  int to[KPT];
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kSortThreads;
    if (i < valid) {
      const int32_t key = shared.temp.sorted[i];
      to[j] = shared.digit_base[digit.Digit(static_cast<uint32_t>(key))] + i;
      out_keys[to[j]] = key;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    if (first_entry + j * 32 < valid) shared.temp.sorted[ranks[j]] = positions[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kSortThreads;
    if (i < valid) out_positions[to[j]] = shared.temp.sorted[i];
  }
}

// The counting sort's phases (see the top of the file); every thread of the grid calls each, thread
// and threads its place in the grid. Keys come from edge_key (second_idx: null for one side).

// Calls f(key, position, place) for each key i < num_keys, thread and threads its place in the
// grid, place taken from the key's cursor in row_counts: lanes of a warp that share a key (a sampled
// batch's destinations come in runs) take their places with one atomic, the lowest lane's, each
// lane its rank among them past what it returns. Every lane of a warp calls it.
template <typename RowIdx, typename OtherIdx, typename F>
__device__ __forceinline__ void for_each_key(const RowIdx* __restrict__ row_idx,
                                             const OtherIdx* __restrict__ second_idx, int64_t num_keys,
                                             int32_t num_edges, int32_t num_rows, int32_t num_second_rows,
                                             int32_t* row_counts, int64_t thread, int64_t threads, F&& f) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t warp_start = thread - lane; warp_start < num_keys; warp_start += threads) {
    const int64_t i = warp_start + lane;
    int32_t key = -1, position = 0;
    if (i < num_keys) edge_key(row_idx, second_idx, i, num_edges, num_rows, num_second_rows, key, position);
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const int leader = __ffs(peers) - 1;
    int32_t first_place = 0;
    if (key >= 0 && lane == leader) first_place = atomicAdd(row_counts + key, __popc(peers));
    first_place = __shfl_sync(0xffffffffu, first_place, leader);
    if (key >= 0) f(key, position, first_place + __popc(peers & ((1u << lane) - 1)));
  }
}

// The exclusive sum of the counts over the key space: each side's offsets, and in row_counts each
// key's first place (its cursor). Each block scans its run after the sum of the runs before it.
// Returns the longest row's count, the same in every block.
template <int KPT, typename FirstOther, typename SecondOther>
__device__ __forceinline__ int32_t scan_rows(TileShared<KPT>& shared, const SortBuffers& buffers, int64_t key_space,
                                             int32_t num_edges, const TypedSide<FirstOther>& first,
                                             const TypedSide<SecondOther>& second, const cg::grid_group& grid) {
  const KeyRun run = key_run(key_space);
  int32_t own_sum = 0, own_max = 0;
  for (int64_t k = run.begin + threadIdx.x; k < run.end; k += kSortThreads) {
    const int32_t count = __ldcg(buffers.row_counts + k);
    own_sum += count;
    own_max = max(own_max, count);
  }
  int32_t unused, run_sum, run_max;
  DigitScan(shared.temp.scan).ExclusiveSum(own_sum, unused, run_sum);
  __syncthreads();
  DigitScan(shared.temp.scan).ExclusiveScan(own_max, unused, 0, MaxOp{}, run_max);
  if (threadIdx.x == 0) {
    buffers.block_sums[blockIdx.x] = run_sum;
    buffers.block_maxes[blockIdx.x] = run_max;
  }
  grid.sync();
  int32_t earlier = 0, longest_seen = 0;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += kSortThreads) {
    if (b < blockIdx.x) earlier += __ldcg(buffers.block_sums + b);
    longest_seen = max(longest_seen, __ldcg(buffers.block_maxes + b));
  }
  int32_t carry, longest;
  __syncthreads();  // (the scan's storage is used again)
  DigitScan(shared.temp.scan).ExclusiveSum(earlier, unused, carry);
  __syncthreads();
  DigitScan(shared.temp.scan).ExclusiveScan(longest_seen, unused, 0, MaxOp{}, longest);
  const int64_t first_keys = first.num_rows + 1;
  for (int64_t tile = run.begin; tile < run.end; tile += kSortThreads) {
    const int64_t k = tile + threadIdx.x;
    const int32_t count = k < run.end ? __ldcg(buffers.row_counts + k) : 0;
    int32_t before, tile_sum;
    __syncthreads();
    DigitScan(shared.temp.scan).ExclusiveSum(count, before, tile_sum);
    if (k < run.end) {
      const int32_t start = carry + before;
      buffers.row_counts[k] = start;
      if (k < first_keys) first.offsets[k] = start;
      else second.offsets[k - first_keys] = start - num_edges;
    }
    carry += tile_sum;
  }
  __syncthreads();  // the radix passes reuse the scan's shared storage
  return longest;
}

// Each entry at its key's cursor (taken by an atomic, in no set order): keys[0] and positions[0]
// hold the keys and edge positions by place, row_counts then each key's end.
template <typename RowIdx, typename OtherIdx>
__device__ __forceinline__ void scatter_rows(const RowIdx* __restrict__ row_idx,
                                             const OtherIdx* __restrict__ second_idx, int64_t num_keys,
                                             int32_t num_edges, int32_t num_rows, int32_t num_second_rows,
                                             const SortBuffers& buffers, int64_t thread, int64_t threads) {
  for_each_key(row_idx, second_idx, num_keys, num_edges, num_rows, num_second_rows, buffers.row_counts, thread,
               threads, [&](int32_t key, int32_t position, int32_t place) {
                 buffers.keys[0][place] = key;
                 buffers.positions[0][place] = position;
               });
}

// The groupings' entries (as write_entries) from the scattered rows: an entry's place in its row is
// the count of the row's entries of smaller edge position (positions are distinct within a side),
// the place a stable sort gives it.
template <typename FirstOther, typename SecondOther>
__device__ __forceinline__ void write_ranked_entries(const SortBuffers& buffers, int64_t num_keys, int32_t num_edges,
                                                     const TypedSide<FirstOther>& first,
                                                     const TypedSide<SecondOther>& second, RangeFlags range_flags,
                                                     int64_t thread, int64_t threads) {
  const int32_t first_keys = static_cast<int32_t>(first.num_rows + 1);
  const int32_t row_out_key = static_cast<int32_t>(first.num_rows);
  bool row_out = false, other_out = false;
  for (int64_t j = thread; j < num_keys; j += threads) {
    const int32_t key = __ldcg(buffers.keys[0] + j);
    const int32_t position = __ldcg(buffers.positions[0] + j);
    const int32_t begin = key == 0 ? 0 : __ldcg(buffers.row_counts + key - 1);
    const int32_t end = __ldcg(buffers.row_counts + key);
    int32_t rank[4] = {0, 0, 0, 0};
    int32_t m = begin;
    for (; m + 4 <= end; m += 4) {
#pragma unroll
      for (int u = 0; u < 4; ++u) rank[u] += __ldcg(buffers.positions[0] + m + u) < position;
    }
    for (; m < end; ++m) rank[0] += __ldcg(buffers.positions[0] + m) < position;
    const int64_t place = begin + rank[0] + rank[1] + rank[2] + rank[3];
    if (key < first_keys) {
      row_out |= key == row_out_key;
      other_out |= group_entry(first, key, position, place, 0);
    } else {
      group_entry(second, key, position, place - num_edges, first_keys);
    }
  }
  publish_range_flags(range_flags, row_out, other_out);
}

// num_tiles tiles of tile_keys(KPT) entries over the sides * num_edges keys of edge_key (second side
// from first.other_idx when sides is 2), block t sorting tile t; num_bits: the bits the largest key
// needs (key_bits); key_space: the keys' range (max key + 1) where the counting sort serves
// (buffers.row_counts then holds that many entries; its scan writes the offsets, also where a long
// row leaves the sort to the radix passes), else 0 (the radix sort, then a binary search a row).
// Every resident block is launched: those past the tiles only wait at the radix passes' syncs, and
// all of them take part in the other phases.
template <int KPT, typename RowIdx, typename OtherIdx>
__global__ void __launch_bounds__(kSortThreads, 1)
cooperative_grouping_kernel(const RowIdx* __restrict__ row_idx, int32_t num_edges, int sides, int num_bits,
                            int num_tiles, int64_t key_space, SortBuffers buffers, TypedSide<OtherIdx> first,
                            TypedSide<RowIdx> second, RangeFlags range_flags) {
  __shared__ TileShared<KPT> shared;
  const cg::grid_group grid = cg::this_grid();
  const int tile = static_cast<int>(blockIdx.x);
  const bool sorts = tile < num_tiles;  // the same for the whole block
  const int64_t num_keys = static_cast<int64_t>(sides) * num_edges;
  const int64_t tile_start = static_cast<int64_t>(tile) * tile_keys(KPT);
  const int valid = sorts ? static_cast<int>(min(num_keys - tile_start, tile_keys(KPT))) : 0;
  // Warp-striped: item j of a lane is entry warp * 32 * KPT + j * 32 + lane of the tile, the
  // order in which the rank counts, so keys of one digit keep their order (stable).
  const int first_entry = static_cast<int>(threadIdx.x / 32) * 32 * KPT + static_cast<int>(threadIdx.x % 32);
  const OtherIdx* second_idx = sides == 2 ? first.other_idx : nullptr;
  const int32_t num_rows = static_cast<int32_t>(first.num_rows);
  const int32_t num_second_rows = static_cast<int32_t>(first.num_other);

  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (key_space > 0) {  // the same for the whole grid
    for (int64_t k = thread; k < key_space; k += threads) buffers.row_counts[k] = 0;
    grid.sync();
    // Each key's count (the places taken are not kept).
    for_each_key(row_idx, second_idx, num_keys, num_edges, num_rows, num_second_rows, buffers.row_counts, thread,
                 threads, [](int32_t, int32_t, int32_t) {});
    grid.sync();
    const int32_t longest = scan_rows(shared, buffers, key_space, num_edges, first, second, grid);
    if (longest <= kRankedRowMax) {
      grid.sync();
      scatter_rows(row_idx, second_idx, num_keys, num_edges, num_rows, num_second_rows, buffers, thread, threads);
      grid.sync();
      write_ranked_entries(buffers, num_keys, num_edges, first, second, range_flags, thread, threads);
      return;
    }
    // The radix passes' first syncs order their writes after the scan's reads.
  }

  const int passes = (num_bits + kDigitBits - 1) / kDigitBits;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * kDigitBits;
    const KeyDigit digit{static_cast<uint32_t>(shift), (1u << min(kDigitBits, num_bits - shift)) - 1};
    uint32_t keys[KPT];
    int32_t positions[KPT];
    int ranks[KPT];
    if (sorts) {
      // Pass 0 reads the indices; pass p the keys and positions pass p - 1 wrote, past L1.
      const int32_t* in_keys = buffers.keys[(pass + 1) & 1] + tile_start;
      const int32_t* in_positions = buffers.positions[(pass + 1) & 1] + tile_start;
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const int i = first_entry + j * 32;
        // Padding: the largest key, ranked after every real key of its digit and never written.
        keys[j] = ~0u;
        positions[j] = 0;
        if (i < valid && pass == 0) {
          int32_t key;
          edge_key(row_idx, second_idx, tile_start + i, num_edges, num_rows, num_second_rows, key, positions[j]);
          keys[j] = static_cast<uint32_t>(key);
        } else if (i < valid) {
          keys[j] = static_cast<uint32_t>(__ldcg(in_keys + i));
          positions[j] = __ldcg(in_positions + i);
        }
      }
      rank_tile(shared, keys, ranks, digit, valid, buffers.tile_counts + tile * kDigits);
    }
    grid.sync();
    if (sorts) {
      place_tile(shared, buffers.tile_counts, tile, num_tiles);
      write_tile(shared, keys, positions, ranks, first_entry, valid, digit, buffers.keys[pass & 1],
                 buffers.positions[pass & 1]);
    }
    grid.sync();
  }
  // Plain loads: the grid sync orders them after every block's writes.
  const int sorted = (passes + 1) & 1;
  write_entries(buffers.keys[sorted], buffers.positions[sorted], num_edges, sides, first, second, range_flags, thread,
                threads);
  if (key_space == 0) write_searched_offsets(buffers.keys[sorted], num_edges, sides, first, second, thread, threads);
}

// Calls f(kernel, row index, other index) with the kernel for the index types and keys_per_thread
// (the indices: values of their types).
template <typename F>
void with_kernel(IndexKind row_index, IndexKind other_index, int keys_per_thread_, F&& f) {
  dispatch_index(row_index, [&](auto ri) {
    dispatch_index(other_index, [&](auto oi) {
      using RowIdx = decltype(ri);
      using OtherIdx = decltype(oi);
      if (keys_per_thread_ == kSmallKeysPerThread) {
        f(cooperative_grouping_kernel<kSmallKeysPerThread, RowIdx, OtherIdx>, ri, oi);
      } else {
        f(cooperative_grouping_kernel<kLargeKeysPerThread, RowIdx, OtherIdx>, ri, oi);
      }
    });
  });
}

// Blocks of a kernel the device holds at once: the grid of a cooperative launch.
int resident_blocks(const void* kernel) { return sm_count() * blocks_per_sm(kernel, kSortThreads); }

int resident_blocks(IndexKind row_index, IndexKind other_index, int keys_per_thread_) {
  int blocks = 0;
  with_kernel(row_index, other_index, keys_per_thread_,
              [&](auto kernel, auto, auto) { blocks = resident_blocks(reinterpret_cast<const void*>(kernel)); });
  return blocks;
}

}  // namespace

int cooperative_grouping_tiles(int64_t num_keys, IndexKind row_index, IndexKind other_index) {
  if (num_keys <= 0 || !cooperative_launch()) return 0;
  for (const int kpt : {kSmallKeysPerThread, kLargeKeysPerThread}) {
    const int64_t tiles = tiles_of(num_keys, kpt);
    if (tiles <= kMaxTiles && tiles <= resident_blocks(row_index, other_index, kpt)) return static_cast<int>(tiles);
  }
  return 0;
}

// The keys' range, max key + 1: the first side's rows and its key for out-of-range indices, then
// the second side's, offset past them.
int64_t key_space_of(const GroupSide& first, const GroupSide* second) {
  return second == nullptr ? first.num_rows + 1 : first.num_rows + 1 + first.num_other + 1;
}

int64_t cooperative_grouping_ints(int64_t num_keys, int tiles, const GroupSide& first, const GroupSide* second,
                                  IndexKind row_index) {
  const int64_t ints = 4 * num_keys + static_cast<int64_t>(tiles) * kDigits;
  const int64_t key_space = key_space_of(first, second);
  if (!sorts_by_count(num_keys, key_space)) return ints;
  return ints + key_space + 2 * resident_blocks(row_index, first.other_index, keys_per_thread(num_keys, tiles));
}

bool launch_group_edges_cooperative(const void* row_idx, IndexKind row_index, int64_t num_edges, int tiles,
                                    int32_t* scratch, const GroupSide& first, const GroupSide* second,
                                    RangeFlags range_flags, cudaStream_t stream) {
  const int sides = second == nullptr ? 1 : 2;
  const int64_t num_keys = sides * num_edges;
  const int64_t key_space = key_space_of(first, second);
  int32_t* row_counts = scratch + 4 * num_keys + static_cast<int64_t>(tiles) * kDigits;
  const int blocks = resident_blocks(row_index, first.other_index, keys_per_thread(num_keys, tiles));
  SortBuffers buffers{{scratch, scratch + num_keys},
                      {scratch + 2 * num_keys, scratch + 3 * num_keys},
                      scratch + 4 * num_keys,
                      row_counts,
                      row_counts + key_space,
                      row_counts + key_space + blocks};
  cudaError_t status = cudaSuccess;
  with_kernel(row_index, first.other_index, keys_per_thread(num_keys, tiles), [&](auto kernel, auto ri, auto oi) {
    using RowIdx = decltype(ri);
    using OtherIdx = decltype(oi);
    // One side: the second is never read (sides is 1).
    status = launch_cooperative(kernel, resident_blocks(reinterpret_cast<const void*>(kernel)), kSortThreads, stream,
                                static_cast<const RowIdx*>(row_idx), static_cast<int32_t>(num_edges), sides,
                                key_bits(key_space - 1), tiles, sorts_by_count(num_keys, key_space) ? key_space : 0,
                                buffers, typed<OtherIdx>(first),
                                typed<RowIdx>(second == nullptr ? first : *second), range_flags);
  });
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // a launch that could not start leaves nothing behind: the caller sorts with CUB
    return false;
  }
  return true;
}

}  // namespace edgedot
