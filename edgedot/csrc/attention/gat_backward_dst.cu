// The backward's destination pass of GAT and GATv2 (GatScore, Gatv2Score).
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_gat_backward_dst(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_backward_dst<Gatv2Score>(a, scalar, stream);
  } else {
    launch_backward_dst<GatScore>(a, scalar, stream);
  }
}

int64_t gat_dst_pass_teams(const GatBackwardArgs& a, ScalarKind scalar) {
  return a.in.v2 ? backward_dst_teams<Gatv2Score>(a, scalar) : backward_dst_teams<GatScore>(a, scalar);
}

}  // namespace edgedot
