#!/usr/bin/env bash
# The one script to run on a GPU machine: builds the CUDA pieces, runs
# //benchmarks:gpu_check and measures the trainer's MFU, and writes
# everything to ${OUT:-/tmp/gpu_out}/gpu_report.txt (and prints it).
#
#   bash benchmarks/run_gpu.sh [--build-anyway] [--cmake] [--no-build]
#                              [--no-check] [--no-mfu]
#
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
# 3. gpu_check (one PASS/FAIL line per check).
# 4. MFU: the trainer (--device cuda --nproc 1 --mixed-precision bf16, a
#    12-layer, 1024-wide transformer, seq 1024, global batch 16, 30 steps,
#    --log-json) against the bf16 dense matmul peak measured in the same run
#    (8192^3 torch.matmul, CUDA events) and against the H100's nominal
#    989 TFLOP/s. MFU_ARGS overrides the model flags.
#
# Exit status: 0 all ran and gpu_check passed; 1 a build, gpu_check or the
# MFU run failed; 77 no GPU; 2 bad arguments.
#
# On the lent machine (the device tool), from a checkout here:
#   bash tools/gpu_bundle.sh      # once, on the Debian build machine
#   run(carry=["third_party/gpu_deps"], command="bash benchmarks/run_gpu.sh")
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
REPORT_DIR="${OUT:-/tmp/gpu_out}"
BUILD_DIR="${GPU_BUILD_DIR:-/tmp/gpu_build}"
NOMINAL_PEAK_TFLOPS=989  # H100 SXM dense bf16 (without sparsity)

build_anyway=0
force_cmake=0
do_build=1
do_check=1
do_mfu=1
for arg in "$@"; do
  case "$arg" in
    --build-anyway) build_anyway=1 ;;
    --cmake) force_cmake=1 ;;
    --no-build) do_build=0 ;;
    --no-check) do_check=0 ;;
    --no-mfu) do_mfu=0 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "run_gpu.sh: unknown argument '$arg' (--help lists them)" >&2; exit 2 ;;
  esac
done

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
if [ -n "$no_gpu" ] && [ "$build_anyway" = 0 ]; then
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
    say "build: bazel build --config=cuda //benchmarks:gpu_check //:trainer"
    (cd "$ROOT" && bazel build --config=cuda //benchmarks:gpu_check //:trainer) > "$build_log" 2>&1
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
        ninja -C "$BUILD_DIR" -j"$jobs" gpu_check trainer
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
for binary in "$GPU_CHECK" "$TRAINER"; do
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
  "$GPU_CHECK" > "$REPORT_DIR/gpu_check.log" 2>&1
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

# ---- 4. MFU ----------------------------------------------------------------------
if [ "$do_mfu" = 1 ]; then
  say ""
  say "== MFU"
  # The bf16 dense peak of this GPU now: the best of 5 timings of 20
  # 8192^3 matmuls each (after warm-up), with CUDA events.
  peak_out="$("$PYTHON" - <<'EOF' 2>&1
import torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    torch.matmul(a, b)
torch.cuda.synchronize()
best = 0.0
for _ in range(5):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    best = max(best, 2 * n**3 * 20 / seconds / 1e12)
print(f"PEAK {best:.1f} {torch.cuda.get_device_name(0)}")
EOF
)"
  peak="$(printf '%s\n' "$peak_out" | awk '/^PEAK/ {print $2}')"
  if [ -z "$peak" ]; then
    say "peak: FAILED: $(printf '%s' "$peak_out" | tail -n 5)"
    status=1
  else
    say "peak: bf16 torch.matmul 8192^3 = $peak TFLOP/s on $(printf '%s\n' "$peak_out" | awk '/^PEAK/ {$1=$2=""; print substr($0,3)}') (nominal $NOMINAL_PEAK_TFLOPS)"
  fi

  model_args="${MFU_ARGS:---layers 12 --dim 1024 --heads 16 --seq 1024 --global-batch 16}"
  log_json="$REPORT_DIR/trainer_mfu.jsonl"
  rm -f "$log_json"
  read -r -a model_flags <<< "$model_args"
  cmd=("$TRAINER" --device cuda --nproc 1 --mixed-precision bf16 --model transformer
       --data synthetic "${model_flags[@]}" --steps 30 --log-json "$log_json")
  say "trainer: ${cmd[*]}"
  "${cmd[@]}" > "$REPORT_DIR/trainer_mfu.log" 2>&1
  rc=$?
  if [ "$rc" != 0 ]; then
    status=1
    say "trainer: FAILED (exit $rc); the end of trainer_mfu.log:"
    tail -n 20 "$REPORT_DIR/trainer_mfu.log" | tee -a "$REPORT"
  else
    grep -E '^trainer: (transformer|compute)' "$REPORT_DIR/trainer_mfu.log" | tee -a "$REPORT"
    # Parameters from the trainer's first line; tokens/s: the median over
    # steps 6..30 (the first steps include cuBLAS set-up and the caching
    # allocator's growth).
    params="$(sed -n 's/^trainer: [a-z]*, \([0-9]*\) parameters.*/\1/p' "$REPORT_DIR/trainer_mfu.log" | head -1)"
    "$PYTHON" - "$log_json" "$params" "${peak:-0}" "$NOMINAL_PEAK_TFLOPS" "$model_args" <<'EOF' | tee -a "$REPORT"
import json, statistics, sys
path, params, peak, nominal, args = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5].split()
flag = lambda name: int(args[args.index(name) + 1])
layers, dim, seq = flag("--layers"), flag("--dim"), flag("--seq")
steps = [json.loads(line) for line in open(path) if line.strip()]
timed = [s for s in steps if s["step"] > 5] or steps
tok_s = statistics.median(s["tokens_per_s"] for s in timed)
step_s = statistics.median(s["step_time_s"] for s in timed)
dense = 6 * params                   # forward + backward of every parameter, per token
attention = 12 * layers * dim * seq  # QK^T and AV, forward + backward, per token (not halved for the causal mask)
print(f"trainer: {params} parameters, {len(steps)} steps logged, median over steps {timed[0]['step']}..{timed[-1]['step']}: "
      f"{tok_s:.0f} tokens/s, {step_s * 1e3:.1f} ms/step, final loss {steps[-1]['loss']:.4f}")
for name, flops in (("6N", dense), ("6N + 12*L*d*s", dense + attention)):
    achieved = flops * tok_s / 1e12
    line = f"MFU ({name}, {flops / 1e9:.2f} GFLOP/token): {achieved:.1f} TFLOP/s"
    if peak > 0:
        line += f" = {achieved / peak:.3f} of the measured bf16 peak {peak:.1f}"
    line += f", {achieved / nominal:.3f} of the nominal {nominal:.0f}"
    print(line)
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi

say ""
say "run_gpu.sh: report in $REPORT (exit status $status)"
exit "$status"
