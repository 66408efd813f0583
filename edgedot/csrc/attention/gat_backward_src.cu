// The backward's source pass of GAT and GATv2 (GatScore, Gatv2Score), and both passes' merges.
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_gat_backward_src(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_backward_src<Gatv2Score>(a, scalar, stream);
  } else {
    launch_backward_src<GatScore>(a, scalar, stream);
  }
}

void launch_gat_backward_merges(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_backward_merges<Gatv2Score>(a, scalar, stream);
  } else {
    launch_backward_merges<GatScore>(a, scalar, stream);
  }
}

int64_t gat_src_state_bytes(const GatBackwardArgs& a, ScalarKind scalar) {
  if (a.dx == nullptr) return 0;
  return a.in.v2 ? src_state_bytes<Gatv2Score>(a, scalar) : src_state_bytes<GatScore>(a, scalar);
}

}  // namespace edgedot
