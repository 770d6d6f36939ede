#include "formats/torch_save/torch_save.h"

#include "formats/torch_save/tensor_dict_io.h"

#include <map>
#include <vector>

#include <torch/csrc/jit/serialization/pickler.h>
#include <c10/util/strides.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "formats/io/file_io.h"
#include "formats/torch_save/internal/torch_zip_writer.h"
#include "formats/torch_save/torch_archive_reader.h"

namespace formats {

namespace {

// data.pkl and the tensors whose storages it refers to (in its storage
// order), as torch::jit::pickle_save pickles: the pickler only keeps a
// reference to each tensor, so nothing is copied here.
struct Pickled {
  std::string pickle;
  std::vector<at::Tensor> records;
};
absl::StatusOr<Pickled> Pickle(const c10::IValue& value, absl::string_view what,
                               const std::string& path) {
  Pickled out;
  try {
    // tag_aggregates=false: plain dicts and lists, as Python's torch.save
    // writes them. LibTorch's pickle_save tags typed ones with
    // torch.jit._pickle.restore_type_tag, which Python 2.x's torch.load
    // refuses under its default weights_only=True.
    torch::jit::Pickler pickler(
        [&](const char* data, size_t size) { out.pickle.append(data, size); },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
        /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(value);
    pickler.stop();
    out.records = pickler.tensorData();
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot serialise ", what, " for ", path, ": ", e.what_without_backtrace()));
  }
  return out;
}

}  // namespace

absl::Status AppendTorchSave(const c10::IValue& value, AtomicFileWriter& file) {
  // As torch::jit::pickle_save, streamed: each storage is written (and
  // copied to the CPU, when it is elsewhere) on its own.
  auto pickled = Pickle(value, "state", file.path());
  if (!pickled.ok()) return pickled.status();
  internal::TorchZipWriter zip(file);
  for (size_t i = 0; i < pickled->records.size(); ++i) {
    const torch::jit::WriteableTensorData storage =
        torch::jit::getWriteableTensorData(pickled->records[i]);
    auto written = zip.WriteRecord(absl::StrCat("data/", i), storage.data(), storage.sizeInBytes());
    if (!written.ok()) return written.status();
  }
  auto written = zip.WriteRecord("data.pkl", pickled->pickle.data(), pickled->pickle.size());
  if (!written.ok()) return written.status();
  return zip.Finish();
}

absl::Status SaveIValue(const c10::IValue& value, const std::string& path) {
  auto file = AtomicFileWriter::Open(path);
  if (!file.ok()) return file.status();
  absl::Status status = AppendTorchSave(value, **file);
  if (!status.ok()) return status;
  return (*file)->Commit();
}

absl::StatusOr<c10::IValue> LoadIValue(const std::string& path) {
  return LoadIValue(path, LoadOptions());
}

absl::StatusOr<c10::IValue> LoadIValue(const std::string& path, const LoadOptions& options) {
  ArchiveLimits limits;
  limits.max_bytes = options.max_bytes;
  auto archive = ReadTorchArchive(path, limits);
  if (!archive.ok()) return archive.status();
  return std::move(archive->value);
}

namespace {

// A CPU tensor of `dtype` and `shape`, contiguous, over a storage of the
// right size that holds no memory. The pickler reads only a tensor's
// metadata (dtype, storage size, offset, shape, strides) and keeps a
// reference to each tensor it will need the data of; handing it these
// stand-ins keeps the pickling step from pinning (or copying) any data, so
// that the records can then be written one tensor at a time.
at::Tensor MetadataOnlyTensor(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       c10::DataPtr(nullptr, c10::Device(c10::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype))
      .set_(storage, 0, shape, c10::contiguous_strides(shape));
}

}  // namespace

absl::StatusOr<WrittenTensorDict> WriteTensorDict(const TensorDict& tensors,
                                                  const std::string& path) {
  return WriteTensorDict(tensors, path, nullptr);
}

absl::StatusOr<WrittenTensorDict> WriteTensorDict(const std::vector<TensorSpec>& specs,
                                                  const TensorSource& source,
                                                  const std::string& path) {
  return WriteTensorRecords(specs, source, path, nullptr);
}

absl::StatusOr<WrittenTensorDict> WriteTensorRecords(
    const std::vector<TensorSpec>& specs, const TensorSource& source, const std::string& path,
    const std::function<absl::Status()>& before_commit) {
  // The data.pkl program, pickled from stand-ins (see MetadataOnlyTensor).
  c10::Dict<std::string, at::Tensor> stand_ins;
  std::map<const c10::StorageImpl*, size_t> index_of_storage;
  for (const TensorSpec& spec : specs) {
    int64_t numel = 1;
    for (int64_t d : spec.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot save tensor '", spec.key, "' to ", path, ": its shape [",
                         c10::Join(", ", spec.shape), "] is not a valid shape"));
      }
    }
    if (stand_ins.contains(spec.key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot save ", path, ": tensor '", spec.key, "' is listed twice"));
    }
    at::Tensor stand_in = MetadataOnlyTensor(spec.dtype, spec.shape);
    index_of_storage.emplace(stand_in.storage().unsafeGetStorageImpl(), index_of_storage.size());
    stand_ins.insert(spec.key, std::move(stand_in));
  }
  auto pickled = Pickle(c10::IValue(stand_ins), "tensors", path);
  if (!pickled.ok()) return pickled.status();
  const std::vector<at::Tensor>& records = pickled->records;
  // The pickler lists each storage once, in the dict's order: the source is
  // asked for tensor i as record data/<i> is written.
  if (records.size() != specs.size()) {
    return absl::InternalError(absl::StrCat("saving ", path, ": the pickler listed ",
                                            records.size(), " storages for ", specs.size(),
                                            " tensors"));
  }
  for (size_t i = 0; i < records.size(); ++i) {
    auto found = index_of_storage.find(records[i].storage().unsafeGetStorageImpl());
    if (found == index_of_storage.end() || found->second != i) {
      return absl::InternalError(absl::StrCat(
          "saving ", path, ": the pickler listed the storages out of the dict's order"));
    }
  }

  auto file = AtomicFileWriter::Open(path);
  if (!file.ok()) return file.status();
  internal::TorchZipWriter zip(**file);
  WrittenTensorDict out;
  out.tensor_crc32c.resize(specs.size());
  // The same records, in the same order, as torch::pickle_save: the
  // storages as data/<i>, then data.pkl (and `version` at the end).
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    absl::StatusOr<at::Tensor> produced = source(i);
    if (!produced.ok()) return produced.status();
    if (!produced->defined() || produced->scalar_type() != spec.dtype ||
        produced->sizes() != at::IntArrayRef(spec.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot save tensor '", spec.key, "' to ", path, ": its data is ",
                       produced->defined() ? absl::StrCat(c10::toString(produced->scalar_type()),
                                                          " of shape ", c10::str(produced->sizes()))
                                           : std::string("undefined"),
                       ", expected ", c10::toString(spec.dtype), " of shape [",
                       c10::Join(", ", spec.shape), "]"));
    }
    if (produced->layout() != c10::kStrided || produced->is_quantized()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot save tensor '", spec.key, "' to ", path,
          ": only dense tensors are supported, it has layout ", c10::str(produced->layout()),
          produced->is_quantized() ? " (quantized)" : ""));
    }
    // At most one tensor is copied at a time (when it is not a contiguous
    // CPU tensor already); the copy is freed before the next one.
    at::Tensor data = produced->detach().to(at::kCPU).contiguous();
    *produced = at::Tensor();
    auto crc32c = zip.WriteRecord(absl::StrCat("data/", i), data.data_ptr(), data.nbytes());
    if (!crc32c.ok()) return crc32c.status();
    out.tensor_crc32c[i] = *crc32c;
  }
  auto pickle_crc32c = zip.WriteRecord("data.pkl", pickled->pickle.data(), pickled->pickle.size());
  if (!pickle_crc32c.ok()) return pickle_crc32c.status();
  absl::Status finished = zip.Finish();
  if (!finished.ok()) return finished;
  if (before_commit) {
    absl::Status status = before_commit();
    if (!status.ok()) return status;
  }
  out.bytes = (*file)->bytes();
  out.crc32c = (*file)->crc32c();
  absl::Status status = (*file)->Commit();
  if (!status.ok()) return status;
  return out;
}

absl::StatusOr<std::vector<TensorSpec>> TensorSpecsOf(const TensorDict& tensors,
                                                      const std::string& path) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& item : tensors) {
    if (!item.value().defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot save tensor '", item.key(), "' to ", path, ": it is undefined"));
    }
    specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
  }
  return specs;
}

absl::StatusOr<WrittenTensorDict> WriteTensorDict(const TensorDict& tensors,
                                                  const std::string& path,
                                                  const LiveTensors* live) {
  auto specs = TensorSpecsOf(tensors, path);
  if (!specs.ok()) return specs.status();
  auto from_dict = [&](size_t i) -> absl::StatusOr<at::Tensor> { return tensors[i].value(); };
  std::function<absl::Status()> before_commit;
  if (live != nullptr) {
    // Versions only grow: a tensor changed before (or while) its bytes were
    // written, and whose change has finished, shows here.
    before_commit = [&]() -> absl::Status {
      for (const auto& item : tensors) {
        const at::Tensor& t = item.value();
        auto recorded = live->versions.find(t.unsafeGetTensorImpl());
        if (recorded == live->versions.end()) {
          return absl::InternalError(
              absl::StrCat("saving ", path, ": tensor '", item.key(), "' has no version recorded"));
        }
        const int64_t now = static_cast<int64_t>(t._version());
        if (now != recorded->second) {
          return absl::DataLossError(
              absl::StrCat("cannot save ", path, ": tensor '", item.key(),
                           "' was changed in place while it was being saved (version ",
                           recorded->second, " when the save was asked for, now ", now,
                           "); leave the state unchanged until the save has written it"));
        }
      }
      if (live->written) live->written();
      return absl::OkStatus();
    };
  }
  return WriteTensorRecords(*specs, from_dict, path, before_commit);
}

absl::Status SaveTensorDict(const TensorDict& tensors, const std::string& path) {
  return WriteTensorDict(tensors, path).status();
}

namespace {

// The archive's top-level dict of str -> tensor.
absl::StatusOr<LoadedTensorDict> ToTensorDict(const std::string& path, UnpickledArchive archive) {
  if (!archive.value.isGenericDict()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a dict of tensors, found ", archive.value.tagKind()));
  }
  LoadedTensorDict out;
  for (const auto& entry : archive.value.toGenericDict()) {
    if (!entry.key().isString()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": expected string keys, found ", entry.key().tagKind()));
    }
    const std::string& name = entry.key().toStringRef();
    if (!entry.value().isTensor()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": entry '", name, "' is a ", entry.value().tagKind(), ", expected a tensor"));
    }
    out.tensors.insert(name, entry.value().toTensor());
  }
  out.metadata = std::move(archive.metadata);
  return out;
}

}  // namespace

absl::StatusOr<LoadedTensorDict> LoadTensorDict(const std::string& path) {
  return LoadTensorDict(path, LoadOptions());
}

absl::StatusOr<LoadedTensorDict> LoadTensorDict(const std::string& path,
                                                const LoadOptions& options) {
  ArchiveLimits limits;
  limits.max_bytes = options.max_bytes;
  auto archive = ReadTorchArchive(path, limits);
  if (!archive.ok()) return archive.status();
  return ToTensorDict(path, *std::move(archive));
}

absl::StatusOr<ChecksummedTensorDict> ReadChecksummedTensorDict(const std::string& path,
                                                                TensorData data,
                                                                const std::set<std::string>& keep) {
  auto archive = ReadTorchArchiveInOnePass(path, data, keep);
  if (!archive.ok()) return archive.status();
  auto loaded = ToTensorDict(path, std::move(archive->archive));
  if (!loaded.ok()) return loaded.status();
  ChecksummedTensorDict out;
  out.loaded = *std::move(loaded);
  out.bytes = archive->bytes;
  out.crc32c = archive->crc32c;
  out.record_crc32c = std::move(archive->record_crc32c);
  return out;
}

}  // namespace formats
