// kvlite: the command-line tool. Uses the public API only.
//
//   kvlite plan MODEL_DIR [options]   where every byte of device memory goes, before anything is loaded
//   kvlite --help | --version | help COMMAND
//
// Exit status: 0 success (for `plan`: it fits), 1 the plan does not fit (the table and advice are still
// printed), 2 a usage or input error (one message on stderr; never a crash).
//
// Layout: a small argument parser (Args) with typed getters that throw UsageError; a table of commands, each
// with its options and a run function. More commands (generate, score, tokenize, logits, bench) are one more
// row in commands() and one more run_* function.
#include "kvlite.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
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

kvlite::Plan plan_or_throw(const kvlite::PlanInputs& inputs, const kvlite::PlanOptions& options) {
  auto device = kvlite::detect_device(options.device_mem, options.wsl2);
  if (!device) throw InputError{device.error().message};
  auto plan = kvlite::make_plan(inputs, *device, options);
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
int run_sweep(const kvlite::PlanInputs& inputs, const kvlite::PlanOptions& base, const Sweep& sweep) {
  bool by_length = sweep.key.key == "max-model-len";
  std::string csv = sweep.key.column + (by_length ? "" : ",max_model_len") + ",total_bytes,kv_bytes,concurrency,fits\n";
  for (const auto& value : sweep.values) {
    kvlite::PlanOptions options = base;
    sweep.key.apply(options, value);
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
  kvlite::PlanOptions options;
  if (args.has("--device-mem")) options.device_mem = args.size("--device-mem");
  if (args.has("--utilization")) options.utilization = args.number("--utilization");
  // 0 means "the default rule" inside the library; on the command line a value must be positive.
  if (args.has("--max-model-len")) options.max_model_len = args.integer("--max-model-len", 1, INT64_MAX);
  if (args.has("--max-seqs")) options.max_seqs = args.integer("--max-seqs", 1, INT64_MAX);
  if (args.has("--max-batched-tokens")) options.max_batched_tokens = args.integer("--max-batched-tokens", 1, INT64_MAX);
  if (args.has("--kv-dtype")) {
    auto dtype = kvlite::parse_kv_dtype(args.text("--kv-dtype"));
    if (!dtype) throw UsageError{"--kv-dtype: " + dtype.error().message};
    options.kv_dtype = *dtype;
  }
  if (args.has("--kv-page-tokens")) options.kv_page_tokens = args.integer("--kv-page-tokens", 1, INT64_MAX);
  if (args.has("--max-image-pixels")) options.max_image_pixels = args.integer("--max-image-pixels", 1, INT64_MAX);
  if (args.has("--max-images")) options.max_images = args.integer("--max-images", 1, INT64_MAX);
  if (args.has("--wsl2") && args.has("--no-wsl2")) throw UsageError{"--wsl2 and --no-wsl2 contradict each other"};
  if (args.has("--wsl2")) options.wsl2 = true;
  if (args.has("--no-wsl2")) options.wsl2 = false;
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

const std::vector<Command>& commands() {
  static const std::vector<Command> list = {
      {"plan", "where every byte of device memory goes, and what would fit",
       "Plan device memory for a model directory: weights, context, activations, vision, logits, workspace,\n"
       "graphs and the KV arena against utilization x device memory. Reads config.json and the safetensors\n"
       "headers only; never touches tensor data or the GPU.",
       "kvlite plan MODEL_DIR [options]",
       "max_model_len default: min(model max, 32768), halved while over 2048 until it fits.\n"
       "max_image_pixels default (vision models): min(processor max, 1024 x 1024).\n"
       "--sweep KEY=V1,V2,... (keys: max-model-len, utilization, device-mem, max-image-pixels) prints CSV\n"
       "  KEY[,max_model_len],total_bytes,kv_bytes,concurrency,fits\n"
       "  total_bytes = fixed items + kv_bytes, kv_bytes = KV of one max_model_len sequence (whole pages),\n"
       "  concurrency = such sequences the planned KV arena holds, fits = one fits. Exit 0.\n"
       "\nexit status: 0 fits, 1 does not fit (table and advice still printed), 2 usage or input error.\n",
       {
           {"--device-mem", "SIZE", "plan for a card of this size (8GiB, 7.5G, 512MiB); default: this machine's device"},
           {"--utilization", "R", "fraction of device memory kvlite may use, (0, 1]; default 0.90"},
           {"--max-model-len", "N", "longest sequence (prompt + output); default: see below"},
           {"--max-seqs", "N", "sequences decoded together; default 8"},
           {"--max-batched-tokens", "N", "tokens in one forward step; default min(2048, max_model_len)"},
           {"--kv-dtype", "T", "auto | bf16 | f16 | fp8 (e4m3, halves KV); default auto (the model's dtype)"},
           {"--kv-page-tokens", "N", "tokens per KV page, 1..1024; default 16"},
           {"--max-image-pixels", "N", "vision models: image budget in pixels; default min(processor max, 1048576)"},
           {"--max-images", "N", "vision models: images encoded in one step; default 1"},
           {"--wsl2", "", "plan as under WSL2 (larger driver reservation); default: detected"},
           {"--no-wsl2", "", "plan as on native Linux"},
           {"--json", "", "print the plan as JSON instead of the table"},
           {"--svg", "FILE", "also write the budget as a stacked-bar SVG"},
           {"--sweep", "KEY=V1,V2,...", "print CSV for each value instead of one plan (see below)"},
       },
       run_plan},
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
  } catch (const InputError& e) {
    fprintf(stderr, "kvlite %s: error: %s\n", command->name.c_str(), e.message.c_str());
  } catch (const std::exception& e) {
    fprintf(stderr, "kvlite %s: error: %s\n", command->name.c_str(), e.what());
  }
  return kExitUsage;
}
