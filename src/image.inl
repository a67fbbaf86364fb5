// image: implementation.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <fstream>
#include <sys/stat.h>

// stb_image, compiled here with internal linkage so that it cannot clash with an application's own copy,
// and only for the formats kvlite accepts (less code facing untrusted bytes). Its warnings are its own.
// An application that implements stb_image itself must do it in another file than KVLITE_IMPLEMENTATION.
#if defined(STBI_INCLUDE_STB_IMAGE_H)
#error "stb_image.h was included before kvlite's implementation in this file; include it after, or elsewhere"
#endif
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_NO_STDIO  // kvlite reads files itself, to name them in errors and cap their size
#define STBI_NO_LINEAR
#define STBI_NO_HDR
#define STBI_ONLY_PNG  // not JPEG: stb 2.27's JPEG decoder writes out of bounds on a bad Huffman table, and it
                       // rounds differently from libjpeg-turbo, which decodes JPEG here (below) as PIL and
                       // torchvision do
#define STBI_ONLY_BMP
#define STBI_ONLY_TGA
#define STBI_ONLY_GIF
#define STBI_ONLY_PNM
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wunused-function"
#pragma clang diagnostic ignored "-Wunused-parameter"
#pragma clang diagnostic ignored "-Wsign-compare"
#pragma clang diagnostic ignored "-Wimplicit-fallthrough"
#pragma clang diagnostic ignored "-Wmissing-field-initializers"
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wtype-limits"
#endif
// By its bare name where the build points at its directory (CMake's find_path: /usr/include/stb on Debian,
// include/ under vcpkg or Conan), else as Debian lays it out, for a plain `g++` without -I.
#if __has_include(<stb_image.h>)
#include <stb_image.h>
#else
#include <stb/stb_image.h>
#endif
#if defined(__clang__)
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#undef STB_IMAGE_IMPLEMENTATION
#include <turbojpeg.h>

namespace kvlite {

namespace detail {
namespace img {

constexpr const char* kSupportedFormats = "JPEG, PNG, BMP, TGA, GIF, PNM";

inline uint16_t read_be16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }
inline uint32_t read_be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}
// Does data[at..] begin with the literal `magic` (which may hold NUL bytes)?
template <size_t N>
bool starts_with(const uint8_t* data, size_t size, const char (&magic)[N], size_t at = 0) {
  return size >= at + N - 1 && memcmp(data + at, magic, N - 1) == 0;
}

// The format by its magic bytes: a supported one, a known unsupported one, or nullptr (TGA has no magic;
// stb_image decides).
struct Sniffed {
  const char* name = nullptr;
  bool supported = false;
};
inline Sniffed sniff_format(const uint8_t* d, size_t n) {
  if (n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) return {"JPEG", true};
  if (starts_with(d, n, "\x89PNG\r\n\x1a\n")) return {"PNG", true};
  if (starts_with(d, n, "GIF87a") || starts_with(d, n, "GIF89a")) return {"GIF", true};
  if (starts_with(d, n, "BM")) return {"BMP", true};
  if (n >= 2 && d[0] == 'P' && (d[1] == '5' || d[1] == '6')) return {"PNM", true};
  if (n >= 2 && d[0] == 'P' && d[1] >= '1' && d[1] <= '7') return {"ASCII or PAM PNM (only binary P5/P6 is)", false};
  if (starts_with(d, n, "RIFF") && starts_with(d, n, "WEBP", 8)) return {"WebP", false};
  if (starts_with(d, n, "ftyp", 4)) return {"HEIF/AVIF", false};
  if (starts_with(d, n, "II*") || starts_with(d, n, "MM\0*")) return {"TIFF", false};
  if (starts_with(d, n, "8BPS")) return {"PSD", false};
  if (starts_with(d, n, "#?RADIANCE") || starts_with(d, n, "#?RGBE")) return {"Radiance HDR", false};
  if (starts_with(d, n, "\0\0\0\x0cJXL ") || starts_with(d, n, "\xff\x0a")) return {"JPEG XL", false};
  if (starts_with(d, n, "\0\0\0\x0cjP  ")) return {"JPEG 2000", false};
  if (starts_with(d, n, "%PDF")) return {"PDF", false};
  if (starts_with(d, n, "<svg") || starts_with(d, n, "<?xml")) return {"SVG/XML", false};
  return {};
}

// Width and height as the header states them, read without stb_image, so that a header it refuses (stb_image
// has its own size limits) is still reported with the numbers it claims. nullopt when unknown.
using Dimensions = std::pair<int64_t, int64_t>;  // width, height
inline std::optional<Dimensions> header_dimensions(const char* format_name, const uint8_t* d, size_t n) {
  auto le16 = [&](size_t at) { return int64_t(d[at] | d[at + 1] << 8); };
  auto le32 = [&](size_t at) { return int64_t(int32_t(uint32_t(le16(at)) | uint32_t(le16(at + 2)) << 16)); };
  const std::string f = format_name;
  if (f == "PNG" && n >= 24 && memcmp(d + 12, "IHDR", 4) == 0) return Dimensions{read_be32(d + 16), read_be32(d + 20)};
  if (f == "GIF" && n >= 10) return Dimensions{le16(6), le16(8)};
  if (f == "BMP" && n >= 26) return Dimensions{le32(18), std::abs(le32(22))};  // negative height: top-down rows
  if (f == "JPEG") {  // the first start-of-frame segment: C0..CF except DHT (C4), JPG (C8), DAC (CC)
    for (size_t pos = 2; pos + 9 <= n && d[pos] == 0xFF;) {
      uint8_t marker = d[pos + 1];
      if (marker == 0xFF) { pos++; continue; }
      if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC)
        return Dimensions{read_be16(d + pos + 7), read_be16(d + pos + 5)};
      if (marker == 0xD9 || marker == 0xDA) break;
      pos += 2 + read_be16(d + pos + 2);
    }
  }
  return std::nullopt;
}

// EXIF Orientation (tag 0x0112) from a TIFF block: 1..8, or 1 when absent or malformed. Only IFD0 is read,
// as libjpeg/libpng-based loaders do.
inline int tiff_orientation(const uint8_t* t, size_t n) {
  if (n < 8) return 1;
  bool little = t[0] == 'I' && t[1] == 'I', big = t[0] == 'M' && t[1] == 'M';
  if (!little && !big) return 1;
  auto u16 = [&](size_t at) { return little ? uint16_t(t[at] | t[at + 1] << 8) : read_be16(t + at); };
  auto u32 = [&](size_t at) {
    return little ? uint32_t(t[at]) | uint32_t(t[at + 1]) << 8 | uint32_t(t[at + 2]) << 16 | uint32_t(t[at + 3]) << 24
                  : read_be32(t + at);
  };
  if (u16(2) != 42) return 1;
  size_t ifd = u32(4);
  if (ifd + 2 > n) return 1;
  size_t entries = u16(ifd);
  for (size_t i = 0; i < entries; i++) {
    size_t e = ifd + 2 + 12 * i;
    if (e + 12 > n) break;
    if (u16(e) == 0x0112) {
      int value = u16(e + 2) == 3 /* SHORT */ ? u16(e + 8) : 1;
      return value >= 1 && value <= 8 ? value : 1;
    }
  }
  return 1;
}

// What kvlite needs to know about a JPEG beyond stb_image: the EXIF orientation (first APP1 "Exif" segment
// before the scan) and whether an end-of-image marker follows the scan data. stb_image decodes a truncated
// JPEG without complaint (missing data reads as zeros); kvlite refuses it instead. Inside entropy-coded
// data 0xFF is always stuffed (FF 00) or a restart marker (FF D0-D7), so FF D9 there is the real EOI.
struct JpegFacts {
  int orientation = 1;
  bool has_end = false;
};
inline JpegFacts jpeg_facts(const uint8_t* d, size_t n) {
  JpegFacts facts;
  bool orientation_seen = false;
  size_t pos = 2;  // after SOI
  while (pos + 4 <= n) {
    if (d[pos] != 0xFF) return facts;  // not at a marker: corrupt; stb_image reports it
    uint8_t marker = d[pos + 1];
    if (marker == 0xFF) { pos++; continue; }  // fill byte
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) { pos += 2; continue; }  // no length
    if (marker == 0xD9) return facts;  // EOI before any scan
    size_t length = read_be16(d + pos + 2);
    if (length < 2) return facts;
    if (marker == 0xE1 && !orientation_seen && length >= 8 && pos + 2 + length <= n &&
        memcmp(d + pos + 4, "Exif\0\0", 6) == 0) {
      facts.orientation = tiff_orientation(d + pos + 10, length - 8);
      orientation_seen = true;
    }
    if (marker == 0xDA) {  // start of scan: the entropy-coded data follows its header
      for (size_t i = pos + 2 + length; i + 1 < n; i++)
        if (d[i] == 0xFF && d[i + 1] == 0xD9) { facts.has_end = true; break; }
      return facts;
    }
    pos += 2 + length;
  }
  return facts;
}

// Calls visit(offset, type, length) for each whole chunk of a PNG (length, 4-byte type, data, CRC), in order, until
// it returns false, IEND has been visited, or a chunk runs past the data. Returns the offset of that last chunk
// when it ran past the data (png_overrun refuses such a file before decoding), else kWholePngChunks.
constexpr size_t kWholePngChunks = SIZE_MAX;
template <class Visit>
size_t for_each_png_chunk(const uint8_t* d, size_t n, Visit&& visit) {
  size_t pos = 8;
  while (pos + 12 <= n) {
    const size_t length = read_be32(d + pos);
    if (length > n - pos - 12) return pos;
    const uint8_t* type = d + pos + 4;
    if (!visit(pos, type, length) || memcmp(type, "IEND", 4) == 0) return kWholePngChunks;
    pos += 12 + length;
  }
  return kWholePngChunks;
}

// The first chunk of a PNG, before IEND, whose declared length runs past the data, described ("chunk 'IDAT' at
// byte 6682 declares 2017943870 bytes of data; 129 remain"), or nothing when every chunk is whole. stb_image grows its
// IDAT buffer to the declared length before it reads the chunk: a 6.8 KB file with such a chunk asked for 3.5 GB
// (found by tests/fuzz/fuzz_image.cpp). A file holding such a chunk is truncated or corrupt either way.
inline std::optional<std::string> png_overrun(const uint8_t* d, size_t n) {
  const size_t pos = for_each_png_chunk(d, n, [](size_t, const uint8_t*, size_t) { return true; });
  if (pos == kWholePngChunks) return std::nullopt;
  char name[5];
  for (int i = 0; i < 4; i++) name[i] = isalpha(d[pos + 4 + i]) ? char(d[pos + 4 + i]) : '?';
  name[4] = '\0';
  return format("chunk '%s' at byte %zu declares %zu bytes of data; %zu remain", name, pos, size_t(read_be32(d + pos)),
                n - pos - 12);
}

// The EXIF orientation of a PNG: an eXIf chunk before the first IDAT (where libpng reads it).
inline int png_orientation(const uint8_t* d, size_t n) {
  int orientation = 1;
  for_each_png_chunk(d, n, [&](size_t pos, const uint8_t* type, size_t length) {
    if (memcmp(type, "IDAT", 4) == 0) return false;
    if (memcmp(type, "eXIf", 4) == 0) {
      orientation = tiff_orientation(d + pos + 8, length);
      return false;
    }
    return true;
  });
  return orientation;
}

// A PNG's bytes without its empty IDAT chunks, or nothing when it has none. stb_image 2.27 copies each IDAT
// into a buffer it allocates at the first non-empty one, so an empty IDAT before it memcpy's 0 bytes to a null
// pointer (undefined behaviour; UBSan stops there; found by tests/fuzz/fuzz_image.cpp). An empty IDAT adds
// nothing to the zlib stream and each chunk carries its own CRC, so the image without them is the same image.
inline std::vector<uint8_t> png_without_empty_idat(const uint8_t* d, size_t n) {
  std::vector<size_t> empty;  // offsets of the empty IDAT chunks (12 bytes each: length, type, CRC)
  for_each_png_chunk(d, n, [&](size_t pos, const uint8_t* type, size_t length) {
    if (length == 0 && memcmp(type, "IDAT", 4) == 0) empty.push_back(pos);
    return true;
  });
  std::vector<uint8_t> out;
  if (empty.empty()) return out;
  out.reserve(n - 12 * empty.size());
  size_t from = 0;
  for (size_t chunk : empty) {
    out.insert(out.end(), d + from, d + chunk);
    from = chunk + 12;
  }
  out.insert(out.end(), d + from, d + n);
  return out;
}

// Applies EXIF orientation o (1..8) as torchvision's decode_image(apply_exif_orientation=True) does:
// 2 mirror left-right, 3 rotate 180, 4 mirror top-bottom, 5 transpose, 6 rotate 90 clockwise,
// 7 transverse, 8 rotate 90 counter-clockwise.
inline Image apply_orientation(Image in, int o) {
  if (o <= 1 || o > 8) return in;
  const int64_t W = in.width, H = in.height;
  const bool swap = o >= 5;
  Image out;
  out.width = swap ? H : W;
  out.height = swap ? W : H;
  out.rgb.resize(in.rgb.size());
  for (int64_t y = 0; y < out.height; y++) {
    for (int64_t x = 0; x < out.width; x++) {
      int64_t sx = x, sy = y;  // source pixel of output (x, y)
      switch (o) {
        case 2: sx = W - 1 - x; break;
        case 3: sx = W - 1 - x; sy = H - 1 - y; break;
        case 4: sy = H - 1 - y; break;
        case 5: sx = y; sy = x; break;
        case 6: sx = y; sy = H - 1 - x; break;
        case 7: sx = W - 1 - y; sy = H - 1 - x; break;
        case 8: sx = W - 1 - y; sy = x; break;
      }
      memcpy(&out.rgb[size_t((y * out.width + x) * 3)], &in.rgb[size_t((sy * W + sx) * 3)], 3);
    }
  }
  return out;
}

// RGBA -> RGB onto white as the processor's convert_to_rgb computes it in float32:
// to_dtype(uint8 -> float): v * float(1/255); c*a + (1 - a); to_dtype(float -> uint8): trunc(v * float(255.999)).
inline uint8_t composite_on_white(uint8_t color, uint8_t alpha) {
  const float to_unit = float(1.0 / 255.0), to_byte = float(255.0 + 1.0 - 1e-3);
  float c = float(color) * to_unit, a = float(alpha) * to_unit;
  float blended = c * a;
  blended = blended + (1.0f - a);
  float scaled = blended * to_byte;
  return uint8_t(scaled);
}

inline std::string megapixels(int64_t pixels) { return format("%.1f megapixels", double(pixels) / 1e6); }

inline void require_positive(int64_t value, const char* what) {
  if (value <= 0) fail(ErrorCode::invalid_argument, format("%s must be positive, got %lld", what, (long long)value));
}

// Python's round() on a float: to nearest, ties to even.
inline double round_half_even(double x) {
  double below = std::floor(x), fraction = x - below;
  if (fraction > 0.5) return below + 1.0;
  if (fraction < 0.5) return below;
  return std::fmod(below, 2.0) == 0.0 ? below : below + 1.0;
}

// ---- the resize kernel ----------------------------------------------------------------------------------
// One axis of ATen's antialiased bicubic uint8 resize (UpSampleKernel.cpp, HelperInterpCubic with
// _compute_index_ranges_int16_weights): for each output index, the first input index, the tap count and
// int16 weights at `precision` fractional bits. The arithmetic below is theirs, in the same order and types
// (double), so the int16 weights are identical. (Built with -std=gnu++17 for an FMA target, a compiler may
// fuse multiply-adds here; a weight could then land one int16 step off in a rare tie. -std=c++17 does not.)
struct AxisTaps {
  int64_t max_taps = 0;                  // weights per output index (row stride of `weights`)
  int precision = 0;                     // fractional bits of the int16 weights
  std::vector<int64_t> first, count;     // (out)
  std::vector<int16_t> weights;          // (out, max_taps)
};

inline double keys_cubic(double x) {  // a = -0.5 (PIL and torch with antialias)
  const double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

inline AxisTaps bicubic_aa_taps(int64_t in_size, int64_t out_size) {
  const double scale = double(in_size) / double(out_size);  // area_pixel_compute_scale, align_corners=False
  const double support = scale >= 1.0 ? (4 * 0.5) * scale : 4 * 0.5;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  AxisTaps taps;
  taps.max_taps = int64_t(std::ceil(support)) * 2 + 1;
  taps.first.resize(size_t(out_size));
  taps.count.resize(size_t(out_size));
  std::vector<double> weights(size_t(out_size * taps.max_taps), 0.0);  // (out, max_taps)
  double largest = 0.0;
  for (int64_t i = 0; i < out_size; i++) {
    const double center = scale * (double(i) + 0.5);
    const int64_t first = std::max(int64_t(center - support + 0.5), int64_t(0));
    const int64_t count =
        std::clamp(std::min(int64_t(center + support + 0.5), in_size) - first, int64_t(0), taps.max_taps);
    double* w = &weights[size_t(i * taps.max_taps)];
    double total = 0.0;
    for (int64_t j = 0; j < count; j++) {
      w[j] = keys_cubic((double(j + first) - center + 0.5) * invscale);
      total += w[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < count; j++) {
        w[j] /= total;
        largest = std::max(largest, w[j]);
      }
    }
    taps.first[size_t(i)] = first;
    taps.count[size_t(i)] = count;
  }
  // The most fractional bits (at most 22) for which the largest weight still fits in an int16.
  int precision = 0;
  for (; precision < 22; precision++)
    if (int(0.5 + largest * double(1 << (precision + 1))) >= (1 << 15)) break;
  taps.precision = precision;
  taps.weights.resize(weights.size());
  for (size_t k = 0; k < weights.size(); k++) {
    double v = weights[k] * double(1 << precision);
    taps.weights[k] = int16_t(v < 0 ? int(-0.5 + v) : int(0.5 + v));
  }
  return taps;
}

// out[o] = clamp((2^(p-1) + sum_j in[first+j] * w[j]) >> p, 0, 255) for each of the 3 channels, along one
// axis: `in_step` / `out_step` are the byte distances between neighbours along it, `lines` the lines across
// it (`in_line` / `out_line` apart). Negative sums shift to negative values and clamp to 0 whatever the
// shift rounds to, so the result is that of ATen's arithmetic shift.
inline void resample_axis(const uint8_t* in, int64_t in_step, int64_t in_line, uint8_t* out, int64_t out_step,
                          int64_t out_line, int64_t lines, const AxisTaps& taps) {
  const int64_t out_size = int64_t(taps.first.size());
  const int32_t rounding = int32_t(1) << (taps.precision - 1);
  for (int64_t line = 0; line < lines; line++) {
    const uint8_t* src = in + line * in_line;
    uint8_t* dst = out + line * out_line;
    for (int64_t i = 0; i < out_size; i++) {
      const int16_t* w = &taps.weights[size_t(i * taps.max_taps)];
      const uint8_t* first = src + taps.first[size_t(i)] * in_step;
      int32_t sum[3] = {rounding, rounding, rounding};
      for (int64_t j = 0; j < taps.count[size_t(i)]; j++)
        for (int c = 0; c < 3; c++) sum[c] += int32_t(first[j * in_step + c]) * w[j];
      for (int c = 0; c < 3; c++) dst[i * out_step + c] = uint8_t(std::clamp(sum[c] >> taps.precision, 0, 255));
    }
  }
}

// Every field bounded before any product is formed: patch, merge and temporal sizes by KVLITE_MAX_VISION_PATCH
// (so patch_size x merge_size and 3 x T x P x P stay small), pixel budgets by KVLITE_MAX_PROCESSOR_PIXELS, and
// the normalization by the ranges a preprocessor_config.json is held to (config.hpp).
inline void check_options(const PreprocessOptions& o) {
  const std::pair<const char*, int64_t> sizes[] = {{"patch_size", o.patch_size},
                                                   {"merge_size", o.merge_size},
                                                   {"temporal_patch_size", o.temporal_patch_size}};
  for (const auto& size : sizes)
    if (size.second < 1 || size.second > limits::max_vision_patch)
      fail(ErrorCode::invalid_argument, format("PreprocessOptions::%s is %lld; it must be in 1..%lld "
                                               "(KVLITE_MAX_VISION_PATCH)", size.first, (long long)size.second,
                                               (long long)limits::max_vision_patch));
  const std::pair<const char*, int64_t> budgets[] = {{"min_pixels", o.min_pixels}, {"max_pixels", o.max_pixels}};
  for (const auto& budget : budgets)
    if (budget.second < 1 || budget.second > limits::max_processor_pixels)
      fail(ErrorCode::invalid_argument, format("PreprocessOptions::%s is %lld; it must be in 1..%lld "
                                               "(KVLITE_MAX_PROCESSOR_PIXELS)", budget.first, (long long)budget.second,
                                               (long long)limits::max_processor_pixels));
  if (std::string problem = normalization_problem("rescale_factor", o.rescale_factor); !problem.empty())
    fail(ErrorCode::invalid_argument, "PreprocessOptions::rescale_factor " + problem);
  for (size_t c = 0; c < 3; c++) {
    if (std::string problem = normalization_problem("image_mean", o.image_mean[c]); !problem.empty())
      fail(ErrorCode::invalid_argument, format("PreprocessOptions::image_mean[%zu] ", c) + problem);
    if (std::string problem = normalization_problem("image_std", o.image_std[c]); !problem.empty())
      fail(ErrorCode::invalid_argument, format("PreprocessOptions::image_std[%zu] ", c) + problem);
  }
}

inline void check_image(const Image& image, const char* what) {
  if (image.width <= 0 || image.height <= 0)
    fail(ErrorCode::invalid_argument,
         format("%s: the image is %lld x %lld; both sides must be positive", what, (long long)image.width,
                (long long)image.height));
  if (uint64_t(image.rgb.size()) != uint64_t(image.width) * uint64_t(image.height) * 3)
    fail(ErrorCode::invalid_argument,
         format("%s: Image::rgb holds %llu bytes, but %lld x %lld RGB needs %llu", what,
                (unsigned long long)image.rgb.size(), (long long)image.width, (long long)image.height,
                (unsigned long long)(uint64_t(image.width) * uint64_t(image.height) * 3)));
}

// JPEG through libjpeg-turbo's TurboJPEG API with the settings of PIL's and torchvision's decoders: the accurate
// integer IDCT (islow) and fancy (triangle-filter) chroma upsampling, libjpeg's defaults, so the pixels are the
// ones transformers' processor sees. The header's size is checked against the limit before any pixel is
// decoded; TJFLAG_LIMITSCANS refuses progressive files with more than 500 scans (a CPU-time bomb).
inline Image decode_jpeg(const uint8_t* data, size_t size, const DecodeOptions& options, const std::string& name) {
  struct Handle {
    tjhandle h = tjInitDecompress();
    ~Handle() {
      if (h) tjDestroy(h);
    }
  } handle;
  if (!handle.h) fail(ErrorCode::out_of_memory, format("%s: libjpeg-turbo could not start: %s", name.c_str(), tjGetErrorStr2(nullptr)));
  int width = 0, height = 0, subsampling = 0, colorspace = 0;
  if (tjDecompressHeader3(handle.h, data, (unsigned long)size, &width, &height, &subsampling, &colorspace) != 0)
    fail(ErrorCode::bad_format, format("%s: corrupt JPEG header (libjpeg-turbo: %s)", name.c_str(), tjGetErrorStr2(handle.h)));
  if (width <= 0 || height <= 0)
    fail(ErrorCode::bad_format, format("%s: the JPEG header claims %d x %d pixels; an image needs at least 1 x 1",
                                       name.c_str(), width, height));
  if (int64_t(width) * int64_t(height) > options.max_pixels)
    fail(ErrorCode::invalid_argument,
         format("%s: JPEG of %d x %d = %s is over the decode limit of %s (DecodeOptions::max_pixels = %lld); "
                "refused before decoding. Downscale it, or raise the limit if the image is genuine",
                name.c_str(), width, height, megapixels(int64_t(width) * height).c_str(),
                megapixels(options.max_pixels).c_str(), (long long)options.max_pixels));
  JpegFacts facts = jpeg_facts(data, size);
  if (!facts.has_end)
    fail(ErrorCode::bad_format, format("%s: truncated or corrupt JPEG: no end-of-image marker after the image data "
                                       "(%s read)", name.c_str(), format_bytes(size).c_str()));
  Image image;
  image.width = width;
  image.height = height;
  image.rgb.resize(size_t(width) * size_t(height) * 3);
  // CMYK and YCCK (Adobe) JPEGs: libjpeg-turbo gives the stored CMYK (Adobe's inverted ink values), which become
  // RGB as Pillow and torchvision convert them: each channel = k x (255 - cmy) / 255 subtracted from k, in
  // Pillow's rounding (v = k (255 - cmy) + 128; v = ((v >> 8) + v) >> 8).
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  std::vector<uint8_t> ink;
  if (cmyk) ink.resize(size_t(width) * size_t(height) * 4);  // width x height <= max_pixels, checked above
  if (tjDecompress2(handle.h, data, (unsigned long)size, cmyk ? ink.data() : image.rgb.data(), width, 0, height,
                    cmyk ? TJPF_CMYK : TJPF_RGB, TJFLAG_LIMITSCANS) != 0 &&
      tjGetErrorCode(handle.h) == TJERR_FATAL)  // warnings (e.g. extraneous bytes) decode as PIL's do
    fail(ErrorCode::bad_format, format("%s: corrupt JPEG (%d x %d): libjpeg-turbo: %s", name.c_str(), width, height,
                                       tjGetErrorStr2(handle.h)));
  if (cmyk) {
    auto channel = [](int k, int cmy) {
      int v = k * (255 - cmy) + 128;
      v = ((v >> 8) + v) >> 8;
      return uint8_t(std::clamp(k - v, 0, 255));
    };
    for (size_t i = 0, pixels = size_t(width) * size_t(height); i < pixels; i++) {
      const uint8_t* p = &ink[4 * i];
      for (int c = 0; c < 3; c++) image.rgb[3 * i + size_t(c)] = channel(p[3], p[c]);
    }
  }
  if (options.exif_orientation) image = apply_orientation(std::move(image), facts.orientation);
  return image;
}

// stb_image 2.27 trusts two things in a PNM header, both found by tests/fuzz/fuzz_image.cpp: it reads the
// numbers into an int without a bound (signed overflow on "P6 888888888888"), and for a maxval over 255 (16
// bits a sample) it reads twice the bytes it allocated (a heap over-read in stbi__convert_16_to_8). The header is
// read here first, as stb reads it (whitespace, # comments, decimal width, height, maxval): a number of more
// than 9 digits is refused, and so is a 16-bit PNM.
inline void check_pnm_header(const uint8_t* d, size_t n, const std::string& name) {
  size_t i = 2;  // after "P5" / "P6"
  int64_t maxval = 0;
  for (const char* field : {"width", "height", "maxval"}) {
    while (i < n && (isspace(d[i]) || d[i] == '#')) {
      if (d[i] == '#')
        while (i < n && d[i] != '\n' && d[i] != '\r') i++;
      else
        i++;
    }
    size_t digits = 0;
    int64_t value = 0;
    for (; i < n && d[i] >= '0' && d[i] <= '9'; i++, digits++)
      if (digits < 9) value = value * 10 + (d[i] - '0');  // 9 digits at most are kept: no overflow here either
    if (digits > 9)
      fail(ErrorCode::bad_format, format("%s: the PNM header's %s has %zu digits; kvlite reads at most 9 (a corrupt "
                                         "or hostile file)", name.c_str(), field, digits));
    maxval = value;
  }
  if (maxval > 255)
    fail(ErrorCode::unsupported, format("%s: a 16-bit PNM (maxval %lld); kvlite decodes 8-bit PNM (maxval up to "
                                        "255): convert it first", name.c_str(), (long long)maxval));
}

inline Image decode(const uint8_t* data, size_t size, const DecodeOptions& options, const std::string& name) {
  if (!data || size == 0) fail(ErrorCode::bad_format, format("%s: no image data (0 bytes)", name.c_str()));
  if (options.max_pixels <= 0)
    fail(ErrorCode::invalid_argument,
         format("DecodeOptions::max_pixels must be positive, got %lld", (long long)options.max_pixels));
  if (size > size_t(INT_MAX))
    fail(ErrorCode::unsupported, format("%s: %s of encoded data is over the decoder's 2 GiB limit", name.c_str(),
                                        format_bytes(size).c_str()));
  const Sniffed sniffed = sniff_format(data, size);
  if (sniffed.name && !sniffed.supported)
    fail(ErrorCode::unsupported, format("%s: %s images are not supported (kvlite decodes %s); convert it first",
                                        name.c_str(), sniffed.name, kSupportedFormats));

  if (sniffed.name && strcmp(sniffed.name, "JPEG") == 0) return decode_jpeg(data, size, options, name);
  if (sniffed.name && strcmp(sniffed.name, "PNM") == 0) check_pnm_header(data, size, name);

  // Dimensions from the header alone, then the size limit, before a single pixel is decoded.
  const char* format_name = sniffed.name ? sniffed.name : "TGA";
  int stb_width = 0, stb_height = 0, channels = 0;
  const bool header_ok = stbi_info_from_memory(data, int(size), &stb_width, &stb_height, &channels) != 0;
  const char* reason = stbi_failure_reason() && *stbi_failure_reason() ? stbi_failure_reason() : "unreadable";
  if (!header_ok && !sniffed.name)
    fail(ErrorCode::unsupported, format("%s: not an image kvlite can read (it decodes %s): %s", name.c_str(),
                                        kSupportedFormats, reason));
  const std::optional<Dimensions> claimed =
      header_ok ? Dimensions{stb_width, stb_height} : header_dimensions(format_name, data, size);
  const int64_t width = claimed ? claimed->first : 0, height = claimed ? claimed->second : 0;
  if (claimed && (width <= 0 || height <= 0))
    fail(ErrorCode::bad_format, format("%s: the %s header claims %lld x %lld pixels; an image needs at least 1 x 1",
                                       name.c_str(), format_name, (long long)width, (long long)height));
  // (compared by division: a PNG header's two 32-bit sides multiply past 2^63)
  if (claimed && width > options.max_pixels / height)
    fail(ErrorCode::invalid_argument,
         format("%s: %s of %lld x %lld = %.1f megapixels is over the decode limit of %s (DecodeOptions::max_pixels = "
                "%lld); refused before decoding. Downscale it, or raise the limit if the image is genuine",
                name.c_str(), format_name, (long long)width, (long long)height, double(width) * double(height) / 1e6,
                megapixels(options.max_pixels).c_str(), (long long)options.max_pixels));
  if (!header_ok)
    fail(ErrorCode::bad_format,
         claimed
             ? format("%s: the %s header claims %lld x %lld pixels: corrupt, or beyond the decoder's limits "
                      "(a decompression bomb?) (stb_image: %s)", name.c_str(), format_name, (long long)width,
                      (long long)height, reason)
             : format("%s: corrupt %s header (stb_image: %s)", name.c_str(), format_name, reason));

  int orientation = 1;
  if (strcmp(format_name, "PNG") == 0) {
    if (const std::optional<std::string> overrun = png_overrun(data, size))
      fail(ErrorCode::bad_format, format("%s: truncated or corrupt PNG: %s (refused before decoding)", name.c_str(),
                                         overrun->c_str()));
    orientation = png_orientation(data, size);
  } else if (strcmp(format_name, "BMP") == 0 && size >= 6) {
    uint32_t declared = uint32_t(data[2]) | uint32_t(data[3]) << 8 | uint32_t(data[4]) << 16 | uint32_t(data[5]) << 24;
    if (declared > size)  // bfSize: writers that leave it 0 are not checked
      fail(ErrorCode::bad_format, format("%s: truncated BMP: the header says %u bytes, the data has %zu", name.c_str(),
                                         declared, size));
  }

  std::vector<uint8_t> repaired;  // a PNG without the empty IDAT chunks stb_image mishandles
  if (strcmp(format_name, "PNG") == 0) repaired = png_without_empty_idat(data, size);
  const uint8_t* pixels = repaired.empty() ? data : repaired.data();
  const size_t pixels_size = repaired.empty() ? size : repaired.size();
  const bool composite = options.alpha == AlphaMode::composite_white;
  const int wanted = composite ? 4 : 3;
  int w = 0, h = 0, in_file = 0;
  stbi_uc* decoded = stbi_load_from_memory(pixels, int(pixels_size), &w, &h, &in_file, wanted);
  if (!decoded) {
    const char* why = stbi_failure_reason() && *stbi_failure_reason() ? stbi_failure_reason() : "unreadable data";
    fail(strcmp(why, "outofmem") == 0 ? ErrorCode::out_of_memory : ErrorCode::bad_format,
         format("%s: corrupt or truncated %s (%lld x %lld): %s", name.c_str(), format_name, (long long)width,
                (long long)height, why));
  }
  std::unique_ptr<stbi_uc, void (*)(void*)> owner(decoded, stbi_image_free);
  Image image;
  image.width = w;
  image.height = h;
  image.rgb.resize(size_t(w) * size_t(h) * 3);
  if (!composite) {
    memcpy(image.rgb.data(), decoded, image.rgb.size());
  } else {
    for (size_t p = 0, n = size_t(w) * size_t(h); p < n; p++)
      for (size_t c = 0; c < 3; c++) image.rgb[p * 3 + c] = composite_on_white(decoded[p * 4 + c], decoded[p * 4 + 3]);
  }
  if (options.exif_orientation) image = apply_orientation(std::move(image), orientation);
  return image;
}

}  // namespace img
}  // namespace detail

// ---- decoding ---------------------------------------------------------------------------------------------
Result<Image> decode_image(const uint8_t* data, size_t size, const DecodeOptions& options, const std::string& name) {
  return detail::guard([&] { return detail::img::decode(data, size, options, name); });
}

Result<Image> load_image(const std::string& path, const DecodeOptions& options) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    struct stat st;
    if (stat(path.c_str(), &st) != 0)
      fail(ErrorCode::io_error, format("cannot open image %s: %s", path.c_str(), strerror(errno)));
    if (!S_ISREG(st.st_mode)) fail(ErrorCode::io_error, format("image %s is not a regular file", path.c_str()));
    if (uint64_t(st.st_size) > options.max_file_bytes)
      fail(ErrorCode::invalid_argument,
           format("image %s is %s, over the %s limit (DecodeOptions::max_file_bytes)", path.c_str(),
                  format_bytes(uint64_t(st.st_size)).c_str(), format_bytes(options.max_file_bytes).c_str()));
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(ErrorCode::io_error, format("cannot open image %s: %s", path.c_str(), strerror(errno)));
    std::vector<uint8_t> bytes(size_t(st.st_size));
    if (!bytes.empty() && !in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(bytes.size())))
      fail(ErrorCode::io_error, format("cannot read image %s", path.c_str()));
    return detail::img::decode(bytes.data(), bytes.size(), options, path);
  });
}

Result<Image> image_from_pixels(const uint8_t* pixels, int64_t width, int64_t height, PixelFormat format,
                                int64_t stride_bytes, AlphaMode alpha) {
  return detail::guard([&] {
    using detail::fail;
    int channels = 3, r = 0, g = 1, b = 2;
    switch (format) {
      case PixelFormat::rgb8: break;
      case PixelFormat::bgr8: r = 2; b = 0; break;
      case PixelFormat::rgba8: channels = 4; break;
      case PixelFormat::bgra8: channels = 4; r = 2; b = 0; break;
      case PixelFormat::gray8: channels = 1; g = b = 0; break;
    }
    if (width <= 0 || height <= 0 || width > (int64_t(1) << 24) || height > (int64_t(1) << 24))
      fail(ErrorCode::invalid_argument,
           detail::format("image_from_pixels: %lld x %lld pixels; both sides must be in 1..16777216", (long long)width,
                          (long long)height));
    // Both sides are at most 2^24, so neither product below can overflow; the stride is at most the widest row
    // (4 bytes x 2^24), so no row address can either.
    if (width * height > limits::max_image_pixels)
      fail(ErrorCode::invalid_argument,
           detail::format("image_from_pixels: %lld x %lld is %lld pixels; at most %lld (KVLITE_MAX_IMAGE_PIXELS)",
                          (long long)width, (long long)height, (long long)(width * height),
                          (long long)limits::max_image_pixels));
    if (stride_bytes < 0 || stride_bytes > (int64_t(4) << 24))
      fail(ErrorCode::invalid_argument,
           detail::format("image_from_pixels: stride of %lld bytes; it must be in 0..%lld (0: packed rows)",
                          (long long)stride_bytes, (long long)(int64_t(4) << 24)));
    if (!pixels) fail(ErrorCode::invalid_argument, "image_from_pixels: pixels is null");
    const int64_t row_bytes = width * channels;
    if (stride_bytes == 0) stride_bytes = row_bytes;
    if (stride_bytes < row_bytes)
      fail(ErrorCode::invalid_argument,
           detail::format("image_from_pixels: stride of %lld bytes is shorter than a row of %lld pixels x %d bytes",
                          (long long)stride_bytes, (long long)width, channels));
    Image image;
    image.width = width;
    image.height = height;
    image.rgb.resize(size_t(width * height * 3));
    for (int64_t y = 0; y < height; y++) {
      const uint8_t* src = pixels + y * stride_bytes;
      uint8_t* dst = &image.rgb[size_t(y * width * 3)];
      for (int64_t x = 0; x < width; x++, src += channels, dst += 3) {
        const bool blend = channels == 4 && alpha == AlphaMode::composite_white;
        dst[0] = blend ? detail::img::composite_on_white(src[r], src[3]) : src[r];
        dst[1] = blend ? detail::img::composite_on_white(src[g], src[3]) : src[g];
        dst[2] = blend ? detail::img::composite_on_white(src[b], src[3]) : src[b];
      }
    }
    return image;
  });
}

// ---- preprocessing ----------------------------------------------------------------------------------------
Result<std::pair<int64_t, int64_t>> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                                 int64_t max_pixels) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    detail::img::require_positive(height, "smart_resize: height");
    detail::img::require_positive(width, "smart_resize: width");
    detail::img::require_positive(factor, "smart_resize: factor");
    detail::img::require_positive(min_pixels, "smart_resize: min_pixels");
    // Bounded so that every product below stays far inside int64 (factor x 2^31, h_bar x w_bar).
    if (factor > limits::max_vision_patch * limits::max_vision_patch)
      fail(ErrorCode::invalid_argument, format("smart_resize: factor %lld is over %lld (KVLITE_MAX_VISION_PATCH "
                                               "squared)", (long long)factor,
                                               (long long)(limits::max_vision_patch * limits::max_vision_patch)));
    if (max_pixels > limits::max_processor_pixels)
      fail(ErrorCode::invalid_argument, format("smart_resize: max_pixels %lld is over %lld (KVLITE_MAX_PROCESSOR_PIXELS)",
                                               (long long)max_pixels, (long long)limits::max_processor_pixels));
    if (max_pixels < min_pixels)
      fail(ErrorCode::invalid_argument, format("smart_resize: max_pixels (%lld) is below min_pixels (%lld)",
                                               (long long)max_pixels, (long long)min_pixels));
    if (height > (int64_t(1) << 31) || width > (int64_t(1) << 31))
      fail(ErrorCode::invalid_argument, format("smart_resize: %lld x %lld is beyond any image", (long long)height,
                                               (long long)width));
    // transformers' code, line by line (Python floats are doubles; int / int is a correctly rounded division).
    const double ratio = double(std::max(height, width)) / double(std::min(height, width));
    if (ratio > 200)
      fail(ErrorCode::invalid_argument,
           format("image of %lld x %lld pixels has aspect ratio %g; Qwen2-VL/Qwen3-VL preprocessing refuses ratios "
                  "over 200: crop or pad it", (long long)width, (long long)height, ratio));
    const double f = double(factor), h = double(height), w = double(width);
    int64_t h_bar = int64_t(detail::img::round_half_even(h / f)) * factor;
    int64_t w_bar = int64_t(detail::img::round_half_even(w / f)) * factor;
    if (h_bar * w_bar > max_pixels) {
      const double beta = std::sqrt(double(height * width) / double(max_pixels));
      h_bar = std::max(factor, int64_t(std::floor(h / beta / f)) * factor);
      w_bar = std::max(factor, int64_t(std::floor(w / beta / f)) * factor);
    } else if (h_bar * w_bar < min_pixels) {
      const double beta = std::sqrt(double(min_pixels) / double(height * width));
      h_bar = int64_t(std::ceil(h * beta / f)) * factor;
      w_bar = int64_t(std::ceil(w * beta / f)) * factor;
    }
    return std::make_pair(h_bar, w_bar);
  });
}

Result<Image> resize_bicubic_aa(const Image& image, int64_t height, int64_t width) {
  return detail::guard([&] {
    detail::img::check_image(image, "resize_bicubic_aa");
    if (height <= 0 || width <= 0 || height > (int64_t(1) << 24) || width > (int64_t(1) << 24))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("resize_bicubic_aa: target %lld x %lld; both sides must be in 1..16777216",
                                  (long long)width, (long long)height));
    if (height == image.height && width == image.width) return image;
    // Horizontal pass first (when the width changes), rounded to uint8, then the vertical pass: ATen's order.
    Image current = image;
    if (width != image.width) {
      const detail::img::AxisTaps taps = detail::img::bicubic_aa_taps(image.width, width);
      Image next;
      next.width = width;
      next.height = current.height;
      next.rgb.resize(size_t(width * current.height * 3));  // (height, new width, 3)
      detail::img::resample_axis(current.rgb.data(), 3, current.width * 3, next.rgb.data(), 3, width * 3,
                                 current.height, taps);
      current = std::move(next);
    }
    if (height != image.height) {
      const detail::img::AxisTaps taps = detail::img::bicubic_aa_taps(image.height, height);
      Image next;
      next.width = current.width;
      next.height = height;
      next.rgb.resize(size_t(current.width * height * 3));  // (new height, width, 3)
      const int64_t row = current.width * 3;
      detail::img::resample_axis(current.rgb.data(), row, 3, next.rgb.data(), row, 3, current.width, taps);
      current = std::move(next);
    }
    return current;
  });
}

PreprocessOptions preprocess_options(const ModelConfig& config) {
  PreprocessOptions options;
  if (config.vision.present) {  // the family's processor defaults (config.hpp's vision traits)
    options.min_pixels = config.vision.traits.default_min_pixels;
    options.max_pixels = config.vision.traits.default_max_pixels;
  }
  if (config.min_pixels > 0) options.min_pixels = config.min_pixels;
  if (config.max_pixels > 0) options.max_pixels = config.max_pixels;
  options.rescale_factor = config.rescale_factor;
  for (size_t c = 0; c < 3; c++) {
    options.image_mean[c] = config.image_mean[c];
    options.image_std[c] = config.image_std[c];
  }
  if (config.vision.present) {
    options.patch_size = config.vision.patch_size;
    options.merge_size = config.vision.spatial_merge_size;
    options.temporal_patch_size = config.vision.temporal_patch_size;
  }
  return options;
}

Result<ImageGrid> image_grid(int64_t height, int64_t width, const PreprocessOptions& options) {
  return detail::guard([&] {
    detail::img::check_options(options);
    const int64_t factor = options.patch_size * options.merge_size;
    const auto resized = smart_resize(height, width, factor, options.min_pixels, options.max_pixels).value();
    ImageGrid grid;
    grid.resized_height = resized.first;
    grid.resized_width = resized.second;
    grid.grid_t = 1;  // one still image: its frame repeated temporal_patch_size times fills one temporal patch
    grid.grid_h = resized.first / options.patch_size;
    grid.grid_w = resized.second / options.patch_size;
    grid.image_tokens = grid.grid_t * grid.grid_h * grid.grid_w / (options.merge_size * options.merge_size);
    return grid;
  });
}

Result<VisionInput> preprocess_image(const Image& image, const PreprocessOptions& options) {
  return detail::guard([&] {
    detail::img::check_image(image, "preprocess_image");
    VisionInput input;
    input.grid = image_grid(image.height, image.width, options).value();
    const Image resized = resize_bicubic_aa(image, input.grid.resized_height, input.grid.resized_width).value();

    // Rescale and normalize fused as the processor does: (x - mean/rescale) / (std/rescale) in float32, with
    // mean and std made float32 first, then scaled by float(1 / rescale_factor). One table per channel.
    const float inverse_rescale = float(1.0 / options.rescale_factor);
    float normalized[3][256];
    for (int c = 0; c < 3; c++) {
      const float mean = float(options.image_mean[size_t(c)]) * inverse_rescale;
      const float std = float(options.image_std[size_t(c)]) * inverse_rescale;
      for (int v = 0; v < 256; v++) normalized[c][v] = (float(v) - mean) / std;
    }

    // Patchify: row = merge window (raster order) x position in the window; inside a row (c, t, y, x).
    const int64_t P = options.patch_size, M = options.merge_size, T = options.temporal_patch_size;
    const int64_t grid_h = input.grid.grid_h, grid_w = input.grid.grid_w;
    input.row_size = 3 * T * P * P;
    input.pixel_values.resize(size_t(detail::checked_mul(detail::checked_mul(uint64_t(grid_h), uint64_t(grid_w), "image patches"),
                                                         uint64_t(input.row_size), "pixel values",
                                                         ErrorCode::invalid_argument)));  // (grid_h * grid_w, row_size)
    float* out = input.pixel_values.data();
    for (int64_t window_row = 0; window_row < grid_h / M; window_row++)
      for (int64_t window_col = 0; window_col < grid_w / M; window_col++)
        for (int64_t in_row = 0; in_row < M; in_row++)
          for (int64_t in_col = 0; in_col < M; in_col++) {
            const int64_t y0 = (window_row * M + in_row) * P, x0 = (window_col * M + in_col) * P;
            for (int c = 0; c < 3; c++) {
              float* frame0 = out;
              for (int64_t y = 0; y < P; y++) {
                const uint8_t* src = &resized.rgb[size_t(((y0 + y) * resized.width + x0) * 3 + c)];
                for (int64_t x = 0; x < P; x++) *out++ = normalized[c][src[x * 3]];
              }
              for (int64_t t = 1; t < T; t++, out += P * P) memcpy(out, frame0, size_t(P * P) * sizeof(float));
            }
          }
    return input;
  });
}

}  // namespace kvlite
