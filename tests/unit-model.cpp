// model: the forward pass against transformers' float32 outputs for the three tiny fixture models (logits,
// greedy continuations, prompt log-probs, sliding-window perplexity), and weight binding errors.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

// The fixture's tolerance: max |kvlite - transformers| / max |transformers| over a prompt's logits.
constexpr double kLogitsTolerance = 1e-4;

void check_relative(double value, double reference) {
  CAPTURE(value);
  CAPTURE(reference);
  CHECK(std::fabs(value - reference) <= 1e-4 * std::fabs(reference));
}

}  // namespace

TEST_CASE("logits of every recorded prompt match transformers in float32") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const nlohmann::json reference = fx::reference(name);
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      fx::Npy expected = fx::read_npy(fx::dir(name) + "/" + prompt["logits_file"].get<std::string>());
      auto logits = engine->logits(fx::ids_of(prompt["input_ids"]));
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      CHECK(fx::relative_max_diff(logits->values, expected.values) <= kLogitsTolerance);
    }
  }
}

TEST_CASE("logits do not depend on prefill chunking or threads") {
  // Chunks of 7 tokens make every prompt a multi-step prefill whose later chunks read the earlier ones' K/V
  // from the pages; one thread against two. The CPU backend promises the same bits either way.
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto whole = fx::open(name);
    EngineOptions chunked_options;
    chunked_options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    chunked_options.plan.max_batched_tokens = 7;
    chunked_options.threads = 1;
    auto chunked = fx::open(name, chunked_options);
    const nlohmann::json reference = fx::reference(name);
    const auto& prompt = reference["prompts"][2];  // the longest (chat)
    fx::Npy expected = fx::read_npy(fx::dir(name) + "/" + prompt["logits_file"].get<std::string>());
    auto a = whole->logits(fx::ids_of(prompt["input_ids"]));
    auto b = chunked->logits(fx::ids_of(prompt["input_ids"]));
    REQUIRE(a);
    REQUIRE(b);
    CHECK(chunked->stats().steps == int64_t(expected.rows + 6) / 7);
    CHECK(fx::relative_max_diff(b->values, expected.values) <= kLogitsTolerance);
    CHECK(a->values == b->values);
  }
}

TEST_CASE("greedy continuations equal transformers' generate()") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const nlohmann::json reference = fx::reference(name);
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      const auto& greedy = prompt["greedy"];
      SamplingParams params;  // temperature 0: greedy
      params.max_tokens = greedy["max_new_tokens"].get<int64_t>();
      auto generation = engine->generate(fx::ids_of(prompt["input_ids"]), params);
      REQUIRE_MESSAGE(generation, generation.error().message);
      CHECK(generation->ids == fx::ids_of(greedy["new_ids"]));
      // transformers decodes the new ids with skip_special_tokens=False.
      auto text = engine->detokenize(generation->ids);
      REQUIRE(text);
      CHECK(*text == greedy["text"].get<std::string>());
      CHECK(generation->finish_reason ==
            (greedy["stopped_at_eos"].get<bool>() ? FinishReason::stop_token : FinishReason::max_tokens));
    }
  }
}

TEST_CASE("text prompts are encoded as transformers encodes them before generating") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const nlohmann::json reference = fx::reference(name);
    const auto& prompt = reference["prompts"][0];  // tokenizer.encode(text, add_special_tokens=True)
    SamplingParams params;
    params.max_tokens = 16;
    auto generation = engine->generate(prompt["text"].get<std::string>(), params);
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->prompt_ids == fx::ids_of(prompt["input_ids"]));
    CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
  }
}

TEST_CASE("prompt log-probs equal transformers' log_softmax") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const nlohmann::json reference = fx::reference(name);
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      std::vector<int32_t> ids = fx::ids_of(prompt["input_ids"]);
      std::vector<double> expected = prompt["prompt_logprobs"].get<std::vector<double>>();
      // One window over the whole prompt scores every token after the first with all of its context.
      auto scored = engine->score(ids, int64_t(ids.size()), int64_t(ids.size()));
      REQUIRE_MESSAGE(scored, scored.error().message);
      REQUIRE(scored->logprobs.size() == ids.size());
      CHECK(std::isnan(scored->logprobs[0]));
      for (size_t t = 1; t < ids.size(); t++) {
        CAPTURE(t);
        check_relative(scored->logprobs[t], expected[t - 1]);
      }
    }
  }
}

TEST_CASE("sliding-window perplexity equals the transformers guide's, exact and guide-weighted") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const nlohmann::json reference = fx::reference(name)["perplexity"];
    std::vector<int32_t> ids = fx::ids_of(reference["input_ids"]);
    const int64_t context = reference["context_length"].get<int64_t>(), stride = reference["stride"].get<int64_t>();
    int64_t progress_calls = 0, last_done = 0;
    auto scored = engine->score(ids, context, stride, [&](int64_t done, int64_t total) {
      CHECK(done > last_done);
      CHECK(total == int64_t(reference["windows"].size()));
      last_done = done;
      progress_calls++;
    });
    REQUIRE_MESSAGE(scored, scored.error().message);
    CHECK(scored->windows == int64_t(reference["windows"].size()));
    CHECK(last_done == scored->windows);
    CHECK(progress_calls >= 1);
    CHECK(scored->tokens == reference["exact_tokens"].get<int64_t>());
    check_relative(scored->perplexity, reference["exact_ppl"].get<double>());
    check_relative(scored->nll_sum / double(scored->tokens), reference["exact_avg_nll"].get<double>());
    check_relative(scored->guide_perplexity, reference["guide_ppl"].get<double>());
    const auto& token_nll = reference["token_nll"];
    for (size_t p = 1; p < ids.size(); p++) {
      CAPTURE(p);
      check_relative(-scored->logprobs[p], token_nll[p].get<double>());
    }
    // The text form encodes as transformers' tokenizer(text) did.
    auto from_text = engine->score(reference["text"].get<std::string>(), context, stride);
    REQUIRE_MESSAGE(from_text, from_text.error().message);
    CHECK(from_text->perplexity == scored->perplexity);
  }
}

TEST_CASE("a checkpoint missing tensors is refused with every missing name") {
  // tiny-qwen2's own files with two tensors left out of model.safetensors.
  const std::string source = fx::dir("tiny-qwen2");
  const std::string dir = testing_safetensors::temp_dir("model-missing-tensors");
  for (const char* file : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    std::ofstream(dir + "/" + file, std::ios::binary) << fx::read_file(source + "/" + file);
  auto store = TensorStore::open_dir(source);
  REQUIRE(store);
  const std::vector<std::string> dropped = {"model.layers.1.self_attn.k_proj.bias", "model.norm.weight"};
  std::vector<testing_safetensors::Tensor> kept;
  for (const TensorInfo& info : store->tensors()) {
    if (std::find(dropped.begin(), dropped.end(), info.name) != dropped.end()) continue;
    const uint8_t* data = store->data(info);
    kept.push_back({info.name, dtype_name(info.dtype), info.shape, std::vector<uint8_t>(data, data + info.nbytes)});
  }
  REQUIRE(kept.size() == store->tensors().size() - dropped.size());
  testing_safetensors::write_file(dir + "/model.safetensors", kept);

  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.device_mem = 64 * MiB;
  auto engine = Engine::open(dir, options);
  REQUIRE_FALSE(engine);
  CHECK(engine.error().code == ErrorCode::missing_tensor);
  for (const auto& name : dropped) CHECK(engine.error().message.find(name) != std::string::npos);
}

TEST_CASE("a tensor of the wrong shape is refused naming it and both shapes") {
  const std::string source = fx::dir("tiny-qwen3");
  const std::string dir = testing_safetensors::temp_dir("model-wrong-shape");
  for (const char* file : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    std::ofstream(dir + "/" + file, std::ios::binary) << fx::read_file(source + "/" + file);
  auto store = TensorStore::open_dir(source);
  REQUIRE(store);
  std::vector<testing_safetensors::Tensor> tensors;
  for (const TensorInfo& info : store->tensors()) {
    const uint8_t* data = store->data(info);
    testing_safetensors::Tensor t{info.name, dtype_name(info.dtype), info.shape,
                                  std::vector<uint8_t>(data, data + info.nbytes)};
    // q_norm is [32] (head_dim); store it as [16, 2], the same bytes in a shape the config does not make.
    if (info.name == "model.layers.0.self_attn.q_norm.weight") t.shape = {16, 2};
    tensors.push_back(std::move(t));
  }
  testing_safetensors::write_file(dir + "/model.safetensors", tensors);
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.device_mem = 64 * MiB;
  auto engine = Engine::open(dir, options);
  REQUIRE_FALSE(engine);
  CHECK(engine.error().code == ErrorCode::bad_format);
  CHECK(engine.error().message.find("model.layers.0.self_attn.q_norm.weight") != std::string::npos);
  CHECK(engine.error().message.find("[16, 2]") != std::string::npos);
  CHECK(engine.error().message.find("[32]") != std::string::npos);
}
