#include "formats/fuzz/oracle.h"

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace formats {
namespace fuzz {

void Violation(const std::string& what) {
  std::fprintf(stderr, "\n*** state_dict fuzz oracle violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string StatusText(const absl::Status& status) {
  return status.ok() ? "OK" : std::string(status.ToString());
}

void WriteBytesOrDie(const std::string& path, const void* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) Violation(absl::StrCat("harness cannot create ", path));
  const bool ok = (size == 0 || std::fwrite(data, 1, size, f) == size);
  if (std::fclose(f) != 0 || !ok) Violation(absl::StrCat("harness cannot write ", path));
}

std::string ReadBytesOrDie(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) Violation(absl::StrCat("harness cannot open ", path));
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

const std::string& ScratchDirectory() {
  static const std::string* dir = [] {
    const char* base = std::getenv("TEST_TMPDIR");
    if (base == nullptr) base = std::getenv("TMPDIR");
    if (base == nullptr) base = "/tmp";
    std::string pattern = absl::StrCat(base, "/state_dict_fuzz.XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) {
      Violation(absl::StrCat("harness cannot create a directory like ", pattern));
    }
    auto* d = new std::string(pattern);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(*dir, ignored);
    });
    return d;
  }();
  return *dir;
}

bool BitwiseEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

std::string Describe(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), " ", c10::str(t.sizes()));
}

std::optional<int64_t> TotalBytes(const TensorDict& tensors) {
  int64_t bytes = 0;
  for (const auto& item : tensors) {
    int64_t tensor_bytes;
    if (__builtin_mul_overflow(item.value().numel(), item.value().element_size(), &tensor_bytes) ||
        __builtin_add_overflow(bytes, tensor_bytes, &bytes)) {
      return std::nullopt;
    }
  }
  return bytes;
}

void ExpectSameTensors(const TensorDict& loaded, const TensorDict& again,
                       const std::string& context) {
  if (again.keys() != loaded.keys()) {
    Violation("the round trip changed the tensors' names or their order" + context);
  }
  for (const auto& item : loaded) {
    const at::Tensor& reloaded = again[item.key()];
    if (!BitwiseEqual(item.value(), reloaded)) {
      Violation(absl::StrCat("the round trip changed tensor '", item.key(), "': ",
                             Describe(item.value()), " became ", Describe(reloaded), context));
    }
  }
}

}  // namespace fuzz
}  // namespace formats
