// The loader against files that declare more than they hold (issue 27): a
// ZIP64 record declaring 16 GiB or 1 PiB in a file of a few hundred bytes,
// deflated records that inflate past (or short of) their declared size, a
// byte budget, and pickles with many keys, many records or case-variant
// storage keys. The archives are built here byte by byte (ZipBuilder), so
// that their directory entries can say what no writer would.
//
// Every load runs under a counting CPU allocator (the one LibTorch's and our
// storages come from): the largest single request and the peak of live
// bytes show what the file made the loader allocate.
#include "formats/torch_save/torch_save.h"

#include <libdeflate.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "formats/io/crc32c.h"
#include "formats/testing/file_bytes.h"
#include "formats/testing/python_interop.h"
#include "formats/torch_save/tensor_dict_io.h"

namespace formats {
namespace {

using testing::Spit;
using testing::TempDir;

constexpr uint64_t kGiB = uint64_t{1} << 30;

// ---------------------------------------------------------------------------
// Pickles (protocol 2) and zips, by hand.

std::string Le(uint64_t value, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
  return out;
}

std::string Str(const std::string& s) { return "X" + Le(s.size(), 4) + s; }   // BINUNICODE
std::string Int(int32_t v) { return "J" + Le(static_cast<uint32_t>(v), 4); }  // BININT

// torch._utils._rebuild_tensor_v2 of a 1-D float tensor of `numel`
// elements over storage `key` (as torch.save writes one).
std::string FloatTensor(const std::string& key, int32_t numel) {
  return "ctorch._utils\n_rebuild_tensor_v2\n(" +  // func, MARK
         ("(" + Str("storage") + "ctorch\nFloatStorage\n" + Str(key) + Str("cpu") + Int(numel) +
          "tQ") +  // persistent id
         Int(0) +
         "(" + Int(numel) + "t(" + Int(1) + "t" +  // offset, size, stride
         "\x89"
         "ccollections\nOrderedDict\n)R" +  // False, OrderedDict()
         "tR";                              // args, REDUCE
}

// {name: FloatTensor(storage, numel), ...}
std::string TensorDictPickle(
    const std::vector<std::pair<std::string, std::pair<std::string, int32_t>>>& items) {
  std::string p = "\x80\x02}(";
  for (const auto& [name, storage] : items)
    p += Str(name) + FloatTensor(storage.first, storage.second);
  return p + "u.";
}

std::string Deflate(const std::string& data) {
  libdeflate_compressor* c = libdeflate_alloc_compressor(9);
  std::string out(libdeflate_deflate_compress_bound(c, data.size()), '\0');
  out.resize(libdeflate_deflate_compress(c, data.data(), data.size(), out.data(), out.size()));
  libdeflate_free_compressor(c);
  return out;
}

struct ZipRecord {
  std::string name;
  std::string stored;  // the bytes in the file (deflated when method is 8)
  uint16_t method = 0;
  uint32_t crc32 = 0;
  uint64_t compressed = 0;    // as declared
  uint64_t uncompressed = 0;  // as declared
  bool zip64 = false;         // sizes in a ZIP64 extra field
};

// A stored record of `data`, declared as it is.
ZipRecord Stored(const std::string& name, const std::string& data) {
  return ZipRecord{name,        data,        0,    libdeflate_crc32(0, data.data(), data.size()),
                   data.size(), data.size(), false};
}

// A deflated record of `data`, declared as it is.
ZipRecord Deflated(const std::string& name, const std::string& data) {
  const std::string deflated = Deflate(data);
  return ZipRecord{
      name,        deflated, 8, libdeflate_crc32(0, data.data(), data.size()), deflated.size(),
      data.size(), false};
}

std::string BuildZip(const std::vector<ZipRecord>& records) {
  std::string file;
  std::string directory;
  for (const ZipRecord& r : records) {
    const uint64_t offset = file.size();
    const std::string extra =
        r.zip64 ? Le(1, 2) + Le(16, 2) + Le(r.uncompressed, 8) + Le(r.compressed, 8) : "";
    const uint32_t compressed = r.zip64 ? 0xFFFFFFFFu : static_cast<uint32_t>(r.compressed);
    const uint32_t uncompressed = r.zip64 ? 0xFFFFFFFFu : static_cast<uint32_t>(r.uncompressed);
    const std::string common = Le(r.zip64 ? 45 : 20, 2) + Le(0, 2) + Le(r.method, 2) +
                               Le(0, 4) /* time, date */ + Le(r.crc32, 4) + Le(compressed, 4) +
                               Le(uncompressed, 4) + Le(r.name.size(), 2) + Le(extra.size(), 2);
    file += Le(0x04034b50, 4) + common + r.name + extra + r.stored;
    directory += Le(0x02014b50, 4) + Le(45, 2) + common + Le(0, 2) /* comment */ +
                 Le(0, 2) /* disk */ + Le(0, 2) + Le(0, 4) /* attributes */ + Le(offset, 4) +
                 r.name + extra;
  }
  const uint64_t directory_offset = file.size();
  file += directory;
  file += Le(0x06054b50, 4) + Le(0, 2) + Le(0, 2) + Le(records.size(), 2) + Le(records.size(), 2) +
          Le(directory.size(), 4) + Le(directory_offset, 4) + Le(0, 2);
  return file;
}

// archive/data.pkl, the storage records, archive/version.
std::string TorchArchive(const std::string& pickle, std::vector<ZipRecord> storages) {
  std::vector<ZipRecord> records{Stored("archive/data.pkl", pickle)};
  for (ZipRecord& r : storages) records.push_back(std::move(r));
  records.push_back(Stored("archive/version", "3\n"));
  return BuildZip(records);
}

std::string FloatBytes(int64_t numel, float first) {
  std::string out(static_cast<size_t>(numel) * sizeof(float), '\0');
  for (int64_t i = 0; i < numel; ++i) {
    const float v = first + static_cast<float>(i % 251);
    std::memcpy(&out[static_cast<size_t>(i) * sizeof(float)], &v, sizeof(float));
  }
  return out;
}

// ---------------------------------------------------------------------------
// What a load asks of the CPU allocator.

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    largest_ = std::max<uint64_t>(largest_, n);
    c10::DataPtr inner = base_->allocate(n);
    live_ += n;
    peak_ = std::max(peak_.load(), live_.load());
    auto* held = new Held{std::move(inner), n, this};
    void* data = held->inner.get();
    return c10::DataPtr(data, held, &Release, c10::Device(c10::kCPU));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  uint64_t largest() const { return largest_; }
  uint64_t peak() const { return peak_; }
  void Reset() {
    largest_ = 0;
    peak_ = live_.load();
  }
  uint64_t live() const { return live_; }

 private:
  struct Held {
    c10::DataPtr inner;
    size_t n;
    CountingAllocator* owner;
  };
  static void Release(void* context) {
    auto* held = static_cast<Held*>(context);
    held->owner->live_ -= held->n;
    delete held;
  }

  c10::Allocator* base_;
  std::atomic<uint64_t> largest_{0};
  std::atomic<uint64_t> live_{0};
  std::atomic<uint64_t> peak_{0};
};

// Installs a CountingAllocator as LibTorch's CPU allocator for one test.
class LoaderLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = c10::GetCPUAllocator();
    counting_ = std::make_unique<CountingAllocator>(base_);
    c10::SetCPUAllocator(counting_.get(), /*priority=*/0);
    ASSERT_EQ(c10::GetCPUAllocator(), counting_.get());
  }
  void TearDown() override { c10::SetCPUAllocator(base_, /*priority=*/0); }

  // The file's path, written under this test's directory.
  std::string Write(const std::string& name, const std::string& bytes) {
    if (dir_.empty())
      dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    const std::string path = dir_ + "/" + name;
    Spit(path, bytes);
    return path;
  }

  c10::Allocator* base_ = nullptr;
  std::unique_ptr<CountingAllocator> counting_;
  std::string dir_;
};

// Every way a file is loaded: LoadTensorDict, LoadIValue, and the
// checkpoint's one-pass read (loading, and checksumming only).
std::vector<std::pair<std::string, absl::Status>> LoadEveryWay(const std::string& path) {
  return {
      {"LoadTensorDict", LoadTensorDict(path).status()},
      {"LoadIValue", LoadIValue(path).status()},
      {"checksummed read", ReadChecksummedTensorDict(path, TensorData::kRead).status()},
      {"checksummed verify", ReadChecksummedTensorDict(path, TensorData::kChecksumOnly).status()},
  };
}

void ExpectMentions(const absl::Status& status, const std::vector<std::string>& parts,
                    const std::string& how) {
  EXPECT_FALSE(status.ok()) << how;
  for (const std::string& part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << how << ": '" << part << "' missing from: " << status;
  }
}

// ---------------------------------------------------------------------------

// A ZIP64 entry declaring a 16 GiB (or 1 PiB) stored storage in a file of a
// few hundred bytes: LibTorch's getRecord asked for the declared size
// (malloc(17179869184)) before reading a byte. Now the zip precheck refuses
// the entry from the directory alone, naming it, before anything is
// allocated for it.
TEST_F(LoaderLimitsTest, Zip64RecordDeclaringMoreThanTheFileIsRefusedBeforeAllocating) {
  for (const uint64_t declared : {16 * kGiB, uint64_t{1} << 50}) {
    ZipRecord huge = Stored("archive/data/0", FloatBytes(16, 0));
    huge.zip64 = true;
    huge.compressed = huge.uncompressed = declared;
    const std::string path = Write("zip64_" + std::to_string(declared) + ".pt",
                                   TorchArchive(TensorDictPickle({{"w", {"0", 16}}}), {huge}));
    counting_->Reset();
    for (const auto& [how, status] : LoadEveryWay(path)) {
      ExpectMentions(
          status, {path, "'archive/data/0'", std::to_string(declared), "past the end of the"}, how);
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << how;
    }
    EXPECT_LT(counting_->largest(), 1u << 20) << "an allocation followed the declared size";
  }
}

// The same record declared honestly (ZIP64 extra field, 64 bytes) loads.
TEST_F(LoaderLimitsTest, Zip64RecordOfItsRealSizeLoads) {
  ZipRecord record = Stored("archive/data/0", FloatBytes(16, 1));
  record.zip64 = true;
  const std::string path =
      Write("zip64_ok.pt", TorchArchive(TensorDictPickle({{"w", {"0", 16}}}), {record}));
  for (const auto& [how, status] : LoadEveryWay(path))
    EXPECT_TRUE(status.ok()) << how << ": " << status;
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tensors["w"][15].item<float>(), 16.0f);
}

// A deflated record that inflates past the size its entry declares is an
// error naming it, and the loader never holds more than the declared size;
// one that inflates to fewer bytes is an error too.
TEST_F(LoaderLimitsTest, DeflatedRecordInflatingToAnotherSizeThanDeclaredIsAnError) {
  // 64 KiB of floats, declared as 4 KiB (1024 floats, which the pickle asks
  // for): a bomb in miniature.
  ZipRecord longer = Deflated("archive/data/0", FloatBytes(16384, 0));
  longer.uncompressed = 4096;
  const std::string bomb =
      Write("longer.pt", TorchArchive(TensorDictPickle({{"w", {"0", 1024}}}), {longer}));
  counting_->Reset();
  for (const auto& [how, status] : LoadEveryWay(bomb)) {
    ExpectMentions(status, {bomb, "record 'archive/data/0' inflates to more than the 4096 bytes"},
                   how);
  }
  EXPECT_LE(counting_->largest(), 4096u);

  // 4 KiB declared as 8 KiB.
  ZipRecord shorter = Deflated("archive/data/0", FloatBytes(1024, 0));
  shorter.uncompressed = 8192;
  const std::string short_path =
      Write("shorter.pt", TorchArchive(TensorDictPickle({{"w", {"0", 1024}}}), {shorter}));
  for (const auto& [how, status] : LoadEveryWay(short_path)) {
    ExpectMentions(status,
                   {short_path, "record 'archive/data/0' inflates to 4096 bytes", "declares 8192"},
                   how);
  }

  // Deflated bytes cut short.
  ZipRecord cut = Deflated("archive/data/0", FloatBytes(1024, 0));
  cut.stored.resize(cut.stored.size() / 2);
  cut.compressed = cut.stored.size();
  const std::string cut_path =
      Write("cut.pt", TorchArchive(TensorDictPickle({{"w", {"0", 1024}}}), {cut}));
  for (const auto& [how, status] : LoadEveryWay(cut_path)) {
    ExpectMentions(status, {cut_path, "'archive/data/0'"}, how);
  }
}

// A deflated record bigger than the inflater's 1 MiB window and input buffer
// (several windows, several reads) loads bit for bit, and its checksum
// from the pieces (a verify) equals the loaded data's.
TEST_F(LoaderLimitsTest, DeflatedRecordsLoadThroughBoundedBuffers) {
  constexpr int64_t kNumel = (3 << 20) / 4 + 12345;  // ~3 MiB, not a multiple of the window
  std::string data = FloatBytes(kNumel, 0.5f);
  // Mostly incompressible (so that its deflated bytes also span reads).
  uint32_t x = 12345;
  for (size_t i = 0; i < data.size(); i += 3) {
    x = x * 1664525u + 1013904223u;
    data[i] = static_cast<char>(x >> 24);
  }
  const std::string path =
      Write("big_deflated.pt",
            TorchArchive(TensorDictPickle({{"w", {"0", static_cast<int32_t>(kNumel)}}}),
                         {Deflated("archive/data/0", data)}));
  counting_->Reset();
  const uint64_t live_before = counting_->live();
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const torch::Tensor w = loaded->tensors["w"];
  ASSERT_EQ(w.numel(), kNumel);
  EXPECT_EQ(std::memcmp(w.data_ptr(), data.data(), data.size()), 0);
  // One storage of the declared size; nothing else of note.
  EXPECT_LE(counting_->peak() - live_before, data.size() + (1u << 16));

  auto value = LoadIValue(path);
  ASSERT_TRUE(value.ok()) << value.status();
  const uint32_t crc = Crc32c(data.data(), data.size());
  for (auto mode : {TensorData::kRead, TensorData::kChecksumOnly}) {
    auto read = ReadChecksummedTensorDict(path, mode);
    ASSERT_TRUE(read.ok()) << read.status();
    const at::Tensor& t = read->loaded.tensors["w"];
    EXPECT_EQ(TensorCrc32c(read->record_crc32c, t), crc);
    if (mode == TensorData::kRead) {
      EXPECT_EQ(std::memcmp(t.data_ptr(), data.data(), data.size()), 0);
    }
  }
}

// A 64 KiB file whose deflated record honestly inflates to 64 MiB (deflate's
// ratio): the load holds the declared 64 MiB once (it held it twice: the
// inflated record and a copy), and a budget refuses it up front.
TEST_F(LoaderLimitsTest, DeflateBombIsHeldOnceAndRefusedByABudget) {
  constexpr int64_t kNumel = (64 << 20) / 4;
  const std::string zeros(static_cast<size_t>(kNumel) * 4, '\0');
  const std::string pickle = TensorDictPickle({{"w", {"0", static_cast<int32_t>(kNumel)}}});
  const std::string file = TorchArchive(pickle, {Deflated("archive/data/0", zeros)});
  ASSERT_LT(file.size(), 128u << 10);
  const std::string path = Write("bomb.pt", file);

  counting_->Reset();
  const uint64_t live_before = counting_->live();
  {
    auto loaded = LoadTensorDict(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->tensors["w"].sum().item<float>(), 0.0f);
  }
  EXPECT_LE(counting_->peak() - live_before, zeros.size() + (1u << 16));

  counting_->Reset();
  LoadOptions options;
  options.max_bytes = 16 << 20;
  auto refused = LoadTensorDict(path, options);
  ExpectMentions(refused.status(),
                 {path, "declare " + std::to_string(zeros.size() + pickle.size() + 2) + " bytes",
                  "budget of " + std::to_string(16 << 20) + " bytes"},
                 "LoadTensorDict with a budget");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_LT(counting_->largest(), 1u << 20) << "the budget was checked after allocating";
  EXPECT_FALSE(LoadIValue(path, options).ok());
}

// The budget counts what the records declare: under it a file loads, over
// it the error names the file, the total, the tensors' part and the budget.
TEST_F(LoaderLimitsTest, BudgetRefusesFilesOverItAndAcceptsFilesUnderIt) {
  const std::string pickle = TensorDictPickle({{"a", {"0", 1024}}, {"b", {"1", 1024}}});
  const std::string path =
      Write("two.pt", TorchArchive(pickle, {Stored("archive/data/0", FloatBytes(1024, 0)),
                                            Stored("archive/data/1", FloatBytes(1024, 7))}));
  const uint64_t total = pickle.size() + 2 * 4096 + 2;  // + "3\n"
  LoadOptions options;
  options.max_bytes = total;
  auto under = LoadTensorDict(path, options);
  ASSERT_TRUE(under.ok()) << under.status();
  EXPECT_EQ(under->tensors.size(), 2u);
  EXPECT_TRUE(LoadIValue(path, options).ok());

  options.max_bytes = total - 1;
  for (const absl::Status& status :
       {LoadTensorDict(path, options).status(), LoadIValue(path, options).status()}) {
    ExpectMentions(status,
                   {path, "declare " + std::to_string(total) + " bytes", "8192 of them tensor",
                    "budget of " + std::to_string(total - 1) + " bytes"},
                   "over the budget");
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  }
  // 0: no budget.
  options.max_bytes = 0;
  EXPECT_TRUE(LoadTensorDict(path, options).ok());
}

// One dict of 100k str keys (EMPTY_DICT, MARK, 100k pairs, SETITEMS, as
// torch.save writes it) loads with every key in order; each SETITEM used to
// scan the whole dict (quadratic: minutes). The time is measured by
// //benchmarks:loader_bench, not here.
TEST_F(LoaderLimitsTest, ManyKeysLoad) {
  constexpr int kKeys = 100000;
  std::string pickle = "\x80\x02}(";
  for (int i = 0; i < kKeys; ++i) pickle += Str("k" + std::to_string(i)) + Int(i);
  pickle += "u.";
  const std::string path = Write("keys.pt", TorchArchive(pickle, {}));
  auto value = LoadIValue(path);
  ASSERT_TRUE(value.ok()) << value.status();
  const auto dict = value->toGenericDict();
  ASSERT_EQ(dict.size(), static_cast<size_t>(kKeys));
  int i = 0;
  for (const auto& entry : dict) {
    ASSERT_EQ(entry.key().toStringRef(), "k" + std::to_string(i));
    ASSERT_EQ(entry.value().toInt(), i);
    ++i;
  }
}

// As Python's dict: a key set again keeps its first place and takes the
// last value, whether set by SETITEMS or one SETITEM at a time, str or int.
TEST_F(LoaderLimitsTest, RepeatedKeysKeepTheirPlaceAndTakeTheLastValue) {
  const std::string setitems = "\x80\x02}(" + Str("a") + Int(1) + Str("b") + Int(2) + Str("a") +
                               Int(3) + "u" + "(" + Str("c") + Int(4) + Str("b") + Int(5) + "u.";
  auto value = LoadIValue(Write("setitems.pt", TorchArchive(setitems, {})));
  ASSERT_TRUE(value.ok()) << value.status();
  std::vector<std::pair<std::string, int64_t>> got;
  for (const auto& entry : value->toGenericDict()) {
    got.emplace_back(entry.key().toStringRef(), entry.value().toInt());
  }
  EXPECT_EQ(got, (std::vector<std::pair<std::string, int64_t>>{{"a", 3}, {"b", 5}, {"c", 4}}));

  const std::string setitem =
      "\x80\x02}" + Int(7) + Int(1) + "s" + Int(8) + Int(2) + "s" + Int(7) + Int(3) + "s.";
  auto ints = LoadIValue(Write("setitem.pt", TorchArchive(setitem, {})));
  ASSERT_TRUE(ints.ok()) << ints.status();
  std::vector<std::pair<int64_t, int64_t>> int_items;
  for (const auto& entry : ints->toGenericDict()) {
    int_items.emplace_back(entry.key().toInt(), entry.value().toInt());
  }
  EXPECT_EQ(int_items, (std::vector<std::pair<int64_t, int64_t>>{{7, 3}, {8, 2}}));
}

// Many small records (each tensor its own storage) load, each read once.
TEST_F(LoaderLimitsTest, ManyRecordsLoad) {
  constexpr int kRecords = 20000;
  TensorDict tensors;
  for (int i = 0; i < kRecords; ++i) tensors.insert("p" + std::to_string(i), torch::full({2}, i));
  const std::string path = Write("records.pt", "");
  ASSERT_TRUE(SaveTensorDict(tensors, path).ok());
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tensors.size(), static_cast<size_t>(kRecords));
  for (int i = 0; i < kRecords; i += 997) {
    EXPECT_EQ(loaded->tensors["p" + std::to_string(i)][1].item<float>(), static_cast<float>(i));
  }
}

// Storage keys naming one record in different case (miniz finds names
// ignoring case) share one storage: a pickle cannot make the loader read a
// record once per spelling and hold more than the records declare.
TEST_F(LoaderLimitsTest, CaseVariantStorageKeysShareOneStorage) {
  const std::string pickle =
      TensorDictPickle({{"x", {"ab", 1024}}, {"y", {"AB", 1024}}, {"z", {"aB", 1024}}});
  const std::string path =
      Write("case.pt", TorchArchive(pickle, {Stored("archive/data/ab", FloatBytes(1024, 0))}));
  counting_->Reset();
  const uint64_t live_before = counting_->live();
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tensors["x"].data_ptr(), loaded->tensors["y"].data_ptr());
  EXPECT_EQ(loaded->tensors["x"].data_ptr(), loaded->tensors["z"].data_ptr());
  EXPECT_LE(counting_->peak() - live_before, 4096u + 1024u);
}

}  // namespace
}  // namespace formats
