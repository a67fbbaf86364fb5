// bench-speculative: what speculative decoding buys on this machine's CPU, in llm.c's manner: validate (every
// setting must give the same greedy tokens as plain decoding, or the bench stops), then time, then print the
// target model's forward passes per generated token (hardware-independent) beside the wall-clock speed-up.
//
//   build/bench-speculative [--repeats N] [--draft-captioner DIR]...
//
// Workloads: the bundled BF16 captioner on the five example images ("Describe this image.", chat format), and
// tiny-llama3 (a random fixture) continuing the fixture prompts for 64 tokens. Settings: plain decoding, n-gram
// drafting (--ngram 2 --spec-tokens 4), and draft models: models/kvlite-captioner-draft (the captioner's first
// layer, tools/make_draft_model.py) for the captioner, tests/fixtures/models/tiny-llama3-draft (tiny-llama3 with
// 2% noise) for the text model, each at K = 2 and 4; --draft-captioner adds other captioner drafts.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kvlite.hpp"

namespace {

struct Setting {
  std::string name;
  kvlite::EngineOptions options;
};

struct Workload {
  std::string name, model;
  std::vector<kvlite::Image> images;  // one caption per image; empty: text prompts
  std::vector<std::vector<int32_t>> prompts;
  int64_t max_tokens = 64;
  std::vector<Setting> settings;
};

struct Run {
  std::vector<std::vector<int32_t>> outputs;
  kvlite::EngineStats stats;
  double seconds = 0;
};

[[noreturn]] void die(const std::string& message) {
  fprintf(stderr, "bench-speculative: %s\n", message.c_str());
  exit(1);
}

Run run(const Workload& w, const Setting& s, int repeats) {
  kvlite::EngineOptions options = s.options;
  options.plan.device_mem = 512 * kvlite::MiB;
  options.prefix_caching = false;  // every pass counted
  auto engine = kvlite::Engine::open(w.model, options);
  if (!engine) die(s.name + ": " + engine.error().message);
  kvlite::SamplingParams params;
  params.max_tokens = w.max_tokens;
  Run r;
  const auto start = std::chrono::steady_clock::now();
  for (int repeat = 0; repeat < repeats; repeat++) {
    const size_t count = w.images.empty() ? w.prompts.size() : w.images.size();
    for (size_t i = 0; i < count; i++) {
      kvlite::Result<kvlite::Generation> g =
          w.images.empty() ? (*engine)->generate(w.prompts[i], params)
                           : (*engine)->generate_chat({{"user", std::string(kvlite::kImagePlaceholder) +
                                                                    "Describe this image."}},
                                                      {w.images[i]}, params);
      if (!g) die(s.name + ": " + g.error().message);
      if (repeat == 0) r.outputs.push_back(g->ids);
    }
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.stats = (*engine)->stats();
  return r;
}

kvlite::EngineOptions ngram(int64_t n, int64_t k) {
  kvlite::EngineOptions o;
  o.plan.ngram = n;
  o.plan.speculative_tokens = k;
  return o;
}
kvlite::EngineOptions draft(const std::string& dir, int64_t k) {
  kvlite::EngineOptions o;
  o.draft_model = dir;
  o.plan.speculative_tokens = k;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string root = KVLITE_BENCH_SOURCE_DIR "/";
  int repeats = 10;
  std::vector<std::string> extra_drafts;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "--repeats" && i + 1 < argc) repeats = std::max(1, atoi(argv[++i]));
    else if (arg == "--draft-captioner" && i + 1 < argc) extra_drafts.push_back(argv[++i]);
    else die("usage: bench-speculative [--repeats N] [--draft-captioner DIR]...");
  }

  std::vector<Workload> workloads(2);
  Workload& captions = workloads[0];
  captions.name = "captioner (5 example images)";
  captions.model = root + "models/kvlite-captioner-bf16";
  {
    std::ifstream in(root + "examples/images/captions.txt");
    for (std::string line; std::getline(in, line);) {
      if (line.find('\t') == std::string::npos) continue;
      auto image = kvlite::load_image(root + "examples/images/" + line.substr(0, line.find('\t')));
      if (!image) die(image.error().message);
      captions.images.push_back(std::move(*image));
    }
  }
  captions.settings = {{"plain", {}}, {"n-gram 2, K 4", ngram(2, 4)}};
  for (int64_t k : {2, 4})
    captions.settings.push_back({"draft 1 layer, K " + std::to_string(k), draft(root + "models/kvlite-captioner-draft", k)});
  for (const std::string& dir : extra_drafts)
    for (int64_t k : {2, 4}) captions.settings.push_back({dir + ", K " + std::to_string(k), draft(dir, k)});

  Workload& text = workloads[1];
  text.name = "tiny-llama3 (random), 64 tokens x 3 prompts";
  text.model = root + "tests/fixtures/models/tiny-llama3";
  {
    auto engine = kvlite::Engine::open(text.model);
    if (!engine) die(engine.error().message);
    for (const char* prompt : {"The quick brown fox", "Once upon a time", "def fibonacci(n):"}) {
      auto ids = (*engine)->tokenize(prompt);
      if (!ids) die(ids.error().message);
      text.prompts.push_back(*ids);
    }
  }
  text.settings = {{"plain", {}}, {"n-gram 2, K 4", ngram(2, 4)}};
  for (int64_t k : {2, 4})
    text.settings.push_back({"draft (2% noise), K " + std::to_string(k),
                             draft(root + "tests/fixtures/models/tiny-llama3-draft", k)});

  printf("bench-speculative: %d repeats, CPU, prefix caching off\n", repeats);
  printf("| workload | setting | drafted | accepted | target passes / token | draft passes | wall s | speed-up |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (const Workload& w : workloads) {
    Run plain;
    for (size_t i = 0; i < w.settings.size(); i++) {
      const Setting& s = w.settings[i];
      Run r = run(w, s, repeats);
      if (i == 0) plain = r;
      else if (r.outputs != plain.outputs) die(w.name + ", " + s.name + ": the tokens differ from plain decoding");
      const double per_token = double(r.stats.steps) / double(r.stats.tokens_generated);
      printf("| %s | %s | %lld | %lld | %.2f | %lld | %.3f | %.2fx |\n", w.name.c_str(), s.name.c_str(),
             (long long)r.stats.draft_tokens, (long long)r.stats.draft_tokens_accepted, per_token,
             (long long)r.stats.draft_steps, r.seconds, plain.seconds / r.seconds);
      fflush(stdout);
    }
  }
  return 0;
}
