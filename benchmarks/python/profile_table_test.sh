#!/usr/bin/env bash
# //benchmarks:profile_table_test: profile_table_test.py (unittest) under the
# venv's python, which @libtorch//:python starts.
# Usage (Bazel): profile_table_test.sh PYTHON TEST_PY
set -euo pipefail
exec "$1" "$2"
