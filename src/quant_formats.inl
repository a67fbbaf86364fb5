// quant_formats: implementation.
#include <memory>

namespace kvlite {
namespace detail {
namespace quant_formats {

inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline const TensorInfo& require(const TensorStore& store, const std::string& name, const char* why) {
  const TensorInfo* tensor = store.find(name);
  if (!tensor) fail(ErrorCode::missing_tensor, format("%s is missing: %s", name.c_str(), why));
  return *tensor;
}

inline void expect(const TensorInfo& tensor, DType dtype, const std::vector<int64_t>& shape, const std::string& what) {
  if (tensor.dtype != dtype)
    fail(ErrorCode::bad_format, format("%s has dtype %s; %s stores it as %s", tensor.name.c_str(),
                                       dtype_name(tensor.dtype), what.c_str(), dtype_name(dtype)));
  if (tensor.shape != shape)
    fail(ErrorCode::bad_format, format("%s has shape %s but %s expects %s", tensor.name.c_str(),
                                       cfg::shape_text(tensor.shape).c_str(), what.c_str(), cfg::shape_text(shape).c_str()));
}

inline uint32_t word_at(const uint8_t* words, int64_t index) { return load_u32_le(words + 4 * index); }

// Offsets of the view's tensors inside its one buffer (each 4-byte aligned).
struct ViewLayout {
  uint64_t packed = 0, scales = 0, zeros = 0, g_idx = 0, total = 0;
};
inline ViewLayout view_layout(int64_t n, int64_t k, int64_t groups, DType scale_dtype, bool zeros, bool g_idx) {
  ViewLayout v;
  uint64_t at = 0;
  v.packed = at;
  at += uint64_t(n) * uint64_t(ceil_div64(k, 8)) * 4;  // weight_packed [N, K/8] I32
  v.scales = at;
  at += (dtype_bytes(scale_dtype, uint64_t(n) * uint64_t(groups)) + 3) / 4 * 4;  // [N, G]
  v.zeros = at;
  if (zeros) at += uint64_t(ceil_div64(n, 8)) * uint64_t(groups) * 4;  // [ceil(N/8), G] I32
  v.g_idx = at;
  if (g_idx) at += uint64_t(k) * 4;  // [K] I32
  v.total = at;
  return v;
}

// The group of every input column from a g_idx tensor: empty when it is k / group_size (column order, dropped),
// else the values, each group holding exactly group_size columns (what the reference's sort-and-cut requires).
inline std::vector<int32_t> act_order_groups(const TensorInfo& tensor, const uint8_t* bytes, int64_t k,
                                             int64_t group_size, const std::string& scales_name) {
  const int64_t groups = k / group_size;
  std::vector<int32_t> g_idx(static_cast<size_t>(k));
  std::vector<int64_t> members(static_cast<size_t>(groups), 0);
  bool column_order = true;
  for (int64_t row = 0; row < k; row++) {
    int32_t group;
    memcpy(&group, bytes + 4 * row, 4);
    if (group < 0 || group >= groups)
      fail(ErrorCode::bad_format, format("%s[%lld] = %d is not a group of %s (0..%lld)", tensor.name.c_str(),
                                         (long long)row, group, scales_name.c_str(), (long long)(groups - 1)));
    g_idx[size_t(row)] = group;
    members[size_t(group)]++;
    column_order = column_order && group == row / group_size;
  }
  if (column_order) return {};
  for (int64_t g = 0; g < groups; g++)
    if (members[size_t(g)] != group_size)
      fail(ErrorCode::bad_format,
           format("%s assigns %lld input rows to group %lld; each of the %lld groups must hold group_size %lld "
                  "(static_groups or a truncated g_idx?)",
                  tensor.name.c_str(), (long long)members[size_t(g)], (long long)g, (long long)groups,
                  (long long)group_size));
  return g_idx;
}

// int8 view: q [N, K], scales [N, G], zeros I8 [N, G], g_idx [K].
struct Int8Layout {
  uint64_t q = 0, scales = 0, zeros = 0, g_idx = 0, total = 0;
};
inline Int8Layout int8_layout(int64_t n, int64_t k, int64_t groups, DType scale_dtype, bool zeros, bool g_idx) {
  Int8Layout v;
  uint64_t at = uint64_t(n) * uint64_t(k);
  at = (at + 3) / 4 * 4;
  v.scales = at;
  at += (dtype_bytes(scale_dtype, uint64_t(n) * uint64_t(groups)) + 3) / 4 * 4;
  v.zeros = at;
  if (zeros) at += (uint64_t(n) * uint64_t(groups) + 3) / 4 * 4;
  v.g_idx = at;
  if (g_idx) at += uint64_t(k) * 4;
  v.total = at;
  return v;
}

}  // namespace quant_formats
}  // namespace detail

uint64_t repacked_host_bytes(const LinearDesc& d) {
  if (d.group_size <= 0 || d.packing == IntPacking::compressed_tensors_unpacked) return 0;
  const int64_t groups = d.in_features / d.group_size;
  if (d.format == WeightFormat::int8)  // every 8-bit packing but int-quantized is repacked
    return detail::quant_formats::int8_layout(d.out_features, d.in_features, groups, d.scale_dtype, !d.symmetric,
                                              d.has_g_idx)
        .total;
  if (d.format != WeightFormat::int4 || d.packing == IntPacking::compressed_tensors) return 0;
  return detail::quant_formats::view_layout(d.out_features, d.in_features, groups, d.scale_dtype, !d.symmetric,
                                            d.has_g_idx)
      .total;
}

Result<QuantWeight> int8_weight(const LinearDesc& d, const TensorStore& store) {
  return detail::guard([&]() -> QuantWeight {
    using namespace detail;
    using namespace detail::quant_formats;
    const int64_t n = d.out_features, k = d.in_features;
    if (d.format != WeightFormat::int8)
      fail(ErrorCode::invalid_argument, format("int8_weight(%s): not an int8 Linear", d.name.c_str()));
    if (n <= 0 || k <= 0 || d.group_size <= 0 || k % d.group_size != 0)
      fail(ErrorCode::bad_format, format("%s: [out %lld, in %lld] with group_size %lld: groups must be whole",
                                         d.name.c_str(), (long long)n, (long long)k, (long long)d.group_size));
    const int64_t groups = k / d.group_size;
    const std::string p = d.name + ".";
    const bool gptq = d.packing == IntPacking::gptq || d.packing == IntPacking::gptq_v2;
    const bool unpacked = d.packing == IntPacking::compressed_tensors_unpacked;
    if (d.packing == IntPacking::awq)
      fail(ErrorCode::unsupported, format("%s: AWQ is 4-bit only", d.name.c_str()));

    const std::string scale_name = p + (gptq ? "scales" : "weight_scale");
    const TensorInfo& scales = require(store, scale_name, "an int8 Linear needs its scales");
    if (scales.dtype != DType::F16 && scales.dtype != DType::BF16 && scales.dtype != DType::F32)
      fail(ErrorCode::unsupported, format("%s has dtype %s; scales are supported as F32, BF16 or F16",
                                          scales.name.c_str(), dtype_name(scales.dtype)));
    expect(scales, scales.dtype, gptq ? std::vector<int64_t>{groups, n} : std::vector<int64_t>{n, groups},
           gptq ? "GPTQ scales [groups, out]" : "int8 weight_scale [out, groups]");
    const TensorInfo* g_idx_tensor = store.find(p + (gptq ? "g_idx" : "weight_g_idx"));
    if (g_idx_tensor) expect(*g_idx_tensor, DType::I32, {k}, "g_idx (one group per input column)");
    else if (d.has_g_idx && !gptq)
      fail(ErrorCode::missing_tensor, format("%sweight_g_idx is missing: the Linear uses activation order", p.c_str()));
    std::vector<int32_t> g_idx;
    if (g_idx_tensor) g_idx = act_order_groups(*g_idx_tensor, store.data(*g_idx_tensor), k, d.group_size, scales.name);

    QuantWeight w;
    w.name = d.name;
    w.out_features = n;
    w.in_features = k;
    w.format = WeightFormat::int8;
    w.granularity = groups == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
    w.group_size = d.group_size;
    w.scale_dtype = scales.dtype;
    w.scale_rows = n;
    w.scale_cols = groups;
    w.rounding = DequantRounding::scale_dtype;
    w.int8_activations = d.int8_activations;

    if (unpacked) {  // compressed-tensors int-quantized: used in place
      const TensorInfo& weight = require(store, p + "weight", "an int-quantized Linear stores its int8 weights there");
      expect(weight, DType::I8, {n, k}, "int-quantized [out, in]");
      w.int8 = store.data(weight);
      w.scales = store.data(scales);
      if (const TensorInfo* zero = store.find(p + "weight_zero_point")) {
        expect(*zero, DType::I8, {n, groups}, "an int8 zero point per scale");
        w.zero_points = store.data(*zero);
      } else if (!d.symmetric) {
        fail(ErrorCode::missing_tensor, format("%sweight_zero_point is missing: the Linear is asymmetric", p.c_str()));
      }
      if (!g_idx.empty()) w.g_idx = store.data(*g_idx_tensor);
      return w;
    }

    // Packed 4 bytes a word: unpack q (signed) and the zero points first.
    std::vector<int8_t> zero(size_t(n * groups), 0);  // [N, G]
    bool any_zero = false;
    const TensorInfo* zeros = store.find(p + (gptq ? "qzeros" : "weight_zero_point"));
    if (gptq) {
      const TensorInfo& qzeros = require(store, p + "qzeros", "GPTQ stores its zero points there");
      if (n % 4 != 0) fail(ErrorCode::bad_format, format("%s: out_features %lld is not a multiple of 4", d.name.c_str(), (long long)n));
      expect(qzeros, DType::I32, {groups, n / 4}, "GPTQ 8-bit zero points packed 4 per I32 along out");
      const uint8_t* bytes = store.data(qzeros);
      const int offset = d.packing == IntPacking::gptq ? 1 : 0;  // v1 stores z - 1
      for (int64_t g = 0; g < groups; g++)
        for (int64_t col = 0; col < n; col++) {
          const int z = int(bytes[4 * (g * (n / 4) + col / 4) + col % 4]) + offset;
          if (z > 255)
            fail(ErrorCode::unsupported,
                 format("%s stores 255 for group %lld, column %lld: GPTQ v1's zero - 1 makes that a zero point of 256, "
                        "outside int8; re-save the checkpoint as gptq_v2",
                        qzeros.name.c_str(), (long long)g, (long long)col));
          zero[size_t(col * groups + g)] = int8_t(z - 128);
          any_zero = any_zero || z != 128;
        }
    } else if (zeros) {
      const std::vector<int64_t> shape{(n + 3) / 4, groups};
      expect(*zeros, DType::I32, shape, "an 8-bit zero point packed 4 per I32 along out");
      const uint8_t* bytes = store.data(*zeros);
      for (int64_t col = 0; col < n; col++)
        for (int64_t g = 0; g < groups; g++) {
          const int z = int(bytes[4 * ((col / 4) * groups + g) + col % 4]) - 128;
          zero[size_t(col * groups + g)] = int8_t(z);
          any_zero = any_zero || z != 0;
        }
    } else if (!d.symmetric) {
      fail(ErrorCode::missing_tensor, format("%sweight_zero_point is missing: the Linear is asymmetric", p.c_str()));
    }

    const Int8Layout v = int8_layout(n, k, groups, scales.dtype, any_zero, !g_idx.empty());
    auto storage = std::make_shared<std::vector<uint8_t>>(size_t(v.total), uint8_t(0));
    uint8_t* base = storage->data();
    if (gptq) {
      const TensorInfo& qweight = require(store, p + "qweight", "GPTQ stores its int8 weights there");
      if (k % 4 != 0) fail(ErrorCode::bad_format, format("%s: in_features %lld is not a multiple of 4", d.name.c_str(), (long long)k));
      expect(qweight, DType::I32, {k / 4, n}, "GPTQ 8-bit packed 4 per I32 along in");
      const uint8_t* bytes = store.data(qweight);
      for (int64_t i = 0; i < k / 4; i++)
        for (int64_t col = 0; col < n; col++)
          for (int j = 0; j < 4; j++) base[v.q + col * k + 4 * i + j] = uint8_t(bytes[4 * (i * n + col) + j] ^ 0x80u);
      // scales [G, N] -> [N, G]
      const size_t element = size_t(dtype_bytes(scales.dtype, 1));
      const uint8_t* src = store.data(scales);
      for (int64_t g = 0; g < groups; g++)
        for (int64_t col = 0; col < n; col++)
          memcpy(base + v.scales + (col * groups + g) * element, src + (g * n + col) * element, element);
    } else {
      const TensorInfo& packed = require(store, p + "weight_packed", "a pack-quantized Linear stores its weights there");
      const int64_t words = (k + 3) / 4;
      expect(packed, DType::I32, {n, words}, "8-bit pack-quantized [out, in / 4]");
      if (const TensorInfo* shape = store.find(p + "weight_shape")) {
        expect(*shape, DType::I64, {2}, "pack-quantized [out, in]");
        int64_t stored[2];
        memcpy(stored, store.data(*shape), sizeof stored);
        if (stored[0] != n || stored[1] != k)
          fail(ErrorCode::bad_format, format("%s holds [%lld, %lld] but the Linear is [%lld, %lld] (out, in)",
                                             shape->name.c_str(), (long long)stored[0], (long long)stored[1],
                                             (long long)n, (long long)k));
      }
      const uint8_t* bytes = store.data(packed);
      for (int64_t col = 0; col < n; col++)
        for (int64_t c = 0; c < k; c++) base[v.q + col * k + c] = uint8_t(bytes[4 * col * words + c] ^ 0x80u);
      memcpy(base + v.scales, store.data(scales), size_t(dtype_bytes(scales.dtype, uint64_t(n * groups))));
    }
    if (any_zero) memcpy(base + v.zeros, zero.data(), zero.size());
    if (!g_idx.empty()) memcpy(base + v.g_idx, g_idx.data(), g_idx.size() * 4);
    w.int8 = base + v.q;
    w.scales = base + v.scales;
    w.zero_points = any_zero ? base + v.zeros : nullptr;
    w.g_idx = g_idx.empty() ? nullptr : base + v.g_idx;
    w.storage = std::move(storage);
    return w;
  });
}

Result<QuantWeight> repack_awq_gptq(const LinearDesc& d, const TensorStore& store) {
  return detail::guard([&]() -> QuantWeight {
    using namespace detail;
    using namespace detail::quant_formats;
    const int64_t n = d.out_features, k = d.in_features;
    const bool awq = d.packing == IntPacking::awq;
    if (d.format != WeightFormat::int4 || d.packing == IntPacking::compressed_tensors)
      fail(ErrorCode::invalid_argument, format("repack_awq_gptq(%s): not an AWQ / GPTQ Linear", d.name.c_str()));
    if (n <= 0 || k <= 0 || n % 8 != 0 || k % 8 != 0 || d.group_size <= 0 || k % d.group_size != 0)
      fail(ErrorCode::bad_format, format("%s: [out %lld, in %lld] with group_size %lld: AWQ / GPTQ need multiples of "
                                         "8 and whole groups",
                                         d.name.c_str(), (long long)n, (long long)k, (long long)d.group_size));
    const int64_t groups = k / d.group_size;
    const std::string p = d.name + ".";
    const char* method = awq ? "AWQ" : "GPTQ";

    const TensorInfo& qweight = require(store, p + "qweight", "an AWQ / GPTQ Linear stores its int4 weights there");
    expect(qweight, DType::I32, awq ? std::vector<int64_t>{k, n / 8} : std::vector<int64_t>{k / 8, n},
           format("%s int4 packed 8 per I32", method));
    const TensorInfo& scales = require(store, p + "scales", "an AWQ / GPTQ Linear needs its scales");
    if (scales.dtype != DType::F16 && scales.dtype != DType::BF16 && scales.dtype != DType::F32)
      fail(ErrorCode::unsupported, format("%s has dtype %s; scales are supported as F32, BF16 or F16",
                                          scales.name.c_str(), dtype_name(scales.dtype)));
    expect(scales, scales.dtype, {groups, n}, format("%s scales [groups, out]", method));
    const TensorInfo* qzeros = store.find(p + "qzeros");
    if (qzeros) expect(*qzeros, DType::I32, {groups, n / 8}, format("%s zero points packed 8 per I32 along out", method));
    else if (!awq || !d.symmetric)
      fail(ErrorCode::missing_tensor, format("%sqzeros is missing: %s stores its zero points there", p.c_str(), method));
    const TensorInfo* g_idx_tensor = awq ? nullptr : store.find(p + "g_idx");
    if (g_idx_tensor) expect(*g_idx_tensor, DType::I32, {k}, "GPTQ's g_idx (one group per input row)");

    // Unpack the zero points first: they decide whether the view needs a zero table (all 8: symmetric).
    const uint8_t* qw = store.data(qweight);
    const uint8_t* qz = qzeros ? store.data(*qzeros) : nullptr;
    const int zero_offset = d.packing == IntPacking::gptq ? 1 : 0;  // v1 stores z - 1
    std::vector<uint8_t> zero(size_t(groups * n), 8);               // [G, N]
    bool all_eight = true;
    if (qz) {
      for (int64_t g = 0; g < groups; g++)
        for (int64_t col = 0; col < n; col++) {
          const uint32_t word = word_at(qz, g * (n / 8) + col / 8);
          const int nibble = awq ? kAwqReverseOrder[col % 8] : int(col % 8);
          const int z = int((word >> (4 * nibble)) & 0xfu) + zero_offset;
          if (z > 15)
            fail(ErrorCode::unsupported,
                 format("%s stores 15 for group %lld, column %lld: GPTQ v1's zero - 1 makes that a zero point of 16, "
                        "outside int4 (a quantizer wraps -1 there when z = 0); re-save the checkpoint as gptq_v2",
                        qzeros->name.c_str(), (long long)g, (long long)col));
          zero[size_t(g * n + col)] = uint8_t(z);
          all_eight = all_eight && z == 8;
        }
    }
    const bool zeros = !all_eight;

    // Act-order: keep g_idx only when it is not k / group_size.
    std::vector<int32_t> g_idx;
    if (g_idx_tensor) {
      const uint8_t* bytes = store.data(*g_idx_tensor);
      g_idx.resize(size_t(k));
      std::vector<int64_t> members(size_t(groups), 0);
      bool column_order = true;
      for (int64_t row = 0; row < k; row++) {
        int32_t group;
        memcpy(&group, bytes + 4 * row, 4);
        if (group < 0 || group >= groups)
          fail(ErrorCode::bad_format, format("%s[%lld] = %d is not a group of %s (0..%lld)", g_idx_tensor->name.c_str(),
                                             (long long)row, group, scales.name.c_str(), (long long)(groups - 1)));
        g_idx[size_t(row)] = group;
        members[size_t(group)]++;
        column_order = column_order && group == row / d.group_size;
      }
      if (column_order) {
        g_idx.clear();
      } else {
        for (int64_t g = 0; g < groups; g++)
          if (members[size_t(g)] != d.group_size)
            fail(ErrorCode::bad_format,
                 format("%s assigns %lld input rows to group %lld; each of the %lld groups must hold group_size %lld "
                        "(static_groups or a truncated g_idx?)",
                        g_idx_tensor->name.c_str(), (long long)members[size_t(g)], (long long)g, (long long)groups,
                        (long long)d.group_size));
      }
    }

    const ViewLayout v = view_layout(n, k, groups, scales.dtype, zeros, !g_idx.empty());
    auto storage = std::make_shared<std::vector<uint8_t>>(size_t(v.total), uint8_t(0));
    uint8_t* base = storage->data();

    // weight_packed [N, K/8]: column k of row n at nibble k % 8 of word k / 8, the stored u unchanged.
    const int64_t words = k / 8;
    uint32_t* packed = reinterpret_cast<uint32_t*>(base + v.packed);
    if (awq) {
      for (int64_t row = 0; row < k; row++)
        for (int64_t c = 0; c < n / 8; c++) {
          const uint32_t word = word_at(qw, row * (n / 8) + c);
          for (int j = 0; j < 8; j++) {
            const uint32_t u = (word >> (4 * kAwqReverseOrder[j])) & 0xfu;
            packed[(8 * c + j) * words + row / 8] |= u << (4 * (row % 8));
          }
        }
    } else {
      // A GPTQ word already holds 8 consecutive input rows lowest first: it is the view's word, transposed.
      for (int64_t i = 0; i < words; i++)
        for (int64_t col = 0; col < n; col++) packed[col * words + i] = word_at(qw, i * n + col);
    }

    // scales [G, N] -> [N, G]
    const size_t element = size_t(dtype_bytes(scales.dtype, 1));
    const uint8_t* src_scales = store.data(scales);
    for (int64_t g = 0; g < groups; g++)
      for (int64_t col = 0; col < n; col++)
        memcpy(base + v.scales + (col * groups + g) * element, src_scales + (g * n + col) * element, element);

    if (zeros) {
      uint32_t* out = reinterpret_cast<uint32_t*>(base + v.zeros);
      for (int64_t g = 0; g < groups; g++)
        for (int64_t col = 0; col < n; col++)
          out[(col / 8) * groups + g] |= uint32_t(zero[size_t(g * n + col)]) << (4 * (col % 8));
    }
    if (!g_idx.empty()) memcpy(base + v.g_idx, g_idx.data(), g_idx.size() * 4);

    QuantWeight w;
    w.name = d.name;
    w.out_features = n;
    w.in_features = k;
    w.format = WeightFormat::int4;
    w.granularity = groups == 1 ? ScaleGranularity::channel : ScaleGranularity::group;
    w.packed = base + v.packed;
    w.packed_cols = words;
    w.zero_points = zeros ? base + v.zeros : nullptr;
    w.g_idx = g_idx.empty() ? nullptr : base + v.g_idx;
    w.group_size = d.group_size;
    w.scales = base + v.scales;
    w.scale_dtype = scales.dtype;
    w.scale_rows = n;
    w.scale_cols = groups;
    w.rounding = DequantRounding::scale_dtype;
    w.storage = std::move(storage);
    return w;
  });
}

}  // namespace kvlite
