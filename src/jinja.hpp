// ---------------------------------------------------------------------------------------------------------
// jinja: the subset of Jinja2 that Hugging Face chat templates use, rendered as transformers renders them
// (ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks on, loop controls, `{% generation %}`, its own
// tojson, raise_exception, strftime_now, namespace, dict). The model's own chat template
// (tokenizer_config.json `chat_template` or chat_template.jinja) formats chats through this.
//
// Statements: if/elif/else, for (loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem/
// cycle, `for a, b in x`, `for x in y if cond`, for-else), break/continue, set (names, tuples, `ns.attr =`, block
// set), macro/call/caller(), generation, filter blocks, comments, whitespace control (`-`, `+`).
// Expressions: literals, lists, tuples, dicts, attributes, subscripts, slices, arithmetic, comparisons,
// and/or/not, in/not in, `~`, `x if c else y`, `is` tests, filters, and the str/dict methods templates call.
// Undefined values behave as jinja2's default Undefined. Anything else is refused when parsed (unsupported,
// naming the construct and the template line), never guessed.
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <memory>
#include <string>
#include <string_view>

namespace kvlite {

// ---- limits on templates and their rendering -------------------------------------------------------------
#ifndef KVLITE_MAX_TEMPLATE_BYTES
#define KVLITE_MAX_TEMPLATE_BYTES 1048576  // 1 MiB: real chat templates are 0.4 to 30 KiB
#endif
#ifndef KVLITE_MAX_TEMPLATE_DEPTH
#define KVLITE_MAX_TEMPLATE_DEPTH 64  // nesting of expressions and statements, and of macro calls while rendering
#endif
#ifndef KVLITE_MAX_TEMPLATE_STEPS
#define KVLITE_MAX_TEMPLATE_STEPS 10000000  // loop iterations plus evaluated nodes per render (Qwen3's template
                                           // over 65,536 messages takes about 4 M)
#endif
#ifndef KVLITE_MAX_TEMPLATE_OUTPUT_BYTES
#define KVLITE_MAX_TEMPLATE_OUTPUT_BYTES 67108864  // 64 MiB: also the most any one string value may hold
#endif
namespace limits {
constexpr int64_t max_template_bytes = KVLITE_MAX_TEMPLATE_BYTES;
constexpr int64_t max_template_depth = KVLITE_MAX_TEMPLATE_DEPTH;
constexpr int64_t max_template_steps = KVLITE_MAX_TEMPLATE_STEPS;
constexpr int64_t max_template_output_bytes = KVLITE_MAX_TEMPLATE_OUTPUT_BYTES;
}  // namespace limits

namespace detail {
namespace jinja {
struct Template;
}
}  // namespace detail

// A parsed template; immutable, cheap to copy, safe to render from many threads.
//
//   auto tpl = kvlite::ChatTemplate::parse("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}");
//   auto text = tpl->render(R"({"messages": [{"role": "user", "content": "hi"}]})");  // "user: hi"
//
// Errors: parse() gives bad_format for a syntax error and unsupported for a construct outside the subset, each
// naming the template line; render() gives invalid_argument for a template error (raise_exception's message,
// an undefined attribute, a type error), with the line. Both are bounded by the limits above.
class ChatTemplate {
 public:
  static Result<ChatTemplate> parse(std::string_view source);
  // `context_json`: a JSON object whose members become the template's variables (messages, tools,
  // add_generation_prompt, bos_token, ...); key order is kept, as Python dicts keep it.
  Result<std::string> render(std::string_view context_json) const;
  // strftime_now() uses this time (seconds since the epoch, local time zone) instead of the clock when set;
  // tests pin it.
  void set_now(int64_t unix_seconds) { now_ = unix_seconds; }

 private:
  std::shared_ptr<const detail::jinja::Template> template_;
  int64_t now_ = -1;
  friend class Tokenizer;
};

}  // namespace kvlite
