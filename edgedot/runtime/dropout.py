"""Dropout of the fused ops: the ``(seed, offset)`` a call draws, the state it returns, the mask.

A call with dropout draws a pair ``(seed, offset)`` and returns it as ``rng_state``, an int64
``[2]`` tensor on the inputs' device; its backward reads the pair from there, so forward and
backward drop the same elements. Element ``c`` of a call (graph attention, GAT and GATv2:
``e * heads + h``) is kept when a hash of ``(seed, offset, c)`` is at least ``floor(p * 2**32)``:
the same function on CPU and CUDA (``csrc/dropout.cuh``), whatever order the elements are visited
in.

CUDA: the pair is the CUDA generator's Philox seed and offset, taken inside the extension as
torch's own fused dropout takes it (each call moves the offset on by :data:`OFFSET_STEP`), with no
wait for the device. While a CUDA graph is captured the kernel reads both from the generator's
device tensors, so every replay draws a new mask (a generator other than the default must be
registered with the graph, ``CUDAGraph.register_generator_state``). CPU: the seed is a 64-bit
integer drawn from the CPU generator, the offset 0.

An op adopts this with the schema ``..., float dropout_p, Generator? generator, ... -> (...,
Tensor rng_state)`` and a backward taking ``Tensor? rng_state``: its CPU forward calls
:func:`draw_cpu` and :func:`key`, its CUDA forward :func:`check_generator` and passes the
generator on (the extension's ``draw_dropout_rng``), its fake forward :func:`fake_state`, its CPU
backward :func:`recorded_key` (the CUDA backward passes ``rng_state`` on: ``recorded_dropout_rng``).
"""

import math

import torch

__all__ = ["OFFSET_STEP", "check_generator", "draw_cpu", "no_state", "fake_state", "recorded_key", "key",
           "keep_mask", "next_state", "state_pair"]

# Offsets a CUDA call takes from its generator (kDropoutOffsetStep in csrc/attention/dropout_rng.cpp).
OFFSET_STEP = 4

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def check_generator(generator, device, name="generator"):
    """Raises TypeError unless ``generator`` is a ``torch.Generator`` or None, ValueError unless
    it lives on ``device`` (a CPU generator for CPU tensors, one of their CUDA device for CUDA)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(generator).__name__}")
    device = torch.device(device)
    gen_device = generator.device
    if gen_device.type == "cuda" and gen_device.index is None:
        gen_device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if gen_device != device:
        raise ValueError(f"{name} is on {gen_device} but the inputs are on {device}; dropout draws from a "
                         f"generator of the inputs' device")


def draw_cpu(generator=None):
    """The state of a CPU call: int64 ``[2]`` ``(seed, 0)``, the seed drawn from ``generator``
    (default: torch's default CPU generator)."""
    seed = torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64, generator=generator)
    return torch.stack([seed, torch.zeros((), dtype=torch.int64)])


def no_state(like):
    """The ``rng_state`` of a call without dropout: an empty int64 tensor on ``like``'s device."""
    return like.new_empty((0,), dtype=torch.int64)


def fake_state(like, dropout_p):
    """The ``rng_state`` output of a fake implementation: int64 ``[2]`` with dropout, else ``[0]``."""
    return like.new_empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64)


def state_pair(rng_state, name="rng_state"):
    """``(seed, offset)`` as Python ints from an int64 ``[2]`` tensor (waits for its device if it
    is not the CPU) or a pair of ints."""
    if isinstance(rng_state, torch.Tensor):
        if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
            raise ValueError(f"{name} must be an int64 tensor of shape [2] (seed, offset), got {rng_state.dtype} "
                             f"of shape {tuple(rng_state.shape)}")
        seed, offset = rng_state.tolist()
        return seed, offset
    if (isinstance(rng_state, (tuple, list)) and len(rng_state) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in rng_state)):
        return rng_state[0], rng_state[1]
    raise TypeError(f"{name} must be an int64 [2] tensor or a (seed, offset) pair of ints, "
                    f"got {type(rng_state).__name__}")


def _mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def key(seed, offset):
    """The 64-bit key of a call's mask (``dropout_key`` in ``csrc/dropout.cuh``), from its seed
    and offset as int64 or uint64 values."""
    return _mix64((seed & _MASK64) ^ _mix64(((offset & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64))


def recorded_key(rng_state, dropout_p):
    """The key of a backward's mask, from the ``rng_state`` its forward returned (0 without
    dropout)."""
    if dropout_p == 0:
        return 0
    if rng_state is None:
        raise ValueError("dropout needs rng_state, the int64 [2] tensor the forward returned")
    return key(*state_pair(rng_state))


def _mul32(x, c):
    # (x * c) mod 2**32 for 0 <= x, c < 2**32, in int64 without overflow: split c in 16-bit halves.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(mask_key, first, count, p, device="cpu"):
    """Whether elements ``first .. first + count - 1`` survive (bool ``[count]``) under
    ``mask_key`` (:func:`key`): ``dropout_keep`` of ``csrc/dropout.cuh``, its uint32 arithmetic
    done in int64."""
    c = torch.arange(first, first + count, dtype=torch.int64, device=device)
    u = _mix32((c & _MASK32) ^ (mask_key & _MASK32))
    u = _mix32(u ^ ((c >> 32) & _MASK32) ^ ((mask_key >> 32) & _MASK32))
    threshold = min(math.floor(p * 2**32), 2**32)
    return u >= threshold


def _signed(x):
    return x - 2**64 if x >= 2**63 else x


def next_state(device="cpu", generator=None):
    """The ``rng_state`` (int64 ``[2]`` CPU tensor) the next call with dropout on ``device`` will
    draw from ``generator`` (default: the device's default generator), without drawing it."""
    device = torch.device(device)
    check_generator(generator, device)
    if device.type == "cuda":
        if generator is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        return torch.tensor([_signed(generator.initial_seed()), generator.get_offset()], dtype=torch.int64)
    if device.type != "cpu":
        raise ValueError(f"dropout draws on CPU or CUDA devices, got {device}")
    generator = torch.default_generator if generator is None else generator
    saved = generator.get_state()
    try:
        return draw_cpu(generator)
    finally:
        generator.set_state(saved)
