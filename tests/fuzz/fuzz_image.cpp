// libFuzzer harness: image bytes through decode_image (JPEG via libjpeg-turbo; PNG, BMP, TGA, GIF, PNM via
// stb_image) and, when they decode, Qwen3-VL preprocessing with a small pixel budget.
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvlite::DecodeOptions options;
  options.max_pixels = 1 << 20;  // the fuzzer's memory limit, not the library default
  options.alpha = size % 2 ? kvlite::AlphaMode::drop : kvlite::AlphaMode::composite_white;
  auto image = kvlite::decode_image(data, size, options, "fuzz image");
  fuzz::expect_typed(image, "decode_image");
  if (image.ok()) {
    kvlite::PreprocessOptions pre;
    pre.min_pixels = 32 * 32;
    pre.max_pixels = 128 * 128;
    fuzz::expect_typed(kvlite::preprocess_image(*image, pre), "preprocess_image");
  }
  return 0;
}
