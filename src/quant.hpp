// ---------------------------------------------------------------------------------------------------------
// quant: quantized Linear weights as checkpoints store them, their bit-exact dequantization, and the CPU
// reference matmul that dequantizes a few rows at a time.
//
// Formats (N = out_features, K = in_features; full notes in tests/fixtures/quant/README.md):
//   int4  compressed-tensors "pack-quantized": weight_packed I32 [N, ceil(K/8)], column k in bits 4*(k%8)..
//         of word k/8 (lowest nibble first) holding q + 8, q in [-8, 7]; weight_scale [N, K/G] (group) or
//         [N, 1] (channel); weight_zero_point I32 [ceil(N/8), K/G] packed the same way along N (asymmetric
//         only); weight_g_idx I32 [K] (actorder "group": column k uses group g_idx[k]).
//   fp8   e4m3 weight [N, K] with weight_scale (compressed-tensors: tensor [1], channel [N, 1],
//         block [ceil(N/bn), ceil(K/bk)]) or weight_scale_inv (Qwen / transformers fine-grained fp8, blocks;
//         despite the name a multiplier).
// Dequantization, bit for bit as the reference computes it:
//   weight_scale      w = (q - zero) * scale in the scale's dtype: the exact product rounded to BF16 / F16
//                     (F32 scales: the float32 product). compressed-tensors' dequantize.
//   weight_scale_inv  w = float32(q) * float32(scale_inv), rounded to float32. transformers' Fp8Dequantize.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// How the product q * scale is rounded (see the table above).
enum class DequantRounding : uint8_t {
  scale_dtype,  // to the scale's dtype (compressed-tensors)
  f32,          // to float32 (transformers' fine-grained fp8)
};

// Where a QuantWeight's tensors are and how they are laid out: as the checkpoint stores them, in host memory
// (the CPU backend reads these), or repacked into device memory for the CUDA backend's GEMMs by
// cuda::upload_quant_weight (quant_gpu.hpp describes that layout; the pointers then address its tables).
enum class QuantLayout : uint8_t { checkpoint, cuda_tiles };

// A view of one quantized Linear's tensors inside a TensorStore (valid while the store lives). Tensors are
// read through byte pointers because safetensors guarantees no alignment. Make it with quant_weight().
struct QuantWeight {
  std::string name;  // module name, for messages
  int64_t out_features = 0, in_features = 0;  // N, K
  WeightFormat format = WeightFormat::int4;   // int4 or fp8
  ScaleGranularity granularity = ScaleGranularity::channel;  // int4: group, channel; fp8: tensor, channel, block

  // int4
  const uint8_t* packed = nullptr;       // I32 [N, packed_cols]
  int64_t packed_cols = 0;               // ceil(K / 8)
  const uint8_t* zero_points = nullptr;  // I32 [ceil(N / 8), scale_cols], or nullptr (symmetric: zero 0)
  const uint8_t* g_idx = nullptr;        // I32 [K], or nullptr: column k is in group k / group_size
  int64_t group_size = 0;                // columns per scale (channel: K)

  // int8 (GPTQ 8-bit, compressed-tensors INT8; quant_formats.hpp): signed q [N, K]; zero_points is then I8
  // [N, scale_cols], signed (nullptr: symmetric, zero 0); g_idx and group_size as int4's.
  const uint8_t* int8 = nullptr;
  bool int8_activations = false;  // W8A8: each activation row goes through int8 per token (quantize_int8_activations)

  // fp8
  const uint8_t* fp8 = nullptr;      // F8_E4M3 [N, K]
  int64_t block_n = 0, block_k = 0;  // rows x columns per scale (block granularity)

  // scales: int4 [N, K / group_size]; fp8 tensor [1, 1], channel [N, 1], block [ceil(N/bn), ceil(K/bk)]
  const uint8_t* scales = nullptr;
  DType scale_dtype = DType::F32;  // F32, BF16 or F16
  int64_t scale_rows = 0, scale_cols = 0;
  DequantRounding rounding = DequantRounding::scale_dtype;

  const uint8_t* bias = nullptr;  // [N] or nullptr
  DType bias_dtype = DType::F32;  // F32, BF16 or F16

  QuantLayout layout = QuantLayout::checkpoint;
  // Set when the view's tensors are not the checkpoint's but a copy repacked at load (AWQ, GPTQ:
  // quant_formats.hpp); the pointers above then address this buffer, which lives as long as any copy of the view.
  std::shared_ptr<const std::vector<uint8_t>> storage;
};

// Builds the view of `linear` (a Linear of format int4 or fp8 from describe_linears, or made by hand) over
// `store`, validating every tensor against the descriptor: dtypes; weight_packed [N, ceil(K/8)] (another
// width is reported as the bit width it implies), weight_shape == [N, K]; the scale's shape for the
// granularity; group_size dividing K; the zero points' packed shape; g_idx's shape and values (each group in
// range and holding exactly group_size columns, as the reference requires). Errors name the tensor and both
// shapes: bad_format, missing_tensor, or unsupported (bit widths other than 4, fp8 zero points).
Result<QuantWeight> quant_weight(const LinearDesc& linear, const TensorStore& store);

// out[r, k] = the dequantized weight of row row0 + r, column k, for r < rows: out [rows, K] floats, holding
// exactly the values the reference produces (see the table above). invalid_argument for rows outside [0, N).
Status dequantize_rows(const QuantWeight& weight, int64_t row0, int64_t rows, float* out);

// ---- an int8 copy of a dense Linear (the CPU's --cpu-lm-head int8) ---------------------------------------
// What llama-quantize does to the output matrix, for the CPU path: the lm_head is the largest matrix a decode
// step reads (Qwen3-0.6B's tied 151,936 x 1024 BF16 table is 57% of a W4A16 step's bytes), and an int8 copy
// halves it. Symmetric int8 per row and group of int8_copy_group_size(K) columns:
//   scale = max|w| / 127 (F32; 0 for an all-zero group),  q = nearbyint(w / scale) in [-127, 127],
// so every dequantized weight q * scale is within scale / 2 of w (plus float32 rounding). The view is in
// QuantLayout::checkpoint with format int8, so every CPU kernel set runs it (fast-lowp: int8 activations and
// vpdpbusd, as for a W8A16 checkpoint); it owns its bytes (QuantWeight::storage), int8_copy_bytes(N, K).
// weight: a dense host [N, K] matrix of BF16, F16 or F32 with N, K within the model limits; invalid_argument
// otherwise. `threads` (>= 1) split the rows; the result does not depend on it.
struct Tensor;  // backend.hpp
int64_t int8_copy_group_size(int64_t K);  // 128, 64 or 32 when one divides K, else K (one group a row)
uint64_t int8_copy_bytes(int64_t N, int64_t K);  // 0 for N or K <= 0; UINT64_MAX when it overflows
Result<QuantWeight> quantize_int8_copy(const Tensor& weight, const std::string& name, int threads = 1);

// ---- the CPU matmul --------------------------------------------------------------------------------------
struct QuantLinearOptions {
  int threads = 1;  // >= 1; the result does not depend on it
  // W8A8 as the GPU runs fp8 weights: each activation row is quantized to fp8 and back before the matmul
  // (quantize_fp8_activations, in groups of block_k columns for block weights, else the whole row), the
  // quantize-dequantize compressed-tensors' forward applies. fp8 weights only.
  bool fp8_activations = false;
};

// out = x @ W^T (+ weight.bias): x [T, K] float (row stride x_stride), out [T, N] (row stride out_stride), not
// overlapping x. Rows of W are dequantized 16 at a time into a per-thread buffer, never the whole matrix.
// Every output element is one dot product over K in a fixed order (8 interleaved partial sums reduced in a
// fixed tree, then the remainder, then + bias): the CPU backend's linear order, so it equals a float32 linear
// over the dequantized weight bit for bit, whatever `threads`.
Status quant_linear(const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& weight, float* out,
                    int64_t out_stride, const QuantLinearOptions& options = {});

// Dynamic fp8 e4m3 activation quantization as compressed-tensors computes it: for each row of x and each run
// of `group` columns (the last run may be shorter; group = cols: one scale per token),
//   scale = max|x| / 448 (float32 epsilon when that is 0),  q = e4m3(x / scale + 0)  (saturating, nearest even;
//   the + 0 turns -0 into +0 as the reference's zero-point addition does).
// x [rows, cols] with row stride x_stride; q [rows, cols] e4m3 bytes; scales [rows, ceil(cols / group)].
Status quantize_fp8_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride, int64_t group,
                                uint8_t* q, float* scales);

// ---- bit-level helpers (host and device) ------------------------------------------------------------------
// A little-endian 32-bit word at any alignment.
KVLITE_HD uint32_t load_u32_le(const uint8_t* bytes) {
  uint32_t word;
  memcpy(&word, bytes, 4);  // kvlite runs on little-endian hosts and devices only
  return word;
}
// The signed 4-bit value at nibble `index` (0 = lowest bits) of a pack-quantized word: stored value - 8.
KVLITE_HD int int4_from_word(uint32_t word, int index) { return int((word >> (4 * index)) & 0xfu) - 8; }
// q of column k in one packed row (I32 [ceil(K/8)]).
KVLITE_HD int int4_packed_at(const uint8_t* packed_row, int64_t k) {
  return int4_from_word(load_u32_le(packed_row + 4 * (k / 8)), int(k % 8));
}
// The zero point of row n, scale column g, from weight_zero_point I32 [ceil(N/8), scale_cols] packed along N.
KVLITE_HD int int4_zero_point_at(const uint8_t* zero_points, int64_t scale_cols, int64_t n, int64_t g) {
  return int4_from_word(load_u32_le(zero_points + 4 * ((n / 8) * scale_cols + g)), int(n % 8));
}
// Element `index` of a scale tensor of dtype F32, BF16 or F16, widened to float (exact).
KVLITE_HD float scale_at(const uint8_t* scales, DType dtype, int64_t index) {
  if (dtype == DType::F32) return bits_to_float(load_u32_le(scales + 4 * index));
  uint16_t half;
  memcpy(&half, scales + 2 * index, 2);
  return dtype == DType::BF16 ? bf16_to_float(half) : f16_to_float(half);
}
// value rounded to `dtype` (BF16 or F16, nearest even) and widened back; F32 leaves it alone.
// On the GPU one cvt.rn each way, the same IEEE rounding as the bit code (overflow to inf, subnormals kept): the
// bit code, unrolled 16 times a tile in the fp32-scale GEMV instances, made them ~37,000 SASS instructions and
// half of kernels.cu's ptxas time (sm_86 and sm_120, 2026-11-28).
KVLITE_HD float round_to_dtype(float value, DType dtype) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (dtype == DType::BF16) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bf16_to_float(bits);
  }
  if (dtype == DType::F16) {
    unsigned short bits;
    float widened;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    asm("cvt.f32.f16 %0, %1;" : "=f"(widened) : "h"(bits));
    return widened;
  }
  return value;
#else
  if (dtype == DType::BF16) return bf16_to_float(float_to_bf16(value));
  if (dtype == DType::F16) return f16_to_float(float_to_f16(value));
  return value;
#endif
}
// One dequantized weight: q (an int4 value minus its zero point, or a decoded e4m3) times its scale. The
// float32 product is exact for int4 and e4m3 times BF16/F16 scales, so rounding it once is the reference's
// single rounding in the scale's dtype.
KVLITE_HD float dequantize_value(float q, float scale, DType scale_dtype, DequantRounding rounding) {
  float product = q * scale;
  return rounding == DequantRounding::scale_dtype ? round_to_dtype(product, scale_dtype) : product;
}

namespace detail {
// For a backend's own thread pool: out[t, n0 .. n0 + rows) for every token t, rows <= kQuantRowBlock, using
// scratch >= rows * K floats. Arguments are not checked (quant_linear checks them).
// out holds out_dtype (F32, BF16 or F16): each output (plus bias) is rounded to it once. weight_rounding (F32:
// none) rounds the dequantized weights first, as a GPU multiplies them in the activation dtype.
constexpr int64_t kQuantRowBlock = 16;
void quant_linear_block(const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& weight, int64_t n0,
                        int64_t rows, float* scratch, void* out, int64_t out_stride, DType out_dtype = DType::F32,
                        DType weight_rounding = DType::F32);
void dequantize_rows_unchecked(const QuantWeight& weight, int64_t row0, int64_t rows, float* out);
// One activation row through fp8 and back (quantize_fp8_activations, then each q times its group's scale): what
// W8A8 computes with. x, out [cols]; may be the same array.
void fake_quantize_fp8_row(const float* x, int64_t cols, int64_t group, float* out);
// Dynamic int8 activation quantization per token as compressed-tensors computes it (W8A8, symmetric): for each
// row, scale = max(|min(x, 0)|, max(x, 0)) / 127.5 (float32 epsilon when 0), q = clamp(round_half_even(x / scale),
// -128, 127), and the row the matmul reads is q * scale. x, out [cols]; may be the same array.
void fake_quantize_int8_row(const float* x, int64_t cols, float* out);
// The activation group of W8A8 for an fp8 weight: block_k for block scales, else the whole row.
inline int64_t fp8_activation_group(const QuantWeight& weight) {
  return weight.granularity == ScaleGranularity::block ? weight.block_k : weight.in_features;
}
}  // namespace detail

}  // namespace kvlite
