// rope: RoPE scaling (linear, dynamic, yarn, longrope, llama3; partial rotary) against transformers 5.x:
// frequency and cos/sin tables from its rotary module (tests/fixtures/rope/tables.json), and tiny llama / qwen2
// models with each scaling type run through the engine at prompts crossing original_max_position_embeddings
// (tests/fixtures/rope/models/*), all made by tools/make_rope_fixtures.py. Plus the config errors, and the
// plan of Qwen2.5-7B with its model card's YaRN.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sys/wait.h>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
using namespace kvlite;
namespace fx = model_fixtures;
using json = nlohmann::json;

namespace {

const std::string kRopeDir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/rope";

json read_json(const std::string& path) { return json::parse(fx::read_file(path)); }

ModelConfig parse(const json& doc, const std::string& origin = "config.json") {
  auto config = parse_config(doc.dump(), origin);
  REQUIRE_MESSAGE(config.ok(), config.error().message);
  return *config;
}

Error parse_failure(const json& doc) {
  auto config = parse_config(doc.dump(), "config.json");
  REQUIRE_FALSE(config.ok());
  return config.error();
}

bool mentions(const Error& e, const std::string& part) { return e.message.find(part) != std::string::npos; }

// The largest |a - b| / |b| over the entries.
double max_relative(const std::vector<float>& values, const std::vector<float>& reference) {
  double worst = 0;
  for (size_t i = 0; i < reference.size(); i++)
    worst = std::max(worst, std::fabs(double(values[i]) - double(reference[i])) / std::fabs(double(reference[i])));
  return worst;
}

std::vector<std::string> model_names() { return read_json(kRopeDir + "/models.json")["models"].get<std::vector<std::string>>(); }

std::string model_dir(const std::string& name) { return kRopeDir + "/models/" + name; }

std::unique_ptr<Engine> open_model(const std::string& name, EngineOptions options = {}) {
  if (!options.plan.device_mem) options.plan.device_mem = 64 * MiB;
  auto engine = Engine::open(model_dir(name), options);
  const std::string why = engine.ok() ? std::string() : name + ": " + engine.error().message;
  REQUIRE_MESSAGE(engine.ok(), why);
  return std::move(*engine);
}

constexpr double kLogitsTolerance = 1e-4;  // max |kvlite - transformers| / max |transformers|, float32

}  // namespace

TEST_CASE("frequencies, attention factors and cos/sin tables equal transformers' rotary module") {
  // Every case is a config.json; kvlite parses it and makes the tables a forward over positions up to
  // length - 1 uses. transformers' inv_freq is float32 from the same float32 steps: agreement to an ulp or so.
  const json tables = read_json(kRopeDir + "/tables.json");
  double worst_inv = 0, worst_table = 0;
  for (const auto& c : tables["cases"]) {
    const std::string name = c["name"].get<std::string>();
    CAPTURE(name);
    const ModelConfig config = parse(c["config"], name);
    const RopeConfig& rope = config.text.rope;
    CHECK(rope.type == c["rope_type"].get<std::string>());
    auto rotary = RotaryEmbedding::create(rope, config.text.head_dim);
    REQUIRE_MESSAGE(rotary.ok(), rotary.error().message);
    const std::vector<float> init_expected = c["init_inv_freq"].get<std::vector<float>>();
    REQUIRE(rotary->half() == int64_t(init_expected.size()));
    const double init_error = max_relative(rotary->init_frequencies().inv_freq, init_expected);
    CHECK(init_error <= 1e-6);
    CHECK(std::fabs(rotary->init_frequencies().attention_factor - c["init_attention_scaling"].get<double>()) <= 1e-6);
    worst_inv = std::max(worst_inv, init_error);
    for (const auto& at : c["lengths"]) {
      const int64_t length = at["length"].get<int64_t>();
      CAPTURE(length);
      auto frequencies = rope_frequencies_for_length(rope, rotary->rotary_dim(), length);
      REQUIRE_MESSAGE(frequencies.ok(), frequencies.error().message);
      const double inv_error = max_relative(frequencies->inv_freq, at["inv_freq"].get<std::vector<float>>());
      CHECK(inv_error <= 1e-6);
      worst_inv = std::max(worst_inv, inv_error);
      CHECK(std::fabs(frequencies->attention_factor - at["attention_scaling"].get<double>()) <= 1e-6);

      const std::vector<int32_t> positions = at["positions"].get<std::vector<int32_t>>();
      const int64_t tokens = int64_t(positions.size()), half = rotary->half();
      const std::vector<int32_t> lengths(positions.size(), int32_t(length));
      std::vector<float> cos(size_t(tokens * half)), sin(size_t(tokens * half));
      REQUIRE(rotary->tables(positions.data(), 1, tokens, lengths.data(), cos.data(), sin.data()).ok());
      // |kvlite - transformers| / attention factor, against 1e-6 plus what the frequencies' own difference
      // (inv_error, relative; torch's vectorised float pow is within an ulp or two, not correctly rounded)
      // moves the angle by, plus half an ulp of the float32 angle: at position 131071 an ulp of a frequency
      // near 1 is 0.008 rad.
      const double scale = at["attention_scaling"].get<double>();
      const std::vector<float>& inv_freq = frequencies->inv_freq;
      double table_error = 0;
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < half; i++) {
          const double angle = double(inv_freq[size_t(i)]) * double(positions[size_t(t)]);
          const double allowed = 1e-6 + angle * (inv_error + std::ldexp(1.0, -24));
          const double dc = std::fabs(double(cos[size_t(t * half + i)]) - at["cos"][size_t(t)][size_t(i)].get<double>()) / scale;
          const double ds = std::fabs(double(sin[size_t(t * half + i)]) - at["sin"][size_t(t)][size_t(i)].get<double>()) / scale;
          table_error = std::max(table_error, std::max(dc, ds) / allowed);
        }
      CHECK(table_error <= 1.0);
      worst_table = std::max(worst_table, table_error);
    }
  }
  MESSAGE("worst inv_freq relative error " << worst_inv << "; worst cos/sin error " << worst_table
          << " of the allowance (1e-6 + (inv_freq error + 2^-24) |angle|)");
}

TEST_CASE("dynamic and longrope pick their frequencies by length as dynamic_rope_update does") {
  const json tables = read_json(kRopeDir + "/tables.json");
  for (const auto& c : tables["cases"]) {
    const ModelConfig config = parse(c["config"]);
    const RopeConfig& rope = config.text.rope;
    if (!rope_depends_on_length(rope)) continue;
    CAPTURE(c["name"].get<std::string>());
    auto rotary = RotaryEmbedding::create(rope, config.text.head_dim);
    REQUIRE(rotary.ok());
    const int64_t boundary = rope.type == "dynamic" ? rope.max_position_embeddings : rope.original_max_position_embeddings;
    // up to the boundary: the init frequencies; one past it: different ones
    auto at_boundary = rope_frequencies_for_length(rope, rotary->rotary_dim(), boundary);
    auto past = rope_frequencies_for_length(rope, rotary->rotary_dim(), boundary + 1);
    REQUIRE(at_boundary.ok());
    REQUIRE(past.ok());
    CHECK(at_boundary->inv_freq == rotary->init_frequencies().inv_freq);
    CHECK(past->inv_freq != rotary->init_frequencies().inv_freq);
    // one table call with two sequences of different lengths: each token follows its own sequence's length
    const std::vector<int32_t> positions = {3, 3};
    const std::vector<int32_t> lengths = {int32_t(boundary), int32_t(boundary + 1)};
    const int64_t half = rotary->half();
    std::vector<float> cos(size_t(2 * half)), sin(size_t(2 * half));
    REQUIRE(rotary->tables(positions.data(), 1, 2, lengths.data(), cos.data(), sin.data()).ok());
    std::vector<float> one_cos(static_cast<size_t>(half)), one_sin(static_cast<size_t>(half));
    REQUIRE(rope_tables(past->inv_freq, positions.data(), 1, 1, {}, one_cos.data(), one_sin.data(), past->attention_factor).ok());
    CHECK(std::vector<float>(cos.begin() + half, cos.end()) == one_cos);
    CHECK(std::vector<float>(cos.begin(), cos.begin() + half) != one_cos);
    // without lengths a length-dependent table is refused, not guessed
    CHECK_FALSE(rotary->tables(positions.data(), 1, 2, nullptr, cos.data(), sin.data()).ok());
  }
}

TEST_CASE("rope_step_lengths: each token gets its own sequence's max position + 1 in the step") {
  // two sequences: a 3-token prefill chunk at positions 5..7 and one decode token at position 40; an empty one
  const std::vector<int32_t> positions = {5, 6, 7, 40};
  const std::vector<int32_t> query_starts = {0, 3, 4, 4};
  std::vector<int32_t> lengths(4, -1);
  REQUIRE(rope_step_lengths(positions.data(), 4, query_starts.data(), 3, lengths.data()).ok());
  CHECK(lengths == std::vector<int32_t>{8, 8, 8, 41});
  const std::vector<int32_t> bad_starts = {0, 5};
  auto refused = rope_step_lengths(positions.data(), 4, bad_starts.data(), 1, lengths.data());
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message.find("lie outside the step's 4") != std::string::npos);
}

TEST_CASE("tiny llama and qwen2 models with each RoPE scaling: prefill logits equal transformers'") {
  double worst = 0;
  for (const std::string& name : model_names()) {
    CAPTURE(name);
    auto engine = open_model(name);
    const json reference = read_json(model_dir(name) + "/reference.json");
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      fx::Npy expected = fx::read_npy(model_dir(name) + "/" + prompt["logits_file"].get<std::string>());
      auto logits = engine->logits(fx::ids_of(prompt["input_ids"]));
      REQUIRE_MESSAGE(logits.ok(), logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      const double error = fx::relative_max_diff(logits->values, expected.values);
      CHECK(error <= kLogitsTolerance);
      worst = std::max(worst, error);
    }
  }
  MESSAGE("worst logits deviation, prompt in one step: " << worst);
}

TEST_CASE("tiny models with each RoPE scaling: the prompt one token per step equals transformers fed the same way") {
  // dynamic and longrope give other logits here than in one step (transformers too: each call's frequencies
  // follow its own seq_len, and cached keys keep theirs); the other types give the same.
  EngineOptions options;
  options.plan.max_batched_tokens = 1;
  double worst = 0;
  for (const std::string& name : model_names()) {
    CAPTURE(name);
    auto engine = open_model(name, options);
    const json reference = read_json(model_dir(name) + "/reference.json");
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      fx::Npy expected = fx::read_npy(model_dir(name) + "/" + prompt["token_by_token_logits_file"].get<std::string>());
      auto logits = engine->logits(fx::ids_of(prompt["input_ids"]));
      REQUIRE_MESSAGE(logits.ok(), logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      CHECK(engine->stats().steps >= expected.rows);
      const double error = fx::relative_max_diff(logits->values, expected.values);
      CHECK(error <= kLogitsTolerance);
      worst = std::max(worst, error);
    }
  }
  MESSAGE("worst logits deviation, prompt one token per step: " << worst);
}

TEST_CASE("tiny models with each RoPE scaling: a chunked prefill equals transformers fed the same chunks") {
  double worst = 0;
  for (const std::string& name : model_names()) {
    CAPTURE(name);
    const json reference = read_json(model_dir(name) + "/reference.json");
    const auto& prompt = reference["prompts"][0];  // the long one: 40 tokens in chunks of 7 across 24
    REQUIRE(prompt.contains("chunked_logits_file"));
    EngineOptions options;
    options.plan.max_batched_tokens = prompt["chunk"].get<int64_t>();
    auto engine = open_model(name, options);
    fx::Npy expected = fx::read_npy(model_dir(name) + "/" + prompt["chunked_logits_file"].get<std::string>());
    auto logits = engine->logits(fx::ids_of(prompt["input_ids"]));
    REQUIRE_MESSAGE(logits.ok(), logits.error().message);
    REQUIRE(logits->tokens == expected.rows);
    CHECK(engine->stats().steps == (expected.rows + options.plan.max_batched_tokens - 1) / options.plan.max_batched_tokens);
    const double error = fx::relative_max_diff(logits->values, expected.values);
    CHECK(error <= kLogitsTolerance);
    worst = std::max(worst, error);
  }
  MESSAGE("worst logits deviation, prompt in chunks of 7: " << worst);
}

TEST_CASE("tiny models with each RoPE scaling: greedy continuations equal transformers' generate()") {
  // The short prompt (16 tokens) crosses original_max_position_embeddings (24) while generating: longrope
  // switches to its long factors and dynamic recomputes its base at each new length.
  for (const std::string& name : model_names()) {
    CAPTURE(name);
    auto engine = open_model(name);
    const json reference = read_json(model_dir(name) + "/reference.json");
    for (const auto& prompt : reference["prompts"]) {
      CAPTURE(prompt["name"].get<std::string>());
      const auto& greedy = prompt["greedy"];
      SamplingParams params;  // temperature 0: greedy
      params.max_tokens = greedy["max_new_tokens"].get<int64_t>();
      auto generation = engine->generate(fx::ids_of(prompt["input_ids"]), params);
      REQUIRE_MESSAGE(generation.ok(), generation.error().message);
      std::string got;
      for (int32_t id : generation->ids) got += std::to_string(id) + " ";
      CAPTURE(got);
      CHECK(generation->ids == fx::ids_of(greedy["new_ids"]));
    }
  }
}

TEST_CASE("rope keys in both layouts give the same RopeConfig for every scaling type") {
  json base = read_json(model_dir("llama-yarn") + "/config.json");
  base.erase("rope_parameters");
  const std::vector<json> scalings = {
      {{"rope_type", "linear"}, {"factor", 4.0}},
      {{"type", "dynamic"}, {"factor", 2.0}},
      {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 24}, {"beta_fast", 8},
       {"beta_slow", 0.5}, {"mscale", 0.8}, {"mscale_all_dim", 0.5}, {"truncate", false}, {"attention_factor", 1.2}},
      {{"rope_type", "longrope"}, {"short_factor", std::vector<double>(8, 1.5)}, {"long_factor", std::vector<double>(8, 4.0)},
       {"original_max_position_embeddings", 24}},
  };
  for (const json& scaling : scalings) {
    CAPTURE(scaling.dump());
    json classic = base;
    classic["rope_theta"] = 20000.0;
    classic["rope_scaling"] = scaling;
    json v5 = base;
    v5["rope_parameters"] = scaling;
    v5["rope_parameters"]["rope_theta"] = 20000.0;
    const RopeConfig a = parse(classic).text.rope, b = parse(v5).text.rope;
    CHECK(a.type == b.type);
    CHECK(a.theta == 20000.0);
    CHECK(b.theta == 20000.0);
    CHECK(a.factor == b.factor);
    CHECK(a.original_max_position_embeddings == b.original_max_position_embeddings);
    CHECK(a.attention_factor == b.attention_factor);
    CHECK(a.beta_fast == b.beta_fast);
    CHECK(a.beta_slow == b.beta_slow);
    CHECK(a.mscale == b.mscale);
    CHECK(a.mscale_all_dim == b.mscale_all_dim);
    CHECK(a.truncate == b.truncate);
    CHECK(a.short_factor == b.short_factor);
    CHECK(a.long_factor == b.long_factor);
    CHECK(a.max_position_embeddings == base["max_position_embeddings"].get<int64_t>());
  }
  // a top-level original_max_position_embeddings (Phi-3's place for it) wins over the dict's
  json phi_style = base;
  phi_style["original_max_position_embeddings"] = 16;
  phi_style["rope_scaling"] = scalings[3];
  CHECK(parse(phi_style).text.rope.original_max_position_embeddings == 16);
  // partial_rotary_factor: top level (Phi-4-mini) or in the dict; the scaled types read it for every model
  json partial = base;
  partial["partial_rotary_factor"] = 0.5;
  partial["rope_scaling"] = scalings[0];
  CHECK(parse(partial).text.rope.partial_rotary_factor == 0.5);
  CHECK(rope_rotary_dim(parse(partial).text.rope, 16).value() == 8);
  // the default type is each model's own: Llama's rotates every dimension whatever the factor says, Phi-3's
  // int(head_dim * partial_rotary_factor) (their compute_default_rope_parameters)
  partial.erase("rope_scaling");
  CHECK(parse(partial).text.rope.partial_rotary_factor == 1.0);
  partial["model_type"] = "phi3";
  CHECK(parse(partial).text.rope.partial_rotary_factor == 0.5);
  CHECK(rope_rotary_dim(parse(partial).text.rope, 16).value() == 8);
  // Phi3Config's original_max_position_embeddings (4096 when the file has none) wins over the dict's
  partial.erase("partial_rotary_factor");
  partial["rope_scaling"] = scalings[3];  // its dict says 24
  CHECK(parse(partial).text.rope.original_max_position_embeddings == 4096);
}

TEST_CASE("RoPE config errors name the key and what to change") {
  json base = read_json(model_dir("llama-yarn") + "/config.json");
  base.erase("rope_parameters");
  SUBCASE("an unknown rope type, in either layout") {
    json classic = base;
    classic["rope_scaling"] = {{"rope_type", "proportional"}, {"factor", 2.0}};
    Error e = parse_failure(classic);
    CHECK(e.code == ErrorCode::unsupported);
    CHECK(mentions(e, "rope_scaling.rope_type 'proportional' is not supported"));
    CHECK(mentions(e, "default, linear, dynamic, yarn, longrope, llama3"));
    json legacy = base;
    legacy["rope_scaling"] = {{"type", "su"}};
    CHECK(mentions(parse_failure(legacy), "rope_scaling.type 'su'"));
    json v5 = base;
    v5["rope_parameters"] = {{"rope_type", "ntk-by-parts"}, {"rope_theta", 10000.0}};
    CHECK(parse_failure(v5).code == ErrorCode::unsupported);
    CHECK(mentions(parse_failure(v5), "rope_parameters.rope_type 'ntk-by-parts'"));
  }
  SUBCASE("linear and dynamic without a factor") {
    json doc = base;
    doc["rope_scaling"] = {{"rope_type", "dynamic"}};
    CHECK(mentions(parse_failure(doc), "rope_scaling.factor is missing"));
    doc["rope_scaling"] = {{"rope_type", "linear"}, {"factor", -2}};
    CHECK(mentions(parse_failure(doc), "rope_scaling.factor (-2) must be positive"));
  }
  SUBCASE("longrope factors of the wrong length or sign") {
    json doc = base;
    doc["rope_scaling"] = {{"rope_type", "longrope"}, {"short_factor", std::vector<double>(7, 1.0)},
                           {"long_factor", std::vector<double>(8, 1.0)}};
    Error e = parse_failure(doc);
    CHECK(e.code == ErrorCode::bad_format);
    CHECK(mentions(e, "rope_scaling.short_factor has 7 entries; it needs one per rotary frequency, rotary_dim / 2 = 8"));
    doc["rope_scaling"]["short_factor"] = std::vector<double>(8, 1.0);
    doc["rope_scaling"]["long_factor"][3] = 0;
    CHECK(mentions(parse_failure(doc), "rope_scaling.long_factor must hold positive numbers, not 0"));
    doc["rope_scaling"].erase("long_factor");
    CHECK(mentions(parse_failure(doc), "rope_scaling.long_factor is missing"));
  }
  SUBCASE("a partial_rotary_factor giving an odd or empty rotary dim") {
    json doc = base;
    doc["model_type"] = "phi3";  // whose default RoPE reads the factor
    doc["partial_rotary_factor"] = 0.3;  // int(16 * 0.3) = 4 is fine; 0.25 * 16 = 4 too; 0.1 -> 1
    CHECK(parse(doc).text.rope.partial_rotary_factor == 0.3);
    doc["partial_rotary_factor"] = 0.1;
    CHECK(mentions(parse_failure(doc), "partial_rotary_factor (0.1) gives rotary_dim int(16 * 0.1) = 1"));
    doc["partial_rotary_factor"] = 1.5;
    CHECK(mentions(parse_failure(doc), "partial_rotary_factor (1.5) must be in (0, 1]"));
  }
  SUBCASE("rope_frequencies refuses a type it does not know") {
    RopeConfig rope;
    rope.type = "proportional";
    auto frequencies = rope_frequencies(rope, 64);
    REQUIRE_FALSE(frequencies.ok());
    CHECK(frequencies.error().code == ErrorCode::unsupported);
    CHECK(frequencies.error().message.find("'proportional'") != std::string::npos);
  }
}

TEST_CASE("Qwen2.5-7B with its model card's YaRN (factor 4 on 32768) plans, up to 131072 tokens") {
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/models/qwen2.5-7b-instruct-yarn";
  auto inputs = read_plan_inputs(dir);
  REQUIRE_MESSAGE(inputs.ok(), inputs.error().message);
  const RopeConfig& rope = inputs->config.text.rope;
  CHECK(rope.type == "yarn");
  CHECK(rope.factor == 4.0);
  CHECK(rope.original_max_position_embeddings == 32768);
  CHECK(rope_context_length(rope, inputs->config.text.max_position_embeddings) == 131072);
  DeviceSpec card;
  card.backend = BackendKind::cuda;
  card.name = "planned 24.00 GiB card";
  card.total_bytes = 24 * GiB;
  PlanOptions options;
  options.max_model_len = 131072;
  auto plan = make_plan(*inputs, card, options);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  CHECK(plan->max_model_len == 131072);
  options.max_model_len = 131073;
  auto too_long = make_plan(*inputs, card, options);
  REQUIRE_FALSE(too_long.ok());
  CHECK(too_long.error().message.find("131072") != std::string::npos);

  // the command line, as a user runs it, at the full YaRN context: exit 0 (fits) or 1 (does not), never 2
  // (refused: max_model_len over the model's limit)
  const std::string command = std::string("'") + KVLITE_BINARY_DIR + "/kvlite' plan '" + dir +
                              "' --backend cuda --device-mem 24GiB --no-wsl2 --max-model-len 131072 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) out.append(buffer, n);
  const int status = pclose(pipe);
  CAPTURE(out);
  REQUIRE(WIFEXITED(status));
  CHECK((WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 1));
  CHECK(out.find("qwen2.5-7b-instruct-yarn") != std::string::npos);
  CHECK(out.find("131072") != std::string::npos);
}
