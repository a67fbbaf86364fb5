// quant: implementation.
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <thread>

namespace kvlite {
namespace detail {
namespace quant {

using cfg::shape_text;

inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

[[noreturn]] inline void bad_shape(const TensorInfo& tensor, const std::vector<int64_t>& expected, const std::string& why) {
  fail(ErrorCode::bad_format, format("%s has shape %s but %s expects %s", tensor.name.c_str(),
                                     shape_text(tensor.shape).c_str(), why.c_str(), shape_text(expected).c_str()));
}

inline void expect_dtype(const TensorInfo& tensor, DType dtype, const char* what) {
  if (tensor.dtype != dtype)
    fail(ErrorCode::bad_format, format("%s has dtype %s; %s stores it as %s", tensor.name.c_str(),
                                       dtype_name(tensor.dtype), what, dtype_name(dtype)));
}

inline void expect_float_dtype(const TensorInfo& tensor, const char* what) {
  if (tensor.dtype != DType::F32 && tensor.dtype != DType::BF16 && tensor.dtype != DType::F16)
    fail(ErrorCode::unsupported, format("%s has dtype %s; %s are supported as F32, BF16 or F16", tensor.name.c_str(),
                                        dtype_name(tensor.dtype), what));
}

inline const TensorInfo& require(const TensorStore& store, const std::string& name, const std::string& why) {
  const TensorInfo* tensor = store.find(name);
  if (!tensor) fail(ErrorCode::missing_tensor, format("%s is missing: %s", name.c_str(), why.c_str()));
  return *tensor;
}

// The scale tensor's elements as [rows, cols], accepting a scalar or [1] for a per-tensor scale.
inline void set_scales(QuantWeight& w, const TensorStore& store, const TensorInfo& scale, int64_t rows, int64_t cols) {
  w.scales = store.data(scale);
  w.scale_dtype = scale.dtype;
  w.scale_rows = rows;
  w.scale_cols = cols;
}

inline void check_bias(QuantWeight& w, const TensorStore& store, const std::string& prefix) {
  const TensorInfo* bias = store.find(prefix + "bias");
  if (!bias) return;
  expect_float_dtype(*bias, "biases");
  if (bias->shape != std::vector<int64_t>{w.out_features}) bad_shape(*bias, {w.out_features}, "one bias per output");
  w.bias = store.data(*bias);
  w.bias_dtype = bias->dtype;
}

inline void build_int4(const LinearDesc& d, const TensorStore& store, QuantWeight& w) {
  const std::string p = d.name + ".";
  const int64_t n = d.out_features, k = d.in_features;
  const TensorInfo& packed = require(store, p + "weight_packed", "a pack-quantized Linear stores its int4 weights there");
  expect_dtype(packed, DType::I32, "pack-quantized");
  const int64_t words = ceil_div64(k, 8);
  if (packed.shape.size() != 2 || packed.shape[0] != n || packed.shape[1] != words) {
    // compressed-tensors packs b-bit values densely: ceil(K * b / 32) words per row. Name the width it implies.
    int implied_bits = 0, matches = 0;
    if (packed.shape.size() == 2 && packed.shape[0] == n)
      for (int bits = 1; bits <= 8; bits++)
        if (ceil_div64(k * bits, 32) == packed.shape[1]) implied_bits = bits, matches++;
    if (matches == 1 && implied_bits != 4)
      fail(ErrorCode::unsupported,
           format("%s has shape %s: for in_features %lld that is %d-bit values packed 32 / %d per I32; kvlite "
                  "reads 4-bit int weights, shape %s",
                  packed.name.c_str(), shape_text(packed.shape).c_str(), (long long)k, implied_bits, implied_bits,
                  shape_text({n, words}).c_str()));
    bad_shape(packed, {n, words}, format("[out %lld, in %lld] packed 8 per I32", (long long)n, (long long)k));
  }
  if (const TensorInfo* shape = store.find(p + "weight_shape")) {
    expect_dtype(*shape, DType::I64, "pack-quantized");
    if (shape->shape != std::vector<int64_t>{2}) bad_shape(*shape, {2}, "pack-quantized [out, in]");
    int64_t stored[2];
    memcpy(stored, store.data(*shape), sizeof stored);
    if (stored[0] != n || stored[1] != k)
      fail(ErrorCode::bad_format,
           format("%s holds %s but %s has shape %s, which packs a [%lld, %lld] (out, in) weight", shape->name.c_str(),
                  shape_text({stored[0], stored[1]}).c_str(), packed.name.c_str(), shape_text(packed.shape).c_str(),
                  (long long)n, (long long)k));
  }
  w.packed = store.data(packed);
  w.packed_cols = words;

  if (d.granularity != ScaleGranularity::group && d.granularity != ScaleGranularity::channel)
    fail(ErrorCode::unsupported, format("%s: int4 scales per %s are not supported; supported: group, channel",
                                        d.name.c_str(), scale_granularity_name(d.granularity)));
  w.granularity = d.granularity;
  w.group_size = d.granularity == ScaleGranularity::channel ? k : d.group_size;
  if (w.group_size <= 0 || k % w.group_size != 0)
    fail(ErrorCode::bad_format,
         format("%s: group_size %lld does not divide in_features %lld; groups must be whole (compressed-tensors "
                "refuses them too)",
                packed.name.c_str(), (long long)w.group_size, (long long)k));
  const int64_t groups = k / w.group_size;
  const TensorInfo& scale = require(store, p + "weight_scale", "a pack-quantized Linear needs its scales");
  expect_float_dtype(scale, "scales");
  const std::vector<int64_t> scale_shape{n, groups};
  if (scale.shape != scale_shape)
    bad_shape(scale, scale_shape,
              d.granularity == ScaleGranularity::channel
                  ? std::string("strategy channel")
                  : format("strategy group with group_size %lld over in_features %lld", (long long)w.group_size,
                           (long long)k));
  set_scales(w, store, scale, n, groups);
  w.rounding = DequantRounding::scale_dtype;

  const TensorInfo* zero = store.find(p + "weight_zero_point");
  if (!zero && !d.symmetric)
    fail(ErrorCode::missing_tensor, format("%sweight_zero_point is missing: the Linear is asymmetric", p.c_str()));
  if (zero) {
    expect_dtype(*zero, DType::I32, "pack-quantized");
    const std::vector<int64_t> zero_shape{ceil_div64(n, 8), groups};
    if (zero->shape != zero_shape) bad_shape(*zero, zero_shape, "a zero point per scale, packed 8 per I32 along out");
    w.zero_points = store.data(*zero);
  }

  const TensorInfo* g_idx = store.find(p + "weight_g_idx");
  if (!g_idx && d.has_g_idx)
    fail(ErrorCode::missing_tensor, format("%sweight_g_idx is missing: the Linear uses activation order", p.c_str()));
  if (g_idx) {
    expect_dtype(*g_idx, DType::I32, "pack-quantized");
    if (g_idx->shape != std::vector<int64_t>{k}) bad_shape(*g_idx, {k}, "one group index per input column");
    const uint8_t* bytes = store.data(*g_idx);
    std::vector<int64_t> members(size_t(groups), 0);
    bool column_order = false;
    for (int64_t c = 0; c < k; c++) {
      int32_t group;
      memcpy(&group, bytes + 4 * c, 4);
      if (group == -1) column_order = true;  // compressed-tensors' mark of an uncalibrated g_idx
      else if (group < 0 || group >= groups)
        fail(ErrorCode::bad_format, format("%s[%lld] = %d is not a group of %s (0..%lld)", g_idx->name.c_str(),
                                           (long long)c, group, scale.name.c_str(), (long long)(groups - 1)));
      else members[size_t(group)]++;
    }
    // compressed-tensors ignores a g_idx holding -1 (the columns keep their order); otherwise it sorts the
    // columns by group and cuts runs of group_size, which is column k -> group g_idx[k] only when every group
    // holds exactly group_size columns.
    if (!column_order) {
      for (int64_t g = 0; g < groups; g++)
        if (members[size_t(g)] != w.group_size)
          fail(ErrorCode::bad_format, format("%s assigns %lld columns to group %lld; each of the %lld groups must hold "
                                             "group_size %lld",
                                             g_idx->name.c_str(), (long long)members[size_t(g)], (long long)g,
                                             (long long)groups, (long long)w.group_size));
      w.g_idx = bytes;
    }
  }
}

inline void build_fp8(const LinearDesc& d, const TensorStore& store, QuantWeight& w) {
  const std::string p = d.name + ".";
  const int64_t n = d.out_features, k = d.in_features;
  const TensorInfo& weight = require(store, p + "weight", "an fp8 Linear stores its weights there");
  expect_dtype(weight, DType::F8_E4M3, "an fp8 Linear");
  if (weight.shape != std::vector<int64_t>{n, k}) bad_shape(weight, {n, k}, "[out, in]");
  w.fp8 = store.data(weight);
  if (const TensorInfo* zero = store.find(p + "weight_zero_point"))
    fail(ErrorCode::unsupported, format("%s: asymmetric fp8 weights are not supported", zero->name.c_str()));

  std::string scale_name = d.scale_name;
  if (scale_name.empty()) scale_name = store.find(p + "weight_scale_inv") ? "weight_scale_inv" : "weight_scale";
  if (scale_name != "weight_scale" && scale_name != "weight_scale_inv")
    fail(ErrorCode::bad_format, format("%s: scale name '%s' is neither weight_scale nor weight_scale_inv",
                                       d.name.c_str(), scale_name.c_str()));
  const TensorInfo& scale = require(store, p + scale_name, "an fp8 Linear needs its scales");
  expect_float_dtype(scale, "scales");
  w.rounding = scale_name == "weight_scale_inv" ? DequantRounding::f32 : DequantRounding::scale_dtype;
  w.granularity = d.granularity;
  switch (d.granularity) {
    case ScaleGranularity::tensor:
      if (scale.numel() != 1 || scale.shape.size() > 1) bad_shape(scale, {1}, "strategy tensor");
      set_scales(w, store, scale, 1, 1);
      break;
    case ScaleGranularity::channel:
      if (scale.shape != std::vector<int64_t>{n, 1}) bad_shape(scale, {n, 1}, "strategy channel");
      set_scales(w, store, scale, n, 1);
      break;
    case ScaleGranularity::block: {
      if (d.block_n <= 0 || d.block_k <= 0)
        fail(ErrorCode::bad_format, format("%s: block %lld x %lld must be positive", d.name.c_str(),
                                           (long long)d.block_n, (long long)d.block_k));
      const std::vector<int64_t> blocks{ceil_div64(n, d.block_n), ceil_div64(k, d.block_k)};
      if (scale.shape != blocks)
        bad_shape(scale, blocks, format("%lld x %lld blocks over [%lld, %lld]", (long long)d.block_n,
                                        (long long)d.block_k, (long long)n, (long long)k));
      w.block_n = d.block_n;
      w.block_k = d.block_k;
      set_scales(w, store, scale, blocks[0], blocks[1]);
      break;
    }
    default:
      fail(ErrorCode::unsupported, format("%s: fp8 scales per %s are not supported; supported: tensor, channel, block",
                                          d.name.c_str(), scale_granularity_name(d.granularity)));
  }
}

// e4m3 byte -> float, from base's converter once.
inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; v++) t[size_t(v)] = fp8_e4m3_to_float(uint8_t(v));
    return t;
  }();
  return table;
}

// ---- dot products in the CPU backend's order --------------------------------------------------------------
// 8 partial sums (element k goes to sum k % 8) over the largest multiple of 8, reduced in a fixed tree, then
// the remaining elements in order: the same order as the CPU backend's float32 linear.
constexpr int kLanes = 8;
inline float reduce_lanes(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// out[i][j] = x row i . w row j for a TOKENS x ROWS tile.
template <int TOKENS, int ROWS>
inline void dot_tile(const float* x, int64_t x_stride, const float* w, int64_t k_size, float (&out)[TOKENS][ROWS]) {
  float acc[TOKENS][ROWS][kLanes] = {};
  const int64_t main = k_size - k_size % kLanes;
  for (int64_t k = 0; k < main; k += kLanes)
    for (int i = 0; i < TOKENS; i++)
      for (int j = 0; j < ROWS; j++)
        for (int l = 0; l < kLanes; l++) acc[i][j][l] += x[i * x_stride + k + l] * w[j * k_size + k + l];
  for (int i = 0; i < TOKENS; i++)
    for (int j = 0; j < ROWS; j++) {
      float sum = reduce_lanes(acc[i][j]);
      for (int64_t k = main; k < k_size; k++) sum += x[i * x_stride + k] * w[j * k_size + k];
      out[i][j] = sum;
    }
}

}  // namespace quant

void dequantize_rows_unchecked(const QuantWeight& w, int64_t row0, int64_t rows, float* out) {
  const int64_t k_size = w.in_features;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t n = row0 + r;
    float* dst = out + r * k_size;  // [K]
    if (w.format == WeightFormat::int8) {
      const int8_t* q_row = reinterpret_cast<const int8_t*>(w.int8) + n * k_size;
      const int8_t* zero_row = w.zero_points ? reinterpret_cast<const int8_t*>(w.zero_points) + n * w.scale_cols : nullptr;
      const int64_t scale_row = n * w.scale_cols;
      for (int64_t k = 0; k < k_size; k++) {
        int32_t g = int32_t(k / w.group_size);
        if (w.g_idx) memcpy(&g, w.g_idx + 4 * k, 4);
        const int zero = zero_row ? int(zero_row[g]) : 0;
        dst[k] = dequantize_value(float(int(q_row[k]) - zero), scale_at(w.scales, w.scale_dtype, scale_row + g),
                                  w.scale_dtype, w.rounding);
      }
    } else if (w.format == WeightFormat::int4) {
      const uint8_t* packed_row = w.packed + 4 * n * w.packed_cols;
      const int64_t scale_row = n * w.scale_cols;
      if (w.g_idx) {  // activation order: each column names its group
        for (int64_t k = 0; k < k_size; k++) {
          int32_t g;
          memcpy(&g, w.g_idx + 4 * k, 4);
          const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
          dst[k] = dequantize_value(float(int4_packed_at(packed_row, k) - zero),
                                    scale_at(w.scales, w.scale_dtype, scale_row + g), w.scale_dtype, w.rounding);
        }
      } else {
        for (int64_t g = 0; g < w.scale_cols; g++) {
          const float scale = scale_at(w.scales, w.scale_dtype, scale_row + g);
          const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
          // A group has only 16 distinct weights: dequantize each once, then look the nibbles up.
          float table[16];
          for (int u = 0; u < 16; u++) table[u] = dequantize_value(float(u - 8 - zero), scale, w.scale_dtype, w.rounding);
          const int64_t k0 = g * w.group_size, k1 = k0 + w.group_size;
          if (w.group_size % 8 == 0) {  // whole words (every group size checkpoints use)
            for (int64_t word_index = k0 / 8; word_index < k1 / 8; word_index++) {
              const uint32_t word = load_u32_le(packed_row + 4 * word_index);
              for (int i = 0; i < 8; i++) dst[8 * word_index + i] = table[(word >> (4 * i)) & 0xfu];
            }
          } else {
            for (int64_t k = k0; k < k1; k++) dst[k] = table[int4_packed_at(packed_row, k) + 8];
          }
        }
      }
    } else {
      const std::array<float, 256>& fp8 = quant::fp8_table();
      const uint8_t* src = w.fp8 + n * k_size;
      // Runs of columns sharing one scale: the whole row (tensor, channel) or block_k columns (block).
      const int64_t run = w.granularity == ScaleGranularity::block ? w.block_k : k_size;
      const int64_t scale_row = w.granularity == ScaleGranularity::tensor  ? 0
                                : w.granularity == ScaleGranularity::block ? (n / w.block_n) * w.scale_cols
                                                                           : n;
      for (int64_t j = 0; j * run < k_size; j++) {
        const float scale = scale_at(w.scales, w.scale_dtype, scale_row + j);
        for (int64_t k = j * run; k < std::min(k_size, (j + 1) * run); k++)
          dst[k] = dequantize_value(fp8[src[k]], scale, w.scale_dtype, w.rounding);
      }
    }
  }
}

void quant_linear_block(const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& w, int64_t n0,
                        int64_t rows, float* scratch, void* out, int64_t out_stride, DType out_dtype,
                        DType weight_rounding) {
  const int64_t k_size = w.in_features;
  dequantize_rows_unchecked(w, n0, rows, scratch);  // scratch [rows, K]
  if (weight_rounding != DType::F32)
    for (int64_t i = 0; i < rows * k_size; i++) scratch[i] = round_to_dtype(scratch[i], weight_rounding);
  constexpr int kTileTokens = 4, kTileRows = 4;
  auto store = [&](int64_t t, int64_t n, float value) {
    if (w.bias) value = value + scale_at(w.bias, w.bias_dtype, n);
    const int64_t index = t * out_stride + n;
    switch (out_dtype) {
      case DType::BF16: static_cast<uint16_t*>(out)[index] = float_to_bf16(value); break;
      case DType::F16: static_cast<uint16_t*>(out)[index] = float_to_f16(value); break;
      default: static_cast<float*>(out)[index] = value;
    }
  };
  // Which tile shape computes an output changes nothing: every element sums in the same order.
  int64_t t = 0;
  for (; t + kTileTokens <= tokens; t += kTileTokens) {
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) {
      float tile[kTileTokens][kTileRows];
      quant::dot_tile<kTileTokens, kTileRows>(x + t * x_stride, x_stride, scratch + r * k_size, k_size, tile);
      for (int i = 0; i < kTileTokens; i++)
        for (int j = 0; j < kTileRows; j++) store(t + i, n0 + r + j, tile[i][j]);
    }
    for (; r < rows; r++) {
      float tile[kTileTokens][1];
      quant::dot_tile<kTileTokens, 1>(x + t * x_stride, x_stride, scratch + r * k_size, k_size, tile);
      for (int i = 0; i < kTileTokens; i++) store(t + i, n0 + r, tile[i][0]);
    }
  }
  for (; t < tokens; t++)
    for (int64_t r = 0; r < rows; r++) {
      float tile[1][1];
      quant::dot_tile<1, 1>(x + t * x_stride, x_stride, scratch + r * k_size, k_size, tile);
      store(t, n0 + r, tile[0][0]);
    }
}

}  // namespace detail

Result<QuantWeight> quant_weight(const LinearDesc& linear, const TensorStore& store) {
  return detail::guard([&] {
    if (linear.out_features <= 0 || linear.in_features <= 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%s: [%lld, %lld] (out, in) must be positive", linear.name.c_str(),
                                  (long long)linear.out_features, (long long)linear.in_features));
    QuantWeight w;
    w.name = linear.name;
    w.out_features = linear.out_features;
    w.in_features = linear.in_features;
    w.format = linear.format;
    if (linear.format == WeightFormat::int8) {
      Result<QuantWeight> view = int8_weight(linear, store);  // quant_formats.hpp
      if (!view) throw view.error();
      w = std::move(*view);
    } else if (linear.format == WeightFormat::int4 && linear.packing != IntPacking::compressed_tensors) {
      Result<QuantWeight> repacked = repack_awq_gptq(linear, store);  // quant_formats.hpp
      if (!repacked) throw repacked.error();
      w = std::move(*repacked);
    } else if (linear.format == WeightFormat::int4) detail::quant::build_int4(linear, store, w);
    else if (linear.format == WeightFormat::fp8) detail::quant::build_fp8(linear, store, w);
    else
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%s is %s, not a quantized format (int4, int8, fp8)", linear.name.c_str(),
                                  weight_format_name(linear.format)));
    detail::quant::check_bias(w, store, linear.name + ".");
    return w;
  });
}

namespace detail {

void fake_quantize_fp8_row(const float* x, int64_t cols, int64_t group, float* out) {
  const std::array<float, 256>& fp8 = quant::fp8_table();
  for (int64_t k0 = 0; k0 < cols; k0 += group) {
    const int64_t k1 = std::min(cols, k0 + group);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; k++) amax = std::max(amax, std::fabs(x[k]));
    float scale = amax / 448.0f;
    if (scale == 0.0f) scale = FLT_EPSILON;  // as quantize_fp8_activations
    for (int64_t k = k0; k < k1; k++) out[k] = fp8[float_to_fp8_e4m3(x[k] / scale + 0.0f)] * scale;
  }
}

void fake_quantize_int8_row(const float* x, int64_t cols, float* out) {
  // compressed-tensors' calculate_qparams (the range widened to hold 0, symmetric: max |bound| / (255 / 2)) and
  // quantize / dequantize (torch.round: half to even), in float32 as the reference runs them.
  float lo = 0.0f, hi = 0.0f;
  for (int64_t k = 0; k < cols; k++) lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
  float scale = std::max(std::fabs(lo), std::fabs(hi)) / 127.5f;
  if (scale == 0.0f) scale = FLT_EPSILON;
  for (int64_t k = 0; k < cols; k++) {
    // + 0: the reference adds its zero point (0), which turns -0 into +0
    const float q = std::min(127.0f, std::max(-128.0f, std::nearbyint(x[k] / scale + 0.0f)));
    out[k] = q * scale;
  }
}

}  // namespace detail

Status dequantize_rows(const QuantWeight& weight, int64_t row0, int64_t rows, float* out) {
  return detail::guard([&] {
    if (row0 < 0 || rows < 0 || row0 + rows > weight.out_features)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("dequantize_rows(%s): rows [%lld, %lld) are outside [0, %lld)", weight.name.c_str(),
                                  (long long)row0, (long long)(row0 + rows), (long long)weight.out_features));
    if (rows > 0 && !out) detail::fail(ErrorCode::invalid_argument, "dequantize_rows: out is null");
    detail::dequantize_rows_unchecked(weight, row0, rows, out);
  });
}

Status quantize_fp8_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride, int64_t group,
                                uint8_t* q, float* scales) {
  return detail::guard([&] {
    if (rows < 0 || cols <= 0 || group <= 0 || x_stride < cols)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quantize_fp8_activations: rows %lld, cols %lld, group %lld, x_stride %lld: need "
                                  "cols and group positive and x_stride >= cols",
                                  (long long)rows, (long long)cols, (long long)group, (long long)x_stride));
    const int64_t groups = (cols + group - 1) / group;
    for (int64_t r = 0; r < rows; r++) {
      const float* src = x + r * x_stride;
      for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * group, k1 = std::min(cols, k0 + group);
        float amax = 0.0f;
        for (int64_t k = k0; k < k1; k++) amax = std::max(amax, std::fabs(src[k]));
        float scale = amax / 448.0f;
        if (scale == 0.0f) scale = FLT_EPSILON;  // compressed-tensors' guard against dividing by zero
        scales[r * groups + g] = scale;
        for (int64_t k = k0; k < k1; k++) q[r * cols + k] = float_to_fp8_e4m3(src[k] / scale + 0.0f);
      }
    }
  });
}

namespace detail {
// work(i) for each i in [0, threads): 0 on the caller, the others on threads started here and joined before it
// returns. When the system refuses a thread, the ones already started finish before the error is rethrown.
template <class Work>
void run_on_threads(int threads, const Work& work) {
  std::vector<std::thread> helpers;
  helpers.reserve(size_t(std::max(0, threads - 1)));
  try {
    for (int i = 1; i < threads; i++) helpers.emplace_back(work, i);
  } catch (...) {
    for (std::thread& helper : helpers) helper.join();
    throw;
  }
  work(0);
  for (std::thread& helper : helpers) helper.join();
}
}  // namespace detail

Status quant_linear(const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& weight, float* out,
                    int64_t out_stride, const QuantLinearOptions& options) {
  return detail::guard([&] {
    const int64_t n_size = weight.out_features, k_size = weight.in_features;
    if (tokens < 0 || x_stride < k_size || out_stride < n_size || options.threads < 1)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quant_linear(%s): tokens %lld, x_stride %lld (>= in %lld), out_stride %lld "
                                  "(>= out %lld), threads %d (>= 1)",
                                  weight.name.c_str(), (long long)tokens, (long long)x_stride, (long long)k_size,
                                  (long long)out_stride, (long long)n_size, options.threads));
    if (tokens == 0) return;
    if (!x || !out) detail::fail(ErrorCode::invalid_argument, "quant_linear: x or out is null");

    std::vector<float> requantized;  // [T, K] when activations go through fp8 or int8
    if (weight.format == WeightFormat::int8 && weight.int8_activations) {  // W8A8: the checkpoint's own semantics
      requantized.resize(size_t(tokens * k_size));
      for (int64_t t = 0; t < tokens; t++)
        detail::fake_quantize_int8_row(x + t * x_stride, k_size, requantized.data() + t * k_size);
      x = requantized.data();
      x_stride = k_size;
    } else if (options.fp8_activations) {
      if (weight.format != WeightFormat::fp8)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("quant_linear(%s): fp8 activations go with fp8 weights, not %s",
                                    weight.name.c_str(), weight_format_name(weight.format)));
      const int64_t group = detail::fp8_activation_group(weight);
      requantized.resize(size_t(tokens * k_size));
      for (int64_t t = 0; t < tokens; t++)
        detail::fake_quantize_fp8_row(x + t * x_stride, k_size, group, requantized.data() + t * k_size);
      x = requantized.data();
      x_stride = k_size;
    }

    // Work item b = rows [16 b, 16 b + 16); thread i takes items i, i + threads, ... (results do not depend
    // on who computes an item).
    const int64_t blocks = (n_size + detail::kQuantRowBlock - 1) / detail::kQuantRowBlock;
    const int threads = int(std::min<int64_t>(options.threads, blocks));
    const int64_t scratch_floats = detail::kQuantRowBlock * k_size;
    std::vector<float> scratch(size_t(threads * scratch_floats));  // [threads, 16, K]
    auto work = [&](int thread) {  // allocates nothing and cannot throw
      for (int64_t b = thread; b < blocks; b += threads) {
        const int64_t n0 = b * detail::kQuantRowBlock;
        detail::quant_linear_block(x, x_stride, tokens, weight, n0, std::min(detail::kQuantRowBlock, n_size - n0),
                                   scratch.data() + thread * scratch_floats, out, out_stride);
      }
    };
    detail::run_on_threads(threads, work);
  });
}

int64_t int8_copy_group_size(int64_t K) {
  for (int64_t group : {128, 64, 32})
    if (K % group == 0) return group;
  return K;
}

uint64_t int8_copy_bytes(int64_t N, int64_t K) {
  if (N <= 0 || K <= 0) return 0;
  const uint64_t row = uint64_t(K) + 4 * uint64_t(K / int8_copy_group_size(K));  // codes, then F32 scales
  uint64_t bytes = 0;
  return __builtin_mul_overflow(uint64_t(N), row, &bytes) ? UINT64_MAX : bytes;  // (quantize_int8_copy refuses that)
}

Result<QuantWeight> quantize_int8_copy(const Tensor& weight, const std::string& name, int threads) {
  return detail::guard([&]() -> QuantWeight {
    const int64_t N = weight.rows, K = weight.cols;
    if (!weight.data || N <= 0 || K <= 0 || N > limits::max_vocab || K > limits::max_model_width ||
        weight.row_stride < K)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quantize_int8_copy(%s): a [%lld, %lld] matrix (row stride %lld); need data, "
                                  "1..%lld rows (KVLITE_MAX_VOCAB), 1..%lld columns (KVLITE_MAX_MODEL_WIDTH) and "
                                  "row stride >= columns", name.c_str(), (long long)N, (long long)K,
                                  (long long)weight.row_stride, (long long)limits::max_vocab,
                                  (long long)limits::max_model_width));
    if (weight.dtype != DType::BF16 && weight.dtype != DType::F16 && weight.dtype != DType::F32)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quantize_int8_copy(%s): weights of dtype %s; it reads BF16, F16 or F32",
                                  name.c_str(), dtype_name(weight.dtype)));
    if (threads < 1) detail::fail(ErrorCode::invalid_argument, "quantize_int8_copy: threads must be >= 1");
    const int64_t group = int8_copy_group_size(K), groups = K / group;
    const uint64_t q_bytes = detail::checked_mul(uint64_t(N), uint64_t(K), "int8 copy", ErrorCode::invalid_argument);
    auto storage = std::make_shared<std::vector<uint8_t>>(size_t(int8_copy_bytes(N, K)), uint8_t(0));
    uint8_t* q = storage->data();
    uint8_t* scales = q + q_bytes;  // F32 [N, groups], read through load_u32_le (no alignment needed)
    auto element = [&](const uint8_t* row, int64_t k) { return scale_at(row, weight.dtype, k); };  // F32/BF16/F16
    const int workers = int(std::min<int64_t>(threads, N));
    auto rows = [&](int worker) {  // rows worker, worker + workers, ...
      const int64_t row_bytes = weight.row_stride * weight.element_bytes();
      for (int64_t n = worker; n < N; n += workers) {
        const uint8_t* row = static_cast<const uint8_t*>(weight.data) + n * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
          float amax = 0.0f;
          for (int64_t k = g * group; k < (g + 1) * group; k++) amax = std::max(amax, std::fabs(element(row, k)));
          const float scale = amax / 127.0f;
          const uint32_t scale_bits = float_to_bits(scale);
          memcpy(scales + 4 * (n * groups + g), &scale_bits, 4);
          for (int64_t k = g * group; k < (g + 1) * group; k++) {
            // a NaN or inf weight makes amax non-finite: its group's codes are 0 and its scale says why
            const float v = scale > 0.0f && std::isfinite(scale) ? std::nearbyint(element(row, k) / scale) : 0.0f;
            q[n * K + k] = uint8_t(int8_t(std::max(-127.0f, std::min(127.0f, v))));
          }
        }
      }
    };
    detail::run_on_threads(workers, rows);

    QuantWeight w;
    w.name = name;
    w.out_features = N;
    w.in_features = K;
    w.format = WeightFormat::int8;
    w.granularity = groups == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
    w.int8 = q;
    w.group_size = group;
    w.scales = scales;
    w.scale_dtype = DType::F32;
    w.scale_rows = N;
    w.scale_cols = groups;
    w.layout = QuantLayout::checkpoint;
    w.storage = std::move(storage);
    return w;
  });
}

}  // namespace kvlite
