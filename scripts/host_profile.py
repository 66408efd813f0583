"""Where the host's time goes in training steps on fresh mini-batches, by native and Python frame,
on a CUDA machine: a loop of one path's forward + backward steps for a sampling profiler, and a
summary of what it recorded.

    py-spy record --native --threads --rate 1000 --format raw -o steps.txt -- \\
        python scripts/host_profile.py run --path graph_attention --seconds 8 --stats steps.json
    python scripts/host_profile.py summarize steps.txt --stats steps.json --rate 1000

The paths and the batch are scripts/profile_minibatch.py's (``--paths`` names there: the three
ops, ``compile ...``, ``edgedot TransformerConv``, ``pyg GATConv`` and so on), with new index
tensors every step. ``run`` writes the number of profiled steps and their seconds to ``--stats``;
``summarize`` turns sample counts into µs per step (a sample stands for ``1 / rate`` seconds) and
prints, for the profiled steps: each thread's total, the frames by inclusive and by own time, and
the own time by library (``libcuda``, ``libtorch_cuda``, the extension, the interpreter, ...).
Native frames show only with py-spy's ``--native``; a thread that never runs Python (autograd's
device thread, with C++ nodes alone) may not be sampled by py-spy at all, which the thread list
shows.
"""

import argparse
import collections
import json
import re
import sys
import time

REGION = "profiled_steps"  # the frame of the steps a summary counts
SYNC_EVERY = 50  # steps between synchronisations: a device slower than the host must not fall behind unboundedly


def run(args):
    import torch

    from profile_minibatch import make_paths

    paths = make_paths(args)
    if args.path not in paths:
        raise SystemExit(f"--path must be one of {sorted(paths)}, got {args.path!r}")
    call = paths[args.path]
    for step in range(args.warmup):
        call(step, True)
    torch.cuda.synchronize()
    steps, seconds = profiled_steps(call, args.seconds, args.warmup)
    print(f"{args.path}: {steps} steps in {seconds:.2f} s, {1e6 * seconds / steps:.1f} µs a step")
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump({"path": args.path, "steps": steps, "seconds": seconds}, f)


def profiled_steps(call, seconds, first_step):
    """Forward + backward steps for ``seconds``; (steps, seconds taken, the device finished)."""
    import torch

    begin = time.perf_counter()
    step = first_step
    while time.perf_counter() - begin < seconds:
        call(step, True)
        step += 1
        if (step - first_step) % SYNC_EVERY == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return step - first_step, time.perf_counter() - begin


def frame_name(frame):
    """A frame without its line number: ``f (file.py:12)`` -> ``f (file.py)``."""
    return re.sub(r":\d+\)$", ")", frame)


def library_of(frame):
    """The library of a native frame (``... (libcuda.so.1)``), or ``python`` for a Python one."""
    match = re.search(r"\(([^()]*)\)$", frame)
    where = match.group(1) if match else ""
    if where.endswith(".py") or ".py:" in where or where.startswith("<"):
        return "python"
    return re.sub(r"\.so.*$", ".so", where) or "?"


def thread_id(thread):
    """``thread (123): MainThread`` -> ``123``."""
    match = re.match(r"thread \((\w+)\)", thread)
    return match.group(1) if match else thread


def read_samples(path):
    """``[(thread, frames, count)]`` of py-spy's raw (collapsed) output."""
    samples = []
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            thread = frames[0] if frames[0].startswith("thread") else "?"
            samples.append((thread, frames[1:] if thread != "?" else frames, int(count)))
    return samples


def summarize(args):
    samples = read_samples(args.file)
    stats = json.load(open(args.stats)) if args.stats else None
    per_step = 1e6 / args.rate / stats["steps"] if stats else None

    def show(count):
        return f"{count * per_step:9.1f} µs" if per_step else f"{count:9d} samples"

    threads = collections.Counter()
    in_region = collections.Counter()
    inclusive, own, libraries = collections.Counter(), collections.Counter(), collections.Counter()
    region_total = 0
    main_ids = {thread_id(t) for t, _, _ in samples if "MainThread" in t}
    for thread, frames, count in samples:
        threads[thread] += count
        names = [frame_name(f) for f in frames]
        inside = any(n.startswith(REGION + " ") for n in names)
        # The main thread counts inside the steps only (not its imports, builds and warm-up); other
        # threads (autograd's) count whole: the warm-up is short against the profiled seconds.
        if not inside and thread_id(thread) in main_ids:
            continue
        in_region[thread] += count
        region_total += count
        for name in set(names):
            inclusive[name] += count
        if names:
            own[names[-1]] += count
            libraries[library_of(names[-1])] += count
    if stats:
        print(f"{stats['path']}: {stats['steps']} steps, {1e6 * stats['seconds'] / stats['steps']:.1f} µs a step "
              f"(wall); a sample = {1e6 / args.rate:.0f} µs")
    print("\n== threads: samples in all, then in the profiled steps")
    for thread, count in threads.most_common():
        print(f"{count:9d}  {show(in_region[thread])}  {thread}")
    print(f"\n== inclusive, per step (of {show(region_total).strip()} sampled)")
    for name, count in inclusive.most_common(args.top):
        print(f"{show(count)}  {100 * count / region_total:5.1f}%  {name[:150]}")
    print("\n== own time, per step")
    for name, count in own.most_common(args.top):
        print(f"{show(count)}  {100 * count / region_total:5.1f}%  {name[:150]}")
    print("\n== own time by library, per step")
    for name, count in libraries.most_common():
        print(f"{show(count)}  {100 * count / region_total:5.1f}%  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    loop = commands.add_parser("run", help="a loop of forward + backward steps to be sampled")
    loop.add_argument("--path", default="graph_attention")
    loop.add_argument("--seconds", type=float, default=8.0)
    loop.add_argument("--warmup", type=int, default=30)
    loop.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    loop.add_argument("--fanout", type=int, default=10)
    loop.add_argument("--seeds", type=int, default=16_384)
    loop.add_argument("--stats", help="write the profiled steps and their seconds here (JSON)")
    report = commands.add_parser("summarize", help="µs per step by frame, from py-spy's raw output")
    report.add_argument("file")
    report.add_argument("--stats", help="run's --stats file: per-step figures instead of sample counts")
    report.add_argument("--rate", type=float, default=1000.0, help="the sampling rate given to py-spy")
    report.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        summarize(args)


if __name__ == "__main__":
    sys.exit(main())
