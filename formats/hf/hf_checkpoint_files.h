// Hugging Face checkpoint directories (what transformers' save_pretrained
// writes and from_pretrained reads), as files only: no model or state-dict
// knowledge. Read one tensor range at a time and written one tensor at a
// time, so that a loader or exporter never holds more than its own shard plus
// one tensor.
//
//   auto ckpt = formats::HfCheckpointFiles::Open("/models/llama-3-8b");
//   for (const std::string& name : ckpt->names()) {
//     auto info = ckpt->info(name);                       // dtype, shape, file
//     auto mine = ckpt->Read(name, rank * n, n);          // elements [rank*n, rank*n + n)
//   }
//
//   auto out = formats::HfCheckpointWriter::Create(
//       "/exports/step-1000", specs, int64_t{5} << 30, {{"config.json", config_text}});
//   for (...) out->Write(spec.key, tensor);               // in spec order
//   absl::Status done = out->Commit();                    // now the directory exists
//
// A directory holds either one file, model.safetensors, or shards
// model-00001-of-0000N.safetensors with model.safetensors.index.json:
//
//   {"metadata": {"total_size": <bytes of all tensors>},
//    "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors", ...}}
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/safetensors/safetensors_file.h"
#include "formats/torch_save/torch_save.h"  // TensorSpec

namespace formats {

inline constexpr char kHfSafetensorsFile[] = "model.safetensors";
inline constexpr char kHfSafetensorsIndexFile[] = "model.safetensors.index.json";

struct HfTensorInfo {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t bytes = 0;  // numel * element size
  std::string file;   // the file holding it, a name inside the directory
};

// A checkpoint directory, read. Every file is opened (and its header read and
// checked) by Open, and stays open, one file descriptor each, until the
// object goes; tensors' bytes are read only by Read / ReadAll, with pread.
class HfCheckpointFiles {
 public:
  // Opens `dir`:
  //  - with model.safetensors.index.json: the index (JSON; at most 100 MB)
  //    must be an object with "weight_map", an object of tensor name -> file
  //    name (no duplicate names), and may hold "metadata", an object whose
  //    "total_size", when present, must be a non-negative integer equal to
  //    the sum of the tensors' bytes (DataLoss otherwise); other keys are
  //    ignored. Every file it names must be a plain name inside `dir` (not
  //    empty, no '/', not "." or ".."): InvalidArgument naming the index,
  //    the tensor and the file; and must exist: NotFound naming the index and
  //    the file (symbolic links are followed: the Hub's cache links its files
  //    to blobs). Each file is opened with SafetensorsFile::Open (its errors
  //    as they are). Then, DataLoss naming the files: a tensor in two files'
  //    headers; a tensor of the index missing from its file's header; a
  //    tensor of a header missing from the index or mapped there to another
  //    file.
  //  - else model.safetensors, alone.
  //  - both present: FailedPrecondition (transformers would read
  //    model.safetensors and ignore the index; this reader does not guess).
  //  - neither: NotFound naming `dir` and both names; when the directory
  //    holds pytorch_model.bin (or its index) instead, the message says that
  //    only safetensors checkpoints are read.
  static absl::StatusOr<HfCheckpointFiles> Open(const std::string& dir);

  HfCheckpointFiles(HfCheckpointFiles&&) = default;
  HfCheckpointFiles& operator=(HfCheckpointFiles&&) = default;
  HfCheckpointFiles(const HfCheckpointFiles&) = delete;
  HfCheckpointFiles& operator=(const HfCheckpointFiles&) = delete;

  const std::string& dir() const { return dir_; }
  // True when read through model.safetensors.index.json.
  bool sharded() const { return sharded_; }
  // Every tensor's name, sorted (byte order), whatever the files' order.
  const std::vector<std::string>& names() const { return names_; }
  // The safetensors files, names inside dir(), sorted.
  std::vector<std::string> files() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // NotFound naming the directory and the tensor when there is no `name`.
  absl::StatusOr<HfTensorInfo> info(const std::string& name) const;
  // SafetensorsFile::Read / ReadAll of the file holding `name` (a fresh
  // contiguous 1-D CPU tensor of elements [element_offset, element_offset +
  // numel) of the flattened tensor; the whole tensor in its shape). Safe to
  // call from several threads at once.
  absl::StatusOr<at::Tensor> Read(const std::string& name, int64_t element_offset,
                                  int64_t numel) const;
  // SafetensorsFile::ReadInto: the elements into the caller's buffer.
  absl::Status ReadInto(const std::string& name, int64_t element_offset,
                        const at::Tensor& out) const;
  absl::StatusOr<at::Tensor> ReadAll(const std::string& name) const;

 private:
  HfCheckpointFiles() = default;
  absl::StatusOr<const SafetensorsFile*> FileOf(const std::string& name, const char* who) const;

  std::string dir_;
  bool sharded_ = false;
  std::vector<std::string> file_names_;  // files_[i]'s name inside dir_
  std::vector<SafetensorsFile> files_;
  std::unordered_map<std::string, size_t> tensors_;  // name -> index into files_
  std::vector<std::string> names_;
};

// One file of a HfCheckpointWriter's plan.
struct HfShard {
  std::string file;                  // "model.safetensors" or "model-00001-of-00003.safetensors"
  std::vector<std::string> tensors;  // in spec order
  int64_t bytes = 0;                 // of its tensors' data
};

// Writes a checkpoint directory that transformers'
// AutoModelForCausalLM.from_pretrained loads (with the config.json given in
// `extra_files`), one tensor at a time, under a temporary directory that
// Commit renames to `dir`: a crash leaves at most a hidden
// ".<name>.tmp-<pid>-<random>" directory beside `dir`, never a partial
// export under `dir`'s name.
//
// Files: the shards' names and order as transformers' save_pretrained
// (huggingface_hub's split_torch_state_dict_into_shards) gives them, the
// tensors taken in spec order: a file is closed when adding the next tensor
// would take it over `max_shard_bytes`, and a tensor over the limit gets a
// file of its own. (One difference: huggingface_hub puts an oversized tensor's
// file before the file being filled at that point; here it comes in spec
// order, after it, so that the tensors stream in spec order. Both load the
// same.) One file is model.safetensors; N files are
// model-0000i-of-0000N.safetensors (five digits) with
// model.safetensors.index.json, {"metadata": {"total_size": <bytes>},
// "weight_map": {...}}, indented with sorted keys as transformers writes it.
// Each file's header is written when its first tensor is, since every spec
// is known: the tensors in spec order, {"format": "pt"} as metadata, padded
// to 8 bytes; their data laid out as SaveSafetensors lays it out (largest
// elements first, so each tensor is aligned to its element size), each
// tensor written at its place with pwrite. A file is fsynced and closed
// once its last tensor is written.
//
// Memory: the plan and one header at a time; Write holds at most one
// contiguous CPU copy of the tensor it is given (none when the tensor is
// already contiguous on the CPU) and a 32 MiB conversion buffer.
class HfCheckpointWriter {
 public:
  // Plans the files and creates the temporary directory (its parent's
  // missing directories are created). Errors, before anything is written:
  // InvalidArgument for max_shard_bytes < 1, a spec that is named twice,
  // named "__metadata__" or not valid UTF-8, of a dtype safetensors has no
  // name for or a negative or overflowing shape, an extra file that is not a
  // plain name of a kind an export holds (see below) or that is one of the
  // weight files; FailedPrecondition when `dir` exists and is not a
  // previous export: it must be a directory holding config.json and
  // model.safetensors or model.safetensors.index.json, and only regular
  // files named *.safetensors, *.json, tokenizer.model, merges.txt,
  // vocab.txt or *.jinja (the message names `dir` and the first other
  // entry). A previous export is replaced by Commit.
  static absl::StatusOr<HfCheckpointWriter> Create(
      const std::string& dir, std::vector<TensorSpec> specs, int64_t max_shard_bytes,
      std::map<std::string, std::string> extra_files = {});

  HfCheckpointWriter(HfCheckpointWriter&&) noexcept;
  HfCheckpointWriter& operator=(HfCheckpointWriter&&) noexcept;
  HfCheckpointWriter(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter& operator=(const HfCheckpointWriter&) = delete;
  // Uncommitted: removes the temporary directory and what it holds.
  ~HfCheckpointWriter();

  // The tensor `name`: it must be the next spec's, of the spec's shape (any
  // device, any strides) and dtype — or, where both are float32, bfloat16
  // or float16, of another of the three, converted a 32 MiB chunk at a time
  // (no whole copy in the spec's dtype); InvalidArgument naming the tensor
  // and what was expected otherwise, and nothing is written (the writer
  // stays usable). An I/O error names the file and is returned again by every
  // later call.
  absl::Status Write(const std::string& name, const at::Tensor& tensor);

  // Finishes the export: FailedPrecondition naming the first tensor not
  // written when one is missing. Writes the index and `extra_files`, fsyncs
  // every file and the temporary directory, renames it to `dir` (a previous
  // export there, checked again, is swapped out with renameat2's exchange,
  // or renamed aside where the file system cannot exchange, then removed)
  // and fsyncs the parent. After an error the export is not in place (the
  // destructor removes the temporary directory), except when only the
  // removal of the previous export failed: the message says so and names
  // what is left.
  absl::Status Commit();

  const std::string& dir() const;
  const std::string& temp_dir() const;
  const std::vector<HfShard>& shards() const;
  int64_t total_bytes() const;  // of every tensor: the index's total_size

 private:
  struct State;
  explicit HfCheckpointWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// OK when HfCheckpointWriter::Create could write `dir`: it does not exist,
// is empty, or is a previous export (which Commit would replace);
// FailedPrecondition otherwise, with Create's message. For a caller that
// must know before it spends hours making what it will write (the trainer's
// --export-hf).
absl::Status CheckHfExportTarget(const std::string& dir);

}  // namespace formats
