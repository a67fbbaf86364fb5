// openai_server: `kvlite serve`, an OpenAI-compatible HTTP server over one kvlite::Engine, built on cpp-httplib.
//
//   POST /v1/chat/completions   messages (text, and image_url parts as data: URIs with base64 JPEG / PNG),
//                               stream (server-sent events), max_tokens, temperature, top_p, top_k, seed, stop
//   POST /v1/completions        a prompt string, the same sampling fields
//   GET  /v1/models, /health, /metrics (Prometheus text)
//
// Requests from every client share the engine through continuous batching: HTTP threads parse and validate,
// one engine thread owns the engine (tokenizing, preprocessing, submitting and stepping), and each request's
// text flows back through its own channel. A client that goes away, streaming or not, ends its request at its
// next token (or before it starts), which frees its pages. Errors are OpenAI's: {"error": {"message", "type", "param", "code"}} with 400
// for bad input (the message names the field), 404 for an unknown model, 413 for an oversized body or image,
// 503 when the queue is full.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvlite.hpp"

namespace kvlite_server {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                             // 0: any free port (tests)
  uint64_t max_body_bytes = uint64_t(32) << 20;  // larger bodies: 413
  int64_t max_queue = 64;                      // requests waiting or running; more: 503
  int64_t max_tokens = 0;                      // a request's max_tokens cap; 0: the engine's max_model_len
  int64_t default_max_tokens = 256;            // when a request names none
  std::string model_name;                      // what /v1/models lists; empty: the plan's model name
  int64_t test_step_delay_us = 0;              // tests: a pause after each engine step (a slow device)
  std::string api_key;                         // non-empty: /v1 routes need "Authorization: Bearer <key>" (else 401)
  std::vector<std::string> allowed_origins;    // CORS: origins answered (and preflights allowed); "*" any; empty none
  double shutdown_timeout_s = 30;              // stop(): how long requests in flight may take to finish
  int64_t max_image_bytes = int64_t(20) << 20;  // one image's encoded bytes; more: 413 before it is decoded
  int64_t max_connections = 512;  // connections served at once (a thread each); more get 503 and are closed
  int64_t read_timeout_s = 10;    // the longest wait for the next bytes of a request's headers or body
  // The longest a request may take to arrive whole (line, headers, body), counted from when its connection became
  // ready for it (opened, or the previous answer sent): a client trickling a byte within every read timeout is cut
  // off then, and so is a connection idle that long between requests.
  int64_t request_deadline_s = 60;
};

// Counters /metrics reports (also read by tests).
struct ServeStats {
  int64_t requests_total = 0, requests_running = 0, requests_waiting = 0, requests_rejected = 0;
  int64_t requests_abandoned = 0;  // clients that went away before their request finished
  int64_t kv_pages_used = 0, kv_pages_free = 0;
  int64_t kv_pages_cached = 0, prefix_tokens_reused_total = 0;  // prefix caching
  int64_t tokens_generated_total = 0, prompt_tokens_total = 0, preemptions_total = 0;
  double tokens_per_second = 0;  // generated tokens over the engine's busy time
};

class OpenAIServer {
 public:
  // Takes the engine; validates the options (invalid_argument naming the value).
  static kvlite::Result<std::unique_ptr<OpenAIServer>> create(std::unique_ptr<kvlite::Engine> engine,
                                                              const ServeOptions& options);
  ~OpenAIServer();  // stops and joins everything
  OpenAIServer(const OpenAIServer&) = delete;
  OpenAIServer& operator=(const OpenAIServer&) = delete;

  // Binds host:port (port 0: any); returns the port bound. io_error when the address cannot be bound.
  kvlite::Result<int> bind();
  // Serves until stop(); returns when stopped.
  void serve();
  // Drains: new requests get 503 and the listening socket closes; idle keep-alive connections are closed at
  // once; requests in flight finish (up to shutdown_timeout_s, then they are cancelled). Blocks until then.
  void stop();
  ServeStats stats() const;

 private:
  OpenAIServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Helpers, exposed for tests: base64 (RFC 4648, standard alphabet, padding required, no whitespace), and a
// data: URI's bytes ("data:image/png;base64,...").
kvlite::Result<std::string> decode_base64(const std::string& text);
kvlite::Result<std::string> decode_data_uri(const std::string& uri);
// A request body as the server reads it: what its engine thread hands the engine.
struct ParsedRequest {
  bool chat = true;                           // /v1/chat/completions, else /v1/completions
  std::vector<kvlite::ChatMessage> messages;  // chat, as text (tool calls written in the Hermes form)
  // chat, as the model's template takes them (JSON): role, content, and tool_calls (arguments as objects),
  // tool_call_id, name, reasoning_content as the client sent them
  std::string template_messages = "[]";
  std::string prompt;                         // completions
  std::vector<kvlite::Image> images;          // decoded from the messages' data: URIs
  kvlite::SamplingParams params;              // every field within the server's and kvlite::validate's ranges
  bool stream = false, include_usage = false;
  // Function calling: the `tools` array as the client wrote it (JSON, "" for none), tool_choice as "none",
  // "auto", "required" or a function's name, and parallel_tool_calls. With tools and a tool_choice other than
  // none the answer's calls are parsed out of the text (finish_reason "tool_calls"); "required" and a named
  // function constrain the output to calls in the model's syntax (kvlite::tool_calls_gbnf).
  std::string tools_json;
  std::string tool_choice = "none";
  bool parallel_tool_calls = true;
};
// Reads `body` with the server's checks (the library's JSON limits first): 200 and *out (may be NULL) filled
// when it would be queued, else the HTTP status and, in *message, why. max_tokens_cap bounds max_tokens;
// default_max_tokens is used when the request names none. For tests and the fuzz harnesses.
int parse_request(bool chat, const std::string& body, const std::string& model_name, int64_t max_tokens_cap,
                  int64_t default_max_tokens, ParsedRequest* out, std::string* message);
// A chat request's prompt: the model's own template over the structured messages when it ships one (tool calls
// and results as the template writes them), else kvlite's fallback layout over the text messages.
kvlite::Result<std::string> render_chat(const kvlite::Tokenizer& tokenizer, const ParsedRequest& request,
                                        bool add_generation_prompt);
// What the engine thread does with a parsed request: formats the chat (or encodes the prompt), preprocesses
// its images and submits it. *prompt_tokens (may be NULL): the prompt's length, on success.
kvlite::Result<kvlite::RequestId> submit_request(kvlite::Engine& engine, const ParsedRequest& request,
                                                 const kvlite::TokenCallback& on_token, int64_t* prompt_tokens = nullptr);
// The server's reading of a request body without an engine (chat: /v1/chat/completions, else /v1/completions):
// 200 when it would be queued, else the HTTP status it answers with and, in *message, why. Images are decoded.
// For the fuzz harness (tests/fuzz/fuzz_serve_request.cpp) and tests.
int check_request(bool chat, const std::string& body, const std::string& model_name, int64_t max_tokens_cap,
                  std::string* message);

}  // namespace kvlite_server
