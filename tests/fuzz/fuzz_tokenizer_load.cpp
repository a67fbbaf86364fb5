// libFuzzer harness: tokenizer.json text (tokenizer_config.json from the input's first part), then a
// short encode / decode with whatever loaded.
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  std::string tokenizer_config = in.text(64);
  auto tokenizer = kvlite::Tokenizer::from_json(in.rest(), tokenizer_config);
  fuzz::expect_typed(tokenizer, "Tokenizer::from_json");
  if (tokenizer.ok()) {
    auto ids = tokenizer->encode("Hello, world! 123 \xE4\xBD\xA0\xE5\xA5\xBD", true);
    fuzz::expect_typed(ids, "encode");
    if (ids.ok()) fuzz::expect_typed(tokenizer->decode(*ids, false), "decode");
    fuzz::expect_typed(tokenizer->format_chat({{"user", "hi"}}, true), "format_chat");
  }
  return 0;
}
