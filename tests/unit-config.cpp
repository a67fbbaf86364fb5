// config: config.json parsing (llama, qwen2, qwen3, qwen3_vl; both rope layouts), quantization_config, module
// matching, and the per-Linear descriptors from config alone and from in-memory safetensors headers.
#include <doctest/doctest.h>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"
using namespace kvlite;
using json = nlohmann::json;

namespace {

std::string source_path(const std::string& relative) { return std::string(KVLITE_SOURCE_DIR) + "/" + relative; }
json read_json(const std::string& relative) { return json::parse(detail::read_text_file(source_path(relative))); }

ModelConfig parse(const json& doc) {
  Result<ModelConfig> config = parse_config(doc.dump(), "test.json");
  if (!config) FAIL(config.error().message);
  return config.value();
}
Error parse_failure(const std::string& text) {
  Result<ModelConfig> config = parse_config(text, "test.json");
  REQUIRE_FALSE(config.ok());
  return config.error();
}
Error parse_failure(const json& doc) { return parse_failure(doc.dump()); }
bool mentions(const Error& error, const std::string& text) { return error.message.find(text) != std::string::npos; }

const LinearDesc& linear(const std::vector<LinearDesc>& linears, const std::string& name) {
  auto it = std::find_if(linears.begin(), linears.end(), [&](const LinearDesc& d) { return d.name == name; });
  REQUIRE_MESSAGE(it != linears.end(), name);
  return *it;
}

// Tensor headers in memory (what a TensorStore holds), with bytes for the few tensors whose values are read.
struct FakeCheckpoint {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::vector<uint8_t>> bytes;

  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> data = {}) {
    remove(name);
    TensorInfo t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.nbytes = dtype_bytes(dtype, t.numel());
    tensors.push_back(t);
    if (!data.empty()) bytes[name] = std::move(data);
  }
  void remove(const std::string& name) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const TensorInfo& t) { return t.name == name; }),
                  tensors.end());
    bytes.erase(name);
  }
  // Drops a Linear's weight and everything quantization added, keeping its bias.
  void clear_weight(const std::string& p) {
    for (const char* suffix : {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_scale_inv",
                               "weight_zero_point", "weight_g_idx", "input_scale"})
      remove(p + "." + suffix);
  }
  const TensorInfo* find(const std::string& name) const {
    for (const TensorInfo& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  uint64_t bytes_of(const std::string& prefix) const {
    uint64_t sum = 0;
    for (const TensorInfo& t : tensors)
      if (t.name.compare(0, prefix.size(), prefix) == 0) sum += t.nbytes;
    return sum;
  }
  detail::TensorLookup lookup() const {
    return [this](const std::string& name) { return find(name); };
  }
  detail::TensorData data() const {
    return [this](const TensorInfo& t) -> const uint8_t* {
      auto it = bytes.find(t.name);
      return it == bytes.end() ? nullptr : it->second.data();
    };
  }
  std::vector<LinearDesc> describe(const ModelConfig& config) const {
    return detail::describe_linears_from(config, lookup(), data());
  }
  Error describe_failure(const ModelConfig& config) const {
    try {
      describe(config);
    } catch (const Error& e) {
      return e;
    }
    FAIL("describe_linears_from accepted a broken checkpoint");
    return Error();
  }
};

std::vector<uint8_t> i64_bytes(std::vector<int64_t> values) {
  std::vector<uint8_t> out(values.size() * 8);
  memcpy(out.data(), values.data(), out.size());
  return out;
}

// Every Linear of the config as a BF16 weight (and its bias).
FakeCheckpoint dense_linears(const ModelConfig& config) {
  FakeCheckpoint ck;
  for (const LinearDesc& d : detail::estimate_linears(config)) {
    ck.add(d.name + ".weight", DType::BF16, {d.out_features, d.in_features});
    if (d.has_bias) ck.add(d.name + ".bias", DType::BF16, {d.out_features});
  }
  return ck;
}

void put_int4(FakeCheckpoint& ck, const std::string& p, int64_t n, int64_t k, int64_t group_size, bool asymmetric,
              bool g_idx, DType scale_dtype = DType::BF16) {
  ck.clear_weight(p);
  const int64_t groups = (k + group_size - 1) / group_size;
  ck.add(p + ".weight_packed", DType::I32, {n, (k + 7) / 8});
  ck.add(p + ".weight_scale", scale_dtype, {n, groups});
  ck.add(p + ".weight_shape", DType::I64, {2}, i64_bytes({n, k}));
  if (asymmetric) ck.add(p + ".weight_zero_point", DType::I32, {(n + 7) / 8, groups});
  if (g_idx) ck.add(p + ".weight_g_idx", DType::I32, {k});
}

void put_fp8(FakeCheckpoint& ck, const std::string& p, int64_t n, int64_t k, const std::string& scale_name,
             DType scale_dtype, std::vector<int64_t> scale_shape) {
  ck.clear_weight(p);
  ck.add(p + ".weight", DType::F8_E4M3, {n, k});
  ck.add(p + "." + scale_name, scale_dtype, std::move(scale_shape));
}

json tiny_llama() { return read_json("tests/fixtures/configs/tiny-llama.json"); }
json tiny_vl() { return read_json("tests/fixtures/configs/tiny-qwen3-vl.json"); }
json int4_group(int64_t group_size) {
  return {{"quant_method", "compressed-tensors"},
          {"format", "pack-quantized"},
          {"ignore", {"lm_head"}},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"}, {"group_size", group_size}}},
              {"input_activations", nullptr}}}}}};
}

}  // namespace

// ---- the shipped configs, against their published numbers ---------------------------------------------------

TEST_CASE("Qwen3-4B config.json parses with the published numbers") {
  Result<ModelConfig> loaded = load_config(source_path("models/qwen3-4b"));
  REQUIRE_MESSAGE(loaded.ok(), loaded.error().message);
  const ModelConfig& c = loaded.value();
  CHECK(c.arch == Arch::qwen3);
  CHECK(c.text.num_layers == 36);
  CHECK(c.text.num_heads == 32);
  CHECK(c.text.num_kv_heads == 8);
  CHECK(c.text.head_dim == 128);
  CHECK(c.text.hidden_size == 2560);
  CHECK(c.text.intermediate_size == 9728);
  CHECK(c.text.vocab_size == 151936);
  CHECK(c.text.max_position_embeddings == 40960);
  CHECK(c.text.rope.theta == 1000000.0);
  CHECK(c.text.rope.type == "default");
  CHECK(c.text.tie_word_embeddings);
  CHECK(c.text.qk_norm);
  CHECK_FALSE(c.text.attention_bias);
  CHECK(c.text.rms_norm_eps == 1e-6);
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{151645});
  CHECK(c.quant.method == QuantMethod::none);
  CHECK(c.text_prefix() == "model.");
  CHECK(c.kv_bytes_per_token(2) == 147456);  // 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
  CHECK(c.min_pixels == 0);  // no preprocessor_config.json
}

TEST_CASE("Llama-3.1-8B-Instruct W4A16 config.json parses with the published numbers") {
  Result<ModelConfig> loaded = load_config(source_path("models/llama-3.1-8b-instruct-w4a16"));
  REQUIRE_MESSAGE(loaded.ok(), loaded.error().message);
  const ModelConfig& c = loaded.value();
  CHECK(c.arch == Arch::llama);
  CHECK(c.text.num_layers == 32);
  CHECK(c.text.num_heads == 32);
  CHECK(c.text.num_kv_heads == 8);
  CHECK(c.text.head_dim == 128);  // no head_dim key: 4096 / 32
  CHECK(c.text.hidden_size == 4096);
  CHECK(c.text.intermediate_size == 14336);
  CHECK(c.text.vocab_size == 128256);
  CHECK(c.text.max_position_embeddings == 131072);
  CHECK(c.text.rms_norm_eps == 1e-5);
  CHECK(c.text.rope.theta == 500000.0);
  CHECK(c.text.rope.type == "llama3");
  CHECK(c.text.rope.factor == 8.0);
  CHECK(c.text.rope.low_freq_factor == 1.0);
  CHECK(c.text.rope.high_freq_factor == 4.0);
  CHECK(c.text.rope.original_max_position_embeddings == 8192);
  CHECK_FALSE(c.text.tie_word_embeddings);
  CHECK_FALSE(c.text.qk_norm);
  CHECK(c.text.bos_token_ids == std::vector<int64_t>{128000});
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{128001, 128008, 128009});
  CHECK(c.text.dtype == DType::BF16);
  CHECK(c.kv_bytes_per_token(2) == 131072);

  REQUIRE(c.quant.method == QuantMethod::compressed_tensors);
  CHECK(c.quant.format == "pack-quantized");
  REQUIRE(c.quant.schemes.size() == 1);
  const QuantScheme& s = c.quant.schemes[0];
  CHECK(s.format == WeightFormat::int4);
  CHECK(s.num_bits == 4);
  CHECK(s.granularity == ScaleGranularity::group);
  CHECK(s.group_size == 128);
  CHECK(s.symmetric);
  CHECK_FALSE(s.actorder);
  CHECK_FALSE(s.dynamic_activations);
  CHECK(s.targets == std::vector<std::string>{"Linear"});
  CHECK(c.quant.ignore == std::vector<std::string>{"lm_head"});
}

TEST_CASE("Qwen3-VL-4B-Instruct-FP8 config.json and preprocessor_config.json parse with the published numbers") {
  Result<ModelConfig> loaded = load_config(source_path("models/qwen3-vl-4b-instruct-fp8"));
  REQUIRE_MESSAGE(loaded.ok(), loaded.error().message);
  const ModelConfig& c = loaded.value();
  CHECK(c.arch == Arch::qwen3_vl);
  CHECK(c.text_prefix() == "model.language_model.");
  CHECK(c.text.num_layers == 36);
  CHECK(c.text.num_heads == 32);
  CHECK(c.text.num_kv_heads == 8);
  CHECK(c.text.head_dim == 128);
  CHECK(c.text.hidden_size == 2560);
  CHECK(c.text.intermediate_size == 9728);
  CHECK(c.text.vocab_size == 151936);
  CHECK(c.text.max_position_embeddings == 262144);
  CHECK(c.text.rope.theta == 5000000.0);
  CHECK(c.text.rope.mrope_section == std::vector<int>{24, 20, 20});
  CHECK(c.text.rope.mrope_interleaved);
  CHECK(c.text.tie_word_embeddings);
  CHECK(c.text.qk_norm);
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{151645});
  CHECK(c.kv_bytes_per_token(2) == 147456);

  REQUIRE(c.vision.present);
  CHECK(c.vision.depth == 24);
  CHECK(c.vision.hidden_size == 1024);
  CHECK(c.vision.intermediate_size == 4096);
  CHECK(c.vision.num_heads == 16);
  CHECK(c.vision.out_hidden_size == 2560);
  CHECK(c.vision.num_position_embeddings == 2304);
  CHECK(c.vision.patch_size == 16);
  CHECK(c.vision.spatial_merge_size == 2);
  CHECK(c.vision.temporal_patch_size == 2);
  CHECK(c.vision.deepstack_visual_indexes == std::vector<int64_t>{5, 11, 17});
  CHECK(c.image_token_id == 151655);
  CHECK(c.video_token_id == 151656);
  CHECK(c.vision_start_token_id == 151652);
  CHECK(c.vision_end_token_id == 151653);

  REQUIRE(c.quant.method == QuantMethod::fp8);
  REQUIRE(c.quant.schemes.size() == 1);
  CHECK(c.quant.schemes[0].format == WeightFormat::fp8);
  CHECK(c.quant.schemes[0].granularity == ScaleGranularity::block);
  CHECK(c.quant.schemes[0].block_n == 128);
  CHECK(c.quant.schemes[0].block_k == 128);
  CHECK(c.quant.schemes[0].dynamic_activations);

  // preprocessor_config.json: size.{shortest,longest}_edge are pixel counts
  CHECK(c.min_pixels == 65536);
  CHECK(c.max_pixels == 16777216);
}

// ---- parsing rules ----------------------------------------------------------------------------------------

TEST_CASE("rope_scaling and rope_parameters layouts give identical RopeConfig") {
  auto same = [](const RopeConfig& a, const RopeConfig& b) {
    CHECK(a.type == b.type);
    CHECK(a.theta == b.theta);
    CHECK(a.factor == b.factor);
    CHECK(a.low_freq_factor == b.low_freq_factor);
    CHECK(a.high_freq_factor == b.high_freq_factor);
    CHECK(a.original_max_position_embeddings == b.original_max_position_embeddings);
    CHECK(a.mrope_section == b.mrope_section);
    CHECK(a.mrope_interleaved == b.mrope_interleaved);
  };
  SUBCASE("Llama-3.1 llama3 scaling") {
    json classic = read_json("models/llama-3.1-8b-instruct-w4a16/config.json");
    json v5 = classic;
    v5.erase("rope_theta");
    v5.erase("rope_scaling");
    v5["rope_parameters"] = {{"rope_type", "llama3"},    {"rope_theta", 500000.0},     {"factor", 8.0},
                             {"low_freq_factor", 1.0},   {"high_freq_factor", 4.0},    {"original_max_position_embeddings", 8192}};
    json legacy_type = classic;  // `type` instead of `rope_type`, as Llama-3.1's first release wrote it
    legacy_type["rope_scaling"].erase("rope_type");
    legacy_type["rope_scaling"]["type"] = "llama3";
    RopeConfig a = parse(classic).text.rope;
    same(a, parse(v5).text.rope);
    same(a, parse(legacy_type).text.rope);
    CHECK(a.type == "llama3");
  }
  SUBCASE("Qwen3-VL multimodal rope under text_config") {
    json classic = read_json("models/qwen3-vl-4b-instruct-fp8/config.json");
    json v5 = classic;
    v5["text_config"].erase("rope_theta");
    v5["text_config"].erase("rope_scaling");
    v5["text_config"]["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000000}, {"mrope_section", {24, 20, 20}},
                                            {"mrope_interleaved", true}};
    RopeConfig a = parse(classic).text.rope;
    same(a, parse(v5).text.rope);
    CHECK(a.mrope_section == std::vector<int>{24, 20, 20});
  }
}

TEST_CASE("torch_dtype or dtype, eos as an id or a list, rope under text_config only") {
  json doc = tiny_llama();
  doc.erase("torch_dtype");
  doc["dtype"] = "float16";
  doc["eos_token_id"] = 7;
  ModelConfig c = parse(doc);
  CHECK(c.text.dtype == DType::F16);
  CHECK(c.text.eos_token_ids == std::vector<int64_t>{7});
  CHECK(c.text.head_dim == 32);  // 192 / 6

  ModelConfig vl = parse(tiny_vl());  // transformers 5 layout: dtype, rope_parameters, tie at the top only
  CHECK(vl.text.dtype == DType::BF16);
  CHECK(vl.text.rope.theta == 5000000.0);
  CHECK(vl.text.rope.mrope_section == std::vector<int>{6, 5, 5});
  CHECK(vl.text.tie_word_embeddings);
  CHECK(vl.image_token_id == 77);
  CHECK(vl.video_token_id == 151656);  // transformers' default when the key is absent
}

TEST_CASE("biases per architecture: qwen2 q/k/v always, llama and qwen3 by attention_bias") {
  json qwen2 = tiny_llama();
  qwen2["model_type"] = "qwen2";
  std::vector<LinearDesc> q2 = detail::estimate_linears(parse(qwen2));
  CHECK(linear(q2, "model.layers.1.self_attn.q_proj").has_bias);
  CHECK(linear(q2, "model.layers.1.self_attn.v_proj").has_bias);
  CHECK_FALSE(linear(q2, "model.layers.1.self_attn.o_proj").has_bias);
  CHECK_FALSE(linear(q2, "model.layers.1.mlp.down_proj").has_bias);

  json llama = tiny_llama();
  llama["attention_bias"] = true;
  llama["mlp_bias"] = true;
  std::vector<LinearDesc> l = detail::estimate_linears(parse(llama));
  CHECK(linear(l, "model.layers.0.self_attn.o_proj").has_bias);
  CHECK(linear(l, "model.layers.0.mlp.up_proj").has_bias);
  CHECK_FALSE(linear(detail::estimate_linears(parse(tiny_llama())), "model.layers.0.self_attn.q_proj").has_bias);
}

TEST_CASE("the Linears of each architecture, with their shapes") {
  SUBCASE("llama, untied: 7 per layer and lm_head") {
    std::vector<LinearDesc> linears = detail::estimate_linears(parse(tiny_llama()));
    CHECK(linears.size() == 2 * 7 + 1);
    const LinearDesc& k = linear(linears, "model.layers.1.self_attn.k_proj");
    CHECK(k.out_features == 64);  // 2 KV heads x 32
    CHECK(k.in_features == 192);
    const LinearDesc& down = linear(linears, "model.layers.0.mlp.down_proj");
    CHECK(down.out_features == 192);
    CHECK(down.in_features == 320);
    CHECK(linear(linears, "lm_head").out_features == 1000);
  }
  SUBCASE("llama 3.2 style tied embeddings: no lm_head") {
    json tied = tiny_llama();
    tied["tie_word_embeddings"] = true;
    std::vector<LinearDesc> linears = detail::estimate_linears(parse(tied));
    CHECK(linears.size() == 2 * 7);
    CHECK(std::none_of(linears.begin(), linears.end(), [](const LinearDesc& d) { return d.name == "lm_head"; }));
  }
  SUBCASE("qwen3_vl: language model under model.language_model, the vision tower, mergers") {
    std::vector<LinearDesc> linears = detail::estimate_linears(parse(tiny_vl()));
    CHECK(linears.size() == 2 * 7 + 3 * 4 + 2 + 2 * 2);  // tied: no lm_head
    CHECK_FALSE(linear(linears, "model.language_model.layers.1.mlp.gate_proj").vision);
    const LinearDesc& qkv = linear(linears, "model.visual.blocks.2.attn.qkv");
    CHECK(qkv.vision);
    CHECK(qkv.has_bias);
    CHECK(qkv.out_features == 192);
    CHECK(qkv.in_features == 64);
    CHECK(linear(linears, "model.visual.blocks.0.mlp.linear_fc1").out_features == 96);
    const LinearDesc& fc1 = linear(linears, "model.visual.deepstack_merger_list.1.linear_fc1");
    CHECK(fc1.in_features == 256);  // 2 x 2 patches of 64
    CHECK(fc1.out_features == 256);
    CHECK(linear(linears, "model.visual.merger.linear_fc2").out_features == 96);
  }
}

// ---- which modules a quantization config touches ------------------------------------------------------------

TEST_CASE("compressed-tensors ignore: exact names, re: from the start of the name, the class Linear") {
  QuantConfig q;
  q.method = QuantMethod::compressed_tensors;
  q.ignore = {"lm_head", "re:.*mlp\\.gate$", "re:visual\\."};
  CHECK(quant_ignores(q, "lm_head"));
  CHECK_FALSE(quant_ignores(q, "model.lm_head"));  // exact means exact
  CHECK(quant_ignores(q, "model.layers.3.mlp.gate"));
  CHECK_FALSE(quant_ignores(q, "model.layers.3.mlp.gate_proj"));  // `$` anchors the end
  CHECK(quant_ignores(q, "visual.blocks.0.attn.qkv"));
  CHECK_FALSE(quant_ignores(q, "model.visual.blocks.0.attn.qkv"));  // re.match anchors at the start only
  q.ignore = {"re:model.layers.1"};
  CHECK(quant_ignores(q, "model.layers.17.mlp.up_proj"));  // re.match is a prefix match, not fullmatch
  q.ignore = {"Linear"};
  CHECK(quant_ignores(q, "model.layers.0.self_attn.q_proj"));
}

TEST_CASE("fp8 modules_to_not_convert: substrings (transformers 4) and regexes (transformers 5)") {
  QuantConfig q;
  q.method = QuantMethod::fp8;
  q.modules_to_not_convert = {"lm_head", "model.visual", "visual.blocks.1.attn.proj"};
  CHECK(quant_ignores(q, "lm_head"));
  CHECK(quant_ignores(q, "model.visual.merger.linear_fc1"));
  CHECK(quant_ignores(q, "model.visual.blocks.1.attn.proj"));
  CHECK_FALSE(quant_ignores(q, "model.language_model.layers.0.self_attn.q_proj"));
  q.modules_to_not_convert = {"visual.blocks.1.attn.proj", "model\\.language_model\\.layers\\.[0-3]\\.mlp"};
  CHECK_FALSE(quant_ignores(q, "model.visual.blocks.11.attn.proj"));
  CHECK(quant_ignores(q, "model.language_model.layers.2.mlp.down_proj"));
  CHECK_FALSE(quant_ignores(q, "model.language_model.layers.5.mlp.down_proj"));

  // The shipped Qwen3-VL FP8 config keeps the whole vision tower dense and quantizes the language model.
  ModelConfig vl = load_config(source_path("models/qwen3-vl-4b-instruct-fp8")).value();
  CHECK(quant_ignores(vl.quant, "model.visual.blocks.23.mlp.linear_fc2"));
  CHECK(quant_ignores(vl.quant, "model.visual.deepstack_merger_list.2.linear_fc1"));
  CHECK_FALSE(quant_ignores(vl.quant, "model.language_model.layers.35.mlp.down_proj"));
  CHECK(detail::quant_scheme_for(vl.quant, "model.language_model.layers.0.self_attn.q_proj") == &vl.quant.schemes[0]);
  CHECK(detail::quant_scheme_for(vl.quant, "model.visual.blocks.0.attn.qkv") == nullptr);
}

TEST_CASE("the scheme for a module: exact name over re: over Linear, across mixed-precision groups") {
  json doc = tiny_llama();
  json fp8_weights = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"strategy", "channel"}};
  json block_weights = {{"num_bits", 8}, {"type", "float"}, {"strategy", "block"}, {"block_structure", {64, 64}}};
  doc["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", "mixed-precision"},
      {"config_groups",
       {{"group_0", {{"format", "pack-quantized"}, {"targets", {"Linear"}}, {"weights", int4_group(64)["config_groups"]["group_0"]["weights"]}}},
        {"group_1", {{"format", "float-quantized"}, {"targets", {"re:.*mlp\\.down_proj$"}}, {"weights", fp8_weights},
                     {"input_activations", {{"num_bits", 8}, {"type", "float"}, {"dynamic", true}}}}},
        {"group_2", {{"format", "naive-quantized"}, {"targets", {"model.layers.0.mlp.down_proj"}}, {"weights", block_weights}}}}},
      {"ignore", {"lm_head"}}};
  ModelConfig c = parse(doc);
  std::vector<LinearDesc> linears = detail::estimate_linears(c);
  CHECK(linear(linears, "model.layers.0.mlp.down_proj").granularity == ScaleGranularity::block);
  CHECK(linear(linears, "model.layers.1.mlp.down_proj").granularity == ScaleGranularity::channel);
  CHECK(linear(linears, "model.layers.1.mlp.down_proj").format == WeightFormat::fp8);
  CHECK(linear(linears, "model.layers.1.self_attn.q_proj").format == WeightFormat::int4);
  CHECK(linear(linears, "lm_head").format == WeightFormat::dense);
  CHECK(c.quant.schemes[1].dynamic_activations);
}

// ---- estimates from config.json alone -------------------------------------------------------------------------

TEST_CASE("config-only Linear estimates: W4A16 q_proj of Llama-3.1-8B and fp8 blocks of Qwen3-VL-4B") {
  ModelConfig llama = load_config(source_path("models/llama-3.1-8b-instruct-w4a16")).value();
  std::vector<LinearDesc> linears = describe_linears(llama, nullptr).value();
  const LinearDesc& q = linear(linears, "model.layers.0.self_attn.q_proj");
  CHECK(q.format == WeightFormat::int4);
  CHECK_FALSE(q.exact);
  CHECK(q.group_size == 128);
  // weight_packed 4096 x 512 I32 (8 MiB) + weight_scale 4096 x 32 BF16 + weight_shape 2 x I64
  CHECK(q.bytes == 4096ull * 512 * 4 + 4096ull * 32 * 2 + 16);
  CHECK(q.bytes == 8 * MiB + 256 * KiB + 16);
  const LinearDesc& head = linear(linears, "lm_head");
  CHECK(head.format == WeightFormat::dense);
  CHECK(head.bytes == 128256ull * 4096 * 2);

  ModelConfig vl = load_config(source_path("models/qwen3-vl-4b-instruct-fp8")).value();
  std::vector<LinearDesc> vl_linears = describe_linears(vl, nullptr).value();
  const LinearDesc& gate = linear(vl_linears, "model.language_model.layers.7.mlp.gate_proj");
  CHECK(gate.format == WeightFormat::fp8);
  CHECK(gate.scale_name == "weight_scale_inv");
  CHECK(gate.block_n == 128);
  // 9728 x 2560 fp8 + ceil(9728/128) x ceil(2560/128) = 76 x 20 F32 scales
  CHECK(gate.bytes == 9728ull * 2560 + 76 * 20 * 4);
  const LinearDesc& qkv = linear(vl_linears, "model.visual.blocks.0.attn.qkv");
  CHECK(qkv.format == WeightFormat::dense);
  CHECK(qkv.bytes == (3072ull * 1024 + 3072) * 2);
}

TEST_CASE("config-only summaries agree with the published sizes of Llama-3.1-8B W4A16 and Qwen3-4B") {
  // Published: an 8B W4A16 checkpoint is ~5.7 GB = 3.49 GB int4 linears + 0.11 GB scales + 2.1 GB bf16
  // embeddings and lm_head.
  ModelConfig llama = load_config(source_path("models/llama-3.1-8b-instruct-w4a16")).value();
  WeightsSummary s = summarize_weights(llama, nullptr).value();
  CHECK_FALSE(s.exact);
  CHECK(s.embedding_bytes == 2ull * 128256 * 4096 * 2);
  uint64_t int4_bytes = 0;
  for (const LinearDesc& d : s.linears)
    if (d.format == WeightFormat::int4) int4_bytes += d.bytes;
  CHECK(double(int4_bytes) == doctest::Approx(3.49e9 + 0.11e9).epsilon(0.005));
  CHECK(double(s.total_bytes) == doctest::Approx(5.7e9).epsilon(0.01));
  CHECK(s.vision_bytes == 0);
  CHECK(s.text_bytes == s.total_bytes);

  // Published: Qwen3-4B has 4.0B parameters, 3.6B of them outside the (tied) embedding; bf16 = 2 bytes each.
  ModelConfig qwen = load_config(source_path("models/qwen3-4b")).value();
  WeightsSummary q = summarize_weights(qwen, nullptr).value();
  CHECK(double(q.total_bytes) / 2 == doctest::Approx(4.0e9).epsilon(0.01));
  CHECK(double(q.total_bytes - q.embedding_bytes) / 2 == doctest::Approx(3.6e9).epsilon(0.01));
}

TEST_CASE("config-only summary of a qwen3_vl model counts every vision tensor") {
  ModelConfig c = parse(tiny_vl());
  WeightsSummary s = detail::estimate_weights(c);
  // vision parameters: blocks 3 x (qkv 192x64+192, proj 64x64+64, fc1 96x64+96, fc2 64x96+64) = 87264;
  // 3 mergers x (fc1 256x256+256, fc2 96x256+96) = 271392; patch embed 64x3x2x16x16 + 64 = 98368;
  // pos_embed 16x64 = 1024; block norms 3 x 2 x (64+64) = 768; merger norm 128; 2 deepstack norms x 512 = 1024.
  CHECK(s.vision_bytes == 2 * (87264 + 271392 + 98368 + 1024 + 768 + 128 + 1024));
  // text: embed 500x96 + 2 layers x 82944 linear weights + norms 2x2x96 + 96 + q/k norms 2x2x32; tied.
  CHECK(s.text_bytes == 2 * (48000 + 165888 + 384 + 96 + 128));
  CHECK(s.embedding_bytes == 2 * 48000);
  CHECK(s.total_bytes == s.text_bytes + s.vision_bytes);
}

// ---- decisions from tensor headers --------------------------------------------------------------------------

TEST_CASE("headers: dense Linears with exact bytes, biases flagged") {
  json doc = tiny_llama();
  doc["model_type"] = "qwen2";
  ModelConfig c = parse(doc);
  FakeCheckpoint ck = dense_linears(c);
  ck.add("model.layers.0.self_attn.o_proj.weight", DType::F32, {192, 192});
  std::vector<LinearDesc> linears = ck.describe(c);
  const LinearDesc& q = linear(linears, "model.layers.0.self_attn.q_proj");
  CHECK(q.exact);
  CHECK(q.format == WeightFormat::dense);
  CHECK(q.has_bias);
  CHECK(q.bytes == (192ull * 192 + 192) * 2);
  const LinearDesc& o = linear(linears, "model.layers.0.self_attn.o_proj");
  CHECK(o.weight_dtype == DType::F32);
  CHECK(o.bytes == 192ull * 192 * 4);
  CHECK_FALSE(o.has_bias);
}

TEST_CASE("headers: fp8 with tensor, channel and block scales, scale_inv in F32 or BF16") {
  json doc = tiny_llama();
  doc["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"lm_head"}}};
  ModelConfig c = parse(doc);
  FakeCheckpoint ck = dense_linears(c);
  // gate 320 x 192 and down 192 x 320: blocks do not divide either side
  put_fp8(ck, "model.layers.0.mlp.gate_proj", 320, 192, "weight_scale_inv", DType::F32, {3, 2});
  put_fp8(ck, "model.layers.0.mlp.down_proj", 192, 320, "weight_scale_inv", DType::BF16, {2, 3});
  put_fp8(ck, "model.layers.1.mlp.up_proj", 320, 192, "weight_scale", DType::BF16, {320, 1});
  put_fp8(ck, "model.layers.1.self_attn.k_proj", 64, 192, "weight_scale", DType::F32, {1});
  put_fp8(ck, "model.layers.1.self_attn.v_proj", 64, 192, "weight_scale", DType::F32, {});
  std::vector<LinearDesc> linears = ck.describe(c);

  const LinearDesc& gate = linear(linears, "model.layers.0.mlp.gate_proj");
  CHECK(gate.format == WeightFormat::fp8);
  CHECK(gate.weight_dtype == DType::F8_E4M3);
  CHECK(gate.granularity == ScaleGranularity::block);
  CHECK(gate.block_n == 128);
  CHECK(gate.block_k == 128);
  CHECK(gate.scale_dtype == DType::F32);
  CHECK(gate.scale_name == "weight_scale_inv");
  CHECK(gate.bytes == 320ull * 192 + 3 * 2 * 4);
  const LinearDesc& down = linear(linears, "model.layers.0.mlp.down_proj");
  CHECK(down.scale_dtype == DType::BF16);
  CHECK(down.bytes == 192ull * 320 + 2 * 3 * 2);
  const LinearDesc& up = linear(linears, "model.layers.1.mlp.up_proj");
  CHECK(up.granularity == ScaleGranularity::channel);
  CHECK(up.scale_name == "weight_scale");
  CHECK(up.bytes == 320ull * 192 + 320 * 2);
  CHECK(linear(linears, "model.layers.1.self_attn.k_proj").granularity == ScaleGranularity::tensor);
  CHECK(linear(linears, "model.layers.1.self_attn.v_proj").granularity == ScaleGranularity::tensor);
  CHECK(linear(linears, "model.layers.1.self_attn.v_proj").bytes == 64ull * 192 + 4);
  // Not quantized on disk, so dense whatever the config says.
  CHECK(linear(linears, "model.layers.1.self_attn.q_proj").format == WeightFormat::dense);
}

TEST_CASE("headers: int4 symmetric and asymmetric groups, channel scales, g_idx, with bytes matching the estimate") {
  json doc = tiny_llama();
  doc["quantization_config"] = int4_group(64);
  ModelConfig c = parse(doc);
  FakeCheckpoint ck = dense_linears(c);
  for (const LinearDesc& d : detail::estimate_linears(c))
    if (d.format == WeightFormat::int4) put_int4(ck, d.name, d.out_features, d.in_features, 64, false, false);
  put_int4(ck, "model.layers.1.mlp.down_proj", 192, 320, 64, true, true, DType::F16);
  std::vector<LinearDesc> linears = ck.describe(c);
  std::vector<LinearDesc> estimates = detail::estimate_linears(c);

  const LinearDesc& q = linear(linears, "model.layers.0.self_attn.q_proj");
  CHECK(q.format == WeightFormat::int4);
  CHECK(q.exact);
  CHECK(q.granularity == ScaleGranularity::group);
  CHECK(q.group_size == 64);
  CHECK(q.symmetric);
  CHECK_FALSE(q.has_g_idx);
  CHECK(q.bytes == 192ull * 24 * 4 + 192 * 3 * 2 + 16);
  CHECK(q.bytes == linear(estimates, q.name).bytes);
  CHECK(linear(linears, "lm_head").format == WeightFormat::dense);  // ignored

  const LinearDesc& down = linear(linears, "model.layers.1.mlp.down_proj");
  CHECK_FALSE(down.symmetric);
  CHECK(down.has_g_idx);
  CHECK(down.scale_dtype == DType::F16);
  // packed 192 x 40 I32 + scale 192 x 5 F16 + shape + zero point 24 x 5 I32 + g_idx 320 I32
  CHECK(down.bytes == 192ull * 40 * 4 + 192 * 5 * 2 + 16 + 24 * 5 * 4 + 320 * 4);

  SUBCASE("channel scales, read off the headers when the config does not target the module") {
    put_int4(ck, "lm_head", 1000, 192, 192, true, false);  // one group spanning K = a channel scale
    const std::vector<LinearDesc> described = ck.describe(c);  // kept: `head` refers into it (ASan found the
    const LinearDesc& head = linear(described, "lm_head");       // temporary it once pointed into)
    CHECK(head.format == WeightFormat::int4);
    CHECK(head.granularity == ScaleGranularity::channel);
    CHECK(head.group_size == 192);
    CHECK_FALSE(head.symmetric);
    CHECK(head.bytes == 1000ull * 24 * 4 + 1000 * 2 + 16 + 125 * 4);
  }
}

TEST_CASE("headers: summaries sum every tensor and split vision from text") {
  ModelConfig c = parse(tiny_vl());
  FakeCheckpoint ck = dense_linears(c);
  const std::string lm = "model.language_model.";
  ck.add(lm + "embed_tokens.weight", DType::BF16, {500, 96});
  ck.add(lm + "norm.weight", DType::BF16, {96});
  for (int i = 0; i < 2; i++) {
    std::string layer = lm + "layers." + std::to_string(i) + ".";
    ck.add(layer + "input_layernorm.weight", DType::BF16, {96});
    ck.add(layer + "post_attention_layernorm.weight", DType::BF16, {96});
    ck.add(layer + "self_attn.q_norm.weight", DType::BF16, {32});
    ck.add(layer + "self_attn.k_norm.weight", DType::BF16, {32});
  }
  ck.add("model.visual.patch_embed.proj.weight", DType::BF16, {64, 3, 2, 16, 16});
  ck.add("model.visual.patch_embed.proj.bias", DType::BF16, {64});
  ck.add("model.visual.pos_embed.weight", DType::BF16, {16, 64});
  for (int i = 0; i < 3; i++)
    for (const char* norm : {"norm1", "norm2"})
      for (const char* part : {"weight", "bias"})
        ck.add("model.visual.blocks." + std::to_string(i) + "." + norm + "." + part, DType::BF16, {64});
  for (const char* part : {"weight", "bias"}) {
    ck.add(std::string("model.visual.merger.norm.") + part, DType::BF16, {64});
    for (int j = 0; j < 2; j++)
      ck.add("model.visual.deepstack_merger_list." + std::to_string(j) + ".norm." + part, DType::BF16, {256});
  }
  WeightsSummary exact = detail::summarize_weights_from(c, ck.tensors, ck.data());
  WeightsSummary estimate = detail::estimate_weights(c);
  CHECK(exact.exact);
  CHECK(exact.total_bytes == ck.bytes_of(""));
  CHECK(exact.vision_bytes == ck.bytes_of("model.visual."));
  CHECK(exact.text_bytes == ck.bytes_of(lm));
  CHECK(exact.embedding_bytes == 500 * 96 * 2);
  // A bf16 checkpoint holds exactly what the config-only estimate counts.
  CHECK(exact.total_bytes == estimate.total_bytes);
  CHECK(exact.vision_bytes == estimate.vision_bytes);
  CHECK(exact.linears.size() == estimate.linears.size());

  ck.remove(lm + "embed_tokens.weight");
  CHECK_THROWS_AS(detail::summarize_weights_from(c, ck.tensors, ck.data()), Error);
}

TEST_CASE("headers: every malformed Linear is refused, naming the tensor and both shapes") {
  json doc = tiny_llama();
  doc["quantization_config"] = int4_group(64);
  ModelConfig c = parse(doc);
  FakeCheckpoint good = dense_linears(c);
  const std::string q = "model.layers.0.self_attn.q_proj";
  put_int4(good, q, 192, 192, 64, false, false);
  REQUIRE_NOTHROW(good.describe(c));

  SUBCASE("packed shape") {
    FakeCheckpoint ck = good;
    ck.add(q + ".weight_packed", DType::I32, {192, 25});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_packed"));
    CHECK(mentions(e, "[192, 25]"));
    CHECK(mentions(e, "[192, 24]"));
  }
  SUBCASE("int4 scale shape") {
    FakeCheckpoint ck = good;
    ck.add(q + ".weight_scale", DType::BF16, {192, 2});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_scale"));
    CHECK(mentions(e, "[192, 2]"));
    CHECK(mentions(e, "[192, 3]"));
  }
  SUBCASE("weight_shape disagreeing with config.json") {
    FakeCheckpoint ck = good;
    ck.add(q + ".weight_shape", DType::I64, {2}, i64_bytes({192, 200}));
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_shape"));
    CHECK(mentions(e, "[192, 200]"));
    CHECK(mentions(e, "[192, 192]"));
  }
  SUBCASE("group size not dividing in_features") {
    json doc128 = tiny_llama();
    doc128["quantization_config"] = int4_group(128);
    ModelConfig c128 = parse(doc128);
    FakeCheckpoint ck = dense_linears(c128);
    put_int4(ck, q, 192, 192, 128, false, false);
    Error e = ck.describe_failure(c128);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_packed"));
    CHECK(mentions(e, "group_size 128"));
    CHECK(mentions(e, "192"));
  }
  SUBCASE("zero point shape") {
    FakeCheckpoint ck = good;
    ck.add(q + ".weight_zero_point", DType::I32, {192, 3});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_zero_point"));
    CHECK(mentions(e, "[24, 3]"));
  }
  SUBCASE("fp8 scale shape") {
    FakeCheckpoint ck = good;
    put_fp8(ck, q, 192, 192, "weight_scale_inv", DType::F32, {3, 3});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, q + ".weight_scale_inv"));
    CHECK(mentions(e, "[3, 3]"));
    CHECK(mentions(e, "[2, 2]"));
  }
  SUBCASE("fp8 weight without a scale") {
    FakeCheckpoint ck = good;
    ck.clear_weight(q);
    ck.add(q + ".weight", DType::F8_E4M3, {192, 192});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::missing_tensor);
    CHECK(mentions(e, q + ".weight_scale_inv"));
  }
  SUBCASE("dense weight shape") {
    FakeCheckpoint ck = good;
    ck.add("model.layers.1.mlp.up_proj.weight", DType::BF16, {192, 320});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "model.layers.1.mlp.up_proj.weight"));
    CHECK(mentions(e, "[192, 320]"));
    CHECK(mentions(e, "[320, 192]"));
  }
  SUBCASE("missing Linear") {
    FakeCheckpoint ck = good;
    ck.clear_weight("lm_head");
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::missing_tensor);
    CHECK(mentions(e, "lm_head.weight"));
  }
  SUBCASE("unsupported weight dtype") {
    FakeCheckpoint ck = good;
    ck.add("model.layers.1.mlp.up_proj.weight", DType::I16, {320, 192});
    Error e = ck.describe_failure(c);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "model.layers.1.mlp.up_proj.weight"));
    CHECK(mentions(e, "I16"));
  }
}

// ---- bad config files ---------------------------------------------------------------------------------------

TEST_CASE("bad config.json files are refused with the key named") {
  SUBCASE("malformed JSON") {
    Error e = parse_failure(std::string("{\"model_type\": \"llama\", \"hidden_size\": "));
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "test.json"));
    CHECK(mentions(e, "not valid JSON"));
  }
  SUBCASE("unknown model_type") {
    json doc = tiny_llama();
    doc["model_type"] = "mixtral";  // (mistral runs since issue 39)
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "model_type 'mixtral'"));
    CHECK(mentions(e, "llama, mistral, qwen2, qwen3, qwen3_vl, qwen2_5_vl, gemma2, gemma3_text"));
  }
  SUBCASE("missing hidden_size") {
    json doc = tiny_llama();
    doc.erase("hidden_size");
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "hidden_size is missing"));
  }
  SUBCASE("missing text_config.num_hidden_layers") {
    json doc = tiny_vl();
    doc["text_config"].erase("num_hidden_layers");
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "text_config.num_hidden_layers"));
  }
  SUBCASE("non-positive size") {
    json doc = tiny_llama();
    doc["num_attention_heads"] = 0;
    CHECK(mentions(parse_failure(doc), "num_attention_heads must be positive"));
  }
  SUBCASE("KV heads not dividing the heads") {
    json doc = tiny_llama();
    doc["num_key_value_heads"] = 4;
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "num_key_value_heads"));
  }
  SUBCASE("bad rope type") {
    json doc = tiny_llama();
    doc["rope_scaling"] = {{"rope_type", "proportional"}, {"factor", 4.0}};
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "rope_scaling.rope_type 'proportional'"));
    CHECK(mentions(e, "default, linear, dynamic, yarn, longrope, llama3"));
    json v5 = tiny_vl();
    v5["text_config"]["rope_parameters"]["rope_type"] = "dynamic";
    CHECK(mentions(parse_failure(v5), "text_config.rope_parameters.rope_type 'dynamic'"));
  }
  SUBCASE("llama3 rope without its factor") {
    json doc = read_json("models/llama-3.1-8b-instruct-w4a16/config.json");
    doc["rope_scaling"].erase("factor");
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "rope_scaling.factor is missing"));
  }
  SUBCASE("mrope sections that do not cover head_dim / 2") {
    json doc = tiny_vl();
    doc["text_config"]["rope_parameters"]["mrope_section"] = {6, 5, 4};
    CHECK(mentions(parse_failure(doc), "text_config.rope_parameters.mrope_section"));
  }
  SUBCASE("unknown dtype") {
    json doc = tiny_llama();
    doc["torch_dtype"] = "float8";
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "torch_dtype 'float8'"));
  }
}

// Regression (issue 15, defect 6): config.json sizes had no upper bound: num_heads x head_dim and the vision
// merged width overflowed int64, 1e9 layers or vision blocks ran away until out of memory, and a
// max_position_embeddings of 2^62 wrapped the planner's block-table size.
TEST_CASE("regression: config.json sizes without an upper bound overflowed, ran away or wrapped the planner") {
  struct Case {
    const char* what;
    bool vision;
    std::vector<std::string> path;
    json value;
    const char* key;
    const char* limit_macro;
  };
  const std::vector<Case> cases = {
      {"a billion layers", false, {"num_hidden_layers"}, 1000000000, "num_hidden_layers", "KVLITE_MAX_MODEL_LAYERS"},
      {"a billion vision blocks", true, {"vision_config", "depth"}, 1000000000, "vision_config.depth", "KVLITE_MAX_MODEL_LAYERS"},
      {"heads x head_dim past 2^63", false, {"num_attention_heads"}, int64_t(1) << 40, "num_attention_heads", "KVLITE_MAX_MODEL_HEADS"},
      {"head_dim past 2^63 / heads", false, {"head_dim"}, int64_t(1) << 60, "head_dim", "KVLITE_MAX_HEAD_DIM"},
      {"max_position_embeddings 2^62", false, {"max_position_embeddings"}, int64_t(1) << 62, "max_position_embeddings", "KVLITE_MAX_POSITIONS"},
      {"vocab of 3e9", false, {"vocab_size"}, 3000000000ll, "vocab_size", "KVLITE_MAX_VOCAB"},
      {"vision width whose merged width overflows", true, {"vision_config", "hidden_size"}, int64_t(1) << 61, "vision_config.hidden_size", "KVLITE_MAX_MODEL_WIDTH"},
      {"vision merge of 2^31", true, {"vision_config", "spatial_merge_size"}, int64_t(1) << 31, "vision_config.spatial_merge_size", "KVLITE_MAX_VISION_PATCH"},
      {"hidden size 2^50", false, {"hidden_size"}, int64_t(1) << 50, "hidden_size", "KVLITE_MAX_MODEL_WIDTH"},
      {"an eos id of 2^40", false, {"eos_token_id"}, int64_t(1) << 40, "eos_token_id", "KVLITE_MAX_VOCAB"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    json doc = c.vision ? tiny_vl() : tiny_llama();
    json* node = &doc;
    for (size_t i = 0; i + 1 < c.path.size(); i++) node = &(*node)[c.path[i]];
    (*node)[c.path.back()] = c.value;
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, c.key));
    CHECK(mentions(e, c.limit_macro));
    CHECK(mentions(e, std::to_string(c.value.get<int64_t>())));
  }
  // head_dim derived from hidden_size / heads is bounded too
  json wide = tiny_llama();
  wide.erase("head_dim");
  wide["hidden_size"] = 262144;
  wide["num_attention_heads"] = 2;
  wide["num_key_value_heads"] = 2;
  CHECK(mentions(parse_failure(wide), "KVLITE_MAX_HEAD_DIM"));
  // and the largest sizes under every limit still parse (a real model that large is not refused)
  json big = tiny_llama();
  big["num_hidden_layers"] = limits::max_model_layers;
  big["max_position_embeddings"] = limits::max_positions;
  big["vocab_size"] = limits::max_vocab;
  big["hidden_size"] = limits::max_model_width;
  big["num_attention_heads"] = 256;
  big["num_key_value_heads"] = 256;
  big["head_dim"] = limits::max_head_dim;
  CHECK(parse(big).text.num_layers == limits::max_model_layers);
}

TEST_CASE("unsupported quantization configs are refused with the key and the supported values") {
  json doc = tiny_llama();
  SUBCASE("3-bit int weights") {
    doc["quantization_config"] = int4_group(64);
    doc["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3;
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "quantization_config.config_groups.group_0.weights.num_bits"));
    CHECK(mentions(e, "supported: 4"));
  }
  SUBCASE("4-bit float weights") {
    doc["quantization_config"] = int4_group(16);
    doc["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float";
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "weights.num_bits = 4 with type float"));
  }
  SUBCASE("int4 outside pack-quantized") {
    doc["quantization_config"] = int4_group(64);
    doc["quantization_config"]["format"] = "naive-quantized";
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "quantization_config.format 'naive-quantized'"));
  }
  SUBCASE("unknown compressed-tensors format") {
    doc["quantization_config"] = int4_group(64);
    doc["quantization_config"]["format"] = "marlin-24";
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "quantization_config.format 'marlin-24'"));
  }
  SUBCASE("unknown quant method") {
    doc["quantization_config"] = {{"quant_method", "hqq"}, {"bits", 4}};
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "quantization_config.quant_method 'hqq'"));
    CHECK(mentions(e, "compressed-tensors, fp8, awq, gptq"));
  }
  SUBCASE("an ignore pattern that is not a regex") {
    doc["quantization_config"] = int4_group(64);
    doc["quantization_config"]["ignore"] = {"lm_head", "re:model.layers.(1"};
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "quantization_config.ignore[1]"));
  }
  SUBCASE("fp8 with static activations") {
    doc["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "quantization_config.activation_scheme 'static'"));
  }
  SUBCASE("group strategy without group_size") {
    doc["quantization_config"] = int4_group(64);
    doc["quantization_config"]["config_groups"]["group_0"]["weights"].erase("group_size");
    CHECK(mentions(parse_failure(doc), "weights.group_size is missing"));
  }
}

TEST_CASE("load_config: a missing directory, and older preprocessor keys") {
  Result<ModelConfig> missing = load_config(source_path("models/no-such-model"));
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == ErrorCode::io_error);
  CHECK(mentions(missing.error(), "no-such-model/config.json"));

  std::string dir = std::string(KVLITE_BINARY_DIR) + "/test-tmp/config-preprocessor";
  REQUIRE(std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str()) == 0);
  json vl = tiny_vl();
  std::ofstream(dir + "/config.json") << vl.dump();
  // Qwen2-VL era files: min_pixels / max_pixels at the top level override `size`, as the processor does.
  std::ofstream(dir + "/preprocessor_config.json")
      << R"({"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "min_pixels": 3136, "max_pixels": 1003520})";
  ModelConfig c = load_config(dir).value();
  CHECK(c.min_pixels == 3136);
  CHECK(c.max_pixels == 1003520);
  CHECK(c.origin == dir + "/config.json");

  std::ofstream(dir + "/preprocessor_config.json") << R"({"size": {"shortest_edge": )";
  Result<ModelConfig> broken = load_config(dir);
  REQUIRE_FALSE(broken.ok());
  CHECK(broken.error().code == ErrorCode::bad_format);
  CHECK(mentions(broken.error(), "preprocessor_config.json"));
}

// Found by tests/fuzz/fuzz_config_plan.cpp: nlohmann throws out_of_range (not parse_error) for a number past
// double's range, which reached the caller as `internal`.
TEST_CASE("regression: a number past double's range in config.json was an internal error") {
  json doc = tiny_llama();
  std::string text = doc.dump();
  text.insert(text.size() - 1, ", \"huge\": 1E51655");
  Error e = parse_failure(text);
  CHECK(e.code == ErrorCode::bad_format);
  CHECK(mentions(e, "not valid JSON"));
}
