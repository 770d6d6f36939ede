#include "formats/torch_save/torch_archive_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <caffe2/serialize/inline_container.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "formats/io/crc32c.h"
#include "formats/pickle/pickle_vm.h"
#include "formats/zip/zip_precheck.h"

namespace formats {
namespace {

absl::Status ArchiveError(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(path, ": cannot read PyTorch archive: ", what));
}

absl::Status CaughtArchiveError(const std::string& path, const c10::Error& e) {
  // PyTorchStreamReader reports a damaged zip (bad header, short file,
  // a deflated record that does not inflate) by throwing.
  return absl::DataLossError(absl::StrCat(
      path,
      ": not a readable PyTorch archive (truncated or corrupted?): ", e.what_without_backtrace()));
}

at::Storage UntypedStorage(size_t nbytes, at::DataPtr data) {
  return at::Storage(at::Storage::use_byte_size_t(), nbytes, std::move(data),
                     /*allocator=*/nullptr, /*resizable=*/false);
}

// miniz, and so LibTorch's reader, finds record names ignoring ASCII case.
std::string AsciiLower(std::string s) {
  for (char& c : s) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

// Whether `t`'s elements in order are exactly its storage's bytes (what
// every tensor a PyTorch writer saves is): its checksum is then its
// record's.
bool IsWholeStorage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_contiguous() && t.nbytes() == t.storage().nbytes();
}

// A private (copy-on-write) mapping of a whole file, shared by the storages
// that point into it and unmapped with the last of them. Loaded tensors use
// the file's page-cache pages until they are written: a load reads the file
// as a verify does (through a fixed buffer, into the page cache) and maps
// it, instead of also copying every byte into fresh memory, which cost as
// much again as the disk read (issue #16); a later copy into a model's
// parameters reads the page cache directly. The checksum is taken from the
// reads, not by touching the mapping: faulting a file mapping in sequentially
// fills the page cache one 4 KiB page at a time, where read() fills it with
// large folios, and measured 2x slower here.
class FileMapping {
 public:
  // nullptr when the file system cannot map the file (the caller reads it).
  static std::shared_ptr<FileMapping> Map(int fd, uint64_t bytes) {
    if (bytes == 0) return nullptr;
    void* data =
        ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) return nullptr;
    return std::shared_ptr<FileMapping>(new FileMapping(static_cast<char*>(data), bytes));
  }
  ~FileMapping() { ::munmap(data_, static_cast<size_t>(bytes_)); }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  // The data pointer of a storage of the bytes at `offset`; it keeps the
  // mapping alive.
  static at::DataPtr Share(const std::shared_ptr<FileMapping>& mapping, uint64_t offset) {
    return at::DataPtr(
        mapping->data_ + offset, new std::shared_ptr<FileMapping>(mapping),
        [](void* owner) { delete static_cast<std::shared_ptr<FileMapping>*>(owner); },
        at::Device(at::kCPU));
  }

 private:
  FileMapping(char* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  char* data_;
  uint64_t bytes_;
};

// Reads and checksums the storage records in pieces of this size: each piece
// is checksummed right after it is read, while it is in the CPU's cache.
constexpr size_t kChunkBytes = ZipRecordReader::kPieceBytes;

// An archive's records as LibTorch's reader finds them by name (in the
// archive's folder, ignoring ASCII case, as miniz does), read by
// ZipRecordReader: into memory of exactly the size the record's entry
// declares, which the zip precheck has bounded by the file's size (stored)
// or deflate's expansion of it (deflated), stored bytes read and deflated
// ones inflated straight into it. Only a name that several entries match
// (they differ in case) is left to LibTorch's reader, which picks one as
// miniz does; its getRecord also allocates just the declared size.
class ArchiveRecords {
 public:
  static constexpr int64_t kMissing = -1;
  static constexpr int64_t kAmbiguous = -2;

  // The archive `directory` describes in the file `path`; errors name `name`
  // (the path, or an embedded archive's region).
  ArchiveRecords(const std::string& path, const std::string& name, const ZipDirectory& directory,
                 caffe2::serialize::PyTorchStreamReader& reader)
      : file_(path), path_(name), directory_(directory), reader_(reader) {
    for (size_t i = 0; i < directory_.entries.size(); ++i) {
      auto inserted =
          entry_by_name_.emplace(AsciiLower(directory_.entries[i].name), static_cast<int64_t>(i));
      if (!inserted.second) inserted.first->second = kAmbiguous;
    }
  }

  absl::Status Open() {
    auto zip = ZipRecordReader::Open(file_, directory_, path_);
    if (!zip.ok()) return zip.status();
    zip_ = *std::move(zip);
    return absl::OkStatus();
  }

  ZipRecordReader& zip() { return *zip_; }
  caffe2::serialize::PyTorchStreamReader& reader() { return reader_; }
  const ZipEntry& Entry(int64_t i) const { return directory_.entries[static_cast<size_t>(i)]; }

  // The entry of `record` ("data.pkl", "data/0"), kMissing or kAmbiguous.
  int64_t Find(const std::string& record) const {
    auto found = entry_by_name_.find(AsciiLower(directory_.folder + record));
    return found == entry_by_name_.end() ? kMissing : found->second;
  }

  // The whole record in fresh memory.
  absl::StatusOr<std::pair<at::DataPtr, size_t>> ReadWhole(const std::string& record) {
    const int64_t i = Find(record);
    if (i == kMissing) return ArchiveError(path_, absl::StrCat("record ", record, " is missing"));
    if (i == kAmbiguous) {
      auto [ptr, size] = reader_.getRecord(record);
      return std::make_pair(std::move(ptr), size);
    }
    const ZipEntry& e = Entry(i);
    const size_t size = static_cast<size_t>(e.uncompressed);
    at::DataPtr ptr = c10::GetCPUAllocator()->allocate(size);
    absl::Status status = ReadEntry(e, static_cast<char*>(ptr.get()));
    if (!status.ok()) return status;
    return std::make_pair(std::move(ptr), size);
  }

  // data.pkl, read into the string the VM runs (no second copy).
  absl::StatusOr<std::string> ReadPickle() {
    const std::string name = "data.pkl";
    const int64_t i = Find(name);
    if (i < 0) {
      auto whole = ReadWhole(name);
      if (!whole.ok()) return whole.status();
      return std::string(static_cast<const char*>(whole->first.get()), whole->second);
    }
    std::string pickle(static_cast<size_t>(Entry(i).uncompressed), '\0');
    absl::Status status = ReadEntry(Entry(i), pickle.data());
    if (!status.ok()) return status;
    return pickle;
  }

  // `e`'s bytes into `out` (e.uncompressed of them), refusing what miniz
  // refuses to extract.
  absl::Status ReadEntry(const ZipEntry& e, char* out) {
    absl::Status status = Extractable(e);
    return status.ok() ? zip_->ReadInto(e, out) : status;
  }
  absl::Status ReadEntryInPieces(const ZipEntry& e,
                                 const std::function<void(const char*, size_t)>& piece) {
    absl::Status status = Extractable(e);
    return status.ok() ? zip_->ReadInPieces(e, piece) : status;
  }

 private:
  absl::Status Extractable(const ZipEntry& e) const {
    if ((e.flags & kZipUnsupportedFlags) != 0) {
      return ArchiveError(
          path_, absl::StrCat("record '", absl::CEscape(e.name),
                              "' is encrypted or patch data (flags 0x", absl::Hex(e.flags), ")"));
    }
    return absl::OkStatus();
  }

  const std::string& file_;
  const std::string& path_;
  const ZipDirectory& directory_;
  caffe2::serialize::PyTorchStreamReader& reader_;
  std::unordered_map<std::string, int64_t> entry_by_name_;  // lower-case name -> entry
  std::unique_ptr<ZipRecordReader> zip_;
};

// Reads a PyTorch archive in one sequential pass for ReadTorchArchiveInOnePass:
// the pickle first (small, near the end), whose storages are placeholders of
// their records' sizes; then the file from its first byte to its last, each
// stored storage record read once, becoming its storage (through the file's
// mapping, see FileMapping) or through a fixed buffer when only checksummed,
// checksummed on the fly, the bytes
// between records (zip headers, data.pkl, the central directory) read and
// checksummed too, and the whole file's CRC-32C assembled from the pieces'
// with Crc32cCombine. Records this pass cannot read directly (deflated ones,
// as Python's zipfile rewrites an archive; ones sharing bytes with another)
// are read afterwards (ArchiveRecords: inflated into their storage, or
// through fixed buffers when only checksummed), as are names that differ
// only in case (LibTorch's reader); their compressed bytes are covered by the
// pass like any other. No zip CRC-32 is checked, as LibTorch's reader checks
// none either (its miniz is built without those checks: a flipped byte in a
// stored record loads silently, here and in Python's torch.load).
//
// Every offset and size comes from the file: each is checked against the
// file's size before anything is allocated or read.
class OnePassReader {
 public:
  OnePassReader(const std::string& path, const ZipDirectory& directory,
                caffe2::serialize::PyTorchStreamReader& reader, TensorData data)
      : path_(path), records_(path, path, directory, reader), data_(data) {}
  OnePassReader(const OnePassReader&) = delete;
  OnePassReader& operator=(const OnePassReader&) = delete;

  absl::Status Open() {
    absl::Status status = records_.Open();
    if (!status.ok()) return status;
    size_ = records_.zip().file_bytes();
    ::posix_fadvise(records_.zip().fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ReadPickle() { return records_.ReadPickle(); }

  // The VM's storage loader: a storage of the record's size whose data the
  // pass fills in later (the same storage for every key naming the record).
  absl::StatusOr<at::Storage> Storage(const std::string& record) {
    const std::string key = AsciiLower(record);
    auto found = slots_.find(key);
    if (found != slots_.end()) return found->second.storage;
    const int64_t i = records_.Find(record);
    if (i == ArchiveRecords::kMissing) {
      return ArchiveError(path_, absl::StrCat("record ", record, " is missing"));
    }
    Slot slot;
    slot.record = record;
    if (i == ArchiveRecords::kAmbiguous) {
      // No single directory entry of this name (several, ignoring case):
      // the one LibTorch's reader picks, read now (and kept in either mode).
      at::DataPtr ptr;
      size_t size = 0;
      std::tie(ptr, size) = records_.reader().getRecord(record);
      slot.crc = Crc32c(ptr.get(), size);
      slot.storage = UntypedStorage(size, std::move(ptr));
      slot.done = true;
    } else {
      slot.entry = i;
      slot.direct = Direct(records_.Entry(i));
      slot.storage = UntypedStorage(static_cast<size_t>(records_.Entry(i).uncompressed),
                                    at::DataPtr(nullptr, at::Device(at::kCPU)));
    }
    Slot& kept = slots_.emplace(key, std::move(slot)).first->second;
    by_storage_[kept.storage.unsafeGetStorageImpl()] = &kept;
    return kept.storage;
  }

  // When only checksumming: keep the data of this storage too.
  void Keep(const c10::StorageImpl* storage) {
    auto found = by_storage_.find(storage);
    if (found != by_storage_.end()) found->second->keep = true;
  }

  // The pass over the whole file, then the records it could not read.
  absl::Status ReadRecords() {
    std::vector<Slot*> direct;
    for (auto& entry : slots_) {
      if (!entry.second.done && entry.second.direct) direct.push_back(&entry.second);
    }
    std::sort(direct.begin(), direct.end(), [&](const Slot* a, const Slot* b) {
      return records_.Entry(a->entry).local_header < records_.Entry(b->entry).local_header;
    });
    uint64_t at = 0;  // everything before `at` is checksummed into `crc`
    uint32_t crc = 0;
    for (Slot* slot : direct) {
      const ZipEntry& e = records_.Entry(slot->entry);
      if (e.local_header < at) continue;         // shares bytes with an earlier record: read below
      auto data = records_.zip().DataOffset(e);  // checks the record lies inside the file
      if (!data.ok()) return data.status();
      // The bytes since the last record, then its local header, name and
      // extra field.
      absl::Status status = Skim(at, *data, crc);
      if (!status.ok()) return status;
      status = ReadData(*slot, *data, e.compressed);
      if (!status.ok()) return status;
      crc = Crc32cCombine(crc, slot->crc, e.compressed);
      at = *data + e.compressed;
    }
    absl::Status status = Skim(at, size_, crc);
    if (!status.ok()) return status;
    crc32c_ = crc;
    for (auto& entry : slots_) {
      Slot& slot = entry.second;
      if (slot.done) continue;
      const ZipEntry& e = records_.Entry(slot.entry);
      uint32_t record_crc = 0;
      if (KeepsData(slot)) {
        at::DataPtr ptr = c10::GetCPUAllocator()->allocate(static_cast<size_t>(e.uncompressed));
        status = records_.ReadEntry(e, static_cast<char*>(ptr.get()));
        if (!status.ok()) return status;
        record_crc = Crc32c(ptr.get(), static_cast<size_t>(e.uncompressed));
        slot.storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(ptr));
      } else {
        status = records_.ReadEntryInPieces(
            e, [&](const char* piece, size_t n) { record_crc = Crc32c(piece, n, record_crc); });
        if (!status.ok()) return status;
      }
      slot.crc = record_crc;
      slot.done = true;
    }
    return absl::OkStatus();
  }

  uint64_t bytes() const { return size_; }
  uint32_t crc32c() const { return crc32c_; }
  RecordCrcs record_crc32c() const {
    RecordCrcs out;
    for (const auto& entry : slots_) {
      out[entry.second.storage.unsafeGetStorageImpl()] = entry.second.crc;
    }
    return out;
  }

 private:
  struct Slot {
    std::string record;   // "data/<key>"
    int64_t entry = -1;   // its directory entry (none: read by LibTorch's reader)
    bool direct = false;  // read by the pass itself
    at::Storage storage;
    bool keep = false;  // keep the data when only checksumming
    bool done = false;  // read, and `crc` known
    uint32_t crc = 0;   // CRC-32C of the record's (uncompressed) bytes
  };

  // Records the pass reads: stored (no compression), of consistent sizes, of
  // no flags miniz refuses.
  static bool Direct(const ZipEntry& e) {
    return e.method == kZipStored && e.compressed == e.uncompressed &&
           (e.flags & kZipUnsupportedFlags) == 0;
  }

  bool KeepsData(const Slot& slot) const { return data_ == TensorData::kRead || slot.keep; }

  // The whole file mapped, once, for a load; nullptr when it cannot be, and
  // when only checksumming (the few records kept then are read into fresh
  // memory, so a verify touches one fixed buffer and maps nothing).
  FileMapping* Mapping() {
    if (!mapping_tried_ && data_ == TensorData::kRead) {
      mapping_tried_ = true;
      mapping_ = FileMapping::Map(records_.zip().fd(), size_);
    }
    return mapping_.get();
  }

  char* Buffer() {
    if (buffer_ == nullptr) buffer_.reset(new char[kChunkBytes]);
    return buffer_.get();
  }

  // Checksums bytes [from, to) into `crc` through the fixed buffer.
  absl::Status Skim(uint64_t from, uint64_t to, uint32_t& crc) {
    while (from < to) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, to - from));
      absl::Status status = records_.zip().ReadAt(from, Buffer(), n);
      if (!status.ok()) return status;
      crc = Crc32c(Buffer(), n, crc);
      from += n;
    }
    return absl::OkStatus();
  }

  // The record's `size` bytes at `offset` (inside the file), checksummed:
  // through the fixed buffer, its storage then the mapping's view of them
  // (or nothing, when only checksummed); into a new buffer that becomes its
  // storage's data where the file could not be mapped.
  absl::Status ReadData(Slot& slot, uint64_t offset, uint64_t size) {
    uint32_t crc = 0;
    at::DataPtr ptr;
    char* out = nullptr;
    // Mapped: the bytes are read (into the page cache, and through the fixed
    // buffer to checksum them) and the storage is the mapping's view of them.
    const bool mapped = KeepsData(slot) && size > 0 && Mapping() != nullptr;
    if (KeepsData(slot) && !mapped) {
      ptr = c10::GetCPUAllocator()->allocate(static_cast<size_t>(size));
      out = static_cast<char*>(ptr.get());
    }
    for (uint64_t done = 0; done < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - done));
      char* piece = out != nullptr ? out + done : Buffer();
      absl::Status status = records_.zip().ReadAt(offset + done, piece, n);
      if (!status.ok()) return status;
      crc = Crc32c(piece, n, crc);
      done += n;
    }
    if (mapped) ptr = FileMapping::Share(mapping_, offset);
    if (KeepsData(slot)) slot.storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(ptr));
    slot.crc = crc;
    slot.done = true;
    return absl::OkStatus();
  }

  const std::string& path_;
  ArchiveRecords records_;
  const TensorData data_;
  std::map<std::string, Slot> slots_;  // by lower-case record name
  std::unordered_map<const c10::StorageImpl*, Slot*> by_storage_;
  uint64_t size_ = 0;
  uint32_t crc32c_ = 0;
  std::unique_ptr<char[]> buffer_;
  std::shared_ptr<FileMapping> mapping_;
  bool mapping_tried_ = false;
};

absl::Status CheckBudget(const std::string& path, const ZipDirectory& directory,
                         uint64_t max_bytes) {
  if (max_bytes == 0) return absl::OkStatus();
  const DeclaredBytes declared = DeclaredRecordBytes(directory);
  if (declared.total <= max_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(path, ": its records declare ", declared.total, " bytes (", declared.storages,
                   " of them tensor storages), more than the load's budget of ", max_bytes,
                   " bytes (max_bytes); refused before reading any of them"));
}

// LibTorch's reader over an archive embedded in a region of a file.
class RegionReadAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  RegionReadAdapter(int fd, uint64_t base, uint64_t size) : fd_(fd), base_(base), size_(size) {}
  ~RegionReadAdapter() override { ::close(fd_); }
  size_t size() const override { return static_cast<size_t>(size_); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, static_cast<char*>(buf) + done, n - done,
                                  static_cast<off_t>(base_ + pos + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

 private:
  int fd_;
  uint64_t base_;
  uint64_t size_;
};

// ReadTorchArchive of the archive `directory` describes in the file `path`;
// errors name `name`.
absl::StatusOr<UnpickledArchive> ReadArchive(const std::string& path, const std::string& name,
                                             const ZipDirectory& directory,
                                             const ArchiveLimits& limits) {
  absl::Status status = CheckBudget(name, directory, limits.max_bytes);
  if (!status.ok()) return status;
  try {
    // LibTorch's reader validates the zip as for any load (cheaply: the end
    // records, the central directory and the version record) and finds the
    // records whose names several entries match.
    std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
    if (directory.whole_file) {
      reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    } else {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        return absl::NotFoundError(absl::StrCat("cannot open ", name, ": ", std::strerror(errno)));
      reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
          std::make_shared<RegionReadAdapter>(fd, directory.base, directory.file_bytes));
    }
    if (!reader->hasRecord("data.pkl")) {
      return absl::DataLossError(absl::StrCat(name, ": no data.pkl record"));
    }
    ArchiveRecords records(path, name, directory, *reader);
    status = records.Open();
    if (!status.ok()) return status;
    auto pickle = records.ReadPickle();
    if (!pickle.ok()) return pickle.status();
    // One storage per record, however many keys name it (they may differ in
    // case): memory stays within what the records declare.
    std::unordered_map<std::string, at::Storage> storages;
    auto load_storage = [&](const std::string& record) -> absl::StatusOr<at::Storage> {
      const std::string key = AsciiLower(record);
      auto found = storages.find(key);
      if (found != storages.end()) return found->second;
      auto whole = records.ReadWhole(record);
      if (!whole.ok()) return whole.status();
      at::Storage storage = UntypedStorage(whole->second, std::move(whole->first));
      storages.emplace(key, storage);
      return storage;
    };
    return UnpickleArchive(name, *pickle, load_storage);
  } catch (const c10::Error& e) {
    return CaughtArchiveError(name, e);
  }
}

}  // namespace

absl::StatusOr<UnpickledArchive> ReadTorchArchive(const std::string& path,
                                                  const ArchiveLimits& limits) {
  // The reader's constructor leaks miniz's state when it throws after opening
  // the zip; the precheck refuses every archive it would throw on there, and
  // gives the directory the records are read by.
  auto directory = ReadTorchArchiveDirectory(path);
  if (!directory.ok()) return directory.status();
  return ReadArchive(path, path, *directory, limits);
}

absl::StatusOr<UnpickledArchive> ReadTorchArchive(const FileRegion& region,
                                                  const ArchiveLimits& limits) {
  auto directory = ReadTorchArchiveDirectory(region);
  if (!directory.ok()) return directory.status();
  return ReadArchive(region.path, region.Name(), *directory, limits);
}

absl::StatusOr<ChecksummedArchive> ReadTorchArchiveInOnePass(const std::string& path,
                                                             TensorData data,
                                                             const std::set<std::string>& keep) {
  // The precheck (as ReadTorchArchive), which also gives the directory.
  auto directory = ReadTorchArchiveDirectory(path);
  if (!directory.ok()) return directory.status();
  try {
    // LibTorch's reader still opens the archive: it validates the zip as for
    // any load (cheaply: the end records, the central directory and the
    // version record), and finds the records whose names several entries
    // match.
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (!reader.hasRecord("data.pkl")) {
      return absl::DataLossError(absl::StrCat(path, ": no data.pkl record"));
    }
    OnePassReader records(path, *directory, reader, data);
    absl::Status status = records.Open();
    if (!status.ok()) return status;
    auto pickle = records.ReadPickle();
    if (!pickle.ok()) return pickle.status();
    auto archive = UnpickleArchive(
        path, *pickle, [&](const std::string& record) { return records.Storage(record); });
    if (!archive.ok()) return archive.status();
    // Only checksumming, data is still kept for the tensors `keep` names and
    // for tensors that are not exactly their storage's bytes (never written
    // by PyTorch's savers; their checksum needs their data), of the
    // top-level dict.
    if (data == TensorData::kChecksumOnly && archive->value.isGenericDict()) {
      for (const auto& entry : archive->value.toGenericDict()) {
        if (!entry.value().isTensor()) continue;
        const at::Tensor& t = entry.value().toTensor();
        const bool named = entry.key().isString() && keep.count(entry.key().toStringRef()) > 0;
        if (named || !IsWholeStorage(t)) records.Keep(t.storage().unsafeGetStorageImpl());
      }
    }
    status = records.ReadRecords();
    if (!status.ok()) return status;
    ChecksummedArchive out;
    out.archive = *std::move(archive);
    out.bytes = records.bytes();
    out.crc32c = records.crc32c();
    out.record_crc32c = records.record_crc32c();
    return out;
  } catch (const c10::Error& e) {
    return CaughtArchiveError(path, e);
  }
}

std::optional<uint32_t> TensorCrc32c(const RecordCrcs& records, const at::Tensor& t) {
  if (IsWholeStorage(t)) {
    auto found = records.find(t.storage().unsafeGetStorageImpl());
    if (found != records.end()) return found->second;
  }
  if (t.numel() == 0) return 0u;
  if (t.storage().data() == nullptr) return std::nullopt;  // only checksummed
  const at::Tensor c = t.contiguous();
  return Crc32c(c.data_ptr(), c.nbytes());
}

}  // namespace formats
