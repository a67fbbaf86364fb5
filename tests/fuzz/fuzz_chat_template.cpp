// libFuzzer harness: kvlite's Jinja interpreter (jinja.hpp) and the Tokenizer's template path. Byte 0 even: the
// rest is a template, parsed and rendered over a conversation with a system turn, tool calls, tools and image
// parts. Odd: byte 1 picks one of the real templates of tests/fixtures/chat_templates, and the rest is message
// JSON, rendered as the whole variable set, as the messages of one, and through Tokenizer::apply_chat_template.
// Every outcome is text or a typed error, within the template limits.
#include <fstream>
#include <sstream>
#include <vector>
#include "fuzz_support.hpp"

namespace {
const char* const kFamilies[] = {"gemma2", "gemma3", "llama3.1", "llama3.2", "mistral-v0.3",
                                 "phi3.5", "phi4-mini", "qwen2.5", "qwen3", "qwen3-vl", "smollm2"};

const std::vector<kvlite::ChatTemplate>& real_templates() {
  static const std::vector<kvlite::ChatTemplate> templates = [] {
    std::vector<kvlite::ChatTemplate> list;
    for (const char* family : kFamilies) {
      std::ifstream in(fuzz::source_dir() + "/tests/fixtures/chat_templates/" + family + ".jinja", std::ios::binary);
      std::ostringstream text;
      text << in.rdbuf();
      list.push_back(kvlite::ChatTemplate::parse(text.str()).value());
    }
    return list;
  }();
  return templates;
}

const char* const kConversation = R"({"messages": [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?  "}]},
  {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function",
    "function": {"name": "look", "arguments": {"what": "image", "n": 2, "x": 1.5, "ok": true, "none": null}}}]},
  {"role": "tool", "tool_call_id": "call12345", "content": "a cat"},
  {"role": "assistant", "content": "<think>\nok\n</think>\n\nA cat.", "reasoning_content": "ok"},
  {"role": "user", "content": "\u00e9\u4e16 \ud83c\udf89 thanks"}],
  "tools": [{"type": "function", "function": {"name": "look", "description": "Look", "parameters": {"type": "object",
    "properties": {"what": {"type": "string"}}, "required": ["what"]}}}],
  "documents": null, "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false})";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  const uint8_t mode = in.byte();
  if (mode & 1) {
    const std::vector<kvlite::ChatTemplate>& templates = real_templates();
    const kvlite::ChatTemplate& tpl = templates[in.byte() % templates.size()];
    const std::string messages = in.rest();
    fuzz::expect_typed(tpl.render(messages), "render(fuzzed variables)");
    fuzz::expect_typed(tpl.render(R"({"add_generation_prompt": true, "bos_token": "<s>", "messages": )" + messages + "}"),
                       "render(fuzzed messages)");
    fuzz::expect_typed(fuzz::fixture_tokenizer(0).apply_chat_template(messages, mode & 2, R"({"enable_thinking": false})"),
                       "apply_chat_template");
    return 0;
  }
  auto tpl = kvlite::ChatTemplate::parse(in.rest());
  fuzz::expect_typed(tpl, "ChatTemplate::parse");
  if (!tpl.ok()) return 0;
  fuzz::expect_typed(tpl->render(kConversation), "render(conversation)");
  fuzz::expect_typed(tpl->render("{}"), "render({})");
  return 0;
}
