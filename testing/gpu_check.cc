#include "testing/gpu_check.h"

#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_join.h"

namespace gpu_check {

Result Pass(std::string detail) { return {true, std::move(detail)}; }
Result Fail(std::string detail) { return {false, std::move(detail)}; }

void Problems::Add(std::string what) { list_.push_back(std::move(what)); }

std::string Problems::Joined() const { return absl::StrJoin(list_, "; "); }

std::string Describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace gpu_check
