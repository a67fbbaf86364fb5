// tokenizer: implementation. The reference is Hugging Face `tokenizers` (v0.23): each step below names the
// part of it it mirrors, and the unit tests compare ids with its output token for token.
#include <algorithm>
#include <array>
#include <cctype>
#include <ctime>
#include <mutex>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <nlohmann/json.hpp>
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>
#include "unicode_nfc.inl"

namespace kvlite {

const char* chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::none:
      return "none";
    case ChatFormat::chatml:
      return "chatml";
    case ChatFormat::llama3:
      return "llama3";
  }
  return "?";
}

namespace detail {
namespace tok {

// ---- UTF-8 ------------------------------------------------------------------------------------------------
enum class Utf8Status { complete, invalid, truncated };
struct Utf8Scan {
  size_t length;  // bytes of the longest valid prefix of a sequence (at least 1): the whole character when
                  // complete, else the "maximal subpart" one U+FFFD replaces
  Utf8Status status;
};
// Reads the sequence starting at s[0] (n >= 1 bytes available), with the well-formedness table of Unicode
// (Table 3-7): the second byte's range depends on the lead byte, which rules out overlongs and surrogates.
inline Utf8Scan utf8_scan(const unsigned char* s, size_t n) {
  unsigned char lead = s[0];
  if (lead < 0x80) return {1, Utf8Status::complete};
  size_t need = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) need = 2;
  else if (lead == 0xE0) need = 3, second_lo = 0xA0;
  else if (lead >= 0xE1 && lead <= 0xEC) need = 3;
  else if (lead == 0xED) need = 3, second_hi = 0x9F;
  else if (lead >= 0xEE && lead <= 0xEF) need = 3;
  else if (lead == 0xF0) need = 4, second_lo = 0x90;
  else if (lead >= 0xF1 && lead <= 0xF3) need = 4;
  else if (lead == 0xF4) need = 4, second_hi = 0x8F;
  else return {1, Utf8Status::invalid};
  size_t i = 1;
  for (; i < need; i++) {
    if (i == n) return {i, Utf8Status::truncated};
    unsigned char lo = i == 1 ? second_lo : 0x80, hi = i == 1 ? second_hi : 0xBF;
    if (s[i] < lo || s[i] > hi) return {i, Utf8Status::invalid};
  }
  return {need, Utf8Status::complete};
}

// The byte offset of the first byte that is not part of valid UTF-8, or npos.
inline size_t utf8_invalid_offset(std::string_view text) {
  auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    Utf8Scan scan = utf8_scan(s + i, text.size() - i);
    if (scan.status != Utf8Status::complete) return i;
    i += scan.length;
  }
  return std::string_view::npos;
}

// Decodes the character at text[i] (i < text.size()) and advances i past it. Safe on any bytes: an invalid or
// truncated sequence reads as U+FFFD and is skipped by its maximal subpart, as utf8_append_lossy replaces it.
inline uint32_t utf8_next(std::string_view text, size_t& i) {
  auto* s = reinterpret_cast<const unsigned char*>(text.data()) + i;
  Utf8Scan scan = utf8_scan(s, text.size() - i);
  i += scan.length;
  if (scan.status != Utf8Status::complete) return 0xFFFD;
  switch (scan.length) {
    case 1:
      return s[0];
    case 2:
      return ((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    case 3:
      return ((s[0] & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu);
    default:
      return ((s[0] & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
  }
}
// The character that ends at text[end - 1] (0 < end <= text.size()); *start receives where it begins. Safe on
// any bytes: when no complete character ends exactly there, the last byte alone reads as U+FFFD.
inline uint32_t utf8_previous(std::string_view text, size_t end, size_t* start = nullptr) {
  size_t lead = end - 1;  // a character is at most 4 bytes: at most 3 continuation bytes before its lead
  while (lead > 0 && end - lead < 4 && (static_cast<unsigned char>(text[lead]) & 0xC0) == 0x80) lead--;
  auto* s = reinterpret_cast<const unsigned char*>(text.data());
  Utf8Scan scan = utf8_scan(s + lead, end - lead);
  if (scan.status != Utf8Status::complete || lead + scan.length != end) lead = end - 1;  // no character ends here
  size_t next = lead;
  uint32_t cp = utf8_next(text.substr(0, end), next);
  if (start) *start = lead;
  return cp;
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

constexpr const char* kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Appends bytes as UTF-8, each maximal invalid subpart replaced by U+FFFD (Rust's String::from_utf8_lossy,
// which HF's ByteLevel decoder uses). With keep_truncated_tail, a valid but unfinished character at the very
// end is not replaced: its bytes are returned for the caller to complete later.
inline std::string utf8_append_lossy(std::string& out, std::string_view bytes, bool keep_truncated_tail) {
  auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    Utf8Scan scan = utf8_scan(s + i, bytes.size() - i);
    if (scan.status == Utf8Status::complete) {
      out.append(bytes.data() + i, scan.length);
    } else if (scan.status == Utf8Status::truncated && keep_truncated_tail) {
      return std::string(bytes.substr(i));
    } else {
      out += kReplacementCharacter;
    }
    i += scan.length;
  }
  return std::string();
}

// Unicode White_Space: what Rust's `\s` (HF's added-token lstrip/rstrip) and Oniguruma's `\s` match.
inline bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
// Python's str.isspace(), which Jinja's `trim` filter (Llama-3's chat template) strips: White_Space plus
// the information separators U+001C..U+001F.
inline bool is_python_space(uint32_t cp) { return is_white_space(cp) || (cp >= 0x1C && cp <= 0x1F); }

inline std::string python_strip(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end) {
    size_t next = begin;
    if (!is_python_space(utf8_next(text, next))) break;
    begin = next;
  }
  while (end > begin) {
    size_t start = end;
    if (!is_python_space(utf8_previous(text, end, &start))) break;
    end = std::max(start, begin);
  }
  return std::string(text.substr(begin, end - begin));
}

// ---- NFC (UAX #15) over the generated tables in unicode_nfc.inl -------------------------------------------
constexpr uint32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161, kHangulTBase = 0x11A7;
constexpr uint32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr uint32_t kHangulNCount = kHangulVCount * kHangulTCount, kHangulSCount = kHangulLCount * kHangulNCount;

inline uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  auto end = std::end(kCanonicalCombiningClass);
  auto it = std::upper_bound(std::begin(kCanonicalCombiningClass), end, cp,
                             [](uint32_t value, const CombiningClassRange& r) { return value < r.first; });
  if (it == std::begin(kCanonicalCombiningClass)) return 0;
  --it;
  return cp <= it->last ? it->combining_class : 0;
}

inline void decompose_canonical(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
    uint32_t index = cp - kHangulSBase;
    out.push_back(kHangulLBase + index / kHangulNCount);
    out.push_back(kHangulVBase + (index % kHangulNCount) / kHangulTCount);
    if (index % kHangulTCount) out.push_back(kHangulTBase + index % kHangulTCount);
    return;
  }
  auto end = std::end(kCanonicalDecomposition);
  auto it = std::lower_bound(std::begin(kCanonicalDecomposition), end, cp,
                             [](const CanonicalDecomposition& d, uint32_t value) { return d.code_point < value; });
  if (it == end || it->code_point != cp) {
    out.push_back(cp);
    return;
  }
  decompose_canonical(it->first, out);
  if (it->second) decompose_canonical(it->second, out);
}

// The primary composite of (first, second), or 0.
inline uint32_t compose_canonical(uint32_t first, uint32_t second) {
  if (first >= kHangulLBase && first < kHangulLBase + kHangulLCount && second >= kHangulVBase &&
      second < kHangulVBase + kHangulVCount)
    return kHangulSBase + ((first - kHangulLBase) * kHangulVCount + (second - kHangulVBase)) * kHangulTCount;
  if (first >= kHangulSBase && first < kHangulSBase + kHangulSCount && (first - kHangulSBase) % kHangulTCount == 0 &&
      second > kHangulTBase && second < kHangulTBase + kHangulTCount)
    return first + (second - kHangulTBase);
  auto end = std::end(kCanonicalComposition);
  auto it = std::lower_bound(std::begin(kCanonicalComposition), end, std::make_pair(first, second),
                             [](const CanonicalComposition& c, const std::pair<uint32_t, uint32_t>& key) {
                               return std::make_pair(c.first, c.second) < key;
                             });
  return (it != end && it->first == first && it->second == second) ? it->composite : 0;
}

// NFC of valid UTF-8: full canonical decomposition, canonical ordering of combining marks, then canonical
// composition of every mark not blocked from the last starter.
inline std::string nfc(std::string_view text) {
  // U+0000..U+02FF (bytes below 0xCC) contain no combining marks and nothing NFC changes.
  if (std::none_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0xCC; }))
    return std::string(text);
  std::vector<uint32_t> chars;  // (code points) the full decomposition
  chars.reserve(text.size());
  for (size_t i = 0; i < text.size();) decompose_canonical(utf8_next(text, i), chars);
  // Canonical ordering: a stable sort of every run of non-starters by combining class.
  for (size_t i = 0; i < chars.size();) {
    if (combining_class(chars[i]) == 0) {
      i++;
      continue;
    }
    size_t run_end = i;
    while (run_end < chars.size() && combining_class(chars[run_end]) != 0) run_end++;
    std::stable_sort(chars.begin() + long(i), chars.begin() + long(run_end),
                     [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
    i = run_end;
  }
  // Composition: C joins the last starter S unless a character between them has class 0 or >= class(C).
  std::vector<uint32_t> composed;
  composed.reserve(chars.size());
  long starter = -1;          // index in `composed` of the last starter
  int last_class_since = -1;  // class of the last character kept after that starter; -1: none yet
  for (uint32_t cp : chars) {
    int cls = combining_class(cp);
    bool blocked = last_class_since != -1 && (last_class_since == 0 || last_class_since >= cls);
    if (starter >= 0 && !blocked) {
      if (uint32_t composite = compose_canonical(composed[size_t(starter)], cp)) {
        composed[size_t(starter)] = composite;
        continue;
      }
    }
    if (cls == 0) {
      starter = long(composed.size());
      last_class_since = -1;
    } else {
      last_class_since = cls;
    }
    composed.push_back(cp);
  }
  std::string out;
  out.reserve(text.size());
  for (uint32_t cp : composed) utf8_append(out, cp);
  return out;
}

// ---- regular expressions (PCRE2 with Unicode properties) --------------------------------------------------
struct Pcre2CodeFree {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataFree {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

// A compiled pattern, shared read-only between threads (each search makes its own match data).
class Regex {
 public:
  Regex() = default;
  // `what` names the pattern in errors ("tokenizer.json pre_tokenizer Split regex").
  Regex(const std::string& pattern, const std::string& what) {
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
    if (!code) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof(message));
      fail(ErrorCode::bad_format,
           format("%s '%s' does not compile with PCRE2: %s at offset %zu", what.c_str(), pattern.c_str(),
                  reinterpret_cast<const char*>(message), size_t(error_offset)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // when JIT is unavailable the interpreter runs instead
    code_.reset(code, Pcre2CodeFree());
    what_ = what;
  }

  // Every match in `subject` (valid UTF-8), as [start, end) byte ranges. Iterates as Oniguruma's find_iter
  // (HF's SysRegex) does: an empty match right where the previous match ended is skipped by one character.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const {
    std::vector<std::pair<size_t, size_t>> matches;
    std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr));
    if (!data) throw std::bad_alloc();
    size_t search_from = 0;
    size_t last_match_end = std::string_view::npos;
    while (search_from <= subject.size()) {
      if (!search(subject, search_from, data.get())) break;
      PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      size_t start = ovector[0], end = ovector[1];
      if (start == end && end == last_match_end) {
        if (search_from >= subject.size()) break;
        utf8_next(subject, search_from);
        continue;
      }
      matches.emplace_back(start, end);
      search_from = end;
      last_match_end = end;
    }
    return matches;
  }

  // Whether the pattern matches at the very start of `subject`.
  bool matches_at_start(std::string_view subject) const {
    std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr));
    if (!data) throw std::bad_alloc();
    return search(subject, 0, data.get(), PCRE2_ANCHORED);
  }

 private:
  bool search(std::string_view subject, size_t from, pcre2_match_data* data, uint32_t options = 0) const {
    auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
    // The subject was validated as UTF-8 once, on entry to encode.
    int rc = pcre2_match(code_.get(), text, subject.size(), from, options | PCRE2_NO_UTF_CHECK, data, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // the JIT's small default stack; the interpreter uses the heap
      rc = pcre2_match(code_.get(), text, subject.size(), from, options | PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data,
                       nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      fail(ErrorCode::invalid_argument, format("%s failed on a %zu-byte piece of the input: %s", what_.c_str(),
                                               subject.size(), reinterpret_cast<const char*>(message)));
    }
    return true;
  }

  std::shared_ptr<pcre2_code> code_;
  std::string what_;
};

// The pattern ByteLevel splits with when use_regex is true (GPT-2's).
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust regex's Unicode `\w` (HF's single_word check).
constexpr const char* kWordCharacterPattern = R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

// ---- byte-level alphabet (GPT-2's bytes_to_unicode) -------------------------------------------------------
// Printable bytes stand for themselves; the others map to U+0100 + n in byte order, so every byte has a
// visible character.
inline const std::array<uint32_t, 256>& byte_to_char() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 0x100;
    for (uint32_t b = 0; b < 256; b++) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}
// The inverse map: character -> byte, or -1 for a character outside the alphabet.
inline int char_to_byte(uint32_t cp) {
  static const std::unordered_map<uint32_t, uint8_t> table = [] {
    std::unordered_map<uint32_t, uint8_t> t;
    for (uint32_t b = 0; b < 256; b++) t[byte_to_char()[b]] = uint8_t(b);
    return t;
  }();
  auto it = table.find(cp);
  return it == table.end() ? -1 : it->second;
}
// What HF's ByteLevel decoder makes of one token: its characters mapped back to bytes when all of them are in
// the alphabet, else the token's own UTF-8 (added tokens such as "<|reserved special token 0|>").
inline std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    int b = char_to_byte(utf8_next(token, i));
    if (b < 0) return std::string(token);
    bytes += char(b);
  }
  return bytes;
}

// ---- the pipeline's parts ---------------------------------------------------------------------------------
enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct PreTokenizerStep {
  enum class Kind { split, byte_level } kind = Kind::split;
  // split
  Regex regex;
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  // byte_level
  bool add_prefix_space = false;
  bool use_regex = false;
};

struct AddedToken {
  int32_t id = -1;
  std::string content;
  std::string pattern;  // what is matched: content, or its normalized form when `normalized`
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// Added-token patterns in a byte trie, for leftmost-longest matching (HF uses an Aho-Corasick automaton
// with MatchKind::LeftmostLongest; a trie walk from each position finds the same matches).
class TokenTrie {
 public:
  TokenTrie() : nodes_(1) {}
  void insert(const std::string& pattern, int32_t token_index) {
    size_t node = 0;
    for (unsigned char byte : pattern) {
      auto& children = nodes_[node].children;
      auto it =
          std::lower_bound(children.begin(), children.end(), byte,
                           [](const std::pair<unsigned char, uint32_t>& c, unsigned char b) { return c.first < b; });
      if (it == children.end() || it->first != byte) {
        it = children.insert(it, {byte, uint32_t(nodes_.size())});
        nodes_.emplace_back();
        node = nodes_.size() - 1;  // `it` and `children` may dangle after emplace_back
      } else {
        node = it->second;
      }
    }
    nodes_[node].token = token_index;
    first_bytes_[static_cast<unsigned char>(pattern[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The leftmost-longest match at or after `from`: {start, end, token index}, or start == npos.
  std::tuple<size_t, size_t, int32_t> find(std::string_view text, size_t from) const {
    for (size_t start = from; start < text.size(); start++) {
      if (!first_bytes_[static_cast<unsigned char>(text[start])]) continue;
      size_t node = 0, best_end = 0;
      int32_t best = -1;
      for (size_t i = start; i < text.size(); i++) {
        const auto& children = nodes_[node].children;
        unsigned char byte = static_cast<unsigned char>(text[i]);
        auto it =
            std::lower_bound(children.begin(), children.end(), byte,
                             [](const std::pair<unsigned char, uint32_t>& c, unsigned char b) { return c.first < b; });
        if (it == children.end() || it->first != byte) break;
        node = it->second;
        if (nodes_[node].token >= 0) best = nodes_[node].token, best_end = i + 1;
      }
      if (best >= 0) return {start, best_end, best};
    }
    return {std::string_view::npos, 0, -1};
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, uint32_t>> children;  // sorted by byte
    int32_t token = -1;
  };
  std::vector<Node> nodes_;
  std::array<bool, 256> first_bytes_{};
};

struct MergeRule {
  uint32_t rank;   // position in the merges list: lower merges first
  int32_t merged;  // the id of the concatenation
};

// A piece of the input on its way through the pipeline: text still to tokenize, or an added token's id.
struct Piece {
  std::string text;
  int32_t token = -1;
};

}  // namespace tok

struct TokenizerData {
  // ---- vocabulary (model vocab and added tokens), indexed by id ----
  std::vector<std::string> token_text;                  // as written in tokenizer.json ("Ġthe"); "" for a hole
  std::vector<std::string> token_bytes;                 // what the ByteLevel decoder makes of it (" the")
  std::vector<uint8_t> token_present;                   // 1 when the id has a token
  std::vector<uint8_t> token_special;                   // 1 for added tokens marked special
  std::unordered_map<std::string, int32_t> id_by_text;  // model vocab, then added tokens over it

  // ---- BPE model ----
  std::unordered_map<std::string, int32_t> model_id_by_bytes;  // model vocab keyed by decoded bytes
  std::array<int32_t, 256> byte_token{};                       // the single-byte token of each byte, or -1
  std::array<std::vector<int32_t>, 256> byte_fallback_tokens;  // <0xXX> ids of the byte's character, or empty
  std::unordered_map<uint64_t, tok::MergeRule> merges;         // (left id << 32 | right id) -> rule
  int32_t unk_id = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;

  // ---- pipeline ----
  bool normalize_nfc = false;
  std::vector<tok::PreTokenizerStep> pre_tokenizer;
  std::vector<tok::AddedToken> added_tokens;
  tok::TokenTrie raw_added_trie, normalized_added_trie;
  tok::Regex word_character;
  std::vector<int32_t> template_prefix, template_suffix;  // ids around the sequence when add_special_tokens
  bool template_has_sequence = true;

  // ---- tokenizer_config.json ----
  int32_t bos_id = -1, eos_id = -1;
  // The model's own chat template (tokenizer_config.json chat_template, or chat_template.jinja), which
  // format_chat renders when present; parse_error holds why it could not be parsed (format_chat reports it).
  std::string chat_template_source;
  std::optional<ChatTemplate> chat_template;
  std::optional<Error> chat_template_error;
  // The special tokens transformers passes to the template (bos_token, eos_token, unk_token, pad_token): the
  // config's strings, or null.
  std::string special_tokens_json = "{}";
  // The chat format, and the parts of the chat_template that vary between releases of a family (read from
  // the template's string literals; kvlite does not run Jinja).
  ChatFormat chat_format = ChatFormat::none;
  std::string chatml_default_system;  // Qwen2/2.5: the system turn added when the first message is not one
  bool llama3_dated_system = false;   // Llama-3.1+: a system turn with the dates always opens the prompt
  std::string llama3_knowledge_date;  // "December 2023"
  std::string llama3_today;           // the template's fixed date_string ("26 Jul 2024"), or "" for today

  // ---- word cache: pre-token bytes -> ids (HF caches words shorter than 256 bytes, 10000 of them) ----
  static constexpr size_t kCacheCapacity = 10000, kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  bool has_token(int32_t id) const { return id >= 0 && size_t(id) < token_present.size() && token_present[size_t(id)]; }
  std::vector<int32_t> bpe(const std::string& word) const;
  std::vector<int32_t> bpe_uncached(const std::string& word) const;
  void split_added_tokens(std::vector<tok::Piece>& pieces, const tok::TokenTrie& trie) const;
  std::vector<std::string> pre_tokenize(const std::string& text) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  std::string decode(const int32_t* ids, size_t count, bool skip_special_tokens, bool keep_truncated_tail,
                     std::string* truncated_tail) const;
};

namespace tok {

// ---- loading tokenizer.json ---------------------------------------------------------------------------------
using Json = nlohmann::json;

[[noreturn]] inline void unsupported(const std::string& where, const std::string& type, const char* supported) {
  fail(ErrorCode::unsupported,
       format("tokenizer.json %s type '%s' is not supported (kvlite reads byte-level BPE tokenizers: %s)",
              where.c_str(), type.c_str(), supported));
}

inline const Json& member(const Json& object, const char* key, const std::string& where) {
  if (!object.is_object() || !object.contains(key))
    fail(ErrorCode::bad_format, format("tokenizer.json %s has no '%s'", where.c_str(), key));
  return object.at(key);
}
inline std::string type_of(const Json& object, const std::string& where) {
  const Json& type = member(object, "type", where);
  if (!type.is_string()) fail(ErrorCode::bad_format, format("tokenizer.json %s 'type' is not a string", where.c_str()));
  return type.get<std::string>();
}
inline bool flag(const Json& object, const char* key, bool fallback) {
  if (!object.contains(key) || object.at(key).is_null()) return fallback;
  return object.at(key).get<bool>();
}

inline void read_normalizer(const Json& normalizer, const std::string& where, bool& nfc) {
  if (normalizer.is_null()) return;
  std::string type = type_of(normalizer, where);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const Json& steps = member(normalizer, "normalizers", where);
    for (size_t i = 0; i < steps.size(); i++)
      read_normalizer(steps[i], format("%s.normalizers[%zu]", where.c_str(), i), nfc);
  } else {
    unsupported(where, type, "normalizer null, NFC or a Sequence of NFC");
  }
}

// Escapes a literal for PCRE2 (HF compiles a String pattern as regex::escape(pattern)).
inline std::string regex_escape(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !isalnum(u) && c != '_' && c != ' ') out += '\\';
    out += c;
  }
  return out;
}

inline void read_pre_tokenizer(const Json& step, const std::string& where, std::vector<PreTokenizerStep>& steps) {
  const char* supported = "ByteLevel, or a Sequence of Split steps ending with ByteLevel";
  std::string type = type_of(step, where);
  if (type == "Sequence") {
    const Json& list = member(step, "pretokenizers", where);
    for (size_t i = 0; i < list.size(); i++)
      read_pre_tokenizer(list[i], format("%s.pretokenizers[%zu]", where.c_str(), i), steps);
    return;
  }
  PreTokenizerStep out;
  if (type == "Split") {
    out.kind = PreTokenizerStep::Kind::split;
    const Json& pattern = member(step, "pattern", where);
    std::string regex;
    if (pattern.is_object() && pattern.contains("Regex")) regex = pattern.at("Regex").get<std::string>();
    else if (pattern.is_object() && pattern.contains("String"))
      regex = regex_escape(pattern.at("String").get<std::string>());
    else
      fail(ErrorCode::bad_format,
           format("tokenizer.json %s pattern is neither {\"Regex\": ...} nor {\"String\": ...}", where.c_str()));
    out.regex = Regex(regex, format("tokenizer.json %s regex", where.c_str()));
    std::string behavior = member(step, "behavior", where).get<std::string>();
    if (behavior == "Isolated") out.behavior = SplitBehavior::isolated;
    else if (behavior == "Removed") out.behavior = SplitBehavior::removed;
    else if (behavior == "MergedWithPrevious") out.behavior = SplitBehavior::merged_with_previous;
    else if (behavior == "MergedWithNext") out.behavior = SplitBehavior::merged_with_next;
    else if (behavior == "Contiguous") out.behavior = SplitBehavior::contiguous;
    else
      fail(ErrorCode::bad_format,
           format("tokenizer.json %s behavior '%s' is not a Split behavior", where.c_str(), behavior.c_str()));
    out.invert = flag(step, "invert", false);
  } else if (type == "ByteLevel") {
    out.kind = PreTokenizerStep::Kind::byte_level;
    out.add_prefix_space = flag(step, "add_prefix_space", true);
    out.use_regex = flag(step, "use_regex", true);
    if (out.use_regex) out.regex = Regex(kByteLevelPattern, "the ByteLevel pre-tokenizer's regex");
  } else {
    unsupported(where, type, supported);
  }
  if (!steps.empty() && steps.back().kind == PreTokenizerStep::Kind::byte_level)
    fail(ErrorCode::unsupported, format("tokenizer.json %s (%s) follows the ByteLevel step; kvlite needs ByteLevel "
                                        "to be the last pre-tokenizer step",
                                        where.c_str(), type.c_str()));
  steps.push_back(std::move(out));
}

// An id from tokenizer.json: a non-negative integer below KVLITE_MAX_VOCAB and at most KVLITE_MAX_TOKEN_ID_GAP
// past `entries` (how many ids the file lists so far), since the id tables are dense arrays sized by the
// largest id: a 6 KB file with an id of 3e8 asked for 9.6 GB.
inline int32_t checked_id(const Json& value, const std::string& where, uint64_t entries) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0)
    fail(ErrorCode::bad_format,
         format("tokenizer.json %s: id %s is not a non-negative integer", where.c_str(), value.dump().c_str()));
  const int64_t id = value.get<int64_t>();
  if (id >= limits::max_vocab)
    fail(ErrorCode::bad_format, format("tokenizer.json %s: id %lld is not below kvlite's vocabulary limit %lld "
                                       "(KVLITE_MAX_VOCAB)", where.c_str(), (long long)id, (long long)limits::max_vocab));
  if (uint64_t(id) >= entries + uint64_t(limits::max_token_id_gap))
    fail(ErrorCode::bad_format,
         format("tokenizer.json %s: id %lld is far past the %llu ids the file lists (more than KVLITE_MAX_TOKEN_ID_GAP = "
                "%lld unused ids before it); real vocabularies are dense", where.c_str(), (long long)id,
                (unsigned long long)entries, (long long)limits::max_token_id_gap));
  return int32_t(id);
}

// Reads a TemplateProcessing `single` template into the ids before and after the sequence.
inline void read_template(const Json& processor, const std::string& where, TokenizerData& data) {
  const Json& single = member(processor, "single", where);
  const Json& special_tokens = processor.contains("special_tokens") ? processor.at("special_tokens") : Json::object();
  std::vector<int32_t> prefix, suffix;
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); i++) {
    const Json& piece = single[i];
    if (piece.contains("Sequence")) {
      seen_sequence = true;
    } else if (piece.contains("SpecialToken")) {
      std::string name = member(piece.at("SpecialToken"), "id", where + ".single").get<std::string>();
      if (!special_tokens.contains(name))
        fail(ErrorCode::bad_format, format("tokenizer.json %s.single[%zu] names special token '%s', which is not in "
                                           "its special_tokens",
                                           where.c_str(), i, name.c_str()));
      for (const Json& id : member(special_tokens.at(name), "ids", where + ".special_tokens")) {
        int32_t token = checked_id(id, where + ".special_tokens['" + name + "']", data.token_present.size());
        if (size_t(token) >= data.token_present.size() || !data.token_present[size_t(token)])
          fail(ErrorCode::bad_format, format("tokenizer.json %s.special_tokens['%s'] holds id %d, which is not a token "
                                             "of the vocabulary or added_tokens", where.c_str(), name.c_str(), token));
        (seen_sequence ? suffix : prefix).push_back(token);
      }
    } else {
      fail(ErrorCode::bad_format,
           format("tokenizer.json %s.single[%zu] is neither a Sequence nor a SpecialToken", where.c_str(), i));
    }
  }
  // Templates compose in order: a later TemplateProcessing wraps what the earlier ones produced.
  data.template_prefix.insert(data.template_prefix.begin(), prefix.begin(), prefix.end());
  data.template_suffix.insert(data.template_suffix.end(), suffix.begin(), suffix.end());
  if (!seen_sequence) data.template_has_sequence = false;
}

inline void read_post_processor(const Json& processor, const std::string& where, TokenizerData& data) {
  if (processor.is_null()) return;
  std::string type = type_of(processor, where);
  if (type == "Sequence") {
    const Json& list = member(processor, "processors", where);
    for (size_t i = 0; i < list.size(); i++)
      read_post_processor(list[i], format("%s.processors[%zu]", where.c_str(), i), data);
  } else if (type == "TemplateProcessing") {
    read_template(processor, where, data);
  } else if (type != "ByteLevel") {  // ByteLevel only trims offsets, which kvlite does not report
    unsupported(where, type, "post_processor null, ByteLevel, TemplateProcessing or a Sequence of those");
  }
}

inline void read_bpe_model(const Json& model, TokenizerData& data) {
  if (model.contains("type") && type_of(model, "model") != "BPE")
    unsupported("model", type_of(model, "model"), "model BPE");
  if (model.contains("dropout") && !model.at("dropout").is_null() && model.at("dropout").get<double>() != 0.0)
    fail(ErrorCode::unsupported,
         "tokenizer.json model.dropout is set; kvlite tokenizes deterministically (dropout null)");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(affix) && !model.at(affix).is_null() && !model.at(affix).get<std::string>().empty())
      fail(ErrorCode::unsupported, format("tokenizer.json model.%s is '%s'; byte-level BPE in kvlite has none", affix,
                                          model.at(affix).get<std::string>().c_str()));
  data.fuse_unk = flag(model, "fuse_unk", false);
  data.byte_fallback = flag(model, "byte_fallback", false);
  data.ignore_merges = flag(model, "ignore_merges", false);

  const Json& vocab = member(model, "vocab", "model");
  if (!vocab.is_object()) fail(ErrorCode::bad_format, "tokenizer.json model.vocab is not an object of token: id");
  int32_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    max_id = std::max(max_id, checked_id(it.value(), "model.vocab['" + it.key() + "']", vocab.size()));
  data.token_text.assign(size_t(max_id + 1), std::string());
  data.token_bytes.assign(size_t(max_id + 1), std::string());
  data.token_present.assign(size_t(max_id + 1), 0);
  data.id_by_text.reserve(vocab.size());
  data.model_id_by_bytes.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    const std::string& text = it.key();
    if (utf8_invalid_offset(text) != std::string_view::npos)
      fail(ErrorCode::bad_format, format("tokenizer.json model.vocab has a token that is not valid UTF-8 (id %d)", id));
    data.id_by_text[text] = id;
    data.token_text[size_t(id)] = text;
    data.token_present[size_t(id)] = 1;
    data.token_bytes[size_t(id)] = byte_level_decode(text);
    // Only tokens spelled entirely in the byte alphabet can come out of byte-level pre-tokenization.
    bool in_alphabet = true;
    for (size_t i = 0; i < text.size() && in_alphabet;) in_alphabet = char_to_byte(utf8_next(text, i)) >= 0;
    if (in_alphabet) data.model_id_by_bytes[data.token_bytes[size_t(id)]] = id;
  }

  // Each byte starts as the token of its character; without one: byte fallback, unk, or nothing (as HF).
  for (uint32_t b = 0; b < 256; b++) {
    std::string character;
    utf8_append(character, byte_to_char()[b]);
    auto it = data.id_by_text.find(character);
    data.byte_token[b] = it == data.id_by_text.end() ? -1 : it->second;
    std::vector<int32_t> fallback;
    for (unsigned char byte : character) {
      auto f = data.id_by_text.find(format("<0x%02X>", byte));
      if (f == data.id_by_text.end()) {
        fallback.clear();
        break;
      }
      fallback.push_back(f->second);
    }
    data.byte_fallback_tokens[b] = std::move(fallback);
  }
  if (model.contains("unk_token") && !model.at("unk_token").is_null()) {
    std::string unk = model.at("unk_token").get<std::string>();
    auto it = data.id_by_text.find(unk);
    if (it == data.id_by_text.end())
      fail(ErrorCode::bad_format, format("tokenizer.json model.unk_token '%s' is not in model.vocab", unk.c_str()));
    data.unk_id = it->second;
  }

  const Json& merges = member(model, "merges", "model");
  if (!merges.is_array()) fail(ErrorCode::bad_format, "tokenizer.json model.merges is not a list");
  data.merges.reserve(merges.size());
  uint32_t rank = 0;
  for (size_t i = 0; i < merges.size(); i++) {
    const Json& merge = merges[i];
    std::string left, right;
    if (merge.is_string()) {  // "a b" (the older layout); HF skips "#version" lines
      std::string line = merge.get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;
      size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        fail(ErrorCode::bad_format, format("tokenizer.json model.merges[%zu] '%s' is not two tokens separated by one "
                                           "space",
                                           i, line.c_str()));
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      fail(ErrorCode::bad_format, format("tokenizer.json model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", i));
    }
    int32_t ids[3];
    const std::string* parts[3] = {&left, &right, nullptr};
    std::string merged = left + right;
    parts[2] = &merged;
    for (int k = 0; k < 3; k++) {
      auto it = data.id_by_text.find(*parts[k]);
      if (it == data.id_by_text.end())
        fail(ErrorCode::bad_format, format("tokenizer.json model.merges[%zu] ('%s' '%s'): token '%s' is not in "
                                           "model.vocab",
                                           i, left.c_str(), right.c_str(), parts[k]->c_str()));
      ids[k] = it->second;
    }
    // A repeated pair keeps its last rank, as HF's map insertion does.
    data.merges[(uint64_t(uint32_t(ids[0])) << 32) | uint32_t(ids[1])] = MergeRule{rank++, ids[2]};
  }
}

inline void read_added_tokens(const Json& list, TokenizerData& data) {
  if (!list.is_null() && !list.is_array()) fail(ErrorCode::bad_format, "tokenizer.json added_tokens is not a list");
  for (size_t i = 0; i < list.size(); i++) {
    const Json& entry = list[i];
    std::string where = format("added_tokens[%zu]", i);
    AddedToken token;
    token.content = member(entry, "content", where).get<std::string>();
    if (token.content.empty()) continue;  // HF ignores empty added tokens
    if (utf8_invalid_offset(token.content) != std::string_view::npos)
      fail(ErrorCode::bad_format, format("tokenizer.json %s content is not valid UTF-8", where.c_str()));
    token.special = flag(entry, "special", false);
    token.normalized = flag(entry, "normalized", !token.special);
    token.single_word = flag(entry, "single_word", false);
    token.lstrip = flag(entry, "lstrip", false);
    token.rstrip = flag(entry, "rstrip", false);
    // HF gives a token already in the vocabulary that id; a new one takes the id the file records.
    auto known = data.id_by_text.find(token.content);
    token.id = known != data.id_by_text.end() ? known->second : checked_id(member(entry, "id", where), where + ".id", data.token_present.size() + list.size());
    token.pattern = token.normalized && data.normalize_nfc ? nfc(token.content) : token.content;
    if (size_t(token.id) >= data.token_present.size()) {
      data.token_text.resize(size_t(token.id) + 1);
      data.token_bytes.resize(size_t(token.id) + 1);
      data.token_present.resize(size_t(token.id) + 1, 0);
    }
    data.token_text[size_t(token.id)] = token.content;
    // The decoder sees the token as matched (HF's simple_id_to_token returns the normalized form).
    data.token_bytes[size_t(token.id)] = byte_level_decode(token.pattern);
    data.token_present[size_t(token.id)] = 1;
    data.id_by_text[token.content] = token.id;
    data.added_tokens.push_back(std::move(token));
  }
  data.token_special.assign(data.token_present.size(), 0);
  for (size_t i = 0; i < data.added_tokens.size(); i++) {
    const AddedToken& token = data.added_tokens[i];
    if (token.special) data.token_special[size_t(token.id)] = 1;
    (token.normalized ? data.normalized_added_trie : data.raw_added_trie).insert(token.pattern, int32_t(i));
  }
}

// bos_token / eos_token: a string, an {"content": ...} object, or null.
inline int32_t read_config_token(const Json& config, const char* key, const TokenizerData& data) {
  if (!config.contains(key) || config.at(key).is_null()) return -1;
  const Json& value = config.at(key);
  std::string content = value.is_object() ? value.at("content").get<std::string>() : value.get<std::string>();
  auto it = data.id_by_text.find(content);
  if (it == data.id_by_text.end())
    fail(ErrorCode::bad_format,
         format("tokenizer_config.json %s '%s' is not a token of tokenizer.json", key, content.c_str()));
  return it->second;
}

// The text of a Jinja string literal that continues `prefix` up to `terminator` (e.g. the default system
// message in '<|im_start|>system\nYou are ...<|im_end|>', where \n is still the two-character escape): the
// first occurrence whose text between is plain literal text (no quote: not a concatenation with a variable),
// with its escapes resolved.
inline std::string template_literal(const std::string& chat_template, const std::string& prefix,
                                    const std::string& terminator) {
  for (size_t at = chat_template.find(prefix); at != std::string::npos; at = chat_template.find(prefix, at + 1)) {
    size_t begin = at + prefix.size(), end = chat_template.find(terminator, begin);
    if (end == std::string::npos) break;
    std::string_view literal(chat_template.data() + begin, end - begin);
    if (literal.empty() || literal.find_first_of("'\"") != std::string_view::npos) continue;
    std::string text;
    for (size_t i = 0; i < literal.size(); i++) {
      if (literal[i] == '\\' && i + 1 < literal.size()) {
        char escaped = literal[++i];
        text += escaped == 'n' ? '\n' : escaped == 't' ? '\t' : escaped;
      } else {
        text += literal[i];
      }
    }
    return text;
  }
  return std::string();
}

// Parses the model's chat template; one outside kvlite's Jinja subset leaves the tokenizer usable and makes
// format_chat report why.
inline void set_chat_template(TokenizerData& data, const std::string& source) {
  data.chat_template_source = source;
  data.chat_template.reset();
  data.chat_template_error.reset();
  if (source.empty()) return;
  Result<ChatTemplate> parsed = ChatTemplate::parse(source);
  if (parsed.ok()) data.chat_template = std::move(parsed).value();
  else data.chat_template_error = parsed.error();
}

inline void read_chat_format(const Json& config, TokenizerData& data) {
  // chat_template: a string, or a list of {name, template} (the one named "default", else the first).
  std::string chat_template;
  if (config.contains("chat_template")) {
    const Json& value = config.at("chat_template");
    if (value.is_string()) {
      chat_template = value.get<std::string>();
    } else if (value.is_array() && !value.empty()) {
      chat_template = value[0].value("template", std::string());
      for (const Json& entry : value)
        if (entry.value("name", std::string()) == "default") chat_template = entry.value("template", std::string());
    }
  }
  set_chat_template(data, chat_template);
  nlohmann::ordered_json special = nlohmann::ordered_json::object();
  // transformers' special_tokens_map: the named tokens that are set, in this order (unset ones stay undefined)
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    const Json value = config.value(key, Json());
    if (value.is_string()) special[key] = value.get<std::string>();
    else if (value.is_object() && value.contains("content") && value.at("content").is_string()) special[key] = value.at("content").get<std::string>();
  }
  data.special_tokens_json = special.dump();
  auto has = [&](const char* token) { return data.id_by_text.count(token) > 0; };
  bool chatml = has("<|im_start|>") && has("<|im_end|>");
  bool llama3 = has("<|start_header_id|>") && has("<|end_header_id|>") && has("<|eot_id|>");
  if (chatml && llama3)  // both families' tokens: the chat template decides
    chatml = chat_template.find("<|start_header_id|>") == std::string::npos;
  if (chatml) {
    data.chat_format = ChatFormat::chatml;
    data.chatml_default_system = template_literal(chat_template, "<|im_start|>system\\n", "<|im_end|>");
  } else if (llama3) {
    data.chat_format = ChatFormat::llama3;
    data.llama3_knowledge_date = template_literal(chat_template, "Cutting Knowledge Date: ", "\\n");
    data.llama3_dated_system = !data.llama3_knowledge_date.empty();
    // Llama-3.2 asks for strftime_now("%d %b %Y"), which transformers provides: today's date.
    if (chat_template.find("strftime_now") == std::string::npos)
      data.llama3_today = template_literal(chat_template, "set date_string = \"", "\"");
    if (data.llama3_dated_system && data.llama3_today.empty() && !data.chat_template &&
        chat_template.find("strftime_now") == std::string::npos)
      fail(ErrorCode::unsupported,
           "tokenizer_config.json chat_template has Llama-3.1's dated system turn but no "
           "date_string kvlite can read");
  }
}

inline std::shared_ptr<TokenizerData> read_tokenizer(const std::string& tokenizer_json,
                                                     const std::string& tokenizer_config_json) {
  Json root, config = Json::object();
  for (const std::string* text : {&tokenizer_json, &tokenizer_config_json}) {
    if (text->size() > uint64_t(limits::max_json_bytes))  // (files are checked as read; text may come from memory)
      fail(ErrorCode::bad_format, format("%s is %zu bytes, more than kvlite's limit of %lld (KVLITE_MAX_JSON_BYTES)",
                                         text == &tokenizer_json ? "tokenizer.json" : "tokenizer_config.json",
                                         text->size(), (long long)limits::max_json_bytes));
    check_json_nesting(*text, text == &tokenizer_json ? "tokenizer.json" : "tokenizer_config.json");
  }
  try {
    root = Json::parse(tokenizer_json);
    if (!tokenizer_config_json.empty()) config = Json::parse(tokenizer_config_json);
  } catch (const Json::exception& e) {
    fail(ErrorCode::bad_format,
         format("%s is not valid JSON: %s", root.is_null() ? "tokenizer.json" : "tokenizer_config.json", e.what()));
  }
  auto data = std::make_shared<TokenizerData>();
  try {
    if (!root.is_object()) fail(ErrorCode::bad_format, "tokenizer.json is not a JSON object");
    if (root.contains("version") && root.at("version") != "1.0")
      fail(ErrorCode::unsupported, format("tokenizer.json version %s is not supported (kvlite reads version 1.0)",
                                          root.at("version").dump().c_str()));
    read_normalizer(root.value("normalizer", Json()), "normalizer", data->normalize_nfc);
    read_bpe_model(member(root, "model", "(top level)"), *data);
    read_added_tokens(root.value("added_tokens", Json()), *data);

    const Json& pre_tokenizer = root.value("pre_tokenizer", Json());
    if (!pre_tokenizer.is_null()) read_pre_tokenizer(pre_tokenizer, "pre_tokenizer", data->pre_tokenizer);
    if (data->pre_tokenizer.empty() || data->pre_tokenizer.back().kind != PreTokenizerStep::Kind::byte_level)
      fail(ErrorCode::unsupported,
           "tokenizer.json pre_tokenizer has no ByteLevel step; kvlite reads byte-level BPE "
           "tokenizers only (GPT-2, Llama-3, Qwen)");
    read_post_processor(root.value("post_processor", Json()), "post_processor", *data);
    const Json& decoder = root.value("decoder", Json());
    std::string decoder_type = decoder.is_null() ? "null" : type_of(decoder, "decoder");
    if (decoder_type != "ByteLevel") unsupported("decoder", decoder_type, "decoder ByteLevel");

    if (!config.is_object()) fail(ErrorCode::bad_format, "tokenizer_config.json is not a JSON object");
    data->bos_id = read_config_token(config, "bos_token", *data);
    data->eos_id = read_config_token(config, "eos_token", *data);
    read_chat_format(config, *data);
    data->word_character = Regex(kWordCharacterPattern, "the word-character class");
  } catch (const Json::exception& e) {  // a key with the wrong JSON type
    fail(ErrorCode::bad_format, format("tokenizer.json or tokenizer_config.json is malformed: %s", e.what()));
  }
  for (int32_t id : data->template_prefix)
    if (!data->has_token(id))
      fail(ErrorCode::bad_format, format("tokenizer.json post_processor adds id %d, which has no token", id));
  for (int32_t id : data->template_suffix)
    if (!data->has_token(id))
      fail(ErrorCode::bad_format, format("tokenizer.json post_processor adds id %d, which has no token", id));
  return data;
}

}  // namespace tok

// ---- encoding ---------------------------------------------------------------------------------------------
// BPE merge loop (HF models/bpe/word.rs merge_all): repeatedly merge the adjacent pair with the lowest rank,
// leftmost first, through a priority queue over a linked list of symbols.
std::vector<int32_t> TokenizerData::bpe_uncached(const std::string& word) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the linked list; -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols;  // one per initial byte; a merge keeps the left one and kills the right
  symbols.reserve(word.size());
  auto add = [&](int32_t id) {
    int32_t index = int32_t(symbols.size());
    if (index > 0) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, true});
  };
  // Initial symbols, one per byte (HF: one per character of the byte-mapped word, which is the same).
  int32_t pending_unk = -1;  // an unknown run waiting to be emitted (fuse_unk joins a run into one)
  for (unsigned char byte : word) {
    if (byte_token[byte] >= 0) {
      if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
      add(byte_token[byte]);
    } else if (byte_fallback && !byte_fallback_tokens[byte].empty()) {
      for (int32_t id : byte_fallback_tokens[byte]) add(id);  // HF leaves a pending unk pending here
    } else if (unk_id >= 0) {
      if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
      pending_unk = unk_id;
    }  // else: HF drops the character
  }
  if (pending_unk >= 0) add(pending_unk);

  struct Candidate {
    uint32_t rank;
    int32_t position;  // index of the left symbol
    int32_t merged;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto rule_for = [&](int32_t left, int32_t right) -> const tok::MergeRule* {
    auto it = merges.find((uint64_t(uint32_t(left)) << 32) | uint32_t(right));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); i++)
    if (auto* rule = rule_for(symbols[i].id, symbols[i + 1].id)) queue.push({rule->rank, int32_t(i), rule->merged});
  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[size_t(top.position)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[size_t(left.next)];
    const tok::MergeRule* rule = rule_for(left.id, right.id);
    if (!rule || rule->merged != top.merged) continue;  // stale: a neighbour changed since it was queued
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[size_t(right.next)].prev = top.position;
    if (left.prev >= 0)
      if (auto* r = rule_for(symbols[size_t(left.prev)].id, left.id)) queue.push({r->rank, left.prev, r->merged});
    if (left.next >= 0)
      if (auto* r = rule_for(left.id, symbols[size_t(left.next)].id)) queue.push({r->rank, top.position, r->merged});
  }
  std::vector<int32_t> ids;
  for (const Symbol& s : symbols)
    if (s.alive) ids.push_back(s.id);
  return ids;
}

std::vector<int32_t> TokenizerData::bpe(const std::string& word) const {
  if (ignore_merges) {  // Llama-3: a pre-token that is itself in the vocabulary is emitted whole
    auto it = model_id_by_bytes.find(word);
    if (it != model_id_by_bytes.end()) return {it->second};
  }
  bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(word);
    if (it != cache.end()) return it->second;
  }
  std::vector<int32_t> ids = bpe_uncached(word);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() >= kCacheCapacity) cache.clear();
    cache.emplace(word, ids);
  }
  return ids;
}

// HF AddedVocabulary::find_matches on each text piece: cut out the added tokens, applying single_word,
// lstrip and rstrip as HF does.
void TokenizerData::split_added_tokens(std::vector<tok::Piece>& pieces, const tok::TokenTrie& trie) const {
  if (trie.empty()) return;
  std::vector<tok::Piece> out;
  for (tok::Piece& piece : pieces) {
    if (piece.token >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    std::string_view text = piece.text;
    size_t emitted = 0;  // text before this offset is already in `out`
    size_t from = 0;
    while (from < text.size()) {
      auto [start, stop, index] = trie.find(text, from);
      if (start == std::string_view::npos) break;
      from = stop;
      const tok::AddedToken& token = added_tokens[size_t(index)];
      if (token.single_word) {
        // `at` copies the structured binding: clang before 16 cannot capture a binding in a lambda.
        bool word_before = start > 0 && [&, at = start] {
          std::string character;
          tok::utf8_append(character, tok::utf8_previous(text, at));
          return word_character.matches_at_start(character);
        }();
        bool word_after = stop < text.size() && word_character.matches_at_start(text.substr(stop));
        if (word_before || word_after) continue;
      }
      if (token.lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          size_t character_start = new_start;
          if (!tok::is_white_space(tok::utf8_previous(text, new_start, &character_start))) break;
          new_start = character_start;
        }
        start = std::max(new_start, emitted);  // a previous match may already own those spaces
      }
      if (token.rstrip) {
        while (stop < text.size()) {
          size_t next = stop;
          if (!tok::is_white_space(tok::utf8_next(text, next))) break;
          stop = next;
        }
        from = stop;
      }
      if (emitted < start) out.push_back({std::string(text.substr(emitted, start - emitted)), -1});
      out.push_back({std::string(), token.id});
      emitted = stop;
    }
    if (emitted < text.size()) out.push_back({std::string(text.substr(emitted)), -1});
  }
  pieces = std::move(out);
}

// The pre-tokenizer steps on one text piece (HF PreTokenizedString::split: empty pieces are dropped). The
// result is raw bytes: the ByteLevel step's character mapping is folded into the byte-keyed vocabulary.
std::vector<std::string> TokenizerData::pre_tokenize(const std::string& text) const {
  std::vector<std::string> pieces{text};
  for (const tok::PreTokenizerStep& step : pre_tokenizer) {
    std::vector<std::string> next;
    for (std::string& piece : pieces) {
      if (step.kind == tok::PreTokenizerStep::Kind::byte_level) {
        if (step.add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
        if (!step.use_regex) {
          next.push_back(std::move(piece));
          continue;
        }
      }
      // HF NormalizedString::split: the matches and the gaps between them, in order, then the behavior.
      struct Span {
        size_t start, end;
        bool is_match;
      };
      std::vector<Span> spans;
      size_t previous = 0;
      for (auto [start, end] : step.regex.find_all(piece)) {
        if (previous != start) spans.push_back({previous, start, false});
        spans.push_back({start, end, true});
        previous = end;
      }
      if (previous != piece.size()) spans.push_back({previous, piece.size(), false});
      bool invert = step.kind == tok::PreTokenizerStep::Kind::split && step.invert;
      if (invert)
        for (Span& span : spans) span.is_match = !span.is_match;
      tok::SplitBehavior behavior =
          step.kind == tok::PreTokenizerStep::Kind::byte_level ? tok::SplitBehavior::isolated : step.behavior;
      std::vector<std::pair<size_t, size_t>> kept;  // [start, end) of each resulting piece
      bool previous_match = false;
      switch (behavior) {
        case tok::SplitBehavior::isolated:
          for (const Span& s : spans) kept.emplace_back(s.start, s.end);
          break;
        case tok::SplitBehavior::removed:
          for (const Span& s : spans)
            if (!s.is_match) kept.emplace_back(s.start, s.end);
          break;
        case tok::SplitBehavior::contiguous:
          for (const Span& s : spans) {
            if (s.is_match == previous_match && !kept.empty()) kept.back().second = s.end;
            else kept.emplace_back(s.start, s.end);
            previous_match = s.is_match;
          }
          break;
        case tok::SplitBehavior::merged_with_previous:
          for (const Span& s : spans) {
            if (s.is_match && !previous_match && !kept.empty()) kept.back().second = s.end;
            else kept.emplace_back(s.start, s.end);
            previous_match = s.is_match;
          }
          break;
        case tok::SplitBehavior::merged_with_next:
          for (size_t i = spans.size(); i-- > 0;) {
            const Span& s = spans[i];
            if (s.is_match && !previous_match && !kept.empty()) kept.back().first = s.start;
            else kept.emplace_back(s.start, s.end);
            previous_match = s.is_match;
          }
          std::reverse(kept.begin(), kept.end());
          break;
      }
      for (auto [start, end] : kept)
        if (end > start) next.push_back(piece.substr(start, end - start));
    }
    pieces = std::move(next);
  }
  return pieces;
}

// HF TokenizerImpl::encode_single_sequence: added tokens out of the raw text, normalize the rest, added
// tokens with normalized = true out of that, pre-tokenize, BPE each pre-token, then the post-processor.
std::vector<int32_t> TokenizerData::encode(std::string_view text, bool add_special_tokens) const {
  if (text.size() > uint64_t(limits::max_prompt_bytes))
    fail(ErrorCode::invalid_argument, format("cannot tokenize %zu bytes of text: kvlite's limit is %lld "
                                             "(KVLITE_MAX_PROMPT_BYTES)", text.size(), (long long)limits::max_prompt_bytes));
  size_t bad = tok::utf8_invalid_offset(text);
  if (bad != std::string_view::npos)
    fail(ErrorCode::invalid_argument,
         format("cannot tokenize: the text is not valid UTF-8 at byte %zu (0x%02X) of %zu; pass UTF-8 text", bad,
                unsigned(static_cast<unsigned char>(text[bad])), text.size()));
  std::vector<tok::Piece> pieces;
  if (!text.empty()) pieces.push_back({std::string(text), -1});
  split_added_tokens(pieces, raw_added_trie);
  if (normalize_nfc)
    for (tok::Piece& piece : pieces)
      if (piece.token < 0) piece.text = tok::nfc(piece.text);
  split_added_tokens(pieces, normalized_added_trie);

  std::vector<int32_t> ids;
  if (add_special_tokens) ids = template_prefix;
  if (!add_special_tokens || template_has_sequence) {
    for (const tok::Piece& piece : pieces) {
      if (piece.token >= 0) {
        ids.push_back(piece.token);
        continue;
      }
      for (const std::string& word : pre_tokenize(piece.text)) {
        std::vector<int32_t> word_ids = bpe(word);
        ids.insert(ids.end(), word_ids.begin(), word_ids.end());
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), template_suffix.begin(), template_suffix.end());
  return ids;
}

std::string TokenizerData::decode(const int32_t* ids, size_t count, bool skip_special_tokens, bool keep_truncated_tail,
                                  std::string* truncated_tail) const {
  std::string bytes;
  if (truncated_tail) bytes = *truncated_tail;
  for (size_t i = 0; i < count; i++) {
    int32_t id = ids[i];
    if (!has_token(id))
      fail(ErrorCode::invalid_argument,
           format("cannot decode id %d (position %zu of %zu): it has no token; ids run from 0 to %zu", id, i, count,
                  token_present.size() - 1));
    if (skip_special_tokens && token_special[size_t(id)]) continue;
    bytes += token_bytes[size_t(id)];
  }
  std::string text;
  std::string tail = tok::utf8_append_lossy(text, bytes, keep_truncated_tail);
  if (truncated_tail) *truncated_tail = std::move(tail);
  return text;
}

std::string unicode_nfc(std::string_view valid_utf8) { return tok::nfc(valid_utf8); }
const char* unicode_nfc_version() { return kUnicodeNfcVersion; }

}  // namespace detail

// ---- public API -------------------------------------------------------------------------------------------
Result<Tokenizer> Tokenizer::from_json(const std::string& tokenizer_json, const std::string& tokenizer_config_json) {
  return detail::guard([&] {
    Tokenizer tokenizer;
    tokenizer.data_ = detail::tok::read_tokenizer(tokenizer_json, tokenizer_config_json);
    return tokenizer;
  });
}

Result<Tokenizer> Tokenizer::load(const std::string& model_dir) {
  return detail::guard([&] {
    std::string json_path = detail::path_join(model_dir, "tokenizer.json");
    std::string config_path = detail::path_join(model_dir, "tokenizer_config.json");
    if (!detail::file_exists(json_path))
      detail::fail(ErrorCode::io_error, detail::format("%s does not exist; kvlite reads the tokenizer from a Hugging "
                                                       "Face tokenizer.json in the model directory",
                                                       json_path.c_str()));
    std::string tokenizer_json = detail::read_text_file(json_path);
    std::string config_json = detail::file_exists(config_path) ? detail::read_text_file(config_path) : std::string();
    Result<Tokenizer> tokenizer = from_json(tokenizer_json, config_json);
    if (!tokenizer.ok())  // name the directory the files came from
      detail::fail(tokenizer.error().code, tokenizer.error().message + " (in " + model_dir + ")");
    // transformers saves the template as chat_template.jinja (and then reads it before tokenizer_config.json's).
    std::string jinja_path = detail::path_join(model_dir, "chat_template.jinja");
    if (detail::file_exists(jinja_path)) {
      Tokenizer loaded = std::move(tokenizer).value();
      // The data was made just now and no one else holds it yet: setting its template is still part of loading.
      detail::tok::set_chat_template(const_cast<detail::TokenizerData&>(*loaded.data_), detail::read_text_file(jinja_path));
      return loaded;
    }
    return std::move(tokenizer).value();
  });
}

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return detail::guard([&] { return data_->encode(text, add_special_tokens); });
}

Result<std::string> Tokenizer::decode(const int32_t* ids, size_t count, bool skip_special_tokens) const {
  return detail::guard([&] { return data_->decode(ids, count, skip_special_tokens, false, nullptr); });
}

int32_t Tokenizer::token_id(std::string_view token) const {
  auto it = data_->id_by_text.find(std::string(token));
  return it == data_->id_by_text.end() ? -1 : it->second;
}
std::string Tokenizer::token_text(int32_t id) const {
  return data_->has_token(id) ? data_->token_text[size_t(id)] : "";
}
std::string Tokenizer::token_bytes(int32_t id) const {
  return data_->has_token(id) ? data_->token_bytes[size_t(id)] : "";
}
size_t Tokenizer::vocab_size() const { return data_->token_present.size(); }
int32_t Tokenizer::bos_id() const { return data_->bos_id; }
int32_t Tokenizer::eos_id() const { return data_->eos_id; }
bool Tokenizer::is_special(int32_t id) const { return data_->has_token(id) && data_->token_special[size_t(id)]; }
ChatFormat Tokenizer::chat_format() const { return data_->chat_format; }

Result<std::string> Tokenizer::format_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  return detail::guard([&] {
    // Messages are text from the app's users: bounded, and UTF-8 as encode() requires (the Llama-3 format's
    // trim walks characters, so it must never see a broken one).
    if (messages.size() > uint64_t(limits::max_chat_messages))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%zu chat messages: kvlite's limit is %lld (KVLITE_MAX_CHAT_MESSAGES)", messages.size(),
                                  (long long)limits::max_chat_messages));
    uint64_t total_bytes = 0;
    for (size_t i = 0; i < messages.size(); i++) {
      for (const std::string* field : {&messages[i].role, &messages[i].content}) {
        total_bytes += field->size();
        size_t bad = detail::tok::utf8_invalid_offset(*field);
        if (bad != std::string_view::npos)
          detail::fail(ErrorCode::invalid_argument,
                       detail::format("chat message %zu: its %s is not valid UTF-8 at byte %zu (0x%02X) of %zu; pass "
                                      "UTF-8 text", i, field == &messages[i].role ? "role" : "content", bad,
                                      unsigned(static_cast<unsigned char>((*field)[bad])), field->size()));
      }
      if (total_bytes > uint64_t(limits::max_prompt_bytes))
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("the chat messages hold more than %lld bytes of text (KVLITE_MAX_PROMPT_BYTES)",
                                    (long long)limits::max_prompt_bytes));
    }
    if (data_->chat_template || data_->chat_template_error) {
      nlohmann::ordered_json list = nlohmann::ordered_json::array();
      for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
      return render_chat_template(list.dump(), add_generation_prompt, "{}");
    }
    std::string prompt;
    switch (data_->chat_format) {
      case ChatFormat::chatml:
        // Qwen2/2.5's templates add their default system turn when the conversation does not open with one.
        if (!data_->chatml_default_system.empty() && (messages.empty() || messages[0].role != "system"))
          prompt += "<|im_start|>system\n" + data_->chatml_default_system + "<|im_end|>\n";
        for (const ChatMessage& m : messages) prompt += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
        if (add_generation_prompt) prompt += "<|im_start|>assistant\n";
        break;
      case ChatFormat::llama3: {
        // Llama-3's templates start with bos_token and trim every message; 3.1+ always open with a system
        // turn that carries the knowledge cutoff and today's date, the caller's system message after them.
        const detail::TokenizerData& d = *data_;
        prompt = d.bos_id >= 0 ? d.token_text[size_t(d.bos_id)] : "<|begin_of_text|>";
        size_t first = 0;
        if (d.llama3_dated_system) {
          std::string system;
          if (!messages.empty() && messages[0].role == "system")
            system = detail::tok::python_strip(messages[first++].content);
          std::string today = d.llama3_today;
          if (today.empty()) {  // strftime_now("%d %b %Y")
            char buffer[32];
            time_t now = time(nullptr);
            struct tm local;
            localtime_r(&now, &local);
            strftime(buffer, sizeof(buffer), "%d %b %Y", &local);
            today = buffer;
          }
          prompt += "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: " + d.llama3_knowledge_date +
                    "\nToday Date: " + today + "\n\n" + system + "<|eot_id|>";
        }
        for (size_t i = first; i < messages.size(); i++)
          prompt += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
                    detail::tok::python_strip(messages[i].content) + "<|eot_id|>";
        if (add_generation_prompt) prompt += "<|start_header_id|>assistant<|end_header_id|>\n\n";
        break;
      }
      case ChatFormat::none:
        detail::fail(ErrorCode::unsupported,
                     "this tokenizer has neither ChatML (<|im_start|>, <|im_end|>) nor Llama-3 "
                     "(<|start_header_id|>, <|eot_id|>) tokens, so kvlite has no chat format "
                     "for it; format the prompt yourself and encode it");
    }
    return prompt;
  });
}

bool Tokenizer::has_chat_template() const { return !data_->chat_template_source.empty(); }
const std::string& Tokenizer::chat_template() const { return data_->chat_template_source; }

Result<std::string> Tokenizer::apply_chat_template(std::string_view messages_json, bool add_generation_prompt,
                                                   std::string_view extra_json) const {
  return detail::guard([&] { return render_chat_template(messages_json, add_generation_prompt, extra_json); });
}

// The variables transformers' render_jinja_template gives a template, in its order: messages (reasoning fields
// aliased), tools, documents, add_generation_prompt, then the special tokens and the caller's extra variables.
std::string Tokenizer::render_chat_template(std::string_view messages_json, bool add_generation_prompt,
                                            std::string_view extra_json) const {
  using OJson = nlohmann::ordered_json;
  if (data_->chat_template_error) throw *data_->chat_template_error;
  if (!data_->chat_template)
    detail::fail(ErrorCode::unsupported, "this model ships no chat template (tokenizer_config.json chat_template or "
                                         "chat_template.jinja); use format_chat, which falls back to ChatML or Llama-3");
  for (std::string_view text : {messages_json, extra_json}) {
    if (text.size() > uint64_t(limits::max_prompt_bytes))
      detail::fail(ErrorCode::invalid_argument, detail::format("the chat messages hold more than %lld bytes of JSON "
                                                               "(KVLITE_MAX_PROMPT_BYTES)", (long long)limits::max_prompt_bytes));
    detail::check_json_nesting(text, "the chat messages");
  }
  OJson messages, extra;
  try {
    messages = OJson::parse(messages_json);
    extra = extra_json.empty() ? OJson::object() : OJson::parse(extra_json);
  } catch (const OJson::exception& e) {
    detail::fail(ErrorCode::invalid_argument, std::string("the chat messages or extra variables are not valid JSON: ") + e.what());
  }
  if (!messages.is_array()) detail::fail(ErrorCode::invalid_argument, "the chat messages must be a JSON array of objects");
  if (!extra.is_object()) detail::fail(ErrorCode::invalid_argument, "the extra template variables must be a JSON object");
  if (messages.size() > uint64_t(limits::max_chat_messages))
    detail::fail(ErrorCode::invalid_argument, detail::format("%zu chat messages: kvlite's limit is %lld (KVLITE_MAX_CHAT_MESSAGES)",
                                                             messages.size(), (long long)limits::max_chat_messages));
  OJson chat = OJson::array();
  for (OJson& m : messages) {
    if (!m.is_object()) detail::fail(ErrorCode::invalid_argument, "every chat message must be a JSON object");
    // transformers (_alias_reasoning_fields): reasoning under any of its names is also `thinking` (first) and
    // `reasoning_content` (last).
    const OJson* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"})
      if (!reasoning && m.contains(key) && !m[key].is_null()) reasoning = &m[key];
    if (reasoning) {
      OJson aliased = OJson::object();
      aliased["thinking"] = *reasoning;
      OJson value = *reasoning;
      for (auto it = m.begin(); it != m.end(); ++it) aliased[it.key()] = it.value();
      aliased.erase("reasoning_content");
      aliased["reasoning_content"] = value;
      chat.push_back(std::move(aliased));
    } else {
      chat.push_back(std::move(m));
    }
  }
  OJson context = OJson::object();
  context["messages"] = std::move(chat);
  context["tools"] = extra.contains("tools") ? extra["tools"] : OJson();
  context["documents"] = extra.contains("documents") ? extra["documents"] : OJson();
  context["add_generation_prompt"] = add_generation_prompt;
  const OJson special = OJson::parse(data_->special_tokens_json);
  for (auto it = special.begin(); it != special.end(); ++it) context[it.key()] = it.value();
  for (auto it = extra.begin(); it != extra.end(); ++it)
    if (it.key() != "tools" && it.key() != "documents") context[it.key()] = it.value();
  Result<std::string> rendered = data_->chat_template->render(context.dump());
  if (!rendered.ok()) throw rendered.error();
  return std::move(rendered).value();
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

Result<std::string> StreamingDecoder::push(int32_t id) {
  return detail::guard([&] {
    std::string tail = pending_;
    std::string text = tokenizer_.data_->decode(&id, 1, skip_special_tokens_, true, &tail);
    pending_ = std::move(tail);  // only once the id proved valid
    return text;
  });
}

std::string StreamingDecoder::flush() {
  std::string text;
  detail::tok::utf8_append_lossy(text, pending_, false);
  pending_.clear();
  return text;
}

}  // namespace kvlite
