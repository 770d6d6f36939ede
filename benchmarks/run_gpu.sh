#!/usr/bin/env bash
# The one script to run on a GPU machine (issue 36): builds the CUDA
# pieces, runs gpu_check, then our trainer against Python's FSDP peers on
# two model sizes, and writes everything to ${OUT:-/tmp/gpu_out}/gpu_report.txt
# (and prints it). One call, under 8 minutes on the lent H100/H200 (16
# cores): build ~2 min, gpu_check ~1 min, torch.func's functorch peers
# ~0.5 min, the benchmark ~4 min.
#
#   bash benchmarks/run_gpu.sh [--build-anyway] [--cmake] [--no-build]
#                              [--no-check] [--no-bench] [--no-toy]
#                              [--no-llama] [--cpu]
#
# --no-check skips gpu_check (and its build), --no-toy the toy model's
# FSDP peers and the out-of-memory check (5, 6), --no-llama the Llama
# shapes against TorchTitan (7).
# 1. No GPU (nvidia-smi fails, or the Python torch sees no CUDA device):
#    prints "NOT RUN: no GPU (<what was seen>)" and exits 77; with
#    --build-anyway it still builds first (to check the build here).
# 2. Build: `bazel build --config=cuda //benchmarks:gpu_check //:trainer`
#    when bazel is on PATH (unless --cmake), else CMake + ninja with
#    benchmarks/gpu/CMakeLists.txt into ${GPU_BUILD_DIR:-/tmp/gpu_build},
#    against the torch of $PYTHON (default: python3, else the project's
#    venv) and third_party/gpu_deps (tools/gpu_bundle.sh). JOBS=N limits
#    ninja's parallelism. --no-build reuses the binaries already built.
#    CMake's source lists are benchmarks/gpu/sources.cmake, generated from
#    the BUILD files (tools/gpu_cmake.py; regenerated here when stale).
# 3. gpu_check (one PASS/FAIL line per check; fsdp_step_no_sync runs an
#    FSDP step under CUDA's sync-debug mode error; functorch_per_sample_grads
#    and functorch_batched_hessians compare our functorch on the GPU with the
#    CPU and time it, median of 20 calls). Then torch.func's peers of those
#    two on the same device: the PerSampleGrad_VmapGrad case of
#    functorch/transforms/bench/functorch_reference_bench.py and the
#    Hessian_VmapJacfwdJacrev case of benchmarks/python/hessian_bench.py,
#    each --device cuda (synchronised after every call), --min-time 0.5,
#    --repetitions 3, bounded by FUNC_TIMEOUT (s per run, default 60) and
#    BUDGET_S; printed: ours (gpu_check's median) vs torch.func (median of
#    the 3 means) and torch.func/ours (> 1: ours is faster). Skipped with
#    --no-check or --no-bench.
# 4. The dense matmul peak of this GPU, measured now (bf16 8192^3).
# 5. Ours against the Python peers, interleaved per configuration: the
#    trainer (FSDP1, its default), the trainer with --fsdp fully_shard,
#    Python's fully_shard with AdamW fused=True and foreach=True and
#    FullyShardedDataParallel with fused=True (benchmarks/python/fsdp_step.py),
#    both trainer runs again; all bf16 parameters with fp32
#    reduction, SDPA causal attention, a world of 1. Configurations: 152M
#    (12 layers x 1024, 16 heads, seq 1024, global batch 16) and 408M (8
#    layers x 2048, 16 heads, seq 2048, global batch 16). Printed per run:
#    tokens/s (median over steps 6..BENCH_STEPS), its ratio to the best
#    Python run, MFU (6 N FLOP per token against the peak of step 4), and
#    the CUDA caching allocator's peak allocated / reserved bytes (ours:
#    --log-json's cuda_peak_*; Python's: torch.cuda.max_memory_*).
#    Environment: BENCH_STEPS (default 20), RUN_TIMEOUT (s per run, default
#    90), BUDGET_S (after this many seconds of the script no further run
#    starts, default 390: 390 + 90 < 8 min), BENCH_CONFIGS ("name|flags;name|flags").
#
# 6. Out of memory in a step: the 408M configuration with a batch that
#    cannot fit must exit with status 3 and a line naming the step and the
#    allocator's figures (GPU only).
#
# --cpu: the same pipeline on the CPU without a GPU, to test the script:
# no build (the binaries must exist: bazel build //:trainer
# //benchmarks:gpu_check, or --cmake's build directory), gpu_check
# --dry-run-on-cpu, a float32 CPU matmul as the "peak", and one tiny
# configuration (2 layers x 64, seq 64, batch 4, 8 steps) on Gloo.
#
# Exit status: 0 all ran and gpu_check passed; 1 a build, gpu_check or a
# benchmark run failed (or was skipped for time); 77 no GPU; 2 bad
# arguments.
#
# On the lent machine (the device tool), from a checkout here:
#   bash tools/gpu_bundle.sh        # once, on the Debian build machine
#   bash tools/fetch_gpu_peers.sh   # TorchTitan's wheels, likewise
#   run(carry=["third_party/gpu_deps", "third_party/gpu_peers"],
#       command="bash benchmarks/run_gpu.sh", timeout_s=540)
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
REPORT_DIR="${OUT:-/tmp/gpu_out}"
BUILD_DIR="${GPU_BUILD_DIR:-/tmp/gpu_build}"
NOMINAL_PEAK_TFLOPS=989  # H100 SXM dense bf16 (without sparsity)
SCRIPT_START=$(date +%s)
RUN_TIMEOUT="${RUN_TIMEOUT:-90}"
BUDGET_S="${BUDGET_S:-390}"
FUNC_TIMEOUT="${FUNC_TIMEOUT:-60}"
over_budget() { [ $(( $(date +%s) - SCRIPT_START )) -ge "$BUDGET_S" ]; }
BENCH_DEVICE=cuda

build_anyway=0
force_cmake=0
do_build=1
do_check=1
do_bench=1
do_toy=1
do_llama=1
cpu_mode=0
for arg in "$@"; do
  case "$arg" in
    --build-anyway) build_anyway=1 ;;
    --cmake) force_cmake=1 ;;
    --no-build) do_build=0 ;;
    --no-check) do_check=0 ;;
    --no-bench|--no-mfu) do_bench=0 ;;
    --no-toy) do_toy=0 ;;
    --no-llama) do_llama=0 ;;
    --cpu) cpu_mode=1 ;;
    -h|--help) sed -n '2,77p' "$0"; exit 0 ;;
    *) echo "run_gpu.sh: unknown argument '$arg' (--help lists them)" >&2; exit 2 ;;
  esac
done

if [ "$cpu_mode" = 1 ]; then
  BENCH_DEVICE=cpu
  do_build=0
  BENCH_STEPS="${BENCH_STEPS:-8}"
fi
BENCH_STEPS="${BENCH_STEPS:-20}"

mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_report.txt"
: > "$REPORT"
# Everything reported goes to the report and to stdout.
say() { printf '%s\n' "$*" | tee -a "$REPORT"; }

# The Python whose torch we build against and measure with.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c 'import torch' >/dev/null 2>&1; then
    venv="${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3"
    [ -x "$venv" ] && PYTHON="$venv"
  fi
fi

say "run_gpu.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores"
say "python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])' 2>&1))"

# ---- 1. Is there a GPU? ------------------------------------------------------
no_gpu=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  no_gpu="no nvidia-smi on PATH"
elif ! smi="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"; then
  no_gpu="nvidia-smi failed: $(printf '%s' "$smi" | head -c 200)"
else
  say "gpu: $smi"
fi
torch_line="$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1 | tail -1)"
say "torch: $torch_line"
if [ -z "$no_gpu" ]; then
  case "$torch_line" in
    *"devices 0"|*Error*|*error*) no_gpu="$PYTHON's torch sees no CUDA device: $torch_line" ;;
  esac
fi
if [ "$cpu_mode" = 1 ]; then
  say "--cpu: testing the script on the CPU${no_gpu:+ (no GPU: $no_gpu)}"
  no_gpu=""
elif [ -n "$no_gpu" ] && [ "$build_anyway" = 0 ]; then
  say "NOT RUN: no GPU ($no_gpu)"
  exit 77
fi

# ---- 2. Build ------------------------------------------------------------------
status=0
use_bazel=0
if [ "$force_cmake" = 0 ] && command -v bazel >/dev/null 2>&1; then use_bazel=1; fi
if [ "$use_bazel" = 1 ]; then
  GPU_CHECK="$ROOT/bazel-bin/benchmarks/gpu_check"
  TRAINER="$ROOT/bazel-bin/trainer/trainer"
else
  GPU_CHECK="$BUILD_DIR/gpu_check"
  TRAINER="$BUILD_DIR/trainer"
fi
build_log="$REPORT_DIR/build.log"
if [ "$do_build" = 1 ]; then
  start=$(date +%s)
  if [ "$use_bazel" = 1 ]; then
    bazel_targets=(//:trainer)
    [ "$do_check" = 1 ] && bazel_targets+=(//benchmarks:gpu_check)
    say "build: bazel build --config=cuda ${bazel_targets[*]}"
    (cd "$ROOT" && bazel build --config=cuda "${bazel_targets[@]}") > "$build_log" 2>&1
    rc=$?
  else
    rc=0
    torch_dir="$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)"
    deps="$ROOT/third_party/gpu_deps"
    if [ -z "$torch_dir" ]; then
      say "build: FAILED: $PYTHON cannot import torch (set PYTHON to a Python with a CUDA torch)"
      rc=1
    elif [ ! -f "$deps/include/absl/status/status.h" ]; then
      say "build: FAILED: $deps is missing or incomplete: run tools/gpu_bundle.sh on the Debian build machine and carry third_party/gpu_deps"
      rc=1
    elif ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
      say "build: FAILED: needs cmake and ninja on PATH (found: $(command -v cmake || echo no cmake), $(command -v ninja || echo no ninja))"
      rc=1
    else
      jobs="${JOBS:-$(nproc)}"
      # gpu_check only when it runs: --no-check saves its build.
      ninja_targets=(trainer)
      [ "$do_check" = 1 ] && ninja_targets+=(gpu_check)
      # The source lists come from the BUILD files (tools/gpu_cmake.py): when
      # the committed benchmarks/gpu/sources.cmake is stale, build from a
      # fresh one rather than fail at link time on the GPU machine.
      mkdir -p "$BUILD_DIR"
      sources="$ROOT/benchmarks/gpu/sources.cmake"
      if ! "$PYTHON" "$ROOT/tools/gpu_cmake.py" --check > "$BUILD_DIR/gpu_cmake_check.log" 2>&1; then
        if "$PYTHON" "$ROOT/tools/gpu_cmake.py" > "$BUILD_DIR/sources.cmake" 2>> "$BUILD_DIR/gpu_cmake_check.log"; then
          sources="$BUILD_DIR/sources.cmake"
          say "build: benchmarks/gpu/sources.cmake differs from the BUILD files (//tools:gpu_cmake_test fails; python3 tools/gpu_cmake.py --write fixes it): building from a fresh copy"
        else
          say "build: tools/gpu_cmake.py failed (see $BUILD_DIR/gpu_cmake_check.log): building from the committed sources.cmake"
        fi
      fi
      say "build: cmake + ninja -j$jobs into $BUILD_DIR, TORCH_DIR=$torch_dir, GPU_DEPS=$deps"
      {
        cmake -S "$ROOT/benchmarks/gpu" -B "$BUILD_DIR" -G Ninja \
          -DTORCH_DIR="$torch_dir" -DGPU_DEPS="$deps" -DTORCHFSDP_SOURCES="$sources" &&
        ninja -C "$BUILD_DIR" -j"$jobs" "${ninja_targets[@]}"
      } > "$build_log" 2>&1
      rc=$?
    fi
  fi
  elapsed=$(( $(date +%s) - start ))
  if [ "$rc" != 0 ]; then
    say "build: FAILED (exit $rc) after ${elapsed} s; the end of $build_log:"
    tail -n 40 "$build_log" | tee -a "$REPORT"
    exit 1
  fi
  say "build: done in ${elapsed} s ($GPU_CHECK, $TRAINER)"
fi
built=("$TRAINER")
[ "$do_check" = 1 ] && built+=("$GPU_CHECK")
for binary in "${built[@]}"; do
  if [ ! -x "$binary" ]; then
    say "build: $binary does not exist (run without --no-build)"
    exit 1
  fi
  # Every library a CMake-built binary loads must be found without
  # LD_LIBRARY_PATH (the wheel and the bundle are on its DT_RPATH).
  missing=""
  if [ "$use_bazel" = 0 ]; then
    missing="$(LD_LIBRARY_PATH='' ldd "$binary" 2>&1 | grep 'not found')"
  fi
  if [ -n "$missing" ]; then
    say "build: $binary cannot start: the loader does not find:"
    say "$missing"
    exit 1
  fi
done

if [ -n "$no_gpu" ]; then
  # --build-anyway without a GPU: the build was the point.
  say "NOT RUN: no GPU ($no_gpu)"
  exit 77
fi

# ---- 3. gpu_check ----------------------------------------------------------------
if [ "$do_check" = 1 ]; then
  say ""
  say "== gpu_check"
  check_args=()
  [ "$cpu_mode" = 1 ] && check_args=(--dry-run-on-cpu)
  # Bounded (CHECK_TIMEOUT, default 180 s): a hung collective must not eat the
  # machine's time.
  timeout "${CHECK_TIMEOUT:-180}" "$GPU_CHECK" "${check_args[@]}" > "$REPORT_DIR/gpu_check.log" 2>&1
  rc=$?
  # The PASS/FAIL/NOT RUN lines and the summary; the full output is in gpu_check.log.
  grep -E '^(PASS|FAIL|NOT RUN|gpu_check)' "$REPORT_DIR/gpu_check.log" | tee -a "$REPORT"
  say "gpu_check: exit status $rc"
  if [ "$rc" != 0 ]; then
    status=1
    say "the end of gpu_check.log:"
    tail -n 30 "$REPORT_DIR/gpu_check.log" | tee -a "$REPORT"
  fi
fi

# ---- 3b. Our functorch against torch.func on the device -------------------------
if [ "$do_check" = 1 ] && [ "$do_bench" = 1 ]; then
  say ""
  say "== functorch on $BENCH_DEVICE: ours (gpu_check) against torch.func"
  func_dir="$REPORT_DIR/functorch"
  mkdir -p "$func_dir"
  func_run() {  # $1: stem, then the script and its arguments
    local stem="$1"
    shift
    rm -f "$func_dir/$stem.json"
    if over_budget; then
      say "torch.func $stem: SKIPPED (the script has run ${BUDGET_S} s, BUDGET_S)"
      status=1
      return
    fi
    local t0
    t0=$(date +%s)
    timeout "$FUNC_TIMEOUT" "$PYTHON" "$@" --device "$BENCH_DEVICE" --min-time 0.5 \
      --repetitions 3 --json "$func_dir/$stem.json" > "$func_dir/$stem.log" 2>&1
    local rc=$?
    if [ "$rc" != 0 ]; then
      status=1
      say "torch.func $stem: FAILED (exit $rc$([ "$rc" = 124 ] && echo ", FUNC_TIMEOUT=${FUNC_TIMEOUT} s")); the end of $stem.log:"
      tail -n 8 "$func_dir/$stem.log" | tee -a "$REPORT"
    else
      say "torch.func $stem: $(( $(date +%s) - t0 )) s ($(grep -m 1 "^torch " "$func_dir/$stem.log"))"
    fi
  }
  func_run per_sample_grads "$ROOT/functorch/transforms/bench/functorch_reference_bench.py" \
    --filter '^PerSampleGrad_VmapGrad$'
  func_run batched_hessians "$ROOT/benchmarks/python/hessian_bench.py" \
    --filter '^Hessian_VmapJacfwdJacrev$'
  # Ours: the "median X ms" of gpu_check's PASS lines.
  "$PYTHON" - "$REPORT_DIR/gpu_check.log" "$func_dir" <<'EOF' 2>&1 | tee -a "$REPORT"
import json, os, re, sys
log, func_dir = sys.argv[1], sys.argv[2]
text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
cases = [("per-sample grads: vmap(grad), MLP 128-256-10, batch 256", "functorch_per_sample_grads",
          "per_sample_grads", "PerSampleGrad_VmapGrad"),
         ("Hessians: vmap(jacfwd(jacrev)), 2-512-512-512-3, 1024 pts",
          "functorch_batched_hessians", "batched_hessians", "Hessian_VmapJacfwdJacrev")]
missing = False
for label, check, stem, case in cases:
    m = re.search(r"^PASS %s .* median ([0-9.]+) ms of (\d+) calls" % check, text, re.M)
    ours = float(m.group(1)) if m else None
    theirs = None
    try:
        with open(os.path.join(func_dir, stem + ".json"), encoding="utf-8") as f:
            theirs = json.load(f)["cases"][case]["wall_s"] * 1e3
    except (OSError, KeyError, ValueError):
        pass
    ours_s = f"{ours:9.3f} ms" if ours is not None else "(no PASS line)"
    theirs_s = f"{theirs:9.3f} ms" if theirs is not None else "(no result)"
    ratio = (f"torch.func/ours {theirs / ours:5.2f}x"
             if ours is not None and theirs is not None and ours > 0 else "no ratio")
    missing |= ours is None or theirs is None
    print(f"  {label:58s} ours {ours_s}  torch.func {theirs_s}  {ratio}")
print("  (ours: median of gpu_check's timed calls; torch.func: median of 3 means over"
      " >= 0.5 s each; both synchronise the device after every call; > 1x: ours is faster)")
sys.exit(1 if missing else 0)
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

# ---- 4. The matmul peak ------------------------------------------------------------
peak=0
if [ "$do_bench" = 1 ]; then
  say ""
  say "== peak"
  # The dense peak of this device now: the best of 5 timings of 20 n^3
  # matmuls each (after warm-up); bf16 8192^3 with CUDA events on the GPU,
  # float32 512^3 on the CPU (--cpu: only so the MFU column has a scale).
  peak_out="$("$PYTHON" - "$BENCH_DEVICE" <<'EOF' 2>&1
import sys, time, torch
device = sys.argv[1]
cuda = device == "cuda"
n = 8192 if cuda else 512
dtype = torch.bfloat16 if cuda else torch.float32
a = torch.randn(n, n, device=device, dtype=dtype)
b = torch.randn(n, n, device=device, dtype=dtype)
for _ in range(5):
    torch.matmul(a, b)
if cuda:
    torch.cuda.synchronize()
best = 0.0
for _ in range(5):
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    for _ in range(20):
        torch.matmul(a, b)
    if cuda:
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    best = max(best, 2 * n**3 * 20 / seconds / 1e12)
name = torch.cuda.get_device_name(0) if cuda else "the CPU, float32"
print(f"PEAK {best:.3f} {n}^3 on {name}")
EOF
)"
  peak="$(printf '%s\n' "$peak_out" | awk '/^PEAK/ {print $2}')"
  if [ -z "$peak" ]; then
    say "peak: FAILED: $(printf '%s' "$peak_out" | tail -n 5)"
    status=1
    peak=0
  else
    say "peak: torch.matmul $(printf '%s\n' "$peak_out" | sed -n 's/^PEAK [^ ]* //p') = $peak TFLOP/s (H100 SXM nominal bf16: $NOMINAL_PEAK_TFLOPS)"
  fi
fi

# One benchmark run: bounded by RUN_TIMEOUT, skipped once the script has
# run BUDGET_S seconds; its --log-json path is added to runs[] for the table.
run_one() {  # $1: label, $2: log file stem, then the command; returns its exit status
  local label="$1" stem="$2"
  shift 2
  rm -f "$bench_dir/$stem.jsonl"
  if over_budget; then
    say "$label: SKIPPED (the script has run ${BUDGET_S} s, BUDGET_S)"
    status=1
    return 0
  fi
  say "$label: $*"
  local t0
  t0=$(date +%s)
  timeout "$RUN_TIMEOUT" "$@" > "$bench_dir/$stem.log" 2>&1
  local rc=$?
  if [ "$rc" != 0 ]; then
    status=1
    say "$label: FAILED (exit $rc$([ "$rc" = 124 ] && echo ", RUN_TIMEOUT=${RUN_TIMEOUT} s")); the end of $stem.log:"
    tail -n 8 "$bench_dir/$stem.log" | tee -a "$REPORT"
  else
    say "$label: $(( $(date +%s) - t0 )) s"
  fi
  runs+=("$label=$bench_dir/$stem.jsonl")
  return "$rc"
}

# Our trainer, under its default --cuda-graphs auto (the step captured
# where it can be). The capture had never run on a GPU when this was
# written: a run that fails is run once more eagerly (--cuda-graphs off,
# label and log stem with _eager), so the comparison still has our figure;
# the failure stays in the report.
run_ours() {  # as run_one
  local label="$1" stem="$2"
  shift 2
  run_one "$label" "$stem" "$@" && return 0
  [ "$BENCH_DEVICE" = cuda ] || return 1
  local args=() arg
  for arg in "$@"; do
    [ "$arg" = "$bench_dir/$stem.jsonl" ] && arg="$bench_dir/${stem}_eager.jsonl"
    args+=("$arg")
  done
  run_one "${label}_eager" "${stem}_eager" "${args[@]}" --cuda-graphs off
}

# ---- 5. Ours against Python's FSDP peers, interleaved ----------------------------
# Per configuration: ours (FSDP1, then --fsdp fully_shard), Python's
# fully_shard (FSDP2) with AdamW(fused=True) and AdamW(foreach=True),
# FullyShardedDataParallel (FSDP1) with AdamW(fused=True), then both of
# ours again. Every run is one process on one GPU
# (a world of 1 on NCCL), bf16 parameters with fp32 gradient reduction,
# FULL_SHARD with one unit per block, SDPA causal attention, AdamW (lr 3e-3,
# weight decay 0.01, cosine after 10 warm-up steps), synthetic tokens,
# BENCH_STEPS steps; tokens/s is the median over the steps after the 5th
# (benchmarks/python/gpu_report.py, which prints the table). Each run is
# bounded by RUN_TIMEOUT seconds, and once the script has run BUDGET_S
# seconds the remaining runs are skipped (and said so), so that one call
# stays within the lent machine's 8 minutes.
if [ "$do_bench" = 1 ] && [ "$do_toy" = 1 ]; then
  bench_dir="$REPORT_DIR/bench"
  mkdir -p "$bench_dir"
  if [ "$BENCH_DEVICE" = cuda ]; then
    configs=("152M|--layers 12 --dim 1024 --heads 16 --seq 1024 --global-batch 16 --vocab 256"
             "408M|--layers 8 --dim 2048 --heads 16 --seq 2048 --global-batch 16 --vocab 256")
  else
    configs=("tiny-cpu|--layers 2 --dim 64 --heads 4 --seq 64 --global-batch 4 --vocab 256")
  fi
  # BENCH_CONFIGS="name|flags;name|flags" replaces them.
  if [ -n "${BENCH_CONFIGS:-}" ]; then IFS=';' read -r -a configs <<< "$BENCH_CONFIGS"; fi
  py_variants=("fully_shard|fsdp2|fused" "fully_shard|fsdp2|foreach"
               "FullyShardedDataParallel|fsdp1|fused")
  # A launcher's variables would make the trainer and the Python peer join
  # a world: each runs as a lone process.
  unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
  for config in "${configs[@]}"; do
    name="${config%%|*}"
    read -r -a model_flags <<< "${config#*|}"
    say ""
    say "== $name: ${model_flags[*]}, bf16 parameters, fp32 reduction, AdamW, $BENCH_STEPS steps"
    runs=()
    ours=("$TRAINER" --device "$BENCH_DEVICE" --nproc 1 --mixed-precision bf16
          --model transformer --data synthetic --optimizer adamw "${model_flags[@]}"
          --steps "$BENCH_STEPS")
    run_ours ours1 "${name}_ours1" "${ours[@]}" --log-json "$bench_dir/${name}_ours1.jsonl"
    run_ours ours_fully_shard1 "${name}_ours_fully_shard1" "${ours[@]}" --fsdp fully_shard \
      --log-json "$bench_dir/${name}_ours_fully_shard1.jsonl"
    for variant in "${py_variants[@]}"; do
      IFS='|' read -r what kind impl <<< "$variant"
      run_one "py:$what/$impl" "${name}_${kind}_$impl" \
        "$PYTHON" "$ROOT/benchmarks/python/fsdp_step.py" --fsdp "$kind" --device "$BENCH_DEVICE" \
        --mixed-precision bf16 --model transformer --optimizer adamw --optimizer-impl "$impl" \
        "${model_flags[@]}" --steps "$BENCH_STEPS" --log-json "$bench_dir/${name}_${kind}_$impl.jsonl"
    done
    run_ours ours2 "${name}_ours2" "${ours[@]}" --log-json "$bench_dir/${name}_ours2.jsonl"
    run_ours ours_fully_shard2 "${name}_ours_fully_shard2" "${ours[@]}" --fsdp fully_shard \
      --log-json "$bench_dir/${name}_ours_fully_shard2.jsonl"
    # N from the trainer's first line (both runs print the same).
    params="$(cat "$bench_dir/${name}_ours1.log" "$bench_dir/${name}_ours2.log" 2>/dev/null |
              sed -n 's/^trainer: [a-z]*, \([0-9]*\) parameters.*/\1/p' | head -1)"
    if [ -z "$params" ]; then
      say "$name: no parameter count (no trainer run started): no table"
      status=1
      continue
    fi
    say ""
    "$PYTHON" "$ROOT/benchmarks/python/gpu_report.py" --title "$name" --params "$params" \
      --peak-tflops "$peak" "${runs[@]}" | tee -a "$REPORT"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi

# ---- 6. Out of memory in a step (issue 36, item 4) -------------------------------
# The 408M configuration with a global batch of 512 sequences of 2048: its
# activations do not fit in the GPU's memory, the parameters do. Expected:
# exit status 3 and one line "step 1: out of memory on cuda:0 ..." naming
# the allocator's figures (trainer/train.cc), no abort.
if [ "$do_bench" = 1 ] && [ "$do_toy" = 1 ] && [ "$BENCH_DEVICE" = cuda ]; then
  say ""
  say "== out of memory in a step"
  if over_budget; then
    say "oom: SKIPPED (the script has run ${BUDGET_S} s, BUDGET_S)"
  else
    oom_log="$REPORT_DIR/oom.log"
    timeout 60 "$TRAINER" --device cuda --nproc 1 --mixed-precision bf16 --model transformer \
      --data synthetic --optimizer adamw --layers 8 --dim 2048 --heads 16 --seq 2048 \
      --global-batch 512 --vocab 256 --steps 2 > "$oom_log" 2>&1
    rc=$?
    oom_line="$(grep -m 1 'out of memory' "$oom_log")"
    if [ "$rc" = 3 ] && [ -n "$oom_line" ]; then
      say "oom: PASS exit status 3: $oom_line"
    else
      status=1
      say "oom: FAIL exit status $rc (expected 3 with an 'out of memory' line); the end of oom.log:"
      tail -n 8 "$oom_log" | tee -a "$REPORT"
    fi
  fi
fi

# ---- 7. Llama shapes: ours against TorchTitan, interleaved (issue 47) ------
# Per shape (a Hugging Face config.json of benchmarks/llama/, untied and with
# Llama 3's rope scaling, as TorchTitan's llama3 is): our trainer
# (--model llama, fully_shard, bf16 parameters, fp32 reduction), then
# TorchTitan 0.2.2 (benchmarks/torchtitan/titan_peer.py: its own llama3
# Transformer and train loop, fp32 parameters under bf16 autocast on one
# GPU, fused AdamW) in the variants of the shape's list, then ours again.
# Both: the trainer's synthetic tokens for --seed 0 (the same tokens at
# every step), the same global batch and sequence, AdamW (lr 3e-4, betas
# 0.9/0.999, weight decay 0.01, 10 warm-up steps then constant), gradient
# clipping at 1.0, LLAMA_STEPS steps. A variant is MODE:AC, MODE one of
# eager, compile (--compile.enable), compile_float8 (+ --model.converters
# quantize.linear.float8, the output projection left out, as TorchTitan's
# Llama 3 recipes do), AC none or selective (per-op). Printed per shape:
# gpu_report.py's table (median tokens/s over the steps after the 5th, MFU by
# TorchTitan's formula against the peak of step 4, the step's peak
# allocated/reserved bytes, the final loss; on CUDA also ours with --float8
# before the second run of ours), then the profile of one step
# (our first run's step PROFILE_STEP, TorchTitan's first compile_float8
# run's) by kernel class (benchmarks/python/profile_table.py).
# LLAMA_SHAPES="name|config|global batch|seq|variant variant ...;..." replaces
# the shapes. The final losses are set against TorchTitan's runs' range
# (gpu_report.py's SUMMARY ... final loss). Each side initialises the model
# its own way unless LLAMA_SAME_INIT=1: then both start from one checkpoint,
# TorchTitan's initialisation for --seed 0 written as a Hugging Face
# checkpoint (titan_peer.py --write-hf, on the CPU), ours through
# --hf-checkpoint, TorchTitan's through titan_peer.py --init-hf, so the
# losses are comparable step by step. Issue 47's 200-step comparison of the
# losses (bf16 ours and TorchTitan, and --float8) is this part alone with
# more steps, e.g. LLAMA_SAME_INIT=1 LLAMA_STEPS=200 LLAMA_SHAPES="8x2048|
# benchmarks/llama/llama_8x2048_config.json|8|2048|eager:none
# compile_float8:none" bash benchmarks/run_gpu.sh --no-check --no-toy
# (about 6 minutes). --cpu always checks the same-weights path: the first
# batch's float32 loss of ours from the checkpoint (one step on the CPU)
# against TorchTitan's model on the same weights (titan_peer.py --dry-run
# --init-hf), within 1e-5 relative. --cpu: one tiny shape; TorchTitan is only checked (--dry-run:
# its arguments, model and data), as it cannot train without a GPU.
if [ "$do_bench" = 1 ] && [ "$do_llama" = 1 ]; then
  llama_dir="$REPORT_DIR/llama"
  mkdir -p "$llama_dir"
  LLAMA_STEPS="${LLAMA_STEPS:-$([ "$cpu_mode" = 1 ] && echo 6 || echo 15)}"
  PROFILE_STEP="${PROFILE_STEP:-$([ "$cpu_mode" = 1 ] && echo 4 || echo 10)}"
  TITAN_TIMEOUT="${TITAN_TIMEOUT:-180}"
  # TorchTitan's wheels (tools/fetch_gpu_peers.sh), unpacked into a private
  # folder on PYTHONPATH: nothing is installed into the machine's Python.
  titan_site="${TITAN_SITE:-/tmp/titan_site}"
  peers="$ROOT/third_party/gpu_peers"
  titan_ok=0
  if ls "$peers"/torchtitan-*.whl > /dev/null 2>&1; then
    rm -rf "$titan_site"
    mkdir -p "$titan_site"
    titan_ok=1
    for wheel in "$peers"/*.whl; do
      "$PYTHON" -m zipfile -e "$wheel" "$titan_site" || titan_ok=0
    done
    [ "$titan_ok" = 1 ] || say "llama: unpacking $peers into $titan_site failed: ours only"
  else
    say "llama: no TorchTitan wheels in $peers (bash tools/fetch_gpu_peers.sh, then carry third_party/gpu_peers): ours only"
  fi
  [ "$titan_ok" = 1 ] || status=1
  llama_cfg="$ROOT/benchmarks/llama"
  if [ "$BENCH_DEVICE" = cuda ]; then
    # Most telling first: the budget (BUDGET_S) cuts the tail.
    shapes=("1b|$llama_cfg/llama32_1b_untied_config.json|8|2048|compile_float8:none eager:none compile:none compile_float8:selective"
            "8x2048|$llama_cfg/llama_8x2048_config.json|8|2048|compile_float8:none eager:none compile:none"
            "3b|$llama_cfg/llama32_3b_untied_config.json|4|2048|compile_float8:selective compile_float8:none")
  else
    shapes=("tiny-cpu|$llama_cfg/small_config.json|4|64|eager:none compile:none compile_float8:selective")
  fi
  if [ -n "${LLAMA_SHAPES:-}" ]; then IFS=';' read -r -a shapes <<< "$LLAMA_SHAPES"; fi
  unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
  bench_dir="$llama_dir"
  for shape in "${shapes[@]}"; do
    IFS='|' read -r name config batch seq variants <<< "$shape"
    say ""
    say "== llama $name: $(basename "$config"), global batch $batch x seq $seq, $LLAMA_STEPS steps"
    runs=()
    titan=(env PYTHONPATH="$titan_site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON"
           "$ROOT/benchmarks/torchtitan/titan_peer.py" --hf-config "$config" --seed 0)
    # The model's shape (and, with the same initialisation, its weights).
    model_flags=(--model-config "$config")
    init_dir=""
    if [ "${LLAMA_SAME_INIT:-0}" = 1 ] || [ "$cpu_mode" = 1 ]; then
      init_dir="$bench_dir/${name}_init"
      if [ "$titan_ok" = 1 ] && "${titan[@]}" --write-hf "$init_dir" > "$bench_dir/${name}_init.log" 2>&1; then
        say "$(grep -m 1 '^titan: wrote' "$bench_dir/${name}_init.log")"
        [ "${LLAMA_SAME_INIT:-0}" = 1 ] && model_flags=(--hf-checkpoint "$init_dir")
        titan+=(--init-hf "$init_dir")
      else
        say "llama $name: no common initialisation (titan_peer.py --write-hf; the end of ${name}_init.log):"
        tail -n 5 "$bench_dir/${name}_init.log" 2>/dev/null | tee -a "$REPORT"
        init_dir=""
        status=1
      fi
    fi
    if [ "$cpu_mode" = 1 ] && [ -n "$init_dir" ]; then
      # The same weights give the same first loss: ours in float32 on the
      # CPU against TorchTitan's model (its dry run computes it).
      "$TRAINER" --device cpu --nproc 1 --model llama --hf-checkpoint "$init_dir" --data synthetic \
        --seed 0 --seq "$seq" --global-batch "$batch" --steps 1 \
        --log-json "$bench_dir/${name}_same_init_ours.jsonl" > "$bench_dir/${name}_same_init_ours.log" 2>&1
      "${titan[@]}" --dry-run -- --training.local_batch_size "$batch" --training.seq_len "$seq" \
        --model.hf_assets_path "$llama_dir" > "$bench_dir/${name}_same_init_titan.log" 2>&1
      if "$PYTHON" - "$bench_dir/${name}_same_init_ours.jsonl" "$bench_dir/${name}_same_init_titan.log" <<'PY' | tee -a "$REPORT"; [ "${PIPESTATUS[0]}" = 0 ]; then :; else status=1; fi
import json, re, sys
try:
    ours = json.loads(open(sys.argv[1]).readline())["loss"]
    titan = float(re.search(r"^titan: step-1 loss (\S+)", open(sys.argv[2]).read(), re.M).group(1))
except Exception as e:  # a run that failed: its log says why
    print(f"same weights: FAILED ({e!r}; see {sys.argv[1]} and {sys.argv[2]})")
    sys.exit(1)
rel = abs(ours - titan) / abs(titan)
print(f"same weights: the first batch's float32 loss, ours {ours:.9g}, TorchTitan {titan:.9g}: "
      f"relative difference {rel:.2e} ({'OK' if rel <= 1e-5 else 'FAILED'}: at most 1e-5)")
sys.exit(0 if rel <= 1e-5 else 1)
PY
    fi
    ours=("$TRAINER" --device "$BENCH_DEVICE" --nproc 1 --model llama "${model_flags[@]}"
          --fsdp fully_shard --mixed-precision bf16 --data synthetic --seed 0 --seq "$seq"
          --global-batch "$batch" --optimizer adamw --lr 3e-4 --lr-schedule constant
          --warmup-steps 10 --clip 1.0 --steps "$LLAMA_STEPS")
    titan_common=(--training.local_batch_size "$batch" --training.seq_len "$seq"
                  --training.steps "$LLAMA_STEPS" --training.max_norm 1.0
                  --optimizer.lr 3e-4 --optimizer.beta2 0.999 --optimizer.weight_decay 0.01
                  --optimizer.implementation fused --lr_scheduler.warmup_steps 10
                  --lr_scheduler.decay_ratio 0.0 --metrics.disable_color_printing
                  --model.hf_assets_path "$llama_dir")
    run_one ours_fully_shard1 "${name}_ours1" "${ours[@]}" --log-json "$bench_dir/${name}_ours1.jsonl" \
      --profile-step "$PROFILE_STEP" --profile-trace "$bench_dir/${name}_ours_profile.json"
    titan_profiled=""
    for variant in $variants; do
      mode="${variant%%:*}"
      ac="${variant#*:}"
      flags=(--activation_checkpoint.mode "$ac" --job.dump_folder "$bench_dir/${name}_titan_${mode}_$ac")
      [ "$ac" = selective ] && flags+=(--activation_checkpoint.selective_ac_option op)
      case "$mode" in
        eager) ;;
        compile) flags+=(--compile.enable) ;;
        compile_float8) flags+=(--compile.enable --model.converters quantize.linear.float8
                                --quantize.linear.float8.filter_fqns output) ;;
        *) say "llama: variant '$variant': expected eager, compile or compile_float8 before ':'"; status=1; continue ;;
      esac
      if [ "$mode" = compile_float8 ] && [ -z "$titan_profiled" ]; then
        titan_profiled="$bench_dir/${name}_titan_${mode}_$ac/profile_traces/iteration_$PROFILE_STEP"
        flags+=(--profiling.enable_profiling --profiling.save_traces_folder profile_traces
                --profiling.profile_freq "$PROFILE_STEP" --profiling.profiler_warmup 1
                --profiling.profiler_active 1)
      fi
      if [ "$titan_ok" != 1 ]; then continue; fi
      if [ "$BENCH_DEVICE" = cpu ]; then
        # No GPU: TorchTitan cannot train; check what it would run.
        dry_log="$bench_dir/${name}_titan_${mode}_${ac}_dry.log"
        if "${titan[@]}" --dry-run -- "${titan_common[@]}" "${flags[@]}" > "$dry_log" 2>&1; then
          say "titan:$mode/$ac: --dry-run: $(grep -m 1 '^titan:' "$dry_log"), DRY RUN OK"
        else
          status=1
          say "titan:$mode/$ac: --dry-run FAILED; the end of $dry_log:"
          tail -n 8 "$dry_log" | tee -a "$REPORT"
        fi
        continue
      fi
      RUN_TIMEOUT="$TITAN_TIMEOUT" run_one "py:titan/$mode/$ac" "${name}_titan_${mode}_$ac" \
        "${titan[@]}" --log-json "$bench_dir/${name}_titan_${mode}_$ac.jsonl" -- \
        "${titan_common[@]}" "${flags[@]}"
    done
    # --float8 where the GPU has float8 matrix products (the trainer refuses
    # otherwise, naming why: the run then shows FAILED with that line).
    [ "$BENCH_DEVICE" = cuda ] && run_ours ours_float8 "${name}_ours_float8" "${ours[@]}" --float8 \
      --log-json "$bench_dir/${name}_ours_float8.jsonl"
    # The second run of ours is the CUDA-graph one (--cuda-graphs auto; the
    # first's --profile-step keeps it eager).
    run_ours ours_fully_shard2 "${name}_ours2" "${ours[@]}" --log-json "$bench_dir/${name}_ours2.jsonl"
    params="$(cat "$bench_dir/${name}_ours1.log" "$bench_dir/${name}_ours2.log" 2>/dev/null |
              sed -n 's/^trainer: [a-z]*, \([0-9]*\) parameters.*/\1/p' | head -1)"
    if [ -z "$params" ]; then
      say "llama $name: no parameter count (no trainer run started): no table"
      status=1
      continue
    fi
    # TorchTitan's FLOP per token: 6 (N - the embedding's) + 12 L H Dh T.
    flops="$("$PYTHON" -c '
import json, sys
c = json.load(open(sys.argv[1])); n = int(sys.argv[2]); t = int(sys.argv[3])
h = c["num_attention_heads"]; dh = c["hidden_size"] // h
print(6 * (n - c["vocab_size"] * c["hidden_size"]) + 12 * c["num_hidden_layers"] * h * dh * t)' \
      "$config" "$params" "$seq")"
    say ""
    "$PYTHON" "$ROOT/benchmarks/python/gpu_report.py" --title "llama $name" --params "$params" \
      --flops-per-token "$flops" --peak-tflops "$peak" "${runs[@]}" | tee -a "$REPORT"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    # The profile of one step, ours beside TorchTitan's best-guess variant.
    traces=()
    [ -f "$bench_dir/${name}_ours_profile.json" ] && traces+=(--trace "ours=$bench_dir/${name}_ours_profile.json")
    titan_trace=""
    # (Only a compile_float8 variant is profiled: none ran, no trace.)
    [ -n "$titan_profiled" ] && titan_trace="$(ls "$titan_profiled"/*.json* 2>/dev/null | head -1)"
    [ -n "$titan_trace" ] && traces+=(--trace "titan=$titan_trace")
    if [ "${#traces[@]}" -gt 0 ]; then
      say ""
      say "== llama $name: one step's time by kernel class"
      "$PYTHON" "$ROOT/benchmarks/python/profile_table.py" "${traces[@]}" \
        --json "$bench_dir/${name}_profile_table.json" 2>&1 | tee -a "$REPORT"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    else
      say "llama $name: no profile trace (ours: ${name}_ours1.log; TorchTitan: $titan_profiled)"
      status=1
    fi
  done
fi

say ""
say "run_gpu.sh: report in $REPORT (exit status $status)"
exit "$status"
