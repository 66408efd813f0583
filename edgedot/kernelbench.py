"""The seed problem in KernelBench's format, and an exporter to one self-contained problem file.

KernelBench evaluates a module that defines ``Model`` (the PyTorch reference), ``ModelNew`` (the
custom kernel), ``get_inputs()`` and ``get_init_inputs()``. This module defines them for the
problem edgedot grew from: ``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>`` on a graph
of ``num_edges`` edges between ``num_src_nodes`` and ``num_dst_nodes`` nodes of ``feat_dim``
features. Here ``ModelNew`` calls :func:`edgedot.edge_dot`.

``python -m edgedot.kernelbench --export PATH`` writes the same problem as one Python file that
does not import edgedot: its ``ModelNew`` builds edgedot's CUDA forward kernel with
``torch.utils.cpp_extension.load_inline`` from sources inlined at export time, read from
``edgedot/csrc``. Without arguments, it compares ``ModelNew`` with ``Model`` on ``get_inputs()``.
"""

import argparse
import inspect
import re
import string
from pathlib import Path

import torch
from torch import nn

from . import __version__
from ._build import CSRC
from .functional import edge_dot
from .reference import edge_dot_reference

__all__ = [
    "num_src_nodes", "num_dst_nodes", "num_edges", "feat_dim", "Model", "ModelNew", "get_inputs",
    "get_init_inputs", "cuda_source", "export",
]

num_src_nodes = 1024
num_dst_nodes = 768
num_edges = 16384
feat_dim = 128


class Model(nn.Module):
    """The reference: gathers both endpoint rows of every edge, multiplies, sums over features."""

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        return edge_dot_reference(src_feat, dst_feat, src_idx, dst_idx)


class ModelNew(nn.Module):
    """edgedot's fused gather-dot kernel, :func:`edgedot.edge_dot`.

    Like the reference's gather it does not wait for the GPU to validate indices
    (``check_indices=False``); on the CPU edge_dot always checks them.
    """

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        return edge_dot(src_feat, dst_feat, src_idx, dst_idx, check_indices=False)


def get_inputs():
    """Fresh random ``[src_feat, dst_feat, src_idx, dst_idx]``: float32 features, int32 indices.

    On the GPU when one is available, else on the CPU.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src_feat = torch.randn(num_src_nodes, feat_dim, device=device)
    dst_feat = torch.randn(num_dst_nodes, feat_dim, device=device)
    src_idx = torch.randint(0, num_src_nodes, (num_edges,), dtype=torch.int32, device=device)
    dst_idx = torch.randint(0, num_dst_nodes, (num_edges,), dtype=torch.int32, device=device)
    return [src_feat, dst_feat, src_idx, dst_idx]


def get_init_inputs():
    """Constructor arguments of ``Model`` and ``ModelNew``: none."""
    return []


# csrc files the forward kernel needs, each after the local headers it includes.
EXPORT_SOURCES = ("edgedot.h", "common.cuh", "launch.cu", "forward.cu")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")
_QUOTE_BEFORE_QUOTE_OR_END = re.compile(r'"(?="|\Z)')

# The export's entry point: edgedot/csrc/bindings.cpp's forward for [N, D] features, without
# its index check (no error flag, no host synchronisation).
_BINDING = r"""// ---- binding, written by edgedot/kernelbench.py: bindings.cpp's forward for [N, D] features ----
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

namespace {

edgedot::ScalarKind scalar_kind(const torch::Tensor& feat) {
  switch (feat.scalar_type()) {
    case at::kFloat: return edgedot::ScalarKind::f32;
    case at::kDouble: return edgedot::ScalarKind::f64;
    case at::kHalf: return edgedot::ScalarKind::f16;
    case at::kBFloat16: return edgedot::ScalarKind::bf16;
    default: TORCH_CHECK_TYPE(false, "edge_dot_forward: unsupported feature dtype ", feat.scalar_type());
  }
}

edgedot::IndexKind index_kind(const torch::Tensor& idx, const char* name) {
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, name,
                   " must be int32 or int64, got ", idx.scalar_type());
  return idx.scalar_type() == at::kInt ? edgedot::IndexKind::i32 : edgedot::IndexKind::i64;
}

}  // namespace

// out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]> for [N, D] CUDA features.
// The indices are trusted, as in the seed problem: nothing checks them on the host (error_flag
// is null, so the call never synchronises). The kernel still never reads outside the features:
// an edge with an out-of-range index gets NaN.
torch::Tensor edge_dot_forward(torch::Tensor src_feat, torch::Tensor dst_feat, torch::Tensor src_idx,
                               torch::Tensor dst_idx) {
  TORCH_CHECK(src_feat.is_cuda(), "edge_dot_forward: the inputs must be CUDA tensors");
  TORCH_CHECK(dst_feat.device() == src_feat.device() && src_idx.device() == src_feat.device() &&
                  dst_idx.device() == src_feat.device(),
              "edge_dot_forward: all inputs must be on one device");
  TORCH_CHECK(src_feat.dim() == 2 && dst_feat.dim() == 2 && src_feat.size(1) == dst_feat.size(1),
              "edge_dot_forward: features must be [Ns, D] and [Nd, D]");
  TORCH_CHECK_TYPE(dst_feat.scalar_type() == src_feat.scalar_type(),
                   "edge_dot_forward: src_feat and dst_feat must have the same dtype");
  TORCH_CHECK(src_idx.dim() == 1 && dst_idx.dim() == 1 && src_idx.size(0) == dst_idx.size(0),
              "edge_dot_forward: src_idx and dst_idx must be 1-D of the same length");
  const c10::cuda::CUDAGuard guard(src_feat.device());
  src_feat = src_feat.contiguous();
  dst_feat = dst_feat.contiguous();
  src_idx = src_idx.contiguous();
  dst_idx = dst_idx.contiguous();
  const int64_t num_edges = src_idx.size(0);
  torch::Tensor out = at::empty({num_edges}, src_feat.options());
  if (num_edges == 0) return out;

  const edgedot::ForwardArgs args{
      edgedot::Rows{src_feat.data_ptr(), src_feat.size(0), src_feat.stride(0), /*head_stride=*/0},
      edgedot::Rows{dst_feat.data_ptr(), dst_feat.size(0), dst_feat.stride(0), /*head_stride=*/0},
      src_idx.data_ptr(),
      dst_idx.data_ptr(),
      out.data_ptr(),
      num_edges,
      /*heads=*/1,
      src_feat.size(1),
      /*error_flag=*/nullptr};
  edgedot::launch_forward(args, edgedot::EdgeOrder{nullptr, nullptr}, scalar_kind(src_feat),
                          index_kind(src_idx, "src_idx"), index_kind(dst_idx, "dst_idx"),
                          c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
"""

_DECLARATION = ("torch::Tensor edge_dot_forward(torch::Tensor src_feat, torch::Tensor dst_feat, "
                "torch::Tensor src_idx, torch::Tensor dst_idx);")


def cuda_source():
    """The CUDA translation unit the export inlines, read from ``edgedot/csrc`` now.

    The files of ``EXPORT_SOURCES`` in order, without their ``#include "..."`` lines of local
    headers and ``#pragma once``, then the binding ``edge_dot_forward``. Raises RuntimeError if a
    file includes a local header that does not come before it.
    """
    parts = []
    for position, name in enumerate(EXPORT_SOURCES):
        lines = []
        for line in (CSRC / name).read_text().splitlines():
            include = _LOCAL_INCLUDE.match(line)
            if include and include.group(1) not in EXPORT_SOURCES[:position]:
                raise RuntimeError(
                    f"csrc/{name} includes {include.group(1)!r}, which the export does not inline before it")
            if not include and not _PRAGMA_ONCE.match(line):
                lines.append(line)
        parts.append(f"// ---- edgedot/csrc/{name} ----\n" + "\n".join(lines).strip() + "\n")
    parts.append(_BINDING)
    return "\n".join(parts)


def _python_string(text):
    """``text`` as a triple-quoted Python literal that keeps its lines readable.

    Backslashes are doubled, and every quote followed by another quote or by the end of the text
    is escaped, so no run of quotes in the text can close the literal early.
    """
    escaped = _QUOTE_BEFORE_QUOTE_OR_END.sub(r'\\"', text.replace("\\", "\\\\"))
    return '"""\\\n' + escaped + '"""'


# The exported file; get_inputs and get_init_inputs are copied from this module's source.
_EXPORT_TEMPLATE = string.Template('''\
"""Edge-wise dot products on a graph (SDDMM, ``u_dot_v``) as a KernelBench problem.

``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>``. ``Model`` is the PyTorch reference;
``ModelNew`` runs edgedot's fused CUDA forward kernel, which it builds with
``torch.utils.cpp_extension.load_inline`` when constructed (torch caches the build).

Generated by ``python -m edgedot.kernelbench --export`` from edgedot $version; it does not import
edgedot. Change edgedot/csrc and export again rather than editing this file.
"""

import functools

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

num_src_nodes = $num_src_nodes
num_dst_nodes = $num_dst_nodes
num_edges = $num_edges
feat_dim = $feat_dim

# edgedot/csrc/{$sources} without their local includes and
# `#pragma once`, then the binding edge_dot_forward. The binding trusts its inputs, as the seed
# problem does: it does not check the indices (an out-of-range one yields NaN, never a read
# outside the features) and so never waits for the GPU.
CUDA_SOURCE = $cuda_source

CPP_SOURCE = "$declaration"


@functools.cache
def _extension():
    """The compiled kernel, built on the first call (needs CUDA and nvcc)."""
    return load_inline(
        name="edgedot_kernelbench_export",
        cpp_sources=CPP_SOURCE,
        cuda_sources=CUDA_SOURCE,
        functions=["edge_dot_forward"],
        extra_cuda_cflags=["-O3"],
    )


class Model(nn.Module):
    """The reference: gathers both endpoint rows of every edge, multiplies, sums over features."""

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        src = src_feat[src_idx.long()]
        dst = dst_feat[dst_idx.long()]
        return (src * dst).sum(dim=-1)


class ModelNew(nn.Module):
    """edgedot's fused gather-dot kernel for [N, D] CUDA features; builds it when constructed."""

    def __init__(self):
        super().__init__()
        self.ext = _extension()

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        return self.ext.edge_dot_forward(src_feat, dst_feat, src_idx, dst_idx)


$get_inputs

$get_init_inputs''')


def export(path):
    """Writes the self-contained problem file to ``path`` and returns its resolved path."""
    text = _EXPORT_TEMPLATE.substitute(
        version=__version__,
        num_src_nodes=num_src_nodes,
        num_dst_nodes=num_dst_nodes,
        num_edges=num_edges,
        feat_dim=feat_dim,
        sources=", ".join(EXPORT_SOURCES),
        cuda_source=_python_string(cuda_source()),
        declaration=_DECLARATION,
        get_inputs=inspect.getsource(get_inputs),
        get_init_inputs=inspect.getsource(get_init_inputs),
    )
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main(argv=None):
    """Command line: ``--export PATH`` writes the problem file, else compares the two models."""
    parser = argparse.ArgumentParser(
        prog="python -m edgedot.kernelbench",
        description="KernelBench form of edgedot's seed problem: check ModelNew against Model, "
                    "or export a self-contained problem file.")
    parser.add_argument("--export", metavar="PATH", type=Path,
                        help="write the self-contained problem file (not importing edgedot) to PATH")
    args = parser.parse_args(argv)
    if args.export is not None:
        print(f"wrote {export(args.export)}")
        return
    inputs = get_inputs()
    expected = Model()(*inputs)
    got = ModelNew()(*inputs)
    error = (got - expected).abs().max().item()
    print(f"ModelNew vs Model on {inputs[0].device}: max abs error {error:.3e}")


if __name__ == "__main__":
    main()
