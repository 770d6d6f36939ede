#include "trainer/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace trainer {
namespace {

constexpr char kLockName[] = ".lock";
constexpr char kLockHeader[] = "trainer checkpoint-dir lock";

std::string Flag(const std::string& dir) { return absl::StrCat("--checkpoint-dir='", dir, "'"); }

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Writes `text` to `path` and fsyncs it; the errno's text on failure.
absl::Status WriteSynced(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::FailedPreconditionError(std::strerror(errno));
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int write_errno = errno;
  const bool synced = n == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const int sync_errno = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size())) {
    return absl::FailedPreconditionError(n < 0 ? std::strerror(write_errno) : "short write");
  }
  if (!synced) return absl::FailedPreconditionError(std::strerror(sync_errno));
  return absl::OkStatus();
}

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Field 22 of /proc/<pid>/stat (starttime); 0 when unreadable.
int64_t StartTicks(int64_t pid) {
  const std::optional<std::string> stat = ReadText(absl::StrCat("/proc/", pid, "/stat"));
  if (!stat.has_value()) return 0;
  const size_t paren = stat->rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return 0;
  const std::vector<std::string> fields =
      absl::StrSplit(stat->substr(paren + 1), ' ', absl::SkipEmpty());
  int64_t ticks = 0;  // fields[0] is field 3 (state): starttime is fields[19]
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &ticks)) return 0;
  return ticks;
}

// Whether the holder's process still runs on this host: its pid exists
// and, when both are known, started when the lock says.
bool Alive(const LockHolder& holder) {
  if (holder.pid <= 0) return false;
  if (::kill(static_cast<pid_t>(holder.pid), 0) != 0 && errno != EPERM) return false;
  const int64_t now = StartTicks(holder.pid);
  return holder.pid_start == 0 || now == 0 || now == holder.pid_start;
}

absl::Status InUse(const std::string& dir, const std::string& path, const LockHolder& holder,
                   const LockHolder& me) {
  const bool same_host = holder.host == me.host;
  return absl::FailedPreconditionError(absl::StrCat(
      Flag(dir), " is in use by ", holder.Describe(), " (lock file '", path,
      "'): expected a directory no other job writes to; wait for that job, or use another "
      "--checkpoint-dir",
      same_host ? ""
                : "; that job runs on another host, which cannot be checked from here: "
                  "remove the lock file if it is gone"));
}

}  // namespace

std::string LockHolder::Describe() const {
  return absl::StrCat("job ", job, " (host ", host, ", pid ", pid, ", since ", start, ")");
}

LockHolder ThisJob() {
  LockHolder me;
  me.host = HostName();
  me.start = NowUtc();
  const bool launched = std::getenv("RANK") != nullptr;
  me.pid = launched ? static_cast<int64_t>(getppid()) : static_cast<int64_t>(getpid());
  me.pid_start = StartTicks(me.pid);
  const char* slurm_job = std::getenv("SLURM_JOB_ID");
  const char* slurm_step = std::getenv("SLURM_STEP_ID");
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  if (slurm_job != nullptr && *slurm_job != '\0') {
    me.job = absl::StrCat("slurm:", slurm_job, ".", slurm_step != nullptr ? slurm_step : "0");
  } else if (run_id != nullptr && *run_id != '\0' && std::string(run_id) != "none") {
    me.job = absl::StrCat("torchelastic:", run_id);
  } else {
    me.job = absl::StrCat(launched ? "launcher:" : "process:", me.host, ":", me.pid);
  }
  return me;
}

std::string FormatLock(const LockHolder& h) {
  return absl::StrCat(kLockHeader, "\nhost=", h.host, "\npid=", h.pid, "\npid_start=", h.pid_start,
                      "\nstart=", h.start, "\njob=", h.job, "\n");
}

absl::StatusOr<LockHolder> ParseLock(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kLockHeader) {
    return absl::InvalidArgumentError(absl::StrCat("its first line is not '", kLockHeader, "'"));
  }
  LockHolder h;
  bool pid_ok = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(lines[i], absl::MaxSplits('=', 1));
    if (kv.first == "host") h.host = kv.second;
    if (kv.first == "pid") pid_ok = absl::SimpleAtoi(kv.second, &h.pid) && h.pid > 0;
    if (kv.first == "start") h.start = kv.second;
    if (kv.first == "pid_start" && !absl::SimpleAtoi(kv.second, &h.pid_start)) h.pid_start = 0;
    if (kv.first == "job") h.job = kv.second;
  }
  if (h.host.empty() || !pid_ok || h.job.empty()) {
    return absl::InvalidArgumentError("expected lines host=NAME, pid=N (> 0) and job=ID");
  }
  return h;
}

absl::Status CheckDirectoryWritable(const std::string& dir, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(Flag(dir), ": cannot create it: ", ec.message(),
                     ": expected a directory this process can create and write"));
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(Flag(dir), ": exists and is not a directory: expected a directory"));
  }
  const std::string probe = absl::StrCat(dir, "/.probe.", rank, ".", getpid());
  absl::Status written = WriteSynced(probe, "probe\n");
  std::filesystem::remove(probe, ec);
  if (!written.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Flag(dir), ": cannot write in it (rank ", rank, ", '", probe,
                     "'): ", written.message(), ": expected a directory this process can write"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DirectoryLock>> DirectoryLock::Acquire(const std::string& dir,
                                                                      const LockHolder& me,
                                                                      std::string* taken_over) {
  const std::string path = absl::StrCat(dir, "/", kLockName);
  const std::string mine = FormatLock(me);
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  std::unique_ptr<DirectoryLock> lock(new DirectoryLock(path, me));
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (auto s = WriteSynced(temp, mine); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(Flag(dir), ": cannot write '", temp, "': ", s.message()));
    }
    if (::link(temp.c_str(), path.c_str()) == 0) {  // atomic: fails if a lock exists
      ::unlink(temp.c_str());
      return lock;
    }
    const int link_errno = errno;
    if (link_errno != EEXIST) {
      ::unlink(temp.c_str());
      return absl::FailedPreconditionError(absl::StrCat(Flag(dir), ": cannot create the lock '",
                                                        path, "': ", std::strerror(link_errno)));
    }
    const std::optional<std::string> text = ReadText(path);
    if (!text.has_value()) {  // released meanwhile
      ::unlink(temp.c_str());
      continue;
    }
    auto holder = ParseLock(*text);
    if (!holder.ok()) {
      ::unlink(temp.c_str());
      return absl::FailedPreconditionError(absl::StrCat(
          Flag(dir), ": the lock file '", path, "' is not a trainer's lock (",
          holder.status().message(),
          "): expected a file this trainer wrote; remove it if no job uses this directory"));
    }
    if (holder->job == me.job) {  // this job's, from before a restart
      ::unlink(temp.c_str());
      return lock;
    }
    if (holder->host != me.host || Alive(*holder)) {
      ::unlink(temp.c_str());
      return InUse(dir, path, *holder, me);
    }
    // Stale: replace it, then make sure no other job replaced it too.
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      const int rename_errno = errno;
      ::unlink(temp.c_str());
      return absl::FailedPreconditionError(absl::StrCat(Flag(dir),
                                                        ": cannot replace the stale lock '", path,
                                                        "': ", std::strerror(rename_errno)));
    }
    if (ReadText(path) == mine) {
      *taken_over = holder->Describe();
      return lock;
    }
  }
  return absl::AbortedError(absl::StrCat(Flag(dir), ": the lock '", path,
                                         "' kept changing hands: another job is "
                                         "starting on this directory"));
}

DirectoryLock::~DirectoryLock() {
  const std::optional<std::string> text = ReadText(path_);
  if (!text.has_value()) return;
  auto holder = ParseLock(*text);
  if (holder.ok() && holder->job == me_.job) ::unlink(path_.c_str());
}

}  // namespace trainer
