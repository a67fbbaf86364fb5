// config: implementation.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

namespace kvlite {

const char* arch_name(Arch arch) {
  switch (arch) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
    case Arch::qwen3_vl: return "qwen3_vl";
    case Arch::qwen2_5_vl: return "qwen2_5_vl";
    case Arch::mistral: return "mistral";
    case Arch::gemma2: return "gemma2";
    case Arch::gemma3: return "gemma3";
    case Arch::phi3: return "phi3";
  }
  return "?";
}
const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::dense: return "dense";
    case WeightFormat::fp8: return "fp8";
    case WeightFormat::int4: return "int4";
    case WeightFormat::int8: return "int8";
  }
  return "?";
}
const char* int_packing_name(IntPacking packing) {
  switch (packing) {
    case IntPacking::compressed_tensors: return "compressed-tensors";
    case IntPacking::compressed_tensors_unpacked: return "compressed-tensors int-quantized";
    case IntPacking::awq: return "awq";
    case IntPacking::gptq: return "gptq";
    case IntPacking::gptq_v2: return "gptq_v2";
  }
  return "?";
}
const char* scale_granularity_name(ScaleGranularity granularity) {
  switch (granularity) {
    case ScaleGranularity::none: return "none";
    case ScaleGranularity::tensor: return "tensor";
    case ScaleGranularity::channel: return "channel";
    case ScaleGranularity::group: return "group";
    case ScaleGranularity::block: return "block";
  }
  return "?";
}

std::string ModelConfig::text_prefix() const {
  if (arch == Arch::qwen3_vl) return "model.language_model.";
  if (model_type == "gemma3") return "language_model.model.";  // Gemma3ForConditionalGeneration as published
  return "model.";
}

uint64_t ModelConfig::kv_bytes_per_token(int kv_element_bytes) const {
  return 2ull * uint64_t(text.num_layers) * uint64_t(text.num_kv_heads) * uint64_t(text.head_dim) *
         uint64_t(kv_element_bytes);
}

namespace detail {
namespace cfg {
using json = nlohmann::json;

// ---- regular expressions (Python re.match semantics: anchored at the start, not at the end) ----------------
// Returns false and sets *valid = false when the pattern does not compile.
inline bool regex_matches_start(const std::string& pattern, const std::string& subject, bool* valid = nullptr) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), 0, &error_code,
                                   &error_offset, nullptr);
  if (valid) *valid = code != nullptr;
  if (!code) return false;
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code, nullptr);
  int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.c_str()), subject.size(), 0, PCRE2_ANCHORED, match,
                       nullptr);
  pcre2_match_data_free(match);
  pcre2_code_free(code);
  return rc >= 0;
}
inline bool regex_compiles(const std::string& pattern) {
  bool valid = false;
  regex_matches_start(pattern, "", &valid);
  return valid;
}
// Characters that make a modules_to_not_convert key behave differently as a regex than as a substring.
// '.' is left out on purpose: every dotted module name contains it and it matches itself either way.
inline bool has_regex_syntax(const std::string& key) { return key.find_first_of("*+?[](){}|^$\\") != std::string::npos; }

// compressed-tensors match_name: "re:<regex>" matches from the start of the name, anything else exactly.
inline bool ct_name_matches(const std::string& name, const std::string& target) {
  if (target.compare(0, 3, "re:") == 0) return regex_matches_start(target.substr(3), name);
  return target == name;
}

// ---- reading JSON with the key path in every message ----------------------------------------------------
// A JSON object and the dotted path that names it ("text_config", "quantization_config.config_groups.group_0").
struct Node {
  const json* value = nullptr;
  std::string path;
  std::string origin;  // the file, for messages

  std::string key_path(const std::string& key) const { return path.empty() ? key : path + "." + key; }
  // JSON null counts as absent, as transformers treats it (`"head_dim": null`, `"rope_scaling": null`).
  const json* find(const std::string& key) const {
    auto it = value->find(key);
    return it == value->end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  [[noreturn]] void fail_key(ErrorCode code, const std::string& key, const std::string& why) const {
    fail(code, format("%s: %s %s", origin.c_str(), key_path(key).c_str(), why.c_str()));
  }

  Node child(const std::string& key) const {
    const json* v = find(key);
    if (!v) fail_key(ErrorCode::bad_format, key, "is missing");
    if (!v->is_object()) fail_key(ErrorCode::bad_format, key, "must be a JSON object");
    return Node{v, key_path(key), origin};
  }
  std::optional<Node> optional_child(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return child(key);
  }

  static bool integral(const json& v, int64_t* out) {
    if (v.is_number_integer()) {
      *out = v.get<int64_t>();
      return true;
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) {
        *out = int64_t(d);
        return true;
      }
    }
    return false;
  }
  std::optional<int64_t> optional_int(const std::string& key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    int64_t out = 0;
    if (!integral(*v, &out)) fail_key(ErrorCode::bad_format, key, format("must be an integer, not %s", v->dump().c_str()));
    return out;
  }
  int64_t positive(const std::string& key) const {
    std::optional<int64_t> v = optional_int(key);
    if (!v) fail_key(ErrorCode::bad_format, key, "is missing; kvlite needs it to size the model");
    if (*v <= 0) fail_key(ErrorCode::bad_format, key, format("must be positive, not %lld", (long long)*v));
    return *v;
  }
  int64_t positive_or(const std::string& key, int64_t fallback) const { return has(key) ? positive(key) : fallback; }
  // A positive size no larger than `limit` (one of kvlite::limits, named by its macro `limit_macro`).
  int64_t bounded(const std::string& key, int64_t limit, const char* limit_macro) const {
    int64_t v = positive(key);
    if (v > limit)
      fail_key(ErrorCode::bad_format, key,
               format("is %lld, above kvlite's limit of %lld (%s): the file is corrupt or hostile; for a real model "
                      "that large, #define %s higher before including kvlite.hpp",
                      (long long)v, (long long)limit, limit_macro, limit_macro));
    return v;
  }
  int64_t bounded_or(const std::string& key, int64_t fallback, int64_t limit, const char* limit_macro) const {
    return has(key) ? bounded(key, limit, limit_macro) : fallback;
  }
  double number_or(const std::string& key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) fail_key(ErrorCode::bad_format, key, format("must be a number, not %s", v->dump().c_str()));
    return v->get<double>();
  }
  double required_number(const std::string& key) const {
    if (!has(key)) fail_key(ErrorCode::bad_format, key, "is missing");
    return number_or(key, 0);
  }
  bool bool_or(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail_key(ErrorCode::bad_format, key, format("must be true or false, not %s", v->dump().c_str()));
    return v->get<bool>();
  }
  std::optional<std::string> optional_string(const std::string& key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) fail_key(ErrorCode::bad_format, key, format("must be a string, not %s", v->dump().c_str()));
    return v->get<std::string>();
  }
  std::string string_or(const std::string& key, const std::string& fallback) const {
    return optional_string(key).value_or(fallback);
  }
  std::vector<std::string> string_list(const std::string& key) const {
    std::vector<std::string> out;
    const json* v = find(key);
    if (!v) return out;
    if (!v->is_array()) fail_key(ErrorCode::bad_format, key, "must be a list of strings");
    for (const json& item : *v) {
      if (!item.is_string()) fail_key(ErrorCode::bad_format, key, format("must hold only strings, not %s", item.dump().c_str()));
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  std::vector<int64_t> int_list(const std::string& key) const {
    std::vector<int64_t> out;
    const json* v = find(key);
    if (!v) return out;
    if (!v->is_array()) fail_key(ErrorCode::bad_format, key, format("must be a list of integers, not %s", v->dump().c_str()));
    for (const json& item : *v) {
      int64_t x = 0;
      if (!integral(item, &x)) fail_key(ErrorCode::bad_format, key, format("must hold only integers, not %s", item.dump().c_str()));
      out.push_back(x);
    }
    return out;
  }
  // An id or a list of ids (`eos_token_id: 151645` or `[128001, 128008, 128009]`).
  std::vector<int64_t> ids(const std::string& key) const {
    const json* v = find(key);
    if (!v) return {};
    if (v->is_array()) return checked_ids(key, int_list(key));
    int64_t x = 0;
    if (!integral(*v, &x)) fail_key(ErrorCode::bad_format, key, format("must be an id or a list of ids, not %s", v->dump().c_str()));
    return checked_ids(key, {x});
  }
  // Token ids index the vocabulary: each must lie in 0..limits::max_vocab - 1 (the model's own vocab_size is
  // checked against them where both are known).
  std::vector<int64_t> checked_ids(const std::string& key, std::vector<int64_t> ids) const {
    for (int64_t id : ids)
      if (id < 0 || id >= limits::max_vocab)
        fail_key(ErrorCode::bad_format, key,
                 format("holds the id %lld, outside 0..%lld (KVLITE_MAX_VOCAB)", (long long)id,
                        (long long)(limits::max_vocab - 1)));
    return ids;
  }
};

inline json parse_json(const std::string& text, const std::string& origin) {
  check_json_nesting(text, origin);
  try {
    json doc = json::parse(text);
    if (!doc.is_object()) fail(ErrorCode::bad_format, format("%s: the top level must be a JSON object", origin.c_str()));
    return doc;
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1E51655
    fail(ErrorCode::bad_format, format("%s is not valid JSON: %s", origin.c_str(), e.what()));
  }
}

// The keys of `<quant_path>.dynamic` in the order the file lists them. nlohmann::json keeps an object's keys
// sorted, but GPTQModel's `dynamic` rules are tried in the file's order (the first regex that matches a module
// decides it), so the text is read once more, order kept, when the config has such rules.
inline std::vector<std::string> dynamic_rule_order(const std::string& text, const std::string& quant_path) {
  std::vector<std::string> keys;
  if (text.find("\"dynamic\"") == std::string::npos) return keys;
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text, nullptr, false);
  const nlohmann::ordered_json* node = &doc;
  for (size_t start = 0; node && node->is_object();) {
    const size_t dot = quant_path.find('.', start);
    auto it = node->find(quant_path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    node = it == node->end() ? nullptr : &*it;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (!node || !node->is_object()) return keys;
  auto dynamic = node->find("dynamic");
  if (dynamic == node->end() || !dynamic->is_object()) return keys;
  for (auto it = dynamic->begin(); it != dynamic->end(); ++it) keys.push_back(it.key());
  return keys;
}

inline std::string join(const std::vector<std::string>& items, const char* separator = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); i++) out += (i ? separator : "") + items[i];
  return out;
}

// ---- model parts ----------------------------------------------------------------------------------------
inline DType parse_dtype(const Node& node, const std::string& key, DType fallback) {
  std::optional<std::string> name = node.optional_string(key);
  if (!name) return fallback;
  if (*name == "bfloat16") return DType::BF16;
  if (*name == "float16") return DType::F16;
  if (*name == "float32") return DType::F32;
  node.fail_key(ErrorCode::unsupported, key, format("'%s' is not supported; supported: bfloat16, float16, float32", name->c_str()));
}

// A list of positive finite numbers (longrope's short_factor / long_factor), at most `limit` long.
inline std::vector<double> positive_numbers(const Node& node, const std::string& key, int64_t limit) {
  const json* v = node.find(key);
  if (!v) node.fail_key(ErrorCode::bad_format, key, "is missing");
  if (!v->is_array()) node.fail_key(ErrorCode::bad_format, key, "must be a list of numbers");
  if (int64_t(v->size()) > limit)
    node.fail_key(ErrorCode::bad_format, key, format("has %zu entries; the rotary dimension allows at most %lld",
                                                     v->size(), (long long)limit));
  std::vector<double> out;
  for (const json& item : *v) {
    if (!item.is_number() || !(item.get<double>() > 0) || !std::isfinite(item.get<double>()))
      node.fail_key(ErrorCode::bad_format, key, format("must hold positive numbers, not %s", item.dump().c_str()));
    out.push_back(item.get<double>());
  }
  return out;
}

// One rope parameter dict (`rope_scaling` or `rope_parameters`, or one layer type's entry of a nested
// `rope_parameters`) read into `rope` as transformers' ROPE_INIT_FUNCTIONS read it. `text` is the config
// holding it (top-level `partial_rotary_factor` / `original_max_position_embeddings`); rope.theta,
// rope.max_position_embeddings and rope.partial_rotary_factor hold the caller's defaults on entry.
// class_original_max_position_embeddings: the config class's attribute when the file has no top-level key
// (Phi3Config: 4096); > 0 takes priority over the dict's value, as standardize_rope_params' hasattr does.
inline void parse_rope_parameters(const Node& params, const Node& text, int64_t head_dim, RopeConfig& rope,
                                  int64_t class_original_max_position_embeddings = 0) {
  rope.theta = params.number_or("rope_theta", rope.theta);
  if (!(rope.theta > 0)) params.fail_key(ErrorCode::bad_format, "rope_theta", "must be positive");
  // transformers' standardize_rope_params: the dict's value first, then the config's attribute
  rope.partial_rotary_factor = params.number_or("partial_rotary_factor", rope.partial_rotary_factor);
  if (!(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1))
    params.fail_key(ErrorCode::bad_format, "partial_rotary_factor",
                    format("(%g) must be in (0, 1]", rope.partial_rotary_factor));
  const int64_t rotary_dim = int64_t(double(head_dim) * rope.partial_rotary_factor);  // Python's int()
  if (rotary_dim < 2 || rotary_dim % 2 != 0)
    params.fail_key(ErrorCode::bad_format, "partial_rotary_factor",
                    format("(%g) gives rotary_dim int(%lld * %g) = %lld; it must be even and at least 2",
                           rope.partial_rotary_factor, (long long)head_dim, rope.partial_rotary_factor,
                           (long long)rotary_dim));

  const char* type_key = params.has("rope_type") ? "rope_type" : "type";
  std::string type = params.string_or(type_key, "default");
  if (type == "mrope") type = "default";  // the older name of Qwen's multimodal default rope
  static const char* const kSupported = "default, linear, dynamic, yarn, longrope, llama3";
  if (type != "default" && type != "linear" && type != "dynamic" && type != "yarn" && type != "longrope" &&
      type != "llama3")
    params.fail_key(ErrorCode::unsupported, type_key, format("'%s' is not supported; supported: %s", type.c_str(), kSupported));
  rope.type = type;
  if (type == "default") return;

  auto positive_number = [&](const char* key, double fallback) {
    double v = params.number_or(key, fallback);
    if (!(v > 0) || !std::isfinite(v)) params.fail_key(ErrorCode::bad_format, key, format("(%g) must be positive", v));
    return v;
  };
  // llama3, yarn, longrope: standardize_rope_params gives a top-level original_max_position_embeddings
  // priority (Phi-3 keeps it there), else keeps the dict's, else sets max_position_embeddings.
  auto original_length = [&]() -> int64_t {
    if (text.has("original_max_position_embeddings"))
      return text.bounded("original_max_position_embeddings", limits::max_positions, "KVLITE_MAX_POSITIONS");
    if (class_original_max_position_embeddings > 0) return class_original_max_position_embeddings;
    if (params.has("original_max_position_embeddings"))
      return params.bounded("original_max_position_embeddings", limits::max_positions, "KVLITE_MAX_POSITIONS");
    if (rope.max_position_embeddings <= 0)
      params.fail_key(ErrorCode::bad_format, "original_max_position_embeddings",
                      "is missing and so is max_position_embeddings");
    return rope.max_position_embeddings;
  };

  if (type == "linear" || type == "dynamic") {
    if (!params.has("factor")) params.fail_key(ErrorCode::bad_format, "factor", format("is missing (%s rope needs it)", type.c_str()));
    rope.factor = positive_number("factor", 1.0);
    if (type == "dynamic" && rope.max_position_embeddings <= 0)
      params.fail_key(ErrorCode::bad_format, type_key, "'dynamic' needs max_position_embeddings (its base length)");
  } else if (type == "llama3") {
    rope.factor = params.required_number("factor");
    rope.low_freq_factor = params.required_number("low_freq_factor");
    rope.high_freq_factor = params.required_number("high_freq_factor");
    rope.original_max_position_embeddings = original_length();
    if (!(rope.factor > 0)) params.fail_key(ErrorCode::bad_format, "factor", "must be positive");
    if (!(rope.low_freq_factor > 0)) params.fail_key(ErrorCode::bad_format, "low_freq_factor", "must be positive");
    if (!(rope.high_freq_factor > rope.low_freq_factor))
      params.fail_key(ErrorCode::bad_format, "high_freq_factor",
                      format("(%g) must be greater than low_freq_factor (%g)", rope.high_freq_factor, rope.low_freq_factor));
  } else if (type == "yarn") {
    rope.original_max_position_embeddings = original_length();
    // factor None: max_position_embeddings / original_max_position_embeddings (DeepSeek-V3's convention)
    rope.factor = params.has("factor") ? positive_number("factor", 1.0)
                                       : double(rope.max_position_embeddings) / double(rope.original_max_position_embeddings);
    if (!(rope.factor > 0)) params.fail_key(ErrorCode::bad_format, "factor", "is missing and max_position_embeddings is not positive");
    rope.attention_factor = params.has("attention_factor") ? positive_number("attention_factor", 1.0) : 0.0;
    rope.beta_fast = params.number_or("beta_fast", 0.0);
    rope.beta_slow = params.number_or("beta_slow", 0.0);
    rope.mscale = params.number_or("mscale", 0.0);
    rope.mscale_all_dim = params.number_or("mscale_all_dim", 0.0);
    rope.truncate = params.bool_or("truncate", true);
    for (double v : {rope.beta_fast, rope.beta_slow, rope.mscale, rope.mscale_all_dim})
      if (!std::isfinite(v)) params.fail_key(ErrorCode::bad_format, "beta_fast", "and its siblings must be finite");
  } else {  // longrope
    rope.original_max_position_embeddings = original_length();
    rope.factor = params.has("factor") ? positive_number("factor", 1.0) : 0.0;
    rope.attention_factor = params.has("attention_factor") ? positive_number("attention_factor", 1.0) : 0.0;
    rope.short_factor = positive_numbers(params, "short_factor", rotary_dim / 2);
    rope.long_factor = positive_numbers(params, "long_factor", rotary_dim / 2);
    for (const char* key : {"short_factor", "long_factor"}) {
      const size_t n = std::string(key) == "short_factor" ? rope.short_factor.size() : rope.long_factor.size();
      if (int64_t(n) != rotary_dim / 2)
        params.fail_key(ErrorCode::bad_format, key,
                        format("has %zu entries; it needs one per rotary frequency, rotary_dim / 2 = %lld", n,
                               (long long)(rotary_dim / 2)));
    }
  }
}

// The default RoPE is each model's own compute_default_rope_parameters: Phi-3's rotates int(head_dim *
// partial_rotary_factor) dimensions, Llama's, Mistral's, Qwen's and Gemma's every one whatever the factor says
// (the scaled types of ROPE_INIT_FUNCTIONS read the factor for every model).
inline RopeConfig default_rope_of(Arch arch, RopeConfig rope) {
  if (rope.type == "default" && arch != Arch::phi3) rope.partial_rotary_factor = 1.0;
  return rope;
}

// Rotary parameters from the classic keys (`rope_theta` + `rope_scaling`) or the newer `rope_parameters`.
inline RopeConfig parse_rope(const Node& text, Arch arch, int64_t head_dim, int64_t max_position_embeddings = 0) {
  RopeConfig rope;
  // transformers' class defaults when the key is absent.
  rope.theta = arch == Arch::qwen3_vl ? 5000000.0 : arch == Arch::qwen2_5_vl ? 1000000.0 : 10000.0;
  rope.theta = text.number_or("rope_theta", rope.theta);
  rope.max_position_embeddings = max_position_embeddings;
  rope.partial_rotary_factor = text.number_or("partial_rotary_factor", 1.0);
  // Phi3Config carries original_max_position_embeddings = 4096 whether or not the file says it, and its
  // standardize_rope_params prefers that attribute to the dict's value.
  const int64_t class_original = arch == Arch::phi3 ? 4096 : 0;
  std::optional<Node> params;
  if (text.has("rope_parameters")) {
    params = text.child("rope_parameters");
    for (const char* layer_type : {"full_attention", "sliding_attention"})
      if (params->has(layer_type))
        params->fail_key(ErrorCode::unsupported, layer_type, "(rope parameters per layer type) is not supported");
  } else {
    params = text.optional_child("rope_scaling");
  }
  if (!(rope.theta > 0)) text.fail_key(ErrorCode::bad_format, "rope_theta", "must be positive");
  json no_params = json::object();
  if (!params && arch == Arch::qwen2_5_vl) {
    // Qwen2_5_VLRotaryEmbedding reads mrope_section with a default: a file without rope keys still has M-RoPE
    params = Node{&no_params, text.path, text.origin};
  }
  if (!params) {
    // no dict: the defaults, still checked (partial_rotary_factor)
    json empty = json::object();
    parse_rope_parameters(Node{&empty, text.path, text.origin}, text, head_dim, rope, class_original);
    return default_rope_of(arch, rope);
  }
  // M-RoPE's tables come from three position rows at once; the length-dependent types pick frequencies per
  // sequence length, which kvlite does for one position row only.
  const char* type_key = params->has("rope_type") ? "rope_type" : "type";
  const std::string type = params->string_or(type_key, "default");
  const bool vl = arch == Arch::qwen3_vl || arch == Arch::qwen2_5_vl;
  if ((vl || params->has("mrope_section")) && (type == "dynamic" || type == "longrope"))
    params->fail_key(ErrorCode::unsupported, type_key,
                     format("'%s' is not supported with M-RoPE (mrope_section); supported there: default, linear, "
                            "yarn, llama3", type.c_str()));
  parse_rope_parameters(*params, text, head_dim, rope, class_original);
  rope = default_rope_of(arch, rope);

  for (int64_t section : params->int_list("mrope_section")) {
    if (section <= 0) params->fail_key(ErrorCode::bad_format, "mrope_section", "must hold positive sizes");
    rope.mrope_section.push_back(int(section));
  }
  rope.mrope_interleaved = params->bool_or("mrope_interleaved", false);
  if (vl) {
    // what each rotary code falls back to; Qwen2.5-VL lays the sections end to end, Qwen3-VL interleaves them
    if (rope.mrope_section.empty())
      rope.mrope_section = arch == Arch::qwen3_vl ? std::vector<int>{24, 20, 20} : std::vector<int>{16, 24, 24};
    rope.mrope_layout = arch == Arch::qwen3_vl ? RopeConfig::MropeLayout::interleaved : RopeConfig::MropeLayout::sectioned;
    int64_t sum = 0;
    for (int s : rope.mrope_section) sum += s;
    if (rope.mrope_section.size() != 3 || sum * 2 != head_dim)
      params->fail_key(ErrorCode::bad_format, "mrope_section",
                       format("must be 3 sizes (t, h, w) adding up to head_dim / 2 = %lld", (long long)(head_dim / 2)));
  }
  return rope;
}


// ---- block traits (config.hpp's table) ------------------------------------------------------------------
// A float key whose JSON null means "off" (Gemma-2's soft-caps: null disables, absent takes the default).
inline double number_or_null(const Node& node, const std::string& key, double absent, double null_value) {
  auto it = node.value->find(key);
  if (it == node.value->end()) return absent;
  if (it->is_null()) return null_value;
  const double v = node.number_or(key, absent);
  if (!(v > 0) || !std::isfinite(v)) node.fail_key(ErrorCode::bad_format, key, format("must be positive (or null), not %g", v));
  return v;
}

inline MlpActivation parse_activation(const Node& text, const char* key, const std::string& name,
                                      std::initializer_list<MlpActivation> allowed) {
  MlpActivation act = MlpActivation::silu;
  if (name == "silu") act = MlpActivation::silu;
  else if (name == "gelu_pytorch_tanh") act = MlpActivation::gelu_tanh;
  else if (name == "gelu") act = MlpActivation::gelu;
  else text.fail_key(ErrorCode::unsupported, key, format("'%s' is not supported; supported: silu, gelu_pytorch_tanh, gelu", name.c_str()));
  if (std::find(allowed.begin(), allowed.end(), act) == allowed.end())
    text.fail_key(ErrorCode::unsupported, key, format("'%s' is not supported for this model type", name.c_str()));
  return act;
}

// layer_types as written (transformers >= 4.54 saves it), else the family's rule for it.
inline std::vector<LayerKind> parse_layer_types(const Node& text, int64_t layers, const std::function<LayerKind(int64_t)>& rule) {
  std::vector<LayerKind> kinds;
  if (!text.has("layer_types")) {
    for (int64_t l = 0; l < layers; l++) kinds.push_back(rule(l));
    return kinds;
  }
  std::vector<std::string> names = text.string_list("layer_types");
  if (int64_t(names.size()) != layers)
    text.fail_key(ErrorCode::bad_format, "layer_types",
                  format("lists %zu layers but num_hidden_layers is %lld", names.size(), (long long)layers));
  for (size_t l = 0; l < names.size(); l++) {
    if (names[l] == "full_attention") kinds.push_back(LayerKind::full);
    else if (names[l] == "sliding_attention") kinds.push_back(LayerKind::sliding);
    else
      text.fail_key(ErrorCode::unsupported, format("layer_types[%zu]", l),
                    format("'%s' is not supported; supported: full_attention, sliding_attention", names[l].c_str()));
  }
  return kinds;
}

inline BlockTraits parse_block_traits(const Node& text, Arch arch, const TextConfig& t) {
  BlockTraits b;
  const int64_t layers = t.num_layers;
  auto window_key = [&](const char* key) -> int64_t {
    return text.has(key) ? text.bounded(key, limits::max_positions, "KVLITE_MAX_POSITIONS") : 0;
  };
  const bool gemma = arch == Arch::gemma2 || arch == Arch::gemma3;
  if (gemma) {
    // Gemma2Config / Gemma3TextConfig: hidden_activation (older files also carry hidden_act)
    const char* act_key = text.has("hidden_activation") ? "hidden_activation" : "hidden_act";
    b.activation = parse_activation(text, act_key, text.string_or(act_key, "gelu_pytorch_tanh"),
                                    {MlpActivation::gelu_tanh, MlpActivation::gelu});
    b.norm_form = NormForm::one_plus_weight;
    b.embedding_scaled = true;
    b.sandwich_norms = true;
    b.query_pre_attn_scalar = text.number_or("query_pre_attn_scalar", 256);
    if (!(b.query_pre_attn_scalar > 0))
      text.fail_key(ErrorCode::bad_format, "query_pre_attn_scalar", "must be positive");
    if (text.bool_or("use_bidirectional_attention", false))
      text.fail_key(ErrorCode::unsupported, "use_bidirectional_attention", "= true (an encoder) is not supported");
    const bool g2 = arch == Arch::gemma2;
    b.attn_logit_softcap = number_or_null(text, "attn_logit_softcapping", g2 ? 50.0 : 0.0, 0.0);
    b.final_logit_softcap = number_or_null(text, "final_logit_softcapping", g2 ? 30.0 : 0.0, 0.0);
    b.sliding_window = text.has("sliding_window") ? window_key("sliding_window") : 4096;
    // Gemma-2: sliding, full, sliding, ...; Gemma-3: every sliding_window_pattern-th layer full (default 6)
    const int64_t pattern = g2 ? 2 : text.bounded_or("sliding_window_pattern", 6, limits::max_model_layers, "KVLITE_MAX_MODEL_LAYERS");
    b.layer_kinds = parse_layer_types(text, layers, [&](int64_t l) {
      return (l + 1) % pattern ? LayerKind::sliding : LayerKind::full;
    });
  } else {
    b.activation = parse_activation(text, "hidden_act", t.hidden_act, {MlpActivation::silu});
    if (arch == Arch::mistral || arch == Arch::phi3) {
      // MistralModel / Phi3Model: one mask for every layer, sliding when sliding_window is set
      b.sliding_window = window_key("sliding_window");
      b.layer_kinds.assign(size_t(layers), b.sliding_window > 0 ? LayerKind::sliding : LayerKind::full);
      b.fused_projections = arch == Arch::phi3;
    } else if (arch == Arch::qwen2 || arch == Arch::qwen3 || arch == Arch::qwen2_5_vl) {
      // Qwen2Config: sliding_window = sliding_window if use_sliding_window else None; layers from
      // max_window_layers on slide (layer_types when written)
      if (text.bool_or("use_sliding_window", false)) b.sliding_window = window_key("sliding_window");
      const int64_t max_window_layers = text.bounded_or("max_window_layers", 28, limits::max_model_layers, "KVLITE_MAX_MODEL_LAYERS");
      b.layer_kinds = parse_layer_types(text, layers, [&](int64_t l) {
        return b.sliding_window > 0 && l >= max_window_layers ? LayerKind::sliding : LayerKind::full;
      });
      if (b.sliding_window == 0) b.layer_kinds.assign(size_t(layers), LayerKind::full);  // no window: full masks
    } else {
      b.layer_kinds.assign(size_t(layers), LayerKind::full);
    }
  }
  if (b.has_sliding_layers() && b.sliding_window <= 0)
    text.fail_key(ErrorCode::bad_format, "sliding_window", "must be a positive number of tokens for the sliding layers");
  return b;
}

// Gemma3TextConfig's class defaults for the keys a published config.json leaves out (Gemma-3-4B's text_config
// lists only a few), and its RoPE split: rope_parameters {full_attention, sliding_attention} (transformers 5)
// or rope_theta + rope_local_base_freq (+ rope_scaling for the global layers). Rewrites `text` so that
// parse_rope reads the global layers' parameters; returns the sliding layers' base.
inline double prepare_gemma3_text(nlohmann::json& text, const std::string& origin) {
  const std::pair<const char*, nlohmann::json> defaults[] = {
      {"vocab_size", 262208}, {"hidden_size", 2304}, {"intermediate_size", 9216}, {"num_hidden_layers", 26},
      {"num_attention_heads", 8}, {"num_key_value_heads", 4}, {"head_dim", 256}, {"max_position_embeddings", 131072},
      {"rms_norm_eps", 1e-6}, {"query_pre_attn_scalar", 256}, {"tie_word_embeddings", true}};
  for (const auto& d : defaults)
    if (!text.contains(d.first)) text[d.first] = d.second;
  Node node{&text, "", origin};
  double local_theta = 10000.0;
  if (std::optional<Node> params = node.optional_child("rope_parameters"); params && params->has("full_attention")) {
    Node full = params->child("full_attention");
    if (std::optional<Node> sliding = params->optional_child("sliding_attention")) {
      const std::string type = sliding->string_or("rope_type", "default");
      if (type != "default")
        sliding->fail_key(ErrorCode::unsupported, "rope_type", format("'%s' on the sliding layers is not supported; supported: default", type.c_str()));
      local_theta = sliding->number_or("rope_theta", local_theta);
    }
    nlohmann::json global = *full.value;
    if (!global.contains("rope_theta")) global["rope_theta"] = 1000000.0;
    text["rope_parameters"] = global;
  } else {
    local_theta = node.number_or("rope_local_base_freq", local_theta);
    if (!node.has("rope_theta") && !node.has("rope_parameters")) text["rope_theta"] = 1000000.0;
  }
  if (!(local_theta > 0)) node.fail_key(ErrorCode::bad_format, "rope_local_base_freq", "must be positive");
  return local_theta;
}

inline TextConfig parse_text(const Node& text, const Node& root, Arch arch) {
  TextConfig t;
  t.hidden_size = text.bounded("hidden_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  t.intermediate_size = text.bounded("intermediate_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  t.num_layers = text.bounded("num_hidden_layers", limits::max_model_layers, "KVLITE_MAX_MODEL_LAYERS");
  t.num_heads = text.bounded("num_attention_heads", limits::max_model_heads, "KVLITE_MAX_MODEL_HEADS");
  t.num_kv_heads = text.bounded_or("num_key_value_heads", t.num_heads, limits::max_model_heads, "KVLITE_MAX_MODEL_HEADS");
  t.vocab_size = text.bounded("vocab_size", limits::max_vocab, "KVLITE_MAX_VOCAB");
  t.max_position_embeddings = text.bounded("max_position_embeddings", limits::max_positions, "KVLITE_MAX_POSITIONS");
  if (text.has("head_dim")) {
    t.head_dim = text.bounded("head_dim", limits::max_head_dim, "KVLITE_MAX_HEAD_DIM");
  } else {
    if (t.hidden_size % t.num_heads != 0)
      text.fail_key(ErrorCode::bad_format, "head_dim",
                    format("is missing and hidden_size %lld is not a multiple of num_attention_heads %lld",
                           (long long)t.hidden_size, (long long)t.num_heads));
    t.head_dim = t.hidden_size / t.num_heads;
    if (t.head_dim > limits::max_head_dim)
      text.fail_key(ErrorCode::bad_format, "head_dim",
                    format("is missing, and hidden_size / num_attention_heads = %lld is above kvlite's limit of %lld "
                           "(KVLITE_MAX_HEAD_DIM)", (long long)t.head_dim, (long long)limits::max_head_dim));
  }
  if (t.num_heads % t.num_kv_heads != 0)
    text.fail_key(ErrorCode::bad_format, "num_key_value_heads",
                  format("(%lld) must divide num_attention_heads (%lld)", (long long)t.num_kv_heads, (long long)t.num_heads));
  t.rms_norm_eps = text.number_or("rms_norm_eps", 1e-6);
  if (!(t.rms_norm_eps > 0)) text.fail_key(ErrorCode::bad_format, "rms_norm_eps", "must be positive");
  t.hidden_act = text.string_or("hidden_act", "silu");

  // qwen3_vl: transformers 4.x ties by text_config's flag, 5.x writes it at the top level.
  // (Gemma2Config / Gemma3TextConfig tie by default; the others do not)
  const bool tie_default = arch == Arch::gemma2 || arch == Arch::gemma3;
  if (text.has("tie_word_embeddings")) t.tie_word_embeddings = text.bool_or("tie_word_embeddings", tie_default);
  else t.tie_word_embeddings = root.bool_or("tie_word_embeddings", tie_default);

  bool attention_bias = text.bool_or("attention_bias", false);
  switch (arch) {
    case Arch::llama:
      t.attention_bias = t.o_proj_bias = attention_bias;
      t.mlp_bias = text.bool_or("mlp_bias", false);
      break;
    case Arch::mistral:  // MistralAttention / Phi3Attention: no biases
    case Arch::phi3:
    case Arch::gemma2:  // Gemma2Attention: attention_bias on q/k/v/o
      t.attention_bias = t.o_proj_bias = arch == Arch::gemma2 && attention_bias;
      break;
    case Arch::gemma3:
      t.attention_bias = t.o_proj_bias = attention_bias;
      t.qk_norm = true;
      break;
    case Arch::qwen2:  // Qwen2Attention: q/k/v always have biases, o_proj never (Qwen2.5-VL's text model too)
    case Arch::qwen2_5_vl:
      t.attention_bias = true;
      t.o_proj_bias = false;
      break;
    case Arch::qwen3:
    case Arch::qwen3_vl:
      t.attention_bias = t.o_proj_bias = attention_bias;
      t.qk_norm = true;
      break;
  }

  const char* dtype_key = text.has("torch_dtype") ? "torch_dtype" : "dtype";
  if (text.has(dtype_key)) t.dtype = parse_dtype(text, dtype_key, DType::BF16);
  else t.dtype = parse_dtype(root, root.has("torch_dtype") ? "torch_dtype" : "dtype", DType::BF16);

  // Rotary keys live with the text model; very old qwen3_vl files had them only at the top level.
  bool text_has_rope = text.has("rope_parameters") || text.has("rope_scaling") || text.has("rope_theta");
  t.rope = parse_rope(text_has_rope ? text : root, arch, t.head_dim, t.max_position_embeddings);

  t.bos_token_ids = text.has("bos_token_id") ? text.ids("bos_token_id") : root.ids("bos_token_id");
  t.eos_token_ids = text.has("eos_token_id") ? text.ids("eos_token_id") : root.ids("eos_token_id");
  t.block = parse_block_traits(text, arch, t);
  return t;
}

inline VisionConfig parse_vision(const Node& vision, Arch arch) {
  VisionConfig v;
  v.present = true;
  const bool qwen25 = arch == Arch::qwen2_5_vl;
  v.depth = vision.bounded("depth", limits::max_model_layers, "KVLITE_MAX_MODEL_LAYERS");
  v.hidden_size = vision.bounded("hidden_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  v.intermediate_size = vision.bounded("intermediate_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  v.num_heads = vision.bounded("num_heads", limits::max_model_heads, "KVLITE_MAX_MODEL_HEADS");
  v.out_hidden_size = vision.bounded("out_hidden_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  // transformers' Qwen3VLVisionConfig / Qwen2_5_VLVisionConfig defaults for the rest (Qwen2.5-VL's published
  // files also carry in_chans and spatial_patch_size, which its config class ignores: in_channels and patch_size
  // are what the model reads)
  v.in_channels = vision.bounded_or("in_channels", 3, limits::max_vision_patch, "KVLITE_MAX_VISION_PATCH");
  v.patch_size = vision.bounded_or("patch_size", qwen25 ? 14 : 16, limits::max_vision_patch, "KVLITE_MAX_VISION_PATCH");
  v.temporal_patch_size = vision.bounded_or("temporal_patch_size", 2, limits::max_vision_patch, "KVLITE_MAX_VISION_PATCH");
  v.spatial_merge_size = vision.bounded_or("spatial_merge_size", 2, limits::max_vision_patch, "KVLITE_MAX_VISION_PATCH");
  if (qwen25) {
    // Qwen2.5-VL (config.hpp's vision traits): no position table, no DeepStack; RMSNorm, SwiGLU, window attention
    VisionTraits& t = v.traits;
    t.prefix = "visual.";
    t.norm = VisionNorm::rms_norm;
    t.mlp = VisionMlp::swiglu;
    t.patch_embed_bias = false;
    t.learned_positions = false;
    t.default_min_pixels = 56 * 56;
    t.default_max_pixels = 28 * 28 * 1280;
    t.window_size = vision.bounded_or("window_size", 112, limits::max_vision_window, "KVLITE_MAX_VISION_WINDOW");
    // vit_merger_window_size = window_size // spatial_merge_size // patch_size: at least one merge window a side
    if (t.window_size < v.patch_size * v.spatial_merge_size)
      vision.fail_key(ErrorCode::bad_format, "window_size",
                      format("(%lld pixels) is smaller than one merge window (patch_size %lld x spatial_merge_size %lld)",
                             (long long)t.window_size, (long long)v.patch_size, (long long)v.spatial_merge_size));
    t.fullatt_block_indexes = vision.has("fullatt_block_indexes") ? vision.int_list("fullatt_block_indexes")
                                                                   : std::vector<int64_t>{7, 15, 23, 31};
    for (int64_t index : t.fullatt_block_indexes)
      if (index < 0 || index >= v.depth)
        vision.fail_key(ErrorCode::bad_format, "fullatt_block_indexes",
                        format("holds block %lld, outside 0..%lld (depth %lld)", (long long)index,
                               (long long)(v.depth - 1), (long long)v.depth));
    if (vision.has("num_position_embeddings") || vision.has("deepstack_visual_indexes"))
      vision.fail_key(ErrorCode::unsupported, vision.has("deepstack_visual_indexes") ? "deepstack_visual_indexes" : "num_position_embeddings",
                      "is a Qwen3-VL key; a qwen2_5_vl tower has neither a position table nor DeepStack");
    v.hidden_act = vision.string_or("hidden_act", "silu");
  } else {
    v.num_position_embeddings = vision.bounded_or("num_position_embeddings", 2304, limits::max_vision_positions, "KVLITE_MAX_VISION_POSITIONS");
    v.deepstack_visual_indexes = vision.has("deepstack_visual_indexes") ? vision.int_list("deepstack_visual_indexes")
                                                                          : std::vector<int64_t>{8, 16, 24};
    v.hidden_act = vision.string_or("hidden_act", "gelu_pytorch_tanh");
  }
  // The 2-D RoPE's base: rope_parameters {rope_type: "axial", rope_theta}, 10000 when absent.
  if (std::optional<Node> rope = vision.optional_child("rope_parameters"))
    v.rope_theta = rope->number_or("rope_theta", v.rope_theta);
  if (!(v.rope_theta > 0)) vision.fail_key(ErrorCode::bad_format, "rope_parameters.rope_theta", "must be positive");
  if (v.hidden_size % v.num_heads != 0)
    vision.fail_key(ErrorCode::bad_format, "num_heads",
                    format("(%lld) must divide hidden_size (%lld)", (long long)v.num_heads, (long long)v.hidden_size));
  for (int64_t index : v.deepstack_visual_indexes)
    if (index < 0 || index >= v.depth)
      vision.fail_key(ErrorCode::bad_format, "deepstack_visual_indexes",
                      format("holds block %lld, outside 0..%lld (depth %lld)", (long long)index, (long long)(v.depth - 1),
                             (long long)v.depth));
  return v;
}

// ---- quantization_config --------------------------------------------------------------------------------
inline void check_patterns(const Node& node, const std::string& key, const std::vector<std::string>& patterns) {
  for (size_t i = 0; i < patterns.size(); i++)
    if (patterns[i].compare(0, 3, "re:") == 0 && !regex_compiles(patterns[i].substr(3)))
      node.fail_key(ErrorCode::bad_format, format("%s[%zu]", key.c_str(), i),
                    format("'%s' is not a valid regular expression", patterns[i].c_str()));
}

inline QuantScheme parse_ct_group(const Node& group, const std::string& top_format) {
  QuantScheme s;
  s.targets = group.string_list("targets");
  if (s.targets.empty()) group.fail_key(ErrorCode::bad_format, "targets", "is missing or empty");
  check_patterns(group, "targets", s.targets);
  if (!group.has("weights"))
    group.fail_key(ErrorCode::unsupported, "weights",
                   "is null: a group that quantizes only activations is not supported (kvlite runs quantized weights)");
  Node weights = group.child("weights");
  std::string format_key = group.has("format") ? group.key_path("format") : "quantization_config.format";
  std::string fmt = group.string_or("format", top_format);
  if (fmt.empty() || fmt == "mixed-precision")
    group.fail_key(ErrorCode::bad_format, "format",
                   "is missing: a group needs its own format when quantization_config.format is absent or mixed-precision");

  std::string type = weights.string_or("type", "int");
  s.num_bits = int(weights.positive_or("num_bits", 8));
  if (type == "int" && s.num_bits == 8) {
    // INT8 (llm-compressor W8A16 / W8A8): int-quantized stores weight I8 [N, K]; pack-quantized 4 values a word
    if (fmt != "int-quantized" && fmt != "pack-quantized")
      fail(ErrorCode::unsupported,
           format("%s: %s '%s' is not supported for 8-bit int weights; supported: int-quantized, pack-quantized",
                  group.origin.c_str(), format_key.c_str(), fmt.c_str()));
    s.format = WeightFormat::int8;
    s.packing = fmt == "int-quantized" ? IntPacking::compressed_tensors_unpacked : IntPacking::compressed_tensors;
  } else if (type == "int") {
    if (s.num_bits != 4)
      weights.fail_key(ErrorCode::unsupported, "num_bits",
                       format("= %d with type int is not supported; supported: 4 (type int, pack-quantized), 8 (type "
                              "int, int-quantized or pack-quantized) or 8 (type float)", s.num_bits));
    if (fmt != "pack-quantized")
      fail(ErrorCode::unsupported, format("%s: %s '%s' is not supported for 4-bit int weights; supported: pack-quantized",
                                          group.origin.c_str(), format_key.c_str(), fmt.c_str()));
    s.format = WeightFormat::int4;
  } else if (type == "float") {
    if (s.num_bits != 8)
      weights.fail_key(ErrorCode::unsupported, "num_bits",
                       format("= %d with type float is not supported; supported: 8 (type float) or 4 (type int, "
                              "pack-quantized)", s.num_bits));
    if (fmt != "float-quantized" && fmt != "naive-quantized")
      fail(ErrorCode::unsupported,
           format("%s: %s '%s' is not supported for 8-bit float weights; supported: float-quantized, naive-quantized",
                  group.origin.c_str(), format_key.c_str(), fmt.c_str()));
    s.format = WeightFormat::fp8;
  } else {
    weights.fail_key(ErrorCode::unsupported, "type", format("'%s' is not supported; supported: int, float", type.c_str()));
  }
  s.symmetric = weights.bool_or("symmetric", true);
  if (s.format == WeightFormat::fp8 && !s.symmetric)
    weights.fail_key(ErrorCode::unsupported, "symmetric", "= false is not supported for float weights");
  if (weights.bool_or("dynamic", false))
    weights.fail_key(ErrorCode::unsupported, "dynamic", "= true (weights quantized at run time) is not supported");

  std::string strategy = weights.string_or("strategy", "tensor");
  const bool int_weights = s.format == WeightFormat::int4 || s.format == WeightFormat::int8;
  if (strategy == "group" && int_weights) {
    s.granularity = ScaleGranularity::group;
    s.group_size = weights.bounded("group_size", limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH");
  } else if (strategy == "channel") {
    s.granularity = ScaleGranularity::channel;
  } else if (strategy == "tensor" && s.format == WeightFormat::fp8) {
    s.granularity = ScaleGranularity::tensor;
  } else if (strategy == "block" && s.format == WeightFormat::fp8) {
    s.granularity = ScaleGranularity::block;
    std::vector<int64_t> block = weights.int_list("block_structure");
    if (block.size() != 2 || block[0] <= 0 || block[1] <= 0)
      weights.fail_key(ErrorCode::bad_format, "block_structure", "must be [rows, cols] of positive sizes, e.g. [128, 128]");
    s.block_n = block[0];
    s.block_k = block[1];
  } else {
    weights.fail_key(ErrorCode::unsupported, "strategy",
                     format("'%s' is not supported for %s weights; supported: %s", strategy.c_str(),
                            s.format == WeightFormat::int4   ? "4-bit int"
                            : s.format == WeightFormat::int8 ? "8-bit int"
                                                             : "8-bit float",
                            int_weights ? "group, channel" : "tensor, channel, block"));
  }
  // actorder: "group"/"dynamic" (or true) store weight_g_idx; "weight"/"static" reorder offline and store none.
  if (const json* actorder = weights.find("actorder")) {
    if (actorder->is_boolean()) s.actorder = actorder->get<bool>();
    else if (actorder->is_string()) {
      std::string order = actorder->get<std::string>();
      if (order == "group" || order == "dynamic") s.actorder = true;
      else if (order != "weight" && order != "static")
        weights.fail_key(ErrorCode::unsupported, "actorder",
                         format("'%s' is not supported; supported: group, dynamic, weight, static", order.c_str()));
    } else {
      weights.fail_key(ErrorCode::bad_format, "actorder", "must be a string, true, false or null");
    }
  }
  if (std::optional<Node> inputs = group.optional_child("input_activations")) {
    s.dynamic_activations = inputs->bool_or("dynamic", false);
    if (s.format == WeightFormat::int8) {
      // W8A8: int8 activations, one scale per token computed at run time; static scales (input_scale) are not read
      const std::string input_type = inputs->string_or("type", "int"), input_strategy = inputs->string_or("strategy", "tensor");
      if (input_type != "int" || inputs->positive_or("num_bits", 8) != 8 || !s.dynamic_activations ||
          input_strategy != "token" || !inputs->bool_or("symmetric", true))
        group.fail_key(ErrorCode::unsupported, "input_activations",
                       format("(%s %lld-bit, strategy %s, dynamic %s) is not supported with int8 weights; supported: "
                              "none (W8A16) or symmetric int8 per token, dynamic (W8A8)",
                              input_type.c_str(), (long long)inputs->positive_or("num_bits", 8), input_strategy.c_str(),
                              s.dynamic_activations ? "true" : "false"));
    }
  }
  return s;
}

// One AWQ / GPTQ scheme's numeric fields (bits, group size, zero point, act-order) from `q`: the
// quantization_config itself, or one `dynamic` rule's overrides laid over it.
inline QuantScheme awq_gptq_scheme(const Node& q, bool awq) {
  QuantScheme s;
  s.format = WeightFormat::int4;
  const char* bits_key = q.has("bits") || !q.has("w_bit") ? "bits" : "w_bit";
  std::optional<int64_t> bits = q.optional_int(bits_key);
  if (!bits) q.fail_key(ErrorCode::bad_format, bits_key, "is missing");
  if (*bits != 4 && (awq || *bits != 8))
    q.fail_key(ErrorCode::unsupported, bits_key,
               format("= %lld: kvlite reads %s; download the model's %s or compressed-tensors W4A16 release",
                      (long long)*bits, awq ? "4-bit AWQ" : "4- and 8-bit GPTQ", awq ? "4-bit AWQ" : "GPTQ-Int4"));
  s.num_bits = int(*bits);
  if (*bits == 8) s.format = WeightFormat::int8;
  const char* group_key = q.has("group_size") || !q.has("q_group_size") ? "group_size" : "q_group_size";
  std::optional<int64_t> group = q.optional_int(group_key);
  if (!group) q.fail_key(ErrorCode::bad_format, group_key, "is missing");
  if (*group == -1 && !awq) {
    s.granularity = ScaleGranularity::channel;  // GPTQ group_size -1: one scale per output row
  } else if (*group > 0 && *group <= limits::max_model_width) {
    s.granularity = ScaleGranularity::group;
    s.group_size = *group;
  } else {
    q.fail_key(ErrorCode::bad_format, group_key,
               format("= %lld; expected a positive group size%s", (long long)*group, awq ? "" : " or -1 (per channel)"));
  }
  if (awq) {
    s.symmetric = !q.bool_or("zero_point", true);
  } else {
    s.symmetric = q.bool_or("sym", true);
    s.actorder = q.bool_or("desc_act", false);
  }
  return s;
}

// GPTQModel's `dynamic`: {"<regex>": {overrides}, ...}, read in order, first match (re.match) wins. "-:<regex>"
// leaves the module dense (GPTQModel stores it as a plain .weight); "+:<regex>" or a bare regex quantizes it
// with the listed fields replacing the base config's. Fields that change the stored layout are read (bits,
// group_size, sym, desc_act; zero_point for AWQ); those that only steer the quantizer's search are ignored as
// the base config's are; anything else is refused by name, as an override kvlite would otherwise drop silently.
// `order`: the rules' keys as the file lists them (nlohmann::json sorts an object's keys, and which rule comes first
// decides a module that two of them match; see dynamic_rule_order).
inline void parse_dynamic_rules(const Node& q, bool awq, const std::vector<std::string>& order, QuantConfig& quant) {
  const json* dynamic = q.find("dynamic");
  if (!dynamic) return;
  if (!dynamic->is_object()) q.fail_key(ErrorCode::bad_format, "dynamic", "must be a JSON object of regex -> overrides");
  if (order.size() != dynamic->size())  // the caller read the same text: only a bug gets here
    q.fail_key(ErrorCode::internal, "dynamic", format("has %zu rules, but their file order lists %zu",
                                                      dynamic->size(), order.size()));
  static const char* const kLayoutKeys[] = {"bits", "group_size", "sym", "desc_act", "zero_point"};
  static const char* const kSearchKeys[] = {"damp_percent", "damp_auto_increment", "static_groups", "true_sequential",
                                            "mse", "act_group_aware", "v2", "v2_alpha", "gptaq", "foem", "hessian",
                                            "fallback", "smooth", "failsafe"};
  for (const std::string& key : order) {
    auto it = dynamic->find(key);
    if (it == dynamic->end()) q.fail_key(ErrorCode::internal, "dynamic", "'" + key + "' is not among its rules");
    const Node rule_node{&it.value(), q.key_path("dynamic") + "." + key, q.origin};
    if (!it.value().is_object())
      fail(ErrorCode::bad_format, format("%s: %s must be a JSON object of overrides, not %s", q.origin.c_str(),
                                           rule_node.path.c_str(), it.value().dump().c_str()));
    const bool negative = key.compare(0, 2, "-:") == 0;
    const std::string pattern = negative || key.compare(0, 2, "+:") == 0 ? key.substr(2) : key;
    if (!regex_compiles(pattern))
      fail(ErrorCode::bad_format, format("%s: %s: '%s' is not a valid regular expression", q.origin.c_str(),
                                           rule_node.path.c_str(), pattern.c_str()));
    QuantConfig::Rule rule;
    rule.pattern = pattern;
    if (!negative) {
      json merged = *q.value;  // the base config with this rule's fields replaced
      for (auto field = it.value().begin(); field != it.value().end(); ++field) {
        const std::string& name = field.key();
        const bool layout = std::find_if(std::begin(kLayoutKeys), std::end(kLayoutKeys),
                                         [&](const char* k) { return name == k; }) != std::end(kLayoutKeys);
        const bool search = std::find_if(std::begin(kSearchKeys), std::end(kSearchKeys),
                                         [&](const char* k) { return name == k; }) != std::end(kSearchKeys);
        if (!layout && !search)
          rule_node.fail_key(ErrorCode::unsupported, name,
                             "is not supported in a dynamic override; kvlite reads bits, group_size, sym, desc_act "
                             "(AWQ: zero_point) there, and \"-:<regex>\" for a module left unquantized");
        if (layout) merged[name] = field.value();
      }
      QuantScheme s = awq_gptq_scheme(Node{&merged, rule_node.path, q.origin}, awq);
      s.packing = quant.schemes[0].packing;  // checkpoint_format / AWQ version are the file's, not a module's
      rule.scheme = int(quant.schemes.size());
      quant.schemes.push_back(s);  // no targets: only the rule selects it
    }
    quant.rules.push_back(rule);
  }
}

// quant_method "awq" (AutoAWQ GEMM) and "gptq" (AutoGPTQ / GPTQModel / optimum): one int4 (GPTQ: or int8) scheme for every Linear
// but those in modules_to_not_convert and lm_head, which neither quantizes (transformers' get_modules_to_not_convert
// adds the output embedding; GPTQ's `lm_head: true` is the exception, refused below), and GPTQModel's `dynamic`
// rules on top.
inline QuantConfig parse_awq_gptq(const Node& q, const std::string& method, const std::vector<std::string>& dynamic_order) {
  QuantConfig quant;
  const bool awq = method == "awq";
  quant.method = awq ? QuantMethod::awq : QuantMethod::gptq;
  QuantScheme s = awq_gptq_scheme(q, awq);
  s.targets = {"Linear"};
  if (awq) {
    quant.format = "awq";
    s.packing = IntPacking::awq;
    std::string version = q.string_or("version", "gemm");
    std::transform(version.begin(), version.end(), version.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    if (version != "gemm")
      q.fail_key(ErrorCode::unsupported, "version",
                 format("'%s' is not supported; kvlite reads AutoAWQ's GEMM layout (version gemm), the one "
                        "published AWQ checkpoints use", version.c_str()));
  } else {
    quant.format = "gptq";
    // GPTQModel writes checkpoint_format; older configs call it `format`; absent means v1.
    const char* format_key = q.has("checkpoint_format") ? "checkpoint_format" : "format";
    const std::string checkpoint_format = q.string_or(format_key, "gptq");
    if (checkpoint_format == "gptq") s.packing = IntPacking::gptq;
    else if (checkpoint_format == "gptq_v2") s.packing = IntPacking::gptq_v2;
    else
      q.fail_key(ErrorCode::unsupported, format_key,
                 format("'%s' is not supported; supported: gptq (v1, zero points stored minus one), gptq_v2",
                        checkpoint_format.c_str()));
    if (q.bool_or("lm_head", false))
      q.fail_key(ErrorCode::unsupported, "lm_head", "= true (a quantized lm_head) is not supported");
  }
  quant.schemes.push_back(s);
  parse_dynamic_rules(q, awq, dynamic_order, quant);
  quant.modules_to_not_convert = q.string_list("modules_to_not_convert");
  quant.modules_to_not_convert.push_back("lm_head");
  return quant;
}

// Quantization methods kvlite does not read, refused with what to download or convert instead.
[[noreturn]] inline void refuse_quant_method(const Node& q, const std::string& method) {
  if (method == "bitsandbytes") {
    const bool four_bit = q.bool_or("load_in_4bit", false);
    const std::string type = four_bit ? q.string_or("bnb_4bit_quant_type", "fp4") : std::string("int8");
    q.fail_key(ErrorCode::unsupported, "quant_method",
               format("'bitsandbytes' (%s, LLM.int8 / QLoRA's format) is not supported: its kernels are "
                      "bitsandbytes' own. Download the model's AWQ, GPTQ-Int4 or compressed-tensors W4A16 release, "
                      "or the unquantized checkpoint",
                      type.c_str()));
  }
  if (method == "modelopt") {
    const std::string algo = q.string_or("quant_algo", "?");
    q.fail_key(ErrorCode::unsupported, "quant_method",
               format("'modelopt' (%s) is not supported%s; download the model's compressed-tensors W4A16, AWQ, "
                      "GPTQ-Int4 or FP8 release",
                      algo.c_str(), algo == "NVFP4" ? " (NVFP4 needs Blackwell FP4 tensor cores)" : ""));
  }
  if (method == "gguf")
    q.fail_key(ErrorCode::unsupported, "quant_method",
               "'gguf' is not supported: kvlite reads safetensors checkpoints; download the model's Hugging Face "
               "release (AWQ, GPTQ-Int4 or compressed-tensors W4A16 for 4 bits)");
  q.fail_key(ErrorCode::unsupported, "quant_method",
             format("'%s' is not supported; supported: compressed-tensors, fp8, awq, gptq", method.c_str()));
}

inline QuantConfig parse_quant(const Node& q, const std::vector<std::string>& dynamic_order = {}) {
  QuantConfig quant;
  std::optional<std::string> method = q.optional_string("quant_method");
  if (!method) q.fail_key(ErrorCode::bad_format, "quant_method", "is missing");
  if (*method == "compressed-tensors") {
    quant.method = QuantMethod::compressed_tensors;
    quant.format = q.string_or("format", "");
    static const char* const kFormats[] = {"pack-quantized", "int-quantized", "float-quantized", "naive-quantized",
                                           "mixed-precision"};
    if (quant.format == "nvfp4-pack-quantized")
      q.fail_key(ErrorCode::unsupported, "format",
                 "'nvfp4-pack-quantized' (NVFP4: 4-bit e2m1 weights with fp8 block scales) is not supported; "
                 "download the compressed-tensors W4A16 (pack-quantized), AWQ or GPTQ-Int4 release of the model");
    if (!quant.format.empty() &&
        std::find(std::begin(kFormats), std::end(kFormats), quant.format) == std::end(kFormats))
      q.fail_key(ErrorCode::unsupported, "format",
                 format("'%s' is not supported; supported: pack-quantized (int4, int8), int-quantized (int8), "
                        "float-quantized and naive-quantized (fp8), mixed-precision of those",
                        quant.format.c_str()));
    if (std::optional<Node> kv = q.optional_child("kv_cache_scheme")) {
      // vLLM reads per-tensor static fp8 KV scales; nothing else is a scheme kvlite can honour.
      const int64_t bits = kv->positive_or("num_bits", 8);
      const std::string type = kv->string_or("type", "float"), strategy = kv->string_or("strategy", "tensor");
      if (bits != 8 || type != "float")
        q.fail_key(ErrorCode::unsupported, "kv_cache_scheme",
                   format("is %lld-bit %s; supported: 8-bit float (an e4m3 KV cache)", (long long)bits, type.c_str()));
      if (strategy != "tensor")
        q.fail_key(ErrorCode::unsupported, "kv_cache_scheme",
                   format("has strategy '%s'; supported: tensor (one k_scale and v_scale per layer)", strategy.c_str()));
      if (kv->bool_or("dynamic", false))
        q.fail_key(ErrorCode::unsupported, "kv_cache_scheme", "is dynamic; supported: static scales in the checkpoint");
      quant.kv_cache_fp8 = true;
    }
    Node groups = q.child("config_groups");
    if (groups.value->empty() && !quant.kv_cache_fp8)
      q.fail_key(ErrorCode::bad_format, "config_groups", "is empty (and there is no kv_cache_scheme)");
    for (auto it = groups.value->begin(); it != groups.value->end(); ++it) quant.schemes.push_back(parse_ct_group(groups.child(it.key()), quant.format));
    quant.ignore = q.string_list("ignore");
    check_patterns(q, "ignore", quant.ignore);
  } else if (*method == "fp8") {
    quant.method = QuantMethod::fp8;
    quant.format = "fp8";
    std::string fmt = q.string_or("fmt", "e4m3");
    if (fmt != "e4m3") q.fail_key(ErrorCode::unsupported, "fmt", format("'%s' is not supported; supported: e4m3", fmt.c_str()));
    std::string activations = q.string_or("activation_scheme", "dynamic");
    if (activations != "dynamic")
      q.fail_key(ErrorCode::unsupported, "activation_scheme",
                 format("'%s' is not supported; supported: dynamic", activations.c_str()));
    QuantScheme s;
    s.targets = {"Linear"};
    s.format = WeightFormat::fp8;
    s.num_bits = 8;
    s.granularity = ScaleGranularity::block;
    s.block_n = s.block_k = 128;  // transformers' FineGrainedFP8Config default
    if (const json* block = q.find("weight_block_size")) {
      std::vector<int64_t> sizes = q.int_list("weight_block_size");
      if (sizes.size() != 2 || sizes[0] <= 0 || sizes[1] <= 0)
        q.fail_key(ErrorCode::bad_format, "weight_block_size",
                   format("must be [rows, cols] of positive sizes, not %s", block->dump().c_str()));
      s.block_n = sizes[0];
      s.block_k = sizes[1];
    }
    s.dynamic_activations = true;
    quant.schemes.push_back(s);
    // transformers' FineGrainedFP8 quantizer adds the output embedding when the config names no modules
    // (get_modules_to_not_convert): a config without the key keeps lm_head in the model dtype.
    if (!q.has("modules_to_not_convert")) quant.modules_to_not_convert = {"lm_head"};
    else quant.modules_to_not_convert = q.string_list("modules_to_not_convert");
  } else if (*method == "awq" || *method == "gptq") {
    quant = parse_awq_gptq(q, *method, dynamic_order);
  } else {
    refuse_quant_method(q, *method);
  }
  return quant;
}

}  // namespace cfg
}  // namespace detail

namespace detail {
// The `dynamic` rule that decides this module (GPTQModel: the first that matches), or nullptr.
inline const QuantConfig::Rule* quant_rule_for(const QuantConfig& quant, const std::string& module_name) {
  for (const QuantConfig::Rule& rule : quant.rules)
    if (cfg::regex_matches_start(rule.pattern, module_name)) return &rule;
  return nullptr;
}
}  // namespace detail

bool quant_ignores(const QuantConfig& quant, const std::string& module_name) {
  if (const QuantConfig::Rule* rule = detail::quant_rule_for(quant, module_name); rule && rule->scheme < 0) return true;
  for (const std::string& entry : quant.ignore)
    if (entry == "Linear" || detail::cfg::ct_name_matches(module_name, entry)) return true;
  for (const std::string& key : quant.modules_to_not_convert) {
    if (!key.empty() && module_name.find(key) != std::string::npos) return true;
    if (detail::cfg::has_regex_syntax(key) && detail::cfg::regex_matches_start(key, module_name)) return true;
  }
  return false;
}

namespace detail {
const QuantScheme* quant_scheme_for(const QuantConfig& quant, const std::string& module_name) {
  if (quant.method == QuantMethod::none || quant_ignores(quant, module_name)) return nullptr;
  if (const QuantConfig::Rule* rule = quant_rule_for(quant, module_name)) return &quant.schemes[size_t(rule->scheme)];
  const QuantScheme* best = nullptr;
  int best_rank = 3;  // 0 exact name, 1 regex, 2 class "Linear"
  for (const QuantScheme& scheme : quant.schemes)
    for (const std::string& target : scheme.targets) {
      int rank = 3;
      if (target == "Linear") rank = 2;
      else if (target.compare(0, 3, "re:") == 0) rank = cfg::regex_matches_start(target.substr(3), module_name) ? 1 : 3;
      else if (target == module_name) rank = 0;
      if (rank < best_rank) {
        best = &scheme;
        best_rank = rank;
      }
    }
  return best;
}
}  // namespace detail

Result<ModelConfig> parse_config(const std::string& json_text, const std::string& origin) {
  return detail::guard([&]() -> ModelConfig {
    using detail::cfg::Node;
    if (json_text.size() > uint64_t(limits::max_json_bytes))
      detail::fail(ErrorCode::bad_format, detail::format("%s is %zu bytes; at most %lld (KVLITE_MAX_JSON_BYTES)",
                                                         origin.c_str(), json_text.size(),
                                                         (long long)limits::max_json_bytes));
    nlohmann::json doc = detail::cfg::parse_json(json_text, origin);
    Node root{&doc, "", origin};
    ModelConfig config;
    config.origin = origin;
    std::optional<std::string> model_type = root.optional_string("model_type");
    if (!model_type) root.fail_key(ErrorCode::bad_format, "model_type", "is missing");
    config.model_type = *model_type;
    if (*model_type == "llama") config.arch = Arch::llama;
    else if (*model_type == "qwen2") config.arch = Arch::qwen2;
    else if (*model_type == "qwen3") config.arch = Arch::qwen3;
    else if (*model_type == "qwen3_vl") config.arch = Arch::qwen3_vl;
    else if (*model_type == "qwen2_5_vl") config.arch = Arch::qwen2_5_vl;
    else if (*model_type == "mistral") config.arch = Arch::mistral;
    else if (*model_type == "gemma2") config.arch = Arch::gemma2;
    else if (*model_type == "gemma3_text" || *model_type == "gemma3") config.arch = Arch::gemma3;
    else if (*model_type == "phi3") config.arch = Arch::phi3;
    else
      root.fail_key(ErrorCode::unsupported, "model_type",
                    detail::format("'%s' is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_vl, qwen2_5_vl, gemma2, "
                                   "gemma3_text, gemma3 (its text model), phi3", model_type->c_str()));

    if (config.arch == Arch::qwen3_vl || config.arch == Arch::qwen2_5_vl) {
      // Qwen2.5-VL's published files keep the text keys at the top level (Qwen2_5_VLConfig gathers them into
      // text_config); transformers 5 writes text_config.
      const bool nested = config.arch == Arch::qwen3_vl || root.has("text_config");
      config.text = detail::cfg::parse_text(nested ? root.child("text_config") : root, root, config.arch);
      config.vision = detail::cfg::parse_vision(root.child("vision_config"), config.arch);
      if (config.arch == Arch::qwen2_5_vl)  // Qwen2VLImageProcessor's class defaults: OpenAI CLIP's mean / std
        for (int c = 0; c < 3; c++) {
          config.image_mean[c] = std::array<double, 3>{0.48145466, 0.4578275, 0.40821073}[size_t(c)];
          config.image_std[c] = std::array<double, 3>{0.26862954, 0.26130258, 0.27577711}[size_t(c)];
        }
      // transformers' Qwen3VLConfig / Qwen2_5_VLConfig defaults (the same ids)
      config.image_token_id = root.checked_ids("image_token_id", {root.optional_int("image_token_id").value_or(151655)})[0];
      config.video_token_id = root.checked_ids("video_token_id", {root.optional_int("video_token_id").value_or(151656)})[0];
      config.vision_start_token_id = root.checked_ids("vision_start_token_id", {root.optional_int("vision_start_token_id").value_or(151652)})[0];
      config.vision_end_token_id = root.checked_ids("vision_end_token_id", {root.optional_int("vision_end_token_id").value_or(151653)})[0];
    } else if (config.arch == Arch::gemma3) {
      // gemma3_text at the top level; gemma3 (multimodal) nests it in text_config (its vision tower is not run)
      const bool nested = *model_type == "gemma3";
      nlohmann::json text = nested ? *root.child("text_config").value : doc;
      const double local_theta = detail::cfg::prepare_gemma3_text(text, origin);
      Node text_node{&text, nested ? "text_config" : "", origin};
      config.text = detail::cfg::parse_text(text_node, root, config.arch);
      config.text.block.local_rope_theta = local_theta;
      config.text.block.max_positions_scaled = true;
      if (nested && root.has("vision_config")) {
        // Gemma3ForConditionalGeneration's SigLIP tower (SiglipVisionConfig defaults for absent keys) and its
        // projector, for the weights estimate: patch conv + bias, position table, per layer q/k/v/o with
        // biases, fc1/fc2 with biases and 2 LayerNorms, the post LayerNorm, then mm_input_projection [C, H]
        // and mm_soft_emb_norm [C].
        Node vision = root.child("vision_config");
        auto size = [&](const char* key, int64_t fallback) {
          return uint64_t(vision.bounded_or(key, fallback, limits::max_model_width, "KVLITE_MAX_MODEL_WIDTH"));
        };
        const uint64_t C = size("hidden_size", 768), F = size("intermediate_size", 3072),
                       depth = size("num_hidden_layers", 12), patch = size("patch_size", 16),
                       image = size("image_size", 224), channels = size("num_channels", 3);
        if (patch == 0 || image % patch != 0)
          vision.fail_key(ErrorCode::bad_format, "patch_size", "must divide image_size");
        const uint64_t positions = (image / patch) * (image / patch);
        const uint64_t layer = 4 * (C * C + C) + (C * F + F) + (F * C + C) + 4 * C;
        config.unrun_params = (C * channels * patch * patch + C) + positions * C + depth * layer + 2 * C +
                              C * uint64_t(config.text.hidden_size) + C;
      }
    } else {
      config.text = detail::cfg::parse_text(root, root, config.arch);
    }

    // Early compressed-tensors checkpoints wrote `compression_config`; some VLMs nest it in text_config.
    std::optional<Node> quant = root.optional_child("quantization_config");
    if (!quant) quant = root.optional_child("compression_config");
    if (!quant && root.has("text_config")) quant = root.child("text_config").optional_child("quantization_config");
    if (quant) config.quant = detail::cfg::parse_quant(*quant, detail::cfg::dynamic_rule_order(json_text, quant->path));
    return config;
  });
}

namespace detail {
std::string normalization_problem(const std::string& key, double value) {
  double low = 0, high = 0;
  const char* macros = "";
  if (key == "image_mean") {
    low = 0.0 - limits::image_mean_margin, high = 1.0 + limits::image_mean_margin;
    macros = "KVLITE_IMAGE_MEAN_MARGIN";
  } else if (key == "image_std") {
    low = limits::min_image_std, high = limits::max_image_std;
    macros = "KVLITE_MIN_IMAGE_STD, KVLITE_MAX_IMAGE_STD";
  } else {
    low = limits::min_rescale_factor, high = limits::max_rescale_factor;
    macros = "KVLITE_MIN_RESCALE_FACTOR, KVLITE_MAX_RESCALE_FACTOR";
  }
  if (value >= low && value <= high) return "";  // false for NaN
  return format("is %g: it must be in [%g, %g] (%s)", value, low, high, macros);
}
}  // namespace detail

Result<ModelConfig> apply_processor_config(ModelConfig config, const std::string& json_text, const std::string& origin) {
  return detail::guard([&]() -> ModelConfig {
    using detail::cfg::Node;
    if (json_text.size() > uint64_t(limits::max_json_bytes))
      detail::fail(ErrorCode::bad_format, detail::format("%s is %zu bytes; at most %lld (KVLITE_MAX_JSON_BYTES)",
                                                         origin.c_str(), json_text.size(),
                                                         (long long)limits::max_json_bytes));
    nlohmann::json doc = detail::cfg::parse_json(json_text, origin);
    Node root{&doc, "", origin};
    const int64_t kPixels = limits::max_processor_pixels;
    const char* kPixelsMacro = "KVLITE_MAX_PROCESSOR_PIXELS";
    // Qwen2VLImageProcessor: `size` = {shortest_edge, longest_edge} are MIN and MAX PIXEL COUNTS; top-level
    // min_pixels / max_pixels (older files) override them, as its __init__ does.
    if (std::optional<Node> size = root.optional_child("size")) {
      config.min_pixels = size->bounded_or("shortest_edge", size->bounded_or("min_pixels", 0, kPixels, kPixelsMacro), kPixels, kPixelsMacro);
      config.max_pixels = size->bounded_or("longest_edge", size->bounded_or("max_pixels", 0, kPixels, kPixelsMacro), kPixels, kPixelsMacro);
    }
    config.min_pixels = root.bounded_or("min_pixels", config.min_pixels, kPixels, kPixelsMacro);
    config.max_pixels = root.bounded_or("max_pixels", config.max_pixels, kPixels, kPixelsMacro);
    // Every other key the Qwen2-VL / Qwen3-VL image processor reads is used, or refused naming the key and
    // what kvlite supports: never ignored (a CLIP mean/std ignored moved logits 0.4 relative, silently).
    for (const char* name : {"image_mean", "image_std"}) {
      double* out = std::string(name) == "image_mean" ? config.image_mean : config.image_std;
      const nlohmann::json* v = root.find(name);
      if (!v || v->is_null()) continue;
      std::vector<double> values;
      if (v->is_number()) values.assign(3, v->get<double>());
      else if (v->is_array() && v->size() == 3 && std::all_of(v->begin(), v->end(), [](const nlohmann::json& x) { return x.is_number(); }))
        for (const auto& x : *v) values.push_back(x.get<double>());
      else
        root.fail_key(ErrorCode::bad_format, name, detail::format("must be a number or 3 numbers (R, G, B), not %s", v->dump().c_str()));
      for (size_t c = 0; c < 3; c++) {
        const std::string problem = detail::normalization_problem(name, values[c]);
        if (!problem.empty()) root.fail_key(ErrorCode::bad_format, detail::format("%s[%zu]", name, c), problem);
        out[c] = values[c];
      }
    }
    config.rescale_factor = root.number_or("rescale_factor", config.rescale_factor);
    if (const std::string problem = detail::normalization_problem("rescale_factor", config.rescale_factor); !problem.empty())
      root.fail_key(ErrorCode::bad_format, "rescale_factor", problem);
    for (const char* flag : {"do_resize", "do_rescale", "do_normalize", "do_convert_rgb"})
      if (!root.bool_or(flag, true))
        root.fail_key(ErrorCode::unsupported, flag,
                      "is false; kvlite's image path always resizes, rescales, normalizes and converts to RGB as "
                      "Qwen-VL checkpoints are published (true or absent is supported)");
    if (const nlohmann::json* resample = root.find("resample"); resample && !resample->is_null() &&
                                                                !(resample->is_number_integer() && resample->get<int64_t>() == 3))
      root.fail_key(ErrorCode::unsupported, "resample",
                    detail::format("is %s; kvlite resizes with antialiased bicubic (3), as Qwen-VL's processor does",
                                   resample->dump().c_str()));
    if (config.vision.present) {
      const std::pair<const char*, int64_t> sizes[] = {{"patch_size", config.vision.patch_size},
                                                       {"temporal_patch_size", config.vision.temporal_patch_size},
                                                       {"merge_size", config.vision.spatial_merge_size}};
      for (const auto& size : sizes)
        if (std::optional<int64_t> given = root.optional_int(size.first); given && *given != size.second)
          root.fail_key(ErrorCode::bad_format, size.first,
                        detail::format("is %lld but config.json's vision_config says %lld: the processor and the "
                                       "vision tower must agree", (long long)*given, (long long)size.second));
    }
    // The budget images get (preprocess_options: kvlite's default for a count the file leaves out) must leave
    // room for one: a file with only a maximum below the default minimum refused every image, not itself.
    ModelConfig without_file = config;
    without_file.min_pixels = without_file.max_pixels = 0;
    const PreprocessOptions defaults = preprocess_options(without_file);
    const int64_t min_pixels = config.min_pixels > 0 ? config.min_pixels : defaults.min_pixels;
    const int64_t max_pixels = config.max_pixels > 0 ? config.max_pixels : defaults.max_pixels;
    if (min_pixels > max_pixels)
      detail::fail(ErrorCode::bad_format,
                   detail::format("%s: the minimum pixel count %lld%s is larger than the maximum %lld%s", origin.c_str(),
                                  (long long)min_pixels, config.min_pixels > 0 ? "" : " (kvlite's default: the file sets none)",
                                  (long long)max_pixels, config.max_pixels > 0 ? "" : " (kvlite's default: the file sets none)"));
    return config;
  });
}

Result<ModelConfig> load_config(const std::string& model_dir) {
  return detail::guard([&]() -> ModelConfig {
    std::string path = detail::path_join(model_dir, "config.json");
    auto is_gguf = [](const std::string& name) {
      return name.size() > 5 && (name.compare(name.size() - 5, 5, ".gguf") == 0 || name.compare(name.size() - 5, 5, ".GGUF") == 0);
    };
    if (is_gguf(model_dir))
      detail::fail(ErrorCode::unsupported,
                   detail::format("%s is a GGUF file (llama.cpp's format), which kvlite does not read: download the "
                                  "model's Hugging Face release (safetensors + config.json; for 4 bits its AWQ, "
                                  "GPTQ-Int4 or compressed-tensors W4A16 repo)", model_dir.c_str()));
    if (!detail::file_exists(path))
      detail::fail(ErrorCode::io_error,
                   detail::format("%s not found: a model directory needs the config.json its checkpoint was published with",
                                  path.c_str()));
    ModelConfig config = parse_config(detail::read_text_file(path), path).value();

    std::string processor_path = detail::path_join(model_dir, "preprocessor_config.json");
    if (detail::file_exists(processor_path))
      config = apply_processor_config(std::move(config), detail::read_text_file(processor_path), processor_path).value();
    return config;
  });
}

// ---- Linears ----------------------------------------------------------------------------------------------
namespace detail {
namespace cfg {

// A Linear as config.json says it must be.
struct LinearSpec {
  std::string name;
  int64_t n = 0, k = 0;  // out_features, in_features
  bool bias = false;
  bool vision = false;
};

inline std::vector<LinearSpec> linear_specs(const ModelConfig& c) {
  std::vector<LinearSpec> specs;
  const TextConfig& t = c.text;
  const int64_t q_out = t.num_heads * t.head_dim, kv_out = t.num_kv_heads * t.head_dim;
  const std::string prefix = c.text_prefix();
  for (int64_t i = 0; i < t.num_layers; i++) {
    std::string layer = prefix + format("layers.%lld.", (long long)i);
    if (t.block.fused_projections) {  // Phi-3: q | k | v and gate | up as one stored Linear each
      specs.push_back({layer + "self_attn.qkv_proj", q_out + 2 * kv_out, t.hidden_size, t.attention_bias, false});
    } else {
      specs.push_back({layer + "self_attn.q_proj", q_out, t.hidden_size, t.attention_bias, false});
      specs.push_back({layer + "self_attn.k_proj", kv_out, t.hidden_size, t.attention_bias, false});
      specs.push_back({layer + "self_attn.v_proj", kv_out, t.hidden_size, t.attention_bias, false});
    }
    specs.push_back({layer + "self_attn.o_proj", t.hidden_size, q_out, t.o_proj_bias, false});
    if (t.block.fused_projections) {
      specs.push_back({layer + "mlp.gate_up_proj", 2 * t.intermediate_size, t.hidden_size, t.mlp_bias, false});
    } else {
      specs.push_back({layer + "mlp.gate_proj", t.intermediate_size, t.hidden_size, t.mlp_bias, false});
      specs.push_back({layer + "mlp.up_proj", t.intermediate_size, t.hidden_size, t.mlp_bias, false});
    }
    specs.push_back({layer + "mlp.down_proj", t.hidden_size, t.intermediate_size, t.mlp_bias, false});
  }
  if (!t.tie_word_embeddings) specs.push_back({"lm_head", t.vocab_size, t.hidden_size, false, false});
  if (c.vision.present) {
    const VisionConfig& v = c.vision;
    const int64_t merged = v.hidden_size * v.spatial_merge_size * v.spatial_merge_size;  // 2x2 patches per row
    const std::string& visual = v.traits.prefix;
    const bool swiglu = v.traits.mlp == VisionMlp::swiglu;
    for (int64_t i = 0; i < v.depth; i++) {
      std::string block = visual + format("blocks.%lld.", (long long)i);
      specs.push_back({block + "attn.qkv", 3 * v.hidden_size, v.hidden_size, true, true});
      specs.push_back({block + "attn.proj", v.hidden_size, v.hidden_size, true, true});
      if (swiglu) {  // Qwen2_5_VLMLP(bias=True)
        specs.push_back({block + "mlp.gate_proj", v.intermediate_size, v.hidden_size, true, true});
        specs.push_back({block + "mlp.up_proj", v.intermediate_size, v.hidden_size, true, true});
        specs.push_back({block + "mlp.down_proj", v.hidden_size, v.intermediate_size, true, true});
      } else {
        specs.push_back({block + "mlp.linear_fc1", v.intermediate_size, v.hidden_size, true, true});
        specs.push_back({block + "mlp.linear_fc2", v.hidden_size, v.intermediate_size, true, true});
      }
    }
    // Qwen3VLVisionPatchMerger's linear_fc1 / linear_fc2; Qwen2_5_VLPatchMerger's nn.Sequential mlp.0 / mlp.2
    auto merger = [&](const std::string& name) {
      specs.push_back({name + (swiglu ? ".mlp.0" : ".linear_fc1"), merged, merged, true, true});
      specs.push_back({name + (swiglu ? ".mlp.2" : ".linear_fc2"), v.out_hidden_size, merged, true, true});
    };
    merger(visual + "merger");
    for (size_t j = 0; j < v.deepstack_visual_indexes.size(); j++) merger(visual + format("deepstack_merger_list.%zu", j));
  }
  return specs;
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); i++) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

inline DType fp8_scale_dtype(const ModelConfig& c) {
  // transformers' FP8Linear holds weight_scale_inv in float32; compressed-tensors scales follow the model dtype.
  return c.quant.method == QuantMethod::fp8 ? DType::F32 : c.text.dtype;
}

inline LinearDesc estimate_linear(const ModelConfig& c, const LinearSpec& spec) {
  LinearDesc d;
  d.name = spec.name;
  d.out_features = spec.n;
  d.in_features = spec.k;
  d.has_bias = spec.bias;
  d.vision = spec.vision;
  d.exact = false;
  const DType dtype = c.text.dtype;
  const uint64_t n = uint64_t(spec.n), k = uint64_t(spec.k);
  uint64_t bytes = spec.bias ? dtype_bytes(dtype, n) : 0;
  const QuantScheme* scheme = quant_scheme_for(c.quant, spec.name);
  if (!scheme || scheme->format == WeightFormat::dense) {
    d.format = WeightFormat::dense;
    d.weight_dtype = dtype;
    d.scale_dtype = dtype;
    bytes += dtype_bytes(dtype, n * k);
  } else if (scheme->format == WeightFormat::int8) {
    // INT8: compressed-tensors int-quantized (weight I8 [N, K]) or pack-quantized (I32 [N, K/4]); GPTQ 8-bit
    // (qweight I32 [K/4, N], qzeros [G, N/4], scales [G, N], g_idx [K]). Scales in the model dtype.
    d.format = WeightFormat::int8;
    d.packing = scheme->packing;
    d.granularity = scheme->granularity;
    d.group_size = scheme->granularity == ScaleGranularity::group ? scheme->group_size : spec.k;
    d.scale_dtype = dtype;
    d.symmetric = scheme->symmetric;
    d.has_g_idx = scheme->actorder;
    d.int8_activations = scheme->dynamic_activations;
    const uint64_t groups = ceil_div(k, uint64_t(d.group_size));
    const bool gptq = scheme->packing == IntPacking::gptq || scheme->packing == IntPacking::gptq_v2;
    d.weight_dtype = scheme->packing == IntPacking::compressed_tensors_unpacked ? DType::I8 : DType::I32;
    d.scale_name = gptq ? "scales" : "weight_scale";
    bytes += n * ceil_div(k, 4) * 4 + dtype_bytes(dtype, n * groups);
    if (gptq) {
      bytes += groups * ceil_div(n, 4) * 4 + k * 4;  // qzeros, g_idx
    } else {
      if (!d.symmetric)  // weight_zero_point: I8 [N, G] (int-quantized) or I32 [N/4, G] (pack-quantized)
        bytes += scheme->packing == IntPacking::compressed_tensors_unpacked ? n * groups : ceil_div(n, 4) * groups * 4;
      if (scheme->packing == IntPacking::compressed_tensors) bytes += 2 * 8;  // weight_shape (2,) I64
      if (d.has_g_idx) bytes += k * 4;                                         // weight_g_idx (K,) I32
    }
  } else if (scheme->format == WeightFormat::int4 && scheme->packing != IntPacking::compressed_tensors) {
    // AWQ / GPTQ (src/quant_formats.hpp): int32 words of 8 values, scales [G, N] in the model dtype (float16 in
    // every published checkpoint), zero points [G, N/8] (GPTQ stores them even when symmetric), GPTQ's g_idx [K].
    d.format = WeightFormat::int4;
    d.weight_dtype = DType::I32;
    d.packing = scheme->packing;
    d.granularity = scheme->granularity;
    d.group_size = scheme->granularity == ScaleGranularity::group ? scheme->group_size : spec.k;
    d.scale_dtype = dtype;
    d.scale_name = "scales";
    d.symmetric = scheme->symmetric;
    d.has_g_idx = scheme->actorder;
    const uint64_t groups = ceil_div(k, uint64_t(d.group_size));
    const bool gptq = scheme->packing != IntPacking::awq;
    bytes += ceil_div(k * n, 8) * 4;                          // qweight: AWQ (K, N/8), GPTQ (K/8, N) I32
    bytes += dtype_bytes(dtype, n * groups);                 // scales (G, N)
    if (gptq || !d.symmetric) bytes += groups * ceil_div(n, 8) * 4;  // qzeros (G, N/8) I32
    if (gptq) bytes += k * 4;                                // g_idx (K,) I32
  } else if (scheme->format == WeightFormat::int4) {
    d.format = WeightFormat::int4;
    d.weight_dtype = DType::I32;
    d.granularity = scheme->granularity;
    d.group_size = scheme->granularity == ScaleGranularity::group ? scheme->group_size : spec.k;
    d.scale_dtype = dtype;
    d.scale_name = "weight_scale";
    d.symmetric = scheme->symmetric;
    d.has_g_idx = scheme->actorder;
    const uint64_t groups = ceil_div(k, uint64_t(d.group_size));
    bytes += n * ceil_div(k, 8) * 4;           // weight_packed (N, K/8) I32
    bytes += dtype_bytes(dtype, n * groups);   // weight_scale (N, groups)
    bytes += 2 * 8;                            // weight_shape (2,) I64
    if (!d.symmetric) bytes += ceil_div(n, 8) * groups * 4;  // weight_zero_point (N/8, groups) I32
    if (d.has_g_idx) bytes += k * 4;                         // weight_g_idx (K,) I32
  } else {
    d.format = WeightFormat::fp8;
    d.weight_dtype = DType::F8_E4M3;
    d.granularity = scheme->granularity;
    d.block_n = scheme->block_n;
    d.block_k = scheme->block_k;
    d.scale_dtype = fp8_scale_dtype(c);
    d.scale_name = c.quant.method == QuantMethod::fp8 ? "weight_scale_inv" : "weight_scale";
    uint64_t scales = 1;
    if (d.granularity == ScaleGranularity::channel) scales = n;
    if (d.granularity == ScaleGranularity::block) scales = ceil_div(n, uint64_t(d.block_n)) * ceil_div(k, uint64_t(d.block_k));
    bytes += n * k + dtype_bytes(d.scale_dtype, scales);
    if (!scheme->dynamic_activations) bytes += dtype_bytes(DType::F32, 1);  // static input_scale (1,)
  }
  d.bytes = bytes;
  return d;
}

// Every tensor name a Linear may own on disk; its bytes are the sum of those present.
static const char* const kLinearTensorSuffixes[] = {"weight",       "weight_packed",     "weight_shape",
                                                    "weight_scale", "weight_scale_inv", "weight_zero_point",
                                                    "weight_g_idx", "input_scale",      "bias",
                                                    "qweight",      "qzeros",           "scales",
                                                    "g_idx"};

struct HeaderReader {
  const TensorLookup& lookup;
  const TensorData& data;
  const TensorInfo* find(const std::string& name) const { return lookup(name); }
  [[noreturn]] void bad_shape(const TensorInfo& t, const std::vector<int64_t>& expected, const std::string& why) const {
    fail(ErrorCode::bad_format, format("%s has shape %s but %s expects %s", t.name.c_str(), shape_text(t.shape).c_str(),
                                       why.c_str(), shape_text(expected).c_str()));
  }
  void expect_dtype(const TensorInfo& t, DType dtype) const {
    if (t.dtype != dtype)
      fail(ErrorCode::bad_format, format("%s has dtype %s; this format stores it as %s", t.name.c_str(), dtype_name(t.dtype),
                                         dtype_name(dtype)));
  }
  void expect_scale_dtype(const TensorInfo& t) const {
    if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16)
      fail(ErrorCode::unsupported, format("%s has dtype %s; scales are supported as F32, BF16 or F16", t.name.c_str(),
                                          dtype_name(t.dtype)));
  }
};

inline void describe_int4(const ModelConfig& c, const LinearSpec& spec, const HeaderReader& h, const TensorInfo& packed,
                          LinearDesc& d) {
  const std::string& p = spec.name;
  const int64_t n = spec.n, k = spec.k;
  h.expect_dtype(packed, DType::I32);
  if (const TensorInfo* shape = h.find(p + ".weight_shape")) {
    h.expect_dtype(*shape, DType::I64);
    if (shape->shape != std::vector<int64_t>{2}) h.bad_shape(*shape, {2}, "pack-quantized");
    if (const uint8_t* bytes = h.data ? h.data(*shape) : nullptr) {
      int64_t stored[2];
      memcpy(stored, bytes, sizeof stored);  // little-endian I64, as safetensors stores it
      if (stored[0] != n || stored[1] != k)
        fail(ErrorCode::bad_format,
             format("%s holds %s but config.json gives this Linear [%lld, %lld] (out, in)", shape->name.c_str(),
                    shape_text({stored[0], stored[1]}).c_str(), (long long)n, (long long)k));
    }
  }
  const QuantScheme* declared = quant_scheme_for(c.quant, p);
  const bool eight_bit = declared && declared->format == WeightFormat::int8;
  const int64_t per_word = eight_bit ? 4 : 8;  // compressed-tensors packs 32 / num_bits values a word
  const std::vector<int64_t> packed_shape{n, int64_t(ceil_div(uint64_t(k), uint64_t(per_word)))};
  if (packed.shape != packed_shape)
    h.bad_shape(packed, packed_shape,
                format("[out %lld, in %lld] packed %lld per I32", (long long)n, (long long)k, (long long)per_word));

  const TensorInfo* scale = h.find(p + ".weight_scale");
  if (!scale)
    fail(ErrorCode::missing_tensor, format("%s.weight_scale is missing: %s.weight_packed needs its scales", p.c_str(), p.c_str()));
  h.expect_scale_dtype(*scale);
  const QuantScheme* scheme = declared;
  if (scheme && (scheme->format == WeightFormat::int4 || scheme->format == WeightFormat::int8)) {
    d.granularity = scheme->granularity;
    d.group_size = scheme->granularity == ScaleGranularity::group ? scheme->group_size : k;
    if (d.granularity == ScaleGranularity::group && k % d.group_size != 0)
      fail(ErrorCode::bad_format,
           format("%s: group_size %lld does not divide in_features %lld; int kernels need whole groups",
                  packed.name.c_str(), (long long)d.group_size, (long long)k));
    const std::vector<int64_t> expected{n, d.granularity == ScaleGranularity::group ? k / d.group_size : 1};
    if (scale->shape != expected)
      h.bad_shape(*scale, expected,
                  format("strategy %s%s", scale_granularity_name(d.granularity),
                         d.granularity == ScaleGranularity::group ? format(" (group_size %lld)", (long long)d.group_size).c_str() : ""));
  } else {  // the config does not say (the module is not targeted): read the layout off the scale
    if (scale->shape.size() != 2 || scale->shape[0] != n || scale->shape[1] <= 0 || k % scale->shape[1] != 0)
      h.bad_shape(*scale, {n, 1}, "a channel scale, or [out, in / group_size] for groups,");
    d.granularity = scale->shape[1] == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
    d.group_size = k / scale->shape[1];
  }
  const int64_t groups = scale->shape[1];
  d.scale_dtype = scale->dtype;
  d.scale_name = "weight_scale";
  if (const TensorInfo* zero = h.find(p + ".weight_zero_point")) {
    h.expect_dtype(*zero, DType::I32);
    const std::vector<int64_t> expected{int64_t(ceil_div(uint64_t(n), uint64_t(per_word))), groups};
    if (zero->shape != expected)
      h.bad_shape(*zero, expected, format("an asymmetric zero point packed %lld per I32 along out", (long long)per_word));
    d.symmetric = false;
  }
  if (const TensorInfo* g_idx = h.find(p + ".weight_g_idx")) {
    h.expect_dtype(*g_idx, DType::I32);
    if (g_idx->shape != std::vector<int64_t>{k}) h.bad_shape(*g_idx, {k}, "one group index per input column");
    d.has_g_idx = true;
  }
  d.format = eight_bit ? WeightFormat::int8 : WeightFormat::int4;
  d.packing = IntPacking::compressed_tensors;
  d.int8_activations = eight_bit && declared->dynamic_activations;
  d.weight_dtype = DType::I32;
}

// compressed-tensors "int-quantized" (INT8 W8A16 / W8A8): weight I8 [N, K], weight_scale [N, 1] or [N, G],
// weight_zero_point I8 of the scale's shape (asymmetric only), weight_g_idx I32 [K] (actorder).
inline void describe_int8_unpacked(const ModelConfig& c, const LinearSpec& spec, const HeaderReader& h,
                                   const TensorInfo& weight, LinearDesc& d) {
  const std::string& p = spec.name;
  const int64_t n = spec.n, k = spec.k;
  if (weight.shape != std::vector<int64_t>{n, k}) h.bad_shape(weight, {n, k}, "config.json [out, in]");
  const TensorInfo* scale = h.find(p + ".weight_scale");
  if (!scale) fail(ErrorCode::missing_tensor, format("%s.weight_scale is missing: %s is I8 (int-quantized) and needs its scales", p.c_str(), weight.name.c_str()));
  h.expect_scale_dtype(*scale);
  if (scale->shape.size() != 2 || scale->shape[0] != n || scale->shape[1] <= 0 || k % scale->shape[1] != 0)
    h.bad_shape(*scale, {n, 1}, "a channel scale, or [out, in / group_size] for groups,");
  const QuantScheme* scheme = quant_scheme_for(c.quant, p);
  const int64_t groups = scale->shape[1];
  if (scheme && scheme->format == WeightFormat::int8 && scheme->granularity == ScaleGranularity::group &&
      groups * scheme->group_size != k)
    h.bad_shape(*scale, {n, k / scheme->group_size}, format("group_size %lld", (long long)scheme->group_size));
  d.granularity = groups == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
  d.group_size = k / groups;
  d.scale_dtype = scale->dtype;
  d.scale_name = "weight_scale";
  if (const TensorInfo* zero = h.find(p + ".weight_zero_point")) {
    h.expect_dtype(*zero, DType::I8);
    if (zero->shape != scale->shape) h.bad_shape(*zero, scale->shape, "one int8 zero point per scale");
    d.symmetric = false;
  }
  if (const TensorInfo* g_idx = h.find(p + ".weight_g_idx")) {
    h.expect_dtype(*g_idx, DType::I32);
    if (g_idx->shape != std::vector<int64_t>{k}) h.bad_shape(*g_idx, {k}, "one group index per input column");
    d.has_g_idx = true;
  }
  d.format = WeightFormat::int8;
  d.packing = IntPacking::compressed_tensors_unpacked;
  d.int8_activations = scheme && scheme->format == WeightFormat::int8 && scheme->dynamic_activations;
  d.weight_dtype = DType::I8;
}

// AWQ / GPTQ tensors (src/quant_formats.hpp has the layouts): shapes checked against config.json's [N, K], the
// group size from the config (or, for a Linear it does not cover, from the scales' rows).
inline void describe_awq_gptq(const ModelConfig& c, const LinearSpec& spec, const HeaderReader& h,
                              const TensorInfo& qweight, LinearDesc& d) {
  const std::string& p = spec.name;
  const int64_t n = spec.n, k = spec.k;
  if (c.quant.method != QuantMethod::awq && c.quant.method != QuantMethod::gptq)
    fail(ErrorCode::bad_format,
         format("%s is an AWQ / GPTQ tensor but config.json's quantization_config is not quant_method awq or gptq",
                qweight.name.c_str()));
  const bool awq = c.quant.method == QuantMethod::awq;
  const char* method = awq ? "AWQ" : "GPTQ";
  h.expect_dtype(qweight, DType::I32);
  const QuantScheme* declared = quant_scheme_for(c.quant, p);
  const bool eight_bit = declared ? declared->format == WeightFormat::int8 : (!awq && qweight.shape.size() == 2 && qweight.shape[0] * 4 == k);
  const int64_t per_word = eight_bit ? 4 : 8;
  // AWQ packs 8 int4 values a word along N; GPTQ packs 32 / bits values a word along K.
  if (n % per_word != 0 || k % per_word != 0)
    fail(ErrorCode::bad_format, format("%s: [out %lld, in %lld] are not multiples of %lld, which %s's %d-bit words need",
                                       qweight.name.c_str(), (long long)n, (long long)k, (long long)per_word, method,
                                       eight_bit ? 8 : 4));
  const std::vector<int64_t> packed_shape =
      awq ? std::vector<int64_t>{k, n / 8} : std::vector<int64_t>{k / per_word, n};
  if (qweight.shape != packed_shape)
    h.bad_shape(qweight, packed_shape,
                format("%s %d-bit of [out %lld, in %lld] packed %lld per I32 along %s", method, eight_bit ? 8 : 4,
                       (long long)n, (long long)k, (long long)per_word, awq ? "out" : "in"));
  const TensorInfo* scales = h.find(p + ".scales");
  if (!scales) fail(ErrorCode::missing_tensor, format("%s.scales is missing: %s needs its scales", p.c_str(), qweight.name.c_str()));
  h.expect_scale_dtype(*scales);
  const QuantScheme* scheme = declared;
  int64_t groups = 0;
  if (scheme && scheme->format != WeightFormat::dense) {
    d.granularity = scheme->granularity;
    d.group_size = scheme->granularity == ScaleGranularity::group ? scheme->group_size : k;
    d.symmetric = scheme->symmetric;
    d.has_g_idx = scheme->actorder;
    if (k % d.group_size != 0)
      fail(ErrorCode::bad_format, format("%s: group_size %lld does not divide in_features %lld; int4 kernels need whole groups",
                                         qweight.name.c_str(), (long long)d.group_size, (long long)k));
    groups = k / d.group_size;
  } else {  // not covered by the config (listed in modules_to_not_convert, yet stored packed): read the scales
    if (scales->shape.size() != 2 || scales->shape[0] <= 0 || k % scales->shape[0] != 0)
      h.bad_shape(*scales, {1, n}, "[in / group_size, out] scales");
    groups = scales->shape[0];
    d.group_size = k / groups;
    d.granularity = groups == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
    d.symmetric = awq ? !h.find(p + ".qzeros") : false;
    d.has_g_idx = false;
  }
  const std::vector<int64_t> scale_shape{groups, n};
  if (scales->shape != scale_shape)
    h.bad_shape(*scales, scale_shape, format("group_size %lld over [out %lld, in %lld]", (long long)d.group_size,
                                             (long long)n, (long long)k));
  d.scale_dtype = scales->dtype;
  d.scale_name = "scales";
  const TensorInfo* zeros = h.find(p + ".qzeros");
  if (zeros) {
    h.expect_dtype(*zeros, DType::I32);
    if (zeros->shape != std::vector<int64_t>{groups, n / per_word})
      h.bad_shape(*zeros, {groups, n / per_word}, format("zero points packed %lld per I32 along out", (long long)per_word));
  } else if (!awq || !d.symmetric) {
    fail(ErrorCode::missing_tensor, format("%s.qzeros is missing: %s stores %s zero points there", p.c_str(), method,
                                           awq ? "AWQ's (zero_point true)" : "GPTQ's"));
  }
  if (const TensorInfo* g_idx = h.find(p + ".g_idx")) {
    h.expect_dtype(*g_idx, DType::I32);
    if (g_idx->shape != std::vector<int64_t>{k}) h.bad_shape(*g_idx, {k}, "one group index per input row");
  } else if (d.has_g_idx) {
    fail(ErrorCode::missing_tensor, format("%s.g_idx is missing: desc_act true (act-order) stores each input row's "
                                           "group there", p.c_str()));
  }
  d.packing = scheme && scheme->format != WeightFormat::dense ? scheme->packing
              : awq                                            ? IntPacking::awq
                                                               : IntPacking::gptq;
  d.format = eight_bit ? WeightFormat::int8 : WeightFormat::int4;
  d.weight_dtype = DType::I32;
}

inline void describe_fp8(const ModelConfig& c, const LinearSpec& spec, const HeaderReader& h, const TensorInfo& weight,
                         LinearDesc& d) {
  const std::string& p = spec.name;
  const int64_t n = spec.n, k = spec.k;
  if (weight.shape != std::vector<int64_t>{n, k}) h.bad_shape(weight, {n, k}, "config.json [out, in]");
  const TensorInfo* scale = h.find(p + ".weight_scale_inv");
  d.scale_name = "weight_scale_inv";
  if (!scale) {
    scale = h.find(p + ".weight_scale");
    d.scale_name = "weight_scale";
  }
  if (!scale)
    fail(ErrorCode::missing_tensor, format("%s is F8_E4M3 but neither %s.weight_scale_inv nor %s.weight_scale exists",
                                           weight.name.c_str(), p.c_str(), p.c_str()));
  h.expect_scale_dtype(*scale);
  d.scale_dtype = scale->dtype;
  // Block sizes: the config's, else the 128 x 128 every published block-fp8 checkpoint uses.
  const QuantScheme* scheme = quant_scheme_for(c.quant, p);
  int64_t bn = 128, bk = 128;
  if (scheme && scheme->granularity == ScaleGranularity::block) {
    bn = scheme->block_n;
    bk = scheme->block_k;
  }
  const std::vector<int64_t> block_shape{int64_t(ceil_div(uint64_t(n), uint64_t(bn))), int64_t(ceil_div(uint64_t(k), uint64_t(bk)))};
  const bool block_expected = scheme && scheme->granularity == ScaleGranularity::block;
  if (scale->shape == block_shape && (block_expected || scale->shape != std::vector<int64_t>{n, 1})) {
    d.granularity = ScaleGranularity::block;
    d.block_n = bn;
    d.block_k = bk;
  } else if (scale->shape == std::vector<int64_t>{n, 1}) {
    d.granularity = ScaleGranularity::channel;
  } else if (scale->shape.size() <= 1 && scale->numel() == 1) {
    d.granularity = ScaleGranularity::tensor;
  } else {
    fail(ErrorCode::bad_format,
         format("%s has shape %s; for a [%lld, %lld] fp8 weight expected [1] (tensor), [%lld, 1] (channel) or %s "
                "(%lld x %lld blocks)",
                scale->name.c_str(), shape_text(scale->shape).c_str(), (long long)n, (long long)k, (long long)n,
                shape_text(block_shape).c_str(), (long long)bn, (long long)bk));
  }
  d.format = WeightFormat::fp8;
  d.weight_dtype = DType::F8_E4M3;
}

inline LinearDesc describe_linear(const ModelConfig& c, const LinearSpec& spec, const HeaderReader& h) {
  LinearDesc d;
  d.name = spec.name;
  d.out_features = spec.n;
  d.in_features = spec.k;
  d.vision = spec.vision;
  d.exact = true;
  const std::string& p = spec.name;
  if (const TensorInfo* qweight = h.find(p + ".qweight")) {
    describe_awq_gptq(c, spec, h, *qweight, d);
  } else if (const TensorInfo* packed = h.find(p + ".weight_packed")) {
    describe_int4(c, spec, h, *packed, d);
  } else if (const TensorInfo* weight = h.find(p + ".weight")) {
    if (weight->dtype == DType::F8_E4M3) {
      describe_fp8(c, spec, h, *weight, d);
    } else if (weight->dtype == DType::I8) {
      describe_int8_unpacked(c, spec, h, *weight, d);
    } else if (weight->dtype == DType::BF16 || weight->dtype == DType::F16 || weight->dtype == DType::F32) {
      if (weight->shape != std::vector<int64_t>{spec.n, spec.k}) h.bad_shape(*weight, {spec.n, spec.k}, "config.json [out, in]");
      d.format = WeightFormat::dense;
      d.weight_dtype = d.scale_dtype = weight->dtype;
    } else {
      fail(ErrorCode::unsupported,
           format("%s has dtype %s; Linear weights are supported as BF16/F16/F32, F8_E4M3 or I8 (int-quantized) with "
                  "scales, compressed-tensors pack-quantized, AWQ or GPTQ",
                  weight->name.c_str(), dtype_name(weight->dtype)));
    }
  } else {
    fail(ErrorCode::missing_tensor,
         format("%s.weight (or %s.weight_packed) is not in the checkpoint, but config.json (model_type %s) has this Linear",
                p.c_str(), p.c_str(), c.model_type.c_str()));
  }
  if (const TensorInfo* bias = h.find(p + ".bias")) {
    if (bias->shape != std::vector<int64_t>{spec.n}) h.bad_shape(*bias, {spec.n}, "one bias per output");
    d.has_bias = true;
  }
  for (const char* suffix : kLinearTensorSuffixes)
    if (const TensorInfo* t = h.find(p + "." + suffix)) d.bytes += t->nbytes;
  return d;
}

inline bool is_vision_tensor(const std::string& name) {
  return name.compare(0, 13, "model.visual.") == 0 || name.compare(0, 7, "visual.") == 0;
}

}  // namespace cfg

std::vector<LinearDesc> estimate_linears(const ModelConfig& config) {
  std::vector<LinearDesc> out;
  for (const cfg::LinearSpec& spec : cfg::linear_specs(config)) out.push_back(cfg::estimate_linear(config, spec));
  return out;
}

std::vector<LinearDesc> describe_linears_from(const ModelConfig& config, const TensorLookup& lookup, const TensorData& data) {
  cfg::HeaderReader reader{lookup, data};
  std::vector<LinearDesc> out;
  for (const cfg::LinearSpec& spec : cfg::linear_specs(config)) out.push_back(cfg::describe_linear(config, spec, reader));
  return out;
}

WeightsSummary summarize_weights_from(const ModelConfig& config, const std::vector<TensorInfo>& tensors, const TensorData& data) {
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : tensors) by_name[t.name] = &t;
  TensorLookup lookup = [&](const std::string& name) -> const TensorInfo* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  WeightsSummary s;
  s.exact = true;
  s.linears = describe_linears_from(config, lookup, data);
  for (const TensorInfo& t : tensors) {
    s.total_bytes += t.nbytes;
    if (cfg::is_vision_tensor(t.name)) s.vision_bytes += t.nbytes;
  }
  s.text_bytes = s.total_bytes - s.vision_bytes;
  const std::string embed = config.text_prefix() + "embed_tokens.weight";
  const TensorInfo* table = lookup(embed);
  if (!table)
    fail(ErrorCode::missing_tensor, format("%s (the input embedding table) is not in the checkpoint", embed.c_str()));
  s.embedding_bytes = table->nbytes;
  s.embed_table_bytes = table->nbytes;
  for (const LinearDesc& linear : s.linears)
    if (linear.name == "lm_head") s.embedding_bytes += linear.bytes;
  return s;
}

WeightsSummary estimate_weights(const ModelConfig& config) {
  WeightsSummary s;
  s.exact = false;
  s.linears = estimate_linears(config);
  const TextConfig& t = config.text;
  const DType dtype = t.dtype;
  const uint64_t hidden = uint64_t(t.hidden_size), layers = uint64_t(t.num_layers);
  const uint64_t embedding = dtype_bytes(dtype, uint64_t(t.vocab_size) * hidden);
  // input / post-attention (+ Gemma's pre- / post-feedforward) per layer, and the final norm
  uint64_t norms = layers * (t.block.sandwich_norms ? 4 : 2) * dtype_bytes(dtype, hidden) + dtype_bytes(dtype, hidden);
  if (t.qk_norm) norms += layers * 2 * dtype_bytes(dtype, uint64_t(t.head_dim));
  uint64_t text_linears = 0, vision_linears = 0, lm_head = 0;
  for (const LinearDesc& linear : s.linears) {
    (linear.vision ? vision_linears : text_linears) += linear.bytes;
    if (linear.name == "lm_head") lm_head = linear.bytes;
  }
  s.embedding_bytes = embedding + lm_head;
  s.embed_table_bytes = embedding;
  s.text_bytes = embedding + norms + text_linears;
  if (config.vision.present) {
    const VisionConfig& v = config.vision;
    const uint64_t vh = uint64_t(v.hidden_size), merged = vh * uint64_t(v.spatial_merge_size * v.spatial_merge_size);
    // LayerNorm: weight + bias; RMSNorm (Qwen2.5-VL): weight
    const uint64_t norm_tensors = v.traits.norm == VisionNorm::layer_norm ? 2 : 1;
    auto layer_norm = [&](uint64_t dim) { return norm_tensors * dtype_bytes(dtype, dim); };
    uint64_t vision = vision_linears;
    // patch_embed: Conv3d(in_channels -> hidden, kernel (temporal, patch, patch)), with bias in Qwen3-VL
    vision += dtype_bytes(dtype, vh * uint64_t(v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size)) +
              (v.traits.patch_embed_bias ? dtype_bytes(dtype, vh) : 0);
    vision += dtype_bytes(dtype, uint64_t(v.num_position_embeddings) * vh);  // pos_embed table (0 without one)
    vision += uint64_t(v.depth) * 2 * layer_norm(vh);                       // norm1, norm2 per block
    vision += layer_norm(vh);                                               // merger.norm / ln_q (before the shuffle)
    vision += uint64_t(v.deepstack_visual_indexes.size()) * layer_norm(merged);  // post-shuffle norms
    s.vision_bytes = vision;
  }
  s.vision_bytes += dtype_bytes(dtype, config.unrun_params);  // a tower on disk that is not run (gemma3)
  s.total_bytes = s.text_bytes + s.vision_bytes;
  return s;
}

}  // namespace detail

Result<std::vector<LinearDesc>> describe_linears(const ModelConfig& config, const TensorStore* store) {
  return detail::guard([&]() -> std::vector<LinearDesc> {
    if (!store || store->empty()) return detail::estimate_linears(config);
    return detail::describe_linears_from(
        config, [store](const std::string& name) { return store->find(name); },
        [store](const TensorInfo& tensor) { return store->data(tensor); });
  });
}

Result<WeightsSummary> summarize_weights(const ModelConfig& config, const TensorStore* store) {
  return detail::guard([&]() -> WeightsSummary {
    if (!store || store->empty()) return detail::estimate_weights(config);
    return detail::summarize_weights_from(config, store->tensors(),
                                          [store](const TensorInfo& tensor) { return store->data(tensor); });
  });
}

}  // namespace kvlite
