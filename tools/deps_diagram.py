#!/usr/bin/env python3
"""The package dependency diagram, generated from the BUILD files.

    python3 tools/deps_diagram.py           print the diagram
    python3 tools/deps_diagram.py --write   put it into README.md (between the
                                            deps-diagram markers)
    python3 tools/deps_diagram.py --check   exit 1 when README.md's copy differs
                                            (printing the diff), on a cycle or an
                                            upward arrow, on a package not placed
                                            in LAYERS, or when a component's
                                            README misses one of its .h/.cc files

Reads the BUILD files with a small parser (no `bazel query`, so it runs inside
a test): a package's arrows are the labels in the deps, srcs, hdrs, data and
actual attributes of its production targets (not tests, not testonly
targets: a test may use anything). Python 3 standard library only.
//tools:deps_diagram_test runs --check.
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
    ["functorch/module", "functorch/transforms", "comm", "module_call", "state_dict"],
    ["fsdp", "activation_checkpointing", "launcher"],
    ["state_dict/fsdp"],
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


def split_top_level(body):
    """Splits the text between a call's parentheses at depth-0 commas."""
    parts, depth, start, quote = [], 0, 0, None
    i = 0
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
        i += 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_build(text):
    """[(rule kind, {attribute: value text})] for the top-level calls."""
    text = strip_comments(text)
    rules = []
    for match in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*)\s*\(", text, re.M):
        depth, quote, i = 1, None, match.end()
        while i < len(text) and depth:
            c = text[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            i += 1
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


# ---- checks -------------------------------------------------------------

def layer_of():
    return {package: i for i, layer in enumerate(LAYERS) for package in layer}


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


# ---- main -------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update README.md's copy")
    mode.add_argument("--check", action="store_true",
                      help="fail when README.md differs or the graph or tables are wrong")
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."),
                        help="the source tree (default: this script's repository)")
    args = parser.parse_args()
    root = os.path.realpath(args.root)

    graph = read_graph(root)
    problems = graph_problems(graph)
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
              "no cycles, no upward arrows; component READMEs list their files")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
