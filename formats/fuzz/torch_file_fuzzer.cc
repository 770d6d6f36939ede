// libFuzzer target: bytes as a PyTorch file (torch.save's zip archive) through
// LoadTensorDict and LoadIValue, with harness.h's round-trip oracle.
// Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "formats/fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  formats::fuzz::RunTorchFileInput(data, size);
  return 0;
}
