// threads: one Engine called from several threads at once (issue 43). Every public call holds the engine for
// its run, so concurrent generate / submit / step / result / stats / tokenize / encode_images / cancel give
// exactly what the same calls give one after another (transformers' greedy ids for the tiny fixtures), a
// token callback that tries to start engine work gets a typed error instead of a deadlock, and cancel() is
// async-signal-safe: a real SIGUSR1 whose handler calls it stops a running generate, keeping its partial text.
// Built twice: as test-threads, and as test-threads-tsan (this file with the header's implementation in one TU
// under -fsanitize=thread, tests/CMakeLists.txt), where a data race fails the run.
#include <doctest/doctest.h>
#include <pthread.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {
using engine_helpers::check_pool_empty;
using engine_helpers::greedy;

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> greedy;  // transformers' 16 greedy ids
};

std::vector<Prompt> prompts(const std::string& name) {
  std::vector<Prompt> list;
  const nlohmann::json reference = fx::reference(name);  // kept: a range over a temporary's member dangles
  for (const auto& p : reference["prompts"])
    list.push_back({fx::ids_of(p["input_ids"]), fx::ids_of(p["greedy"]["new_ids"])});
  return list;
}

constexpr int kThreads = 4;
constexpr int kRounds = 3;

// Runs body(thread index) on kThreads threads released together.
template <typename Body>
void run_threads(Body body) {
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++)
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      body(t);
    });
  go.store(true);
  for (std::thread& thread : threads) thread.join();
}

}  // namespace

TEST_CASE("generate from several threads at once gives each thread transformers' greedy ids") {
  for (const std::string& name : {std::string("tiny-qwen2"), std::string("tiny-llama3")}) {
    CAPTURE(name);
    auto engine = fx::open(name);
    const std::vector<Prompt> list = prompts(name);
    // The single-thread results first: the same calls one after another.
    std::vector<Generation> alone;
    for (const Prompt& p : list) alone.push_back(engine->generate(p.ids, greedy()).value());
    for (size_t i = 0; i < list.size(); i++) CHECK(alone[i].ids == list[i].greedy);

    std::vector<std::vector<Generation>> got(kThreads);
    std::vector<std::string> errors(kThreads);
    run_threads([&](int t) {
      for (int round = 0; round < kRounds; round++) {
        const size_t which = size_t(t + round) % list.size();
        std::string streamed;
        auto generation = engine->generate(list[which].ids, greedy(), [&](const std::string& piece, int32_t) {
          streamed += piece;
          return true;
        });
        if (!generation) {
          errors[size_t(t)] = generation.error().message;
          return;
        }
        if (streamed != generation->text) errors[size_t(t)] = "streamed text differs from the result's";
        got[size_t(t)].push_back(std::move(*generation));
      }
    });
    for (int t = 0; t < kThreads; t++) {
      CAPTURE(t);
      CHECK(errors[size_t(t)] == "");
      REQUIRE(got[size_t(t)].size() == size_t(kRounds));
      for (int round = 0; round < kRounds; round++) {
        const size_t which = size_t(t + round) % list.size();
        CHECK(got[size_t(t)][size_t(round)].ids == alone[which].ids);
        CHECK(got[size_t(t)][size_t(round)].text == alone[which].text);
      }
    }
    check_pool_empty(*engine);
    CHECK(engine->stats().tokens_generated == int64_t(list.size() + kThreads * kRounds) * 16);
  }
}

TEST_CASE("submit, step, result, stats, tokenize and cancel(id) from several threads at once") {
  auto engine = fx::open("tiny-qwen3");
  const std::vector<Prompt> list = prompts("tiny-qwen3");
  const std::string text = "Threads share one engine.";
  const std::vector<int32_t> text_ids = engine->tokenize(text).value();

  std::atomic<bool> done{false};
  std::atomic<int64_t> stats_reads{0}, last_steps{0};
  std::atomic<bool> stats_went_back{false};
  std::thread reader([&] {  // stats() never waits for a call to end, and its counters only grow
    while (!done.load()) {
      const int64_t steps = engine->stats().steps;
      if (steps < last_steps.load()) stats_went_back.store(true);
      last_steps.store(steps);
      stats_reads++;
    }
  });
  std::vector<std::string> errors(kThreads);
  std::atomic<int> cancelled_requests{0};
  run_threads([&](int t) {
    for (int round = 0; round < kRounds; round++) {
      const size_t which = size_t(t + round) % list.size();
      auto id = engine->submit(list[which].ids, greedy());
      if (!id) return void(errors[size_t(t)] = id.error().message);
      // Thread 3's last request is cancelled from this thread while the others may be stepping it.
      const bool cancel_it = t == 3 && round == kRounds - 1;
      if (cancel_it && !engine->cancel(*id)) return void(errors[size_t(t)] = "cancel(id) failed");
      while (!engine->finished(*id)) {
        auto more = engine->step();
        if (!more) return void(errors[size_t(t)] = more.error().message);
        auto ids = engine->tokenize(text);  // between steps, from every thread
        if (!ids || *ids != text_ids) return void(errors[size_t(t)] = "tokenize differed");
      }
      auto generation = engine->result(*id);
      if (!generation) return void(errors[size_t(t)] = generation.error().message);
      if (generation->finish_reason == FinishReason::cancelled) {
        cancelled_requests++;
        // Whatever it had generated before the cancel is the reference's beginning.
        const auto& ids = generation->ids;
        if (!std::equal(ids.begin(), ids.end(), list[which].greedy.begin()))
          errors[size_t(t)] = "a cancelled request's ids are not the reference's beginning";
      } else if (generation->ids != list[which].greedy) {
        errors[size_t(t)] = "ids differ from transformers' greedy ids";
      }
    }
  });
  done.store(true);
  reader.join();
  for (int t = 0; t < kThreads; t++) CHECK_MESSAGE(errors[size_t(t)] == "", "thread ", t, ": ", errors[size_t(t)]);
  CHECK(cancelled_requests.load() <= 1);  // it may have finished before the cancel reached a step
  CHECK_FALSE(stats_went_back.load());
  CHECK(stats_reads.load() > 0);
  CHECK(engine->stats().steps >= last_steps.load());
  check_pool_empty(*engine);
}

TEST_CASE("cancel() from another thread stops only the call running then, and the waiting calls go on") {
  auto engine = fx::open("tiny-qwen2");
  const std::vector<Prompt> list = prompts("tiny-qwen2");
  std::atomic<int> cancelled{0}, completed{0};
  std::vector<std::string> errors(kThreads);
  std::atomic<bool> started{false};
  std::thread canceller([&] {
    while (!started.load()) std::this_thread::yield();
    engine->cancel();
  });
  run_threads([&](int t) {
    auto generation = engine->generate(list[size_t(t) % list.size()].ids, greedy(), [&](const std::string&, int32_t) {
      started.store(true);
      return true;
    });
    const std::vector<int32_t>& reference = list[size_t(t) % list.size()].greedy;
    if (generation && generation->finish_reason == FinishReason::cancelled) {
      cancelled++;  // it keeps what it generated: the reference's beginning
      if (!std::equal(generation->ids.begin(), generation->ids.end(), reference.begin()))
        errors[size_t(t)] = "a cancelled generation's ids are not the reference's beginning";
    } else if (generation) {
      if (generation->ids != reference) errors[size_t(t)] = "ids differ";
      completed++;
    } else {
      errors[size_t(t)] = generation.error().message;
    }
  });
  canceller.join();
  for (int t = 0; t < kThreads; t++) CHECK_MESSAGE(errors[size_t(t)] == "", "thread ", t, ": ", errors[size_t(t)]);
  CHECK(cancelled.load() <= 1);  // one call at most was running when cancel() came (none if all had ended)
  CHECK(cancelled.load() + completed.load() == kThreads);
  check_pool_empty(*engine);
}

TEST_CASE("a token callback that starts engine work gets invalid_argument, not a deadlock") {
  auto engine = fx::open("tiny-qwen2");
  const std::vector<Prompt> list = prompts("tiny-qwen2");
  std::string nested_error;
  int64_t steps_seen = -1;
  auto generation = engine->generate(list[0].ids, greedy(4), [&](const std::string&, int32_t) {
    if (nested_error.empty()) {
      auto inner = engine->generate(list[1].ids, greedy(2));
      nested_error = inner ? "ran" : inner.error().message;
      CHECK((!inner && inner.error().code == ErrorCode::invalid_argument));
      steps_seen = engine->stats().steps;  // reading the counters from a callback is allowed
    }
    return true;
  });
  REQUIRE(generation);
  CHECK(generation->ids == std::vector<int32_t>(list[0].greedy.begin(), list[0].greedy.begin() + 4));
  CHECK(nested_error.find("inside a token callback") != std::string::npos);
  CHECK(steps_seen > 0);
}

namespace {
Engine* g_signalled_engine = nullptr;
extern "C" void cancel_on_signal(int) { g_signalled_engine->cancel(); }
}  // namespace

TEST_CASE("cancel() from a signal handler: a real SIGUSR1 stops the running generate") {
  auto engine = fx::open("tiny-qwen2");
  const std::vector<Prompt> list = prompts("tiny-qwen2");
  g_signalled_engine = engine.get();
  struct sigaction action {}, previous {};
  action.sa_handler = cancel_on_signal;
  sigemptyset(&action.sa_mask);
  REQUIRE(sigaction(SIGUSR1, &action, &previous) == 0);

  std::atomic<bool> third_token{false}, signalled{false};
  const pthread_t generating = pthread_self();
  std::thread signaller([&] {  // the signal is raised from a test thread, at the generating thread
    while (!third_token.load()) std::this_thread::yield();
    pthread_kill(generating, SIGUSR1);
    signalled.store(true);
  });
  int tokens = 0;
  auto generation = engine->generate(list[0].ids, greedy(), [&](const std::string&, int32_t) {
    if (++tokens == 3) {
      third_token.store(true);
      while (!signalled.load()) std::this_thread::yield();  // the handler has run on this thread by now
    }
    return true;
  });
  signaller.join();
  sigaction(SIGUSR1, &previous, nullptr);
  g_signalled_engine = nullptr;
  REQUIRE(generation);  // stopped, keeping its text so far
  CHECK(generation->finish_reason == FinishReason::cancelled);
  CHECK(generation->ids == std::vector<int32_t>(list[0].greedy.begin(), list[0].greedy.begin() + 3));
  CHECK(tokens == 3);
  check_pool_empty(*engine);
  CHECK(engine->generate(list[0].ids, greedy()).value().ids == list[0].greedy);
}

TEST_CASE("encode_images from several threads at once equals encoding alone") {
  EngineOptions options;
  options.plan.device_mem = 64 * MiB;
  auto opened = Engine::open(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/vl/tiny-qwen3-vl", options);
  REQUIRE_MESSAGE(opened, opened.error().message);
  Engine& engine = **opened;
  Image image;  // a small deterministic picture
  image.width = 48;
  image.height = 32;
  image.rgb.resize(size_t(image.width * image.height * 3));
  for (size_t i = 0; i < image.rgb.size(); i++) image.rgb[i] = uint8_t((i * 37) % 251);
  VisionInput input = engine.preprocess(image).value();
  const ImageFeatures alone = engine.encode_images({input}).value();
  std::vector<std::string> errors(kThreads);
  run_threads([&](int t) {
    for (int round = 0; round < 2; round++) {
      auto features = engine.encode_images({input});
      if (!features) return void(errors[size_t(t)] = features.error().message);
      if (features->values != alone.values) errors[size_t(t)] = "features differ";
    }
  });
  for (int t = 0; t < kThreads; t++) CHECK_MESSAGE(errors[size_t(t)] == "", "thread ", t, ": ", errors[size_t(t)]);
}

#ifdef KVLITE_IMPLEMENTATION  // test-threads-tsan: the CPU backend's pool itself, under ThreadSanitizer
TEST_CASE("the CPU backend's thread pool runs every item once, back to back and after its workers slept") {
  // Its workers spin on the generation counter for ThreadPool::kSpin after a run and then sleep; the caller
  // spins on the busy count likewise. Runs back to back take the spinning path, runs after a pause longer
  // than kSpin the sleeping one; each item's plain write must be seen by the caller after run() (TSan checks
  // the ordering), and no item may run twice or be skipped.
  for (int threads = 1; threads <= 4; threads++) {
    CAPTURE(threads);
    detail::ThreadPool pool(threads);
    CHECK(pool.threads() == threads);
    std::vector<int> calls(64), workers_seen(static_cast<size_t>(threads));
    int64_t wrong = 0;
    for (int run = 0; run < 600; run++) {
      if (run % 100 == 99) std::this_thread::sleep_for(detail::ThreadPool::kSpin * 5);  // let the workers sleep
      const int64_t items = 1 + run % 61;
      std::fill(calls.begin(), calls.end(), 0);
      std::vector<int> by_worker(size_t(items), -1);
      auto body = [&](int64_t item, int worker) {
        calls[size_t(item)]++;  // one thread per item: a plain increment
        by_worker[size_t(item)] = worker;
      };
      pool.run(items, body);
      for (int64_t item = 0; item < 64; item++) wrong += calls[size_t(item)] != (item < items ? 1 : 0);
      for (int worker : by_worker) {
        wrong += worker < 0 || worker >= threads;
        if (worker >= 0 && worker < threads) workers_seen[size_t(worker)] = 1;
      }
    }
    CHECK(wrong == 0);
    MESSAGE("workers that took items: " << std::count(workers_seen.begin(), workers_seen.end(), 1) << " of " << threads);
  }
}
#endif
