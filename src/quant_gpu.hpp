// ---------------------------------------------------------------------------------------------------------
// quant_gpu: the layout the CUDA backend's quantized GEMMs read, written at load by cuda::upload_quant_weight;
// where each weight sits so that a warp's tensor-core B fragments load with 16-byte coalesced loads; the
// bit-level dequantization the kernels run; and the host-side choice of kernel, split-K and scratch use.
// The geometry and bit functions are __host__ __device__: kernels.cu runs them and
// tests/unit-quant-gpu-host.cpp checks them on the CPU against dequantize_rows.
//
// Terms: N = out_features, K = in_features; lane = 0..31 in a warp, g = lane / 4, q = lane % 4 (PTX's
// groupID / threadID_in_group). mma.m16n8k16 (bf16/f16) B fragment: b0 = B[k = 2q, 2q+1][n = g], b1 = B[k =
// 2q+8, 2q+9][n = g]; mma.m16n8k32 (e4m3): b0 = B[k = 4q .. 4q+3][n = g], b1 = B[k = 16+4q .. 19+4q][n = g].
// The lower 16 bits (byte) of a register hold the lower k.
//
// The device layout of one Linear (offsets 256-byte aligned, in this order; n_pad = N rounded up to 64,
// k_pad = K rounded up to 128; padding dequantizes to exactly 0):
//
//   tiles     [N / 64][k_pad / tile_k] tiles; a block of 64 output columns streams one contiguous run.
//             int4: k16 x n64 = 512 B: lane l's 16 bytes (at 16 l) are 4 words; word w, nibble i holds the
//                   value for n8 block j = 2w + (i%4)/2, register r = (i%4)%2, half h = i/4:
//                   column 8j + g, k = 2q + 8r + h. So ((word >> 4p) & 0x000f000f) is the pair p = i%4
//                   of a B register, low half first: one shift and one lop3 per bf16x2 / f16x2.
//                   Stored value u = q + 8 as the checkpoint stores it.
//             fp8:  k32 x n64 = 2 KB: 4 chunks of 32 lanes x 16 bytes (chunk c at 512 c, lane at 16 l);
//                   word i of lane l's chunk c is register r = i%2 of n8 block j = 2c + i/2: bytes b = 0..3
//                   hold column 8j + g, k = 16r + 4q + b (the m16n8k32 B fragment, e4m3 as stored).
//             int8: the fp8 tiles' geometry, byte for byte; a byte is q as the int8 view stores it (signed,
//                   two's complement; padding holds the zero point, so q - z = 0 there).
//   scales    [groups][n_pad]: int4 and int8 in the checkpoint's scale dtype, fp8 widened to F32 (exact). Within
//             a tile's 64 columns, position 8 g + j holds column 8 j + g: a lane's 8 scales are contiguous.
//   zeros     asymmetric int4 / int8 only: [groups][n_pad] bytes, positions as the scales: int4's zero point + 8,
//             int8's zero point as a signed byte.
//   perm      int4 / int8 act-order only: I32 [k_pad]; device column k' holds input column perm[k'] (-1: padding).
//             Columns are sorted by group at load, so a group is group_size consecutive device columns; the
//             activations are permuted the same way before the GEMM.
//   bias      F32 [n_pad] (zeros when the Linear has none).
//   counters  U32 [N / 64]: split-K arrival counters, zero at rest (the last block of a column tile resets
//             its counter), so split-K needs no memset per call.
//
// Groups: int4 group strategy: group_size columns; int4 channel and fp8 tensor/channel: one group of all
// k_pad columns; fp8 block: block_k columns (the scale table repeats a block's scale on its block_n rows).
// The tensor-core kernels need every tile_k run of columns inside one group (`mma`): int4 group_size % 16,
// fp8 block_k % 32; other layouts run through dequantize + cuBLAS only. int8 (GPTQ 8-bit, compressed-tensors
// INT8) has no tensor-core kernel yet: it stays 1 byte a weight on the device and always runs through dequantize
// + cuBLAS, a chunk of output columns at a time (W8A8's int8 activations are not emulated: it runs as W8A16).
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {
namespace cuda {

constexpr int64_t kQuantTileN = 64;    // output columns of a tile (and of a GEMM thread block)
constexpr int64_t kQuantStageK = 128;  // input columns of one pipeline stage (k_pad is a multiple)
constexpr int64_t kInt4TileK = 16, kInt4TileBytes = 512;
constexpr int64_t kFp8TileK = 32, kFp8TileBytes = 2048;

// The device view's base pointer (upload_quant_weight points the format's own field at the layout's start).
inline const uint8_t* quant_device_base(const QuantWeight& w) {
  return w.format == WeightFormat::int4 ? w.packed : w.format == WeightFormat::int8 ? w.int8 : w.fp8;
}

// The device layout of one quantized Linear (see the top of this part). Host arithmetic only.
struct QuantGpuLayout {
  WeightFormat format = WeightFormat::int4;
  int64_t n = 0, k = 0;          // N, K
  int64_t n_pad = 0, k_pad = 0;  // multiples of kQuantTileN, kQuantStageK
  int64_t n_tiles = 0;           // n_pad / 64
  int64_t stages = 0;            // k_pad / 128
  int64_t tile_k = 0, tile_bytes = 0, tiles_per_stage = 0;
  int64_t group_size = 0;        // device columns per scale row
  int64_t groups = 0;            // scale rows (padded groups past K have scale 0)
  DType table_scale_dtype = DType::F32;  // int4: the checkpoint's scale dtype; fp8: F32
  bool mma = false;       // the tensor-core kernels can read it (every tile_k run in one group)
  bool permuted = false;  // act-order: device column k' holds input column perm[k']
  bool zeros = false;     // int4 zero points
  uint64_t tiles_offset = 0, tiles_bytes = 0;
  uint64_t scales_offset = 0, scales_bytes = 0;
  uint64_t zeros_offset = 0, zeros_bytes = 0;
  uint64_t perm_offset = 0, perm_bytes = 0;
  uint64_t bias_offset = 0, bias_bytes = 0;
  uint64_t counters_offset = 0, counters_bytes = 0;
  uint64_t total_bytes = 0;

  uint64_t tile_row_bytes() const { return uint64_t(k_pad / tile_k * tile_bytes); }  // one column tile
  // Index of (group, column n) in the scale and zero tables.
  int64_t table_index(int64_t group, int64_t n) const;
};

// The layout `weight` (a checkpoint view, or a device view from upload_quant_weight) takes on the device.
// Reads only host memory: for a checkpoint view it looks at g_idx to tell act-order (a non-monotonic g_idx)
// from plain group order; a device view carries perm exactly when it is act-order.
QuantGpuLayout quant_gpu_layout(const QuantWeight& weight);
// The same from a descriptor (describe_linears; shapes from headers or config.json), for planning before the
// tensors are read: a g_idx is counted as act-order (k_pad x 4 bytes more than a g_idx in column order takes).
QuantGpuLayout quant_gpu_layout(const LinearDesc& linear);

// Repacking, on the host, into the bytes that go to the device (upload_quant_weight copies them):
// the tiles of column tiles [first_tile, first_tile + count): count * layout.tile_row_bytes() bytes.
// bad_format when an fp8 weight holds the e4m3 NaN code (S.1111.111; quantizers saturate at +-448 and never
// write it), naming the tensor and the element.
Status repack_quant_tiles(const QuantWeight& host, const QuantGpuLayout& layout, int64_t first_tile, int64_t count,
                          uint8_t* out);
// Everything after the tiles (scales, zeros, perm, bias, counters): layout.total_bytes - layout.scales_offset
// bytes, as they sit from scales_offset on.
Status repack_quant_tables(const QuantWeight& host, const QuantGpuLayout& layout, uint8_t* out);

// ---- fused Linears (q|k|v, gate|up) -----------------------------------------------------------------------
// Quantized Linears that read one input and write adjacent column blocks of one output live on the device as one
// Linear: part i is rows [n_i, n_i + N_i) of it, n_i the earlier parts' N summed. One GEMM then streams q, k and v
// (or gate and up) in one launch instead of three (two): at decode the small ones are latency-bound (Llama-3.1-8B
// W4A16 on an H100, bench/RESULTS.md: the fused qkv shape 15.6 us at M = 1, o_proj's 4096 x 4096 alone 10.1 us).
// They fuse when one kernel instance runs them all and their tiles and tables can follow each other: the same
// format, K, checkpoint scale dtype and rounding (the kernel's ScaleProduct); int4: the same granularity and group
// size, zero points in all or none, a g_idx in none or an equal one in all (act-order permutes the input columns:
// one permutation for every part; GPTQ's comes from the layer input's statistics, which q, k and v share, as gate
// and up do); fp8: block scales of one block_k in all or none (tensor and channel scales mix: the device table holds
// a scale per column); and every part but the last a whole number of 64-column tiles. Biases need not match: the
// device bias is an F32 table, zeros for a part without one.
// "" when `parts` (two or more; a single Linear trivially) fuse, else why not, naming the parts.
std::string quant_fusion_refusal(const std::vector<const QuantWeight*>& parts);
// The same from descriptors (describe_linears), for the planner: the same answer as from the weights they
// describe, except for act-order parts, whose g_idx tensors it has not read: refused, so the planner counts them
// apart, an upper bound (as it counts any g_idx as act-order).
std::string quant_fusion_refusal(const std::vector<const LinearDesc*>& parts);
// The fused layout: one Linear of N = the parts' N summed (quant_fusion_refusal(parts) must be "").
QuantGpuLayout quant_gpu_layout(const std::vector<const QuantWeight*>& parts);
QuantGpuLayout quant_gpu_layout(const std::vector<const LinearDesc*>& parts);
// The fused layout's tiles [first_tile, first_tile + count) and tables, from each part's own repack: part i's
// column tiles are tiles n_i / 64 on, and its table columns start at column n_i in every group.
Status repack_quant_tiles(const std::vector<const QuantWeight*>& parts, const QuantGpuLayout& layout,
                          int64_t first_tile, int64_t count, uint8_t* out);
Status repack_quant_tables(const std::vector<const QuantWeight*>& parts, const QuantGpuLayout& layout, uint8_t* out);

// ---- fragment geometry --------------------------------------------------------------------------------------
// The group of column k of K: 32-bit (K_pad < 2^31, checked at upload), a shift when the group size is a power of
// two (every published checkpoint: 32, 64, 128). The GEMM's fetch computes it per 16-byte chunk of every stage,
// where a 64-bit divide by a run-time value was ~550 of a stage's 2,000 SASS instructions at M = 1.
KVLITE_HD int quant_group_shift(int64_t group_size) {  // log2(group_size), or -1 when not a power of two
  if (group_size <= 0 || (group_size & (group_size - 1)) != 0) return -1;
  int shift = 0;
  while ((int64_t(1) << shift) < group_size) shift++;
  return shift;
}
KVLITE_HD uint32_t quant_group_of(uint32_t k, uint32_t group_size, int group_shift) {
  return group_shift >= 0 ? k >> group_shift : k / group_size;
}
// Position of tile column c (0..63) in the scale / zero tables, and back: lane g's 8 columns 8j + g sit at 8g + j.
KVLITE_HD int quant_table_position(int column) { return 8 * (column % 8) + column / 8; }
KVLITE_HD int quant_table_column(int position) { return 8 * (position % 8) + position / 8; }

// int4: the n8 block and the B register (0: b0, 1: b1) that pair p (0..3) of word w of a lane feeds.
KVLITE_HD int int4_pair_block(int word, int pair) { return 2 * word + pair / 2; }
KVLITE_HD int int4_pair_register(int pair) { return pair % 2; }
// The tile column and k (0..15) of nibble `nibble` (0..7) of word `word` (0..3) of lane `lane`.
KVLITE_HD void int4_tile_slot(int lane, int word, int nibble, int* column, int* k) {
  const int pair = nibble % 4, half = nibble / 4;
  *column = 8 * int4_pair_block(word, pair) + lane / 4;
  *k = 2 * (lane % 4) + 8 * int4_pair_register(pair) + half;
}

// fp8: the n8 block and register of word `word` (0..3) of a lane's chunk `chunk` (0..3).
KVLITE_HD int fp8_word_block(int chunk, int word) { return 2 * chunk + word / 2; }
KVLITE_HD int fp8_word_register(int word) { return word % 2; }
// The tile column and k (0..31) of byte `byte` of that word.
KVLITE_HD void fp8_tile_slot(int lane, int chunk, int word, int byte, int* column, int* k) {
  *column = 8 * fp8_word_block(chunk, word) + lane / 4;
  *k = 16 * fp8_word_register(word) + 4 * (lane % 4) + byte;
}
// W8A16 runs a k32 fp8 tile as two m16n8k16 steps (half r = register r's 16 columns). In step r a lane's B
// registers are the e4m3 bytes of register r, reordered (fp8_pair_order) and decoded: b0 <- k 16r + 4q + {0, 1},
// b1 <- k 16r + 4q + {2, 3}. Its A registers must hold the same columns, so it loads 8 bytes of bf16/f16 from
// column 16r + 4q of rows g and g + 8: a0/a1 = the first two values, a2/a3 = the next two. (The m16n8k16 slots
// 2q, 2q+1 / 2q+8, 2q+9 then hold matching columns of A and B, which is all a dot product needs.)
KVLITE_HD int w8a16_a_column(int lane, int half, int slot_register /*0: a0/a1, 1: a2/a3*/, int element) {
  return 16 * half + 4 * (lane % 4) + 2 * slot_register + element;
}

// W8A8 applies scales to the mma accumulators, whose lane holds columns 8j + 2q + e (e = 0, 1) of block j:
// their weight scales sit at these table positions.
KVLITE_HD int w8a8_scale_position(int lane, int block, int e) {
  return quant_table_position(8 * block + 2 * (lane % 4) + e);
}

// ---- dequantization bits ----------------------------------------------------------------------------------
// int4 -> bf16/f16 with the magic-number trick: OR-ing a nibble u into the mantissa of 128.0 (bf16 0x4300) or
// 1024.0 (f16 0x6400) gives exactly magic + u; subtracting magic + zero (exact: integers below 2^8 / 2^11) gives
// u - zero = q - z exactly; one multiply by the scale then rounds once, as the reference does.
constexpr uint32_t kInt4MagicBf16 = 0x4300u, kInt4MagicF16 = 0x6400u;
KVLITE_HD uint32_t int4_magic(bool bf16) { return bf16 ? kInt4MagicBf16 : kInt4MagicF16; }
// lop3.b32's truth table: bit (a_i b_i c_i) of `lut` is result bit i, with a = 0xf0, b = 0xcc, c = 0xaa spelling
// the table (PTX ISA); so (a & b) | c is (0xf0 & 0xcc) | 0xaa = 0xea. The host's lop3, for checking a table.
constexpr uint32_t kLop3AndOr = (0xf0u & 0xccu) | 0xaau;
KVLITE_HD uint32_t lop3_reference(uint32_t a, uint32_t b, uint32_t c, uint32_t lut) {
  uint32_t result = 0;
  for (int i = 0; i < 32; i++) {
    const uint32_t index = (((a >> i) & 1u) << 2) | (((b >> i) & 1u) << 1) | ((c >> i) & 1u);
    result |= ((lut >> index) & 1u) << i;
  }
  return result;
}
constexpr uint32_t kInt4PairMask = 0x000f000fu;  // nibble p of each 16-bit half, once shifted down by 4 p
// Pair p (0..3) of a device word as two 16-bit values magic + u: low half nibble p, high half nibble p + 4.
KVLITE_HD uint32_t int4_pair_bits(uint32_t word, int pair, uint32_t magic) {
#if defined(__CUDA_ARCH__)
  // One LOP3 ((a & b) | c: kLop3AndOr) with the mask as its immediate and the magic word in a register: written as
  // C++, ptxas emits an AND and an OR (a LOP3 takes one immediate), 16 extra instructions a W4A16 tile
  // (cuobjdump of quant_gemv_mma_kernel, H100, 2026-11-27). The CPU checks the table (unit-quant-gpu-host).
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, %4;"
      : "=r"(bits)
      : "r"(word >> (4 * pair)), "n"(kInt4PairMask), "r"(magic | (magic << 16)), "n"(kLop3AndOr));
  return bits;
#else
  return ((word >> (4 * pair)) & kInt4PairMask) | (magic | (magic << 16));
#endif
}
// The 16-bit value magic + zero (zero = the stored zero point, 0..15; 8 when symmetric).
KVLITE_HD uint32_t int4_subtrahend_bits(uint32_t zero_nibble, uint32_t magic) { return magic | (zero_nibble & 0xfu); }

// e4m3 -> bf16/f16 by moving bits: sign to bit 15, exponent and mantissa (7 bits) to the top of the 16-bit
// format's exponent/mantissa. The result is q * 2^-fix (fix = 120 for bf16: biases 127 - 7; 8 for f16: 15 - 7),
// subnormal e4m3 included (they land on subnormals, which bf16/f16 multiplies keep), so a scale pre-multiplied
// by 2^fix restores q * s with the product's one rounding. The NaN codes would decode to +-480: the repack
// refuses them.
KVLITE_HD int fp8_exponent_fix(bool bf16) { return bf16 ? 120 : 8; }
// Bytes [b0 b1 b2 b3] -> [b0 b2 b1 b3] (prmt): then bytes 0, 2 hold k 0, 1 and bytes 1, 3 hold k 2, 3.
KVLITE_HD uint32_t fp8_pair_order(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(word, 0u, 0x3120u);
#else
  return (word & 0xff0000ffu) | ((word >> 8) & 0x0000ff00u) | ((word << 8) & 0x00ff0000u);
#endif
}
// Pair p of an ordered word as two 16-bit values (low half the lower k): p = 0 from bytes 0 and 2, p = 1 from
// bytes 1 and 3.
KVLITE_HD uint32_t fp8_pair_bits(uint32_t ordered, int pair, bool bf16) {
  const uint32_t v = pair == 0 ? ordered << 8 : ordered;  // the pair's bytes at bits 8..15 and 24..31
  const int shift = bf16 ? 4 : 1;                         // exponent+mantissa from bits 8..14 to 4..10 / 7..13
  return (v & 0x80008000u) | ((v & 0x7f007f00u) >> shift);
}
// A scale for fp8_pair_bits' values: s * 2^fix, exact while it stays finite (|s| < 2^8 for bf16, < 2^7.99 for
// f16; weight scales are ~1e-3).
KVLITE_HD float fp8_folded_scale(float scale, bool bf16) {
  return scale * bits_to_float(uint32_t(127 + fp8_exponent_fix(bf16)) << 23);  // * 2^fix, exact
}

// How the A16 kernels (mma and GEMVs) multiply a dequantized pair by its scale, so that each weight they feed the
// tensor cores is the reference's weight (dequantize_rows) rounded once to the compute dtype T:
//   pair_multiply   the scale is a T pair and one bf16x2 / f16x2 multiply rounds the exact q x s once: right when
//                   the checkpoint's scale dtype is T (the scale is then exact in T; both roundings, the
//                   reference's and T's, are that one). The common case, and one instruction a pair.
//   fp32            the scale stays a float: q x s in fp32 (the reference's own float product, bit for bit), then
//                   rounded once to T. F32 scales, and transformers' weight_scale_inv (DequantRounding::f32).
//   fp32_then_scale_dtype
//                   as fp32, then rounded to the checkpoint's 16-bit scale dtype (the reference's rounding, the
//                   other one of bf16 / f16) before T: a BF16-scaled checkpoint run with F16 activations or back.
// The CUDA backend takes scale_product's choice under CudaBackendOptions::fp32_scale_products, else pair_multiply
// for every weight, which for other scale dtypes rounds the scale to T first: two roundings (up to 2 steps of T
// off), but one instruction a pair where the fp32 product costs about six (3x slower decode for FP8 F32 scales).
enum class ScaleProduct : uint8_t { pair_multiply, fp32, fp32_then_scale_dtype };
// checkpoint_scale: the checkpoint's scale dtype (QuantWeight::scale_dtype, not the device table's); activation:
// T (BF16 or F16).
KVLITE_HD ScaleProduct scale_product(DType checkpoint_scale, DequantRounding rounding, DType activation) {
  if (checkpoint_scale == activation) return ScaleProduct::pair_multiply;
  if (checkpoint_scale != DType::F32 && rounding == DequantRounding::scale_dtype)
    return ScaleProduct::fp32_then_scale_dtype;
  return ScaleProduct::fp32;
}
// The float a kernel rounds to T under fp32 / fp32_then_scale_dtype: value (q, or q 2^-fix for fp8) times scale
// (s, or the folded s 2^fix), rounded as fp32 multiplies round, then to scale_dtype for fp32_then_scale_dtype.
KVLITE_HD float scale_product_fp32(float value, float scale, ScaleProduct mode, DType scale_dtype) {
  const float product = value * scale;
  return mode == ScaleProduct::fp32_then_scale_dtype ? round_to_dtype(product, scale_dtype) : product;
}

// ---- which kernel, how split, how much scratch (host) -------------------------------------------------------
// The quantized GEMMs of the CUDA backend:
//   mma_a16          int4 W4A16 / fp8 W8A16: weights dequantized in registers, bf16/f16 mma.m16n8k16
//   mma_w8a8         fp8 W8A8 (sm_89+): activations quantized per token (per block_k group for block weights),
//                    e4m3 mma.m16n8k32, scales applied to each tile's fp32 partial product
//   dequant_cublas   weights dequantized to the activation dtype into scratch (tiled over N), then cuBLAS
//   gemv_a16         int4 / fp8 weights with bf16/f16 activations, a few rows (decode): the tiles streamed from
//                    device memory into registers, dequantized as mma_a16 does, fp32 FMAs (no tensor cores)
//   gemv_mma         gemv_a16's streamed loads with mma_a16's tensor-core math straight from registers (no shared
//                    memory staging): up to 16 rows for the price of one
enum class QuantKernel : uint8_t { automatic, mma_a16, mma_w8a8, dequant_cublas, gemv_a16, gemv_mma };
const char* quant_kernel_name(QuantKernel kernel);

// Activation rows up to which mma_a16 runs; more rows go through dequantize + cuBLAS, whose dequantization
// then costs less than the tensor-core time it saves. A first guess: bench/quant_gemm.cu times both at
// M = 512 and 2048 on each GPU.
constexpr int64_t kQuantMmaMaxRows = 256;
// Activation rows up to which gemv_a16 runs (one launch computes this many rows; more rows forced onto it run in
// passes). At M = 1 the mma kernels spend a 16-row tensor-core step on one row and stage every byte through
// shared memory (18-30% of copy bandwidth for W4A16 on an H100, bench/RESULTS.md); the GEMV's fp32 FMAs cost
// 16 M per 16 bytes of int4 weights, past the FMA rate near M = 8, so it stops at 4.
constexpr int64_t kQuantGemvMaxRows = 4;
// Rows one gemv_mma launch computes: the 16 rows of an mma.m16n8k16 A fragment (rows g and g + 8 of each lane).
constexpr int64_t kQuantGemvMmaMaxRows = 16;
// The automatic choice at decode rows, measured on an H100 (bench/RESULTS.md, 2026-11-26, third session):
//   int4, M = 1 .. 16: gemv_mma, flat from 1 to 8 rows (bench-quant_gemm, Llama-3.1-8B's gate_up: 46-47 us at M =
//          1, 2, 4, 8; gemv_a16 51, 68, 99 us at M = 1, 2, 4; mma_a16 90 us). At M = 1 the two GEMVs trade places
//          by shape (gemv_mma holds 98 registers, 2 blocks an SM against gemv_a16's 3), and end to end Llama-3.1-8B
//          W4A16 decodes at 177.7 tok/s with gemv_mma against 167.0 with gemv_a16.
//   fp8, M = 1 .. 16: gemv_mma since its tiles stream in batches through registers (gemv_mma_run; bench/RESULTS.md,
//          2026-11-27 third session, H200): 21-36% less time than gemv_a16 at M = 1 (Llama-3.1-8B gate_up 51.0 -> 35.9
//          us, lm_head 173 -> 137) and 25-46% less than mma_a16 at M = 8 and 16 (gate_up M = 8 64.2 -> 37.6 us), every
//          Llama-3.1-8B and Qwen3-VL-4B shape. (Before it, gemv_a16 held M = 1 and the mma kernels M >= 2.)
//          gemv_a16 stays a forced choice (set_quant_kernel), for the tests and the bench.
constexpr int64_t quant_gemv_auto_rows(WeightFormat) { return 0; }
constexpr int64_t quant_gemv_mma_auto_rows(WeightFormat) { return 16; }
// The GEMV splits K as the mma kernel does: enough splits to fill the GPU's block slots once (SMs x blocks an SM
// holds). Aiming for 4 waves of shorter blocks instead was measured slower on an H100 (Llama qkv at M = 1 12.5 ->
// 20.9 us, down 28.3 -> 35.1, gate_up 51.9 -> 53.7): more splits cost more partials and fix-ups than the tail
// they remove.
// Stages each split-K partition gets at least: more splits fill more SMs at M = 1, but each split pays the
// block's epilogue (the warps' sum, a partial written and read back). A first guess, for bench/quant_gemm.cu to
// settle.
constexpr int64_t kQuantMinSplitStages = 2;
// W8A8 runs on compute capability 8.9 and newer (the e4m3 mma); older GPUs run fp8 weights as W8A16.
constexpr int kQuantW8A8MinSm = 89;
// Whether the automatic choice runs fp8 weights as W8A8 on compute capability `sm`: where mma.m16n8k32.e4m3 is
// native, sm_89 (RTX 40, the 8 GB cards' Ada) and sm_100 on (sm_120: RTX 50). Hopper (sm_90) has e4m3 only in
// wgmma: ptxas lowers the warp-level e4m3 mma to 12 F2FP.F16.E4M3.UNPACK_B + 2 HMMA per instruction, so there
// fp8 weights run as W8A16 (mma_w8a8 can still be forced, for the bench). Measured on an H100 at M = 1 (bench/
// RESULTS.md) the two are close: a Llama-3.1-8B layer's four GEMMs 127 us W8A16 vs 137 us W8A8, a Qwen3-VL-4B
// layer's 84 vs 75 us; the W8A16 kernel, not the choice, is what a faster Hopper path needs.
constexpr bool quant_w8a8_preferred(int sm) { return sm >= kQuantW8A8MinSm && sm / 10 != 9; }

// The kernel `forced` or, when automatic, the one for `rows` rows on a GPU of compute capability `sm` with
// activations of dtype `activation`: gemv_a16 up to quant_gemv_auto_rows rows (none now), gemv_mma up to
// quant_gemv_mma_auto_rows rows (16), then W8A8 for fp8 where it is native, else mma_a16 up to kQuantMmaMaxRows
// rows, then dequantize + cuBLAS. F32 activations always dequantize
// (exact weights, float32 cuBLAS).
QuantKernel choose_quant_kernel(const QuantGpuLayout& layout, DType activation, int sm, int64_t rows,
                                QuantKernel forced);
// Why `kernel` cannot run `layout` here ("" when it can).
std::string quant_kernel_refusal(const QuantGpuLayout& layout, QuantKernel kernel, DType activation, int sm);

// The rows a gemv_a16 launch is compiled for: 1, 2 or 4 (the smallest that holds `rows`, at most 4).
KVLITE_HD int quant_gemv_rows(int64_t rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : 4; }

// The 16-row mma tiles a GEMM block takes for `rows` rows: 1, 2 or 4 (up to 64 rows per block).
KVLITE_HD int quant_m_tiles(int64_t rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }

// How one quant_linear call runs: passes of row_chunk rows (all of them unless the scratch cannot hold the
// staged activations); a pass launches m_blocks x n_tiles x splits GEMM blocks, or dequantizes n_chunk output
// columns at a time for cuBLAS.
struct QuantGemmPlan {
  QuantKernel kernel = QuantKernel::dequant_cublas;
  int64_t row_chunk = 0;      // gemv_a16: at most kQuantGemvMaxRows; gemv_mma: kQuantGemvMmaMaxRows
  int64_t splits = 1;         // split-K partitions of the stages (only when one block row, m_blocks == 1)
  int64_t n_chunk = 0;        // dequant_cublas: output columns per pass (a multiple of 64)
  bool stage_x = false;       // mma_a16: activations copied into scratch first (act-order, or unaligned)
  uint64_t x_bytes = 0;       // scratch for the staged / quantized activations of one pass
  uint64_t partial_bytes = 0; // scratch for split-K partials
  uint64_t weight_bytes = 0;  // dequant_cublas: scratch for one chunk of dequantized weights
};
// Per-row scratch bytes of staged activations: mma_a16 k_pad bf16/f16; mma_w8a8 k_pad e4m3 + its scales.
uint64_t quant_staged_row_bytes(const QuantGpuLayout& layout, QuantKernel kernel);
// Plans `rows` rows through `kernel`: target_blocks = blocks resident on the whole GPU at once (SMs x blocks
// per SM of the kernel); act_bytes = 2 or 4. false with *why set when scratch_bytes cannot hold even one
// 64-column chunk / one row.
bool plan_quant_gemm(const QuantGpuLayout& layout, QuantKernel kernel, int64_t rows, bool stage_x, int act_bytes,
                     uint64_t scratch_bytes, int64_t target_blocks, QuantGemmPlan* plan, std::string* why);
// Stages [*begin, *end) of split `split` of `splits` over `stages` (as even as integers allow).
KVLITE_HD void quant_split_range(int64_t stages, int64_t splits, int64_t split, int64_t* begin, int64_t* end) {
  *begin = stages * split / splits;
  *end = stages * (split + 1) / splits;
}

}  // namespace cuda
}  // namespace kvlite
