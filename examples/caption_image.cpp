// caption_image: describe an image with a Qwen3-VL model, streaming the text to stdout. Public API only.
//
//   caption_image MODEL_DIR IMAGE [--prompt TEXT] [--max-tokens N] [--device-mem SIZE]
//
// The image (JPEG, PNG, BMP, TGA, GIF, PNM) is decoded, preprocessed as transformers' Qwen3-VL processor
// does, and sent as a user message: the image placeholder followed by the prompt ("Describe this image." by
// default), in the model's chat format. Greedy decoding. Exit status: 0 done, 1 the library refused (the
// message says why), 2 usage error. Links the kvlite library (CMake target kvlite::kvlite), which holds the
// implementation; without CMake, define KVLITE_IMPLEMENTATION before this include instead.
#include "kvlite.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

int usage(const char* message) {
  if (message) fprintf(stderr, "caption_image: %s\n", message);
  fputs("usage: caption_image MODEL_DIR IMAGE [--prompt TEXT] [--max-tokens N] [--device-mem SIZE]\n"
        "  --prompt TEXT      what to ask about the image (default: \"Describe this image.\")\n"
        "  --max-tokens N     generate at most N tokens (default 128)\n"
        "  --device-mem SIZE  memory the plan divides, e.g. 8GiB (default: this machine's memory)\n",
        stderr);
  return 2;
}

int failed(const kvlite::Error& error) {
  fprintf(stderr, "caption_image: %s (%s)\n", error.message.c_str(), kvlite::error_code_name(error.code));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  std::string prompt = "Describe this image.";
  kvlite::SamplingParams params;  // greedy
  params.max_tokens = 128;
  kvlite::EngineOptions options;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(nullptr);
      return 0;
    }
    if (arg == "--prompt" || arg == "--max-tokens" || arg == "--device-mem") {
      if (i + 1 >= argc) return usage((arg + " needs a value").c_str());
      const std::string value = argv[++i];
      if (arg == "--prompt") {
        prompt = value;
      } else if (arg == "--max-tokens") {
        char* end = nullptr;
        const long long n = strtoll(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || n < 1) return usage("--max-tokens needs a positive integer");
        params.max_tokens = n;
      } else {
        auto bytes = kvlite::parse_size(value);
        if (!bytes) return usage(("--device-mem: " + bytes.error().message).c_str());
        options.plan.device_mem = *bytes;
      }
    } else if (arg.size() > 1 && arg[0] == '-') {
      return usage(("unknown option " + arg).c_str());
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) return usage("expected MODEL_DIR and IMAGE");

  auto image = kvlite::load_image(positional[1]);
  if (!image) return failed(image.error());
  auto engine = kvlite::Engine::open(positional[0], options);
  if (!engine) return failed(engine.error());

  auto print = [](const std::string& piece, int32_t) {
    fputs(piece.c_str(), stdout);
    fflush(stdout);
    return true;
  };
  std::vector<kvlite::ChatMessage> messages = {{"user", std::string(kvlite::kImagePlaceholder) + prompt}};
  auto generation = (*engine)->generate_chat(messages, {*image}, params, print);
  if (!generation) return failed(generation.error());
  fputs("\n", stdout);
  return 0;
}
