#!/bin/bash
# Fails when a file of one top-level package includes another top-level
# package's internal/ header: internal/ is private to its package, and a seam
# another package uses is a public header saying so (issue 26).
#
# Reads the real source tree (found through this script's own symlink), so
# it sees every package, not only declared inputs. third_party/ is vendored
# code with its own rules.
set -euo pipefail

root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$root"
[[ -f WORKSPACE ]] || { echo "cannot find the workspace root (got $root)"; exit 1; }

violations=$(find . -path ./third_party -prune -o -path './bazel-*' -prune -o -path ./.git -prune \
    -o -type f \( -name '*.h' -o -name '*.cc' \) -print |
  xargs grep -HnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"]*/internal/' |
  awk -F: '{
    package = $1; sub(/^\.\//, "", package); sub(/\/.*/, "", package)
    match($0, /"[^"]*"/); included = substr($0, RSTART + 1, RLENGTH - 2)
    split(included, parts, "/")
    if (parts[1] != package) print
  }' || true)

if [[ -n "$violations" ]]; then
  echo "Includes of another top-level package's internal/ header (make the seam a public header):"
  echo "$violations"
  exit 1
fi
echo "no cross-package internal/ includes"
