"""Clocks, bandwidth probes and the measurement of one benchmark path (check, then time)."""

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

CALLS_PER_GRAPH = 100
L2_BYTES_IF_UNKNOWN = 60 * 2**20   # H200's L2; also stands for a CPU's last-level cache
L2_PROBE_BYTES = 8 * 2**20         # the buffer the L2 probes keep hot (well inside 60 MB)
L2_PROBE_REPLAYS = 20


@dataclass(frozen=True)
class Settings:
    """How long each measurement runs, and how many input sets a small case rotates through."""

    target_s: float   # timed seconds aimed at per path
    min_reps: int
    max_reps: int
    max_sets: int
    copy_bytes: int   # size of the tensor copied to measure the copy bandwidth
    reps_scale: float = 1.0

    def reps_for(self, seconds_per_call):
        reps = math.ceil(self.target_s / max(seconds_per_call, 1e-9))
        reps = min(max(reps, self.min_reps), self.max_reps)
        return max(1, round(reps * self.reps_scale))


# Host-bound calls of tens of microseconds vary from call to call (two modes on the H200's host):
# up to 2000 of them make a stable median in well under a second.
FULL = Settings(target_s=0.25, min_reps=10, max_reps=2000, max_sets=128, copy_bytes=2 * 2**30)
# Rounds of a section whose calls get a new graph each (run_section): their times are the host's,
# whose speed drifted within a section by up to 1.5x on the H200's hosts (2026-12-05: one call's
# quarters of reps 610, 506, 540 and 524 µs, the same computation as a later path 398-399).
FRESH_GRAPH_ROUNDS = 8
QUICK = Settings(target_s=0.01, min_reps=3, max_reps=10, max_sets=4, copy_bytes=64 * 2**20)


def progress(message):
    print(message, file=sys.stderr, flush=True)


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cache_bytes(device):
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", L2_BYTES_IF_UNKNOWN)
    return L2_BYTES_IF_UNKNOWN


# --------------------------------------------------------------------------- clocks

def no_reset(_):
    pass


class CudaClock:
    """Times each call between two CUDA events; measures peak memory with the caching allocator."""

    def __init__(self, device):
        self.device = device

    def sync(self):
        torch.cuda.synchronize(self.device)

    def time_calls(self, call, reps, num_sets, reset=no_reset):
        """Seconds of each of ``reps`` calls, input set ``r % num_sets`` for call ``r``."""
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for rep in range(reps):
            reset(rep % num_sets)
            starts[rep].record()
            call(rep % num_sets)
            ends[rep].record()
        self.sync()
        return [start.elapsed_time(end) * 1e-3 for start, end in zip(starts, ends)]

    def peak_extra_bytes(self, call, reset):
        reset(0)
        self.sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = call(0)
        self.sync()
        del out
        return torch.cuda.max_memory_allocated(self.device) - before


class HostClock:
    """CPU timing with ``time.perf_counter``; no memory statistics."""

    def sync(self):
        pass

    def time_calls(self, call, reps, num_sets, reset=no_reset):
        times = []
        for rep in range(reps):
            reset(rep % num_sets)
            start = time.perf_counter()
            call(rep % num_sets)
            times.append(time.perf_counter() - start)
        return times

    def peak_extra_bytes(self, call, reset):
        return None


# --------------------------------------------------------------------------- bandwidth probes

def copy_bandwidth(device, clock, settings):
    """Bytes per second (read + written) of ``dst.copy_(src)``, median of 10 copies; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.ones(settings.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    clock.time_calls(lambda _: dst.copy_(src), 3, 1)
    seconds = statistics.median(clock.time_calls(lambda _: dst.copy_(src), 10, 1))
    return 2 * src.nbytes / seconds


def capture_in_graph(call, set_of_call):
    """``CALLS_PER_GRAPH`` calls, the k-th on input set ``set_of_call(k)``, in one CUDA graph.

    Returns the graph and the calls' outputs (kept alive, so each call writes its own)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            call(set_of_call(k))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(set_of_call(k)) for k in range(CALLS_PER_GRAPH)]
    return graph, outs


def l2_probe_bytes(device):
    """Size of the buffers the L2 probes keep hot: ``L2_PROBE_BYTES``, at most a quarter of L2."""
    return min(L2_PROBE_BYTES, cache_bytes(device) // 4)


def l2_bandwidths(device, clock):
    """Bytes per second of hot ops on ``L2_PROBE_BYTES`` buffers that stay in the L2 cache.

    ``CALLS_PER_GRAPH`` ops replayed from one CUDA graph (the same launch pattern as the hot
    graph replay of the kernels), median of ``L2_PROBE_REPLAYS`` replays. ``copy``:
    ``dst.copy_(src)``, bytes read + written; ``read``: ``torch.sum(src)``, bytes read.
    None on CPU."""
    if device.type != "cuda":
        return {"copy": None, "read": None}
    src = torch.ones(l2_probe_bytes(device) // 4, dtype=torch.float32, device=device)
    dst, total = torch.empty_like(src), torch.empty((), dtype=torch.float32, device=device)
    rates = {}
    for name, op, moved in (("copy", lambda _: dst.copy_(src), 2 * src.nbytes),
                            ("read", lambda _: torch.sum(src, 0, out=total), src.nbytes)):
        graph, _ = capture_in_graph(op, lambda k: 0)
        clock.time_calls(lambda _: graph.replay(), 3, 1)
        seconds = statistics.median(clock.time_calls(lambda _: graph.replay(), L2_PROBE_REPLAYS, 1))
        rates[name] = CALLS_PER_GRAPH * moved / seconds
        del graph
    return rates


# --------------------------------------------------------------------------- one path

class NotApplicable(Exception):
    """The path cannot run this case; the message says why."""


def relative_error(got, want):
    if got is None:
        return math.inf
    return float((got.detach().double() - want).norm() / want.norm().clamp_min(1e-300))


@dataclass
class BenchPath:
    call: Callable[[int], torch.Tensor]           # the timed call, on input set i
    error_of: Callable[[torch.Tensor], float]     # relative error of call(0)'s result
    reset: Callable[[int], None] = no_reset       # restores input set i before a call (untimed)
    bytes_moved: Optional[int] = None             # when it differs from the case's count
    num_edges: Optional[int] = None               # edges computed, when not the case's E
    check: Optional[Callable[[], float]] = None   # relative error by its own run, instead of error_of
    strict: bool = True                           # False: timed even above the tolerance (a baseline)


def prepare(path, tolerance, num_sets, clock, settings, with_peak=True):
    """Checks ``path`` on input set 0, measures its peak extra memory and warms it up: ``(result, reps)``,
    the result without its times (status FAIL, and no reps, where a strict path misses the
    tolerance) and the reps its timing takes."""
    path.reset(0)
    error = path.check() if path.check is not None else path.error_of(path.call(0))
    inaccurate = not error <= tolerance
    if inaccurate and path.strict:
        return {"status": "FAIL", "rel_err": error}, 0
    peak = clock.peak_extra_bytes(path.call, path.reset) if with_peak else None
    warm_up = clock.time_calls(path.call, max(3, num_sets), num_sets, path.reset)
    result = {"status": "ok", "rel_err": error, "peak_extra_bytes": peak, "bytes_moved": path.bytes_moved,
              "num_edges": path.num_edges}
    if inaccurate:
        result["inaccurate"] = True
    return result, settings.reps_for(statistics.median(warm_up))


def timed(path, reps, num_sets, clock, calls_per_run=1):
    """Microseconds of each of ``reps`` calls of ``path``, per op (``calls_per_run`` ops a call)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        times = clock.time_calls(path.call, reps, num_sets, path.reset)
    return [1e6 * t / calls_per_run for t in times]


def with_times(result, times_us):
    """``result`` completed with its times and their median."""
    return dict(result, median_us=statistics.median(times_us), reps=len(times_us), times_us=times_us)


def measure(path, tolerance, num_sets, clock, settings, calls_per_run=1, with_peak=True):
    """Checks ``path`` on input set 0, then times it; ``calls_per_run`` ops run in each call."""
    result, reps = prepare(path, tolerance, num_sets, clock, settings, with_peak)
    if result["status"] != "ok":
        return result
    return with_times(result, timed(path, reps, num_sets, clock, calls_per_run))


def guarded(run):
    """``run()``, or the status of what it raised: OOM, n/a and errors do not stop the other paths."""
    try:
        return run()
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except NotApplicable as reason:
        return {"status": "n/a", "message": str(reason)}
    except Exception as error:  # a broken path must not stop the others
        return {"status": "ERR", "message": first_line(error)}


def run_path(make_path, num_sets, **measure_options):
    """Builds the path and measures it; OOM, n/a and errors become a status instead of raising."""
    def run():
        path = make_path()
        try:
            return measure(path, num_sets=num_sets, **measure_options)
        finally:
            for i in range(num_sets):
                path.reset(i)
    return guarded(run)


def run_section(label, path_makers, bytes_moved, copy_bw, baselines=("eager", "compile"), with_l2=False,
                l2_bw=None, rounds=1, **measure_options):
    """Runs every path of one section; see :func:`add_comparisons` for what is added. With
    ``rounds`` > 1 the paths are checked and warmed up one after the other, then timed in
    ``rounds`` rounds that each take every path in turn for its share of the reps: the host's drift
    over the section's seconds then falls on all paths alike, and the ratios between them hold
    (host-bound calls, such as those on a new mini-batch every step). With one round each path is
    built, measured and released before the next, so that the large cases' paths (plans, peers'
    adjacencies) never hold their memory at once."""
    if rounds > 1:
        results = _interleaved(label, path_makers, rounds, **measure_options)
    else:
        results = {}
        for name, make_path in path_makers.items():
            progress(f"  {label}: {name}")
            results[name] = run_path(make_path, **measure_options)
            release_memory()
    add_comparisons(results, bytes_moved, copy_bw, baselines, with_l2, l2_bw)
    return results


def _interleaved(label, path_makers, rounds, tolerance, num_sets, clock, settings, calls_per_run=1,
                 with_peak=True):
    """The results of :func:`run_section` with its rounds (see there)."""
    results, built, timing = {}, [], {}
    try:
        for name, make_path in path_makers.items():
            progress(f"  {label}: {name}")

            def check(make_path=make_path):
                built.append(make_path())
                return prepare(built[-1], tolerance, num_sets, clock, settings, with_peak)
            outcome = guarded(check)
            if isinstance(outcome, dict):
                results[name] = outcome
                continue
            results[name], reps = outcome
            if results[name]["status"] == "ok":
                timing[name] = (built[-1], math.ceil(reps / rounds), [])
        progress(f"  {label}: timed in {rounds} rounds")
        for _ in range(rounds):
            for name, (path, share, times) in list(timing.items()):
                outcome = guarded(lambda: timed(path, share, num_sets, clock, calls_per_run))
                if isinstance(outcome, dict):
                    results[name] = outcome
                    del timing[name]
                else:
                    times.extend(outcome)
        for name, (_, _, times) in timing.items():
            results[name] = with_times(results[name], times)
    finally:
        for path in built:
            for i in range(num_sets):
                path.reset(i)
        release_memory()
    return results


def add_comparisons(results, bytes_moved, copy_bw, baselines, with_l2=False, l2_bw=None):
    """Adds ``vs_<baseline>`` (time / that path's time) and the fraction of the copy bandwidth
    that the counted bytes make per second; ``with_l2``: also that of the L2 bandwidth (None
    where it is unknown)."""
    times = {f"vs_{name}": results.get(name, {}).get("median_us") for name in baselines}
    for result in results.values():
        if result["status"] != "ok":
            continue
        seconds = result["median_us"] * 1e-6
        for key, baseline in times.items():
            result[key] = result["median_us"] / baseline if baseline else None
        result["bytes_moved"] = result["bytes_moved"] or bytes_moved
        result["bw_fraction"] = result["bytes_moved"] / seconds / copy_bw if copy_bw else None
        if with_l2:
            result["l2_fraction"] = result["bytes_moved"] / seconds / l2_bw if l2_bw else None
