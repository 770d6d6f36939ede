#include "trainer/step_profile.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include "absl/strings/str_cat.h"
#include "formats/io/file_io.h"

namespace trainer {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// CPU ops always; GPU kernels, memcpys and memsets (CUPTI) on CUDA only: the
// CPU build's LibTorch has no CUPTI to ask.
std::set<ActivityType> Activities(const c10::Device& device) {
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  return activities;
}

// fsync of a written file, so the rename below publishes durable bytes.
absl::Status FsyncFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("--profile-trace: cannot open '", path,
                                            "' to fsync it: ", std::strerror(errno)));
  }
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("--profile-trace: fsync of '", path,
                                            "' failed: ", std::strerror(fsync_errno)));
  }
  return absl::OkStatus();
}

std::string ParentDir(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace

StepProfiler::StepProfiler(const c10::Device& device, int64_t step) : device_(device) {
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities = Activities(device);
  // prepareProfiler initialises Kineto (and CUPTI) so that enableProfiler
  // only starts recording.
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  active_ = true;
  // Opened after enableProfiler: a RecordFunction samples the profiler's
  // callbacks when it is constructed.
  annotation_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (annotation_->isActive()) annotation_->before(absl::StrCat("ProfilerStep#", step));
}

StepProfiler::~StepProfiler() {
  annotation_.reset();
  if (!active_) return;
  // The step failed: stop recording and drop the events. A destructor must
  // not throw, and the step's own error is the one to report.
  try {
    profiler::disableProfiler();
  } catch (const std::exception&) {
  }
}

absl::Status StepProfiler::Finish(const std::string& path) {
  if (annotation_ != nullptr && annotation_->isActive()) annotation_->end();
  annotation_.reset();
  // The step's kernels are only queued when its CPU side returns: wait for
  // them, or the trace would miss the tail of the step.
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  active_ = false;
  if (result == nullptr) {
    return absl::InternalError(
        absl::StrCat("--profile-trace='", path, "': the Kineto profiler returned no result"));
  }
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  std::filesystem::remove(tmp, ec);  // debris of a crashed run
  try {
    result->save(tmp);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("--profile-trace='", path, "': writing '", tmp,
                                            "' failed: ", e.what_without_backtrace()));
  }
  // Kineto logs a failed write instead of throwing: check that it wrote.
  if (std::filesystem::file_size(tmp, ec) == 0 || ec) {
    std::filesystem::remove(tmp, ec);
    return absl::InternalError(absl::StrCat("--profile-trace='", path,
                                            "': Kineto wrote no trace to '", tmp,
                                            "' (is the directory writable?)"));
  }
  if (absl::Status s = FsyncFile(tmp); !s.ok()) return s;
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::filesystem::remove(tmp, ec);
    return absl::InternalError(
        absl::StrCat("--profile-trace='", path, "': renaming '", tmp, "' over it failed: ", why));
  }
  return formats::FsyncDirectory(ParentDir(path));
}

absl::Status CheckProfileTrace(const std::string& path) {
  const std::string dir = ParentDir(path);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("--profile-trace='", path,
                                                   "': expected a file in an existing directory; '",
                                                   dir, "' is not one"));
  }
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-trace='", path, "': expected a file path, not a directory"));
  }
  return absl::OkStatus();
}

}  // namespace trainer
