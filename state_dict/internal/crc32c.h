// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78), the
// checksum of iSCSI, ext4 and LevelDB, which checkpoint manifests record per
// file and per tensor.
//
// Hand-written because Debian 12 packages no CRC-32C library for C++ (no
// libcrc32c-dev; only the Python module python3-crc32c). On x86-64 CPUs with
// SSE4.2 it uses the `crc32` instruction, 8 bytes per instruction (memory
// speed, tens of times the byte table); elsewhere the portable table loop.
// Both give identical values, so checkpoints written by either verify on the
// other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace state_dict {
namespace internal {

// `crc` continues a previous call over the preceding bytes (start with 0):
// Crc32c(ab) == Crc32c(b, Crc32c(a)).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// The two implementations Crc32c chooses between, for tests and benchmarks.
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);
// Only callable when Crc32cHardwareAvailable().
uint32_t Crc32cHardware(const void* data, size_t size, uint32_t crc = 0);
bool Crc32cHardwareAvailable();

}  // namespace internal
}  // namespace state_dict
