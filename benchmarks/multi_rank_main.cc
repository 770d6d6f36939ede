#include "benchmarks/multi_rank_main.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "host/compute_layout.h"
#include "launcher/launch.h"

namespace benchmarks {
namespace {

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

int LaunchRanks(int argc, char** argv, const MultiRankBenchmark& spec) {
  launcher::LaunchOptions options;
  options.nproc_per_node = spec.world_size;
  // The ranks write to pipes; keep escape codes out of the report.
  options.command = {"/proc/self/exe", "--benchmark_color=false"};
  for (int i = 1; i < argc; ++i) options.command.push_back(argv[i]);
  options.timeout = std::chrono::minutes(20);
  options.on_line = [](int rank, bool is_stderr, const std::string& line) {
    if (rank == 0 && !is_stderr) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    } else if (is_stderr) {
      std::fprintf(stderr, "[rank %d] %s\n", rank, line.c_str());
    }
  };
  auto result = launcher::launch(options);
  if (!result.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.name.c_str(),
                 std::string(result.status().message()).c_str());
    return 2;
  }
  if (result->exit_code != 0) {
    std::fprintf(stderr, "%s: %s\n", spec.name.c_str(), result->summary.c_str());
  }
  return result->exit_code;
}

}  // namespace

int RunOnLocalRanks(int argc, char** argv, const MultiRankBenchmark& spec) {
  if (std::getenv("RANK") == nullptr) return LaunchRanks(argc, argv, spec);

  comm::InitOptions init;
  init.timeout = std::chrono::minutes(5);
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.name.c_str(), group.status().ToString().c_str());
    return 1;
  }
  if (group->rank() == 0) {
    // Ranks started by launcher::launch got OMP_NUM_THREADS from its layout.
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    std::printf(
        "%s: compute: %s\n", spec.name.c_str(),
        host::DescribeComputeLayout(local_world != nullptr ? std::atoi(local_world) : group->size())
            .c_str());
    std::fflush(stdout);
  }
  if (group->rank() != 0) {
    // Only rank 0 writes --benchmark_out files.
    int kept = 1;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]).rfind("--benchmark_out", 0) != 0) argv[kept++] = argv[i];
    }
    argc = kept;
  }
  benchmark::Initialize(&argc, argv);
  spec.register_benchmarks(*group);
  if (group->rank() == 0) {
    std::unique_ptr<benchmark::BenchmarkReporter> reporter;
    if (spec.make_reporter) reporter = spec.make_reporter();
    if (reporter) {
      benchmark::RunSpecifiedBenchmarks(reporter.get());
    } else {
      benchmark::RunSpecifiedBenchmarks();
    }
  } else {
    SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  comm::barrier(*group).wait();
  benchmark::Shutdown();
  return 0;
}

}  // namespace benchmarks
