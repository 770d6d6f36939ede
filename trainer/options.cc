#include "trainer/options.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"

namespace trainer {
namespace {

absl::Status BadValue(const std::string& flag, const std::string& value,
                      const std::string& expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "='", value, "': expected ", expected));
}

template <typename Enum>
absl::Status ParseEnum(const std::string& flag, const std::string& value,
                       const std::vector<std::pair<const char*, Enum>>& choices,
                       Enum* out) {
  std::vector<std::string> names;
  for (const auto& [name, v] : choices) {
    if (value == name) {
      *out = v;
      return absl::OkStatus();
    }
    names.push_back(name);
  }
  return BadValue(flag, value, absl::StrCat("one of ", absl::StrJoin(names, "|")));
}

absl::Status ParseInt(const std::string& flag, const std::string& value,
                      int64_t min, int64_t* out) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v)) {
    return BadValue(flag, value, "an integer");
  }
  if (v < min) {
    return BadValue(flag, value, absl::StrCat("an integer >= ", min));
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseDouble(const std::string& flag, const std::string& value,
                         bool allow_zero, double* out) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v)) {
    return BadValue(flag, value, "a finite number");
  }
  if (v < 0 || (!allow_zero && v == 0)) {
    return BadValue(flag, value, allow_zero ? "a number >= 0" : "a number > 0");
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseBool(const std::string& flag, const std::string& value,
                       bool* out) {
  if (value == "true" || value == "1") {
    *out = true;
  } else if (value == "false" || value == "0") {
    *out = false;
  } else {
    return BadValue(flag, value, "true|false (or the bare flag for true)");
  }
  return absl::OkStatus();
}

absl::Status ParseAutoWrap(const std::string& value, Options* o) {
  if (value == "block") {
    o->auto_wrap = AutoWrap::kBlock;
  } else if (value == "none") {
    o->auto_wrap = AutoWrap::kNone;
  } else if (absl::StartsWith(value, "size:")) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(value.substr(5), &n) || n <= 0) {
      return BadValue("auto-wrap", value,
                      "block|none|size:N with N a positive parameter count");
    }
    o->auto_wrap = AutoWrap::kSize;
    o->auto_wrap_min_params = n;
  } else {
    return BadValue("auto-wrap", value, "block|none|size:N");
  }
  return absl::OkStatus();
}

using Setter = std::function<absl::Status(const std::string& value, Options*)>;

struct FlagSpec {
  bool is_bool = false;
  Setter set;
};

const std::map<std::string, FlagSpec>& Flags() {
  static const auto* flags = new std::map<std::string, FlagSpec>{
      {"model", {false, [](const std::string& v, Options* o) {
         return ParseEnum<ModelKind>("model", v,
             {{"mlp", ModelKind::kMlp}, {"transformer", ModelKind::kTransformer}},
             &o->model);
       }}},
      {"data", {false, [](const std::string& v, Options* o) {
         return ParseEnum<DataKind>("data", v,
             {{"text", DataKind::kText}, {"synthetic", DataKind::kSynthetic}},
             &o->data);
       }}},
      {"steps", {false, [](const std::string& v, Options* o) {
         return ParseInt("steps", v, 1, &o->steps);
       }}},
      {"seed", {false, [](const std::string& v, Options* o) {
         return ParseInt("seed", v, 0, &o->seed);
       }}},
      {"global-batch", {false, [](const std::string& v, Options* o) {
         return ParseInt("global-batch", v, 1, &o->global_batch);
       }}},
      {"lr", {false, [](const std::string& v, Options* o) {
         return ParseDouble("lr", v, false, &o->lr);
       }}},
      {"nproc", {false, [](const std::string& v, Options* o) {
         int64_t n = 0;
         auto s = ParseInt("nproc", v, 1, &n);
         if (s.ok() && n > 1024) return BadValue("nproc", v, "an integer in [1, 1024]");
         o->nproc = static_cast<int>(n);
         o->nproc_given = true;
         return s;
       }}},
      {"threads-per-rank", {false, [](const std::string& v, Options* o) {
         int64_t n = 0;
         auto s = ParseInt("threads-per-rank", v, 0, &n);
         if (s.ok() && n > 4096) {
           return BadValue("threads-per-rank", v, "an integer in [0, 4096]");
         }
         o->threads_per_rank = static_cast<int>(n);
         return s;
       }}},
      {"timeout", {false, [](const std::string& v, Options* o) {
         auto s = ParseDouble("timeout", v, false, &o->timeout_s);
         if (s.ok() && o->timeout_s > 1e7) {
           return BadValue("timeout", v, "a number of seconds in (0, 1e7]");
         }
         return s;
       }}},
      {"max-restarts", {false, [](const std::string& v, Options* o) {
         int64_t n = 0;
         auto s = ParseInt("max-restarts", v, 0, &n);
         if (s.ok() && n > 1000) return BadValue("max-restarts", v, "an integer in [0, 1000]");
         o->max_restarts = static_cast<int>(n);
         return s;
       }}},
      {"sharding", {false, [](const std::string& v, Options* o) {
         return ParseEnum<Sharding>("sharding", v,
             {{"full", Sharding::kFull}, {"grad_op", Sharding::kGradOp},
              {"none", Sharding::kNone}, {"hybrid", Sharding::kHybrid}},
             &o->sharding);
       }}},
      {"mixed-precision", {false, [](const std::string& v, Options* o) {
         return ParseEnum<MixedPrecision>("mixed-precision", v,
             {{"none", MixedPrecision::kNone}, {"bf16", MixedPrecision::kBf16}},
             &o->mixed_precision);
       }}},
      {"cpu-offload", {true, [](const std::string& v, Options* o) {
         return ParseBool("cpu-offload", v, &o->cpu_offload);
       }}},
      {"auto-wrap", {false, ParseAutoWrap}},
      {"backward-prefetch", {false, [](const std::string& v, Options* o) {
         return ParseEnum<BackwardPrefetch>("backward-prefetch", v,
             {{"pre", BackwardPrefetch::kPre}, {"post", BackwardPrefetch::kPost},
              {"none", BackwardPrefetch::kNone}},
             &o->backward_prefetch);
       }}},
      {"activation-checkpointing", {false, [](const std::string& v, Options* o) {
         return ParseEnum<ActivationCheckpointing>("activation-checkpointing", v,
             {{"none", ActivationCheckpointing::kNone}, {"block", ActivationCheckpointing::kBlock}},
             &o->activation_checkpointing);
       }}},
      {"grad-accum", {false, [](const std::string& v, Options* o) {
         return ParseInt("grad-accum", v, 1, &o->grad_accum);
       }}},
      {"clip", {false, [](const std::string& v, Options* o) {
         return ParseDouble("clip", v, true, &o->clip);
       }}},
      {"optimizer", {false, [](const std::string& v, Options* o) {
         return ParseEnum<OptimizerKind>("optimizer", v,
             {{"adam", OptimizerKind::kAdam}, {"adamw", OptimizerKind::kAdamW},
              {"sgd", OptimizerKind::kSgd}},
             &o->optimizer);
       }}},
      {"lr-schedule", {false, [](const std::string& v, Options* o) {
         return ParseEnum<LrSchedule>("lr-schedule", v,
             {{"constant", LrSchedule::kConstant}, {"cosine", LrSchedule::kCosine}},
             &o->lr_schedule);
       }}},
      {"warmup-steps", {false, [](const std::string& v, Options* o) {
         return ParseInt("warmup-steps", v, 0, &o->warmup_steps);
       }}},
      {"layers", {false, [](const std::string& v, Options* o) {
         return ParseInt("layers", v, 1, &o->layers);
       }}},
      {"dim", {false, [](const std::string& v, Options* o) {
         return ParseInt("dim", v, 1, &o->dim);
       }}},
      {"heads", {false, [](const std::string& v, Options* o) {
         return ParseInt("heads", v, 1, &o->heads);
       }}},
      {"vocab", {false, [](const std::string& v, Options* o) {
         return ParseInt("vocab", v, 2, &o->vocab);
       }}},
      {"seq", {false, [](const std::string& v, Options* o) {
         return ParseInt("seq", v, 1, &o->seq);
       }}},
      {"checkpoint-dir", {false, [](const std::string& v, Options* o) {
         if (v.empty()) return BadValue("checkpoint-dir", v, "a directory path");
         o->checkpoint_dir = v;
         return absl::OkStatus();
       }}},
      {"checkpoint-every", {false, [](const std::string& v, Options* o) {
         return ParseInt("checkpoint-every", v, 0, &o->checkpoint_every);
       }}},
      {"checkpoint-format", {false, [](const std::string& v, Options* o) {
         return ParseEnum<CheckpointFormat>("checkpoint-format", v,
             {{"sharded", CheckpointFormat::kSharded}, {"full", CheckpointFormat::kFull}},
             &o->checkpoint_format);
       }}},
      {"keep-last", {false, [](const std::string& v, Options* o) {
         return ParseInt("keep-last", v, 0, &o->keep_last);
       }}},
      {"async-checkpoint", {true, [](const std::string& v, Options* o) {
         return ParseBool("async-checkpoint", v, &o->async_checkpoint);
       }}},
      {"resume", {true, [](const std::string& v, Options* o) {
         return ParseBool("resume", v, &o->resume);
       }}},
      {"log-json", {false, [](const std::string& v, Options* o) {
         if (v.empty()) return BadValue("log-json", v, "a file path");
         o->log_json = v;
         return absl::OkStatus();
       }}},
      {"help", {true, [](const std::string& v, Options* o) {
         return ParseBool("help", v, &o->help);
       }}},
  };
  return *flags;
}

}  // namespace

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  Options options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h") {
      options.help = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unexpected argument '", arg, "': expected a flag --NAME[=VALUE] (see --help)"));
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = Flags().find(name);
    if (it == Flags().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (!has_value) {
      if (it->second.is_bool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": missing value"));
      }
    }
    if (absl::Status s = it->second.set(value, &options); !s.ok()) return s;
  }
  if (options.help) return options;
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  return options;
}

absl::Status ValidateOptions(const Options& o) {
  if (o.model == ModelKind::kTransformer && o.dim % o.heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--heads=", o.heads, ": expected a divisor of --dim=", o.dim,
        " (each attention head gets dim/heads features)"));
  }
  if (o.data == DataKind::kText && o.vocab < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab=", o.vocab,
        ": expected >= 256 with --data=text (the corpus is byte-level)"));
  }
  if (o.resume && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--resume: expected --checkpoint-dir to name the directory to resume from");
  }
  if (o.async_checkpoint && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--async-checkpoint: expected --checkpoint-dir to say where checkpoints go");
  }
  if (o.keep_last > 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--keep-last=", o.keep_last,
        ": expected --checkpoint-dir to say which checkpoints to keep"));
  }
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-every=", o.checkpoint_every,
        ": expected --checkpoint-dir to say where checkpoints go"));
  }
  return absl::OkStatus();
}

absl::Status CheckFeatureAvailability(const Options& o, int world_size) {
  const int64_t per_rank_parts = static_cast<int64_t>(world_size) * o.grad_accum;
  if (o.global_batch % world_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--global-batch=", o.global_batch, ": expected a multiple of the world size ",
        world_size, " (every rank takes an equal share of each global batch)"));
  }
  if (o.global_batch % per_rank_parts != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--global-batch=", o.global_batch, ": expected a multiple of world size ",
        world_size, " x --grad-accum=", o.grad_accum, " = ", per_rank_parts,
        " (each rank splits its share into grad-accum equal micro-batches)"));
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

const char* Name(ModelKind v) { return v == ModelKind::kMlp ? "mlp" : "transformer"; }
const char* Name(DataKind v) { return v == DataKind::kText ? "text" : "synthetic"; }
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
  // %.17g round-trips doubles exactly, so every rank sees the same lr.
  auto exact = [](double d) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", d);
    return std::string(buf);
  };
  std::vector<std::string> a = {
      absl::StrCat("--model=", Name(o.model)),
      absl::StrCat("--data=", Name(o.data)),
      absl::StrCat("--steps=", o.steps),
      absl::StrCat("--seed=", o.seed),
      absl::StrCat("--global-batch=", o.global_batch),
      absl::StrCat("--lr=", exact(o.lr)),
      absl::StrCat("--nproc=", o.nproc),
      absl::StrCat("--threads-per-rank=", o.threads_per_rank),
      absl::StrCat("--sharding=", Name(o.sharding)),
      absl::StrCat("--mixed-precision=", Name(o.mixed_precision)),
      absl::StrCat("--cpu-offload=", o.cpu_offload ? "true" : "false"),
      absl::StrCat("--auto-wrap=", AutoWrapName(o)),
      absl::StrCat("--backward-prefetch=", Name(o.backward_prefetch)),
      absl::StrCat("--activation-checkpointing=", Name(o.activation_checkpointing)),
      absl::StrCat("--grad-accum=", o.grad_accum),
      absl::StrCat("--clip=", exact(o.clip)),
      absl::StrCat("--optimizer=", Name(o.optimizer)),
      absl::StrCat("--lr-schedule=", Name(o.lr_schedule)),
      absl::StrCat("--warmup-steps=", o.warmup_steps),
      absl::StrCat("--layers=", o.layers),
      absl::StrCat("--dim=", o.dim),
      absl::StrCat("--heads=", o.heads),
      absl::StrCat("--vocab=", o.vocab),
      absl::StrCat("--seq=", o.seq),
      absl::StrCat("--checkpoint-every=", o.checkpoint_every),
      absl::StrCat("--checkpoint-format=", Name(o.checkpoint_format)),
      absl::StrCat("--resume=", o.resume ? "true" : "false"),
      absl::StrCat("--keep-last=", o.keep_last),
      absl::StrCat("--async-checkpoint=", o.async_checkpoint ? "true" : "false"),
  };
  // Not --max-restarts: restarting is the launcher's job, not the ranks'.
  if (o.timeout_s > 0) a.push_back("--timeout=" + exact(o.timeout_s));
  if (!o.checkpoint_dir.empty()) a.push_back("--checkpoint-dir=" + o.checkpoint_dir);
  if (!o.log_json.empty()) a.push_back("--log-json=" + o.log_json);
  return a;
}

std::string Usage() {
  const Options d;
  return absl::StrCat(
      "usage: trainer [FLAGS]   (flags take --name VALUE or --name=VALUE)\n"
      "  --model mlp|transformer        (", Name(d.model), ")\n"
      "  --data text|synthetic          (", Name(d.data), ") text: /usr/share/common-licenses, byte-level\n"
      "  --steps N                      (", d.steps, ")\n"
      "  --seed N                       (", d.seed, ")\n"
      "  --global-batch N               (", d.global_batch, ") sequences per step, split across ranks\n"
      "  --lr X                         (", d.lr, ")\n"
      "  --nproc N                      (", d.nproc, ") ranks to start through comm's launcher\n"
      "  --threads-per-rank N           (0 = OMP_NUM_THREADS if set, else cores / ranks)\n"
      "  --timeout SECONDS              collective timeout: a rank waiting this long for a\n"
      "                                 hung peer fails (default: the launcher's, else 600)\n"
      "  --max-restarts N               (0) restart every rank after one fails, up to N\n"
      "                                 times; resumes from --checkpoint-dir's newest\n"
      "  --sharding full|grad_op|none|hybrid   (", Name(d.sharding), ")\n"
      "  --mixed-precision none|bf16    (", Name(d.mixed_precision), ")\n"
      "  --cpu-offload                  (off)\n"
      "  --auto-wrap block|size:N|none  (", AutoWrapName(d), ")\n"
      "  --backward-prefetch pre|post|none   (", Name(d.backward_prefetch), ")\n"
      "  --activation-checkpointing block|none   (", Name(d.activation_checkpointing),
      ") block: recompute each transformer\n"
      "                                 block's activations in backward instead of keeping them\n"
      "      (hybrid: 2-D mesh replicas x shards, e.g. 2x2 on --nproc 4;\n"
      "       bf16: bfloat16 compute, float32 reduction and optimizer)\n"
      "  --grad-accum K                 (", d.grad_accum, ") micro-batches per optimizer step\n"
      "  --clip X                       (0 = off) max global gradient norm\n"
      "  --optimizer adam|adamw|sgd     (", Name(d.optimizer), ")\n"
      "  --lr-schedule constant|cosine  (", Name(d.lr_schedule), ")\n"
      "  --warmup-steps N               (", d.warmup_steps, ")\n"
      "  --layers N --dim N --heads N --vocab N --seq N   (", d.layers, " ", d.dim,
      " ", d.heads, " ", d.vocab, " ", d.seq, ")\n"
      "  --checkpoint-dir DIR           checkpoints go to DIR/step_<N>\n"
      "  --checkpoint-every K           (0 = only at the end, with --checkpoint-dir)\n"
      "  --checkpoint-format sharded|full   (", Name(d.checkpoint_format), ") sharded: each rank\n"
      "                                 writes its pieces; full: rank 0 writes model.pt\n"
      "  --keep-last K                  (0 = all) after each checkpoint, remove complete\n"
      "                                 ones older than the newest K (and crash debris)\n"
      "  --async-checkpoint             write checkpoints in the background from a\n"
      "                                 snapshot while the next steps run\n"
      "  --resume                       continue from the newest checkpoint in DIR\n"
      "  --log-json FILE                one JSON object per step (rank 0)\n");
}

}  // namespace trainer
