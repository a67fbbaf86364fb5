// ---------------------------------------------------------------------------------------------------------
// engine: the public API. Opens a model directory into one arena, then generates text (streaming, several
// requests batched continuously over the paged KV cache), scores text (perplexity) and returns logits.
//
//   #include "kvlite.hpp"   // in one .cpp: #define KVLITE_IMPLEMENTATION first
//   kvlite::EngineOptions options;
//   options.plan.max_model_len = 4096;                                  // what the KV arena is sized for
//   auto engine = kvlite::Engine::open("models/Qwen3-4B", options);    // plan, arena, weights, tokenizer
//   if (!engine) { fprintf(stderr, "%s\n", engine.error().message.c_str()); return 1; }
//   kvlite::SamplingParams params;                                      // greedy; temperature > 0 samples
//   params.max_tokens = 200;
//   auto out = (*engine)->generate("The capital of France is", params,
//                                  [](const std::string& piece, int32_t) { fputs(piece.c_str(), stdout); return true; });
//   auto ppl = (*engine)->score(text, /*context_length=*/2048, /*stride=*/512);  // ppl->perplexity
//
// Requests. generate() runs one request to its end (and advances any others submitted before). For many
// at once: submit() each, then run() (or step() in your own loop) and take each result(). Each step packs the
// next token of every decoding sequence plus prefill chunks of the others, up to max_batched_tokens. KV pages
// are taken as tokens arrive and returned when a sequence ends. When pages run out, new requests wait and,
// if a running one cannot grow, the most recently started one is preempted: its pages are freed and it is
// recomputed from its tokens later, giving the same tokens. A request that could never fit (prompt +
// max_tokens > max_model_len, or more pages than the whole arena) is refused up front with does_not_fit.
//
// Threads: every call is safe from any thread. One internal lock serialises the calls (generate*, submit, step,
// run, result, finished, score, logits, encode_images, preprocess, tokenize, detokenize, set_op_timing,
// measure_copy_bandwidth), each holding it for its whole run: a second thread's call waits, then runs. Taking no
// lock: cancel() (atomics only, async-signal-safe: a SIGINT handler may call it) stops the running call
// (generate, run, step, score, logits) at its next step, dropping every request in flight -- generate returns its
// text so far with FinishReason::cancelled, the others fail with ErrorCode::cancelled -- and does nothing when
// no call runs; cancel(id) ends one request (any thread, not a signal handler);
// stats() returns the counters as of the last step without waiting; info(), plan(), config(), tokenizer() and
// stop_token_ids() are fixed at open. Callbacks run inside the engine's step on the calling thread: they may call
// cancel(), cancel(id), stats() and set_op_timing(); another call from a token callback fails with
// invalid_argument (src/manual.txt THREADS; tests/unit-threads.cpp, also under ThreadSanitizer).
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

struct EngineOptions {
  // The memory plan. device_mem, when set, is the memory the plan divides: on the CPU the budget's base; on CUDA
  // the card to plan for, so an H200 opened with 8 GiB behaves exactly as an 8 GiB card (one reservation of the
  // plan's arena). activation_dtype: CUDA's BF16 default, F16 or F32; the CPU's F32 default (the reference), or
  // BF16 / F16 to run the GPU's rounding on the CPU.
  PlanOptions plan;
  // Where to compute (device.hpp): auto, the GPU when one is usable, else the CPU saying why (Plan::backend_rule),
  // as the C API (kvlite_options_init), the CLI and the manual's DEFAULTS say; cpu for the float32 reference every
  // reference-checked result assumes (the tests name it).
  BackendChoice backend = BackendChoice::auto_;
  int device = 0;            // CUDA device index
  bool cuda_graphs = true;   // CUDA: replay decode steps from graphs captured at open (one per batch bucket)
  // CUDA, sm_90+: launch kernels with programmatic dependent launch (CudaBackendOptions::programmatic_launch;
  // bit for bit the same results). EngineInfo::backend_name says when it is in effect.
  bool cuda_programmatic_launch = true;
  // Prefix caching: full KV pages stay cached under a hash chain of their tokens (and, with images, of their
  // M-RoPE positions and image features) and later requests that start with the same tokens reuse them instead
  // of recomputing; cached pages are evicted least recently used when pages run out. Unset: on where it is exact,
  // the CPU backend (whose K/V for a token does not depend on how a prefill was chunked); off on CUDA, whose
  // GEMMs may round a row differently with the batch around it.
  std::optional<bool> prefix_caching;
  int threads = 0;   // CPU worker threads; 0: one per hardware thread
  CpuKernels cpu_kernels = CpuKernels::fast;  // CPU Linears: the SIMD kernels (default) or the reference loops (CpuKernels)
  // CPU: the lm_head as stored (default) or an int8 copy made at load (CpuLmHead; the draft model's stays as
  // stored). invalid_argument on CUDA.
  CpuLmHead cpu_lm_head = CpuLmHead::stored;
  // fp8 checkpoints: quantize each activation row to fp8 and back before the matmul (W8A8, what the GPU's fp8
  // tensor cores compute) instead of multiplying float activations by the dequantized weight (W8A16).
  bool fp8_activations = false;
  // Speculative decoding with a draft model: the directory of a smaller model with the target's tokenizer (a
  // text model: llama, qwen2, qwen3) that drafts plan.speculative_tokens tokens per step for the target to verify
  // in one forward pass. Planned with the target (plan_engine: its weights, buffers and KV beside every page);
  // the CPU backend only so far. Empty: none (n-gram drafting is plan.ngram).
  std::string draft_model;
  // Called during open with the checkpoint's bytes made ready so far and their total: (0, total) once planned,
  // then as weights become ready (CUDA: after each layer's upload; the CPU: after each tensor is paged in from
  // its mapped file), and
  // (total, total) when they are all there. Returning false aborts the open cleanly: it fails with
  // ErrorCode::cancelled and everything taken so far (the arena, the mapping) is released.
  std::function<bool(uint64_t done_bytes, uint64_t total_bytes)> load_progress;
  // Logs: every message this engine logs (at open and in its calls) starts with "<name>: " -- empty: the model
  // directory's last component -- and goes to `log` when set (messages below log_level dropped), on the thread
  // of the call, else to the process-wide set_log_callback.
  std::string name;
  LogCallback log;
  LogLevel log_level = LogLevel::info;
};

// The plan Engine::open(model_dir, options) makes, without reading a byte of weights or touching GPU memory:
// the same backend choice (options.backend, options.device), the same device, the same numbers, byte for byte
// (`kvlite plan` prints it). With --backend cuda and no GPU here, device_mem plans a card that is not present:
// such a plan is made, and Engine::open refuses it (unsupported without CUDA, device_error without a GPU).
Result<Plan> plan_engine(const std::string& model_dir, const EngineOptions& options);
Result<Plan> plan_engine(const PlanInputs& inputs, const EngineOptions& options);

// Why a generation ended.
enum class FinishReason {
  running,      // not finished yet
  stop_token,   // an end-of-turn token (the tokenizer's eos, <|im_end|>, <|eot_id|>, generation_config's
                // eos_token_id, or SamplingParams::stop_tokens); it is the last id, its text is not emitted
  stop_string,  // the text reached one of SamplingParams::stop_strings; the text stops before it
  max_tokens,   // SamplingParams::max_tokens ids were generated
  length,       // the context is full: prompt + output reached the engine's max_model_len (vLLM's "length")
  callback,     // the token callback returned false
  cancelled,    // Engine::cancel()
  grammar_end,  // SamplingParams::grammar / json_schema: the output is a complete sentence and nothing may follow
};
const char* finish_reason_name(FinishReason reason);

// Called with each piece of text as it becomes final and the id that completed it. Pieces are whole UTF-8
// characters (a character split across tokens arrives with its last token, so a piece may be ""), and text
// that may turn out to start a stop string is held back until it does not. Text still held when generation
// ends arrives in a last call with id -1. Return false to end this request (FinishReason::callback).
using TokenCallback = std::function<bool(const std::string& piece, int32_t id)>;

using RequestId = int64_t;

struct Generation {
  RequestId request = 0;  // the id it ran as: submit()'s, or the one generate() took (cancel(id), the logs)
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> ids;  // generated ids, the stop token included when one ended it (as transformers)
  std::vector<float> logprobs;  // SamplingParams::logprobs: log p(ids[i] | everything before it); else empty
  std::string text;          // the text streamed to the callback: without the stop token or stop string
  FinishReason finish_reason = FinishReason::running;
};

// Perplexity of a token sequence with transformers' sliding-window recipe (score_windows): each window is
// read on its own, and each token after the first is scored once with the context its window gives it.
struct ScoreResult {
  double perplexity = 0;         // exp(nll_sum / tokens)
  double nll_sum = 0;            // sum of -log p(token | context) over the scored tokens
  int64_t tokens = 0;            // scored tokens: all but the first
  std::vector<double> logprobs;  // [n]: logprobs[p] = log p(ids[p] | window context); logprobs[0] = NaN
  // The figure transformers' guide prints: each window's mean loss weighted by (its target count - 1). It
  // differs slightly from `perplexity` when stride < context (the guide's weights are off by one there).
  double guide_perplexity = 0;
  int64_t windows = 0;
  int64_t context_length = 0, stride = 0;
};
// Called after each window is scored.
using ScoreProgress = std::function<void(int64_t windows_done, int64_t windows_total)>;

// Logits of every position: values[t * vocab + j] = logit of token j after ids[0..t].
struct Logits {
  int64_t tokens = 0, vocab = 0;
  std::vector<float> values;  // [tokens, vocab] float32
};

// The vision tower's outputs for some images (transformers' get_image_features), one row per image token in
// order: level 0 the merger's embedding (it replaces the token's embedding), level 1 + j the DeepStack
// feature added to the token's hidden state after decoder layer j.
struct ImageFeatures {
  int64_t levels = 0, tokens = 0, hidden = 0;
  std::vector<float> values;  // [levels, tokens, hidden]
};

// How a Qwen3-VL prompt places an image: the engine expands the <|image_pad|> to the image's tokens.
constexpr const char* kImagePlaceholder = "<|vision_start|><|image_pad|><|vision_end|>";

// Counters since open().
struct EngineStats {
  int64_t steps = 0;             // forward steps
  int64_t graph_steps = 0;       // of which replayed from a CUDA graph
  int64_t tokens_computed = 0;   // tokens through the model (prefill and decode, recomputation included)
  int64_t tokens_generated = 0;  // ids sampled
  int64_t preemptions = 0;       // running requests preempted for KV pages (and recomputed later)
  int64_t peak_running = 0;      // most sequences in one step
  // Speculative decoding: drafted tokens the target verified, and how many it accepted (each accepted draft is
  // a token gained without a forward pass of its own).
  int64_t draft_tokens = 0;
  int64_t draft_tokens_accepted = 0;
  // A draft model's forward passes (catching up with new tokens, then one per drafted token) and the tokens
  // they read.
  int64_t draft_steps = 0;
  int64_t draft_tokens_computed = 0;
  // Prefix caching: KV pages a new request took from the cache instead of computing them, and their tokens
  // (pages held by the cache: arena().kv().stats().cached_pages).
  int64_t prefix_pages_reused = 0;
  int64_t prefix_tokens_reused = 0;
  // Constrained decoding (SamplingParams::grammar, json_schema): rows masked, and of those how many needed a
  // new vocabulary walk (the rest found their parse state's mask remembered), and the walks' time.
  int64_t grammar_rows = 0;
  int64_t grammar_masks_computed = 0;
  double grammar_mask_seconds = 0;
  // Each backend op's calls and wall time while op timing was on (Engine::set_op_timing), since open.
  OpTimes op_times{};
};

// What the engine runs on, fixed at open (kvlite bench prints it).
struct EngineInfo {
  BackendKind backend = BackendKind::cpu;
  std::string backend_name;             // Backend::name(): "cuda (NVIDIA H200, sm_90, BF16 activations)"
  DType activation_dtype = DType::F32;
  // Bytes of weights one decode step reads, as the backend stores them: every Linear of every layer, the norms
  // and the lm_head (not the embedding table, of which a step reads a few rows unless it is the tied lm_head).
  uint64_t decode_weight_bytes = 0;
  std::vector<int64_t> graph_buckets;   // CUDA: batch sizes with a captured decode graph (empty: none)
  bool prefix_caching = false;          // EngineOptions::prefix_caching as resolved for this backend
  // CUDA: device memory the captured graphs took, measured with cudaMemGetInfo around their capture (the plan's
  // "graphs" row is an estimate of this).
  uint64_t graph_memory_bytes = 0;
  // PlanOptions::host_embeddings in effect: the forward pass looks the embedding rows up in the host table
  // (Backend::gather_host_rows; on CUDA through pinned staging, the table never on the device).
  bool host_embeddings = false;
};

// Engine::measure_copy_bandwidth's result.
struct CopyBandwidth {
  double bytes_per_second = 0;  // bytes read + written
  uint64_t bytes = 0;           // per copy
  int repeats = 0;
  std::string method;           // "cudaMemcpy device to device" or "memcpy"
};

// Writes a float32 [rows, cols] array as a NumPy .npy file (format 1.0, little-endian, C order), byte for
// byte what numpy.save writes. io_error naming the path when it cannot be written.
Status write_npy(const std::string& path, const float* values, int64_t rows, int64_t cols);

class Engine {
 public:
  // Loads config.json and the safetensors headers, chooses the backend (options.backend), plans for its device
  // (options.plan), reserves the one arena (host memory, or ONE cudaMalloc on a GPU), binds the weights (CPU:
  // views into the mmap, BF16/F16/F32 as on disk; CUDA: uploaded into the arena's weights region in chunks,
  // Linears converted to the activation dtype; absent tensors are missing_tensor, listing them), makes the
  // backend, captures the CUDA decode graphs and loads the tokenizer. No device allocation happens after open.
  // Errors: whatever those steps report, e.g. does_not_fit with the plan's advice when the memory budget is too
  // small, unsupported for --backend cuda in a build without CUDA, device_error when no GPU is usable.
  // Qwen3-VL on CUDA: the vision tower's weights are uploaded after the text model's (Linears in the activation
  // dtype) and it runs on the GPU with buffers from the plan's "vision" region; its outputs come to the host as
  // floats and go back as the image rows (within 5e-7 of the CPU backend's in F32 on an H100).
  static Result<std::unique_ptr<Engine>> open(const std::string& model_dir, const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Plan& plan() const;
  const ModelConfig& config() const;
  const Tokenizer& tokenizer() const;
  const Arena& arena() const;
  // The ids generation stops at unless SamplingParams adds more (sorted).
  const std::vector<int32_t>& stop_token_ids() const;

  Result<std::vector<int32_t>> tokenize(const std::string& text, bool add_special_tokens = true) const;
  Result<std::string> detokenize(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // One request to its end. The text is encoded with the tokenizer's special tokens (Llama-3 prepends
  // <|begin_of_text|>); generate_chat formats the messages in the model's chat format with an open
  // assistant turn.
  Result<Generation> generate(const std::string& prompt, const SamplingParams& params,
                              const TokenCallback& on_token = nullptr);
  Result<Generation> generate(const std::vector<int32_t>& prompt_ids, const SamplingParams& params,
                              const TokenCallback& on_token = nullptr);
  Result<Generation> generate_chat(const std::vector<ChatMessage>& messages, const SamplingParams& params,
                                   const TokenCallback& on_token = nullptr);

  // Vision models (qwen3_vl): prompts with images. The prompt holds one <|image_pad|> per image, in order
  // (kImagePlaceholder, wrapped in <|vision_start|> ... <|vision_end|> as Qwen's chat template writes it);
  // the engine expands each to its image's tokens (Generation::prompt_ids shows the expanded ids), runs the
  // vision tower when the request is submitted, and gives the image tokens their M-RoPE positions. Images are
  // preprocessed with preprocess(). Errors: unsupported for a model without a vision tower; invalid_argument
  // when placeholders and images differ in number; does_not_fit, before any image is preprocessed, when a
  // request carries more images than the plan's max_images (its images are encoded together).
  //   auto image = kvlite::load_image("cat.jpg");
  //   auto out = engine->generate_chat({{"user", std::string(kvlite::kImagePlaceholder) + "Describe it."}},
  //                                    {*image}, params, on_token);
  Result<Generation> generate(const std::string& prompt, const std::vector<Image>& images,
                              const SamplingParams& params, const TokenCallback& on_token = nullptr);
  Result<Generation> generate_chat(const std::vector<ChatMessage>& messages, const std::vector<Image>& images,
                                   const SamplingParams& params, const TokenCallback& on_token = nullptr);
  Result<Generation> generate(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images,
                              const SamplingParams& params, const TokenCallback& on_token = nullptr);
  // preprocess_image with the model's options: the processor's (preprocessor_config.json) with its pixel
  // budget capped at the plan's max_image_pixels (larger images are scaled down to fit the vision buffers).
  Result<VisionInput> preprocess(const Image& image) const;
  // The vision tower alone (transformers' get_image_features): the images' merged embeddings and DeepStack
  // features, one row per image token. Any number of images: they are encoded max_images at a time.
  Result<ImageFeatures> encode_images(const std::vector<VisionInput>& images);

  // Continuous batching. submit() validates and queues a request (does_not_fit when it could never fit);
  // step() runs one forward step over everything runnable and returns whether requests remain unfinished;
  // run() steps until none does. result() hands over a finished request's Generation (once; invalid_argument
  // for an unknown id or one still running).
  Result<RequestId> submit(const std::vector<int32_t>& prompt_ids, const SamplingParams& params,
                           const TokenCallback& on_token = nullptr);
  Result<RequestId> submit(const std::vector<int32_t>& prompt_ids, const std::vector<VisionInput>& images,
                           const SamplingParams& params, const TokenCallback& on_token = nullptr);
  Result<bool> step();
  Status run();
  // Times every backend op from the next one on (Backend::set_op_timing; EngineStats::op_times adds up each op's
  // calls and wall time, each op waiting for its own work), or stops. Slower, and on CUDA the steps run eagerly
  // while it is on (a graph replays many ops as one): for finding where a step's time goes (kvlite bench
  // --profile). May be called from a token callback: it takes effect at the next op.
  void set_op_timing(bool on);
  bool finished(RequestId id) const;
  Result<Generation> result(RequestId id);

  // Perplexity over `ids` (or the encoding of `text`, with special tokens) in windows of context_length
  // tokens every `stride` tokens. Windows are batched like requests; each needs context_length <=
  // max_model_len.
  Result<ScoreResult> score(const std::vector<int32_t>& ids, int64_t context_length, int64_t stride,
                            const ScoreProgress& progress = nullptr);
  Result<ScoreResult> score(const std::string& text, int64_t context_length, int64_t stride,
                            const ScoreProgress& progress = nullptr);

  // The logits of every position of one sequence of at most max_model_len tokens. With images (vision
  // models), `ids` holds one <|image_pad|> per image and the result covers the expanded sequence.
  Result<Logits> logits(const std::vector<int32_t>& ids);
  Result<Logits> logits(const std::vector<int32_t>& ids, const std::vector<VisionInput>& images);

  // Thread-safe and async-signal-safe: stop the call running now (generate, run, step, score, logits) at its next
  // step and end every request in flight. generate returns the text and ids generated so far with
  // FinishReason::cancelled; run, step, score and logits return ErrorCode::cancelled. A cancel() made while no call runs does nothing: it
  // never reaches a later call.
  void cancel();
  // Thread-safe: end one request (an id from submit) at the next step, with FinishReason::cancelled, its pages
  // back in the pool; the others go on. A request that has already finished is left as it is. invalid_argument
  // for an id this engine never issued. From a token callback, returning false ends its own request at once.
  Status cancel(RequestId id);

  EngineStats stats() const;
  EngineInfo info() const;
  // Copy bandwidth of the engine's memory, measured now, `repeats` copies of `bytes` timed together: bytes read
  // + written per second, the ceiling of memory-bound work such as decoding. GPU: cudaMemcpy device to device
  // from the KV region's first half onto its second (no allocation), bytes 0: min(half the region, 256 MiB).
  // CPU: memcpy between two host buffers of `bytes` (0: 256 MiB, larger than any cache) taken for the
  // measurement. invalid_argument while a request is in flight (the GPU's overwrites KV pages).
  Result<CopyBandwidth> measure_copy_bandwidth(uint64_t bytes = 0, int repeats = 10);

 private:
  Engine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlite
