// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78), the
// checksum of iSCSI, ext4 and LevelDB, which checkpoint manifests record per
// file and per tensor.
//
// Hand-written because Debian 12 packages no CRC-32C library for C++ (no
// libcrc32c-dev; only the Python module python3-crc32c). On x86-64 CPUs with
// SSE4.2 it uses the `crc32` instruction on three interleaved stripes
// (here 23 GB/s from cache, 12 GB/s from memory: 3x and 1.7x one chain of
// it);
// elsewhere the portable table loop.
// Both give identical values, so checkpoints written by either verify on the
// other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace formats {

// `crc` continues a previous call over the preceding bytes (start with 0):
// Crc32c(ab) == Crc32c(b, Crc32c(a)).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// The two implementations Crc32c chooses between, for tests and benchmarks.
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);
// Only callable when Crc32cHardwareAvailable().
uint32_t Crc32cHardware(const void* data, size_t size, uint32_t crc = 0);
bool Crc32cHardwareAvailable();

// The CRC-32C of the concatenation A‖B from crc_a = Crc32c(A),
// crc_b = Crc32c(B) and B's length, without B's bytes (zlib's
// crc32_combine method: crc_a times x^(8·size_b) modulo the polynomial, plus
// crc_b; O(log size_b)). Lets pieces of a file be checksummed on their own
// (each tensor record, as its manifest entry needs) and the whole file's
// checksum be assembled from them.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b);

}  // namespace formats
