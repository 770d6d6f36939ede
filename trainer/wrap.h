// The model as the trainer trains it: wrapped in fsdp::FullyShardedDataParallel
// over the given group (one rank included: one code path), per --sharding,
// --auto-wrap, --backward-prefetch, --mixed-precision, --cpu-offload and
// --activation-checkpointing (the flag -> option table is in README.md).
#pragma once

#include <memory>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "trainer/models.h"
#include "trainer/options.h"

namespace trainer {

// Wraps `model` (built on the CPU; FSDP moves each unit to `device`) over
// `world`, or over a 2-D mesh of it for --sharding=hybrid. With
// use_orig_params, so the stock optimizers run per original parameter (on
// this rank's part of it), keyed by the model's own FQNs. Blocks are called
// through module_call::call from TransformerLM's block runner; the root,
// which has no single forward, is entered through run() around Loss().
absl::StatusOr<std::unique_ptr<fsdp::FullyShardedDataParallel>> WrapModel(
    const Options& options, std::shared_ptr<LanguageModel> model, c10::Device device,
    const comm::ProcessGroup& world);

}  // namespace trainer
