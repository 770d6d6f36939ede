#include "formats/zip/zip_precheck.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <caffe2/serialize/versions.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// miniz's raw-deflate decoder. miniz is compiled into libtorch_cpu and its
// functions are exported, but LibTorch installs no miniz.h; this is its
// declaration (flags 0: raw deflate, no zlib header). Returns the number of
// bytes written, or (size_t)-1 when the stream is bad or does not fit.
extern "C" size_t tinfl_decompress_mem_to_mem(void* out, size_t out_len, const void* in,
                                              size_t in_len, int flags);
// Its streaming decoder (miniz.h: tinfl_decompress, with its decompressor
// allocated and initialised by miniz itself, so its layout is not needed
// here). Flags and results as miniz.h defines them (unchanged since miniz
// 1.x).
extern "C" {
struct tinfl_decompressor_tag;
tinfl_decompressor_tag* tinfl_decompressor_alloc();
void tinfl_decompressor_free(tinfl_decompressor_tag* decompressor);
int tinfl_decompress(tinfl_decompressor_tag* r, const uint8_t* in_next, size_t* in_size,
                     uint8_t* out_start, uint8_t* out_next, size_t* out_size, uint32_t flags);
}

namespace formats {
namespace {

constexpr size_t kMaxCommentSize = 0xFFFF;
// PyTorch writes "3\n"; anything near this size is not a version record.
constexpr uint64_t kMaxVersionRecordBytes = 64 << 10;
// 2.x writes 40 digits as the serialization id.
constexpr uint64_t kMaxSerializationIdBytes = 4096;
constexpr uint64_t kMaxDeflateRatio = 1032;
constexpr uint32_t kDosDirectoryAttribute = 0x10;

uint16_t Le16(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(u[0] | (u[1] << 8));
}
uint32_t Le32(const char* p) { return Le16(p) | (static_cast<uint32_t>(Le16(p + 2)) << 16); }
uint64_t Le64(const char* p) { return Le32(p) | (static_cast<uint64_t>(Le32(p + 4)) << 32); }

// As miniz decides (mz_zip_reader_is_file_a_directory): a name ending in
// '/', or the DOS directory attribute.
bool IsDirectory(const ZipEntry& e) {
  return (!e.name.empty() && e.name.back() == '/') ||
         (e.external_attributes & kDosDirectoryAttribute) != 0;
}

// CRC-32 (the zip's checksum: IEEE polynomial, reflected 0xEDB88320).
uint32_t ZipCrc32(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : data) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

class ArchiveCheck {
 public:
  ArchiveCheck(const std::string& path, ZipDirectory& out) : file_(path), path_(path), out_(out) {}
  // An archive embedded in `region` of its file.
  ArchiveCheck(const FileRegion& region, ZipDirectory& out)
      : file_(region.path), name_(region.Name()), path_(name_), out_(out), region_(&region) {}
  ~ArchiveCheck() {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Run() {
    fd_ = ::open(file_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      const std::string what = absl::StrCat("cannot open it: ", std::strerror(err));
      return err == ENOENT ? absl::NotFoundError(Message(what)) : Bad(what);
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Bad(absl::StrCat("cannot stat it: ", std::strerror(errno)));
    size_ = static_cast<uint64_t>(st.st_size);
    if (region_ != nullptr) {
      if (region_->offset > size_ || region_->length > size_ - region_->offset) {
        return Bad(absl::StrCat("the region lies beyond the end of the ", size_, "-byte file"));
      }
      base_ = region_->offset;
      size_ = region_->length;
      out_.base = base_;
      out_.whole_file = false;
    }
    out_.file_bytes = size_;

    absl::Status status = ReadEndRecords();
    if (!status.ok()) return status;
    std::vector<ZipEntry>& entries = out_.entries;
    status = ReadCentralDirectory(entries);
    if (!status.ok()) return status;
    if (entries.empty()) return Bad("the zip holds no records");
    const std::string& first = entries.front().name;
    const size_t slash = first.find('/');
    if (slash == std::string::npos) {
      return Bad(absl::StrCat("its first record '", absl::CEscape(first),
                              "' is not inside a folder (PyTorch archives hold "
                              "'<folder>/data.pkl', '<folder>/version', ...)"));
    }
    const std::string folder = first.substr(0, slash + 1);
    out_.folder = folder;
    // LibTorch 2.x's reader also reads ".data/serialization_id", when there
    // is one, in its constructor (and leaks miniz's state when that throws).
    for (const ZipEntry* e : Find(entries, folder + ".data/serialization_id")) {
      std::string contents;
      status = ReadSmallRecord(
          *e, absl::StrCat("serialization id record '", absl::CEscape(e->name), "'"),
          kMaxSerializationIdBytes, contents);
      if (!status.ok()) return status;
    }
    // The reader takes ".data/version" when there is one, else "version";
    // it finds names case-insensitively (miniz's sorted lookup).
    for (const char* record : {".data/version", "version"}) {
      std::vector<const ZipEntry*> found = Find(entries, folder + record);
      if (found.empty()) continue;
      for (const ZipEntry* e : found) {
        status = CheckVersionRecord(*e);
        if (!status.ok()) return status;
      }
      return absl::OkStatus();
    }
    return Bad(absl::StrCat("it has no version record ('", absl::CEscape(folder),
                            ".data/version' or '", absl::CEscape(folder), "version')"));
  }

 private:
  std::string Message(absl::string_view what) const {
    return absl::StrCat(path_, ": not a readable PyTorch archive: ", what);
  }
  absl::Status Bad(absl::string_view what) const { return absl::DataLossError(Message(what)); }

  // `size` bytes at `offset`, which must lie inside the file.
  absl::Status ReadAt(uint64_t offset, uint64_t size, std::string& out, absl::string_view what) {
    if (offset > size_ || size > size_ - offset) {
      return Bad(absl::StrCat("its ", what, " (", size, " bytes at offset ", offset,
                              ") lies beyond the end of the ", size_, "-byte file"));
    }
    out.resize(static_cast<size_t>(size));
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n =
          ::pread(fd_, &out[done], out.size() - done, static_cast<off_t>(base_ + offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return Bad(absl::StrCat("cannot read its ", what, ": ",
                                n < 0 ? std::strerror(errno) : "unexpected end"));
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  // The end of central directory record (the last one in the final 64 KiB +
  // 22 bytes: it may be followed by a comment), and the ZIP64 end record
  // when its locator precedes it.
  absl::Status ReadEndRecords() {
    if (size_ < kZipEndSize)
      return Bad(absl::StrCat("it is ", size_, " bytes, too short for a zip"));
    const uint64_t tail_size = std::min<uint64_t>(size_, kZipEndSize + kMaxCommentSize);
    std::string tail;
    absl::Status status = ReadAt(size_ - tail_size, tail_size, tail, "end of central directory");
    if (!status.ok()) return status;
    size_t at = tail.size() - kZipEndSize + 1;
    bool found = false;
    while (at-- > 0) {
      if (Le32(&tail[at]) == kZipEndSignature) {
        found = true;
        break;
      }
    }
    if (!found) return Bad("no end of central directory record (not a zip, or truncated)");
    const uint64_t end_offset = size_ - tail_size + at;
    const char* end = &tail[at];
    if (Le16(end + 4) != 0 || Le16(end + 6) != 0 || Le16(end + 8) != Le16(end + 10)) {
      return Bad("it spans several disks");
    }
    entries_ = Le16(end + 10);
    cd_size_ = Le32(end + 12);
    cd_offset_ = Le32(end + 16);
    if (end_offset >= kZip64LocatorSize) {
      std::string locator;
      status =
          ReadAt(end_offset - kZip64LocatorSize, kZip64LocatorSize, locator, "ZIP64 end locator");
      if (!status.ok()) return status;
      if (Le32(locator.data()) == kZip64LocatorSignature) {
        std::string end64;
        status = ReadAt(Le64(locator.data() + 8), kZip64EndSize, end64,
                        "ZIP64 end of central directory");
        if (!status.ok()) return status;
        if (Le32(end64.data()) != kZip64EndSignature) {
          return Bad("its ZIP64 end locator points at no ZIP64 end record");
        }
        if (Le32(end64.data() + 16) != 0 || Le32(end64.data() + 20) != 0 ||
            Le64(end64.data() + 24) != Le64(end64.data() + 32)) {
          return Bad("it spans several disks");
        }
        entries_ = Le64(end64.data() + 32);
        cd_size_ = Le64(end64.data() + 40);
        cd_offset_ = Le64(end64.data() + 48);
      }
    }
    if (cd_offset_ > end_offset || cd_size_ > end_offset - cd_offset_) {
      return Bad(absl::StrCat("its central directory (", cd_size_, " bytes at offset ", cd_offset_,
                              ") overlaps its end records at ", end_offset));
    }
    if (entries_ > cd_size_ / kZipCentralHeaderSize) {
      return Bad(absl::StrCat("it claims ", entries_, " records in a ", cd_size_,
                              "-byte central directory"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadCentralDirectory(std::vector<ZipEntry>& entries) {
    std::string cd;
    absl::Status status = ReadAt(cd_offset_, cd_size_, cd, "central directory");
    if (!status.ok()) return status;
    size_t at = 0;
    for (uint64_t i = 0; i < entries_; ++i) {
      const std::string where = absl::StrCat("central directory record ", i);
      if (cd.size() - at < kZipCentralHeaderSize || Le32(&cd[at]) != kZipCentralHeaderSignature) {
        return Bad(absl::StrCat(where, " is missing or damaged"));
      }
      const char* h = &cd[at];
      ZipEntry e;
      e.flags = Le16(h + 8);
      e.method = Le16(h + 10);
      e.crc32 = Le32(h + 16);
      e.compressed = Le32(h + 20);
      e.uncompressed = Le32(h + 24);
      e.local_header = Le32(h + 42);
      e.external_attributes = Le32(h + 38);
      const size_t name_size = Le16(h + 28);
      const size_t extra_size = Le16(h + 30);
      const size_t comment_size = Le16(h + 32);
      const size_t record_size = kZipCentralHeaderSize + name_size + extra_size + comment_size;
      if (cd.size() - at < record_size) return Bad(absl::StrCat(where, " is truncated"));
      e.name.assign(h + kZipCentralHeaderSize, name_size);
      status = ApplyZip64Extra(absl::string_view(h + kZipCentralHeaderSize + name_size, extra_size),
                               Le16(h + 34), where, e);
      if (!status.ok()) return status;
      // miniz extracts a directory as nothing, leaving the reader's buffer
      // uninitialised: a record with bytes must not be marked as one.
      if (IsDirectory(e) && (e.compressed != 0 || e.uncompressed != 0)) {
        return Bad(absl::StrCat(where, " ('", absl::CEscape(e.name), "') holds ", e.uncompressed,
                                " bytes but is marked as a directory"));
      }
      // miniz (and so LibTorch's reader) extracts stored and deflated records
      // only; another method's sizes are claims nothing can check (a
      // method-33 data.pkl claiming 2.5 GB in a 1.4 KB file was allocated
      // before anything noticed: found by the torch_file fuzzer).
      if (e.method != kZipStored && e.method != kZipDeflated) {
        return Bad(absl::StrCat(where, " ('", absl::CEscape(e.name), "') uses compression method ",
                                e.method,
                                ": expected 0 (stored) or 8 (deflated), the only ones "
                                "PyTorch's reader extracts"));
      }
      // Deflate expands at most ~1032:1, and LibTorch's getRecord allocates
      // the claimed size before inflating: a record claiming more would make
      // a tiny file allocate gigabytes, then fail to inflate anyway.
      if (e.method == kZipDeflated && e.uncompressed / kMaxDeflateRatio > e.compressed + 1) {
        return Bad(absl::StrCat(where, " ('", absl::CEscape(e.name), "') claims ", e.uncompressed,
                                " bytes from ", e.compressed,
                                " deflated bytes, more than deflate can expand to"));
      }
      // Every size must fit in the file before anything is allocated from
      // it (a reader allocates a stored record's size before reading it).
      // The local header's name and extra field are not counted: they are
      // only read when the record is.
      if (e.local_header > size_ || kZipLocalHeaderSize > size_ - e.local_header ||
          e.compressed > size_ - e.local_header - kZipLocalHeaderSize) {
        return Bad(absl::StrCat(where, " ('", absl::CEscape(e.name), "') declares ", e.compressed,
                                " bytes at offset ", e.local_header, ", past the end of the ",
                                size_, "-byte file"));
      }
      // The same for a stored record that claims more bytes than it stores
      // (2.x's getRecord allocates the claim first: a bit flip in a size
      // asked for 2 GiB; found by the torch_file fuzzer).
      if (e.method == kZipStored && e.compressed != e.uncompressed) {
        return Bad(absl::StrCat(where, " ('", absl::CEscape(e.name), "') is stored but records ",
                                e.compressed, " bytes compressed and ", e.uncompressed,
                                " uncompressed"));
      }
      entries.push_back(std::move(e));
      at += record_size;
    }
    return absl::OkStatus();
  }

  // Sizes and offsets that do not fit 32 bits are 0xFFFFFFFF in the record
  // and follow, in this order, in its ZIP64 extra field (id 1).
  absl::Status ApplyZip64Extra(absl::string_view extra, uint16_t disk, const std::string& where,
                               ZipEntry& e) {
    const bool need = e.uncompressed == kZip64Marker || e.compressed == kZip64Marker ||
                      e.local_header == kZip64Marker || disk == 0xFFFF;
    if (!need) return absl::OkStatus();
    while (extra.size() >= 4) {
      const uint16_t id = Le16(extra.data());
      const size_t size = Le16(extra.data() + 2);
      if (extra.size() - 4 < size) break;
      absl::string_view field = extra.substr(4, size);
      if (id == kZip64ExtraId) {
        for (uint64_t* value : {&e.uncompressed, &e.compressed, &e.local_header}) {
          if (*value != kZip64Marker) continue;
          if (field.size() < 8) return Bad(absl::StrCat(where, ": its ZIP64 extra field is short"));
          *value = Le64(field.data());
          field.remove_prefix(8);
        }
        return absl::OkStatus();
      }
      extra.remove_prefix(4 + size);
    }
    return Bad(absl::StrCat(where, " lacks the ZIP64 extra field its sizes refer to"));
  }

  // Entries whose name equals `name` ignoring ASCII case, as miniz compares.
  static std::vector<const ZipEntry*> Find(const std::vector<ZipEntry>& entries,
                                           const std::string& name) {
    std::vector<const ZipEntry*> out;
    for (const ZipEntry& e : entries) {
      if (e.name.size() != name.size()) continue;
      bool same = true;
      for (size_t i = 0; i < name.size() && same; ++i) {
        same = std::tolower(static_cast<unsigned char>(e.name[i])) ==
               std::tolower(static_cast<unsigned char>(name[i]));
      }
      if (same) out.push_back(&e);
    }
    return out;
  }

  // Reads a small record as miniz would extract it (stored or deflated,
  // CRC-checked), refusing what it would refuse.
  absl::Status ReadSmallRecord(const ZipEntry& e, const std::string& what, uint64_t max_bytes,
                               std::string& contents) {
    if ((e.flags & kZipUnsupportedFlags) != 0) {
      return Bad(absl::StrCat("its ", what, " is encrypted or patch data (flags 0x",
                              absl::Hex(e.flags), ")"));
    }
    if (IsDirectory(e)) return Bad(absl::StrCat("its ", what, " is marked as a directory"));
    if (e.method != kZipStored && e.method != kZipDeflated) {
      return Bad(absl::StrCat("its ", what, " uses compression method ", e.method,
                              " (only stored and deflated records are read)"));
    }
    if (e.method == kZipStored && e.compressed != e.uncompressed) {
      return Bad(absl::StrCat("its ", what, " is stored but records ", e.compressed,
                              " bytes compressed and ", e.uncompressed, " uncompressed"));
    }
    if (e.uncompressed > max_bytes) {
      return Bad(absl::StrCat("its ", what, " is ", e.uncompressed, " bytes; expected at most ",
                              max_bytes));
    }
    std::string header;
    absl::Status status = ReadAt(e.local_header, kZipLocalHeaderSize, header,
                                 absl::StrCat("local header of the ", what));
    if (!status.ok()) return status;
    const std::optional<uint64_t> data_offset = ZipDataOffset(e, header.data());
    if (!data_offset.has_value()) {
      return Bad(absl::StrCat("the local header of its ", what, " is damaged"));
    }
    std::string stored;
    status = ReadAt(*data_offset, e.compressed, stored, what);
    if (!status.ok()) return status;
    if (e.method == kZipStored) {
      contents = std::move(stored);
    } else {
      contents.assign(static_cast<size_t>(e.uncompressed), '\0');
      const size_t n = contents.empty()
                           ? 0
                           : tinfl_decompress_mem_to_mem(&contents[0], contents.size(),
                                                         stored.data(), stored.size(), 0);
      if (n != contents.size()) {
        return Bad(absl::StrCat("its ", what, " does not inflate to its recorded ", e.uncompressed,
                                " bytes"));
      }
    }
    const uint32_t crc = ZipCrc32(contents);
    if (crc != e.crc32) {
      return Bad(absl::StrCat("its ", what, " fails its CRC-32 check (", absl::Hex(crc),
                              ", recorded ", absl::Hex(e.crc32), ")"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckVersionRecord(const ZipEntry& e) {
    const std::string what = absl::StrCat("version record '", absl::CEscape(e.name), "'");
    std::string contents;
    absl::Status status = ReadSmallRecord(e, what, kMaxVersionRecordBytes, contents);
    if (!status.ok()) return status;
    // What the reader does: std::stoull (strtoull: leading blanks, a sign,
    // digits, anything after them ignored), then a range check.
    const std::string text(contents.c_str());  // strtoull stops at a NUL
    errno = 0;
    char* end = nullptr;
    const unsigned long long version = std::strtoull(text.c_str(), &end, 10);
    if (end == text.c_str() || errno == ERANGE) {
      return Bad(absl::StrCat("its ", what, " holds '", absl::CEscape(contents.substr(0, 32)),
                              "', not a file format version"));
    }
    if (version < caffe2::serialize::kMinSupportedFileFormatVersion ||
        version > caffe2::serialize::kMaxSupportedFileFormatVersion) {
      return Bad(absl::StrCat("its file format version ", version, " is outside the ",
                              caffe2::serialize::kMinSupportedFileFormatVersion, "..",
                              caffe2::serialize::kMaxSupportedFileFormatVersion,
                              " this LibTorch reads"));
    }
    return absl::OkStatus();
  }

  const std::string file_;   // what is opened
  const std::string name_;   // a region's name
  const std::string& path_;  // what errors name
  ZipDirectory& out_;
  const FileRegion* region_ = nullptr;
  int fd_ = -1;
  uint64_t base_ = 0;  // the archive's first byte in the file
  uint64_t size_ = 0;  // the archive's size
  uint64_t entries_ = 0;
  uint64_t cd_size_ = 0;
  uint64_t cd_offset_ = 0;
};

}  // namespace

std::optional<uint64_t> ZipDataOffset(const ZipEntry& e, const char* local_header) {
  if (Le32(local_header) != kZipLocalHeaderSignature) return std::nullopt;
  // Name length at byte 26, extra field length at byte 28.
  return e.local_header + kZipLocalHeaderSize + Le16(local_header + 26) + Le16(local_header + 28);
}

DeclaredBytes DeclaredRecordBytes(const ZipDirectory& directory) {
  DeclaredBytes out;
  const std::string storages = directory.folder + "data/";
  for (const ZipEntry& e : directory.entries) {
    if (__builtin_add_overflow(out.total, e.uncompressed, &out.total)) out.total = UINT64_MAX;
    bool storage = e.name.size() > storages.size();
    for (size_t i = 0; i < storages.size() && storage; ++i) {
      storage = std::tolower(static_cast<unsigned char>(e.name[i])) ==
                std::tolower(static_cast<unsigned char>(storages[i]));
    }
    if (storage && __builtin_add_overflow(out.storages, e.uncompressed, &out.storages)) {
      out.storages = UINT64_MAX;
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ZipRecordReader>> ZipRecordReader::Open(
    const std::string& path, const ZipDirectory& directory, const std::string& name) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat("cannot open ", path, ": ", std::strerror(error)));
  }
  std::unique_ptr<ZipRecordReader> reader(
      new ZipRecordReader(name.empty() ? path : name, directory, fd));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat("cannot stat ", path, ": ", std::strerror(error)));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (directory.whole_file
          ? file_bytes != directory.file_bytes
          : file_bytes < directory.base || file_bytes - directory.base < directory.file_bytes) {
    return reader->Error(absl::StrCat("it changed while being read (", directory.file_bytes,
                                      " bytes, then ", st.st_size, ")"));
  }
  return reader;
}

ZipRecordReader::~ZipRecordReader() { ::close(fd_); }

absl::Status ZipRecordReader::Error(absl::string_view what) const {
  return absl::DataLossError(absl::StrCat(path_, ": cannot read PyTorch archive: ", what));
}

absl::Status ZipRecordReader::ReadAt(uint64_t offset, char* out, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pread(fd_, out + done, size - done, static_cast<off_t>(directory_.base + offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      return absl::Status(absl::ErrnoToStatusCode(error),
                          absl::StrCat("cannot read ", path_, ": ", std::strerror(error)));
    }
    if (n == 0) {
      return Error(absl::StrCat("it ends at byte ", offset + done, ", before the ", size - done,
                                " bytes expected there"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ZipRecordReader::DataOffset(const ZipEntry& e) {
  const uint64_t size = directory_.file_bytes;
  if (e.local_header > size || kZipLocalHeaderSize > size - e.local_header) {
    return Error(absl::StrCat("the local header of record '", absl::CEscape(e.name),
                              "' lies beyond the end of the ", size, "-byte file"));
  }
  char header[kZipLocalHeaderSize];
  absl::Status status = ReadAt(e.local_header, header, sizeof(header));
  if (!status.ok()) return status;
  const std::optional<uint64_t> offset = ZipDataOffset(e, header);
  if (!offset.has_value()) {
    return Error(
        absl::StrCat("the local header of record '", absl::CEscape(e.name), "' is damaged"));
  }
  const uint64_t data = *offset;
  if (data > size || e.compressed > size - data) {
    return Error(absl::StrCat("record '", absl::CEscape(e.name), "' (", e.compressed,
                              " bytes at offset ", data, ") runs past the end of the ", size,
                              "-byte file"));
  }
  return data;
}

absl::Status ZipRecordReader::ReadInto(const ZipEntry& e, char* out) {
  auto offset = DataOffset(e);
  if (!offset.ok()) return offset.status();
  if (e.method == kZipDeflated) return Inflate(e, *offset, out, nullptr);
  if (e.method != kZipStored || e.compressed != e.uncompressed) {
    return Error(absl::StrCat("record '", absl::CEscape(e.name), "' uses compression method ",
                              e.method, " (only stored and deflated records are read)"));
  }
  return ReadAt(*offset, out, static_cast<size_t>(e.uncompressed));
}

absl::Status ZipRecordReader::ReadInPieces(const ZipEntry& e,
                                           const std::function<void(const char*, size_t)>& piece) {
  auto offset = DataOffset(e);
  if (!offset.ok()) return offset.status();
  if (e.method == kZipDeflated) return Inflate(e, *offset, nullptr, &piece);
  if (e.method != kZipStored || e.compressed != e.uncompressed) {
    return Error(absl::StrCat("record '", absl::CEscape(e.name), "' uses compression method ",
                              e.method, " (only stored and deflated records are read)"));
  }
  if (input_ == nullptr) input_.reset(new char[kPieceBytes]);
  for (uint64_t done = 0; done < e.compressed;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kPieceBytes, e.compressed - done));
    absl::Status status = ReadAt(*offset + done, input_.get(), n);
    if (!status.ok()) return status;
    piece(input_.get(), n);
    done += n;
  }
  return absl::OkStatus();
}

absl::Status ZipRecordReader::Inflate(const ZipEntry& e, uint64_t offset, char* out,
                                      const std::function<void(const char*, size_t)>* piece) {
  // miniz.h's values.
  constexpr uint32_t kHasMoreInput = 2;
  constexpr uint32_t kNonWrappingOutput = 4;
  constexpr int kDone = 0;
  constexpr int kNeedsMoreInput = 1;
  constexpr int kHasMoreOutput = 2;
  constexpr int kCannotMakeProgress = -4;  // input exhausted mid-stream
  const std::string name = absl::StrCat("record '", absl::CEscape(e.name), "'");
  const absl::Status too_long = Error(absl::StrCat(
      name, " inflates to more than the ", e.uncompressed, " bytes its directory entry declares"));
  std::unique_ptr<tinfl_decompressor_tag, void (*)(tinfl_decompressor_tag*)> inflater(
      tinfl_decompressor_alloc(), tinfl_decompressor_free);
  if (inflater == nullptr) return absl::ResourceExhaustedError("cannot allocate an inflater");
  if (input_ == nullptr) input_.reset(new char[kPieceBytes]);
  // Into `out`, exactly the declared size (inflating past it stops with
  // kHasMoreOutput); or through a window of kPieceBytes, which tinfl also
  // uses as its dictionary (a wrapping buffer: a power of two).
  std::unique_ptr<char[]> window;
  uint8_t empty = 0;  // `out` of a record that declares no bytes
  uint8_t* out_start = reinterpret_cast<uint8_t*>(out);
  size_t out_capacity = static_cast<size_t>(e.uncompressed);
  if (out == nullptr) {
    window.reset(new char[kPieceBytes]);
    out_start = reinterpret_cast<uint8_t*>(window.get());
    out_capacity = kPieceBytes;
  } else if (out_capacity == 0) {
    out_start = &empty;
  }
  uint64_t read = 0;      // compressed bytes read into input_ so far
  size_t in_at = 0;       // next unconsumed byte of input_
  size_t in_end = 0;      // valid bytes of input_
  uint64_t produced = 0;  // uncompressed bytes so far
  size_t out_at = 0;      // where the next bytes go, from out_start
  while (true) {
    if (in_at == in_end && read < e.compressed) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kPieceBytes, e.compressed - read));
      absl::Status status = ReadAt(offset + read, input_.get(), n);
      if (!status.ok()) return status;
      read += n;
      in_at = 0;
      in_end = n;
    }
    size_t in_size = in_end - in_at;
    size_t out_size = out_capacity - out_at;
    const uint32_t flags =
        (read < e.compressed ? kHasMoreInput : 0) | (out == nullptr ? 0 : kNonWrappingOutput);
    const int status =
        tinfl_decompress(inflater.get(), reinterpret_cast<const uint8_t*>(input_.get()) + in_at,
                         &in_size, out_start, out_start + out_at, &out_size, flags);
    in_at += in_size;
    if (out == nullptr) {
      // Only the declared bytes are handed on.
      if (out_size > e.uncompressed - produced) return too_long;
      if (out_size > 0) (*piece)(reinterpret_cast<const char*>(out_start) + out_at, out_size);
      out_at = (out_at + out_size) & (kPieceBytes - 1);
    } else {
      if (status == kHasMoreOutput) return too_long;
      out_at += out_size;
    }
    produced += out_size;
    if (status == kDone) {
      if (produced != e.uncompressed) {
        return Error(absl::StrCat(name, " inflates to ", produced,
                                  " bytes; its directory entry declares ", e.uncompressed));
      }
      return absl::OkStatus();
    }
    if (status == kCannotMakeProgress ||
        (status == kNeedsMoreInput && read == e.compressed && in_at == in_end)) {
      return Error(absl::StrCat(name, ": its ", e.compressed, " deflated bytes end after ",
                                produced, " of its declared ", e.uncompressed,
                                " bytes, before the deflate stream does"));
    }
    if ((status != kNeedsMoreInput && status != kHasMoreOutput) ||
        (in_size == 0 && out_size == 0 && in_at < in_end)) {
      return Error(absl::StrCat(name, " is not valid deflate data (inflater status ", status,
                                " after ", produced, " bytes)"));
    }
  }
}

absl::Status PrecheckTorchArchive(const std::string& path) {
  return ReadTorchArchiveDirectory(path).status();
}

absl::StatusOr<ZipDirectory> ReadTorchArchiveDirectory(const std::string& path) {
  ZipDirectory directory;
  absl::Status status = ArchiveCheck(path, directory).Run();
  if (!status.ok()) return status;
  return directory;
}

std::string FileRegion::Name() const {
  return absl::StrCat(path, " (bytes ", offset, "..", offset + length, ")");
}

absl::StatusOr<ZipDirectory> ReadTorchArchiveDirectory(const FileRegion& region) {
  ZipDirectory directory;
  absl::Status status = ArchiveCheck(region, directory).Run();
  if (!status.ok()) return status;
  return directory;
}

}  // namespace formats
