#!/usr/bin/env bash
# The Llama training step on the CPU, 2 ranks over Gloo: `//:trainer --model
# llama --fsdp fully_shard` against transformers' LlamaForCausalLM under
# Python's fully_shard (benchmarks/python/llama_step.py), the same
# checkpoint (benchmarks/llama/small_config.json, 4 layers x 256, GQA 8/4,
# vocabulary 4096: 3.7M parameters, initialised by transformers and saved
# once), the same synthetic batches, AdamW and schedule. Rounds alternate
# which side goes first; each side's median step time over the steps after
# --warmup, the ratio ours / Python (goal <= 0.5), and the losses of both
# (they must agree: the same model and data).
#
#   benchmarks/run_llama_cpu.sh [--rounds N] [--steps N] [--warmup N] [--seq N] [--batch N]
#                               [--config FILE]
#
# --config: another config.json (e.g. models/testdata/llama3_gqa/config.json,
# the golden 2 x 64 model, where per-op overhead rather than GEMM time
# decides).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 steps=20 warmup=5 seq=128 batch=8 config=benchmarks/llama/small_config.json
while (($#)); do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    *) echo "run_llama_cpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
[[ -x "$PY" ]] || { echo "run_llama_cpu.sh: $PY missing: run tools/setup.sh --with-python" >&2; exit 1; }
bazel build //:trainer >/dev/null 2>&1 || bazel build //:trainer
TRAINER="$(bazel info bazel-bin 2>/dev/null)/trainer/trainer"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" benchmarks/python/llama_step.py --make-checkpoint "$work/ckpt" \
  --config "$config"
# tcmalloc for Python as for ours (linked there), as compare_pytorch.sh does.
tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 2>/dev/null || true)
common=(--steps "$steps" --seq "$seq" --global-batch "$batch" --seed 0)
ours() {
  "$TRAINER" --model llama --hf-checkpoint "$work/ckpt" --fsdp fully_shard --nproc 2 \
    --data synthetic "${common[@]}" --log-json "$1" >/dev/null
}
theirs() {
  OMP_NUM_THREADS=1 LD_PRELOAD="$tcmalloc" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 benchmarks/python/llama_step.py --hf-checkpoint "$work/ckpt" \
    "${common[@]}" --log-json "$1" >/dev/null 2>&1
}
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then ours "$work/ours_$r.jsonl"; theirs "$work/py_$r.jsonl"
  else theirs "$work/py_$r.jsonl"; ours "$work/ours_$r.jsonl"; fi
done
"$PY" - "$work" "$rounds" "$warmup" <<'PYEOF'
import json, statistics, sys
work, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def read(path):
    return [json.loads(l) for l in open(path)]
ratios, ours_all, py_all = [], [], []
for r in range(rounds):
    o, p = read(f"{work}/ours_{r}.jsonl"), read(f"{work}/py_{r}.jsonl")
    to = statistics.median(x["step_time_s"] for x in o[warmup:])
    tp = statistics.median(x["step_time_s"] for x in p[warmup:])
    ours_all.append(to); py_all.append(tp); ratios.append(to / tp)
    dl = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(o, p))
    print(f"round {r}: ours {to*1e3:.1f} ms/step, python {tp*1e3:.1f} ms/step, ratio {to/tp:.3f}, "
          f"losses {o[0]['loss']:.4f} -> {o[-1]['loss']:.4f} (max rel diff vs python {dl:.2e})")
print(f"median: ours {statistics.median(ours_all)*1e3:.1f} ms, python "
      f"{statistics.median(py_all)*1e3:.1f} ms, ratio {statistics.median(ratios):.3f} (goal <= 0.5)")
PYEOF
