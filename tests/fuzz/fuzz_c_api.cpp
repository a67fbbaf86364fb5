// libFuzzer harness: the C API as a careless or hostile caller uses it. The input is a program: each byte picks a
// call, later bytes its arguments: NULL pointers, struct_size values of no version, extreme and non-finite
// numbers, ids outside the vocabulary, requests taken twice or never, generation structs freed twice (defined as
// safe), and token callbacks that stop their request, cancel the engine's call or cancel another request from
// inside. Every call must return KVLITE_OK or a code with a message, never KVLITE_INTERNAL, never crash or leak.
// The engine is the tiny Llama-3 fixture, opened once; kvlite_open / kvlite_plan also run on fuzzed options.
#include <cmath>
#include <cstring>
#include <vector>

#include "fuzz_support.hpp"

namespace {

const std::string& model_dir() {
  static const std::string dir = fuzz::source_dir() + "/tests/fixtures/models/tiny-llama3";
  return dir;
}

kvlite_engine* shared_engine() {
  static kvlite_engine* engine = [] {
    kvlite_options options;
    kvlite_options_init(&options);
    options.backend = KVLITE_BACKEND_CPU;
    options.device_mem = 64ull << 20;
    options.max_model_len = 48;  // short generations and scoring windows: more calls per second
    options.threads = 1;
    kvlite_engine* e = nullptr;
    if (kvlite_open(model_dir().c_str(), &options, nullptr, nullptr, &e) != KVLITE_OK) {
      fprintf(stderr, "the fixture model does not open: %s\n", kvlite_last_error());
      abort();
    }
    return e;
  }();
  return engine;
}

void check(int status, const char* call) {
  if (status == KVLITE_OK) return;
  if (status < 0 || status >= KVLITE_INTERNAL) {
    fprintf(stderr, "%s: status %d (%s): %s\n", call, status, kvlite_status_name(status), kvlite_last_error());
    abort();
  }
  if (kvlite_last_error()[0] == '\0') {
    fprintf(stderr, "%s failed with %s and no message\n", call, kvlite_status_name(status));
    abort();
  }
}

// Extreme values first, then whatever the bytes say.
int64_t extreme_i64(fuzz::Bytes& in) {
  static const int64_t kValues[] = {0, 1, -1, 2, 7, 64, 65, 4096, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN,
                                    INT64_MAX - 27, int64_t(1) << 32, int64_t(1) << 40, 16777216, 16777217};
  const uint8_t pick = in.byte();
  if (pick < 2 * (sizeof kValues / sizeof kValues[0])) return kValues[pick / 2];
  return in.i64();
}
double extreme_double(fuzz::Bytes& in) {
  static const double kValues[] = {0.0, -0.0, 1.0, 0.5, -1.0, 1e-300, 1e308, HUGE_VAL, -HUGE_VAL, NAN, 2.0, 1e-6};
  const uint8_t pick = in.byte();
  if (pick < 2 * (sizeof kValues / sizeof kValues[0])) return kValues[pick / 2];
  const int64_t bits = in.i64();
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
uint32_t struct_size(fuzz::Bytes& in, uint32_t real) {
  switch (in.byte() % 6) {
    case 0: return 0;
    case 1: return real - 1;
    case 2: return real + 8;
    case 3: return in.u32();
    default: return real;
  }
}

// What a token callback does, from the input.
struct CallbackPlan {
  kvlite_engine* engine = nullptr;
  int stop_after = 0;   // 0: never returns 0
  int action = 0;       // 1: kvlite_cancel(engine); 2: kvlite_cancel_request(engine, other)
  int64_t other = 0;
  int calls = 0;
};
int on_token(const char* piece, int32_t, void* user_data) {
  if (!piece) abort();  // always a string, "" at least
  auto* plan = static_cast<CallbackPlan*>(user_data);
  plan->calls++;
  if (plan->action == 1 && plan->calls == 2) kvlite_cancel(plan->engine);
  if (plan->action == 2 && plan->calls == 1) (void)kvlite_cancel_request(plan->engine, plan->other);
  return plan->stop_after == 0 || plan->calls < plan->stop_after;
}

// A kvlite_sampling from the input: every field extreme or not, stop lists consistent with their counts (a count
// larger than its array would be the caller's out-of-bounds read, not kvlite's), or NULL with a count.
struct Sampling {
  kvlite_sampling value;
  std::vector<int32_t> stop_tokens;
  std::vector<std::string> stop_text;
  std::vector<const char*> stop_strings;
};
void fill_sampling(fuzz::Bytes& in, Sampling* s) {
  kvlite_sampling_init(&s->value);
  const uint8_t which = in.byte();
  if (which & 1) s->value.temperature = float(extreme_double(in));
  if (which & 2) s->value.top_k = extreme_i64(in);
  if (which & 4) s->value.top_p = float(extreme_double(in));
  if (which & 8) s->value.min_p = float(extreme_double(in));
  if (which & 16) s->value.repetition_penalty = float(extreme_double(in));
  s->value.seed = uint64_t(in.i64());
  // max_tokens: extreme, or small enough that the 48-token context is not always filled
  s->value.max_tokens = (which & 32) ? extreme_i64(in) : int64_t(in.byte() % 6);
  s->value.ignore_eos = in.byte() & 1;
  const uint8_t stops = in.byte();
  for (int i = 0; i < (stops & 3); i++) s->stop_tokens.push_back(int32_t(extreme_i64(in)));
  for (int i = 0; i < ((stops >> 2) & 3); i++) s->stop_text.push_back(in.text(8));
  for (const std::string& t : s->stop_text) s->stop_strings.push_back(t.c_str());
  if ((stops >> 4) & 1) s->stop_strings.push_back(nullptr);  // a NULL entry
  s->value.stop_tokens = s->stop_tokens.empty() ? nullptr : s->stop_tokens.data();
  s->value.n_stop_tokens = s->stop_tokens.size();
  s->value.stop_strings = s->stop_strings.empty() ? nullptr : s->stop_strings.data();
  s->value.n_stop_strings = s->stop_strings.size();
  if ((stops >> 5) & 1) s->value.stop_tokens = nullptr;  // a count without its array
  s->value.struct_size = struct_size(in, uint32_t(sizeof(kvlite_sampling)));
}

void fill_options(fuzz::Bytes& in, kvlite_options* o) {
  kvlite_options_init(o);
  o->backend = (in.byte() % 4 == 0) ? int32_t(extreme_i64(in)) : KVLITE_BACKEND_CPU;
  const uint8_t which = in.byte();
  // The budget stays within the fuzzer's memory limit (kvlite reserves what the plan says, as asked).
  // (never 0: that is "this machine's memory", which kv_fill would then fill: 21 GiB here)
  o->device_mem = (which & 1) ? 1 + uint64_t(in.u32() % (48u << 20)) : (32ull << 20);
  if (which & 2) o->utilization = extreme_double(in);
  if (which & 4) o->max_model_len = extreme_i64(in);
  if (which & 8) o->max_seqs = extreme_i64(in);
  if (which & 16) o->max_batched_tokens = extreme_i64(in);
  if (which & 32) o->threads = int32_t(extreme_i64(in));
  if (which & 64) o->max_images = extreme_i64(in);
  if (which & 128) o->max_image_pixels = extreme_i64(in);
  static const char* const kDTypes[] = {nullptr, "auto", "f32", "bf16", "fp8", "f64", ""};
  o->kv_dtype = kDTypes[in.byte() % 7];
  o->kv_fill = in.byte() & 1;
  o->device = (in.byte() % 8 == 0) ? int32_t(extreme_i64(in)) : 0;
  const uint8_t log = in.byte();
  if (log & 1) o->log_level = int32_t(extreme_i64(in));
  if (log & 2) o->name = (log & 4) ? "" : "fuzz-engine";
  o->struct_size = struct_size(in, uint32_t(sizeof(kvlite_options)));
}

void take(kvlite_generation* out) {
  if (out->n_ids > 0 && !out->ids) abort();
  if (!out->text) abort();
  kvlite_generation_free(out);
  kvlite_generation_free(out);  // zeroed by the first: defined as safe
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  kvlite_engine* engine = shared_engine();
  for (int calls = 0; calls < 8 && !in.empty(); calls++) {
    const uint8_t op = in.byte();
    const bool null_engine = (op & 0x80) != 0;  // the same call on a NULL engine
    kvlite_engine* e = null_engine ? nullptr : engine;
    switch (op % 10) {
      case 0: {  // generate from text
        Sampling s;
        fill_sampling(in, &s);
        const std::string prompt = in.text(24);
        CallbackPlan plan{engine, in.byte() % 4, in.byte() % 3, extreme_i64(in)};
        kvlite_generation out{};
        const int status = kvlite_generate(e, (op & 0x40) ? nullptr : prompt.c_str(), nullptr, 0,
                                           (op & 0x20) ? nullptr : &s.value, (op & 0x10) ? on_token : nullptr, &plan,
                                           &out);
        check(status, "kvlite_generate");
        if (status == KVLITE_OK) take(&out);
        break;
      }
      case 1: {  // generate from chat messages, with NULL arrays or entries
        Sampling s;
        fill_sampling(in, &s);
        const size_t n = in.byte() % 4;
        std::vector<std::string> text;
        for (size_t i = 0; i < 2 * n; i++) text.push_back(in.text(12));
        std::vector<const char*> roles, contents;
        for (size_t i = 0; i < n; i++) {
          roles.push_back((op & 0x40) && i == 0 ? nullptr : text[2 * i].c_str());
          contents.push_back(text[2 * i + 1].c_str());
        }
        CallbackPlan plan{engine, in.byte() % 4, in.byte() % 3, extreme_i64(in)};
        kvlite_generation out{};
        const int status = kvlite_generate_chat(e, (op & 0x20) ? nullptr : roles.data(), contents.data(), n, nullptr, 0,
                                                &s.value, (op & 0x10) ? on_token : nullptr, &plan, &out);
        check(status, "kvlite_generate_chat");
        if (status == KVLITE_OK) take(&out);
        break;
      }
      case 2: {  // continuous batching: submit two, cancel, step, take results (twice: the second must fail)
        Sampling s;
        fill_sampling(in, &s);
        std::vector<int32_t> ids;
        for (int i = 0, n = in.byte() % 6; i < n; i++) ids.push_back(int32_t(in.byte() % 3 == 0 ? extreme_i64(in) : in.byte()));
        int64_t first = -1, second = -1;
        CallbackPlan plan{engine, in.byte() % 4, in.byte() % 3, 0};
        int status = kvlite_submit(e, ids.empty() ? nullptr : ids.data(), ids.size(), nullptr, 0, &s.value,
                                   (op & 0x10) ? on_token : nullptr, &plan, &first);
        check(status, "kvlite_submit");
        plan.other = first;
        status = kvlite_submit(e, ids.empty() ? nullptr : ids.data(), ids.size(), nullptr, 0, &s.value, on_token, &plan,
                               &second);
        check(status, "kvlite_submit");
        if (in.byte() & 1) check(kvlite_cancel_request(e, (op & 0x40) ? extreme_i64(in) : second), "kvlite_cancel_request");
        int unfinished = 1;
        for (int steps = 0; unfinished && steps < 80; steps++) {
          status = kvlite_step(e, (op & 0x20) ? nullptr : &unfinished);
          check(status, "kvlite_step");
          if (status != KVLITE_OK || (op & 0x20)) break;
        }
        for (int64_t id : {first, second, first, extreme_i64(in)}) {  // unfinished, taken twice, unknown
          kvlite_generation out{};
          status = kvlite_result(e, id, (op & 0x08) ? nullptr : &out);
          check(status, "kvlite_result");
          if (status == KVLITE_OK) take(&out);
        }
        // Anything left (a step that failed, or not run) ends and is taken here, so the next input starts clean.
        unfinished = 1;
        for (int steps = 0; unfinished && steps < 80 && !null_engine; steps++)
          if (kvlite_step(engine, &unfinished) != KVLITE_OK) break;
        for (int64_t id : {first, second}) {
          kvlite_generation out{};
          if (id >= 0 && kvlite_result(engine, id, &out) == KVLITE_OK) take(&out);
        }
        break;
      }
      case 3: {  // tokenize and detokenize, with ids from anywhere
        const std::string text = in.text(32);
        int32_t* ids = nullptr;
        size_t n = 0;
        int status = kvlite_tokenize(e, (op & 0x40) ? nullptr : text.c_str(), op & 1, (op & 0x20) ? nullptr : &ids, &n);
        check(status, "kvlite_tokenize");
        if (status == KVLITE_OK) kvlite_free(ids);
        std::vector<int32_t> raw;
        for (int i = 0, count = in.byte() % 5; i < count; i++) raw.push_back(int32_t(extreme_i64(in)));
        char* out = nullptr;
        status = kvlite_detokenize(e, raw.empty() ? nullptr : raw.data(), raw.empty() && (op & 0x10) ? 3 : raw.size(),
                                   op & 2, &out);
        check(status, "kvlite_detokenize");
        if (status == KVLITE_OK) kvlite_free(out);
        break;
      }
      case 4: {  // plan on fuzzed options (reads config.json only)
        kvlite_options options;
        fill_options(in, &options);
        char* text = nullptr;
        int fits = 0;
        const int status = kvlite_plan((op & 0x40) ? nullptr : model_dir().c_str(), (op & 0x20) ? nullptr : &options,
                                       op & 1, &text, (op & 0x10) ? nullptr : &fits);
        check(status, "kvlite_plan");
        if (status == KVLITE_OK) kvlite_free(text);
        break;
      }
      case 5: {  // open on fuzzed options, with a progress callback that may abort, then close (twice: NULL after)
        kvlite_options options;
        fill_options(in, &options);
        const int stop_at = in.byte() % 3;
        int progress_calls = 0;
        struct Progress {
          int stop_at;
          int* calls;
        } progress{stop_at, &progress_calls};
        auto on_progress = [](uint64_t, uint64_t, void* user) -> int {
          auto* p = static_cast<Progress*>(user);
          return p->stop_at == 0 || ++*p->calls < p->stop_at;
        };
        kvlite_engine* opened = nullptr;
        const int status = kvlite_open(model_dir().c_str(), &options, (op & 0x10) ? +on_progress : nullptr, &progress,
                                       &opened);
        check(status, "kvlite_open");
        if (status == KVLITE_OK) {
          char* text = nullptr;
          if (kvlite_engine_plan(opened, op & 1, &text) == KVLITE_OK) kvlite_free(text);
          kvlite_close(opened);
        } else if (opened) {
          abort();  // out-parameters are written only on success
        }
        kvlite_close(nullptr);
        break;
      }
      case 6: {  // images: encoded bytes, raw pixels with extreme sizes, sizes of NULL
        const std::string bytes = in.text(64);
        kvlite_image* image = nullptr;
        int status = kvlite_image_decode(bytes.empty() ? nullptr : reinterpret_cast<const uint8_t*>(bytes.data()),
                                         bytes.empty() && (op & 0x40) ? 16 : bytes.size(), &image);
        check(status, "kvlite_image_decode");
        kvlite_image_free(image);
        image = nullptr;
        int64_t width = extreme_i64(in), height = extreme_i64(in), stride = (op & 0x20) ? extreme_i64(in) : 0;
        const int32_t format = int32_t(in.byte() % 7) - 1;
        // Sizes kvlite must refuse before reading get a 1-byte buffer; sizes it accepts get a buffer that holds
        // them (a caller claiming more than it has is the caller's bug), when that is small.
        const bool refused = width <= 0 || height <= 0 || width > (int64_t(1) << 24) || height > (int64_t(1) << 24) ||
                             width * height > kvlite::limits::max_image_pixels || stride < 0 ||
                             stride > (int64_t(4) << 24);
        const uint64_t need = refused ? 1 : uint64_t(height) * uint64_t(std::max<int64_t>(stride, width * 4));
        if (need > (1u << 20)) break;
        std::vector<uint8_t> pixels(size_t(need), 7);
        status = kvlite_image_from_pixels((op & 0x10) ? nullptr : pixels.data(), width, height, format, stride, &image);
        check(status, "kvlite_image_from_pixels");
        if (status == KVLITE_OK && refused) abort();
        int64_t w = 0, h = 0;
        check(kvlite_image_size(image, (op & 0x08) ? nullptr : &w, &h), "kvlite_image_size");
        if (image) {  // a text model takes no image: refused, typed
          kvlite_generation out{};
          const kvlite_image* images[] = {image};
          status = kvlite_generate(e, "<|begin_of_text|>", images, 1, nullptr, nullptr, nullptr, &out);
          check(status, "kvlite_generate with an image");
          if (status == KVLITE_OK) take(&out);
        }
        kvlite_image_free(image);
        kvlite_image_free(nullptr);
        break;
      }
      case 7: {  // scoring and logits with extreme windows and ids
        const std::string text = in.text(16);
        double perplexity = 0;
        int64_t tokens = 0;
        check(kvlite_score(e, text.c_str(), extreme_i64(in), extreme_i64(in), (op & 0x40) ? nullptr : &perplexity,
                           (op & 0x20) ? nullptr : &tokens),
              "kvlite_score");
        std::vector<int32_t> ids;
        for (int i = 0, n = in.byte() % 5; i < n; i++) ids.push_back(int32_t(in.byte() % 4 == 0 ? extreme_i64(in) : in.byte()));
        float* values = nullptr;
        int64_t rows = 0, vocab = 0;
        const int status = kvlite_logits(e, ids.empty() ? nullptr : ids.data(), ids.size(),
                                         (op & 0x10) ? nullptr : &values, &rows, &vocab);
        check(status, "kvlite_logits");
        if (status == KVLITE_OK) kvlite_free(values);
        break;
      }
      case 8: {  // chat formatting, names of numbers, cancels with nothing running
        const std::string role = in.text(8), content = in.text(16);
        const char* roles[] = {role.c_str()};
        const char* contents[] = {(op & 0x40) ? nullptr : content.c_str()};
        char* text = nullptr;
        const int status = kvlite_format_chat(e, roles, contents, 1, op & 1, (op & 0x20) ? nullptr : &text);
        check(status, "kvlite_format_chat");
        if (status == KVLITE_OK) kvlite_free(text);
        // the same bytes as the messages' JSON for the template (and as its extra variables)
        text = nullptr;
        const int applied = kvlite_apply_chat_template(e, (op & 0x40) ? nullptr : content.c_str(), op & 1,
                                                       (op & 0x10) ? role.c_str() : nullptr, &text);
        check(applied, "kvlite_apply_chat_template");
        if (applied == KVLITE_OK) kvlite_free(text);
        const int64_t n = extreme_i64(in);
        if (!kvlite_status_name(int(n)) || !kvlite_finish_reason_name(int32_t(n))) abort();
        kvlite_cancel(e);
        kvlite_cancel(nullptr);
        check(kvlite_cancel_request(e, extreme_i64(in)), "kvlite_cancel_request");
        kvlite_free(nullptr);
        kvlite_generation_free(nullptr);
        break;
      }
      case 9: {  // the *_init functions and out-parameters of NULL
        kvlite_options_init(nullptr);
        kvlite_sampling_init(nullptr);
        check(kvlite_engine_plan(e, op & 1, nullptr), "kvlite_engine_plan");
        check(kvlite_generate(e, "x", nullptr, 0, nullptr, nullptr, nullptr, nullptr), "kvlite_generate");
        check(kvlite_submit(e, nullptr, 0, nullptr, 0, nullptr, nullptr, nullptr, nullptr), "kvlite_submit");
        check(kvlite_generate(e, "x", nullptr, 2, nullptr, nullptr, nullptr, nullptr), "kvlite_generate");
        break;
      }
    }
  }
  return 0;
}
