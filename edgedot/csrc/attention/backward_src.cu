// The backward's source pass of every score's attention (engine.cuh, scores.cuh, gat_scores.cuh).
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_attention_backward_src(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_backward_src<CosineScore>(a, scalar, stream);
  } else {
    launch_backward_src<DotScore>(a, scalar, stream);
  }
}

void launch_gat_backward_src(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_backward_src<Gatv2Score>(a, scalar, stream);
  } else {
    launch_backward_src<GatScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
