// jinja: lexer, parser and evaluator of the Jinja2 subset chat templates use (see jinja.hpp). The reference is
// jinja2 3.1 as transformers configures it; tests/unit-chat-template.cpp checks every construct against it.
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <nlohmann/json.hpp>

namespace kvlite {
namespace detail {
namespace jinja {

// ---- values -----------------------------------------------------------------------------------------------
// Python's values as templates see them: dicts keep insertion order; strings are UTF-8 indexed by code point.
struct Value;
struct Callable;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

struct Value {
  enum class Kind : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, ns, callable };
  Kind kind = Kind::undefined;
  bool is_tuple = false;  // a list written (a, b): printed with parentheses
  bool b = false;
  uint16_t depth = 0;  // nesting of lists/dicts inside, bounded so that printing and freeing cannot overflow the stack
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;  // dict (never changed once built) or namespace (changed by `set ns.x = ...`)
  std::shared_ptr<const Callable> fn;
  std::shared_ptr<const std::string> hint;  // undefined: what it stands for ("'x' is undefined")

  static Value undefined(std::string why) {
    Value v;
    v.hint = std::make_shared<const std::string>(std::move(why));
    return v;
  }
  static Value none() { Value v; v.kind = Kind::none; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::boolean; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::integer; v.i = x; return v; }
  static Value floating(double x) { Value v; v.kind = Kind::floating; v.f = x; return v; }
  static Value string(std::string x) {
    Value v;
    v.kind = Kind::string;
    v.s = std::make_shared<const std::string>(std::move(x));
    return v;
  }
  static Value make_list(List items, bool tuple = false);
  static Value make_dict(Dict items, Kind kind = Kind::dict);
  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_number() const { return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean; }
  const std::string& str() const { return *s; }
};

struct Interp;
struct Call {
  std::vector<Value> args;
  Kwargs kwargs;
  int line = 0;
};
struct Callable {
  std::string name;
  std::function<Value(Interp&, Call&)> run;
};

[[noreturn]] void render_error(int line, const std::string& message) {
  fail(ErrorCode::invalid_argument, format("chat template line %d: %s", line, message.c_str()));
}

Value Value::make_list(List items, bool tuple) {
  Value v;
  v.kind = Kind::list;
  v.is_tuple = tuple;
  for (const Value& item : items) v.depth = std::max<uint16_t>(v.depth, uint16_t(item.depth + 1));
  if (v.depth > limits::max_json_depth)
    fail(ErrorCode::invalid_argument, format("chat template: a value nests lists and dicts more than %lld deep "
                                             "(KVLITE_MAX_JSON_DEPTH)", (long long)limits::max_json_depth));
  v.list = std::make_shared<const List>(std::move(items));
  return v;
}
Value Value::make_dict(Dict items, Kind kind) {
  Value v;
  v.kind = kind;
  for (const auto& item : items) v.depth = std::max<uint16_t>(v.depth, uint16_t(item.second.depth + 1));
  if (v.depth > limits::max_json_depth)
    fail(ErrorCode::invalid_argument, format("chat template: a value nests lists and dicts more than %lld deep "
                                             "(KVLITE_MAX_JSON_DEPTH)", (long long)limits::max_json_depth));
  v.dict = std::make_shared<Dict>(std::move(items));
  return v;
}

const Value* dict_find(const Dict& dict, const std::string& key) {
  for (const auto& entry : dict)
    if (entry.first == key) return &entry.second;
  return nullptr;
}

// ---- UTF-8 and Python string helpers ----------------------------------------------------------------------
// Code points of valid UTF-8 (input is validated before rendering; template literals are validated when parsed).
std::vector<uint32_t> code_points(const std::string& text) {
  std::vector<uint32_t> out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n && i + size_t(k) < text.size(); k++) cp = (cp << 6) | (static_cast<unsigned char>(text[i + size_t(k)]) & 0x3F);
    out.push_back(cp);
    i += size_t(n);
  }
  return out;
}
void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F)), out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}
std::string from_code_points(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; i++) append_utf8(out, cps[i]);
  return out;
}
// The offset of the first byte that does not begin valid UTF-8 (no overlongs, surrogates or code points past
// U+10FFFF), or npos.
size_t utf8_invalid_at(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    size_t n = c < 0x80 ? 1 : (c >= 0xC2 && c < 0xE0) ? 2 : (c >= 0xE0 && c < 0xF0) ? 3 : (c >= 0xF0 && c < 0xF5) ? 4 : 0;
    if (n == 0 || i + n > text.size()) return i;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < n; k++) {
      unsigned char d = static_cast<unsigned char>(text[i + k]);
      if ((d & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return i;
    i += n;
  }
  return std::string_view::npos;
}
size_t utf8_length(const std::string& text) {
  size_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}
// Python's str.isspace().
bool py_space(uint32_t cp) {
  return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
// str.strip/lstrip/rstrip: whitespace, or any of `chars` when given.
std::string py_strip(const std::string& text, const Value* chars, bool left, bool right) {
  std::vector<uint32_t> cps = code_points(text);
  std::vector<uint32_t> set;
  bool use_set = chars && chars->kind == Value::Kind::string;
  if (use_set) set = code_points(chars->str());
  auto strip = [&](uint32_t cp) { return use_set ? std::find(set.begin(), set.end(), cp) != set.end() : py_space(cp); };
  size_t begin = 0, end = cps.size();
  if (left) while (begin < end && strip(cps[begin])) begin++;
  if (right) while (end > begin && strip(cps[end - 1])) end--;
  return from_code_points(cps, begin, end);
}
// ASCII case mapping (Python maps all of Unicode; templates change the case of ASCII role names and keywords).
std::string ascii_upper(std::string s) { for (char& c : s) if (c >= 'a' && c <= 'z') c = char(c - 32); return s; }
std::string ascii_lower(std::string s) { for (char& c : s) if (c >= 'A' && c <= 'Z') c = char(c + 32); return s; }
bool ascii_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool ascii_alnum(char c) { return ascii_alpha(c) || (c >= '0' && c <= '9'); }

// Python's repr() of a float: the shortest digits that read back the same; exponent form outside [1e-4, 1e16).
std::string py_float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[40];
  int precision = 1;
  for (; precision <= 17; precision++) {
    snprintf(buf, sizeof buf, "%.*e", precision - 1, x);
    if (strtod(buf, nullptr) == x) break;
  }
  // buf: [-]d.ddde[+-]XX
  std::string text(buf);
  bool negative = text[0] == '-';
  if (negative) text.erase(0, 1);
  size_t e = text.find('e');
  int exponent = atoi(text.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; i++)
    if (text[i] != '.') digits += text[i];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exponent >= -5 + 1 && exponent < 16) {  // Python: -4 <= exponent < 16
    if (exponent >= 0) {
      if (digits.size() <= size_t(exponent) + 1) {
        out = digits + std::string(size_t(exponent) + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, size_t(exponent) + 1) + "." + digits.substr(size_t(exponent) + 1);
      }
    } else {
      out = "0." + std::string(size_t(-exponent - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp_text[16];
    snprintf(exp_text, sizeof exp_text, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp_text;
  }
  return negative ? "-" + out : out;
}

// Python's repr() of a str.
std::string py_str_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == quote) out += '\\', out += char(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) out += format("\\x%02x", c);
    else out += char(c);
  }
  return out + quote;
}

std::string repr(const Value& v);
// str(): what {{ value }} prints.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined: return "";
    case Value::Kind::none: return "None";
    case Value::Kind::boolean: return v.b ? "True" : "False";
    case Value::Kind::integer: return std::to_string(v.i);
    case Value::Kind::floating: return py_float_repr(v.f);
    case Value::Kind::string: return v.str();
    case Value::Kind::callable: return "<function " + v.fn->name + ">";
    case Value::Kind::ns: return "<Namespace>";
    default: return repr(v);
  }
}
std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::string: return py_str_repr(v.str());
    case Value::Kind::list: {
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); k++) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (v.is_tuple && v.list->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Value::Kind::dict: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->size(); k++)
        out += (k ? ", " : "") + py_str_repr((*v.dict)[k].first) + ": " + repr((*v.dict)[k].second);
      return out + "}";
    }
    default: return to_str(v);
  }
}

// json.dumps(value, ensure_ascii=False, indent=indent, separators=default, sort_keys=False), as transformers'
// tojson filter calls it. Undefined and callables are not serializable (TypeError in Python).
void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += format("\\u%04x", c);
        else out += char(c);
    }
  }
  out += '"';
}
void to_json(std::string& out, const Value& v, int indent, int level, int line) {
  auto newline = [&](int at) {
    out += '\n';
    out.append(size_t(indent) * size_t(at), ' ');
  };
  switch (v.kind) {
    case Value::Kind::none: out += "null"; return;
    case Value::Kind::boolean: out += v.b ? "true" : "false"; return;
    case Value::Kind::integer: out += std::to_string(v.i); return;
    case Value::Kind::floating:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f < 0 ? "-Infinity" : "Infinity";
      else out += py_float_repr(v.f);
      return;
    case Value::Kind::string: json_string(out, v.str()); return;
    case Value::Kind::list: {
      if (v.list->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t k = 0; k < v.list->size(); k++) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(level + 1);
        to_json(out, (*v.list)[k], indent, level + 1, line);
      }
      if (indent >= 0) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::dict: {
      if (v.dict->empty()) { out += "{}"; return; }
      out += '{';
      for (size_t k = 0; k < v.dict->size(); k++) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(level + 1);
        json_string(out, (*v.dict)[k].first);
        out += ": ";
        to_json(out, (*v.dict)[k].second, indent, level + 1, line);
      }
      if (indent >= 0) newline(level);
      out += '}';
      return;
    }
    case Value::Kind::undefined: render_error(line, "tojson: an undefined value is not JSON serializable");
    case Value::Kind::ns: render_error(line, "tojson: a namespace is not JSON serializable");
    case Value::Kind::callable: render_error(line, "tojson: a function is not JSON serializable");
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      return u <= uint64_t(INT64_MAX) ? Value::integer(int64_t(u)) : Value::floating(double(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::floating(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(it.key(), from_json(it.value()));
      return Value::make_dict(std::move(items));
    }
    default: fail(ErrorCode::invalid_argument, "chat template variables: binary JSON values are not supported");
  }
}

// ---- lexer ------------------------------------------------------------------------------------------------
struct Token {
  enum class Type : uint8_t { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, end };
  Type type;
  std::string text;  // text/name/string value/operator
  int64_t i = 0;
  double f = 0;
  int line = 1;
};

[[noreturn]] void syntax_error(int line, const std::string& message) {
  fail(ErrorCode::bad_format, format("chat template line %d: %s", line, message.c_str()));
}

// jinja2 reads the source with str.splitlines() and joins it with "\n": every line boundary Python knows
// becomes "\n", and a final one is dropped (keep_trailing_newline=False).
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  bool ended_with_break = false;
  for (size_t i = 0; i < source.size(); i++) {
    unsigned char c = static_cast<unsigned char>(source[i]);
    size_t skip = 0;
    if (c == '\r' && i + 1 < source.size() && source[i + 1] == '\n') skip = 1;
    bool is_break = c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1C || c == 0x1D || c == 0x1E;
    if (c == 0xC2 && i + 1 < source.size() && static_cast<unsigned char>(source[i + 1]) == 0x85) is_break = true, skip = 1;
    if (c == 0xE2 && i + 2 < source.size() && static_cast<unsigned char>(source[i + 1]) == 0x80 &&
        (static_cast<unsigned char>(source[i + 2]) == 0xA8 || static_cast<unsigned char>(source[i + 2]) == 0xA9))
      is_break = true, skip = 2;
    if (is_break) {
      out += '\n';
      i += skip;
      ended_with_break = i + 1 == source.size();
    } else {
      out += char(c);
      ended_with_break = false;
    }
  }
  if (ended_with_break) out.pop_back();
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}
  std::vector<Token> run() {
    bool line_starting = true;  // the text about to be read starts a line (for lstrip_blocks)
    while (pos_ < src_.size()) {
      size_t open = find_open(pos_);
      std::string text = src_.substr(pos_, open - pos_);
      int text_line = line_;
      count_lines(pos_, open);
      pos_ = open;
      if (open >= src_.size()) {
        push_text(text, text_line);
        break;
      }
      char kind = src_[open + 1];  // '{', '%' or '#'
      char sign = open + 2 < src_.size() ? src_[open + 2] : 0;
      if (sign == '-') {
        text = py_strip(text, nullptr, false, true);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks: blanks between the line's start and the tag
        size_t line_start = text.rfind('\n');
        line_start = line_start == std::string::npos ? 0 : line_start + 1;
        if (line_start > 0 || line_starting) {
          bool blank = line_start < text.size();
          for (size_t k = line_start; k < text.size(); k++)
            if (text[k] != ' ' && text[k] != '\t' && text[k] != '\r' && text[k] != '\f' && text[k] != '\v') blank = false;
          if (blank) text.resize(line_start);
        }
      }
      push_text(text, text_line);
      pos_ = open + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        size_t close = src_.find("#}", pos_);
        if (close == std::string::npos) syntax_error(line_, "a comment {# is never closed with #}");
        bool strip = close > pos_ && src_[close - 1] == '-';
        count_lines(pos_, close);
        pos_ = close + 2;
        line_starting = after_tag(strip, true);
        continue;
      }
      int tag_line = line_;
      tokens_.push_back({kind == '{' ? Token::Type::var_begin : Token::Type::block_begin, "", 0, 0, tag_line});
      bool strip = lex_tag(kind == '{' ? '}' : '%');
      tokens_.push_back({kind == '{' ? Token::Type::var_end : Token::Type::block_end, "", 0, 0, line_});
      line_starting = after_tag(strip, kind == '%');
    }
    tokens_.push_back({Token::Type::end, "", 0, 0, line_});
    return std::move(tokens_);
  }

 private:
  size_t find_open(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); i++)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return src_.size();
  }
  void count_lines(size_t from, size_t to) {
    for (size_t i = from; i < to && i < src_.size(); i++) line_ += src_[i] == '\n';
  }
  void push_text(const std::string& text, int line) {
    if (!text.empty()) tokens_.push_back({Token::Type::text, text, 0, 0, line});
  }
  // After a tag: `-` strips the whitespace that follows; trim_blocks drops one newline after a block or comment.
  // Returns whether the next text starts a line.
  bool after_tag(bool strip, bool block) {
    if (strip) {
      size_t end = pos_;
      while (end < src_.size()) {
        std::vector<uint32_t> cp;
        unsigned char c = static_cast<unsigned char>(src_[end]);
        if (c < 0x80) {
          if (!py_space(c)) break;
          end++;
        } else {  // multi-byte whitespace (U+00A0, U+3000, ...), which Python's \s matches too
          int n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
          if (end + size_t(n) > src_.size()) break;
          std::vector<uint32_t> one = code_points(src_.substr(end, size_t(n)));
          if (one.empty() || !py_space(one[0])) break;
          end += size_t(n);
        }
      }
      count_lines(pos_, end);
      bool newline = end > pos_ && src_[end - 1] == '\n';
      pos_ = end;
      return newline;
    }
    if (block && pos_ < src_.size() && src_[pos_] == '\n') {
      pos_++;
      line_++;
      return true;
    }
    return false;
  }
  // The tokens inside {{ }} or {% %}, up to the closing delimiter (`close` is '}' or '%'); returns whether it
  // was written with `-`.
  bool lex_tag(char close) {
    int balance = 0;  // open brackets: a `}}` inside a dict literal closes the dict, not the tag
    for (;;) {
      while (pos_ < src_.size() && (src_[pos_] == ' ' || src_[pos_] == '\t' || src_[pos_] == '\n' || src_[pos_] == '\r' ||
                                    src_[pos_] == '\f' || src_[pos_] == '\v')) {
        line_ += src_[pos_] == '\n';
        pos_++;
      }
      if (pos_ >= src_.size()) syntax_error(line_, close == '}' ? "{{ is never closed with }}" : "{% is never closed with %}");
      char c = src_[pos_];
      if (balance == 0) {
        for (char sign : {'-', '+', '\0'}) {
          std::string end = sign ? std::string(1, sign) + close + "}" : std::string(1, close) + "}";
          if (src_.compare(pos_, end.size(), end) == 0) {
            pos_ += end.size();
            return sign == '-';
          }
        }
      }
      Token token{Token::Type::op, "", 0, 0, line_};
      if (ascii_alpha(c) || c == '_') {
        size_t start = pos_;
        while (pos_ < src_.size() && (ascii_alnum(src_[pos_]) || src_[pos_] == '_')) pos_++;
        token.type = Token::Type::name;
        token.text = src_.substr(start, pos_ - start);
      } else if (c >= '0' && c <= '9') {
        lex_number(token);
      } else if (c == '\'' || c == '"') {
        lex_string(token, c);
      } else {
        static const char* const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "(", ")",
                                          "[", "]", "{", "}", ",", ".", ":", "|", "=", "<", ">"};
        bool found = false;
        for (const char* op : ops) {
          size_t n = strlen(op);
          if (src_.compare(pos_, n, op) == 0) {
            token.text = op;
            pos_ += n;
            found = true;
            break;
          }
        }
        if (!found) syntax_error(line_, format("unexpected character '%c' in a tag", c));
        if (token.text == "(" || token.text == "[" || token.text == "{") balance++;
        if (token.text == ")" || token.text == "]" || token.text == "}") balance--;
      }
      tokens_.push_back(std::move(token));
    }
  }
  void lex_number(Token& token) {
    size_t start = pos_;
    auto digits = [&] {
      while (pos_ < src_.size() && ((src_[pos_] >= '0' && src_[pos_] <= '9') || src_[pos_] == '_')) pos_++;
    };
    digits();
    bool is_float = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && src_[pos_ + 1] >= '0' && src_[pos_ + 1] <= '9') {
      is_float = true;
      pos_++;
      digits();
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t save = pos_++;
      if (pos_ < src_.size() && (src_[pos_] == '+' || src_[pos_] == '-')) pos_++;
      if (pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '9') {
        is_float = true;
        digits();
      } else {
        pos_ = save;
      }
    }
    std::string text;
    for (size_t k = start; k < pos_; k++)
      if (src_[k] != '_') text += src_[k];
    if (is_float) {
      token.type = Token::Type::floating;
      token.f = strtod(text.c_str(), nullptr);
    } else {
      token.type = Token::Type::integer;
      errno = 0;
      unsigned long long value = strtoull(text.c_str(), nullptr, 10);
      if (errno || value > uint64_t(INT64_MAX)) syntax_error(line_, "an integer literal does not fit in 64 bits");
      token.i = int64_t(value);
    }
  }
  // A string literal, its backslash escapes read as Python's unicode-escape codec reads them.
  void lex_string(Token& token, char quote) {
    token.type = Token::Type::string;
    int start_line = line_;
    pos_++;
    std::string value;
    for (;;) {
      if (pos_ >= src_.size()) syntax_error(start_line, "a string literal is never closed");
      char c = src_[pos_++];
      if (c == quote) break;
      if (c == '\n') line_++;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (pos_ >= src_.size()) syntax_error(start_line, "a string literal is never closed");
      char e = src_[pos_++];
      auto hex = [&](int n) {
        uint32_t cp = 0;
        for (int k = 0; k < n; k++) {
          if (pos_ >= src_.size() || !isxdigit(static_cast<unsigned char>(src_[pos_])))
            syntax_error(line_, "a string literal has a truncated \\x, \\u or \\U escape");
          char h = src_[pos_++];
          cp = cp * 16 + uint32_t(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) syntax_error(line_, "a string literal escapes a code point that is not a character");
        append_utf8(value, cp);
      };
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\n': line_++; break;  // a backslash-newline continues the line
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = uint32_t(e - '0');
            for (int k = 0; k < 2 && pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '7'; k++) cp = cp * 8 + uint32_t(src_[pos_++] - '0');
            append_utf8(value, cp);
          } else {  // unknown escapes stay as written
            value += '\\';
            value += e;
          }
      }
    }
    token.text = std::move(value);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// ---- AST --------------------------------------------------------------------------------------------------
struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Expr {
  enum class Kind : uint8_t { literal, name, list, tuple, dict, attr, subscript, slice, call, filter, test, unary, binary,
                              compare, and_, or_, not_, ternary, concat };
  Kind kind;
  int line;
  Value literal;
  std::string name;               // name, attribute, filter/test name, operator
  std::vector<ExprPtr> children;  // operands / arguments (slice: value, start, stop, step; any may be null)
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;   // compare: one per pair
  bool negated = false;           // test: `is not`
  int depth = 1;                  // of the tree below: chains (a + b + c, x|f|g, a.b.c) grow it without recursion
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;
struct Node {
  enum class Kind : uint8_t { text, output, if_, for_, set, set_block, macro, call_block, filter_block, generation,
                              break_, continue_ };
  Kind kind;
  int line;
  std::string text;
  ExprPtr expr;                                      // output / for iterable / set value / call
  std::vector<std::pair<ExprPtr, Body>> branches;    // if/elif (else: null condition)
  std::vector<std::string> targets;                  // for / set names
  std::string attr;                                  // set ns.attr: targets[0] is ns
  ExprPtr condition;                                 // for ... if condition
  Body body, else_body;
  std::vector<std::pair<std::string, ExprPtr>> params;  // macro / caller parameters with defaults (null: none)
};

struct Template {
  Body body;
};

// ---- parser -----------------------------------------------------------------------------------------------
const char* const kFilters[] = {"trim", "tojson", "length", "count", "join", "upper", "lower", "capitalize", "title",
                                "replace", "default", "d", "selectattr", "rejectattr", "select", "reject", "map",
                                "items", "first", "last", "string", "int", "float", "list", "unique", "safe", "abs",
                                "round", "sort", "reverse", "e", "escape", "min", "max", "sum", "dictsort", "indent"};
const char* const kTests[] = {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable", "number",
                              "integer", "float", "boolean", "true", "false", "odd", "even", "divisibleby", "equalto",
                              "eq", "==", "ne", "!=", "lt", "<", "le", "<=", "gt", ">", "ge", ">=", "in", "sameas",
                              "callable", "lower", "upper"};
bool known(const char* const* names, size_t count, const std::string& name) {
  for (size_t k = 0; k < count; k++)
    if (name == names[k]) return true;
  return false;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}
  Template run() {
    Template tpl;
    tpl.body = parse_body({});
    if (peek().type != Token::Type::end) syntax_error(peek().line, "unexpected end tag");
    return tpl;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return t_[std::min(at_ + ahead, t_.size() - 1)]; }
  const Token& next() {
    const Token& token = t_[at_];
    if (at_ + 1 < t_.size()) at_++;
    return token;
  }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).type == Token::Type::op && peek(ahead).text == op; }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).type == Token::Type::name && peek(ahead).text == name;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) syntax_error(peek().line, format("expected '%s', found %s", op, describe(peek()).c_str()));
    next();
  }
  std::string expect_name() {
    if (peek().type != Token::Type::name) syntax_error(peek().line, format("expected a name, found %s", describe(peek()).c_str()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Token::Type::block_end) syntax_error(peek().line, format("expected the end of the tag (%%}), found %s", describe(peek()).c_str()));
    next();
  }
  static std::string describe(const Token& token) {
    switch (token.type) {
      case Token::Type::end: return "the end of the template";
      case Token::Type::block_end: return "'%}'";
      case Token::Type::var_end: return "'}}'";
      case Token::Type::string: return "a string";
      case Token::Type::integer: case Token::Type::floating: return "a number";
      default: return "'" + token.text + "'";
    }
  }
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser, int line) : p(parser) {
      if (++p.depth_ > limits::max_template_depth)
        fail(ErrorCode::unsupported, format("chat template line %d: nests more than %lld deep (KVLITE_MAX_TEMPLATE_DEPTH)",
                                            line, (long long)limits::max_template_depth));
    }
    ~DepthGuard() { p.depth_--; }
  };

  // Statements until one of `ends` (the tag name is left unread, after its {%).
  Body parse_body(std::initializer_list<const char*> ends) {
    DepthGuard guard(*this, peek().line);
    Body body;
    for (;;) {
      const Token& token = peek();
      if (token.type == Token::Type::end) {
        if (ends.size()) syntax_error(token.line, format("the template ends before {%% %s %%}", *(ends.end() - 1)));
        return body;
      }
      if (token.type == Token::Type::text) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::text;
        node->line = token.line;
        node->text = next().text;
        body.push_back(std::move(node));
      } else if (token.type == Token::Type::var_begin) {
        next();
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::output;
        node->line = token.line;
        node->expr = parse_expression();
        if (peek().type != Token::Type::var_end) syntax_error(peek().line, format("expected '}}', found %s", describe(peek()).c_str()));
        next();
        body.push_back(std::move(node));
      } else if (token.type == Token::Type::block_begin) {
        const Token& name = peek(1);
        if (name.type != Token::Type::name) syntax_error(name.line, "a {% tag without a statement name");
        for (const char* end : ends)
          if (name.text == end) return body;
        next();
        body.push_back(parse_statement());
      } else {
        syntax_error(token.line, "unexpected token");
      }
    }
  }

  NodePtr parse_statement() {
    const Token& keyword = next();
    auto node = std::make_unique<Node>();
    node->line = keyword.line;
    const std::string& k = keyword.text;
    if (k == "if") {
      node->kind = Node::Kind::if_;
      ExprPtr condition = parse_expression();
      expect_block_end();
      for (;;) {
        Body branch = parse_body({"elif", "else", "endif"});
        node->branches.emplace_back(std::move(condition), std::move(branch));
        next();  // {%
        std::string tag = next().text;
        if (tag == "elif") {
          condition = parse_expression();
          expect_block_end();
        } else if (tag == "else") {
          expect_block_end();
          node->else_body = parse_body({"endif"});
          next(), next();
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
    } else if (k == "for") {
      node->kind = Node::Kind::for_;
      bool paren = is_op("(");
      if (paren) next();
      node->targets.push_back(expect_name());
      while (is_op(",")) {
        next();
        node->targets.push_back(expect_name());
      }
      if (paren) expect_op(")");
      if (!is_name("in")) syntax_error(peek().line, "expected 'in' in a for loop");
      next();
      node->expr = parse_ternary(false);  // `if` here filters the loop
      if (is_name("if")) {
        next();
        node->condition = parse_expression();
      }
      if (is_name("recursive")) unsupported_construct(peek().line, "recursive for loops");
      expect_block_end();
      node->body = parse_body({"else", "endfor"});
      next();
      if (next().text == "else") {
        expect_block_end();
        node->else_body = parse_body({"endfor"});
        next(), next();
      }
      expect_block_end();
    } else if (k == "set") {
      std::string first = expect_name();
      if (is_op(".")) {
        next();
        node->kind = Node::Kind::set;
        node->targets.push_back(first);
        node->attr = expect_name();
        expect_op("=");
        node->expr = parse_expression();
        expect_block_end();
      } else {
        node->targets.push_back(first);
        while (is_op(",")) {
          next();
          node->targets.push_back(expect_name());
        }
        if (is_op("=")) {
          next();
          node->kind = Node::Kind::set;
          node->expr = parse_tuple_expression();
          expect_block_end();
        } else {
          if (node->targets.size() != 1) syntax_error(node->line, "a block set takes one name");
          node->kind = Node::Kind::set_block;
          if (is_op("|")) node->expr = parse_filter_chain(nullptr);
          expect_block_end();
          node->body = parse_body({"endset"});
          next(), next();
          expect_block_end();
        }
      }
    } else if (k == "macro") {
      node->kind = Node::Kind::macro;
      node->text = expect_name();
      parse_params(*node);
      expect_block_end();
      node->body = parse_body({"endmacro"});
      next(), next();
      if (peek().type == Token::Type::name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (k == "call") {
      node->kind = Node::Kind::call_block;
      if (is_op("(")) parse_params(*node);
      node->expr = parse_expression();
      if (node->expr->kind != Expr::Kind::call) syntax_error(node->line, "{% call %} needs a macro call");
      expect_block_end();
      node->body = parse_body({"endcall"});
      next(), next();
      expect_block_end();
    } else if (k == "filter") {
      node->kind = Node::Kind::filter_block;
      node->expr = parse_filter_chain(nullptr);
      expect_block_end();
      node->body = parse_body({"endfilter"});
      next(), next();
      expect_block_end();
    } else if (k == "generation") {
      node->kind = Node::Kind::generation;
      expect_block_end();
      node->body = parse_body({"endgeneration"});
      next(), next();
      expect_block_end();
    } else if (k == "break" || k == "continue") {
      node->kind = k == "break" ? Node::Kind::break_ : Node::Kind::continue_;
      expect_block_end();
    } else if (k.compare(0, 3, "end") == 0 || k == "elif" || k == "else") {
      syntax_error(keyword.line, "{% " + k + " %} without the statement it closes");
    } else {
      unsupported_construct(keyword.line, "the statement '" + k + "'");
    }
    return node;
  }
  [[noreturn]] static void unsupported_construct(int line, const std::string& what) {
    fail(ErrorCode::unsupported, format("chat template line %d: %s is not in kvlite's Jinja subset", line, what.c_str()));
  }
  void parse_params(Node& node) {
    expect_op("(");
    while (!is_op(")")) {
      std::string name = expect_name();
      ExprPtr value;
      if (is_op("=")) {
        next();
        value = parse_expression();
      }
      node.params.emplace_back(name, std::move(value));
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  ExprPtr make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  // A node that wraps `inner` (the previous link of a chain) is one deeper; chains are bounded as nesting is,
  // so that rendering and freeing the tree stay within the stack.
  void deeper(Expr& outer, const Expr* inner) {
    if (!inner) return;
    outer.depth = std::max(outer.depth, inner->depth + 1);
    if (outer.depth > 4 * limits::max_template_depth)
      fail(ErrorCode::unsupported, format("chat template line %d: an expression chains more than %lld operations "
                                          "(4 x KVLITE_MAX_TEMPLATE_DEPTH)", outer.line, 4 * (long long)limits::max_template_depth));
  }
  // `a, b` without brackets (set's right side) is a tuple.
  ExprPtr parse_tuple_expression() {
    int line = peek().line;
    ExprPtr first = parse_expression();
    if (!is_op(",")) return first;
    auto tuple = make(Expr::Kind::tuple, line);
    tuple->children.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().type == Token::Type::block_end) break;
      tuple->children.push_back(parse_expression());
    }
    return tuple;
  }
  ExprPtr parse_expression() { return parse_ternary(true); }
  ExprPtr parse_ternary(bool with_condition) {
    DepthGuard guard(*this, peek().line);
    ExprPtr value = parse_or();
    while (with_condition && is_name("if")) {
      int line = next().line;
      auto e = make(Expr::Kind::ternary, line);
      deeper(*e, value.get());
      e->children.push_back(std::move(value));
      e->children.push_back(parse_or());
      if (is_name("else")) {
        next();
        e->children.push_back(parse_ternary(true));
      } else {
        e->children.push_back(nullptr);
      }
      value = std::move(e);
    }
    return value;
  }
  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto e = make(Expr::Kind::or_, next().line);
      deeper(*e, left.get());
      e->children.push_back(std::move(left));
      e->children.push_back(parse_and());
      left = std::move(e);
    }
    return left;
  }
  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto e = make(Expr::Kind::and_, next().line);
      deeper(*e, left.get());
      e->children.push_back(std::move(left));
      e->children.push_back(parse_not());
      left = std::move(e);
    }
    return left;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this, peek().line);
      auto e = make(Expr::Kind::not_, next().line);
      e->children.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    int line = peek().line;
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> e;
    for (;;) {
      std::string op;
      if (peek().type == Token::Type::op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                             peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next(), next();
        op = "notin";
      } else {
        break;
      }
      if (!e) {
        e = make(Expr::Kind::compare, line);
        deeper(*e, first.get());
        e->children.push_back(std::move(first));
      }
      e->ops.push_back(op);
      e->children.push_back(parse_math1());
    }
    return e ? std::move(e) : std::move(first);
  }
  ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(Expr::Kind::binary, line);
    deeper(*e, left.get());
    deeper(*e, right.get());
    e->name = op;
    e->children.push_back(std::move(left));
    e->children.push_back(std::move(right));
    return e;
  }
  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& op = next();
      left = binary(op.text, std::move(left), parse_concat(), op.line);
    }
    return left;
  }
  ExprPtr parse_concat() {
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = make(Expr::Kind::concat, peek().line);
    e->children.push_back(std::move(first));
    while (is_op("~")) {
      next();
      e->children.push_back(parse_math2());
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& op = next();
      left = binary(op.text, std::move(left), parse_pow(), op.line);
    }
    return left;
  }
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const Token& op = next();
      left = binary(op.text, std::move(left), parse_unary(true), op.line);
    }
    return left;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this, peek().line);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token& op = next();
      node = make(Expr::Kind::unary, op.line);
      node->name = op.text;
      node->children.push_back(parse_unary(false));
    } else {
      node = parse_postfix(parse_primary());
    }
    return with_filter ? parse_filter_expr(std::move(node)) : std::move(node);
  }
  ExprPtr parse_primary() {
    const Token& token = peek();
    switch (token.type) {
      case Token::Type::name: {
        next();
        auto e = make(Expr::Kind::literal, token.line);
        if (token.text == "true" || token.text == "True") e->literal = Value::boolean(true);
        else if (token.text == "false" || token.text == "False") e->literal = Value::boolean(false);
        else if (token.text == "none" || token.text == "None") e->literal = Value::none();
        else e->kind = Expr::Kind::name, e->name = token.text;
        return e;
      }
      case Token::Type::string: {
        std::string text = next().text;
        while (peek().type == Token::Type::string) text += next().text;  // adjacent literals concatenate
        auto e = make(Expr::Kind::literal, token.line);
        e->literal = Value::string(std::move(text));
        return e;
      }
      case Token::Type::integer: {
        auto e = make(Expr::Kind::literal, token.line);
        e->literal = Value::integer(next().i);
        return e;
      }
      case Token::Type::floating: {
        auto e = make(Expr::Kind::literal, token.line);
        e->literal = Value::floating(next().f);
        return e;
      }
      case Token::Type::op:
        if (token.text == "(") {
          next();
          if (is_op(")")) {
            next();
            return make(Expr::Kind::tuple, token.line);
          }
          ExprPtr first = parse_expression();
          if (is_op(")")) {
            next();
            return first;
          }
          auto tuple = make(Expr::Kind::tuple, token.line);
          tuple->children.push_back(std::move(first));
          while (is_op(",")) {
            next();
            if (is_op(")")) break;
            tuple->children.push_back(parse_expression());
          }
          expect_op(")");
          return tuple;
        }
        if (token.text == "[") {
          next();
          auto list = make(Expr::Kind::list, token.line);
          while (!is_op("]")) {
            list->children.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return list;
        }
        if (token.text == "{") {
          next();
          auto dict = make(Expr::Kind::dict, token.line);
          while (!is_op("}")) {
            dict->children.push_back(parse_expression());
            expect_op(":");
            dict->children.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return dict;
        }
        break;
      default:
        break;
    }
    syntax_error(token.line, format("unexpected %s in an expression", describe(token).c_str()));
  }
  ExprPtr parse_postfix(ExprPtr node) {
    for (;;) {
      if (is_op(".")) {
        int line = next().line;
        auto e = make(Expr::Kind::attr, line);
        deeper(*e, node.get());
        if (peek().type == Token::Type::integer) {
          e->kind = Expr::Kind::subscript;
          e->children.push_back(std::move(node));
          auto index = make(Expr::Kind::literal, line);
          index->literal = Value::integer(next().i);
          e->children.push_back(std::move(index));
        } else {
          e->name = expect_name();
          e->children.push_back(std::move(node));
        }
        node = std::move(e);
      } else if (is_op("[")) {
        int line = next().line;
        ExprPtr parts[3];
        bool slice = false;
        for (int part = 0; part < 3; part++) {
          if (!is_op(":") && !is_op("]")) parts[part] = parse_expression();
          if (part < 2 && is_op(":")) {
            next();
            slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        auto e = make(slice ? Expr::Kind::slice : Expr::Kind::subscript, line);
        deeper(*e, node.get());
        e->children.push_back(std::move(node));
        if (!slice && !parts[0]) syntax_error(line, "an empty subscript []");
        e->children.push_back(std::move(parts[0]));
        if (slice) e->children.push_back(std::move(parts[1])), e->children.push_back(std::move(parts[2]));
        node = std::move(e);
      } else if (is_op("(")) {
        auto e = make(Expr::Kind::call, peek().line);
        deeper(*e, node.get());
        e->children.push_back(std::move(node));
        parse_call_args(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }
  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) unsupported_construct(peek().line, "*args / **kwargs in a call");
      if (peek().type == Token::Type::name && is_op("=", 1)) {
        std::string name = next().text;
        next();
        e.kwargs.emplace_back(name, parse_expression());
      } else {
        e.children.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }
  ExprPtr parse_filter_expr(ExprPtr node) {
    for (;;) {
      if (is_op("|")) {
        node = parse_filters(std::move(node));
      } else if (is_name("is")) {
        int line = next().line;
        auto e = make(Expr::Kind::test, line);
        deeper(*e, node.get());
        if (is_name("not")) {
          next();
          e->negated = true;
        }
        if (peek().type == Token::Type::name) e->name = next().text;
        else if (peek().type == Token::Type::op && (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">=")))
          e->name = next().text;
        else syntax_error(line, "expected a test name after 'is'");
        if (!known(kTests, sizeof kTests / sizeof *kTests, e->name)) unsupported_construct(line, "the test '" + e->name + "'");
        e->children.push_back(std::move(node));
        if (is_op("(")) {
          parse_call_args(*e);
        } else if ((peek().type == Token::Type::name || peek().type == Token::Type::string || peek().type == Token::Type::integer ||
                    peek().type == Token::Type::floating || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          e->children.push_back(parse_postfix(parse_primary()));
        }
        node = std::move(e);
      } else if (is_op("(")) {
        auto e = make(Expr::Kind::call, peek().line);
        deeper(*e, node.get());
        e->children.push_back(std::move(node));
        parse_call_args(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }
  // `| f(args) | g ...`, starting at the `|` (or at the first name when `node` is null: filter blocks).
  ExprPtr parse_filters(ExprPtr node) {
    if (is_op("|")) next();
    int line = peek().line;
    std::string name = expect_name();
    while (is_op(".")) next(), name += "." + expect_name();
    if (!known(kFilters, sizeof kFilters / sizeof *kFilters, name)) unsupported_construct(line, "the filter '" + name + "'");
    auto e = make(Expr::Kind::filter, line);
    deeper(*e, node.get());
    e->name = name;
    e->children.push_back(std::move(node));
    if (is_op("(")) parse_call_args(*e);
    return e;
  }
  ExprPtr parse_filter_chain(ExprPtr node) {
    node = parse_filters(std::move(node));
    while (is_op("|")) node = parse_filters(std::move(node));
    return node;
  }

  std::vector<Token> t_;
  size_t at_ = 0;
  int depth_ = 0;
};

// ---- evaluator --------------------------------------------------------------------------------------------
struct Scope {
  std::vector<std::pair<std::string, Value>> vars;
  std::shared_ptr<Scope> parent;
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (const auto& v : s->vars)
        if (v.first == name) return &v.second;
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    for (auto& v : vars)
      if (v.first == name) {
        v.second = std::move(value);
        return;
      }
    vars.emplace_back(name, std::move(value));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

struct LoopSignal {
  enum class Kind { none, break_, continue_ } kind = Kind::none;
};

struct Interp {
  int64_t steps = 0;
  int depth = 0;   // macro and caller() calls in progress
  int frames = 0;  // eval/exec frames on the C++ stack: macro calls multiply the nesting the parser bounded
  struct Frame {
    Interp& in;
    Frame(Interp& interp, int line) : in(interp) {
      if (++in.frames > 8 * limits::max_template_depth)
        render_error(line, format("expressions, statements and macro calls nest more than %lld deep while rendering "
                                  "(8 x KVLITE_MAX_TEMPLATE_DEPTH)", 8 * (long long)limits::max_template_depth));
    }
    ~Frame() { in.frames--; }
  };
  int64_t now = -1;
  std::string* out = nullptr;

  void step(int line, int64_t cost = 1) {
    steps += cost;
    if (steps > limits::max_template_steps)
      render_error(line, format("rendering took more than %lld steps (KVLITE_MAX_TEMPLATE_STEPS)", (long long)limits::max_template_steps));
  }
  // A new list of `items` values: 10 steps each (a value is ~100 bytes), asked before anything is allocated, so
  // that the step limit also bounds memory (10 M steps: at most 1 M values, ~100 MB).
  void charge_items(int line, uint64_t items) {
    if (items > uint64_t(limits::max_template_steps)) items = uint64_t(limits::max_template_steps);
    step(line, int64_t(items) * 10);
  }
  void check_size(size_t bytes, int line) {
    if (bytes > uint64_t(limits::max_template_output_bytes))
      render_error(line, format("a string or the output grows past %lld bytes (KVLITE_MAX_TEMPLATE_OUTPUT_BYTES)",
                                (long long)limits::max_template_output_bytes));
  }
  void emit(const std::string& text, int line) {
    check_size(out->size() + text.size(), line);
    step(line, 1 + int64_t(text.size() / 4096));
    *out += text;
  }

  // ---- truthiness, equality, ordering (Python's) ----
  static bool truthy(const Value& v) {
    switch (v.kind) {
      case Value::Kind::undefined: case Value::Kind::none: return false;
      case Value::Kind::boolean: return v.b;
      case Value::Kind::integer: return v.i != 0;
      case Value::Kind::floating: return v.f != 0;
      case Value::Kind::string: return !v.s->empty();
      case Value::Kind::list: return !v.list->empty();
      case Value::Kind::dict: return !v.dict->empty();
      default: return true;
    }
  }
  static double number(const Value& v) {
    return v.kind == Value::Kind::floating ? v.f : v.kind == Value::Kind::integer ? double(v.i) : double(v.b);
  }
  bool equal(const Value& a, const Value& b) {
    if (a.is_number() && b.is_number()) {
      if (a.kind != Value::Kind::floating && b.kind != Value::Kind::floating)
        return (a.kind == Value::Kind::integer ? a.i : int64_t(a.b)) == (b.kind == Value::Kind::integer ? b.i : int64_t(b.b));
      return number(a) == number(b);
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
      case Value::Kind::undefined: case Value::Kind::none: return true;
      case Value::Kind::string: return a.str() == b.str();
      case Value::Kind::list:
        if (a.list->size() != b.list->size()) return false;
        step(0, int64_t(a.list->size() / 16));
        for (size_t k = 0; k < a.list->size(); k++)
          if (!equal((*a.list)[k], (*b.list)[k])) return false;
        return true;
      case Value::Kind::dict:
        if (a.dict->size() != b.dict->size()) return false;
        step(0, int64_t(a.dict->size() * a.dict->size() / 16));  // (linear lookups)
        for (const auto& entry : *a.dict) {
          const Value* other = dict_find(*b.dict, entry.first);
          if (!other || !equal(entry.second, *other)) return false;
        }
        return true;
      case Value::Kind::ns: return a.dict == b.dict;
      case Value::Kind::callable: return a.fn == b.fn;
      default: return false;
    }
  }
  // -1, 0, 1; a type error for values Python cannot order.
  int compare(const Value& a, const Value& b, int line) {
    if (a.is_number() && b.is_number()) {
      double x = number(a), y = number(b);
      if (a.kind != Value::Kind::floating && b.kind != Value::Kind::floating) {
        int64_t p = a.kind == Value::Kind::integer ? a.i : a.b, q = b.kind == Value::Kind::integer ? b.i : b.b;
        return p < q ? -1 : p > q;
      }
      return x < y ? -1 : x > y;
    }
    if (a.kind == Value::Kind::string && b.kind == Value::Kind::string) {
      int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
      return c < 0 ? -1 : c > 0;
    }
    if (a.kind == Value::Kind::list && b.kind == Value::Kind::list) {
      step(line, int64_t(std::min(a.list->size(), b.list->size()) / 16));
      for (size_t k = 0; k < a.list->size() && k < b.list->size(); k++) {
        if (equal((*a.list)[k], (*b.list)[k])) continue;
        return compare((*a.list)[k], (*b.list)[k], line);
      }
      return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
    }
    if (a.is_undefined() || b.is_undefined()) undefined_error(a.is_undefined() ? a : b, line);
    render_error(line, "'<' is not supported between " + type_name(a) + " and " + type_name(b));
  }
  static std::string type_name(const Value& v) {
    switch (v.kind) {
      case Value::Kind::undefined: return "Undefined";
      case Value::Kind::none: return "NoneType";
      case Value::Kind::boolean: return "bool";
      case Value::Kind::integer: return "int";
      case Value::Kind::floating: return "float";
      case Value::Kind::string: return "str";
      case Value::Kind::list: return v.is_tuple ? "tuple" : "list";
      case Value::Kind::dict: return "dict";
      case Value::Kind::ns: return "Namespace";
      default: return "function";
    }
  }
  [[noreturn]] static void undefined_error(const Value& v, int line) {
    render_error(line, v.hint ? *v.hint : std::string("a value is undefined"));
  }

  // ---- iteration: the items `for` visits ----
  List iterate(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::undefined: return {};
      case Value::Kind::list: step(line, int64_t(v.list->size() / 16)); return *v.list;
      case Value::Kind::dict: {
        step(line, int64_t(v.dict->size() / 16));
        List keys;
        for (const auto& entry : *v.dict) keys.push_back(Value::string(entry.first));
        return keys;
      }
      case Value::Kind::string: {
        List chars;
        std::vector<uint32_t> cps = code_points(v.str());
        step(line, int64_t(cps.size()));
        for (uint32_t cp : cps) {
          std::string c;
          append_utf8(c, cp);
          chars.push_back(Value::string(std::move(c)));
        }
        return chars;
      }
      default: render_error(line, "'" + type_name(v) + "' object is not iterable");
    }
  }
  int64_t length(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::undefined: return 0;
      case Value::Kind::string: step(line, int64_t(v.str().size() / 64)); return int64_t(utf8_length(v.str()));
      case Value::Kind::list: return int64_t(v.list->size());
      case Value::Kind::dict: return int64_t(v.dict->size());
      default: render_error(line, "object of type '" + type_name(v) + "' has no len()");
    }
  }

  // ---- attribute and item access (jinja2's getattr / getitem, through the immutable sandbox) ----
  Value attribute(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) undefined_error(obj, line);
    if (Value method = bound_method(obj, name, line); method.kind == Value::Kind::callable) return method;
    if (obj.kind == Value::Kind::dict || obj.kind == Value::Kind::ns) {
      if (const Value* found = dict_find(*obj.dict, name)) return *found;
    }
    return Value::undefined("'" + describe_object(obj) + "' has no attribute '" + name + "'");
  }
  Value item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) undefined_error(obj, line);
    if (obj.kind == Value::Kind::dict && key.kind == Value::Kind::string) {
      if (const Value* found = dict_find(*obj.dict, key.str())) return *found;
    } else if ((obj.kind == Value::Kind::list || obj.kind == Value::Kind::string) &&
               (key.kind == Value::Kind::integer || key.kind == Value::Kind::boolean)) {
      int64_t index = key.kind == Value::Kind::integer ? key.i : key.b;
      if (obj.kind == Value::Kind::list) {
        int64_t n = int64_t(obj.list->size());
        if (index < 0) index += n;
        if (index >= 0 && index < n) return (*obj.list)[size_t(index)];
      } else {
        step(line, int64_t(obj.str().size() / 64));
        std::vector<uint32_t> cps = code_points(obj.str());
        int64_t n = int64_t(cps.size());
        if (index < 0) index += n;
        if (index >= 0 && index < n) return Value::string(from_code_points(cps, size_t(index), size_t(index) + 1));
      }
    }
    if (key.kind == Value::Kind::string) {
      Value method = bound_method(obj, key.str(), line);
      if (method.kind == Value::Kind::callable) return method;
      return Value::undefined("'" + describe_object(obj) + "' has no attribute '" + key.str() + "'");
    }
    return Value::undefined("'" + describe_object(obj) + "' has no attribute " + repr(key));
  }
  static std::string describe_object(const Value& obj) {
    if (obj.kind == Value::Kind::ns) return "<Namespace>";
    return type_name(obj) + " object";
  }
  Value slice(const Value& obj, const Value* start, const Value* stop, const Value* stride, int line) {
    if (obj.is_undefined()) undefined_error(obj, line);
    auto index_of = [&](const Value* v, const char* what) -> std::optional<int64_t> {
      if (!v || v->kind == Value::Kind::none) return std::nullopt;
      if (v->kind == Value::Kind::integer) return v->i;
      if (v->kind == Value::Kind::boolean) return int64_t(v->b);
      render_error(line, std::string("slice ") + what + " must be an integer or None");
    };
    std::optional<int64_t> a = index_of(start, "start"), b = index_of(stop, "stop"), c = index_of(stride, "step");
    int64_t step_by = c.value_or(1);
    if (step_by == 0) render_error(line, "slice step cannot be zero");
    std::vector<uint32_t> cps;
    int64_t n;
    if (obj.kind == Value::Kind::list) n = int64_t(obj.list->size());
    else if (obj.kind == Value::Kind::string) cps = code_points(obj.str()), n = int64_t(cps.size());
    else render_error(line, "'" + type_name(obj) + "' object is not subscriptable");
    // Python's slice.indices
    auto clamp = [&](std::optional<int64_t> v, int64_t fallback_positive, int64_t fallback_negative) {
      if (!v) return step_by > 0 ? fallback_positive : fallback_negative;
      int64_t x = *v;
      if (x < 0) x = std::max<int64_t>(x + n, step_by > 0 ? 0 : -1);
      else x = std::min<int64_t>(x, step_by > 0 ? n : n - 1);
      return x;
    };
    int64_t begin = clamp(a, 0, n - 1), end = clamp(b, n, -1);
    std::vector<int64_t> picked;
    for (int64_t k = begin; step_by > 0 ? k < end : k > end; k += step_by) picked.push_back(k);
    step(line, int64_t(picked.size()));
    if (obj.kind == Value::Kind::list) {
      List items;
      for (int64_t k : picked) items.push_back((*obj.list)[size_t(k)]);
      return Value::make_list(std::move(items), obj.is_tuple);
    }
    std::string text;
    for (int64_t k : picked) append_utf8(text, cps[size_t(k)]);
    return Value::string(std::move(text));
  }

  // ---- expressions ----
  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_call(const Expr& e, const ScopePtr& scope);
  Value apply_filter(const std::string& name, Value value, Call& call, const ScopePtr& scope);
  bool apply_test(const std::string& name, const Value& value, Call& call);
  Value bound_method(const Value& obj, const std::string& name, int line);
  Value arithmetic(const std::string& op, const Value& a, const Value& b, int line);
  Value call_value(const Value& callee, Call& call, const std::string& what) {
    if (callee.is_undefined()) undefined_error(callee, call.line);
    if (callee.kind != Value::Kind::callable) render_error(call.line, what + " is not callable ('" + type_name(callee) + "')");
    if (++depth > limits::max_template_depth)
      render_error(call.line, format("calls nest more than %lld deep (KVLITE_MAX_TEMPLATE_DEPTH)", (long long)limits::max_template_depth));
    Value result = callee.fn->run(*this, call);
    depth--;
    return result;
  }

  // ---- statements ----
  LoopSignal exec(const Body& body, const ScopePtr& scope);
  LoopSignal exec_for(const Node& node, const ScopePtr& scope);
  std::string capture(const Body& body, const ScopePtr& scope) {
    std::string* saved = out;
    std::string text;
    out = &text;
    exec(body, scope);
    out = saved;
    return text;
  }
  Value make_macro(const Node& node, const ScopePtr& defined_in);
  std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t limit, int line);
  Value apply_filter_chain(const Expr& chain, Value value, const ScopePtr& scope);
  Value attribute_path(const Value& item, const Value& path, int line);
};

// Arguments by position or name, as a Python signature binds them.
struct Args {
  Call& call;
  const std::string& what;
  std::vector<const char*> names;
  const Value* get(size_t position, const char* name) const {
    for (const auto& kw : call.kwargs)
      if (kw.first == name) return &kw.second;
    return position < call.args.size() ? &call.args[position] : nullptr;
  }
};
void check_args(Call& call, const std::string& what, std::initializer_list<const char*> names) {
  if (call.args.size() > names.size())
    render_error(call.line, format("%s takes at most %zu arguments (%zu given)", what.c_str(), names.size(), call.args.size()));
  for (const auto& kw : call.kwargs) {
    bool ok = false;
    for (const char* name : names) ok |= kw.first == name;
    if (!ok) render_error(call.line, what + " got an unexpected keyword argument '" + kw.first + "'");
  }
}
const Value* arg(Call& call, size_t position, const char* name) {
  for (const auto& kw : call.kwargs)
    if (kw.first == name) return &kw.second;
  return position < call.args.size() ? &call.args[position] : nullptr;
}
const std::string& string_arg(Call& call, size_t position, const char* name, const std::string& what) {
  const Value* v = arg(call, position, name);
  if (!v || v->kind != Value::Kind::string) render_error(call.line, what + ": argument '" + name + "' must be a string");
  return v->str();
}

Value Interp::arithmetic(const std::string& op, const Value& a, const Value& b, int line) {
  if (a.is_undefined()) undefined_error(a, line);
  if (b.is_undefined()) undefined_error(b, line);
  auto bad = [&]() -> Value {
    render_error(line, "unsupported operand types for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (op == "+") {
    if (a.kind == Value::Kind::string && b.kind == Value::Kind::string) {
      check_size(a.str().size() + b.str().size(), line);
      step(line, int64_t((a.str().size() + b.str().size()) / 4096));
      return Value::string(a.str() + b.str());
    }
    if (a.kind == Value::Kind::list && b.kind == Value::Kind::list && a.is_tuple == b.is_tuple) {
      charge_items(line, a.list->size() + b.list->size());
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(items), a.is_tuple);
    }
  }
  if (op == "*") {
    const Value* seq = a.kind == Value::Kind::string || a.kind == Value::Kind::list ? &a : &b;
    const Value* count = seq == &a ? &b : &a;
    if ((seq->kind == Value::Kind::string || seq->kind == Value::Kind::list) &&
        (count->kind == Value::Kind::integer || count->kind == Value::Kind::boolean)) {
      int64_t times = std::max<int64_t>(0, count->kind == Value::Kind::integer ? count->i : count->b);
      if (seq->kind == Value::Kind::string) {
        if (times > 0 && seq->str().size() > 0) check_size(uint64_t(times) > uint64_t(limits::max_template_output_bytes) ? uint64_t(-1) : seq->str().size() * uint64_t(times), line);
        std::string text;
        for (int64_t k = 0; k < times && !seq->str().empty(); k++) text += seq->str();
        step(line, int64_t(text.size() / 4096));
        return Value::string(std::move(text));
      }
      if (times > 0 && !seq->list->empty())
        charge_items(line, times > limits::max_template_steps ? uint64_t(limits::max_template_steps) : uint64_t(times) * seq->list->size());
      List items;
      for (int64_t k = 0; k < times; k++) items.insert(items.end(), seq->list->begin(), seq->list->end());
      return Value::make_list(std::move(items), seq->is_tuple);
    }
  }
  if (!a.is_number() || !b.is_number()) return bad();
  bool integers = a.kind != Value::Kind::floating && b.kind != Value::Kind::floating;
  int64_t x = a.kind == Value::Kind::integer ? a.i : a.b, y = b.kind == Value::Kind::integer ? b.i : b.b;
  double p = number(a), q = number(b);
  auto overflow = [&]() -> Value { render_error(line, "integer overflow in " + op + " (kvlite's integers are 64-bit)"); };
  if (op == "+" || op == "-" || op == "*") {
    if (integers) {
      int64_t r;
      bool o = op == "+" ? __builtin_add_overflow(x, y, &r) : op == "-" ? __builtin_sub_overflow(x, y, &r) : __builtin_mul_overflow(x, y, &r);
      if (o) return overflow();
      return Value::integer(r);
    }
    return Value::floating(op == "+" ? p + q : op == "-" ? p - q : p * q);
  }
  if (op == "/") {
    if (q == 0) render_error(line, "division by zero");
    return Value::floating(p / q);
  }
  if (op == "//" || op == "%") {
    if (integers) {
      if (y == 0) render_error(line, "integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) return overflow();
      int64_t quotient = x / y, rest = x % y;
      if (rest != 0 && ((rest < 0) != (y < 0))) quotient--, rest += y;
      return Value::integer(op == "//" ? quotient : rest);
    }
    if (q == 0) render_error(line, "float division or modulo by zero");
    double rest = std::fmod(p, q);
    if (rest != 0 && ((rest < 0) != (q < 0))) rest += q;
    return Value::floating(op == "//" ? std::floor(p / q) : rest);
  }
  if (op == "**") {
    if (integers && y >= 0) {
      int64_t r = 1;
      for (int64_t k = 0; k < y; k++) {
        if (__builtin_mul_overflow(r, x, &r)) return overflow();
        if (r == 0 || r == 1) break;
        step(line);
      }
      if (r == 1 && x == -1) r = (y % 2) ? -1 : 1;
      return Value::integer(r);
    }
    return Value::floating(std::pow(p, q));
  }
  return bad();
}

Value Interp::eval(const Expr& e, const ScopePtr& scope) {
  step(e.line);
  Frame frame(*this, e.line);
  switch (e.kind) {
    case Expr::Kind::literal: return e.literal;
    case Expr::Kind::name: {
      const Value* found = scope->find(e.name);
      return found ? *found : Value::undefined("'" + e.name + "' is undefined");
    }
    case Expr::Kind::list: case Expr::Kind::tuple: {
      List items;
      for (const auto& child : e.children) items.push_back(eval(*child, scope));
      return Value::make_list(std::move(items), e.kind == Expr::Kind::tuple);
    }
    case Expr::Kind::dict: {
      Dict items;
      for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
        Value key = eval(*e.children[k], scope);
        if (key.kind != Value::Kind::string) render_error(e.line, "kvlite's dict literals take string keys");
        Value value = eval(*e.children[k + 1], scope);
        bool replaced = false;
        for (auto& entry : items)
          if (entry.first == key.str()) entry.second = value, replaced = true;
        if (!replaced) items.emplace_back(key.str(), std::move(value));
      }
      return Value::make_dict(std::move(items));
    }
    case Expr::Kind::attr: return attribute(eval(*e.children[0], scope), e.name, e.line);
    case Expr::Kind::subscript: return item(eval(*e.children[0], scope), eval(*e.children[1], scope), e.line);
    case Expr::Kind::slice: {
      Value obj = eval(*e.children[0], scope);
      Value parts[3];
      const Value* pointers[3] = {nullptr, nullptr, nullptr};
      for (int k = 0; k < 3; k++)
        if (e.children[size_t(k) + 1]) parts[k] = eval(*e.children[size_t(k) + 1], scope), pointers[k] = &parts[k];
      return slice(obj, pointers[0], pointers[1], pointers[2], e.line);
    }
    case Expr::Kind::call: return eval_call(e, scope);
    case Expr::Kind::filter: {
      Value value = eval(*e.children[0], scope);
      Call call;
      call.line = e.line;
      for (size_t k = 1; k < e.children.size(); k++) call.args.push_back(eval(*e.children[k], scope));
      for (const auto& kw : e.kwargs) call.kwargs.emplace_back(kw.first, eval(*kw.second, scope));
      return apply_filter(e.name, std::move(value), call, scope);
    }
    case Expr::Kind::test: {
      Value value = eval(*e.children[0], scope);
      Call call;
      call.line = e.line;
      for (size_t k = 1; k < e.children.size(); k++) call.args.push_back(eval(*e.children[k], scope));
      for (const auto& kw : e.kwargs) call.kwargs.emplace_back(kw.first, eval(*kw.second, scope));
      return Value::boolean(apply_test(e.name, value, call) != e.negated);
    }
    case Expr::Kind::unary: {
      Value v = eval(*e.children[0], scope);
      if (v.is_undefined()) undefined_error(v, e.line);
      if (!v.is_number()) render_error(e.line, "bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
      if (e.name == "+") return v.kind == Value::Kind::boolean ? Value::integer(v.b) : v;
      if (v.kind == Value::Kind::floating) return Value::floating(-v.f);
      int64_t x = v.kind == Value::Kind::integer ? v.i : v.b;
      if (x == INT64_MIN) render_error(e.line, "integer overflow in unary -");
      return Value::integer(-x);
    }
    case Expr::Kind::binary: return arithmetic(e.name, eval(*e.children[0], scope), eval(*e.children[1], scope), e.line);
    case Expr::Kind::compare: {
      Value left = eval(*e.children[0], scope);
      for (size_t k = 0; k < e.ops.size(); k++) {
        Value right = eval(*e.children[k + 1], scope);
        const std::string& op = e.ops[k];
        bool result;
        if (op == "==") result = equal(left, right);
        else if (op == "!=") result = !equal(left, right);
        else if (op == "in" || op == "notin") {
          Call call;
          call.line = e.line;
          call.args.push_back(right);
          result = apply_test("in", left, call) == (op == "in");
        } else {
          int c = compare(left, right, e.line);
          result = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
        }
        if (!result) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case Expr::Kind::and_: {
      Value left = eval(*e.children[0], scope);
      return truthy(left) ? eval(*e.children[1], scope) : left;
    }
    case Expr::Kind::or_: {
      Value left = eval(*e.children[0], scope);
      return truthy(left) ? left : eval(*e.children[1], scope);
    }
    case Expr::Kind::not_: return Value::boolean(!truthy(eval(*e.children[0], scope)));
    case Expr::Kind::ternary:
      if (truthy(eval(*e.children[1], scope))) return eval(*e.children[0], scope);
      if (e.children[2]) return eval(*e.children[2], scope);
      return Value::undefined("the if expression on line " + std::to_string(e.line) + " evaluated to false and no else section was defined.");
    case Expr::Kind::concat: {
      std::string text;
      for (const auto& child : e.children) {
        text += to_str(eval(*child, scope));
        check_size(text.size(), e.line);
      }
      step(e.line, int64_t(text.size() / 4096));
      return Value::string(std::move(text));
    }
  }
  render_error(e.line, "unknown expression");
}

Value Interp::eval_call(const Expr& e, const ScopePtr& scope) {
  Call call;
  call.line = e.line;
  Value callee = eval(*e.children[0], scope);
  for (size_t k = 1; k < e.children.size(); k++) call.args.push_back(eval(*e.children[k], scope));
  for (const auto& kw : e.kwargs) call.kwargs.emplace_back(kw.first, eval(*kw.second, scope));
  std::string what = e.children[0]->kind == Expr::Kind::name ? "'" + e.children[0]->name + "'"
                     : e.children[0]->kind == Expr::Kind::attr ? "'" + e.children[0]->name + "'" : "the value";
  return call_value(callee, call, what);
}

// Methods of str, dict and list that templates call; changing ones (append, pop, update...) are refused as the
// immutable sandbox refuses them.
Value Interp::bound_method(const Value& obj, const std::string& name, int line) {
  auto method = [&](std::function<Value(Interp&, Call&)> run) {
    Value v;
    v.kind = Value::Kind::callable;
    v.fn = std::make_shared<const Callable>(Callable{type_name(obj) + "." + name, std::move(run)});
    return v;
  };
  if (obj.kind == Value::Kind::string) {
    step(line, int64_t(obj.str().size() / 64));  // every str method walks the string
    const Value self = obj;
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "str." + name, {"chars"});
        const Value* chars = arg(c, 0, "chars");
        return Value::string(py_strip(self.str(), chars, name != "rstrip", name != "lstrip"));
      });
    if (name == "upper" || name == "lower")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "str." + name, {});
        return Value::string(name == "upper" ? ascii_upper(self.str()) : ascii_lower(self.str()));
      });
    if (name == "title" || name == "capitalize")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "str." + name, {});
        std::string text = self.str();
        bool previous_cased = false;
        for (size_t k = 0; k < text.size(); k++) {
          char ch = text[k];
          if (name == "capitalize") {
            text[k] = k == 0 ? ascii_upper(std::string(1, ch))[0] : ascii_lower(std::string(1, ch))[0];
            continue;
          }
          text[k] = previous_cased ? ascii_lower(std::string(1, ch))[0] : ascii_upper(std::string(1, ch))[0];
          previous_cased = ascii_alpha(ch) || (static_cast<unsigned char>(ch) >= 0x80);
        }
        return Value::string(text);
      });
    if (name == "startswith" || name == "endswith")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "str." + name, {"prefix"});
        const Value* what = arg(c, 0, "prefix");
        if (!what) render_error(c.line, "str." + name + " takes a string or a tuple of strings");
        List options = what->kind == Value::Kind::list ? *what->list : List{*what};
        for (const Value& option : options) {
          if (option.kind != Value::Kind::string) render_error(c.line, "str." + name + " takes a string or a tuple of strings");
          const std::string& s = self.str();
          const std::string& o = option.str();
          bool match = o.size() <= s.size() && (name == "startswith" ? s.compare(0, o.size(), o) == 0 : s.compare(s.size() - o.size(), o.size(), o) == 0);
          if (match) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "split" || name == "rsplit")
      return method([self, name](Interp& in, Call& c) {
        check_args(c, "str." + name, {"sep", "maxsplit"});
        const Value* sep = arg(c, 0, "sep");
        const Value* max_value = arg(c, 1, "maxsplit");
        int64_t max_splits = max_value && max_value->kind == Value::Kind::integer ? max_value->i : -1;
        const std::string& s = self.str();
        List parts;
        if (!sep || sep->kind == Value::Kind::none) {
          if (name == "rsplit" && max_splits >= 0) render_error(c.line, "str.rsplit with maxsplit and no separator is not in kvlite's subset");
          std::vector<uint32_t> cps = code_points(s);
          size_t k = 0;
          int64_t splits = 0;
          while (k < cps.size()) {
            while (k < cps.size() && py_space(cps[k])) k++;
            if (k >= cps.size()) break;
            if (max_splits >= 0 && splits >= max_splits) {
              size_t end = cps.size();
              while (end > k && py_space(cps[end - 1])) end--;
              parts.push_back(Value::string(from_code_points(cps, k, end)));
              break;
            }
            size_t start = k;
            while (k < cps.size() && !py_space(cps[k])) k++;
            parts.push_back(Value::string(from_code_points(cps, start, k)));
            splits++;
          }
        } else {
          if (sep->kind != Value::Kind::string) render_error(c.line, "str." + name + ": the separator must be a string");
          const std::string& d = sep->str();
          if (d.empty()) render_error(c.line, "str." + name + ": empty separator");
          if (name == "split") {
            size_t start = 0;
            int64_t splits = 0;
            for (;;) {
              size_t at = (max_splits >= 0 && splits >= max_splits) ? std::string::npos : s.find(d, start);
              if (at == std::string::npos) {
                parts.push_back(Value::string(s.substr(start)));
                break;
              }
              parts.push_back(Value::string(s.substr(start, at - start)));
              start = at + d.size();
              splits++;
            }
          } else {
            size_t end = s.size();
            int64_t splits = 0;
            List reversed;
            for (;;) {
              size_t at = (max_splits >= 0 && splits >= max_splits) || end < d.size() ? std::string::npos : s.rfind(d, end - d.size());
              if (at == std::string::npos) {
                reversed.push_back(Value::string(s.substr(0, end)));
                break;
              }
              reversed.push_back(Value::string(s.substr(at + d.size(), end - at - d.size())));
              end = at;
              splits++;
            }
            parts.assign(reversed.rbegin(), reversed.rend());
          }
        }
        in.step(c.line, int64_t(parts.size()));
        return Value::make_list(std::move(parts));
      });
    if (name == "replace")
      return method([self](Interp& in, Call& c) {
        check_args(c, "str.replace", {"old", "new", "count"});
        const std::string& from = string_arg(c, 0, "old", "str.replace");
        const std::string& to = string_arg(c, 1, "new", "str.replace");
        const Value* count = arg(c, 2, "count");
        int64_t limit = count && count->kind == Value::Kind::integer ? count->i : -1;
        return Value::string(in.replace(self.str(), from, to, limit, c.line));
      });
    if (name == "count" || name == "find")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "str." + name, {"sub"});
        const std::string& sub = string_arg(c, 0, "sub", "str." + name);
        const std::string& s = self.str();
        if (name == "find") {
          size_t at = s.find(sub);
          return Value::integer(at == std::string::npos ? -1 : int64_t(utf8_length(s.substr(0, at))));
        }
        if (sub.empty()) return Value::integer(int64_t(utf8_length(s)) + 1);
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) n++;
        return Value::integer(n);
      });
    if (name == "join")
      return method([self](Interp& in, Call& c) {
        check_args(c, "str.join", {"iterable"});
        const Value* items = arg(c, 0, "iterable");
        if (!items) render_error(c.line, "str.join takes an iterable");
        std::string text;
        bool first = true;
        for (const Value& item : in.iterate(*items, c.line)) {
          if (item.kind != Value::Kind::string) render_error(c.line, "str.join: expected str, found " + type_name(item));
          if (!first) text += self.str();
          text += item.str();
          first = false;
          in.check_size(text.size(), c.line);
        }
        return Value::string(std::move(text));
      });
  } else if (obj.kind == Value::Kind::dict) {
    const Value self = obj;
    if (name == "items" || name == "keys" || name == "values")
      return method([self, name](Interp&, Call& c) {
        check_args(c, "dict." + name, {});
        List out;
        for (const auto& entry : *self.dict) {
          if (name == "keys") out.push_back(Value::string(entry.first));
          else if (name == "values") out.push_back(entry.second);
          else out.push_back(Value::make_list({Value::string(entry.first), entry.second}, true));
        }
        return Value::make_list(std::move(out));
      });
    if (name == "get")
      return method([self](Interp&, Call& c) {
        check_args(c, "dict.get", {"key", "default"});
        const Value* key = arg(c, 0, "key");
        const Value* fallback = arg(c, 1, "default");
        if (key && key->kind == Value::Kind::string)
          if (const Value* found = dict_find(*self.dict, key->str())) return *found;
        return fallback ? *fallback : Value::none();
      });
    if (name == "update" || name == "pop" || name == "popitem" || name == "setdefault" || name == "clear")
      render_error(line, "dict." + name + " changes a value, which chat templates may not do (transformers renders them in "
                         "an immutable sandbox)");
  } else if (obj.kind == Value::Kind::list) {
    if (name == "append" || name == "extend" || name == "insert" || name == "pop" || name == "remove" || name == "clear" ||
        name == "sort" || name == "reverse")
      render_error(line, "list." + name + " changes a value, which chat templates may not do (transformers renders them in "
                         "an immutable sandbox)");
  }
  return Value();
}

// ---- filters ----------------------------------------------------------------------------------------------

Value Interp::apply_filter(const std::string& name, Value value, Call& call, const ScopePtr& scope) {
  const int line = call.line;
  Frame frame(*this, line);  // map('map', 'map', ...) recurses
  step(line, value.kind == Value::Kind::string ? int64_t(value.str().size() / 64) : 0);
  const std::string what = "filter '" + name + "'";
  auto text_of = [&](const Value& v) { return to_str(v); };
  if (name == "safe") {
    check_args(call, what, {});
    return value;
  }
  if (name == "default" || name == "d") {
    check_args(call, what, {"default_value", "boolean"});
    const Value* fallback = arg(call, 0, "default_value");
    const Value* boolean = arg(call, 1, "boolean");
    bool use = value.is_undefined() || (boolean && truthy(*boolean) && !truthy(value));
    return use ? (fallback ? *fallback : Value::string("")) : value;
  }
  if (name == "trim") {
    check_args(call, what, {"chars"});
    return Value::string(py_strip(text_of(value), arg(call, 0, "chars"), true, true));
  }
  if (name == "upper" || name == "lower") {
    check_args(call, what, {});
    return Value::string(name == "upper" ? ascii_upper(text_of(value)) : ascii_lower(text_of(value)));
  }
  if (name == "capitalize") {
    check_args(call, what, {});
    std::string text = ascii_lower(text_of(value));
    if (!text.empty()) text[0] = ascii_upper(text.substr(0, 1))[0];
    return Value::string(text);
  }
  if (name == "title") {  // jinja2: each word (split at whitespace, - ( { [ <) upper-cased first, lower-cased rest
    check_args(call, what, {});
    std::string text = text_of(value);
    bool word_start = true;
    for (char& ch : text) {
      bool separator = ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v' || ch == '-' ||
                       ch == '(' || ch == '{' || ch == '[' || ch == '<';
      if (separator) {
        word_start = true;
        continue;
      }
      ch = word_start ? ascii_upper(std::string(1, ch))[0] : ascii_lower(std::string(1, ch))[0];
      word_start = false;
    }
    return Value::string(text);
  }
  if (name == "replace") {
    check_args(call, what, {"old", "new", "count"});
    const Value* count = arg(call, 2, "count");
    return Value::string(replace(text_of(value), text_of(arg(call, 0, "old") ? *arg(call, 0, "old") : Value()),
                                 text_of(arg(call, 1, "new") ? *arg(call, 1, "new") : Value()),
                                 count && count->kind == Value::Kind::integer ? count->i : -1, line));
  }
  if (name == "string") {
    check_args(call, what, {});
    return Value::string(text_of(value));
  }
  if (name == "e" || name == "escape") {
    check_args(call, what, {});
    std::string out;
    for (char ch : text_of(value)) {
      switch (ch) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += ch;
      }
    }
    return Value::string(out);
  }
  if (name == "length" || name == "count") {
    check_args(call, what, {});
    return Value::integer(length(value, line));
  }
  if (name == "tojson") {
    check_args(call, what, {"indent", "ensure_ascii", "separators", "sort_keys"});
    const Value* indent = arg(call, 0, "indent");
    for (const char* option : {"ensure_ascii", "separators", "sort_keys"}) {
      const Value* given = arg(call, 9, option);
      if (given && truthy(*given)) render_error(line, std::string("tojson(") + option + "=...) is not in kvlite's subset");
    }
    int width = -1;
    if (indent && indent->kind == Value::Kind::integer) width = int(std::max<int64_t>(0, std::min<int64_t>(indent->i, 64)));
    else if (indent && indent->kind != Value::Kind::none) render_error(line, "tojson: indent must be an integer");
    std::string out;
    to_json(out, value, width, 0, line);
    check_size(out.size(), line);
    return Value::string(std::move(out));
  }
  if (name == "join") {
    check_args(call, what, {"d", "attribute"});
    const Value* separator = arg(call, 0, "d");
    const Value* attr = arg(call, 1, "attribute");
    std::string sep = separator ? text_of(*separator) : "";
    std::string out;
    bool first = true;
    for (const Value& item : iterate(value, line)) {
      if (!first) out += sep;
      out += text_of(attr ? attribute_path(item, *attr, line) : item);
      first = false;
      check_size(out.size(), line);
    }
    return Value::string(std::move(out));
  }
  if (name == "first" || name == "last") {
    check_args(call, what, {});
    List items = iterate(value, line);
    if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") {
    check_args(call, what, {});
    return Value::make_list(iterate(value, line));
  }
  if (name == "reverse") {
    check_args(call, what, {});
    if (value.kind == Value::Kind::string) {
      std::vector<uint32_t> cps = code_points(value.str());
      std::reverse(cps.begin(), cps.end());
      return Value::string(from_code_points(cps, 0, cps.size()));
    }
    List items = iterate(value, line);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "items") {
    check_args(call, what, {});
    if (value.is_undefined()) return Value::make_list({});
    if (value.kind != Value::Kind::dict) render_error(line, "filter 'items' needs a mapping, not " + type_name(value));
    List out;
    for (const auto& entry : *value.dict) out.push_back(Value::make_list({Value::string(entry.first), entry.second}, true));
    return Value::make_list(std::move(out));
  }
  if (name == "dictsort") {
    check_args(call, what, {"case_sensitive", "by", "reverse"});
    if (value.kind != Value::Kind::dict) render_error(line, "filter 'dictsort' needs a mapping");
    Dict entries = *value.dict;
    const Value* by = arg(call, 1, "by");
    bool by_value = by && by->kind == Value::Kind::string && by->str() == "value";
    const Value* reverse = arg(call, 2, "reverse");
    const Value* case_sensitive = arg(call, 0, "case_sensitive");
    bool fold = !(case_sensitive && truthy(*case_sensitive));
    auto key = [&](const std::pair<std::string, Value>& e) {
      Value k = by_value ? e.second : Value::string(e.first);
      if (fold && k.kind == Value::Kind::string) k = Value::string(ascii_lower(k.str()));
      return k;
    };
    std::stable_sort(entries.begin(), entries.end(), [&](const auto& a, const auto& b) { return compare(key(a), key(b), line) < 0; });
    if (reverse && truthy(*reverse)) std::reverse(entries.begin(), entries.end());
    List out;
    for (auto& entry : entries) out.push_back(Value::make_list({Value::string(entry.first), entry.second}, true));
    return Value::make_list(std::move(out));
  }
  if (name == "int") {
    check_args(call, what, {"default", "base"});
    const Value* fallback = arg(call, 0, "default");
    Value otherwise = fallback ? *fallback : Value::integer(0);
    if (value.kind == Value::Kind::integer) return value;
    if (value.kind == Value::Kind::boolean) return Value::integer(value.b);
    if (value.kind == Value::Kind::floating) {
      if (!std::isfinite(value.f) || std::fabs(value.f) >= 9.2e18) return otherwise;
      return Value::integer(int64_t(value.f));
    }
    if (value.kind == Value::Kind::string) {
      std::string text = py_strip(value.str(), nullptr, true, true);
      std::string digits;
      for (char ch : text) if (ch != '_') digits += ch;
      char* end = nullptr;
      errno = 0;
      long long parsed = strtoll(digits.c_str(), &end, 10);
      if (!digits.empty() && end && *end == 0 && errno == 0) return Value::integer(parsed);
      double f = strtod(digits.c_str(), &end);
      if (!digits.empty() && end && *end == 0 && std::isfinite(f) && std::fabs(f) < 9.2e18) return Value::integer(int64_t(f));
    }
    return otherwise;
  }
  if (name == "float") {
    check_args(call, what, {"default"});
    const Value* fallback = arg(call, 0, "default");
    Value otherwise = fallback ? *fallback : Value::floating(0.0);
    if (value.is_number()) return Value::floating(number(value));
    if (value.kind == Value::Kind::string) {
      std::string text = py_strip(value.str(), nullptr, true, true);
      char* end = nullptr;
      double f = strtod(text.c_str(), &end);
      if (!text.empty() && end && *end == 0) return Value::floating(f);
    }
    return otherwise;
  }
  if (name == "abs") {
    check_args(call, what, {});
    if (value.kind == Value::Kind::floating) return Value::floating(std::fabs(value.f));
    if (value.kind == Value::Kind::integer) {
      if (value.i == INT64_MIN) render_error(line, "integer overflow in abs");
      return Value::integer(value.i < 0 ? -value.i : value.i);
    }
    if (value.kind == Value::Kind::boolean) return Value::integer(value.b);
    render_error(line, "bad operand type for abs(): '" + type_name(value) + "'");
  }
  if (name == "round") {
    check_args(call, what, {"precision", "method"});
    const Value* precision_value = arg(call, 0, "precision");
    const Value* method_value = arg(call, 1, "method");
    int64_t precision = precision_value && precision_value->kind == Value::Kind::integer ? precision_value->i : 0;
    std::string method = method_value && method_value->kind == Value::Kind::string ? method_value->str() : "common";
    if (!value.is_number()) render_error(line, "filter 'round' needs a number");
    if (method != "common" && method != "ceil" && method != "floor") render_error(line, "filter 'round': method must be common, ceil or floor");
    double x = number(value), scale = std::pow(10.0, double(std::max<int64_t>(-300, std::min<int64_t>(precision, 300))));
    double r = method == "ceil" ? std::ceil(x * scale) / scale : method == "floor" ? std::floor(x * scale) / scale
                                                                                    : std::nearbyint(x * scale) / scale;  // half to even, as Python's round()
    return Value::floating(r);
  }
  if (name == "unique") {
    check_args(call, what, {"case_sensitive", "attribute"});
    const Value* case_sensitive = arg(call, 0, "case_sensitive");
    const Value* attr = arg(call, 1, "attribute");
    bool fold = !(case_sensitive && truthy(*case_sensitive));
    List out, seen;
    for (const Value& item : iterate(value, line)) {
      Value key = attr ? attribute_path(item, *attr, line) : item;
      if (fold && key.kind == Value::Kind::string) key = Value::string(ascii_lower(key.str()));
      bool duplicate = false;
      for (const Value& s : seen) {
        step(line);
        if (equal(s, key)) { duplicate = true; break; }
      }
      if (!duplicate) seen.push_back(key), out.push_back(item);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "sort") {
    check_args(call, what, {"reverse", "case_sensitive", "attribute"});
    const Value* reverse = arg(call, 0, "reverse");
    const Value* case_sensitive = arg(call, 1, "case_sensitive");
    const Value* attr = arg(call, 2, "attribute");
    bool fold = !(case_sensitive && truthy(*case_sensitive));
    List items = iterate(value, line);
    step(line, int64_t(items.size()) * 20);
    auto key = [&](const Value& item) {
      Value k = attr ? attribute_path(item, *attr, line) : item;
      if (fold && k.kind == Value::Kind::string) k = Value::string(ascii_lower(k.str()));
      return k;
    };
    bool descending = reverse && truthy(*reverse);
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      int c = compare(key(a), key(b), line);
      return descending ? c > 0 : c < 0;
    });
    return Value::make_list(std::move(items));
  }
  if (name == "min" || name == "max") {
    check_args(call, what, {"case_sensitive", "attribute"});
    List items = iterate(value, line);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    const Value* attr = arg(call, 1, "attribute");
    const Value* case_sensitive = arg(call, 0, "case_sensitive");
    bool fold = !(case_sensitive && truthy(*case_sensitive));
    auto key = [&](const Value& item) {
      Value k = attr ? attribute_path(item, *attr, line) : item;
      if (fold && k.kind == Value::Kind::string) k = Value::string(ascii_lower(k.str()));
      return k;
    };
    size_t best = 0;
    for (size_t k = 1; k < items.size(); k++) {
      int c = compare(key(items[k]), key(items[best]), line);
      if (name == "min" ? c < 0 : c > 0) best = k;
    }
    return items[best];
  }
  if (name == "sum") {
    check_args(call, what, {"attribute", "start"});
    const Value* attr = arg(call, 0, "attribute");
    const Value* start = arg(call, 1, "start");
    Value total = start ? *start : Value::integer(0);
    for (const Value& item : iterate(value, line)) total = arithmetic("+", total, attr ? attribute_path(item, *attr, line) : item, line);
    return total;
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    bool by_attr = name == "selectattr" || name == "rejectattr";
    bool keep_matching = name == "selectattr" || name == "select";
    size_t first_test_arg = by_attr ? 1 : 0;
    if (by_attr && (call.args.empty() || call.args[0].kind != Value::Kind::string))
      render_error(line, what + " needs the attribute name first");
    std::string test_name;
    if (call.args.size() > first_test_arg) {
      if (call.args[first_test_arg].kind != Value::Kind::string) render_error(line, what + ": the test must be named by a string");
      test_name = call.args[first_test_arg].str();
      if (!known(kTests, sizeof kTests / sizeof *kTests, test_name))
        fail(ErrorCode::unsupported, format("chat template line %d: the test '%s' is not in kvlite's Jinja subset", line, test_name.c_str()));
    }
    Call test_call;
    test_call.line = line;
    for (size_t k = first_test_arg + 1; k < call.args.size(); k++) test_call.args.push_back(call.args[k]);
    test_call.kwargs = call.kwargs;
    List out;
    for (const Value& item : iterate(value, line)) {
      step(line);
      Value subject = by_attr ? attribute_path(item, call.args[0], line) : item;
      bool passes = test_name.empty() ? truthy(subject) : apply_test(test_name, subject, test_call);
      if (passes == keep_matching) out.push_back(item);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "map") {
    const Value* attr = arg(call, 99, "attribute");
    List out;
    if (attr) {
      check_args(call, what, {"attribute", "default"});
      const Value* fallback = arg(call, 99, "default");
      for (const Value& item : iterate(value, line)) {
        Value v = attribute_path(item, *attr, line);
        out.push_back(v.is_undefined() && fallback ? *fallback : v);
      }
    } else {
      if (call.args.empty() || call.args[0].kind != Value::Kind::string) render_error(line, "filter 'map' needs a filter name or attribute=");
      std::string filter = call.args[0].str();
      if (!known(kFilters, sizeof kFilters / sizeof *kFilters, filter))
        fail(ErrorCode::unsupported, format("chat template line %d: the filter '%s' is not in kvlite's Jinja subset", line, filter.c_str()));
      Call inner;
      inner.line = line;
      inner.args.assign(call.args.begin() + 1, call.args.end());
      inner.kwargs = call.kwargs;
      for (const Value& item : iterate(value, line)) {
        Call copy = inner;
        out.push_back(apply_filter(filter, item, copy, scope));
      }
    }
    return Value::make_list(std::move(out));
  }
  if (name == "indent") {
    check_args(call, what, {"width", "first", "blank"});
    const Value* width_value = arg(call, 0, "width");
    const Value* first = arg(call, 1, "first");
    const Value* blank = arg(call, 2, "blank");
    std::string pad = width_value && width_value->kind == Value::Kind::string ? width_value->str()
                      : std::string(size_t(std::max<int64_t>(0, std::min<int64_t>(width_value && width_value->kind == Value::Kind::integer ? width_value->i : 4, 1024))), ' ');
    std::string text = text_of(value), out;
    std::vector<std::string> lines;
    size_t start = 0;
    for (size_t k = 0; k <= text.size(); k++)
      if (k == text.size() || text[k] == '\n') lines.push_back(text.substr(start, k - start)), start = k + 1;
    for (size_t k = 0; k < lines.size(); k++) {
      if (k) out += '\n';
      bool indent_this = (k > 0 || (first && truthy(*first))) && (!lines[k].empty() || (blank && truthy(*blank)));
      if (indent_this) out += pad;
      out += lines[k];
      check_size(out.size(), line);
    }
    return Value::string(out);
  }
  fail(ErrorCode::unsupported, format("chat template line %d: the filter '%s' is not in kvlite's Jinja subset", line, name.c_str()));
}

bool Interp::apply_test(const std::string& name, const Value& value, Call& call) {
  const int line = call.line;
  auto operand = [&]() -> const Value& {
    if (call.args.empty()) render_error(line, "the test '" + name + "' needs an argument");
    return call.args[0];
  };
  using K = Value::Kind;
  if (name == "defined") return !value.is_undefined();
  if (name == "undefined") return value.is_undefined();
  if (name == "none") return value.kind == K::none;
  if (name == "string") return value.kind == K::string;
  if (name == "mapping") return value.kind == K::dict;
  if (name == "sequence") return value.kind == K::string || value.kind == K::list || value.kind == K::dict;
  if (name == "iterable") return value.kind == K::string || value.kind == K::list || value.kind == K::dict || value.kind == K::undefined;
  if (name == "number") return value.is_number();
  if (name == "integer") return value.kind == K::integer;
  if (name == "float") return value.kind == K::floating;
  if (name == "boolean") return value.kind == K::boolean;
  if (name == "true") return value.kind == K::boolean && value.b;
  if (name == "false") return value.kind == K::boolean && !value.b;
  if (name == "callable") return value.kind == K::callable;
  if (name == "lower" || name == "upper") {
    std::string text = to_str(value);
    return text == (name == "lower" ? ascii_lower(text) : ascii_upper(text));
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (value.is_undefined()) undefined_error(value, line);
    if (value.kind != K::integer && value.kind != K::boolean) render_error(line, "the test '" + name + "' needs an integer");
    int64_t x = value.kind == K::integer ? value.i : value.b;
    if (name == "odd") return x % 2 != 0;
    if (name == "even") return x % 2 == 0;
    const Value& d = operand();
    if (d.kind != K::integer || d.i == 0) render_error(line, "divisibleby needs a non-zero integer");
    if (d.i == -1) return true;
    return x % d.i == 0;
  }
  if (name == "equalto" || name == "eq" || name == "==") return equal(value, operand());
  if (name == "ne" || name == "!=") return !equal(value, operand());
  if (name == "sameas") {
    const Value& other = operand();
    if (value.kind != other.kind) return false;
    if (value.kind == K::none || value.kind == K::undefined) return value.kind == K::none;
    if (value.kind == K::boolean) return value.b == other.b;
    if (value.kind == K::list) return value.list == other.list;
    if (value.kind == K::dict || value.kind == K::ns) return value.dict == other.dict;
    return false;
  }
  if (name == "lt" || name == "<") return compare(value, operand(), line) < 0;
  if (name == "le" || name == "<=") return compare(value, operand(), line) <= 0;
  if (name == "gt" || name == ">") return compare(value, operand(), line) > 0;
  if (name == "ge" || name == ">=") return compare(value, operand(), line) >= 0;
  if (name == "in") {
    const Value& container = operand();
    switch (container.kind) {
      case K::string:
        if (value.kind != K::string) render_error(line, "'in <string>' requires string as left operand, not " + type_name(value));
        step(line, int64_t(container.str().size() / 64));
        return container.str().find(value.str()) != std::string::npos;
      case K::list:
        for (const Value& item : *container.list) {
          step(line);
          if (equal(item, value)) return true;
        }
        return false;
      case K::dict:
        return value.kind == K::string && dict_find(*container.dict, value.str()) != nullptr;
      case K::undefined:
        return false;
      default:
        render_error(line, "argument of type '" + type_name(container) + "' is not iterable");
    }
  }
  fail(ErrorCode::unsupported, format("chat template line %d: the test '%s' is not in kvlite's Jinja subset", line, name.c_str()));
}

// The filters of a block set or filter block (`| f | g`, parsed innermost first) over `value`.
Value Interp::apply_filter_chain(const Expr& chain, Value value, const ScopePtr& scope) {
  std::vector<const Expr*> filters;
  for (const Expr* f = &chain; f; f = f->children[0].get()) filters.push_back(f);
  for (size_t k = filters.size(); k-- > 0;) {
    Call call;
    call.line = filters[k]->line;
    for (size_t a = 1; a < filters[k]->children.size(); a++) call.args.push_back(eval(*filters[k]->children[a], scope));
    for (const auto& kw : filters[k]->kwargs) call.kwargs.emplace_back(kw.first, eval(*kw.second, scope));
    value = apply_filter(filters[k]->name, value, call, scope);
  }
  return value;
}

LoopSignal Interp::exec(const Body& body, const ScopePtr& scope) {
  Frame frame(*this, body.empty() ? 0 : body[0]->line);
  for (const NodePtr& node_ptr : body) {
    const Node& node = *node_ptr;
    step(node.line);
    switch (node.kind) {
      case Node::Kind::text: emit(node.text, node.line); break;
      case Node::Kind::output: emit(to_str(eval(*node.expr, scope)), node.line); break;
      case Node::Kind::if_: {
        const Body* chosen = &node.else_body;
        for (const auto& branch : node.branches)
          if (truthy(eval(*branch.first, scope))) {
            chosen = &branch.second;
            break;
          }
        LoopSignal signal = exec(*chosen, scope);
        if (signal.kind != LoopSignal::Kind::none) return signal;
        break;
      }
      case Node::Kind::for_: {
        LoopSignal signal = exec_for(node, scope);
        if (signal.kind != LoopSignal::Kind::none) return signal;
        break;
      }
      case Node::Kind::set: {
        Value value = eval(*node.expr, scope);
        if (!node.attr.empty()) {
          const Value* target = scope->find(node.targets[0]);
          if (!target || target->kind != Value::Kind::ns)
            render_error(node.line, "can only set attributes on a namespace ('" + node.targets[0] + "' is not one)");
          if (!node.attr.empty() && node.attr[0] == '_')
            render_error(node.line, "chat templates cannot store underscore-prefixed attributes on a namespace");
          Dict& dict = *target->dict;
          bool replaced = false;
          for (auto& entry : dict)
            if (entry.first == node.attr) entry.second = value, replaced = true;
          if (!replaced) dict.emplace_back(node.attr, value);
        } else if (node.targets.size() == 1) {
          scope->set(node.targets[0], std::move(value));
        } else {
          List items = iterate(value, node.line);
          if (items.size() != node.targets.size())
            render_error(node.line, format("cannot unpack %zu values into %zu names", items.size(), node.targets.size()));
          for (size_t k = 0; k < items.size(); k++) scope->set(node.targets[k], items[k]);
        }
        break;
      }
      case Node::Kind::set_block: {
        Value text = Value::string(capture(node.body, scope));
        if (node.expr) text = apply_filter_chain(*node.expr, text, scope);
        scope->set(node.targets[0], text);
        break;
      }
      case Node::Kind::filter_block: {
        Value value = apply_filter_chain(*node.expr, Value::string(capture(node.body, scope)), scope);
        emit(to_str(value), node.line);
        break;
      }
      case Node::Kind::macro: scope->set(node.text, make_macro(node, scope)); break;
      case Node::Kind::call_block: {
        // caller(): renders the block, in the scope it was written in, with its own parameters.
        const Node* block = &node;
        ScopePtr where = scope;
        Value caller;
        caller.kind = Value::Kind::callable;
        caller.fn = std::make_shared<const Callable>(Callable{"caller", [block, where](Interp& in, Call& c) {
          auto local = std::make_shared<Scope>();
          local->parent = where;
          for (size_t k = 0; k < block->params.size(); k++) {
            const Value* given = arg(c, k, block->params[k].first.c_str());
            local->set(block->params[k].first, given ? *given : block->params[k].second ? in.eval(*block->params[k].second, where)
                                                                                        : Value::undefined("'" + block->params[k].first + "' is undefined"));
          }
          return Value::string(in.capture(block->body, local));
        }});
        const Expr& call_expr = *node.expr;
        Call call;
        call.line = call_expr.line;
        Value callee = eval(*call_expr.children[0], scope);
        for (size_t k = 1; k < call_expr.children.size(); k++) call.args.push_back(eval(*call_expr.children[k], scope));
        for (const auto& kw : call_expr.kwargs) call.kwargs.emplace_back(kw.first, eval(*kw.second, scope));
        call.kwargs.emplace_back("caller", caller);
        emit(to_str(call_value(callee, call, "the called macro")), node.line);
        break;
      }
      case Node::Kind::generation: {
        LoopSignal signal = exec(node.body, scope);
        if (signal.kind != LoopSignal::Kind::none) return signal;
        break;
      }
      case Node::Kind::break_: return {LoopSignal::Kind::break_};
      case Node::Kind::continue_: return {LoopSignal::Kind::continue_};
    }
  }
  return {};
}

LoopSignal Interp::exec_for(const Node& node, const ScopePtr& scope) {
  Value iterable = eval(*node.expr, scope);
  List all = iterate(iterable, node.line);
  // `for x in seq if cond`: the condition sees each item in a scope of its own; loop.* counts what passes.
  List items;
  if (node.condition) {
    for (const Value& item : all) {
      step(node.line);
      auto probe = std::make_shared<Scope>();
      probe->parent = scope;
      if (node.targets.size() == 1) {
        probe->set(node.targets[0], item);
      } else {
        List parts = iterate(item, node.line);
        if (parts.size() != node.targets.size())
          render_error(node.line, format("cannot unpack %zu values into %zu loop variables", parts.size(), node.targets.size()));
        for (size_t k = 0; k < parts.size(); k++) probe->set(node.targets[k], parts[k]);
      }
      if (truthy(eval(*node.condition, probe))) items.push_back(item);
    }
  } else {
    items = std::move(all);
  }
  if (items.empty()) {
    exec(node.else_body, scope);
    return {};
  }
  const int64_t n = int64_t(items.size());
  auto shared_items = std::make_shared<const List>(items);
  for (int64_t k = 0; k < n; k++) {
    step(node.line);
    auto local = std::make_shared<Scope>();
    local->parent = scope;
    const Value& item = items[size_t(k)];
    if (node.targets.size() == 1) {
      local->set(node.targets[0], item);
    } else {
      List parts = iterate(item, node.line);
      if (parts.size() != node.targets.size())
        render_error(node.line, format("cannot unpack %zu values into %zu loop variables", parts.size(), node.targets.size()));
      for (size_t p = 0; p < parts.size(); p++) local->set(node.targets[p], parts[p]);
    }
    Dict loop;
    loop.emplace_back("index", Value::integer(k + 1));
    loop.emplace_back("index0", Value::integer(k));
    loop.emplace_back("revindex", Value::integer(n - k));
    loop.emplace_back("revindex0", Value::integer(n - k - 1));
    loop.emplace_back("first", Value::boolean(k == 0));
    loop.emplace_back("last", Value::boolean(k == n - 1));
    loop.emplace_back("length", Value::integer(n));
    loop.emplace_back("depth", Value::integer(1));
    loop.emplace_back("depth0", Value::integer(0));
    loop.emplace_back("previtem", k > 0 ? items[size_t(k - 1)] : Value::undefined("there is no previous item"));
    loop.emplace_back("nextitem", k + 1 < n ? items[size_t(k + 1)] : Value::undefined("there is no next item"));
    Value cycle;
    cycle.kind = Value::Kind::callable;
    cycle.fn = std::make_shared<const Callable>(Callable{"loop.cycle", [k](Interp&, Call& c) {
      if (c.args.empty()) render_error(c.line, "loop.cycle needs at least one value");
      return c.args[size_t(k) % c.args.size()];
    }});
    loop.emplace_back("cycle", cycle);
    Value loop_value;
    loop_value.kind = Value::Kind::ns;  // printed as an object, not serializable, like jinja2's LoopContext
    loop_value.dict = std::make_shared<Dict>(std::move(loop));
    local->set("loop", loop_value);
    LoopSignal signal = exec(node.body, local);
    if (signal.kind == LoopSignal::Kind::break_) break;
  }
  return {};
}

Value Interp::make_macro(const Node& node, const ScopePtr& defined_in) {
  const Node* macro = &node;
  std::weak_ptr<Scope> home = defined_in;  // the scope holds the macro: a strong pointer would be a cycle
  Value v;
  v.kind = Value::Kind::callable;
  v.fn = std::make_shared<const Callable>(Callable{node.text, [macro, home](Interp& in, Call& c) {
    ScopePtr where = home.lock();
    if (!where) render_error(c.line, "macro '" + macro->text + "' is called after its scope ended");
    auto local = std::make_shared<Scope>();
    local->parent = where;
    if (c.args.size() > macro->params.size())
      render_error(c.line, format("macro '%s' takes not more than %zu argument(s)", macro->text.c_str(), macro->params.size()));
    for (size_t k = 0; k < macro->params.size(); k++) {
      const std::string& name = macro->params[k].first;
      const Value* given = nullptr;
      if (k < c.args.size()) given = &c.args[k];
      for (const auto& kw : c.kwargs)
        if (kw.first == name) given = &kw.second;
      if (given) local->set(name, *given);
      else if (macro->params[k].second) local->set(name, in.eval(*macro->params[k].second, local));
      else local->set(name, Value::undefined("parameter '" + name + "' was not provided"));
    }
    bool has_caller = false;
    for (const auto& kw : c.kwargs) {
      bool is_param = false;
      for (const auto& p : macro->params) is_param |= p.first == kw.first;
      if (kw.first == "caller") {
        local->set("caller", kw.second);
        has_caller = true;
      } else if (!is_param) {
        render_error(c.line, "macro '" + macro->text + "' takes no keyword argument '" + kw.first + "'");
      }
    }
    (void)has_caller;
    return Value::string(in.capture(macro->body, local));
  }});
  return v;
}

// Python's str.replace (an empty `from` inserts `to` around every character).
std::string Interp::replace(const std::string& s, const std::string& from, const std::string& to, int64_t limit, int line) {
  std::string out;
  int64_t done = 0;
  if (from.empty()) {
    std::vector<uint32_t> cps = code_points(s);
    for (size_t k = 0; k <= cps.size(); k++) {
      if (limit < 0 || done < limit) out += to, done++;
      if (k < cps.size()) append_utf8(out, cps[k]);
      check_size(out.size(), line);
    }
    return out;
  }
  size_t start = 0;
  for (;;) {
    size_t at = (limit >= 0 && done >= limit) ? std::string::npos : s.find(from, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += to;
    check_size(out.size(), line);
    start = at + from.size();
    done++;
  }
  out.append(s, start, std::string::npos);
  check_size(out.size(), line);
  step(line, int64_t(out.size() / 4096));
  return out;
}

// attribute= arguments: "a.b" walks attributes, an integer indexes.
Value Interp::attribute_path(const Value& item, const Value& path, int line) {
  Interp& in = *this;
  if (path.kind == Value::Kind::integer) return in.item(item, path, line);
  if (path.kind != Value::Kind::string) render_error(line, "attribute= must be a string");
  Value current = item;
  size_t start = 0;
  const std::string& p = path.str();
  for (;;) {
    size_t dot = p.find('.', start);
    std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (current.is_undefined()) return current;
    current = numeric ? in.item(current, Value::integer(atoll(part.c_str())), line) : in.item(current, Value::string(part), line);
    if (dot == std::string::npos) return current;
    start = dot + 1;
  }
}

// ---- globals and the entry points -------------------------------------------------------------------------
Value builtin(const char* name, std::function<Value(Interp&, Call&)> run) {
  Value v;
  v.kind = Value::Kind::callable;
  v.fn = std::make_shared<const Callable>(Callable{name, std::move(run)});
  return v;
}

// The globals jinja2 and transformers give every chat template: range, dict, namespace, raise_exception,
// strftime_now.
void add_globals(Scope& globals) {
  globals.set("range", builtin("range", [](Interp& in, Call& c) {
    if (c.args.empty() || c.args.size() > 3 || !c.kwargs.empty()) render_error(c.line, "range takes 1 to 3 integers");
    int64_t v[3] = {0, 0, 1};
    for (size_t k = 0; k < c.args.size(); k++) {
      if (c.args[k].kind != Value::Kind::integer) render_error(c.line, "range takes integers");
      v[k] = c.args[k].i;
    }
    int64_t start = c.args.size() == 1 ? 0 : v[0], stop = c.args.size() == 1 ? v[0] : v[1], by = c.args.size() == 3 ? v[2] : 1;
    if (by == 0) render_error(c.line, "range() arg 3 must not be zero");
    long double span = by > 0 ? (long double)stop - (long double)start : (long double)start - (long double)stop;
    long double count = span <= 0 ? 0 : std::ceil(span / std::fabs((long double)by));
    in.charge_items(c.line, count > 1e18L ? uint64_t(1e18) : uint64_t(count));
    List items;
    for (int64_t x = start; by > 0 ? x < stop : x > stop; x += by) {
      in.step(c.line);
      items.push_back(Value::integer(x));
      if ((by > 0 && x > INT64_MAX - by) || (by < 0 && x < INT64_MIN - by)) break;
    }
    return Value::make_list(std::move(items));
  }));
  globals.set("dict", builtin("dict", [](Interp&, Call& c) {
    Dict items;
    if (!c.args.empty()) {
      if (c.args.size() > 1 || c.args[0].kind != Value::Kind::dict) render_error(c.line, "kvlite's dict() takes a mapping and keywords");
      items = *c.args[0].dict;
    }
    for (const auto& kw : c.kwargs) {
      bool replaced = false;
      for (auto& entry : items)
        if (entry.first == kw.first) entry.second = kw.second, replaced = true;
      if (!replaced) items.push_back(kw);
    }
    return Value::make_dict(std::move(items));
  }));
  globals.set("namespace", builtin("namespace", [](Interp&, Call& c) {
    Dict items;
    if (!c.args.empty()) {
      if (c.args.size() > 1 || c.args[0].kind != Value::Kind::dict) render_error(c.line, "namespace() takes a mapping and keywords");
      items = *c.args[0].dict;
    }
    for (const auto& kw : c.kwargs) {
      bool replaced = false;
      for (auto& entry : items)
        if (entry.first == kw.first) entry.second = kw.second, replaced = true;
      if (!replaced) items.push_back(kw);
    }
    for (const auto& entry : items)
      if (!entry.first.empty() && entry.first[0] == '_')
        render_error(c.line, "chat templates cannot store underscore-prefixed attributes on a namespace");
    return Value::make_dict(std::move(items), Value::Kind::ns);
  }));
  globals.set("raise_exception", builtin("raise_exception", [](Interp&, Call& c) -> Value {
    std::string message = c.args.empty() ? std::string() : to_str(c.args[0]);
    fail(ErrorCode::invalid_argument, format("chat template line %d: raise_exception: %s", c.line, message.c_str()));
  }));
  globals.set("strftime_now", builtin("strftime_now", [](Interp& in, Call& c) {
    if (c.args.size() != 1 || c.args[0].kind != Value::Kind::string) render_error(c.line, "strftime_now takes a format string");
    const std::string& pattern = c.args[0].str();
    if (pattern.size() > 256) render_error(c.line, "strftime_now: the format is longer than 256 bytes");
    time_t now = in.now >= 0 ? time_t(in.now) : time(nullptr);
    struct tm local;
    localtime_r(&now, &local);
    char buffer[1024];
    size_t n = pattern.empty() ? 0 : strftime(buffer, sizeof buffer, pattern.c_str(), &local);
    return Value::string(std::string(buffer, n));
  }));
}

std::shared_ptr<const Template> parse_template(std::string_view source) {
  if (source.size() > uint64_t(limits::max_template_bytes))
    fail(ErrorCode::invalid_argument, format("the chat template is %zu bytes, more than kvlite's limit of %lld "
                                             "(KVLITE_MAX_TEMPLATE_BYTES)", source.size(), (long long)limits::max_template_bytes));
  if (size_t bad = utf8_invalid_at(source); bad != std::string_view::npos)
    fail(ErrorCode::bad_format, format("the chat template is not valid UTF-8 (at byte %zu)", bad));
  Lexer lexer(normalize_newlines(source));
  Parser parser(lexer.run());
  return std::make_shared<const Template>(parser.run());
}

std::string render_template(const Template& tpl, const Dict& variables, int64_t now) {
  auto globals = std::make_shared<Scope>();
  add_globals(*globals);
  auto root = std::make_shared<Scope>();
  root->parent = globals;
  for (const auto& v : variables) root->set(v.first, v.second);
  Interp in;
  in.now = now;
  std::string out;
  in.out = &out;
  in.exec(tpl.body, root);
  return out;
}

}  // namespace jinja
}  // namespace detail

Result<ChatTemplate> ChatTemplate::parse(std::string_view source) {
  return detail::guard([&] {
    ChatTemplate tpl;
    tpl.template_ = detail::jinja::parse_template(source);
    return tpl;
  });
}

Result<std::string> ChatTemplate::render(std::string_view context_json) const {
  return detail::guard([&] {
    if (!template_) detail::fail(ErrorCode::invalid_argument, "render() on an empty ChatTemplate");
    if (context_json.size() > uint64_t(limits::max_json_bytes))
      detail::fail(ErrorCode::invalid_argument, detail::format("the template variables are %zu bytes of JSON, more than "
                                                               "KVLITE_MAX_JSON_BYTES", context_json.size()));
    detail::check_json_nesting(context_json, "the template variables");
    nlohmann::ordered_json context;
    try {
      context = nlohmann::ordered_json::parse(context_json);
    } catch (const nlohmann::ordered_json::exception& e) {
      detail::fail(ErrorCode::invalid_argument, std::string("the template variables are not valid JSON: ") + e.what());
    }
    if (!context.is_object()) detail::fail(ErrorCode::invalid_argument, "the template variables must be a JSON object");
    detail::jinja::Value variables = detail::jinja::from_json(context);
    return detail::jinja::render_template(*template_, *variables.dict, now_);
  });
}

}  // namespace kvlite
