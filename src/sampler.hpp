// ---------------------------------------------------------------------------------------------------------
// sampler: turning one row of logits into the next token, and the sliding-window schedule of scoring.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// The most tokens one request may ask for (SamplingParams::max_tokens): no context is longer than
// KVLITE_MAX_POSITIONS, so a larger number can mean nothing more, and bounding it keeps prompt + max_tokens
// arithmetic far from overflow (a caller's INT64_MAX "no limit" overflowed it).
#ifndef KVLITE_MAX_NEW_TOKENS
#define KVLITE_MAX_NEW_TOKENS KVLITE_MAX_POSITIONS
#endif
// Stop tokens and stop strings one request may carry (each); every generated token is checked against them all.
#ifndef KVLITE_MAX_STOP_ENTRIES
#define KVLITE_MAX_STOP_ENTRIES 1024
#endif
// Bytes of one stop string: the held-back tail of the text is compared against each, every token.
#ifndef KVLITE_MAX_STOP_STRING_BYTES
#define KVLITE_MAX_STOP_STRING_BYTES 4096
#endif
namespace limits {
constexpr int64_t max_new_tokens = KVLITE_MAX_NEW_TOKENS;
constexpr int64_t max_stop_entries = KVLITE_MAX_STOP_ENTRIES;
constexpr int64_t max_stop_string_bytes = KVLITE_MAX_STOP_STRING_BYTES;
}  // namespace limits

struct SamplingParams {
  float temperature = 0.0f;         // 0: greedy (argmax; ties go to the lowest id, as torch.argmax)
  int64_t top_k = 0;                // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off
  float repetition_penalty = 1.0f;  // 1: off; > 1 discourages tokens already in the prompt or output
  uint64_t seed = 0;                // same seed, same prompt, same tokens
  int64_t max_tokens = 256;         // 1..KVLITE_MAX_NEW_TOKENS; generation also ends when the context is full
  std::vector<int32_t> stop_tokens;       // added to the tokenizer's end-of-turn tokens
  std::vector<std::string> stop_strings;  // generation ends when the text ends with one (it is cut off)
  bool ignore_eos = false;  // benchmarks: the model's end-of-turn tokens do not stop it (stop_tokens still do)
  // Generation::logprobs gets each generated token's log-probability under the model: the log-softmax of its
  // logits as the model gave them (before the penalty, temperature and filters), as vLLM's logprobs and
  // OpenAI's logprobs report. On a GPU such rows are sampled on the host (their logits come back whole).
  bool logprobs = false;
  // Constrained decoding (grammar.hpp): every output is a sentence of this GBNF grammar (start rule `root`), or
  // a JSON value valid against this JSON schema (its text); at most one of the two. At each step the tokens
  // that cannot continue a sentence get no probability; end-of-turn tokens are allowed once the output is
  // complete, and generation ends (FinishReason::grammar_end) when nothing more may follow. The grammar is
  // compiled once per engine and text, its masks kept per parse state. A bad one is refused by generate and
  // submit (bad_format or unsupported, with where and why).
  std::string grammar;
  std::string json_schema;
};
// Every field in its range (invalid_argument naming the field, its value and the range): the one check behind
// generate, generate_chat and submit, in C++ and C.
Status validate(const SamplingParams& params);

// A small, fast, seedable generator (xoshiro256**, seeded through splitmix64): reproducible on every
// platform, unlike std::uniform_real_distribution.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next_u64();
  float next_float();  // uniform in [0, 1), 24 random bits

 private:
  uint64_t state_[4];
};

// Samples from one row of logits, in transformers' order: repetition penalty on the logits (positive
// logits divided, negative multiplied, once per distinct previous token), temperature, top-k, top-p
// (smallest set of most likely tokens whose probability reaches top_p, at least one), min-p (drop tokens
// below min_p x the top probability), then a draw. `logits` is modified in place. The scratch arrays hold
// `vocab` entries each and are the caller's (the arena's sampling region): nothing is allocated.
int32_t sample_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                     int64_t history_len, Rng& rng, float* prob_scratch, int32_t* index_scratch);
int32_t argmax(const float* values, int64_t count);

// ---- speculative decoding (EngineOptions: PlanOptions::speculative_tokens, ngram) ----
// Prompt-lookup (n-gram) drafting: the longest suffix of `history`, at most max_ngram tokens, that also occurs
// earlier in it (its latest occurrence followed by max_tokens tokens, else the one followed by the most); the
// tokens that followed it there, at most max_tokens, are the draft, written to `draft`. Returns their count (0: no
// match). O(history_len x max_ngram) compares.
int64_t propose_ngram_draft(const int32_t* history, int64_t history_len, int64_t max_ngram, int64_t max_tokens,
                            int32_t* draft);
// Verifies one drafted token against the target model's row of logits, by the speculative sampling rule
// (Leviathan et al. 2023, Chen et al. 2023) for a draft that proposes its token with certainty (n-gram drafting):
// greedy, the token is the target's argmax and the draft is accepted when it is that token; sampling, the draft
// is accepted with probability p(draft) under the distribution sample_token draws from (penalty, temperature,
// top-k, top-p, min-p), and on rejection the token is drawn from p without the draft, renormalized. Either way
// the token is distributed exactly as sample_token's (it draws one or two numbers from `rng`, sample_token one).
// `logits` is modified in place; the scratch arrays are sample_token's.
struct DraftVerdict {
  int32_t token = -1;     // the token to emit: the draft when accepted, else the target's own
  bool accepted = false;
};
DraftVerdict verify_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                                int64_t history_len, int32_t draft, Rng& rng, float* prob_scratch,
                                int32_t* index_scratch);
// The same rule for a draft drawn from a distribution q (a draft model: sample_draft_token wrote q): sampling, the
// draft is accepted with probability min(1, p(draft) / q(draft)) and on rejection the token is drawn from
// max(0, p - q), normalized, so the emitted token is distributed as p whatever q is; greedy as above. draft_probs
// [vocab] is q; nullptr means a draft proposed with certainty (the overload above).
DraftVerdict verify_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                                int64_t history_len, int32_t draft, const float* draft_probs, Rng& rng,
                                float* prob_scratch, int32_t* index_scratch);
// A draft model's token from its row of logits, under the same processing as sample_token (the draft proposes
// from what the target would sample from: penalty, temperature, top-k, top-p, min-p). Greedy: the argmax, and
// draft_probs is left alone. Sampling: one draw, and draft_probs[vocab] receives the whole distribution q it was
// drawn from (0 outside the candidates), which verify_draft_token needs.
int32_t sample_draft_token(float* logits, int64_t vocab, const SamplingParams& params, const int32_t* history,
                           int64_t history_len, Rng& rng, float* draft_probs, float* prob_scratch,
                           int32_t* index_scratch);
// log_softmax(logits)[token], computed stably in double.
double token_logprob(const float* logits, int64_t vocab, int32_t token);

// One window of the transformers perplexity recipe ("Perplexity of fixed-length models"): the model reads
// tokens [begin, end) and is scored on the targets in [first_target, end) (positions before first_target
// were scored by an earlier window and only give context). Each target t is predicted from position t-1.
struct ScoreWindow {
  int64_t begin = 0, end = 0, first_target = 0;
};
// Windows of `context` tokens every `stride` tokens, exactly as the guide's loop: trg_len = end - prev_end,
// the first window's first token has no prediction (it is never a target).
Result<std::vector<ScoreWindow>> score_windows(int64_t num_tokens, int64_t context, int64_t stride);

}  // namespace kvlite
