// libFuzzer target: bytes as a rendezvous peer's replies to comm's TCPStore
// client (see harness.h for the layout and the oracles). Built and run by
// tools/fuzz.sh --target rendezvous.
#include <cstddef>
#include <cstdint>

#include "comm/fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  comm::fuzz::RunRendezvousInput(data, size);
  return 0;
}
