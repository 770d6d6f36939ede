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
// Exit status: 0 success, 1 a bad checkpoint or failed command, 2 bad usage.
// `ckpt --help` and `ckpt COMMAND --help` list the commands and flags.
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "formats/safetensors/safetensors.h"
#include "state_dict/checkpoint.h"

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
    command->add_option("DIR", dir, "a step directory, or a root (its latest complete step)")
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
  auto step_dir = ResolveStepDir(UserPath(dir));
  if (!step_dir.ok()) return Fail(step_dir.status());
  if (inspect->parsed()) return Inspect(*step_dir);
  if (verify->parsed()) return Verify(*step_dir);
  if (!safetensors_out.empty()) return ConvertToSafetensors(*step_dir, UserPath(safetensors_out));
  return Convert(*step_dir, UserPath(full_out));
}
