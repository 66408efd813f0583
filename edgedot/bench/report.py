"""The benchmark's report: tables on stdout, the JSON file and the chart."""

import json
from pathlib import Path

from .attention import TARGET_DEVICE, targets_apply
from .cases import (ATTN_FORWARD, ATTN_FORWARD_BACKWARD, EDGE_ATTN_FORWARD, EDGE_ATTN_FORWARD_BACKWARD, FORWARD,
                    FORWARD_BACKWARD, GAT_FORWARD, GAT_FORWARD_BACKWARD, GRAPH_REPLAY, GRAPH_REPLAY_HOT)
from .timing import CALLS_PER_GRAPH


def megabytes(value):
    """Bytes as MB (10**6), one decimal."""
    return f"{value / 1e6:.1f}"


def gigabytes(value):
    """Bytes as GB (10**9), one decimal."""
    return f"{value / 1e9:.1f}"


METRICS = {
    "median_us": ("median time per call (us)", "{:.1f}".format),
    "vs_eager": ("time / eager time (<1: faster than eager)", "{:.3f}".format),
    "vs_compile": ("time / compile time (<1: faster than compile)", "{:.3f}".format),
    "vs_pyg": ("time / PyG time (<1: faster than PyG)", "{:.3f}".format),
    "vs_turbo": ("time / Turbo-GNN time (<1: faster than Turbo-GNN)", "{:.3f}".format),
    "vs_anemoi": ("time / anemoi's Triton GraphTransformer time (<1: faster than anemoi's)", "{:.3f}".format),
    "vs_bound": ("time / bytes bound (the section's least bytes at the copy bandwidth)", "{:.2f}".format),
    "vs_forward": ("forward+backward time / the same path's forward time", "{:.2f}".format),
    "bw_fraction": ("bytes counted / time / copy bandwidth", "{:.2f}".format),
    "l2_fraction": ("bytes gathered / time / L2 copy bandwidth", "{:.2f}".format),
    "peak_extra_bytes": ("peak extra memory of one call (MB)", megabytes),
}
EDGE_DOT_METRICS = ["median_us", "vs_eager", "vs_compile", "bw_fraction", "peak_extra_bytes"]

# Each table: title, the sections whose results make its rows (with a suffix to the case name)
# and the metrics shown, one table per metric.
TABLES = [
    ("Forward", [(FORWARD, "")], EDGE_DOT_METRICS),
    ("Forward + backward", [(FORWARD_BACKWARD, "")], EDGE_DOT_METRICS),
    ("Kernel time alone: calls captured in a CUDA graph", [(GRAPH_REPLAY, " cold"), (GRAPH_REPLAY_HOT, " hot")],
     ["median_us", "vs_compile", "bw_fraction", "l2_fraction"]),
    ("Attention forward", [(ATTN_FORWARD, "")],
     ["median_us", "vs_compile", "vs_pyg", "vs_turbo", "vs_bound", "peak_extra_bytes"]),
    ("Attention forward + backward", [(ATTN_FORWARD_BACKWARD, "")],
     ["median_us", "vs_compile", "vs_pyg", "vs_turbo", "vs_forward", "vs_bound", "peak_extra_bytes"]),
    ("GAT forward", [(GAT_FORWARD, "")],
     ["median_us", "vs_compile", "vs_pyg", "vs_turbo", "vs_bound", "peak_extra_bytes"]),
    ("GAT forward + backward", [(GAT_FORWARD_BACKWARD, "")],
     ["median_us", "vs_compile", "vs_pyg", "vs_turbo", "vs_forward", "vs_bound", "peak_extra_bytes"]),
    ("Attention with edge features, forward", [(EDGE_ATTN_FORWARD, "")],
     ["median_us", "vs_compile", "vs_anemoi", "vs_bound", "peak_extra_bytes"]),
    ("Attention with edge features, forward + backward", [(EDGE_ATTN_FORWARD_BACKWARD, "")],
     ["median_us", "vs_compile", "vs_anemoi", "vs_forward", "vs_bound", "peak_extra_bytes"]),
]
SECTIONS = [section for _, parts, _ in TABLES for section, _ in parts]
NAME_WIDTH, CELL_WIDTH, CASE_CELL_WIDTH = 18, 16, 11


def table_lines(header, rows, cell_width=CELL_WIDTH):
    def line(cells):
        return cells[0].ljust(NAME_WIDTH) + "".join(str(c).rjust(cell_width) for c in cells[1:])
    lines = [line(header), "-" * (NAME_WIDTH + cell_width * (len(header) - 1))]
    return lines + [line(row) for row in rows]


def metric_cell(result, key, formatter):
    if result is None:
        return "-"
    if result["status"] != "ok":
        return result["status"]
    value = result.get(key)
    if value is None:
        return "n/a"
    return formatter(value) + ("*" if key == "median_us" and result.get("inaccurate") else "")


def case_table(cases):
    header = ["case", "Ns", "Nd", "E", "HxD", "dtype", "index", "edges", "sets", "src rows",
              "fwd MB", "f+b MB", "cusparse E"]
    rows = []
    for name, record in cases.items():
        if record.get("kind") != "edge_dot":
            continue
        config = record["config"]
        cusparse = record[FORWARD].get("cusparse", {})
        rows.append([name, config["num_src"], config["num_dst"], config["num_edges"],
                     f"{config['heads']}x{config['dim']}", config["dtype"], config["index_dtype"],
                     config["edges"], record["input_sets"], record["src_rows_read"],
                     megabytes(record["bytes"][FORWARD]), megabytes(record["bytes"][FORWARD_BACKWARD]),
                     cusparse.get("num_edges") or "-"])
    return table_lines(header, rows, CASE_CELL_WIDTH) if rows else []


def attention_case_table(cases):
    """Sizes, the float64 check's sample and the gather bound of each attention (and GAT) case."""
    header = ["case", "N", "E", "HxD", "dtype", "in", "sets", "chk nodes", "chk edges", "fwd MB", "f+b MB",
              "bound us"]
    rows = []
    for name, record in cases.items():
        if record.get("kind") not in ("attention", "gat", "edge_attention"):
            continue
        config, check = record["config"], record["check"]
        bound = record["bound_us"]
        forward_key, both_key = {"attention": (ATTN_FORWARD, ATTN_FORWARD_BACKWARD), "gat": (GAT_FORWARD,
                                 GAT_FORWARD_BACKWARD), "edge_attention": (EDGE_ATTN_FORWARD,
                                 EDGE_ATTN_FORWARD_BACKWARD)}[record["kind"]]
        forward_bytes, both_bytes = record["bytes"][forward_key], record["bytes"].get(both_key)
        rows.append([name, config["num_nodes"], config["num_edges"], f"{config['heads']}x{config['dim']}",
                     config["dtype"], config["in_channels"], record["input_sets"], check["dst_nodes"],
                     check["edges"], megabytes(forward_bytes), "n/a" if both_bytes is None else megabytes(both_bytes),
                     "n/a" if bound is None else f"{bound:.0f}"])
    return ["", "Attention cases (chk: destination nodes and edges of the float64 check)"] + \
        table_lines(header, rows, CASE_CELL_WIDTH) if rows else []


def table_rows(cases, parts):
    """``(row label, results by path)`` for each case that has one of the sections in ``parts``."""
    return [(name + suffix, record[section]) for name, record in cases.items()
            for section, suffix in parts if section in record]


def section_tables(cases, title, parts, metrics):
    rows = table_rows(cases, parts)
    if not rows:
        return []
    paths = list(dict.fromkeys(path for _, results in rows for path in results))
    lines = []
    for key in metrics:
        description, formatter = METRICS[key]
        lines += ["", f"{title}: {description}"]
        lines += table_lines(["case"] + paths,
                             [[label] + [metric_cell(results.get(path), key, formatter) for path in paths]
                              for label, results in rows])
    return lines


def target_cell(pair, formatter, scored=True):
    """``measured/target ok|MISS`` for a ``[measured, target]`` pair (no target: the value);
    unscored, ``measured/target n/a``."""
    value, target = pair
    if value is None:
        return "n/a" if target is not None else "-"
    if target is None:
        return formatter(value)
    verdict = ("ok" if value <= target else "MISS") if scored else "n/a"
    return f"{formatter(value)}/{formatter(target)} {verdict}"


def targets_table(cases, scored=True):
    """The attention cases' targets (``attention.targets``), one row per case; ``scored``: whether
    the run is one the targets apply to (``attention.targets_apply``), else no verdicts."""
    columns = [("fwd us", "forward_us", "{:.0f}".format), ("f+b us", "forward_backward_us", "{:.0f}".format),
               ("fwd/bound", "forward_vs_bound", "{:.2f}".format),
               ("f+b/fwd", "forward_backward_vs_forward", "{:.2f}".format),
               ("det/default", "deterministic_vs_default", "{:.2f}".format),
               ("f+b peak GB", "forward_backward_peak_bytes", gigabytes),
               ("fwd/uniform", "forward_vs_uniform", "{:.2f}".format),
               ("f+b/uniform", "forward_backward_vs_uniform", "{:.2f}".format)]
    rows = []
    for name, record in cases.items():
        if "targets" not in record:
            continue
        goals = record["targets"]
        rows.append([name] + [target_cell(goals.get(key, [None, None]), formatter, scored) for _, key, formatter in columns])
    if not rows:
        return []
    title = "Attention targets (edgedot's default path; measured/target; det/default: forward+backward)"
    if not scored:
        title += (f"; not scored: the targets are for the full-size cases on an NVIDIA {TARGET_DEVICE}, "
                  "this run is not one")
    return ["", title] + table_lines(["case"] + [title for title, _, _ in columns], rows, 20)


def note_lines(cases):
    notes = []
    for name, record in cases.items():
        for section in SECTIONS:
            for path, result in record.get(section, {}).items():
                if result["status"] == "FAIL":
                    notes.append(f"{name} / {section} / {path}: FAIL, relative error {result['rel_err']:.3g}")
                elif result["status"] != "ok":
                    message = result.get("message", "")
                    notes.append(f"{name} / {section} / {path}: {result['status']} {message}")
                elif result.get("inaccurate"):
                    notes.append(f"{name} / {section} / {path}: timed (*) although its relative error "
                                 f"{result['rel_err']:.3g} exceeds the tolerance")
        budget = record.get("targets", {}).get("memory_budget_bytes")
        if budget:
            sections = record.get(ATTN_FORWARD_BACKWARD, {})
            verdicts = [f"{path} {fit_word(sections[path], fit)}" for path, fit in
                        record["targets"]["fits_budget"].items()]
            notes.append(f"{name}: forward+backward in {budget / 1e9:.0f} GB of extra memory: " + ", ".join(verdicts))
    return ["", "Notes:"] + ["  " + note for note in notes] if notes else []


def fit_word(result, fit):
    """``yes (x GB)``, ``no (x GB)`` or the status of a path against a memory budget."""
    if isinstance(fit, bool):
        return f"{'yes' if fit else 'no'} ({result['peak_extra_bytes'] / 1e9:.1f} GB)"
    return "peak unknown" if fit is None else fit


def bandwidth_lines(report):
    """The header's copy (DRAM) and L2 bandwidth lines."""
    copy_bw, l2 = report["copy_bandwidth_bytes_per_s"], report["l2_bandwidth_bytes_per_s"]

    def rate(value):
        return f"{value / 1e9:.0f} GB/s" if value else "n/a"

    return ["copy bandwidth (dst.copy_(src), read + write): " + rate(copy_bw),
            f"L2 bandwidth ({report['l2_probe_bytes'] / 2**20:.0f} MiB hot buffers, {CALLS_PER_GRAPH} ops per "
            f"CUDA graph): copy (read + write) {rate(l2['copy'])}, read (torch.sum) {rate(l2['read'])}"]


def report_lines(report):
    lines = [f"edgedot benchmark: {report['device']}, torch {report['torch']}, {report['date']}"]
    lines += bandwidth_lines(report)
    lines += [
        f"L2 cache assumed: {report['cache_bytes'] / 2**20:.0f} MiB; times: median per call; "
        "cusparse: sampled_addmm call only (mask built beforehand), on E_unique edges; "
        "graph replay: cold rotates through the input sets, hot calls input set 0 only",
        "",
    ]
    lines += case_table(report["cases"])
    lines += attention_case_table(report["cases"])
    for title, parts, metrics in TABLES:
        lines += section_tables(report["cases"], title, parts, metrics)
    lines += targets_table(report["cases"], targets_apply(report["device"], report["quick"]))
    lines += note_lines(report["cases"])
    lines += ["", f"kernel load {report['kernel_load_seconds']:.1f} s (not counted); "
                  f"benchmark {report['total_seconds']:.0f} s"]
    return lines


def write_json(report, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def save_chart(report, path):
    """Grouped bars of the median time per case, log scale, one panel per table with times."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    panels = [(title, rows) for title, parts, _ in TABLES
              if (rows := table_rows(report["cases"], parts))
              and any(r["status"] == "ok" for _, results in rows for r in results.values())]
    if not panels:
        print("no timed path: no chart")
        return
    widest = max(len(rows) for _, rows in panels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.3 * widest), 4.5 * len(panels)), squeeze=False)
    for axis, (title, rows) in zip(axes[:, 0], panels):
        path_names = list(dict.fromkeys(p for _, results in rows for p in results))
        width = 0.8 / len(path_names)
        for k, path_name in enumerate(path_names):
            offset = (k - (len(path_names) - 1) / 2) * width
            bars = [(i + offset, results[path_name]["median_us"]) for i, (_, results) in enumerate(rows)
                    if results.get(path_name, {}).get("status") == "ok"]
            if bars:
                axis.bar(*zip(*bars), width=width, label=path_name)
        axis.set_yscale("log")
        axis.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=30, ha="right")
        axis.set_ylabel("median time per call (us)")
        axis.set_title(f"{title} ({report['device']})")
        axis.legend(fontsize="small")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")
