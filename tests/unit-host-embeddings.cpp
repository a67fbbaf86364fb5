// host-embeddings: --host-embeddings (PlanOptions::host_embeddings) keeps an untied token-embedding table in host
// memory. The planner: a CUDA plan's weights row drops by exactly the table's bytes and says where it went, the
// pinned host staging buffer is planned (host memory, outside the device budget), a tied table is refused, the CPU
// changes nothing, and a plan that does not fit names the flag with what it saves. The engine: the forward pass
// looks the rows up with Backend::gather_host_rows (the CPU's plain gather; the CUDA backend's host staging is
// detail::gather_host_rows_into, checked here against gather_rows), with transformers' logits and greedy tokens.
// The GPU cases are in unit-cuda-engine.cpp.
#include <doctest/doctest.h>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"
#include "safetensors_writer.hpp"

using namespace kvlite;
namespace fx = model_fixtures;

namespace {

std::string source_path(const std::string& relative) { return std::string(KVLITE_SOURCE_DIR) + "/" + relative; }
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
const char* kW8A8 = "tests/fixtures/configs/qwen2.5-7b-instruct-w8a8-int8";

DeviceSpec planned_card(uint64_t bytes) {
  DeviceSpec card;
  card.backend = BackendKind::cuda;
  card.name = "planned " + format_bytes(bytes) + " card";
  card.total_bytes = bytes;
  card.wsl2 = false;
  return card;
}

Plan plan_of(const PlanInputs& inputs, const DeviceSpec& device, const PlanOptions& options) {
  Result<Plan> plan = make_plan(inputs, device, options);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  return *plan;
}

std::string advice_with(const Plan& plan, const std::string& part) {
  for (const std::string& line : plan.advice)
    if (contains(line, part)) return line;
  return "";
}

constexpr double kLogitsTolerance = 1e-4;  // max |kvlite - transformers| / max |transformers|, float32

// A copy of a tied fixture with its embeddings untied: tie_word_embeddings false (at the top and in text_config)
// and lm_head.weight a copy of embed_tokens. The same numbers, so transformers' logits of the tied model are the
// copy's; but --host-embeddings may keep its table in host memory.
std::string untied_copy(const std::string& source, const std::string& name, const std::string& embed_name) {
  namespace st = testing_safetensors;
  const std::string dir = st::temp_dir(name);
  REQUIRE(std::system(("cp -r '" + source + "/.' '" + dir + "'").c_str()) == 0);
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(fx::read_file(dir + "/config.json"));
  config["tie_word_embeddings"] = false;
  if (config.contains("text_config")) config["text_config"]["tie_word_embeddings"] = false;
  st::write_text(dir + "/config.json", config.dump(2));
  auto store = TensorStore::open_dir(source);
  REQUIRE(store.ok());
  std::vector<st::Tensor> tensors;
  for (const TensorInfo& info : store->tensors()) {
    const uint8_t* data = store->data(info);
    tensors.push_back({info.name, dtype_name(info.dtype), info.shape, std::vector<uint8_t>(data, data + info.nbytes)});
    if (info.name == embed_name) {
      st::Tensor head = tensors.back();
      head.name = "lm_head.weight";
      tensors.push_back(head);
    }
  }
  std::string shards = dir + "/model.safetensors";
  std::remove(shards.c_str());
  st::write_file(shards, tensors);
  return dir;
}

}  // namespace

TEST_CASE("Qwen2.5-7B W8A8 on an 8 GiB card: --host-embeddings takes exactly the embedding table off the weights row") {
  auto inputs = read_plan_inputs(source_path(kW8A8));
  REQUIRE_MESSAGE(inputs.ok(), inputs.error().message);
  const TextConfig& t = inputs->config.text;
  REQUIRE_FALSE(t.tie_word_embeddings);
  // 152064 x 3584 bf16: 1.02 GiB, estimated from config.json like the rest of the weights
  CHECK(inputs->weights.embed_table_bytes == uint64_t(t.vocab_size) * uint64_t(t.hidden_size) * 2);
  CHECK(inputs->weights.embed_table_bytes == 1089994752);
  PlanOptions options;
  options.max_model_len = 4096;
  const Plan device = plan_of(*inputs, planned_card(8 * GiB), options);
  options.host_embeddings = true;
  const Plan host = plan_of(*inputs, planned_card(8 * GiB), options);
  MESSAGE("weights row: " << format_bytes(device.item("weights")->bytes) << " -> "
                          << format_bytes(host.item("weights")->bytes) << "; fixed " << format_bytes(device.fixed_bytes)
                          << " -> " << format_bytes(host.fixed_bytes));
  CHECK(device.item("weights")->bytes - host.item("weights")->bytes == inputs->weights.embed_table_bytes);
  CHECK(device.fixed_bytes - host.fixed_bytes == inputs->weights.embed_table_bytes);
  CHECK(device.arena_bytes() - host.arena_bytes() == inputs->weights.embed_table_bytes);
  // every other row is the same: the rows land in the activations' hidden buffer, which is planned already
  for (const PlanItem& item : device.items)
    if (item.key != "weights") {
      CAPTURE(item.key);
      REQUIRE(host.item(item.key) != nullptr);
      CHECK(host.item(item.key)->bytes == item.bytes);
    }
  CHECK(device.host_embedding_bytes == 0);
  CHECK(device.host_staging_bytes == 0);
  CHECK(host.host_embedding_bytes == inputs->weights.embed_table_bytes);
  // the pinned staging buffer: max_batched_tokens x hidden x bf16, host memory (in no row)
  CHECK(host.options.max_batched_tokens == 2048);
  CHECK(host.host_staging_bytes == 2048ull * 3584 * 2);
  const std::string& why = host.item("weights")->why;
  CAPTURE(why);
  CHECK(contains(why, "embed_tokens (1.02 GiB) stays in host memory (--host-embeddings)"));
  CHECK(contains(why, "pinned host buffer of 14.0 MiB"));
  CHECK(contains(why, "host memory, not in the device budget"));
  CHECK_FALSE(contains(device.item("weights")->why, "--host-embeddings"));
  CHECK(contains(host.table(), "stays in host memory (--host-embeddings)"));
  CHECK(contains(host.json(), "\"host_embeddings\": true"));
  CHECK(contains(host.json(), "\"host_embedding_bytes\": 1089994752"));
  // --max-batched-tokens sizes the staging buffer
  options.max_batched_tokens = 512;
  CHECK(plan_of(*inputs, planned_card(8 * GiB), options).host_staging_bytes == 512ull * 3584 * 2);
}

TEST_CASE("advice names --host-embeddings with the bytes it saves, and whether that alone makes the plan fit") {
  auto inputs = read_plan_inputs(source_path(kW8A8));
  REQUIRE(inputs.ok());
  PlanOptions options;
  options.max_model_len = 4096;
  options.max_seqs = 1;
  // 8 GiB: int8 Linears are still dequantized to bf16 on the GPU (the repack row), so the table alone is not enough
  const Plan short_plan = plan_of(*inputs, planned_card(8 * GiB), options);
  REQUIRE_FALSE(short_plan.fits);
  const std::string line = advice_with(short_plan, "--host-embeddings");
  CAPTURE(line);
  CHECK(contains(line, "With --host-embeddings: the untied embedding table (embed_tokens, 1.02 GiB) stays in host "
                       "memory, 1.02 GiB less on the device"));
  CHECK(contains(line, "not enough alone: still short by"));
  // a card the plan fits with the table on the host and not with it on the device
  PlanOptions host_options = options;
  host_options.host_embeddings = true;
  const Plan probe = plan_of(*inputs, planned_card(64 * GiB), host_options);
  options.utilization = host_options.utilization = 1.0;
  const uint64_t card = probe.fixed_bytes + 4096 * probe.kv_bytes_per_token + 64 * MiB;
  const Plan without = plan_of(*inputs, planned_card(card), options);
  const Plan with = plan_of(*inputs, planned_card(card), host_options);
  CHECK(with.fits);
  REQUIRE_FALSE(without.fits);
  const std::string fits_line = advice_with(without, "--host-embeddings");
  CAPTURE(fits_line);
  CHECK(contains(fits_line, "that alone makes it fit"));
  // no advice to do what is done already, nor on the CPU (its table is host memory)
  CHECK(advice_with(plan_of(*inputs, planned_card(8 * GiB), host_options), "--host-embeddings").empty());
  DeviceSpec cpu;
  cpu.backend = BackendKind::cpu;
  cpu.total_bytes = 4 * GiB;
  const Plan cpu_plan = plan_of(*inputs, cpu, options);
  REQUIRE_FALSE(cpu_plan.fits);
  CHECK(advice_with(cpu_plan, "--host-embeddings").empty());
}

TEST_CASE("a tied embedding table is refused with --host-embeddings, on either backend") {
  // tiny-qwen2 ties lm_head to embed_tokens (tiny-llama3 does not)
  auto tied = read_plan_inputs(fx::dir("tiny-qwen2"));
  REQUIRE(tied.ok());
  REQUIRE(tied->config.text.tie_word_embeddings);
  PlanOptions options;
  options.host_embeddings = true;
  DeviceSpec cpu;
  cpu.backend = BackendKind::cpu;
  cpu.total_bytes = 1 * GiB;
  for (const DeviceSpec& device : {planned_card(8 * GiB), cpu}) {
    CAPTURE(backend_name(device.backend));
    Result<Plan> plan = make_plan(*tied, device, options);
    REQUIRE_FALSE(plan.ok());
    CHECK(plan.error().code == ErrorCode::invalid_argument);
    CHECK(contains(plan.error().message, "tie_word_embeddings"));
    CHECK(contains(plan.error().message, "drop --host-embeddings"));
  }
  // and the tied model plans without it, with no advice to use it
  options.host_embeddings = false;
  options.max_model_len = 64;
  const Plan tiny = plan_of(*tied, planned_card(300 * MiB), options);
  CHECK(advice_with(tiny, "--host-embeddings").empty());
  // an engine refuses it before reserving anything
  EngineOptions engine_options;
  engine_options.backend = BackendChoice::cpu;
  engine_options.plan.device_mem = 64 * MiB;
  engine_options.plan.host_embeddings = true;
  auto engine = Engine::open(fx::dir("tiny-qwen2"), engine_options);
  REQUIRE_FALSE(engine.ok());
  CHECK(engine.error().code == ErrorCode::invalid_argument);
}

TEST_CASE("on the CPU --host-embeddings changes no number: the plan says so") {
  auto inputs = read_plan_inputs(fx::dir("tiny-llama3"));
  REQUIRE(inputs.ok());
  REQUIRE_FALSE(inputs->config.text.tie_word_embeddings);
  DeviceSpec cpu;
  cpu.backend = BackendKind::cpu;
  cpu.total_bytes = 64 * MiB;
  PlanOptions options;
  const Plan plain = plan_of(*inputs, cpu, options);
  options.host_embeddings = true;
  const Plan host = plan_of(*inputs, cpu, options);
  CHECK(host.fixed_bytes == plain.fixed_bytes);
  CHECK(host.arena_bytes() == plain.arena_bytes());
  CHECK(host.kv_pages == plain.kv_pages);
  CHECK(host.host_embedding_bytes == 0);
  CHECK(host.host_staging_bytes == 0);
  CHECK(contains(host.item("weights")->why, "--host-embeddings changes nothing here"));
  // on a planned CUDA card the same fixture's weights row drops by its table (1510 x 64 bf16)
  const Plan gpu_plain = plan_of(*inputs, planned_card(1 * GiB), PlanOptions{});
  const Plan gpu_host = plan_of(*inputs, planned_card(1 * GiB), options);
  CHECK(gpu_plain.item("weights")->bytes - gpu_host.item("weights")->bytes == inputs->weights.embed_table_bytes);
  CHECK(inputs->weights.embed_table_bytes ==
        uint64_t(inputs->config.text.vocab_size) * uint64_t(inputs->config.text.hidden_size) * 2);
}

TEST_CASE("the host staging's rows equal gather_rows' for every table and activation dtype") {
  // detail::gather_host_rows_into is what the CUDA backend stages in pinned memory before its copy; the CPU's
  // gather_rows is the reference (its conversions round to nearest even, as the GPU's do)
  const int64_t V = 37, H = 19, T = 11;
  std::vector<float> values(size_t(V * H));
  for (size_t i = 0; i < values.size(); i++) values[i] = std::sin(0.37f * float(i)) * 70000.0f / float(1 + i % 13);
  std::vector<int32_t> ids = {0, 36, 5, 5, 12, 1, 30, 7, 36, 0, 18};
  for (DType table_dtype : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<uint8_t> table_bytes(size_t(V * H) * dtype_bytes(table_dtype, 1));
    for (size_t i = 0; i < values.size(); i++) {
      if (table_dtype == DType::F32) std::memcpy(&table_bytes[i * 4], &values[i], 4);
      const uint16_t h = table_dtype == DType::BF16 ? float_to_bf16(values[i]) : float_to_f16(values[i]);
      if (table_dtype != DType::F32) std::memcpy(&table_bytes[i * 2], &h, 2);
    }
    const Tensor table = Tensor::matrix(table_bytes.data(), table_dtype, V, H);
    for (DType act : {DType::F32, DType::BF16, DType::F16}) {
      CAPTURE(dtype_name(table_dtype));
      CAPTURE(dtype_name(act));
      CpuBackendOptions cpu_options;
      cpu_options.activation_dtype = act;
      auto backend = make_cpu_backend(cpu_options);
      REQUIRE(backend.ok());
      const size_t bytes = size_t(T * H) * dtype_bytes(act, 1);
      std::vector<uint8_t> expected(bytes), staged(bytes, 0xAB), looked_up(bytes, 0xCD);
      REQUIRE((*backend)->gather_rows(table, Tensor::vector(ids.data(), DType::I32, T),
                                      Tensor::matrix(expected.data(), act, T, H)).ok());
      detail::gather_host_rows_into(table, ids.data(), T, act, staged.data());
      CHECK(staged == expected);
      REQUIRE((*backend)->gather_host_rows(table, ids.data(), Tensor::matrix(looked_up.data(), act, T, H)).ok());
      CHECK(looked_up == expected);
    }
  }
  // an id outside the table is refused on the host, naming it, before anything is written
  CpuBackendOptions f32;
  auto backend = make_cpu_backend(f32);
  REQUIRE(backend.ok());
  std::vector<float> table(size_t(V * H), 1.0f), out(size_t(2 * H), -1.0f);
  const int32_t bad[2] = {3, int32_t(V)};
  Status refused = (*backend)->gather_host_rows(Tensor::matrix(table.data(), DType::F32, V, H), bad,
                                                Tensor::matrix(out.data(), DType::F32, 2, H));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(contains(refused.error().message, "ids[1] = 37 is outside the table's 37 rows"));
  CHECK(out[0] == -1.0f);
}

TEST_CASE("CPU engine with --host-embeddings: transformers' logits and greedy tokens, the same bits as without") {
  const std::string name = "tiny-llama3";  // untied lm_head
  EngineOptions host_options;
  host_options.plan.host_embeddings = true;
  auto plain = fx::open(name);
  auto host = fx::open(name, host_options);
  CHECK(host->plan().options.host_embeddings);
  CHECK(host->info().host_embeddings);  // the forward pass looks the rows up with gather_host_rows
  CHECK_FALSE(plain->info().host_embeddings);
  CHECK(host->info().decode_weight_bytes == plain->info().decode_weight_bytes);
  // chunked prefill: a step of 7 tokens at a time looks up 7 rows
  EngineOptions chunked_options = host_options;
  chunked_options.plan.max_batched_tokens = 7;
  auto chunked = fx::open(name, chunked_options);
  const nlohmann::json reference = fx::reference(name);
  for (const auto& prompt : reference["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    const std::vector<int32_t> ids = fx::ids_of(prompt["input_ids"]);
    const fx::Npy expected = fx::read_npy(fx::dir(name) + "/" + prompt["logits_file"].get<std::string>());
    auto a = plain->logits(ids);
    auto b = host->logits(ids);
    auto c = chunked->logits(ids);
    REQUIRE_MESSAGE(b, b.error().message);
    REQUIRE(a);
    REQUIRE(c);
    REQUIRE(b->tokens == expected.rows);
    CHECK(fx::relative_max_diff(b->values, expected.values) <= kLogitsTolerance);
    CHECK(fx::relative_max_diff(c->values, expected.values) <= kLogitsTolerance);
    CHECK(b->values == a->values);
    SamplingParams params;
    params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
    auto generation = host->generate(ids, params);
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
  }
  // batched decode (several sequences a step, each its own row)
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> greedy = fx::reference_greedy(name, &prompts);
  std::vector<RequestId> requests;
  for (const auto& ids : prompts) requests.push_back(host->submit(ids, engine_helpers::greedy()).value());
  REQUIRE(host->run());
  for (size_t i = 0; i < prompts.size(); i++) CHECK(host->result(requests[i]).value().ids == greedy[i]);
  engine_helpers::check_pool_empty(*host);
}

TEST_CASE("CPU engine with --host-embeddings in BF16 activations: the same bits as the device table") {
  // the CPU's BF16 mode rounds where the GPU does: the looked-up rows are the table's bf16 values as stored
  EngineOptions options;
  options.plan.activation_dtype = DType::BF16;
  auto plain = fx::open("tiny-llama3", options);
  options.plan.host_embeddings = true;
  auto host = fx::open("tiny-llama3", options);
  const nlohmann::json reference = fx::reference("tiny-llama3");
  const std::vector<int32_t> ids = fx::ids_of(reference["prompts"][2]["input_ids"]);
  auto a = plain->logits(ids);
  auto b = host->logits(ids);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(b->values == a->values);
  auto x = plain->generate(ids, engine_helpers::greedy());
  auto y = host->generate(ids, engine_helpers::greedy());
  REQUIRE(x);
  REQUIRE(y);
  CHECK(y->ids == x->ids);
}

TEST_CASE("Gemma's embedding scale applies after a host lookup: an untied gemma2 gives transformers' logits") {
  const std::string source = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/families/gemma2";
  const std::string dir = untied_copy(source, "gemma2-untied", "model.embed_tokens.weight");
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = 64 * MiB;
  auto plain = Engine::open(dir, options);
  REQUIRE_MESSAGE(plain.ok(), plain.error().message);
  options.plan.host_embeddings = true;
  auto host = Engine::open(dir, options);
  REQUIRE_MESSAGE(host.ok(), host.error().message);
  CHECK((*host)->info().host_embeddings);
  const nlohmann::json reference = nlohmann::json::parse(fx::read_file(source + "/reference.json"));
  for (const auto& prompt : reference["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    const fx::Npy expected = fx::read_npy(source + "/" + prompt["logits_file"].get<std::string>());
    auto a = (*plain)->logits(fx::ids_of(prompt["input_ids"]));
    auto b = (*host)->logits(fx::ids_of(prompt["input_ids"]));
    REQUIRE(a);
    REQUIRE_MESSAGE(b, b.error().message);
    CHECK(b->values == a->values);
    CHECK(fx::relative_max_diff(b->values, expected.values) <= kLogitsTolerance);
  }
}

TEST_CASE("image embeddings replace the rows of a host lookup: an untied Qwen3-VL gives transformers' logits") {
  const std::string fixtures = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/";
  const std::string dir = untied_copy(fixtures + "vl/tiny-qwen3-vl", "qwen3-vl-untied", "model.language_model.embed_tokens.weight");
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = 64 * MiB;
  options.plan.max_images = 2;
  options.plan.host_embeddings = true;
  auto host = Engine::open(dir, options);
  REQUIRE_MESSAGE(host.ok(), host.error().message);
  CHECK((*host)->info().host_embeddings);
  const nlohmann::json reference = nlohmann::json::parse(fx::read_file(fixtures + "vl/reference.json"));
  const int32_t pad = reference["image_token_id"].get<int32_t>();
  int with_images = 0;
  for (const auto& prompt : reference["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    // the prompt's images as transformers' processor gave them, and one <|image_pad|> per image
    std::vector<VisionInput> images;
    for (const auto& image : prompt["images"]) {
      VisionInput input;
      const fx::Npy pixels = fx::read_npy(fixtures + image["pixel_values_file"].get<std::string>());
      input.pixel_values = pixels.values;
      input.row_size = pixels.cols;
      const auto grid = image["grid_thw"].get<std::vector<int64_t>>();
      input.grid.grid_t = grid[0];
      input.grid.grid_h = grid[1];
      input.grid.grid_w = grid[2];
      input.grid.resized_height = grid[1] * 16;
      input.grid.resized_width = grid[2] * 16;
      input.grid.image_tokens = image["image_tokens"].get<int64_t>();
      images.push_back(std::move(input));
    }
    with_images += images.empty() ? 0 : 1;
    std::vector<int32_t> ids;
    for (int32_t id : fx::ids_of(prompt["input_ids"]))
      if (id != pad || ids.empty() || ids.back() != pad) ids.push_back(id);
    const fx::Npy expected = fx::read_npy(fixtures + "vl/" + prompt["logits_file"].get<std::string>());
    auto logits = (*host)->logits(ids, images);
    REQUIRE_MESSAGE(logits, logits.error().message);
    REQUIRE(logits->tokens == expected.rows);
    CHECK(fx::relative_max_diff(logits->values, expected.values) <= kLogitsTolerance);
  }
  CHECK(with_images > 0);
}
