// cli: the kvlite command-line tool, run as a program (build/kvlite): exit codes 0 fits / 1 does not fit /
// 2 usage or input error, one message on stderr, never a crash; plan output as table, JSON, SVG and CSV.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <cstdio>
#include <fstream>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"

namespace {

struct Run {
  int status = -1;  // exit status; -1 when it did not exit normally (a crash)
  std::string out, err;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string quote(const std::string& arg) {
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs build/kvlite with these arguments; stdout through a pipe, stderr through a file.
Run run_kvlite(const std::vector<std::string>& args) {
  static const std::string err_path = testing_safetensors::temp_dir("cli-stderr") + "/stderr";
  std::string command = quote(std::string(KVLITE_BINARY_DIR) + "/kvlite");
  for (const auto& a : args) command += " " + quote(a);
  command += " 2>" + quote(err_path);
  Run run;
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) run.out.append(buffer, n);
  int status = pclose(pipe);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.err = read_file(err_path);
  return run;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

const std::string kQwenVL = std::string(KVLITE_SOURCE_DIR) + "/models/qwen3-vl-4b-instruct-fp8";
const std::string kLlama = std::string(KVLITE_SOURCE_DIR) + "/models/llama-3.1-8b-instruct-w4a16";

}  // namespace

TEST_CASE("--version and --help exit 0 on stdout") {
  Run version = run_kvlite({"--version"});
  CHECK(version.status == 0);
  CHECK(version.out == std::string("kvlite ") + KVLITE_VERSION_STRING + "\n");
  Run help = run_kvlite({"--help"});
  CHECK(help.status == 0);
  CHECK(contains(help.out, "plan"));
  CHECK(help.err.empty());
  for (const auto& args : std::vector<std::vector<std::string>>{{"plan", "--help"}, {"help", "plan"}, {"plan", "-h"}}) {
    Run plan_help = run_kvlite(args);
    CHECK(plan_help.status == 0);
    for (const char* option : {"--backend", "--device", "--device-mem", "--utilization", "--max-model-len", "--max-seqs",
                               "--max-batched-tokens", "--kv-dtype", "--kv-fill", "--host-embeddings", "--max-image-pixels", "--wsl2",
                               "--no-wsl2", "--json", "--sweep", "--svg"})
      CHECK_MESSAGE(contains(plan_help.out, option), option);
  }
}

TEST_CASE("usage errors exit 2 with one message on stderr naming the problem") {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{}, "usage: kvlite COMMAND"},
      {{"plna"}, "did you mean plan?"},
      {{"help", "nope"}, "unknown command 'nope'"},
      {{"plan"}, "MODEL_DIR is missing"},
      {{"plan", "a", "b"}, "'b' is extra"},
      {{"plan", "a", "--max-model-lenn", "5"}, "did you mean --max-model-len?"},
      {{"plan", "a", "--device-mem", "8XB"}, "'8XB'"},
      {{"plan", "a", "--utilization", "abc"}, "'abc'"},
      {{"plan", "a", "--max-model-len", "0"}, "--max-model-len 0 is outside 1.."},
      {{"plan", "a", "--max-seqs", "-3"}, "--max-seqs -3"},
      {{"plan", "a", "--max-batched-tokens", "2k"}, "'2k'"},
      {{"plan", "a", "--kv-dtype", "int8"}, "'int8'"},
      {{"plan", "a", "--wsl2", "--no-wsl2"}, "contradict"},
      {{"plan", "a", "--json", "--json"}, "given twice"},
      {{"plan", "a", "--max-seqs"}, "needs a value"},
      {{"plan", "a", "--json=1"}, "takes no value"},
      {{"plan", "a", "--sweep", "foo=1"}, "unknown key 'foo'"},
      {{"plan", "a", "--sweep", "max-model-len=1,x"}, "'x'"},
      {{"plan", "a", "--sweep", "max-model-len=1", "--json"}, "CSV only"},
      {{"plan", "/nonexistent/kvlite-model"}, "/nonexistent/kvlite-model"},
  };
  for (const auto& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    CAPTURE(joined);
    Run run = run_kvlite(c.args);
    CHECK(run.status == 2);
    CHECK(run.out.empty());
    CHECK_MESSAGE(contains(run.err, c.needle), run.err);
  }
}

TEST_CASE("plan on the shipped Qwen3-VL-4B FP8 config: 8 GiB under WSL2 at 0.80 x 4096 does not fit (exit 1)") {
  Run run = run_kvlite({"plan", kQwenVL, "--backend", "cuda", "--device-mem", "8GiB", "--wsl2", "--utilization", "0.80", "--max-model-len", "4096"});
  CHECK(run.status == 1);
  CHECK(run.err.empty());
  CHECK(contains(run.out, "budget = 0.80 x 8.00 GiB = 6.40 GiB"));
  CHECK(contains(run.out, "DOES NOT FIT"));
  CHECK(contains(run.out, "Does not fit: KV needs 576.0 MiB for one 4096-token sequence"));
  CHECK(contains(run.out, "weights (estimated from config.json)"));
  CHECK(contains(run.out, "WSL2"));
}

TEST_CASE("plan on the shipped Llama-3.1-8B W4A16 config: 2048 fits (exit 0), 131072 does not (exit 1)") {
  Run fits = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--no-wsl2", "--max-model-len", "2048"});
  CHECK(fits.status == 0);
  CHECK(contains(fits.out, "FITS"));
  CHECK(contains(fits.out, "128.0 KiB per token (bf16)"));
  Run full = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--no-wsl2", "--max-model-len", "131072"});
  CHECK(full.status == 1);
  CHECK(contains(full.out, "KV needs 16.00 GiB for one 131072-token sequence"));
  CHECK(contains(full.out, "does not fit at any utilization"));
}

// Regression (issue 15, defect 1): utilization_for stepped with nextafter(u, 2.0), which moves down once the
// needed utilization is above 2, so these two commands never returned (ctest's timeout catches a relapse).
TEST_CASE("regression: the planner hung when the needed utilization was above 2") {
  Run plan = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "3GiB", "--no-wsl2", "--max-model-len", "4096"});
  CHECK(plan.status == 1);
  // (the figure depends on the CUDA context, planned for the GPU present when there is one)
  CHECK(contains(plan.out, "max_model_len 4096 does not fit at any utilization: needs "));
  CHECK(contains(plan.out, " GiB more than the whole 3.00 GiB card"));
  if (kvlite::cuda::device_count() == 0)
    CHECK(contains(plan.out, "needs 3.55 GiB more than the whole 3.00 GiB card"));
  Run generate = run_kvlite({"generate", std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3", "--prompt",
                             "hi", "--device-mem", "1500KiB"});
  CHECK(generate.status == 1);
  CHECK(contains(generate.err, "does not fit"));
}

TEST_CASE("one plan: kvlite plan prints the plan Engine::open opens with, for the same options as generate") {
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3";
  for (const std::vector<std::string>& flags : std::vector<std::vector<std::string>>{
           {},
           {"--backend", "cpu", "--device-mem", "64MiB", "--max-model-len", "96", "--max-seqs", "3"},
           // (auto: a GPU where there is one, whose plan holds the CUDA context: more than the CPU's 32 MiB)
           {"--backend", "auto", "--kv-fill", "--device-mem", kvlite::cuda::device_count() > 0 ? "2GiB" : "32MiB",
            "--utilization", "0.5", "--kv-page-tokens", "8"}}) {
    std::vector<std::string> args = {"plan", dir, "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    Run run = run_kvlite(args);
    CAPTURE(run.err);
    REQUIRE(run.status == 0);
    // The same flags, parsed as generate parses them, opened as generate opens them.
    kvlite::EngineOptions options;
    options.backend = kvlite::BackendChoice::auto_;  // the CLI's default
    for (size_t i = 0; i < flags.size(); i++) {
      if (flags[i] == "--backend") options.backend = *kvlite::parse_backend_choice(flags[++i]);
      else if (flags[i] == "--device-mem") options.plan.device_mem = *kvlite::parse_size(flags[++i]);
      else if (flags[i] == "--max-model-len") options.plan.max_model_len = std::stoll(flags[++i]);
      else if (flags[i] == "--max-seqs") options.plan.max_seqs = std::stoll(flags[++i]);
      else if (flags[i] == "--utilization") options.plan.utilization = std::stod(flags[++i]);
      else if (flags[i] == "--kv-page-tokens") options.plan.kv_page_tokens = std::stoll(flags[++i]);
      else if (flags[i] == "--kv-fill") options.plan.kv_fill = true;
    }
    auto engine = kvlite::Engine::open(dir, options);
    REQUIRE_MESSAGE(engine.ok(), engine.error().message);
    CHECK(model_fixtures::plan_json_for_comparison(run.out) ==
          model_fixtures::plan_json_for_comparison((*engine)->plan().json()));
  }
}

TEST_CASE("plan --backend cuda without a GPU plans a card only when told its size") {
  if (kvlite::cuda::built_with_cuda() && kvlite::cuda::device_count() > 0) {
    MESSAGE("skipped: a GPU is present, so --backend cuda plans it");
    return;
  }
  Run none = run_kvlite({"plan", kLlama, "--backend", "cuda"});
  CHECK(none.status == 2);
  CHECK(contains(none.err, "--device-mem"));
  Run card = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--no-wsl2"});
  CHECK(card.status <= 1);
  CHECK(contains(card.out, "backend cuda (--backend cuda; a planned card, no GPU here)"));
  Run cpu = run_kvlite({"plan", kLlama, "--device-mem", "8GiB", "--no-wsl2"});  // auto: the CPU is what runs here
  CHECK(contains(cpu.out, "device CPU"));
  Run bad = run_kvlite({"plan", kLlama, "--backend", "tpu"});
  CHECK(bad.status == 2);
  CHECK(contains(bad.err, "unknown backend 'tpu'"));
}

TEST_CASE("plan options the model refuses exit 2 with the value") {
  Run too_long = run_kvlite({"plan", kQwenVL, "--backend", "cuda", "--device-mem", "8GiB", "--max-model-len", "300000"});
  CHECK(too_long.status == 2);
  CHECK(contains(too_long.err, "300000"));
  CHECK(contains(too_long.err, "262144"));
  Run ratio = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--utilization", "1.5"});
  CHECK(ratio.status == 2);
  CHECK(contains(ratio.err, "utilization 1.5"));
  Run no_vision = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--max-image-pixels", "1048576"});
  CHECK(no_vision.status == 2);
  CHECK(contains(no_vision.err, "no vision tower"));
}

TEST_CASE("plan --json is one JSON document whose verdict matches the exit status") {
  for (const char* length : {"2048", "131072"}) {
    Run run = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--no-wsl2", "--max-model-len", length, "--json"});
    CAPTURE(length);
    REQUIRE(run.status <= 1);
    auto j = nlohmann::json::parse(run.out);
    CHECK(j["fits"].get<bool>() == (run.status == 0));
    CHECK(j["kv_bytes_per_token"].get<uint64_t>() == 131072);
    CHECK(j["weights_source"] == "config");
    CHECK(j["max_model_len"].get<int64_t>() == std::stoll(length));
    CHECK(j["budget_bytes"].is_number_integer());
  }
}

TEST_CASE("plan --svg writes a standalone SVG next to the table") {
  std::string path = testing_safetensors::temp_dir("cli-svg") + "/plan.svg";
  Run run = run_kvlite({"plan", kQwenVL, "--backend", "cuda", "--device-mem", "8GiB", "--svg", path});
  CHECK(run.status <= 1);
  CHECK(contains(run.out, "budget ="));
  std::string svg = read_file(path);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(contains(svg, "</svg>"));
  Run unwritable = run_kvlite({"plan", kQwenVL, "--backend", "cuda", "--device-mem", "8GiB", "--svg", "/nonexistent/dir/plan.svg"});
  CHECK(unwritable.status == 2);
  CHECK(contains(unwritable.err, "/nonexistent/dir/plan.svg"));
}

TEST_CASE("plan --sweep prints CSV for each value and exits 0") {
  Run run = run_kvlite({"plan", kLlama, "--backend", "cuda", "--device-mem", "8GiB", "--no-wsl2", "--sweep", "max-model-len=512,2048,131072"});
  CHECK(run.status == 0);
  std::vector<std::string> lines;
  std::istringstream in(run.out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0] == "max_model_len,total_bytes,kv_bytes,concurrency,fits");
  CHECK(lines[1].rfind("512,", 0) == 0);
  CHECK(contains(lines[1], ",67108864,"));  // 512 x 128 KiB
  CHECK(contains(lines[2], ",268435456,"));  // 2048 x 128 KiB
  CHECK(lines[2].substr(lines[2].size() - 5) == ",true");
  CHECK(contains(lines[3], ",17179869184,"));  // 131072 x 128 KiB = 16 GiB
  CHECK(lines[3].substr(lines[3].size() - 6) == ",false");
  Run by_card = run_kvlite({"plan", kLlama, "--max-model-len", "4096", "--sweep", "device-mem=6GiB,24GiB"});
  CHECK(by_card.status == 0);
  CHECK(by_card.out.rfind("device_mem,max_model_len,total_bytes,kv_bytes,concurrency,fits\n6GiB,4096,", 0) == 0);
}

// ---- the engine commands, on the tiny fixture models (tests/fixtures/models, references from transformers) ----

TEST_CASE("tokenize prints the ids transformers' tokenizer gives, as a JSON array") {
  const nlohmann::json reference = model_fixtures::reference("tiny-llama3");
  const auto& prompt = reference["prompts"][1];
  Run run = run_kvlite({"tokenize", model_fixtures::dir("tiny-llama3"), "--text", prompt["text"].get<std::string>()});
  CHECK(run.status == 0);
  CHECK(run.err.empty());
  CHECK(nlohmann::json::parse(run.out) == prompt["input_ids"]);  // <|begin_of_text|> first, as encode(add_special_tokens=True)
  Run plain = run_kvlite({"tokenize", model_fixtures::dir("tiny-llama3"), "--text", prompt["text"].get<std::string>(),
                          "--no-special-tokens"});
  CHECK(plain.status == 0);
  nlohmann::json without_bos = prompt["input_ids"];
  without_bos.erase(without_bos.begin());
  CHECK(nlohmann::json::parse(plain.out) == without_bos);
}

TEST_CASE("generate streams transformers' greedy continuation to stdout") {
  for (const std::string& name : {"tiny-llama3", "tiny-qwen3"}) {
    CAPTURE(name);
    const nlohmann::json reference = model_fixtures::reference(name);
    const auto& prompt = reference["prompts"][0];
    Run run = run_kvlite({"generate", model_fixtures::dir(name), "--prompt", prompt["text"].get<std::string>(),
                          "--max-tokens", "16", "--backend", "cpu", "--device-mem", "64MiB", "--threads", "1"});
    CHECK(run.status == 0);
    CHECK(run.out == prompt["greedy"]["text"].get<std::string>() + "\n");
    CHECK_MESSAGE(contains(run.err, "16 generated tokens"), run.err);
  }
}

TEST_CASE("generate --cpu-kernels fast gives transformers' greedy continuation, an unknown kernel set is refused") {
  const std::string name = "tiny-qwen3";
  const nlohmann::json reference = model_fixtures::reference(name);
  const auto& prompt = reference["prompts"][0];
  Run run = run_kvlite({"generate", model_fixtures::dir(name), "--prompt", prompt["text"].get<std::string>(),
                        "--max-tokens", "16", "--backend", "cpu", "--device-mem", "64MiB", "--threads", "2",
                        "--cpu-kernels", "fast"});
  CHECK(run.status == 0);
  CHECK(run.out == prompt["greedy"]["text"].get<std::string>() + "\n");
  Run bad = run_kvlite({"generate", model_fixtures::dir(name), "--prompt", "hi", "--backend", "cpu",
                        "--device-mem", "64MiB", "--cpu-kernels", "quick"});
  CHECK(bad.status != 0);
  CHECK_MESSAGE(contains(bad.err, "--cpu-kernels: 'quick': use reference, fast or fast-lowp"), bad.err);
}

TEST_CASE("--cpu-lm-head int8: the plan's repack row holds the copy, and unknown values and CUDA are refused") {
  const std::string dir = model_fixtures::dir("tiny-qwen3");  // tied: the [1415, 64] F16 embedding table
  Run run = run_kvlite({"plan", dir, "--backend", "cpu", "--device-mem", "64MiB", "--cpu-lm-head", "int8"});
  CHECK(run.status == 0);
  const uint64_t copy = kvlite::int8_copy_bytes(1415, 64);
  CHECK_MESSAGE(contains(run.out, "--cpu-lm-head int8: the lm_head's int8 copy [1415, 64] with F32 scales per 64 "
                                  "columns, " + kvlite::format_bytes(copy)), run.out);
  Run stored = run_kvlite({"plan", dir, "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(stored.status == 0);
  CHECK_FALSE(contains(stored.out, "--cpu-lm-head"));
  Run bad = run_kvlite({"generate", dir, "--prompt", "hi", "--backend", "cpu", "--device-mem", "64MiB",
                        "--cpu-lm-head", "int4"});
  CHECK(bad.status == 2);
  CHECK_MESSAGE(contains(bad.err, "--cpu-lm-head: 'int4': use stored or int8"), bad.err);
  Run gpu = run_kvlite({"plan", dir, "--backend", "cuda", "--device-mem", "8GiB", "--cpu-lm-head", "int8"});
  CHECK(gpu.status != 0);
  CHECK_MESSAGE(contains(gpu.err, "cpu_lm_head int8 is a CPU backend option"), gpu.err);
}

TEST_CASE("generate --logprobs prints each token's id and log-probability, as the library gives them") {
  const std::string name = "tiny-qwen3";
  const nlohmann::json reference = model_fixtures::reference(name);
  const auto& prompt = reference["prompts"][0];
  Run run = run_kvlite({"generate", model_fixtures::dir(name), "--prompt", prompt["text"].get<std::string>(),
                        "--max-tokens", "16", "--backend", "cpu", "--device-mem", "64MiB", "--threads", "1",
                        "--logprobs"});
  CHECK(run.status == 0);
  CHECK(run.out == prompt["greedy"]["text"].get<std::string>() + "\n");
  kvlite::EngineOptions cpu;
  cpu.backend = kvlite::BackendChoice::cpu;  // as --backend cpu (EngineOptions defaults to auto)
  auto engine = kvlite::Engine::open(model_fixtures::dir(name), cpu);
  REQUIRE(engine);
  kvlite::SamplingParams params;
  params.max_tokens = 16;
  params.logprobs = true;
  auto generation = (*engine)->generate(prompt["text"].get<std::string>(), params);
  REQUIRE(generation);
  REQUIRE(generation->ids.size() == 16);
  std::istringstream lines(run.err);
  size_t seen = 0;
  for (std::string line; std::getline(lines, line);) {
    size_t index = 0;
    int id = 0;
    double logprob = 0;
    if (sscanf(line.c_str(), "kvlite generate: token %zu id %d logprob %lf", &index, &id, &logprob) != 3) continue;
    CAPTURE(line);
    REQUIRE(index < generation->ids.size());
    CHECK(id == generation->ids[index]);
    CHECK(std::fabs(logprob - double(generation->logprobs[index])) <= 1e-6);
    seen++;
  }
  CHECK(seen == 16);
}

TEST_CASE("generate --backend cpu --activation-dtype bf16 | f16 runs the GPU's rounding on the CPU") {
  // The tiny fixtures' greedy continuations survive 16-bit activations (unit-cpu-dtypes.cpp measures how close
  // the logits stay); here: the flag reaches the engine and the plan says so.
  const nlohmann::json reference = model_fixtures::reference("tiny-llama3");
  const auto& prompt = reference["prompts"][0];
  for (const char* dtype : {"bf16", "f16"}) {
    CAPTURE(dtype);
    Run run = run_kvlite({"generate", model_fixtures::dir("tiny-llama3"), "--prompt", prompt["text"].get<std::string>(),
                          "--max-tokens", "8", "--backend", "cpu", "--device-mem", "64MiB", "--activation-dtype", dtype});
    INFO(run.err);
    CHECK(run.status == 0);
    CHECK_FALSE(run.out.empty());
    Run plan = run_kvlite({"plan", model_fixtures::dir("tiny-llama3"), "--backend", "cpu", "--device-mem", "64MiB",
                           "--activation-dtype", dtype, "--json"});
    CHECK(plan.status == 0);
    const nlohmann::json doc = nlohmann::json::parse(plan.out);
    CHECK(doc["options"]["activation_dtype"] == (std::string(dtype) == "bf16" ? "BF16" : "F16"));
    CHECK(doc["options"]["kv_dtype"] == dtype);
  }
}

TEST_CASE("generate --chat formats the prompt in the model's chat format") {
  const nlohmann::json reference = model_fixtures::reference("tiny-qwen2");
  const auto& chat = reference["prompts"][2];
  Run run = run_kvlite({"generate", model_fixtures::dir("tiny-qwen2"), "--chat", "--system",
                        chat["messages"][0]["content"].get<std::string>(), "--prompt",
                        chat["messages"][1]["content"].get<std::string>(), "--max-tokens", "16", "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(run.status == 0);
  CHECK(run.out == chat["greedy"]["text"].get<std::string>() + "\n");
  CHECK_MESSAGE(contains(run.err, std::to_string(chat["input_ids"].size()) + " prompt"), run.err);
}

TEST_CASE("generate stops at a full context (length), refuses a prompt that cannot fit (exit 1) and bad options (exit 2)") {
  const std::string dir = model_fixtures::dir("tiny-qwen3");
  Run full = run_kvlite({"generate", dir, "--prompt", "hi", "--max-tokens", "100", "--max-model-len", "64",
                         "--backend", "cpu", "--device-mem", "64MiB"});  // (the random fixture never says eos in 63 tokens)
  CHECK(full.status == 0);
  CHECK_MESSAGE(contains(full.err, "1 prompt + 63 generated tokens"), full.err);
  CHECK_MESSAGE(contains(full.err, "(length)"), full.err);
  std::string long_prompt;
  for (int i = 0; i < 80; i++) long_prompt += " hi";
  Run too_long = run_kvlite({"generate", dir, "--prompt", long_prompt, "--max-model-len", "64", "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(too_long.status == 1);
  CHECK(too_long.out.empty());
  CHECK_MESSAGE(contains(too_long.err, "max_model_len is 64"), too_long.err);
  Run bad = run_kvlite({"generate", dir, "--prompt", "hi", "--top-p", "1.5"});
  CHECK(bad.status == 2);
  CHECK_MESSAGE(contains(bad.err, "top_p"), bad.err);
  Run missing = run_kvlite({"generate", dir});
  CHECK(missing.status == 2);
  CHECK_MESSAGE(contains(missing.err, "--prompt is required"), missing.err);
}

TEST_CASE("score prints the sliding-window perplexity transformers' guide computes") {
  const nlohmann::json reference = model_fixtures::reference("tiny-qwen2")["perplexity"];
  const std::string text_file = testing_safetensors::temp_dir("cli-score") + "/text.txt";
  std::ofstream(text_file, std::ios::binary) << reference["text"].get<std::string>();
  Run run = run_kvlite({"score", model_fixtures::dir("tiny-qwen2"), "--text-file", text_file, "--context-length",
                        std::to_string(reference["context_length"].get<int64_t>()), "--stride",
                        std::to_string(reference["stride"].get<int64_t>()), "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(run.status == 0);
  CHECK(run.err.empty());  // progress only when stderr is a terminal
  double perplexity = 0, guide = 0;
  REQUIRE(sscanf(run.out.c_str(), "perplexity: %lf", &perplexity) == 1);
  REQUIRE(contains(run.out, "guide perplexity: "));
  REQUIRE(sscanf(run.out.c_str() + run.out.find("guide perplexity: "), "guide perplexity: %lf", &guide) == 1);
  const double exact = reference["exact_ppl"].get<double>(), guide_reference = reference["guide_ppl"].get<double>();
  CHECK(std::fabs(perplexity - exact) <= 1e-4 * exact);
  CHECK(std::fabs(guide - guide_reference) <= 1e-4 * guide_reference);
  CHECK(contains(run.out, "tokens: " + std::to_string(reference["exact_tokens"].get<int64_t>()) + " scored"));
}

TEST_CASE("logits writes transformers' logits as a float32 .npy") {
  const nlohmann::json reference = model_fixtures::reference("tiny-qwen3");
  const auto& prompt = reference["prompts"][1];
  std::string tokens;
  for (const auto& id : prompt["input_ids"]) tokens += (tokens.empty() ? "" : ",") + std::to_string(id.get<int>());
  const std::string out = testing_safetensors::temp_dir("cli-logits") + "/logits.npy";
  Run run = run_kvlite({"logits", model_fixtures::dir("tiny-qwen3"), "--tokens", tokens, "--out", out,
                        "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(run.status == 0);
  CHECK(run.err.empty());
  model_fixtures::Npy written = model_fixtures::read_npy(out);
  model_fixtures::Npy expected =
      model_fixtures::read_npy(model_fixtures::dir("tiny-qwen3") + "/" + prompt["logits_file"].get<std::string>());
  REQUIRE(written.rows == expected.rows);
  REQUIRE(written.cols == expected.cols);
  CHECK(model_fixtures::relative_max_diff(written.values, expected.values) <= 1e-4);
  Run bad = run_kvlite({"logits", model_fixtures::dir("tiny-qwen3"), "--tokens", "1,x", "--out", out});
  CHECK(bad.status == 2);
  CHECK_MESSAGE(contains(bad.err, "'x'"), bad.err);
}

TEST_CASE("generate and logits run the FP8 and W4A16 fixture checkpoints as stored") {
  for (const std::string name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant/" + name;
    const nlohmann::json prompt = nlohmann::json::parse(read_file(dir + "/reference.json"))["prompts"][0];
    Run generated = run_kvlite({"generate", dir, "--prompt", prompt["text"].get<std::string>(), "--max-tokens", "16",
                                "--backend", "cpu", "--device-mem", "64MiB"});
    CHECK_MESSAGE(generated.status == 0, generated.err);
    CHECK(generated.out == prompt["greedy"]["text"].get<std::string>() + "\n");
    std::string tokens;
    for (const auto& id : prompt["input_ids"]) tokens += (tokens.empty() ? "" : ",") + std::to_string(id.get<int>());
    const std::string out = testing_safetensors::temp_dir("cli-quant-logits") + "/" + name + ".npy";
    Run logits = run_kvlite({"logits", dir, "--tokens", tokens, "--out", out, "--backend", "cpu", "--device-mem", "64MiB"});
    CHECK_MESSAGE(logits.status == 0, logits.err);
    model_fixtures::Npy written = model_fixtures::read_npy(out);
    model_fixtures::Npy expected = model_fixtures::read_npy(dir + "/" + prompt["logits_file"].get<std::string>());
    REQUIRE(written.rows == expected.rows);
    REQUIRE(written.cols == expected.cols);
    CHECK(model_fixtures::relative_max_diff(written.values, expected.values) <= 1e-4);
  }
}

// ---- kvlite bench -------------------------------------------------------------------------------------------

namespace {
// The numbers of a line, in order (a trailing % is dropped).
std::vector<double> numbers_of(const std::string& line) {
  std::vector<double> out;
  std::istringstream in(line);
  std::string word;
  while (in >> word) {
    if (!word.empty() && word.back() == '%') word.pop_back();
    char* end = nullptr;
    const double value = std::strtod(word.c_str(), &end);
    if (end != word.c_str() && *end == '\0') out.push_back(value);
  }
  return out;
}
}  // namespace

TEST_CASE("bench --profile: a prefill's and a decode step's ops, one row each, with the time between them, adding up to the step") {
  Run run = run_kvlite({"bench", model_fixtures::dir("tiny-qwen3"), "--backend", "cpu", "--batch", "2,1",
                        "--prompt-tokens", "12", "--decode-tokens", "6", "--device-mem", "256MiB", "--threads", "2",
                        "--profile"});
  INFO(run.err);
  INFO(run.out);
  REQUIRE(run.status == 0);
  // tiny-qwen3 runs attention and rope_kv_write once per layer per step (2 layers), prefill or decode
  const int64_t layers = kvlite::load_config(model_fixtures::dir("tiny-qwen3")).value().text.num_layers;
  // the prefill: both 12-token prompts; the decode: the 5 steps after the first tokens
  for (const char* title : {"profile: batch 2, a prefill step of its 12-token prompts (the mean of ",
                            "profile: batch 2, a decode step (the mean of 5;"}) {
    CAPTURE(title);
    const size_t start = run.out.find(title);
    REQUIRE(start != std::string::npos);
    std::istringstream table(run.out.substr(start));
    std::string line;
    std::getline(table, line);  // the title
    std::getline(table, line);  // the header
    CHECK(contains(line, "us/call"));
    std::map<std::string, std::vector<double>> rows;
    while (std::getline(table, line) && !line.empty()) {
      const size_t name_end = line.find("  ");
      REQUIRE(name_end != std::string::npos);
      std::string values = line.substr(name_end);
      values.erase(std::remove(values.begin(), values.end(), '%'), values.end());
      rows[line.substr(0, name_end)] = numbers_of(values);
    }
    for (const char* op : {"attention", "rope_kv_write"}) {
      CAPTURE(op);
      REQUIRE(rows.count(op) == 1);
      REQUIRE(rows[op].size() == 4);  // calls, ms, us/call, share%
      CHECK(rows[op][0] == double(layers));
    }
    REQUIRE(rows.count("(all ops)") == 1);
    REQUIRE(rows.count("(between the ops)") == 1);
    double ops_share = 0;
    for (const auto& row : rows)
      if (row.first[0] != '(') ops_share += row.second.back();
    CHECK(std::fabs(ops_share - rows["(all ops)"].back()) <= 0.1 * double(rows.size()));  // each share rounded to 0.1
    CHECK(std::fabs(rows["(all ops)"].back() + rows["(between the ops)"].back() - 100.0) <= 0.2);
  }
}

TEST_CASE("bench: a vision-language model's random prompts hold no image or video marker") {
  // The captioner's 373-token vocabulary: 64 ids drawn uniformly would hold its image placeholder (id 371) with
  // probability 1 - (372/373)^64 = 16%, per prompt; batch 8 makes a miss nearly certain to show.
  Run run = run_kvlite({"bench", std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16", "--backend", "cpu",
                        "--batch", "1,8", "--prompt-tokens", "64", "--decode-tokens", "3", "--device-mem", "256MiB",
                        "--threads", "2"});
  INFO(run.err);
  INFO(run.out);
  CHECK(run.status == 0);
  CHECK(contains(run.out, "of_roofline"));
}

TEST_CASE("bench: decode tokens/s and time to first token beside the roofline, on the CPU backend too") {
  Run run = run_kvlite({"bench", model_fixtures::dir("tiny-qwen3"), "--backend", "cpu", "--batch", "1,3",
                        "--prompt-tokens", "12", "--decode-tokens", "5", "--device-mem", "256MiB", "--threads", "2"});
  INFO(run.err);
  INFO(run.out);
  REQUIRE(run.status == 0);
  std::istringstream out(run.out);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(out, line)) lines.push_back(line);
  auto line_starting = [&](const std::string& prefix) {
    for (const auto& l : lines)
      if (l.rfind(prefix, 0) == 0) return l;
    return std::string();
  };
  CHECK(contains(line_starting("kvlite bench: tiny-qwen3 on "), "cpu"));
  const std::string bandwidth = line_starting("copy bandwidth: ");
  REQUIRE_FALSE(bandwidth.empty());
  CHECK(contains(bandwidth, "GB/s"));
  CHECK(contains(bandwidth, "memcpy"));
  REQUIRE_FALSE(numbers_of(bandwidth).empty());
  CHECK(numbers_of(bandwidth)[0] > 0);
  CHECK(contains(line_starting("weights read per decode step: "), "KV per token: "));
  const std::string open_line = line_starting("open: ");
  REQUIRE_FALSE(open_line.empty());
  REQUIRE_FALSE(numbers_of(open_line).empty());
  CHECK(numbers_of(open_line)[0] > 0);  // Engine::open's wall time, in milliseconds
  CHECK(numbers_of(open_line)[0] < 60000);
  // The table: a header, then one row per batch size in the order given.
  size_t header = 0;
  while (header < lines.size() && !contains(lines[header], "ttft_ms")) header++;
  REQUIRE(header + 2 < lines.size());
  for (const char* column : {"batch", "prompt", "decode", "ttft_ms", "ttft_floor_ms", "decode_tok/s", "roofline_tok/s",
                             "of_roofline"})
    CHECK_MESSAGE(contains(lines[header], column), column);
  const int64_t batches[] = {1, 3};
  for (size_t i = 0; i < 2; i++) {
    const std::vector<double> row = numbers_of(lines[header + 1 + i]);
    CAPTURE(lines[header + 1 + i]);
    REQUIRE(row.size() == 8);
    CHECK(row[0] == double(batches[i]));
    CHECK(row[1] == 12);
    CHECK(row[2] == 5);
    for (size_t c = 3; c < 8; c++) CHECK(row[c] > 0);  // times, rates and the fraction of the roofline
  }
  CHECK(contains(run.out, "roofline: "));
}

TEST_CASE("bench and --backend: usage errors exit 2 naming the problem") {
  const std::string dir = model_fixtures::dir("tiny-qwen3");
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"bench", dir, "--batch", "0"}, "--batch 0 is outside"},
      {{"bench", dir, "--batch", "1,x"}, "--batch needs a whole number"},
      {{"bench", dir, "--decode-tokens", "1"}, "--decode-tokens 1 is outside"},
      {{"bench", dir, "--max-seqs", "2", "--batch", "1,4"}, "less than the largest --batch 4"},
      {{"bench", dir, "--backend", "tpu"}, "unknown backend 'tpu'"},
      {{"generate", dir, "--prompt", "x", "--backend", "cpu", "--activation-dtype", "f8"}, "unknown dtype 'f8'"},
  };
  for (const Case& c : cases) {
    Run run = run_kvlite(c.args);
    CAPTURE(c.needle);
    INFO(run.err);
    CHECK(run.status == 2);
    CHECK(contains(run.err, c.needle));
    CHECK(run.out.empty());
  }
  if (!kvlite::cuda::built_with_cuda() || kvlite::cuda::device_count() == 0) {
    Run run = run_kvlite({"generate", dir, "--prompt", "x", "--backend", "cuda"});
    INFO(run.err);
    CHECK(run.status == 2);
    CHECK(contains(run.err, kvlite::cuda::built_with_cuda() ? "no CUDA device" : "built without CUDA"));
  }
}

// ---- images: the tiny Qwen3-VL fixture (tests/fixtures/vl, references from transformers) ------------------

namespace {

const std::string kFixtures = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/";
const std::string kTinyVL = kFixtures + "vl/tiny-qwen3-vl";

std::string joined_ids(const std::vector<int32_t>& ids) {
  std::string text;
  for (int32_t id : ids) text += (text.empty() ? "" : ",") + std::to_string(id);
  return text;
}

// The processor's input_ids with each run of <|image_pad|> back to the one placeholder a prompt holds.
std::vector<int32_t> collapsed_ids(const nlohmann::json& prompt, int32_t pad) {
  std::vector<int32_t> ids;
  for (int32_t id : model_fixtures::ids_of(prompt["input_ids"]))
    if (id != pad || ids.empty() || ids.back() != pad) ids.push_back(id);
  return ids;
}

}  // namespace

TEST_CASE("logits --image writes transformers' logits of a prompt with an image, the image tokens inserted by the CLI") {
  const nlohmann::json reference = nlohmann::json::parse(model_fixtures::read_file(kFixtures + "vl/reference.json"));
  const int32_t pad = reference["image_token_id"].get<int32_t>();
  const auto& prompt = reference["prompts"][0];  // one image, after "<|im_start|>user\n"
  REQUIRE(prompt["images"].size() == 1);
  const std::string image = kFixtures + prompt["images"][0]["file"].get<std::string>();
  const std::vector<int32_t> ids = collapsed_ids(prompt, pad);  // ..., <|vision_start|>, <|image_pad|>, <|vision_end|>, ...
  const std::string dir = testing_safetensors::temp_dir("cli-logits-image");
  Run run = run_kvlite({"logits", kTinyVL, "--image", image, "--tokens", joined_ids(ids), "--out", dir + "/vl.npy",
                        "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(run.status == 0);
  CHECK_MESSAGE(run.err.empty(), run.err);
  model_fixtures::Npy written = model_fixtures::read_npy(dir + "/vl.npy");
  model_fixtures::Npy expected = model_fixtures::read_npy(kFixtures + "vl/" + prompt["logits_file"].get<std::string>());
  REQUIRE(written.rows == expected.rows);  // the expanded sequence: 6 image tokens for the one placeholder
  REQUIRE(written.cols == expected.cols);
  CHECK(model_fixtures::relative_max_diff(written.values, expected.values) <= 1e-4);
  CHECK(contains(run.out, "float32 [" + std::to_string(expected.rows) + ", " + std::to_string(expected.cols) + "]"));

  // Without an <|image_pad|> among the ids, the placeholder goes before them, as generate --image puts it.
  const std::vector<int32_t> text_ids = {9, 17, 33, 1200};
  Run before = run_kvlite({"logits", kTinyVL, "--image", image, "--tokens", joined_ids(text_ids), "--out",
                           dir + "/before.npy", "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(before.status == 0);
  kvlite::EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.device_mem = 64 * kvlite::MiB;
  auto engine = kvlite::Engine::open(kTinyVL, options);
  REQUIRE(engine);
  auto decoded = kvlite::load_image(image);
  REQUIRE(decoded);
  auto input = (*engine)->preprocess(*decoded);
  REQUIRE(input);
  std::vector<int32_t> placed = {reference["vision_start_token_id"].get<int32_t>(), pad,
                                 reference["vision_end_token_id"].get<int32_t>()};
  placed.insert(placed.end(), text_ids.begin(), text_ids.end());
  auto library = (*engine)->logits(placed, {*input});
  REQUIRE(library);
  model_fixtures::Npy cli = model_fixtures::read_npy(dir + "/before.npy");
  CHECK(cli.rows == 3 - 1 + 6 + int64_t(text_ids.size()));
  CHECK(cli.values == library->values);
}

TEST_CASE("logits and generate --image refuse bad images and requests with one message and exit 2") {
  const std::string dir = testing_safetensors::temp_dir("cli-bad-images");
  const std::string out = dir + "/out.npy";
  // Unsupported format (WebP), truncated PNG, empty file, a PNG header claiming 10000 x 10000.
  testing_safetensors::write_text(dir + "/cat.webp", std::string("RIFF\x24\0\0\0WEBPVP8 \0\0\0\0", 20));
  const std::string png = read_file(kFixtures + "images/photo_67x45.png");
  testing_safetensors::write_text(dir + "/cut.png", png.substr(0, png.size() / 2));
  testing_safetensors::write_text(dir + "/empty.png", "");
  std::string bomb = png.substr(0, 16);  // signature, IHDR length and type
  for (uint32_t side : {10000u, 10000u})
    for (int shift = 24; shift >= 0; shift -= 8) bomb += char((side >> shift) & 0xff);
  bomb += std::string("\x08\x02\0\0\0\0\0\0\0", 9);
  testing_safetensors::write_text(dir + "/bomb.png", bomb);
  struct Case {
    std::string image, needle;
  };
  for (const Case& c : {Case{"cat.webp", "WebP images are not supported"}, Case{"cut.png", "truncated"},
                        Case{"empty.png", "no image data (0 bytes)"}, Case{"bomb.png", "10000 x 10000"}}) {
    CAPTURE(c.image);
    for (const char* command : {"logits", "generate"}) {
      CAPTURE(command);
      Run run = std::string(command) == "logits"
                    ? run_kvlite({"logits", kTinyVL, "--image", dir + "/" + c.image, "--tokens", "9,17", "--out", out,
                                  "--backend", "cpu", "--device-mem", "64MiB"})
                    : run_kvlite({"generate", kTinyVL, "--image", dir + "/" + c.image, "--prompt", "Hi",
                                  "--backend", "cpu", "--device-mem", "64MiB"});
      CHECK(run.status == 2);
      CHECK(run.out.empty());
      CHECK_MESSAGE(contains(run.err, dir + "/" + c.image), run.err);
      CHECK_MESSAGE(contains(run.err, c.needle), run.err);
    }
  }
  const std::string image = kFixtures + "images/photo_67x45.png";
  // A text model takes no image, nor an image budget.
  Run text_model = run_kvlite({"logits", model_fixtures::dir("tiny-qwen3"), "--image", image, "--tokens", "9,17",
                               "--out", out, "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(text_model.status == 2);
  CHECK_MESSAGE(contains(text_model.err, "no vision tower"), text_model.err);
  Run budget = run_kvlite({"logits", model_fixtures::dir("tiny-qwen3"), "--tokens", "9,17", "--out", out,
                           "--backend", "cpu", "--device-mem", "64MiB", "--max-image-pixels", "8192"});
  CHECK(budget.status == 2);
  CHECK_MESSAGE(contains(budget.err, "max_image_pixels 8192 was given but"), budget.err);
  // Two <|image_pad|> for one --image: the library's message, with both numbers.
  Run two_pads = run_kvlite({"logits", kTinyVL, "--image", image, "--tokens", "1406,1409,1407,9,1406,1409,1407", "--out",
                             out, "--backend", "cpu", "--device-mem", "64MiB"});
  CHECK(two_pads.status == 2);
  CHECK_MESSAGE(contains(two_pads.err, "2 image placeholders"), two_pads.err);
  CHECK_MESSAGE(contains(two_pads.err, "1 image was given"), two_pads.err);
}

TEST_CASE("plan --max-image-pixels: image tokens per image as transformers' processor makes them, vision weights from the headers") {
  // Derived from the fixture's files, not from the planner: patch and merge sizes from config.json, the
  // vision tensors' bytes from the safetensors header.
  const nlohmann::json config = nlohmann::json::parse(model_fixtures::read_file(kTinyVL + "/config.json"));
  const int64_t side = config["vision_config"]["patch_size"].get<int64_t>() *
                       config["vision_config"]["spatial_merge_size"].get<int64_t>();
  const std::string safetensors = model_fixtures::read_file(kTinyVL + "/model.safetensors");
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; i--) header_length = header_length << 8 | uint8_t(safetensors[size_t(i)]);
  const nlohmann::json header = nlohmann::json::parse(safetensors.substr(8, header_length));
  uint64_t vision_bytes = 0;
  for (const auto& tensor : header.items())
    if (tensor.key().rfind("model.visual.", 0) == 0)
      vision_bytes += tensor.value()["data_offsets"][1].get<uint64_t>() - tensor.value()["data_offsets"][0].get<uint64_t>();
  REQUIRE(vision_bytes > 0);
  // The processor with max_pixels 8192 turned the recorded images into 6, 8 and 8 tokens: 8 is the most.
  const nlohmann::json reference = nlohmann::json::parse(model_fixtures::read_file(kFixtures + "vl/reference.json"));
  REQUIRE(reference["max_pixels"].get<int64_t>() == 8192);
  int64_t most_tokens = 0;
  for (const auto& prompt : reference["prompts"])
    for (const auto& image : prompt["images"]) most_tokens = std::max(most_tokens, image["image_tokens"].get<int64_t>());

  Run run = run_kvlite({"plan", kTinyVL, "--device-mem", "2GiB", "--max-image-pixels", "8192", "--max-images", "2", "--json"});
  REQUIRE(run.status <= 1);
  auto j = nlohmann::json::parse(run.out);
  const auto& image_budget = j["image_budget"];
  CHECK(image_budget["tokens_per_image"].get<int64_t>() == 8192 / (side * side));
  CHECK(image_budget["tokens_per_image"].get<int64_t>() == most_tokens);
  CHECK(image_budget["patches_per_image"].get<int64_t>() == 8192 / (side * side) * 4);
  CHECK(image_budget["max_images"].get<int64_t>() == 2);
  CHECK(image_budget["vision_weights_bytes"].get<uint64_t>() == vision_bytes);
  uint64_t vision_row = 0;
  for (const auto& item : j["items"])
    if (item["key"] == "vision") vision_row = item["bytes"].get<uint64_t>();
  CHECK(vision_row > 0);
  CHECK(image_budget["encoder_activation_bytes"].get<uint64_t>() == vision_row);

  Run table = run_kvlite({"plan", kTinyVL, "--device-mem", "2GiB", "--max-image-pixels", "8192"});
  REQUIRE(table.status <= 1);
  CHECK_MESSAGE(contains(table.out, "floor(8,192 pixels / 1,024 per token (patch x merge)^2) = 8 merged tokens from 32 patches"),
                table.out);
  CHECK(contains(table.out, "vision weights " + kvlite::format_bytes(vision_bytes) + " (in the weights row)"));
  CHECK(contains(table.out, "the vision tower " + kvlite::format_bytes(vision_bytes) + " of it"));
}

TEST_CASE("plan on the published configs of Mistral, Gemma 2 / 3 and Phi-3 families prints a plan (issue 39)") {
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/configs/families/";
  for (const char* model : {"mistral-7b-instruct-v0.3", "ministral-8b-instruct-2410", "gemma-2-2b", "gemma-3-1b-it",
                            "phi-3.5-mini-instruct", "phi-4-mini-instruct"}) {
    CAPTURE(std::string(model));
    Run run = run_kvlite({"plan", dir + model, "--device-mem", "8GiB", "--no-wsl2", "--max-model-len", "4096"});
    CHECK(run.status <= 1);  // 0 fits, 1 does not (Mistral-7B / Ministral-8B in bf16 need more than 8 GiB)
    CHECK(contains(run.out, "weights (estimated from config.json"));
    CHECK(run.err.empty());
  }
}

TEST_CASE("generate --json-schema gives the captioner's structured caption as JSON of the schema, --grammar a sentence of the grammar") {
  const std::string root = std::string(KVLITE_SOURCE_DIR);
  const std::string schema_path = root + "/examples/schemas/shapes.json";
  std::ifstream schema_file(schema_path);
  const nlohmann::json schema = nlohmann::json::parse(schema_file);
  const auto& item = schema["properties"]["shapes"]["items"]["properties"];
  for (const char* scene : {"scene_1.png", "scene_4.png"}) {
    CAPTURE(scene);
    Run run = run_kvlite({"generate", root + "/models/kvlite-captioner-bf16", "--image", root + "/examples/images/" + scene,
                          "--chat", "--prompt", "Describe this image.", "--json-schema", schema_path, "--backend", "cpu",
                          "--device-mem", "256MiB"});
    REQUIRE_MESSAGE(run.status == 0, run.err);
    CHECK_MESSAGE(contains(run.err, "(grammar_end)"), run.err);
    const nlohmann::json caption = nlohmann::json::parse(run.out);  // throws (fails) if not JSON
    REQUIRE(caption.size() == 1);
    const auto& shapes = caption.at("shapes");
    CHECK(shapes.size() >= 1);
    CHECK(shapes.size() <= 3);
    for (const auto& shape : shapes) {
      CHECK(shape.size() == 3);
      for (const char* key : {"size", "color", "shape"}) {
        const auto& allowed = item[key]["enum"];
        CHECK_MESSAGE(std::find(allowed.begin(), allowed.end(), shape.at(key)) != allowed.end(), shape.dump());
      }
    }
  }
  const std::string grammar_path = std::string(KVLITE_BINARY_DIR) + "/cli-test.gbnf";
  std::ofstream(grammar_path) << "root ::= (\"left\" | \"right\" | \"stop\") \" \" [1-9] [0-9]? \" cm\"\n";
  Run sentence = run_kvlite({"generate", model_fixtures::dir("tiny-qwen3"), "--prompt", "go", "--grammar", grammar_path,
                             "--backend", "cpu", "--device-mem", "64MiB"});
  REQUIRE_MESSAGE(sentence.status == 0, sentence.err);
  CHECK_MESSAGE(std::regex_match(sentence.out, std::regex("(left|right|stop) [1-9][0-9]? cm\n?")), sentence.out);
  // a schema or grammar kvlite cannot honour exits 2 naming why, before the model loads
  const std::string bad_path = std::string(KVLITE_BINARY_DIR) + "/cli-test-bad.json";
  std::ofstream(bad_path) << R"({"type": "array", "uniqueItems": true})";
  Run bad = run_kvlite({"generate", model_fixtures::dir("tiny-qwen3"), "--prompt", "go", "--json-schema", bad_path});
  CHECK(bad.status == 2);
  CHECK_MESSAGE(contains(bad.err, "uniqueItems"), bad.err);
  Run both = run_kvlite({"generate", model_fixtures::dir("tiny-qwen3"), "--prompt", "go", "--json-schema", bad_path,
                         "--grammar", grammar_path});
  CHECK(both.status == 2);
  Run missing = run_kvlite({"generate", model_fixtures::dir("tiny-qwen3"), "--prompt", "go", "--grammar", "/nonexistent.gbnf"});
  CHECK(missing.status == 2);
  CHECK_MESSAGE(contains(missing.err, "cannot read"), missing.err);
}
