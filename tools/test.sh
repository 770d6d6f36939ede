#!/usr/bin/env bash
# Sets up what is missing and runs the whole test suite. Extra arguments go to
# `bazel test` (e.g. tools/test.sh --config=asan). The last line is
# "N passed, N failed", counted from Bazel's own per-target results plus one
# entry each for the formatting check, fuzzing and the CUDA build: after the
# Bazel tests, `tools/format.sh --check` checks that every .cc/.h file is as
# clang-format 14 and .clang-format would write it (tools/format.sh formats
# them), tools/fuzz.sh fuzzes the file loaders, the DCP reader, the
# safetensors loader and the rendezvous client for 50 s per target (250 s in
# all),
# and `bazel build --config=cuda //...` compiles and links every target
# against LibTorch's CUDA libraries and NCCL (no GPU needed; nothing CUDA
# runs here). All three are skipped when extra arguments are given: a configured
# run (--config=asan, a test filter) is a rerun of the Bazel tests, and the
# fuzzers carry their own sanitizers.
set -uo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh --with-python || exit 1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
bazel test //... --test_summary=short "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

# A target marked flaky that failed and then passed on a retry is FLAKY in
# Bazel's summary: counted as passed (Bazel's exit status says so too) and
# named here, so a retry is never silent.
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(PASSED|FLAKY)' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
grep -E '^//[^ ]+ +(\(cached\) )?FLAKY' "$log" | sed 's/^/flaky (passed on a retry): /' || true
if ((status != 0 && failed == 0)); then
  failed=1  # the build itself failed before any test ran
fi
if (($# == 0)); then
  if tools/format.sh --check; then
    echo "format: PASSED"
    passed=$((passed + 1))
  else
    echo "format: FAILED"
    failed=$((failed + 1))
    ((status == 0)) && status=1
  fi
  if tools/fuzz.sh --seconds 50; then
    echo "fuzz: PASSED"
    passed=$((passed + 1))
  else
    echo "fuzz: FAILED"
    failed=$((failed + 1))
    ((status == 0)) && status=1
  fi
  if bazel build --config=cuda //... 2>&1 | tail -5; ((PIPESTATUS[0] == 0)); then
    echo "cuda build: PASSED"
    passed=$((passed + 1))
  else
    echo "cuda build: FAILED"
    failed=$((failed + 1))
    ((status == 0)) && status=1
  fi
else
  echo "format, fuzz, cuda build: skipped (extra arguments given to bazel test)"
fi
echo "${passed} passed, ${failed} failed"
exit "$status"
