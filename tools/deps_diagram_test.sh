#!/bin/bash
# Fails when the root README's dependency diagram differs from the BUILD
# files (printing the diff and the command that regenerates it), on a cycle
# or an upward arrow between packages, read from the BUILD files and from
# the #include lines of production files (an include of the same layer or
# above, naming the file and line), on a package tools/deps_diagram.py does
# not place in a layer, and when a component's README "Where the code is"
# table misses one of its .h/.cc files. First, --self-test plants upward,
# sideways and exempt includes in a temporary tree and checks that exactly
# the planted ones are reported.
#
# Reads the real source tree (found through this script's own symlink, as
# //module_call:no_cross_package_internal_include_test does), so it sees
# every package and file, not only declared inputs; tagged "external" so
# Bazel never answers it from the cache.
set -euo pipefail

root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
[[ -f "$root/WORKSPACE" ]] || { echo "cannot find the workspace root (got $root)"; exit 1; }
python=$(command -v python3 || echo /usr/bin/python3)
"$python" "$root/tools/deps_diagram.py" --self-test
exec "$python" "$root/tools/deps_diagram.py" --check --root "$root"
