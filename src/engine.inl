// engine: implementation. Each step, the scheduler (scheduler.inl) picks the requests that run and how many of
// their tokens; speculative decoding may add drafted tokens. The step's tokens go through the model in
// one forward pass; the rows whose logits someone wants (the last row of a generating sequence, every target
// of a scoring window, every row of a logits request) are projected a chunk at a time and handed out.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <nlohmann/json.hpp>

namespace kvlite {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::running: return "running";
    case FinishReason::stop_token: return "stop_token";
    case FinishReason::stop_string: return "stop_string";
    case FinishReason::max_tokens: return "max_tokens";
    case FinishReason::length: return "length";
    case FinishReason::callback: return "callback";
    case FinishReason::cancelled: return "cancelled";
    case FinishReason::grammar_end: return "grammar_end";
  }
  return "?";
}

struct Engine::Impl {
  ModelConfig config;
  TensorStore store;  // keeps the mmap the weight views point into
  Plan plan;
  std::unique_ptr<Arena> arena;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<TextModel> model;
  std::unique_ptr<VisionModel> vision;  // qwen3_vl
  // Speculative decoding with a draft model (EngineOptions::draft_model): its config and the mmap its weights are
  // views into (the speculator, declared after them, holds its forward pass: it is destroyed first).
  ModelConfig draft_config;
  TensorStore draft_store;
  detail::Speculator speculator;  // drafting (n-gram or the draft model) and what verification needs
  std::vector<float> raw_row;  // [V]: a row's logits kept as the model gave them (SamplingParams::logprobs)
  // Constrained decoding: the vocabulary's trie (made at the first constrained request) and one masker per
  // grammar or schema text, at most kMaxGrammars; past that the map starts over.
  std::shared_ptr<const GrammarVocabulary> grammar_vocabulary;
  std::unordered_map<std::string, std::shared_ptr<GrammarMasker>> maskers;
  static constexpr size_t kMaxGrammars = 64;
  std::vector<std::pair<int32_t, float>> stop_logits;  // constrain_row's scratch
  TokenMask budget_mask;
  PreprocessOptions preprocess;         // qwen3_vl: the processor's, with the plan's image budget
  std::optional<Tokenizer> tokenizer;  // set by open() (a Tokenizer only comes from load)
  std::vector<int32_t> stop_ids;  // sorted
  // Global cancel() aims at the public call running steps now (CallScope), never at a later one: a cancel made
  // while no call runs aims at nothing. 0 means "no call".
  std::atomic<uint64_t> calls_started{0}, running_call{0}, cancelled_call{0};
  // cancel(RequestId): ids named from any thread, applied by the next step (a request that finished first is
  // simply not found: ids are never reused).
  std::mutex request_cancels_mutex;
  std::set<RequestId> request_cancels;
  std::atomic<RequestId> last_issued_id{0};
  // Every public call but cancel(), cancel(id), set_op_timing() and the accessors of what open fixed holds
  // call_mutex for its whole run (CallLock): calls from several threads run one after another, in the order the
  // mutex grants them. call_owner is the thread holding it, so that a nested call on that thread (generate(text)
  // calling generate(ids), or a callback calling back) is recognised instead of deadlocking; `stepping` is set
  // while a step runs the token callbacks, which must not start engine work of their own.
  std::mutex call_mutex;
  std::atomic<std::thread::id> call_owner{};
  detail::EngineLog log;  // EngineOptions::name / log / log_level, in effect while a call holds the engine
  std::optional<detail::ScopedEngineLog> log_scope;  // the holding call's
  bool stepping = false;
  // stats() from any thread while a call runs: the counters as of the last step, published under their own
  // small lock so that a reader never waits for a whole generate.
  mutable std::mutex published_stats_mutex;
  EngineStats published_stats;
  EngineStats stats;
  EngineInfo info;

  RequestId next_id = 1;
  std::map<RequestId, std::unique_ptr<detail::EngineRequest>> requests;
  detail::Scheduler scheduler;  // the queues, and each step's requests (admission, chunked prefill, preemption)

  detail::StepBatch batch;  // host staging of one step, sized once (Tmax tokens, Smax sequences)

  // A GPU engine's host side of the logits (sized at open): a chunk as the GPU stores it and widened to float,
  // the host sampler's scratch (rows with a repetition penalty), and the device sampler's rows.
  std::vector<uint8_t> logits_raw;                     // [max_logit_rows, V] activation dtype
  std::vector<float> logits_host;                      // [max_logit_rows, V] (also a CPU engine's, for 16-bit logits)
  std::vector<float> host_probs;                       // [V]
  std::vector<int32_t> host_order;                     // [V]
  std::vector<cuda::DeviceSamplingParams> device_params;  // per device-sampled row of a chunk
  std::vector<int64_t> device_rows;                    // their rows in the chunk
  std::vector<int32_t> sampled_ids;                    // [max_logit_rows] what the GPU sampled

  detail::DecodeGraphs graphs;  // CUDA decode graphs, one per batch bucket

  KVPagePool& pool() { return arena->kv(); }
  int64_t max_model_len() const { return plan.max_model_len; }
  bool on_gpu() const { return backend->kind() == BackendKind::cuda; }
  static void check(const Status& status) {
    if (!status) throw status.error();
  }

  // ---- requests ----------------------------------------------------------------------------------------

  void check_ids(const std::vector<int32_t>& ids, const char* what) const {
    if (ids.empty()) detail::fail(ErrorCode::invalid_argument, detail::format("%s: no tokens", what));
    for (size_t i = 0; i < ids.size(); i++)
      if (ids[i] < 0 || ids[i] >= config.text.vocab_size)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("%s: token %zu is %d, outside the model's vocabulary [0, %lld)", what, i, ids[i],
                                    (long long)config.text.vocab_size));
  }

  // The sequence could never be held: refuse it now rather than let it wait forever. (max_model_len is at
  // most the whole KV arena: Arena::create refuses a plan where one such sequence does not fit.)
  void check_fits(int64_t kv_tokens, const std::string& what, const std::string& advice) const {
    if (kv_tokens > max_model_len())
      detail::fail(ErrorCode::does_not_fit,
                   detail::format("%s needs %lld tokens of KV but the engine's max_model_len is %lld (its KV arena "
                                  "holds %lld tokens); %s",
                                  what.c_str(), (long long)kv_tokens, (long long)max_model_len(),
                                  (long long)plan.kv_tokens, advice.c_str()));
  }

  detail::EngineRequest& add_request(detail::RequestKind kind, std::vector<int32_t> tokens) {
    auto request = std::make_unique<detail::EngineRequest>();
    request->id = next_id++;
    last_issued_id.store(request->id);
    request->kind = kind;
    request->tokens = std::move(tokens);
    detail::EngineRequest& r = *request;
    requests[r.id] = std::move(request);
    scheduler.enqueue(r);
    return r;
  }

  // ---- images --------------------------------------------------------------------------------------------

  // The vision tower over `images`, in groups that fit its buffers: levels x tokens rows on the host.
  ImageFeatures encode_images(const std::vector<const VisionInput*>& images) {
    if (!vision)
      detail::fail(ErrorCode::unsupported,
                   detail::format("%s (model_type %s) has no vision tower; it takes no images", config.origin.c_str(),
                                  config.model_type.c_str()));
    // A caller's VisionInput sizes the output below: every field is checked against the vision config first
    // (the output was sized from image_tokens and overrun by the real rows when they disagreed).
    for (size_t i = 0; i < images.size(); i++) {
      Status valid = check_vision_input(config.vision, *images[i]);
      if (!valid) detail::fail(valid.error().code, detail::format("image %zu: %s", i, valid.error().message.c_str()));
    }
    ImageFeatures out;
    out.levels = vision->levels();
    out.hidden = config.vision.out_hidden_size;
    for (const VisionInput* image : images) out.tokens += image->grid.image_tokens;
    out.values.assign(size_t(out.levels * out.tokens * out.hidden), 0.0f);
    int64_t token = 0;
    std::vector<const VisionInput*> group;  // the next images, as many as one encode() holds
    int64_t patches = 0;
    std::vector<uint16_t> narrow;  // one level's rows as 16-bit activations store them (BF16 / F16 only)
    auto encode_group = [&] {
      vision->encode(group);  // an image too large for the buffers alone: encode() says why
      for (int64_t level = 0; level < out.levels; level++) {
        const Tensor rows = vision->output(level);
        float* dst = out.values.data() + (level * out.tokens + token) * out.hidden;
        if (rows.dtype == DType::F32) {
          Status copied = backend->copy_to_host(rows, dst);
          if (!copied) throw copied.error();
        } else {  // widened to float (exact), so the text model's rounding back gives the same bits
          narrow.resize(size_t(rows.elements()));
          Status copied = backend->copy_to_host(rows, narrow.data());
          if (!copied) throw copied.error();
          detail::widen_to_float(narrow.data(), rows.dtype, narrow.size(), dst);
        }
      }
      for (const VisionInput* image : group) token += image->grid.image_tokens;
      group.clear();
      patches = 0;
    };
    for (const VisionInput* image : images) {
      if (!group.empty() &&
          (int64_t(group.size()) == vision->max_images() || patches + image->rows() > vision->max_patches()))
        encode_group();
      group.push_back(image);
      patches += image->rows();
    }
    if (!group.empty()) encode_group();
    return out;
  }

  // A request's images are encoded together when it is submitted, in vision buffers the plan sized for
  // max_images of them: more are refused before any is preprocessed or encoded.
  void check_image_count(size_t images, const char* what) const {
    if (vision && int64_t(images) > plan.options.max_images)
      detail::fail(ErrorCode::does_not_fit,
                   detail::format("%s: %zu images in one request, but the plan allows at most %lld (max_images); "
                                  "raise max_images to %zu (EngineOptions::plan.max_images; kvlite plan --max-images "
                                  "%zu shows what it costs) or send at most %lld",
                                  what, images, (long long)plan.options.max_images, images, images,
                                  (long long)plan.options.max_images));
  }

  // `ids` with one image_token_id per image (the processor's input form): each placeholder becomes its image's
  // tokens, their features are computed, and the prompt's M-RoPE positions with them.
  detail::VisionPrompt prepare_prompt(const std::vector<int32_t>& ids, const std::vector<VisionInput>& images,
                                      const char* what) {
    detail::VisionPrompt prompt;
    const int32_t pad = int32_t(config.image_token_id);
    const int64_t placeholders = pad < 0 ? 0 : int64_t(std::count(ids.begin(), ids.end(), pad));
    if (images.empty() && placeholders == 0) {
      prompt.ids = ids;
      return prompt;
    }
    if (!vision)
      detail::fail(ErrorCode::unsupported,
                   detail::format("%s: %zu image%s given but %s (model_type %s) has no vision tower", what,
                                  images.size(), images.size() == 1 ? "" : "s", config.origin.c_str(),
                                  config.model_type.c_str()));
    check_image_count(images.size(), what);
    if (placeholders != int64_t(images.size()))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%s: the prompt holds %lld image placeholder%s (<|image_pad|>, id %d) but %zu "
                                  "image%s given; put one %s in the prompt per image, in order",
                                  what, (long long)placeholders, placeholders == 1 ? "" : "s", pad, images.size(),
                                  images.size() == 1 ? " was" : "s were", kImagePlaceholder));
    std::vector<const VisionInput*> inputs;
    std::vector<ImageGrid> grids;
    for (const VisionInput& image : images) {
      inputs.push_back(&image);
      grids.push_back(image.grid);
    }
    prompt.features = encode_images(inputs);
    size_t image = 0;
    int64_t feature_row = 0;
    for (int32_t id : ids) {
      if (id != pad) {
        prompt.ids.push_back(id);
        continue;
      }
      // processor: text.replace(image_token, image_token * num_image_tokens)
      const int64_t count = images[image++].grid.image_tokens;
      prompt.image_spans.push_back({int64_t(prompt.ids.size()), count, feature_row});
      prompt.ids.insert(prompt.ids.end(), size_t(count), pad);
      feature_row += count;
    }
    Result<MropePositions> positions = mrope_positions(prompt.ids, pad, grids, config.vision.spatial_merge_size);
    if (!positions) throw positions.error();
    prompt.mrope = std::move(positions->positions);
    prompt.rope_delta = positions->rope_delta;
    return prompt;
  }

  // Engine::preprocess of each image.
  std::vector<VisionInput> preprocess_all(const std::vector<Image>& images) const {
    check_image_count(images.size(), "generate");
    std::vector<VisionInput> inputs;
    for (const Image& image : images) {
      if (!vision)
        detail::fail(ErrorCode::unsupported, detail::format("%s (model_type %s) has no vision tower; it takes no images",
                                                            config.origin.c_str(), config.model_type.c_str()));
      Result<VisionInput> input = preprocess_image(image, preprocess);
      if (!input) throw input.error();
      inputs.push_back(std::move(*input));
    }
    return inputs;
  }

  static void attach(detail::EngineRequest& r, detail::VisionPrompt&& prompt) {
    r.mrope = std::move(prompt.mrope);
    r.rope_delta = prompt.rope_delta;
    r.image_spans = std::move(prompt.image_spans);
    r.features = std::move(prompt.features);
  }

  // The masker for a request's grammar or schema (nullptr: unconstrained); compiled once per text: a request that
  // repeats a schema finds its masker (and the masks it remembers) by the schema's own text, before any compiling.
  std::shared_ptr<GrammarMasker> constraint_for(const SamplingParams& params) {
    if (params.grammar.empty() && params.json_schema.empty()) return nullptr;
    std::string key = params.grammar.empty() ? "schema\n" + params.json_schema : "gbnf\n" + params.grammar;
    auto found = maskers.find(key);
    if (found != maskers.end()) return found->second;
    std::string gbnf = params.grammar;
    if (gbnf.empty()) {
      Result<std::string> compiled = Grammar::json_schema_to_gbnf(params.json_schema);
      if (!compiled) throw compiled.error();
      gbnf = std::move(*compiled);
    }
    Result<std::shared_ptr<const Grammar>> grammar = Grammar::parse(gbnf);
    if (!grammar) throw grammar.error();
    if (!grammar_vocabulary) {
      const int64_t vocab = config.text.vocab_size;
      std::vector<std::string> pieces(static_cast<size_t>(vocab));
      std::vector<uint8_t> excluded(static_cast<size_t>(vocab), 1);
      for (int64_t id = 0; id < vocab && id < int64_t(tokenizer->vocab_size()); id++) {
        pieces[size_t(id)] = tokenizer->token_bytes(int32_t(id));
        excluded[size_t(id)] = tokenizer->is_special(int32_t(id));
      }
      grammar_vocabulary = std::make_shared<const GrammarVocabulary>(pieces, excluded);
    }
    if (maskers.size() >= kMaxGrammars) maskers.clear();  // requests keep their own (shared) maskers alive
    auto masker = std::make_shared<GrammarMasker>(std::move(*grammar), grammar_vocabulary);
    maskers.emplace(std::move(key), masker);
    return masker;
  }

  RequestId submit(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images,
                   const SamplingParams& params, const TokenCallback& on_token) {
    check_ids(prompt_ids, "generate");
    Status valid = validate(params);
    if (!valid) throw valid.error();
    std::shared_ptr<GrammarMasker> masker = constraint_for(params);
    detail::VisionPrompt vision_prompt = prepare_prompt(prompt_ids, images, "generate");
    const std::vector<int32_t>& prompt = vision_prompt.ids;
    const int64_t prompt_len = int64_t(prompt.size());
    // Only a prompt that leaves no room for one output token is refused; one whose prompt + max_tokens passes
    // max_model_len generates until the context is full and finishes with FinishReason::length, as vLLM and
    // transformers do.
    check_fits(prompt_len + 1,
               detail::format("a prompt of %lld tokens (+ 1 to generate)", (long long)prompt_len),
               detail::format("shorten the prompt below %lld tokens", (long long)max_model_len()) +
                   " or raise max_model_len (EngineOptions::plan.max_model_len, kvlite --max-model-len)");
    detail::EngineRequest& r = add_request(detail::RequestKind::generate, prompt);
    attach(r, std::move(vision_prompt));
    r.params = params;
    r.rng = Rng(params.seed);
    r.on_token = on_token;
    r.decoder.emplace(*tokenizer, false);
    if (masker) {
      r.matcher.emplace(masker->grammar_ptr());
      r.masker = std::move(masker);
    }
    r.result.prompt_ids = prompt;
    r.result.request = r.id;
    if (detail::log_enabled(LogLevel::debug))
      detail::log(LogLevel::debug, detail::format("request %lld: %lld prompt tokens, %zu images, max_tokens %lld",
                                                  (long long)r.id, (long long)prompt_len, images.size(),
                                                  (long long)params.max_tokens));
    // prompt_len < max_model_len (check_fits above) and max_tokens <= KVLITE_MAX_NEW_TOKENS (validate): no overflow
    r.tokens.reserve(size_t(prompt_len + std::min(params.max_tokens, max_model_len() - prompt_len)));
    return r.id;
  }

  bool is_stop_token(const detail::EngineRequest& r, int32_t id) const {
    return (!r.params.ignore_eos && std::binary_search(stop_ids.begin(), stop_ids.end(), id)) ||
           std::find(r.params.stop_tokens.begin(), r.params.stop_tokens.end(), id) != r.params.stop_tokens.end();
  }

  // Constrained decoding: the tokens that cannot continue the sentence get -inf (end-of-turn tokens only once
  // it is complete). False, and the request finished, when no token is left (a grammar whose next character no
  // token of this vocabulary writes): it ends as complete if it is, else as cut by length.
  bool constrain_row(detail::EngineRequest& r, float* row, int64_t vocab) {
    const auto started = std::chrono::steady_clock::now();
    const int64_t computed_before = r.masker->masks_computed();
    // The tokens left, this one included (max_tokens, or the context's end): a token that leaves more bytes to
    // complete the sentence than tokens remain after it is not allowed, so the output is whole whenever a
    // token per byte can finish it (byte-level vocabularies), even when max_tokens cuts it.
    const int64_t left = std::min(r.params.max_tokens - int64_t(r.result.ids.size()),
                                  max_model_len() - int64_t(r.tokens.size()));
    // (when even the shortest completion does not fit, the plain mask: the output is cut, as without a grammar)
    const int64_t budget = r.matcher->min_completion() <= left ? left - 1 : -1;
    const TokenMask& mask = r.masker->mask_for_budget(r.matcher->state(), budget, budget_mask);
    stats.grammar_rows++;
    stats.grammar_masks_computed += r.masker->masks_computed() - computed_before;
    stats.grammar_mask_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const bool complete = r.matcher->complete();
    // the end-of-turn tokens' logits, put back after the mask when the sentence may end here
    stop_logits.clear();
    if (complete) {
      for (const std::vector<int32_t>* ids : {&stop_ids, &r.params.stop_tokens})
        for (int32_t id : *ids)
          if (id >= 0 && id < vocab && is_stop_token(r, id)) stop_logits.push_back({id, row[id]});
    }
    bool any = !stop_logits.empty();
    for (size_t word = 0; word * 64 < size_t(vocab); word++) {
      const uint64_t bits = word < mask.size() ? mask[word] : 0;
      any = any || bits != 0;
      const int64_t end = std::min<int64_t>(vocab, int64_t(word + 1) * 64);
      for (int64_t id = int64_t(word) * 64; id < end; id++)
        if (!((bits >> (id % 64)) & 1u)) row[id] = -std::numeric_limits<float>::infinity();
    }
    for (const auto& kept : stop_logits) row[kept.first] = kept.second;
    if (!any) finish(r, complete ? FinishReason::grammar_end : FinishReason::length);
    return any;
  }

  // Hands text[emitted, end) to the callback with `id`; false when the callback asks to stop.
  bool emit(detail::EngineRequest& r, size_t end, int32_t id) {
    std::string piece = r.text.substr(r.emitted, end - r.emitted);
    r.emitted = end;
    r.result.text += piece;
    return !r.on_token || r.on_token(piece, id);
  }

  // Takes r out of the queues and gives its slot and pages back.
  void retire(detail::EngineRequest& r) {
    r.finished = true;
    scheduler.release(r);
  }

  void finish(detail::EngineRequest& r, FinishReason reason) {
    retire(r);
    r.result.finish_reason = reason;
    if (reason == FinishReason::stop_token || reason == FinishReason::max_tokens || reason == FinishReason::length ||
        reason == FinishReason::grammar_end) {
      // Whatever was held back (a potential stop string's start, an incomplete character) is final now.
      r.text += r.decoder->flush();
      if (r.emitted < r.text.size()) emit(r, r.text.size(), -1);
    }
  }

  // A generated id: record it, stream its text, and decide whether the request goes on.
  void accept_token(detail::EngineRequest& r, int32_t id, float logprob = std::numeric_limits<float>::quiet_NaN()) {
    stats.tokens_generated++;
    r.tokens.push_back(id);
    r.result.ids.push_back(id);
    if (r.params.logprobs) r.result.logprobs.push_back(logprob);
    if (is_stop_token(r, id)) return finish(r, FinishReason::stop_token);
    // (the row was masked: the token's bytes continue the sentence; a grammar's end is decided after the text)
    const bool grammar_done = r.matcher && r.matcher->accept(tokenizer->token_bytes(id)) && !r.matcher->can_continue();
    Result<std::string> piece = r.decoder->push(id);
    if (!piece) throw piece.error();
    const size_t searched_from = r.emitted;
    r.text += *piece;
    // The earliest stop string in the text not yet emitted ends the request, cut before it.
    size_t stop_at = std::string::npos;
    for (const std::string& stop : r.params.stop_strings) stop_at = std::min(stop_at, r.text.find(stop, searched_from));
    if (stop_at != std::string::npos) {
      r.text.resize(stop_at);
      emit(r, stop_at, id);
      return finish(r, FinishReason::stop_string);
    }
    // Hold back the longest tail that could still grow into a stop string.
    size_t hold = 0;
    for (const std::string& stop : r.params.stop_strings)
      for (size_t len = std::min(stop.size() - 1, r.text.size() - r.emitted); len > hold; len--)
        if (r.text.compare(r.text.size() - len, len, stop, 0, len) == 0) {
          hold = len;
          break;
        }
    if (!emit(r, r.text.size() - hold, id)) return finish(r, FinishReason::callback);
    if (grammar_done) return finish(r, FinishReason::grammar_end);
    if (int64_t(r.result.ids.size()) >= r.params.max_tokens) return finish(r, FinishReason::max_tokens);
    if (int64_t(r.tokens.size()) >= max_model_len()) return finish(r, FinishReason::length);
  }

  // Every unfinished request ends (cancel, or an error mid-step): pages and slots go back to the pool.
  void abort_all() {
    for (detail::EngineRequest* r : scheduler.unfinished()) {
      if (r->kind == detail::RequestKind::generate) {
        finish(*r, FinishReason::cancelled);
      } else {
        retire(*r);
      }
    }
  }

  // ---- the step ----------------------------------------------------------------------------------------

  // The positions of r whose logits are wanted among [first, first + count).
  std::pair<int64_t, int64_t> wanted_rows(const detail::EngineRequest& r, int64_t first, int64_t count) const {
    int64_t begin = r.want_begin, end = r.want_end;
    if (r.kind == detail::RequestKind::generate) {  // the last token's row (and its drafts'), once all is in
      end = int64_t(r.tokens.size());
      begin = end - 1 - int64_t(r.drafts.size());
    }
    return {std::max(begin, first), std::min(end, first + count)};
  }

  void consume_row(const detail::RowOwner& owner, float* row) {
    detail::EngineRequest& r = *owner.request;
    const int64_t vocab = config.text.vocab_size;
    switch (r.kind) {
      case detail::RequestKind::generate: {
        if (r.finished || r.draft_rejected) break;  // rows after the request ended or after a rejected draft
        // the sampler's scratch: the arena's rows on the CPU, host vectors beside a GPU's (whose rows are device
        // memory)
        float* probs = on_gpu() ? host_probs.data() : model->sampling_probs(r.slot);
        int32_t* order = on_gpu() ? host_order.data() : model->sampling_order(r.slot);
        // logprobs: the row as the model gave it (sampling changes it in place), scored as score() scores
        if (r.params.logprobs) std::copy(row, row + vocab, raw_row.data());
        if (r.matcher && !constrain_row(r, row, vocab)) break;  // nothing may follow: the request ended
        auto logprob_of = [&](int32_t id) {
          return r.params.logprobs ? float(token_logprob(raw_row.data(), vocab, id))
                                   : std::numeric_limits<float>::quiet_NaN();
        };
        const int64_t drafted = owner.position - r.draft_base;  // the row verifying drafts[drafted], if any
        if (!r.drafts.empty() && drafted < int64_t(r.drafts.size())) {
          // r.tokens holds the accepted drafts before this one: the history the target's token depends on
          // a draft model's sampled draft came from a distribution q; n-gram drafts are certain
          const float* q =
              speculator.draft_model() && r.params.temperature != 0.0f ? speculator.draft_distribution(r.slot, drafted)
                                                                     : nullptr;
          const DraftVerdict verdict = verify_draft_token(row, vocab, r.params, r.tokens.data(),
                                                          int64_t(r.tokens.size()), r.drafts[size_t(drafted)], q,
                                                          r.rng, probs, order);
          if (verdict.accepted) stats.draft_tokens_accepted++;
          else r.draft_rejected = true;
          accept_token(r, verdict.token, logprob_of(verdict.token));
          break;
        }
        const int32_t id =
            sample_token(row, vocab, r.params, r.tokens.data(), int64_t(r.tokens.size()), r.rng, probs, order);
        accept_token(r, id, logprob_of(id));
        break;
      }
      case detail::RequestKind::score:
        r.logprobs[owner.position + 1] = token_logprob(row, vocab, r.tokens[size_t(owner.position + 1)]);
        break;
      case detail::RequestKind::logits:
        std::copy(row, row + vocab, r.logits + owner.position * vocab);
        break;
    }
  }

  // A public call's hold on the engine (call_mutex). Nested on the thread that holds it already: no second lock,
  // but a callback running inside a step may not start engine work (invalid_argument naming the call).
  struct CallLock {
    Impl& engine;
    bool locked = false;
    CallLock(Impl& e, const char* call) : engine(e) {
      if (engine.call_owner.load() == std::this_thread::get_id()) {
        if (engine.stepping)
          detail::fail(ErrorCode::invalid_argument,
                       detail::format("Engine::%s called from inside a token callback: a callback may call cancel(), "
                                      "cancel(id), stats() and set_op_timing() only (return false to end its own "
                                      "request)", call));
        return;
      }
      engine.call_mutex.lock();
      engine.call_owner.store(std::this_thread::get_id());
      engine.log_scope.emplace(&engine.log);
      locked = true;
    }
    ~CallLock() {
      if (!locked) return;
      engine.log_scope.reset();
      engine.publish_stats();
      engine.call_owner.store(std::thread::id());
      engine.call_mutex.unlock();
    }
    CallLock(const CallLock&) = delete;
    CallLock& operator=(const CallLock&) = delete;
  };

  void publish_stats() {
    EngineStats now = stats;
    now.op_times = backend->op_times();
    std::lock_guard<std::mutex> lock(published_stats_mutex);
    published_stats = now;
  }

  // The public call that runs steps: cancel() made during it (and only then) stops it.
  struct CallScope {
    Impl& engine;
    explicit CallScope(Impl& e) : engine(e) { engine.running_call.store(++engine.calls_started); }
    ~CallScope() { engine.running_call.store(0); }
  };

  // Requests cancel(RequestId) named end now, with FinishReason::cancelled; their pages go back to the pool.
  void apply_request_cancels() {
    std::set<RequestId> ids;
    {
      std::lock_guard<std::mutex> lock(request_cancels_mutex);
      ids.swap(request_cancels);
    }
    for (RequestId id : ids) {
      auto it = requests.find(id);
      if (it == requests.end() || it->second->finished || it->second->kind != detail::RequestKind::generate) continue;
      finish(*it->second, FinishReason::cancelled);
      detail::log(LogLevel::debug, detail::format("request %lld cancelled", (long long)id));
    }
  }

  // One forward step. Returns whether unfinished requests remain.
  bool step() {
    const uint64_t call = running_call.load();
    if (call != 0 && cancelled_call.load() == call) {
      abort_all();
      detail::fail(ErrorCode::cancelled, "cancelled by Engine::cancel()");
    }
    apply_request_cancels();
    if (scheduler.idle()) return false;
    try {
      stepping = true;
      run_step();
      stepping = false;
    } catch (...) {
      stepping = false;
      abort_all();  // leave the engine usable: no request holds pages it will never release
      throw;
    }
    publish_stats();
    return !scheduler.idle();
  }

  void run_step() {
    // Sequence s of the attention batch is pool slot s: the scheduler gives the requests in slot order.
    const std::vector<detail::ScheduledRequest>& scheduled =
        scheduler.schedule(stats, [this](detail::EngineRequest& r, int64_t limit) {
          return speculator.draft(r, limit, scheduler, stats);
        });
    if (scheduled.empty())
      detail::fail(ErrorCode::internal,
                   detail::format("the scheduler found nothing to run with %zu requests waiting and %zu running",
                                  scheduler.waiting_count(), scheduler.running_count()));
    if (speculator.draft_model()) speculator.run_draft_model(scheduled, batch, pool(), stats);
    const KVPagePool& kv = pool();
    const KVPagePool* window_kv = arena->kv_window();  // the sliding layers' pages, when they have their own
    const int64_t page_tokens = kv.page_tokens();
    const int64_t seqs = scheduled.back().request->slot + 1;
    std::fill(batch.context_lens.begin(), batch.context_lens.begin() + seqs, 0);
    int64_t t = 0, rows = 0, max_context = 0;
    size_t next = 0;
    const int64_t max_tokens = int64_t(batch.token_ids.size());
    batch.image_runs.clear();
    for (int64_t s = 0; s < seqs; s++) {
      batch.query_starts[size_t(s)] = int32_t(t);
      if (next == scheduled.size() || scheduled[next].request->slot != s) continue;
      detail::EngineRequest& r = *scheduled[next].request;
      const int64_t n = scheduled[next++].tokens;
      const int32_t* pages = kv.block_table(r.slot);
      const int32_t* window_pages = window_kv ? window_kv->block_table(r.slot) : nullptr;
      auto want = wanted_rows(r, r.computed, n);
      const int64_t prompt_positions = int64_t(r.mrope.size()) / 3;
      for (const detail::ImageSpan& span : r.image_spans) {  // the image tokens among [computed, computed + n)
        const int64_t begin = std::max(span.first, r.computed), end = std::min(span.first + span.count, r.computed + n);
        if (begin >= end) continue;
        ImageRun run;
        run.token = t + begin - r.computed;
        run.count = end - begin;
        run.rows = r.features.values.data() + (span.feature_row + begin - span.first) * r.features.hidden;
        run.level_stride = r.features.tokens * r.features.hidden;
        batch.image_runs.push_back(run);
      }
      for (int64_t p = r.computed; p < r.computed + n; p++, t++) {
        batch.token_ids[size_t(t)] = r.tokens[size_t(p)];
        // a prompt token's (t, h, w) from get_rope_index; any other token index + rope_delta on every row
        for (int64_t row = 0; row < batch.position_rows; row++)
          batch.positions[size_t(row * max_tokens + t)] =
              p < prompt_positions ? r.mrope[size_t(row * prompt_positions + p)] : int32_t(p + r.rope_delta);
        batch.slots[size_t(t)] = int32_t(int64_t(pages[p / page_tokens]) * page_tokens + p % page_tokens);
        if (window_pages)
          batch.window_slots[size_t(t)] = int32_t(int64_t(window_pages[p / page_tokens]) * page_tokens + p % page_tokens);
        if (p >= want.first && p < want.second) {
          batch.logit_row_ids[size_t(rows)] = int32_t(t);
          batch.row_owners[size_t(rows++)] = {&r, p};
        }
      }
      batch.context_lens[size_t(s)] = int32_t(r.computed + n);
      max_context = std::max(max_context, r.computed + n);
    }
    batch.query_starts[size_t(seqs)] = int32_t(t);
    // Rows of positions packed to [position_rows, t], as rope_tables reads them (each moves to a lower index).
    for (int64_t row = 1; row < batch.position_rows; row++)
      memmove(batch.positions.data() + row * t, batch.positions.data() + row * max_tokens, size_t(t) * sizeof(int32_t));

    StepInput input = batch.input(pool(), t, batch.position_rows, seqs, max_context, rows, window_kv);
    input.image_runs = int64_t(batch.image_runs.size());
    input.image_run_list = batch.image_runs.data();
    if (graphs.run(input, int64_t(scheduled.size()))) {
      stats.graph_steps++;
    } else {
      model->forward(input);
    }
    for (const detail::ScheduledRequest& s : scheduled) {
      s.request->computed += s.tokens;
      // the drafts leave r.tokens: rows verify them in order and accepted ones come back through accept_token
      if (!s.request->drafts.empty()) s.request->tokens.resize(size_t(s.request->draft_base + 1));
      scheduler.register_pages(*s.request);  // (before its rows are consumed: a request that ends there frees its slot)
    }
    stats.steps++;
    stats.tokens_computed += t;
    stats.peak_running = std::max(stats.peak_running, int64_t(scheduled.size()));

    const int64_t vocab = config.text.vocab_size;
    for (int64_t first = 0; first < rows; first += model->max_logit_rows()) {
      const int64_t count = std::min(model->max_logit_rows(), rows - first);
      Tensor logits = model->logits(first, count);
      if (on_gpu()) {
        consume_device_rows(logits, first, count);
      } else if (logits.dtype == DType::F32) {
        for (int64_t i = 0; i < count; i++)
          consume_row(batch.row_owners[size_t(first + i)], static_cast<float*>(logits.data) + i * vocab);
      } else {  // BF16 / F16 activations on the CPU: widened on the host, as the GPU's host rows are
        detail::widen_to_float(logits.data, logits.dtype, size_t(count * vocab), logits_host.data());
        for (int64_t i = 0; i < count; i++) consume_row(batch.row_owners[size_t(first + i)], logits_host.data() + i * vocab);
      }
    }
    speculator.settle(scheduled);
    // Sliding windows in memory: what each request's next query no longer sees goes back now (drafts settled), so a
    // request that waits holds only its window.
    for (const detail::ScheduledRequest& s : scheduled) scheduler.trim_window(*s.request);
    // Prefill-only requests end once every token is in.
    for (const detail::ScheduledRequest& s : scheduled) {
      detail::EngineRequest& r = *s.request;
      if (r.kind != detail::RequestKind::generate && !r.finished && r.computed == int64_t(r.tokens.size()))
        retire(r);
    }
  }

  // A chunk of logits on the GPU (rows first .. first + count of the step's logit rows): generate rows are
  // sampled there (cuda::sample: only their ids come back); rows whose consumer needs the whole row (scores,
  // logits requests, a repetition penalty) come to the host, widened to float. Rows are then consumed in order.
  void consume_device_rows(const Tensor& logits, int64_t first, int64_t count) {
    const int64_t vocab = config.text.vocab_size;
    device_params.clear();
    device_rows.clear();
    bool host_rows = false;
    for (int64_t i = 0; i < count; i++) {
      detail::EngineRequest& r = *batch.row_owners[size_t(first + i)].request;
      // (a drafting request's rows are verified in order against its history: on the host)
      if (r.kind != detail::RequestKind::generate || r.params.repetition_penalty != 1.0f || !r.drafts.empty() ||
          r.params.logprobs || r.matcher) {
        host_rows = true;
        continue;
      }
      cuda::DeviceSamplingParams p{};
      p.temperature = r.params.temperature;
      p.top_k = int32_t(std::min<int64_t>(r.params.top_k, vocab));  // >= vocab is off, as 0
      p.top_p = r.params.top_p;
      p.min_p = r.params.min_p;
      // sample_token draws once per sampled token (not when greedy): the same draw from the same Rng
      p.draw = r.params.temperature != 0.0f ? uint32_t(r.rng.next_float() * 16777216.0f) : 0;
      p.row = int32_t(i);
      device_params.push_back(p);
      device_rows.push_back(i);
    }
    const int64_t sampled = int64_t(device_rows.size());
    if (sampled > 0) {
      const TextModel::SamplingBuffers buffers = model->sampling_buffers();
      const Tensor params = buffers.params.slice_rows(0, sampled), ids = buffers.ids.slice_rows(0, sampled);
      check(backend->copy_from_host(device_params.data(), params));
      check(cuda::sample(*backend, logits, params, buffers.probs.slice_rows(0, sampled), ids));
      check(backend->copy_to_host(ids, sampled_ids.data()));
    }
    if (host_rows) {
      check(backend->copy_to_host(logits, logits_raw.data()));
      detail::widen_to_float(logits_raw.data(), logits.dtype, size_t(count * vocab), logits_host.data());
    }
    size_t next_sampled = 0;
    for (int64_t i = 0; i < count; i++) {
      if (next_sampled < device_rows.size() && device_rows[next_sampled] == i) {
        accept_token(*batch.row_owners[size_t(first + i)].request, sampled_ids[next_sampled++]);
      } else {
        consume_row(batch.row_owners[size_t(first + i)], logits_host.data() + i * vocab);
      }
    }
  }

  // Steps until done() holds (the caller's requests finished).
  template <class Done>
  void run_until(Done done) {
    CallScope scope(*this);
    while (!done())
      if (!step() && !done()) detail::fail(ErrorCode::internal, "the engine ran out of work before the request finished");
  }

  void erase(RequestId id) { requests.erase(id); }
};

// ---- Engine -------------------------------------------------------------------------------------------------

namespace detail {
namespace engine {

// generation_config.json's eos_token_id (an id or a list), which is what transformers' generate() stops at.
std::vector<int64_t> generation_eos_ids(const std::string& model_dir) {
  const std::string path = path_join(model_dir, "generation_config.json");
  if (!file_exists(path)) return {};
  const std::string text = read_text_file(path);
  check_json_nesting(text, path);
  nlohmann::json json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded() || !json.is_object())
    fail(ErrorCode::bad_format, format("%s is not a JSON object", path.c_str()));
  std::vector<int64_t> ids;
  auto eos = json.find("eos_token_id");
  if (eos == json.end() || eos->is_null()) return ids;
  auto add = [&](const nlohmann::json& value) {
    if (!value.is_number_integer())
      fail(ErrorCode::bad_format, format("%s: eos_token_id must be an integer or a list of integers", path.c_str()));
    ids.push_back(value.get<int64_t>());
  };
  if (eos->is_array()) {
    for (const auto& value : *eos) add(value);
  } else {
    add(*eos);
  }
  return ids;
}

DType kv_element_dtype(KVDType kv_dtype) {
  switch (kv_dtype) {
    case KVDType::f32: return DType::F32;
    case KVDType::bf16: return DType::BF16;
    case KVDType::f16: return DType::F16;
    case KVDType::fp8: return DType::F8_E4M3;
    case KVDType::auto_: break;
  }
  fail(ErrorCode::internal, "the plan left the KV dtype unresolved");
}

}  // namespace engine
}  // namespace detail

Engine::Engine() : impl_(new Impl()) {}
Engine::~Engine() = default;

namespace detail {
namespace engine {

}  // namespace engine
}  // namespace detail

Result<Plan> plan_engine(const PlanInputs& inputs_in, const EngineOptions& options) {
  return detail::guard([&]() -> Plan {
    // A draft model is planned with its target: its inputs come from options.draft_model unless given.
    PlanInputs with_draft;
    const PlanInputs* chosen = &inputs_in;
    if (!options.draft_model.empty() && !inputs_in.draft) {
      Result<PlanInputs> draft = read_plan_inputs(options.draft_model);
      if (!draft)
        detail::fail(draft.error().code,
                     detail::format("draft model %s: %s", options.draft_model.c_str(), draft.error().message.c_str()));
      with_draft = inputs_in;
      with_draft.draft = std::make_shared<const PlanInputs>(std::move(*draft));
      chosen = &with_draft;
    }
    const PlanInputs& inputs = *chosen;
    // Engine options the plan does not check itself, refused here: before Engine::open reserves its arena.
    detail::check_cpu_threads(options.threads, "EngineOptions::threads");  // (device: detect_device checks it)
    std::string why;
    Result<DeviceSpec> device = detect_device(options.backend, options.device, options.plan.device_mem,
                                              options.plan.wsl2, &why);
    if (!device) throw device.error();
    device->cpu_threads = options.threads;  // the CPU backend's scratch is per thread
    device->cpu_kernels = options.cpu_kernels;  // and fast_lowp's activation buffer
    device->cpu_lm_head = options.cpu_lm_head;  // and the int8 copy (the repack row)
    if (options.cpu_lm_head != CpuLmHead::stored && device->backend != BackendKind::cpu)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("EngineOptions::cpu_lm_head %s is a CPU backend option; the %s backend runs the "
                                  "lm_head as stored (drop --cpu-lm-head, or choose --backend cpu)",
                                  cpu_lm_head_name(options.cpu_lm_head), backend_name(device->backend)));
    Result<Plan> plan = make_plan(inputs, *device, options.plan);
    if (!plan) throw plan.error();
    plan->backend_rule = why;
    plan->prefix_caching = options.prefix_caching.value_or(plan->device.backend == BackendKind::cpu);
    return std::move(*plan);
  });
}

Result<Plan> plan_engine(const std::string& model_dir, const EngineOptions& options) {
  return detail::guard([&]() -> Plan {
    Result<PlanInputs> inputs = read_plan_inputs(model_dir);
    if (!inputs) throw inputs.error();
    Result<Plan> plan = plan_engine(*inputs, options);
    if (!plan) throw plan.error();
    return std::move(*plan);
  });
}

Result<std::unique_ptr<Engine>> Engine::open(const std::string& model_dir, const EngineOptions& options) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    std::unique_ptr<Engine> engine(new Engine());
    Impl& e = *engine->impl_;
    std::string name = options.name;
    if (name.empty()) {
      std::string dir = model_dir;
      while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
      name = dir.substr(dir.find_last_of('/') == std::string::npos ? 0 : dir.find_last_of('/') + 1);
    }
    e.log.prefix = name + ": ";
    e.log.callback = options.log;
    e.log.min_level = options.log_level;
    detail::ScopedEngineLog open_log(&e.log);
    Result<ModelConfig> config = load_config(model_dir);
    if (!config) throw config.error();
    e.config = std::move(*config);
    Result<TensorStore> store = TensorStore::open_dir(model_dir);
    if (!store) throw store.error();
    e.store = std::move(*store);
    if (e.store.empty())
      fail(ErrorCode::missing_tensor, format("%s has no safetensors weights (model.safetensors, an index, or "
                                             "*.safetensors)", model_dir.c_str()));
    Result<WeightsSummary> weights = summarize_weights(e.config, &e.store);
    if (!weights) throw weights.error();

    // The plan `kvlite plan` shows for these options (plan_engine: one rule for the backend and the device).
    PlanInputs inputs;
    inputs.config = e.config;
    inputs.weights = *weights;
    inputs.tensor_count = e.store.tensors().size();
    if (!options.draft_model.empty()) {  // speculative decoding with a draft model: planned with the target
      Result<ModelConfig> draft_config = load_config(options.draft_model);
      if (!draft_config) fail(draft_config.error().code, format("draft model %s: %s", options.draft_model.c_str(),
                                                                draft_config.error().message.c_str()));
      e.draft_config = std::move(*draft_config);
      Result<TensorStore> draft_store = TensorStore::open_dir(options.draft_model);
      if (!draft_store) throw draft_store.error();
      e.draft_store = std::move(*draft_store);
      if (e.draft_store.empty())
        fail(ErrorCode::missing_tensor, format("draft model %s has no safetensors weights", options.draft_model.c_str()));
      Result<WeightsSummary> draft_weights = summarize_weights(e.draft_config, &e.draft_store);
      if (!draft_weights) throw draft_weights.error();
      auto draft = std::make_shared<PlanInputs>();
      draft->config = e.draft_config;
      draft->weights = std::move(*draft_weights);
      draft->tensor_count = e.draft_store.tensors().size();
      inputs.draft = std::move(draft);
    }
    Result<Plan> plan = plan_engine(inputs, options);
    if (!plan) throw plan.error();
    e.plan = std::move(*plan);
    // Load progress: bytes of weights made ready (the CPU pages them in tensor by tensor; CUDA uploads them layer
    // by layer).
    // false from the callback aborts: everything taken so far is released as this function unwinds.
    const uint64_t total_weight_bytes = inputs.weights.total_bytes;
    auto progress = [&](uint64_t done) {
      if (options.load_progress && !options.load_progress(done, total_weight_bytes))
        fail(ErrorCode::cancelled, format("opening %s cancelled by the load-progress callback after %s of %s",
                                          model_dir.c_str(), format_bytes(done).c_str(),
                                          format_bytes(total_weight_bytes).c_str()));
    };
    progress(0);
    const BackendKind backend_kind = e.plan.device.backend;
    const bool gpu = backend_kind == BackendKind::cuda;
    if (gpu && !e.plan.device.queried)  // a card planned on a machine without one: plannable, not runnable
      fail(cuda::built_with_cuda() ? ErrorCode::device_error : ErrorCode::unsupported,
           format("backend cuda: %s; the plan is for a %s that is not here (%s)",
                  cuda::built_with_cuda() ? "no CUDA device is visible (no GPU, or no driver)"
                                          : "kvlite was built without CUDA (no nvcc at build time); rebuild with the "
                                            "CUDA toolkit",
                  e.plan.device.name.c_str(), "use --backend cpu or auto"));

    Result<TextModelWeights> bound = bind_text_weights(e.config, e.store);
    if (!bound) throw bound.error();
    std::optional<VisionWeights> vision_weights;
    if (e.config.vision.present) {
      if (e.config.vision.out_hidden_size != e.config.text.hidden_size)
        fail(ErrorCode::bad_format,
             format("%s: vision_config.out_hidden_size %lld differs from the language model's hidden_size %lld; the "
                    "image embeddings replace token embeddings, so they must match", e.config.origin.c_str(),
                    (long long)e.config.vision.out_hidden_size, (long long)e.config.text.hidden_size));
      Result<VisionWeights> bound_vision = bind_vision_weights(e.config, e.store);
      if (!bound_vision) throw bound_vision.error();
      vision_weights = std::move(*bound_vision);
    }
    const DType kv_dtype = detail::engine::kv_element_dtype(e.plan.options.kv_dtype);

    // The one reservation (one cudaMalloc on a GPU): everything below is carved from it.
    Result<std::unique_ptr<Arena>> arena = Arena::create(e.plan, e.config);
    if (!arena) throw arena.error();
    e.arena = std::move(*arena);

    if (gpu) {
      const ArenaRegion* workspace = e.arena->region("workspace");
      if (!workspace) fail(ErrorCode::internal, "the CUDA plan has no workspace region");
      CudaBackendOptions backend_options;
      backend_options.device = options.device;
      backend_options.workspace = e.arena->region_data("workspace");
      backend_options.workspace_bytes = workspace->bytes;
      backend_options.activation_dtype = *e.plan.options.activation_dtype;
      backend_options.programmatic_launch = options.cuda_programmatic_launch;
      backend_options.host_staging_bytes = e.plan.host_staging_bytes;  // --host-embeddings: pinned host memory
      Result<std::unique_ptr<Backend>> backend = make_cuda_backend(backend_options);
      if (!backend) throw backend.error();
      e.backend = std::move(*backend);
    } else {
      // what the plan's workspace row counted (cpu_backend_options_for), plus the test switch
      CpuBackendOptions backend_options = detail::cpu_backend_options_for(
          e.config, *weights, inputs.draft.get(), *e.plan.options.activation_dtype, options.threads,
          options.cpu_kernels, options.cpu_lm_head);
      backend_options.fp8_activations = options.fp8_activations;
      Result<std::unique_ptr<Backend>> backend = make_cpu_backend(backend_options);
      if (!backend) throw backend.error();
      e.backend = std::move(*backend);
    }
    if (!e.backend->supports(Op::kv_write, kv_dtype) || !e.backend->supports(Op::attention, kv_dtype))
      fail(ErrorCode::unsupported, format("the %s backend does not store the KV cache as %s; choose another KV dtype "
                                          "(f32, bf16 or f16)",
                                          e.backend->name().c_str(), kv_dtype_name(e.plan.options.kv_dtype)));

    TextModelWeights text_weights;
    if (gpu) {
      detail::engine::WeightUploader upload(*e.backend, *e.arena, e.plan.upload_chunk_bytes);
      text_weights = detail::engine::upload_text_weights(*bound, upload, progress, total_weight_bytes,
                                                         e.plan.host_embedding_bytes > 0);
      if (e.plan.host_embedding_bytes > 0)  // read once now, so that the first steps do not wait for the disk
        if (const TensorInfo* table = e.store.find(e.config.text_prefix() + "embed_tokens.weight"))
          e.store.page_in(*table);
      // the vision tower (Qwen3-VL) into the same span, after the text model: its views become device memory
      if (vision_weights) vision_weights = detail::engine::upload_vision_weights(*vision_weights, upload);
    } else {
      // The CPU computes from the mapped files: page them in now, tensor by tensor in file order, so that the
      // progress counts bytes really read (a cancel lands between tensors) and the first request does not
      // pay for the reads.
      uint64_t paged = 0;
      for (const TensorInfo& tensor : e.store.tensors()) {
        e.store.page_in(tensor);
        paged += tensor.nbytes;
        progress(std::min(paged, total_weight_bytes));
      }
      text_weights = std::move(*bound);
      if (options.cpu_lm_head == CpuLmHead::int8 && !text_weights.lm_head.quant) {  // (a quantized one stays)
        // The copy the plan's repack row counted; the stored lm_head (or, tied, embed_tokens: its lookups still
        // read the stored rows) stays mapped. The draft model, if any, keeps its own as stored.
        Result<QuantWeight> copy = quantize_int8_copy(text_weights.lm_head.weight, "lm_head (int8 copy)",
                                                      detail::cpu_threads_or_all(options.threads));
        if (!copy) throw copy.error();
        text_weights.lm_head.quant = std::make_shared<const QuantWeight>(std::move(*copy));
        text_weights.lm_head.weight = Tensor{};
      }
      // --host-embeddings changes nothing on the CPU (its table is host memory already) but the op that looks the
      // rows up: the GPU's path (gather_host_rows in stage()), run here as a plain gather
      text_weights.embed_tokens_on_host = e.plan.options.host_embeddings;
    }
    progress(total_weight_bytes);
    e.info.backend = backend_kind;
    e.info.backend_name = e.backend->name();
    e.info.activation_dtype = e.backend->activation_dtype();
    e.info.decode_weight_bytes = detail::engine::decode_weight_bytes(text_weights, gpu);
    e.info.host_embeddings = text_weights.embed_tokens_on_host;
    e.model = std::make_unique<TextModel>(e.config, std::move(text_weights), *e.backend, *e.arena, e.plan, kv_dtype);
    e.speculator.open(e.plan.options.speculative_tokens, e.plan.options.ngram, e.plan.max_model_len,
                      e.config.text.vocab_size, size_t(e.plan.options.max_seqs));
    if (!options.draft_model.empty()) {
      // (the plan refused a draft model on CUDA: its weights are the mmap's views, as the CPU target's)
      Result<TextModelWeights> draft_weights = bind_text_weights(e.draft_config, e.draft_store);
      if (!draft_weights)
        fail(draft_weights.error().code,
             format("draft model %s: %s", options.draft_model.c_str(), draft_weights.error().message.c_str()));
      auto draft_model = std::make_unique<TextModel>(e.draft_config, std::move(*draft_weights), *e.backend,
                                                     *e.arena, e.plan, kv_dtype, TextModelRegions::draft());
      float* draft_probs = reinterpret_cast<float*>(e.arena->region_data("draft_probs"));
      if (!draft_probs) fail(ErrorCode::internal, "the plan for a draft model has no draft_probs region");
      e.speculator.set_draft_model(std::move(draft_model), draft_probs);
    }
    if (vision_weights) {
      e.vision = std::make_unique<VisionModel>(e.config, std::move(*vision_weights), *e.backend, *e.arena, e.plan);
      // The processor's options, with the plan's image budget: the vision buffers hold no larger image.
      e.preprocess = preprocess_options(e.config);
      e.preprocess.max_pixels = std::min(e.preprocess.max_pixels, e.plan.options.max_image_pixels);
      e.preprocess.min_pixels = std::min(e.preprocess.min_pixels, e.preprocess.max_pixels);
    }

    Result<Tokenizer> tokenizer = Tokenizer::load(model_dir);
    if (!tokenizer) throw tokenizer.error();
    e.tokenizer = std::move(*tokenizer);
    const Tokenizer& tok = *e.tokenizer;
    if (e.speculator.draft_model()) {
      // A draft's ids must mean what the target's mean: the same vocabulary, token for token.
      Result<Tokenizer> draft_tokenizer = Tokenizer::load(options.draft_model);
      if (!draft_tokenizer)
        fail(draft_tokenizer.error().code, format("draft model %s: %s", options.draft_model.c_str(),
                                                  draft_tokenizer.error().message.c_str()));
      if (draft_tokenizer->vocab_size() != tok.vocab_size())
        fail(ErrorCode::invalid_argument,
             format("draft model %s: its tokenizer has %zu tokens but %s's has %zu; a draft must use the target's "
                    "tokenizer", options.draft_model.c_str(), draft_tokenizer->vocab_size(), model_dir.c_str(),
                    tok.vocab_size()));
      for (size_t id = 0; id < tok.vocab_size(); id++)
        if (draft_tokenizer->token_text(int32_t(id)) != tok.token_text(int32_t(id)))
          fail(ErrorCode::invalid_argument,
               format("draft model %s: token %zu is '%s' in its tokenizer but '%s' in %s's; a draft must use the "
                      "target's tokenizer", options.draft_model.c_str(), id,
                      draft_tokenizer->token_text(int32_t(id)).c_str(), tok.token_text(int32_t(id)).c_str(),
                      model_dir.c_str()));
    }

    // Stop ids: config.json's and generation_config.json's eos, the tokenizer's eos, and the end-of-turn
    // tokens of the chat formats kvlite writes.
    std::set<int32_t> stops;
    auto add_stop = [&](int64_t id) {
      if (id >= 0 && id < e.config.text.vocab_size) stops.insert(int32_t(id));
    };
    for (int64_t id : e.config.text.eos_token_ids) add_stop(id);
    for (int64_t id : detail::engine::generation_eos_ids(model_dir)) add_stop(id);
    add_stop(tok.eos_id());
    add_stop(tok.token_id("<|im_end|>"));
    add_stop(tok.token_id("<|eot_id|>"));
    e.stop_ids.assign(stops.begin(), stops.end());

    const size_t max_tokens = size_t(e.plan.options.max_batched_tokens), max_seqs = size_t(e.plan.options.max_seqs);
    e.batch.open(max_tokens, max_seqs, e.config.uses_mrope() ? 3 : 1);  // M-RoPE: 3 rows of positions
    e.raw_row.assign(size_t(e.config.text.vocab_size), 0.0f);
    e.scheduler.open(e.arena->kv(), e.arena->kv_main_window(), e.arena->kv_window(), e.arena->window(),
                     e.plan.options.max_batched_tokens,
                     e.plan.options.max_seqs, e.plan.prefix_caching.value_or(!gpu));  // plan_engine resolved prefix caching
    e.info.prefix_caching = e.scheduler.prefix_caching();
    if (!gpu && e.backend->activation_dtype() != DType::F32)  // 16-bit logits on the CPU, widened for the sampler
      e.logits_host.assign(size_t(e.model->max_logit_rows() * e.config.text.vocab_size), 0.0f);
    if (gpu) {
      // Host side of the logits: a chunk as the GPU stores it, widened to float, and the host sampler's scratch.
      const size_t vocab = size_t(e.config.text.vocab_size), rows = size_t(e.model->max_logit_rows());
      e.logits_raw.assign(rows * vocab * dtype_bytes(e.backend->activation_dtype(), 1), 0);
      e.logits_host.assign(rows * vocab, 0.0f);
      e.host_probs.assign(vocab, 0.0f);
      e.host_order.assign(vocab, 0);
      e.device_params.reserve(rows);
      e.device_rows.reserve(rows);
      e.sampled_ids.assign(rows, 0);
      if (options.cuda_graphs)
        e.graphs.capture(*e.model, *e.backend, e.pool(), e.arena->kv_window(), e.batch.position_rows,
                         e.plan.options.max_seqs,
                         e.plan.options.max_batched_tokens, e.max_model_len(), e.info);
    }
    if (detail::log_enabled(LogLevel::info))
      detail::log(LogLevel::info,
                  format("opened %s on %s [%s]: arena %s, KV %s tokens, max_model_len %lld, %s left free",
                         model_dir.c_str(), e.info.backend_name.c_str(), e.plan.backend_rule.c_str(),
                         format_bytes(e.plan.arena_bytes()).c_str(), detail::planning::format_count(e.plan.kv_tokens).c_str(),
                         (long long)e.plan.max_model_len, format_bytes(e.plan.free_bytes).c_str()));
    e.publish_stats();
    return engine;
  });
}

const Plan& Engine::plan() const { return impl_->plan; }
const ModelConfig& Engine::config() const { return impl_->config; }
const Tokenizer& Engine::tokenizer() const { return *impl_->tokenizer; }
const Arena& Engine::arena() const { return *impl_->arena; }
const std::vector<int32_t>& Engine::stop_token_ids() const { return impl_->stop_ids; }

// Every call below holds the engine (Impl::CallLock) for its whole run: see "Threads" in engine.hpp.
Result<std::vector<int32_t>> Engine::tokenize(const std::string& text, bool add_special_tokens) const {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "tokenize");
    return impl_->tokenizer->encode(text, add_special_tokens).value();
  });
}

Result<std::string> Engine::detokenize(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "detokenize");
    return impl_->tokenizer->decode(ids, skip_special_tokens).value();
  });
}

Result<RequestId> Engine::submit(const std::vector<int32_t>& prompt_ids, const SamplingParams& params,
                                 const TokenCallback& on_token) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "submit");
    return impl_->submit(prompt_ids, {}, params, on_token);
  });
}

Result<RequestId> Engine::submit(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images,
                                 const SamplingParams& params, const TokenCallback& on_token) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "submit");
    return impl_->submit(prompt_ids, images, params, on_token);
  });
}

Result<VisionInput> Engine::preprocess(const Image& image) const {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "preprocess");
    return std::move(impl_->preprocess_all({image}).front());
  });
}

Result<ImageFeatures> Engine::encode_images(const std::vector<VisionInput>& images) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "encode_images");
    std::vector<const VisionInput*> inputs;
    for (const VisionInput& image : images) inputs.push_back(&image);
    return impl_->encode_images(inputs);
  });
}

Result<bool> Engine::step() {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "step");
    Impl::CallScope scope(*impl_);
    return impl_->step();
  });
}

Status Engine::run() {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "run");
    impl_->run_until([&] { return impl_->scheduler.idle(); });
  });
}

void Engine::set_op_timing(bool on) {
  if (impl_->call_owner.load() == std::this_thread::get_id()) {  // from a callback: the step reads it next op
    impl_->backend->set_op_timing(on);
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->call_mutex);
  impl_->backend->set_op_timing(on);
}

bool Engine::finished(RequestId id) const {
  Result<bool> done = detail::guard([&] {
    Impl::CallLock lock(*impl_, "finished");
    auto it = impl_->requests.find(id);
    return it != impl_->requests.end() && it->second->finished;
  });
  return done && *done;  // from inside a token callback: false (the step is still running)
}

Result<Generation> Engine::result(RequestId id) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "result");
    auto it = impl_->requests.find(id);
    if (it == impl_->requests.end() || it->second->kind != detail::RequestKind::generate)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("no request %lld (unknown, or its result was already taken)", (long long)id));
    if (!it->second->finished)
      detail::fail(ErrorCode::invalid_argument, detail::format("request %lld is still running", (long long)id));
    Generation generation = std::move(it->second->result);
    impl_->requests.erase(it);
    return generation;
  });
}

Result<Generation> Engine::generate(const std::vector<int32_t>& prompt_ids, const SamplingParams& params,
                                    const TokenCallback& on_token) {
  return generate(prompt_ids, std::vector<VisionInput>{}, params, on_token);
}

Result<Generation> Engine::generate(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images,
                                    const SamplingParams& params, const TokenCallback& on_token) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "generate");
    RequestId id = impl_->submit(prompt_ids, images, params, on_token);
    try {
      impl_->run_until([&] { return impl_->requests.at(id)->finished; });
    } catch (const Error& error) {
      // cancel() stopped the call: this request ended with FinishReason::cancelled and keeps what it generated
      // (abort_all finished it); the other requests in flight were dropped with theirs.
      auto it = impl_->requests.find(id);
      const bool kept = error.code == ErrorCode::cancelled && it != impl_->requests.end() && it->second->finished;
      if (!kept) {
        impl_->erase(id);
        throw;
      }
    } catch (...) {
      impl_->erase(id);
      throw;
    }
    Generation generation = std::move(impl_->requests.at(id)->result);
    impl_->erase(id);
    return generation;
  });
}

Result<Generation> Engine::generate(const std::string& prompt, const SamplingParams& params,
                                    const TokenCallback& on_token) {
  return generate(prompt, std::vector<Image>{}, params, on_token);
}

Result<Generation> Engine::generate(const std::string& prompt, const std::vector<Image>& images,
                                    const SamplingParams& params, const TokenCallback& on_token) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "generate");  // the inner generate is nested on this thread: no second lock
    std::vector<int32_t> ids = impl_->tokenizer->encode(prompt, true).value();
    std::vector<VisionInput> inputs = impl_->preprocess_all(images);
    return generate(ids, inputs, params, on_token).value();
  });
}

Result<Generation> Engine::generate_chat(const std::vector<ChatMessage>& messages, const SamplingParams& params,
                                         const TokenCallback& on_token) {
  return generate_chat(messages, std::vector<Image>{}, params, on_token);
}

Result<Generation> Engine::generate_chat(const std::vector<ChatMessage>& messages, const std::vector<Image>& images,
                                         const SamplingParams& params, const TokenCallback& on_token) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "generate_chat");
    std::string prompt = impl_->tokenizer->format_chat(messages, true).value();
    // The formatted prompt already holds its special tokens (Llama-3's <|begin_of_text|> included), so it is
    // encoded without adding more.
    std::vector<int32_t> ids = impl_->tokenizer->encode(prompt, false).value();
    std::vector<VisionInput> inputs = impl_->preprocess_all(images);
    return generate(ids, inputs, params, on_token).value();
  });
}

Result<ScoreResult> Engine::score(const std::vector<int32_t>& ids, int64_t context_length, int64_t stride,
                                  const ScoreProgress& progress) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "score");
    Impl& e = *impl_;
    Result<std::vector<ScoreWindow>> windows = score_windows(int64_t(ids.size()), context_length, stride);
    if (!windows) throw windows.error();
    e.check_ids(ids, "score");
    const int64_t longest = std::min<int64_t>(context_length, int64_t(ids.size()));
    e.check_fits(longest, detail::format("scoring with context length %lld", (long long)context_length),
                 "raise max_model_len to the context length (EngineOptions::plan.max_model_len; kvlite score does)");

    ScoreResult result;
    result.context_length = context_length;
    result.stride = stride;
    result.windows = int64_t(windows->size());
    result.logprobs.assign(ids.size(), std::numeric_limits<double>::quiet_NaN());
    std::vector<RequestId> window_ids;
    for (const ScoreWindow& w : *windows) {
      detail::EngineRequest& r = e.add_request(
          detail::RequestKind::score, std::vector<int32_t>(ids.begin() + w.begin, ids.begin() + w.end));
      // Row p predicts tokens[p + 1]: targets [first_target, end) are rows [first_target - 1, end - 1).
      r.want_begin = w.first_target - 1 - w.begin;
      r.want_end = w.end - 1 - w.begin;
      r.logprobs = result.logprobs.data() + w.begin;
      window_ids.push_back(r.id);
    }
    auto windows_done = [&] {
      int64_t done = 0;
      for (RequestId id : window_ids) done += e.requests.at(id)->finished ? 1 : 0;
      return done;
    };
    try {
      int64_t reported = 0;
      e.run_until([&] {
        int64_t done = windows_done();
        if (progress && done != reported) progress(reported = done, int64_t(window_ids.size()));
        return done == int64_t(window_ids.size());
      });
    } catch (...) {
      for (RequestId id : window_ids) e.erase(id);
      throw;
    }
    for (RequestId id : window_ids) e.erase(id);

    // Exact: every token after the first, once.
    for (size_t p = 1; p < ids.size(); p++) result.nll_sum -= result.logprobs[p];
    result.tokens = int64_t(ids.size()) - 1;
    result.perplexity = std::exp(result.nll_sum / double(result.tokens));
    // The guide: window mean losses weighted by trg_len - 1, trg_len = end - previous end.
    double weighted = 0, weights = 0;
    int64_t previous_end = 0;
    for (const ScoreWindow& w : *windows) {
      double window_nll = 0;
      for (int64_t p = w.first_target; p < w.end; p++) window_nll -= result.logprobs[size_t(p)];
      const double weight = double(w.end - previous_end - 1);
      weighted += window_nll / double(w.end - w.first_target) * weight;
      weights += weight;
      previous_end = w.end;
    }
    result.guide_perplexity = weights > 0 ? std::exp(weighted / weights) : std::numeric_limits<double>::quiet_NaN();
    return result;
  });
}

Result<ScoreResult> Engine::score(const std::string& text, int64_t context_length, int64_t stride,
                                  const ScoreProgress& progress) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "score");
    std::vector<int32_t> ids = impl_->tokenizer->encode(text, true).value();
    return score(ids, context_length, stride, progress).value();
  });
}

Result<Logits> Engine::logits(const std::vector<int32_t>& ids) { return logits(ids, std::vector<VisionInput>{}); }

Result<Logits> Engine::logits(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "logits");
    Impl& e = *impl_;
    e.check_ids(prompt_ids, "logits");
    detail::VisionPrompt prompt = e.prepare_prompt(prompt_ids, images, "logits");
    const std::vector<int32_t>& ids = prompt.ids;
    e.check_fits(int64_t(ids.size()), detail::format("a logits request of %zu tokens", ids.size()),
                 "raise max_model_len (EngineOptions::plan.max_model_len, kvlite --max-model-len)");
    Logits out;
    out.tokens = int64_t(ids.size());
    out.vocab = e.config.text.vocab_size;
    out.values.assign(size_t(out.tokens * out.vocab), 0.0f);
    detail::EngineRequest& r = e.add_request(detail::RequestKind::logits, ids);
    Impl::attach(r, std::move(prompt));
    r.want_begin = 0;
    r.want_end = out.tokens;
    r.logits = out.values.data();
    const RequestId id = r.id;
    try {
      e.run_until([&] { return e.requests.at(id)->finished; });
    } catch (...) {
      e.erase(id);
      throw;
    }
    e.erase(id);
    return out;
  });
}

// Lock-free atomics only (no lock, no allocation, no log): async-signal-safe, so a SIGINT handler may call it.
static_assert(std::atomic<uint64_t>::is_always_lock_free, "Engine::cancel() must be async-signal-safe");
void Engine::cancel() {
  const uint64_t call = impl_->running_call.load();
  if (call != 0) impl_->cancelled_call.store(call);
}

Status Engine::cancel(RequestId id) {
  if (id <= 0 || id > impl_->last_issued_id.load())
    return Error(ErrorCode::invalid_argument,
                 detail::format("cancel: no request %lld was ever submitted to this engine", (long long)id));
  std::lock_guard<std::mutex> lock(impl_->request_cancels_mutex);
  impl_->request_cancels.insert(id);  // at most one entry per id ever issued; cleared by every step
  return Status();
}

EngineStats Engine::stats() const {
  if (impl_->call_owner.load() == std::this_thread::get_id()) {  // from a callback: the live counters
    EngineStats stats = impl_->stats;
    stats.op_times = impl_->backend->op_times();
    return stats;
  }
  std::lock_guard<std::mutex> lock(impl_->published_stats_mutex);  // as of the last step (or call) to end
  return impl_->published_stats;
}

EngineInfo Engine::info() const { return impl_->info; }

Result<CopyBandwidth> Engine::measure_copy_bandwidth(uint64_t bytes, int repeats) {
  return detail::guard([&] {
    Impl::CallLock lock(*impl_, "measure_copy_bandwidth");
    Impl& e = *impl_;
    if (!e.scheduler.idle())
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("measure_copy_bandwidth: wait until the %zu requests in flight finish (on a GPU "
                                  "it copies over the KV pages)", e.scheduler.running_count() + e.scheduler.waiting_count()));
    if (repeats < 1)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("measure_copy_bandwidth: repeats %d must be >= 1", repeats));
    CopyBandwidth result;
    result.repeats = repeats;
    if (e.on_gpu()) {
      const ArenaRegion* kv = e.arena->region("kv");
      const uint64_t half = kv->bytes / 2 / 256 * 256;
      if (bytes == 0) bytes = std::min<uint64_t>(half, 256 * MiB);
      if (bytes == 0 || bytes > half)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("measure_copy_bandwidth: %llu bytes; the KV region (%s) holds two copies of at "
                                    "most %s", (unsigned long long)bytes, format_bytes(kv->bytes).c_str(),
                                    format_bytes(half).c_str()));
      uint8_t* src = e.arena->base() + kv->offset;
      Result<double> measured = cuda::copy_bandwidth(*e.backend, src + half, src, bytes, repeats);
      if (!measured) throw measured.error();
      result.bytes_per_second = *measured;
      result.method = "cudaMemcpy device to device";
    } else {
      if (bytes == 0) bytes = 256 * MiB;
      std::vector<uint8_t> src(static_cast<size_t>(bytes), 1), dst(static_cast<size_t>(bytes), 0);
      memcpy(dst.data(), src.data(), bytes);  // untimed: the first touch of fresh pages costs page faults
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < repeats; i++) memcpy(dst.data(), src.data(), bytes);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!(seconds > 0) || dst[bytes - 1] != 1)
        detail::fail(ErrorCode::internal, "measure_copy_bandwidth: the copies took no time or did not happen");
      result.bytes_per_second = 2.0 * double(bytes) * double(repeats) / seconds;  // read + written
      result.method = "memcpy";
    }
    result.bytes = bytes;
    return result;
  });
}

Status write_npy(const std::string& path, const float* values, int64_t rows, int64_t cols) {
  return detail::guard([&] {
    if (rows < 0 || cols < 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("write_npy: shape [%lld, %lld] is negative", (long long)rows, (long long)cols));
    // the values' bytes, overflow-checked (rows x cols x 4 sizes the write)
    detail::checked_mul(detail::checked_mul(uint64_t(rows), uint64_t(cols), "write_npy elements", ErrorCode::invalid_argument),
                        4, "write_npy bytes", ErrorCode::invalid_argument);
    if (rows * cols > 0 && values == nullptr)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("write_npy: shape [%lld, %lld] is negative or the values are null", (long long)rows,
                                  (long long)cols));
    // numpy.lib.format: the dict, spare spaces so the first axis can grow to 21 digits in place, then spaces
    // and a newline up to a multiple of 64 bytes counted from the file's start (10 bytes of magic + length).
    std::string rows_text = detail::format("%lld", (long long)rows);
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + rows_text + ", " +
                         detail::format("%lld", (long long)cols) + "), }";
    header += std::string(rows_text.size() < 21 ? 21 - rows_text.size() : 0, ' ');
    header += std::string(63 - (10 + header.size()) % 64, ' ') + "\n";
    std::string prefix = std::string("\x93NUMPY\x01\x00", 8);
    prefix += char(header.size() & 0xff);
    prefix += char(header.size() >> 8);
    FILE* file = fopen(path.c_str(), "wb");
    if (!file) detail::fail(ErrorCode::io_error, detail::format("cannot write %s: %s", path.c_str(), strerror(errno)));
    const size_t count = size_t(rows * cols);
    bool written = fwrite(prefix.data(), 1, prefix.size(), file) == prefix.size() &&
                   fwrite(header.data(), 1, header.size(), file) == header.size() &&
                   fwrite(values, sizeof(float), count, file) == count;  // little-endian hosts only, as kvlite
    if (fclose(file) != 0) written = false;
    if (!written) detail::fail(ErrorCode::io_error, detail::format("cannot write %s (disk full?)", path.c_str()));
  });
}

}  // namespace kvlite
