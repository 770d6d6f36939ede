#include "state_dict/async_checkpoint.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "formats/testing/python_interop.h"
#include "state_dict/internal/live_checkpoint.h"
#include "state_dict/testing/expect_same_state.h"

namespace state_dict {
namespace {

using testing::ExpectSameState;

using formats::testing::TempDir;

TensorDict MakeState(double scale) {
  TensorDict sd;
  sd.insert("w", torch::arange(4000, torch::kFloat).view({40, 100}) * scale);
  sd.insert("b", torch::arange(7, torch::kDouble) * -scale);
  sd.insert("step", torch::tensor({int64_t(scale)}, torch::kLong));
  return sd;
}

TensorDict Clone(const TensorDict& sd) {
  TensorDict out;
  for (const auto& item : sd) out.insert(item.key(), item.value().clone());
  return out;
}

// Each rank's even share of every tensor, as FSDP shards a flat parameter.
std::vector<ShardedStateDict> EvenShards(const TensorDict& full, int world) {
  std::vector<ShardedStateDict> shards(static_cast<size_t>(world));
  for (const auto& item : full) {
    for (int r = 0; r < world; ++r) {
      const FlatRange range = EvenShardRange(item.value().numel(), world, r);
      shards[static_cast<size_t>(r)].insert(
          item.key(), ShardFullTensor(item.value(), range.numel > 0 ? std::vector<FlatRange>{range}
                                                                    : std::vector<FlatRange>{}));
    }
  }
  return shards;
}

// The save writes the state as it was at the call, although the training
// loop changes the live tensors in place right after (the snapshot), and the
// snapshot buffers are reused for the next save.
TEST(AsyncCheckpointerTest, WritesTheStateAsOfTheCallWhileTheLiveStateChanges) {
  const std::string root = TempDir("async_full");
  TensorDict live = MakeState(1);
  AsyncCheckpointer saver;
  for (int64_t step = 1; step <= 3; ++step) {
    const TensorDict expected = Clone(live);
    ASSERT_TRUE(saver.SaveFull(root, step, live).ok());
    for (const auto& item : live) item.value().add_(1000);  // the next steps
    ASSERT_TRUE(saver.Wait().ok());
    EXPECT_TRUE(saver.Wait().ok()) << "a result is returned once, then OK";
    EXPECT_FALSE(saver.in_flight());
    auto loaded = LoadFullStateDict(StepDirectory(root, step));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ExpectSameState(*loaded, expected);
  }
  EXPECT_TRUE(VerifyCheckpoint(StepDirectory(root, 3)).ok());
}

TEST(AsyncCheckpointerTest, ShardsOfTwoRanksThenCommit) {
  const std::string root = TempDir("async_sharded");
  const TensorDict full = MakeState(2);
  AsyncCheckpointer rank0, rank1;
  const std::vector<ShardedStateDict> shards = EvenShards(full, 2);
  ASSERT_TRUE(rank0.SaveShard(root, 5, 0, 2, shards[0]).ok());
  ASSERT_TRUE(rank1.SaveShard(root, 5, 1, 2, shards[1]).ok());
  ASSERT_TRUE(rank0.Wait().ok());
  ASSERT_TRUE(rank1.Wait().ok());
  ASSERT_TRUE(CommitShardedCheckpoint(root, 5, 2).ok());
  auto loaded = LoadFullStateDict(StepDirectory(root, 5));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, full);
}

// Without a snapshot: what the background thread writes is the live state
// as of the call, as long as the loop changes it only after
// WaitUntilWritten(); full and sharded.
TEST(AsyncCheckpointerTest, InPlaceSavesWriteTheStateAsOfTheCall) {
  const std::string root = TempDir("async_in_place");
  TensorDict live = MakeState(1);
  AsyncCheckpointer saver;
  saver.WaitUntilWritten();  // nothing in flight: returns at once
  for (int64_t step = 1; step <= 3; ++step) {
    const TensorDict expected = Clone(live);
    ASSERT_TRUE(saver.SaveFullInPlace(root, step, live).ok());
    saver.WaitUntilWritten();
    for (const auto& item : live) item.value().add_(1000);  // the next optimizer step
    ASSERT_TRUE(saver.Wait().ok());
    auto loaded = LoadFullStateDict(StepDirectory(root, step));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ExpectSameState(*loaded, expected);
  }

  const TensorDict full = Clone(live);
  std::vector<AsyncCheckpointer> ranks(2);
  const std::vector<ShardedStateDict> shards = EvenShards(live, 2);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ranks[static_cast<size_t>(r)]
                    .SaveShardInPlace(root, 4, r, 2, shards[static_cast<size_t>(r)])
                    .ok());
  }
  for (auto& rank : ranks) {
    rank.WaitUntilWritten();
    ASSERT_TRUE(rank.Wait().ok());
  }
  ASSERT_TRUE(CommitShardedCheckpoint(root, 4, 2).ok());
  auto loaded = LoadFullStateDict(StepDirectory(root, 4));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, full);
}

// A live tensor changed in place after the save was asked for (its version
// counter moved) fails the save with DataLoss naming it; nothing of that
// step is committed, the previous checkpoint stays the latest.
TEST(AsyncCheckpointerTest, LiveTensorChangedBeforeItWasWrittenFailsTheSave) {
  const std::string root = TempDir("async_in_place_changed");
  TensorDict live = MakeState(1);
  ASSERT_TRUE(SaveFullCheckpoint(root, 1, live).ok());
  formats::LiveTensors versions;
  for (const auto& item : live) {
    versions.versions[item.value().unsafeGetTensorImpl()] = item.value()._version();
  }
  live["b"].mul_(2);  // the loop did not wait
  const absl::Status status = internal::SaveFullCheckpoint(root, 2, live, &versions);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find("tensor 'b' was changed in place"), std::string::npos) << status;
  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDirectory(root, 1));

  // The same through the sharded path.
  ShardedStateDict shard;
  for (const auto& item : live) {
    shard.insert(item.key(), ShardFullTensor(item.value(), {FlatRange{0, item.value().numel()}}));
  }
  formats::LiveTensors shard_versions;
  for (const auto& item : shard) {
    const at::Tensor& piece = item.value().pieces[0].data;
    shard_versions.versions[piece.unsafeGetTensorImpl()] = piece._version();
  }
  shard["w"].pieces[0].data.add_(1);
  const absl::Status sharded = internal::SaveShard(root, 3, 0, 1, shard, &shard_versions);
  EXPECT_EQ(sharded.code(), absl::StatusCode::kDataLoss) << sharded;
  EXPECT_NE(sharded.message().find("'w'"), std::string::npos) << sharded;
  EXPECT_FALSE(CommitShardedCheckpoint(root, 3, 1).ok());
}

// A background save that fails is reported by the next save (which then
// does not start) or by Wait(), with the synchronous save's message.
TEST(AsyncCheckpointerTest, BackgroundErrorsSurfaceAtTheNextSaveOrWait) {
  const std::string root = TempDir("async_errors");
  ASSERT_TRUE(SaveFullCheckpoint(root, 1, MakeState(1)).ok());
  AsyncCheckpointer saver;
  ASSERT_TRUE(saver.SaveFull(root, 1, MakeState(9)).ok()) << "started";
  absl::Status next = saver.SaveFull(root, 2, MakeState(2));
  EXPECT_TRUE(absl::IsAlreadyExists(next)) << next;
  EXPECT_FALSE(saver.in_flight()) << "the failed save's successor must not start";
  EXPECT_FALSE(ReadManifest(StepDirectory(root, 2)).ok());

  ASSERT_TRUE(saver.SaveFull(root, 1, MakeState(9)).ok());
  absl::Status waited = saver.Wait();
  EXPECT_TRUE(absl::IsAlreadyExists(waited)) << waited;
  EXPECT_NE(waited.message().find("step_1"), std::string::npos) << waited;

  // An undefined tensor is named, from the background thread.
  TensorDict bad = MakeState(3);
  bad.insert("missing", torch::Tensor());
  ASSERT_TRUE(saver.SaveFull(root, 3, bad).ok());
  waited = saver.Wait();
  EXPECT_NE(waited.message().find("'missing'"), std::string::npos) << waited;
  // The step-1 checkpoint is untouched by all of this.
  auto loaded = LoadFullStateDict(StepDirectory(root, 1));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(1));
}

// SIGKILL while the background thread is between the data file and the
// MANIFEST: the previous checkpoint is still the latest, and it loads.
TEST(AsyncCheckpointerTest, KilledDuringBackgroundSaveLeavesPreviousCheckpoint) {
  const std::string root = TempDir("async_killed");
  ASSERT_TRUE(SaveFullCheckpoint(root, 1, MakeState(1)).ok());
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    internal::SetAfterFileWrittenHookForTesting([&](const std::string&) {
      char byte = 1;
      if (::write(pipe_fds[1], &byte, 1) != 1) ::_exit(3);
      while (true) ::pause();  // the background thread waits here to be killed
    });
    AsyncCheckpointer saver;
    if (!saver.SaveFull(root, 2, MakeState(2)).ok()) ::_exit(4);
    while (true) ::pause();  // "training" goes on in the foreground
  }
  ::close(pipe_fds[1]);
  char byte = 0;
  ASSERT_EQ(::read(pipe_fds[0], &byte, 1), 1) << "child never wrote a file";
  ::close(pipe_fds[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);

  EXPECT_EQ(::access((StepDirectory(root, 2) + "/model.pt").c_str(), F_OK), 0);
  EXPECT_FALSE(ReadManifest(StepDirectory(root, 2)).ok());
  auto latest = LatestCheckpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDirectory(root, 1));
  auto loaded = LoadFullStateDict(*latest);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, MakeState(1));
}

}  // namespace
}  // namespace state_dict
