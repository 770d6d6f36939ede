#!/usr/bin/env python3
"""The source lists of the CMake GPU build, generated from the BUILD files.

    python3 tools/gpu_cmake.py           print benchmarks/gpu/sources.cmake as
                                         the BUILD files say it should be
    python3 tools/gpu_cmake.py --write   write benchmarks/gpu/sources.cmake
    python3 tools/gpu_cmake.py --check   exit 1 when benchmarks/gpu/sources.cmake
                                         differs (printing the diff and the
                                         command that regenerates it)

benchmarks/gpu/CMakeLists.txt builds //trainer:trainer and
//benchmarks:gpu_check on the GPU machine, which has no Bazel. What it
compiles comes from here: every project cc_library in the transitive deps of
those two binaries (deps and implementation_deps; a select() contributes the
labels of all its branches, so --config=cuda's //comm:nccl is in), with its
.cc srcs, local_defines and linkopts, and the binaries' own srcs. Labels that
only a `//third_party:cuda` branch brings are marked CUDA-only (built when
TORCHFSDP_CUDA is ON); alwayslink libraries are kept apart (CMake links their
objects into each binary, as Bazel does). copts are not carried (CMake's
Release flags are -O2 like .bazelrc's; warnings are not errors there).

cuda_objects targets (kernels/cuda.bzl: .cu files compiled by nvcc, no
LibTorch) must be reached only through //third_party:cuda branches (the
CPU-only build has no nvcc); their .cu sources and headers go into
TORCHFSDP_CUDA_OBJECTS_SRCS / _HDRS, and the nvcc flags into
TORCHFSDP_NVCC_FLAGS, read from the NVCC_FLAGS and CUDA_ARCHS lists of the
.bzl file the BUILD file loads cuda_objects from (so the architectures cannot
drift from Bazel's), less -Werror, as for the C++ sources.

Reads the BUILD files with tools/deps_diagram.py's parser (no `bazel query`,
so it runs inside a test). Python 3 standard library only.
//tools:gpu_cmake_test runs --check.
"""

import argparse
import difflib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import deps_diagram  # noqa: E402  (the BUILD-file parser; beside this file)

# What the CMake build makes: (label, CMake target name).
BINARIES = [
    ("//trainer:trainer", "trainer"),
    ("//benchmarks:gpu_check", "gpu_check"),
]
CUDA_CONDITION = "//third_party:cuda"
DEFAULT_CONDITION = "//conditions:default"
OUTPUT = "benchmarks/gpu/sources.cmake"
REGENERATE = "python3 tools/gpu_cmake.py --write"
COMPILED = (".cc", ".cpp", ".c")
HEADERS = (".h", ".hpp", ".inc")
CUDA_OBJECTS = "cuda_objects"  # the macro of kernels/cuda.bzl


class BuildError(Exception):
    pass


# ---- attribute values: lists, select() and their conditions ---------------

def closing_paren(text, open_index):
    """The index just past the bracket that closes text[open_index]."""
    end = deps_diagram.closing_paren(text, open_index)
    if end is None:
        raise BuildError(f"unbalanced brackets in {text!r}")
    return end


def literals(text):
    return [d or s for d, s in re.findall(r'"([^"\\]*)"|\'([^\'\\]*)\'', text)]


def conditional_values(value, where):
    """[(when, string)] of an attribute's value, as the CMake build (whose
    only configuration is TORCHFSDP_CUDA) sees it. when is "always" (a plain
    list, or the default branch of a select() without a CUDA branch), "cuda"
    (a //third_party:cuda branch), "not cuda" (the default branch of a select()
    that has a CUDA branch) or "never" (any other condition)."""
    if re.search(r"\bglob\s*\(", value):
        raise BuildError(f"{where}: glob() is not supported here: list the files")
    out, plain, i = [], [], 0
    for match in re.finditer(r"\bselect\s*\(", value):
        if match.start() < i:
            continue
        end = closing_paren(value, match.end() - 1)
        plain.append(value[i:match.start()])
        i = end
        body = value[match.end():end - 1].strip()
        if body.startswith("{"):
            body = body[1:closing_paren(body, 0) - 1]
        branches = []
        for entry in deps_diagram.split_top_level(body):
            # "condition": [values]: the key's literal, a colon, the branch.
            match_key = re.match(r'\s*("[^"]*"|\'[^\']*\')\s*:(.*)\Z', entry, re.S)
            if not match_key:
                raise BuildError(f"{where}: cannot read the select() entry {entry!r}")
            branches.append((match_key.group(1)[1:-1], literals(match_key.group(2))))
        has_cuda = any(key == CUDA_CONDITION for key, _ in branches)
        for key, strings in branches:
            if key == CUDA_CONDITION:
                when = "cuda"
            elif key == DEFAULT_CONDITION:
                when = "not cuda" if has_cuda else "always"
            else:
                when = "never"
            out += [(when, string) for string in strings]
    plain.append(value[i:])
    return [("always", string) for string in literals(" ".join(plain))] + out


# ---- the BUILD files --------------------------------------------------------

def read_rules(root):
    """{(package, name): (kind, attributes, build file path)}."""
    rules = {}
    for package, path in deps_diagram.find_build_files(root):
        with open(path, encoding="utf-8") as f:
            for kind, attributes in deps_diagram.parse_build(f.read()):
                names = literals(attributes.get("name", ""))
                if names:
                    rules[(package, names[0])] = (kind, attributes,
                                                  os.path.relpath(path, root))
    return rules


def parse_label(label, package):
    """(package, name) of a project label; None for an external one."""
    if label.startswith("@"):
        return None
    if label.startswith("//"):
        target_package, colon, name = label[2:].partition(":")
        return (target_package, name if colon else target_package.rsplit("/", 1)[-1])
    return (package, label[1:] if label.startswith(":") else label)


def display(key):
    package, name = key
    return f"//{package}:{name}"


def is_true(text):
    return text.strip() in ("True", "1")


def closure(rules, root_keys):
    """{library key: cuda_only} over the transitive deps of root_keys, and
    the roots' own CUDA-only flags (always False)."""
    reached = {}  # key -> True when only CUDA branches lead there
    stack = [(key, False) for key in root_keys]
    while stack:
        key, cuda_only = stack.pop()
        if key in reached and (cuda_only or not reached[key]):
            continue
        if key not in rules:
            raise BuildError(f"{display(key)}: no such target in "
                             f"{key[0] or '.'}/BUILD")
        kind, attributes, path = rules[key]
        if kind == "alias":
            actuals = literals(attributes.get("actual", ""))
            stack.append((parse_label(actuals[0], key[0]), cuda_only))
            continue
        if kind == CUDA_OBJECTS:
            if not cuda_only:
                # A CPU-only CMake build (TORCHFSDP_CUDA=OFF) has no nvcc.
                raise BuildError(f"{display(key)} ({path}) is a {CUDA_OBJECTS} target reached "
                                 f"outside a {CUDA_CONDITION} branch: select it (or the "
                                 "library that needs it) under --config=cuda only")
            reached[key] = True
            continue  # no deps: nvcc objects and libcudart
        if kind not in ("cc_library", "cc_binary"):
            raise BuildError(f"{display(key)} ({path}) is a {kind}: expected a cc_library "
                             f"or {CUDA_OBJECTS}")
        reached[key] = cuda_only
        for attribute in ("deps", "implementation_deps"):
            for condition, label in conditional_values(attributes.get(attribute, ""),
                                                       f"{display(key)} {attribute}"):
                dep = parse_label(label, key[0])
                if dep is None or dep[0].split("/", 1)[0] == "third_party":
                    continue
                # Every branch's labels; a CUDA branch's only under CUDA.
                stack.append((dep, cuda_only or condition == "cuda"))
    return reached


def package_files(key, attributes, attribute, suffixes, root):
    """The package's files named by a plain list attribute (no select())."""
    where = display(key)
    files = []
    for when, name in conditional_values(attributes.get(attribute, ""), f"{where} {attribute}"):
        if when != "always":
            raise BuildError(f"{where}: {attribute} under a select(): not supported for "
                             f"{CUDA_OBJECTS} (tools/gpu_cmake.py)")
        if name.startswith(("//", ":", "@")) or not name.endswith(suffixes):
            raise BuildError(f"{where}: {attribute} {name!r}: expected a file of the package "
                             f"ending in {', '.join(suffixes)}")
        path_in_repo = "/".join(filter(None, (key[0], name)))
        if not os.path.isfile(os.path.join(root, path_in_repo)):
            raise BuildError(f"{where}: {attribute} {path_in_repo} does not exist")
        files.append(path_in_repo)
    return sorted(files)


def target_info(key, rules, cuda_only, root):
    """The CMake-relevant facts of one cc_library, cc_binary or cuda_objects."""
    kind, attributes, path = rules[key]
    where = display(key)
    if kind == CUDA_OBJECTS:
        empty = {"always": [], "cuda": [], "not cuda": []}
        return {
            "label": where, "kind": kind, "cuda_only": True, "alwayslink": False,
            "srcs": [], "cuda_srcs": [],
            "cu_srcs": package_files(key, attributes, "srcs", (".cu",), root),
            "cu_hdrs": package_files(key, attributes, "hdrs", HEADERS, root),
            "local_defines": empty, "defines": empty, "linkopts": empty,
        }
    srcs = []
    for when, src in conditional_values(attributes.get("srcs", ""), f"{where} srcs"):
        if src.startswith(("//", ":", "@")):
            raise BuildError(f"{where}: source label {src!r}: only files of the package "
                             "are supported (tools/gpu_cmake.py)")
        if src.endswith(HEADERS):
            continue
        if not src.endswith(COMPILED):
            raise BuildError(f"{where}: source {src!r}: expected {', '.join(COMPILED)} or a "
                             "header")
        if when not in ("always", "cuda"):
            raise BuildError(f"{where}: source {src!r} under a select() condition other than "
                             f"{CUDA_CONDITION}: not supported (tools/gpu_cmake.py)")
        path_in_repo = "/".join(filter(None, (key[0], src)))
        if not os.path.isfile(os.path.join(root, path_in_repo)):
            raise BuildError(f"{where}: source {path_in_repo} does not exist")
        srcs.append((when == "cuda", path_in_repo))

    def values(attribute):
        """{"always": [...], "cuda": [...], "not cuda": [...]}."""
        found = {"always": [], "cuda": [], "not cuda": [], "never": []}
        for when, value in conditional_values(attributes.get(attribute, ""),
                                              f"{where} {attribute}"):
            found[when].append(value)
        del found["never"]
        return found

    return {
        "label": where,
        "kind": kind,
        "cuda_only": cuda_only,
        "alwayslink": is_true(attributes.get("alwayslink", "False")),
        "srcs": sorted(s for c, s in srcs if not c),
        "cuda_srcs": sorted(s for c, s in srcs if c),
        "local_defines": values("local_defines"),
        "defines": values("defines"),
        "linkopts": values("linkopts"),
    }


# ---- sources.cmake ----------------------------------------------------------

def variable(key):
    """The CMake name of a target: comm, comm__nccl, state_dict_fsdp__fsdp_dcp."""
    package, name = key
    base = package.replace("/", "_") or "_root"
    return base if name == package.rsplit("/", 1)[-1] else f"{base}__{name}"


def cmake_list(name, items, indent=""):
    if not items:
        return [f"{indent}set({name})"]
    return [f"{indent}set({name}"] + [f"{indent}  {item}" for item in items] + [f"{indent})"]


def section(title):
    return f"# ---- {title} ".ljust(80, "-")


def unique(items):
    return list(dict.fromkeys(items))


def per_build(contributions):
    """([values of the CPU build], [values of the CUDA build]) from
    [(cuda_only, {"always", "cuda", "not cuda": [values]})]."""
    cpu, cuda = [], []
    for cuda_only, found in contributions:
        if not cuda_only:
            cpu += found["always"] + found["not cuda"]
        cuda += found["always"] + found["cuda"]
    return unique(cpu), unique(cuda)


def conditional_list(name, cpu, cuda):
    """set(name ...), its value depending on TORCHFSDP_CUDA where the two
    builds differ."""
    if cpu == cuda:
        return cmake_list(name, [f'"{v}"' for v in cpu])
    return (["if(TORCHFSDP_CUDA)"] + cmake_list(name, [f'"{v}"' for v in cuda], "  ")
            + ["else()"] + cmake_list(name, [f'"{v}"' for v in cpu], "  ") + ["endif()"])


def pch_includes(root):
    """LIBTORCH_PCH_INCLUDES of third_party/libtorch_pch.bzl: what Bazel's
    precompiled header holds, which the CMake build precompiles too."""
    path = os.path.join(root, "third_party", "libtorch_pch.bzl")
    with open(path) as f:
        match = re.search(r"^LIBTORCH_PCH_INCLUDES = \[(.*?)\]", f.read(), re.S | re.M)
    if not match:
        raise BuildError(f"{path}: no LIBTORCH_PCH_INCLUDES = [...] list")
    return literals(match.group(1))


def nvcc_flags(root, rules, keys):
    """TORCHFSDP_NVCC_FLAGS: NVCC_FLAGS + CUDA_ARCHS of the .bzl file that
    each cuda_objects target's BUILD file loads the macro from (one file for
    all), without -Werror: like the C++ sources' flags in CMakeLists.txt, a
    warning of the GPU machine's own nvcc or host compiler must not stop a
    GPU run (the Bazel build keeps the code clean)."""
    bzl_files = set()
    for key in keys:
        build_path = rules[key][2]
        with open(os.path.join(root, build_path), encoding="utf-8") as f:
            match = re.search(r'^load\(\s*"([^"]+)"[^)]*"' + CUDA_OBJECTS + '"',
                              f.read(), re.M)
        if not match:
            raise BuildError(f"{display(key)}: {build_path} does not load {CUDA_OBJECTS} "
                             "from a .bzl file (load(\"...\", \"cuda_objects\"))")
        label = match.group(1)
        if label.startswith("@"):
            raise BuildError(f"{build_path}: {CUDA_OBJECTS} from {label}: only this "
                             "repository's .bzl files are read")
        if label.startswith("//"):
            package, _, name = label[2:].partition(":")
        else:
            package, name = key[0], label.lstrip(":")
        bzl_files.add("/".join(filter(None, (package, name))))
    if len(bzl_files) != 1:
        raise BuildError(f"{CUDA_OBJECTS} loaded from {sorted(bzl_files)}: expected one .bzl "
                         "file (TORCHFSDP_NVCC_FLAGS is one list)")
    bzl = bzl_files.pop()
    with open(os.path.join(root, bzl), encoding="utf-8") as f:
        text = f.read()
    flags = []
    for name in ("NVCC_FLAGS", "CUDA_ARCHS"):
        match = re.search(r"^" + name + r" = \[(.*?)\]", text, re.S | re.M)
        if not match:
            raise BuildError(f"{bzl}: no {name} = [...] list (tools/gpu_cmake.py reads the nvcc "
                             "flags from it)")
        flags += literals(match.group(1))
    out = []
    for flag in flags:
        if flag.startswith("-Werror"):
            continue
        if flag.startswith("-Xcompiler="):
            host = [f for f in flag[len("-Xcompiler="):].split(",") if f != "-Werror"]
            flag = "-Xcompiler=" + ",".join(host)
        out.append(flag)
    return bzl, out


def render(rules, root):
    binaries = []
    for label, target in BINARIES:
        key = parse_label(label, "")
        if key not in rules or rules[key][0] != "cc_binary":
            raise BuildError(f"{label}: not a cc_binary (tools/gpu_cmake.py BINARIES)")
        binaries.append((key, target))
    reached = closure(rules, [key for key, _ in binaries])
    binary_keys = {key for key, _ in binaries}
    libraries = sorted(key for key in reached if key not in binary_keys)
    info = {key: target_info(key, rules, reached[key], root) for key in list(reached)}
    names = {}
    for key in sorted(reached):
        other = names.setdefault(variable(key), key)
        if other != key:
            raise BuildError(f"{display(key)} and {display(other)} both map to the CMake "
                             f"name {variable(key)}: rename one or extend variable()")

    def srcs_variable(key, cuda=False):
        """TORCHFSDP_SRCS_comm, TORCHFSDP_CUDA_SRCS_comm, TORCHFSDP_BINARY_SRCS_trainer."""
        prefix = "TORCHFSDP_" + ("BINARY_" if key in binary_keys else "")
        name = dict(binaries)[key] if key in binary_keys else variable(key)
        return f"{prefix}{'CUDA_' if cuda else ''}SRCS_{name}"

    def srcs_lists(key):
        facts = info[key]
        if facts["kind"] == CUDA_OBJECTS:
            return cmake_list(f"TORCHFSDP_CU_SRCS_{variable(key)}",
                              [f'"${{REPO}}/{s}"' for s in facts["cu_srcs"]])
        out = cmake_list(srcs_variable(key), [f'"${{REPO}}/{s}"' for s in facts["srcs"]])
        if facts["cuda_srcs"]:
            out += cmake_list(srcs_variable(key, cuda=True),
                              [f'"${{REPO}}/{s}"' for s in facts["cuda_srcs"]])
        return out

    lines = [
        "# GENERATED by tools/gpu_cmake.py from the BUILD files: do not edit.",
        f"# Regenerate: {REGENERATE}",
        "# (//tools:gpu_cmake_test fails while this file differs from the BUILD files.)",
        "#",
        "# benchmarks/gpu/CMakeLists.txt includes it after setting REPO. For each project",
        "# cc_library in the transitive deps of the binaries below (a select()'s branches",
        "# all taken; what only a //third_party:cuda branch brings is marked CUDA only):",
        "# TORCHFSDP_SRCS_<name>, its .cc files. Then the binaries' own sources and",
        "# linkopts, what CMakeLists.txt builds (the .cu files of cuda_objects targets",
        "# and their nvcc flags among it), and each source file's local_defines.",
        "",
        section("libraries"),
    ]
    for key in libraries:
        facts = info[key]
        notes = [n for n, on in (("alwayslink", facts["alwayslink"]),
                                 ("cuda_objects: nvcc", facts["kind"] == CUDA_OBJECTS),
                                 ("CUDA only", facts["cuda_only"])) if on]
        lines.append(f"# {facts['label']}" + (f" ({', '.join(notes)})" if notes else ""))
        lines += srcs_lists(key)

    lines += ["", section("binaries")]
    for key, target in binaries:
        facts = info[key]
        own = closure(rules, [key])
        lines.append(f"# {facts['label']}: links "
                     f"{sum(1 for k in own if k != key)} project libraries")
        lines += srcs_lists(key)
        cpu, cuda = per_build([(own[k], info[k]["linkopts"]) for k in sorted(own)])
        lines += conditional_list(f"TORCHFSDP_LINKOPTS_{target}", cpu, cuda)
    lines.append("set(TORCHFSDP_BINARIES " + " ".join(t for _, t in binaries) + ")")

    # What CMakeLists.txt builds: one static library of every non-alwayslink
    # library (the linker takes from it what each binary needs), and the
    # alwayslink libraries' objects, which go into every binary.
    groups = {"LIBRARY": [], "CUDA_LIBRARY": [], "ALWAYSLINK": [], "CUDA_ALWAYSLINK": []}
    cuda_objects = [key for key in libraries if info[key]["kind"] == CUDA_OBJECTS]
    for key in libraries:
        facts = info[key]
        if facts["kind"] == CUDA_OBJECTS:
            continue
        kind = "ALWAYSLINK" if facts["alwayslink"] else "LIBRARY"
        groups[("CUDA_" if facts["cuda_only"] else "") + kind].append(
            f"${{{srcs_variable(key)}}}")
        if facts["cuda_srcs"]:
            groups["CUDA_" + kind].append(f"${{{srcs_variable(key, cuda=True)}}}")
    lines += [
        "",
        section("what CMakeLists.txt builds"),
        "# TORCHFSDP_LIBRARY_SRCS: one static library; TORCHFSDP_ALWAYSLINK_SRCS: objects",
        "# linked into each binary (alwayslink); the CUDA_ lists only when TORCHFSDP_CUDA.",
    ]
    for group, refs in groups.items():
        lines += cmake_list(f"TORCHFSDP_{group}_SRCS", refs)
    lines += [
        "# TORCHFSDP_CUDA_OBJECTS_SRCS: .cu files nvcc compiles with TORCHFSDP_NVCC_FLAGS",
        "# (only when TORCHFSDP_CUDA) into the static library, the binaries then linking",
        "# libcudart; each object depends on TORCHFSDP_CUDA_OBJECTS_HDRS.",
    ]
    lines += cmake_list("TORCHFSDP_CUDA_OBJECTS_SRCS",
                        [f"${{TORCHFSDP_CU_SRCS_{variable(k)}}}" for k in cuda_objects])
    lines += cmake_list("TORCHFSDP_CUDA_OBJECTS_HDRS", [
        f'"${{REPO}}/{h}"' for h in unique(h for k in cuda_objects for h in info[k]["cu_hdrs"])])
    if cuda_objects:
        bzl, flags = nvcc_flags(root, rules, cuda_objects)
        lines.append(f"# NVCC_FLAGS + CUDA_ARCHS of {bzl}, less -Werror")
    else:
        flags = []
    lines += cmake_list("TORCHFSDP_NVCC_FLAGS", [f'"{f}"' for f in flags])

    # Defines: a library's `defines` reach its dependents (here: everything);
    # local_defines only its own sources.
    cpu, cuda = per_build([(reached[k], info[k]["defines"]) for k in sorted(reached)])
    lines += conditional_list("TORCHFSDP_DEFINES", cpu, cuda)
    lines += ["", section("the precompiled LibTorch headers (third_party/libtorch_pch.bzl)")]
    lines += cmake_list("TORCHFSDP_PCH_HEADERS", [f"<{h}>" for h in pch_includes(root)])
    lines += ["", section("local_defines, per source file")]
    for key in sorted(reached):
        facts = info[key]
        cpu, cuda = per_build([(facts["cuda_only"], facts["local_defines"])])
        if not cpu and not cuda:
            continue
        refs = f"${{{srcs_variable(key)}}}"
        if facts["cuda_srcs"]:
            refs += f" ${{{srcs_variable(key, cuda=True)}}}"
        lines.append(f"# {facts['label']}")
        property_of = ("set_source_files_properties({refs} PROPERTIES COMPILE_DEFINITIONS "
                       '"{defines}")')
        if cpu == cuda:
            lines.append(property_of.format(refs=refs, defines=";".join(cpu)))
            continue
        lines.append("if(TORCHFSDP_CUDA)")
        lines.append("  " + property_of.format(refs=refs, defines=";".join(cuda)))
        if cpu:
            lines.append("else()")
            lines.append("  " + property_of.format(refs=refs, defines=";".join(cpu)))
        lines.append("endif()")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"update {OUTPUT}")
    mode.add_argument("--check", action="store_true",
                      help=f"fail when {OUTPUT} differs from the BUILD files")
    parser.add_argument("--root",
                        default=os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."),
                        help="the source tree (default: this script's repository)")
    args = parser.parse_args()
    root = os.path.realpath(args.root)

    try:
        text = render(read_rules(root), root)
    except BuildError as error:
        print(f"tools/gpu_cmake.py: {error}", file=sys.stderr)
        return 1
    if not args.write and not args.check:
        sys.stdout.write(text)
        return 0

    path = os.path.join(root, OUTPUT)
    current = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            current = f.read()
    if args.write:
        if current != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"{OUTPUT}: updated")
        else:
            print(f"{OUTPUT}: already up to date")
        return 0
    if current != text:
        print(f"{OUTPUT} differs from the BUILD files:" if current is not None
              else f"{OUTPUT} does not exist")
        sys.stdout.writelines(difflib.unified_diff(
            (current or "").splitlines(True), text.splitlines(True),
            f"{OUTPUT} (committed)", "from the BUILD files"))
        print(f"Regenerate it with: {REGENERATE}")
        return 1
    print(f"{OUTPUT} up to date with the BUILD files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
