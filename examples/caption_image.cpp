// caption_image: describe an image with a Qwen3-VL model, streaming the text to stdout. Public API only.
//
//   caption_image MODEL_DIR IMAGE [--prompt TEXT] [--max-tokens N] [--backend B] [--device-mem SIZE]
//                 [--kv-dtype T] [--plan]
//
// The image (JPEG, PNG, BMP, TGA, GIF, PNM) is decoded, preprocessed as transformers' Qwen3-VL processor
// does, and sent as a user message: the image placeholder followed by the prompt ("Describe this image." by
// default), in the model's chat format. Greedy decoding. The caption goes to stdout; stderr says which backend
// ran and how long it took (open, time to first token, tokens/s), and with --plan first prints the engine's
// memory plan (the plan it opened with: `kvlite plan` prints the same for the same options). Exit status: 0
// done, 1 the library refused (the message says why), 2 usage error. Links the kvlite library (CMake target kvlite::kvlite), which holds the
// implementation; without CMake, define KVLITE_IMPLEMENTATION before this include instead.
#include "kvlite.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

int usage(const char* message) {
  if (message) fprintf(stderr, "caption_image: %s\n", message);
  fputs("usage: caption_image MODEL_DIR IMAGE [--prompt TEXT] [--max-tokens N] [--backend B] [--device-mem SIZE]\n"
        "                     [--kv-dtype T] [--plan]\n"
        "  --prompt TEXT      what to ask about the image (default: \"Describe this image.\")\n"
        "  --max-tokens N     generate at most N tokens (default 128)\n"
        "  --backend B        auto (default: the GPU when kvlite has CUDA and one is present, else the CPU) | cpu |\n"
        "                     cuda (the vision tower and the decoder on the GPU)\n"
        "  --device-mem SIZE  memory the plan divides, e.g. 8GiB (default: the device's)\n"
        "  --kv-dtype T       auto | f32 | bf16 | f16 | fp8 (e4m3, the CPU backend); default auto\n"
        "  --plan             print the engine's memory plan to stderr first\n"
        "The caption goes to stdout; the backend that ran and the timings go to stderr.\n",
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
  options.backend = kvlite::BackendChoice::auto_;
  bool print_plan = false;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(nullptr);
      return 0;
    }
    if (arg == "--plan") {
      print_plan = true;
    } else if (arg == "--prompt" || arg == "--max-tokens" || arg == "--device-mem" || arg == "--backend" ||
               arg == "--kv-dtype") {
      if (i + 1 >= argc) return usage((arg + " needs a value").c_str());
      const std::string value = argv[++i];
      if (arg == "--prompt") {
        prompt = value;
      } else if (arg == "--max-tokens") {
        char* end = nullptr;
        const long long n = strtoll(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || n < 1) return usage("--max-tokens needs a positive integer");
        params.max_tokens = n;
      } else if (arg == "--kv-dtype") {
        auto dtype = kvlite::parse_kv_dtype(value);
        if (!dtype) return usage(("--kv-dtype: " + dtype.error().message).c_str());
        options.plan.kv_dtype = *dtype;
      } else if (arg == "--backend") {
        auto backend = kvlite::parse_backend_choice(value);
        if (!backend) return usage(("--backend: " + backend.error().message).c_str());
        options.backend = *backend;
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

  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  auto image = kvlite::load_image(positional[1]);
  if (!image) return failed(image.error());
  const Clock::time_point opening = Clock::now();
  auto engine = kvlite::Engine::open(positional[0], options);
  if (!engine) return failed(engine.error());
  const double open_seconds = seconds_since(opening);
  const kvlite::Plan& plan = (*engine)->plan();
  if (print_plan) fputs(plan.table().c_str(), stderr);

  const Clock::time_point start = Clock::now();
  double first_token_seconds = -1;
  auto print = [&](const std::string& piece, int32_t) {
    if (first_token_seconds < 0) first_token_seconds = seconds_since(start);
    fputs(piece.c_str(), stdout);
    fflush(stdout);
    return true;
  };
  std::vector<kvlite::ChatMessage> messages = {{"user", std::string(kvlite::kImagePlaceholder) + prompt}};
  auto generation = (*engine)->generate_chat(messages, {*image}, params, print);
  if (!generation) return failed(generation.error());
  const double total_seconds = seconds_since(start);
  fputs("\n", stdout);
  fflush(stdout);
  // Decode speed: the tokens after the first over the time after it (the first includes the image and prefill).
  const size_t tokens = generation->ids.size();
  const double decode_seconds = total_seconds - std::max(first_token_seconds, 0.0);
  char rate[64] = "- tokens/s";
  if (tokens > 1 && decode_seconds > 0)
    snprintf(rate, sizeof rate, "%.1f tokens/s", double(tokens - 1) / decode_seconds);
  fprintf(stderr, "caption_image: backend %s [%s]; arena %s; open %.3f s, first token %.3f s, %zu tokens, %s\n",
          (*engine)->info().backend_name.c_str(), plan.backend_rule.c_str(),
          kvlite::format_bytes(plan.arena_bytes()).c_str(), open_seconds, std::max(first_token_seconds, 0.0), tokens,
          rate);
  return 0;
}
