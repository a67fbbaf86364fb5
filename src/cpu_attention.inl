// cpu_attention: the fast kernels' paged attention (CpuKernels fast and fast_lowp), beside the reference loop in
// backend_cpu.inl (impl_attention), which stays the truth it is tested against (tests/unit-cpu-fast.cpp).
//
// What is different from the reference. The reference takes one cached token at a time: it widens its key and
// value, and for each query head of the group takes a dot product, rescales the running sum when the maximum
// grows and adds p v, in scalar loops. Here the keys come in blocks of up to kAttentionKeyBlock tokens of one
// page (a page's tokens for one KV head are rows kv_heads x head_dim apart, read in place, any of the float
// KV dtypes): the block's scores for every head of the pass are one small dense GEMM (cpu_fast::dense_tile, the
// Linear kernels: keys as the weight's rows), the online softmax rescales once a block, and p V is a SIMD
// accumulation over the block's value rows. Every output still comes from one thread in a fixed order (the
// blocks start at the same cache positions whatever the batch), so results do not depend on the thread count,
// and a token's output is the same in a prefill chunk as in a decode step; they differ from the reference by
// float rounding only. fp8 KV and 16-bit activations keep the reference.
namespace kvlite {
namespace detail {
namespace cpu_fast {

constexpr int64_t kAttentionKeyBlock = 32;  // keys scored at once (the scores: heads per pass x this, on the stack)
constexpr int64_t kAttentionMaxHeads = 8;   // query heads an item takes at most (the backend's heads per pass)

// ---- p V: acc[0, d) += sum over j in [0, n) of p[j] v[j vs + (0, d)], each lane summed over j in order -----
template <class W>
void accumulate_rows_portable(const float* p, const W* v, int64_t vs, int64_t n, int64_t d, float* acc) {
  for (int64_t j = 0; j < n; j++)
    for (int64_t i = 0; i < d; i++) acc[i] += p[j] * to_float(v[j * vs + i]);
}
#if KVLITE_CPU_X86_SIMD
template <class W>
KVLITE_TARGET_AVX2 void accumulate_rows_avx2(const float* p, const W* v, int64_t vs, int64_t n, int64_t d, float* acc) {
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {  // four independent chains hide the FMA's latency
    __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8), a2 = _mm256_loadu_ps(acc + i + 16),
           a3 = _mm256_loadu_ps(acc + i + 24);
    for (int64_t j = 0; j < n; j++) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const W* row = v + j * vs + i;
      a0 = _mm256_fmadd_ps(pj, load8(row), a0);
      a1 = _mm256_fmadd_ps(pj, load8(row + 8), a1);
      a2 = _mm256_fmadd_ps(pj, load8(row + 16), a2);
      a3 = _mm256_fmadd_ps(pj, load8(row + 24), a3);
    }
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
    _mm256_storeu_ps(acc + i + 16, a2);
    _mm256_storeu_ps(acc + i + 24, a3);
  }
  for (; i + 8 <= d; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i);
    for (int64_t j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v + j * vs + i), a);
    _mm256_storeu_ps(acc + i, a);
  }
  for (; i < d; i++)  // the tail, in the same order over j
    for (int64_t j = 0; j < n; j++) acc[i] = std::fma(p[j], to_float(v[j * vs + i]), acc[i]);
}
template <class W>
KVLITE_TARGET_AVX512 void accumulate_rows_avx512(const float* p, const W* v, int64_t vs, int64_t n, int64_t d,
                                                 float* acc) {
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + i), a1 = _mm512_loadu_ps(acc + i + 16), a2 = _mm512_loadu_ps(acc + i + 32),
           a3 = _mm512_loadu_ps(acc + i + 48);
    for (int64_t j = 0; j < n; j++) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      const W* row = v + j * vs + i;
      a0 = _mm512_fmadd_ps(pj, load16(row, kAll16), a0);
      a1 = _mm512_fmadd_ps(pj, load16(row + 16, kAll16), a1);
      a2 = _mm512_fmadd_ps(pj, load16(row + 32, kAll16), a2);
      a3 = _mm512_fmadd_ps(pj, load16(row + 48, kAll16), a3);
    }
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
    _mm512_storeu_ps(acc + i + 32, a2);
    _mm512_storeu_ps(acc + i + 48, a3);
  }
  for (; i < d; i += 16) {  // masked: reads and writes nothing past d
    const __mmask16 m = lane_mask16(d - i);
    __m512 a = _mm512_maskz_loadu_ps(m, acc + i);
    for (int64_t j = 0; j < n; j++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load16(v + j * vs + i, m), a);
    _mm512_mask_storeu_ps(acc + i, m, a);
  }
}
#endif
#if KVLITE_CPU_NEON
template <class W>
void accumulate_rows_neon(const float* p, const W* v, int64_t vs, int64_t n, int64_t d, float* acc) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    F32x8 a0 = load8_neon(acc + i), a1 = load8_neon(acc + i + 8);
    for (int64_t j = 0; j < n; j++) {
      const F32x8 pj = splat8_neon(p[j]);
      a0 = fma8_neon(a0, pj, load8_neon(v + j * vs + i));
      a1 = fma8_neon(a1, pj, load8_neon(v + j * vs + i + 8));
    }
    vst1q_f32(acc + i, a0.lo), vst1q_f32(acc + i + 4, a0.hi), vst1q_f32(acc + i + 8, a1.lo), vst1q_f32(acc + i + 12, a1.hi);
  }
  for (; i + 8 <= d; i += 8) {
    F32x8 a = load8_neon(acc + i);
    for (int64_t j = 0; j < n; j++) a = fma8_neon(a, splat8_neon(p[j]), load8_neon(v + j * vs + i));
    vst1q_f32(acc + i, a.lo), vst1q_f32(acc + i + 4, a.hi);
  }
  for (; i < d; i++)
    for (int64_t j = 0; j < n; j++) acc[i] = std::fma(p[j], to_float(v[j * vs + i]), acc[i]);
}
#endif
template <class W>
void accumulate_rows(CpuIsa isa, const float* p, const W* v, int64_t vs, int64_t n, int64_t d, float* acc) {
#if KVLITE_CPU_X86_SIMD
  if (isa == CpuIsa::avx512) return accumulate_rows_avx512(p, v, vs, n, d, acc);
  if (isa == CpuIsa::avx2) return accumulate_rows_avx2(p, v, vs, n, d, acc);
#endif
#if KVLITE_CPU_NEON
  if (isa == CpuIsa::neon) return accumulate_rows_neon(p, v, vs, n, d, acc);
#endif
  (void)isa;
  accumulate_rows_portable(p, v, vs, n, d, acc);
}

// scores[h * kAttentionKeyBlock + j] = q head h . key row j, for `heads` heads (rows head_dim apart) x n keys
// (rows ks apart): the Linear tiles, heads as tokens and keys as the weight's rows.
template <class W>
struct ScoreTile {
  CpuIsa isa;
  const float* q;
  const W* keys;
  int64_t key_stride, head_dim;
  float* scores;
  template <int TT, int R>
  void run(int64_t h, int64_t j) {
    dense_tile<TT, R>(isa, q + h * head_dim, head_dim, keys + j * key_stride, key_stride, head_dim,
                      scores + h * kAttentionKeyBlock + j, kAttentionKeyBlock);
  }
};

// What one (query token, KV head) item attends over: cache positions [first, last] of one sequence's pages.
struct AttentionSpan {
  const int32_t* pages;  // the sequence's block table row
  int64_t first, last;
};

// One item: `heads` query heads (at most kAttentionMaxHeads) from q on, head_dim floats each, consecutive, which
// all read KV head kv_head, over span; out: the same heads' outputs; acc: heads x acc_stride floats of scratch.
// Per block of keys: s = (q k^T) scale (softcapped: tanh(s / cap) cap); the running maximum m and sum l
// rescaled by exp(m_old - m_new) when the block raises m; l += sum exp(s - m); acc += exp(s - m) v.
template <class E>
void attention_item(CpuIsa isa, const float* q, int64_t heads, const E* cache, const KVPageLayout& layout,
                    int64_t layer, int64_t kv_head, const AttentionSpan& span, float scale, float cap, float* acc,
                    int64_t acc_stride, float* out) {
  const int64_t head_dim = layout.head_dim, key_stride = layout.kv_heads * head_dim;
  float running_max[kAttentionMaxHeads], running_sum[kAttentionMaxHeads];
  float scores[kAttentionMaxHeads * kAttentionKeyBlock], p[kAttentionKeyBlock];
  for (int64_t h = 0; h < heads; h++) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
    std::fill(acc + h * acc_stride, acc + h * acc_stride + head_dim, 0.0f);
  }
  for (int64_t c = span.first; c <= span.last;) {
    const int64_t page = span.pages[c / layout.page_tokens], offset = c % layout.page_tokens;
    const int64_t n = std::min({kAttentionKeyBlock, layout.page_tokens - offset, span.last - c + 1});
    const E* keys = cache + layout.offset(page, layer, 0, offset, kv_head);
    const E* values = cache + layout.offset(page, layer, 1, offset, kv_head);
    ScoreTile<E> tile{isa, q, keys, key_stride, head_dim, scores};
    if (isa == CpuIsa::neon) for_each_tile_by_tokens<2>(heads, 0, n, tile);
    else for_each_tile_by_tokens<4>(heads, 0, n, tile);
    for (int64_t h = 0; h < heads; h++) {
      float* s = scores + h * kAttentionKeyBlock;
      float block_max = -INFINITY;
      for (int64_t j = 0; j < n; j++) {
        s[j] *= scale;
        if (cap > 0.0f) s[j] = std::tanh(s[j] / cap) * cap;
        block_max = std::max(block_max, s[j]);
      }
      float* a = acc + h * acc_stride;
      if (block_max > running_max[h]) {
        const float correction = std::exp(running_max[h] - block_max);  // exp(-inf) = 0 at the start
        running_sum[h] *= correction;
        for (int64_t d = 0; d < head_dim; d++) a[d] *= correction;
        running_max[h] = block_max;
      }
      for (int64_t j = 0; j < n; j++) {
        p[j] = std::exp(s[j] - running_max[h]);
        running_sum[h] += p[j];
      }
      accumulate_rows(isa, p, values, key_stride, n, head_dim, a);
    }
    c += n;
  }
  for (int64_t h = 0; h < heads; h++)  // a query sees at least its own token, so running_sum >= 1
    for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h * acc_stride + d] / running_sum[h];
}

}  // namespace cpu_fast
}  // namespace detail
}  // namespace kvlite
