#!/usr/bin/env bash
# Runs the same cases in Python PyTorch (Debian's python3-torch, through
# /usr/bin/python3) and in this project, and prints a table of the times and
# the ratios ours/PyTorch (below 1: ours is faster). Issues #9 and #13.
#
#   benchmarks/compare_pytorch.sh [--out FILE] [--rounds N] [--steps N]
#                                 [--mlp-steps N] [--reps N] [--warmup N]
#
# Python runs twice, and the table has a ratio for each:
#   defaults  as `apt-get install python3-torch` gives it on a fresh Debian 12:
#             libblas.so.3 is the reference (netlib) BLAS of libblas3, glibc
#             malloc, and LibTorch's own intra-op thread count (sized from
#             cpuinfo's physical cores: 1 on these VMs). Emulated by putting
#             libblas3's and liblapack3's directories first on LD_LIBRARY_PATH.
#   same      the BLAS (the OpenBLAS alternative tools/setup.sh selects), the
#             allocator (tcmalloc, preloaded) and the intra-op threads ours
#             runs with.
# Ours runs as a user runs it: the binaries' own thread layout (all cores for
# one process, cores / ranks for 2 ranks), OpenBLAS, tcmalloc linked.
#
# Cases:
#   1. Per-sample gradients, MLP 128->256->ReLU->10, cross-entropy, batch 256,
#      float32: //benchmarks:transforms_bench's BM_PerSampleGrad_VmapGrad and
#      BM_PerSampleGrad_Loop against functorch's vmap(grad(loss)) and a Python
#      per-example autograd loop
#      (functorch/transforms/bench/functorch_reference_bench.py), median of
#      --reps repetitions, wall time.
#   2. Batched Hessians of a 2->512->512->512->3 tanh MLP at 1024 points:
#      //benchmarks:hessian_bench against benchmarks/python/hessian_bench.py
#      (vmap(jacfwd(jacrev)), vmap(hessian), per-point loop).
#   3. A data-parallel training step on 2 ranks over Gloo: `//:trainer --nproc 2`
#      against torch.nn.parallel.DistributedDataParallel
#      (benchmarks/python/ddp_step.py, two processes started with
#      RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as torch.distributed.run fails
#      on Debian's Python 3.11 build), same model, sizes, synthetic data
#      (bit-identical batches), Adam and global batch; the trainer's default
#      transformer and its MLP. Median step time over --rounds runs per side
#      (rotating which side goes first), first --warmup steps of each run
#      skipped.
#
# Builds what it needs with bazel (the flags of .bazelrc only). Writes nothing
# into the repository unless --out FILE is given (then the table also goes
# to FILE). Takes about 5-8 minutes on 2 cores after the build.
set -euo pipefail

usage() { sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; }

out=""
rounds=2
steps=40       # transformer steps per run
mlp_steps=200  # MLP steps per run (its steps take milliseconds)
reps=3
warmup=5
while (($#)); do
  case "$1" in
    --out) out="${2:?--out needs a FILE}"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --rounds) rounds="${2:?}"; shift 2 ;;
    --steps) steps="${2:?}"; shift 2 ;;
    --mlp-steps) mlp_steps="${2:?}"; shift 2 ;;
    --reps) reps="${2:?}"; shift 2 ;;
    --warmup) warmup="${2:?}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_pytorch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in rounds steps mlp_steps reps; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "compare_pytorch.sh: --${v//_/-} must be a positive integer" >&2; exit 2; }
done
[[ "$warmup" =~ ^[0-9]+$ ]] || { echo "compare_pytorch.sh: --warmup must be an integer >= 0" >&2; exit 2; }
if ((warmup >= steps || warmup >= mlp_steps)); then
  echo "compare_pytorch.sh: --warmup $warmup leaves no timed steps (--steps $steps, --mlp-steps $mlp_steps)" >&2
  exit 2
fi
# --out is relative to where the script was started.
if [[ -n "$out" && "$out" != /* ]]; then out="$PWD/$out"; fi

cd "$(dirname "$0")/.."
PY=/usr/bin/python3

if ! "$PY" -c 'import torch, functorch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()' 2>/dev/null; then
  echo "compare_pytorch.sh: $PY cannot import torch and functorch (with Gloo): install" >&2
  echo "  Debian's python3-torch with: tools/setup.sh --with-python   (as root)" >&2
  exit 1
fi

readonly lib=/usr/lib/x86_64-linux-gnu
readonly reference_blas_dirs="$lib/blas:$lib/lapack"
readonly tcmalloc="$lib/libtcmalloc_minimal.so.4"
for f in "$lib/blas/libblas.so.3" "$lib/lapack/liblapack.so.3" "$tcmalloc"; do
  [[ -e "$f" ]] || {
    echo "compare_pytorch.sh: $f missing: the Python columns need libblas3, liblapack3 and" >&2
    echo "  libtcmalloc-minimal4 (apt-get install libblas3 liblapack3 libtcmalloc-minimal4)" >&2
    exit 1
  }
done

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

# Runs a Python command as the variant says: defaults | same THREADS.
py_as() {
  local variant=$1; shift
  if [[ $variant == defaults ]]; then
    env -u LD_PRELOAD LD_LIBRARY_PATH="$reference_blas_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
  else
    local threads=$1; shift
    env OMP_NUM_THREADS="$threads" LD_PRELOAD="$tcmalloc" "$@"
  fi
}

# --- 1. per-sample gradients ------------------------------------------------
echo "== per-sample gradients: ours ($reps repetitions)" >&2
"$bench_bin" --benchmark_filter='^BM_PerSampleGrad_' \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_out="$tmp/cpp_bench.json" --benchmark_out_format=json >&2
for variant in defaults same; do
  echo "== per-sample gradients: Python functorch, $variant ($reps repetitions)" >&2
  py_as "$variant" $([[ $variant == same ]] && echo "$cores") \
    "$PY" functorch/transforms/bench/functorch_reference_bench.py \
    --filter '^PerSampleGrad_' --repetitions "$reps" --json "$tmp/py_bench.$variant.json" >&2
done

# --- 2. batched Hessians ----------------------------------------------------
echo "== batched Hessians: ours ($reps repetitions)" >&2
"$hessian_bin" --benchmark_filter='^BM_(Hessian_|Sgemm)' \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_out="$tmp/cpp_hessian.json" --benchmark_out_format=json >&2
for variant in defaults same; do
  echo "== batched Hessians: Python functorch, $variant ($reps repetitions)" >&2
  py_as "$variant" $([[ $variant == same ]] && echo "$cores") \
    "$PY" benchmarks/python/hessian_bench.py --repetitions "$reps" \
    --json "$tmp/py_hessian.$variant.json" >&2
done

# --- 3. data-parallel step, 2 ranks -----------------------------------------
free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

run_ours() {  # model steps log
  local model=$1 n=$2 log=$3
  # NO_SHARD: FSDP without sharding is the data-parallel step DDP takes.
  if ! timeout 300 "$trainer_bin" --nproc 2 --sharding none --data synthetic --model "$model" \
      "${common_flags[@]}" --steps "$n" --log-json "$log" >"$tmp/ours.out" 2>&1; then
    echo "compare_pytorch.sh: the trainer failed:" >&2; cat "$tmp/ours.out" >&2; exit 1
  fi
  grep -m1 'compute:' "$tmp/ours.out" >&2 || true
  tail -n 1 "$tmp/ours.out" >&2
}

run_python() {  # variant model steps log
  local variant=$1 model=$2 n=$3 log=$4 port pids=() rank status=0
  port=$(free_port)
  for rank in 1 0; do
    local log_flag=()
    ((rank == 0)) && log_flag=(--log-json "$log")
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      py_as "$variant" $([[ $variant == same ]] && echo "$ddp_threads") \
      timeout 300 "$PY" benchmarks/python/ddp_step.py --model "$model" \
      "${common_flags[@]}" --steps "$n" "${log_flag[@]}" \
      >"$tmp/py.$rank.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  if ((status != 0)); then
    echo "compare_pytorch.sh: the Python DDP run ($variant) failed (status $status):" >&2
    sed 's/^/[rank 0] /' "$tmp/py.0.out" >&2; sed 's/^/[rank 1] /' "$tmp/py.1.out" >&2
    exit 1
  fi
  head -n 1 "$tmp/py.0.out" >&2
}

# The same flags for both sides (the trainer's defaults written out).
common_flags=(--seed 0 --global-batch 16 --optimizer adam --lr 3e-3 --lr-schedule cosine
              --warmup-steps 10 --layers 2 --dim 64 --heads 4 --vocab 256 --seq 64)
ddp_args=()
for model in transformer mlp; do
  n=$steps; [[ $model == mlp ]] && n=$mlp_steps
  mkdir -p "$tmp/$model"
  for ((r = 1; r <= rounds; r++)); do
    echo "== data parallel, $model, round $r/$rounds: $n steps per side" >&2
    # Rotate which side goes first, so none always runs on a warmer machine.
    sides=(ours defaults same)
    for ((k = 0; k < 3; k++)); do
      side=${sides[$(((k + r - 1) % 3))]}
      if [[ $side == ours ]]; then
        run_ours "$model" "$n" "$tmp/$model/ours.$r.jsonl"
      else
        run_python "$side" "$model" "$n" "$tmp/$model/py-$side.$r.jsonl"
      fi
    done
  done
  ddp_args+=(--ddp "DDP step, 2 ranks Gloo, $model" "$tmp/$model")
done

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
report=$("$PY" benchmarks/python/compare_report.py \
  --cpp-bench "$tmp/cpp_bench.json" --cpp-hessian "$tmp/cpp_hessian.json" \
  --py defaults "$tmp/py_bench.defaults.json" "$tmp/py_hessian.defaults.json" \
  --py same "$tmp/py_bench.same.json" "$tmp/py_hessian.same.json" \
  "${ddp_args[@]}" --warmup "$warmup" \
  --header "compare_pytorch: $(date -u '+%Y-%m-%d %H:%M UTC'), $cores cores, load average $(cut -d' ' -f1-3 /proc/loadavg), PyTorch $torch_version ($PY), $((SECONDS - start_s)) s of runs" \
  --header "Python 'defaults': reference BLAS (libblas3), glibc malloc, LibTorch's default threads; 'same': OpenBLAS ($(readlink -f $lib/libblas.so.3)), tcmalloc preloaded, OMP_NUM_THREADS=$cores (1 process) / $ddp_threads (each of 2 ranks), as ours" \
  --header "DDP flags (all sides): --data synthetic ${common_flags[*]}; --steps $steps (transformer) / $mlp_steps (mlp), $rounds round(s)")
echo
echo "$report"
if [[ -n "$out" ]]; then
  printf '%s\n' "$report" >"$out"
  echo "compare_pytorch.sh: wrote $out" >&2
fi
