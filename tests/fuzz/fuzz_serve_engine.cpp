// libFuzzer harness: a request body through kvlite serve's whole request-to-engine path, without HTTP: the
// server's reader (parse_request: JSON with the library's limits, messages, data: URI images, sampling fields)
// and then what its engine thread does (submit_request: chat format or prompt encoding, preprocessing, submit),
// stepped to the end on the tiny Llama-3 fixture. Whatever the server accepts, the engine must accept too (its
// SamplingParams pass kvlite::validate) or refuse with a typed error; nothing may crash, leak or be `internal`.
// Input: a route byte (bit 0: completions; bits 1-3: the max_tokens cap, 1..8; bits 4-5: when the token callback
// ends the request), then the body.
#include "fuzz_support.hpp"
#include "server/openai_server.hpp"

namespace {

kvlite::Engine& engine() {
  static std::unique_ptr<kvlite::Engine> opened = [] {
    kvlite::EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;
    options.plan.device_mem = 64 * kvlite::MiB;
    options.plan.max_model_len = 96;
    options.threads = 1;
    return kvlite::Engine::open(fuzz::source_dir() + "/tests/fixtures/models/tiny-llama3", options).value();
  }();
  return *opened;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t route = data[0];
  const bool chat = (route & 1) == 0;
  const int64_t cap = 1 + ((route >> 1) & 7);
  const int stop_after = (route >> 4) & 3;  // 0: never; else after that many pieces
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  kvlite_server::ParsedRequest request;
  std::string message;
  const int status = kvlite_server::parse_request(chat, body, "tiny-llama3", cap, 4, &request, &message);
  const bool known = status == 200 || status == 400 || status == 404 || status == 413;
  if (!known || (status != 200 && message.empty())) {
    fprintf(stderr, "parse_request: status %d, message '%s'\n", status, message.c_str());
    abort();
  }
  if (status != 200) return 0;
  kvlite::Status valid = kvlite::validate(request.params);
  if (!valid.ok()) {
    fprintf(stderr, "the server accepted sampling fields the engine refuses: %s\n", valid.error().message.c_str());
    abort();
  }
  int pieces = 0;
  auto on_token = [&](const std::string&, int32_t) { return stop_after == 0 || ++pieces < stop_after; };
  kvlite::Engine& e = engine();
  auto id = kvlite_server::submit_request(e, request, on_token);
  fuzz::expect_typed(id, "submit_request");
  if (!id.ok()) return 0;
  for (int steps = 0; !e.finished(*id); steps++) {
    if (steps > 64) {
      fprintf(stderr, "a request of at most %lld tokens still runs after 64 steps\n", (long long)cap);
      abort();
    }
    auto more = e.step();
    fuzz::expect_typed(more, "step");
    if (!more.ok()) break;
  }
  auto result = e.result(*id);
  fuzz::expect_typed(result, "result");
  if (result.ok() && int64_t(result->ids.size()) > cap) {
    fprintf(stderr, "%zu tokens generated under a cap of %lld\n", result->ids.size(), (long long)cap);
    abort();
  }
  return 0;
}
