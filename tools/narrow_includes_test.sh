#!/bin/bash
# Fails when a project .cc/.h (third_party/ aside) includes all of LibTorch,
# <torch/torch.h> or <torch/all.h>, naming the file and line: one such
# translation unit takes 15 to 50 s and about 1 GB to compile (issue 35).
# Include the headers the file uses instead (CONTRIBUTING.md, "LibTorch
# includes"). A file that truly needs all of LibTorch says why on the line
# just above the include, in a comment starting "// Needs all of LibTorch:".
#
# Reads the real source tree (found through this script's own symlink, as
# //tools:deps_diagram_test does), so it sees every package and file, not
# only declared inputs; tagged "external" so Bazel never answers it from the
# cache.
set -euo pipefail

root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$root"
[[ -f WORKSPACE ]] || { echo "cannot find the workspace root (got $root)"; exit 1; }

violations=$(find . -path ./third_party -prune -o -path './bazel-*' -prune -o -path ./.git -prune \
    -o -type f \( -name '*.h' -o -name '*.cc' \) -print | sort |
  xargs awk '
    FNR == 1 { previous = "" }
    /^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]torch\/(torch|all)\.h[>"]/ {
      if (previous !~ /^[[:space:]]*\/\/ Needs all of LibTorch:/) {
        file = FILENAME; sub(/^\.\//, "", file)
        print file ":" FNR ": " $0
      }
    }
    { previous = $0 }' || true)

if [[ -n "$violations" ]]; then
  echo "Includes of all of LibTorch (<torch/torch.h> / <torch/all.h>):"
  echo "$violations"
  echo
  echo "Include the LibTorch headers the file uses instead (<ATen/core/Tensor.h>, <torch/types.h>,"
  echo "<torch/nn/modules/linear.h>, <torch/optim/adam.h>, ...; CONTRIBUTING.md, \"LibTorch includes\"),"
  echo "or, where the file truly needs all of LibTorch, say why on the line just above the include:"
  echo "  // Needs all of LibTorch: <why>"
  exit 1
fi
echo "no include of all of LibTorch"
