#include "trainer/options.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launcher/flag_checks.h"

namespace trainer {
namespace {

// %.17g reads back as the same double, so every rank sees the parent's lr
// (through absl, or CLI11's strtold and a cast: 17 digits sit closer to the
// double than any rounding midpoint).
std::string Exact(double d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  return buf;
}

using launcher::add_integer;
using launcher::checked;

// --flag X, a finite number > 0 (>= 0 with `zero_ok`) and at most `max`.
CLI::Option* AddNumber(CLI::App& app, const std::string& flag, double& out, bool zero_ok,
                       const std::string& help, double max = std::numeric_limits<double>::max(),
                       const std::string& above_max = "") {
  return app.add_option(flag, out, help)
      ->type_name("X")
      ->transform(checked([=](std::string& v) -> std::string {
        double d = 0;
        if (!absl::SimpleAtod(v, &d) || !std::isfinite(d)) return "a finite number";
        if (d < 0 || (!zero_ok && d == 0)) return zero_ok ? "a number >= 0" : "a number > 0";
        if (d > max) return above_max;
        v = Exact(d);
        return "";
      }));
}

// --flag NAME, one of `choices` (spelled as Name() spells them).
template <typename Enum>
void AddChoice(CLI::App& app, const std::string& flag, Enum& out, const std::vector<Enum>& choices,
               const std::string& help) {
  std::vector<std::string> names;
  for (Enum c : choices) names.push_back(Name(c));
  const std::string list = absl::StrJoin(names, "|");
  app.add_option(flag, out, help)
      ->type_name(list)
      ->default_str(Name(out))
      ->transform(checked([=](std::string& v) {
        for (Enum c : choices) {
          if (v == Name(c)) {
            v = std::to_string(static_cast<int>(c));  // what CLI11 converts to the enum
            return std::string();
          }
        }
        return "one of " + list;
      }));
}

// --flag (true) or --flag=true|false|1|0.
void AddSwitch(CLI::App& app, const std::string& flag, bool& out, const std::string& help) {
  app.add_flag(flag, out, help)->transform(checked([](std::string& v) {
    return v == "true" || v == "1" || v == "false" || v == "0"
               ? std::string()
               : std::string("true|false (or the bare flag for true)");
  }));
}

// --flag PATH, not empty.
void AddPath(CLI::App& app, const std::string& flag, std::string& out, const std::string& what,
             const std::string& help) {
  app.add_option(flag, out, help)
      ->type_name(what == "a file path" ? "FILE" : "DIR")
      ->transform(checked([what](std::string& v) { return v.empty() ? what : std::string(); }));
}

// Every flag, writing into `o` (whose values are the defaults --help shows).
void DefineFlags(CLI::App& app, Options& o) {
  app.name("trainer");
  app.description(
      "Trains a small language model with FSDP on --nproc ranks. Flags take --name VALUE "
      "or --name=VALUE; a switch is --name or --name=true|false.");
  app.set_help_flag();  // -h/--help set Options::help (ParseOptions returns it)
  AddSwitch(app, "-h,--help", o.help, "print this help and exit");
  app.allow_extras();  // unknown flags and stray arguments: reported by ParseOptions
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: the last one counts
  app.get_formatter()->column_width(42);

  AddChoice(app, "--model", o.model, {ModelKind::kMlp, ModelKind::kTransformer, ModelKind::kLlama},
            "decoder-only transformer, an MLP over a window of --seq tokens, or a Llama-family "
            "model (Llama 2/3, Mistral, Qwen2/3) from --hf-checkpoint or --model-config");
  AddPath(app, "--hf-checkpoint", o.hf_checkpoint, "a directory path",
          "--model llama: a Hugging Face checkpoint (config.json + safetensors, one file or "
          "sharded with its index), loaded straight into each rank's shards");
  AddPath(app, "--model-config", o.model_config, "a file path",
          "--model llama: a Hugging Face config.json; the weights initialised as transformers "
          "does, from --seed");
  AddPath(app, "--export-hf", o.export_hf, "a directory path",
          "--model llama: after the last step, write the model here as a Hugging Face "
          "checkpoint (from_pretrained loads it)");
  AddChoice(app, "--export-hf-dtype", o.export_hf_dtype,
            {ExportDtype::kFloat32, ExportDtype::kBf16}, "the dtype of --export-hf's files");
  add_integer(app, "--export-hf-max-shard-bytes", o.export_hf_max_shard_bytes,
              "--export-hf's largest safetensors file (several, with an index, when the model is "
              "larger)",
              1);
  app.add_option_function<std::string>(
         "--data",
         [&o](const std::string& v) {
           o.data = v == "text"        ? DataKind::kText
                    : v == "synthetic" ? DataKind::kSynthetic
                                       : DataKind::kFile;
           o.data_path = o.data == DataKind::kFile ? v : "";
         },
         "text: /usr/share/common-licenses, byte-level; synthetic: random tokens; PATH: your "
         "file, a token file or text (--data-format, --tokenizer; one named text or synthetic: "
         "give it as ./text)")
      ->type_name("text|synthetic|PATH")
      ->default_str("text")
      ->transform(checked([](std::string& v) {
        return v.empty() ? std::string("text, synthetic or a file path") : std::string();
      }));
  AddChoice(app, "--data-format", o.data_format,
            {DataFormat::kAuto, DataFormat::kBytes, DataFormat::kTokens, DataFormat::kText},
            "--data PATH's layout: tokens (a token file: llm.c's .bin with its uint16 GPT-2 or "
            "uint32 Llama 3 header, as //tools:tokenize writes; or nanoGPT's headerless uint16 "
            ".bin), text (encoded with --tokenizer), bytes (its bytes are the ids), auto (a "
            "token file when it starts with an llm.c header or is named *.bin; else text with "
            "--tokenizer, bytes without, and --model llama refuses text without --tokenizer)");
  AddPath(app, "--tokenizer", o.tokenizer, "a file path",
          "a Hugging Face tokenizer.json: --data PATH is text, encoded once at start (on rank 0, "
          "as //tools:tokenize encodes one text file: its special tokens, then its end-of-text "
          "token); its ids must fit the model (--vocab, or --model llama's vocab_size)");
  add_integer(app, "--eval-every", o.eval_every,
              "every N steps, the loss on a held-out last tenth of the data (0: no split)", 0);
  add_integer(app, "--steps", o.steps, "optimizer steps", 1);
  add_integer(app, "--seed", o.seed, "seeds the model and every step's batch", 0);
  add_integer(app, "--global-batch", o.global_batch, "sequences per step, split across ranks", 1);
  AddNumber(app, "--lr", o.lr, /*zero_ok=*/false, "peak learning rate");
  add_integer(app, "--nproc", o.nproc, "ranks to start through the launcher", 1, 1024);
  add_integer(app, "--threads-per-rank", o.threads_per_rank,
              "intra-op threads of each rank (0: OMP_NUM_THREADS if set, else cores / ranks)", 0,
              4096);
  AddSwitch(app, "--bind-cores", o.bind_cores,
            "bind each rank to its own cores when ranks x threads fit them (default true; "
            "--bind-cores=false when other jobs share the CPUs)");
  AddNumber(app, "--timeout", o.timeout_s, /*zero_ok=*/false,
            "collective and rendezvous timeout: a rank waiting this long for a hung peer "
            "fails (default: the launcher's, else 600)",
            1e7, "a number of seconds in (0, 1e7]")
      ->type_name("SECONDS")
      ->default_str("");
  add_integer(app, "--max-restarts", o.max_restarts,
              "restart every rank after one fails, up to N times; resumes from --checkpoint-dir's "
              "newest checkpoint",
              0, 1000);
  AddChoice(app, "--device", o.device, {Device::kCpu, Device::kCuda},
            "cuda: each rank on GPU LOCAL_RANK % count, NCCL for the model's collectives "
            "(a --config=cuda build on a machine with a GPU)");
  AddChoice(app, "--fsdp", o.fsdp, {FsdpApi::kFsdp1, FsdpApi::kFullyShard},
            "fsdp1: FullyShardedDataParallel (flat parameters); fully_shard: FSDP2's "
            "per-parameter shards (--sharding full, grad_op or hybrid; --backward-prefetch "
            "pre or none)");
  AddChoice(app, "--sharding", o.sharding,
            {Sharding::kFull, Sharding::kGradOp, Sharding::kNone, Sharding::kHybrid},
            "FSDP strategy (hybrid: a 2-D mesh of replicas x shards, e.g. 2x2 on --nproc 4)");
  AddChoice(app, "--mixed-precision", o.mixed_precision,
            {MixedPrecision::kNone, MixedPrecision::kBf16},
            "bf16: bfloat16 compute, float32 reduction and optimizer");
  AddSwitch(app, "--cpu-offload", o.cpu_offload, "keep the sharded parameters on the CPU");
  AddSwitch(app, "--float8", o.float8,
            "--model llama: the decoder layers' projections through float8 matrix products "
            "(torchao's tensorwise recipe: kernels/float8_linear.h; lm_head stays high "
            "precision); needs a CUDA device of compute capability 8.9 or later");
  AddSwitch(app, "--float8-all-gather", o.float8_all_gather,
            "with --float8 and --fsdp fully_shard: the float8 projections' weights are "
            "all-gathered as float8 (torchao's enable_fsdp_float8_all_gather: half a bf16 "
            "all-gather's bytes; pays across GPUs)");
  app.add_option_function<std::string>(
         "--auto-wrap",
         [&o](const std::string& v) {
           o.auto_wrap = v == "block"  ? AutoWrap::kBlock
                         : v == "none" ? AutoWrap::kNone
                                       : AutoWrap::kSize;
           if (o.auto_wrap == AutoWrap::kSize) o.auto_wrap_min_params = std::stoll(v.substr(5));
         },
         "FSDP units: each transformer block, blocks of at least N parameters, or the root only")
      ->type_name("block|size:N|none")
      ->default_str(AutoWrapName(o))
      ->transform(checked([](std::string& v) -> std::string {
        int64_t n = 0;
        if (v == "block" || v == "none") return "";
        if (!absl::StartsWith(v, "size:")) return "block|none|size:N";
        if (!absl::SimpleAtoi(v.substr(5), &n) || n <= 0) {
          return "block|none|size:N with N a positive parameter count";
        }
        v = absl::StrCat("size:", n);
        return "";
      }));
  AddChoice(app, "--backward-prefetch", o.backward_prefetch,
            {BackwardPrefetch::kPre, BackwardPrefetch::kPost, BackwardPrefetch::kNone},
            "when backward gathers the next unit's parameters");
  AddChoice(app, "--activation-checkpointing", o.activation_checkpointing,
            {ActivationCheckpointing::kNone, ActivationCheckpointing::kBlock},
            "block: recompute each transformer block's activations in backward instead of "
            "keeping them");
  add_integer(app, "--grad-accum", o.grad_accum, "micro-batches per optimizer step", 1);
  AddNumber(app, "--clip", o.clip, /*zero_ok=*/true, "max global gradient norm (0: off)");
  AddChoice(app, "--optimizer", o.optimizer,
            {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kSgd}, "optimizer");
  AddChoice(app, "--lr-schedule", o.lr_schedule, {LrSchedule::kConstant, LrSchedule::kCosine},
            "after the linear warmup");
  add_integer(app, "--warmup-steps", o.warmup_steps, "steps of linear learning-rate warmup", 0);
  add_integer(app, "--layers", o.layers, "transformer blocks", 1);
  add_integer(app, "--dim", o.dim, "model width (the MLP's hidden width)", 1);
  add_integer(app, "--heads", o.heads, "attention heads (a divisor of --dim)", 1);
  add_integer(app, "--vocab", o.vocab, "vocabulary size (>= 256 with --data text)", 2);
  add_integer(app, "--seq", o.seq, "tokens per sequence (the MLP's window)", 1);
  AddPath(app, "--checkpoint-dir", o.checkpoint_dir, "a directory path",
          "checkpoints go to DIR/step_<N>");
  add_integer(app, "--checkpoint-every", o.checkpoint_every,
              "steps between checkpoints (0: only at the end, with --checkpoint-dir)", 0);
  AddChoice(app, "--checkpoint-format", o.checkpoint_format,
            {CheckpointFormat::kSharded, CheckpointFormat::kFull},
            "sharded: each rank writes its pieces; full: rank 0 writes model.pt");
  add_integer(app, "--keep-last", o.keep_last,
              "after each checkpoint, remove complete ones older than the newest N, and crash "
              "debris (0: keep all)",
              0);
  AddSwitch(app, "--async-checkpoint", o.async_checkpoint,
            "write checkpoints in the background while the next step runs (its optimizer step "
            "waits until the state is written)");
  AddSwitch(app, "--resume", o.resume, "continue from the newest checkpoint in --checkpoint-dir");
  AddPath(app, "--import-dcp", o.import_dcp, "a directory path",
          "continue from this torch.distributed.checkpoint directory (model, optimizer, "
          "trainer.step, trainer.seed), e.g. Python FSDP's");
  AddSwitch(app, "--allow-nonfinite-import", o.allow_nonfinite_import,
            "load a checkpoint (--resume, --import-dcp) whose state holds NaN or Inf instead of "
            "refusing it");
  AddPath(app, "--export-dcp", o.export_dcp, "a directory path",
          "after the last step, write a torch.distributed.checkpoint directory here for "
          "Python's dcp.load");
  AddPath(app, "--log-json", o.log_json, "a file path", "one JSON object per step (rank 0)");
  add_integer(app, "--profile-step", o.profile_step,
              "profile step N on rank 0 with LibTorch's Kineto profiler (CPU ops; GPU kernels "
              "with --device cuda) into --profile-trace; that step's --log-json time and "
              "tokens/s include the profiler's overhead and the writing of the trace (0: off)",
              0);
  AddChoice(app, "--cuda-graphs", o.cuda_graphs,
            {CudaGraphs::kAuto, CudaGraphs::kOn, CudaGraphs::kOff},
            "capture the step's forward and backward into a CUDA graph and replay it: auto where "
            "nothing prevents it (else eager, printing why), on (refused, naming why, where "
            "something does), off");
  AddPath(app, "--profile-trace", o.profile_trace, "a file path",
          "--profile-step's Chrome trace (chrome://tracing, Perfetto, "
          "benchmarks/python/profile_table.py), written atomically");
}

// CLI11 words a flag given last without its value "--steps: 1 required N
// missing".
std::string MissingValue(const CLI::App& app, const std::string& what) {
  const std::string flag = what.substr(0, what.find(':'));
  const CLI::Option* option = app.get_option_no_throw(flag);
  return absl::StrCat(flag, ": missing value",
                      option == nullptr ? "" : " (expected " + option->get_type_name() + ")");
}

}  // namespace

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  Options options;
  CLI::App app;
  DefineFlags(app, options);
  if (absl::Status s = launcher::refuse_empty_values(app, args); !s.ok()) return s;
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 reads last-first
  } catch (const CLI::ArgumentMismatch& e) {
    return absl::InvalidArgumentError(MissingValue(app, e.what()));
  } catch (const CLI::ParseError& e) {
    return launcher::flag_error(e);
  }
  if (const std::vector<std::string> extra = app.remaining(); !extra.empty()) {
    const std::string& arg = extra.front();
    if (absl::StartsWith(arg, "--") && arg.size() > 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg.substr(0, arg.find('=')), " (see --help)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "unexpected argument '", arg, "': expected a flag --NAME[=VALUE] (see --help)"));
  }
  options.nproc_given = app.count("--nproc") > 0;
  if (options.help) return options;
  if (options.model == ModelKind::kLlama) {
    for (const char* flag : {"--layers", "--dim", "--heads", "--vocab"}) {
      if (app.count(flag) > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag,
                         ": --model=llama takes its shape from its config.json (--hf-checkpoint or "
                         "--model-config); expected no ",
                         flag));
      }
    }
  }
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  return options;
}

absl::Status ValidateOptions(const Options& o) {
  const bool llama = o.model == ModelKind::kLlama;
  if (llama && o.hf_checkpoint.empty() == o.model_config.empty()) {
    return absl::InvalidArgumentError(
        o.hf_checkpoint.empty()
            ? "--model=llama: expected --hf-checkpoint DIR (a Hugging Face checkpoint) or "
              "--model-config FILE (a config.json, randomly initialised)"
            : absl::StrCat("--model-config='", o.model_config,
                           "': expected it or --hf-checkpoint='", o.hf_checkpoint,
                           "', not both (the checkpoint has its config.json)"));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string*>{"--hf-checkpoint", &o.hf_checkpoint},
        {"--model-config", &o.model_config},
        {"--export-hf", &o.export_hf}}) {
    if (!llama && !value->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, "='", *value, "': expected --model=llama, got --model=", Name(o.model)));
    }
  }
  if (o.float8 && !llama) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--float8: expected --model=llama (it converts the Llama decoder layers' projections), "
        "got --model=",
        Name(o.model)));
  }
  if (o.float8_all_gather && (!o.float8 || o.fsdp != FsdpApi::kFullyShard)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--float8-all-gather: expected --float8 and --fsdp=fully_shard (fully_shard gathers the "
        "float8 projections' weights), got --float8=",
        o.float8 ? "on" : "off", " --fsdp=", Name(o.fsdp)));
  }
  if (!o.export_hf.empty() && o.export_hf == o.hf_checkpoint) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--export-hf='", o.export_hf,
        "': expected a directory other than --hf-checkpoint's (the export never replaces the "
        "checkpoint it was loaded from)"));
  }
  if (o.model == ModelKind::kTransformer && o.dim % o.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heads=", o.heads, ": expected a divisor of --dim=", o.dim,
                     " (each attention head gets dim/heads features)"));
  }
  if (!llama && o.data == DataKind::kText && o.vocab < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab=", o.vocab, ": expected >= 256 with --data=text (the corpus is byte-level)"));
  }
  if (!o.tokenizer.empty() && o.data != DataKind::kFile) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tokenizer='", o.tokenizer,
        "': expected --data PATH, a text file to encode (got --data=", Name(o.data), ")"));
  }
  if (!o.tokenizer.empty() &&
      (o.data_format == DataFormat::kTokens || o.data_format == DataFormat::kBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokenizer='", o.tokenizer,
                     "': expected --data-format=auto or text (it encodes text), got --data-format=",
                     Name(o.data_format),
                     o.data_format == DataFormat::kTokens
                         ? " (a token file is already encoded: drop --tokenizer)"
                         : " (the bytes are the ids: drop --tokenizer)"));
  }
  if (o.data_format == DataFormat::kText && o.tokenizer.empty()) {
    return absl::InvalidArgumentError(
        "--data-format=text: expected --tokenizer FILE, the tokenizer.json to encode it with "
        "(or --data-format=bytes to train on its bytes)");
  }
  if (o.data_format != DataFormat::kAuto && o.data != DataKind::kFile) {
    return absl::InvalidArgumentError(absl::StrCat("--data-format=", Name(o.data_format),
                                                   ": expected --data PATH (it says how to read "
                                                   "that file), got --data=",
                                                   Name(o.data)));
  }
  if (o.eval_every > 0 && o.data == DataKind::kSynthetic) {
    return absl::InvalidArgumentError(
        absl::StrCat("--eval-every=", o.eval_every,
                     ": expected --data text or PATH (random tokens have nothing to hold out)"));
  }
  if (o.resume && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--resume: expected --checkpoint-dir to name the directory to resume from");
  }
  if (!o.import_dcp.empty() && o.resume) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--import-dcp='", o.import_dcp,
        "': expected no --resume (a run starts from one of the two: the DCP directory, or "
        "--checkpoint-dir's newest checkpoint)"));
  }
  if (!o.export_dcp.empty() && o.export_dcp == o.import_dcp) {
    return absl::InvalidArgumentError(
        absl::StrCat("--export-dcp='", o.export_dcp,
                     "': expected a directory other than --import-dcp's (a DCP directory is "
                     "written once, never over the checkpoint it came from)"));
  }
  if (o.async_checkpoint && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--async-checkpoint: expected --checkpoint-dir to say where checkpoints go");
  }
  if (o.keep_last > 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--keep-last=", o.keep_last,
                     ": expected --checkpoint-dir to say which checkpoints to keep"));
  }
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint-every=", o.checkpoint_every,
                     ": expected --checkpoint-dir to say where checkpoints go"));
  }
  if (o.profile_step > 0 && o.profile_trace.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-step=", o.profile_step,
                     ": expected --profile-trace PATH to say where the trace goes"));
  }
  if (o.profile_step == 0 && !o.profile_trace.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-trace='", o.profile_trace,
                     "': expected --profile-step N (N >= 1) to say which step to profile"));
  }
  if (o.profile_step > o.steps) {
    return absl::InvalidArgumentError(absl::StrCat("--profile-step=", o.profile_step,
                                                   ": expected a step <= --steps=", o.steps,
                                                   " (that step would never run)"));
  }
  return absl::OkStatus();
}

absl::Status CheckFeatureAvailability(const Options& o, int world_size) {
  const int64_t per_rank_parts = static_cast<int64_t>(world_size) * o.grad_accum;
  if (o.global_batch % world_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--global-batch=", o.global_batch, ": expected a multiple of the world size ",
                     world_size, " (every rank takes an equal share of each global batch)"));
  }
  if (o.global_batch % per_rank_parts != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--global-batch=", o.global_batch, ": expected a multiple of world size ",
                     world_size, " x --grad-accum=", o.grad_accum, " = ", per_rank_parts,
                     " (each rank splits its share into grad-accum equal micro-batches)"));
  }
  if (o.fsdp == FsdpApi::kFullyShard) {
    // What fully_shard does not do here: refused by name, never ignored.
    if (o.sharding == Sharding::kNone) {
      return absl::InvalidArgumentError(
          "--sharding=none with --fsdp=fully_shard: expected --sharding=full (reshard after "
          "forward), grad_op (keep the parameters gathered until backward) or hybrid (a 2-D "
          "mesh of replicas x shards); fully_shard always shards (use --fsdp=fsdp1 for none)");
    }
    if (o.backward_prefetch == BackwardPrefetch::kPost) {
      return absl::InvalidArgumentError(
          "--backward-prefetch=post with --fsdp=fully_shard: expected pre (each block "
          "prefetches the one before it in backward) or none; post is FSDP1's");
    }
  }
  if (o.sharding == Sharding::kHybrid) {
    if (auto shape = HybridMeshShape(world_size); !shape.ok()) return shape.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<int64_t, int64_t>> HybridMeshShape(int world_size) {
  for (int64_t shard = 2; shard < world_size; ++shard) {
    if (world_size % shard == 0 && shard * shard >= world_size) {
      return std::make_pair(static_cast<int64_t>(world_size) / shard, shard);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--sharding=hybrid with ", world_size, " rank", world_size == 1 ? "" : "s",
      ": expected a world size that forms a 2-D mesh of at least 2 replicas x 2 shards "
      "(4, 6, 8, 9, ...; --nproc=4 gives 2x2); use --sharding=full or none otherwise"));
}

const char* Name(ModelKind v) {
  switch (v) {
    case ModelKind::kMlp: return "mlp";
    case ModelKind::kTransformer: return "transformer";
    case ModelKind::kLlama: return "llama";
  }
  return "?";
}
const char* Name(ExportDtype v) { return v == ExportDtype::kBf16 ? "bfloat16" : "float32"; }
const char* Name(DataKind v) {
  switch (v) {
    case DataKind::kText: return "text";
    case DataKind::kSynthetic: return "synthetic";
    case DataKind::kFile: return "file";
  }
  return "?";
}
const char* Name(DataFormat v) {
  switch (v) {
    case DataFormat::kAuto: return "auto";
    case DataFormat::kBytes: return "bytes";
    case DataFormat::kTokens: return "tokens";
    case DataFormat::kText: return "text";
  }
  return "?";
}
const char* Name(FsdpApi v) { return v == FsdpApi::kFullyShard ? "fully_shard" : "fsdp1"; }
const char* Name(Sharding v) {
  switch (v) {
    case Sharding::kFull: return "full";
    case Sharding::kGradOp: return "grad_op";
    case Sharding::kNone: return "none";
    case Sharding::kHybrid: return "hybrid";
  }
  return "?";
}
const char* Name(MixedPrecision v) { return v == MixedPrecision::kNone ? "none" : "bf16"; }
const char* Name(Device v) { return v == Device::kCpu ? "cpu" : "cuda"; }
const char* Name(BackwardPrefetch v) {
  switch (v) {
    case BackwardPrefetch::kPre: return "pre";
    case BackwardPrefetch::kPost: return "post";
    case BackwardPrefetch::kNone: return "none";
  }
  return "?";
}
const char* Name(OptimizerKind v) {
  switch (v) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "?";
}
const char* Name(CudaGraphs v) {
  switch (v) {
    case CudaGraphs::kAuto: return "auto";
    case CudaGraphs::kOn: return "on";
    case CudaGraphs::kOff: return "off";
  }
  return "?";
}
const char* Name(LrSchedule v) { return v == LrSchedule::kConstant ? "constant" : "cosine"; }
const char* Name(ActivationCheckpointing v) {
  return v == ActivationCheckpointing::kBlock ? "block" : "none";
}
const char* Name(CheckpointFormat v) {
  return v == CheckpointFormat::kSharded ? "sharded" : "full";
}

std::string AutoWrapName(const Options& o) {
  switch (o.auto_wrap) {
    case AutoWrap::kBlock: return "block";
    case AutoWrap::kNone: return "none";
    case AutoWrap::kSize: return absl::StrCat("size:", o.auto_wrap_min_params);
  }
  return "?";
}

std::vector<std::string> ToArgs(const Options& o) {
  std::vector<std::string> a = {
      absl::StrCat("--model=", Name(o.model)),
      absl::StrCat("--data=", o.data == DataKind::kFile ? o.data_path : Name(o.data)),
      absl::StrCat("--data-format=", Name(o.data_format)),
      absl::StrCat("--eval-every=", o.eval_every),
      absl::StrCat("--allow-nonfinite-import=", o.allow_nonfinite_import ? "true" : "false"),
      absl::StrCat("--steps=", o.steps),
      absl::StrCat("--seed=", o.seed),
      absl::StrCat("--global-batch=", o.global_batch),
      absl::StrCat("--lr=", Exact(o.lr)),
      absl::StrCat("--nproc=", o.nproc),
      absl::StrCat("--threads-per-rank=", o.threads_per_rank),
      absl::StrCat("--bind-cores=", o.bind_cores ? "true" : "false"),
      absl::StrCat("--device=", Name(o.device)),
      absl::StrCat("--fsdp=", Name(o.fsdp)),
      absl::StrCat("--sharding=", Name(o.sharding)),
      absl::StrCat("--mixed-precision=", Name(o.mixed_precision)),
      absl::StrCat("--cpu-offload=", o.cpu_offload ? "true" : "false"),
      absl::StrCat("--auto-wrap=", AutoWrapName(o)),
      absl::StrCat("--backward-prefetch=", Name(o.backward_prefetch)),
      absl::StrCat("--activation-checkpointing=", Name(o.activation_checkpointing)),
      absl::StrCat("--grad-accum=", o.grad_accum),
      absl::StrCat("--clip=", Exact(o.clip)),
      absl::StrCat("--optimizer=", Name(o.optimizer)),
      absl::StrCat("--lr-schedule=", Name(o.lr_schedule)),
      absl::StrCat("--warmup-steps=", o.warmup_steps),
      absl::StrCat("--seq=", o.seq),
      absl::StrCat("--checkpoint-every=", o.checkpoint_every),
      absl::StrCat("--checkpoint-format=", Name(o.checkpoint_format)),
      absl::StrCat("--resume=", o.resume ? "true" : "false"),
      absl::StrCat("--keep-last=", o.keep_last),
      absl::StrCat("--async-checkpoint=", o.async_checkpoint ? "true" : "false"),
      absl::StrCat("--cuda-graphs=", Name(o.cuda_graphs)),
  };
  if (o.model == ModelKind::kLlama) {
    // Its shape is its config.json's (ParseOptions refuses the shape flags).
    if (!o.hf_checkpoint.empty()) a.push_back("--hf-checkpoint=" + o.hf_checkpoint);
    if (!o.model_config.empty()) a.push_back("--model-config=" + o.model_config);
    if (!o.export_hf.empty()) {
      a.push_back("--export-hf=" + o.export_hf);
      a.push_back(absl::StrCat("--export-hf-dtype=", Name(o.export_hf_dtype)));
      a.push_back(absl::StrCat("--export-hf-max-shard-bytes=", o.export_hf_max_shard_bytes));
    }
  } else {
    for (const std::string& flag :
         {absl::StrCat("--layers=", o.layers), absl::StrCat("--dim=", o.dim),
          absl::StrCat("--heads=", o.heads), absl::StrCat("--vocab=", o.vocab)}) {
      a.push_back(flag);
    }
  }
  // Not --max-restarts: restarting is the launcher's job, not the ranks'.
  if (o.timeout_s > 0) a.push_back("--timeout=" + Exact(o.timeout_s));
  if (!o.checkpoint_dir.empty()) a.push_back("--checkpoint-dir=" + o.checkpoint_dir);
  if (!o.import_dcp.empty()) a.push_back("--import-dcp=" + o.import_dcp);
  if (!o.export_dcp.empty()) a.push_back("--export-dcp=" + o.export_dcp);
  if (!o.log_json.empty()) a.push_back("--log-json=" + o.log_json);
  if (!o.tokenizer.empty()) a.push_back("--tokenizer=" + o.tokenizer);
  if (o.float8) a.push_back("--float8");
  if (o.float8_all_gather) a.push_back("--float8-all-gather");
  if (o.profile_step > 0) {
    a.push_back(absl::StrCat("--profile-step=", o.profile_step));
    a.push_back("--profile-trace=" + o.profile_trace);
  }
  return a;
}

std::string Usage() {
  Options defaults;
  CLI::App app;
  DefineFlags(app, defaults);
  return app.help();
}

}  // namespace trainer
