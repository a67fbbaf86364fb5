// plan: the memory planner. Until config.inl lands, the two reference models are hand-built below from their
// published config.json values (Llama-3.1-8B-Instruct; Qwen3-VL-4B-Instruct, shared notes qwen3-vl.md) and the
// on-disk formats of their quantized checkpoints (compressed-tensors W4A16 group 128; Qwen block FP8), tensor
// by tensor, the way summarize_weights reports them from safetensors headers.
#include <doctest/doctest.h>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"

namespace plan_models {
using namespace kvlite;

inline uint64_t bf16_bytes(uint64_t elements) { return elements * 2; }

inline LinearDesc dense_linear(const std::string& name, int64_t n, int64_t k, bool bias, bool vision) {
  LinearDesc d;
  d.name = name;
  d.out_features = n;
  d.in_features = k;
  d.format = WeightFormat::dense;
  d.weight_dtype = DType::BF16;
  d.has_bias = bias;
  d.vision = vision;
  d.bytes = bf16_bytes(uint64_t(n * k)) + (bias ? bf16_bytes(uint64_t(n)) : 0);
  d.exact = true;
  return d;
}

// compressed-tensors pack-quantized, symmetric, group 128: weight_packed I32 [N, K/8], weight_scale bf16
// [N, K/128], weight_shape I64 [2].
inline LinearDesc w4a16_linear(const std::string& name, int64_t n, int64_t k) {
  LinearDesc d;
  d.name = name;
  d.out_features = n;
  d.in_features = k;
  d.format = WeightFormat::int4;
  d.weight_dtype = DType::I32;
  d.granularity = ScaleGranularity::group;
  d.scale_dtype = DType::BF16;
  d.scale_name = "weight_scale";
  d.group_size = 128;
  d.bytes = uint64_t(n) * uint64_t(k / 8) * 4 + bf16_bytes(uint64_t(n) * uint64_t((k + 127) / 128)) + 16;
  d.exact = true;
  return d;
}

// Qwen block FP8: weight F8_E4M3 [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)]. Checkpoints store the
// scales as F32, BF16 or F16 (read from the headers); bf16 here, so the repack row has work to plan.
inline LinearDesc fp8_block_linear(const std::string& name, int64_t n, int64_t k) {
  LinearDesc d;
  d.name = name;
  d.out_features = n;
  d.in_features = k;
  d.format = WeightFormat::fp8;
  d.weight_dtype = DType::F8_E4M3;
  d.granularity = ScaleGranularity::block;
  d.scale_dtype = DType::BF16;
  d.scale_name = "weight_scale_inv";
  d.block_n = 128;
  d.block_k = 128;
  d.bytes = uint64_t(n) * uint64_t(k) + bf16_bytes(uint64_t((n + 127) / 128) * uint64_t((k + 127) / 128));
  d.exact = true;
  return d;
}

inline ModelConfig llama31_8b() {
  ModelConfig c;
  c.model_type = "llama";
  c.arch = Arch::llama;
  c.origin = "models/Llama-3.1-8B-Instruct-W4A16/config.json";
  TextConfig& t = c.text;
  t.hidden_size = 4096;
  t.intermediate_size = 14336;
  t.num_layers = 32;
  t.num_heads = 32;
  t.num_kv_heads = 8;
  t.head_dim = 128;
  t.vocab_size = 128256;
  t.max_position_embeddings = 131072;
  t.rms_norm_eps = 1e-5;
  t.dtype = DType::BF16;
  t.rope.type = "llama3";
  t.rope.theta = 500000.0;
  t.rope.factor = 8.0;
  t.rope.original_max_position_embeddings = 8192;
  c.quant.method = QuantMethod::compressed_tensors;
  c.quant.format = "pack-quantized";
  c.quant.ignore = {"lm_head"};
  return c;
}

// Llama-3.1-8B W4A16: every decoder Linear int4; embed_tokens and lm_head (untied) bf16; RMSNorm weights bf16.
inline WeightsSummary llama31_8b_w4a16(const ModelConfig& c) {
  WeightsSummary w;
  const TextConfig& t = c.text;
  int64_t q = t.num_heads * t.head_dim, kv = t.num_kv_heads * t.head_dim, h = t.hidden_size, i = t.intermediate_size;
  for (int64_t layer = 0; layer < t.num_layers; layer++) {
    std::string p = "model.layers." + std::to_string(layer) + ".";
    w.linears.push_back(w4a16_linear(p + "self_attn.q_proj", q, h));
    w.linears.push_back(w4a16_linear(p + "self_attn.k_proj", kv, h));
    w.linears.push_back(w4a16_linear(p + "self_attn.v_proj", kv, h));
    w.linears.push_back(w4a16_linear(p + "self_attn.o_proj", h, q));
    w.linears.push_back(w4a16_linear(p + "mlp.gate_proj", i, h));
    w.linears.push_back(w4a16_linear(p + "mlp.up_proj", i, h));
    w.linears.push_back(w4a16_linear(p + "mlp.down_proj", h, i));
  }
  w.linears.push_back(dense_linear("lm_head", t.vocab_size, h, false, false));
  uint64_t embed = bf16_bytes(uint64_t(t.vocab_size * h));
  uint64_t norms = bf16_bytes(uint64_t((2 * t.num_layers + 1) * h));
  for (const auto& l : w.linears) w.total_bytes += l.bytes;
  w.total_bytes += embed + norms;
  w.text_bytes = w.total_bytes;
  w.embedding_bytes = embed + bf16_bytes(uint64_t(t.vocab_size * h));
  w.exact = true;
  return w;
}

inline ModelConfig qwen3_vl_4b() {
  ModelConfig c;
  c.model_type = "qwen3_vl";
  c.arch = Arch::qwen3_vl;
  c.origin = "models/Qwen3-VL-4B-Instruct-FP8/config.json";
  TextConfig& t = c.text;
  t.hidden_size = 2560;
  t.intermediate_size = 9728;
  t.num_layers = 36;
  t.num_heads = 32;
  t.num_kv_heads = 8;
  t.head_dim = 128;
  t.vocab_size = 151936;
  t.max_position_embeddings = 262144;
  t.tie_word_embeddings = true;
  t.qk_norm = true;
  t.dtype = DType::BF16;
  t.rope.theta = 5000000.0;
  t.rope.mrope_section = {24, 20, 20};
  t.rope.mrope_interleaved = true;
  VisionConfig& v = c.vision;
  v.present = true;
  v.depth = 24;
  v.hidden_size = 1024;
  v.intermediate_size = 4096;
  v.num_heads = 16;
  v.patch_size = 16;
  v.temporal_patch_size = 2;
  v.spatial_merge_size = 2;
  v.out_hidden_size = 2560;
  v.num_position_embeddings = 2304;
  v.deepstack_visual_indexes = {5, 11, 17};
  c.quant.method = QuantMethod::fp8;
  c.quant.format = "fp8";
  c.image_token_id = 151655;
  c.min_pixels = 65536;      // preprocessor size.shortest_edge
  c.max_pixels = 16777216;   // preprocessor size.longest_edge
  return c;
}

// Qwen3-VL-4B FP8: language-model Linears block FP8; the vision tower, mergers, embeddings and norms bf16.
inline WeightsSummary qwen3_vl_4b_fp8(const ModelConfig& c) {
  WeightsSummary w;
  const TextConfig& t = c.text;
  const VisionConfig& v = c.vision;
  int64_t q = t.num_heads * t.head_dim, kv = t.num_kv_heads * t.head_dim, h = t.hidden_size, i = t.intermediate_size;
  uint64_t text = 0, vision = 0;
  for (int64_t layer = 0; layer < t.num_layers; layer++) {
    std::string p = "model.language_model.layers." + std::to_string(layer) + ".";
    w.linears.push_back(fp8_block_linear(p + "self_attn.q_proj", q, h));
    w.linears.push_back(fp8_block_linear(p + "self_attn.k_proj", kv, h));
    w.linears.push_back(fp8_block_linear(p + "self_attn.v_proj", kv, h));
    w.linears.push_back(fp8_block_linear(p + "self_attn.o_proj", h, q));
    w.linears.push_back(fp8_block_linear(p + "mlp.gate_proj", i, h));
    w.linears.push_back(fp8_block_linear(p + "mlp.up_proj", i, h));
    w.linears.push_back(fp8_block_linear(p + "mlp.down_proj", h, i));
  }
  for (int64_t block = 0; block < v.depth; block++) {
    std::string p = "model.visual.blocks." + std::to_string(block) + ".";
    w.linears.push_back(dense_linear(p + "attn.qkv", 3 * v.hidden_size, v.hidden_size, true, true));
    w.linears.push_back(dense_linear(p + "attn.proj", v.hidden_size, v.hidden_size, true, true));
    w.linears.push_back(dense_linear(p + "mlp.linear_fc1", v.intermediate_size, v.hidden_size, true, true));
    w.linears.push_back(dense_linear(p + "mlp.linear_fc2", v.hidden_size, v.intermediate_size, true, true));
  }
  int64_t merged = 4 * v.hidden_size;
  for (size_t m = 0; m <= v.deepstack_visual_indexes.size(); m++) {
    std::string p = m == 0 ? std::string("model.visual.merger.")
                           : "model.visual.deepstack_merger_list." + std::to_string(m - 1) + ".";
    w.linears.push_back(dense_linear(p + "linear_fc1", merged, merged, true, true));
    w.linears.push_back(dense_linear(p + "linear_fc2", v.out_hidden_size, merged, true, true));
    vision += bf16_bytes(uint64_t(2 * (m == 0 ? v.hidden_size : merged)));  // LayerNorm weight + bias
  }
  for (const auto& l : w.linears) (l.vision ? vision : text) += l.bytes;
  uint64_t embed = bf16_bytes(uint64_t(t.vocab_size * h));  // tied: also the lm_head
  text += embed + bf16_bytes(uint64_t((2 * t.num_layers + 1) * h + 2 * t.num_layers * t.head_dim));
  vision += bf16_bytes(uint64_t(v.hidden_size * 1536 + v.hidden_size));           // patch_embed
  vision += bf16_bytes(uint64_t(v.num_position_embeddings * v.hidden_size));      // pos_embed
  vision += bf16_bytes(uint64_t(v.depth * 4 * v.hidden_size));                    // norm1, norm2 (w + b)
  w.text_bytes = text;
  w.vision_bytes = vision;
  w.total_bytes = text + vision;
  w.embedding_bytes = embed;
  w.exact = true;
  return w;
}

inline DeviceSpec planned_card(uint64_t bytes, bool wsl2) {
  DeviceSpec d;
  d.backend = BackendKind::cuda;
  d.name = "planned " + format_bytes(bytes) + " card";
  d.total_bytes = bytes;
  d.wsl2 = wsl2;
  return d;
}

}  // namespace plan_models

using namespace kvlite;
using namespace plan_models;

namespace {

struct Model {
  ModelConfig config;
  WeightsSummary weights;
};
Model llama() {
  Model m{llama31_8b(), {}};
  m.weights = llama31_8b_w4a16(m.config);
  return m;
}
Model qwen() {
  Model m{qwen3_vl_4b(), {}};
  m.weights = qwen3_vl_4b_fp8(m.config);
  return m;
}

Plan plan_for(const Model& m, const DeviceSpec& device, const PlanOptions& options) {
  auto plan = make_plan(m.config, m.weights, device, options);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  return *plan;
}

PlanOptions options_with(double utilization, int64_t max_model_len) {
  PlanOptions o;
  o.utilization = utilization;
  o.max_model_len = max_model_len;
  return o;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
bool any_contains(const std::vector<std::string>& lines, const std::string& part) {
  for (const auto& l : lines)
    if (contains(l, part)) return true;
  return false;
}

uint64_t kv_for(const Plan& plan, int64_t tokens) {
  return (uint64_t(tokens) + plan.kv_page_tokens - 1) / plan.kv_page_tokens * plan.kv_page_bytes;
}

const BufferSpec& named(const std::vector<BufferSpec>& buffers, const std::string& name) {
  for (const auto& b : buffers)
    if (b.name == name) return b;
  FAIL("no buffer named " << name);
  return buffers.front();
}

}  // namespace

TEST_CASE("KV bytes per token: Llama-3.1-8B 131072, Qwen3-VL-4B 147456, half with fp8") {
  Model l = llama(), q = qwen();
  DeviceSpec card = planned_card(24 * GiB, false);
  PlanOptions o = options_with(0.9, 2048);
  CHECK(plan_for(l, card, o).kv_bytes_per_token == 131072);
  CHECK(plan_for(q, card, o).kv_bytes_per_token == 147456);
  o.kv_dtype = KVDType::fp8;
  CHECK(plan_for(l, card, o).kv_bytes_per_token == 65536);
  CHECK(plan_for(q, card, o).kv_bytes_per_token == 73728);
  o.kv_dtype = KVDType::bf16;
  Plan p = plan_for(q, card, o);
  CHECK(p.kv_page_bytes == 16 * 147456);
  // 2048 tokens of Qwen3-VL-4B KV = 288 MiB; 4096 = 576 MiB (notes: memory-planning.md).
  CHECK(kv_for(p, 2048) == 288 * MiB);
  CHECK(kv_for(p, 4096) == 576 * MiB);
}

TEST_CASE("Llama-3.1-8B W4A16 perplexity on an 8 GiB card: 2048 fits, 131072 cannot (its KV alone is 16 GiB)") {
  Model l = llama();
  DeviceSpec card = planned_card(8 * GiB, false);
  Plan short_context = plan_for(l, card, options_with(0.9, 2048));
  CHECK(short_context.fits);
  CHECK(short_context.shortfall_bytes == 0);
  CHECK(short_context.concurrency == doctest::Approx(double(short_context.kv_tokens) / 2048));
  CHECK(contains(short_context.advice.at(0), "KV holds"));

  Plan full = plan_for(l, card, options_with(0.9, 131072));
  CHECK_FALSE(full.fits);
  CHECK(kv_for(full, 131072) == 16 * GiB);
  CHECK(full.shortfall_bytes == int64_t(16 * GiB) - full.kv_available_bytes);
  CHECK(contains(full.advice.at(0), "Does not fit: KV needs 16.00 GiB for one 131072-token sequence"));
  // No ratio of an 8 GiB card holds 5+ GiB of weights and 16 GiB of KV.
  CHECK(full.utilization_needed > 1.0);
  CHECK(any_contains(full.advice, "does not fit at any utilization: needs"));
  // Its suggestion fits when re-planned, and so does the fp8-KV one, which holds twice the tokens.
  REQUIRE(full.max_model_len_that_fits > 0);
  CHECK(full.max_model_len_that_fits == int64_t(full.kv_tokens));
  CHECK(any_contains(full.advice, "--max-model-len " + std::to_string(full.max_model_len_that_fits)));
  CHECK(plan_for(l, card, options_with(0.9, full.max_model_len_that_fits)).fits);
  CHECK(full.max_model_len_that_fits_fp8_kv >= 2 * full.max_model_len_that_fits);
  PlanOptions fp8 = options_with(0.9, full.max_model_len_that_fits_fp8_kv);
  fp8.kv_dtype = KVDType::fp8;
  CHECK(plan_for(l, card, fp8).fits);
  // The fixed items are the same whatever max_model_len (max_batched_tokens 2048 both times).
  CHECK(full.fixed_bytes == short_context.fixed_bytes);
}

// (With the GPU's layout of the FP8 Linears in the plan, the repack row: 0.80 under WSL2 leaves no room for KV.)
TEST_CASE("Qwen3-VL-4B FP8 on an 8 GiB card under WSL2: 0.85 x 4096 and 0.70 x 2048") {
  Model q = qwen();
  DeviceSpec wsl2_card = planned_card(8 * GiB, true);
  Plan a = plan_for(q, wsl2_card, options_with(0.85, 4096));
  CHECK(a.budget_bytes == uint64_t(std::floor(0.85 * double(8 * GiB))));
  CHECK(a.item("context")->bytes == 1024 * MiB);
  CHECK_FALSE(a.item("context")->in_arena);
  CHECK_FALSE(a.fits);
  CHECK(contains(a.advice.at(0), "KV needs 576.0 MiB for one 4096-token sequence"));
  CHECK(any_contains(a.advice, "WSL2"));
  // What would fit, each re-planned.
  REQUIRE(a.utilization_needed > 0.85);
  REQUIRE(a.utilization_needed <= 1.0);
  CHECK(plan_for(q, wsl2_card, options_with(a.utilization_needed, 4096)).fits);
  REQUIRE(a.max_model_len_that_fits > 0);
  CHECK(a.max_model_len_that_fits < 4096);
  CHECK(plan_for(q, wsl2_card, options_with(0.85, a.max_model_len_that_fits)).fits);
  // Native Linux: the same plan with 1024 MiB - cuda_context_bytes (645 MiB) less context, all of it KV.
  Plan native = plan_for(q, planned_card(8 * GiB, false), options_with(0.85, 4096));
  CHECK(native.kv_available_bytes - a.kv_available_bytes ==
        int64_t(1024 * MiB - cuda_context_bytes(planned_card(8 * GiB, false))));
  CHECK_FALSE(any_contains(native.advice, "WSL2"));

  // Less utilization and half the context: the budget shrinks more than the KV need does.
  Plan b = plan_for(q, wsl2_card, options_with(0.70, 2048));
  CHECK_FALSE(b.fits);
  CHECK(b.fixed_bytes == a.fixed_bytes);
  CHECK(a.kv_available_bytes - b.kv_available_bytes == int64_t(a.budget_bytes - b.budget_bytes));
  CHECK(b.kv_available_bytes < 0);
  CHECK(b.max_model_len_that_fits == 0);
  CHECK(b.kv_arena_bytes == 0);
  CHECK(any_contains(b.advice, "No max_model_len fits at utilization 0.70"));
  CHECK(contains(b.advice.at(0), "only -"));  // the negative number is said, never alone
  CHECK(plan_for(q, wsl2_card, options_with(b.utilization_needed, 2048)).fits);
}

TEST_CASE("a smaller image budget is suggested when it makes the context fit") {
  Model q = qwen();
  DeviceSpec card = planned_card(8 * GiB, false);
  Plan p = plan_for(q, card, options_with(0.79, 4096));
  REQUIRE_FALSE(p.fits);
  REQUIRE(p.image_pixels_that_fit > 0);
  CHECK(p.image_pixels_that_fit < p.options.max_image_pixels);
  CHECK(p.image_pixels_that_fit % (32 * 32) == 0);
  CHECK(any_contains(p.advice, "With --max-image-pixels " + std::to_string(p.image_pixels_that_fit) + ": fits"));
  PlanOptions o = options_with(0.79, 4096);
  o.max_image_pixels = p.image_pixels_that_fit;
  CHECK(plan_for(q, card, o).fits);
  o.max_image_pixels = p.image_pixels_that_fit + 32 * 32;
  CHECK_FALSE(plan_for(q, card, o).fits);
}

TEST_CASE("default max_model_len: model max capped at 32768, halved to fit, never below 2048") {
  Model q = qwen();
  Plan big = plan_for(q, planned_card(24 * GiB, false), PlanOptions{});
  CHECK(big.max_model_len == 32768);
  CHECK(big.max_model_len_rule == "default: model max 262144 capped at 32768");
  CHECK(big.fits);
  CHECK(big.options.max_batched_tokens == 2048);
  CHECK(big.options.max_seqs == 8);

  Plan eight = plan_for(q, planned_card(8 * GiB, false), PlanOptions{});
  CHECK(eight.max_model_len == 8192);
  CHECK(eight.max_model_len_rule == "default: model max 262144 capped at 32768, halved to 8192 to fit");
  CHECK(eight.fits);
  CHECK_FALSE(plan_for(q, planned_card(8 * GiB, false), options_with(0.9, 16384)).fits);

  Plan tiny = plan_for(q, planned_card(6 * GiB, false), PlanOptions{});
  CHECK(tiny.max_model_len == 2048);
  CHECK_FALSE(tiny.fits);
  CHECK(contains(tiny.max_model_len_rule, "halved to 2048 to fit (and still does not)"));

  Model small = llama();
  small.config.text.max_position_embeddings = 1000;
  Plan short_model = plan_for(small, planned_card(24 * GiB, false), PlanOptions{});
  CHECK(short_model.max_model_len == 1000);
  CHECK(short_model.max_model_len_rule == "default: model max 1000");
  CHECK(short_model.options.max_batched_tokens == 1000);  // min(2048, max_model_len)
}

TEST_CASE("invariants over models, cards, ratios, KV dtypes and backends") {
  std::vector<Model> models = {llama(), qwen()};
  std::vector<DeviceSpec> devices;
  for (uint64_t gib : {4, 8, 24}) {
    devices.push_back(planned_card(gib * GiB, false));
    devices.push_back(planned_card(gib * GiB, true));
  }
  DeviceSpec cpu;
  cpu.name = "CPU";
  cpu.total_bytes = 16 * GiB + 12345;  // odd sizes too
  devices.push_back(cpu);
  int checked = 0;
  for (const auto& m : models)
    for (const auto& device : devices)
      for (double utilization : {0.6, 0.85, 1.0})
        for (KVDType dtype : {KVDType::auto_, KVDType::fp8})
          for (int64_t length : {0, 1000, 4096}) {
            PlanOptions o = options_with(utilization, length);
            o.kv_dtype = dtype;
            Plan p = plan_for(m, device, o);
            CAPTURE(p.model_name);
            CAPTURE(device.name);
            CAPTURE(device.wsl2);
            CAPTURE(utilization);
            CAPTURE(length);
            uint64_t sum = 0;
            for (const auto& item : p.items) {
              CHECK(item.bytes % kPlanAlignment == 0);
              sum += item.bytes;
            }
            CHECK(p.fixed_bytes == sum);
            CHECK(int64_t(p.budget_bytes) == int64_t(p.fixed_bytes) + p.kv_available_bytes);
            CHECK(p.kv_arena_bytes == p.kv_pages * p.kv_page_bytes);
            CHECK(p.kv_tokens == p.kv_pages * p.kv_page_tokens);
            CHECK(int64_t(p.kv_arena_bytes) <= std::max<int64_t>(p.kv_available_bytes, 0));
            // Every backend takes only the pages max_seqs sequences of max_model_len can use (or all the budget
            // allows, if less); --kv-fill takes every whole page (invariants below).
            uint64_t cap = uint64_t(p.options.max_seqs) * ((uint64_t(p.max_model_len) + p.kv_page_tokens - 1) / p.kv_page_tokens);
            CHECK(p.kv_pages_usable == cap);
            CHECK(p.kv_pages <= cap);
            if (p.kv_available_bytes > 0)
              CHECK((p.kv_pages == cap || int64_t(p.kv_arena_bytes + p.kv_page_bytes) > p.kv_available_bytes));
            CHECK(p.free_bytes == p.budget_bytes - std::min(p.budget_bytes, p.fixed_bytes + p.kv_arena_bytes));
            if (p.device.backend == BackendKind::cpu) CHECK_FALSE(p.item("weights")->in_arena);  // the mmap, in place
            {
              PlanOptions fill = o;
              fill.kv_fill = true;
              Plan f = plan_for(m, device, fill);
              if (f.kv_available_bytes > 0) CHECK(int64_t(f.kv_arena_bytes + f.kv_page_bytes) > f.kv_available_bytes);
              CHECK(f.kv_pages >= p.kv_pages);
              CHECK(f.fits == p.fits);
              CHECK(f.fixed_bytes == p.fixed_bytes);
            }
            uint64_t outside_arena = 0;
            for (const auto& item : p.items) outside_arena += item.in_arena ? 0 : item.bytes;
            CHECK(p.arena_bytes() + outside_arena == p.fixed_bytes + p.kv_arena_bytes);
            CHECK(detail::arena_layout(p).total_bytes == p.arena_bytes());  // what the arena will reserve
            CHECK(p.fits == (p.kv_available_bytes > 0 && p.kv_tokens >= uint64_t(p.max_model_len)));
            CHECK(p.shortfall_bytes == (p.fits ? 0 : int64_t(kv_for(p, p.max_model_len)) - p.kv_available_bytes));
            CHECK(p.concurrency == doctest::Approx(double(p.kv_tokens) / double(p.max_model_len)));
            REQUIRE_FALSE(p.advice.empty());
            CHECK(contains(p.advice[0], p.fits ? "KV holds" : "Does not fit: KV needs"));

            // Re-planned with the resolved options, the suggestions fit, and one page more does not.
            int64_t model_max = m.config.text.max_position_embeddings;
            if (p.max_model_len_that_fits > 0) {
              PlanOptions again = p.options;
              again.max_model_len = p.max_model_len_that_fits;
              CHECK(plan_for(m, device, again).fits);
              again.max_model_len = p.max_model_len_that_fits + int64_t(p.kv_page_tokens);
              if (again.max_model_len <= model_max) CHECK_FALSE(plan_for(m, device, again).fits);
            } else {
              CHECK(p.kv_tokens == 0);
            }
            if (p.utilization_needed <= 1.0) {
              PlanOptions again = p.options;
              again.utilization = p.utilization_needed;
              CHECK(plan_for(m, device, again).fits);
              again.utilization = p.utilization_needed * (1 - 1e-6);
              CHECK_FALSE(plan_for(m, device, again).fits);
            }
            if (p.max_model_len_that_fits_fp8_kv > 0) {
              PlanOptions again = p.options;
              again.kv_dtype = KVDType::fp8;
              again.max_model_len = p.max_model_len_that_fits_fp8_kv;
              CHECK(plan_for(m, device, again).fits);
            }
            if (m.config.vision.present && p.image_pixels_that_fit > 0) {
              PlanOptions again = p.options;
              again.max_image_pixels = p.image_pixels_that_fit;
              CHECK(plan_for(m, device, again).fits);
              again.max_image_pixels += 32 * 32;
              if (again.max_image_pixels <= m.config.max_pixels) CHECK_FALSE(plan_for(m, device, again).fits);
            }
            checked++;
          }
  CHECK(checked == 2 * 7 * 3 * 2 * 3);
}

TEST_CASE("every option error is invalid_argument and carries its value") {
  Model l = llama(), q = qwen();
  DeviceSpec card = planned_card(8 * GiB, false);
  auto error_of = [&](const Model& m, const PlanOptions& o, const DeviceSpec& d) -> Error {
    auto plan = make_plan(m.config, m.weights, d, o);
    REQUIRE_FALSE(plan.ok());
    CHECK(plan.error().code == ErrorCode::invalid_argument);
    return plan.error();
  };
  struct Case {
    const char* what;
    std::function<void(PlanOptions&)> set;
    bool vision;
    const char* needle;
  };
  std::vector<Case> cases = {
      {"utilization 0", [](PlanOptions& o) { o.utilization = 0; }, false, "utilization 0 "},
      {"utilization negative", [](PlanOptions& o) { o.utilization = -0.5; }, false, "utilization -0.5"},
      {"utilization over 1", [](PlanOptions& o) { o.utilization = 1.5; }, false, "utilization 1.5"},
      {"utilization NaN", [](PlanOptions& o) { o.utilization = std::nan(""); }, false, "utilization nan"},
      {"max_model_len negative", [](PlanOptions& o) { o.max_model_len = -5; }, false, "max_model_len -5"},
      {"max_model_len over the model", [](PlanOptions& o) { o.max_model_len = 131073; }, false, "131073"},
      {"max_seqs negative", [](PlanOptions& o) { o.max_seqs = -1; }, false, "max_seqs -1"},
      {"max_seqs huge", [](PlanOptions& o) { o.max_seqs = kMaxPlanSeqs + 1; }, false, "max_seqs 65537"},
      {"max_batched_tokens negative", [](PlanOptions& o) { o.max_batched_tokens = -3; }, false, "max_batched_tokens -3"},
      {"kv_page_tokens 0", [](PlanOptions& o) { o.kv_page_tokens = 0; }, false, "kv_page_tokens 0"},
      {"kv_page_tokens 1025", [](PlanOptions& o) { o.kv_page_tokens = 1025; }, false, "kv_page_tokens 1025"},
      {"max_images 0", [](PlanOptions& o) { o.max_images = 0; }, true, "max_images 0"},
      {"max_image_pixels negative", [](PlanOptions& o) { o.max_image_pixels = -7; }, true, "max_image_pixels -7"},
      {"max_image_pixels below a merge window", [](PlanOptions& o) { o.max_image_pixels = 1000; }, true, "1000"},
      {"max_image_pixels below min_pixels", [](PlanOptions& o) { o.max_image_pixels = 32768; }, true, "65536"},
      {"max_image_pixels huge", [](PlanOptions& o) { o.max_image_pixels = kMaxPlanImagePixels + 1024; }, true, "268436480"},
      {"max_image_pixels without a vision tower", [](PlanOptions& o) { o.max_image_pixels = 1048576; }, false, "no vision tower"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    PlanOptions o;
    c.set(o);
    Error e = error_of(c.vision ? q : l, o, card);
    CHECK_MESSAGE(contains(e.message, c.needle), e.message);
  }
  DeviceSpec empty = card;
  empty.total_bytes = 0;
  CHECK(contains(error_of(l, PlanOptions{}, empty).message, "--device-mem"));
  auto dtype = parse_kv_dtype("int8");
  REQUIRE_FALSE(dtype.ok());
  CHECK(dtype.error().code == ErrorCode::invalid_argument);
  CHECK(contains(dtype.error().message, "'int8'"));
  CHECK(parse_kv_dtype("fp8").value() == KVDType::fp8);
  CHECK(parse_kv_dtype("auto").value() == KVDType::auto_);
  CHECK(parse_kv_dtype("bf16").value() == KVDType::bf16);
  CHECK(parse_kv_dtype("f16").value() == KVDType::f16);
  CHECK(parse_kv_dtype("f32").value() == KVDType::f32);
}

TEST_CASE("activation buffers follow the config's shapes, bf16 on CUDA and fp32 on the CPU") {
  ModelConfig c = llama31_8b();
  const int64_t T = 2047, S = 7;  // odd on purpose
  auto gpu = activation_buffers(c, T, S, BackendKind::cuda);
  auto cpu = activation_buffers(c, T, S, BackendKind::cpu);
  auto rounded = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  CHECK(named(gpu, "hidden").bytes == rounded(uint64_t(T) * 4096 * 2));  // the residual in the activation dtype
  CHECK(named(gpu, "normed").bytes == rounded(uint64_t(T) * 4096 * 2));
  CHECK(named(gpu, "qkv").bytes == rounded(uint64_t(T) * (32 + 2 * 8) * 128 * 2));
  CHECK(named(gpu, "attn_out").bytes == rounded(uint64_t(T) * 32 * 128 * 2));
  CHECK(named(gpu, "gate_up").bytes == rounded(uint64_t(T) * 2 * 14336 * 2));
  CHECK(named(gpu, "mlp_act").bytes == rounded(uint64_t(T) * 14336 * 2));
  CHECK(named(gpu, "attn_partials").bytes == rounded(uint64_t(S) * 32 * 16 * (128 + 2) * 4));
  CHECK(named(gpu, "positions").bytes == rounded(uint64_t(T) * 4));
  CHECK(named(cpu, "qkv").bytes == rounded(uint64_t(T) * (32 + 2 * 8) * 128 * 4));
  CHECK(named(cpu, "hidden").bytes == 2 * named(gpu, "hidden").bytes);
  for (const auto& b : gpu) CHECK(b.bytes % kPlanAlignment == 0);
  CHECK(named(gpu, "rope_cos").bytes == rounded(uint64_t(T) * 64 * 4));
  // A GPU's attention batch has a spare sequence (CUDA graph padding) and its block tables on the device, sized
  // for the model's longest sequence (131072 tokens in pages of 16); the CPU reads the pool's tables in place.
  CHECK(named(gpu, "query_starts").bytes == rounded(uint64_t(S + 2) * 4));
  CHECK(named(gpu, "context_lens").bytes == rounded(uint64_t(S + 1) * 4));
  CHECK(named(gpu, "block_tables").bytes == rounded(uint64_t(S + 1) * (131072 / 16) * 4));
  CHECK(named(cpu, "query_starts").bytes == rounded(uint64_t(S + 1) * 4));
  CHECK(named(gpu, "logit_rows").bytes == rounded(uint64_t(T) * 4));
  CHECK(gpu.size() == 17);
  CHECK(cpu.size() == 16);
  // F32 activations on a GPU: every activation buffer twice the bf16 bytes, the index buffers the same.
  auto gpu32 = activation_buffers(c, T, S, DType::F32, block_table_pages(c, 16));
  CHECK(named(gpu32, "qkv").bytes == 2 * named(gpu, "qkv").bytes);
  CHECK(named(gpu32, "hidden").bytes == named(cpu, "hidden").bytes);
  CHECK(named(gpu32, "block_tables").bytes == named(gpu, "block_tables").bytes);
  // M-RoPE: three position rows per token.
  CHECK(named(activation_buffers(qwen3_vl_4b(), T, S, BackendKind::cuda), "positions").bytes == rounded(3 * uint64_t(T) * 4));
  // The planner's activations row is exactly their sum.
  Model l = llama();
  Plan p = plan_for(l, planned_card(8 * GiB, false), options_with(0.9, 4096));
  CHECK(p.item("activations")->bytes == buffers_bytes(activation_buffers(c, 2048, 8, BackendKind::cuda)));
  CHECK(p.item("logits")->bytes == buffers_bytes(logits_buffers(c, 8)));
}

TEST_CASE("vision buffers: a 1024 x 768 budget is 48 x 64 patches and 768 image tokens") {
  ModelConfig c = qwen3_vl_4b();
  auto buffers = vision_buffers(c, 1024 * 768, 1, BackendKind::cuda);
  const uint64_t patches = 48 * 64, tokens = 768;
  CHECK(named(buffers, "pixel_patches").bytes == patches * 1536 * 2);
  CHECK(named(buffers, "vision_hidden").bytes == patches * 1024 * 4);
  CHECK(named(buffers, "vision_qkv").bytes == patches * 3 * 1024 * 2);
  CHECK(named(buffers, "vision_mlp").bytes == patches * 4096 * 2);
  CHECK(named(buffers, "merger_in").bytes == tokens * 4 * 1024 * 2);
  CHECK(named(buffers, "merged").bytes == 4 * tokens * 2560 * 4);  // final merger + 3 DeepStack levels
  // A budget that is not a whole number of 32 x 32 windows plans the windows it holds; two images double it.
  CHECK(buffers_bytes(vision_buffers(c, 1024 * 768 + 1000, 1, BackendKind::cuda)) == buffers_bytes(buffers));
  CHECK(named(vision_buffers(c, 1024 * 768, 2, BackendKind::cuda), "merged").bytes == 2 * 4 * tokens * 2560 * 4);
  CHECK(vision_buffers(llama31_8b(), 1024 * 768, 1, BackendKind::cuda).empty());
  // The plan's default image budget is 1024 x 1024, not the processor's 16777216, and it says why.
  Model q = qwen();
  Plan p = plan_for(q, planned_card(24 * GiB, false), PlanOptions{});
  CHECK(p.options.max_image_pixels == 1024 * 1024);
  CHECK(contains(p.max_image_pixels_rule, "16,384 image tokens"));
  CHECK(p.item("vision")->bytes == buffers_bytes(vision_buffers(c, 1024 * 1024, 1, BackendKind::cuda)));
  CHECK(plan_for(llama(), planned_card(24 * GiB, false), PlanOptions{}).item("vision") == nullptr);
}

TEST_CASE("the image budget: tokens per image and what it costs, from the config's patch and merge sizes") {
  Model q = qwen();
  const VisionConfig& v = q.config.vision;
  const int64_t pixels_per_token = (v.patch_size * v.spatial_merge_size) * (v.patch_size * v.spatial_merge_size);
  REQUIRE(pixels_per_token == 1024);  // 16 x 2 pixels a side
  struct Case {
    int64_t pixels, images, tokens;
    const char* rule;  // the table's line
  };
  // 1024 x 1024 (the default) and 1024 x 768 hold whole 32 x 32 windows; 1000 pixels more hold none more;
  // 65536 is the processor's min_pixels (256 x 256).
  const Case cases[] = {
      {0, 1, 1024, "floor(1,048,576 pixels / 1,024 per token (patch x merge)^2) = 1,024 merged tokens from 4,096 patches"},
      {1024 * 768, 1, 768, "floor(786,432 pixels / 1,024 per token (patch x merge)^2) = 768 merged tokens from 3,072 patches"},
      {1024 * 768 + 1000, 2, 768, "floor(787,432 pixels / 1,024 per token (patch x merge)^2) = 768 merged tokens"},
      {65536, 3, 64, "floor(65,536 pixels / 1,024 per token (patch x merge)^2) = 64 merged tokens from 256 patches"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.pixels);
    PlanOptions o = options_with(0.9, 4096);
    o.max_image_pixels = c.pixels;
    o.max_images = c.images;
    Plan p = plan_for(q, planned_card(16 * GiB, false), o);
    const int64_t budget = p.options.max_image_pixels;
    CHECK(budget == (c.pixels ? c.pixels : 1024 * 1024));
    CHECK(p.image_pixels_per_token == pixels_per_token);
    CHECK(p.image_tokens_per_image == budget / pixels_per_token);
    CHECK(p.image_tokens_per_image == c.tokens);
    CHECK(p.image_patches_per_image == c.tokens * v.spatial_merge_size * v.spatial_merge_size);
    CHECK(p.vision_weights_bytes == q.weights.vision_bytes);
    CHECK(p.vision_activation_bytes == buffers_bytes(vision_buffers(q.config, budget, c.images, BackendKind::cuda)));
    CHECK(p.vision_activation_bytes == p.item("vision")->bytes);
    const std::string table = p.table();
    CHECK(contains(table, c.rule));
    CHECK(contains(table, std::to_string(c.images) + (c.images == 1 ? " image per request" : " images per request")));
    const size_t budget_row = table.find("\nimage budget ");
    REQUIRE(budget_row != std::string::npos);
    const std::string budget_line = table.substr(budget_row + 1, table.find('\n', budget_row + 1) - budget_row - 1);
    CHECK_MESSAGE(contains(budget_line, format_bytes(p.vision_activation_bytes + p.vision_weights_bytes) + "  what images cost"),
                  budget_line);
    CHECK(contains(budget_line, "encoder activations " + format_bytes(p.vision_activation_bytes)));
    CHECK(contains(table, "vision weights " + format_bytes(q.weights.vision_bytes) + " (in the weights row)"));
    CHECK(contains(p.item("weights")->why, "the vision tower " + format_bytes(q.weights.vision_bytes) + " of it"));
    auto j = nlohmann::json::parse(p.json());
    const auto& image_budget = j["image_budget"];
    REQUIRE(image_budget.is_object());
    CHECK(image_budget["max_image_pixels"].get<int64_t>() == budget);
    CHECK(image_budget["max_images"].get<int64_t>() == c.images);
    CHECK(image_budget["pixels_per_token"].get<int64_t>() == pixels_per_token);
    CHECK(image_budget["tokens_per_image"].get<int64_t>() == c.tokens);
    CHECK(image_budget["patches_per_image"].get<int64_t>() == 4 * c.tokens);
    CHECK(image_budget["encoder_activation_bytes"].get<uint64_t>() == p.vision_activation_bytes);
    CHECK(image_budget["vision_weights_bytes"].get<uint64_t>() == q.weights.vision_bytes);
  }
  // A text model has no image budget.
  Plan text = plan_for(llama(), planned_card(16 * GiB, false), options_with(0.9, 4096));
  CHECK(text.image_tokens_per_image == 0);
  CHECK(text.vision_weights_bytes == 0);
  CHECK_FALSE(contains(text.table(), "image tokens"));
  CHECK(nlohmann::json::parse(text.json())["image_budget"].is_null());
}

TEST_CASE("logits: 32 rows at a time for scoring, more when more sequences decode") {
  ModelConfig c = qwen3_vl_4b();
  CHECK(named(logits_buffers(c, 8), "logits").bytes == (32ull * 151936 * 4 + 255) / 256 * 256);
  CHECK(named(logits_buffers(c, 8), "sampling_probs").bytes == (8ull * 151936 * 4 + 255) / 256 * 256);
  CHECK(named(logits_buffers(c, 8), "sampling_order").bytes == (8ull * 151936 * 4 + 255) / 256 * 256);
  CHECK(named(logits_buffers(c, 100), "logits").bytes == (100ull * 151936 * 4 + 255) / 256 * 256);
}

TEST_CASE("CUDA-only rows (repack of quantized Linears, context, graphs) are zero on the CPU") {
  Model q = qwen();
  DeviceSpec card = planned_card(16 * GiB, false);
  Plan p = plan_for(q, card, options_with(0.9, 4096));
  // 128 x 128 blocks per layer: q 32x20, k 8x20, v 8x20, o 20x32, gate 76x20, up 76x20, down 20x76 = 6160.
  // The GPU layout of every quantized text Linear (cuda::quant_device_bytes, what upload_quant_weight fills) over
  // its bytes on disk; each layer's q|k|v and gate|up fused into one device Linear when they fuse (every model
  // here: quantized alike, whole 64-column tiles), as the uploader stores them.
  auto repack_for = [](const Model& m) {
    std::map<std::string, const LinearDesc*> by_name;
    for (const LinearDesc& linear : m.weights.linears)
      if (linear.format != WeightFormat::dense && !linear.vision) by_name[linear.name] = &linear;
    if (by_name.empty()) return uint64_t(0);  // a dense model
    uint64_t extra = 0;
    auto count = [&](const std::vector<const LinearDesc*>& parts) {
      uint64_t disk = 0;
      for (const LinearDesc* part : parts) disk += part->bytes;
      extra += std::max<uint64_t>(cuda::quant_device_bytes(parts), disk) - disk;
    };
    for (int64_t l = 0; l < m.config.text.num_layers; l++) {
      const std::string layer = m.config.text_prefix() + "layers." + std::to_string(l) + ".";
      auto part = [&](const char* name) {
        auto found = by_name.find(layer + name);
        REQUIRE(found != by_name.end());
        return found->second;
      };
      const std::vector<const LinearDesc*> qkv = {part("self_attn.q_proj"), part("self_attn.k_proj"),
                                                  part("self_attn.v_proj")};
      const std::vector<const LinearDesc*> gate_up = {part("mlp.gate_proj"), part("mlp.up_proj")};
      REQUIRE(cuda::quant_fusion_refusal(qkv) == "");
      REQUIRE(cuda::quant_fusion_refusal(gate_up) == "");
      count(qkv);
      count(gate_up);
      count({part("self_attn.o_proj")});
      count({part("mlp.down_proj")});
    }
    return (extra + 255) / 256 * 256;
  };
  // What the Linears one at a time would take: fusing never needs more.
  auto unfused_repack_for = [](const Model& m) {
    uint64_t extra = 0;
    for (const LinearDesc& linear : m.weights.linears)
      if (linear.format != WeightFormat::dense && !linear.vision)
        extra += std::max<uint64_t>(cuda::quant_device_bytes(linear), linear.bytes) - linear.bytes;
    return (extra + 255) / 256 * 256;
  };
  CHECK(p.item("repack")->bytes == repack_for(q));
  CHECK(p.item("repack")->bytes <= unfused_repack_for(q));
  CHECK(p.item("repack")->why.find("groups fused") != std::string::npos);
  CHECK(p.item("repack")->bytes > 0);
  Model q32 = q;
  for (auto& linear : q32.weights.linears) linear.scale_dtype = DType::F32;
  CHECK(plan_for(q32, card, options_with(0.9, 4096)).item("repack")->bytes == repack_for(q32));
  CHECK(plan_for(llama(), card, options_with(0.9, 4096)).item("repack")->bytes == repack_for(llama()));
  // A planned card's context: 260 MiB + the RTX 4060 Ti's 34 SMs x 1,536 threads x 1 KiB of stack + 68 MiB.
  CHECK(p.item("context")->bytes == 260 * MiB + 34 * 1536 * KiB + 68 * MiB);
  // A queried GPU's own SMs: the H100 the constants were measured on (132 x 2,048) comes to the 524 MiB bare
  // context measured there, plus the 68 MiB.
  DeviceSpec h100 = card;
  h100.multiprocessors = 132;
  h100.threads_per_multiprocessor = 2048;
  CHECK(plan_for(q, h100, options_with(0.9, 4096)).item("context")->bytes == 524 * MiB + 68 * MiB);
  CHECK(cuda_context_bytes(h100) == 592 * MiB);
  // Graph pool: 2 MiB + 64 KiB per layer per decode bucket, in whole 2 MiB.
  auto graphs = [&](int64_t seqs) {
    PlanOptions o = options_with(0.9, 4096);
    o.max_seqs = seqs;
    return plan_for(q, card, o).item("graphs")->bytes;
  };
  const uint64_t layers = uint64_t(q.config.text.num_layers);
  auto expected_graphs = [&](uint64_t buckets) {
    return (2 * MiB + 64 * KiB * layers * buckets + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
  };
  CHECK(graphs(1) == expected_graphs(1));    // 1
  CHECK(graphs(6) == expected_graphs(4));    // 1,2,4,6
  CHECK(graphs(8) == expected_graphs(4));    // 1,2,4,8
  CHECK(graphs(9) == expected_graphs(5));    // 1,2,4,8,9
  CHECK(graphs(256) == expected_graphs(9));  // 1..256: 9 buckets
  CHECK(graphs(8) % (2 * MiB) == 0);
  // Workspace: the CUDA backend's (cuBLAS workspace + attention scratch, the same constants the backend carves)
  // + the largest quantized Linear (the bf16 lm_head is used as stored, never repacked).
  Model l = llama();
  uint64_t gate = 14336ull * 4096 / 2 + 14336ull * 32 * 2 + 16;
  const uint64_t workspace = plan_for(l, card, options_with(0.9, 4096)).item("workspace")->bytes;
  CHECK(workspace == (kCudaWorkspaceBytes + gate + 255) / 256 * 256);
  CHECK(kCudaWorkspaceBytes == 64 * MiB);
  cuda::CudaWorkspaceLayout layout;
  REQUIRE(cuda::cuda_workspace_layout(workspace, kCudaCublasWorkspaceBytes, &layout));
  CHECK(layout.scratch_bytes >= kCudaScratchBytes);
  // The decode graphs' memory is the driver's, outside the arena.
  CHECK_FALSE(p.item("graphs")->in_arena);

  DeviceSpec cpu;
  cpu.name = "CPU";
  cpu.total_bytes = 64 * GiB;
  Plan c = plan_for(q, cpu, options_with(0.9, 4096));
  CHECK(c.item("repack")->bytes == 0);
  CHECK(c.item("context")->bytes == 0);
  CHECK(c.item("graphs")->bytes == 0);
  // The CPU backend's scratch, from the model's shapes (as make_cpu_backend sizes it): per thread (2 + 8) x
  // head_dim attention floats in whole 64-byte lines and 16 dequantized rows of the widest quantized Linear's K;
  // one 64-token chunk of K floats more when activations are 16-bit (widened for quant_linear).
  int64_t widest = 1;
  for (const LinearDesc& d : q.weights.linears)
    if (d.format != WeightFormat::dense) widest = std::max(widest, d.in_features);
  const int64_t head_dim = std::max(q.config.text.head_dim, q.config.vision.hidden_size / q.config.vision.num_heads);
  auto scratch = [&](uint64_t threads, bool widened) {
    const uint64_t per_thread = (uint64_t(10 * head_dim + 15) / 16 * 16 + 16 * uint64_t(widest)) * 4;
    return (threads * per_thread + (widened ? 64 * uint64_t(widest) * 4 : 0) + 255) / 256 * 256;
  };
  CHECK(widest > 1);
  CHECK(c.item("workspace")->bytes == scratch(std::max(1u, std::thread::hardware_concurrency()), false));
  DeviceSpec three_threads = cpu;
  three_threads.cpu_threads = 3;  // EngineOptions::threads
  CHECK(plan_for(q, three_threads, options_with(0.9, 4096)).item("workspace")->bytes == scratch(3, false));
  PlanOptions bf16 = options_with(0.9, 4096);
  bf16.activation_dtype = DType::BF16;
  const Plan b = plan_for(q, three_threads, bf16);
  CHECK(b.item("workspace")->bytes == scratch(3, true));
  CHECK(b.item("workspace")->why.find("3 threads (--threads)") != std::string::npos);
  CHECK(c.item("activations")->bytes > p.item("activations")->bytes);  // fp32 on the CPU
  // KV auto is f32 on the CPU (the reference matches transformers' float32): twice the bf16 bytes.
  CHECK(c.options.kv_dtype == KVDType::f32);
  CHECK(c.kv_bytes_per_token == 2 * 147456);
}

TEST_CASE("--wsl2 overrides the device's detection") {
  Model q = qwen();
  PlanOptions o = options_with(0.8, 4096);
  o.wsl2 = true;
  Plan forced = plan_for(q, planned_card(8 * GiB, false), o);
  CHECK(forced.device.wsl2);
  CHECK(forced.options.wsl2 == std::optional<bool>(true));
  CHECK(forced.item("context")->bytes == 1024 * MiB);
  o.wsl2 = false;
  CHECK(plan_for(q, planned_card(8 * GiB, true), o).item("context")->bytes == 260 * MiB + 34 * 1536 * KiB + 68 * MiB);
}

TEST_CASE("weights estimated from config.json say so") {
  Model l = llama();
  l.weights.exact = false;
  Plan p = plan_for(l, planned_card(8 * GiB, false), options_with(0.9, 2048));
  CHECK(p.weights_source == "config");
  CHECK(contains(p.item("weights")->label, "estimated from config.json"));
  CHECK(p.weights_bytes == l.weights.total_bytes);
  Plan exact = plan_for(llama(), planned_card(8 * GiB, false), options_with(0.9, 2048));
  CHECK(exact.weights_source == "headers");
  CHECK(contains(exact.item("weights")->label, "exact"));
  // On the GPU: as stored (int4 Linears and a bf16 lm_head need no conversion), plus room to start each text
  // tensor on a 256-byte boundary (at most 4 + 18 per layer).
  CHECK(exact.item("weights")->bytes == (l.weights.total_bytes + 256 * (4 + 18 * 32) + 255) / 256 * 256);
}

TEST_CASE("json: every key present, byte counts are integers") {
  Model q = qwen();
  for (double utilization : {0.70, 0.95}) {
    Plan p = plan_for(q, planned_card(8 * GiB, true), options_with(utilization, 4096));
    auto j = nlohmann::json::parse(p.json());
    for (const char* key : {"weights_bytes", "kv_bytes_per_token", "kv_page_tokens", "kv_page_bytes", "kv_arena_bytes",
                            "kv_tokens", "kv_pages", "budget_bytes", "fixed_bytes", "arena_bytes", "max_model_len",
                            "max_model_len_that_fits", "max_model_len_that_fits_fp8_kv", "image_pixels_that_fit",
                            "kv_available_bytes", "shortfall_bytes"}) {
      CAPTURE(key);
      REQUIRE(j.contains(key));
      CHECK(j[key].is_number_integer());
    }
    CHECK(j["weights_source"] == "headers");
    CHECK(j["fits"].is_boolean());
    CHECK(j["fits"].get<bool>() == p.fits);
    CHECK(j["utilization_needed"].is_number());
    CHECK(j["kv_bytes_per_token"].get<uint64_t>() == 147456);
    CHECK(j["budget_bytes"].get<uint64_t>() == p.budget_bytes);
    CHECK(j["kv_available_bytes"].get<int64_t>() == p.kv_available_bytes);
    REQUIRE(j["items"].is_array());
    CHECK(j["items"].size() == p.items.size());
    for (const auto& item : j["items"]) {
      CHECK(item["bytes"].is_number_integer());
      CHECK(item["key"].is_string());
      CHECK(item["why"].is_string());
    }
    CHECK(j["device"]["total_bytes"].get<uint64_t>() == 8 * GiB);
    CHECK(j["device"]["wsl2"].get<bool>());
    CHECK(j["options"]["max_model_len"].get<int64_t>() == 4096);
    CHECK(j["options"]["kv_dtype"] == "bf16");
    CHECK(j["advice"].is_array());
    CHECK(j["advice"].size() == p.advice.size());
  }
}

TEST_CASE("svg: one standalone document with red overflow only when it does not fit") {
  Model q = qwen();
  Plan fits = plan_for(q, planned_card(16 * GiB, false), options_with(0.9, 4096));
  Plan short_of = plan_for(q, planned_card(8 * GiB, true), options_with(0.8, 4096));
  REQUIRE(fits.fits);
  REQUIRE_FALSE(short_of.fits);
  for (const Plan* p : {&fits, &short_of}) {
    std::string svg = p->svg();
    CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
    CHECK(svg.size() > 7);
    CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
    // Every element closes: as many opening tags as closing ones and self-closed ones.
    size_t opened = 0, closed = 0;
    for (size_t i = 0; i + 1 < svg.size(); i++) {
      if (svg[i] == '<' && svg[i + 1] != '/') opened++;
      if (svg[i] == '<' && svg[i + 1] == '/') closed++;
      if (svg[i] == '/' && svg[i + 1] == '>') closed++;
    }
    CHECK(opened == closed);
    CHECK(contains(svg, "budget " + format_bytes(p->budget_bytes)));
    for (const auto& item : p->items)
      if (item.bytes) CHECK(contains(svg, item.label));
  }
  CHECK(contains(fits.svg(), "KV arena"));
  CHECK_FALSE(contains(fits.svg(), "#e15759"));
  CHECK(contains(short_of.svg(), "#e15759"));
  CHECK(contains(short_of.svg(), "short by " + format_bytes(uint64_t(short_of.shortfall_bytes))));
}

TEST_CASE("table: header, one row per item, budget, KV arena, verdict and advice") {
  Model q = qwen();
  Plan p = plan_for(q, planned_card(8 * GiB, true), options_with(0.80, 4096));
  std::string t = p.table();
  CHECK(contains(t, "model Qwen3-VL-4B-Instruct-FP8 (qwen3_vl) | device planned 8.00 GiB card | WSL2 yes | backend cuda"));
  for (const auto& item : p.items) CHECK(contains(t, item.label));
  CHECK(contains(t, "budget = 0.80 x 8.00 GiB = 6.40 GiB"));
  CHECK(contains(t, "144.0 KiB per token (bf16)"));
  CHECK(contains(t, "DOES NOT FIT"));
  CHECK(contains(t, "short by " + format_bytes(uint64_t(p.shortfall_bytes))));
  for (const auto& line : p.advice) CHECK(contains(t, line));
  Plan ok = plan_for(q, planned_card(16 * GiB, false), options_with(0.9, 4096));
  CHECK(contains(ok.table(), "FITS"));
  CHECK_FALSE(contains(ok.table(), "DOES NOT FIT"));
}

TEST_CASE("planning's what-fits searches assemble a few dozen candidate layouts, not one per length or pixel") {
  // The searches (max_model_len halved from the default, the fp8-KV answer, the image budget's and --spec-tokens'
  // binary searches, the advice's trials) must stay logarithmic in what they search: a linear scan over lengths
  // or image windows would assemble thousands. Counted, not timed (the time is printed for the record).
  Model q = qwen(), l = llama();
  DeviceSpec card = planned_card(8 * GiB, true);
  int64_t most = 0;
  const auto start = std::chrono::steady_clock::now();
  const int plans = 50;
  for (int i = 0; i < plans; i++)
    for (const Model* m : {&q, &l})
      for (int64_t length : {int64_t(0), int64_t(1024 + 64 * i), int64_t(131072)}) {  // 0: the default rule
        const Plan plan = plan_for(*m, card, options_with(0.5 + 0.01 * i, length));
        CHECK(plan.layouts_assembled >= 1);
        most = std::max(most, plan.layouts_assembled);
      }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("most layouts one plan assembled: " << most << "; " << ms / (plans * 6) << " ms a plan");
  CHECK(most <= 48);
}

// ---- the shipped configs under models/ (config.json only: weights estimated) ------------------------------

namespace {
const std::string kShippedQwenVL = std::string(KVLITE_SOURCE_DIR) + "/models/qwen3-vl-4b-instruct-fp8";
const std::string kShippedLlama = std::string(KVLITE_SOURCE_DIR) + "/models/llama-3.1-8b-instruct-w4a16";
const std::string kShippedQwen = std::string(KVLITE_SOURCE_DIR) + "/models/qwen3-4b";

PlanInputs shipped(const std::string& dir) {
  auto inputs = read_plan_inputs(dir);
  REQUIRE_MESSAGE(inputs.ok(), inputs.error().message);
  return *inputs;
}
Plan plan_for(const PlanInputs& inputs, const DeviceSpec& device, const PlanOptions& options) {
  auto plan = make_plan(inputs, device, options);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  return *plan;
}
}  // namespace

TEST_CASE("the hand-built reference models agree with the shipped config.json files") {
  for (const auto& pair : {std::make_pair(llama31_8b(), kShippedLlama), std::make_pair(qwen3_vl_4b(), kShippedQwenVL)}) {
    const ModelConfig& hand = pair.first;
    ModelConfig parsed = shipped(pair.second).config;
    CAPTURE(pair.second);
    CHECK(parsed.arch == hand.arch);
    CHECK(parsed.text.hidden_size == hand.text.hidden_size);
    CHECK(parsed.text.intermediate_size == hand.text.intermediate_size);
    CHECK(parsed.text.num_layers == hand.text.num_layers);
    CHECK(parsed.text.num_heads == hand.text.num_heads);
    CHECK(parsed.text.num_kv_heads == hand.text.num_kv_heads);
    CHECK(parsed.text.head_dim == hand.text.head_dim);
    CHECK(parsed.text.vocab_size == hand.text.vocab_size);
    CHECK(parsed.text.max_position_embeddings == hand.text.max_position_embeddings);
    CHECK(parsed.text.tie_word_embeddings == hand.text.tie_word_embeddings);
    CHECK(parsed.vision.present == hand.vision.present);
    CHECK(parsed.vision.hidden_size == hand.vision.hidden_size);
    CHECK(parsed.vision.intermediate_size == hand.vision.intermediate_size);
    CHECK(parsed.vision.out_hidden_size == hand.vision.out_hidden_size);
    CHECK(parsed.vision.deepstack_visual_indexes == hand.vision.deepstack_visual_indexes);
    CHECK(parsed.min_pixels == hand.min_pixels);
    CHECK(parsed.max_pixels == hand.max_pixels);
  }
  // W4A16 bytes estimated from config.json are the hand-counted bytes of the checkpoint's tensors.
  PlanInputs llama_inputs = shipped(kShippedLlama);
  CHECK_FALSE(llama_inputs.weights.exact);
  CHECK(llama_inputs.weights.total_bytes == llama31_8b_w4a16(llama31_8b()).total_bytes);
}

TEST_CASE("shipped Qwen3-VL-4B FP8 on an 8 GiB card: WSL2 at 0.82 x 4096 and 0.70 x 2048 do not fit, native 0.82 does") {
  PlanInputs q = shipped(kShippedQwenVL);
  DeviceSpec wsl2 = planned_card(8 * GiB, true);
  Plan a = plan_for(q, wsl2, options_with(0.82, 4096));
  CHECK(a.weights_source == "config");
  CHECK(a.kv_bytes_per_token == 147456);
  CHECK_FALSE(a.fits);
  CHECK(a.shortfall_bytes == int64_t(576 * MiB) - a.kv_available_bytes);
  REQUIRE(a.utilization_needed <= 1.0);
  CHECK(plan_for(q, wsl2, options_with(a.utilization_needed, 4096)).fits);
  if (a.max_model_len_that_fits > 0) CHECK(plan_for(q, wsl2, options_with(0.82, a.max_model_len_that_fits)).fits);

  Plan b = plan_for(q, wsl2, options_with(0.70, 2048));
  CHECK_FALSE(b.fits);
  CHECK(b.kv_available_bytes < 0);  // less budget than the fixed items: no context length helps
  CHECK(b.max_model_len_that_fits == 0);
  CHECK(plan_for(q, wsl2, options_with(b.utilization_needed, 2048)).fits);

  // The 645 MiB WSL2 costs are the difference: native Linux fits 4096 at the same ratio.
  Plan native = plan_for(q, planned_card(8 * GiB, false), options_with(0.82, 4096));
  CHECK(native.fits);
  CHECK(native.kv_available_bytes - a.kv_available_bytes ==
        int64_t(1024 * MiB - cuda_context_bytes(planned_card(8 * GiB, false))));
}

TEST_CASE("shipped Llama-3.1-8B W4A16 perplexity on 8 GiB: 2048 fits, 131072 needs 16 GiB of KV and cannot") {
  PlanInputs l = shipped(kShippedLlama);
  DeviceSpec card = planned_card(8 * GiB, false);
  Plan short_context = plan_for(l, card, options_with(0.90, 2048));
  CHECK(short_context.fits);
  CHECK(short_context.kv_bytes_per_token == 131072);
  Plan full = plan_for(l, card, options_with(0.90, 131072));
  CHECK_FALSE(full.fits);
  CHECK(full.shortfall_bytes == int64_t(16 * GiB) - full.kv_available_bytes);
  CHECK(full.utilization_needed > 1.0);
  REQUIRE(full.max_model_len_that_fits >= 2048);
  CHECK(plan_for(l, card, options_with(0.90, full.max_model_len_that_fits)).fits);
}

// Regression (issue 15, defect 1): the utilization search never ended once the need passed 2 x the card.
TEST_CASE("regression: the planner hung when the needed utilization was above 2") {
  PlanInputs l = shipped(kShippedLlama);
  for (uint64_t card_bytes : {3 * GiB, 1 * GiB, 64 * MiB, 1 * MiB}) {
    Plan p = plan_for(l, planned_card(card_bytes, false), options_with(0.90, 4096));
    CHECK_FALSE(p.fits);
    CHECK(p.utilization_needed > 2.0);
    // the smallest utilization that holds everything: its budget holds the need, one step less does not
    uint64_t needed = uint64_t(int64_t(p.fixed_bytes) + p.shortfall_bytes + p.kv_available_bytes);  // fixed + KV
    CHECK(uint64_t(std::floor((long double)p.utilization_needed * card_bytes)) >= needed);
    CHECK(uint64_t(std::floor((long double)std::nextafter(p.utilization_needed, 0.0) * card_bytes)) < needed);
  }
}

TEST_CASE("plan_engine for a planned CUDA card is read_plan_inputs + detect_device + make_plan") {
  EngineOptions o;
  o.backend = BackendChoice::cuda;
  o.plan = options_with(0.8, 4096);
  o.plan.device_mem = 8 * GiB;
  o.plan.wsl2 = true;
  auto direct = plan_engine(kShippedQwenVL, o);
  REQUIRE_MESSAGE(direct.ok(), direct.error().message);
  CHECK(direct->model_name == "qwen3-vl-4b-instruct-fp8");
  CHECK(direct->device.backend == BackendKind::cuda);
  CHECK(direct->device.total_bytes == 8 * GiB);
  CHECK_FALSE(direct->backend_rule.empty());
  std::string why;
  auto device = detect_device(o.backend, o.device, o.plan.device_mem, o.plan.wsl2, &why);
  REQUIRE(device.ok());
  CHECK(why == direct->backend_rule);
  Plan by_hand = plan_for(shipped(kShippedQwenVL), *device, o.plan);
  by_hand.backend_rule = why;
  CHECK(direct->prefix_caching == std::optional<bool>(false));  // the engine's rule for CUDA
  by_hand.prefix_caching = direct->prefix_caching;
  CHECK(direct->json() == by_hand.json());
  auto missing = plan_engine("/nonexistent/kvlite-model", o);
  REQUIRE_FALSE(missing.ok());
  CHECK(contains(missing.error().message, "/nonexistent/kvlite-model"));
}

TEST_CASE("activation dtype: the CPU's F32, CUDA's model dtype by default, or another on request") {
  const std::string fixtures = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/";
  PlanInputs bf16 = shipped(fixtures + "tiny-llama3"), f16 = shipped(fixtures + "tiny-qwen3");
  DeviceSpec card = planned_card(1 * GiB, false);
  DeviceSpec cpu;
  cpu.name = "CPU";
  cpu.total_bytes = 1 * GiB;
  CHECK(plan_for(bf16, card, PlanOptions{}).options.activation_dtype == std::optional<DType>(DType::BF16));
  CHECK(plan_for(f16, card, PlanOptions{}).options.activation_dtype == std::optional<DType>(DType::F16));
  CHECK(plan_for(bf16, cpu, PlanOptions{}).options.activation_dtype == std::optional<DType>(DType::F32));
  PlanOptions f32;
  f32.activation_dtype = DType::F32;
  Plan wide = plan_for(bf16, card, f32), narrow = plan_for(bf16, card, PlanOptions{});
  CHECK(wide.item("activations")->bytes > narrow.item("activations")->bytes);
  CHECK(nlohmann::json::parse(wide.json())["options"]["activation_dtype"] == "F32");
  // The CPU runs BF16 / F16 too (the GPU's rounding): its activation buffers shrink, KV auto follows.
  PlanOptions half = f32;
  half.activation_dtype = DType::BF16;
  Plan cpu_half = plan_for(bf16, cpu, half), cpu_wide = plan_for(bf16, cpu, PlanOptions{});
  CHECK(cpu_half.options.activation_dtype == std::optional<DType>(DType::BF16));
  CHECK(cpu_half.options.kv_dtype == KVDType::bf16);
  CHECK(cpu_wide.options.kv_dtype == KVDType::f32);
  CHECK(cpu_half.item("activations")->bytes < cpu_wide.item("activations")->bytes);
  PlanOptions bad = f32;
  bad.activation_dtype = DType::I32;
  CHECK_FALSE(make_plan(bf16, card, bad));
  auto refused = make_plan(bf16, cpu, bad);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(contains(refused.error().message, "BF16, F16 or F32"));
}

// What the GPU uploader stores of a checkpoint, counted from its headers: dense Linears (weight and bias) in the
// activation dtype, everything else as stored, a converted copy of a tied table not in that dtype; each tensor
// at a 256-byte boundary, but a layer's q|k|v and gate|up weights (and biases) stacked into one tensor each (the
// dense fixtures' groups all fuse: biases in every part or none).
uint64_t device_weight_bytes(const std::string& dir, DType act) {
  auto store = TensorStore::open_dir(dir);
  REQUIRE(store);
  auto config = load_config(dir);
  REQUIRE(config);
  uint64_t total = 0;
  const uint64_t act_bytes = dtype_bytes(act, 1);
  std::map<std::string, uint64_t> stacked;  // "layers.N.self_attn.qkv.weight" -> bytes
  for (const TensorInfo& t : store->tensors()) {
    const bool linear = t.name.find("_proj.") != std::string::npos || t.name.rfind("lm_head.", 0) == 0;
    uint64_t elements = 1;
    for (int64_t d : t.shape) elements *= uint64_t(d);
    const uint64_t bytes = linear ? elements * act_bytes : t.nbytes;
    std::string group = t.name;
    for (const char* part : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}) {
      const size_t at = group.find(part);
      if (at != std::string::npos) group.replace(at, strlen(part), part[0] == 'g' || part[0] == 'u' ? "gate_up" : "qkv");
    }
    if (group != t.name) stacked[group] += bytes;
    else total += align_up(bytes, 256);
  }
  for (const auto& entry : stacked) total += align_up(entry.second, 256);
  const TensorInfo* table = store->find("model.embed_tokens.weight");
  REQUIRE(table != nullptr);
  if (config->text.tie_word_embeddings && table->dtype != act) total += align_up(table->nbytes / dtype_bytes(table->dtype, 1) * act_bytes, 256);
  return total;
}

TEST_CASE("a CUDA plan's weights region holds the checkpoint as the GPU stores it") {
  const std::string fixtures = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/";
  for (const char* name : {"tiny-llama3", "tiny-qwen2", "tiny-qwen3"}) {
    for (DType act : {DType::BF16, DType::F16, DType::F32}) {
      CAPTURE(name);
      CAPTURE(dtype_name(act));
      PlanInputs inputs = shipped(fixtures + name);
      PlanOptions o;
      o.activation_dtype = act;
      Plan p = plan_for(inputs, planned_card(1 * GiB, false), o);
      const uint64_t needed = device_weight_bytes(fixtures + name, act);
      const uint64_t planned = p.item("weights")->bytes;
      CHECK(planned >= needed);
      // not more than the alignment room it may not use: 256 bytes per tensor it could hold
      CHECK(planned - needed <= 256 * (4 + 18 * uint64_t(inputs.config.text.num_layers)) + 255);
      CHECK(p.item("weights")->in_arena);
      CHECK(p.upload_chunk_bytes == kCudaUploadChunkBytes);
    }
  }
}

// Issue 14: advice only what the engine can do, and never what the model already is.
TEST_CASE("advice: no KV dtype the backends cannot store, no quantizing an already quantized model") {
  // kv_dtype_storable is what the backends say: the CPU backend's supports() for every KV dtype
  auto cpu = make_cpu_backend();
  REQUIRE(cpu.ok());
  const std::vector<std::pair<KVDType, DType>> dtypes = {
      {KVDType::f32, DType::F32}, {KVDType::bf16, DType::BF16}, {KVDType::f16, DType::F16}, {KVDType::fp8, DType::F8_E4M3}};
  for (const auto& kv : dtypes) {
    CAPTURE(kv_dtype_name(kv.first));
    const bool stored = (*cpu)->supports(Op::kv_write, kv.second) && (*cpu)->supports(Op::attention, kv.second);
    CHECK(kv_dtype_storable(BackendKind::cpu, kv.first) == stored);
  }
  PlanInputs llama = shipped(kShippedLlama);  // W4A16
  Plan small = plan_for(llama, planned_card(3 * GiB, false), options_with(0.90, 4096));
  REQUIRE_FALSE(small.fits);
  bool already = false;
  for (const std::string& line : small.advice) {
    CAPTURE(line);
    CHECK(line.find("use a quantized checkpoint") == std::string::npos);
    CHECK((line.find("--kv-dtype fp8") == std::string::npos || kv_dtype_storable(BackendKind::cuda, KVDType::fp8)));
    already = already || line.find("already quantized") != std::string::npos;
  }
  CHECK(already);
  PlanInputs dense = shipped(kShippedQwen);  // BF16
  Plan dense_small = plan_for(dense, planned_card(4 * GiB, false), options_with(0.90, 4096));
  REQUIRE_FALSE(dense_small.fits);
  bool suggested = false;
  for (const std::string& line : dense_small.advice) suggested = suggested || line.find("use a quantized checkpoint") != std::string::npos;
  CHECK(suggested);
}
