// Test helper: the tiny fixture models of tests/fixtures/models (made by tools/make_fixtures.py with
// transformers) and their reference outputs, plus an independent .npy reader. Not part of the library.
#pragma once
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"

namespace model_fixtures {

// One per on-disk dtype and architecture: BF16 llama (llama3 RoPE scaling, untied lm_head), F32 qwen2 (q/k/v
// biases, tied), F16 qwen3 (q/k norms, head_dim 32 != hidden / heads).
inline const std::vector<std::string>& names() {
  static const std::vector<std::string> list = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3"};
  return list;
}

inline std::string dir(const std::string& name) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/" + name;
}

// The dense fixtures' directories and the W4A16 one's (tests/fixtures/quant/tiny-w4a16): the engine tests that
// run every kind of Linear against transformers.
inline std::vector<std::string> dense_and_w4a16_dirs() {
  std::vector<std::string> dirs;
  for (const std::string& name : names()) dirs.push_back(dir(name));
  dirs.push_back(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant/tiny-w4a16");
  return dirs;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// reference.json: prompts (input_ids, logits_file, prompt_logprobs, greedy) and perplexity.
inline nlohmann::json reference(const std::string& name) {
  return nlohmann::json::parse(read_file(dir(name) + "/reference.json"));
}

struct Npy {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;  // [rows, cols]
};

// A float32 2-D .npy (format 1.0, C order), parsed from the bytes without the library.
inline Npy read_npy(const std::string& path) {
  std::string bytes = read_file(path);
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0 || bytes[6] != 1 || bytes[7] != 0)
    throw std::runtime_error(path + ": not a version 1.0 .npy file");
  size_t header_len = size_t(uint8_t(bytes[8])) | size_t(uint8_t(bytes[9])) << 8;
  std::string header = bytes.substr(10, header_len);
  if (header.find("'descr': '<f4'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos)
    throw std::runtime_error(path + ": not little-endian float32 in C order: " + header);
  Npy npy;
  long long rows = 0, cols = 0;
  size_t shape = header.find("'shape': (");
  if (shape == std::string::npos || sscanf(header.c_str() + shape, "'shape': (%lld, %lld)", &rows, &cols) != 2)
    throw std::runtime_error(path + ": no 2-D shape in " + header);
  npy.rows = rows;
  npy.cols = cols;
  size_t data = 10 + header_len;
  if (bytes.size() != data + size_t(rows * cols) * 4) throw std::runtime_error(path + ": size does not match the shape");
  npy.values.resize(size_t(rows * cols));
  memcpy(npy.values.data(), bytes.data() + data, npy.values.size() * 4);
  return npy;
}

// max |a - b| / max |reference|: how the fixture's tolerance is stated.
inline double relative_max_diff(const std::vector<float>& values, const std::vector<float>& reference) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < reference.size(); i++) {
    diff = std::max(diff, std::fabs(double(values[i]) - double(reference[i])));
    scale = std::max(scale, std::fabs(double(reference[i])));
  }
  return diff / scale;
}

// An engine on the CPU with a small budget (the default would reserve 90% of this machine's memory).
inline std::unique_ptr<kvlite::Engine> open(const std::string& name, kvlite::EngineOptions options = {}) {
  if (!options.plan.device_mem) options.plan.device_mem = 64 * kvlite::MiB;
  // The fixtures' references are the CPU's float32 results: auto (EngineOptions' default) means the CPU here; a
  // test that wants the GPU names cuda.
  if (options.backend == kvlite::BackendChoice::auto_) options.backend = kvlite::BackendChoice::cpu;
  auto engine = kvlite::Engine::open(dir(name), options);
  if (!engine) throw std::runtime_error("open " + name + ": " + engine.error().message);
  return std::move(*engine);
}

inline std::vector<int32_t> ids_of(const nlohmann::json& value) { return value.get<std::vector<int32_t>>(); }

// The fixture's prompts (appended to *prompts) and transformers' greedy continuation of each (returned).
inline std::vector<std::vector<int32_t>> reference_greedy(const std::string& name,
                                                          std::vector<std::vector<int32_t>>* prompts) {
  std::vector<std::vector<int32_t>> greedy;
  const nlohmann::json fixture = reference(name);  // (not iterated as a temporary: it would dangle)
  for (const auto& p : fixture["prompts"]) {
    prompts->push_back(ids_of(p["input_ids"]));
    greedy.push_back(ids_of(p["greedy"]["new_ids"]));
  }
  return greedy;
}


// A plan's JSON with a discrete GPU's free memory zeroed: free_bytes is read when each plan queries the GPU, so
// two plans of the same options differ in it alone (it decides nothing there; an integrated GPU plans against
// it, and keeps it).
inline std::string plan_json_for_comparison(const std::string& json) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(json);
  if (j["device"]["backend"] == "cuda" && j["device"]["queried"] == true && j["device"]["integrated"] == false)
    j["device"]["free_bytes"] = 0;
  return j.dump(2);
}

}  // namespace model_fixtures
