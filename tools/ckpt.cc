// ckpt: inspect, verify and convert state_dict checkpoints.
//
//   bazel run //tools:ckpt -- inspect DIR
//   bazel run //tools:ckpt -- verify DIR
//   bazel run //tools:ckpt -- convert DIR --to-full OUT.pt
//
// DIR is a step directory (it holds a MANIFEST) or a checkpoint root, in
// which case the latest complete step is used. `convert` writes the FULL state
// dict in PyTorch's format: Python's torch.load(OUT) gives {name: tensor}.
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
    std::cout << "  " << f.name << "  rank " << f.rank << "  " << f.bytes
              << " bytes  crc32c " << absl::StrCat(absl::Hex(f.crc32c, absl::kZeroPad8))
              << "\n";
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
        absl::StrAppend(&entry.second, entry.second.empty() ? "" : ", ", "rank ", f.rank,
                        " [", t.range.offset, ", ", t.range.end(), ")");
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
  std::cout << "wrote " << out << ": " << full->size() << " full tensors from " << step_dir
            << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Inspects, verifies and converts state_dict checkpoints.", "ckpt");
  app.require_subcommand(1);
  std::string dir, out;
  CLI::App* inspect = app.add_subcommand("inspect", "files, checksums, tensors and pieces");
  CLI::App* verify = app.add_subcommand("verify", "check pieces, sizes and checksums");
  CLI::App* convert = app.add_subcommand("convert", "write the FULL state dict (torch.load)");
  for (CLI::App* command : {inspect, verify, convert}) {
    command->add_option("DIR", dir, "a step directory, or a root (its latest complete step)")
        ->required();
  }
  convert->add_option("--to-full", out, "the file to write")->required();
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
  auto step_dir = ResolveStepDir(UserPath(dir));
  if (!step_dir.ok()) return Fail(step_dir.status());
  if (inspect->parsed()) return Inspect(*step_dir);
  if (verify->parsed()) return Verify(*step_dir);
  return Convert(*step_dir, UserPath(out));
}
