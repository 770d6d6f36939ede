// Fail fast on --checkpoint-dir: before step 1, every rank checks that the
// directory can be created and written, and one lock file makes a second job
// on the same directory refuse at start instead of at its first save.
//
//   <dir>/.lock   written by rank 0 at start, removed when its Train returns:
//     trainer checkpoint-dir lock
//     host=<hostname>
//     pid=<the process whose life is the job's on that host>
//     start=<UTC time the lock was taken>
//     job=<the job's identity, below>
//
// "The same job" — what elastic restarts (--max-restarts, torchrun's) must
// recognise as their own lock although every restarted worker has a new pid
// — is, in order: Slurm's SLURM_JOB_ID.SLURM_STEP_ID; torchrun's
// TORCHELASTIC_RUN_ID (unless "none", its default for a non-standalone
// rendezvous); else, for a rank started by a launcher (RANK set: the
// trainer's own --nproc / --max-restarts, //tools:launch, torchrun), the
// launcher's host and pid (the rank's parent, which outlives its restarts);
// else this process's host and pid (--nproc 1 without restarts). `pid` is
// the launcher's (the rank's parent) or this process's.
//
// A lock held by another job is refused naming its holder
// (FailedPrecondition). A stale one — same host, its pid no longer alive
// or now another process (its start time differs: pid_start=) (a job
// killed with kill -9, a reboot) — is taken over, with a line saying so. A lock
// of another host cannot be checked from here: refused, saying to remove it
// if that job is gone. A .lock that is not such a file is refused as not
// ours (FailedPrecondition). No PyTorch counterpart: torch.distributed
// checkpointing leaves this to the scheduler.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainer {

// Creates `dir` (and its parents) if needed and writes, fsyncs and removes
// a probe file ".probe.<rank>.<pid>" in it. FailedPrecondition naming
// --checkpoint-dir, the path and the system's reason otherwise.
absl::Status CheckDirectoryWritable(const std::string& dir, int rank);

// Who holds (or would hold) the lock.
struct LockHolder {
  std::string host;
  int64_t pid = 0;
  // The pid's start time (field 22 of /proc/<pid>/stat, clock ticks since
  // boot), so that a pid reused by another process (after a reboot, say)
  // does not keep a stale lock alive. 0: unknown (then the pid alone).
  int64_t pid_start = 0;
  std::string start;
  std::string job;
  std::string Describe() const;  // "job J (host H, pid P, since S)"
};

// This process's job, as above.
LockHolder ThisJob();

// Parses a lock file's text; InvalidArgument saying what is missing.
absl::StatusOr<LockHolder> ParseLock(const std::string& text);
std::string FormatLock(const LockHolder& holder);

// The lock of `dir`, held until destroyed (which removes the file if it is
// still this job's).
class DirectoryLock {
 public:
  // Takes `dir`/.lock for `me` (ThisJob()): a new lock, this job's own (a
  // restart: kept), or a stale one (taken over; `taken_over` says whose).
  static absl::StatusOr<std::unique_ptr<DirectoryLock>> Acquire(const std::string& dir,
                                                                const LockHolder& me,
                                                                std::string* taken_over);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  DirectoryLock(std::string path, LockHolder me) : path_(std::move(path)), me_(std::move(me)) {}
  std::string path_;
  LockHolder me_;
};

}  // namespace trainer
