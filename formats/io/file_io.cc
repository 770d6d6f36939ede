#include "formats/io/file_io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace formats {
namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(errno),
                      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

std::string Dirname(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status FsyncDirectory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open directory", path);
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return ErrnoError("cannot fsync directory", path);
  return absl::OkStatus();
}

// Small appends (zip headers, small tensors) are gathered in this buffer;
// larger ones are written directly rather than copied into it first.
constexpr size_t kWriteBufferBytes = size_t{1} << 20;
constexpr size_t kDirectWriteBytes = size_t{64} << 10;
// Writeback is started after every this many bytes (see WriteAll).
constexpr uint64_t kWritebackBytes = uint64_t{8} << 20;
constexpr size_t kReadBufferBytes = size_t{4} << 20;

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp, int fd)
    : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd), buffer_(new char[kWriteBufferBytes]) {}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Open(const std::string& path) {
  // The pid and a per-process counter keep concurrent writers (ranks sharing
  // a file system, a background save beside a foreground one) apart; a
  // leftover temporary from a crashed writer is never read by anyone.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp, fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

absl::Status AtomicFileWriter::WriteAll(const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd_, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return error_ = ErrnoError("cannot write", tmp_);
    }
    data += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
  // Starts writing back what is written so far, without waiting for it, so
  // that the disk works while the caller prepares the next bytes and the
  // fsync in Commit() finds little left to do. Only a hint: where the file
  // system has no use for it, Commit()'s fsync does all the work, as before.
  if (written_ - writeback_started_ >= kWritebackBytes) {
    ::sync_file_range(fd_, static_cast<off64_t>(writeback_started_),
                      static_cast<off64_t>(written_ - writeback_started_), SYNC_FILE_RANGE_WRITE);
    writeback_started_ = written_;
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Flush() {
  absl::Status status = WriteAll(buffer_.get(), buffered_);
  buffered_ = 0;
  return status;
}

absl::Status AtomicFileWriter::Append(const void* data, size_t size) {
  if (size == 0) return Store(data, size);  // an empty tensor's data may be null
  crc_ = Crc32c(data, size, crc_);
  return Store(data, size);
}

absl::Status AtomicFileWriter::AppendChecksummed(const void* data, size_t size, uint32_t crc32c) {
  crc_ = Crc32cCombine(crc_, crc32c, size);
  return Store(data, size);
}

absl::Status AtomicFileWriter::Store(const void* data, size_t size) {
  if (!error_.ok()) return error_;
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already committed"));
  if (size == 0) return absl::OkStatus();
  bytes_ += size;
  const char* p = static_cast<const char*>(data);
  if (size < kDirectWriteBytes && buffered_ + size <= kWriteBufferBytes) {
    std::memcpy(buffer_.get() + buffered_, p, size);
    buffered_ += size;
    return absl::OkStatus();
  }
  absl::Status status = Flush();
  if (!status.ok()) return status;
  if (size < kDirectWriteBytes) {
    std::memcpy(buffer_.get(), p, size);
    buffered_ = size;
    return absl::OkStatus();
  }
  return WriteAll(p, size);
}

absl::Status AtomicFileWriter::Commit() {
  if (!error_.ok()) return error_;
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already committed"));
  absl::Status status = Flush();
  if (!status.ok()) return status;
  if (::fsync(fd_) != 0) return error_ = ErrnoError("cannot fsync", tmp_);
  const int fd = fd_;
  fd_ = -1;  // from here on the destructor must not close it again
  if (::close(fd) != 0) {
    error_ = ErrnoError("cannot close", tmp_);
    ::unlink(tmp_.c_str());
    return error_;
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    error_ = ErrnoError("cannot rename into place", path_);
    ::unlink(tmp_.c_str());
    return error_;
  }
  return FsyncDirectory(Dirname(path_));
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  auto writer = AtomicFileWriter::Open(path);
  if (!writer.ok()) return writer.status();
  absl::Status status = (*writer)->Append(contents.data(), contents.size());
  if (!status.ok()) return status;
  return (*writer)->Commit();
}

absl::StatusOr<FileChecksum> ChecksumFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<char[]> buffer(new char[kReadBufferBytes]);
  FileChecksum out;
  while (true) {
    ssize_t n = ::read(fd, buffer.get(), kReadBufferBytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = ErrnoError("cannot read", path);
      ::close(fd);
      return status;
    }
    if (n == 0) break;
    out.crc32c = Crc32c(buffer.get(), static_cast<size_t>(n), out.crc32c);
    out.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return out;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  std::string out;
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = ErrnoError("cannot read", path);
      ::close(fd);
      return status;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

absl::Status CreateDirectories(const std::string& path) {
  if (path.empty() || PathExists(path)) return absl::OkStatus();
  std::string parent = Dirname(path);
  if (parent != path) {
    absl::Status status = CreateDirectories(parent);
    if (!status.ok()) return status;
  }
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoError("cannot create directory", path);
  }
  return FsyncDirectory(parent);
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return ErrnoError("cannot list directory", path);
  std::vector<std::string> names;
  while (struct dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

}  // namespace formats
