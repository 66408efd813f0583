// The lane-level vector work of the attention engine (engine.cuh): teams of lanes, a lane's vectors
// of a row held raw or widened, their dot products, scaled sums and stores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "common/common.cuh"

namespace edgedot {

__device__ __forceinline__ float fma_accum(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_accum(double a, double b, double c) { return fma(a, b, c); }

// A product rounded on its own, never fused into a later addition or subtraction: what one pass
// computes and another recomputes or reads from it must be the same bits.
__device__ __forceinline__ float mul_rounded(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rounded(double a, double b) { return __dmul_rn(a, b); }

// A score, rounded on its own (never fused into the subtraction of lse).
template <typename A>
__device__ __forceinline__ A scaled_score(A dot, A scale) {
  return mul_rounded(dot, scale);
}

// A team of `group` lanes (an aligned power of two up to 32) owns one (row, head) pair. Teams of a
// warp walk different rows, so they diverge: reductions shuffle within the team's own lanes.
struct Team {
  unsigned mask;
  int lane, group, first;  // first: the warp lane of the team's lane 0

  __device__ __forceinline__ explicit Team(int g) : group(g) {
    const int warp_lane = threadIdx.x & 31;
    lane = warp_lane & (g - 1);
    first = warp_lane - lane;
    mask = g == 32 ? 0xffffffffu : ((1u << g) - 1) << first;
  }

  // Sum over the team. The butterfly gives every lane the same bits (a + b == b + a), so decisions
  // taken on the result stay uniform across the team.
  template <typename A>
  __device__ __forceinline__ A sum(A x) const {
    A one[1] = {x};
    sum_each(one);
    return one[0];
  }

  // Sums each x[i] over the team, the same bits as sum(x[i]), in one set of rounds: independent
  // shuffles in flight, and one dispatch on the width. The rounds are unrolled for each width (as
  // a runtime loop, each round also paid a shift, a compare and a branch).
  template <int N, typename A>
  __device__ __forceinline__ void sum_each(A (&x)[N]) const {
    switch (group) {
      case 4: butterfly<4>(x); return;
      case 8: butterfly<8>(x); return;
      case 16: butterfly<16>(x); return;
      default: butterfly<32>(x); return;  // teams are aligned powers of two from 4 (kAttentionMinTeam)
    }
  }

  template <int kLanes, int N, typename A>
  __device__ __forceinline__ void butterfly(A (&x)[N]) const {
#pragma unroll
    for (int offset = kLanes >> 1; offset > 0; offset >>= 1)
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] += __shfl_xor_sync(mask, x[i], offset);
  }

  template <typename V>
  __device__ __forceinline__ V from(V x, int team_lane) const {
    return __shfl_sync(mask, x, first + team_lane);
  }
};

// Fewest lanes of a team: walk_edges gives each edge of a batch to a lane of its own. Lanes beyond
// a row's vectors add zeros, which leave the team's sums as they are (but for the sign of a zero).
constexpr int kAttentionMinTeam = 4;
static_assert(kAttentionMinTeam == 4, "Team::sum unrolls the widths 4 to 32");

// Team shape for rows of `vectors` vectors: lanes per team and vectors per lane (per_lane, a power
// of two). One vector per lane up to 32, so small heads spread over several lanes and the heads of
// one node (adjacent teams) read adjacent memory.
struct TeamShape {
  int group, per_lane;
};

inline TeamShape attention_team(int64_t vectors) {
  int group = kAttentionMinTeam;
  while (group < 32 && group < vectors) group *= 2;
  int per_lane = 1;
  while (static_cast<int64_t>(group) * per_lane < vectors) per_lane *= 2;
  return {group, per_lane};
}

// A lane's NV vectors of a row: vectors lane + u * group, u < NV, those below `vectors`.
template <typename T, int VEC, int NV>
struct LaneRow {
  using A = accum_t<T>;
  A x[NV][VEC];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < NV; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[u][j] = 0;
  }

  __device__ __forceinline__ A at(int u, int c) const { return x[u][c]; }
};

template <int NV>
__device__ __forceinline__ bool lane_has(const Team& t, int vectors, int u) {
  return t.lane + u * t.group < vectors;
}

template <typename T, int VEC>
__device__ __forceinline__ const T* lane_vec(const T* row, const Team& t, int u) {
  return row + (t.lane + u * t.group) * VEC;
}

// The bits of a vector of VEC elements of T, in 32-bit words (one 16-bit word for a single half
// type element): held as elements, half types would take a register per element.
template <typename T, int VEC>
struct VecBits {
  static constexpr int kBytes = sizeof(T) * VEC;
  using Word = std::conditional_t<kBytes >= 4, uint32_t, uint16_t>;
  Word w[kBytes / sizeof(Word)];
};

// A vector's bits through the read-only data cache: the kernels never write the tables they gather
// from, which the compiler does not infer by itself here.
template <typename T, int VEC>
__device__ __forceinline__ VecBits<T, VEC> load_bits_ro(const T* p) {
  constexpr int kBytes = VecBits<T, VEC>::kBytes;
  VecBits<T, VEC> b;
  if constexpr (kBytes == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    b.w[0] = v.x, b.w[1] = v.y, b.w[2] = v.z, b.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    b.w[0] = v.x, b.w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    b.w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  } else {
    static_assert(kBytes == 2, "vectors of 2, 4, 8 or 16 bytes");
    b.w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  }
  return b;
}

// Element c of a vector, widened to the accumulation type (exactly).
template <typename T, int VEC>
__device__ __forceinline__ accum_t<T> widen(const VecBits<T, VEC>& b, int c) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(b.w[c]);
  } else if constexpr (std::is_same_v<T, double>) {
    return __hiloint2double(static_cast<int>(b.w[2 * c + 1]), static_cast<int>(b.w[2 * c]));
  } else if constexpr (VecBits<T, VEC>::kBytes >= 4) {
    typename Pair<T>::type pair;  // half types: the element's half of its pair's word
    memcpy(&pair, &b.w[c / 2], sizeof(pair));
    const float2 f = to_float2(pair);
    return c % 2 == 0 ? f.x : f.y;
  } else {
    T x;
    memcpy(&x, &b.w[0], sizeof(x));
    return to_accum(x);
  }
}

// Raw vectors of a row, as loaded (widened where used, so that loads of several edges issue
// together and half types keep half the registers).
template <typename T, int VEC, int NV>
struct RawRow {
  VecBits<T, VEC> x[NV];

  // The lane's vectors of row; zeros for those it does not hold, and all zeros for a null row. Every
  // path sets every register: a vector left as it was would keep its registers live from one batch
  // (and unit) to the next, through the rest of the loop.
  __device__ __forceinline__ void load(const T* row, const Team& t, int vectors) {
    const VecBits<T, VEC> zero{};
#pragma unroll
    for (int u = 0; u < NV; ++u)
      x[u] = row != nullptr && lane_has<NV>(t, vectors, u) ? load_bits_ro<T, VEC>(lane_vec<T, VEC>(row, t, u)) : zero;
  }

  // Element c of vector u, widened.
  __device__ __forceinline__ accum_t<T> at(int u, int c) const { return widen(x[u], c); }
};

// Element c of vector u of raw (+ extra when add_extra), in the accumulation type.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> widened(const RawRow<T, VEC, NV>& raw, const RawRow<T, VEC, NV>& extra,
                                              bool add_extra, int u, int c) {
  accum_t<T> value = raw.at(u, c);
  if (add_extra) value += extra.at(u, c);
  return value;
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_widened(LaneRow<T, VEC, NV>& out, const T* row, const Team& t, int vectors) {
  RawRow<T, VEC, NV> raw;
  raw.load(row, t, vectors);
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    const bool has = lane_has<NV>(t, vectors, u);
#pragma unroll
    for (int c = 0; c < VEC; ++c) out.x[u][c] = has ? raw.at(u, c) : accum_t<T>(0);
  }
}

// This lane's part of <x, raw (+ extra)> over the vectors below `vectors`; x a LaneRow, or a RawRow
// widened element by element (the same values, without holding them widened).
template <typename X, typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> lane_dot(const X& x, const RawRow<T, VEC, NV>& raw,
                                               const RawRow<T, VEC, NV>& extra, bool add_extra, const Team& t,
                                               int vectors) {
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc = fma_accum(x.at(u, c), widened(raw, extra, add_extra, u, c), acc);
  }
  return acc;
}

// acc += g * (raw (+ extra)) over the vectors below `vectors`.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void add_scaled(LaneRow<T, VEC, NV>& acc, accum_t<T> g, const RawRow<T, VEC, NV>& raw,
                                           const RawRow<T, VEC, NV>& extra, bool add_extra, const Team& t,
                                           int vectors) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc.x[u][c] = fma_accum(g, widened(raw, extra, add_extra, u, c), acc.x[u][c]);
  }
}

// This lane's part of <x, y>; lanes without a vector hold zeros there.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> lane_dot(const LaneRow<T, VEC, NV>& x, const LaneRow<T, VEC, NV>& y) {
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc = fma_accum(x.x[u][j], y.x[u][j], acc);
  return acc;
}

// acc *= c.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void scale_row(LaneRow<T, VEC, NV>& acc, accum_t<T> c) {
#pragma unroll
  for (int u = 0; u < NV; ++u)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc.x[u][j] *= c;
}

// row = a * x + b * y (y only when use_y), written as T over the lane's vectors.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_combination(T* row, const Team& t, int vectors, accum_t<T> a,
                                                  const LaneRow<T, VEC, NV>& x, accum_t<T> b,
                                                  const LaneRow<T, VEC, NV>& y, bool use_y) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      accum_t<T> value = a * x.x[u][j];
      if (use_y) value = fma_accum(b, y.x[u][j], value);
      out.v[j] = from_accum<T>(value);
    }
    *reinterpret_cast<Vec<T, VEC>*>(row + (t.lane + u * t.group) * VEC) = out;
  }
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_zero_row(T* row, const Team& t, int vectors) {
  Vec<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = from_accum<T>(accum_t<T>(0));
#pragma unroll
  for (int u = 0; u < NV; ++u)
    if (lane_has<NV>(t, vectors, u)) *reinterpret_cast<Vec<T, VEC>*>(row + (t.lane + u * t.group) * VEC) = zero;
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_row(T* row, const Team& t, int vectors, accum_t<T> a,
                                          const LaneRow<T, VEC, NV>& x) {
  store_combination(row, t, vectors, a, x, a, x, false);
}

// row = a * x + plus, rounded once to T, where plus (a row of the same layout, read-only) is not
// null: an output epilogue's residual or bias. Else store_row.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_row_plus(T* row, const Team& t, int vectors, accum_t<T> a,
                                               const LaneRow<T, VEC, NV>& x, const T* plus) {
  if (plus == nullptr) {
    store_row(row, t, vectors, a, x);
    return;
  }
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
    const VecBits<T, VEC> p = load_bits_ro<T, VEC>(lane_vec<T, VEC>(plus, t, u));
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_accum<T>(fma_accum(a, x.x[u][j], widen(p, j)));
    *reinterpret_cast<Vec<T, VEC>*>(row + (t.lane + u * t.group) * VEC) = out;
  }
}

}  // namespace edgedot
