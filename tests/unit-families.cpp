// families: Mistral, Qwen2 with use_sliding_window, Phi-3, Gemma-2 and Gemma-3 (text) against transformers'
// float32 outputs for the tiny random models of tests/fixtures/families (tools/make_family_fixtures.py): logits
// in one prefill, in chunks that cross the sliding window's edge and token by token, greedy continuations; and
// the BlockTraits config.json gives each family.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

// max |kvlite - transformers| / max |transformers| over a prompt's logits (F32 CPU).
constexpr double kLogitsTolerance = 1e-4;

const std::vector<std::string>& families() {
  // gemma3_text-linear: linear RoPE scaling on the global layers, the local ones on rope_local_base_freq;
  // phi3-partial: partial_rotary_factor 0.75 (Phi3's default RoPE rotates 12 of 16 dims)
  static const std::vector<std::string> list = {"mistral",     "qwen2-swa",          "phi3",
                                                "gemma2",      "gemma3_text",        "gemma3_text-linear",
                                                "phi3-partial"};
  return list;
}

std::string family_dir(const std::string& name) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/families/" + name;
}

nlohmann::json family_reference(const std::string& name) {
  return nlohmann::json::parse(fx::read_file(family_dir(name) + "/reference.json"));
}

std::unique_ptr<Engine> open_family(const std::string& name, EngineOptions options = {}) {
  if (!options.plan.device_mem) options.plan.device_mem = 64 * MiB;
  auto engine = Engine::open(family_dir(name), options);
  if (!engine) throw std::runtime_error("open " + name + ": " + engine.error().message);
  return std::move(*engine);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0;
  for (size_t i = 0; i < b.size(); i++) diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
  return diff;
}

// Every prompt's logits through `engine` against transformers' one forward (or the file `logits_key` names).
void check_logits(Engine& engine, const std::string& name, const char* logits_key = "logits_file") {
  const nlohmann::json reference = family_reference(name);
  for (size_t k = 0; k < reference["prompts"].size(); k++) {
    const auto& prompt = reference["prompts"][k];
    CAPTURE(k);
    fx::Npy expected = fx::read_npy(family_dir(name) + "/" + prompt[logits_key].get<std::string>());
    auto logits = engine.logits(fx::ids_of(prompt["input_ids"]));
    REQUIRE_MESSAGE(logits, logits.error().message);
    REQUIRE(logits->tokens == expected.rows);
    REQUIRE(logits->vocab == expected.cols);
    const double relative = fx::relative_max_diff(logits->values, expected.values);
    MESSAGE(name << " prompt " << k << " (" << expected.rows << " tokens): max |diff| "
                 << max_abs_diff(logits->values, expected.values) << ", relative " << relative);
    CHECK(relative <= kLogitsTolerance);
  }
}

}  // namespace

TEST_CASE("each family's logits match transformers in float32, in one prefill") {
  for (const std::string& name : families()) {
    CAPTURE(name);
    auto engine = open_family(name);
    check_logits(*engine, name);
  }
}

TEST_CASE("each family's logits match transformers with chunked prefill across the window edge") {
  // Chunks of 3 tokens: the window of 8 starts inside an earlier chunk, so each chunk's queries read keys
  // of two earlier steps from the pages and must drop the ones that slid out.
  for (const std::string& name : families()) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.max_batched_tokens = 3;
    options.threads = 1;
    auto engine = open_family(name, options);
    check_logits(*engine, name);
  }
}

TEST_CASE("each family's logits match transformers token by token") {
  for (const std::string& name : families()) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.max_batched_tokens = 1;
    auto engine = open_family(name, options);
    check_logits(*engine, name);
  }
}

TEST_CASE("each family's greedy continuations equal transformers' generate()") {
  for (const std::string& name : families()) {
    CAPTURE(name);
    for (int64_t chunk : {int64_t(0), int64_t(5)}) {  // one prefill step, or chunks of 5
      CAPTURE(chunk);
      EngineOptions options;
      options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
      if (chunk) options.plan.max_batched_tokens = chunk;
      auto engine = open_family(name, options);
      const nlohmann::json reference = family_reference(name);
      for (const auto& prompt : reference["prompts"]) {
        const auto& greedy = prompt["greedy"];
        SamplingParams params;  // temperature 0: greedy
        params.max_tokens = greedy["max_new_tokens"].get<int64_t>();
        auto generation = engine->generate(fx::ids_of(prompt["input_ids"]), params);
        REQUIRE_MESSAGE(generation, generation.error().message);
        CHECK(generation->ids == fx::ids_of(greedy["new_ids"]));
      }
    }
  }
}

// The windows-in-memory cases: the CPU reference, pages of 4 tokens (so pages leave a window of 8 within the
// fixtures' 40-token prompt), sequences of up to 64 tokens, 2 at once, steps of `chunk` tokens.
EngineOptions window_options(int64_t chunk) {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;
  options.plan.kv_page_tokens = 4;
  options.plan.max_model_len = 64;
  options.plan.max_batched_tokens = chunk;
  options.plan.max_seqs = 2;
  return options;
}

// The families whose sliding layers sit beside full-attention ones: their windows get pages of their own.
const std::vector<std::string>& mixed_families() {
  static const std::vector<std::string> list = {"qwen2-swa", "gemma2", "gemma3_text"};
  return list;
}

TEST_CASE("sliding layers keep only their windows in memory: pages go back as keys leave, logits stay transformers'") {
  // Pages of 4 tokens, window 8: a query sees keys from 7 before it, so at rest a sequence needs the pages of its
  // last 7 keys and its next one: at most ceil(7 / 4) + 1 = 3 pages, while a step of n tokens adds ceil(n / 4).
  for (const std::string& name : mixed_families()) {
    CAPTURE(name);
    for (int64_t chunk : {int64_t(1), int64_t(5), int64_t(64)}) {  // token by token, chunks across the edge, one step
      CAPTURE(chunk);
      auto engine = open_family(name, window_options(chunk));
      const Plan& plan = engine->plan();
      const int64_t window = 8, page = 4;
      REQUIRE(plan.kv_window == uint64_t(window));
      const nlohmann::json config = nlohmann::json::parse(fx::read_file(family_dir(name) + "/config.json"));
      int64_t sliding = 0;
      for (const auto& kind : config["layer_types"]) sliding += kind == "sliding_attention";
      const int64_t layers = config["num_hidden_layers"].get<int64_t>();
      // f32 KV: 2 x kv_heads x head_dim x 4 bytes a layer and token, split by layer kind
      const uint64_t per_layer = plan.kv_bytes_per_token / uint64_t(layers - sliding);
      CHECK(plan.kv_window_bytes_per_token == per_layer * uint64_t(sliding));
      // the windows of 2 sequences and one step's tokens, never more than 2 x 64 tokens' pages
      CHECK(plan.kv_window_pages == std::min<uint64_t>(2 * (2 + 2) + uint64_t((chunk + 3) / 4), 2 * 16));
      const Arena& arena = engine->arena();
      REQUIRE(arena.kv_window() != nullptr);
      CHECK(arena.region("kv_window")->bytes == plan.kv_window_pages * plan.kv_window_page_bytes);
      check_logits(*engine, name);
      const KVPagePool::Stats windows = arena.kv_window()->stats();
      const KVPagePool::Stats full = arena.kv().stats();
      MESSAGE(name << " chunk " << chunk << ": window pages peak " << windows.peak_used_pages << " of "
                   << windows.total_pages << ", full pages peak " << full.peak_used_pages);
      const int64_t step_pages = std::min<int64_t>(chunk, 40) / page + 2;  // a step's tokens touch this many pages
      CHECK(windows.peak_used_pages <= (window - 1 + page - 1) / page + step_pages);
      CHECK(full.peak_used_pages == 10);   // the 40-token prompt, every page
      if (chunk < 40) CHECK(windows.page_frees > 0);
      CHECK(windows.used_pages == 0);  // every sequence gone (pages the cache alone holds count as free)
    }
  }
}

TEST_CASE("every layer sliding: the KV pages themselves keep only the windows, logits stay transformers'") {
  // mistral and phi3 slide over 8 tokens on every layer: one pool, each sequence trimmed to its window's pages
  for (const std::string& name : {std::string("mistral"), std::string("phi3")}) {
    CAPTURE(name);
    for (int64_t chunk : {int64_t(1), int64_t(5), int64_t(64)}) {
      CAPTURE(chunk);
      auto engine = open_family(name, window_options(chunk));
      const Plan& plan = engine->plan();
      REQUIRE(plan.kv_pages_windowed());
      CHECK(plan.kv_window == 8);
      CHECK(plan.kv_window_pages == 0);
      CHECK(engine->arena().kv_window() == nullptr);
      CHECK(engine->arena().kv_main_window() == 8);
      // the windows of 2 sequences and one step's tokens, never more than 2 x 64 tokens' pages
      CHECK(plan.kv_pages == std::min<uint64_t>(2 * (2 + 2) + uint64_t((chunk + 3) / 4), 2 * 16));
      CHECK(plan.sliding_kv_note.find("every layer slides over 8 tokens and keeps only its window") != std::string::npos);
      check_logits(*engine, name);
      const KVPagePool::Stats pages = engine->arena().kv().stats();
      MESSAGE(name << " chunk " << chunk << ": pages peak " << pages.peak_used_pages << " of " << pages.total_pages);
      CHECK(pages.peak_used_pages <= (8 - 1 + 3) / 4 + std::min<int64_t>(chunk, 40) / 4 + 2);
      if (chunk < 40) CHECK(pages.page_frees > 0);
      CHECK(pages.used_pages == 0);
    }
  }
}

TEST_CASE("sliding windows in memory: a cached prefix brings its window's pages, greedy tokens unchanged") {
  for (const std::string& name : {std::string("qwen2-swa"), std::string("gemma2"), std::string("gemma3_text"),
                                  std::string("mistral")}) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;
    options.prefix_caching = true;
    options.plan.kv_page_tokens = 4;
    options.plan.max_model_len = 64;
    options.plan.max_batched_tokens = 5;
    auto engine = open_family(name, options);
    REQUIRE(engine->plan().kv_window == 8);
    CHECK(engine->plan().kv_pages_windowed() == (name == "mistral"));
    const nlohmann::json reference = family_reference(name);
    const auto& prompt = reference["prompts"][2];  // 40 tokens: 5 windows
    SamplingParams params;
    params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
    for (int run = 0; run < 2; run++) {
      CAPTURE(run);
      auto generation = engine->generate(fx::ids_of(prompt["input_ids"]), params);
      REQUIRE_MESSAGE(generation, generation.error().message);
      CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
    }
    // the second run attached the first one's pages: (40 - 1) / 4 = 9 of them, its window's among them
    CHECK(engine->stats().prefix_pages_reused == 9);
  }
}

TEST_CASE("sliding-window families under page pressure: preempted, recomputed, the same greedy tokens") {
  // Pages of 4 tokens. The KV arena holds one max_model_len sequence: 16 pages (gemma's full layers), or for
  // mistral, whose every layer slides and keeps only its window of 8, the 8 pages one sequence can touch in a step
  // of 16 tokens (its window's 2 + 2, and the step's 4). The three prompts with their 12 new tokens need more.
  // The 40-token prompt runs past 3 x the window on either side of its preemption.
  for (const std::string& name : {std::string("mistral"), std::string("gemma2"), std::string("gemma3_text")}) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.max_model_len = 64;
    options.plan.max_batched_tokens = 16;
    options.plan.kv_page_tokens = 4;
    options.plan.utilization = 1.0;
    const Plan probe = open_family(name, options)->plan();
    const uint64_t pages = probe.kv_pages_windowed() ? kv_window_pages_for(8, 4, 1, 16, 64) : 16;
    CHECK(probe.kv_pages_windowed() == (name == "mistral"));
    // (gemma's sliding layers keep their windows in pages of their own, a fixed region beside the full layers')
    const uint64_t windows = probe.kv_window_pages * probe.kv_window_page_bytes;
    options.plan.device_mem = probe.fixed_bytes + pages * probe.kv_page_bytes + (windows ? windows + kPlanAlignment : 0);
    auto engine = open_family(name, options);
    REQUIRE(engine->plan().kv_pages == pages);
    const nlohmann::json reference = family_reference(name);
    std::vector<RequestId> ids;
    for (size_t k : {size_t(2), size_t(1), size_t(0)}) {
      SamplingParams params;
      params.max_tokens = reference["prompts"][k]["greedy"]["max_new_tokens"].get<int64_t>();
      auto id = engine->submit(fx::ids_of(reference["prompts"][k]["input_ids"]), params);
      REQUIRE_MESSAGE(id, id.error().message);
      ids.push_back(*id);
    }
    REQUIRE(engine->run());
    CHECK(engine->stats().preemptions > 0);
    for (size_t i = 0; i < ids.size(); i++) {
      const size_t k = 2 - i;
      CAPTURE(k);
      auto generation = engine->result(ids[i]);
      REQUIRE(generation);
      CHECK(generation->ids == fx::ids_of(reference["prompts"][k]["greedy"]["new_ids"]));
    }
  }
}

TEST_CASE("phi3 with partial rotary and longrope: logits inside and beyond original_max_position_embeddings") {
  // Phi-4-mini's arrangement at a tiny size: rotary_dim int(16 x 0.75) = 12, longrope with 6 short / long
  // factors, original_max_position_embeddings 24. Prompts of 5 and 19 tokens stay on the short factors; the
  // 40-token prompt passes 24 in its one forward, so every token takes the long ones (and the attention factor).
  const std::string name = "phi3-longrope";
  Result<ModelConfig> config = load_config(family_dir(name));
  REQUIRE_MESSAGE(config, config.error().message);
  CHECK(config->text.rope.type == "longrope");
  CHECK(config->text.rope.partial_rotary_factor == 0.75);
  CHECK(config->text.rope.original_max_position_embeddings == 24);
  CHECK(rope_rotary_dim(config->text.rope, config->text.head_dim).value() == 12);
  auto engine = open_family(name);
  check_logits(*engine, name);
  // In chunks of 3 each step takes the frequencies of its own length, as transformers' forward calls fed the
  // same chunks through the cache do (keys cached before position 24 keep the short factors).
  EngineOptions options;
  options.plan.max_batched_tokens = 3;
  options.threads = 1;
  auto chunked = open_family(name, options);
  check_logits(*chunked, name, "chunks_logits_file");
}

TEST_CASE("phi3 with longrope: greedy continuations equal transformers fed the same pieces") {
  // kvlite prefills the prompt in one step, then decodes a token a step; transformers fed the same way
  // (greedy_pieces) gives these tokens. Phi-3's own generate() drops its cache and recomputes the sequence
  // with the long factors when it first passes original_max_position_embeddings, which kvlite does not do:
  // the 19-token prompt crosses 24 while generating, and there (only there) generate()'s tokens differ.
  const std::string name = "phi3-longrope";
  auto engine = open_family(name);
  const nlohmann::json reference = family_reference(name);
  for (size_t k = 0; k < reference["prompts"].size(); k++) {
    CAPTURE(k);
    const auto& prompt = reference["prompts"][k];
    SamplingParams params;  // temperature 0: greedy
    params.max_tokens = prompt["greedy_pieces"]["max_new_tokens"].get<int64_t>();
    auto generation = engine->generate(fx::ids_of(prompt["input_ids"]), params);
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->ids == fx::ids_of(prompt["greedy_pieces"]["new_ids"]));
    const size_t length = prompt["input_ids"].size();
    const bool crosses_while_generating = length <= 24 && length + size_t(params.max_tokens) > 24;
    if (!crosses_while_generating) CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
  }
}

TEST_CASE("config.json gives each family its block traits") {
  auto load = [](const std::string& name) {
    Result<ModelConfig> config = load_config(family_dir(name));
    REQUIRE_MESSAGE(config, config.error().message);
    return config->text.block;
  };
  using K = LayerKind;
  BlockTraits mistral = load("mistral");
  CHECK(mistral.layer_kinds == std::vector<K>{K::sliding, K::sliding, K::sliding});
  CHECK(mistral.sliding_window == 8);
  CHECK(mistral.norm_form == NormForm::weight);
  // use_sliding_window with max_window_layers 1: layer 0 keeps full attention
  BlockTraits qwen2 = load("qwen2-swa");
  CHECK(qwen2.layer_kinds == std::vector<K>{K::full, K::sliding, K::sliding});
  BlockTraits phi3 = load("phi3");
  CHECK(phi3.fused_projections);
  CHECK(phi3.window_of(2) == 8);
  BlockTraits gemma2 = load("gemma2");
  CHECK(gemma2.layer_kinds == std::vector<K>{K::sliding, K::full, K::sliding, K::full});
  CHECK(gemma2.norm_form == NormForm::one_plus_weight);
  CHECK(gemma2.activation == MlpActivation::gelu_tanh);
  CHECK(gemma2.embedding_scaled);
  CHECK(gemma2.sandwich_norms);
  CHECK(gemma2.attn_logit_softcap == 2.0);
  CHECK(gemma2.final_logit_softcap == 3.0);
  CHECK(gemma2.query_pre_attn_scalar == 24.0);
  CHECK(gemma2.window_of(1) == 0);
  BlockTraits gemma3 = load("gemma3_text");
  CHECK(gemma3.local_rope_theta == 10000.0);
  CHECK(gemma3.attn_logit_softcap == 0.0);
  CHECK(gemma3.final_logit_softcap == 0.0);
  CHECK(gemma3.window_of(0) == 8);
  // transformers 5's rope_parameters per layer type: the global layers' linear scaling, the local base
  Result<ModelConfig> linear = load_config(family_dir("gemma3_text-linear"));
  REQUIRE_MESSAGE(linear, linear.error().message);
  CHECK(linear->text.rope.type == "linear");
  CHECK(linear->text.rope.factor == 8.0);
  CHECK(linear->text.rope.theta == 1000000.0);
  CHECK(linear->text.block.local_rope_theta == 10000.0);
  Result<ModelConfig> partial = load_config(family_dir("phi3-partial"));
  REQUIRE_MESSAGE(partial, partial.error().message);
  CHECK(partial->text.rope.type == "default");
  CHECK(partial->text.rope.partial_rotary_factor == 0.75);
}

TEST_CASE("family configs: the rules for absent keys, and what is refused") {
  auto parse = [](const std::string& text) { return parse_config(text, "config.json"); };
  const std::string sizes = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
      "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64)";
  // mistral without a window: full attention everywhere
  auto mistral = parse(R"({"model_type": "mistral", "sliding_window": null, )" + sizes + "}");
  REQUIRE(mistral);
  CHECK_FALSE(mistral->text.block.has_sliding_layers());
  // qwen2: sliding_window alone is not enough, use_sliding_window must say so (transformers' rule)
  auto qwen2 = parse(R"({"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 2, )" + sizes + "}");
  REQUIRE(qwen2);
  CHECK_FALSE(qwen2->text.block.has_sliding_layers());
  auto qwen2_swa = parse(R"({"model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8,
      "max_window_layers": 2, )" + sizes + "}");
  REQUIRE(qwen2_swa);
  CHECK(qwen2_swa->text.block.layer_kinds ==
        std::vector<LayerKind>{LayerKind::full, LayerKind::full, LayerKind::sliding, LayerKind::sliding});
  // gemma2: absent soft-caps take transformers' defaults (50, 30); null turns them off
  auto gemma2 = parse(R"({"model_type": "gemma2", "head_dim": 16, )" + sizes + "}");
  REQUIRE(gemma2);
  CHECK(gemma2->text.block.attn_logit_softcap == 50.0);
  CHECK(gemma2->text.block.final_logit_softcap == 30.0);
  CHECK(gemma2->text.block.sliding_window == 4096);
  CHECK(gemma2->text.tie_word_embeddings);  // Gemma2Config's default when the key is absent (Gemma-2-2B's file)
  auto uncapped = parse(R"({"model_type": "gemma2", "attn_logit_softcapping": null, "final_logit_softcapping": null,
      "head_dim": 16, )" + sizes + "}");
  REQUIRE(uncapped);
  CHECK(uncapped->text.block.attn_logit_softcap == 0.0);
  // gemma3 (multimodal): the text model from text_config with Gemma3TextConfig's defaults, RoPE bases per kind
  auto gemma3 = parse(R"({"model_type": "gemma3", "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
      "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024}, "torch_dtype": "bfloat16"})");
  REQUIRE_MESSAGE(gemma3, gemma3.error().message);
  CHECK(gemma3->text.num_heads == 8);
  CHECK(gemma3->text.head_dim == 256);
  CHECK(gemma3->text.rope.theta == 1000000.0);
  CHECK(gemma3->text.block.local_rope_theta == 10000.0);
  CHECK(gemma3->text.block.layer_kinds[5] == LayerKind::full);
  CHECK(gemma3->text.block.layer_kinds[4] == LayerKind::sliding);
  CHECK(gemma3->text_prefix() == "language_model.model.");
  // refused, naming the key
  auto silu_gemma = parse(R"({"model_type": "gemma2", "hidden_activation": "relu", "head_dim": 16, )" + sizes + "}");
  REQUIRE_FALSE(silu_gemma);
  CHECK(silu_gemma.error().message.find("hidden_activation") != std::string::npos);
  auto bad_kinds = parse(R"({"model_type": "gemma2", "layer_types": ["full_attention"], "head_dim": 16, )" + sizes + "}");
  REQUIRE_FALSE(bad_kinds);
  CHECK(bad_kinds.error().message.find("layer_types") != std::string::npos);
  auto chunked = parse(R"({"model_type": "gemma3_text", "layer_types": ["chunked_attention", "full_attention",
      "full_attention", "full_attention"], "head_dim": 16, )" + sizes + "}");
  REQUIRE_FALSE(chunked);
  CHECK(chunked.error().code == ErrorCode::unsupported);
}

// ---- config-only plans of the published configs (tests/fixtures/configs/families) ----------------------------

namespace {

struct PublishedModel {
  const char* dir;
  uint64_t safetensors_bytes;  // the published parameter count x bytes per parameter (every tensor on disk)
  Arch arch;
};

// Parameter counts from the model cards / safetensors indexes: Mistral-7B-v0.3 7,248,023,552 (bf16),
// Ministral-8B 8,019,808,256 (bf16), Gemma-2-2B 2,614,341,888 (stored float32), Gemma-3-1B 999,885,952 (bf16),
// Gemma-3-4B 4,300,079,472 (bf16, the SigLIP tower and projector included), Phi-3.5-mini 3,821,079,552 (bf16),
// Phi-4-mini 3,836,021,760 (bf16, lm_head tied).
const PublishedModel kPublished[] = {
    {"mistral-7b-instruct-v0.3", 14496047104ull, Arch::mistral},
    {"ministral-8b-instruct-2410", 16039616512ull, Arch::mistral},
    {"gemma-2-2b", 10457367552ull, Arch::gemma2},
    {"gemma-3-1b-it", 1999771904ull, Arch::gemma3},
    {"gemma-3-4b-it", 8600158944ull, Arch::gemma3},
    {"phi-3.5-mini-instruct", 7642159104ull, Arch::phi3},
    {"phi-4-mini-instruct", 7672043520ull, Arch::phi3},
};

std::string published_dir(const char* name) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/configs/families/" + name;
}

}  // namespace

TEST_CASE("published family configs: weights estimated within 2 percent, and a plan on an 8 GiB card") {
  for (const PublishedModel& model : kPublished) {
    const std::string name = model.dir;
    CAPTURE(name);
    auto inputs = read_plan_inputs(published_dir(model.dir));
    REQUIRE_MESSAGE(inputs, inputs.error().message);
    const RopeConfig& rope = inputs->config.text.rope;
    if (name == "gemma-3-4b-it") {
      // linear 8 on the global layers, the local ones on their own base; 131072 already is the scaled context
      CHECK(rope.type == "linear");
      CHECK(rope.factor == 8.0);
      CHECK(inputs->config.text.block.local_rope_theta == 10000.0);
    }
    if (model.arch == Arch::phi3) {
      // longrope with 48 short and 48 long factors: Phi-3.5-mini rotates all 96 dims, Phi-4-mini 96 of 128
      CHECK(rope.type == "longrope");
      CHECK(rope.original_max_position_embeddings == 4096);
      CHECK(rope.short_factor.size() == 48);
      CHECK(rope.long_factor.size() == 48);
      CHECK(rope_rotary_dim(rope, inputs->config.text.head_dim).value() == 96);
    }
    if (name == "gemma-3-4b-it" || model.arch == Arch::phi3) {
      // the planner's context stays 131072 (Gemma-3's max_position_embeddings already counts its linear 8;
      // longrope's reach is max_position_embeddings): one token more is refused before any memory is counted
      DeviceSpec big;
      big.backend = BackendKind::cuda;
      big.name = "planned 200 GiB card";
      big.total_bytes = 200 * GiB;
      PlanOptions longest;
      longest.max_model_len = 131073;
      auto over = make_plan(*inputs, big, longest);
      REQUIRE_FALSE(over);
      CHECK(over.error().message.find("max_model_len 131073 is more than the model's max_position_embeddings 131072") !=
            std::string::npos);
      longest.max_model_len = 131072;
      auto full = make_plan(*inputs, big, longest);
      CHECK_MESSAGE(full, (full ? std::string() : full.error().message));
    }
    CHECK(inputs->config.arch == model.arch);
    CHECK_FALSE(inputs->weights.exact);
    const double error = (double(inputs->weights.total_bytes) - double(model.safetensors_bytes)) /
                         double(model.safetensors_bytes);
    MESSAGE(name << ": estimated " << inputs->weights.total_bytes << " bytes, published "
                      << model.safetensors_bytes << " (" << error * 100 << " %)");
    CHECK(std::fabs(error) <= 0.02);
    DeviceSpec card;
    card.backend = BackendKind::cuda;
    card.name = "planned 8 GiB card";
    card.total_bytes = 8 * GiB;
    PlanOptions options;
    options.utilization = 0.9;
    options.max_model_len = 4096;
    auto plan = make_plan(*inputs, card, options);
    REQUIRE_MESSAGE(plan, plan.error().message);
    // the full layers' KV in "kv" pages and the sliding ones' in "kv_window" pages: together every layer's
    CHECK(plan->kv_bytes_per_token + plan->kv_window_bytes_per_token == inputs->config.kv_bytes_per_token(2));
    // the KV arena row says what the sliding layers keep and what that saves
    CHECK(plan->sliding_kv_note.empty() == !inputs->config.text.block.has_sliding_layers());
    if (!plan->sliding_kv_note.empty()) CHECK(plan->table().find(plan->sliding_kv_note) != std::string::npos);
    if (name == "gemma-3-1b-it") {
      // layers 5, 11, 17, 23 are global; the 22 local ones keep 8 x (ceil(512 / 16) + 2) + 2048 / 16 = 400 pages
      CHECK(plan->sliding_kv_note.find("22 of 26 layers slide over 512 tokens and keep only their windows") !=
            std::string::npos);
      CHECK(plan->kv_window == 512);
      CHECK(plan->kv_window_bytes_per_token == 22 * 2 * 1 * 256 * 2);
      CHECK(plan->kv_window_pages == 400);
      CHECK(plan->kv_pages == 8 * 4096 / 16);  // max_seqs 8 x 4096 tokens of the full layers fit
      // 8 sequences of 4096: (4 x 8 x 4096 + 22 x 400 x 16) / (26 x 8 x 4096) = 31.9%
      CHECK(plan->sliding_kv_note.find("(32%)") != std::string::npos);
    }
    if (name == "gemma-3-4b-it") {
      // the issue's case: one sequence of 32K. 5 of 34 layers are global; the local ones keep 1 x (1024 / 16 + 2)
      // + 512 / 16 = 98 pages at max_batched_tokens 512: (5 x 32768 + 29 x 98 x 16) / (34 x 32768) = 18.8%, near
      // the 17.3% of the windows alone (the step's tokens are the rest)
      PlanOptions one = options;
      one.max_model_len = 32768;
      one.max_seqs = 1;
      one.max_batched_tokens = 512;
      auto long_plan = make_plan(*inputs, card, one);
      REQUIRE_MESSAGE(long_plan, long_plan.error().message);
      CHECK(long_plan->kv_window_pages == 98);
      CHECK(long_plan->sliding_kv_note.find("29 of 34 layers slide over 1024 tokens and keep only their windows") !=
            std::string::npos);
      CHECK(long_plan->sliding_kv_note.find("(19%)") != std::string::npos);
      MESSAGE(long_plan->sliding_kv_note);
      // what the KV of that sequence takes against every layer's KV for 32K tokens (the weights alone are over an
      // 8 GiB card's budget in bf16: this plan does not fit, its KV rows are still exact)
      const uint64_t kv = long_plan->kv_pages_usable * long_plan->kv_page_bytes +
                          long_plan->kv_window_pages * long_plan->kv_window_page_bytes;
      CHECK(double(kv) / double(32768 * inputs->config.kv_bytes_per_token(2)) < 0.19);
    }
  }
}

// ---- the attention op's window and soft-cap, and the Gemma ops, on the CPU by hand ------------------------------

TEST_CASE("attention's window: a query sees exactly its last W keys, soft-cap bends the scores, bad options refused") {
  CpuBackendOptions cpu;
  cpu.threads = 1;
  auto backend = make_cpu_backend(cpu);
  REQUIRE(backend);
  Backend& b = **backend;
  const int64_t T = 10, D = 2;
  const KVPageLayout layout{1, 4, 1, D};  // 1 layer, 4-token pages, one KV head of 2
  std::vector<float> pages(size_t(layout.page_elements() * 3), 0.0f);
  KVCacheView cache;
  cache.pages = pages.data();
  cache.dtype = DType::F32;
  cache.layout = layout;
  cache.num_pages = 3;
  std::vector<float> k(size_t(T * D)), v(size_t(T * D)), q(size_t(T * D), 0.0f), out(size_t(T * D));
  std::vector<int32_t> slots(static_cast<size_t>(T)), starts = {0, int32_t(T)}, context = {int32_t(T)};
  std::vector<int32_t> table = {0, 1, 2};
  for (int64_t t = 0; t < T; t++) {
    slots[size_t(t)] = int32_t(t);
    k[size_t(t * D)] = float(t);  // keys grow along dim 0 so that a query (1, 0) prefers later keys
    k[size_t(t * D + 1)] = 0.0f;
    v[size_t(t * D)] = float(t);  // the value names its token
    v[size_t(t * D + 1)] = 1.0f;
  }
  REQUIRE(b.kv_write(cache, 0, Tensor::matrix(k.data(), DType::F32, T, D), Tensor::matrix(v.data(), DType::F32, T, D),
                     Tensor::vector(slots.data(), DType::I32, T)).ok());
  const AttentionBatch batch{Tensor::vector(starts.data(), DType::I32, 2), Tensor::vector(context.data(), DType::I32, 1),
                             Tensor::matrix(table.data(), DType::I32, 1, 3), T};
  auto run = [&](AttentionOptions options) {
    Status status = b.attention(Tensor::matrix(q.data(), DType::F32, T, D), cache, 0, batch, 1.0f,
                                Tensor::matrix(out.data(), DType::F32, T, D), options);
    REQUIRE_MESSAGE(status.ok(), status.error().message);
  };
  // q = 0: equal scores, so the output is the mean of the visible values: tokens max(0, t - W + 1) .. t
  for (int64_t window : {1, 3, 8, 0}) {
    CAPTURE(window);
    AttentionOptions options;
    options.window = window;
    run(options);
    for (int64_t t = 0; t < T; t++) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
      CHECK(out[size_t(t * D)] == doctest::Approx(double(first + t) / 2.0).epsilon(1e-6));
      CHECK(out[size_t(t * D + 1)] == doctest::Approx(1.0).epsilon(1e-6));
    }
  }
  // q = (1, 0): score of key j is j; a cap of 2 squashes them to 2 tanh(j / 2), the weights are their softmax
  for (int64_t t = 0; t < T; t++) q[size_t(t * D)] = 1.0f;
  AttentionOptions capped;
  capped.window = 4;
  capped.logit_softcap = 2.0f;
  run(capped);
  for (int64_t t = 0; t < T; t++) {
    double total = 0, weighted = 0;
    for (int64_t j = std::max<int64_t>(0, t - 3); j <= t; j++) {
      const double p = std::exp(2.0 * std::tanh(double(j) / 2.0));
      total += p;
      weighted += p * double(j);
    }
    CHECK(out[size_t(t * D)] == doctest::Approx(weighted / total).epsilon(1e-5));
  }
  AttentionOptions negative;
  negative.window = -1;
  Status refused = b.attention(Tensor::matrix(q.data(), DType::F32, T, D), cache, 0, batch, 1.0f,
                               Tensor::matrix(out.data(), DType::F32, T, D), negative);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(refused.error().message.find("window -1") != std::string::npos);
  AttentionOptions nan_cap;
  nan_cap.logit_softcap = std::nanf("");
  refused = b.attention(Tensor::matrix(q.data(), DType::F32, T, D), cache, 0, batch, 1.0f,
                        Tensor::matrix(out.data(), DType::F32, T, D), nan_cap);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message.find("logit_softcap") != std::string::npos);
}

TEST_CASE("gelu_mul, scale and soft_cap compute PyTorch's formulas, a cap of 0 is refused") {
  auto backend = make_cpu_backend();
  REQUIRE(backend);
  Backend& b = **backend;
  std::vector<float> gate = {-3.0f, -0.5f, 0.0f, 0.7f, 2.0f, 9.0f}, up = {1.0f, 2.0f, -1.0f, 0.5f, -2.0f, 0.25f};
  std::vector<float> out(gate.size());
  const Tensor g = Tensor::matrix(gate.data(), DType::F32, 1, 6), u = Tensor::matrix(up.data(), DType::F32, 1, 6),
               o = Tensor::matrix(out.data(), DType::F32, 1, 6);
  REQUIRE(b.gelu_mul(g, u, GeluApprox::tanh, o).ok());
  for (size_t i = 0; i < gate.size(); i++) {
    const double x = gate[i];
    const double gelu = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    CHECK(out[i] == doctest::Approx(gelu * up[i]).epsilon(1e-6));
  }
  REQUIRE(b.gelu_mul(g, u, GeluApprox::none, o).ok());
  for (size_t i = 0; i < gate.size(); i++) {
    const double x = gate[i];
    CHECK(out[i] == doctest::Approx(0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))) * up[i]).epsilon(1e-6));
  }
  REQUIRE(b.scale(g, 48.0f, o).ok());
  for (size_t i = 0; i < gate.size(); i++) CHECK(out[i] == gate[i] * 48.0f);
  REQUIRE(b.soft_cap(o, 30.0f, o).ok());
  for (size_t i = 0; i < gate.size(); i++)
    CHECK(out[i] == doctest::Approx(30.0 * std::tanh(gate[i] * 48.0 / 30.0)).epsilon(1e-6));
  Status refused = b.soft_cap(o, 0.0f, o);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
}
