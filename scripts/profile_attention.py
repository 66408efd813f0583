"""Where graph attention's time goes, on a CUDA machine: the evidence behind docs/performance.md's
notes on power-law graphs and mini-batches.

    python scripts/profile_attention.py calls CASE     per-call medians of variants of one case
                                                       (CUDA events) and a profiler table of one call
    ncu --profile-from-start off --clock-control none --metrics ... \\
        python scripts/profile_attention.py kernels CASE
                                                       one forward and one forward+backward between
                                                       cudaProfilerStart/Stop, for Nsight Compute

CASE names an attention case of ``python -m edgedot.bench`` (e.g. attn_minibatch_f32,
attn_rmat20_bf16, attn_uniform20_bf16); ``kernels`` also takes its GAT cases (e.g.
gatv2_products_bf16), run through ``gat_attention`` / ``gatv2_attention`` on the edges as given.
"""

import argparse
import statistics

import torch

import edgedot
from edgedot.bench.attention import ATTENTION_CASES, make_attention_set
from edgedot.bench.attention_check import unfused_attention
from edgedot.bench.gat import GAT_CASES, GATCase, op_att, op_inputs


def case_named(name):
    for case in ATTENTION_CASES + GAT_CASES:
        if case.name == name:
            return case
    names = ", ".join(c.name for c in ATTENTION_CASES + GAT_CASES)
    raise SystemExit(f"no attention or GAT case {name!r}; cases: {names}")


def median_us(call, reps=300, warmup=30):
    """Median of CUDA-event times of ``call()``, after warm-up."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def variants(case, s):
    """name -> function of (backward) running one call as the benchmark does (new index tensors each
    call for a fresh-graph case)."""
    scale = case.dim ** -0.5
    compiled = torch.compile(unfused_attention, dynamic=False)

    def graph():
        if not case.fresh_graph:
            return s.src_idx, s.dst_idx, s.dst_ptr
        edge_index = s.edge_index.clone()
        return edge_index[0], edge_index[1], s.dst_ptr.clone()

    def edgedot_call(options, backward):
        src, dst, ptr = graph()
        extra = {"dst_ptr": ptr} if options.get("grouped") else {}
        opts = {k: v for k, v in options.items() if k != "grouped"}
        out = edgedot.graph_attention(s.q, s.k, s.v, src, dst, **extra, **opts)
        if backward:
            out.backward(s.grad_out)

    def compile_path(backward):
        src, dst, _ = graph()
        out = compiled(s.q, s.k, s.v, src, dst, scale)
        if backward:
            out.backward(s.grad_out)

    def graph_only(backward):
        graph()

    return {
        "index copies only": graph_only,
        "edgedot": lambda b: edgedot_call({}, b),
        "edgedot check_indices=False": lambda b: edgedot_call({"check_indices": False}, b),
        "edgedot dst_ptr": lambda b: edgedot_call({"grouped": True}, b),
        "edgedot dst_ptr check_indices=False": lambda b: edgedot_call({"grouped": True, "check_indices": False}, b),
        "compile": compile_path,
    }


def calls(case):
    s = make_attention_set(case, torch.device("cuda"), 0)
    s.requires_grad_()
    paths = variants(case, s)
    print(f"{case.name}: {case.num_nodes} nodes, {case.num_edges} edges, {case.dtype}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'variant':40s} {'fwd us':>9s} {'fwd+bwd us':>11s}")
    for name, run in paths.items():
        s.clear_grads()
        fwd = median_us(lambda: run(False))
        both = median_us(lambda: run(True))
        print(f"{name:40s} {fwd:9.1f} {both:11.1f}", flush=True)
    for name in ("edgedot dst_ptr", "edgedot dst_ptr check_indices=False"):
        run = paths[name]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run(False)
            torch.cuda.synchronize()
        print(f"\nprofile of 20 forward calls, {name}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def gat_call(case, s):
    """A function of (backward) running the case's GAT op on input set ``s`` (the bench's op path)."""
    att = op_att(case, s.q.device).requires_grad_()
    op = edgedot.gat_attention if case.conv == "gat" else edgedot.gatv2_attention

    def run(backward):
        out = op(*op_inputs(case, s, att), s.src_idx, s.dst_idx, negative_slope=0.2)
        if backward:
            out.backward(s.grad_out)
    return run


def kernels(case):
    s = make_attention_set(case, torch.device("cuda"), 0)
    s.requires_grad_()
    run = gat_call(case, s) if isinstance(case, GATCase) else variants(case, s)["edgedot"]
    for _ in range(3):
        run(True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run(False)
    run(True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("calls", "kernels"))
    parser.add_argument("case")
    args = parser.parse_args()
    case = case_named(args.case)
    if args.mode == "calls" and isinstance(case, GATCase):
        raise SystemExit("calls takes the attention cases; kernels takes the GAT cases too")
    (calls if args.mode == "calls" else kernels)(case)


if __name__ == "__main__":
    main()
