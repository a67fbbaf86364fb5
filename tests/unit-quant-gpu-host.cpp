// quant-gpu-host: the CUDA backend's device layout for quantized Linears, checked on the CPU. Each weight is
// repacked as cuda::upload_quant_weight repacks it; then every lane of every tile is emulated as kernels.cu's
// GEMMs run it (the words a lane loads, the bit tricks of quant_gpu.hpp, the bf16/f16 subtract and multiply,
// each rounded once as the hardware rounds) and each value is placed by the PTX fragment layout of the mma
// it feeds (written out here, independently of quant_gpu.hpp). The result must equal dequantize_rows - the
// bit-exact reference - rounded to the compute dtype: bit for bit when the scale's dtype is the compute dtype.
// Also: the kernel choice, split-K and scratch planning. Needs no GPU.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "quant_weights.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <nlohmann/json.hpp>

using namespace kvlite;
using namespace kvlite::cuda;
using json = nlohmann::json;
using namespace quant_test;

namespace {

std::string fixture(const std::string& relative) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant/" + relative;
}

// ---- the compute dtype's arithmetic, as the GPU rounds it -------------------------------------------------
// bf16 / f16 values are exact in float, and so are the products and differences the kernels form (8 x 8 and
// 11 x 11 significant bits), so float arithmetic followed by one rounding is the hardware's result.
float decode16(uint32_t bits, bool bf16) { return bf16 ? bf16_to_float(uint16_t(bits)) : f16_to_float(uint16_t(bits)); }
float round16(float value, bool bf16) { return round_to_dtype(value, bf16 ? DType::BF16 : DType::F16); }
DType dtype16(bool bf16) { return bf16 ? DType::BF16 : DType::F16; }
// One step of `dtype` at |value| (a subnormal step below the normal range).
float ulp_of(DType dtype, float value) {
  const int mantissa = dtype == DType::BF16 ? 7 : dtype == DType::F16 ? 10 : 23;
  const int min_exponent = dtype == DType::F16 ? -14 : -126;
  const int exponent = value == 0 ? min_exponent : std::max(min_exponent, std::ilogb(value));
  return std::ldexp(1.0f, exponent - mantissa);
}

// ---- the device image and the emulated kernels -------------------------------------------------------------
struct Device {
  QuantGpuLayout layout;
  std::vector<uint8_t> bytes;  // the whole device region, as upload_quant_weight writes it
  std::vector<float> reference;  // dequantize_rows, [N, K]
  std::vector<int32_t> perm;     // [k_pad] when permuted

  explicit Device(const QuantWeight& w) : Device(std::vector<const QuantWeight*>{&w}) {}
  // Several Linears fused into one (quant_gpu.hpp): the reference is the parts' dequantized rows, stacked.
  explicit Device(const std::vector<const QuantWeight*>& parts) : layout(quant_gpu_layout(parts)) {
    bytes.assign(size_t(layout.total_bytes), 0xcd);
    REQUIRE(repack_quant_tiles(parts, layout, 0, layout.n_tiles, bytes.data() + layout.tiles_offset).ok());
    REQUIRE(repack_quant_tables(parts, layout, bytes.data() + layout.scales_offset).ok());
    reference.resize(size_t(layout.n * layout.k));
    float* rows = reference.data();
    for (const QuantWeight* w : parts) {
      REQUIRE(dequantize_rows(*w, 0, w->out_features, rows).ok());
      rows += w->out_features * w->in_features;
    }
    if (layout.permuted) {
      perm.resize(size_t(layout.k_pad));
      memcpy(perm.data(), bytes.data() + layout.perm_offset, perm.size() * 4);
    }
  }
  uint32_t word_at(uint64_t offset) const { return load_u32_le(bytes.data() + offset); }
  const uint8_t* tile(int64_t n_tile, int64_t k_tile) const {
    return bytes.data() + layout.tiles_offset + uint64_t(n_tile) * layout.tile_row_bytes() +
           uint64_t(k_tile * layout.tile_bytes);
  }
  // A scale-table entry as the kernels read it: position `position` of column tile n_tile, group `group`.
  float scale(int64_t group, int64_t n_tile, int position) const {
    const int64_t index = group * layout.n_pad + n_tile * kQuantTileN + position;
    return scale_at(bytes.data() + layout.scales_offset, layout.table_scale_dtype, index);
  }
  uint32_t zero(int64_t group, int64_t n_tile, int position) const {
    return layout.zeros ? bytes[size_t(layout.zeros_offset + uint64_t(group * layout.n_pad + n_tile * 64 + position))] : 8u;
  }
  // The reference value for device element (n, device column k'): 0 in the padding.
  float expected(int64_t n, int64_t k_device) const {
    if (n >= layout.n || k_device >= layout.k) return 0.0f;
    const int64_t k = layout.permuted ? perm[size_t(k_device)] : k_device;
    return reference[size_t(n * layout.k + k)];
  }
};

// Compares the emulated value of (n, k') with the reference rounded once to the compute dtype: bit for bit, whatever
// the scale's dtype and rounding (quant_gpu.hpp's ScaleProduct).
struct ValueCheck {
  bool bf16;
  int64_t checked = 0, differing = 0;
  std::string first;
  void operator()(const Device& d, int64_t n, int64_t k_device, float got) {
    const float want = round16(d.expected(n, k_device), bf16);
    checked++;
    const bool ok = float_to_bits(got) == float_to_bits(want) || (got == 0 && want == 0);
    if (!ok && differing++ == 0)
      first = "[" + std::to_string(n) + ", " + std::to_string(k_device) + "]: got " + std::to_string(got) +
              " (bits " + std::to_string(float_to_bits(got)) + "), reference " + std::to_string(want) + " (bits " +
              std::to_string(float_to_bits(want)) + ")";
  }
};
#define CHECK_VALUES(check)                         \
  do {                                              \
    INFO((check).first);                            \
    CHECK((check).checked > 0);                     \
    CHECK((check).differing == 0);                  \
  } while (0)

// The kernels' scaled_pair: value (exact in the compute dtype) times its scale register, one bf16x2 / f16x2
// multiply (the scale rounded to the compute dtype: exact under pair_multiply) or fp32 (scale_product_fp32), then
// one rounding to the compute dtype.
float emulate_scaled(float value, float scale, ScaleProduct mode, bool bf16) {
  if (mode == ScaleProduct::pair_multiply) return round16(value * round16(scale, bf16), bf16);
  return round16(scale_product_fp32(value, scale, mode, bf16 ? DType::F16 : DType::BF16), bf16);
}

// W4A16, as kernels.cu's Int4A16 step: lane reads its 16 bytes (4 words) of the tile, its 8 scales at table
// positions 8g .. 8g+7 (and zero points), then per word w and pair p: bits = int4_pair_bits, (bits - (magic |
// zero)) exact in the compute dtype, times the scale as scaled_pair does -> B register int4_pair_register(p) of
// n8 block int4_pair_block(w, p).
void emulate_w4a16(const Device& d, const QuantWeight& w, bool bf16, ValueCheck& check) {
  const QuantGpuLayout& l = d.layout;
  const uint32_t magic = int4_magic(bf16);
  const ScaleProduct mode = scale_product(w.scale_dtype, w.rounding, dtype16(bf16));
  for (int64_t t = 0; t < l.n_tiles; t++)
    for (int64_t kt = 0; kt < l.k_pad / kInt4TileK; kt++) {
      const int64_t group = kt * kInt4TileK / l.group_size;
      for (int lane = 0; lane < 32; lane++) {
        const int g = lane / 4, q = lane % 4;
        float scale[8];
        uint32_t subtrahend[8];
        for (int j = 0; j < 8; j++) {
          scale[j] = d.scale(group, t, 8 * g + j);
          subtrahend[j] = int4_subtrahend_bits(d.zero(group, t, 8 * g + j), magic);
        }
        for (int word = 0; word < 4; word++) {
          const uint32_t bits_word = d.word_at(uint64_t(d.tile(t, kt) - d.bytes.data()) + 16 * lane + 4 * word);
          for (int pair = 0; pair < 4; pair++) {
            const uint32_t bits = int4_pair_bits(bits_word, pair, magic);
            const int j = int4_pair_block(word, pair), reg = int4_pair_register(pair);
            for (int half = 0; half < 2; half++) {
              const float value = decode16(bits >> (16 * half), bf16) - decode16(subtrahend[j], bf16);  // exact
              const float weight = emulate_scaled(value, scale[j], mode, bf16);
              // PTX m16n8k16 B fragment: register reg, half h holds B[k = 2q + 8 reg + h][n = g] of block j.
              check(d, t * 64 + 8 * j + g, kt * kInt4TileK + 2 * q + 8 * reg + half, weight);
            }
          }
        }
      }
    }
}

// W8A16, as kernels.cu's Fp8A16 step: lane reads its 4 chunks (16 words) of the k32 tile and its 8 scales
// (positions 8g + j, folded by 2^fix); word i of chunk c is register
// fp8_word_register(i) of block fp8_word_block(c, i); in m16n8k16 step r (= that register) it becomes b0/b1 by
// fp8_pair_order + fp8_pair_bits(pair s) times the folded scale. Its A operand for slot register s, element e
// is column w8a16_a_column(lane, r, s, e), so that is where the B value must come from.
void emulate_w8a16(const Device& d, const QuantWeight& w, bool bf16, ValueCheck& check) {
  const QuantGpuLayout& l = d.layout;
  const ScaleProduct mode = scale_product(w.scale_dtype, w.rounding, dtype16(bf16));
  for (int64_t t = 0; t < l.n_tiles; t++)
    for (int64_t kt = 0; kt < l.k_pad / kFp8TileK; kt++) {
      const int64_t group = kt * kFp8TileK / l.group_size;
      for (int lane = 0; lane < 32; lane++) {
        const int g = lane / 4;
        float scale[8];
        for (int j = 0; j < 8; j++) scale[j] = fp8_folded_scale(d.scale(group, t, 8 * g + j), bf16);
        for (int chunk = 0; chunk < 4; chunk++)
          for (int i = 0; i < 4; i++) {
            const uint64_t offset = uint64_t(d.tile(t, kt) - d.bytes.data()) + 512 * chunk + 16 * lane + 4 * i;
            const uint32_t ordered = fp8_pair_order(d.word_at(offset));
            const int j = fp8_word_block(chunk, i), step = fp8_word_register(i);
            for (int pair = 0; pair < 2; pair++) {
              const uint32_t bits = fp8_pair_bits(ordered, pair, bf16);
              for (int e = 0; e < 2; e++) {
                const float weight = emulate_scaled(decode16(bits >> (16 * e), bf16), scale[j], mode, bf16);
                check(d, t * 64 + 8 * j + g, kt * kFp8TileK + w8a16_a_column(lane, step, pair, e), weight);
              }
            }
          }
      }
    }
}

// W8A8: the kernel feeds the raw words to mma.m16n8k32, so byte b of register r of block j must be the stored
// e4m3 byte of B[k = 16r + 4q + b][n = g] (PTX's m16n8k32 B fragment), padding 0; and the per-column scale a
// lane applies to its accumulator column 8j + 2q + e must be that column's.
void check_w8a8_tiles(const Device& d, const QuantWeight& w) {
  const QuantGpuLayout& l = d.layout;
  int64_t checked = 0, wrong = 0;
  for (int64_t t = 0; t < l.n_tiles; t++)
    for (int64_t kt = 0; kt < l.k_pad / kFp8TileK; kt++)
      for (int lane = 0; lane < 32; lane++)
        for (int chunk = 0; chunk < 4; chunk++)
          for (int i = 0; i < 4; i++) {
            const uint32_t word = d.word_at(uint64_t(d.tile(t, kt) - d.bytes.data()) + 512 * chunk + 16 * lane + 4 * i);
            const int j = fp8_word_block(chunk, i), reg = fp8_word_register(i);
            for (int b = 0; b < 4; b++) {
              const int64_t n = t * 64 + 8 * j + lane / 4, k = kt * 32 + 16 * reg + 4 * (lane % 4) + b;
              const uint8_t want = n < l.n && k < l.k ? w.fp8[n * l.k + k] : 0;
              checked++;
              wrong += uint8_t(word >> (8 * b)) != want;
            }
          }
  CHECK(checked == l.n_pad * l.k_pad);
  CHECK(wrong == 0);
  for (int64_t group = 0; group < l.groups; group++)
    for (int64_t t = 0; t < l.n_tiles; t++)
      for (int lane = 0; lane < 32; lane++)
        for (int j = 0; j < 8; j++)
          for (int e = 0; e < 2; e++) {
            const int64_t n = t * 64 + 8 * j + 2 * (lane % 4) + e;
            float want = 0;
            if (n < l.n && group * l.group_size < l.k) {
              const int64_t source = w.granularity == ScaleGranularity::tensor    ? 0
                                     : w.granularity == ScaleGranularity::channel ? n
                                                                                  : (n / w.block_n) * w.scale_cols + group;
              want = scale_at(w.scales, w.scale_dtype, source);
            }
            CHECK(d.scale(group, t, w8a8_scale_position(lane, j, e)) == want);
          }
}

// The dequantize kernel (dequantize + cuBLAS, and every layout the mma kernels cannot read): each element of
// each tile, found by int4_tile_slot / fp8_tile_slot, with its group's scale and zero point from the tables,
// through dequantize_value - exactly the reference's float, padding 0.
void emulate_dequantize(const Device& d, const QuantWeight& w) {
  const QuantGpuLayout& l = d.layout;
  int64_t checked = 0, wrong = 0;
  std::string first;
  auto check = [&](int64_t n, int64_t k_device, float got) {
    const float want = d.expected(n, k_device);
    checked++;
    if (float_to_bits(got) != float_to_bits(want) && !(got == 0 && want == 0) && wrong++ == 0)
      first = "[" + std::to_string(n) + ", " + std::to_string(k_device) + "]: got " + std::to_string(got) +
              ", reference " + std::to_string(want);
  };
  for (int64_t t = 0; t < l.n_tiles; t++)
    for (int64_t kt = 0; kt < l.k_pad / l.tile_k; kt++) {
      const uint64_t tile = uint64_t(d.tile(t, kt) - d.bytes.data());
      for (int lane = 0; lane < 32; lane++) {
        if (w.format == WeightFormat::int4) {
          for (int word = 0; word < 4; word++)
            for (int nibble = 0; nibble < 8; nibble++) {
              int column, k;
              int4_tile_slot(lane, word, nibble, &column, &k);
              const int64_t k_device = kt * l.tile_k + k, group = k_device / l.group_size;
              const int position = quant_table_position(column);
              const int u = int((d.word_at(tile + 16 * lane + 4 * word) >> (4 * nibble)) & 0xfu);
              const float value = dequantize_value(float(u - int(d.zero(group, t, position))),
                                                   d.scale(group, t, position), w.scale_dtype, w.rounding);
              check(t * 64 + column, k_device, value);
            }
        } else {
          for (int chunk = 0; chunk < 4; chunk++)
            for (int word = 0; word < 4; word++)
              for (int byte = 0; byte < 4; byte++) {
                int column, k;
                fp8_tile_slot(lane, chunk, word, byte, &column, &k);
                const int64_t k_device = kt * l.tile_k + k, group = k_device / l.group_size;
                const uint8_t code = uint8_t(d.word_at(tile + 512 * chunk + 16 * lane + 4 * word) >> (8 * byte));
                // int8: q - z, both signed bytes (the zero table's byte at the scale's position, 0 without one)
                const int zero = l.zeros ? int(int8_t(d.zero(group, t, quant_table_position(column)))) : 0;
                const float decoded = w.format == WeightFormat::int8 ? float(int(int8_t(code)) - zero)
                                                                     : fp8_e4m3_to_float(code);
                const float value = dequantize_value(decoded,
                                                     d.scale(group, t, quant_table_position(column)), w.scale_dtype,
                                                     w.rounding);
                check(t * 64 + column, k_device, value);
              }
        }
      }
    }
  INFO(first);
  CHECK(checked == l.n_pad * l.k_pad);
  CHECK(wrong == 0);
}

// The dequantize kernel always, and the A16 kernels for both compute dtypes when the layout is theirs, over the
// device image d; w stands for the weight's format, scale dtype and rounding.
void check_emulations(const Device& d, const QuantWeight& w) {
  emulate_dequantize(d, w);
  if (!d.layout.mma) return;
  for (bool bf16 : {true, false}) {
    CAPTURE(bf16);
    // The reference's weight rounded once to the compute dtype, bit for bit, for every scale dtype and rounding.
    ValueCheck check{bf16};
    if (w.format == WeightFormat::int4) emulate_w4a16(d, w, bf16, check);
    else emulate_w8a16(d, w, bf16, check);
    CHECK(check.checked == d.layout.n_pad * d.layout.k_pad);
    CHECK_VALUES(check);
  }
}

// Every emulation that applies to `w`, and W8A8's tiles and scales for fp8.
void check_weight(const QuantWeight& w) {
  CAPTURE(w.name);
  const Device d(w);
  CHECK(d.layout.total_bytes == quant_device_bytes(w));
  check_emulations(d, w);
  if (d.layout.mma && w.format == WeightFormat::fp8) check_w8a8_tiles(d, w);
}

// check_weight for Linears fused into one device Linear: the kernels read the parts' reference rows stacked, bit
// for bit (the parts share format, scale dtype and rounding: the first stands for all).
void check_fused(const std::vector<const QuantWeight*>& parts) {
  const Device d(parts);
  CHECK(d.layout.total_bytes == quant_device_bytes(parts));
  check_emulations(d, *parts[0]);
}

// The fused device image is, byte for byte, the one repack of the parts' rows stacked into one checkpoint weight
// (made without the fusion code: concatenate_rows).
void check_same_as_concatenation(const std::vector<const QuantWeight*>& parts) {
  const OwnedWeight stacked = concatenate_rows(parts);
  const Device fused(parts), whole(stacked.weight);
  CHECK(fused.layout.total_bytes == whole.layout.total_bytes);
  CHECK(fused.bytes == whole.bytes);
  CHECK(fused.reference == whole.reference);
}

// The descriptor describe_linears would give for a hand-made weight.
LinearDesc desc_of(const QuantWeight& w) {
  LinearDesc d;
  d.name = w.name;
  d.out_features = w.out_features;
  d.in_features = w.in_features;
  d.format = w.format;
  d.weight_dtype = w.format == WeightFormat::int4 ? DType::I32 : DType::F8_E4M3;
  d.granularity = w.granularity;
  d.scale_dtype = w.scale_dtype;
  d.scale_name = w.rounding == DequantRounding::f32 ? "weight_scale_inv" : "weight_scale";
  d.group_size = w.group_size;
  d.block_n = w.block_n;
  d.block_k = w.block_k;
  d.symmetric = w.zero_points == nullptr;
  d.has_g_idx = w.g_idx != nullptr;
  d.has_bias = w.bias != nullptr;
  return d;
}

// quant_fusion_refusal of weights (a braced list of two pointers would also match the descriptors' overload as an
// iterator pair).
std::string refusal(const std::vector<const QuantWeight*>& parts) { return quant_fusion_refusal(parts); }

}  // namespace

// ---- geometry ---------------------------------------------------------------------------------------------

TEST_CASE("tile slots: every (column, k) of a tile is held by exactly one lane, word and nibble/byte") {
  std::vector<int> int4_hits(64 * 16, 0), fp8_hits(64 * 32, 0);
  for (int lane = 0; lane < 32; lane++) {
    for (int word = 0; word < 4; word++)
      for (int nibble = 0; nibble < 8; nibble++) {
        int column, k;
        int4_tile_slot(lane, word, nibble, &column, &k);
        REQUIRE(column >= 0);
        REQUIRE(column < 64);
        REQUIRE(k >= 0);
        REQUIRE(k < 16);
        int4_hits[size_t(column * 16 + k)]++;
        CHECK(column % 8 == lane / 4);  // a lane's columns are those of its B fragments (n = g)
      }
    for (int chunk = 0; chunk < 4; chunk++)
      for (int word = 0; word < 4; word++)
        for (int byte = 0; byte < 4; byte++) {
          int column, k;
          fp8_tile_slot(lane, chunk, word, byte, &column, &k);
          REQUIRE(column >= 0);
          REQUIRE(column < 64);
          REQUIRE(k >= 0);
          REQUIRE(k < 32);
          fp8_hits[size_t(column * 32 + k)]++;
          CHECK(column % 8 == lane / 4);
        }
  }
  CHECK(std::all_of(int4_hits.begin(), int4_hits.end(), [](int h) { return h == 1; }));
  CHECK(std::all_of(fp8_hits.begin(), fp8_hits.end(), [](int h) { return h == 1; }));
  for (int c = 0; c < 64; c++) CHECK(quant_table_column(quant_table_position(c)) == c);
  for (int lane = 0; lane < 32; lane++)
    for (int j = 0; j < 8; j++) CHECK(quant_table_column(8 * (lane / 4) + j) == 8 * j + lane / 4);
}

TEST_CASE("W8A16's A columns match its B values slot for slot, and cover each k16 step once") {
  for (int lane = 0; lane < 32; lane++)
    for (int step = 0; step < 2; step++)
      for (int reg = 0; reg < 2; reg++)
        for (int e = 0; e < 2; e++) {
          // B: pair `reg` of the ordered register `step` word holds bytes 2 reg, 2 reg + 1 of the stored word,
          // i.e. k = 16 step + 4q + 2 reg + e.
          CHECK(w8a16_a_column(lane, step, reg, e) == 16 * step + 4 * (lane % 4) + 2 * reg + e);
        }
  // Each m16n8k16 step sees its 16 columns once: slots (2q, 2q+1) and (2q+8, 2q+9) of lanes q = 0..3.
  for (int step = 0; step < 2; step++) {
    std::vector<int> hits(32, 0);
    for (int q = 0; q < 4; q++)
      for (int reg = 0; reg < 2; reg++)
        for (int e = 0; e < 2; e++) hits[size_t(w8a16_a_column(q, step, reg, e))]++;
    for (int k = 0; k < 32; k++) CHECK(hits[size_t(k)] == (k / 16 == step ? 1 : 0));
  }
}

// ---- bits ---------------------------------------------------------------------------------------------------

TEST_CASE("int4 magic-number dequantization: all 16 nibbles x all 16 zero points, bf16 and f16") {
  for (bool bf16 : {true, false}) {
    const uint32_t magic = int4_magic(bf16);
    for (uint32_t u = 0; u < 16; u++)
      for (uint32_t z = 0; z < 16; z++)
        for (int pair = 0; pair < 4; pair++) {
          // the nibble in low half position `pair` and (15 - u) in the high half's
          const uint32_t word = (u << (4 * pair)) | ((15 - u) << (4 * (pair + 4)));
          const uint32_t bits = int4_pair_bits(word, pair, magic);
          const float sub = decode16(int4_subtrahend_bits(z, magic), bf16);
          CHECK(decode16(bits, bf16) - sub == float(int(u) - int(z)));
          CHECK(decode16(bits >> 16, bf16) - sub == float(int(15 - u) - int(z)));
          CHECK(decode16(bits, bf16) == float(decode16(magic, bf16) + u));  // magic + u is exact
        }
  }
}

TEST_CASE("the device's one-LOP3 nibble extraction: its truth table computes the host's (a & b) | c") {
  // The device path of int4_pair_bits is lop3.b32(word >> 4p, kInt4PairMask, magic pair, kLop3AndOr); the host's
  // emulation of that instruction must give the host path's bits for every word tried.
  CHECK(kLop3AndOr == 0xeau);
  std::mt19937 rng(4242);
  for (bool bf16 : {true, false}) {
    const uint32_t magic = int4_magic(bf16);
    for (int trial = 0; trial < 2000; trial++) {
      const uint32_t word = static_cast<uint32_t>(rng());
      for (int pair = 0; pair < 4; pair++)
        CHECK(lop3_reference(word >> (4 * pair), kInt4PairMask, magic | (magic << 16), kLop3AndOr) ==
              int4_pair_bits(word, pair, magic));
    }
  }
  // and the emulation itself spells other tables as the PTX ISA does
  const uint32_t a = 0x12345678u, b = 0x0f0f0f0fu, c = 0xff00ff00u;
  CHECK(lop3_reference(a, b, c, 0xf0u) == a);
  CHECK(lop3_reference(a, b, c, 0xccu) == b);
  CHECK(lop3_reference(a, b, c, 0xaau) == c);
  CHECK(lop3_reference(a, b, c, 0xf0u & 0xccu) == (a & b));
  CHECK(lop3_reference(a, b, c, 0xf0u ^ 0xaau) == (a ^ c));
}

TEST_CASE("e4m3 bit decoding: all 256 codes, bf16 and f16, both byte pairs") {
  for (bool bf16 : {true, false}) {
    const float unfold = std::ldexp(1.0f, fp8_exponent_fix(bf16));
    for (int code = 0; code < 256; code++)
      for (int position = 0; position < 4; position++) {
        // the code at one byte position, another code elsewhere
        uint32_t word = 0x3a5c1e00u ^ (0x11111111u * uint32_t(position));
        word = (word & ~(0xffu << (8 * position))) | (uint32_t(code) << (8 * position));
        const uint32_t ordered = fp8_pair_order(word);
        // byte position -> (pair, half): k 0, 1 are pair 0, k 2, 3 pair 1
        const uint32_t bits = fp8_pair_bits(ordered, position / 2, bf16) >> (16 * (position % 2));
        const float decoded = decode16(bits & 0xffffu, bf16) * unfold;
        const float want = fp8_e4m3_to_float(uint8_t(code));
        CAPTURE(code);
        CAPTURE(position);
        if ((code & 0x7f) == 0x7f) CHECK(std::fabs(decoded) == 480.0f);  // NaN codes: refused at repack
        else CHECK(float_to_bits(decoded) == float_to_bits(want));          // -0 stays -0
      }
    // A folded scale restores q * s with one rounding: for every finite code and a few scales.
    for (float scale : {0.00390625f, 0.0123f, 1.5f, 37.0f})
      for (int code = 0; code < 256; code++) {
        if ((code & 0x7f) == 0x7f) continue;
        const uint32_t bits = fp8_pair_bits(fp8_pair_order(uint32_t(code)), 0, bf16);
        const float folded = round16(fp8_folded_scale(round16(scale, bf16), bf16), bf16);
        const float got = round16(decode16(bits & 0xffffu, bf16) * folded, bf16);
        const float want = round16(fp8_e4m3_to_float(uint8_t(code)) * round16(scale, bf16), bf16);
        CAPTURE(code);
        CHECK(float_to_bits(got) == float_to_bits(want));
      }
  }
}

// ---- whole weights through the emulated kernels ----------------------------------------------------------------

TEST_CASE("hand-made int4 weights: every nibble and zero point, each scale dtype, channel, groups, act-order") {
  Random rng(61);
  struct Shape { int64_t n, k, group; bool asymmetric, act_order; };
  const Shape shapes[] = {
      {128, 256, 128, false, false}, {192, 384, 32, true, false}, {64 * 3 + 7, 200, 200, false, false},
      {70, 272, 16, true, true},     {65, 512, 64, false, true},  {64, 1024, 1024, true, false},
      {96, 120, 24, true, true},  // groups of 24: the dequantize kernel only
  };
  for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
    for (const Shape& s : shapes) {
      CAPTURE(std::string(dtype_name(scale_dtype)));
      CAPTURE(s.n);
      CAPTURE(s.k);
      CAPTURE(s.group);
      OwnedWeight o = make_int4(s.n, s.k, s.group, scale_dtype, s.asymmetric, s.act_order, rng);
      const QuantGpuLayout layout = quant_gpu_layout(o.weight);
      CHECK(layout.permuted == s.act_order);
      CHECK(layout.zeros == s.asymmetric);
      CHECK(layout.mma == (s.group == s.k || s.group % 16 == 0));
      check_weight(o.weight);
    }
}

TEST_CASE("hand-made int8 weights: every byte and zero point, each scale dtype, channel, groups, act-order, padding") {
  Random rng(63);
  struct Shape { int64_t n, k, group; bool asymmetric, act_order; };
  const Shape shapes[] = {
      {128, 256, 256, false, false}, {192, 384, 32, true, false}, {64 * 3 + 7, 200, 200, true, false},
      {70, 272, 16, true, true},     {65, 512, 64, false, true},  {33, 100, 20, true, true},  // K, N off the tiles
  };
  for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
    for (const Shape& s : shapes) {
      CAPTURE(std::string(dtype_name(scale_dtype)));
      CAPTURE(s.n);
      CAPTURE(s.k);
      CAPTURE(s.group);
      OwnedWeight o = make_int8(s.n, s.k, s.group, scale_dtype, s.asymmetric, s.act_order, /*w8a8=*/false, rng);
      const QuantGpuLayout layout = quant_gpu_layout(o.weight);
      CHECK(layout.permuted == s.act_order);
      CHECK(layout.zeros == s.asymmetric);
      CHECK_FALSE(layout.mma);  // dequantize + cuBLAS only
      CHECK(layout.tile_bytes == kFp8TileBytes);
      // 1 byte a weight on the device (padded to whole tiles), plus tables
      CHECK(layout.tiles_bytes == uint64_t(layout.n_pad * layout.k_pad));
      CHECK(layout.table_scale_dtype == scale_dtype);
      check_weight(o.weight);
      // the descriptor the planner reads gives the same bytes
      LinearDesc desc = desc_of(o.weight);
      CHECK(quant_device_bytes(desc) == quant_device_bytes(o.weight));
      // every kernel but dequantize + cuBLAS refuses it, and the automatic choice is that one at every row count
      for (QuantKernel kernel : {QuantKernel::mma_a16, QuantKernel::mma_w8a8, QuantKernel::gemv_a16,
                                 QuantKernel::gemv_mma})
        CHECK_FALSE(quant_kernel_refusal(layout, kernel, DType::BF16, 90).empty());
      CHECK(quant_kernel_refusal(layout, QuantKernel::dequant_cublas, DType::BF16, 90).empty());
      for (int64_t rows : {1, 4, 16, 300})
        CHECK(choose_quant_kernel(layout, DType::BF16, 90, rows, QuantKernel::automatic) == QuantKernel::dequant_cublas);
    }
}

TEST_CASE("int8 Linears do not fuse on the GPU: each part uploads alone") {
  Random rng(64);
  OwnedWeight a = make_int8(64, 128, 128, DType::BF16, false, false, /*w8a8=*/false, rng);
  OwnedWeight b = make_int8(64, 128, 128, DType::BF16, false, false, /*w8a8=*/false, rng);
  CHECK(refusal({&a.weight, &b.weight}).find("not an int4 or fp8 Linear") != std::string::npos);
}

TEST_CASE("hand-made fp8 weights: all 254 finite e4m3 codes, tensor/channel/block scales of each dtype") {
  Random rng(62);
  struct Shape { int64_t n, k; ScaleGranularity granularity; int64_t block_n, block_k; };
  const Shape shapes[] = {
      {128, 256, ScaleGranularity::tensor, 0, 0},  {64 * 3 + 9, 200, ScaleGranularity::channel, 0, 0},
      {256, 384, ScaleGranularity::block, 128, 128}, {136, 160, ScaleGranularity::block, 128, 128},
      {40, 96, ScaleGranularity::block, 16, 32},    {72, 100, ScaleGranularity::block, 24, 48},
  };
  for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
    for (DequantRounding rounding : {DequantRounding::scale_dtype, DequantRounding::f32})
      for (const Shape& s : shapes) {
        CAPTURE(std::string(dtype_name(scale_dtype)));
        CAPTURE(s.n);
        CAPTURE(s.k);
        CAPTURE(int(rounding));
        OwnedWeight o = make_fp8(s.n, s.k, s.granularity, s.block_n, s.block_k, scale_dtype, rounding, rng);
        CHECK(quant_gpu_layout(o.weight).mma == (s.granularity != ScaleGranularity::block || s.block_k % 32 == 0));
        check_weight(o.weight);
      }
}

TEST_CASE("an fp8 weight holding the e4m3 NaN code is refused at repack, naming the element") {
  Random rng(63);
  for (uint8_t nan : {uint8_t(0x7f), uint8_t(0xff)}) {
    OwnedWeight o = make_fp8(70, 96, ScaleGranularity::channel, 0, 0, DType::BF16, DequantRounding::scale_dtype, rng);
    o.fp8[size_t(66 * 96 + 41)] = nan;
    const QuantGpuLayout layout = quant_gpu_layout(o.weight);
    std::vector<uint8_t> tiles(size_t(layout.tiles_bytes));
    const Status status = repack_quant_tiles(o.weight, layout, 0, layout.n_tiles, tiles.data());
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().code == ErrorCode::bad_format);
    CHECK(status.error().message.find("hand.fp8.weight[66, 41]") != std::string::npos);
    // the column tiles without it repack
    CHECK(repack_quant_tiles(o.weight, layout, 0, 1, tiles.data()).ok());
  }
}

TEST_CASE("odd-linears: every fixture Linear through the emulated kernels equals the reference") {
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = TensorStore::open_files({fixture("odd-linears/model.safetensors")}).value();
  REQUIRE(doc["linears"].size() == 14);
  for (const json& entry : doc["linears"]) check_weight(quant_weight(odd_linear_desc(entry), store).value());
}

TEST_CASE("fixture models: every quantized Linear through the emulated kernels equals the reference") {
  for (const char* name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    const std::string dir = fixture(name);
    const ModelConfig config = load_config(dir).value();
    TensorStore store = TensorStore::open_dir(dir).value();
    int quantized = 0;
    const std::vector<LinearDesc> linears = describe_linears(config, &store).value();
    for (const LinearDesc& desc : linears)
      if (desc.format != WeightFormat::dense) {
        const QuantWeight weight = quant_weight(desc, store).value();
        check_weight(weight);
        // the planner's count from the descriptor: the upload's, or (a g_idx in column order) the perm table more
        const uint64_t planned = quant_device_bytes(desc), uploaded = quant_device_bytes(weight);
        CHECK(planned >= uploaded);
        CHECK(planned - uploaded <= align_up(uint64_t(quant_gpu_layout(weight).k_pad) * 4, 256));
        CHECK((planned == uploaded) == (quant_gpu_layout(weight).permuted || !desc.has_g_idx));
        quantized++;
      }
    CHECK(quantized == 14);
    // each layer's q|k|v and gate|up: the descriptors' fusion answer (the planner's) is the weights' (the uploader's)
    int groups = 0, fused = 0;
    for (int64_t l = 0; l < config.text.num_layers; l++)
      for (const std::vector<std::string>& names :
           {std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
            std::vector<std::string>{"mlp.gate_proj", "mlp.up_proj"}}) {
        std::vector<const LinearDesc*> descs;
        std::vector<QuantWeight> weights;
        for (const std::string& name : names) {
          const std::string full = config.text_prefix() + "layers." + std::to_string(l) + "." + name;
          for (const LinearDesc& desc : linears)
            if (desc.name == full && desc.format != WeightFormat::dense) {
              descs.push_back(&desc);
              weights.push_back(quant_weight(desc, store).value());
            }
        }
        if (descs.size() != names.size()) continue;
        std::vector<const QuantWeight*> parts;
        for (const QuantWeight& w : weights) parts.push_back(&w);
        CAPTURE(descs[0]->name);
        CHECK(quant_fusion_refusal(descs) == quant_fusion_refusal(parts));
        if (quant_fusion_refusal(parts).empty()) {
          check_fused(parts);
          CHECK(quant_device_bytes(descs) >= quant_device_bytes(parts));
          fused++;
        }
        groups++;
      }
    CHECK(groups > 0);
    CHECK(fused > 0);  // whole 64-column tiles in every fixture: q|k|v and gate|up alike quantized fuse
  }
}

TEST_CASE("repacking in column-tile chunks gives the bytes of one whole repack") {
  Random rng(64);
  OwnedWeight int4 = make_int4(64 * 5 + 3, 384, 128, DType::BF16, true, false, rng);
  OwnedWeight fp8 = make_fp8(64 * 4 + 1, 320, ScaleGranularity::block, 128, 128, DType::F32, DequantRounding::f32, rng);
  for (const QuantWeight* w : {&int4.weight, &fp8.weight}) {
    const QuantGpuLayout layout = quant_gpu_layout(*w);
    std::vector<uint8_t> whole(size_t(layout.tiles_bytes)), pieces(size_t(layout.tiles_bytes), 0);
    REQUIRE(repack_quant_tiles(*w, layout, 0, layout.n_tiles, whole.data()).ok());
    for (int64_t first = 0; first < layout.n_tiles; first += 2) {
      const int64_t count = std::min<int64_t>(2, layout.n_tiles - first);
      REQUIRE(repack_quant_tiles(*w, layout, first, count, pieces.data() + first * layout.tile_row_bytes()).ok());
    }
    CHECK(whole == pieces);
    CHECK_FALSE(repack_quant_tiles(*w, layout, layout.n_tiles - 1, 2, pieces.data()).ok());
  }
}

TEST_CASE("fused Linears: q|k|v and gate|up repacked as one device Linear equal the parts' references stacked") {
  Random rng(66);
  for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32}) {
    CAPTURE(std::string(dtype_name(scale_dtype)));
    // int4 q | k | v of a GQA layer (the last part ragged: its padding is the fused Linear's), groups of 32 and
    // channel scales, symmetric and asymmetric; biases in some parts only (the device bias is one F32 table)
    for (int64_t group : {int64_t(32), int64_t(256)})
      for (bool asymmetric : {false, true}) {
        CAPTURE(group);
        CAPTURE(asymmetric);
        OwnedWeight q = make_int4(128, 256, group, scale_dtype, asymmetric, false, rng);
        OwnedWeight k = make_int4(64, 256, group, scale_dtype, asymmetric, false, rng);
        OwnedWeight v = make_int4(64 + 24, 256, group, scale_dtype, asymmetric, false, rng);
        add_bias(q, DType::BF16, rng);
        add_bias(v, DType::F32, rng);
        const std::vector<const QuantWeight*> parts = {&q.weight, &k.weight, &v.weight};
        REQUIRE(refusal(parts) == "");
        check_fused(parts);
        const Device d(parts);
        CHECK(d.layout.n == 128 + 64 + 88);
        CHECK(d.layout.n_pad == 320);
        // the bias table: each part's bias at its columns, zeros for k (none) and the padding
        for (int64_t n = 0; n < d.layout.n_pad; n++) {
          float want = 0;
          if (n < 128) want = scale_at(q.weight.bias, q.weight.bias_dtype, n);
          else if (n >= 192 && n < 280) want = scale_at(v.weight.bias, v.weight.bias_dtype, n - 192);
          float got;
          memcpy(&got, d.bytes.data() + d.layout.bias_offset + uint64_t(n) * 4, 4);
          CHECK(got == want);
        }
        for (int64_t t = 0; t < d.layout.n_tiles; t++) CHECK(d.word_at(d.layout.counters_offset + uint64_t(t) * 4) == 0);
        // never more than the parts one by one
        CHECK(quant_device_bytes(parts) <= quant_device_bytes(q.weight) + quant_device_bytes(k.weight) +
                                               quant_device_bytes(v.weight));
        check_same_as_concatenation(parts);
        // gate | up: two equal parts
        OwnedWeight gate = make_int4(192, 256, group, scale_dtype, asymmetric, false, rng);
        OwnedWeight up = make_int4(192, 256, group, scale_dtype, asymmetric, false, rng);
        check_fused({&gate.weight, &up.weight});
        check_same_as_concatenation({&gate.weight, &up.weight});
      }
    // fp8: tensor, channel and tensor scales mix (the device table holds one per column); blocks of one block_k
    // but different block_n
    for (DequantRounding rounding : {DequantRounding::scale_dtype, DequantRounding::f32}) {
      CAPTURE(int(rounding));
      OwnedWeight q = make_fp8(128, 160, ScaleGranularity::tensor, 0, 0, scale_dtype, rounding, rng);
      OwnedWeight k = make_fp8(64, 160, ScaleGranularity::channel, 0, 0, scale_dtype, rounding, rng);
      OwnedWeight v = make_fp8(40, 160, ScaleGranularity::tensor, 0, 0, scale_dtype, rounding, rng);
      add_bias(k, DType::F16, rng);
      REQUIRE(refusal({&q.weight, &k.weight, &v.weight}) == "");
      check_fused({&q.weight, &k.weight, &v.weight});
      check_same_as_concatenation({&q.weight, &k.weight, &v.weight});
      OwnedWeight gate = make_fp8(128, 256, ScaleGranularity::block, 128, 128, scale_dtype, rounding, rng);
      OwnedWeight up = make_fp8(136, 256, ScaleGranularity::block, 64, 128, scale_dtype, rounding, rng);
      REQUIRE(refusal({&gate.weight, &up.weight}) == "");
      check_fused({&gate.weight, &up.weight});
      OwnedWeight up128 = make_fp8(136, 256, ScaleGranularity::block, 128, 128, scale_dtype, rounding, rng);
      check_same_as_concatenation({&gate.weight, &up128.weight});
    }
  }
}

TEST_CASE("fused Linears: act-order parts with one g_idx share its permutation") {
  Random rng(70);
  for (bool asymmetric : {false, true}) {
    CAPTURE(asymmetric);
    OwnedWeight q = make_int4(128, 272, 16, DType::BF16, asymmetric, true, rng);
    OwnedWeight k = make_int4(64, 272, 16, DType::BF16, asymmetric, true, rng);
    OwnedWeight v = make_int4(70, 272, 16, DType::BF16, asymmetric, true, rng);
    for (OwnedWeight* o : {&k, &v}) {  // GPTQ's permutation comes from the shared input: one g_idx
      o->g_idx = q.g_idx;
      o->weight.g_idx = o->g_idx.data();
    }
    const std::vector<const QuantWeight*> parts = {&q.weight, &k.weight, &v.weight};
    REQUIRE(refusal(parts) == "");
    CHECK(quant_gpu_layout(parts).permuted);
    check_fused(parts);
    check_same_as_concatenation(parts);
  }
}

TEST_CASE("fused Linears: repacking in column-tile chunks across the parts' boundaries gives one whole repack") {
  Random rng(67);
  OwnedWeight a = make_int4(128, 384, 128, DType::BF16, true, false, rng);
  OwnedWeight b = make_int4(64, 384, 128, DType::BF16, true, false, rng);
  OwnedWeight c = make_int4(64 * 2 + 5, 384, 128, DType::BF16, true, false, rng);
  const std::vector<const QuantWeight*> parts = {&a.weight, &b.weight, &c.weight};
  const QuantGpuLayout layout = quant_gpu_layout(parts);
  REQUIRE(layout.n_tiles == 6);
  std::vector<uint8_t> whole(size_t(layout.tiles_bytes)), pieces(size_t(layout.tiles_bytes), 0);
  REQUIRE(repack_quant_tiles(parts, layout, 0, layout.n_tiles, whole.data()).ok());
  for (int64_t first = 0; first < layout.n_tiles; first += 3) {  // [0, 3) ends inside b, [3, 6) starts inside c
    REQUIRE(repack_quant_tiles(parts, layout, first, 3, pieces.data() + first * layout.tile_row_bytes()).ok());
  }
  CHECK(whole == pieces);
  // a part's own repack is its share of the fused tiles
  std::vector<uint8_t> own(size_t(quant_gpu_layout(b.weight).tiles_bytes));
  REQUIRE(repack_quant_tiles(b.weight, quant_gpu_layout(b.weight), 0, 1, own.data()).ok());
  CHECK(std::equal(own.begin(), own.end(), whole.begin() + 2 * layout.tile_row_bytes()));
  CHECK_FALSE(repack_quant_tiles(parts, layout, 5, 2, pieces.data()).ok());
}

TEST_CASE("fused Linears: what does not fuse is refused, naming the parts, from weights and descriptors alike") {
  Random rng(68);
  OwnedWeight base = make_int4(128, 256, 32, DType::BF16, false, false, rng);
  base.weight.name = "layer.q_proj";
  struct Case {
    const char* what;
    OwnedWeight other;
    const char* expect;  // in the message
  };
  auto named = [](OwnedWeight o, const char* name) {
    o.weight.name = name;
    return o;
  };
  std::vector<Case> cases;
  cases.push_back({"fp8 beside int4", named(make_fp8(64, 256, ScaleGranularity::channel, 0, 0, DType::BF16,
                                                     DequantRounding::scale_dtype, rng), "layer.k_proj"), "int4"});
  cases.push_back({"another K", named(make_int4(64, 384, 32, DType::BF16, false, false, rng), "layer.k_proj"), "input"});
  cases.push_back({"another scale dtype", named(make_int4(64, 256, 32, DType::F16, false, false, rng), "layer.k_proj"),
                   "dtypes"});
  cases.push_back({"another group", named(make_int4(64, 256, 64, DType::BF16, false, false, rng), "layer.k_proj"),
                   "groups"});
  cases.push_back({"channel beside groups", named(make_int4(64, 256, 256, DType::BF16, false, false, rng), "layer.k_proj"),
                   "groups"});
  cases.push_back({"zero points in one", named(make_int4(64, 256, 32, DType::BF16, true, false, rng), "layer.k_proj"),
                   "zero points"});
  cases.push_back({"act-order", named(make_int4(64, 256, 32, DType::BF16, false, true, rng), "layer.k_proj"), "g_idx"});
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const std::vector<const QuantWeight*> parts = {&base.weight, &c.other.weight};
    const std::string why = refusal(parts);
    CHECK(why.find(c.expect) != std::string::npos);
    CHECK(why.find("layer.k_proj") != std::string::npos);
    const LinearDesc d0 = desc_of(base.weight), d1 = desc_of(c.other.weight);
    CHECK(quant_fusion_refusal(std::vector<const LinearDesc*>{&d0, &d1}) == why);
    std::vector<uint8_t> out(1 << 20);
    CHECK_FALSE(repack_quant_tables(parts, quant_gpu_layout(base.weight), out.data()).ok());
  }
  // act-order: parts with one g_idx fuse (one permutation); another g_idx does not; descriptors cannot tell
  OwnedWeight act_q = named(make_int4(128, 256, 32, DType::BF16, false, true, rng), "layer.q_proj");
  OwnedWeight act_k = named(make_int4(64, 256, 32, DType::BF16, false, true, rng), "layer.k_proj");
  CHECK(refusal({&act_q.weight, &act_k.weight}).find("layer.k_proj's g_idx differs from layer.q_proj's") !=
        std::string::npos);
  act_k.g_idx = act_q.g_idx;
  act_k.weight.g_idx = act_k.g_idx.data();
  CHECK(refusal({&act_q.weight, &act_k.weight}) == "");
  const LinearDesc act_dq = desc_of(act_q.weight), act_dk = desc_of(act_k.weight);
  CHECK(quant_fusion_refusal(std::vector<const LinearDesc*>{&act_dq, &act_dk}).find("descriptors do not tell") !=
        std::string::npos);
  // every part but the last in whole 64-column tiles
  OwnedWeight ragged = named(make_int4(96, 256, 32, DType::BF16, false, false, rng), "layer.q_proj");
  OwnedWeight last = named(make_int4(64, 256, 32, DType::BF16, false, false, rng), "layer.k_proj");
  CHECK(refusal({&ragged.weight, &last.weight}).find("layer.q_proj has 96 output features") !=
        std::string::npos);
  CHECK(refusal({&last.weight, &ragged.weight}) == "");
  // fp8: blocks beside channel scales, blocks of another block_k, another rounding
  OwnedWeight channel = make_fp8(128, 256, ScaleGranularity::channel, 0, 0, DType::F32, DequantRounding::f32, rng);
  OwnedWeight block = make_fp8(128, 256, ScaleGranularity::block, 128, 128, DType::F32, DequantRounding::f32, rng);
  OwnedWeight block64 = make_fp8(128, 256, ScaleGranularity::block, 128, 64, DType::F32, DequantRounding::f32, rng);
  OwnedWeight rounded = make_fp8(128, 256, ScaleGranularity::channel, 0, 0, DType::F32, DequantRounding::scale_dtype, rng);
  CHECK(refusal({&channel.weight, &block.weight}).find("blocks") != std::string::npos);
  CHECK(refusal({&block.weight, &block64.weight}).find("block_k 128, block_k 64") != std::string::npos);
  CHECK(refusal({&channel.weight, &rounded.weight}).find("roundings") != std::string::npos);
  for (const auto& pair : {std::make_pair(&channel, &block), std::make_pair(&block, &block64),
                           std::make_pair(&channel, &rounded), std::make_pair(&ragged, &last)}) {
    const LinearDesc d0 = desc_of(pair.first->weight), d1 = desc_of(pair.second->weight);
    CHECK(quant_fusion_refusal(std::vector<const LinearDesc*>{&d0, &d1}) ==
          refusal({&pair.first->weight, &pair.second->weight}));
  }
}

TEST_CASE("linear_group_fuses: quantized parts that fuse, or dense parts with biases in all or none") {
  Random rng(69);
  OwnedWeight q = make_int4(128, 256, 32, DType::BF16, false, false, rng);
  OwnedWeight k = make_int4(64, 256, 32, DType::BF16, false, false, rng);
  OwnedWeight k16 = make_int4(64, 256, 32, DType::F16, false, false, rng);
  auto quant = [](const OwnedWeight& o) {
    LinearWeights l;
    l.quant = std::make_shared<const QuantWeight>(o.weight);
    return l;
  };
  std::vector<uint16_t> storage(64 * 256 + 64, 0x3f80);
  auto dense = [&](int64_t n, bool bias) {
    LinearWeights l;
    l.weight = Tensor::matrix(storage.data(), DType::BF16, n, 256);
    if (bias) l.bias = Tensor::vector(storage.data() + 64 * 256, DType::BF16, n);
    return l;
  };
  CHECK(linear_group_fuses(LinearGroup{{quant(q), quant(k)}}));
  CHECK_FALSE(linear_group_fuses(LinearGroup{{quant(q), quant(k16)}}));  // scale dtypes differ
  CHECK_FALSE(linear_group_fuses(LinearGroup{{quant(q)}}));               // one part: nothing to fuse
  CHECK_FALSE(linear_group_fuses(LinearGroup{{quant(q), dense(64, false)}}));
  CHECK(linear_group_fuses(LinearGroup{{dense(64, false), dense(32, false), dense(32, false)}}));
  CHECK(linear_group_fuses(LinearGroup{{dense(64, true), dense(32, true)}}));
  CHECK_FALSE(linear_group_fuses(LinearGroup{{dense(64, true), dense(32, false)}}));
  LinearWeights narrower = dense(32, false);
  narrower.weight.cols = narrower.weight.row_stride = 128;  // another in_features
  CHECK_FALSE(linear_group_fuses(LinearGroup{{dense(64, false), narrower}}));
  // the descriptors' answer is the weights'
  const LinearDesc dq = desc_of(q.weight), dk = desc_of(k.weight), dk16 = desc_of(k16.weight);
  CHECK(linear_group_fuses(std::vector<const LinearDesc*>{&dq, &dk}));
  CHECK_FALSE(linear_group_fuses(std::vector<const LinearDesc*>{&dq, &dk16}));
  LinearDesc a, b;
  a.out_features = b.out_features = 64;
  a.in_features = b.in_features = 256;
  a.has_bias = true;
  CHECK_FALSE(linear_group_fuses(std::vector<const LinearDesc*>{&a, &b}));
  b.has_bias = true;
  CHECK(linear_group_fuses(std::vector<const LinearDesc*>{&a, &b}));
  b.in_features = 128;
  CHECK_FALSE(linear_group_fuses(std::vector<const LinearDesc*>{&a, &b}));
}

TEST_CASE("layout arithmetic: sizes, alignment, padding, tables, and quant_device_bytes") {
  Random rng(65);
  OwnedWeight o = make_int4(100, 200, 200, DType::F16, true, false, rng);  // channel: one group over k_pad
  const QuantGpuLayout l = quant_gpu_layout(o.weight);
  CHECK(l.n_pad == 128);
  CHECK(l.k_pad == 256);
  CHECK(l.groups == 1);
  CHECK(l.group_size == 256);
  CHECK(l.tiles_bytes == 128 * 256 / 2);
  CHECK(l.scales_bytes == 128 * 2);
  CHECK(l.zeros_bytes == 128);
  CHECK(l.perm_bytes == 0);
  CHECK(l.bias_bytes == 128 * 4);
  CHECK(l.counters_bytes == 2 * 4);
  for (uint64_t offset : {l.scales_offset, l.zeros_offset, l.perm_offset, l.bias_offset, l.counters_offset})
    CHECK(offset % 256 == 0);
  CHECK(l.total_bytes == l.counters_offset + 256);
  CHECK(quant_device_bytes(o.weight) == l.total_bytes);
  // a g_idx that restates column order is no act-order
  OwnedWeight ordered = make_int4(64, 256, 32, DType::BF16, false, false, rng);
  std::vector<int32_t> groups(256);
  for (int k = 0; k < 256; k++) groups[size_t(k)] = k / 32;
  ordered.weight.g_idx = reinterpret_cast<const uint8_t*>(groups.data());
  CHECK_FALSE(quant_gpu_layout(ordered.weight).permuted);
  std::swap(groups[3], groups[40]);
  CHECK(quant_gpu_layout(ordered.weight).permuted);
  // bias and counters
  std::vector<uint16_t> bias(100);
  for (int n = 0; n < 100; n++) bias[size_t(n)] = float_to_bf16(0.25f * float(n) - 3.0f);
  o.weight.bias = reinterpret_cast<const uint8_t*>(bias.data());
  o.weight.bias_dtype = DType::BF16;
  Device d(o.weight);
  for (int64_t n = 0; n < l.n_pad; n++) {
    float value;
    memcpy(&value, d.bytes.data() + l.bias_offset + 4 * n, 4);
    CHECK(value == (n < 100 ? bf16_to_float(bias[size_t(n)]) : 0.0f));
  }
  for (int64_t t = 0; t < l.n_tiles; t++) CHECK(d.word_at(l.counters_offset + 4 * t) == 0);
}

// ---- kernel choice and planning ---------------------------------------------------------------------------------

TEST_CASE("kernel choice: the GEMV for decode rows, W8A8 for fp8 on sm_89+, mma up to kQuantMmaMaxRows, else dequantize") {
  Random rng(66);
  OwnedWeight int4 = make_int4(128, 256, 128, DType::BF16, false, false, rng);
  OwnedWeight odd = make_int4(128, 240, 40, DType::BF16, false, false, rng);  // groups of 40: no mma
  OwnedWeight fp8 = make_fp8(128, 256, ScaleGranularity::block, 128, 128, DType::BF16, DequantRounding::f32, rng);
  const QuantGpuLayout li = quant_gpu_layout(int4.weight), lo = quant_gpu_layout(odd.weight),
                       lf = quant_gpu_layout(fp8.weight);
  const QuantKernel a = QuantKernel::automatic;
  // decode rows: a GEMV on every GPU while the layout has mma tiles and activations are 16-bit: both formats
  // through gemv_mma up to its rows (then the mma kernels); gemv_a16 only when forced
  const int64_t past_gemv = std::max(quant_gemv_mma_auto_rows(WeightFormat::int4), quant_gemv_mma_auto_rows(WeightFormat::fp8)) + 1;
  for (int sm : {80, 86, 87, 89, 90, 100, 120})
    for (int64_t rows = 1; rows <= past_gemv; rows++) {
      CAPTURE(sm);
      CAPTURE(rows);
      const QuantKernel on_int4 = choose_quant_kernel(li, DType::BF16, sm, rows, a);
      const QuantKernel on_fp8 = choose_quant_kernel(lf, DType::F16, sm, rows, a);
      CHECK((on_int4 == QuantKernel::gemv_mma) == (rows <= quant_gemv_mma_auto_rows(WeightFormat::int4)));
      CHECK((on_fp8 == QuantKernel::gemv_mma) == (rows <= quant_gemv_mma_auto_rows(WeightFormat::fp8)));
      CHECK(on_int4 != QuantKernel::gemv_a16);
      CHECK(on_fp8 != QuantKernel::gemv_a16);
      if (rows > quant_gemv_mma_auto_rows(WeightFormat::fp8))
        CHECK(on_fp8 == (quant_w8a8_preferred(sm) ? QuantKernel::mma_w8a8 : QuantKernel::mma_a16));
      CHECK(choose_quant_kernel(lo, DType::BF16, sm, rows, a) == QuantKernel::dequant_cublas);
      CHECK(choose_quant_kernel(li, DType::F32, sm, rows, a) == QuantKernel::dequant_cublas);
    }
  CHECK(quant_gemv_auto_rows(WeightFormat::fp8) <= kQuantGemvMaxRows);
  CHECK(quant_gemv_auto_rows(WeightFormat::int4) <= kQuantGemvMaxRows);
  CHECK(quant_gemv_mma_auto_rows(WeightFormat::int4) <= kQuantGemvMmaMaxRows);
  CHECK(quant_gemv_mma_auto_rows(WeightFormat::fp8) <= kQuantGemvMmaMaxRows);
  CHECK(choose_quant_kernel(li, DType::BF16, 90, past_gemv, a) == QuantKernel::mma_a16);
  CHECK(choose_quant_kernel(li, DType::F16, 80, kQuantMmaMaxRows, a) == QuantKernel::mma_a16);
  CHECK(choose_quant_kernel(li, DType::BF16, 90, kQuantMmaMaxRows + 1, a) == QuantKernel::dequant_cublas);
  CHECK(choose_quant_kernel(li, DType::F32, 90, 1, a) == QuantKernel::dequant_cublas);
  CHECK(choose_quant_kernel(lo, DType::BF16, 90, 1, a) == QuantKernel::dequant_cublas);
  CHECK(choose_quant_kernel(lf, DType::BF16, 89, 2048, a) == QuantKernel::mma_w8a8);
  CHECK(choose_quant_kernel(lf, DType::BF16, 120, past_gemv, a) == QuantKernel::mma_w8a8);
  CHECK(choose_quant_kernel(lf, DType::BF16, 87, past_gemv, a) == QuantKernel::mma_a16);
  // Hopper: the warp-level e4m3 mma is emulated there; W8A16 (or dequantize + cuBLAS past kQuantMmaMaxRows)
  CHECK(choose_quant_kernel(lf, DType::BF16, 90, past_gemv, a) == QuantKernel::mma_a16);
  CHECK(choose_quant_kernel(lf, DType::BF16, 90, 2048, a) == QuantKernel::dequant_cublas);
  CHECK(choose_quant_kernel(lf, DType::BF16, 90, 1, QuantKernel::mma_w8a8) == QuantKernel::mma_w8a8);
  CHECK(quant_kernel_refusal(lf, QuantKernel::mma_w8a8, DType::BF16, 90).empty());
  CHECK(choose_quant_kernel(lf, DType::BF16, 100, past_gemv, a) == QuantKernel::mma_w8a8);
  CHECK(choose_quant_kernel(li, DType::BF16, 90, 1, QuantKernel::mma_a16) == QuantKernel::mma_a16);
  CHECK(quant_kernel_refusal(li, QuantKernel::gemv_a16, DType::BF16, 86).empty());
  CHECK(quant_kernel_refusal(lf, QuantKernel::gemv_a16, DType::F16, 90).empty());
  CHECK(quant_kernel_refusal(li, QuantKernel::gemv_a16, DType::F32, 90).find("F32") != std::string::npos);
  CHECK(quant_kernel_refusal(lo, QuantKernel::gemv_a16, DType::BF16, 90).find("40") != std::string::npos);
  CHECK(std::string(quant_kernel_name(QuantKernel::gemv_a16)) == "gemv_a16");
  CHECK(quant_kernel_refusal(li, QuantKernel::gemv_mma, DType::BF16, 86).empty());
  CHECK(quant_kernel_refusal(lf, QuantKernel::gemv_mma, DType::F16, 120).empty());
  CHECK(quant_kernel_refusal(li, QuantKernel::gemv_mma, DType::F32, 90).find("F32") != std::string::npos);
  CHECK(quant_kernel_refusal(lo, QuantKernel::gemv_mma, DType::BF16, 90).find("40") != std::string::npos);
  CHECK(std::string(quant_kernel_name(QuantKernel::gemv_mma)) == "gemv_mma");
  CHECK(choose_quant_kernel(lf, DType::BF16, 86, 4096, a) == QuantKernel::dequant_cublas);
  CHECK(choose_quant_kernel(lf, DType::BF16, 90, 1, QuantKernel::mma_a16) == QuantKernel::mma_a16);
  CHECK(quant_kernel_refusal(li, QuantKernel::mma_a16, DType::BF16, 80).empty());
  CHECK(quant_kernel_refusal(lf, QuantKernel::mma_w8a8, DType::BF16, 89).empty());
  CHECK(quant_kernel_refusal(lf, QuantKernel::mma_w8a8, DType::BF16, 86).find("sm_86") != std::string::npos);
  CHECK(quant_kernel_refusal(li, QuantKernel::mma_w8a8, DType::BF16, 90).find("fp8 weights only") != std::string::npos);
  CHECK(quant_kernel_refusal(lo, QuantKernel::mma_a16, DType::BF16, 90).find("40") != std::string::npos);
  CHECK(quant_kernel_refusal(li, QuantKernel::mma_a16, DType::F32, 90).find("F32") != std::string::npos);
  CHECK(quant_kernel_refusal(lo, QuantKernel::dequant_cublas, DType::F32, 80).empty());
}

TEST_CASE("quant_group_of: the GEMM's 32-bit group index equals k / group_size, shifted for powers of two") {
  CHECK(quant_group_shift(128) == 7);
  CHECK(quant_group_shift(32) == 5);
  CHECK(quant_group_shift(1) == 0);
  CHECK(quant_group_shift(96) == -1);
  CHECK(quant_group_shift(0) == -1);
  Random rng(69);
  for (int64_t group : {int64_t(16), int64_t(32), int64_t(64), int64_t(96), int64_t(128), int64_t(160), int64_t(256),
                        int64_t(4096), int64_t(1) << 20}) {
    const int shift = quant_group_shift(group);
    for (int trial = 0; trial < 2000; trial++) {
      const uint32_t k = trial < 4 ? uint32_t(INT32_MAX - trial) : uint32_t(rng.below(int64_t(INT32_MAX)));
      CAPTURE(group); CAPTURE(k);
      REQUIRE(quant_group_of(k, uint32_t(group), shift) == uint32_t(int64_t(k) / group));
    }
  }
}

TEST_CASE("planning: split-K fills the GPU for one block row, scratch is never exceeded, rows pass in chunks") {
  Random rng(67);
  OwnedWeight big = make_int4(1024, 4096, 128, DType::BF16, false, false, rng);  // 16 column tiles, 32 stages
  const QuantGpuLayout l = quant_gpu_layout(big.weight);
  QuantGemmPlan plan;
  std::string why;
  // decode: 16 tiles on a GPU holding 396 blocks -> splits so that 16 x splits <= 396, each of at least
  // kQuantMinSplitStages of the 32 stages
  REQUIRE(plan_quant_gemm(l, QuantKernel::mma_a16, 1, false, 2, 32 * MiB, 396, &plan, &why));
  const int64_t splits = std::min<int64_t>(396 / 16, 32 / kQuantMinSplitStages);
  CHECK(plan.splits == splits);
  CHECK(plan.row_chunk == 1);
  CHECK(plan.partial_bytes == uint64_t(splits * 16 * 16 * 64 * 4));
  CHECK_FALSE(plan.stage_x);
  for (int64_t s = 0; s < plan.splits; s++) {
    int64_t begin, end;
    quant_split_range(l.stages, plan.splits, s, &begin, &end);
    CHECK(end - begin >= kQuantMinSplitStages);
  }
  REQUIRE(plan_quant_gemm(l, QuantKernel::mma_a16, 1, false, 2, 32 * MiB, 100, &plan, &why));
  CHECK(plan.splits == std::min<int64_t>(100 / 16, 32 / kQuantMinSplitStages));
  // many column tiles already fill it: no split
  REQUIRE(plan_quant_gemm(l, QuantKernel::mma_a16, 7, false, 2, 32 * MiB, 12, &plan, &why));
  CHECK(plan.splits == 1);
  CHECK(plan.partial_bytes == 0);
  // the GEMV: passes of at most kQuantGemvMaxRows rows, split like one mma block row (16-row partials)
  for (int64_t rows : {1, 3, 4, 5, 9}) {
    CAPTURE(rows);
    REQUIRE(plan_quant_gemm(l, QuantKernel::gemv_a16, rows, false, 2, 32 * MiB, 396, &plan, &why));
    CHECK(plan.row_chunk == std::min(rows, kQuantGemvMaxRows));
    CHECK(plan.splits == splits);
    CHECK(plan.partial_bytes == uint64_t(splits * 16 * 16 * 64 * 4));
    REQUIRE(plan_quant_gemm(l, QuantKernel::gemv_a16, rows, true, 2, 32 * MiB, 396, &plan, &why));
    CHECK(plan.row_chunk == std::min(rows, kQuantGemvMaxRows));
    CHECK(plan.x_bytes >= uint64_t(plan.row_chunk) * quant_staged_row_bytes(l, QuantKernel::gemv_a16));
  }
  // the tensor-core GEMV: passes of at most kQuantGemvMmaMaxRows rows, the same splits and partials
  for (int64_t rows : {1, 9, 16, 17, 40}) {
    CAPTURE(rows);
    REQUIRE(plan_quant_gemm(l, QuantKernel::gemv_mma, rows, false, 2, 32 * MiB, 396, &plan, &why));
    CHECK(plan.row_chunk == std::min(rows, kQuantGemvMmaMaxRows));
    CHECK(plan.splits == splits);
    CHECK(plan.partial_bytes == uint64_t(splits * 16 * 16 * 64 * 4));
  }
  // more than 64 rows: no split (the block rows give the parallelism)
  REQUIRE(plan_quant_gemm(l, QuantKernel::mma_a16, 100, false, 2, 32 * MiB, 396, &plan, &why));
  CHECK(plan.splits == 1);
  // a small scratch: fewer splits, then none; staged rows in chunks; never over the scratch
  for (uint64_t scratch : {uint64_t(64 * KiB), uint64_t(300 * KiB), uint64_t(2 * MiB), uint64_t(32 * MiB)})
    for (QuantKernel kernel :
         {QuantKernel::mma_a16, QuantKernel::mma_w8a8, QuantKernel::gemv_a16, QuantKernel::gemv_mma})
      for (int64_t rows : {1, 16, 33, 64, 65, 2048}) {
        CAPTURE(scratch);
        CAPTURE(rows);
        CAPTURE(quant_kernel_name(kernel));
        REQUIRE(plan_quant_gemm(l, kernel, rows, true, 2, scratch, 396, &plan, &why));
        CHECK(plan.stage_x);
        CHECK(plan.row_chunk >= 1);
        CHECK(plan.row_chunk <= rows);
        CHECK((plan.row_chunk == rows || plan.row_chunk < 64 || plan.row_chunk % 64 == 0));
        CHECK(plan.x_bytes + plan.partial_bytes <= scratch);
        CHECK(plan.x_bytes >= uint64_t(plan.row_chunk) * quant_staged_row_bytes(l, kernel));
        if (plan.splits > 1) CHECK(plan.row_chunk <= 64);
      }
  // dequantize + cuBLAS: whole 64-row tiles of weights per pass
  REQUIRE(plan_quant_gemm(l, QuantKernel::dequant_cublas, 2048, false, 2, 32 * MiB, 396, &plan, &why));
  CHECK(plan.n_chunk == 1024);  // 1024 x 4096 x 2 = 8 MiB fits
  REQUIRE(plan_quant_gemm(l, QuantKernel::dequant_cublas, 2048, false, 4, 3 * MiB, 396, &plan, &why));
  CHECK(plan.n_chunk == 192);  // 3 MiB / (64 x 4096 x 4 = 1 MiB) = 3 tiles
  CHECK(plan.weight_bytes <= 3 * MiB);
  CHECK_FALSE(plan_quant_gemm(l, QuantKernel::dequant_cublas, 1, false, 4, 512 * KiB, 396, &plan, &why));
  CHECK(why.find("scratch") != std::string::npos);
}

TEST_CASE("split ranges cover the stages once, in order") {
  for (int64_t stages : {1, 2, 7, 32, 112})
    for (int64_t splits = 1; splits <= std::min<int64_t>(stages, 40); splits++) {
      int64_t next = 0;
      for (int64_t s = 0; s < splits; s++) {
        int64_t begin, end;
        quant_split_range(stages, splits, s, &begin, &end);
        CHECK(begin == next);
        CHECK(end >= begin);
        next = end;
      }
      CHECK(next == stages);
    }
}

TEST_CASE("scale_product: a T-pair multiply only where the checkpoint's scales are T, else fp32 and one rounding") {
  for (DType activation : {DType::BF16, DType::F16}) {
    const DType other = activation == DType::BF16 ? DType::F16 : DType::BF16;
    for (DequantRounding rounding : {DequantRounding::scale_dtype, DequantRounding::f32}) {
      CHECK(scale_product(activation, rounding, activation) == ScaleProduct::pair_multiply);
      CHECK(scale_product(DType::F32, rounding, activation) == ScaleProduct::fp32);
    }
    CHECK(scale_product(other, DequantRounding::scale_dtype, activation) == ScaleProduct::fp32_then_scale_dtype);
    CHECK(scale_product(other, DequantRounding::f32, activation) == ScaleProduct::fp32);
  }
  // The scale rounded to T before the multiply (the kernels' old way) is two roundings: for this F32 scale and q the
  // product lands a whole bf16 step away from the reference's one rounding, which scale_product_fp32 keeps.
  const float q = 7.0f, scale = 1.0f + 3.0f / 512;  // exact in F32, between bf16 values (steps of 1/128)
  const float one_rounding = round_to_dtype(scale_product_fp32(q, scale, ScaleProduct::fp32, DType::F32), DType::BF16);
  const float two_roundings = round_to_dtype(q * round_to_dtype(scale, DType::BF16), DType::BF16);
  CHECK(one_rounding == round_to_dtype(q * scale, DType::BF16));
  CHECK(one_rounding != two_roundings);
}

// AWQ / GPTQ (tests/fixtures/quant_formats): repacked at load into the compressed-tensors view, they upload through
// the same repack as every int4 weight; each is emulated lane by lane against dequantize_rows, the planner's bytes
// from the descriptor equal the upload's, and q|k|v / gate|up fuse as the descriptors say.
TEST_CASE("AWQ / GPTQ fixtures: the repacked views run through the emulated kernels and plan exactly") {
  for (const char* name : {"awq-g32-zp-skip", "awq-g128-zp", "awq-g64-nozp", "gptq-g128-sym", "gptq-g32-asym-actorder",
                           "gptq-v2-channel-asym", "gptq-v2-g64-sym-actorder"}) {
    const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant_formats/" + name;
    CAPTURE(dir);
    const ModelConfig config = load_config(dir).value();
    TensorStore store = TensorStore::open_dir(dir).value();
    const std::vector<LinearDesc> linears = describe_linears(config, &store).value();
    std::map<std::string, QuantWeight> weights;
    for (const LinearDesc& desc : linears)
      if (desc.format != WeightFormat::dense) {
        const QuantWeight weight = quant_weight(desc, store).value();
        check_weight(weight);
        CHECK(quant_device_bytes(desc) == quant_device_bytes(weight));
        CHECK(quant_gpu_layout(weight).permuted == desc.has_g_idx);
        weights.emplace(desc.name, weight);
      }
    int fused = 0;
    for (const std::vector<std::string>& names : {std::vector<std::string>{"q_proj", "k_proj", "v_proj"},
                                                  std::vector<std::string>{"gate_proj", "up_proj"}}) {
      std::vector<const LinearDesc*> descs;
      std::vector<const QuantWeight*> parts;
      for (const std::string& part : names) {
        const std::string full = "model.layers.0." + std::string(part[0] == 'g' || part[0] == 'u' ? "mlp." : "self_attn.") + part;
        for (const LinearDesc& desc : linears)
          if (desc.name == full) descs.push_back(&desc);
        parts.push_back(&weights.at(full));
      }
      // GPTQ's act-order is one order per layer input (q, k, v share it; gate, up too): the weights fuse. Their
      // descriptors refuse (the planner has not read g_idx) and count the parts apart, an upper bound.
      REQUIRE(quant_fusion_refusal(parts).empty());
      check_fused(parts);
      fused++;
      if (config.quant.schemes[0].actorder) {
        CHECK_FALSE(quant_fusion_refusal(descs).empty());
        uint64_t apart = 0;
        for (const QuantWeight* part : parts) apart += quant_device_bytes(*part);
        CHECK(apart >= quant_device_bytes(parts));
      } else {
        CHECK(quant_fusion_refusal(descs).empty());
        CHECK(quant_device_bytes(descs) == quant_device_bytes(parts));
      }
    }
    CHECK(fused == 2);
  }
}

TEST_CASE("int8 fixtures (GPTQ 8-bit, compressed-tensors INT8, GPTQModel's, llm-compressor's): every Linear through the emulated dequantize kernel equals the reference") {
  for (const char* name : {"gptq8-g32-asym-actorder", "gptq8-v2-channel-sym", "ct-w8a16", "ct-w8a8-dynamic",
                           "ct-pack8-g32-asym-actorder", "gptqmodel-gptq8-channel-asym",
                           "gptqmodel-gptq8-g32-sym-actorder", "gptqmodel-gptq8-v2-channel-asym", "llmc-w8a8",
                           "llmc-w8a8-smoothquant-gptq", "llmc-w8a16-g128", "llmc-w8a16-channel-gptq",
                           "llmc-w8a16-g32-asym"}) {
    const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant_formats/" + name;
    CAPTURE(dir);
    const ModelConfig config = load_config(dir).value();
    TensorStore store = TensorStore::open_dir(dir).value();
    const std::vector<LinearDesc> linears = describe_linears(config, &store).value();
    int checked = 0;
    for (const LinearDesc& desc : linears)
      if (desc.format == WeightFormat::int8) {
        const QuantWeight weight = quant_weight(desc, store).value();
        check_weight(weight);
        CHECK(quant_device_bytes(desc) >= quant_device_bytes(weight));  // a descriptor's g_idx counts as act-order
        if (!desc.has_g_idx) CHECK(quant_device_bytes(desc) == quant_device_bytes(weight));
        checked++;
      }
    CHECK(checked > 0);
  }
}
