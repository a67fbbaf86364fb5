// validation: every public entry point checks the numbers it is given before it computes with them (issue 47).
// One regression per defect a fuzzing round found, named after it, each checked to fail on the code before its
// fix: max_tokens near INT64_MAX, PreprocessOptions products, thread counts, K-only or V-only fp8 KV scales and
// processor normalization values (the server's JSON nesting is in unit-serve.cpp). Then the bounds the audit
// (bench/AUDIT-47.md) lists, at their edges.
#include <doctest/doctest.h>
#include <climits>
#include <limits>
#include <thread>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

bool mentions(const Error& error, const std::string& text) { return error.message.find(text) != std::string::npos; }

EngineOptions small_cpu(int64_t max_model_len = 64) {
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = 64 * MiB;
  options.plan.max_model_len = max_model_len;
  options.threads = 1;
  return options;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = std::string(KVLITE_BINARY_DIR) + "/test-tmp/validation-" + name;
  REQUIRE(std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str()) == 0);
  return dir;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ofstream(to, std::ios::binary) << fx::read_file(from);
}

// tiny-llama3-fp8kv (a kv_cache_scheme checkpoint) copied to a fresh directory with the tensors `keep` accepts.
template <class Keep>
std::string fp8kv_copy(const std::string& name, Keep keep, bool with_scheme = true) {
  const std::string source = fx::dir("tiny-llama3-fp8kv"), dir = fresh_dir(name);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    copy_file(source + "/" + file, dir + "/" + file);
  nlohmann::json config = nlohmann::json::parse(fx::read_file(source + "/config.json"));
  if (!with_scheme) config.erase("quantization_config");
  std::ofstream(dir + "/config.json") << config.dump();
  TensorStore store = TensorStore::open_dir(source).value();
  std::vector<testing_safetensors::Tensor> tensors;
  for (const TensorInfo& info : store.tensors()) {
    if (!keep(info.name)) continue;
    const uint8_t* data = store.data(info);
    tensors.push_back({info.name, dtype_name(info.dtype), info.shape, std::vector<uint8_t>(data, data + info.nbytes)});
  }
  testing_safetensors::write_file(dir + "/model.safetensors", tensors);
  return dir;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

// ---- 1. max_tokens ---------------------------------------------------------------------------------------

TEST_CASE("regression: max_tokens near INT64_MAX overflowed prompt + max_tokens in submit (C++ and C API)") {
  auto engine = Engine::open(fx::dir("tiny-llama3"), small_cpu()).value();
  SamplingParams params;
  params.max_tokens = INT64_MAX;
  const std::vector<int32_t> prompt = {1, 2, 3};

  Result<RequestId> submitted = engine->submit(prompt, params);
  REQUIRE_FALSE(submitted.ok());
  CHECK(submitted.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(submitted.error(), "max_tokens"));
  CHECK(mentions(submitted.error(), "KVLITE_MAX_NEW_TOKENS"));
  Result<Generation> generated = engine->generate("hello", params);
  REQUIRE_FALSE(generated.ok());
  CHECK(generated.error().code == ErrorCode::invalid_argument);
  Result<Generation> chatted = engine->generate_chat({{"user", "hello"}}, params);
  REQUIRE_FALSE(chatted.ok());
  CHECK(chatted.error().code == ErrorCode::invalid_argument);

  // The largest accepted count means "until the context is full": it ends at max_model_len with `length`.
  params.max_tokens = limits::max_new_tokens;
  params.ignore_eos = true;
  Result<Generation> full = engine->generate(prompt, params);
  REQUIRE_MESSAGE(full.ok(), full.error().message);
  CHECK(full->finish_reason == FinishReason::length);
  CHECK(int64_t(full->ids.size()) + int64_t(prompt.size()) == 64);
  params.max_tokens = limits::max_new_tokens + 1;
  CHECK(engine->submit(prompt, params).error().code == ErrorCode::invalid_argument);

  // The C API's three generating calls.
  kvlite_options options;
  kvlite_options_init(&options);
  options.backend = KVLITE_BACKEND_CPU;
  options.device_mem = 64 * MiB;
  options.max_model_len = 64;
  options.threads = 1;
  kvlite_engine* c_engine = nullptr;
  REQUIRE(kvlite_open(fx::dir("tiny-llama3").c_str(), &options, nullptr, nullptr, &c_engine) == KVLITE_OK);
  kvlite_sampling sampling;
  kvlite_sampling_init(&sampling);
  sampling.max_tokens = INT64_MAX;
  kvlite_generation out{};
  CHECK(kvlite_generate(c_engine, "hello", nullptr, 0, &sampling, nullptr, nullptr, &out) == KVLITE_INVALID_ARGUMENT);
  CHECK(std::string(kvlite_last_error()).find("max_tokens") != std::string::npos);
  const char* roles[] = {"user"};
  const char* contents[] = {"hello"};
  CHECK(kvlite_generate_chat(c_engine, roles, contents, 1, nullptr, 0, &sampling, nullptr, nullptr, &out) ==
        KVLITE_INVALID_ARGUMENT);
  int64_t request = -1;
  CHECK(kvlite_submit(c_engine, prompt.data(), prompt.size(), nullptr, 0, &sampling, nullptr, nullptr, &request) ==
        KVLITE_INVALID_ARGUMENT);
  CHECK(request == -1);
  kvlite_close(c_engine);
}

TEST_CASE("sampling parameters are refused by name at each edge of their range") {
  auto refused = [](SamplingParams p, const char* name) {
    Status status = validate(p);
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().code == ErrorCode::invalid_argument);
    CHECK(mentions(status.error(), name));
  };
  CHECK(validate(SamplingParams{}).ok());
  SamplingParams p;
  p.max_tokens = 0;
  refused(p, "max_tokens");
  p = {};
  p.temperature = -0.0001f;
  refused(p, "temperature");
  p = {};
  p.top_k = -1;
  refused(p, "top_k");
  p = {};
  p.top_p = 0;
  refused(p, "top_p");
  p = {};
  p.min_p = 1.5f;
  refused(p, "min_p");
  p = {};
  p.repetition_penalty = std::numeric_limits<float>::infinity();
  refused(p, "repetition_penalty");
  p = {};
  p.stop_strings.assign(size_t(limits::max_stop_entries) + 1, "x");
  refused(p, "KVLITE_MAX_STOP_ENTRIES");
  p = {};
  p.stop_tokens.assign(size_t(limits::max_stop_entries) + 1, 0);
  refused(p, "KVLITE_MAX_STOP_ENTRIES");
  p = {};
  p.stop_strings = {std::string(size_t(limits::max_stop_string_bytes) + 1, 'x')};
  refused(p, "KVLITE_MAX_STOP_STRING_BYTES");
  p = {};
  p.top_k = INT64_MAX;  // larger than any vocabulary: off, and only ever compared
  CHECK(validate(p).ok());
}

// ---- 2. PreprocessOptions --------------------------------------------------------------------------------

TEST_CASE("regression: PreprocessOptions patch_size x merge_size overflowed in image_grid") {
  PreprocessOptions options;
  options.patch_size = int64_t(1) << 32;
  options.merge_size = int64_t(1) << 32;  // the product is 2^64: it wrapped to 0
  Result<ImageGrid> grid = image_grid(224, 224, options);
  REQUIRE_FALSE(grid.ok());
  CHECK(grid.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(grid.error(), "patch_size"));
  CHECK(mentions(grid.error(), "KVLITE_MAX_VISION_PATCH"));

  for (int64_t PreprocessOptions::*field :
       {&PreprocessOptions::patch_size, &PreprocessOptions::merge_size, &PreprocessOptions::temporal_patch_size}) {
    PreprocessOptions edge;
    edge.*field = limits::max_vision_patch + 1;
    CHECK(image_grid(224, 224, edge).error().code == ErrorCode::invalid_argument);
    edge.*field = 0;
    CHECK(image_grid(224, 224, edge).error().code == ErrorCode::invalid_argument);
  }
  PreprocessOptions pixels;
  pixels.max_pixels = limits::max_processor_pixels + 1;
  CHECK(mentions(image_grid(224, 224, pixels).error(), "KVLITE_MAX_PROCESSOR_PIXELS"));
  CHECK(smart_resize(224, 224, INT64_MAX, 1, 1 << 20).error().code == ErrorCode::invalid_argument);
  CHECK(smart_resize(224, 224, 32, 1, INT64_MAX).error().code == ErrorCode::invalid_argument);
  // The published sizes still give Qwen3-VL's grid.
  ImageGrid published = image_grid(224, 224, PreprocessOptions{}).value();
  CHECK(published.grid_h == 16);
  CHECK(published.image_tokens == 64);
}

// ---- 3. threads ------------------------------------------------------------------------------------------

TEST_CASE("regression: a thread count of INT32_MAX reserved 16 GiB before failing (make_cpu_backend, Engine::open, kvlite_open)") {
  const int cap = max_cpu_threads();
  CHECK(cap == int(std::max(1u, std::thread::hardware_concurrency())) * limits::max_threads_per_hardware_thread);
  CpuBackendOptions backend_options;
  backend_options.threads = cap + 1;  // (first: before the fix this one started, and INT32_MAX below reserved)
  Result<std::unique_ptr<Backend>> backend = make_cpu_backend(backend_options);
  REQUIRE_FALSE(backend.ok());
  CHECK(backend.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(backend.error(), "KVLITE_MAX_THREADS_PER_HARDWARE_THREAD"));
  backend_options.threads = INT32_MAX;
  CHECK(make_cpu_backend(backend_options).error().code == ErrorCode::invalid_argument);
  backend_options.threads = 2;
  CHECK(make_cpu_backend(backend_options).ok());

  EngineOptions options = small_cpu();
  options.threads = cap + 1;
  Result<std::unique_ptr<Engine>> engine = Engine::open(fx::dir("tiny-llama3"), options);
  REQUIRE_FALSE(engine.ok());
  CHECK(engine.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(engine.error(), "EngineOptions::threads"));
  CHECK(plan_engine(fx::dir("tiny-llama3"), options).error().code == ErrorCode::invalid_argument);

  kvlite_options c_options;
  kvlite_options_init(&c_options);
  c_options.backend = KVLITE_BACKEND_CPU;
  c_options.device_mem = 64 * MiB;
  c_options.threads = INT32_MAX;
  kvlite_engine* c_engine = nullptr;
  CHECK(kvlite_open(fx::dir("tiny-llama3").c_str(), &c_options, nullptr, nullptr, &c_engine) == KVLITE_INVALID_ARGUMENT);
  CHECK(c_engine == nullptr);
  CHECK(std::string(kvlite_last_error()).find("kvlite_options.threads") != std::string::npos);
}

// ---- 5. fp8 KV scales ------------------------------------------------------------------------------------

TEST_CASE("regression: a kv_cache_scheme checkpoint with K scales only or V scales only opened (refused at open, naming the missing tensor)") {
  struct Case {
    const char* name;
    const char* dropped;  // the scale kind left out
    bool with_scheme;
  };
  // K only: opened, then every fp8 forward failed; V only: the scales were ignored (logits as with none). The
  // same without a declared scheme.
  for (const Case& c : {Case{"k-only", "v_scale", true}, Case{"v-only", "k_scale", true},
                        Case{"k-only-no-scheme", "v_scale", false}, Case{"v-only-no-scheme", "k_scale", false}}) {
    CAPTURE(c.name);
    const std::string dir = fp8kv_copy(c.name, [&](const std::string& name) { return !ends_with(name, c.dropped); },
                                       c.with_scheme);
    EngineOptions options = small_cpu();
    options.plan.kv_dtype = KVDType::fp8;
    Result<std::unique_ptr<Engine>> engine = Engine::open(dir, options);
    REQUIRE_FALSE(engine.ok());
    CHECK(engine.error().code == ErrorCode::missing_tensor);
    CHECK(mentions(engine.error(), std::string("model.layers.0.self_attn.") + c.dropped + " is missing"));
  }
  // A declared scheme with no scales at all, and one layer's V scale missing.
  const std::string none = fp8kv_copy("no-scales", [](const std::string& name) {
    return !ends_with(name, "k_scale") && !ends_with(name, "v_scale");
  });
  CHECK(mentions(Engine::open(none, small_cpu()).error(), "model.layers.0.self_attn.k_scale is missing"));
  const std::string one = fp8kv_copy("one-layer", [](const std::string& name) { return name != "model.layers.1.self_attn.v_scale"; });
  CHECK(mentions(Engine::open(one, small_cpu()).error(), "model.layers.1.self_attn.v_scale is missing"));
  // Both scales on every layer, or no scheme and no scales, open.
  CHECK(Engine::open(fp8kv_copy("complete", [](const std::string&) { return true; }), small_cpu()).ok());
  CHECK(Engine::open(fx::dir("tiny-llama3"), small_cpu()).ok());
}

// ---- 6. processor values ---------------------------------------------------------------------------------

TEST_CASE("regression: image_mean 1e308 in preprocessor_config.json loaded and every image was then refused") {
  const std::string dir = fresh_dir("processor");
  copy_file(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/configs/tiny-qwen3-vl.json", dir + "/config.json");
  auto load_with = [&](const std::string& processor) {
    std::ofstream(dir + "/preprocessor_config.json") << processor;
    return load_config(dir);
  };
  Result<ModelConfig> huge = load_with(R"({"image_mean": [1e308, 0.5, 0.5]})");
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().code == ErrorCode::bad_format);
  CHECK(mentions(huge.error(), "preprocessor_config.json"));
  CHECK(mentions(huge.error(), "image_mean[0]"));
  CHECK(mentions(huge.error(), "KVLITE_IMAGE_MEAN_MARGIN"));

  for (const char* processor : {R"({"image_mean": -1.5})", R"({"image_mean": [0.5, 0.5, 2.01]})",
                                R"({"image_std": 1e-9})", R"({"image_std": [0.5, -0.5, 0.5]})",
                                R"({"image_std": 1e300})", R"({"rescale_factor": 1e300})",
                                R"({"rescale_factor": 1e-300})"}) {
    CAPTURE(processor);
    Result<ModelConfig> refused = load_with(processor);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.error().code == ErrorCode::bad_format);
    CHECK(mentions(refused.error(), "preprocessor_config.json"));
  }
  // Published values load: Qwen's, CLIP's, ImageNet's.
  for (const char* processor : {R"({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 0.00392156862745098})",
                                R"({"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]})",
                                R"({"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]})"}) {
    CAPTURE(processor);
    CHECK(load_with(processor).ok());
  }
  // The same ranges hold for a caller's PreprocessOptions.
  PreprocessOptions options;
  options.image_mean[1] = 1e308;
  CHECK(mentions(image_grid(224, 224, options).error(), "image_mean[1]"));
  options = {};
  options.image_std[2] = 1e-30;
  CHECK(mentions(image_grid(224, 224, options).error(), "image_std[2]"));
  options = {};
  options.rescale_factor = 1e308;
  CHECK(mentions(image_grid(224, 224, options).error(), "rescale_factor"));
}

// Found by the audit of issue 47: both sides at most 2^24 still made 2^48 pixels (an allocation of 768 TiB that
// failed as out_of_memory), and a stride of INT64_MAX made row addresses overflow.
TEST_CASE("image_from_pixels bounds the pixel count (KVLITE_MAX_IMAGE_PIXELS) and the stride before reading") {
  const uint8_t pixel[4] = {1, 2, 3, 4};
  Result<Image> huge = image_from_pixels(pixel, int64_t(1) << 24, int64_t(1) << 24, PixelFormat::rgb8, 0);
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(huge.error(), "KVLITE_MAX_IMAGE_PIXELS"));
  Result<Image> strided = image_from_pixels(pixel, 1, 2, PixelFormat::gray8, INT64_MAX);
  REQUIRE_FALSE(strided.ok());
  CHECK(mentions(strided.error(), "stride"));
  Result<Image> one = image_from_pixels(pixel, 1, 1, PixelFormat::rgba8, 0);
  REQUIRE(one.ok());
  CHECK(one->rgb.size() == 3);
}

// Found by tests/fuzz/fuzz_processor_config.cpp: a file that sets only a maximum below kvlite's default minimum
// (65536 pixels) loaded, and then every image was refused ("max_pixels is below min_pixels").
TEST_CASE("regression: a processor maximum below kvlite's default minimum loaded and refused every image") {
  const std::string dir = fresh_dir("processor-budget");
  copy_file(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/configs/tiny-qwen3-vl.json", dir + "/config.json");
  std::ofstream(dir + "/preprocessor_config.json") << R"({"size": {"longest_edge": 4096}})";
  Result<ModelConfig> refused = load_config(dir);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::bad_format);
  CHECK(mentions(refused.error(), "kvlite's default"));
  std::ofstream(dir + "/preprocessor_config.json") << R"({"size": {"longest_edge": 4096, "shortest_edge": 1024}})";
  REQUIRE(load_config(dir).ok());
  CHECK(image_grid(100, 80, preprocess_options(load_config(dir).value())).ok());
}


// Found by the audit of issue 47: rows x cols was multiplied unchecked (signed overflow for a huge shape).
TEST_CASE("write_npy checks rows x cols x 4 for overflow before using it") {
  const std::string path = std::string(KVLITE_BINARY_DIR) + "/test-tmp/validation-huge.npy";
  const float value = 1.0f;
  Status huge = write_npy(path, &value, INT64_MAX, 3);
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().code == ErrorCode::invalid_argument);
  CHECK(mentions(huge.error(), "write_npy"));
  CHECK(write_npy(path, &value, -1, 1).error().code == ErrorCode::invalid_argument);
  CHECK(write_npy(path, &value, 1, 1).ok());
}
