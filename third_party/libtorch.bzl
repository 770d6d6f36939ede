"""@libtorch: the LibTorch 2.x the project builds against, from one place.

Where it comes from, first match wins:
  1. TORCHFSDP_LIBTORCH, a LibTorch directory (include/ and lib/ inside): the
     official libtorch archive, unpacked, or any `torch` wheel's `torch/`.
  2. The `torch` wheel tools/setup.sh installs into the project's prefix,
     ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv.

Checked when the repository is set up (bazel's fetch step), so a wrong
LibTorch is one error naming the path, what was found and what is needed,
not a page of compile errors:
  - the directory holds torch/version.h, libtorch_cpu.so and libc10.so;
  - its version is within SUPPORTED (the project uses C++20 headers and the
    c10d Backend API; 2.x before 2.11 are not tried);
  - it was built with the C++11 string ABI (_GLIBCXX_USE_CXX11_ABI=1), which
    Debian's Abseil and GoogleTest use; wheels before 2.7 were not.

Targets:
  :libtorch        CPU: libtorch_cpu + libc10 (no libtorch.so, which pulls in
                   libtorch_cuda).
  :libtorch_cuda   CUDA + NCCL: libtorch_cuda, libc10_cuda, the CUDA toolkit's
                   and NCCL's headers. Building it without a CUDA LibTorch,
                   the CUDA toolkit or nccl.h fails naming which.
  :python          the Python interpreter with this same `torch` (tests and
                   golden scripts); its path is in TORCHFSDP_PYTHON.
"""

SUPPORTED = ((2, 11), (2, 15))  # inclusive (major, minor) range
TESTED = "2.15.0"

_HINT = "run tools/setup.sh (installs the torch wheel into the project's prefix) or set TORCHFSDP_LIBTORCH to a LibTorch directory"

def _home(ctx):
    home = ctx.os.environ.get("TORCHFSDP_HOME", "")
    if home:
        return home
    return ctx.os.environ.get("HOME", "/root") + "/.cache/torchfsdp-cpp"

def _default_libtorch(ctx):
    venv = ctx.path(_home(ctx) + "/venv/lib")
    if venv.exists:
        for pydir in venv.readdir():
            torch = pydir.get_child("site-packages").get_child("torch")
            if torch.exists:
                return torch
    return None

def _version(ctx, root):
    # 2.x from about 2.10 keeps the numbers in torch/headeronly/version.h
    # (api/include/torch/version.h includes it); earlier ones in the latter.
    include = root.get_child("include")
    header = include.get_child("torch").get_child("headeronly").get_child("version.h")
    if not header.exists:
        header = include.get_child("torch").get_child("csrc").get_child("api").get_child("include").get_child("torch").get_child("version.h")
    if not header.exists:
        fail("LibTorch at {}: {} not found; expected a LibTorch 2.x directory (include/ and lib/); {}".format(root, header, _HINT))
    numbers = {}
    for line in ctx.read(header).splitlines():
        parts = [p for p in line.replace("\t", " ").split(" ") if p]
        if len(parts) == 3 and parts[0] == "#define" and parts[1] in ("TORCH_VERSION_MAJOR", "TORCH_VERSION_MINOR", "TORCH_VERSION_PATCH"):
            numbers[parts[1]] = int(parts[2])
    if len(numbers) != 3:
        fail("LibTorch at {}: no TORCH_VERSION_MAJOR/MINOR/PATCH in {}".format(root, header))
    return (numbers["TORCH_VERSION_MAJOR"], numbers["TORCH_VERSION_MINOR"], numbers["TORCH_VERSION_PATCH"])

def _cxx11_abi(ctx, c10):
    # std::string in a mangled name is std::__cxx11::basic_string under the
    # new ABI and std::basic_string under the old; libc10 exports c10::Error,
    # whose constructor takes one.
    result = ctx.execute(["sh", "-c", "nm -D --defined-only '{}' | grep -c '__cxx11' || true".format(c10)])
    if result.return_code != 0:
        fail("LibTorch at {}: could not read {}'s symbols with nm: {}".format(c10.dirname, c10, result.stderr))
    return int(result.stdout.strip() or "0") > 0

def _libtorch_repository_impl(ctx):
    override = ctx.os.environ.get("TORCHFSDP_LIBTORCH", "")
    if override:
        root = ctx.path(override)
        if not root.exists:
            fail("TORCHFSDP_LIBTORCH={}: no such directory; expected a LibTorch directory (include/ and lib/)".format(override))
        origin = "TORCHFSDP_LIBTORCH"
    else:
        root = _default_libtorch(ctx)
        if root == None:
            fail("LibTorch not found: no TORCHFSDP_LIBTORCH, and no torch wheel under {}/venv; {}".format(_home(ctx), _HINT))
        origin = "the project's prefix"
    root = root.realpath
    lib = root.get_child("lib")
    for name in ["libtorch_cpu.so", "libc10.so"]:
        if not lib.get_child(name).exists:
            fail("LibTorch at {} ({}): {} not found in {}; {}".format(root, origin, name, lib, _HINT))

    version = _version(ctx, root)
    found = "{}.{}.{}".format(version[0], version[1], version[2])
    low, high = SUPPORTED
    if (version[0], version[1]) < low or (version[0], version[1]) > high:
        fail("LibTorch at {} ({}) is version {}; this project needs {}.{} to {}.{} (tested: {}); {}".format(
            root,
            origin,
            found,
            low[0],
            low[1],
            high[0],
            high[1],
            TESTED,
            _HINT,
        ))
    if not _cxx11_abi(ctx, lib.get_child("libc10.so")):
        fail("LibTorch at {} ({}) {} was built with the pre-C++11 string ABI (_GLIBCXX_USE_CXX11_ABI=0); this project links Debian's Abseil and GoogleTest, built with _GLIBCXX_USE_CXX11_ABI=1: use a cxx11-ABI LibTorch (every torch wheel from 2.7 on)".format(root, origin, found))

    ctx.symlink(root.get_child("include"), "include")
    ctx.symlink(ctx.attr._pch_bzl, "pch.bzl")
    ctx.symlink(lib, "lib")

    has_cuda_lib = lib.get_child("libtorch_cuda.so").exists
    cuda_home = ctx.path(ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    has_toolkit = cuda_home.get_child("include").get_child("cuda_runtime_api.h").exists
    if has_toolkit:
        ctx.symlink(cuda_home.get_child("include"), "cuda_include")
    nccl_include = None
    site = root.dirname
    for candidate in [site.get_child("nvidia").get_child("nccl").get_child("include"), cuda_home.get_child("include")]:
        if candidate.get_child("nccl.h").exists:
            nccl_include = candidate
            break
    if nccl_include:
        ctx.symlink(nccl_include, "nccl_include")

    # The wheel's libraries find their CUDA and NCCL siblings through their
    # own RPATH ($ORIGIN/../../nvidia/...); the linker, resolving a
    # libtorch_cuda link, needs the same directories.
    nvidia = site.get_child("nvidia")
    rpath_link = []
    if nvidia.exists:
        for pkg in nvidia.readdir():
            if pkg.get_child("lib").exists:
                rpath_link.append(str(pkg.get_child("lib")))
    if has_toolkit:
        for sub in ["lib64", "lib"]:
            if cuda_home.get_child(sub).exists:
                rpath_link.append(str(cuda_home.get_child(sub)))

    cuda_problem = ""
    if not has_cuda_lib:
        cuda_problem = "--config=cuda: the LibTorch at {} ({}) has no libtorch_cuda.so (a CPU-only LibTorch); use the torch wheel or a CUDA libtorch archive".format(root, found)
    elif not has_toolkit:
        cuda_problem = "--config=cuda: the CUDA toolkit was not found ({}/include/cuda_runtime_api.h missing); install it or set CUDA_HOME".format(cuda_home)
    elif not nccl_include:
        cuda_problem = "--config=cuda: nccl.h not found (looked in {}/nvidia/nccl/include and {}/include); install NCCL's headers".format(site, cuda_home)

    python = ctx.os.environ.get("TORCHFSDP_PYTHON", "")
    if not python:
        python = _home(ctx) + "/venv/bin/python3"

    ctx.file("version.bzl", "LIBTORCH_VERSION = {}\nLIBTORCH_ROOT = {}\nTORCHFSDP_PYTHON = {}\n".format(repr(found), repr(str(root)), repr(python)))
    ctx.template("BUILD", ctx.attr._build_template, {
        "%{version}": found,
        "%{lib}": str(lib),
        "%{rpath_link}": repr(["-Wl,-rpath-link," + d for d in rpath_link]),
        "%{cuda_problem}": cuda_problem.replace("\"", "'"),
        "%{python}": python,
    })

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    attrs = {
        "_build_template": attr.label(default = "//third_party:libtorch.BUILD.tpl"),
        "_pch_bzl": attr.label(default = "//third_party:libtorch_pch.bzl"),
    },
    environ = ["TORCHFSDP_LIBTORCH", "TORCHFSDP_HOME", "TORCHFSDP_PYTHON", "CUDA_HOME", "HOME"],
    local = True,
)
