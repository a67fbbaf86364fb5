// draft-model: speculative decoding with a draft model (EngineOptions::draft_model). The engine with a draft gives
// transformers' greedy tokens for every fixture (a different model of the same tokenizer as draft, and the
// target as its own draft, which must have every draft accepted: any slip in the draft's KV bookkeeping would
// show), batched, under preemption and at every limit; seeded sampling is reproducible; the bundled captioner
// with its early-exit draft gives its captions in fewer passes; the plan has a row for each thing the draft adds,
// names the largest K that fits, and refuses what cannot work. (The verification rule's distribution test is in
// unit-speculative.cpp.)
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"

using namespace kvlite;
namespace fx = model_fixtures;

namespace {
using engine_helpers::check_pool_empty;
using engine_helpers::greedy;

using fx::reference_greedy;

EngineOptions with_draft(const std::string& draft, int64_t k) {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.draft_model = fx::dir(draft);
  options.plan.speculative_tokens = k;
  return options;
}

struct Pairing {
  std::string target, draft;
};
// Targets with a draft of the same tokenizer: another architecture's random model, and the target itself.
const std::vector<Pairing>& pairings() {
  static const std::vector<Pairing> list = {{"tiny-qwen3", "tiny-qwen2"}, {"tiny-qwen2", "tiny-qwen3"},
                                            {"tiny-llama3", "tiny-llama3-fp8kv"}, {"tiny-llama3", "tiny-llama3"},
                                            {"tiny-qwen3", "tiny-qwen3"}};
  return list;
}

}  // namespace

TEST_CASE("with a draft model, greedy tokens are transformers', alone and batched, and a self-draft is always accepted") {
  for (const Pairing& pairing : pairings()) {
    const bool self = pairing.target == pairing.draft;
    std::vector<std::vector<int32_t>> prompts;
    const std::vector<std::vector<int32_t>> expected = reference_greedy(pairing.target, &prompts);
    for (int64_t k : {1, 3, 8}) {
      CAPTURE(pairing.target);
      CAPTURE(pairing.draft);
      CAPTURE(k);
      auto engine = fx::open(pairing.target, with_draft(pairing.draft, k));
      std::vector<RequestId> ids;
      for (const auto& prompt : prompts) {
        auto id = engine->submit(prompt, greedy());
        REQUIRE_MESSAGE(id, id.error().message);
        ids.push_back(*id);
      }
      Status ran = engine->run();
      REQUIRE_MESSAGE(ran, ran.error().message);
      for (size_t i = 0; i < ids.size(); i++) {
        auto generation = engine->result(ids[i]);
        REQUIRE(generation);
        CHECK(generation->ids == expected[i]);
      }
      for (size_t i = 0; i < prompts.size(); i++) {
        auto generation = engine->generate(prompts[i], greedy());
        REQUIRE(generation);
        CHECK(generation->ids == expected[i]);
      }
      const EngineStats stats = engine->stats();
      CHECK(stats.draft_tokens > 0);
      CHECK(stats.draft_steps > 0);
      if (self) {
        // The draft computes what the target computes: every draft is the target's own greedy token, so one
        // pass yields K + 1 tokens (less where max_tokens cuts the draft short).
        CHECK(stats.draft_tokens_accepted == stats.draft_tokens);
        CHECK(stats.steps < stats.tokens_generated);
      }
      MESSAGE(pairing.target << " drafted by " << pairing.draft << ", K " << k << ": " << stats.draft_tokens
                             << " drafted, " << stats.draft_tokens_accepted << " accepted, " << stats.steps
                             << " target passes for " << stats.tokens_generated << " tokens");
      check_pool_empty(*engine);
      CHECK(Arena::allocations_after_start() == 0);
    }
  }
}

TEST_CASE("a draft that agrees partly: each step accepts exactly the drafts the draft model's own logits predict") {
  // tiny-llama3-draft is tiny-llama3 with 2% noise on its layers (tools/make_draft_model.py --noise 0.02): it
  // agrees with its target often, not always. Which drafts a step accepts follows from the two models alone: the
  // draft's greedy token after each prefix of the final sequence (its teacher-forced logits, from a plain engine
  // of the draft model) against the target's token there. Any slip in the draft's cache (positions, pages,
  // what it keeps after a partial acceptance) would change its drafts and the count.
  const std::string name = "tiny-llama3";
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> expected = reference_greedy(name, &prompts);
  auto draft_alone = fx::open("tiny-llama3-draft");
  int64_t total_accepted = 0, total_drafted = 0;
  for (int64_t k : {2, 5}) {
    auto engine = fx::open(name, with_draft("tiny-llama3-draft", k));
    for (size_t i = 0; i < prompts.size(); i++) {
      CAPTURE(k);
      CAPTURE(i);
      const EngineStats before = engine->stats();
      const int64_t max_tokens = int64_t(expected[i].size());
      auto generation = engine->generate(prompts[i], greedy(max_tokens));
      REQUIRE(generation);
      REQUIRE(generation->ids == expected[i]);
      std::vector<int32_t> sequence = prompts[i];
      sequence.insert(sequence.end(), generation->ids.begin(), generation->ids.end());
      auto logits = draft_alone->logits(sequence);
      REQUIRE(logits);
      auto draft_greedy = [&](size_t position) {  // the draft's token after sequence[0, position)
        return argmax(logits->values.data() + (position - 1) * size_t(logits->vocab), logits->vocab);
      };
      // The engine's steps: the prefill gives token 1; each later step drafts min(K, tokens left - 1) tokens,
      // accepts them while they are the target's, and adds the target's next token.
      int64_t generated = 1, accepted = 0, drafted = 0;
      size_t length = prompts[i].size() + 1;
      while (generated < max_tokens) {
        const int64_t allowed = std::min(k, max_tokens - generated - 1);
        int64_t a = 0;
        while (a < allowed && draft_greedy(length + size_t(a)) == sequence[length + size_t(a)]) a++;
        drafted += allowed;
        accepted += a;
        generated += a + 1;
        length += size_t(a + 1);
      }
      CHECK(engine->stats().draft_tokens_accepted - before.draft_tokens_accepted == accepted);
      CHECK(engine->stats().draft_tokens - before.draft_tokens == drafted);
      total_accepted += accepted;
      total_drafted += drafted;
    }
  }
  MESSAGE("tiny-llama3 drafted by tiny-llama3-draft: " << total_accepted << " of " << total_drafted << " accepted");
  CHECK(total_accepted > 0);
  CHECK(total_accepted < total_drafted);  // a partial agreement, as the fixture was made to be
}

TEST_CASE("with a draft model under page pressure, preempted requests still give transformers' greedy tokens") {
  const std::string name = "tiny-llama3";
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> expected = reference_greedy(name, &prompts);
  EngineOptions options = with_draft("tiny-llama3-fp8kv", 6);
  options.plan.max_model_len = 128;
  options.plan.utilization = 1.0;
  const Plan probe = fx::open(name, options)->plan();
  REQUIRE(probe.draft_kv_page_bytes > 0);
  // 8 pages of 16 tokens, each with the draft's KV beside it (and the draft region's alignment)
  options.plan.device_mem = probe.fixed_bytes + 8 * (probe.kv_page_bytes + probe.draft_kv_page_bytes) + 256;
  auto engine = fx::open(name, options);
  REQUIRE(engine->plan().kv_pages == 8);
  std::vector<RequestId> ids;
  for (size_t i : {2, 0, 1}) {
    auto id = engine->submit(prompts[i], greedy());
    REQUIRE_MESSAGE(id, id.error().message);
    ids.push_back(*id);
  }
  REQUIRE(engine->run());
  CHECK(engine->stats().preemptions > 0);
  CHECK(engine->stats().draft_tokens > 0);
  size_t k = 0;
  for (size_t i : {2, 0, 1}) {
    auto generation = engine->result(ids[k++]);
    REQUIRE(generation);
    CHECK(generation->ids == expected[i]);
  }
  check_pool_empty(*engine);
}

TEST_CASE("with a draft model, max_tokens, max_model_len and stop tokens end generation where they do without it") {
  const std::string name = "tiny-qwen3";
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> expected = reference_greedy(name, &prompts);
  const std::vector<int32_t>& prompt = prompts[0];
  for (int64_t max_tokens : {1, 2, 5, 9}) {
    CAPTURE(max_tokens);
    auto engine = fx::open(name, with_draft(name, 4));
    auto generation = engine->generate(prompt, greedy(max_tokens));
    REQUIRE(generation);
    CHECK(generation->ids == std::vector<int32_t>(expected[0].begin(), expected[0].begin() + max_tokens));
    CHECK(generation->finish_reason == FinishReason::max_tokens);
  }
  {  // the context: max_model_len = prompt + 5
    EngineOptions options = with_draft(name, 4);
    options.plan.max_model_len = int64_t(prompt.size()) + 5;
    auto engine = fx::open(name, options);
    auto generation = engine->generate(prompt, greedy(16));
    REQUIRE(generation);
    CHECK(generation->ids == std::vector<int32_t>(expected[0].begin(), expected[0].begin() + 5));
    CHECK(generation->finish_reason == FinishReason::length);
  }
  {  // a stop token: the reference's 4th greedy token ends it there (drafts past it are dropped)
    auto engine = fx::open(name, with_draft(name, 4));
    SamplingParams params = greedy(16);
    params.stop_tokens = {expected[0][3]};
    auto generation = engine->generate(prompt, params);
    REQUIRE(generation);
    const auto first = std::find(expected[0].begin(), expected[0].end(), expected[0][3]);
    CHECK(generation->ids == std::vector<int32_t>(expected[0].begin(), first + 1));
    CHECK(generation->finish_reason == FinishReason::stop_token);
    check_pool_empty(*engine);
  }
}

TEST_CASE("with a draft model, seeded sampling is reproducible, alone or batched") {
  const std::string name = "tiny-qwen3";
  std::vector<std::vector<int32_t>> prompts;
  reference_greedy(name, &prompts);
  auto engine = fx::open(name, with_draft("tiny-qwen2", 4));
  std::vector<SamplingParams> params(prompts.size());
  for (size_t i = 0; i < params.size(); i++) {
    params[i].temperature = 0.9f;
    params[i].top_k = 50;
    params[i].seed = 100 + i;
    params[i].max_tokens = 24;
  }
  std::vector<std::vector<int32_t>> alone;
  for (size_t i = 0; i < prompts.size(); i++) {
    auto generation = engine->generate(prompts[i], params[i]);
    REQUIRE(generation);
    alone.push_back(generation->ids);
  }
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); i++) ids.push_back(*engine->submit(prompts[i], params[i]));
  REQUIRE(engine->run());
  for (size_t i = 0; i < ids.size(); i++) CHECK(engine->result(ids[i])->ids == alone[i]);
  CHECK(engine->stats().draft_tokens_accepted > 0);  // sampled drafts are accepted too
  check_pool_empty(*engine);
}

TEST_CASE("the bundled captioner with its early-exit draft model: the same captions in fewer target passes") {
  const std::string root = std::string(KVLITE_SOURCE_DIR) + "/";
  const std::vector<std::pair<std::string, std::string>> examples = engine_helpers::example_captions();
  REQUIRE(examples.size() >= 5);
  std::map<bool, EngineStats> stats;
  for (bool drafting : {false, true}) {
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    if (drafting) {
      options.draft_model = root + "models/kvlite-captioner-draft";
      options.plan.speculative_tokens = 4;
    }
    options.plan.device_mem = 256 * MiB;
    options.prefix_caching = false;  // every pass counted as it would be without a cache
    auto engine = Engine::open(root + "models/kvlite-captioner-bf16", options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    for (const auto& example : examples) {
      auto image = load_image(root + "examples/images/" + example.first);
      REQUIRE(image);
      auto caption = (*engine)->generate_chat({{"user", std::string(kImagePlaceholder) + "Describe this image."}},
                                              {*image}, greedy(64));
      REQUIRE(caption);
      CHECK_MESSAGE(caption->text == example.second, example.first);
    }
    stats[drafting] = (*engine)->stats();
  }
  MESSAGE("captioner, five example images: " << stats[false].steps << " target passes without a draft, "
                                              << stats[true].steps << " with (" << stats[true].draft_tokens
                                              << " drafted, " << stats[true].draft_tokens_accepted << " accepted; "
                                              << stats[true].draft_steps << " draft passes) for "
                                              << stats[true].tokens_generated << " tokens");
  CHECK(stats[true].tokens_generated == stats[false].tokens_generated);
  CHECK(stats[true].draft_tokens_accepted > 0);
  // Each accepted draft saves a pass, except an accepted last token (a caption's <|im_end|>), which ends the
  // request before the pass's own token: at most one per caption.
  CHECK(stats[true].steps >= stats[false].steps - stats[true].draft_tokens_accepted);
  CHECK(stats[true].steps <= stats[false].steps - stats[true].draft_tokens_accepted + int64_t(examples.size()));
}

TEST_CASE("the plan has the draft model's rows and its KV beside every page, and names the largest K that fits") {
  const std::string dir = fx::dir("tiny-qwen3");
  EngineOptions options = with_draft("tiny-qwen2", 4);
  options.plan.device_mem = 64 * MiB;
  auto plan = plan_engine(dir, options);
  REQUIRE_MESSAGE(plan, plan.error().message);
  REQUIRE(plan->fits);
  for (const char* key : {"draft_weights", "draft_activations", "draft_logits", "draft_probs"}) {
    CAPTURE(key);
    REQUIRE(plan->item(key) != nullptr);
    CHECK(plan->item(key)->bytes > 0);
  }
  CHECK_FALSE(plan->item("draft_weights")->in_arena);  // memory-mapped on the CPU, as the target's
  auto draft_inputs = read_plan_inputs(fx::dir("tiny-qwen2"));
  REQUIRE(draft_inputs);
  CHECK(plan->draft_kv_bytes_per_token == draft_inputs->config.kv_bytes_per_token(4));
  CHECK(plan->draft_kv_page_bytes == 16 * plan->draft_kv_bytes_per_token);
  CHECK(plan->item("draft_probs")->bytes >= uint64_t(plan->options.max_seqs) * 4 * 1415 * 4);
  CHECK(plan->table().find("draft model") != std::string::npos);
  const nlohmann::json json = nlohmann::json::parse(plan->json());
  CHECK(json["draft_kv_page_bytes"] == plan->draft_kv_page_bytes);
  // The arena the engine opens is the plan's, the draft's KV region included.
  auto engine = Engine::open(dir, options);
  REQUIRE_MESSAGE(engine, engine.error().message);
  const ArenaRegion* draft_kv = (*engine)->arena().region("draft_kv");
  REQUIRE(draft_kv != nullptr);
  CHECK(draft_kv->bytes == (*engine)->plan().kv_pages * plan->draft_kv_page_bytes);
  CHECK((*engine)->arena().size() == (*engine)->plan().arena_bytes());

  // A budget where K = 3 fits and K = 8 does not: the advice names the largest K.
  EngineOptions fitted = with_draft("tiny-qwen2", 3);
  fitted.plan.max_model_len = 256;
  fitted.plan.utilization = 1.0;
  fitted.plan.kv_fill = false;
  fitted.plan.device_mem = 512 * MiB;
  auto probe = plan_engine(dir, fitted);
  REQUIRE(probe);
  const uint64_t needed = probe->fixed_bytes + 16 * (probe->kv_page_bytes + probe->draft_kv_page_bytes) + 256;
  fitted.plan.device_mem = needed;
  auto three = plan_engine(dir, fitted);
  REQUIRE(three);
  CHECK(three->fits);
  fitted.plan.speculative_tokens = 8;
  auto eight = plan_engine(dir, fitted);
  REQUIRE(eight);
  CHECK_FALSE(eight->fits);
  CHECK(eight->speculative_tokens_that_fit == 3);
  bool named = false;
  for (const std::string& line : eight->advice) named = named || line.find("--spec-tokens 3: fits") != std::string::npos;
  CHECK_MESSAGE(named, eight->advice.size() << " advice lines");
  CHECK(eight->fits_without_draft);
  // The advice followed: K = 3 on that budget opens and generates with the plan's numbers.
  fitted.plan.speculative_tokens = eight->speculative_tokens_that_fit;
  auto advised = Engine::open(dir, fitted);
  REQUIRE_MESSAGE(advised, advised.error().message);
  CHECK((*advised)->plan().kv_pages == 16);
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> expected = reference_greedy("tiny-qwen3", &prompts);
  auto generation = (*advised)->generate(prompts[0], greedy());
  REQUIRE(generation);
  CHECK(generation->ids == expected[0]);
}

TEST_CASE("a draft model is refused with the reason: n-gram too, no K, another vocabulary or tokenizer, a vision "
          "model, CUDA, a missing directory") {
  const std::string dir = fx::dir("tiny-qwen3");
  auto refused = [&](EngineOptions options, ErrorCode code, const std::string& words) {
    options.plan.device_mem = 64 * MiB;
    auto plan = plan_engine(dir, options);
    auto engine = Engine::open(dir, options);
    REQUIRE_FALSE(engine);
    CHECK(engine.error().code == code);
    CHECK_MESSAGE(engine.error().message.find(words) != std::string::npos, engine.error().message);
    if (!plan) CHECK(plan.error().code == code);
  };
  EngineOptions both = with_draft("tiny-qwen2", 4);
  both.plan.ngram = 3;
  refused(both, ErrorCode::invalid_argument, "not both");
  refused(with_draft("tiny-qwen2", 0), ErrorCode::invalid_argument, "needs --spec-tokens");
  refused(with_draft("tiny-llama3", 4), ErrorCode::invalid_argument, "vocabulary");
  EngineOptions vision = with_draft("tiny-qwen2", 4);
  vision.draft_model = std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16";
  refused(vision, ErrorCode::unsupported, "not a text model");
  EngineOptions missing = with_draft("tiny-qwen2", 4);
  missing.draft_model = "/nonexistent/draft";
  {
    missing.plan.device_mem = 64 * MiB;
    auto engine = Engine::open(dir, missing);
    REQUIRE_FALSE(engine);
    CHECK(engine.error().message.find("/nonexistent/draft") != std::string::npos);
  }
  // A tokenizer whose ids 306 and 307 are swapped (same size, same merges): refused, naming the token.
  const std::filesystem::path copy = std::filesystem::path(KVLITE_BINARY_DIR) / "draft-model-other-tokenizer";
  std::filesystem::remove_all(copy);
  std::filesystem::copy(fx::dir("tiny-qwen2"), copy, std::filesystem::copy_options::recursive);
  {
    std::string text = fx::read_file((copy / "tokenizer.json").string());
    for (const auto& swap : std::vector<std::pair<std::string, std::string>>{
             {"\"\xC4\xA0we\": 306", "\"\xC4\xA0we\": 999307"}, {"\"\xC4\xA0the\": 307", "\"\xC4\xA0the\": 306"},
             {"\"\xC4\xA0we\": 999307", "\"\xC4\xA0we\": 307"}}) {
      const size_t at = text.find(swap.first);
      REQUIRE(at != std::string::npos);
      text.replace(at, swap.first.size(), swap.second);
    }
    std::ofstream((copy / "tokenizer.json").string(), std::ios::binary) << text;
  }
  EngineOptions other = with_draft("tiny-qwen2", 4);
  other.draft_model = copy.string();
  refused(other, ErrorCode::invalid_argument, "token 306 is '\xC4\xA0the' in its tokenizer but '\xC4\xA0we'");
  // CUDA: planned for a card, refused (the draft runs on the CPU backend only so far).
  EngineOptions cuda = with_draft("tiny-qwen2", 4);
  cuda.backend = BackendChoice::cuda;
  cuda.plan.device_mem = 8 * GiB;
  auto plan = plan_engine(dir, cuda);
  REQUIRE_FALSE(plan);
  CHECK(plan.error().code == ErrorCode::unsupported);
  CHECK(plan.error().message.find("CPU backend only") != std::string::npos);
}
