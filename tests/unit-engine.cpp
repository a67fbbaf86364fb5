// engine: continuous batching (batched equals alone, preemption under page pressure), refusing what cannot
// fit, cancellation, stop tokens and strings, seeded sampling, streaming, the .npy writer, and the promise of
// no arena allocation after start.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <atomic>
#include <future>
#include <thread>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {
using engine_helpers::greedy;
using engine_helpers::check_pool_empty;

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> greedy;  // transformers' 16 greedy ids
  std::string greedy_text;
};

std::vector<Prompt> prompts(const std::string& name) {
  std::vector<Prompt> list;
  const nlohmann::json reference = fx::reference(name);
  for (const auto& p : reference["prompts"])
    list.push_back({fx::ids_of(p["input_ids"]), fx::ids_of(p["greedy"]["new_ids"]), p["greedy"]["text"].get<std::string>()});
  return list;
}



// An engine whose KV arena has exactly `pages` pages: the whole budget minus the plan's fixed items.
std::unique_ptr<Engine> open_with_pages(const std::string& name, EngineOptions options, uint64_t pages) {
  options.plan.utilization = 1.0;
  const Plan probe = fx::open(name, options)->plan();
  options.plan.device_mem = probe.fixed_bytes + pages * probe.kv_page_bytes;
  auto engine = fx::open(name, options);
  REQUIRE(engine->plan().kv_pages == pages);
  return engine;
}

}  // namespace

TEST_CASE("batched generation of several prompts equals each alone") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    std::vector<Prompt> list = prompts(name);
    std::vector<RequestId> ids;
    std::vector<std::string> streamed(list.size());
    for (size_t i = 0; i < list.size(); i++) {
      auto id = engine->submit(list[i].ids, greedy(), [&streamed, i](const std::string& piece, int32_t) {
        streamed[i] += piece;
        return true;
      });
      REQUIRE_MESSAGE(id, id.error().message);
      ids.push_back(*id);
    }
    REQUIRE(engine->run());
    CHECK(engine->stats().peak_running == int64_t(list.size()));  // they really shared steps
    for (size_t i = 0; i < list.size(); i++) {
      CAPTURE(i);
      CHECK(engine->finished(ids[i]));
      auto generation = engine->result(ids[i]);
      REQUIRE(generation);
      CHECK(generation->ids == list[i].greedy);  // transformers, one prompt at a time
      CHECK(generation->finish_reason == FinishReason::max_tokens);
      // Streaming: whole characters, adding up to what decode gives for all ids at once.
      CHECK(streamed[i] == generation->text);
      CHECK(generation->text == list[i].greedy_text);
    }
    auto again = engine->result(ids[0]);
    REQUIRE_FALSE(again);
    CHECK(again.error().code == ErrorCode::invalid_argument);
    check_pool_empty(*engine);
  }
}

TEST_CASE("under page pressure the newest request is preempted and recomputed with the same tokens") {
  const std::string name = "tiny-llama3";
  std::vector<Prompt> list = prompts(name);
  // Whole prompts in one step, and prompts prefilled 24 tokens at a time (the two short ones start while the
  // long one is still in its last chunk).
  for (int64_t batched_tokens : {128, 24}) {
    CAPTURE(batched_tokens);
    // The KV arena holds exactly one max_model_len sequence: 8 pages of 16 tokens.
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.max_model_len = 128;
    options.plan.max_batched_tokens = batched_tokens;
    auto engine = open_with_pages(name, options, 8);

    // chat, plain_short and plain_mixed with 16 new tokens each need more pages at the end than the 8 there
    // are (82 + 16 tokens alone take 7).
    std::vector<size_t> order = {2, 0, 1};
    int64_t pages_needed = 0;
    for (size_t i : order) pages_needed += engine->arena().kv().pages_for(int64_t(list[i].ids.size()) + 16);
    REQUIRE(pages_needed > 8);
    std::vector<RequestId> ids;
    for (size_t i : order) {
      auto id = engine->submit(list[i].ids, greedy());
      REQUIRE_MESSAGE(id, id.error().message);
      ids.push_back(*id);
    }
    REQUIRE(engine->run());
    CHECK(engine->stats().preemptions > 0);
    CHECK(engine->stats().peak_running >= 2);
    for (size_t k = 0; k < order.size(); k++) {
      CAPTURE(order[k]);
      auto generation = engine->result(ids[k]);
      REQUIRE(generation);
      CHECK(generation->ids == list[order[k]].greedy);
    }
    check_pool_empty(*engine);
  }
}

TEST_CASE("a request that runs out of context finishes with `length`: a prompt that cannot fit is refused up front") {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.max_model_len = 64;
  auto engine = fx::open("tiny-qwen2", options);
  std::vector<int32_t> prompt = prompts("tiny-qwen2")[2].ids;  // 38 tokens
  REQUIRE(prompt.size() == 38);

  // 38 + 27 = 65 > 64: generates until the context is full (26 tokens), as vLLM and transformers do
  SamplingParams no_stop = greedy(27);
  no_stop.ignore_eos = true;
  auto full = engine->generate(prompt, no_stop);
  REQUIRE_MESSAGE(full, full.error().message);
  CHECK(full->finish_reason == FinishReason::length);
  CHECK(std::string(finish_reason_name(full->finish_reason)) == "length");
  REQUIRE(full->ids.size() == 26);
  SamplingParams exact = greedy(26);
  exact.ignore_eos = true;
  auto fits = engine->generate(prompt, exact);  // 64: fits, and stops at max_tokens first
  REQUIRE(fits);
  CHECK(fits->finish_reason == FinishReason::max_tokens);
  CHECK(fits->ids == full->ids);
  check_pool_empty(*engine);

  // a prompt that leaves no room for one output token
  std::vector<int32_t> whole(64, prompt[0]);
  auto refused = engine->submit(whole, greedy(1));
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::does_not_fit);
  const std::string& message = refused.error().message;
  CHECK(message.find("a prompt of 64 tokens") != std::string::npos);
  CHECK(message.find("max_model_len is 64") != std::string::npos);
  CHECK(message.find("below 64 tokens") != std::string::npos);
  std::vector<int32_t> almost(63, prompt[0]);
  auto one = engine->generate(almost, no_stop);
  REQUIRE(one);
  CHECK(one->ids.size() == 1);
  CHECK(one->finish_reason == FinishReason::length);

  std::vector<int32_t> long_ids(65, prompt[0]);
  auto logits = engine->logits(long_ids);
  REQUIRE_FALSE(logits);
  CHECK(logits.error().code == ErrorCode::does_not_fit);
  CHECK(logits.error().message.find("65 tokens") != std::string::npos);
  auto scored = engine->score(long_ids, 65, 32);
  REQUIRE_FALSE(scored);
  CHECK(scored.error().code == ErrorCode::does_not_fit);
  CHECK(scored.error().message.find("context length 65") != std::string::npos);
  CHECK(engine->score(long_ids, 64, 32));  // windows of 64 fit
}

TEST_CASE("invalid requests are refused") {
  auto engine = fx::open("tiny-qwen3");
  auto empty = engine->submit({}, greedy());
  REQUIRE_FALSE(empty);
  CHECK(empty.error().code == ErrorCode::invalid_argument);
  auto outside = engine->submit({5, int32_t(engine->config().text.vocab_size)}, greedy());
  REQUIRE_FALSE(outside);
  CHECK(outside.error().code == ErrorCode::invalid_argument);
  SamplingParams bad = greedy();
  bad.top_p = 0.0f;
  auto invalid = engine->generate(prompts("tiny-qwen3")[0].ids, bad);
  REQUIRE_FALSE(invalid);
  CHECK(invalid.error().code == ErrorCode::invalid_argument);
  auto unknown = engine->result(12345);
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().code == ErrorCode::invalid_argument);
}

TEST_CASE("cancel() stops the running call, from the callback or another thread, and generate keeps its text so far") {
  auto engine = fx::open("tiny-qwen2");
  std::vector<Prompt> list = prompts("tiny-qwen2");
  const std::vector<int32_t> first_three(list[0].greedy.begin(), list[0].greedy.begin() + 3);

  SUBCASE("from the token callback") {
    int tokens = 0;
    std::string streamed;
    auto generation = engine->generate(list[0].ids, greedy(), [&](const std::string& piece, int32_t) {
      streamed += piece;
      if (++tokens == 3) engine->cancel();
      return true;
    });
    REQUIRE(generation);
    CHECK(generation->finish_reason == FinishReason::cancelled);
    CHECK(generation->ids == first_three);
    CHECK(generation->text == streamed);
    CHECK(tokens == 3);
  }
  SUBCASE("from another thread, dropping every request in flight") {
    auto other = engine->submit(list[1].ids, greedy());
    REQUIRE(other);
    std::promise<void> second_token;
    std::promise<void> cancelled;
    std::thread canceller([&] {
      second_token.get_future().wait();
      engine->cancel();
      cancelled.set_value();
    });
    int tokens = 0;
    auto generation = engine->generate(list[0].ids, greedy(), [&](const std::string&, int32_t) {
      if (++tokens == 2) {
        second_token.set_value();
        cancelled.get_future().wait();
      }
      return true;
    });
    canceller.join();
    REQUIRE(generation);
    CHECK(generation->finish_reason == FinishReason::cancelled);
    CHECK(generation->ids == std::vector<int32_t>(list[0].greedy.begin(), list[0].greedy.begin() + 2));
    CHECK(engine->finished(*other));
    auto dropped = engine->result(*other);
    REQUIRE(dropped);
    CHECK(dropped->finish_reason == FinishReason::cancelled);
  }
  check_pool_empty(*engine);
  // The engine goes on as if nothing happened.
  auto generation = engine->generate(list[0].ids, greedy());
  REQUIRE(generation);
  CHECK(generation->ids == list[0].greedy);
}

TEST_CASE("cancel() made while no call runs reaches no later call") {
  auto engine = fx::open("tiny-qwen2");
  std::vector<Prompt> list = prompts("tiny-qwen2");
  engine->cancel();  // idle: aimed at nothing
  auto generation = engine->generate(list[0].ids, greedy());
  REQUIRE_MESSAGE(generation, generation.error().message);
  CHECK(generation->ids == list[0].greedy);
  // Between two step() calls nothing runs either: the next step goes on.
  auto id = engine->submit(list[1].ids, greedy());
  REQUIRE(id);
  REQUIRE(engine->step());
  engine->cancel();
  REQUIRE(engine->run());
  auto result = engine->result(*id);
  REQUIRE(result);
  CHECK(result->ids == list[1].greedy);
  check_pool_empty(*engine);
}

TEST_CASE("cancel(id) ends one request, from the caller, a callback or another thread: the others go on") {
  auto engine = fx::open("tiny-llama3");
  std::vector<Prompt> list = prompts("tiny-llama3");
  REQUIRE(list.size() >= 2);

  SUBCASE("between steps, from the caller") {
    auto keep = engine->submit(list[0].ids, greedy());
    auto drop = engine->submit(list[1].ids, greedy());
    REQUIRE(keep);
    REQUIRE(drop);
    REQUIRE(engine->step());
    REQUIRE(engine->cancel(*drop));
    REQUIRE(engine->run());
    auto dropped = engine->result(*drop);
    REQUIRE(dropped);
    CHECK(dropped->finish_reason == FinishReason::cancelled);
    CHECK(dropped->ids.size() < list[1].greedy.size());
    auto kept = engine->result(*keep);
    REQUIRE(kept);
    CHECK(kept->ids == list[0].greedy);  // the other request is untouched
    // A finished request is left as it is; an id never issued is an error naming it.
    CHECK(engine->cancel(*keep));
    Status never = engine->cancel(*keep + 1000);
    REQUIRE_FALSE(never);
    CHECK(never.error().code == ErrorCode::invalid_argument);
    CHECK(never.error().message.find(std::to_string(*keep + 1000)) != std::string::npos);
  }
  SUBCASE("from another request's token callback, and from another thread") {
    RequestId victim = 0;
    auto keep_callback = [&](const std::string&, int32_t) {
      if (victim) CHECK(engine->cancel(victim));  // cancel the other request from inside a step
      return true;
    };
    auto keep = engine->submit(list[0].ids, greedy(), keep_callback);
    auto drop = engine->submit(list[1].ids, greedy());
    REQUIRE(keep);
    REQUIRE(drop);
    victim = *drop;
    REQUIRE(engine->run());
    auto dropped = engine->result(*drop);
    REQUIRE(dropped);
    CHECK(dropped->finish_reason == FinishReason::cancelled);
    CHECK(engine->result(*keep)->ids == list[0].greedy);

    auto far = engine->submit(list[1].ids, greedy(16));
    REQUIRE(far);
    std::thread other([&] { CHECK(engine->cancel(*far)); });
    other.join();
    REQUIRE(engine->run());
    CHECK(engine->result(*far)->finish_reason == FinishReason::cancelled);
  }
  check_pool_empty(*engine);
}

TEST_CASE("load progress: reported from 0 to the checkpoint's bytes tensor by tensor, and false aborts the open cleanly") {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  options.load_progress = [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
    return true;
  };
  auto engine = fx::open("tiny-qwen3", options);
  REQUIRE(calls.size() >= 2);
  const uint64_t total = calls.front().second;
  CHECK(total == engine->plan().weights_bytes);
  CHECK(calls.front().first == 0);
  CHECK(calls.back().first == total);
  size_t distinct = 1;
  for (size_t i = 1; i < calls.size(); i++) {
    CHECK(calls[i].first >= calls[i - 1].first);
    CHECK(calls[i].second == total);
    distinct += calls[i].first != calls[i - 1].first;
  }
  // The CPU pages the weights in tensor by tensor: a report per tensor, not only (0, total) and (total, total).
  CHECK(distinct > 4);
  const int reports = int(calls.size());
  for (int abort_at : {0, reports / 2, reports - 1}) {  // at the first report, one half way, and the last
    CAPTURE(abort_at);
    int seen = 0;
    options.load_progress = [&](uint64_t, uint64_t) { return seen++ < abort_at; };
    options.plan.device_mem = 64 * MiB;
    auto aborted = Engine::open(fx::dir("tiny-qwen3"), options);
    REQUIRE_FALSE(aborted);
    CHECK(aborted.error().code == ErrorCode::cancelled);
    CHECK(aborted.error().message.find("load-progress callback") != std::string::npos);
  }
  // The engine opened first is untouched, and a new one opens after the aborted ones.
  options.load_progress = nullptr;
  auto again = Engine::open(fx::dir("tiny-qwen3"), options);
  REQUIRE(again);
  CHECK((*again)->generate("hi", greedy(2)));
}

TEST_CASE("log callback: what kvlite reports reaches the host's log at its level, and nothing below the minimum") {
  struct Entry {
    LogLevel level;
    std::string message;
  };
  std::vector<Entry> entries;
  set_log_callback([&](LogLevel level, const std::string& message) { entries.push_back({level, message}); },
                   LogLevel::debug);
  {
    auto engine = fx::open("tiny-qwen2");
    auto id = engine->submit(prompts("tiny-qwen2")[0].ids, greedy());
    REQUIRE(id);
    REQUIRE(engine->cancel(*id));
    REQUIRE(engine->run());
  }
  set_log_callback([&](LogLevel, const std::string&) { throw std::runtime_error("a host's bad callback"); });
  auto quiet = fx::open("tiny-qwen2");  // the throwing callback is contained
  set_log_callback(nullptr);
  auto opened = std::find_if(entries.begin(), entries.end(),
                             [](const Entry& e) { return e.message.rfind("tiny-qwen2: opened ", 0) == 0; });
  REQUIRE(opened != entries.end());
  CHECK(opened->level == LogLevel::info);
  CHECK(opened->message.find("arena") != std::string::npos);
  CHECK(std::any_of(entries.begin(), entries.end(), [](const Entry& e) {
    return e.level == LogLevel::debug && e.message.find("cancelled") != std::string::npos;
  }));
  // At the default minimum (info) debug messages are not delivered.
  entries.clear();
  set_log_callback([&](LogLevel level, const std::string& message) { entries.push_back({level, message}); });
  {
    auto engine = fx::open("tiny-qwen2");
    auto id = engine->submit(prompts("tiny-qwen2")[0].ids, greedy());
    REQUIRE(engine->cancel(*id));
    REQUIRE(engine->run());
  }
  set_log_callback(nullptr);
  CHECK_FALSE(entries.empty());
  for (const Entry& e : entries) CHECK(e.level >= LogLevel::info);
  CHECK(std::string(log_level_name(LogLevel::warning)) == "warning");
}

TEST_CASE("a token callback returning false ends its request") {
  auto engine = fx::open("tiny-qwen3");
  Prompt prompt = prompts("tiny-qwen3")[1];
  int calls = 0;
  auto generation = engine->generate(prompt.ids, greedy(), [&](const std::string&, int32_t) { return ++calls < 4; });
  REQUIRE(generation);
  CHECK(calls == 4);
  CHECK(generation->finish_reason == FinishReason::callback);
  CHECK(generation->ids == std::vector<int32_t>(prompt.greedy.begin(), prompt.greedy.begin() + 4));
  check_pool_empty(*engine);
}

TEST_CASE("stop tokens end generation and are the last id") {
  auto engine = fx::open("tiny-llama3");
  Prompt prompt = prompts("tiny-llama3")[0];
  // The engine's own stop ids include generation_config.json's eos_token_id list.
  for (int32_t id : {1504, 1507, 1508})
    CHECK(std::binary_search(engine->stop_token_ids().begin(), engine->stop_token_ids().end(), id));
  SamplingParams params = greedy();
  params.stop_tokens = {prompt.greedy[5]};
  std::string streamed;
  auto generation = engine->generate(prompt.ids, params, [&](const std::string& piece, int32_t id) {
    CHECK(id != prompt.greedy[5]);  // the stop token's text is not streamed
    streamed += piece;
    return true;
  });
  REQUIRE(generation);
  CHECK(generation->finish_reason == FinishReason::stop_token);
  CHECK(generation->ids == std::vector<int32_t>(prompt.greedy.begin(), prompt.greedy.begin() + 6));
  auto without_stop = engine->detokenize(std::vector<int32_t>(prompt.greedy.begin(), prompt.greedy.begin() + 5));
  REQUIRE(without_stop);
  CHECK(generation->text == *without_stop);
  CHECK(streamed == generation->text);
}

TEST_CASE("stop strings end generation before the string, which is never streamed") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    auto engine = fx::open(name);
    Prompt prompt = prompts(name)[0];
    // A stop string from the middle of transformers' greedy text, spanning a token boundary or not.
    auto head = engine->detokenize(std::vector<int32_t>(prompt.greedy.begin(), prompt.greedy.begin() + 6));
    auto tail = engine->detokenize(std::vector<int32_t>(prompt.greedy.begin(), prompt.greedy.begin() + 9));
    REQUIRE(head);
    REQUIRE(tail);
    std::string stop = tail->substr(head->size() - 1, 3);
    size_t at = prompt.greedy_text.find(stop);
    REQUIRE(at != std::string::npos);
    SamplingParams params = greedy();
    params.stop_strings = {"never appears \xe2\x9c\x93", stop};
    std::string streamed;
    auto generation = engine->generate(prompt.ids, params, [&](const std::string& piece, int32_t) {
      streamed += piece;
      return true;
    });
    REQUIRE(generation);
    CHECK(generation->finish_reason == FinishReason::stop_string);
    CHECK(generation->text == prompt.greedy_text.substr(0, at));
    CHECK(streamed == generation->text);
    CHECK(generation->ids.size() < prompt.greedy.size());
    CHECK(std::equal(generation->ids.begin(), generation->ids.end(), prompt.greedy.begin()));
  }
}

TEST_CASE("seeded sampling is reproducible, alone or batched") {
  auto engine = fx::open("tiny-qwen2");
  std::vector<Prompt> list = prompts("tiny-qwen2");
  SamplingParams params = greedy(24);
  params.temperature = 0.9f;
  params.top_p = 0.95f;
  params.top_k = 50;
  params.seed = 1234;
  auto first = engine->generate(list[0].ids, params);
  auto second = engine->generate(list[0].ids, params);
  REQUIRE(first);
  REQUIRE(second);
  CHECK(first->ids.size() == 24);
  CHECK(first->ids == second->ids);
  CHECK(first->ids != list[0].greedy);  // it did sample
  params.seed = 1235;
  auto other_seed = engine->generate(list[0].ids, params);
  REQUIRE(other_seed);
  CHECK(other_seed->ids != first->ids);
  // Batched with others, each request keeps its own generator.
  params.seed = 1234;
  auto a = engine->submit(list[2].ids, params);
  auto b = engine->submit(list[0].ids, params);
  auto c = engine->submit(list[1].ids, params);
  REQUIRE((a && b && c));
  REQUIRE(engine->run());
  auto batched = engine->result(*b);
  REQUIRE(batched);
  CHECK(batched->ids == first->ids);
}

TEST_CASE("chat generation formats the messages in the model's chat format") {
  auto engine = fx::open("tiny-qwen2");
  const nlohmann::json chat = fx::reference("tiny-qwen2")["prompts"][2];
  std::vector<ChatMessage> messages;
  for (const auto& m : chat["messages"]) messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  auto generation = engine->generate_chat(messages, greedy());
  REQUIRE_MESSAGE(generation, generation.error().message);
  CHECK(generation->prompt_ids == fx::ids_of(chat["input_ids"]));  // apply_chat_template(add_generation_prompt)
  CHECK(generation->ids == fx::ids_of(chat["greedy"]["new_ids"]));
}

TEST_CASE("write_npy writes what numpy.save wrote") {
  for (const char* file : {"logits_0.npy", "logits_2.npy"}) {
    const std::string path = fx::dir("tiny-qwen3") + "/" + file;
    fx::Npy npy = fx::read_npy(path);
    const std::string out = testing_safetensors::temp_dir("engine-npy") + "/" + file;
    REQUIRE(write_npy(out, npy.values.data(), npy.rows, npy.cols));
    CHECK(fx::read_file(out) == fx::read_file(path));  // byte for byte, header padding included
  }
  auto unwritable = write_npy("/nonexistent-dir/x.npy", nullptr, 0, 3);
  REQUIRE_FALSE(unwritable);
  CHECK(unwritable.error().code == ErrorCode::io_error);
  CHECK(unwritable.error().message.find("/nonexistent-dir/x.npy") != std::string::npos);
}

TEST_CASE("nothing is allocated from the arena's memory after start") {
  auto engine = fx::open("tiny-llama3");
  std::vector<Prompt> list = prompts("tiny-llama3");
  for (const Prompt& p : list) REQUIRE(engine->submit(p.ids, greedy()));
  REQUIRE(engine->run());
  REQUIRE(engine->logits(list[0].ids));
  const nlohmann::json perplexity = fx::reference("tiny-llama3")["perplexity"];
  REQUIRE(engine->score(fx::ids_of(perplexity["input_ids"]), 64, 32));
  CHECK(engine->stats().steps > 0);
  CHECK(Arena::allocations_after_start() == 0);
}

TEST_CASE("logprobs: each generated token's log-probability under the model, as transformers' logits and scoring "
          "the whole sequence give it, also when sampling with a penalty and when drafting") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    const nlohmann::json reference = fx::reference(name);
    const nlohmann::json& prompt = reference["prompts"][0];
    const std::vector<int32_t> ids = fx::ids_of(prompt["input_ids"]);
    auto engine = fx::open(name);
    SamplingParams greedy_logprobs = greedy();
    greedy_logprobs.logprobs = true;
    SamplingParams sampled = greedy_logprobs;
    sampled.temperature = 0.9f;
    sampled.top_k = 20;
    sampled.repetition_penalty = 1.3f;  // changes what is drawn, not the model's log-probabilities
    sampled.seed = 7;
    for (const SamplingParams& params : {greedy_logprobs, sampled}) {
      CAPTURE(params.temperature);
      auto generation = engine->generate(ids, params);
      REQUIRE(generation);
      REQUIRE(generation->logprobs.size() == generation->ids.size());
      // The whole sequence's logits, teacher-forced: row p - 1 predicts token p.
      std::vector<int32_t> sequence = ids;
      sequence.insert(sequence.end(), generation->ids.begin(), generation->ids.end());
      auto logits = engine->logits(sequence);
      REQUIRE(logits);
      double worst = 0;
      for (size_t i = 0; i < generation->ids.size(); i++) {
        const float* row = logits->values.data() + (ids.size() + i - 1) * size_t(logits->vocab);
        const double expected = token_logprob(row, logits->vocab, generation->ids[i]);
        CHECK(generation->logprobs[i] <= 0.0f);
        worst = std::max(worst, std::fabs(double(generation->logprobs[i]) - expected));
      }
      CHECK(worst <= 1e-5);
      // The first token's against transformers' own logits of the prompt (its last row).
      const fx::Npy theirs = fx::read_npy(fx::dir(name) + "/" + prompt["logits_file"].get<std::string>());
      const double first = token_logprob(theirs.values.data() + (theirs.rows - 1) * theirs.cols, theirs.cols,
                                         generation->ids[0]);
      CHECK(std::fabs(double(generation->logprobs[0]) - first) <= 1e-4);
    }
    // Off by default: nothing is kept.
    auto plain = engine->generate(ids, greedy());
    REQUIRE(plain);
    CHECK(plain->logprobs.empty());
    // Drafting (n-gram, and the model as its own draft) reports the same log-probabilities.
    auto alone = engine->generate(ids, greedy_logprobs);
    REQUIRE(alone);
    EngineOptions ngram;
    ngram.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    ngram.plan.ngram = 2;
    ngram.plan.speculative_tokens = 4;
    EngineOptions self_draft;
    self_draft.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    self_draft.draft_model = fx::dir(name);
    self_draft.plan.speculative_tokens = 3;
    for (const EngineOptions& options : {ngram, self_draft}) {
      auto drafting = fx::open(name, options);
      auto generation = drafting->generate(ids, greedy_logprobs);
      REQUIRE(generation);
      CHECK(generation->ids == alone->ids);
      REQUIRE(generation->logprobs.size() == alone->logprobs.size());
      for (size_t i = 0; i < alone->logprobs.size(); i++)
        CHECK(std::fabs(generation->logprobs[i] - alone->logprobs[i]) <= 1e-5f);
    }
  }
}

TEST_CASE("op timing: a decode step's ops per layer, counted while it is on, and the same tokens as untimed") {
  for (const char* name : {"tiny-llama3", "tiny-qwen3"}) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const std::vector<int32_t> ids = prompts(name)[0].ids;
    SamplingParams params = greedy();
    params.max_tokens = 9;
    auto untimed = engine->generate(ids, params);
    REQUIRE(untimed);
    CHECK(engine->stats().op_times[size_t(Op::attention)].calls == 0);  // off by default
    engine->set_op_timing(true);
    auto timed = engine->generate(ids, params);
    REQUIRE(timed);
    engine->set_op_timing(false);
    CHECK(timed->ids == untimed->ids);
    // one prefill step and 8 decode steps: every step runs attention and rope_kv_write (the rope of q and k together,
    // then the KV store) once per layer, and neither of the two ops apart
    const OpTimes& ops = engine->stats().op_times;
    const int64_t layers = engine->config().text.num_layers, steps = 9;
    CHECK(ops[size_t(Op::attention)].calls == steps * layers);
    CHECK(ops[size_t(Op::rope_kv_write)].calls == steps * layers);
    CHECK(ops[size_t(Op::kv_write)].calls == 0);
    CHECK(ops[size_t(Op::rope)].calls == 0);
    CHECK(ops[size_t(Op::attention)].seconds > 0.0);
    // the CPU runs q|k|v and gate|up part by part: 7 Linears a layer, + lm_head
    CHECK(ops[size_t(Op::linear)].calls >= steps * 7 * layers);
    CHECK(ops[size_t(Op::linear)].calls <= steps * (7 * layers + 1));
    // and nothing more once it is off again
    REQUIRE(engine->generate(ids, params));
    CHECK(engine->stats().op_times[size_t(Op::attention)].calls == steps * layers);
  }
}

TEST_CASE("each engine logs to its own callback, naming itself, or to the process-wide one with its name") {
  std::vector<std::string> left, right, global;
  set_log_callback([&](LogLevel, const std::string& message) { global.push_back(message); }, LogLevel::debug);
  EngineOptions named;
  named.name = "left";
  named.log = [&](LogLevel, const std::string& message) { left.push_back(message); };
  auto first = fx::open("tiny-qwen2", named);
  EngineOptions own;  // no name: the directory's
  own.log_level = LogLevel::debug;
  own.log = [&](LogLevel, const std::string& message) { right.push_back(message); };
  auto second = fx::open("tiny-qwen3", own);
  auto third = fx::open("tiny-llama3");  // no log of its own: the process-wide one
  auto starts = [](const std::vector<std::string>& lines, const std::string& prefix) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& line) { return line.rfind(prefix, 0) == 0; });
  };
  CHECK(starts(left, "left: opened "));
  CHECK(starts(right, "tiny-qwen3: opened "));
  // A request cancelled in the second engine: its debug line reaches that engine's log only.
  const std::vector<Prompt> list = prompts("tiny-qwen3");
  auto id = second->submit(list[0].ids, greedy());
  REQUIRE(id);
  REQUIRE(second->cancel(*id));
  REQUIRE(second->run());
  CHECK(starts(right, "tiny-qwen3: request " + std::to_string(*id) + " cancelled"));
  CHECK(starts(global, "tiny-llama3: opened "));
  CHECK_FALSE(starts(global, "left: "));
  CHECK_FALSE(starts(global, "tiny-qwen3: "));
  set_log_callback(nullptr);
}
