// request: what the engine knows of one submitted request (generate, score or logits) while it waits, runs and
// ends. Its own part because the scheduler, speculative decoding and the engine's step all read and write it.
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvlite {
namespace detail {

enum class RequestKind { generate, score, logits };

// A run of one image's tokens in a request: tokens [first, first + count) take feature rows [feature_row, +count).
struct ImageSpan {
  int64_t first = 0, count = 0, feature_row = 0;
};

// A prompt whose <|image_pad|> placeholders are expanded, with what the model needs for its images.
struct VisionPrompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> mrope;  // [3, ids] (empty without images)
  int64_t rope_delta = 0;
  std::vector<ImageSpan> image_spans;
  ImageFeatures features;
};

struct EngineRequest {
  RequestId id = 0;
  RequestKind kind = RequestKind::generate;
  std::vector<int32_t> tokens;  // what the model reads: the prompt (or window), then each generated id
  int64_t computed = 0;         // tokens whose K/V are in the cache (0 again after a preemption)
  int32_t slot = -1;            // KV pool slot while running
  bool finished = false;

  // generate
  SamplingParams params;
  Rng rng;
  TokenCallback on_token;
  std::optional<StreamingDecoder> decoder;
  std::string text;    // decoded so far (cut at a stop string)
  size_t emitted = 0;  // bytes of `text` handed to on_token
  Generation result;
  // Constrained decoding: the compiled grammar's masks (shared by the requests with the same grammar) and
  // this request's parse state after its output so far.
  std::shared_ptr<GrammarMasker> masker;
  std::optional<GrammarMatcher> matcher;
  // Speculative decoding: the tokens drafted for the step being run (appended to `tokens` while it runs),
  // `draft_base` the index in `tokens` of the last token before them; once a draft is rejected the request's
  // later rows in the step are ignored (their K/V is overwritten later).
  std::vector<int32_t> drafts;
  int64_t draft_base = 0;
  bool draft_rejected = false;
  // A draft model: tokens whose K/V the draft's cache holds (in this request's pages; 0 again after a preemption,
  // and for a new request, whose cached prefix holds only the target's for sure), and the drafts this step wants.
  int64_t draft_computed = 0;
  int64_t draft_wanted = 0;
  // Prefix caching: the keys of this request's full pages so far (page_key), and how many of its pages are in the
  // cache (taken from it at admission, or entered once computed).
  std::vector<uint64_t> page_keys;
  int64_t registered_pages = 0;

  // score and logits: rows [want_begin, want_end) of `tokens` have their logits consumed
  int64_t want_begin = 0, want_end = 0;
  double* logprobs = nullptr;  // score: logprobs[p + 1] = log p(tokens[p + 1] | tokens[0..p])
  float* logits = nullptr;     // logits: [tokens, V]

  // A vision model's prompt (qwen3_vl). Tokens past the prompt's positions have index + rope_delta.
  std::vector<int32_t> mrope;   // [3, prompt tokens]: rows t, h, w (get_rope_index); empty: position = index
  int64_t rope_delta = 0;
  std::vector<ImageSpan> image_spans;  // runs of image tokens in `tokens`
  ImageFeatures features;              // their rows, in token order
};

}  // namespace detail
}  // namespace kvlite
