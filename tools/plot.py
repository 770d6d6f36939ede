#!/bin/sh
# A shell preamble that Python reads as a string: `bazel run //tools:plot`
# (an sh_binary) and ./tools/plot.py start the venv's Python that
# `tools/setup.sh --with-python` makes, which has matplotlib.
''':'
for py in "${TORCHFSDP_PYTHON:-}" \
    "${TORCHFSDP_HOME:+$TORCHFSDP_HOME/venv/bin/python3}" \
    "${HOME:+$HOME/.cache/torchfsdp-cpp/venv/bin/python3}" \
    "$(getent passwd "$(id -u)" | cut -d: -f6)/.cache/torchfsdp-cpp/venv/bin/python3"; do
  # The last one: `bazel test` sets HOME to the test's temporary directory.
  [ -n "$py" ] && [ -x "$py" ] && exec "$py" "$0" "$@"
done
echo 'plot: no Python at ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3' \
  "(HOME=${HOME:-unset}, TORCHFSDP_HOME=${TORCHFSDP_HOME:-unset}): run tools/setup.sh --with-python" >&2
exit 1
'''

__doc__ = """Plots a trainer --log-json file: loss, validation loss and tokens/s against step.

    bazel run //tools:plot -- LOG.jsonl [-o OUT.png] [--title TEXT]

LOG.jsonl has one JSON object per line with at least "step", "loss" and
"tokens_per_s" (see trainer/json_log.h). A resumed run appends to its log, so
a step can appear more than once: the last line for a step wins, which is
the line of the run that continued. A run with --eval-every also logs
"val_loss" on its evaluation steps: drawn as points joined by a line on the
loss axis. Writes OUT.png (default: LOG with .png).

Runs under ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3
(TORCHFSDP_PYTHON overrides it), the venv `tools/setup.sh --with-python`
makes with the torch wheel, numpy and matplotlib.
"""

import argparse
import json
import os
import sys


def read_log(path):
    by_step = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot: {path}:{number}: not JSON ({e})")
            for key in ("step", "loss", "tokens_per_s"):
                if key not in record:
                    sys.exit(f"plot: {path}:{number}: no '{key}' key "
                             f"(expected a trainer --log-json file)")
            by_step[int(record["step"])] = record
    if not by_step:
        sys.exit(f"plot: {path}: no step records")
    return [by_step[s] for s in sorted(by_step)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a trainer --log-json file")
    parser.add_argument("-o", "--output", help="PNG to write (default: LOG.png)")
    parser.add_argument("--title", help="chart title (default: the log's name)")
    args = parser.parse_args()

    # `bazel run` starts us in the runfiles tree: resolve paths where the
    # user typed the command.
    cwd = os.environ.get("BUILD_WORKING_DIRECTORY")
    if cwd:
        os.chdir(cwd)
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"plot: matplotlib is missing from {sys.executable}: run "
                 "`tools/setup.sh --with-python` (it installs matplotlib into the venv)")

    records = read_log(args.log)
    steps = [r["step"] for r in records]
    loss = [r["loss"] if r["loss"] is not None else float("nan") for r in records]
    throughput = [r["tokens_per_s"] for r in records]
    world = len(records[-1].get("peak_rss_bytes", [0]))

    fig, ax_loss = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax_loss.plot(steps, loss, color="tab:blue", linewidth=1.4, label="loss")
    val = [(r["step"], r["val_loss"] if r["val_loss"] is not None else float("nan"))
           for r in records if "val_loss" in r]
    if val:
        ax_loss.plot([s for s, _ in val], [v for _, v in val], color="tab:green",
                     marker="o", markersize=4, linewidth=1.2, label="validation loss")
        ax_loss.legend(loc="upper right")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (global mean)", color="tab:blue")
    ax_loss.tick_params(axis="y", labelcolor="tab:blue")
    ax_loss.grid(alpha=0.3)

    ax_tps = ax_loss.twinx()
    ax_tps.plot(steps, throughput, color="tab:orange", linewidth=0.9, alpha=0.8,
                label="tokens/s")
    ax_tps.set_ylabel("tokens/s", color="tab:orange")
    ax_tps.tick_params(axis="y", labelcolor="tab:orange")
    ax_tps.set_ylim(bottom=0)

    title = args.title or os.path.basename(args.log)
    val_text = f", validation loss {val[-1][1]:.3f}" if val else ""
    ax_loss.set_title(f"{title}: loss {loss[0]:.3f} -> {loss[-1]:.3f}{val_text} over "
                      f"{len(steps)} steps, {world} rank{'s' if world != 1 else ''}")
    fig.tight_layout()
    output = args.output or os.path.splitext(args.log)[0] + ".png"
    fig.savefig(output)
    print(f"plot: wrote {output}" +
          (f" ({len(val)} validation loss points)" if val else ""))


if __name__ == "__main__":
    main()
