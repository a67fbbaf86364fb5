// linears: describe_linears / summarize_weights over real safetensors files opened with TensorStore (the
// decisions themselves are tested on in-memory headers in unit-config.cpp; this checks the store glue:
// lookups by name, weight_shape values read from the mmap, sharded directories, empty directories).
#include <doctest/doctest.h>
#include <random>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
using json = nlohmann::json;
namespace st = testing_safetensors;

namespace {

json read_json(const std::string& relative) {
  return json::parse(detail::read_text_file(std::string(KVLITE_SOURCE_DIR) + "/" + relative));
}

// A tensor filled with seeded random bytes (the values are never read, only their spans).
st::Tensor random_tensor(std::mt19937& rng, const std::string& name, const std::string& dtype, std::vector<int64_t> shape) {
  uint64_t count = 1;
  for (int64_t d : shape) count *= uint64_t(d);
  std::vector<uint8_t> bytes(dtype_bytes(*dtype_from_name(dtype), count));
  for (uint8_t& b : bytes) b = uint8_t(rng() | 1u);
  return {name, dtype, std::move(shape), std::move(bytes)};
}
st::Tensor i64_tensor(const std::string& name, std::vector<int64_t> values) {
  std::vector<uint8_t> bytes(values.size() * 8);
  memcpy(bytes.data(), values.data(), bytes.size());
  return {name, "I64", {int64_t(values.size())}, bytes};
}

// A tiny Llama in compressed-tensors W4A16 (group 64, lm_head dense), as llm-compressor lays it out.
std::vector<st::Tensor> w4a16_llama(std::mt19937& rng, int64_t stored_k_of_first_q = 192) {
  std::vector<st::Tensor> tensors;
  tensors.push_back(random_tensor(rng, "model.embed_tokens.weight", "BF16", {1000, 192}));
  tensors.push_back(random_tensor(rng, "model.norm.weight", "BF16", {192}));
  tensors.push_back(random_tensor(rng, "lm_head.weight", "BF16", {1000, 192}));
  struct Shape { const char* name; int64_t n, k; };
  const Shape shapes[] = {{"self_attn.q_proj", 192, 192}, {"self_attn.k_proj", 64, 192}, {"self_attn.v_proj", 64, 192},
                          {"self_attn.o_proj", 192, 192}, {"mlp.gate_proj", 320, 192},   {"mlp.up_proj", 320, 192},
                          {"mlp.down_proj", 192, 320}};
  for (int layer = 0; layer < 2; layer++) {
    std::string prefix = "model.layers." + std::to_string(layer) + ".";
    tensors.push_back(random_tensor(rng, prefix + "input_layernorm.weight", "BF16", {192}));
    tensors.push_back(random_tensor(rng, prefix + "post_attention_layernorm.weight", "BF16", {192}));
    for (const Shape& s : shapes) {
      std::string p = prefix + s.name;
      tensors.push_back(random_tensor(rng, p + ".weight_packed", "I32", {s.n, (s.k + 7) / 8}));
      tensors.push_back(random_tensor(rng, p + ".weight_scale", "BF16", {s.n, s.k / 64}));
      bool first_q = layer == 0 && std::string(s.name) == "self_attn.q_proj";
      tensors.push_back(i64_tensor(p + ".weight_shape", {s.n, first_q ? stored_k_of_first_q : s.k}));
    }
  }
  return tensors;
}

json w4a16_config() {
  json doc = read_json("tests/fixtures/configs/tiny-llama.json");
  doc["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", "pack-quantized"},
      {"ignore", {"lm_head"}},
      {"config_groups",
       {{"group_0",
         {{"targets", {"Linear"}},
          {"weights", {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"}, {"group_size", 64}}}}}}}};
  return doc;
}

std::string model_dir(const std::string& name, const json& config) {
  std::string dir = st::temp_dir(name);
  st::write_text(dir + "/config.json", config.dump(2));
  return dir;
}

}  // namespace

TEST_CASE("a W4A16 checkpoint on disk: every Linear from its headers, bytes summing to the files") {
  std::mt19937 rng(20250917);
  std::string dir = model_dir("linears-w4a16", w4a16_config());
  std::vector<st::Tensor> tensors = w4a16_llama(rng);
  st::write_file(dir + "/model.safetensors", tensors);

  ModelConfig config = load_config(dir).value();
  TensorStore store = TensorStore::open_dir(dir).value();
  Result<std::vector<LinearDesc>> linears = describe_linears(config, &store);
  REQUIRE_MESSAGE(linears.ok(), linears.error().message);
  REQUIRE(linears->size() == 15);
  uint64_t linear_bytes = 0;
  for (const LinearDesc& d : *linears) {
    CHECK(d.exact);
    linear_bytes += d.bytes;
  }
  const LinearDesc& down = linears->at(6);
  CHECK(down.name == "model.layers.0.mlp.down_proj");
  CHECK(down.format == WeightFormat::int4);
  CHECK(down.group_size == 64);
  CHECK(down.bytes == 192ull * 40 * 4 + 192 * 5 * 2 + 16);
  CHECK(linears->back().name == "lm_head");
  CHECK(linears->back().format == WeightFormat::dense);

  WeightsSummary summary = summarize_weights(config, &store).value();
  CHECK(summary.exact);
  CHECK(summary.total_bytes == store.total_bytes());
  uint64_t other_bytes = 0;  // embeddings and norms
  for (const st::Tensor& t : tensors)
    if (t.name.find("norm") != std::string::npos || t.name.find("embed") != std::string::npos) other_bytes += t.bytes.size();
  CHECK(summary.total_bytes == linear_bytes + other_bytes);
  CHECK(summary.embedding_bytes == 2 * 1000 * 192 * 2);  // the table and the untied lm_head
  CHECK(summary.vision_bytes == 0);
}

TEST_CASE("weight_shape values are read from the file and checked against config.json") {
  std::mt19937 rng(7);
  std::string dir = model_dir("linears-weight-shape", w4a16_config());
  st::write_file(dir + "/model.safetensors", w4a16_llama(rng, 200));
  ModelConfig config = load_config(dir).value();
  TensorStore store = TensorStore::open_dir(dir).value();
  Result<std::vector<LinearDesc>> linears = describe_linears(config, &store);
  REQUIRE_FALSE(linears.ok());
  CHECK(linears.error().code == ErrorCode::bad_format);
  CHECK(linears.error().message.find("model.layers.0.self_attn.q_proj.weight_shape holds [192, 200]") != std::string::npos);
  CHECK_FALSE(summarize_weights(config, &store).ok());
}

TEST_CASE("a sharded fp8 qwen3_vl checkpoint: fp8 language model, dense vision tower") {
  std::mt19937 rng(31);
  json doc = read_json("tests/fixtures/configs/tiny-qwen3-vl.json");
  doc["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"model.visual"}}};
  std::string dir = model_dir("linears-fp8-vl", doc);
  ModelConfig config = load_config(dir).value();

  std::vector<st::Tensor> text, vision;
  for (const LinearDesc& d : detail::estimate_linears(config)) {
    if (d.vision) {
      vision.push_back(random_tensor(rng, d.name + ".weight", "BF16", {d.out_features, d.in_features}));
      vision.push_back(random_tensor(rng, d.name + ".bias", "BF16", {d.out_features}));
    } else {
      text.push_back(random_tensor(rng, d.name + ".weight", "F8_E4M3", {d.out_features, d.in_features}));
      text.push_back(random_tensor(rng, d.name + ".weight_scale_inv", "BF16",
                                   {(d.out_features + 127) / 128, (d.in_features + 127) / 128}));
    }
  }
  text.push_back(random_tensor(rng, "model.language_model.embed_tokens.weight", "BF16", {500, 96}));
  vision.push_back(random_tensor(rng, "model.visual.pos_embed.weight", "BF16", {16, 64}));
  st::write_file(dir + "/model-00001-of-00002.safetensors", text);
  st::write_file(dir + "/model-00002-of-00002.safetensors", vision);
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (const st::Tensor& t : text) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const st::Tensor& t : vision) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  st::write_text(dir + "/model.safetensors.index.json", index.dump());

  TensorStore store = TensorStore::open_dir(dir).value();
  REQUIRE(store.files().size() == 2);
  WeightsSummary summary = summarize_weights(config, &store).value();
  uint64_t vision_bytes = 0, text_bytes = 0;
  for (const st::Tensor& t : vision) vision_bytes += t.bytes.size();
  for (const st::Tensor& t : text) text_bytes += t.bytes.size();
  CHECK(summary.vision_bytes == vision_bytes);
  CHECK(summary.text_bytes == text_bytes);
  for (const LinearDesc& d : summary.linears) {
    CHECK(d.format == (d.vision ? WeightFormat::dense : WeightFormat::fp8));
    if (!d.vision) {
      CHECK(d.granularity == ScaleGranularity::block);
      CHECK(d.scale_dtype == DType::BF16);
    }
  }
}

TEST_CASE("a directory without weights plans from config.json alone") {
  std::string dir = model_dir("linears-no-weights", w4a16_config());
  ModelConfig config = load_config(dir).value();
  TensorStore store = TensorStore::open_dir(dir).value();
  REQUIRE(store.empty());
  std::vector<LinearDesc> linears = describe_linears(config, &store).value();
  REQUIRE(linears.size() == 15);
  for (const LinearDesc& d : linears) CHECK_FALSE(d.exact);
  WeightsSummary summary = summarize_weights(config, &store).value();
  CHECK_FALSE(summary.exact);
  CHECK(summary.total_bytes == detail::estimate_weights(config).total_bytes);
}
