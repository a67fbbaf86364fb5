// Test helper shared by the engine suites: greedy sampling parameters, the check that every KV page is back in
// the pool, and the example images' captions. Not part of the library.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>
#include <doctest/doctest.h>
#include "kvlite.hpp"

namespace engine_helpers {

inline kvlite::SamplingParams greedy(int64_t max_tokens = 16) {
  kvlite::SamplingParams params;
  params.max_tokens = max_tokens;
  return params;
}

// Every page back in the pool: nothing leaked by finished, preempted or cancelled requests.
inline void check_pool_empty(const kvlite::Engine& engine) {
  const kvlite::KVPagePool::Stats stats = engine.arena().kv().stats();
  CHECK(stats.used_pages == 0);
  CHECK(stats.live_sequences == 0);
}

// The example images and their captions (examples/images/captions.txt, "<file>\t<caption>" per line), in order.
inline std::vector<std::pair<std::string, std::string>> example_captions() {
  std::vector<std::pair<std::string, std::string>> examples;
  std::ifstream in(std::string(KVLITE_SOURCE_DIR) + "/examples/images/captions.txt");
  for (std::string line; std::getline(in, line);)
    if (line.find('\t') != std::string::npos)
      examples.emplace_back(line.substr(0, line.find('\t')), line.substr(line.find('\t') + 1));
  return examples;
}

}  // namespace engine_helpers
