"""edgedot's column sums against PyTorch's ``x.sum(0)`` on a CUDA machine: each result checked
against a float64 sum first, then medians of CUDA-event timings after warm-up, and the bytes of
``x`` read per second.

    python scripts/column_sum_bench.py
"""

import torch

from edgedot.ops.column_sum import column_sum
from profile_attention import median_us  # scripts/ is on the path when run as a script

# rows, width, dtype: a bias gradient of the mini-batch layers, the fused q/k/v projection's, and
# ogbn-products' node count at bfloat16.
SHAPES = [(180_224, 128, torch.float32), (180_224, 384, torch.float32), (180_224, 128, torch.bfloat16),
          (2_449_029, 128, torch.bfloat16)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':>22} {'dtype':>9} {'edgedot us':>11} {'GB/s':>7} {'x.sum(0) us':>12} {'GB/s':>7} {'ratio':>6}")
    for rows, width, dtype in SHAPES:
        x = torch.randn(rows, width, device="cuda").to(dtype)
        want = x.double().sum(0)
        for name, got in (("column_sum", column_sum(x)), ("x.sum(0)", x.sum(0))):
            error = ((got.double() - want).norm() / want.norm()).item()
            if error > TOL[dtype]:
                raise SystemExit(f"{name} of {rows}x{width} {dtype}: relative error {error:.2e}")
        ours, theirs = median_us(lambda: column_sum(x), reps=50), median_us(lambda: x.sum(0), reps=50)
        gb = x.numel() * x.element_size() / 1e3
        print(f"{f'{rows} x {width}':>22} {str(dtype)[6:]:>9} {ours:11.1f} {gb / ours:7.0f} {theirs:12.1f} "
              f"{gb / theirs:7.0f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()
