// grammar: GBNF parsing, the recognizer, vocabulary masks against a token-by-token check, the JSON-schema
// compiler against an independent validator (and std::regex for patterns), and constrained generation on the
// random-weight fixture: every output valid against its schema.
#include <doctest/doctest.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine_helpers.hpp"
#include "kvlite.hpp"

using namespace kvlite;
using json = nlohmann::json;

namespace {

std::shared_ptr<const Grammar> must_parse(const std::string& gbnf) {
  auto g = Grammar::parse(gbnf);
  if (!g) FAIL(g.error().message << "\n" << gbnf);
  return *g;
}

// Whether the whole text is a sentence of the grammar.
bool accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.accept(text) && m.complete();
}

// Whether the text can start a sentence.
bool prefix_ok(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.accept(text);
}

// A random sentence: at each step one of the bytes that keep a stack alive, ending with probability 1/4 where
// the sentence may end (and always within max_bytes when possible); "" with ok=false if it got stuck.
std::string random_sentence(const std::shared_ptr<const Grammar>& g, std::mt19937_64& rng, size_t max_bytes, bool& ok) {
  GrammarMatcher m(g);
  std::string out;
  // candidate bytes: printable ASCII and a few UTF-8 lead/continuation bytes
  std::vector<uint8_t> candidates;
  for (int c = 0x20; c < 0x7F; c++) candidates.push_back(uint8_t(c));
  for (int c : {0x0A, 0xC3, 0xA9, 0xE2, 0x82, 0xAC}) candidates.push_back(uint8_t(c));
  while (true) {
    if (m.complete() && (out.size() >= max_bytes || !m.can_continue() || rng() % 4 == 0)) {
      ok = true;
      return out;
    }
    std::vector<uint8_t> allowed;
    for (uint8_t c : candidates) {
      GrammarState next;
      if (GrammarMatcher::advance(m.grammar(), m.state(), std::string(1, char(c)), next)) allowed.push_back(c);
    }
    if (allowed.empty() || out.size() > max_bytes * 4) {
      ok = m.complete();
      return out;
    }
    // past the budget, prefer bytes that close things: the ones after which the sentence is complete
    uint8_t pick = allowed[rng() % allowed.size()];
    if (out.size() >= max_bytes)
      for (uint8_t c : {'"', '}', ']', '0', '1', 'e', 'l'})
        if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) {
          pick = c;
          break;
        }
    m.accept(std::string(1, char(pick)));
    out += char(pick);
  }
}

// ---- an independent validator for the schema subset the compiler supports -------------------------------
struct Validator {
  const json& root;
  std::string why;
  bool fail(const std::string& what) {
    why = what;
    return false;
  }
  const json& resolve(const std::string& ref) {
    if (ref == "#") return root;
    const std::string defs = ref.rfind("#/$defs/", 0) == 0 ? "$defs" : "definitions";
    return root[defs][ref.substr(ref.find('/', 2) + 1)];
  }
  static size_t code_points(const std::string& s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
  }
  bool check(const json& v, const json& s) {
    if (s.is_boolean()) return s.get<bool>() || fail("false schema");
    if (s.contains("$ref")) return check(v, resolve(s["$ref"]));
    if (s.contains("const") && v != s["const"]) return fail("const");
    if (s.contains("enum")) {
      bool found = false;
      for (const json& e : s["enum"]) found = found || e == v;
      if (!found) return fail("enum");
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        int matches = 0;
        for (const json& option : s[key]) {
          json merged = option;
          for (auto it = s.begin(); it != s.end(); ++it)
            if (it.key() != key && !merged.contains(it.key())) merged[it.key()] = it.value();
          Validator inner{root, ""};
          matches += inner.check(v, merged);
        }
        if (matches == 0) return fail(key);
        return true;
      }
    if (s.contains("allOf") && !check(v, s["allOf"][0])) return false;
    if (s.contains("type")) {
      std::vector<std::string> types;
      if (s["type"].is_string()) types.push_back(s["type"]);
      else for (const json& t : s["type"]) types.push_back(t);
      bool typed = false;
      for (const std::string& t : types)
        typed = typed || (t == "string" && v.is_string()) || (t == "integer" && v.is_number_integer()) ||
                (t == "number" && v.is_number()) || (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null()) ||
                (t == "object" && v.is_object()) || (t == "array" && v.is_array());
      if (!typed) return fail("type " + s["type"].dump() + " for " + v.dump());
    }
    if (v.is_string()) {
      const std::string text = v;
      if (s.contains("minLength") && code_points(text) < s["minLength"].get<size_t>()) return fail("minLength");
      if (s.contains("maxLength") && code_points(text) > s["maxLength"].get<size_t>()) return fail("maxLength");
      if (s.contains("pattern") && !std::regex_search(text, std::regex(s["pattern"].get<std::string>(), std::regex::ECMAScript)))
        return fail("pattern " + s["pattern"].get<std::string>() + " on " + text);
      if (s.contains("format")) {
        static const std::map<std::string, std::string> formats = {
            {"date", R"(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$)"},
            {"time", R"(^([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$)"},
            {"date-time", R"(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$)"},
            {"uuid", R"(^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$)"},
            {"email", R"(^[^@\s]+@[^@\s]+\.[^@\s]+$)"}};
        if (!std::regex_search(text, std::regex(formats.at(s["format"])))) return fail("format " + s["format"].get<std::string>() + " on " + text);
      }
    }
    if (v.is_number_integer()) {
      const double x = v.get<double>();
      if (s.contains("minimum") && x < s["minimum"].get<double>()) return fail("minimum");
      if (s.contains("maximum") && x > s["maximum"].get<double>()) return fail("maximum");
      if (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) return fail("exclusiveMinimum");
      if (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()) return fail("exclusiveMaximum");
    }
    if (v.is_array()) {
      if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return fail("minItems");
      if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return fail("maxItems");
      size_t first_item = 0;  // items applies past prefixItems
      if (s.contains("prefixItems")) {
        first_item = s["prefixItems"].size();
        for (size_t i = 0; i < v.size() && i < first_item; i++)
          if (!check(v[i], s["prefixItems"][i])) return false;
      }
      if (s.contains("items"))
        for (size_t i = first_item; i < v.size(); i++)
          if (!check(v[i], s["items"])) return false;
    }
    if (v.is_object()) {
      const json props = s.value("properties", json::object());
      if (s.contains("required"))
        for (const json& r : s["required"])
          if (!v.contains(r.get<std::string>())) return fail("required " + r.get<std::string>());
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (props.contains(it.key())) {
          if (!check(it.value(), props[it.key()])) return false;
        } else if (s.contains("additionalProperties")) {
          const json& extra = s["additionalProperties"];
          if (extra.is_boolean() && !extra.get<bool>()) return fail("additional property " + it.key());
          if (extra.is_object() && !check(it.value(), extra)) return false;
        }
      }
    }
    return true;
  }
};

bool valid_against(const std::string& text, const json& schema, std::string& why) {
  json value;
  try {
    value = json::parse(text);
  } catch (const json::exception& e) {
    why = std::string("not JSON: ") + e.what();
    return false;
  }
  Validator v{schema, ""};
  const bool ok = v.check(value, schema);
  why = v.why;
  return ok;
}

// The suite: schemas of the shapes apps and robots ask for.
std::vector<std::string> schema_suite() {
  return {
      R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]})",
      R"({"type": "object", "properties": {"shapes": {"type": "array", "items": {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle"]}, "color": {"enum": ["red", "green", "blue", "yellow"]}, "size": {"enum": ["small", "large"]}}, "required": ["shape", "color", "size"]}, "minItems": 1, "maxItems": 3}}, "required": ["shapes"]})",
      R"({"type": "boolean"})",
      R"({"type": "object"})",
      R"({"type": "array", "maxItems": 4})",
      R"({})",
      R"({"type": "integer", "minimum": 0, "maximum": 100})",
      R"({"type": "integer", "minimum": -40, "maximum": 125})",
      R"({"type": "integer", "exclusiveMinimum": 7, "exclusiveMaximum": 1000})",
      R"({"type": "number"})",
      R"({"type": "null"})",
      R"({"enum": ["pick", "place", "move", "stop", 42, null, true]})",
      R"({"const": {"ok": true}})",
      R"({"type": "string", "maxLength": 12})",
      R"({"type": "string", "minLength": 3, "maxLength": 5})",
      R"({"type": "string", "format": "date"})",
      R"({"type": "string", "format": "time"})",
      R"({"type": "string", "format": "date-time"})",
      R"({"type": "string", "format": "uuid"})",
      R"({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"})",
      R"({"type": "string", "pattern": "^(yes|no|maybe)$"})",
      R"({"type": "string", "pattern": "^\\d+\\.\\d{2}$"})",
      R"({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 6}, "minItems": 2, "maxItems": 4})",
      R"({"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3})",
      R"({"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}, {"enum": ["m", "cm"]}], "items": false})",
      R"({"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "label": {"type": "string", "maxLength": 10}}, "required": ["x", "y"]})",
      R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}})",
      R"({"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "maxProperties_note": null})",
      R"({"type": "object", "properties": {"tool": {"const": "grasp"}, "arguments": {"type": "object", "properties": {"object": {"type": "string", "maxLength": 16}, "force": {"type": "number"}}, "required": ["object", "force"]}}, "required": ["tool", "arguments"]})",
      R"({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}, {"type": "null"}]})",
      R"({"type": ["string", "null"], "maxLength": 8})",
      R"({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 640}, "y": {"type": "integer", "minimum": 0, "maximum": 480}}, "required": ["x", "y"]}}, "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}, "required": ["from", "to"]})",
      R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/node"})",
      R"({"type": "object", "properties": {"ok": {"type": "boolean"}, "items": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 5}, "when": {"type": "string", "format": "date"}}, "required": ["ok", "items", "when"], "additionalProperties": false})",
      R"({"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["kind", "r"]}, {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer", "minimum": 1, "maximum": 50}, "h": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["kind", "w", "h"]}]})",
  };
}

}  // namespace

TEST_CASE("grammar: GBNF sentences are accepted and non-sentences refused, repetitions exactly bounded") {
  auto g = must_parse(R"(
# a comment
root ::= greeting " " name ( "!" | "." )?
greeting ::= "hi" | "hello"
name ::= [A-Z] [a-z]{1,3}
)");
  CHECK(accepts(g, "hi Bob"));
  CHECK(accepts(g, "hello Anna!"));
  CHECK(accepts(g, "hi Jo."));
  CHECK_FALSE(accepts(g, "hi B"));        // [a-z]{1,3}: at least one
  CHECK_FALSE(accepts(g, "hi Bobby"));    // at most three
  CHECK_FALSE(accepts(g, "hey Bob"));
  CHECK_FALSE(accepts(g, "hi bob"));
  CHECK_FALSE(accepts(g, "hi Bob!!"));
  CHECK(prefix_ok(g, "hel"));
  CHECK_FALSE(prefix_ok(g, "hex"));

  auto rep = must_parse("root ::= \"a\"{2,4} \"b\"* (\"c\" \"d\")+ [^x-z]? .");
  CHECK(accepts(rep, "aacdq"));
  CHECK(accepts(rep, "aaaabbbcdcdwq"));
  CHECK_FALSE(accepts(rep, "acdq"));
  CHECK_FALSE(accepts(rep, "aaaaacdq"));
  CHECK_FALSE(accepts(rep, "aabq"));
  CHECK_FALSE(accepts(rep, "aacdyq"));
  CHECK_FALSE(accepts(rep, "aacdyyq"));
  CHECK(accepts(rep, "aacd\xC3\xA9"));  // '.' is one code point, here two bytes
  // x{m} and x{m,}
  auto exact = must_parse("root ::= [0-9]{3} \"-\" [a]{2,}");
  CHECK(accepts(exact, "123-aa"));
  CHECK(accepts(exact, "123-aaaaaa"));
  CHECK_FALSE(accepts(exact, "12-aa"));
  CHECK_FALSE(accepts(exact, "123-a"));
}

TEST_CASE("grammar: bad grammars are refused with where and why") {
  struct Case {
    const char* gbnf;
    const char* says;
  };
  const Case cases[] = {
      {"start ::= \"a\"", "no 'root' rule"},
      {"root ::= item", "'item' is used but never defined"},
      {"root ::= root \"a\" | \"b\"", "left-recursive"},
      {"root ::= x\nx ::= y? root \"a\"\ny ::= \"b\"", "left-recursive"},
      {"root ::= \"abc", "not closed"},
      {"root ::= [abc", "not closed"},
      {"root ::= \"a\"{5,2}", "n < m"},
      {"root ::= \"a\"{99999}", "KVLITE_MAX_GRAMMAR_REPEAT"},
      {"root ::= \"\\q\"", "unknown escape"},
      {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
      {"root ::= * \"a\"", "follows nothing"},
      {"root ::= [z-a]", "before its start"},
      {"root ::= (\"a\"", "')' was expected"},
      {"root ::= \"a\" )", "unexpected ')'"},
  };
  for (const Case& c : cases) {
    auto g = Grammar::parse(c.gbnf);
    CAPTURE(c.gbnf);
    REQUIRE_FALSE(g);
    CHECK(g.error().code == ErrorCode::bad_format);
    CHECK_MESSAGE(g.error().message.find(c.says) != std::string::npos, g.error().message);
    CHECK(g.error().message.find("grammar") != std::string::npos);
  }
  auto where = Grammar::parse("root ::= \"a\"\n\nx ::= \"b\" ~");
  REQUIRE_FALSE(where);
  CHECK_MESSAGE(where.error().message.find("line 3, column 11") != std::string::npos, where.error().message);
  // past the size bound, before any parsing
  auto huge = Grammar::parse("root ::= \"" + std::string(size_t(limits::max_grammar_bytes), 'a') + "\"");
  REQUIRE_FALSE(huge);
  CHECK(huge.error().code == ErrorCode::invalid_argument);
  // exponential expansion is bounded
  auto bomb = Grammar::parse("root ::= \"" + std::string(300, 'a') + "\"{4000}");
  REQUIRE_FALSE(bomb);
  CHECK(bomb.error().message.find("KVLITE_MAX_GRAMMAR_ELEMENTS") != std::string::npos);
}

TEST_CASE("grammar: a character split across reads is held, and refused when no rule could take it") {
  auto g = must_parse("root ::= \"caf\" [\\u00E0-\\u00FF] \"!\"");
  GrammarMatcher m(g);
  CHECK(m.accept("caf\xC3"));  // the first byte of é (U+00E9)
  CHECK_FALSE(m.complete());
  CHECK(m.accept("\xA9!"));
  CHECK(m.complete());
  CHECK_FALSE(m.can_continue());
  GrammarMatcher n(g);
  CHECK_FALSE(n.accept("caf\xE2"));  // a three-byte character is past U+00FF
  CHECK_FALSE(n.accept("caf\xC3\x28"));  // not a continuation byte
  CHECK(n.accept("caf"));
  CHECK_FALSE(n.accept("\xC0\xA9"));  // overlong
  CHECK_FALSE(n.accept("\x80"));      // a continuation byte first
  CHECK(n.accept("\xC3"));
  // a partial character only some code point could finish: U+D000..D7FF yes, the surrogates U+D800..DFFF never
  auto wide = must_parse("root ::= [^a]");
  CHECK(prefix_ok(wide, "\xED\x9F"));
  CHECK_FALSE(prefix_ok(wide, "\xED\xA0"));  // (a token ending there would leave generation stuck)
  CHECK_FALSE(prefix_ok(wide, "\xF4\x90"));  // past U+10FFFF
  CHECK_FALSE(prefix_ok(wide, "\xE0\x80"));  // overlong
}

TEST_CASE("grammar: the trie mask equals each token checked on its own, in every state of random walks") {
  std::mt19937_64 rng(7);
  // a vocabulary of random pieces: JSON punctuation, digits, words with and without a leading space, UTF-8
  const std::vector<std::string> atoms = {"{", "}", "[", "]", "\"", ":", ",", " ", "\n", "0", "1", "7", "42", "-",
                                          ".", "e", "true", "false", "null", "name", "age", "a", "b", "\\", "\\n",
                                          "\xC3\xA9", "\xC3", "\xA9", "\xE2\x82\xAC", "x", "yz"};
  std::vector<std::string> vocab;
  std::set<std::string> seen;
  while (vocab.size() < 900) {
    std::string piece;
    const int parts = 1 + int(rng() % 3);
    for (int i = 0; i < parts; i++) piece += atoms[rng() % atoms.size()];
    vocab.push_back(piece);  // duplicates too: two ids with the same bytes
  }
  vocab.push_back("");
  std::vector<uint8_t> excluded(vocab.size(), 0);
  excluded[3] = 1;
  auto vocabulary = std::make_shared<const GrammarVocabulary>(vocab, excluded);
  for (const std::string& schema : {std::string(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name"]})"),
                                    std::string(R"({"type": "array", "items": {"type": ["number", "boolean", "null"]}})")}) {
    auto gbnf = Grammar::json_schema_to_gbnf(schema);
    REQUIRE(gbnf);
    auto grammar = must_parse(*gbnf);
    GrammarMasker masker(grammar, vocabulary);
    for (int walk = 0; walk < 8; walk++) {
      GrammarMatcher m(grammar);
      for (int step = 0; step < 40 && m.can_continue(); step++) {
        const TokenMask& mask = masker.mask(m.state());
        std::vector<int32_t> allowed;
        for (size_t id = 0; id < vocab.size(); id++) {
          GrammarState next;
          const bool expect = !excluded[id] && !vocab[id].empty() &&
                              GrammarMatcher::advance(*grammar, m.state(), vocab[id], next);
          CHECK_MESSAGE(token_mask_allows(mask, int32_t(id)) == expect, "token " << id << " '" << vocab[id] << "'");
          if (expect) allowed.push_back(int32_t(id));
        }
        // min_completion is exact: some byte takes it down by one, until the sentence is whole
        GrammarState walk = m.state();
        for (int64_t left = GrammarMatcher::min_completion(*grammar, walk); left > 0; left--) {
          bool stepped = false;
          for (int b = 0; b < 256 && !stepped; b++) {
            GrammarState next;
            if (GrammarMatcher::advance(*grammar, walk, std::string(1, char(b)), next) &&
                GrammarMatcher::min_completion(*grammar, next) == left - 1) {
              walk = next;
              stepped = true;
            }
          }
          REQUIRE(stepped);
        }
        bool whole = false;
        for (const auto& stack : walk.stacks) whole = whole || stack.empty();
        CHECK(whole);
        // the engine's budget mask: the remembered heavy tokens or a walk give the same tokens as a walk
        for (int64_t budget : {int64_t(0), int64_t(3), int64_t(12), int64_t(40), int64_t(80)}) {
          TokenMask within, scratch;
          masker.mask_within(m.state(), budget, within);
          const TokenMask& fast = masker.mask_for_budget(m.state(), budget, scratch);
          int64_t most = 0;
          masker.mask(m.state(), &most);
          CHECK((most <= budget ? fast == mask : fast == within));
          for (size_t id = 0; id < vocab.size(); id++) {
            GrammarState next;
            const bool expect = token_mask_allows(mask, int32_t(id)) &&
                                GrammarMatcher::advance(*grammar, m.state(), vocab[id], next) &&
                                GrammarMatcher::min_completion(*grammar, next) <= budget;
            CHECK(token_mask_allows(within, int32_t(id)) == expect);
          }
        }
        if (allowed.empty()) break;
        REQUIRE(m.accept(vocab[size_t(allowed[rng() % allowed.size()])]));
      }
    }
    CHECK(masker.masks_reused() > 0);  // states recur (inside strings, between items)
  }
}

TEST_CASE("grammar: integer ranges from a schema take exactly the integers in them") {
  const std::pair<int64_t, int64_t> ranges[] = {{0, 100}, {-40, 125}, {7, 7}, {13, 987}, {-1000, -3}, {95, 1005}, {1, 9}};
  for (const auto& range : ranges) {
    const int64_t lo = range.first, hi = range.second;
    CAPTURE(lo);
    CAPTURE(hi);
    auto gbnf = Grammar::json_schema_to_gbnf(json{{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}.dump());
    REQUIRE(gbnf);
    auto g = must_parse(*gbnf);
    for (int64_t x = lo - 120; x <= hi + 120; x++) {
      CAPTURE(x);
      CHECK(accepts(g, std::to_string(x)) == (x >= lo && x <= hi));
    }
    CHECK_FALSE(accepts(g, "00"));
    CHECK_FALSE(accepts(g, "-0"));
  }
}

TEST_CASE("grammar: every schema of the suite compiles, and its random sentences validate against it") {
  std::mt19937_64 rng(11);
  const auto suite = schema_suite();
  CHECK(suite.size() >= 30);
  for (const std::string& text : suite) {
    CAPTURE(text);
    std::string stripped = text;
    json schema = json::parse(text);
    schema.erase("maxProperties_note");  // (a null annotation-like key the compiler must refuse: checked below)
    auto gbnf = Grammar::json_schema_to_gbnf(schema.dump());
    REQUIRE_MESSAGE(gbnf, gbnf.error().message);
    auto g = must_parse(*gbnf);
    for (int i = 0; i < 25; i++) {
      bool ok = false;
      const std::string sentence = random_sentence(g, rng, 60, ok);
      CAPTURE(sentence);
      REQUIRE(ok);
      std::string why;
      CHECK_MESSAGE(valid_against(sentence, schema, why), why);
    }
  }
}

TEST_CASE("grammar: schema documents that break the schema are refused by its grammar") {
  struct Case {
    const char* schema;
    std::vector<const char*> good, bad;
  };
  const Case cases[] = {
      {R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]})",
       {R"({"name": "x"})", R"({"name": "x", "age": 3})", "{ \"name\" : \"a\\\"b\" }"},
       {R"({"age": 3})", R"({"name": 3})", R"({"name": "x", "age": 3.5})", R"({"name": "x", "extra": 1})", R"({"age": 3, "name": "x"})"}},
      {R"({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2})",
       {R"(["a"])", R"(["a", "b"])"},
       {"[]", R"(["a", "b", "a"])", R"(["c"])"}},
      {R"({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"})", {R"("AB-123")", R"("ZZ-0000")"}, {R"("AB-12")", R"("ab-123")", R"("AB-12345")"}},
      {R"({"type": "string", "pattern": "[0-9]x"})", {R"("a1xb")", R"("9x")"}, {R"("xx")", R"("1")"}},
      {R"({"type": "string", "format": "date"})", {R"("2026-11-28")"}, {R"("2026-13-01")", R"("2026-1-01")", R"("26-11-28")"}},
      {R"({"type": "number"})", {"0", "-1.5", "3e10", "12.25E-3"}, {"01", "1.", ".5", "+1", "NaN"}},
  };
  for (const Case& c : cases) {
    const std::string schema_text = c.schema;
    CAPTURE(schema_text);
    auto gbnf = Grammar::json_schema_to_gbnf(c.schema);
    REQUIRE(gbnf);
    auto g = must_parse(*gbnf);
    for (const char* doc : c.good) CHECK_MESSAGE(accepts(g, doc), std::string(doc));
    for (const char* doc : c.bad) CHECK_MESSAGE(!accepts(g, doc), std::string(doc));
  }
}

TEST_CASE("grammar: schemas it cannot honour are refused by keyword, not ignored") {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"type": "object", "maxProperties_note": null})", "keyword 'maxProperties_note'"},
      {R"({"type": "string", "format": "ipv6"})", "format 'ipv6'"},
      {R"({"type": "number", "minimum": 0.5})", "'minimum' on a number"},
      {R"({"type": "array", "uniqueItems": true})", "keyword 'uniqueItems'"},
      {R"({"$ref": "https://example.com/schema"})", "$ref"},
      {R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})", "allOf"},
      {R"({"type": "string", "pattern": "(?=a)b"})", "look-around"},
      {R"({"type": "integer", "minimum": 5, "maximum": 1})", "no integer"},
      {R"({"type": "object", "required": ["a"]})", "not in 'properties'"},
      {R"({"type": "array", "maxItems": 100000})", "KVLITE_MAX_GRAMMAR_REPEAT"},
      {R"({"type": "integer", "multipleOf": 5})", "multipleOf"},
      {R"({"type": "string", "pattern": "^[A-Z]{1}-[0-9]{5,4}$"})", "n < m"},
      {R"({"type": "string", "pattern": "a{,3}"})", "bad {m,n}"},
      {R"({"type": "string", "pattern": "a{99999}"})", "KVLITE_MAX_GRAMMAR_REPEAT"},
      {R"({"type": "string", "pattern": "^a+$", "minLength": 5})", "minLength"},
      {R"({"type": "array", "prefixItems": [{"type": "number"}], "minItems": 3})", "prefixItems"},
      {"[1, 2", "not valid JSON"},
      {"false", "allows nothing"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.first);
    auto gbnf = Grammar::json_schema_to_gbnf(c.first);
    REQUIRE_FALSE(gbnf);
    CHECK_MESSAGE(gbnf.error().message.find(c.second) != std::string::npos, gbnf.error().message);
  }
  std::string deep;
  for (int i = 0; i < 200; i++) deep += R"({"type": "array", "items": )";
  deep += "{}";
  for (int i = 0; i < 200; i++) deep += "}";
  auto nested = Grammar::json_schema_to_gbnf(deep);
  REQUIRE_FALSE(nested);
  CHECK(nested.error().message.find("KVLITE_MAX_JSON_DEPTH") != std::string::npos);
}

// ---- constrained generation -------------------------------------------------------------------------------
namespace {
std::unique_ptr<Engine> open_fixture(const std::string& dir) {
  EngineOptions options;
  options.backend = BackendChoice::cpu;
  options.plan.device_mem = 256 * MiB;
  auto engine = Engine::open(dir, options);
  if (!engine) FAIL(dir << ": " << engine.error().message);
  return std::move(*engine);
}
}  // namespace

TEST_CASE("grammar: every output of the random-weight model is valid against its schema (and almost none without)") {
  auto engine = open_fixture(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3");
  const auto suite = schema_suite();
  int valid_constrained = 0, valid_free = 0, outputs = 0;
  for (size_t i = 0; i < suite.size(); i++) {
    json schema = json::parse(suite[i]);
    schema.erase("maxProperties_note");
    CAPTURE(suite[i]);
    for (uint64_t seed : {1, 2}) {
      SamplingParams params;
      params.temperature = 1.0f;
      params.seed = seed + 100 * i;
      params.max_tokens = 400;
      params.json_schema = schema.dump();
      auto out = engine->generate_chat({{"user", "Answer in JSON."}}, params);
      REQUIRE_MESSAGE(out, out.error().message);
      outputs++;
      std::string why;
      const bool ok = valid_against(out->text, schema, why);
      CHECK_MESSAGE(ok, out->text << " (" << std::string(finish_reason_name(out->finish_reason)) << "): " << why);
      CHECK((out->finish_reason == FinishReason::grammar_end || out->finish_reason == FinishReason::stop_token));
      valid_constrained += ok;
      params.json_schema.clear();
      auto free_out = engine->generate_chat({{"user", "Answer in JSON."}}, params);
      REQUIRE(free_out);
      valid_free += valid_against(free_out->text, schema, why);
    }
  }
  MESSAGE("valid: " << valid_constrained << " of " << outputs << " constrained, " << valid_free << " unconstrained");
  CHECK(valid_constrained == outputs);
  CHECK(valid_free * 10 < outputs);
  engine_helpers::check_pool_empty(*engine);
}

TEST_CASE("grammar: a max_tokens too small for free text still ends in a whole, valid document") {
  // Tokens that would leave more bytes to close the document than tokens remain are masked too, so the output
  // is complete when max_tokens cuts it: max_tokens is each schema's shortest document plus a few tokens.
  auto engine = open_fixture(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3");
  const auto suite = schema_suite();
  int cut = 0;
  for (size_t i = 0; i < suite.size(); i++) {
    json schema = json::parse(suite[i]);
    schema.erase("maxProperties_note");
    CAPTURE(suite[i]);
    SamplingParams params;
    params.temperature = 1.0f;
    params.json_schema = schema.dump();
    auto gbnf = Grammar::json_schema_to_gbnf(params.json_schema);
    REQUIRE(gbnf);
    const int64_t shortest = GrammarMatcher(must_parse(*gbnf)).min_completion();
    CHECK(shortest >= 1);
    CHECK(shortest <= 80);
    params.max_tokens = shortest + 4;
    for (uint64_t seed = 0; seed < 3; seed++) {
      params.seed = 7 + i + 1000 * seed;
      auto out = engine->generate_chat({{"user", "Answer in JSON."}}, params);
      REQUIRE_MESSAGE(out, out.error().message);
      std::string why;
      CHECK_MESSAGE(valid_against(out->text, schema, why), out->text << ": " << why);
      cut += out->finish_reason == FinishReason::max_tokens;
    }
  }
  MESSAGE(cut << " of " << 3 * suite.size() << " outputs reached max_tokens");
  CHECK(cut > 0);  // the budget was binding for some: the check above tested the budget mask
}

TEST_CASE("grammar: constrained requests batched, preempted and drafted (n-gram) give the tokens each gives alone") {
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3";
  const auto suite = schema_suite();
  const size_t picks[] = {0, 1, 25, 31, 32, 34};
  auto params_for = [&](size_t i) {
    SamplingParams params;  // greedy: the same tokens whatever the batch, preemption or drafting
    params.max_tokens = 48;
    json schema = json::parse(suite[i]);
    params.json_schema = schema.dump();
    return params;
  };
  std::vector<std::vector<int32_t>> alone;
  std::vector<std::vector<int32_t>> prompts;
  {
    auto engine = open_fixture(dir);
    for (size_t k = 0; k < std::size(picks); k++) {
      std::string prompt = "Answer in JSON, case " + std::to_string(k) + ".";
      auto ids = engine->tokenizer().encode(prompt, false);
      REQUIRE(ids);
      prompts.push_back(*ids);
      auto out = engine->generate(prompts.back(), params_for(picks[k]));
      REQUIRE(out);
      alone.push_back(out->ids);
    }
  }
  for (int mode = 0; mode < 2; mode++) {
    CAPTURE(mode);
    EngineOptions options;
    options.backend = BackendChoice::cpu;
    options.plan.max_model_len = 128;
    if (mode == 1) {
      options.plan.ngram = 2;
      options.plan.speculative_tokens = 3;
    }
    // a KV arena of 8 pages (one 128-token sequence): the six requests together need more, so some are
    // preempted and recomputed
    options.plan.utilization = 1.0;
    options.plan.device_mem = 256 * MiB;
    auto probe = Engine::open(dir, options);
    REQUIRE(probe);
    options.plan.device_mem = (*probe)->plan().fixed_bytes + 8 * (*probe)->plan().kv_page_bytes;
    probe->reset();
    auto engine = Engine::open(dir, options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    std::vector<RequestId> ids;
    for (size_t k = 0; k < std::size(picks); k++) {
      auto id = (*engine)->submit(prompts[k], params_for(picks[k]));
      REQUIRE_MESSAGE(id, id.error().message);
      ids.push_back(*id);
    }
    REQUIRE((*engine)->run());
    CHECK((*engine)->stats().preemptions > 0);
    if (mode == 1) CHECK((*engine)->stats().draft_tokens > 0);
    for (size_t k = 0; k < ids.size(); k++) {
      auto out = (*engine)->result(ids[k]);
      REQUIRE(out);
      CHECK(out->ids == alone[k]);
    }
    engine_helpers::check_pool_empty(**engine);
  }
}

TEST_CASE("grammar: a bad grammar or schema is refused by submit, and no request is left behind") {
  auto engine = open_fixture(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3");
  SamplingParams params;
  params.grammar = "root ::= undefined-rule";
  auto refused = engine->generate("hi", params);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::bad_format);
  CHECK(refused.error().message.find("undefined-rule") != std::string::npos);
  params.grammar.clear();
  params.json_schema = R"({"type": "string", "format": "ipv6"})";
  refused = engine->generate("hi", params);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::unsupported);
  params.grammar = "root ::= \"a\"";
  refused = engine->generate("hi", params);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().message.find("both set") != std::string::npos);
  // a grammar: a fixed sentence comes out whatever the model prefers, and ends the request
  params.json_schema.clear();
  params.grammar = "root ::= \"move(\" [0-9] \",\" [0-9] \")\"";
  auto out = engine->generate("hi", params);
  REQUIRE(out);
  CHECK(out->finish_reason == FinishReason::grammar_end);
  CHECK(std::regex_match(out->text, std::regex(R"(move\([0-9],[0-9]\))")));
  engine_helpers::check_pool_empty(*engine);
}

TEST_CASE("grammar: tool calls in the Hermes and Llama-3 forms: the grammar takes exactly well-formed calls, the parser finds them") {
  const std::string tools = R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object",
      "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "grasp", "parameters": {"type": "object", "properties": {"force": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["force"]}}},
    {"type": "function", "function": {"name": "stop"}}])";
  auto hermes = Grammar::parse(tool_calls_gbnf(tools, ToolCallSyntax::hermes, "", true).value());
  REQUIRE_MESSAGE(hermes, hermes.error().message);
  const std::string one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call>";
  const std::string two = one + "\n<tool_call>\n{\"name\": \"grasp\", \"arguments\": {\"force\": 7}}\n</tool_call>";
  CHECK(accepts(*hermes, one));
  CHECK(accepts(*hermes, two));
  CHECK(accepts(*hermes, "<tool_call>\n{\"name\": \"stop\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(accepts(*hermes, "<tool_call>\n{\"name\": \"grasp\", \"arguments\": {\"force\": 11}}\n</tool_call>"));
  CHECK_FALSE(accepts(*hermes, "<tool_call>\n{\"name\": \"fly\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(accepts(*hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"C\"}}\n</tool_call>"));
  // one call only, of one named function
  auto single = Grammar::parse(tool_calls_gbnf(tools, ToolCallSyntax::hermes, "grasp", false).value());
  REQUIRE(single);
  CHECK(accepts(*single, "<tool_call>\n{\"name\": \"grasp\", \"arguments\": {\"force\": 10}}\n</tool_call>"));
  CHECK_FALSE(accepts(*single, one));
  CHECK_FALSE(accepts(*single, two));
  auto llama = Grammar::parse(tool_calls_gbnf(tools, ToolCallSyntax::llama3_json, "", true).value());
  REQUIRE(llama);
  CHECK(accepts(*llama, "{\"name\": \"grasp\", \"parameters\": {\"force\": 3}}"));
  CHECK_FALSE(accepts(*llama, "{\"name\": \"grasp\", \"arguments\": {\"force\": 3}}"));
  // refused: a name not in tools, a bad tool, a bad name
  auto missing = tool_calls_gbnf(tools, ToolCallSyntax::hermes, "fly", false);
  REQUIRE_FALSE(missing);
  CHECK(missing.error().message.find("fly") != std::string::npos);
  CHECK_FALSE(tool_calls_gbnf(R"([{"type": "function"}])", ToolCallSyntax::hermes, "", true));
  CHECK_FALSE(tool_calls_gbnf(R"([{"type": "function", "function": {"name": "a b"}}])", ToolCallSyntax::hermes, "", true));
  CHECK_FALSE(tool_calls_gbnf("[]", ToolCallSyntax::hermes, "", true));

  // parsing: calls out, the rest as content; a broken call stays text
  ParsedToolCalls parsed = parse_tool_calls("Let me check.\n" + two, ToolCallSyntax::hermes);
  REQUIRE(parsed.calls.size() == 2);
  CHECK(parsed.calls[0].name == "get_weather");
  CHECK(json::parse(parsed.calls[0].arguments) == json{{"city", "Paris"}, {"unit", "C"}});
  CHECK(parsed.calls[0].arguments.find("\"city\"") < parsed.calls[0].arguments.find("\"unit\""));  // order kept
  CHECK(parsed.calls[1].name == "grasp");
  CHECK(parsed.content == "Let me check.");
  ParsedToolCalls broken = parse_tool_calls("<tool_call>\n{\"name\": 3}\n</tool_call>", ToolCallSyntax::hermes);
  CHECK(broken.calls.empty());
  CHECK(broken.content == "<tool_call>\n{\"name\": 3}\n</tool_call>");
  ParsedToolCalls l3 = parse_tool_calls(" {\"name\": \"stop\", \"parameters\": {}}", ToolCallSyntax::llama3_json);
  REQUIRE(l3.calls.size() == 1);
  CHECK(l3.calls[0].arguments == "{}");
  CHECK(l3.content.empty());
  CHECK(parse_tool_calls("It is sunny.", ToolCallSyntax::llama3_json).content == "It is sunny.");
  // the syntax from the templates themselves
  auto read = [](const std::string& family) {
    std::ifstream in(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/chat_templates/" + family + ".jinja");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  CHECK(tool_call_syntax_of(read("qwen2.5")) == ToolCallSyntax::hermes);
  CHECK(tool_call_syntax_of(read("qwen3")) == ToolCallSyntax::hermes);
  CHECK(tool_call_syntax_of(read("llama3.1")) == ToolCallSyntax::llama3_json);
  CHECK(tool_call_syntax_of(read("llama3.2")) == ToolCallSyntax::llama3_json);
}
