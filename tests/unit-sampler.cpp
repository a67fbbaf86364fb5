// sampler: the logits processors in transformers' order, reproducibility, and the perplexity windows.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include <cmath>
#include <map>
#include <random>

using namespace kvlite;

static std::vector<float> random_logits(int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(size_t(vocab), 0.0f);
  for (auto& v : logits) v = normal(rng);
  return logits;
}

struct Scratch {
  std::vector<float> probs;
  std::vector<int32_t> index;
  explicit Scratch(int64_t vocab) : probs(size_t(vocab)), index(size_t(vocab)) {}
};

static int32_t draw(std::vector<float> logits, const SamplingParams& p, Rng& rng, const std::vector<int32_t>& history = {}) {
  Scratch s(int64_t(logits.size()));
  return sample_token(logits.data(), int64_t(logits.size()), p, history.data(), int64_t(history.size()), rng,
                      s.probs.data(), s.index.data());
}

TEST_CASE("greedy is argmax, first index on ties") {
  auto logits = random_logits(1001, 1);
  SamplingParams p;
  Rng rng(0);
  CHECK(draw(logits, p, rng) == int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  std::vector<float> tie = {1.0f, 3.0f, 3.0f, 2.0f};
  CHECK(draw(tie, p, rng) == 1);
}

TEST_CASE("the same seed gives the same tokens, another seed other tokens") {
  auto logits = random_logits(500, 2);
  SamplingParams p;
  p.temperature = 1.0f;
  Rng a(42), b(42), c(43);
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 50; i++) { ta.push_back(draw(logits, p, a)); tb.push_back(draw(logits, p, b)); tc.push_back(draw(logits, p, c)); }
  CHECK(ta == tb);
  CHECK(ta != tc);
}

TEST_CASE("sampling frequencies follow softmax(logits / temperature)") {
  std::vector<float> logits = {0.5f, 1.5f, -0.3f, 1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.7f;
  Rng rng(7);
  const int n = 200000;
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; i++) counts[size_t(draw(logits, p, rng))]++;
  double z = 0;
  for (float l : logits) z += std::exp(double(l) / 0.7);
  for (size_t i = 0; i < logits.size(); i++) {
    double expect = std::exp(double(logits[i]) / 0.7) / z;
    CHECK(std::fabs(double(counts[i]) / n - expect) < 0.005);
  }
}

TEST_CASE("top-k, top-p and min-p keep exactly the tokens transformers keeps") {
  // probabilities 0.5, 0.25, 0.15, 0.07, 0.03 (logits are their logs)
  std::vector<double> probs = {0.5, 0.25, 0.15, 0.07, 0.03};
  std::vector<float> logits;
  for (double q : probs) logits.push_back(float(std::log(q)));
  auto support = [&](SamplingParams p) {
    p.temperature = 1.0f;
    Rng rng(11);
    std::map<int32_t, int> seen;
    for (int i = 0; i < 20000; i++) seen[draw(logits, p, rng)]++;
    return seen;
  };
  SamplingParams p;
  p.top_k = 2;
  CHECK(support(p).size() == 2);
  p = SamplingParams();
  p.top_p = 0.8f;  // 0.5 + 0.25 = 0.75 < 0.8, so 3 tokens are needed
  auto s = support(p);
  CHECK(s.size() == 3);
  CHECK(s.count(3) == 0);
  p = SamplingParams();
  p.min_p = 0.2f;  // threshold 0.1: keeps 0.5, 0.25, 0.15
  CHECK(support(p).size() == 3);
  p = SamplingParams();
  p.top_p = 0.01f;  // at least one token always stays
  CHECK(support(p).size() == 1);
}

TEST_CASE("repetition penalty divides positive and multiplies negative logits once per token") {
  std::vector<float> logits = {2.0f, -1.0f, 1.9f, 0.5f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Rng rng(0);
  // Token 0 repeated three times is penalized once: 2.0 / 2 = 1.0 < 1.9.
  CHECK(draw(logits, p, rng, {0, 0, 0}) == 2);
  std::vector<float> work = logits;
  Scratch s(4);
  std::vector<int32_t> history = {0, 1, 0};
  sample_token(work.data(), 4, p, history.data(), 3, rng, s.probs.data(), s.index.data());
  CHECK(work[0] == 1.0f);
  CHECK(work[1] == -2.0f);
  CHECK(work[2] == 1.9f);
}

TEST_CASE("bad sampling parameters are refused with the value") {
  SamplingParams p;
  p.top_p = 1.5f;
  auto st = validate(p);
  CHECK(st.error().code == ErrorCode::invalid_argument);
  CHECK(st.error().message.find("1.5") != std::string::npos);
  p = SamplingParams();
  p.temperature = -1.0f;
  CHECK_FALSE(validate(p).ok());
  p = SamplingParams();
  p.max_tokens = 0;
  CHECK_FALSE(validate(p).ok());
}

TEST_CASE("token_logprob equals log softmax") {
  auto logits = random_logits(300, 5);
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  CHECK(token_logprob(logits.data(), 300, 17) == doctest::Approx(double(logits[17]) - std::log(z)).epsilon(1e-12));
}

TEST_CASE("score windows follow the transformers perplexity guide") {
  // The guide's loop for 10 tokens, max_length 4, stride 2: windows [0,4) [2,6) [4,8) [6,10).
  auto w = score_windows(10, 4, 2).value();
  REQUIRE(w.size() == 4);
  CHECK(w[0].begin == 0); CHECK(w[0].end == 4); CHECK(w[0].first_target == 1);
  CHECK(w[1].begin == 2); CHECK(w[1].end == 6); CHECK(w[1].first_target == 4);
  CHECK(w[3].begin == 6); CHECK(w[3].end == 10); CHECK(w[3].first_target == 8);
  // With overlap (stride < context) every token but the first is a target exactly once; without overlap
  // each window's first token has no predecessor in its window and is not scored (as in the guide).
  for (int64_t context : {2, 5, 64}) {
    for (int64_t stride = 1; stride <= context; stride++) {
      auto ws = score_windows(137, context, stride).value();
      std::vector<int> hits(137, 0);
      for (const auto& x : ws) {
        CHECK(x.end - x.begin <= context);
        CHECK(x.first_target > x.begin);  // every target has its predecessor inside the window
        for (int64_t t = x.first_target; t < x.end; t++) hits[size_t(t)]++;
      }
      CHECK(hits[0] == 0);
      for (int t = 1; t < 137; t++) {
        bool window_start = stride == context && t % stride == 0;
        CHECK(hits[size_t(t)] == (window_start ? 0 : 1));
      }
    }
  }
  CHECK(score_windows(10, 4, 5).error().code == ErrorCode::invalid_argument);
  CHECK_FALSE(score_windows(1, 4, 2).ok());
}
