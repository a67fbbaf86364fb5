// tokenizer: byte-level BPE against Hugging Face `tokenizers` / `transformers` output (tests/fixtures/tokenizers,
// written by tools/make_fixtures.py), NFC against Python's unicodedata (tests/fixtures/unicode/nfc.json,
// written by tools/gen_unicode_tables.py), the streaming decoder, added-token flags and the errors.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include "kvlite.hpp"
using namespace kvlite;
using Json = nlohmann::json;

namespace {
std::string fixture_path(const std::string& relative) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/" + relative;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Json read_json(const std::string& path) { return Json::parse(read_file(path)); }

Tokenizer load_family(const std::string& family) {
  Result<Tokenizer> tokenizer = Tokenizer::load(fixture_path("tokenizers/" + family));
  REQUIRE_MESSAGE(tokenizer.ok(), tokenizer.error().message);
  return *tokenizer;
}

// The tokenizer.json of a family, edited by `edit`, loaded with that family's tokenizer_config.json.
template <class Edit>
Result<Tokenizer> load_edited(const std::string& family, Edit&& edit) {
  Json tokenizer_json = read_json(fixture_path("tokenizers/" + family + "/tokenizer.json"));
  edit(tokenizer_json);
  return Tokenizer::from_json(tokenizer_json.dump(),
                              read_file(fixture_path("tokenizers/" + family + "/tokenizer_config.json")));
}

std::string stream_decode(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, bool skip_special) {
  StreamingDecoder decoder(tokenizer, skip_special);
  std::string text;
  for (int32_t id : ids) text += decoder.push(id).value();
  return text + decoder.flush();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Every case of a family's cases.json: ids both ways, vocabulary strings, decoding (plain, skipping special
// tokens, streamed), the decode_cases that cut characters, and the chat prompts with their ids.
void check_family(const std::string& family) {
  Tokenizer tokenizer = load_family(family);
  Json truth = read_json(fixture_path("tokenizers/" + family + "/cases.json"));

  CHECK(tokenizer.vocab_size() == truth["vocab_size"].get<size_t>());
  CHECK(tokenizer.bos_id() == (truth["bos_token_id"].is_null() ? -1 : truth["bos_token_id"].get<int32_t>()));
  CHECK(tokenizer.eos_id() == truth["eos_token_id"].get<int32_t>());
  for (const Json& added : truth["added_tokens"]) {
    INFO("added token " << added["content"].get<std::string>());
    CHECK(tokenizer.token_id(added["content"].get<std::string>()) == added["id"].get<int32_t>());
    CHECK(tokenizer.is_special(added["id"].get<int32_t>()) == added["special"].get<bool>());
  }

  size_t checked = 0;
  for (const Json& c : truth["cases"]) {
    std::string text = c["text"];
    INFO(family << " case " << c["category"].get<std::string>() << ": " << Json(text).dump());
    std::vector<int32_t> ids = c["ids"], ids_with_special = c["ids_with_special"];
    Result<std::vector<int32_t>> encoded = tokenizer.encode(text, false);
    REQUIRE_MESSAGE(encoded.ok(), encoded.error().message);
    CHECK(*encoded == ids);
    CHECK(tokenizer.encode(text, true).value() == ids_with_special);
    std::vector<std::string> tokens;
    for (int32_t id : ids) tokens.push_back(tokenizer.token_text(id));
    CHECK(tokens == c["tokens"].get<std::vector<std::string>>());
    CHECK(tokenizer.decode(ids, false).value() == c["decoded"].get<std::string>());
    CHECK(tokenizer.decode(ids, true).value() == c["decoded_skip_special"].get<std::string>());
    CHECK(stream_decode(tokenizer, ids, false) == c["decoded"].get<std::string>());
    CHECK(stream_decode(tokenizer, ids, true) == c["decoded_skip_special"].get<std::string>());
    checked++;
  }
  CHECK(checked >= 60);

  for (const Json& c : truth["decode_cases"]) {
    std::vector<int32_t> ids = c["ids"];
    INFO(family << " decode case from " << Json(c["from_text"]).dump());
    CHECK(tokenizer.decode(ids, false).value() == c["decoded"].get<std::string>());
    CHECK(stream_decode(tokenizer, ids, false) == c["decoded"].get<std::string>());
  }

  for (const Json& chat : truth["chat"]) {
    INFO(family << " chat " << chat["name"].get<std::string>());
    std::vector<ChatMessage> messages;
    for (const Json& m : chat["messages"]) messages.push_back({m["role"], m["content"]});
    Result<std::string> prompt = tokenizer.format_chat(messages, chat["add_generation_prompt"].get<bool>());
    REQUIRE_MESSAGE(prompt.ok(), prompt.error().message);
    CHECK(*prompt == chat["text"].get<std::string>());
    CHECK(tokenizer.encode(*prompt, false).value() == chat["ids"].get<std::vector<int32_t>>());
  }
}
}  // namespace

TEST_CASE("llama3 fixture: every case encodes, decodes, streams and formats chat exactly as HF") {
  check_family("llama3");
  CHECK(load_family("llama3").chat_format() == ChatFormat::llama3);
}

TEST_CASE("qwen2 fixture: every case encodes, decodes, streams and formats chat exactly as HF") {
  check_family("qwen2");
  CHECK(load_family("qwen2").chat_format() == ChatFormat::chatml);
}

TEST_CASE("the merges list reads the same as \"a b\" strings and as [a, b] pairs") {
  // llama3's file has strings and qwen2's pairs; rewriting each in the other layout changes no id.
  for (const char* family : {"llama3", "qwen2"}) {
    Result<Tokenizer> swapped = load_edited(family, [](Json& j) {
      for (Json& merge : j["model"]["merges"]) {
        if (merge.is_string()) {
          std::string line = merge;
          merge = Json::array({line.substr(0, line.find(' ')), line.substr(line.find(' ') + 1)});
        } else {
          merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
        }
      }
    });
    REQUIRE_MESSAGE(swapped.ok(), swapped.error().message);
    Json truth = read_json(fixture_path(std::string("tokenizers/") + family + "/cases.json"));
    for (const Json& c : truth["cases"])
      CHECK(swapped->encode(c["text"].get<std::string>(), false).value() == c["ids"].get<std::vector<int32_t>>());
  }
}

TEST_CASE("encoding from several threads at once gives the single-threaded ids") {
  Tokenizer tokenizer = load_family("qwen2");
  Json truth = read_json(fixture_path("tokenizers/qwen2/cases.json"));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); t++) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; round++)
        for (const Json& c : truth["cases"])
          if (tokenizer.encode(c["text"].get<std::string>(), false).value() != c["ids"].get<std::vector<int32_t>>())
            mismatches[t]++;
    });
  }
  for (std::thread& thread : threads) thread.join();
  CHECK(mismatches == std::vector<int>(4, 0));
}

TEST_CASE("NFC matches Python's unicodedata on every decomposable character and on random mark sequences") {
  Json truth = read_json(fixture_path("unicode/nfc.json"));
  CHECK(truth["unicode_version"].get<std::string>() == detail::unicode_nfc_version());
  size_t changed = 0;
  for (const Json& c : truth["cases"]) {
    std::string input = c[0], expected = c[1];
    INFO("NFC of " << Json(input).dump());
    CHECK(detail::unicode_nfc(input) == expected);
    changed += input != expected;
  }
  CHECK(truth["cases"].size() > 7000);
  CHECK(changed > 2000);  // the cases do exercise composition and reordering
}

TEST_CASE("the streaming decoder holds back a character split across tokens until it is complete") {
  Tokenizer tokenizer = load_family("llama3");
  // U+1F600 has no token of its own in this vocabulary: HF splits it into byte tokens.
  std::string text = "smile \xF0\x9F\x98\x80 ok";
  std::vector<int32_t> ids = tokenizer.encode(text, false).value();
  StreamingDecoder decoder(tokenizer);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(decoder.push(id).value());
  pieces.push_back(decoder.flush());
  std::string joined;
  size_t held_back = 0;
  for (const std::string& piece : pieces) {
    joined += piece;
    // No piece ends inside a character (encode accepts only valid UTF-8); the emoji arrives whole.
    CHECK(tokenizer.encode(piece, false).ok());
    if (piece.empty()) held_back++;
    if (contains(piece, "\xF0")) CHECK(contains(piece, "\xF0\x9F\x98\x80"));
  }
  CHECK(held_back >= 1);
  CHECK(joined == text);
  CHECK(joined == tokenizer.decode(ids, false).value());

  // Cut after the emoji's first token: flush turns the unfinished character into one U+FFFD, as decode does.
  size_t first_emoji_token = 0;
  while (!contains(tokenizer.token_bytes(ids[first_emoji_token]), "\xF0")) first_emoji_token++;
  std::vector<int32_t> cut(ids.begin(), ids.begin() + long(first_emoji_token) + 1);
  StreamingDecoder partial(tokenizer);
  std::string streamed;
  for (int32_t id : cut) streamed += partial.push(id).value();
  CHECK(streamed == "smile ");
  CHECK(partial.flush() == "\xEF\xBF\xBD");
  CHECK(partial.flush() == "");
  CHECK(tokenizer.decode(cut, false).value() == "smile \xEF\xBF\xBD");
}

TEST_CASE("added tokens: lstrip, rstrip, single_word and normalized behave as HF") {
  // Expected ids from HF tokenizers 0.23.3: Tokenizer.from_file(<fixture>/tokenizer.json), then
  // add_tokens([AddedToken('<mask>', lstrip=True, rstrip=True, special=True, normalized=False),
  //             AddedToken('[W]', single_word=True, special=False, normalized=False),
  //             AddedToken('ab', special=False, normalized=True)]) and encode(text, add_special_tokens=False).
  Result<Tokenizer> llama = load_edited("llama3", [](Json& j) {
    j["added_tokens"].push_back({{"id", 1510},
                                 {"content", "<mask>"},
                                 {"single_word", false},
                                 {"lstrip", true},
                                 {"rstrip", true},
                                 {"normalized", false},
                                 {"special", true}});
    j["added_tokens"].push_back({{"id", 1511},
                                 {"content", "[W]"},
                                 {"single_word", true},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", false}});
    j["added_tokens"].push_back({{"id", 1512},
                                 {"content", "ab"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", true},
                                 {"special", false}});
  });
  REQUIRE_MESSAGE(llama.ok(), llama.error().message);
  CHECK(llama->token_id("ab") == 856);  // already in the vocabulary: HF keeps that id
  const std::vector<std::pair<std::string, std::vector<int32_t>>> llama_cases = {
      {"Hello <mask> world", {39, 265, 314, 1510, 86, 262, 284}},
      {"Hello   <mask>\n\nworld", {39, 265, 314, 1510, 86, 262, 284}},
      {"<mask><mask>  <mask>", {1510, 1510, 1510}},
      {"a[W]b", {64, 58, 54, 60, 65}},
      {"a [W] b", {64, 220, 1511, 276}},
      {"[W]", {1511}},
      {"\xC3\xA9[W]", {288, 58, 54, 60}},
      {"_[W]", {62, 58, 54, 60}},
      {"-[W]-", {12, 1511, 12}},
      {"\xD9\xA1[W]", {149, 94, 58, 54, 60}},
      {"x\xCC\x81[W]", {87, 1286, 58, 54, 60}},
      {"xaby ab", {87, 856, 88, 220, 856}},
      {"cab<mask>ab", {66, 856, 1510, 856}},
  };
  for (const auto& llama_case : llama_cases) {  // (no structured binding: clang 14 cannot capture one)
    const auto& text = llama_case.first;
    const auto& ids = llama_case.second;
    INFO(Json(text).dump());
    CHECK(llama->encode(text, false).value() == ids);
  }
  CHECK(llama->decode({39, 265, 314, 1510, 86, 262, 284}, true).value() == "Helloworld");

  // qwen2 normalizes with NFC: a normalized token matches the NFC of the text, a raw one the text as written.
  // HF: add_tokens([AddedToken('\u212bngstrom', normalized=False), AddedToken('caf\u00e9!', normalized=True),
  //                 AddedToken('caf\u00e9?', normalized=False)]) (none special).
  Result<Tokenizer> qwen = load_edited("qwen2", [](Json& j) {
    const char* contents[] = {
        "\xE2\x84\xAB"
        "ngstrom",
        "caf\xC3\xA9!", "caf\xC3\xA9?"};
    bool normalized[] = {false, true, false};
    for (int i = 0; i < 3; i++)
      j["added_tokens"].push_back({{"id", 1415 + i},
                                   {"content", contents[i]},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", normalized[i]},
                                   {"special", false}});
  });
  REQUIRE_MESSAGE(qwen.ok(), qwen.error().message);
  std::vector<int32_t> ids = qwen->encode(
                                     "Caf: cafe\xCC\x81! \xE2\x84\xAB"
                                     "ngstrom \xC3\x85ngstrom",
                                     false)
                                 .value();
  CHECK(ids == std::vector<int32_t>{34, 64, 69, 25, 220, 1416, 220, 1415, 1312, 591, 313, 781});
  // HF's ByteLevel decoder maps the added token's 'é' (in the byte alphabet) to the lone byte 0xE9: U+FFFD.
  CHECK(qwen->decode(ids, false).value() ==
        "Caf: caf\xEF\xBF\xBD! \xE2\x84\xAB"
        "ngstrom \xC3\x85ngstrom");
  ids = qwen->encode("caf\xC3\xA9! cafe\xCC\x81? caf\xC3\xA9?", false).value();
  CHECK(ids == std::vector<int32_t>{1416, 261, 64, 69, 284, 30, 220, 1417});
  CHECK(qwen->decode(ids, false).value() == "caf\xEF\xBF\xBD! caf\xC3\xA9? caf\xEF\xBF\xBD?");
}

TEST_CASE("invalid UTF-8 input is refused with its byte offset") {
  Tokenizer tokenizer = load_family("qwen2");
  const std::vector<std::pair<std::string, size_t>> bad = {
      {"abc\xFF", 3},            // never a UTF-8 byte
      {"ab\xC3", 2},             // truncated
      {"\xC0\xAF", 0},           // overlong
      {"ok \xED\xA0\x80", 3},    // a surrogate
      {"x\xF4\x90\x80\x80", 1},  // above U+10FFFF
      {"\xE2\x82\xACz\x80", 4},  // a stray continuation byte after a good character
  };
  for (const auto& bad_case : bad) {  // (no structured binding: clang 14 cannot capture one)
    const std::string& text = bad_case.first;
    const size_t offset = bad_case.second;
    Result<std::vector<int32_t>> ids = tokenizer.encode(text, false);
    REQUIRE_FALSE(ids.ok());
    CHECK(ids.error().code == ErrorCode::invalid_argument);
    CHECK_MESSAGE(contains(ids.error().message, "byte " + std::to_string(offset) + " "), ids.error().message);
  }
  CHECK(tokenizer.encode(std::string("a\0b", 3), false).ok());  // U+0000 is valid UTF-8
}

TEST_CASE("decoding an id with no token is refused, in decode and in the streaming decoder") {
  Tokenizer tokenizer = load_family("llama3");
  for (int32_t id : {-1, int32_t(tokenizer.vocab_size()), 1 << 30}) {
    Result<std::string> text = tokenizer.decode({64, id}, false);
    REQUIRE_FALSE(text.ok());
    CHECK(text.error().code == ErrorCode::invalid_argument);
    CHECK(contains(text.error().message, std::to_string(id)));
  }
  StreamingDecoder decoder(tokenizer);
  std::vector<int32_t> ids = tokenizer.encode("\xF0\x9F\x98\x80", false).value();
  REQUIRE(ids.size() >= 2);
  CHECK(decoder.push(ids[0]).value() == "");
  CHECK_FALSE(decoder.push(-5).ok());
  std::string rest;
  for (size_t i = 1; i < ids.size(); i++) rest += decoder.push(ids[i]).value();
  CHECK(rest == "\xF0\x9F\x98\x80");  // the refused id left the held-back bytes alone
}

TEST_CASE("malformed and unsupported tokenizer files are refused, naming what is wrong") {
  auto expect = [](const Result<Tokenizer>& tokenizer, ErrorCode code, std::initializer_list<const char*> parts) {
    REQUIRE_FALSE(tokenizer.ok());
    CHECK_MESSAGE(tokenizer.error().code == code, tokenizer.error().message);
    for (const char* part : parts) CHECK_MESSAGE(contains(tokenizer.error().message, part), tokenizer.error().message);
  };
  expect(Tokenizer::from_json("{\"model\": ", ""), ErrorCode::bad_format, {"tokenizer.json", "not valid JSON"});
  expect(Tokenizer::from_json("[1, 2]", ""), ErrorCode::bad_format, {"not a JSON object"});
  expect(load_edited("llama3", [](Json& j) { j["model"]["type"] = "Unigram"; }), ErrorCode::unsupported,
         {"model", "Unigram"});
  expect(load_edited("llama3",
                     [](Json& j) {
                       j["normalizer"] = {{"type", "BertNormalizer"}};
                     }),
         ErrorCode::unsupported, {"normalizer.type 'BertNormalizer'"});
  expect(load_edited(
             "qwen2",
             [](Json& j) {
               j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFD"}}}}};
             }),
         ErrorCode::unsupported, {"normalizer.normalizers[1].type 'NFD'"});
  expect(load_edited("llama3",
                     [](Json& j) {
                       j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Foo"}};
                     }),
         ErrorCode::unsupported, {"pre_tokenizer.pretokenizers[1].type 'Foo'"});
  expect(load_edited("llama3",
                     [](Json& j) {
                       j["decoder"] = {{"type", "WordPiece"}};
                     }),
         ErrorCode::unsupported, {"decoder.type 'WordPiece'"});
  expect(load_edited("llama3",
                     [](Json& j) {
                       j["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, {{"type", "CTC"}}}}};
                     }),
         ErrorCode::unsupported, {"decoder.decoders[1].type 'CTC'"});
  expect(load_edited("llama3",
                     [](Json& j) {
                       j["post_processor"] = {{"type", "Foo"}};
                     }),
         ErrorCode::unsupported, {"post_processor.type 'Foo'"});
  expect(load_edited("llama3",
                     [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?i:'s|\\p{L}+"; }),
         ErrorCode::bad_format, {"pre_tokenizer.pretokenizers[0].pattern", "missing closing parenthesis", "offset 13"});
  expect(load_edited("qwen2",
                     [](Json& j) {
                       j["model"]["merges"][5] = Json::array({"Ġ", "no-such-token"});
                     }),
         ErrorCode::bad_format, {"model.merges[5]", "no-such-token"});
  expect(load_edited("llama3", [](Json& j) { j["model"]["merges"][7] = "a b c"; }), ErrorCode::bad_format,
         {"model.merges[7]", "a b c"});
  expect(load_edited("llama3", [](Json& j) { j["model"].erase("vocab"); }), ErrorCode::bad_format, {"vocab"});
  expect(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = "one"; }), ErrorCode::bad_format,
         {"model.vocab"});
  expect(load_edited("llama3", [](Json& j) { j["model"]["dropout"] = 0.1; }), ErrorCode::unsupported, {"dropout"});

  Result<Tokenizer> missing = Tokenizer::load(fixture_path("no-such-model"));
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == ErrorCode::io_error);
  CHECK(contains(missing.error().message, "no-such-model/tokenizer.json"));
  Result<Tokenizer> no_config =
      Tokenizer::from_json(read_file(fixture_path("tokenizers/qwen2/tokenizer.json")), "{\"eos_token\": \"<nope>\"}");
  REQUIRE_FALSE(no_config.ok());
  CHECK(contains(no_config.error().message, "tokenizer_config.json eos_token '<nope>'"));
}

TEST_CASE("format_chat refuses a tokenizer with neither a chat template nor chat family's tokens") {
  Json tokenizer_json = read_json(fixture_path("tokenizers/qwen2/tokenizer.json"));
  Json kept = Json::array();
  for (const Json& token : tokenizer_json["added_tokens"])
    if (token["content"] != "<|im_start|>") kept.push_back(token);
  tokenizer_json["added_tokens"] = kept;
  Json config = read_json(fixture_path("tokenizers/qwen2/tokenizer_config.json"));
  config.erase("chat_template");  // with its template, format_chat would render that (test-chat-template)
  Result<Tokenizer> plain = Tokenizer::from_json(tokenizer_json.dump(), config.dump());
  REQUIRE_MESSAGE(plain.ok(), plain.error().message);
  CHECK(plain->chat_format() == ChatFormat::none);
  Result<std::string> prompt = plain->format_chat({{"user", "hi"}}, true);
  REQUIRE_FALSE(prompt.ok());
  CHECK(prompt.error().code == ErrorCode::unsupported);
}

// Regression (issue 15, defect 2): the Llama-3 format trims every message, and the trim walked characters
// backwards assuming valid UTF-8: a message ending in a stray lead or continuation byte read past the
// string's start or end (a heap over-read under ASan). Messages are now checked as encode() checks text.
TEST_CASE("regression: format_chat over-read a message that is not valid UTF-8") {
  for (const char* family : {"llama3", "qwen2"}) {
    CAPTURE(family);
    Tokenizer tokenizer = load_family(family);
    const std::vector<std::pair<std::string, size_t>> bad = {
        {"\x80", 0}, {"hi \xE2\x80", 3}, {"\xF0\x9F\x98", 0}, {"\xBF\xBF\xBF\xBF \t", 0}, {"a\xC3", 1}, {"\xFF\xFE", 0}};
    for (const auto& bad_case : bad) {  // (no structured binding: clang 14 cannot capture one)
      const std::string& content = bad_case.first;
      const size_t offset = bad_case.second;
      for (bool as_system : {false, true}) {
        std::vector<ChatMessage> messages = {{as_system ? "system" : "user", content}};
        Result<std::string> prompt = tokenizer.format_chat(messages, true);
        REQUIRE_FALSE(prompt.ok());
        CHECK(prompt.error().code == ErrorCode::invalid_argument);
        CHECK_MESSAGE(contains(prompt.error().message, "chat message 0: its content is not valid UTF-8 at byte " +
                                                           std::to_string(offset) + " "),
                      prompt.error().message);
      }
    }
    Result<std::string> bad_role = tokenizer.format_chat({{"user", "hi"}, {"us\xE9r", "x"}}, true);
    REQUIRE_FALSE(bad_role.ok());
    CHECK(contains(bad_role.error().message, "chat message 1: its role is not valid UTF-8 at byte 2"));
    // Random bytes never crash: each prompt is either formatted or refused as invalid_argument.
    std::mt19937 random(15);
    for (int trial = 0; trial < 2000; trial++) {
      std::string content(size_t(random() % 12), '\0');
      for (char& c : content) c = char(random() % 256);
      Result<std::string> prompt = tokenizer.format_chat({{"system", content}, {"user", content}}, true);
      if (!prompt.ok()) CHECK(prompt.error().code == ErrorCode::invalid_argument);
    }
  }
  // Valid text is still trimmed as Python's str.strip() does (White_Space and U+001C..U+001F, multi-byte ones too).
  Tokenizer llama = load_family("llama3");
  std::string prompt = llama.format_chat({{"user", " \xE3\x80\x80hi \xC3\xA9\xE2\x80\xA8\x1c\n"}}, false).value();
  CHECK(contains(prompt, "<|end_header_id|>\n\nhi \xC3\xA9<|eot_id|>"));
}

TEST_CASE("chat messages and prompts are bounded by named limits") {
  Tokenizer tokenizer = load_family("qwen2");
  std::vector<ChatMessage> many(size_t(limits::max_chat_messages) + 1, ChatMessage{"user", "x"});
  Result<std::string> too_many = tokenizer.format_chat(many, true);
  REQUIRE_FALSE(too_many.ok());
  CHECK(too_many.error().code == ErrorCode::invalid_argument);
  CHECK(contains(too_many.error().message, "KVLITE_MAX_CHAT_MESSAGES"));
  std::string huge(size_t(limits::max_prompt_bytes) + 1, 'a');
  Result<std::vector<int32_t>> ids = tokenizer.encode(huge, false);
  REQUIRE_FALSE(ids.ok());
  CHECK(ids.error().code == ErrorCode::invalid_argument);
  CHECK(contains(ids.error().message, "KVLITE_MAX_PROMPT_BYTES"));
  Result<std::string> long_chat = tokenizer.format_chat({{"user", huge}}, true);
  REQUIRE_FALSE(long_chat.ok());
  CHECK(contains(long_chat.error().message, "KVLITE_MAX_PROMPT_BYTES"));
}

// Regression (issue 15, defect 5): ids in tokenizer.json sized dense tables: a 6 KB file asked for 9.6 GB
// (a vocab id of 3e8) or 6.4 GB (an added-token id of 2e8), and a vocab id of 2^31 - 1 overflowed max_id + 1.
TEST_CASE("regression: tokenizer.json ids drove dense allocations") {
  auto expect_refused = [](const Result<Tokenizer>& tokenizer, std::initializer_list<const char*> parts) {
    REQUIRE_FALSE(tokenizer.ok());
    CHECK_MESSAGE(tokenizer.error().code == ErrorCode::bad_format, tokenizer.error().message);
    for (const char* part : parts) CHECK_MESSAGE(contains(tokenizer.error().message, part), tokenizer.error().message);
  };
  expect_refused(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = 300000000; }),
                 {"model.vocab['!']", "300000000", "KVLITE_MAX_VOCAB"});
  expect_refused(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = 2147483647; }),
                 {"2147483647", "KVLITE_MAX_VOCAB"});
  expect_refused(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = int64_t(1) << 40; }), {"KVLITE_MAX_VOCAB"});
  expect_refused(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = 4000000; }),
                 {"4000000", "KVLITE_MAX_TOKEN_ID_GAP"});
  expect_refused(load_edited("llama3", [](Json& j) { j["model"]["vocab"]["!"] = -1; }), {"-1", "non-negative"});
  expect_refused(load_edited("qwen2",
                             [](Json& j) {
                               j["added_tokens"].push_back({{"id", 200000000}, {"content", "<|hostile|>"}, {"special", true}});
                             }),
                 {"added_tokens", "200000000", "KVLITE_MAX_VOCAB"});
  expect_refused(load_edited("qwen2",
                             [](Json& j) {
                               j["added_tokens"].push_back({{"id", 3000000}, {"content", "<|hostile|>"}, {"special", true}});
                             }),
                 {"added_tokens", "3000000", "KVLITE_MAX_TOKEN_ID_GAP"});
  // a post-processor template naming an id that is no token
  expect_refused(load_edited("llama3",
                             [](Json& j) {
                               j["post_processor"] = {{"type", "TemplateProcessing"},
                                                      {"single", {{{"SpecialToken", {{"id", "<x>"}, {"type_id", 0}}}},
                                                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                                                      {"special_tokens", {{"<x>", {{"id", "<x>"}, {"ids", {5000}}, {"tokens", {"<x>"}}}}}}};
                             }),
                 {"5000", "not a token"});
  // JSON nested past the limit is refused before any reader recurses into it
  std::string deep = "{\"model\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_refused(Tokenizer::from_json(deep, ""), {"KVLITE_MAX_JSON_DEPTH"});
  // ids near the real sizes still load: an added token right after the vocabulary, as every real file has
  Result<Tokenizer> dense = load_edited("qwen2", [](Json& j) {
    j["added_tokens"].push_back({{"id", int64_t(j["model"]["vocab"].size()) + 1000}, {"content", "<|late|>"}, {"special", true}});
  });
  CHECK_MESSAGE(dense.ok(), dense.error().message);
}
