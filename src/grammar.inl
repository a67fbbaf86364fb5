// grammar: GBNF parser, JSON-schema compiler, recognizer and vocabulary masks (see grammar.hpp).
#include <nlohmann/json.hpp>

namespace kvlite {

// ---- character sets ----------------------------------------------------------------------------------------
bool Grammar::CharSet::contains(uint32_t cp) const {
  bool in = false;
  for (const auto& range : ranges)
    if (cp >= range.first && cp <= range.second) {
      in = true;
      break;
    }
  return in != negated;
}

bool Grammar::CharSet::intersects(uint32_t lo, uint32_t hi) const {
  if (!negated) {
    for (const auto& range : ranges)
      if (range.first <= hi && range.second >= lo) return true;
    return false;
  }
  // negated: some code point of [lo, hi] is outside every range; walk the uncovered gaps
  uint32_t cursor = lo;
  bool progressed = true;
  while (progressed && cursor <= hi) {
    progressed = false;
    for (const auto& range : ranges)
      if (range.first <= cursor && range.second >= cursor) {
        if (range.second >= hi) return false;
        cursor = range.second + 1;
        progressed = true;
      }
  }
  return cursor <= hi;
}

namespace detail {
namespace gbnf {

// UTF-8 decode of one code point from text[pos]; advances pos. Invalid bytes read as themselves (U+0080..FF
// would be wrong; grammars are UTF-8 text, and the parser refuses invalid UTF-8 before it gets here).
inline uint32_t next_code_point(std::string_view text, size_t& pos) {
  const uint8_t lead = uint8_t(text[pos]);
  int length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
  if (length == 0 || pos + size_t(length) > text.size())
    fail(ErrorCode::bad_format, format("grammar: invalid UTF-8 at byte %zu", pos));
  uint32_t cp = length == 1 ? lead : length == 2 ? (lead & 0x1F) : length == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (int i = 1; i < length; i++) {
    const uint8_t byte = uint8_t(text[pos + size_t(i)]);
    if ((byte & 0xC0) != 0x80) fail(ErrorCode::bad_format, format("grammar: invalid UTF-8 at byte %zu", pos));
    cp = (cp << 6) | (byte & 0x3F);
  }
  pos += size_t(length);
  return cp;
}

// A rule while parsing: alternatives of sequences of items; an item is a char set, a rule name or a nested
// (anonymous) rule, with its repetition already expanded into rules of their own.
struct Builder {
  std::string_view src;
  size_t pos = 0;
  std::vector<std::vector<std::vector<Grammar::Element>>> rules;  // rule -> alternatives -> elements
  std::vector<std::string> names;
  std::vector<bool> defined;
  std::unordered_map<std::string, int32_t> by_name;
  std::vector<Grammar::CharSet> char_sets;
  int64_t element_count = 0;

  [[noreturn]] void error(const std::string& what) const {
    int64_t line = 1, column = 1;
    for (size_t i = 0; i < pos && i < src.size(); i++) {
      if (src[i] == '\n') line++, column = 1;
      else column++;
    }
    fail(ErrorCode::bad_format, format("grammar: line %lld, column %lld: %s", (long long)line, (long long)column,
                                       what.c_str()));
  }
  void count(int64_t n) {
    element_count += n;
    if (element_count > limits::max_grammar_elements)
      error(format("more than %lld elements once repetitions are expanded (KVLITE_MAX_GRAMMAR_ELEMENTS)",
                   (long long)limits::max_grammar_elements));
  }
  int32_t rule_named(const std::string& name) {
    auto it = by_name.find(name);
    if (it != by_name.end()) return it->second;
    const int32_t id = int32_t(rules.size());
    rules.emplace_back();
    names.push_back(name);
    defined.push_back(false);
    by_name.emplace(name, id);
    return id;
  }
  int32_t new_rule(const std::string& base) {
    std::string name = base + "-" + std::to_string(rules.size());
    const int32_t id = rule_named(name);
    defined[size_t(id)] = true;
    return id;
  }
  bool at_end() const { return pos >= src.size(); }
  char peek() const { return at_end() ? '\0' : src[pos]; }
  // Spaces and comments; newlines too when `newlines`.
  void skip_space(bool newlines) {
    while (!at_end()) {
      const char c = src[pos];
      if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) pos++;
      else if (c == '#') {
        while (!at_end() && src[pos] != '\n') pos++;
      } else break;
    }
  }
  static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }
  std::string parse_name() {
    const size_t begin = pos;
    while (!at_end() && is_name_char(src[pos])) pos++;
    if (pos == begin) error("a rule name was expected");
    return std::string(src.substr(begin, pos - begin));
  }
  uint32_t parse_hex(int digits) {
    uint32_t value = 0;
    for (int i = 0; i < digits; i++) {
      if (at_end()) error("the escape ends early");
      const char c = src[pos++];
      int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (v < 0) error(format("'%c' is not a hexadecimal digit", c));
      value = value * 16 + uint32_t(v);
    }
    if (value > 0x10FFFF) error("the escape is past U+10FFFF");
    return value;
  }
  // One character of a literal or class, escapes read.
  uint32_t parse_char() {
    if (at_end()) error("a character was expected");
    if (src[pos] == '\\') {
      pos++;
      if (at_end()) error("the escape ends early");
      const char c = src[pos++];
      switch (c) {
        case 'n': return '\n';
        case 't': return '\t';
        case 'r': return '\r';
        case '0': return 0;
        case 'x': return parse_hex(2);
        case 'u': return parse_hex(4);
        case 'U': return parse_hex(8);
        case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': case '/': case '.': return uint32_t(c);
        default: pos--; error(format("unknown escape '\\%c'", c));
      }
    }
    return next_code_point(src, pos);
  }
  int32_t add_set(Grammar::CharSet set) {
    char_sets.push_back(std::move(set));
    return int32_t(char_sets.size() - 1);
  }
  // A sequence of items up to '|', ')' or the end of the rule; returns its elements.
  std::vector<Grammar::Element> parse_sequence(const std::string& rule_name, bool nested) {
    std::vector<Grammar::Element> out;
    size_t last_item_begin = 0;  // index in `out` where the last item starts (for a postfix operator)
    bool have_item = false;
    while (true) {
      skip_space(nested);
      if (at_end()) break;
      const char c = peek();
      if (c == '|' || c == ')' || c == '\n') break;
      if (c == '"') {
        pos++;
        last_item_begin = out.size();
        have_item = true;
        while (true) {
          if (at_end()) error("the string literal is not closed");
          if (peek() == '"') { pos++; break; }
          if (peek() == '\n') error("a string literal may not span lines");
          const uint32_t cp = parse_char();
          Grammar::CharSet set;
          set.ranges.push_back({cp, cp});
          out.push_back({Grammar::Element::chars, add_set(std::move(set))});
          count(1);
        }
        if (out.size() == last_item_begin) have_item = false;  // "" is nothing; a postfix on it is refused below
      } else if (c == '[') {
        pos++;
        Grammar::CharSet set;
        if (peek() == '^') { set.negated = true; pos++; }
        while (true) {
          if (at_end() || peek() == '\n') error("the character class is not closed");
          if (peek() == ']') { pos++; break; }
          const uint32_t first = parse_char();
          uint32_t last = first;
          if (peek() == '-' && pos + 1 < src.size() && src[pos + 1] != ']') {
            pos++;
            last = parse_char();
            if (last < first) error("a range's end is before its start");
          }
          set.ranges.push_back({first, last});
        }
        last_item_begin = out.size();
        have_item = true;
        out.push_back({Grammar::Element::chars, add_set(std::move(set))});
        count(1);
      } else if (c == '.') {
        pos++;
        Grammar::CharSet set;
        set.negated = true;  // nothing excluded: any character
        last_item_begin = out.size();
        have_item = true;
        out.push_back({Grammar::Element::chars, add_set(std::move(set))});
        count(1);
      } else if (c == '(') {
        pos++;
        const int32_t sub = new_rule(rule_name);
        rules[size_t(sub)] = parse_alternatives(rule_name, true);
        skip_space(true);
        if (peek() != ')') error("')' was expected");
        pos++;
        last_item_begin = out.size();
        have_item = true;
        out.push_back({Grammar::Element::rule, sub});
        count(1);
      } else if (is_name_char(c)) {
        const std::string name = parse_name();
        skip_space(false);
        if (src.substr(pos, 3) == "::=") error(format("'%s ::=' starts a new rule: end the previous one with a newline", name.c_str()));
        last_item_begin = out.size();
        have_item = true;
        out.push_back({Grammar::Element::rule, rule_named(name)});
        count(1);
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!have_item) error(format("'%c' follows nothing it could repeat", c));
        pos++;
        int64_t min = 0, max = -1;  // -1: no upper bound
        if (c == '+') min = 1;
        else if (c == '?') max = 1;
        else if (c == '{') {
          auto number = [&]() {
            skip_space(false);
            const size_t begin = pos;
            int64_t value = 0;
            while (!at_end() && peek() >= '0' && peek() <= '9') {
              value = value * 10 + (peek() - '0');
              pos++;
              if (value > limits::max_grammar_repeat)
                error(format("a repetition bound over %lld (KVLITE_MAX_GRAMMAR_REPEAT)", (long long)limits::max_grammar_repeat));
            }
            if (pos == begin) error("a number was expected in { }");
            skip_space(false);
            return value;
          };
          min = number();
          if (peek() == ',') {
            pos++;
            skip_space(false);
            if (peek() != '}') {
              max = number();
              if (max < min) error("{m,n} with n < m");
            }
          } else {
            max = min;
          }
          if (peek() != '}') error("'}' was expected");
          pos++;
        }
        std::vector<Grammar::Element> item(out.begin() + std::ptrdiff_t(last_item_begin), out.end());
        out.resize(last_item_begin);
        repeat(rule_name, item, min, max, out);
        have_item = false;  // x** is refused
      } else {
        error(format("unexpected '%c'", c));
      }
    }
    return out;
  }
  // Appends `item` repeated min..max times (max -1: unbounded) to out, through helper rules.
  void repeat(const std::string& rule_name, const std::vector<Grammar::Element>& item, int64_t min, int64_t max,
              std::vector<Grammar::Element>& out) {
    count(int64_t(item.size()) * (min + 2));
    for (int64_t i = 0; i < min; i++) out.insert(out.end(), item.begin(), item.end());
    if (max < 0) {
      // R ::= item R | ""
      const int32_t r = new_rule(rule_name);
      std::vector<Grammar::Element> loop = item;
      loop.push_back({Grammar::Element::rule, r});
      rules[size_t(r)] = {loop, {}};
      out.push_back({Grammar::Element::rule, r});
      count(int64_t(item.size()) + 2);
      return;
    }
    // up to (max - min) more, nested: R_k ::= item R_{k-1} | "", R_1 ::= item | ""
    int32_t inner = -1;
    for (int64_t k = 1; k <= max - min; k++) {
      const int32_t r = new_rule(rule_name);
      std::vector<Grammar::Element> alt = item;
      if (inner >= 0) alt.push_back({Grammar::Element::rule, inner});
      rules[size_t(r)] = {alt, {}};
      count(int64_t(item.size()) + 2);
      inner = r;
    }
    if (inner >= 0) out.push_back({Grammar::Element::rule, inner});
  }
  std::vector<std::vector<Grammar::Element>> parse_alternatives(const std::string& rule_name, bool nested) {
    std::vector<std::vector<Grammar::Element>> alternatives;
    alternatives.push_back(parse_sequence(rule_name, nested));
    while (true) {
      const size_t save = pos;
      skip_space(true);
      if (peek() == '|') {
        pos++;
        alternatives.push_back(parse_sequence(rule_name, nested));
      } else {
        pos = save;
        break;
      }
    }
    return alternatives;
  }
  void parse_all() {
    while (true) {
      skip_space(true);
      if (at_end()) break;
      const std::string name = parse_name();
      skip_space(false);
      if (src.substr(pos, 3) != "::=") error(format("'::=' was expected after '%s'", name.c_str()));
      pos += 3;
      const int32_t id = rule_named(name);
      if (defined[size_t(id)]) error(format("rule '%s' is defined twice", name.c_str()));
      defined[size_t(id)] = true;
      rules[size_t(id)] = parse_alternatives(name, false);
      skip_space(false);
      if (!at_end() && peek() != '\n') error(format("unexpected '%c' after rule '%s'", peek(), name.c_str()));
    }
  }
};

}  // namespace gbnf
}  // namespace detail

Result<std::shared_ptr<const Grammar>> Grammar::parse(std::string_view gbnf) {
  return detail::guard([&]() -> std::shared_ptr<const Grammar> {
    using detail::fail;
    using detail::format;
    if (int64_t(gbnf.size()) > limits::max_grammar_bytes)
      fail(ErrorCode::invalid_argument, format("grammar: %zu bytes; at most %lld (KVLITE_MAX_GRAMMAR_BYTES)",
                                               gbnf.size(), (long long)limits::max_grammar_bytes));
    detail::gbnf::Builder b;
    b.src = gbnf;
    b.parse_all();
    auto root_it = b.by_name.find("root");
    if (root_it == b.by_name.end() || !b.defined[size_t(root_it->second)])
      fail(ErrorCode::bad_format, "grammar: no 'root' rule (generation starts from root ::= ...)");
    for (size_t r = 0; r < b.rules.size(); r++)
      if (!b.defined[r]) fail(ErrorCode::bad_format, format("grammar: rule '%s' is used but never defined", b.names[r].c_str()));

    auto g = std::make_shared<Grammar>();
    g->root = root_it->second;
    g->rule_names = b.names;
    g->char_sets = std::move(b.char_sets);
    g->rules.resize(b.rules.size());
    for (size_t r = 0; r < b.rules.size(); r++)
      for (const auto& alt : b.rules[r]) {
        g->rules[r].push_back(int32_t(g->elements.size()));
        g->elements.insert(g->elements.end(), alt.begin(), alt.end());
        g->elements.push_back({Element::end, 0});
      }

    // Left recursion: the recognizer expands rule references until a character is next, so a rule that can
    // reach itself without reading one would expand forever. Nullable rules first (fixed point), then a
    // search over "rule A may start with rule B" edges.
    const size_t n = g->rules.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; r++) {
        if (nullable[r]) continue;
        for (int32_t start : g->rules[r]) {
          bool all = true;
          for (int32_t p = start; g->elements[size_t(p)].kind != Element::end; p++) {
            const Element& e = g->elements[size_t(p)];
            if (e.kind == Element::chars || !nullable[size_t(e.value)]) { all = false; break; }
          }
          if (all) { nullable[r] = true; changed = true; break; }
        }
      }
    }
    std::vector<std::vector<int32_t>> starts(n);
    for (size_t r = 0; r < n; r++)
      for (int32_t start : g->rules[r])
        for (int32_t p = start; g->elements[size_t(p)].kind == Element::rule; p++) {
          const int32_t target = g->elements[size_t(p)].value;
          starts[r].push_back(target);
          if (!nullable[size_t(target)]) break;
        }
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
    for (size_t r0 = 0; r0 < n; r0++) {
      if (color[r0]) continue;
      std::vector<std::pair<int32_t, size_t>> path{{int32_t(r0), 0}};
      color[r0] = 1;
      while (!path.empty()) {
        auto& [rule, next] = path.back();
        if (next < starts[size_t(rule)].size()) {
          const int32_t target = starts[size_t(rule)][next++];
          if (color[size_t(target)] == 1)
            fail(ErrorCode::bad_format,
                 format("grammar: rule '%s' is left-recursive (it can reach itself through '%s' without reading a "
                        "character); write the repetition with * or + instead",
                        g->rule_names[size_t(target)].c_str(), g->rule_names[size_t(rule)].c_str()));
          if (color[size_t(target)] == 0) {
            color[size_t(target)] = 1;
            path.push_back({target, 0});
          }
        } else {
          color[size_t(rule)] = 2;
          path.pop_back();
        }
      }
    }
    // Shortest completions in bytes: each character set's shortest UTF-8 character, each rule's fewest bytes
    // (a fixed point from "never"), then each position's.
    std::vector<int64_t> char_bytes(g->char_sets.size(), 1);
    for (size_t c = 0; c < g->char_sets.size(); c++) {
      const CharSet& set = g->char_sets[c];
      int64_t best = 4;
      for (const auto& probe : {std::pair<uint32_t, int64_t>{0x7F, 1}, {0x7FF, 2}, {0xFFFF, 3}}) {
        const uint32_t lo = probe.second == 1 ? 0 : probe.second == 2 ? 0x80 : 0x800;
        if (set.intersects(lo, probe.first)) { best = probe.second; break; }
      }
      char_bytes[c] = best;
    }
    std::vector<int64_t> rule_min(n, kNever);
    auto alternative_from = [&](int32_t p) {
      int64_t total = 0;
      for (; g->elements[size_t(p)].kind != Element::end; p++) {
        const Element& e = g->elements[size_t(p)];
        total += e.kind == Element::chars ? char_bytes[size_t(e.value)] : rule_min[size_t(e.value)];
        if (total >= kNever) return kNever;
      }
      return total;
    };
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; r++)
        for (int32_t start : g->rules[r]) {
          const int64_t len = alternative_from(start);
          if (len < rule_min[r]) { rule_min[r] = len; changed = true; }
        }
    }
    if (rule_min[size_t(g->root)] >= kNever)
      fail(ErrorCode::bad_format, "grammar: root never ends (every alternative recurses without a way out)");
    g->suffix_min.assign(g->elements.size(), 0);
    for (size_t p = g->elements.size(); p-- > 0;) {
      const Element& e = g->elements[p];
      if (e.kind == Element::end) continue;
      const int64_t own = e.kind == Element::chars ? char_bytes[size_t(e.value)] : rule_min[size_t(e.value)];
      g->suffix_min[p] = std::min(kNever, own + g->suffix_min[p + 1]);
    }
    return g;
  });
}

// ---- JSON schema to GBNF ---------------------------------------------------------------------------------
namespace detail {
namespace schema {

using json = nlohmann::ordered_json;

// A GBNF string literal for these bytes.
inline std::string literal(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    const uint8_t u = uint8_t(c);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (u < 0x20 || u == 0x7F) out += format("\\x%02X", u);
    else out += c;
  }
  return out + "\"";
}

// Alternatives for the decimal integers in [lo, hi] (0 <= lo <= hi), without leading zeros.
inline void digits_between(const std::string& a, const std::string& b, std::vector<std::string>& out,
                           const std::string& prefix) {
  // a and b have the same length, a <= b
  if (a.empty()) { out.push_back(prefix.empty() ? "\"\"" : prefix); return; }
  const std::string sep = prefix.empty() ? "" : " ";
  if (a[0] == b[0]) return digits_between(a.substr(1), b.substr(1), out, prefix + sep + literal(a.substr(0, 1)));
  const size_t rest = a.size() - 1;
  const bool a_low = a.find_first_not_of('0', 1) == std::string::npos;
  const bool b_high = b.find_first_not_of('9', 1) == std::string::npos;
  auto any_digits = [&](size_t n) { return n == 0 ? std::string() : n == 1 ? std::string(" [0-9]") : format(" [0-9]{%zu}", n); };
  if (a_low && b_high) {
    out.push_back(prefix + sep + format("[%c-%c]", a[0], b[0]) + any_digits(rest));
    return;
  }
  char low_first = a[0], high_first = b[0];
  if (!a_low) {
    digits_between(a.substr(1), std::string(rest, '9'), out, prefix + sep + literal(a.substr(0, 1)));
    low_first++;
  }
  if (!b_high) high_first--;
  if (low_first <= high_first) out.push_back(prefix + sep + format("[%c-%c]", low_first, high_first) + any_digits(rest));
  if (!b_high) digits_between(std::string(rest, '0'), b.substr(1), out, prefix + sep + literal(b.substr(0, 1)));
}

inline std::string uint_range(uint64_t lo, uint64_t hi) {
  std::vector<std::string> alternatives;
  while (lo <= hi) {
    const std::string low = std::to_string(lo);
    // the largest number with as many digits as lo
    uint64_t top = 9;
    for (size_t i = 1; i < low.size(); i++) top = top * 10 + 9;
    const uint64_t end = std::min(hi, top);
    digits_between(low, std::to_string(end), alternatives, "");
    if (end == hi) break;
    lo = end + 1;
  }
  std::string out = "(";
  for (size_t i = 0; i < alternatives.size(); i++) out += (i ? " | " : "") + alternatives[i];
  return out + ")";
}

struct Compiler {
  const json& doc;
  std::vector<std::pair<std::string, std::string>> rules;  // in definition order
  std::unordered_map<std::string, std::string> ref_rule;    // "#/$defs/x" -> rule name
  std::unordered_map<std::string, bool> primitives;
  int64_t counter = 0;

  [[noreturn]] void refuse(ErrorCode code, const std::string& where, const std::string& what) const {
    fail(code, format("json_schema at %s: %s", where.empty() ? "the top" : where.c_str(), what.c_str()));
  }
  std::string add(const std::string& base, const std::string& body) {
    std::string name = base + "-" + std::to_string(++counter);
    rules.push_back({name, body});
    return name;
  }
  const char* primitive(const std::string& name) {
    static const std::pair<const char*, const char*> table[] = {
        {"ws", "| \" \""},
        // \uXXXX escapes: no lone surrogate (parsers refuse one), a high one followed by its low one
        {"char", "[^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" ( [0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | "
                 "[dD] [0-7] [0-9a-fA-F]{2} | [dD] [89abAB] [0-9a-fA-F]{2} \"\\\\u\" [dD] [c-fC-F] [0-9a-fA-F]{2} ) )"},
        {"string", "\"\\\"\" char* \"\\\"\""},
        {"integral", "\"0\" | [1-9] [0-9]{0,15}"},
        {"number", "\"-\"? integral ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )?"},
        {"integer", "\"-\"? integral"},
        {"boolean", "\"true\" | \"false\""},
        {"null", "\"null\""},
        {"value", "object | array | string | number | boolean | null"},
        {"object", "\"{\" ws ( string ws \":\" ws value ws ( \",\" ws string ws \":\" ws value ws )* )? \"}\""},
        {"array", "\"[\" ws ( value ws ( \",\" ws value ws )* )? \"]\""},
        {"date", "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [1-2] [0-9] | \"3\" [0-1] )"},
        {"time", "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )"},
        {"uuid", "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{12}"},
        {"email", "[a-zA-Z0-9._%+-]{1,64} \"@\" [a-zA-Z0-9-]{1,63} ( \".\" [a-zA-Z0-9-]{1,63} ){1,4}"},
    };
    static const std::pair<const char*, std::vector<const char*>> needs[] = {
        {"char", {}}, {"string", {"char"}}, {"number", {"integral"}}, {"integer", {"integral"}},
        {"value", {"object", "array", "string", "number", "boolean", "null"}},
        {"object", {"ws", "string", "value"}}, {"array", {"ws", "value"}},
    };
    for (const auto& entry : table)
      if (name == entry.first) {
        if (!primitives[name]) {  // marked before its dependencies: value and object refer to each other
          primitives[name] = true;
          rules.push_back({name, entry.second});
          for (const auto& need : needs)
            if (name == need.first)
              for (const char* dep : need.second) primitive(dep);
        }
        return entry.first;
      }
    fail(ErrorCode::internal, "json_schema: unknown primitive " + name);
  }

  // Keywords that only annotate; any other unknown keyword is refused.
  static bool annotation(const std::string& key) {
    static const char* const names[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                        "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
                                        "name", "contentMediaType", "contentEncoding"};
    for (const char* n : names)
      if (key == n) return true;
    return false;
  }

  std::string resolve_ref(const std::string& ref, const std::string& where) {
    auto found = ref_rule.find(ref);
    if (found != ref_rule.end()) return found->second;
    const json* target = nullptr;
    if (ref == "#") target = &doc;
    else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (ref.compare(0, p.size(), p) == 0) {
          const std::string section = p.substr(2, p.size() - 3);
          const std::string key = ref.substr(p.size());
          if (doc.is_object() && doc.contains(section) && doc[section].is_object() && doc[section].contains(key))
            target = &doc[section][key];
        }
      }
    }
    if (!target) refuse(ErrorCode::unsupported, where, "$ref '" + ref + "' does not name #, #/$defs/<name> or #/definitions/<name> of this schema");
    const std::string name = "ref-" + std::to_string(++counter);
    ref_rule[ref] = name;
    const size_t slot = rules.size();
    rules.push_back({name, ""});
    const std::string body = visit(*target, ref);
    rules[slot].second = body;
    return name;
  }

  std::string string_body(const json& s, const std::string& where) {
    if (s.contains("format") && s.contains("pattern"))
      refuse(ErrorCode::unsupported, where, "both 'format' and 'pattern'");
    if ((s.contains("format") || s.contains("pattern")) && (s.contains("minLength") || s.contains("maxLength")))
      refuse(ErrorCode::unsupported, where, "'minLength' / 'maxLength' beside 'format' or 'pattern' (write the length in the pattern)");
    std::string inner;
    if (s.contains("format")) {
      if (!s["format"].is_string()) refuse(ErrorCode::bad_format, where, "'format' must be a string");
      const std::string f = s["format"];
      if (f == "date") inner = primitive("date");
      else if (f == "time") inner = primitive("time");
      else if (f == "date-time") inner = std::string(primitive("date")) + " \"T\" " + primitive("time");
      else if (f == "uuid") inner = primitive("uuid");
      else if (f == "email") inner = primitive("email");
      else refuse(ErrorCode::unsupported, where, "format '" + f + "'; supported: date, time, date-time, uuid, email");
    } else if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) refuse(ErrorCode::bad_format, where, "'pattern' must be a string");
      inner = regex(s["pattern"].get<std::string>(), where);
    } else {
      int64_t min = 0, max = -1;
      if (s.contains("minLength")) min = bound(s["minLength"], "minLength", where);
      if (s.contains("maxLength")) max = bound(s["maxLength"], "maxLength", where);
      if (max >= 0 && max < min) refuse(ErrorCode::invalid_argument, where, "maxLength < minLength");
      primitive("char");
      if (min == 0 && max < 0) inner = "char*";
      else if (max < 0) inner = format("char{%lld,}", (long long)min);
      else inner = format("char{%lld,%lld}", (long long)min, (long long)max);
    }
    return "\"\\\"\" " + inner + " \"\\\"\"";
  }

  int64_t bound(const json& v, const char* key, const std::string& where) const {
    if (!v.is_number_integer() && !v.is_number_unsigned()) refuse(ErrorCode::bad_format, where, format("'%s' must be an integer", key));
    if (v.is_number_integer() && v.get<int64_t>() < 0) refuse(ErrorCode::bad_format, where, format("'%s' is negative", key));
    const uint64_t value = v.get<uint64_t>();
    if (value > uint64_t(limits::max_grammar_repeat))
      refuse(ErrorCode::unsupported, where, format("'%s' is %llu; at most %lld (KVLITE_MAX_GRAMMAR_REPEAT)", key,
                                                   (unsigned long long)value, (long long)limits::max_grammar_repeat));
    return int64_t(value);
  }

  std::string integer_body(const json& s, const std::string& where) {
    if (s.contains("multipleOf")) refuse(ErrorCode::unsupported, where, "'multipleOf'");
    const bool has_min = s.contains("minimum") || s.contains("exclusiveMinimum");
    const bool has_max = s.contains("maximum") || s.contains("exclusiveMaximum");
    if (!has_min && !has_max) return primitive("integer");
    // the integers a 16-digit integral part can write
    const int64_t limit = 9999999999999999LL;
    auto read = [&](const char* key, bool exclusive, int64_t step) -> std::optional<int64_t> {
      if (!s.contains(key)) return std::nullopt;
      const json& v = s[key];
      if (!v.is_number()) refuse(ErrorCode::bad_format, where, format("'%s' must be a number", key));
      double d = v.get<double>();
      d = step > 0 ? std::ceil(d) : std::floor(d);
      if (exclusive && d == v.get<double>()) d += double(step);
      d = std::max(double(-limit), std::min(double(limit), d));
      return int64_t(d);
    };
    std::optional<int64_t> lo = read("minimum", false, 1), hi = read("maximum", false, -1);
    if (auto x = read("exclusiveMinimum", true, 1)) lo = lo ? std::max(*lo, *x) : *x;
    if (auto x = read("exclusiveMaximum", true, -1)) hi = hi ? std::min(*hi, *x) : *x;
    const int64_t low = lo.value_or(-limit), high = hi.value_or(limit);
    if (low > high) refuse(ErrorCode::invalid_argument, where, format("no integer is in [%lld, %lld]", (long long)low, (long long)high));
    std::vector<std::string> parts;
    if (low < 0) {
      const int64_t neg_hi = -low, neg_lo = high < 0 ? -high : 1;  // "-" then [neg_lo, neg_hi]
      parts.push_back("\"-\" " + uint_range(uint64_t(neg_lo), uint64_t(neg_hi)));
    }
    if (high >= 0) parts.push_back(uint_range(uint64_t(std::max<int64_t>(low, 0)), uint64_t(high)));
    std::string out = "(";
    for (size_t i = 0; i < parts.size(); i++) out += (i ? " | " : "") + parts[i];
    return out + ")";
  }

  std::string object_body(const json& s, const std::string& where) {
    primitive("ws");
    const json empty = json::object();
    const json& props = s.contains("properties") ? s["properties"] : empty;
    if (!props.is_object()) refuse(ErrorCode::bad_format, where, "'properties' must be an object");
    std::vector<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) refuse(ErrorCode::bad_format, where, "'required' must be an array");
      for (const json& r : s["required"]) {
        if (!r.is_string()) refuse(ErrorCode::bad_format, where, "'required' must hold strings");
        if (!props.contains(r.get<std::string>()))
          refuse(ErrorCode::unsupported, where, "required property '" + r.get<std::string>() + "' is not in 'properties'");
        required.push_back(r);
      }
    }
    if (props.empty()) {
      if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
        const std::string value = visit(s["additionalProperties"], where + "/additionalProperties");
        const std::string kv = std::string(primitive("string")) + " ws \":\" ws " + value + " ws";
        return "\"{\" ws ( " + kv + " ( \",\" ws " + kv + " )* )? \"}\"";
      }
      if (s.contains("additionalProperties") && s["additionalProperties"] == false) return "\"{\" ws \"}\"";
      return primitive("object");
    }
    std::vector<std::string> kvs;
    std::vector<bool> needed;
    for (auto it = props.begin(); it != props.end(); ++it) {
      const std::string value = visit(it.value(), where + "/properties/" + it.key());
      kvs.push_back(literal(json(it.key()).dump()) + " ws \":\" ws " + value + " ws");
      needed.push_back(std::find(required.begin(), required.end(), it.key()) != required.end());
    }
    // seq(i, first): properties i.. in order, the required ones always, a comma before each but the first
    std::map<std::pair<size_t, bool>, std::string> made;
    const std::string base = "obj" + std::to_string(++counter);
    std::function<std::string(size_t, bool)> seq = [&](size_t i, bool first) -> std::string {
      if (i == kvs.size()) return "\"\"";
      auto found = made.find({i, first});
      if (found != made.end()) return found->second;
      const std::string kv = first ? kvs[i] : "\",\" ws " + kvs[i];
      std::string body = kv + " " + seq(i + 1, false);
      if (!needed[i]) body = "( " + body + " ) | " + seq(i + 1, first);
      const std::string name = add(base, body);
      made[{i, first}] = name;
      return name;
    };
    return "\"{\" ws " + seq(0, true) + " \"}\"";
  }

  std::string array_body(const json& s, const std::string& where) {
    primitive("ws");
    int64_t min = 0, max = -1;
    if (s.contains("minItems")) min = bound(s["minItems"], "minItems", where);
    if (s.contains("maxItems")) max = bound(s["maxItems"], "maxItems", where);
    if (max >= 0 && max < min) refuse(ErrorCode::invalid_argument, where, "maxItems < minItems");
    if (s.contains("prefixItems")) {
      const json& prefix = s["prefixItems"];
      if (!prefix.is_array() || prefix.empty()) refuse(ErrorCode::bad_format, where, "'prefixItems' must be a non-empty array");
      if (s.contains("items") && s["items"] != false) refuse(ErrorCode::unsupported, where, "'items' beside 'prefixItems' (only items: false)");
      if (s.contains("minItems") || s.contains("maxItems"))
        refuse(ErrorCode::unsupported, where, "'minItems' / 'maxItems' beside 'prefixItems' (the tuple's length is its own)");
      std::string body = "\"[\" ws";
      for (size_t i = 0; i < prefix.size(); i++)
        body += std::string(i ? " \",\" ws " : " ") + visit(prefix[i], where + "/prefixItems/" + std::to_string(i)) + " ws";
      return body + " \"]\"";
    }
    const std::string item = s.contains("items") ? visit(s["items"], where + "/items") : primitive("value");
    if (max == 0) return "\"[\" ws \"]\"";
    const std::string more = max < 0 ? (min <= 1 ? "*" : format("{%lld,}", (long long)(min - 1)))
                                     : format("{%lld,%lld}", (long long)std::max<int64_t>(min - 1, 0), (long long)(max - 1));
    const std::string list = item + " ws ( \",\" ws " + item + " ws )" + more;
    return "\"[\" ws " + (min == 0 ? "( " + list + " )?" : list) + " \"]\"";
  }

  // A JSON-schema regular expression as the content of a JSON string (quote, backslash and control
  // characters are never produced: the output still matches).
  std::string regex(const std::string& pattern, const std::string& where) {
    primitive("char");
    size_t pos = 0;
    const std::string safe_exclusions = "\"\\\\\\x00-\\x1F";
    std::function<std::string()> alternation;
    auto class_escape = [&](char c, std::string& out) -> bool {  // \d \w \s inside or outside a class
      if (c == 'd') out += "0-9";
      else if (c == 'w') out += "a-zA-Z0-9_";
      else if (c == 's') out += " \\t\\n\\r";
      else return false;
      return true;
    };
    auto class_char = [&](uint32_t cp) {
      if (cp == ']' || cp == '\\' || cp == '^' || cp == '-' || cp == '"') return format("\\x%02X", cp);
      if (cp < 0x20) return format("\\x%02X", cp);
      std::string out;
      append_utf8(out, cp);
      return out;
    };
    auto atom = [&]() -> std::string {
      const char c = pattern[pos];
      if (c == '(') {
        pos++;
        if (pattern.compare(pos, 2, "?:") == 0) pos += 2;
        else if (pos < pattern.size() && pattern[pos] == '?') refuse(ErrorCode::unsupported, where, "pattern: look-around and named groups");
        std::string inner = alternation();
        if (pos >= pattern.size() || pattern[pos] != ')') refuse(ErrorCode::bad_format, where, "pattern: ')' missing");
        pos++;
        return "( " + inner + " )";
      }
      if (c == '[') {
        pos++;
        bool negated = false;
        if (pos < pattern.size() && pattern[pos] == '^') { negated = true; pos++; }
        std::vector<std::pair<uint32_t, uint32_t>> ranges;
        auto member = [&]() -> uint32_t {  // one character of the class; \d \w \s add their ranges (returns ~0)
          if (pattern[pos] == '\\' && pos + 1 < pattern.size()) {
            const char e = pattern[pos + 1];
            pos += 2;
            if (e == 'd') { ranges.push_back({'0', '9'}); return ~0u; }
            if (e == 'w') { ranges.insert(ranges.end(), {{'a', 'z'}, {'A', 'Z'}, {'0', '9'}, {'_', '_'}}); return ~0u; }
            if (e == 's') { ranges.insert(ranges.end(), {{' ', ' '}, {'\t', '\n'}, {'\r', '\r'}}); return ~0u; }
            return e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : uint32_t(uint8_t(e));
          }
          return gbnf::next_code_point(pattern, pos);
        };
        bool first = true;
        while (pos < pattern.size() && (pattern[pos] != ']' || first)) {
          first = false;
          const uint32_t lo = member();
          if (lo == ~0u) continue;
          uint32_t hi = lo;
          if (pos + 1 < pattern.size() && pattern[pos] == '-' && pattern[pos + 1] != ']') {
            pos++;
            hi = member();
            if (hi == ~0u || hi < lo) refuse(ErrorCode::bad_format, where, "pattern: bad range in a class");
          }
          ranges.push_back({lo, hi});
        }
        if (pos >= pattern.size()) refuse(ErrorCode::bad_format, where, "pattern: ']' missing");
        pos++;
        // Characters a JSON string cannot hold as themselves (quote, backslash, controls) are never produced.
        const std::pair<uint32_t, uint32_t> unsafe[] = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
        if (negated) ranges.insert(ranges.end(), std::begin(unsafe), std::end(unsafe));
        else {
          for (const auto& cut : unsafe) {
            std::vector<std::pair<uint32_t, uint32_t>> kept;
            for (const auto& r : ranges) {
              if (r.second < cut.first || r.first > cut.second) { kept.push_back(r); continue; }
              if (r.first < cut.first) kept.push_back({r.first, cut.first - 1});
              if (r.second > cut.second) kept.push_back({cut.second + 1, r.second});
            }
            ranges = std::move(kept);
          }
          if (ranges.empty()) refuse(ErrorCode::unsupported, where, "pattern: a class of only quote, backslash or control characters");
        }
        std::string out = negated ? "[^" : "[";
        for (const auto& r : ranges) {
          out += class_char(r.first);
          if (r.second != r.first) out += "-" + class_char(r.second);
        }
        return out + "]";
      }
      if (c == '.') { pos++; return "[^" + safe_exclusions + "\\n]"; }
      if (c == '\\') {
        if (pos + 1 >= pattern.size()) refuse(ErrorCode::bad_format, where, "pattern ends with '\\'");
        const char e = pattern[pos + 1];
        pos += 2;
        std::string members;
        if (class_escape(e, members)) return "[" + members + "]";
        if (e == 'D' || e == 'W' || e == 'S') {
          class_escape(char(e + 32), members);
          return "[^" + members + safe_exclusions + "]";
        }
        if (e == 'n' || e == 't' || e == 'r' || (e >= '0' && e <= '9') || (e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z'))
          refuse(ErrorCode::unsupported, where, format("pattern: escape '\\%c'", e));
        return literal(std::string(1, e) == "\"" || e == '\\' ? std::string("\\") + e : std::string(1, e));
      }
      const size_t begin = pos;
      gbnf::next_code_point(pattern, pos);
      const std::string ch = pattern.substr(begin, pos - begin);
      return literal(ch == "\"" ? "\\\"" : ch);
    };
    auto quantified = [&]() -> std::string {
      std::string a = atom();
      if (pos < pattern.size()) {
        const char q = pattern[pos];
        std::string op;
        if (q == '*' || q == '+' || q == '?') { op = std::string(1, q); pos++; }
        else if (q == '{') {
          const size_t close = pattern.find('}', pos);
          if (close == std::string::npos) refuse(ErrorCode::bad_format, where, "pattern: '}' missing");
          // {m}, {m,} or {m,n} with m <= n, each within the repeat bound (GBNF's own rules, checked here so that
          // the compiled grammar always parses)
          const std::string inside = pattern.substr(pos + 1, close - pos - 1);
          const size_t comma = inside.find(',');
          const std::string low = inside.substr(0, comma), high = comma == std::string::npos ? low : inside.substr(comma + 1);
          auto number = [&](const std::string& digits) -> int64_t {
            if (digits.empty() || digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos)
              refuse(ErrorCode::bad_format, where, "pattern: bad {m,n} '{" + inside + "}'");
            const int64_t value = std::stoll(digits);
            if (value > limits::max_grammar_repeat)
              refuse(ErrorCode::unsupported, where, format("pattern: {%s} past %lld (KVLITE_MAX_GRAMMAR_REPEAT)",
                                                           inside.c_str(), (long long)limits::max_grammar_repeat));
            return value;
          };
          const int64_t m = number(low);
          if (!(comma != std::string::npos && high.empty()) && number(high) < m)
            refuse(ErrorCode::bad_format, where, "pattern: {m,n} with n < m in '{" + inside + "}'");
          op = "{" + inside + "}";
          pos = close + 1;
        }
        if (!op.empty() && pos < pattern.size() && (pattern[pos] == '?' || pattern[pos] == '+')) pos++;  // lazy / possessive
        a = "( " + a + " )" + op;
      }
      return a;
    };
    alternation = [&]() -> std::string {
      std::string out;
      std::string seq;
      while (true) {
        if (pos >= pattern.size() || pattern[pos] == ')' || pattern[pos] == '|') {
          out += (out.empty() ? "" : " | ") + (seq.empty() ? std::string("\"\"") : seq);
          seq.clear();
          if (pos < pattern.size() && pattern[pos] == '|') { pos++; continue; }
          return out;
        }
        if (pattern[pos] == '^' || pattern[pos] == '$') { pos++; continue; }  // anchors handled around the whole
        seq += (seq.empty() ? "" : " ") + quantified();
      }
    };
    const bool anchored_start = !pattern.empty() && pattern[0] == '^';
    const bool anchored_end = !pattern.empty() && pattern.back() == '$' && (pattern.size() < 2 || pattern[pattern.size() - 2] != '\\');
    std::string body = alternation();
    if (pos != pattern.size()) refuse(ErrorCode::bad_format, where, "pattern: unbalanced ')'");
    return std::string(anchored_start ? "" : "char* ") + "( " + body + " )" + (anchored_end ? "" : " char*");
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) out += char(cp);
    else if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); out += char(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) { out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
    else { out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
  }

  std::string type_body(const std::string& type, const json& s, const std::string& where) {
    if (type == "string") return string_body(s, where);
    if (type == "integer") return integer_body(s, where);
    if (type == "number") {
      for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
        if (s.contains(k)) refuse(ErrorCode::unsupported, where, format("'%s' on a number (integer ranges are supported)", k));
      return primitive("number");
    }
    if (type == "boolean") return primitive("boolean");
    if (type == "null") return primitive("null");
    if (type == "object") return object_body(s, where);
    if (type == "array") return array_body(s, where);
    refuse(ErrorCode::bad_format, where, "unknown type '" + type + "'");
  }

  // A GBNF expression for the values `s` allows (no surrounding whitespace).
  std::string visit(const json& s, const std::string& where) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return primitive("value");
      refuse(ErrorCode::unsupported, where, "the schema false allows nothing");
    }
    if (!s.is_object()) refuse(ErrorCode::bad_format, where, "a schema must be an object or a boolean");
    static const char* const known[] = {"type", "properties", "required", "additionalProperties", "enum", "const",
                                        "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
                                        "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                                        "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref", "multipleOf"};
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (annotation(it.key())) continue;
      if (std::find_if(std::begin(known), std::end(known), [&](const char* k) { return it.key() == k; }) == std::end(known))
        refuse(ErrorCode::unsupported, where, "keyword '" + it.key() + "' is not supported (it would be ignored, so the output could break it)");
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) refuse(ErrorCode::bad_format, where, "'$ref' must be a string");
      return resolve_ref(s["$ref"], where);
    }
    if (s.contains("const")) return literal(s["const"].dump());
    if (s.contains("enum")) {
      const json& values = s["enum"];
      if (!values.is_array() || values.empty()) refuse(ErrorCode::bad_format, where, "'enum' must be a non-empty array");
      std::string out = "(";
      for (size_t i = 0; i < values.size(); i++) out += (i ? " | " : " ") + literal(values[i].dump());
      return out + " )";
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        const json& options = s[key];
        if (!options.is_array() || options.empty()) refuse(ErrorCode::bad_format, where, format("'%s' must be a non-empty array", key));
        std::string out = "(";
        for (size_t i = 0; i < options.size(); i++) {
          // sibling keywords apply to every option (a common "type" beside anyOf)
          json merged = options[i];
          if (merged.is_object())
            for (auto it = s.begin(); it != s.end(); ++it)
              if (it.key() != key && !merged.contains(it.key()) && !annotation(it.key())) merged[it.key()] = it.value();
          out += (i ? " | " : " ") + visit(merged, where + "/" + key + "/" + std::to_string(i));
        }
        return out + " )";
      }
    if (s.contains("allOf")) {
      const json& all = s["allOf"];
      if (!all.is_array() || all.size() != 1) refuse(ErrorCode::unsupported, where, "'allOf' of more than one schema");
      return visit(all[0], where + "/allOf/0");
    }
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) return type_body(t, s, where);
      if (!t.is_array() || t.empty()) refuse(ErrorCode::bad_format, where, "'type' must be a string or a non-empty array");
      std::string out = "(";
      for (size_t i = 0; i < t.size(); i++) {
        if (!t[i].is_string()) refuse(ErrorCode::bad_format, where, "'type' must hold strings");
        out += (i ? " | " : " ") + type_body(t[i], s, where);
      }
      return out + " )";
    }
    // no type: infer one from the keywords, else any value
    if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) return object_body(s, where);
    if (s.contains("items") || s.contains("prefixItems")) return array_body(s, where);
    if (s.contains("pattern") || s.contains("format") || s.contains("minLength") || s.contains("maxLength")) return string_body(s, where);
    return primitive("value");
  }
};

}  // namespace schema
}  // namespace detail

Result<std::string> Grammar::json_schema_to_gbnf(std::string_view schema_json) {
  return detail::guard([&]() -> std::string {
    using detail::fail;
    using detail::format;
    if (int64_t(schema_json.size()) > limits::max_schema_bytes)
      fail(ErrorCode::invalid_argument, format("json_schema: %zu bytes; at most %lld (KVLITE_MAX_SCHEMA_BYTES)",
                                               schema_json.size(), (long long)limits::max_schema_bytes));
    detail::check_json_nesting(schema_json, "json_schema");
    nlohmann::ordered_json doc;  // properties keep their order: the output's order
    try {
      doc = nlohmann::ordered_json::parse(schema_json);
    } catch (const nlohmann::json::exception& e) {
      fail(ErrorCode::bad_format, format("json_schema is not valid JSON: %s", e.what()));
    }
    detail::schema::Compiler compiler{doc, {}, {}, {}, 0};
    const std::string root = compiler.visit(doc, "");
    std::string out = "root ::= " + root + "\n";
    for (const auto& rule : compiler.rules) out += rule.first + " ::= " + rule.second + "\n";
    return out;
  });
}

// ---- tool calls ----------------------------------------------------------------------------------------------
const char* tool_call_syntax_name(ToolCallSyntax syntax) {
  return syntax == ToolCallSyntax::llama3_json ? "llama3_json" : "hermes";
}

ToolCallSyntax tool_call_syntax_of(std::string_view chat_template) {
  // Llama-3.1/3.2's templates ask for {"name": ..., "parameters": ...}; Qwen's and Hermes' write <tool_call>
  if (chat_template.find("<tool_call>") == std::string_view::npos &&
      chat_template.find("\"parameters\": dictionary of argument name") != std::string_view::npos)
    return ToolCallSyntax::llama3_json;
  return ToolCallSyntax::hermes;
}

Result<std::string> tool_calls_gbnf(std::string_view tools_json, ToolCallSyntax syntax, const std::string& only,
                                    bool parallel) {
  return detail::guard([&]() -> std::string {
    using detail::fail;
    using detail::format;
    using ojson = nlohmann::ordered_json;
    if (int64_t(tools_json.size()) > limits::max_schema_bytes)
      fail(ErrorCode::invalid_argument, format("tools: %zu bytes; at most %lld (KVLITE_MAX_SCHEMA_BYTES)",
                                               tools_json.size(), (long long)limits::max_schema_bytes));
    detail::check_json_nesting(tools_json, "tools");
    ojson tools;
    try {
      tools = ojson::parse(tools_json);
    } catch (const nlohmann::json::exception& e) {
      fail(ErrorCode::bad_format, format("tools is not valid JSON: %s", e.what()));
    }
    if (!tools.is_array() || tools.empty()) fail(ErrorCode::invalid_argument, "tools must be a non-empty array");
    if (tools.size() > KVLITE_MAX_TOOLS)
      fail(ErrorCode::invalid_argument, format("%zu tools; at most %d (KVLITE_MAX_TOOLS)", tools.size(), KVLITE_MAX_TOOLS));
    std::vector<std::pair<std::string, std::string>> rules;  // merged: primitives once, each tool's own rules
    std::vector<std::string> calls;
    int64_t counter = 0;
    for (size_t i = 0; i < tools.size(); i++) {
      const ojson& tool = tools[i];
      const std::string where = format("tools[%zu]", i);
      if (!tool.is_object() || tool.value("type", "") != "function" || !tool.contains("function") || !tool["function"].is_object())
        fail(ErrorCode::invalid_argument, where + " must be {\"type\": \"function\", \"function\": {...}}");
      const ojson& function = tool["function"];
      if (!function.contains("name") || !function["name"].is_string())
        fail(ErrorCode::invalid_argument, where + ".function.name must be a string");
      const std::string name = function["name"];
      if (name.empty() || name.size() > 64 ||
          name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != std::string::npos)
        fail(ErrorCode::invalid_argument, where + ".function.name '" + name + "' must be 1-64 of [A-Za-z0-9_.-]");
      if (!only.empty() && name != only) continue;
      const ojson parameters = function.contains("parameters") && !function["parameters"].is_null()
                                   ? function["parameters"] : ojson{{"type", "object"}};
      detail::schema::Compiler compiler{parameters, {}, {}, {}, counter};
      const std::string arguments = compiler.visit(parameters, where + ".function.parameters");
      counter = compiler.counter;
      for (auto& rule : compiler.rules)
        if (std::find_if(rules.begin(), rules.end(), [&](const auto& r) { return r.first == rule.first; }) == rules.end())
          rules.push_back(std::move(rule));
      const std::string name_literal = detail::schema::literal(ojson(name).dump());
      if (syntax == ToolCallSyntax::llama3_json)
        calls.push_back("\"{\\\"name\\\": \" " + name_literal + " \", \\\"parameters\\\": \" " + arguments + " \"}\"");
      else
        calls.push_back("\"<tool_call>\\n{\\\"name\\\": \" " + name_literal + " \", \\\"arguments\\\": \" " + arguments +
                        " \"}\\n</tool_call>\"");
    }
    if (calls.empty()) fail(ErrorCode::invalid_argument, "tool_choice names '" + only + "', which is not in tools");
    std::string out = "root ::= call";
    if (parallel && syntax == ToolCallSyntax::hermes) out += " ( \"\\n\" call )*";
    out += "\ncall ::= ";
    for (size_t i = 0; i < calls.size(); i++) out += (i ? " | " : "") + calls[i];
    out += "\n";
    for (const auto& rule : rules) out += rule.first + " ::= " + rule.second + "\n";
    return out;
  });
}

ParsedToolCalls parse_tool_calls(const std::string& text, ToolCallSyntax syntax) {
  ParsedToolCalls out;
  auto trim = [](std::string s) {
    const size_t begin = s.find_first_not_of(" \t\r\n");
    if (begin == std::string::npos) return std::string();
    const size_t end = s.find_last_not_of(" \t\r\n");
    return s.substr(begin, end - begin + 1);
  };
  // a call's JSON: {"name": "...", "arguments" | "parameters": {...}}; false when it is not one
  auto read_call = [&](const std::string& json_text, ToolCall& call) {
    if (int64_t(json_text.size()) > limits::max_json_bytes) return false;
    if (!detail::guard([&] { detail::check_json_nesting(json_text, "a tool call"); })) return false;
    nlohmann::ordered_json value = nlohmann::ordered_json::parse(json_text, nullptr, false);
    if (value.is_discarded() || !value.is_object() || !value.contains("name") || !value["name"].is_string()) return false;
    const char* key = value.contains("arguments") ? "arguments" : value.contains("parameters") ? "parameters" : nullptr;
    if (!key || !value[key].is_object()) return false;
    call.name = value["name"];
    call.arguments = value[key].dump();
    return true;
  };
  if (syntax == ToolCallSyntax::llama3_json) {
    ToolCall call;
    std::string body = trim(text);
    if (body.rfind("<|python_tag|>", 0) == 0) body = trim(body.substr(14));
    if (!body.empty() && body[0] == '{' && read_call(body, call)) out.calls.push_back(std::move(call));
    else out.content = trim(text);
    return out;
  }
  std::string content;
  size_t at = 0;
  const std::string open = "<tool_call>", close = "</tool_call>";
  while (at < text.size()) {
    const size_t begin = text.find(open, at);
    if (begin == std::string::npos) break;
    const size_t end = text.find(close, begin + open.size());
    if (end == std::string::npos) break;
    ToolCall call;
    if (read_call(trim(text.substr(begin + open.size(), end - begin - open.size())), call)) {
      content += text.substr(at, begin - at);
      out.calls.push_back(std::move(call));
    } else {
      content += text.substr(at, end + close.size() - at);
    }
    at = end + close.size();
  }
  content += text.substr(std::min(at, text.size()));
  out.content = trim(content);
  return out;
}

std::string Grammar::json_object_gbnf() {
  return Grammar::json_schema_to_gbnf(R"({"type": "object"})").value();
}

// ---- the recognizer ----------------------------------------------------------------------------------------
namespace detail {
namespace gbnf {

// Where expand writes stacks: the first `count` entries of `out`, whose vectors (and their capacity) are reused
// from one step to the next, so that the vocabulary walk allocates little once warm.
struct StackSink {
  std::vector<std::vector<int32_t>>& out;
  size_t count = 0;
  bool put(const std::vector<int32_t>& stack) {
    if (count < out.size()) out[count].assign(stack.begin(), stack.end());
    else out.push_back(stack);
    count++;
    return int64_t(count) <= limits::max_grammar_stacks * 4;
  }
  void finish() { out.resize(count); }
};

// Expands `stack` until its top is a character set (or it is empty: the sentence may end), adding each
// result to `out`. False when a bound is passed.
inline bool expand(const Grammar& g, std::vector<int32_t>& stack, StackSink& out) {
  if (int64_t(stack.size()) > limits::max_grammar_depth) return false;
  if (stack.empty()) return out.put(stack);
  const int32_t top = stack.back();
  const Grammar::Element& e = g.elements[size_t(top)];
  if (e.kind == Grammar::Element::chars) return out.put(stack);
  if (e.kind == Grammar::Element::end) {  // not pushed by the code below; kept total
    stack.pop_back();
    const bool ok = expand(g, stack, out);
    stack.push_back(top);
    return ok;
  }
  // a rule reference: continue after it (unless the alternative ends there: a tail call), then each alternative
  stack.pop_back();
  const bool tail = g.elements[size_t(top) + 1].kind == Grammar::Element::end;
  if (!tail) stack.push_back(top + 1);
  bool ok = true;
  for (int32_t start : g.rules[size_t(e.value)]) {
    const bool empty = g.elements[size_t(start)].kind == Grammar::Element::end;
    if (!empty) stack.push_back(start);
    ok = expand(g, stack, out) && ok;
    if (!empty) stack.pop_back();
    if (!ok) break;
  }
  if (!tail) stack.pop_back();
  stack.push_back(top);
  return ok;
}

inline bool normalize(std::vector<std::vector<int32_t>>& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  return int64_t(stacks.size()) <= limits::max_grammar_stacks;
}

// Stacks after reading code point cp.
inline bool step(const Grammar& g, const std::vector<std::vector<int32_t>>& in, uint32_t cp,
                 std::vector<std::vector<int32_t>>& out) {
  StackSink sink{out, 0};
  thread_local std::vector<int32_t> moved;
  bool ok = true;
  for (const auto& stack : in) {
    if (stack.empty()) continue;
    const Grammar::Element& e = g.elements[size_t(stack.back())];
    if (e.kind != Grammar::Element::chars || !g.char_sets[size_t(e.value)].contains(cp)) continue;
    moved.assign(stack.begin(), stack.end() - 1);
    const int32_t next = stack.back() + 1;
    if (g.elements[size_t(next)].kind != Grammar::Element::end) moved.push_back(next);
    if (!expand(g, moved, sink)) {
      ok = false;
      break;
    }
  }
  sink.finish();
  return ok && normalize(out);
}

// Length of a UTF-8 character from its lead byte (0: not a lead byte).
inline int utf8_length(uint8_t lead) {
  return lead < 0x80 ? 1 : lead >= 0xC2 && lead <= 0xDF ? 2 : lead >= 0xE0 && lead <= 0xEF ? 3 : lead >= 0xF0 && lead <= 0xF4 ? 4 : 0;
}

// The code points a character starting with these bytes may be: [lo, hi].
inline void partial_range(const uint8_t* bytes, int have, int need, uint32_t& lo, uint32_t& hi) {
  const uint8_t lead = bytes[0];
  uint32_t prefix = need == 2 ? (lead & 0x1F) : need == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (int i = 1; i < have; i++) prefix = (prefix << 6) | (bytes[i] & 0x3F);
  const int missing = need - have;
  lo = prefix << (6 * missing);
  hi = lo | ((1u << (6 * missing)) - 1);
  const uint32_t min_for_length = need == 2 ? 0x80 : need == 3 ? 0x800 : 0x10000;
  lo = std::max(lo, min_for_length);
  hi = std::min<uint32_t>(hi, 0x10FFFF);
}

inline bool partial_possible(const Grammar& g, const GrammarState& s) {
  uint32_t lo = 0, hi = 0;
  partial_range(s.partial, s.partial_len, s.partial_need, lo, hi);
  if (lo > hi) return false;
  // the code points it may still become, surrogates (U+D800..DFFF, not characters) left out
  std::pair<uint32_t, uint32_t> parts[2] = {{lo, std::min<uint32_t>(hi, 0xD7FF)}, {std::max<uint32_t>(lo, 0xE000), hi}};
  for (const auto& stack : s.stacks) {
    if (stack.empty()) continue;
    const Grammar::Element& e = g.elements[size_t(stack.back())];
    if (e.kind != Grammar::Element::chars) continue;
    for (const auto& part : parts)
      if (part.first <= part.second && g.char_sets[size_t(e.value)].intersects(part.first, part.second)) return true;
  }
  return false;
}

// Reads one byte on: to = from + byte. Returns false when the byte cannot follow.
inline bool step_byte(const Grammar& g, const GrammarState& from, uint8_t byte, GrammarState& to) {
  if (from.partial_len == 0) {
    const int length = utf8_length(byte);
    if (length == 0) return false;
    if (length == 1) {
      to.partial_len = to.partial_need = 0;
      return step(g, from.stacks, byte, to.stacks) && !to.stacks.empty();
    }
    to.stacks = from.stacks;
    to.partial[0] = byte;
    to.partial_len = 1;
    to.partial_need = uint8_t(length);
    return partial_possible(g, to);
  }
  if ((byte & 0xC0) != 0x80) return false;
  uint8_t bytes[4];
  std::memcpy(bytes, from.partial, 4);
  bytes[from.partial_len] = byte;
  const int have = from.partial_len + 1;
  if (have < from.partial_need) {
    to.stacks = from.stacks;
    std::memcpy(to.partial, bytes, 4);
    to.partial_len = uint8_t(have);
    to.partial_need = from.partial_need;
    return partial_possible(g, to);
  }
  uint32_t lo = 0, hi = 0;
  partial_range(bytes, have, have, lo, hi);
  if (lo > hi || (lo >= 0xD800 && lo <= 0xDFFF)) return false;  // overlong, past U+10FFFF, or a surrogate
  to.partial_len = to.partial_need = 0;
  return step(g, from.stacks, lo, to.stacks) && !to.stacks.empty();
}

// A key that identifies a state (for the mask cache).
inline std::string state_key(const GrammarState& s) {
  std::string key;
  key.push_back(char(s.partial_len));
  key.append(reinterpret_cast<const char*>(s.partial), s.partial_len);
  for (const auto& stack : s.stacks) {
    const uint32_t size = uint32_t(stack.size());
    key.append(reinterpret_cast<const char*>(&size), sizeof size);
    key.append(reinterpret_cast<const char*>(stack.data()), stack.size() * sizeof(int32_t));
  }
  return key;
}

}  // namespace gbnf
}  // namespace detail

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  detail::gbnf::StackSink sink{state_.stacks, 0};
  for (int32_t alt : grammar_->rules[size_t(grammar_->root)]) {
    std::vector<int32_t> stack;
    if (grammar_->elements[size_t(alt)].kind != Grammar::Element::end) stack.push_back(alt);
    if (!detail::gbnf::expand(*grammar_, stack, sink)) break;  // (a start past the bounds: what was expanded)
  }
  sink.finish();
  detail::gbnf::normalize(state_.stacks);
}

bool GrammarMatcher::advance(const Grammar& grammar, const GrammarState& from, std::string_view bytes,
                             GrammarState& to) {
  GrammarState a = from, b;
  for (char c : bytes) {
    if (!detail::gbnf::step_byte(grammar, a, uint8_t(c), b)) return false;
    std::swap(a, b);
  }
  to = std::move(a);
  return true;
}

bool GrammarMatcher::accept(std::string_view bytes) {
  GrammarState next;
  if (!advance(*grammar_, state_, bytes, next)) return false;
  state_ = std::move(next);
  return true;
}

int64_t GrammarMatcher::min_completion(const Grammar& grammar, const GrammarState& state) {
  int64_t best = Grammar::kNever;
  uint32_t lo = 0, hi = 0;
  if (state.partial_len) detail::gbnf::partial_range(state.partial, state.partial_len, state.partial_need, lo, hi);
  for (const auto& stack : state.stacks) {
    if (state.partial_len) {
      // only a stack whose next character can be the one begun goes on
      if (stack.empty()) continue;
      const Grammar::Element& e = grammar.elements[size_t(stack.back())];
      if (e.kind != Grammar::Element::chars || !grammar.char_sets[size_t(e.value)].intersects(lo, hi)) continue;
    }
    int64_t total = 0;
    for (int32_t p : stack) total = std::min(Grammar::kNever, total + grammar.suffix_min[size_t(p)]);
    if (state.partial_len) {
      // the character begun: its remaining bytes instead of the top element's shortest character
      const int32_t top = stack.back();
      total += int64_t(state.partial_need - state.partial_len) - (grammar.suffix_min[size_t(top)] - grammar.suffix_min[size_t(top) + 1]);
    }
    best = std::min(best, total);
  }
  return best;
}

bool GrammarMatcher::complete() const {
  if (state_.partial_len) return false;
  for (const auto& stack : state_.stacks)
    if (stack.empty()) return true;
  return false;
}

bool GrammarMatcher::can_continue() const {
  for (const auto& stack : state_.stacks)
    if (!stack.empty()) return true;
  return false;
}

// ---- the vocabulary and its masks --------------------------------------------------------------------------
GrammarVocabulary::GrammarVocabulary(const std::vector<std::string>& token_bytes, const std::vector<uint8_t>& excluded)
    : vocab_(int64_t(token_bytes.size())) {
  std::vector<int32_t> ids;
  for (size_t id = 0; id < token_bytes.size(); id++)
    if (!token_bytes[id].empty() && !(id < excluded.size() && excluded[id])) ids.push_back(int32_t(id));
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return token_bytes[size_t(a)] < token_bytes[size_t(b)] || (token_bytes[size_t(a)] == token_bytes[size_t(b)] && a < b);
  });
  // Sorted strings make the trie in preorder: each string shares its longest common prefix with the path
  // open so far; deeper nodes of the path are closed (their subtree ends where the next node starts).
  std::vector<int32_t> path;  // node index per depth - 1
  std::string previous;
  for (int32_t id : ids) {
    const std::string& bytes = token_bytes[size_t(id)];
    size_t common = 0;
    while (common < previous.size() && common < bytes.size() && previous[common] == bytes[common]) common++;
    while (path.size() > common) {
      nodes[size_t(path.back())].subtree_end = int32_t(nodes.size());
      path.pop_back();
    }
    for (size_t d = common; d < bytes.size(); d++) {
      Node node;
      node.byte = uint8_t(bytes[d]);
      node.depth = int32_t(d + 1);
      node.tokens_begin = node.tokens_end = int32_t(token_ids.size());
      path.push_back(int32_t(nodes.size()));
      nodes.push_back(node);
    }
    Node& end = nodes[size_t(path.back())];
    if (end.tokens_end != int32_t(token_ids.size())) end.tokens_begin = int32_t(token_ids.size());  // first id here
    token_ids.push_back(id);
    end.tokens_end = int32_t(token_ids.size());
    previous = bytes;
  }
  while (!path.empty()) {
    nodes[size_t(path.back())].subtree_end = int32_t(nodes.size());
    path.pop_back();
  }
}

GrammarMasker::GrammarMasker(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {}

int64_t GrammarMasker::compute(const GrammarState& state, int64_t budget, TokenMask& mask, Entry* entry,
                               std::vector<uint16_t>* after_out) {
  const GrammarVocabulary& v = *vocabulary_;
  int64_t most_after = 0;
  const int64_t heavy_above = entry ? entry->shortest + kHeavyMargin : Grammar::kNever;
  mask.assign(size_t((v.size() + 63) / 64), 0);
  // states[d]: after the first d bytes of the node path being visited (states[0] = `state`)
  std::vector<GrammarState> states(1, state);
  const auto& nodes = v.nodes;
  size_t i = 0;
  while (i < nodes.size()) {
    const GrammarVocabulary::Node& node = nodes[i];
    const size_t depth = size_t(node.depth);
    if (states.size() <= depth) states.resize(depth + 1);
    if (!detail::gbnf::step_byte(*grammar_, states[depth - 1], node.byte, states[depth])) {
      i = size_t(node.subtree_end);  // no token under this prefix can be read
      continue;
    }
    if (node.tokens_begin < node.tokens_end) {
      const int64_t after = GrammarMatcher::min_completion(*grammar_, states[depth]);
      most_after = std::max(most_after, after);
      if (after_out) {
        const uint16_t kept = uint16_t(std::min<int64_t>(after, kAfterUnknown));
        for (int32_t t = node.tokens_begin; t < node.tokens_end; t++) (*after_out)[size_t(v.token_ids[size_t(t)])] = kept;
      }
      if (after > heavy_above && entry->heavy_listed) {
        for (int32_t t = node.tokens_begin; t < node.tokens_end; t++) entry->heavy.push_back({after, v.token_ids[size_t(t)]});
        if (entry->heavy.size() > kMaxHeavy) {
          entry->heavy_listed = false;
          entry->heavy.clear();
        }
      }
      if (budget < 0 || after <= budget)
        for (int32_t t = node.tokens_begin; t < node.tokens_end; t++) {
          const int32_t id = v.token_ids[size_t(t)];
          mask[size_t(id) / 64] |= uint64_t(1) << (id % 64);
        }
    }
    i++;
  }
  return most_after;
}

void GrammarMasker::mask_within(const GrammarState& state, int64_t budget, TokenMask& out) {
  computed_++;
  compute(state, std::max<int64_t>(budget, 0), out);
}

const TokenMask& GrammarMasker::mask_for_budget(const GrammarState& state, int64_t budget, TokenMask& scratch) {
  Entry& e = entry(state);
  if (budget < 0 || e.most_after <= budget) return e.mask;
  if (e.heavy_listed && budget >= e.shortest + kHeavyMargin) {
    // every token not listed leaves at most shortest + margin <= budget: drop the listed ones over it
    scratch = e.mask;
    for (const auto& h : e.heavy)
      if (h.first > budget) scratch[size_t(h.second) / 64] &= ~(uint64_t(1) << (h.second % 64));
    return scratch;
  }
  if (e.after.empty()) {
    size_t holding = 0;
    for (const auto& other : cache_) holding += !other.second.after.empty();
    if (holding >= kMaxAfterEntries || budget >= kAfterUnknown) {  // memory's bound, or past what 16 bits hold
      mask_within(state, budget, scratch);
      return scratch;
    }
    computed_++;
    e.after.assign(size_t(vocabulary_->size()), kAfterUnknown);
    TokenMask unused;
    const std::vector<std::pair<int64_t, int32_t>> heavy = std::move(e.heavy);
    compute(state, -1, unused, &e, &e.after);
    e.heavy = heavy;  // (the walk listed them again)
  }
  if (budget >= kAfterUnknown) {
    mask_within(state, budget, scratch);
    return scratch;
  }
  // the tokens of the mask that leave at most `budget` bytes to complete
  scratch = e.mask;
  for (size_t word = 0; word < scratch.size(); word++) {
    const uint64_t bits = scratch[word];
    if (!bits) continue;
    for (int bit = 0; bit < 64; bit++)
      if ((bits >> bit) & 1u && int64_t(e.after[word * 64 + size_t(bit)]) > budget) scratch[word] &= ~(uint64_t(1) << bit);
  }
  return scratch;
}

const TokenMask& GrammarMasker::mask(const GrammarState& state, int64_t* most_after) {
  Entry& e = entry(state);
  if (most_after) *most_after = e.most_after;
  return e.mask;
}

GrammarMasker::Entry& GrammarMasker::entry(const GrammarState& state) {
  const std::string key = detail::gbnf::state_key(state);
  clock_++;
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    reused_++;
    it->second.last_use = clock_;
    return it->second;
  }
  if (int64_t(cache_.size()) >= limits::max_grammar_masks) {
    // drop the least recently used half
    std::vector<int64_t> uses;
    for (const auto& entry : cache_) uses.push_back(entry.second.last_use);
    std::nth_element(uses.begin(), uses.begin() + std::ptrdiff_t(uses.size() / 2), uses.end());
    const int64_t cut = uses[uses.size() / 2];
    for (auto e = cache_.begin(); e != cache_.end();) e = e->second.last_use < cut ? cache_.erase(e) : std::next(e);
  }
  computed_++;
  Entry& slot = cache_[key];
  slot.last_use = clock_;
  slot.shortest = GrammarMatcher::min_completion(*grammar_, state);
  slot.most_after = compute(state, -1, slot.mask, &slot);
  return slot;
}

}  // namespace kvlite
