// The forward of every score's attention (engine.cuh, scores.cuh, gat_scores.cuh).
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_attention_forward(const AttentionForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.scale_heads != nullptr) {
    launch_forward<CosineScore>(a, scalar, stream);
  } else {
    launch_forward<DotScore>(a, scalar, stream);
  }
}

void launch_gat_forward(const GatForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_forward<Gatv2Score>(a, scalar, stream);
  } else {
    launch_forward<GatScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
