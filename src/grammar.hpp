// ---------------------------------------------------------------------------------------------------------
// grammar: constrained decoding. A context-free grammar in GBNF (llama.cpp's notation) or a JSON schema
// compiled to one, matched code point by code point by a pushdown recognizer, and turned into a mask over the
// model's vocabulary at each step, so that every output is a sentence of the grammar.
//
//   root   ::= "{" ws "\"name\"" ws ":" ws string ws "}"     rules: name ::= alternatives, one per line
//   string ::= "\"" ( [^"\\] | "\\" ["\\nt] )* "\""           "literal", [class], [^negated], . any
//   ws     ::= [ \t\n]{0,20}                                  ( group ), x* x+ x? x{m} x{m,} x{m,n}, # comment
//
// The recognizer keeps the set of parse stacks alive after the text so far (as llama.cpp's grammar sampler
// does); a token is allowed when its bytes, read on from that state, leave a stack alive. Masks are computed
// over a trie of the vocabulary (a rejected prefix skips every token under it) and remembered per parse state,
// so a state seen before (inside a string, between list items) costs a lookup: the cost per token is one trie
// walk per new state, not per token.
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <map>
#include <unordered_map>

namespace kvlite {

// Bytes of a grammar's source text (SamplingParams::grammar).
#ifndef KVLITE_MAX_GRAMMAR_BYTES
#define KVLITE_MAX_GRAMMAR_BYTES (256 * 1024)
#endif
// Bytes of a JSON schema (SamplingParams::json_schema); its nesting is bounded by KVLITE_MAX_JSON_DEPTH.
#ifndef KVLITE_MAX_SCHEMA_BYTES
#define KVLITE_MAX_SCHEMA_BYTES (256 * 1024)
#endif
// Elements of a compiled grammar (characters classes, rule references; x{m,n} is expanded into n copies).
#ifndef KVLITE_MAX_GRAMMAR_ELEMENTS
#define KVLITE_MAX_GRAMMAR_ELEMENTS (1 << 20)
#endif
// The largest bound of one repetition, x{m,n}.
#ifndef KVLITE_MAX_GRAMMAR_REPEAT
#define KVLITE_MAX_GRAMMAR_REPEAT 4096
#endif
// Parse stacks alive at once (an ambiguous grammar multiplies them) and the depth of one stack (nesting):
// a token whose text would pass either bound is not allowed.
#ifndef KVLITE_MAX_GRAMMAR_STACKS
#define KVLITE_MAX_GRAMMAR_STACKS 256
#endif
#ifndef KVLITE_MAX_GRAMMAR_DEPTH
#define KVLITE_MAX_GRAMMAR_DEPTH 1024
#endif
// Vocabulary masks remembered per compiled grammar (each vocab / 8 bytes); past it the oldest half goes.
#ifndef KVLITE_MAX_GRAMMAR_MASKS
#define KVLITE_MAX_GRAMMAR_MASKS 512
#endif
namespace limits {
constexpr int64_t max_grammar_bytes = KVLITE_MAX_GRAMMAR_BYTES;
constexpr int64_t max_schema_bytes = KVLITE_MAX_SCHEMA_BYTES;
constexpr int64_t max_grammar_elements = KVLITE_MAX_GRAMMAR_ELEMENTS;
constexpr int64_t max_grammar_repeat = KVLITE_MAX_GRAMMAR_REPEAT;
constexpr int64_t max_grammar_stacks = KVLITE_MAX_GRAMMAR_STACKS;
constexpr int64_t max_grammar_depth = KVLITE_MAX_GRAMMAR_DEPTH;
constexpr int64_t max_grammar_masks = KVLITE_MAX_GRAMMAR_MASKS;
}  // namespace limits

// A compiled grammar: immutable, shared by every request that uses it. The start rule is `root`.
class Grammar {
 public:
  // Parses GBNF. Errors (bad_format) give the line and column; an undefined rule, a missing root and left
  // recursion (a rule that can reach itself without reading a character) are refused by name.
  static Result<std::shared_ptr<const Grammar>> parse(std::string_view gbnf);
  // Compiles a JSON schema (its text) to GBNF: type (one or a list), properties (in their order), required,
  // additionalProperties (false, or a schema for a map when there are no properties), enum, const, items,
  // prefixItems, minItems/maxItems, minLength/maxLength, pattern (a regular expression: literals, ., classes,
  // \d \w \s, groups, |, * + ? {m,n}), format (date, time, date-time, uuid, email), integer minimum/maximum
  // (exclusive too), anyOf/oneOf, allOf of one schema, $ref to #/$defs/... or #/definitions/... (recursive
  // ones too). A keyword that would restrict the output and is not listed is refused (unsupported) rather than
  // ignored; annotations (title, description, default, examples, $schema, $id, $comment) are skipped. The JSON
  // is on one line with at most one space between tokens (a small model given free whitespace spends its tokens
  // on it), numbers of at most 16 integer and 16 fraction digits and 2 exponent digits, properties in the
  // schema's order; an object with properties has no others.
  static Result<std::string> json_schema_to_gbnf(std::string_view schema_json);
  // GBNF for any JSON value whose top level is an object (OpenAI's response_format json_object).
  static std::string json_object_gbnf();

  struct Element {
    enum Kind : uint8_t { end, chars, rule } kind = end;
    int32_t value = 0;  // chars: index into char_sets; rule: rule index
  };
  struct CharSet {
    bool negated = false;
    std::vector<std::pair<uint32_t, uint32_t>> ranges;  // inclusive code point ranges
    bool contains(uint32_t cp) const;
    bool intersects(uint32_t lo, uint32_t hi) const;  // some code point in [lo, hi] is in the set
  };
  std::vector<Element> elements;                    // alternatives, each ended by an `end` element
  std::vector<std::vector<int32_t>> rules;          // per rule: the element index where each alternative starts
  std::vector<std::string> rule_names;
  std::vector<CharSet> char_sets;
  int32_t root = -1;
  // Per element position: the fewest characters that finish its alternative from there (kNever: none do),
  // the ground of GrammarMatcher::min_completion.
  std::vector<int64_t> suffix_min;
  static constexpr int64_t kNever = int64_t(1) << 40;
};

// The parse state after some text: the stacks alive (each a list of element positions, the top last) and the
// bytes of a character not yet complete. Cheap to copy for small grammars.
struct GrammarState {
  std::vector<std::vector<int32_t>> stacks;  // sorted, unique; an empty stack means the text is a sentence
  uint8_t partial[4] = {0, 0, 0, 0};
  uint8_t partial_len = 0, partial_need = 0;  // bytes held, bytes the character has in all
};

// Reads text against a grammar.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);
  // Reads bytes on; false (and the state unchanged) when they cannot continue a sentence.
  bool accept(std::string_view bytes);
  // The text so far is a whole sentence (the output may end here).
  bool complete() const;
  // Some text may still follow.
  bool can_continue() const;
  const GrammarState& state() const { return state_; }
  const Grammar& grammar() const { return *grammar_; }
  // The state after `bytes` read on from `from`; false when they cannot be read (or pass the stack limits).
  static bool advance(const Grammar& grammar, const GrammarState& from, std::string_view bytes, GrammarState& to);
  // The fewest bytes after which the text read so far is a whole sentence (0: it is one): an upper bound on the
  // tokens needed when the vocabulary has a token for each byte (byte-level vocabularies do).
  static int64_t min_completion(const Grammar& grammar, const GrammarState& state);
  int64_t min_completion() const { return min_completion(*grammar_, state_); }

 private:
  std::shared_ptr<const Grammar> grammar_;
  GrammarState state_;
};

// The vocabulary as the mask sees it: each token's bytes as the decoder writes them (Tokenizer::token_bytes) in
// a trie, the special tokens left out (a constrained output never contains one; end-of-turn tokens are allowed
// separately, when the grammar is complete).
class GrammarVocabulary {
 public:
  // token_bytes[id]; `excluded[id]` (optional, same size) marks ids never allowed (special tokens, holes).
  GrammarVocabulary(const std::vector<std::string>& token_bytes, const std::vector<uint8_t>& excluded);
  int64_t size() const { return vocab_; }
  struct Node {
    uint8_t byte = 0;
    int32_t depth = 0;         // bytes from the root (1 for a first byte)
    int32_t subtree_end = 0;   // index one past this node's last descendant (nodes are in preorder)
    int32_t tokens_begin = 0, tokens_end = 0;  // ids in token_ids whose bytes end here
  };
  std::vector<Node> nodes;          // preorder; no root node
  std::vector<int32_t> token_ids;

 private:
  int64_t vocab_ = 0;
};

// The allowed tokens in one state, as a bitset over the vocabulary (bit id % 64 of word id / 64).
using TokenMask = std::vector<uint64_t>;

// One grammar over one vocabulary: computes masks and remembers them per state. Not thread-safe (the engine
// uses it under its lock).
class GrammarMasker {
 public:
  GrammarMasker(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary);
  // The tokens whose bytes can be read on from `state` (end-of-turn tokens are not in it: see
  // GrammarMatcher::complete). *most_after (when given) receives the largest min_completion any of them leaves.
  const TokenMask& mask(const GrammarState& state, int64_t* most_after = nullptr);
  // The tokens of mask(state) that leave at most `budget` characters to complete the sentence: with a token
  // budget of B left, a token that leaves more than B - 1 could not be finished in time (max_tokens, or the
  // context's end). Not remembered (it depends on the budget); the engine asks only when mask's most_after says
  // some token would break the budget.
  void mask_within(const GrammarState& state, int64_t budget, TokenMask& out);
  // What the engine asks each step: mask(state) when every allowed token leaves at most `budget` bytes to
  // complete (or budget < 0: no budget), else the tokens of it that do. Remembered per state with the mask: the
  // few tokens that leave more than kHeavyMargin bytes beyond the state's own shortest completion (a token that
  // opens a long required object), so a budget above that margin costs a copy of the mask, not a trie walk;
  // closer to the end it walks (mask_within). `scratch` holds the result when it is not the remembered mask.
  const TokenMask& mask_for_budget(const GrammarState& state, int64_t budget, TokenMask& scratch);
  static constexpr int64_t kHeavyMargin = 32;
  static constexpr size_t kMaxHeavy = 4096;  // past it a state's heavy tokens are not listed (walk instead)
  static constexpr size_t kMaxAfterEntries = 32;
  static constexpr uint16_t kAfterUnknown = 65535;
  int64_t masks_computed() const { return computed_; }
  int64_t masks_reused() const { return reused_; }
  const Grammar& grammar() const { return *grammar_; }
  const std::shared_ptr<const Grammar>& grammar_ptr() const { return grammar_; }

 private:
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const GrammarVocabulary> vocabulary_;
  struct Entry {
    int64_t last_use = 0;
    int64_t most_after = 0;
    int64_t shortest = 0;                                // the state's own min_completion
    std::vector<std::pair<int64_t, int32_t>> heavy;      // (bytes left after, id) past shortest + kHeavyMargin
    bool heavy_listed = true;                            // false: more than kMaxHeavy of them
    // Once a budget closer than the margin has been asked for here: the bytes each token leaves to complete
    // (kAfterUnknown: that many or more), so that later budgets in this state (a string's characters near
    // max_tokens) filter the mask instead of walking the trie. At most kMaxAfterEntries entries hold one (two bytes
    // a token).
    std::vector<uint16_t> after;
    TokenMask mask;
  };
  std::unordered_map<std::string, Entry> cache_;  // state key -> its mask
  int64_t clock_ = 0, computed_ = 0, reused_ = 0;
  // The trie walk: the tokens readable from `state` (and leaving at most `budget` to complete, when >= 0).
  int64_t compute(const GrammarState& state, int64_t budget, TokenMask& mask, Entry* entry = nullptr,
                  std::vector<uint16_t>* after_out = nullptr);
  Entry& entry(const GrammarState& state);
};

// ---- tool calls ----------------------------------------------------------------------------------------------
// How a model writes a tool call, as its chat template shows it:
//   hermes       <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Qwen2.5, Qwen3, Hermes; several
//                calls one after another, a newline between)
//   llama3_json  {"name": "f", "parameters": {...}}                           (Llama-3.1/3.2's JSON form; one call)
enum class ToolCallSyntax { hermes, llama3_json };
const char* tool_call_syntax_name(ToolCallSyntax syntax);
// The syntax a chat template's text writes (llama3_json for Llama-3's "parameters" form; hermes otherwise).
ToolCallSyntax tool_call_syntax_of(std::string_view chat_template);
// GBNF for tool calls of the OpenAI `tools` array (its JSON text: [{"type": "function", "function": {"name",
// "parameters" (a JSON schema; absent: any object)}}]): a call of `only` ("" any of them), one or (parallel, hermes
// only) more. Tool names must be 1-64 of [A-Za-z0-9_.-]; at most KVLITE_MAX_TOOLS tools.
#ifndef KVLITE_MAX_TOOLS
#define KVLITE_MAX_TOOLS 128
#endif
Result<std::string> tool_calls_gbnf(std::string_view tools_json, ToolCallSyntax syntax, const std::string& only,
                                    bool parallel);
struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object's text, as OpenAI's function.arguments
};
struct ParsedToolCalls {
  std::vector<ToolCall> calls;  // in order
  std::string content;          // the text outside them, trimmed ("" when only calls)
};
// Finds the calls in a generated text (what tool_calls_gbnf allows, or a model's free text in that syntax): a
// call whose JSON does not parse, or lacks a string "name" and an object of arguments, stays in the content.
ParsedToolCalls parse_tool_calls(const std::string& text, ToolCallSyntax syntax);

inline bool token_mask_allows(const TokenMask& mask, int32_t id) {
  return id >= 0 && size_t(id) / 64 < mask.size() && (mask[size_t(id) / 64] >> (id % 64)) & 1u;
}

}  // namespace kvlite
