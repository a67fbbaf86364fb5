// scheduler: which requests run in the next step, and how many of their tokens. Requests wait in a FIFO queue and
// run in start order; every step first gives each running request its next tokens (one when decoding, a chunk
// when prefilling), preempting the most recently started one when the KV pages run out, then admits waiting
// requests while slots, pages and the step's token budget last. Admission attaches a request's longest cached
// prefix (prefix caching). The scheduler owns the queues and the KV pool's slots and pages of the requests in
// them; the engine packs and runs what schedule() returns.
#include <algorithm>
#include <cstring>
#include <deque>
#include <utility>
#include <vector>

namespace kvlite {
namespace detail {

// One request of a step: its next `tokens` tokens, from request->computed on.
struct ScheduledRequest {
  EngineRequest* request;
  int64_t tokens;
};

class Scheduler {
 public:
  // At open, once the arena is made: the pool the requests' K/V live in (which outlives the scheduler's use of
  // it), the step's token budget, its most sequences and whether admission looks for cached prefixes.
  // window_pool: the sliding layers' pages (Arena::kv_window), or nullptr; its sequences follow the pool's slot for
  // slot, and each keeps only the pages its window of `window` tokens still reads. main_window > 0: the pool's own
  // sequences keep only that window (every layer slides: Arena::kv_main_window).
  void open(KVPagePool& pool, int64_t main_window, KVPagePool* window_pool, int64_t window, int64_t max_batched_tokens,
            int64_t max_seqs, bool prefix_cache) {
    pool_ = &pool;
    main_window_ = main_window;
    window_pool_ = window_pool;
    window_ = window_pool ? window : 0;
    max_batched_tokens_ = max_batched_tokens;
    prefix_cache_ = prefix_cache;
    scheduled_.reserve(size_t(max_seqs));
    attach_pages_.assign(size_t(pool.max_pages_per_seq()), -1);
    attach_window_pages_.assign(size_t(pool.max_pages_per_seq()), -1);
  }
  bool prefix_caching() const { return prefix_cache_; }

  // A new request waits for its first step.
  void enqueue(EngineRequest& r) { waiting_.push_back(&r); }
  // Takes r out of the queues and gives its slot and pages back.
  void release(EngineRequest& r) {
    if (r.slot >= 0) {
      free_slot(r.slot);
      r.slot = -1;
    }
    running_.erase(std::remove(running_.begin(), running_.end(), &r), running_.end());
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &r), waiting_.end());
  }
  // The requests in the queues, running ones first (in start order), then waiting ones.
  std::vector<EngineRequest*> unfinished() const {
    std::vector<EngineRequest*> live(running_.begin(), running_.end());
    live.insert(live.end(), waiting_.begin(), waiting_.end());
    return live;
  }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  size_t waiting_count() const { return waiting_.size(); }
  size_t running_count() const { return running_.size(); }

  // The next step's requests, in pool slot order (sequence s of the attention batch is slot s). `draft(r, limit)`
  // is asked for each decoding request: the drafted tokens it appended to r.tokens (their pages reserved without
  // preempting anyone), at most `limit`, the step's budget left after r's own token. Counts preemptions and
  // reused prefix pages and tokens in `stats`.
  template <class Draft>
  const std::vector<ScheduledRequest>& schedule(EngineStats& stats, Draft&& draft) {
    scheduled_.clear();
    int64_t budget = max_batched_tokens_;
    bool preempted = false;
    // Running requests, oldest first: the next token, or the next prefill chunk.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
      EngineRequest& r = *running_[i];
      int64_t n = std::min<int64_t>(int64_t(r.tokens.size()) - r.computed, budget);
      if (int64_t(r.tokens.size()) - r.computed == 1) n += draft(r, budget - 1);
      bool kept = true;
      while (!reserve(r, r.computed + n)) {
        EngineRequest& victim = *running_.back();
        preempt(victim);
        preempted = true;
        stats.preemptions++;
        log(LogLevel::debug, "KV pages ran out: the newest running request is preempted (recomputed later)");
        if (&victim == &r) {
          kept = false;
          break;
        }
      }
      if (!kept) break;  // r was the newest: nothing after it is left to schedule
      scheduled_.push_back({&r, n});
      budget -= n;
      i++;
    }
    // Waiting requests, in order, while slots and pages last (not in a step that had to preempt).
    while (!preempted && budget > 0 && !waiting_.empty()) {
      EngineRequest& r = *waiting_.front();
      int32_t slot = create_slot();
      if (slot < 0) break;
      r.slot = slot;
      attach_cached_prefix(r);
      int64_t n = std::min<int64_t>(int64_t(r.tokens.size()) - r.computed, budget);
      if (!reserve(r, r.computed + n)) {
        free_slot(slot);
        r.slot = -1;
        r.computed = 0;
        r.registered_pages = 0;
        break;
      }
      stats.prefix_pages_reused += r.registered_pages;
      stats.prefix_tokens_reused += r.computed;
      waiting_.pop_front();
      running_.push_back(&r);
      scheduled_.push_back({&r, n});
      budget -= n;
    }
    std::sort(scheduled_.begin(), scheduled_.end(), [](const ScheduledRequest& a, const ScheduledRequest& b) {
      return a.request->slot < b.request->slot;
    });
    return scheduled_;
  }
  // The last schedule()'s requests, in slot order.
  const std::vector<ScheduledRequest>& scheduled() const { return scheduled_; }

  // Grows r's KV to `tokens`; false when a pool is out of pages. The sliding layers' pages that r's next query
  // (r.computed) no longer sees are given back first.
  bool reserve(EngineRequest& r, int64_t tokens) {
    trim_window(r);
    for (KVPagePool* pool : {pool_, window_pool_}) {
      if (!pool) continue;
      Status grown = pool->seq_reserve(r.slot, tokens);
      if (grown) continue;
      if (grown.error().code != ErrorCode::out_of_memory) throw grown.error();
      return false;
    }
    return true;
  }

  // Sliding windows in memory: r's sliding-layer pages whose every key is before the window of its next query
  // (cache index r.computed sees keys from r.computed - W + 1 on) go back to their pool (the window pool, or the
  // KV pool itself when every layer slides). The engine calls it
  // after each step, once drafts are settled (r.computed is then what is kept), so that a request waiting for its
  // next step holds at most its window's pages.
  void trim_window(EngineRequest& r) {
    if (r.slot < 0) return;
    for (auto [pool, window] : {std::pair<KVPagePool*, int64_t>{pool_, main_window_}, {window_pool_, window_}}) {
      if (!pool || window <= 0) continue;
      Status trimmed = pool->seq_release_before(r.slot, r.computed - window + 1);
      if (!trimmed) throw trimmed.error();
    }
  }

  // Enters r's full pages whose K/V is final (all of their tokens computed and kept: not drafts) into the cache
  // (in both pools: a sliding layer's page too, before it leaves the window, so a later prefix finds it).
  void register_pages(EngineRequest& r) {
    if (!prefix_cache_ || r.slot < 0) return;
    const int64_t full = std::min<int64_t>(r.computed, int64_t(r.tokens.size())) / pool_->page_tokens();
    for (KVPagePool* pool : {pool_, window_pool_}) {
      if (!pool) continue;
      const int32_t* table = pool->block_table(r.slot);
      for (int64_t i = r.registered_pages; i < full; i++) {
        if (table[i] < 0) continue;  // out of the window before it was full and final: never cached
        Result<bool> entered = pool->cache_insert(table[i], page_key(r, i));
        if (!entered) throw entered.error();
      }
    }
    r.registered_pages = std::max(r.registered_pages, full);
  }

 private:
  // ---- prefix cache --------------------------------------------------------------------------------------------
  // Page i's key chains page i - 1's with every token of page i: its id and, for a vision prompt, its M-RoPE
  // position (t, h, w) and, for an image token, the bits of its image features (every level), so that equal keys
  // mean equal K/V. 64-bit splitmix mixing: a false match is a 2^-64 event per lookup.
  static uint64_t mix(uint64_t h, uint64_t value) {
    uint64_t z = h ^ (value + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t page_key(EngineRequest& r, int64_t page) {
    const int64_t page_tokens = pool_->page_tokens();
    const int64_t prompt = int64_t(r.mrope.size()) / 3;  // vision prompts: positions recorded for these
    while (int64_t(r.page_keys.size()) <= page) {
      const int64_t i = int64_t(r.page_keys.size());
      uint64_t h = i == 0 ? 0x6b766c6974650001ull : r.page_keys.back();
      for (int64_t p = i * page_tokens; p < (i + 1) * page_tokens; p++) {
        h = mix(h, uint32_t(r.tokens[size_t(p)]));
        if (r.mrope.empty()) continue;
        for (int64_t axis = 0; axis < 3; axis++)
          h = mix(h, uint64_t(p < prompt ? r.mrope[size_t(axis * prompt + p)] : p + r.rope_delta));
        for (const ImageSpan& span : r.image_spans) {
          if (p < span.first || p >= span.first + span.count) continue;
          const int64_t row = span.feature_row + (p - span.first), hidden = r.features.hidden;
          for (int64_t level = 0; level < r.features.levels; level++) {
            const float* v = r.features.values.data() + (level * r.features.tokens + row) * hidden;
            for (int64_t c = 0; c < hidden; c++) {
              uint32_t bits;
              memcpy(&bits, &v[c], 4);
              h = mix(h, bits);
            }
          }
        }
      }
      r.page_keys.push_back(h);
    }
    return r.page_keys[size_t(page)];
  }

  // A new generate request's longest cached prefix of whole pages, attached to its slot: those tokens count as
  // computed. The last token is always computed (its logits are what the request needs).
  void attach_cached_prefix(EngineRequest& r) {
    if (!prefix_cache_ || r.kind != RequestKind::generate) return;
    const int64_t page_tokens = pool_->page_tokens();
    const int64_t most = std::min<int64_t>((int64_t(r.tokens.size()) - 1) / page_tokens, int64_t(attach_pages_.size()));
    // Each pool needs the pages its first query reads cached: every page, or from a window's start on (earlier
    // ones are never read again: -1). The longest prefix whose pages every pool has wins.
    struct Candidate {
      KVPagePool* pool;
      int64_t window;
      std::vector<int32_t>* pages;
    };
    const Candidate candidates[2] = {{pool_, main_window_, &attach_pages_}, {window_pool_, window_, &attach_window_pages_}};
    int64_t looked = 0;  // pages whose keys were looked up: up to the first miss of a pool without a window
    for (; looked < most; looked++) {
      const uint64_t key = page_key(r, looked);
      bool stop = false;
      for (const Candidate& c : candidates) {
        if (!c.pool) continue;
        const int32_t page = c.pool->cache_lookup(key);
        (*c.pages)[size_t(looked)] = page;
        stop = stop || (page < 0 && c.window <= 0);
      }
      if (stop) break;
    }
    auto first_read = [&](int64_t window, int64_t hits) {  // the first page a query at hits x page_tokens reads
      return window > 0 ? std::max<int64_t>(0, hits * page_tokens - window + 1) / page_tokens : 0;
    };
    int64_t hits = looked;
    for (; hits > 0; hits--) {
      bool found = true;
      for (const Candidate& c : candidates)
        for (int64_t i = c.pool ? first_read(c.window, hits) : hits; found && i < hits; i++) found = (*c.pages)[size_t(i)] >= 0;
      if (found) break;
    }
    if (hits == 0) return;
    for (const Candidate& c : candidates) {
      if (!c.pool) continue;
      for (int64_t i = 0; i < first_read(c.window, hits); i++) (*c.pages)[size_t(i)] = -1;
      Status attached = c.pool->seq_attach(r.slot, c.pages->data(), hits);
      if (!attached) throw attached.error();
    }
    r.computed = hits * page_tokens;
    r.registered_pages = hits;
  }

  // A slot in every pool: the same id in each (they are created and freed together, so their free lists agree).
  int32_t create_slot() {
    const int32_t slot = pool_->seq_create();
    if (slot < 0 || !window_pool_) return slot;
    const int32_t window_slot = window_pool_->seq_create();
    if (window_slot != slot)
      fail(ErrorCode::internal, format("the sliding-window KV pool gave slot %d for the KV pool's %d: their sequences "
                                       "went out of step", window_slot, slot));
    return slot;
  }
  void free_slot(int32_t slot) {
    for (KVPagePool* pool : {pool_, window_pool_}) {
      if (!pool) continue;
      Status freed = pool->seq_free(slot);
      if (!freed) throw freed.error();
    }
  }

  // r goes back to the front of the queue, its pages freed: it is recomputed from its first token when admitted.
  void preempt(EngineRequest& r) {
    free_slot(r.slot);
    r.slot = -1;
    r.computed = 0;
    r.registered_pages = 0;
    r.draft_computed = 0;
    running_.erase(std::remove(running_.begin(), running_.end(), &r), running_.end());
    waiting_.push_front(&r);
  }

  KVPagePool* pool_ = nullptr;
  int64_t main_window_ = 0;            // > 0: pool_'s sequences keep only this window (every layer slides)
  KVPagePool* window_pool_ = nullptr;  // the sliding layers' pages, or nullptr
  int64_t window_ = 0;
  int64_t max_batched_tokens_ = 0;
  bool prefix_cache_ = false;
  std::vector<int32_t> attach_pages_;            // [max_pages_per_seq]: a cached prefix's pages, found at admission
  std::vector<int32_t> attach_window_pages_;     // [max_pages_per_seq]: its sliding layers' (-1 before the window)
  std::deque<EngineRequest*> waiting_;           // FIFO; preempted requests go back to the front
  std::vector<EngineRequest*> running_;          // in start order: the last one is preempted first
  std::vector<ScheduledRequest> scheduled_;      // capacity max_seqs
};

}  // namespace detail
}  // namespace kvlite
