#!/usr/bin/env python3
"""The source lists of the CMake GPU build, generated from the BUILD files.

    python3 tools/gpu_cmake.py           print benchmarks/gpu/sources.cmake as
                                         the BUILD files say it should be
    python3 tools/gpu_cmake.py --write   write benchmarks/gpu/sources.cmake
    python3 tools/gpu_cmake.py --check   exit 1 when benchmarks/gpu/sources.cmake
                                         differs (printing the diff and the
                                         command that regenerates it)
    python3 tools/gpu_cmake.py --self-test   the optional libraries' marking
                                         on small planted trees

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

Optional libraries (OPTIONAL_LIBRARIES below) are built only when CMake
finds the system libraries they need, else a stand-in of the same header is:
//trainer:text_data (the trainer's --tokenizer) needs tokenizer/, which needs
PCRE2, ICU and SentencePiece, which the GPU machine lacks. What only an
optional library brings is marked as built with its switch
(TORCHFSDP_<NAME>_LIBRARY_SRCS, when CMakeLists.txt sets
TORCHFSDP_WITH_<NAME>), its stand-in's as built without
(TORCHFSDP_NO_<NAME>_LIBRARY_SRCS), as CUDA-only labels are marked; a
library built either way that depends on one of the optional library's
external repositories (@pcre2, @icu, @sentencepiece) is an error, as is a
stand-in whose hdrs differ from the library's. Bazel always builds the library itself.

cuda_objects targets (kernels/cuda.bzl: .cu files compiled by nvcc, no
LibTorch) must be reached only through //third_party:cuda branches (the
CPU-only build has no nvcc); their .cu sources and headers go into
TORCHFSDP_CUDA_OBJECTS_SRCS / _HDRS, and the nvcc flags into
TORCHFSDP_NVCC_FLAGS, read from the NVCC_FLAGS and CUDA_ARCHS lists of the
.bzl file the BUILD file loads cuda_objects from (so the architectures cannot
drift from Bazel's), less -Werror, as for the C++ sources.

Reads the BUILD files with tools/deps_diagram.py's parser (no `bazel query`,
so it runs inside a test). Python 3 standard library only.
//tools:gpu_cmake_test runs --self-test (the optional libraries' marking on
small planted trees: each rule above, and each refusal) and --check.
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

# (library, its stand-in, NAME, the external repositories only the library
# may bring): the CMake build links the library when CMakeLists.txt sets
# TORCHFSDP_WITH_<NAME> (it found those repositories' system libraries),
# else the stand-in, a library of the same hdrs that needs none of them.
OPTIONAL_LIBRARIES = [
    ("//trainer:text_data", "//trainer:text_data_unavailable", "TOKENIZER",
     ("@pcre2", "@icu", "@sentencepiece")),
]

# When a label is built (closure()): "always", "cuda" (TORCHFSDP_CUDA),
# NAME (an optional library's: TORCHFSDP_WITH_NAME) or "NO_" + NAME (its
# stand-in's: not TORCHFSDP_WITH_NAME).
ALWAYS = "always"
CUDA = "cuda"


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


def combine(outer, inner, where):
    """The condition of a label reached under `inner` from a path built
    under `outer`: a label needs both, and only one can be said per label."""
    if outer == ALWAYS or outer == inner:
        return inner
    if inner == ALWAYS:
        return outer
    raise BuildError(f"{where}: built only under {outer} and only under {inner}: one label "
                     "under two conditions is not supported (tools/gpu_cmake.py)")


def optional_libraries(rules):
    """{library key: (stand-in key, NAME, externals)} of OPTIONAL_LIBRARIES,
    checked: both are cc_libraries with the same hdrs."""
    out = {}
    for label, stand_in, name, externals in OPTIONAL_LIBRARIES:
        key, stand_in_key = parse_label(label, ""), parse_label(stand_in, "")
        for k in (key, stand_in_key):
            if k not in rules or rules[k][0] != "cc_library":
                raise BuildError(f"{display(k)}: not a cc_library (tools/gpu_cmake.py "
                                 "OPTIONAL_LIBRARIES)")
        hdrs = [sorted(literals(rules[k][1].get("hdrs", ""))) for k in (key, stand_in_key)]
        if hdrs[0] != hdrs[1]:
            raise BuildError(f"{stand_in} (hdrs {hdrs[1]}) stands in for {label} (hdrs "
                             f"{hdrs[0]}) in the CMake build without {name}: expected the same "
                             "hdrs, the header both implement")
        out[key] = (stand_in_key, name, tuple(externals))
    return out


def closure(rules, root_keys):
    """{key: condition} over the transitive deps of root_keys (the roots
    included, always): ALWAYS, CUDA (only //third_party:cuda branches lead
    there), an optional library's NAME (only it leads there) or "NO_" +
    NAME (only its stand-in does)."""
    optional = optional_libraries(rules)
    stand_ins = {stand_in: (name, key) for key, (stand_in, name, _) in optional.items()}
    guarded = {}  # external repository -> (NAME, the library that may bring it)
    for key, (_, name, externals) in optional.items():
        for external in externals:
            guarded[external] = (name, key)
    seen = {}  # key -> the conditions it was reached under
    stack = [(key, ALWAYS) for key in root_keys]
    while stack:
        key, condition = stack.pop()
        if key in optional and condition != optional[key][1]:
            # Reached from the build: the library under its switch, its
            # stand-in without it.
            stand_in, name, _ = optional[key]
            stack.append((key, combine(condition, name, display(key))))
            stack.append((stand_in, combine(condition, "NO_" + name, display(stand_in))))
            continue
        if key in stand_ins and condition != "NO_" + stand_ins[key][0]:
            name, library = stand_ins[key]
            raise BuildError(f"{display(key)} is {display(library)}'s stand-in (tools/"
                             f"gpu_cmake.py OPTIONAL_LIBRARIES), yet reached itself: both "
                             "would be linked, defining the same functions; depend on "
                             f"{display(library)}")
        conditions = seen.setdefault(key, set())
        if ALWAYS in conditions or condition in conditions:
            continue  # nothing new reachable from here
        conditions.add(condition)
        if key not in rules:
            raise BuildError(f"{display(key)}: no such target in "
                             f"{key[0] or '.'}/BUILD")
        kind, attributes, path = rules[key]
        if kind == "alias":
            actuals = literals(attributes.get("actual", ""))
            stack.append((parse_label(actuals[0], key[0]), condition))
            continue
        if kind == CUDA_OBJECTS:
            if condition != CUDA:
                # A CPU-only CMake build (TORCHFSDP_CUDA=OFF) has no nvcc.
                raise BuildError(f"{display(key)} ({path}) is a {CUDA_OBJECTS} target reached "
                                 f"outside a {CUDA_CONDITION} branch: select it (or the "
                                 "library that needs it) under --config=cuda only")
            continue  # no deps: nvcc objects and libcudart
        if kind not in ("cc_library", "cc_binary"):
            raise BuildError(f"{display(key)} ({path}) is a {kind}: expected a cc_library "
                             f"or {CUDA_OBJECTS}")
        for attribute in ("deps", "implementation_deps"):
            for when, label in conditional_values(attributes.get(attribute, ""),
                                                  f"{display(key)} {attribute}"):
                dep = parse_label(label, key[0])
                if dep is None:
                    repository = label.split("//", 1)[0]
                    if repository in guarded and condition != guarded[repository][0]:
                        name, library = guarded[repository]
                        raise BuildError(
                            f"{display(key)} ({path}) depends on {label}, which only "
                            f"{display(library)} may bring: the CMake build without {name} "
                            f"(where CMake finds no {repository[1:]}) would build it too; "
                            f"reach it through {display(library)} (tools/gpu_cmake.py "
                            "OPTIONAL_LIBRARIES)")
                    continue
                if dep[0].split("/", 1)[0] == "third_party":
                    continue
                # Every branch's labels; a CUDA branch's only under CUDA.
                stack.append((dep, combine(condition, CUDA, display(dep)) if when == "cuda"
                              else condition))
    reached = {}
    for key, conditions in seen.items():
        # Built with an optional library and without it: built always.
        for name in {c for c in conditions if "NO_" + c in conditions}:
            conditions -= {name, "NO_" + name}
            conditions.add(ALWAYS)
        if ALWAYS in conditions:
            reached[key] = ALWAYS
        elif len(conditions) == 1:
            reached[key] = next(iter(conditions))
        else:
            raise BuildError(f"{display(key)}: built only under {' or '.join(sorted(conditions))}"
                             ": a label built under either of two conditions is not supported "
                             "(tools/gpu_cmake.py)")
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


def target_info(key, rules, condition, root):
    """The CMake-relevant facts of one cc_library, cc_binary or cuda_objects
    built under `condition` (closure())."""
    kind, attributes, path = rules[key]
    where = display(key)
    if kind == CUDA_OBJECTS:
        empty = {"always": [], "cuda": [], "not cuda": []}
        return {
            "label": where, "kind": kind, "condition": CUDA, "cuda_only": True,
            "alwayslink": False,
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

    if condition not in (ALWAYS, CUDA):
        # An optional library's (or its stand-in's) defines and linkopts
        # would reach the whole CMake build, whichever is linked.
        for attribute in ("defines", "linkopts"):
            if any(values(attribute).values()):
                raise BuildError(f"{where}: {attribute} in a library built only under {condition}"
                                 ": not supported (tools/gpu_cmake.py; CMakeLists.txt sets what "
                                 "the optional library's system libraries need)")
    return {
        "label": where,
        "kind": kind,
        "condition": condition,
        "cuda_only": condition == CUDA,
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
    for label, stand_in, _, _ in OPTIONAL_LIBRARIES:
        if parse_label(label, "") not in reached:
            raise BuildError(f"{label} (tools/gpu_cmake.py OPTIONAL_LIBRARIES): neither binary "
                             f"depends on it: remove its entry (and {stand_in} if unused)")
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
        "# all taken; what only a //third_party:cuda branch brings is marked CUDA only,",
        "# what only an optional library or its stand-in brings, with or without it):",
        "# TORCHFSDP_SRCS_<name>, its .cc files. Then the binaries' own sources and",
        "# linkopts, what CMakeLists.txt builds (the .cu files of cuda_objects targets",
        "# and their nvcc flags among it), and each source file's local_defines.",
        "",
        section("libraries"),
    ]
    for key in libraries:
        facts = info[key]
        condition = facts["condition"]
        notes = [n for n, on in (
            ("alwayslink", facts["alwayslink"]),
            ("cuda_objects: nvcc", facts["kind"] == CUDA_OBJECTS),
            ("CUDA only", facts["cuda_only"]),
            (f"only with TORCHFSDP_WITH_{condition}", condition not in (ALWAYS, CUDA)
             and not condition.startswith("NO_")),
            (f"only without TORCHFSDP_WITH_{condition[3:]}", condition.startswith("NO_")),
        ) if on]
        lines.append(f"# {facts['label']}" + (f" ({', '.join(notes)})" if notes else ""))
        lines += srcs_lists(key)

    lines += ["", section("binaries")]
    for key, target in binaries:
        facts = info[key]
        own = closure(rules, [key])
        lines.append(f"# {facts['label']}: links "
                     f"{sum(1 for k in own if k != key)} project libraries")
        lines += srcs_lists(key)
        cpu, cuda = per_build([(own[k] == CUDA, info[k]["linkopts"]) for k in sorted(own)])
        lines += conditional_list(f"TORCHFSDP_LINKOPTS_{target}", cpu, cuda)
    lines.append("set(TORCHFSDP_BINARIES " + " ".join(t for _, t in binaries) + ")")

    # What CMakeLists.txt builds: one static library of every non-alwayslink
    # library (the linker takes from it what each binary needs), and the
    # alwayslink libraries' objects, which go into every binary.
    prefixes = {ALWAYS: "", CUDA: "CUDA_"}
    for _, _, name, _ in OPTIONAL_LIBRARIES:
        prefixes[name] = name + "_"
        prefixes["NO_" + name] = "NO_" + name + "_"
    groups = {prefix + kind: [] for kind in ("LIBRARY", "ALWAYSLINK")
              for prefix in ("", "CUDA_")}
    groups.update({prefix + kind: [] for prefix in list(prefixes.values())[2:]
                   for kind in ("LIBRARY", "ALWAYSLINK")})
    cuda_objects = [key for key in libraries if info[key]["kind"] == CUDA_OBJECTS]
    for key in libraries:
        facts = info[key]
        if facts["kind"] == CUDA_OBJECTS:
            continue
        kind = "ALWAYSLINK" if facts["alwayslink"] else "LIBRARY"
        groups[prefixes[facts["condition"]] + kind].append(f"${{{srcs_variable(key)}}}")
        if facts["cuda_srcs"]:
            groups["CUDA_" + kind].append(f"${{{srcs_variable(key, cuda=True)}}}")
    lines += [
        "",
        section("what CMakeLists.txt builds"),
        "# TORCHFSDP_LIBRARY_SRCS: one static library; TORCHFSDP_ALWAYSLINK_SRCS: objects",
        "# linked into each binary (alwayslink); the CUDA_ lists only when TORCHFSDP_CUDA;",
        "# an optional library's (tools/gpu_cmake.py OPTIONAL_LIBRARIES) NAME_ lists only",
        "# when TORCHFSDP_WITH_NAME (CMake found its system libraries), its stand-in's",
        "# NO_NAME_ lists only when not.",
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
    cpu, cuda = per_build([(reached[k] == CUDA, info[k]["defines"]) for k in sorted(reached)])
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


# ---- --self-test: the marking of optional libraries ------------------------

# A small tree shaped like the real one around OPTIONAL_LIBRARIES' entry:
# the trainer reaches //trainer:text_data, which reaches @pcre2 and @icu
# through tokenizer/; the stand-in does not. Each case changes some BUILD
# files and says what closure() must answer: conditions, or an error.
SELF_TEST_BUILDS = {
    "third_party/libtorch_pch.bzl": 'LIBTORCH_PCH_INCLUDES = ["torch/types.h"]\n',
    "trainer/BUILD": """
cc_binary(name = "trainer", srcs = ["main.cc"], deps = [":train"])
cc_library(name = "train", srcs = ["train.cc"], deps = [":text_data", "//comm"])
cc_library(name = "text_data", srcs = ["text_data.cc"], hdrs = ["text_data.h"],
           deps = ["//tokenizer", "//comm", "@com_google_absl//absl/status"])
cc_library(name = "text_data_unavailable", srcs = ["text_data_unavailable.cc"],
           hdrs = ["text_data.h"], deps = ["//comm"])
""",
    "tokenizer/BUILD": """
cc_library(name = "tokenizer", srcs = ["tokenizer.cc"], deps = [":internal"])
cc_library(name = "internal", srcs = ["regex.cc"], deps = ["@pcre2", "@icu//:icu"])
""",
    "comm/BUILD": 'cc_library(name = "comm", srcs = ["comm.cc"])\n',
    "benchmarks/BUILD": 'cc_binary(name = "gpu_check", srcs = ["gpu_check.cc"], deps = ["//comm"])\n',
}
SELF_TEST_SOURCES = ["trainer/main.cc", "trainer/train.cc", "trainer/text_data.cc",
                     "trainer/text_data.h", "trainer/text_data_unavailable.cc",
                     "tokenizer/tokenizer.cc", "tokenizer/regex.cc", "comm/comm.cc",
                     "benchmarks/gpu_check.cc"]
SELF_TEST_CASES = [
    # (what, {path: (old, new)} edits of SELF_TEST_BUILDS, expected: a dict
    # {label: condition} that closure() must include, or an error's words)
    ("the library's labels with it, the stand-in's without, the rest always", {},
     {"//trainer:text_data": "TOKENIZER", "//tokenizer:tokenizer": "TOKENIZER",
      "//tokenizer:internal": "TOKENIZER", "//trainer:text_data_unavailable": "NO_TOKENIZER",
      "//comm:comm": ALWAYS, "//trainer:train": ALWAYS}),
    ("the build reaching the library's own dependencies itself",
     {"trainer/BUILD": ('deps = [":text_data", "//comm"]', 'deps = [":text_data", "//comm", "//tokenizer"]')},
     "//tokenizer:internal (tokenizer/BUILD) depends on @pcre2, which only "
     "//trainer:text_data may bring"),
    ("a label the library and its stand-in both reach is built always",
     {"trainer/BUILD": ('hdrs = ["text_data.h"], deps = ["//comm"])',
                        'hdrs = ["text_data.h"], deps = ["//comm", "//shared"])'),
      "tokenizer/BUILD": ('deps = [":internal"]', 'deps = [":internal", "//shared"]'),
      "shared/BUILD": (None, 'cc_library(name = "shared", srcs = ["shared.cc"])\n')},
     {"//shared:shared": ALWAYS, "//tokenizer:tokenizer": "TOKENIZER"}),
    ("a library built always that needs @icu",
     {"comm/BUILD": ('srcs = ["comm.cc"]', 'srcs = ["comm.cc"], deps = ["@icu//:icu"]')},
     "//comm:comm (comm/BUILD) depends on @icu//:icu, which only //trainer:text_data may "
     "bring: the CMake build without TOKENIZER"),
    ("a stand-in of other hdrs",
     {"trainer/BUILD": ('hdrs = ["text_data.h"], deps = ["//comm"])',
                        'hdrs = ["other.h"], deps = ["//comm"])')},
     "//trainer:text_data_unavailable (hdrs ['other.h']) stands in for //trainer:text_data"),
    ("the stand-in reached itself",
     {"trainer/BUILD": ('deps = [":text_data", "//comm"]',
                        'deps = [":text_data", ":text_data_unavailable"]')},
     "//trainer:text_data_unavailable is //trainer:text_data's stand-in"),
    ("the library reached only under CUDA",
     {"trainer/BUILD": ('deps = [":text_data", "//comm"]',
                        'deps = ["//comm"] + select({"//third_party:cuda": [":text_data"], '
                        '"//conditions:default": []})')},
     "built only under cuda and only under TOKENIZER"),
    ("linkopts in the library",
     {"trainer/BUILD": ('deps = ["//tokenizer", "//comm", "@com_google_absl//absl/status"])',
                        'deps = ["//tokenizer"], linkopts = ["-licuuc"])')},
     "//trainer:text_data: linkopts in a library built only under TOKENIZER"),
    ("the library no binary reaches",
     {"trainer/BUILD": ('deps = [":text_data", "//comm"]', 'deps = ["//comm"]')},
     "//trainer:text_data (tools/gpu_cmake.py OPTIONAL_LIBRARIES): neither binary depends on it"),
]


def self_test():
    """Runs SELF_TEST_CASES on temporary trees; 0 when each gives what it
    expects."""
    import tempfile
    failures = 0
    for what, edits, expected in SELF_TEST_CASES:
        files = dict(SELF_TEST_BUILDS)
        for path, (old, new) in edits.items():
            if old is None:
                files[path] = new
                continue
            if old not in files[path]:
                raise AssertionError(f"self-test case {what!r}: {old!r} not in {path}")
            files[path] = files[path].replace(old, new)
        with tempfile.TemporaryDirectory() as root:
            for path, text in list(files.items()) + [(p, "") for p in SELF_TEST_SOURCES] + [
                    ("shared/shared.cc", "")]:
                os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                    f.write(text)
            try:
                rules = read_rules(root)
                text = render(rules, root)
                got = {display(k): c for k, c in closure(rules, [("trainer", "trainer"),
                                                                 ("benchmarks", "gpu_check")]).items()}
            except BuildError as error:
                got, text = str(error), ""
        if isinstance(expected, str):
            ok = isinstance(got, str) and expected in got
        else:
            ok = isinstance(got, dict) and all(got.get(k) == v for k, v in expected.items())
            # What the CMake build takes from the marking.
            ok = ok and (expected.get("//trainer:text_data_unavailable") != "NO_TOKENIZER" or (
                "set(TORCHFSDP_NO_TOKENIZER_LIBRARY_SRCS\n  ${TORCHFSDP_SRCS_trainer__"
                "text_data_unavailable}\n)" in text and
                "set(TORCHFSDP_TOKENIZER_LIBRARY_SRCS\n  ${TORCHFSDP_SRCS_tokenizer__internal}\n"
                "  ${TORCHFSDP_SRCS_tokenizer}\n  ${TORCHFSDP_SRCS_trainer__text_data}\n)" in text))
        print(f"self-test: {'ok' if ok else 'FAILED'}: {what}"
              + ("" if ok else f": expected {expected!r}, got {got!r}"))
        failures += not ok
    if failures:
        print(f"self-test failed: {failures} of {len(SELF_TEST_CASES)} cases")
        return 1
    print(f"self-test: the {len(SELF_TEST_CASES)} cases of OPTIONAL_LIBRARIES' marking passed")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"update {OUTPUT}")
    mode.add_argument("--check", action="store_true",
                      help=f"fail when {OUTPUT} differs from the BUILD files")
    mode.add_argument("--self-test", action="store_true",
                      help="check the marking of optional libraries on small planted trees")
    parser.add_argument("--root",
                        default=os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."),
                        help="the source tree (default: this script's repository)")
    args = parser.parse_args()
    root = os.path.realpath(args.root)
    if args.self_test:
        return self_test()

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
