// bench-grammar: what constrained decoding costs per token on the CPU at a 151,936-token vocabulary (Qwen's), in
// llm.c's manner: validate (the masker's masks against a per-token check with GrammarMatcher::advance, the
// lm_head product against a float64 dot product; it stops on any difference), then time, then print the cost
// per token beside the cheapest decode step any model with that vocabulary has.
//
//   build/bench-grammar [--tokens N] [--repeats N]
//
// The vocabulary is synthetic and seeded, shaped like Qwen2/3's byte-level BPE: the 256 bytes, English-like words
// with and without a leading space and capitalized, code pieces, digit runs of 1-3, the punctuation and
// indentation runs of JSON and code, CJK / kana / Hangul / Cyrillic / accented Latin / emoji pieces and partial
// UTF-8 characters; 20 special ids at the end are excluded, as the engine excludes special tokens.
//
// Per schema of a suite of 8 JSON schemas: --repeats random walks (default 5) of at most --tokens tokens (default
// 200) through one GrammarMasker, as requests with the same schema share one in the engine. The first walk
// starts with an empty mask cache (cold), the others find what it left (steady state). Each step picks among the
// allowed tokens (half the time uniformly, half the time the one of 8 uniform candidates that leaves the least to
// complete, so strings end and walks finish) and stops once the text is complete, as a model that may emit
// end-of-turn there would sooner or later. Per token it times (a) GrammarMasker::mask (a cache lookup, or the
// trie walk of a new state), plus GrammarMasker::mask_within when the engine would ask for it (the tokens left,
// max_tokens = --tokens, are fewer than what some allowed token leaves to complete), (b) the engine's loop that
// sets disallowed logits of a 151,936-float row to -inf (Engine::Impl::constrain_row), (c) GrammarMatcher::accept
// of the chosen token's bytes.
//
// The floor: a decode step reads at least the lm_head, here a 151,936 x 1024 BF16 matrix times a float vector
// (plain C++, one thread and std::thread over every hardware thread, the fastest of 9 runs before the walks and 9
// after; the faster is the floor; the matrix read alone is printed beside it as the bandwidth ceiling). The
// whole-weight reads of Qwen3-0.6B (1.2e9 bytes) and Qwen3-4B (8.0e9) are timed at the bandwidth that product
// reached. Goal (the issue): the constrained cost per token under 5% of unconstrained decoding; the verdict is
// printed for (a) + (b) + (c) and for that plus the engine's mask_within steps.
#include <algorithm>
#include <bitset>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "kvlite.hpp"

namespace {

using kvlite::GrammarMasker;
using kvlite::GrammarMatcher;
using kvlite::GrammarState;
using kvlite::TokenMask;

constexpr int64_t kVocab = 151936;
constexpr int64_t kSpecials = 20;
constexpr int64_t kHidden = 1024;  // Qwen3-0.6B's hidden size (its lm_head is the embedding, tied)

[[noreturn]] void die(const std::string& message) {
  fprintf(stderr, "bench-grammar: %s\n", message.c_str());
  exit(1);
}

// splitmix64: the same sequence on every platform (std's distributions are not).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
};

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// ---- the vocabulary ---------------------------------------------------------------------------------------------
void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) out += char(cp);
  else if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); out += char(0x80 | (cp & 0x3F)); }
  else if (cp < 0x10000) { out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
  else { out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
}
std::string utf8(uint32_t cp) {
  std::string s;
  append_utf8(s, cp);
  return s;
}

struct Vocabulary {
  std::vector<std::string> tokens;  // [kVocab] bytes
  std::vector<uint8_t> excluded;    // [kVocab]
  std::vector<std::pair<std::string, int64_t>> categories;
};

Vocabulary make_vocabulary(uint64_t seed) {
  Rng rng(seed);
  std::vector<std::string> tokens;
  std::unordered_set<std::string> seen;
  auto add = [&](std::string s) {
    if (s.empty() || !seen.insert(s).second) return false;
    tokens.push_back(std::move(s));
    return true;
  };
  Vocabulary v;
  auto category = [&](const char* name, size_t before) { v.categories.push_back({name, int64_t(tokens.size() - before)}); };
  const int64_t regular = kVocab - kSpecials;

  size_t mark = tokens.size();
  for (int b = 0; b < 256; b++) add(std::string(1, char(b)));
  category("single bytes", mark);

  // words from syllables
  static const char* const onsets[] = {"", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
                                       "v", "w", "y", "z", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr",
                                       "sh", "sl", "sp", "st", "str", "th", "tr", "wh", "qu"};
  static const char* const vowels[] = {"a", "e", "i", "o", "u", "a", "e", "i", "o", "ea", "ee", "ai", "ou", "io", "y", "oo"};
  static const char* const codas[] = {"", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "st", "ck", "rd", "ct",
                                      "ss", "x", "th", "rt"};
  static const char* const suffixes[] = {"ing", "tion", "ed", "er", "ly", "ment", "ness", "able", "s", "es", "al", "ity"};
  auto pick = [&](const auto& table) { return std::string(table[rng.below(sizeof table / sizeof table[0])]); };
  auto word = [&]() {
    const uint64_t r = rng.below(100);
    const int syllables = r < 35 ? 1 : r < 80 ? 2 : 3;
    std::string w;
    for (int i = 0; i < syllables; i++) w += pick(onsets) + pick(vowels) + pick(codas);
    if (rng.below(4) == 0) w += pick(suffixes);
    return w;
  };
  auto capitalized = [](std::string w) {
    if (!w.empty()) w[0] = char(toupper(uint8_t(w[0])));
    return w;
  };
  auto upper = [](std::string w) {
    for (char& c : w) c = char(toupper(uint8_t(c)));
    return w;
  };

  mark = tokens.size();
  for (int n = 0; n < 10; n++) add(std::to_string(n));
  for (int n = 0; n < 100; n++) add((n < 10 ? "0" : "") + std::to_string(n));
  for (int n = 0; n < 1000; n++) add((n < 100 ? "0" : "") + std::string(n < 10 ? "0" : "") + std::to_string(n));
  category("digit runs (1-3)", mark);

  mark = tokens.size();
  static const char* const json_pieces[] = {
      "{\"", "\":", "\",", "},", "  ", "\n  ", "\":\"", "\",\"", "\"}", "\"]", "\"},", "\"},{\"", "}]", "]}", "}}", "]]",
      "[{", "[\"", "\":[", "\":{", "\": ", "\", ", ", ", ": ", "{\n", "[\n", "},\n", "],\n", "\",\n", "\n}", "\n]",
      "\": \"", "\":[\"", "\":[{\"", " \"", "\"\n", "\":\n", "{}", "[]", "\"\"", "\\\"", "\\n", "\\\\", "\\u", " {\"",
      " [\"", "\":true", "\":false", "\":null", "\":0", "\":1", " }", " ]", "{ ", "[ ", "\" ", "\"]}", "\"}]", "\"}}",
      "\"],", "}\n", "]\n", "\n}\n", "\n\n", "\n\n\n", "//", "/*", "*/", "();", "()", "):", ") {", "=>", "->", "::",
      "==", "!=", "<=", ">=", "&&", "||", "++", "+=", "-=", "...", "..", "\")", "('", "')", "\"))", "\");", "\"])",
      "'s", "'t", "'re", "'ll", "'ve", "n't", " (", " [", " {", " =", " ==", " +", " -", " *", " /", " <", " >",
      " &&", " ||", " //", " #", " @", ".\n", ",\n", ";\n", ":\n", ".\"", ",\"", "?\"", "!\"", "\".", "\",", " -", "--",
      "---", "###", "##", "**", "__", "```", "`", "``", "\t", "\t\t", "\n\t", "\n\t\t", "\r\n", " \n", " \n\n"};
  for (const char* p : json_pieces) add(p);
  for (int k = 1; k <= 32; k++) {
    add(std::string(size_t(k), ' '));
    add("\n" + std::string(size_t(k), ' '));
    add("\n\n" + std::string(size_t(k), ' '));
    add(",\n" + std::string(size_t(k), ' '));
    add("{\n" + std::string(size_t(k), ' '));
    add("[\n" + std::string(size_t(k), ' '));
    add("\",\n" + std::string(size_t(k), ' '));
    add("},\n" + std::string(size_t(k), ' '));
    if (k <= 8) add(std::string(size_t(k), '\t')), add("\n" + std::string(size_t(k), '\t'));
  }
  {
    static const char punct[] = "{}[]\":,.;()<>=+-*/\\'!?@#$%^&|~`_ \n";
    const size_t np = sizeof punct - 1;
    while (int64_t(tokens.size() - mark) < 4000) {
      const size_t length = 2 + rng.below(3);
      std::string s;
      for (size_t i = 0; i < length; i++) s += punct[rng.below(np)];
      add(s);
    }
  }
  category("punctuation / whitespace runs", mark);

  mark = tokens.size();
  {
    std::vector<uint32_t> cjk;
    for (uint32_t cp = 0x4E00; cp <= 0x9FA5; cp++) cjk.push_back(cp);
    for (size_t i = cjk.size() - 1; i > 0; i--) std::swap(cjk[i], cjk[rng.below(i + 1)]);
    for (size_t i = 0; i < 12000; i++) add(utf8(cjk[i]));
    const size_t common = 3000;  // CJK words from the first 3,000 of the shuffled characters
    while (int64_t(tokens.size() - mark) < 20000)
      add(utf8(cjk[rng.below(common)]) + utf8(cjk[rng.below(common)]) + (rng.below(5) == 0 ? utf8(cjk[rng.below(common)]) : ""));
    for (uint32_t cp : {0x3001u, 0x3002u, 0xFF0Cu, 0xFF1Au, 0xFF08u, 0xFF09u, 0x300Cu, 0x300Du, 0xFF01u, 0xFF1Fu}) {
      add(utf8(cp));
      for (int i = 0; i < 30; i++) add(utf8(cjk[rng.below(common)]) + utf8(cp));
    }
  }
  category("CJK (3-byte characters, words)", mark);

  mark = tokens.size();
  for (uint32_t cp = 0x3041; cp <= 0x30FF; cp++) add(utf8(cp));
  while (int64_t(tokens.size() - mark) < 1200) {
    std::string s;
    const int n = 2 + int(rng.below(3));
    for (int i = 0; i < n; i++) s += utf8(0x3041 + uint32_t(rng.below(0x30FF - 0x3041 + 1)));
    add(s);
  }
  while (int64_t(tokens.size() - mark) < 3200) add(utf8(0xAC00 + uint32_t(rng.below(0xD7A3 - 0xAC00 + 1))));
  category("kana, Hangul", mark);

  mark = tokens.size();
  while (int64_t(tokens.size() - mark) < 6000) {
    std::string s = rng.below(2) ? " " : "";
    const int n = 2 + int(rng.below(7));
    for (int i = 0; i < n; i++) {
      const bool cap = i == 0 && rng.below(5) == 0;
      s += utf8((cap ? 0x0410u : 0x0430u) + uint32_t(rng.below(32)));
    }
    add(s);
  }
  category("Cyrillic (2-byte characters)", mark);

  mark = tokens.size();
  {
    static const uint32_t accents[] = {0xE9, 0xE8, 0xEA, 0xFC, 0xF6, 0xE4, 0xF1, 0xE7, 0xE1, 0xED, 0xF3, 0xFA, 0xDF, 0xE0};
    while (int64_t(tokens.size() - mark) < 2000) {
      std::string w = word();
      const size_t at = rng.below(w.size() + 1);
      w = w.substr(0, at) + utf8(accents[rng.below(sizeof accents / sizeof accents[0])]) + w.substr(at);
      add(rng.below(2) ? " " + w : w);
    }
  }
  category("accented Latin words", mark);

  mark = tokens.size();
  while (int64_t(tokens.size() - mark) < 300) add(utf8(0x1F300 + uint32_t(rng.below(0x1F64F - 0x1F300 + 1))));
  category("emoji (4-byte characters)", mark);

  mark = tokens.size();
  for (int lead = 0xE4; lead <= 0xE9; lead++)
    for (int cont = 0x80; cont <= 0xBF; cont++) add(std::string{char(lead), char(cont)});
  for (int cont = 0x80; cont <= 0xBF; cont++) add(std::string{char(0xF0), char(0x9F), char(cont)});
  add(std::string{char(0xF0), char(0x9F)});
  while (int64_t(tokens.size() - mark) < 1000) add(std::string{char(0x80 + rng.below(64)), char(0x80 + rng.below(64))});
  while (int64_t(tokens.size() - mark) < 1500)  // the tail of one character and a whole one after it
    add(std::string(1, char(0x80 + rng.below(64))) + utf8(0x4E00 + uint32_t(rng.below(0x9FA5 - 0x4E00 + 1))));
  category("partial UTF-8 characters", mark);

  mark = tokens.size();
  while (int64_t(tokens.size() - mark) < 6000) {
    const uint64_t r = rng.below(8);
    const std::string w = word();
    if (r == 0) add("_" + w);
    else if (r == 1) add("." + w);
    else if (r == 2) add(w + "(");
    else if (r == 3) add(w + capitalized(word()));
    else if (r == 4) add(w + "_");
    else if (r == 5) add("    " + w);
    else if (r == 6) add(" " + w + "(");
    else add("\"" + w);
  }
  category("code pieces", mark);

  mark = tokens.size();
  while (int64_t(tokens.size()) < regular) {
    const std::string w = word();
    const uint64_t r = rng.below(100);
    if (r < 30) add(w);
    else if (r < 65) add(" " + w);
    else if (r < 75) add(capitalized(w));
    else if (r < 95) add(" " + capitalized(w));
    else if (r < 98) add(upper(w));
    else add(" " + upper(w));
  }
  category("English-like words", mark);

  // ids: the bytes first, the rest shuffled (merge ranks mix the kinds), then the specials
  for (size_t i = tokens.size() - 1; i > 256; i--) std::swap(tokens[i], tokens[256 + rng.below(i - 256 + 1)]);
  static const char* const specials[kSpecials] = {
      "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
      "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
      "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
      "<|fim_suffix|>", "<|fim_pad|>"};
  for (const char* s : specials) tokens.push_back(s);
  category("special (excluded)", tokens.size() - kSpecials);
  if (int64_t(tokens.size()) != kVocab) die("vocabulary size " + std::to_string(tokens.size()));
  v.tokens = std::move(tokens);
  v.excluded.assign(size_t(kVocab), 0);
  for (int64_t id = kVocab - kSpecials; id < kVocab; id++) v.excluded[size_t(id)] = 1;
  return v;
}

// ---- masks --------------------------------------------------------------------------------------------------------
#if defined(_MSC_VER)
#define BENCH_NOINLINE __declspec(noinline)
#else
#define BENCH_NOINLINE __attribute__((noinline))
#endif

int64_t bits_set(uint64_t w) { return int64_t(std::bitset<64>(w).count()); }
int64_t popcount(const TokenMask& mask) {
  int64_t n = 0;
  for (uint64_t w : mask) n += bits_set(w);
  return n;
}
// The id of the k-th allowed token (k < popcount(mask)).
int32_t nth_allowed(const TokenMask& mask, int64_t k) {
  for (size_t w = 0; w < mask.size(); w++) {
    const int64_t c = bits_set(mask[w]);
    if (k < c) {
      uint64_t bits = mask[w];
      for (int64_t i = 0; i < k; i++) bits &= bits - 1;
      return int32_t(w * 64 + size_t(bits_set((bits & (~bits + 1)) - 1)));  // the lowest set bit's index
    }
    k -= c;
  }
  return -1;
}

// The engine's loop (Engine::Impl::constrain_row, without the end-of-turn tokens): -inf where not allowed.
BENCH_NOINLINE bool apply_mask(float* row, int64_t vocab, const TokenMask& mask) {
  bool any = false;
  for (size_t word = 0; word * 64 < size_t(vocab); word++) {
    const uint64_t bits = word < mask.size() ? mask[word] : 0;
    any = any || bits != 0;
    const int64_t end = std::min<int64_t>(vocab, int64_t(word + 1) * 64);
    for (int64_t id = int64_t(word) * 64; id < end; id++)
      if (!((bits >> (id % 64)) & 1u)) row[id] = -std::numeric_limits<float>::infinity();
  }
  return any;
}

// ---- the schemas ----------------------------------------------------------------------------------------------------
struct Schema {
  const char* name;
  const char* json;  // nullptr: Grammar::json_object_gbnf() (OpenAI's response_format json_object)
};

const Schema kSchemas[] = {
    {"person (string, integer range, email, string array)",
     R"({"type": "object", "properties": {
          "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
          "email": {"type": "string", "format": "email"},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["name", "age"]})"},
    {"product (uuid, number, enum, nested object)",
     R"({"type": "object", "properties": {
          "id": {"type": "string", "format": "uuid"}, "title": {"type": "string"}, "price": {"type": "number"},
          "currency": {"enum": ["USD", "EUR", "GBP", "JPY", "CNY"]}, "in_stock": {"type": "boolean"},
          "dimensions": {"type": "object", "properties": {
              "width": {"type": "number"}, "height": {"type": "number"}, "unit": {"enum": ["cm", "in"]}},
            "required": ["width", "height", "unit"]}},
        "required": ["id", "title", "price", "currency", "in_stock", "dimensions"]})"},
    {"event (maxLength, date, time, array of objects)",
     R"({"type": "object", "properties": {
          "title": {"type": "string", "maxLength": 64}, "date": {"type": "string", "format": "date"},
          "start": {"type": "string", "format": "time"},
          "attendees": {"type": "array", "minItems": 1, "maxItems": 8, "items": {"type": "object", "properties": {
              "name": {"type": "string"}, "role": {"enum": ["host", "speaker", "guest"]}},
            "required": ["name", "role"]}}},
        "required": ["title", "date", "attendees"]})"},
    {"tool call (anyOf of two tools, const names)",
     R"({"anyOf": [
          {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object",
              "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                             "days": {"type": "integer", "minimum": 1, "maximum": 14}},
              "required": ["location", "unit"]}}, "required": ["name", "arguments"]},
          {"type": "object", "properties": {"name": {"const": "search_web"}, "arguments": {"type": "object",
              "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
              "required": ["query"]}}, "required": ["name", "arguments"]}]})"},
    {"classification (enum, number, short array)",
     R"({"type": "object", "properties": {
          "label": {"enum": ["positive", "negative", "neutral", "mixed"]}, "confidence": {"type": "number"},
          "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["label", "confidence", "reasons"]})"},
    {"address book ($defs, $ref, pattern)",
     R"({"$defs": {"address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "JP", "CN"]}}, "required": ["street", "city", "country"]}},
        "type": "object", "properties": {"people": {"type": "array", "maxItems": 4, "items": {"type": "object",
            "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/address"},
                           "work": {"$ref": "#/$defs/address"}}, "required": ["name", "home"]}}},
        "required": ["people"]})"},
    {"log entry (date-time, integer range, map)",
     R"({"type": "object", "properties": {
          "timestamp": {"type": "string", "format": "date-time"},
          "level": {"enum": ["debug", "info", "warning", "error"]}, "message": {"type": "string"},
          "code": {"type": "integer", "minimum": -1000, "maximum": 1000},
          "context": {"type": "object", "additionalProperties": {"type": "string"}}},
        "required": ["timestamp", "level", "message"]})"},
    {"any JSON object (json_object)", nullptr},
};

std::shared_ptr<const kvlite::Grammar> compile(const Schema& s) {
  std::string gbnf;
  if (s.json) {
    auto text = kvlite::Grammar::json_schema_to_gbnf(s.json);
    if (!text) die(std::string(s.name) + ": " + text.error().message);
    gbnf = *text;
  } else {
    gbnf = kvlite::Grammar::json_object_gbnf();
  }
  auto g = kvlite::Grammar::parse(gbnf);
  if (!g) die(std::string(s.name) + ": " + g.error().message);
  return *g;
}

// One step's choice: half the time uniform among the allowed, half the time the one of 8 uniform candidates that
// leaves the least to complete (so strings and lists end).
int32_t choose(const kvlite::Grammar& g, const GrammarState& state, const std::vector<std::string>& tokens,
               const TokenMask& mask, int64_t allowed, Rng& rng) {
  if (rng.below(2) == 0) return nth_allowed(mask, int64_t(rng.below(uint64_t(allowed))));
  int32_t best = -1;
  int64_t best_left = std::numeric_limits<int64_t>::max();
  GrammarState after;
  for (int c = 0; c < 8; c++) {
    const int32_t id = nth_allowed(mask, int64_t(rng.below(uint64_t(allowed))));
    if (!GrammarMatcher::advance(g, state, tokens[size_t(id)], after)) return id;  // validation catches it
    const int64_t left = GrammarMatcher::min_completion(g, after);
    if (left < best_left) best = id, best_left = left;
  }
  return best;
}

// ---- validation ------------------------------------------------------------------------------------------------------
struct Checked {
  int64_t states = 0, ids = 0, budget_states = 0;
};

// The mask of `state` (and at every 4th state mask_within's) against advance() on sampled ids: 1,000 uniform, up
// to 1,000 among the allowed, the 256 single bytes and the specials.
void check_state(const kvlite::Grammar& g, GrammarMasker& masker, const GrammarState& state, const Vocabulary& v,
                 Rng& rng, const std::string& where, Checked& checked) {
  int64_t most_after = -1;
  const TokenMask mask = masker.mask(state, &most_after);  // a copy, kept whatever the masker does next
  const int64_t allowed = popcount(mask);
  std::vector<int32_t> ids;
  for (int i = 0; i < 1000; i++) ids.push_back(int32_t(rng.below(uint64_t(kVocab))));
  for (int i = 0; i < 1000 && allowed > 0; i++) ids.push_back(nth_allowed(mask, int64_t(rng.below(uint64_t(allowed)))));
  for (int32_t b = 0; b < 256; b++) ids.push_back(b);
  for (int32_t id = int32_t(kVocab - kSpecials); id < int32_t(kVocab); id++) ids.push_back(id);
  GrammarState after;
  int64_t sampled_most = 0;
  for (int32_t id : ids) {
    const std::string& bytes = v.tokens[size_t(id)];
    const bool expected = !v.excluded[size_t(id)] && GrammarMatcher::advance(g, state, bytes, after);
    if (expected != kvlite::token_mask_allows(mask, id))
      die(where + ": token " + std::to_string(id) + " (" + std::to_string(bytes.size()) + " bytes) is " +
          (expected ? "readable but masked out" : "allowed by the mask but not readable"));
    if (expected) sampled_most = std::max(sampled_most, GrammarMatcher::min_completion(g, after));
    checked.ids++;
  }
  if (sampled_most > most_after)
    die(where + ": a sampled token leaves " + std::to_string(sampled_most) + " to complete, most_after says " +
        std::to_string(most_after));
  checked.states++;
  if (checked.states % 4 == 0) {  // mask_within at a budget a little above the state's own shortest completion
    const int64_t budget = GrammarMatcher::min_completion(g, state) + int64_t(rng.below(3));
    TokenMask within;
    masker.mask_within(state, budget, within);
    for (int32_t id : ids) {
      const std::string& bytes = v.tokens[size_t(id)];
      const bool expected = !v.excluded[size_t(id)] && GrammarMatcher::advance(g, state, bytes, after) &&
                            GrammarMatcher::min_completion(g, after) <= budget;
      if (expected != kvlite::token_mask_allows(within, id))
        die(where + ": mask_within(" + std::to_string(budget) + "): token " + std::to_string(id) + " is " +
            (expected ? "within the budget but masked out" : "allowed but past the budget or not readable"));
    }
    checked.budget_states++;
  }
}

// ---- timing ---------------------------------------------------------------------------------------------------------
struct Samples {
  // microseconds per token; total = mask + apply + accept, engine = total + mask_within where the engine asks
  // for it; budget: only the steps that asked
  std::vector<double> mask, apply, accept, total, engine, budget;
  int64_t tokens = 0, computed = 0, reused = 0, walks = 0, complete = 0, budget_same = 0;
  void add(const Samples& o) {
    mask.insert(mask.end(), o.mask.begin(), o.mask.end());
    apply.insert(apply.end(), o.apply.begin(), o.apply.end());
    accept.insert(accept.end(), o.accept.begin(), o.accept.end());
    total.insert(total.end(), o.total.begin(), o.total.end());
    engine.insert(engine.end(), o.engine.begin(), o.engine.end());
    budget.insert(budget.end(), o.budget.begin(), o.budget.end());
    tokens += o.tokens, computed += o.computed, reused += o.reused, walks += o.walks, complete += o.complete;
    budget_same += o.budget_same;
  }
};
double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0 : s / double(x.size());
}
double p99(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  return x[size_t(std::ceil(0.99 * double(x.size()))) - 1];
}

// One walk, timed as the engine would spend it. Also checks each applied row (its finite logits are the mask's).
void walk(const kvlite::Grammar& g, const std::shared_ptr<const kvlite::Grammar>& grammar, GrammarMasker& masker,
          const Vocabulary& v, int64_t max_tokens, uint64_t seed, const std::vector<float>& logits,
          std::vector<float>& row, Samples& out, const std::string& where) {
  Rng rng(seed);
  GrammarMatcher matcher(grammar);
  TokenMask budget_mask;
  const int64_t computed0 = masker.masks_computed(), reused0 = masker.masks_reused();
  int64_t n = 0;
  for (; n < max_tokens && !matcher.complete(); n++) {
    auto t0 = Clock::now();
    int64_t most_after = 0;
    const TokenMask* allowed = &masker.mask(matcher.state(), &most_after);
    const double mask_us = us_since(t0);
    double budget_us = 0;
    const int64_t left = max_tokens - n;  // the engine's rule (constrain_row): mask_for_budget
    if (most_after > left - 1 && GrammarMatcher::min_completion(g, matcher.state()) <= left) {
      auto tb = Clock::now();
      const TokenMask& within = masker.mask_for_budget(matcher.state(), left - 1, budget_mask);
      budget_us = us_since(tb);
      if (within == *allowed) out.budget_same++;  // it cut nothing
      allowed = &within;
      out.budget.push_back(budget_us);
    }
    std::memcpy(row.data(), logits.data(), sizeof(float) * size_t(kVocab));
    auto t1 = Clock::now();
    const bool any = apply_mask(row.data(), kVocab, *allowed);
    const double apply_us = us_since(t1);
    const int64_t count = popcount(*allowed);
    int64_t finite = 0;
    for (float x : row) finite += std::isfinite(x) ? 1 : 0;
    if (finite != count || any != (count > 0)) die(where + ": the applied row keeps " + std::to_string(finite) + " logits, the mask allows " + std::to_string(count));
    if (count == 0) {
      if (GrammarMatcher::min_completion(g, matcher.state()) <= left - 1)
        die(where + ": no token allowed at step " + std::to_string(n) + " although the text can be completed");
      break;
    }
    const int32_t id = choose(g, matcher.state(), v.tokens, *allowed, count, rng);
    auto t2 = Clock::now();
    const bool ok = matcher.accept(v.tokens[size_t(id)]);
    const double accept_us = us_since(t2);
    if (!ok) die(where + ": the mask allowed token " + std::to_string(id) + " but accept() refused it");
    out.mask.push_back(mask_us);
    out.apply.push_back(apply_us);
    out.accept.push_back(accept_us);
    out.total.push_back(mask_us + apply_us + accept_us);
    out.engine.push_back(mask_us + budget_us + apply_us + accept_us);
  }
  out.tokens += n;
  out.walks++;
  out.complete += matcher.complete() ? 1 : 0;
  out.computed += masker.masks_computed() - computed0;
  out.reused += masker.masks_reused() - reused0;
}

// ---- the decode floor: lm_head as BF16 matrix x float vector --------------------------------------------------------
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void matvec_rows(const uint16_t* w, const float* x, float* y, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; r++) {
    const uint16_t* wr = w + r * kHidden;
    float acc[16] = {0};
    for (int64_t c = 0; c < kHidden; c += 16)
      for (int k = 0; k < 16; k++) acc[k] += bf16_to_float(wr[c + k]) * x[c + k];
    float s = 0;
    for (float a : acc) s += a;
    y[r] = s;
  }
}

// The matrix read and nothing else (a XOR of its 64-bit words): the bandwidth a decode step could reach here.
uint64_t read_words(const uint64_t* w, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) a ^= w[i], b ^= w[i + 1], c ^= w[i + 2], d ^= w[i + 3];
  for (; i < n; i++) a ^= w[i];
  return a ^ b ^ c ^ d;
}
uint64_t read_all(const uint16_t* w, size_t count, int threads) {
  const uint64_t* words = reinterpret_cast<const uint64_t*>(w);
  const size_t n = count / 4;
  std::vector<uint64_t> partial(size_t(threads), 0);
  std::vector<std::thread> pool;
  const size_t per = (n + size_t(threads) - 1) / size_t(threads);
  for (int t = 0; t < threads; t++) {
    const size_t b = std::min(n, size_t(t) * per), e = std::min(n, b + per);
    pool.emplace_back([&partial, words, b, e, t] { partial[size_t(t)] = read_words(words + b, e - b); });
  }
  for (auto& th : pool) th.join();
  uint64_t r = 0;
  for (uint64_t p : partial) r ^= p;
  return r;
}

void matvec(const uint16_t* w, const float* x, float* y, int threads) {
  if (threads <= 1) return matvec_rows(w, x, y, 0, kVocab);
  std::vector<std::thread> pool;
  const int64_t per = (kVocab + threads - 1) / threads;
  for (int t = 0; t < threads; t++) {
    const int64_t b = std::min<int64_t>(kVocab, t * per), e = std::min<int64_t>(kVocab, b + per);
    pool.emplace_back(matvec_rows, w, x, y, b, e);
  }
  for (auto& th : pool) th.join();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_tokens = 200;
  int repeats = 5;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "--tokens" && i + 1 < argc) max_tokens = std::max(1, atoi(argv[++i]));
    else if (arg == "--repeats" && i + 1 < argc) repeats = std::max(1, atoi(argv[++i]));
    else die("usage: bench-grammar [--tokens N] [--repeats N]");
  }
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  const auto bench_start = Clock::now();

  auto t = Clock::now();
  const Vocabulary v = make_vocabulary(0x6B766C697465ull);
  const double make_ms = us_since(t) / 1e3;
  t = Clock::now();
  auto vocabulary = std::make_shared<const kvlite::GrammarVocabulary>(v.tokens, v.excluded);
  const double trie_ms = us_since(t) / 1e3;
  int64_t vocab_bytes = 0, multibyte = 0;
  for (const auto& s : v.tokens) {
    vocab_bytes += int64_t(s.size());
    for (char c : s)
      if (uint8_t(c) >= 0x80) { multibyte++; break; }
  }
  printf("bench-grammar: --tokens %lld --repeats %d, CPU, %d hardware threads\n", (long long)max_tokens, repeats, hw);
  printf("vocabulary: %lld tokens (synthetic, Qwen-shaped byte-level BPE), %lld bytes, %lld with non-ASCII bytes; trie "
         "%zu nodes, built in %.0f ms (generated in %.0f ms)\n",
         (long long)kVocab, (long long)vocab_bytes, (long long)multibyte, vocabulary->nodes.size(), trie_ms, make_ms);
  for (const auto& c : v.categories) printf("  %-34s %7lld\n", c.first.c_str(), (long long)c.second);

  std::vector<std::shared_ptr<const kvlite::Grammar>> grammars;
  for (const Schema& s : kSchemas) grammars.push_back(compile(s));

  // 1. validate: every state of two walks per schema (40 steps each) against advance() on sampled ids
  t = Clock::now();
  Checked checked;
  for (size_t si = 0; si < grammars.size(); si++) {
    const kvlite::Grammar& g = *grammars[si];
    GrammarMasker masker(grammars[si], vocabulary);  // its own cache: the timed walks start cold
    Rng check_rng(1000 + si);
    for (int w = 0; w < 2; w++) {
      Rng rng(7 * si + uint64_t(w) + 1);
      GrammarMatcher matcher(grammars[si]);
      for (int step = 0; step < 40 && !matcher.complete(); step++) {
        const std::string where = std::string(kSchemas[si].name) + ", walk " + std::to_string(w) + ", step " + std::to_string(step);
        check_state(g, masker, matcher.state(), v, check_rng, where, checked);
        const TokenMask& mask = masker.mask(matcher.state());
        const int64_t allowed = popcount(mask);
        if (allowed == 0) die(where + ": no token allowed and the text is not complete");
        const int32_t id = choose(g, matcher.state(), v.tokens, mask, allowed, rng);
        if (!matcher.accept(v.tokens[size_t(id)])) die(where + ": accept() refused an allowed token");
      }
    }
  }
  printf("validated: %lld states of %zu schemas, %lld sampled ids against GrammarMatcher::advance (and most_after), "
         "%lld mask_within budgets: all equal (%.1f s)\n",
         (long long)checked.states, grammars.size(), (long long)checked.ids, (long long)checked.budget_states,
         us_since(t) / 1e6);

  // the lm_head product, validated on sampled rows against a float64 dot product
  std::vector<uint16_t> weights(static_cast<size_t>(kVocab * kHidden));
  {
    Rng rng(42);
    for (size_t i = 0; i < weights.size(); i += 4) {
      const uint64_t r = rng.next();
      for (size_t k = 0; k < 4 && i + k < weights.size(); k++) {
        // a normal-ish weight of magnitude ~0.02: sign, exponent 2^-8 .. 2^-5, 7 random mantissa bits
        const uint16_t bits = uint16_t(r >> (16 * k));
        weights[i + k] = uint16_t((bits & 0x8000) | uint16_t((119 + ((bits >> 7) & 3)) << 7) | (bits & 0x7F));
      }
    }
  }
  std::vector<float> x(static_cast<size_t>(kHidden)), y(static_cast<size_t>(kVocab));
  {
    Rng rng(43);
    for (float& e : x) e = float(rng.uniform() * 2 - 1);
  }
  matvec(weights.data(), x.data(), y.data(), hw);
  {
    Rng rng(44);
    for (int i = 0; i < 256; i++) {
      const int64_t r = int64_t(rng.below(uint64_t(kVocab)));
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < kHidden; c++) {
        const double p = double(bf16_to_float(weights[size_t(r * kHidden + c)])) * double(x[size_t(c)]);
        ref += p, mag += std::fabs(p);
      }
      if (std::fabs(double(y[size_t(r)]) - ref) > 1e-5 * mag + 1e-30)
        die("lm_head product: row " + std::to_string(r) + " is " + std::to_string(y[size_t(r)]) + ", float64 says " + std::to_string(ref));
    }
  }
  const double matrix_bytes = double(weights.size()) * 2;
  // The fastest of 9 after a warm-up, before the walks and again after them: the floor is what the machine can do
  // (other work on it only slows a run).
  double one_ms = 1e30, all_ms = 1e30, read_ms = 1e30;
  volatile uint64_t sink = 0;
  auto measure_floor = [&] {
    auto fastest = [&](auto&& call) {
      call();
      double best = 1e30;
      for (int i = 0; i < 9; i++) {
        auto s = Clock::now();
        call();
        best = std::min(best, us_since(s) / 1e3);
      }
      return best;
    };
    one_ms = std::min(one_ms, fastest([&] { matvec(weights.data(), x.data(), y.data(), 1); }));
    if (hw > 1) all_ms = std::min(all_ms, fastest([&] { matvec(weights.data(), x.data(), y.data(), hw); }));
    read_ms = std::min(read_ms, fastest([&] { sink = sink ^ read_all(weights.data(), weights.size(), hw); }));
  };
  measure_floor();

  // 2. time the walks
  std::vector<float> logits(static_cast<size_t>(kVocab)), row(static_cast<size_t>(kVocab));
  {
    Rng rng(45);
    for (float& e : logits) e = float(rng.uniform() * 20 - 10);
  }
  std::vector<Samples> colds, steadies;
  Samples all_cold, all_steady;
  for (size_t si = 0; si < grammars.size(); si++) {
    fprintf(stderr, "bench-grammar: timing %s\n", kSchemas[si].name);
    GrammarMasker masker(grammars[si], vocabulary);
    Samples cold, steady;
    for (int w = 0; w < repeats; w++) {
      const std::string where = std::string(kSchemas[si].name) + ", timed walk " + std::to_string(w);
      walk(*grammars[si], grammars[si], masker, v, max_tokens, 0x5EED0000ull + 100 * si + uint64_t(w), logits, row,
           w == 0 ? cold : steady, where);
    }
    colds.push_back(cold);
    steadies.push_back(steady);
    all_cold.add(cold);
    all_steady.add(steady);
  }
  measure_floor();
  const double floor_ms = hw > 1 ? std::min(one_ms, all_ms) : one_ms;
  const double bandwidth = matrix_bytes / (floor_ms / 1e3);  // bytes per second
  const double qwen06_ms = 1.2e9 / bandwidth * 1e3, qwen4_ms = 8.0e9 / bandwidth * 1e3;

  // 3. the figures
  printf("\nper schema: %d walks of at most %lld tokens through one masker; the first walk starts with an empty mask "
         "cache (cold), the rest find what it left (steady). Microseconds per token.\n\n",
         repeats, (long long)max_tokens);
  printf("| schema | shortest document, bytes | tokens cold / steady | complete | masks computed cold / steady | reused | "
         "mask cold mean / p99 | mask steady mean / p99 | apply mean | accept mean | steady a + b + c mean | "
         "mask_within steps, mean | all walks with mask_within, mean | %% of floor: steady a + b + c / all with mask_within |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t si = 0; si < grammars.size(); si++) {
    const Samples& cold = colds[si];
    const Samples& steady = steadies[si];
    Samples both = cold;
    both.add(steady);
    const double steady_total = mean(steady.total.empty() ? cold.total : steady.total);
    const int64_t shortest = GrammarMatcher(grammars[si]).min_completion();
    printf("| %s | %lld | %lld / %lld | %lld/%lld | %lld / %lld | %lld | %.1f / %.0f | %.1f / %.0f | %.1f | %.1f | %.1f | "
           "%zu, %.0f | %.1f | %.2f%% / %.2f%% |\n",
           kSchemas[si].name, (long long)shortest, (long long)cold.tokens, (long long)steady.tokens,
           (long long)both.complete, (long long)both.walks, (long long)cold.computed, (long long)steady.computed,
           (long long)both.reused, mean(cold.mask), p99(cold.mask), mean(steady.mask), p99(steady.mask),
           mean(both.apply), mean(both.accept), steady_total, both.budget.size(), mean(both.budget), mean(both.engine),
           100.0 * steady_total / (floor_ms * 1e3), 100.0 * mean(both.engine) / (floor_ms * 1e3));
  }
  if (all_cold.complete + all_steady.complete < all_cold.walks + all_steady.walks)
    printf("\n(a walk that did not complete: its schema's shortest document has more bytes than --tokens, so the "
           "engine's budget rule, one token per byte, allows no token at all and the request would end with nothing)\n");
  printf("\nlm_head %lld x %lld BF16 (%.0f MB) x float vector, plain C++, the fastest of 9 before the walks and 9 after:\n\n", (long long)kVocab,
         (long long)kHidden, matrix_bytes / 1e6);
  printf("| lm_head product | ms | GB/s |\n|---|---|---|\n");
  printf("| 1 thread | %.2f | %.2f |\n", one_ms, matrix_bytes / one_ms / 1e6);
  if (hw > 1) printf("| %d threads | %.2f | %.2f |\n", hw, all_ms, matrix_bytes / all_ms / 1e6);
  printf("| decode floor (the faster) | %.2f | %.2f |\n", floor_ms, bandwidth / 1e9);
  printf("| (the matrix read alone, %d threads: the bandwidth ceiling) | %.2f | %.2f |\n", hw, read_ms, matrix_bytes / read_ms / 1e6);
  printf("| Qwen3-0.6B whole weights (1.2e9 bytes) at that bandwidth | %.1f | |\n", qwen06_ms);
  printf("| Qwen3-4B whole weights (8.0e9 bytes) at that bandwidth | %.1f | |\n", qwen4_ms);

  auto row_of = [&](const char* what, const std::vector<double>& c, const std::vector<double>& s) {
    printf("| %s | %.1f / %.0f | %.1f / %.0f |\n", what, mean(c), p99(c), mean(s), p99(s));
  };
  printf("\nall schemas, microseconds per token, mean / p99:\n\n");
  printf("| | first walks (cold cache) | later walks (steady state) |\n|---|---|---|\n");
  printf("| walks, tokens | %lld, %lld | %lld, %lld |\n", (long long)all_cold.walks, (long long)all_cold.tokens,
         (long long)all_steady.walks, (long long)all_steady.tokens);
  printf("| masks computed / reused | %lld / %lld | %lld / %lld |\n", (long long)all_cold.computed,
         (long long)all_cold.reused, (long long)all_steady.computed, (long long)all_steady.reused);
  row_of("(a) GrammarMasker::mask", all_cold.mask, all_steady.mask);
  printf("| (a') mask_within, steps that asked: count (cutting nothing), mean us | %zu (%lld), %.0f | %zu (%lld), %.0f |\n",
         all_cold.budget.size(), (long long)all_cold.budget_same, mean(all_cold.budget), all_steady.budget.size(),
         (long long)all_steady.budget_same, mean(all_steady.budget));
  row_of("(b) -inf over the 151,936-float row", all_cold.apply, all_steady.apply);
  row_of("(c) GrammarMatcher::accept", all_cold.accept, all_steady.accept);
  row_of("total (a + b + c)", all_cold.total, all_steady.total);
  row_of("with mask_within (a + a' + b + c)", all_cold.engine, all_steady.engine);
  auto joined = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> r = a;
    r.insert(r.end(), b.begin(), b.end());
    return r;
  };
  const double base_ms[3] = {floor_ms, qwen06_ms, qwen4_ms};
  const char* const base_name[3] = {"the decode floor", "Qwen3-0.6B's weight read", "Qwen3-4B's weight read"};
  for (int which = 0; which < 2; which++) {
    const Samples* kinds[2] = {&all_cold, &all_steady};
    for (int b = 0; b < 3; b++) {
      double pct[2];
      for (int k = 0; k < 2; k++) {
        const std::vector<double>& samples = which == 0 ? kinds[k]->total : kinds[k]->engine;
        pct[k] = 100 * mean(samples.empty() ? (which == 0 ? all_cold.total : all_cold.engine) : samples) / (base_ms[b] * 1e3);
      }
      printf("| %s as %% of %s (%.1f ms) | %.2f%% | %.2f%% |\n", which == 0 ? "a + b + c" : "with mask_within",
             base_name[b], base_ms[b], pct[0], pct[1]);
    }
  }
  const double goal = 5.0;
  auto pct_of_floor = [&](const std::vector<double>& samples) { return 100 * mean(samples) / (floor_ms * 1e3); };
  auto verdict = [&](double pct) { return pct < goal ? "met" : "NOT met"; };
  const double p_steady = pct_of_floor(all_steady.total.empty() ? all_cold.total : all_steady.total);
  const double p_cold = pct_of_floor(all_cold.total);
  const double p_all = pct_of_floor(joined(all_cold.total, all_steady.total));
  const double p_engine = pct_of_floor(joined(all_cold.engine, all_steady.engine));
  printf("\ngoal: constrained cost per token under %.0f%% of unconstrained decoding at a 150k vocabulary, against the "
         "decode floor (lm_head only, %.2f ms): a + b + c steady state %.2f%% (%s), first walks %.2f%% (%s), all walks "
         "%.2f%% (%s); with the engine's mask_within steps, all walks %.2f%% (%s)\n",
         goal, floor_ms, p_steady, verdict(p_steady), p_cold, verdict(p_cold), p_all, verdict(p_all), p_engine,
         verdict(p_engine));
  printf("bench-grammar: %.1f s\n", us_since(bench_start) / 1e6);
  return 0;
}
