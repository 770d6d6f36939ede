"""The table benchmarks/compare_pytorch.sh prints: ours vs Python PyTorch.

    compare_report.py --cpp-bench CPP.json --cpp-hessian CPP_H.json \\
        --py LABEL PY.json PY_H.json [--py LABEL ...] \\
        --ddp NAME DIR [--ddp NAME DIR ...] --warmup W [--header TEXT]

CPP.json / CPP_H.json: //benchmarks:transforms_bench / hessian_bench
--benchmark_out (JSON, with repetitions: the "median" aggregates are used).
PY.json: functorch_reference_bench.py --json; PY_H.json: hessian_bench.py
--json, one pair per Python variant LABEL. DIR holds ours.<round>.jsonl (the
trainer's --log-json) and py-LABEL.<round>.jsonl (ddp_step.py --log-json) for
each round and label; the first W steps of every run are skipped and the rest
pooled. Prints a Markdown table with one column and one ratio per Python
variant; ratio = ours / PyTorch (below 1: ours is faster).
"""

import argparse
import json
import math
import os
import statistics
import sys

# (ours in transforms_bench / hessian_bench, Python case, description).
PER_SAMPLE = [
    ("BM_PerSampleGrad_VmapGrad", "PerSampleGrad_VmapGrad",
     "per-sample grads, vmap(grad(loss))"),
    ("BM_PerSampleGrad_Loop", "PerSampleGrad_Loop",
     "per-sample grads, per-example autograd loop"),
]
HESSIAN = [
    ("BM_Hessian_VmapJacfwdJacrev", "Hessian_VmapJacfwdJacrev",
     "batched Hessians, vmap(jacfwd(jacrev(u)))"),
    ("BM_Hessian_VmapHessian", "Hessian_VmapHessian", "batched Hessians, vmap(hessian(u))"),
    ("BM_Hessian_PerPointLoop", "Hessian_PerPointLoop", "batched Hessians, per-point loop"),
]
UNIT_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def read_cpp_bench(path):
    """Wall seconds per call of every case (the median aggregate if any)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        for suffix in ("/real_time",):
            name = name[: -len(suffix)] if name.endswith(suffix) else name
        if b.get("run_type") == "iteration" and name in out:
            continue
        out[name] = b["real_time"] * UNIT_SCALE[b.get("time_unit", "ns")]
    return out


def read_py_cases(path):
    with open(path, encoding="utf-8") as f:
        return {name: case["wall_s"] for name, case in json.load(f)["cases"].items()}


def read_steps(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt_ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def step_times(path, warmup):
    steps = read_steps(path)
    if len(steps) <= warmup:
        sys.exit(f"compare_report: {path} has {len(steps)} steps, not more than --warmup {warmup}")
    return steps, [r["step_time_s"] for r in steps[warmup:]]


def max_loss_diff(a_steps, b_steps):
    diff = 0.0
    for a, b in zip(a_steps, b_steps):
        if a["loss"] is None or b["loss"] is None:
            return math.inf
        diff = max(diff, abs(a["loss"] - b["loss"]))
    return diff


def main():
    p = argparse.ArgumentParser()
    # Without --cpp-bench/--cpp-hessian/--py (compare_pytorch.sh --cases
    # without functorch) only the --ddp rows are made, for the label "same".
    p.add_argument("--cpp-bench")
    p.add_argument("--cpp-hessian")
    p.add_argument("--py", nargs=3, action="append", default=[],
                   metavar=("LABEL", "PY_BENCH", "PY_HESSIAN"))
    p.add_argument("--ddp", nargs=2, action="append", default=[], metavar=("NAME", "DIR"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--header", action="append", default=[])
    args = p.parse_args()
    functorch_cases = bool(args.py or args.cpp_bench or args.cpp_hessian)
    if functorch_cases and not (args.py and args.cpp_bench and args.cpp_hessian):
        sys.exit("compare_report: the functorch rows need --cpp-bench, --cpp-hessian and at least "
                 "one --py LABEL PY_BENCH PY_HESSIAN")
    if not functorch_cases and not args.ddp:
        sys.exit("compare_report: nothing to report (no --py and no --ddp)")
    labels = [label for label, _, _ in args.py] or ["same"]

    rows, notes = [], []

    if functorch_cases:
        functorch_rows(args, labels, rows, notes)
    ddp_rows(args, labels, rows, notes)
    print_report(args, labels, rows, notes)


def add_row(rows, labels, what, ours, theirs_by_label):
    row = [what, fmt_ms(ours)]
    for label in labels:
        theirs = theirs_by_label[label]
        row += [fmt_ms(theirs), f"{ours / theirs:.2f}"]
    rows.append(row)


def functorch_rows(args, labels, rows, notes):
    cpp = read_cpp_bench(args.cpp_bench)
    cpp.update(read_cpp_bench(args.cpp_hessian))
    py = {}
    for label, bench, hessian in args.py:
        py[label] = read_py_cases(bench)
        py[label].update(read_py_cases(hessian))
    for cpp_name, py_name, what in PER_SAMPLE + HESSIAN:
        missing = [cpp_name] if cpp_name not in cpp else []
        missing += [f"{py_name} ({label})" for label in labels if py_name not in py[label]]
        if missing:
            sys.exit(f"compare_report: missing {', '.join(missing)} in the results")
        add_row(rows, labels, f"{what} (wall, median of reps)", cpp[cpp_name],
                {label: py[label][py_name] for label in labels})

    for (batched, loop, what) in (("PerSampleGrad_VmapGrad", "PerSampleGrad_Loop",
                                   "vmap(grad) vs the per-example loop"),
                                  ("Hessian_VmapJacfwdJacrev", "Hessian_PerPointLoop",
                                   "vmap(jacfwd(jacrev)) vs the per-point loop")):
        parts = [f"ours {cpp['BM_' + loop] / cpp['BM_' + batched]:.1f}x"]
        parts += [f"PyTorch {label} {py[label][loop] / py[label][batched]:.1f}x" for label in labels]
        notes.append(f"{what}: " + ", ".join(parts) + " faster")
    notes.append("per-sample vmap(grad): ours is " + ", ".join(
        f"{py[label]['PerSampleGrad_VmapGrad'] / cpp['BM_PerSampleGrad_VmapGrad']:.1f}x faster "
        f"than PyTorch {label}" for label in labels))


def ddp_rows(args, labels, rows, notes):
    for name, directory in args.ddp:
        ours_t, per_round = [], {label: [] for label in labels}
        theirs_t = {label: [] for label in labels}
        loss_diff = {label: 0.0 for label in labels}
        rounds = 0
        while os.path.exists(os.path.join(directory, f"ours.{rounds + 1}.jsonl")):
            rounds += 1
            o_steps, ot = step_times(os.path.join(directory, f"ours.{rounds}.jsonl"), args.warmup)
            ours_t += ot
            for label in labels:
                path = os.path.join(directory, f"py-{label}.{rounds}.jsonl")
                if not os.path.exists(path):
                    sys.exit(f"compare_report: {path} missing (round {rounds} of ours exists)")
                q_steps, qt = step_times(path, args.warmup)
                if len(q_steps) != len(o_steps):
                    sys.exit(f"compare_report: {path} has {len(q_steps)} steps, ours {len(o_steps)}")
                theirs_t[label] += qt
                per_round[label].append(statistics.median(ot) / statistics.median(qt))
                loss_diff[label] = max(loss_diff[label], max_loss_diff(o_steps, q_steps))
        if rounds == 0:
            sys.exit(f"compare_report: {directory}: no ours.1.jsonl")
        add_row(rows, labels, f"{name} (median step time)", statistics.median(ours_t),
                {label: statistics.median(theirs_t[label]) for label in labels})
        notes.append(
            f"{name}: {rounds} round(s) x {len(ours_t) // rounds} timed steps per side "
            f"(first {args.warmup} skipped); per-round ratios " + "; ".join(
                f"{label} " + ", ".join(f"{r:.2f}" for r in per_round[label]) for label in labels)
            + "; largest |loss(ours) - loss(PyTorch)| over all steps: " + ", ".join(
                f"{label} {loss_diff[label]:.2g}" for label in labels))


def print_report(args, labels, rows, notes):
    for line in args.header:
        print(line)
    if args.header:
        print()
    header = ["case", "ours"]
    for label in labels:
        header += [f"PyTorch ({label})", f"ours/PyTorch ({label})"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
