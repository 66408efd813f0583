#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cmath>
#include <cstdint>
#include <mutex>

#include "attention/dropout_rng.h"
#include "common/check_message.h"

namespace edgedot {
namespace {

// Dropout of the fused kernels (edgedot/runtime/dropout.py, csrc/attention/dropout.cuh). A forward draws its (seed,
// offset) from a CUDA generator the way torch's fused dropout does (philox_cuda_state: plain values,
// or device pointers while a CUDA graph is captured, so that every replay moves the offset on) and
// its kernel records the pair it used in an int64 [2] tensor, rng_state; the backward reads the
// pair from there on the device. Nothing waits for the device. A new op adopts it with dropout_of,
// draw_dropout_rng in its forward and recorded_dropout_rng in its backward.

// Offsets a call takes from the generator's stream. The mask hashes the offset whole, so any step
// keeps calls apart; philox_cuda_state wants a multiple of 4.
constexpr uint64_t kDropoutOffsetStep = 4;

}  // namespace

// threshold and keep_scale of dropout_p; rng to be filled in by one of the functions below.
Dropout dropout_of(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, message("edgedot: dropout_p must lie in [0, 1], got ",
                                                                  dropout_p));
  // threshold = min(floor(p * 2**32), 2**32): p * 2**32 is exact in double.
  const double scaled = std::floor(dropout_p * 4294967296.0);
  const uint64_t threshold = scaled >= 4294967296.0 ? uint64_t{1} << 32 : static_cast<uint64_t>(scaled);
  const double keep_scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
  return Dropout{DropoutRng{}, threshold, keep_scale};
}

// A forward's (seed, offset) for tensors on `like`'s device, from `generator` (default: that
// device's default CUDA generator), and rng_state, the int64 [2] tensor its kernel records them in.
DropoutRng draw_dropout_rng(const c10::optional<at::Generator>& generator, const at::Tensor& like,
                            at::Tensor& rng_state) {
  if (generator.has_value()) {
    // torch.Generator("cuda") names no index: it draws for the current device.
    const c10::Device on = generator->device();
    const bool same =
        on.is_cuda() && (on.has_index() ? on.index() : c10::cuda::current_device()) == like.device().index();
    TORCH_CHECK_VALUE(same, message("edgedot: the dropout generator is on ", on, " but the inputs are on ",
                                    like.device(), "; pass a generator of their device"));
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(kDropoutOffsetStep);
  }
  rng_state = at::empty({2}, like.options().dtype(at::kLong));
  DropoutRng r{};
  if (philox.captured_) {
    r.seed_ptr = philox.seed_.ptr;
    r.offset_ptr = philox.offset_.ptr;
    r.offset_add = philox.offset_intragraph_;
  } else {
    r.seed = philox.seed_.val;
    r.offset = philox.offset_.val;
  }
  r.record = rng_state.data_ptr<int64_t>();
  return r;
}

// A backward's (seed, offset): read by its kernels from the rng_state its forward returned.
DropoutRng recorded_dropout_rng(const c10::optional<at::Tensor>& rng_state, const at::Tensor& like) {
  TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->scalar_type() == at::kLong && rng_state->dim() == 1 &&
                        rng_state->numel() == 2 && rng_state->is_contiguous() && rng_state->device() == like.device(),
                    message("edgedot: dropout needs rng_state, the contiguous int64 [2] tensor the forward returned, "
                            "on ", like.device()));
  const int64_t* p = rng_state->data_ptr<int64_t>();
  DropoutRng r{};
  r.seed_ptr = p;
  r.offset_ptr = p + 1;
  return r;
}

}  // namespace edgedot
