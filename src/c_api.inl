// c_api: the C functions of c_api.h over the C++ API. Every function catches everything (guard / catch (...)):
// no exception crosses into C. Memory handed to the caller comes from malloc, so that kvlite_free is free().
#include <cstdlib>
#include <cstring>

struct kvlite_engine {
  std::unique_ptr<kvlite::Engine> engine;
};
struct kvlite_image {
  kvlite::Image image;
};

namespace kvlite {
namespace detail {
namespace c_api {

thread_local std::string last_error;

int fail_with(const Error& error) {
  last_error = error.message;
  return int(error.code);
}

int invalid(const char* message) { return fail_with(Error(ErrorCode::invalid_argument, message)); }

// Runs f (which returns a Status-like int or throws kvlite::Error) with everything caught.
template <class F>
int call(F&& f) {
  Status status = guard([&] { f(); });
  return status ? KVLITE_OK : fail_with(status.error());
}

// A copy of `text` in malloc'd memory (the caller frees it with kvlite_free).
char* malloc_string(const std::string& text) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (!copy) fail(ErrorCode::out_of_memory, "kvlite: out of host memory for a returned string");
  std::memcpy(copy, text.c_str(), text.size() + 1);
  return copy;
}

template <class T>
T* malloc_array(const std::vector<T>& values) {
  if (values.empty()) return nullptr;
  T* copy = static_cast<T*>(std::malloc(values.size() * sizeof(T)));
  if (!copy) fail(ErrorCode::out_of_memory, "kvlite: out of host memory for a returned array");
  std::memcpy(copy, values.data(), values.size() * sizeof(T));
  return copy;
}

void need(const void* pointer, const char* what) {
  if (!pointer) fail(ErrorCode::invalid_argument, format("%s is NULL", what));
}

// A (pointer, count) pair from C: a count without its array is an error.
template <class T>
void need_array(const T* pointer, size_t count, const char* what) {
  if (count > 0 && !pointer) fail(ErrorCode::invalid_argument, format("%s is NULL but its count is %zu", what, count));
}

// Stop tokens and stop strings one C call may pass (each): checked before they are copied.
constexpr int64_t kMaxCStopEntries = limits::max_stop_entries;

// A struct from C must come from its *_init function (which sets struct_size). A size below the first version's
// is a caller that forgot the init; one between it and this version's is an older caller's, whose missing fields
// (appended since) take their init values; a larger one is a newer header's, whose added fields this version does
// not read. The copy returned is this version's whole struct.
template <class S>
S widen_struct(const S* s, size_t first_version_size, void (*init)(S*), const char* name, const char* init_name) {
  if (s->struct_size < first_version_size)
    fail(ErrorCode::invalid_argument, format("%s.struct_size is %u, less than any version's (%zu): call %s before "
                                             "setting fields", name, unsigned(s->struct_size), first_version_size,
                                             init_name));
  S whole;
  init(&whole);
  std::memcpy(static_cast<void*>(&whole), s, std::min(size_t(s->struct_size), sizeof(S)));
  whole.struct_size = uint32_t(sizeof(S));
  return whole;
}
// The sizes of version 0.1.0's structs: the fields before those appended since.
constexpr size_t kOptionsFirstSize = offsetof(kvlite_options, name);
constexpr size_t kSamplingFirstSize = offsetof(kvlite_sampling, request_out);

EngineOptions engine_options(const kvlite_options* given) {
  EngineOptions options;
  options.backend = BackendChoice::auto_;
  if (!given) return options;
  const kvlite_options whole = widen_struct(given, kOptionsFirstSize, kvlite_options_init, "kvlite_options",
                                            "kvlite_options_init");
  const kvlite_options* in = &whole;
  switch (in->backend) {
    case KVLITE_BACKEND_AUTO: options.backend = BackendChoice::auto_; break;
    case KVLITE_BACKEND_CPU: options.backend = BackendChoice::cpu; break;
    case KVLITE_BACKEND_CUDA: options.backend = BackendChoice::cuda; break;
    default: fail(ErrorCode::invalid_argument, format("kvlite_options.backend %d is none of KVLITE_BACKEND_AUTO, "
                                                      "_CPU, _CUDA", int(in->backend)));
  }
  options.device = in->device;
  if (in->device_mem) options.plan.device_mem = in->device_mem;
  if (in->utilization != 0) options.plan.utilization = in->utilization;
  options.plan.max_model_len = in->max_model_len;
  options.plan.max_seqs = in->max_seqs;
  options.plan.max_batched_tokens = in->max_batched_tokens;
  if (in->kv_dtype) {
    Result<KVDType> dtype = parse_kv_dtype(in->kv_dtype);
    if (!dtype) throw dtype.error();
    options.plan.kv_dtype = *dtype;
  }
  options.plan.max_image_pixels = in->max_image_pixels;
  if (in->max_images) options.plan.max_images = in->max_images;
  options.plan.kv_fill = in->kv_fill != 0;
  options.plan.host_embeddings = in->host_embeddings != 0;
  check_cpu_threads(in->threads, "kvlite_options.threads");
  options.threads = in->threads;
  if (in->name) options.name = in->name;
  if (in->log_level < KVLITE_LOG_DEBUG || in->log_level > KVLITE_LOG_ERROR)
    fail(ErrorCode::invalid_argument, format("kvlite_options.log_level %d is none of KVLITE_LOG_DEBUG (0) .. "
                                             "KVLITE_LOG_ERROR (3)", int(in->log_level)));
  options.log_level = LogLevel(in->log_level);
  if (in->log) {
    const kvlite_log_fn log = in->log;
    void* const user_data = in->log_user_data;
    options.log = [log, user_data](LogLevel level, const std::string& message) {
      log(int32_t(level), message.c_str(), user_data);
    };
  }
  return options;
}

// request_out (may be NULL) receives kvlite_sampling.request_out, where a generate call reports its request's id.
SamplingParams sampling_params(const kvlite_sampling* given, int64_t** request_out = nullptr) {
  SamplingParams params;
  if (request_out) *request_out = nullptr;
  if (!given) return params;
  const kvlite_sampling whole = widen_struct(given, kSamplingFirstSize, kvlite_sampling_init, "kvlite_sampling",
                                             "kvlite_sampling_init");
  const kvlite_sampling* in = &whole;
  if (request_out) *request_out = in->request_out;
  params.temperature = in->temperature;
  params.top_k = in->top_k;
  params.top_p = in->top_p;
  params.min_p = in->min_p;
  params.repetition_penalty = in->repetition_penalty;
  params.seed = in->seed;
  params.max_tokens = in->max_tokens;
  need_array(in->stop_tokens, in->n_stop_tokens, "kvlite_sampling.stop_tokens");
  need_array(in->stop_strings, in->n_stop_strings, "kvlite_sampling.stop_strings");
  if (in->n_stop_tokens > size_t(kMaxCStopEntries) || in->n_stop_strings > size_t(kMaxCStopEntries))
    fail(ErrorCode::invalid_argument, format("kvlite_sampling: %zu stop tokens and %zu stop strings; at most %lld each",
                                             in->n_stop_tokens, in->n_stop_strings, (long long)kMaxCStopEntries));
  params.stop_tokens.assign(in->stop_tokens, in->stop_tokens + in->n_stop_tokens);
  for (size_t i = 0; i < in->n_stop_strings; i++) {
    need(in->stop_strings[i], "a kvlite_sampling.stop_strings entry");
    params.stop_strings.emplace_back(in->stop_strings[i]);
  }
  params.ignore_eos = in->ignore_eos != 0;
  // bounded reads: a string past its limit is refused without reading it to the end
  auto bounded = [](const char* text, int64_t limit, const char* field) {
    if (!text) return std::string();
    const size_t length = strnlen(text, size_t(limit) + 1);
    if (int64_t(length) > limit)
      fail(ErrorCode::invalid_argument, format("kvlite_sampling.%s is longer than %lld bytes", field, (long long)limit));
    return std::string(text, length);
  };
  params.grammar = bounded(in->grammar, limits::max_grammar_bytes, "grammar (KVLITE_MAX_GRAMMAR_BYTES)");
  params.json_schema = bounded(in->json_schema, limits::max_schema_bytes, "json_schema (KVLITE_MAX_SCHEMA_BYTES)");
  return params;
}

std::vector<ChatMessage> chat_messages(const char* const* roles, const char* const* contents, size_t n) {
  need_array(roles, n, "roles");
  need_array(contents, n, "contents");
  if (n > size_t(limits::max_chat_messages))
    fail(ErrorCode::invalid_argument, format("%zu chat messages; at most %lld", n, (long long)limits::max_chat_messages));
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < n; i++) {
    need(roles[i], "a role");
    need(contents[i], "a message's content");
    messages.push_back({roles[i], contents[i]});
  }
  return messages;
}

std::vector<Image> images_of(const kvlite_image* const* images, size_t n) {
  need_array(images, n, "images");
  std::vector<Image> out;
  for (size_t i = 0; i < n; i++) {
    need(images[i], "an image");
    out.push_back(images[i]->image);
  }
  return out;
}

TokenCallback token_callback(kvlite_token_fn on_token, void* user_data) {
  if (!on_token) return nullptr;
  return [on_token, user_data](const std::string& piece, int32_t id) { return on_token(piece.c_str(), id, user_data) != 0; };
}

void fill(kvlite_generation* out, Generation&& generation) {
  kvlite_generation result{};
  result.text = malloc_string(generation.text);
  try {
    result.ids = malloc_array(generation.ids);
  } catch (...) {
    std::free(result.text);
    throw;
  }
  result.n_ids = generation.ids.size();
  result.n_prompt_ids = generation.prompt_ids.size();
  result.finish_reason = int32_t(generation.finish_reason);
  *out = result;
}

Engine& engine_of(kvlite_engine* engine) {
  need(engine, "engine");
  if (!engine->engine) fail(ErrorCode::invalid_argument, "engine is not open");
  return *engine->engine;
}

}  // namespace c_api
}  // namespace detail
}  // namespace kvlite

extern "C" {

void kvlite_options_init(kvlite_options* options) {
  if (!options) return;
  std::memset(options, 0, sizeof *options);
  options->struct_size = uint32_t(sizeof *options);
  options->backend = KVLITE_BACKEND_AUTO;
  options->utilization = 0.90;
  options->max_images = 1;
  options->log_level = KVLITE_LOG_INFO;
}

void kvlite_sampling_init(kvlite_sampling* sampling) {
  if (!sampling) return;
  std::memset(sampling, 0, sizeof *sampling);
  const kvlite::SamplingParams defaults;
  sampling->struct_size = uint32_t(sizeof *sampling);
  sampling->temperature = defaults.temperature;
  sampling->top_k = defaults.top_k;
  sampling->top_p = defaults.top_p;
  sampling->min_p = defaults.min_p;
  sampling->repetition_penalty = defaults.repetition_penalty;
  sampling->seed = defaults.seed;
  sampling->max_tokens = defaults.max_tokens;
}

void kvlite_generation_free(kvlite_generation* generation) {
  if (!generation) return;
  std::free(generation->ids);
  std::free(generation->text);
  std::memset(generation, 0, sizeof *generation);
}

const char* kvlite_version(void) { return KVLITE_VERSION_STRING; }

const char* kvlite_status_name(int status) {
  if (status < 0 || status > int(kvlite::ErrorCode::internal)) return "unknown";
  return kvlite::error_code_name(kvlite::ErrorCode(status));
}

const char* kvlite_finish_reason_name(int32_t reason) {
  if (reason < 0 || reason > int32_t(kvlite::FinishReason::grammar_end)) return "unknown";
  return kvlite::finish_reason_name(kvlite::FinishReason(reason));
}

const char* kvlite_last_error(void) { return kvlite::detail::c_api::last_error.c_str(); }

void kvlite_free(void* memory) { std::free(memory); }

void kvlite_set_log(kvlite_log_fn log, void* user_data, int32_t min_level) {
  if (!log) {
    kvlite::set_log_callback(nullptr);
    return;
  }
  const int32_t level = min_level < KVLITE_LOG_DEBUG ? KVLITE_LOG_DEBUG : min_level > KVLITE_LOG_ERROR ? KVLITE_LOG_ERROR
                                                                                                       : min_level;
  try {
    kvlite::set_log_callback([log, user_data](kvlite::LogLevel l, const std::string& message) {
      log(int32_t(l), message.c_str(), user_data);
    }, kvlite::LogLevel(level));
  } catch (...) {  // std::function's allocation: nothing to report through a void function
  }
}

int kvlite_plan(const char* model_dir, const kvlite_options* options, int json, char** text_out, int* fits_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need(model_dir, "model_dir");
    need(text_out, "text_out");
    kvlite::Result<kvlite::Plan> plan = kvlite::plan_engine(model_dir, engine_options(options));
    if (!plan) throw plan.error();
    char* text = malloc_string(json ? plan->json() : plan->table());
    *text_out = text;
    if (fits_out) *fits_out = plan->fits ? 1 : 0;
  });
}

int kvlite_open(const char* model_dir, const kvlite_options* options, kvlite_progress_fn progress, void* user_data,
                kvlite_engine** engine_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need(model_dir, "model_dir");
    need(engine_out, "engine_out");
    kvlite::EngineOptions engine_options_ = engine_options(options);
    if (progress)
      engine_options_.load_progress = [progress, user_data](uint64_t done, uint64_t total) {
        return progress(done, total, user_data) != 0;
      };
    auto handle = std::make_unique<kvlite_engine>();
    kvlite::Result<std::unique_ptr<kvlite::Engine>> engine = kvlite::Engine::open(model_dir, engine_options_);
    if (!engine) throw engine.error();
    handle->engine = std::move(*engine);
    *engine_out = handle.release();
  });
}

void kvlite_close(kvlite_engine* engine) {
  try {
    delete engine;
  } catch (...) {  // destructors do not throw; belt and braces at the C boundary
  }
}

int kvlite_engine_plan(kvlite_engine* engine, int json, char** text_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    const kvlite::Plan& plan = engine_of(engine).plan();
    need(text_out, "text_out");
    *text_out = malloc_string(json ? plan.json() : plan.table());
  });
}

int kvlite_tokenize(kvlite_engine* engine, const char* text, int add_special_tokens, int32_t** ids_out, size_t* n_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(text, "text");
    need(ids_out, "ids_out");
    need(n_out, "n_out");
    kvlite::Result<std::vector<int32_t>> ids = e.tokenize(text, add_special_tokens != 0);
    if (!ids) throw ids.error();
    *ids_out = malloc_array(*ids);
    *n_out = ids->size();
  });
}

int kvlite_detokenize(kvlite_engine* engine, const int32_t* ids, size_t n_ids, int skip_special_tokens,
                      char** text_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need_array(ids, n_ids, "ids");
    need(text_out, "text_out");
    kvlite::Result<std::string> text =
        e.detokenize(std::vector<int32_t>(ids, ids + n_ids), skip_special_tokens != 0);
    if (!text) throw text.error();
    *text_out = malloc_string(*text);
  });
}

int kvlite_format_chat(kvlite_engine* engine, const char* const* roles, const char* const* contents,
                       size_t n_messages, int add_generation_prompt, char** text_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(text_out, "text_out");
    kvlite::Result<std::string> text =
        e.tokenizer().format_chat(chat_messages(roles, contents, n_messages), add_generation_prompt != 0);
    if (!text) throw text.error();
    *text_out = malloc_string(*text);
  });
}

int kvlite_apply_chat_template(kvlite_engine* engine, const char* messages_json, int add_generation_prompt,
                               const char* extra_json, char** text_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(messages_json, "messages_json");
    need(text_out, "text_out");
    kvlite::Result<std::string> text =
        e.tokenizer().apply_chat_template(messages_json, add_generation_prompt != 0, extra_json ? extra_json : "{}");
    if (!text) throw text.error();
    *text_out = malloc_string(*text);
  });
}

int kvlite_image_load(const char* path, kvlite_image** image_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need(path, "path");
    need(image_out, "image_out");
    kvlite::Result<kvlite::Image> image = kvlite::load_image(path);
    if (!image) throw image.error();
    *image_out = new kvlite_image{std::move(*image)};
  });
}

int kvlite_image_decode(const uint8_t* data, size_t size, kvlite_image** image_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need_array(data, size, "data");
    need(image_out, "image_out");
    kvlite::Result<kvlite::Image> image = kvlite::decode_image(data, size);
    if (!image) throw image.error();
    *image_out = new kvlite_image{std::move(*image)};
  });
}

int kvlite_image_from_pixels(const uint8_t* pixels, int64_t width, int64_t height, int32_t pixel_format,
                             int64_t stride_bytes, kvlite_image** image_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need(pixels, "pixels");
    need(image_out, "image_out");
    kvlite::PixelFormat format;
    switch (pixel_format) {
      case KVLITE_PIXELS_RGB8: format = kvlite::PixelFormat::rgb8; break;
      case KVLITE_PIXELS_BGR8: format = kvlite::PixelFormat::bgr8; break;
      case KVLITE_PIXELS_RGBA8: format = kvlite::PixelFormat::rgba8; break;
      case KVLITE_PIXELS_BGRA8: format = kvlite::PixelFormat::bgra8; break;
      case KVLITE_PIXELS_GRAY8: format = kvlite::PixelFormat::gray8; break;
      default:
        kvlite::detail::fail(kvlite::ErrorCode::invalid_argument,
                             kvlite::detail::format("pixel_format %d is none of KVLITE_PIXELS_*", int(pixel_format)));
    }
    kvlite::Result<kvlite::Image> image = kvlite::image_from_pixels(pixels, width, height, format, stride_bytes);
    if (!image) throw image.error();
    *image_out = new kvlite_image{std::move(*image)};
  });
}

int kvlite_image_size(const kvlite_image* image, int64_t* width_out, int64_t* height_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    need(image, "image");
    need(width_out, "width_out");
    need(height_out, "height_out");
    *width_out = image->image.width;
    *height_out = image->image.height;
  });
}

void kvlite_image_free(kvlite_image* image) { delete image; }

int kvlite_generate(kvlite_engine* engine, const char* prompt, const kvlite_image* const* images, size_t n_images,
                    const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                    kvlite_generation* out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(prompt, "prompt");
    need(out, "out");
    int64_t* request_out = nullptr;
    kvlite::Result<kvlite::Generation> generation =
        e.generate(prompt, images_of(images, n_images), sampling_params(sampling, &request_out),
                   token_callback(on_token, user_data));
    if (!generation) throw generation.error();
    if (request_out) *request_out = generation->request;
    fill(out, std::move(*generation));
  });
}

int kvlite_generate_chat(kvlite_engine* engine, const char* const* roles, const char* const* contents,
                         size_t n_messages, const kvlite_image* const* images, size_t n_images,
                         const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                         kvlite_generation* out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(out, "out");
    int64_t* request_out = nullptr;
    kvlite::Result<kvlite::Generation> generation =
        e.generate_chat(chat_messages(roles, contents, n_messages), images_of(images, n_images),
                        sampling_params(sampling, &request_out), token_callback(on_token, user_data));
    if (!generation) throw generation.error();
    if (request_out) *request_out = generation->request;
    fill(out, std::move(*generation));
  });
}

int kvlite_submit(kvlite_engine* engine, const int32_t* prompt_ids, size_t n_ids, const kvlite_image* const* images,
                  size_t n_images, const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                  int64_t* request_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need_array(prompt_ids, n_ids, "prompt_ids");
    need(request_out, "request_out");
    std::vector<kvlite::VisionInput> inputs;
    for (const kvlite::Image& image : images_of(images, n_images)) {
      kvlite::Result<kvlite::VisionInput> input = e.preprocess(image);
      if (!input) throw input.error();
      inputs.push_back(std::move(*input));
    }
    kvlite::Result<kvlite::RequestId> id = e.submit(std::vector<int32_t>(prompt_ids, prompt_ids + n_ids), inputs,
                                                    sampling_params(sampling), token_callback(on_token, user_data));
    if (!id) throw id.error();
    *request_out = *id;
  });
}

int kvlite_step(kvlite_engine* engine, int* unfinished_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    kvlite::Result<bool> more = e.step();
    if (!more) throw more.error();
    if (unfinished_out) *unfinished_out = *more ? 1 : 0;
  });
}

int kvlite_result(kvlite_engine* engine, int64_t request, kvlite_generation* out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(out, "out");
    kvlite::Result<kvlite::Generation> generation = e.result(request);
    if (!generation) throw generation.error();
    fill(out, std::move(*generation));
  });
}

int kvlite_cancel_request(kvlite_engine* engine, int64_t request) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Status status = engine_of(engine).cancel(request);
    if (!status) throw status.error();
  });
}

void kvlite_cancel(kvlite_engine* engine) {
  if (engine && engine->engine) engine->engine->cancel();
}

int kvlite_score(kvlite_engine* engine, const char* text, int64_t context_length, int64_t stride,
                 double* perplexity_out, int64_t* tokens_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need(text, "text");
    need(perplexity_out, "perplexity_out");
    kvlite::Result<kvlite::ScoreResult> result = e.score(std::string(text), context_length, stride);
    if (!result) throw result.error();
    *perplexity_out = result->perplexity;
    if (tokens_out) *tokens_out = result->tokens;
  });
}

int kvlite_logits(kvlite_engine* engine, const int32_t* ids, size_t n_ids, float** values_out, int64_t* rows_out,
                  int64_t* vocab_out) {
  using namespace kvlite::detail::c_api;
  return call([&] {
    kvlite::Engine& e = engine_of(engine);
    need_array(ids, n_ids, "ids");
    need(values_out, "values_out");
    need(rows_out, "rows_out");
    need(vocab_out, "vocab_out");
    kvlite::Result<kvlite::Logits> logits = e.logits(std::vector<int32_t>(ids, ids + n_ids));
    if (!logits) throw logits.error();
    *values_out = malloc_array(logits->values);
    *rows_out = logits->tokens;
    *vocab_out = logits->vocab;
  });
}

}  // extern "C"
