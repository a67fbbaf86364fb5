// Quantized Linears for the tests. Made by hand (QuantWeight views over tensors they own): int4 with every
// nibble value, zero points and act-order; fp8 cycling through every finite e4m3 code; scales of any dtype.
// Read from the fixtures: odd_linear_desc, the descriptor of an entry of tests/fixtures/quant/odd-linears.
#pragma once
#include "kvlite.hpp"
#include "host_floats.hpp"

#include <algorithm>
#include <random>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

namespace quant_test {

using namespace kvlite;
using host_floats::Random;

// Owns the tensors a hand-made QuantWeight points into.
struct OwnedWeight {
  QuantWeight weight;
  std::vector<uint8_t> packed, zeros, g_idx, fp8, scales, bias;
};

inline void put_scales(OwnedWeight& o, DType dtype, int64_t rows, int64_t cols, Random& rng, float lo, float hi) {
  const size_t element = size_t(dtype_bytes(dtype, 1));
  o.scales.assign(size_t(rows * cols) * element, 0);
  for (int64_t i = 0; i < rows * cols; i++) {
    const float value = rng.uniform(lo, hi) * (rng.below(2) ? 1.0f : -1.0f);
    host_floats::encode(dtype, value, &o.scales[size_t(i) * element]);
  }
  o.weight.scales = o.scales.data();
  o.weight.scale_dtype = dtype;
  o.weight.scale_rows = rows;
  o.weight.scale_cols = cols;
}

// Act-order: a shuffled g_idx over K columns, each group holding group_size of them.
inline void put_act_order(OwnedWeight& o, int64_t k, int64_t group, Random& rng) {
  std::vector<int32_t> groups_of(static_cast<size_t>(k));
  for (int64_t c = 0; c < k; c++) groups_of[size_t(c)] = int32_t(c / group);
  std::shuffle(groups_of.begin(), groups_of.end(), rng.engine);
  o.g_idx.resize(size_t(k) * 4);
  memcpy(o.g_idx.data(), groups_of.data(), o.g_idx.size());
  o.weight.g_idx = o.g_idx.data();
}

// int4 [N, K] with every nibble value, random scales of `scale_dtype`; zero points (every value) when
// asymmetric; act-order (a shuffled g_idx, each group holding group_size columns) when act_order.
inline OwnedWeight make_int4(int64_t n, int64_t k, int64_t group, DType scale_dtype, bool asymmetric, bool act_order,
                      Random& rng) {
  OwnedWeight o;
  QuantWeight& w = o.weight;
  w.name = "hand.int4";
  w.out_features = n;
  w.in_features = k;
  w.format = WeightFormat::int4;
  w.granularity = group == k ? ScaleGranularity::channel : ScaleGranularity::group;
  w.group_size = group;
  w.packed_cols = (k + 7) / 8;
  o.packed.assign(size_t(n * w.packed_cols * 4), 0);
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < k; c++)
      o.packed[size_t(4 * (r * w.packed_cols + c / 8) + (c % 8) / 2)] |=
          uint8_t(((r * 7 + c * 3 + rng.below(16)) % 16) << (4 * (c % 2)));
  w.packed = o.packed.data();
  const int64_t groups = k / group;
  put_scales(o, scale_dtype, n, groups, rng, 0.002f, 0.05f);
  if (asymmetric) {
    o.zeros.assign(size_t((n + 7) / 8 * groups * 4), 0);
    for (int64_t r = 0; r < n; r++)
      for (int64_t g = 0; g < groups; g++)
        o.zeros[size_t(4 * ((r / 8) * groups + g) + (r % 8) / 2)] |= uint8_t(((r + 5 * g) % 16) << (4 * (r % 2)));
    w.zero_points = o.zeros.data();
  }
  if (act_order) put_act_order(o, k, group, rng);
  return o;
}

// int8 [N, K] (GPTQ 8-bit / compressed-tensors INT8) with every value -128..127, random scales of `scale_dtype`
// [N, ceil(K / group)]; I8 zero points (every value) when asymmetric; act-order (a shuffled g_idx, each group
// holding `group` columns; K a multiple of group) when act_order; W8A8 (int8 activations) when w8a8.
inline OwnedWeight make_int8(int64_t n, int64_t k, int64_t group, DType scale_dtype, bool asymmetric, bool act_order,
                             bool w8a8, Random& rng) {
  OwnedWeight o;
  QuantWeight& w = o.weight;
  w.name = "hand.int8";
  w.out_features = n;
  w.in_features = k;
  w.format = WeightFormat::int8;
  w.granularity = group == k ? ScaleGranularity::channel : ScaleGranularity::group;
  w.group_size = group;
  w.int8_activations = w8a8;
  o.packed.resize(size_t(n * k));  // the int8 values
  for (int64_t i = 0; i < n * k; i++) o.packed[size_t(i)] = uint8_t((i * 37 + rng.below(256)) % 256);
  w.int8 = o.packed.data();
  const int64_t groups = (k + group - 1) / group;
  put_scales(o, scale_dtype, n, groups, rng, 0.00002f, 0.005f);  // F16 subnormal products too
  if (asymmetric) {
    o.zeros.resize(size_t(n * groups));
    for (auto& zero : o.zeros) zero = uint8_t(rng.below(256));
    w.zero_points = o.zeros.data();
  }
  if (act_order) put_act_order(o, k, group, rng);
  return o;
}

// fp8 [N, K] cycling through every e4m3 code but the two NaNs; `granularity` tensor, channel or block.
inline OwnedWeight make_fp8(int64_t n, int64_t k, ScaleGranularity granularity, int64_t block_n, int64_t block_k,
                     DType scale_dtype, DequantRounding rounding, Random& rng) {
  OwnedWeight o;
  QuantWeight& w = o.weight;
  w.name = "hand.fp8";
  w.out_features = n;
  w.in_features = k;
  w.format = WeightFormat::fp8;
  w.granularity = granularity;
  w.rounding = rounding;
  o.fp8.resize(size_t(n * k));
  int code = int(rng.below(256));
  for (auto& byte : o.fp8) {
    do code = (code + 1) % 256;
    while ((code & 0x7f) == 0x7f);
    byte = uint8_t(code);
  }
  w.fp8 = o.fp8.data();
  if (granularity == ScaleGranularity::block) {
    w.block_n = block_n;
    w.block_k = block_k;
    put_scales(o, scale_dtype, (n + block_n - 1) / block_n, (k + block_k - 1) / block_k, rng, 0.0005f, 0.02f);
  } else {
    put_scales(o, scale_dtype, granularity == ScaleGranularity::channel ? n : 1, 1, rng, 0.0005f, 0.02f);
  }
  return o;
}

// A bias of `dtype` (values in [-1, 1]) for `o`.
inline void add_bias(OwnedWeight& o, DType dtype, Random& rng) {
  const size_t element = size_t(dtype_bytes(dtype, 1));
  o.bias.assign(size_t(o.weight.out_features) * element, 0);
  for (int64_t n = 0; n < o.weight.out_features; n++) {
    const float value = rng.uniform(-1.0f, 1.0f);
    host_floats::encode(dtype, value, &o.bias[size_t(n) * element]);
  }
  o.weight.bias = o.bias.data();
  o.weight.bias_dtype = dtype;
}

// Parts stacked along N into one checkpoint-layout weight: what a fused device Linear (quant_gpu.hpp) must compute,
// made without the fusion code. int4: rows, scales and zero points (every part but the last a multiple of 8 rows);
// fp8: rows and scales, tensor and channel scales as channel scales, block scales as rows of blocks (every part but
// the last a multiple of block_n, one block size); biases widened to F32, zeros for a part without one.
inline OwnedWeight concatenate_rows(const std::vector<const QuantWeight*>& parts) {
  OwnedWeight o;
  QuantWeight& w = o.weight;
  w = *parts[0];
  w.name = "hand.concatenated";
  w.out_features = 0;
  for (const QuantWeight* p : parts) w.out_features += p->out_features;
  const size_t element = size_t(dtype_bytes(w.scale_dtype, 1));
  auto append = [](std::vector<uint8_t>& to, const uint8_t* from, size_t bytes) { to.insert(to.end(), from, from + bytes); };
  for (const QuantWeight* p : parts) {
    const size_t n = size_t(p->out_features), k = size_t(p->in_features);
    if (w.format == WeightFormat::int4) {
      append(o.packed, p->packed, n * size_t(p->packed_cols) * 4);
      append(o.scales, p->scales, n * size_t(p->scale_cols) * element);
      if (p->zero_points) append(o.zeros, p->zero_points, (n + 7) / 8 * size_t(p->scale_cols) * 4);
    } else {
      append(o.fp8, p->fp8, n * k);
      if (p->granularity == ScaleGranularity::block) {
        append(o.scales, p->scales, size_t(p->scale_rows * p->scale_cols) * element);
      } else {
        for (size_t r = 0; r < n; r++)
          append(o.scales, p->scales + (p->granularity == ScaleGranularity::tensor ? 0 : r) * element, element);
      }
    }
  }
  bool any_bias = false;
  for (const QuantWeight* p : parts) any_bias = any_bias || p->bias != nullptr;
  if (any_bias) {
    o.bias.assign(size_t(w.out_features) * 4, 0);
    int64_t row = 0;
    for (const QuantWeight* p : parts) {
      for (int64_t n = 0; p->bias && n < p->out_features; n++) {
        const float value = scale_at(p->bias, p->bias_dtype, n);
        memcpy(&o.bias[size_t(row + n) * 4], &value, 4);
      }
      row += p->out_features;
    }
  }
  w.packed = o.packed.empty() ? nullptr : o.packed.data();
  w.fp8 = o.fp8.empty() ? nullptr : o.fp8.data();
  w.zero_points = o.zeros.empty() ? nullptr : o.zeros.data();
  w.scales = o.scales.data();
  w.bias = any_bias ? o.bias.data() : nullptr;
  w.bias_dtype = DType::F32;
  if (w.format == WeightFormat::fp8 && w.granularity != ScaleGranularity::block) {
    w.granularity = ScaleGranularity::channel;
    w.scale_rows = w.out_features;
    w.scale_cols = 1;
  } else if (w.format == WeightFormat::fp8) {
    w.scale_rows = int64_t(o.scales.size() / element) / w.scale_cols;
  } else {
    w.scale_rows = w.out_features;
  }
  return o;
}

// The descriptor of one entry of odd-linears/linears.json (compressed-tensors' quantization scheme of the Linear).
inline LinearDesc odd_linear_desc(const nlohmann::json& entry) {
  LinearDesc d;
  d.name = entry["name"];
  d.out_features = entry["out_features"];
  d.in_features = entry["in_features"];
  const nlohmann::json& weights = entry["weights"];
  const std::string strategy = weights["strategy"];
  d.format = entry["format"] == "pack-quantized" ? WeightFormat::int4 : WeightFormat::fp8;
  d.granularity = strategy == "group"     ? ScaleGranularity::group
                  : strategy == "channel" ? ScaleGranularity::channel
                  : strategy == "block"   ? ScaleGranularity::block
                                          : ScaleGranularity::tensor;
  if (weights.contains("group_size") && !weights["group_size"].is_null()) d.group_size = weights["group_size"];
  if (weights.contains("block_structure") && !weights["block_structure"].is_null()) {
    d.block_n = weights["block_structure"][0];
    d.block_k = weights["block_structure"][1];
  }
  d.symmetric = weights.value("symmetric", true);
  d.has_g_idx = weights.contains("actorder") && weights["actorder"] == "group";
  d.scale_name = entry["scale_name"];
  return d;
}

}  // namespace quant_test
