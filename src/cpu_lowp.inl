// cpu_lowp: the CPU's low-precision-activation Linear kernels (CpuKernels::fast_lowp), llama.cpp's numerics.
//
// CpuKernels::fast keeps the reference's numbers (f32 activations, the reference's dequantized weights; only
// the summation order differs). That leaves the integer and bf16 dot-product instructions unused, and they are
// what makes llama.cpp's Q4_0 / Q8_0 / BF16 CPU paths fast: it quantizes each Linear's input first (Q8_0: int8
// in blocks of 32 with one scale each; BF16 weights: the input rounded to bf16) and multiplies integers (VNNI
// vpdpbusd: 64 byte products a cycle) or bf16 pairs (vdpbf16ps). fast_lowp does the same:
//
//   int4 (groups in order, a multiple of 128) and int8 (groups in order, a multiple of 128; not W8A8) weights:
//     each token's row is quantized per 32 columns, d = max|x| / 127, q = round_even(x / d) in [-127, 127]
//     (quantize_q8_row), and
//       out[n] = sum_b s(n, b) d_b sum_{k in b} w_q(n, k) q_k  -  sum_g s(n, g) z(n, g) sum_{b in g} d_b sum q
//     where w_q is the stored code (int4: u in 0..15 and z = 8 + zero point; int8: the signed byte and its
//     zero point). The integer sums are exact; the float scaling is unrounded (the reference rounds
//     (u - 8 - z) s to the scale's dtype first).
//   BF16 weights: the row rounded to bf16 (float_to_bf16), then each product exact and summed in f32 (AVX-512
//     BF16's vdpbf16ps where the CPU has it, else the fast f32 kernels over the rounded values).
//   Everything else (F16 / F32 weights, fp8, act-order, W8A8, odd K) runs CpuKernels::fast's kernels.
//
// The error this adds is the activation rounding: at most half a step of 1/127 of the block's max|x| a column
// (int8), or 2^-9 relative (bf16); tests/unit-cpu-lowp.cpp checks each kernel against the formula above in
// double (every ISA) and against the reference within that rounding's bound.
//
// Layout of a quantized row (Q8Rows): for int4 weights each 128 columns are stored as their 64 even columns,
// then their 64 odd ones, because a packed int4 byte holds columns 2j (low nibble) and 2j + 1 (high): the low
// and high nibbles of 64 bytes then meet their activations without a shuffle. int8 weights: natural order.
// lane_scales holds, for every 64-byte vector of q, the 16 floats d of the block each int32 lane's bytes come
// from (int4: lane i of a 128-column chunk covers columns 8i..8i+7 of it, block i / 4; int8: lane i of 64
// columns covers 4i..4i+3, block i / 8), so a lane's integer sum is scaled by one multiply.
// AArch64: the integer kernels use sdot (ARMv8.2's dot-product extension: Cortex-A55/A76/A78 and later, Jetson
// Orin, Graviton 2+; not Cortex-A57/A72), found at run time (HWCAP_ASIMDDP); GCC compiles them with a target
// attribute, so the build needs no -march. Clang takes them only where the build targets dotprod already.
#if KVLITE_CPU_NEON && ((defined(__GNUC__) && !defined(__clang__)) || defined(__ARM_FEATURE_DOTPROD))
#define KVLITE_CPU_NEON_DOT 1
#if defined(__ARM_FEATURE_DOTPROD)
#define KVLITE_TARGET_NEON_DOT
#else
#define KVLITE_TARGET_NEON_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#else
#define KVLITE_CPU_NEON_DOT 0
#endif
#if KVLITE_CPU_X86_SIMD
#define KVLITE_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define KVLITE_TARGET_BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#endif

namespace kvlite {
namespace detail {
namespace cpu_lowp {

constexpr int64_t kBlock = 32;   // columns per activation scale
constexpr int64_t kChunk = 128;  // columns of an int4 chunk (64 packed bytes); group sizes are multiples of it

// The instruction-set extras the lowp kernels use beyond CpuIsa::avx512 (checked at run time).
inline bool cpu_has_vnni() {
#if KVLITE_CPU_X86_SIMD
  __builtin_cpu_init();
  return cpu_isa_supported(CpuIsa::avx512) && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}
inline bool cpu_has_neon_dot() {
#if KVLITE_CPU_NEON_DOT && defined(__ARM_FEATURE_DOTPROD)
  return true;
#elif KVLITE_CPU_NEON_DOT && defined(__linux__)
  return (getauxval(AT_HWCAP) & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
#else
  return false;
#endif
}
inline bool cpu_has_bf16_dot() {
#if KVLITE_CPU_X86_SIMD
  __builtin_cpu_init();
  return cpu_isa_supported(CpuIsa::avx512) && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// How many BF16 rows a one-token GEMV streams side by side (bf16_dot_linear_rows). A decode step's GEMV is a read
// of the weight from memory; how fast one core reads it depends on how many misses the prefetchers keep in
// flight. Intel's (measured on a Sapphire Rapids guest) read 20-60% more with 8 rows' streams interleaved than
// with one; Zen 4's read twice as fast with one row as with four interleaved (bench/RESULTS.md, fifteenth and
// twenty-first sessions). Resolved once, when the backend starts.
constexpr int kBf16StreamRowsInterleaved = 8;
inline bool cpu_is_intel() {
#if KVLITE_CPU_X86_SIMD
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}
inline int bf16_stream_rows_for_cpu() { return cpu_is_intel() ? kBf16StreamRowsInterleaved : 1; }

// Which weights the integer kernels take: the checkpoint's layout, groups in order that are whole chunks.
inline bool int4_covered(const QuantWeight& w) {
  return w.format == WeightFormat::int4 && w.layout == QuantLayout::checkpoint && w.packed && w.scales &&
         !w.g_idx && w.in_features % kChunk == 0 && w.group_size >= kChunk && w.group_size % kChunk == 0 &&
         w.scale_cols == w.in_features / w.group_size;
}
inline bool int8_covered(const QuantWeight& w) {
  return w.format == WeightFormat::int8 && w.layout == QuantLayout::checkpoint && w.int8 && w.scales &&
         !w.g_idx && !w.int8_activations && w.in_features % kChunk == 0 && w.group_size >= kChunk &&
         w.group_size % kChunk == 0 && w.scale_cols == w.in_features / w.group_size;
}

// Floats of scratch one token's quantized row takes (q bytes, lane scales, group sums), for K columns.
inline int64_t q8_row_floats(int64_t K) { return K / 4 + K / 4 + K / kChunk + 16; }

// Rows of quantized activations: token t's q at q + t * stride_floats floats, its lane scales and group sums after.
struct Q8Rows {
  float* base = nullptr;
  int64_t K = 0, stride = 0;  // floats between tokens
  const int8_t* q(int64_t t) const { return reinterpret_cast<const int8_t*>(base + t * stride); }
  int8_t* q(int64_t t) { return reinterpret_cast<int8_t*>(base + t * stride); }
  const float* lane_scales(int64_t t) const { return base + t * stride + K / 4; }
  float* lane_scales(int64_t t) { return base + t * stride + K / 4; }
  // sum_{b in group g} d_b * sum_{k in b} q_k (the zero points' term), per group of the weight
  const float* group_sums(int64_t t) const { return base + t * stride + K / 2; }
  float* group_sums(int64_t t) { return base + t * stride + K / 2; }
};

// Position of column k in the int4 layout (even columns of each 128 first).
inline int64_t int4_position(int64_t k) { return (k / kChunk) * kChunk + (k % 2) * 64 + (k % kChunk) / 2; }

}  // namespace cpu_lowp

// Declared in backend.hpp (the tests' view of it): x[0, K) per 32 columns into q [K], lane_scales and
// group_sums, as Q8Rows lays out one token.
void quantize_q8_activations(const float* x, int64_t K, bool int4_layout, int64_t group, int8_t* q, float* lanes,
                             float* sums) {
  using cpu_lowp::kBlock;
  for (int64_t g = 0; g < K / group; g++) sums[g] = 0.0f;
  for (int64_t b = 0; b < K / kBlock; b++) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; i++) {
      const float a = std::fabs(xb[i]);
      amax = a > amax ? a : amax;  // NaN never wins
    }
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t qsum = 0;
    for (int64_t i = 0; i < kBlock; i++) {
      float v = xb[i] * inverse;
      v = v > -127.0f ? v : -127.0f;  // NaN -> -127: finite either way
      v = v < 127.0f ? v : 127.0f;
      const int32_t code = int32_t(std::nearbyint(v));
      qsum += code;
      const int64_t k = b * kBlock + i;
      q[int4_layout ? cpu_lowp::int4_position(k) : k] = int8_t(code);
    }
    sums[b * kBlock / group] += d * float(qsum);
    if (int4_layout) {
      const int64_t chunk = b / 4, first = (b % 4) * 4;  // lanes 4 (b % 4) .. + 3 of its chunk's 16
      for (int64_t i = 0; i < 4; i++) lanes[chunk * 16 + first + i] = d;
    } else {
      const int64_t vec = b / 2, first = (b % 2) * 8;  // lanes 8 (b % 2) .. + 7 of its 64 columns' 16
      for (int64_t i = 0; i < 8; i++) lanes[vec * 16 + first + i] = d;
    }
  }
}

namespace cpu_lowp {
// Quantizes x[0, K) into token t of `rows` (K % 128 == 0; group: the weight's group size, a multiple of 128).
// Plain C++: it reads K floats where the kernel reads N K weights.
inline void quantize_q8_row(const float* x, bool int4_layout, int64_t group, Q8Rows& rows, int64_t t) {
  quantize_q8_activations(x, rows.K, int4_layout, group, rows.q(t), rows.lane_scales(t), rows.group_sums(t));
}

inline float int4_offset(const QuantWeight& w, int64_t n, int64_t g) {  // 8 + zero: the code of weight 0
  return float(8 + (w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0));
}
inline float int8_offset(const QuantWeight& w, int64_t n, int64_t g) {
  return w.zero_points ? float(reinterpret_cast<const int8_t*>(w.zero_points)[n * w.scale_cols + g]) : 0.0f;
}
inline float weight_scale(const QuantWeight& w, int64_t n, int64_t g) {
  return scale_at(w.scales, w.scale_dtype, n * w.scale_cols + g);
}
// A row block's scales as floats, and its codes' offsets where they vary (zero points), made once per block
// before its tiles (block_tables): the kernels' inner loops then read one float a group, and add the offsets'
// term s(n, g) offset(n, g) group_sums_t[g] once a group, instead of converting a scale and unpacking a zero
// point there.
struct BlockTables {
  const float* scales = nullptr;   // [rows][groups]: s(n0 + r, g)
  const float* offsets = nullptr;  // [rows][groups], or nullptr: every code's offset is `offset`
  float offset = 0.0f;             // int4 without zero points: 8; int8 without: 0 (no term at all)
  int64_t n0 = 0, groups = 0;
  const float* scale_row(int64_t n) const { return scales + (n - n0) * groups; }
  const float* offset_row(int64_t n) const { return offsets ? offsets + (n - n0) * groups : nullptr; }
  bool any_offset() const { return offsets != nullptr || offset != 0.0f; }
};
// Floats of scratch block_tables needs for `rows` rows.
inline int64_t block_table_floats(const QuantWeight& w, int64_t rows) { return 2 * rows * w.scale_cols; }
template <bool INT4>
BlockTables block_tables(const QuantWeight& w, int64_t n0, int64_t n1, float* scratch) {
  BlockTables bt;
  bt.n0 = n0, bt.groups = w.scale_cols;
  const int64_t count = (n1 - n0) * bt.groups, first = n0 * bt.groups;  // rows n0.. are one run of scales
  float* scales = scratch;
  for (int64_t i = 0; i < count; i++) scales[i] = scale_at(w.scales, w.scale_dtype, first + i);
  bt.scales = scales;
  if (w.zero_points) {
    float* offsets = scratch + count;
    for (int64_t r = 0; r < n1 - n0; r++)
      for (int64_t g = 0; g < bt.groups; g++)
        offsets[r * bt.groups + g] = INT4 ? int4_offset(w, n0 + r, g) : int8_offset(w, n0 + r, g);
    bt.offsets = offsets;
  } else {
    bt.offset = INT4 ? 8.0f : 0.0f;
  }
  return bt;
}
// The offsets' term of row n's group g for the tile's tokens, added to corr (scale: s(n, g)).
template <int TT>
inline void add_offsets(const BlockTables& bt, const float* offset_row, int64_t g, float scale,
                        const float* const (&group_sums)[TT], float (&corr)[TT]) {
  if (!bt.any_offset()) return;
  const float so = scale * (offset_row ? offset_row[g] : bt.offset);
  for (int tt = 0; tt < TT; tt++) corr[tt] += so * group_sums[tt][g];
}

// ---- portable C++: the 16 lanes of the SIMD kernels, in plain loops ------------------------------------------
template <int TT, int R>
void int4_tile_portable(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1, float* out,
                        int64_t os, const BlockTables& bt) {
  const int64_t per_group = w.group_size / kChunk;
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) group_sums[tt] = a.group_sums(t + tt);
  for (int64_t n = n0; n < n1; n += R) {
    float acc[TT][R][16] = {};
    float corr[R][TT] = {};
    for (int64_t g = 0; g < w.scale_cols; g++)
      for (int r = 0; r < R; r++) {
        const float s = bt.scale_row(n + r)[g];
        add_offsets<TT>(bt, bt.offset_row(n + r), g, s, group_sums, corr[r]);
        for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
          const uint8_t* packed = w.packed + 4 * ((n + r) * w.packed_cols + c * 16);
          for (int tt = 0; tt < TT; tt++) {
            const int8_t* q = a.q(t + tt) + c * kChunk;
            const float* lanes = a.lane_scales(t + tt) + c * 16;
            for (int lane = 0; lane < 16; lane++) {
              int32_t sum = 0;
              for (int j = 4 * lane; j < 4 * lane + 4; j++) {  // byte j: columns 2j (low nibble) and 2j + 1
                const uint32_t word = load_u32_le(packed + 4 * (j / 4));
                const int32_t byte = int32_t((word >> (8 * (j % 4))) & 0xffu);
                sum += (byte & 0xf) * q[j] + (byte >> 4) * q[64 + j];
              }
              acc[tt][r][lane] += float(sum) * (lanes[lane] * s);
            }
          }
        }
      }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) {
        float sum = 0.0f;
        for (int lane = 0; lane < 16; lane++) sum += acc[tt][r][lane];
        out[tt * os + n + r] = sum - corr[r][tt];
      }
  }
}

template <int TT, int R>
void int8_tile_portable(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1, float* out,
                        int64_t os, const BlockTables& bt) {
  const int64_t per_group = w.group_size / 64;
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) group_sums[tt] = a.group_sums(t + tt);
  for (int64_t n = n0; n < n1; n += R) {
    float acc[TT][R][16] = {};
    float corr[R][TT] = {};
    for (int64_t g = 0; g < w.scale_cols; g++)
      for (int r = 0; r < R; r++) {
        const float s = bt.scale_row(n + r)[g];
        add_offsets<TT>(bt, bt.offset_row(n + r), g, s, group_sums, corr[r]);
        for (int64_t v = g * per_group; v < (g + 1) * per_group; v++) {
          const int8_t* wq = reinterpret_cast<const int8_t*>(w.int8) + (n + r) * w.in_features + v * 64;
          for (int tt = 0; tt < TT; tt++) {
            const int8_t* q = a.q(t + tt) + v * 64;
            const float* lanes = a.lane_scales(t + tt) + v * 16;
            for (int lane = 0; lane < 16; lane++) {
              int32_t sum = 0;
              for (int j = 4 * lane; j < 4 * lane + 4; j++) sum += int32_t(wq[j]) * q[j];
              acc[tt][r][lane] += float(sum) * (lanes[lane] * s);
            }
          }
        }
      }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) {
        float sum = 0.0f;
        for (int lane = 0; lane < 16; lane++) sum += acc[tt][r][lane];
        out[tt * os + n + r] = sum - corr[r][tt];
      }
  }
}

// The integer kernels prefetch the weights kPrefetchBytes ahead of what they read (a decode step reads them one row
// at a time, in address order; measured on Zen 4: int4 rows 16 -> 17-18 GB/s; the bf16 stream gained nothing).
// A prefetch never faults, so past the matrix's end is fine.
constexpr int64_t kPrefetchBytes = 4096;

#if KVLITE_CPU_X86_SIMD
// ---- AVX2: vpmaddubsw (u8 x s8 -> pairs of s16) then vpmaddwd with ones (-> s32 over 4 bytes) -------------------
// int4: u <= 15 and |q| <= 127, so a pair sum (<= 3,810) and the two nibbles' sum never saturate s16.
// int8: |w| q through vpsignb (|w| <= 128 unsigned, |q| <= 127): a pair is at most 32,512.
// The SIMD kernels take every pointer out of the loops first (q, lane scales, rows, scales): with them
// recomputed from the structs inside, the int4 kernel ran at half its speed.
template <int TT, int R>
KVLITE_TARGET_AVX2 void int4_tile_avx2(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1,
                                       float* out, int64_t os, const BlockTables& bt) {
  const int64_t groups = w.scale_cols, per_group = w.group_size / kChunk, row_bytes = 4 * w.packed_cols;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* rows = w.packed + n * row_bytes;
    const float* scales = bt.scale_row(n);
    float corr[R][TT] = {};
    __m256 acc[TT][R];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) acc[tt][r] = _mm256_setzero_ps();
    for (int64_t g = 0, c = 0; g < groups; g++) {
      __m256 s[R];
      for (int r = 0; r < R; r++) {
        const float scale = scales[r * groups + g];
        s[r] = _mm256_set1_ps(scale);
        add_offsets<TT>(bt, bt.offset_row(n + r), g, scale, group_sums, corr[r]);
      }
      for (const int64_t end = c + per_group; c < end; c++)
        for (int r = 0; r < R; r++)
          for (int h = 0; h < 2; h++) {  // bytes 32 h .. + 31: lanes 8 h .. + 7 of the chunk's 16
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * row_bytes + 64 * c + 32 * h));
            const __m256i lo = _mm256_and_si256(wv, low4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
            for (int tt = 0; tt < TT; tt++) {
              const int8_t* qc = q[tt] + kChunk * c + 32 * h;
              const __m256i pairs = _mm256_add_epi16(
                  _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc))),
                  _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + 64))));
              const __m256 lane_scale = _mm256_mul_ps(_mm256_loadu_ps(lanes[tt] + 16 * c + 8 * h), s[r]);
              acc[tt][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), lane_scale, acc[tt][r]);
            }
          }
    }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) out[tt * os + n + r] = cpu_fast::hsum8(acc[tt][r]) - corr[r][tt];
  }
}

template <int TT, int R>
KVLITE_TARGET_AVX2 void int8_tile_avx2(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1,
                                       float* out, int64_t os, const BlockTables& bt) {
  const int64_t groups = w.scale_cols, per_group = w.group_size / 32, K = w.in_features;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* rows = w.int8 + n * K;
    const float* scales = bt.scale_row(n);
    float corr[R][TT] = {};
    __m256 acc[TT][R];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) acc[tt][r] = _mm256_setzero_ps();
    for (int64_t g = 0, h = 0; g < groups; g++) {
      __m256 s[R];
      for (int r = 0; r < R; r++) {
        const float scale = scales[r * groups + g];
        s[r] = _mm256_set1_ps(scale);
        add_offsets<TT>(bt, bt.offset_row(n + r), g, scale, group_sums, corr[r]);
      }
      for (const int64_t end = h + per_group; h < end; h++)  // 32 columns: lanes 8 (h % 2) .. + 7 of their 64's 16
        for (int r = 0; r < R; r++) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * K + 32 * h));
          const __m256i magnitude = _mm256_abs_epi8(wv);
          for (int tt = 0; tt < TT; tt++) {
            const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[tt] + 32 * h));
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(qv, wv));
            const __m256 lane_scale = _mm256_mul_ps(_mm256_loadu_ps(lanes[tt] + 8 * h), s[r]);
            acc[tt][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), lane_scale, acc[tt][r]);
          }
        }
    }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) out[tt * os + n + r] = cpu_fast::hsum8(acc[tt][r]) - corr[r][tt];
  }
}

// ---- AVX-512 VNNI: vpdpbusd, 64 byte products into 16 s32 lanes ----------------------------------------------
// The offsets' terms (corr) are summed after the rows' chunks, group by group in the same order as inside the
// loop, so the same bits: with groups of 128 a group is one chunk, and their scalar work and the pointers
// recomputed each group were half a decode step's instructions (W4A16 g128 read 6.0-6.8 GB/s on one Sapphire
// Rapids core, a third of its bandwidth).
template <int TT, int R>
KVLITE_TARGET_VNNI void int4_tile_vnni(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1,
                                       float* out, int64_t os, const BlockTables& bt) {
  const int64_t groups = w.scale_cols, per_group = w.group_size / kChunk, row_bytes = 4 * w.packed_cols;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* packed = w.packed + n * row_bytes;  // chunk c of row n + r: packed + r row_bytes + 64 c
    const float* scales = bt.scale_row(n);
    __m512 acc[TT][R];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) acc[tt][r] = _mm512_setzero_ps();
    int64_t c = 0;  // the chunk: kChunk columns, 64 bytes of each row, 16 lane scales of each token
    for (int64_t g = 0; g < groups; g++) {
      __m512 s[R];
      for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scales[r * groups + g]);
      for (const int64_t end = c + per_group; c < end; c++, packed += 64)
        for (int r = 0; r < R; r++) {
          const uint8_t* row = packed + r * row_bytes;
          _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBytes), _MM_HINT_T0);
          const __m512i wv = _mm512_loadu_si512(row);
          const __m512i lo = _mm512_and_si512(wv, low4);
          const __m512i hi = _mm512_and_si512(_mm512_maskz_srli_epi16(__mmask32(~0u), wv, 4), low4);
          for (int tt = 0; tt < TT; tt++) {
            const int8_t* qc = q[tt] + kChunk * c;
            __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(qc));
            sum = _mm512_dpbusd_epi32(sum, hi, _mm512_loadu_si512(qc + 64));
            const __m512 lane_scale = _mm512_mul_ps(_mm512_loadu_ps(lanes[tt] + 16 * c), s[r]);
            acc[tt][r] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(cpu_fast::kAll16, sum), lane_scale, acc[tt][r]);
          }
        }
    }
    float corr[R][TT] = {};
    if (bt.any_offset())
      for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < R; r++) add_offsets<TT>(bt, bt.offset_row(n + r), g, scales[r * groups + g], group_sums, corr[r]);
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) out[tt * os + n + r] = cpu_fast::hsum16(acc[tt][r]) - corr[r][tt];
  }
}

// int8 x int8: vpdpbusd multiplies unsigned by signed bytes, so q goes in as q + 128 (q xor 0x80) and the
// 128 sum w that adds (one more vpdpbusd of 128s, shared by the tile's tokens) comes off.
template <int TT, int R>
KVLITE_TARGET_VNNI void int8_tile_vnni(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1,
                                       float* out, int64_t os, const BlockTables& bt) {
  const int64_t groups = w.scale_cols, per_group = w.group_size / 64, K = w.in_features;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* rows = w.int8 + n * K;
    const float* scales = bt.scale_row(n);
    __m512 acc[TT][R];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) acc[tt][r] = _mm512_setzero_ps();
    for (int64_t g = 0, v = 0; g < groups; g++) {
      __m512 s[R];
      for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scales[r * groups + g]);
      for (const int64_t end = v + per_group; v < end; v++)
        for (int r = 0; r < R; r++) {
          const uint8_t* bytes = rows + r * K + 64 * v;
          _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
          const __m512i wv = _mm512_loadu_si512(bytes);
          const __m512i offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv);  // 128 sum w, per lane
          for (int tt = 0; tt < TT; tt++) {
            const __m512i qu = _mm512_xor_si512(_mm512_loadu_si512(q[tt] + 64 * v), bias);
            const __m512i sum = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qu, wv), offset);
            const __m512 lane_scale = _mm512_mul_ps(_mm512_loadu_ps(lanes[tt] + 16 * v), s[r]);
            acc[tt][r] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(cpu_fast::kAll16, sum), lane_scale, acc[tt][r]);
          }
        }
    }
    float corr[R][TT] = {};  // after the chunks, as int4_tile_vnni's
    if (bt.any_offset())
      for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < R; r++) add_offsets<TT>(bt, bt.offset_row(n + r), g, scales[r * groups + g], group_sums, corr[r]);
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) out[tt * os + n + r] = cpu_fast::hsum16(acc[tt][r]) - corr[r][tt];
  }
}

// ---- AVX-512 BF16: vdpbf16ps, 32 bf16 products a vector (pairs summed into 16 f32 lanes) ---------------------
// x: tokens' rows already rounded to bf16 [TT][K] (row stride xs); w: BF16 rows (stride ws).
// Whole vectors with plain loads, then the tail with masked ones: a masked load is a second micro-op on the
// ports vdpbf16ps issues from, and masking every step cost a 4-token x 4-row tile 20-25% (19.9 against 16.2 ms
// for a 3072 x 1024 weight on 128 tokens, Sapphire Rapids). The zeros a masked load fills in add exact zeros, so
// each sum is the same sequence of vdpbf16ps either way.
template <int TT, int R, bool MASKED>
KVLITE_TARGET_BF16DOT inline void bf16_tile_step(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws,
                                                 __mmask32 m, __m512 (&acc)[TT][R]) {
  __m512i wv[R];
  for (int r = 0; r < R; r++) wv[r] = MASKED ? _mm512_maskz_loadu_epi16(m, w + r * ws) : _mm512_loadu_si512(w + r * ws);
  for (int tt = 0; tt < TT; tt++) {
    const __m512i xv = MASKED ? _mm512_maskz_loadu_epi16(m, x + tt * xs) : _mm512_loadu_si512(x + tt * xs);
    for (int r = 0; r < R; r++) acc[tt][r] = _mm512_dpbf16_ps(acc[tt][r], (__m512bh)xv, (__m512bh)wv[r]);
  }
}
template <int TT, int R>
KVLITE_TARGET_BF16DOT void bf16_tile_dot(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, int64_t K,
                                          float* out, int64_t os) {
  __m512 acc[TT][R];
  for (int tt = 0; tt < TT; tt++)
    for (int r = 0; r < R; r++) acc[tt][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) bf16_tile_step<TT, R, false>(x + k, xs, w + k, ws, __mmask32(~0u), acc);
  if (k < K)  // masked loads read (and fault) nothing past K
    bf16_tile_step<TT, R, true>(x + k, xs, w + k, ws, __mmask32((1u << (K - k)) - 1u), acc);
  for (int tt = 0; tt < TT; tt++)
    for (int r = 0; r < R; r++) out[tt * os + r] = cpu_fast::hsum16(acc[tt][r]);
}
#endif

#if KVLITE_CPU_NEON_DOT
// ---- NEON dot product (ARMv8.2 sdot): 16 signed byte products into 4 s32 lanes ----------------------------------
// Signed by signed, so neither int4's codes (0..15) nor int8's bytes need the x86 kernels' offsets. Lane i of a
// 16-byte vector h of a chunk is lane 4h + i of the x86 kernels' 16, the same lane scale. Tiles of few sums keep
// one sum a vector h (4 chains: sdot and fmla latency hide behind each other), larger ones one a tile.
template <int TT, int R>
KVLITE_TARGET_NEON_DOT void int4_tile_neon_dot(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0,
                                               int64_t n1, float* out, int64_t os, const BlockTables& bt) {
  constexpr int H = TT * R >= 4 ? 1 : 4;
  const int64_t groups = w.scale_cols, per_group = w.group_size / kChunk, row_bytes = 4 * w.packed_cols;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* rows = w.packed + n * row_bytes;
    const float* scales = bt.scale_row(n);
    float corr[R][TT] = {};
    float32x4_t acc[TT][R][H];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) acc[tt][r][h] = vdupq_n_f32(0.0f);
    for (int64_t g = 0, c = 0; g < groups; g++) {
      float s[R];
      for (int r = 0; r < R; r++) {
        s[r] = scales[r * groups + g];
        add_offsets<TT>(bt, bt.offset_row(n + r), g, s[r], group_sums, corr[r]);
      }
      for (const int64_t end = c + per_group; c < end; c++)
        for (int r = 0; r < R; r++) {
          const uint8_t* packed = rows + r * row_bytes + 64 * c;
          __builtin_prefetch(packed + kPrefetchBytes);
          for (int h = 0; h < 4; h++) {  // bytes 16 h .. + 15: columns 32 h .. + 31 of the chunk (even and odd)
            const uint8x16_t wv = vld1q_u8(packed + 16 * h);
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(wv, low4)), hi = vreinterpretq_s8_u8(vshrq_n_u8(wv, 4));
            for (int tt = 0; tt < TT; tt++) {
              const int8_t* qc = q[tt] + kChunk * c + 16 * h;
              const int32x4_t sum = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(qc)), hi, vld1q_s8(qc + 64));
              const float32x4_t lane_scale = vmulq_n_f32(vld1q_f32(lanes[tt] + 16 * c + 4 * h), s[r]);
              acc[tt][r][h % H] = vfmaq_f32(acc[tt][r][h % H], vcvtq_f32_s32(sum), lane_scale);
            }
          }
        }
    }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) {
        float32x4_t v = acc[tt][r][0];
        for (int h = 1; h < H; h++) v = vaddq_f32(v, acc[tt][r][h]);
        out[tt * os + n + r] = vaddvq_f32(v) - corr[r][tt];
      }
  }
}

template <int TT, int R>
KVLITE_TARGET_NEON_DOT void int8_tile_neon_dot(const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0,
                                               int64_t n1, float* out, int64_t os, const BlockTables& bt) {
  constexpr int H = TT * R >= 4 ? 1 : 4;
  const int64_t groups = w.scale_cols, per_group = w.group_size / 64, K = w.in_features;
  const int8_t* q[TT];
  const float* lanes[TT];
  const float* group_sums[TT];
  for (int tt = 0; tt < TT; tt++) q[tt] = a.q(t + tt), lanes[tt] = a.lane_scales(t + tt), group_sums[tt] = a.group_sums(t + tt);
  for (int64_t n = n0; n < n1; n += R) {
    const int8_t* rows = reinterpret_cast<const int8_t*>(w.int8) + n * K;
    const float* scales = bt.scale_row(n);
    float corr[R][TT] = {};
    float32x4_t acc[TT][R][H];
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) acc[tt][r][h] = vdupq_n_f32(0.0f);
    for (int64_t g = 0, v = 0; g < groups; g++) {
      float s[R];
      for (int r = 0; r < R; r++) {
        s[r] = scales[r * groups + g];
        add_offsets<TT>(bt, bt.offset_row(n + r), g, s[r], group_sums, corr[r]);
      }
      for (const int64_t end = v + per_group; v < end; v++)
        for (int r = 0; r < R; r++) {
          const int8_t* bytes = rows + r * K + 64 * v;
          __builtin_prefetch(bytes + kPrefetchBytes);
          for (int h = 0; h < 4; h++) {  // columns 16 h .. + 15 of the 64: lanes 4 h .. + 3 of their 16
            const int8x16_t wv = vld1q_s8(bytes + 16 * h);
            for (int tt = 0; tt < TT; tt++) {
              const int32x4_t sum = vdotq_s32(vdupq_n_s32(0), wv, vld1q_s8(q[tt] + 64 * v + 16 * h));
              const float32x4_t lane_scale = vmulq_n_f32(vld1q_f32(lanes[tt] + 16 * v + 4 * h), s[r]);
              acc[tt][r][h % H] = vfmaq_f32(acc[tt][r][h % H], vcvtq_f32_s32(sum), lane_scale);
            }
          }
        }
    }
    for (int tt = 0; tt < TT; tt++)
      for (int r = 0; r < R; r++) {
        float32x4_t v = acc[tt][r][0];
        for (int h = 1; h < H; h++) v = vaddq_f32(v, acc[tt][r][h]);
        out[tt * os + n + r] = vaddvq_f32(v) - corr[r][tt];
      }
  }
}
#endif  // KVLITE_CPU_NEON_DOT

// ---- dispatch ---------------------------------------------------------------------------------------------
// Which integer kernels `isa` runs: avx512 with VNNI, else avx2's (AVX-512 without VNNI too); neon with sdot;
// else portable. Resolved once, when the backend starts: CPUID is slow (a VM exit under a hypervisor).
enum class IntKernels : uint8_t { portable, avx2, vnni, neon_dot };
inline IntKernels int_kernels_for(CpuIsa isa) {
  if (isa == CpuIsa::neon && cpu_has_neon_dot()) return IntKernels::neon_dot;
  if (isa == CpuIsa::avx512 && cpu_has_vnni()) return IntKernels::vnni;
  if (isa == CpuIsa::avx512 || isa == CpuIsa::avx2) return IntKernels::avx2;
  return IntKernels::portable;
}

// Rows [n0, n1) (a multiple of R of them) for tokens [t, t + TT): each kernel loops over the rows itself, so a
// row of a few cache lines (a W4A16 row of 1,024 columns is 8) pays no call.
template <bool INT4, int TT, int R>
void int_rows(IntKernels kernels, const Q8Rows& a, int64_t t, const QuantWeight& w, int64_t n0, int64_t n1,
              float* out, int64_t os, const BlockTables& bt) {
#if KVLITE_CPU_X86_SIMD
  if (kernels == IntKernels::vnni)
    return INT4 ? int4_tile_vnni<TT, R>(a, t, w, n0, n1, out, os, bt) : int8_tile_vnni<TT, R>(a, t, w, n0, n1, out, os, bt);
  if (kernels == IntKernels::avx2)
    return INT4 ? int4_tile_avx2<TT, R>(a, t, w, n0, n1, out, os, bt) : int8_tile_avx2<TT, R>(a, t, w, n0, n1, out, os, bt);
#endif
#if KVLITE_CPU_NEON_DOT
  if (kernels == IntKernels::neon_dot)
    return INT4 ? int4_tile_neon_dot<TT, R>(a, t, w, n0, n1, out, os, bt)
                : int8_tile_neon_dot<TT, R>(a, t, w, n0, n1, out, os, bt);
#endif
  INT4 ? int4_tile_portable<TT, R>(a, t, w, n0, n1, out, os, bt) : int8_tile_portable<TT, R>(a, t, w, n0, n1, out, os, bt);
}
// Token tiles of cpu_fast::kTokens; rows one at a time below a full token tile (a stream, as cpu_fast's
// for_each_tile_by_tokens), else in 4-row tiles and the last rows singly.
template <bool INT4, int TT>
void int_token_tile(IntKernels kernels, const Q8Rows& a, int64_t tokens, int64_t t, const QuantWeight& w, int64_t n0,
                    int64_t n1, float* out, int64_t os, const BlockTables& bt) {
  float* o = out + t * os;
  const int64_t n4 = tokens < cpu_fast::kTokens ? n0 : n0 + (n1 - n0) / 4 * 4;
  if (n4 > n0) int_rows<INT4, TT, 4>(kernels, a, t, w, n0, n4, o, os, bt);
  if (n1 > n4) int_rows<INT4, TT, 1>(kernels, a, t, w, n4, n1, o, os, bt);
}
template <bool INT4>
void int_tiles(IntKernels kernels, const Q8Rows& a, int64_t tokens, const QuantWeight& w, int64_t n0, int64_t n1,
               float* out, int64_t os, float* scratch) {
  const BlockTables bt = block_tables<INT4>(w, n0, n1, scratch);
  for (int64_t t = 0; t < tokens; t += cpu_fast::kTokens) {
    switch (std::min<int64_t>(cpu_fast::kTokens, tokens - t)) {
      case 4: int_token_tile<INT4, 4>(kernels, a, tokens, t, w, n0, n1, out, os, bt); break;
      case 3: int_token_tile<INT4, 3>(kernels, a, tokens, t, w, n0, n1, out, os, bt); break;
      case 2: int_token_tile<INT4, 2>(kernels, a, tokens, t, w, n0, n1, out, os, bt); break;
      default: int_token_tile<INT4, 1>(kernels, a, tokens, t, w, n0, n1, out, os, bt); break;
    }
  }
}

// out[t * out_stride + n] for tokens [0, tokens) of `a`, rows [n0, n1) (+ bias), of an int4_covered or
// int8_covered weight. scratch: block_table_floats(w, n1 - n0) floats of the calling thread's.
inline void int_linear_rows(IntKernels kernels, const Q8Rows& a, int64_t tokens, const QuantWeight& w, float* out,
                            int64_t out_stride, int64_t n0, int64_t n1, float* scratch) {
  if (w.format == WeightFormat::int4) int_tiles<true>(kernels, a, tokens, w, n0, n1, out, out_stride, scratch);
  else int_tiles<false>(kernels, a, tokens, w, n0, n1, out, out_stride, scratch);
  if (w.bias != nullptr)
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t n = n0; n < n1; n++) out[t * out_stride + n] += scale_at(w.bias, w.bias_dtype, n);
}

#if KVLITE_CPU_X86_SIMD
struct Bf16DotTile {
  const uint16_t* x;
  int64_t x_stride;
  const Tensor& weight;
  float* out;
  int64_t out_stride;
  template <int TT, int R>
  void run(int64_t t, int64_t n) {
    bf16_tile_dot<TT, R>(x + t * x_stride, x_stride, row_of<const uint16_t>(weight, n), weight.row_stride,
                         weight.cols, out + t * out_stride + n, out_stride);
  }
};
#endif

// BF16 weights on bf16 activations (x: [tokens] rows rounded to bf16, stride x_stride): rows [n0, n1) (+ bias).
// Only where cpu_has_bf16_dot(); elsewhere the backend multiplies the rounded values with the fast kernels.
// stream_rows (1 or kBf16StreamRowsInterleaved): rows a single token's GEMV reads side by side; each row's sum
// is the same sequence of vdpbf16ps whatever it is, so it changes no bit.
inline void bf16_dot_linear_rows(const uint16_t* x, int64_t x_stride, int64_t tokens, const Tensor& weight,
                                 const Tensor& bias, float* out, int64_t out_stride, int64_t n0, int64_t n1,
                                 int stream_rows) {
#if KVLITE_CPU_X86_SIMD
  Bf16DotTile tile{x, x_stride, weight, out, out_stride};
  if (tokens == 1 && stream_rows == kBf16StreamRowsInterleaved) {
    int64_t n = n0;
    for (; n + kBf16StreamRowsInterleaved <= n1; n += kBf16StreamRowsInterleaved)
      tile.template run<1, kBf16StreamRowsInterleaved>(0, n);
    for (; n < n1; n++) tile.template run<1, 1>(0, n);
  } else {
    cpu_fast::for_each_tile_by_tokens<4>(tokens, n0, n1, tile);
  }
#else
  (void)x, (void)x_stride, (void)tokens, (void)weight, (void)out, (void)out_stride, (void)stream_rows;
  fail(ErrorCode::internal, "bf16_dot_linear_rows: no AVX-512 BF16 on this build");
#endif
  if (bias.data != nullptr)
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t n = n0; n < n1; n++) out[t * out_stride + n] += float_at(bias, n);
}

}  // namespace cpu_lowp
}  // namespace detail
}  // namespace kvlite
