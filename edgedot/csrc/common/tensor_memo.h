// Facts about index tensors, remembered across calls until their data may have changed: the one
// memo of edge_dot's checked forward (edge_dot/edge_dot_ops.cpp) and the memos of the deferred
// graph check (common/graph_checks.cpp), both reached through in_range_memo() and friends.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

namespace edgedot {

// A Fact per 1-D index tensor, remembered until its memory changes: keyed on the tensor's base
// (itself, or the tensor a view views, which shares its version counter) and the view's place in
// it, so edge_index[0], a new view every call, finds the previous call's entry; valid while that
// base lives, keeps its memory and its version. A tensor that shares the memory but not the
// counter (.data, .detach()) has another base, so it is never trusted on another's word.
// Inference tensors have no version counter: nothing is remembered for them.
template <class Fact>
class TensorMemo {
 public:
  std::optional<Fact> get(const at::Tensor& idx) {
    if (idx.is_inference()) return std::nullopt;
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(key_of(idx, base));
    if (it == entries_.end() || it->second.base.expired() || it->second.version != idx._version() ||
        it->second.data != idx.data_ptr()) {
      return std::nullopt;
    }
    return it->second.fact;
  }

  void put(const at::Tensor& idx, Fact fact) {
    if (idx.is_inference()) return;
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() >= sweep_at_) {
      for (auto it = entries_.begin(); it != entries_.end();) {
        it = it->second.base.expired() ? entries_.erase(it) : ++it;
      }
      sweep_at_ = std::max<size_t>(kFirstSweep, 2 * entries_.size());
    }
    // The weak reference keeps a dead base's TensorImpl, part of the key, from being reused until
    // its entry is swept: a new tensor in freed memory never matches.
    entries_.insert_or_assign(key_of(idx, base),
                              Entry{WeakImpl(base.getIntrusivePtr()), idx._version(), idx.data_ptr(), fact});
  }

  void forget(const at::Tensor& idx) {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(key_of(idx, base_of(idx)));
  }

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // (base, storage offset, length, stride, dtype): index tensors are 1-D.
  using Key = std::tuple<const c10::TensorImpl*, int64_t, int64_t, int64_t, int>;
  struct KeyHash {
    size_t operator()(const Key& k) const {
      size_t h = std::hash<const void*>()(std::get<0>(k));
      for (const int64_t x : {std::get<1>(k), std::get<2>(k), std::get<3>(k), int64_t{std::get<4>(k)}}) {
        h = h * 1000003u ^ std::hash<int64_t>()(x);
      }
      return h;
    }
  };
  struct Entry {
    WeakImpl base;
    int64_t version;
    const void* data;
    Fact fact;
  };
  static const at::TensorBase& base_of(const at::Tensor& idx) { return idx.is_view() ? idx._base() : idx; }
  static Key key_of(const at::Tensor& idx, const at::TensorBase& base) {
    return {base.unsafeGetTensorImpl(), idx.storage_offset(), idx.size(0), idx.stride(0),
            static_cast<int>(idx.scalar_type())};
  }
  static constexpr size_t kFirstSweep = 1024;
  std::mutex mutex_;
  std::unordered_map<Key, Entry, KeyHash> entries_;
  size_t sweep_at_ = kFirstSweep;
};

// Index tensors found inside [0, num_rows) (the fact: num_rows). The kernels never read out of
// range whatever this says: an index changed behind PyTorch's back yields NaN, not a crash.
class InRangeMemo : public TensorMemo<int64_t> {
 public:
  // Whether idx was found in range for at most num_rows rows and is unchanged since.
  bool covers(const at::Tensor& idx, int64_t num_rows) {
    const std::optional<int64_t> known = get(idx);
    return known.has_value() && *known <= num_rows;
  }
};

// edge_dot's checked forward's memo (its check waits for its verdict).
InRangeMemo& in_range_memo();

}  // namespace edgedot
