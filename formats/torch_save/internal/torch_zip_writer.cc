#include "formats/torch_save/internal/torch_zip_writer.h"

#include <libdeflate.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <caffe2/serialize/versions.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "formats/io/crc32c.h"
#include "formats/zip/zip_format.h"

namespace formats {
namespace internal {
namespace {

// Bit 11: UTF-8 names; bit 3: CRC and sizes follow the data (a data
// descriptor). miniz writes an empty record without a descriptor, and
// without bit 3. Version-needed, method, time and date stay 0.
uint16_t Flags(uint64_t size) { return size == 0 ? 0x0800 : 0x0808; }
constexpr uint16_t kPaddingExtraId = 0x4246;  // "FB", PyTorch's alignment field
// Sizes and offsets from this on go into the ZIP64 field (as miniz: a value
// of exactly 0xFFFFFFFF too, since it would read as the marker).
constexpr uint64_t kZip64Threshold = kZip64Marker;
// torch.load maps records in place when their data is aligned to this.
constexpr uint64_t kDataAlignment = 64;
// Pieces small enough to stay in L2 from the CRCs to the write.
constexpr size_t kPieceBytes = size_t{256} << 10;

// Little-endian fields, appended.
class Bytes {
 public:
  Bytes& u16(uint64_t v) { return put(v, 2); }
  Bytes& u32(uint64_t v) { return put(v, 4); }
  Bytes& u64(uint64_t v) { return put(v, 8); }
  Bytes& raw(absl::string_view s) {
    out_.append(s.data(), s.size());
    return *this;
  }
  Bytes& fill(char c, size_t n) {
    out_.append(n, c);
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  Bytes& put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return *this;
  }
  std::string out_;
};

// ZIP64 extended information: only the fields that do not fit in 32 bits,
// in the specification's order (miniz's choice for both headers).
std::string Zip64Extra(const uint64_t* size, const uint64_t* compressed_size,
                       const uint64_t* offset) {
  const int fields = (size != nullptr) + (compressed_size != nullptr) + (offset != nullptr);
  if (fields == 0) return "";
  Bytes b;
  b.u16(kZip64ExtraId).u16(8 * fields);
  if (size != nullptr) b.u64(*size);
  if (compressed_size != nullptr) b.u64(*compressed_size);
  if (offset != nullptr) b.u64(*offset);
  return b.str();
}

// c10::hash_combine, which PyTorchStreamWriter folds its id with.
uint64_t HashCombine(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2));
}

}  // namespace

TorchZipWriter::TorchZipWriter(AtomicFileWriter& file, std::string archive_name)
    : file_(file), base_(file.bytes()), archive_name_(std::move(archive_name)) {}

absl::StatusOr<uint32_t> TorchZipWriter::WriteRecord(absl::string_view name, const void* data,
                                                     size_t size) {
  if (finished_) {
    return absl::FailedPreconditionError(absl::StrCat("cannot add record '", name, "' to ",
                                                      file_.path(), ": the archive is finished"));
  }
  Entry entry{absl::StrCat(archive_name_, "/", name), file_.bytes() - base_, size, 0};
  if (entry.name.size() > 0xFFFF) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot add record '", name, "' to ", file_.path(), ": its name has ",
                     entry.name.size(), " bytes, a zip name at most 65535"));
  }
  const bool large_size = entry.size >= kZip64Threshold;
  const bool large_offset = entry.offset >= kZip64Threshold;
  // As miniz: the local ZIP64 field carries the size and a compressed size
  // of 0 (not known yet when it writes the header), and the offset.
  const uint64_t zero = 0;
  const std::string zip64 =
      Zip64Extra(large_size ? &entry.size : nullptr, large_size ? &zero : nullptr,
                 large_offset ? &entry.offset : nullptr);
  const uint64_t unpadded =
      entry.offset + kZipLocalHeaderSize + entry.name.size() + zip64.size() + 4;
  const uint64_t padding = (kDataAlignment - unpadded % kDataAlignment) % kDataAlignment;

  Bytes header;
  header.u32(kZipLocalHeaderSignature).u16(0).u16(Flags(size)).u16(0).u16(0).u16(0);
  header.u32(0).u32(0).u32(0);  // CRC and sizes: in the data descriptor
  header.u16(entry.name.size()).u16(zip64.size() + 4 + padding);
  header.raw(entry.name).raw(zip64);
  header.u16(kPaddingExtraId).u16(padding).fill('Z', padding);
  absl::Status status = file_.Append(header.str().data(), header.str().size());
  if (!status.ok()) return status;

  uint32_t crc32 = 0;
  uint32_t crc32c = 0;
  const auto* bytes = static_cast<const char*>(data);
  for (size_t done = 0; done < size;) {
    const size_t n = std::min(kPieceBytes, size - done);
    crc32 = libdeflate_crc32(crc32, bytes + done, n);
    const uint32_t piece_crc32c = Crc32c(bytes + done, n);
    crc32c = Crc32cCombine(crc32c, piece_crc32c, n);
    status = file_.AppendChecksummed(bytes + done, n, piece_crc32c);
    if (!status.ok()) return status;
    done += n;
  }
  entry.crc32 = crc32;
  // What PyTorchStreamWriter (2.x) folds into the serialization id.
  uncompressed_crc_hash_ = HashCombine(uncompressed_crc_hash_, crc32);

  if (size > 0) {
    Bytes descriptor;
    descriptor.u32(kZipDataDescriptorSignature).u32(crc32);
    if (zip64.empty()) {
      descriptor.u32(size).u32(size);
    } else {
      descriptor.u64(size).u64(size);
    }
    status = file_.Append(descriptor.str().data(), descriptor.str().size());
    if (!status.ok()) return status;
  }
  entries_.push_back(std::move(entry));
  return crc32c;
}

absl::Status TorchZipWriter::Finish() {
  // The version torch.load checks, as PyTorchStreamWriter writes it for
  // archives that use no newer feature.
  const std::string version = absl::StrCat(caffe2::serialize::kMinProducedFileFormatVersion, "\n");
  auto written = WriteRecord("version", version.data(), version.size());
  if (!written.ok()) return written.status();
  // LibTorch 2.x's writer adds the byte order of the tensor data and an id
  // folded from the records' names and CRC-32s. The records and their layout
  // are byte-identical to PyTorchStreamWriter's (torch_zip_writer_test); the
  // id's 40 digits are made the same way in spirit but are not LibTorch's
  // (its exact folding is not reproduced): nothing reads the value but to
  // compare the ids of files of one checkpoint.
  written = WriteRecord("byteorder", "little", 6);
  if (!written.ok()) return written.status();
  std::vector<std::string> names;
  for (const Entry& e : entries_) names.push_back(e.name.substr(archive_name_.size() + 1));
  names.push_back(".data/serialization_id");
  std::sort(names.begin(), names.end());
  uint64_t name_hash = 0;
  for (const std::string& name : names) {
    name_hash = HashCombine(name_hash, std::hash<std::string>{}(name));
  }
  const std::string id = absl::StrFormat("%020u%020u", name_hash, uncompressed_crc_hash_);
  written = WriteRecord(".data/serialization_id", id.data(), id.size());
  if (!written.ok()) return written.status();
  finished_ = true;

  const uint64_t directory_offset = file_.bytes() - base_;
  Bytes directory;
  for (const Entry& e : entries_) {
    const bool large_size = e.size >= kZip64Threshold;
    const std::string zip64 =
        Zip64Extra(large_size ? &e.size : nullptr, large_size ? &e.size : nullptr,
                   e.offset >= kZip64Threshold ? &e.offset : nullptr);
    const uint64_t size32 = std::min(e.size, kZip64Threshold);
    directory.u32(kZipCentralHeaderSignature).u16(0).u16(0).u16(Flags(e.size)).u16(0).u16(0).u16(0);
    directory.u32(e.crc32).u32(size32).u32(size32);
    directory.u16(e.name.size()).u16(zip64.size()).u16(0);  // no comment
    directory.u16(0).u16(0).u32(0);                         // disk, attributes
    directory.u32(std::min(e.offset, kZip64Threshold));
    directory.raw(e.name).raw(zip64);
  }
  const uint64_t directory_bytes = directory.str().size();
  const uint64_t zip64_end_offset = directory_offset + directory_bytes;
  const uint64_t count = entries_.size();
  Bytes end;
  end.u32(kZip64EndSignature).u64(kZip64EndSize - 12).u16(0x031E).u16(0x002D);
  end.u32(0).u32(0).u64(count).u64(count).u64(directory_bytes).u64(directory_offset);
  end.u32(kZip64LocatorSignature).u32(0).u64(zip64_end_offset).u32(1);
  end.u32(kZipEndSignature).u16(0).u16(0);
  end.u16(std::min<uint64_t>(count, 0xFFFF)).u16(std::min<uint64_t>(count, 0xFFFF));
  end.u32(std::min(directory_bytes, kZip64Threshold));
  end.u32(std::min(directory_offset, kZip64Threshold)).u16(0);
  absl::Status status = file_.Append(directory.str().data(), directory.str().size());
  if (!status.ok()) return status;
  return file_.Append(end.str().data(), end.str().size());
}

}  // namespace internal
}  // namespace formats
