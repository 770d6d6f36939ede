// The zip format's fixed numbers (PKWARE APPNOTE 6.3), as the reader of
// PyTorch archives (zip_precheck) and their writer (torch_zip_writer) use
// them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace formats {

constexpr uint32_t kZipLocalHeaderSignature = 0x04034b50;
constexpr uint32_t kZipDataDescriptorSignature = 0x08074b50;
constexpr uint32_t kZipCentralHeaderSignature = 0x02014b50;
constexpr uint32_t kZipEndSignature = 0x06054b50;
constexpr uint32_t kZip64EndSignature = 0x06064b50;
constexpr uint32_t kZip64LocatorSignature = 0x07064b50;

// Fixed parts; names, extra fields and comments follow them.
constexpr size_t kZipLocalHeaderSize = 30;
constexpr size_t kZipCentralHeaderSize = 46;
constexpr size_t kZipEndSize = 22;
constexpr size_t kZip64EndSize = 56;
constexpr size_t kZip64LocatorSize = 20;

constexpr uint16_t kZipStored = 0;
constexpr uint16_t kZipDeflated = 8;
// The extra field of 64-bit sizes and offsets; a 32-bit field holding
// kZip64Marker says its value is there.
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint32_t kZip64Marker = 0xFFFFFFFFu;

}  // namespace formats
