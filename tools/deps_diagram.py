#!/usr/bin/env python3
"""The package dependency diagram, generated from the BUILD files, and the
layering checked against the BUILD files and the #include lines.

    python3 tools/deps_diagram.py             print the diagram
    python3 tools/deps_diagram.py --write     put it into README.md (between the
                                              deps-diagram markers)
    python3 tools/deps_diagram.py --check     exit 1 when README.md's copy differs
                                              (printing the diff), on a cycle or an
                                              upward arrow (BUILD or #include), on a
                                              package not placed in LAYERS, or when a
                                              component's README misses one of its
                                              .h/.cc files
    python3 tools/deps_diagram.py --self-test plant arrows in a small temporary tree
                                              and check that --check's include rule
                                              finds exactly them

Reads the BUILD files with a small parser (no `bazel query`, so it runs inside
a test): a package's arrows are the labels in the deps, srcs, hdrs, data and
actual attributes of its production targets (not tests, not testonly
targets: a test may use anything). The diagram shows these arrows.

The #include lines are read too, so that a dependency a BUILD file does not
declare (or declares through another target) cannot run up the house either.
Every production file is read: a .cc or .h file under a package's folder
(the package is the nearest folder above it with a BUILD file), except
  - a file named `*_test.cc`;
  - a file in a folder named `testing`, `fuzz` or `testdata` at any depth
    (test helpers, fuzz targets and fixtures: `comm/testing/`, `testing/`,
    `comm/fuzz/`);
  - a file that its package's BUILD names only in the srcs / hdrs /
    textual_hdrs of test rules (`*_test`) and `testonly` targets
    (`launcher/launch_test_child.cc`, `tests/fsdp_test_models.h`).
Each `#include "path"` whose path is a file of this repository (from the
root, else from the including file's folder; `<...>` includes and quoted
ones of other repositories, such as "absl/...", are not ours) is an arrow
from the file's package to the included file's package. An arrow within one
package is fine; one to a lower layer is fine; one to the same layer (another
package) or above fails --check, as a BUILD arrow does, naming the file and
line. So does a production file that includes a test-only file (one of the
first two kinds above), or a file of a package not placed in LAYERS.
Python 3 standard library only. //tools:deps_diagram_test runs --self-test
and --check.
"""

import argparse
import difflib
import os
import re
import sys

# The intended layering, bottom first. A package may depend only on packages
# in lower layers; an arrow to its own layer or above is reported as upward.
# Every Bazel package with production targets must be listed here (a new one
# fails --check until it is placed).
LAYERS = [
    # kernels: fused ops for models/ (LibTorch and CUDA only)
    ["functorch/module", "functorch/transforms", "comm", "module_call", "host", "formats",
     "optim", "tokenizer", "kernels"],
    # models: on module_call (each decoder layer through the call point)
    ["fsdp", "activation_checkpointing", "launcher", "state_dict", "models"],  # state_dict: on formats
    # testing: testonly helpers (RunOnRanks) above the launcher; not drawn,
    # since the diagram shows production targets only.
    ["state_dict/fsdp", "testing"],
    ["state_dict/fully_shard"],  # FSDP2's state dicts, on FSDP1's (state_dict/fsdp)
    ["trainer"],
    ["", "tools", "benchmarks"],  # "" is the root package (//:trainer)
]

# Folders whose README need not have a complete "Where the code is" table
# yet, with why. Remove an entry when its README lists every file (--check
# says when an entry is no longer needed).
README_TABLE_EXCEPTIONS = {
}

# External repositories, by the name the diagram gives them.
EXTERNAL_NAMES = {
    "libtorch": "LibTorch",
    "com_google_absl": "Abseil",
    "cli11": "CLI11",
    "nlohmann_json": "nlohmann-json",
    "libdeflate": "libdeflate",
    "com_github_google_benchmark": "Google Benchmark",
    "com_google_googletest": "GoogleTest",
    "pcre2": "PCRE2",
    "icu": "ICU",
    "sentencepiece": "SentencePiece",
}
# Packages of this repository that stand for something outside it.
THIRD_PARTY_PACKAGES = {"third_party": "CUDA"}

DEP_ATTRIBUTES = ("deps", "implementation_deps", "srcs", "hdrs", "data", "actual")
BEGIN_MARKER = "<!-- deps-diagram:begin"
END_MARKER = "<!-- deps-diagram:end -->"
REGENERATE = "python3 tools/deps_diagram.py --write"
SKIPPED_DIRS = {".git", "third_party", "__pycache__"}
LINE_WIDTH = 100


# ---- BUILD files ----------------------------------------------------------

def strip_comments(text):
    """BUILD text with # comments blanked (strings kept)."""
    out, i, n = [], 0, len(text)
    quote = None
    while i < n:
        c = text[i]
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            out.append(c)
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def scan_brackets(text, start=0):
    """Yields (index, character, bracket depth after it) for each character
    of text from start that is outside a string literal; ([{ open a level,
    )]} close one."""
    depth, quote, i = 0, None, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        else:
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            yield i, c, depth
        i += 1


def split_top_level(body):
    """Splits the text between a call's parentheses at depth-0 commas."""
    parts, start = [], 0
    for i, c, depth in scan_brackets(body):
        if c == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def closing_paren(text, open_index):
    """The index just past the bracket that closes text[open_index] (strings
    skipped), or None when it is never closed."""
    for i, c, depth in scan_brackets(text, open_index):
        if c in ")]}" and depth == 0:
            return i + 1
    return None


def parse_build(text):
    """[(rule kind, {attribute: value text})] for the top-level calls."""
    text = strip_comments(text)
    rules = []
    for match in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*)\s*\(", text, re.M):
        i = closing_paren(text, match.end() - 1) or len(text)
        attributes = {}
        for part in split_top_level(text[match.end():i - 1]):
            key, eq, value = part.partition("=")
            if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
                attributes[key.strip()] = value.strip()
        rules.append((match.group(1), attributes))
    return rules


def string_literals(value):
    value = re.sub(r"(\"[^\"]*\"|'[^']*')\s*:", "", value)  # select() keys are no deps
    return re.findall(r'"([^"\\]*)"|\'([^\'\\]*)\'', value)


def resolve(label, package):
    """(kind, name) of what a label points at: ("package", "comm"),
    ("external", "LibTorch"), or None for a file of the same package."""
    if label.startswith("@"):
        repo = label[1:].split("//", 1)[0]
        return ("external", EXTERNAL_NAMES.get(repo, repo))
    if label.startswith("//"):
        target_package = label[2:].split(":", 1)[0]
        top = target_package.split("/", 1)[0]
        if top in THIRD_PARTY_PACKAGES:
            return ("external", THIRD_PARTY_PACKAGES[top])
        return ("package", target_package)
    return None  # ":name" or "file.cc": this package


def find_build_files(root):
    found = []
    for directory, dirs, files in os.walk(root):
        rel = os.path.relpath(directory, root)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        dirs[:] = sorted(
            d for d in dirs
            if d not in SKIPPED_DIRS and not d.startswith("bazel-") and not d.startswith(".")
        )
        if "BUILD" in files or "BUILD.bazel" in files:
            name = "BUILD" if "BUILD" in files else "BUILD.bazel"
            found.append((rel, os.path.join(directory, name)))
    return found


def read_graph(root):
    """{package: {"deps": set, "externals": set}} for packages with production
    targets; arrows within a package are dropped."""
    graph = {}
    for package, path in find_build_files(root):
        with open(path, encoding="utf-8") as f:
            rules = parse_build(f.read())
        for kind, attributes in rules:
            if kind.endswith("_test") or kind in ("config_setting", "package", "load",
                                                   "exports_files", "licenses"):
                continue
            if "name" not in attributes:
                continue
            if attributes.get("testonly", "False").strip() in ("True", "1"):
                continue
            node = graph.setdefault(package, {"deps": set(), "externals": set()})
            for attribute in DEP_ATTRIBUTES:
                for double, single in string_literals(attributes.get(attribute, "")):
                    target = resolve(double or single, package)
                    if target is None:
                        continue
                    if target[0] == "external":
                        node["externals"].add(target[1])
                    elif target[1] != package:
                        node["deps"].add(target[1])
    return graph


# ---- #include lines ------------------------------------------------------

INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
SOURCE_SUFFIXES = (".cc", ".h")
TEST_FOLDERS = {"testing", "fuzz", "testdata"}
FILE_ATTRIBUTES = ("srcs", "hdrs", "textual_hdrs")


def package_of(path, packages):
    """The package (a folder with a BUILD file) that holds `path`, a file
    relative to the root; None outside every package."""
    folder = os.path.dirname(path)
    while True:
        if folder in packages:
            return folder
        if not folder:
            return None
        folder = os.path.dirname(folder)


def label(package):
    return "//" + package if package else "the root package //"


def in_test_folder(path):
    return any(part in TEST_FOLDERS for part in path.split("/")[:-1])


def test_only_files(root, package, build_path):
    """Files (relative to the root) that the package's BUILD names only in
    test rules and testonly targets."""
    with open(build_path, encoding="utf-8") as f:
        rules = parse_build(f.read())
    test_named, production_named = set(), set()
    for kind, attributes in rules:
        test_only = (kind.endswith("_test")
                     or attributes.get("testonly", "False").strip() in ("True", "1"))
        for attribute in FILE_ATTRIBUTES:
            for double, single in string_literals(attributes.get(attribute, "")):
                name = (double or single).lstrip(":")
                if name.startswith(("//", "@")):
                    continue
                path = package + "/" + name if package else name
                (test_named if test_only else production_named).add(path)
    return test_named - production_named


def production_files(root):
    """{path: package} for every production .cc/.h file (see the docstring)."""
    builds = find_build_files(root)
    packages = {package for package, _ in builds}
    excluded = set()
    for package, build_path in builds:
        excluded |= test_only_files(root, package, build_path)
    files = {}
    for directory, dirs, names in os.walk(root):
        rel = os.path.relpath(directory, root)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        dirs[:] = sorted(
            d for d in dirs
            if d not in SKIPPED_DIRS and not d.startswith("bazel-") and not d.startswith(".")
        )
        for name in sorted(names):
            path = rel + "/" + name if rel else name
            if (not name.endswith(SOURCE_SUFFIXES) or name.endswith("_test.cc")
                    or in_test_folder(path) or path in excluded):
                continue
            package = package_of(path, packages)
            if package is not None:
                files[path] = package
    return files, packages


def include_arrows(root):
    """[(file, line number, included path, from package, to package)] for the
    #include lines of production files that name a file of another package."""
    files, packages = production_files(root)
    arrows = []
    for path, package in sorted(files.items()):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        for number, line in enumerate(lines, 1):
            match = INCLUDE_LINE.match(line)
            if not match:
                continue
            included = match.group(1)
            from_root = os.path.normpath(included)
            beside = os.path.normpath(os.path.join(os.path.dirname(path), included))
            if not from_root.startswith("..") and os.path.isfile(os.path.join(root, from_root)):
                target = from_root.replace(os.sep, "/")
            elif not beside.startswith("..") and os.path.isfile(os.path.join(root, beside)):
                target = beside.replace(os.sep, "/")
            else:
                continue  # not a file of this repository
            target_package = package_of(target, packages)
            if target_package is None or (target_package == package
                                          and not in_test_folder(target)):
                continue
            arrows.append((path, number, included, package, target_package, target))
    return arrows


def include_problems(root, layers_list=None):
    layers = layer_of(layers_list)
    problems, unplaced = [], set()
    for path, number, included, package, dep, target in include_arrows(root):
        where = f'{path}:{number}: #include "{included}"'
        if in_test_folder(target) or target.endswith("_test.cc"):
            problems.append(f"{where}: a production file of {label(package)} includes a "
                            "test-only file (testing/, fuzz/ or testdata/ folder): expected "
                            "production code only")
        elif package not in layers or dep not in layers:
            missing = package if package not in layers else dep
            if missing not in unplaced:  # once per package: the first include says it
                unplaced.add(missing)
                problems.append(f"{where}: {label(package)} -> {label(dep)}, and "
                                f"{label(missing)} is not placed in LAYERS "
                                "(tools/deps_diagram.py)")
        elif layers[dep] >= layers[package]:
            direction = "upward" if layers[dep] > layers[package] else "sideways"
            problems.append(
                f"{direction} include: {where}: {label(package)} (layer {layers[package]}) -> "
                f"{label(dep)} (layer {layers[dep]}): expected an include of its own package "
                "or a lower layer only")
    return problems


# ---- checks -------------------------------------------------------------

def layer_of(layers_list=None):
    return {package: i for i, layer in enumerate(layers_list or LAYERS) for package in layer}


def find_cycles(graph):
    """Strongly connected components with more than one package (Tarjan)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {}).get("deps", ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def graph_problems(graph):
    layers = layer_of()
    problems = []
    for package in sorted(graph):
        if package not in layers:
            problems.append(
                f"package //{package} is not placed in LAYERS (tools/deps_diagram.py): "
                "add it to the layer it belongs to")
    for package in sorted(graph):
        for dep in sorted(graph[package]["deps"]):
            if dep not in graph:
                problems.append(f"//{package} depends on //{dep}, which has no production "
                                "targets (a test-only or missing package)")
            elif package in layers and dep in layers and layers[dep] >= layers[package]:
                problems.append(
                    f"upward arrow: //{package} (layer {layers[package]}) -> //{dep} "
                    f"(layer {layers[dep]}): expected a dependency on a lower layer only")
    for cycle in find_cycles(graph):
        problems.append("cycle: " + " <-> ".join("//" + p for p in cycle))
    return problems


# ---- the diagram ----------------------------------------------------------

def display(package):
    return "//:trainer" if package == "" else package + "/"


def render(graph):
    layers = layer_of()
    width = max(len(display(p)) for p in graph)
    lines = ["```text",
             "layer  package" + " " * (width - 7) + "  depends on (project packages; [external])"]
    for number in range(len(LAYERS) - 1, -1, -1):
        for package in LAYERS[number]:
            if package not in graph:
                continue
            node = graph[package]
            deps = sorted(node["deps"], key=lambda d: (-layers.get(d, -1), d))
            words = [display(d) + "," for d in deps]
            externals = [e + "," for e in sorted(node["externals"])]
            for group in (words, externals):
                if group:
                    group[-1] = group[-1][:-1]
            if externals:
                externals[0] = "[" + externals[0]
                externals[-1] += "]"
            prefix = f"{number:>5}  {display(package):<{width}}  "
            line = prefix
            for word in words + externals:  # wrapped at LINE_WIDTH
                if len(line) + len(word) > LINE_WIDTH and len(line) > len(prefix):
                    lines.append(line.rstrip())
                    line = " " * len(prefix)
                line += word + " "
            lines.append(line.rstrip())
    lines.append("```")
    return "\n".join(lines) + "\n"


def readme_block(readme_text):
    begin = readme_text.find(BEGIN_MARKER)
    end = readme_text.find(END_MARKER)
    if begin < 0 or end < begin:
        return None
    begin = readme_text.index("\n", begin) + 1
    return begin, end


# ---- README "Where the code is" tables ------------------------------------

def component_folders(graph, root):
    """The folders of the diagram's library packages (not the root, tools,
    benchmarks)."""
    return sorted(p for p in graph if p and p not in ("tools", "benchmarks")
                  and os.path.isdir(os.path.join(root, p)))


def code_files(root, folder, packages):
    """The .h/.cc files under `folder`, relative to it, without those of
    subfolders that are packages of the diagram or have a README of their own
    (those map their own files)."""
    files = []
    top = os.path.join(root, folder)
    for directory, dirs, names in os.walk(top):
        rel_dir = os.path.relpath(directory, top).replace(os.sep, "/")
        if rel_dir != "." and (folder + "/" + rel_dir in packages
                               or os.path.exists(os.path.join(directory, "README.md"))):
            dirs[:] = []
            continue
        dirs.sort()
        for name in sorted(names):
            if name.endswith((".h", ".cc")):
                files.append(name if rel_dir == "." else rel_dir + "/" + name)
    return files


def where_the_code_is(readme_text):
    """The text of the README's "Where the code is" / "What is where" section."""
    match = re.search(r"^(#+)\s*(where the code is|what is where)\b.*$", readme_text,
                      re.I | re.M)
    if not match:
        return None
    level = len(match.group(1))
    rest = readme_text[match.end():]
    following = re.search(r"^#{1,%d}\s" % level, rest, re.M)
    return rest[:following.start()] if following else rest


def mentioned(section, path):
    """Whether `path` (relative to the folder) is named in the section:
    as itself, as its basename, or in the `name.h/.cc` shorthand."""
    stem, ext = os.path.splitext(path)
    base = os.path.basename(path)
    candidates = {path, base}
    short = os.path.basename(stem)
    if ext in (".h", ".cc"):
        candidates |= {stem + ".h/.cc", short + ".h/.cc"}
    for candidate in candidates:
        if re.search(r"(?<![\w/.])" + re.escape(candidate) + r"(?![\w])", section):
            return True
    return False


def readme_problems(graph, root):
    problems, notes = [], []
    for folder in component_folders(graph, root):
        files = code_files(root, folder, graph)
        readme = os.path.join(root, folder, "README.md")
        missing, why = [], None
        if not os.path.exists(readme):
            why = f"{folder}/ has no README.md"
        else:
            with open(readme, encoding="utf-8") as f:
                section = where_the_code_is(f.read())
            if section is None:
                why = f"{folder}/README.md has no 'Where the code is' section"
            else:
                missing = [p for p in files if not mentioned(section, p)]
        complete = why is None and not missing
        if folder in README_TABLE_EXCEPTIONS:
            if complete:
                problems.append(
                    f"{folder}/README.md now lists every file: remove '{folder}' from "
                    "README_TABLE_EXCEPTIONS in tools/deps_diagram.py")
            else:
                notes.append(f"known exception: {folder}/ ({README_TABLE_EXCEPTIONS[folder]})")
            continue
        problems += [f"{folder}/{path}: tests live beside the code ({folder}/*_test.cc) and "
                     f"their helpers in testing/ (CONTRIBUTING.md, Tests), not in a test/ folder"
                     for path in files if path.startswith("test/") or "/test/" in path]
        if why:
            problems.append(why + " (a table of every .h/.cc file and what lives there)")
        elif missing:
            problems.append(f"{folder}/README.md 'Where the code is' does not mention: "
                            + ", ".join(missing))
    return problems, notes


# ---- --self-test ------------------------------------------------------------

SELF_TEST_LAYERS = [["low", "side"], ["high"]]
SELF_TEST_TREE = {
    "low/BUILD": 'cc_library(name = "low", srcs = ["low.cc"], hdrs = ["low.h"])\n'
                 'cc_binary(name = "child", testonly = True, srcs = ["child.cc"])\n'
                 'cc_test(name = "low_test", srcs = ["low_test.cc", "shared.h"])\n'
                 'cc_library(name = "shared", hdrs = ["shared.h"])\n',
    "low/low.h": '#pragma once\n',
    "low/low.cc": '#include "low/low.h"\n#include <vector>\n#include "absl/strings/str_cat.h"\n'
                  '#include "high/high.h"\n',                        # planted: upward
    "low/shared.h": '#include "high/high.h"\n',                     # planted: test and prod
    "low/internal/impl.h": '#include "../low.h"\n#include "../../side/side.h"\n',  # sideways
    "low/child.cc": '#include "high/high.h"\n',                     # testonly target: exempt
    "low/low_test.cc": '#include "high/high.h"\n',                  # a test: exempt
    "low/testing/helper.h": '#include "high/high.h"\n',             # testing/: exempt
    "low/fuzz/fuzzer.cc": '#include "high/high.h"\n',               # fuzz/: exempt
    "side/BUILD": 'cc_library(name = "side", hdrs = ["side.h"])\n',
    "side/side.h": '// #include "high/high.h" (a comment)\n',
    "high/BUILD": 'cc_library(name = "high", hdrs = ["high.h"], deps = ["//low"])\n',
    "high/high.h": '#include "low/low.h"\n#include "low/testing/helper.h"\n',  # planted: test-only
    "high/high_test.cc": '#include "low/testing/helper.h"\n',
}
SELF_TEST_EXPECTED = [
    'high/high.h:2: #include "low/testing/helper.h": a production file',
    'sideways include: low/internal/impl.h:2: #include "../../side/side.h": //low (layer 0) -> '
    '//side (layer 0)',
    'upward include: low/low.cc:4: #include "high/high.h": //low (layer 0) -> //high (layer 1)',
    'upward include: low/shared.h:1: #include "high/high.h": //low (layer 0) -> //high (layer 1)',
]


def self_test():
    """Plants upward, sideways and test-only includes (and exempt ones) in a
    temporary tree; fails unless include_problems reports exactly them."""
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        for path, text in SELF_TEST_TREE.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)
        problems = sorted(include_problems(root, SELF_TEST_LAYERS))
    unexpected = [p for p in problems if not any(p.startswith(e) for e in SELF_TEST_EXPECTED)]
    missed = [e for e in SELF_TEST_EXPECTED if not any(p.startswith(e) for p in problems)]
    for line in unexpected:
        print("self-test: reported but not planted: " + line)
    for line in missed:
        print("self-test: planted but not reported: " + line)
    if unexpected or missed or len(problems) != len(SELF_TEST_EXPECTED):
        print(f"self-test failed: {len(problems)} problems, {len(SELF_TEST_EXPECTED)} planted")
        return 1
    print(f"self-test: the {len(problems)} planted include arrows were reported, and only they")
    return 0


# ---- main -------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update README.md's copy")
    mode.add_argument("--check", action="store_true",
                      help="fail when README.md differs or the graph, includes or tables "
                      "are wrong")
    mode.add_argument("--self-test", action="store_true",
                      help="check the include rule on a small planted tree")
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."),
                        help="the source tree (default: this script's repository)")
    args = parser.parse_args()
    root = os.path.realpath(args.root)
    if args.self_test:
        return self_test()

    graph = read_graph(root)
    problems = graph_problems(graph) + include_problems(root)
    diagram = render(graph)
    readme_path = os.path.join(root, "README.md")

    if not args.write and not args.check:
        sys.stdout.write(diagram)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0

    with open(readme_path, encoding="utf-8") as f:
        readme = f.read()
    block = readme_block(readme)
    if block is None:
        print(f"README.md has no '{BEGIN_MARKER} ... -->' / '{END_MARKER}' markers",
              file=sys.stderr)
        return 1
    current = readme[block[0]:block[1]]

    if args.write:
        if current != diagram:
            with open(readme_path, "w", encoding="utf-8") as f:
                f.write(readme[:block[0]] + diagram + readme[block[1]:])
            print("README.md: diagram updated")
        else:
            print("README.md: diagram already up to date")
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0

    failed = False
    if current != diagram:
        failed = True
        print("README.md's dependency diagram differs from the BUILD files:")
        sys.stdout.writelines(difflib.unified_diff(
            current.splitlines(True), diagram.splitlines(True),
            "README.md (committed)", "from the BUILD files"))
        print(f"Regenerate it with: {REGENERATE}")
    for problem in problems:
        failed = True
        print(problem)
    table_problems, notes = readme_problems(graph, root)
    for problem in table_problems:
        failed = True
        print(problem)
    for note in notes:
        print(note)
    if not failed:
        print(f"dependency diagram up to date: {len(graph)} packages, "
              f"{sum(len(n['deps']) for n in graph.values())} arrows, "
              f"{len(include_arrows(root))} #include lines across packages, "
              "no cycles, no upward or sideways arrows; component READMEs list their files")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
