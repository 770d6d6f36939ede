// Reading from the disk, not from memory: a file just written (or just
// read) sits in the page cache, and reading it again measures memory
// bandwidth. Benchmarks that compare a load with the disk's read speed drop
// the files' clean pages first, so both read from the disk. No root needed
// (posix_fadvise POSIX_FADV_DONTNEED on each file, after fdatasync so that
// no dirty page stays behind); a file that cannot be opened is skipped.
#pragma once

#include <string>

namespace benchmarks {

void DropFromPageCache(const std::string& path);

// Every regular file directly in `dir`.
void DropDirectoryFromPageCache(const std::string& dir);

}  // namespace benchmarks
