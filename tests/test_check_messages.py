"""The extension's failing checks: each raises Python's error type with a message that holds the
numbers, shapes and dtypes it names, and no process dies on the way (``csrc/common/check_message.h``:
streaming a number into a check's message inside the extension crashed the process on the CUDA
machines, so every check passes one ready string)."""

import re
from pathlib import Path

import pytest
import torch

from edgedot.runtime.build import cuda_module
from utils import requires_cuda

CSRC = Path(__file__).resolve().parents[1] / "edgedot" / "csrc"
CHECK = re.compile(r"\bTORCH_CHECK(?:_VALUE|_TYPE|_INDEX)?\(")


def _top_level_args(text):
    """``text`` (a macro's argument list, without its parentheses) split at its top-level commas."""
    args, depth, start, i, quoted = [], 0, 0, 0, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    return args + [text[start:].strip()]


def _checks():
    """(file:line, condition, message arguments) of every TORCH_CHECK* in the extension's sources."""
    found = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cpp", ".cu", ".h", ".cuh") or path.name == "check_message.h":
            continue
        text = path.read_text()
        for match in CHECK.finditer(text):
            depth, i = 1, match.end()
            while depth:  # to the macro's closing parenthesis (no parentheses inside the literals here)
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            args = _top_level_args(text[match.end():i - 1])
            found.append((f"{path.relative_to(CSRC)}:{text.count(chr(10), 0, match.start()) + 1}", args[0], args[1:]))
    return found


def test_every_check_passes_one_ready_message():
    """Every check's message is one literal, one ``message(...)`` or one string variable: nothing left
    for c10::str to stream."""
    checks = _checks()
    assert len(checks) > 40, "the scan found too few checks to be reading the sources"
    bad = [where for where, _, message in checks
           if len(message) != 1 or not re.fullmatch(r'"(.|\n)*"|message\((.|\n)*\)|[a-z_]+', message[0])]
    assert not bad, f"checks that c10::str would stream: {bad}"


def test_the_scan_sees_streamed_pieces():
    """The scan's own check: a streamed number is two message arguments, a message(...) is one."""
    streamed = 'TORCH_CHECK_VALUE(n > 0, "edgedot: n must be positive, got ", n);'
    ready = 'TORCH_CHECK_VALUE(f(a, b), message("edgedot: got ", n, " (", g(a, b), ")"));'
    assert len(_top_level_args(streamed[len("TORCH_CHECK_VALUE("):-2])[1:]) == 2
    assert _top_level_args(ready[len("TORCH_CHECK_VALUE("):-2])[1:] == ['message("edgedot: got ", n, " (", g(a, b), ")")']


@requires_cuda
def test_failing_checks_raise_with_their_numbers():
    """Checks whose messages hold a number, a shape or a dtype raise, with those values in the text."""
    ext = cuda_module()
    x = torch.randn(5, 4, device="cuda")
    weight = torch.randn(6, 4, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match=r"width a multiple of heads = 4, got \[6, 4\]"):
        ext.linear_sides_autograd(x, [weight], [torch.zeros(6, device="cuda")], 4, False)
    with pytest.raises(ValueError, match=r"got \[7\] Float"):
        ext.column_sum(torch.ones(7, device="cuda"))
    with pytest.raises(ValueError, match=r"att must be \[H, C\] or \[2, H, C\], got \[3, 2, 8\]"):
        ext.node_logits_forward(torch.randn(5, 2, 8, device="cuda"), torch.randn(3, 2, 8, device="cuda"))
    rows = torch.arange(4, device="cuda")
    with pytest.raises(ValueError, match="and at most 1024 buckets"):
        ext.edge_order(rows, rows, 2**40, 0)
    with pytest.raises(ValueError, match="unknown reduction 'bogus'"):
        ext.grad_rows(x, x, x, rows, rows, None, "bogus")
