// serve: `kvlite serve`'s OpenAI-compatible server on loopback, in process, over the bundled captioner (CPU):
// every endpoint, streaming and not, images as data: URIs, every kind of bad input with its status code and
// message, a full queue, and a load test of 200 concurrent mixed requests (20 clients disconnecting midway) in
// which every completed request's text equals what it gets alone, none is lost, and the KV pool ends empty.
#include <doctest/doctest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvlite.hpp"
#include "server/openai_server.hpp"

using nlohmann::json;
using kvlite_server::OpenAIServer;
using kvlite_server::ServeOptions;

namespace {

const std::string kCaptioner = std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16";
const std::string kImages = std::string(KVLITE_SOURCE_DIR) + "/examples/images/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string base64(const std::string& bytes) {
  static const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 | uint32_t(uint8_t(bytes[i + 1])) << 8 | uint8_t(bytes[i + 2]);
    for (int k = 3; k >= 0; k--) out += alphabet[(v >> (6 * k)) & 63];
  }
  if (i < bytes.size()) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? alphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string data_uri(const std::string& bytes) { return "data:image/png;base64," + base64(bytes); }

// The five example captions (examples/images/captions.txt).
std::map<std::string, std::string> expected_captions() {
  std::map<std::string, std::string> captions;
  std::istringstream in(read_file(kImages + "captions.txt"));
  for (std::string line; std::getline(in, line);) {
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) captions[line.substr(0, tab)] = line.substr(tab + 1);
  }
  return captions;
}

json image_chat(const std::string& image_path, bool stream = false) {
  json body = {{"messages",
                json::array({{{"role", "user"},
                              {"content", json::array({{{"type", "image_url"},
                                                        {"image_url", {{"url", data_uri(read_file(image_path))}}}},
                                                       {{"type", "text"}, {"text", "Describe this image."}}})}}})}};
  if (stream) body["stream"] = true;
  return body;
}

// A server on an ephemeral loopback port, serving from its own thread.
struct Running {
  std::unique_ptr<OpenAIServer> server;
  std::thread thread;
  int port = 0;
  // device_mem: what the plan divides; 256 MiB holds the KV of 16 sequences of max_model_len, less forces
  // preemption under load.
  explicit Running(ServeOptions options = {}, uint64_t device_mem = 256 * kvlite::MiB,
                   const std::string& model_dir = kCaptioner) {
    options.port = 0;
    kvlite::EngineOptions engine_options;
    engine_options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    engine_options.plan.device_mem = device_mem;
    engine_options.plan.max_seqs = 16;
    engine_options.threads = 1;
    auto engine = kvlite::Engine::open(model_dir, engine_options);
    REQUIRE_MESSAGE(engine.ok(), engine.error().message);
    auto created = OpenAIServer::create(std::move(*engine), options);
    REQUIRE_MESSAGE(created.ok(), created.error().message);
    server = std::move(*created);
    auto bound = server->bind();
    REQUIRE_MESSAGE(bound.ok(), bound.error().message);
    port = *bound;
    thread = std::thread([this] { server->serve(); });
  }
  ~Running() {
    server->stop();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    c.set_write_timeout(120, 0);
    return c;
  }
};

struct Reply {
  int status = 0;
  json body;
};

// OpenAI's default temperature is 1 (kvlite serve samples when a request names none): these tests compare texts,
// so a generation request that names no temperature asks for greedy decoding.
std::string greedy(const std::string& path, const std::string& body) {
  if (path != "/v1/chat/completions" && path != "/v1/completions") return body;
  json parsed = json::parse(body, nullptr, false);
  if (!parsed.is_object() || parsed.contains("temperature")) return body;
  parsed["temperature"] = 0;
  return parsed.dump();
}

// status -1 when no response came (the error's name in body["transport_error"]); never REQUIRE: client threads.
Reply post(const Running& running, const std::string& path, const std::string& raw_body) {
  const std::string body = greedy(path, raw_body);
  auto result = running.client().Post(path.c_str(), body, "application/json");
  if (!result) return Reply{-1, json{{"transport_error", httplib::to_string(result.error())}}};
  Reply reply{result->status, json()};
  reply.body = json::parse(result->body, nullptr, false);
  return reply;
}

// A streamed answer: the concatenated content of its chunks, the finish reason, and whether [DONE] came.
struct Streamed {
  int status = 0;
  std::string text, finish_reason;
  bool done = false;
  int chunks = 0;
  int usage_chunks = 0;  // stream_options.include_usage: chunks with no choices, only the usage
  json usage, error;
};

Streamed post_stream(const Running& running, const std::string& path, const json& body, int disconnect_after = 0) {
  Streamed out;
  std::string buffer;
  httplib::Client c = running.client();
  httplib::Request request;
  request.method = "POST";
  request.path = path;
  request.body = greedy(path, body.dump());
  request.set_header("Content-Type", "application/json");
  request.content_receiver = [&](const char* data, size_t length, uint64_t, uint64_t) {
    buffer.append(data, length);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        out.done = true;
        continue;
      }
      const json chunk = json::parse(payload);
      if (chunk.contains("usage") && !chunk["usage"].is_null()) out.usage = chunk["usage"];
      if (chunk.contains("error")) {
        out.error = chunk["error"];
        continue;
      }
      if (chunk["choices"].empty()) {
        out.usage_chunks++;
        continue;
      }
      const json& choice = chunk["choices"][0];
      if (choice.contains("delta") && choice["delta"].contains("content"))
        out.text += choice["delta"]["content"].get<std::string>();
      if (choice.contains("text")) out.text += choice["text"].get<std::string>();
      if (!choice["finish_reason"].is_null()) out.finish_reason = choice["finish_reason"].get<std::string>();
      out.chunks++;
      if (disconnect_after > 0 && out.chunks >= disconnect_after) return false;  // the client goes away
    }
    return true;
  };
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  c.send(request, response, error);
  out.status = response.status;
  return out;
}

bool wait_until(const std::function<bool()>& condition, double seconds = 30) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

}  // namespace

TEST_CASE("base64 and data: URIs decode exactly, and refuse what is not") {
  for (const std::string& s : {std::string(""), std::string("a"), std::string("ab"), std::string("abc"),
                               std::string("\x00\xff\x10 binary", 9)}) {
    auto decoded = kvlite_server::decode_base64(base64(s));
    REQUIRE(decoded.ok());
    CHECK(*decoded == s);
  }
  CHECK_FALSE(kvlite_server::decode_base64("abc").ok());     // not a multiple of 4
  CHECK_FALSE(kvlite_server::decode_base64("ab!d").ok());    // not the alphabet
  CHECK_FALSE(kvlite_server::decode_base64("a=bc").ok());    // padding in the middle
  CHECK_FALSE(kvlite_server::decode_base64("ab c").ok());    // whitespace
  CHECK_FALSE(kvlite_server::decode_data_uri("https://example.com/cat.png").ok());
  CHECK_FALSE(kvlite_server::decode_data_uri("data:image/png,rawbytes").ok());
  CHECK(*kvlite_server::decode_data_uri("data:image/png;base64,YWJj") == "abc");
}

TEST_CASE("models, health, metrics: a chat with an image, streamed and not, captions as caption_image does") {
  Running running;
  auto models = running.client().Get("/v1/models");
  REQUIRE(models);
  CHECK(models->status == 200);
  CHECK(json::parse(models->body)["data"][0]["id"] == "kvlite-captioner-bf16");
  auto health = running.client().Get("/health");
  REQUIRE(health);
  CHECK(health->status == 200);

  const auto captions = expected_captions();
  for (const auto& entry : captions) {
    const std::string& image = entry.first;
    const std::string& caption = entry.second;
    CAPTURE(image);
    Reply reply = post(running, "/v1/chat/completions", image_chat(kImages + image).dump());
    REQUIRE(reply.status == 200);
    CHECK(reply.body["object"] == "chat.completion");
    CHECK(reply.body["choices"][0]["message"]["content"] == caption);
    CHECK(reply.body["choices"][0]["finish_reason"] == "stop");
    // usage counts the prompt as the model saw it: the image's 16 tokens included
    CHECK(reply.body["usage"]["prompt_tokens"].get<int64_t>() > 16);
    CHECK(reply.body["usage"]["completion_tokens"].get<int64_t>() >= 1);
    Streamed streamed = post_stream(running, "/v1/chat/completions", image_chat(kImages + image, true));
    CHECK(streamed.status == 200);
    CHECK(streamed.text == caption);
    CHECK(streamed.finish_reason == "stop");
    CHECK(streamed.done);
  }
  // /v1/completions: plain text, and max_tokens ends it with "length".
  Reply completion = post(running, "/v1/completions", R"({"prompt": "a small", "max_tokens": 2})");
  REQUIRE(completion.status == 200);
  CHECK(completion.body["object"] == "text_completion");
  CHECK(completion.body["choices"][0]["text"].is_string());

  auto metrics = running.client().Get("/metrics");
  REQUIRE(metrics);
  CHECK(metrics->body.find("# TYPE kvlite_kv_pages_used gauge") != std::string::npos);
  CHECK(metrics->body.find("kvlite_requests_total{model_name=\"kvlite-captioner-bf16\"} 11") != std::string::npos);
  CHECK(metrics->body.find("kvlite_kv_pages_used{model_name=\"kvlite-captioner-bf16\"} 0") != std::string::npos);
  // The same chat with the same image, asked repeatedly above: the prefix cache served its pages.
  CHECK(metrics->body.find("# TYPE kvlite_prefix_tokens_reused_total counter") != std::string::npos);
  CHECK(metrics->body.find("kvlite_prefix_tokens_reused_total{model_name=\"kvlite-captioner-bf16\"} 0\n") == std::string::npos);
  CHECK(metrics->body.find("kvlite_kv_pages_cached{model_name=\"kvlite-captioner-bf16\"} 0\n") == std::string::npos);
}

TEST_CASE("logprobs: each token and its log-probability in OpenAI's chat and completions forms, as the engine gives "
          "them; what is not supported is refused") {
  Running running;
  const auto captions = expected_captions();
  const std::string image_name = captions.begin()->first;
  json body = image_chat(kImages + image_name);
  body["logprobs"] = true;
  Reply reply = post(running, "/v1/chat/completions", body.dump());
  REQUIRE(reply.status == 200);
  const json& content = reply.body["choices"][0]["logprobs"]["content"];
  REQUIRE(content.is_array());
  CHECK(int64_t(content.size()) == reply.body["usage"]["completion_tokens"].get<int64_t>());
  // The engine's own logprobs for the same chat (a fresh engine on the same model).
  kvlite::EngineOptions engine_options;
  engine_options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
  engine_options.plan.device_mem = 256 * kvlite::MiB;
  auto engine = kvlite::Engine::open(kCaptioner, engine_options);
  REQUIRE(engine);
  auto image = kvlite::load_image(kImages + image_name);
  REQUIRE(image);
  kvlite::SamplingParams params;
  params.max_tokens = 256;
  params.logprobs = true;
  auto generation =
      (*engine)->generate_chat({{"user", std::string(kvlite::kImagePlaceholder) + "Describe this image."}}, {*image},
                               params);
  REQUIRE(generation);
  REQUIRE(content.size() == generation->logprobs.size());
  std::string text;
  for (size_t i = 0; i < content.size(); i++) {
    CHECK(content[i]["logprob"].get<double>() == doctest::Approx(generation->logprobs[i]).epsilon(1e-6));
    CHECK(content[i]["token"] == (*engine)->tokenizer().token_bytes(generation->ids[i]));
    CHECK(content[i]["top_logprobs"].empty());
    if (i + 1 < content.size()) text += content[i]["token"].get<std::string>();  // the last is <|im_end|>
  }
  CHECK(text == captions.begin()->second);
  // Not asked: null.
  Reply plain = post(running, "/v1/chat/completions", image_chat(kImages + image_name).dump());
  REQUIRE(plain.status == 200);
  CHECK(plain.body["choices"][0]["logprobs"].is_null());
  // Completions: "logprobs": 0 gives the legacy arrays.
  Reply completion = post(running, "/v1/completions", R"({"prompt": "a small", "max_tokens": 3, "logprobs": 0})");
  REQUIRE(completion.status == 200);
  const json& legacy = completion.body["choices"][0]["logprobs"];
  const size_t completed = size_t(completion.body["usage"]["completion_tokens"].get<int64_t>());
  CHECK(completed >= 1);
  CHECK(legacy["tokens"].size() == completed);
  CHECK(legacy["token_logprobs"].size() == completed);
  CHECK(legacy["text_offset"][0] == 0);
  for (const json& value : legacy["token_logprobs"]) CHECK(value.get<double>() <= 0.0);
  // Alternatives and streaming with logprobs are refused, naming the field.
  for (const auto& refused : std::vector<std::pair<std::string, std::string>>{
           {"/v1/completions", R"({"prompt": "a", "logprobs": 3})"},
           {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 2})"},
           {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "stream": true})"},
           {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"})"}}) {
    CAPTURE(refused.second);
    Reply bad = post(running, refused.first, refused.second);
    CHECK(bad.status == 400);
    CHECK(bad.body["error"]["message"].get<std::string>().find("logprobs") != std::string::npos);
  }
}

TEST_CASE("bad input gets OpenAI's status codes and a message naming the problem") {
  ServeOptions options;
  options.max_body_bytes = 4 << 20;
  Running running(options);
  const std::string scene = read_file(kImages + "scene_1.png");
  // A PNG header claiming 100000 x 100000 pixels (a decompression bomb): refused before decoding.
  std::string bomb = scene.substr(0, 33);
  const unsigned char size[8] = {0x00, 0x01, 0x86, 0xA0, 0x00, 0x01, 0x86, 0xA0};
  bomb.replace(16, 8, reinterpret_cast<const char*>(size), 8);
  auto with_image = [](const std::string& url, int images = 1) {
    json parts = json::array();
    for (int i = 0; i < images; i++) parts.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
    parts.push_back({{"type", "text"}, {"text", "Describe this image."}});
    return json{{"messages", json::array({{{"role", "user"}, {"content", parts}}})}}.dump();
  };
  struct Case {
    std::string body;
    int status;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"{not json", 400, "not valid JSON"},
      {"[1, 2]", 400, "JSON object"},
      {R"({"messages": 5})", 400, "'messages'"},
      {R"({"messages": [{"role": "user", "content": 7}]})", 400, "content"},
      {R"({"messages": [{"content": "hi"}]})", 400, "'role'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"})", 400, "'max_tokens'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000})", 400, "'max_tokens'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "temperature": 9})", 400, "'temperature'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"})", 400, "'stream'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stop": [1]})", 400, "'stop'"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "n": 3})", 400, "'n'"},
      {R"({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})", 404, "gpt-4"},
      {R"({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})", 400, "audio"},
      {with_image("https://example.com/cat.png"), 400, "data: URIs"},
      {with_image("data:image/png;base64,AAAA"), 400, "not one kvlite can read"},
      {with_image("data:image/png;base64,not base64!"), 400, "base64"},
      {with_image(data_uri(bomb)), 413, "pixels"},
      {with_image(data_uri(scene), 2), 400, "max_images"},
      {std::string(R"({"messages": [{"role": "user", "content": ")") + "\xff\xfe" + R"("}]})", 400, "UTF-8"},
      {R"({"prompt": 5})", 400, "'prompt'"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.body.substr(0, 120));
    const std::string path = c.body.find("\"prompt\"") != std::string::npos ? "/v1/completions" : "/v1/chat/completions";
    Reply reply = post(running, path, c.body);
    CHECK(reply.status == c.status);
    REQUIRE(reply.body.is_object());
    REQUIRE(reply.body.contains("error"));
    const std::string message = reply.body["error"]["message"].get<std::string>();
    CHECK_MESSAGE(message.find(c.needle) != std::string::npos, message);
  }
  // A body over --max-body-bytes (here 4 MiB; the default is 32 MiB): 413 before it is parsed.
  Reply huge = post(running, "/v1/chat/completions", std::string(5 << 20, ' '));
  CHECK(huge.status == 413);
  CHECK(huge.body["error"]["message"].get<std::string>().find("larger than") != std::string::npos);
  // An unknown route: 404 in the same shape.
  auto missing = running.client().Get("/v2/everything");
  REQUIRE(missing);
  CHECK(missing->status == 404);
  // The engine is untouched by all of it.
  Reply fine = post(running, "/v1/chat/completions", image_chat(kImages + "scene_4.png").dump());
  CHECK(fine.status == 200);
  CHECK(fine.body["choices"][0]["message"]["content"] == expected_captions()["scene_4.png"]);
  CHECK(wait_until([&] { return running.server->stats().kv_pages_used == 0; }));
}

// A raw HTTP/1.1 client: sends one POST and, unlike httplib::Client, can hang up while the answer is pending.
int send_raw_post(int port, const std::string& path, const std::string& raw_body) {
  const std::string body = greedy(path, raw_body);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  const std::string request = "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                              "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) != ssize_t(request.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST_CASE("a client that disconnects while it waits, streaming or not, ends its request and frees its pages") {
  // Each engine step is slowed to 20 ms, so a 200-token request would run 4 s: long enough to see, with a wide
  // margin, that the request ended when its client left (within a few steps) and not when its tokens ran out.
  ServeOptions options;
  options.test_step_delay_us = 20000;
  Running running(options);
  constexpr int64_t kMaxTokens = 200;
  for (const bool streaming : {false, true}) {
    CAPTURE(streaming);
    const kvlite_server::ServeStats before = running.server->stats();
    json body = image_chat(kImages + "scene_2.png", streaming);
    body["max_tokens"] = kMaxTokens;
    body["ignore_eos"] = true;  // vLLM's extension: the caption's end does not stop it
    const int fd = send_raw_post(running.port, "/v1/chat/completions", body.dump());
    REQUIRE(fd >= 0);
    // Hang up once the engine runs it (a streaming client reads nothing: it leaves before its first chunk).
    REQUIRE(wait_until([&] { return running.server->stats().requests_running == 1; }));
    const auto hung_up = std::chrono::steady_clock::now();
    close(fd);
    REQUIRE(wait_until([&] {
      const kvlite_server::ServeStats s = running.server->stats();
      return s.requests_running == 0 && s.requests_waiting == 0 && s.kv_pages_used == 0;
    }));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - hung_up).count();
    const kvlite_server::ServeStats after = running.server->stats();
    CHECK(after.requests_abandoned == before.requests_abandoned + 1);
    const int64_t generated = after.tokens_generated_total - before.tokens_generated_total;
    CHECK(generated < kMaxTokens / 4);
    MESSAGE(std::string(streaming ? "streaming" : "non-streaming") << " client hung up: its request ended after " << generated
                                                        << " of " << kMaxTokens << " tokens, " << seconds
                                                        << " s after; KV pages used: " << after.kv_pages_used);
  }
  // The server goes on serving.
  Reply fine = post(running, "/v1/chat/completions", image_chat(kImages + "scene_4.png").dump());
  CHECK(fine.status == 200);
  CHECK(fine.body["choices"][0]["message"]["content"] == expected_captions()["scene_4.png"]);
}

TEST_CASE("a full queue answers 503, and the requests it took all finish") {
  ServeOptions options;
  options.max_queue = 2;
  Running running(options);
  std::atomic<int> ok{0}, full{0}, other{0};
  for (int round = 0; round < 5 && full == 0; round++) {
    std::vector<std::thread> clients;
    for (int i = 0; i < 24; i++)
      clients.emplace_back([&] {
        Reply reply = post(running, "/v1/completions", R"({"prompt": "a small", "max_tokens": 64, "stop": ["zzzz"], "ignore_eos": true})");
        if (reply.status == 200) ok++;
        else if (reply.status == 503 && reply.body["error"]["code"] == "queue_full") full++;
        else other++;
      });
    for (auto& t : clients) t.join();
  }
  CHECK(full > 0);
  CHECK(ok > 0);
  CHECK(other == 0);
  CHECK(running.server->stats().requests_rejected == full.load());
  CHECK(wait_until([&] { return running.server->stats().kv_pages_used == 0; }));
}

TEST_CASE("200 concurrent mixed requests (60 under ASan), 10% disconnecting midway, on a KV pool that forces "
          "preemption: every completed text equals its solo run, none is lost, the KV pool ends empty") {
  ServeOptions options;
  options.max_queue = 256;
  // 8.5 MiB: a KV pool of 352 tokens (22 pages) for 16 running sequences, 1.4 of max_model_len: running
  // requests outgrow it and are preempted (their pages freed, recomputed later), as on a full 8 GB card.
  Running running(options, 8 * kvlite::MiB + 512 * kvlite::KiB);
  const auto captions = expected_captions();
  std::vector<std::string> images;
  for (const auto& [image, caption] : captions) images.push_back(image);
  const std::vector<std::string> prompts = {"a small", "a large red", "a small white square and", "the"};

  // The kinds of request, and what each gives alone (greedy: the same text in any batch).
  struct Kind {
    bool image;
    std::string name;  // image file or prompt
    int max_tokens;
  };
  std::vector<Kind> kinds;
  for (const std::string& image : images) kinds.push_back({true, image, 40});
  for (size_t i = 0; i < prompts.size(); i++) kinds.push_back({false, prompts[i], 6 + int(i) * 5});
  auto body_of = [&](const Kind& k, bool stream) {
    json body = k.image ? image_chat(kImages + k.name, stream)
                        : json{{"prompt", k.name}, {"max_tokens", k.max_tokens}, {"stream", stream}};
    if (k.image) body["max_tokens"] = k.max_tokens;
    return body;
  };
  std::vector<std::string> solo;
  for (const Kind& k : kinds) {
    Reply reply = post(running, k.image ? "/v1/chat/completions" : "/v1/completions", body_of(k, false).dump());
    REQUIRE(reply.status == 200);
    solo.push_back(k.image ? reply.body["choices"][0]["message"]["content"].get<std::string>()
                           : reply.body["choices"][0]["text"].get<std::string>());
  }
  for (size_t i = 0; i < images.size(); i++) CHECK(solo[i] == captions.at(images[i]));

  // 200 concurrent requests, 20 of them disconnecting; the sanitizer tree, whose every operation costs ~10x,
  // runs the same checks at 60 and 6 (the g++ tree runs the full load).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVLITE_TEST_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(KVLITE_TEST_UNDER_ASAN)
  constexpr int kRequests = 60, kDisconnecting = 6;
#else
  constexpr int kRequests = 200, kDisconnecting = 20;
#endif
  std::atomic<int> completed{0}, matched{0}, disconnected{0}, failed{0};
  std::mutex mismatch_mutex;
  std::vector<std::string> mismatches;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; i++) {
    clients.emplace_back([&, i] {
      const size_t k = size_t(i) % kinds.size();
      const Kind& kind = kinds[k];
      const char* path = kind.image ? "/v1/chat/completions" : "/v1/completions";
      const bool disconnecting = i % (kRequests / kDisconnecting) == 3;  // one in ten
      const bool stream = disconnecting || i % 2 == 0;
      std::string text;
      if (stream) {
        Streamed s = post_stream(running, path, body_of(kind, true), disconnecting ? 1 : 0);
        if (disconnecting) {
          disconnected++;
          return;
        }
        if (s.status != 200 || !s.done) {
          failed++;
          std::lock_guard<std::mutex> lock(mismatch_mutex);
          mismatches.push_back("request " + std::to_string(i) + ": streamed status " + std::to_string(s.status));
          return;
        }
        text = s.text;
      } else {
        Reply reply = post(running, path, body_of(kind, false).dump());
        if (reply.status != 200) {
          failed++;
          std::lock_guard<std::mutex> lock(mismatch_mutex);
          mismatches.push_back("request " + std::to_string(i) + ": status " + std::to_string(reply.status) + " " +
                               reply.body.dump());
          return;
        }
        text = kind.image ? reply.body["choices"][0]["message"]["content"].get<std::string>()
                          : reply.body["choices"][0]["text"].get<std::string>();
      }
      completed++;
      if (text == solo[k]) {
        matched++;
      } else {
        std::lock_guard<std::mutex> lock(mismatch_mutex);
        mismatches.push_back("request " + std::to_string(i) + ": '" + text + "' alone: '" + solo[k] + "'");
      }
    });
  }
  for (auto& t : clients) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const std::string& m : mismatches) MESSAGE(m);
  CHECK(failed == 0);
  CHECK(disconnected == kDisconnecting);
  CHECK(completed == kRequests - kDisconnecting);  // no request lost
  CHECK(matched == completed.load());
  CHECK(running.server->stats().preemptions_total > 0);  // the pool was too small for the load, as meant
  // Every page back, nothing running or waiting (the disconnected requests end at their next token).
  CHECK(wait_until([&] {
    const kvlite_server::ServeStats s = running.server->stats();
    return s.kv_pages_used == 0 && s.requests_running == 0 && s.requests_waiting == 0;
  }));
  const kvlite_server::ServeStats stats = running.server->stats();
  MESSAGE("load test: " << kRequests << " requests (" << kDisconnecting << " disconnecting) in " << seconds
                        << " s; " << stats.tokens_generated_total << " tokens generated, "
                        << stats.tokens_per_second << " tokens/s of engine time; " << stats.preemptions_total
                        << " preemptions; KV pages used after: " << stats.kv_pages_used << "; abandoned: "
                        << stats.requests_abandoned);
}

// Issue 47: nlohmann's parser has no depth limit; a 32 MiB body of '[' cost 2.5 GB and 5 s. The server now checks
// every body against the library's limits (KVLITE_MAX_JSON_DEPTH, KVLITE_MAX_JSON_BYTES) before parsing it.
TEST_CASE("regression: the server parsed request bodies with no JSON nesting limit") {
  auto body_nested = [](int depth) {
    return R"({"prompt": "hi", "extra": )" + std::string(size_t(depth - 1), '[') + std::string(size_t(depth - 1), ']') + "}";
  };
  std::string message;
  // 64 levels, the limit: read as JSON, then refused for its unknown field (issue 42), not for its depth
  CHECK(kvlite_server::check_request(false, body_nested(64), "m", 16, &message) == 400);
  CHECK(message.find("'extra'") != std::string::npos);
  CHECK(message.find("KVLITE_MAX_JSON_DEPTH") == std::string::npos);
  CHECK(kvlite_server::check_request(false, body_nested(65), "m", 16, &message) == 400);
  CHECK(message.find("KVLITE_MAX_JSON_DEPTH") != std::string::npos);
  const auto start = std::chrono::steady_clock::now();
  message.clear();
  CHECK(kvlite_server::check_request(true, std::string(size_t(32) << 20, '['), "m", 16, &message) == 400);
  CHECK(message.find("nested more than 64 deep at byte 64") != std::string::npos);
  MESSAGE("32 MiB of '[' refused in " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                                      << " s");
  // What the engine thread is handed: the server's fields, within kvlite::validate's ranges.
  kvlite_server::ParsedRequest parsed;
  REQUIRE(kvlite_server::parse_request(false, R"({"prompt": "hi", "max_tokens": 7, "stop": ["x"], "top_k": 3})", "m",
                                       16, 256, &parsed, &message) == 200);
  CHECK(parsed.params.max_tokens == 7);
  CHECK(parsed.params.top_k == 3);
  CHECK(kvlite::validate(parsed.params).ok());
  CHECK(kvlite_server::check_request(false, R"({"prompt": "hi", "stop": ")" + std::string(5000, 'x') + "\"}", "m", 16,
                                     &message) == 400);
}

// ---- issue 42: the OpenAI contract, and operations --------------------------------------------------------

TEST_CASE("contract: no seed samples afresh, a seed repeats, and OpenAI's default temperature is 1") {
  Running running;
  auto completion = [&](const json& extra) {
    json body = {{"prompt", "The"}, {"max_tokens", 24}, {"ignore_eos", true}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    Reply reply = post(running, "/v1/completions", body.dump());
    REQUIRE(reply.status == 200);
    return reply.body["choices"][0]["text"].get<std::string>();
  };
  // No temperature, no seed: sampled at temperature 1, each call with its own seed. Five calls of 24 tokens
  // from a model of this vocabulary all alike would mean the seed (or the temperature) is fixed.
  std::set<std::string> unseeded;
  for (int i = 0; i < 5; i++) {
    json body = {{"prompt", "The"}, {"max_tokens", 24}, {"ignore_eos", true}};
    auto reply = running.client().Post("/v1/completions", body.dump(), "application/json");  // no greedy()
    REQUIRE(reply);
    REQUIRE(reply->status == 200);
    unseeded.insert(json::parse(reply->body)["choices"][0]["text"].get<std::string>());
  }
  CHECK(unseeded.size() >= 2);
  // The same seed at temperature 1: the same text; greedy: the same text every time.
  CHECK(completion({{"temperature", 1.0}, {"seed", 42}}) == completion({{"temperature", 1.0}, {"seed", 42}}));
  CHECK(completion({{"temperature", 0}}) == completion({{"temperature", 0}}));
}

TEST_CASE("contract: every field is implemented or refused with 400 naming it, and neutral values pass") {
  Running running;
  const std::string chat = R"("messages": [{"role": "user", "content": "hi"}], "max_tokens": 2)";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({)" + chat + R"(, "tools": [{"type": "function"}]})", "tools"},
      {R"({)" + chat + R"(, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})", "'g'"},
      {R"({)" + chat + R"(, "tool_choice": "required"})", "tool_choice"},
      {R"({)" + chat + R"(, "response_format": {"type": "xml"}})", "response_format"},
      {R"({)" + chat + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "ipv6"}}}})", "ipv6"},
      {R"({)" + chat + R"(, "response_format": {"type": "json_schema"}})", "response_format"},
      {R"({)" + chat + R"(, "presence_penalty": 0.5})", "presence_penalty"},
      {R"({)" + chat + R"(, "frequency_penalty": -1})", "frequency_penalty"},
      {R"({)" + chat + R"(, "logit_bias": {"5": 10}})", "logit_bias"},
      {R"({)" + chat + R"(, "n": 2})", "'n'"},
      {R"({)" + chat + R"(, "functions": []})", "functions"},
      {R"({)" + chat + R"(, "guided_json": {}})", "guided_json"},
      {R"({)" + chat + R"(, "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "a", "echo": true})", "echo"},
      {R"({"prompt": "a", "best_of": 3})", "best_of"},
      {R"({"prompt": "a", "suffix": "b"})", "suffix"},
      {R"({"prompt": "a", "messages": []})", "messages"},
  };
  for (const auto& entry : refused) {
    // (not a structured binding: clang 14's C++17 cannot capture one in CAPTURE's lambda)
    const std::string& body = entry.first;
    const std::string& field = entry.second;
    CAPTURE(body);
    const std::string path = body.find("\"prompt\"") != std::string::npos ? "/v1/completions" : "/v1/chat/completions";
    Reply reply = post(running, path, body);
    CHECK(reply.status == 400);
    REQUIRE(reply.body.contains("error"));
    CHECK_MESSAGE(reply.body["error"]["message"].get<std::string>().find(field) != std::string::npos,
                  reply.body["error"]["message"]);
  }
  for (const std::string& body : {
           R"({)" + chat + R"(, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "n": 1, "user": "u"})",
           R"({)" + chat + R"(, "tool_choice": "none", "tools": [], "response_format": {"type": "text"}})",
           std::string(R"({"prompt": "a", "max_tokens": 2, "echo": false, "best_of": 1})")}) {
    CAPTURE(body);
    const std::string path = body.find("\"prompt\"") != std::string::npos ? "/v1/completions" : "/v1/chat/completions";
    CHECK(post(running, path, body).status == 200);
  }
  // The checks are the server's own reading too (parse_request, which the fuzz harness runs)
  std::string message;
  CHECK(kvlite_server::check_request(true, R"({"messages": [{"role": "user", "content": "a"}], "logit_bias": {"1": 1}})",
                                     "m", 16, &message) == 400);
  CHECK(message.find("logit_bias") != std::string::npos);
}

TEST_CASE("contract: a tool transcript (assistant content null with tool_calls, then a tool message) is accepted") {
  Running running;
  const json body = {
      {"max_tokens", 4},
      {"messages",
       json::array({{{"role", "user"}, {"content", "What is the weather in Paris?"}},
                    {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls", json::array({{{"id", "call_1"},
                                                  {"type", "function"},
                                                  {"function", {{"name", "get_weather"},
                                                                {"arguments", R"({"city": "Paris"})"}}}}})}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "22 C, sunny"}}})}};
  Reply reply = post(running, "/v1/chat/completions", body.dump());
  CHECK(reply.status == 200);
  kvlite_server::ParsedRequest parsed;
  std::string message;
  REQUIRE(kvlite_server::parse_request(true, body.dump(), "m", 16, 16, &parsed, &message) == 200);
  REQUIRE(parsed.messages.size() == 3);
  CHECK(parsed.messages[1].content == "<tool_call>\n{\"arguments\":{\"city\":\"Paris\"},\"name\":\"get_weather\"}\n</tool_call>");
  CHECK(parsed.messages[2].role == "tool");
  CHECK(parsed.messages[2].content == "22 C, sunny");
  // The model's template gets the transcript structured, as transformers' apply_chat_template and vLLM give it:
  // the calls with their arguments as an object (OpenAI sends a JSON string), the result with its call's id.
  const json structured = json::parse(parsed.template_messages);
  REQUIRE(structured.size() == 3);
  CHECK(structured[1]["content"] == "");
  CHECK(structured[1]["tool_calls"] ==
        json::array({{{"type", "function"}, {"id", "call_1"},
                      {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}}}}}}}));
  CHECK(structured[2] == json({{"role", "tool"}, {"content", "22 C, sunny"}, {"tool_call_id", "call_1"}}));
  // The captioner's own template writes no tool calls: the prompt is its rendering of the structure.
  kvlite::Result<kvlite::Tokenizer> captioner = kvlite::Tokenizer::load(kCaptioner);
  REQUIRE(captioner.ok());
  const std::string plain = kvlite_server::render_chat(*captioner, parsed, true).value();
  CHECK(plain == captioner->apply_chat_template(parsed.template_messages, true).value());
  CHECK(plain.find("<|im_start|>tool\n22 C, sunny<|im_end|>") != std::string::npos);
  // With a template that writes them (Qwen2.5's, which tests/unit-chat-template.cpp checks against transformers),
  // the call and its result come out in Qwen's form.
  const json config = {{"chat_template", read_file(std::string(KVLITE_SOURCE_DIR) +
                                                   "/tests/fixtures/chat_templates/qwen2.5.jinja")}};
  kvlite::Result<kvlite::Tokenizer> qwen =
      kvlite::Tokenizer::from_json(read_file(kCaptioner + "/tokenizer.json"), config.dump());
  REQUIRE_MESSAGE(qwen.ok(), qwen.error().message);
  const std::string rendered = kvlite_server::render_chat(*qwen, parsed, true).value();
  CHECK(rendered.find("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                      "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>") != std::string::npos);
  CHECK(rendered.find("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>") !=
        std::string::npos);
  // A tool message without the call it answers is refused by name
  json orphan = body;
  orphan["messages"][2].erase("tool_call_id");
  CHECK(kvlite_server::parse_request(true, orphan.dump(), "m", 16, 16, nullptr, &message) == 400);
  CHECK(message.find("tool_call_id") != std::string::npos);
}

TEST_CASE("contract: a streamed request that cannot fit is answered 400 before streaming, usage comes as a last "
          "chunk with no choices") {
  Running running;
  auto models = running.client().Get("/v1/models");
  REQUIRE(models);
  const int64_t max_model_len = json::parse(models->body)["data"][0]["max_model_len"].get<int64_t>();
  std::string long_prompt;
  for (int64_t i = 0; i < max_model_len + 8; i++) long_prompt += " a";
  Streamed too_long = post_stream(running, "/v1/completions", {{"prompt", long_prompt}, {"stream", true}, {"max_tokens", 1}});
  CHECK(too_long.status == 400);
  CHECK(too_long.chunks == 0);
  Streamed with_usage = post_stream(running, "/v1/chat/completions",
                                    {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                     {"max_tokens", 3}, {"ignore_eos", true}, {"stream", true},
                                     {"stream_options", {{"include_usage", true}}}});
  CHECK(with_usage.status == 200);
  CHECK(with_usage.done);
  CHECK(with_usage.usage_chunks == 1);
  CHECK(with_usage.usage["completion_tokens"] == 3);
  CHECK(with_usage.finish_reason == "length");
}

TEST_CASE("contract: /v1/models/{id}, /tokenize, /detokenize, /version") {
  Running running;
  auto card = running.client().Get("/v1/models/kvlite-captioner-bf16");
  REQUIRE(card);
  CHECK(card->status == 200);
  CHECK(json::parse(card->body)["id"] == "kvlite-captioner-bf16");
  auto missing = running.client().Get("/v1/models/gpt-4");
  REQUIRE(missing);
  CHECK(missing->status == 404);
  CHECK(json::parse(missing->body)["error"]["code"] == "model_not_found");
  Reply tokens = post(running, "/tokenize", R"({"prompt": "a red square", "add_special_tokens": false})");
  REQUIRE(tokens.status == 200);
  CHECK(tokens.body["count"].get<size_t>() == tokens.body["tokens"].size());
  CHECK(tokens.body["count"].get<int64_t>() >= 2);
  Reply text = post(running, "/detokenize", json{{"tokens", tokens.body["tokens"]}}.dump());
  REQUIRE(text.status == 200);
  CHECK(text.body["prompt"] == "a red square");
  Reply chat = post(running, "/tokenize", R"({"messages": [{"role": "user", "content": "a red square"}]})");
  REQUIRE(chat.status == 200);
  CHECK(chat.body["count"].get<int64_t>() > tokens.body["count"].get<int64_t>());  // the chat format around it
  CHECK(post(running, "/detokenize", R"({"tokens": [-1]})").status == 400);
  CHECK(post(running, "/tokenize", R"({"prompt": "a", "bogus": 1})").status == 400);
  auto version = running.client().Get("/version");
  REQUIRE(version);
  CHECK(json::parse(version->body)["version"] == KVLITE_VERSION_STRING);
}

TEST_CASE("operations: --api-key guards /v1 with 401 in OpenAI's shape, and CORS answers allowed origins") {
  ServeOptions options;
  options.api_key = "s3cret";
  options.allowed_origins = {"http://ui.example"};
  Running running(options);
  const std::string body = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})";
  Reply refused = post(running, "/v1/chat/completions", body);
  CHECK(refused.status == 401);
  CHECK(refused.body["error"]["code"] == "invalid_api_key");
  httplib::Client wrong = running.client();
  wrong.set_bearer_token_auth("s3creT");
  auto wrong_reply = wrong.Get("/v1/models");
  REQUIRE(wrong_reply);
  CHECK(wrong_reply->status == 401);
  httplib::Client right = running.client();
  right.set_bearer_token_auth("s3cret");
  auto right_reply = right.Post("/v1/chat/completions", body, "application/json");
  REQUIRE(right_reply);
  CHECK(right_reply->status == 200);
  auto health = running.client().Get("/health");  // not /v1: no key needed, as with vLLM
  REQUIRE(health);
  CHECK(health->status == 200);
  // A preflight from an allowed origin, then a request from it; a preflight from another origin is refused.
  auto preflight = running.client().Options(
      "/v1/chat/completions", {{"Origin", "http://ui.example"}, {"Access-Control-Request-Method", "POST"},
                               {"Access-Control-Request-Headers", "authorization, content-type"}});
  REQUIRE(preflight);
  CHECK(preflight->status == 204);
  CHECK(preflight->get_header_value("Access-Control-Allow-Origin") == "http://ui.example");
  CHECK(preflight->get_header_value("Access-Control-Allow-Headers") == "authorization, content-type");
  auto from_ui = right.Get("/v1/models", {{"Origin", "http://ui.example"}});
  REQUIRE(from_ui);
  CHECK(from_ui->get_header_value("Access-Control-Allow-Origin") == "http://ui.example");
  auto other = running.client().Options("/v1/models", {{"Origin", "http://evil.example"}});
  REQUIRE(other);
  CHECK(other->status == 403);
  CHECK_FALSE(other->has_header("Access-Control-Allow-Origin"));
}

TEST_CASE("operations: stop() drains: the request in flight finishes, an idle keep-alive connection does not hold "
          "it, new connections are refused") {
  ServeOptions options;
  options.test_step_delay_us = 20000;  // 20 ms a step: 30 tokens take ~0.6 s
  options.shutdown_timeout_s = 20;
  Running running(options);
  // An idle keep-alive connection, as a pooled client leaves one
  httplib::Client pooled = running.client();
  pooled.set_keep_alive(true);
  auto first = pooled.Get("/health");
  REQUIRE(first);
  Reply in_flight;
  std::thread request([&] {
    in_flight = post(running, "/v1/completions", R"({"prompt": "The", "max_tokens": 30, "ignore_eos": true})");
  });
  REQUIRE(wait_until([&] { return running.server->stats().requests_running == 1; }));
  const auto start = std::chrono::steady_clock::now();
  running.server->stop();
  running.thread.join();  // serve() returns once every connection is closed: the idle one must not hold it
  const double drain_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  running.thread = std::thread([] {});
  request.join();
  CHECK_MESSAGE(in_flight.status == 200, in_flight.body.dump());
  CHECK(in_flight.body["usage"]["completion_tokens"] == 30);
  CHECK(drain_seconds < 10);  // the request's own time, not the idle connection's keep-alive timeout (60 s)
  MESSAGE("stop() drained one request in flight and one idle keep-alive connection in " << drain_seconds << " s");
  auto after = running.client().Get("/health");
  CHECK_FALSE(after);  // nothing listens any more
}

TEST_CASE("operations: /metrics with a model_name label, running within --max-seqs, latency histograms and "
          "finish reasons") {
  Running running;
  std::vector<std::thread> clients;
  for (int i = 0; i < 4; i++)
    clients.emplace_back([&] { post(running, "/v1/chat/completions", image_chat(kImages + "scene_2.png").dump()); });
  for (std::thread& t : clients) t.join();
  CHECK(post(running, "/v1/completions", R"({"prompt": "The", "max_tokens": 3, "ignore_eos": true})").status == 200);
  auto metrics = running.client().Get("/metrics");
  REQUIRE(metrics);
  const std::string& text = metrics->body;
  auto value = [&](const std::string& series) {
    const size_t at = text.find("\n" + series + " ");
    REQUIRE_MESSAGE(at != std::string::npos, series);
    return std::stod(text.substr(at + series.size() + 2));
  };
  const std::string label = R"({model_name="kvlite-captioner-bf16")";
  CHECK(value("kvlite_requests_total" + label + "}") == 5);
  CHECK(value("kvlite_request_success_total" + label + R"(,finished_reason="length"})") == 1);
  CHECK(value("kvlite_request_success_total" + label + R"(,finished_reason="stop"})") == 4);
  CHECK(value("kvlite_time_to_first_token_seconds_count" + label + "}") == 5);
  CHECK(value("kvlite_e2e_request_latency_seconds_count" + label + "}") == 5);
  CHECK(value("kvlite_inter_token_latency_seconds_count" + label + "}") >= 2);
  CHECK(value("kvlite_time_to_first_token_seconds_bucket" + label + R"(,le="+Inf"})") == 5);
  // image tokens are prompt tokens: what the prefix cache reused never exceeds them
  CHECK(value("kvlite_prompt_tokens_total" + label + "}") >= value("kvlite_prefix_tokens_reused_total" + label + "}"));
  CHECK(value("kvlite_prompt_tokens_total" + label + "}") > 4 * 16);
  CHECK(running.server->stats().requests_running <= 16);
}

// Sends raw bytes and reads the answer (until it is complete, the server closes, or 5 s pass).
std::string raw_exchange(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return "connect: " + std::string(strerror(errno));
  }
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string answer;
  char buffer[4096];
  // Reads one whole answer (its headers and Content-Length bytes of body), or until the server closes.
  auto complete = [&] {
    const size_t end = answer.find("\r\n\r\n");
    if (end == std::string::npos) return false;
    const size_t at = answer.find("Content-Length: ");
    if (at == std::string::npos || at > end) return true;
    return answer.size() >= end + 4 + size_t(std::stoul(answer.substr(at + 16)));
  };
  ssize_t n = 0;
  while (!complete() && (n = recv(fd, buffer, sizeof buffer, 0)) > 0) answer.append(buffer, size_t(n));
  if (answer.empty()) answer = "recv " + std::to_string(n) + ": " + std::string(strerror(errno));
  close(fd);
  return answer;
}

TEST_CASE("bounds: compressed bodies get 415 and chunked ones 411 before their body is read, with Connection: "
          "close") {
  Running running;
  const auto start = std::chrono::steady_clock::now();
  const std::string chunked_request = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      "Transfer-Encoding: chunked\r\n\r\n10\r\n{\"messages\": [{\r\n0\r\n\r\n";
  const std::string chunked_answer = raw_exchange(running.port, chunked_request);
  CHECK_MESSAGE(chunked_answer.rfind("HTTP/1.1 411", 0) == 0, chunked_answer);
  CHECK(chunked_answer.find("Content-Length") != std::string::npos);
  CHECK(chunked_answer.find("Connection: close") != std::string::npos);  // a client sends nothing more on it
  // 200 KB that would inflate far past the limit; the server must not read (or inflate) it
  const std::string gzip_request = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   "Content-Encoding: gzip\r\nContent-Length: 200000\r\n\r\n" + std::string(200000, 'x');
  const std::string gzip_answer = raw_exchange(running.port, gzip_request);
  CHECK(gzip_answer.rfind("HTTP/1.1 415", 0) == 0);
  CHECK(gzip_answer.find("Content-Encoding 'gzip'") != std::string::npos);
  CHECK(gzip_answer.find("Connection: close") != std::string::npos);
  MESSAGE("answer to a gzip body: " << gzip_answer.substr(0, 400));
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 4);  // not our 5 s timeout
  CHECK(post(running, "/v1/chat/completions", image_chat(kImages + "scene_1.png").dump()).status == 200);
}

// ---- issue 42: slow and hostile clients (loopback only, bounded in count and time) --------------------------

// A client that connects and trickles the start of a request, then sends nothing more: it holds its connection.
int slow_socket(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  const std::string partial = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le";
  (void)send(fd, partial.data(), partial.size(), MSG_NOSIGNAL);
  return fd;
}

// /health's latency over `count` requests, each on a new connection (as a load balancer probes): p50 and p99 in ms.
std::pair<double, double> health_latency(const Running& running, int count) {
  std::vector<double> ms;
  for (int i = 0; i < count; i++) {
    const auto start = std::chrono::steady_clock::now();
    auto reply = running.client().Get("/health");
    const double took = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    ms.push_back(reply && reply->status == 200 ? took : 1e9);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms[std::min(ms.size() - 1, ms.size() * 99 / 100)]};
}

TEST_CASE("slow clients: /health keeps its latency with 200 slow sockets open, and a request still completes") {
  Running running;
  const auto [p50_before, p99_before] = health_latency(running, 100);
  std::vector<int> slow;
  for (int i = 0; i < 200; i++) slow.push_back(slow_socket(running.port));
  CHECK(std::count(slow.begin(), slow.end(), -1) == 0);
  const auto [p50_slow, p99_slow] = health_latency(running, 100);
  MESSAGE("/health latency p50 / p99: " << p50_before << " / " << p99_before << " ms alone, " << p50_slow << " / "
                                        << p99_slow << " ms with 200 slow sockets open");
  // A liveness bound, not a timing test (the figures are printed above and kept in bench/RESULTS.md): it was no
  // answer at all while the slow sockets held every thread; 3 s leaves room for ASan on 2 busy cores.
  CHECK(p99_slow < 3000);
  const auto start = std::chrono::steady_clock::now();
  Reply reply = post(running, "/v1/chat/completions", image_chat(kImages + "scene_5.png").dump());
  CHECK(reply.status == 200);
  CHECK(reply.body["choices"][0]["message"]["content"] == expected_captions()["scene_5.png"]);
  MESSAGE("an image chat with 200 slow sockets open: " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s");
  for (int fd : slow) close(fd);
}

TEST_CASE("slow clients: a request that stops arriving is dropped after --read-timeout, and connections over "
          "--max-connections get 503") {
  ServeOptions options;
  options.max_queue = 1;
  options.max_connections = 4;  // the cap is at least max_queue + 8 = 9
  options.read_timeout_s = 1;
  Running running(options);
  const int stalled = slow_socket(running.port);
  REQUIRE(stalled >= 0);
  timeval timeout{5, 0};
  setsockopt(stalled, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  const auto start = std::chrono::steady_clock::now();
  char buffer[1024];
  std::string answer;
  const ssize_t n = recv(stalled, buffer, sizeof buffer, 0);  // the answer's first bytes, or the end
  if (n > 0) answer.assign(buffer, size_t(n));
  const double dropped_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  (void)n;
  // answered 400 (or closed) after --read-timeout, never served; the connection then waits as any idle one
  CHECK((answer.empty() || answer.rfind("HTTP/1.1 400", 0) == 0));
  CHECK(dropped_after < 7);
  MESSAGE("a stalled request was dropped after " << dropped_after << " s (--read-timeout 1)");
  close(stalled);
  // Its thread lets go of the connection when it reads the close; until then it still counts against the cap.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Fill the cap with slow sockets: the next connection is refused with 503, not left waiting
  std::vector<int> slow;
  for (int i = 0; i < 9; i++) slow.push_back(slow_socket(running.port));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto refused = running.client().Get("/health");
  REQUIRE(refused);
  CHECK(refused->status == 503);
  CHECK(json::parse(refused->body)["error"]["code"] == "too_many_connections");
  for (int fd : slow) close(fd);
  CHECK(wait_until([&] {
    auto fine = running.client().Get("/health");
    return fine && fine->status == 200;
  }, 10));
}

TEST_CASE("slow clients: a request trickled a byte within every read timeout is cut off at --request-deadline, and "
          "a streamed answer longer than the deadline is not") {
  ServeOptions options;
  options.read_timeout_s = 1;
  options.request_deadline_s = 2;
  options.test_step_delay_us = 20000;  // 20 ms a step: a 150-token answer streams for 3 s, past the deadline
  Running running(options);
  const int fd = slow_socket(running.port);
  REQUIRE(fd >= 0);
  // One more header byte every 0.4 s, each within --read-timeout 1 s: without a deadline it would stay forever.
  const auto start = std::chrono::steady_clock::now();
  bool open = true;
  for (int i = 0; i < 25 && open; i++) {  // 10 s at most
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    char byte = 0;
    if (send(fd, "x", 1, MSG_NOSIGNAL) < 0 || recv(fd, &byte, 1, MSG_DONTWAIT) == 0) open = false;
  }
  const double cut_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  close(fd);
  CHECK_FALSE(open);
  CHECK(cut_after < 8);  // a liveness bound: the deadline is 2 s; without one the loop runs its 10 s
  MESSAGE("a request trickled a byte every 0.4 s was cut off after " << cut_after << " s (--request-deadline 2)");
  // A streamed answer outlasting the deadline completes, and so does a request after it on the same connection.
  json body = {{"prompt", "a small"}, {"max_tokens", 150}, {"ignore_eos", true}, {"stream", true}};
  const auto streamed_start = std::chrono::steady_clock::now();
  Streamed s = post_stream(running, "/v1/completions", body);
  const double streamed_for =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - streamed_start).count();
  CHECK(s.status == 200);
  CHECK(s.done);
  CHECK(s.finish_reason == "length");
  MESSAGE("a 150-token answer streamed for " << streamed_for << " s, uncut");
  httplib::Client client = running.client();
  client.set_keep_alive(true);
  body["stream"] = false;
  body["max_tokens"] = 120;
  for (int i = 0; i < 2; i++) {  // twice on one keep-alive connection, each answer 2.4 s long
    auto reply = client.Post("/v1/completions", body.dump(), "application/json");
    REQUIRE(reply);
    CHECK(reply->status == 200);
  }
}

TEST_CASE("bounds: an image flood is refused before any image is decoded: count first, then each one's bytes") {
  ServeOptions options;
  options.max_image_bytes = 2048;
  Running running(options);
  // Ten 4096 x 4096 PNG headers (each would cost 48 MiB decoded): the count alone refuses them.
  std::string big = read_file(kImages + "scene_1.png").substr(0, 33);
  const unsigned char size[8] = {0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x10, 0x00};
  big.replace(16, 8, reinterpret_cast<const char*>(size), 8);
  json parts = json::array();
  for (int i = 0; i < 10; i++) parts.push_back({{"type", "image_url"}, {"image_url", {{"url", data_uri(big)}}}});
  const json flood = {{"messages", json::array({{{"role", "user"}, {"content", parts}}})}};
  const auto start = std::chrono::steady_clock::now();
  Reply refused = post(running, "/v1/chat/completions", flood.dump());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(refused.status == 400);
  CHECK(refused.body["error"]["message"].get<std::string>().find("carries 10 images") != std::string::npos);
  MESSAGE("10 images refused by count in " << seconds * 1000 << " ms");
  // The flood from 8 clients at once, 40 requests: this process's resident memory (the server runs in it) sampled
  // every 2 ms stays where it was; decoding would take 10 x 48 MiB per request.
  auto resident_kib = [] {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line))
      if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
    return 0LL;
  };
  const long long rss_before = resident_kib();
  std::atomic<long long> rss_peak{rss_before};
  std::atomic<bool> flooding{true};
  std::thread sampler([&] {
    while (flooding) {
      rss_peak = std::max(rss_peak.load(), resident_kib());
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::atomic<int> refused_by_count{0};
  std::vector<std::thread> flooders;
  for (int c = 0; c < 8; c++)
    flooders.emplace_back([&] {
      for (int r = 0; r < 5; r++)
        refused_by_count += post(running, "/v1/chat/completions", flood.dump()).status == 400;
    });
  for (auto& t : flooders) t.join();
  flooding = false;
  sampler.join();
  CHECK(refused_by_count == 40);
  MESSAGE("resident memory under a flood of 40 requests x 10 images of 4096 x 4096: " << rss_before / 1024 << " MiB "
          "before, " << rss_peak / 1024 << " MiB at the peak");
  CHECK(rss_peak - rss_before < 96 * 1024);  // one decoded image alone would be 48 MiB
  // One image (2854 bytes) over --max-image-bytes (2048 here): 413 from its base64 length, before it is decoded
  const std::string scene = read_file(kImages + "scene_1.png");
  REQUIRE(scene.size() > 2048 + 3);
  Reply heavy = post(running, "/v1/chat/completions", image_chat(kImages + "scene_1.png").dump());
  CHECK(heavy.status == 413);
  CHECK(heavy.body["error"]["message"].get<std::string>().find("--max-image-bytes") != std::string::npos);
}

TEST_CASE("structured output: response_format json_schema and json_object give JSON valid against the schema, streamed or not") {
  Running running;
  // (ordered_json: the request carries the schema's properties in their order, which the output must follow)
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(R"({"type": "object", "properties": {"shapes": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {"size": {"enum": ["small", "large"]}, "color": {"enum": ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]}, "shape": {"enum": ["circle", "square", "triangle"]}}, "required": ["size", "color", "shape"]}}}, "required": ["shapes"]})");
  const std::string image = "data:image/png;base64," + base64(read_file(kImages + "scene_1.png"));
  for (bool stream : {false, true}) {
    CAPTURE(stream);
    nlohmann::ordered_json body = nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}},
                                 {"type": "text", "text": "Describe this image."}]}],
                                 "max_tokens": 200, "temperature": 0,
                                 "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "strict": true}}})");
    body["messages"][0]["content"][0]["image_url"]["url"] = image;
    body["stream"] = stream;
    body["response_format"]["json_schema"]["schema"] = schema;
    std::string content, finish;
    if (!stream) {
      Reply reply = post(running, "/v1/chat/completions", body.dump());
      REQUIRE_MESSAGE(reply.status == 200, reply.body.dump());
      content = reply.body["choices"][0]["message"]["content"];
      finish = reply.body["choices"][0]["finish_reason"];
    } else {
      auto reply = running.client().Post("/v1/chat/completions", body.dump(), "application/json");
      REQUIRE(reply);
      REQUIRE(reply->status == 200);
      std::istringstream events(reply->body);
      for (std::string line; std::getline(events, line);) {
        if (line.rfind("data: {", 0) != 0) continue;
        const json chunk = json::parse(line.substr(6));
        if (chunk["choices"].empty()) continue;
        const json& choice = chunk["choices"][0];
        if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
        if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
      }
    }
    CAPTURE(content);
    CHECK(finish == "stop");
    const json caption = json::parse(content);
    REQUIRE(caption.contains("shapes"));
    CHECK(caption.size() == 1);
    CHECK(caption["shapes"].size() >= 1);
    CHECK(caption["shapes"].size() <= 3);
    for (const json& shape : caption["shapes"]) CHECK(shape.size() == 3);
    CHECK(content.find("\"size\"") < content.find("\"color\""));  // the schema's order (json would sort)
  }
  // json_object: a JSON object, whole even when max_tokens cuts it (the budget mask)
  for (int max_tokens : {120, 12}) {
    json body = json::parse(R"({"messages": [{"role": "user", "content": "Say something."}], "temperature": 1.0,
                                 "seed": 3, "response_format": {"type": "json_object"}})");
    body["max_tokens"] = max_tokens;
    Reply reply = post(running, "/v1/chat/completions", body.dump());
    REQUIRE(reply.status == 200);
    const std::string text = reply.body["choices"][0]["message"]["content"];
    CAPTURE(text);
    CHECK(json::parse(text).is_object());
  }
}

TEST_CASE("function calling: tools reach the template, tool_choice required or named gives OpenAI tool_calls, streamed or not") {
  Running running;
  const std::string tools = R"([{"type": "function", "function": {"name": "grasp", "description": "Grasp an object",
      "parameters": {"type": "object", "properties": {"object": {"enum": ["circle", "square", "star"]}, "force": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["object", "force"]}}},
      {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}}}])";
  auto request = [&](const std::string& choice, bool stream) {
    return R"({"messages": [{"role": "user", "content": "Pick up the circle."}], "max_tokens": 200, "temperature": 0,
               "stream": )" + std::string(stream ? "true" : "false") + R"(, "tools": )" + tools + R"(, "tool_choice": )" + choice + "}";
  };
  auto check_call = [](const json& call, const std::string& expected_name) {
    CHECK(call["type"] == "function");
    CHECK(call["id"].get<std::string>().rfind("call_", 0) == 0);
    const std::string name = call["function"]["name"];
    if (!expected_name.empty()) CHECK(name == expected_name);
    const json arguments = json::parse(call["function"]["arguments"].get<std::string>());  // a JSON object's text
    CHECK(arguments.is_object());
    if (name == "grasp") {
      CHECK(arguments.size() == 2);
      CHECK(arguments["force"].get<int>() >= 1);
      CHECK(arguments["force"].get<int>() <= 10);
    } else {
      CHECK(name == "stop");
    }
  };
  for (const std::string& choice : {std::string(R"("required")"), std::string(R"({"type": "function", "function": {"name": "grasp"}})")}) {
    CAPTURE(choice);
    const std::string expected = choice == R"("required")" ? "" : "grasp";
    Reply reply = post(running, "/v1/chat/completions", request(choice, false));
    REQUIRE_MESSAGE(reply.status == 200, reply.body.dump());
    const json& message = reply.body["choices"][0]["message"];
    CHECK_MESSAGE(reply.body["choices"][0]["finish_reason"] == "tool_calls", reply.body.dump());
    CHECK(message["content"].is_null());
    REQUIRE(message["tool_calls"].is_array());
    REQUIRE(message["tool_calls"].size() >= 1);
    for (const json& call : message["tool_calls"]) check_call(call, expected);
    // streamed: the calls come as one tool_calls delta with indexes, then the finish reason
    auto streamed = running.client().Post("/v1/chat/completions", request(choice, true), "application/json");
    REQUIRE(streamed);
    REQUIRE(streamed->status == 200);
    std::istringstream events(streamed->body);
    json calls = json::array();
    std::string finish;
    for (std::string line; std::getline(events, line);) {
      if (line.rfind("data: {", 0) != 0) continue;
      const json chunk = json::parse(line.substr(6));
      if (chunk["choices"].empty()) continue;
      const json& c = chunk["choices"][0];
      if (c["delta"].contains("tool_calls"))
        for (const json& call : c["delta"]["tool_calls"]) calls.push_back(call);
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
    CHECK(finish == "tool_calls");
    REQUIRE(calls.size() == message["tool_calls"].size());
    for (size_t i = 0; i < calls.size(); i++) {
      CHECK(calls[i]["index"] == i);
      CHECK(calls[i]["function"] == message["tool_calls"][i]["function"]);  // greedy: the same calls
    }
  }
  // tool_choice none: the text is never parsed for calls
  Reply with_tools = post(running, "/v1/chat/completions", request(R"("none")", false));
  REQUIRE(with_tools.status == 200);
  CHECK_FALSE(with_tools.body["choices"][0]["message"].contains("tool_calls"));
  // The tools reach a template that lists them (Qwen3's, on the tiny fixture; the captioner's template has no
  // tools section): the prompt a request renders holds the tool's description and the template's instructions
  std::string message;
  kvlite_server::ParsedRequest parsed;
  REQUIRE(kvlite_server::parse_request(true, request(R"("auto")", false), "m", 256, 256, &parsed, &message) == 200);
  auto qwen = kvlite::Tokenizer::load(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen3");
  REQUIRE(qwen);
  auto rendered = kvlite_server::render_chat(*qwen, parsed, true);
  REQUIRE_MESSAGE(rendered, rendered.error().message);
  CHECK_MESSAGE(rendered->find("Grasp an object") != std::string::npos, *rendered);
  CHECK(rendered->find("<tool_call>") != std::string::npos);
  // auto: free text, parsed for calls in the template's syntax (this tiny captioner writes none)
  Reply automatic = post(running, "/v1/chat/completions", request(R"("auto")", false));
  REQUIRE(automatic.status == 200);
  CHECK(automatic.body["choices"][0]["message"]["content"].is_string());
  // refused: required without tools, a bad tool
  const std::string no_tools = R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})";
  CHECK(post(running, "/v1/chat/completions", no_tools).status == 400);
  const std::string bad_tool = R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]})";
  Reply bad = post(running, "/v1/chat/completions", bad_tool);
  CHECK(bad.status == 400);
  CHECK(bad.body["error"]["message"].get<std::string>().find("a b") != std::string::npos);
}

TEST_CASE("a Qwen2.5-VL directory serves as it is: a chat with an image gives what generate_chat gives") {
  // tests/fixtures/vl/qwen2_5_vl (tools/make_vl25_fixtures.py): window attention, sectioned M-RoPE
  const std::string dir = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/vl/qwen2_5_vl/tiny-qwen2.5-vl";
  const std::string image_path = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/images/photo_67x45.png";
  Running running({}, 64 * kvlite::MiB, dir);
  json body = image_chat(image_path);
  body["max_tokens"] = 8;
  Reply reply = post(running, "/v1/chat/completions", body.dump());
  REQUIRE(reply.status == 200);
  kvlite::EngineOptions engine_options;
  engine_options.backend = kvlite::BackendChoice::cpu;
  engine_options.plan.device_mem = 64 * kvlite::MiB;
  auto engine = kvlite::Engine::open(dir, engine_options);
  REQUIRE_MESSAGE(engine.ok(), engine.error().message);
  auto image = kvlite::load_image(image_path);
  REQUIRE(image);
  kvlite::SamplingParams params;
  params.max_tokens = 8;
  auto expected = (*engine)->generate_chat({{"user", std::string(kvlite::kImagePlaceholder) + "Describe this image."}},
                                           {*image}, params);
  REQUIRE_MESSAGE(expected.ok(), expected.error().message);
  REQUIRE(expected->ids.size() == 8);
  CHECK(reply.body["choices"][0]["message"]["content"] == expected->text);
  CHECK(reply.body["usage"]["completion_tokens"].get<int64_t>() == 8);
  CHECK(reply.body["usage"]["prompt_tokens"].get<int64_t>() == int64_t(expected->prompt_ids.size()));
}
