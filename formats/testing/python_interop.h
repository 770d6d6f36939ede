// Runs the Python whose `torch` is the wheel the build's LibTorch came from
// (@libtorch//:python_path; tools/setup.sh --with-python installs it) from
// tests, to check files against PyTorch itself.
#pragma once

#include <string>

namespace formats {
namespace testing {

// True when that Python can `import torch`.
bool PythonTorchAvailable();

// Writes `script` to a file and runs it with the given arguments; returns the
// exit status and fills `output` with its stdout+stderr.
int RunPython(const std::string& script, const std::string& args, std::string* output);

// A fresh directory under $TEST_TMPDIR.
std::string TempDir(const std::string& name);

}  // namespace testing
}  // namespace formats
