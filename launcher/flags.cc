#include "launcher/flags.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/flag_checks.h"

namespace launcher {
namespace {

// The flags, into `o`. PROGRAM [ARGS...] (after `--`, or from the first
// argument that is not a flag) is left untouched in app.remaining().
void define_launch_flags(CLI::App& app, LaunchOptions& o) {
  app.name("launch");
  app.footer("PROGRAM [ARGS...] follow the flags, after `--` or not.");
  app.prefix_command();
  app.set_help_flag();  // --help only as the first argument (tools/launch.cc)
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  auto seconds = [&app](const std::string& flag, std::chrono::milliseconds& out,
                        const std::string& help) {
    app.add_option_function<double>(
           flag,
           [&out](double s) {
             out = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(s * 1000)));
           },
           help)
        ->type_name("SECONDS")
        ->transform(checked([](std::string& v) -> std::string {
          double s = 0;
          if (absl::SimpleAtod(v, &s) && s > 0 && s <= 1e7) return "";
          return "a positive number of seconds (at most 1e7)";
        }));
  };
  add_integer(app, "--nproc,--nproc-per-node,--nproc_per_node", o.nproc_per_node,
              "ranks on this node", 1)
      ->required()
      ->default_str("");
  add_integer(app, "--nnodes", o.nnodes, "nodes", 1);
  add_integer(app, "--node-rank,--node_rank", o.node_rank, "this node's rank", 0);
  app.add_option("--master-addr,--master_addr", o.master_addr, "node 0's address")
      ->type_name("ADDR");
  add_integer(app, "--master-port,--master_port", o.master_port,
              "node 0's port (default: a free local port)", 1, 65535)
      ->default_str("");
  seconds("--timeout", o.timeout, "end the whole job after this long (exit 124)");
  seconds("--collective-timeout", o.collective_timeout,
          "the ranks' process-group timeout, passed as COMM_COLLECTIVE_TIMEOUT_MS");
  add_integer(app, "--max-restarts,--max_restarts", o.max_restarts,
              "restart every rank after a failure, up to N times (TORCHELASTIC_RESTART_COUNT); "
              "with --nnodes, node 0 decides for all",
              0);
  add_integer(app, "--threads-per-rank", o.threads_per_rank,
              "OMP_NUM_THREADS of each rank (default: OMP_NUM_THREADS if set, else cores / nproc)",
              1)
      ->default_str("");
  app.add_flag("--bind-cores", o.bind_cores,
               "bind each rank to its own cores when ranks x threads fit them (default true; "
               "--bind-cores=false when other jobs share the CPUs)");
}

}  // namespace

absl::StatusOr<LaunchOptions> parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions options;
  CLI::App app;
  define_launch_flags(app, options);
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 reads last-first
  } catch (const CLI::RequiredError&) {
    return absl::InvalidArgumentError(
        "--nproc is missing: expected --nproc N (ranks on this node)");
  } catch (const CLI::ParseError& e) {
    return flag_error(e);
  }
  std::vector<std::string> rest = app.remaining();
  // Only the flags' arguments: "--x=" after PROGRAM is the program's.
  const std::vector<std::string> flags(args.begin(), args.end() - rest.size());
  if (absl::Status s = refuse_empty_values(app, flags); !s.ok()) return s;
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag ", rest.front().substr(0, rest.front().find('='))));
  }
  options.command = std::move(rest);
  if (options.command.empty()) {
    return absl::InvalidArgumentError(
        "no program given: expected `-- PROGRAM [ARGS...]` after the flags");
  }
  return options;
}

std::string launch_usage() {
  LaunchOptions defaults;
  CLI::App app;
  define_launch_flags(app, defaults);
  app.set_help_flag("-h,--help", "print this help and exit (only as the first argument)");
  app.get_formatter()->column_width(34);
  return app.help();
}

}  // namespace launcher
