"""Host costs of one path's step split into forward and backward, and every operator per step."""
import statistics, sys, time
import torch
sys.argv, paths_arg = sys.argv[:1] + ["--dtype", sys.argv[1]], sys.argv[2]
import argparse
from profile_minibatch import make_paths

args = argparse.Namespace(dtype=sys.argv[2], fanout=10, seeds=16384)
paths = make_paths(args)
for name in paths_arg.split(","):
    call = paths[name]
    for s in range(10):
        call(s, True)
    torch.cuda.synchronize()
    # forward alone / forward+backward, host time with the device busy
    res = {}
    for label, bw in (("fwd", False), ("f+b", True)):
        times = []
        for s in range(60):
            torch.cuda._sleep(20_000_000)
            t = time.perf_counter(); call(s, bw); times.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        res[label] = 1e6 * statistics.median(times)
    # the same with the device idle (the steady state the step timer sees)
    for label, bw in (("fwd idle", False), ("f+b idle", True)):
        times = []
        for s in range(60):
            torch.cuda.synchronize()
            t = time.perf_counter(); call(s, bw); times.append(time.perf_counter() - t)
        res[label] = 1e6 * statistics.median(times)
    print(f"== {name} {args.dtype}: host us " + ", ".join(f"{k} {v:.0f}" for k, v in res.items()), flush=True)
    calls = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(calls):
            call(s, True)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda a: -a.count)
    n_ops = sum(a.count for a in rows if a.key.startswith("aten::")) / calls
    print(f"   aten ops a step: {n_ops:.0f}; all events by count (per step: count, self CPU us profiled)")
    for a in rows[:70]:
        if a.count / calls >= 0.9:
            print(f"   {a.count / calls:5.1f}  {a.self_cpu_time_total / calls:8.1f}  {a.key[:110]}")
