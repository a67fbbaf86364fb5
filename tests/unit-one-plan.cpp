// one-plan: the plan `kvlite plan` shows is the plan the engine runs. plan_engine and Engine::open agree byte
// for byte for every bundled and fixture model; the KV arena holds what max_seqs sequences can use unless
// --kv-fill; every advice line that names a flag is followed, and the plan it gives fits, opens and generates.
#include <doctest/doctest.h>
#include <regex>
#include <string>
#include <utility>
#include <vector>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

const std::string kModels = std::string(KVLITE_SOURCE_DIR) + "/models/";

// Every model directory the project ships or tests with: the bundled captioners (weights), the published
// configs under models/ (no weights) and the tiny transformers fixtures.
std::vector<std::string> every_model_dir() {
  std::vector<std::string> dirs;
  for (const char* name : {"kvlite-captioner-bf16", "kvlite-captioner-fp8", "kvlite-captioner-w4a16",
                           "kvlite-captioner-draft", "llama-3.1-8b-instruct-w4a16", "qwen3-4b",
                           "qwen3-vl-4b-instruct-fp8", "qwen2.5-7b-instruct-yarn"})
    dirs.push_back(kModels + name);
  for (const std::string& name : fx::names()) dirs.push_back(fx::dir(name));
  return dirs;
}

bool has_weights(const std::string& dir) {
  auto store = TensorStore::open_dir(dir);
  return store.ok() && !store->empty();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Plan planned(const std::string& dir, const EngineOptions& options) {
  auto plan = plan_engine(dir, options);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  return std::move(*plan);
}

// The flags an advice line tells the user to pass, as (flag, value): "(--max-model-len 9408)",
// "With --kv-dtype fp8: ...", "With --max-image-pixels 65536: fits ...".
std::vector<std::pair<std::string, std::string>> advised_flags(const std::string& line) {
  static const std::regex flag("--([a-z0-9-]+) ([0-9A-Za-z.]+)");
  std::vector<std::pair<std::string, std::string>> flags;
  for (std::sregex_iterator it(line.begin(), line.end(), flag), end; it != end; ++it)
    flags.emplace_back("--" + (*it)[1].str(), (*it)[2].str());
  return flags;
}

// The options with one advised flag applied; a flag this test does not know fails the test, so a new kind of
// advice cannot go unfollowed.
EngineOptions follow(EngineOptions options, const std::string& flag, const std::string& value) {
  if (flag == "--max-model-len") {
    options.plan.max_model_len = std::stoll(value);
  } else if (flag == "--utilization") {
    options.plan.utilization = std::stod(value);
  } else if (flag == "--kv-dtype") {
    auto dtype = parse_kv_dtype(value);
    REQUIRE(dtype.ok());
    options.plan.kv_dtype = *dtype;
  } else if (flag == "--max-image-pixels") {
    options.plan.max_image_pixels = std::stoll(value);
  } else {
    FAIL("advice names " << flag << " " << value << ", which this test does not know how to follow");
  }
  return options;
}

// Follows every advice line of a plan that does not fit (all the flags a line names, together): each gives a plan
// that fits and, when `run` (the backend is here), an engine that opens with that plan and generates. Returns
// the lines followed.
int follow_every_advice(const std::string& dir, const EngineOptions& options, bool run) {
  const Plan plan = planned(dir, options);
  CAPTURE(plan.table());
  REQUIRE_FALSE(plan.fits);
  int followed = 0;
  for (const std::string& line : plan.advice) {
    // One line is one thing to do: every flag it names, together.
    const auto flags = advised_flags(line);
    if (flags.empty()) continue;
    {
      CAPTURE(line);
      EngineOptions advised = options;
      for (const auto& [flag, value] : flags) advised = follow(advised, flag, value);
      const Plan after = planned(dir, advised);
      CHECK_MESSAGE(after.fits, after.table());
      followed++;
      if (!run || !after.fits) continue;
      auto engine = Engine::open(dir, advised);
      REQUIRE_MESSAGE(engine.ok(), engine.error().message);
      CHECK((*engine)->plan().json() == after.json());
      SamplingParams params;
      params.max_tokens = 2;
      auto generation = (*engine)->generate("Hi", params);
      REQUIRE_MESSAGE(generation.ok(), generation.error().message);
      CHECK(generation->ids.size() >= 1);
    }
  }
  return followed;
}

// CPU options whose budget holds the fixed items plus `kv_pages` pages at utilization 1.
EngineOptions cpu_with_pages(const std::string& dir, EngineOptions options, double pages) {
  options.backend = BackendChoice::cpu;
  options.plan.utilization = 1.0;
  EngineOptions probe_options = options;
  probe_options.plan.device_mem = 64 * GiB;
  const Plan probe = planned(dir, probe_options);
  options.plan.device_mem = probe.fixed_bytes + uint64_t(pages * double(probe.kv_page_bytes));
  return options;
}

}  // namespace

TEST_CASE("one plan: Engine::open runs the plan plan_engine shows, byte for byte, for every bundled and fixture model") {
  int opened = 0;
  for (const std::string& dir : every_model_dir()) {
    CAPTURE(dir);
    std::vector<EngineOptions> variants(4);
    variants[0].backend = BackendChoice::cpu;
    variants[1].backend = BackendChoice::auto_;  // the GPU when there is one (and the model runs there)
    variants[2].backend = BackendChoice::cpu;
    variants[2].plan.device_mem = 3 * GiB;
    variants[2].plan.max_model_len = 128;
    variants[2].plan.max_seqs = 3;
    variants[3].backend = BackendChoice::cpu;
    variants[3].plan.kv_fill = true;
    variants[3].plan.device_mem = 256 * MiB;
    variants[3].plan.utilization = 0.5;
    for (const EngineOptions& options : variants) {
      const Plan plan = planned(dir, options);
      CHECK_FALSE(plan.backend_rule.empty());
      if (!has_weights(dir)) {  // a published config: planned, and the engine says what is missing
        auto engine = Engine::open(dir, options);
        REQUIRE_FALSE(engine.ok());
        CHECK(engine.error().code == ErrorCode::missing_tensor);
        continue;
      }
      if (!plan.fits) continue;  // Engine::open refuses it with the same plan's advice (tested in engine)
      auto engine = Engine::open(dir, options);
      REQUIRE_MESSAGE(engine.ok(), engine.error().message);
      CHECK(model_fixtures::plan_json_for_comparison((*engine)->plan().json()) ==
            model_fixtures::plan_json_for_comparison(plan.json()));
      CHECK((*engine)->plan().table() == plan.table());
      CHECK(uint64_t((*engine)->arena().kv().stats().total_pages) == plan.kv_pages);
      opened++;
    }
  }
  CHECK(opened >= 6 * 3);  // every model with weights, in every variant that fits
}

TEST_CASE("one plan: a planned CUDA card is planned anywhere, and opened only where a GPU is") {
  EngineOptions options;
  options.backend = BackendChoice::cuda;
  options.plan.device_mem = 8 * GiB;
  const std::string dir = fx::dir("tiny-qwen3");
  const Plan plan = planned(dir, options);
  CHECK(plan.device.backend == BackendKind::cuda);
  CHECK(plan.device.total_bytes == 8 * GiB);
  if (cuda::built_with_cuda() && cuda::device_count() > 0) {
    CHECK(plan.device.queried);
    MESSAGE("a GPU is present: --backend cuda plans and opens it (the GPU tests run the engine)");
    return;
  }
  CHECK_FALSE(plan.device.queried);
  CHECK(contains(plan.backend_rule, "planned card"));
  auto engine = Engine::open(dir, options);
  REQUIRE_FALSE(engine.ok());
  CHECK(engine.error().code == (cuda::built_with_cuda() ? ErrorCode::device_error : ErrorCode::unsupported));
  CHECK(contains(engine.error().message, "planned 8.00 GiB card"));
  // Without --device-mem there is no card to plan for: the error says how to get one.
  options.plan.device_mem.reset();
  auto none = plan_engine(dir, options);
  REQUIRE_FALSE(none.ok());
  CHECK(contains(none.error().message, "--device-mem"));
}

TEST_CASE("one plan: auto runs a vision-language model where it runs a text model (the GPU when one is present)") {
  EngineOptions options;
  options.backend = BackendChoice::auto_;
  const Plan vision = planned(kModels + "kvlite-captioner-bf16", options);
  const Plan text = planned(kModels + "qwen3-4b", options);
  CHECK(vision.device.backend == text.device.backend);
  CHECK(vision.backend_rule == text.backend_rule);
  const bool gpu_here = cuda::built_with_cuda() && cuda::device_count() > 0;
  CHECK(vision.device.backend == (gpu_here ? BackendKind::cuda : BackendKind::cpu));
}

TEST_CASE("KV sized to use: the arena holds what max_seqs sequences of max_model_len can use, unless --kv-fill") {
  for (BackendChoice backend : {BackendChoice::cpu, BackendChoice::cuda}) {
    CAPTURE(backend_choice_name(backend));
    EngineOptions options;
    options.backend = backend;
    options.plan.device_mem = 8 * GiB;
    options.plan.max_model_len = 2048;
    options.plan.max_seqs = 1;
    const std::string dir = kModels + "llama-3.1-8b-instruct-w4a16";
    const Plan sized = planned(dir, options);
    REQUIRE(sized.fits);
    CHECK(sized.kv_pages == 2048 / 16);  // one sequence of 2048 tokens in pages of 16
    CHECK(sized.kv_pages_usable == 128);
    CHECK(sized.concurrency == doctest::Approx(1.0));
    // What is left over is left free, and said so.
    const uint64_t outside = sized.fixed_bytes + sized.kv_arena_bytes;
    CHECK(sized.free_bytes == sized.budget_bytes - outside);
    CHECK(sized.free_bytes > 512 * MiB);
    CHECK(contains(sized.table(), "left free"));
    CHECK(contains(sized.json(), "\"free_bytes\""));

    options.plan.kv_fill = true;  // vLLM's way: the whole budget
    const Plan filled = planned(dir, options);
    CHECK(filled.kv_pages > sized.kv_pages);
    CHECK(filled.kv_pages == uint64_t(filled.kv_available_bytes) / filled.kv_page_bytes);
    CHECK(filled.free_bytes < filled.kv_page_bytes);
    CHECK(contains(filled.table(), "--kv-fill"));
    // The verdict, the largest length and the advice do not depend on the cap.
    CHECK(filled.fits == sized.fits);
    CHECK(filled.max_model_len_that_fits == sized.max_model_len_that_fits);
  }
}

TEST_CASE("KV sized to use: the engine's arena is the plan's, and a budget too small for max_seqs still opens") {
  const std::string dir = fx::dir("tiny-llama3");
  EngineOptions options;
  options.plan.max_model_len = 64;
  options.plan.max_seqs = 4;
  options = cpu_with_pages(dir, options, 10.5);  // room for 10 pages; 4 x 64 tokens could use 16
  const Plan plan = planned(dir, options);
  REQUIRE(plan.fits);
  CHECK(plan.kv_pages == 10);
  CHECK(plan.kv_pages_usable == 16);
  CHECK(contains(plan.table(), "all the budget allows"));
  auto engine = Engine::open(dir, options);
  REQUIRE_MESSAGE(engine.ok(), engine.error().message);
  CHECK((*engine)->arena().kv().stats().total_pages == 10);
  CHECK((*engine)->arena().size() == plan.arena_bytes());
}

TEST_CASE("advice that works: every advice line's flags, followed together, fit, open and generate (CPU)") {
  // A length that does not fit in a budget that holds half of it: the largest length and the utilization.
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    EngineOptions options;
    options.plan.max_model_len = 256;
    options = cpu_with_pages(fx::dir(name), options, 256 / 16 / 2 + 0.5);
    options.plan.device_mem = uint64_t(double(*options.plan.device_mem) / 0.5) + 1;
    options.plan.utilization = 0.5;
    const Plan plan = planned(fx::dir(name), options);
    CHECK(contains(plan.table(), "Largest max_model_len"));
    CHECK(contains(plan.table(), "Utilization needed"));
    CHECK(follow_every_advice(fx::dir(name), options, true) >= 2);
  }
  // A vision model whose image budget crowds out its KV: a smaller image budget (and the other advice).
  const std::string captioner = kModels + "kvlite-captioner-bf16";
  EngineOptions options;
  options.plan.max_image_pixels = 65536;  // 64 image tokens instead of the default 16
  EngineOptions small = options;
  small.plan.max_image_pixels = 16384;
  small = cpu_with_pages(captioner, small, 16.5);  // the default budget's fixed items + one 256-token sequence
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = *small.plan.device_mem * 2;  // at utilization 0.5: 16.5 pages beside the default budget
  options.plan.utilization = 0.5;
  const Plan plan = planned(captioner, options);
  CHECK(contains(plan.table(), "--max-image-pixels"));
  CHECK(follow_every_advice(captioner, options, true) >= 2);
}

TEST_CASE("advice that works: on planned 8 GiB CUDA cards (the README's cases), every advised flag fits") {
  struct Case {
    const char* model;
    double utilization;
    int64_t max_model_len;
    bool wsl2;
  };
  const bool gpu = cuda::built_with_cuda() && cuda::device_count() > 0;
  for (const Case& c : {Case{"qwen3-vl-4b-instruct-fp8", 0.80, 4096, true}, Case{"qwen3-vl-4b-instruct-fp8", 0.70, 2048, false},
                        Case{"llama-3.1-8b-instruct-w4a16", 0.90, 131072, false},
                        Case{"llama-3.1-8b-instruct-w4a16", 0.80, 8192, false}}) {
    CAPTURE(std::string(c.model));
    EngineOptions options;
    options.backend = BackendChoice::cuda;
    options.plan.device_mem = 8 * GiB;
    options.plan.utilization = c.utilization;
    options.plan.max_model_len = c.max_model_len;
    options.plan.max_seqs = 1;
    options.plan.wsl2 = c.wsl2;
    // No weights here, so nothing opens: the followed plans must fit (the engine opens what fits: above).
    CHECK(follow_every_advice(kModels + c.model, options, false) >= 1);
  }
  if (!gpu) MESSAGE("no GPU: the planned cards' advice is checked as plans only");
}

TEST_CASE("advice that works: no line advises what the model already is or what the backend cannot store") {
  // The W4A16 Llama on a card too small for its weights: told it needs a larger card, not to quantize.
  EngineOptions options;
  options.backend = BackendChoice::cuda;
  options.plan.device_mem = 4 * GiB;
  options.plan.max_model_len = 2048;
  const Plan plan = planned(kModels + "llama-3.1-8b-instruct-w4a16", options);
  REQUIRE_FALSE(plan.fits);
  for (const std::string& line : plan.advice) {
    CAPTURE(line);
    CHECK_FALSE(contains(line, "use a quantized checkpoint"));
    if (contains(line, "--kv-dtype fp8")) CHECK(kv_dtype_storable(plan.device.backend, KVDType::fp8));
  }
}

TEST_CASE("integrated GPU: planned against the shared memory that was free, and the plan says so") {
  DeviceSpec jetson;
  jetson.backend = BackendKind::cuda;
  jetson.name = "Orin";
  jetson.total_bytes = 7 * GiB + 512 * MiB;  // what cudaMemGetInfo reports on an 8 GB Orin: the system's memory
  jetson.free_bytes = 5 * GiB;                // what the OS and the other processes left
  jetson.sm = 87;
  jetson.queried = true;
  jetson.integrated = true;
  auto device = plan_gpu_device(jetson, std::nullopt);
  REQUIRE_MESSAGE(device.ok(), device.error().message);
  CHECK(device->total_bytes == 5 * GiB);
  CHECK(device->shared_total_bytes == 7 * GiB + 512 * MiB);
  CHECK(contains(device->name, "integrated"));
  PlanInputs inputs;
  auto read = read_plan_inputs(fx::dir("tiny-qwen3"));
  REQUIRE(read.ok());
  auto plan = make_plan(*read, *device, PlanOptions{});
  REQUIRE(plan.ok());
  CHECK(plan->budget_bytes == uint64_t(0.90 * double(5 * GiB)));
  CHECK(contains(plan->table(), "integrated: planned against the 5.00 GiB free of the 7.50 GiB"));
  CHECK(contains(plan->json(), "\"integrated\": true"));
  // --device-mem beyond what is free is refused with both numbers; within it, a card of that size.
  auto too_much = plan_gpu_device(jetson, 6 * GiB);
  REQUIRE_FALSE(too_much.ok());
  CHECK(too_much.error().code == ErrorCode::invalid_argument);
  CHECK(contains(too_much.error().message, "5.00 GiB"));
  auto within = plan_gpu_device(jetson, 4 * GiB);
  REQUIRE(within.ok());
  CHECK(within->total_bytes == 4 * GiB);
  // A discrete card is planned against its whole memory, as before.
  DeviceSpec discrete = jetson;
  discrete.integrated = false;
  auto card = plan_gpu_device(discrete, std::nullopt);
  REQUIRE(card.ok());
  CHECK(card->total_bytes == 7 * GiB + 512 * MiB);
  CHECK_FALSE(contains(card->name, "integrated"));
}
