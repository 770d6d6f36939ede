#!/usr/bin/env bash
# Issue 25, item 5: what a checkpoint adds to the trainer's peak RSS, on the
# trainer's own state (trainer_bench's size: --layers 8 --dim 512, AdamW),
# 1 and 2 ranks. Each case is one trainer run of three steps, without and
# with a checkpoint after step 2 (each run its own processes: peak RSS is a
# per-process high-water mark; the trainer's --log-json reports it per rank
# with each step, so step 3's record holds step 2's save and step 2's does
# not). Prints, per (ranks, format), against the checkpoint's size on disk
# and its largest tensor, the largest increase over ranks of
#   across runs:  step 3's peak with the checkpoint - without it, which
#                 carries the run-to-run spread of the peak (a few MiB);
#   within a run: step 3's peak - step 2's with the checkpoint, minus the
#                 same of the run without (the steady state's growth).
#
#   benchmarks/run_checkpoint_memory.sh [--out DIR] [--layers N] [--dim N]
#
# Formats: sharded and full, each synchronous and with --async-checkpoint;
# and --export-dcp, which runs after the last step's record: for it, the
# largest peak RSS of the run's processes (getrusage) with and without.
# Takes ~2 minutes on 2 cores; the checkpoints are removed at the end (the
# logs stay in --out). SHARDED saves write views of the live flat
# parameters and optimizer state (state_dict/fsdp/README.md); FULL saves
# gather one tensor at a time onto rank 0 just before writing it
# (state_dict/fsdp/fsdp_full_checkpoint.h).
set -euo pipefail

out=""
layers=8
dim=512
while (($#)); do
  case "$1" in
    --out) out="${2:?--out needs DIR}"; shift 2 ;;
    --layers) layers="${2:?--layers needs N}"; shift 2 ;;
    --dim) dim="${2:?--dim needs N}"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_checkpoint_memory.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" && "$out" != /* ]] && out="$PWD/$out"
cd "$(dirname "$0")/.."
out=${out:-$(mktemp -d /tmp/checkpoint_memory.XXXXXX)}
mkdir -p "$out"
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
[[ -x "$PY" ]] || {
  echo "run_checkpoint_memory.sh: $PY missing: run tools/setup.sh --with-python" >&2
  exit 1
}

bazel build //trainer:trainer >&2
trainer="$(bazel info bazel-bin 2>/dev/null)/trainer/trainer"

run() {  # name ranks [trainer flags...]
  local name=$1 ranks=$2
  shift 2
  echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $name" >&2
  rm -rf "$out/ckpt_$name" "$out/dcp_$name"
  # The largest peak RSS of the run's processes (getrusage of the children:
  # the launcher and its ranks) to $name.maxrss, in KiB.
  "$PY" -c 'import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)' "$out/$name.maxrss" \
    "$trainer" --nproc "$ranks" --model transformer --data synthetic --layers "$layers" \
    --dim "$dim" --optimizer adamw --steps 3 --warmup-steps 1 --log-json "$out/$name.jsonl" \
    "$@" >"$out/$name.txt" 2>&1 || { cat "$out/$name.txt" >&2; exit 1; }
}
for ranks in 1 2; do
  run "r${ranks}_none" "$ranks"
  for format in sharded full; do
    run "r${ranks}_${format}" "$ranks" --checkpoint-dir "$out/ckpt_r${ranks}_${format}" \
      --checkpoint-every 2 --checkpoint-format "$format"
    run "r${ranks}_${format}-async" "$ranks" --checkpoint-every 2 --async-checkpoint \
      --checkpoint-dir "$out/ckpt_r${ranks}_${format}-async" --checkpoint-format "$format"
  done
  run "r${ranks}_dcp-export" "$ranks" --export-dcp "$out/dcp_r${ranks}_dcp-export"
done

"$PY" - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
MiB = 1024.0 * 1024.0

def peaks(name):
    """Per step, the per-rank peak RSS its --log-json record reports."""
    found = {}
    for line in open(os.path.join(out, name + ".jsonl")):
        record = json.loads(line)
        if "peak_rss_bytes" in record:
            found[record["step"]] = record["peak_rss_bytes"]
    return found

def largest_tensor(step_dir):
    import torch
    biggest, total = 0, 0
    for path in glob.glob(os.path.join(step_dir, "*.pt")):
        for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
            if torch.is_tensor(value):
                biggest = max(biggest, value.numel() * value.element_size())
    for path in glob.glob(os.path.join(step_dir, "*")):
        total += os.path.getsize(path)
    return biggest, total

print(f"{'ranks':>5} {'format':>13} {'peak RSS no ckpt':>17} {'with ckpt':>10} "
      f"{'added across runs':>18} {'within a run':>13} {'ckpt size':>10} "
      f"{'largest tensor':>15} {'across/size':>12}")
for ranks in (1, 2):
    base = peaks(f"r{ranks}_none")
    for fmt in ("sharded", "sharded-async", "full", "full-async"):
        with_ckpt = peaks(f"r{ranks}_{fmt}")
        across = max(w - b for w, b in zip(with_ckpt[3], base[3]))
        within = max((w3 - w2) - (b3 - b2) for w3, w2, b3, b2 in
                     zip(with_ckpt[3], with_ckpt[2], base[3], base[2]))
        step_dir = sorted(glob.glob(os.path.join(out, f"ckpt_r{ranks}_{fmt}", "step_*")))[-1]
        biggest, total = largest_tensor(step_dir)
        print(f"{ranks:>5} {fmt:>13} {max(base[3]) / MiB:>13.1f} MiB "
              f"{max(with_ckpt[3]) / MiB:>6.1f} MiB {across / MiB:>14.1f} MiB "
              f"{within / MiB:>9.1f} MiB {total / MiB:>6.1f} MiB {biggest / MiB:>11.1f} MiB "
              f"{across / total:>12.3f}")
    # --export-dcp writes after the last step's record: the whole run's
    # largest peak (any process) with it, against the run without.
    def maxrss(name):
        return int(open(os.path.join(out, name + ".maxrss")).read()) * 1024
    added = maxrss(f"r{ranks}_dcp-export") - maxrss(f"r{ranks}_none")
    dcp_dir = os.path.join(out, f"dcp_r{ranks}_dcp-export")
    dcp_size = sum(os.path.getsize(os.path.join(dcp_dir, f)) for f in os.listdir(dcp_dir))
    print(f"{ranks:>5} {'dcp-export':>13} {maxrss(f'r{ranks}_none') / MiB:>13.1f} MiB "
          f"{maxrss(f'r{ranks}_dcp-export') / MiB:>6.1f} MiB {added / MiB:>14.1f} MiB "
          f"{'-':>13} {dcp_size / MiB:>6.1f} MiB {'':>15} {added / dcp_size:>12.3f}")
EOF
# The checkpoints (about 5 GB per run of this script) are not kept.
rm -rf "$out"/ckpt_* "$out"/dcp_*
