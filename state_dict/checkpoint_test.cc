#include "state_dict/checkpoint.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "formats/io/file_io.h"
#include "formats/testing/file_bytes.h"
#include "formats/testing/python_interop.h"
#include "state_dict/internal/live_checkpoint.h"
#include "state_dict/testing/expect_same_state.h"

namespace state_dict {
namespace {

using formats::testing::Slurp;
using formats::testing::Spit;
using testing::ExpectSameState;

using formats::testing::TempDir;

bool Contains(const absl::Status& status, const std::string& text) {
  return status.message().find(text) != absl::string_view::npos;
}

// A model-like state: uneven sizes so 4 ranks split it unevenly.
TensorDict MakeState(double scale) {
  TensorDict sd;
  sd.insert("encoder.weight", torch::arange(35, torch::kFloat).view({5, 7}) * scale);
  sd.insert("encoder.bias", torch::arange(5, torch::kFloat) * -scale);
  sd.insert("head.weight", torch::arange(6, torch::kDouble).view({2, 3}) * scale);
  sd.insert("steps", torch::tensor({int64_t(scale)}, torch::kLong));
  return sd;
}

// FSDP-style shards of `sd` over `world` ranks: the state's tensors are
// flattened into one flat parameter and split evenly.
std::vector<ShardedStateDict> Shard(const TensorDict& sd, int world) {
  std::vector<int64_t> numels;
  int64_t total = 0;
  for (const auto& item : sd) {
    numels.push_back(item.value().numel());
    total += item.value().numel();
  }
  std::vector<ShardedStateDict> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto ranges = OriginalRangesInShard(numels, EvenShardRange(total, world, r));
    size_t i = 0;
    for (const auto& item : sd) {
      out[static_cast<size_t>(r)].insert(item.key(), ShardFullTensor(item.value(), {ranges[i++]}));
    }
  }
  return out;
}

TEST(CheckpointTest, FullRoundTripAndLatest) {
  const std::string root = TempDir("full");
  ASSERT_TRUE(SaveFullCheckpoint(root, 10, MakeState(1)).ok());
  ASSERT_TRUE(SaveFullCheckpoint(root, 20, MakeState(2)).ok());
  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, root + "/step_20");
  ASSERT_TRUE(VerifyCheckpoint(*latest).ok());
  auto loaded = LoadFullStateDict(*latest);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(2));
  // The data file is PyTorch's own format.
  auto direct = LoadTensorDict(*latest + "/model.pt");
  ASSERT_TRUE(direct.ok()) << direct.status();
  ExpectSameState(direct->tensors, MakeState(2));
  // A complete step is never overwritten in place.
  EXPECT_TRUE(absl::IsAlreadyExists(SaveFullCheckpoint(root, 20, MakeState(3))));
}

// Loaded tensors share the committed file's pages until written (a private
// mapping): writing them must change neither the file nor a later load, and
// they must stay valid after their checkpoint is removed.
TEST(CheckpointTest, LoadedTensorsAreTheirOwnAndOutliveTheirFiles) {
  const std::string root = TempDir("loaded_own");
  ASSERT_TRUE(SaveFullCheckpoint(root, 1, MakeState(1)).ok());
  ASSERT_TRUE(SaveShardedCheckpoint(root, 2, Shard(MakeState(2), 2)).ok());
  const std::string full_dir = StepDirectory(root, 1), sharded_dir = StepDirectory(root, 2);
  const std::string model_bytes = Slurp(full_dir + "/model.pt");

  auto full = LoadFullStateDict(full_dir);
  auto rank0 = LoadLocalShard(sharded_dir, 0, 2);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  const TensorDict rank0_want = LoadLocalShard(sharded_dir, 0, 2).value();
  for (auto& item : *full) item.value().add_(100);
  for (auto& item : *rank0) item.value().fill_(-7);
  EXPECT_EQ(Slurp(full_dir + "/model.pt"), model_bytes);
  EXPECT_TRUE(VerifyCheckpoint(full_dir).ok());
  EXPECT_TRUE(VerifyCheckpoint(sharded_dir).ok());
  auto again = LoadFullStateDict(full_dir);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameState(*again, MakeState(1));
  auto rank0_again = LoadLocalShard(sharded_dir, 0, 2);
  ASSERT_TRUE(rank0_again.ok()) << rank0_again.status();
  ExpectSameState(*rank0_again, rank0_want);

  // The checkpoints removed (as pruning does) while their tensors live.
  ASSERT_TRUE(PruneCheckpoints(root, 1).ok());
  std::filesystem::remove_all(sharded_dir);
  ASSERT_FALSE(std::filesystem::exists(full_dir));
  ASSERT_FALSE(std::filesystem::exists(sharded_dir));
  ExpectSameState(*again, MakeState(1));
  ExpectSameState(*rank0_again, rank0_want);
  for (auto& item : *again) item.value().mul_(2);
  ExpectSameState(*again, MakeState(2));
  for (const auto& item : *full) {
    EXPECT_TRUE(torch::equal(item.value(), MakeState(1)[item.key()] + 100)) << item.key();
  }
}

TEST(CheckpointTest, ShardedOnFourRanksLoadsOnOneTwoAndThree) {
  const std::string root = TempDir("sharded");
  const TensorDict state = MakeState(3);
  ASSERT_TRUE(SaveShardedCheckpoint(root, 5, Shard(state, 4)).ok());
  const std::string dir = StepDirectory(root, 5);
  ASSERT_TRUE(VerifyCheckpoint(dir).ok());
  auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok());
  EXPECT_EQ(manifest->world_size, 4);
  EXPECT_EQ(manifest->kind, CheckpointKind::kSharded);

  auto full = LoadFullStateDict(dir);  // world size 1
  ASSERT_TRUE(full.ok()) << full.status();
  ExpectSameState(*full, state);

  for (int world : {2, 3}) {
    const std::vector<ShardedStateDict> expected = Shard(state, world);
    for (int rank = 0; rank < world; ++rank) {
      std::vector<std::pair<std::string, ShardRequest>> requests;
      for (const auto& item : expected[static_cast<size_t>(rank)]) {
        ShardRequest request;
        request.global_shape = item.value().global_shape;
        request.dtype = item.value().dtype;
        for (const ShardPiece& p : item.value().pieces) request.ranges.push_back(p.range);
        requests.emplace_back(item.key(), request);
      }
      auto got = LoadResharded(dir, requests);
      ASSERT_TRUE(got.ok()) << got.status();
      for (const auto& item : expected[static_cast<size_t>(rank)]) {
        const ShardedTensor& g = (*got)[item.key()];
        ASSERT_EQ(g.pieces.size(), item.value().pieces.size());
        for (size_t k = 0; k < g.pieces.size(); ++k) {
          EXPECT_TRUE(torch::equal(g.pieces[k].data, item.value().pieces[k].data))
              << item.key() << " world " << world << " rank " << rank;
        }
      }
    }
  }
  // LOCAL: only for the same world size.
  EXPECT_TRUE(LoadLocalShard(dir, 1, 4).ok());
  auto wrong_world = LoadLocalShard(dir, 1, 2);
  EXPECT_TRUE(Contains(wrong_world.status(), "world size 4")) << wrong_world.status();
}

TEST(CheckpointTest, ModelMismatchNamesTheTensor) {
  const std::string root = TempDir("mismatch");
  ASSERT_TRUE(SaveShardedCheckpoint(root, 1, Shard(MakeState(1), 2)).ok());
  const std::string dir = StepDirectory(root, 1);
  ShardRequest request;
  request.global_shape = {5, 6};
  request.dtype = torch::kFloat;
  request.ranges = {{0, 3}};
  auto shape = LoadResharded(dir, {{"encoder.weight", request}});
  EXPECT_TRUE(Contains(shape.status(), "'encoder.weight'")) << shape.status();
  EXPECT_TRUE(Contains(shape.status(), "[5, 7]")) << shape.status();
  request.global_shape = {5, 7};
  request.dtype = torch::kHalf;
  auto dtype = LoadResharded(dir, {{"encoder.weight", request}});
  EXPECT_TRUE(Contains(dtype.status(), "Half")) << dtype.status();
  auto unknown = LoadResharded(dir, {{"decoder.weight", request}});
  EXPECT_TRUE(absl::IsNotFound(unknown.status()));
  EXPECT_TRUE(Contains(unknown.status(), "'decoder.weight'")) << unknown.status();
}

TEST(CheckpointTest, DamagedCheckpointsAreClearErrors) {
  const std::string root = TempDir("damaged");
  ASSERT_TRUE(SaveShardedCheckpoint(root, 7, Shard(MakeState(1), 4)).ok());
  const std::string dir = StepDirectory(root, 7);
  const std::string rank2 = dir + "/rank_00002.pt";
  const std::string original = Slurp(rank2);

  // Truncated file.
  Spit(rank2, original.substr(0, original.size() - 100));
  absl::Status status = VerifyCheckpoint(dir);
  EXPECT_TRUE(Contains(status, rank2) && Contains(status, "truncated")) << status;
  EXPECT_FALSE(LoadFullStateDict(dir).ok());

  // One corrupted byte inside tensor data: find rank 2's piece of
  // encoder.weight in the file and flip a bit in it.
  ShardedTensor piece = Shard(MakeState(1), 4)[2]["encoder.weight"];
  torch::Tensor data = piece.pieces.at(0).data.contiguous();
  const std::string needle(static_cast<const char*>(data.data_ptr()), data.nbytes());
  const size_t at = original.find(needle);
  ASSERT_NE(at, std::string::npos);
  std::string corrupted = original;
  corrupted[at + 5] ^= 0x10;
  Spit(rank2, corrupted);
  status = VerifyCheckpoint(dir);
  EXPECT_TRUE(Contains(status, "checksum mismatch in file " + rank2)) << status;
  EXPECT_TRUE(Contains(status, "'encoder.weight'")) << status;

  // Missing rank file.
  ::unlink(rank2.c_str());
  auto loaded = LoadFullStateDict(dir);
  EXPECT_TRUE(absl::IsNotFound(loaded.status()));
  EXPECT_TRUE(Contains(loaded.status(), rank2) && Contains(loaded.status(), "rank 2"))
      << loaded.status();
  Spit(rank2, original);
  EXPECT_TRUE(VerifyCheckpoint(dir).ok());

  // A manifest from a newer format.
  const std::string manifest_path = dir + "/MANIFEST";
  std::string manifest = Slurp(manifest_path);
  Spit(manifest_path, "torchfsdp-checkpoint 3" + manifest.substr(manifest.find('\n')));
  status = VerifyCheckpoint(dir);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_TRUE(Contains(status, "format version 3") && Contains(status, manifest_path)) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition(LatestCheckpoint(root).status()));

  // A manifest cut short is an incomplete save, not a checkpoint.
  Spit(manifest_path, manifest.substr(0, manifest.size() / 2));
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpoint(root).status()));
  Spit(manifest_path, manifest);
  EXPECT_TRUE(LatestCheckpoint(root).ok());
}

// A process is SIGKILLed in the middle of writing step 2 (after its first
// file is durable, before the rest and the manifest). Step 1 must still be
// the latest checkpoint and load completely.
TEST(CheckpointTest, KilledSaveLeavesPreviousCheckpointLoadable) {
  const std::string root = TempDir("killed");
  ASSERT_TRUE(SaveShardedCheckpoint(root, 1, Shard(MakeState(1), 4)).ok());

  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    internal::SetAfterFileWrittenHookForTesting([&](const std::string&) {
      char byte = 1;
      if (::write(pipe_fds[1], &byte, 1) != 1) ::_exit(3);
      while (true) ::pause();  // wait here to be killed mid-save
    });
    (void)SaveShardedCheckpoint(root, 2, Shard(MakeState(2), 4));
    ::_exit(2);  // not reached: the hook never returns
  }
  ::close(pipe_fds[1]);
  char byte = 0;
  ASSERT_EQ(::read(pipe_fds[0], &byte, 1), 1) << "child never wrote a file";
  ::close(pipe_fds[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);

  // The partial step exists on disk, with its first file, but no manifest.
  const std::string partial = StepDirectory(root, 2);
  EXPECT_EQ(::access((partial + "/rank_00000.pt").c_str(), F_OK), 0);
  EXPECT_NE(::access((partial + "/MANIFEST").c_str(), F_OK), 0);
  EXPECT_TRUE(absl::IsNotFound(ReadManifest(partial).status()));

  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDirectory(root, 1));
  auto loaded = LoadFullStateDict(*latest);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(1));

  // Saving step 2 again over the debris completes normally.
  ASSERT_TRUE(SaveShardedCheckpoint(root, 2, Shard(MakeState(2), 4)).ok());
  latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, partial);
  loaded = LoadFullStateDict(partial);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(2));
}

// Four processes each write their own shard with no communication; after
// all of them exited (the barrier), one commits the manifest.
TEST(CheckpointTest, RanksInSeparateProcessesThenCommit) {
  const std::string root = TempDir("processes");
  const TensorDict state = MakeState(4);
  const std::vector<ShardedStateDict> shards = Shard(state, 4);
  std::vector<pid_t> children;
  for (int r = 0; r < 4; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      absl::Status status = SaveShard(root, 9, r, 4, shards[static_cast<size_t>(r)]);
      ::_exit(status.ok() ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int wstatus = 0;
    ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
    ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  }
  EXPECT_FALSE(LatestCheckpoint(root).ok());  // not visible before the commit
  ASSERT_TRUE(CommitShardedCheckpoint(root, 9, 4).ok());
  auto loaded = LoadFullStateDict(StepDirectory(root, 9));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, state);
}

TEST(CheckpointTest, CommitRefusesUntilEveryRankFinished) {
  const std::string root = TempDir("commit");
  auto shards = Shard(MakeState(1), 3);
  ASSERT_TRUE(SaveShard(root, 4, 0, 3, shards[0]).ok());
  ASSERT_TRUE(SaveShard(root, 4, 2, 3, shards[2]).ok());
  absl::Status status = CommitShardedCheckpoint(root, 4, 3);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_TRUE(Contains(status, "rank 1")) << status;
  EXPECT_FALSE(LatestCheckpoint(root).ok());
  ASSERT_TRUE(SaveShard(root, 4, 1, 3, shards[1]).ok());
  ASSERT_TRUE(CommitShardedCheckpoint(root, 4, 3).ok());
  EXPECT_TRUE(LatestCheckpoint(root).ok());
}

// What a rank of a `world`-rank job requests when resuming: its shard of
// every tensor (as Shard lays them out).
std::vector<std::pair<std::string, ShardRequest>> Requests(const ShardedStateDict& shard) {
  std::vector<std::pair<std::string, ShardRequest>> out;
  for (const auto& item : shard) {
    ShardRequest request;
    request.global_shape = item.value().global_shape;
    request.dtype = item.value().dtype;
    for (const ShardPiece& p : item.value().pieces) request.ranges.push_back(p.range);
    out.emplace_back(item.key(), request);
  }
  return out;
}

// A resume of the whole checkpoint on `world` ranks (every rank's
// LoadResharded): OK only if every rank's is, and then with the right data.
absl::Status Resume(const std::string& dir, const TensorDict& state, int world) {
  const std::vector<ShardedStateDict> expected = Shard(state, world);
  for (int rank = 0; rank < world; ++rank) {
    const ShardedStateDict& want = expected[static_cast<size_t>(rank)];
    auto got = LoadResharded(dir, Requests(want));
    if (!got.ok()) return got.status();
    for (const auto& item : want) {
      const ShardedTensor& g = (*got)[item.key()];
      for (size_t k = 0; k < item.value().pieces.size(); ++k) {
        if (!torch::equal(g.pieces.at(k).data, item.value().pieces[k].data)) {
          return absl::InternalError(absl::StrCat("resume on ", world, " ranks: rank ", rank,
                                                  " got wrong data for ", item.key()));
        }
      }
    }
  }
  return absl::OkStatus();
}

bool MentionsFile(const absl::Status& status, const std::string& path) {
  std::string lower(status.message());
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (path.find("MANIFEST") != std::string::npos) {
    return lower.find("manifest") != std::string::npos;
  }
  return Contains(status, path);
}

// Many deterministic, seeded corruptions of a real 2-rank sharded
// checkpoint: byte flips and truncation of any file, deleted files, garbage
// appended, MANIFEST numbers (offsets, sizes, shapes, counts, ranks, step)
// nudged by one, dtypes swapped, rank files swapped. In every trial `verify`
// and every way of loading (full, resume on 2 and 3 ranks, local shards)
// must agree: all reject, naming a file involved, or all accept with intact
// data. Nothing may crash or hang.
TEST(CheckpointTest, CorruptionTrialsVerifyAndLoadsAgree) {
  const std::string root = TempDir("corruption");
  const TensorDict state = MakeState(1);
  ASSERT_TRUE(SaveShardedCheckpoint(root, 3, Shard(state, 2)).ok());
  const std::string dir = StepDirectory(root, 3);
  const std::vector<std::string> names = {"MANIFEST", "rank_00000.pt", "rank_00001.pt"};
  // Only the manifest and the data files make up a committed checkpoint:
  // the ranks' .meta files are gone after the commit.
  std::map<std::string, std::string> pristine;
  for (const std::string& name : names) pristine[name] = Slurp(dir + "/" + name);
  EXPECT_NE(::access((dir + "/rank_00000.meta").c_str(), F_OK), 0);
  EXPECT_NE(::access((dir + "/rank_00001.meta").c_str(), F_OK), 0);
  ASSERT_TRUE(VerifyCheckpoint(dir).ok());

  const char* kDtypes[] = {"Float", "Double", "Long", "Half", "Int", "BFloat16"};
  const int kKinds = 7;
  const int kTrials = 280;
  std::map<int, std::pair<int, int>> outcomes;  // kind -> (rejected, accepted)
  const auto start = std::chrono::steady_clock::now();
  for (int trial = 0; trial < kTrials; ++trial) {
    for (const auto& file : pristine) Spit(dir + "/" + file.first, file.second);
    std::mt19937 rng(static_cast<uint32_t>(trial));
    auto pick = [&](size_t n) {
      return static_cast<size_t>(std::uniform_int_distribution<size_t>(0, n - 1)(rng));
    };
    const int kind = trial % kKinds;
    const std::string name = names[pick(names.size())];
    const std::string path = dir + "/" + name;
    std::string bytes = pristine[name];
    std::string what;
    std::vector<std::string> involved = {path};
    switch (kind) {
      case 0: {  // flip one byte anywhere
        const size_t at = pick(bytes.size());
        bytes[at] = static_cast<char>(bytes[at] ^ (1 + pick(255)));
        what = absl::StrCat("flip byte ", at, " of ", name);
        Spit(path, bytes);
        break;
      }
      case 1: {  // truncate
        const size_t size = pick(bytes.size());
        what = absl::StrCat("truncate ", name, " to ", size);
        Spit(path, bytes.substr(0, size));
        break;
      }
      case 2:  // delete
        what = absl::StrCat("delete ", name);
        ::unlink(path.c_str());
        break;
      case 3:  // garbage appended
        what = absl::StrCat("append to ", name);
        Spit(path, bytes + std::string(1 + pick(64), '\0'));
        break;
      case 4:
      case 5: {  // a number in the MANIFEST moved by one
        std::string m = pristine["MANIFEST"];
        std::vector<std::pair<size_t, size_t>> runs;  // digit runs
        for (size_t i = 0; i < m.size();) {
          if (!std::isdigit(static_cast<unsigned char>(m[i]))) {
            ++i;
            continue;
          }
          size_t j = i;
          while (j < m.size() && std::isdigit(static_cast<unsigned char>(m[j]))) ++j;
          runs.emplace_back(i, j - i);
          i = j;
        }
        const auto run = runs[pick(runs.size())];
        const int64_t value = std::stoll(m.substr(run.first, run.second));
        const int64_t nudged = value + (pick(2) == 0 ? 1 : -1);
        m.replace(run.first, run.second, std::to_string(nudged));
        what = absl::StrCat("MANIFEST number at byte ", run.first, ": ", value, " -> ", nudged);
        involved = {dir + "/MANIFEST"};
        Spit(dir + "/MANIFEST", m);
        break;
      }
      case 6: {  // a dtype in the MANIFEST changed, or the rank files swapped
        if (pick(2) == 0) {
          std::string m = pristine["MANIFEST"];
          std::vector<size_t> at;
          for (size_t i = m.find(" dtype "); i != std::string::npos; i = m.find(" dtype ", i + 1)) {
            at.push_back(i + 7);
          }
          const size_t begin = at[pick(at.size())];
          const size_t end = m.find(' ', begin);
          const std::string old = m.substr(begin, end - begin);
          std::string dtype = kDtypes[pick(6)];
          if (dtype == old) dtype = old == "Float" ? "Double" : "Float";
          m.replace(begin, end - begin, dtype);
          what = absl::StrCat("MANIFEST dtype ", old, " -> ", dtype);
          involved = {dir + "/MANIFEST"};
          Spit(dir + "/MANIFEST", m);
        } else {
          what = "swap rank_00000.pt and rank_00001.pt";
          Spit(dir + "/rank_00000.pt", pristine["rank_00001.pt"]);
          Spit(dir + "/rank_00001.pt", pristine["rank_00000.pt"]);
          involved = {dir + "/rank_00000.pt", dir + "/rank_00001.pt"};
        }
        break;
      }
    }
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": ", what));
    const absl::Status verify = VerifyCheckpoint(dir);
    absl::Status full = LoadFullStateDict(dir).status();
    if (full.ok()) {
      auto loaded = LoadFullStateDict(dir);
      for (const auto& item : state) {
        if (!torch::equal((*loaded)[item.key()], item.value())) {
          full = absl::InternalError("full load returned wrong data for " + item.key());
        }
      }
    }
    absl::Status local;
    for (int rank = 0; rank < 2 && local.ok(); ++rank) {
      auto shard = LoadLocalShard(dir, rank, 2);
      local = shard.status();
    }
    const std::vector<std::pair<std::string, absl::Status>> loads = {
        {"full", full},
        {"resume on 2", Resume(dir, state, 2)},
        {"resume on 3", Resume(dir, state, 3)},
        {"local shards", local}};
    for (const auto& load : loads) {
      EXPECT_EQ(load.second.ok(), verify.ok())
          << load.first << ": " << load.second << "\nverify: " << verify;
      EXPECT_FALSE(absl::IsInternal(load.second)) << load.first << ": " << load.second;
    }
    if (!verify.ok()) {
      bool named = false;
      for (const std::string& file : involved) named = named || MentionsFile(verify, file);
      EXPECT_TRUE(named) << "verify: " << verify;
      named = false;
      for (const std::string& file : involved) named = named || MentionsFile(full, file);
      EXPECT_TRUE(named) << "full load: " << full;
    }
    (verify.ok() ? outcomes[kind].second : outcomes[kind].first)++;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& o : outcomes) {
    std::cout << "corruption kind " << o.first << ": " << o.second.first << " rejected, "
              << o.second.second << " accepted (intact)\n";
    EXPECT_GT(o.second.first, 0) << "kind " << o.first << " never caught anything";
  }
  std::cout << kTrials << " trials in " << seconds << " s\n";
  // Restored, the checkpoint loads again.
  for (const auto& file : pristine) Spit(dir + "/" + file.first, file.second);
  EXPECT_TRUE(VerifyCheckpoint(dir).ok());
}

// A tensor replicated on every rank (what a LOCAL save holds) is stored as
// overlapping pieces. Identical copies verify and load; copies that differ
// are rejected by verify, the full load and every resume alike, naming the
// tensor and the first element that differs (issue #14: verify and the
// loads used to disagree on overlaps).
TEST(CheckpointTest, ReplicatedPiecesMustBeIdenticalCopies) {
  const torch::Tensor replicated = torch::arange(6, torch::kDouble);
  TensorDict state = MakeState(1);
  for (const bool differ : {false, true}) {
    SCOPED_TRACE(differ ? "copies differ" : "identical copies");
    const std::string root = TempDir(differ ? "replicated_differ" : "replicated_same");
    std::vector<ShardedStateDict> shards = Shard(state, 2);
    torch::Tensor copy = replicated.clone();
    if (differ) copy[4] = 40.0;
    shards[0].insert("replicated", ShardFullTensor(replicated, {{0, 6}}));
    shards[1].insert("replicated", ShardFullTensor(copy, {{0, 6}}));
    ASSERT_TRUE(SaveShardedCheckpoint(root, 1, shards).ok());
    const std::string dir = StepDirectory(root, 1);
    TensorDict with_replicated = state;
    with_replicated.insert("replicated", replicated);
    const absl::Status verify = VerifyCheckpoint(dir);
    auto full = LoadFullStateDict(dir);
    const std::vector<absl::Status> loads = {verify, full.status(), Resume(dir, with_replicated, 2),
                                             Resume(dir, with_replicated, 3)};
    for (const absl::Status& status : loads) {
      if (!differ) {
        EXPECT_TRUE(status.ok()) << status;
        continue;
      }
      EXPECT_TRUE(absl::IsDataLoss(status)) << status;
      EXPECT_TRUE(Contains(status,
                           "tensor 'replicated': pieces [0, 6) and [0, 6) overlap but "
                           "differ at element 4"))
          << status;
    }
    if (!differ) ExpectSameState(*full, with_replicated);
  }
}

// A MANIFEST moved into another step's directory (or edited to another
// step) would resume the wrong step.
TEST(CheckpointTest, ManifestStepMustMatchItsDirectory) {
  const std::string root = TempDir("wrong_step");
  ASSERT_TRUE(SaveFullCheckpoint(root, 4, MakeState(1)).ok());
  const std::string dir = StepDirectory(root, 4);
  auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  manifest->step = 5;  // resealed: a copy, not damage
  Spit(dir + "/MANIFEST", FormatManifest(*manifest));
  absl::Status status = VerifyCheckpoint(dir);
  EXPECT_TRUE(Contains(status, "records step 5 but lies in directory step_4")) << status;
  EXPECT_FALSE(LoadFullStateDict(dir).ok());
}

// The MANIFEST carries its own CRC-32C: any edit is damage, however
// plausible the result (a shape changed to another of the same element
// count cannot be contradicted by a sharded checkpoint's 1-D pieces).
TEST(CheckpointTest, ManifestEditsAreCaughtByItsChecksum) {
  const std::string root = TempDir("manifest_crc");
  ASSERT_TRUE(SaveShardedCheckpoint(root, 1, Shard(MakeState(1), 2)).ok());
  const std::string dir = StepDirectory(root, 1);
  const std::string pristine = Slurp(dir + "/MANIFEST");
  ASSERT_TRUE(absl::StartsWith(pristine, "torchfsdp-checkpoint 2\n")) << pristine;
  ASSERT_TRUE(VerifyCheckpoint(dir).ok());
  // Every single-byte change of the covered text, one position at a time
  // (a sample: every 7th byte) is refused by verify and by the full load.
  const size_t covered = pristine.rfind("end crc32c ");
  ASSERT_NE(covered, std::string::npos);
  for (size_t at = 0; at < covered; at += 7) {
    std::string edited = pristine;
    edited[at] = edited[at] == '1' ? '2' : '1';
    Spit(dir + "/MANIFEST", edited);
    const absl::Status status = VerifyCheckpoint(dir);
    EXPECT_FALSE(status.ok()) << "byte " << at;
    EXPECT_FALSE(LoadFullStateDict(dir).ok()) << "byte " << at;
  }
  // A format-1 manifest (no checksum of its own) still reads.
  auto m = ParseManifest(pristine, "pristine");
  ASSERT_TRUE(m.ok()) << m.status();
  m->format_version = 1;
  const std::string v1 = FormatManifest(*m);
  EXPECT_TRUE(absl::EndsWith(v1, "\nend\n")) << v1;
  Spit(dir + "/MANIFEST", v1);
  EXPECT_TRUE(VerifyCheckpoint(dir).ok());
  // A version-2 manifest turned into a version-1 one is still caught.
  std::string downgraded = pristine;
  downgraded.replace(0, 22, "torchfsdp-checkpoint 1");
  Spit(dir + "/MANIFEST", downgraded);
  EXPECT_TRUE(absl::IsDataLoss(VerifyCheckpoint(dir))) << VerifyCheckpoint(dir);
}

// Numbers in a MANIFEST that checksums (written by a bad tool, or resealed)
// size nothing before they are checked against the files: a world size of
// two billion is refused before a per-rank table is made, and entries
// claiming more data than their file can hold before anything is read.
TEST(CheckpointTest, ManifestNumbersAreCheckedBeforeTheySizeAnything) {
  const std::string root = TempDir("manifest_numbers");
  ASSERT_TRUE(SaveShardedCheckpoint(root, 1, Shard(MakeState(1), 2)).ok());
  const std::string dir = StepDirectory(root, 1);
  auto pristine = ReadManifest(dir);
  ASSERT_TRUE(pristine.ok()) << pristine.status();

  Manifest huge_world = *pristine;
  huge_world.world_size = 2000000000;
  Spit(dir + "/MANIFEST", FormatManifest(huge_world));
  absl::Status status = VerifyCheckpoint(dir);
  EXPECT_TRUE(Contains(status, "lists 2 files for a world of size 2000000000")) << status;
  EXPECT_FALSE(LoadFullStateDict(dir).ok());

  Manifest huge_tensor = *pristine;
  ManifestTensor& t = huge_tensor.files[0].tensors[0];
  t.global_shape = {int64_t{1} << 40};
  t.range = FlatRange{0, int64_t{1} << 40};
  for (ManifestFile& f : huge_tensor.files) {
    for (ManifestTensor& other : f.tensors) {
      if (other.name == t.name) {
        other.global_shape = t.global_shape;
        if (&other != &t) other.range = FlatRange{0, 0}, other.key = "-";
      }
    }
  }
  Spit(dir + "/MANIFEST", FormatManifest(huge_tensor));
  status = VerifyCheckpoint(dir);
  EXPECT_TRUE(Contains(status, "cannot hold its tensors")) << status;
  EXPECT_FALSE(LoadFullStateDict(dir).ok());
}

// A damaged newest checkpoint is set aside, not silently skipped: resume
// continues from the newest good one and can save the damaged step anew.
TEST(CheckpointTest, RecoverSetsDamagedNewerCheckpointsAside) {
  const std::string root = TempDir("recover");
  for (int step : {2, 4, 6, 8}) {
    ASSERT_TRUE(SaveShardedCheckpoint(root, step, Shard(MakeState(step), 2)).ok());
  }
  // 8: its MANIFEST damaged; 6: a data file damaged; 4: fine.
  std::string manifest = Slurp(StepDirectory(root, 8) + "/MANIFEST");
  manifest[manifest.size() / 2] ^= 0x01;
  Spit(StepDirectory(root, 8) + "/MANIFEST", manifest);
  std::string data = Slurp(StepDirectory(root, 6) + "/rank_00001.pt");
  data[data.size() / 2] ^= 0x40;
  Spit(StepDirectory(root, 6) + "/rank_00001.pt", data);
  ::mkdir(StepDirectory(root, 9).c_str(), 0755);       // an interrupted save: no MANIFEST
  ::mkdir((root + "/.damaged.step_8").c_str(), 0755);  // set aside by an earlier run

  auto recovered = RecoverLatestCheckpoint(root);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  ASSERT_TRUE(recovered->step_dir.has_value());
  EXPECT_EQ(*recovered->step_dir, StepDirectory(root, 4));
  ASSERT_EQ(recovered->set_aside.size(), 2u);
  EXPECT_EQ(recovered->set_aside[0].step_dir, StepDirectory(root, 8));
  EXPECT_EQ(recovered->set_aside[0].moved_to, root + "/.damaged.step_8.1");
  EXPECT_TRUE(Contains(recovered->set_aside[0].why, "is damaged")) << recovered->set_aside[0].why;
  EXPECT_EQ(recovered->set_aside[1].step_dir, StepDirectory(root, 6));
  EXPECT_EQ(recovered->set_aside[1].moved_to, root + "/.damaged.step_6");
  EXPECT_TRUE(Contains(recovered->set_aside[1].why, "rank_00001.pt"))
      << recovered->set_aside[1].why;

  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDirectory(root, 4));
  // Steps 6 and 8 can be written again; the set-aside copies are left for a
  // person and never listed or pruned.
  ASSERT_TRUE(SaveShardedCheckpoint(root, 6, Shard(MakeState(6), 2)).ok());
  EXPECT_TRUE(VerifyCheckpoint(StepDirectory(root, 6)).ok());
  auto pruned = PruneCheckpoints(root, 1);
  ASSERT_TRUE(pruned.ok()) << pruned.status();
  EXPECT_TRUE(formats::PathExists(root + "/.damaged.step_6"));
  EXPECT_TRUE(formats::PathExists(root + "/.damaged.step_8.1"));
  // Nothing damaged left: a second call moves nothing.
  recovered = RecoverLatestCheckpoint(root);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  EXPECT_EQ(recovered->step_dir, std::optional<std::string>(StepDirectory(root, 6)));
  EXPECT_TRUE(recovered->set_aside.empty());
  // A job killed before its first save has no root yet: nothing to resume,
  // not an error (the chaos test's early kills restart this way).
  recovered = RecoverLatestCheckpoint(root + "/never_created");
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  EXPECT_FALSE(recovered->step_dir.has_value());
  EXPECT_TRUE(recovered->set_aside.empty());
}

// --keep-last: older complete checkpoints go, and so does the debris of
// earlier crashes (torn saves older than the newest checkpoint, interrupted
// removals); a torn directory newer than the newest checkpoint stays (a save
// may be writing it), and so does anything kept.
TEST(CheckpointTest, PruneKeepsTheNewestAndRemovesOlderAndDebris) {
  const std::string root = TempDir("prune");
  for (int step : {1, 2, 4, 5}) {
    ASSERT_TRUE(SaveShardedCheckpoint(root, step, Shard(MakeState(step), 2)).ok());
  }
  ASSERT_TRUE(SaveShardedCheckpoint(root, 3, Shard(MakeState(3), 2)).ok());
  ASSERT_EQ(::unlink((StepDirectory(root, 3) + "/MANIFEST").c_str()), 0);  // torn save
  ::mkdir(StepDirectory(root, 7).c_str(), 0755);                           // a save in progress
  Spit(StepDirectory(root, 7) + "/rank_00000.pt", "partial");
  ::mkdir((root + "/.removing.step_0").c_str(), 0755);  // an interrupted removal
  Spit(root + "/.removing.step_0/rank_00000.pt", "debris");

  EXPECT_TRUE(absl::IsInvalidArgument(PruneCheckpoints(root, 0).status()));
  auto nothing = PruneCheckpoints(root, 10);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_TRUE(nothing->removed.empty());
  EXPECT_EQ(nothing->torn,
            (std::vector<std::string>{root + "/.removing.step_0", StepDirectory(root, 3)}));

  Spit(root + "/not_a_checkpoint.txt", "left alone");
  auto report = PruneCheckpoints(root, 2);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->removed,
            (std::vector<std::string>{StepDirectory(root, 1), StepDirectory(root, 2)}));
  EXPECT_TRUE(report->torn.empty());
  auto left = formats::ListDirectory(root);
  ASSERT_TRUE(left.ok());
  std::sort(left->begin(), left->end());
  EXPECT_EQ(*left,
            (std::vector<std::string>{"not_a_checkpoint.txt", "step_4", "step_5", "step_7"}));
  auto loaded = LoadFullStateDict(StepDirectory(root, 5));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(5));
  ASSERT_TRUE(VerifyCheckpoint(StepDirectory(root, 4)).ok());

  auto one = PruneCheckpoints(root, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->removed, std::vector<std::string>{StepDirectory(root, 4)});
  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, StepDirectory(root, 5));
}

// A removal killed at every point it changes the disk (each rename, unlink
// and rmdir, via the hook): the newest checkpoint always loads, every
// checkpoint still listed verifies, and the next prune finishes the job.
TEST(CheckpointTest, PruneKilledAtAnyPointLeavesTheNewestLoadable) {
  int kills = 0;
  for (int kill_at = 0; kill_at < 200; ++kill_at) {
    const std::string root = TempDir("prune_killed");
    for (int step : {1, 2, 3}) {
      ASSERT_TRUE(SaveShardedCheckpoint(root, step, Shard(MakeState(step), 2)).ok());
    }
    ::mkdir(StepDirectory(root, 0).c_str(), 0755);  // torn, older
    Spit(StepDirectory(root, 0) + "/rank_00001.pt", "partial");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int calls = 0;
      internal::SetBeforeRemoveHookForTesting([&](const std::string&) {
        if (calls++ == kill_at) ::raise(SIGKILL);
      });
      ::_exit(PruneCheckpoints(root, 1).ok() ? 0 : 1);
    }
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    const bool killed = WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL;
    ASSERT_TRUE(killed || (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0))
        << "kill_at " << kill_at << ": status " << wstatus;
    auto latest = LatestCheckpoint(root);
    ASSERT_TRUE(latest.ok()) << "kill_at " << kill_at << ": " << latest.status();
    EXPECT_EQ(*latest, StepDirectory(root, 3)) << "kill_at " << kill_at;
    auto loaded = LoadFullStateDict(*latest);
    ASSERT_TRUE(loaded.ok()) << "kill_at " << kill_at << ": " << loaded.status();
    ExpectSameState(*loaded, MakeState(3));
    auto listed = ListCheckpoints(root);
    ASSERT_TRUE(listed.ok());
    for (const std::string& dir : *listed) {
      EXPECT_TRUE(VerifyCheckpoint(dir).ok()) << "kill_at " << kill_at << ": " << dir;
    }
    auto finish = PruneCheckpoints(root, 1);
    ASSERT_TRUE(finish.ok()) << "kill_at " << kill_at << ": " << finish.status();
    auto left = formats::ListDirectory(root);
    ASSERT_TRUE(left.ok());
    EXPECT_EQ(*left, std::vector<std::string>{"step_3"}) << "kill_at " << kill_at;
    if (!killed) break;  // past the last point the removal changes the disk
    ++kills;
  }
  // 2 checkpoints x (rename, 2 rank files, MANIFEST, rmdir) + the torn one.
  EXPECT_GE(kills, 12);
}

}  // namespace
}  // namespace state_dict
