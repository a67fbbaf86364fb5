// Shared by the libFuzzer harnesses: a tiny reader that turns the fuzzer's bytes into bounded values, and
// the trap for a kvlite bug (an `internal` error, which a hostile input must never produce).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include "kvlite.hpp"

namespace fuzz {

struct Bytes {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool empty() const { return at >= size; }
  uint8_t byte() { return at < size ? data[at++] : 0; }
  uint32_t u32() { return uint32_t(byte()) | uint32_t(byte()) << 8 | uint32_t(byte()) << 16 | uint32_t(byte()) << 24; }
  int64_t i64() { return int64_t(uint64_t(u32()) | uint64_t(u32()) << 32); }
  std::string text(size_t max) {  // a length byte, then that many bytes
    size_t n = std::min<size_t>(byte() % (max + 1), size - std::min(at, size));
    std::string s(reinterpret_cast<const char*>(data + at), n);
    at += n;
    return s;
  }
  std::string rest() {
    std::string s = at < size ? std::string(reinterpret_cast<const char*>(data + at), size - at) : std::string();
    at = size;
    return s;
  }
};

// kvlite answers hostile input with typed errors; `internal` means a bug (an exception that escaped a check).
template <class R>
void expect_typed(const R& result, const char* where) {
  if (!result.ok() && result.error().code == kvlite::ErrorCode::internal) {
    fprintf(stderr, "%s: internal error on hostile input: %s\n", where, result.error().message.c_str());
    abort();
  }
}

inline std::string source_dir() {
  const char* dir = getenv("KVLITE_SOURCE_DIR");
  return dir ? dir : KVLITE_SOURCE_DIR;
}

// The real Qwen2 (0) and Llama-3 (1) tokenizers of tests/fixtures/tokenizers, loaded once.
inline const kvlite::Tokenizer& fixture_tokenizer(int which) {
  static const kvlite::Tokenizer qwen = kvlite::Tokenizer::load(source_dir() + "/tests/fixtures/tokenizers/qwen2").value();
  static const kvlite::Tokenizer llama = kvlite::Tokenizer::load(source_dir() + "/tests/fixtures/tokenizers/llama3").value();
  return which ? llama : qwen;
}

}  // namespace fuzz
