// libFuzzer target: a whole safetensors file through LoadSafetensors and
// SafetensorsFile, and the same bytes as the model.safetensors.index.json of
// a two-shard directory through HfCheckpointFiles, with harness.h's oracles.
// (One target for both, so that the index parser shares the safetensors
// target's fuzzing time rather than adding to it; either parser refuses the
// other's inputs at their first bytes.) Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "formats/fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  formats::fuzz::RunSafetensorsInput(data, size);
  formats::fuzz::RunHfIndexInput(data, size).IgnoreError();  // the oracles abort
  return 0;
}
