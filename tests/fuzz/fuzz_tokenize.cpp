// libFuzzer harness: encode and streaming decode of arbitrary bytes and ids with the real Qwen2 and Llama-3
// tokenizers of tests/fixtures. Property: for valid UTF-8, decode(encode(x)) == NFC(x) where the tokenizer
// normalizes (Qwen2) and == x where it does not (Llama-3), streamed or whole.
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  const int which = in.byte() & 1;
  const kvlite::Tokenizer& t = fuzz::fixture_tokenizer(which);
  const std::string text = in.rest();
  auto ids = t.encode(text, false);
  fuzz::expect_typed(ids, "encode");
  if (ids.ok()) {
    auto whole = t.decode(*ids, false);
    if (!whole.ok()) abort();  // ids from encode always decode
    kvlite::StreamingDecoder stream(t, false);
    std::string streamed;
    for (int32_t id : *ids) streamed += stream.push(id).value();
    streamed += stream.flush();
    const std::string expected = which ? text : kvlite::detail::unicode_nfc(text);
    if (*whole != expected || streamed != expected) {
      fprintf(stderr, "round trip differs: %zu bytes in, %zu whole, %zu streamed\n", text.size(), whole->size(),
              streamed.size());
      abort();
    }
  }
  // the same bytes read as ids: decode refuses unknown ones with a typed error, never crashes
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 4 <= text.size(); i += 4) {
    int32_t id;
    memcpy(&id, text.data() + i, 4);
    raw.push_back(id % 200000);
  }
  fuzz::expect_typed(t.decode(raw, true), "decode");
  kvlite::StreamingDecoder stream(t, true);
  for (int32_t id : raw) fuzz::expect_typed(stream.push(id), "StreamingDecoder::push");
  (void)stream.flush();
  return 0;
}
