// captioner: the bundled Qwen3-VL captioner (models/kvlite-captioner-{bf16,fp8,w4a16}, tools/train_captioner.py)
// as make demo runs it. External truths: the scene generator's exact caption of each example image
// (examples/images/captions.txt, written with the images by the training script) and transformers' logits of
// each format (tests/fixtures/captioner, tools/make_captioner_fixtures.py).
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvlite.hpp"
#include "model_fixtures.hpp"

namespace {

const std::string kRoot = std::string(KVLITE_SOURCE_DIR) + "/";
const char* const kFormats[] = {"bf16", "fp8", "w4a16"};

std::string model_dir(const std::string& format) { return kRoot + "models/kvlite-captioner-" + format; }

// examples/images/captions.txt: "<file>\t<caption>" per line.
std::vector<std::pair<std::string, std::string>> example_captions() {
  std::ifstream in(kRoot + "examples/images/captions.txt");
  std::vector<std::pair<std::string, std::string>> examples;
  std::string line;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) examples.emplace_back(line.substr(0, tab), line.substr(tab + 1));
  }
  return examples;
}

std::unique_ptr<kvlite::Engine> open_captioner(const std::string& format) {
  kvlite::EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.device_mem = 256 * kvlite::MiB;  // the default would plan for 90% of this machine's memory
  auto engine = kvlite::Engine::open(model_dir(format), options);
  if (!engine) FAIL(format << ": " << engine.error().message);
  return std::move(*engine);
}

}  // namespace

TEST_CASE("the bundled captioner gives each example image the caption its scene was drawn with, in every format") {
  const auto examples = example_captions();
  REQUIRE(examples.size() >= 5);
  kvlite::SamplingParams greedy;
  greedy.max_tokens = 64;
  for (const char* format : kFormats) {
    auto engine = open_captioner(format);
    for (const auto& example : examples) {
      const std::string& file = example.first;  // not a structured binding: clang 14's doctest macros capture it
      const std::string& expected = example.second;
      auto image = kvlite::load_image(kRoot + "examples/images/" + file);
      REQUIRE_MESSAGE(image, file);
      const std::vector<kvlite::ChatMessage> messages = {
          {"user", std::string(kvlite::kImagePlaceholder) + "Describe this image."}};
      auto caption = engine->generate_chat(messages, {*image}, greedy);
      REQUIRE_MESSAGE(caption, caption.error().message);
      CHECK_MESSAGE(caption->text == expected, format << " " << file << ": got \"" << caption->text << "\"");
      CHECK(caption->finish_reason == kvlite::FinishReason::stop_token);
    }
  }
}

TEST_CASE("the bundled captioner's logits are transformers', in every format, with the prompt kvlite builds") {
  const nlohmann::json reference =
      nlohmann::json::parse(model_fixtures::read_file(kRoot + "tests/fixtures/captioner/reference.json"));
  for (const char* format : kFormats) {
    CAPTURE(format);
    const auto& entry = reference["formats"][format];
    auto engine = open_captioner(format);
    auto image = kvlite::load_image(kRoot + entry["image"].get<std::string>());
    REQUIRE(image);
    auto input = engine->preprocess(*image);
    REQUIRE(input);
    const std::vector<int32_t> ids = entry["ids"].get<std::vector<int32_t>>();  // one <|image_pad|> for the image

    // The prompt caption_image builds (chat template, image placeholder, question, open assistant turn) is the
    // fixture's prompt: the ids before the caption.
    auto chat = engine->tokenizer().format_chat(
        {{"user", std::string(kvlite::kImagePlaceholder) + "Describe this image."}}, true);
    REQUIRE(chat);
    auto prompt_ids = engine->tokenize(*chat, false);
    REQUIRE(prompt_ids);
    auto caption_ids = engine->tokenize(entry["caption"].get<std::string>() + "<|im_end|>", false);
    REQUIRE(caption_ids);
    REQUIRE(ids.size() > caption_ids->size());
    const std::vector<int32_t> prompt(ids.begin(), ids.end() - int64_t(caption_ids->size()));
    const std::vector<int32_t> answer(ids.end() - int64_t(caption_ids->size()), ids.end());
    CHECK(answer == *caption_ids);
    CHECK(*prompt_ids == prompt);
    CHECK(entry["expanded_tokens"].get<int64_t>() ==
          int64_t(ids.size()) - 1 + input->grid.image_tokens);  // the one placeholder becomes the image's tokens

    auto logits = engine->logits(ids, {*input});
    REQUIRE_MESSAGE(logits, logits.error().message);
    const auto expected = model_fixtures::read_npy(kRoot + "tests/fixtures/captioner/" +
                                                   entry["logits_file"].get<std::string>());
    REQUIRE(logits->tokens == expected.rows);
    REQUIRE(logits->vocab == expected.cols);
    CHECK(model_fixtures::relative_max_diff(logits->values, expected.values) <= 1e-4);
  }
}
