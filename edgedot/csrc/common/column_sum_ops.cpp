// Column sums on the torch side: x [rows, width] -> [width] in x's dtype (or another feature dtype),
// accumulated in float32 (float64 for float64) in an order fixed by the shape (common/column_sum.cu).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/torch_common.h"

namespace edgedot {

at::Tensor column_sum(const at::Tensor& x_in, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.is_cuda() && is_feature_dtype(x_in.scalar_type()),
                    message("edgedot: column_sum needs x 2-D float32, float64, float16 or bfloat16 on a CUDA device, "
                            "got ", x_in.sizes(), " ", x_in.scalar_type()));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = unit_stride_last(x_in);
  const int64_t rows = x.size(0), width = x.size(1);
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK_VALUE(is_feature_dtype(out_type), message("edgedot: column_sum's out_dtype must be a feature dtype, got ",
                                                        out_type));
  at::Tensor out = at::empty({width}, x.options().dtype(out_type));
  if (rows == 0) return out.zero_();
  if (width == 0) return out;
  const at::ScalarType accum = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partial = at::empty({column_sum_blocks(rows), width}, x.options().dtype(accum));
  launch_column_sum(x.data_ptr(), rows, width, x.stride(0), partial.data_ptr(), out.data_ptr(),
                    scalar_kind(x.scalar_type()), scalar_kind(out_type), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace edgedot
