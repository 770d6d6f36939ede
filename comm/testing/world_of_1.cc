#include "comm/testing/world_of_1.h"

#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace comm {
namespace testing {
namespace {

// A fresh directory under $TMPDIR (else /tmp), removed when done.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ =
        absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/gpu_check_XXXXXX");
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    TORCH_CHECK(mkdtemp(buf.data()) != nullptr, "gpu_check: mkdtemp('", templ,
                "') failed: ", std::strerror(errno));
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

absl::StatusOr<WorldOf1> MakeWorldOf1(const std::string& backend,
                                      std::chrono::milliseconds timeout) {
  auto dir = std::make_shared<const TempDir>();
  comm::InitOptions init;
  init.backend = backend;
  init.init_method = "file://" + dir->path() + "/store";
  init.rank = 0;
  init.world_size = 1;
  init.timeout = timeout;
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    return absl::Status(group.status().code(),
                        absl::StrCat("comm::init_process_group(backend '", backend,
                                     "', world of 1): ", group.status().message()));
  }
  WorldOf1 world;
  world.store_directory = std::move(dir);
  world.group = *group;
  return world;
}

}  // namespace testing
}  // namespace comm
