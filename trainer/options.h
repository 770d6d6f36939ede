// The trainer's command line: every flag, its default, and the checks that
// run before anything is built.
//
// Flags are spelled with dashes (`--global-batch 8` or `--global-batch=8`),
// as scripts rely on them, and parsed by CLI11, which also prints --help. An
// unknown flag, a missing or malformed value or a value out of range is an
// error naming the flag, the value and what was expected; nothing is
// ignored; a flag given twice takes the last value.
//
// FSDP flags (--sharding, --mixed-precision, --cpu-offload, --auto-wrap,
// --backward-prefetch) configure the fsdp::FullyShardedDataParallel wrapper
// every run uses (train.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainer {

// kLlama: a Llama-family decoder from models/ (Llama 2/3, Mistral, Qwen2,
// Qwen3), its shape from a Hugging Face config.json (--hf-checkpoint or
// --model-config), not from --layers/--dim/--heads/--vocab.
enum class ModelKind { kMlp, kTransformer, kLlama };
// The dtype of --export-hf's files.
enum class ExportDtype { kFloat32, kBf16 };
// kText: the license texts (data.h); kSynthetic: random tokens; kFile: the
// user's file --data PATH (its layout: --data-format, data.h).
enum class DataKind { kText, kSynthetic, kFile };
// How --data PATH is read (data.h, ResolveDataFormat): kAuto picks by content
// and name (llm.c's header: uint16 or uint32 tokens; else a .bin name: uint16
// tokens; else text: encoded with --tokenizer, or bytes without one). kText:
// encoded with --tokenizer at start (text_data.h).
enum class DataFormat { kAuto, kBytes, kTokens, kText };
enum class Sharding { kFull, kGradOp, kNone, kHybrid };
enum class MixedPrecision { kNone, kBf16 };
enum class AutoWrap { kBlock, kSize, kNone };
enum class BackwardPrefetch { kPre, kPost, kNone };
enum class ActivationCheckpointing { kNone, kBlock };
enum class OptimizerKind { kAdam, kAdamW, kSgd };
enum class LrSchedule { kConstant, kCosine };
enum class CheckpointFormat { kSharded, kFull };
enum class Device { kCpu, kCuda };
// Which FSDP wraps the model: FullyShardedDataParallel (FSDP1) or
// fsdp::fully_shard (FSDP2, per-parameter shards; trainer/wrap.h).
enum class FsdpApi { kFsdp1, kFullyShard };
// --cuda-graphs: capture the step into a CUDA graph and replay it
// (trainer/cuda_graphs.h). kAuto: where nothing prevents it, else eager with
// the reasons printed; kOn: refused when something prevents it; kOff: eager.
enum class CudaGraphs { kAuto, kOn, kOff };

struct Options {
  ModelKind model = ModelKind::kTransformer;
  // --model llama: a Hugging Face checkpoint directory (config.json and
  // safetensors weights) loaded into the shards, or a config.json alone
  // (transformers' random initialisation from --seed). Exactly one.
  std::string hf_checkpoint;
  std::string model_config;
  // --model llama: after the last step, the model as a Hugging Face
  // checkpoint directory (config.json, safetensors files of at most
  // export_hf_max_shard_bytes, an index when several) that transformers'
  // from_pretrained loads; written by rank 0 tensor by tensor, atomically.
  std::string export_hf;
  ExportDtype export_hf_dtype = ExportDtype::kFloat32;
  int64_t export_hf_max_shard_bytes = 5'000'000'000;  // transformers' "5GB"
  DataKind data = DataKind::kText;
  std::string data_path;  // --data PATH (kFile)
  DataFormat data_format = DataFormat::kAuto;
  // --data PATH is text, encoded once at start with this Hugging Face
  // tokenizer.json as //tools:tokenize encodes one text file (text_data.h);
  // its ids must fit the model's vocabulary. Empty: no tokenizer.
  std::string tokenizer;
  // Every N steps (and after the last), the mean loss over the held-out
  // split (the last tenth of the data, which training then never samples):
  // printed and logged as val_loss. 0: no split, no evaluation.
  int64_t eval_every = 0;
  int64_t steps = 450;  // ~1 min on 2 cores with the defaults (2 ranks)
  int64_t seed = 0;
  int64_t global_batch = 16;
  double lr = 3e-3;
  // No flags = 2 ranks, FULL_SHARD (issue #9).
  int nproc = 2;
  // Whether --nproc was given. A rank started by an outside launcher
  // (RANK set) takes the launcher's WORLD_SIZE unless --nproc says
  // otherwise, so the default of 2 does not clash with `launch --nproc 4`.
  bool nproc_given = false;
  // Intra-op threads per rank (LibTorch's pool and OpenBLAS); 0: automatic,
  // OMP_NUM_THREADS if set, else cores / ranks (host/thread_layout.h).
  int threads_per_rank = 0;
  // Each rank on its own cores (launcher::LaunchOptions::bind_cores).
  bool bind_cores = true;
  // Collective timeout of the process groups, in seconds: a rank waiting
  // this long for a peer that hung fails. 0: the launcher's
  // COMM_COLLECTIVE_TIMEOUT_MS if set, else 600 (10 minutes).
  double timeout_s = 0;
  // Restarts of every rank after one fails (the trainer's own launcher,
  // --nproc; with --checkpoint-dir a restart resumes from the newest
  // complete checkpoint). An outside launcher restarts its own ranks.
  int max_restarts = 0;

  // Where each rank computes. kCuda: GPU LOCAL_RANK % (GPUs visible), the
  // model's collectives on NCCL, the trainer's small CPU ones on Gloo
  // (comm::kGlooCpuNcclCuda); needs a --config=cuda build and a GPU.
  Device device = Device::kCpu;

  // FSDP.
  FsdpApi fsdp = FsdpApi::kFsdp1;
  Sharding sharding = Sharding::kFull;
  MixedPrecision mixed_precision = MixedPrecision::kNone;
  bool cpu_offload = false;
  bool float8 = false;  // --float8: Llama projections through float8 matrix products
  bool float8_all_gather =
      false;  // --float8-all-gather: fully_shard gathers their weights in float8
  AutoWrap auto_wrap = AutoWrap::kBlock;
  int64_t auto_wrap_min_params = 0;  // N of --auto-wrap size:N
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;
  // kBlock: every transformer block's activations are recomputed in
  // backward instead of kept (activation_checkpointing/).
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNone;

  int64_t grad_accum = 1;
  double clip = 0.0;  // 0: no clipping
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  LrSchedule lr_schedule = LrSchedule::kCosine;
  int64_t warmup_steps = 10;

  // Model sizes (the MLP uses dim as its hidden width and seq as its window).
  // --model llama takes its own from its config.json (only seq applies).
  int64_t layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t vocab = 256;
  int64_t seq = 64;

  std::string checkpoint_dir;    // empty: no checkpoints
  int64_t checkpoint_every = 0;  // 0: only with --checkpoint-dir, at the end
  // kSharded: every rank writes its pieces (no gathering); kFull: rank 0
  // writes one model.pt that Python's torch.load opens. --resume reads either.
  CheckpointFormat checkpoint_format = CheckpointFormat::kSharded;
  // After each checkpoint commits, remove complete checkpoints older than
  // the newest K, and debris of crashed saves (state_dict::PruneCheckpoints).
  // 0: keep every checkpoint.
  int64_t keep_last = 0;
  // Write each checkpoint from the live state in a background thread while
  // the next step's forward and backward run, its optimizer step waiting
  // until the state is written (state_dict::AsyncCheckpointer, in place:
  // no snapshot copy); a sharded one is
  // committed at the first step boundary where every rank's write finished.
  bool async_checkpoint = false;
  bool resume = false;
  // Not a flag: the checkpoint a restarted rank resumes from, already chosen
  // for the job (ChooseResumeCheckpoint). Empty: --resume chooses.
  std::string resume_from;
  // A PyTorch distributed checkpoint (torch.distributed.checkpoint, DCP) to
  // continue from, e.g. one Python FSDP / fully_shard saved
  // (tools/trainer_mirror.py): model, optimizer state, "trainer.step" and
  // "trainer.seed" are loaded before the first step, which is step + 1.
  // Empty: none. Not with --resume (a restart's checkpoint, being newer,
  // takes its place).
  std::string import_dcp;
  // Load a checkpoint (--resume, a restart, --import-dcp) whose parameters
  // or optimizer state hold NaN or Inf instead of refusing it.
  bool allow_nonfinite_import = false;
  // Where to write a DCP directory of the model, optimizer, step and seed
  // after the last step, for Python's dcp.load. Empty: none.
  std::string export_dcp;
  std::string log_json;  // empty: no JSON log
  // Step N under LibTorch's Kineto profiler on rank 0 (trainer/step_profile.h),
  // its Chrome trace written to profile_trace. 0: no profiling. The step's
  // logged time and tokens/s include the profiler's overhead.
  int64_t profile_step = 0;
  std::string profile_trace;
  // Whether the step is captured into a CUDA graph (cuda_graphs.h).
  CudaGraphs cuda_graphs = CudaGraphs::kAuto;

  bool help = false;
};

// Parses argv[1..] (`args` excludes the program name) and validates the
// result (ValidateOptions). Errors are InvalidArgument.
absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args);

// Consistency checks between flags: dim % heads == 0, text data needs
// vocab >= 256, --tokenizer needs --data PATH that may be text (not
// --data-format=bytes|tokens) and --data-format=text needs --tokenizer, --resume needs
// --checkpoint-dir and excludes --import-dcp,
// --export-dcp differs from --import-dcp, --profile-step and --profile-trace
// come together (a step <= --steps), ... (hand-written: CLI11's
// needs() could say only "--resume requires --checkpoint-dir", and not the
// arithmetic ones; single values are checked by the parser).
absl::Status ValidateOptions(const Options& options);

// Checks against the distributed setup actually used (`world_size` ranks):
// global_batch divisible by world_size * grad_accum, and --sharding=hybrid
// only on a world size that forms a 2-D mesh (HybridMeshShape).
absl::Status CheckFeatureAvailability(const Options& options, int world_size);

// (replicate, shard) sizes of --sharding=hybrid's 2-D mesh on `world_size`
// ranks: shard = the smallest divisor >= sqrt(world_size) that leaves at
// least 2 replicas (4 -> 2x2, 6 -> 2x3, 8 -> 2x4, 9 -> 3x3). Both must be
// >= 2, or hybrid would just be FULL_SHARD (replicate 1) or NO_SHARD
// (shard 1): InvalidArgument for 1, 2, 3 or any prime.
absl::StatusOr<std::pair<int64_t, int64_t>> HybridMeshShape(int world_size);

// The flags back as a command line (used to re-execute the trainer as each
// rank, so every rank sees exactly the parsed options). Hand-written: CLI11
// writes config files, not command lines.
std::vector<std::string> ToArgs(const Options& options);

// --help text (CLI11's, with every flag's default).
std::string Usage();

const char* Name(ModelKind v);
const char* Name(ExportDtype v);
const char* Name(DataKind v);
const char* Name(DataFormat v);
const char* Name(Sharding v);
const char* Name(MixedPrecision v);
const char* Name(Device v);
const char* Name(FsdpApi v);
const char* Name(CudaGraphs v);
const char* Name(BackwardPrefetch v);
const char* Name(OptimizerKind v);
const char* Name(LrSchedule v);
const char* Name(CheckpointFormat v);
const char* Name(ActivationCheckpointing v);
std::string AutoWrapName(const Options& options);  // "block", "size:N", "none"

}  // namespace trainer
