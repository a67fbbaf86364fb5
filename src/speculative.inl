// speculative: speculative decoding. A decoding request's step also reads up to K drafted tokens, whose logits the
// engine verifies in order (verify_draft_token), so that one forward pass over the weights can yield up to K + 1
// tokens. Drafts come from prompt lookup (n-gram: propose_ngram_draft) or from a small draft model run over the
// same backend and KV pages before the target's step. The Speculator drafts when the scheduler asks (draft),
// runs the draft model (run_draft_model), keeps the distributions its drafts were drawn from for verification
// (draft_distribution), and after the step drops what verification rejected (settle).
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

namespace kvlite {
namespace detail {

class Speculator {
 public:
  // At open: K (PlanOptions::speculative_tokens; 0 turns speculation off), the n-gram length to match, the longest
  // sequence and the vocabulary, and room for max_seqs drafting requests.
  void open(int64_t speculative_tokens, int64_t ngram, int64_t max_model_len, int64_t vocab, size_t max_seqs) {
    speculative_tokens_ = speculative_tokens;
    ngram_ = ngram;
    max_model_len_ = max_model_len;
    vocab_ = vocab;
    drafting_.reserve(max_seqs);
    ranges_.reserve(max_seqs);
  }
  // A draft model (EngineOptions::draft_model) drafts instead of prompt lookup: its forward pass (K/V in the
  // pool's pages, its own "draft_kv" region) and the arena's "draft_probs" region [Smax, K, V].
  void set_draft_model(std::unique_ptr<TextModel> model, float* probs) {
    draft_model_ = std::move(model);
    draft_probs_ = probs;
    draft_row_.assign(size_t(vocab_), 0.0f);
  }
  const TextModel* draft_model() const { return draft_model_.get(); }

  // Speculative decoding (speculative_tokens > 0): a decoding request's next step also reads up to
  // K drafted tokens (n-gram: the continuation of the latest earlier occurrence of its last tokens), whose logits
  // are verified in order (verify_draft_token), so one forward pass over the weights can yield up to K + 1
  // tokens. Drafts are appended to r.tokens for the step when the pages for them are there without preempting
  // anyone; `limit` is the step's token budget left after r's own token. Returns the tokens drafted. With a draft
  // model the pages are reserved here and the tokens drafted by run_draft_model(), before the step is packed.
  int64_t draft(EngineRequest& r, int64_t limit, Scheduler& scheduler, EngineStats& stats) {
    const int64_t k = speculative_tokens_;
    if (k <= 0 || r.kind != RequestKind::generate) return 0;
    // Every accepted draft and the token after them must be allowed: by max_tokens and by the context.
    const int64_t allowed = std::min({k, limit, r.params.max_tokens - int64_t(r.result.ids.size()) - 1,
                                      max_model_len_ - int64_t(r.tokens.size())});
    if (allowed <= 0) return 0;
    if (draft_model_) {
      if (!scheduler.reserve(r, r.computed + 1 + allowed)) return 0;
      r.drafts.clear();
      r.draft_wanted = allowed;
      r.draft_base = int64_t(r.tokens.size()) - 1;
      r.draft_rejected = false;
      return allowed;
    }
    r.drafts.resize(size_t(allowed));
    const int64_t count =
        propose_ngram_draft(r.tokens.data(), int64_t(r.tokens.size()), ngram_, allowed, r.drafts.data());
    r.drafts.resize(size_t(count));
    if (count == 0 || !scheduler.reserve(r, r.computed + 1 + count)) {
      r.drafts.clear();
      return 0;
    }
    r.draft_base = int64_t(r.tokens.size()) - 1;
    r.draft_rejected = false;
    r.tokens.insert(r.tokens.end(), r.drafts.begin(), r.drafts.end());
    stats.draft_tokens += count;
    return count;
  }

  // The distribution the draft model drew request slot `slot`'s draft i from.
  float* draft_distribution(int32_t slot, int64_t i) const {
    return draft_probs_ + (int64_t(slot) * speculative_tokens_ + i) * vocab_;
  }

  // The draft model's turn, before the step is packed: each request that wants drafts (draft_wanted > 0, pages
  // reserved by draft()) first has the draft read its tokens the draft's cache lacks (a prompt, or the tokens
  // accepted last step), in steps of at most max_batched_tokens; the last one's logits give draft 1. Then one
  // step per further draft, each reading the draft before it. The draft's K/V goes into the same pages as the
  // target's (its own "draft_kv" region), its positions are the tokens' indices (a text model's), and its tokens
  // are drawn as the target would sample (sample_draft_token keeps each one's distribution for verification).
  // The drafts are appended to r.tokens, as n-gram drafts are.
  void run_draft_model(const std::vector<ScheduledRequest>& scheduled, StepBatch& batch, const KVPagePool& kv,
                       EngineStats& stats) {
    std::vector<EngineRequest*>& drafting = drafting_;
    drafting.clear();
    for (const ScheduledRequest& s : scheduled)
      if (s.request->draft_wanted > 0) drafting.push_back(s.request);
    if (drafting.empty()) return;
    std::sort(drafting.begin(), drafting.end(),
              [](const EngineRequest* a, const EngineRequest* b) { return a->slot < b->slot; });
    const int64_t page_tokens = kv.page_tokens(), vocab = vocab_;
    const int64_t max_tokens = int64_t(batch.token_ids.size());
    // One draft step over tokens [from, from + count) of each request (count 0: not in this step); the rows of
    // requests whose last token is in it give their next draft.
    auto draft_step = [&](const std::vector<std::pair<int64_t, int64_t>>& ranges) {
      const int64_t seqs = drafting.back()->slot + 1;
      std::fill(batch.context_lens.begin(), batch.context_lens.begin() + seqs, 0);
      int64_t t = 0, rows = 0, max_context = 0;
      size_t next = 0;
      for (int64_t s = 0; s < seqs; s++) {
        batch.query_starts[size_t(s)] = int32_t(t);
        if (next == drafting.size() || drafting[next]->slot != s) continue;
        EngineRequest& r = *drafting[next];
        const int64_t from = ranges[next].first, count = ranges[next].second;
        next++;
        if (count == 0) continue;
        const int32_t* pages = kv.block_table(r.slot);
        for (int64_t p = from; p < from + count; p++, t++) {
          batch.token_ids[size_t(t)] = r.tokens[size_t(p)];
          batch.positions[size_t(t)] = int32_t(p);
          batch.slots[size_t(t)] = int32_t(int64_t(pages[p / page_tokens]) * page_tokens + p % page_tokens);
        }
        if (from + count == int64_t(r.tokens.size())) {
          batch.logit_row_ids[size_t(rows)] = int32_t(t - 1);
          batch.row_owners[size_t(rows++)] = {&r, from + count - 1};
        }
        batch.context_lens[size_t(s)] = int32_t(from + count);
        max_context = std::max(max_context, from + count);
        r.draft_computed = from + count;
      }
      batch.query_starts[size_t(seqs)] = int32_t(t);
      draft_model_->forward(batch.input(kv, t, 1, seqs, max_context, rows));
      stats.draft_steps++;
      stats.draft_tokens_computed += t;
      for (int64_t first = 0; first < rows; first += draft_model_->max_logit_rows()) {
        const int64_t count = std::min(draft_model_->max_logit_rows(), rows - first);
        const Tensor logits = draft_model_->logits(first, count);
        for (int64_t i = 0; i < count; i++) {
          EngineRequest& r = *batch.row_owners[size_t(first + i)].request;
          float* row = host_logits_row(logits, i, vocab, draft_row_.data());
          const int64_t index = int64_t(r.drafts.size());
          const int32_t id = sample_draft_token(row, vocab, r.params, r.tokens.data(), int64_t(r.tokens.size()), r.rng,
                                                draft_distribution(r.slot, index), draft_model_->sampling_probs(r.slot),
                                                draft_model_->sampling_order(r.slot));
          r.drafts.push_back(id);
          r.tokens.push_back(id);
        }
      }
    };
    std::vector<std::pair<int64_t, int64_t>>& ranges = ranges_;
    // Catching up: every token the draft's cache lacks, the target's newest included (its row gives draft 1).
    for (;;) {
      int64_t budget = max_tokens;
      bool any = false;
      ranges.assign(drafting.size(), {0, 0});
      for (size_t i = 0; i < drafting.size() && budget > 0; i++) {
        EngineRequest& r = *drafting[i];
        const int64_t missing = r.draft_base + 1 - r.draft_computed;  // up to the target's newest token
        if (missing <= 0) continue;
        ranges[i] = {r.draft_computed, std::min(missing, budget)};
        budget -= ranges[i].second;
        any = true;
      }
      if (!any) break;
      draft_step(ranges);
    }
    // Then one token per step: the latest draft, while a request wants more.
    for (int64_t drafted = 1;; drafted++) {
      bool any = false;
      for (size_t i = 0; i < drafting.size(); i++) {
        EngineRequest& r = *drafting[i];
        const bool more = int64_t(r.drafts.size()) < r.draft_wanted;
        ranges[i] = more ? std::make_pair(int64_t(r.tokens.size()) - 1, int64_t(1)) : std::make_pair(int64_t(0), int64_t(0));
        any = any || more;
      }
      if (!any) break;
      draft_step(ranges);
    }
    for (EngineRequest* r : drafting) {
      stats.draft_tokens += int64_t(r->drafts.size());
      r->draft_wanted = 0;
    }
  }

  // After a step's rows are consumed: a drafting request keeps the K/V of its last token and accepted drafts
  // (the positions past them held rejected drafts; the next steps overwrite them).
  void settle(const std::vector<ScheduledRequest>& scheduled) {
    for (const ScheduledRequest& s : scheduled) {
      EngineRequest& r = *s.request;
      if (r.drafts.empty()) continue;
      if (!r.finished) r.computed = std::min<int64_t>(r.computed, int64_t(r.tokens.size()) - 1);
      // the draft's cache: its inputs up to the last accepted draft (it never read the last draft it made)
      if (!r.finished) r.draft_computed = std::min<int64_t>(r.draft_computed, int64_t(r.tokens.size()) - 1);
      r.drafts.clear();
      r.draft_rejected = false;
    }
  }

 private:
  int64_t speculative_tokens_ = 0, ngram_ = 0, max_model_len_ = 0, vocab_ = 0;
  std::unique_ptr<TextModel> draft_model_;
  float* draft_probs_ = nullptr;                    // [Smax, K, V]: the distribution each draft was drawn from
  std::vector<float> draft_row_;                    // [V]: a row of the draft's logits as floats
  std::vector<EngineRequest*> drafting_;            // capacity Smax: a draft model's step
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // capacity Smax: [from, count) of each
};

}  // namespace detail
}  // namespace kvlite
