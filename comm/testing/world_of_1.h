// A world of one rank on a c10d::FileStore in a fresh temporary directory
// (no port, as the trainer's --nproc 1), for the GPU checks that run a
// backend on a single GPU (comm/comm_gpu_check.h: NCCL and
// "cpu:gloo,cuda:nccl"; fsdp/fsdp_gpu_check.h: FSDP on NCCL, Gloo in a dry run).
//
//   absl::StatusOr<comm::testing::WorldOf1> world = comm::testing::MakeWorldOf1("nccl", timeout);
//   comm::all_reduce(world->group, t).wait();
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace comm {
namespace testing {

struct WorldOf1 {
  // The directory of the store, removed when the last copy of this
  // WorldOf1 goes (after the group: NCCL creates its communicator at the
  // first collective, through the store).
  std::shared_ptr<const void> store_directory;
  comm::ProcessGroup group;  // rank 0 of 1
};

// init_process_group on `backend` ("gloo", "nccl", comm::kGlooCpuNcclCuda)
// with `timeout` for its collectives. The error names the backend and "world of 1"
// beside init_process_group's own message.
absl::StatusOr<WorldOf1> MakeWorldOf1(const std::string& backend,
                                      std::chrono::milliseconds timeout);

}  // namespace testing
}  // namespace comm
