#!/usr/bin/env bash
# Sets up what is missing and runs the whole test suite. Extra arguments go to
# `bazel test` (e.g. tools/test.sh --config=asan). The last line is
# "N passed, N failed", counted from Bazel's own per-target results plus one
# entry each for the formatting check, fuzzing, the CUDA build and the CMake
# GPU build: after the
# Bazel tests, `tools/format.sh --check` checks that every .cc/.h file is as
# clang-format 14 and .clang-format would write it (tools/format.sh formats
# them), tools/fuzz.sh fuzzes the file loaders, the DCP reader, the
# safetensors loader and the rendezvous client for 50 s per target (250 s in
# all), and `bazel build --config=cuda` builds what differs under CUDA (the
# NCCL plug-in //comm:nccl and the binaries that link it, against LibTorch's
# CUDA libraries and NCCL; no GPU needed, nothing CUDA runs here; every other
# target compiles the same in both configurations, so nothing else is
# rebuilt), and tools/gpu_cmake_check.sh builds the GPU machine's CMake path
# (benchmarks/gpu) against the wheel, checks that its binaries load nothing
# from /usr/lib, and runs gpu_check --dry-run-on-cpu. All four are skipped
# when extra arguments are given: a
# configured run (--config=asan, a test filter) is a rerun of the Bazel
# tests, and the fuzzers carry their own sanitizers.
#
# Before the last line it prints how long each phase took (set-up, build,
# tests, format, fuzz, CUDA build, GPU CMake build), so a slow CI run says
# where its time went.
set -uo pipefail
cd "$(dirname "$0")/.."

timings=()
# phase NAME COMMAND...: runs COMMAND and records its wall time under NAME.
phase() {
  local name=$1 start=$SECONDS rc
  shift
  "$@"
  rc=$?
  timings+=("$(printf '%-12s %5d s' "$name" $((SECONDS - start)))")
  return "$rc"
}

phase set-up tools/setup.sh --with-python || exit 1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Built first on its own so the timings separate compiling from testing; a
# target that fails to build is counted by `bazel test` below.
phase build bazel build //... --keep_going "$@"
run_tests() {
  bazel test //... --test_summary=short "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
phase tests run_tests "$@"
status=$?

# A target marked flaky that failed and then passed on a retry is FLAKY in
# Bazel's summary: counted as passed (Bazel's exit status says so too) and
# named here, so a retry is never silent.
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(PASSED|FLAKY)' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
grep -E '^//[^ ]+ +(\(cached\) )?FLAKY' "$log" | sed 's/^/flaky (passed on a retry): /' || true
if ((status != 0 && failed == 0)); then
  failed=1  # the build itself failed before any test ran
fi

# count NAME COMMAND...: one more passed or failed entry for COMMAND.
count() {
  local name=$1
  shift
  if phase "$name" "$@"; then
    echo "$name: PASSED"
    passed=$((passed + 1))
  else
    echo "$name: FAILED"
    failed=$((failed + 1))
    ((status == 0)) && status=1
  fi
}
cuda_build() {
  bazel build --config=cuda //... //comm:nccl 2>&1 | tail -5
  return "${PIPESTATUS[0]}"
}
if (($# == 0)); then
  count format tools/format.sh --check
  count fuzz tools/fuzz.sh --seconds 50
  count "cuda build" cuda_build
  count "gpu cmake" tools/gpu_cmake_check.sh
else
  echo "format, fuzz, cuda build, gpu cmake: skipped (extra arguments given to bazel test)"
fi
echo "time per phase:"
printf '  %s\n' "${timings[@]}"
echo "  total        $(printf '%5d' "$SECONDS") s"
echo "${passed} passed, ${failed} failed"
exit "$status"
