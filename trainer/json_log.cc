#include "trainer/json_log.h"

#include <sys/resource.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace trainer {

std::string FormatJsonLine(const StepRecord& r) {
  // ordered_json keeps the documented key order.
  nlohmann::ordered_json line = {
      {"step", r.step},
      {"loss", r.loss},
      {"lr", r.lr},
      {"step_time_s", r.step_time_s},
      {"tokens_per_s", r.tokens_per_s},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"sharded_state_bytes", r.sharded_state_bytes},
      {"world_size", r.peak_rss_bytes.size()},
  };
  if (r.val_loss.has_value()) {
    line["val_loss"] = *r.val_loss;
    // exp of the mean per-token loss (nats): what language-model papers report.
    line["val_perplexity"] = std::exp(*r.val_loss);
  }
  if (!r.cuda_peak_allocated_bytes.empty()) {
    line["cuda_peak_allocated_bytes"] = r.cuda_peak_allocated_bytes;
    line["cuda_peak_reserved_bytes"] = r.cuda_peak_reserved_bytes;
  }
  return line.dump();
}

JsonLogWriter::~JsonLogWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status JsonLogWriter::Open(const std::string& path, bool append) {
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (file_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--log-json='", path, "': cannot open for writing: ", std::strerror(errno)));
  }
  path_ = path;
  return absl::OkStatus();
}

absl::Status JsonLogWriter::Write(const StepRecord& record) {
  if (file_ == nullptr) return absl::FailedPreconditionError("JSON log not open");
  const std::string line = FormatJsonLine(record) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    return absl::DataLossError(
        absl::StrCat("writing --log-json '", path_, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    // "VmHWM:	  123456 kB"
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "VmHWM:")) {
      std::vector<std::string> parts =
          absl::StrSplit(rest, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      int64_t kib = 0;
      if (!parts.empty() && absl::SimpleAtoi(absl::StripAsciiWhitespace(parts[0]), &kib)) {
        return kib * 1024;
      }
    }
  }
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
}

}  // namespace trainer
