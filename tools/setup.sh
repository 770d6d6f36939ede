#!/usr/bin/env bash
# Installs the Debian packages the build needs; does nothing when they are
# already there. Usage: tools/setup.sh [--with-python]
#   --with-python  also install python3-torch and python3-matplotlib
#                  (golden-value fixtures, Python interop tests, tools/plot).
set -euo pipefail

packages=(
  g++
  bazel-bootstrap
  libtorch-dev
  libgloo-dev
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
)
for arg in "$@"; do
  case "$arg" in
    --with-python) packages+=(python3-torch python3-numpy python3-matplotlib) ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --with-python)" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "setup.sh: installing missing Debian packages: ${missing[*]}" >&2
if [[ $(id -u) -ne 0 ]]; then
  echo "setup.sh: these packages are missing and installing them needs root:" >&2
  printf '  %s\n' "${missing[@]}" >&2
  echo "run as root: tools/setup.sh $*  (or: apt-get install ${missing[*]})" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
echo "setup.sh: installed ${missing[*]}" >&2
