// cpu_fast: the CPU backend's fast Linear kernels (CpuKernels::fast), beside the reference loops of
// backend_cpu.inl, which stay the truth they are tested against (tests/unit-cpu-fast.cpp).
//
// What is different from the reference: weights are read as stored (BF16 / F16 / F32, int4 pack-quantized
// words, int8 or fp8 e4m3 bytes) and widened or dequantized in SIMD registers right before the FMA; the
// reference converts dense weights element by element and dequantizes quantized weights 16 rows at a time into
// scratch first. Scratch: the fast kernels use the backend's existing per-thread dequantization buffer for
// their tables (int4 groups, act-order int8 scales) and its W8A8 activation buffer; nothing of their own. Each output
// element is still one dot product computed by one thread in a fixed order (vector lanes over k, then a fixed
// horizontal reduction, then the tail), so results do not depend on the thread count either; they differ from
// the reference by float rounding only (another summation order).
//
// int4 is dequantized through a table: a group has only 16 distinct weights, (u - 8 - zero) * scale rounded
// to the scale's dtype for u in 0..15, which are exactly the reference's values. The table lives in one
// AVX-512 register (vpermps picks by the nibble) or two AVX2 ones (vpermps on the low 3 bits, a blend on bit
// 3), so the weights the FMAs see equal the reference's bit for bit.
//
// ISA choice: the x86 kernels are compiled with function target attributes, so kvlite.hpp builds with the
// project's plain flags and runs on any x86-64; the CPU's features are checked at run time
// (__builtin_cpu_supports) before a backend uses them. On AArch64 (Jetson's Cortex-A78AE, Graviton, a Raspberry
// Pi 5) the NEON kernels need nothing checked: Advanced SIMD, FMA and the f16 conversions are part of the base
// architecture. Elsewhere only the portable C++ kernels exist.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVLITE_CPU_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#define KVLITE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVLITE_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else
#define KVLITE_CPU_X86_SIMD 0
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define KVLITE_CPU_NEON 1
#include <arm_neon.h>
#else
#define KVLITE_CPU_NEON 0
#endif

namespace kvlite {

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::automatic: return "automatic";
    case CpuIsa::portable: return "portable";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::neon: return "neon";
  }
  return "?";
}

#if KVLITE_CPU_X86_SIMD
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports has no "f16c". It needs no OS support
// of its own beyond AVX's, which the "avx2" check covers.
static bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}
#endif

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::automatic: case CpuIsa::portable: return true;
#if KVLITE_CPU_X86_SIMD
    // __builtin_cpu_supports also checks that the OS saves the wide registers (XGETBV), not only CPUID.
    case CpuIsa::avx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case CpuIsa::avx512:
      __builtin_cpu_init();
      return cpu_isa_supported(CpuIsa::avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    case CpuIsa::avx2: case CpuIsa::avx512: return false;
#endif
    case CpuIsa::neon: return KVLITE_CPU_NEON != 0;  // AArch64's Advanced SIMD is never optional
  }
  return false;
}

CpuIsa best_cpu_isa() {
  if (cpu_isa_supported(CpuIsa::avx512)) return CpuIsa::avx512;
  if (cpu_isa_supported(CpuIsa::avx2)) return CpuIsa::avx2;
  if (cpu_isa_supported(CpuIsa::neon)) return CpuIsa::neon;
  return CpuIsa::portable;
}

namespace detail {
namespace cpu_fast {

// Tile shape: ROWS output rows x up to kTokens tokens per register tile; a backend work item is kRowBlock rows
// (a multiple of every ROWS) for all tokens, so each item's weights are read from memory once and from cache
// for the later token tiles.
constexpr int kTokens = 4;
constexpr int64_t kRowBlock = 16;

// Whether the fast int4 kernels cover this weight: checkpoint layout, groups in order (no g_idx) of whole
// packed words, at least 16 columns (a row's tables, 16 floats a group, then fit in K floats of scratch).
// Others (act-order, groups of 8, repacked CUDA tiles) run the reference.
inline bool int4_supported(const QuantWeight& w) {
  return w.format == WeightFormat::int4 && w.layout == QuantLayout::checkpoint && w.g_idx == nullptr &&
         w.group_size >= 16 && w.group_size % 8 == 0 && w.in_features % w.group_size == 0 &&
         w.scale_cols * w.group_size == w.in_features;
}
// Floats of table scratch int4_linear_rows needs for `rows` rows: 16 per group.
inline int64_t int4_table_floats(const QuantWeight& w, int64_t rows) { return rows * w.scale_cols * 16; }

// The 16 dequantized values of (row n, group g): exactly dequantize_rows' table.
inline void int4_table(const QuantWeight& w, int64_t n, int64_t g, float* table) {
  const float scale = scale_at(w.scales, w.scale_dtype, n * w.scale_cols + g);
  const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
  for (int u = 0; u < 16; u++) table[u] = dequantize_value(float(u - 8 - zero), scale, w.scale_dtype, w.rounding);
}

// ---- portable C++ -------------------------------------------------------------------------------------------
// The reference's lane structure (8 partial sums), but reading the stored weights directly (dense) or through
// the group's table (int4): no scratch.
template <int TT, int R, class W>
void dense_tile_portable(const float* x, int64_t xs, const W* w, int64_t ws, int64_t k_size, float* out,
                         int64_t os) {
  float acc[TT][R][kLanes] = {};
  const int64_t main = k_size - k_size % kLanes;
  for (int64_t k = 0; k < main; k += kLanes)
    for (int r = 0; r < R; r++) {
      float wk[kLanes];
      for (int l = 0; l < kLanes; l++) wk[l] = to_float(w[r * ws + k + l]);
      for (int t = 0; t < TT; t++)
        for (int l = 0; l < kLanes; l++) acc[t][r][l] += x[t * xs + k + l] * wk[l];
    }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) {
      float sum = reduce_lanes(acc[t][r]);
      for (int64_t k = main; k < k_size; k++) sum += x[t * xs + k] * to_float(w[r * ws + k]);
      out[t * os + r] = sum;
    }
}

// tables: row n's [scale_cols][16] dequantized values, the next row's after them (int4_table).
template <int TT, int R>
void int4_tile_portable(const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables, float* out,
                        int64_t os) {
  float acc[TT][R][kLanes] = {};
  for (int64_t g = 0; g < w.scale_cols; g++)
    for (int r = 0; r < R; r++) {
      const float* table = tables + (r * w.scale_cols + g) * 16;
      const uint8_t* packed_row = w.packed + 4 * (n + r) * w.packed_cols;
      for (int64_t word = g * w.group_size / 8; word < (g + 1) * w.group_size / 8; word++) {
        const uint32_t bits = load_u32_le(packed_row + 4 * word);
        float wk[kLanes];
        for (int l = 0; l < kLanes; l++) wk[l] = table[(bits >> (4 * l)) & 0xfu];
        for (int t = 0; t < TT; t++)
          for (int l = 0; l < kLanes; l++) acc[t][r][l] += x[t * xs + 8 * word + l] * wk[l];
      }
    }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = reduce_lanes(acc[t][r]);
}

// ---- int8 and fp8: byte weights ------------------------------------------------------------------------------
// int8 (GPTQ 8-bit, compressed-tensors INT8) and fp8 e4m3 weights are one byte a weight, [N, K], read in place:
// each vector of bytes is widened (int8: sign-extended; e4m3: decoded with integer ops, exactly
// fp8_e4m3_to_float), its zero point subtracted (int8), multiplied by its scale and rounded as dequantize_value
// rounds (the scale's dtype, or f32), so the FMAs see the reference's dequantized weights bit for bit.
// Columns go in runs that share one scale (int8 groups in order; fp8 blocks of block_k, else the whole row),
// each run in vectors from its first column with a masked tail; act-order int8 (g_idx) goes over K in vectors
// instead and gathers each column's scale and zero point from the row's tables (int8_order_tables).

// Whether the fast byte kernels cover this weight: checkpoint layout; int8 groups that tile K in order, or an
// act-order g_idx whose per-row tables (scale and zero point per group, 2 floats each) fit K floats of scratch.
inline bool bytes_supported(const QuantWeight& w) {
  if (w.layout != QuantLayout::checkpoint || w.scales == nullptr) return false;
  if (w.format == WeightFormat::fp8)
    return w.fp8 != nullptr && (w.granularity != ScaleGranularity::block || (w.block_k >= 1 && w.block_n >= 1));
  if (w.format != WeightFormat::int8 || w.int8 == nullptr || w.group_size < 1) return false;
  if (w.g_idx) return 2 * w.scale_cols <= w.in_features;
  return w.scale_cols == (w.in_features + w.group_size - 1) / w.group_size;
}
// Columns per scale, and where row n's scales start (the reference's dequantize_rows indices).
inline int64_t byte_run(const QuantWeight& w) {
  if (w.format == WeightFormat::int8) return w.group_size;
  return w.granularity == ScaleGranularity::block ? w.block_k : w.in_features;
}
inline int64_t byte_scale_row(const QuantWeight& w, int64_t n) {
  if (w.format == WeightFormat::int8) return n * w.scale_cols;
  return w.granularity == ScaleGranularity::tensor ? 0
         : w.granularity == ScaleGranularity::block ? (n / w.block_n) * w.scale_cols
                                                    : n;
}
inline float byte_scale(const QuantWeight& w, int64_t n, int64_t run) {
  return scale_at(w.scales, w.scale_dtype, byte_scale_row(w, n) + run);
}
inline float byte_zero(const QuantWeight& w, int64_t n, int64_t run) {  // int8 zero points; exact as a float
  return w.format == WeightFormat::int8 && w.zero_points
             ? float(reinterpret_cast<const int8_t*>(w.zero_points)[n * w.scale_cols + run])
             : 0.0f;
}
inline const uint8_t* byte_row(const QuantWeight& w, int64_t n) {
  return (w.format == WeightFormat::int8 ? w.int8 : w.fp8) + n * w.in_features;
}
// Floats of scratch bytes_linear_rows needs for `rows` rows: act-order int8's tables, 2 per group a row.
inline int64_t bytes_table_floats(const QuantWeight& w, int64_t rows) {
  return w.format == WeightFormat::int8 && w.g_idx ? rows * 2 * w.scale_cols : 0;
}
// Act-order int8: row r's scales as floats [scale_cols], then its zero points [scale_cols], for rows n0...
inline void int8_order_tables(const QuantWeight& w, int64_t n0, int64_t rows, float* tables) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < w.scale_cols; g++) {
      tables[(2 * r) * w.scale_cols + g] = byte_scale(w, n0 + r, g);
      tables[(2 * r + 1) * w.scale_cols + g] = byte_zero(w, n0 + r, g);
    }
}
inline int32_t g_idx_at(const QuantWeight& w, int64_t k) {
  int32_t g;
  memcpy(&g, w.g_idx + 4 * k, 4);
  return g;
}

// portable: 8 lanes, as the SIMD kernels (lane l of a vector of 8 from a run's start), dequantize_value itself
template <bool FP8>
inline float byte_value(uint8_t b) { return FP8 ? fp8_e4m3_to_float(b) : float(int8_t(b)); }

template <int TT, int R, bool FP8>
void bytes_tile_portable(const float* x, int64_t xs, const QuantWeight& w, int64_t n, float* out, int64_t os) {
  float acc[TT][R][kLanes] = {};
  const int64_t K = w.in_features, run = byte_run(w);
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += run, j++) {
    const int64_t k1 = std::min(K, k0 + run);
    float scale[R], zero[R];
    for (int r = 0; r < R; r++) {
      scale[r] = byte_scale(w, n + r, j);
      zero[r] = byte_zero(w, n + r, j);
    }
    for (int64_t k = k0; k < k1; k += kLanes) {
      const int lanes = int(std::min<int64_t>(kLanes, k1 - k));
      for (int r = 0; r < R; r++) {
        const uint8_t* q = byte_row(w, n + r) + k;
        float wk[kLanes];
        for (int l = 0; l < lanes; l++) {
          const float v = FP8 ? byte_value<FP8>(q[l]) : byte_value<FP8>(q[l]) - zero[r];
          wk[l] = dequantize_value(v, scale[r], w.scale_dtype, w.rounding);
        }
        for (int t = 0; t < TT; t++)
          for (int l = 0; l < lanes; l++) acc[t][r][l] += x[t * xs + k + l] * wk[l];
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = reduce_lanes(acc[t][r]);
}

// tables: int8_order_tables of rows n.. (2 * scale_cols floats a row)
template <int TT, int R>
void int8_order_tile_portable(const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables,
                              float* out, int64_t os) {
  float acc[TT][R][kLanes] = {};
  const int64_t K = w.in_features;
  for (int64_t k = 0; k < K; k += kLanes) {
    const int lanes = int(std::min<int64_t>(kLanes, K - k));
    int32_t g[kLanes];
    for (int l = 0; l < lanes; l++) g[l] = g_idx_at(w, k + l);
    for (int r = 0; r < R; r++) {
      const int8_t* q = reinterpret_cast<const int8_t*>(byte_row(w, n + r)) + k;
      const float* scales = tables + 2 * r * w.scale_cols;
      const float* zeros = scales + w.scale_cols;
      float wk[kLanes];
      for (int l = 0; l < lanes; l++)
        wk[l] = dequantize_value(float(q[l]) - zeros[g[l]], scales[g[l]], w.scale_dtype, w.rounding);
      for (int t = 0; t < TT; t++)
        for (int l = 0; l < lanes; l++) acc[t][r][l] += x[t * xs + k + l] * wk[l];
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = reduce_lanes(acc[t][r]);
}

#if KVLITE_CPU_X86_SIMD
// ---- AVX2 + FMA + F16C: 8 lanes -----------------------------------------------------------------------------
KVLITE_TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVLITE_TARGET_AVX2 inline __m256 load8(const Bf16* p) {  // bf16 is the top half of an f32: widen and shift
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
KVLITE_TARGET_AVX2 inline __m256 load8(const Half* p) {  // F16C: exact, subnormals included
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KVLITE_TARGET_AVX2 inline float hsum8(__m256 v) {  // a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int TT, int R, class W>
KVLITE_TARGET_AVX2 void dense_tile_avx2(const float* x, int64_t xs, const W* w, int64_t ws, int64_t k_size,
                                        float* out, int64_t os) {
  __m256 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm256_setzero_ps();
  const int64_t main = k_size - k_size % 8;
  for (int64_t k = 0; k < main; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; r++) wv[r] = load8(w + r * ws + k);
    for (int t = 0; t < TT; t++) {
      const __m256 xv = _mm256_loadu_ps(x + t * xs + k);
      for (int r = 0; r < R; r++) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) {
      float sum = hsum8(acc[t][r]);
      for (int64_t k = main; k < k_size; k++) sum += x[t * xs + k] * to_float(w[r * ws + k]);
      out[t * os + r] = sum;
    }
}

// p rounded to bf16 (nearest even; NaN stays a quiet NaN) and widened back: float_to_bf16 on 8 lanes.
KVLITE_TARGET_AVX2 inline __m256 round_bf16_avx2(__m256 p) {
  const __m256i bits = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  const __m256i rounded =
      _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), high);
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(bits, high), _mm256_set1_epi32(0x00400000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(p, p, _CMP_UNORD_Q));
}
KVLITE_TARGET_AVX2 inline __m256 round_to_dtype_avx2(__m256 p, const QuantWeight& w) {
  if (w.rounding != DequantRounding::scale_dtype) return p;
  if (w.scale_dtype == DType::BF16) return round_bf16_avx2(p);
  if (w.scale_dtype == DType::F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
  return p;
}

// The group's table as two registers: entries 0..7 and 8..15.
KVLITE_TARGET_AVX2 inline void int4_table_avx2(const QuantWeight& w, int64_t n, int64_t g, __m256& low, __m256& high) {
  const __m256 scale = _mm256_set1_ps(scale_at(w.scales, w.scale_dtype, n * w.scale_cols + g));
  const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
  const __m256i q = _mm256_sub_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 + zero));
  low = round_to_dtype_avx2(_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale), w);
  high = round_to_dtype_avx2(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q, _mm256_set1_epi32(8))), scale), w);
}

// Every group's table of rows [n0, n0 + rows) into tables [rows][scale_cols][16].
KVLITE_TARGET_AVX2 void int4_tables_avx2(const QuantWeight& w, int64_t n0, int64_t rows, float* tables) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < w.scale_cols; g++) {
      __m256 low, high;
      int4_table_avx2(w, n0 + r, g, low, high);
      _mm256_storeu_ps(tables + (r * w.scale_cols + g) * 16, low);
      _mm256_storeu_ps(tables + (r * w.scale_cols + g) * 16 + 8, high);
    }
}

template <int TT, int R>
KVLITE_TARGET_AVX2 void int4_tile_avx2(const float* x, int64_t xs, const QuantWeight& w, int64_t n,
                                       const float* tables, float* out, int64_t os) {
  __m256 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm256_setzero_ps();
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);  // lane l: nibble l of the word
  const uint8_t* packed = w.packed + 4 * n * w.packed_cols;
  const int64_t words_per_group = w.group_size / 8;
  for (int64_t g = 0; g < w.scale_cols; g++) {
    __m256 low[R], high[R];
    for (int r = 0; r < R; r++) {
      low[r] = _mm256_loadu_ps(tables + (r * w.scale_cols + g) * 16);
      high[r] = _mm256_loadu_ps(tables + (r * w.scale_cols + g) * 16 + 8);
    }
    for (int64_t word = g * words_per_group; word < (g + 1) * words_per_group; word++) {
      __m256 wv[R];
      for (int r = 0; r < R; r++) {
        const __m256i nibbles =
            _mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32_le(packed + 4 * (r * w.packed_cols + word)))), shifts);
        // vpermps reads the low 3 bits of each index; bit 3 (moved to the sign bit) picks the table half
        const __m256 from_low = _mm256_permutevar8x32_ps(low[r], nibbles);
        const __m256 from_high = _mm256_permutevar8x32_ps(high[r], nibbles);
        wv[r] = _mm256_blendv_ps(from_low, from_high, _mm256_castsi256_ps(_mm256_slli_epi32(nibbles, 28)));
      }
      for (int t = 0; t < TT; t++) {
        const __m256 xv = _mm256_loadu_ps(x + t * xs + 8 * word);
        for (int r = 0; r < R; r++) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8(acc[t][r]);
}

// ---- AVX2: byte weights --------------------------------------------------------------------------------------
// Lanes [0, lanes) set: the mask of a vector's first `lanes` columns.
KVLITE_TARGET_AVX2 inline __m256i lane_mask_avx2(int lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// 8 bytes as floats: int8 sign-extended, or e4m3 decoded exactly as fp8_e4m3_to_float (normal: the exponent
// rebiased by 120 with the mantissa shifted into place; subnormal: mantissa x 2^-9; S.1111.111: NaN).
template <bool FP8>
KVLITE_TARGET_AVX2 inline __m256 bytes8_avx2(const uint8_t* p, int lanes) {
  __m128i b;
  if (lanes == 8) {
    b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {  // the tail: nothing read past the row
    alignas(16) uint8_t tail[16] = {};
    memcpy(tail, p, size_t(lanes));
    b = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
  }
  if (!FP8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256i v = _mm256_cvtepu8_epi32(b);
  const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
  __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal), _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f)));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}
// x's next 8 columns (the tail's missing ones 0)
KVLITE_TARGET_AVX2 inline __m256 x8_avx2(const float* p, int lanes) {
  return lanes == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask_avx2(lanes));
}
// (q - zero) x scale rounded as dequantize_value; lanes past `lanes` 0
KVLITE_TARGET_AVX2 inline __m256 dequant8_avx2(__m256 q, __m256 zero, __m256 scale, int lanes, const QuantWeight& w) {
  __m256 p = round_to_dtype_avx2(_mm256_mul_ps(_mm256_sub_ps(q, zero), scale), w);
  return lanes == 8 ? p : _mm256_and_ps(p, _mm256_castsi256_ps(lane_mask_avx2(lanes)));
}

template <int TT, int R, bool FP8>
KVLITE_TARGET_AVX2 void bytes_tile_avx2(const float* x, int64_t xs, const QuantWeight& w, int64_t n, float* out,
                                        int64_t os) {
  __m256 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm256_setzero_ps();
  const int64_t K = w.in_features, run = byte_run(w);
  const uint8_t* q = byte_row(w, n);
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += run, j++) {
    const int64_t k1 = std::min(K, k0 + run);
    __m256 scale[R], zero[R];
    for (int r = 0; r < R; r++) {
      scale[r] = _mm256_set1_ps(byte_scale(w, n + r, j));
      zero[r] = _mm256_set1_ps(byte_zero(w, n + r, j));  // fp8: 0, and e4m3 - 0 keeps -0 (-0 - +0 = -0)
    }
    for (int64_t k = k0; k < k1; k += 8) {
      const int lanes = int(std::min<int64_t>(8, k1 - k));
      __m256 wv[R];
      for (int r = 0; r < R; r++) wv[r] = dequant8_avx2(bytes8_avx2<FP8>(q + r * K + k, lanes), zero[r], scale[r], lanes, w);
      for (int t = 0; t < TT; t++) {
        const __m256 xv = x8_avx2(x + t * xs + k, lanes);
        for (int r = 0; r < R; r++) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8(acc[t][r]);
}

template <int TT, int R>
KVLITE_TARGET_AVX2 void int8_order_tile_avx2(const float* x, int64_t xs, const QuantWeight& w, int64_t n,
                                             const float* tables, float* out, int64_t os) {
  __m256 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm256_setzero_ps();
  const int64_t K = w.in_features;
  const uint8_t* q = byte_row(w, n);
  for (int64_t k = 0; k < K; k += 8) {
    const int lanes = int(std::min<int64_t>(8, K - k));
    const __m256i mask = lane_mask_avx2(lanes);
    const __m256i g = _mm256_maskload_epi32(reinterpret_cast<const int*>(w.g_idx + 4 * k), mask);
    __m256 wv[R];
    for (int r = 0; r < R; r++) {
      const float* scales = tables + 2 * r * w.scale_cols;
      const __m256 scale = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), scales, g, _mm256_castsi256_ps(mask), 4);
      const __m256 zero =
          _mm256_mask_i32gather_ps(_mm256_setzero_ps(), scales + w.scale_cols, g, _mm256_castsi256_ps(mask), 4);
      wv[r] = dequant8_avx2(bytes8_avx2<false>(q + r * K + k, lanes), zero, scale, lanes, w);
    }
    for (int t = 0; t < TT; t++) {
      const __m256 xv = x8_avx2(x + t * xs + k, lanes);
      for (int r = 0; r < R; r++) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8(acc[t][r]);
}

// ---- AVX-512 F/BW/VL: 16 lanes, masked tails ---------------------------------------------------------------
// GCC 12 warns (-Wuninitialized) inside the unmasked forms of several AVX-512 intrinsics (their "undefined"
// source operand); the zero-masked forms with every lane set are the same instructions without it.
constexpr __mmask16 kAll16 = 0xffff;
KVLITE_TARGET_AVX512 inline float hsum16(__m512 v) {  // the two halves added, then hsum8's fixed tree
  // (GCC 12 implements _mm512_castps512_ps256 with the unmasked extract too)
  const __m256 low = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(__mmask8(0xf), _mm512_castps_pd(v), 0));
  const __m256 high = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(__mmask8(0xf), _mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(low, high));
}
KVLITE_TARGET_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KVLITE_TARGET_AVX512 inline __m512 load16(const Bf16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, _mm512_maskz_cvtepu16_epi32(kAll16, bits), 16));
}
KVLITE_TARGET_AVX512 inline __m512 load16(const Half* p, __mmask16 m) {
  return _mm512_maskz_cvtph_ps(kAll16, _mm256_maskz_loadu_epi16(m, p));
}

template <int TT, int R, class W>
KVLITE_TARGET_AVX512 void dense_tile_avx512(const float* x, int64_t xs, const W* w, int64_t ws, int64_t k_size,
                                            float* out, int64_t os) {
  __m512 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; r++) wv[r] = load16(w + r * ws + k, __mmask16(0xffff));
    for (int t = 0; t < TT; t++) {
      const __m512 xv = _mm512_loadu_ps(x + t * xs + k);
      for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  if (k < k_size) {  // the tail: masked loads read (and fault) nothing past the row
    const __mmask16 m = __mmask16((1u << (k_size - k)) - 1u);
    __m512 wv[R];
    for (int r = 0; r < R; r++) wv[r] = load16(w + r * ws + k, m);
    for (int t = 0; t < TT; t++) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * xs + k);
      for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum16(acc[t][r]);
}

// p rounded to bf16 (nearest even; NaN stays a quiet NaN) and widened back: float_to_bf16 on 16 lanes.
KVLITE_TARGET_AVX512 inline __m512 round_bf16_avx512(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll16, bits, 16), _mm512_set1_epi32(1));
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), high);
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), rounded, quiet));
}
KVLITE_TARGET_AVX512 inline __m512 int4_table_avx512(const QuantWeight& w, int64_t n, int64_t g) {
  const __m512 scale = _mm512_set1_ps(scale_at(w.scales, w.scale_dtype, n * w.scale_cols + g));
  const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
  const __m512i q = _mm512_sub_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(8 + zero));
  const __m512 p = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, q), scale);
  if (w.rounding != DequantRounding::scale_dtype) return p;
  if (w.scale_dtype == DType::BF16) return round_bf16_avx512(p);
  if (w.scale_dtype == DType::F16)
    return _mm512_maskz_cvtph_ps(kAll16, _mm512_maskz_cvtps_ph(kAll16, p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return p;
}

KVLITE_TARGET_AVX512 void int4_tables_avx512(const QuantWeight& w, int64_t n0, int64_t rows, float* tables) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < w.scale_cols; g++)
      _mm512_storeu_ps(tables + (r * w.scale_cols + g) * 16, int4_table_avx512(w, n0 + r, g));
}

template <int TT, int R>
KVLITE_TARGET_AVX512 void int4_tile_avx512(const float* x, int64_t xs, const QuantWeight& w, int64_t n,
                                           const float* tables, float* out, int64_t os) {
  __m512 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  // 16 columns are two packed words: lanes 0..7 take word 0, lanes 8..15 word 1, each shifted to its nibble
  const __m512i word_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const uint8_t* packed = w.packed + 4 * n * w.packed_cols;
  const int64_t group = w.group_size;
  for (int64_t g = 0; g < w.scale_cols; g++) {
    __m512 table[R];
    for (int r = 0; r < R; r++) table[r] = _mm512_loadu_ps(tables + (r * w.scale_cols + g) * 16);
    const int64_t k1 = (g + 1) * group;
    int64_t k = g * group;
    for (; k + 16 <= k1; k += 16) {
      __m512 wv[R];
      for (int r = 0; r < R; r++) {
        const __m128i two_words =
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + 4 * (r * w.packed_cols + k / 8)));
        const __m512i nibbles =
            _mm512_maskz_srlv_epi32(
                kAll16, _mm512_maskz_permutexvar_epi32(kAll16, word_of_lane, _mm512_zextsi128_si512(two_words)), shifts);
        wv[r] = _mm512_maskz_permutexvar_ps(kAll16, nibbles, table[r]);  // vpermps reads the low 4 bits: the nibble
      }
      for (int t = 0; t < TT; t++) {
        const __m512 xv = _mm512_loadu_ps(x + t * xs + k);
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
    if (k < k1) {  // a group of 8 (mod 16) columns ends with one word: the low 8 lanes
      const __mmask16 m = __mmask16(0x00ff);
      __m512 wv[R];
      for (int r = 0; r < R; r++) {
        const __m512i word = _mm512_set1_epi32(int(load_u32_le(packed + 4 * (r * w.packed_cols + k / 8))));
        wv[r] = _mm512_maskz_permutexvar_ps(m, _mm512_maskz_srlv_epi32(kAll16, word, shifts), table[r]);
      }
      for (int t = 0; t < TT; t++) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * xs + k);
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum16(acc[t][r]);
}
// ---- AVX-512: byte weights -----------------------------------------------------------------------------------
KVLITE_TARGET_AVX512 inline __m512 round_to_dtype_avx512(__m512 p, const QuantWeight& w) {
  if (w.rounding != DequantRounding::scale_dtype) return p;
  if (w.scale_dtype == DType::BF16) return round_bf16_avx512(p);
  if (w.scale_dtype == DType::F16)
    return _mm512_maskz_cvtph_ps(kAll16, _mm512_maskz_cvtps_ph(kAll16, p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return p;
}
// 16 bytes (lanes of m) as floats: bytes8_avx2's decoding on 16 lanes; masked lanes read nothing and are 0.
template <bool FP8>
KVLITE_TARGET_AVX512 inline __m512 bytes16_avx512(const uint8_t* p, __mmask16 m) {
  const __m128i b = _mm_maskz_loadu_epi8(m, p);
  if (!FP8) return _mm512_maskz_cvtepi32_ps(kAll16, _mm512_maskz_cvtepi8_epi32(kAll16, b));
  const __m512i v = _mm512_maskz_cvtepu8_epi32(kAll16, b);
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_maskz_slli_epi32(kAll16, _mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_maskz_slli_epi32(kAll16, em, 20), _mm512_set1_epi32(120 << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, em), _mm512_set1_ps(1.0f / 512.0f));
  __m512i bits = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal,
                                         _mm512_castps_si512(subnormal));
  bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)), bits,
                                 _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}
KVLITE_TARGET_AVX512 inline __mmask16 lane_mask16(int64_t lanes) {
  return lanes >= 16 ? kAll16 : __mmask16((1u << lanes) - 1u);
}

template <int TT, int R, bool FP8>
KVLITE_TARGET_AVX512 void bytes_tile_avx512(const float* x, int64_t xs, const QuantWeight& w, int64_t n, float* out,
                                            int64_t os) {
  __m512 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  const int64_t K = w.in_features, run = byte_run(w);
  const uint8_t* q = byte_row(w, n);
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += run, j++) {
    const int64_t k1 = std::min(K, k0 + run);
    __m512 scale[R], zero[R];
    for (int r = 0; r < R; r++) {
      scale[r] = _mm512_set1_ps(byte_scale(w, n + r, j));
      zero[r] = _mm512_set1_ps(byte_zero(w, n + r, j));
    }
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = lane_mask16(k1 - k);
      __m512 wv[R];
      for (int r = 0; r < R; r++) {
        __m512 v = bytes16_avx512<FP8>(q + r * K + k, m);
        if (!FP8) v = _mm512_sub_ps(v, zero[r]);
        wv[r] = round_to_dtype_avx512(_mm512_maskz_mul_ps(m, v, scale[r]), w);
      }
      for (int t = 0; t < TT; t++) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * xs + k);
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum16(acc[t][r]);
}

template <int TT, int R>
KVLITE_TARGET_AVX512 void int8_order_tile_avx512(const float* x, int64_t xs, const QuantWeight& w, int64_t n,
                                                 const float* tables, float* out, int64_t os) {
  __m512 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  const int64_t K = w.in_features;
  const uint8_t* q = byte_row(w, n);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lane_mask16(K - k);
    const __m512i g = _mm512_maskz_loadu_epi32(m, w.g_idx + 4 * k);
    __m512 wv[R];
    for (int r = 0; r < R; r++) {
      const float* scales = tables + 2 * r * w.scale_cols;
      const __m512 scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, g, scales, 4);
      const __m512 zero = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, g, scales + w.scale_cols, 4);
      wv[r] = round_to_dtype_avx512(
          _mm512_maskz_mul_ps(m, _mm512_sub_ps(bytes16_avx512<false>(q + r * K + k, m), zero), scale), w);
    }
    for (int t = 0; t < TT; t++) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * xs + k);
      for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum16(acc[t][r]);
}

#endif  // KVLITE_CPU_X86_SIMD

#if KVLITE_CPU_NEON
// ---- NEON (AArch64): 8 lanes as two float32x4 -------------------------------------------------------------
// The portable kernels' lane structure: lane l of each 8 columns, two q registers a sum; the horizontal sum is
// reduce_lanes' tree exactly (a + b pairs lanes l and l + 4, then pairwise adds). 32 registers: tiles of 2 rows x
// 4 tokens hold 16 sums, 4 weight vectors and the activations.
struct F32x8 { float32x4_t lo, hi; };
inline F32x8 zero8_neon() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
inline F32x8 load8_neon(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline F32x8 load8_neon(const Bf16* p) {  // bf16 is the top half of an f32: widen and shift
  const uint16x8_t bits = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(bits), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(bits, 16))};
}
inline F32x8 load8_neon(const Half* p) {  // fcvtl: exact, subnormals included
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline F32x8 fma8_neon(F32x8 acc, F32x8 a, F32x8 b) { return {vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi)}; }
inline float hsum8_neon(F32x8 v) {  // ((0+4)+(1+5)) + ((2+6)+(3+7)), as reduce_lanes
  const float32x4_t s = vaddq_f32(v.lo, v.hi);
  return vpadds_f32(vget_low_f32(vpaddq_f32(s, s)));
}

template <int TT, int R, class W>
void dense_tile_neon(const float* x, int64_t xs, const W* w, int64_t ws, int64_t k_size, float* out, int64_t os) {
  F32x8 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = zero8_neon();
  const int64_t main = k_size - k_size % 8;
  for (int64_t k = 0; k < main; k += 8) {
    F32x8 wv[R];
    for (int r = 0; r < R; r++) wv[r] = load8_neon(w + r * ws + k);
    for (int t = 0; t < TT; t++) {
      const F32x8 xv = load8_neon(x + t * xs + k);
      for (int r = 0; r < R; r++) acc[t][r] = fma8_neon(acc[t][r], wv[r], xv);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) {
      float sum = hsum8_neon(acc[t][r]);
      for (int64_t k = main; k < k_size; k++) sum += x[t * xs + k] * to_float(w[r * ws + k]);
      out[t * os + r] = sum;
    }
}

// p rounded to bf16 (nearest even; NaN stays a quiet NaN) and widened back: float_to_bf16 on 4 lanes.
inline float32x4_t round_bf16_neon(float32x4_t p) {
  const uint32x4_t bits = vreinterpretq_u32_f32(p), high = vdupq_n_u32(0xffff0000u);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  const uint32x4_t rounded = vandq_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), high);
  const uint32x4_t quiet = vorrq_u32(vandq_u32(bits, high), vdupq_n_u32(0x00400000u));
  const uint32x4_t is_nan = vmvnq_u32(vceqq_f32(p, p));
  return vreinterpretq_f32_u32(vbslq_u32(is_nan, quiet, rounded));
}
inline float32x4_t round_to_dtype_neon(float32x4_t p, const QuantWeight& w) {
  if (w.rounding != DequantRounding::scale_dtype) return p;
  if (w.scale_dtype == DType::BF16) return round_bf16_neon(p);
  if (w.scale_dtype == DType::F16) return vcvt_f32_f16(vcvt_f16_f32(p));  // fcvtn: nearest even (FPCR's default)
  return p;
}

// int4 through the group's table: its 16 floats are 64 bytes, four q registers, and tbl picks bytes by index,
// so the 4 columns of a vector take bytes 4u .. 4u + 3 of their nibble u's entry: the reference's values, bit
// for bit, as the x86 kernels' vpermps.
inline uint8x16x4_t int4_table_neon(const float* table) {
  uint8x16x4_t t;
  t.val[0] = vld1q_u8(reinterpret_cast<const uint8_t*>(table));
  t.val[1] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 4));
  t.val[2] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 8));
  t.val[3] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 12));
  return t;
}
// The 8 weights of one packed word (nibble l: column l) from the table.
inline F32x8 int4_word_neon(uint32_t word, const uint8x16x4_t& table) {
  static const uint8_t kSpread[2][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};
  static const uint8_t kByteOfFloat[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  const uint8x8_t bytes = vcreate_u8(uint64_t(word));
  // [low 0, high 0, low 1, high 1, ...]: nibble l in byte l, times 4 (its entry's first byte)
  const uint8x8_t nibbles = vzip1_u8(vand_u8(bytes, vdup_n_u8(0x0f)), vshr_n_u8(bytes, 4));
  const uint8x16_t first_byte = vcombine_u8(vshl_n_u8(nibbles, 2), vdup_n_u8(0));
  const uint8x16_t byte_of_float = vld1q_u8(kByteOfFloat);
  const uint8x16_t lo = vorrq_u8(vqtbl1q_u8(first_byte, vld1q_u8(kSpread[0])), byte_of_float);
  const uint8x16_t hi = vorrq_u8(vqtbl1q_u8(first_byte, vld1q_u8(kSpread[1])), byte_of_float);
  return {vreinterpretq_f32_u8(vqtbl4q_u8(table, lo)), vreinterpretq_f32_u8(vqtbl4q_u8(table, hi))};
}

template <int TT, int R>
void int4_tile_neon(const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables, float* out,
                    int64_t os) {
  F32x8 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = zero8_neon();
  const uint8_t* packed = w.packed + 4 * n * w.packed_cols;
  const int64_t words_per_group = w.group_size / 8;
  for (int64_t g = 0; g < w.scale_cols; g++) {
    uint8x16x4_t table[R];
    for (int r = 0; r < R; r++) table[r] = int4_table_neon(tables + (r * w.scale_cols + g) * 16);
    for (int64_t word = g * words_per_group; word < (g + 1) * words_per_group; word++) {
      F32x8 wv[R];
      for (int r = 0; r < R; r++) wv[r] = int4_word_neon(load_u32_le(packed + 4 * (r * w.packed_cols + word)), table[r]);
      for (int t = 0; t < TT; t++) {
        const F32x8 xv = load8_neon(x + t * xs + 8 * word);
        for (int r = 0; r < R; r++) acc[t][r] = fma8_neon(acc[t][r], wv[r], xv);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8_neon(acc[t][r]);
}

// ---- NEON: byte weights ----------------------------------------------------------------------------------------
// Lanes [0, lanes) of 8 set.
inline uint32x4_t lane_mask4_neon(int lanes, int first) {
  static const uint32_t kIndex[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  return vcltq_u32(vld1q_u32(kIndex + first), vdupq_n_u32(uint32_t(lanes)));
}
// 4 bytes' values (int8 sign-extended, or e4m3 decoded as bytes8_avx2 does) from their u32 widening.
template <bool FP8>
inline float32x4_t byte_values4_neon(uint32x4_t v) {
  if (!FP8) return vcvtq_f32_s32(vshrq_n_s32(vshlq_n_s32(vreinterpretq_s32_u32(v), 24), 24));
  const uint32x4_t em = vandq_u32(v, vdupq_n_u32(0x7f));
  const uint32x4_t sign = vshlq_n_u32(vandq_u32(v, vdupq_n_u32(0x80)), 24);
  const uint32x4_t normal = vaddq_u32(vshlq_n_u32(em, 20), vdupq_n_u32(120u << 23));
  const uint32x4_t subnormal = vreinterpretq_u32_f32(vmulq_f32(vcvtq_f32_u32(em), vdupq_n_f32(1.0f / 512.0f)));
  uint32x4_t bits = vbslq_u32(vcltq_u32(em, vdupq_n_u32(8)), subnormal, normal);
  bits = vbslq_u32(vceqq_u32(em, vdupq_n_u32(0x7f)), vdupq_n_u32(0x7fc00000u), bits);
  return vreinterpretq_f32_u32(vorrq_u32(bits, sign));
}
// 8 bytes as floats; the tail reads nothing past the row (its missing lanes decode byte 0)
template <bool FP8>
inline F32x8 bytes8_neon(const uint8_t* p, int lanes) {
  uint8x8_t b;
  if (lanes == 8) {
    b = vld1_u8(p);
  } else {
    uint8_t tail[8] = {};
    memcpy(tail, p, size_t(lanes));
    b = vld1_u8(tail);
  }
  const uint16x8_t h = vmovl_u8(b);
  return {byte_values4_neon<FP8>(vmovl_u16(vget_low_u16(h))), byte_values4_neon<FP8>(vmovl_high_u16(h))};
}
// x's next 8 columns (the tail's missing ones 0)
inline F32x8 x8_neon(const float* p, int lanes) {
  if (lanes == 8) return load8_neon(p);
  float tail[8] = {};
  memcpy(tail, p, size_t(lanes) * sizeof(float));
  return load8_neon(tail);
}
// (q - zero) x scale rounded as dequantize_value; lanes past `lanes` 0
inline F32x8 dequant8_neon(F32x8 q, F32x8 zero, F32x8 scale, int lanes, const QuantWeight& w) {
  F32x8 p = {round_to_dtype_neon(vmulq_f32(vsubq_f32(q.lo, zero.lo), scale.lo), w),
             round_to_dtype_neon(vmulq_f32(vsubq_f32(q.hi, zero.hi), scale.hi), w)};
  if (lanes < 8) {
    p.lo = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(p.lo), lane_mask4_neon(lanes, 0)));
    p.hi = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(p.hi), lane_mask4_neon(lanes, 4)));
  }
  return p;
}
inline F32x8 splat8_neon(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }

template <int TT, int R, bool FP8>
void bytes_tile_neon(const float* x, int64_t xs, const QuantWeight& w, int64_t n, float* out, int64_t os) {
  F32x8 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = zero8_neon();
  const int64_t K = w.in_features, run = byte_run(w);
  const uint8_t* q = byte_row(w, n);
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += run, j++) {
    const int64_t k1 = std::min(K, k0 + run);
    F32x8 scale[R], zero[R];
    for (int r = 0; r < R; r++) {
      scale[r] = splat8_neon(byte_scale(w, n + r, j));
      zero[r] = splat8_neon(byte_zero(w, n + r, j));  // fp8: 0, and e4m3 - 0 keeps -0 (-0 - +0 = -0)
    }
    for (int64_t k = k0; k < k1; k += 8) {
      const int lanes = int(std::min<int64_t>(8, k1 - k));
      F32x8 wv[R];
      for (int r = 0; r < R; r++) wv[r] = dequant8_neon(bytes8_neon<FP8>(q + r * K + k, lanes), zero[r], scale[r], lanes, w);
      for (int t = 0; t < TT; t++) {
        const F32x8 xv = x8_neon(x + t * xs + k, lanes);
        for (int r = 0; r < R; r++) acc[t][r] = fma8_neon(acc[t][r], wv[r], xv);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8_neon(acc[t][r]);
}

template <int TT, int R>
void int8_order_tile_neon(const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables,
                          float* out, int64_t os) {
  F32x8 acc[TT][R];
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = zero8_neon();
  const int64_t K = w.in_features;
  const uint8_t* q = byte_row(w, n);
  for (int64_t k = 0; k < K; k += 8) {
    const int lanes = int(std::min<int64_t>(8, K - k));
    int32_t g[8] = {};
    for (int l = 0; l < lanes; l++) g[l] = g_idx_at(w, k + l);
    F32x8 wv[R];
    for (int r = 0; r < R; r++) {  // no gather: the 8 columns' scales and zero points through the stack
      const float* scales = tables + 2 * r * w.scale_cols;
      float s[8] = {}, z[8] = {};
      for (int l = 0; l < lanes; l++) s[l] = scales[g[l]], z[l] = scales[w.scale_cols + g[l]];
      wv[r] = dequant8_neon(bytes8_neon<false>(q + r * K + k, lanes), load8_neon(z), load8_neon(s), lanes, w);
    }
    for (int t = 0; t < TT; t++) {
      const F32x8 xv = x8_neon(x + t * xs + k, lanes);
      for (int r = 0; r < R; r++) acc[t][r] = fma8_neon(acc[t][r], wv[r], xv);
    }
  }
  for (int t = 0; t < TT; t++)
    for (int r = 0; r < R; r++) out[t * os + r] = hsum8_neon(acc[t][r]);
}
#endif  // KVLITE_CPU_NEON

// ---- dispatch -----------------------------------------------------------------------------------------------
// One tile of TT tokens x R rows on `isa` (resolved: portable, avx2 or avx512; the backend checked the CPU).
template <int TT, int R, class W>
void dense_tile(CpuIsa isa, const float* x, int64_t xs, const W* w, int64_t ws, int64_t k_size, float* out,
                int64_t os) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return dense_tile_avx512<TT, R>(x, xs, w, ws, k_size, out, os);
  if (isa == CpuIsa::avx2) return dense_tile_avx2<TT, R>(x, xs, w, ws, k_size, out, os);
#endif
#if KVLITE_CPU_NEON
  if (isa == CpuIsa::neon) return dense_tile_neon<TT, R>(x, xs, w, ws, k_size, out, os);
#endif
  (void)isa;
  dense_tile_portable<TT, R>(x, xs, w, ws, k_size, out, os);
}
template <int TT, int R>
void int4_tile(CpuIsa isa, const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables,
               float* out, int64_t os) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return int4_tile_avx512<TT, R>(x, xs, w, n, tables, out, os);
  if (isa == CpuIsa::avx2) return int4_tile_avx2<TT, R>(x, xs, w, n, tables, out, os);
#endif
#if KVLITE_CPU_NEON
  if (isa == CpuIsa::neon) return int4_tile_neon<TT, R>(x, xs, w, n, tables, out, os);
#endif
  (void)isa;
  int4_tile_portable<TT, R>(x, xs, w, n, tables, out, os);
}
template <int TT, int R, bool FP8>
void bytes_tile(CpuIsa isa, const float* x, int64_t xs, const QuantWeight& w, int64_t n, float* out, int64_t os) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return bytes_tile_avx512<TT, R, FP8>(x, xs, w, n, out, os);
  if (isa == CpuIsa::avx2) return bytes_tile_avx2<TT, R, FP8>(x, xs, w, n, out, os);
#endif
#if KVLITE_CPU_NEON
  if (isa == CpuIsa::neon) return bytes_tile_neon<TT, R, FP8>(x, xs, w, n, out, os);
#endif
  (void)isa;
  bytes_tile_portable<TT, R, FP8>(x, xs, w, n, out, os);
}
template <int TT, int R>
void int8_order_tile(CpuIsa isa, const float* x, int64_t xs, const QuantWeight& w, int64_t n, const float* tables,
                     float* out, int64_t os) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return int8_order_tile_avx512<TT, R>(x, xs, w, n, tables, out, os);
  if (isa == CpuIsa::avx2) return int8_order_tile_avx2<TT, R>(x, xs, w, n, tables, out, os);
#endif
#if KVLITE_CPU_NEON
  if (isa == CpuIsa::neon) return int8_order_tile_neon<TT, R>(x, xs, w, n, tables, out, os);
#endif
  (void)isa;
  int8_order_tile_portable<TT, R>(x, xs, w, n, tables, out, os);
}
inline void int4_tables(CpuIsa isa, const QuantWeight& w, int64_t n0, int64_t rows, float* tables) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return int4_tables_avx512(w, n0, rows, tables);
  if (isa == CpuIsa::avx2) return int4_tables_avx2(w, n0, rows, tables);
#endif
  (void)isa;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < w.scale_cols; g++) int4_table(w, n0 + r, g, tables + (r * w.scale_cols + g) * 16);
}

// Calls tile.template run<TT, R>(t, n) over tokens [0, tokens) x rows [n0, n1): R-row tiles, then single rows;
// token tiles of kTokens, then the remainder as one smaller tile. Every element's sum is the same whatever
// tile computes it.
template <int R, class Tile>
void for_each_tile(int64_t tokens, int64_t n0, int64_t n1, Tile& tile) {
  for (int64_t t = 0; t < tokens; t += kTokens) {
    const int64_t tt = std::min<int64_t>(kTokens, tokens - t);
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
      switch (tt) {
        case 4: tile.template run<4, R>(t, n); break;
        case 3: tile.template run<3, R>(t, n); break;
        case 2: tile.template run<2, R>(t, n); break;
        default: tile.template run<1, R>(t, n); break;
      }
    }
    for (; n < n1; n++) {
      switch (tt) {
        case 4: tile.template run<4, 1>(t, n); break;
        case 3: tile.template run<3, 1>(t, n); break;
        case 2: tile.template run<2, 1>(t, n); break;
        default: tile.template run<1, 1>(t, n); break;
      }
    }
  }
}

// for_each_tile<R>, or single rows when there are fewer tokens than a token tile: a decode step's GEMV is a stream
// from memory, and one row at a time streams it fastest (on Zen 4 one BF16 row at a time read 23 GB/s, four
// rows' interleaved streams 11; bench/RESULTS.md, fifteenth session); with a full token tile the multiply-adds count more.
template <int R, class Tile>
void for_each_tile_by_tokens(int64_t tokens, int64_t n0, int64_t n1, Tile& tile) {
  if (tokens < kTokens) for_each_tile<1>(tokens, n0, n1, tile);
  else for_each_tile<R>(tokens, n0, n1, tile);
}

// out[t, n] = x[t] . weight[n] (+ bias[n]) for every token, rows [n0, n1): F32 activations and output.
template <class W>
struct DenseTile {
  CpuIsa isa;
  const Tensor& x;
  const Tensor& weight;
  const Tensor& out;
  template <int TT, int R>
  void run(int64_t t, int64_t n) {
    dense_tile<TT, R>(isa, row_of<const float>(x, t), x.row_stride, row_of<const W>(weight, n), weight.row_stride,
                      x.cols, row_of<float>(out, t) + n, out.row_stride);
  }
};
inline void dense_linear_rows(CpuIsa isa, const Tensor& x, const Tensor& weight, const Tensor& bias,
                              const Tensor& out, int64_t n0, int64_t n1) {
  with_float_type(weight.dtype, [&](auto tag) {
    using W = decltype(tag);
    DenseTile<W> tile{isa, x, weight, out};
    // NEON's sums are two registers each: 2-row tiles keep 16 of them and the operands in its 32
    if (isa == CpuIsa::neon) for_each_tile_by_tokens<2>(x.rows, n0, n1, tile);
    else for_each_tile_by_tokens<4>(x.rows, n0, n1, tile);
  });
  if (bias.data != nullptr)  // after the dot product, as the reference adds it
    for (int64_t t = 0; t < x.rows; t++)
      for (int64_t n = n0; n < n1; n++) row_of<float>(out, t)[n] += float_at(bias, n);
}

// out[t * out_stride + n] = x[t] . dequantized row n (+ bias) for tokens [0, tokens), rows [n0, n1).
// The block's group tables are made once (int4_table_floats(weight, n1 - n0) floats of `tables`) and read by
// every token tile.
struct Int4Tile {
  CpuIsa isa;
  const float* x;
  int64_t x_stride;
  const QuantWeight& weight;
  int64_t n0;
  const float* tables;
  float* out;
  int64_t out_stride;
  template <int TT, int R>
  void run(int64_t t, int64_t n) {
    int4_tile<TT, R>(isa, x + t * x_stride, x_stride, weight, n, tables + (n - n0) * weight.scale_cols * 16,
                     out + t * out_stride + n, out_stride);
  }
};
inline void int4_linear_rows(CpuIsa isa, const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& weight,
                             float* out, int64_t out_stride, int64_t n0, int64_t n1, float* tables) {
  int4_tables(isa, weight, n0, n1 - n0, tables);
  Int4Tile tile{isa, x, x_stride, weight, n0, tables, out, out_stride};
  // AVX2 holds each row's table in two registers: 2-row tiles keep tables, weights and sums in its 16; NEON's
  // table is four registers and its sums two each: 1-row tiles (8 sums, the table, a word's weights)
  if (isa == CpuIsa::avx2) for_each_tile_by_tokens<2>(tokens, n0, n1, tile);
  else if (isa == CpuIsa::neon) for_each_tile_by_tokens<1>(tokens, n0, n1, tile);
  else for_each_tile_by_tokens<4>(tokens, n0, n1, tile);
  if (weight.bias != nullptr)
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t n = n0; n < n1; n++) out[t * out_stride + n] += scale_at(weight.bias, weight.bias_dtype, n);
}

// out[t * out_stride + n] = x[t] . dequantized row n (+ bias) for tokens [0, tokens), rows [n0, n1) of an int8
// or fp8 weight (bytes_supported). Act-order int8 first makes the block's tables (bytes_table_floats(weight,
// n1 - n0) floats of `tables`); the others use no scratch.
template <bool FP8>
struct BytesTile {
  CpuIsa isa;
  const float* x;
  int64_t x_stride;
  const QuantWeight& weight;
  float* out;
  int64_t out_stride;
  template <int TT, int R>
  void run(int64_t t, int64_t n) {
    bytes_tile<TT, R, FP8>(isa, x + t * x_stride, x_stride, weight, n, out + t * out_stride + n, out_stride);
  }
};
struct Int8OrderTile {
  CpuIsa isa;
  const float* x;
  int64_t x_stride;
  const QuantWeight& weight;
  int64_t n0;
  const float* tables;
  float* out;
  int64_t out_stride;
  template <int TT, int R>
  void run(int64_t t, int64_t n) {
    int8_order_tile<TT, R>(isa, x + t * x_stride, x_stride, weight, n, tables + (n - n0) * 2 * weight.scale_cols,
                           out + t * out_stride + n, out_stride);
  }
};
inline void bytes_linear_rows(CpuIsa isa, const float* x, int64_t x_stride, int64_t tokens, const QuantWeight& weight,
                              float* out, int64_t out_stride, int64_t n0, int64_t n1, float* tables) {
  // AVX2 has 16 registers: 2-row tiles keep weights, scales, zero points and sums in them; NEON's sums are two
  // registers each, so it takes 2-row tiles too
  if (weight.format == WeightFormat::int8 && weight.g_idx) {
    int8_order_tables(weight, n0, n1 - n0, tables);
    Int8OrderTile tile{isa, x, x_stride, weight, n0, tables, out, out_stride};
    if (isa == CpuIsa::avx2 || isa == CpuIsa::neon) for_each_tile_by_tokens<2>(tokens, n0, n1, tile);
    else for_each_tile_by_tokens<4>(tokens, n0, n1, tile);
  } else if (weight.format == WeightFormat::int8) {
    BytesTile<false> tile{isa, x, x_stride, weight, out, out_stride};
    if (isa == CpuIsa::avx2 || isa == CpuIsa::neon) for_each_tile_by_tokens<2>(tokens, n0, n1, tile);
    else for_each_tile_by_tokens<4>(tokens, n0, n1, tile);
  } else {
    BytesTile<true> tile{isa, x, x_stride, weight, out, out_stride};
    if (isa == CpuIsa::avx2 || isa == CpuIsa::neon) for_each_tile_by_tokens<2>(tokens, n0, n1, tile);
    else for_each_tile_by_tokens<4>(tokens, n0, n1, tile);
  }
  if (weight.bias != nullptr)  // after the dot product, as the reference adds it
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t n = n0; n < n1; n++) out[t * out_stride + n] += scale_at(weight.bias, weight.bias_dtype, n);
}

}  // namespace cpu_fast
}  // namespace detail
}  // namespace kvlite
