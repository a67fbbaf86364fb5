// ---------------------------------------------------------------------------------------------------------
// plan: where every byte goes, before a byte of weights is read or the GPU is touched. A pure function of
// (config, tensor headers or the config alone, device, options). The arena is carved from the same numbers.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// auto: the activation dtype (by default f32 on the CPU, whose reference matches transformers' float32, and on a
// GPU the model's 16-bit dtype; whatever PlanOptions::activation_dtype asks for otherwise); fp8: e4m3.
enum class KVDType { auto_, bf16, f16, fp8, f32 };
const char* kv_dtype_name(KVDType dtype);
Result<KVDType> parse_kv_dtype(const std::string& text);  // "auto" | "bf16" | "f16" | "fp8" | "f32"
int kv_dtype_bytes(KVDType dtype);  // 2, 1 for fp8, 4 for f32 (auto must be resolved first)
// Whether the engine on `backend` can store its KV cache as `dtype` (the backends' supports(kv_write) and
// supports(attention), which a test keeps in step): the planner advises only KV dtypes the engine can run.
// Both backends store every KV dtype (fp8: e4m3 with per-layer scales); kept as the one place to say otherwise.
bool kv_dtype_storable(BackendKind backend, KVDType dtype);

struct PlanOptions {
  // The memory the plan divides instead of the device's: on CUDA a card of this size (an 8 GiB card planned on
  // any GPU, or on none); on the CPU the budget's base. Read by plan_engine (through detect_device); make_plan
  // plans for the DeviceSpec it is given.
  std::optional<uint64_t> device_mem;
  double utilization = 0.90;           // fraction of device memory kvlite may use, (0, 1]
  int64_t max_model_len = 0;           // 0: the default rule (see Plan::max_model_len_rule)
  int64_t max_seqs = 0;                // 0: default 8; sequences decoded together
  int64_t max_batched_tokens = 0;      // 0: default min(2048, max_model_len); tokens in one forward step
  KVDType kv_dtype = KVDType::auto_;
  int64_t max_image_pixels = 0;        // vision models; 0: kvlite's default, min(processor max, 1024 x 1024)
  int64_t max_images = 1;              // vision models: images one request may carry, encoded together in one
                                       // step; a request with more is refused (does_not_fit)
  int64_t kv_page_tokens = 16;         // tokens per KV page
  // The KV arena holds at most the pages max_seqs sequences of max_model_len tokens can use, so the rest of the
  // budget stays free for the application kvlite is embedded in (a display, a browser, the OS on a Jetson).
  // true: fill the whole budget with KV pages, as vLLM does on a dedicated server (--kv-fill).
  bool kv_fill = false;
  std::optional<bool> wsl2;            // override WSL2 detection
  // Speculative decoding: each decoding sequence drafts up to speculative_tokens tokens (K) per step and the
  // model verifies them in the same forward pass. 0: off. The drafts come from one of:
  //  - prompt lookup (n-gram drafting, ngram > 0): the latest earlier occurrence of the sequence's last tokens
  //    (matching at most `ngram` of them). It needs no memory of its own: the K + 1 tokens a sequence reads are
  //    inside max_batched_tokens, and their logits go through the planned logits rows;
  //  - a draft model (PlanInputs::draft, EngineOptions::draft_model): a smaller model with the same tokenizer
  //    runs K steps ahead. The plan adds its weights, its activations and logits for a step like the target's,
  //    its distributions for K tokens per sequence, and its KV beside every KV page (the same contexts).
  int64_t speculative_tokens = 0;
  int64_t ngram = 0;
  // The dtype every activation is stored in: F32, BF16 or F16 on either backend (ops compute in f32 and round
  // on each store). Unset: F32 on the CPU (its reference matches transformers' float32; BF16 / F16 there run the
  // GPU's rounding, for tests); on CUDA the model's dtype (F16 for F16 checkpoints, else BF16), as KV auto.
  // Resolved in Plan::options.
  std::optional<DType> activation_dtype;
  // The token-embedding table (embed_tokens) stays in host memory, the checkpoint's mmap, instead of the device
  // (--host-embeddings; llama.cpp keeps token_embd on the CPU for the same reason): a step looks up its T rows on
  // the host into a pinned staging buffer of max_batched_tokens x hidden activations and copies them into the
  // "hidden" activations. Saves the table's bytes of device memory (Qwen2.5-7B: 1.02 GiB of bf16) for a host
  // gather and a T x H copy per step. CUDA only changes anything (the CPU's table is host memory already); an
  // untied table only: a tied one is lm_head too, which the GPU multiplies by (refused, invalid_argument).
  bool host_embeddings = false;
};

// Limits on options (beyond them the planner's products would stop meaning anything).
constexpr int64_t kMaxPlanSeqs = 65536;
constexpr int64_t kMaxPlanBatchedTokens = 1 << 20;
constexpr int64_t kMaxPlanPageTokens = 1024;
constexpr int64_t kMaxPlanImages = 1024;
constexpr int64_t kMaxPlanImagePixels = int64_t(1) << 28;  // 16384 x 16384
constexpr int64_t kMaxSpeculativeTokens = 32;  // beyond ~8 acceptance falls off: 32 is generous
constexpr int64_t kMaxNgram = 32;
// Every planned region starts on this boundary: each buffer and item is rounded up to it.
constexpr uint64_t kPlanAlignment = 256;

// What the CUDA runtime spends outside the arena on native Linux (the plan's "context" row), from figures measured
// on an H100 80GB HBM3 (132 SMs x 2,048 threads; driver 580.159.04, CUDA 13.0; 2026-11-26) by the GPU test
// "device memory measured within 3% of the plan" (tests/unit-cuda-engine.cpp prints them):
//   the bare context: 524.0 MiB (nvidia-smi's figure for the process after its first cudaMemGetInfo). Of that,
//     the stack every resident thread may use on every SM (cudaLimitStackSize, 1 KiB unless raised) is
//     132 x 2,048 x 1 KiB = 264 MiB, which scales with the card; the other 260 MiB is taken as the same on
//     every card (one GPU measured so far: an 8 GB card's figure would settle it);
//   cuBLAS's handle and the kernels loaded while the engine opens (CUDA loads modules lazily): 66.7 MiB (the
//     process's cudaMemGetInfo drop over Engine::open, less its 67.3 MiB arena; the graphs measured 0 there).
constexpr uint64_t kCudaContextBaseBytes = 260 * MiB;
constexpr uint64_t kCudaStackBytesPerThread = 1 * KiB;
constexpr uint64_t kCudaRuntimeBytes = 68 * MiB;
// A planned card (--device-mem with no GPU queried) as the largest of the 8 GB cards kvlite is for: the RTX 4060
// Ti's 34 SMs x 1,536 threads (RTX 3060 8 GB: 28, RTX 4060: 24).
constexpr int kPlannedCardMultiprocessors = 34;
constexpr int kPlannedCardThreadsPerMultiprocessor = 1536;
// The CUDA context a plan sets aside on native Linux for `device` (WSL2: kContextWsl2 in the planner).
uint64_t cuda_context_bytes(const DeviceSpec& device);

// The CUDA backend's workspace (CudaBackendOptions, backend_cuda.hpp), carved from the plan's "workspace" item:
// the one source of both numbers. cuBLAS's part is what it asks for on Hopper (4 MiB suffice on older GPUs); the
// scratch holds split attention's partials ([rows, heads, splits, head_dim + 2] floats: decode of 64 sequences x
// 64 heads x head_dim 128 split 8 ways needs 16 MiB; less scratch only means fewer splits).
constexpr uint64_t kCudaCublasWorkspaceBytes = 32 * MiB;
constexpr uint64_t kCudaScratchBytes = 32 * MiB;
constexpr uint64_t kCudaWorkspaceBytes = kCudaCublasWorkspaceBytes + kCudaScratchBytes;
// Weights reach the GPU in chunks of at most this many bytes, straight from the mmap (pageable memory: no pinned
// buffer, which WSL2 limits). A chunk that needs converting to the activation dtype is staged in the KV region
// (free until the first step) and converted there by the GPU, so staging costs no memory of its own.
constexpr uint64_t kCudaUploadChunkBytes = 16 * MiB;

// One line of the plan table. Items with in_arena == true are regions of the one reservation, carved in
// this order; the others (CUDA context) are memory the device spends that kvlite does not allocate.
struct PlanItem {
  std::string key;    // stable identifier: "weights", "repack", "context", "activations", "vision",
                      // "logits", "workspace", "graphs"; with a draft model "draft_weights",
                      // "draft_activations", "draft_logits", "draft_probs"
  std::string label;  // for the table: "weights (exact, 398 tensors)"
  uint64_t bytes = 0;
  std::string why;    // one line: how the number was computed
  bool in_arena = true;
};

struct Plan {
  DeviceSpec device;    // as planned for (wsl2 as resolved from options)
  PlanOptions options;  // resolved: every 0 / auto replaced by the value used
  std::string model_name;
  Arch arch = Arch::llama;
  // Why this backend: "--backend cpu", "auto: no CUDA device is visible", ... (plan_engine sets it;
  // empty from make_plan, which is given its device).
  std::string backend_rule;
  // Prefix caching as the engine will run it (EngineOptions::prefix_caching resolved for the backend: plan_engine
  // sets it; make_plan leaves it unset). It costs no bytes: cached pages are KV pages, free to evict. Its hits are
  // runtime figures: EngineStats::prefix_pages_reused / prefix_tokens_reused and the pool's cached_pages.
  std::optional<bool> prefix_caching;

  std::vector<PlanItem> items;  // everything but the KV arena, in table order
  uint64_t weights_bytes = 0;
  std::string weights_source;   // "headers" or "config"
  uint64_t upload_chunk_bytes = 0;  // CUDA: weights are uploaded in chunks of at most this (kCudaUploadChunkBytes)
  uint64_t kv_bytes_per_token = 0;  // of the pages in "kv": every layer's, or the full-attention layers' (kv_window)
  uint64_t kv_page_tokens = 0;
  uint64_t kv_page_bytes = 0;   // kv_page_tokens x kv_bytes_per_token
  // Sliding windows in memory (models with sliding and full-attention layers: gemma2, gemma3, qwen2 with
  // max_window_layers): the sliding layers' KV lives in pages of its own, region "kv_window", from which a
  // sequence holds only the pages its window still reads: a page goes back to the pool once every key in it is
  // out of every later query's window. kv_window_pages is what max_seqs sequences can hold at once in a step of
  // max_batched_tokens (kv_window_pages_for), so that pool never runs out before the "kv" one. 0 without (no
  // sliding layers, all layers sliding, or a draft model, which shares the "kv" pages' ids).
  uint64_t kv_window = 0;  // W, the sliding layers' window
  // Every layer slides (mistral, phi3 with sliding_window; no draft model): the "kv" pages themselves keep only the
  // windows (kv_window set, kv_window_pages 0), and a sequence of any length up to max_model_len needs at most
  // kv_window_pages_for one sequence of them.
  bool kv_pages_windowed() const { return kv_window > 0 && kv_window_pages == 0; }
  uint64_t kv_window_bytes_per_token = 0;
  uint64_t kv_window_page_bytes = 0;
  uint64_t kv_window_pages = 0;
  // With a draft model: the draft's KV for the same tokens, kept beside each page in the arena's "draft_kv"
  // region (kv_pages x draft_kv_page_bytes); KV arena figures and everything that fits count both. 0 without.
  uint64_t draft_kv_bytes_per_token = 0;
  uint64_t draft_kv_page_bytes = 0;
  std::string draft_model_name;  // empty without a draft model
  uint64_t budget_bytes = 0;    // floor(utilization x device memory)
  uint64_t fixed_bytes = 0;     // sum of items (what must fit before any KV)
  int64_t kv_available_bytes = 0;  // budget - fixed; negative when even that does not fit
  uint64_t kv_arena_bytes = 0;  // whole pages only (with a draft model, its KV for them too)
  uint64_t kv_pages_usable = 0; // the pages max_seqs sequences of max_model_len can use (the arena's cap
                                // unless options.kv_fill)
  uint64_t free_bytes = 0;      // budget - arena - what the device spends outside it: left to the application
  uint64_t kv_pages = 0;
  uint64_t kv_tokens = 0;       // kv_pages x kv_page_tokens
  int64_t max_model_len = 0;
  std::string max_model_len_rule;    // why this max_model_len ("requested", "default: ...")
  // Models with sliding-window layers (mistral, gemma2/3, phi3, qwen2 use_sliding_window): how many slide over
  // how many tokens, and what one max_model_len sequence's KV would take if their windows were kept alone; empty
  // otherwise. The arena still keeps every layer's KV for the whole context (the KV arena row says so).
  std::string sliding_kv_note;
  std::string max_image_pixels_rule; // vision models: why this image budget; empty otherwise
  double concurrency = 0;       // kv_tokens / max_model_len
  bool fits = false;            // one sequence of max_model_len fits
  int64_t shortfall_bytes = 0;  // how much more memory a fit needs (0 when it fits)
  // What would fit (computed whatever `fits` says):
  int64_t max_model_len_that_fits = 0;         // at this ratio and dtype; 0 when nothing fits
  double utilization_needed = 0;               // for the requested max_model_len; > 1 when no ratio fits
  int64_t max_model_len_that_fits_fp8_kv = 0;  // with --kv-dtype fp8
  int64_t image_pixels_that_fit = 0;           // vision models: the largest image budget that fits
  // With a draft model, when the plan does not fit: the largest --spec-tokens at which it does (0: none), and
  // whether it fits without the draft model.
  int64_t speculative_tokens_that_fit = 0;
  bool fits_without_draft = false;
  // The candidate layouts planning assembled to give these answers, this plan's own included: the searches
  // are halvings and binary searches, so a few dozen at most (tests/unit-plan.cpp bounds it).
  int64_t layouts_assembled = 0;
  // Vision models: what the image budget means and costs (zeros for text models). An image over
  // max_image_pixels is scaled down to fit (smart_resize with that maximum, as the processor does), which
  // keeps h x w <= max: no image becomes more tokens than this. (Except where smart_resize rounds a side UP,
  // for very thin images: a side shorter than patch x merge is raised to it, and an image under min_pixels
  // is scaled up with sides rounded up. Such an image can overshoot a budget near min_pixels, in
  // transformers too; the engine refuses it with the numbers.)
  int64_t image_pixels_per_token = 0;   // (patch x merge)^2: one merged token covers this many pixels
  int64_t image_tokens_per_image = 0;   // merged tokens of the largest image allowed: floor(max_image_pixels /
                                        // image_pixels_per_token): its <|image_pad|> expands to as many
  int64_t image_patches_per_image = 0;  // its patches (tokens x merge^2): the encoder's sequence length
  uint64_t vision_weights_bytes = 0;    // vision tower and mergers (part of the weights row)
  uint64_t vision_activation_bytes = 0; // the vision row: encoder buffers for max_images such images
  // --host-embeddings (PlanOptions::host_embeddings) on CUDA: the table's bytes kept out of the weights row (in
  // host memory, the mmap) and the pinned host staging buffer the looked-up rows go through (max_batched_tokens x
  // hidden x activation bytes, host memory too); both 0 otherwise (and on the CPU, where nothing changes).
  uint64_t host_embedding_bytes = 0;
  uint64_t host_staging_bytes = 0;
  std::vector<std::string> advice;             // sentences for people, most useful first

  uint64_t arena_bytes() const;  // sum of in_arena items + kv_arena_bytes: the one reservation
  const PlanItem* item(const std::string& key) const;  // nullptr when the plan has no such item
  std::string table() const;     // the human table
  std::string json() const;      // the machine form (byte counts as integers)
  std::string svg() const;       // a stacked bar of the budget, a standalone SVG document
};

// The planner. Never touches the GPU and never reads tensor data (headers only). Option errors are
// invalid_argument and carry the value; a plan that does not fit is NOT an error (see Plan::fits).
Result<Plan> make_plan(const ModelConfig& config, const WeightsSummary& weights, const DeviceSpec& device,
                       const PlanOptions& options);

// What plan_model_dir reads from a model directory, kept so a caller can re-plan without reading it again
// (`kvlite plan --sweep`).
struct PlanInputs;
struct CpuBackendOptions;  // backend.hpp
namespace detail {
// The CpuBackendOptions Engine::open makes for a model and its draft (nullptr: none): the head dims attention sees
// (text, vision, draft), the widest quantized Linear's in_features (fast_lowp: the widest Linear's, dense too),
// W8A8's int8 activations, the kernels; the CPU plan's workspace row is cpu_backend_scratch_bytes of it. The
// fp8_activations test switch is the engine's. lm_head int8: the int8 copy's input (hidden_size) widens that.
CpuBackendOptions cpu_backend_options_for(const ModelConfig& config, const WeightsSummary& weights,
                                          const PlanInputs* draft, DType activation, int threads, CpuKernels kernels,
                                          CpuLmHead lm_head = CpuLmHead::stored);
}  // namespace detail
struct PlanInputs {
  ModelConfig config;
  WeightsSummary weights;
  uint64_t tensor_count = 0;  // tensors in the safetensors headers (0: none, weights estimated from config.json)
  // Speculative decoding with a draft model (PlanOptions::speculative_tokens): the draft's own inputs (its
  // `draft` unset). It must be a text model (llama, qwen2, qwen3) with the target's vocabulary size; the CPU
  // backend runs it (CUDA: unsupported so far).
  std::shared_ptr<const PlanInputs> draft;
};
Result<PlanInputs> read_plan_inputs(const std::string& model_dir);  // config.json + safetensors headers
Result<Plan> make_plan(const PlanInputs& inputs, const DeviceSpec& device, const PlanOptions& options);
// A model directory's plan for a backend choice and device: plan_engine (engine.hpp), the function Engine::open
// itself plans with.

// The buffers of one forward step, each a named region with its bytes (rounded up to kPlanAlignment): the
// planner sums them and the engine carves them, so the two agree. Shapes name config sizes:
// T tokens, H hidden, Hq/Hkv heads, D head_dim, I intermediate, S sequences, V vocab, N patches, P pages of a
// sequence.
struct BufferSpec {
  std::string name;   // "hidden", "qkv", ...
  uint64_t bytes = 0;
  std::string shape;  // "(T, H) fp32"
};
// Language model, one step of `tokens` tokens from up to `max_seqs` sequences, activations in
// `activation_dtype` (F32, BF16 or F16). With block_table_pages > 0 (a GPU: its attention reads block tables from
// device memory) the step's block tables get a buffer "block_tables" (S + 1, P), and the attention batch room for
// one more sequence: the spare sequence that holds a CUDA graph's padding rows. The CPU (0) reads the KV pool's
// tables in place.
// With kv_window (the plan's kv_window > 0) the sliding layers' slots and, on a GPU, block tables get buffers of
// their own: "window_slot_mapping" (T) and "window_block_tables" (S + 1, P).
std::vector<BufferSpec> activation_buffers(const ModelConfig& config, int64_t tokens, int64_t max_seqs,
                                           DType activation_dtype, int64_t block_table_pages, bool kv_window = false);
// The plan's buffers for a backend's default activation dtype: the CPU's (F32, no block-table buffer), or
// CUDA's BF16 with block tables for sequences of up to max_position_embeddings tokens in pages of 16.
std::vector<BufferSpec> activation_buffers(const ModelConfig& config, int64_t tokens, int64_t max_seqs,
                                           BackendKind backend);
// How a model's KV splits into page groups. Both kinds of layer present (and `windows_in_memory`: no draft model):
// the full-attention layers' KV in the "kv" pages, the sliding layers' (window W) in "kv_window" pages; else every
// layer in "kv" (window_layers 0), which keep only windows when every layer slides (main_window). Layer l's K/V sit
// in its group's pages at index group_layer(l).
struct KVGroups {
  int64_t full_layers = 0, window_layers = 0, window = 0;
  // Every layer slides (and windows_in_memory): they all stay in "kv", whose pages keep only this window.
  int64_t main_window = 0;
  std::vector<int64_t> group_layer;  // [num_layers]: the layer's index among its group's layers
  bool in_window(const BlockTraits& block, int64_t layer) const { return window_layers > 0 && block.window_of(layer) > 0; }
};
KVGroups kv_groups(const TextConfig& text, bool windows_in_memory);
// The "kv_window" pages max_seqs sequences can hold at once: each keeps the pages its window reads (the last
// W - 1 keys before its next query, at most ceil((W - 1) / page) + 1 pages) plus the pages of this step's tokens,
// which are at most max_batched_tokens across the batch: max_seqs x (ceil(W / page) + 2) + ceil(T / page), and never
// more than max_seqs sequences of max_model_len take.
uint64_t kv_window_pages_for(int64_t window, int64_t page_tokens, int64_t max_seqs, int64_t max_batched_tokens,
                             int64_t max_model_len);

// Pages of the block-table buffer a CUDA plan reserves per sequence: enough for the model's longest sequence
// (max_position_embeddings), so the plan's fixed items do not depend on max_model_len.
int64_t block_table_pages(const ModelConfig& config, int64_t kv_page_tokens);
// Vision encoder, `images` images of at most `image_pixels` pixels each (empty for text-only models), for an
// activation dtype or a backend's default one.
std::vector<BufferSpec> vision_buffers(const ModelConfig& config, int64_t image_pixels, int64_t images,
                                       DType activation_dtype);
std::vector<BufferSpec> vision_buffers(const ModelConfig& config, int64_t image_pixels, int64_t images,
                                       BackendKind backend);
// Logits and sampling for up to `max_seqs` sequences (scoring reuses the same rows, 32 at a time). The logits
// rows are F32-sized; a GPU computing in BF16/F16 stores them in its activation dtype in the same buffer.
std::vector<BufferSpec> logits_buffers(const ModelConfig& config, int64_t max_seqs);
// CUDA decode graph buckets for up to max_seqs sequences: the powers of two below max_seqs, then max_seqs.
std::vector<int64_t> decode_graph_buckets(int64_t max_seqs);
// Words of one row of the "sampling_params" buffer (cuda::DeviceSamplingParams).
constexpr int64_t kSamplingParamWords = 6;
uint64_t buffers_bytes(const std::vector<BufferSpec>& buffers);  // their sum

}  // namespace kvlite
