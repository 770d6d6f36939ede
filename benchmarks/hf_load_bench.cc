// Loading a Hugging Face checkpoint straight into fully_shard's shards, and
// exporting one back, against the disk's own speed measured beside it
// (issue 45's load goal).
//
//   bazel run -c opt //benchmarks:hf_load_bench -- --config models/... \
//       [--nproc 2] [--dir /tmp/hf_load_bench] [--keep]
//
// 1. Writes a checkpoint of random bf16 weights of --config's shape (a
//    Llama 3.2 1B shape by default: benchmarks/llama/llama32_1b_config.json)
//    into --dir/in, in 1 GB files with an index, as transformers shards it
//    (HfCheckpointWriter, tensor by tensor).
// 2. Measures the disk beside it: every file of the checkpoint read whole
//    with read(2) in 8 MiB blocks (MB/s), and the same number of bytes
//    written to a new file and fsynced. The files are dropped from the page
//    cache before this read and again before the load (page_cache.h), so
//    both come from the disk: a file just written or read is in memory, and
//    reading it again measures memory bandwidth, not the disk.
// 3. Starts --nproc ranks (the launcher, Gloo). Each builds the model on the
//    meta device, fully_shards each decoder layer and the root as the
//    trainer does, allocates its shards (fsdp::to_empty), and loads the
//    checkpoint with trainer::LoadHfIntoShards (each rank reads only its
//    ranges): the load's wall time (all ranks), the bytes read, the rank's
//    peak RSS (VmHWM) against its shard + the largest tensor (the goal:
//    at most 1.2x). Then trainer::ExportHf writes it back (rank 0 writes
//    as the others send): its time and bytes.
// Prints one table; RESULTS.md has the figures.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "benchmarks/page_cache.h"
#include "comm/collectives.h"
#include "comm/process_group.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "fsdp/fully_shard.h"
#include "launcher/launch.h"
#include "models/llama.h"
#include "models/llama_config.h"
#include "state_dict/hf_checkpoint.h"
#include "trainer/checkpointing.h"
#include "trainer/options.h"
#include "trainer/wrap.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

int64_t StatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
  }
  return -1;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "hf_load_bench: %s\n", what.c_str());
  std::exit(1);
}

struct Args {
  std::string config = "benchmarks/llama/llama32_1b_config.json";
  std::string dir = "/tmp/hf_load_bench";
  int nproc = 2;
  bool keep = false;
  // Use --dir/in as it is when it holds a checkpoint (profiling the load alone).
  bool reuse = false;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(arg + ": missing value");
      return argv[++i];
    };
    if (arg == "--config") {
      a.config = value();
    } else if (arg == "--dir") {
      a.dir = value();
    } else if (arg == "--nproc") {
      a.nproc = std::atoi(value().c_str());
    } else if (arg == "--keep") {
      a.keep = true;
    } else if (arg == "--reuse") {
      a.reuse = a.keep = true;
    } else {
      Die("unknown argument " + arg);
    }
  }
  return a;
}

// Step 1: random bf16 weights of the config's shape, tensor by tensor.
int64_t MakeCheckpoint(const models::LlamaConfig& config, const std::string& dir) {
  models::LlamaForCausalLM meta(config, c10::kMeta);
  std::vector<formats::TensorSpec> specs;
  for (const auto& p : meta->named_parameters()) {
    specs.push_back({p.key(), torch::kBFloat16, p.value().sizes().vec()});
  }
  auto writer = formats::HfCheckpointWriter::Create(
      dir, specs, int64_t{1} << 30,
      {{"config.json", models::LlamaConfigJson(config, torch::kBFloat16)}});
  if (!writer.ok()) Die(writer.status().ToString());
  for (const formats::TensorSpec& spec : specs) {
    const torch::Tensor t =
        models::InitialLlamaParameter(config, spec.key, spec.shape, 1).to(torch::kBFloat16);
    if (auto s = writer->Write(spec.key, t); !s.ok()) Die(s.ToString());
  }
  if (auto s = writer->Commit(); !s.ok()) Die(s.ToString());
  return writer->total_bytes();
}

// Step 2: the disk's read and write speed on the same bytes.
std::pair<double, double> DiskSpeed(const std::string& dir, int64_t bytes) {
  benchmarks::DropDirectoryFromPageCache(dir);
  std::vector<char> block(8 << 20);
  int64_t read_bytes = 0;
  const auto read_start = Clock::now();
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY);
    if (fd < 0) Die("cannot open " + entry.path().string());
    ssize_t n;
    while ((n = ::read(fd, block.data(), block.size())) > 0) read_bytes += n;
    ::close(fd);
  }
  const double read_mb_s = static_cast<double>(read_bytes) / 1e6 / Seconds(read_start);
  const std::string path = dir + ".write_probe";
  const auto write_start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) Die("cannot create " + path);
  for (int64_t left = bytes; left > 0;) {
    const ssize_t n = ::write(fd, block.data(), std::min<int64_t>(left, block.size()));
    if (n <= 0) Die("write failed: " + path);
    left -= n;
  }
  ::fsync(fd);
  ::close(fd);
  const double write_mb_s = static_cast<double>(bytes) / 1e6 / Seconds(write_start);
  std::filesystem::remove(path);
  return {read_mb_s, write_mb_s};
}

// Step 3, in each rank.
int Rank(const Args& args) {
  auto group = comm::init_process_group();
  if (!group.ok()) Die(group.status().ToString());
  const std::string in = args.dir + "/in", out = args.dir + "/out";
  auto config = models::ReadLlamaConfig(in + "/config.json");
  if (!config.ok()) Die(config.status().ToString());
  const int64_t rss_start = StatusKb("VmRSS:");
  auto model = models::LlamaForCausalLM(*config, c10::kMeta);
  int64_t largest = 0, total = 0;
  for (const auto& p : model->named_parameters()) {
    largest = std::max(largest, p.value().numel() * 4);
    total += p.value().numel() * 4;
  }
  trainer::Options o;
  o.model = trainer::ModelKind::kLlama;
  o.fsdp = trainer::FsdpApi::kFullyShard;
  o.hf_checkpoint = in;
  o.export_hf = out;
  o.export_hf_dtype = trainer::ExportDtype::kBf16;
  o.export_hf_max_shard_bytes = int64_t{1} << 30;
  auto wrapped = trainer::Wrap(o, model.ptr(), torch::kCPU, *group);
  if (!wrapped.ok()) Die(wrapped.status().ToString());
  const trainer::TrainedModel trained = wrapped->model();
  int64_t shard = 0;
  for (const auto& p : trained.parameters()) shard += p.numel() * p.element_size();
  comm::barrier(*group).wait();
  const auto load_start = Clock::now();
  if (auto s = trainer::LoadHfIntoShards(o, *group, trained); !s.ok()) Die(s.ToString());
  comm::barrier(*group).wait();
  const double load_s = Seconds(load_start);
  const int64_t hwm_load = StatusKb("VmHWM:");
  // The export: optimizer-free (ExportHf checks the optimizer's state too).
  torch::optim::SGD none(trained.parameters(), torch::optim::SGDOptions(0.1));
  const auto export_start = Clock::now();
  if (auto s = trainer::ExportHf(o, *group, trained, none,
                                 models::LlamaConfigJson(*config, torch::kBFloat16));
      !s.ok()) {
    Die(s.ToString());
  }
  comm::barrier(*group).wait();
  const double export_s = Seconds(export_start);
  const int64_t hwm_export = StatusKb("VmHWM:");
  auto files = formats::HfCheckpointFiles::Open(in);
  int64_t file_bytes = 0;
  for (const std::string& name : files->names()) file_bytes += files->info(name)->bytes;
  const double bound = static_cast<double>(shard + largest) / (1 << 20);
  std::printf(
      "rank %d: shard %.0f MiB + largest tensor %.0f MiB = %.0f MiB; RSS at start %.0f MiB, peak "
      "%.0f MiB after the load (%.2fx the bound), %.0f MiB after the export (%.2fx); load %.2f s "
      "(%.0f MB/s of the file's %.0f MB over all ranks), export %.2f s (%.0f MB/s)\n",
      group->rank(), shard / 1048576.0, largest / 1048576.0, bound, rss_start / 1024.0,
      hwm_load / 1024.0, hwm_load / 1024.0 / bound, hwm_export / 1024.0,
      hwm_export / 1024.0 / bound, load_s, file_bytes / 1e6 / load_s, file_bytes / 1e6, export_s,
      file_bytes / 1e6 / export_s);
  std::fflush(stdout);
  (void)total;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  if (std::getenv("RANK") != nullptr) return Rank(args);
  auto config = models::ReadLlamaConfig(args.config);
  if (!config.ok()) Die(config.status().ToString());
  int64_t bytes = 0;
  if (args.reuse && std::filesystem::exists(args.dir + "/in/config.json")) {
    auto files = formats::HfCheckpointFiles::Open(args.dir + "/in");
    if (!files.ok()) Die(files.status().ToString());
    for (const std::string& name : files->names()) bytes += files->info(name)->bytes;
    std::printf("checkpoint: %.0f MB in %s (reused)\n", bytes / 1e6, (args.dir + "/in").c_str());
  } else {
    std::filesystem::remove_all(args.dir);
    std::filesystem::create_directories(args.dir);
    const auto make_start = Clock::now();
    bytes = MakeCheckpoint(*config, args.dir + "/in");
    std::printf("checkpoint: %.0f MB of bf16 in %s, written in %.1f s\n", bytes / 1e6,
                (args.dir + "/in").c_str(), Seconds(make_start));
  }
  const auto [read_mb_s, write_mb_s] = DiskSpeed(args.dir + "/in", bytes);
  std::printf(
      "disk beside it: read %.0f MB/s (read(2), 8 MiB blocks, not in the page cache), write %.0f "
      "MB/s (+fsync)\n",
      read_mb_s, write_mb_s);
  std::fflush(stdout);
  benchmarks::DropDirectoryFromPageCache(args.dir + "/in");  // the load reads the disk too
  launcher::LaunchOptions launch;
  launch.nproc_per_node = args.nproc;
  launch.command = {"/proc/self/exe"};
  for (int i = 1; i < argc; ++i) launch.command.push_back(argv[i]);
  launch.command[0] = std::filesystem::read_symlink("/proc/self/exe").string();
  auto result = launcher::launch(launch);
  if (!result.ok()) Die(result.status().ToString());
  if (!args.keep) std::filesystem::remove_all(args.dir);
  return result->exit_code;
}
