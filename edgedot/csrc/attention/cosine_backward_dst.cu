// The backward's destination pass of AGNN's cosine score (CosineScore).
#include "attention/scores.cuh"

namespace edgedot {

void launch_cosine_backward_dst(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  launch_backward_dst<CosineScore>(a, scalar, stream);
}

}  // namespace edgedot
