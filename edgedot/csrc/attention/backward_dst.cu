// The backward's destination pass of every score's attention (engine.cuh, scores.cuh, gat_scores.cuh).
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_attention_backward_dst(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_backward_dst<CosineScore>(a, scalar, stream);
  } else {
    launch_backward_dst<DotScore>(a, scalar, stream);
  }
}

void launch_gat_backward_dst(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_backward_dst<Gatv2Score>(a, scalar, stream);
  } else {
    launch_backward_dst<GatScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
