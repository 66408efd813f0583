"""Command line of the benchmark: ``python -m edgedot.bench [--quick] [--cases a,b] ...``."""

import argparse
import datetime
import math
import time
from dataclasses import asdict, replace

import torch

from . import __doc__ as package_doc
from .attention import ATTENTION_CASES, AttentionCase, add_power_law_ratios, run_attention_case, shrunk_attention
from .cases import CASES, TOLERANCE, dtype_name, shrunk
from .edge_attention import EDGE_ATTENTION_CASES, EdgeAttentionCase, run_edge_attention_case
from .edge_dot import load_kernels, run_case
from .gat import GAT_CASES, GATCase, add_gat_power_law_ratios, run_gat_case, shrunk_gat
from .report import report_lines, save_chart, write_json
from .timing import (FULL, QUICK, CudaClock, HostClock, cache_bytes, copy_bandwidth, first_line, l2_bandwidths,
                     l2_probe_bytes, progress, release_memory)


def _known_cases():
    known = {case.name: (case, shrunk) for case in CASES}
    known.update({case.name: (case, shrunk_attention) for case in ATTENTION_CASES})
    known.update({case.name: (case, shrunk_gat) for case in GAT_CASES})
    known.update({case.name: (case, shrunk_attention) for case in EDGE_ATTENTION_CASES})
    return known


def select_cases(names, quick):
    """The chosen cases (all for ``None``), shrunk for ``--quick``; edge_dot cases first.
    ``names``: a list of case names, or one string of them separated by commas."""
    known = _known_cases()
    if names is None:
        chosen = list(known)
    else:
        chosen = [name.strip() for name in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [shrink(case) if quick else case for case, shrink in (known[name] for name in chosen)]


def case_names(text):
    """``--cases``: names separated by commas, each known and none empty."""
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError("no case named: give one or more case names separated by commas, "
                                         "or leave --cases out for all")
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} holds an empty case name")
    known = _known_cases()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def reps_scale(text):
    """``--reps-scale``: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, not {text}")
    return value


def parse_args(argv, cuda_available=None):
    """The options; a usage error (exit status 2, naming the option) for bad values, and without
    CUDA (``cuda_available``, default: ``torch.cuda.is_available()``) for the full-size suite
    unless ``--full-on-cpu`` asks for it."""
    parser = argparse.ArgumentParser(prog="python -m edgedot.bench", description=package_doc.splitlines()[0])
    parser.add_argument("--cases", type=case_names, help="comma-separated case names (default: all): "
                        + ", ".join(case.name for case in [*CASES, *ATTENTION_CASES, *GAT_CASES]))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (also on CPU)")
    parser.add_argument("--full-on-cpu", action="store_true",
                        help="without CUDA, run the full sizes on the CPU anyway (hours); without it and "
                             "without --quick, a machine without CUDA is refused")
    parser.add_argument("--json", default="bench_out/bench.json", help="where to write all numbers")
    parser.add_argument("--png", default="bench_out/bench.png", help="where to write the chart")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--reps-scale", type=reps_scale, default=1.0,
                        help="multiplies every number of timed calls (a positive number; default 1)")
    args = parser.parse_args(argv)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not (cuda_available or args.quick or args.full_on_cpu):
        parser.error("no CUDA device: the full-size suite is sized for a GPU and would take hours on the "
                     "CPU; pass --quick for tiny sizes (a smoke test), or --full-on-cpu to run it anyway")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = replace(QUICK if args.quick else FULL, reps_scale=args.reps_scale)
    cases = select_cases(args.cases, args.quick)
    clock = CudaClock(device) if device.type == "cuda" else HostClock()

    progress("loading the edgedot kernels")
    try:
        kernel_load_seconds = load_kernels(device)
    except Exception as error:  # every edgedot path will then report ERR
        progress(f"edgedot failed on {device}: {first_line(error)}")
        kernel_load_seconds = math.nan
    start = time.perf_counter()
    copy_bw = copy_bandwidth(device, clock, settings)
    l2_bw = l2_bandwidths(device, clock)
    bandwidths = {"copy": copy_bw, "l2_copy": l2_bw["copy"]}
    records = {}
    for case in cases:
        # (GATCase and EdgeAttentionCase first: they are AttentionCases too.)
        run = run_gat_case if isinstance(case, GATCase) else \
            run_edge_attention_case if isinstance(case, EdgeAttentionCase) else \
            run_attention_case if isinstance(case, AttentionCase) else run_case
        records[case.name] = run(case, device, clock, settings, not args.no_backward, bandwidths)
        release_memory()
    add_power_law_ratios(records)
    add_gat_power_law_ratios(records)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": args.quick,
        "settings": asdict(settings),
        "tolerance": {dtype_name(dtype): tol for dtype, tol in TOLERANCE.items()},
        "cache_bytes": cache_bytes(device),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "l2_bandwidth_bytes_per_s": l2_bw,
        "l2_probe_bytes": l2_probe_bytes(device),
        "kernel_load_seconds": kernel_load_seconds,
        "total_seconds": time.perf_counter() - start,
        "cases": records,
    }
    print("\n".join(report_lines(report)))
    write_json(report, args.json)
    save_chart(report, args.png)


if __name__ == "__main__":
    main()
