// The backward's destination pass of graph attention: DotScore, and CosineScore for a learned scale
// (cosine_backward_dst.cu).
// Each score's passes build in a file of their own, so that the build compiles them in parallel.
#include "attention/scores.cuh"

namespace edgedot {

void launch_attention_backward_dst(const AttentionBackwardArgs& a, ScalarKind scalar,
                                   cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_cosine_backward_dst(a, scalar, stream);
  } else {
    launch_backward_dst<DotScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
