/* ---------------------------------------------------------------------------------------------------------
   The C API: kvlite for every language that can call C (C, C#, Python ctypes, Rust, Go, Swift). Included from
   a C compiler, kvlite.hpp declares only this; from C++ it declares this and the C++ API. The implementation
   is part of the one implementation translation unit (KVLITE_IMPLEMENTATION; in CMake the kvlite library, and
   libkvlite.so with -DKVLITE_BUILD_SHARED=ON).

   Rules that hold for every function:
   - Status: an int, KVLITE_OK (0) or one of the KVLITE_* codes below (the C++ ErrorCode values). No C++
     exception or type crosses this boundary.
   - Errors: kvlite_last_error() is the message of the last call that failed on the calling thread (thread-local;
     valid until that thread's next failing call). A successful call leaves it as it was.
   - Ownership: memory kvlite returns through an out-parameter (char*, int32_t*, float*) belongs to the caller,
     who frees it with kvlite_free(); structs it fills (kvlite_generation) are freed with their *_free
     function. Handles (kvlite_engine, kvlite_image) are freed with kvlite_close / kvlite_image_free. Pointers
     the caller passes in are only read during the call (never kept), except callbacks' user data, which
     is passed back to the callback during the call that received it.
   - Out-parameters are written only on success (on failure they are left as they were).
   - Threads: every function may be called from any thread; an engine's calls run one at a time (a second
     thread's call waits for the first, see the header's THREADS), except kvlite_cancel (lock-free,
     async-signal-safe: a SIGINT handler may call it) and kvlite_cancel_request (any thread). kvlite_close only
     with no call of that engine running. Callbacks run on the calling thread, inside the call; they must not
     call kvlite, except kvlite_cancel / kvlite_cancel_request.
   - ABI: the structs carry their own size (struct_size, set by the *_init functions): a later version may
     add fields at their end and still read what an older caller passes. Function signatures and the numbers
     of existing codes do not change within a major version (KVLITE_VERSION_MAJOR); see README "C API".
   --------------------------------------------------------------------------------------------------------- */
#ifndef KVLITE_C_API_H
#define KVLITE_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
/* libkvlite.so exports these functions and nothing else: the library is compiled with -fvisibility=hidden (CMake,
   when kvlite_library is static) and the declarations below are the exceptions, so the C++ API's symbols stay
   inside (tests/check_exports.sh counts them). */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

/* Status codes (the C++ ErrorCode values). */
#define KVLITE_OK 0
#define KVLITE_INVALID_ARGUMENT 1 /* a bad option or parameter, or a NULL where a value is needed */
#define KVLITE_IO_ERROR 2         /* a file could not be opened, read or mapped */
#define KVLITE_BAD_FORMAT 3       /* a file is malformed */
#define KVLITE_UNSUPPORTED 4      /* well-formed but not supported */
#define KVLITE_MISSING_TENSOR 5   /* a tensor the model needs is absent */
#define KVLITE_DOES_NOT_FIT 6     /* the plan does not fit the memory budget (the message has the advice) */
#define KVLITE_OUT_OF_MEMORY 7    /* an allocation failed */
#define KVLITE_DEVICE_ERROR 8     /* a CUDA call failed, or no GPU */
#define KVLITE_CANCELLED 9        /* kvlite_cancel, or a progress callback returned 0 */
#define KVLITE_INTERNAL 10        /* a bug in kvlite */

/* Backends (kvlite_options.backend). */
#define KVLITE_BACKEND_AUTO 0 /* the GPU when present and the model runs there, else the CPU */
#define KVLITE_BACKEND_CPU 1  /* the float32 reference */
#define KVLITE_BACKEND_CUDA 2

/* Why a generation ended (kvlite_generation.finish_reason: the C++ FinishReason values). */
#define KVLITE_FINISH_RUNNING 0
#define KVLITE_FINISH_STOP_TOKEN 1
#define KVLITE_FINISH_STOP_STRING 2
#define KVLITE_FINISH_MAX_TOKENS 3
#define KVLITE_FINISH_LENGTH 4
#define KVLITE_FINISH_CALLBACK 5
#define KVLITE_FINISH_CANCELLED 6
#define KVLITE_FINISH_GRAMMAR_END 7 /* the grammar or JSON schema allows nothing more */

/* Pixel layouts of kvlite_image_from_pixels. */
#define KVLITE_PIXELS_RGB8 0
#define KVLITE_PIXELS_BGR8 1
#define KVLITE_PIXELS_RGBA8 2
#define KVLITE_PIXELS_BGRA8 3
#define KVLITE_PIXELS_GRAY8 4

/* Log levels (kvlite_set_log). */
#define KVLITE_LOG_DEBUG 0
#define KVLITE_LOG_INFO 1
#define KVLITE_LOG_WARNING 2
#define KVLITE_LOG_ERROR 3

typedef struct kvlite_engine kvlite_engine; /* an open model: kvlite_open ... kvlite_close */
typedef struct kvlite_image kvlite_image;   /* a decoded RGB image: kvlite_image_* ... kvlite_image_free */

/* Log messages at or above the level set (kvlite_set_log, or an engine's kvlite_options.log_level);
   NUL-terminated; valid during the call. */
typedef void (*kvlite_log_fn)(int32_t level, const char* message, void* user_data);

/* The engine's options (EngineOptions). Zero / NULL fields take kvlite's defaults; call kvlite_options_init
   first. */
typedef struct kvlite_options {
  uint32_t struct_size;     /* sizeof(kvlite_options), set by kvlite_options_init */
  int32_t backend;          /* KVLITE_BACKEND_*; default AUTO */
  int32_t device;           /* CUDA device index; default 0 */
  uint64_t device_mem;      /* bytes the plan divides; 0: the device's */
  double utilization;       /* (0, 1]; 0: 0.90 */
  int64_t max_model_len;    /* 0: the default rule */
  int64_t max_seqs;         /* 0: 8 */
  int64_t max_batched_tokens; /* 0: min(2048, max_model_len) */
  const char* kv_dtype;     /* "auto", "f32", "bf16", "f16", "fp8"; NULL: auto */
  int64_t max_image_pixels; /* vision models; 0: kvlite's default */
  int64_t max_images;       /* vision models; 0: 1 */
  int32_t kv_fill;          /* nonzero: fill the budget with KV pages (vLLM's way) */
  int32_t threads;          /* CPU threads; 0: one per hardware thread */
  /* This engine's log: its messages start with "<name>: " and go to `log` (on the thread of the call) when set,
     else to kvlite_set_log's callback. */
  const char* name;         /* NULL or "": the model directory's last component */
  kvlite_log_fn log;        /* NULL: kvlite_set_log's */
  void* log_user_data;
  int32_t log_level;        /* KVLITE_LOG_*: messages below it are dropped; default INFO */
  /* nonzero: keep an untied token-embedding table in host memory instead of the device (--host-embeddings;
     CUDA saves the table's bytes, the CPU changes nothing; a tied table is refused) */
  int32_t host_embeddings;
} kvlite_options;
void kvlite_options_init(kvlite_options* options);

/* Sampling (SamplingParams). Call kvlite_sampling_init first: greedy, 256 tokens. */
typedef struct kvlite_sampling {
  uint32_t struct_size;
  float temperature;            /* 0: greedy */
  int64_t top_k;                /* 0: off */
  float top_p;                  /* 1: off */
  float min_p;                  /* 0: off */
  float repetition_penalty;     /* 1: off */
  uint64_t seed;
  int64_t max_tokens;
  const int32_t* stop_tokens;   /* n_stop_tokens ids, read during the call */
  size_t n_stop_tokens;
  const char* const* stop_strings; /* n_stop_strings UTF-8 strings, read during the call */
  size_t n_stop_strings;
  int32_t ignore_eos;
  /* NULL, or where kvlite_generate / kvlite_generate_chat store the id the request ran as (the ids kvlite_submit
     issues; the engine's debug log names requests by it) when they return KVLITE_OK. */
  int64_t* request_out;
  /* Constrained decoding (NULL or "": off; at most one of the two): every output is a sentence of this GBNF
     grammar (start rule root), or JSON valid against this JSON schema (its text). Read during the call. A bad
     one is refused with KVLITE_BAD_FORMAT or KVLITE_UNSUPPORTED and the reason in kvlite_last_error. */
  const char* grammar;
  const char* json_schema;
} kvlite_sampling;
void kvlite_sampling_init(kvlite_sampling* sampling);

/* A finished generation. Fill with kvlite_generate* / kvlite_result; free with kvlite_generation_free. */
typedef struct kvlite_generation {
  int32_t* ids;         /* n_ids generated ids (the stop token included when one ended it) */
  size_t n_ids;
  size_t n_prompt_ids;  /* the prompt's length in tokens (images expanded) */
  char* text;           /* the streamed text, NUL-terminated UTF-8 */
  int32_t finish_reason; /* KVLITE_FINISH_* */
} kvlite_generation;
void kvlite_generation_free(kvlite_generation* generation); /* frees its arrays and zeroes it; NULL is fine */

/* Called with each piece of text as it becomes final (NUL-terminated; may be "") and the id that completed it
   (-1 for held-back text flushed at the end). Return nonzero to go on, 0 to end this request
   (KVLITE_FINISH_CALLBACK). */
typedef int (*kvlite_token_fn)(const char* piece, int32_t id, void* user_data);
/* Load progress: bytes of weights ready so far and their total. Return nonzero to go on, 0 to abort the open
   (it fails with KVLITE_CANCELLED, everything released). */
typedef int (*kvlite_progress_fn)(uint64_t done_bytes, uint64_t total_bytes, void* user_data);

/* ---- strings, errors, memory ---- */
const char* kvlite_version(void);                 /* "0.1.0": static, never freed */
const char* kvlite_status_name(int status);       /* "invalid_argument": static */
const char* kvlite_finish_reason_name(int32_t reason); /* "stop_token": static */
const char* kvlite_last_error(void);              /* this thread's last failure ("" if none): owned by kvlite */
void kvlite_free(void* memory);                   /* frees what kvlite returned through an out-parameter */
/* Routes kvlite's diagnostics to `log` (process-wide); NULL stops them. */
void kvlite_set_log(kvlite_log_fn log, void* user_data, int32_t min_level);

/* ---- plan: where every byte goes, without reading weights or allocating device memory ---- */
/* *text_out: the plan as the table `kvlite plan` prints (json == 0) or its JSON (json != 0); caller frees.
   *fits_out (may be NULL): 1 when it fits. A plan that does not fit is KVLITE_OK with *fits_out = 0. */
int kvlite_plan(const char* model_dir, const kvlite_options* options, int json, char** text_out, int* fits_out);

/* ---- engines ---- */
/* Opens model_dir with options (NULL: defaults) and plans, reserves and loads as kvlite_plan showed. progress
   may be NULL. *engine_out: the caller's, closed with kvlite_close. */
int kvlite_open(const char* model_dir, const kvlite_options* options, kvlite_progress_fn progress, void* user_data,
                kvlite_engine** engine_out);
void kvlite_close(kvlite_engine* engine); /* NULL is fine */
/* The plan the engine opened with (table or JSON); caller frees. */
int kvlite_engine_plan(kvlite_engine* engine, int json, char** text_out);

/* ---- text ---- */
/* *ids_out: *n_out ids (caller frees; may be NULL when *n_out is 0). */
int kvlite_tokenize(kvlite_engine* engine, const char* text, int add_special_tokens, int32_t** ids_out,
                    size_t* n_out);
int kvlite_detokenize(kvlite_engine* engine, const int32_t* ids, size_t n_ids, int skip_special_tokens,
                      char** text_out);
/* n_messages messages (roles[i], contents[i]) in the model's chat format, with an open assistant turn when
   add_generation_prompt; caller frees *text_out. */
int kvlite_format_chat(kvlite_engine* engine, const char* const* roles, const char* const* contents,
                       size_t n_messages, int add_generation_prompt, char** text_out);
/* The model's own chat template over messages as JSON, the way transformers' apply_chat_template takes them: an
   array of {"role", "content", and "tool_calls" / "tool_call_id" / "name" / "reasoning_content" where they apply};
   extra_json (NULL: none) a JSON object of further template variables, e.g. {"tools": [...], "enable_thinking":
   false}. KVLITE_UNSUPPORTED when the model ships no template. The text holds the special tokens already: encode
   it with kvlite_tokenize(..., add_special_tokens = 0) and kvlite_submit it. Caller frees *text_out. */
int kvlite_apply_chat_template(kvlite_engine* engine, const char* messages_json, int add_generation_prompt,
                               const char* extra_json, char** text_out);

/* ---- images (vision models) ---- */
int kvlite_image_load(const char* path, kvlite_image** image_out);                     /* JPEG, PNG, ... */
int kvlite_image_decode(const uint8_t* data, size_t size, kvlite_image** image_out);  /* encoded bytes */
/* Raw pixels, e.g. a camera frame: height rows of stride_bytes (0: width x bytes per pixel). */
int kvlite_image_from_pixels(const uint8_t* pixels, int64_t width, int64_t height, int32_t pixel_format,
                             int64_t stride_bytes, kvlite_image** image_out);
int kvlite_image_size(const kvlite_image* image, int64_t* width_out, int64_t* height_out);
void kvlite_image_free(kvlite_image* image); /* NULL is fine */

/* ---- generation ---- */
/* One request to its end. The prompt is encoded with the tokenizer's special tokens; for a vision model it
   holds one <|vision_start|><|image_pad|><|vision_end|> per image, in order (n_images images; images may be
   NULL when n_images is 0). on_token may be NULL. *out is filled (caller frees with kvlite_generation_free). */
int kvlite_generate(kvlite_engine* engine, const char* prompt, const kvlite_image* const* images, size_t n_images,
                    const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                    kvlite_generation* out);
/* The same with messages formatted in the model's chat format (an image placeholder in a message's content
   places an image). */
int kvlite_generate_chat(kvlite_engine* engine, const char* const* roles, const char* const* contents,
                         size_t n_messages, const kvlite_image* const* images, size_t n_images,
                         const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                         kvlite_generation* out);

/* Continuous batching: submit requests, step until none is left, take each result once. */
int kvlite_submit(kvlite_engine* engine, const int32_t* prompt_ids, size_t n_ids, const kvlite_image* const* images,
                  size_t n_images, const kvlite_sampling* sampling, kvlite_token_fn on_token, void* user_data,
                  int64_t* request_out);
int kvlite_step(kvlite_engine* engine, int* unfinished_out); /* *unfinished_out: 1 while requests remain */
int kvlite_result(kvlite_engine* engine, int64_t request, kvlite_generation* out);
/* Any thread: end one request at the next step (KVLITE_FINISH_CANCELLED). */
int kvlite_cancel_request(kvlite_engine* engine, int64_t request);
/* Any thread, or a signal handler (lock-free, async-signal-safe): stop the call running now; does nothing when
   none runs. kvlite_generate / kvlite_generate_chat return KVLITE_OK with the text so far and
   KVLITE_FINISH_CANCELLED; the other calls return KVLITE_CANCELLED. */
void kvlite_cancel(kvlite_engine* engine);

/* ---- scoring and logits ---- */
/* Perplexity of text (encoded with special tokens) in windows of context_length tokens every stride tokens. */
int kvlite_score(kvlite_engine* engine, const char* text, int64_t context_length, int64_t stride,
                 double* perplexity_out, int64_t* tokens_out);
/* Logits of every position of one sequence: *values_out is [*rows_out, *vocab_out] float32, row t = the
   logits after ids[0..t]; caller frees. */
int kvlite_logits(kvlite_engine* engine, const int32_t* ids, size_t n_ids, float** values_out, int64_t* rows_out,
                  int64_t* vocab_out);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVLITE_C_API_H */
