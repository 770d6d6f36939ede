// Writes the project-made seeds of the checkpoint and dcp fuzzers
// (harness.h: WriteProjectSeeds). Usage:
//   write_project_seeds <checkpoint dir> <dcp dir>
// tools/fuzz/make_seed_corpus.py runs it with the corpus directories.
#include <iostream>

#include "state_dict/fuzz/harness.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " <checkpoint corpus dir> <dcp corpus dir>\n";
    return 2;
  }
  absl::Status status = state_dict::fuzz::WriteProjectSeeds(argv[1], argv[2]);
  if (!status.ok()) {
    std::cerr << "write_project_seeds: " << status << "\n";
    return 1;
  }
  return 0;
}
