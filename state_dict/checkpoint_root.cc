// The root of a checkpoint directory (checkpoint.h): listing its complete
// step directories, recovering the newest one that verifies, pruning old
// ones. Writing, committing and reading one step directory is
// checkpoint.cc's.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "formats/io/file_io.h"
#include "state_dict/checkpoint.h"
#include "state_dict/internal/live_checkpoint.h"

namespace state_dict {
namespace internal {
namespace {
std::function<void(const std::string&)>& BeforeRemoveHook() {
  static auto* hook = new std::function<void(const std::string&)>();
  return *hook;
}
}  // namespace

void SetBeforeRemoveHookForTesting(std::function<void(const std::string&)> hook) {
  BeforeRemoveHook() = std::move(hook);
}
}  // namespace internal

absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root) {
  auto names = formats::ListDirectory(root);
  if (!names.ok()) return names.status();
  std::vector<std::pair<int64_t, std::string>> steps;
  for (const std::string& name : *names) {
    int64_t step;
    if (!absl::StartsWith(name, "step_") || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    const std::string dir = root + "/" + name;
    auto m = ReadManifest(dir);
    if (!m.ok()) {
      // A newer format is a complete checkpoint this build cannot read;
      // silently falling back to an older one would lose progress.
      if (absl::IsFailedPrecondition(m.status())) return m.status();
      continue;  // interrupted save: no (complete) manifest
    }
    if (m->step != step) continue;
    steps.emplace_back(step, dir);
  }
  std::sort(steps.begin(), steps.end());
  std::vector<std::string> out;
  for (auto& s : steps) out.push_back(std::move(s.second));
  return out;
}

namespace {

constexpr char kRemovingPrefix[] = ".removing.";

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

void BeforeRemove(const std::string& path) {
  if (internal::BeforeRemoveHook()) internal::BeforeRemoveHook()(path);
}

// rm -r of a directory no reader looks at any more (already renamed away).
absl::Status RemoveTree(const std::string& path) {
  auto names = formats::ListDirectory(path);
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    const std::string child = path + "/" + name;
    struct stat st;
    if (::lstat(child.c_str(), &st) != 0) return ErrnoError("lstat", child);
    if (S_ISDIR(st.st_mode)) {
      if (auto s = RemoveTree(child); !s.ok()) return s;
      continue;
    }
    BeforeRemove(child);
    if (::unlink(child.c_str()) != 0) return ErrnoError("unlink", child);
  }
  BeforeRemove(path);
  if (::rmdir(path.c_str()) != 0) return ErrnoError("rmdir", path);
  return absl::OkStatus();
}

// Renames `root`/`name` out of sight (durably), then deletes it.
absl::Status RemoveStepDirectory(const std::string& root, const std::string& name) {
  const std::string from = root + "/" + name;
  const std::string to = absl::StrCat(root, "/", kRemovingPrefix, name);
  if (formats::PathExists(to)) {  // debris of an earlier interrupted removal
    if (auto s = RemoveTree(to); !s.ok()) return s;
  }
  BeforeRemove(from);
  if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoError("rename", from);
  if (auto s = formats::FsyncDirectory(root); !s.ok()) return s;
  return RemoveTree(to);
}

}  // namespace

absl::StatusOr<PruneReport> PruneCheckpoints(const std::string& root, int keep_last) {
  if (keep_last < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_last=", keep_last,
                     ": expected at least 1 (the newest complete checkpoint "
                     "is never removed)"));
  }
  auto names = formats::ListDirectory(root);
  if (!names.ok()) return names.status();
  std::vector<std::pair<int64_t, std::string>> complete, torn;
  std::vector<std::string> removing;
  for (const std::string& name : *names) {
    if (absl::StartsWith(name, kRemovingPrefix)) {
      removing.push_back(name);
      continue;
    }
    int64_t step;
    if (!absl::StartsWith(name, "step_") || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    auto m = ReadManifest(root + "/" + name);
    if (m.ok() && m->step == step) {
      complete.emplace_back(step, name);
    } else if (absl::IsNotFound(m.status())) {
      torn.emplace_back(step, name);
    } else if (absl::IsFailedPrecondition(m.status())) {
      return m.status();  // a newer format: nothing here is ours to judge
    }
  }
  std::sort(complete.begin(), complete.end());
  std::sort(torn.begin(), torn.end());
  std::sort(removing.begin(), removing.end());
  PruneReport report;
  for (const std::string& name : removing) {
    if (auto s = RemoveTree(root + "/" + name); !s.ok()) return s;
    report.torn.push_back(root + "/" + name);
  }
  if (complete.empty()) return report;  // a first save may be in progress
  const int64_t newest = complete.back().first;
  const size_t doomed = complete.size() > static_cast<size_t>(keep_last)
                            ? complete.size() - static_cast<size_t>(keep_last)
                            : 0;
  for (size_t i = 0; i < doomed; ++i) {
    if (auto s = RemoveStepDirectory(root, complete[i].second); !s.ok()) return s;
    report.removed.push_back(root + "/" + complete[i].second);
  }
  for (const auto& [step, name] : torn) {
    if (step >= newest) continue;
    if (auto s = RemoveStepDirectory(root, name); !s.ok()) return s;
    report.torn.push_back(root + "/" + name);
  }
  return report;
}

namespace {

constexpr char kDamagedPrefix[] = ".damaged.";

// Renames root/name to the first free ".damaged.<name>[.<k>]", durably.
absl::StatusOr<std::string> SetAside(const std::string& root, const std::string& name) {
  const std::string from = root + "/" + name;
  std::string to = absl::StrCat(root, "/", kDamagedPrefix, name);
  for (int k = 1; formats::PathExists(to); ++k) {
    to = absl::StrCat(root, "/", kDamagedPrefix, name, ".", k);
  }
  if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoError("rename", from);
  if (auto s = formats::FsyncDirectory(root); !s.ok()) return s;
  return to;
}

// Whether `status` says a checkpoint's bytes are wrong (rather than that it
// cannot be judged here).
bool IsDamage(const absl::Status& status) {
  return absl::IsDataLoss(status) || absl::IsNotFound(status);
}

}  // namespace

absl::StatusOr<RecoveredCheckpoint> RecoverLatestCheckpoint(const std::string& root) {
  RecoveredCheckpoint out;
  // A root that does not exist yet is a job killed before its first save.
  if (!formats::PathExists(root)) return out;
  auto names = formats::ListDirectory(root);
  if (!names.ok()) return names.status();
  std::vector<std::pair<int64_t, std::string>> steps;
  for (const std::string& name : *names) {
    int64_t step;
    if (absl::StartsWith(name, "step_") && absl::SimpleAtoi(name.substr(5), &step)) {
      steps.emplace_back(step, name);
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  for (const auto& [step, name] : steps) {
    const std::string dir = root + "/" + name;
    auto manifest = ReadManifest(dir);
    absl::Status status = manifest.status();
    if (absl::IsNotFound(status)) continue;  // an interrupted save
    if (status.ok()) status = VerifyCheckpoint(dir);
    if (status.ok()) {
      out.step_dir = dir;
      return out;
    }
    if (!IsDamage(status)) return status;
    auto moved = SetAside(root, name);
    if (!moved.ok()) return moved.status();
    out.set_aside.push_back(SetAsideCheckpoint{dir, *moved, status});
  }
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  auto all = ListCheckpoints(root);
  if (!all.ok()) return all.status();
  if (all->empty()) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
  }
  return all->back();
}

}  // namespace state_dict
