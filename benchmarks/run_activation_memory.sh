#!/usr/bin/env bash
# Issue #15's memory benchmark: //benchmarks:trainer_bench at a long-sequence
# configuration, every case with and without activation checkpointing, each
# (case, world size) in its own process (peak RSS is a per-process
# high-water mark). Prints one table per world size and the FULL_SHARD floor.
#
#   benchmarks/run_activation_memory.sh [--seq N] [--rows N] [--out DIR]
#   benchmarks/run_activation_memory.sh --report DIR   # the tables again
#
# Defaults: --seq 512 --rows 2 (1024 tokens per rank and step; the model's
# positions are sized to the sequence). Takes ~6 minutes on 2 cores.
#
# Columns (max over ranks):
#   activations  fwd_retained_MiB: what the allocator holds more after the
#                forward than before it, i.e. what the graph keeps for
#                backward (tcmalloc's counter; under FULL_SHARD it includes
#                the root unit's gathered parameters).
#   step cost    step_peak_rss_MiB - base_rss_MiB: what training adds to
#                the process (LibTorch, Gloo and the binary are in base_rss).
#                The step peak is the high-water mark over the steps alone;
#                building and wrapping the model is the set-up peak.
#   state        parameters + gradients + Adam state a rank holds.
#   gathered     the most unsharded parameter bytes alive at once (FSDP).
# The FULL_SHARD floor (issue #15) is base_rss + state + gathered +
# checkpointed activations. Backward must also hold what any checkpointed
# run holds beyond its state and checkpointed activations, FSDP or not:
# one block's recomputed activations, their gradients at the peak of the
# block's backward, and the allocator's slack. That is measured, not
# estimated: the 1-rank NoFSDP_ckpt case's step cost minus its state and
# activations, added to the floor and printed as "with the checkpointed
# backward". (It was estimated as 2 x the activations
# per block; measured on trainer_bench at seq 512 with tcmalloc's counters,
# a block's recomputation holds 48 MiB, its backward peaks ~21 MiB above
# that (1.4x, not 2x), and the mapped heap runs ~40 MiB above the
# allocated peak on 1 and 2 ranks alike, which no per-block estimate
# covers.)
set -euo pipefail

seq=512
rows=2
out=""
report_only=0
while (($#)); do
  case "$1" in
    --seq) seq="${2:?--seq needs N}"; shift 2 ;;
    --rows) rows="${2:?--rows needs N}"; shift 2 ;;
    --out) out="${2:?--out needs DIR}"; shift 2 ;;
    --report) out="${2:?--report needs DIR}"; report_only=1; shift 2 ;;
    -h|--help) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_activation_memory.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" && "$out" != /* ]] && out="$PWD/$out"
cd "$(dirname "$0")/.."
out=${out:-$(mktemp -d /tmp/activation_memory.XXXXXX)}
# The tables are made by the venv's Python that tools/setup.sh --with-python
# makes (TORCHFSDP_PYTHON overrides it), checked before the long runs.
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
[[ -x "$PY" ]] || {
  echo "run_activation_memory.sh: $PY missing: run tools/setup.sh --with-python (TORCHFSDP_HOME moves the venv)" >&2
  exit 1
}
mkdir -p "$out"

bench=""
if ((!report_only)); then
  bazel build //benchmarks:trainer_bench >&2
  bench="$(bazel info bazel-bin 2>/dev/null)/benchmarks/trainer_bench"
fi

run() {  # ranks case
  echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $2 on $1 rank(s)" >&2
  TRAINER_BENCH_NPROC="$1" TRAINER_BENCH_SEQ="$seq" TRAINER_BENCH_ROWS="$rows" \
    "$bench" --benchmark_filter="^BM_Step/$2/" \
    --benchmark_out="$out/$1_$2.json" --benchmark_out_format=json >"$out/$1_$2.txt" 2>&1 ||
    { cat "$out/$1_$2.txt" >&2; exit 1; }
}
if ((!report_only)); then
  for c in NoFSDP NoFSDP_ckpt FULL_SHARD FULL_SHARD_ckpt; do run 1 "$c"; done
  for c in DDP FULL_SHARD FULL_SHARD_ckpt SHARD_GRAD_OP SHARD_GRAD_OP_ckpt; do run 2 "$c"; done
fi

"$PY" - "$out" "$seq" "$rows" <<'EOF'
import json, os, sys
out, seq, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
MiB = 1024.0 * 1024.0

def load(n, case):
    b = json.load(open(os.path.join(out, f"{n}_{case}.json")))["benchmarks"][0]
    return {"ms": b["real_time"], "act": b["fwd_retained_MiB"],
            "cost": b["step_peak_rss_MiB"] - b["base_rss_MiB"], "peak": b["step_peak_rss_MiB"],
            "setup": b["setup_peak_rss_MiB"], "base": b["base_rss_MiB"],
            "state": b["state_bytes"] / MiB, "gathered": b.get("peak_gathered_MiB", 0.0)}

print(f"trainer_bench TransformerLM (8 blocks, dim 512), seq {seq}, {rows} rows per rank\n")
for n, cases in ((1, ["NoFSDP", "FULL_SHARD"]), (2, ["DDP", "FULL_SHARD", "SHARD_GRAD_OP"])):
    print(f"{n} rank(s):\n")
    print("| case | step ms | activations MiB | step cost MiB | state MiB | gathered MiB "
          "| step peak RSS MiB | set-up peak RSS MiB | ckpt: activations smaller "
          "| ckpt: step time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cases:
        for ckpt in (False, True):
            name = c + ("_ckpt" if ckpt else "")
            if not os.path.exists(os.path.join(out, f"{n}_{name}.json")):
                continue
            r = load(n, name)
            goal = ["", ""]
            if ckpt:
                plain = load(n, c)
                smaller = plain["act"] / r["act"] if r["act"] > 0 else float("inf")
                slower = r["ms"] / plain["ms"]
                goal = [f"{smaller:.2f}x ({'met' if smaller >= 3 else 'MISSED'}: >= 3x)",
                        f"{slower:.2f}x ({'met' if slower <= 1.35 else 'MISSED'}: <= 1.35x)"]
            print(f"| {name} | {r['ms']:.0f} | {r['act']:.1f} | {r['cost']:.0f} | "
                  f"{r['state']:.0f} | {r['gathered']:.1f} | {r['peak']:.0f} | {r['setup']:.0f} | "
                  f"{goal[0]} | {goal[1]} |")
    print()
    fs = f"{n}_FULL_SHARD_ckpt"
    if os.path.exists(os.path.join(out, fs + ".json")):
        r = load(n, "FULL_SHARD_ckpt")
        floor = r["base"] + r["state"] + r["gathered"] + r["act"]
        line = (f"FULL_SHARD_ckpt floor on {n} rank(s): base {r['base']:.0f} + state {r['state']:.0f}"
                f" + gathered {r['gathered']:.1f} + checkpointed activations {r['act']:.1f}"
                f" = {floor:.0f} MiB; step peak {r['peak']:.0f} MiB = {r['peak'] / floor:.3f} x floor"
                f" ({'met' if r['peak'] <= 1.10 * floor else 'MISSED'}: <= 1.10x)")
        if os.path.exists(os.path.join(out, "1_NoFSDP_ckpt.json")):
            u = load(1, "NoFSDP_ckpt")
            backward = u["cost"] - u["state"] - u["act"]
            with_backward = floor + backward
            line += (f"; with the checkpointed backward (1-rank NoFSDP_ckpt: step cost"
                     f" {u['cost']:.0f} - state {u['state']:.0f} - activations {u['act']:.1f}"
                     f" = {backward:.1f}) {with_backward:.0f} MiB: {r['peak'] / with_backward:.3f} x"
                     f" ({'met' if r['peak'] <= 1.10 * with_backward else 'MISSED'}: <= 1.10x)")
        print(line + "\n")
EOF
echo "raw outputs: $out" >&2
