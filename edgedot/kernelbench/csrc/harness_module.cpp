// The module of the KernelBench harness's own extension (edgedot/kernelbench/extension.py builds
// it, apart from the library's): the seed problem's entry point, kernelbench_forward
// (kernelbench.cpp). The export inlines kernelbench.cpp, not this file: load_inline writes its own
// module there.
#include <torch/extension.h>

namespace edgedot {
torch::Tensor kernelbench_forward(torch::Tensor src_feat, torch::Tensor dst_feat, torch::Tensor src_idx,
                                  torch::Tensor dst_idx);
}  // namespace edgedot (kernelbench.cpp)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kernelbench_forward", &edgedot::kernelbench_forward,
        "the seed problem's forward with KernelBench's contract: any index dtype, reference rounding (CUDA)");
}
