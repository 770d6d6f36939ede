// The --checkpoint-dir lock (run_lock.h) in one process: its file format,
// a second job refused naming the holder, a stale holder (a pid that has
// exited) taken over, another host's lock refused, the same job's kept,
// release only of our own lock, a foreign file, and the writability probe.
#include "trainer/run_lock.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace trainer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(base != nullptr ? base : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A pid that no process has any more: a child that exited and was reaped.
int64_t DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

LockHolder Job(const std::string& job, int64_t pid, const std::string& host = "") {
  LockHolder h = ThisJob();
  h.job = job;
  if (pid != h.pid) h.pid_start = 0;  // ThisJob()'s is of its own pid
  h.pid = pid;
  if (!host.empty()) h.host = host;
  return h;
}

TEST(RunLock, FormatParsesBack) {
  const LockHolder h = Job("launcher:vm:42", 42);
  auto parsed = ParseLock(FormatLock(h));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->host, h.host);
  EXPECT_EQ(parsed->pid, 42);
  EXPECT_EQ(parsed->start, h.start);
  EXPECT_EQ(parsed->job, "launcher:vm:42");
  LockHolder mine = ThisJob();
  EXPECT_GT(mine.pid_start, 0);  // this process's start, from /proc
  EXPECT_EQ(ParseLock(FormatLock(mine))->pid_start, mine.pid_start);
  EXPECT_THAT(std::string(ParseLock("hello\n").status().message()),
              HasSubstr("its first line is not 'trainer checkpoint-dir lock'"));
  EXPECT_THAT(
      std::string(
          ParseLock("trainer checkpoint-dir lock\nhost=a\npid=x\njob=j\n").status().message()),
      HasSubstr("expected lines host=NAME, pid=N (> 0) and job=ID"));
}

TEST(RunLock, ThisJobIsTheLauncherForALaunchedRank) {
  unsetenv("SLURM_JOB_ID");
  unsetenv("TORCHELASTIC_RUN_ID");
  unsetenv("RANK");
  EXPECT_EQ(ThisJob().pid, getpid());
  EXPECT_THAT(ThisJob().job, HasSubstr("process:"));
  setenv("RANK", "0", 1);
  EXPECT_EQ(ThisJob().pid, getppid());
  EXPECT_THAT(ThisJob().job, HasSubstr("launcher:"));
  setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun's default: not an identity
  EXPECT_THAT(ThisJob().job, HasSubstr("launcher:"));
  setenv("TORCHELASTIC_RUN_ID", "a1b2", 1);
  EXPECT_EQ(ThisJob().job, "torchelastic:a1b2");
  setenv("SLURM_JOB_ID", "77", 1);
  setenv("SLURM_STEP_ID", "3", 1);
  EXPECT_EQ(ThisJob().job, "slurm:77.3");
  unsetenv("SLURM_JOB_ID");
  unsetenv("SLURM_STEP_ID");
  unsetenv("TORCHELASTIC_RUN_ID");
  unsetenv("RANK");
}

TEST(RunLock, SecondJobRefusedStaleTakenOverSameJobKept) {
  const std::string dir = FreshDir("lock");
  const std::string path = dir + "/.lock";
  std::string taken_over;
  // Job A, alive (this process's pid).
  auto a = DirectoryLock::Acquire(dir, Job("A", getpid()), &taken_over);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(taken_over.empty());
  EXPECT_THAT(Read(path), HasSubstr("job=A\n"));
  // Job B on the same directory: refused, naming A.
  auto b = DirectoryLock::Acquire(dir, Job("B", getpid()), &taken_over);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr("--checkpoint-dir='" + dir + "' is in use by job A (host "));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("pid " + std::to_string(getpid())));
  // A restart of job A (another pid): its own lock.
  auto a_again = DirectoryLock::Acquire(dir, Job("A", getpid() + 1), &taken_over);
  ASSERT_TRUE(a_again.ok()) << a_again.status();
  a_again->reset();  // another pid of A releases: the lock is A's, so it goes
  EXPECT_FALSE(fs::exists(path));
  a->reset();  // nothing left to remove

  // A stale lock (its pid has exited) is taken over, saying whose.
  const int64_t dead = DeadPid();
  auto stale = DirectoryLock::Acquire(dir, Job("C", dead), &taken_over);
  ASSERT_TRUE(stale.ok());
  auto d = DirectoryLock::Acquire(dir, Job("D", getpid()), &taken_over);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT(taken_over, HasSubstr("job C (host "));
  EXPECT_THAT(Read(path), HasSubstr("job=D\n"));
  stale->reset();  // C's release leaves D's lock alone
  EXPECT_THAT(Read(path), HasSubstr("job=D\n"));
  d->reset();
  EXPECT_FALSE(fs::exists(path));

  // A live pid that started at another time (reused after the holder
  // died): stale.
  LockHolder reused = Job("G", getpid());
  reused.pid_start += 1;
  auto g = DirectoryLock::Acquire(dir, reused, &taken_over);
  ASSERT_TRUE(g.ok());
  taken_over.clear();
  auto h = DirectoryLock::Acquire(dir, Job("H", getpid()), &taken_over);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(taken_over, HasSubstr("job G (host "));
  h->reset();

  // Another host's lock cannot be checked: refused even with a dead pid.
  auto remote = DirectoryLock::Acquire(dir, Job("E", dead, "elsewhere"), &taken_over);
  ASSERT_TRUE(remote.ok());
  auto f = DirectoryLock::Acquire(dir, Job("F", getpid()), &taken_over);
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(std::string(f.status().message()),
              HasSubstr("that job runs on another host, which cannot be checked from here"));
}

TEST(RunLock, AForeignLockFileIsRefusedAndLeftAlone) {
  const std::string dir = FreshDir("foreign");
  std::ofstream(dir + "/.lock") << "pid 12\n";
  std::string taken_over;
  auto lock = DirectoryLock::Acquire(dir, ThisJob(), &taken_over);
  ASSERT_FALSE(lock.ok());
  EXPECT_EQ(lock.status().message(),
            "--checkpoint-dir='" + dir + "': the lock file '" + dir +
                "/.lock' is not a trainer's lock (its first line is not 'trainer checkpoint-dir "
                "lock'): expected a file this trainer wrote; remove it if no job uses this "
                "directory");
  EXPECT_EQ(Read(dir + "/.lock"), "pid 12\n");
}

TEST(RunLock, WritableProbe) {
  const std::string dir = FreshDir("probe") + "/a/b";
  EXPECT_TRUE(CheckDirectoryWritable(dir, 3).ok());
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_TRUE(fs::is_empty(dir));  // the probe is gone
  const absl::Status s = CheckDirectoryWritable("/proc/nonexistent/ck", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("--checkpoint-dir='/proc/nonexistent/ck': cannot create it: "));
  // /proc/self exists and is a directory no one may create files in.
  const absl::Status ro = CheckDirectoryWritable("/proc/self", 1);
  EXPECT_EQ(ro.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(ro.message()),
              HasSubstr("--checkpoint-dir='/proc/self': cannot write in it (rank 1, "));
}

}  // namespace
}  // namespace trainer
