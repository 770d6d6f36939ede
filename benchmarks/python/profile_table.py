"""Where one training step's time goes, kernel class by kernel class, for
several Chrome traces side by side (issue 47: "a profile, not a guess").

    profile_table.py --trace ours=OURS.json --trace titan=TITAN.json.gz [--json OUT]

A trace is the trainer's --profile-step / --profile-trace file (Kineto,
written by LibTorch) or torch.profiler's export_chrome_trace (TorchTitan's
profile_traces/iteration_N/rankR_trace.json), plain JSON or gzipped (by
content, whatever the name). Python 3 standard library only.

What is counted, per trace:
  - The step. When the trace has "ProfilerStep#N" annotations (torch.profiler's
    prof.step(); the trainer writes one too), the last one is the step: its
    CPU ops are those that start inside it, and its GPU work is what the CPU
    launched inside it (the runtime calls' "correlation" ids; kernels run
    after their launch, often after the annotation ends). Without
    annotations, the whole trace is the step.
  - GPU events: Kineto's categories "kernel", "gpu_memcpy", "gpu_memset"
    (older Kineto: "Kernel", "Memcpy", "Memset"). Each is put in one class by
    its name (CLASSES; first match wins, so flash-attention kernels whose
    template names mention cutlass are attention, not GEMM). "idle" is the
    step's GPU span (first kernel start to last kernel end) minus the union
    of the kernels' intervals; "overlap" is what kernels on several streams
    ran at once (the class times add up to span - idle + overlap); "total" is
    the span.
  - A trace without GPU events (a CPU run) is read as "CPU ops": events of
    category "cpu_op", top-level ones only (not inside another cpu_op of the
    same thread, so aten::linear is not counted again as its aten::addmm),
    autograd's "evaluate_function: MmBackward0" as the op it differentiates.

Prints a table (class | NAME ms | % | ... | first/second), then the ten
longest kernels (or ops) of each trace. Exit status 1, with a message naming
the trace, when a file is missing, not a Chrome trace, or holds no events of
its step. --json OUT writes the same figures for scripts.
"""

import argparse
import gzip
import json
import math
import re
import sys

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver", "runtime", "hip_runtime", "xpu_runtime"}
STEP_PREFIX = "ProfilerStep#"

# (class, pattern on the lower-cased name), in the order they are tried: a
# kernel matches the first. Why this order:
#   communication first: NCCL's kernels say ReduceScatter / AllReduce, which
#     the elementwise "reduce" would take;
#   attention before GEMM: FlashAttention's template arguments spell cutlass;
#   Inductor's triton_ kernels in their own class (a fused RMSNorm is
#     "triton_per_fused_..._rsqrt"), before the op-name classes;
#   optimizer before norm: the gradient clip's multi_tensor_apply LpNorm;
#   loss before elementwise: log_softmax before softmax;
#   copies before elementwise: ATen's copies are elementwise_kernel<direct_copy...>.
CLASSES = [
    ("communication", r"nccl|gloo|all_?gather|reduce_?scatter|all_?reduce|allgather|"
                      r"all_to_all|alltoall|broadcast|c10d::|sendrecv"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn|_efficient_attention|mha_"),
    ("fused (triton)", r"(^|[^a-z])triton_"),
    # Not "lamb": ATen's kernel names spell {lambda()#1}. lpnorm_cleanup: the
    # second pass of _foreach_norm (the gradient clip / finiteness check).
    ("optimizer", r"multi_tensor_apply|adam|foreach|fused_sgd|lpnorm"),
    ("loss", r"cross_?entropy|nll|log_?softmax"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|_scaled_mm|ampere_.*(s|h|bf)\d+|"
             r"hopper_|sm\d+_xmma|^(mm|addmm|bmm|baddbmm|linear|mv|addmv|dot|einsum)$"),
    # GammaBetaBackward: layer norm's weight and bias gradients.
    ("norm", r"rms_?norm|layer_?norm|gammabeta|norm(?!al)"),
    ("copies", r"memcpy|memset|copy|catarray|^cat$|^stack$|^to$|contiguous|^clone$"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|softmax|gelu|silu|swiglu|"
                    r"relu|sigmoid|tanh|rope|rotary|^(add|sub|mul|div|neg|pow|rsqrt|sqrt|exp|"
                    r"log|where|fill|zero|clamp|sum|mean|max|min|amax|any|all|isfinite|"
                    r"logical_not|abs|triu|tril|lerp|addcmul|addcdiv|masked_fill)_?$"),
]
COMPILED = [(name, re.compile(pattern)) for name, pattern in CLASSES]
ORDER = [name for name, _ in CLASSES] + ["other"]

AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "


class TraceError(Exception):
    pass


def op_base_name(name):
    """A CPU op's name as the op it is: "aten::addmm" -> "addmm";
    "autograd::engine::evaluate_function: MmBackward0" -> "mm";
    "...: torch::autograd::AccumulateGrad" -> "accumulate_grad";
    a C++ autograd Function's node, "...: torch::autograd::CppNode<
    kernels::(anonymous namespace)::LinearFunction>" -> "linear"."""
    if name.startswith(AUTOGRAD_PREFIX):
        name = name[len(AUTOGRAD_PREFIX):]
        cpp_node = re.match(r".*CppNode<(.*)>$", name)
        if cpp_node:
            name = re.sub(r"Function$", "", cpp_node.group(1))
        name = name.rsplit("::", 1)[-1]
        name = re.sub(r"Backward\d*$", "", name)
        name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)  # CamelCase -> snake_case
    else:
        name = name.rsplit("::", 1)[-1]
    return name.lower()


def classify(name, category="kernel"):
    """The class of a GPU event (category one of GPU_CATEGORIES) or a CPU op
    (category "cpu_op")."""
    if category in ("gpu_memcpy", "gpu_memset", "memcpy", "memset"):
        return "copies"
    lowered = name.lower()
    candidates = [lowered]
    if category == "cpu_op":
        candidates.append(op_base_name(name))
    for cls, pattern in COMPILED:
        if any(pattern.search(c) for c in candidates):
            return cls
    return "other"


def load_events(path):
    """The trace's event list; TraceError naming the path otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror})")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TraceError(f"{path}: gzip data that does not decompress ({e})")
    try:
        trace = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not JSON ({e}); expected a Chrome trace "
                         "(torch.profiler's export_chrome_trace, or the trainer's --profile-trace)")
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise TraceError(f"{path}: expected a Chrome trace, a JSON object with a \"traceEvents\" "
                         "list (or a list of events)")
    return [e for e in events if isinstance(e, dict)]


def complete(event):
    """Whether `event` is a complete event ("ph": "X") with a start and a
    duration, in microseconds."""
    return (event.get("ph") == "X" and isinstance(event.get("ts"), (int, float))
            and isinstance(event.get("dur"), (int, float)))


def category(event):
    return str(event.get("cat", "")).lower()


def union_length(intervals):
    """Total length covered by [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def top_level(ops):
    """The ops not contained in another op of the same thread (by time:
    a child starts at or after its parent and ends by its end)."""
    by_thread = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        parent_end = -math.inf
        for e in events:
            # 1 ns of slack: Kineto rounds ts and dur to the nanosecond.
            if e["ts"] + e["dur"] <= parent_end + 1e-3:
                continue
            out.append(e)
            parent_end = e["ts"] + e["dur"]
    return out


def step_span(events):
    """The last ProfilerStep#N annotation (a CPU event; torch.profiler's
    GPU-side copy, category gpu_user_annotation, is not one), or None."""
    spans = [e for e in events if complete(e) and str(e.get("name", "")).startswith(STEP_PREFIX)
             and not category(e).startswith("gpu")]
    return max(spans, key=lambda e: e["ts"]) if spans else None


def correlation(event):
    args = event.get("args")
    return args.get("correlation") if isinstance(args, dict) else None


def step_events(events):
    """(label of the step, its GPU events, its CPU ops)."""
    gpu = [e for e in events if complete(e) and category(e) in GPU_CATEGORIES]
    cpu = [e for e in events if complete(e) and category(e) == "cpu_op"]
    span = step_span(events)
    if span is None:
        return "the whole trace", gpu, cpu
    start, end = span["ts"], span["ts"] + span["dur"]
    cpu = [e for e in cpu if start <= e["ts"] <= end]
    launched = {correlation(e) for e in events
                if complete(e) and category(e) in RUNTIME_CATEGORIES and start <= e["ts"] <= end}
    launched.discard(None)
    if launched and any(correlation(e) is not None for e in gpu):
        gpu = [e for e in gpu if correlation(e) in launched]
    else:
        # No correlation ids: what started on the GPU from the step's start
        # (the last step: nothing after it is another step's).
        gpu = [e for e in gpu if e["ts"] >= start]
    return span["name"], gpu, cpu


def summarize(label, path):
    """The figures of one trace: a dict (see --json)."""
    events = load_events(path)
    step, gpu, cpu = step_events(events)
    if gpu:
        mode, counted = "GPU kernels", gpu
    elif cpu:
        mode, counted = "CPU ops", top_level(cpu)
    else:
        raise TraceError(f"{label}={path}: no GPU kernels (categories kernel, gpu_memcpy, "
                         f"gpu_memset) and no CPU ops (cpu_op) in {step}: expected a profiled "
                         "training step")
    classes = {name: 0.0 for name in ORDER}
    kernels = {}
    for e in counted:
        cls = classify(str(e.get("name", "")), category(e))
        classes[cls] += e["dur"]
        entry = kernels.setdefault(e.get("name", ""), {"class": cls, "count": 0, "us": 0.0})
        entry["count"] += 1
        entry["us"] += e["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in counted]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = union_length(intervals)
    summed = sum(classes.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:10]
    ms = 1e-3
    return {
        "path": path,
        "mode": mode,
        "step": step,
        "classes_ms": {name: us * ms for name, us in classes.items()},
        "idle_ms": max(span - busy, 0.0) * ms,
        "overlap_ms": max(summed - busy, 0.0) * ms,
        "total_ms": span * ms,
        "events": len(counted),
        "top": [{"name": name, "class": v["class"], "count": v["count"], "ms": v["us"] * ms}
                for name, v in top],
    }


def short(name, width=90):
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def percent(part, whole):
    return f"{100.0 * part / whole:.1f}" if whole > 0 else "-"


def render(labels, results):
    lines = []
    for label in labels:
        r = results[label]
        lines.append(f"{label}: {r['path']} ({r['mode']}, {r['step']}, {r['events']} events)")
    modes = {results[label]["mode"] for label in labels}
    if len(modes) > 1:
        lines.append("warning: GPU kernels and CPU ops side by side; the times do not compare")
    ratio = len(labels) == 2
    header = ["class"]
    for label in labels:
        header += [f"{label} ms", "%"]
    if ratio:
        header.append(f"{labels[0]}/{labels[1]}")
    rows = []
    keys = ORDER + ["idle", "overlap", "total"]
    for key in keys:
        if key in ORDER:
            values = [results[label]["classes_ms"][key] for label in labels]
            if all(v == 0 for v in values):
                continue
        else:
            values = [results[label][f"{key}_ms"] for label in labels]
            if key == "overlap" and all(v < 5e-4 for v in values):
                continue
        row = [key]
        for label, v in zip(labels, values):
            row += [f"{v:.3f}", percent(v, results[label]["total_ms"])]
        if ratio:
            # "-" where the ratio would divide by a figure shown as 0.000.
            row.append(f"{values[0] / values[1]:.2f}" if values[1] >= 5e-4 else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))

    lines.append(fmt(header))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    lines.append("(% of total, the step's span: first start to last end; overlap: time "
                 "several streams or threads ran at once, counted in each class)")
    for label in labels:
        r = results[label]
        kind = "kernels" if r["mode"] == "GPU kernels" else "top-level CPU ops"
        lines.append("")
        lines.append(f"top {len(r['top'])} {kind} of {label}:")
        for k in r["top"]:
            lines.append(f"  {k['ms']:9.3f} ms  {k['count']:5d}x  {k['class']:<14}  "
                         f"{short(k['name'])}")
    return "\n".join(lines)


def parse_trace_arg(value):
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(
            f"--trace '{value}': expected NAME=PATH (e.g. ours=step.json)")
    return label, path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Time per kernel class of one training step, traces side by side.")
    parser.add_argument("--trace", action="append", type=parse_trace_arg, required=True,
                        metavar="NAME=PATH",
                        help="a Chrome trace (.json or .json.gz); give two or more")
    parser.add_argument("--json", metavar="OUT", help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    labels = [label for label, _ in args.trace]
    if len(set(labels)) != len(labels):
        parser.error(f"--trace: names {labels} repeat; expected distinct names")
    results = {}
    try:
        for label, path in args.trace:
            results[label] = summarize(label, path)
    except TraceError as e:
        print(f"profile_table.py: {e}", file=sys.stderr)
        return 1
    print(render(labels, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: results[label] for label in labels}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
