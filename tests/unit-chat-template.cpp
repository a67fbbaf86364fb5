// chat templates: kvlite's Jinja interpreter (jinja.hpp) against transformers' render_jinja_template on the real
// templates of every supported family, and construct by construct against jinja2 (tests/fixtures/chat_templates,
// written by tools/make_chat_template_fixtures.py); the Tokenizer hook-up (tokenizer_config.json chat_template,
// chat_template.jinja, the ChatML / Llama-3 fallback); errors with lines; limits.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <unistd.h>
#include <fstream>
#include <sstream>
#include "kvlite.hpp"
using namespace kvlite;
using OJson = nlohmann::ordered_json;

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
const OJson& fixtures() {
  static const OJson data = OJson::parse(read_file(fixture_path("chat_templates/cases.json")));
  return data;
}
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A case either renders to `expected` byte for byte, or fails where jinja2 raised; raise_exception's message and a
// syntax error's line must match jinja2's.
void check_case(const ChatTemplate& tpl, const OJson& c) {
  Result<std::string> out = tpl.render(c["context"].dump());
  if (c.contains("expected")) {
    REQUIRE_MESSAGE(out.ok(), out.error().message);
    CHECK(*out == c["expected"].get<std::string>());
  } else {
    REQUIRE_FALSE_MESSAGE(out.ok(), "rendered " << *out << " where jinja2 raised " << c["message"]);
    if (c["error"] == "TemplateError")  // raise_exception
      CHECK_MESSAGE(contains(out.error().message, "raise_exception: " + c["message"].get<std::string>()), out.error().message);
  }
}
}  // namespace

TEST_CASE("the real chat templates of every family render byte-equal to transformers") {
  const OJson& data = fixtures();
  std::map<std::string, ChatTemplate> templates;
  for (auto it = data["templates"].begin(); it != data["templates"].end(); ++it) {
    Result<ChatTemplate> tpl = ChatTemplate::parse(read_file(fixture_path("chat_templates/" + it.value()["file"].get<std::string>())));
    REQUIRE_MESSAGE(tpl.ok(), it.key() << ": " << tpl.error().message);
    tpl->set_now(data["now_unix"].get<int64_t>());
    templates.emplace(it.key(), *tpl);
  }
  std::map<std::string, int> rendered, raised;
  for (const OJson& c : data["cases"]) {
    INFO(c["name"].get<std::string>());
    check_case(templates.at(c["family"].get<std::string>()), c);
    (c.contains("expected") ? rendered : raised)[c["family"].get<std::string>()]++;
  }
  CHECK(templates.size() == 11);
  for (const auto& family : templates) {
    INFO(family.first);
    CHECK(rendered[family.first] >= 10);  // every family renders a real corpus, not only errors
  }
  CHECK(raised["gemma2"] > 0);  // "Conversation roles must alternate", "System role not supported"
  CHECK(raised["mistral-v0.3"] > 0);
}

TEST_CASE("each Jinja construct renders as jinja2 renders it, and fails where jinja2 fails") {
  const OJson& data = fixtures();
  int checked = 0;
  for (const OJson& c : data["interpreter"]) {
    INFO(c["name"].get<std::string>());
    Result<ChatTemplate> tpl = ChatTemplate::parse(c["template"].get<std::string>());
    if (c.contains("error") && c["error"] == "syntax") {
      REQUIRE_FALSE(tpl.ok());
      CHECK(tpl.error().code == ErrorCode::bad_format);
      CHECK_MESSAGE(contains(tpl.error().message, "line " + std::to_string(c["line"].get<int>()) + ":"), tpl.error().message);
      checked++;
      continue;
    }
    REQUIRE_MESSAGE(tpl.ok(), tpl.error().message);
    tpl->set_now(data["now_unix"].get<int64_t>());
    check_case(*tpl, c);
    checked++;
  }
  CHECK(checked >= 60);
}

TEST_CASE("render errors name the template line") {
  ChatTemplate tpl = ChatTemplate::parse("one\ntwo\n{{ messages[0].content.missing.deeper }}").value();
  Result<std::string> out = tpl.render(R"({"messages": [{"content": {}}]})");
  REQUIRE_FALSE(out.ok());
  CHECK(out.error().code == ErrorCode::invalid_argument);
  CHECK(contains(out.error().message, "chat template line 3: 'dict object' has no attribute 'missing'"));
  Result<std::string> raised = ChatTemplate::parse("\n\n\n{{ raise_exception('no tools here') }}").value().render("{}");
  REQUIRE_FALSE(raised.ok());
  CHECK(contains(raised.error().message, "line 4: raise_exception: no tools here"));
}

TEST_CASE("constructs outside the subset are refused when parsed, naming the construct and line") {
  const std::pair<const char*, const char*> refused[] = {
      {"ok\n{% include 'x.jinja' %}", "line 2: the statement 'include'"},
      {"{{ x | wordwrap }}", "line 1: the filter 'wordwrap'"},
      {"a\nb\n{% if x is prime %}{% endif %}", "line 3: the test 'prime'"},
      {"{% for x in y recursive %}{% endfor %}", "line 1: recursive for loops"},
      {"{{ f(*args) }}", "*args"},
  };
  for (const auto& r : refused) {
    INFO(r.first);
    Result<ChatTemplate> tpl = ChatTemplate::parse(r.first);
    REQUIRE_FALSE(tpl.ok());
    CHECK(tpl.error().code == ErrorCode::unsupported);
    CHECK_MESSAGE(contains(tpl.error().message, r.second), tpl.error().message);
  }
}

TEST_CASE("templates and their rendering are bounded by named limits") {
  std::string huge(size_t(limits::max_template_bytes) + 1, 'x');
  Result<ChatTemplate> too_big = ChatTemplate::parse(huge);
  REQUIRE_FALSE(too_big.ok());
  CHECK(contains(too_big.error().message, "KVLITE_MAX_TEMPLATE_BYTES"));

  std::string deep = "{{ " + std::string(size_t(limits::max_template_depth) + 8, '(') + "1" +
                     std::string(size_t(limits::max_template_depth) + 8, ')') + " }}";
  Result<ChatTemplate> too_deep = ChatTemplate::parse(deep);
  REQUIRE_FALSE(too_deep.ok());
  CHECK(contains(too_deep.error().message, "KVLITE_MAX_TEMPLATE_DEPTH"));

  Result<std::string> recursion =
      ChatTemplate::parse("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}").value().render("{}");
  REQUIRE_FALSE(recursion.ok());
  CHECK(contains(recursion.error().message, "KVLITE_MAX_TEMPLATE_DEPTH"));

  Result<std::string> endless =
      ChatTemplate::parse("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}").value().render("{}");
  REQUIRE_FALSE(endless.ok());
  CHECK(contains(endless.error().message, "KVLITE_MAX_TEMPLATE_STEPS"));

  Result<std::string> big_output =
      ChatTemplate::parse("{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}").value().render("{}");
  REQUIRE_FALSE(big_output.ok());
  CHECK(contains(big_output.error().message, "KVLITE_MAX_TEMPLATE_OUTPUT_BYTES"));

  Result<std::string> big_string = ChatTemplate::parse("{{ 'ab' * 100000000000 }}").value().render("{}");
  REQUIRE_FALSE(big_string.ok());
  CHECK(contains(big_string.error().message, "KVLITE_MAX_TEMPLATE_OUTPUT_BYTES"));

  Result<std::string> nested = ChatTemplate::parse(
      "{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|length }}")
                                   .value().render("{}");
  REQUIRE_FALSE(nested.ok());
  CHECK(contains(nested.error().message, "KVLITE_MAX_JSON_DEPTH"));
}

TEST_CASE("the Tokenizer formats chats through the model's own template") {
  // qwen2's tokenizer_config.json ships Qwen2.5's template: format_chat now runs it (the bundled chat cases in
  // test-tokenizer keep checking the text against transformers).
  Result<Tokenizer> qwen = Tokenizer::load(fixture_path("tokenizers/qwen2"));
  REQUIRE_MESSAGE(qwen.ok(), qwen.error().message);
  CHECK(qwen->has_chat_template());
  CHECK(contains(qwen->chat_template(), "<|im_start|>"));
  // The JSON form takes what transformers takes: content parts, tool calls, tools, extra variables.
  const OJson& data = fixtures();
  int compared = 0;
  for (const OJson& c : data["cases"]) {
    if (c["family"] != "qwen2.5" || !c.contains("expected")) continue;
    const OJson& context = c["context"];
    OJson extra = OJson::object();
    if (!context["tools"].is_null()) extra["tools"] = context["tools"];
    Result<std::string> out = qwen->apply_chat_template(context["messages"].dump(), context["add_generation_prompt"].get<bool>(), extra.dump());
    INFO(c["name"].get<std::string>());
    REQUIRE_MESSAGE(out.ok(), out.error().message);
    CHECK(*out == c["expected"].get<std::string>());
    compared++;
  }
  CHECK(compared >= 10);

  // A tokenizer_config.json without chat_template keeps the ChatML fallback.
  std::string tokenizer_json = read_file(fixture_path("tokenizers/qwen2/tokenizer.json"));
  OJson config = OJson::parse(read_file(fixture_path("tokenizers/qwen2/tokenizer_config.json")));
  config.erase("chat_template");
  Result<Tokenizer> plain = Tokenizer::from_json(tokenizer_json, config.dump());
  REQUIRE_MESSAGE(plain.ok(), plain.error().message);
  CHECK_FALSE(plain->has_chat_template());
  CHECK(plain->format_chat({{"user", "hi"}}, true).value() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(plain->apply_chat_template(R"([{"role": "user", "content": "hi"}])", true).error().code == ErrorCode::unsupported);

  // A template outside the subset leaves encode/decode working and makes format_chat say why.
  config["chat_template"] = "{% for m in messages %}{{ m.content | wordwrap }}{% endfor %}";
  Result<Tokenizer> odd = Tokenizer::from_json(tokenizer_json, config.dump());
  REQUIRE_MESSAGE(odd.ok(), odd.error().message);
  CHECK(odd->encode("hi", false).ok());
  Result<std::string> refused = odd->format_chat({{"user", "hi"}}, true);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::unsupported);
  CHECK(contains(refused.error().message, "the filter 'wordwrap'"));

  // A list of named templates: the one named "default".
  config["chat_template"] = OJson::array({{{"name", "tool_use"}, {"template", "TOOLS"}}, {{"name", "default"}, {"template", "{{ messages[0].content }}!"}}});
  Result<Tokenizer> named = Tokenizer::from_json(tokenizer_json, config.dump());
  REQUIRE_MESSAGE(named.ok(), named.error().message);
  CHECK(named->format_chat({{"user", "hi"}}, false).value() == "hi!");
}

TEST_CASE("chat_template.jinja in the model directory is the template transformers reads first") {
  std::string dir = (std::filesystem::temp_directory_path() / ("kvlite-chat-template-" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(dir);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    std::ofstream(dir + "/" + name, std::ios::binary) << read_file(fixture_path(std::string("tokenizers/qwen2/") + name));
  }
  std::ofstream(dir + "/chat_template.jinja", std::ios::binary)
      << read_file(fixture_path("chat_templates/gemma3.jinja"));
  Result<Tokenizer> tokenizer = Tokenizer::load(dir);
  REQUIRE_MESSAGE(tokenizer.ok(), tokenizer.error().message);
  // Gemma 3's layout, with qwen2's special tokens (bos_token is null: undefined to the template, printed as "").
  CHECK(tokenizer->format_chat({{"system", "Be brief."}, {"user", " hi "}}, true).value() ==
        "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n");
  Result<std::string> alternating = tokenizer->format_chat({{"user", "a"}, {"user", "b"}}, false);
  REQUIRE_FALSE(alternating.ok());
  CHECK(alternating.error().code == ErrorCode::invalid_argument);
  CHECK(contains(alternating.error().message, "Conversation roles must alternate user/assistant/user/assistant/..."));
}
