// State dicts as safetensors files (Hugging Face's format for model weights,
// https://github.com/huggingface/safetensors; Python: safetensors.torch's
// save_file / load_file, and what transformers' from_pretrained reads).
//
//   state_dict::TensorDict sd = state_dict::ModuleStateDict(*model);
//   absl::Status saved = formats::SaveSafetensors(sd, "model.safetensors");
//   // Python: safetensors.torch.load_file("model.safetensors") -> {name: tensor}
//   auto loaded = formats::LoadSafetensors("py.safetensors");  // save_file(...)
//   loaded->tensors["0.weight"];  loaded->metadata["format"];     // "pt"
//
// The file: an 8-byte little-endian length N, N bytes of UTF-8 JSON (padded
// with spaces so that the data starts 8-byte aligned)
//
//   {"__metadata__": {"format": "pt"},
//    "0.weight": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}, ...}
//
// then the tensors' bytes, little-endian, row-major, back to back: each
// tensor's data_offsets are [begin, end) in that buffer, and the tensors
// cover it exactly (no gaps, no overlaps, nothing after the last).
//
// dtypes, safetensors' name -> torch: BOOL bool, U8 uint8, I8 int8, I16
// int16, U16 uint16, I32 int32, U32 uint32, I64 int64, U64 uint64, F16 half,
// BF16 bfloat16, F32 float, F64 double, C64 complex64, F8_E4M3 float8_e4m3fn,
// F8_E5M2 float8_e5m2, F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0 float8_e8m0fnu. The
// packed sub-byte types (F4, F6_E2M3, F6_E3M2) and every other torch dtype
// (complex128, the quantized ones) are refused, naming the tensor and dtype.
// No tensor of a file may share bytes with another; shared or overlapping
// tensors are written as separate copies (as SaveTensorDict does).
#pragma once

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/torch_save/torch_save.h"  // TensorDict, LoadOptions

namespace formats {

// Writes `tensors` to `path` as a safetensors file, atomically (temporary
// file, fsync, rename: a crash leaves the old file or none). The header lists
// the tensors in the dict's order; their bytes are laid out by descending
// element size (as Python's writer does), so every tensor's data is aligned
// to its element size for readers that map the file. Each tensor is written
// on its own, made contiguous and copied to the CPU only when it is not
// already: the memory a save adds is the header, one write buffer and at most
// one tensor's copy.
//
// `metadata` becomes the header's "__metadata__" (string -> string), with
// "format": "pt" added unless it names a "format" (transformers'
// from_pretrained refuses a safetensors file without it).
//
// Errors (InvalidArgument, before anything is written): a dtype with no
// safetensors name or a non-strided tensor (sparse, mkldnn), naming the
// tensor; a tensor named "__metadata__"; a name or metadata string that is
// not valid UTF-8; a header over 100,000,000 bytes (what readers refuse).
// I/O errors name the file.
absl::Status SaveSafetensors(const TensorDict& tensors, const std::string& path,
                             const std::map<std::string, std::string>& metadata = {});

struct LoadedSafetensors {
  // In the header's order (for Python's files: sorted by dtype, then name;
  // for SaveSafetensors': the saved dict's order).
  TensorDict tensors;
  // "__metadata__"; empty when the file has none.
  std::map<std::string, std::string> metadata;
};

// Reads a safetensors file (SaveSafetensors', Python's save_file, any other
// writer's). Tensors are fresh CPU tensors that own their memory (nothing
// maps the file).
//
// Strict, as the reference reader and somewhat more: DataLoss naming the file
// and what is wrong for a file shorter than 8 bytes; a header length over
// 100,000,000 bytes (the reference's limit) or past the end of the file,
// both checked before anything is allocated; a header that is not UTF-8
// JSON, not an object, or deeper than the format's three levels (refused at
// the first nested value the format has no place for, so a crafted header
// costs no stack); duplicate keys; "__metadata__" not an object of strings;
// per tensor (named): a missing or unknown field, an unknown dtype, shape
// entries that are not non-negative integers or whose product overflows,
// data_offsets not two non-decreasing integers, a byte length other than
// numel * element size, offsets past the data; tensors that overlap or
// leave a gap between them; bytes after the last tensor; a BOOL byte other
// than 0 or 1. (Stricter than the reference, which ignores duplicate keys
// and unknown fields and takes any BOOL byte.)
//
// Memory: at most the header (N bytes, plus its parsed entries) and the
// tensors' declared bytes. `options.max_bytes` (0: none) bounds the two
// together: a file whose header and tensors take more is ResourceExhausted,
// refused before either is read.
absl::StatusOr<LoadedSafetensors> LoadSafetensors(const std::string& path,
                                                  const LoadOptions& options = {});

}  // namespace formats
