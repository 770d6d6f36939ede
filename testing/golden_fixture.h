// GoldenFixture: golden values a tools/golden/ script computed with Python
// PyTorch and saved as torch.save({str: Tensor}), read back in a C++ test.
// Every package's golden tests read their fixtures through it.
//
//   // tools/golden/optim_golden.py writes optim/testdata/optim_golden.pt
//   const test_data::GoldenFixture golden(
//       test_data::RunfilePath("optim/testdata/optim_golden.pt"));
//   EXPECT_TRUE(torch::allclose(param, golden["param.3.0"]));
//
// The fixture is a plain dict from strings to tensors (what the scripts
// write; the reader is LibTorch's torch::pickle_load, so the file is exactly
// what Python's torch.save wrote). The target is testonly.
//
// Errors (c10::Error, naming the file): a file that cannot be read, one that
// is not a {str: Tensor} dict, and a key the fixture lacks (the message also
// names the key, so a fixture that is older than its test says what to
// regenerate).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace test_data {

// `workspace_path` (relative to the workspace root) under `bazel test`
// (its runfiles, $TEST_SRCDIR/$TEST_WORKSPACE/...), and `workspace_path`
// itself otherwise (a test binary run from the workspace root).
std::string RunfilePath(const std::string& workspace_path);

class GoldenFixture {
 public:
  // Reads the whole file at `path` (a file path, e.g. from RunfilePath).
  explicit GoldenFixture(const std::string& path);

  bool has(const std::string& key) const { return tensors_.count(key) != 0; }
  // The tensor saved under `key`; throws when there is none.
  const at::Tensor& operator[](const std::string& key) const;
  // Every entry, by key.
  const std::map<std::string, at::Tensor>& tensors() const { return tensors_; }
  // The entries "<prefix>.<name>", as {name: tensor}.
  std::map<std::string, at::Tensor> with_prefix(const std::string& prefix) const;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, at::Tensor> tensors_;
};

}  // namespace test_data
