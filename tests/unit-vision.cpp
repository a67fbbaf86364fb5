// vision: Qwen3-VL end to end against transformers' float32 outputs for the tiny fixture model of
// tests/fixtures/vl (tools/make_vl_fixtures.py): preprocessing, the vision tower and its DeepStack features,
// M-RoPE positions, fused prefill logits and greedy decoding, with and without chunked prefill and batching.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
using namespace kvlite;
namespace fx = model_fixtures;

namespace {

// The fixture's tolerance: max |kvlite - transformers| / max |transformers| over a tensor.
constexpr double kTolerance = 1e-4;

std::string fixtures_dir() { return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/"; }
std::string model_dir() { return fixtures_dir() + "vl/tiny-qwen3-vl"; }
nlohmann::json reference() { return nlohmann::json::parse(fx::read_file(fixtures_dir() + "vl/reference.json")); }

std::unique_ptr<Engine> open_model(EngineOptions options = {}) {
  if (!options.plan.device_mem) options.plan.device_mem = 64 * MiB;
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
    EngineOptions options;
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
  EngineOptions chunked_options;
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
    EngineOptions options;
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
                                               image_path + " --prompt 'What is it?' --max-tokens 8 --device-mem 64MiB",
                                           status);
  CHECK(status == 0);
  CHECK(caption == expected->text + "\n");
  const std::string cli = run_program(std::string(KVLITE_BINARY_DIR) + "/kvlite generate " + model_dir() +
                                          " --chat --prompt 'What is it?' --image " + image_path +
                                          " --max-tokens 8 --device-mem 64MiB",
                                      status);
  CHECK(status == 0);
  CHECK(cli == expected->text + "\n");
  run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + model_dir(), status);
  CHECK(status == 2);
  run_program(std::string(KVLITE_BINARY_DIR) + "/caption_image " + fx::dir("tiny-qwen3") + " " + image_path +
                  " --device-mem 64MiB",
              status);
  CHECK(status == 1);
}
