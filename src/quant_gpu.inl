// quant_gpu: implementation (host side: layout arithmetic, repacking, kernel choice and planning).
#include <algorithm>

namespace kvlite {
namespace cuda {
namespace {

int64_t round_up64(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// A checkpoint g_idx that only restates column order (g_idx[k] == k / group_size, what GPTQ without desc_act
// and compressed-tensors' "static" actorder write) needs no permutation.
bool g_idx_in_column_order(const QuantWeight& w) {
  for (int64_t k = 0; k < w.in_features; k++) {
    int32_t group;
    memcpy(&group, w.g_idx + 4 * k, 4);
    if (group != k / w.group_size) return false;
  }
  return true;
}

// Scale groups (columns of the checkpoint's scale tensor) the checkpoint holds; device groups past these are
// padding. int4 channel and fp8 tensor/channel have one, which the device's single group matches.
int64_t checkpoint_groups(const QuantWeight& w) { return w.scale_cols; }

// The stored nibble (q + 8) of a device element of an int4 layout: padding rows get 8 (q = 0 with the zero
// 8), padding columns the zero point of their group (q - z = 0).
struct Int4Source {
  const QuantWeight& w;
  const QuantGpuLayout& layout;
  const std::vector<int32_t>& perm;  // [K] when layout.permuted

  uint32_t zero_nibble(int64_t n, int64_t group) const {
    if (!w.zero_points || n >= w.out_features || group >= checkpoint_groups(w)) return 8;
    return uint32_t(int4_zero_point_at(w.zero_points, w.scale_cols, n, group) + 8);
  }
  uint32_t nibble(int64_t n, int64_t k_device) const {
    if (n >= w.out_features) return 8;
    if (k_device >= w.in_features) return zero_nibble(n, k_device / layout.group_size);
    const int64_t k = layout.permuted ? perm[size_t(k_device)] : k_device;
    return uint32_t(int4_packed_at(w.packed + 4 * n * w.packed_cols, k) + 8);
  }
};

// Device column k' -> input column: columns sorted by group (stable), so each group is group_size consecutive
// device columns (quant_weight checked that every group holds exactly group_size columns).
std::vector<int32_t> act_order_permutation(const QuantWeight& w) {
  std::vector<int32_t> groups(size_t(w.in_features));
  memcpy(groups.data(), w.g_idx, groups.size() * 4);
  std::vector<int32_t> perm(groups.size());
  for (size_t k = 0; k < perm.size(); k++) perm[k] = int32_t(k);
  std::stable_sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) { return groups[size_t(a)] < groups[size_t(b)]; });
  return perm;
}

void store_u32(uint8_t* p, uint32_t v) { memcpy(p, &v, 4); }

void repack_int4_tiles(const QuantWeight& w, const QuantGpuLayout& layout, int64_t first_tile, int64_t count,
                       uint8_t* out) {
  const std::vector<int32_t> perm = layout.permuted ? act_order_permutation(w) : std::vector<int32_t>();
  const Int4Source source{w, layout, perm};
  const int64_t k_tiles = layout.k_pad / kInt4TileK;
  for (int64_t t = first_tile; t < first_tile + count; t++)
    for (int64_t kt = 0; kt < k_tiles; kt++) {
      uint8_t* tile = out + ((t - first_tile) * k_tiles + kt) * kInt4TileBytes;
      const int64_t n0 = t * kQuantTileN, k0 = kt * kInt4TileK;
      const bool inside = !layout.permuted && n0 + kQuantTileN <= w.out_features && k0 + kInt4TileK <= w.in_features;
      for (int lane = 0; lane < 32; lane++) {
        uint32_t words[4] = {0, 0, 0, 0};
        if (inside) {
          // Whole checkpoint words: k0 + 2q, 2q+1 (b0) are nibbles 2q, 2q+1 of word k0/8; b1's of word k0/8 + 1.
          const int g = lane / 4, q = lane % 4;
          for (int j = 0; j < 8; j++) {
            const uint8_t* row = w.packed + 4 * ((n0 + 8 * j + g) * w.packed_cols + k0 / 8);
            const uint32_t b0 = (load_u32_le(row) >> (8 * q)) & 0xffu, b1 = (load_u32_le(row + 4) >> (8 * q)) & 0xffu;
            const int p0 = 2 * (j % 2);  // pair of b0; b1's is p0 + 1 (int4_pair_block / int4_pair_register)
            words[j / 2] |= ((b0 & 0xfu) << (4 * p0)) | ((b0 >> 4) << (4 * (p0 + 4))) |
                            ((b1 & 0xfu) << (4 * (p0 + 1))) | ((b1 >> 4) << (4 * (p0 + 5)));
          }
        } else {
          for (int word = 0; word < 4; word++)
            for (int nibble = 0; nibble < 8; nibble++) {
              int column, k;
              int4_tile_slot(lane, word, nibble, &column, &k);
              words[word] |= source.nibble(n0 + column, k0 + k) << (4 * nibble);
            }
        }
        for (int word = 0; word < 4; word++) store_u32(tile + 16 * lane + 4 * word, words[word]);
      }
    }
}

void repack_fp8_tiles(const QuantWeight& w, const QuantGpuLayout& layout, int64_t first_tile, int64_t count,
                      uint8_t* out) {
  const int64_t n_size = w.out_features, k_size = w.in_features, k_tiles = layout.k_pad / kFp8TileK;
  auto refuse_nan = [&](int64_t n, int64_t k) {
    detail::fail(ErrorCode::bad_format,
                 detail::format("%s.weight[%lld, %lld] holds the e4m3 NaN code 0x%02x; fp8 quantizers saturate at "
                                "+-448 and never write it, so the checkpoint is damaged",
                                w.name.c_str(), (long long)n, (long long)k, unsigned(w.fp8[n * k_size + k])));
  };
  for (int64_t t = first_tile; t < first_tile + count; t++)
    for (int64_t kt = 0; kt < k_tiles; kt++) {
      uint8_t* tile = out + ((t - first_tile) * k_tiles + kt) * kFp8TileBytes;
      for (int chunk = 0; chunk < 4; chunk++)
        for (int lane = 0; lane < 32; lane++)
          for (int word = 0; word < 4; word++) {
            int column, k;
            fp8_tile_slot(lane, chunk, word, 0, &column, &k);
            const int64_t n = t * kQuantTileN + column, kd = kt * kFp8TileK + k;  // bytes kd .. kd + 3
            uint32_t value = 0;
            if (n < n_size && kd + 4 <= k_size) {
              value = load_u32_le(w.fp8 + n * k_size + kd);
            } else if (n < n_size) {
              for (int b = 0; b < 4 && kd + b < k_size; b++) value |= uint32_t(w.fp8[n * k_size + kd + b]) << (8 * b);
            }
            // A byte whose low 7 bits are all ones (+1 carries into bit 7) is S.1111.111.
            if ((((value & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0)
              for (int b = 0; b < 4; b++)
                if (((value >> (8 * b)) & 0x7fu) == 0x7fu) refuse_nan(n, kd + b);
            store_u32(tile + 512 * chunk + 16 * lane + 4 * word, value);
          }
    }
}

// int8: the fp8 tiles' byte positions (fp8_tile_slot); a byte is q (two's complement), padding rows 0, padding
// columns their group's zero point (q - z = 0 where the group's scale is real: a channel layout's one group spans
// the padding too).
void repack_int8_tiles(const QuantWeight& w, const QuantGpuLayout& layout, int64_t first_tile, int64_t count,
                       uint8_t* out) {
  const std::vector<int32_t> perm = layout.permuted ? act_order_permutation(w) : std::vector<int32_t>();
  const int64_t n_size = w.out_features, k_size = w.in_features, k_tiles = layout.k_pad / kFp8TileK;
  auto byte_at = [&](int64_t n, int64_t k_device) -> uint8_t {
    if (n >= n_size) return 0;
    if (k_device >= k_size) {
      const int64_t group = k_device / layout.group_size;
      return w.zero_points && group < checkpoint_groups(w) ? w.zero_points[n * w.scale_cols + group] : 0;
    }
    return w.int8[n * k_size + (layout.permuted ? perm[size_t(k_device)] : k_device)];
  };
  for (int64_t t = first_tile; t < first_tile + count; t++)
    for (int64_t kt = 0; kt < k_tiles; kt++) {
      uint8_t* tile = out + ((t - first_tile) * k_tiles + kt) * kFp8TileBytes;
      for (int chunk = 0; chunk < 4; chunk++)
        for (int lane = 0; lane < 32; lane++)
          for (int word = 0; word < 4; word++) {
            int column, k;
            fp8_tile_slot(lane, chunk, word, 0, &column, &k);  // bytes b = 0..3 hold k .. k + 3 of one column
            const int64_t n = t * kQuantTileN + column, kd = kt * kFp8TileK + k;
            uint8_t* dst = tile + 512 * chunk + 16 * lane + 4 * word;
            if (!layout.permuted && n < n_size && kd + 4 <= k_size) memcpy(dst, w.int8 + n * k_size + kd, 4);
            else
              for (int b = 0; b < 4; b++) dst[b] = byte_at(n, kd + b);
          }
    }
}

}  // namespace

int64_t QuantGpuLayout::table_index(int64_t group, int64_t column) const {
  return group * n_pad + column / kQuantTileN * kQuantTileN + quant_table_position(int(column % kQuantTileN));
}

namespace {
// The layout from what decides it: format and shape, scale granularity and group/block, the int4 scale dtype,
// zero points, act-order.
QuantGpuLayout layout_of(WeightFormat format, int64_t n, int64_t k, ScaleGranularity granularity, int64_t group_size,
                         int64_t block_k, DType scale_dtype, bool zeros, bool permuted) {
  QuantGpuLayout l;
  l.format = format;
  l.n = n;
  l.k = k;
  l.n_pad = round_up64(l.n, kQuantTileN);
  l.k_pad = round_up64(l.k, kQuantStageK);
  l.n_tiles = l.n_pad / kQuantTileN;
  l.stages = l.k_pad / kQuantStageK;
  uint64_t table_element = 4;
  if (format == WeightFormat::int4) {
    l.tile_k = kInt4TileK;
    l.tile_bytes = kInt4TileBytes;
    if (granularity == ScaleGranularity::channel) {
      l.group_size = l.k_pad;
      l.mma = true;
    } else {
      l.group_size = group_size;
      l.mma = group_size % kInt4TileK == 0;
    }
    l.table_scale_dtype = scale_dtype;
    table_element = dtype_bytes(scale_dtype, 1);
    l.zeros = zeros;
    l.permuted = permuted;
  } else if (format == WeightFormat::int8) {
    l.tile_k = kFp8TileK;
    l.tile_bytes = kFp8TileBytes;
    l.group_size = granularity == ScaleGranularity::channel ? l.k_pad : group_size;
    l.mma = false;  // no int8 tensor-core kernel yet: dequantize + cuBLAS
    l.table_scale_dtype = scale_dtype;
    table_element = dtype_bytes(scale_dtype, 1);
    l.zeros = zeros;
    l.permuted = permuted;
  } else {
    l.tile_k = kFp8TileK;
    l.tile_bytes = kFp8TileBytes;
    if (granularity == ScaleGranularity::block) {
      l.group_size = block_k;
      l.mma = block_k % kFp8TileK == 0;
    } else {
      l.group_size = l.k_pad;
      l.mma = true;
    }
    l.table_scale_dtype = DType::F32;
  }
  l.tiles_per_stage = kQuantStageK / l.tile_k;
  l.groups = (l.k_pad + l.group_size - 1) / l.group_size;

  uint64_t offset = 0;
  auto place = [&](uint64_t bytes, uint64_t* at, uint64_t* size) {
    *at = offset;
    *size = bytes;
    offset = align_up(offset + bytes, 256);
  };
  place(uint64_t(l.n_tiles) * l.tile_row_bytes(), &l.tiles_offset, &l.tiles_bytes);
  place(uint64_t(l.groups * l.n_pad) * table_element, &l.scales_offset, &l.scales_bytes);
  place(l.zeros ? uint64_t(l.groups * l.n_pad) : 0, &l.zeros_offset, &l.zeros_bytes);
  place(l.permuted ? uint64_t(l.k_pad) * 4 : 0, &l.perm_offset, &l.perm_bytes);
  place(uint64_t(l.n_pad) * 4, &l.bias_offset, &l.bias_bytes);
  place(uint64_t(l.n_tiles) * 4, &l.counters_offset, &l.counters_bytes);
  l.total_bytes = offset;
  return l;
}
}  // namespace

QuantGpuLayout quant_gpu_layout(const QuantWeight& w) {
  const bool integer = w.format == WeightFormat::int4 || w.format == WeightFormat::int8;
  const bool permuted = integer && w.g_idx != nullptr && (w.layout == QuantLayout::cuda_tiles || !g_idx_in_column_order(w));
  return layout_of(w.format, w.out_features, w.in_features, w.granularity, w.group_size, w.block_k, w.scale_dtype,
                   integer && w.zero_points != nullptr, permuted);
}

QuantGpuLayout quant_gpu_layout(const LinearDesc& linear) {
  const bool integer = linear.format == WeightFormat::int4 || linear.format == WeightFormat::int8;
  return layout_of(linear.format, linear.out_features, linear.in_features, linear.granularity, linear.group_size,
                   linear.block_k, linear.scale_dtype, integer && !linear.symmetric, integer && linear.has_g_idx);
}

Status repack_quant_tiles(const QuantWeight& host, const QuantGpuLayout& layout, int64_t first_tile, int64_t count,
                          uint8_t* out) {
  return detail::guard([&] {
    if (host.layout != QuantLayout::checkpoint)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("repack_quant_tiles(%s): the weight is already repacked", host.name.c_str()));
    if (first_tile < 0 || count < 0 || first_tile + count > layout.n_tiles)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("repack_quant_tiles(%s): tiles [%lld, %lld) are outside the %lld column tiles",
                                  host.name.c_str(), (long long)first_tile, (long long)(first_tile + count),
                                  (long long)layout.n_tiles));
    if (host.format == WeightFormat::int4) repack_int4_tiles(host, layout, first_tile, count, out);
    else if (host.format == WeightFormat::int8) repack_int8_tiles(host, layout, first_tile, count, out);
    else repack_fp8_tiles(host, layout, first_tile, count, out);
  });
}

Status repack_quant_tables(const QuantWeight& w, const QuantGpuLayout& layout, uint8_t* out) {
  return detail::guard([&] {
    if (w.layout != QuantLayout::checkpoint)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("repack_quant_tables(%s): the weight is already repacked", w.name.c_str()));
    const uint64_t base = layout.scales_offset;
    memset(out, 0, size_t(layout.total_bytes - base));  // padding scales 0, bias 0, counters 0
    const int64_t real_groups = checkpoint_groups(w);
    for (int64_t group = 0; group < layout.groups; group++)
      for (int64_t n = 0; n < w.out_features && group < real_groups; n++) {
        const int64_t index = layout.table_index(group, n);
        if (w.format == WeightFormat::int4 || w.format == WeightFormat::int8) {
          const uint64_t element = dtype_bytes(w.scale_dtype, 1);
          memcpy(out + layout.scales_offset - base + uint64_t(index) * element,
                 w.scales + uint64_t(n * w.scale_cols + group) * element, size_t(element));
        } else {
          int64_t source = 0;  // tensor
          if (w.granularity == ScaleGranularity::channel) source = n;
          if (w.granularity == ScaleGranularity::block) source = (n / w.block_n) * w.scale_cols + group;
          const float scale = scale_at(w.scales, w.scale_dtype, source);
          memcpy(out + layout.scales_offset - base + uint64_t(index) * 4, &scale, 4);
        }
      }
    if (layout.zeros) {
      uint8_t* zeros = out + layout.zeros_offset - base;
      for (int64_t group = 0; group < layout.groups; group++)
        for (int64_t n = 0; n < layout.n_pad; n++) {
          const bool real = n < w.out_features && group < real_groups;
          if (w.format == WeightFormat::int8)
            zeros[layout.table_index(group, n)] = real ? w.zero_points[n * w.scale_cols + group] : 0;
          else
            zeros[layout.table_index(group, n)] =
                uint8_t(real ? int4_zero_point_at(w.zero_points, w.scale_cols, n, group) + 8 : 8);
        }
    }
    if (layout.permuted) {
      const std::vector<int32_t> perm = act_order_permutation(w);
      uint8_t* table = out + layout.perm_offset - base;
      for (int64_t k = 0; k < layout.k_pad; k++) {
        const int32_t source = k < w.in_features ? perm[size_t(k)] : -1;
        memcpy(table + 4 * k, &source, 4);
      }
    }
    if (w.bias)
      for (int64_t n = 0; n < w.out_features; n++) {
        const float bias = scale_at(w.bias, w.bias_dtype, n);
        memcpy(out + layout.bias_offset - base + uint64_t(n) * 4, &bias, 4);
      }
  });
}

// ---- fused Linears ------------------------------------------------------------------------------------------

namespace {
// What decides whether Linears fuse, from a weight or a descriptor alike.
struct FusionTraits {
  std::string name;
  WeightFormat format = WeightFormat::dense;
  int64_t n = 0, k = 0;
  ScaleGranularity granularity = ScaleGranularity::none;
  int64_t group_size = 0, block_k = 0;
  DType scale_dtype = DType::F32;
  DequantRounding rounding = DequantRounding::scale_dtype;
  bool zeros = false, g_idx = false;
  const uint8_t* g_idx_values = nullptr;  // I32 [K]: a weight's g_idx; nullptr for a descriptor (not read yet)
  bool permuted = false;                  // a weight's layout is act-order (quant_gpu_layout)
};
FusionTraits traits_of(const QuantWeight& w) {
  return {w.name, w.format, w.out_features, w.in_features, w.granularity, w.group_size, w.block_k, w.scale_dtype,
          w.rounding, w.format == WeightFormat::int4 && w.zero_points != nullptr, w.g_idx != nullptr, w.g_idx,
          w.g_idx != nullptr && quant_gpu_layout(w).permuted};
}
FusionTraits traits_of(const LinearDesc& d) {
  // quant_weight's rounding rule: transformers' weight_scale_inv multiplies in float32
  const DequantRounding rounding =
      d.scale_name == "weight_scale_inv" ? DequantRounding::f32 : DequantRounding::scale_dtype;
  return {d.name, d.format, d.out_features, d.in_features, d.granularity, d.group_size, d.block_k, d.scale_dtype,
          rounding, d.format == WeightFormat::int4 && !d.symmetric, d.has_g_idx, nullptr, false};
}

std::string fusion_refusal(const std::vector<FusionTraits>& parts) {
  using detail::format;
  if (parts.empty()) return "no Linears to fuse";
  const FusionTraits& first = parts[0];
  if (first.format != WeightFormat::int4 && first.format != WeightFormat::fp8)
    return format("%s is %s, not an int4 or fp8 Linear", first.name.c_str(), weight_format_name(first.format));
  const bool first_block = first.granularity == ScaleGranularity::block;
  for (size_t i = 0; i < parts.size(); i++) {
    const FusionTraits& p = parts[i];
    const char* name = p.name.c_str();
    if (p.format != first.format)
      return format("%s is %s and %s %s", first.name.c_str(), weight_format_name(first.format), name,
                    weight_format_name(p.format));
    if (p.k != first.k)
      return format("%s reads %lld input features and %s %lld", first.name.c_str(), (long long)first.k, name,
                    (long long)p.k);
    if (p.scale_dtype != first.scale_dtype || p.rounding != first.rounding)
      return format("%s and %s have scales of different dtypes or roundings (%s, %s): the kernel multiplies by one "
                    "kind", first.name.c_str(), name, dtype_name(first.scale_dtype), dtype_name(p.scale_dtype));
    if (p.g_idx != first.g_idx)
      return format("%s and %s differ in g_idx (one is act-order)", first.name.c_str(), name);
    if (p.g_idx && (!p.g_idx_values || !first.g_idx_values))
      return format("%s has a g_idx: act-order Linears fuse only when their g_idx tensors are equal, which their "
                    "descriptors do not tell (the planner counts them apart)", name);
    if (p.g_idx && p.k == first.k && memcmp(p.g_idx_values, first.g_idx_values, size_t(p.k) * 4) != 0)
      return format("%s's g_idx differs from %s's (act-order permutes each Linear its own way)", name,
                    first.name.c_str());
    if (p.format == WeightFormat::int4) {
      if (p.granularity != first.granularity ||
          (p.granularity == ScaleGranularity::group && p.group_size != first.group_size))
        return format("%s and %s have different int4 scale groups (%s %lld, %s %lld)", first.name.c_str(), name,
                      scale_granularity_name(first.granularity), (long long)first.group_size,
                      scale_granularity_name(p.granularity), (long long)p.group_size);
      if (p.zeros != first.zeros)
        return format("%s and %s differ in zero points (one is asymmetric)", first.name.c_str(), name);
    } else if ((p.granularity == ScaleGranularity::block) != first_block ||
               (first_block && p.block_k != first.block_k)) {
      return format("%s and %s have different fp8 scale blocks along K (%s, %s)", first.name.c_str(), name,
                    first_block ? format("block_k %lld", (long long)first.block_k).c_str()
                                : scale_granularity_name(first.granularity),
                    p.granularity == ScaleGranularity::block ? format("block_k %lld", (long long)p.block_k).c_str()
                                                             : scale_granularity_name(p.granularity));
    }
    if (i + 1 < parts.size() && p.n % kQuantTileN != 0)
      return format("%s has %lld output features, not a whole number of %lld-column tiles, and is not the last part",
                    name, (long long)p.n, (long long)kQuantTileN);
  }
  return "";
}

QuantGpuLayout fused_layout(const std::vector<FusionTraits>& parts) {
  const std::string why = fusion_refusal(parts);
  if (!why.empty()) detail::fail(ErrorCode::invalid_argument, "these Linears do not fuse: " + why);
  const FusionTraits& first = parts[0];
  int64_t n = 0;
  for (const FusionTraits& p : parts) n += p.n;
  // fp8 tensor and channel scales lay out alike (one group of k_pad columns, a scale per column); act-order parts
  // share one g_idx, so one permutation
  return layout_of(first.format, n, first.k, first.granularity, first.group_size, first.block_k, first.scale_dtype,
                   first.zeros, first.permuted);
}

template <class Part>
std::vector<FusionTraits> traits_of_parts(const std::vector<const Part*>& parts) {
  std::vector<FusionTraits> traits;
  for (const Part* part : parts) traits.push_back(traits_of(*part));
  return traits;
}
}  // namespace

std::string quant_fusion_refusal(const std::vector<const QuantWeight*>& parts) {
  return fusion_refusal(traits_of_parts(parts));
}
std::string quant_fusion_refusal(const std::vector<const LinearDesc*>& parts) {
  return fusion_refusal(traits_of_parts(parts));
}
QuantGpuLayout quant_gpu_layout(const std::vector<const QuantWeight*>& parts) {
  if (parts.size() == 1) return quant_gpu_layout(*parts[0]);
  return fused_layout(traits_of_parts(parts));
}
QuantGpuLayout quant_gpu_layout(const std::vector<const LinearDesc*>& parts) {
  if (parts.size() == 1) return quant_gpu_layout(*parts[0]);
  return fused_layout(traits_of_parts(parts));
}

Status repack_quant_tiles(const std::vector<const QuantWeight*>& parts, const QuantGpuLayout& layout,
                          int64_t first_tile, int64_t count, uint8_t* out) {
  if (parts.size() == 1) return repack_quant_tiles(*parts[0], layout, first_tile, count, out);
  return detail::guard([&] {
    const std::string why = quant_fusion_refusal(parts);
    if (!why.empty()) detail::fail(ErrorCode::invalid_argument, "repack_quant_tiles: these Linears do not fuse: " + why);
    if (first_tile < 0 || count < 0 || first_tile + count > layout.n_tiles)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("repack_quant_tiles: tiles [%lld, %lld) are outside the fused Linear's %lld",
                                  (long long)first_tile, (long long)(first_tile + count), (long long)layout.n_tiles));
    int64_t part_first_tile = 0;  // the fused tile where the part's tiles begin
    for (const QuantWeight* part : parts) {
      const QuantGpuLayout own = quant_gpu_layout(*part);
      const int64_t begin = std::max(first_tile, part_first_tile);
      const int64_t end = std::min(first_tile + count, part_first_tile + own.n_tiles);
      if (begin < end) {
        const Status repacked = repack_quant_tiles(*part, own, begin - part_first_tile, end - begin,
                                                   out + uint64_t(begin - first_tile) * layout.tile_row_bytes());
        if (!repacked.ok()) throw repacked.error();
      }
      part_first_tile += own.n_tiles;
    }
  });
}

Status repack_quant_tables(const std::vector<const QuantWeight*>& parts, const QuantGpuLayout& layout, uint8_t* out) {
  if (parts.size() == 1) return repack_quant_tables(*parts[0], layout, out);
  return detail::guard([&] {
    const std::string why = quant_fusion_refusal(parts);
    if (!why.empty()) detail::fail(ErrorCode::invalid_argument, "repack_quant_tables: these Linears do not fuse: " + why);
    const uint64_t base = layout.scales_offset, element = dtype_bytes(layout.table_scale_dtype, 1);
    memset(out, 0, size_t(layout.total_bytes - base));  // counters 0
    int64_t column0 = 0;  // the part's first fused column: a multiple of 64, so its table positions carry over
    for (const QuantWeight* part : parts) {
      const QuantGpuLayout own = quant_gpu_layout(*part);
      std::vector<uint8_t> tables(size_t(own.total_bytes - own.scales_offset));
      const Status repacked = repack_quant_tables(*part, own, tables.data());
      if (!repacked.ok()) throw repacked.error();
      const uint8_t* own_base = tables.data() - own.scales_offset;  // so that own_base + own.x_offset is table x
      for (int64_t group = 0; group < layout.groups; group++) {
        memcpy(out + layout.scales_offset - base + uint64_t(group * layout.n_pad + column0) * element,
               own_base + own.scales_offset + uint64_t(group * own.n_pad) * element, size_t(uint64_t(own.n_pad) * element));
        if (layout.zeros)
          memcpy(out + layout.zeros_offset - base + uint64_t(group * layout.n_pad + column0),
                 own_base + own.zeros_offset + uint64_t(group * own.n_pad), size_t(own.n_pad));
      }
      memcpy(out + layout.bias_offset - base + uint64_t(column0) * 4, own_base + own.bias_offset,
             size_t(own.n_pad) * 4);
      if (layout.permuted && column0 == 0)  // the parts' g_idx are equal: the first part's permutation is every one's
        memcpy(out + layout.perm_offset - base, own_base + own.perm_offset, size_t(layout.perm_bytes));
      column0 += own.n_pad;
    }
  });
}

// ---- kernel choice and planning -----------------------------------------------------------------------------

const char* quant_kernel_name(QuantKernel kernel) {
  switch (kernel) {
    case QuantKernel::automatic: return "automatic";
    case QuantKernel::mma_a16: return "mma_a16";
    case QuantKernel::mma_w8a8: return "mma_w8a8";
    case QuantKernel::dequant_cublas: return "dequant_cublas";
    case QuantKernel::gemv_a16: return "gemv_a16";
    case QuantKernel::gemv_mma: return "gemv_mma";
  }
  return "?";
}

std::string quant_kernel_refusal(const QuantGpuLayout& layout, QuantKernel kernel, DType activation, int sm) {
  if (kernel == QuantKernel::automatic || kernel == QuantKernel::dequant_cublas) return "";
  if (layout.format == WeightFormat::int8)
    return detail::format("%s does not run int8 weights: they run through dequantize + cuBLAS (no int8 GEMM kernel "
                          "yet)", quant_kernel_name(kernel));
  if (kernel == QuantKernel::mma_w8a8 && layout.format != WeightFormat::fp8)
    return "W8A8 (mma_w8a8) runs fp8 weights only";
  if (kernel == QuantKernel::mma_w8a8 && sm < kQuantW8A8MinSm)
    return detail::format("W8A8 (mma_w8a8) needs the e4m3 tensor cores of compute capability 8.9 or newer; this "
                          "GPU is sm_%d", sm);
  if (activation != DType::BF16 && activation != DType::F16)
    return detail::format("%s needs BF16 or F16 activations (%s activations run through dequantize + cuBLAS)",
                          quant_kernel_name(kernel), dtype_name(activation));
  if (!layout.mma)
    return layout.format == WeightFormat::int4
               ? detail::format("%s needs int4 groups of a multiple of 16 columns; this Linear's are %lld",
                                quant_kernel_name(kernel), (long long)layout.group_size)
               : detail::format("%s needs fp8 blocks of a multiple of 32 columns; this Linear's are %lld",
                                quant_kernel_name(kernel), (long long)layout.group_size);
  return "";
}

QuantKernel choose_quant_kernel(const QuantGpuLayout& layout, DType activation, int sm, int64_t rows,
                                QuantKernel forced) {
  if (forced != QuantKernel::automatic) return forced;
  if ((activation != DType::BF16 && activation != DType::F16) || !layout.mma) return QuantKernel::dequant_cublas;
  if (rows <= quant_gemv_auto_rows(layout.format)) return QuantKernel::gemv_a16;
  if (rows <= quant_gemv_mma_auto_rows(layout.format)) return QuantKernel::gemv_mma;
  if (layout.format == WeightFormat::fp8 && quant_w8a8_preferred(sm)) return QuantKernel::mma_w8a8;
  return rows <= kQuantMmaMaxRows ? QuantKernel::mma_a16 : QuantKernel::dequant_cublas;
}

uint64_t quant_staged_row_bytes(const QuantGpuLayout& layout, QuantKernel kernel) {
  if (kernel == QuantKernel::mma_w8a8) return uint64_t(layout.k_pad) + uint64_t(layout.groups) * 4;
  return uint64_t(layout.k_pad) * 2;
}

namespace {
// Scratch for `rows` staged rows: mma_a16 [rows, k_pad] bf16/f16; mma_w8a8 [rows, k_pad] e4m3, then its
// scales as [groups][rows rounded up to 64] floats (a block reads 16 * m_tiles consecutive rows of a group).
uint64_t staged_bytes(const QuantGpuLayout& layout, QuantKernel kernel, int64_t rows) {
  if (kernel == QuantKernel::mma_w8a8)
    return align_up(uint64_t(rows * layout.k_pad), 256) + align_up(uint64_t(layout.groups * round_up64(rows, 64)) * 4, 256);
  return align_up(uint64_t(rows * layout.k_pad) * 2, 256);
}
}  // namespace

bool plan_quant_gemm(const QuantGpuLayout& layout, QuantKernel kernel, int64_t rows, bool stage_x, int act_bytes,
                     uint64_t scratch_bytes, int64_t target_blocks, QuantGemmPlan* plan, std::string* why) {
  QuantGemmPlan p;
  p.kernel = kernel;
  p.row_chunk = rows;
  if (kernel == QuantKernel::dequant_cublas) {
    const uint64_t per_tile = uint64_t(kQuantTileN * layout.k_pad) * uint64_t(act_bytes);
    const int64_t tiles = int64_t(std::min<uint64_t>(scratch_bytes / per_tile, uint64_t(layout.n_tiles)));
    if (tiles == 0) {
      *why = detail::format("dequantizing 64 rows of %lld columns needs %s of scratch; the workspace leaves %s",
                            (long long)layout.k_pad, format_bytes(per_tile).c_str(), format_bytes(scratch_bytes).c_str());
      return false;
    }
    p.n_chunk = tiles * kQuantTileN;
    p.weight_bytes = uint64_t(p.n_chunk) * uint64_t(layout.k_pad) * uint64_t(act_bytes);
    *plan = p;
    return true;
  }
  if (kernel == QuantKernel::gemv_a16) p.row_chunk = std::min(rows, kQuantGemvMaxRows);  // passes of its rows
  if (kernel == QuantKernel::gemv_mma) p.row_chunk = std::min(rows, kQuantGemvMmaMaxRows);
  p.stage_x = kernel == QuantKernel::mma_w8a8 || stage_x;
  if (p.stage_x) {
    if (staged_bytes(layout, kernel, 1) > scratch_bytes) {
      *why = detail::format("staging one row of %lld activations needs %s of scratch; the workspace leaves %s",
                            (long long)layout.k_pad, format_bytes(staged_bytes(layout, kernel, 1)).c_str(),
                            format_bytes(scratch_bytes).c_str());
      return false;
    }
    int64_t chunk = rows;
    if (staged_bytes(layout, kernel, chunk) > scratch_bytes) {
      chunk = std::max<int64_t>(1, int64_t(scratch_bytes / quant_staged_row_bytes(layout, kernel)));
      while (chunk > 1 && staged_bytes(layout, kernel, chunk) > scratch_bytes) chunk--;
      if (chunk > 64) chunk = chunk / 64 * 64;  // passes of whole 64-row blocks
    }
    p.row_chunk = std::min(chunk, p.row_chunk);
    p.x_bytes = staged_bytes(layout, kernel, p.row_chunk);
  }
  // Split-K when one block row leaves the GPU idle: as many splits as fill it once, each of at least
  // kQuantMinSplitStages stages. (Tried on an H100: splitting to fill whole waves instead -- 5 splits, 480 blocks,
  // for Llama-3.1-8B's qkv at M = 1 rather than 2 splits, 192 blocks in 0.73 of a wave -- left the W4A16 GEMM at
  // 27 us: the kernel, not the grid, is what holds it at 20% of copy bandwidth; see bench/RESULTS.md.)
  if (p.row_chunk <= 64 && layout.n_tiles < target_blocks) {
    int64_t splits = std::min<int64_t>(target_blocks / layout.n_tiles, layout.stages / kQuantMinSplitStages);
    const uint64_t per_split =
        uint64_t(layout.n_tiles) * uint64_t(16 * quant_m_tiles(p.row_chunk)) * uint64_t(kQuantTileN) * 4;
    while (splits > 1 && p.x_bytes + uint64_t(splits) * per_split > scratch_bytes) splits--;
    if (splits > 1) {
      p.splits = splits;
      p.partial_bytes = uint64_t(splits) * per_split;
    }
  }
  *plan = p;
  return true;
}

}  // namespace cuda
}  // namespace kvlite
