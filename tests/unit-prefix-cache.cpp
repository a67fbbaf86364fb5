// prefix caching: full KV pages cached under a hash chain of their tokens (KVPagePool::cache_insert /
// cache_lookup / seq_attach), reused by later requests that start with the same tokens, evicted least recently
// used when pages run out. The pool's bookkeeping against a shadow model; the engine's outputs with the cache
// equal its outputs without it (text, multi-turn chat, images, preemption, cancel, eviction), and the tokens it
// skips are exactly the cached prefix's.
#include <doctest/doctest.h>
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "engine_helpers.hpp"

using namespace kvlite;
namespace fx = model_fixtures;

namespace {
using engine_helpers::check_pool_empty;
using engine_helpers::greedy;

KVPagePool make_pool(int64_t pages, int64_t page_tokens, int64_t max_seqs, int64_t max_pages_per_seq) {
  auto pool = KVPagePool::create(pages, page_tokens, max_seqs, max_pages_per_seq);
  REQUIRE(pool.ok());
  return std::move(*pool);
}

EngineOptions with_cache(bool on, int64_t page_tokens = 4) {
  EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  options.prefix_caching = on;
  options.plan.kv_page_tokens = page_tokens;
  return options;
}

// Generations of `prompts` submitted together, then run.
std::vector<Generation> run_all(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                const SamplingParams& params) {
  std::vector<RequestId> ids;
  for (const auto& prompt : prompts) ids.push_back(engine.submit(prompt, params).value());
  REQUIRE(engine.run());
  std::vector<Generation> out;
  for (RequestId id : ids) out.push_back(engine.result(id).value());
  return out;
}

}  // namespace

TEST_CASE("the pool's prefix cache: insert, lookup, attach, LRU eviction from a prefix's end, counts") {
  KVPagePool pool = make_pool(6, 4, 3, 6);
  const int32_t a = pool.seq_create();
  REQUIRE(pool.seq_reserve(a, 12).ok());  // 3 pages
  const int32_t* table = pool.block_table(a);
  const int32_t p0 = table[0], p1 = table[1], p2 = table[2];
  CHECK(pool.cache_insert(p0, 100).value());
  CHECK(pool.cache_insert(p1, 101).value());
  CHECK_FALSE(pool.cache_insert(p1, 102).value());  // a page is cached once
  CHECK_FALSE(pool.cache_insert(p2, 100).value());  // a key names one page
  CHECK(pool.cache_lookup(100) == p0);
  CHECK(pool.cache_lookup(101) == p1);
  CHECK(pool.cache_lookup(102) == -1);
  CHECK(pool.page_refcount(p0) == 2);  // the sequence's and the cache's
  KVPagePool::Stats stats = pool.stats();
  CHECK(stats.used_pages == 3);
  CHECK(stats.cached_pages == 2);
  CHECK(stats.cache_only_pages == 0);

  // The sequence ends: its cached pages stay (cache only, counted free), the other one is freed.
  REQUIRE(pool.seq_free(a).ok());
  stats = pool.stats();
  CHECK(stats.used_pages == 0);
  CHECK(stats.free_pages == 6);
  CHECK(stats.cache_only_pages == 2);
  CHECK(pool.page_refcount(p2) == 0);
  CHECK(pool.page_refcount(p1) == 1);

  // A new sequence takes the cached prefix: in use again, not evictable.
  const int32_t b = pool.seq_create();
  const int32_t prefix[] = {p0, p1};
  REQUIRE(pool.seq_attach(b, prefix, 2).ok());
  CHECK(pool.seq_tokens(b) == 8);
  CHECK(pool.block_table(b)[1] == p1);
  CHECK(pool.page_refcount(p0) == 2);
  CHECK(pool.stats().cache_only_pages == 0);
  CHECK_FALSE(pool.seq_attach(b, prefix, 2).ok());  // only an empty sequence
  const int32_t not_cached[] = {p2};
  const int32_t c = pool.seq_create();
  CHECK_FALSE(pool.seq_attach(c, not_cached, 1).ok());
  REQUIRE(pool.seq_free(c).ok());
  REQUIRE(pool.seq_free(b).ok());  // p1 is released before p0: p1 becomes the least recently used

  // Pages run out: the free ones go first, then the cache's, the prefix's last page first.
  const int32_t d = pool.seq_create();
  REQUIRE(pool.seq_reserve(d, 16).ok());  // 4 free pages
  CHECK(pool.stats().cache_evictions == 0);
  REQUIRE(pool.seq_reserve(d, 20).ok());  // needs one more: evicts p1 (key 101)
  CHECK(pool.stats().cache_evictions == 1);
  CHECK(pool.cache_lookup(101) == -1);
  CHECK(pool.cache_lookup(100) == p0);
  CHECK(pool.page_refcount(p1) == 1);  // now d's
  CHECK(pool.block_table(d)[4] == p1);
  const int32_t e = pool.seq_create();
  CHECK_FALSE(pool.seq_reserve(e, 8).ok());  // 1 page evictable, 2 needed: all or nothing
  CHECK(pool.cache_lookup(100) == p0);
  REQUIRE(pool.seq_reserve(e, 4).ok());  // takes p0, the last one
  CHECK(pool.cache_lookup(100) == -1);
  CHECK(pool.stats().cached_pages == 0);
  REQUIRE(pool.seq_free(d).ok());
  REQUIRE(pool.seq_free(e).ok());
  CHECK(pool.stats().free_pages == 6);
  CHECK_FALSE(pool.cache_insert(p0, 7).ok());  // a free page cannot be cached
}

TEST_CASE("the prefix cache under 50k random operations keeps every count, and allocates nothing") {
  // A shadow: which keys should still be found, the pages each live sequence holds.
  std::mt19937_64 rng(41);
  KVPagePool pool = make_pool(23, 3, 5, 6);
  std::map<uint64_t, int32_t> cached;           // key -> page (until evicted)
  std::map<int32_t, std::vector<int32_t>> seqs;  // live sequence -> its pages
  uint64_t next_key = 1;
  for (int op = 0; op < 50000; op++) {
    const int kind = int(rng() % 5);
    if (kind == 0) {  // a sequence, maybe from a cached prefix
      const int32_t seq = pool.seq_create();
      if (seq < 0) continue;
      std::vector<int32_t> prefix;
      for (const auto& entry : cached)
        if (prefix.size() < 3 && rng() % 3 == 0) prefix.push_back(entry.second);
      if (!prefix.empty()) REQUIRE(pool.seq_attach(seq, prefix.data(), int64_t(prefix.size())).ok());
      seqs[seq] = prefix;
    } else if (kind == 1 && !seqs.empty()) {  // grow one
      auto it = std::next(seqs.begin(), long(rng() % seqs.size()));
      const int64_t tokens = pool.seq_tokens(it->first) + int64_t(rng() % 7);
      if (pool.seq_reserve(it->first, tokens).ok()) {
        const int32_t* table = pool.block_table(it->first);
        it->second.assign(table, table + pool.seq_pages(it->first));
      }
    } else if (kind == 2 && !seqs.empty()) {  // end one
      auto it = std::next(seqs.begin(), long(rng() % seqs.size()));
      REQUIRE(pool.seq_free(it->first).ok());
      seqs.erase(it);
    } else if (kind >= 3 && !seqs.empty()) {  // cache one of a sequence's pages
      auto it = std::next(seqs.begin(), long(rng() % seqs.size()));
      if (it->second.empty()) continue;
      const int32_t page = it->second[size_t(rng() % it->second.size())];
      const uint64_t key = next_key++;
      const bool entered = pool.cache_insert(page, key).value();
      bool already = false;
      for (const auto& entry : cached) already = already || entry.second == page;
      CHECK(entered == !already);
      if (entered) cached[key] = page;
    }
    // Evicted keys are gone from the shadow once their page belongs to someone else.
    for (auto it = cached.begin(); it != cached.end();) {
      if (pool.cache_lookup(it->first) != it->second) it = cached.erase(it);
      else ++it;
    }
    // Counts: each page's references are its sequences' plus the cache's.
    std::map<int32_t, int> references;
    for (const auto& entry : seqs)
      for (int32_t page : entry.second) references[page]++;
    std::set<int32_t> cached_pages;
    for (const auto& entry : cached) {
      cached_pages.insert(entry.second);
      references[entry.second]++;
    }
    int64_t in_use = 0, cache_only = 0;
    for (int32_t page = 0; page < 23; page++) {
      REQUIRE(pool.page_refcount(page) == references[page]);
      const bool used_by_seq = references[page] > (cached_pages.count(page) ? 1 : 0);
      in_use += used_by_seq;
      cache_only += cached_pages.count(page) && !used_by_seq;
    }
    const KVPagePool::Stats stats = pool.stats();
    REQUIRE(stats.used_pages == in_use);
    REQUIRE(stats.cache_only_pages == cache_only);
    REQUIRE(stats.cached_pages == int64_t(cached_pages.size()));
    REQUIRE(stats.free_pages + stats.used_pages == 23);
  }
}

TEST_CASE("prefix caching: a request starting with computed pages reuses them, same tokens, fewer computed") {
  for (const std::string& name : fx::names()) {
    CAPTURE(name);
    const nlohmann::json reference = fx::reference(name);
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& p : reference["prompts"]) prompts.push_back(fx::ids_of(p["input_ids"]));
    auto cached = fx::open(name, with_cache(true));
    auto plain = fx::open(name, with_cache(false));
    CHECK(cached->info().prefix_caching);
    CHECK_FALSE(plain->info().prefix_caching);
    // Twice the same prompts: the second round finds every whole page but the one holding each last token.
    for (int round = 0; round < 2; round++) {
      CAPTURE(round);
      const int64_t before = cached->stats().tokens_computed, reused_before = cached->stats().prefix_tokens_reused;
      const std::vector<Generation> got = run_all(*cached, prompts, greedy(16));
      const std::vector<Generation> want = run_all(*plain, prompts, greedy(16));
      for (size_t i = 0; i < prompts.size(); i++) {
        CHECK(got[i].ids == want[i].ids);
        CHECK(got[i].ids == fx::ids_of(reference["prompts"][i]["greedy"]["new_ids"]));
      }
      int64_t expected_reuse = 0;
      if (round == 1)
        for (const auto& prompt : prompts) expected_reuse += (int64_t(prompt.size()) - 1) / 4 * 4;
      CHECK(cached->stats().prefix_tokens_reused - reused_before == expected_reuse);
      int64_t plain_tokens = 0;
      for (size_t i = 0; i < prompts.size(); i++) plain_tokens += int64_t(prompts[i].size()) + int64_t(want[i].ids.size()) - 1;
      CHECK(cached->stats().tokens_computed - before == plain_tokens - expected_reuse);
    }
    check_pool_empty(*cached);
    CHECK(cached->arena().kv().stats().cached_pages > 0);
  }
}

TEST_CASE("prefix caching: a multi-turn chat computes only the new turn, and answers as without the cache") {
  const std::string name = "tiny-qwen3";
  auto cached = fx::open(name, with_cache(true));
  auto plain = fx::open(name, with_cache(false));
  const nlohmann::json reference = fx::reference(name);
  std::vector<int32_t> conversation = fx::ids_of(reference["prompts"][0]["input_ids"]);
  const std::vector<int32_t> follow_up = fx::ids_of(reference["prompts"][1]["input_ids"]);
  for (int turn = 0; turn < 3; turn++) {
    CAPTURE(turn);
    const int64_t computed_before = cached->stats().tokens_computed;
    const int64_t reused_before = cached->stats().prefix_tokens_reused;
    auto got = cached->generate(conversation, greedy(12));
    auto want = plain->generate(conversation, greedy(12));
    REQUIRE(got);
    REQUIRE(want);
    CHECK(got->ids == want->ids);
    // Every whole page of what the previous turns computed is found: the prompt (all but its last token, whose
    // logits are wanted) is covered up to the last page the last turn filled.
    const int64_t reused = cached->stats().prefix_tokens_reused - reused_before;
    if (turn == 0) {
      CHECK(reused == 0);
    } else {
      CHECK(reused > 0);
      CHECK(reused % 4 == 0);
      CHECK(reused <= int64_t(conversation.size()) - 1);
    }
    CHECK(cached->stats().tokens_computed - computed_before ==
          int64_t(conversation.size()) + int64_t(got->ids.size()) - 1 - reused);
    // The next turn: this one's prompt and answer, then the user's next message.
    conversation.insert(conversation.end(), got->ids.begin(), got->ids.end());
    conversation.insert(conversation.end(), follow_up.begin(), follow_up.begin() + 5);
  }
  check_pool_empty(*cached);
}

TEST_CASE("prefix caching under page pressure: preempted and evicting requests give the tokens they give alone") {
  const std::string name = "tiny-llama3";
  const nlohmann::json reference = fx::reference(name);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : reference["prompts"]) prompts.push_back(fx::ids_of(p["input_ids"]));
  // Shared prefixes: each prompt again with two more tokens of another.
  for (size_t i = 0; i < 3; i++) {
    std::vector<int32_t> longer = prompts[i];
    longer.push_back(prompts[(i + 1) % 3][1]);
    longer.push_back(prompts[(i + 2) % 3][2]);
    prompts.push_back(longer);
  }
  auto plain = fx::open(name, with_cache(false));
  std::vector<std::vector<int32_t>> alone;
  for (const auto& prompt : prompts) alone.push_back(plain->generate(prompt, greedy(24)).value().ids);

  EngineOptions options = with_cache(true);
  options.plan.utilization = 1.0;
  options.plan.max_model_len = 128;  // the longest prompt (84) and its 24 tokens
  const Plan probe = fx::open(name, options)->plan();
  const int64_t pages = 40;  // 160 tokens for six prompts of 11-84 tokens + 24 each: preemption and eviction
  options.plan.device_mem = probe.fixed_bytes + uint64_t(pages) * probe.kv_page_bytes;
  auto tight = fx::open(name, options);
  REQUIRE(tight->plan().kv_pages == uint64_t(pages));
  for (int round = 0; round < 2; round++) {
    const std::vector<Generation> got = run_all(*tight, prompts, greedy(24));
    for (size_t i = 0; i < prompts.size(); i++) CHECK(got[i].ids == alone[i]);
  }
  MESSAGE("40 pages: " << tight->stats().preemptions << " preemptions, " << tight->arena().kv().stats().cache_evictions
                       << " cached pages evicted, " << tight->stats().prefix_tokens_reused << " tokens reused");
  CHECK(tight->stats().preemptions > 0);
  CHECK(tight->arena().kv().stats().cache_evictions > 0);
  CHECK(tight->stats().prefix_tokens_reused > 0);
  check_pool_empty(*tight);
}

TEST_CASE("prefix caching: a cancelled request leaves its computed pages to the cache and nothing in use") {
  const std::string name = "tiny-qwen2";
  auto engine = fx::open(name, with_cache(true));
  const std::vector<int32_t> prompt = fx::ids_of(fx::reference(name)["prompts"][2]["input_ids"]);
  const RequestId id = engine->submit(prompt, greedy(40)).value();
  REQUIRE(engine->step());  // the prompt (one chunk), and its first token
  REQUIRE(engine->cancel(id));
  REQUIRE(engine->run());
  CHECK(engine->result(id).value().finish_reason == FinishReason::cancelled);
  check_pool_empty(*engine);
  CHECK(engine->arena().kv().stats().cached_pages == int64_t(prompt.size()) / 4);
  // And the next request with that prompt starts from them.
  auto again = engine->generate(prompt, greedy(8));
  REQUIRE(again);
  CHECK(engine->stats().prefix_tokens_reused == (int64_t(prompt.size()) - 1) / 4 * 4);
}

TEST_CASE("prefix caching with images: one prompt, different images: the text before the image is reused, the captions are unchanged") {
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16";
  EngineOptions on = with_cache(true), off = with_cache(false);
  auto cached = Engine::open(dir, on);
  auto plain = Engine::open(dir, off);
  REQUIRE(cached);
  REQUIRE(plain);
  const std::vector<ChatMessage> messages = {{"user", std::string(kImagePlaceholder) + "Describe this image."}};
  int64_t reused_total = 0;
  for (int round = 0; round < 2; round++)
    for (const char* file : {"scene_1.png", "scene_2.png", "scene_3.png"}) {
      CAPTURE(round);
      CAPTURE(file);
      auto image = load_image(std::string(KVLITE_SOURCE_DIR) + "/examples/images/" + file);
      REQUIRE(image);
      const int64_t reused_before = (*cached)->stats().prefix_tokens_reused;
      auto got = (*cached)->generate_chat(messages, {*image}, greedy(24));
      auto want = (*plain)->generate_chat(messages, {*image}, greedy(24));
      REQUIRE(got);
      REQUIRE(want);
      CHECK(got->text == want->text);
      CHECK(got->ids == want->ids);
      const int64_t reused = (*cached)->stats().prefix_tokens_reused - reused_before;
      reused_total += reused;
      // A different image: only whole pages before the first image token match; the same image again (round 1):
      // the whole prompt but its last page.
      if (round == 0 && std::string(file) != "scene_1.png") CHECK(reused < int64_t(got->prompt_ids.size()) / 2);
      if (round == 1) CHECK(reused == (int64_t(got->prompt_ids.size()) - 1) / 4 * 4);
    }
  CHECK(reused_total > 0);
  check_pool_empty(**cached);
}

TEST_CASE("the plan says whether the prefix cache is on, as the engine runs it, and that it costs no bytes") {
  const std::string dir = fx::dir("tiny-qwen3");
  for (int setting = 0; setting < 3; setting++) {  // unset (the CPU's default: on), on, off
    CAPTURE(setting);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.device_mem = 64 * MiB;
    if (setting > 0) options.prefix_caching = setting == 1;
    auto plan = plan_engine(dir, options);
    REQUIRE_MESSAGE(plan, plan.error().message);
    const bool on = setting != 2;
    CHECK(plan->prefix_caching == std::optional<bool>(on));
    CHECK(plan->table().find(on ? "reuse them; pages only the cache holds" : "off (--prefix-cache off)") !=
          std::string::npos);
    CHECK(nlohmann::json::parse(plan->json())["prefix_caching"] == on);
    auto engine = Engine::open(dir, options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    CHECK((*engine)->info().prefix_caching == on);
    // no bytes of its own: the same arena either way
    EngineOptions other = options;
    other.prefix_caching = !on;
    CHECK(plan_engine(dir, other)->arena_bytes() == plan->arena_bytes());
  }
}
