#include "formats/io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace formats {
namespace {

// Polynomials over GF(2) modulo the CRC-32C polynomial, in the CRC's
// reflected bit order: bit 31 is x^0, bit 0 is x^31.
constexpr uint32_t kReflectedPoly = 0x82F63B78u;

std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kReflectedPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

// a(x) * b(x) mod P(x).
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = uint32_t{1} << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kReflectedPoly : b >> 1;  // b *= x
  }
  return product;
}

// x^(2^k) mod P for k = 0..66: enough for x^(8n) with any 64-bit n.
struct PowersOfX {
  uint32_t x2k[67];
  PowersOfX() {
    x2k[0] = uint32_t{1} << 30;  // x^1
    for (int k = 1; k < 67; ++k) x2k[k] = MultiplyModP(x2k[k - 1], x2k[k - 1]);
  }
};

// x^(8n) mod P: the factor that appending n zero bytes multiplies by.
uint32_t XToThe8nModP(uint64_t n) {
  static const PowersOfX powers;
  uint32_t p = uint32_t{1} << 31;  // x^0
  for (int k = 3; n != 0; n >>= 1, ++k) {
    if (n & 1) p = MultiplyModP(powers.x2k[k], p);
  }
  return p;
}

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeCrc32cTable();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

#if defined(__x86_64__)

bool Crc32cHardwareAvailable() {
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
}

namespace {

// The `crc32` instruction takes 3 cycles but can start every cycle, so one
// chain of it runs at a third of what the core can do (~6.5 GB/s here; a
// load through a file mapping checksums each page as it first touches it and
// waited on that: issue #16). Three stripes of kStripe bytes are checksummed
// at once and their registers joined: a register r followed by n more bytes
// becomes r * x^(8n) mod P, XORed with the register of those bytes alone.
// The multiplications are by constants, done with four 256-entry tables.
constexpr size_t kStripe = 8192;

class ShiftTable {
 public:
  // Multiplies by x^(8 * bytes) mod P.
  explicit ShiftTable(uint64_t bytes) {
    const uint32_t factor = XToThe8nModP(bytes);
    for (int i = 0; i < 4; ++i) {
      for (uint32_t v = 0; v < 256; ++v) by_byte_[i][v] = MultiplyModP(factor, v << (8 * i));
    }
  }
  uint32_t operator()(uint32_t reg) const {
    return by_byte_[0][reg & 0xFF] ^ by_byte_[1][(reg >> 8) & 0xFF] ^
           by_byte_[2][(reg >> 16) & 0xFF] ^ by_byte_[3][reg >> 24];
  }

 private:
  uint32_t by_byte_[4][256];
};

__attribute__((target("sse4.2"))) inline uint64_t CrcWord(uint64_t reg, const unsigned char* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm_crc32_u64(reg, word);
}

}  // namespace

// Compiled for SSE4.2 alone (a per-function target, not a global -msse4.2),
// so the binary still runs on CPUs without it: Crc32c only calls this after
// the runtime check.
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const void* data, size_t size,
                                                          uint32_t crc) {
  static const ShiftTable past_one_stripe(kStripe), past_two_stripes(2 * kStripe);
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  // Bytes up to an 8-byte boundary, then three stripes at a time, then
  // whole words, then the tail.
  while (size > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --size;
  }
  while (size >= 3 * kStripe) {
    uint64_t first = c, second = 0, third = 0;
    for (size_t i = 0; i < kStripe; i += 8) {
      first = CrcWord(first, p + i);
      second = CrcWord(second, p + kStripe + i);
      third = CrcWord(third, p + 2 * kStripe + i);
    }
    c = past_two_stripes(static_cast<uint32_t>(first)) ^
        past_one_stripe(static_cast<uint32_t>(second)) ^ third;
    p += 3 * kStripe;
    size -= 3 * kStripe;
  }
  while (size >= 8) {
    c = CrcWord(c, p);
    p += 8;
    size -= 8;
  }
  while (size > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --size;
  }
  return ~static_cast<uint32_t>(c);
}

#else  // not x86-64: the table loop only

bool Crc32cHardwareAvailable() { return false; }

uint32_t Crc32cHardware(const void* data, size_t size, uint32_t crc) {
  return Crc32cPortable(data, size, crc);
}

#endif

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
  // The pre- and post-inversion of both CRCs cancel out (as in zlib): the
  // register after A, shifted through |B| bytes, XORed with B's own CRC.
  return MultiplyModP(XToThe8nModP(size_b), crc_a) ^ crc_b;
}

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  return Crc32cHardwareAvailable() ? Crc32cHardware(data, size, crc)
                                   : Crc32cPortable(data, size, crc);
}

}  // namespace formats
