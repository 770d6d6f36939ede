// Ranks started by Slurm's srun: the launcher variables read from Slurm's.
//
// `srun --ntasks N ./trainer …` starts N tasks and tells each who it is
// through SLURM_* variables, not through the RANK / WORLD_SIZE / MASTER_ADDR
// that torch.distributed's env:// rendezvous (and comm's) reads. For a task
// of a job step (srun sets SLURM_STEP_ID; the batch script itself, which
// also has SLURM_PROCID=0, is not one) and only when RANK is not set (a
// launcher's variables win, e.g. torchrun started by srun), comm takes:
//
//   RANK              SLURM_PROCID
//   WORLD_SIZE        SLURM_STEP_NUM_TASKS (else SLURM_NTASKS)
//   LOCAL_RANK        SLURM_LOCALID
//   LOCAL_WORLD_SIZE  WORLD_SIZE / SLURM_STEP_NUM_NODES when that divides,
//                     else WORLD_SIZE (the step's tasks are then uneven
//                     across nodes; only thread and device layout use it)
//   MASTER_ADDR       MASTER_ADDR if set, else the first host of
//                     SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), which
//                     is where srun puts task 0
//   MASTER_PORT       MASTER_PORT if set, else kSlurmDefaultMasterPort
//
// PyTorch has no such mapping built in (Lightning and submitit each carry
// one); this is the same table.
//
//   srun --nodes 2 --ntasks-per-node 4 ./trainer --checkpoint-dir /ckpt …
//
// Errors name the Slurm variable, its value and what was expected.
#pragma once

#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace comm {

// torch.distributed's default port, used when MASTER_PORT is not set. Two
// jobs sharing a node need MASTER_PORT set apart (e.g. from SLURM_JOB_ID).
inline constexpr int kSlurmDefaultMasterPort = 29500;

// Whether this process is a task that srun started, with no RANK of a
// launcher to override it.
bool is_slurm_task();

// The rank environment of an srun task per the table above; nullopt when
// is_slurm_task() is false.
absl::StatusOr<std::optional<RankEnvironment>> slurm_rank_environment();

// The first host name of a Slurm hostlist, as task 0 runs there:
// "gnode[10,20]" -> "gnode10", "node[07-09],gpu1" -> "node07",
// "rack[1-2]-n[01-04]" -> "rack1-n01", "login1,login2" -> "login1".
// InvalidArgument for an empty list or unbalanced brackets.
absl::StatusOr<std::string> first_slurm_host(absl::string_view hostlist);

}  // namespace comm
