// libFuzzer harness: preprocessor_config.json text (apply_processor_config, what load_config does with the file)
// over a Qwen3-VL config, then the image path with what it loaded. A processor config that loads must preprocess
// every ordinary image into finite pixel values: issue 47 found image_mean 1e308 loaded and every image was then
// refused as if the image were at fault. The first byte picks the image's size.
#include <cmath>

#include "fuzz_support.hpp"

namespace {

const kvlite::ModelConfig& base_config() {
  static const std::string path = fuzz::source_dir() + "/tests/fixtures/configs/tiny-qwen3-vl.json";
  static const kvlite::ModelConfig config = kvlite::parse_config(kvlite::detail::read_text_file(path), path).value();
  return config;
}

kvlite::Image gradient(int64_t width, int64_t height) {
  kvlite::Image image;
  image.width = width;
  image.height = height;
  image.rgb.resize(size_t(width * height * 3));
  for (size_t i = 0; i < image.rgb.size(); i++) image.rgb[i] = uint8_t(i * 37 % 256);
  return image;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  const uint8_t shape = in.byte();
  auto loaded = kvlite::apply_processor_config(base_config(), in.rest(), "fuzz preprocessor_config.json");
  fuzz::expect_typed(loaded, "apply_processor_config");
  if (!loaded.ok()) return 0;
  const kvlite::PreprocessOptions options = kvlite::preprocess_options(*loaded);
  // Ordinary images (aspect ratio at most 8) get a grid under the budget the file set...
  const int64_t width = 16 + (shape & 15) * 40, height = 16 + (shape >> 4) * 40;
  auto grid = kvlite::image_grid(height, width, options);
  if (!grid.ok()) {
    fprintf(stderr, "a processor config that loaded gives no grid for %lld x %lld: %s\n", (long long)width,
            (long long)height, grid.error().message.c_str());
    abort();
  }
  // ...and, under the fuzzer's own smaller budget, finite pixel values.
  kvlite::PreprocessOptions small = options;
  small.max_pixels = std::min<int64_t>(small.max_pixels, 96 * 96);
  small.min_pixels = std::min<int64_t>(small.min_pixels, small.max_pixels);
  auto input = kvlite::preprocess_image(gradient(width % 97 + 8, height % 89 + 8), small);
  if (!input.ok()) {
    fprintf(stderr, "a processor config that loaded refuses an image: %s\n", input.error().message.c_str());
    abort();
  }
  for (float v : input->pixel_values)
    if (!std::isfinite(v)) {
      fprintf(stderr, "a processor config that loaded makes pixel values that are not finite\n");
      abort();
    }
  return 0;
}
