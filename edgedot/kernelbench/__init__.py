"""The seed problem in KernelBench's format, and an exporter to one self-contained problem file.

The KernelBench harness of the project, apart from the library: this module (the problem,
``Model``, ``ModelNew``, the exporter), :mod:`edgedot.kernelbench.evaluation` (KernelBench's
evaluation procedure) and ``csrc/`` (the problem's C++ entry point and its index cast, built
into the harness's own extension by :mod:`edgedot.kernelbench.extension`, apart from the library's,
and inlined by the export).

KernelBench evaluates a module that defines ``Model`` (the PyTorch reference), ``ModelNew`` (the
custom kernel), ``get_inputs()`` and ``get_init_inputs()``. This module defines them for the
problem edgedot grew from: ``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>`` on a graph
of ``num_edges`` edges between ``num_src_nodes`` and ``num_dst_nodes`` nodes of ``feat_dim``
features. Here ``ModelNew`` calls edgedot's kernel with the reference's contract (any index
dtype, as KernelBench's evaluator casts every input to the precision of its run).

``python -m edgedot.kernelbench --export PATH`` writes the same problem as one Python file that
does not import edgedot: its ``ModelNew`` builds edgedot's CUDA forward kernel with
``torch.utils.cpp_extension.load_inline`` from sources inlined at export time, read from
``edgedot/csrc`` and ``edgedot/kernelbench/csrc``. ``--evaluate PATH`` runs KernelBench's
evaluation procedure on such a file (:mod:`edgedot.kernelbench.evaluation`; needs CUDA). Without arguments, it compares ``ModelNew`` with ``Model`` on
``get_inputs()``.
"""

import argparse
import inspect
import re
import string
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..runtime.build import PACKAGE
from ..ops.edge_dot import edge_dot
from ..reference import edge_dot_reference
from .extension import cuda_module

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
    """edgedot's fused gather-dot kernel, with the reference's contract for KernelBench.

    KernelBench's evaluator casts every input to the precision of its run, the index tensors
    included, so ``ModelNew`` takes indices of any integer or floating dtype, truncated like
    ``.long()``. On CUDA, ``[N, D]`` features go to ``kernelbench_forward`` of the harness's own
    extension (:mod:`edgedot.kernelbench.extension`; ``edgedot/kernelbench/csrc/kernelbench.cpp``,
    the entry point the export inlines): floating indices are
    converted in one launch, half types round each product before the sum as the reference does,
    and nothing waits for the GPU (an out-of-range index yields NaN, never a read outside the
    features). Elsewhere it calls :func:`edgedot.edge_dot`, which on the CPU always checks the
    indices.
    """

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        if src_feat.is_cuda and src_feat.dim() == 2 and dst_feat.dim() == 2:
            return cuda_module().kernelbench_forward(src_feat, dst_feat, src_idx, dst_idx)
        src_idx = src_idx.long() if src_idx.is_floating_point() else src_idx
        dst_idx = dst_idx.long() if dst_idx.is_floating_point() else dst_idx
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


# Sources (under edgedot/) of the seed problem's entry point (kernelbench.cpp) and the kernels it
# calls, each after the local headers it includes.
EXPORT_SOURCES = ("csrc/common/edgedot.h", "csrc/common/common.cuh", "csrc/common/launch.cu", "csrc/edge_dot/edge_dot_forward.cu",
                  "kernelbench/csrc/index_cast.cu", "kernelbench/csrc/kernelbench.cpp")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")
_QUOTE_BEFORE_QUOTE_OR_END = re.compile(r'"(?="|\Z)')

# The export's C++ declaration of its entry point, kernelbench/csrc/kernelbench.cpp's kernelbench_forward.
_DECLARATION = ("namespace edgedot { torch::Tensor kernelbench_forward(torch::Tensor src_feat, "
                "torch::Tensor dst_feat, torch::Tensor src_idx, torch::Tensor dst_idx); } "
                "using edgedot::kernelbench_forward;")


def cuda_source():
    """The CUDA translation unit the export inlines, read from edgedot's sources now.

    The files of ``EXPORT_SOURCES`` in order, without their ``#include "..."`` lines of local
    headers and ``#pragma once``; the last, ``kernelbench.cpp``, defines the entry point
    ``edgedot::kernelbench_forward``. Raises RuntimeError if a file includes a local header that
    does not come before it.
    """
    parts = []
    for position, path in enumerate(EXPORT_SOURCES):
        inlined = {before.removeprefix("csrc/") for before in EXPORT_SOURCES[:position]}  # as included
        lines = []
        for line in (PACKAGE / path).read_text().splitlines():
            include = _LOCAL_INCLUDE.match(line)
            if include and include.group(1) not in inlined:
                raise RuntimeError(
                    f"{path} includes {include.group(1)!r}, which the export does not inline before it")
            if not include and not _PRAGMA_ONCE.match(line):
                lines.append(line)
        parts.append(f"// ---- edgedot/{path} ----\n" + "\n".join(lines).strip() + "\n")
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

# edgedot/{$sources} without their local includes
# and `#pragma once`. The entry point, kernelbench_forward, takes the inputs as KernelBench's evaluator
# passes them: indices of any integer or floating dtype (truncated like .long()), features in any
# float type (half types round each product, as the reference does). It trusts the indices, as
# the seed problem does: nothing checks them (an out-of-range one yields NaN, never a read outside
# the features), so it never waits for the GPU.
CUDA_SOURCE = $cuda_source

CPP_SOURCE = "$declaration"


@functools.cache
def _extension():
    """The compiled kernel, built on the first call (needs CUDA and nvcc)."""
    return load_inline(
        name="edgedot_kernelbench_export",
        cpp_sources=CPP_SOURCE,
        cuda_sources=CUDA_SOURCE,
        functions=["kernelbench_forward"],
        extra_cuda_cflags=["-O3"],
    )


class Model(nn.Module):
    """The reference: gathers both endpoint rows of every edge, multiplies, sums over features."""

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        src = src_feat[src_idx.long()]
        dst = dst_feat[dst_idx.long()]
        return (src * dst).sum(dim=-1)


class ModelNew(nn.Module):
    """edgedot's fused gather-dot kernel for [N, D] CUDA features; builds it when constructed.

    Accepts the index tensors in any integer or floating dtype, like the reference."""

    def __init__(self):
        super().__init__()
        self.ext = _extension()

    def forward(self, src_feat, dst_feat, src_idx, dst_idx):
        return self.ext.kernelbench_forward(src_feat, dst_feat, src_idx, dst_idx)


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
    """Command line: ``--export PATH`` writes the problem file, ``--evaluate PATH`` runs
    KernelBench's evaluation procedure on one, else ``ModelNew`` is compared with ``Model``."""
    parser = argparse.ArgumentParser(
        prog="python -m edgedot.kernelbench",
        description="KernelBench form of edgedot's seed problem: check ModelNew against Model, "
                    "export a self-contained problem file, or evaluate one as KernelBench does.")
    parser.add_argument("--export", metavar="PATH", type=Path,
                        help="write the self-contained problem file (not importing edgedot) to PATH")
    parser.add_argument("--evaluate", metavar="PATH", type=Path,
                        help="run KernelBench's evaluation procedure on the problem file at PATH (CUDA)")
    parser.add_argument("--precision", action="append", choices=["fp32", "fp16", "bf16"],
                        help="precision of --evaluate (repeatable; default: all three)")
    args = parser.parse_args(argv)
    if args.export is not None:
        print(f"wrote {export(args.export)}")
        return
    if args.evaluate is not None:
        if not torch.cuda.is_available():
            raise SystemExit("python -m edgedot.kernelbench --evaluate needs CUDA: no CUDA device found")
        from . import evaluation

        problem = evaluation.load_problem(args.evaluate)
        results = [evaluation.evaluate(problem, p) for p in args.precision or ["fp32", "fp16", "bf16"]]
        for result in results:
            evaluation.report(result)
        raise SystemExit(0 if all(r.correct for r in results) else 1)
    inputs = get_inputs()
    expected = Model()(*inputs)
    got = ModelNew()(*inputs)
    error = (got - expected).abs().max().item()
    print(f"ModelNew vs Model on {inputs[0].device}: max abs error {error:.3e}")

