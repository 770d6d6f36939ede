// ckpt: inspect, verify and convert state_dict checkpoints.
//
//   bazel run //tools:ckpt -- inspect DIR
//   bazel run //tools:ckpt -- verify DIR
//   bazel run //tools:ckpt -- convert DIR --to-full OUT.pt
//   bazel run //tools:ckpt -- convert DIR --to-safetensors OUT.safetensors
//
// DIR is a step directory (it holds a MANIFEST) or a checkpoint root, in
// which case the latest complete step is used. `convert` assembles the FULL
// state dict (a sharded checkpoint's pieces from every rank) and writes
// either all of it in PyTorch's format (--to-full: Python's torch.load(OUT)
// gives {name: tensor}) or the model's weights alone as safetensors
// (--to-safetensors: safetensors.torch.load_file(OUT), with "format": "pt"
// in its metadata as transformers' from_pretrained wants). Model weights are
// what is left without the optimizer state ("<param>/<entry>", as sharded
// checkpoints name it) and the trainer's "trainer.*" entries (its step and
// seed); in the trainer's FULL layout ("model.<name>", "optim.<name>.<entry>",
// "trainer.*") they are the "model." entries, written without that prefix.
//
// DIR may also be a PyTorch distributed checkpoint (torch.distributed.checkpoint,
// DCP: a directory with a `.metadata`, as Python's dcp.save or the trainer's
// --export-dcp write it). `inspect` lists its files, every tensor with its
// dtype, shape and chunks (box offsets + sizes, the file and byte range) and
// every other value; `verify` reads every tensor whole and every value, so
// each tensor's chunks must cover it and each chunk's bytes be in its file
// (DCP has no checksums: a flipped byte inside a chunk is not found);
// `convert --to-full` writes every tensor under its flattened key
// ("model.<fqn>", "optim.state.<fqn>.<entry>"), the tensors Python's
// dcp_to_torch_save gives, flattened (its non-tensor values — param groups,
// ints — are not tensors, and skipped with a count); `--to-safetensors` the
// "model." tensors without that prefix.
// Exit status: 0 success, 1 a bad checkpoint or failed command, 2 bad usage.
// `ckpt --help` and `ckpt COMMAND --help` list the commands and flags.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "formats/safetensors/safetensors.h"
#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"

namespace {

// `bazel run` starts the tool in its runfiles; relative paths are meant
// relative to where the user typed the command.
std::string UserPath(const std::string& path) {
  const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || cwd == nullptr) return path;
  return absl::StrCat(cwd, "/", path);
}

absl::StatusOr<std::string> ResolveStepDir(const std::string& dir) {
  auto manifest = state_dict::ReadManifest(dir);
  if (manifest.ok() || !absl::IsNotFound(manifest.status())) {
    if (!manifest.ok()) return manifest.status();
    return dir;
  }
  return state_dict::LatestCheckpoint(dir);
}

int Fail(const absl::Status& status) {
  std::cerr << "ckpt: " << status.message() << "\n";
  return 1;
}

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int Inspect(const std::string& step_dir) {
  auto m = state_dict::ReadManifest(step_dir);
  if (!m.ok()) return Fail(m.status());
  std::cout << "checkpoint " << step_dir << "\n"
            << "kind " << state_dict::CheckpointKindName(m->kind) << "\n"
            << "step " << m->step << "\n"
            << "world_size " << m->world_size << "\n"
            << "format_version " << m->format_version << "\n"
            << "files " << m->files.size() << "\n";
  for (const auto& f : m->files) {
    std::cout << "  " << f.name << "  rank " << f.rank << "  " << f.bytes << " bytes  crc32c "
              << absl::StrCat(absl::Hex(f.crc32c, absl::kZeroPad8)) << "\n";
  }
  // One line per tensor, with where its pieces are for sharded checkpoints.
  std::vector<std::string> order;
  std::map<std::string, std::pair<const state_dict::ManifestTensor*, std::string>> tensors;
  for (const auto& f : m->files) {
    for (const auto& t : f.tensors) {
      auto& entry = tensors[t.name];
      if (entry.first == nullptr) {
        entry.first = &t;
        order.push_back(t.name);
      }
      if (m->kind == state_dict::CheckpointKind::kSharded && t.range.numel > 0) {
        absl::StrAppend(&entry.second, entry.second.empty() ? "" : ", ", "rank ", f.rank, " [",
                        t.range.offset, ", ", t.range.end(), ")");
      }
    }
  }
  std::cout << "tensors " << order.size() << "\n";
  for (const std::string& name : order) {
    const auto& entry = tensors[name];
    std::cout << "  " << name << "  " << c10::toString(entry.first->dtype) << "  "
              << Shape(entry.first->global_shape);
    if (!entry.second.empty()) std::cout << "  pieces: " << entry.second;
    std::cout << "\n";
  }
  return 0;
}

int Verify(const std::string& step_dir) {
  absl::Status status = state_dict::VerifyCheckpoint(step_dir);
  if (!status.ok()) return Fail(status);
  auto m = state_dict::ReadManifest(step_dir);
  size_t tensors = 0;
  for (const auto& f : m->files) tensors += f.tensors.size();
  std::cout << "OK " << step_dir << ": " << m->files.size() << " files, " << tensors
            << " tensor entries; manifest consistent, every tensor's pieces cover it, "
               "sizes and checksums match\n";
  return 0;
}

int Convert(const std::string& step_dir, const std::string& out) {
  auto full = state_dict::LoadFullStateDict(step_dir);
  if (!full.ok()) return Fail(full.status());
  absl::Status status = state_dict::SaveTensorDict(*full, out);
  if (!status.ok()) return Fail(status);
  std::cout << "wrote " << out << ": " << full->size() << " full tensors from " << step_dir << "\n";
  return 0;
}

bool StartsWith(const std::string& s, absl::string_view prefix) {
  return absl::string_view(s).substr(0, prefix.size()) == prefix;
}

// The model's weights among a FULL state dict's entries (see the top of the
// file); `skipped` gets the number of the others.
state_dict::TensorDict ModelWeights(const state_dict::TensorDict& full, size_t* skipped) {
  // The trainer's FULL checkpoints prefix everything (trainer/checkpointing.cc).
  bool trainer_full = full.contains("trainer.step");
  for (const auto& item : full) {
    const std::string& key = item.key();
    trainer_full = trainer_full && (StartsWith(key, "model.") || StartsWith(key, "optim.") ||
                                    StartsWith(key, "trainer."));
  }
  state_dict::TensorDict weights;
  *skipped = 0;
  for (const auto& item : full) {
    const std::string& key = item.key();
    if (trainer_full && StartsWith(key, "model.")) {
      weights.insert(key.substr(6), item.value());
    } else if (!trainer_full && key.find('/') == std::string::npos &&
               !StartsWith(key, "trainer.")) {
      weights.insert(key, item.value());
    } else {
      ++*skipped;
    }
  }
  return weights;
}

int ConvertToSafetensors(const std::string& step_dir, const std::string& out) {
  auto full = state_dict::LoadFullStateDict(step_dir);
  if (!full.ok()) return Fail(full.status());
  size_t skipped = 0;
  const state_dict::TensorDict weights = ModelWeights(*full, &skipped);
  if (weights.is_empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(step_dir, " holds no model weights: its ", full->size(),
                     " entries are all optimizer state or the trainer's")));
  }
  absl::Status status = formats::SaveSafetensors(weights, out);
  if (!status.ok()) return Fail(status);
  std::cout << "wrote " << out << ": " << weights.size() << " model tensors from " << step_dir
            << " (skipped " << skipped
            << " entries of optimizer state and the trainer's step and seed)\n";
  return 0;
}

// A DCP directory: it holds DCP's `.metadata`.
bool IsDcpDirectory(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir + "/.metadata", ec);
}

std::string ObjectText(const state_dict::DcpCheckpoint& ckpt, const std::string& key) {
  auto value = ckpt.LoadObject(key);
  if (!value.ok()) return absl::StrCat("(unreadable: ", value.status().message(), ")");
  if (value->isInt()) return absl::StrCat(value->toInt());
  if (value->isDouble()) return absl::StrCat(value->toDouble());
  if (value->isBool()) return value->toBool() ? "True" : "False";
  if (value->isString()) return absl::StrCat("'", value->toStringRef(), "'");
  if (value->isNone()) return "None";
  return std::string(value->tagKind());
}

int InspectDcp(const std::string& dir) {
  auto ckpt = state_dict::DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  std::cout << "checkpoint " << dir << "\nkind dcp (torch.distributed.checkpoint)\n";
  std::vector<std::pair<std::string, uintmax_t>> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file()) files.emplace_back(entry.path().filename(), entry.file_size());
  }
  std::sort(files.begin(), files.end());
  std::cout << "files " << files.size() << "\n";
  for (const auto& [name, bytes] : files) std::cout << "  " << name << "  " << bytes << " bytes\n";
  const auto tensors = ckpt->tensors();
  std::cout << "tensors " << tensors.size() << "\n";
  for (const auto& t : tensors) {
    std::cout << "  " << t.key << "  " << c10::toString(t.dtype) << "  " << Shape(t.shape);
    auto chunks = ckpt->Chunks(t.key);
    if (!chunks.ok()) return Fail(chunks.status());
    std::cout << "  chunks:";
    for (size_t i = 0; i < chunks->size(); ++i) {
      const auto& c = (*chunks)[i];
      std::cout << (i == 0 ? " " : ", ") << Shape(c.offsets) << "+" << Shape(c.sizes) << " in "
                << c.file << " [" << c.offset << ", " << c.offset + c.length << ")";
    }
    std::cout << "\n";
  }
  const auto objects = ckpt->objects();
  std::cout << "objects " << objects.size() << "\n";
  for (const std::string& key : objects) {
    std::cout << "  " << key << "  " << ObjectText(*ckpt, key) << "\n";
  }
  return 0;
}

// Every tensor of a DCP directory whole, under its flattened key.
absl::StatusOr<state_dict::TensorDict> LoadDcpTensors(const state_dict::DcpCheckpoint& ckpt) {
  state_dict::TensorDict out;
  for (const auto& t : ckpt.tensors()) {
    auto tensor = ckpt.LoadTensor(t.key);
    if (!tensor.ok()) return tensor.status();
    out.insert(t.key, *tensor);
  }
  return out;
}

int VerifyDcp(const std::string& dir) {
  auto ckpt = state_dict::DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto tensors = LoadDcpTensors(*ckpt);
  if (!tensors.ok()) return Fail(tensors.status());
  int64_t elements = 0;
  for (const auto& item : *tensors) elements += item.value().numel();
  for (const std::string& key : ckpt->objects()) {
    if (auto value = ckpt->LoadObject(key); !value.ok()) return Fail(value.status());
  }
  std::cout << "OK " << dir << ": " << tensors->size() << " tensors (" << elements
            << " elements) and " << ckpt->objects().size()
            << " other values read; every tensor's chunks cover it and lie in their files "
               "(DCP has no checksums: bytes flipped inside a chunk are not detected)\n";
  return 0;
}

int ConvertDcp(const std::string& dir, const std::string& full_out,
               const std::string& safetensors_out) {
  auto ckpt = state_dict::DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto tensors = LoadDcpTensors(*ckpt);
  if (!tensors.ok()) return Fail(tensors.status());
  const size_t objects = ckpt->objects().size();
  if (!full_out.empty()) {
    if (auto s = state_dict::SaveTensorDict(*tensors, full_out); !s.ok()) return Fail(s);
    std::cout << "wrote " << full_out << ": " << tensors->size() << " tensors from DCP " << dir
              << " (skipped " << objects << " non-tensor values)\n";
    return 0;
  }
  state_dict::TensorDict weights;
  for (const auto& item : *tensors) {
    if (StartsWith(item.key(), "model.")) weights.insert(item.key().substr(6), item.value());
  }
  if (weights.is_empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("DCP checkpoint ", dir,
                     " holds no \"model.\" tensors: expected a checkpoint saved as "
                     "dcp.save({\"model\": ...})")));
  }
  if (auto s = formats::SaveSafetensors(weights, safetensors_out); !s.ok()) return Fail(s);
  std::cout << "wrote " << safetensors_out << ": " << weights.size() << " model tensors from DCP "
            << dir << " (skipped " << tensors->size() - weights.size() << " other tensors and "
            << objects << " non-tensor values)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Inspects, verifies and converts state_dict checkpoints.", "ckpt");
  app.require_subcommand(1);
  std::string dir, full_out, safetensors_out;
  CLI::App* inspect = app.add_subcommand("inspect", "files, checksums, tensors and pieces");
  CLI::App* verify = app.add_subcommand("verify", "check pieces, sizes and checksums");
  CLI::App* convert = app.add_subcommand(
      "convert", "write the FULL state dict (torch.load) or the model's weights (safetensors)");
  for (CLI::App* command : {inspect, verify, convert}) {
    command
        ->add_option("DIR", dir,
                     "a step directory, a root (its latest complete step), or a DCP directory")
        ->required();
  }
  CLI::Option* to_full =
      convert
          ->add_option("--to-full", full_out,
                       "write every entry (model, optimizer state, the trainer's step and "
                       "seed) in PyTorch's format: torch.load(OUT) gives {name: tensor}")
          ->type_name("OUT.pt");
  CLI::Option* to_safetensors =
      convert
          ->add_option("--to-safetensors", safetensors_out,
                       "write the model's weights only, as safetensors with "
                       "{\"format\": \"pt\"} metadata: skips optimizer state "
                       "(\"<param>/<entry>\") and the trainer's \"trainer.*\" entries; of "
                       "the trainer's FULL layout, keeps \"model.<name>\" as \"<name>\"")
          ->type_name("OUT.safetensors");
  to_full->excludes(to_safetensors);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::vector<CLI::App*> chosen = app.get_subcommands();
    const std::vector<std::string> rest = app.remaining();
    const std::string message =
        !chosen.empty() ? absl::StrCat(chosen.front()->get_name(), ": ", e.what())
        : rest.empty()  ? "expected a command: inspect, verify or convert"
                        : absl::StrCat("unknown command '", rest.front(),
                                       "': expected inspect, verify or convert");
    std::cerr << "ckpt: " << message << "\n" << app.help();
    return 2;
  }
  if (convert->parsed() && full_out.empty() && safetensors_out.empty()) {
    std::cerr << "ckpt: convert: expected --to-full OUT.pt or --to-safetensors "
                 "OUT.safetensors\n"
              << convert->help();
    return 2;
  }
  if (IsDcpDirectory(UserPath(dir))) {
    const std::string dcp = UserPath(dir);
    if (inspect->parsed()) return InspectDcp(dcp);
    if (verify->parsed()) return VerifyDcp(dcp);
    return ConvertDcp(dcp, full_out.empty() ? "" : UserPath(full_out),
                      safetensors_out.empty() ? "" : UserPath(safetensors_out));
  }
  auto step_dir = ResolveStepDir(UserPath(dir));
  if (!step_dir.ok()) return Fail(step_dir.status());
  if (inspect->parsed()) return Inspect(*step_dir);
  if (verify->parsed()) return Verify(*step_dir);
  if (!safetensors_out.empty()) return ConvertToSafetensors(*step_dir, UserPath(safetensors_out));
  return Convert(*step_dir, UserPath(full_out));
}
