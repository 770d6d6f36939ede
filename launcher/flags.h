// The command line of //tools:launch, torchrun's flags with dashes or
// underscores:
//
//   launch --nproc N [--nnodes M] [--node-rank K] [--master-addr A]
//          [--master-port P] [--timeout SECONDS] [--collective-timeout SECONDS]
//          [--max-restarts N] [--threads-per-rank T] [--] PROGRAM [ARGS...]
//
// (also --flag=value; a flag given twice takes the last value). PROGRAM and
// everything after it are the program's, untouched, with or without `--`.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/launch.h"

namespace launcher {

// `args` excludes argv[0]. A bad flag or value is an InvalidArgument naming
// the flag, the value and what was expected ("--nproc='x': expected an
// integer >= 1"); so are an unknown flag, a missing --nproc and a missing
// PROGRAM.
absl::StatusOr<LaunchOptions> parse_launch_args(const std::vector<std::string>& args);

// The --help text: every flag with its default.
std::string launch_usage();

}  // namespace launcher
