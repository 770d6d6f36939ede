# shellcheck shell=bash
# The C/C++ runtime every Linux machine has, as a regex over sonames:
# glibc's libraries, the loader, the kernel's vDSO, libstdc++ and libgcc_s.
# It is what the GPU bundle need not carry (tools/gpu_bundle.sh) and what
# the CMake-built binaries may load from outside the wheel and the bundle
# (tools/gpu_cmake_check.sh); both source this file, so the two cannot
# disagree about it.
C_RUNTIME_SONAMES='^(linux-vdso|libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
