// ---------------------------------------------------------------------------------------------------------
// arena: the one reservation, its regions, and the KV page pool carved from its last region.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// KV page layout (elements of the KV dtype), one page covering every layer:
//   page[layer][kv: 0 = K, 1 = V][token_in_page][kv_head][head_dim]
// so a page is freed and reused whole, and a layer's K block for a page is contiguous.
struct KVPageLayout {
  int64_t layers = 0, page_tokens = 0, kv_heads = 0, head_dim = 0;
  KVLITE_HD int64_t page_elements() const { return layers * 2 * page_tokens * kv_heads * head_dim; }
  KVLITE_HD int64_t offset(int64_t page, int64_t layer, int64_t kv, int64_t token_in_page, int64_t kv_head) const {
    return (((page * layers + layer) * 2 + kv) * page_tokens + token_in_page) * kv_heads * head_dim + kv_head * head_dim;
  }
};

// Fixed-size pages with O(1) alloc/free (a free stack), reference counts (for prefix sharing), and one
// block table per sequence slot: a preallocated [max_seqs, max_pages_per_seq] int32 matrix, the form
// attention kernels read. No allocation happens after construction.
class KVPagePool {
 public:
  struct Stats {
    int64_t total_pages = 0, free_pages = 0, used_pages = 0, peak_used_pages = 0;
    int64_t live_sequences = 0;
    uint64_t page_allocs = 0, page_frees = 0;
    int64_t tokens_stored = 0;   // sum of live sequences' lengths
    int64_t token_capacity = 0;  // used_pages x page_tokens
  };
  KVPagePool() = default;
  KVPagePool(int64_t num_pages, int64_t page_tokens, int64_t max_seqs, int64_t max_pages_per_seq);

  int64_t page_tokens() const { return page_tokens_; }
  int64_t max_seqs() const { return max_seqs_; }
  int64_t max_pages_per_seq() const { return max_pages_per_seq_; }

  // Pages. alloc_page returns -1 when none is free.
  int32_t alloc_page();
  void retain_page(int32_t page);
  void release_page(int32_t page);  // frees the page when its count reaches zero
  int32_t page_refcount(int32_t page) const;

  // Sequences. seq_create returns a slot id or -1 when all max_seqs slots are live.
  int32_t seq_create();
  // Grows the sequence to hold `tokens` tokens, taking pages as needed. All or nothing: on failure nothing
  // changes (out_of_memory when pages run out, does_not_fit past max_pages_per_seq), with the numbers.
  Status seq_reserve(int32_t seq, int64_t tokens);
  void seq_free(int32_t seq);  // releases its pages and the slot
  int64_t seq_tokens(int32_t seq) const;
  int64_t seq_pages(int32_t seq) const;
  const int32_t* block_table(int32_t seq) const;  // row of max_pages_per_seq entries; -1 past seq_pages
  const int32_t* block_tables() const { return tables_.data(); }  // [max_seqs, max_pages_per_seq]
  // Pages needed for `tokens` tokens.
  int64_t pages_for(int64_t tokens) const { return (tokens + page_tokens_ - 1) / page_tokens_; }

  Stats stats() const;

 private:
  int64_t page_tokens_ = 16, max_seqs_ = 0, max_pages_per_seq_ = 0;
  std::vector<int32_t> free_stack_;   // capacity num_pages, never grows
  std::vector<int32_t> refcount_;     // [num_pages]
  std::vector<int32_t> tables_;       // [max_seqs * max_pages_per_seq]
  std::vector<int64_t> seq_tokens_;   // [max_seqs], -1 when the slot is free
  std::vector<int64_t> seq_pages_;    // [max_seqs]
  std::vector<int32_t> free_slots_;   // capacity max_seqs
  int64_t peak_used_ = 0;
  uint64_t allocs_ = 0, frees_ = 0;
};

struct ArenaRegion {
  std::string key;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// The one reservation of plan.arena_bytes(): one aligned host allocation for the CPU backend, one
// cudaMalloc for CUDA. Regions follow the plan's in_arena items in order, each 256-byte aligned (the plan
// rounds every item up to that), then the KV pages.
class Arena {
 public:
  static Result<std::unique_ptr<Arena>> create(const Plan& plan, const ModelConfig& config);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  BackendKind backend() const { return backend_; }
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  const std::vector<ArenaRegion>& regions() const { return regions_; }
  const ArenaRegion* region(const std::string& key) const;
  uint8_t* region_data(const std::string& key) const;  // nullptr when absent
  KVPagePool& kv() { return kv_; }
  const KVPageLayout& kv_layout() const { return kv_layout_; }
  // System (host or device) allocations made for the arena's memory after create() returned. kvlite's
  // promise is that this stays 0; tests assert it.
  static uint64_t allocations_after_start();

 private:
  Arena() = default;
  BackendKind backend_ = BackendKind::cpu;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::vector<ArenaRegion> regions_;
  KVPagePool kv_;
  KVPageLayout kv_layout_;
};

}  // namespace kvlite
