#include "models/llama_config.h"

#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace models {
namespace {

using Json = nlohmann::json;

// The defaults of transformers' config classes (5.x) for the fields a
// checkpoint may leave out.
struct TypeDefaults {
  const char* model_type;
  int64_t max_position_embeddings;
  // 0: the attention heads (LlamaConfig's None).
  int64_t num_key_value_heads;
  // 0: hidden_size / num_attention_heads.
  int64_t head_dim;
  std::optional<int64_t> sliding_window;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
};

constexpr int64_t kNoDefault = 0;

const TypeDefaults* DefaultsOf(const std::string& model_type) {
  static const TypeDefaults kTypes[] = {
      {"llama", 2048, kNoDefault, kNoDefault, std::nullopt, 1, 2},
      {"mistral", 4096 * 32, 8, kNoDefault, 4096, 1, 2},
      {"qwen2", 32768, 32, kNoDefault, std::nullopt, std::nullopt, std::nullopt},
      {"qwen3", 32768, 32, 128, std::nullopt, std::nullopt, std::nullopt},
  };
  for (const TypeDefaults& d : kTypes) {
    if (model_type == d.model_type) return &d;
  }
  return nullptr;
}

// Reads fields of one JSON object, each error naming the source and the
// field's path.
class Fields {
 public:
  Fields(const Json& object, std::string source, std::string prefix = "")
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool Has(const std::string& key) const {
    return object_.contains(key) && !object_.at(key).is_null();
  }
  const Json& Get(const std::string& key) const { return object_.at(key); }
  std::string Path(const std::string& key) const { return prefix_ + key; }

  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(
        source_, ": ", Path(key), "=", Has(key) ? Get(key).dump() : "null", ": ", what));
  }
  absl::Status Unimplemented(const std::string& key, const std::string& what) const {
    return absl::UnimplementedError(
        absl::StrCat(source_, ": ", Path(key), "=", Get(key).dump(), ": ", what));
  }

  absl::StatusOr<int64_t> Int(const std::string& key, std::optional<int64_t> fallback) const {
    if (!Has(key)) {
      if (fallback) return *fallback;
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": ", Path(key), " is missing: expected an integer"));
    }
    const Json& v = Get(key);
    if (v.is_number_integer()) return v.get<int64_t>();
    // Some writers store integers as 8192.0.
    if (v.is_number_float() && v.get<double>() == static_cast<double>(v.get<int64_t>())) {
      return v.get<int64_t>();
    }
    return Error(key, "expected an integer");
  }
  absl::StatusOr<double> Number(const std::string& key, std::optional<double> fallback) const {
    if (!Has(key)) {
      if (fallback) return *fallback;
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": ", Path(key), " is missing: expected a number"));
    }
    if (!Get(key).is_number()) return Error(key, "expected a number");
    return Get(key).get<double>();
  }
  absl::StatusOr<bool> Bool(const std::string& key, bool fallback) const {
    if (!Has(key)) return fallback;
    if (!Get(key).is_boolean()) return Error(key, "expected true or false");
    return Get(key).get<bool>();
  }
  absl::StatusOr<std::string> String(const std::string& key,
                                     std::optional<std::string> fallback) const {
    if (!Has(key)) {
      if (fallback) return *fallback;
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": ", Path(key), " is missing: expected a string"));
    }
    if (!Get(key).is_string()) return Error(key, "expected a string");
    return Get(key).get<std::string>();
  }

 private:
  const Json& object_;
  std::string source_;
  std::string prefix_;
};

#define ASSIGN_OR_RETURN_FIELD(lhs, expr)         \
  do {                                            \
    auto value_or = (expr);                       \
    if (!value_or.ok()) return value_or.status(); \
    lhs = *value_or;                              \
  } while (false)

absl::StatusOr<std::optional<c10::ScalarType>> ParseDtype(const Fields& f, const std::string& key) {
  if (!f.Has(key)) return std::optional<c10::ScalarType>();
  auto name = f.String(key, std::nullopt);
  if (!name.ok()) return name.status();
  std::string n = *name;
  if (n.rfind("torch.", 0) == 0) n = n.substr(6);
  if (n == "auto") return std::optional<c10::ScalarType>();
  if (n == "float32" || n == "float") return std::optional<c10::ScalarType>(c10::kFloat);
  if (n == "bfloat16") return std::optional<c10::ScalarType>(c10::kBFloat16);
  if (n == "float16" || n == "half") return std::optional<c10::ScalarType>(c10::kHalf);
  return f.Error(key, "expected float32, bfloat16 or float16");
}

// Absent key -> `fallback`; null -> none; an integer -> it.
absl::StatusOr<std::optional<int64_t>> NullableInt(const Json& object, const Fields& f,
                                                   const std::string& key,
                                                   std::optional<int64_t> fallback) {
  if (!object.contains(key)) return fallback;
  if (object.at(key).is_null()) return std::optional<int64_t>();
  auto v = f.Int(key, std::nullopt);
  if (!v.ok()) return v.status();
  return std::optional<int64_t>(*v);
}

absl::Status ParseRope(const Json& root, const Fields& top, const std::string& source,
                       LlamaConfig& config) {
  // transformers: rope_scaling (4.x) wins over rope_parameters (5.x).
  std::string key;
  if (top.Has("rope_scaling")) {
    key = "rope_scaling";
  } else if (top.Has("rope_parameters")) {
    key = "rope_parameters";
  }
  static const Json kEmpty = Json::object();
  const Json& rope = key.empty() ? kEmpty : root.at(key);
  if (!rope.is_object()) return top.Error(key, "expected an object");
  const Fields f(rope, source, key + ".");
  for (const char* nested : {"full_attention", "sliding_attention"}) {
    if (rope.contains(nested)) {
      return top.Unimplemented(
          key, absl::StrCat("per-layer-type RoPE parameters ('", nested, "') are not implemented"));
    }
  }
  std::string type = "default";
  const char* type_key = nullptr;
  for (const char* k : {"rope_type", "type"}) {
    if (rope.contains(k) && !rope.at(k).is_null()) {
      if (!rope.at(k).is_string()) return top.Error(key, absl::StrCat(k, " must be a string"));
      type = rope.at(k).get<std::string>();
      type_key = k;
      break;
    }
  }
  std::set<std::string> allowed = {"rope_type", "type", "rope_theta"};
  if (type == "default") {
    config.rope.type = RopeType::kDefault;
  } else if (type == "linear") {
    config.rope.type = RopeType::kLinear;
    allowed.insert("factor");
  } else if (type == "llama3") {
    config.rope.type = RopeType::kLlama3;
    allowed.insert(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  } else {
    return absl::UnimplementedError(
        absl::StrCat(top.Path(key), ".", type_key, "='", type,
                     "': this RoPE type is not implemented (default, linear and llama3 are)"));
  }
  // A key that would change the computation in transformers and that this
  // type does not read here is refused rather than ignored.
  for (const auto& [k, v] : rope.items()) {
    if (allowed.count(k) == 0) {
      return absl::UnimplementedError(
          absl::StrCat(top.Path(key), ".", k, "=", v.dump(), ": not implemented for rope_type '",
                       type, "' (expected only ", absl::StrJoin(allowed, ", "), ")"));
    }
  }
  // theta: inside the RoPE object, else the top-level rope_theta, else
  // transformers' default_theta.
  if (rope.contains("rope_theta") && !rope.at("rope_theta").is_null()) {
    ASSIGN_OR_RETURN_FIELD(config.rope.theta, f.Number("rope_theta", std::nullopt));
  } else {
    ASSIGN_OR_RETURN_FIELD(config.rope.theta, top.Number("rope_theta", 10000.0));
  }
  if (!(config.rope.theta > 0)) return top.Error(key, "rope_theta must be > 0");
  if (config.rope.type != RopeType::kDefault) {
    ASSIGN_OR_RETURN_FIELD(config.rope.factor, f.Number("factor", std::nullopt));
    if (!(config.rope.factor > 0)) return f.Error("factor", "expected a number > 0");
  }
  if (config.rope.type == RopeType::kLlama3) {
    ASSIGN_OR_RETURN_FIELD(config.rope.low_freq_factor, f.Number("low_freq_factor", std::nullopt));
    ASSIGN_OR_RETURN_FIELD(config.rope.high_freq_factor,
                           f.Number("high_freq_factor", std::nullopt));
    // transformers: a top-level original_max_position_embeddings wins, then
    // the RoPE object's, then max_position_embeddings.
    if (top.Has("original_max_position_embeddings")) {
      ASSIGN_OR_RETURN_FIELD(config.rope.original_max_position_embeddings,
                             top.Int("original_max_position_embeddings", std::nullopt));
    } else {
      ASSIGN_OR_RETURN_FIELD(
          config.rope.original_max_position_embeddings,
          f.Int("original_max_position_embeddings", config.max_position_embeddings));
    }
    if (!(config.rope.low_freq_factor > 0) ||
        !(config.rope.high_freq_factor > config.rope.low_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          top.Path(key), ": low_freq_factor=", config.rope.low_freq_factor, ", high_freq_factor=",
          config.rope.high_freq_factor, ": expected 0 < low_freq_factor < high_freq_factor"));
    }
    if (config.rope.original_max_position_embeddings <= 0) {
      return f.Error("original_max_position_embeddings", "expected an integer > 0");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLlamaConfig(const LlamaConfig& c, const std::string& source) {
  auto positive = [&](const char* name, int64_t v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", name, "=", v, ": expected an integer > 0"));
  };
  for (auto [name, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                         {"hidden_size", c.hidden_size},
                         {"intermediate_size", c.intermediate_size},
                         {"num_hidden_layers", c.num_hidden_layers},
                         {"num_attention_heads", c.num_attention_heads},
                         {"num_key_value_heads", c.num_key_value_heads},
                         {"head_dim", c.head_dim},
                         {"max_position_embeddings", c.max_position_embeddings}}) {
    if (auto s = positive(name, v); !s.ok()) return s;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": num_key_value_heads=", c.num_key_value_heads,
                     " does not divide num_attention_heads=", c.num_attention_heads,
                     ": expected each key/value head to serve the same number of query heads"));
  }
  if (c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": head_dim=", c.head_dim, ": expected an even number (RoPE rotates pairs)"));
  }
  if (!(c.rms_norm_eps > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": rms_norm_eps=", c.rms_norm_eps, ": expected a number > 0"));
  }
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3") {
    return absl::UnimplementedError(
        absl::StrCat(source, ": model_type='", c.model_type,
                     "': not implemented (expected llama, mistral, qwen2 or qwen3)"));
  }
  if (c.sliding_window && *c.sliding_window <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": sliding_window=", *c.sliding_window, ": expected > 0 or null"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text,
                                             const std::string& source) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object, got ", root.type_name()));
  }
  const Fields f(root, source);
  LlamaConfig c;
  c.source_json = json_text;
  ASSIGN_OR_RETURN_FIELD(c.model_type, f.String("model_type", std::nullopt));
  const TypeDefaults* defaults = DefaultsOf(c.model_type);
  if (defaults == nullptr) {
    return f.Unimplemented("model_type",
                           "not implemented (expected llama, mistral, qwen2 or qwen3)");
  }

  // What this model does not compute is refused before anything else.
  if (auto act = f.String("hidden_act", std::string("silu")); !act.ok()) {
    return act.status();
  } else if (*act != "silu") {
    return f.Unimplemented("hidden_act", "not implemented (expected silu: SwiGLU)");
  }
  for (const char* moe : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    if (f.Has(moe) && !(f.Get(moe).is_number() && f.Get(moe).get<double>() == 0)) {
      return f.Unimplemented(moe, "mixture-of-experts layers are not implemented");
    }
  }
  for (const char* capping : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    if (f.Has(capping)) return f.Unimplemented(capping, "logit soft-capping is not implemented");
  }
  if (f.Has("attention_dropout") &&
      !(f.Get("attention_dropout").is_number() && f.Get("attention_dropout").get<double>() == 0)) {
    return f.Unimplemented("attention_dropout",
                           "attention dropout is not implemented (expected 0)");
  }
  if (f.Has("partial_rotary_factor") && !(f.Get("partial_rotary_factor").is_number() &&
                                          f.Get("partial_rotary_factor").get<double>() == 1)) {
    return f.Unimplemented("partial_rotary_factor", "partial RoPE is not implemented (expected 1)");
  }
  for (const char* rope_key : {"rope_scaling", "rope_parameters"}) {
    if (f.Has(rope_key) && f.Get(rope_key).is_object() &&
        f.Get(rope_key).contains("partial_rotary_factor") &&
        !(f.Get(rope_key)["partial_rotary_factor"].is_number() &&
          f.Get(rope_key)["partial_rotary_factor"].get<double>() == 1)) {
      return absl::UnimplementedError(absl::StrCat(
          source, ": ", rope_key, ".partial_rotary_factor=",
          f.Get(rope_key)["partial_rotary_factor"].dump(), ": partial RoPE is not implemented"));
    }
  }
  const bool qwen = c.model_type == "qwen2" || c.model_type == "qwen3";
  if (qwen) {
    if (auto sliding = f.Bool("use_sliding_window", false); !sliding.ok()) {
      return sliding.status();
    } else if (*sliding) {
      return f.Unimplemented("use_sliding_window", "sliding-window attention is not implemented");
    }
  }
  if (f.Has("layer_types")) {
    if (!f.Get("layer_types").is_array()) return f.Error("layer_types", "expected a list");
    for (const Json& t : f.Get("layer_types")) {
      if (!t.is_string() || t.get<std::string>() != "full_attention") {
        return f.Unimplemented("layer_types", absl::StrCat("layer type ", t.dump(),
                                                           " is not implemented (expected "
                                                           "full_attention only)"));
      }
    }
  }

  ASSIGN_OR_RETURN_FIELD(c.vocab_size, f.Int("vocab_size", std::nullopt));
  ASSIGN_OR_RETURN_FIELD(c.hidden_size, f.Int("hidden_size", std::nullopt));
  ASSIGN_OR_RETURN_FIELD(c.intermediate_size, f.Int("intermediate_size", std::nullopt));
  ASSIGN_OR_RETURN_FIELD(c.num_hidden_layers, f.Int("num_hidden_layers", std::nullopt));
  ASSIGN_OR_RETURN_FIELD(c.num_attention_heads, f.Int("num_attention_heads", std::nullopt));
  if (c.num_attention_heads <= 0) {
    return f.Error("num_attention_heads", "expected an integer > 0");
  }
  ASSIGN_OR_RETURN_FIELD(c.num_key_value_heads,
                         f.Int("num_key_value_heads", defaults->num_key_value_heads == kNoDefault
                                                          ? c.num_attention_heads
                                                          : defaults->num_key_value_heads));
  if (f.Has("head_dim")) {
    ASSIGN_OR_RETURN_FIELD(c.head_dim, f.Int("head_dim", std::nullopt));
  } else if (defaults->head_dim != kNoDefault) {
    c.head_dim = defaults->head_dim;
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": hidden_size=", c.hidden_size, " is not divisible by num_attention_heads=",
          c.num_attention_heads, " and head_dim is not given: expected one of the two"));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  ASSIGN_OR_RETURN_FIELD(c.max_position_embeddings,
                         f.Int("max_position_embeddings", defaults->max_position_embeddings));
  ASSIGN_OR_RETURN_FIELD(c.rms_norm_eps, f.Number("rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN_FIELD(c.initializer_range, f.Number("initializer_range", 0.02));
  ASSIGN_OR_RETURN_FIELD(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));

  if (c.model_type == "qwen2") {
    c.qkv_bias = true;
    c.o_proj_bias = false;
  } else if (c.model_type == "mistral") {
    c.qkv_bias = c.o_proj_bias = false;
  } else {  // llama, qwen3
    bool bias = false;
    ASSIGN_OR_RETURN_FIELD(bias, f.Bool("attention_bias", false));
    c.qkv_bias = c.o_proj_bias = bias;
  }
  if (c.model_type == "llama") ASSIGN_OR_RETURN_FIELD(c.mlp_bias, f.Bool("mlp_bias", false));
  c.qk_norm = c.model_type == "qwen3";
  if (c.model_type == "mistral") {
    ASSIGN_OR_RETURN_FIELD(c.sliding_window,
                           NullableInt(root, f, "sliding_window", defaults->sliding_window));
  }

  ASSIGN_OR_RETURN_FIELD(c.bos_token_id,
                         NullableInt(root, f, "bos_token_id", defaults->bos_token_id));
  ASSIGN_OR_RETURN_FIELD(c.pad_token_id, NullableInt(root, f, "pad_token_id", std::nullopt));
  if (root.contains("eos_token_id") && root.at("eos_token_id").is_array()) {
    for (const Json& id : root.at("eos_token_id")) {
      if (!id.is_number_integer()) return f.Error("eos_token_id", "expected integers");
      c.eos_token_ids.push_back(id.get<int64_t>());
    }
  } else {
    std::optional<int64_t> eos;
    ASSIGN_OR_RETURN_FIELD(eos, NullableInt(root, f, "eos_token_id", defaults->eos_token_id));
    if (eos) c.eos_token_ids.push_back(*eos);
  }

  std::optional<c10::ScalarType> dtype, torch_dtype;
  ASSIGN_OR_RETURN_FIELD(dtype, ParseDtype(f, "dtype"));
  ASSIGN_OR_RETURN_FIELD(torch_dtype, ParseDtype(f, "torch_dtype"));
  if (dtype && torch_dtype && *dtype != *torch_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": dtype=", f.Get("dtype").dump(), " and torch_dtype=", f.Get("torch_dtype").dump(),
        " contradict each other: expected one, or both the same"));
  }
  c.dtype = dtype ? dtype : torch_dtype;

  if (auto s = ParseRope(root, f, source, c); !s.ok()) {
    // ParseRope's messages start with the field; prefix the source.
    if (absl::StrContains(s.message(), source)) return s;
    return absl::Status(s.code(), absl::StrCat(source, ": ", s.message()));
  }
  if (auto s = ValidateLlamaConfig(c, source); !s.ok()) return s;
  return c;
}

absl::StatusOr<LlamaConfig> ReadLlamaConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read (a config.json)"));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return ParseLlamaConfig(text.str(), path);
}

std::string LlamaConfigJson(const LlamaConfig& c, c10::ScalarType dtype) {
  Json root = Json::object();
  if (!c.source_json.empty()) {
    try {
      root = Json::parse(c.source_json);
    } catch (const Json::exception&) {
      root = Json::object();
    }
  }
  // 4.x spelling when the source used it, else 5.x's.
  const bool old_spelling = root.contains("torch_dtype") ||
                            (!root.contains("rope_parameters") &&
                             (root.contains("rope_theta") || root.contains("rope_scaling")));
  static const std::map<std::string, std::string> kArchitectures = {
      {"llama", "LlamaForCausalLM"},
      {"mistral", "MistralForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},
      {"qwen3", "Qwen3ForCausalLM"}};
  root["model_type"] = c.model_type;
  if (!root.contains("architectures")) root["architectures"] = {kArchitectures.at(c.model_type)};
  root["vocab_size"] = c.vocab_size;
  root["hidden_size"] = c.hidden_size;
  root["intermediate_size"] = c.intermediate_size;
  root["num_hidden_layers"] = c.num_hidden_layers;
  root["num_attention_heads"] = c.num_attention_heads;
  root["num_key_value_heads"] = c.num_key_value_heads;
  root["head_dim"] = c.head_dim;
  root["max_position_embeddings"] = c.max_position_embeddings;
  root["rms_norm_eps"] = c.rms_norm_eps;
  root["initializer_range"] = c.initializer_range;
  root["tie_word_embeddings"] = c.tie_word_embeddings;
  root["hidden_act"] = "silu";
  if (c.model_type == "llama" || c.model_type == "qwen3") root["attention_bias"] = c.qkv_bias;
  if (c.model_type == "llama") root["mlp_bias"] = c.mlp_bias;
  if (c.model_type == "mistral") {
    root["sliding_window"] = c.sliding_window ? Json(*c.sliding_window) : Json(nullptr);
  }
  root["bos_token_id"] = c.bos_token_id ? Json(*c.bos_token_id) : Json(nullptr);
  root["pad_token_id"] = c.pad_token_id ? Json(*c.pad_token_id) : Json(nullptr);
  if (c.eos_token_ids.size() == 1) {
    root["eos_token_id"] = c.eos_token_ids[0];
  } else if (c.eos_token_ids.empty()) {
    root["eos_token_id"] = nullptr;
  } else {
    root["eos_token_id"] = c.eos_token_ids;
  }

  Json rope = Json::object();
  switch (c.rope.type) {
    case RopeType::kDefault: rope["rope_type"] = "default"; break;
    case RopeType::kLinear:
      rope["rope_type"] = "linear";
      rope["factor"] = c.rope.factor;
      break;
    case RopeType::kLlama3:
      rope["rope_type"] = "llama3";
      rope["factor"] = c.rope.factor;
      rope["low_freq_factor"] = c.rope.low_freq_factor;
      rope["high_freq_factor"] = c.rope.high_freq_factor;
      rope["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
      break;
  }
  root.erase("original_max_position_embeddings");
  const char* dtype_name = dtype == c10::kBFloat16 ? "bfloat16"
                           : dtype == c10::kHalf   ? "float16"
                                                   : "float32";
  if (old_spelling) {
    root["rope_theta"] = c.rope.theta;
    if (c.rope.type == RopeType::kDefault) {
      root["rope_scaling"] = nullptr;
    } else {
      root["rope_scaling"] = rope;
    }
    root.erase("rope_parameters");
    root["torch_dtype"] = dtype_name;
    root.erase("dtype");
  } else {
    rope["rope_theta"] = c.rope.theta;
    root["rope_parameters"] = rope;
    root.erase("rope_scaling");
    root.erase("rope_theta");
    root["dtype"] = dtype_name;
    root.erase("torch_dtype");
  }
  return root.dump(2) + "\n";
}

}  // namespace models

#undef ASSIGN_OR_RETURN_FIELD
