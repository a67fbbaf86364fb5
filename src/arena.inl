// arena: implementation.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <limits>

namespace kvlite {

// ---- the one door for arena memory ---------------------------------------------------------------------
namespace detail {
// The counter is on while at least one Arena is live (finished create() and not yet destroyed). The thread
// inside Arena::create() is exempt while it builds that arena: those are the allocations kvlite plans.
static std::atomic<int64_t> g_live_arenas{0};
static std::atomic<uint64_t> g_allocations_after_start{0};
static thread_local int g_creating_arena = 0;

struct CreatingArenaScope {
  CreatingArenaScope() { g_creating_arena++; }
  ~CreatingArenaScope() { g_creating_arena--; }
  CreatingArenaScope(const CreatingArenaScope&) = delete;
  CreatingArenaScope& operator=(const CreatingArenaScope&) = delete;
};

void* acquire_arena_memory(BackendKind backend, uint64_t bytes, uint64_t alignment, const char* what) {
  // An attempt counts whether or not it succeeds: asking the system for memory after start is the failure.
  if (g_live_arenas.load(std::memory_order_relaxed) > 0 && g_creating_arena == 0)
    g_allocations_after_start.fetch_add(1, std::memory_order_relaxed);
  if (backend == BackendKind::cuda) {
    Result<void*> pointer = cuda::allocate_arena(bytes);
    if (!pointer) fail(pointer.error().code, format("%s: %s", what, pointer.error().message.c_str()));
    return *pointer;
  }
  // posix_memalign wants a power-of-two multiple of sizeof(void*); a zero-byte request still gets a pointer.
  alignment = std::max<uint64_t>(alignment, sizeof(void*));
  void* pointer = nullptr;
  int status = bytes > std::numeric_limits<size_t>::max()
                   ? ENOMEM
                   : posix_memalign(&pointer, size_t(alignment), size_t(std::max<uint64_t>(bytes, 1)));
  if (status != 0)
    fail(ErrorCode::out_of_memory,
         format("cannot allocate %s (%llu bytes) of host memory for %s: %s; plan for less memory "
                "(--device-mem, --utilization) or a shorter --max-model-len",
                format_bytes(bytes).c_str(), (unsigned long long)bytes, what, strerror(status)));
  return pointer;
}

void release_arena_memory(BackendKind backend, void* pointer) noexcept {
  if (!pointer) return;
  if (backend == BackendKind::cuda) {
    // A failed cudaFree at teardown leaves nothing to undo (the context is broken or going away), and a
    // destructor must not throw: the status is dropped on purpose.
    (void)cuda::free_arena(pointer);
    return;
  }
  free(pointer);
}

ArenaLayout arena_layout(const Plan& plan) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  ArenaLayout layout;
  uint64_t end = 0;
  auto add = [&](const std::string& key, uint64_t bytes) {
    if (key.empty()) fail(ErrorCode::invalid_argument, "a plan item in the arena has no key; every region needs one");
    for (const ArenaRegion& region : layout.regions)
      if (region.key == key)
        fail(ErrorCode::invalid_argument,
             format("the plan lists the arena region '%s' twice; every in_arena item needs its own key (the "
                    "\"kv\" region is added by the arena from kv_pages, not listed among plan.items)",
                    key.c_str()));
    if (end > kMax - (kArenaRegionAlignment - 1) || bytes > kMax - align_up(end, kArenaRegionAlignment))
      fail(ErrorCode::invalid_argument,
           format("the arena overflows 64 bits at region '%s' (%llu bytes after %llu): the plan is corrupt",
                  key.c_str(), (unsigned long long)bytes, (unsigned long long)end));
    uint64_t offset = align_up(end, kArenaRegionAlignment);
    layout.regions.push_back(ArenaRegion{key, offset, bytes});
    end = offset + bytes;
  };
  for (const PlanItem& item : plan.items)
    if (item.in_arena) add(item.key, item.bytes);
  if (plan.kv_page_bytes != 0 && plan.kv_pages > kMax / plan.kv_page_bytes)
    fail(ErrorCode::invalid_argument, format("the KV region overflows 64 bits (%llu pages of %llu bytes): the plan is corrupt",
                                             (unsigned long long)plan.kv_pages, (unsigned long long)plan.kv_page_bytes));
  add("kv", plan.kv_pages * plan.kv_page_bytes);
  if (plan.kv_window_pages != 0) {  // the sliding layers' pages (Plan::kv_window)
    if (plan.kv_window_page_bytes == 0 || plan.kv_window_pages > kMax / plan.kv_window_page_bytes)
      fail(ErrorCode::invalid_argument, "the sliding windows' KV region overflows 64 bits or has empty pages: the plan is corrupt");
    add("kv_window", plan.kv_window_pages * plan.kv_window_page_bytes);
  }
  if (plan.draft_kv_page_bytes != 0) {  // a draft model's KV: the same pages, its own layout (speculative decoding)
    if (plan.kv_pages > kMax / plan.draft_kv_page_bytes)
      fail(ErrorCode::invalid_argument, "the draft model's KV region overflows 64 bits: the plan is corrupt");
    add("draft_kv", plan.kv_pages * plan.draft_kv_page_bytes);
  }
  layout.total_bytes = end;
  return layout;
}
}  // namespace detail

// ---- KVPagePool --------------------------------------------------------------------------------------------
Result<KVPagePool> KVPagePool::create(int64_t num_pages, int64_t page_tokens, int64_t max_seqs,
                                      int64_t max_pages_per_seq) {
  return detail::guard([&]() -> KVPagePool {
    constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    auto bad = [](const char* name, int64_t value, const char* range) {
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("KV page pool: %s %lld is out of range %s", name, (long long)value, range));
    };
    if (num_pages < 0 || num_pages > kMaxId) bad("num_pages", num_pages, "[0, 2^31) (block tables hold int32 page ids)");
    if (page_tokens <= 0) bad("page_tokens", page_tokens, "(0, ...)");
    if (max_seqs <= 0 || max_seqs > kMaxId) bad("max_seqs", max_seqs, "(0, 2^31)");
    if (max_pages_per_seq <= 0 || max_pages_per_seq > kMaxId) bad("max_pages_per_seq", max_pages_per_seq, "(0, 2^31)");
    if (max_seqs > kMax / 4 / max_pages_per_seq || page_tokens > kMax / max_pages_per_seq)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("KV page pool: %lld sequences x %lld pages of %lld tokens overflows 64 bits",
                                  (long long)max_seqs, (long long)max_pages_per_seq, (long long)page_tokens));
    KVPagePool pool;
    pool.page_tokens_ = page_tokens;
    pool.max_seqs_ = max_seqs;
    pool.max_pages_per_seq_ = max_pages_per_seq;
    // Stacks pop from the end: fill them in reverse so page 0 and slot 0 come out first.
    pool.free_stack_ = detail::ArenaVector<int32_t>(size_t(num_pages));
    for (int64_t i = 0; i < num_pages; i++) pool.free_stack_[size_t(i)] = int32_t(num_pages - 1 - i);
    pool.free_pages_ = num_pages;
    pool.refcount_ = detail::ArenaVector<int32_t>(size_t(num_pages), 0);
    pool.tables_ = detail::ArenaVector<int32_t>(size_t(max_seqs * max_pages_per_seq), -1);
    pool.seq_tokens_ = detail::ArenaVector<int64_t>(size_t(max_seqs), -1);
    pool.seq_pages_ = detail::ArenaVector<int64_t>(size_t(max_seqs), 0);
    pool.seq_first_ = detail::ArenaVector<int64_t>(size_t(max_seqs), 0);
    pool.free_slots_ = detail::ArenaVector<int32_t>(size_t(max_seqs));
    for (int64_t i = 0; i < max_seqs; i++) pool.free_slots_[size_t(i)] = int32_t(max_seqs - 1 - i);
    pool.free_slot_count_ = max_seqs;
    size_t buckets = 1;
    while (buckets < size_t(num_pages)) buckets *= 2;
    pool.page_key_ = detail::ArenaVector<uint64_t>(size_t(num_pages), 0);
    pool.cached_ = detail::ArenaVector<uint8_t>(size_t(num_pages), 0);
    pool.bucket_head_ = detail::ArenaVector<int32_t>(buckets, -1);
    pool.bucket_next_ = detail::ArenaVector<int32_t>(size_t(num_pages), -1);
    pool.lru_prev_ = detail::ArenaVector<int32_t>(size_t(num_pages), -1);
    pool.lru_next_ = detail::ArenaVector<int32_t>(size_t(num_pages), -1);
    return pool;
  });
}

uint64_t KVPagePool::metadata_bytes() const {
  return free_stack_.capacity() * sizeof(int32_t) + refcount_.capacity() * sizeof(int32_t) +
         tables_.capacity() * sizeof(int32_t) + seq_tokens_.capacity() * sizeof(int64_t) +
         (seq_pages_.capacity() + seq_first_.capacity()) * sizeof(int64_t) + free_slots_.capacity() * sizeof(int32_t) +
         page_key_.capacity() * sizeof(uint64_t) + cached_.capacity() + bucket_head_.capacity() * sizeof(int32_t) +
         (bucket_next_.capacity() + lru_prev_.capacity() + lru_next_.capacity()) * sizeof(int32_t);
}

void KVPagePool::lru_unlink(int32_t page) {
  const int32_t prev = lru_prev_[size_t(page)], next = lru_next_[size_t(page)];
  (prev >= 0 ? lru_next_[size_t(prev)] : lru_head_) = next;
  (next >= 0 ? lru_prev_[size_t(next)] : lru_tail_) = prev;
  lru_prev_[size_t(page)] = lru_next_[size_t(page)] = -1;
  cache_only_--;
}

void KVPagePool::lru_push(int32_t page) {  // as the most recently used
  lru_prev_[size_t(page)] = lru_tail_;
  lru_next_[size_t(page)] = -1;
  (lru_tail_ >= 0 ? lru_next_[size_t(lru_tail_)] : lru_head_) = page;
  lru_tail_ = page;
  cache_only_++;
}

int32_t KVPagePool::take_page() {
  int32_t page = -1;
  if (free_pages_ > 0) {
    page = free_stack_[size_t(--free_pages_)];
  } else if (lru_head_ >= 0) {  // evict the least recently used cache-only page
    page = lru_head_;
    lru_unlink(page);
    int32_t* link = &bucket_head_[size_t(page_key_[size_t(page)] & (bucket_head_.size() - 1))];
    while (*link != page) link = &bucket_next_[size_t(*link)];
    *link = bucket_next_[size_t(page)];
    bucket_next_[size_t(page)] = -1;
    cached_[size_t(page)] = 0;
    cached_count_--;
    evictions_++;
  } else {
    return -1;
  }
  refcount_[size_t(page)] = 1;
  allocs_++;
  peak_used_ = std::max(peak_used_, num_pages() - free_pages_ - cache_only_);
  return page;
}

void KVPagePool::dropped_to(int32_t page) {
  const int32_t count = refcount_[size_t(page)];
  if (count == 0) {
    free_stack_[size_t(free_pages_++)] = page;
    frees_++;
  } else if (count == 1 && cached_[size_t(page)]) {
    lru_push(page);
  }
}

int32_t KVPagePool::alloc_page() { return take_page(); }

Result<bool> KVPagePool::cache_insert(int32_t page, uint64_t key) {
  return detail::guard([&]() -> bool {
    if (page_refcount(page) <= 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cache_insert: page %d is not allocated (pool of %lld pages)", page, (long long)num_pages()));
    if (cached_[size_t(page)] || cache_lookup(key) >= 0) return false;
    page_key_[size_t(page)] = key;
    cached_[size_t(page)] = 1;
    int32_t& head = bucket_head_[size_t(key & (bucket_head_.size() - 1))];
    bucket_next_[size_t(page)] = head;
    head = page;
    cached_count_++;
    refcount_[size_t(page)]++;  // the cache's reference (a page in use: not evictable until its users let go)
    return true;
  });
}

int32_t KVPagePool::cache_lookup(uint64_t key) const {
  if (bucket_head_.empty()) return -1;
  for (int32_t page = bucket_head_[size_t(key & (bucket_head_.size() - 1))]; page >= 0; page = bucket_next_[size_t(page)])
    if (page_key_[size_t(page)] == key) return page;
  return -1;
}

Status KVPagePool::seq_attach(int32_t seq, const int32_t* pages, int64_t count) {
  return detail::guard([&] {
    if (!live(seq) || seq_tokens_[size_t(seq)] != 0 || seq_pages_[size_t(seq)] != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("seq_attach: sequence slot %d is not a live, empty sequence", seq));
    if (count < 0 || count > max_pages_per_seq_)
      detail::fail(ErrorCode::invalid_argument, detail::format("seq_attach: %lld pages for a sequence of at most %lld",
                                                               (long long)count, (long long)max_pages_per_seq_));
    int64_t first = 0;  // leading -1 entries: pages a sliding window no longer reads
    while (first < count && pages[first] == -1) first++;
    for (int64_t i = first; i < count; i++)
      if (page_refcount(pages[i]) <= 0 || !cached_[size_t(pages[i])])
        detail::fail(ErrorCode::invalid_argument, detail::format("seq_attach: page %d is not a cached page", pages[i]));
    int32_t* row = &tables_[size_t(seq * max_pages_per_seq_)];
    seq_first_[size_t(seq)] = first;
    for (int64_t i = first; i < count; i++) {
      const int32_t page = pages[i];
      if (refcount_[size_t(page)] == 1) lru_unlink(page);  // only the cache held it: in use again
      refcount_[size_t(page)]++;
      row[i] = page;
    }
    seq_pages_[size_t(seq)] = count;
    seq_tokens_[size_t(seq)] = count * page_tokens_;
    tokens_stored_ += count * page_tokens_;
    peak_used_ = std::max(peak_used_, num_pages() - free_pages_ - cache_only_);
  });
}

Status KVPagePool::retain_page(int32_t page) {
  return detail::guard([&] {
    if (page_refcount(page) <= 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("retain_page: page %d is not allocated (pool of %lld pages); retain a page that "
                                  "alloc_page or a block table gave you",
                                  page, (long long)num_pages()));
    if (refcount_[size_t(page)] == std::numeric_limits<int32_t>::max())
      detail::fail(ErrorCode::invalid_argument, detail::format("retain_page: page %d's reference count is at its maximum", page));
    if (refcount_[size_t(page)] == 1 && cached_[size_t(page)]) lru_unlink(page);
    refcount_[size_t(page)]++;
  });
}

Status KVPagePool::release_page(int32_t page) {
  return detail::guard([&] {
    if (page_refcount(page) <= 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("release_page: page %d is not allocated (pool of %lld pages): a release without a "
                                  "matching alloc_page or retain_page",
                                  page, (long long)num_pages()));
    --refcount_[size_t(page)];
    dropped_to(page);
  });
}

int32_t KVPagePool::page_refcount(int32_t page) const {
  if (page < 0 || page >= num_pages()) return -1;
  return refcount_[size_t(page)];
}

bool KVPagePool::live(int32_t seq) const { return seq >= 0 && seq < max_seqs_ && seq_tokens_[size_t(seq)] >= 0; }

int32_t KVPagePool::seq_create() {
  if (free_slot_count_ == 0) return -1;
  int32_t seq = free_slots_[size_t(--free_slot_count_)];
  seq_tokens_[size_t(seq)] = 0;
  seq_pages_[size_t(seq)] = 0;
  seq_first_[size_t(seq)] = 0;
  return seq;
}

Status KVPagePool::seq_reserve(int32_t seq, int64_t tokens) {
  return detail::guard([&] {
    if (!live(seq))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("seq_reserve: sequence slot %d is not live (slots 0..%lld; seq_create one first)", seq,
                                  (long long)max_seqs_ - 1));
    if (tokens < 0)
      detail::fail(ErrorCode::invalid_argument, detail::format("seq_reserve: sequence %d asked for %lld tokens", seq, (long long)tokens));
    int64_t& length = seq_tokens_[size_t(seq)];
    if (tokens <= length) return;
    int64_t limit_tokens = max_pages_per_seq_ * page_tokens_;
    if (tokens > limit_tokens)
      detail::fail(ErrorCode::does_not_fit,
                   detail::format("sequence %d cannot grow to %lld tokens: that needs %llu pages of %lld tokens, past "
                                  "the %lld pages a sequence may hold (%lld tokens, from max_model_len); raise "
                                  "--max-model-len or shorten the request",
                                  seq, (long long)tokens, (unsigned long long)ceil_div(uint64_t(tokens), uint64_t(page_tokens_)),
                                  (long long)page_tokens_, (long long)max_pages_per_seq_, (long long)limit_tokens));
    int64_t& pages = seq_pages_[size_t(seq)];
    int64_t needed = pages_for(tokens) - pages;
    if (needed > free_pages_ + cache_only_)
      detail::fail(ErrorCode::out_of_memory,
                   detail::format("KV cache full: sequence %d needs %lld more pages, %lld free of %lld (growing from %lld "
                                  "to %lld tokens, %lld tokens per page); finish or preempt a sequence, or plan more "
                                  "KV memory",
                                  seq, (long long)needed, (long long)(free_pages_ + cache_only_), (long long)num_pages(),
                                  (long long)length, (long long)tokens, (long long)page_tokens_));
    int32_t* row = &tables_[size_t(seq * max_pages_per_seq_)];
    for (int64_t i = 0; i < needed; i++) row[pages + i] = take_page();  // (counted above: never -1)
    pages += needed;
    tokens_stored_ += tokens - length;
    length = tokens;
  });
}

Status KVPagePool::seq_free(int32_t seq) {
  return detail::guard([&] {
    if (!live(seq))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("seq_free: sequence slot %d is not live (freed twice, or never created)", seq));
    int32_t* row = &tables_[size_t(seq * max_pages_per_seq_)];
    int64_t pages = seq_pages_[size_t(seq)];
    const int64_t first = seq_first_[size_t(seq)];  // (earlier pages were released: their entries are -1)
    // Check the whole row before touching anything, so a corrupt table leaves the pool as it was.
    for (int64_t i = first; i < pages; i++)
      if (row[i] < 0 || row[i] >= num_pages() || refcount_[size_t(row[i])] <= 0)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("seq_free: page %d in sequence %d's block table is already free (released "
                                    "through release_page while the sequence held it)",
                                    row[i], seq));
    for (int64_t i = first; i < pages; i++) {
      const int32_t page = row[i];
      if (--refcount_[size_t(page)] == 0) dropped_to(page);  // freed, in table order
    }
    // Pages left to the cache alone, last first: a prefix's later pages become least recently used before its
    // first ones, so eviction shortens cached prefixes from their end (a chain is found from its start).
    for (int64_t i = pages - 1; i >= first; i--) {
      if (refcount_[size_t(row[i])] == 1) dropped_to(row[i]);
      row[i] = -1;
    }
    seq_first_[size_t(seq)] = 0;
    tokens_stored_ -= seq_tokens_[size_t(seq)];
    seq_tokens_[size_t(seq)] = -1;
    seq_pages_[size_t(seq)] = 0;
    free_slots_[size_t(free_slot_count_++)] = seq;
  });
}

Status KVPagePool::seq_release_before(int32_t seq, int64_t token) {
  return detail::guard([&] {
    if (!live(seq))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("seq_release_before: sequence slot %d is not live", seq));
    int32_t* row = &tables_[size_t(seq * max_pages_per_seq_)];
    int64_t& first = seq_first_[size_t(seq)];
    // pages [first, end) hold only tokens before `token`
    const int64_t end = std::min<int64_t>(std::max<int64_t>(token, 0) / page_tokens_, seq_pages_[size_t(seq)]);
    for (; first < end; first++) {
      const int32_t page = row[first];
      row[first] = -1;
      --refcount_[size_t(page)];
      dropped_to(page);  // free at 0; a cached page the cache alone holds becomes evictable
    }
  });
}

int64_t KVPagePool::seq_first_page(int32_t seq) const { return live(seq) ? seq_first_[size_t(seq)] : 0; }

int64_t KVPagePool::seq_tokens(int32_t seq) const { return live(seq) ? seq_tokens_[size_t(seq)] : -1; }
int64_t KVPagePool::seq_pages(int32_t seq) const { return live(seq) ? seq_pages_[size_t(seq)] : 0; }

const int32_t* KVPagePool::block_table(int32_t seq) const {
  if (seq < 0 || seq >= max_seqs_) return nullptr;
  return &tables_[size_t(seq * max_pages_per_seq_)];
}

KVPagePool::Stats KVPagePool::stats() const {
  Stats stats;
  stats.total_pages = num_pages();
  stats.free_pages = free_pages_ + cache_only_;
  stats.used_pages = num_pages() - stats.free_pages;
  stats.cached_pages = cached_count_;
  stats.cache_only_pages = cache_only_;
  stats.cache_evictions = evictions_;
  stats.peak_used_pages = peak_used_;
  stats.live_sequences = max_seqs_ - free_slot_count_;
  stats.page_allocs = allocs_;
  stats.page_frees = frees_;
  stats.tokens_stored = tokens_stored_;
  stats.token_capacity = stats.used_pages * page_tokens_;
  return stats;
}

// ---- Arena -------------------------------------------------------------------------------------------------
Result<std::unique_ptr<Arena>> Arena::create(const Plan& plan, const ModelConfig& config) {
  return detail::guard([&]() -> std::unique_ptr<Arena> {
    if (!plan.fits)
      detail::fail(ErrorCode::does_not_fit,
                   detail::format("the plan for '%s' does not fit: it needs %s more memory%s%s; run `kvlite plan` "
                                  "to see where every byte goes and what would fit",
                                  plan.model_name.c_str(), format_bytes_signed(plan.shortfall_bytes).c_str(),
                                  plan.advice.empty() ? "" : ". ", plan.advice.empty() ? "" : plan.advice[0].c_str()));
    if (plan.kv_pages == 0 || plan.kv_page_tokens == 0 || plan.kv_page_bytes == 0)
      detail::fail(ErrorCode::does_not_fit,
                   detail::format("the plan for '%s' has no KV cache (%llu pages of %llu tokens, %llu bytes each); "
                                  "run `kvlite plan` to see what would fit",
                                  plan.model_name.c_str(), (unsigned long long)plan.kv_pages,
                                  (unsigned long long)plan.kv_page_tokens, (unsigned long long)plan.kv_page_bytes));
    if (plan.options.max_seqs <= 0 || plan.max_model_len <= 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("the plan has max_seqs %lld and max_model_len %lld; both must be > 0 (make_plan "
                                  "resolves them)",
                                  (long long)plan.options.max_seqs, (long long)plan.max_model_len));
    const TextConfig& text = config.text;
    if (text.num_layers <= 0 || text.num_kv_heads <= 0 || text.head_dim <= 0 ||
        plan.kv_page_tokens > uint64_t(std::numeric_limits<int32_t>::max()))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%s: the KV cache needs num_hidden_layers, num_key_value_heads, head_dim and "
                                  "page tokens > 0 (got %lld, %lld, %lld, %llu)",
                                  config.origin.c_str(), (long long)text.num_layers, (long long)text.num_kv_heads,
                                  (long long)text.head_dim, (unsigned long long)plan.kv_page_tokens));
    // The full-attention layers' pages ("kv": every layer unless the sliding ones have pages of their own).
    const KVGroups groups = kv_groups(text, plan.kv_window > 0);
    if ((groups.window_layers > 0) != (plan.kv_window_pages > 0) ||
        uint64_t(groups.window_layers > 0 ? groups.window : groups.main_window) != plan.kv_window)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("the plan keeps sliding windows in %llu pages of their own (window %llu) but %s has "
                                  "%lld sliding layers beside %lld full ones (window %lld); make the plan from the same "
                                  "config",
                                  (unsigned long long)plan.kv_window_pages, (unsigned long long)plan.kv_window,
                                  config.origin.empty() ? "the model" : config.origin.c_str(),
                                  (long long)groups.window_layers, (long long)groups.full_layers, (long long)groups.window));
    KVPageLayout kv_layout{groups.full_layers, int64_t(plan.kv_page_tokens), text.num_kv_heads, text.head_dim};
    // The plan's page bytes come from its KV dtype; the page's element count from the model: they must agree
    // on a whole element size, or the kernels would index a different cache than the one reserved.
    uint64_t page_elements = uint64_t(kv_layout.page_elements());
    uint64_t element_bytes = plan.kv_page_bytes / page_elements;
    if (plan.kv_page_bytes % page_elements != 0 || (element_bytes != 1 && element_bytes != 2 && element_bytes != 4))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("the plan's KV page of %llu bytes does not match %s: %lld layers x 2 x %llu tokens "
                                  "x %lld KV heads x %lld head_dim = %llu elements, not 1, 2 or 4 bytes each; make "
                                  "the plan from the same config",
                                  (unsigned long long)plan.kv_page_bytes,
                                  config.origin.empty() ? "the model's KV shape" : config.origin.c_str(),
                                  (long long)groups.full_layers, (unsigned long long)plan.kv_page_tokens,
                                  (long long)text.num_kv_heads, (long long)text.head_dim,
                                  (unsigned long long)page_elements));
    KVPageLayout window_layout{groups.window_layers, int64_t(plan.kv_page_tokens), text.num_kv_heads, text.head_dim};
    if (groups.window_layers > 0 && plan.kv_window_page_bytes != uint64_t(window_layout.page_elements()) * element_bytes)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("the plan's sliding-window KV page of %llu bytes does not match %lld sliding layers "
                                  "x 2 x %llu tokens x %lld KV heads x %lld head_dim x %llu bytes; make the plan from "
                                  "the same config",
                                  (unsigned long long)plan.kv_window_page_bytes, (long long)groups.window_layers,
                                  (unsigned long long)plan.kv_page_tokens, (long long)text.num_kv_heads,
                                  (long long)text.head_dim, (unsigned long long)element_bytes));

    detail::ArenaLayout layout = detail::arena_layout(plan);
    detail::CreatingArenaScope creating;
    std::unique_ptr<Arena> arena(new Arena());
    arena->backend_ = plan.device.backend;
    // From here a failure frees what was taken: ~Arena releases base_ (started_ is still false).
    arena->base_ = static_cast<uint8_t*>(
        detail::acquire_arena_memory(arena->backend_, layout.total_bytes, detail::kArenaHostAlignment, "the arena"));
    arena->size_ = layout.total_bytes;
    arena->regions_ = std::move(layout.regions);
    int64_t max_pages_per_seq = int64_t(ceil_div(uint64_t(plan.max_model_len), plan.kv_page_tokens));
    Result<KVPagePool> pool =
        KVPagePool::create(int64_t(std::min<uint64_t>(plan.kv_pages, uint64_t(std::numeric_limits<int64_t>::max()))),
                           int64_t(plan.kv_page_tokens), plan.options.max_seqs, max_pages_per_seq);
    if (!pool) throw pool.error();
    arena->kv_ = std::move(*pool);
    arena->kv_layout_ = kv_layout;
    arena->main_window_ = groups.main_window;
    if (groups.window_layers > 0) {
      Result<KVPagePool> window_pool =
          KVPagePool::create(int64_t(std::min<uint64_t>(plan.kv_window_pages, uint64_t(std::numeric_limits<int64_t>::max()))),
                             int64_t(plan.kv_page_tokens), plan.options.max_seqs, max_pages_per_seq);
      if (!window_pool) throw window_pool.error();
      arena->kv_window_ = std::move(*window_pool);
      arena->kv_window_layout_ = window_layout;
      arena->window_ = groups.window;
    }
    arena->kv_element_bytes_ = int(element_bytes);
    arena->started_ = true;
    detail::g_live_arenas.fetch_add(1, std::memory_order_relaxed);
    return arena;
  });
}

Arena::~Arena() {
  if (started_) detail::g_live_arenas.fetch_sub(1, std::memory_order_relaxed);
  detail::release_arena_memory(backend_, base_);
}

const ArenaRegion* Arena::region(const std::string& key) const {
  for (const ArenaRegion& r : regions_)
    if (r.key == key) return &r;
  return nullptr;
}

uint8_t* Arena::region_data(const std::string& key) const {
  const ArenaRegion* r = region(key);
  return r ? base_ + r->offset : nullptr;
}

uint64_t Arena::allocations_after_start() { return detail::g_allocations_after_start.load(std::memory_order_relaxed); }

}  // namespace kvlite
