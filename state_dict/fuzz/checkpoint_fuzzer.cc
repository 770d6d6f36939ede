// libFuzzer target: one file of a sharded checkpoint directory replaced by the
// input (its first byte picks which), through VerifyCheckpoint and every load,
// with harness.h's agreement oracle. Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "state_dict/fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  state_dict::fuzz::RunCheckpointInput(data, size);
  return 0;
}
