// The image path against transformers' Qwen2-VL/Qwen3-VL image processor and the decoders it uses.
// Every expected value comes from tests/fixtures/images/cases.json and the files beside it, made by
// tools/make_image_fixtures.py (transformers 5.23, torchvision 0.29, Pillow 13).
#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "safetensors_writer.hpp"

using namespace kvlite;
using nlohmann::json;

namespace {

const std::string kDir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/images/";

const json& cases() {
  static const json data = [] {
    std::ifstream in(kDir + "cases.json");
    REQUIRE_MESSAGE(in.good(), "missing " << kDir << "cases.json (tools/make_image_fixtures.py makes it)");
    return json::parse(in);
  }();
  return data;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  REQUIRE(out.good());
}

// FNV-1a 64 as 16 hex digits, as make_image_fixtures.py computes it over the RGB bytes.
std::string fnv1a64(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  char text[17];
  snprintf(text, sizeof(text), "%016llx", (unsigned long long)h);
  return text;
}

// The fixture maker's seeded inputs: the top byte of successive splitmix64 outputs.
std::vector<uint8_t> splitmix_bytes(uint64_t seed, size_t count) {
  std::vector<uint8_t> out(count);
  uint64_t state = seed;
  for (auto& byte : out) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    byte = uint8_t(z >> 56);
  }
  return out;
}

// A truth image recorded as {file?, height, width, fnv1a64}: decoded by kvlite (PNG) and proven exact by the
// checksum before it is used as a reference.
Image load_truth(const json& truth) {
  auto image = load_image(kDir + truth["file"].get<std::string>());
  REQUIRE_MESSAGE(image.ok(), image.error().message);
  REQUIRE(image->height == truth["height"].get<int64_t>());
  REQUIRE(image->width == truth["width"].get<int64_t>());
  REQUIRE_MESSAGE(fnv1a64(image->rgb) == truth["fnv1a64"].get<std::string>(),
                  "the PNG decoder did not reproduce " << truth["file"].get<std::string>() << " exactly");
  return *image;
}

struct Difference {
  int max = 0;
  double mean = 0;
};
Difference difference(const Image& a, const Image& b) {
  REQUIRE(a.width == b.width);
  REQUIRE(a.height == b.height);
  Difference d;
  double total = 0;
  for (size_t i = 0; i < a.rgb.size(); i++) {
    int delta = std::abs(int(a.rgb[i]) - int(b.rgb[i]));
    d.max = std::max(d.max, delta);
    total += delta;
  }
  d.mean = a.rgb.empty() ? 0 : total / double(a.rgb.size());
  return d;
}

Image noise_image(uint64_t seed, int64_t height, int64_t width) {
  Image image;
  image.height = height;
  image.width = width;
  image.rgb = splitmix_bytes(seed, size_t(height * width * 3));
  return image;
}

// The decode entry of cases.json for this file.
const json& decode_entry(const std::string& file) {
  for (const auto& entry : cases()["decode"])
    if (entry["file"] == file) return entry;
  FAIL("no decode entry for " << file);
  static json none;
  return none;
}

std::string temp_path(const std::string& name) { return std::string(KVLITE_BINARY_DIR) + "/unit-image-" + name; }

// A PNG that holds only a signature and an IHDR chunk claiming width x height RGB pixels.
std::vector<uint8_t> png_header_only(uint32_t width, uint32_t height) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
  for (uint32_t v : {width, height})
    for (int shift = 24; shift >= 0; shift -= 8) png.push_back(uint8_t(v >> shift));
  for (uint8_t b : {8, 2, 0, 0, 0}) png.push_back(b);  // 8 bits, RGB, deflate, no filter, no interlace
  for (int i = 0; i < 4; i++) png.push_back(0);       // CRC (stb_image does not check it)
  return png;
}

}  // namespace

TEST_CASE("smart_resize matches transformers on every recorded case, errors included") {
  int checked = 0, errors = 0;
  for (const auto& c : cases()["smart_resize"]) {
    const int64_t h = c["height"], w = c["width"], factor = c["factor"], mn = c["min_pixels"], mx = c["max_pixels"];
    CAPTURE(h);
    CAPTURE(w);
    CAPTURE(factor);
    CAPTURE(mn);
    CAPTURE(mx);
    auto got = smart_resize(h, w, factor, mn, mx);
    if (c.contains("error")) {
      REQUIRE_FALSE(got.ok());
      CHECK(got.error().code == ErrorCode::invalid_argument);
      CHECK(got.error().message.find("aspect ratio") != std::string::npos);
      errors++;
    } else {
      REQUIRE_MESSAGE(got.ok(), got.error().message);
      CHECK(got->first == c["resized_height"].get<int64_t>());
      CHECK(got->second == c["resized_width"].get<int64_t>());
      if (factor == 32) {  // the same through image_grid with Qwen3-VL's patch 16 x merge 2
        PreprocessOptions options;
        options.min_pixels = mn;
        options.max_pixels = mx;
        auto grid = image_grid(h, w, options);
        REQUIRE(grid.ok());
        CHECK(grid->grid_t == 1);
        CHECK(grid->grid_h == got->first / 16);
        CHECK(grid->grid_w == got->second / 16);
        CHECK(grid->image_tokens == got->first * got->second / 1024);
      }
    }
    checked++;
  }
  CHECK(checked > 150);
  CHECK(errors >= 6);
}

TEST_CASE("smart_resize names the aspect ratio it refuses, and refuses bad budgets") {
  auto wide = smart_resize(1, 201, 32, 65536, 16777216);
  REQUIRE_FALSE(wide.ok());
  CHECK(wide.error().message.find("201") != std::string::npos);
  CHECK(smart_resize(1, 200, 32, 65536, 16777216).ok());  // exactly 200 is allowed, as in transformers
  CHECK(smart_resize(0, 10, 32, 1, 100).error().code == ErrorCode::invalid_argument);
  CHECK(smart_resize(10, 10, 0, 1, 100).error().code == ErrorCode::invalid_argument);
  CHECK(smart_resize(10, 10, 32, 0, 100).error().code == ErrorCode::invalid_argument);
  auto inverted = smart_resize(10, 10, 32, 200, 100);
  REQUIRE_FALSE(inverted.ok());
  CHECK(inverted.error().message.find("below min_pixels") != std::string::npos);
}

TEST_CASE("resize_bicubic_aa is bit-exact with torchvision's antialiased bicubic on seeded noise") {
  int checked = 0;
  for (const auto& c : cases()["resize"]) {
    const Image source = noise_image(c["seed"], c["height"], c["width"]);
    REQUIRE_MESSAGE(fnv1a64(source.rgb) == c["source_fnv1a64"].get<std::string>(), "the seeded input differs");
    const Image truth = load_truth(c["resized"]);
    CAPTURE(truth.height);
    CAPTURE(truth.width);
    CAPTURE(source.height);
    CAPTURE(source.width);
    auto resized = resize_bicubic_aa(source, truth.height, truth.width);
    REQUIRE_MESSAGE(resized.ok(), resized.error().message);
    const Difference d = difference(*resized, truth);
    CHECK_MESSAGE(d.max == 0, "max difference " << d.max << ", mean " << d.mean);
    checked++;
  }
  CHECK(checked >= 10);
}

TEST_CASE("preprocess_image matches the Qwen3-VL processor: grid, resized image and pixel_values") {
  int with_pixel_values = 0;
  for (const auto& c : cases()["processor_cases"]) {
    const std::string name = c["name"], file = c["file"];
    CAPTURE(name);
    // What the processor saw: the file as its loader decodes it. Lossless files are decoded by kvlite (and
    // must match exactly); for a JPEG the reference decoder's pixels stand in, so that this test is about
    // preprocessing only (decoder differences are the decode tests' business).
    const json& decoded = decode_entry(file);
    Image input;
    if (decoded["exact"].get<bool>()) {
      auto image = load_image(kDir + file);
      REQUIRE_MESSAGE(image.ok(), image.error().message);
      REQUIRE(fnv1a64(image->rgb) == decoded["truth"]["fnv1a64"].get<std::string>());
      input = *image;
    } else {
      input = load_truth(decoded["truth"]);
    }
    PreprocessOptions options;  // Qwen3-VL's, with the case's budget
    options.min_pixels = c["min_pixels"];
    options.max_pixels = c["max_pixels"];
    auto result = preprocess_image(input, options);
    REQUIRE_MESSAGE(result.ok(), result.error().message);
    const auto& grid_thw = c["grid_thw"];
    CHECK(result->grid.grid_t == grid_thw[0].get<int64_t>());
    CHECK(result->grid.grid_h == grid_thw[1].get<int64_t>());
    CHECK(result->grid.grid_w == grid_thw[2].get<int64_t>());
    CHECK(result->grid.image_tokens == c["image_tokens"].get<int64_t>());
    CHECK(result->row_size == c["pixel_values_shape"][1].get<int64_t>());
    CHECK(result->rows() == c["pixel_values_shape"][0].get<int64_t>());

    const Image truth = load_truth(c["resized"]);
    CHECK(result->grid.resized_height == truth.height);
    CHECK(result->grid.resized_width == truth.width);
    auto resized = resize_bicubic_aa(input, truth.height, truth.width);
    REQUIRE(resized.ok());
    const Difference d = difference(*resized, truth);
    CHECK_MESSAGE(d.max == 0, "resized image: max difference " << d.max << ", mean " << d.mean);

    if (c.contains("pixel_values")) {
      const model_fixtures::Npy npy = model_fixtures::read_npy(kDir + c["pixel_values"].get<std::string>());
      REQUIRE(std::vector<int64_t>{npy.rows, npy.cols} == std::vector<int64_t>{result->rows(), result->row_size});
      const std::vector<float>& expected = npy.values;
      float worst = 0;
      size_t worst_at = 0;
      for (size_t i = 0; i < expected.size(); i++) {
        float delta = std::fabs(expected[i] - result->pixel_values[i]);
        if (delta > worst) worst = delta, worst_at = i;
      }
      // Same float32 operations as transformers: bit-exact (one uint8 step would be 2/255).
      CHECK_MESSAGE(worst == 0.0f, "pixel_values differ by up to " << worst << " at row " << worst_at / 1536
                                                                   << ", element " << worst_at % 1536);
      with_pixel_values++;
    }
  }
  CHECK(with_pixel_values == 2);
}

TEST_CASE("patch rows follow 2x2 merge windows in raster order, each row ordered channel, frame, y, x") {
  // A 64 x 96 image whose pixels spell their coordinates; the budget keeps its size, so no resize.
  Image image;
  image.height = 64;
  image.width = 96;
  for (int64_t y = 0; y < 64; y++)
    for (int64_t x = 0; x < 96; x++)
      for (uint8_t v : {uint8_t(x), uint8_t(y), uint8_t(x + 2 * y)}) image.rgb.push_back(v);
  PreprocessOptions options;
  options.min_pixels = options.max_pixels = 64 * 96;
  auto input = preprocess_image(image, options);
  REQUIRE(input.ok());
  REQUIRE(input->grid.grid_h == 4);
  REQUIRE(input->grid.grid_w == 6);
  REQUIRE(input->rows() == 24);
  auto value = [](int v) { return (float(v) - 127.5f) / 127.5f; };
  for (int64_t row = 0; row < 24; row++) {
    // Row = (window_row * (grid_w / 2) + window_col) * 4 + in_row * 2 + in_col.
    const int64_t window = row / 4, window_row = window / 3, window_col = window % 3;
    const int64_t patch_row = window_row * 2 + (row % 4) / 2, patch_col = window_col * 2 + row % 2;
    const float* values = &input->pixel_values[size_t(row * 1536)];
    for (int c = 0; c < 3; c++)
      for (int t = 0; t < 2; t++)
        for (int y = 0; y < 16; y++)
          for (int x = 0; x < 16; x++) {
            const int px = int(patch_col * 16 + x), py = int(patch_row * 16 + y);
            const int expected = c == 0 ? px : c == 1 ? py : uint8_t(px + 2 * py);
            REQUIRE(values[((c * 2 + t) * 16 + y) * 16 + x] == value(expected));
          }
  }
  CHECK(input->grid.image_tokens == 6);
}

TEST_CASE("lossless formats decode exactly as the reference decoders: PNG, gray, BMP, TGA, GIF, PNM, EXIF") {
  int checked = 0;
  for (const auto& entry : cases()["decode"]) {
    if (!entry["exact"].get<bool>()) continue;
    const std::string file = entry["file"];
    CAPTURE(file);
    auto image = load_image(kDir + file);
    REQUIRE_MESSAGE(image.ok(), image.error().message);
    CHECK(image->height == entry["truth"]["height"].get<int64_t>());
    CHECK(image->width == entry["truth"]["width"].get<int64_t>());
    CHECK(fnv1a64(image->rgb) == entry["truth"]["fnv1a64"].get<std::string>());
    // From memory: the same pixels.
    const std::vector<uint8_t> bytes = read_bytes(kDir + file);
    auto from_memory = decode_image(bytes.data(), bytes.size(), {}, file);
    REQUIRE(from_memory.ok());
    CHECK(from_memory->rgb == image->rgb);
    checked++;
  }
  CHECK(checked >= 16);
}

TEST_CASE("JPEG decodes to torchvision's pixels (both are libjpeg-turbo: islow IDCT, fancy upsampling): 4:4:4, 4:2:2, 4:2:0, progressive, gray, CMYK, EXIF") {
  int checked = 0;
  for (const auto& entry : cases()["decode"]) {
    if (entry["exact"].get<bool>()) continue;
    const std::string file = entry["file"];
    CAPTURE(file);
    auto image = load_image(kDir + file);
    REQUIRE_MESSAGE(image.ok(), image.error().message);
    const Difference d = difference(*image, load_truth(entry["truth"]));  // also checks EXIF-rotated sizes
    // stb_image 2.27 was off by up to 3 levels (mean 0.06 and 0.10) from this reference.
    CHECK_MESSAGE(d.max == 0, "max difference " << d.max);
    // From memory: the same pixels.
    const std::vector<uint8_t> bytes = read_bytes(kDir + file);
    auto from_memory = decode_image(bytes.data(), bytes.size(), {}, file);
    REQUIRE(from_memory.ok());
    CHECK(from_memory->rgb == image->rgb);
    checked++;
  }
  CHECK(checked == 8);
}

TEST_CASE("EXIF orientation can be left unapplied") {
  DecodeOptions raw;
  raw.exif_orientation = false;
  auto upright = load_image(kDir + "orient_1_7x5.png");
  REQUIRE(upright.ok());
  for (int orientation = 2; orientation <= 8; orientation++) {
    CAPTURE(orientation);
    auto image = load_image(kDir + "orient_" + std::to_string(orientation) + "_7x5.png", raw);
    REQUIRE(image.ok());
    CHECK(image->width == 7);
    CHECK(image->height == 5);
    CHECK(image->rgb == upright->rgb);  // the same stored pixels, only the tag differs
  }
}

TEST_CASE("alpha: dropped for files, composited onto white for raw RGBA, as the processor does") {
  const json& composite = cases()["composite"];
  const Image composited = load_truth(composite["truth"]);
  const Image dropped = *load_image(kDir + composite["source"].get<std::string>());
  CHECK(fnv1a64(dropped.rgb) == decode_entry(composite["source"])["truth"]["fnv1a64"].get<std::string>());
  CHECK(difference(dropped, composited).max > 100);  // the fixture has transparent pixels: the modes differ

  DecodeOptions blend;
  blend.alpha = AlphaMode::composite_white;
  auto decoded = load_image(kDir + composite["source"].get<std::string>(), blend);
  REQUIRE(decoded.ok());
  CHECK(fnv1a64(decoded->rgb) == composite["truth"]["fnv1a64"].get<std::string>());

  const std::vector<uint8_t> rgba = read_bytes(kDir + composite["raw_rgba"].get<std::string>());
  const int64_t height = composite["height"], width = composite["width"];
  REQUIRE(rgba.size() == size_t(height * width * 4));
  auto raw = image_from_pixels(rgba.data(), width, height, PixelFormat::rgba8);
  REQUIRE(raw.ok());
  CHECK(fnv1a64(raw->rgb) == composite["truth"]["fnv1a64"].get<std::string>());
  auto raw_dropped = image_from_pixels(rgba.data(), width, height, PixelFormat::rgba8, 0, AlphaMode::drop);
  REQUIRE(raw_dropped.ok());
  CHECK(raw_dropped->rgb == dropped.rgb);

  // BGRA with 12 bytes of padding per row: the same image.
  const int64_t stride = width * 4 + 12;
  std::vector<uint8_t> bgra(size_t(height * stride), 0xAB);
  for (int64_t y = 0; y < height; y++)
    for (int64_t x = 0; x < width; x++) {
      const uint8_t* p = &rgba[size_t((y * width + x) * 4)];
      uint8_t* q = &bgra[size_t(y * stride + x * 4)];
      q[0] = p[2], q[1] = p[1], q[2] = p[0], q[3] = p[3];
    }
  auto from_bgra = image_from_pixels(bgra.data(), width, height, PixelFormat::bgra8, stride);
  REQUIRE(from_bgra.ok());
  CHECK(from_bgra->rgb == raw->rgb);
}

TEST_CASE("image_from_pixels: RGB, BGR and gray buffers with strides") {
  const int64_t width = 5, height = 3;
  const std::vector<uint8_t> rgb = splitmix_bytes(7, size_t(width * height * 3));
  auto packed = image_from_pixels(rgb.data(), width, height, PixelFormat::rgb8);
  REQUIRE(packed.ok());
  CHECK(packed->rgb == rgb);
  std::vector<uint8_t> bgr(size_t(height * 20), 0);  // stride 20 > 15
  for (int64_t y = 0; y < height; y++)
    for (int64_t x = 0; x < width; x++)
      for (int c = 0; c < 3; c++) bgr[size_t(y * 20 + x * 3 + c)] = rgb[size_t((y * width + x) * 3 + 2 - c)];
  auto from_bgr = image_from_pixels(bgr.data(), width, height, PixelFormat::bgr8, 20);
  REQUIRE(from_bgr.ok());
  CHECK(from_bgr->rgb == rgb);
  const std::vector<uint8_t> gray = splitmix_bytes(8, size_t(width * height));
  auto from_gray = image_from_pixels(gray.data(), width, height, PixelFormat::gray8);
  REQUIRE(from_gray.ok());
  for (size_t p = 0; p < gray.size(); p++)
    for (int c = 0; c < 3; c++) CHECK(from_gray->rgb[p * 3 + size_t(c)] == gray[p]);
}

TEST_CASE("unsupported formats are refused by name") {
  const uint8_t webp[] = {'R', 'I', 'F', 'F', 0x24, 0, 0, 0, 'W', 'E', 'B', 'P', 'V', 'P', '8', ' ', 0, 0, 0, 0};
  auto a = decode_image(webp, sizeof(webp), {}, "cat.webp");
  REQUIRE_FALSE(a.ok());
  CHECK(a.error().code == ErrorCode::unsupported);
  CHECK(a.error().message.find("cat.webp") != std::string::npos);
  CHECK(a.error().message.find("WebP") != std::string::npos);
  const uint8_t tiff[] = {'I', 'I', '*', 0, 8, 0, 0, 0, 0, 0};
  CHECK(decode_image(tiff, sizeof(tiff)).error().code == ErrorCode::unsupported);
  const std::vector<uint8_t> noise = splitmix_bytes(99, 300);  // nothing in particular
  auto b = decode_image(noise.data(), noise.size(), {}, "noise.bin");
  REQUIRE_FALSE(b.ok());
  CHECK(b.error().code == ErrorCode::unsupported);
  CHECK(b.error().message.find("JPEG, PNG") != std::string::npos);
  auto empty = decode_image(noise.data(), 0, {}, "empty.png");
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.error().code == ErrorCode::bad_format);
  auto missing = load_image(kDir + "no-such-image.png");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == ErrorCode::io_error);
  CHECK(missing.error().message.find("no-such-image.png") != std::string::npos);
}

TEST_CASE("truncated PNG and JPEG files are refused, naming the file") {
  for (const char* file : {"photo_67x45.png", "photo_300x200.jpg", "tall_31x97.bmp"}) {
    CAPTURE(file);
    const std::vector<uint8_t> bytes = read_bytes(kDir + file);
    const std::string path = temp_path(std::string("truncated-") + file);
    write_bytes(path, bytes.data(), bytes.size() * 6 / 10);
    auto image = load_image(path);
    std::remove(path.c_str());
    REQUIRE_FALSE(image.ok());
    CHECK(image.error().code == ErrorCode::bad_format);
    CHECK(image.error().message.find(path) != std::string::npos);
    CHECK(image.error().message.find("truncated") != std::string::npos);
  }
}

TEST_CASE("decompression bombs are refused from the header, before decoding") {
  // 10000 x 10000 claimed by 33 bytes: over the default 64 Mi pixel limit.
  const std::vector<uint8_t> bomb = png_header_only(10000, 10000);
  auto refused = decode_image(bomb.data(), bomb.size(), {}, "bomb.png");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(refused.error().message.find("10000 x 10000") != std::string::npos);
  CHECK(refused.error().message.find("max_pixels") != std::string::npos);
  // Under a raised limit the same bytes reach the decoder, which finds no pixel data.
  DecodeOptions generous;
  generous.max_pixels = int64_t(1) << 30;
  auto corrupt = decode_image(bomb.data(), bomb.size(), generous, "bomb.png");
  REQUIRE_FALSE(corrupt.ok());
  CHECK(corrupt.error().code == ErrorCode::bad_format);
  // Dimensions within our limit but beyond stb_image's own: a corrupt header, reported with its numbers.
  const std::vector<uint8_t> huge = png_header_only(1000000, 1000000);
  auto over_limit = decode_image(huge.data(), huge.size(), generous, "huge.png");
  REQUIRE_FALSE(over_limit.ok());
  CHECK(over_limit.error().code == ErrorCode::invalid_argument);
  DecodeOptions unlimited;
  unlimited.max_pixels = int64_t(1) << 42;
  auto too_large = decode_image(huge.data(), huge.size(), unlimited, "huge.png");
  REQUIRE_FALSE(too_large.ok());
  CHECK(too_large.error().code == ErrorCode::bad_format);
  CHECK(too_large.error().message.find("claims 1000000 x 1000000") != std::string::npos);
  // A real file over a lowered limit.
  DecodeOptions strict;
  strict.max_pixels = 3000;  // photo_67x45.png has 3015
  auto small = load_image(kDir + "photo_67x45.png", strict);
  REQUIRE_FALSE(small.ok());
  CHECK(small.error().code == ErrorCode::invalid_argument);
  CHECK(small.error().message.find("67 x 45") != std::string::npos);
  strict.max_pixels = 3015;
  CHECK(load_image(kDir + "photo_67x45.png", strict).ok());
}

TEST_CASE("zero-size images are refused: an empty file, headers that claim no pixels, an empty Image") {
  const std::string path = temp_path("empty.png");
  write_bytes(path, nullptr, 0);
  auto empty = load_image(path);
  std::remove(path.c_str());
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.error().code == ErrorCode::bad_format);
  CHECK(empty.error().message.find(path + ": no image data (0 bytes)") != std::string::npos);
  // A PNG whose IHDR claims 0 x 13 (stb_image refuses it too) and one claiming 17 x 0.
  for (const auto& size : {std::make_pair(0u, 13u), std::make_pair(17u, 0u)}) {
    const std::vector<uint8_t> png = png_header_only(size.first, size.second);
    auto refused = decode_image(png.data(), png.size(), {}, "nothing.png");
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.error().code == ErrorCode::bad_format);
    const std::string claimed = std::to_string(size.first) + " x " + std::to_string(size.second);
    CHECK_MESSAGE(refused.error().message.find("nothing.png: the PNG header claims " + claimed + " pixels") !=
                      std::string::npos,
                  refused.error().message);
  }
  // A BMP of width 0: the real file's header with biWidth zeroed.
  std::vector<uint8_t> bmp = read_bytes(kDir + "tall_31x97.bmp");
  for (size_t at = 18; at < 22; at++) bmp[at] = 0;
  auto zero_wide = decode_image(bmp.data(), bmp.size(), {}, "zero.bmp");
  REQUIRE_FALSE(zero_wide.ok());
  CHECK(zero_wide.error().code == ErrorCode::bad_format);
  CHECK_MESSAGE(zero_wide.error().message.find("0 x 97") != std::string::npos, zero_wide.error().message);
  // Decoded images of no pixels never reach the resize.
  auto no_pixels = preprocess_image(Image{}, PreprocessOptions{});
  REQUIRE_FALSE(no_pixels.ok());
  CHECK(no_pixels.error().code == ErrorCode::invalid_argument);
  CHECK(no_pixels.error().message.find("the image is 0 x 0") != std::string::npos);
  CHECK(image_grid(0, 5, PreprocessOptions{}).error().code == ErrorCode::invalid_argument);
}

TEST_CASE("bad raw images, sizes and options are refused with the numbers") {
  const uint8_t pixel[4] = {1, 2, 3, 4};
  auto zero = image_from_pixels(pixel, 0, 1, PixelFormat::rgb8);
  REQUIRE_FALSE(zero.ok());
  CHECK(zero.error().code == ErrorCode::invalid_argument);
  CHECK(zero.error().message.find("0 x 1") != std::string::npos);
  CHECK(image_from_pixels(nullptr, 1, 1, PixelFormat::rgb8).error().code == ErrorCode::invalid_argument);
  auto short_stride = image_from_pixels(pixel, 2, 1, PixelFormat::rgba8, 4);
  REQUIRE_FALSE(short_stride.ok());
  CHECK(short_stride.error().message.find("stride") != std::string::npos);

  // Aspect ratio over 200: refused with the ratio, as transformers does.
  std::vector<uint8_t> line(201 * 3, 128);
  auto thin = image_from_pixels(line.data(), 201, 1, PixelFormat::rgb8);
  REQUIRE(thin.ok());
  auto refused = preprocess_image(*thin, PreprocessOptions{});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(refused.error().message.find("aspect ratio 201") != std::string::npos);

  Image broken;
  broken.width = 4;
  broken.height = 4;
  broken.rgb.resize(10);
  CHECK(preprocess_image(broken, PreprocessOptions{}).error().code == ErrorCode::invalid_argument);
  CHECK(resize_bicubic_aa(*thin, 0, 5).error().code == ErrorCode::invalid_argument);
  PreprocessOptions bad;
  bad.image_std[1] = 0.0;
  CHECK(image_grid(100, 100, bad).error().code == ErrorCode::invalid_argument);
}

TEST_CASE("preprocess_options takes the budget and patch sizes from the model config") {
  ModelConfig config;
  CHECK(preprocess_options(config).min_pixels == 65536);
  CHECK(preprocess_options(config).max_pixels == 16777216);
  config.min_pixels = 3136;
  config.max_pixels = 1003520;
  config.vision.present = true;
  config.vision.patch_size = 14;
  config.vision.spatial_merge_size = 2;
  config.vision.temporal_patch_size = 2;
  const PreprocessOptions options = preprocess_options(config);
  CHECK(options.min_pixels == 3136);
  CHECK(options.max_pixels == 1003520);
  CHECK(options.patch_size == 14);
  auto grid = image_grid(1080, 1920, options);  // Qwen2-VL's factor 28, as a recorded smart_resize case
  REQUIRE(grid.ok());
  int found = 0;
  for (const auto& c : cases()["smart_resize"])
    if (c["height"] == 1080 && c["width"] == 1920 && c["factor"] == 28 && c["min_pixels"] == 3136) {
      CHECK(grid->resized_height == c["resized_height"].get<int64_t>());
      CHECK(grid->resized_width == c["resized_width"].get<int64_t>());
      found++;
    }
  CHECK(found == 1);
  CHECK(grid->image_tokens == grid->resized_height * grid->resized_width / (28 * 28));
}

// Regression (issue 15, defect 4): stb_image 2.27 (Debian's libstb-dev) wrote past stbi__build_huffman's
// 257-entry size table on this 10-byte JPEG, a DHT segment whose 16 code counts add up to more than 256
// (UBSan: "index 257 out of bounds for type 'stbi_uc[257]'"; ASan is silent, the write stays inside stb's
// struct). JPEG now goes to libjpeg-turbo, which refuses it; the sanitizer build of this suite runs it.
TEST_CASE("regression: a 10-byte JPEG with a bad Huffman table overran stb_image's table") {
  const std::vector<uint8_t> hostile = {0xFF, 0xD8, 0xFF, 0xC4, 0x00, 0x13, 0x00, 0xFF, 0xFF, 0xFF};
  auto image = decode_image(hostile.data(), hostile.size(), {}, "hostile.jpg");
  REQUIRE_FALSE(image.ok());
  CHECK(image.error().code == ErrorCode::bad_format);
  CHECK(image.error().message.find("hostile.jpg: corrupt JPEG") != std::string::npos);
  // every prefix and a few mutations of it are refused too, never decoded
  for (size_t n = 1; n <= hostile.size(); n++) {
    auto prefix = decode_image(hostile.data(), n, {}, "prefix.jpg");
    CHECK_FALSE(prefix.ok());
  }
}

TEST_CASE("JPEG: a header over the pixel limit is refused before decoding") {
  const std::vector<uint8_t> photo = read_bytes(kDir + "photo_300x200.jpg");
  DecodeOptions small;
  small.max_pixels = 300 * 200 - 1;
  auto refused = decode_image(photo.data(), photo.size(), small, "photo.jpg");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::invalid_argument);
  CHECK(refused.error().message.find("300 x 200") != std::string::npos);
  small.max_pixels = 300 * 200;
  CHECK(decode_image(photo.data(), photo.size(), small, "photo.jpg").ok());
}

// Found by tests/fuzz/fuzz_image.cpp: a PNG header claiming 2,934,785,544 x 4,188,368,203 pixels made the
// pixel-limit check multiply the two sides past 2^63 (UBSan: signed integer overflow) before refusing it.
TEST_CASE("regression: a PNG header's sides overflowed the pixel-limit product") {
  const std::vector<uint8_t> png = read_bytes(std::string(KVLITE_SOURCE_DIR) +
                                              "/tests/fuzz/crashes/image/png-dimensions-product-overflow");
  auto image = decode_image(png.data(), png.size(), {}, "huge.png");
  REQUIRE_FALSE(image.ok());
  CHECK(image.error().code != ErrorCode::internal);
  // and a well-formed header claiming 2^31 - 1 on both sides is refused by the limit, before decoding
  std::vector<uint8_t> header = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A, 0, 0, 0, 13, 'I', 'H', 'D', 'R',
                                 0x7F, 0xFF, 0xFF, 0xFF, 0x7F, 0xFF, 0xFF, 0xFF, 8, 2, 0, 0, 0, 0, 0, 0, 0};
  auto claimed = decode_image(header.data(), header.size(), {}, "claims.png");
  REQUIRE_FALSE(claimed.ok());
  CHECK(claimed.error().code != ErrorCode::internal);
}

// Issue 16: preprocessor_config.json honoured in full. image_mean / image_std were ignored (0.5 hard-coded): a
// checkpoint with CLIP's values got logits 0.4 relative off, silently. tools/make_processor_fixtures.py ran
// transformers' processor with CLIP's values on photo_67x45.png.
TEST_CASE("preprocessor_config.json: CLIP's image_mean / image_std and rescale_factor give transformers' pixel_values") {
  const std::string dir = kDir + "clip-processor";
  auto config = load_config(dir);
  REQUIRE_MESSAGE(config.ok(), config.error().message);
  CHECK(config->image_mean[0] == 0.48145466);
  CHECK(config->image_std[2] == 0.27577711);
  const PreprocessOptions options = preprocess_options(*config);
  auto image = load_image(kDir + "photo_67x45.png");
  REQUIRE(image.ok());
  auto input = preprocess_image(*image, options);
  REQUIRE_MESSAGE(input.ok(), input.error().message);
  const model_fixtures::Npy expected = model_fixtures::read_npy(dir + "/photo_67x45.pixel_values.npy");
  REQUIRE(input->pixel_values.size() == expected.values.size());
  CHECK(input->pixel_values == expected.values);  // bit for bit
  // Qwen's 0.5 would not do: the fixture tells the two apart
  PreprocessOptions qwen = options;
  qwen.image_mean = {{0.5, 0.5, 0.5}};
  qwen.image_std = {{0.5, 0.5, 0.5}};
  CHECK(preprocess_image(*image, qwen)->pixel_values != expected.values);
}

TEST_CASE("preprocessor_config.json: values kvlite cannot honour are refused, naming the key") {
  const std::string source = kDir + "clip-processor";
  const std::string dir = testing_safetensors::temp_dir("processor-refusals");
  std::ofstream(dir + "/config.json") << model_fixtures::read_file(source + "/config.json");
  const nlohmann::json good = nlohmann::json::parse(model_fixtures::read_file(source + "/preprocessor_config.json"));
  struct Case {
    const char* key;
    nlohmann::json value;
    ErrorCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"do_normalize", false, ErrorCode::unsupported, "do_normalize is false"},
      {"do_rescale", false, ErrorCode::unsupported, "do_rescale is false"},
      {"do_resize", false, ErrorCode::unsupported, "do_resize is false"},
      {"do_convert_rgb", false, ErrorCode::unsupported, "do_convert_rgb is false"},
      {"resample", 2, ErrorCode::unsupported, "resample is 2"},
      {"image_mean", {0.5, 0.5}, ErrorCode::bad_format, "image_mean must be a number or 3 numbers"},
      {"image_std", {0.5, 0.0, 0.5}, ErrorCode::bad_format, "image_std[1] is 0"},
      {"rescale_factor", -1.0, ErrorCode::bad_format, "rescale_factor is -1"},
      {"patch_size", 14, ErrorCode::bad_format, "patch_size is 14 but config.json's vision_config says 16"},
      {"merge_size", 4, ErrorCode::bad_format, "merge_size is 4"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.key);
    nlohmann::json edited = good;
    edited[c.key] = c.value;
    std::ofstream(dir + "/preprocessor_config.json", std::ios::trunc) << edited.dump();
    auto config = load_config(dir);
    REQUIRE_FALSE(config.ok());
    CHECK(config.error().code == c.code);
    CHECK_MESSAGE(config.error().message.find(c.message) != std::string::npos, config.error().message);
  }
  nlohmann::json scalar = good;
  scalar["image_mean"] = 0.25;  // one number for every channel, as the processor accepts
  std::ofstream(dir + "/preprocessor_config.json", std::ios::trunc) << scalar.dump();
  auto config = load_config(dir);
  REQUIRE_MESSAGE(config.ok(), config.error().message);
  CHECK(config->image_mean[2] == 0.25);
}

// Found by tests/fuzz/fuzz_image.cpp: stb_image 2.27 multiplied a PNM header's width into an int without a
// bound (UBSan: signed integer overflow at 888888888 * 10). kvlite reads the header first and refuses it.
TEST_CASE("regression: a PNM header number overflowed stb_image's int") {
  const std::vector<uint8_t> pnm = read_bytes(std::string(KVLITE_SOURCE_DIR) + "/tests/fuzz/crashes/image/pnm-width-int-overflow");
  auto image = decode_image(pnm.data(), pnm.size(), {}, "long.ppm");
  REQUIRE_FALSE(image.ok());
  CHECK(image.error().code == ErrorCode::bad_format);
  CHECK(image.error().message.find("PNM header's width") != std::string::npos);
  const std::string comment = "P6 # 12345678901234567890 in a comment is fine\n19 13\n255\n";
  std::vector<uint8_t> ok(comment.begin(), comment.end());
  ok.resize(ok.size() + 19 * 13 * 3, 7);
  auto decoded = decode_image(ok.data(), ok.size(), {}, "comment.ppm");
  REQUIRE_MESSAGE(decoded.ok(), decoded.error().message);
  CHECK(decoded->width == 19);
  CHECK(decoded->height == 13);
}

// Found by tests/fuzz/fuzz_image.cpp: stb_image 2.27 decodes a PNM with maxval over 255 (16 bits a sample) by
// reading twice the bytes it allocated (ASan: heap-buffer-overflow in stbi__convert_16_to_8). 16-bit PNM is
// refused before stb sees it.
TEST_CASE("regression: a 16-bit PNM made stb_image read past its buffer") {
  const std::vector<uint8_t> pnm = read_bytes(std::string(KVLITE_SOURCE_DIR) + "/tests/fuzz/crashes/image/pnm-16-bit-over-read");
  auto image = decode_image(pnm.data(), pnm.size(), {}, "deep.ppm");
  REQUIRE_FALSE(image.ok());
  CHECK(image.error().code == ErrorCode::unsupported);
  CHECK(image.error().message.find("16-bit PNM (maxval 256)") != std::string::npos);
}

// Found by tests/fuzz/fuzz_image.cpp: an empty IDAT chunk before the image data made stb_image 2.27 memcpy 0 bytes
// to a null pointer (undefined behaviour; UBSan stops there). Empty IDATs are dropped before decoding: a PNG
// with them is the same image as without.
TEST_CASE("regression: an empty IDAT chunk before the data made stb_image copy to a null pointer") {
  const std::vector<uint8_t> fuzzed =
      read_bytes(std::string(KVLITE_SOURCE_DIR) + "/tests/fuzz/crashes/image/png-empty-idat-null-memcpy");
  auto corrupt = decode_image(fuzzed.data(), fuzzed.size(), {}, "fuzzed.png");
  REQUIRE_FALSE(corrupt.ok());  // (the rest of that file is noise)
  CHECK(corrupt.error().code == ErrorCode::bad_format);
  // A real PNG with two empty IDAT chunks (length 0, "IDAT", the CRC of "IDAT") before its first IDAT.
  const std::vector<uint8_t> png = read_bytes(kDir + "gray_23x19.png");
  auto expected = decode_image(png.data(), png.size(), {}, "gray_23x19.png");
  REQUIRE(expected.ok());
  size_t first_idat = 8;
  while (memcmp(png.data() + first_idat + 4, "IDAT", 4) != 0)
    first_idat += 12 + (size_t(png[first_idat]) << 24 | size_t(png[first_idat + 1]) << 16 |
                        size_t(png[first_idat + 2]) << 8 | size_t(png[first_idat + 3]));
  const uint8_t empty_idat[12] = {0, 0, 0, 0, 'I', 'D', 'A', 'T', 0x35, 0xAF, 0x06, 0x1E};
  std::vector<uint8_t> padded(png.begin(), png.begin() + long(first_idat));
  padded.insert(padded.end(), empty_idat, empty_idat + 12);
  padded.insert(padded.end(), empty_idat, empty_idat + 12);
  padded.insert(padded.end(), png.begin() + long(first_idat), png.end());
  auto decoded = decode_image(padded.data(), padded.size(), {}, "empty-idat.png");
  REQUIRE_MESSAGE(decoded.ok(), decoded.error().message);
  CHECK(decoded->width == expected->width);
  CHECK(decoded->height == expected->height);
  CHECK(decoded->rgb == expected->rgb);
}

// Found by tests/fuzz/fuzz_image.cpp (2026-11-27): a 6,823-byte PNG whose second IDAT chunk declares 2,017,943,870
// bytes made stb_image grow its IDAT buffer to 3.5 GB before reading the chunk. A chunk that runs past the data is
// refused before decoding, with the chunk, its offset and the bytes that are there.
TEST_CASE("regression: a PNG chunk declaring more bytes than the file holds made stb_image allocate gigabytes") {
  const std::vector<uint8_t> fuzzed =
      read_bytes(std::string(KVLITE_SOURCE_DIR) + "/tests/fuzz/crashes/image/png-idat-length-huge-realloc");
  auto image = decode_image(fuzzed.data(), fuzzed.size(), {}, "fuzzed.png");
  REQUIRE_FALSE(image.ok());
  CHECK(image.error().code == ErrorCode::bad_format);
  CHECK(image.error().message ==
        "fuzzed.png: truncated or corrupt PNG: chunk 'IDAT' at byte 6682 declares 2017943870 bytes of data; 129 "
        "remain (refused before decoding)");
  // A real PNG with its IDAT's length raised past the end; and the same file whole still decodes.
  std::vector<uint8_t> png = read_bytes(kDir + "gray_23x19.png");
  REQUIRE(decode_image(png.data(), png.size(), {}, "gray_23x19.png").ok());
  size_t idat = 8;
  while (memcmp(png.data() + idat + 4, "IDAT", 4) != 0)
    idat += 12 + (size_t(png[idat]) << 24 | size_t(png[idat + 1]) << 16 | size_t(png[idat + 2]) << 8 | size_t(png[idat + 3]));
  png[idat] = 0x40;  // 2^30 and more
  auto overrun = decode_image(png.data(), png.size(), {}, "overrun.png");
  REQUIRE_FALSE(overrun.ok());
  CHECK(overrun.error().code == ErrorCode::bad_format);
  CHECK(overrun.error().message.find("chunk 'IDAT' at byte " + std::to_string(idat) + " declares") != std::string::npos);
}
