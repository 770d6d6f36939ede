#!/usr/bin/env bash
# Runs the same cases in Python PyTorch and in this project, and prints a
# table of the times and the ratios ours/PyTorch (below 1: ours is faster).
# Issues #9 and #13.
#
#   benchmarks/compare_pytorch.sh [--out FILE] [--rounds N] [--steps N]
#                                 [--mlp-steps N] [--reps N] [--warmup N]
#                                 [--cases LIST]
#
# Python is the venv's interpreter that `tools/setup.sh --with-python` makes,
# ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3
# (TORCHFSDP_PYTHON overrides it): the same `torch` wheel whose LibTorch ours
# is built against, hence the same kernels and the same BLAS (MKL, linked
# into libtorch_cpu). It runs with what ours runs with ('same' in the
# table): the intra-op threads, and tcmalloc (preloaded; ours links it).
# Ours runs as a user runs it: the binaries' own thread layout (all cores for
# one process, cores / ranks for 2 ranks), tcmalloc linked.
#
# Cases:
#   1. Per-sample gradients, MLP 128->256->ReLU->10, cross-entropy, batch 256,
#      float32: //benchmarks:transforms_bench's BM_PerSampleGrad_VmapGrad and
#      BM_PerSampleGrad_Loop against vmap(grad(loss)) and a Python
#      per-example autograd loop
#      (functorch/transforms/bench/functorch_reference_bench.py), median of
#      --reps repetitions, wall time.
#   2. Batched Hessians of a 2->512->512->512->3 tanh MLP at 1024 points:
#      //benchmarks:hessian_bench against benchmarks/python/hessian_bench.py
#      (torch.func: vmap(jacfwd(jacrev)), vmap(hessian), per-point loop).
#   3. A data-parallel training step on 2 ranks over Gloo: `//:trainer --nproc 2`
#      against torch.nn.parallel.DistributedDataParallel
#      (benchmarks/python/ddp_step.py, 2 ranks started by torchrun,
#      `python3 -m torch.distributed.run --standalone`), same model, sizes,
#      synthetic data (bit-identical batches), Adam and global batch; the
#      trainer's default transformer and its MLP. Median step time over
#      --rounds runs per side (rotating which side goes first), first
#      --warmup steps of each run skipped.
#   4. An FSDP step on 2 ranks over Gloo: `//:trainer --nproc 2 --sharding
#      full` (FULL_SHARD, the trainer's default) against Python's
#      FullyShardedDataParallel (fsdp1) and fully_shard (fsdp2) running
#      benchmarks/python/fsdp_step.py with the same model and flags, as in 3.
#   5. A fully_shard step on 2 ranks over Gloo: `//:trainer --nproc 2 --fsdp
#      fully_shard` (FSDP2's per-parameter sharding; the blocks reshard after
#      forward, the root keeps its parameters: PyTorch's default)
#      against Python's fully_shard (fsdp_step.py --fsdp fsdp2), as in 3.
#      The table's "ours" column of 4 (FSDP1) and 5 (fully_shard) compares
#      our two FSDPs in the same run.
#
# --cases picks what runs, a comma-separated subset of functorch (1 and 2),
# ddp (3), fsdp (4 and 5); default functorch,ddp,fsdp.
#
# Builds what it needs with bazel (the flags of .bazelrc only). Writes nothing
# into the repository unless --out FILE is given (then the table also goes
# to FILE). Takes about 7-9 minutes on 2 cores after the build.
set -euo pipefail

usage() { sed -n '2,52p' "$0" | sed 's/^# \{0,1\}//'; }

out=""
rounds=2
steps=40       # transformer steps per run
mlp_steps=200  # MLP steps per run (its steps take milliseconds)
reps=3
warmup=5
cases=functorch,ddp,fsdp
while (($#)); do
  case "$1" in
    --out) out="${2:?--out needs a FILE}"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --rounds) rounds="${2:?}"; shift 2 ;;
    --steps) steps="${2:?}"; shift 2 ;;
    --mlp-steps) mlp_steps="${2:?}"; shift 2 ;;
    --reps) reps="${2:?}"; shift 2 ;;
    --warmup) warmup="${2:?}"; shift 2 ;;
    --cases) cases="${2:?--cases needs a LIST}"; shift 2 ;;
    --cases=*) cases="${1#--cases=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_pytorch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in rounds steps mlp_steps reps; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "compare_pytorch.sh: --${v//_/-} must be a positive integer" >&2; exit 2; }
done
IFS=, read -r -a case_list <<<"$cases"
for c in "${case_list[@]}"; do
  [[ $c == functorch || $c == ddp || $c == fsdp ]] ||
    { echo "compare_pytorch.sh: --cases: '$c' is not one of functorch, ddp, fsdp" >&2; exit 2; }
done
wants() { [[ ",$cases," == *",$1,"* ]]; }
[[ "$warmup" =~ ^[0-9]+$ ]] || { echo "compare_pytorch.sh: --warmup must be an integer >= 0" >&2; exit 2; }
if ((warmup >= steps || warmup >= mlp_steps)); then
  echo "compare_pytorch.sh: --warmup $warmup leaves no timed steps (--steps $steps, --mlp-steps $mlp_steps)" >&2
  exit 2
fi
# --out is relative to where the script was started.
if [[ -n "$out" && "$out" != /* ]]; then out="$PWD/$out"; fi

cd "$(dirname "$0")/.."
PY="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"

if [[ ! -x "$PY" ]]; then
  echo "compare_pytorch.sh: $PY missing: the Python side runs on the venv with the torch" >&2
  echo "  wheel that tools/setup.sh --with-python makes (run it; TORCHFSDP_HOME moves the venv)" >&2
  exit 1
fi
# functorch_reference_bench.py uses torch.func.
if ! "$PY" -c 'import torch, torch.func, torch.distributed as d; assert d.is_available() and d.is_gloo_available()'; then
  echo "compare_pytorch.sh: $PY cannot import torch and torch.func with Gloo:" >&2
  echo "  rerun tools/setup.sh --with-python" >&2
  exit 1
fi

readonly tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[[ -e "$tcmalloc" ]] || {
  echo "compare_pytorch.sh: $tcmalloc missing: the Python columns preload tcmalloc, as ours" >&2
  echo "  links it (apt-get install libtcmalloc-minimal4; tools/setup.sh installs it)" >&2
  exit 1
}

echo "== building //benchmarks:transforms_bench //benchmarks:hessian_bench //:trainer" >&2
bazel build //benchmarks:transforms_bench //benchmarks:hessian_bench //:trainer >&2
bin=$(bazel info bazel-bin 2>/dev/null)
bench_bin="$bin/benchmarks/transforms_bench"
hessian_bin="$bin/benchmarks/hessian_bench"
trainer_bin="$bin/trainer/trainer"
for f in "$bench_bin" "$hessian_bin" "$trainer_bin"; do
  [[ -x "$f" ]] || { echo "compare_pytorch.sh: $f missing after the build" >&2; exit 1; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cores=$(nproc)
ddp_threads=$((cores / 2 > 0 ? cores / 2 : 1))
# Ours picks its own threads: no OMP_NUM_THREADS from the caller's shell.
unset OMP_NUM_THREADS MKL_NUM_THREADS
start_s=$SECONDS

# Runs a Python command as ours runs: THREADS intra-op threads, tcmalloc.
py_same() {
  local threads=$1; shift
  env OMP_NUM_THREADS="$threads" LD_PRELOAD="$tcmalloc" "$@"
}

report_functorch=()
if wants functorch; then
# --- 1. per-sample gradients ------------------------------------------------
echo "== per-sample gradients: ours ($reps repetitions)" >&2
"$bench_bin" --benchmark_filter='^BM_PerSampleGrad_' \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_out="$tmp/cpp_bench.json" --benchmark_out_format=json >&2
echo "== per-sample gradients: Python ($reps repetitions)" >&2
py_same "$cores" "$PY" functorch/transforms/bench/functorch_reference_bench.py \
  --filter '^PerSampleGrad_' --repetitions "$reps" --json "$tmp/py_bench.same.json" >&2

# --- 2. batched Hessians ----------------------------------------------------
echo "== batched Hessians: ours ($reps repetitions)" >&2
"$hessian_bin" --benchmark_filter='^BM_(Hessian_|Sgemm)' \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_out="$tmp/cpp_hessian.json" --benchmark_out_format=json >&2
echo "== batched Hessians: Python torch.func ($reps repetitions)" >&2
py_same "$cores" "$PY" benchmarks/python/hessian_bench.py --repetitions "$reps" \
  --json "$tmp/py_hessian.same.json" >&2
report_functorch=(--cpp-bench "$tmp/cpp_bench.json" --cpp-hessian "$tmp/cpp_hessian.json"
                  --py same "$tmp/py_bench.same.json" "$tmp/py_hessian.same.json")
fi

# --- 3. data-parallel step, 2 ranks -----------------------------------------

run_ours() {  # model steps log [sharding]
  local model=$1 n=$2 log=$3 sharding=${4:-none}
  # NO_SHARD: FSDP without sharding is the data-parallel step DDP takes.
  if ! timeout 300 "$trainer_bin" --nproc 2 --sharding "$sharding" "${ours_flags[@]}" \
      --data synthetic --model "$model" \
      "${common_flags[@]}" --steps "$n" --log-json "$log" >"$tmp/ours.out" 2>&1; then
    echo "compare_pytorch.sh: the trainer failed:" >&2; cat "$tmp/ours.out" >&2; exit 1
  fi
  grep -m1 'compute:' "$tmp/ours.out" >&2 || true
  tail -n 1 "$tmp/ours.out" >&2
}

run_python() {  # model steps log [script args...]
  local model=$1 n=$2 log=$3
  shift 3
  local script=(benchmarks/python/ddp_step.py)
  (($#)) && script=("$@")
  # torchrun picks a free port itself (--standalone); rank 0 writes the log.
  if ! py_same "$ddp_threads" timeout 300 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node 2 "${script[@]}" --model "$model" \
      "${common_flags[@]}" --steps "$n" --log-json "$log" >"$tmp/py.out" 2>&1; then
    echo "compare_pytorch.sh: the Python run (${script[*]}) failed:" >&2; cat "$tmp/py.out" >&2; exit 1
  fi
  grep -m1 -E '^(ddp|fsdp)_step:' "$tmp/py.out" >&2 || true
}

# The same flags for both sides (the trainer's defaults written out).
common_flags=(--seed 0 --global-batch 16 --optimizer adam --lr 3e-3 --lr-schedule cosine
              --warmup-steps 10 --layers 2 --dim 64 --heads 4 --vocab 256 --seq 64)
# --rounds runs of each side into DIR/ours.R.jsonl and DIR/py-same.R.jsonl,
# rotating which side goes first so none always runs on a warmer machine.
run_rounds() {  # title dir model steps sharding [python script args...]
  local title=$1 dir=$2 model=$3 n=$4 sharding=$5
  shift 5
  mkdir -p "$dir"
  local r k side sides=(ours python)
  for ((r = 1; r <= rounds; r++)); do
    echo "== $title, round $r/$rounds: $n steps per side" >&2
    for ((k = 0; k < 2; k++)); do
      side=${sides[$(((k + r - 1) % 2))]}
      if [[ $side == ours ]]; then
        run_ours "$model" "$n" "$dir/ours.$r.jsonl" "$sharding"
      else
        run_python "$model" "$n" "$dir/py-same.$r.jsonl" "$@"
      fi
    done
  done
}

ours_flags=()  # the trainer's flags beyond the common ones
ddp_args=()
if wants ddp; then
  for model in transformer mlp; do
    n=$steps; [[ $model == mlp ]] && n=$mlp_steps
    run_rounds "data parallel, $model" "$tmp/$model" "$model" "$n" none
    ddp_args+=(--ddp "DDP step, 2 ranks Gloo, $model" "$tmp/$model")
  done
fi

# --- 4. FSDP step, 2 ranks: FULL_SHARD against Python's FSDP1 and FSDP2 ------
# Same model and flags; one unit per transformer block plus the root,
# BACKWARD_PRE prefetch and use_orig_params on both sides (fsdp_step.py).
if wants fsdp; then
  for impl in fsdp1 fsdp2; do
    run_rounds "FSDP FULL_SHARD vs Python $impl" "$tmp/$impl" transformer "$steps" full \
      benchmarks/python/fsdp_step.py --fsdp "$impl" --sharding full
    ddp_args+=(--ddp "FSDP FULL_SHARD step, 2 ranks Gloo, transformer, vs Python $impl" "$tmp/$impl")
  done
  # --- 5. fully_shard step, 2 ranks: against Python's fully_shard -----------
  ours_flags=(--fsdp fully_shard)
  run_rounds "fully_shard vs Python fsdp2" "$tmp/fully_shard" transformer "$steps" full \
    benchmarks/python/fsdp_step.py --fsdp fsdp2 --sharding full
  ours_flags=()
  ddp_args+=(--ddp "fully_shard step (--fsdp fully_shard), 2 ranks Gloo, transformer, vs Python fsdp2"
             "$tmp/fully_shard")
fi

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
report=$("$PY" benchmarks/python/compare_report.py "${report_functorch[@]}" \
  "${ddp_args[@]}" --warmup "$warmup" \
  --header "compare_pytorch: $(date -u '+%Y-%m-%d %H:%M UTC'), $cores cores, load average $(cut -d' ' -f1-3 /proc/loadavg), PyTorch $torch_version ($PY), $((SECONDS - start_s)) s of runs" \
  --header "Python 'same': the same torch wheel (its MKL, as ours), tcmalloc preloaded, OMP_NUM_THREADS=$cores (1 process) / $ddp_threads (each of 2 ranks, torchrun), as ours" \
  --header "DDP flags (all sides): --data synthetic ${common_flags[*]}; --steps $steps (transformer) / $mlp_steps (mlp), $rounds round(s)")
echo
echo "$report"
if [[ -n "$out" ]]; then
  printf '%s\n' "$report" >"$out"
  echo "compare_pytorch.sh: wrote $out" >&2
fi
