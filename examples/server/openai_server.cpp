// openai_server: see openai_server.hpp. Public kvlite API only.
#include "openai_server.hpp"

#include <httplib.h>
#include <dirent.h>
#include <netdb.h>
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
#include <map>
#include <mutex>
#include <optional>
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
    case kvlite::FinishReason::stop_string: return "stop";
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
  std::optional<HttpError> error;
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

// Sampling fields shared by both endpoints.
kvlite::SamplingParams sampling_of(const json& body, int64_t max_tokens_cap, int64_t default_max_tokens) {
  kvlite::SamplingParams params;
  const int64_t fallback = std::min(default_max_tokens, max_tokens_cap);
  params.max_tokens = integer_field(body, "max_tokens", 1, max_tokens_cap, fallback);
  params.max_tokens = integer_field(body, "max_completion_tokens", 1, max_tokens_cap, params.max_tokens);
  params.temperature = float(number_field(body, "temperature", 0.0, 2.0, 0.0));
  params.top_p = float(number_field(body, "top_p", 0.0, 1.0, 1.0));
  if (body.contains("top_p") && params.top_p <= 0.0f) bad("'top_p' must be greater than 0", "top_p");
  const int64_t top_k = integer_field(body, "top_k", -1, int64_t(1) << 30, 0);
  params.top_k = top_k < 0 ? 0 : top_k;
  params.min_p = float(number_field(body, "min_p", 0.0, 1.0, 0.0));
  params.repetition_penalty = float(number_field(body, "repetition_penalty", 0.01, 100.0, 1.0));
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) bad("'seed' must be an integer", "seed");
    params.seed = uint64_t(body["seed"].get<int64_t>());
  }
  if (body.contains("ignore_eos") && !body["ignore_eos"].is_null()) {  // vLLM's extension, for benchmarks
    if (!body["ignore_eos"].is_boolean()) bad("'ignore_eos' must be a boolean", "ignore_eos");
    params.ignore_eos = body["ignore_eos"].get<bool>();
  }
  if (body.contains("n") && !body["n"].is_null() && integer_field(body, "n", 1, 1, 1) != 1) bad("'n' must be 1", "n");
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

kvlite::Image image_of(const json& part, size_t message) {
  const std::string where = "messages[" + std::to_string(message) + "].content";
  if (!part.contains("image_url")) bad("an image_url part needs 'image_url'", where);
  const json& image_url = part["image_url"];
  std::string url;
  if (image_url.is_string()) url = image_url.get<std::string>();
  else if (image_url.is_object() && image_url.contains("url") && image_url["url"].is_string())
    url = image_url["url"].get<std::string>();
  else bad("'image_url' must be an object with a string 'url'", where);
  kvlite::Result<std::string> bytes = decode_data_uri(url);
  if (!bytes) bad(bytes.error().message, where);
  kvlite::Result<kvlite::Image> image =
      kvlite::decode_image(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size());
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

// What a request is checked against.
struct RequestLimits {
  std::string model_name;
  int64_t max_tokens_cap = 0;
  int64_t default_max_tokens = 256;
};

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

ParsedRequest chat_job(const json& body, const RequestLimits& limits) {
  ParsedRequest job;
  job.chat = true;
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    bad("'messages' must be a non-empty array", "messages");
  size_t index = 0;
  for (const json& m : body["messages"]) {
    const std::string where = "messages[" + std::to_string(index) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad(where + " must be an object with a string 'role'", where);
    kvlite::ChatMessage message{m["role"].get<std::string>(), ""};
    const json& content = m.contains("content") ? m["content"] : json(nullptr);
    if (content.is_string()) {
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
          job.images.push_back(image_of(part, index));
          message.content += kvlite::kImagePlaceholder;
        } else {
          bad("content part type '" + type + "' is not supported (text, image_url)", where + ".content");
        }
      }
    } else {
      bad(where + ".content must be a string or an array of parts", where + ".content");
    }
    job.messages.push_back(std::move(message));
    index++;
  }
  job.params = sampling_of(body, limits.max_tokens_cap, limits.default_max_tokens);
  // OpenAI's chat form: "logprobs": true, with "top_logprobs" (the alternatives at each token) 0 or absent
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    if (!body["logprobs"].is_boolean()) bad("'logprobs' must be a boolean", "logprobs");
    job.params.logprobs = body["logprobs"].get<bool>();
  }
  if (integer_field(body, "top_logprobs", 0, 20, 0) > 0)
    bad("'top_logprobs' above 0 is not supported (each token's own log-probability is: 'logprobs': true)",
        "top_logprobs");
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
  ParsedRequest request = chat ? chat_job(body, limits) : completion_job(body, limits);
  request.stream = stream_of(body);
  if (body.contains("stream_options") && body["stream_options"].is_object() &&
      body["stream_options"].contains("include_usage"))
    request.include_usage = body["stream_options"]["include_usage"].is_boolean() &&
                            body["stream_options"]["include_usage"].get<bool>();
  if (request.stream && request.params.logprobs)
    bad("'logprobs' with 'stream' is not supported yet: ask without streaming", "logprobs");
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

kvlite::Result<kvlite::RequestId> submit_request(kvlite::Engine& engine, const ParsedRequest& request,
                                                 const kvlite::TokenCallback& on_token, int64_t* prompt_tokens) {
  std::vector<int32_t> ids;
  if (request.chat) {
    kvlite::Result<std::string> prompt = engine.tokenizer().format_chat(request.messages, true);
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
  kvlite::Result<kvlite::RequestId> id = engine.submit(ids, inputs, request.params, on_token);
  if (id && prompt_tokens) *prompt_tokens = int64_t(ids.size());
  return id;
}

// ---- the server -------------------------------------------------------------------------------------------

struct OpenAIServer::Impl {
  std::unique_ptr<kvlite::Engine> engine;
  ServeOptions options;
  RequestLimits limits;
  httplib::Server http;
  int port = 0;

  // Jobs from HTTP threads, in arrival order; the engine thread drains them.
  std::mutex queue_mutex;
  std::condition_variable queue_changed;
  std::deque<Job> incoming;
  int64_t in_flight = 0;  // incoming + submitted, under queue_mutex
  bool stopping = false;
  std::thread engine_thread;

  mutable std::mutex stats_mutex;
  ServeStats counters;
  double busy_seconds = 0;

  // ---- the engine thread ----
  struct Active {
    std::shared_ptr<Channel> channel;
  };

  void engine_loop() {
    std::map<kvlite::RequestId, Active> active;
    for (;;) {
      std::deque<Job> jobs;
      {
        std::unique_lock<std::mutex> lock(queue_mutex);
        queue_changed.wait(lock, [&] { return stopping || !incoming.empty() || !active.empty(); });
        if (stopping) break;
        jobs.swap(incoming);
      }
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
        for (const auto& [channel, result] : finished) {
          if (result) counters.tokens_generated_total += int64_t(result->ids.size());
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
    auto on_token = [channel](const std::string& piece, int32_t) {
      if (!piece.empty()) channel->push(piece);
      return !channel->abandoned.load();  // a client that went away ends its request: its pages go back
    };
    int64_t prompt_tokens = 0;
    kvlite::Result<kvlite::RequestId> id = submit_request(*engine, job.request, on_token, &prompt_tokens);
    if (!id) return fail(id.error());
    active[*id] = Active{channel};
    std::lock_guard<std::mutex> lock(stats_mutex);
    counters.prompt_tokens_total += prompt_tokens;
  }

  void update_stats(size_t running, double step_seconds) {
    const kvlite::EngineStats engine_stats = engine->stats();
    const kvlite::KVPagePool::Stats pages = engine->arena().kv().stats();
    std::lock_guard<std::mutex> lock(stats_mutex);
    busy_seconds += step_seconds;
    counters.requests_running = int64_t(running);
    counters.kv_pages_used = pages.used_pages;
    counters.kv_pages_free = pages.free_pages;
    counters.kv_pages_cached = pages.cached_pages;
    counters.prefix_tokens_reused_total = engine_stats.prefix_tokens_reused;
    counters.preemptions_total = engine_stats.preemptions;
    counters.tokens_per_second = busy_seconds > 0 ? double(counters.tokens_generated_total) / busy_seconds : 0;
  }

  // ---- HTTP threads ----

  // Queues a job, or says why not (503 when the queue is full).
  void enqueue(Job job) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      if (stopping) throw HttpError{503, "the server is stopping", "", "server_error", "stopping"};
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
    if (chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
    else choice["text"] = text;
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
              bool include_usage) {
    std::shared_ptr<Channel> channel = job.channel;
    const std::string id = fresh_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = now_seconds();
    const std::string model = options.model_name;
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
          json last = chunk(chat ? json::object() : json(""), finish_reason_text(channel->finish_reason));
          if (include_usage)
            last["usage"] = {{"prompt_tokens", channel->prompt_tokens},
                             {"completion_tokens", channel->completion_tokens},
                             {"total_tokens", channel->prompt_tokens + channel->completion_tokens}};
          if (!send(last)) {
            channel->abandoned.store(true);
            return false;
          }
        }
        const std::string end = "data: [DONE]\n\n";
        sink.write(end.data(), end.size());
        sink.done();
        return true;
      }
    }, [channel](bool success) {
      if (!success) channel->abandoned.store(true);  // the connection ended before the stream did
    });
  }

  void handle_generation(const httplib::Request& request, httplib::Response& response, bool chat) {
    try {
      Job job;
      job.request = read_request(chat, request.body, limits);
      const bool streaming = job.request.stream, include_usage = job.request.include_usage;
      job.channel = std::make_shared<Channel>();
      job.channel->chat = chat;
      Job waiting_for{};
      waiting_for.channel = job.channel;
      enqueue(std::move(job));
      if (streaming) stream(waiting_for, std::make_shared<const ClientSocket>(request), response, chat, include_usage);
      else answer(waiting_for, ClientSocket(request), response, chat);
    } catch (const HttpError& e) {
      send_error(response, e);
    } catch (const std::exception& e) {
      send_error(response, {500, e.what(), "", "server_error", "internal"});
    }
  }

  std::string metrics_text() const {
    const ServeStats s = stats();
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help, double value) {
      char line[64];
      snprintf(line, sizeof line, "%.17g", value);
      out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + line + "\n";
    };
    metric("kvlite_requests_running", "gauge", "Requests the engine is running.", double(s.requests_running));
    metric("kvlite_requests_waiting", "gauge", "Requests queued for the engine.", double(s.requests_waiting));
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
    metric("kvlite_prompt_tokens_total", "counter", "Prompt tokens submitted.", double(s.prompt_tokens_total));
    metric("kvlite_generation_tokens_total", "counter", "Tokens generated.", double(s.tokens_generated_total));
    metric("kvlite_preemptions_total", "counter", "Requests preempted for KV pages.", double(s.preemptions_total));
    metric("kvlite_generation_tokens_per_second", "gauge", "Tokens generated per second of engine work.",
           s.tokens_per_second);
    return out;
  }

  ServeStats stats() const {
    ServeStats s;
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      s = counters;
    }
    std::lock_guard<std::mutex> lock(const_cast<Impl*>(this)->queue_mutex);
    s.requests_waiting = int64_t(incoming.size());
    return s;
  }

  void routes() {
    http.set_payload_max_length(size_t(options.max_body_bytes));
    // cpp-httplib's 5 s defaults drop a client that a burst keeps waiting for its turn to send or read; an
    // inference server's clients wait longer than that by nature.
    http.set_read_timeout(60, 0);
    http.set_write_timeout(60, 0);
    http.set_keep_alive_timeout(60);
    // Every request in flight may hold an HTTP thread while it waits: enough threads for the queue.
    const size_t threads = size_t(std::max<int64_t>(options.max_queue, 1)) + 8;
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) { handle_generation(q, r, true); });
    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) { handle_generation(q, r, false); });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& r) {
      json body = {{"object", "list"},
                   {"data", json::array({{{"id", options.model_name}, {"object", "model"}, {"created", 0},
                                          {"owned_by", "kvlite"},
                                          {"max_model_len", engine->plan().max_model_len}}})}};
      r.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    });
    http.Get("/health", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"status":"ok"})", "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
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
  return s.port;
}

void OpenAIServer::serve() { impl_->http.listen_after_bind(); }

void OpenAIServer::stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->queue_mutex);
    impl_->stopping = true;
  }
  impl_->queue_changed.notify_all();
  impl_->http.stop();
}

ServeStats OpenAIServer::stats() const { return impl_->stats(); }

}  // namespace kvlite_server
