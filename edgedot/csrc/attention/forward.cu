// The forward of graph attention: DotScore, and CosineScore for a learned scale
// (cosine_forward.cu).
// Each score's passes build in a file of their own, so that the build compiles them in parallel.
#include "attention/scores.cuh"

namespace edgedot {

void launch_attention_forward(const AttentionForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_cosine_forward(a, scalar, stream);
  } else {
    launch_forward<DotScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
