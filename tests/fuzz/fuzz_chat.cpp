// libFuzzer harness: chat messages (roles and contents from the input) formatted by the ChatML and Llama-3
// formats, encoded, and the image placeholders in the result placed with fuzzed image grids (M-RoPE).
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  const kvlite::Tokenizer& t = fuzz::fixture_tokenizer(in.byte() & 1);
  std::vector<kvlite::ChatMessage> messages;
  const int count = in.byte() % 6;
  for (int i = 0; i < count; i++) {
    kvlite::ChatMessage m;
    m.role = in.text(12);
    m.content = in.text(200);
    messages.push_back(std::move(m));
  }
  auto prompt = t.format_chat(messages, in.byte() & 1);
  fuzz::expect_typed(prompt, "format_chat");
  if (!prompt.ok()) return 0;
  auto ids = t.encode(*prompt, false);
  fuzz::expect_typed(ids, "encode");
  if (!ids.ok() || ids->empty()) return 0;
  // a fuzzed token stands for the image placeholder, with fuzzed grids
  const int32_t pad = (*ids)[in.byte() % ids->size()];
  std::vector<kvlite::ImageGrid> grids(in.byte() % 4);
  for (auto& g : grids) {
    g.grid_t = in.byte() % 3;
    g.grid_h = int64_t(in.byte()) - 8;
    g.grid_w = int64_t(in.byte()) - 8;
    g.image_tokens = int64_t(in.u32() % 5000) - 10;
  }
  fuzz::expect_typed(kvlite::mrope_positions(*ids, pad, grids, 2), "mrope_positions");
  return 0;
}
