// Checkpoint I/O of the trainer's ~25M-parameter TransformerLM (8 blocks,
// dim 512, as trainer_bench) with its AdamW state (exp_avg, exp_avg_sq):
// 76M floats, ~291 MiB, against the disk's own bandwidth measured in the
// same run (issue #16):
//
//   BM_DiskWrite/0, /1      a plain file of the checkpoint's size: write(),
//                           fsync (0, as dd conv=fsync), or with writeback
//                           started every 8 MiB on the way (1, as the
//                           checkpoint writer does); 1 is the bound for saves
//   BM_DiskRead             the same file read back with its pages dropped
//                           from the page cache first (cold reads)
//   BM_Save/full            SaveFullCheckpoint (one model.pt + MANIFEST)
//   BM_Save/sharded/R       SaveShard on R ranks (threads here, each its
//                           half of every tensor) + CommitShardedCheckpoint
//   BM_Load/W/0             LoadFullStateDict (W = 0) / each of W ranks'
//                           LoadResharded of its own pieces, cold page cache
//   BM_Load/W/1             the same, then the loaded tensors copied into
//                           resident tensors of the state's shapes (a
//                           trainer resuming: what a load costs in the end)
//   BM_DcpSave/R            the sharded state as a torch.distributed.checkpoint
//                           directory: SaveDcpShard on R ranks + commit
//   BM_DcpLoad/W            each of W ranks' LoadResharded of its ranges
//                           from a DCP directory 2 ranks wrote, cold
//   BM_Verify/full, /sharded/R  VerifyCheckpoint, cold page cache
//   Each load and verify iteration also reads the plain file cold, next to
//   it in time (paired_read_ms): the disk moves by tens of percent within a
//   minute here, and the summary gives each case against both.
//   BM_TrainLoop/0|1|2|3    4 training steps of the real model with no save
//                           (0), a SaveFullCheckpoint (1), an
//                           AsyncCheckpointer::SaveFull (2, snapshot) or
//                           SaveFullInPlace (3, no snapshot; the loop calls
//                           WaitUntilWritten before each optimizer step)
//                           after the first, Wait at the end; the loop cost
//                           of a save is the difference to no save. Each
//                           mode runs twice, interleaved; blocked_ms is the
//                           time the loop spends inside the save calls
//                           (2: the snapshot; 3: waiting until written).
//
// Before the benchmarks, main() measures the memory a save adds: the peak
// RSS (VmHWM, reset through /proc/self/clear_refs) of one SaveFullCheckpoint
// and one SaveShard, minus the RSS before, beside the largest tensor; the
// same for one VerifyCheckpoint of the full checkpoint; and the same for a
// whole-state copy as a check that the measurement sees allocations. The summary prints every
// throughput as a fraction of the disk's, and the async loop cost as a fraction of a synchronous
// save.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "benchmarks/page_cache.h"
#include "state_dict/async_checkpoint.h"
#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"
#include "state_dict/sharded_tensor.h"
#include "trainer/models.h"

namespace {

using state_dict::TensorDict;

const trainer::ModelConfig kConfig{/*layers=*/8, /*dim=*/512, /*heads=*/8,
                                   /*vocab=*/256, /*seq=*/32};
constexpr int kIterations = 3;
// Cold reads vary most (the first after a large write can take 3x as long):
// more of them.
constexpr int kReadIterations = 6;

std::string g_root;  // scratch directory on the disk under test
std::shared_ptr<trainer::LanguageModel> g_model;
TensorDict g_state;  // model + AdamW state, as the trainer's FULL checkpoint
uint64_t g_state_bytes = 0;

int64_t g_step = 0;  // fresh step directory per save
std::string Run(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof(buf), p)) out += buf;
    ::pclose(p);
  }
  return out;
}

void RemoveTree(const std::string& path) { (void)Run("rm -rf '" + path + "'"); }

uint64_t DirectoryBytes(const std::string& dir) {
  return std::strtoull(Run("du -sb '" + dir + "' | cut -f1").c_str(), nullptr, 10);
}

// /proc/self/status fields in KiB.
int64_t StatusKiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + std::strlen(field));
  }
  return -1;
}

// Peak RSS added by `fn`: VmHWM after it (reset before through clear_refs)
// minus VmRSS before, in MiB.
template <typename Fn>
double PeakRssAddedMiB(Fn&& fn) {
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const int64_t before = StatusKiB("VmRSS:");
  fn();
  return static_cast<double>(StatusKiB("VmHWM:") - before) / 1024.0;
}

// The rank's half (or all) of every tensor, as FSDP's even split.
state_dict::ShardedStateDict RankShard(int rank, int world) {
  state_dict::ShardedStateDict shard;
  for (const auto& item : g_state) {
    const state_dict::FlatRange r = state_dict::EvenShardRange(item.value().numel(), world, rank);
    shard.insert(item.key(), state_dict::ShardFullTensor(
                                 item.value(), r.numel > 0 ? std::vector<state_dict::FlatRange>{r}
                                                           : std::vector<state_dict::FlatRange>{}));
  }
  return shard;
}

std::vector<std::pair<std::string, state_dict::ShardRequest>> RankRequests(int rank, int world) {
  std::vector<std::pair<std::string, state_dict::ShardRequest>> out;
  for (const auto& item : g_state) {
    state_dict::ShardRequest req;
    req.global_shape = item.value().sizes().vec();
    req.dtype = item.value().scalar_type();
    const state_dict::FlatRange r = state_dict::EvenShardRange(item.value().numel(), world, rank);
    if (r.numel > 0) req.ranges.push_back(r);
    out.emplace_back(item.key(), std::move(req));
  }
  return out;
}

void Check(benchmark::State& state, const absl::Status& status) {
  if (!status.ok()) state.SkipWithError(std::string(status.message()).c_str());
}

// Every rank's shard of the state, built once per world size (outside the
// timed region: ShardFullTensor copies the pieces).
const std::vector<state_dict::ShardedStateDict>& Shards(int world) {
  static std::map<int, std::vector<state_dict::ShardedStateDict>> cache;
  auto& shards = cache[world];
  if (shards.empty()) {
    for (int r = 0; r < world; ++r) shards.push_back(RankShard(r, world));
  }
  return shards;
}

// Saves step `step` under `root` in the given layout; world 0 = full.
absl::Status SaveAs(const std::string& root, int64_t step, int world) {
  if (world == 0) return state_dict::SaveFullCheckpoint(root, step, g_state);
  std::vector<absl::Status> statuses(static_cast<size_t>(world));
  const std::vector<state_dict::ShardedStateDict>& shards = Shards(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      statuses[static_cast<size_t>(r)] =
          state_dict::SaveShard(root, step, r, world, shards[static_cast<size_t>(r)]);
    });
  }
  for (auto& t : ranks) t.join();
  for (const auto& s : statuses) {
    if (!s.ok()) return s;
  }
  return state_dict::CommitShardedCheckpoint(root, step, world);
}

// The plain write goes in 256 KiB calls, the size the disk does best with
// here: 8 MiB writes measured 3-7x slower on this VM (dd conv=fsync of
// 300 MB: 165-548 MB/s with bs=8M, 1.1-1.2 GB/s with bs=256K), and a slow
// baseline would flatter every fraction below. The plain read goes in 1 MiB
// calls: 256 KiB reads measured 0.75-1.2 GB/s where 1 MiB and 4 MiB reads
// gave 1.0-1.2 GB/s in the same minutes.
constexpr size_t kDiskWriteChunk = size_t{256} << 10;
constexpr size_t kDiskReadChunk = size_t{1} << 20;

std::string PlainFile() { return g_root + "/plain.bin"; }

// Writes the state's bytes as one plain file (what a save must move);
// returns the seconds it took, fsync included. With `early_writeback`, the
// kernel is asked to start writing back every 8 MiB as they are written
// (sync_file_range, as the checkpoint writer does), else only the final
// fsync writes anything back (as `dd conv=fsync`).
double WritePlainFile(bool early_writeback = true) {
  static std::vector<char> buffer;
  if (buffer.empty()) {
    buffer.resize(g_state_bytes);
    size_t at = 0;
    for (const auto& item : g_state) {
      std::memcpy(buffer.data() + at, item.value().data_ptr(), item.value().nbytes());
      at += item.value().nbytes();
    }
  }
  // A new file each time, as a save writes one: truncating the previous one
  // would add freeing its blocks.
  ::unlink(PlainFile().c_str());
  const auto start = std::chrono::steady_clock::now();
  int fd = ::open(PlainFile().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  size_t writeback_started = 0;
  for (size_t done = 0; fd >= 0 && done < buffer.size();) {
    ssize_t n = ::write(fd, buffer.data() + done, std::min(kDiskWriteChunk, buffer.size() - done));
    if (n <= 0) break;
    done += static_cast<size_t>(n);
    if (early_writeback && done - writeback_started >= (size_t{8} << 20)) {
      ::sync_file_range(fd, static_cast<off64_t>(writeback_started),
                        static_cast<off64_t>(done - writeback_started), SYNC_FILE_RANGE_WRITE);
      writeback_started = done;
    }
  }
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Seconds to read the plain file with a cold page cache (dropped first,
// outside the time).
double ColdPlainReadSeconds() {
  static std::vector<char> buffer(kDiskReadChunk);
  if (::access(PlainFile().c_str(), R_OK) != 0) WritePlainFile();
  benchmarks::DropFromPageCache(PlainFile());
  const auto start = std::chrono::steady_clock::now();
  int fd = ::open(PlainFile().c_str(), O_RDONLY | O_CLOEXEC);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  while (fd >= 0 && ::read(fd, buffer.data(), buffer.size()) > 0) {
  }
  if (fd >= 0) ::close(fd);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// range(0): 1 = early writeback, 0 = none (dd conv=fsync).
void BM_DiskWrite(benchmark::State& state) {
  const bool early_writeback = state.range(0) == 1;
  for (auto _ : state) state.SetIterationTime(WritePlainFile(early_writeback));
  state.SetLabel(early_writeback ? "writeback every 8 MiB" : "as dd conv=fsync");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_state_bytes));
}

void BM_DiskRead(benchmark::State& state) {
  for (auto _ : state) state.SetIterationTime(ColdPlainReadSeconds());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_state_bytes));
}

// range(0): ranks, 0 = full checkpoint. Each iteration also writes the
// plain file next to it in time (before it on odd iterations, after it on
// even ones): `paired_write_MBps` is the disk's fsync'd write rate in the same
// seconds as the saves, which the summary gives each save against as well.
void BM_Save(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::string root = g_root + "/save";
  if (world > 0) Shards(world);  // built before the clock starts
  uint64_t bytes = 0;
  double paired_s = 0;
  int64_t i = 0;
  for (auto _ : state) {
    const int64_t step = ++g_step;
    const bool plain_first = ++i % 2 == 1;
    state.PauseTiming();
    if (plain_first) paired_s += WritePlainFile();
    state.ResumeTiming();
    Check(state, SaveAs(root, step, world));
    state.PauseTiming();
    bytes += DirectoryBytes(state_dict::StepDirectory(root, step));
    RemoveTree(root);
    if (!plain_first) paired_s += WritePlainFile();
    state.ResumeTiming();
  }
  state.counters["paired_write_MBps"] =
      benchmark::Counter(static_cast<double>(i) * g_state_bytes / paired_s / 1e6);
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.SetLabel(world == 0 ? "full" : "sharded/" + std::to_string(world) + " ranks");
}

// A fresh checkpoint of the given layout for a load or verify case, and a
// fresh plain file beside it: both written just now, so that they stand
// alike in every cache below the VM (a file read again and again stays in
// the host's cache; one written minutes earlier, with gigabytes written
// since, may not: that made checkpoint reads look 2x slower than the plain
// read in a whole run, and not in a run of the read cases alone).
std::string FreshCheckpoint(int world) {
  const std::string root = g_root + "/read_" + std::to_string(world);
  RemoveTree(root);
  absl::Status s = SaveAs(root, 1, world);
  if (!s.ok()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
  WritePlainFile();
  return state_dict::StepDirectory(root, 1);
}

// Times `read` (a cold read of checkpoint `dir`) each iteration and, beside
// it in time, a cold read of the plain file of the same size, before it on
// odd iterations and after it on even ones: the disk moves by tens of
// percent within a minute on this VM, and `paired_read_ms` (that read's
// mean time) gives each case a baseline taken in the same seconds.
// `clear` runs first, untimed: it frees what the previous `read` returned.
template <typename Clear, typename Read>
void TimeColdReads(benchmark::State& state, const std::string& dir, Clear&& clear, Read&& read) {
  // One untimed round first: the files were written just now (see
  // FreshCheckpoint), and the first cold reads after writing ~600 MB took
  // 1.5-5x as long as the later ones (the host still writing them back),
  // for the plain file and the checkpoint alike.
  ColdPlainReadSeconds();
  benchmarks::DropDirectoryFromPageCache(dir);
  read();
  double paired_s = 0;
  int64_t i = 0;
  for (auto _ : state) {
    clear();
    const bool plain_first = ++i % 2 == 1;
    if (plain_first) paired_s += ColdPlainReadSeconds();
    benchmarks::DropDirectoryFromPageCache(dir);
    const auto start = std::chrono::steady_clock::now();
    read();
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(took);
    if (!plain_first) paired_s += ColdPlainReadSeconds();
  }
  state.counters["paired_read_ms"] = benchmark::Counter(1e3 * paired_s / static_cast<double>(i));
  state.counters["paired_read_MBps"] =
      benchmark::Counter(static_cast<double>(i) * g_state_bytes / paired_s / 1e6);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * DirectoryBytes(dir)));
}

// range(0): ranks, 0 = full checkpoint; range(1): 1 = also copy what was
// loaded into the state's own (resident) tensors, as a resuming trainer
// does (load_state_dict, FSDP's flat shards), 0 = load only.
void BM_Load(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const bool into_state = state.range(1) == 1;
  const std::string dir = FreshCheckpoint(world);
  std::vector<std::vector<std::pair<std::string, state_dict::ShardRequest>>> requests;
  for (int r = 0; r < world; ++r) requests.push_back(RankRequests(r, world));
  // What a resuming trainer copies into: every rank's tensors, resident.
  static TensorDict destination;
  static std::map<int, std::vector<std::map<std::string, torch::Tensor>>> rank_destinations;
  if (into_state && world == 0 && destination.is_empty()) {
    for (const auto& item : g_state)
      destination.insert(item.key(), torch::zeros_like(item.value()));
  }
  if (into_state && world > 0 && rank_destinations[world].empty()) {
    for (int r = 0; r < world; ++r) {
      auto& mine = rank_destinations[world].emplace_back();
      for (const auto& [name, request] : requests[static_cast<size_t>(r)]) {
        for (const auto& range : request.ranges) {
          mine[name] = torch::zeros({range.numel}, torch::TensorOptions(request.dtype));
        }
      }
    }
  }
  absl::StatusOr<TensorDict> loaded;
  std::vector<absl::StatusOr<state_dict::ShardedStateDict>> rank_loaded(static_cast<size_t>(world));
  auto clear = [&] {
    loaded = TensorDict();
    for (auto& r : rank_loaded) r = state_dict::ShardedStateDict();
  };
  auto load = [&] {
    if (world == 0) {
      loaded = state_dict::LoadFullStateDict(dir);
      Check(state, loaded.status());
      if (!loaded.ok() || !into_state) return;
      for (const auto& item : *loaded) destination[item.key()].copy_(item.value());
      return;
    }
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back([&, r] {
        auto& mine = rank_loaded[static_cast<size_t>(r)];
        mine = state_dict::LoadResharded(dir, requests[static_cast<size_t>(r)]);
        if (!mine.ok() || !into_state) return;
        auto& into = rank_destinations[world][static_cast<size_t>(r)];
        for (const auto& item : *mine) {
          for (const auto& piece : item.value().pieces) into[item.key()].copy_(piece.data);
        }
      });
    }
    for (auto& t : ranks) t.join();
    for (const auto& r : rank_loaded) Check(state, r.status());
  };
  TimeColdReads(state, dir, clear, load);
  if (world == 0 && loaded.ok()) {
    for (const auto& item : g_state) {
      const torch::Tensor& got = into_state ? destination[item.key()] : (*loaded)[item.key()];
      if (!torch::equal(got, item.value())) {
        state.SkipWithError(("loaded " + item.key() + " differs").c_str());
      }
    }
  }
  state.SetLabel(
      (world == 0 ? std::string("full") : "sharded/" + std::to_string(world) + " ranks") +
      (into_state ? ", copied into the state" : ""));
}

// torch.distributed.checkpoint (issue 25): the same shards saved as DCP
// (SaveDcpShard on R threads + CommitDcpCheckpoint), and each of W ranks'
// LoadResharded of its own ranges from it, cold, against the same paired
// disk baselines as BM_Save/sharded and BM_Load/W/0.
absl::Status SaveDcp(const std::string& dir, int world) {
  std::vector<absl::Status> statuses(static_cast<size_t>(world));
  const std::vector<state_dict::ShardedStateDict>& shards = Shards(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      state_dict::DcpShard shard;
      for (const auto& item : shards[static_cast<size_t>(r)]) {
        shard.tensors.push_back(state_dict::DcpShard::Tensor{{"model", item.key()}, item.value()});
      }
      statuses[static_cast<size_t>(r)] = state_dict::SaveDcpShard(dir, r, shard);
    });
  }
  for (auto& t : ranks) t.join();
  for (const auto& s : statuses) {
    if (!s.ok()) return s;
  }
  return state_dict::CommitDcpCheckpoint(dir, world);
}

void BM_DcpSave(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::string dir = g_root + "/dcp_save";
  Shards(world);
  uint64_t bytes = 0;
  double paired_s = 0;
  int64_t i = 0;
  for (auto _ : state) {
    const bool plain_first = ++i % 2 == 1;
    state.PauseTiming();
    if (plain_first) paired_s += WritePlainFile();
    state.ResumeTiming();
    Check(state, SaveDcp(dir, world));
    state.PauseTiming();
    bytes += DirectoryBytes(dir);
    RemoveTree(dir);
    if (!plain_first) paired_s += WritePlainFile();
    state.ResumeTiming();
  }
  state.counters["paired_write_MBps"] =
      benchmark::Counter(static_cast<double>(i) * g_state_bytes / paired_s / 1e6);
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.SetLabel("dcp/" + std::to_string(world) + " ranks");
}

void BM_DcpLoad(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::string dir = g_root + "/dcp_read_" + std::to_string(world);
  RemoveTree(dir);
  Check(state, SaveDcp(dir, 2));  // written by 2 ranks, read by `world`
  WritePlainFile();
  auto ckpt = state_dict::DcpCheckpoint::Open(dir);
  Check(state, ckpt.status());
  if (!ckpt.ok()) return;
  std::vector<std::vector<std::pair<std::string, state_dict::ShardRequest>>> requests;
  for (int r = 0; r < world; ++r) {
    auto& mine = requests.emplace_back();
    for (auto& [name, request] : RankRequests(r, world))
      mine.emplace_back("model." + name, request);
  }
  std::vector<absl::StatusOr<state_dict::ShardedStateDict>> loaded(static_cast<size_t>(world));
  auto clear = [&] {
    for (auto& l : loaded) l = state_dict::ShardedStateDict();
  };
  auto load = [&] {
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back([&, r] {
        loaded[static_cast<size_t>(r)] = ckpt->LoadResharded(requests[static_cast<size_t>(r)]);
      });
    }
    for (auto& t : ranks) t.join();
    for (const auto& l : loaded) Check(state, l.status());
  };
  TimeColdReads(state, dir, clear, load);
  state.SetLabel("dcp of 2 ranks read by " + std::to_string(world));
}

void BM_Verify(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::string dir = FreshCheckpoint(world);
  TimeColdReads(
      state, dir, [] {}, [&] { Check(state, state_dict::VerifyCheckpoint(dir)); });
  state.SetLabel(world == 0 ? "full" : "sharded/" + std::to_string(world) + " ranks");
}

double ThreadCpuSeconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// range(0): 0 = no save, 1 = synchronous save, 2 = async save from a
// snapshot, 3 = async save in place; at the first of 4 real training steps
// (forward, backward, Adam) of the model.
void BM_TrainLoop(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const std::string root = g_root + "/loop";
  torch::optim::Adam optimizer(g_model->parameters(), torch::optim::AdamOptions(1e-5));
  torch::manual_seed(1);
  const torch::Tensor batch = torch::randint(kConfig.vocab, {4, kConfig.seq + 1}, torch::kInt64);
  state_dict::AsyncCheckpointer saver;
  double blocked_s = 0;  // time the loop spent inside the save call
  double save_cpu_s = 0;
  for (auto _ : state) {
    const int64_t step = ++g_step;
    for (int i = 0; i < 4; ++i) {
      optimizer.zero_grad();
      g_model->Loss(batch).backward();
      if (mode == 3) {  // the state must not change before the save has written it
        const auto start = std::chrono::steady_clock::now();
        saver.WaitUntilWritten();
        blocked_s +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      optimizer.step();
      if (i != 0 || mode == 0) continue;
      const auto start = std::chrono::steady_clock::now();
      if (mode == 1) {
        const double cpu_before = ThreadCpuSeconds();
        Check(state, state_dict::SaveFullCheckpoint(root, step, g_state));
        save_cpu_s += ThreadCpuSeconds() - cpu_before;
      } else {
        // The writer thread is new for each save: its CPU clock is the save's.
        auto then = [&save_cpu_s] {
          save_cpu_s += ThreadCpuSeconds();
          return absl::OkStatus();
        };
        Check(state, mode == 2 ? saver.SaveFull(root, step, g_state, then)
                               : saver.SaveFullInPlace(root, step, g_state, then));
      }
      blocked_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    Check(state, saver.Wait());  // the loop's end: the save is complete
    state.PauseTiming();
    RemoveTree(root);
    state.ResumeTiming();
  }
  state.counters["blocked_ms"] = benchmark::Counter(1e3 * blocked_s / state.iterations());
  // CPU time the save itself used (the writing thread's clock): what an async
  // save takes from the training loop's cores even when its I/O waits overlap.
  state.counters["save_cpu_ms"] = benchmark::Counter(1e3 * save_cpu_s / state.iterations());
  state.SetLabel(mode == 0   ? "no save"
                 : mode == 1 ? "sync save"
                 : mode == 2 ? "async save (snapshot)"
                             : "async save (in place)");
}

BENCHMARK(BM_DiskWrite)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(kIterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DiskRead)->Iterations(kReadIterations)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Save)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(kIterations)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)
    ->ArgsProduct({{0, 1, 2}, {0, 1}})
    ->Iterations(kReadIterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DcpSave)
    ->Arg(2)
    ->Iterations(kIterations)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DcpLoad)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(kReadIterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Verify)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(kReadIterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TrainLoop)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Iterations(kIterations)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Console output plus the ratios the goals are stated in.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const std::string name = run.benchmark_name();
      auto bps = run.counters.find("bytes_per_second");
      if (bps != run.counters.end()) rate_[name] = bps->second.value;
      for (const char* counter : {"paired_read_MBps", "paired_write_MBps"}) {
        auto paired = run.counters.find(counter);
        if (paired != run.counters.end()) paired_[name] = paired->second.value * 1e6;
      }
      const double seconds =
          run.GetAdjustedRealTime() * (run.time_unit == benchmark::kMillisecond ? 1e-3 : 1);
      // Repeated cases (the training loop runs each mode twice, interleaved,
      // so drifting load on a shared machine hits all modes alike): mean.
      seconds_[name] += seconds / 2;
      auto blocked = run.counters.find("blocked_ms");
      if (blocked != run.counters.end()) blocked_[name] += blocked->second.value / 2;
      auto cpu = run.counters.find("save_cpu_ms");
      if (cpu != run.counters.end()) save_cpu_[name] += cpu->second.value / 2;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    const double dd_write = Rate("BM_DiskWrite/0"), write = Rate("BM_DiskWrite/1");
    const double read = Rate("BM_DiskRead");
    std::printf(
        "\nDisk: fsync'd write %.0f MB/s (%.0f MB/s as dd conv=fsync), cold read %.0f MB/s\n",
        write / 1e6, dd_write / 1e6, read / 1e6);
    for (const auto& [name, rate] : rate_) {
      if (name.rfind("BM_Disk", 0) == 0) continue;
      const double disk = name.rfind("BM_Save", 0) == 0 ? write : read;
      std::printf("  %-40s %7.0f MB/s = %3.0f%% of the disk's %s", name.c_str(), rate / 1e6,
                  100 * rate / disk, name.rfind("BM_Save", 0) == 0 ? "write" : "read");
      auto paired = paired_.find(name);
      if (paired != paired_.end()) {
        std::printf(", %3.0f%% of the %s beside it (%.0f MB/s)", 100 * rate / paired->second,
                    name.rfind("BM_Save", 0) == 0 ? "write" : "read", paired->second / 1e6);
      }
      std::printf("\n");
    }
    const double none = Seconds("BM_TrainLoop/0/iterations:3/real_time");
    const double sync = Seconds("BM_TrainLoop/1/iterations:3/real_time");
    const double async = Seconds("BM_TrainLoop/2/iterations:3/real_time");
    const double in_place = Seconds("BM_TrainLoop/3/iterations:3/real_time");
    if (none > 0 && sync > 0 && async > 0 && in_place > 0) {
      std::printf(
          "Training loop (4 steps, mean of 2 runs of each mode): no save %.3f s; sync "
          "save adds %.3f s; async save from a snapshot adds %.3f s = %.1f%%, in place "
          "%.3f s = %.1f%% of the synchronous save's cost\n",
          none, sync - none, async - none, 100 * (async - none) / (sync - none), in_place - none,
          100 * (in_place - none) / (sync - none));
      std::printf(
          "Time the loop waits in the save calls: sync %.0f ms, snapshot %.0f ms, in "
          "place (until written) %.0f ms\n",
          blocked_["BM_TrainLoop/1/iterations:3/real_time"],
          blocked_["BM_TrainLoop/2/iterations:3/real_time"],
          blocked_["BM_TrainLoop/3/iterations:3/real_time"]);
      std::printf(
          "CPU time of the save itself: sync %.0f ms, async (writer thread) %.0f ms "
          "(snapshot) / %.0f ms (in place); the loop's 2 compute threads share the 2 "
          "cores with it\n",
          save_cpu_["BM_TrainLoop/1/iterations:3/real_time"],
          save_cpu_["BM_TrainLoop/2/iterations:3/real_time"],
          save_cpu_["BM_TrainLoop/3/iterations:3/real_time"]);
    }
  }

 private:
  double Rate(const std::string& prefix) const {
    for (const auto& [name, rate] : rate_) {
      if (name.rfind(prefix, 0) == 0) return rate;
    }
    return 0;
  }
  double Seconds(const std::string& name) const {
    auto found = seconds_.find(name);
    return found == seconds_.end() ? 0 : found->second;
  }
  std::map<std::string, double> rate_, paired_, seconds_, blocked_, save_cpu_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const char* dir = std::getenv("CHECKPOINT_BENCH_DIR");
  g_root = dir != nullptr ? dir : "/tmp/checkpoint_bench";
  RemoveTree(g_root);
  (void)Run("mkdir -p '" + g_root + "'");

  g_model = trainer::BuildModel(trainer::ModelType::kTransformer, kConfig, /*seed=*/0);
  torch::manual_seed(0);
  int64_t largest = 0;
  for (const auto& p : g_model->named_parameters()) {
    const torch::Tensor w = p.value().detach();
    g_state.insert("model." + p.key(), w);
    g_state.insert("optim." + p.key() + ".exp_avg", torch::randn_like(w) * 1e-3);
    g_state.insert("optim." + p.key() + ".exp_avg_sq", torch::rand_like(w) * 1e-6);
    largest = std::max<int64_t>(largest, w.nbytes());
  }
  g_state.insert("trainer.step", torch::tensor({int64_t{1000}}));
  for (const auto& item : g_state) g_state_bytes += item.value().nbytes();
  std::printf(
      "State: %zu tensors, %.1f MiB (model + AdamW exp_avg, exp_avg_sq); largest "
      "tensor %.1f MiB; directory %s\n",
      g_state.size(), g_state_bytes / 1048576.0, largest / 1048576.0, g_root.c_str());

  // Memory a save adds, first thing in the process (nothing freed yet that
  // the allocator could hand back to the save unseen).
  const double full_added = PeakRssAddedMiB([] {
    absl::Status s = state_dict::SaveFullCheckpoint(g_root + "/mem_full", 1, g_state);
    if (!s.ok()) std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
  });
  const state_dict::ShardedStateDict shard = RankShard(0, 1);
  const double shard_added = PeakRssAddedMiB([&] {
    absl::Status s = state_dict::SaveShard(g_root + "/mem_shard", 1, 0, 1, shard);
    if (!s.ok()) std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
  });
  // Memory a verify adds: VerifyCheckpoint of the full checkpoint just
  // saved (goal: a fixed buffer, not the file's tensors). Before the copy
  // below, which frees 290 MiB the allocator could hand back unseen.
  const double verify_added = PeakRssAddedMiB([] {
    absl::Status s =
        state_dict::VerifyCheckpoint(state_dict::StepDirectory(g_root + "/mem_full", 1));
    if (!s.ok()) std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
  });
  std::vector<torch::Tensor> copies;
  const double copy_added = PeakRssAddedMiB([&] {
    for (const auto& item : g_state) copies.push_back(item.value().clone());
  });
  copies.clear();
  std::printf(
      "Peak RSS added: SaveFullCheckpoint %.1f MiB, SaveShard (1 rank) %.1f MiB, "
      "VerifyCheckpoint (full) %.1f MiB; largest tensor %.1f MiB; check: a full copy "
      "of the state adds %.1f MiB\n",
      full_added, shard_added, verify_added, largest / 1048576.0, copy_added);
  RemoveTree(g_root + "/mem_full");
  RemoveTree(g_root + "/mem_shard");

  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  RemoveTree(g_root);
  return 0;
}
