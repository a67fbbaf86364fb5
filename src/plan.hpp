// ---------------------------------------------------------------------------------------------------------
// plan: where every byte goes, before a byte of weights is read or the GPU is touched. A pure function of
// (config, tensor headers or the config alone, device, options). The arena is carved from the same numbers.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

enum class KVDType { auto_, bf16, f16, fp8 };  // auto: the model's dtype (bf16 or f16); fp8: e4m3
const char* kv_dtype_name(KVDType dtype);
Result<KVDType> parse_kv_dtype(const std::string& text);  // "auto" | "bf16" | "f16" | "fp8"

struct PlanOptions {
  std::optional<uint64_t> device_mem;  // plan for a card of this size instead of the one present
  double utilization = 0.90;           // fraction of device memory kvlite may use, (0, 1]
  int64_t max_model_len = 0;           // 0: the default rule (see Plan::max_model_len_rule)
  int64_t max_seqs = 0;                // 0: default 8; sequences decoded together
  int64_t max_batched_tokens = 0;      // 0: default min(2048, max_model_len); tokens in one forward step
  KVDType kv_dtype = KVDType::auto_;
  int64_t max_image_pixels = 0;        // vision models; 0: preprocessor_config.json's max, else the model default
  int64_t max_images = 1;              // images encoded in one step (vision models)
  int64_t kv_page_tokens = 16;         // tokens per KV page
  std::optional<bool> wsl2;            // override WSL2 detection
};

// One line of the plan table. Items with in_arena == true are regions of the one reservation, carved in
// this order; the others (CUDA context) are memory the device spends that kvlite does not allocate.
struct PlanItem {
  std::string key;    // stable identifier: "weights", "repack", "context", "activations", "vision",
                      // "logits", "workspace", "graphs", "kv"
  std::string label;  // for the table: "weights (exact, 4.45 GiB in 398 tensors)"
  uint64_t bytes = 0;
  std::string why;    // one line: how the number was computed
  bool in_arena = true;
};

struct Plan {
  DeviceSpec device;
  PlanOptions options;  // resolved: every 0 replaced by the value used
  std::string model_name;
  Arch arch = Arch::llama;

  std::vector<PlanItem> items;  // everything but the KV arena, in table order
  uint64_t weights_bytes = 0;
  std::string weights_source;   // "headers" or "config"
  uint64_t kv_bytes_per_token = 0;
  uint64_t kv_page_tokens = 0;
  uint64_t kv_page_bytes = 0;   // kv_page_tokens x kv_bytes_per_token (all layers)
  uint64_t budget_bytes = 0;    // utilization x device memory
  uint64_t fixed_bytes = 0;     // sum of items (what must fit before any KV)
  int64_t kv_available_bytes = 0;  // budget - fixed; negative when even that does not fit
  uint64_t kv_arena_bytes = 0;  // whole pages only
  uint64_t kv_pages = 0;
  uint64_t kv_tokens = 0;       // kv_pages x kv_page_tokens
  int64_t max_model_len = 0;
  std::string max_model_len_rule;  // why this max_model_len ("requested", "default: ...")
  double concurrency = 0;       // kv_tokens / max_model_len
  bool fits = false;            // one sequence of max_model_len fits
  int64_t shortfall_bytes = 0;  // how much more memory a fit needs (0 when it fits)
  // What would fit (computed whatever `fits` says):
  int64_t max_model_len_that_fits = 0;         // at this ratio and dtype; 0 when nothing fits
  double utilization_needed = 0;               // for the requested max_model_len; > 1 when no ratio fits
  int64_t max_model_len_that_fits_fp8_kv = 0;  // with --kv-dtype fp8
  int64_t image_pixels_that_fit = 0;           // vision models: the largest image budget that fits
  std::vector<std::string> advice;             // sentences for people, most useful first

  uint64_t arena_bytes() const;  // sum of in_arena items + kv_arena_bytes: the one reservation
  std::string table() const;     // the human table
  std::string json() const;      // the machine form (byte counts as integers)
  std::string svg() const;       // a stacked bar of the budget
};

// The planner. Never touches the GPU and never reads tensor data (headers only).
Result<Plan> make_plan(const ModelConfig& config, const WeightsSummary& weights, const DeviceSpec& device,
                       const PlanOptions& options);
// Convenience: reads MODEL_DIR's config.json and safetensors headers (if any), detects the device, plans.
Result<Plan> plan_model_dir(const std::string& model_dir, const PlanOptions& options);

// The activation buffers of one forward step of `tokens` tokens (and the vision encoder for `image_pixels`),
// each a named region with its bytes: the planner sums them and the engine carves them, so the two agree.
struct BufferSpec {
  std::string name;   // "hidden", "qkv", ...
  uint64_t bytes = 0;
  std::string shape;  // "(tokens, hidden)"
};
std::vector<BufferSpec> activation_buffers(const ModelConfig& config, int64_t tokens, int64_t max_seqs,
                                           BackendKind backend);
std::vector<BufferSpec> vision_buffers(const ModelConfig& config, int64_t image_pixels, int64_t images,
                                       BackendKind backend);

}  // namespace kvlite
