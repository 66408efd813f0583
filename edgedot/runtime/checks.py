"""Argument checks shared by every implementation; each error names the offending argument."""

import threading
import weakref

import torch

FEATURE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def heads_of(feat):
    """Head count of a feature tensor: 1 for ``[N, D]``, ``H`` for ``[N, H, D]``."""
    return 1 if feat.dim() == 2 else feat.shape[1]


def output_shape(src_feat, dst_feat, num_edges):
    """``[E]`` when both sides are ``[N, D]``, else ``[E, H]``."""
    if src_feat.dim() == 2 and dst_feat.dim() == 2:
        return (num_edges,)
    return (num_edges, max(heads_of(src_feat), heads_of(dst_feat)))


def _check_index(name, idx):
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(idx).__name__}")
    if idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")


def check_indices_pair(src_idx, dst_idx):
    """Checks the two index tensors alone: integer, 1-D, same length, same device."""
    _check_index("src_idx", src_idx)
    _check_index("dst_idx", dst_idx)
    if src_idx.shape[0] != dst_idx.shape[0]:
        raise ValueError(
            f"src_idx and dst_idx must have the same length, got {src_idx.shape[0]} and {dst_idx.shape[0]}")
    if src_idx.device != dst_idx.device:
        raise ValueError(f"src_idx is on {src_idx.device} but dst_idx is on {dst_idx.device}")


def check_tensors(src_feat, dst_feat, src_idx, dst_idx):
    """Raises TypeError naming the first argument of :func:`edgedot.edge_dot` that is no tensor."""
    for name, t in (("src_feat", src_feat), ("dst_feat", dst_feat), ("src_idx", src_idx), ("dst_idx", dst_idx)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")


def check_float_tensor(name, t, shape_ok, shape_text):
    """Raises TypeError / ValueError naming ``name`` unless ``t`` is a tensor of a feature dtype
    for which ``shape_ok(t)`` holds (``shape_text``: the shape wanted, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not shape_ok(t):
        raise ValueError(f"{name} must be {shape_text}, got shape {tuple(t.shape)}")
    if t.dtype not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")


def check_feature(name, feat, rows="N"):
    """Raises TypeError / ValueError naming ``name`` unless ``feat`` is a ``[rows, D]`` or
    ``[rows, H, D]`` tensor of a feature dtype."""
    check_float_tensor(name, feat, lambda t: t.dim() in (2, 3), f"[{rows}, D] or [{rows}, H, D]")


def check_inputs(src_feat, dst_feat, src_idx, dst_idx):
    """Raises a clear error for any malformed argument of :func:`edgedot.edge_dot`."""
    check_tensors(src_feat, dst_feat, src_idx, dst_idx)
    if _plain_pair(src_feat, dst_feat, src_idx, dst_idx):
        return
    for name, feat in (("src_feat", src_feat), ("dst_feat", dst_feat)):
        check_feature(name, feat)
    if src_feat.dtype != dst_feat.dtype:
        raise TypeError(f"src_feat is {src_feat.dtype} but dst_feat is {dst_feat.dtype}; they must match")
    if src_feat.shape[-1] != dst_feat.shape[-1]:
        raise ValueError(
            f"feature sizes differ: src_feat has D={src_feat.shape[-1]}, dst_feat has D={dst_feat.shape[-1]}")
    src_heads, dst_heads = heads_of(src_feat), heads_of(dst_feat)
    if src_heads != dst_heads and 1 not in (src_heads, dst_heads):
        raise ValueError(
            f"head counts differ: src_feat has H={src_heads}, dst_feat has H={dst_heads} (one may be 1)")
    check_indices_pair(src_idx, dst_idx)
    device = src_feat.device
    for name, t in (("dst_feat", dst_feat), ("src_idx", src_idx), ("dst_idx", dst_idx)):
        if t.device != device:
            raise ValueError(f"src_feat is on {device} but {name} is on {t.device}; all inputs must share a device")


def _plain_pair(src_feat, dst_feat, src_idx, dst_idx):
    # The common well-formed case in one expression, a subset of what check_inputs accepts
    # (half its time on small CPU graphs, where a call's Python is most of its cost).
    dtype = src_feat.dtype
    return (src_feat.dim() == 2 and dst_feat.dim() == 2 and dst_feat.dtype == dtype and dtype in FEATURE_DTYPES
            and src_feat.shape[1] == dst_feat.shape[1] and src_idx.dim() == 1 and dst_idx.dim() == 1
            and src_idx.dtype in INDEX_DTYPES and dst_idx.dtype in INDEX_DTYPES
            and src_idx.shape[0] == dst_idx.shape[0]
            and src_feat.device == dst_feat.device == src_idx.device == dst_idx.device)


def check_index_range(name, idx, num_rows):
    """Raises IndexError if any entry of ``idx`` lies outside ``[0, num_rows)`` (synchronises)."""
    if idx.numel() == 0:
        return
    lo, hi = torch.aminmax(idx)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{name} holds {bad}, outside [0, {num_rows})")


class TensorMemo:
    """Facts about index tensors, each remembered until its data may have changed.

    A graph's index tensors are usually passed again and again, and learning a fact about one
    (its range, its order) costs a pass over E integers and, on CUDA, a wait for the GPU. An
    entry is keyed on what identifies the data: the storage (held by a weak reference, so a
    storage freed and another allocated at the same address never matches), the offset, shape,
    strides, dtype and device. ``edge_index[0]``, a new object on every call, finds the entry of
    the previous call's view.

    An entry also names the tensor whose version counter vouches for it: the base of the tensor
    it was learned from (the tensor itself when it is no view). Views share their base's
    counter, so an in-place write through any of them invalidates every entry of that base. A
    lookup holds only for a tensor with that same base, at that version, on the same memory. A
    tensor that shares the storage but is not known to share the counter (``.data``,
    ``.detach()``, the aliases a graph compiled by inductor passes to an op, which inductor
    writes through without counting) is never trusted on another tensor's word: it is checked
    on every call. Writes that bypass
    PyTorch (raw pointers, DLPack producers, ``.data``, a numpy array behind ``torch.from_numpy``)
    are not seen: the ops remember only what may be wrong without harm (see
    :func:`check_graph`), and only for CUDA tensors.
    """

    def __init__(self):
        # key -> (weak storage, weak base, version, data_ptr, fact)
        self._entries = {}

    def get(self, idx):
        """The fact recorded for ``idx``, or None if there is none or ``idx`` changed since."""
        key, storage = _key_of(idx)
        entry = self._entries.get(key) if key is not None else None
        # This runs on every call: kept lean.
        if entry is None or entry[0]() is not storage:
            return None
        base = idx._base if idx._is_view() else idx
        if entry[1]() is not base or entry[2] != idx._version or entry[3] != storage.data_ptr():
            return None
        return entry[4]

    def put(self, idx, fact):
        """Records ``fact`` (not None) for ``idx`` as it is now (nothing for a tensor without a
        version counter or a storage of its own)."""
        if idx.is_inference():  # no version counter: checked on every call
            return
        key, storage = _key_of(idx)
        if key is None:
            return
        base = idx._base if idx._is_view() else idx
        entries = self._entries

        def drop(_):
            if entries.get(key) is entry:
                del entries[key]

        entry = (weakref.ref(storage, drop), weakref.ref(base, drop), idx._version, storage.data_ptr(), fact)
        entries[key] = entry


def _key_of(idx):
    """``(key, storage)`` of a plain tensor; ``(None, None)`` for one without a storage of its own
    to key on (wrapper subclasses, functorch wrappers)."""
    try:
        storage = idx.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, None
    return (id(storage), idx.storage_offset(), tuple(idx.shape), idx.stride(), idx.dtype, idx.device), storage


# Bits of graph_flags' answer (GraphCheckFlag in csrc/edgedot.h).
SRC_OUT_OF_RANGE, DST_OUT_OF_RANGE, PTR_ENDS_WRONG, PTR_DECREASES, PTR_DISAGREES = 1, 2, 4, 8, 16

# Parts of a graph launch_graph_check checked (kGraphCheck* in csrc/common/torch_common.h).
CHECKED_SRC, CHECKED_DST, CHECKED_PTR = 1, 2, 4

# The names a graph's tensors go by in errors: (source indices, destination indices, pointer).
OP_NAMES = ("src_idx", "dst_idx", "dst_ptr")


_naming = threading.local()


def graph_names():
    """The names a graph's tensors go by in the errors of the checks run now: the op's argument
    names (:data:`OP_NAMES`), or a layer's inside :func:`call_naming_graph`."""
    return getattr(_naming, "names", OP_NAMES)


def call_naming_graph(names, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its graph checks (the op's own, or its grouping kernel's) naming the
    source indices, destination indices and pointer ``names`` (a layer's ``edge_index[0]``, ...),
    where ``names`` is not None. A layer that leaves the check of its ``edge_index`` to the op
    calls the op so: the op's grouping kernel then checks the graph without a launch of its own.
    Under ``torch.compile`` the call is plain (the op's own names)."""
    if names is None or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    saved = graph_names()
    _naming.names = names
    try:
        return fn(*args, **kwargs)
    finally:
        _naming.names = saved


def check_graph(src_idx, num_src, dst_idx, num_dst, dst_ptr=None, names=None):
    """Raises IndexError naming ``src_idx`` / ``dst_idx`` and the bad index if one lies outside
    ``[0, num_src)`` / ``[0, num_dst)``, and with ``dst_ptr`` (int32/int64 ``[num_dst + 1]``, shape
    already checked) ValueError naming it unless it is ``dst_idx``'s CSR pointer: it starts at 0,
    ends at E, never decreases, and edge i lies in the range of its destination ``dst_idx[i]``.
    ``names`` are the three tensors' names in the errors (default: :func:`graph_names`).

    On the CPU the check runs here, every call: its memory can be rewritten behind PyTorch's
    version counter (a numpy buffer behind ``torch.from_numpy``, refilled by a data loader), and
    a pass there costs about what a memo lookup saves.

    On CUDA the host never waits for it: one fused kernel runs the check on the device, ahead of
    the call's kernels on the same stream, and its verdict is read when it is ready (see
    :class:`DeferredChecks`): an error is raised by the first edgedot call made after the device
    ran the check, or by :func:`edgedot.wait_for_checks`, which waits for it. The kernels read
    nothing out of range meanwhile: an out-of-range source makes its destination's output NaN, an
    out-of-range destination drops its edge, a pointer that disagrees with ``dst_idx`` makes its
    destinations NaN. A graph found right is remembered (by the extension, by
    :class:`TensorMemo`'s rule) until its tensors are modified in place, so a graph passed again
    launches nothing; a write that bypasses the version counter (``.data``, DLPack) is then not
    seen, with the same safe outcome. Nothing is launched while a CUDA graph is captured (a replay
    could not report what it found)."""
    if names is None:
        names = graph_names()
    if not src_idx.is_cuda:
        flags = graph_flags(src_idx, num_src, dst_idx, num_dst, dst_ptr, True, True)
        if flags:
            _raise_graph_error(flags, src_idx, num_src, dst_idx, num_dst, dst_ptr, names)
        return
    if torch.cuda.is_current_stream_capturing():
        return
    _deferred_check(src_idx.device,
                    lambda flags: (None, launch_graph_check(src_idx, num_src, dst_idx, num_dst, dst_ptr, flags)),
                    lambda: (src_idx, num_src, dst_idx, num_dst, dst_ptr, names))


def _deferred_check(device, launch, graph):
    """Runs ``launch(host_flags)``, which launches a kernel on ``device`` that writes a graph's
    check into ``host_flags`` (a read-back buffer of :data:`deferred`) and returns ``(result,
    parts)``; queues the verdict of the parts checked (``graph()``: the graph as
    :meth:`DeferredChecks.submit` takes it) and returns ``result``. First raises what earlier
    checks found."""
    deferred.raise_found()
    read_back = deferred.buffer(device)
    result, launched = launch(read_back[0])
    if launched:
        deferred.submit(read_back, device, launched, graph())
    else:
        deferred.give_back(read_back, device)
    return result


def launch_graph_check(src_idx, num_src, dst_idx, num_dst, dst_ptr, host_flags):
    """The device's check behind :func:`check_graph` on CUDA (``csrc/common/graph_checks.cpp``): the
    parts of the graph no earlier check covers, checked by one kernel writing its flags into
    ``host_flags`` (pinned, of :data:`deferred`) and remembered at once, as if found right (a call
    passing the graph again before the verdict is read needs no check of its own; a bad verdict
    forgets them). The memos follow :class:`TensorMemo`'s rule, in the extension, where a lookup
    costs a fraction of Python's. Returns the parts launched, ``CHECKED_SRC | CHECKED_DST |
    CHECKED_PTR`` bits (0: nothing launched)."""
    from .build import cuda_module
    return cuda_module().graph_check_launch(src_idx, num_src, dst_idx, num_dst, dst_ptr, host_flags)


def grouping_with_check(dst_idx, src_idx, num_dst, num_src, both):
    """The extension's ``group_edges(dst_idx, src_idx, num_dst, num_src)`` (``group_edges_both``
    with ``both``), plain CUDA index tensors, with :func:`check_graph`'s range check of the graph
    (no pointer) run by the grouping's own kernel, which reads every index of both ends anyway: a
    new graph's check then costs no launch of its own. Its verdict is deferred, remembered and
    reported as :func:`check_graph`'s, under :func:`graph_names`. Not while a CUDA graph is
    captured (the caller groups without it, as :func:`check_graph` checks nothing then)."""
    names = graph_names()
    groups = _deferred_check(dst_idx.device,
                             lambda flags: launch_grouping_check(dst_idx, src_idx, num_dst, num_src, both, flags),
                             lambda: (src_idx, num_src, dst_idx, num_dst, None, names))
    return tuple(groups)


def self_looped_with_check(edge_index, num_nodes, dropped, num_src, num_dst, names):
    """The extension's self-loop handling of a CUDA ``[2, E]`` ``edge_index`` (sources in row 0; the
    GAT layers'): ``(src, dst)`` of ``E + num_nodes`` entries, each self-loop's destination
    ``dropped``, the loops of nodes ``0 .. num_nodes - 1`` appended; with :func:`check_graph`'s
    range check of the two rows (against ``num_src`` and ``num_dst``) run by the same kernel, which
    reads every index anyway: a new graph's check then costs no launch of its own. Its verdict is
    deferred, remembered and reported as :func:`check_graph`'s, under ``names`` (the source row's,
    the destination row's, a pointer's). Not while a CUDA graph is captured."""
    def launch(flags):
        src, dst, launched = launch_self_looped_check(edge_index, num_nodes, dropped, num_src, num_dst, flags)
        return (src, dst), launched
    return _deferred_check(edge_index.device, launch,
                           lambda: (edge_index[0], num_src, edge_index[1], num_dst, None, names))


def launch_self_looped_check(edge_index, num_nodes, dropped, num_src, num_dst, host_flags):
    """The extension's ``self_looped_checked`` (``csrc/common/graph_checks.cpp``): ``(src, dst,
    parts)``, the parts of the graph (``edge_index[0]``'s range, ``edge_index[1]``'s) whose check
    the self-loop kernel ran into ``host_flags`` (the bits of :func:`launch_graph_check`,
    remembered at once as that function's are)."""
    from .build import cuda_module
    return cuda_module().self_looped_checked(edge_index, num_nodes, dropped, num_src, num_dst, host_flags)


def launch_grouping_check(dst_idx, src_idx, num_dst, num_src, both, host_flags):
    """The extension's ``group_edges_checked`` (``csrc/common/graph_checks.cpp``): the groupings,
    and the parts of the graph whose range check the grouping kernel ran into ``host_flags`` (the
    bits of :func:`launch_graph_check`; remembered at once as that function's are)."""
    from .build import cuda_module
    return cuda_module().group_edges_checked(dst_idx, src_idx, num_dst, num_src, both, host_flags)


class DeferredChecks:
    """Graph checks running on the device, whose verdicts the host reads without waiting.

    A check's kernel writes its flags straight into pinned host memory, a read-back buffer of
    :meth:`buffer`; :meth:`submit` queues an event behind it. :meth:`raise_found`, which every
    CUDA check and every attention call makes first, looks at the events without waiting: for each
    check the device has finished, it drops the check, or, where it failed, has the extension
    forget what its memos were told (:func:`launch_graph_check`) and raises the check's error,
    naming the argument of the call that passed the bad graph. :meth:`wait` waits for every
    pending check first (:func:`edgedot.wait_for_checks`).

    A pending check holds the call's index tensors, for the details of its error (their values
    as they are when the error is raised)."""

    # Read-back buffers kept for reuse, per device: making a pinned tensor and an Event costs the
    # host more than the check's launch.
    MAX_SPARE = 16
    # Stream wrappers kept for Event.record, per (stream, device): torch.cuda.current_stream makes
    # a new one every call, which cost the H200 machine's host about a tenth of a mini-batch
    # forward (py-spy, 2026-12-05). Past this many, they are all dropped.
    MAX_STREAMS = 64
    # int32 flags a check writes (kGraphCheckFlags in csrc/common/edgedot.h).
    NUM_FLAGS = 5

    def __init__(self):
        self._pending = []
        self._spare = {}
        self._streams = {}
        self._lock = threading.Lock()  # threads may call ops at once

    def buffer(self, device):
        """``(host, done)`` for a check on ``device``: pinned int32 ``[NUM_FLAGS]`` flags, free to
        write (a spare's check has been read), and its ``torch.cuda.Event``."""
        with self._lock:
            spare = self._spare.get(device)
            if spare:
                return spare.pop()
        return torch.empty(self.NUM_FLAGS, dtype=torch.int32, pin_memory=True), torch.cuda.Event()

    def submit(self, read_back, device, launched, graph):
        """Queues the read-back of a check just launched on ``device``'s current stream into
        ``read_back`` (:meth:`buffer`'s pair); ``launched``: the parts of the graph it checked
        (:func:`launch_graph_check`'s bits), forgotten if it fails; ``graph``:
        :func:`check_graph`'s tensors and names."""
        host, done = read_back
        done.record(self._current_stream(device))
        with self._lock:
            self._pending.append((done, host, launched, graph, device))

    def _current_stream(self, device):
        """``torch.cuda.current_stream(device)`` (``device``: a CUDA device with its index), the
        same wrapper for the same stream each time."""
        key = torch._C._cuda_getCurrentStream(device.index)  # (stream id, device index, device type)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= self.MAX_STREAMS:
                self._streams.clear()
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._streams[key] = stream
        return stream

    def give_back(self, read_back, device):
        """Returns an unused pair of :meth:`buffer` to the spares."""
        with self._lock:
            spare = self._spare.setdefault(device, [])
            if len(spare) < self.MAX_SPARE:
                spare.append(read_back)

    def raise_found(self, wait=False):
        """Settles every finished check (every pending one with ``wait``); raises the first error.
        Nothing during CUDA-graph capture, which forbids looking at events."""
        if not self._pending or torch.cuda.is_current_stream_capturing():
            return
        with self._lock:
            finished, waiting = [], []
            for check in self._pending:
                if wait:
                    check[0].synchronize()
                (finished if wait or check[0].query() else waiting).append(check)
            self._pending = waiting
        failed = []
        for done, host, launched, graph, device in finished:
            flags = sum(1 << k for k, bit in enumerate(host.tolist()) if bit)
            self.give_back((host, done), device)  # read: the buffer and its event may serve a later check
            if flags:
                from .build import cuda_module
                src_idx, _, dst_idx, _, dst_ptr, _ = graph
                cuda_module().graph_check_forget(src_idx, dst_idx, dst_ptr, launched)
                failed.append((flags, graph))
        if failed:
            flags, graph = failed[0]
            _raise_graph_error(flags, *graph, earlier=True)

    def wait(self):
        self.raise_found(wait=True)

    def discard(self):
        """Forgets every pending check, its verdict unread, once the device has run it: its kernel
        writes into a buffer that, freed before, could be another tensor's memory by then."""
        with self._lock:
            pending, self._pending = self._pending, []
        for done, *_ in pending:
            done.synchronize()


deferred = DeferredChecks()


def wait_for_checks():
    """Waits for the index checks of earlier edgedot calls still running on the device (CUDA
    calls do not wait for them), and raises the error of the first that found a bad index or
    pointer (``IndexError`` / ``ValueError`` naming the argument). Without pending checks it
    returns at once; every edgedot call also raises the errors of the checks the device has
    finished by then, without waiting. Call it where a loop must know its graphs were valid,
    e.g. before saving a checkpoint; a bad index is never read in any case."""
    deferred.wait()


def graph_flags(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst):
    """The conditions of :func:`check_graph` that fail, as a bitmask (``SRC_OUT_OF_RANGE``,
    ``DST_OUT_OF_RANGE`` when asked; ``PTR_ENDS_WRONG``, ``PTR_DECREASES``, ``PTR_DISAGREES`` with
    ``dst_ptr``), read back at once (on CUDA one kernel of the extension and one wait)."""
    if src_idx.is_cuda:
        from .build import cuda_module
        flags = cuda_module().graph_flags(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst)
        return sum(1 << k for k, bit in enumerate(flags.tolist()) if bit)
    return _flags_on_host(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst)


def _flags_on_host(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst):
    """:func:`graph_flags` by tensor operations (any device but CUDA): each index's range read
    back as two numbers (the fewest operations; a CPU call runs it every time)."""
    flags = SRC_OUT_OF_RANGE if check_src and _out_of_range(src_idx, num_src) else 0
    if check_dst and _out_of_range(dst_idx, num_dst):
        flags |= DST_OUT_OF_RANGE
    if dst_ptr is not None:
        ptr = dst_ptr.to(torch.int64).contiguous()
        num_edges = dst_idx.shape[0]
        conditions = [(ptr[0] != 0) | (ptr[-1] != num_edges), (ptr[1:] < ptr[:-1]).any(),
                      (_rows_of_edges(ptr, num_edges) != dst_idx).any()]
        for flag, failed in zip((PTR_ENDS_WRONG, PTR_DECREASES, PTR_DISAGREES), torch.stack(conditions).tolist()):
            if failed:
                flags |= flag
    return flags


def _out_of_range(idx, num_rows):
    """Whether an entry of ``idx`` lies outside ``[0, num_rows)``."""
    if idx.numel() == 0:
        return False
    lo, hi = torch.aminmax(idx)
    return lo.item() < 0 or hi.item() >= num_rows


def _rows_of_edges(ptr, num_edges):
    """The node whose range of ``ptr`` (int64, contiguous) holds each edge."""
    return torch.searchsorted(ptr, torch.arange(num_edges, device=ptr.device), right=True) - 1


def _raise_graph_error(flags, src_idx, num_src, dst_idx, num_dst, dst_ptr, names=OP_NAMES, earlier=False):
    """The error for the failed conditions ``flags``, with its details (more passes, more waits);
    ``earlier``: found by the device after the call that passed the graph returned."""
    src_name, dst_name, ptr_name = names
    when = " (in the graph of an earlier call: the device's check found it after the call returned)" \
        if earlier else ""
    num_edges = dst_idx.shape[0]
    if flags & (PTR_ENDS_WRONG | PTR_DECREASES):
        raise ValueError(f"{ptr_name} must rise from 0 to E={num_edges} without decreasing (a CSR pointer by "
                         f"destination){when}")
    if flags & PTR_DISAGREES:
        rows = _rows_of_edges(dst_ptr.to(torch.int64).contiguous(), num_edges)
        wrong = torch.nonzero(rows != dst_idx)
        detail = "(are the edges sorted by destination?)"
        if wrong.numel():
            bad = int(wrong[0, 0])
            detail = (f"edge {bad} has destination {int(dst_idx[bad])} but lies in the range of node "
                      f"{int(rows[bad])} {detail}")
        raise ValueError(f"{ptr_name} disagrees with {dst_name}: {detail}{when}")
    for bit, name, idx, num_rows in ((SRC_OUT_OF_RANGE, src_name, src_idx, num_src),
                                     (DST_OUT_OF_RANGE, dst_name, dst_idx, num_dst)):
        if flags & bit:
            if idx.numel():
                lo, hi = (int(v) for v in torch.aminmax(idx))
                if lo < 0 or hi >= num_rows:
                    raise IndexError(f"{name} holds {lo if lo < 0 else hi}, outside [0, {num_rows}){when}")
            if earlier:  # written since the check
                raise IndexError(f"{name} held an index outside [0, {num_rows}){when}")
    # The data changed between the check and the details (another stream wrote it).
    raise ValueError(f"{src_name}, {dst_name} or {ptr_name} changed while being checked")
