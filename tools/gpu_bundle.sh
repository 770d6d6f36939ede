#!/usr/bin/env bash
# Builds third_party/gpu_deps/: the small Debian dependencies the CMake build
# of the GPU checks (benchmarks/gpu/CMakeLists.txt) needs on the lent GPU
# machine, which has torch, nvcc, CMake and ninja but no Debian packages and
# no network. Run it here (Debian 12, apt reaches the mirrors); the folder is
# git-ignored and travels with the device tool's `carry`:
#
#   bash tools/gpu_bundle.sh
#   run(carry=["third_party/gpu_deps"], command="bash benchmarks/run_gpu.sh")
#
# What goes in (the Bazel build takes the same packages from /usr, see
# third_party/system_deps.bzl):
#   libabsl-dev + libabsl20220623   Abseil headers and shared libraries
#   libgloo-dev                     gloo/ headers (ProcessGroupGloo.hpp includes them)
#   libcli11-dev                    CLI11 (header-only: trainer, launcher)
#   nlohmann-json3-dev              nlohmann/json (header-only: --log-json)
#   libdeflate-dev + libdeflate0    libdeflate (checkpoint CRC-32)
#   libtcmalloc-minimal4            gperftools' tcmalloc (what every Bazel binary links)
# Only headers and shared libraries are kept: static libraries, CMake and
# pkg-config files and docs are dropped (the bundle must stay far below the
# 64 MiB a device call carries).
#
# The shared libraries need glibc >= 2.34 and libstdc++ with GLIBCXX_3.4.29
# (GCC 11): Ubuntu 22.04 and later, Debian 12 and later.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/third_party/gpu_deps"
PACKAGES=(
  libabsl-dev libabsl20220623
  libgloo-dev
  libcli11-dev
  nlohmann-json3-dev
  libdeflate-dev libdeflate0
  libtcmalloc-minimal4
)

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "gpu_bundle.sh: needs apt-get and dpkg (run it on the Debian 12 build machine)" >&2
  exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# apt-get download runs as the _apt user when it can; a world-writable
# directory keeps it from warning about falling back to root.
chmod 0777 "$WORK"
(cd "$WORK" && apt-get download "${PACKAGES[@]}") || {
  echo "gpu_bundle.sh: apt-get download ${PACKAGES[*]} failed (no network to the Debian mirrors? try apt-get update)" >&2
  exit 1
}

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
for deb in "$WORK"/*.deb; do
  dpkg -x "$deb" "$DEST.tmp"
done

# Flatten to include/ and lib/, keeping only what a build and a run need.
mkdir -p "$DEST.tmp/bundle/lib"
mv "$DEST.tmp/usr/include" "$DEST.tmp/bundle/include"
LIBDIR="$DEST.tmp/usr/lib/x86_64-linux-gnu"
# Shared libraries and their symlinks (libfoo.so -> libfoo.so.N -> ...).
find "$LIBDIR" -maxdepth 1 \( -name '*.so' -o -name '*.so.*' \) -exec mv -t "$DEST.tmp/bundle/lib" {} +
# libgloo-dev ships /usr/lib/libgloo.so, a link to a libgloo0 we do not need
# (the wheel has Gloo compiled into libtorch_cpu): headers only.
rm -f "$DEST.tmp/bundle/lib/libgloo"*
# tcmalloc's debugging variant is not linked.
rm -f "$DEST.tmp/bundle/lib/libtcmalloc_minimal_debug"*
# Dangling links (a -dev package's libfoo.so whose target package is not
# bundled) would only confuse the linker.
find "$DEST.tmp/bundle/lib" -xtype l -delete
# What the bundled libraries need in turn must be bundled too, or be the
# C/C++ runtime every machine has: the GPU machine has no Debian packages,
# and the CMake-built binaries reach the bundle's libraries (libabsl_status
# needing libabsl_cord) through their DT_RPATH.
source "$(dirname "$0")/gpu_c_runtime.sh"
unbundled=""
for lib in "$DEST.tmp/bundle/lib"/*.so*; do
  [ -L "$lib" ] && continue
  for needed in $(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    if [ ! -e "$DEST.tmp/bundle/lib/$needed" ] && ! [[ "$needed" =~ $C_RUNTIME_SONAMES ]]; then
      unbundled+="  $(basename "$lib") needs $needed"$'\n'
    fi
  done
done
if [ -n "$unbundled" ]; then
  printf 'gpu_bundle.sh: libraries needed by the bundle but not in it (add their packages to PACKAGES):\n%s' \
    "$unbundled" >&2
  exit 1
fi
# The Debian package versions, for the record.
for deb in "$WORK"/*.deb; do
  # shellcheck disable=SC2016  # dpkg's ${field} syntax, not the shell's
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb"
done | sort > "$DEST.tmp/bundle/PACKAGES"

rm -rf "$DEST"
mv "$DEST.tmp/bundle" "$DEST"
rm -rf "$DEST.tmp"

echo "gpu_bundle.sh: $(wc -l < "$DEST/PACKAGES") packages into $DEST:"
sed 's/^/  /' "$DEST/PACKAGES"
echo "gpu_bundle.sh: size $(du -sh "$DEST" | cut -f1) ($(du -sb "$DEST" | cut -f1) bytes; the device tool carries at most 64 MiB in all)"
