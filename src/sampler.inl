// sampler: implementation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kvlite {

Status validate(const SamplingParams& p) {
  return detail::guard([&] {
    auto bad = [](const std::string& what) { detail::fail(ErrorCode::invalid_argument, what); };
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
      bad(detail::format("temperature must be >= 0 (0 = greedy), got %g", p.temperature));
    if (p.top_k < 0) bad(detail::format("top_k must be >= 0 (0 = off), got %lld", (long long)p.top_k));
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) bad(detail::format("top_p must be in (0, 1], got %g", p.top_p));
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) bad(detail::format("min_p must be in [0, 1], got %g", p.min_p));
    if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
      bad(detail::format("repetition_penalty must be > 0 (1 = off), got %g", p.repetition_penalty));
    if (p.max_tokens <= 0 || p.max_tokens > limits::max_new_tokens)
      bad(detail::format("max_tokens must be in 1..%lld (KVLITE_MAX_NEW_TOKENS; generation also ends when the "
                         "context is full), got %lld", (long long)limits::max_new_tokens, (long long)p.max_tokens));
    if (int64_t(p.stop_tokens.size()) > limits::max_stop_entries ||
        int64_t(p.stop_strings.size()) > limits::max_stop_entries)
      bad(detail::format("%zu stop tokens and %zu stop strings; at most %lld each (KVLITE_MAX_STOP_ENTRIES)",
                         p.stop_tokens.size(), p.stop_strings.size(), (long long)limits::max_stop_entries));
    if (!p.grammar.empty() && !p.json_schema.empty())
      bad("grammar and json_schema are both set; a request takes one constraint");
    if (int64_t(p.grammar.size()) > limits::max_grammar_bytes)
      bad(detail::format("a grammar of %zu bytes; at most %lld (KVLITE_MAX_GRAMMAR_BYTES)", p.grammar.size(),
                         (long long)limits::max_grammar_bytes));
    if (int64_t(p.json_schema.size()) > limits::max_schema_bytes)
      bad(detail::format("a json_schema of %zu bytes; at most %lld (KVLITE_MAX_SCHEMA_BYTES)", p.json_schema.size(),
                         (long long)limits::max_schema_bytes));
    for (const auto& s : p.stop_strings) {
      if (s.empty()) bad("stop strings must not be empty");
      if (int64_t(s.size()) > limits::max_stop_string_bytes)
        bad(detail::format("a stop string of %zu bytes; at most %lld (KVLITE_MAX_STOP_STRING_BYTES)", s.size(),
                           (long long)limits::max_stop_string_bytes));
    }
  });
}

// ---- Rng: xoshiro256** (Blackman and Vigna), state seeded by splitmix64 ----------------------------------
Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (auto& s : state_) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    s = z ^ (z >> 31);
  }
}
uint64_t Rng::next_u64() {
  auto rotl = [](uint64_t v, int k) { return (v << k) | (v >> (64 - k)); };
  uint64_t result = rotl(state_[1] * 5, 7) * 9, t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}
float Rng::next_float() { return float(next_u64() >> 40) * (1.0f / 16777216.0f); }

int32_t argmax(const float* values, int64_t count) {
  int64_t best = 0;
  for (int64_t i = 1; i < count; i++)
    if (values[i] > values[best]) best = i;
  return int32_t(best);
}

double token_logprob(const float* logits, int64_t vocab, int32_t token) {
  double max_logit = logits[argmax(logits, vocab)], sum = 0.0;
  for (int64_t i = 0; i < vocab; i++) sum += std::exp(double(logits[i]) - max_logit);
  return double(logits[token]) - max_logit - std::log(sum);
}

namespace detail {
// The distribution sample_token draws from, in transformers' order: repetition penalty on the logits (positive
// logits divided, negative multiplied, once per distinct previous token), temperature, top-k, top-p (smallest set
// of most likely tokens whose probability reaches top_p, at least one), min-p (drop tokens below min_p x the top
// probability). Greedy (temperature 0): returns 0 and the argmax is the token (the logits are penalized). Else the
// candidates are order[0, returned) with their (unnormalized) probabilities at probs[order[i]].
int64_t sampling_distribution(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                              int64_t history_len, float* prob_scratch, int32_t* index_scratch) {
  // Repetition penalty (CTRL, as transformers' RepetitionPenaltyLogitsProcessor): once per distinct token.
  if (params.repetition_penalty != 1.0f) {
    float* seen = prob_scratch;  // marks tokens already penalized
    std::fill(seen, seen + vocab, 0.0f);
    for (int64_t i = 0; i < history_len; i++) {
      int32_t t = history[i];
      if (t < 0 || t >= vocab || seen[t] == 1.0f) continue;
      seen[t] = 1.0f;
      logits[t] = logits[t] > 0 ? logits[t] / params.repetition_penalty : logits[t] * params.repetition_penalty;
    }
  }
  if (params.temperature == 0.0f) return 0;

  // Temperature, then probabilities in scratch[0, vocab), candidate ids sorted by probability.
  float* probs = prob_scratch;
  int32_t* order = index_scratch;
  float max_logit = logits[argmax(logits, vocab)];
  for (int64_t i = 0; i < vocab; i++) probs[i] = (logits[i] - max_logit) / params.temperature;
  int64_t candidates = vocab;
  for (int64_t i = 0; i < vocab; i++) order[i] = int32_t(i);
  auto by_probability = [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
  if (params.top_k > 0 && params.top_k < vocab) {
    std::partial_sort(order, order + params.top_k, order + vocab, by_probability);
    candidates = params.top_k;
  } else {
    std::sort(order, order + vocab, by_probability);
  }
  // Softmax over the candidates (the rest have probability 0).
  double sum = 0.0;
  for (int64_t i = 0; i < candidates; i++) sum += std::exp(double(probs[order[i]]));
  for (int64_t i = 0; i < candidates; i++) probs[order[i]] = float(std::exp(double(probs[order[i]])) / sum);
  if (params.top_p < 1.0f) {
    double cumulative = 0.0;
    int64_t keep = 0;
    while (keep < candidates) {
      cumulative += probs[order[keep]];
      keep++;
      if (cumulative >= double(params.top_p)) break;
    }
    candidates = keep;
  }
  if (params.min_p > 0.0f) {
    float threshold = params.min_p * probs[order[0]];
    int64_t keep = 1;
    while (keep < candidates && probs[order[keep]] >= threshold) keep++;
    candidates = keep;
  }
  return candidates;
}

// One draw from candidates order[0, candidates) weighted by probs[], skipping `excluded` (-1: none).
int32_t draw_candidate(const float* probs, const int32_t* order, int64_t candidates, int32_t excluded, Rng& rng) {
  double total = 0.0;
  for (int64_t i = 0; i < candidates; i++)
    if (order[i] != excluded) total += probs[order[i]];
  double draw = double(rng.next_float()) * total, running = 0.0;
  int32_t last = -1;
  for (int64_t i = 0; i < candidates; i++) {
    if (order[i] == excluded) continue;
    running += probs[order[i]];
    last = order[i];
    if (draw < running) return order[i];
  }
  return last;
}
}  // namespace detail

int32_t sample_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                     int64_t history_len, Rng& rng, float* prob_scratch, int32_t* index_scratch) {
  const int64_t candidates =
      detail::sampling_distribution(logits, vocab, params, history, history_len, prob_scratch, index_scratch);
  if (params.temperature == 0.0f) return argmax(logits, vocab);
  return detail::draw_candidate(prob_scratch, index_scratch, candidates, -1, rng);
}

DraftVerdict verify_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                                int64_t history_len, int32_t draft, Rng& rng, float* prob_scratch,
                                int32_t* index_scratch) {
  return verify_draft_token(logits, vocab, params, history, history_len, draft, nullptr, rng, prob_scratch,
                            index_scratch);
}

int32_t sample_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                           int64_t history_len, Rng& rng, float* draft_probs, float* prob_scratch,
                           int32_t* index_scratch) {
  const int64_t candidates =
      detail::sampling_distribution(logits, vocab, params, history, history_len, prob_scratch, index_scratch);
  if (params.temperature == 0.0f) return argmax(logits, vocab);
  double total = 0.0;
  for (int64_t i = 0; i < candidates; i++) total += prob_scratch[index_scratch[i]];
  std::fill(draft_probs, draft_probs + vocab, 0.0f);
  for (int64_t i = 0; i < candidates; i++)
    draft_probs[index_scratch[i]] = float(double(prob_scratch[index_scratch[i]]) / total);
  return detail::draw_candidate(prob_scratch, index_scratch, candidates, -1, rng);
}

DraftVerdict verify_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                                int64_t history_len, int32_t draft, const float* draft_probs, Rng& rng,
                                float* prob_scratch, int32_t* index_scratch) {
  const int64_t candidates =
      detail::sampling_distribution(logits, vocab, params, history, history_len, prob_scratch, index_scratch);
  DraftVerdict verdict;
  if (params.temperature == 0.0f) {
    verdict.token = argmax(logits, vocab);
    verdict.accepted = verdict.token == draft;
    return verdict;
  }
  // p(draft) under the processed distribution (0 when top-k / top-p / min-p dropped it).
  double total = 0.0, p_draft = 0.0;  // (the draft's probability added last)
  for (int64_t i = 0; i < candidates; i++) {
    if (index_scratch[i] == draft) p_draft = prob_scratch[draft];
    else total += prob_scratch[index_scratch[i]];
  }
  total += p_draft;
  if (draft_probs) {
    // Accept with probability min(1, p(draft) / q(draft)) (q(draft) > 0: the draft model drew it from q) ...
    const double q_draft = draft >= 0 && draft < vocab ? double(draft_probs[draft]) : 0.0;
    if (p_draft > 0.0 && double(rng.next_float()) * q_draft * total < p_draft) {
      verdict.token = draft;
      verdict.accepted = true;
      return verdict;
    }
    // ... else draw from max(0, p - q), normalized. The residual's weights go into prob_scratch over p's
    // candidates (a token outside them has p = 0, so no residual); where the residual is empty (p <= q
    // everywhere, which rejection makes impossible in exact arithmetic) the token is drawn from p.
    double residual = 0.0;
    for (int64_t i = 0; i < candidates; i++) {
      const int32_t t = index_scratch[i];
      residual += std::max(0.0, double(prob_scratch[t]) / total - double(draft_probs[t]));
    }
    if (residual > 0.0) {
      for (int64_t i = 0; i < candidates; i++) {
        const int32_t t = index_scratch[i];
        prob_scratch[t] = float(std::max(0.0, double(prob_scratch[t]) / total - double(draft_probs[t])));
      }
    }
    verdict.token = detail::draw_candidate(prob_scratch, index_scratch, candidates, -1, rng);
    return verdict;
  }
  // Accept with probability p(draft) / total (the draft proposed it with certainty: q(draft) = 1) ...
  if (p_draft > 0.0 && double(rng.next_float()) * total < p_draft) {
    verdict.token = draft;
    verdict.accepted = true;
    return verdict;
  }
  // ... else draw from max(0, p - q), normalized: p without the draft.
  verdict.token = detail::draw_candidate(prob_scratch, index_scratch, candidates, p_draft > 0.0 ? draft : -1, rng);
  if (verdict.token < 0) verdict.token = draft;  // the draft was the only candidate (accepted above; unreachable)
  return verdict;
}

int64_t propose_ngram_draft(const int32_t* history, int64_t history_len, int64_t max_ngram, int64_t max_tokens,
                            int32_t* draft) {
  if (history_len < 2 || max_ngram < 1 || max_tokens < 1) return 0;
  // Longest n first; for each n, the latest earlier occurrence of the last n tokens with a whole continuation
  // (max_tokens tokens before the history ends), else the one with the longest (a run of one token, whose latest
  // occurrences overlap the suffix, drafts more of it this way).
  for (int64_t n = std::min(max_ngram, history_len - 1); n >= 1; n--) {
    const int32_t* suffix = history + history_len - n;
    int64_t best_from = -1, best_count = 0;
    for (int64_t start = history_len - n - 1; start >= 0 && best_count < max_tokens; start--) {
      if (!std::equal(suffix, suffix + n, history + start)) continue;
      const int64_t from = start + n;  // the continuation: tokens after the match
      const int64_t count = std::min(max_tokens, history_len - from);
      if (count > best_count) best_from = from, best_count = count;
    }
    if (best_count > 0) {
      std::copy(history + best_from, history + best_from + best_count, draft);
      return best_count;
    }
  }
  return 0;
}

Result<std::vector<ScoreWindow>> score_windows(int64_t num_tokens, int64_t context, int64_t stride) {
  return detail::guard([&] {
    if (context < 2) detail::fail(ErrorCode::invalid_argument, detail::format("context length must be >= 2, got %lld", (long long)context));
    if (stride < 1 || stride > context)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("stride must be in 1..context length (%lld), got %lld", (long long)context, (long long)stride));
    if (num_tokens < 2)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("scoring needs at least 2 tokens, the text has %lld", (long long)num_tokens));
    std::vector<ScoreWindow> windows;
    int64_t prev_end = 0;
    for (int64_t begin = 0; begin < num_tokens; begin += stride) {
      int64_t end = std::min(begin + context, num_tokens);
      // The guide labels [prev_end, end); the first token of the text has nothing before it.
      windows.push_back({begin, end, std::max(prev_end, begin + 1)});
      prev_end = end;
      if (end == num_tokens) break;
    }
    return windows;
  });
}

}  // namespace kvlite
