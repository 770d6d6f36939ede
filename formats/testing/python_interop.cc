#include "formats/testing/python_interop.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <fstream>

#include "torch_python.h"

namespace formats {
namespace testing {

std::string TempDir(const std::string& name) {
  const char* base = getenv("TEST_TMPDIR");
  std::string dir = std::string(base != nullptr ? base : "/tmp") + "/" + name;
  std::string cmd = "rm -rf '" + dir + "' && mkdir -p '" + dir + "'";
  if (system(cmd.c_str()) != 0) abort();
  return dir;
}

bool PythonTorchAvailable() {
  static const bool available =
      system((std::string("'") + kTorchPython + "' -c 'import torch' >/dev/null 2>&1").c_str()) ==
      0;
  return available;
}

int RunPython(const std::string& script, const std::string& args, std::string* output) {
  const std::string path = TempDir("python_script") + "/script.py";
  {
    std::ofstream out(path);
    out << script;
  }
  const std::string cmd = std::string("'") + kTorchPython + "' '" + path + "' " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace testing
}  // namespace formats
