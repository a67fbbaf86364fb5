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

// The entry of `cp` in a generated expansion table (kCompatibilityDecomposition, kLowercase), or nullptr.
template <size_t N>
inline const Expansion* find_expansion(const Expansion (&table)[N], uint32_t cp) {
  auto it = std::lower_bound(std::begin(table), std::end(table), cp,
                             [](const Expansion& e, uint32_t value) { return e.code_point < value; });
  return it != std::end(table) && it->code_point == cp ? it : nullptr;
}

// NFC (or, with `compatibility`, NFKC) of valid UTF-8: full canonical (or compatibility) decomposition,
// canonical ordering of combining marks, then canonical composition of every mark not blocked from the last
// starter.
inline std::string nfc(std::string_view text, bool compatibility = false) {
  // U+0000..U+009F (bytes below 0xC2) contain nothing NFKC changes; U+0000..U+02FF (below 0xCC) nothing NFC
  // changes.
  const unsigned char first_changed = compatibility ? 0xC2 : 0xCC;
  if (std::none_of(text.begin(), text.end(),
                   [&](char c) { return static_cast<unsigned char>(c) >= first_changed; }))
    return std::string(text);
  std::vector<uint32_t> chars;  // (code points) the full decomposition
  chars.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = utf8_next(text, i);
    const Expansion* expansion = compatibility ? find_expansion(kCompatibilityDecomposition, cp) : nullptr;
    if (expansion)  // already the full NFKD
      chars.insert(chars.end(), kExpansionCodePoints + expansion->offset,
                   kExpansionCodePoints + expansion->offset + expansion->length);
    else
      decompose_canonical(cp, chars);
  }
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

// Unicode full lowercase mapping, character by character (Rust's char::to_lowercase, which HF's Lowercase
// normalizer applies; Python's str.lower() of one character, from which the table is generated).
inline std::string lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = utf8_next(text, i);
    if (cp >= 'A' && cp <= 'Z') {
      out += char(cp + 32);
    } else if (cp < 0x80) {
      out += char(cp);
    } else if (const Expansion* lower = find_expansion(kLowercase, cp)) {
      for (uint32_t k = 0; k < lower->length; k++) utf8_append(out, kExpansionCodePoints[lower->offset + k]);
    } else {
      utf8_append(out, cp);
    }
  }
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
// The pre-tokenizers that HF writes with Rust's `regex` crate or a character predicate, as PCRE2 patterns:
// Whitespace is `\w+|[^\w\s]+` (inverted, matches kept); WhitespaceSplit splits on char::is_whitespace;
// Digits on char::is_numeric (Nd, Nl, No); Punctuation on is_ascii_punctuation || is_punctuation (P*).
#define KVLITE_WHITE_SPACE_CLASS R"(\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
#define KVLITE_WORD_CLASS R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})"
constexpr const char* kWhitespacePattern = "[" KVLITE_WORD_CLASS "]+|[^" KVLITE_WORD_CLASS KVLITE_WHITE_SPACE_CLASS "]+";
constexpr const char* kWhiteSpaceCharacterPattern = "[" KVLITE_WHITE_SPACE_CLASS "]";
#undef KVLITE_WHITE_SPACE_CLASS
#undef KVLITE_WORD_CLASS
constexpr const char* kDigitPattern = R"(\p{N})";
constexpr const char* kPunctuationPattern = R"([\p{P}\x{21}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{60}\x{7B}-\x{7E}])";

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

// Where a SentencePiece-style Metaspace step adds its replacement character in front of a piece.
enum class PrependScheme { always, first, never };

// One normalizer step (HF normalizers/*), applied to each piece of text outside the added tokens.
struct NormalizerStep {
  enum class Kind { nfc, nfkc, lowercase, strip, prepend, replace } kind = Kind::nfc;
  bool strip_left = false, strip_right = false;  // strip
  std::string text;                              // prepend: what is put in front; replace: the replacement
  Regex pattern;                                 // replace: what is replaced (a String pattern is escaped)
};

// One pre-tokenizer step. Whitespace, WhitespaceSplit, Digits and Punctuation are Split steps with the
// pattern HF's predicate or regex stands for.
struct PreTokenizerStep {
  enum class Kind { split, byte_level, metaspace } kind = Kind::split;
  // split
  Regex regex;
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  // byte_level
  bool add_prefix_space = false;
  bool use_regex = false;
  // metaspace
  std::string replacement;  // one character, "▁": spaces become it
  Regex replacement_regex;  // it, to split at
  PrependScheme prepend_scheme = PrependScheme::always;
  bool split = true;
};

// One decoder step (HF decoders/*); each maps the list of token strings to a new list.
struct DecoderStep {
  enum class Kind { byte_level, metaspace, byte_fallback, fuse, strip, replace } kind = Kind::byte_level;
  std::string replacement;  // metaspace: the character that stands for a space
  PrependScheme prepend_scheme = PrependScheme::always;
  Regex pattern;            // replace: what is replaced
  std::string content;      // replace: the replacement
  uint32_t strip_character = ' ';
  size_t strip_start = 0, strip_stop = 0;  // strip: at most this many characters at each end
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
  bool at_start = false;  // it begins at byte 0 of the input (Metaspace's prepend_scheme "first" asks)
};

}  // namespace tok

struct TokenizerData {
  // ---- vocabulary (model vocab and added tokens), indexed by id ----
  std::vector<std::string> token_text;                  // as written in tokenizer.json ("Ġthe", "▁the"); "" for a hole
  std::vector<std::string> token_bytes;                 // what the decoder makes of the token on its own (" the")
  std::vector<uint8_t> token_present;                   // 1 when the id has a token
  std::vector<uint8_t> token_special;                   // 1 for added tokens marked special
  std::unordered_map<std::string, int32_t> id_by_text;  // model vocab, then added tokens over it
  std::unordered_map<int32_t, std::string> decoder_text;  // normalized added tokens: what the decoder sees

  // ---- BPE model ----
  std::unordered_map<std::string, int32_t> model_vocab;  // the model's own vocabulary (no added tokens)
  std::array<int32_t, 256> byte_fallback_id{};           // the id of <0xXX> for each byte, or -1
  std::unordered_map<uint64_t, tok::MergeRule> merges;   // (left id << 32 | right id) -> rule
  int32_t unk_id = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;

  // ---- pipeline ----
  std::vector<tok::NormalizerStep> normalizer;
  std::vector<tok::PreTokenizerStep> pre_tokenizer;
  std::vector<tok::DecoderStep> decoder;
  bool has_decoder = false;  // without one HF joins the tokens with spaces
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
  // Whether an id is a byte-fallback token <0xXX> (the ByteFallback decoder joins runs of them).
  bool is_byte_token(int32_t id) const;
  // Whether the bytes of ids[0, count) (each token's own, token_bytes) end inside a UTF-8 character, with the
  // bytes so far a valid start of one.
  bool ends_inside_character(const int32_t* ids, size_t count) const;
  std::vector<int32_t> bpe(const std::string& word) const;
  std::vector<int32_t> bpe_uncached(const std::string& word) const;
  std::string normalize(std::string text) const;
  void split_added_tokens(std::vector<tok::Piece>& pieces, const tok::TokenTrie& trie) const;
  std::vector<std::string> pre_tokenize(const std::string& text, bool at_start) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // The decoder chain on token strings, joined (HF Tokenizer::decode after the id -> token step).
  // open_end: skip a Strip's stop on the joined text (what the streaming decoder shows while more may come).
  std::string decode_tokens(std::vector<std::string> tokens, bool open_end = false) const;
  // What the decoder's per-token steps make of one token that is not first in the text, without joining or
  // UTF-8 repair (ByteLevel's bytes, a <0xXX> token's byte, "▁" as a space): Tokenizer::token_bytes.
  std::string token_piece(const std::string& token) const;
  std::string decode(const int32_t* ids, size_t count, bool skip_special_tokens, bool open_end = false) const;
  // A Strip step after Fuse or ByteLevel (which join all tokens into one) cuts the end of the whole text: up
  // to held_tail_count characters equal to held_tail_character that a streaming decoder must hold back.
  uint32_t held_tail_character = 0;
  size_t held_tail_count = 0;
};

namespace tok {

// ---- loading tokenizer.json ---------------------------------------------------------------------------------
using Json = nlohmann::json;

[[noreturn]] inline void unsupported(const std::string& where, const std::string& type, const char* supported) {
  fail(ErrorCode::unsupported, format("tokenizer.json %s.type '%s' is not supported (kvlite reads %s)", where.c_str(),
                                      type.c_str(), supported));
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
inline std::string string_member(const Json& object, const char* key, const std::string& where) {
  const Json& value = member(object, key, where);
  if (!value.is_string())
    fail(ErrorCode::bad_format, format("tokenizer.json %s.%s is not a string", where.c_str(), key));
  return value.get<std::string>();
}
// A list member of a Sequence, bounded: each step runs on every piece of every prompt.
inline const Json& step_list(const Json& object, const char* key, const std::string& where) {
  const Json& list = member(object, key, where);
  if (!list.is_array()) fail(ErrorCode::bad_format, format("tokenizer.json %s.%s is not a list", where.c_str(), key));
  if (list.size() > size_t(limits::max_pipeline_steps))
    fail(ErrorCode::bad_format, format("tokenizer.json %s.%s has %zu steps, more than kvlite's limit of %lld "
                                       "(KVLITE_MAX_TOKENIZER_STEPS)", where.c_str(), key, list.size(),
                                       (long long)limits::max_pipeline_steps));
  return list;
}
// A single character ("▁"), as Metaspace's replacement and Strip's content are in HF.
inline std::string one_character(const Json& object, const char* key, const std::string& where) {
  std::string text = string_member(object, key, where);
  size_t next = 0;
  if (text.empty() || utf8_invalid_offset(text) != std::string_view::npos || (utf8_next(text, next), next) != text.size())
    fail(ErrorCode::bad_format, format("tokenizer.json %s.%s '%s' is not one character", where.c_str(), key,
                                       text.c_str()));
  return text;
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

// A {"String": ...} or {"Regex": ...} pattern (Split, Replace), compiled.
inline Regex read_pattern(const Json& step, const std::string& where) {
  const Json& pattern = member(step, "pattern", where);
  std::string regex;
  if (pattern.is_object() && pattern.contains("Regex") && pattern.at("Regex").is_string())
    regex = pattern.at("Regex").get<std::string>();
  else if (pattern.is_object() && pattern.contains("String") && pattern.at("String").is_string())
    regex = regex_escape(pattern.at("String").get<std::string>());
  else
    fail(ErrorCode::bad_format,
         format("tokenizer.json %s.pattern is neither {\"Regex\": ...} nor {\"String\": ...}", where.c_str()));
  if (regex.empty())  // an empty pattern matches between every two characters; no real file has one
    fail(ErrorCode::bad_format, format("tokenizer.json %s.pattern is empty", where.c_str()));
  return Regex(regex, format("tokenizer.json %s.pattern", where.c_str()));
}

inline PrependScheme read_prepend_scheme(const Json& step, const std::string& where) {
  // Files written before prepend_scheme existed carry add_prefix_space instead (true: always).
  if (!step.contains("prepend_scheme") || step.at("prepend_scheme").is_null())
    return flag(step, "add_prefix_space", true) ? PrependScheme::always : PrependScheme::never;
  std::string scheme = string_member(step, "prepend_scheme", where);
  if (scheme == "always") return PrependScheme::always;
  if (scheme == "first") return PrependScheme::first;
  if (scheme == "never") return PrependScheme::never;
  fail(ErrorCode::bad_format, format("tokenizer.json %s.prepend_scheme '%s' is not always, first or never",
                                     where.c_str(), scheme.c_str()));
}

constexpr const char* kSupportedNormalizers = "normalizers null, Sequence, NFC, NFKC, Lowercase, Strip, Prepend, Replace";

inline void read_normalizer(const Json& normalizer, const std::string& where, std::vector<NormalizerStep>& steps,
                            int depth = 0) {
  if (normalizer.is_null()) return;
  if (depth > 8) fail(ErrorCode::bad_format, format("tokenizer.json %s: Sequences nest too deeply", where.c_str()));
  std::string type = type_of(normalizer, where);
  NormalizerStep step;
  if (type == "Sequence") {
    const Json& list = step_list(normalizer, "normalizers", where);
    for (size_t i = 0; i < list.size(); i++)
      read_normalizer(list[i], format("%s.normalizers[%zu]", where.c_str(), i), steps, depth + 1);
    return;
  } else if (type == "NFC") {
    step.kind = NormalizerStep::Kind::nfc;
  } else if (type == "NFKC") {
    step.kind = NormalizerStep::Kind::nfkc;
  } else if (type == "Lowercase") {
    step.kind = NormalizerStep::Kind::lowercase;
  } else if (type == "Strip") {
    step.kind = NormalizerStep::Kind::strip;
    step.strip_left = flag(normalizer, "strip_left", false);
    step.strip_right = flag(normalizer, "strip_right", false);
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::prepend;
    step.text = string_member(normalizer, "prepend", where);
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::replace;
    step.pattern = read_pattern(normalizer, where);
    step.text = string_member(normalizer, "content", where);
  } else {
    unsupported(where, type, kSupportedNormalizers);
  }
  if (steps.size() >= size_t(limits::max_pipeline_steps))
    fail(ErrorCode::bad_format, format("tokenizer.json %s: more than %lld normalizer steps (KVLITE_MAX_TOKENIZER_STEPS)",
                                       where.c_str(), (long long)limits::max_pipeline_steps));
  steps.push_back(std::move(step));
}

inline SplitBehavior read_behavior(const Json& step, const std::string& where, const char* fallback) {
  std::string behavior = step.contains("behavior") && !step.at("behavior").is_null()
                             ? string_member(step, "behavior", where) : std::string(fallback);
  if (behavior == "Isolated") return SplitBehavior::isolated;
  if (behavior == "Removed") return SplitBehavior::removed;
  if (behavior == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (behavior == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (behavior == "Contiguous") return SplitBehavior::contiguous;
  fail(ErrorCode::bad_format,
       format("tokenizer.json %s.behavior '%s' is not a Split behavior", where.c_str(), behavior.c_str()));
}

constexpr const char* kSupportedPreTokenizers =
    "pre-tokenizers null, Sequence, ByteLevel, Metaspace, Split, Digits, Punctuation, Whitespace, WhitespaceSplit";

inline void read_pre_tokenizer(const Json& step, const std::string& where, std::vector<PreTokenizerStep>& steps,
                               int depth = 0) {
  if (depth > 8) fail(ErrorCode::bad_format, format("tokenizer.json %s: Sequences nest too deeply", where.c_str()));
  std::string type = type_of(step, where);
  if (type == "Sequence") {
    const Json& list = step_list(step, "pretokenizers", where);
    for (size_t i = 0; i < list.size(); i++)
      read_pre_tokenizer(list[i], format("%s.pretokenizers[%zu]", where.c_str(), i), steps, depth + 1);
    return;
  }
  PreTokenizerStep out;
  if (type == "Split") {
    out.regex = read_pattern(step, where);
    out.behavior = read_behavior(step, where, "");
    out.invert = flag(step, "invert", false);
  } else if (type == "ByteLevel") {
    out.kind = PreTokenizerStep::Kind::byte_level;
    out.add_prefix_space = flag(step, "add_prefix_space", true);
    out.use_regex = flag(step, "use_regex", true);
    if (out.use_regex) out.regex = Regex(kByteLevelPattern, "the ByteLevel pre-tokenizer's regex");
  } else if (type == "Metaspace") {
    out.kind = PreTokenizerStep::Kind::metaspace;
    out.replacement = one_character(step, "replacement", where);
    out.prepend_scheme = read_prepend_scheme(step, where);
    out.split = flag(step, "split", true);
    out.replacement_regex = Regex(regex_escape(out.replacement), "the Metaspace pre-tokenizer's split");
  } else if (type == "Digits") {
    out.regex = Regex(kDigitPattern, "the Digits pre-tokenizer's class");
    out.behavior = flag(step, "individual_digits", false) ? SplitBehavior::isolated : SplitBehavior::contiguous;
  } else if (type == "Punctuation") {
    out.regex = Regex(kPunctuationPattern, "the Punctuation pre-tokenizer's class");
    out.behavior = read_behavior(step, where, "Isolated");
  } else if (type == "Whitespace") {
    out.regex = Regex(kWhitespacePattern, "the Whitespace pre-tokenizer's regex");
    out.behavior = SplitBehavior::removed;
    out.invert = true;  // the regex's matches are the pieces; what lies between is dropped
  } else if (type == "WhitespaceSplit") {
    out.regex = Regex(kWhiteSpaceCharacterPattern, "the WhitespaceSplit pre-tokenizer's class");
    out.behavior = SplitBehavior::removed;
  } else {
    unsupported(where, type, kSupportedPreTokenizers);
  }
  if (steps.size() >= size_t(limits::max_pipeline_steps))
    fail(ErrorCode::bad_format, format("tokenizer.json %s: more than %lld pre-tokenizer steps "
                                       "(KVLITE_MAX_TOKENIZER_STEPS)", where.c_str(), (long long)limits::max_pipeline_steps));
  steps.push_back(std::move(out));
}

constexpr const char* kSupportedDecoders =
    "decoders null, Sequence, ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace";

inline void read_decoder(const Json& decoder, const std::string& where, std::vector<DecoderStep>& steps,
                         int depth = 0) {
  if (depth > 8) fail(ErrorCode::bad_format, format("tokenizer.json %s: Sequences nest too deeply", where.c_str()));
  std::string type = type_of(decoder, where);
  DecoderStep step;
  if (type == "Sequence") {
    const Json& list = step_list(decoder, "decoders", where);
    for (size_t i = 0; i < list.size(); i++)
      read_decoder(list[i], format("%s.decoders[%zu]", where.c_str(), i), steps, depth + 1);
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::byte_level;
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::metaspace;
    step.replacement = one_character(decoder, "replacement", where);
    step.prepend_scheme = read_prepend_scheme(decoder, where);
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::byte_fallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::fuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::strip;
    std::string content = one_character(decoder, "content", where);
    size_t next = 0;
    step.strip_character = utf8_next(content, next);
    for (auto [key, value] : {std::make_pair("start", &step.strip_start), std::make_pair("stop", &step.strip_stop)}) {
      const Json& count = member(decoder, key, where);
      if (!count.is_number_unsigned() || count.get<uint64_t>() > 1024)
        fail(ErrorCode::bad_format, format("tokenizer.json %s.%s is not a count from 0 to 1024", where.c_str(), key));
      *value = count.get<size_t>();
    }
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::replace;
    step.pattern = read_pattern(decoder, where);
    step.content = string_member(decoder, "content", where);
  } else {
    unsupported(where, type, kSupportedDecoders);
  }
  if (steps.size() >= size_t(limits::max_pipeline_steps))
    fail(ErrorCode::bad_format, format("tokenizer.json %s: more than %lld decoder steps (KVLITE_MAX_TOKENIZER_STEPS)",
                                       where.c_str(), (long long)limits::max_pipeline_steps));
  steps.push_back(std::move(step));
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
    const Json& list = step_list(processor, "processors", where);
    for (size_t i = 0; i < list.size(); i++)
      read_post_processor(list[i], format("%s.processors[%zu]", where.c_str(), i), data);
  } else if (type == "TemplateProcessing") {
    read_template(processor, where, data);
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    // <s> $A </s> (Roberta) or [CLS] $A [SEP] (Bert): cls and sep are [token, id] pairs.
    int32_t ids[2];
    const char* keys[2] = {"cls", "sep"};
    for (int k = 0; k < 2; k++) {
      const Json& pair = member(processor, keys[k], where);
      if (!pair.is_array() || pair.size() != 2)
        fail(ErrorCode::bad_format, format("tokenizer.json %s.%s is not a [token, id] pair", where.c_str(), keys[k]));
      ids[k] = checked_id(pair[1], where + "." + keys[k], data.token_present.size());
    }
    data.template_prefix.insert(data.template_prefix.begin(), ids[0]);
    data.template_suffix.push_back(ids[1]);
  } else if (type != "ByteLevel") {  // ByteLevel only trims offsets, which kvlite does not report
    unsupported(where, type, "post-processors null, Sequence, ByteLevel, TemplateProcessing, RobertaProcessing, "
                             "BertProcessing");
  }
}

inline void read_bpe_model(const Json& model, TokenizerData& data) {
  if (model.contains("type") && type_of(model, "model") != "BPE")
    unsupported("model", type_of(model, "model"), "model BPE; the families kvlite targets use no Unigram or "
                                                  "WordPiece tokenizer.json");
  if (model.contains("dropout") && !model.at("dropout").is_null() && model.at("dropout").get<double>() != 0.0)
    fail(ErrorCode::unsupported,
         "tokenizer.json model.dropout is set; kvlite tokenizes deterministically (dropout null)");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(affix) && !model.at(affix).is_null() && !model.at(affix).get<std::string>().empty())
      fail(ErrorCode::unsupported, format("tokenizer.json model.%s is '%s'; BPE in kvlite has none", affix,
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
  data.model_vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    const std::string& text = it.key();
    if (utf8_invalid_offset(text) != std::string_view::npos)
      fail(ErrorCode::bad_format, format("tokenizer.json model.vocab has a token that is not valid UTF-8 (id %d)", id));
    data.id_by_text[text] = id;
    data.model_vocab[text] = id;
    data.token_text[size_t(id)] = text;
    data.token_present[size_t(id)] = 1;
  }
  for (uint32_t b = 0; b < 256; b++) {
    auto it = data.model_vocab.find(format("<0x%02X>", b));
    data.byte_fallback_id[b] = it == data.model_vocab.end() ? -1 : it->second;
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
    token.pattern = token.normalized ? data.normalize(token.content) : token.content;
    if (token.pattern.empty()) continue;  // (a normalizer that removes the whole token: HF can never match it)
    if (size_t(token.id) >= data.token_present.size()) {
      data.token_text.resize(size_t(token.id) + 1);
      data.token_bytes.resize(size_t(token.id) + 1);
      data.token_present.resize(size_t(token.id) + 1, 0);
    }
    data.token_text[size_t(token.id)] = token.content;
    // The decoder sees a normalized added token as it is matched (HF decodes "Hello" under Lowercase as "hello").
    if (token.pattern != token.content) data.decoder_text[token.id] = token.pattern;
    else data.decoder_text.erase(token.id);
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
    read_normalizer(root.value("normalizer", Json()), "normalizer", data->normalizer);
    read_bpe_model(member(root, "model", "(top level)"), *data);
    read_added_tokens(root.value("added_tokens", Json()), *data);

    const Json& pre_tokenizer = root.value("pre_tokenizer", Json());
    if (!pre_tokenizer.is_null()) read_pre_tokenizer(pre_tokenizer, "pre_tokenizer", data->pre_tokenizer);
    read_post_processor(root.value("post_processor", Json()), "post_processor", *data);
    const Json& decoder = root.value("decoder", Json());
    data->has_decoder = !decoder.is_null();
    if (data->has_decoder) read_decoder(decoder, "decoder", data->decoder);
    bool joined = false;
    for (const DecoderStep& step : data->decoder) {
      joined = joined || step.kind == DecoderStep::Kind::fuse || step.kind == DecoderStep::Kind::byte_level;
      if (joined && step.kind == DecoderStep::Kind::strip && step.strip_stop > 0) {
        data->held_tail_character = step.strip_character;  // (real files strip one character kind)
        data->held_tail_count += step.strip_stop;
      }
    }
    for (size_t id = 0; id < data->token_present.size(); id++)
      if (data->token_present[id]) {
        auto normalized = data->decoder_text.find(int32_t(id));
        data->token_bytes[id] =
            data->token_piece(normalized == data->decoder_text.end() ? data->token_text[id] : normalized->second);
      }
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
  std::vector<Symbol> symbols;  // one per initial token; a merge keeps the left one and kills the right
  symbols.reserve(word.size());  // at most one per byte
  auto add = [&](int32_t id) {
    int32_t index = int32_t(symbols.size());
    if (index > 0) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, true});
  };
  // Initial symbols, one per character (HF models/bpe/model.rs merge_word): its vocabulary token, else its
  // UTF-8 bytes as <0xXX> tokens (byte_fallback), else unk (fuse_unk joins a run of them), else nothing.
  int32_t pending_unk = -1;  // an unknown run waiting to be emitted
  for (size_t i = 0; i < word.size();) {
    size_t begin = i;
    tok::utf8_next(word, i);
    auto known = model_vocab.find(word.substr(begin, i - begin));
    if (known != model_vocab.end()) {
      if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
      add(known->second);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (size_t k = begin; k < i && all; k++) all = byte_fallback_id[static_cast<unsigned char>(word[k])] >= 0;
      if (all) {  // HF leaves a pending unk pending here
        for (size_t k = begin; k < i; k++) add(byte_fallback_id[static_cast<unsigned char>(word[k])]);
        continue;
      }
    }
    if (unk_id >= 0) {
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
    auto it = model_vocab.find(word);
    if (it != model_vocab.end()) return {it->second};
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
      if (emitted < start)
        out.push_back({std::string(text.substr(emitted, start - emitted)), -1, piece.at_start && emitted == 0});
      out.push_back({std::string(), token.id});
      emitted = stop;
    }
    if (emitted < text.size()) out.push_back({std::string(text.substr(emitted)), -1, piece.at_start && emitted == 0});
  }
  pieces = std::move(out);
}

namespace tok {
// The byte a "<0xXX>" token stands for (two hex digits, either case as HF's ByteFallback reads them), or -1.
inline int byte_token_value(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  int value = 0;
  for (int k = 3; k < 5; k++) {
    char c = token[size_t(k)];
    int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}
}  // namespace tok

bool TokenizerData::ends_inside_character(const int32_t* ids, size_t count) const {
  std::string tail;  // the last bytes: a character is at most 4
  for (size_t i = count; i > 0 && tail.size() < 4; i--) tail.insert(0, token_bytes[size_t(ids[i - 1])]);
  size_t lead = tail.size();
  while (lead > 0 && tail.size() - lead < 4) {
    lead--;
    if ((static_cast<unsigned char>(tail[lead]) & 0xC0) != 0x80) break;  // not a continuation byte
  }
  if (lead >= tail.size()) return false;
  const tok::Utf8Scan scan =
      tok::utf8_scan(reinterpret_cast<const unsigned char*>(tail.data()) + lead, tail.size() - lead);
  return scan.status == tok::Utf8Status::truncated;
}

bool TokenizerData::is_byte_token(int32_t id) const {
  if (!byte_fallback) return false;
  int value = tok::byte_token_value(token_text[size_t(id)]);  // (id is valid)
  return value >= 0 && byte_fallback_id[size_t(value)] == id;
}

namespace tok {
// Every occurrence of `from` (not empty) in `text` replaced by `to`, left to right.
inline std::string replace_literal(const std::string& text, const std::string& from, const std::string& to) {
  std::string out;
  size_t previous = 0;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, previous)) {
    out.append(text, previous, at - previous);
    out += to;
    previous = at + from.size();
  }
  out.append(text, previous, std::string::npos);
  return out;
}

// Every match of `pattern` in `text` replaced by `content` (HF NormalizedString::replace; Replace decoder).
inline std::string replace_all(const Regex& pattern, const std::string& text, const std::string& content) {
  std::string out;
  size_t previous = 0;
  for (auto [start, end] : pattern.find_all(text)) {
    out.append(text, previous, start - previous);
    out += content;
    previous = end;
  }
  out.append(text, previous, std::string::npos);
  return out;
}

}  // namespace tok

// The normalizer steps on one piece of text (HF normalizers/*).
std::string TokenizerData::normalize(std::string text) const {
  for (const tok::NormalizerStep& step : normalizer) {
    switch (step.kind) {
      case tok::NormalizerStep::Kind::nfc:
        text = tok::nfc(text);
        break;
      case tok::NormalizerStep::Kind::nfkc:
        text = tok::nfc(text, true);
        break;
      case tok::NormalizerStep::Kind::lowercase:
        text = tok::lowercase(text);
        break;
      case tok::NormalizerStep::Kind::strip: {  // char::is_whitespace at either end
        size_t begin = 0, end = text.size();
        while (step.strip_left && begin < end) {
          size_t next = begin;
          if (!tok::is_white_space(tok::utf8_next(text, next))) break;
          begin = next;
        }
        while (step.strip_right && end > begin) {
          size_t start = end;
          if (!tok::is_white_space(tok::utf8_previous(text, end, &start))) break;
          end = start;
        }
        text = text.substr(begin, end - begin);
        break;
      }
      case tok::NormalizerStep::Kind::prepend:  // an empty piece stays empty
        if (!text.empty()) text = step.text + text;
        break;
      case tok::NormalizerStep::Kind::replace:
        text = tok::replace_all(step.pattern, text, step.text);
        break;
    }
  }
  return text;
}

// The pre-tokenizer steps on one text piece (HF PreTokenizedString::split: empty pieces are dropped).
// `at_start`: the piece begins at byte 0 of the input (Metaspace's prepend_scheme "first").
std::vector<std::string> TokenizerData::pre_tokenize(const std::string& text, bool at_start) const {
  std::vector<std::pair<std::string, bool>> pieces{{text, at_start}};  // (text, begins at the input's start)
  for (const tok::PreTokenizerStep& step : pre_tokenizer) {
    std::vector<std::pair<std::string, bool>> next;
    for (auto& [piece, piece_at_start] : pieces) {
      tok::SplitBehavior behavior = step.behavior;
      bool invert = step.invert;
      if (step.kind == tok::PreTokenizerStep::Kind::byte_level) {
        if (step.add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
        behavior = tok::SplitBehavior::isolated, invert = false;
      } else if (step.kind == tok::PreTokenizerStep::Kind::metaspace) {
        piece = tok::replace_literal(piece, " ", step.replacement);
        bool prepend = step.prepend_scheme == tok::PrependScheme::always ||
                       (step.prepend_scheme == tok::PrependScheme::first && piece_at_start);
        if (prepend && piece.compare(0, step.replacement.size(), step.replacement) != 0)
          piece.insert(0, step.replacement);
        behavior = tok::SplitBehavior::merged_with_next, invert = false;
      }
      bool split = step.kind == tok::PreTokenizerStep::Kind::split ||
                   (step.kind == tok::PreTokenizerStep::Kind::byte_level && step.use_regex) ||
                   (step.kind == tok::PreTokenizerStep::Kind::metaspace && step.split);
      std::vector<std::pair<size_t, size_t>> kept;  // [start, end) of each resulting piece
      if (!split) {
        kept.emplace_back(0, piece.size());
      } else {
        // HF NormalizedString::split: the matches and the gaps between them, in order, then the behavior.
        struct Span {
          size_t start, end;
          bool is_match;
        };
        std::vector<Span> spans;
        size_t previous = 0;
        const tok::Regex& regex =
            step.kind == tok::PreTokenizerStep::Kind::metaspace ? step.replacement_regex : step.regex;
        for (auto [start, end] : regex.find_all(piece)) {
          if (previous != start) spans.push_back({previous, start, false});
          spans.push_back({start, end, true});
          previous = end;
        }
        if (previous != piece.size()) spans.push_back({previous, piece.size(), false});
        if (invert)
          for (Span& span : spans) span.is_match = !span.is_match;
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
      }
      for (auto [start, end] : kept) {
        if (end <= start) continue;
        std::string part = piece.substr(start, end - start);
        if (step.kind == tok::PreTokenizerStep::Kind::byte_level) {  // each byte to its visible character
          std::string mapped;
          for (unsigned char byte : part) tok::utf8_append(mapped, tok::byte_to_char()[byte]);
          part = std::move(mapped);
        }
        next.emplace_back(std::move(part), piece_at_start && start == 0);
      }
    }
    pieces = std::move(next);
  }
  std::vector<std::string> words;
  words.reserve(pieces.size());
  for (auto& piece : pieces) words.push_back(std::move(piece.first));
  return words;
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
  if (!text.empty()) pieces.push_back({std::string(text), -1, true});
  split_added_tokens(pieces, raw_added_trie);
  if (!normalizer.empty())
    for (tok::Piece& piece : pieces)
      if (piece.token < 0) piece.text = normalize(std::move(piece.text));
  split_added_tokens(pieces, normalized_added_trie);

  std::vector<int32_t> ids;
  if (add_special_tokens) ids = template_prefix;
  if (!add_special_tokens || template_has_sequence) {
    for (const tok::Piece& piece : pieces) {
      if (piece.token >= 0) {
        ids.push_back(piece.token);
        continue;
      }
      if (piece.text.empty()) continue;
      for (const std::string& word : pre_tokenize(piece.text, piece.at_start)) {
        std::vector<int32_t> word_ids = bpe(word);
        ids.insert(ids.end(), word_ids.begin(), word_ids.end());
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), template_suffix.begin(), template_suffix.end());
  return ids;
}

// HF decoders' decode_chain, step by step, on the token strings; then joined.
std::string TokenizerData::decode_tokens(std::vector<std::string> tokens, bool open_end) const {
  if (!has_decoder) {  // HF: tokens.join(" ")
    std::string text;
    for (size_t i = 0; i < tokens.size(); i++) text += (i ? " " : "") + tokens[i];
    return text;
  }
  bool joined = false;  // a Fuse or ByteLevel step made all tokens one: a Strip then cuts the whole text
  for (const tok::DecoderStep& step : decoder) {
    joined = joined || step.kind == tok::DecoderStep::Kind::fuse || step.kind == tok::DecoderStep::Kind::byte_level;
    switch (step.kind) {
      case tok::DecoderStep::Kind::byte_level: {  // all tokens to bytes, then lossy UTF-8: one token
        std::string bytes;
        for (const std::string& token : tokens) bytes += tok::byte_level_decode(token);
        std::string text;
        tok::utf8_append_lossy(text, bytes, false);
        tokens.assign(1, std::move(text));
        break;
      }
      case tok::DecoderStep::Kind::metaspace:
        for (size_t i = 0; i < tokens.size(); i++) {
          // The replacement character becomes a space, except in the first token, where HF drops every one
          // of them (not only the leading one) unless prepend_scheme is never.
          bool drop = i == 0 && step.prepend_scheme != tok::PrependScheme::never;
          tokens[i] = tok::replace_literal(tokens[i], step.replacement, drop ? "" : " ");
        }
        break;
      case tok::DecoderStep::Kind::byte_fallback: {
        // Runs of <0xXX> tokens become their bytes when those are UTF-8, else one U+FFFD per token.
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (!run_tokens) return;
          if (tok::utf8_invalid_offset(run) == std::string_view::npos) {
            out.push_back(run);
          } else {
            for (size_t k = 0; k < run_tokens; k++) out.push_back(tok::kReplacementCharacter);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& token : tokens) {
          int value = tok::byte_token_value(token);
          if (value >= 0) {
            run += char(value);
            run_tokens++;
          } else {
            flush();
            out.push_back(std::move(token));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case tok::DecoderStep::Kind::fuse: {
        std::string text;
        for (const std::string& token : tokens) text += token;
        tokens.assign(1, std::move(text));
        break;
      }
      case tok::DecoderStep::Kind::strip:
        // Up to strip_start leading and strip_stop trailing characters equal to the content. (HF indexes
        // past the start of a token shorter than strip_stop and panics; kvlite strips what there is.)
        for (std::string& token : tokens) {
          size_t begin = 0, end = token.size();
          for (size_t k = 0; k < step.strip_start && begin < end; k++) {
            size_t next = begin;
            if (tok::utf8_next(token, next) != step.strip_character) break;
            begin = next;
          }
          for (size_t k = 0; k < step.strip_stop && end > begin && !(open_end && joined); k++) {
            size_t start = end;
            if (tok::utf8_previous(token, end, &start) != step.strip_character) break;
            end = start;
          }
          token = token.substr(begin, end - begin);
        }
        break;
      case tok::DecoderStep::Kind::replace:
        for (std::string& token : tokens) token = tok::replace_all(step.pattern, token, step.content);
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

std::string TokenizerData::token_piece(const std::string& token) const {
  if (!has_decoder) return token;
  std::string text = token;
  for (const tok::DecoderStep& step : decoder) {
    switch (step.kind) {
      case tok::DecoderStep::Kind::byte_level:
        text = tok::byte_level_decode(text);
        break;
      case tok::DecoderStep::Kind::metaspace:
        text = tok::replace_literal(text, step.replacement, " ");
        break;
      case tok::DecoderStep::Kind::byte_fallback:
        if (int value = tok::byte_token_value(text); value >= 0) text = std::string(1, char(value));
        break;
      case tok::DecoderStep::Kind::replace:
        text = tok::replace_all(step.pattern, text, step.content);
        break;
      case tok::DecoderStep::Kind::fuse:
      case tok::DecoderStep::Kind::strip:  // both act on the text as a whole, not on one token in it
        break;
    }
  }
  return text;
}

std::string TokenizerData::decode(const int32_t* ids, size_t count, bool skip_special_tokens, bool open_end) const {
  std::vector<std::string> tokens;
  tokens.reserve(count);
  for (size_t i = 0; i < count; i++) {
    int32_t id = ids[i];
    if (!has_token(id))
      fail(ErrorCode::invalid_argument,
           format("cannot decode id %d (position %zu of %zu): it has no token; ids run from 0 to %zu", id, i, count,
                  token_present.size() - 1));
    if (skip_special_tokens && token_special[size_t(id)]) continue;
    auto normalized = decoder_text.find(id);
    tokens.push_back(normalized == decoder_text.end() ? token_text[size_t(id)] : normalized->second);
  }
  return decode_tokens(std::move(tokens), open_end);
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
  return detail::guard([&] { return data_->decode(ids, count, skip_special_tokens); });
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

namespace detail {
// The start of a streaming decoder's context window[begin, end): begin, or earlier while the context's text is
// empty, up to max_ids ids. A context without text may not have used up a Strip's start yet (Fuse, then Strip
// 'x' start 2: "x" and "xx" both decode to ""); one with text has, so more text after it is never cut. *text
// receives the context's decode.
inline size_t streaming_context_start(const TokenizerData& data, const std::vector<int32_t>& window, size_t begin,
                                      size_t end, size_t max_ids, std::string* text) {
  *text = data.decode(window.data() + begin, end - begin, false, true);
  while (text->empty() && begin > 0 && end - begin < max_ids) {
    begin--;
    *text = data.decode(window.data() + begin, end - begin, false, true);
  }
  return begin;
}
}  // namespace detail

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

// decode(window_) past its context is what the ids since add to the whole decode: the decoders' only
// dependence on earlier tokens is the start of the text (Metaspace's first token, a Strip's start after Fuse),
// UTF-8 sequences split across tokens (ByteLevel) and runs of <0xXX> tokens (ByteFallback); the context covers
// each: the last id, the open <0xXX> run before it, and more ids while the context's own text is empty. What later ids
// may still change is held back: trailing U+FFFDs (a character may complete), an open run of <0xXX> tokens,
// and the characters a Strip's stop would cut from the end of the text (they stay when more text follows).
Result<std::string> StreamingDecoder::push(int32_t id) {
  return detail::guard([&] {
    const detail::TokenizerData& data = *tokenizer_.data_;
    if (!data.has_token(id))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cannot decode id %d: it has no token; ids run from 0 to %zu", id,
                                  data.token_present.size() - 1));
    if (skip_special_tokens_ && data.token_special[size_t(id)]) return std::string();
    window_.push_back(id);
    // A run of held ids cannot grow forever; it is let out at kMaxHeldIds. Byte-level text is not cut in the
    // middle of a character whose bytes are still arriving (up to 3 more ids): its first bytes would come out
    // as U+FFFD and the rest as another. (A <0xXX> run is split at its last whole character below.)
    const size_t held_ids = window_.size() - context_ids_;
    bool force = held_ids >= kMaxHeldIds + 3 ||
                 (held_ids >= kMaxHeldIds &&
                  (data.byte_fallback || !data.ends_inside_character(window_.data(), window_.size())));
    if (data.is_byte_token(id) && !force) return std::string();
    if (force) {
      // The window is long and ends in a run of <0xXX> tokens that is still open (a CJK sentence in a vocabulary
      // without its characters, or one character's first bytes after text held back): the run decodes to its
      // characters only if it turns out valid UTF-8, else to one U+FFFD per token. Out goes everything before
      // the run's incomplete last character, as if the run will be valid (and without a Strip's stop: text
      // follows it); that character's bytes stay held, after a context of the ids before them.
      size_t run_start = window_.size();
      while (run_start > 0 && data.is_byte_token(window_[run_start - 1])) run_start--;
      std::string run;
      for (size_t i = run_start; i < window_.size(); i++) run += data.token_bytes[size_t(window_[i])];
      size_t complete = 0, last_character = 0;  // bytes of whole valid characters; where the last one starts
      while (complete < run.size()) {
        detail::tok::Utf8Scan scan = detail::tok::utf8_scan(
            reinterpret_cast<const unsigned char*>(run.data()) + complete, run.size() - complete);
        if (scan.status != detail::tok::Utf8Status::complete) break;
        last_character = complete;
        complete += scan.length;
      }
      const size_t split = run_start + complete;
      if (split < window_.size() && split > context_ids_) {
        std::string text = data.decode(window_.data(), split, false, true);
        std::string out = text.compare(0, emitted_.size(), emitted_) == 0 ? text.substr(emitted_.size()) : text;
        // The context: the last whole character's byte tokens, or the id before the run.
        const size_t context_begin = detail::streaming_context_start(
            data, window_, complete > 0 ? run_start + last_character : split - 1, split, kMaxHeldIds, &emitted_);
        window_.erase(window_.begin(), window_.begin() + long(context_begin));
        context_ids_ = split - context_begin;
        return out;
      }
    }
    std::string text = data.decode(window_.data(), window_.size(), false, true);
    if (text.compare(0, emitted_.size(), emitted_) != 0) {  // (no decoder here rewrites earlier text)
      if (!force) return std::string();
      emitted_.clear();
    }
    size_t stable_end = text.size(), tail_characters = 0;
    while (stable_end > emitted_.size() && !force) {
      size_t start = stable_end;
      uint32_t last = detail::tok::utf8_previous(text, stable_end, &start);
      bool strippable = last == data.held_tail_character && tail_characters < data.held_tail_count;
      if (last != 0xFFFD && !strippable) break;
      tail_characters += strippable;
      stable_end = start;
    }
    std::string out = text.substr(emitted_.size(), stable_end - emitted_.size());
    const size_t held = text.size() - stable_end;
    // The next context: the last id, with the open run of <0xXX> tokens before it if any.
    size_t keep = 1;
    while (keep < window_.size() && keep < kMaxHeldIds && data.is_byte_token(window_[window_.size() - keep]) &&
           data.is_byte_token(window_[window_.size() - keep - 1]))
      keep++;
    if (held == 0) {  // all of the window's text is out: only the context stays
      const size_t context_begin = detail::streaming_context_start(data, window_, window_.size() - keep,
                                                                   window_.size(), kMaxHeldIds, &emitted_);
      window_.erase(window_.begin(), window_.begin() + long(context_begin));
      context_ids_ = window_.size();
    } else {  // keep the whole window: what is held may depend on how its first tokens render
      emitted_ = text.substr(0, stable_end);
    }
    return out;
  });
}

std::string StreamingDecoder::flush() {
  std::string out;
  if (!window_.empty()) {
    std::string text = tokenizer_.data_->decode(window_.data(), window_.size(), false);
    out = text.compare(0, emitted_.size(), emitted_) == 0 ? text.substr(emitted_.size()) : text;
  }
  window_.clear();
  context_ids_ = 0;
  emitted_.clear();
  return out;
}

}  // namespace kvlite
