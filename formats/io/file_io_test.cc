#include "formats/io/file_io.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "formats/io/crc32c.h"

namespace formats {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// RFC 3720 (iSCSI) B.4 test vectors and the common "123456789" check value.
TEST(Crc32cTest, KnownVectors) {
  const std::string digits = "123456789";
  const std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF);
  std::vector<unsigned char> ascending(32), descending(32);
  for (int i = 0; i < 32; ++i) {
    ascending[static_cast<size_t>(i)] = static_cast<unsigned char>(i);
    descending[static_cast<size_t>(i)] = static_cast<unsigned char>(31 - i);
  }
  for (auto crc : {Crc32c, Crc32cPortable}) {
    EXPECT_EQ(crc(digits.data(), digits.size(), 0), 0xE3069283u);
    EXPECT_EQ(crc(zeros.data(), zeros.size(), 0), 0x8A9136AAu);
    EXPECT_EQ(crc(ones.data(), ones.size(), 0), 0x62A8AB43u);
    EXPECT_EQ(crc(ascending.data(), ascending.size(), 0), 0x46DD794Eu);
    EXPECT_EQ(crc(descending.data(), descending.size(), 0), 0x113FDB5Cu);
    EXPECT_EQ(crc(digits.data(), 0, 0), 0u);
  }
}

// The hardware path must give the table's values for every length and
// alignment (its head / three-stripe / word / tail split: lengths up to
// 256 KiB span several 24 KiB stripe triples) and when continued piecewise.
TEST(Crc32cTest, HardwareMatchesTableOnRandomLengthsAndAlignments) {
  if (!Crc32cHardwareAvailable()) GTEST_SKIP() << "this CPU has no SSE4.2";
  std::mt19937_64 rng(16);
  std::vector<unsigned char> buffer(1 << 18);
  for (auto& b : buffer) b = static_cast<unsigned char>(rng());
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t offset = rng() % 16;
    const size_t size = trial < 64 ? static_cast<size_t>(trial) : rng() % (buffer.size() - offset);
    const uint32_t seed = trial % 3 == 0 ? 0u : static_cast<uint32_t>(rng());
    const unsigned char* p = buffer.data() + offset;
    const uint32_t want = Crc32cPortable(p, size, seed);
    ASSERT_EQ(Crc32cHardware(p, size, seed), want) << "offset " << offset << " size " << size;
    const size_t split = size == 0 ? 0 : rng() % size;
    ASSERT_EQ(Crc32cHardware(p + split, size - split, Crc32cHardware(p, split, seed)), want)
        << "offset " << offset << " size " << size << " split " << split;
  }
}

// Crc32cCombine(crc(A), crc(B), |B|) is the straight CRC of A‖B (the table
// loop's, as the reference): at every split, with empty pieces, and folded
// over many pieces of a file as the checkpoint reader assembles it.
TEST(Crc32cTest, CombineMatchesTheStraightCrc) {
  std::mt19937_64 rng(17);
  std::vector<unsigned char> buffer(size_t{1} << 20);
  for (auto& b : buffer) b = static_cast<unsigned char>(rng());
  const unsigned char* p = buffer.data();
  for (int trial = 0; trial < 500; ++trial) {
    const size_t size = trial < 40 ? static_cast<size_t>(trial) : rng() % buffer.size();
    const size_t split =
        trial % 5 == 0 ? (trial % 10 == 0 ? 0 : size) : (size == 0 ? 0 : rng() % size);
    const uint32_t a = Crc32cPortable(p, split);
    const uint32_t b = Crc32cPortable(p + split, size - split);
    ASSERT_EQ(Crc32cCombine(a, b, size - split), Crc32cPortable(p, size))
        << "size " << size << " split " << split;
  }
  uint32_t folded = 0;
  for (size_t at = 0; at < buffer.size();) {
    const size_t n = std::min<size_t>(buffer.size() - at, rng() % 70000);
    folded = Crc32cCombine(folded, Crc32c(p + at, n), n);
    at += n;
  }
  EXPECT_EQ(folded, Crc32cPortable(p, buffer.size()));
}

// Lengths past 32 bits (files of several GB): the CRC of 2^k zero bytes
// built by doubling with Crc32cCombine matches the straight CRC where that
// can be computed (1 MiB), and combining stays associative at 2^40 bytes.
TEST(Crc32cTest, CombineHandlesLengthsBeyond32Bits) {
  uint32_t zeros = Crc32cPortable("\0", 1);  // CRC of 2^k zero bytes, k = 0
  for (int k = 0; k < 20; ++k) zeros = Crc32cCombine(zeros, zeros, uint64_t{1} << k);
  const std::vector<unsigned char> mib(size_t{1} << 20, 0);
  ASSERT_EQ(zeros, Crc32cPortable(mib.data(), mib.size()));
  uint32_t big = zeros;  // 2^20 zero bytes
  for (int k = 20; k < 40; ++k) big = Crc32cCombine(big, big, uint64_t{1} << k);
  const uint32_t a = Crc32cPortable("head", 4), c = Crc32cPortable("tail!", 5);
  const uint64_t n = uint64_t{1} << 40;
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(a, big, n), c, 5),
            Crc32cCombine(a, Crc32cCombine(big, c, 5), n + 5));
  EXPECT_NE(Crc32cCombine(a, big, n), Crc32cCombine(a, big, n + 1));
}

TEST(AtomicFileWriterTest, SmallAndLargeAppendsLandInOrderWithTheirChecksum) {
  const std::string path = ::testing::TempDir() + "/writer_order.bin";
  std::mt19937_64 rng(7);
  std::string expected;
  auto writer = AtomicFileWriter::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  // Sizes around the 64 KiB direct-write threshold and the 1 MiB write
  // buffer: gathered, flushed, written directly; every other piece comes
  // with its own CRC-32C (AppendChecksummed), which must extend the file's.
  bool checksummed = false;
  for (size_t size :
       {size_t{0}, size_t{3}, size_t{1000}, size_t{1} << 20, size_t{17}, (size_t{64} << 10) - 1,
        size_t{64} << 10, size_t{900} << 10, (size_t{1} << 20) - 5, size_t{3} << 20, size_t{1}}) {
    std::string piece(size, '\0');
    for (auto& c : piece) c = static_cast<char>(rng());
    ASSERT_TRUE((checksummed ? (*writer)->AppendChecksummed(piece.data(), piece.size(),
                                                            Crc32c(piece.data(), piece.size()))
                             : (*writer)->Append(piece.data(), piece.size()))
                    .ok());
    checksummed = !checksummed;
    expected += piece;
  }
  EXPECT_FALSE(PathExists(path)) << "visible before Commit";
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_EQ((*writer)->bytes(), expected.size());
  EXPECT_EQ((*writer)->crc32c(), Crc32cPortable(expected.data(), expected.size()));
  EXPECT_EQ(Slurp(path), expected);
  auto sum = ChecksumFile(path);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->bytes, expected.size());
  EXPECT_EQ(sum->crc32c, (*writer)->crc32c());
  EXPECT_FALSE((*writer)->Append("x", 1).ok()) << "append after commit";
}

TEST(AtomicFileWriterTest, UncommittedWriterLeavesTheOldFileAndNoTemporary) {
  const std::string dir = ::testing::TempDir() + "/uncommitted";
  ASSERT_TRUE(CreateDirectories(dir).ok());
  const std::string path = dir + "/data.bin";
  ASSERT_TRUE(WriteFileAtomically(path, "old contents").ok());
  {
    auto writer = AtomicFileWriter::Open(path);
    ASSERT_TRUE(writer.ok());
    const std::string big(3 << 20, 'n');
    ASSERT_TRUE((*writer)->Append(big.data(), big.size()).ok());
  }  // dropped without Commit, e.g. an error in the middle of a save
  EXPECT_EQ(Slurp(path), "old contents");
  auto names = ListDirectory(dir);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"data.bin"});
}

TEST(AtomicFileWriterTest, ErrorsNameThePath) {
  auto writer = AtomicFileWriter::Open("/nonexistent-dir-16/x.bin");
  ASSERT_FALSE(writer.ok());
  EXPECT_NE(writer.status().message().find("/nonexistent-dir-16/x.bin"), std::string::npos)
      << writer.status();
  auto sum = ChecksumFile("/nonexistent-dir-16/x.bin");
  EXPECT_TRUE(absl::IsNotFound(sum.status())) << sum.status();
}

}  // namespace
}  // namespace formats
