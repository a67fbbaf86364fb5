// libFuzzer harness: a caller-built VisionInput (grid, token count, row size, pixel buffer) through the
// engine of the tiny Qwen3-VL fixture on the CPU backend: encode_images, and logits with a placeholder prompt.
#include <cmath>
#include "fuzz_support.hpp"

namespace {
kvlite::Engine& engine() {
  static std::unique_ptr<kvlite::Engine> e = [] {
    kvlite::EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.device_mem = 64 * kvlite::MiB;
    options.plan.max_images = 2;
    auto opened = kvlite::Engine::open(fuzz::source_dir() + "/tests/fixtures/vl/tiny-qwen3-vl", options);
    if (!opened) {
      fprintf(stderr, "cannot open the fixture: %s\n", opened.error().message.c_str());
      abort();
    }
    return std::move(*opened);
  }();
  return *e;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  std::vector<kvlite::VisionInput> images(1 + in.byte() % 2);
  for (auto& image : images) {
    image.grid.grid_t = int64_t(in.byte() % 3);
    image.grid.grid_h = int64_t(in.byte() % 16) - 2;
    image.grid.grid_w = int64_t(in.byte() % 16) - 2;
    image.grid.image_tokens = int64_t(in.byte()) - 4;
    image.row_size = (in.byte() & 1) ? 1536 : int64_t(in.byte()) * 8;
    const size_t values = size_t(in.u32() % 300000);
    image.pixel_values.resize(values);
    for (size_t i = 0; i < values; i++) image.pixel_values[i] = float(int(i % 97) - 48) / 48.0f;
    if (in.byte() == 7 && values) image.pixel_values[values / 2] = NAN;
  }
  kvlite::Engine& e = engine();
  fuzz::expect_typed(e.encode_images(images), "encode_images");
  const int32_t pad = e.tokenizer().token_id("<|image_pad|>");
  std::vector<int32_t> ids = {100, pad, 101};
  if (images.size() == 2) ids.push_back(pad);
  fuzz::expect_typed(e.logits(ids, images), "logits");
  return 0;
}
