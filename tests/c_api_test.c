/* c-api: every function of kvlite's C API, from a C11 program, on the tiny Qwen3 fixture and the bundled
   captioner, with every error path a C caller can reach: NULL arguments, bad options, unknown requests, bad
   images, a plan that does not fit, an aborted open. Exit status 0 when every check holds; each failed check
   prints its line. Compiled as C (-std=c11 -Wall -Wextra -Wpedantic -Werror): kvlite.hpp declares only the C API
   to a C compiler. */
#include "kvlite.hpp"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static int checks = 0;

#define CHECK(condition)                                                                  \
  do {                                                                                    \
    checks++;                                                                             \
    if (!(condition)) {                                                                   \
      failures++;                                                                         \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #condition, \
              kvlite_last_error());                                                       \
    }                                                                                     \
  } while (0)

/* A call that must fail with `status`, leaving a message that mentions `needle`. */
#define CHECK_FAILS(call, status, needle)                                                        \
  do {                                                                                          \
    int got_ = (call);                                                                          \
    CHECK(got_ == (status));                                                                    \
    CHECK(strstr(kvlite_last_error(), (needle)) != NULL);                                       \
  } while (0)

static const char* const kQwen = KVLITE_SOURCE_DIR "/tests/fixtures/models/tiny-qwen3";
static const char* const kCaptioner = KVLITE_SOURCE_DIR "/models/kvlite-captioner-bf16";
static const char* const kScene = KVLITE_SOURCE_DIR "/examples/images/scene_1.png";

struct Stream {
  char text[4096];
  size_t length;
  int calls;
  int stop_after; /* 0: never */
};

static int on_token(const char* piece, int32_t id, void* user_data) {
  struct Stream* stream = (struct Stream*)user_data;
  size_t n = strlen(piece);
  (void)id;
  if (stream->length + n < sizeof stream->text) {
    memcpy(stream->text + stream->length, piece, n + 1);
    stream->length += n;
  }
  stream->calls++;
  return stream->stop_after == 0 || stream->calls < stream->stop_after;
}

/* kvlite_cancel from inside the callback (as a signal handler or another thread would): the generation stops
   and keeps its text so far. */
struct Cancelling {
  kvlite_engine* engine;
  int calls;
};

static int cancel_at_third(const char* piece, int32_t id, void* user_data) {
  struct Cancelling* c = (struct Cancelling*)user_data;
  (void)piece, (void)id;
  if (++c->calls == 3) kvlite_cancel(c->engine);
  return 1;
}

struct Progress {
  int calls;
  uint64_t last_done, total;
  int abort_at; /* -1: never */
};

static int on_progress(uint64_t done, uint64_t total, void* user_data) {
  struct Progress* progress = (struct Progress*)user_data;
  progress->last_done = done;
  progress->total = total;
  return progress->calls++ != progress->abort_at;
}

struct Log {
  int messages;
  int saw_open;
  int saw_named_open; /* "camera-left: opened ..." */
  int below_level;    /* messages under the engine's log_level */
  int32_t min_level;
};

static void on_log(int32_t level, const char* message, void* user_data) {
  struct Log* log = (struct Log*)user_data;
  log->messages++;
  if (level < log->min_level) log->below_level++;
  if (level == KVLITE_LOG_INFO && strstr(message, ": opened ") != NULL) log->saw_open = 1; /* "<engine>: opened" */
  if (strncmp(message, "camera-left: opened ", 20) == 0) log->saw_named_open = 1;
}

static int read_file(const char* path, uint8_t** data, size_t* size) {
  FILE* file = fopen(path, "rb");
  long length;
  if (!file) return 0;
  fseek(file, 0, SEEK_END);
  length = ftell(file);
  fseek(file, 0, SEEK_SET);
  *data = (uint8_t*)malloc((size_t)length);
  *size = fread(*data, 1, (size_t)length, file);
  fclose(file);
  return *size == (size_t)length;
}

static void strings_and_errors(void) {
  CHECK(strcmp(kvlite_version(), KVLITE_C_TEST_VERSION) == 0);
  CHECK(strcmp(kvlite_status_name(KVLITE_OK), "ok") == 0);
  CHECK(strcmp(kvlite_status_name(KVLITE_DOES_NOT_FIT), "does_not_fit") == 0);
  CHECK(strcmp(kvlite_status_name(KVLITE_CANCELLED), "cancelled") == 0);
  CHECK(strcmp(kvlite_status_name(99), "unknown") == 0);
  CHECK(strcmp(kvlite_finish_reason_name(KVLITE_FINISH_MAX_TOKENS), "max_tokens") == 0);
  CHECK(strcmp(kvlite_finish_reason_name(KVLITE_FINISH_CANCELLED), "cancelled") == 0);
  CHECK(strcmp(kvlite_finish_reason_name(-1), "unknown") == 0);
  kvlite_free(NULL);
  kvlite_close(NULL);
  kvlite_image_free(NULL);
  kvlite_generation_free(NULL);
  kvlite_options_init(NULL);
  kvlite_sampling_init(NULL);
}

static void plans(void) {
  kvlite_options options;
  char* text = NULL;
  int fits = -1;
  kvlite_options_init(&options);
  CHECK(options.struct_size == sizeof options);
  options.backend = KVLITE_BACKEND_CPU;
  options.device_mem = 64u << 20;
  CHECK(kvlite_plan(kQwen, &options, 0, &text, &fits) == KVLITE_OK);
  CHECK(text != NULL && strstr(text, "KV arena") != NULL);
  CHECK(fits == 1);
  kvlite_free(text);
  CHECK(kvlite_plan(kQwen, NULL, 1, &text, NULL) == KVLITE_OK);
  CHECK(text != NULL && text[0] == '{' && strstr(text, "\"fits\": true") != NULL);
  kvlite_free(text);

  /* A planned 8 GiB CUDA card that cannot hold the request: KVLITE_OK, fits 0, the advice in the table. */
  options.backend = KVLITE_BACKEND_CUDA;
  options.device_mem = (uint64_t)8 << 30;
  options.max_model_len = 131072;
  CHECK(kvlite_plan(KVLITE_SOURCE_DIR "/models/llama-3.1-8b-instruct-w4a16", &options, 0, &text, &fits) == KVLITE_OK);
  CHECK(fits == 0);
  CHECK(text != NULL && strstr(text, "DOES NOT FIT") != NULL && strstr(text, "--max-model-len") != NULL);
  CHECK(strstr(text, "With --host-embeddings") != NULL); /* its untied table: the advice names the flag */
  kvlite_free(text);
  /* host_embeddings (0 after init): the untied table stays in host memory, and the weights row says so */
  CHECK(options.host_embeddings == 0);
  options.host_embeddings = 1;
  CHECK(kvlite_plan(KVLITE_SOURCE_DIR "/models/llama-3.1-8b-instruct-w4a16", &options, 0, &text, &fits) == KVLITE_OK);
  CHECK(text != NULL && strstr(text, "stays in host memory (--host-embeddings)") != NULL);
  CHECK(strstr(text, "With --host-embeddings") == NULL);
  kvlite_free(text);
  /* refused for a tied table (tiny-qwen3 ties lm_head to embed_tokens) */
  text = NULL;
  options.max_model_len = 0;
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "tie_word_embeddings");
  options.host_embeddings = 0;

  /* Errors: each names what is wrong. */
  text = NULL;
  CHECK_FAILS(kvlite_plan(NULL, NULL, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "model_dir");
  CHECK_FAILS(kvlite_plan(kQwen, NULL, 0, NULL, NULL), KVLITE_INVALID_ARGUMENT, "text_out");
  CHECK_FAILS(kvlite_plan("/nonexistent/kvlite", NULL, 0, &text, NULL), KVLITE_IO_ERROR, "/nonexistent/kvlite");
  CHECK(text == NULL); /* out-parameters are written only on success */
  kvlite_options_init(&options);
  options.backend = 7;
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "backend 7");
  kvlite_options_init(&options);
  options.kv_dtype = "int3";
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "int3");
  kvlite_options_init(&options);
  options.utilization = 1.5;
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "1.5");
  kvlite_options_init(&options);
  options.threads = -2;
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "threads");
  kvlite_options_init(&options);
  options.struct_size = 8; /* not from kvlite_options_init */
  CHECK_FAILS(kvlite_plan(kQwen, &options, 0, &text, NULL), KVLITE_INVALID_ARGUMENT, "kvlite_options_init");
  /* A 0.1.0 caller's struct (without name, log, log_user_data, log_level) plans with their defaults; the bytes
     past its end are never read. */
  kvlite_options_init(&options);
  options.device_mem = 64u << 20;
  options.struct_size = (uint32_t)offsetof(kvlite_options, name);
  options.log_level = 99;
  CHECK(kvlite_plan(kQwen, &options, 0, &text, NULL) == KVLITE_OK);
  kvlite_free(text);
  text = NULL;
}

static kvlite_engine* open_qwen(void) {
  kvlite_options options;
  kvlite_engine* engine = NULL;
  kvlite_options_init(&options);
  options.backend = KVLITE_BACKEND_CPU;
  options.device_mem = 64u << 20;
  options.threads = 1;
  CHECK(kvlite_open(kQwen, &options, NULL, NULL, &engine) == KVLITE_OK);
  return engine;
}

static void opening(void) {
  kvlite_options options;
  kvlite_engine* engine = NULL;
  struct Progress progress = {0, 0, 0, -1};
  struct Log log = {0, 0, 0, 0, KVLITE_LOG_DEBUG};
  struct Log own = {0, 0, 0, 0, KVLITE_LOG_INFO};
  char* text = NULL;
  kvlite_options_init(&options);
  options.backend = KVLITE_BACKEND_CPU;
  options.device_mem = 64u << 20;
  kvlite_set_log(on_log, &log, KVLITE_LOG_INFO);
  CHECK(kvlite_open(kQwen, &options, on_progress, &progress, &engine) == KVLITE_OK);
  kvlite_set_log(NULL, NULL, KVLITE_LOG_INFO);
  CHECK(engine != NULL);
  CHECK(progress.calls >= 2);
  CHECK(progress.total > 0 && progress.last_done == progress.total);
  CHECK(log.saw_open);
  CHECK(kvlite_engine_plan(engine, 0, &text) == KVLITE_OK);
  CHECK(text != NULL && strstr(text, "backend cpu") != NULL);
  kvlite_free(text);
  CHECK(kvlite_engine_plan(engine, 1, &text) == KVLITE_OK);
  CHECK(text != NULL && text[0] == '{');
  kvlite_free(text);
  kvlite_close(engine);

  /* A log per engine: its name starts each message, its callback gets them (not the process-wide one), and
     nothing below its level; a level out of range is refused. */
  log.messages = 0;
  kvlite_set_log(on_log, &log, KVLITE_LOG_DEBUG);
  options.name = "camera-left";
  options.log = on_log;
  options.log_user_data = &own;
  options.log_level = KVLITE_LOG_INFO;
  CHECK(kvlite_open(kQwen, &options, NULL, NULL, &engine) == KVLITE_OK);
  CHECK(own.saw_named_open && own.below_level == 0);
  CHECK(log.messages == 0);
  kvlite_close(engine);
  engine = NULL;
  options.log_level = 7;
  CHECK_FAILS(kvlite_open(kQwen, &options, NULL, NULL, &engine), KVLITE_INVALID_ARGUMENT, "log_level");
  CHECK(engine == NULL);
  kvlite_set_log(NULL, NULL, KVLITE_LOG_INFO);
  options.name = NULL;
  options.log = NULL;
  options.log_user_data = NULL;
  options.log_level = KVLITE_LOG_INFO;

  /* The progress callback aborts: cancelled, nothing returned. */
  engine = NULL;
  progress.calls = 0;
  progress.abort_at = 0;
  CHECK_FAILS(kvlite_open(kQwen, &options, on_progress, &progress, &engine), KVLITE_CANCELLED, "load-progress");
  CHECK(engine == NULL);
  /* Too little memory: does_not_fit with the advice; a directory without weights: missing_tensor. */
  options.device_mem = 1u << 20;
  CHECK_FAILS(kvlite_open(kQwen, &options, NULL, NULL, &engine), KVLITE_DOES_NOT_FIT, "does not fit");
  kvlite_options_init(&options);
  options.backend = KVLITE_BACKEND_CPU;
  CHECK_FAILS(kvlite_open(KVLITE_SOURCE_DIR "/models/qwen3-4b", &options, NULL, NULL, &engine), KVLITE_MISSING_TENSOR,
              "safetensors");
  CHECK_FAILS(kvlite_open(kQwen, &options, NULL, NULL, NULL), KVLITE_INVALID_ARGUMENT, "engine_out");
  CHECK_FAILS(kvlite_engine_plan(NULL, 0, &text), KVLITE_INVALID_ARGUMENT, "engine");
}

static void text(kvlite_engine* engine) {
  int32_t* ids = NULL;
  size_t n = 0;
  char* decoded = NULL;
  char* prompt = NULL;
  const char* roles[2] = {"system", "user"};
  const char* contents[2] = {"You are terse.", "Hello"};
  CHECK(kvlite_tokenize(engine, "Hello world", 1, &ids, &n) == KVLITE_OK);
  CHECK(n > 0 && ids != NULL);
  CHECK(kvlite_detokenize(engine, ids, n, 0, &decoded) == KVLITE_OK);
  CHECK(decoded != NULL && strstr(decoded, "Hello world") != NULL);
  kvlite_free(decoded);
  kvlite_free(ids);
  CHECK(kvlite_tokenize(engine, "", 0, &ids, &n) == KVLITE_OK);
  CHECK(n == 0);
  kvlite_free(ids);
  CHECK(kvlite_format_chat(engine, roles, contents, 2, 1, &prompt) == KVLITE_OK);
  CHECK(prompt != NULL && strstr(prompt, "<|im_start|>system\nYou are terse.<|im_end|>") != NULL);
  CHECK(strstr(prompt, "<|im_start|>assistant\n") != NULL);
  {
    /* The same messages as JSON through the template give the same prompt; a tool transcript and the template's
       variables reach it too. */
    char* structured = NULL;
    CHECK(kvlite_apply_chat_template(engine,
                                     "[{\"role\": \"system\", \"content\": \"You are terse.\"},"
                                     " {\"role\": \"user\", \"content\": \"Hello\"}]",
                                     1, NULL, &structured) == KVLITE_OK);
    CHECK(structured != NULL && strcmp(structured, prompt) == 0);
    kvlite_free(structured);
    structured = NULL;
    CHECK(kvlite_apply_chat_template(
              engine,
              "[{\"role\": \"user\", \"content\": \"Weather in Paris?\"},"
              " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\", \"function\":"
              " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}]},"
              " {\"role\": \"tool\", \"tool_call_id\": \"1\", \"content\": \"22 C\"}]",
              1, "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}]}",
              &structured) == KVLITE_OK);
    /* tiny-qwen3 ships Qwen2.5's template: the tools in its system turn, the call and its result in Qwen's form */
    CHECK(structured != NULL && strstr(structured, "# Tools") != NULL);
    CHECK(strstr(structured, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                             "</tool_call>") != NULL);
    CHECK(strstr(structured, "<tool_response>\n22 C\n</tool_response>") != NULL);
    kvlite_free(structured);
    structured = NULL;
    CHECK_FAILS(kvlite_apply_chat_template(engine, "{\"role\": \"user\"}", 1, NULL, &structured),
                KVLITE_INVALID_ARGUMENT, "array");
    CHECK_FAILS(kvlite_apply_chat_template(engine, "[", 1, NULL, &structured), KVLITE_INVALID_ARGUMENT, "JSON");
    CHECK_FAILS(kvlite_apply_chat_template(engine, NULL, 1, NULL, &structured), KVLITE_INVALID_ARGUMENT,
                "messages_json");
    CHECK(structured == NULL);
  }
  kvlite_free(prompt);

  CHECK_FAILS(kvlite_tokenize(engine, NULL, 1, &ids, &n), KVLITE_INVALID_ARGUMENT, "text");
  CHECK_FAILS(kvlite_tokenize(NULL, "x", 1, &ids, &n), KVLITE_INVALID_ARGUMENT, "engine");
  CHECK_FAILS(kvlite_detokenize(engine, NULL, 3, 0, &decoded), KVLITE_INVALID_ARGUMENT, "ids");
  {
    int32_t bad = 1 << 30;
    CHECK_FAILS(kvlite_detokenize(engine, &bad, 1, 0, &decoded), KVLITE_INVALID_ARGUMENT, "1073741824");
  }
  CHECK_FAILS(kvlite_format_chat(engine, roles, NULL, 2, 1, &prompt), KVLITE_INVALID_ARGUMENT, "contents");
  {
    const char* invalid_utf8[1] = {"\xff\xfe"};
    CHECK_FAILS(kvlite_format_chat(engine, roles, invalid_utf8, 1, 1, &prompt), KVLITE_INVALID_ARGUMENT, "UTF-8");
  }
}

static void generation(kvlite_engine* engine) {
  kvlite_sampling sampling;
  kvlite_generation out, again, chat;
  struct Stream stream;
  const char* roles[1] = {"user"};
  const char* contents[1] = {"Hello"};
  const char* stops[1] = {"zzzz-never"};
  kvlite_sampling_init(&sampling);
  sampling.max_tokens = 8;
  sampling.stop_strings = stops;
  sampling.n_stop_strings = 1;
  memset(&stream, 0, sizeof stream);
  CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, on_token, &stream, &out) == KVLITE_OK);
  CHECK(out.n_ids == 8);
  CHECK(out.finish_reason == KVLITE_FINISH_MAX_TOKENS);
  CHECK(out.n_prompt_ids > 0);
  CHECK(strcmp(out.text, stream.text) == 0); /* what streamed is the text */
  /* Greedy is deterministic; the same prompt again gives the same ids (no callback this time). */
  CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, NULL, NULL, &again) == KVLITE_OK);
  CHECK(again.n_ids == out.n_ids && memcmp(again.ids, out.ids, out.n_ids * sizeof(int32_t)) == 0);
  kvlite_generation_free(&again);
  /* Each generation reports the request it ran as: ids are issued in order, one per request. */
  {
    int64_t first = 0, second = 0;
    sampling.request_out = &first;
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, NULL, NULL, &again) == KVLITE_OK);
    kvlite_generation_free(&again);
    sampling.request_out = &second;
    CHECK(kvlite_generate_chat(engine, roles, contents, 1, NULL, 0, &sampling, NULL, NULL, &again) == KVLITE_OK);
    kvlite_generation_free(&again);
    sampling.request_out = NULL;
    CHECK(first > 0 && second == first + 1);
  }
  /* A caller built against 0.1.0 (a struct without the fields appended since) is read with their defaults. */
  {
    kvlite_sampling older = sampling;
    older.struct_size = (uint32_t)offsetof(kvlite_sampling, request_out);
    older.request_out = (int64_t*)1; /* past the older struct's end: never read */
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &older, NULL, NULL, &again) == KVLITE_OK);
    CHECK(again.n_ids == out.n_ids);
    kvlite_generation_free(&again);
  }
  /* Constrained decoding: the grammar's sentence whatever the model prefers, JSON of the schema; a schema
     kvlite cannot honour is refused by keyword. */
  {
    kvlite_sampling constrained = sampling;
    long number = 0;
    constrained.stop_strings = NULL;
    constrained.n_stop_strings = 0;
    constrained.max_tokens = 16;
    constrained.grammar = "root ::= (\"yes\" | \"no\") \".\"";
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &constrained, NULL, NULL, &again) == KVLITE_OK);
    CHECK(again.finish_reason == KVLITE_FINISH_GRAMMAR_END);
    CHECK(strcmp(again.text, "yes.") == 0 || strcmp(again.text, "no.") == 0);
    CHECK(strcmp(kvlite_finish_reason_name(again.finish_reason), "grammar_end") == 0);
    kvlite_generation_free(&again);
    constrained.grammar = NULL;
    constrained.json_schema = "{\"type\": \"integer\", \"minimum\": 1, \"maximum\": 6}";
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &constrained, NULL, NULL, &again) == KVLITE_OK);
    number = strtol(again.text, NULL, 10);
    CHECK(number >= 1 && number <= 6 && strlen(again.text) == 1);
    kvlite_generation_free(&again);
    constrained.json_schema = "{\"type\": \"string\", \"format\": \"ipv6\"}";
    CHECK_FAILS(kvlite_generate(engine, "The harbour", NULL, 0, &constrained, NULL, NULL, &again), KVLITE_UNSUPPORTED,
                "ipv6");
    constrained.json_schema = NULL;
    constrained.grammar = "root ::= nowhere";
    CHECK_FAILS(kvlite_generate(engine, "The harbour", NULL, 0, &constrained, NULL, NULL, &again), KVLITE_BAD_FORMAT,
                "nowhere");
  }
  kvlite_generation_free(&again);
  CHECK(again.ids == NULL && again.text == NULL);
  /* The callback ends its request. */
  memset(&stream, 0, sizeof stream);
  stream.stop_after = 2;
  CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, on_token, &stream, &again) == KVLITE_OK);
  CHECK(again.finish_reason == KVLITE_FINISH_CALLBACK);
  kvlite_generation_free(&again);
  /* A global cancel mid-generation: KVLITE_OK, the ids so far, KVLITE_FINISH_CANCELLED. */
  {
    struct Cancelling cancelling;
    cancelling.engine = engine;
    cancelling.calls = 0;
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, cancel_at_third, &cancelling, &again) == KVLITE_OK);
    CHECK(again.finish_reason == KVLITE_FINISH_CANCELLED);
    CHECK(again.n_ids == 3 && memcmp(again.ids, out.ids, 3 * sizeof(int32_t)) == 0);
    kvlite_generation_free(&again);
  }
  CHECK(kvlite_generate_chat(engine, roles, contents, 1, NULL, 0, &sampling, NULL, NULL, &chat) == KVLITE_OK);
  CHECK(chat.n_ids >= 1);
  kvlite_generation_free(&chat);

  /* Continuous batching: two requests, one cancelled from the caller; results taken once. */
  {
    int64_t keep = 0, drop = 0;
    int unfinished = 1, steps = 0;
    CHECK(kvlite_submit(engine, out.ids, 4, NULL, 0, &sampling, NULL, NULL, &keep) == KVLITE_OK);
    CHECK(kvlite_submit(engine, out.ids, 3, NULL, 0, &sampling, NULL, NULL, &drop) == KVLITE_OK);
    CHECK(keep > 0 && drop > keep);
    CHECK(kvlite_step(engine, &unfinished) == KVLITE_OK);
    CHECK(kvlite_cancel_request(engine, drop) == KVLITE_OK);
    while (unfinished && steps++ < 100) CHECK(kvlite_step(engine, &unfinished) == KVLITE_OK);
    CHECK(unfinished == 0);
    CHECK(kvlite_result(engine, drop, &again) == KVLITE_OK);
    CHECK(again.finish_reason == KVLITE_FINISH_CANCELLED);
    kvlite_generation_free(&again);
    CHECK(kvlite_result(engine, keep, &again) == KVLITE_OK);
    CHECK(again.finish_reason == KVLITE_FINISH_MAX_TOKENS && again.n_ids == 8);
    kvlite_generation_free(&again);
    CHECK_FAILS(kvlite_result(engine, keep, &again), KVLITE_INVALID_ARGUMENT, "already taken");
    CHECK_FAILS(kvlite_cancel_request(engine, 999999), KVLITE_INVALID_ARGUMENT, "999999");
    kvlite_cancel(engine); /* idle: does nothing to the next call */
    CHECK(kvlite_generate(engine, "The harbour", NULL, 0, &sampling, NULL, NULL, &again) == KVLITE_OK);
    kvlite_generation_free(&again);
  }
  kvlite_generation_free(&out);

  /* Errors. */
  CHECK_FAILS(kvlite_generate(engine, NULL, NULL, 0, &sampling, NULL, NULL, &out), KVLITE_INVALID_ARGUMENT, "prompt");
  CHECK_FAILS(kvlite_generate(engine, "x", NULL, 0, &sampling, NULL, NULL, NULL), KVLITE_INVALID_ARGUMENT, "out");
  CHECK_FAILS(kvlite_generate(engine, "x", NULL, 2, &sampling, NULL, NULL, &out), KVLITE_INVALID_ARGUMENT, "images");
  sampling.temperature = -1.0f;
  CHECK_FAILS(kvlite_generate(engine, "x", NULL, 0, &sampling, NULL, NULL, &out), KVLITE_INVALID_ARGUMENT,
              "temperature");
  kvlite_sampling_init(&sampling);
  sampling.n_stop_tokens = 3; /* without the array */
  CHECK_FAILS(kvlite_generate(engine, "x", NULL, 0, &sampling, NULL, NULL, &out), KVLITE_INVALID_ARGUMENT,
              "stop_tokens");
  kvlite_sampling_init(&sampling);
  sampling.struct_size = 4;
  CHECK_FAILS(kvlite_generate(engine, "x", NULL, 0, &sampling, NULL, NULL, &out), KVLITE_INVALID_ARGUMENT,
              "kvlite_sampling_init");
  {
    int32_t bad = -5;
    int64_t request = 0;
    CHECK_FAILS(kvlite_submit(engine, &bad, 1, NULL, 0, NULL, NULL, NULL, &request), KVLITE_INVALID_ARGUMENT, "-5");
    CHECK_FAILS(kvlite_submit(engine, NULL, 0, NULL, 0, NULL, NULL, NULL, &request), KVLITE_INVALID_ARGUMENT, "");
  }
  CHECK_FAILS(kvlite_step(NULL, NULL), KVLITE_INVALID_ARGUMENT, "engine");
  /* A text model refuses images. */
  {
    kvlite_image* image = NULL;
    const kvlite_image* images[1];
    CHECK(kvlite_image_load(kScene, &image) == KVLITE_OK);
    images[0] = image;
    kvlite_sampling_init(&sampling);
    CHECK_FAILS(kvlite_generate(engine, "x", images, 1, &sampling, NULL, NULL, &out), KVLITE_UNSUPPORTED, "vision");
    kvlite_image_free(image);
  }
}

static void scoring(kvlite_engine* engine) {
  double perplexity = 0;
  int64_t tokens = 0, rows = 0, vocab = 0;
  float* values = NULL;
  int32_t ids[4] = {39, 265, 314, 411};
  CHECK(kvlite_score(engine, "The harbour was quiet before the boats came in.", 8, 4, &perplexity, &tokens) ==
        KVLITE_OK);
  CHECK(perplexity > 1.0 && tokens > 0);
  CHECK(kvlite_logits(engine, ids, 4, &values, &rows, &vocab) == KVLITE_OK);
  CHECK(rows == 4 && vocab > 0 && values != NULL);
  kvlite_free(values);
  CHECK_FAILS(kvlite_score(engine, "abc", 0, 1, &perplexity, &tokens), KVLITE_INVALID_ARGUMENT, "context");
  CHECK_FAILS(kvlite_score(engine, NULL, 8, 4, &perplexity, &tokens), KVLITE_INVALID_ARGUMENT, "text");
  CHECK_FAILS(kvlite_logits(engine, ids, 4, NULL, &rows, &vocab), KVLITE_INVALID_ARGUMENT, "values_out");
  CHECK_FAILS(kvlite_logits(engine, NULL, 4, &values, &rows, &vocab), KVLITE_INVALID_ARGUMENT, "ids");
}

static void images_and_captions(void) {
  kvlite_image *from_file = NULL, *from_bytes = NULL, *from_pixels = NULL;
  const kvlite_image* images[1];
  uint8_t* bytes = NULL;
  size_t size = 0;
  int64_t width = 0, height = 0;
  kvlite_options options;
  kvlite_engine* engine = NULL;
  kvlite_sampling sampling;
  kvlite_generation file_caption, pixel_caption, chat_caption;
  const char* roles[1] = {"user"};
  const char* contents[1] = {"<|vision_start|><|image_pad|><|vision_end|>Describe this image."};
  uint8_t* rgb;
  int64_t i;

  CHECK(kvlite_image_load(kScene, &from_file) == KVLITE_OK);
  CHECK(kvlite_image_size(from_file, &width, &height) == KVLITE_OK);
  CHECK(width == 128 && height == 128);
  CHECK(read_file(kScene, &bytes, &size));
  CHECK(kvlite_image_decode(bytes, size, &from_bytes) == KVLITE_OK);
  CHECK_FAILS(kvlite_image_decode(bytes, 10, &from_pixels), KVLITE_BAD_FORMAT, "");
  free(bytes);
  /* A camera frame as raw RGB: the file's pixels, through kvlite_image_from_pixels. */
  rgb = (uint8_t*)malloc((size_t)(width * height * 3));
  for (i = 0; i < width * height * 3; i++) rgb[i] = 0;
  CHECK_FAILS(kvlite_image_from_pixels(rgb, 0, 5, KVLITE_PIXELS_RGB8, 0, &from_pixels), KVLITE_INVALID_ARGUMENT, "");
  CHECK_FAILS(kvlite_image_from_pixels(rgb, 4, 4, 42, 0, &from_pixels), KVLITE_INVALID_ARGUMENT, "pixel_format 42");
  CHECK_FAILS(kvlite_image_from_pixels(NULL, 4, 4, KVLITE_PIXELS_RGB8, 0, &from_pixels), KVLITE_INVALID_ARGUMENT,
              "pixels");
  CHECK_FAILS(kvlite_image_load("/nonexistent/scene.png", &from_pixels), KVLITE_IO_ERROR, "/nonexistent/scene.png");
  CHECK_FAILS(kvlite_image_size(NULL, &width, &height), KVLITE_INVALID_ARGUMENT, "image");

  kvlite_options_init(&options);
  options.backend = KVLITE_BACKEND_CPU;
  options.device_mem = 256u << 20;
  CHECK(kvlite_open(kCaptioner, &options, NULL, NULL, &engine) == KVLITE_OK);
  kvlite_sampling_init(&sampling);
  sampling.max_tokens = 40;
  images[0] = from_file;
  CHECK(kvlite_generate_chat(engine, roles, contents, 1, images, 1, &sampling, NULL, NULL, &file_caption) ==
        KVLITE_OK);
  CHECK(strcmp(file_caption.text, "a small blue circle above a large red square") == 0);
  images[0] = from_bytes;
  CHECK(kvlite_generate_chat(engine, roles, contents, 1, images, 1, &sampling, NULL, NULL, &chat_caption) ==
        KVLITE_OK);
  CHECK(strcmp(chat_caption.text, file_caption.text) == 0);
  kvlite_generation_free(&chat_caption);
  /* An all-black frame from memory is captioned too (whatever the caption): the path works end to end. */
  CHECK(kvlite_image_from_pixels(rgb, width, height, KVLITE_PIXELS_RGB8, 0, &from_pixels) == KVLITE_OK);
  images[0] = from_pixels;
  CHECK(kvlite_generate_chat(engine, roles, contents, 1, images, 1, &sampling, NULL, NULL, &pixel_caption) ==
        KVLITE_OK);
  CHECK(pixel_caption.n_ids >= 1);
  kvlite_generation_free(&pixel_caption);
  /* Placeholders and images must agree in number. */
  CHECK_FAILS(kvlite_generate_chat(engine, roles, contents, 1, NULL, 0, &sampling, NULL, NULL, &pixel_caption),
              KVLITE_INVALID_ARGUMENT, "image");
  /* submit with an image: the prompt's ids from the chat format, the image preprocessed by the engine. */
  {
    char* prompt = NULL;
    int32_t* ids = NULL;
    size_t n = 0;
    int64_t request = 0;
    int unfinished = 1, steps = 0;
    kvlite_generation result;
    images[0] = from_file;
    CHECK(kvlite_format_chat(engine, roles, contents, 1, 1, &prompt) == KVLITE_OK);
    CHECK(kvlite_tokenize(engine, prompt, 0, &ids, &n) == KVLITE_OK);
    CHECK(kvlite_submit(engine, ids, n, images, 1, &sampling, NULL, NULL, &request) == KVLITE_OK);
    while (unfinished && steps++ < 200) CHECK(kvlite_step(engine, &unfinished) == KVLITE_OK);
    CHECK(kvlite_result(engine, request, &result) == KVLITE_OK);
    CHECK(strcmp(result.text, file_caption.text) == 0);
    kvlite_generation_free(&result);
    kvlite_free(ids);
    kvlite_free(prompt);
  }
  kvlite_generation_free(&file_caption);
  kvlite_close(engine);
  kvlite_image_free(from_pixels);
  kvlite_image_free(from_bytes);
  kvlite_image_free(from_file);
  free(rgb);
}

int main(void) {
  kvlite_engine* engine;
  strings_and_errors();
  plans();
  opening();
  engine = open_qwen();
  if (engine) {
    text(engine);
    generation(engine);
    scoring(engine);
    kvlite_close(engine);
  }
  images_and_captions();
  printf("c-api: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
