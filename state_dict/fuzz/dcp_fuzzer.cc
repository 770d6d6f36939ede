// libFuzzer target: one file of a torch.distributed.checkpoint directory
// (`.metadata` or a rank's `.distcp`) replaced by the input (its first byte
// picks which), through DcpCheckpoint::Open, whole and halved LoadResharded
// of every tensor and LoadObject of every object, with harness.h's oracle.
// Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "state_dict/fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  state_dict::fuzz::RunDcpInput(data, size);
  return 0;
}
