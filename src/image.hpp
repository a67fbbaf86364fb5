// ---------------------------------------------------------------------------------------------------------
// image: decoding (stb_image, compiled privately), and Qwen2-VL / Qwen3-VL preprocessing exactly as
// transformers' default image processor does it: smart_resize, torchvision's antialiased bicubic resize
// (ATen's integer uint8 kernel, reproduced bit for bit), rescale + normalize, and patchify into the rows
// the vision encoder reads.
//
//    auto image = kvlite::load_image("cat.jpg");                       // RGB, EXIF orientation applied
//    auto input = kvlite::preprocess_image(*image, kvlite::preprocess_options(config));
//    // input->pixel_values: (grid_t*grid_h*grid_w, 1536) floats; input->grid.image_tokens placeholders
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <array>

namespace kvlite {

// An 8-bit RGB image: rows top to bottom, pixels packed R, G, B.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // (height, width, 3)
};

// What becomes of an alpha channel. transformers does both, depending on how the image arrives.
enum class AlphaMode {
  drop,             // keep R, G, B as stored: its loaders for a path/URL (PIL .convert("RGB"); torchvision
                    // decode_image(mode=RGB)) - the default for files and bytes
  composite_white,  // blend onto white, c*a + (1-a) in float32 then truncated as torchvision's to_dtype: its
                    // convert_to_rgb for an RGBA array or tensor - the default for raw pixels
};

// The most pixels an image may have: decoded (DecodeOptions::max_pixels's default) or handed over as raw pixels
// (image_from_pixels, kvlite_image_from_pixels). 64 Mi pixels ~ 8192 x 8192; the RGB costs 3 bytes each.
#ifndef KVLITE_MAX_IMAGE_PIXELS
#define KVLITE_MAX_IMAGE_PIXELS 67108864
#endif
namespace limits {
constexpr int64_t max_image_pixels = KVLITE_MAX_IMAGE_PIXELS;
}  // namespace limits

struct DecodeOptions {
  // Refuse images with more pixels than this BEFORE decoding them (a small file can claim 100000 x 100000
  // and make the decoder allocate tens of GiB). 64 Mi pixels ~ 8192 x 8192; the decoded RGB costs 3 bytes each.
  int64_t max_pixels = limits::max_image_pixels;
  uint64_t max_file_bytes = uint64_t(256) << 20;  // load_image refuses larger files without reading them
  bool exif_orientation = true;  // apply EXIF Orientation (JPEG APP1, PNG eXIf), as transformers' loaders do
  AlphaMode alpha = AlphaMode::drop;
};

// Decodes JPEG (baseline, progressive), PNG (gray, palette, alpha, 16-bit: high byte kept), BMP, TGA,
// GIF (first frame) and PNM (P5/P6) to RGB. Refuses with a clear error, naming the file: unsupported
// formats (WebP, TIFF, HEIF/AVIF, ... : `unsupported`), corrupt or truncated data (`bad_format`, with the
// decoder's reason), images over options.max_pixels (`invalid_argument`, before any pixel is decoded).
Result<Image> load_image(const std::string& path, const DecodeOptions& options = {});
// The same from bytes in memory; `name` stands for them in messages.
Result<Image> decode_image(const uint8_t* data, size_t size, const DecodeOptions& options = {},
                           const std::string& name = "image");

// Raw pixels as a camera or a GUI hands them over. stride_bytes: bytes from one row to the next (0: packed).
enum class PixelFormat { rgb8, bgr8, rgba8, bgra8, gray8 };
Result<Image> image_from_pixels(const uint8_t* pixels, int64_t width, int64_t height, PixelFormat format,
                                int64_t stride_bytes = 0, AlphaMode alpha = AlphaMode::composite_white);

// ---- Qwen2-VL / Qwen3-VL preprocessing ------------------------------------------------------------------
// transformers' smart_resize: both sides multiples of `factor` (patch x merge: 32 for Qwen3-VL, 28 for
// Qwen2/2.5-VL), pixel count brought into [min_pixels, max_pixels] keeping the aspect ratio, Python's
// half-to-even rounding. Aspect ratio over 200 is an error, as there. Returns {height, width}.
Result<std::pair<int64_t, int64_t>> smart_resize(int64_t height, int64_t width, int64_t factor,
                                                 int64_t min_pixels, int64_t max_pixels);

// torchvision.transforms.v2.functional.resize(uint8 image, [height, width], BICUBIC, antialias=True) as it
// runs on a CPU (ATen upsample_bicubic2d_aa, uint8: Keys cubic a = -0.5 with support 2 x max(1, in/out),
// weights normalized, then quantized to int16; horizontal pass, rounded to uint8, then vertical pass).
// Bit-exact. The same size returns a copy.
Result<Image> resize_bicubic_aa(const Image& image, int64_t height, int64_t width);

struct PreprocessOptions {
  int64_t min_pixels = 65536;     // preprocessor_config.json size.shortest_edge (Qwen3-VL's published value)
  int64_t max_pixels = 16777216;  // size.longest_edge
  int64_t patch_size = 16;
  int64_t merge_size = 2;           // 2 x 2 patches become one LLM token
  int64_t temporal_patch_size = 2;  // a still image is repeated into this many frames
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean{{0.5, 0.5, 0.5}};
  std::array<double, 3> image_std{{0.5, 0.5, 0.5}};
};
// The model's options: pixel budget from preprocessor_config.json when the directory had one, patch and
// merge sizes from the vision config; the rest are Qwen3-VL's values.
PreprocessOptions preprocess_options(const ModelConfig& config);

struct ImageGrid {
  int64_t resized_height = 0, resized_width = 0;  // after smart_resize
  int64_t grid_t = 0, grid_h = 0, grid_w = 0;     // in patches (image_grid_thw)
  int64_t image_tokens = 0;                       // grid_t * grid_h * grid_w / merge_size^2
};
// What preprocessing an image of this size will give, without touching pixels (prompt building, planning).
Result<ImageGrid> image_grid(int64_t height, int64_t width, const PreprocessOptions& options);

struct VisionInput {
  ImageGrid grid;
  int64_t row_size = 0;  // 3 * temporal_patch_size * patch_size^2 (1536)
  // (grid_t * grid_h * grid_w, row_size): rows in 2 x 2 merge-window order (windows in raster order, then
  // (0,0), (0,1), (1,0), (1,1) inside), each row ordered (channel, frame, y, x); values (x - mean) / std
  // on the 0..1 scale, float32 exactly as transformers computes them.
  std::vector<float> pixel_values;
  int64_t rows() const { return row_size ? int64_t(pixel_values.size()) / row_size : 0; }
};
// smart_resize -> resize_bicubic_aa -> rescale and normalize -> patchify; transformers' pixel_values and
// image_grid_thw for one image.
Result<VisionInput> preprocess_image(const Image& image, const PreprocessOptions& options);

}  // namespace kvlite
