// The backward's source pass of AGNN's cosine score (CosineScore).
#include "attention/scores.cuh"

namespace edgedot {

void launch_cosine_backward_src(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  launch_backward_src<CosineScore>(a, scalar, stream);
}

}  // namespace edgedot
