// libFuzzer harness: a request body as kvlite serve reads it (JSON, messages and their parts, base64 data: URIs
// and the images inside them, sampling fields), for /v1/chat/completions and /v1/completions. Every input gets
// 200 or one of the server's error statuses with a message; nothing else may happen.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/openai_server.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) == 0;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  std::string message;
  const int status = kvlite_server::check_request(chat, body, "kvlite-captioner-bf16", 256, &message);
  const bool known = status == 200 || status == 400 || status == 404 || status == 413;
  if (!known || (status != 200 && message.empty())) std::abort();
  return 0;
}
