// The forward of GAT and GATv2 (GatScore, Gatv2Score).
#include "attention/gat_scores.cuh"

namespace edgedot {

void launch_gat_forward(const GatForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  if (a.in.v2) {
    launch_forward<Gatv2Score>(a, scalar, stream);
  } else {
    launch_forward<GatScore>(a, scalar, stream);
  }
}

}  // namespace edgedot
