// libFuzzer harness: constrained decoding's parsers and recognizer (grammar.hpp). Byte 0 even: the rest after
// byte 1 is GBNF; odd: it is a JSON schema, compiled to GBNF (which must then parse: the compiler writes only
// grammars its parser reads). Byte 1 seeds a walk of up to 48 tokens over the first 4,096 ids of the Qwen2
// tokenizer: at each step the trie mask must agree with each sampled token checked on its own, and the shortest
// completion must be reachable (0 exactly when the text is a sentence). Every outcome is a grammar or a typed
// error, within the named limits.
#include <random>
#include "fuzz_support.hpp"

namespace {
const std::shared_ptr<const kvlite::GrammarVocabulary>& vocabulary() {
  static const std::shared_ptr<const kvlite::GrammarVocabulary> v = [] {
    const kvlite::Tokenizer& t = fuzz::fixture_tokenizer(0);
    std::vector<std::string> bytes(4096);
    std::vector<uint8_t> excluded(4096, 0);
    for (int32_t id = 0; id < 4096; id++) {
      bytes[size_t(id)] = t.token_bytes(id);
      excluded[size_t(id)] = t.is_special(id);
    }
    return std::make_shared<const kvlite::GrammarVocabulary>(bytes, excluded);
  }();
  return v;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool schema = data[0] & 1;
  std::mt19937 rng(data[1]);
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  std::string gbnf = text;
  if (schema) {
    auto compiled = kvlite::Grammar::json_schema_to_gbnf(text);
    fuzz::expect_typed(compiled, "json_schema_to_gbnf");
    if (!compiled) return 0;
    gbnf = *compiled;
  }
  auto grammar = kvlite::Grammar::parse(gbnf);
  fuzz::expect_typed(grammar, "Grammar::parse");
  if (!grammar) {
    if (schema) {
      fprintf(stderr, "a compiled schema does not parse: %s\n%s\n", grammar.error().message.c_str(), gbnf.c_str());
      abort();
    }
    return 0;
  }
  const kvlite::Grammar& g = **grammar;
  kvlite::GrammarMasker masker(*grammar, vocabulary());
  kvlite::GrammarMatcher matcher(*grammar);
  const kvlite::Tokenizer& t = fuzz::fixture_tokenizer(0);
  for (int step = 0; step < 48 && matcher.can_continue(); step++) {
    const kvlite::TokenMask& mask = masker.mask(matcher.state());
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < 4096; id++)
      if (kvlite::token_mask_allows(mask, id)) allowed.push_back(id);
    for (int k = 0; k < 64; k++) {  // the mask against each token checked alone
      const int32_t id = int32_t(rng() % 4096);
      kvlite::GrammarState next;
      const bool alone = !t.is_special(id) && !t.token_bytes(id).empty() &&
                         kvlite::GrammarMatcher::advance(g, matcher.state(), t.token_bytes(id), next);
      if (alone != kvlite::token_mask_allows(mask, id)) {
        fprintf(stderr, "mask and the token alone disagree on id %d at step %d\n", id, step);
        abort();
      }
    }
    const int64_t shortest = matcher.min_completion();
    if ((shortest == 0) != matcher.complete()) {
      fprintf(stderr, "min_completion %lld but complete() is %d\n", (long long)shortest, int(matcher.complete()));
      abort();
    }
    if (allowed.empty()) break;
    const int32_t pick = allowed[rng() % allowed.size()];
    if (!matcher.accept(t.token_bytes(pick))) {
      fprintf(stderr, "an allowed token %d is not accepted\n", pick);
      abort();
    }
  }
  return 0;
}
