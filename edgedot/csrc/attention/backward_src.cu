// The backward's source pass of graph attention: DotScore, and CosineScore for a learned scale
// (cosine_backward_src.cu); and both passes' merges.
// Each score's passes build in a file of their own, so that the build compiles them in parallel.
#include "attention/scores.cuh"

namespace edgedot {

void launch_attention_backward_src(const AttentionBackwardArgs& a, ScalarKind scalar,
                                   cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_cosine_backward_src(a, scalar, stream);
  } else {
    launch_backward_src<DotScore>(a, scalar, stream);
  }
}

void launch_attention_backward_merges(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  launch_backward_merges<DotScore>(a, scalar, stream);  // CosineScore merges what DotScore does
}

int64_t attention_src_state_bytes(const AttentionBackwardArgs& a, ScalarKind scalar) {
  // CosineScore records what DotScore does.
  return a.dk != nullptr ? src_state_bytes<DotScore>(a, scalar) : 0;
}

}  // namespace edgedot
