"""Hostile pointers and indices (scripts/fuzz_pointers.py), unchecked: every call returns or raises a
clear error naming the argument, and a valid call afterwards is still right. On a GPU the same
script runs under compute-sanitizer memcheck (scripts/device_check.sh), which proves that nothing is
read out of range."""

import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "fuzz_pointers.py"
spec = importlib.util.spec_from_file_location("fuzz_pointers", SCRIPT)
fuzz_pointers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz_pointers)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", fuzz_pointers.OPS)
def test_hostile_graph_gives_a_result_or_a_clear_error(device, op):
    gen = torch.Generator().manual_seed(sum(map(ord, op)))
    num_src = 29 if op == "agnn_attention" else 41  # AGNN: one node set
    for index_dtype in (torch.int32, torch.int64):
        inputs = fuzz_pointers.make_inputs(op, gen, num_src, 29, 2, 8, torch.float32, device)
        src = fuzz_pointers.hostile_index(gen, num_src, 900, device, index_dtype)
        dst = fuzz_pointers.hostile_index(gen, 29, 900, device, index_dtype)
        for ptr in (None, *(fuzz_pointers.hostile_ptr(gen, 29, 900, device) for _ in range(6))):
            message = fuzz_pointers.call(op, inputs, src, torch.sort(dst).values if ptr is not None else dst, ptr,
                                         device)
            if message is not None:
                assert any(name in message for name in ("src_idx", "dst_idx", "dst_ptr")), message
            elif device == "cpu":
                pytest.fail("the CPU checks every call: a hostile graph must raise")
    fuzz_pointers.check_still_right(device)


def test_fuzz_script_runs():
    # On the CPU every hostile call raises: both calls of every round are counted.
    assert fuzz_pointers.fuzz("cpu", rounds=6, seed=3) == 2 * 6
    fuzz_pointers.check_still_right("cpu")
