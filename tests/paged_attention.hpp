// paged_attention: a CPU backend attention test's fixture (KV pages poisoned with NaN, shuffled block tables,
// several sequences), the step it runs and the naive double-precision attention it is checked against. Shared by
// cpu-ops: (the reference loop against the formula) and cpu-fast: (the fast kernels' attention against it).
#pragma once
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "host_floats.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace paged_attention {
using namespace kvlite;
using namespace host_floats;

// One attention configuration with its own KV pages (every layer, poisoned with NaN), some sequences and
// their K/V (the values as stored, i.e. rounded to the KV dtype) kept contiguously for the reference.
struct PagedFixture {
  int64_t heads, kv_heads, head_dim, page_tokens, layer = 1;
  DType kv_dtype;
  KVPageLayout layout;
  int64_t num_pages;
  std::vector<uint8_t> pages;
  std::vector<std::vector<int32_t>> tables;  // per sequence, its pages (shuffled, not contiguous)
  int64_t max_pages_per_seq;

  PagedFixture(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, int64_t page_tokens_, DType kv_dtype_,
               const std::vector<int64_t>& contexts, Random& rng)
      : heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), page_tokens(page_tokens_), kv_dtype(kv_dtype_) {
    layout = KVPageLayout{2, page_tokens, kv_heads, head_dim};
    max_pages_per_seq = 0;
    int64_t needed = 0;
    for (int64_t c : contexts) {
      needed += int64_t(ceil_div(uint64_t(c), uint64_t(page_tokens)));
      max_pages_per_seq = std::max<int64_t>(max_pages_per_seq, int64_t(ceil_div(uint64_t(c), uint64_t(page_tokens))));
    }
    num_pages = needed + 3;  // spare pages nobody owns
    pages.resize(size_t(num_pages * layout.page_elements()) * dtype_bytes(kv_dtype, 1));
    for (size_t i = 0; i < pages.size(); i += dtype_bytes(kv_dtype, 1)) encode(kv_dtype, NAN, &pages[i]);
    std::vector<int32_t> ids(static_cast<size_t>(num_pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng.engine);
    size_t next = 0;
    for (int64_t c : contexts) {
      std::vector<int32_t> table;
      for (int64_t p = 0; p < int64_t(ceil_div(uint64_t(c), uint64_t(page_tokens))); p++) table.push_back(ids[next++]);
      tables.push_back(table);
    }
  }
  KVCacheView cache() { return KVCacheView{pages.data(), kv_dtype, layout, num_pages}; }
  int32_t slot(size_t seq, int64_t position) const {
    return int32_t(tables[seq][size_t(position / page_tokens)] * page_tokens + position % page_tokens);
  }
  // Block tables [seqs, max_pages_per_seq] for the listed sequences, -1 past each one's pages.
  std::vector<int32_t> block_tables(const std::vector<size_t>& seqs) const {
    std::vector<int32_t> rows(seqs.size() * size_t(max_pages_per_seq), -1);
    for (size_t i = 0; i < seqs.size(); i++)
      std::copy(tables[seqs[i]].begin(), tables[seqs[i]].end(), rows.begin() + long(i * size_t(max_pages_per_seq)));
    return rows;
  }
};

// One step of attention: several sequences, each with its run of query tokens at the end of its context.
struct Step {
  std::vector<size_t> seqs;        // fixture sequence per batch entry
  std::vector<int64_t> first;      // first query position per entry
  std::vector<int64_t> count;      // query tokens per entry
  int64_t tokens() const { return std::accumulate(count.begin(), count.end(), int64_t(0)); }
};

// Writes the step's K/V (rows taken from the sequences' full K/V) and runs attention; returns the output.
Matrix run_step(Backend& backend, PagedFixture& fx, const Step& step, const std::vector<Matrix>& q_all,
                const std::vector<Matrix>& k_all, const std::vector<Matrix>& v_all,
                const AttentionOptions& options = {}) {
  const int64_t tokens = step.tokens(), width = fx.kv_heads * fx.head_dim, q_width = fx.heads * fx.head_dim;
  Matrix q(DType::F32, tokens, q_width, 2), k(DType::F32, tokens, width, 1), v(DType::F32, tokens, width, 3);
  std::vector<int32_t> slots, starts = {0}, contexts;
  int64_t row = 0;
  for (size_t e = 0; e < step.seqs.size(); e++) {
    size_t s = step.seqs[e];
    for (int64_t j = 0; j < step.count[e]; j++, row++) {
      int64_t position = step.first[e] + j;
      for (int64_t c = 0; c < q_width; c++) q.set(row, c, q_all[s].get(position, c));
      for (int64_t c = 0; c < width; c++) {
        k.set(row, c, k_all[s].get(position, c));
        v.set(row, c, v_all[s].get(position, c));
      }
      slots.push_back(fx.slot(s, position));
    }
    starts.push_back(int32_t(row));
    contexts.push_back(int32_t(step.first[e] + step.count[e]));
  }
  REQUIRE(backend.kv_write(fx.cache(), fx.layer, k.view(), v.view(), Tensor::vector(slots.data(), DType::I32, tokens)).ok());
  std::vector<int32_t> tables = fx.block_tables(step.seqs);
  AttentionBatch batch;
  batch.query_starts = Tensor::vector(starts.data(), DType::I32, int64_t(starts.size()));
  batch.context_lens = Tensor::vector(contexts.data(), DType::I32, int64_t(contexts.size()));
  batch.block_tables = Tensor::matrix(tables.data(), DType::I32, int64_t(step.seqs.size()), fx.max_pages_per_seq);
  batch.max_context = *std::max_element(contexts.begin(), contexts.end());
  Matrix out(DType::F32, tokens, q_width, 1);
  REQUIRE(backend.attention(q.view(), fx.cache(), fx.layer, batch, 1.0f / std::sqrt(float(fx.head_dim)), out.view(),
                            options).ok());
  CHECK(out.padding_untouched());
  return out;
}

// K or V as the cache stores it: each value rounded to the KV dtype.
Matrix as_stored(const PagedFixture& fx, const Matrix& m) {
  Matrix rounded(DType::F32, m.rows, m.cols);
  uint8_t bytes[4];
  for (int64_t r = 0; r < m.rows; r++)
    for (int64_t c = 0; c < m.cols; c++) {
      encode(fx.kv_dtype, m.get(r, c), bytes);
      rounded.set(r, c, decode(fx.kv_dtype, bytes));
    }
  return rounded;
}

// Naive attention in double for one sequence's query at `position`: a full softmax over cache tokens
// 0..position of the stored K/V (see as_stored), GQA head h -> KV head h / (heads / kv_heads); with a sliding
// window only the last `window` of them (kv_idx > q_idx - window), with a soft cap s = tanh(s / cap) cap.
std::vector<double> reference_attention(const PagedFixture& fx, const Matrix& q, const Matrix& stored_k,
                                        const Matrix& stored_v, int64_t position, int64_t window = 0,
                                        double cap = 0) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  const int64_t group = fx.heads / fx.kv_heads;
  const double scale = double(1.0f / std::sqrt(float(fx.head_dim)));
  std::vector<double> out(size_t(fx.heads * fx.head_dim), 0.0), scores(size_t(position + 1));
  for (int64_t h = 0; h < fx.heads; h++) {
    const int64_t kv = h / group;
    double max_score = -INFINITY, total = 0;
    for (int64_t c = first; c <= position; c++) {
      double dot = 0;
      for (int64_t d = 0; d < fx.head_dim; d++)
        dot += double(q.get(position, h * fx.head_dim + d)) * stored_k.get(c, kv * fx.head_dim + d);
      scores[size_t(c)] = cap > 0 ? std::tanh(dot * scale / cap) * cap : dot * scale;
      max_score = std::max(max_score, scores[size_t(c)]);
    }
    for (int64_t c = first; c <= position; c++) total += std::exp(scores[size_t(c)] - max_score);
    for (int64_t c = first; c <= position; c++) {
      double p = std::exp(scores[size_t(c)] - max_score) / total;
      for (int64_t d = 0; d < fx.head_dim; d++) out[size_t(h * fx.head_dim + d)] += p * stored_v.get(c, kv * fx.head_dim + d);
    }
  }
  return out;
}

// Random q, k, v for every position of every sequence; q scaled up so the softmax is peaked, not flat.
void make_qkv(const PagedFixture& fx, const std::vector<int64_t>& contexts, Random& rng, std::vector<Matrix>& q,
              std::vector<Matrix>& k, std::vector<Matrix>& v) {
  for (int64_t c : contexts) {
    q.emplace_back(DType::F32, c, fx.heads * fx.head_dim);
    k.emplace_back(DType::F32, c, fx.kv_heads * fx.head_dim);
    v.emplace_back(DType::F32, c, fx.kv_heads * fx.head_dim);
    q.back().randomize(rng, 3.0f);
    k.back().randomize(rng);
    v.back().randomize(rng);
  }
}


}  // namespace paged_attention
