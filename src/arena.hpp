// ---------------------------------------------------------------------------------------------------------
// arena: the one reservation, its regions, and the KV page pool carved from its last region.
//
//   base_ ──► | weights | repack | activations | ... | graphs | kv: page 0 | page 1 | ... | page P-1 |
//             each region 256-byte aligned, in the plan's item order; the KV region is kv_pages x kv_page_bytes
//
// Every byte of arena and page-pool memory is acquired through detail::acquire_arena_memory, which counts
// acquisitions made after an Arena finished create(): Arena::allocations_after_start() must stay 0.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// KV page layout (elements of the KV dtype), one page covering every layer:
//   page[layer][kv: 0 = K, 1 = V][token_in_page][kv_head][head_dim]
// so a page is freed and reused whole, and a layer's K block for a page is contiguous.
struct KVPageLayout {
  int64_t layers = 0, page_tokens = 0, kv_heads = 0, head_dim = 0;
  KVLITE_HD int64_t page_elements() const { return layers * 2 * page_tokens * kv_heads * head_dim; }
  // Element offset of head_dim[0] of (page, layer, kv, token_in_page, kv_head) from the KV region's start.
  KVLITE_HD int64_t offset(int64_t page, int64_t layer, int64_t kv, int64_t token_in_page, int64_t kv_head) const {
    return (((page * layers + layer) * 2 + kv) * page_tokens + token_in_page) * kv_heads * head_dim + kv_head * head_dim;
  }
};

namespace detail {
// The one door for arena and page-pool memory: `backend` cpu is an aligned host allocation, cuda the
// device reservation (cuda::allocate_arena). Counts the acquisition in Arena::allocations_after_start()
// when an Arena is live and this thread is not inside Arena::create(). Throws Error (out_of_memory with the
// numbers, or the CUDA entry point's error) naming `what`.
void* acquire_arena_memory(BackendKind backend, uint64_t bytes, uint64_t alignment, const char* what);
void release_arena_memory(BackendKind backend, void* pointer) noexcept;

// std::allocator for the page pool's tables, routed through acquire_arena_memory so that any growth after
// start shows up in the counter.
template <class T>
struct ArenaAllocator {
  using value_type = T;
  ArenaAllocator() = default;
  template <class U>
  ArenaAllocator(const ArenaAllocator<U>&) {}  // NOLINT: rebinding, as the standard allocators do
  T* allocate(size_t count) {
    return static_cast<T*>(acquire_arena_memory(BackendKind::cpu, uint64_t(count) * sizeof(T), alignof(T),
                                                 "the KV page pool's tables"));
  }
  void deallocate(T* pointer, size_t) noexcept { release_arena_memory(BackendKind::cpu, pointer); }
  template <class U>
  bool operator==(const ArenaAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const ArenaAllocator<U>&) const { return false; }
};
template <class T>
using ArenaVector = std::vector<T, ArenaAllocator<T>>;
}  // namespace detail

// Fixed-size pages with O(1) alloc/free (a free stack), reference counts (for prefix sharing), and one
// block table per sequence slot: a preallocated [max_seqs, max_pages_per_seq] int32 matrix, the form
// attention kernels read. No allocation happens after construction: every table is sized once and indexed
// with explicit counts, never push_back.
class KVPagePool {
 public:
  struct Stats {
    int64_t total_pages = 0, free_pages = 0, used_pages = 0, peak_used_pages = 0;
    int64_t live_sequences = 0;
    uint64_t page_allocs = 0, page_frees = 0;
    int64_t tokens_stored = 0;   // sum of live sequences' lengths
    int64_t token_capacity = 0;  // used_pages x page_tokens
    // Prefix cache: pages holding a cached prefix's K/V (in use or not), and of those the ones only the cache
    // holds (counted in free_pages: a page allocation takes them, least recently used first, when no page is free).
    int64_t cached_pages = 0, cache_only_pages = 0;
    uint64_t cache_evictions = 0;
  };
  KVPagePool() = default;  // empty: no pages, no slots
  // num_pages in [0, 2^31), page_tokens, max_seqs and max_pages_per_seq > 0; invalid_argument otherwise.
  static Result<KVPagePool> create(int64_t num_pages, int64_t page_tokens, int64_t max_seqs,
                                   int64_t max_pages_per_seq);

  int64_t num_pages() const { return int64_t(refcount_.size()); }
  int64_t page_tokens() const { return page_tokens_; }
  int64_t max_seqs() const { return max_seqs_; }
  int64_t max_pages_per_seq() const { return max_pages_per_seq_; }
  // Host bytes of the pool's tables (their capacities): fixed at construction.
  uint64_t metadata_bytes() const;

  // Pages. alloc_page returns -1 when none is free; the new page has refcount 1.
  int32_t alloc_page();
  Status retain_page(int32_t page);   // invalid_argument for a page that is not allocated
  Status release_page(int32_t page);  // frees the page when its count reaches zero
  int32_t page_refcount(int32_t page) const;  // 0 for a free page, -1 for an id out of range

  // Prefix cache. A full page whose K/V is final can be entered under a key (a hash chain of the tokens up to
  // and including it: the engine's); the cache then holds a reference to it, so it outlives its sequence. A page
  // only the cache holds is free for allocation, evicted least recently used first; lookups find it until then.
  // cache_insert: false (nothing changes) when the key is already there or the page is cached under another key;
  // invalid_argument for a page that is not allocated.
  Result<bool> cache_insert(int32_t page, uint64_t key);
  int32_t cache_lookup(uint64_t key) const;  // the page, or -1
  // Gives an empty live sequence the pages of a cached prefix (each retained): it then holds count x
  // page_tokens tokens. Leading entries may be -1 (a sliding window's pages before it: never read again), the
  // rest must be cached pages. invalid_argument for a sequence that holds tokens or a page that is not cached.
  Status seq_attach(int32_t seq, const int32_t* pages, int64_t count);

  // Sliding windows: gives back sequence seq's pages whose every token is before `token` (the page's entry becomes
  // -1; a cached page stays in the cache, evictable). Its length and later pages do not change, nor does an earlier
  // call's: the first page it holds only moves forward. invalid_argument for a slot that is not live.
  Status seq_release_before(int32_t seq, int64_t token);
  int64_t seq_first_page(int32_t seq) const;  // the first page seq still holds (0 unless released); 0 when not live

  // Sequences. seq_create returns a slot id or -1 when all max_seqs slots are live.
  int32_t seq_create();
  // Grows the sequence to hold `tokens` tokens, taking pages as needed (a smaller count changes nothing).
  // All or nothing: on failure nothing changes (out_of_memory when pages run out, does_not_fit past
  // max_pages_per_seq), with the numbers.
  Status seq_reserve(int32_t seq, int64_t tokens);
  Status seq_free(int32_t seq);  // releases its pages (each frees at refcount zero) and the slot
  int64_t seq_tokens(int32_t seq) const;  // -1 for a slot that is not live
  int64_t seq_pages(int32_t seq) const;   // 0 for a slot that is not live
  const int32_t* block_table(int32_t seq) const;  // row of max_pages_per_seq entries; -1 past seq_pages
  const int32_t* block_tables() const { return tables_.data(); }  // [max_seqs, max_pages_per_seq]
  // Pages needed for `tokens` tokens.
  int64_t pages_for(int64_t tokens) const { return (tokens + page_tokens_ - 1) / page_tokens_; }

  Stats stats() const;

 private:
  bool live(int32_t seq) const;
  int32_t take_page();             // a free page, else the least recently used cache-only one; -1 when none
  void dropped_to(int32_t page);   // after a reference is dropped: free at 0, evictable at 1 when cached
  void lru_unlink(int32_t page);
  void lru_push(int32_t page);
  int64_t page_tokens_ = 16, max_seqs_ = 0, max_pages_per_seq_ = 0;
  detail::ArenaVector<int32_t> free_stack_;  // [num_pages]; entries [0, free_pages_) are free page ids
  int64_t free_pages_ = 0;
  detail::ArenaVector<int32_t> refcount_;    // [num_pages]
  detail::ArenaVector<int32_t> tables_;      // [max_seqs * max_pages_per_seq], -1 where unused
  detail::ArenaVector<int64_t> seq_tokens_;  // [max_seqs], -1 when the slot is free
  detail::ArenaVector<int64_t> seq_pages_;   // [max_seqs]
  detail::ArenaVector<int64_t> seq_first_;   // [max_seqs] first page held (seq_release_before)
  detail::ArenaVector<int32_t> free_slots_;  // [max_seqs]; entries [0, free_slot_count_) are free slots
  int64_t free_slot_count_ = 0;
  int64_t tokens_stored_ = 0;
  int64_t peak_used_ = 0;
  uint64_t allocs_ = 0, frees_ = 0;
  // Prefix cache: per page its key and whether it has one; keys hashed into buckets (chains through
  // bucket_next_); cache-only pages in a doubly linked LRU list (head: least recently used). All sized at create.
  detail::ArenaVector<uint64_t> page_key_;     // [num_pages]
  detail::ArenaVector<uint8_t> cached_;        // [num_pages]
  detail::ArenaVector<int32_t> bucket_head_;   // [power of two >= num_pages], -1 when empty
  detail::ArenaVector<int32_t> bucket_next_;   // [num_pages]
  detail::ArenaVector<int32_t> lru_prev_, lru_next_;  // [num_pages]
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int64_t cached_count_ = 0, cache_only_ = 0;
  uint64_t evictions_ = 0;
};

struct ArenaRegion {
  std::string key;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

namespace detail {
// Alignment of every region's offset: what cudaMalloc guarantees for the base, and enough for any vector load.
constexpr uint64_t kArenaRegionAlignment = 256;
// Alignment of the CPU backend's host reservation (a page).
constexpr uint64_t kArenaHostAlignment = 4096;
struct ArenaLayout {
  std::vector<ArenaRegion> regions;  // the plan's in_arena items in order, then "kv"
  uint64_t total_bytes = 0;          // the one reservation: the end of the "kv" region
};
// The regions carved from `plan`: each in_arena item in order at a kArenaRegionAlignment offset, then "kv"
// of kv_pages x kv_page_bytes. Plan::arena_bytes() is this total. Throws invalid_argument for a duplicate
// key (the plan must not list "kv" among its items) or sizes that overflow 64 bits.
ArenaLayout arena_layout(const Plan& plan);
}  // namespace detail

// The one reservation of plan.arena_bytes(): one aligned host allocation for the CPU backend, one
// cudaMalloc for CUDA (plan.device.backend decides). Regions follow the plan's in_arena items in order,
// each 256-byte aligned (the plan rounds every item up to that), then the KV pages.
class Arena {
 public:
  // Fails with does_not_fit when the plan does not fit, invalid_argument when the plan and config disagree
  // (KV page bytes vs the model's KV shape), out_of_memory when the reservation fails, unsupported for a
  // CUDA plan in a build without CUDA.
  static Result<std::unique_ptr<Arena>> create(const Plan& plan, const ModelConfig& config);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  BackendKind backend() const { return backend_; }
  uint8_t* base() const { return base_; }  // device memory for the CUDA backend
  uint64_t size() const { return size_; }
  const std::vector<ArenaRegion>& regions() const { return regions_; }
  const ArenaRegion* region(const std::string& key) const;  // nullptr when absent
  uint8_t* region_data(const std::string& key) const;       // nullptr when absent
  KVPagePool& kv() { return kv_; }
  const KVPagePool& kv() const { return kv_; }
  const KVPageLayout& kv_layout() const { return kv_layout_; }
  // The sliding layers' pages (Plan::kv_window): nullptr when every layer's KV is in kv(). Its sequences are kv()'s
  // (the same slots, created and freed together); a sequence holds only the pages its window still reads.
  KVPagePool* kv_window() { return window_ > 0 ? &kv_window_ : nullptr; }
  const KVPagePool* kv_window() const { return window_ > 0 ? &kv_window_ : nullptr; }
  const KVPageLayout& kv_window_layout() const { return kv_window_layout_; }
  int64_t window() const { return window_; }  // W, or 0
  // Every layer slides (Plan::kv_pages_windowed): kv()'s own sequences keep only this window's pages; 0 otherwise.
  int64_t kv_main_window() const { return main_window_; }
  int kv_element_bytes() const { return kv_element_bytes_; }  // 1 (fp8), 2 (bf16, f16) or 4 (f32)
  // System (host or device) allocations made for arena and page-pool memory after an Arena finished
  // create(), process-wide and monotonic. kvlite's promise is that this stays 0; tests assert it.
  static uint64_t allocations_after_start();

 private:
  Arena() = default;
  BackendKind backend_ = BackendKind::cpu;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  bool started_ = false;  // counted among the live arenas that switch the allocation counter on
  std::vector<ArenaRegion> regions_;
  KVPagePool kv_;
  KVPageLayout kv_layout_;
  int kv_element_bytes_ = 0;
  KVPagePool kv_window_;
  KVPageLayout kv_window_layout_;
  int64_t window_ = 0;
  int64_t main_window_ = 0;
};

}  // namespace kvlite
