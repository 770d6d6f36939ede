#!/usr/bin/python3
"""The table benchmarks/compare_pytorch.sh prints: ours vs Python PyTorch.

    compare_report.py --cpp-bench CPP.json --py-bench PY.json \\
        --ddp NAME DIR [--ddp NAME DIR ...] --warmup W [--header TEXT]

CPP.json: //benchmarks:transforms_bench --benchmark_out (JSON, with
repetitions: the "median" aggregates are used). PY.json:
functorch_reference_bench.py --json. DIR holds ours.<round>.jsonl (the
trainer's --log-json) and py.<round>.jsonl (ddp_step.py --log-json) for
each round; the first W steps of every run are skipped and the rest pooled.
Prints a Markdown table; ratio = ours / PyTorch (below 1: ours is faster).
"""

import argparse
import glob
import json
import math
import os
import statistics
import sys

# Google Benchmark case -> functorch_reference_bench.py case, description.
PER_SAMPLE = [
    ("BM_PerSampleGrad_VmapGrad", "PerSampleGrad_VmapGrad",
     "per-sample grads, vmap(grad(loss))"),
    ("BM_PerSampleGrad_Loop", "PerSampleGrad_Loop",
     "per-sample grads, per-example autograd loop"),
]
UNIT_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def read_cpp_bench(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = {}
    for b in data["benchmarks"]:
        # With repetitions: take the median aggregate; without: the run.
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        if b.get("run_type") == "iteration" and name in out:
            continue
        scale = UNIT_SCALE[b.get("time_unit", "ns")]
        out[name] = {"cpu_s": b["cpu_time"] * scale, "wall_s": b["real_time"] * scale}
    return out


def read_steps(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt_ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpp-bench")
    p.add_argument("--py-bench")
    p.add_argument("--ddp", nargs=2, action="append", default=[], metavar=("NAME", "DIR"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--header", action="append", default=[])
    args = p.parse_args()

    rows, notes = [], []
    if args.cpp_bench and args.py_bench:
        cpp = read_cpp_bench(args.cpp_bench)
        with open(args.py_bench, encoding="utf-8") as f:
            py = json.load(f)["cases"]
        for cpp_name, py_name, what in PER_SAMPLE:
            if cpp_name not in cpp or py_name not in py:
                sys.exit(f"compare_report: missing {cpp_name} or {py_name} in the results")
            for kind, key in (("CPU", "cpu_s"), ("wall", "wall_s")):
                ours, theirs = cpp[cpp_name][key], py[py_name][key]
                rows.append((f"{what} ({kind}, median of reps)", fmt_ms(ours),
                             fmt_ms(theirs), f"{ours / theirs:.2f}"))

    for name, directory in args.ddp:
        ours_runs = sorted(glob.glob(os.path.join(directory, "ours.*.jsonl")))
        py_runs = sorted(glob.glob(os.path.join(directory, "py.*.jsonl")))
        if not ours_runs or len(ours_runs) != len(py_runs):
            sys.exit(f"compare_report: {directory}: expected as many ours.*.jsonl as py.*.jsonl")
        ours_t, py_t, loss_diff, per_round = [], [], 0.0, []
        for o_path, p_path in zip(ours_runs, py_runs):
            o, q = read_steps(o_path), read_steps(p_path)
            if len(o) != len(q) or len(o) <= args.warmup:
                sys.exit(f"compare_report: {o_path} has {len(o)} steps, {p_path} {len(q)}; "
                         f"expected the same number, more than --warmup {args.warmup}")
            ot = [r["step_time_s"] for r in o[args.warmup:]]
            qt = [r["step_time_s"] for r in q[args.warmup:]]
            ours_t += ot
            py_t += qt
            per_round.append(statistics.median(ot) / statistics.median(qt))
            for a, b in zip(o, q):
                if a["loss"] is None or b["loss"] is None:
                    loss_diff = math.inf
                else:
                    loss_diff = max(loss_diff, abs(a["loss"] - b["loss"]))
        ours, theirs = statistics.median(ours_t), statistics.median(py_t)
        rows.append((f"{name} (median step time)", fmt_ms(ours), fmt_ms(theirs),
                     f"{ours / theirs:.2f}"))
        notes.append(f"{name}: {len(ours_runs)} round(s) x {len(ours_t) // len(ours_runs)} "
                     f"timed steps per side (first {args.warmup} skipped); per-round ratios "
                     + ", ".join(f"{r:.2f}" for r in per_round)
                     + f"; largest |loss(ours) - loss(PyTorch)| over all steps: {loss_diff:.2g}")

    for line in args.header:
        print(line)
    if args.header:
        print()
    print("| case | ours | PyTorch | ratio ours/PyTorch |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if notes:
        print()
        for n in notes:
            print(f"- {n}")


if __name__ == "__main__":
    main()
