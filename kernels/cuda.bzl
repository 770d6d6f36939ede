"""cuda_objects: .cu files compiled by nvcc into a cc_library (Bazel 4 has no
CUDA rules, and the project fetches none).

    cuda_objects(
        name = "cuda_kernels",
        srcs = ["internal/cuda_kernels.cu"],
        hdrs = ["internal/cuda_kernels.h"],
    )

makes a genrule that runs nvcc on each source (position-independent, the
architectures in CUDA_ARCHS, warnings as errors) and a cc_library `name`
holding the objects and linking the CUDA runtime (libcudart). Both are
tagged manual: a machine without the CUDA toolkit never builds them, and a
target selects the library under //third_party:cuda (--config=cuda).

nvcc is $CUDA_HOME/bin/nvcc (CUDA_HOME reaches the action only with
--action_env=CUDA_HOME), else /usr/local/cuda/bin/nvcc, else nvcc on PATH;
its host compiler is nvcc's default (g++). libcudart is linked from
CUDA_LIB_DIR. The sources include project headers from the workspace root
("kernels/internal/cuda_kernels.h"), and no LibTorch: nvcc never parses
LibTorch's headers.
"""

# tools/gpu_cmake.py reads CUDA_ARCHS and NVCC_FLAGS (their string literals)
# for the GPU machine's CMake build, benchmarks/gpu/sources.cmake: keep them
# plain lists of literals, and regenerate it (python3 tools/gpu_cmake.py
# --write) after changing them.

# sm_80 (A100), sm_90 (H100, H200), sm_100 (B200), and PTX for compute_90,
# which later GPUs compile when they load the library.
CUDA_ARCHS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_100,code=sm_100",
    "-gencode=arch=compute_90,code=compute_90",
]

CUDA_LIB_DIR = "/usr/local/cuda/lib64"

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Werror=all-warnings",
    "-Xcompiler=-fPIC,-Wall,-Wextra,-Werror,-Wno-unused-parameter",
]

def cuda_objects(name, srcs, hdrs = [], visibility = None):
    objects = []
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_objects {}: source {}: expected a .cu file".format(name, src))
        stem = src[:-len(".cu")]

        # One object, position-independent, which Bazel links in PIC
        # (--force_pic) and non-PIC builds alike.
        obj = stem + ".o"
        package = native.package_name()
        in_package = (package + "/" + src) if package else src
        native.genrule(
            name = name + "_" + stem.replace("/", "_") + "_nvcc",
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                "nvcc=;",
                "for c in \"$${CUDA_HOME:-}/bin/nvcc\" /usr/local/cuda/bin/nvcc \"$$(command -v nvcc || true)\"; do",
                "  if [ -x \"$$c\" ]; then nvcc=$$c; break; fi;",
                "done;",
                "if [ -z \"$$nvcc\" ]; then",
                "  echo 'cuda_objects: nvcc not found (CUDA_HOME, /usr/local/cuda/bin, PATH): --config=cuda needs the CUDA toolkit' >&2;",
                "  exit 1;",
                "fi;",
                # The workspace root as the action sees it (external/<repo>/
                # when this workspace is someone else's dependency).
                "src=$(location {});".format(src),
                "root=$${{src%{}}};".format(in_package),
                "\"$$nvcc\" " + " ".join(NVCC_FLAGS + CUDA_ARCHS),
                "-I\"$${root:-.}\" -c \"$$src\" -o $(location " + obj + ")",
            ]),
            tags = ["manual"],
            visibility = ["//visibility:private"],
        )
        objects.append(obj)
    native.cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        linkopts = [
            "-L" + CUDA_LIB_DIR,
            "-Wl,-rpath," + CUDA_LIB_DIR,
            "-lcudart",
        ],
        tags = ["manual"],
        visibility = visibility,
    )
