// vision: Qwen3-VL end to end against transformers' float32 outputs for the tiny fixture model of
// tests/fixtures/vl (tools/make_vl_fixtures.py): preprocessing, the vision tower and its DeepStack features,
// M-RoPE positions, fused prefill logits and greedy decoding, with and without chunked prefill and batching.
// Then Qwen2.5-VL against tests/fixtures/vl/qwen2_5_vl (tools/make_vl25_fixtures.py): its config traits, the
// processor on PNG / JPEG files, the windowed tower, sectioned M-RoPE, logits rows, greedy captions, the plan.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

// The fixture's tolerance: max |kvlite - transformers| / max |transformers| over a tensor.
constexpr double kTolerance = 1e-4;

std::string fixtures_dir() { return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/"; }
std::string model_dir() { return fixtures_dir() + "vl/tiny-qwen3-vl"; }
nlohmann::json reference() { return nlohmann::json::parse(fx::read_file(fixtures_dir() + "vl/reference.json")); }

// The fixture's prompts carry up to two images, and a request's images are encoded together: plan for two.
EngineOptions fixture_options() {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.device_mem = 64 * MiB;
  options.plan.max_images = 2;
  return options;
}

std::unique_ptr<Engine> open_model(const EngineOptions& options = fixture_options()) {
  auto engine = Engine::open(model_dir(), options);
  if (!engine) throw std::runtime_error("open tiny-qwen3-vl: " + engine.error().message);
  return std::move(*engine);
}

// A prompt's images as transformers' processor gave them: its pixel_values and grid.
std::vector<VisionInput> fixture_images(const nlohmann::json& prompt) {
  std::vector<VisionInput> images;
  for (const auto& image : prompt["images"]) {
    VisionInput input;
    fx::Npy pixels = fx::read_npy(fixtures_dir() + image["pixel_values_file"].get<std::string>());
    input.pixel_values = pixels.values;
    input.row_size = pixels.cols;
    auto grid = image["grid_thw"].get<std::vector<int64_t>>();
    input.grid.grid_t = grid[0];
    input.grid.grid_h = grid[1];
    input.grid.grid_w = grid[2];
    input.grid.resized_height = grid[1] * 16;
    input.grid.resized_width = grid[2] * 16;
    input.grid.image_tokens = image["image_tokens"].get<int64_t>();
    REQUIRE(input.rows() == grid[0] * grid[1] * grid[2]);
    images.push_back(std::move(input));
  }
  return images;
}

// The ids before the processor expanded them: each run of <|image_pad|> back to one placeholder.
std::vector<int32_t> collapsed_ids(const nlohmann::json& prompt, int32_t image_token_id) {
  std::vector<int32_t> ids;
  for (int32_t id : fx::ids_of(prompt["input_ids"]))
    if (id != image_token_id || ids.empty() || ids.back() != image_token_id) ids.push_back(id);
  return ids;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Image load_fixture_image(const nlohmann::json& image) {
  auto loaded = load_image(fixtures_dir() + image["file"].get<std::string>());
  REQUIRE_MESSAGE(loaded, loaded.error().message);
  return std::move(*loaded);
}

// Runs a built program with these arguments (no shell quoting needed: the paths are the repository's);
// returns its stdout, and its exit status through `status`.
std::string run_program(const std::string& command_line, int& status) {
  FILE* pipe = popen((command_line + " 2>/dev/null").c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) out.append(buffer, n);
  const int raw = pclose(pipe);
  status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return out;
}

}  // namespace

TEST_CASE("the fixture's images preprocess to transformers' pixel_values, bit for bit") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  int checked = 0;
  for (const auto& prompt : ref["prompts"])
    for (const auto& image : prompt["images"]) {
      CAPTURE(image["file"].get<std::string>());
      auto input = engine->preprocess(load_fixture_image(image));
      REQUIRE_MESSAGE(input, input.error().message);
      auto grid = image["grid_thw"].get<std::vector<int64_t>>();
      CHECK(input->grid.grid_t == grid[0]);
      CHECK(input->grid.grid_h == grid[1]);
      CHECK(input->grid.grid_w == grid[2]);
      CHECK(input->grid.image_tokens == image["image_tokens"].get<int64_t>());
      fx::Npy expected = fx::read_npy(fixtures_dir() + image["pixel_values_file"].get<std::string>());
      CHECK(input->pixel_values == expected.values);
      checked++;
    }
  CHECK(checked == 3);
}

TEST_CASE("the vision tower's merged embeddings and each DeepStack feature match transformers") {
  // One image per encode (the default max_images), and both images of the second prompt in one encode, where
  // attention must stay within each image (as transformers runs them: one call, cu_seqlens). The plan holds
  // 8192 / 32^2 x 4 = 32 patches per image: the wide and tall images (32 each) fill one encode of two.
  for (int64_t max_images : {1, 2}) {
    CAPTURE(max_images);
    EngineOptions options = fixture_options();
    options.plan.max_images = max_images;
    auto engine = open_model(options);
    const nlohmann::json ref = reference();
    for (const auto& prompt : ref["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      auto features = engine->encode_images(fixture_images(prompt));
      REQUIRE_MESSAGE(features, features.error().message);
      const auto& deepstack_files = prompt["deepstack_files"];
      REQUIRE(features->levels == 1 + int64_t(deepstack_files.size()));
      for (int64_t level = 0; level < features->levels; level++) {
        CAPTURE(level);
        const std::string file = level == 0 ? prompt["vision_file"].get<std::string>()
                                            : deepstack_files[size_t(level - 1)].get<std::string>();
        fx::Npy expected = fx::read_npy(fixtures_dir() + "vl/" + file);
        REQUIRE(features->tokens == expected.rows);
        REQUIRE(features->hidden == expected.cols);
        std::vector<float> got(features->values.begin() + level * expected.rows * expected.cols,
                               features->values.begin() + (level + 1) * expected.rows * expected.cols);
        CHECK(fx::relative_max_diff(got, expected.values) <= kTolerance);
      }
    }
  }
}

TEST_CASE("mrope_positions equals get_rope_index: positions (3, S) and rope_delta") {
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    std::vector<ImageGrid> grids;
    for (const VisionInput& image : fixture_images(prompt)) grids.push_back(image.grid);
    auto positions = mrope_positions(fx::ids_of(prompt["input_ids"]), pad, grids, 2);
    REQUIRE_MESSAGE(positions, positions.error().message);
    std::vector<int32_t> expected;
    for (const auto& row : prompt["position_ids"])
      for (int32_t p : row.get<std::vector<int32_t>>()) expected.push_back(p);
    CHECK(positions->positions == expected);
    CHECK(positions->rope_delta == prompt["rope_delta"].get<int64_t>());
  }
  // Text alone is ordinary RoPE with rope_delta 0.
  auto text = mrope_positions({5, 6, 7}, pad, {}, 2);
  REQUIRE(text);
  CHECK(text->positions == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2});
  CHECK(text->rope_delta == 0);
}

TEST_CASE("mrope_positions refuses image tokens that do not match the grids") {
  const int32_t pad = 9;
  ImageGrid grid;  // 1 x 4 x 6 patches: 2 x 3 tokens
  grid.grid_t = 1;
  grid.grid_h = 4;
  grid.grid_w = 6;
  grid.image_tokens = 6;
  std::vector<int32_t> five = {1, pad, pad, pad, pad, pad, 2};
  auto short_run = mrope_positions(five, pad, {grid}, 2);
  REQUIRE_FALSE(short_run);
  CHECK(short_run.error().code == ErrorCode::invalid_argument);
  CHECK(short_run.error().message.find("has 5 tokens") != std::string::npos);
  std::vector<int32_t> six = {1, pad, pad, pad, pad, pad, pad, 2};
  auto no_grid = mrope_positions(six, pad, {}, 2);
  REQUIRE_FALSE(no_grid);
  CHECK(no_grid.error().message.find("only 0 image grids") != std::string::npos);
  auto extra_grid = mrope_positions(six, pad, {grid, grid}, 2);
  REQUIRE_FALSE(extra_grid);
  CHECK(extra_grid.error().message.find("2 image grids given") != std::string::npos);
  CHECK(mrope_positions(six, pad, {grid}, 2).ok());
}

TEST_CASE("logits of prompts with one and two images match transformers in float32") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    fx::Npy expected = fx::read_npy(fixtures_dir() + "vl/" + prompt["logits_file"].get<std::string>());
    auto logits = engine->logits(collapsed_ids(prompt, pad), fixture_images(prompt));
    REQUIRE_MESSAGE(logits, logits.error().message);
    REQUIRE(logits->tokens == expected.rows);
    REQUIRE(logits->vocab == expected.cols);
    CHECK(fx::relative_max_diff(logits->values, expected.values) <= kTolerance);
  }
}

TEST_CASE("image logits do not depend on prefill chunks cutting through images, nor on threads") {
  // Chunks of 7 tokens split both prompts' images across steps: the merged embeddings and DeepStack rows of
  // an image arrive in pieces, each at the right rows.
  auto whole = open_model();
  EngineOptions chunked_options = fixture_options();
  chunked_options.plan.max_batched_tokens = 7;
  chunked_options.threads = 1;
  auto chunked = open_model(chunked_options);
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    fx::Npy expected = fx::read_npy(fixtures_dir() + "vl/" + prompt["logits_file"].get<std::string>());
    auto a = whole->logits(collapsed_ids(prompt, pad), fixture_images(prompt));
    const int64_t steps_before = chunked->stats().steps;
    auto b = chunked->logits(collapsed_ids(prompt, pad), fixture_images(prompt));
    REQUIRE(a);
    REQUIRE(b);
    CHECK(chunked->stats().steps - steps_before == (expected.rows + 6) / 7);
    CHECK(fx::relative_max_diff(b->values, expected.values) <= kTolerance);
    CHECK(a->values == b->values);
  }
}

TEST_CASE("greedy continuations with images equal transformers' generate() (decode positions + rope_delta)") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    const auto& greedy = prompt["greedy"];
    SamplingParams params;
    params.max_tokens = greedy["max_new_tokens"].get<int64_t>();
    auto generation = engine->generate(collapsed_ids(prompt, pad), fixture_images(prompt), params);
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->prompt_ids == fx::ids_of(prompt["input_ids"]));  // placeholders expanded as the processor does
    CHECK(generation->ids == fx::ids_of(greedy["new_ids"]));
  }
}

TEST_CASE("generate from the text and decoded images: tokenize, preprocess, encode, fuse, decode") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    std::vector<Image> images;
    for (const auto& image : prompt["images"]) images.push_back(load_fixture_image(image));
    SamplingParams params;
    params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
    std::string streamed;
    auto generation = engine->generate(prompt["text"].get<std::string>(), images, params,
                                       [&](const std::string& piece, int32_t) {
                                         streamed += piece;
                                         return true;
                                       });
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->prompt_ids == fx::ids_of(prompt["input_ids"]));
    CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
    CHECK(streamed == prompt["greedy"]["text"].get<std::string>());
  }
}

TEST_CASE("a chat with images, as kImagePlaceholder in the message content") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  const auto& prompt = ref["prompts"][1];  // system "Be brief.", user: <image>Compare ... with<image> the tall one.
  SamplingParams params;
  params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
  std::vector<Image> images;
  for (const auto& image : prompt["images"]) images.push_back(load_fixture_image(image));
  const std::string placeholder = kImagePlaceholder;
  auto generation = engine->generate_chat(
      {{"system", "Be brief."},
       {"user", placeholder + "Compare the wide picture with" + placeholder + " the tall one."}},
      images, params);
  REQUIRE_MESSAGE(generation, generation.error().message);
  CHECK(generation->prompt_ids == fx::ids_of(prompt["input_ids"]));
  CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
}

TEST_CASE("requests with images batched in one step decode as they do alone, text-only ones too") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  SamplingParams params;
  params.max_tokens = 8;
  std::vector<RequestId> ids;
  for (const auto& prompt : ref["prompts"]) {
    auto id = engine->submit(collapsed_ids(prompt, pad), fixture_images(prompt), params);
    REQUIRE_MESSAGE(id, id.error().message);
    ids.push_back(*id);
  }
  // A text-only prompt in the same batch: its three position rows are equal (ordinary RoPE).
  auto text_ids = engine->tokenize("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", false);
  REQUIRE(text_ids);
  auto text_request = engine->submit(*text_ids, params);
  REQUIRE(text_request);
  REQUIRE(engine->run());
  CHECK(engine->stats().peak_running == 3);
  for (size_t k = 0; k < ids.size(); k++) {
    auto generation = engine->result(ids[k]);
    REQUIRE(generation);
    CHECK(generation->ids == fx::ids_of(ref["prompts"][k]["greedy"]["new_ids"]));
  }
  auto batched_text = engine->result(*text_request);
  REQUIRE(batched_text);
  auto alone = open_model()->generate(*text_ids, params);
  REQUIRE(alone);
  CHECK(batched_text->ids == alone->ids);
}

TEST_CASE("under page pressure a request with images is preempted and recomputed with the same tokens") {
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (int64_t batched_tokens : {128, 24}) {  // whole prompts, and chunks that cut through the images
    CAPTURE(batched_tokens);
    EngineOptions options = fixture_options();
    options.plan.max_model_len = 96;
    options.plan.max_batched_tokens = batched_tokens;
    options.plan.utilization = 1.0;
    const Plan probe = open_model(options)->plan();
    // 6 pages of 16 tokens: the two prompts with 8 new tokens each (39 and 72 tokens) need 3 + 5.
    options.plan.device_mem = probe.fixed_bytes + 6 * probe.kv_page_bytes;
    auto engine = open_model(options);
    REQUIRE(engine->plan().kv_pages == 6);
    SamplingParams params;
    params.max_tokens = 8;
    std::vector<RequestId> ids;
    for (const auto& prompt : ref["prompts"]) {
      auto id = engine->submit(collapsed_ids(prompt, pad), fixture_images(prompt), params);
      REQUIRE_MESSAGE(id, id.error().message);
      ids.push_back(*id);
    }
    REQUIRE(engine->run());
    CHECK(engine->stats().preemptions > 0);
    for (size_t k = 0; k < ids.size(); k++) {
      auto generation = engine->result(ids[k]);
      REQUIRE(generation);
      CHECK(generation->ids == fx::ids_of(ref["prompts"][k]["greedy"]["new_ids"]));
    }
    CHECK(engine->arena().kv().stats().used_pages == 0);
  }
}

TEST_CASE("images are refused by a text model and must match the placeholders in number") {
  auto text_model = fx::open("tiny-qwen3");
  const nlohmann::json ref = reference();
  const auto& prompt = ref["prompts"][0];
  auto refused = text_model->generate(prompt["text"].get<std::string>(), {load_fixture_image(prompt["images"][0])},
                                      SamplingParams{});
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::unsupported);
  CHECK(refused.error().message.find("no vision tower") != std::string::npos);

  auto engine = open_model();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  auto two_for_one = engine->logits(collapsed_ids(prompt, pad), fixture_images(ref["prompts"][1]));
  REQUIRE_FALSE(two_for_one);
  CHECK(two_for_one.error().code == ErrorCode::invalid_argument);
  CHECK(two_for_one.error().message.find("1 image placeholder") != std::string::npos);
  CHECK(two_for_one.error().message.find("2 images were given") != std::string::npos);
  auto none = engine->logits(collapsed_ids(prompt, pad), {});
  REQUIRE_FALSE(none);
  CHECK(none.error().message.find("0 images were given") != std::string::npos);
}

// Regression (issue 15, defect 3): encode_images sized its output from the caller's image_tokens and then
// copied the real rows' tokens into it (a heap overflow), and a negative grid gave `internal` (a
// std::length_error); reachable from submit, generate, logits and encode_images. Every field is now checked
// before anything is sized from it.
TEST_CASE("regression: a caller's VisionInput overflowed encode_images") {
  auto engine = open_model();
  const nlohmann::json ref = reference();
  const auto& prompt = ref["prompts"][0];
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  const VisionInput good = fixture_images(prompt).front();
  struct Case {
    const char* what;
    std::function<void(VisionInput&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"image_tokens smaller than the grid makes", [](VisionInput& v) { v.grid.image_tokens = 1; }, "image_tokens is 1"},
      {"image_tokens larger", [](VisionInput& v) { v.grid.image_tokens *= 50; }, "image_tokens is"},
      {"a negative grid", [](VisionInput& v) { v.grid.grid_h = -4; }, "grid_h is -4"},
      {"an odd grid side", [](VisionInput& v) { v.grid.grid_w += 1; }, "multiple of the merge size"},
      {"a huge grid", [](VisionInput& v) { v.grid.grid_h = int64_t(1) << 40; }, "KVLITE_MAX_VISION_GRID_SIDE"},
      {"two frames", [](VisionInput& v) { v.grid.grid_t = 2; }, "grid_t is 2"},
      {"a short pixel buffer", [](VisionInput& v) { v.pixel_values.resize(v.pixel_values.size() - 1); }, "pixel_values holds"},
      {"a long pixel buffer", [](VisionInput& v) { v.pixel_values.resize(v.pixel_values.size() + 1536); }, "pixel_values holds"},
      {"a wrong row size", [](VisionInput& v) { v.row_size = 7; }, "row_size is 7"},
      {"a NaN pixel", [](VisionInput& v) { v.pixel_values[5] = std::nanf(""); }, "pixel_values[5] is not finite"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    VisionInput bad = good;
    c.edit(bad);
    auto encoded = engine->encode_images({bad});
    REQUIRE_FALSE(encoded);
    CHECK(encoded.error().code == ErrorCode::invalid_argument);
    CHECK_MESSAGE(contains(encoded.error().message, c.message), encoded.error().message);
    auto logits = engine->logits(collapsed_ids(prompt, pad), {bad});
    REQUIRE_FALSE(logits);
    CHECK(logits.error().code == ErrorCode::invalid_argument);
    auto submitted = engine->submit(collapsed_ids(prompt, pad), {bad}, SamplingParams{});
    REQUIRE_FALSE(submitted);
    CHECK(submitted.error().code == ErrorCode::invalid_argument);
  }
  // the engine is still sound: the good image encodes
  CHECK(engine->encode_images({good}).ok());
}

TEST_CASE("examples/caption_image and kvlite generate --image stream what generate_chat gives") {
  const nlohmann::json ref = reference();
  const std::string image_path = fixtures_dir() + ref["prompts"][0]["images"][0]["file"].get<std::string>();
  auto engine = open_model();
  SamplingParams params;
  params.max_tokens = 8;
  auto expected = engine->generate_chat({{"user", std::string(kImagePlaceholder) + "What is it?"}},
                                        {load_fixture_image(ref["prompts"][0]["images"][0])}, params);
  REQUIRE(expected);
  REQUIRE(expected->ids.size() == 8);
  int status = -1;
  const std::string caption = run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + model_dir() + " " +
                                               image_path + " --prompt 'What is it?' --max-tokens 8 --backend cpu --device-mem 64MiB",
                                           status);
  CHECK(status == 0);
  CHECK(caption == expected->text + "\n");
  const std::string cli = run_program(std::string(KVLITE_BINARY_DIR) + "/kvlite generate " + model_dir() +
                                          " --chat --prompt 'What is it?' --image " + image_path +
                                          " --max-tokens 8 --backend cpu --device-mem 64MiB",
                                      status);
  CHECK(status == 0);
  CHECK(cli == expected->text + "\n");
  run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + model_dir(), status);
  CHECK(status == 2);
  run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + fx::dir("tiny-qwen3") + " " + image_path +
                  " --backend cpu --device-mem 64MiB",
              status);
  CHECK(status == 1);
}

TEST_CASE("a request with more images than the plan's max_images is refused up front, naming both numbers") {
  EngineOptions options = fixture_options();
  options.plan.max_images = 1;
  auto engine = open_model(options);
  const nlohmann::json ref = reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  const auto& two = ref["prompts"][1];
  auto check_refused = [](const Error& error) {
    CHECK(error.code == ErrorCode::does_not_fit);
    CHECK_MESSAGE(contains(error.message, "2 images in one request"), error.message);
    CHECK_MESSAGE(contains(error.message, "at most 1 (max_images)"), error.message);
    CHECK_MESSAGE(contains(error.message, "raise max_images to 2"), error.message);
    CHECK_MESSAGE(contains(error.message, "--max-images 2"), error.message);
  };
  auto logits = engine->logits(collapsed_ids(two, pad), fixture_images(two));
  REQUIRE_FALSE(logits);
  check_refused(logits.error());
  auto submitted = engine->submit(collapsed_ids(two, pad), fixture_images(two), SamplingParams{});
  REQUIRE_FALSE(submitted);
  check_refused(submitted.error());
  // Before any preprocessing: the second image (0 x 0) would fail there with invalid_argument.
  const std::vector<Image> one_good_one_empty = {load_fixture_image(two["images"][0]), Image{}};
  auto generated = engine->generate(two["text"].get<std::string>(), one_good_one_empty, SamplingParams{});
  REQUIRE_FALSE(generated);
  check_refused(generated.error());
  const std::string placeholder = kImagePlaceholder;
  auto chat = engine->generate_chat({{"user", placeholder + "and" + placeholder}}, one_good_one_empty, SamplingParams{});
  REQUIRE_FALSE(chat);
  check_refused(chat.error());
  CHECK(engine->stats().steps == 0);
  // The tower alone (get_image_features) takes any number, max_images at a time.
  auto features = engine->encode_images(fixture_images(two));
  REQUIRE_MESSAGE(features, features.error().message);
  CHECK(features->tokens == 16);
  // A plan for two takes the request.
  auto fits = open_model()->logits(collapsed_ids(two, pad), fixture_images(two));
  CHECK_MESSAGE(fits, fits.error().message);
}

TEST_CASE("bad images reach the engine's callers as typed errors with the numbers: zero size, aspect ratio over 200") {
  auto engine = open_model();
  const std::string prompt = std::string(kImagePlaceholder) + "What is it?";
  auto empty = engine->generate(prompt, {Image{}}, SamplingParams{});
  REQUIRE_FALSE(empty);
  CHECK(empty.error().code == ErrorCode::invalid_argument);
  CHECK_MESSAGE(contains(empty.error().message, "0 x 0"), empty.error().message);

  std::mt19937 random(2024);
  std::vector<uint8_t> row(201 * 3);  // 201 x 1 RGB
  for (uint8_t& value : row) value = uint8_t(random() & 0xff);
  auto thin = image_from_pixels(row.data(), 201, 1, PixelFormat::rgb8);
  REQUIRE(thin);
  auto refused = engine->generate(prompt, {*thin}, SamplingParams{});
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK_MESSAGE(contains(refused.error().message, "aspect ratio 201"), refused.error().message);
  CHECK(engine->preprocess(*thin).error().code == ErrorCode::invalid_argument);
  // 200 is still allowed, as in transformers.
  auto ratio_200 = image_from_pixels(row.data(), 200, 1, PixelFormat::rgb8);
  REQUIRE(ratio_200);
  CHECK(engine->preprocess(*ratio_200).ok());
  CHECK(engine->stats().steps == 0);
}

TEST_CASE("an image over the plan's max_image_pixels is scaled as transformers' processor scales it with max_pixels set to that budget") {
  // The fixture model with the published processor maximum (16777216) instead of its 8192: the plan's budget,
  // not the processor's, is then what limits. With max_image_pixels at the budget of the processor cases in
  // tests/fixtures/images/cases.json (min_pixels 4096 as the model's, max_pixels 8192), the engine must give
  // exactly what the processor gave there: the same grids, the same pixel_values bit for bit.
  const std::string dir = testing_safetensors::temp_dir("vision-budget");
  for (const char* file : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer_config.json"})
    std::filesystem::copy_file(model_dir() + "/" + file, dir + "/" + file);
  nlohmann::json processor = nlohmann::json::parse(fx::read_file(model_dir() + "/preprocessor_config.json"));
  processor["size"]["longest_edge"] = 16777216;
  testing_safetensors::write_text(dir + "/preprocessor_config.json", processor.dump());

  const nlohmann::json cases = nlohmann::json::parse(fx::read_file(fixtures_dir() + "images/cases.json"));
  const auto& processor_cases = cases["processor_cases"];
  REQUIRE(processor_cases.size() == 5);
  const int64_t budget = processor_cases[0]["max_pixels"].get<int64_t>();
  EngineOptions options = fixture_options();
  options.plan.max_image_pixels = budget;
  auto opened = Engine::open(dir, options);
  REQUIRE_MESSAGE(opened, opened.error().message);
  auto& engine = *opened;
  REQUIRE(engine->config().max_pixels == 16777216);
  REQUIRE(engine->config().min_pixels == processor_cases[0]["min_pixels"].get<int64_t>());
  int scaled_down = 0, pixel_values_checked = 0;
  for (const auto& c : processor_cases) {
    CAPTURE(c["name"].get<std::string>());
    REQUIRE(c["max_pixels"].get<int64_t>() == budget);
    auto image = load_image(fixtures_dir() + "images/" + c["file"].get<std::string>());
    REQUIRE_MESSAGE(image, image.error().message);
    if (image->width * image->height > budget) scaled_down++;
    auto input = engine->preprocess(*image);
    REQUIRE_MESSAGE(input, input.error().message);
    const auto grid = c["grid_thw"].get<std::vector<int64_t>>();
    CHECK(input->grid.grid_t == grid[0]);
    CHECK(input->grid.grid_h == grid[1]);
    CHECK(input->grid.grid_w == grid[2]);
    CHECK(input->grid.image_tokens == c["image_tokens"].get<int64_t>());
    CHECK(input->grid.image_tokens <= engine->plan().image_tokens_per_image);
    if (c.contains("pixel_values") && c["pixel_values"].is_string()) {
      fx::Npy expected = fx::read_npy(fixtures_dir() + "images/" + c["pixel_values"].get<std::string>());
      CHECK(input->pixel_values == expected.values);
      pixel_values_checked++;
    }
  }
  CHECK(scaled_down == 2);  // photo_300x200 and wide_640x64
  CHECK(pixel_values_checked == 2);

  // Without the budget (kvlite's default, min(16777216, 1024 x 1024)) the wide image keeps all its pixels:
  // the budget is what scaled it.
  EngineOptions default_budget = fixture_options();
  default_budget.plan.device_mem = 256 * MiB;  // vision buffers for two 1024 x 1024 images
  auto unbounded = Engine::open(dir, default_budget);
  REQUIRE_MESSAGE(unbounded, unbounded.error().message);
  auto wide = (*unbounded)->preprocess(*load_image(fixtures_dir() + "images/wide_640x64.png"));
  REQUIRE(wide);
  auto expected = smart_resize(64, 640, 32, 4096, 1024 * 1024);
  REQUIRE(expected);
  CHECK(wide->grid.resized_height == expected->first);
  CHECK(wide->grid.resized_width == expected->second);
  CHECK(wide->grid.image_tokens == 40);  // 64 x 640 as it is: 2 x 20 merge windows
}

// ---- Qwen2.5-VL (tests/fixtures/vl/qwen2_5_vl, tools/make_vl25_fixtures.py) ---------------------------------
// The same tower and engine with the family's traits: window attention (blocks 0 and 2 within 56 x 56 pixel
// windows, 1 and 3 per image), RMSNorm, SwiGLU, no position table, the ln_q merger, sectioned M-RoPE; inputs
// decoded and preprocessed by kvlite from PNG and JPEG files (RGBA, gray) and compared with what transformers'
// own processor made of the same files.
namespace {

std::string vl25_dir() { return fixtures_dir() + "vl/qwen2_5_vl/"; }
std::string vl25_model_dir() { return vl25_dir() + "tiny-qwen2.5-vl"; }
nlohmann::json vl25_reference() { return nlohmann::json::parse(fx::read_file(vl25_dir() + "reference.json")); }

std::unique_ptr<Engine> open_vl25(const EngineOptions& options = fixture_options()) {
  auto engine = Engine::open(vl25_model_dir(), options);
  if (!engine) throw std::runtime_error("open tiny-qwen2.5-vl: " + engine.error().message);
  return std::move(*engine);
}

std::vector<VisionInput> vl25_images(Engine& engine, const nlohmann::json& prompt) {
  std::vector<VisionInput> images;
  for (const auto& image : prompt["images"]) {
    auto input = engine.preprocess(load_fixture_image(image));
    REQUIRE_MESSAGE(input, input.error().message);
    images.push_back(std::move(*input));
  }
  return images;
}

}  // namespace

TEST_CASE("Qwen2.5-VL: config.json gives the family's vision traits, nested (transformers 5) or flat (published)") {
  auto nested = load_config(vl25_model_dir());
  REQUIRE_MESSAGE(nested, nested.error().message);
  CHECK(nested->arch == Arch::qwen2_5_vl);
  CHECK(nested->text_prefix() == "model.");
  CHECK(nested->text.attention_bias);   // qwen2's q/k/v biases
  CHECK_FALSE(nested->text.o_proj_bias);
  CHECK_FALSE(nested->text.qk_norm);
  CHECK(nested->text.rope.mrope_section == std::vector<int>{2, 3, 3});
  CHECK(nested->text.rope.mrope_layout == RopeConfig::MropeLayout::sectioned);
  const VisionTraits& t = nested->vision.traits;
  CHECK(t.prefix == "visual.");
  CHECK(t.norm == VisionNorm::rms_norm);
  CHECK(t.mlp == VisionMlp::swiglu);
  CHECK_FALSE(t.patch_embed_bias);
  CHECK_FALSE(t.learned_positions);
  CHECK(t.window_size == 56);
  CHECK(t.fullatt_block_indexes == std::vector<int64_t>{1, 3});
  CHECK(t.full_attention(1));
  CHECK_FALSE(t.full_attention(2));
  CHECK(nested->vision.patch_size == 14);
  CHECK(nested->min_pixels == 28 * 28 * 6);
  CHECK(nested->image_mean[0] == doctest::Approx(0.48145466));
  CHECK(nested->image_std[2] == doctest::Approx(0.27577711));

  auto flat = parse_config(fx::read_file(fixtures_dir() + "configs/qwen2.5-vl-3b-instruct.json"), "3b/config.json");
  REQUIRE_MESSAGE(flat, flat.error().message);
  CHECK(flat->text.hidden_size == 2048);
  CHECK(flat->text.num_layers == 36);
  CHECK(flat->text.tie_word_embeddings);
  CHECK(flat->text.rope.theta == 1000000.0);
  CHECK(flat->text.rope.mrope_section == std::vector<int>{16, 24, 24});
  CHECK(flat->vision.traits.window_size == 112);
  CHECK(flat->vision.traits.fullatt_block_indexes == std::vector<int64_t>{7, 15, 23, 31});
  CHECK(flat->vision.out_hidden_size == 2048);
  // without a preprocessor_config.json: Qwen2VLImageProcessor's class defaults
  const PreprocessOptions defaults = preprocess_options(*flat);
  CHECK(defaults.min_pixels == 56 * 56);
  CHECK(defaults.max_pixels == 28 * 28 * 1280);
  CHECK(defaults.image_mean[1] == doctest::Approx(0.4578275));

  // a window smaller than one merge window, and a full-attention block past the depth, are refused by name
  nlohmann::json bad = nlohmann::json::parse(fx::read_file(fixtures_dir() + "configs/qwen2.5-vl-3b-instruct.json"));
  bad["vision_config"]["window_size"] = 20;
  auto small_window = parse_config(bad.dump(), "bad/config.json");
  REQUIRE_FALSE(small_window);
  CHECK(small_window.error().code == ErrorCode::bad_format);
  CHECK(contains(small_window.error().message, "window_size"));
  CHECK(contains(small_window.error().message, "20 pixels"));
  bad["vision_config"]["window_size"] = 112;
  bad["vision_config"]["fullatt_block_indexes"] = {7, 32};
  auto past_depth = parse_config(bad.dump(), "bad/config.json");
  REQUIRE_FALSE(past_depth);
  CHECK(contains(past_depth.error().message, "holds block 32, outside 0..31"));
}

TEST_CASE("Qwen2.5-VL: sectioned M-RoPE tables take rows t, h, w section after section") {
  // mrope_section [2, 3, 3]: frequencies 0-1 from t, 2-4 from h, 5-7 from w (Qwen3-VL would interleave them)
  const std::vector<float> inv_freq = {1.0f, 0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f, 0.0078125f};
  const std::vector<int32_t> positions = {3, 5, 7};  // one token: t 3, h 5, w 7
  std::vector<float> cos(8), sin(8);
  REQUIRE(rope_tables(inv_freq, positions.data(), 3, 1, {2, 3, 3}, cos.data(), sin.data(), 1.0f,
                      RopeConfig::MropeLayout::sectioned).ok());
  const int rows[8] = {0, 0, 1, 1, 1, 2, 2, 2};
  for (int i = 0; i < 8; i++) {
    CAPTURE(i);
    CHECK(cos[size_t(i)] == float(std::cos(double(inv_freq[size_t(i)] * float(positions[size_t(rows[i])])))));
    CHECK(sin[size_t(i)] == float(std::sin(double(inv_freq[size_t(i)] * float(positions[size_t(rows[i])])))));
  }
}

TEST_CASE("Qwen2.5-VL: kvlite's processor on PNG and JPEG (RGBA, gray, odd sizes) gives transformers' grids and pixels") {
  auto engine = open_vl25();
  const nlohmann::json ref = vl25_reference();
  int checked = 0;
  for (const auto& prompt : ref["prompts"])
    for (const auto& image : prompt["images"]) {
      CAPTURE(image["file"].get<std::string>());
      auto input = engine->preprocess(load_fixture_image(image));
      REQUIRE_MESSAGE(input, input.error().message);
      auto grid = image["grid_thw"].get<std::vector<int64_t>>();
      CHECK(input->grid.grid_t == grid[0]);
      CHECK(input->grid.grid_h == grid[1]);
      CHECK(input->grid.grid_w == grid[2]);
      CHECK(input->grid.image_tokens == image["image_tokens"].get<int64_t>());
      CHECK(input->row_size == 3 * 2 * 14 * 14);
      double sum = 0, abs_sum = 0;
      for (float v : input->pixel_values) {
        sum += v;
        abs_sum += std::fabs(v);
      }
      // float32 values summed in double on both sides: equal pixels agree to rounding
      CHECK(sum == doctest::Approx(image["pixel_values_sum"].get<double>()).epsilon(1e-9).scale(1.0));
      CHECK(abs_sum == doctest::Approx(image["pixel_values_abs_sum"].get<double>()).epsilon(1e-9));
      const auto first = image["pixel_values_first_row"].get<std::vector<double>>();
      for (size_t i = 0; i < first.size(); i++) CHECK(double(input->pixel_values[i]) == doctest::Approx(first[i]).epsilon(1e-6).scale(1.0));
      checked++;
    }
  CHECK(checked == 4);
}

TEST_CASE("Qwen2.5-VL: the windowed vision tower's merged embeddings match transformers, one or two images an encode") {
  for (int64_t max_images : {1, 2}) {
    CAPTURE(max_images);
    EngineOptions options = fixture_options();
    options.plan.max_images = max_images;
    auto engine = open_vl25(options);
    const nlohmann::json ref = vl25_reference();
    for (const auto& prompt : ref["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      auto features = engine->encode_images(vl25_images(*engine, prompt));
      REQUIRE_MESSAGE(features, features.error().message);
      REQUIRE(features->levels == 1);  // no DeepStack
      fx::Npy expected = fx::read_npy(vl25_dir() + prompt["vision_file"].get<std::string>());
      REQUIRE(features->tokens == expected.rows);
      REQUIRE(features->hidden == expected.cols);
      const double diff = fx::relative_max_diff(features->values, expected.values);
      MESSAGE("vision ", prompt["name"].get<std::string>(), " max_images ", max_images, ": ", diff);
      CHECK(diff <= kTolerance);
    }
  }
}

TEST_CASE("Qwen2.5-VL: mrope_positions equals its get_rope_index") {
  const nlohmann::json ref = vl25_reference();
  auto engine = open_vl25();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    std::vector<ImageGrid> grids;
    for (const VisionInput& image : vl25_images(*engine, prompt)) grids.push_back(image.grid);
    auto positions = mrope_positions(fx::ids_of(prompt["input_ids"]), pad, grids, 2);
    REQUIRE_MESSAGE(positions, positions.error().message);
    std::vector<int32_t> expected;
    for (const auto& row : prompt["position_ids"])
      for (int32_t p : row.get<std::vector<int32_t>>()) expected.push_back(p);
    CHECK(positions->positions == expected);
    CHECK(positions->rope_delta == prompt["rope_delta"].get<int64_t>());
  }
}

TEST_CASE("Qwen2.5-VL: logits with images match transformers in float32, whole and in chunks of 7 tokens") {
  auto whole = open_vl25();
  EngineOptions chunked_options = fixture_options();
  chunked_options.plan.max_batched_tokens = 7;
  auto chunked = open_vl25(chunked_options);
  const nlohmann::json ref = vl25_reference();
  const int32_t pad = ref["image_token_id"].get<int32_t>();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    fx::Npy expected = fx::read_npy(vl25_dir() + prompt["logits_file"].get<std::string>());
    const auto rows = prompt["logits_rows"].get<std::vector<int64_t>>();
    REQUIRE(int64_t(rows.size()) == expected.rows);
    for (Engine* engine : {whole.get(), chunked.get()}) {
      auto logits = engine->logits(collapsed_ids(prompt, pad), vl25_images(*engine, prompt));
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == int64_t(prompt["input_ids"].size()));
      REQUIRE(logits->vocab == expected.cols);
      std::vector<float> kept;
      for (int64_t r : rows)
        kept.insert(kept.end(), logits->values.begin() + r * logits->vocab, logits->values.begin() + (r + 1) * logits->vocab);
      const double diff = fx::relative_max_diff(kept, expected.values);
      MESSAGE("logits ", prompt["name"].get<std::string>(), std::string(engine == whole.get() ? " whole: " : " chunked: "), diff);
      CHECK(diff <= kTolerance);
    }
  }
}

TEST_CASE("Qwen2.5-VL: greedy captions from the text and the image files equal transformers' generate()") {
  auto engine = open_vl25();
  const nlohmann::json ref = vl25_reference();
  for (const auto& prompt : ref["prompts"]) {
    CAPTURE(prompt["name"].get<std::string>());
    std::vector<Image> images;
    for (const auto& image : prompt["images"]) images.push_back(load_fixture_image(image));
    SamplingParams params;
    params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
    auto generation = engine->generate(prompt["text"].get<std::string>(), images, params);
    REQUIRE_MESSAGE(generation, generation.error().message);
    CHECK(generation->prompt_ids == fx::ids_of(prompt["input_ids"]));
    CHECK(generation->ids == fx::ids_of(prompt["greedy"]["new_ids"]));
    CHECK(generation->text == prompt["greedy"]["text"].get<std::string>());
  }
}

TEST_CASE("Qwen2.5-VL: the plan's weights estimate from config.json alone is within 2% of transformers' parameters") {
  const nlohmann::json ref = vl25_reference();
  for (const auto& item : ref["published"].items()) {
    // (not a structured binding: C++17 lets no lambda, CAPTURE's among them, refer to one; clang refuses it)
    const std::string name = item.key();
    const nlohmann::json& published = item.value();
    CAPTURE(name);
    auto config = parse_config(fx::read_file(fixtures_dir() + published["config"].get<std::string>()), name);
    REQUIRE_MESSAGE(config, config.error().message);
    auto weights = summarize_weights(*config, nullptr);  // no checkpoint: the config-only estimate
    REQUIRE_MESSAGE(weights, weights.error().message);
    const double params = double(weights->total_bytes) / 2;  // bfloat16
    const double vision = double(weights->vision_bytes) / 2;
    const double expected = published["parameters"].get<double>();
    MESSAGE(name, ": estimate ", uint64_t(params), " parameters (vision ", uint64_t(vision), "), transformers ",
            published["parameters"].get<uint64_t>(), " (vision ", published["vision_parameters"].get<uint64_t>(), ")");
    CHECK(std::fabs(params - expected) / expected <= 0.02);
    CHECK(std::fabs(vision - published["vision_parameters"].get<double>()) / published["vision_parameters"].get<double>() <= 0.02);
  }
}

TEST_CASE("Qwen2.5-VL: the plan's vision row sizes window attention's buffers, no N x N scores") {
  auto config = load_config(vl25_model_dir());
  REQUIRE(config);
  // 56 x 84 pixels = 2 x 3 merge windows = 24 patches per image
  auto buffers = vision_buffers(*config, 56 * 84, 1, DType::F32);
  auto bytes_of = [&](const char* name) -> uint64_t {
    for (const BufferSpec& b : buffers)
      if (b.name == name) return b.bytes;
    return 0;
  };
  CHECK(bytes_of("vision_gate_up") >= 24 * 2 * 48 * 4);
  CHECK(bytes_of("vision_window_order") >= 6 * 4);
  CHECK(bytes_of("vision_window_segments") >= 7 * 4);
  CHECK(bytes_of("vision_pos_indices") == 0);  // no position table
  // Linear in the patches (segment_attention streams keys: no [N, N] scores for the full blocks either): four
  // times the pixels, at most four times the bytes (plus the per-image segment words and alignment).
  auto total = [](const std::vector<BufferSpec>& specs) {
    uint64_t sum = 0;
    for (const BufferSpec& b : specs) sum += b.bytes;
    return sum;
  };
  const uint64_t one = total(buffers), four = total(vision_buffers(*config, 4 * 56 * 84, 1, DType::F32));
  CHECK(four > 3 * one);
  CHECK(four <= 4 * one + 4096);
}

TEST_CASE("Qwen2.5-VL on an 8 GiB card: 7B-AWQ fits one 4096-token caption at 0.95, the 3B in bf16 only squeezed") {
  // tests/fixtures/configs/qwen2.5-vl-7b-instruct-awq: the published 7B config with the AWQ release's
  // quantization_config (4 bits, group 128, zero points, the vision tower not converted)
  DeviceSpec card;
  card.backend = BackendKind::cuda;
  card.name = "planned 8 GiB card";
  card.total_bytes = 8 * GiB;
  auto awq = read_plan_inputs(fixtures_dir() + "configs/qwen2.5-vl-7b-instruct-awq");
  REQUIRE_MESSAGE(awq, awq.error().message);
  PlanOptions one;
  one.utilization = 0.95;
  one.max_seqs = 1;
  one.max_model_len = 4096;
  one.max_batched_tokens = 512;
  auto plan = make_plan(*awq, card, one);
  REQUIRE_MESSAGE(plan, plan.error().message);
  CHECK(plan->fits);
  CHECK(plan->item("vision") != nullptr);
  CHECK(plan->vision_weights_bytes > GiB);  // the bf16 tower (676.6 M parameters) is not quantized
  CHECK(plan->image_tokens_per_image == 1280);
  CHECK(plan->table().find("window attention (112 px windows, 4 full blocks)") != std::string::npos);
  // at the defaults (0.9, 8 sequences) it does not, and the advice says what would
  auto defaults = make_plan(*awq, card, PlanOptions{});
  REQUIRE(defaults);
  CHECK_FALSE(defaults->fits);
  CHECK_FALSE(defaults->advice.empty());
  // the 3B in bf16: 7 GiB of weights against a 7.2 GiB budget
  nlohmann::json three = nlohmann::json::parse(fx::read_file(fixtures_dir() + "configs/qwen2.5-vl-3b-instruct.json"));
  auto config = parse_config(three.dump(), "qwen2.5-vl-3b-instruct/config.json");
  REQUIRE(config);
  auto weights = summarize_weights(*config, nullptr);
  REQUIRE(weights);
  auto bf16 = make_plan(*config, *weights, card, PlanOptions{});
  REQUIRE(bf16);
  CHECK_FALSE(bf16->fits);
  bool told = false;
  for (const std::string& line : bf16->advice) told = told || line.find("use a quantized checkpoint") != std::string::npos ||
                                                            line.find("No max_model_len fits") != std::string::npos;
  CHECK(told);
  // ... and it fits only squeezed: one 4096-token sequence with a 0.4-megapixel image at utilization 0.97 (about
  // 240 MiB of the card left to everything else)
  PlanOptions squeezed = one;
  squeezed.utilization = 0.97;
  squeezed.max_image_pixels = 401408;
  auto tight = make_plan(*config, *weights, card, squeezed);
  REQUIRE(tight);
  CHECK(tight->fits);
  squeezed.utilization = 0.95;
  CHECK_FALSE(make_plan(*config, *weights, card, squeezed)->fits);
}

TEST_CASE("Qwen2.5-VL: examples/caption_image and kvlite generate --image run a Qwen2.5-VL directory unchanged") {
  const nlohmann::json ref = vl25_reference();
  const auto& image = ref["prompts"][0]["images"][0];
  const std::string image_path = fixtures_dir() + image["file"].get<std::string>();
  auto engine = open_vl25();
  SamplingParams params;
  params.max_tokens = 8;
  auto expected = engine->generate_chat({{"user", std::string(kImagePlaceholder) + "What is it?"}},
                                        {load_fixture_image(image)}, params);
  REQUIRE(expected);
  int status = -1;
  const std::string caption = run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + vl25_model_dir() + " " +
                                              image_path + " --prompt 'What is it?' --max-tokens 8 --backend cpu --device-mem 64MiB",
                                          status);
  CHECK(status == 0);
  CHECK(caption == expected->text + "\n");
  const std::string cli = run_program(std::string(KVLITE_BINARY_DIR) + "/kvlite generate " + vl25_model_dir() +
                                          " --chat --prompt 'What is it?' --image " + image_path +
                                          " --max-tokens 8 --backend cpu --device-mem 64MiB",
                                      status);
  CHECK(status == 0);
  CHECK(cli == expected->text + "\n");
}

TEST_CASE("Qwen2.5-VL: 16-bit activations on the CPU (pixels rounded in window order) stay near the F32 tower") {
  auto reference_engine = open_vl25();
  const nlohmann::json ref = vl25_reference();
  const auto& prompt = ref["prompts"][1];  // the gray JPEG and the photo: partial and whole windows, two images
  const std::vector<VisionInput> images = vl25_images(*reference_engine, prompt);
  auto reference = reference_engine->encode_images(images);
  REQUIRE_MESSAGE(reference, reference.error().message);
  for (DType act : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(act));
    EngineOptions options = fixture_options();
    options.plan.activation_dtype = act;
    auto engine = open_vl25(options);
    auto features = engine->encode_images(images);
    REQUIRE_MESSAGE(features, features.error().message);
    REQUIRE(features->values.size() == reference->values.size());
    const double drift = fx::relative_max_diff(features->values, reference->values);
    MESSAGE("vision features ", std::string(dtype_name(act)), " vs F32: ", drift);
    // a few roundings of 2^-8 (bf16) or 2^-11 (f16) through 4 blocks; rows in the wrong order would be O(1)
    CHECK(drift < (act == DType::BF16 ? 0.03 : 0.005));  // measured 0.0088 and 0.0010
  }
}
