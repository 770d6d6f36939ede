// generate: continue prompts with a Llama-family model (models/generation.h),
// or score a file under it; C++ only.
//
//   bazel run //tools:generate -- --hf-checkpoint DIR --tokenizer tokenizer.json \
//       --prompt "Once upon a time" [--prompt "..."] [--max-new-tokens 64] \
//       [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 1] [--output text|ids|json]
//   bazel run //tools:generate -- --hf-checkpoint DIR --prompt-ids '[[1, 2, 3], [4, 5]]'
//   bazel run //tools:generate -- --hf-checkpoint DIR --tokenizer tokenizer.json --score a.txt
//   bazel run //tools:generate -- --checkpoint-dir RUN --model-config config.json --prompt-ids ...
//
// The model: a Hugging Face checkpoint directory (--hf-checkpoint), or the
// trainer's own checkpoints (--checkpoint-dir: the newest complete step of
// the root, or one step_<N>; FULL or sharded, any world size) with the
// config.json the run trained (--model-config).
// Prompts: --prompt TEXT (repeatable, encoded with --tokenizer and its
// post-processor, e.g. Llama 3's BOS, unless --no-special-tokens),
// --prompt-ids JSON (a list of id lists), or --prompts-file F (JSON Lines:
// each line a string, a list of ids, or an object with "text" or "ids").
// All prompts run as one batch, left-padded (the config's pad_token_id, else
// its first EOS, else 0) and masked, each row giving its unbatched result.
// Greedy by default; --temperature T > 0 samples (then --top-k, --top-p,
// --seed). A row stops at the config's eos_token_id (--ignore-eos: never).
//
// Output: text (each prompt with its continuation, decoded; needs
// --tokenizer), ids (one JSON list of new ids per line) or json (one object
// per line: "prompt_ids", "ids", "stop" ("eos" or "length"), and "text", the
// continuation decoded, with --tokenizer). Default: text with a tokenizer,
// else ids.
//
// --score FILE: the file's tokens (a token file as the trainer reads it:
// llm.c's uint16/uint32 header or a *.bin, what //tools:tokenize writes;
// else text with --tokenizer, else a JSON list of ids) through the model in windows of at most
// max_position_embeddings tokens (each window's first token is the last one's last, so every token
// after the first is predicted once); prints JSON with the mean loss
// (nats), the perplexity and each token's loss.
//
// --benchmark: after the output, one JSON line on stderr with the prompt
// step's time, tokens/s of the new tokens and the mean time per token at
// several depths (to see that a token's cost does not grow with the
// sequence).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <c10/core/InferenceMode.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "CLI/CLI.hpp"
#include "formats/io/file_io.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/generation.h"
#include "models/llama.h"
#include "models/llama_config.h"
#include "nlohmann/json.hpp"
#include "state_dict/checkpoint.h"
#include "state_dict/hf_checkpoint.h"
#include "tokenizer/tokenizer.h"
#include "trainer/data.h"
#include "trainer/options.h"

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "generate: %s\n", message.c_str());
  return 1;
}

std::string Dump(const nlohmann::json& json) {
  return json.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// A JSON list of integer ids, or an error naming `where`.
absl::StatusOr<std::vector<int64_t>> IdList(const nlohmann::json& json, const std::string& where) {
  if (!json.is_array())
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected a list of ids"));
  std::vector<int64_t> ids;
  for (const auto& id : json) {
    if (!id.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", Dump(id), " is not an integer id"));
    }
    ids.push_back(id.get<int64_t>());
  }
  return ids;
}

struct Inputs {
  std::vector<std::string> prompts;
  std::string prompt_ids, prompts_file;
};

// The prompts as ids, in flag order: --prompt texts, --prompt-ids, then the
// --prompts-file lines.
absl::StatusOr<std::vector<std::vector<int64_t>>> ReadPrompts(
    const Inputs& in, const tokenizer::Tokenizer* tok, const tokenizer::EncodeOptions& encode) {
  std::vector<std::vector<int64_t>> prompts;
  auto add_text = [&](const std::string& text, const std::string& where) -> absl::Status {
    if (tok == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": a text prompt needs --tokenizer tokenizer.json"));
    }
    auto ids = tok->Encode(text, encode);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", ids.status().message()));
    prompts.emplace_back(ids->begin(), ids->end());
    return absl::OkStatus();
  };
  for (size_t i = 0; i < in.prompts.size(); ++i) {
    if (auto s = add_text(in.prompts[i], absl::StrCat("--prompt #", i + 1)); !s.ok()) return s;
  }
  if (!in.prompt_ids.empty()) {
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(in.prompt_ids);
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: not JSON: ", e.what()));
    }
    if (!json.is_array() || json.empty()) {
      return absl::InvalidArgumentError(
          "--prompt-ids: expected a list of id lists, e.g. [[1, 2, 3], [4, 5]]");
    }
    for (size_t i = 0; i < json.size(); ++i) {
      auto ids = IdList(json[i], absl::StrCat("--prompt-ids[", i, "]"));
      if (!ids.ok()) return ids.status();
      prompts.push_back(*std::move(ids));
    }
  }
  if (!in.prompts_file.empty()) {
    auto read = formats::ReadFile(in.prompts_file);
    if (!read.ok()) {
      return absl::NotFoundError(
          absl::StrCat("--prompts-file ", in.prompts_file, ": cannot be read"));
    }
    const std::string& contents = *read;
    std::istringstream lines(contents);
    std::string line;
    for (int64_t number = 1; std::getline(lines, line); ++number) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = absl::StrCat(in.prompts_file, ":", number);
      nlohmann::json json;
      try {
        json = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": not JSON: ", e.what()));
      }
      if (json.is_object() && json.contains("text"))
        json = json["text"];
      else if (json.is_object() && json.contains("ids"))
        json = json["ids"];
      if (json.is_string()) {
        if (auto s = add_text(json.get<std::string>(), where); !s.ok()) return s;
      } else if (json.is_array()) {
        auto ids = IdList(json, where);
        if (!ids.ok()) return ids.status();
        prompts.push_back(*std::move(ids));
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": expected a string, a list of ids, or an object with \"text\" or \"ids\""));
      }
    }
  }
  return prompts;
}

std::string Decode(const tokenizer::Tokenizer& tok, const std::vector<int64_t>& ids) {
  std::vector<tokenizer::TokenId> narrow(ids.begin(), ids.end());
  auto text = tok.Decode(narrow);
  return text.ok() ? *text : absl::StrCat("<", text.status().message(), ">");
}

// --score: per-token losses of `ids` in windows of at most `window` tokens.
int Score(models::LlamaForCausalLMImpl& model, const std::vector<int64_t>& ids,
          const tokenizer::Tokenizer* tok, const std::string& path, c10::Device device) {
  const int64_t vocab = model.config().vocab_size;
  const int64_t window = model.config().max_position_embeddings;
  if (ids.size() < 2) {
    return Fail(absl::StrCat("--score ", path, ": ", ids.size(),
                             " tokens; expected at least 2 (the first is never predicted)"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return Fail(absl::StrCat("--score ", path, ": id ", ids[i], " at index ", i,
                               " is outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  c10::InferenceMode inference;  // no autograd bookkeeping at all (NoGradGuard keeps some)
  const torch::Tensor all = torch::tensor(ids, torch::kLong);
  std::vector<double> losses;
  const int64_t n = all.size(0);
  for (int64_t start = 0; start < n - 1; start += window - 1) {
    const int64_t end = std::min(n, start + window);
    const torch::Tensor chunk = all.narrow(0, start, end - start).to(device).unsqueeze(0);
    const torch::Tensor logits = model.forward(chunk.narrow(1, 0, end - start - 1));
    const torch::Tensor loss = torch::nn::functional::cross_entropy(
        logits[0].to(torch::kFloat), chunk[0].narrow(0, 1, end - start - 1),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    const torch::Tensor cpu = loss.to(torch::kDouble).cpu();
    losses.insert(losses.end(), cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel());
  }
  double sum = 0;
  for (double l : losses) sum += l;
  const double mean = sum / losses.size();
  nlohmann::json out;
  out["file"] = path;
  out["tokens"] = n;
  out["predicted"] = losses.size();
  out["window"] = window;
  out["loss"] = mean;
  out["perplexity"] = std::exp(mean);
  out["per_token"] = nlohmann::json::array();
  for (int64_t i = 1; i < n; ++i) {
    nlohmann::json t = {{"index", i}, {"id", ids[i]}, {"loss", losses[i - 1]}};
    if (tok != nullptr) {
      auto token = tok->IdToToken(static_cast<tokenizer::TokenId>(ids[i]));
      if (token) t["token"] = std::string(*token);
    }
    out["per_token"].push_back(std::move(t));
  }
  std::printf("%s\n", Dump(out).c_str());
  return 0;
}

// --checkpoint-dir: every parameter of `model` from a trainer checkpoint,
// `dir` being --checkpoint-dir's root (its newest complete step) or one
// step_<N> directory. FULL (model.pt): the "model.<fqn>" records; SHARDED
// (rank_*.pt of any world size): each parameter whole, gathered from the
// ranks' pieces (state_dict's reshard on load, to one rank).
absl::Status LoadTrainerCheckpoint(models::LlamaForCausalLMImpl& model, const std::string& dir) {
  std::string step_dir = dir;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "MANIFEST")) {
    auto latest = state_dict::LatestCheckpoint(dir);
    if (!latest.ok()) {
      return absl::NotFoundError(absl::StrCat(
          dir, ": neither a step directory (no MANIFEST) nor a checkpoint root with a complete ",
          "checkpoint: ", latest.status().message()));
    }
    step_dir = *latest;
  }
  torch::NoGradGuard no_grad;
  if (std::filesystem::exists(std::filesystem::path(step_dir) / "model.pt")) {
    auto saved = state_dict::LoadFullStateDict(step_dir);
    if (!saved.ok()) return saved.status();
    for (auto& p : model.named_parameters()) {
      const torch::Tensor* t = saved->find("model." + p.key());
      if (t == nullptr) {
        return absl::NotFoundError(absl::StrCat(step_dir, "/model.pt has no model.", p.key(),
                                                ": not a checkpoint of this model (config)"));
      }
      if (t->sizes() != p.value().sizes()) {
        return absl::InvalidArgumentError(
            absl::StrCat(step_dir, "/model.pt: model.", p.key(), " is [",
                         absl::StrJoin(t->sizes(), ", "), "], the model's [",
                         absl::StrJoin(p.value().sizes(), ", "), "]: another model's checkpoint"));
      }
      p.value().copy_(*t);
    }
    return absl::OkStatus();
  }
  std::vector<std::pair<std::string, state_dict::ShardRequest>> requests;
  for (const auto& p : model.named_parameters()) {
    state_dict::ShardRequest request;
    request.global_shape = p.value().sizes().vec();
    request.dtype = p.value().scalar_type();
    request.ranges = {{0, p.value().numel()}};
    requests.emplace_back(p.key(), std::move(request));
  }
  auto loaded = state_dict::LoadResharded(step_dir, requests);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat(step_dir, ": ", loaded.status().message()));
  }
  for (auto& p : model.named_parameters()) {
    const state_dict::ShardedTensor* t = loaded->find(p.key());
    if (t == nullptr || t->pieces.size() != 1) {
      return absl::NotFoundError(absl::StrCat(step_dir, ": no whole ", p.key()));
    }
    p.value().view({-1}).copy_(t->pieces[0].data.reshape({-1}));
  }
  return absl::OkStatus();
}

// Mean seconds per token over steps [from, from + 16), when generated.
void AddDepth(nlohmann::json& json, const std::vector<double>& steps, int64_t from) {
  if (static_cast<int64_t>(steps.size()) < from + 16) return;
  double sum = 0;
  for (int64_t i = from; i < from + 16; ++i) sum += steps[i];
  json["ms_per_token_at"][std::to_string(from)] = sum / 16 * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("generate: continue prompts with a Llama-family model, or score a file");
  std::string hf_checkpoint, checkpoint_dir, model_config, tokenizer_path, output,
      device_name = "cpu", dtype_name = "float32", score;
  Inputs inputs;
  models::GenerationOptions options;
  options.max_new_tokens = 32;
  bool greedy = false, ignore_eos = false, no_cache = false, no_special_tokens = false,
       benchmark = false;
  app.add_option("--hf-checkpoint", hf_checkpoint,
                 "a Hugging Face checkpoint directory (config.json + safetensors)");
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "a trainer checkpoint (FULL or sharded): its root (the newest step) or a step_<N> "
                 "directory; with --model-config");
  app.add_option("--model-config", model_config,
                 "--checkpoint-dir: the config.json the run trained");
  app.add_option("--tokenizer", tokenizer_path,
                 "the tokenizer.json or tokenizer.model (text prompts and output)");
  app.add_option("--prompt", inputs.prompts, "a text prompt (repeat for a batch)");
  app.add_option("--prompt-ids", inputs.prompt_ids, "prompts as ids, JSON: [[1, 2, 3], [4, 5]]");
  app.add_option(
      "--prompts-file", inputs.prompts_file,
      "JSON Lines: a string, a list of ids, or {\"text\": ...} / {\"ids\": [...]} per line");
  app.add_flag("--no-special-tokens", no_special_tokens,
               "encode text prompts without the post-processor's special tokens (e.g. BOS)");
  app.add_option("--output", output, "text|ids|json (default: text with --tokenizer, else ids)")
      ->check(CLI::IsMember({"text", "ids", "json"}));
  app.add_flag("--greedy", greedy, "argmax decoding (the default; --temperature 0 is the same)");
  app.add_option("--temperature", options.temperature, "sample at this temperature (0: greedy)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", options.top_k, "sample from the K likeliest tokens (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", options.top_p, "sample from the smallest set reaching P (1: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", options.seed, "the sampling generator's seed");
  app.add_option("--max-new-tokens", options.max_new_tokens, "tokens to generate per prompt")
      ->check(CLI::PositiveNumber);
  app.add_flag("--ignore-eos", ignore_eos, "do not stop at the config's eos_token_id");
  app.add_option("--device", device_name, "cpu|cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype_name, "float32|bfloat16")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_flag("--no-cache", no_cache,
               "recompute the whole sequence at every step (no key/value cache)");
  app.add_option("--score", score,
                 "print the per-token loss and perplexity of this file (a token file as the "
                 "trainer reads it: llm.c's header or *.bin; text with --tokenizer; else a "
                 "JSON list of ids)");
  app.add_flag("--benchmark", benchmark, "print timings as JSON on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  options.use_cache = !no_cache;
  if (greedy && options.temperature > 0) {
    return Fail(absl::StrCat("--greedy and --temperature ", options.temperature,
                             ": choose one (--temperature 0 is greedy)"));
  }
  if (checkpoint_dir.empty() == hf_checkpoint.empty()) {
    return Fail(
        "expected the model from --hf-checkpoint DIR or --checkpoint-dir DIR, one of the two");
  }
  if (!hf_checkpoint.empty() && !model_config.empty()) {
    return Fail("--model-config goes with --checkpoint-dir; --hf-checkpoint has its config.json");
  }
  if (!checkpoint_dir.empty() && model_config.empty()) {
    return Fail(absl::StrCat("--checkpoint-dir ", checkpoint_dir,
                             ": needs --model-config FILE, the config.json the run trained (a "
                             "trainer checkpoint holds no config)"));
  }
  const bool has_prompts =
      !inputs.prompts.empty() || !inputs.prompt_ids.empty() || !inputs.prompts_file.empty();
  if (score.empty() == !has_prompts) {
    return Fail(
        "expected prompts (--prompt, --prompt-ids, --prompts-file) or --score FILE, one of the "
        "two");
  }
  if (output.empty()) output = tokenizer_path.empty() ? "ids" : "text";
  if (output == "text" && tokenizer_path.empty()) {
    return Fail("--output text: needs --tokenizer tokenizer.json (or use --output ids|json)");
  }
  const c10::Device device =
      device_name == "cuda" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    return Fail(
        "--device cuda: no CUDA device is available to this LibTorch (or this build has no CUDA)");
  }
  const c10::ScalarType dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat;

  const std::string model_flag = hf_checkpoint.empty() ? "--checkpoint-dir" : "--hf-checkpoint";
  const std::string model_dir = hf_checkpoint.empty() ? checkpoint_dir : hf_checkpoint;
  const std::string config_path =
      model_config.empty() ? hf_checkpoint + "/config.json" : model_config;
  auto config = models::ReadLlamaConfig(config_path);
  if (!config.ok()) {
    return Fail(absl::StrCat(model_config.empty() ? "--hf-checkpoint" : "--model-config", ": ",
                             config.status().message()));
  }

  std::optional<tokenizer::Tokenizer> tok;
  if (!tokenizer_path.empty()) {
    auto loaded = tokenizer::Tokenizer::FromFile(tokenizer_path);
    if (!loaded.ok()) return Fail(absl::StrCat("--tokenizer: ", loaded.status().message()));
    tok.emplace(*std::move(loaded));
    if (tok->vocab_size() > config->vocab_size) {
      return Fail(absl::StrCat("--tokenizer ", tokenizer_path, " has ", tok->vocab_size(),
                               " ids, more than the model's vocab_size ", config->vocab_size, " (",
                               config_path, "): not this model's tokenizer"));
    }
  }

  models::LlamaForCausalLM model(*config, c10::kCPU, /*init_seed=*/std::nullopt);
  const absl::Status loaded = hf_checkpoint.empty()
                                  ? LoadTrainerCheckpoint(*model, checkpoint_dir)
                                  : state_dict::LoadHfCheckpoint(*model, hf_checkpoint);
  if (!loaded.ok()) return Fail(absl::StrCat(model_flag, ": ", loaded.message()));
  model->to(device, dtype);
  model->eval();

  tokenizer::EncodeOptions encode;
  encode.add_special_tokens = !no_special_tokens;
  const tokenizer::Tokenizer* tok_ptr = tok ? &*tok : nullptr;
  if (!score.empty()) {
    std::vector<int64_t> ids;
    // A token file (llm.c's header, or named *.bin: what //tools:tokenize
    // writes and the trainer reads) is scored as it is, the tokenizer only
    // decoding; text goes through --tokenizer; anything else is a JSON list.
    auto is_token_file = trainer::IsTokenFile(score, "--score");
    if (is_token_file.ok() && *is_token_file) {
      // Every id is checked against the model by Score; the reader only
      // checks the file's layout.
      auto data =
          trainer::LoadDataFile(score, trainer::DataFormat::kTokens, int64_t{1} << 32, "--score");
      if (!data.ok()) return Fail(std::string(data.status().message()));
      ids.assign(data->tokens.begin(), data->tokens.end());
      std::fprintf(stderr, "generate: scoring %s\n", data->description.c_str());
      return Score(*model, ids, tok_ptr, score, device);
    }
    auto read = formats::ReadFile(score);
    if (!read.ok()) return Fail(absl::StrCat("--score ", score, ": cannot be read"));
    const std::string& contents = *read;
    if (tok) {
      auto encoded = tok->Encode(contents, encode);
      if (!encoded.ok())
        return Fail(absl::StrCat("--score ", score, ": ", encoded.status().message()));
      ids.assign(encoded->begin(), encoded->end());
    } else {
      nlohmann::json json;
      try {
        json = nlohmann::json::parse(contents);
      } catch (const nlohmann::json::exception& e) {
        return Fail(absl::StrCat(
            "--score ", score,
            ": not JSON (without --tokenizer the file is a JSON list of ids): ", e.what()));
      }
      auto list = IdList(json, absl::StrCat("--score ", score));
      if (!list.ok()) return Fail(std::string(list.status().message()));
      ids = *std::move(list);
    }
    return Score(*model, ids, tok_ptr, score, device);
  }

  auto prompts = ReadPrompts(inputs, tok_ptr, encode);
  if (!prompts.ok()) return Fail(std::string(prompts.status().message()));
  if (!ignore_eos) options.eos_ids = config->eos_token_ids;
  const int64_t vocab = config->vocab_size;
  if (config->pad_token_id && *config->pad_token_id >= 0 && *config->pad_token_id < vocab) {
    options.pad_id = *config->pad_token_id;
  } else if (!config->eos_token_ids.empty()) {
    options.pad_id = config->eos_token_ids.front();
  }
  models::GenerationTimes times;
  const auto start = std::chrono::steady_clock::now();
  auto generated = models::Generate(*model, *prompts, options, benchmark ? &times : nullptr);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!generated.ok()) {
    // Prompts are numbered in batch order: --prompt, --prompt-ids, --prompts-file.
    return Fail(absl::StrCat(generated.status().message(),
                             " (prompts numbered from 0 in the "
                             "order --prompt, --prompt-ids, --prompts-file; model ",
                             model_dir, ")"));
  }
  for (size_t i = 0; i < generated->size(); ++i) {
    const models::Generated& g = (*generated)[i];
    if (output == "ids") {
      std::printf("%s\n", Dump(nlohmann::json(g.tokens)).c_str());
    } else if (output == "json") {
      nlohmann::json json = {{"index", i},
                             {"prompt_ids", g.prompt},
                             {"ids", g.tokens},
                             {"stop", models::StopName(g.stop)}};
      if (tok) json["text"] = Decode(*tok, g.tokens);
      std::printf("%s\n", Dump(json).c_str());
    } else {
      std::vector<int64_t> all = g.prompt;
      all.insert(all.end(), g.tokens.begin(), g.tokens.end());
      if (generated->size() > 1 && i > 0) std::printf("\n---\n");
      std::printf("%s\n", Decode(*tok, all).c_str());
    }
  }
  if (benchmark) {
    const auto& steps = times.step_seconds;
    int64_t new_tokens = 0;
    for (const auto& g : *generated) new_tokens += static_cast<int64_t>(g.tokens.size());
    double decode = 0;
    for (size_t i = 1; i < steps.size(); ++i) decode += steps[i];
    nlohmann::json json = {{"batch", generated->size()},
                           {"prompt_tokens", (*generated)[0].prompt.size()},
                           {"new_tokens", new_tokens},
                           {"cache", options.use_cache},
                           {"device", device_name},
                           {"dtype", dtype_name},
                           {"seconds", seconds},
                           {"prompt_step_ms", steps.empty() ? 0.0 : steps[0] * 1e3},
                           {"tokens_per_s", new_tokens / seconds},
                           {"decode_tokens_per_s",
                            decode > 0 ? (steps.size() - 1) * generated->size() / decode : 0.0}};
    for (int64_t from : {16, 64, 128, 256, 496}) AddDepth(json, steps, from);
    std::fprintf(stderr, "%s\n", Dump(json).c_str());
  }
  return 0;
}
