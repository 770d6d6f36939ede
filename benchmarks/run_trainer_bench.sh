#!/usr/bin/env bash
# Runs //benchmarks:trainer_bench on 1, 2 and 4 local ranks and prints one
# table: config, ranks, step time, ratio vs baseline, parameter + gradient +
# optimizer bytes per rank, fraction of unsharded, peak RSS (max over ranks).
#
#   benchmarks/run_trainer_bench.sh            # ~8-10 min on 2 cores
#   RANKS="1 2" benchmarks/run_trainer_bench.sh
#
# Each (case, world size) runs in its own process group, because peak RSS
# is a per-process high-water mark. Baselines: 1 rank, the unwrapped model
# (NoFSDP); N > 1, plain flatten/all-reduce/unflatten data parallelism
# (DDP), which is also what NO_SHARD is held to (goal <= 1.10x) and
# FULL_SHARD (goal <= 1.35x). FULLY_SHARD (fsdp::fully_shard as the
# trainer's --fsdp=fully_shard applies it) is held to FULL_SHARD (issue 37:
# no slower, peak memory no higher).
#
# State bytes (parameters + gradients + Adam state a rank holds, max over
# ranks) are the benchmark's state_bytes counter, measured by
# trainer::ShardedStateBytes (what the trainer's --log-json reports). The
# unsharded reference is the 1-rank NoFSDP run.
set -euo pipefail
cd "$(dirname "$0")/.."

RANKS="${RANKS:-1 2 4}"
# The tables are made by the venv's Python that tools/setup.sh --with-python
# makes (TORCHFSDP_PYTHON overrides it), checked before the long runs.
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
[[ -x "$PY" ]] || {
  echo "run_trainer_bench.sh: $PY missing: run tools/setup.sh --with-python (TORCHFSDP_HOME moves the venv)" >&2
  exit 1
}
bazel build //benchmarks:trainer_bench
BIN="$(bazel info bazel-bin 2>/dev/null)"
BENCH="$BIN/benchmarks/trainer_bench"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

for n in $RANKS; do
  if [[ "$n" == 1 ]]; then cases="NoFSDP FULL_SHARD SHARD_GRAD_OP NO_SHARD FULLY_SHARD"
  else cases="DDP FULL_SHARD SHARD_GRAD_OP NO_SHARD FULLY_SHARD"; fi
  for c in $cases; do
    echo "trainer_bench: $c on $n rank(s)" >&2
    TRAINER_BENCH_NPROC="$n" "$BENCH" --benchmark_filter="^BM_Step/$c/" \
      --benchmark_out="$OUT/bench_${n}_${c}.json" --benchmark_out_format=json \
      > "$OUT/bench_${n}_${c}.log" 2>&1 || { cat "$OUT/bench_${n}_${c}.log" >&2; exit 1; }
  done
done

"$PY" - "$OUT" "$RANKS" <<'EOF'
import json, os, sys
out, ranks = sys.argv[1], [int(r) for r in sys.argv[2].split()]

def bench(n, c):
    path = os.path.join(out, f"bench_{n}_{c}.json")
    b = json.load(open(path))["benchmarks"][0]
    return b["real_time"], b["peak_rss_MiB"], b["params"], int(b["state_bytes"])

unsharded = bench(1, "NoFSDP")[3] if 1 in ranks else None
print("| config | ranks | step ms | ratio vs baseline | state bytes/rank (max) | "
      "fraction of unsharded | goal | peak RSS MiB (max rank) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
params = None
for n in ranks:
    cases = ["NoFSDP" if n == 1 else "DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "FULLY_SHARD"]
    base_ms = bench(n, cases[0])[0]
    for c in cases:
        ms, rss, params, sb = bench(n, c)
        ratio = ms / base_ms
        frac = f"{sb / unsharded:.3f}" if (sb is not None and unsharded) else "-"
        goal = ""
        if n > 1 and c == "NO_SHARD":
            goal = f"time <= 1.10x: {'met' if ratio <= 1.10 else 'MISSED'}"
        elif n > 1 and c == "FULL_SHARD":
            t = "met" if ratio <= 1.35 else "MISSED"
            m = ("met" if sb / unsharded <= 1.0 / n + 0.05 else "MISSED") if unsharded else "?"
            goal = f"time <= 1.35x: {t}; bytes <= 1/N+5%: {m}"
        elif c == "FULLY_SHARD":
            full_ms, full_rss = bench(n, "FULL_SHARD")[:2]
            t = "met" if ms <= full_ms else "MISSED"
            r = "met" if rss <= full_rss else "MISSED"
            goal = (f"vs FULL_SHARD: time {ms / full_ms:.2f}x (<= 1): {t}; "
                    f"peak RSS {rss / full_rss:.2f}x (<= 1): {r}")
        base = "NoFSDP" if n == 1 else "DDP"
        sbs = f"{sb:,}" if sb is not None else "-"
        print(f"| {c} | {n} | {ms:.0f} | {ratio:.2f}x vs {base} | {sbs} | {frac} | {goal} | {rss:.0f} |")
print(f"\nmodel: TransformerLM, {params:,.0f} parameters; ratios within one world size.")
EOF
