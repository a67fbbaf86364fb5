// quant-formats: AWQ and GPTQ int4 checkpoints (src/quant_formats.hpp), read from their own layouts and repacked
// once at load into the compressed-tensors view. The fixtures (tests/fixtures/quant_formats, made by
// tools/make_awq_gptq_fixtures.py) carry transformers' logits over the weights dequantized from the packed tensors
// by code that follows the reference libraries' own dequantization: kvlite must reproduce the dequantized weights
// bit for bit, the logits within 1e-4 and the greedy continuations exactly. Also: the configs (and the formats
// refused with what to download instead), the planner's repack row, and malformed tensors.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
using json = nlohmann::json;
namespace st = testing_safetensors;

namespace {

const char* const kCases[] = {"awq-g32-zp-skip",     "awq-g128-zp",          "awq-g64-nozp",
                              "gptq-g128-sym",       "gptq-g32-asym-actorder", "gptq-v2-channel-asym",
                              "gptq-v2-g64-sym-actorder"};

std::string fixture(const std::string& name) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant_formats/" + name;
}
std::string source_path(const std::string& relative) { return std::string(KVLITE_SOURCE_DIR) + "/" + relative; }

std::vector<float> floats_of(const TensorStore& store, const std::string& name) {
  const TensorInfo* tensor = store.find(name);
  REQUIRE_MESSAGE(tensor != nullptr, name);
  std::vector<float> out(tensor->numel());
  for (size_t i = 0; i < out.size(); i++) out[i] = scale_at(store.data(*tensor), tensor->dtype, int64_t(i));
  return out;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

template <typename T>
void check_error(const Result<T>& result, ErrorCode code, const std::vector<std::string>& fragments) {
  REQUIRE_FALSE(result.ok());
  CHECK_MESSAGE(result.error().code == code, result.error().message);
  for (const std::string& fragment : fragments)
    CHECK_MESSAGE(contains(result.error().message, fragment), "'" << fragment << "' not in: " << result.error().message);
}

std::string config_with(const json& quantization_config) {
  json doc = json::parse(model_fixtures::read_file(fixture("gptq-g128-sym") + "/config.json"));
  doc["quantization_config"] = quantization_config;
  return doc.dump();
}

}  // namespace

TEST_CASE("AWQ and GPTQ configs parse into one int4 scheme, lm_head and modules_to_not_convert left dense") {
  for (const char* case_name : kCases) {
    const std::string name = case_name;
    CAPTURE(name);
    const ModelConfig config = load_config(fixture(name)).value();
    const json q = json::parse(model_fixtures::read_file(fixture(name) + "/config.json"))["quantization_config"];
    const bool awq = q["quant_method"] == "awq";
    CHECK(config.quant.method == (awq ? QuantMethod::awq : QuantMethod::gptq));
    REQUIRE(config.quant.schemes.size() == 1);
    const QuantScheme& s = config.quant.schemes[0];
    CHECK(s.format == WeightFormat::int4);
    CHECK(s.packing == (awq ? Int4Packing::awq
                            : q["checkpoint_format"] == "gptq_v2" ? Int4Packing::gptq_v2 : Int4Packing::gptq));
    CHECK(s.symmetric == (awq ? !q["zero_point"].get<bool>() : q["sym"].get<bool>()));
    CHECK(s.actorder == (!awq && q["desc_act"].get<bool>()));
    CHECK(s.granularity == (q["group_size"] == -1 ? ScaleGranularity::channel : ScaleGranularity::group));
    CHECK(quant_ignores(config.quant, "lm_head"));
    CHECK_FALSE(quant_ignores(config.quant, "model.layers.0.mlp.down_proj"));
    CHECK(quant_ignores(config.quant, "model.layers.1.mlp.down_proj") == (name == "awq-g32-zp-skip"));
  }
}

TEST_CASE("refused formats name themselves and what to download instead") {
  auto parse = [](const json& q) { return parse_config(config_with(q), "config.json"); };
  check_error(parse({{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}, {"bnb_4bit_quant_type", "nf4"}}),
              ErrorCode::unsupported, {"bitsandbytes", "nf4", "AWQ, GPTQ-Int4 or compressed-tensors W4A16"});
  check_error(parse({{"quant_method", "bitsandbytes"}, {"load_in_8bit", true}}), ErrorCode::unsupported,
              {"bitsandbytes", "int8", "unquantized checkpoint"});
  check_error(parse({{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}}), ErrorCode::unsupported,
              {"NVFP4", "compressed-tensors W4A16"});
  check_error(parse({{"quant_method", "compressed-tensors"}, {"format", "nvfp4-pack-quantized"}, {"config_groups", json::object()}}),
              ErrorCode::unsupported, {"NVFP4", "W4A16"});
  check_error(parse({{"quant_method", "gptq"}, {"bits", 8}, {"group_size", 128}}), ErrorCode::unsupported,
              {"bits", "= 8", "4-bit GPTQ", "FP8"});
  check_error(parse({{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"checkpoint_format", "marlin"}}),
              ErrorCode::unsupported, {"checkpoint_format", "marlin", "gptq_v2"});
  check_error(parse({{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}, {"version", "gemv_fast"}}),
              ErrorCode::unsupported, {"version", "gemv_fast", "GEMM"});
  check_error(parse({{"quant_method", "awq"}, {"bits", 4}, {"group_size", -1}}), ErrorCode::bad_format,
              {"group_size", "-1"});
  // compressed-tensors INT8 (int-quantized) is not read yet: refused naming the format and the releases that load
  const std::string w8a8 = model_fixtures::read_file(source_path("tests/fixtures/configs/qwen2.5-7b-instruct-w8a8-int8/config.json"));
  check_error(parse_config(w8a8, "config.json"), ErrorCode::unsupported, {"int-quantized", "W8A8", "W4A16"});
  // GGUF files
  check_error(load_config("/tmp/Qwen2.5-7B-Instruct-Q4_K_M.gguf"), ErrorCode::unsupported,
              {"GGUF", "llama.cpp", "AWQ"});
}

TEST_CASE("FP8 config-only estimate: without modules_to_not_convert lm_head stays in the model dtype") {
  json q = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}};
  json doc = json::parse(model_fixtures::read_file(source_path("tests/fixtures/configs/qwen3-8b-awq/config.json")));
  doc["quantization_config"] = q;
  const ModelConfig config = parse_config(doc.dump(), "config.json").value();
  CHECK(quant_ignores(config.quant, "lm_head"));
  const std::vector<LinearDesc> linears = describe_linears(config, nullptr).value();
  auto lm_head = std::find_if(linears.begin(), linears.end(), [](const LinearDesc& d) { return d.name == "lm_head"; });
  REQUIRE(lm_head != linears.end());
  CHECK(lm_head->format == WeightFormat::dense);
  CHECK(lm_head->bytes == uint64_t(151936) * 4096 * 2);
  // with the key present, only what it lists stays dense (transformers adds nothing)
  q["modules_to_not_convert"] = json::array({"model.layers.0.mlp"});
  doc["quantization_config"] = q;
  CHECK_FALSE(quant_ignores(parse_config(doc.dump(), "config.json").value().quant, "lm_head"));
}

TEST_CASE("AWQ / GPTQ fixtures: every Linear loads repacked, the reference Linears dequantize bit for bit") {
  for (const char* case_name : kCases) {
    const std::string name = case_name;
    CAPTURE(name);
    const std::string dir = fixture(name);
    const ModelConfig config = load_config(dir).value();
    TensorStore store = TensorStore::open_dir(dir).value();
    Result<std::vector<LinearDesc>> linears = describe_linears(config, &store);
    REQUIRE_MESSAGE(linears.ok(), linears.error().message);
    const json reference_doc = json::parse(model_fixtures::read_file(dir + "/reference.json"));
    int quantized = 0;
    for (const LinearDesc& desc : *linears) {
      if (desc.format == WeightFormat::dense) continue;
      CAPTURE(desc.name);
      CHECK(desc.packing == config.quant.schemes[0].packing);
      CHECK(desc.exact);
      Result<QuantWeight> weight = quant_weight(desc, store);
      REQUIRE_MESSAGE(weight.ok(), weight.error().message);
      CHECK(weight->storage != nullptr);  // repacked, not a view of the mmap
      CHECK((weight->g_idx != nullptr) == desc.has_g_idx);  // act-order keeps its g_idx; column order drops it
      quantized++;
    }
    CHECK(quantized == reference_doc["quantized_linears"].get<int>());
    CHECK(quantized == (name == "awq-g32-zp-skip" ? 13 : 14));
    TensorStore reference = TensorStore::open_files({dir + "/reference.safetensors"}).value();
    REQUIRE(reference_doc["reference_linears"].size() == 4);
    for (const auto& item : reference_doc["reference_linears"].items()) {
      const std::string& linear = item.key();
      CAPTURE(linear);
      auto desc = std::find_if(linears->begin(), linears->end(), [&](const LinearDesc& d) { return d.name == linear; });
      REQUIRE(desc != linears->end());
      const QuantWeight weight = quant_weight(*desc, store).value();
      std::vector<float> got(size_t(weight.out_features * weight.in_features));
      REQUIRE(dequantize_rows(weight, 0, weight.out_features, got.data()).ok());
      const std::vector<float> want = floats_of(reference, linear + ".weight");
      REQUIRE(got.size() == want.size());
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); i++) differ += float_to_bits(got[i]) != float_to_bits(want[i]);
      CHECK(differ == 0);
    }
  }
}

TEST_CASE("AWQ / GPTQ fixture models reproduce transformers' logits within 1e-4 and its greedy continuations") {
  for (const char* case_name : kCases) {
    const std::string name = case_name;
    CAPTURE(name);
    EngineOptions options;
    options.plan.device_mem = 64 * MiB;
    auto engine = Engine::open(fixture(name), options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    const json reference = json::parse(model_fixtures::read_file(fixture(name) + "/reference.json"));
    REQUIRE(reference["prompts"].size() == 1);
    for (const json& prompt : reference["prompts"]) {
      const std::vector<int32_t> ids = prompt["input_ids"].get<std::vector<int32_t>>();
      model_fixtures::Npy expected =
          model_fixtures::read_npy(fixture(name) + "/" + prompt["logits_file"].get<std::string>());
      auto logits = (*engine)->logits(ids);
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      double max_abs = 0;
      for (size_t i = 0; i < expected.values.size(); i++)
        max_abs = std::max(max_abs, std::fabs(double(logits->values[i]) - double(expected.values[i])));
      const double relative = model_fixtures::relative_max_diff(logits->values, expected.values);
      MESSAGE(name << ": max |logit - reference| = " << max_abs << " (relative " << relative << ")");
      CHECK(max_abs <= 1e-4);
      CHECK(relative <= 1e-4);
      SamplingParams params;  // temperature 0: greedy
      params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
      auto generation = (*engine)->generate(ids, params);
      REQUIRE_MESSAGE(generation, generation.error().message);
      CHECK(generation->ids == prompt["greedy"]["new_ids"].get<std::vector<int32_t>>());
    }
  }
}

TEST_CASE("the repacked view is the compressed-tensors layout: nibble, zero point and scale per (row, column)") {
  // A hand-packed AWQ and GPTQ v1 Linear of N = 16, K = 64, group 32, every value distinct enough to catch a
  // transposition or the interleave: u(k, n) = (3k + 5n) % 16, z(g, n) = (g + 2n + 1) % 15 + 1.
  const int64_t n = 16, k = 64, group = 32, groups = 2;
  auto u_at = [](int64_t row, int64_t col) { return uint32_t((3 * row + 5 * col) % 16); };
  auto z_at = [](int64_t g, int64_t col) { return uint32_t((g + 2 * col + 1) % 15 + 1); };
  std::vector<uint16_t> scales(size_t(groups * n));
  for (int64_t i = 0; i < groups * n; i++) scales[size_t(i)] = float_to_f16(0.01f * float(i + 1));
  auto i32_bytes = [](const std::vector<uint32_t>& words) {
    std::vector<uint8_t> out(words.size() * 4);
    memcpy(out.data(), words.data(), out.size());
    return out;
  };
  std::vector<uint8_t> scale_bytes(scales.size() * 2);
  memcpy(scale_bytes.data(), scales.data(), scale_bytes.size());
  for (bool awq : {true, false}) {
    CAPTURE(awq);
    std::vector<uint32_t> qweight(size_t(k * n / 8), 0), qzeros(size_t(groups * n / 8), 0);
    for (int64_t row = 0; row < k; row++)
      for (int64_t col = 0; col < n; col++) {
        if (awq) qweight[size_t(row * (n / 8) + col / 8)] |= u_at(row, col) << (4 * kAwqReverseOrder[col % 8]);
        else qweight[size_t((row / 8) * n + col)] |= u_at(row, col) << (4 * (row % 8));
      }
    for (int64_t g = 0; g < groups; g++)
      for (int64_t col = 0; col < n; col++)
        qzeros[size_t(g * (n / 8) + col / 8)] |= (awq ? z_at(g, col) : z_at(g, col) - 1)
                                                 << (4 * (awq ? kAwqReverseOrder[col % 8] : int(col % 8)));
    // kAwqReverseOrder inverts kAwqOrder: nibble i holds column offset kAwqOrder[i]
    for (int i = 0; i < 8; i++) CHECK(kAwqReverseOrder[kAwqOrder[i]] == i);
    const std::string dir = st::temp_dir(awq ? "quant-formats-awq" : "quant-formats-gptq");
    std::vector<st::Tensor> tensors = {
        {"m.qweight", "I32", awq ? std::vector<int64_t>{k, n / 8} : std::vector<int64_t>{k / 8, n}, i32_bytes(qweight)},
        {"m.qzeros", "I32", {groups, n / 8}, i32_bytes(qzeros)},
        {"m.scales", "F16", {groups, n}, scale_bytes}};
    st::write_file(dir + "/model.safetensors", tensors);
    TensorStore store = TensorStore::open_files({dir + "/model.safetensors"}).value();
    LinearDesc d;
    d.name = "m";
    d.out_features = n;
    d.in_features = k;
    d.format = WeightFormat::int4;
    d.packing = awq ? Int4Packing::awq : Int4Packing::gptq;
    d.granularity = ScaleGranularity::group;
    d.group_size = group;
    d.symmetric = false;
    const QuantWeight w = quant_weight(d, store).value();
    REQUIRE(w.zero_points != nullptr);
    CHECK(w.g_idx == nullptr);
    CHECK(w.packed_cols == k / 8);
    CHECK(w.scale_cols == groups);
    for (int64_t col = 0; col < n; col++)
      for (int64_t row = 0; row < k; row++) {
        CHECK(int4_packed_at(w.packed + 4 * col * w.packed_cols, row) + 8 == int(u_at(row, col)));
        if (row % group == 0) {
          const int64_t g = row / group;
          CHECK(int4_zero_point_at(w.zero_points, w.scale_cols, col, g) + 8 == int(z_at(g, col)));
          CHECK(scale_at(w.scales, w.scale_dtype, col * groups + g) == f16_to_float(scales[size_t(g * n + col)]));
        }
      }
    CHECK(int4_repacked_host_bytes(d) == w.storage->size());

    // GPTQ v1 cannot hold z = 16 (stored 15): refused, naming the tensor and the element
    if (!awq) {
      qzeros[0] |= 0xfu;
      tensors[1] = {"m.qzeros", "I32", {groups, n / 8}, i32_bytes(qzeros)};
      st::write_file(dir + "/bad.safetensors", tensors);
      TensorStore bad = TensorStore::open_files({dir + "/bad.safetensors"}).value();
      check_error(quant_weight(d, bad), ErrorCode::unsupported, {"m.qzeros", "group 0, column 0", "16", "gptq_v2"});
      // a qweight of the other format's shape is refused naming both shapes
      LinearDesc as_awq = d;
      as_awq.packing = Int4Packing::awq;
      check_error(quant_weight(as_awq, store), ErrorCode::bad_format, {"m.qweight", "[8, 16]", "[64, 2]"});
    }
  }
}

TEST_CASE("an unbalanced GPTQ g_idx is refused (a group must hold group_size input rows)") {
  const int64_t n = 8, k = 32, groups = 2;
  std::vector<uint8_t> qweight(size_t(k / 8 * n * 4), 0x11), qzeros(size_t(groups * n / 8 * 4), 0x77),
      scales(size_t(groups * n * 2), 0x3c);
  std::vector<int32_t> g_idx(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; i++) g_idx[size_t(i)] = int32_t(i / 16);
  g_idx[0] = 1;  // group 1 now holds 17 rows
  std::vector<uint8_t> g_bytes(g_idx.size() * 4);
  memcpy(g_bytes.data(), g_idx.data(), g_bytes.size());
  const std::string dir = st::temp_dir("quant-formats-gidx");
  st::write_file(dir + "/model.safetensors", {{"m.qweight", "I32", {k / 8, n}, qweight},
                                              {"m.qzeros", "I32", {groups, n / 8}, qzeros},
                                              {"m.scales", "F16", {groups, n}, scales},
                                              {"m.g_idx", "I32", {k}, g_bytes}});
  TensorStore store = TensorStore::open_files({dir + "/model.safetensors"}).value();
  LinearDesc d;
  d.name = "m";
  d.out_features = n;
  d.in_features = k;
  d.format = WeightFormat::int4;
  d.packing = Int4Packing::gptq;
  d.granularity = ScaleGranularity::group;
  d.group_size = 16;
  check_error(quant_weight(d, store), ErrorCode::bad_format, {"m.g_idx", "15 input rows to group 0"});
}

TEST_CASE("real AWQ / GPTQ configs plan on an 8 GiB card, and the repack row counts each format exactly") {
  struct Case {
    const char* dir;
    Int4Packing packing;
  };
  for (const Case& c : {Case{"llama-3.1-8b-instruct-awq-int4", Int4Packing::awq}, Case{"qwen2.5-7b-instruct-awq", Int4Packing::awq},
                        Case{"qwen2.5-7b-instruct-gptq-int4", Int4Packing::gptq}, Case{"qwen3-8b-awq", Int4Packing::awq}}) {
    const std::string dir = c.dir;
    CAPTURE(dir);
    auto inputs = read_plan_inputs(source_path(std::string("tests/fixtures/configs/") + c.dir));
    REQUIRE_MESSAGE(inputs.ok(), inputs.error().message);
    int64_t quantized = 0;
    uint64_t host_repack = 0;
    for (const LinearDesc& d : inputs->weights.linears) {
      if (d.name == "lm_head") CHECK(d.format == WeightFormat::dense);
      if (d.format == WeightFormat::dense) continue;
      CHECK(d.packing == c.packing);
      quantized++;
      host_repack += int4_repacked_host_bytes(d);
    }
    CHECK(quantized == 7 * inputs->config.text.num_layers);
    DeviceSpec card;
    card.backend = BackendKind::cuda;
    card.name = "planned 8 GiB card";
    card.total_bytes = 8 * GiB;
    PlanOptions options;
    options.utilization = 0.90;
    options.max_model_len = 4096;
    Plan plan = make_plan(*inputs, card, options).value();
    MESSAGE(dir << ": weights " << format_bytes(inputs->weights.total_bytes) << ", fits 4096: " << plan.fits
                  << ", max context that fits " << plan.max_model_len_that_fits);
    REQUIRE(plan.max_model_len_that_fits >= 2048);
    options.max_model_len = plan.max_model_len_that_fits;
    CHECK(make_plan(*inputs, card, options).value().fits);
    // CPU: the repack row is the repacked host view of every AWQ / GPTQ Linear
    DeviceSpec cpu;
    cpu.backend = BackendKind::cpu;
    cpu.total_bytes = 64 * GiB;
    options.max_model_len = 2048;
    Plan on_cpu = make_plan(*inputs, cpu, options).value();
    auto row = std::find_if(on_cpu.items.begin(), on_cpu.items.end(), [](const PlanItem& i) { return i.key == "repack"; });
    REQUIRE(row != on_cpu.items.end());
    CHECK(row->bytes == align_up(host_repack, 256));
    CHECK(host_repack > 0);
  }
}
