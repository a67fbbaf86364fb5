// speculative: n-gram (prompt lookup) speculative decoding. The drafter's matching rule; the verification rule
// keeps the target's distribution (a chi-square test over many draws at a stated significance level, with a
// wrong rule as a control that the test rejects); the engine with drafting gives transformers' greedy tokens,
// alone, batched, under preemption and at every limit, and reproducible seeded sampling; the plan shows it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"

using namespace kvlite;
namespace fx = model_fixtures;

namespace {
using engine_helpers::greedy;
using engine_helpers::check_pool_empty;

std::vector<int32_t> draft_of(const std::vector<int32_t>& history, int64_t max_ngram, int64_t max_tokens) {
  std::vector<int32_t> draft(size_t(std::max<int64_t>(max_tokens, 1)));
  const int64_t n = propose_ngram_draft(history.data(), int64_t(history.size()), max_ngram, max_tokens, draft.data());
  draft.resize(size_t(n));
  return draft;
}

// The distribution sample_token draws from, computed here from its definition (transformers' order: repetition
// penalty, temperature, top-k, top-p, min-p), in double.
std::vector<double> target_distribution(const std::vector<float>& logits, const SamplingParams& p,
                                        const std::vector<int32_t>& history) {
  const size_t V = logits.size();
  std::vector<double> z(V);
  for (size_t i = 0; i < V; i++) {
    double l = logits[i];
    if (p.repetition_penalty != 1.0f && std::find(history.begin(), history.end(), int32_t(i)) != history.end())
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    z[i] = l / p.temperature;
  }
  std::vector<size_t> order(V);
  for (size_t i = 0; i < V; i++) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return z[a] > z[b]; });
  size_t keep = p.top_k > 0 ? std::min(V, size_t(p.top_k)) : V;
  double sum = 0;
  for (size_t i = 0; i < keep; i++) sum += std::exp(z[order[i]]);
  std::vector<double> prob(V, 0.0);
  for (size_t i = 0; i < keep; i++) prob[order[i]] = std::exp(z[order[i]]) / sum;
  if (p.top_p < 1.0f) {
    double cumulative = 0;
    size_t k = 0;
    while (k < keep) {
      cumulative += prob[order[k++]];
      if (cumulative >= p.top_p) break;
    }
    keep = k;
  }
  if (p.min_p > 0.0f) {
    size_t k = 1;
    while (k < keep && prob[order[k]] >= p.min_p * prob[order[0]]) k++;
    keep = k;
  }
  std::vector<double> out(V, 0.0);
  double total = 0;
  for (size_t i = 0; i < keep; i++) total += prob[order[i]];
  for (size_t i = 0; i < keep; i++) out[order[i]] = prob[order[i]] / total;
  return out;
}

// Pearson's chi-square of observed counts against expected probabilities; `df` gets the degrees of freedom.
// An observation where the expected probability is 0 makes it infinite.
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expected, int64_t draws, int* df) {
  double chi2 = 0;
  int support = 0;
  for (size_t i = 0; i < counts.size(); i++) {
    if (expected[i] == 0.0) {
      if (counts[i] > 0) return INFINITY;
      continue;
    }
    support++;
    const double e = expected[i] * double(draws);
    chi2 += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
  }
  *df = support - 1;
  return chi2;
}

// Upper 0.1% points of the chi-square distribution (alpha = 0.001), by degrees of freedom.
double chi_square_critical_0001(int df) {
  static const double table[] = {0, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124};
  REQUIRE(df >= 1);
  REQUIRE(df <= 8);
  return table[df];
}

}  // namespace

TEST_CASE("n-gram drafting: the longest matching suffix, its latest earlier occurrence, what followed it") {
  // ... 5 6 7 | 1 2 3 4 | ... 1 2 3 9 | ... 1 2 3: the suffix 1 2 3 last occurred before 9.
  CHECK(draft_of({5, 6, 7, 1, 2, 3, 4, 8, 1, 2, 3, 9, 0, 1, 2, 3}, 3, 4) == std::vector<int32_t>{9, 0, 1, 2});
  // The draft stops at max_tokens, and at the end of the history.
  CHECK(draft_of({5, 6, 7, 1, 2, 3, 4, 8, 1, 2, 3, 9, 0, 1, 2, 3}, 3, 2) == std::vector<int32_t>{9, 0});
  // The latest occurrence is cut short (1 2 3 | 9): the earlier whole one is taken (1 2 3 | 4 8 1 2 3 ...).
  CHECK(draft_of({5, 6, 7, 1, 2, 3, 4, 8, 1, 2, 3, 9, 0, 1, 2, 3}, 3, 6) == std::vector<int32_t>{4, 8, 1, 2, 3, 9});
  CHECK(draft_of({1, 2, 3, 1, 2}, 2, 8) == std::vector<int32_t>{3, 1, 2});
  // A longer n wins over a later shorter match: "2 3" matches at index 1 (followed by 4); "3" alone last at 5.
  CHECK(draft_of({1, 2, 3, 4, 7, 3, 5, 2, 3}, 2, 1) == std::vector<int32_t>{4});
  CHECK(draft_of({1, 2, 3, 4, 7, 3, 5, 2, 3}, 1, 1) == std::vector<int32_t>{5});
  // No earlier occurrence, too little history, nothing asked: no draft.
  CHECK(draft_of({1, 2, 3, 4}, 3, 4).empty());
  CHECK(draft_of({7}, 3, 4).empty());
  CHECK(draft_of({1, 1}, 0, 4).empty());
  CHECK(draft_of({1, 1}, 2, 0).empty());
  // A run of one token drafts more of it: the latest occurrences overlap the suffix and are cut short by the
  // history's end, so an earlier one with a whole continuation is taken.
  CHECK(draft_of({4, 4, 4, 4}, 2, 3) == std::vector<int32_t>{4, 4});
  CHECK(draft_of({4, 4, 4, 4, 4, 4}, 2, 3) == std::vector<int32_t>{4, 4, 4});

  // Property over random histories: every draft continues an occurrence of the history's last token(s).
  Rng rng(17);
  for (int trial = 0; trial < 2000; trial++) {
    std::vector<int32_t> history(size_t(2 + rng.next_u64() % 40));
    for (int32_t& t : history) t = int32_t(rng.next_u64() % 4);
    const int64_t ngram = 1 + int64_t(rng.next_u64() % 4), k = 1 + int64_t(rng.next_u64() % 6);
    const std::vector<int32_t> draft = draft_of(history, ngram, k);
    CHECK(int64_t(draft.size()) <= k);
    // Some n in 1..ngram and start: history[start, start + n) equals the suffix and the draft follows it.
    bool explained = draft.empty();
    for (int64_t n = 1; n <= ngram && !explained; n++)
      for (int64_t start = 0; start + n < int64_t(history.size()) && !explained; start++)
        explained = std::equal(history.end() - n, history.end(), history.begin() + start) &&
                    std::equal(draft.begin(), draft.end(), history.begin() + start + n);
    CHECK(explained);
    // A history whose last token occurs earlier always drafts something.
    if (std::find(history.begin(), history.end() - 1, history.back()) != history.end() - 1) CHECK_FALSE(draft.empty());
  }
}

TEST_CASE("draft verification keeps the target distribution (chi-square, alpha 0.001), and a wrong rule is rejected") {
  const std::vector<float> logits = {1.2f, 0.3f, -0.4f, 2.0f, 0.1f, -1.5f};
  const std::vector<int32_t> history = {0, 3};
  std::vector<SamplingParams> cases(5);
  cases[0].temperature = 0.8f;
  cases[1].temperature = 1.0f, cases[1].top_k = 4;
  cases[2].temperature = 1.3f, cases[2].top_p = 0.8f;
  cases[3].temperature = 0.7f, cases[3].min_p = 0.1f;
  cases[4].temperature = 1.1f, cases[4].repetition_penalty = 1.3f, cases[4].top_k = 5;
  constexpr int64_t kDraws = 40000;
  std::vector<float> probs(logits.size()), row(logits.size());
  std::vector<int32_t> order(logits.size());
  for (size_t c = 0; c < cases.size(); c++) {
    const std::vector<double> expected = target_distribution(logits, cases[c], history);
    for (int32_t draft : {3, 2, 5}) {  // the likeliest token, an unlikely one, one the filters may drop
      CAPTURE(c);
      CAPTURE(draft);
      Rng rng(1000 + uint64_t(c) * 10 + uint64_t(draft));
      std::vector<int64_t> counts(logits.size(), 0);
      int64_t accepted = 0;
      for (int64_t i = 0; i < kDraws; i++) {
        row = logits;
        const DraftVerdict v = verify_draft_token(row.data(), int64_t(row.size()), cases[c], history.data(),
                                                  int64_t(history.size()), draft, rng, probs.data(), order.data());
        REQUIRE(v.token >= 0);
        REQUIRE(v.token < int32_t(logits.size()));
        CHECK(v.accepted == (v.token == draft));
        counts[size_t(v.token)]++;
        accepted += v.accepted;
      }
      int df = 0;
      const double chi2 = chi_square(counts, expected, kDraws, &df);
      CHECK_MESSAGE(chi2 < chi_square_critical_0001(df), "chi2 " << chi2 << " with " << df << " degrees of freedom");
      // The draft is accepted with probability p(draft): within 5 standard deviations of a binomial.
      const double p = expected[size_t(draft)];
      CHECK(std::fabs(double(accepted) - p * kDraws) <= 5.0 * std::sqrt(kDraws * p * (1 - p)) + 1e-9);
    }
  }
  // Control: "take the draft whenever the filters keep it" is not the target distribution, and the test says so.
  {
    const SamplingParams& params = cases[0];
    const std::vector<double> expected = target_distribution(logits, params, history);
    Rng rng(7);
    std::vector<int64_t> counts(logits.size(), 0);
    for (int64_t i = 0; i < kDraws; i++) {
      row = logits;
      const int32_t draft = 2;
      const bool kept = expected[size_t(draft)] > 0;
      const int32_t token = kept ? draft
                                 : sample_token(row.data(), int64_t(row.size()), params, history.data(),
                                                int64_t(history.size()), rng, probs.data(), order.data());
      counts[size_t(token)]++;
    }
    int df = 0;
    CHECK(chi_square(counts, expected, kDraws, &df) > chi_square_critical_0001(std::max(df, 1)));
  }
  // Greedy: the target's argmax, accepted exactly when it is the draft; no random draw is used.
  SamplingParams greedy;
  for (int32_t draft : {3, 0}) {
    Rng rng(1), untouched(1);
    row = logits;
    const DraftVerdict v = verify_draft_token(row.data(), int64_t(row.size()), greedy, history.data(),
                                              int64_t(history.size()), draft, rng, probs.data(), order.data());
    CHECK(v.token == 3);
    CHECK(v.accepted == (draft == 3));
    CHECK(rng.next_u64() == untouched.next_u64());
  }
}

TEST_CASE("a draft model's sampled drafts: verification keeps the target distribution whatever q is (chi-square, "
          "alpha 0.001), and wrong rules are rejected") {
  // Target logits p and draft logits q over 6 tokens: a draft close to the target, one far from it, and one that
  // puts mass where the target's filters leave none.
  const std::vector<float> target = {1.2f, 0.3f, -0.4f, 2.0f, 0.1f, -1.5f};
  const std::vector<std::vector<float>> drafts = {
      {1.0f, 0.5f, -0.4f, 1.8f, 0.0f, -1.0f}, {-1.0f, 2.0f, 1.5f, -0.5f, 0.2f, 0.7f}, {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 3.0f}};
  const std::vector<int32_t> history = {0, 3};
  std::vector<SamplingParams> cases(4);
  cases[0].temperature = 0.8f;
  cases[1].temperature = 1.0f, cases[1].top_k = 4;
  cases[2].temperature = 1.3f, cases[2].top_p = 0.8f;
  cases[3].temperature = 1.1f, cases[3].repetition_penalty = 1.3f, cases[3].min_p = 0.05f;
  constexpr int64_t kDraws = 40000;
  const size_t V = target.size();
  std::vector<float> probs(V), q(V), row(V);
  std::vector<int32_t> order(V);
  for (size_t c = 0; c < cases.size(); c++) {
    const std::vector<double> expected = target_distribution(target, cases[c], history);
    for (size_t d = 0; d < drafts.size(); d++) {
      CAPTURE(c);
      CAPTURE(d);
      const std::vector<double> q_expected = target_distribution(drafts[d], cases[c], history);
      Rng rng(5000 + uint64_t(c) * 10 + uint64_t(d));
      std::vector<int64_t> counts(V, 0), proposed(V, 0);
      int64_t accepted = 0;
      double expected_accept = 0;  // sum over x of min(p(x), q(x))
      for (size_t x = 0; x < V; x++) expected_accept += std::min(expected[x], q_expected[x]);
      for (int64_t i = 0; i < kDraws; i++) {
        row = drafts[d];
        const int32_t draft = sample_draft_token(row.data(), int64_t(V), cases[c], history.data(),
                                                 int64_t(history.size()), rng, q.data(), probs.data(), order.data());
        REQUIRE(draft >= 0);
        REQUIRE(draft < int32_t(V));
        proposed[size_t(draft)]++;
        row = target;
        const DraftVerdict v = verify_draft_token(row.data(), int64_t(V), cases[c], history.data(),
                                                  int64_t(history.size()), draft, q.data(), rng, probs.data(),
                                                  order.data());
        REQUIRE(v.token >= 0);
        REQUIRE(v.token < int32_t(V));
        CHECK(v.accepted == (v.token == draft));
        counts[size_t(v.token)]++;
        accepted += v.accepted;
      }
      int df = 0;
      double chi2 = chi_square(proposed, q_expected, kDraws, &df);  // the draft samples q as sample_token would
      CHECK_MESSAGE(chi2 < chi_square_critical_0001(df), "draft: chi2 " << chi2 << ", df " << df);
      chi2 = chi_square(counts, expected, kDraws, &df);  // and the verified tokens follow p
      CHECK_MESSAGE(chi2 < chi_square_critical_0001(df), "verified: chi2 " << chi2 << ", df " << df);
      // Acceptance probability is sum_x min(p(x), q(x)) (Leviathan et al., 2023): within 5 binomial deviations.
      CHECK(std::fabs(double(accepted) - expected_accept * kDraws) <=
            5.0 * std::sqrt(kDraws * expected_accept * (1 - expected_accept)) + 1e-9);
    }
  }
  // Controls, with the far draft: keeping every draft yields q, and resampling rejections from p instead of the
  // residual max(0, p - q) is biased; the test rejects both.
  {
    const SamplingParams& params = cases[0];
    const std::vector<double> expected = target_distribution(target, params, history);
    Rng rng(11);
    std::vector<int64_t> always(V, 0), from_p(V, 0);
    for (int64_t i = 0; i < kDraws; i++) {
      row = drafts[1];
      const int32_t draft = sample_draft_token(row.data(), int64_t(V), params, history.data(), int64_t(history.size()),
                                               rng, q.data(), probs.data(), order.data());
      always[size_t(draft)]++;
      row = target;
      const DraftVerdict v = verify_draft_token(row.data(), int64_t(V), params, history.data(),
                                                int64_t(history.size()), draft, q.data(), rng, probs.data(),
                                                order.data());
      if (v.accepted) {
        from_p[size_t(v.token)]++;
      } else {
        row = target;
        from_p[size_t(sample_token(row.data(), int64_t(V), params, history.data(), int64_t(history.size()), rng,
                                   probs.data(), order.data()))]++;
      }
    }
    int df = 0;
    CHECK(chi_square(always, expected, kDraws, &df) > chi_square_critical_0001(std::max(df, 1)));
    CHECK(chi_square(from_p, expected, kDraws, &df) > chi_square_critical_0001(std::max(df, 1)));
  }
  // Greedy: the draft model's argmax, q untouched, and the target's argmax decides.
  SamplingParams greedy_params;
  Rng rng(3), untouched(3);
  row = drafts[1];
  std::fill(q.begin(), q.end(), -1.0f);
  CHECK(sample_draft_token(row.data(), int64_t(V), greedy_params, history.data(), int64_t(history.size()), rng,
                           q.data(), probs.data(), order.data()) == 1);
  CHECK(q[0] == -1.0f);
  row = target;
  const DraftVerdict v = verify_draft_token(row.data(), int64_t(V), greedy_params, history.data(),
                                            int64_t(history.size()), 1, q.data(), rng, probs.data(), order.data());
  CHECK(v.token == 3);
  CHECK_FALSE(v.accepted);
  CHECK(rng.next_u64() == untouched.next_u64());
}

namespace {

using fx::reference_greedy;

EngineOptions speculative(int64_t ngram = 3, int64_t k = 4) {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.plan.ngram = ngram;
  options.plan.speculative_tokens = k;
  return options;
}



}  // namespace

TEST_CASE("with n-gram drafting, greedy tokens are transformers', alone and batched, for every fixture model") {
  int64_t drafted = 0, accepted = 0;
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    std::vector<std::vector<int32_t>> prompts;
    const std::vector<std::vector<int32_t>> expected = reference_greedy(name, &prompts);
    for (const auto& setting : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 4}, {2, 8}}) {
      const int64_t ngram = setting.first, k = setting.second;  // (not a structured binding: CAPTURE's lambda)
      CAPTURE(ngram);
      CAPTURE(k);
      auto engine = fx::open(name, speculative(ngram, k));
      std::vector<RequestId> ids;
      for (const auto& prompt : prompts) {  // batched: all at once
        auto id = engine->submit(prompt, greedy());
        REQUIRE_MESSAGE(id, id.error().message);
        ids.push_back(*id);
      }
      REQUIRE(engine->run());
      for (size_t i = 0; i < ids.size(); i++) {
        auto generation = engine->result(ids[i]);
        REQUIRE(generation);
        CHECK(generation->ids == expected[i]);
        CHECK(generation->finish_reason == FinishReason::max_tokens);
      }
      for (size_t i = 0; i < prompts.size(); i++) {  // alone
        auto generation = engine->generate(prompts[i], greedy());
        REQUIRE(generation);
        CHECK(generation->ids == expected[i]);
      }
      drafted += engine->stats().draft_tokens;
      accepted += engine->stats().draft_tokens_accepted;
      check_pool_empty(*engine);
    }
  }
  // (their 16 greedy tokens rarely repeat: the accept path is exercised by the longer cases below)
  MESSAGE("fixtures: " << drafted << " tokens drafted, " << accepted << " accepted");
  CHECK(drafted > 0);
}

TEST_CASE("with n-gram drafting under page pressure, preempted requests still give transformers' greedy tokens") {
  const std::string name = "tiny-llama3";
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<std::vector<int32_t>> expected = reference_greedy(name, &prompts);
  EngineOptions options = speculative(2, 6);
  options.plan.max_model_len = 128;
  options.plan.utilization = 1.0;
  const Plan probe = fx::open(name, options)->plan();
  options.plan.device_mem = probe.fixed_bytes + 8 * probe.kv_page_bytes;  // 8 pages of 16 tokens
  auto engine = fx::open(name, options);
  REQUIRE(engine->plan().kv_pages == 8);
  std::vector<RequestId> ids;
  for (size_t i : {2, 0, 1}) {
    auto id = engine->submit(prompts[i], greedy());
    REQUIRE_MESSAGE(id, id.error().message);
    ids.push_back(*id);
  }
  REQUIRE(engine->run());
  CHECK(engine->stats().preemptions > 0);
  CHECK(engine->stats().draft_tokens > 0);
  size_t k = 0;
  for (size_t i : {2, 0, 1}) {
    auto generation = engine->result(ids[k++]);
    REQUIRE(generation);
    CHECK(generation->ids == expected[i]);
  }
  check_pool_empty(*engine);
}

TEST_CASE("with n-gram drafting, max_tokens, max_model_len, stop strings and stop tokens end generation where they "
          "do without it") {
  const std::string name = "tiny-qwen3";
  auto plain = fx::open(name);
  auto drafting = fx::open(name, speculative(2, 8));
  // A prompt that repeats itself, and 120 tokens of a random model (which loops): drafts get accepted.
  const std::vector<int32_t> prompt = *plain->tokenize("The quick brown fox jumps over the lazy dog. The quick brown fox");
  std::vector<SamplingParams> variants;
  for (int64_t max_tokens : {1, 2, 3, 7, 40, 120}) variants.push_back(greedy(max_tokens));
  {
    SamplingParams p = greedy(40);
    auto reference = plain->generate(prompt, p);
    REQUIRE(reference);
    REQUIRE(reference->text.size() > 6);
    p.stop_strings = {reference->text.substr(reference->text.size() / 2, 3)};  // a string it will meet
    variants.push_back(p);
    SamplingParams q = greedy(40);
    q.stop_tokens = {reference->ids[5]};  // a token it will meet
    variants.push_back(q);
  }
  for (size_t v = 0; v < variants.size(); v++) {
    CAPTURE(v);
    auto a = plain->generate(prompt, variants[v]);
    auto b = drafting->generate(prompt, variants[v]);
    REQUIRE(a);
    REQUIRE(b);
    CHECK(a->ids == b->ids);
    CHECK(a->text == b->text);
    CHECK(a->finish_reason == b->finish_reason);
  }
  MESSAGE("tiny-qwen3, " << drafting->stats().tokens_generated << " tokens: " << drafting->stats().draft_tokens
                         << " drafted, " << drafting->stats().draft_tokens_accepted << " accepted");
  CHECK(drafting->stats().draft_tokens_accepted > 0);  // the accept path ran, not only rejections
  // The context's end: an engine whose max_model_len leaves room for 9 new tokens.
  EngineOptions short_plain, short_drafting = speculative(2, 8);
  short_plain.plan.max_model_len = short_drafting.plan.max_model_len = int64_t(prompt.size()) + 9;
  auto a = fx::open(name, short_plain)->generate(prompt, greedy(100));
  auto b = fx::open(name, short_drafting)->generate(prompt, greedy(100));
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a->finish_reason == FinishReason::length);
  CHECK(a->ids == b->ids);
  CHECK(b->finish_reason == FinishReason::length);
  check_pool_empty(*drafting);
}

TEST_CASE("with n-gram drafting, seeded sampling is reproducible, alone or batched") {
  const std::string name = "tiny-qwen2";
  std::vector<std::vector<int32_t>> prompts;
  reference_greedy(name, &prompts);
  auto engine = fx::open(name, speculative(2, 4));
  std::vector<SamplingParams> params(prompts.size());
  for (size_t i = 0; i < params.size(); i++) {
    params[i].temperature = 0.9f;
    params[i].top_k = 40;
    params[i].seed = 100 + i;
    params[i].max_tokens = 24;
  }
  std::vector<std::vector<int32_t>> alone;
  for (size_t i = 0; i < prompts.size(); i++) {
    auto g = engine->generate(prompts[i], params[i]);
    REQUIRE(g);
    alone.push_back(g->ids);
    auto again = engine->generate(prompts[i], params[i]);
    REQUIRE(again);
    CHECK(again->ids == g->ids);
  }
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); i++) ids.push_back(*engine->submit(prompts[i], params[i]));
  REQUIRE(engine->run());
  for (size_t i = 0; i < ids.size(); i++) CHECK(engine->result(ids[i])->ids == alone[i]);
  check_pool_empty(*engine);
}

TEST_CASE("the bundled captioner with n-gram drafting: the same captions in fewer forward passes") {
  const std::string root = std::string(KVLITE_SOURCE_DIR) + "/";
  const std::vector<std::pair<std::string, std::string>> examples = engine_helpers::example_captions();
  REQUIRE(examples.size() >= 5);
  std::map<bool, EngineStats> stats;
  for (bool drafting : {false, true}) {
    EngineOptions options = drafting ? speculative(2, 4) : EngineOptions{};
    options.plan.device_mem = 256 * MiB;
    auto engine = Engine::open(root + "models/kvlite-captioner-bf16", options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    for (const auto& example : examples) {
      auto image = load_image(root + "examples/images/" + example.first);
      REQUIRE(image);
      auto caption = (*engine)->generate_chat({{"user", std::string(kImagePlaceholder) + "Describe this image."}},
                                              {*image}, greedy(64));
      REQUIRE(caption);
      CHECK_MESSAGE(caption->text == example.second, example.first);
    }
    stats[drafting] = (*engine)->stats();
  }
  MESSAGE("captioner, five example images: " << stats[false].steps << " forward passes without drafting, "
                                              << stats[true].steps << " with (" << stats[true].draft_tokens
                                              << " drafted, " << stats[true].draft_tokens_accepted << " accepted) for "
                                              << stats[true].tokens_generated << " tokens");
  CHECK(stats[true].tokens_generated == stats[false].tokens_generated);
  CHECK(stats[true].draft_tokens_accepted > 0);
  CHECK(stats[true].steps == stats[false].steps - stats[true].draft_tokens_accepted);
}

TEST_CASE("the plan shows n-gram drafting, and refuses half or out-of-range settings") {
  const std::string dir = fx::dir("tiny-llama3");
  EngineOptions options = speculative(3, 4);
  options.plan.device_mem = 64 * MiB;
  auto plan = plan_engine(dir, options);
  REQUIRE_MESSAGE(plan, plan.error().message);
  CHECK(plan->table().find("speculative") != std::string::npos);
  CHECK(plan->table().find("n-gram drafting (prompt lookup, n <= 3), up to 4 tokens") != std::string::npos);
  const nlohmann::json json = nlohmann::json::parse(plan->json());
  CHECK(json["options"]["speculative_tokens"] == 4);
  CHECK(json["options"]["ngram"] == 3);
  // Without it, no row (the plan is what it was).
  EngineOptions plain;
  plain.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  plain.plan.device_mem = 64 * MiB;
  CHECK(plan_engine(dir, plain)->table().find("speculative") == std::string::npos);
  for (const auto& setting : std::vector<std::pair<int64_t, int64_t>>{{3, 0}, {0, 4}, {-1, 4}, {3, 33}, {33, 4}}) {
    const int64_t ngram = setting.first, k = setting.second;
    EngineOptions bad = speculative(ngram, k);
    bad.plan.device_mem = 64 * MiB;
    auto refused = plan_engine(dir, bad);
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::invalid_argument);
  }
  EngineOptions narrow = speculative(3, 8);
  narrow.plan.device_mem = 64 * MiB;
  narrow.plan.max_batched_tokens = 8;
  auto refused = plan_engine(dir, narrow);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().message.find("max_batched_tokens of at least 9") != std::string::npos);
}
