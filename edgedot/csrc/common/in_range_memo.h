// What a checked forward found in range (edge_dot/edge_dot_ops.cpp), remembered across calls; the
// one memo of the process is in_range_memo() (common/graph_checks.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace edgedot {

// Index tensors a checked forward found in range, each remembered until its memory changes, by the
// rule of edgedot/runtime/checks.py:TensorMemo: keyed on the tensor's base (itself, or the tensor a view
// views, which shares its version counter) and the view's place in it, so edge_index[0], a new
// view every call, finds the previous call's entry; valid while that base lives, keeps its memory
// and its version. Repeated calls on one graph then neither check nor wait. Here rather than in
// Python, where the lookup cost as much host time as a quarter of a small call.
class InRangeMemo {
 public:
  // Whether idx was found in range for at most num_rows rows and is unchanged since.
  bool covers(const at::Tensor& idx, int64_t num_rows) {
    if (idx.is_inference()) return false;  // no version counter: checked every call
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(key_of(idx, base));
    return it != entries_.end() && !it->second.base.expired() && it->second.version == idx._version() &&
           it->second.data == idx.data_ptr() && it->second.num_rows <= num_rows;
  }

  void add(const at::Tensor& idx, int64_t num_rows) {
    if (idx.is_inference()) return;
    const at::TensorBase& base = base_of(idx);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() >= sweep_at_) {
      for (auto it = entries_.begin(); it != entries_.end();) it = it->second.base.expired() ? entries_.erase(it) : ++it;
      sweep_at_ = std::max<size_t>(kFirstSweep, 2 * entries_.size());
    }
    // The weak reference keeps a dead base's TensorImpl, part of the key, from being reused until
    // its entry is swept: a new tensor in freed memory never matches.
    entries_.insert_or_assign(key_of(idx, base),
                              Entry{WeakImpl(base.getIntrusivePtr()), idx._version(), idx.data_ptr(), num_rows});
  }

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // (base, storage offset, length, stride, dtype): index tensors are 1-D (valid_inputs).
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
    int64_t num_rows;
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

InRangeMemo& in_range_memo();

}  // namespace edgedot
