#!/bin/bash
# Fails when benchmarks/gpu/sources.cmake (the source lists of the CMake GPU
# build, benchmarks/gpu/CMakeLists.txt) differs from the BUILD files,
# printing the diff and the command that regenerates it:
# tools/gpu_cmake.py --check. First, --self-test runs the marking of
# optional libraries (built only where CMake finds their system libraries,
# else a stand-in: the trainer's --tokenizer) on small planted trees.
#
# Reads the real source tree (found through this script's own symlink, as
# //tools:deps_diagram_test does), so it sees every BUILD file and source,
# not only declared inputs; tagged "external" so Bazel never answers it from
# the cache.
set -euo pipefail

root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
[[ -f "$root/WORKSPACE" ]] || { echo "cannot find the workspace root (got $root)"; exit 1; }
python=$(command -v python3 || echo /usr/bin/python3)
"$python" "$root/tools/gpu_cmake.py" --self-test
exec "$python" "$root/tools/gpu_cmake.py" --check --root "$root"
