// kv-fp8: the e4m3 KV cache. The CPU backend's stored bytes and attention equal a numpy emulation of the same
// rounding (tools/make_fp8_kv_fixtures.py); a checkpoint's compressed-tensors kv_cache_scheme scales are read
// and used; the engine runs prefill, chunked prefill, decode, preemption and scoring on fp8 pages; and the
// logits stay near those of an f32 cache (the deviation is printed for the record).
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

const std::string kScaled = fx::dir("tiny-llama3-fp8kv");

std::vector<float> floats(const nlohmann::json& rows) {
  std::vector<float> out;
  for (const auto& row : rows)
    for (const auto& v : row) out.push_back(v.get<float>());
  return out;
}

std::unique_ptr<Engine> open_cpu(const std::string& dir, KVDType kv, int64_t max_batched_tokens = 0) {
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = 64 * MiB;
  options.plan.kv_dtype = kv;
  options.plan.max_batched_tokens = max_batched_tokens;
  options.threads = 2;
  auto engine = Engine::open(dir, options);
  REQUIRE_MESSAGE(engine.ok(), engine.error().message);
  return std::move(*engine);
}

// CPU options for `dir` whose budget (at utilization 1) holds the plan's fixed items and exactly `pages` KV pages
// of `page_tokens` tokens in `kv` for sequences of max_model_len tokens.
EngineOptions cpu_with_kv_pages(const std::string& dir, KVDType kv, int64_t max_model_len, int64_t page_tokens,
                                uint64_t pages) {
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.kv_dtype = kv;
  options.plan.max_model_len = max_model_len;
  options.plan.kv_page_tokens = page_tokens;
  options.plan.utilization = 1.0;
  const Plan probe = plan_engine(dir, options).value();
  options.plan.device_mem = probe.fixed_bytes + pages * probe.kv_page_bytes;
  return options;
}

// max |a - b| / max |b| over two logit arrays, and the share of rows whose argmax agrees.
struct Deviation {
  double relative = 0;
  double top1_agreement = 0;
};
Deviation deviation(const Logits& a, const Logits& b) {
  double diff = 0, scale = 0;
  int64_t agree = 0;
  for (int64_t t = 0; t < a.tokens; t++) {
    const float* ra = a.values.data() + t * a.vocab;
    const float* rb = b.values.data() + t * b.vocab;
    for (int64_t j = 0; j < a.vocab; j++) {
      diff = std::max(diff, double(std::fabs(ra[j] - rb[j])));
      scale = std::max(scale, double(std::fabs(rb[j])));
    }
    agree += std::max_element(ra, ra + a.vocab) - ra == std::max_element(rb, rb + b.vocab) - rb;
  }
  return {diff / scale, double(agree) / double(a.tokens)};
}

}  // namespace

TEST_CASE("the stored e4m3 bytes and attention over them equal the numpy emulation, per-layer scales included") {
  const auto fixture = nlohmann::json::parse(fx::read_file(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/fp8_kv/attention.json"));
  const int64_t heads = fixture["heads"], kv_heads = fixture["kv_heads"], head_dim = fixture["head_dim"];
  const int64_t tokens = fixture["tokens"];
  const float k_scale = fixture["k_scale"], v_scale = fixture["v_scale"];
  std::vector<float> q = floats(fixture["q"]), k = floats(fixture["k"]), v = floats(fixture["v"]);
  const std::vector<float> expected = floats(fixture["out"]);
  CpuBackendOptions backend_options;
  backend_options.threads = 2;
  backend_options.max_head_dim = head_dim;
  auto backend = make_cpu_backend(backend_options);
  REQUIRE(backend.ok());
  CHECK((*backend)->supports(Op::kv_write, DType::F8_E4M3));
  CHECK((*backend)->supports(Op::attention, DType::F8_E4M3));

  for (int64_t page_tokens : {1, 4, 16}) {
    CAPTURE(page_tokens);
    // Two layers; the fixture's scales are layer 1's (layer 0 has others, so a wrong index shows).
    const KVPageLayout layout{2, page_tokens, kv_heads, head_dim};
    const int64_t pages = int64_t(ceil_div(uint64_t(tokens), uint64_t(page_tokens))) + 2;
    std::vector<uint8_t> cache_bytes(size_t(pages * layout.page_elements()), 0x7f);  // poison: e4m3 NaN
    const float k_scales[2] = {0.5f, k_scale}, v_scales[2] = {0.25f, v_scale};
    KVCacheView cache{cache_bytes.data(), DType::F8_E4M3, layout, pages, k_scales, v_scales};
    // Pages in reverse order: the block table, not the layout, decides where a token lives.
    std::vector<int32_t> table(size_t(pages - 2)), slots(static_cast<size_t>(tokens));
    for (size_t p = 0; p < table.size(); p++) table[p] = int32_t(pages - 1 - int64_t(p));
    for (int64_t t = 0; t < tokens; t++) slots[size_t(t)] = table[size_t(t / page_tokens)] * int32_t(page_tokens) + int32_t(t % page_tokens);
    const int64_t width = kv_heads * head_dim;
    REQUIRE((*backend)->kv_write(cache, 1, Tensor::matrix(k.data(), DType::F32, tokens, width),
                                 Tensor::matrix(v.data(), DType::F32, tokens, width),
                                 Tensor::vector(slots.data(), DType::I32, tokens)).ok());
    int64_t byte_mismatches = 0;
    for (int64_t t = 0; t < tokens; t++)
      for (int kv = 0; kv < 2; kv++)
        for (int64_t c = 0; c < width; c++) {
          const int64_t page = table[size_t(t / page_tokens)];
          const uint8_t got = cache_bytes[size_t(layout.offset(page, 1, kv, t % page_tokens, c / head_dim) + c % head_dim)];
          const int want = fixture[kv == 0 ? "k_bytes" : "v_bytes"][size_t(t)][size_t(c)].get<int>();
          byte_mismatches += got != want;
        }
    CHECK(byte_mismatches == 0);

    std::vector<int32_t> starts = {0, int32_t(tokens)}, contexts = {int32_t(tokens)};
    AttentionBatch batch;
    batch.query_starts = Tensor::vector(starts.data(), DType::I32, 2);
    batch.context_lens = Tensor::vector(contexts.data(), DType::I32, 1);
    batch.block_tables = Tensor::matrix(table.data(), DType::I32, 1, int64_t(table.size()));
    batch.max_context = tokens;
    std::vector<float> out(size_t(tokens * heads * head_dim), NAN);
    REQUIRE((*backend)->attention(Tensor::matrix(q.data(), DType::F32, tokens, heads * head_dim), cache, 1, batch,
                                  fixture["attention_scaling"].get<float>(),
                                  Tensor::matrix(out.data(), DType::F32, tokens, heads * head_dim)).ok());
    double worst = 0;
    for (size_t i = 0; i < out.size(); i++) worst = std::max(worst, std::fabs(double(out[i]) - double(expected[i])));
    CHECK(worst < 2e-6);
  }
}

TEST_CASE("a checkpoint's kv_cache_scheme scales are read per layer and used by an fp8 cache") {
  auto config = load_config(kScaled);
  REQUIRE(config.ok());
  CHECK(config->quant.kv_cache_fp8);
  auto store = TensorStore::open_dir(kScaled);
  REQUIRE(store.ok());
  auto weights = bind_text_weights(*config, *store);
  REQUIRE_MESSAGE(weights.ok(), weights.error().message);
  const auto recorded = nlohmann::json::parse(fx::read_file(kScaled + "/scales.json"))["scales"];
  REQUIRE(weights->k_scales.size() == recorded.size());
  for (size_t l = 0; l < recorded.size(); l++) {
    CHECK(weights->k_scales[l] == recorded[l][0].get<float>());
    CHECK(weights->v_scales[l] == recorded[l][1].get<float>());
  }
  // The same weights without the scales (tiny-llama3) give other fp8 logits: the scales are used; both stay
  // near the f32 cache's.
  const std::vector<int32_t> ids = fx::ids_of(fx::reference("tiny-llama3")["prompts"][0]["input_ids"]);
  auto scaled = open_cpu(kScaled, KVDType::fp8)->logits(ids);
  auto unscaled = open_cpu(fx::dir("tiny-llama3"), KVDType::fp8)->logits(ids);
  auto exact = open_cpu(fx::dir("tiny-llama3"), KVDType::f32)->logits(ids);
  REQUIRE(scaled.ok());
  REQUIRE(unscaled.ok());
  REQUIRE(exact.ok());
  CHECK(scaled->values != unscaled->values);
  const Deviation with_scales = deviation(*scaled, *exact), without = deviation(*unscaled, *exact);
  MESSAGE("tiny-llama3, fp8 KV vs f32 KV: max |diff| / max |logit| " << with_scales.relative
          << " with the checkpoint's scales, " << without.relative << " with 1.0");
  // The random tiny model's logits are nearly flat, so e4m3's 3 mantissa bits move them by a large share of their
  // small range; the bound only catches garbage (zeros, NaN, a wrong layer's scale). The trained captioner's
  // test below is the one that measures quality.
  CHECK(with_scales.relative < 0.75);
  // Without fp8 the scales change nothing.
  auto f32_scaled = open_cpu(kScaled, KVDType::f32)->logits(ids);
  REQUIRE(f32_scaled.ok());
  CHECK(f32_scaled->values == exact->values);
}

TEST_CASE("kv_cache_scheme: only static per-tensor 8-bit float scales are taken: anything else is refused by name") {
  for (const char* scheme : {R"({"num_bits": 4, "type": "int", "strategy": "tensor"})",
                             R"({"num_bits": 8, "type": "float", "strategy": "channel"})",
                             R"({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": true})"}) {
    CAPTURE(scheme);
    auto config = nlohmann::json::parse(fx::read_file(kScaled + "/config.json"));
    config["quantization_config"]["kv_cache_scheme"] = nlohmann::json::parse(scheme);
    auto parsed = parse_config(config.dump(), "config.json");
    REQUIRE_FALSE(parsed.ok());
    CHECK(parsed.error().code == ErrorCode::unsupported);
    CHECK(parsed.error().message.find("kv_cache_scheme") != std::string::npos);
  }
}

TEST_CASE("fp8 pages in the engine: prefill, chunked prefill, decode, preemption and scoring: logits near f32's") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    const nlohmann::json reference = fx::reference(name);
    auto fp8 = open_cpu(fx::dir(name), KVDType::fp8);
    auto f32 = open_cpu(fx::dir(name), KVDType::f32);
    CHECK(fp8->plan().kv_bytes_per_token * 4 == f32->plan().kv_bytes_per_token);
    double worst = 0, agreement = 1;
    for (const auto& prompt : reference["prompts"]) {
      const std::vector<int32_t> ids = fx::ids_of(prompt["input_ids"]);
      auto a = fp8->logits(ids);
      auto b = f32->logits(ids);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      const Deviation d = deviation(*a, *b);
      worst = std::max(worst, d.relative);
      agreement = std::min(agreement, d.top1_agreement);
      // Chunked prefill (4 tokens a step) writes and reads the same pages: the same bits.
      auto chunked = open_cpu(fx::dir(name), KVDType::fp8, 4)->logits(ids);
      REQUIRE(chunked.ok());
      CHECK(chunked->values == a->values);
    }
    MESSAGE(name << ": fp8 KV vs f32 KV logits: max |diff| / max |logit| " << worst << ", top-1 agreement at least "
                 << agreement * 100 << "%");
    CHECK(worst < 0.75);  // a sanity bound (see above): the random fixtures' logits are nearly flat

    // Batched with preemption equals alone: an arena of 3 pages for two requests that need 2 each.
    SamplingParams params;
    params.max_tokens = 12;
    params.ignore_eos = true;
    std::vector<std::vector<int32_t>> alone;
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& prompt : reference["prompts"]) prompts.push_back(fx::ids_of(prompt["input_ids"]));
    prompts.resize(2);
    for (const auto& ids : prompts) alone.push_back(fp8->generate(ids, params)->ids);
    const EngineOptions tight = cpu_with_kv_pages(fx::dir(name), KVDType::fp8, 32, 16, 3);
    auto small = Engine::open(fx::dir(name), tight);
    REQUIRE_MESSAGE(small.ok(), small.error().message);
    REQUIRE((*small)->plan().kv_pages == 3);
    std::vector<RequestId> ids;
    for (const auto& prompt : prompts) ids.push_back((*small)->submit(prompt, params).value());
    REQUIRE((*small)->run().ok());
    CHECK((*small)->stats().preemptions > 0);
    for (size_t i = 0; i < ids.size(); i++) CHECK((*small)->result(ids[i])->ids == alone[i]);
    CHECK((*small)->arena().kv().stats().used_pages == 0);

    // Scoring runs on fp8 pages, near the f32 cache's perplexity.
    auto ppl_fp8 = fp8->score(prompts[0], 8, 4);
    auto ppl_f32 = f32->score(prompts[0], 8, 4);
    REQUIRE(ppl_fp8.ok());
    REQUIRE(ppl_f32.ok());
    CHECK(std::isfinite(ppl_fp8->perplexity));
    CHECK(std::fabs(ppl_fp8->perplexity / ppl_f32->perplexity - 1) < 0.5);
  }
}

TEST_CASE("the trained captioner with an fp8 KV cache gives the example captions, its logits near the f32 cache's") {
  const std::string captioner = std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16";
  auto fp8 = open_cpu(captioner, KVDType::fp8);
  auto f32 = open_cpu(captioner, KVDType::f32);
  const std::string images = std::string(KVLITE_SOURCE_DIR) + "/examples/images/";
  std::istringstream captions(fx::read_file(images + "captions.txt"));
  SamplingParams params;
  params.max_tokens = 64;
  double worst = 0;
  int checked = 0;
  for (std::string line; std::getline(captions, line);) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos) continue;
    auto image = load_image(images + line.substr(0, tab));
    REQUIRE(image.ok());
    const std::vector<ChatMessage> chat = {{"user", std::string(kImagePlaceholder) + "Describe this image."}};
    auto generation = fp8->generate_chat(chat, {*image}, params);
    REQUIRE(generation.ok());
    CHECK(generation->text == line.substr(tab + 1));
    // The logits of the prompt and caption through both caches.
    auto input = fp8->preprocess(*image);
    REQUIRE(input.ok());
    std::vector<int32_t> ids = fp8->tokenize(fp8->tokenizer().format_chat(chat, true).value(), false).value();
    ids.insert(ids.end(), generation->ids.begin(), generation->ids.end());
    auto a = fp8->logits(ids, {*input});
    auto b = f32->logits(ids, {*input});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    const Deviation d = deviation(*a, *b);
    worst = std::max(worst, d.relative);
    checked++;
  }
  CHECK(checked == 5);
  MESSAGE("kvlite-captioner-bf16, fp8 KV vs f32 KV over the 5 example prompts and captions: max |diff| / max |logit| "
          << worst);
  CHECK(worst < 0.05);
}

TEST_CASE("fp8 KV is advised only where a backend stores it, and the advice, followed, runs") {
  CHECK(kv_dtype_storable(BackendKind::cpu, KVDType::fp8));
  CHECK(kv_dtype_storable(BackendKind::cuda, KVDType::fp8));
  // A budget whose KV holds 20 tokens at f32 but 80 at fp8: a 64-token request is advised fp8, and runs.
  const std::string dir = fx::dir("tiny-qwen3");
  EngineOptions options = cpu_with_kv_pages(dir, KVDType::f32, 64, 4, 5);
  const Plan plan = plan_engine(dir, options).value();
  REQUIRE_FALSE(plan.fits);
  const auto line = std::find_if(plan.advice.begin(), plan.advice.end(),
                                 [](const std::string& a) { return a.find("--kv-dtype fp8") != std::string::npos; });
  REQUIRE(line != plan.advice.end());
  CHECK(line->find("With --kv-dtype fp8: fits") != std::string::npos);  // fp8 alone is enough here
  options.plan.kv_dtype = KVDType::fp8;
  auto engine = Engine::open(dir, options);
  REQUIRE_MESSAGE(engine.ok(), engine.error().message);
  SamplingParams params;
  params.max_tokens = 40;
  params.ignore_eos = true;
  auto generation = (*engine)->generate(std::vector<int32_t>(20, 5), params);
  REQUIRE(generation.ok());
  CHECK(generation->ids.size() == 40);
}
