// Writes the project-made seeds of the state_dict fuzzers (harness.h:
// WriteProjectSeeds). Usage:
//   write_project_seeds <torch_file dir> <checkpoint dir> <dcp dir>
// tools/fuzz/make_seed_corpus.py runs it with the corpus directories.
#include <iostream>

#include "state_dict/fuzz/harness.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0]
              << " <torch_file corpus dir> <checkpoint corpus dir> <dcp corpus dir>\n";
    return 2;
  }
  absl::Status status = state_dict::fuzz::WriteProjectSeeds(argv[1], argv[2], argv[3]);
  if (!status.ok()) {
    std::cerr << "write_project_seeds: " << status << "\n";
    return 1;
  }
  return 0;
}
