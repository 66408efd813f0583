// The forward of AGNN's cosine score (CosineScore).
#include "attention/scores.cuh"

namespace edgedot {

void launch_cosine_forward(const AttentionForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  launch_forward<CosineScore>(a, scalar, stream);
}

}  // namespace edgedot
