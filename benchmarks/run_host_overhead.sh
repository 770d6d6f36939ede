#!/usr/bin/env bash
# FSDP's host overhead per unit per step, ours against Python's (issue 37's
# goal: under half of Python's fully_shard, in ATen operators dispatched and
# in microseconds), on a model so small that compute is negligible.
#
#   benchmarks/run_host_overhead.sh [--rounds N]     # ~2 min on 2 cores
#
# Both sides run the trainer's transformer at --tiny size (8 blocks x 16, 2
# heads, vocab 32, seq 8, 2 rows: 9 FSDP units, the blocks and the root) on
# a Gloo world of 1, one intra-op thread, tcmalloc, fused AdamW:
#   ours    //benchmarks:op_count_bench --tiny --fsdp=none|fsdp1|fully_shard
#   Python  benchmarks/python/op_count.py --tiny --fsdp none|fsdp1|fsdp2
# Each prints a step's ATen operators (RecordFunction / torch.profiler,
# nested ones included) and the median step time of 50 unprofiled steps.
# A unit's overhead is (FSDP step - unwrapped step) / 9, for the
# operators and for the time; the time is the median over --rounds
# interleaved rounds (ours none, fsdp1, fully_shard, Python none, fsdp1,
# fsdp2, then again), the operator counts do not vary.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
while (($#)); do
  case "$1" in
    --rounds) rounds="${2:?--rounds needs N}"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_host_overhead.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "run_host_overhead.sh: --rounds must be a positive integer" >&2; exit 2; }
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
[[ -x "$PY" ]] || { echo "run_host_overhead.sh: $PY missing: run tools/setup.sh --with-python" >&2; exit 1; }
readonly tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[[ -e "$tcmalloc" ]] || { echo "run_host_overhead.sh: $tcmalloc missing (tools/setup.sh installs it)" >&2; exit 1; }

bazel build -c opt //benchmarks:op_count_bench >&2
bench="$(bazel info -c opt bazel-bin 2>/dev/null)/benchmarks/op_count_bench"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for ((r = 1; r <= rounds; r++)); do
  echo "== round $r/$rounds" >&2
  for f in none fsdp1 fully_shard; do
    OMP_NUM_THREADS=1 "$bench" --tiny --fsdp="$f" | grep '^RESULT' >>"$out/ours_$f"
  done
  for f in none fsdp1 fsdp2; do
    OMP_NUM_THREADS=1 LD_PRELOAD="$tcmalloc" "$PY" benchmarks/python/op_count.py --tiny \
      --optimizer-impl fused --fsdp "$f" | grep '^RESULT' >>"$out/py_$f"
  done
done

"$PY" - "$out" <<'PYEOF'
import statistics, sys, os
out = sys.argv[1]

def read(name):
    rows = []
    for line in open(os.path.join(out, name)):
        f = line.split()
        rows.append({f[i]: float(f[i + 1]) for i in range(1, len(f) - 1, 2)})
    return {"ops": rows[-1]["aten_ops_per_step"], "top": rows[-1]["top_level_per_step"],
            "us": statistics.median(r["host_us_per_step"] for r in rows),
            "units": rows[-1]["units"], "all_us": [r["host_us_per_step"] for r in rows]}

print("| side | FSDP | ATen ops/step | top-level | step us (median) | per unit: ops | per unit: us |")
print("| --- | --- | --- | --- | --- | --- | --- |")
per_unit = {}
for side, names in (("ours", ("none", "fsdp1", "fully_shard")), ("Python", ("none", "fsdp1", "fsdp2"))):
    base = read(f"{'ours' if side == 'ours' else 'py'}_none")
    for n in names:
        r = read(f"{'ours' if side == 'ours' else 'py'}_{n}")
        if n == "none":
            print(f"| {side} | unwrapped | {r['ops']:.0f} | {r['top']:.0f} | {r['us']:.0f} | - | - |")
            continue
        ops = (r["ops"] - base["ops"]) / r["units"]
        us = (r["us"] - base["us"]) / r["units"]
        per_unit[(side, n)] = (ops, us)
        print(f"| {side} | {n} | {r['ops']:.0f} | {r['top']:.0f} | {r['us']:.0f} | {ops:.1f} | {us:.0f} |")
print()
for ours, theirs in (("fully_shard", "fsdp2"), ("fsdp1", "fsdp1")):
    o, t = per_unit[("ours", ours)], per_unit[("Python", theirs)]
    print(f"- ours {ours} / Python {theirs}, per unit: operators {o[0] / t[0]:.2f}x, "
          f"time {o[1] / t[1]:.2f}x (goal < 0.5x)")
PYEOF
