// arena: the one reservation and its regions, the KV page pool (pages, refcounts, block tables, sequences),
// the page layout, the allocation counter, and the memory-waste simulation that justifies paging.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <deque>
#include <iterator>
#include <map>
#include <random>
#include "kvlite.hpp"
using namespace kvlite;

namespace {

// A tiny model's KV shape with odd sizes, written by hand (config parsing is tested in unit-config).
ModelConfig tiny_config() {
  ModelConfig config;
  config.model_type = "llama";
  config.origin = "tiny/config.json";
  config.text.num_layers = 3;
  config.text.num_kv_heads = 3;
  config.text.head_dim = 7;
  config.text.num_heads = 6;
  config.text.hidden_size = 42;
  return config;
}

// A plan filled by hand (the planner is tested on its own): the items the arena must carve, one of them
// not 256-byte rounded (the arena aligns defensively) and one outside the arena.
//   KV: 2 x 3 layers x 3 heads x 7 head_dim x 2 bytes = 252 B per token; 5 tokens per page = 1260 B.
Plan tiny_plan() {
  Plan plan;
  plan.model_name = "tiny";
  plan.device.backend = BackendKind::cpu;
  plan.fits = true;
  plan.items = {
      {"weights", "weights", 41 * 256, "", true},
      {"context", "CUDA context", 300 * MiB, "", false},
      {"activations", "activations", 7 * 256, "", true},
      {"workspace", "workspace", 1000, "", true},
      {"graphs", "graphs", 256, "", true},
  };
  plan.kv_bytes_per_token = 252;
  plan.kv_page_tokens = 5;
  plan.kv_page_bytes = 1260;
  plan.kv_pages = 37;
  plan.kv_arena_bytes = 37 * 1260;
  plan.kv_tokens = 37 * 5;
  plan.max_model_len = 23;  // 5 pages per sequence, the last one partly used
  plan.options.max_seqs = 4;
  plan.options.max_model_len = 23;
  plan.options.kv_page_tokens = 5;
  return plan;
}

std::unique_ptr<Arena> make_arena(const Plan& plan, const ModelConfig& config) {
  auto arena = Arena::create(plan, config);
  if (!arena) FAIL(arena.error().message);
  return std::move(arena).value();
}

KVPagePool make_pool(int64_t pages, int64_t page_tokens, int64_t max_seqs, int64_t max_pages_per_seq) {
  auto pool = KVPagePool::create(pages, page_tokens, max_seqs, max_pages_per_seq);
  if (!pool) FAIL(pool.error().message);
  return std::move(pool).value();
}

// Everything observable about a pool, to prove a failed call changed nothing.
struct PoolSnapshot {
  KVPagePool::Stats stats;
  std::vector<int32_t> tables, refcounts;
  std::vector<int64_t> tokens, pages;
  explicit PoolSnapshot(const KVPagePool& pool) : stats(pool.stats()) {
    tables.assign(pool.block_tables(), pool.block_tables() + pool.max_seqs() * pool.max_pages_per_seq());
    for (int32_t p = 0; p < pool.num_pages(); p++) refcounts.push_back(pool.page_refcount(p));
    for (int32_t s = 0; s < pool.max_seqs(); s++) {
      tokens.push_back(pool.seq_tokens(s));
      pages.push_back(pool.seq_pages(s));
    }
  }
  bool operator==(const PoolSnapshot& o) const {
    const auto &a = stats, &b = o.stats;
    return a.total_pages == b.total_pages && a.free_pages == b.free_pages && a.used_pages == b.used_pages &&
           a.peak_used_pages == b.peak_used_pages && a.live_sequences == b.live_sequences &&
           a.page_allocs == b.page_allocs && a.page_frees == b.page_frees && a.tokens_stored == b.tokens_stored &&
           a.token_capacity == b.token_capacity && tables == o.tables && refcounts == o.refcounts &&
           tokens == o.tokens && pages == o.pages;
  }
};

}  // namespace

// ---- the reservation and its regions -----------------------------------------------------------------------

TEST_CASE("regions follow the plan's in_arena items in order, 256-byte aligned, then the KV pages") {
  Plan plan = tiny_plan();
  auto arena = make_arena(plan, tiny_config());
  const auto& regions = arena->regions();
  // Expected offsets worked by hand: weights 10496 B at 0; activations 1792 B at 10496; workspace 1000 B at
  // 12288 (ends 13288, not a multiple of 256); graphs 256 B at 13312; kv 37 x 1260 = 46620 B at 13568.
  REQUIRE(regions.size() == 5);
  const char* keys[] = {"weights", "activations", "workspace", "graphs", "kv"};
  const uint64_t offsets[] = {0, 10496, 12288, 13312, 13568};
  const uint64_t bytes[] = {10496, 1792, 1000, 256, 46620};
  for (size_t i = 0; i < regions.size(); i++) {
    CAPTURE(i);
    CHECK(regions[i].key == keys[i]);
    CHECK(regions[i].offset == offsets[i]);
    CHECK(regions[i].bytes == bytes[i]);
  }
  CHECK(arena->size() == 13568 + 46620);
  CHECK(detail::arena_layout(plan).total_bytes == arena->size());
  CHECK(arena->region("context") == nullptr);  // not in the arena: the device spends it, kvlite does not
  CHECK(arena->region_data("context") == nullptr);

  // The same properties stated generally: each in_arena item appears with its bytes, in plan order; regions
  // are aligned, disjoint, increasing and inside the reservation.
  size_t next = 0;
  for (const PlanItem& item : plan.items) {
    if (!item.in_arena) continue;
    REQUIRE(next < regions.size());
    CHECK(regions[next].key == item.key);
    CHECK(regions[next].bytes == item.bytes);
    next++;
  }
  CHECK(regions.back().bytes == plan.kv_pages * plan.kv_page_bytes);
  for (size_t i = 0; i < regions.size(); i++) {
    CHECK(regions[i].offset % 256 == 0);
    CHECK(regions[i].offset + regions[i].bytes <= arena->size());
    if (i > 0) CHECK(regions[i].offset >= regions[i - 1].offset + regions[i - 1].bytes);
    CHECK(arena->region_data(regions[i].key) == arena->base() + regions[i].offset);
  }
  CHECK(reinterpret_cast<uintptr_t>(arena->base()) % 4096 == 0);

  // The page pool and layout come from the same plan and config.
  CHECK(arena->backend() == BackendKind::cpu);
  CHECK(arena->kv().num_pages() == 37);
  CHECK(arena->kv().page_tokens() == 5);
  CHECK(arena->kv().max_seqs() == 4);
  CHECK(arena->kv().max_pages_per_seq() == 5);  // ceil(23 / 5)
  CHECK(arena->kv_layout().layers == 3);
  CHECK(arena->kv_layout().kv_heads == 3);
  CHECK(arena->kv_layout().head_dim == 7);
  CHECK(arena->kv_element_bytes() == 2);
  CHECK(uint64_t(arena->kv_layout().page_elements()) * 2 == plan.kv_page_bytes);
}

TEST_CASE("every byte of every region can be written and read back") {
  Plan plan = tiny_plan();
  auto arena = make_arena(plan, tiny_config());
  // A pattern that differs between regions and along each one, so an overlap or a short region shows.
  auto pattern = [](size_t region, uint64_t i) { return uint8_t((i * 131 + region * 29 + 7) & 0xff); };
  const auto& regions = arena->regions();
  for (size_t r = 0; r < regions.size(); r++) {
    uint8_t* data = arena->region_data(regions[r].key);
    for (uint64_t i = 0; i < regions[r].bytes; i++) data[i] = pattern(r, i);
  }
  for (size_t r = 0; r < regions.size(); r++) {
    const uint8_t* data = arena->region_data(regions[r].key);
    uint64_t mismatches = 0;
    for (uint64_t i = 0; i < regions[r].bytes; i++) mismatches += data[i] != pattern(r, i);
    CAPTURE(regions[r].key);
    CHECK(mismatches == 0);
  }
}

TEST_CASE("create refuses plans that do not fit, disagree with the config, or cannot be reserved") {
  ModelConfig config = tiny_config();
  SUBCASE("a plan that does not fit") {
    Plan plan = tiny_plan();
    plan.fits = false;
    plan.shortfall_bytes = int64_t(3 * MiB);
    plan.advice = {"Lower --max-model-len to 2048."};
    auto arena = Arena::create(plan, config);
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::does_not_fit);
    CHECK(arena.error().message.find("3.0 MiB") != std::string::npos);
    CHECK(arena.error().message.find("Lower --max-model-len to 2048.") != std::string::npos);
  }
  SUBCASE("no KV pages") {
    Plan plan = tiny_plan();
    plan.kv_pages = 0;
    auto arena = Arena::create(plan, config);
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::does_not_fit);
  }
  SUBCASE("page bytes that are not a whole element size of the model's KV shape") {
    Plan plan = tiny_plan();
    plan.kv_page_bytes = 1260 * 3 / 2;  // 1.5 bytes per element: a plan made for another model
    auto arena = Arena::create(plan, config);
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::invalid_argument);
    CHECK(arena.error().message.find("630 elements") != std::string::npos);
    CHECK(arena.error().message.find("tiny/config.json") != std::string::npos);
  }
  SUBCASE("a duplicate region key (the plan listing \"kv\" itself)") {
    Plan plan = tiny_plan();
    plan.items.push_back({"kv", "kv", 1260, "", true});
    auto arena = Arena::create(plan, config);
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::invalid_argument);
    CHECK(arena.error().message.find("'kv' twice") != std::string::npos);
  }
  SUBCASE("a reservation larger than the address space") {
    Plan plan = tiny_plan();
    plan.items[0].bytes = 1ull << 60;
    auto arena = Arena::create(plan, config);
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::out_of_memory);
    std::string total = std::to_string(detail::arena_layout(plan).total_bytes) + " bytes";
    CHECK(arena.error().message.find(total) != std::string::npos);
  }
}

TEST_CASE("a CUDA arena needs a CUDA build and a GPU") {
  Plan plan = tiny_plan();
  plan.device.backend = BackendKind::cuda;
  auto arena = Arena::create(plan, tiny_config());
  if (!cuda::built_with_cuda()) {
    REQUIRE(!arena);
    CHECK(arena.error().code == ErrorCode::unsupported);
    CHECK(arena.error().message.find("without CUDA") != std::string::npos);
  } else if (cuda::device_count() > 0) {
    REQUIRE(arena);
    CHECK((*arena)->backend() == BackendKind::cuda);
    CHECK((*arena)->size() == detail::arena_layout(plan).total_bytes);
    CHECK(reinterpret_cast<uintptr_t>((*arena)->base()) % 256 == 0);
  } else {
    CHECK(!arena);
  }
}

// ---- pages -------------------------------------------------------------------------------------------------

TEST_CASE("pages: a free stack hands out every page once, then -1, and a freed page is the next one out") {
  KVPagePool pool = make_pool(7, 16, 2, 4);
  std::vector<int32_t> pages;
  for (int i = 0; i < 7; i++) pages.push_back(pool.alloc_page());
  CHECK(pages == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(pool.alloc_page() == -1);
  CHECK(pool.stats().free_pages == 0);
  CHECK(pool.stats().used_pages == 7);
  // LIFO: each alloc/free is one stack operation, whatever the pool size.
  REQUIRE(pool.release_page(4));
  REQUIRE(pool.release_page(1));
  CHECK(pool.alloc_page() == 1);
  CHECK(pool.alloc_page() == 4);
  CHECK(pool.alloc_page() == -1);
  auto stats = pool.stats();
  CHECK(stats.page_allocs == 9);
  CHECK(stats.page_frees == 2);
  CHECK(stats.peak_used_pages == 7);
  CHECK(stats.token_capacity == 7 * 16);
}

TEST_CASE("refcounts: retain and release, the page frees at zero, misuse is an error") {
  KVPagePool pool = make_pool(3, 4, 1, 3);
  int32_t page = pool.alloc_page();
  CHECK(pool.page_refcount(page) == 1);
  REQUIRE(pool.retain_page(page));
  REQUIRE(pool.retain_page(page));
  CHECK(pool.page_refcount(page) == 3);
  REQUIRE(pool.release_page(page));
  REQUIRE(pool.release_page(page));
  CHECK(pool.page_refcount(page) == 1);
  CHECK(pool.stats().free_pages == 2);
  REQUIRE(pool.release_page(page));
  CHECK(pool.page_refcount(page) == 0);
  CHECK(pool.stats().free_pages == 3);

  Status twice = pool.release_page(page);
  CHECK(twice.error().code == ErrorCode::invalid_argument);
  CHECK(twice.error().message.find("page 0 is not allocated") != std::string::npos);
  CHECK(pool.retain_page(page).error().code == ErrorCode::invalid_argument);
  CHECK(pool.release_page(3).error().code == ErrorCode::invalid_argument);
  CHECK(pool.release_page(-1).error().code == ErrorCode::invalid_argument);
  CHECK(pool.page_refcount(3) == -1);
  CHECK(pool.stats().free_pages == 3);
}

TEST_CASE("pool parameters out of range are refused") {
  CHECK(KVPagePool::create(-1, 16, 1, 1).error().code == ErrorCode::invalid_argument);
  CHECK(KVPagePool::create(int64_t(1) << 31, 16, 1, 1).error().code == ErrorCode::invalid_argument);
  CHECK(KVPagePool::create(8, 0, 1, 1).error().code == ErrorCode::invalid_argument);
  CHECK(KVPagePool::create(8, 16, 0, 1).error().code == ErrorCode::invalid_argument);
  CHECK(KVPagePool::create(8, 16, 1, 0).error().code == ErrorCode::invalid_argument);
  CHECK(KVPagePool::create(0, 16, 1, 1).ok());  // a pool with no pages is valid; every reserve fails
}

// ---- sequences and block tables ------------------------------------------------------------------------------

TEST_CASE("seq_reserve grows a sequence page by page and fills its block table row") {
  // 11 pages of 5 tokens, 3 slots of up to 4 pages (20 tokens).
  KVPagePool pool = make_pool(11, 5, 3, 4);
  int32_t a = pool.seq_create(), b = pool.seq_create();
  CHECK(a == 0);
  CHECK(b == 1);
  CHECK(pool.seq_tokens(a) == 0);
  CHECK(pool.seq_pages(a) == 0);

  REQUIRE(pool.seq_reserve(a, 1));  // 1 token: page 0
  REQUIRE(pool.seq_reserve(b, 7));  // 7 tokens: pages 1, 2
  REQUIRE(pool.seq_reserve(a, 5));  // still fits page 0
  CHECK(pool.seq_pages(a) == 1);
  REQUIRE(pool.seq_reserve(a, 6));  // needs a second page: 3
  REQUIRE(pool.seq_reserve(a, 3));  // smaller: nothing changes
  CHECK(pool.seq_tokens(a) == 6);
  CHECK(pool.seq_tokens(b) == 7);
  CHECK(pool.seq_pages(a) == 2);
  CHECK(pool.seq_pages(b) == 2);

  const int32_t* row_a = pool.block_table(a);
  const int32_t* row_b = pool.block_table(b);
  CHECK(std::vector<int32_t>(row_a, row_a + 4) == std::vector<int32_t>{0, 3, -1, -1});
  CHECK(std::vector<int32_t>(row_b, row_b + 4) == std::vector<int32_t>{1, 2, -1, -1});
  // The whole matrix, row by row: [max_seqs, max_pages_per_seq], the unused slot all -1.
  CHECK(std::vector<int32_t>(pool.block_tables(), pool.block_tables() + 12) ==
        std::vector<int32_t>{0, 3, -1, -1, 1, 2, -1, -1, -1, -1, -1, -1});

  auto stats = pool.stats();
  CHECK(stats.live_sequences == 2);
  CHECK(stats.used_pages == 4);
  CHECK(stats.tokens_stored == 13);
  CHECK(stats.token_capacity == 20);

  // seq_free returns the pages (page 3 was taken last and goes back on top) and the slot.
  REQUIRE(pool.seq_free(a));
  CHECK(pool.seq_tokens(a) == -1);
  CHECK(pool.seq_pages(a) == 0);
  CHECK(std::vector<int32_t>(row_a, row_a + 4) == std::vector<int32_t>{-1, -1, -1, -1});
  CHECK(pool.page_refcount(0) == 0);
  CHECK(pool.page_refcount(3) == 0);
  stats = pool.stats();
  CHECK(stats.free_pages == 9);
  CHECK(stats.live_sequences == 1);
  CHECK(stats.tokens_stored == 7);
  CHECK(pool.alloc_page() == 3);  // freed in row order 0, 3: the last one pushed comes out first
  REQUIRE(pool.release_page(3));
  CHECK(pool.seq_create() == a);  // the freed slot is reused

  CHECK(pool.seq_free(a).ok());
  CHECK(pool.seq_free(a).error().code == ErrorCode::invalid_argument);
  CHECK(pool.seq_reserve(a, 3).error().code == ErrorCode::invalid_argument);
  CHECK(pool.seq_reserve(7, 3).error().code == ErrorCode::invalid_argument);
  CHECK(pool.seq_reserve(b, -1).error().code == ErrorCode::invalid_argument);
  CHECK(pool.block_table(3) == nullptr);
}

TEST_CASE("seq_reserve is all or nothing: out of pages or past max_pages_per_seq leaves the pool as it was") {
  // 6 pages of 4 tokens; each sequence may hold 5 pages (max_model_len 20).
  KVPagePool pool = make_pool(6, 4, 3, 5);
  int32_t a = pool.seq_create(), b = pool.seq_create();
  REQUIRE(pool.seq_reserve(a, 9));  // 3 pages
  REQUIRE(pool.seq_reserve(b, 4));  // 1 page; 2 free

  SUBCASE("out of pages") {
    PoolSnapshot before(pool);
    Status grown = pool.seq_reserve(b, 16);  // needs 3 more, 2 free
    REQUIRE(!grown);
    CHECK(grown.error().code == ErrorCode::out_of_memory);
    CHECK(grown.error().message.find("needs 3 more pages, 2 free of 6") != std::string::npos);
    CHECK(PoolSnapshot(pool) == before);
    REQUIRE(pool.seq_reserve(b, 12));  // 2 more: exactly what is free
    CHECK(pool.stats().free_pages == 0);
    CHECK(pool.seq_reserve(b, 13).error().code == ErrorCode::out_of_memory);
    CHECK(pool.seq_tokens(b) == 12);
  }
  SUBCASE("past max_pages_per_seq") {
    REQUIRE(pool.seq_free(b));
    PoolSnapshot before(pool);
    Status grown = pool.seq_reserve(a, 21);  // 6 pages > 5 per sequence, although 3 are free
    REQUIRE(!grown);
    CHECK(grown.error().code == ErrorCode::does_not_fit);
    CHECK(grown.error().message.find("needs 6 pages of 4 tokens") != std::string::npos);
    CHECK(grown.error().message.find("5 pages a sequence may hold (20 tokens") != std::string::npos);
    CHECK(PoolSnapshot(pool) == before);
    CHECK(pool.seq_reserve(a, int64_t(1) << 62).error().code == ErrorCode::does_not_fit);  // no overflow
    REQUIRE(pool.seq_reserve(a, 20));
    CHECK(pool.seq_pages(a) == 5);
  }
  SUBCASE("no free slot") {
    CHECK(pool.seq_create() == 2);
    CHECK(pool.seq_create() == -1);
    CHECK(pool.stats().live_sequences == 3);
  }
}

TEST_CASE("seq_release_before gives back the pages wholly before a token, once, and seq_free the rest") {
  KVPagePool pool = make_pool(10, 4, 2, 8);
  const int32_t seq = pool.seq_create();
  REQUIRE(pool.seq_reserve(seq, 20));  // 5 pages: tokens 0-3, 4-7, ..., 16-19
  const std::vector<int32_t> pages(pool.block_table(seq), pool.block_table(seq) + 5);
  // keys from 9 on are still read: pages 0 and 1 (tokens 0-7) go, page 2 (8-11) holds token 9 and stays
  REQUIRE(pool.seq_release_before(seq, 9));
  CHECK(pool.block_table(seq)[0] == -1);
  CHECK(pool.block_table(seq)[1] == -1);
  CHECK(pool.block_table(seq)[2] == pages[2]);
  CHECK(pool.seq_first_page(seq) == 2);
  CHECK(pool.seq_pages(seq) == 5);    // the table's logical length and the sequence's tokens do not move
  CHECK(pool.seq_tokens(seq) == 20);
  CHECK(pool.stats().used_pages == 3);
  CHECK(pool.page_refcount(pages[0]) == 0);
  // an earlier token releases nothing more; the pages freed are the next ones out
  REQUIRE(pool.seq_release_before(seq, 3));
  CHECK(pool.stats().used_pages == 3);
  REQUIRE(pool.seq_reserve(seq, 24));  // one more page, at index 5
  CHECK(pool.block_table(seq)[5] == pages[1]);
  // past the sequence's end: every page it has goes, and only those
  REQUIRE(pool.seq_release_before(seq, 1000));
  CHECK(pool.stats().used_pages == 0);
  CHECK(pool.seq_first_page(seq) == 6);
  REQUIRE(pool.seq_free(seq));
  CHECK(pool.stats().free_pages == 10);
  CHECK_FALSE(pool.seq_release_before(seq, 4));  // not live
  // a cached page given back stays in the cache, evictable, and a later prefix attaches past its -1 lead
  const int32_t a = pool.seq_create();
  REQUIRE(pool.seq_reserve(a, 8));
  const int32_t first = pool.block_table(a)[0], second = pool.block_table(a)[1];
  REQUIRE(pool.cache_insert(first, 11).value());
  REQUIRE(pool.cache_insert(second, 12).value());
  REQUIRE(pool.seq_release_before(a, 4));
  CHECK(pool.page_refcount(first) == 1);  // the cache's reference
  CHECK(pool.stats().cache_only_pages == 1);
  REQUIRE(pool.seq_free(a));
  const int32_t b = pool.seq_create();
  const int32_t lead[2] = {-1, second};
  REQUIRE(pool.seq_attach(b, lead, 2));
  CHECK(pool.seq_first_page(b) == 1);
  CHECK(pool.seq_tokens(b) == 8);
  CHECK(pool.page_refcount(second) == 2);
  const int32_t late_lead[2] = {second, -1};  // a -1 after a page is no window's lead
  const int32_t c = pool.seq_create();
  CHECK_FALSE(pool.seq_attach(c, late_lead, 2));
  REQUIRE(pool.seq_free(b));
  REQUIRE(pool.seq_free(c));
  CHECK(pool.stats().used_pages == 0);
}

TEST_CASE("a page shared by two owners survives the first seq_free") {
  KVPagePool pool = make_pool(4, 2, 2, 2);
  int32_t a = pool.seq_create();
  REQUIRE(pool.seq_reserve(a, 3));  // pages 0, 1
  int32_t shared = pool.block_table(a)[0];
  REQUIRE(pool.retain_page(shared));  // a prefix kept for another request
  REQUIRE(pool.seq_free(a));
  CHECK(pool.page_refcount(shared) == 1);
  CHECK(pool.page_refcount(1) == 0);
  CHECK(pool.stats().free_pages == 3);
  REQUIRE(pool.release_page(shared));
  CHECK(pool.stats().free_pages == 4);

  // A page released behind its sequence's back makes seq_free refuse, changing nothing.
  int32_t b = pool.seq_create();
  REQUIRE(pool.seq_reserve(b, 4));
  REQUIRE(pool.release_page(pool.block_table(b)[1]));
  PoolSnapshot before(pool);
  Status freed = pool.seq_free(b);
  CHECK(freed.error().code == ErrorCode::invalid_argument);
  CHECK(freed.error().message.find("already free") != std::string::npos);
  CHECK(PoolSnapshot(pool) == before);
}

// ---- page layout -----------------------------------------------------------------------------------------

TEST_CASE("KVPageLayout::offset maps every (page, layer, K/V, token, head, dim) to one element of the pages") {
  KVPageLayout layout{3, 5, 3, 7};  // layers, page_tokens, kv_heads, head_dim: small and odd
  const int64_t pages = 4;
  CHECK(layout.page_elements() == 3 * 2 * 5 * 3 * 7);
  std::vector<int> hits(size_t(pages * layout.page_elements()), 0);
  int64_t out_of_range = 0;
  for (int64_t page = 0; page < pages; page++)
    for (int64_t layer = 0; layer < layout.layers; layer++)
      for (int64_t kv = 0; kv < 2; kv++)
        for (int64_t token = 0; token < layout.page_tokens; token++)
          for (int64_t head = 0; head < layout.kv_heads; head++)
            for (int64_t d = 0; d < layout.head_dim; d++) {
              int64_t index = layout.offset(page, layer, kv, token, head) + d;
              if (index < 0 || index >= int64_t(hits.size())) out_of_range++;
              else hits[size_t(index)]++;
            }
  CHECK(out_of_range == 0);
  CHECK(std::count(hits.begin(), hits.end(), 1) == int64_t(hits.size()));
  // The documented nesting: a page is whole, and a layer's K block for a page is contiguous, V right after.
  CHECK(layout.offset(1, 0, 0, 0, 0) == layout.page_elements());
  CHECK(layout.offset(2, 1, 1, 0, 0) - layout.offset(2, 1, 0, 0, 0) == 5 * 3 * 7);
  CHECK(layout.offset(2, 1, 0, 4, 2) + 7 == layout.offset(2, 1, 1, 0, 0));
}

// ---- nothing is allocated after start ----------------------------------------------------------------------

TEST_CASE("100k random page and sequence operations allocate nothing and keep every invariant") {
  auto arena = make_arena(tiny_plan(), tiny_config());
  KVPagePool& pool = arena->kv();  // 37 pages of 5 tokens, 4 slots of up to 5 pages (25 tokens)
  const uint64_t allocations_before = Arena::allocations_after_start();
  const uint64_t metadata_before = pool.metadata_bytes();
  // Sized once: free stack + refcounts (37 x int32 each), tables (4 x 5 int32), tokens, pages and first pages
  // held (4 x int64 each), free slots (4 x int32); the prefix cache's page keys (37 x uint64), flags (37 bytes), buckets (64, the
  // power of two at or past 37, x int32), bucket chain and LRU links (3 x 37 x int32).
  CHECK(metadata_before == 37 * 4 * 2 + 4 * 5 * 4 + 4 * 8 * 3 + 4 * 4 + 37 * 8 + 37 + 64 * 4 + 3 * 37 * 4);

  // A shadow of what the pool must hold: the loose page references the test owns (a page appears once per
  // reference) and each live sequence's length.
  std::mt19937_64 rng(20240611);
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  std::vector<int32_t> loose;
  std::map<int32_t, int64_t> lengths;
  int64_t failures_oom = 0, failures_too_long = 0, full_allocs = 0, full_slots = 0;
  auto check_invariants = [&] {
    auto stats = pool.stats();
    REQUIRE(stats.free_pages + stats.used_pages == 37);
    REQUIRE(stats.live_sequences == int64_t(lengths.size()));
    std::vector<int32_t> expected(37, 0);
    for (int32_t page : loose) expected[size_t(page)]++;
    int64_t stored = 0;
    for (const auto& [seq, length] : lengths) {
      REQUIRE(pool.seq_tokens(seq) == length);
      REQUIRE(pool.seq_pages(seq) == (length + 4) / 5);
      const int32_t* row = pool.block_table(seq);
      for (int64_t i = 0; i < 5; i++) {
        if (i < pool.seq_pages(seq)) expected[size_t(row[i])]++;
        else REQUIRE(row[i] == -1);
      }
      stored += length;
    }
    int64_t free_count = 0;
    for (int32_t page = 0; page < 37; page++) {
      REQUIRE(pool.page_refcount(page) == expected[size_t(page)]);
      free_count += expected[size_t(page)] == 0;
    }
    REQUIRE(stats.free_pages == free_count);
    REQUIRE(stats.tokens_stored == stored);
    REQUIRE(stats.token_capacity == stats.used_pages * 5);
  };

  for (int step = 0; step < 100000; step++) {
    switch (rng() % 7) {
      case 0: {  // a loose page
        int64_t free_before = pool.stats().free_pages;
        int32_t page = pool.alloc_page();
        REQUIRE((page == -1) == (free_before == 0));
        if (page >= 0) loose.push_back(page);
        else full_allocs++;
        break;
      }
      case 1:  // another reference to a loose page
        if (!loose.empty()) {
          int32_t page = loose[pick(loose.size())];
          REQUIRE(pool.retain_page(page));
          loose.push_back(page);
        }
        break;
      case 2:  // drop a loose reference
        if (!loose.empty()) {
          size_t i = pick(loose.size());
          REQUIRE(pool.release_page(loose[i]));
          loose.erase(loose.begin() + std::ptrdiff_t(i));
        }
        break;
      case 3: {  // a new sequence
        int32_t seq = pool.seq_create();
        REQUIRE((seq == -1) == (lengths.size() == 4));
        if (seq >= 0) lengths[seq] = 0;
        else full_slots++;
        break;
      }
      case 4:
      case 5:  // grow a sequence, sometimes past what fits
        if (!lengths.empty()) {
          auto it = std::next(lengths.begin(), std::ptrdiff_t(pick(lengths.size())));
          int64_t tokens = int64_t(pick(28));
          int64_t needed = (tokens + 4) / 5 - (it->second + 4) / 5;
          int64_t free_before = pool.stats().free_pages;
          Status grown = pool.seq_reserve(it->first, tokens);
          if (tokens <= it->second) {
            REQUIRE(grown);
          } else if (tokens > 25) {
            REQUIRE(grown.error().code == ErrorCode::does_not_fit);
            failures_too_long++;
          } else if (needed > free_before) {
            REQUIRE(grown.error().code == ErrorCode::out_of_memory);
            failures_oom++;
          } else {
            REQUIRE(grown);
            it->second = tokens;
          }
        }
        break;
      case 6:  // finish a sequence, sometimes keeping its first page as a shared prefix
        if (!lengths.empty()) {
          auto it = std::next(lengths.begin(), std::ptrdiff_t(pick(lengths.size())));
          if (pool.seq_pages(it->first) > 0 && rng() % 2) {
            int32_t page = pool.block_table(it->first)[0];
            REQUIRE(pool.retain_page(page));
            loose.push_back(page);
          }
          REQUIRE(pool.seq_free(it->first));
          lengths.erase(it);
        }
        break;
    }
    if (step % 997 == 0) check_invariants();
  }
  check_invariants();
  MESSAGE("random operations: " << failures_oom << " out_of_memory, " << failures_too_long << " does_not_fit, "
                                << full_allocs << " allocs on an empty pool, " << full_slots << " creates with no slot");
  // Every branch was taken, so the run exercised exhaustion of pages and of slots.
  CHECK(failures_oom > 0);
  CHECK(failures_too_long > 0);
  CHECK(full_allocs > 0);
  CHECK(full_slots > 0);
  CHECK(Arena::allocations_after_start() == allocations_before);
  CHECK(pool.metadata_bytes() == metadata_before);
}

TEST_CASE("the allocation counter sees arena memory taken after an arena started") {
  const uint64_t before_any = Arena::allocations_after_start();
  // No arena live: a pool built now is ordinary set-up.
  KVPagePool early = make_pool(8, 4, 2, 2);
  CHECK(Arena::allocations_after_start() == before_any);
  {
    auto arena = make_arena(tiny_plan(), tiny_config());
    CHECK(Arena::allocations_after_start() == before_any);  // create() itself does not count
    // A second pool while an arena is live: its thirteen tables (seven for pages and slots, six for the prefix
    // cache) are thirteen system allocations after start.
    KVPagePool late = make_pool(8, 4, 2, 2);
    CHECK(Arena::allocations_after_start() == before_any + 13);
  }
  // The arena is gone: set-up again.
  KVPagePool after = make_pool(8, 4, 2, 2);
  CHECK(Arena::allocations_after_start() == before_any + 13);
}

// ---- the case for paging -------------------------------------------------------------------------------------

namespace {

struct Request {
  int64_t prompt = 0, output = 0;
};

// A standard normal from two uniforms (Box-Muller), built on mt19937_64's exactly specified output so the
// mix is the same with every standard library.
double standard_normal(std::mt19937_64& rng) {
  double u1 = (double(rng() >> 11) + 1.0) * 0x1p-53;  // (0, 1]
  double u2 = double(rng() >> 11) * 0x1p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
}
int64_t lognormal_tokens(std::mt19937_64& rng, double median, double sigma, int64_t lo, int64_t hi) {
  return std::clamp(int64_t(std::llround(median * std::exp(sigma * standard_normal(rng)))), lo, hi);
}

struct ServeResult {
  double waste = 0;          // 1 - sum over steps of tokens stored / sum of token capacity reserved
  double mean_running = 0;   // sequences decoding per step
  int64_t steps = 0;         // steps to serve every request
  int64_t preemptions = 0;   // sequences evicted (and later recomputed) when pages ran out
};

// Serves `requests` on `pool`, one step at a time: request i arrives at step i x arrival_interval and waits
// in a FIFO queue; each step admits waiting requests while a slot and pages for the prompt are free (the
// prefill stores the prompt), then every running sequence appends one generated token; a sequence ends
// when its output is complete. When a decode step finds no page, the most recently admitted sequence is
// preempted and requeued at the front (recomputed later, as vLLM does). Memory is measured after each step.
ServeResult serve(KVPagePool& pool, const std::vector<Request>& requests, int64_t arrival_interval) {
  struct Running {
    int32_t seq;
    size_t request;
    int64_t generated;
  };
  ServeResult result;
  std::deque<size_t> waiting;
  std::vector<Running> running;
  size_t arrived = 0, finished = 0;
  double stored = 0, reserved = 0, running_sum = 0;
  while (finished < requests.size()) {
    REQUIRE(result.steps < 10000000);
    while (arrived < requests.size() && int64_t(arrived) * arrival_interval <= result.steps) waiting.push_back(arrived++);
    while (!waiting.empty()) {
      int32_t seq = pool.seq_create();
      if (seq < 0) break;
      if (!pool.seq_reserve(seq, requests[waiting.front()].prompt)) {
        REQUIRE(pool.seq_free(seq));
        break;
      }
      running.push_back({seq, waiting.front(), 0});
      waiting.pop_front();
    }
    for (size_t i = 0; i < running.size();) {
      Status grown = pool.seq_reserve(running[i].seq, pool.seq_tokens(running[i].seq) + 1);
      if (!grown) {
        REQUIRE(grown.error().code == ErrorCode::out_of_memory);
        REQUIRE(pool.seq_free(running.back().seq));
        waiting.push_front(running.back().request);
        running.pop_back();
        result.preemptions++;
        continue;  // retry this sequence (or stop, if it was the one preempted)
      }
      if (++running[i].generated == requests[running[i].request].output) {
        REQUIRE(pool.seq_free(running[i].seq));
        running.erase(running.begin() + std::ptrdiff_t(i));
        finished++;
        continue;
      }
      i++;
    }
    auto stats = pool.stats();
    stored += double(stats.tokens_stored);
    reserved += double(stats.token_capacity);
    running_sum += double(running.size());
    result.steps++;
  }
  result.waste = 1.0 - stored / reserved;
  result.mean_running = running_sum / double(result.steps);
  return result;
}

}  // namespace

TEST_CASE("paged KV wastes under 4% of its memory where max_model_len reservations waste over 60%") {
  // The request mix (seeded, the same everywhere): prompt lengths lognormal with median 512 tokens and
  // sigma 0.9, clipped to [16, 3072] (mean ~700: chat turns with some long documents); output lengths
  // lognormal with median 256 and sigma 0.8, clipped to [1, 1024] (mean ~340). max_model_len 4096, so every
  // request fits one naive slot. 600 requests arrive one every 4 steps, faster than either scheme serves
  // them, so both run full. Both schemes get the same KV budget of 32768 tokens and at most 32 sequences:
  //   pages: 2048 pages of 16 tokens (vLLM's CUDA block size), up to 256 pages per sequence;
  //   naive: the contiguous reservation of max_model_len per sequence that pre-paging servers made, which
  //          is exactly a pool whose one page per sequence holds 4096 tokens: 8 such pages.
  // Waste = 1 - tokens stored / tokens of memory held by sequences, summed over every step until all
  // requests are served. The PagedAttention paper (Kwon et al., SOSP 2023) and the vLLM launch post report
  // 60-80% waste before paging and under 4% with it; the simulation checks our pool gives the same picture.
  const int64_t budget_tokens = 32768, max_model_len = 4096, max_seqs = 32;
  std::mt19937_64 rng(4096);
  std::vector<Request> requests(600);
  double prompt_sum = 0, output_sum = 0;
  for (Request& request : requests) {
    request.prompt = lognormal_tokens(rng, 512, 0.9, 16, 3072);
    request.output = lognormal_tokens(rng, 256, 0.8, 1, 1024);
    prompt_sum += double(request.prompt);
    output_sum += double(request.output);
  }

  KVPagePool paged = make_pool(budget_tokens / 16, 16, max_seqs, max_model_len / 16);
  KVPagePool naive = make_pool(budget_tokens / max_model_len, max_model_len, max_seqs, 1);
  ServeResult with_pages = serve(paged, requests, 4);
  ServeResult with_slots = serve(naive, requests, 4);

  MESSAGE("request mix: mean prompt " << prompt_sum / double(requests.size()) << " tokens, mean output "
                                      << output_sum / double(requests.size()) << " tokens");
  MESSAGE("pages of 16: waste " << 100 * with_pages.waste << "%, " << with_pages.mean_running
                                << " sequences per step, " << with_pages.steps << " steps, "
                                << with_pages.preemptions << " preemptions");
  MESSAGE("max_model_len per sequence: waste " << 100 * with_slots.waste << "%, " << with_slots.mean_running
                                               << " sequences per step, " << with_slots.steps << " steps");
  CHECK(with_pages.waste < 0.04);
  CHECK(with_slots.waste > 0.60);
  // The same budget serves more sequences at once (the paper reports 2-4x throughput at equal memory).
  CHECK(with_pages.mean_running > 2 * with_slots.mean_running);
  // Both pools are back to empty: every request finished and returned its memory.
  CHECK(paged.stats().used_pages == 0);
  CHECK(naive.stats().used_pages == 0);
  CHECK(with_slots.preemptions == 0);  // a naive slot always holds a whole request
}
