"""KernelBench's evaluation procedure for one problem file, as its ``eval_kernel_against_ref`` runs it.

The procedure (KernelBench ``src/kernelbench/eval.py``, current version): the problem's ``Model``,
``get_inputs`` and ``get_init_inputs`` and the candidate's ``ModelNew`` are loaded; seeds for the
correctness trials are drawn with ``torch.manual_seed(seed)`` then ``torch.randint(0, 2**32 - 1)``
once per trial; each trial seeds torch, calls ``get_inputs()`` and moves every tensor with
``x.to(dtype=precision).to(device)`` — the index tensors included — runs ``Model`` then
``ModelNew`` and requires ``torch.allclose(out, out_new, atol=tol, rtol=tol)`` with the
precision's tolerance (``TOLERANCES``) and equal shapes; every trial must pass. Then both models
are timed on one more input set with CUDA events (warm-up calls, then each call between two
events, synchronised), and the mean is reported.

One thing this adds: a precision may round an index onto the row count (bfloat16 holds only 8
significant bits, so 1022 and 1023 become 1024, 766 and 767 become 768), where the reference's
own gather fails with a device-side assert and KernelBench's run ends in an error whatever the
candidate does. Such edges are counted as ``undefined_edges``; the reference is then run on the
other edges only, and the candidate's output is compared on those and must be NaN on the
undefined ones (its kernel reads nothing out of range). With no undefined edge, which is every
float32 and float16 trial of the seed problem, the procedure is KernelBench's exactly.

``python -m edgedot.kernelbench --evaluate PATH [--precision fp32|fp16|bf16]`` runs it.
"""

import dataclasses
import importlib.util
import statistics
import sys

import torch

__all__ = ["PRECISIONS", "TOLERANCES", "TrialResult", "Evaluation", "trial_seeds", "cast_inputs",
           "load_problem", "evaluate"]

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# atol = rtol for each precision (KernelBench's get_tolerance_for_precision).
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclasses.dataclass
class TrialResult:
    """One correctness trial: its seed, whether allclose held, the largest difference on the edges
    where the reference is defined, and how many edges it is not defined on."""
    seed: int
    passed: bool
    max_abs_diff: float
    undefined_edges: int


@dataclasses.dataclass
class Evaluation:
    """The outcome of :func:`evaluate`; times are means in microseconds."""
    precision: str
    trials: list
    correct: bool
    model_new_us: float = float("nan")
    model_us: float = float("nan")

    @property
    def speedup(self):
        return self.model_us / self.model_new_us


def trial_seeds(seed, num_trials):
    """The correctness trials' seeds, drawn as the evaluator draws them."""
    torch.manual_seed(seed)
    return [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(num_trials)]


def _set_seed(seed):
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def cast_inputs(inputs, precision, device):
    """Every tensor to ``precision`` and then to ``device``, other values as they are."""
    return [x.to(dtype=precision).to(device) if isinstance(x, torch.Tensor) else x for x in inputs]


def load_problem(path):
    """The problem file at ``path`` as a module (it must define Model, ModelNew, get_inputs and
    get_init_inputs)."""
    spec = importlib.util.spec_from_file_location("kernelbench_problem", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("Model", "ModelNew", "get_inputs", "get_init_inputs"):
        if not callable(getattr(module, name, None)):
            raise ValueError(f"{path} does not define {name}")
    return module


def _defined_edges(inputs):
    """For the seed problem's inputs (src_feat, dst_feat, src_idx, dst_idx): the edges whose
    indices, read as ``.long()`` reads them, lie inside the tables."""
    src_feat, dst_feat, src_idx, dst_idx = inputs
    src, dst = src_idx.long(), dst_idx.long()
    return (src >= 0) & (src < src_feat.shape[0]) & (dst >= 0) & (dst < dst_feat.shape[0])


def _time_us(model, inputs, warmup, reps):
    for _ in range(warmup):
        model(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.mean(times)


def evaluate(problem, precision="fp32", *, seed=42, num_trials=5, warmup=3, reps=100, device="cuda",
             time_models=True):
    """Runs the evaluator's procedure on ``problem`` (a module from :func:`load_problem`).

    Returns an :class:`Evaluation`; ``correct`` is whether every trial passed.
    """
    dtype = PRECISIONS[precision]
    tol = TOLERANCES[dtype]
    with torch.no_grad():
        _set_seed(seed)
        init = cast_inputs(problem.get_init_inputs(), dtype, device)
        _set_seed(seed)
        model = problem.Model(*init).to(device=device, dtype=dtype)
        _set_seed(seed)
        model_new = problem.ModelNew(*init).to(device=device, dtype=dtype)
        trials = []
        for trial_seed in trial_seeds(seed, num_trials):
            _set_seed(trial_seed)
            inputs = cast_inputs(problem.get_inputs(), dtype, device)
            defined = _defined_edges(inputs)
            undefined = int((~defined).sum())
            if undefined:
                src_feat, dst_feat, src_idx, dst_idx = inputs
                expect = model(src_feat, dst_feat, src_idx[defined], dst_idx[defined])
            else:
                expect = model(*inputs)
            got = model_new(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            if got.shape != (defined.shape[0],) + tuple(expect.shape[1:]):
                trials.append(TrialResult(trial_seed, False, float("inf"), undefined))
                continue
            got_defined = got[defined]
            passed = torch.allclose(expect, got_defined, atol=tol, rtol=tol)
            if undefined:
                passed = passed and bool(torch.isnan(got[~defined]).all())
            diff = (expect.double() - got_defined.double()).abs()
            trials.append(TrialResult(trial_seed, bool(passed), diff.max().item() if diff.numel() else 0.0,
                                      undefined))
        result = Evaluation(precision, trials, all(t.passed for t in trials))
        if time_models and result.correct and device == "cuda":
            _set_seed(seed)
            inputs = cast_inputs(problem.get_inputs(), dtype, device)
            defined = _defined_edges(inputs)
            result.model_new_us = _time_us(model_new, inputs, warmup, reps)
            if not bool(defined.all()):  # time the reference on the edges it is defined on
                inputs = [inputs[0], inputs[1], inputs[2][defined], inputs[3][defined]]
            result.model_us = _time_us(model, inputs, warmup, reps)
    return result


def report(result, file=sys.stdout):
    """Prints one evaluation as a few lines."""
    print(f"precision {result.precision}: correct={result.correct} "
          f"({sum(t.passed for t in result.trials)}/{len(result.trials)} trials)", file=file)
    for t in result.trials:
        extra = f", {t.undefined_edges} edges outside the tables after the cast" if t.undefined_edges else ""
        print(f"  seed {t.seed}: {'pass' if t.passed else 'FAIL'}, max |diff| {t.max_abs_diff:.3e}{extra}",
              file=file)
    if result.model_new_us == result.model_new_us:
        print(f"  ModelNew {result.model_new_us:.1f} us, Model {result.model_us:.1f} us per call "
              f"(mean of cuda_event timings): {result.speedup:.2f}x", file=file)
