// Collects LibTorch's warnings (TORCH_WARN) raised while it is alive,
// instead of printing them, for tests that check what was warned.
//
//   kernels::testing::CollectWarnings warnings;
//   ...
//   EXPECT_THAT(warnings.messages(), ElementsAre(HasSubstr("kernels::RmsNorm")));
#pragma once

#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace kernels::testing {

class CollectWarnings final : public c10::WarningHandler {
 public:
  CollectWarnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages_.push_back(warning.msg()); }
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  std::vector<std::string> messages_;
  c10::WarningUtils::WarningHandlerGuard guard_;
};

}  // namespace kernels::testing
