// Writes the project-made seeds of the torch_file fuzzer (harness.h:
// WriteTorchFileSeeds). Usage:
//   write_project_seeds <torch_file dir>
// tools/fuzz/make_seed_corpus.py runs it with the corpus directory.
#include <iostream>

#include "formats/fuzz/harness.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " <torch_file corpus dir>\n";
    return 2;
  }
  absl::Status status = formats::fuzz::WriteTorchFileSeeds(argv[1]);
  if (!status.ok()) {
    std::cerr << "write_project_seeds: " << status << "\n";
    return 1;
  }
  return 0;
}
