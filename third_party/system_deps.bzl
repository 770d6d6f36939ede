"""Bazel repositories for the Debian packages the project builds against.

Each repository checks that its package is installed and fails with the
package name and the set-up command when it is not, so a missing package is
never reported as a download failure. Headers come from the system include
path (/usr/include); each repository's targets carry the link flags, defines
and extra include directories of its library, so BUILD files elsewhere name
labels, never raw `-l` flags.
"""

load("//third_party:libtorch.bzl", "libtorch_repository")

_SETUP_HINT = "run `tools/setup.sh` as root to install it"

def _debian_package_repository_impl(ctx):
    for path in ctx.attr.required_files:
        if not ctx.path(path).exists:
            fail("Debian package '{}' is missing: {} not found; {}".format(
                ctx.attr.package,
                path,
                _SETUP_HINT,
            ))
    ctx.symlink("/usr/include", "include")
    for build_path, content in ctx.attr.build_files.items():
        ctx.file(build_path, content, executable = False)

debian_package_repository = repository_rule(
    implementation = _debian_package_repository_impl,
    attrs = {
        "package": attr.string(mandatory = True),
        "required_files": attr.string_list(mandatory = True),
        "build_files": attr.string_dict(mandatory = True),
    },
    local = True,
)

_LIB = "/usr/lib/x86_64-linux-gnu/"

def _system_cc_library(name, libs, deps = [], defines = [], includes = [], hdrs_glob = []):
    return """
cc_library(
    name = "{name}",
    hdrs = glob({hdrs_glob}),
    includes = {includes},
    defines = {defines},
    linkopts = {linkopts},
    deps = {deps},
    visibility = ["//visibility:public"],
)
""".format(
        name = name,
        hdrs_glob = repr(hdrs_glob),
        includes = repr(includes),
        defines = repr(defines),
        linkopts = repr(["-l" + lib for lib in libs]),
        deps = repr(deps),
    )

# Abseil targets under their upstream labels, so code written against
# @com_google_absl builds unchanged. Each lists the shared libraries its inline
# code calls into (Debian's libabsl_*.so carry their own dependencies).
_ABSL_PACKAGES = {
    "absl/base": {
        "base": ["absl_base", "absl_raw_logging_internal", "absl_log_severity", "absl_spinlock_wait"],
        "core_headers": [],
    },
    "absl/strings": {
        "strings": ["absl_strings", "absl_strings_internal", "absl_int128", "absl_throw_delegate"],
        "str_format": ["absl_str_format_internal", "absl_strings", "absl_int128"],
        "cord": ["absl_cord", "absl_cord_internal", "absl_cordz_info", "absl_cordz_functions", "absl_strings"],
    },
    "absl/status": {
        "status": ["absl_status", "absl_cord", "absl_cord_internal", "absl_strings", "absl_raw_logging_internal"],
        "statusor": ["absl_statusor", "absl_status", "absl_bad_variant_access", "absl_strings", "absl_raw_logging_internal"],
    },
    "absl/flags": {
        "flag": ["absl_flags_internal", "absl_flags_marshalling", "absl_flags_commandlineflag", "absl_flags_reflection", "absl_flags_config", "absl_strings", "absl_str_format_internal", "absl_synchronization"],
        "parse": ["absl_flags_parse", "absl_flags_usage", "absl_flags_usage_internal", "absl_flags_program_name", "absl_flags_internal", "absl_flags_reflection", "absl_strings"],
        "usage": ["absl_flags_usage", "absl_flags_program_name"],
    },
    "absl/synchronization": {
        "synchronization": ["absl_synchronization", "absl_time", "absl_time_zone", "absl_graphcycles_internal", "absl_base", "absl_raw_logging_internal"],
    },
    "absl/time": {
        "time": ["absl_time", "absl_time_zone", "absl_civil_time", "absl_int128"],
    },
    "absl/container": {
        "flat_hash_map": ["absl_raw_hash_set", "absl_hash", "absl_city", "absl_low_level_hash"],
        "flat_hash_set": ["absl_raw_hash_set", "absl_hash", "absl_city", "absl_low_level_hash"],
        "btree": ["absl_raw_hash_set"],
        "inlined_vector": [],
    },
    "absl/hash": {
        "hash": ["absl_hash", "absl_city", "absl_low_level_hash"],
    },
    "absl/types": {
        "optional": ["absl_bad_optional_access"],
        "span": [],
        "variant": ["absl_bad_variant_access"],
    },
    "absl/cleanup": {
        "cleanup": [],
    },
    "absl/random": {
        "random": ["absl_random_internal_pool_urbg", "absl_random_internal_randen", "absl_random_internal_randen_hwaes", "absl_random_internal_randen_hwaes_impl", "absl_random_internal_randen_slow", "absl_random_internal_platform", "absl_random_seed_gen_exception", "absl_random_internal_seed_material", "absl_random_seed_sequences"],
    },
}

def _absl_build_files():
    files = {"BUILD": ""}
    for package, targets in _ABSL_PACKAGES.items():
        files[package + "/BUILD"] = "".join([
            _system_cc_library(name, libs)
            for name, libs in targets.items()
        ])
    return files

def system_dependencies():
    """Declares @libtorch (third_party/libtorch.bzl), @gloo_headers, @tcmalloc, @com_google_absl, @com_google_googletest, @com_github_google_benchmark, @libdeflate, @cli11, @nlohmann_json, @pcre2, @icu, @sentencepiece."""
    libtorch_repository(name = "libtorch")
    debian_package_repository(
        name = "gloo_headers",
        package = "libgloo-dev",
        # The torch wheel has Gloo compiled into libtorch_cpu but ships no
        # gloo/ headers, which ProcessGroupGloo.hpp includes. The project only
        # passes Gloo's objects around by pointer (devices, options), so the
        # headers' version need not match the one torch was built with.
        required_files = ["/usr/include/gloo/config.h"],
        build_files = {"BUILD": _system_cc_library("gloo_headers", [])},
    )
    debian_package_repository(
        name = "tcmalloc",
        package = "libgoogle-perftools-dev",
        required_files = [_LIB + "libtcmalloc_minimal.so"],
        build_files = {
            # gperftools' thread-caching malloc, for --custom_malloc (see
            # .bazelrc): the project's binaries and tests link it; the
            # libraries themselves never depend on it.
            "BUILD": _system_cc_library("tcmalloc", ["tcmalloc_minimal"]),
        },
    )
    debian_package_repository(
        name = "com_google_absl",
        package = "libabsl-dev",
        required_files = [_LIB + "libabsl_status.so", "/usr/include/absl/status/status.h"],
        build_files = _absl_build_files(),
    )
    debian_package_repository(
        name = "com_google_googletest",
        package = "libgtest-dev and libgmock-dev",
        required_files = [_LIB + "libgtest.a", _LIB + "libgmock.a", "/usr/include/gmock/gmock.h"],
        build_files = {"BUILD": "".join([
            _system_cc_library("gtest", ["gtest", "pthread"]),
            _system_cc_library("gtest_main", ["gtest_main"], deps = [":gtest"]),
            _system_cc_library("gmock", ["gmock", "gtest", "pthread"]),
            _system_cc_library("gmock_main", ["gmock_main"], deps = [":gmock"]),
        ])},
    )
    debian_package_repository(
        name = "com_github_google_benchmark",
        package = "libbenchmark-dev",
        required_files = [_LIB + "libbenchmark.so", "/usr/include/benchmark/benchmark.h"],
        build_files = {"BUILD": "".join([
            _system_cc_library("benchmark", ["benchmark", "pthread"]),
            _system_cc_library("benchmark_main", ["benchmark_main"], deps = [":benchmark"]),
        ])},
    )
    debian_package_repository(
        name = "libdeflate",
        package = "libdeflate-dev",
        required_files = [_LIB + "libdeflate.so", "/usr/include/libdeflate.h"],
        build_files = {
            # Its CRC-32 (carry-less multiplication, ~10 GB/s) checksums the
            # zip records of checkpoint files (state_dict/internal).
            "BUILD": _system_cc_library("libdeflate", ["deflate"]),
        },
    )
    # Header-only, in /usr/include (system headers: exempt from -Werror).
    debian_package_repository(
        name = "cli11",
        package = "libcli11-dev",
        required_files = ["/usr/include/CLI/CLI.hpp"],
        build_files = {"BUILD": _system_cc_library("cli11", [], hdrs_glob = ["include/CLI/*.hpp"])},
    )
    debian_package_repository(
        name = "nlohmann_json",
        package = "nlohmann-json3-dev",
        required_files = ["/usr/include/nlohmann/json.hpp"],
        build_files = {"BUILD": _system_cc_library(
            "nlohmann_json",
            [],
            hdrs_glob = ["include/nlohmann/**/*.hpp"],
        )},
    )
    debian_package_repository(
        name = "pcre2",
        package = "libpcre2-dev",
        required_files = [_LIB + "libpcre2-8.so", "/usr/include/pcre2.h"],
        build_files = {
            # Perl-compatible regular expressions (8-bit code units, UTF-8
            # mode, Unicode properties, JIT): the tokenizer's pre-tokenizer
            # patterns (tokenizer/internal/regex.cc).
            "BUILD": _system_cc_library("pcre2", ["pcre2-8"], defines = ["PCRE2_CODE_UNIT_WIDTH=8"]),
        },
    )
    debian_package_repository(
        name = "icu",
        package = "libicu-dev",
        required_files = [_LIB + "libicuuc.so", "/usr/include/unicode/normalizer2.h"],
        build_files = {
            # International Components for Unicode (the common library):
            # Unicode normalization (NFC, NFKC, ...) and character properties
            # for the tokenizer (tokenizer/internal/normalizer.cc).
            "BUILD": _system_cc_library("icu", ["icuuc"]),
        },
    )
    debian_package_repository(
        name = "sentencepiece",
        package = "libsentencepiece-dev",
        required_files = [_LIB + "libsentencepiece.so", "/usr/include/sentencepiece_processor.h"],
        build_files = {
            # Google's SentencePiece, its processor (not the trainer):
            # tokenizer.model files (Llama 2, Mistral before v0.3) for the
            # tokenizer. Its header declares absl::string_view as
            # std::string_view, which Debian's Abseil defines as a class of
            # its own: only tokenizer/internal/sentencepiece_model.cc, which
            # includes no Abseil, includes it.
            "BUILD": _system_cc_library("sentencepiece", ["sentencepiece"]),
        },
    )
