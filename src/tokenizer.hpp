// ---------------------------------------------------------------------------------------------------------
// tokenizer: BPE (byte-level or SentencePiece-style) read from a Hugging Face tokenizer.json (+
// tokenizer_config.json), encoding and decoding exactly as the `tokenizers` library does; a streaming
// detokenizer; ChatML and Llama-3 prompts.
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <string_view>

namespace kvlite {

namespace detail {
struct TokenizerData;
// NFC of valid UTF-8, from tables generated out of Python's unicodedata (what the NFC normalizer runs; the
// tests check it case by case).
std::string unicode_nfc(std::string_view valid_utf8);
const char* unicode_nfc_version();  // the Unicode version of those tables, e.g. "14.0.0"
}  // namespace detail

// ---- limits on tokenizer files and prompts -----------------------------------------------------------------
// Token ids in tokenizer.json are bounded by KVLITE_MAX_VOCAB (config.hpp) and must be dense: the largest id may
// exceed the number of entries by at most KVLITE_MAX_TOKEN_ID_GAP, so a small file cannot ask for a large table
// (real files: Qwen3 151,669 ids for 151,669 entries). Prompts and chat messages are bounded before any work.
#ifndef KVLITE_MAX_TOKEN_ID_GAP
#define KVLITE_MAX_TOKEN_ID_GAP 65536
#endif
#ifndef KVLITE_MAX_PROMPT_BYTES
#define KVLITE_MAX_PROMPT_BYTES 67108864  // 64 MiB of text: about 16 M tokens, the most any model here accepts
#endif
#ifndef KVLITE_MAX_CHAT_MESSAGES
#define KVLITE_MAX_CHAT_MESSAGES 65536
#endif
// Normalizer, pre-tokenizer and decoder steps in one tokenizer.json (each kind counted on its own): every step
// runs on every piece of every prompt (real files: at most 5).
#ifndef KVLITE_MAX_TOKENIZER_STEPS
#define KVLITE_MAX_TOKENIZER_STEPS 64
#endif
namespace limits {
constexpr int64_t max_pipeline_steps = KVLITE_MAX_TOKENIZER_STEPS;
constexpr int64_t max_token_id_gap = KVLITE_MAX_TOKEN_ID_GAP;
constexpr int64_t max_prompt_bytes = KVLITE_MAX_PROMPT_BYTES;
constexpr int64_t max_chat_messages = KVLITE_MAX_CHAT_MESSAGES;
}  // namespace limits

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (passed through as written)
  std::string content;
};

// The prompt layout format_chat writes, chosen at load from the tokenizer's special tokens (and the
// chat_template in tokenizer_config.json when both families' tokens are present).
enum class ChatFormat {
  none,    // neither family's tokens: format_chat refuses
  chatml,  // Qwen: <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
  llama3,  // <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ...
};
const char* chat_format_name(ChatFormat format);

// A loaded tokenizer. Immutable after load (its word cache is internally locked): copies are cheap handles
// to the same data, and encode/decode may run concurrently from many threads.
//
// What it reads from tokenizer.json (anything else is refused as unsupported, naming the type and its JSON
// path, e.g. "pre_tokenizer.pretokenizers[1].type 'Foo'"):
//   model          BPE with vocab + merges ("a b" strings or ["a", "b"] pairs), ignore_merges, unk_token,
//                  fuse_unk, byte_fallback (<0xXX> tokens), dropout null or 0
//   normalizer     null, Sequence, NFC, NFKC, Lowercase, Strip, Prepend, Replace (String or Regex pattern)
//   pre_tokenizer  null, Sequence, ByteLevel (add_prefix_space, use_regex), Metaspace (replacement,
//                  prepend_scheme always / first / never, split), Split (Regex or String pattern; every
//                  behavior; invert), Digits (individual_digits), Punctuation, Whitespace, WhitespaceSplit;
//                  regexes run on PCRE2 with Unicode properties
//   post_processor null, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing, or a Sequence
//   decoder        null, Sequence, ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace
//   added_tokens   matched before pre-tokenization, leftmost-longest, honouring lstrip, rstrip,
//                  single_word, normalized and special
// That covers the files of GPT-2, Llama-2/3.x, Mistral, Qwen2.5/3, Gemma 2/3, Phi-3.5/4 and SmolLM2.
class Tokenizer {
 public:
  // Reads <model_dir>/tokenizer.json and, when present, <model_dir>/tokenizer_config.json (bos/eos tokens,
  // chat_template).
  static Result<Tokenizer> load(const std::string& model_dir);
  // The same from the two files' text (tokenizer_config_json may be empty).
  static Result<Tokenizer> from_json(const std::string& tokenizer_json, const std::string& tokenizer_config_json);

  // Text (valid UTF-8, else invalid_argument naming the byte offset) to ids. add_special_tokens applies the
  // post-processor's template (Llama-3 prepends <|begin_of_text|>; Qwen adds nothing). Special tokens
  // written in the text are always recognised, as HF does.
  Result<std::vector<int32_t>> encode(std::string_view text, bool add_special_tokens) const;
  // Ids to text; bytes that do not form UTF-8 become U+FFFD, as HF's lossy decoding does. An id with no
  // token is invalid_argument. skip_special_tokens drops added tokens marked special.
  Result<std::string> decode(const int32_t* ids, size_t count, bool skip_special_tokens) const;
  Result<std::string> decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
    return decode(ids.data(), ids.size(), skip_special_tokens);
  }

  // The id of a token as written in the vocabulary ("Ġthe", "<|im_end|>"), or -1.
  int32_t token_id(std::string_view token) const;
  // The vocabulary string of an id ("Ġthe"), or "" for an id with no token.
  std::string token_text(int32_t id) const;
  // The text an id decodes to on its own, not first in the text (" the"; a <0xXX> token gives its raw byte);
  // "" for an id with no token.
  std::string token_bytes(int32_t id) const;
  // One past the largest id (model vocabulary and added tokens together).
  size_t vocab_size() const;
  // tokenizer_config.json's bos_token / eos_token, or -1 when it names none.
  int32_t bos_id() const;
  int32_t eos_id() const;
  // An added token marked special (skipped by skip_special_tokens).
  bool is_special(int32_t id) const;

  // The family of the fallback prompt layout, for models that ship no chat template.
  ChatFormat chat_format() const;
  // The prompt for `messages`, rendered by the model's own chat template when it ships one (tokenizer_config.json
  // chat_template, or chat_template.jinja in the model directory; run by kvlite's Jinja interpreter, jinja.hpp),
  // else in the ChatML or Llama-3 layout chat_format() names. add_generation_prompt opens an assistant turn.
  // The text already holds the special tokens (<|begin_of_text|>, <bos>...): encode it with
  // add_special_tokens = false. Unsupported when there is neither a template nor a fallback format, or when the
  // template uses Jinja outside kvlite's subset (the error names the construct and line); invalid_argument when the
  // template raises (e.g. Gemma's "Conversation roles must alternate").
  Result<std::string> format_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // The model's template over messages as JSON, the way transformers' apply_chat_template takes them: an array of
  // {"role", "content" (a string or a list of parts such as {"type": "image"}), "tool_calls", "reasoning_content",
  // ...}; extra_json is a JSON object of further variables ("tools": [...], "enable_thinking": false, ...).
  // bos_token, eos_token, unk_token and pad_token come from tokenizer_config.json. Unsupported without a template.
  Result<std::string> apply_chat_template(std::string_view messages_json, bool add_generation_prompt,
                                          std::string_view extra_json = "{}") const;
  bool has_chat_template() const;
  const std::string& chat_template() const;  // its source text ("" when the model ships none)

 private:
  friend class StreamingDecoder;
  Tokenizer() = default;
  std::string render_chat_template(std::string_view messages_json, bool add_generation_prompt,
                                   std::string_view extra_json) const;
  std::shared_ptr<const detail::TokenizerData> data_;
};

// Turns ids into text one at a time for streaming output. A UTF-8 character whose bytes are split across
// tokens (byte-level or <0xXX> tokens) is held back until its last byte arrives; the concatenation of every push() and the final flush()
// equals tokenizer.decode(all ids) while at most 64 ids are held back at once. Past that bound what is held is let
// out as it reads so far, which later ids can contradict: a run of <0xXX> tokens that turns out not to be valid
// UTF-8 decodes to one U+FFFD per token, after the stream gave its valid characters (a decoder that holds a
// bounded number of ids cannot wait for the end of an unbounded run).
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  // The text that became complete with this id (often "", e.g. mid-character). invalid_argument for an id
  // with no token.
  Result<std::string> push(int32_t id);
  // Whatever is held back (an incomplete character becomes U+FFFD); the decoder is then empty.
  std::string flush();

 private:
  static constexpr size_t kMaxHeldIds = 64;
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> window_;  // the context ids (already returned), then the ids held back
  size_t context_ids_ = 0;       // how many ids of window_ are context
  std::string emitted_;          // the part of decode(window_) already returned (all of the context's)
};

}  // namespace kvlite
