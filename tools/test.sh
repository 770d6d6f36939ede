#!/usr/bin/env bash
# Sets up what is missing and runs the whole test suite. Extra arguments go to
# `bazel test` (e.g. tools/test.sh --config=asan). The last line is
# "N passed, N failed", counted from Bazel's own per-target results.
set -uo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh --with-python || exit 1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
bazel test //... --test_summary=short "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
if ((status != 0 && failed == 0)); then
  failed=1  # the build itself failed before any test ran
fi
echo "${passed} passed, ${failed} failed"
exit "$status"
