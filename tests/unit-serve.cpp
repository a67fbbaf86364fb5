// serve: `kvlite serve`'s OpenAI-compatible server on loopback, in process, over the bundled captioner (CPU):
// every endpoint, streaming and not, images as data: URIs, every kind of bad input with its status code and
// message, a full queue, and a load test of 200 concurrent mixed requests (20 clients disconnecting midway) in
// which every completed request's text equals what it gets alone, none is lost, and the KV pool ends empty.
#include <doctest/doctest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
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
  explicit Running(ServeOptions options = {}) {
    options.port = 0;
    kvlite::EngineOptions engine_options;
    engine_options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    engine_options.plan.device_mem = 256 * kvlite::MiB;
    engine_options.plan.max_seqs = 16;
    engine_options.threads = 1;
    auto engine = kvlite::Engine::open(kCaptioner, engine_options);
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

// status -1 when no response came (the error's name in body["transport_error"]); never REQUIRE: client threads.
Reply post(const Running& running, const std::string& path, const std::string& body) {
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
};

Streamed post_stream(const Running& running, const std::string& path, const json& body, int disconnect_after = 0) {
  Streamed out;
  std::string buffer;
  httplib::Client c = running.client();
  httplib::Request request;
  request.method = "POST";
  request.path = path;
  request.body = body.dump();
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
  CHECK(metrics->body.find("kvlite_requests_total 11") != std::string::npos);
  CHECK(metrics->body.find("kvlite_kv_pages_used 0") != std::string::npos);
  // The same chat with the same image, asked repeatedly above: the prefix cache served its pages.
  CHECK(metrics->body.find("# TYPE kvlite_prefix_tokens_reused_total counter") != std::string::npos);
  CHECK(metrics->body.find("kvlite_prefix_tokens_reused_total 0\n") == std::string::npos);
  CHECK(metrics->body.find("kvlite_kv_pages_cached 0\n") == std::string::npos);
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
int send_raw_post(int port, const std::string& path, const std::string& body) {
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
        Reply reply = post(running, "/v1/completions", R"({"prompt": "a small", "max_tokens": 64, "stop": ["zzzz"]})");
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

TEST_CASE("200 concurrent mixed requests (60 under ASan), 10% disconnecting midway: every completed text equals its "
          "solo run, none is lost, the KV pool ends empty") {
  ServeOptions options;
  options.max_queue = 256;
  Running running(options);
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
  CHECK(kvlite_server::check_request(false, body_nested(64), "m", 16, &message) == 200);  // 64 levels: the limit
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
