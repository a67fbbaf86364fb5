// kvlite: the command-line tool. Uses the public API only.
//
//   kvlite plan MODEL_DIR [options]   where every byte of device memory goes, before anything is loaded
//   kvlite generate MODEL_DIR --prompt TEXT [--chat] [...]   text, streamed to stdout
//   kvlite score MODEL_DIR --text-file F --context-length N --stride S   sliding-window perplexity
//   kvlite tokenize MODEL_DIR --text TEXT                  token ids as a JSON array
//   kvlite logits MODEL_DIR --tokens 1,2,3 [--image PATH] --out FILE.npy  float32 [n_tokens, vocab] logits
//   kvlite bench MODEL_DIR [--batch 1,8] [--prompt-tokens N] [--decode-tokens N]   speed against the roofline
//   kvlite --help | --version | help COMMAND
//
// Exit status: 0 success (for `plan`: it fits), 1 the plan or a request does not fit (`plan` still prints the
// table and advice), 2 a usage or input error (one message on stderr; never a crash).
//
// Layout: a small argument parser (Args) with typed getters that throw UsageError; a table of commands, each
// with its options and a run function. More commands (generate, score, tokenize, logits, bench) are one more
// row in commands() and one more run_* function.
#include "kvlite.hpp"
#if defined(KVLITE_HAVE_SERVER)
#include "server/openai_server.hpp"
#endif
#include <csignal>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kExitOk = 0, kExitDoesNotFit = 1, kExitUsage = 2;

// The command line is wrong (unknown option, missing value, "8GB?"): exit 2 with a hint to --help.
struct UsageError {
  std::string message;
};
// The command line is fine but its input is not (no config.json, malformed weights, an option the model
// refuses): exit 2 with the library's message.
struct InputError {
  std::string message;
};

struct OptionSpec {
  std::string name;        // "--max-model-len"
  std::string value_name;  // "N"; empty for a flag
  std::string help;
};

// Levenshtein distance, for "did you mean" on unknown options and commands.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 4;  // suggest only near misses
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_distance) best_distance = d, best = c;
  }
  return best;
}

// Parsed arguments of one command: `--name value`, `--name=value`, flags, positionals; `--` ends options.
class Args {
 public:
  Args(const std::vector<OptionSpec>& specs, const std::vector<std::string>& argv) : specs_(specs) {
    bool options_done = false;
    for (size_t i = 0; i < argv.size(); i++) {
      const std::string& arg = argv[i];
      if (options_done || arg.size() < 2 || arg[0] != '-') {
        positionals_.push_back(arg);
        continue;
      }
      if (arg == "--") {
        options_done = true;
        continue;
      }
      if (arg == "-h" || arg == "--help") {
        help_ = true;
        continue;
      }
      std::string name = arg, value;
      bool inline_value = false;
      size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
        inline_value = true;
      }
      const OptionSpec* spec = find(name);
      if (!spec) {
        std::vector<std::string> names;
        for (const auto& s : specs_) names.push_back(s.name);
        std::string near = closest(name, names);
        throw UsageError{"unknown option '" + name + "'" + (near.empty() ? "" : "; did you mean " + near + "?")};
      }
      if (values_.count(name)) throw UsageError{"option " + name + " is given twice"};
      if (spec->value_name.empty()) {
        if (inline_value) throw UsageError{"option " + name + " takes no value (got '" + value + "')"};
      } else if (!inline_value) {
        if (i + 1 >= argv.size()) throw UsageError{"option " + name + " needs a value: " + name + " " + spec->value_name};
        value = argv[++i];
      }
      values_[name] = value;
    }
  }

  bool help() const { return help_; }
  const std::vector<std::string>& positionals() const { return positionals_; }
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  const std::string& text(const std::string& name) const { return values_.at(name); }

  // A whole-string integer in [min, max].
  int64_t integer(const std::string& name, int64_t min, int64_t max) const {
    return parse_integer(name, text(name), min, max);
  }
  static int64_t parse_integer(const std::string& name, const std::string& value, int64_t min, int64_t max) {
    errno = 0;
    char* end = nullptr;
    long long parsed = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno == ERANGE)
      throw UsageError{name + " needs a whole number, got '" + value + "'"};
    if (parsed < min || parsed > max)
      throw UsageError{name + " " + value + " is outside " + std::to_string(min) + ".." + std::to_string(max)};
    return parsed;
  }
  // A whole-string finite number (range checks are the library's, which name the value).
  double number(const std::string& name) const { return parse_number(name, text(name)); }
  static double parse_number(const std::string& name, const std::string& value) {
    char* end = nullptr;
    double parsed = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(parsed))
      throw UsageError{name + " needs a number, got '" + value + "'"};
    return parsed;
  }
  // A byte size: "8GiB", "7.5G", "512MiB", "8e9".
  uint64_t size(const std::string& name) const { return parse_byte_size(name, text(name)); }
  static uint64_t parse_byte_size(const std::string& name, const std::string& value) {
    auto parsed = kvlite::parse_size(value);
    if (!parsed) throw UsageError{name + ": " + parsed.error().message};
    return *parsed;
  }

 private:
  const OptionSpec* find(const std::string& name) const {
    for (const auto& s : specs_)
      if (s.name == name) return &s;
    return nullptr;
  }
  std::vector<OptionSpec> specs_;
  std::vector<std::string> positionals_;
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

struct Command {
  std::string name;
  std::string brief;     // one line for `kvlite --help`
  std::string summary;   // the paragraph opening `kvlite NAME --help`
  std::string usage;     // "kvlite plan MODEL_DIR [options]"
  std::string details;   // paragraphs after the options
  std::vector<OptionSpec> options;
  std::function<int(const Args&)> run;
};

std::string command_help(const Command& c) {
  std::string out = "usage: " + c.usage + "\n\n" + c.summary + "\n\noptions:\n";
  size_t width = 0;
  for (const auto& o : c.options) width = std::max(width, o.name.size() + 1 + o.value_name.size());
  for (const auto& o : c.options) {
    std::string left = o.name + (o.value_name.empty() ? "" : " " + o.value_name);
    out += "  " + left + std::string(width - left.size() + 2, ' ') + o.help + "\n";
  }
  out += "  -h, --help" + std::string(width > 8 ? width - 8 : 2, ' ') + "this text\n";
  if (!c.details.empty()) out += "\n" + c.details;
  return out;
}

// ---- kvlite plan ------------------------------------------------------------------------------------------

kvlite::EngineOptions engine_options(const Args& args);  // the engine commands' options (below)

// One --sweep key: its CSV column and how it sets the options.
struct SweepKey {
  std::string key;     // as written after --sweep: "max-model-len"
  std::string column;  // CSV column: "max_model_len"
  std::function<void(kvlite::PlanOptions&, const std::string&)> apply;
};

std::vector<SweepKey> sweep_keys() {
  return {
      {"max-model-len", "max_model_len",
       [](kvlite::PlanOptions& o, const std::string& v) {
         o.max_model_len = Args::parse_integer("--sweep max-model-len", v, 1, INT64_MAX);
       }},
      {"utilization", "utilization",
       [](kvlite::PlanOptions& o, const std::string& v) { o.utilization = Args::parse_number("--sweep utilization", v); }},
      {"device-mem", "device_mem",
       [](kvlite::PlanOptions& o, const std::string& v) { o.device_mem = Args::parse_byte_size("--sweep device-mem", v); }},
      {"max-image-pixels", "max_image_pixels",
       [](kvlite::PlanOptions& o, const std::string& v) {
         o.max_image_pixels = Args::parse_integer("--sweep max-image-pixels", v, 1, INT64_MAX);
       }},
  };
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

std::string fixed3(double value) {
  char text[64];
  snprintf(text, sizeof text, "%.3f", value);
  return text;
}

kvlite::Plan plan_or_throw(const kvlite::PlanInputs& inputs, const kvlite::EngineOptions& options) {
  auto plan = kvlite::plan_engine(inputs, options);
  if (!plan) throw InputError{plan.error().message};
  return std::move(*plan);
}

// A parsed --sweep KEY=V1,V2,...: every value is checked before the model is read.
struct Sweep {
  SweepKey key;
  std::vector<std::string> values;
};

Sweep parse_sweep(const std::string& spec) {
  size_t eq = spec.find('=');
  std::string name = eq == std::string::npos ? spec : spec.substr(0, eq);
  std::string all;
  for (const auto& k : sweep_keys()) {
    all += (all.empty() ? "" : ", ") + k.key;
    if (k.key != name) continue;
    if (eq == std::string::npos || eq + 1 == spec.size())
      throw UsageError{"--sweep " + name + " needs values: --sweep " + name + "=V1,V2,..."};
    Sweep sweep{k, split(spec.substr(eq + 1), ',')};
    kvlite::PlanOptions scratch;
    for (const auto& value : sweep.values) k.apply(scratch, value);  // throws UsageError naming a bad value
    return sweep;
  }
  throw UsageError{"--sweep: unknown key '" + name + "' (keys: " + all + "); write e.g. --sweep max-model-len=512,1024,2048"};
}

// CSV, one row per value: what one sequence of max_model_len needs (total_bytes = fixed items + its KV,
// kv_bytes = its KV in whole pages), how many such sequences the planned arena holds, and whether one fits.
int run_sweep(const kvlite::PlanInputs& inputs, const kvlite::EngineOptions& base, const Sweep& sweep) {
  bool by_length = sweep.key.key == "max-model-len";
  std::string csv = sweep.key.column + (by_length ? "" : ",max_model_len") + ",total_bytes,kv_bytes,concurrency,fits\n";
  for (const auto& value : sweep.values) {
    kvlite::EngineOptions options = base;
    sweep.key.apply(options.plan, value);
    kvlite::Plan plan = plan_or_throw(inputs, options);
    uint64_t kv_bytes = (uint64_t(plan.max_model_len) + plan.kv_page_tokens - 1) / plan.kv_page_tokens * plan.kv_page_bytes;
    csv += value + (by_length ? "" : "," + std::to_string(plan.max_model_len)) + "," +
           std::to_string(plan.fixed_bytes + kv_bytes) + "," + std::to_string(kv_bytes) + "," +
           fixed3(plan.concurrency) + "," + (plan.fits ? "true" : "false") + "\n";
  }
  fputs(csv.c_str(), stdout);  // only once every value planned: no half CSV before an error
  return kExitOk;
}

int run_plan(const Args& args) {
  if (args.positionals().size() != 1)
    throw UsageError{args.positionals().empty() ? "MODEL_DIR is missing"
                                                : "expected one MODEL_DIR, got " + std::to_string(args.positionals().size()) +
                                                      " arguments ('" + args.positionals()[1] + "' is extra)"};
  const std::string& model_dir = args.positionals()[0];
  // The engine commands' options, parsed by the same code: the plan printed is the plan Engine::open makes.
  const kvlite::EngineOptions options = engine_options(args);
  std::optional<Sweep> sweep;
  if (args.has("--sweep")) {
    if (args.has("--json") || args.has("--svg")) throw UsageError{"--sweep prints CSV only: drop --json / --svg"};
    sweep = parse_sweep(args.text("--sweep"));
  }

  auto inputs = kvlite::read_plan_inputs(model_dir);
  if (!inputs) throw InputError{inputs.error().message};
  if (sweep) return run_sweep(*inputs, options, *sweep);

  kvlite::Plan plan = plan_or_throw(*inputs, options);
  if (args.has("--svg")) {
    const std::string& path = args.text("--svg");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    std::string svg = plan.svg();
    out.write(svg.data(), std::streamsize(svg.size()));
    if (!out) throw InputError{"cannot write the SVG to " + path};
  }
  fputs(args.has("--json") ? plan.json().c_str() : plan.table().c_str(), stdout);
  return plan.fits ? kExitOk : kExitDoesNotFit;
}

// ---- kvlite generate / score / tokenize / logits ------------------------------------------------------------

// Options of every command that opens an engine.
std::vector<OptionSpec> engine_option_specs() {
  return {
      {"--backend", "B", "auto (default: the GPU when kvlite has CUDA, one is present and the CUDA engine runs the "
                         "model) | cpu (the float32 reference) | cuda"},
      {"--device", "N", "CUDA device index; default 0"},
      {"--device-mem", "SIZE", "memory the plan divides (8GiB, 7.5G, 512MiB): on a GPU the card to behave as (with "
                               "--backend cuda and no GPU here: plan, not run, such a card); default: the device's "
                               "(CPU: this machine's memory)"},
      {"--utilization", "R", "fraction of that memory kvlite may use, (0, 1]; default 0.90"},
      {"--max-model-len", "N", "longest sequence (prompt + output); default: min(model max, 32768), halved while "
                               "over 2048 until it fits"},
      {"--max-seqs", "N", "sequences decoded together; default 8"},
      {"--max-batched-tokens", "N", "tokens in one forward step; default min(2048, max_model_len)"},
      {"--kv-dtype", "T", "auto | f32 | bf16 | f16 | fp8 (e4m3, half of bf16's bytes); default auto (the activation "
                          "dtype)"},
      {"--kv-page-tokens", "N", "tokens per KV page, 1..1024; default 16"},
      {"--kv-fill", "", "fill the whole budget with KV pages (vLLM's way); default: only the pages max-seqs "
                        "sequences of max-model-len can use, leaving the rest free"},
      {"--host-embeddings", "", "keep an untied token-embedding table in host memory (the mmap) instead of the "
                                "device: each step looks up its rows on the host and copies them in (CUDA; saves "
                                "the table's bytes, Qwen2.5-7B 1.02 GiB; the CPU changes nothing)"},
      {"--max-image-pixels", "N", "vision models: image budget in pixels (larger images are scaled down to fit); "
                                  "default min(processor max, 1048576)"},
      {"--max-images", "N", "vision models: images one request may carry (encoded in one step); default 1"},
      {"--wsl2", "", "plan as under WSL2 (larger driver reservation); default: detected"},
      {"--no-wsl2", "", "plan as on native Linux"},
      {"--activation-dtype", "T", "bf16 | f16 | f32; default: CUDA the model's 16-bit dtype, the CPU f32 (its bf16 / "
                                  "f16 round where the GPU does)"},
      {"--no-cuda-graphs", "", "CUDA: run decode steps op by op instead of replaying CUDA graphs"},
      {"--no-programmatic-launch", "", "CUDA: launch each kernel only once the one before it has finished; default "
                                       "on sm_90+: each may start while the one before it finishes (programmatic "
                                       "dependent launch; the same results)"},
      {"--prefix-cache", "on|off", "reuse the KV pages of earlier requests' identical prefixes; default on for the CPU, "
                                   "off on CUDA (kvlite bench: off)"},
      {"--threads", "N", "CPU threads; default one per hardware thread"},
      {"--cpu-kernels", "K", "fast | fast-lowp | reference: the CPU's Linears as the SIMD kernels (default; BF16/F16/"
                             "F32, int4, int8 and fp8 weights, F32 activations; AVX-512, AVX2 or plain C++ as the "
                             "CPU allows), the same with llama.cpp's numerics (BF16 Linears on bf16-rounded "
                             "inputs, int4/int8 ones on inputs quantized to int8 per 32 columns: VNNI / bf16 dot "
                             "products, within ~1% of the reference) or the reference loops"},
      {"--cpu-lm-head", "H", "stored | int8: the CPU's lm_head as the checkpoint stores it (default) or an int8 copy "
                             "made at load (F32 scales per row and 128 columns, as llama-quantize does to the output "
                             "matrix): half a BF16 lm_head's bytes a decode step, at ~0.6% weight error"},
      {"--fp8-activations", "", "fp8 checkpoints: quantize activations to fp8 per token as the GPU does (W8A8)"},
      {"--ngram", "N", "speculative decoding by prompt lookup: draft from the latest earlier occurrence of the last "
                       "N (or fewer) tokens, 1..32; alone, --spec-tokens 4"},
      {"--spec-tokens", "K", "speculative decoding: tokens drafted per sequence per step and verified in one "
                             "forward pass, 1..32; alone, --ngram 3. Greedy output is unchanged; sampling keeps its "
                             "distribution"},
      {"--draft", "DIR", "speculative decoding with a draft model: a smaller model with the same tokenizer drafts "
                         "--spec-tokens K (default 4) tokens per step (CPU backend); planned with the model"},
  };
}

std::vector<OptionSpec> with_engine_options(std::vector<OptionSpec> specs) {
  for (auto& spec : engine_option_specs()) specs.push_back(spec);
  return specs;
}

kvlite::EngineOptions engine_options(const Args& args) {
  kvlite::EngineOptions options;
  options.backend = kvlite::BackendChoice::auto_;
  if (args.has("--backend")) {
    auto backend = kvlite::parse_backend_choice(args.text("--backend"));
    if (!backend) throw UsageError{"--backend: " + backend.error().message};
    options.backend = *backend;
  }
  if (args.has("--activation-dtype")) {
    const std::string& text = args.text("--activation-dtype");
    if (text == "bf16" || text == "bfloat16") options.plan.activation_dtype = kvlite::DType::BF16;
    else if (text == "f16" || text == "fp16" || text == "float16") options.plan.activation_dtype = kvlite::DType::F16;
    else if (text == "f32" || text == "fp32" || text == "float32") options.plan.activation_dtype = kvlite::DType::F32;
    else throw UsageError{"--activation-dtype: unknown dtype '" + text + "': use bf16, f16 or f32"};
  }
  options.cuda_graphs = !args.has("--no-cuda-graphs");
  options.cuda_programmatic_launch = !args.has("--no-programmatic-launch");
  if (args.has("--prefix-cache")) {
    const std::string& text = args.text("--prefix-cache");
    if (text != "on" && text != "off") throw UsageError{"--prefix-cache: '" + text + "': use on or off"};
    options.prefix_caching = text == "on";
  }
  if (args.has("--device-mem")) options.plan.device_mem = args.size("--device-mem");
  if (args.has("--utilization")) options.plan.utilization = args.number("--utilization");
  if (args.has("--max-model-len")) options.plan.max_model_len = args.integer("--max-model-len", 1, INT64_MAX);
  if (args.has("--max-seqs")) options.plan.max_seqs = args.integer("--max-seqs", 1, INT64_MAX);
  if (args.has("--max-batched-tokens"))
    options.plan.max_batched_tokens = args.integer("--max-batched-tokens", 1, INT64_MAX);
  if (args.has("--kv-dtype")) {
    auto dtype = kvlite::parse_kv_dtype(args.text("--kv-dtype"));
    if (!dtype) throw UsageError{"--kv-dtype: " + dtype.error().message};
    options.plan.kv_dtype = *dtype;
  }
  if (args.has("--max-image-pixels"))
    options.plan.max_image_pixels = args.integer("--max-image-pixels", 1, INT64_MAX);
  if (args.has("--kv-page-tokens")) options.plan.kv_page_tokens = args.integer("--kv-page-tokens", 1, INT64_MAX);
  if (args.has("--max-images")) options.plan.max_images = args.integer("--max-images", 1, INT64_MAX);
  options.plan.kv_fill = args.has("--kv-fill");
  options.plan.host_embeddings = args.has("--host-embeddings");
  if (args.has("--wsl2") && args.has("--no-wsl2")) throw UsageError{"--wsl2 and --no-wsl2 contradict each other"};
  if (args.has("--wsl2")) options.plan.wsl2 = true;
  if (args.has("--no-wsl2")) options.plan.wsl2 = false;
  if (args.has("--device")) options.device = int(args.integer("--device", 0, 1023));
  if (args.has("--threads")) options.threads = int(args.integer("--threads", 1, 4096));
  if (args.has("--cpu-kernels")) {
    const std::string& text = args.text("--cpu-kernels");
    if (text == "reference") options.cpu_kernels = kvlite::CpuKernels::reference;
    else if (text == "fast") options.cpu_kernels = kvlite::CpuKernels::fast;
    else if (text == "fast-lowp") options.cpu_kernels = kvlite::CpuKernels::fast_lowp;
    else throw UsageError{"--cpu-kernels: '" + text + "': use reference, fast or fast-lowp"};
  }
  if (args.has("--cpu-lm-head")) {
    const std::string& text = args.text("--cpu-lm-head");
    if (text == "stored") options.cpu_lm_head = kvlite::CpuLmHead::stored;
    else if (text == "int8") options.cpu_lm_head = kvlite::CpuLmHead::int8;
    else throw UsageError{"--cpu-lm-head: '" + text + "': use stored or int8"};
  }
  options.fp8_activations = args.has("--fp8-activations");
  if (args.has("--draft")) {
    options.draft_model = args.text("--draft");
    if (args.has("--ngram")) throw UsageError{"--draft and --ngram are two ways to draft: choose one"};
    options.plan.speculative_tokens =
        args.has("--spec-tokens") ? args.integer("--spec-tokens", 1, kvlite::kMaxSpeculativeTokens) : 4;
  } else if (args.has("--ngram") || args.has("--spec-tokens")) {
    options.plan.ngram = args.has("--ngram") ? args.integer("--ngram", 1, kvlite::kMaxNgram) : 3;
    options.plan.speculative_tokens =
        args.has("--spec-tokens") ? args.integer("--spec-tokens", 1, kvlite::kMaxSpeculativeTokens) : 4;
  }
  return options;
}

// The one positional argument of the engine commands.
const std::string& model_dir_argument(const Args& args) {
  if (args.positionals().size() != 1)
    throw UsageError{args.positionals().empty() ? "MODEL_DIR is missing"
                                                : "expected one MODEL_DIR, got " + std::to_string(args.positionals().size()) +
                                                      " arguments ('" + args.positionals()[1] + "' is extra)"};
  return args.positionals()[0];
}

const std::string& required(const Args& args, const std::string& name) {
  if (!args.has(name)) throw UsageError{name + " is required"};
  return args.text(name);
}

// A library error as the exit status says: 1 when it does not fit, 2 otherwise.
struct DoesNotFit {
  std::string message;
};
[[noreturn]] void library_error(const kvlite::Error& error) {
  if (error.code == kvlite::ErrorCode::does_not_fit) throw DoesNotFit{error.message};
  throw InputError{error.message};
}

std::unique_ptr<kvlite::Engine> open_engine(const std::string& model_dir, const kvlite::EngineOptions& options) {
  auto engine = kvlite::Engine::open(model_dir, options);
  if (!engine) library_error(engine.error());
  return std::move(*engine);
}

int run_generate(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  const std::string& prompt = required(args, "--prompt");
  kvlite::SamplingParams params;
  if (args.has("--max-tokens")) params.max_tokens = args.integer("--max-tokens", 1, kvlite::limits::max_new_tokens);
  if (args.has("--temperature")) params.temperature = float(args.number("--temperature"));
  if (args.has("--top-p")) params.top_p = float(args.number("--top-p"));
  if (args.has("--top-k")) params.top_k = args.integer("--top-k", 0, INT64_MAX);
  if (args.has("--min-p")) params.min_p = float(args.number("--min-p"));
  if (args.has("--repetition-penalty")) params.repetition_penalty = float(args.number("--repetition-penalty"));
  if (args.has("--seed")) params.seed = uint64_t(args.integer("--seed", 0, INT64_MAX));
  if (args.has("--stop")) params.stop_strings = {args.text("--stop")};
  params.logprobs = args.has("--logprobs");
  if (args.has("--system") && !args.has("--chat")) throw UsageError{"--system needs --chat"};
  // --json-schema / --grammar: read (bounded) and compiled before the model loads, so a bad one costs no load
  auto read_bounded = [](const std::string& flag, const std::string& path, int64_t limit) {
    std::ifstream file(path, std::ios::binary);
    if (!file) throw InputError{"cannot read " + path + " (" + flag + ")"};
    std::string text(size_t(limit) + 1, '\0');
    file.read(&text[0], std::streamsize(text.size()));
    text.resize(size_t(file.gcount()));
    if (int64_t(text.size()) > limit)
      throw InputError{flag + " " + path + " is larger than " + std::to_string(limit) + " bytes"};
    return text;
  };
  if (args.has("--json-schema") && args.has("--grammar")) throw UsageError{"--json-schema and --grammar: give one"};
  if (args.has("--json-schema")) {
    params.json_schema = read_bounded("--json-schema", args.text("--json-schema"), kvlite::limits::max_schema_bytes);
    auto gbnf = kvlite::Grammar::json_schema_to_gbnf(params.json_schema);
    if (!gbnf) throw InputError{args.text("--json-schema") + ": " + gbnf.error().message};
    auto grammar = kvlite::Grammar::parse(*gbnf);
    if (!grammar) throw InputError{args.text("--json-schema") + ": " + grammar.error().message};
  }
  if (args.has("--grammar")) {
    params.grammar = read_bounded("--grammar", args.text("--grammar"), kvlite::limits::max_grammar_bytes);
    auto grammar = kvlite::Grammar::parse(params.grammar);
    if (!grammar) throw InputError{args.text("--grammar") + ": " + grammar.error().message};
  }
  auto checked = kvlite::validate(params);
  if (!checked) throw UsageError{checked.error().message};
  // --image: the image's placeholder goes before the prompt (vision models).
  std::vector<kvlite::Image> images;
  if (args.has("--image")) {
    auto image = kvlite::load_image(args.text("--image"));
    if (!image) throw InputError{image.error().message};
    images.push_back(std::move(*image));
  }
  const std::string text = images.empty() ? prompt : std::string(kvlite::kImagePlaceholder) + prompt;

  auto engine = open_engine(model_dir, engine_options(args));
  auto print = [](const std::string& piece, int32_t) {
    fputs(piece.c_str(), stdout);
    fflush(stdout);
    return true;
  };
  const auto start = std::chrono::steady_clock::now();
  kvlite::Result<kvlite::Generation> generation = kvlite::Error();
  if (args.has("--chat")) {
    std::vector<kvlite::ChatMessage> messages;
    if (args.has("--system")) messages.push_back({"system", args.text("--system")});
    messages.push_back({"user", text});
    generation = engine->generate_chat(messages, images, params, print);
  } else {
    generation = engine->generate(text, images, params, print);
  }
  if (!generation) library_error(generation.error());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fputs("\n", stdout);
  if (params.logprobs)  // one line per generated token: its id, log-probability and bytes (C-escaped)
    for (size_t i = 0; i < generation->ids.size() && i < generation->logprobs.size(); i++) {
      std::string shown;
      for (unsigned char c : engine->tokenizer().token_bytes(generation->ids[i])) {
        if (c == '\\' || c == '"') shown += '\\';
        shown += c >= 0x20 && c < 0x7f ? std::string(1, char(c)) : kvlite::detail::format("\\x%02x", c);
      }
      fprintf(stderr, "kvlite generate: token %zu id %d logprob %.6f \"%s\"\n", i, generation->ids[i],
              double(generation->logprobs[i]), shown.c_str());
    }
  fprintf(stderr, "kvlite generate: %zu prompt + %zu generated tokens in %.2f s (%s)\n",
          generation->prompt_ids.size(), generation->ids.size(), seconds,
          kvlite::finish_reason_name(generation->finish_reason));
  const kvlite::EngineStats stats = engine->stats();
  if (stats.draft_tokens > 0 || engine->plan().options.speculative_tokens > 0)
    fprintf(stderr,
            "kvlite generate: speculative: %lld drafted, %lld accepted (%.1f%%); %lld forward passes for %zu tokens "
            "(%.2f per token)%s\n",
            (long long)stats.draft_tokens, (long long)stats.draft_tokens_accepted,
            stats.draft_tokens > 0 ? 100.0 * double(stats.draft_tokens_accepted) / double(stats.draft_tokens) : 0.0,
            (long long)stats.steps, generation->ids.size(),
            generation->ids.empty() ? 0.0 : double(stats.steps) / double(generation->ids.size()),
            stats.draft_steps > 0 ? kvlite::detail::format("; the draft model: %lld passes over %lld tokens",
                                                   (long long)stats.draft_steps,
                                                   (long long)stats.draft_tokens_computed).c_str()
                                  : "");
  return kExitOk;
}

int run_score(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  const std::string& path = required(args, "--text-file");
  const int64_t context = Args::parse_integer("--context-length", required(args, "--context-length"), 2, INT64_MAX);
  const int64_t stride = Args::parse_integer("--stride", required(args, "--stride"), 1, INT64_MAX);
  if (stride > context) throw UsageError{"--stride must not exceed --context-length"};
  std::ifstream file(path, std::ios::binary);
  if (!file) throw InputError{"cannot read " + path};
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());

  kvlite::EngineOptions options = engine_options(args);
  // Each window is its own sequence: the KV arena is sized for one window, not the model's maximum.
  if (!args.has("--max-model-len")) options.plan.max_model_len = context;
  auto engine = open_engine(model_dir, options);
  const bool show_progress = isatty(fileno(stderr));
  auto progress = [&](int64_t done, int64_t total) {
    if (show_progress) fprintf(stderr, "\rscoring: window %lld of %lld", (long long)done, (long long)total);
  };
  auto scored = engine->score(text, context, stride, progress);
  if (show_progress) fputs("\n", stderr);
  if (!scored) library_error(scored.error());
  printf("perplexity: %.6f\n", scored->perplexity);
  printf("tokens: %lld scored (windows: %lld of %lld tokens, stride %lld)\n", (long long)scored->tokens,
         (long long)scored->windows, (long long)context, (long long)stride);
  printf("mean nll: %.6f\n", scored->nll_sum / double(scored->tokens));
  printf("guide perplexity: %.6f (transformers' guide weighting)\n", scored->guide_perplexity);
  return kExitOk;
}

int run_tokenize(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  const std::string& text = required(args, "--text");
  auto tokenizer = kvlite::Tokenizer::load(model_dir);
  if (!tokenizer) library_error(tokenizer.error());
  auto ids = tokenizer->encode(text, !args.has("--no-special-tokens"));
  if (!ids) library_error(ids.error());
  std::string json = "[";
  for (size_t i = 0; i < ids->size(); i++) json += (i ? ", " : "") + std::to_string((*ids)[i]);
  printf("%s]\n", json.c_str());
  return kExitOk;
}

int run_logits(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  std::vector<int32_t> ids;
  for (const std::string& part : split(required(args, "--tokens"), ','))
    ids.push_back(int32_t(Args::parse_integer("--tokens", part, 0, INT32_MAX)));
  const std::string& out = required(args, "--out");
  std::optional<kvlite::Image> image;
  if (args.has("--image")) {
    auto loaded = kvlite::load_image(args.text("--image"));
    if (!loaded) throw InputError{loaded.error().message};
    image = std::move(*loaded);
  }
  kvlite::EngineOptions options = engine_options(args);
  // Text: the KV arena is sized for exactly these tokens. With an image the length is known only once the
  // engine has preprocessed it under its image budget, so max_model_len follows the default rule, as for
  // generate.
  if (!args.has("--max-model-len") && !image) options.plan.max_model_len = int64_t(ids.size());
  auto engine = open_engine(model_dir, options);
  std::vector<kvlite::VisionInput> images;
  if (image) {
    auto input = engine->preprocess(*image);
    if (!input) library_error(input.error());
    images.push_back(std::move(*input));
    // One <|image_pad|> among the ids marks where the image goes; without one, the whole placeholder goes
    // before them, as generate --image puts it before the prompt. The engine expands it to the image's tokens.
    if (std::find(ids.begin(), ids.end(), int32_t(engine->config().image_token_id)) == ids.end()) {
      auto placeholder = engine->tokenize(kvlite::kImagePlaceholder, false);
      if (!placeholder) library_error(placeholder.error());
      ids.insert(ids.begin(), placeholder->begin(), placeholder->end());
    }
  }
  auto logits = engine->logits(ids, images);
  if (!logits) library_error(logits.error());
  auto written = kvlite::write_npy(out, logits->values.data(), logits->tokens, logits->vocab);
  if (!written) library_error(written.error());
  printf("wrote %s: float32 [%lld, %lld]\n", out.c_str(), (long long)logits->tokens, (long long)logits->vocab);
  return kExitOk;
}

// ---- kvlite bench --------------------------------------------------------------------------------------------

// Seconds since `start`.
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One batch: `batch` requests of `prompt` tokens submitted at once, each generating exactly `decode` tokens
// (greedy, end-of-turn tokens ignored), timed from submission.
struct BatchTiming {
  double ttft = 0;           // mean time to the first token, seconds
  double decode_tok_s = 0;   // tokens after each request's first, per second, once every request is decoding
  int64_t steps = 0, graph_steps = 0;
};

// Whether `id` is one of a vision-language model's image / video tokens (placeholders and their brackets).
bool is_vision_marker(const kvlite::ModelConfig& config, int32_t id) {
  if (!config.vision.present) return false;
  for (int64_t marker : {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                         config.vision_end_token_id})
    if (marker >= 0 && id == marker) return true;
  return false;
}

// Request b's prompt of `length` ids spread over the vocabulary: a fixed LCG, so the same prompts every run, and
// distinct per request.
std::vector<int32_t> bench_prompt(const kvlite::ModelConfig& config, int64_t length, uint64_t seed, int64_t b) {
  std::vector<int32_t> ids(static_cast<size_t>(length));
  uint64_t state = seed * 7919 + uint64_t(b) * 104729 + 1;
  for (auto& id : ids) {
    do {  // a vision model's image and video markers would ask for images: draw again
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      id = int32_t((state >> 33) % uint64_t(config.text.vocab_size));
    } while (is_vision_marker(config, id));
  }
  return ids;
}

// `batch` requests of `prompt` tokens (bench_prompt with `seed`), each generating `decode` tokens greedily, run
// together and timed. on_prefilled, when given, is called once, from the token callback, when every request has
// its first token (every prefill done: the steps after it are decode steps).
BatchTiming run_batch(kvlite::Engine& engine, int64_t batch, int64_t prompt, int64_t decode, uint64_t seed,
                      const std::function<void()>& on_prefilled = nullptr) {
  kvlite::SamplingParams params;
  params.max_tokens = decode;
  params.ignore_eos = true;
  using Clock = std::chrono::steady_clock;
  std::vector<double> first(size_t(batch), -1.0), last(size_t(batch), -1.0);
  int64_t first_tokens = 0;
  const kvlite::EngineStats before = engine.stats();
  const Clock::time_point start = Clock::now();
  for (int64_t b = 0; b < batch; b++) {
    const std::vector<int32_t> ids = bench_prompt(engine.config(), prompt, seed, b);
    auto on_token = [&, b](const std::string&, int32_t id) {
      if (id < 0) return true;  // the held-back text at the end, not a token
      const double now = seconds_since(start);
      if (first[size_t(b)] < 0) {
        first[size_t(b)] = now;
        if (++first_tokens == batch && on_prefilled) on_prefilled();
      }
      last[size_t(b)] = now;
      return true;
    };
    auto submitted = engine.submit(ids, params, on_token);
    if (!submitted) library_error(submitted.error());
  }
  auto ran = engine.run();
  if (!ran) library_error(ran.error());
  BatchTiming timing;
  double all_first = 0, all_last = 0;
  for (int64_t b = 0; b < batch; b++) {
    timing.ttft += first[size_t(b)] / double(batch);
    all_first = std::max(all_first, first[size_t(b)]);
    all_last = std::max(all_last, last[size_t(b)]);
  }
  // Tokens after the first of each request, over the time from the last first token to the last token (tokens
  // generated while a later request was still prefilling count too, which flatters a batch whose prompts do not
  // fit one step slightly).
  const double decode_seconds = all_last - all_first;
  timing.decode_tok_s = decode > 1 && decode_seconds > 0 ? double(batch * (decode - 1)) / decode_seconds : 0;
  const kvlite::EngineStats after = engine.stats();
  timing.steps = after.steps - before.steps;
  timing.graph_steps = after.graph_steps - before.graph_steps;
  return timing;
}

// kvlite bench --profile: where a prefill's and a decode step's time go, op by op. `batch` requests as the timed
// runs make them; op timing (Engine::set_op_timing: eager steps, each op waiting for its own work) is on for the
// whole run. The prefill table covers the steps until every request has its first token (their prompts, in
// max_batched_tokens chunks), the decode table the steps after. What the ops do not account for is the engine's
// own work between them (scheduling, sampling, copies to the host).
void print_op_table(const char* title, const kvlite::EngineStats& before_stats, const kvlite::EngineStats& after_stats,
                    double wall, int64_t batch) {
  const int64_t steps = after_stats.steps - before_stats.steps;
  if (steps <= 0) return;
  const double step_wall = wall / double(steps);
  struct Row {
    std::string op;
    double calls, seconds;  // per step
  };
  std::vector<Row> rows;
  double ops_seconds = 0;
  for (int i = 0; i < kvlite::kOpCount; i++) {
    const kvlite::OpTime& before = before_stats.op_times[size_t(i)];
    const kvlite::OpTime& after = after_stats.op_times[size_t(i)];
    if (after.calls == before.calls) continue;
    rows.push_back({kvlite::op_name(kvlite::Op(i)), double(after.calls - before.calls) / double(steps),
                    (after.seconds - before.seconds) / double(steps)});
    ops_seconds += rows.back().seconds;
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.seconds > b.seconds; });
  auto share = [&](double seconds) { return 100.0 * seconds / step_wall; };
  printf("\nprofile: batch %lld, %s (the mean of %lld; eager, each op waiting for its own work, so on a GPU "
         "each op's launch counts: a step takes %.3f ms this way)\n",
         (long long)batch, title, (long long)steps, step_wall * 1e3);
  printf("%-20s %10s %12s %10s %8s\n", "op", "calls", "ms", "us/call", "share");
  for (const Row& row : rows)
    printf("%-20s %10.1f %12.4f %10.2f %7.1f%%\n", row.op.c_str(), row.calls, row.seconds * 1e3,
           row.seconds / row.calls * 1e6, share(row.seconds));
  printf("%-20s %10s %12.4f %10s %7.1f%%\n", "(all ops)", "", ops_seconds * 1e3, "", share(ops_seconds));
  printf("%-20s %10s %12.4f %10s %7.1f%%\n", "(between the ops)", "", (step_wall - ops_seconds) * 1e3, "",
         share(step_wall - ops_seconds));
}

void print_profile(kvlite::Engine& engine, int64_t batch, int64_t prompt, int64_t decode) {
  bool prefilled = false;
  const kvlite::EngineStats at_start = engine.stats();
  engine.set_op_timing(true);
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point decode_start;
  kvlite::EngineStats at_first_tokens;
  run_batch(engine, batch, prompt, decode, uint64_t(batch), [&] {
    at_first_tokens = engine.stats();
    decode_start = std::chrono::steady_clock::now();
    prefilled = true;
  });
  engine.set_op_timing(false);
  const kvlite::EngineStats at_end = engine.stats();
  if (!prefilled) {
    printf("\nprofile: the requests got no first token\n");
    return;
  }
  const double prefill_wall = std::chrono::duration<double>(decode_start - start).count();
  print_op_table(("a prefill step of its " + std::to_string(prompt) + "-token prompts").c_str(), at_start,
                 at_first_tokens, prefill_wall, batch);
  if (at_end.steps <= at_first_tokens.steps)
    printf("\nprofile: no decode step to time (--decode-tokens %lld)\n", (long long)decode);
  else
    print_op_table("a decode step", at_first_tokens, at_end, seconds_since(decode_start), batch);
  fflush(stdout);
}

std::vector<int64_t> parse_batches(const std::string& text) {
  std::vector<int64_t> batches;
  for (const std::string& part : split(text, ',')) batches.push_back(Args::parse_integer("--batch", part, 1, 65536));
  return batches;
}

int run_bench(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  const std::vector<int64_t> batches = parse_batches(args.has("--batch") ? args.text("--batch") : "1,8");
  const int64_t prompt = args.has("--prompt-tokens") ? args.integer("--prompt-tokens", 1, 1 << 20) : 128;
  const int64_t decode = args.has("--decode-tokens") ? args.integer("--decode-tokens", 2, 1 << 20) : 64;
  const int64_t largest = *std::max_element(batches.begin(), batches.end());
  kvlite::EngineOptions options = engine_options(args);
  if (!args.has("--backend")) options.backend = kvlite::BackendChoice::auto_;  // measure the GPU when there is one
  if (!args.has("--max-seqs")) options.plan.max_seqs = largest;
  if (!args.has("--prefix-cache")) options.prefix_caching = false;  // time the prefill, not the cache
  if (!args.has("--max-model-len")) options.plan.max_model_len = prompt + decode;
  // Every prompt of the largest batch in one prefill step when it fits the usual 2048 tokens.
  if (!args.has("--max-batched-tokens")) options.plan.max_batched_tokens = std::min<int64_t>(2048, largest * prompt);
  if (options.plan.max_seqs < largest)
    throw UsageError{"--max-seqs " + std::to_string(options.plan.max_seqs) + " is less than the largest --batch " +
                     std::to_string(largest)};
  const auto open_started = std::chrono::steady_clock::now();
  auto engine = open_engine(model_dir, options);
  const double open_seconds = seconds_since(open_started);
  const kvlite::Plan& plan = engine->plan();
  const kvlite::EngineInfo info = engine->info();

  auto bandwidth = engine->measure_copy_bandwidth();
  if (!bandwidth) library_error(bandwidth.error());
  printf("kvlite bench: %s on %s\n", plan.model_name.c_str(), info.backend_name.c_str());
  printf("plan: %s, arena %s, KV %s (%llu tokens), max_batched_tokens %lld\n", plan.device.name.c_str(),
         kvlite::format_bytes(plan.arena_bytes()).c_str(), kvlite::kv_dtype_name(plan.options.kv_dtype),
         (unsigned long long)plan.kv_tokens, (long long)plan.options.max_batched_tokens);
  // Engine::open whole: the plan, the arena, the weights read (from the page cache when warm) and uploaded, the
  // vision tower, and on a GPU the decode graphs captured.
  printf("open: %.2f ms (%s)\n", open_seconds * 1e3,
         info.backend == kvlite::BackendKind::cuda ? "plan, arena, weights read and uploaded, graphs captured"
                                                   : "plan, arena, weights read");
  printf("copy bandwidth: %.1f GB/s (bytes read + written; %s, %s x %d)\n", bandwidth->bytes_per_second / 1e9,
         bandwidth->method.c_str(), kvlite::format_bytes(bandwidth->bytes).c_str(), bandwidth->repeats);
  printf("weights read per decode step: %s; KV per token: %s\n", kvlite::format_bytes(info.decode_weight_bytes).c_str(),
         kvlite::format_bytes(plan.kv_bytes_per_token).c_str());
  if (info.backend == kvlite::BackendKind::cuda) {
    std::string buckets;
    for (int64_t b : info.graph_buckets) buckets += (buckets.empty() ? "" : ",") + std::to_string(b);
    const kvlite::PlanItem* graphs = plan.item("graphs");
    printf("cuda graphs: %s (measured %s; the plan's estimate %s)\n", buckets.empty() ? "none" : buckets.c_str(),
           kvlite::format_bytes(info.graph_memory_bytes).c_str(),
           kvlite::format_bytes(graphs ? graphs->bytes : 0).c_str());
  }
  // A short run first: the first steps pay for warming caches and clocks.
  run_batch(*engine, 1, std::min<int64_t>(prompt, 8), 2, 0);

  printf("\n%5s %7s %7s %10s %14s %13s %15s %12s\n", "batch", "prompt", "decode", "ttft_ms", "ttft_floor_ms",
         "decode_tok/s", "roofline_tok/s", "of_roofline");
  for (int64_t batch : batches) {
    const BatchTiming t = run_batch(*engine, batch, prompt, decode, uint64_t(batch));
    // Roofline: a decode step reads every weight once and each sequence's KV (its mean context over the run);
    // prefill reads the weights once per step of max_batched_tokens and writes the prompts' KV.
    const double context = double(prompt) + double(decode) / 2.0;
    const double step_bytes =
        double(info.decode_weight_bytes) + double(batch) * context * double(plan.kv_bytes_per_token);
    const double roofline_tok_s = double(batch) * bandwidth->bytes_per_second / step_bytes;
    const double prefill_steps =
        std::ceil(double(batch * prompt) / double(std::max<int64_t>(plan.options.max_batched_tokens, 1)));
    const double ttft_floor = (prefill_steps * double(info.decode_weight_bytes) +
                               double(batch * prompt) * double(plan.kv_bytes_per_token)) /
                              bandwidth->bytes_per_second;
    // Below 1% (a tiny model on a slow or sanitized CPU) three significant figures, so it never prints 0.0%.
    const double percent_of_roofline = 100.0 * t.decode_tok_s / roofline_tok_s;
    printf("%5lld %7lld %7lld %10.3f %14.3f %13.2f %15.2f %11.*f%%\n", (long long)batch, (long long)prompt,
           (long long)decode, t.ttft * 1e3, ttft_floor * 1e3, t.decode_tok_s, roofline_tok_s,
           percent_of_roofline >= 1.0 || percent_of_roofline <= 0.0
               ? 1
               : std::min(6, 2 - int(std::floor(std::log10(percent_of_roofline)))),
           percent_of_roofline);
    fflush(stdout);
  }
  printf("\nroofline: the bytes a decode step reads (weights + each sequence's KV at its mean context) over the copy "
         "bandwidth; ttft_floor: the weights read once per prefill step and the prompts' KV written, over it.\n");
  if (args.has("--profile")) print_profile(*engine, batches.front(), prompt, decode);
  return kExitOk;
}

// ---- kvlite serve -----------------------------------------------------------------------------------------

#if defined(KVLITE_HAVE_SERVER)
// SIGINT / SIGTERM only set a flag (all a signal handler may safely do); a watcher thread stops the server.
volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void request_stop(int) { g_stop_requested = 1; }
#endif

int run_serve(const Args& args) {
  const std::string& model_dir = model_dir_argument(args);
  const kvlite::EngineOptions options = engine_options(args);
#if defined(KVLITE_HAVE_SERVER)
  kvlite_server::ServeOptions serve;
  if (args.has("--host")) serve.host = args.text("--host");
  if (args.has("--port")) serve.port = int(args.integer("--port", 0, 65535));
  if (args.has("--max-queue")) serve.max_queue = args.integer("--max-queue", 1, 4096);
  if (args.has("--max-body-bytes")) serve.max_body_bytes = args.size("--max-body-bytes");
  if (args.has("--max-tokens")) serve.max_tokens = args.integer("--max-tokens", 1, kvlite::limits::max_new_tokens);
  if (args.has("--served-model-name")) serve.model_name = args.text("--served-model-name");
  if (args.has("--max-image-bytes")) serve.max_image_bytes = int64_t(args.size("--max-image-bytes"));
  if (args.has("--shutdown-timeout")) serve.shutdown_timeout_s = args.number("--shutdown-timeout");
  if (args.has("--max-connections")) serve.max_connections = args.integer("--max-connections", 1, 16384);
  if (args.has("--read-timeout")) serve.read_timeout_s = args.integer("--read-timeout", 1, 3600);
  if (args.has("--request-deadline")) serve.request_deadline_s = args.integer("--request-deadline", 1, 86400);
  // The key from the environment keeps it out of `ps`; --api-key wins when both are given.
  if (const char* key = std::getenv("KVLITE_API_KEY"); key && *key) serve.api_key = key;
  if (args.has("--api-key")) serve.api_key = args.text("--api-key");
  if (args.has("--allowed-origins")) {
    std::string list = args.text("--allowed-origins");
    for (size_t start = 0; start <= list.size();) {
      const size_t comma = std::min(list.find(',', start), list.size());
      if (comma > start) serve.allowed_origins.push_back(list.substr(start, comma - start));
      start = comma + 1;
    }
  }
  // The plan first, exactly as `kvlite plan` prints it: a plan that does not fit stops here, with its advice.
  auto plan = kvlite::plan_engine(model_dir, options);
  if (!plan) throw InputError{plan.error().message};
  fputs(plan->table().c_str(), stdout);
  fflush(stdout);
  if (!plan->fits) {
    fprintf(stderr, "kvlite serve: the plan does not fit (see its advice above); not starting\n");
    return kExitDoesNotFit;
  }
  auto server = kvlite_server::OpenAIServer::create(open_engine(model_dir, options), serve);
  if (!server) throw InputError{server.error().message};
  auto port = (*server)->bind();
  if (!port) throw InputError{port.error().message};
  printf("kvlite serve: %s on http://%s:%d/v1 (POST /v1/chat/completions, /v1/completions; GET /v1/models, "
         "/health, /metrics); Ctrl-C stops\n",
         plan->model_name.c_str(), serve.host.c_str(), *port);
  fflush(stdout);
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  std::atomic<bool> served{false};
  kvlite_server::OpenAIServer& running = **server;
  std::thread watcher([&] {
    while (!served.load()) {
      if (g_stop_requested) {
        running.stop();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  running.serve();
  served.store(true);
  watcher.join();
  return kExitOk;
#else
  (void)model_dir;
  (void)options;
  throw InputError{"kvlite serve: this kvlite was built without cpp-httplib (Debian: libcpp-httplib-dev); install it "
                   "and rebuild"};
#endif
}

const std::vector<Command>& commands() {
  static const std::vector<Command> list = {
      {"plan", "where every byte of device memory goes, and what would fit",
       "Plan device memory for a model directory: weights, context, activations, vision, logits, workspace,\n"
       "graphs and the KV arena against utilization x device memory. Reads config.json and the safetensors\n"
       "headers only; never reads tensor data or allocates GPU memory. It takes the options of generate, score\n"
       "and logits and prints the plan their engine opens with, byte for byte (backend choice included).",
       "kvlite plan MODEL_DIR [options]",
       "To plan for a GPU this machine does not have: --backend cuda --device-mem 8GiB.\n"
       "--sweep KEY=V1,V2,... (keys: max-model-len, utilization, device-mem, max-image-pixels) prints CSV\n"
       "  KEY[,max_model_len],total_bytes,kv_bytes,concurrency,fits\n"
       "  total_bytes = fixed items + kv_bytes, kv_bytes = KV of one max_model_len sequence (whole pages),\n"
       "  concurrency = such sequences the planned KV arena holds, fits = one fits. Exit 0.\n"
       "\nexit status: 0 fits, 1 does not fit (table and advice still printed), 2 usage or input error.\n",
       with_engine_options({
           {"--json", "", "print the plan as JSON instead of the table"},
           {"--svg", "FILE", "also write the budget as a stacked-bar SVG"},
           {"--sweep", "KEY=V1,V2,...", "print CSV for each value instead of one plan (see below)"},
       }),
       run_plan},
      {"generate", "generate text from a prompt, streamed to stdout",
       "Generate text (Llama-3, Qwen2, Qwen3, Qwen3-VL; BF16/F16/F32, FP8 and W4A16 checkpoints) on the CPU\n"
       "reference engine or the GPU (--backend; images run on either). The\n"
       "text streams to stdout as it is generated; a summary line goes to stderr.",
       "kvlite generate MODEL_DIR --prompt TEXT [--chat] [options]",
       "Generation stops at the model's end-of-turn tokens, at --stop, or after --max-tokens tokens; with\n"
       "--json-schema or --grammar also when the output is complete and nothing more may follow (finish reason\n"
       "grammar_end); max_tokens never cuts such an output short of a whole document when the budget can hold one.\n"
       "Generation also ends when the context is full (prompt + output = max_model_len: finish reason length);\n"
       "a prompt that cannot fit at all is refused (exit 1, with the numbers).\n"
       "\nexit status: 0 done, 1 does not fit, 2 usage or input error.\n",
       with_engine_options({
           {"--prompt", "TEXT", "the prompt (plain text, encoded with the tokenizer's special tokens)"},
           {"--chat", "", "send --prompt as a user message in the model's chat format"},
           {"--system", "TEXT", "with --chat: a system message before it"},
           {"--image", "PATH", "vision models (Qwen3-VL): an image (JPEG, PNG, ...) placed before the prompt"},
           {"--max-tokens", "N", "generate at most N tokens; default 256"},
           {"--temperature", "T", "0 = greedy (default); > 0 samples"},
           {"--top-p", "P", "nucleus sampling, (0, 1]; default 1 (off)"},
           {"--top-k", "K", "sample among the K most likely; default 0 (off)"},
           {"--min-p", "P", "drop tokens below P x the top probability; default 0 (off)"},
           {"--repetition-penalty", "R", "> 1 discourages repeating tokens; default 1 (off)"},
           {"--seed", "S", "sampling seed (same seed, same text); default 0"},
           {"--stop", "TEXT", "stop when the text reaches TEXT (which is not printed)"},
           {"--json-schema", "FILE", "constrain the output to JSON valid against this JSON schema"},
           {"--grammar", "FILE", "constrain the output to sentences of this GBNF grammar (start rule root)"},
           {"--logprobs", "", "print each generated token's id, log-probability and bytes to stderr"},
       }),
       run_generate},
      {"score", "perplexity of a text file with a sliding window",
       "Perplexity with transformers' sliding-window recipe (\"Perplexity of fixed-length models\"): windows of\n"
       "--context-length tokens every --stride tokens; every token after the first is scored once, with the\n"
       "context its window gives it. Progress goes to stderr when it is a terminal.",
       "kvlite score MODEL_DIR --text-file F --context-length N --stride S [options]",
       "Prints perplexity = exp(mean NLL over the scored tokens), then the guide's own weighting of window\n"
       "means for comparison. The KV arena is sized for one window (max_model_len = context length).\n"
       "\nexit status: 0 done, 1 does not fit, 2 usage or input error.\n",
       with_engine_options({
           {"--text-file", "F", "the text to score (UTF-8), encoded with the tokenizer's special tokens"},
           {"--context-length", "N", "tokens per window (e.g. 2048)"},
           {"--stride", "S", "tokens between window starts, 1..N (e.g. 512)"},
       }),
       run_score},
      {"tokenize", "print the token ids of a text as a JSON array",
       "Encode a text with the model directory's tokenizer.json, as Hugging Face tokenizers does.",
       "kvlite tokenize MODEL_DIR --text TEXT [--no-special-tokens]",
       "",
       {
           {"--text", "TEXT", "the text to encode"},
           {"--no-special-tokens", "", "do not add the tokenizer's special tokens (e.g. Llama-3's <|begin_of_text|>)"},
       },
       run_tokenize},
      {"logits", "write the logits of a token sequence as a .npy file",
       "Run one sequence through the model and write the logits of every position: float32 [n_tokens, vocab]\n"
       "in NumPy's .npy format (row t = the logits after tokens 0..t).",
       "kvlite logits MODEL_DIR --tokens 1,2,3 [--image PATH] --out FILE.npy [options]",
       "With --image (vision models) the CLI inserts the image's tokens: the one <|image_pad|> id among --tokens\n"
       "marks the image's place (e.g. ...,<|vision_start|>,<|image_pad|>,<|vision_end|>,... as the chat template\n"
       "writes it); without one, <|vision_start|><|image_pad|><|vision_end|> goes before the tokens, as generate\n"
       "--image does. The <|image_pad|> becomes the image's tokens (how many: the image's size under the image\n"
       "budget), and the rows cover the expanded sequence. max_model_len then follows the default rule.\n"
       "\nexit status: 0 done, 1 does not fit, 2 usage or input error.\n",
       with_engine_options({
           {"--tokens", "IDS", "comma-separated token ids"},
           {"--image", "PATH", "vision models (Qwen3-VL): an image (JPEG, PNG, ...) whose tokens are inserted"},
           {"--out", "FILE", "the .npy file to write"},
       }),
       run_logits},
      {"serve", "an OpenAI-compatible HTTP server (chat completions with images, streaming)",
       "Serve the model over HTTP as vLLM's OpenAI-compatible server does: POST /v1/chat/completions (text and\n"
       "image_url parts as base64 data: URIs; stream: true as server-sent events), POST /v1/completions,\n"
       "GET /v1/models, /health and /metrics (Prometheus text). Requests from every client share the engine\n"
       "through continuous batching; a client that disconnects (streaming or not) ends its request. The plan is\n"
       "printed first, as kvlite plan prints it; a plan that does not fit does not start.",
       "kvlite serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [options]",
       "Errors are OpenAI's: 400 bad input (the message names the field; fields kvlite does not implement are\n"
       "refused by name, never ignored), 401 missing API key, 404 unknown model, 413 oversized body or image,\n"
       "503 queue full or shutting down. Also POST /tokenize, /detokenize, GET /version, /v1/models/{id}.\n"
       "SIGTERM drains: new requests get 503, idle connections close, requests in flight finish (up to\n"
       "--shutdown-timeout).\n"
       "\nexit status: 0 stopped (SIGINT / SIGTERM), 1 does not fit, 2 usage or input error.\n",
       with_engine_options({
           {"--host", "ADDR", "address to listen on; default 127.0.0.1"},
           {"--port", "N", "port; default 8000 (0: any free port)"},
           {"--max-queue", "N", "requests in flight (running or waiting) before 503; default 64"},
           {"--max-body-bytes", "SIZE", "larger request bodies get 413; default 32MiB"},
           {"--max-tokens", "N", "cap on a request's max_tokens; default max_model_len"},
           {"--served-model-name", "NAME", "the model name clients send and /v1/models lists; default the plan's"},
           {"--api-key", "KEY", "/v1 routes need Authorization: Bearer KEY (else 401); also $KVLITE_API_KEY"},
           {"--allowed-origins", "LIST", "CORS: comma-separated origins browsers may call from (* any); default none"},
           {"--shutdown-timeout", "S", "SIGTERM: seconds requests in flight may take to finish; default 30"},
           {"--max-image-bytes", "SIZE", "one image's encoded size; larger gets 413 before decoding; default 20MiB"},
           {"--max-connections", "N", "connections served at once (slow ones hold only their own); more: 503; default 512"},
           {"--read-timeout", "S", "longest wait for a request's next header or body bytes; default 10"},
           {"--request-deadline", "S", "longest a whole request (line, headers, body) may take to arrive, from its connection's opening or previous answer; a connection idle that long is closed; default 60"},
       }),
       run_serve},
      {"bench", "decode tokens/s and time to first token, beside the memory-bandwidth roofline",
       "Measure the engine: time to first token and decode tokens/s for each --batch (that many requests of\n"
       "--prompt-tokens tokens at once, each generating --decode-tokens tokens greedily, end-of-turn tokens\n"
       "ignored), printed beside the roofline: the bytes a decode step reads (every weight once, plus each\n"
       "sequence's KV) over the copy bandwidth measured in the same run (cudaMemcpy device to device on a GPU,\n"
       "memcpy on the CPU). Random-weight checkpoints of real shapes: tools/make_random_checkpoint.py.",
       "kvlite bench MODEL_DIR [--batch 1,8] [--prompt-tokens N] [--decode-tokens N] [options]",
       "Defaults: --backend auto (the GPU when there is one), --max-seqs = the largest batch, --max-model-len =\n"
       "prompt + decode tokens, --max-batched-tokens = min(2048, largest batch x prompt tokens).\n"
       "\nexit status: 0 done, 1 does not fit, 2 usage or input error.\n",
       with_engine_options({
           {"--batch", "B1,B2,...", "batch sizes to measure; default 1,8"},
           {"--prompt-tokens", "N", "prompt length of every request; default 128"},
           {"--decode-tokens", "N", "tokens each request generates, >= 2; default 64"},
           {"--profile", "", "then, for the first --batch, where a prefill's and a decode step's time go, op by op (eager steps, "
                             "each op waiting for its own work)"},
       }),
       run_bench},
  };
  return list;
}

std::string global_help() {
  std::string out = "usage: kvlite COMMAND [options]   (kvlite COMMAND --help for its options)\n\ncommands:\n";
  for (const auto& c : commands()) out += "  " + c.name + std::string(c.name.size() < 10 ? 10 - c.name.size() : 1, ' ') +
                                        c.brief + "\n";
  out += "\n  --help      this text\n  --version   print the version\n";
  return out;
}

const Command* find_command(const std::string& name) {
  for (const auto& c : commands())
    if (c.name == name) return &c;
  return nullptr;
}

std::string unknown_command(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& c : commands()) names.push_back(c.name);
  std::string near = closest(name, names);
  return "unknown command '" + name + "'" + (near.empty() ? "" : "; did you mean " + near + "?") +
         " (kvlite --help lists the commands)";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    fputs(global_help().c_str(), stderr);
    return kExitUsage;
  }
  const std::string& first = args[0];
  if (first == "--help" || first == "-h") {
    fputs(global_help().c_str(), stdout);
    return kExitOk;
  }
  if (first == "--version") {
    printf("kvlite %s\n", KVLITE_VERSION_STRING);
    return kExitOk;
  }
  if (first == "help") {
    if (args.size() == 1) {
      fputs(global_help().c_str(), stdout);
      return kExitOk;
    }
    const Command* command = find_command(args[1]);
    if (!command) {
      fprintf(stderr, "kvlite: error: %s\n", unknown_command(args[1]).c_str());
      return kExitUsage;
    }
    fputs(command_help(*command).c_str(), stdout);
    return kExitOk;
  }
  const Command* command = find_command(first);
  if (!command) {
    fprintf(stderr, "kvlite: error: %s\n", unknown_command(first).c_str());
    return kExitUsage;
  }
  try {
    Args parsed(command->options, std::vector<std::string>(args.begin() + 1, args.end()));
    if (parsed.help()) {
      fputs(command_help(*command).c_str(), stdout);
      return kExitOk;
    }
    return command->run(parsed);
  } catch (const UsageError& e) {
    fprintf(stderr, "kvlite %s: error: %s\nRun 'kvlite %s --help' for usage.\n", command->name.c_str(),
            e.message.c_str(), command->name.c_str());
  } catch (const DoesNotFit& e) {
    fprintf(stderr, "kvlite %s: error: %s\n", command->name.c_str(), e.message.c_str());
    return kExitDoesNotFit;
  } catch (const InputError& e) {
    fprintf(stderr, "kvlite %s: error: %s\n", command->name.c_str(), e.message.c_str());
  } catch (const std::exception& e) {
    fprintf(stderr, "kvlite %s: error: %s\n", command->name.c_str(), e.what());
  }
  return kExitUsage;
}
