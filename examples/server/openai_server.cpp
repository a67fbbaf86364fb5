// openai_server: see openai_server.hpp. Public kvlite API only.
#include "openai_server.hpp"

#include <httplib.h>
#include <dirent.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlite_server {

using nlohmann::json;

namespace {

// An HTTP error in OpenAI's shape.
struct HttpError {
  int status = 400;
  std::string message;
  std::string param;  // the field at fault, or ""
  std::string type = "invalid_request_error";
  std::string code;  // "model_not_found", ...
};

// What a request is checked against.
struct RequestLimits {
  std::string model_name;
  int64_t max_tokens_cap = 0;
  int64_t default_max_tokens = 256;
  // Images, checked before any is decoded: how many one request may carry (the plan's --max-images), one
  // image's encoded bytes (--max-image-bytes), and its pixels as its header states them (the decoder's limit).
  int64_t max_images = 64;
  int64_t max_image_bytes = int64_t(20) << 20;
  int64_t max_image_pixels = kvlite::limits::max_image_pixels;
};

json error_body(const HttpError& e) {
  json error = {{"message", e.message}, {"type", e.type}};
  error["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  error["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return {{"error", error}};
}

[[noreturn]] void bad(const std::string& message, const std::string& param = "", int status = 400) {
  throw HttpError{status, message, param, "invalid_request_error", ""};
}

HttpError from_kvlite(const kvlite::Error& error) {
  switch (error.code) {
    case kvlite::ErrorCode::invalid_argument:
    case kvlite::ErrorCode::bad_format:
    case kvlite::ErrorCode::unsupported:
    case kvlite::ErrorCode::does_not_fit:
      return {400, error.message, "", "invalid_request_error", kvlite::error_code_name(error.code)};
    case kvlite::ErrorCode::cancelled:
      return {499, error.message, "", "cancelled", "cancelled"};
    default:
      return {500, error.message, "", "server_error", kvlite::error_code_name(error.code)};
  }
}

const char* finish_reason_text(kvlite::FinishReason reason) {
  switch (reason) {
    case kvlite::FinishReason::stop_token:
    case kvlite::FinishReason::stop_string:
    case kvlite::FinishReason::grammar_end: return "stop";
    case kvlite::FinishReason::max_tokens:
    case kvlite::FinishReason::length: return "length";
    default: return "abort";
  }
}

// One request's pipe from the engine thread to the HTTP thread that waits for it.
struct Channel {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::string> pieces;  // text not yet sent (streaming) or gathered (not)
  bool done = false;
  bool accepted = false;  // the engine took the request: from here on, errors can only be sent as events
  bool tools_on = false;  // the request has tools and a tool_choice other than none: the text is parsed for calls
  std::optional<HttpError> error;
  // Latency marks (steady clock) for the histograms: when it was queued, its first and latest token.
  std::chrono::steady_clock::time_point queued_at = std::chrono::steady_clock::now(), last_token_at;
  bool had_token = false;
  kvlite::FinishReason finish_reason = kvlite::FinishReason::running;
  int64_t prompt_tokens = 0, completion_tokens = 0;
  json logprobs;  // "logprobs" asked for: each generated token and its log-probability, in the endpoint's form
  std::atomic<bool> abandoned{false};  // the client went away: the token callback ends the request
  bool chat = true;                    // which endpoint's form the answer takes

  void push(std::string piece) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      pieces.push_back(std::move(piece));
    }
    changed.notify_all();
  }
  void accept() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      accepted = true;
    }
    changed.notify_all();
  }
  void finish(kvlite::FinishReason reason, int64_t prompt, int64_t completion, json token_logprobs = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      finish_reason = reason;
      prompt_tokens = prompt;
      completion_tokens = completion;
      logprobs = std::move(token_logprobs);
      done = true;
    }
    changed.notify_all();
  }
  void fail(HttpError e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      error = std::move(e);
      done = true;
    }
    changed.notify_all();
  }
};

// A validated request, waiting for the engine thread.
struct Job {
  ParsedRequest request;
  std::shared_ptr<Channel> channel;
};

int64_t integer_field(const json& body, const char* name, int64_t low, int64_t high, int64_t fallback) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  const json& v = body[name];
  if (!v.is_number_integer()) bad(std::string("'") + name + "' must be an integer", name);
  const int64_t value = v.get<int64_t>();
  if (value < low || value > high)
    bad(std::string("'") + name + "' is " + std::to_string(value) + "; it must be in " + std::to_string(low) + ".." +
            std::to_string(high),
        name);
  return value;
}

double number_field(const json& body, const char* name, double low, double high, double fallback) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  const json& v = body[name];
  if (!v.is_number()) bad(std::string("'") + name + "' must be a number", name);
  const double value = v.get<double>();
  if (!(value >= low && value <= high))
    bad(std::string("'") + name + "' is " + v.dump(-1, ' ', false, json::error_handler_t::replace) + "; it must be in [" + json(low).dump(-1, ' ', false, json::error_handler_t::replace) + ", " +
            json(high).dump(-1, ' ', false, json::error_handler_t::replace) + "]",
        name);
  return value;
}

// A seed for a request that names none: a random device's bits mixed with a counter, so that two requests in the
// same microsecond still differ.
uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = [] {
    std::random_device device;
    return (uint64_t(device()) << 32) ^ uint64_t(device()) ^
           uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  uint64_t x = base + 0x9E3779B97F4A7C15ull * ++counter;  // splitmix64
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Every field of a request is either implemented or refused by name: a field kvlite would otherwise ignore
// (tools, response_format, penalties, logit_bias, echo, ...) changes what the client expects, so a silent 200
// would be a wrong answer. Fields whose value asks for nothing (a zero penalty, n = 1, tool_choice "none") pass.
void refuse_unsupported_fields(const json& body, bool chat) {
  static const char* const common[] = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p",
                                       "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "n", "stop",
                                       "logprobs", "user", "presence_penalty", "frequency_penalty", "logit_bias"};
  static const char* const chat_only[] = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                          "parallel_tool_calls", "response_format", "functions", "function_call"};
  static const char* const completion_only[] = {"prompt", "echo", "best_of", "suffix"};
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();
    bool known = std::find_if(std::begin(common), std::end(common), [&](const char* k) { return key == k; }) !=
                 std::end(common);
    if (chat)
      known = known || std::find_if(std::begin(chat_only), std::end(chat_only),
                                    [&](const char* k) { return key == k; }) != std::end(chat_only);
    else
      known = known || std::find_if(std::begin(completion_only), std::end(completion_only),
                                    [&](const char* k) { return key == k; }) != std::end(completion_only);
    if (!known)
      bad("'" + key + "' is not a field kvlite serve reads on this endpoint; it is refused rather than ignored", key);
  }
  auto present = [&](const char* name) { return body.contains(name) && !body[name].is_null(); };
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    if (!present(penalty)) continue;
    if (!body[penalty].is_number()) bad(std::string("'") + penalty + "' must be a number", penalty);
    if (body[penalty].get<double>() != 0.0)
      bad(std::string("'") + penalty + "' other than 0 is not supported yet (repetition_penalty is)", penalty);
  }
  if (present("logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    bad("'logit_bias' is not supported yet", "logit_bias");
  if (present("user") && !body["user"].is_string()) bad("'user' must be a string", "user");
  if (chat) {
    if (present("tools") && !body["tools"].is_array()) bad("'tools' must be an array", "tools");
    if (present("functions")) bad("'functions' (the deprecated form) is not supported: send 'tools'", "functions");
    if (present("function_call")) bad("'function_call' (the deprecated form) is not supported: send 'tool_choice'", "function_call");
    if (present("parallel_tool_calls") && !body["parallel_tool_calls"].is_boolean())
      bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls");
  } else {
    if (present("echo") && !(body["echo"].is_boolean() && !body["echo"].get<bool>()))
      bad("'echo' is not supported yet", "echo");
    if (present("best_of") && !(body["best_of"].is_number_integer() && body["best_of"].get<int64_t>() == 1))
      bad("'best_of' other than 1 is not supported", "best_of");
    if (present("suffix")) bad("'suffix' is not supported", "suffix");
  }
}

// Sampling fields shared by both endpoints.
kvlite::SamplingParams sampling_of(const json& body, int64_t max_tokens_cap, int64_t default_max_tokens) {
  kvlite::SamplingParams params;
  const int64_t fallback = std::min(default_max_tokens, max_tokens_cap);
  params.max_tokens = integer_field(body, "max_tokens", 1, max_tokens_cap, fallback);
  params.max_tokens = integer_field(body, "max_completion_tokens", 1, max_tokens_cap, params.max_tokens);
  // OpenAI's default temperature is 1 (sampling); greedy decoding is asked for with "temperature": 0.
  params.temperature = float(number_field(body, "temperature", 0.0, 2.0, 1.0));
  params.top_p = float(number_field(body, "top_p", 0.0, 1.0, 1.0));
  if (body.contains("top_p") && params.top_p <= 0.0f) bad("'top_p' must be greater than 0", "top_p");
  const int64_t top_k = integer_field(body, "top_k", -1, int64_t(1) << 30, 0);
  params.top_k = top_k < 0 ? 0 : top_k;
  params.min_p = float(number_field(body, "min_p", 0.0, 1.0, 0.0));
  params.repetition_penalty = float(number_field(body, "repetition_penalty", 0.01, 100.0, 1.0));
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) bad("'seed' must be an integer", "seed");
    params.seed = uint64_t(body["seed"].get<int64_t>());
  } else {
    params.seed = fresh_seed();  // no seed: each call samples differently, as OpenAI's and vLLM's do
  }
  if (body.contains("ignore_eos") && !body["ignore_eos"].is_null()) {  // vLLM's extension, for benchmarks
    if (!body["ignore_eos"].is_boolean()) bad("'ignore_eos' must be a boolean", "ignore_eos");
    params.ignore_eos = body["ignore_eos"].get<bool>();
  }
  if (body.contains("n") && !body["n"].is_null()) {
    if (!body["n"].is_number_integer()) bad("'n' must be an integer", "n");
    if (body["n"].get<int64_t>() != 1) bad("'n' other than 1 (several choices) is not supported yet", "n");
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      params.stop_strings.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= 4) {
      for (const json& s : stop) {
        if (!s.is_string()) bad("'stop' must be a string or an array of up to 4 strings", "stop");
        params.stop_strings.push_back(s.get<std::string>());
      }
    } else {
      bad("'stop' must be a string or an array of up to 4 strings", "stop");
    }
    for (const std::string& s : params.stop_strings) {
      if (s.empty()) bad("'stop' strings must not be empty", "stop");
      if (int64_t(s.size()) > kvlite::limits::max_stop_string_bytes)
        bad("'stop' strings must be at most " + std::to_string(kvlite::limits::max_stop_string_bytes) + " bytes",
            "stop");
    }
  }
  return params;
}

bool stream_of(const json& body) {
  if (!body.contains("stream") || body["stream"].is_null()) return false;
  if (!body["stream"].is_boolean()) bad("'stream' must be a boolean", "stream");
  return body["stream"].get<bool>();
}

kvlite::Image image_of(const json& part, size_t message, const RequestLimits& limits) {
  const std::string where = "messages[" + std::to_string(message) + "].content";
  if (!part.contains("image_url")) bad("an image_url part needs 'image_url'", where);
  const json& image_url = part["image_url"];
  std::string url;
  if (image_url.is_string()) url = image_url.get<std::string>();
  else if (image_url.is_object() && image_url.contains("url") && image_url["url"].is_string())
    url = image_url["url"].get<std::string>();
  else bad("'image_url' must be an object with a string 'url'", where);
  // base64 holds 3 bytes in 4 characters: an image over the limit is refused before it is decoded at all
  const size_t comma = url.find(',');
  if (comma != std::string::npos && int64_t((url.size() - comma - 1) / 4 * 3) > limits.max_image_bytes + 2)
    bad("an image of " + std::to_string((url.size() - comma - 1) / 4 * 3) + " bytes is over the server's limit of " +
            std::to_string(limits.max_image_bytes) + " (--max-image-bytes)",
        where, 413);
  kvlite::Result<std::string> bytes = decode_data_uri(url);
  if (!bytes) bad(bytes.error().message, where);
  kvlite::DecodeOptions decode_options;
  decode_options.max_pixels = limits.max_image_pixels;  // read from the header, before any pixel is decoded
  kvlite::Result<kvlite::Image> image =
      kvlite::decode_image(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size(), decode_options);
  if (!image) {
    const bool too_large = image.error().message.find("over the decode limit") != std::string::npos ||
                           image.error().message.find("beyond the decoder's limits") != std::string::npos;
    bad("the image is not one kvlite can read: " + image.error().message, where, too_large ? 413 : 400);
  }
  return std::move(*image);
}

std::string fresh_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  return std::string(prefix) + std::to_string(++counter);
}

int64_t now_seconds() { return int64_t(std::time(nullptr)); }

// The socket a request came in on, so that a handler waiting for the engine sees its client go away.
// cpp-httplib 0.11 (Debian 12's) keeps the socket to itself; it is found among this process's descriptors by
// its two ends (the request's local and remote address and port), which name one TCP connection. The handler
// runs while its connection is open, so the descriptor stays this connection's for as long as it is watched.
class ClientSocket {
 public:
  ClientSocket(const httplib::Request& request) {
    DIR* fds = opendir("/proc/self/fd");
    if (!fds) return;
    while (dirent* entry = readdir(fds)) {
      const int fd = atoi(entry->d_name);
      if (fd <= 2) continue;
      int type = 0;
      socklen_t length = sizeof type;
      if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM) continue;
      const bool local_matches =
          request.local_port < 0 || end_of(fd, getsockname) == std::make_pair(request.local_addr, request.local_port);
      if (local_matches && end_of(fd, getpeername) == std::make_pair(request.remote_addr, request.remote_port)) {
        fd_ = fd;
        break;
      }
    }
    closedir(fds);
  }
  bool found() const { return fd_ >= 0; }
  int fd() const { return fd_; }

  // True once the client has closed or reset the connection. Its clients send nothing while they wait for an
  // answer, so a readable socket with no bytes to peek at is the end of the stream. A client that sends its
  // next request early (pipelining) is still there: its bytes are left for cpp-httplib to read.
  bool gone() const {
    if (fd_ < 0) return false;
    pollfd p{fd_, short(POLLIN | POLLRDHUP), 0};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP)) return true;
    if (!(p.revents & POLLIN)) return false;
    char byte;
    const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

 private:
  template <class GetName>
  static std::pair<std::string, int> end_of(int fd, GetName get_name) {
    sockaddr_storage address{};
    socklen_t length = sizeof address;
    if (get_name(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return {"", -1};
    char host[NI_MAXHOST], port[NI_MAXSERV];
    if (getnameinfo(reinterpret_cast<sockaddr*>(&address), length, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
      return {"", -1};
    return {host, atoi(port)};
  }
  int fd_ = -1;
};

// How often a handler waiting for the engine looks at its client's socket.
constexpr auto kClientPollInterval = std::chrono::milliseconds(20);


json parse_body(const std::string& text, const RequestLimits& limits) {
  // The library's limits first (KVLITE_MAX_JSON_DEPTH, KVLITE_MAX_JSON_BYTES): nlohmann's parser has none, and a
  // 32 MiB body of '[' cost it 2.5 GB and 5 s.
  if (kvlite::Status within = kvlite::check_json_limits(text, "the body"); !within) bad(within.error().message);
  json body;
  try {
    body = json::parse(text);
  } catch (const std::exception& e) {
    bad(std::string("the body is not valid JSON: ") + e.what());
  }
  if (!body.is_object()) bad("the body must be a JSON object");
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) bad("'model' must be a string", "model");
    const std::string model = body["model"].get<std::string>();
    if (model != limits.model_name)
      throw HttpError{404, "the model '" + model + "' does not exist; this server serves '" + limits.model_name + "'",
                      "model", "invalid_request_error", "model_not_found"};
  }
  return body;
}

// An assistant turn's tool calls as chat templates take them (transformers' and vLLM's form): {"type": "function",
// "id", "function": {"name", "arguments"}}, the arguments an object when the client sent them as a JSON string
// (OpenAI's way; the string is JSON of its own, under the same limits as the body). Their shape is checked here.
json template_tool_calls(const json& calls, const std::string& where) {
  json out = json::array();
  for (const json& call : calls) {
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
        !call["function"].contains("name") || !call["function"]["name"].is_string())
      bad(where + " entries must be objects with a 'function' that has a string 'name'", where);
    const json& function = call["function"];
    json arguments = json::object();
    if (function.contains("arguments") && function["arguments"].is_string()) {
      const std::string text = function["arguments"].get<std::string>();
      if (kvlite::Status within = kvlite::check_json_limits(text, where + " arguments"); !within)
        bad(within.error().message, where);
      arguments = json::parse(text, nullptr, false);
      if (arguments.is_discarded()) arguments = function["arguments"];
    } else if (function.contains("arguments") && !function["arguments"].is_null()) {
      arguments = function["arguments"];
    }
    json entry = {{"type", "function"}, {"function", {{"name", function["name"]}, {"arguments", std::move(arguments)}}}};
    if (call.contains("id") && call["id"].is_string()) entry["id"] = call["id"];
    out.push_back(std::move(entry));
  }
  return out;
}

// The same calls as text in the Hermes / Qwen form their chat templates write
// (<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>), for models without a template of their own.
std::string tool_calls_text(const json& template_calls) {
  std::string text;
  for (const json& call : template_calls) {
    if (!text.empty()) text += "\n";
    text += "<tool_call>\n" +
            json{{"name", call["function"]["name"]}, {"arguments", call["function"]["arguments"]}}.dump(
                -1, ' ', false, json::error_handler_t::replace) +
            "\n</tool_call>";
  }
  return text;
}

ParsedRequest chat_job(const json& body, const RequestLimits& limits) {
  ParsedRequest job;
  job.chat = true;
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    bad("'messages' must be a non-empty array", "messages");
  // Images are counted before any is decoded: a request with too many costs nothing.
  int64_t image_parts = 0;
  for (const json& m : body["messages"])
    if (m.is_object() && m.contains("content") && m["content"].is_array())
      for (const json& part : m["content"])
        if (part.is_object() && part.contains("type") && part["type"] == "image_url") image_parts++;
  if (image_parts > limits.max_images)
    bad("the request carries " + std::to_string(image_parts) + " images; this server takes at most " +
            std::to_string(limits.max_images) + " per request (kvlite serve --max-images, EngineOptions::plan.max_images)",
        "messages");
  size_t index = 0;
  json template_messages = json::array();
  for (const json& m : body["messages"]) {
    const std::string where = "messages[" + std::to_string(index) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad(where + " must be an object with a string 'role'", where);
    kvlite::ChatMessage message{m["role"].get<std::string>(), ""};
    json structured = {{"role", message.role}};
    const json& content = m.contains("content") ? m["content"] : json(nullptr);
    const bool has_tool_calls = m.contains("tool_calls") && m["tool_calls"].is_array() && !m["tool_calls"].empty();
    std::string calls_text;
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      if (message.role != "assistant" || !m["tool_calls"].is_array())
        bad(where + ".tool_calls must be an array, on an assistant message", where + ".tool_calls");
      structured["tool_calls"] = template_tool_calls(m["tool_calls"], where + ".tool_calls");
      calls_text = tool_calls_text(structured["tool_calls"]);
    }
    if (message.role == "tool" && !(m.contains("tool_call_id") && m["tool_call_id"].is_string()))
      bad(where + " (a tool result) needs a string 'tool_call_id'", where + ".tool_call_id");
    for (const char* key : {"tool_call_id", "name", "reasoning_content"})
      if (m.contains(key) && !m[key].is_null()) {
        if (!m[key].is_string()) bad(where + "." + key + " must be a string", where + "." + key);
        structured[key] = m[key];
      }
    if (content.is_null() && has_tool_calls) {
      // an assistant turn that only called tools: its calls are its content
    } else if (content.is_string()) {
      message.content = content.get<std::string>();
    } else if (content.is_array()) {
      for (const json& part : content) {
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
          bad(where + ".content parts must be objects with a string 'type'", where + ".content");
        const std::string type = part["type"].get<std::string>();
        if (type == "text") {
          if (!part.contains("text") || !part["text"].is_string())
            bad("a text part needs a string 'text'", where + ".content");
          message.content += part["text"].get<std::string>();
        } else if (type == "image_url") {
          job.images.push_back(image_of(part, index, limits));
          message.content += kvlite::kImagePlaceholder;
        } else {
          bad("content part type '" + type + "' is not supported (text, image_url)", where + ".content");
        }
      }
    } else {
      bad(where + ".content must be a string or an array of parts", where + ".content");
    }
    // The template gets the content as text (images as their placeholder; "" for a turn of tool calls only, as
    // vLLM gives it), the calls beside it; the text form carries the calls after the content.
    structured["content"] = message.content;
    template_messages.push_back(std::move(structured));
    if (!calls_text.empty()) message.content += (message.content.empty() ? "" : "\n") + calls_text;
    job.messages.push_back(std::move(message));
    index++;
  }
  job.template_messages = template_messages.dump(-1, ' ', false, json::error_handler_t::replace);
  job.params = sampling_of(body, limits.max_tokens_cap, limits.default_max_tokens);
  // OpenAI's chat form: "logprobs": true, with "top_logprobs" (the alternatives at each token) 0 or absent
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    if (!body["logprobs"].is_boolean()) bad("'logprobs' must be a boolean", "logprobs");
    job.params.logprobs = body["logprobs"].get<bool>();
  }
  if (integer_field(body, "top_logprobs", 0, 20, 0) > 0)
    bad("'top_logprobs' above 0 is not supported (each token's own log-probability is: 'logprobs': true)",
        "top_logprobs");
  // tools and tool_choice (OpenAI's function calling)
  const bool has_tools = body.contains("tools") && body["tools"].is_array() && !body["tools"].empty();
  if (has_tools) {
    job.tools_json = body["tools"].dump();
    job.tool_choice = "auto";
    auto checked = kvlite::tool_calls_gbnf(job.tools_json, kvlite::ToolCallSyntax::hermes, "", true);
    if (!checked) bad("'tools': " + checked.error().message, "tools");
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const json& choice = body["tool_choice"];
    if (choice.is_string()) {
      const std::string value = choice;
      if (value != "none" && value != "auto" && value != "required")
        bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice");
      if (value != "none" && !has_tools) bad("'tool_choice' " + value + " needs 'tools'", "tool_choice");
      job.tool_choice = value;
    } else if (choice.is_object() && choice.value("type", "") == "function" && choice.contains("function") &&
               choice["function"].is_object() && choice["function"].contains("name") && choice["function"]["name"].is_string()) {
      if (!has_tools) bad("'tool_choice' names a function but there are no 'tools'", "tool_choice");
      job.tool_choice = choice["function"]["name"].get<std::string>();
      if (job.tool_choice == "none" || job.tool_choice == "auto" || job.tool_choice == "required")
        bad("'tool_choice' names a function called '" + job.tool_choice + "', which kvlite reads as the keyword", "tool_choice");
      auto named = kvlite::tool_calls_gbnf(job.tools_json, kvlite::ToolCallSyntax::hermes, job.tool_choice, false);
      if (!named) bad("'tool_choice': " + named.error().message, "tool_choice");
    } else {
      bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice");
    }
  }
  if (body.contains("parallel_tool_calls") && body["parallel_tool_calls"].is_boolean())
    job.parallel_tool_calls = body["parallel_tool_calls"].get<bool>();
  if ((job.tool_choice == "required" || (job.tool_choice != "none" && job.tool_choice != "auto")) &&
      body.contains("response_format") && !body["response_format"].is_null() &&
      body["response_format"].value("type", "text") != "text")
    bad("'response_format' and a tool_choice that forces a call cannot both shape the output", "response_format");
  // response_format: text (nothing), json_object (any JSON object), json_schema (valid against its schema;
  // "strict" or not, the output is constrained). The schema is compiled here so a bad one is a 400 naming it.
  if (body.contains("response_format") && !body["response_format"].is_null()) {
    const json& format = body["response_format"];
    if (!format.is_object() || !format.contains("type") || !format["type"].is_string())
      bad("'response_format' must be an object with a string 'type' (text, json_object, json_schema)", "response_format");
    const std::string type = format["type"];
    if (type == "json_object") {
      job.params.json_schema = R"({"type": "object"})";
    } else if (type == "json_schema") {
      if (!format.contains("json_schema") || !format["json_schema"].is_object() ||
          !format["json_schema"].contains("schema") || !(format["json_schema"]["schema"].is_object() || format["json_schema"]["schema"].is_boolean()))
        bad("'response_format.json_schema' must be an object with a 'schema' (the JSON schema)", "response_format");
      job.params.json_schema = format["json_schema"]["schema"].dump();
      auto compiled = kvlite::Grammar::json_schema_to_gbnf(job.params.json_schema);
      if (!compiled) bad("'response_format.json_schema.schema': " + compiled.error().message, "response_format");
    } else if (type != "text") {
      bad("'response_format.type' '" + type + "' is not one of text, json_object, json_schema", "response_format");
    }
  }
  return job;
}

ParsedRequest completion_job(const json& body, const RequestLimits& limits) {
  ParsedRequest job;
  job.chat = false;
  if (!body.contains("prompt") || !body["prompt"].is_string()) bad("'prompt' must be a string", "prompt");
  job.prompt = body["prompt"].get<std::string>();
  job.params = sampling_of(body, limits.max_tokens_cap, limits.default_max_tokens);
  // The completions form: "logprobs": N, the number of alternatives listed at each token; 0 lists none
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    if (integer_field(body, "logprobs", 0, 5, 0) > 0)
      bad("'logprobs' above 0 is not supported (0 gives each token's own log-probability)", "logprobs");
    job.params.logprobs = true;
  }
  return job;
}

// A body as the server reads it, everything checked (an HttpError otherwise): the one reader behind the
// endpoints, check_request and parse_request.
ParsedRequest read_request(bool chat, const std::string& text, const RequestLimits& limits) {
  const json body = parse_body(text, limits);
  refuse_unsupported_fields(body, chat);
  ParsedRequest request = chat ? chat_job(body, limits) : completion_job(body, limits);
  request.stream = stream_of(body);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& options = body["stream_options"];
    if (!options.is_object()) bad("'stream_options' must be an object", "stream_options");
    for (auto it = options.begin(); it != options.end(); ++it)
      if (it.key() != "include_usage" && it.key() != "continuous_usage_stats")
        bad("'stream_options." + it.key() + "' is not supported", "stream_options");
    if (options.contains("continuous_usage_stats") && options["continuous_usage_stats"] != false)
      bad("'stream_options.continuous_usage_stats' is not supported", "stream_options");
    if (options.contains("include_usage")) {
      if (!options["include_usage"].is_boolean()) bad("'stream_options.include_usage' must be a boolean", "stream_options");
      request.include_usage = options["include_usage"].get<bool>();
    }
    if (!request.stream) bad("'stream_options' is only allowed with 'stream': true", "stream_options");
  }
  if (request.stream && request.params.logprobs)
    bad("'logprobs' with 'stream' is not supported yet: ask without streaming", "logprobs");
  if (chat && !request.params.json_schema.empty() && body["response_format"]["type"] == "json_schema") {
    // The schema as the client wrote it: its properties' order is the output's (json sorts keys; the body
    // parsed once already, within the bounds, so this second parse is safe)
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(text);
    request.params.json_schema = ordered["response_format"]["json_schema"]["schema"].dump();
  }
  if (chat && !request.tools_json.empty())  // the tools as written: their parameters' order is the calls'
    request.tools_json = nlohmann::ordered_json::parse(text)["tools"].dump();
  return request;
}

}  // namespace

// ---- base64 and data: URIs --------------------------------------------------------------------------------

kvlite::Result<std::string> decode_base64(const std::string& text) {
  auto value = [](unsigned char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.size() % 4 != 0)
    return kvlite::Error(kvlite::ErrorCode::bad_format,
                         "base64: " + std::to_string(text.size()) + " characters is not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    int v[4];
    int padding = 0;
    for (int k = 0; k < 4; k++) {
      const unsigned char c = static_cast<unsigned char>(text[i + size_t(k)]);
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        v[k] = 0;
        padding++;
        continue;
      }
      if (padding > 0 || (v[k] = value(c)) < 0)
        return kvlite::Error(kvlite::ErrorCode::bad_format,
                             "base64: character " + std::to_string(i + size_t(k)) + " is not base64");
    }
    const uint32_t bits = uint32_t(v[0]) << 18 | uint32_t(v[1]) << 12 | uint32_t(v[2]) << 6 | uint32_t(v[3]);
    out.push_back(char(bits >> 16));
    if (padding < 2) out.push_back(char((bits >> 8) & 0xFF));
    if (padding < 1) out.push_back(char(bits & 0xFF));
  }
  return out;
}

kvlite::Result<std::string> decode_data_uri(const std::string& uri) {
  if (uri.rfind("data:", 0) != 0)
    return kvlite::Error(kvlite::ErrorCode::unsupported,
                         "image URLs must be data: URIs (data:image/png;base64,...); kvlite serve fetches nothing");
  const size_t comma = uri.find(',');
  if (comma == std::string::npos) return kvlite::Error(kvlite::ErrorCode::bad_format, "a data: URI without a comma");
  const std::string header = uri.substr(5, comma - 5);
  if (header.size() < 7 || header.compare(header.size() - 7, 7, ";base64") != 0)
    return kvlite::Error(kvlite::ErrorCode::unsupported, "data: URIs must be base64 (data:image/png;base64,...)");
  return decode_base64(uri.substr(comma + 1));
}

int parse_request(bool chat, const std::string& body, const std::string& model_name, int64_t max_tokens_cap,
                  int64_t default_max_tokens, ParsedRequest* out, std::string* message) {
  const RequestLimits limits{model_name, std::max<int64_t>(max_tokens_cap, 1), std::max<int64_t>(default_max_tokens, 1)};
  try {
    ParsedRequest request = read_request(chat, body, limits);
    if (out) *out = std::move(request);
    return 200;
  } catch (const HttpError& e) {
    if (message) *message = e.message;
    return e.status;
  }
}

int check_request(bool chat, const std::string& body, const std::string& model_name, int64_t max_tokens_cap,
                  std::string* message) {
  return parse_request(chat, body, model_name, max_tokens_cap, 256, nullptr, message);
}

kvlite::Result<std::string> render_chat(const kvlite::Tokenizer& tokenizer, const ParsedRequest& request,
                                        bool add_generation_prompt) {
  if (tokenizer.has_chat_template()) {
    // the tools reach the template as transformers passes them (the template writes their descriptions and
    // its tool-call instructions); tool_choice none still lists them, as vLLM does
    const std::string extra = request.tools_json.empty() ? "{}" : "{\"tools\": " + request.tools_json + "}";
    return tokenizer.apply_chat_template(request.template_messages, add_generation_prompt, extra);
  }
  return tokenizer.format_chat(request.messages, add_generation_prompt);
}

kvlite::ToolCallSyntax tool_syntax(const kvlite::Tokenizer& tokenizer) {
  return kvlite::tool_call_syntax_of(tokenizer.has_chat_template() ? tokenizer.chat_template() : std::string());
}

// The answer's tool calls (OpenAI's message.tool_calls), and its content without them; none when the request
// had no tools, or tool_choice none.
bool tool_calls_on(const ParsedRequest& request) { return !request.tools_json.empty() && request.tool_choice != "none"; }

json answer_tool_calls(bool tools_on, kvlite::ToolCallSyntax syntax, std::string& content) {
  json calls = json::array();
  if (!tools_on) return calls;
  kvlite::ParsedToolCalls parsed = kvlite::parse_tool_calls(content, syntax);
  if (parsed.calls.empty()) return calls;
  for (const kvlite::ToolCall& call : parsed.calls)
    calls.push_back({{"id", fresh_id("call_")}, {"type", "function"},
                     {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
  content = parsed.content;
  return calls;
}

kvlite::Result<kvlite::RequestId> submit_request(kvlite::Engine& engine, const ParsedRequest& request,
                                                 const kvlite::TokenCallback& on_token, int64_t* prompt_tokens) {
  std::vector<int32_t> ids;
  kvlite::SamplingParams params = request.params;
  if (request.chat && !request.tools_json.empty() && request.tool_choice != "none" && request.tool_choice != "auto") {
    // required, or a named function: the output is calls, in the syntax the model's template writes
    kvlite::Result<std::string> gbnf = kvlite::tool_calls_gbnf(request.tools_json, tool_syntax(engine.tokenizer()),
                                                               request.tool_choice == "required" ? "" : request.tool_choice,
                                                               request.parallel_tool_calls);
    if (!gbnf) return gbnf.error();
    params.grammar = std::move(*gbnf);
  }
  if (request.chat) {
    kvlite::Result<std::string> prompt = render_chat(engine.tokenizer(), request, true);
    if (!prompt) return prompt.error();
    kvlite::Result<std::vector<int32_t>> encoded = engine.tokenize(*prompt, false);
    if (!encoded) return encoded.error();
    ids = std::move(*encoded);
  } else {
    kvlite::Result<std::vector<int32_t>> encoded = engine.tokenize(request.prompt, true);
    if (!encoded) return encoded.error();
    ids = std::move(*encoded);
  }
  std::vector<kvlite::VisionInput> inputs;
  for (const kvlite::Image& image : request.images) {
    kvlite::Result<kvlite::VisionInput> input = engine.preprocess(image);
    if (!input) return input.error();
    inputs.push_back(std::move(*input));
  }
  kvlite::Result<kvlite::RequestId> id = engine.submit(ids, inputs, params, on_token);
  if (id && prompt_tokens) *prompt_tokens = int64_t(ids.size());
  return id;
}

// ---- the server -------------------------------------------------------------------------------------------

namespace {
// A Prometheus histogram (cumulative buckets, seconds), vLLM's bucket bounds for its latency histograms.
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;  // per bucket (not cumulative), plus +Inf last
  double sum = 0;
  int64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double seconds) {
    size_t i = 0;
    while (i < bounds.size() && seconds > bounds[i]) i++;
    counts[i]++;
    sum += seconds;
    count++;
  }
};

// The server-side TCP connections of this process on `port` (accepted sockets, not the listening one).
std::vector<int> connections_on(int port) {
  std::vector<int> found;
  DIR* fds = opendir("/proc/self/fd");
  if (!fds) return found;
  while (dirent* entry = readdir(fds)) {
    const int fd = atoi(entry->d_name);
    if (fd <= 2) continue;
    int type = 0, listening = 0;
    socklen_t length = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM) continue;
    length = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 || listening) continue;
    sockaddr_storage address{};
    socklen_t address_length = sizeof address;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &address_length) != 0) continue;
    int bound = -1;
    if (address.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
    if (address.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
    if (bound == port) found.push_back(fd);
  }
  closedir(fds);
  return found;
}

// Set on the threads that serve connections over --max-connections: their requests get a 503 and the connection
// closes, without reading a body.
thread_local bool g_over_connection_cap = false;

// cpp-httplib's task queue, with a cap: each task is one connection for its whole life (requests, keep-alive
// waits), so `cap` worker threads serve at most `cap` connections at once and a slow or idle client holds only
// its own. Connections beyond the cap go to a small lane of their own, where each request is refused (503,
// Connection: close) instead of waiting behind the others.
class ConnectionPool : public httplib::TaskQueue {
 public:
  ConnectionPool(size_t cap, size_t refusal_threads) : cap_(cap) {
    for (size_t i = 0; i < cap; i++) threads_.emplace_back([this] { work(jobs_, jobs_ready_, false); });
    for (size_t i = 0; i < refusal_threads; i++) threads_.emplace_back([this] { work(refused_, refused_ready_, true); });
  }
  // One connection wakes one idle thread of its lane: waking all of them (hundreds) for each accepted connection
  // made a burst of 200 connections take 0.8 s to accept on 2 busy cores, and the next client waited behind it.
  void enqueue(std::function<void()> fn) override {
    bool main_lane = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      main_lane = open_ < cap_;
      if (main_lane) {
        open_++;
        jobs_.push_back(std::move(fn));
      } else {
        refused_.push_back(std::move(fn));
      }
    }
    (main_lane ? jobs_ready_ : refused_ready_).notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      shutdown_ = true;
    }
    jobs_ready_.notify_all();
    refused_ready_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

 private:
  void work(std::deque<std::function<void()>>& queue, std::condition_variable& ready, bool refusing) {
    g_over_connection_cap = refusing;
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready.wait(lock, [&] { return shutdown_ || !queue.empty(); });
        if (queue.empty()) return;  // shutting down, nothing left
        fn = std::move(queue.front());
        queue.pop_front();
      }
      fn();  // the connection, until it closes
      if (!refusing) {
        std::lock_guard<std::mutex> lock(mutex_);
        open_--;
      }
    }
  }
  const size_t cap_;
  size_t open_ = 0;  // connections queued or served in the main lane
  bool shutdown_ = false;
  std::mutex mutex_;
  std::condition_variable jobs_ready_, refused_ready_;
  std::deque<std::function<void()>> jobs_, refused_;
  std::vector<std::thread> threads_;
};

// --request-deadline. The read timeout bounds each read of a request, not their sum: a client sending a byte
// within each one held its connection (and its thread) forever. A watchdog scans the server's connections every
// 100 ms: one that waits for a request (since it opened, or since its last answer was sent) for longer than the
// deadline is shut down, so that httplib's blocked read fails and the connection closes. httplib does not say
// which socket a handler serves; the handlers report by the client's address and port, which the watchdog
// matches to a socket with getpeername.
std::string peer_key(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "";
  char host[INET6_ADDRSTRLEN] = "";
  int port = 0;
  if (address.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

std::string peer_key(const httplib::Request& request) {
  return request.remote_addr + ":" + std::to_string(request.remote_port);
}

class RequestDeadlines {
 public:
  explicit RequestDeadlines(int64_t seconds) : deadline_(std::chrono::seconds(seconds)) {}
  ~RequestDeadlines() { stop(); }
  void start(int port) {
    port_ = port;
    watchdog_ = std::thread([this] { watch(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }
  // From a handler: its request has arrived whole (no deadline while it is answered), or its answer is sent.
  void arrived(const std::string& peer) { report(peer, false); }
  void answered(const std::string& peer) { report(peer, true); }

 private:
  struct State {
    bool waiting = true;
    std::chrono::steady_clock::time_point since;
  };
  struct Connection {
    std::string peer;
    State state;
    bool cut = false;
  };
  void report(const std::string& peer, bool waiting) {
    std::lock_guard<std::mutex> lock(mutex_);
    reports_[peer] = {waiting, std::chrono::steady_clock::now()};
  }
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      changed_.wait_for(lock, std::chrono::milliseconds(100));
      if (stopping_) break;
      const auto now = std::chrono::steady_clock::now();
      std::map<int, Connection> current;
      std::map<std::string, State> reports;
      for (int fd : connections_on(port_)) {
        const std::string peer = peer_key(fd);
        if (peer.empty()) continue;
        auto known = connections_.find(fd);
        Connection c = known != connections_.end() && known->second.peer == peer
                           ? known->second
                           : Connection{peer, {true, now}, false};  // new: it waits for its first request
        auto reported = reports_.find(peer);
        if (reported != reports_.end()) {
          c.state = reported->second;
          reports.insert(*reported);  // kept while its connection lives
        }
        if (c.state.waiting && !c.cut && now - c.state.since > deadline_ && peer_key(fd) == peer) {
          ::shutdown(fd, SHUT_RDWR);
          c.cut = true;
        }
        current.emplace(fd, std::move(c));
      }
      connections_ = std::move(current);
      reports_ = std::move(reports);
    }
  }
  const std::chrono::steady_clock::duration deadline_;
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::map<int, Connection> connections_;    // the watchdog's, by socket
  std::map<std::string, State> reports_;     // the handlers', by peer
  std::thread watchdog_;
};

// Set while a connection's thread streams an answer: it counts as sent when the stream ends, not when the
// handler returns.
thread_local bool g_streaming_answer = false;

// Equal strings, in a time that depends only on their lengths (an API key is not guessed byte by byte).
bool constant_time_equal(const std::string& a, const std::string& b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; i++) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= static_cast<unsigned char>(x ^ y);
  }
  return difference == 0;
}
}  // namespace

struct OpenAIServer::Impl {
  std::unique_ptr<kvlite::Engine> engine;
  ServeOptions options;
  RequestLimits limits;
  std::unique_ptr<RequestDeadlines> deadlines;
  httplib::Server http;
  int port = 0;

  // Jobs from HTTP threads, in arrival order; the engine thread drains them.
  std::mutex queue_mutex;
  std::condition_variable queue_changed;
  std::deque<Job> incoming;
  int64_t in_flight = 0;  // incoming + submitted, under queue_mutex
  bool draining = false;  // SIGTERM: no new requests; those in flight finish (up to --shutdown-timeout)
  bool stopping = false;  // the engine thread ends, cancelling what is left
  std::multiset<int> busy_connections;  // sockets whose generation request is still being answered
  // When each connection's handler last let go of it: cpp-httplib writes a non-streamed answer after its handler
  // returns and drops it if the socket's reading side is shut by then, so a drain leaves it a grace period.
  std::map<int, std::chrono::steady_clock::time_point> released_at;
  std::deque<std::function<void(kvlite::Engine&)>> tasks;  // work for the engine thread (tokenize, ...)
  std::thread engine_thread;

  mutable std::mutex stats_mutex;
  ServeStats counters;
  double busy_seconds = 0;
  int64_t running_now = 0;  // requests in the engine (running or preempted), for running / waiting
  std::map<std::string, int64_t> finished_by_reason;
  Histogram time_to_first_token{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0}};
  Histogram inter_token_latency{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0}};
  Histogram end_to_end_latency{{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0}};

  // ---- the engine thread ----
  struct Active {
    std::shared_ptr<Channel> channel;
  };

  void engine_loop() {
    std::map<kvlite::RequestId, Active> active;
    std::deque<std::function<void(kvlite::Engine&)>> work;
    for (;;) {
      std::deque<Job> jobs;
      {
        std::unique_lock<std::mutex> lock(queue_mutex);
        queue_changed.wait(lock, [&] { return stopping || !incoming.empty() || !active.empty() || !tasks.empty(); });
        if (stopping) break;
        jobs.swap(incoming);
        work.swap(tasks);
      }
      for (auto& task : work) task(*engine);
      work.clear();
      for (Job& job : jobs) submit(job, active);
      if (active.empty()) continue;
      const auto start = std::chrono::steady_clock::now();
      kvlite::Result<bool> stepped = engine->step();
      if (options.test_step_delay_us > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(options.test_step_delay_us));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!stepped) {  // every request in flight was dropped by the engine: each client hears why
        for (auto& [id, a] : active) a.channel->fail(from_kvlite(stepped.error()));
        release(active.size());
        active.clear();
      }
      // Finished requests leave the engine first and the counters are brought up to date; only then do their
      // clients hear, so that whatever a client reads next (/metrics) already counts its request as done.
      std::vector<std::pair<std::shared_ptr<Channel>, kvlite::Result<kvlite::Generation>>> finished;
      for (auto it = active.begin(); it != active.end();) {
        if (!engine->finished(it->first)) {
          ++it;
          continue;
        }
        finished.emplace_back(it->second.channel, engine->result(it->first));
        it = active.erase(it);
      }
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        const auto now = std::chrono::steady_clock::now();
        for (const auto& [channel, result] : finished) {
          if (result) {
            counters.tokens_generated_total += int64_t(result->ids.size());
            // the prompt as the engine ran it: each image's tokens included
            counters.prompt_tokens_total += int64_t(result->prompt_ids.size());
            finished_by_reason[channel->abandoned.load() ? "abort" : finish_reason_text(result->finish_reason)]++;
          } else {
            finished_by_reason["abort"]++;
          }
          end_to_end_latency.observe(std::chrono::duration<double>(now - channel->queued_at).count());
          if (channel->abandoned.load()) counters.requests_abandoned++;
        }
      }
      update_stats(active.size(), seconds);
      release(finished.size());
      for (auto& [channel, result] : finished) {
        if (result)  // usage counts the prompt as the engine ran it: each image's tokens included
          channel->finish(result->finish_reason, int64_t(result->prompt_ids.size()), int64_t(result->ids.size()),
                          token_logprobs(*result, channel->chat));
        else
          channel->fail(from_kvlite(result.error()));
      }
    }
    // Stopping: nobody waits for an answer any more, but the pages go back.
    for (auto& [id, a] : active) {
      (void)engine->cancel(id);
      a.channel->fail({503, "the server is stopping", "", "server_error", "stopping"});
    }
  }

  void release(size_t n) {
    std::lock_guard<std::mutex> lock(queue_mutex);
    in_flight -= int64_t(n);
  }

  // A generation's tokens and their log-probabilities as OpenAI's endpoints write them (null when not asked):
  // chat {"content": [{"token", "logprob", "bytes", "top_logprobs": []}]}, completions {"tokens",
  // "token_logprobs", "top_logprobs": null, "text_offset"}. A token's text is its bytes (a piece of a character
  // is written with U+FFFD); the stop token that ended it is included, as its id is.
  json token_logprobs(const kvlite::Generation& generation, bool chat) const {
    if (generation.logprobs.empty()) return nullptr;
    json content = json::array(), tokens = json::array(), values = json::array(), offsets = json::array();
    size_t offset = 0;
    for (size_t i = 0; i < generation.ids.size() && i < generation.logprobs.size(); i++) {
      const std::string bytes = engine->tokenizer().token_bytes(generation.ids[i]);
      json byte_list = json::array();
      for (unsigned char c : bytes) byte_list.push_back(int(c));
      content.push_back({{"token", bytes}, {"logprob", generation.logprobs[i]}, {"bytes", byte_list},
                         {"top_logprobs", json::array()}});
      tokens.push_back(bytes);
      values.push_back(generation.logprobs[i]);
      offsets.push_back(offset);
      offset += bytes.size();
    }
    if (chat) return {{"content", content}};
    return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", nullptr}, {"text_offset", offsets}};
  }

  void submit(Job& job, std::map<kvlite::RequestId, Active>& active) {
    std::shared_ptr<Channel> channel = job.channel;
    auto fail = [&](const kvlite::Error& error) {
      channel->fail(from_kvlite(error));
      release(1);
    };
    if (channel->abandoned.load()) {  // its client left while it queued: it never reaches the engine
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        counters.requests_abandoned++;
      }
      return fail(kvlite::Error(kvlite::ErrorCode::cancelled, "the client went away"));
    }
    auto on_token = [this, channel](const std::string& piece, int32_t) {
      const auto now = std::chrono::steady_clock::now();
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        if (!channel->had_token)
          time_to_first_token.observe(std::chrono::duration<double>(now - channel->queued_at).count());
        else
          inter_token_latency.observe(std::chrono::duration<double>(now - channel->last_token_at).count());
      }
      channel->had_token = true;  // the engine thread alone reads and writes these two
      channel->last_token_at = now;
      if (!piece.empty()) channel->push(piece);
      return !channel->abandoned.load();  // a client that went away ends its request: its pages go back
    };
    kvlite::Result<kvlite::RequestId> id = submit_request(*engine, job.request, on_token);
    if (!id) return fail(id.error());
    active[*id] = Active{channel};
    channel->accept();
  }

  void update_stats(size_t running, double step_seconds) {
    const kvlite::EngineStats engine_stats = engine->stats();
    const kvlite::KVPagePool::Stats pages = engine->arena().kv().stats();
    std::lock_guard<std::mutex> lock(stats_mutex);
    busy_seconds += step_seconds;
    running_now = int64_t(running);
    counters.kv_pages_used = pages.used_pages;
    counters.kv_pages_free = pages.free_pages;
    counters.kv_pages_cached = pages.cached_pages;
    counters.prefix_tokens_reused_total = engine_stats.prefix_tokens_reused;
    counters.preemptions_total = engine_stats.preemptions;
    counters.tokens_per_second = busy_seconds > 0 ? double(counters.tokens_generated_total) / busy_seconds : 0;
  }

  // ---- HTTP threads ----

  // Marks a connection as answering a generation request, so that a drain leaves it open until it is answered.
  struct Busy {
    Impl& impl;
    int fd;
    Busy(Impl& i, int f) : impl(i), fd(f) {
      std::lock_guard<std::mutex> lock(impl.queue_mutex);
      impl.busy_connections.insert(fd);
    }
    ~Busy() {
      if (fd != -2) impl.unbusy(fd);
    }
    int release() {  // a streamed answer is written after the handler returns: its end unmarks it
      const int f = fd;
      fd = -2;
      return f;
    }
  };
  void unbusy(int fd) {
    std::lock_guard<std::mutex> lock(queue_mutex);
    auto it = busy_connections.find(fd);
    if (it != busy_connections.end()) busy_connections.erase(it);
    released_at[fd] = std::chrono::steady_clock::now();
  }

  // Queues a job, or says why not (503 when the queue is full).
  void enqueue(Job job) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      if (stopping || draining) throw HttpError{503, "the server is shutting down", "", "server_error", "stopping"};
      if (in_flight >= options.max_queue) {
        std::lock_guard<std::mutex> stats_lock(stats_mutex);
        counters.requests_rejected++;
        throw HttpError{503,
                        "the server has " + std::to_string(in_flight) + " requests in flight, its queue's limit (" +
                            std::to_string(options.max_queue) + "); retry later",
                        "", "server_error", "queue_full"};
      }
      in_flight++;
      incoming.push_back(std::move(job));
    }
    {
      std::lock_guard<std::mutex> stats_lock(stats_mutex);
      counters.requests_total++;
    }
    queue_changed.notify_all();
  }

  static void send_error(httplib::Response& response, const HttpError& e) {
    response.status = e.status;
    response.set_content(error_body(e).dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  // Waits for the whole answer (not streamed), watching the client: one that goes away ends its request at its
  // next token (or before it starts), which frees its pages.
  void answer(const Job& job, const ClientSocket& client, httplib::Response& response, bool chat) {
    Channel& channel = *job.channel;
    std::unique_lock<std::mutex> lock(channel.mutex);
    while (!channel.changed.wait_for(lock, kClientPollInterval, [&] { return channel.done; }))
      if (!channel.abandoned.load() && client.gone()) channel.abandoned.store(true);
    if (channel.error) return send_error(response, *channel.error);
    std::string text;
    for (const std::string& piece : channel.pieces) text += piece;
    json choice = {{"index", 0}, {"finish_reason", finish_reason_text(channel.finish_reason)}};
    const json calls = chat ? answer_tool_calls(channel.tools_on, tool_syntax(engine->tokenizer()), text)
                            : json::array();
    if (chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
    else choice["text"] = text;
    if (!calls.empty()) {  // OpenAI's form: content null when the answer is only calls
      if (text.empty()) choice["message"]["content"] = nullptr;
      choice["message"]["tool_calls"] = calls;
      choice["finish_reason"] = "tool_calls";
    }
    choice["logprobs"] = channel.logprobs;  // null unless asked for
    json body = {{"id", fresh_id(chat ? "chatcmpl-" : "cmpl-")},
                 {"object", chat ? "chat.completion" : "text_completion"},
                 {"created", now_seconds()},
                 {"model", options.model_name},
                 {"choices", json::array({choice})},
                 {"usage",
                  {{"prompt_tokens", channel.prompt_tokens},
                   {"completion_tokens", channel.completion_tokens},
                   {"total_tokens", channel.prompt_tokens + channel.completion_tokens}}}};
    response.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  }

  // Server-sent events: a chunk per piece of text, a last chunk with the finish reason (and usage when asked),
  // then [DONE]. A write that fails means the client went away: the request ends at its next token.
  // While it waits for the next piece it watches the client's socket too, so a client that goes away during a
  // long prefill is noticed before a write fails.
  void stream(const Job& job, std::shared_ptr<const ClientSocket> client, httplib::Response& response, bool chat,
              bool include_usage, int busy_fd, const std::string& peer) {
    std::shared_ptr<Channel> channel = job.channel;
    const std::string id = fresh_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = now_seconds();
    const std::string model = options.model_name;
    // With tools the text may be calls: it is held to the end, then sent as content or as tool_calls deltas
    const bool tools_on = chat && channel->tools_on;
    const kvlite::ToolCallSyntax syntax = tool_syntax(engine->tokenizer());
    auto chunk = [=](const json& delta_or_text, const json& finish_reason) {
      json choice = {{"index", 0}, {"finish_reason", finish_reason}};
      if (chat) choice["delta"] = delta_or_text;
      else choice["text"] = delta_or_text;
      return json{{"id", id},
                  {"object", chat ? "chat.completion.chunk" : "text_completion"},
                  {"created", created},
                  {"model", model},
                  {"choices", json::array({choice})}};
    };
    response.set_header("Cache-Control", "no-cache");
    response.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
      auto send = [&](const json& event) {
        const std::string line = "data: " + event.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
        return sink.write(line.data(), line.size());
      };
      bool first = true;
      std::string held;  // tools_on: the text so far
      for (;;) {
        std::deque<std::string> pieces;
        bool done = false;
        {
          std::unique_lock<std::mutex> lock(channel->mutex);
          while (!channel->changed.wait_for(lock, kClientPollInterval,
                                            [&] { return channel->done || !channel->pieces.empty(); })) {
            if (client->gone()) {
              channel->abandoned.store(true);
              return false;
            }
          }
          pieces.swap(channel->pieces);
          done = channel->done;
        }
        for (const std::string& piece : pieces) {
          if (tools_on) {
            held += piece;
            continue;
          }
          json delta = chat ? json{{"content", piece}} : json(piece);
          if (chat && first) delta["role"] = "assistant";
          first = false;
          if (!send(chunk(delta, nullptr))) {
            channel->abandoned.store(true);
            return false;
          }
        }
        if (!done) continue;
        if (channel->error) {
          send(error_body(*channel->error));
        } else {
          json finish = finish_reason_text(channel->finish_reason);
          if (tools_on) {
            const json calls = answer_tool_calls(true, syntax, held);
            json delta = {{"role", "assistant"}};
            if (!held.empty() || calls.empty()) delta["content"] = held;
            if (!calls.empty()) {
              json indexed = calls;
              for (size_t i = 0; i < indexed.size(); i++) indexed[i]["index"] = i;  // the streamed form's index
              delta["tool_calls"] = indexed;
              finish = "tool_calls";
            }
            if (!send(chunk(delta, nullptr))) {
              channel->abandoned.store(true);
              return false;
            }
          }
          json last = chunk(chat ? json::object() : json(""), finish);
          if (!send(last)) {
            channel->abandoned.store(true);
            return false;
          }
          if (include_usage) {  // OpenAI's form: one more chunk, with no choices and the usage
            json usage = chunk(nullptr, nullptr);
            usage["choices"] = json::array();
            usage["usage"] = {{"prompt_tokens", channel->prompt_tokens},
                              {"completion_tokens", channel->completion_tokens},
                              {"total_tokens", channel->prompt_tokens + channel->completion_tokens}};
            if (!send(usage)) {
              channel->abandoned.store(true);
              return false;
            }
          }
        }
        const std::string end = "data: [DONE]\n\n";
        sink.write(end.data(), end.size());
        sink.done();
        return true;
      }
    }, [this, channel, busy_fd, peer](bool success) {
      if (!success) channel->abandoned.store(true);  // the connection ended before the stream did
      unbusy(busy_fd);
      g_streaming_answer = false;
      deadlines->answered(peer);  // the stream has ended: the connection waits for its next request from here
    });
    g_streaming_answer = true;
  }

  void handle_generation(const httplib::Request& request, httplib::Response& response, bool chat) {
    try {
      Job job;
      job.request = read_request(chat, request.body, limits);
      const bool streaming = job.request.stream, include_usage = job.request.include_usage;
      job.channel = std::make_shared<Channel>();
      job.channel->chat = chat;
      job.channel->tools_on = chat && tool_calls_on(job.request);
      Job waiting_for{};
      waiting_for.channel = job.channel;
      auto client = std::make_shared<const ClientSocket>(request);
      Busy busy(*this, client->fd());  // before it is queued: a drain from here on leaves this connection open
      enqueue(std::move(job));
      if (streaming) {
        // Everything the engine can refuse (a prompt too long, images that cannot fit) is known when it takes
        // the request: until then no byte is sent, so such errors are HTTP statuses, not events.
        Channel& channel = *waiting_for.channel;
        {
          std::unique_lock<std::mutex> lock(channel.mutex);
          while (!channel.changed.wait_for(lock, kClientPollInterval,
                                           [&] { return channel.accepted || channel.done; }))
            if (!channel.abandoned.load() && client->gone()) channel.abandoned.store(true);
          if (!channel.accepted && channel.error) return send_error(response, *channel.error);
        }
        stream(waiting_for, client, response, chat, include_usage, busy.release(), peer_key(request));
      } else {
        answer(waiting_for, *client, response, chat);
      }
    } catch (const HttpError& e) {
      send_error(response, e);
    } catch (const std::exception& e) {
      send_error(response, {500, e.what(), "", "server_error", "internal"});
    }
  }

  std::string metrics_text() const {
    const ServeStats s = stats();
    const std::string label = "model_name=\"" + options.model_name + "\"";
    std::string out;
    auto number = [](double value) {
      char text[64];
      snprintf(text, sizeof text, "%.17g", value);
      return std::string(text);
    };
    auto metric = [&](const char* name, const char* type, const char* help, double value) {
      out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + "{" +
             label + "} " + number(value) + "\n";
    };
    auto histogram = [&](const char* name, const char* help, const Histogram& h) {
      out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
      int64_t cumulative = 0;
      for (size_t i = 0; i <= h.bounds.size(); i++) {
        cumulative += h.counts[i];
        out += std::string(name) + "_bucket{" + label + ",le=\"" + (i < h.bounds.size() ? number(h.bounds[i]) : "+Inf") +
               "\"} " + std::to_string(cumulative) + "\n";
      }
      out += std::string(name) + "_sum{" + label + "} " + number(h.sum) + "\n";
      out += std::string(name) + "_count{" + label + "} " + std::to_string(h.count) + "\n";
    };
    metric("kvlite_requests_running", "gauge", "Requests in the engine's batch (at most --max-seqs).",
           double(s.requests_running));
    metric("kvlite_requests_waiting", "gauge", "Requests queued for the engine or preempted.",
           double(s.requests_waiting));
    metric("kvlite_requests_total", "counter", "Requests accepted.", double(s.requests_total));
    metric("kvlite_requests_rejected_total", "counter", "Requests refused with 503 (queue full).",
           double(s.requests_rejected));
    metric("kvlite_requests_abandoned_total", "counter", "Requests whose client went away first.",
           double(s.requests_abandoned));
    metric("kvlite_kv_pages_used", "gauge", "KV cache pages in use.", double(s.kv_pages_used));
    metric("kvlite_kv_pages_free", "gauge", "KV cache pages free.", double(s.kv_pages_free));
    metric("kvlite_kv_pages_cached", "gauge", "KV cache pages holding a cached prefix (free when unused).",
           double(s.kv_pages_cached));
    metric("kvlite_prefix_tokens_reused_total", "counter", "Prompt tokens taken from the prefix cache.",
           double(s.prefix_tokens_reused_total));
    metric("kvlite_prompt_tokens_total", "counter",
           "Prompt tokens of finished requests as the engine ran them (image tokens included).",
           double(s.prompt_tokens_total));
    metric("kvlite_generation_tokens_total", "counter", "Tokens generated.", double(s.tokens_generated_total));
    metric("kvlite_preemptions_total", "counter", "Requests preempted for KV pages.", double(s.preemptions_total));
    metric("kvlite_generation_tokens_per_second", "gauge", "Tokens generated per second of engine work.",
           s.tokens_per_second);
    std::lock_guard<std::mutex> lock(stats_mutex);
    out += "# HELP kvlite_request_success_total Finished requests by finish reason (stop, length, abort).\n"
           "# TYPE kvlite_request_success_total counter\n";
    for (const char* reason : {"stop", "length", "abort"}) {
      auto it = finished_by_reason.find(reason);
      out += std::string("kvlite_request_success_total{") + label + ",finished_reason=\"" + reason + "\"} " +
             std::to_string(it == finished_by_reason.end() ? 0 : it->second) + "\n";
    }
    histogram("kvlite_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
              time_to_first_token);
    histogram("kvlite_inter_token_latency_seconds", "Time between a request's consecutive tokens.",
              inter_token_latency);
    histogram("kvlite_e2e_request_latency_seconds", "Time from a request's arrival to its end.", end_to_end_latency);
    return out;
  }

  ServeStats stats() const {
    ServeStats s;
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      s = counters;
    }
    // vLLM's meaning: running = in the engine's batch (at most --max-seqs), waiting = queued or preempted.
    const int64_t max_seqs = std::max<int64_t>(engine->plan().options.max_seqs, 1);
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      s.requests_running = std::min(running_now, max_seqs);
      s.requests_waiting = std::max<int64_t>(running_now - max_seqs, 0);
    }
    std::lock_guard<std::mutex> lock(const_cast<Impl*>(this)->queue_mutex);
    s.requests_waiting += int64_t(incoming.size());
    return s;
  }

  // --max-connections, and never fewer than the requests that may be in flight (each waits on its connection)
  int64_t connection_cap() const { return std::max<int64_t>(options.max_connections, options.max_queue + 8); }

  bool origin_allowed(const std::string& origin) const {
    for (const std::string& allowed : options.allowed_origins)
      if (allowed == "*" || allowed == origin) return true;
    return false;
  }

  json model_card() const {
    return {{"id", options.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "kvlite"},
            {"root", options.model_name}, {"max_model_len", engine->plan().max_model_len}};
  }

  // Runs `work` on the engine thread (which owns the engine) and waits for it; 503 when the server stops first.
  void on_engine_thread(std::function<void(kvlite::Engine&)> work) {
    auto done = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
    auto finished = std::make_shared<bool>(false);
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      if (stopping) throw HttpError{503, "the server is shutting down", "", "server_error", "stopping"};
      tasks.push_back([work, done, finished](kvlite::Engine& e) {
        work(e);
        std::lock_guard<std::mutex> lock(done->first);
        *finished = true;
        done->second.notify_all();
      });
    }
    queue_changed.notify_all();
    std::unique_lock<std::mutex> lock(done->first);
    done->second.wait(lock, [&] { return *finished; });
  }

  // vLLM's /tokenize: {"prompt"} (add_special_tokens, default true) or {"messages"} (add_generation_prompt,
  // default true, as the chat endpoint formats them) -> {"count", "max_model_len", "tokens"}.
  void handle_tokenize(const httplib::Request& q, httplib::Response& r) {
    try {
      const json body = parse_body(q.body, limits);
      for (auto it = body.begin(); it != body.end(); ++it)
        if (it.key() != "model" && it.key() != "prompt" && it.key() != "messages" && it.key() != "add_special_tokens" &&
            it.key() != "add_generation_prompt")
          bad("'" + it.key() + "' is not a field /tokenize reads", it.key());
      std::optional<ParsedRequest> chat;
      std::string prompt;
      bool add_special = true, add_generation_prompt = true;
      if (body.contains("add_special_tokens") && !body["add_special_tokens"].is_boolean())
        bad("'add_special_tokens' must be a boolean", "add_special_tokens");
      if (body.contains("add_generation_prompt") && !body["add_generation_prompt"].is_boolean())
        bad("'add_generation_prompt' must be a boolean", "add_generation_prompt");
      if (body.contains("add_special_tokens")) add_special = body["add_special_tokens"].get<bool>();
      if (body.contains("add_generation_prompt")) add_generation_prompt = body["add_generation_prompt"].get<bool>();
      if (body.contains("messages")) {
        json chat_body = {{"messages", body["messages"]}};
        chat = chat_job(chat_body, limits);
      } else if (body.contains("prompt") && body["prompt"].is_string()) {
        prompt = body["prompt"].get<std::string>();
      } else {
        bad("/tokenize needs a string 'prompt' or 'messages'", "prompt");
      }
      kvlite::Result<std::vector<int32_t>> ids = kvlite::Error(kvlite::ErrorCode::internal, "not run");
      on_engine_thread([&](kvlite::Engine& e) {
        if (chat) {
          kvlite::Result<std::string> text = render_chat(e.tokenizer(), *chat, add_generation_prompt);
          ids = text ? e.tokenize(*text, false) : kvlite::Result<std::vector<int32_t>>(text.error());
        } else {
          ids = e.tokenize(prompt, add_special);
        }
      });
      if (!ids) throw from_kvlite(ids.error());
      json body_out = {{"count", ids->size()}, {"max_model_len", engine->plan().max_model_len}, {"tokens", *ids}};
      r.set_content(body_out.dump(), "application/json");
    } catch (const HttpError& e) {
      send_error(r, e);
    }
  }

  // vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}.
  void handle_detokenize(const httplib::Request& q, httplib::Response& r) {
    try {
      const json body = parse_body(q.body, limits);
      if (!body.contains("tokens") || !body["tokens"].is_array()) bad("'tokens' must be an array of token ids", "tokens");
      std::vector<int32_t> ids;
      const int64_t vocab = int64_t(engine->tokenizer().vocab_size());
      for (const json& id : body["tokens"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab)
          bad("'tokens' entries must be token ids in 0.." + std::to_string(vocab - 1), "tokens");
        ids.push_back(int32_t(id.get<int64_t>()));
      }
      kvlite::Result<std::string> text = engine->tokenizer().decode(ids, false);  // thread-safe (tokenizer.hpp)
      if (!text) throw from_kvlite(text.error());
      r.set_content(json{{"prompt", *text}}.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    } catch (const HttpError& e) {
      send_error(r, e);
    }
  }

  void routes() {
    http.set_payload_max_length(size_t(options.max_body_bytes));
    // cpp-httplib's 5 s defaults drop a client that a burst keeps waiting for its turn to send or read; an
    // inference server's clients wait longer than that by nature.
    // A client must keep its request coming: each read of its headers or body waits at most --read-timeout.
    http.set_read_timeout(time_t(options.read_timeout_s), 0);
    http.set_write_timeout(60, 0);
    http.set_keep_alive_timeout(60);
    // And the whole request within --request-deadline of its connection being ready for it.
    deadlines = std::make_unique<RequestDeadlines>(options.request_deadline_s);
    http.set_post_routing_handler([this](const httplib::Request& q, httplib::Response&) {
      if (!g_streaming_answer) deadlines->answered(peer_key(q));  // a stream counts as sent when it ends
    });
    // One thread per connection up to --max-connections (so that slow or idle sockets hold only their own, and
    // every request in flight has one while it waits); beyond it, a refusal lane answers 503.
    const size_t cap = size_t(connection_cap());
    http.new_task_queue = [cap] { return new ConnectionPool(cap, 4); };
    // CORS: an allowed Origin is echoed on every answer; a preflight (OPTIONS) is answered here, before any route.
    http.set_pre_routing_handler([this](const httplib::Request& q, httplib::Response& r) {
      if (g_over_connection_cap) {
        r.set_header("Connection", "close");
        r.set_header("Retry-After", "1");
        send_error(r, {503, "the server has " + std::to_string(connection_cap()) +
                                " connections open, its limit (--max-connections); retry later",
                       "", "server_error", "too_many_connections"});
        return httplib::Server::HandlerResponse::Handled;
      }
      const std::string origin = q.get_header_value("Origin");
      const bool allowed = !origin.empty() && origin_allowed(origin);
      if (allowed) {
        r.set_header("Access-Control-Allow-Origin", origin);
        r.set_header("Vary", "Origin");
      }
      // Bodies are read only as sent, with a length: cpp-httplib 0.11 would inflate a compressed body, and read a
      // chunked one, past --max-body-bytes. Refused before a byte of the body is read; the connection closes, so
      // the unread body is never taken for a next request.
      // The answer says "Connection: close" (a client sends nothing more on it), and the connection's reading side
      // is shut: cpp-httplib reads what was already sent of the body and then the end, and closes it.
      auto close_after = [&] {
        r.set_header("Connection", "close");
        const ClientSocket client(q);
        if (client.found()) shutdown(client.fd(), SHUT_RD);
      };
      const std::string encoding = q.get_header_value("Content-Encoding");
      if (!encoding.empty() && encoding != "identity") {
        close_after();
        send_error(r, {415, "Content-Encoding '" + encoding + "' is not accepted: send the body uncompressed", "",
                       "invalid_request_error", "unsupported_media_type"});
        return httplib::Server::HandlerResponse::Handled;
      }
      if (q.has_header("Transfer-Encoding")) {
        r.set_header("Connection", "close");
        send_error(r, {411, "a chunked body is not accepted: send it with a Content-Length (at most --max-body-bytes)",
                       "", "invalid_request_error", "length_required"});
        return httplib::Server::HandlerResponse::Handled;
      }
      if (q.method != "OPTIONS") return httplib::Server::HandlerResponse::Unhandled;
      if (!allowed) {
        send_error(r, {403, "CORS: the origin '" + origin + "' is not allowed (--allowed-origins)", "", "invalid_request_error", ""});
        return httplib::Server::HandlerResponse::Handled;
      }
      r.status = 204;
      r.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      const std::string asked = q.get_header_value("Access-Control-Request-Headers");
      r.set_header("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type" : asked);
      r.set_header("Access-Control-Max-Age", "600");
      return httplib::Server::HandlerResponse::Handled;
    });
    // /v1 routes need the API key when one is set (as vLLM's --api-key guards /v1 only); the body is read by then,
    // so the connection stays usable after a 401.
    // Every route's handler runs once its request has arrived whole: from there the deadline does not apply.
    auto arrived = [this](std::function<void(const httplib::Request&, httplib::Response&)> handler) {
      return [this, handler](const httplib::Request& q, httplib::Response& r) {
        deadlines->arrived(peer_key(q));
        g_streaming_answer = false;
        handler(q, r);
      };
    };
    auto guarded = [this, arrived](std::function<void(const httplib::Request&, httplib::Response&)> handler) {
      return arrived([this, handler](const httplib::Request& q, httplib::Response& r) {
        if (!options.api_key.empty() &&
            !constant_time_equal(q.get_header_value("Authorization"), "Bearer " + options.api_key)) {
          r.set_header("WWW-Authenticate", "Bearer");
          return send_error(r, {401, "a valid API key is needed: Authorization: Bearer <key>", "",
                                "invalid_request_error", "invalid_api_key"});
        }
        handler(q, r);
      });
    };
    http.Post("/v1/chat/completions", guarded([this](const httplib::Request& q, httplib::Response& r) { handle_generation(q, r, true); }));
    http.Post("/v1/completions", guarded([this](const httplib::Request& q, httplib::Response& r) { handle_generation(q, r, false); }));
    http.Get("/v1/models", guarded([this](const httplib::Request&, httplib::Response& r) {
      json body = {{"object", "list"}, {"data", json::array({model_card()})}};
      r.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    }));
    http.Get(R"(/v1/models/(.+))", guarded([this](const httplib::Request& q, httplib::Response& r) {
      const std::string id = q.matches[1];
      if (id != options.model_name)
        return send_error(r, {404, "the model '" + id + "' does not exist; this server serves '" + options.model_name + "'",
                              "model", "invalid_request_error", "model_not_found"});
      r.set_content(model_card().dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    }));
    http.Post("/tokenize", arrived([this](const httplib::Request& q, httplib::Response& r) { handle_tokenize(q, r); }));
    http.Post("/detokenize", arrived([this](const httplib::Request& q, httplib::Response& r) { handle_detokenize(q, r); }));
    http.Get("/version", arrived([](const httplib::Request&, httplib::Response& r) {
      r.set_content(json{{"version", KVLITE_VERSION_STRING}}.dump(), "application/json");
    }));
    http.Get("/health", arrived([](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"status":"ok"})", "application/json");
    }));
    http.Get("/metrics", arrived([this](const httplib::Request&, httplib::Response& r) {
      r.set_content(metrics_text(), "text/plain; version=0.0.4");
    }));
    // httplib's own refusals (an oversized body: 413; an unknown path: 404) get OpenAI's error body too.
    http.set_error_handler([](const httplib::Request& q, httplib::Response& r) {
      if (!r.body.empty()) return;
      HttpError e{r.status, "", "", "invalid_request_error", ""};
      if (r.status == 413 && q.get_header_value("Content-Type").find("x-www-form-urlencoded") != std::string::npos)
        e.message = "a form-encoded body is limited to 8 KiB by cpp-httplib: send Content-Type: application/json";
      else if (r.status == 413)
        e.message = "the request body is larger than the server's limit (--max-body-bytes)";
      else if (r.status == 404) e.message = "no route " + q.method + " " + q.path;
      else e.message = "HTTP " + std::to_string(r.status);
      r.set_content(error_body(e).dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    });
  }
};

OpenAIServer::OpenAIServer() : impl_(new Impl()) {}

OpenAIServer::~OpenAIServer() {
  stop();
  if (impl_->engine_thread.joinable()) impl_->engine_thread.join();
}

kvlite::Result<std::unique_ptr<OpenAIServer>> OpenAIServer::create(std::unique_ptr<kvlite::Engine> engine,
                                                                   const ServeOptions& options) {
  if (!engine) return kvlite::Error(kvlite::ErrorCode::invalid_argument, "serve: no engine");
  if (options.port < 0 || options.port > 65535)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--port " + std::to_string(options.port) + " is outside 0..65535");
  if (options.max_queue < 1 || options.max_queue > 4096)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument,
                         "--max-queue " + std::to_string(options.max_queue) + " is outside 1..4096");
  if (options.max_connections < 1 || options.max_connections > 16384)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--max-connections must be in 1..16384");
  if (options.request_deadline_s < 1 || options.request_deadline_s > 86400)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument,
                         "request_deadline_s must be 1..86400 (kvlite serve --request-deadline), not " +
                             std::to_string(options.request_deadline_s));
  if (options.read_timeout_s < 1 || options.read_timeout_s > 3600)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--read-timeout must be in 1..3600 seconds");
  if (!(options.shutdown_timeout_s >= 0 && options.shutdown_timeout_s <= 3600))
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--shutdown-timeout must be in 0..3600 seconds");
  if (options.max_image_bytes < 1024)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--max-image-bytes must be at least 1024");
  if (options.max_body_bytes < 1024)
    return kvlite::Error(kvlite::ErrorCode::invalid_argument, "--max-body-bytes must be at least 1024");
  std::unique_ptr<OpenAIServer> server(new OpenAIServer());
  Impl& s = *server->impl_;
  s.engine = std::move(engine);
  s.options = options;
  if (s.options.model_name.empty()) s.options.model_name = s.engine->plan().model_name;
  const int64_t model_len = s.engine->plan().max_model_len;
  if (s.options.default_max_tokens < 1) s.options.default_max_tokens = 1;
  s.limits = {s.options.model_name, options.max_tokens > 0 ? std::min(options.max_tokens, model_len) : model_len,
              s.options.default_max_tokens};
  s.limits.max_images = std::max<int64_t>(s.engine->plan().options.max_images, 1);
  s.limits.max_image_bytes = options.max_image_bytes;
  s.routes();
  s.engine_thread = std::thread([&s] { s.engine_loop(); });
  return server;
}

namespace {
// cpp-httplib 0.11 (Debian 12's) listens with a backlog of 5: a burst of clients connecting at once overflows it
// and the kernel drops some of their connections. listen() again on the same socket raises the backlog; the
// library does not expose the socket, so it is found among this process's descriptors by its port.
void raise_listen_backlog(int port) {
  DIR* fds = opendir("/proc/self/fd");
  if (!fds) return;
  while (dirent* entry = readdir(fds)) {
    const int fd = atoi(entry->d_name);
    if (fd <= 2) continue;
    int listening = 0;
    socklen_t length = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 || !listening) continue;
    sockaddr_storage address{};
    socklen_t address_length = sizeof address;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &address_length) != 0) continue;
    int bound = -1;
    if (address.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
    if (address.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
    if (bound == port) listen(fd, SOMAXCONN);
  }
  closedir(fds);
}
}  // namespace

kvlite::Result<int> OpenAIServer::bind() {
  Impl& s = *impl_;
  if (s.options.port == 0) {
    s.port = s.http.bind_to_any_port(s.options.host);
    if (s.port <= 0)
      return kvlite::Error(kvlite::ErrorCode::io_error, "serve: cannot bind " + s.options.host + " to any port");
  } else {
    if (!s.http.bind_to_port(s.options.host, s.options.port))
      return kvlite::Error(kvlite::ErrorCode::io_error, "serve: cannot bind " + s.options.host + ":" +
                                                            std::to_string(s.options.port) +
                                                            " (in use, or not an address of this machine)");
    s.port = s.options.port;
  }
  raise_listen_backlog(s.port);
  s.deadlines->start(s.port);
  return s.port;
}

void OpenAIServer::serve() { impl_->http.listen_after_bind(); }

void OpenAIServer::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.queue_mutex);
    if (s.stopping) return;
    s.draining = true;
  }
  // No new connections. cpp-httplib then ends each connection after its current request, but one that is idle
  // in its keep-alive wait would hold serve() for the whole keep-alive timeout: its reading side is shut down
  // here (a read sees the end at once; an answer still being written is not cut), except for connections whose
  // generation request is still being answered.
  s.http.stop();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(int64_t(std::max(0.0, s.options.shutdown_timeout_s) * 1e6));
  constexpr auto kAnswerGrace = std::chrono::milliseconds(500);  // for an answer to be written after its handler
  for (;;) {
    bool idle = false;
    {
      std::lock_guard<std::mutex> lock(s.queue_mutex);
      const auto now = std::chrono::steady_clock::now();
      bool answers_pending = false;
      for (int fd : connections_on(s.port)) {
        auto released = s.released_at.find(fd);
        const bool writing = released != s.released_at.end() && now - released->second < kAnswerGrace;
        answers_pending = answers_pending || writing;
        if (!s.busy_connections.count(fd) && !writing) shutdown(fd, SHUT_RD);
      }
      idle = s.in_flight == 0 && s.busy_connections.empty() && !answers_pending;
    }
    if (idle || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    std::lock_guard<std::mutex> lock(s.queue_mutex);
    s.stopping = true;  // what is still in flight after the timeout is cancelled (its clients hear 503)
  }
  s.queue_changed.notify_all();
  // Connections still open after the timeout: their reading side goes too, so serve() returns.
  for (int i = 0; i < 100; i++) {
    {
      std::lock_guard<std::mutex> lock(s.queue_mutex);
      if (s.busy_connections.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    std::lock_guard<std::mutex> lock(s.queue_mutex);
    for (int fd : connections_on(s.port)) shutdown(fd, SHUT_RD);
  }
  s.deadlines->stop();
}

ServeStats OpenAIServer::stats() const { return impl_->stats(); }

}  // namespace kvlite_server
