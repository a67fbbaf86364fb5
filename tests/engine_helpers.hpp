// Test helper shared by the engine suites: greedy sampling parameters, and the check that every KV page is back
// in the pool. Not part of the library.
#pragma once
#include <cstdint>
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

}  // namespace engine_helpers
