"""edgedot.bench: the command-line smoke run (CPU-sized ``--quick``) and the attention check."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from edgedot.bench import attention, attention_check
from edgedot.bench.__main__ import select_cases
from edgedot.bench.cases import (ATTN_FORWARD, ATTN_FORWARD_BACKWARD, FORWARD, FORWARD_BACKWARD, GRAPH_REPLAY,
                                 GRAPH_REPLAY_HOT)
from edgedot.bench.timing import relative_error

REPO = Path(__file__).resolve().parent.parent
ATTENTION_PATHS = ["edgedot", "edgedot_det", "edgedot_plan", "edgedot_grouped", "edgedot_grouped_unchecked",
                   "edgedot_layer", "pyg", "compile", "turbo"]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """``python -m edgedot.bench --quick`` on an edge_dot case with graph replay and an attention case."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "edgedot.bench", "--quick", "--reps-scale", "0.1",
            "--cases", "default,attn_arxiv_bf16,edge_attn_arxiv_f16", "--json", str(out / "bench.json"), "--png", str(out / "bench.png")]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads((out / "bench.json").read_text()), proc.stdout


def test_quick_run_report(quick_report):
    report, stdout = quick_report
    for key in ("device", "torch", "settings", "tolerance", "copy_bandwidth_bytes_per_s", "l2_bandwidth_bytes_per_s",
                "l2_probe_bytes", "cases"):
        assert key in report, key
    assert set(report["l2_bandwidth_bytes_per_s"]) == {"copy", "read"}
    assert list(report["cases"]) == ["default", "attn_arxiv_bf16", "edge_attn_arxiv_f16"]
    for title in ("Forward: median time per call", "Forward + backward: median time per call",
                  "Kernel time alone: calls captured in a CUDA graph: median time per call",
                  "Attention forward: median time per call", "Attention forward + backward: median time per call",
                  "Attention targets", "L2 bandwidth"):
        assert title in stdout, title
    assert "default cold" in stdout and "default hot" in stdout
    # A CPU / --quick run is not what the H200 targets were set for: shown, never scored.
    targets = stdout[stdout.index("Attention targets"):]
    assert "not scored" in targets and "MISS" not in targets and " ok" not in targets


def test_targets_scored_only_on_their_card_at_full_size():
    from edgedot.bench.report import targets_table
    assert attention.targets_apply("NVIDIA H200", quick=False)
    for device, quick in (("cpu", False), ("NVIDIA H200", True), ("NVIDIA A100-SXM4-80GB", False)):
        assert not attention.targets_apply(device, quick), (device, quick)
    cases = {"attn": {"targets": {"forward_us": [500.0, 450], "forward_backward_us": [1200.0, 1300],
                                  "forward_vs_bound": [None, 1.5], "forward_backward_vs_forward": [2.4, 3.0],
                                  "deterministic_vs_default": [1.0, 1.2],
                                  "forward_backward_peak_bytes": [None, None]}}}
    scored, unscored = "\n".join(targets_table(cases, True)), "\n".join(targets_table(cases, False))
    assert "500/450 MISS" in scored and "1200/1300 ok" in scored and "not scored" not in scored
    assert "500/450 n/a" in unscored and "MISS" not in unscored and "not scored" in unscored


def test_quick_run_edge_dot(quick_report):
    record = quick_report[0]["cases"]["default"]
    assert record["kind"] == "edge_dot"
    for section, paths in ((FORWARD, ["eager", "compile", "edgedot", "edgedot_fresh", "edgedot_nocheck"]),
                           (FORWARD_BACKWARD, ["eager", "compile", "edgedot", "edgedot_det", "edgedot_plan"])):
        for path in paths:
            result = record[section][path]
            assert result["status"] == "ok", (section, path, result)
            assert result["rel_err"] <= quick_report[0]["tolerance"]["float32"]
            assert result["median_us"] > 0 and len(result["times_us"]) == result["reps"]
    for section in (GRAPH_REPLAY, GRAPH_REPLAY_HOT):
        expected = "ok" if torch.cuda.is_available() else "n/a"
        assert {p: r["status"] for p, r in record[section].items()} == dict.fromkeys(["eager", "compile", "edgedot"],
                                                                                     expected)
    assert "l2_fraction" in record[GRAPH_REPLAY_HOT]["edgedot"] or not torch.cuda.is_available()


def test_quick_run_attention_baselines(quick_report):
    record = quick_report[0]["cases"]["attn_arxiv_bf16"]
    assert record["kind"] == "attention"
    assert record["config"]["num_edges"] <= 2 * 4096 and record["check"]["edges"] == record["config"]["num_edges"]
    for key in ("bytes", "bound_us", "targets", ATTN_FORWARD, ATTN_FORWARD_BACKWARD):
        assert key in record, key
    for section in (ATTN_FORWARD, ATTN_FORWARD_BACKWARD):
        assert list(record[section]) == ATTENTION_PATHS
        assert record[section]["compile"]["status"] == "ok", record[section]["compile"]
        for baseline in ("pyg", "turbo"):
            result = record[section][baseline]
            assert result["status"] in ("ok", "n/a"), result
    for key in ("forward_us", "forward_backward_us", "forward_vs_bound", "forward_backward_vs_forward",
                "deterministic_vs_default", "forward_backward_peak_bytes"):
        assert len(record["targets"][key]) == 2


def test_quick_run_attention_edgedot(quick_report):
    record = quick_report[0]["cases"]["attn_arxiv_bf16"]
    for section in (ATTN_FORWARD, ATTN_FORWARD_BACKWARD):
        for path in ("edgedot", "edgedot_det", "edgedot_plan", "edgedot_grouped", "edgedot_grouped_unchecked",
                     "edgedot_layer"):
            result = record[section][path]
            assert result["status"] == "ok", (section, path, result)
            assert result["rel_err"] <= quick_report[0]["tolerance"]["bfloat16"]
    assert record[ATTN_FORWARD_BACKWARD]["edgedot"]["vs_forward"] > 0


def test_case_selection():
    names = [case.name for case in select_cases(None, quick=False)]
    minibatches = ["minibatch_f32", "minibatch_fan5_f32", "minibatch_fan25_f32", "minibatch_bf16"]
    gat_names = [f"{conv}_{graph}" for conv in ("gat", "gatv2")
                 for graph in ["products_bf16", "rmat20_bf16", "uniform20_bf16"] + minibatches + ["20k_f32"]]
    assert names[0] == "default" and names[-32:] == ["attn_arxiv_f32", "attn_arxiv_bf16", "attn_products_bf16",
                                                     "attn_reddit_bf16", "attn_rmat20_bf16", "attn_uniform20_bf16",
                                                     "attn_arxiv_hub_bf16", "attn_arxiv_3m_bf16"] + \
        [f"attn_{name}" for name in minibatches] + ["attn_20k_f32"] + gat_names + ["gatv2_ogbn_products_bf16"] + \
        ["edge_attn_arxiv_f16", "edge_attn_products_f16"]
    (reddit,) = select_cases("attn_reddit_bf16", quick=True)
    assert reddit.num_edges <= 2 * 4096 and reddit.num_edges // reddit.num_nodes > 400  # in-degree kept
    with pytest.raises(SystemExit, match="unknown case"):
        select_cases("default,nope", quick=True)


@pytest.mark.parametrize("sampled", [False, True])
def test_attention_check_is_exact(monkeypatch, sampled):
    """The float64 check on a sample of destination nodes checks whole gradients: the unfused
    float32 math passes it, and fails it with a grad_out that is not zero outside the sample."""
    if sampled:
        monkeypatch.setattr(attention_check, "REFERENCE_EDGES", 300)
    (reddit,) = [case for case in attention.ATTENTION_CASES if case.name == "attn_reddit_bf16"]
    case = attention.shrunk_attention(reddit)  # Reddit-like in-degree
    inputs = attention.make_attention_set(case, torch.device("cpu"), seed=0)
    inputs.requires_grad_()
    check = attention_check.expected_attention(case, inputs, attention.layer_weights(case, torch.device("cpu")),
                                               with_grads=True)
    assert (check.num_edges < case.num_edges) == sampled

    def errors(grad_out):
        args = [t.detach().float().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
        out = attention_check.unfused_attention(*args, inputs.src_idx, inputs.dst_idx, case.dim ** -0.5)
        out.backward(grad_out.float())
        return [relative_error(out[check.rows], check.out)] + \
            [attention_check.rows_error(arg.grad, *check.grads[name]) for name, arg in zip("qkv", args)]

    assert max(errors(check.grad_out)) < 1e-5
    if sampled:
        assert min(errors(inputs.grad_out)[1:]) > 0.1


def test_power_law_cases():
    """The power-law cases make the graphs they name, and their ratio to the uniform twin is
    computed from the edgedot paths of both."""
    from edgedot.bench.attention import ATTENTION_CASES, add_power_law_ratios, case_edges, shrunk_attention
    cases = {case.name: shrunk_attention(case) for case in ATTENTION_CASES}
    g = torch.Generator().manual_seed(0)
    src, dst = case_edges(cases["attn_arxiv_hub_bf16"], g)
    assert torch.bincount(dst).max() >= cases["attn_arxiv_hub_bf16"].hub_edges
    minibatch = cases["attn_minibatch_f32"]
    src, dst = case_edges(minibatch, g)
    assert torch.equal(torch.bincount(dst), torch.full((minibatch.seeds,), minibatch.num_edges // minibatch.seeds))
    rmat = cases["attn_rmat20_bf16"]
    src, dst = case_edges(rmat, g)
    assert src.max() < rmat.num_nodes and torch.bincount(dst).max() > 4 * rmat.num_edges / rmat.num_nodes
    records = {"a": {"kind": "attention", "config": {"twin": "b"}, ATTN_FORWARD: {"edgedot": {"status": "ok",
                     "median_us": 13.0}}, "targets": {}},
               "b": {"kind": "attention", "config": {}, ATTN_FORWARD: {"edgedot": {"status": "ok", "median_us": 10.0}}}}
    add_power_law_ratios(records)
    assert records["a"]["targets"]["forward_vs_uniform"] == [1.3, 1.3]
    assert records["a"]["targets"]["forward_backward_vs_uniform"] == [None, 1.3]


@pytest.mark.parametrize("conv", ["gat", "gatv2"])
def test_gat_paths_pass_their_check(conv):
    """Every GAT benchmark path that can run here (not compile: slow to build on a CPU) passes
    its float64 check, forward and forward+backward, on a shrunk power-law case."""
    from edgedot.bench import gat
    from edgedot.bench.attention import make_attention_set
    from edgedot.bench.cases import TOLERANCE

    pytest.importorskip("torch_geometric")
    case = replace(gat.shrunk_gat(next(c for c in gat.GAT_CASES if c.conv == conv and c.graph == "rmat")),
                   num_edges=600, num_nodes=64, dtype=torch.float32)
    sets = [make_attention_set(case, torch.device("cpu"), seed) for seed in range(2)]
    weights, att = gat.gat_weights(case, "cpu"), gat.op_att(case, "cpu")
    for backward in (False, True):
        if backward:
            for s in sets:
                s.requires_grad_()
            att.requires_grad_()
        check = gat.expected_gat(case, sets[0], weights, att, backward)
        paths = gat.gat_paths(case, sets, check, None, weights, att, backward)
        for name in ("edgedot", "edgedot_layer", "edgedot_sorted", "pyg"):
            path = paths[name]()
            path.reset(0)
            error = path.check() if path.check is not None else path.error_of(path.call(0))
            assert error <= TOLERANCE[case.dtype], (name, backward, error)


def test_bytes_bounds():
    """The least bytes of GATv2 at products size: about 9 GB forward and 23 GB backward (each
    edge's rows and indices in each pass and its record written and read, each node's rows once a
    pass; 28 GB when the source pass gathers x_dst again instead of the record); graph attention's
    backward moves two passes of its forward's edge bytes and eight node rows."""
    from edgedot.bench.attention import ATTENTION_CASES, forward_backward_bytes as attention_bytes
    from edgedot.bench.attention import gather_bytes as attention_forward
    from edgedot.bench.gat import GAT_CASES, forward_backward_bytes, gather_bytes
    gatv2 = next(case for case in GAT_CASES if case.name == "gatv2_products_bf16")
    assert 9.0e9 < gather_bytes(gatv2) < 9.6e9
    assert 22.5e9 < forward_backward_bytes(gatv2) - gather_bytes(gatv2) < 23.5e9
    record = gatv2.heads * (8 + gatv2.dim // 8)
    row = gatv2.heads * gatv2.dim * gatv2.dtype.itemsize
    assert forward_backward_bytes(gatv2) - gather_bytes(gatv2) + gatv2.num_edges * (row - 2 * record) == \
        pytest.approx(27.7e9, rel=0.01)
    gat = next(case for case in GAT_CASES if case.name == "gat_products_bf16")
    assert forward_backward_bytes(gat) < forward_backward_bytes(gatv2)
    attn = next(case for case in ATTENTION_CASES if case.name == "attn_products_bf16")
    row = attn.heads * attn.dim * attn.dtype.itemsize
    edge_pass = attn.num_edges * (2 * row + 2 * attn.index_dtype.itemsize)
    assert attention_bytes(attn) - attention_forward(attn) == 2 * edge_pass + attn.num_nodes * 8 * row


def test_quick_run_edge_attention(quick_report):
    """Attention with edge features: edgedot's paths and compile's checked and timed, forward and
    forward + backward; anemoi's Triton kernel is CUDA only (n/a here, with its reason)."""
    report, stdout = quick_report
    record = report["cases"]["edge_attn_arxiv_f16"]
    assert record["kind"] == "edge_attention" and record["bytes"]["edge_attention_forward_backward"] > \
        record["bytes"]["edge_attention_forward"]
    for section in ("edge_attention_forward", "edge_attention_forward_backward"):
        for path in ("edgedot", "edgedot_default", "compile"):
            result = record[section][path]
            assert result["status"] == "ok", (section, path, result)
            assert result["rel_err"] <= report["tolerance"]["float16"]
        if not report["device"].startswith("cpu"):
            continue
        assert record[section]["anemoi"]["status"] == "n/a"
    assert "Attention with edge features, forward + backward" in stdout


def test_rounds_take_every_path_in_turn():
    """With rounds, a section checks and warms up every path first, then times them in turns, each
    for its share of the reps; a path that misses its check, a broken and an inapplicable one get
    their status and stop no other."""
    from edgedot.bench.timing import QUICK, BenchPath, HostClock, NotApplicable, run_section

    calls = []

    def maker(name, error=0.0):
        def call(i):
            calls.append(name)
            return torch.zeros(1)
        return lambda: BenchPath(call, lambda out: error)

    def broken():
        raise RuntimeError("no such kernel")

    def absent():
        raise NotApplicable("not installed")

    makers = {"a": maker("a"), "wrong": maker("wrong", error=1.0), "b": maker("b"), "broken": broken,
              "absent": absent}
    settings = replace(QUICK, min_reps=8, max_reps=8)
    results = run_section("section", makers, 1000, None, baselines=("a",), rounds=4, tolerance=1e-3, num_sets=1,
                          clock=HostClock(), settings=settings)
    assert [results[n]["status"] for n in ("wrong", "broken", "absent")] == ["FAIL", "ERR", "n/a"]
    for name in ("a", "b"):
        assert results[name]["status"] == "ok" and results[name]["reps"] == 8 and len(results[name]["times_us"]) == 8
    assert results["a"]["vs_a"] == 1.0 and results["b"]["vs_a"] > 0
    assert calls[-16:] == (["a"] * 2 + ["b"] * 2) * 4
    assert "wrong" not in calls[calls.index("b"):]  # the failed path is never timed
