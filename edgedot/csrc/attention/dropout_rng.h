// Dropout of the fused kernels on the torch side (attention/dropout_rng.cpp): a forward's
// Dropout from dropout_p (dropout_of), its (seed, offset) drawn from a CUDA generator
// (draw_dropout_rng), and a backward's read back from the forward's rng_state
// (recorded_dropout_rng).
#pragma once

#include <ATen/ATen.h>

#include "common/edgedot.h"

namespace edgedot {

Dropout dropout_of(double dropout_p);

DropoutRng draw_dropout_rng(const c10::optional<at::Generator>& generator, const at::Tensor& like,
                            at::Tensor& rng_state);

DropoutRng recorded_dropout_rng(const c10::optional<at::Tensor>& rng_state, const at::Tensor& like);

}  // namespace edgedot
