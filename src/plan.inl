// plan: implementation.
//
// The rules, one per table row (each also spelled out in that row's `why`). Every buffer and item is rounded
// up to kPlanAlignment (256 B), the boundary every arena region starts on.
//   weights      WeightsSummary.total_bytes: exact from the safetensors headers, or estimated from config.json
//                when the directory has no weights. CUDA (in the arena): dense Linears' weights and biases are
//                stored in the activation dtype (cuBLAS multiplies like types), so they count at its width, a
//                tied lm_head whose table is not in that dtype gets a converted copy, and every tensor starts
//                on a 256-byte boundary (cuda_weight_slack).
//   repack       CUDA only: extra bytes the GPU layout of the quantized Linears needs over their on-disk bytes
//                (cuda::quant_device_bytes per Linear, or per q|k|v / gate|up group the uploader fuses into one:
//                repacked tiles, F32 scale tables, counters). The region follows the weights', and the uploader
//                fills the two as one span. CPU: 0, it runs the on-disk layout. The row is always shown.
//   context      CUDA context + cuBLAS handles + loaded kernels, which the device spends outside kvlite's arena:
//                on native Linux cuda_context_bytes (plan.hpp: 260 MiB + 1 KiB of stack per resident thread of
//                every SM + 68 MiB, from an H100's measured figures; 379 MiB for a planned 8 GB card), 1024 MiB
//                under WSL2 (its paravirtualized driver reserves more, and pinned host memory is limited there:
//                vLLM disables it; not measured yet). CPU: 0.
//   activations  activation_buffers(config, max_batched_tokens, max_seqs, activation dtype, block table pages):
//                the engine carves exactly these, so plan and arena agree.
//   vision       vision models: vision_buffers(config, max_image_pixels, max_images, backend). The default
//                image budget is min(processor max, 1024 x 1024 pixels), not the processor's own 16777216:
//                planning for the largest image a processor allows is how VLMs swallow small cards.
//                The rows under the table spell the budget out: image tokens = floor(max_image_pixels /
//                (patch x merge)^2) per image (what the largest image allowed becomes), and image budget =
//                this row + the vision tower's weights (which the weights row includes).
//   logits       logits_buffers(config, max_seqs): scoring computes log-probs 32 rows at a time.
//   workspace    CUDA: kCudaWorkspaceBytes (the backend's cuBLAS workspace + attention scratch) + repack scratch
//                as large as the largest single quantized Linear.
//                CPU: the backend's scratch (cpu_backend_scratch_bytes: per thread attention rows and 16 dequantized
//                weight rows of the widest quantized K; token chunks for 16-bit or int8 activations).
//   graphs       CUDA: the driver's memory for the instantiated decode graphs, one per batch bucket (1, 2, 4,
//                ..., max_seqs): 2 MiB + 64 KiB per layer per bucket, in whole 2 MiB, from measurements on an
//                H100 (4 buckets: 2 MiB for 2 layers, 4-6 MiB for Llama-3.1-8B's 32, 6-8 MiB for 36). Outside the
//                arena: the graphs' buffers are the arena's, kvlite allocates nothing while capturing. CPU: 0.
//   KV           budget = floor(utilization x device memory); fixed = sum of the rows above;
//                KV gets whole pages of what is left: pages = floor(max(0, budget - fixed) / page_bytes).
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <thread>
#include <nlohmann/json.hpp>

namespace kvlite {

const char* kv_dtype_name(KVDType dtype) {
  switch (dtype) {
    case KVDType::auto_: return "auto";
    case KVDType::bf16: return "bf16";
    case KVDType::f16: return "f16";
    case KVDType::fp8: return "fp8";
    case KVDType::f32: return "f32";
  }
  return "?";
}

Result<KVDType> parse_kv_dtype(const std::string& text) {
  return detail::guard([&]() -> KVDType {
    if (text == "auto") return KVDType::auto_;
    if (text == "bf16" || text == "bfloat16") return KVDType::bf16;
    if (text == "f16" || text == "fp16" || text == "float16") return KVDType::f16;
    if (text == "fp8" || text == "fp8_e4m3") return KVDType::fp8;
    if (text == "f32" || text == "fp32" || text == "float32") return KVDType::f32;
    detail::fail(ErrorCode::invalid_argument,
                 detail::format("unknown KV dtype '%s': use auto, bf16, f16, fp8 or f32", text.c_str()));
  });
}

int kv_dtype_bytes(KVDType dtype) { return dtype == KVDType::fp8 ? 1 : dtype == KVDType::f32 ? 4 : 2; }

bool kv_dtype_storable(BackendKind, KVDType) { return true; }  // both backends store f32, bf16, f16 and fp8

namespace detail {
// The SMs and resident threads per SM whose stacks the CUDA context reserves: the queried GPU's, or a planned
// card's (kPlannedCard*) when they are unknown.
struct ContextThreads {
  int multiprocessors, threads_per_multiprocessor;
  bool planned;
};
inline ContextThreads context_threads(const DeviceSpec& device) {
  if (device.multiprocessors > 0 && device.threads_per_multiprocessor > 0)
    return {device.multiprocessors, device.threads_per_multiprocessor, false};
  return {kPlannedCardMultiprocessors, kPlannedCardThreadsPerMultiprocessor, true};
}
inline uint64_t context_stack_bytes(const DeviceSpec& device) {
  const ContextThreads t = context_threads(device);
  return uint64_t(t.multiprocessors) * uint64_t(t.threads_per_multiprocessor) * kCudaStackBytesPerThread;
}
}  // namespace detail

uint64_t cuda_context_bytes(const DeviceSpec& device) {
  return kCudaContextBaseBytes + detail::context_stack_bytes(device) + kCudaRuntimeBytes;
}

namespace detail {
CpuBackendOptions cpu_backend_options_for(const ModelConfig& config, const WeightsSummary& weights,
                                          const PlanInputs* draft, DType activation, int threads, CpuKernels kernels,
                                          CpuLmHead lm_head) {
  CpuBackendOptions o;
  o.threads = threads;
  o.kernels = kernels;
  o.activation_dtype = activation;
  o.max_head_dim = config.text.head_dim;
  if (config.vision.present) o.max_head_dim = std::max(o.max_head_dim, config.vision.hidden_size / config.vision.num_heads);
  o.max_quant_in_features = 1;
  auto widen = [&](const WeightsSummary& w) {
    for (const LinearDesc& linear : w.linears) {
      // fast_lowp rounds dense Linears' inputs to bf16 in the same per-token buffer
      if (linear.format != WeightFormat::dense || kernels == CpuKernels::fast_lowp)
        o.max_quant_in_features = std::max(o.max_quant_in_features, linear.in_features);
      o.int8_activations = o.int8_activations || linear.int8_activations;
    }
  };
  widen(weights);
  if (lm_head == CpuLmHead::int8)  // the int8 copy is a quantized Linear over the hidden states
    o.max_quant_in_features = std::max(o.max_quant_in_features, config.text.hidden_size);
  if (draft) {  // the draft model runs on this backend too
    o.max_head_dim = std::max(o.max_head_dim, draft->config.text.head_dim);
    widen(draft->weights);
  }
  return o;
}
}  // namespace detail

namespace detail {
namespace planning {

constexpr uint64_t kDecodeSplits = 16;          // split-KV decode: partial results per (sequence, head)
constexpr int64_t kScoringRows = 32;            // log-prob rows computed at once when scoring
constexpr int64_t kDefaultMaxSeqs = 8;
constexpr int64_t kDefaultBatchedTokens = 2048;
constexpr int64_t kDefaultMaxModelLen = 32768;  // the default rule's cap
constexpr int64_t kMinDefaultMaxModelLen = 2048;  // the default rule halves down to this, no further
constexpr int kUtilizationSearchSteps = 64;     // utilization searches: steps at most (a few suffice)
constexpr int64_t kDefaultImagePixels = 1024 * 1024;      // kvlite's planning default
constexpr uint64_t kContextWsl2 = 1024 * MiB;
// Decode graphs (measured on an H100, CUDA 13.0, kvlite bench "cuda graphs: measured"; buckets 1,2,4,8):
// tiny-qwen3 (2 layers) 2.0 MiB; Llama-3.1-8B (32 layers) 6.0 MiB BF16, 4.0 MiB W4A16; Qwen3-4B (36) 8.0 MiB;
// Qwen3-VL-4B's text model (36, FP8) 6.0 MiB. The driver takes 2 MiB at a time.
constexpr uint64_t kGraphPoolBase = 2 * MiB;
constexpr uint64_t kGraphPoolPerLayerBucket = 64 * KiB;
constexpr uint64_t kGraphPoolGranularity = 2 * MiB;

std::string ull(uint64_t v) { return format("%llu", (unsigned long long)v); }
std::string ll(int64_t v) { return format("%lld", (long long)v); }

BufferSpec buffer(const char* name, std::vector<uint64_t> dims, uint64_t element_bytes, const char* symbols,
                  const char* dtype) {
  uint64_t elements = 1;
  std::string numbers;
  for (uint64_t d : dims) {
    elements *= d;
    numbers += (numbers.empty() ? "" : ", ") + ull(d);
  }
  return {name, align_up(elements * element_bytes, kPlanAlignment),
          format("%s = (%s) %s", symbols, numbers.c_str(), dtype)};
}

// Activations are bf16 on the GPU and fp32 on the CPU (the CPU path is the fp32 reference) unless the options
// say otherwise (PlanOptions::activation_dtype: the CPU also runs BF16 / F16, rounding where the GPU does).
DType default_activation_dtype(BackendKind backend) { return backend == BackendKind::cuda ? DType::BF16 : DType::F32; }
const char* activation_dtype_text(DType dtype) {
  return dtype == DType::BF16 ? "bf16" : dtype == DType::F16 ? "fp16" : "fp32";
}

// Patches per image for an image budget: the processor resizes to whole merge windows (patch x merge
// pixels on a side) with at most `image_pixels` pixels, so a budget holds floor(pixels / window^2) windows.
uint64_t merge_windows(const VisionConfig& vision, int64_t image_pixels) {
  uint64_t side = uint64_t(vision.patch_size * vision.spatial_merge_size);
  return uint64_t(image_pixels) / (side * side);
}
uint64_t window_pixels(const VisionConfig& vision) {
  uint64_t side = uint64_t(vision.patch_size * vision.spatial_merge_size);
  return side * side;
}

// The smallest image budget worth planning: the processor resizes every image up to min_pixels, and no image
// is smaller than one merge window.
int64_t smallest_image_pixels(const ModelConfig& config) {
  uint64_t window = window_pixels(config.vision);
  return int64_t(std::max<uint64_t>(1, ceil_div(uint64_t(std::max<int64_t>(config.min_pixels, 0)), window)) * window);
}

// floor(utilization x total): the one place the budget is computed, so utilization_needed can be checked
// against exactly what a re-plan will compute.
uint64_t budget_for(double utilization, uint64_t total) {
  return uint64_t(std::floor((long double)utilization * (long double)total));
}

std::string format_ratio(double ratio) {
  std::string text = format("%.4f", ratio);
  while (text.size() > 4 && text.back() == '0') text.pop_back();  // keep at least two decimals: "0.80"
  return text;
}

std::string format_count(uint64_t v) {  // 1048576 -> "1,048,576"
  std::string digits = ull(v), out;
  for (size_t i = 0; i < digits.size(); i++) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string model_name_of(const ModelConfig& config) {
  // origin is ".../<model dir>/config.json": the directory names the model.
  std::string path = config.origin;
  size_t slash = path.find_last_of('/');
  if (slash != std::string::npos) {
    std::string dir = path.substr(0, slash);
    while (!dir.empty() && dir.back() == '/') dir.pop_back();
    size_t start = dir.find_last_of('/');
    std::string name = start == std::string::npos ? dir : dir.substr(start + 1);
    if (!name.empty() && name != ".") return name;
  }
  return config.model_type.empty() ? std::string(arch_name(config.arch)) : config.model_type;
}

struct ModelLimits {
  int64_t max_position = 0;       // config's max_position_embeddings, or what its RoPE scaling reaches
  int64_t processor_max_pixels = 0;  // vision: preprocessor max, or the processor's default
};

// The positions a model is meant to reach: what its RoPE scaling reaches (rope_context_length), or
// max_position_embeddings itself where that already counts the scaling (Gemma-3).
inline int64_t context_positions(const TextConfig& t) {
  if (t.block.max_positions_scaled) return t.max_position_embeddings;
  return rope_context_length(t.rope, t.max_position_embeddings);
}

ModelLimits model_limits(const ModelConfig& config) {
  ModelLimits limits;
  limits.max_position = context_positions(config.text);
  if (config.vision.present)
    // the processor's own default when preprocessor_config.json is absent (the family's, VisionTraits:
    // Qwen3-VL 16,777,216; Qwen2VLImageProcessor 12,845,056)
    limits.processor_max_pixels = config.max_pixels > 0 ? config.max_pixels : config.vision.traits.default_max_pixels;
  return limits;
}

void check_config(const ModelConfig& config) {
  const TextConfig& t = config.text;
  auto need = [&](int64_t value, const char* key) {
    if (value <= 0)
      fail(ErrorCode::bad_format, format("%s: %s is %lld; the planner needs it positive",
                                         config.origin.empty() ? "config" : config.origin.c_str(), key, (long long)value));
  };
  need(t.hidden_size, "hidden_size");
  need(t.intermediate_size, "intermediate_size");
  need(t.num_layers, "num_hidden_layers");
  need(t.num_heads, "num_attention_heads");
  need(t.num_kv_heads, "num_key_value_heads");
  need(t.head_dim, "head_dim");
  need(t.vocab_size, "vocab_size");
  need(t.max_position_embeddings, "max_position_embeddings");
  if (config.vision.present) {
    const VisionConfig& v = config.vision;
    need(v.hidden_size, "vision_config.hidden_size");
    need(v.intermediate_size, "vision_config.intermediate_size");
    need(v.patch_size, "vision_config.patch_size");
    need(v.spatial_merge_size, "vision_config.spatial_merge_size");
    need(v.temporal_patch_size, "vision_config.temporal_patch_size");
    need(v.in_channels, "vision_config.in_channels");
    need(v.out_hidden_size, "vision_config.out_hidden_size");
  }
}

// Every option error names the option and carries the value.
void check_options(const ModelConfig& config, const DeviceSpec& device, const PlanOptions& o,
                   const PlanInputs* draft) {
  auto bad = [](std::string message) { fail(ErrorCode::invalid_argument, std::move(message)); };
  if (device.total_bytes == 0)
    bad(format("device '%s' reports 0 bytes of memory: pass --device-mem (e.g. 8GiB) to plan for a card",
               device.name.c_str()));
  if (!(o.utilization > 0.0 && o.utilization <= 1.0))
    bad(format("utilization %g is outside (0, 1]: it is the fraction of device memory kvlite may use, e.g. 0.90",
               o.utilization));
  // A RoPE scaling (yarn, linear, dynamic) reaches past max_position_embeddings: Qwen2.5's YaRN factor 4 on
  // 32768 is its 128K context (rope_context_length).
  int64_t max_position = context_positions(config.text);
  if (o.max_model_len < 0)
    bad(format("max_model_len %lld must be positive (or 0 for the default rule)", (long long)o.max_model_len));
  if (o.max_model_len > max_position)
    bad(format("max_model_len %lld is more than the model's max_position_embeddings %lld (%s%s)",
               (long long)o.max_model_len, (long long)max_position, config.origin.c_str(),
               max_position != config.text.max_position_embeddings ? ", as its RoPE scaling extends it" : ""));
  if (o.max_seqs < 0 || o.max_seqs > kMaxPlanSeqs)
    bad(format("max_seqs %lld is outside 1..%lld (or 0 for the default %lld)", (long long)o.max_seqs,
               (long long)kMaxPlanSeqs, (long long)kDefaultMaxSeqs));
  if (o.max_batched_tokens < 0 || o.max_batched_tokens > kMaxPlanBatchedTokens)
    bad(format("max_batched_tokens %lld is outside 1..%lld (or 0 for the default min(2048, max_model_len))",
               (long long)o.max_batched_tokens, (long long)kMaxPlanBatchedTokens));
  if (o.kv_page_tokens < 1 || o.kv_page_tokens > kMaxPlanPageTokens)
    bad(format("kv_page_tokens %lld is outside 1..%lld", (long long)o.kv_page_tokens, (long long)kMaxPlanPageTokens));
  if (o.speculative_tokens < 0 || o.speculative_tokens > kMaxSpeculativeTokens)
    bad(format("speculative tokens %lld is outside 0..%lld (--spec-tokens)", (long long)o.speculative_tokens,
               (long long)kMaxSpeculativeTokens));
  if (o.ngram < 0 || o.ngram > kMaxNgram)
    bad(format("ngram %lld is outside 0..%lld (--ngram)", (long long)o.ngram, (long long)kMaxNgram));
  if (draft && o.ngram > 0)
    bad(format("speculative decoding drafts from a draft model (--draft) or by n-gram lookup (--ngram %lld), not "
               "both: drop one", (long long)o.ngram));
  if (draft && o.speculative_tokens == 0)
    bad("a draft model (--draft) needs --spec-tokens K: the tokens it drafts per step (e.g. 4)");
  if (!draft && (o.speculative_tokens > 0) != (o.ngram > 0))
    bad(format("speculative decoding needs both --ngram N (the longest n-gram matched) and --spec-tokens K (tokens "
               "drafted per step), or --draft MODEL_DIR and --spec-tokens K; got ngram %lld and speculative tokens "
               "%lld", (long long)o.ngram, (long long)o.speculative_tokens));
  if (draft) {
    const ModelConfig& d = draft->config;
    check_config(d);
    if (d.arch != Arch::llama && d.arch != Arch::qwen2 && d.arch != Arch::qwen3)
      fail(ErrorCode::unsupported,
           format("draft model %s: model_type '%s' is not a text model kvlite drafts with (llama, qwen2, qwen3)",
                  model_name_of(d).c_str(), d.model_type.c_str()));
    if (d.text.vocab_size != config.text.vocab_size)
      bad(format("draft model %s has a vocabulary of %lld tokens but %s has %lld: a draft must share the target's "
                 "tokenizer and vocabulary", model_name_of(d).c_str(), (long long)d.text.vocab_size,
                 model_name_of(config).c_str(), (long long)config.text.vocab_size));
    if (device.backend != BackendKind::cpu)
      fail(ErrorCode::unsupported,
           format("draft model %s: a draft model runs on the CPU backend only so far (%s); on CUDA use n-gram "
                  "drafting (--ngram N --spec-tokens K), or --backend cpu", model_name_of(d).c_str(),
                  device.name.c_str()));
  }
  if (o.speculative_tokens > 0 && o.max_batched_tokens > 0 && o.speculative_tokens + 1 > o.max_batched_tokens)
    bad(format("--spec-tokens %lld needs max_batched_tokens of at least %lld (a sequence reads K + 1 tokens in a "
               "step); max_batched_tokens is %lld", (long long)o.speculative_tokens,
               (long long)o.speculative_tokens + 1, (long long)o.max_batched_tokens));
  if (o.activation_dtype) {
    const DType act = *o.activation_dtype;
    if (act != DType::F32 && act != DType::BF16 && act != DType::F16)
      bad(format("activation dtype %s: activations are BF16, F16 or F32", dtype_name(act)));
  }
  if (o.host_embeddings && config.text.tie_word_embeddings)
    bad(format("--host-embeddings keeps an untied embedding table in host memory, but %s ties its embeddings "
               "(tie_word_embeddings: embed_tokens is also lm_head, which the device multiplies by every step): "
               "drop --host-embeddings", model_name_of(config).c_str()));
  if (o.max_images < 1 || o.max_images > kMaxPlanImages)
    bad(format("max_images %lld is outside 1..%lld", (long long)o.max_images, (long long)kMaxPlanImages));
  if (o.max_image_pixels < 0)
    bad(format("max_image_pixels %lld must be positive (or 0 for the default)", (long long)o.max_image_pixels));
  if (o.max_image_pixels > 0) {
    if (!config.vision.present)
      bad(format("max_image_pixels %lld was given but %s has no vision tower (model_type %s)",
                 (long long)o.max_image_pixels, model_name_of(config).c_str(), config.model_type.c_str()));
    uint64_t window = window_pixels(config.vision);
    if (uint64_t(o.max_image_pixels) < window)
      bad(format("max_image_pixels %lld is less than one merge window (%llu pixels = %lld x %lld): no image fits",
                 (long long)o.max_image_pixels, (unsigned long long)window,
                 (long long)(config.vision.patch_size * config.vision.spatial_merge_size),
                 (long long)(config.vision.patch_size * config.vision.spatial_merge_size)));
    if (o.max_image_pixels < config.min_pixels)
      bad(format("max_image_pixels %lld is less than the processor's min_pixels %lld (every image is resized up "
                 "to at least that): use at least %lld",
                 (long long)o.max_image_pixels, (long long)config.min_pixels, (long long)config.min_pixels));
    if (o.max_image_pixels > kMaxPlanImagePixels)
      bad(format("max_image_pixels %lld is more than %lld (16384 x 16384)", (long long)o.max_image_pixels,
                 (long long)kMaxPlanImagePixels));
  }
}

struct Inputs {
  const ModelConfig& config;
  const WeightsSummary& weights;
  uint64_t tensor_count;
  const DeviceSpec& device;  // wsl2 resolved
  const PlanInputs* draft;   // a draft model's inputs, or nullptr
};

// Sliding layers' pages are returned as they leave the window unless a draft model shares the "kv" pages' ids
// (speculative decoding): its layers keep every token's K/V, so those pages stay as they are.
bool windows_in_memory(const Inputs& in) { return in.draft == nullptr; }

// CUDA: what the device copy of the weights weighs beyond their bytes on disk (negative when converting
// shrinks them), and why.
struct WeightConversion {
  int64_t extra_bytes = 0;
  uint64_t converted_linears = 0;
  bool tied_copy = false;
};
WeightConversion cuda_weight_conversion(const ModelConfig& config, const WeightsSummary& weights, DType act) {
  WeightConversion c;
  const int64_t act_bytes = int64_t(dtype_bytes(act, 1));
  for (const LinearDesc& linear : weights.linears) {
    if (linear.format != WeightFormat::dense || linear.weight_dtype == act) continue;
    const int64_t elements = linear.out_features * linear.in_features + (linear.has_bias ? linear.out_features : 0);
    c.extra_bytes += elements * act_bytes - int64_t(linear.bytes);
    c.converted_linears++;
  }
  // The vision tower's patch embedding (a Conv3d kernel, not among the Linears) runs as a Linear: converted too,
  // from the checkpoint's dtype (summarize_weights counts it in that dtype).
  if (config.vision.present && config.text.dtype != act) {
    const VisionConfig& v = config.vision;
    const int64_t vh = v.hidden_size, patch = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
    c.extra_bytes += (vh * patch + vh) * (act_bytes - int64_t(dtype_bytes(config.text.dtype, 1)));
    c.converted_linears++;
  }
  // A tied lm_head reads the embedding table; gather_rows takes any float table, the GEMM only act. The
  // table's dtype is its width (4: F32) or, for 2 bytes, the checkpoint's 16-bit dtype.
  const TextConfig& t = config.text;
  const uint64_t table_elements = uint64_t(t.vocab_size) * uint64_t(t.hidden_size);
  if (t.tie_word_embeddings && table_elements > 0) {
    const uint64_t width = weights.embedding_bytes / table_elements;
    const DType table = width == 4 ? DType::F32 : t.dtype == DType::F16 ? DType::F16 : DType::BF16;
    if (table != act) {
      c.extra_bytes += int64_t(table_elements) * act_bytes;
      c.tied_copy = true;
    }
  }
  return c;
}

// Room for the uploader's 256-byte alignment of every text tensor: at most 18 per layer (2 norms, q/k norms,
// 7 Linears with weight and bias; 20 with Gemma's 4 norms) plus the embedding table, the final norm, lm_head and a tied copy; and for
// Gemma's norms, uploaded as the fp32 1 + w the binder formed (at most 6 per layer and the final one).
uint64_t cuda_weight_slack(const ModelConfig& config) {
  const uint64_t layers = uint64_t(std::max<int64_t>(config.text.num_layers, 0));
  uint64_t tensors = 4 + (config.text.block.sandwich_norms ? 20 : 18) * layers;
  uint64_t computed_norms = 0;
  if (config.text.block.norm_form == NormForm::one_plus_weight)
    computed_norms = (6 * layers + 1) * uint64_t(std::max<int64_t>(config.text.hidden_size, config.text.head_dim)) * 4;
  // the vision tower: 12 per block (2 LayerNorms and 4 Linears, weight and bias each), the patch embedding (2),
  // the position table, and 6 per merger (the final one and DeepStack's)
  if (config.vision.present)
    tensors += 12 * uint64_t(std::max<int64_t>(config.vision.depth, 0)) + 3 +
               6 * (1 + uint64_t(config.vision.deepstack_visual_indexes.size()));
  return kPlanAlignment * tensors + computed_norms;
}

// --host-embeddings on CUDA (an untied table: check_options refused a tied one): the table's bytes stay in host
// memory, and the looked-up rows go through a pinned host buffer of max_batched_tokens x hidden activations.
uint64_t host_embedding_bytes(const Inputs& in, const PlanOptions& o) {
  return o.host_embeddings && in.device.backend == BackendKind::cuda && !in.config.text.tie_word_embeddings
             ? in.weights.embed_table_bytes
             : 0;
}
uint64_t host_staging_bytes(const Inputs& in, const PlanOptions& o) {
  if (host_embedding_bytes(in, o) == 0) return 0;
  const uint64_t rows = uint64_t(std::max<int64_t>(o.max_batched_tokens, 0));
  const uint64_t hidden = uint64_t(std::max<int64_t>(in.config.text.hidden_size, 0));
  return align_up(dtype_bytes(*o.activation_dtype, rows * hidden), kPlanAlignment);
}

PlanItem weights_item(const Inputs& in, const PlanOptions& o) {
  const DType act = *o.activation_dtype;
  // On the CPU the weights are read in place from the memory-mapped safetensors files (the OS page cache
  // holds them): they count against the budget but are not copied into the arena.
  bool in_arena = in.device.backend == BackendKind::cuda;
  PlanItem item{"weights", "", align_up(in.weights.total_bytes, kPlanAlignment), "", in_arena};
  uint64_t linear_bytes = 0;
  for (const auto& linear : in.weights.linears) linear_bytes += linear.bytes;
  std::string device;  // CUDA: what uploading changes
  if (in_arena) {
    const WeightConversion c = cuda_weight_conversion(in.config, in.weights, act);
    const uint64_t host_table = host_embedding_bytes(in, o);
    const int64_t bytes = std::max<int64_t>(0, int64_t(in.weights.total_bytes) - int64_t(host_table) + c.extra_bytes) +
                          int64_t(cuda_weight_slack(in.config));
    item.bytes = align_up(uint64_t(bytes), kPlanAlignment);
    device = format("; on the GPU %s(%s): ", c.converted_linears || c.tied_copy || host_table ? "" : "as stored ",
                    format_bytes_signed(int64_t(item.bytes) - int64_t(in.weights.total_bytes)).c_str());
    if (c.converted_linears) device += format("%llu Linears converted to %s, ", (unsigned long long)c.converted_linears,
                                              activation_dtype_text(act));
    if (c.tied_copy) device += format("a %s copy of the tied lm_head, ", activation_dtype_text(act));
    device += format("256-byte alignment; uploaded in %s chunks", format_bytes(kCudaUploadChunkBytes).c_str());
    if (host_table > 0)
      device += format("; embed_tokens (%s) stays in host memory (--host-embeddings): each step looks up its rows on "
                       "the host into a pinned host buffer of %s (T=%lld x H=%lld %s; host memory, not in the device "
                       "budget) and copies them into the activations' hidden buffer",
                       format_bytes(host_table).c_str(), format_bytes(host_staging_bytes(in, o)).c_str(),
                       (long long)o.max_batched_tokens, (long long)in.config.text.hidden_size,
                       activation_dtype_text(act));
  }
  if (in.weights.exact) {
    item.label = in.tensor_count ? format("weights (exact, %llu tensors)", (unsigned long long)in.tensor_count)
                                 : std::string("weights (exact, from headers)");
    item.why = format("sum of the tensors' byte spans in the safetensors headers: %zu Linears %s, the rest %s%s",
                      in.weights.linears.size(), format_bytes(linear_bytes).c_str(),
                      format_bytes(in.weights.total_bytes - std::min(linear_bytes, in.weights.total_bytes)).c_str(),
                      in_arena ? device.c_str()
                      : o.host_embeddings
                          ? "; memory-mapped, not copied (CPU; --host-embeddings changes nothing here: the CPU's "
                            "embedding table is host memory already)"
                          : "; memory-mapped, not copied (CPU)");
  } else {
    item.label = "weights (estimated from config.json)";
    item.why = format("no safetensors in the directory: shapes from config.json, formats from quantization_config "
                      "(%zu Linears %s)%s", in.weights.linears.size(), format_bytes(linear_bytes).c_str(), device.c_str());
  }
  if (in.config.vision.present)
    item.why += format("; the vision tower %s of it", format_bytes(in.weights.vision_bytes).c_str());
  return item;
}

// The text model's Linear groups (LinearGroup: each layer's q|k|v and gate|up, found by name, in the model's order)
// that the CUDA uploader fuses into one device Linear (linear_group_fuses).
std::vector<std::vector<const LinearDesc*>> fused_linear_groups(const std::vector<LinearDesc>& linears) {
  std::map<std::string, const LinearDesc*> by_name;
  for (const LinearDesc& linear : linears)
    if (!linear.vision) by_name[linear.name] = &linear;
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  std::vector<std::vector<const LinearDesc*>> groups;
  const std::vector<std::vector<std::string>> members = {{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
                                                         {"mlp.gate_proj", "mlp.up_proj"}};
  for (const auto& entry : by_name)
    for (const std::vector<std::string>& names : members) {
      if (!ends_with(entry.first, names[0])) continue;
      const std::string prefix = entry.first.substr(0, entry.first.size() - names[0].size());
      std::vector<const LinearDesc*> group;
      for (const std::string& name : names) {
        auto found = by_name.find(prefix + name);
        if (found != by_name.end()) group.push_back(found->second);
      }
      if (group.size() == names.size() && linear_group_fuses(group)) groups.push_back(group);
    }
  return groups;
}

PlanItem repack_item(const Inputs& in) {
  PlanItem item{"repack", "repack", 0, "", true};
  if (in.device.backend != BackendKind::cuda) {
    // AWQ / GPTQ Linears are repacked once at load into the compressed-tensors view the CPU matmul runs
    // (repacked_host_bytes: packed weights, transposed scales, zero points, act-order g_idx), held next to
    // the memory-mapped checkpoint; compressed-tensors and fp8 are used in place.
    uint64_t host = 0, repacked = 0;
    for (const auto& linear : in.weights.linears)
      if (uint64_t bytes = repacked_host_bytes(linear)) host += bytes, repacked++;
    item.why = repacked ? format("%llu AWQ / GPTQ Linears repacked at load into the CPU's int4 layout (weight_packed "
                                 "[N, K/8], scales [N, G], zero points, act-order g_idx): %s",
                                 (unsigned long long)repacked, format_bytes(host).c_str())
                        : std::string("CPU backend runs the on-disk layout: nothing to repack");
    bool lm_head_quantized = false;  // (a checkpoint's quantized lm_head runs as stored)
    for (const auto& linear : in.weights.linears)
      lm_head_quantized = lm_head_quantized || (linear.name == "lm_head" && linear.format != WeightFormat::dense);
    if (in.device.cpu_lm_head == CpuLmHead::int8 && !lm_head_quantized) {  // Engine::open's quantize_int8_copy
      const int64_t vocab = in.config.text.vocab_size, hidden = in.config.text.hidden_size;
      const uint64_t copy = int8_copy_bytes(vocab, hidden);
      host = checked_add(host, copy, "repack bytes");
      item.why += format("; --cpu-lm-head int8: the lm_head's int8 copy [%lld, %lld] with F32 scales per %lld "
                         "columns, %s",
                         (long long)vocab, (long long)hidden, (long long)int8_copy_group_size(hidden),
                         format_bytes(copy).c_str());
    }
    item.bytes = align_up(host, kPlanAlignment);
    return item;
  }
  // The quantized Linears the GPU runs, in the layout its GEMMs read (cuda::quant_device_bytes: repacked tiles
  // padded to whole tiles, F32 scale tables, act-order permutation, F32 bias, split-K counters) over their bytes
  // on disk, which the weights row counts. The uploader fills weights and repack as one span.
  // A q|k|v or gate|up group the uploader fuses is one device Linear (cuda::quant_device_bytes of its parts).
  uint64_t extra = 0, quantized = 0, fused_groups = 0;
  std::set<const LinearDesc*> in_group;
  auto count = [&](uint64_t gpu, uint64_t disk) { extra += gpu > disk ? gpu - disk : 0; };
  for (const std::vector<const LinearDesc*>& group : fused_linear_groups(in.weights.linears)) {
    if (group[0]->format == WeightFormat::dense) continue;
    uint64_t disk = 0;
    for (const LinearDesc* part : group) {
      disk += part->bytes;
      in_group.insert(part);
      quantized++;
    }
    count(cuda::quant_device_bytes(group), disk);
    fused_groups++;
  }
  uint64_t int8 = 0;
  for (const auto& linear : in.weights.linears) {
    if (linear.format == WeightFormat::dense || linear.vision || in_group.count(&linear)) continue;
    count(cuda::quant_device_bytes(linear), linear.bytes);
    quantized++;
    int8 += linear.format == WeightFormat::int8;
  }
  item.bytes = align_up(extra, kPlanAlignment);
  const std::string fused =
      fused_groups ? format(" (%llu q|k|v and gate|up groups fused, one Linear each)", (unsigned long long)fused_groups)
                   : std::string();
  const std::string int8_note =
      int8 ? format("; %llu int8 Linears stay 1 byte a weight and run through dequantize + cuBLAS (no int8 GEMM "
                    "kernel yet)", (unsigned long long)int8)
           : std::string();
  item.why = quantized ? format("%llu quantized Linears%s in the GPU's layout (repacked tiles, scale tables, "
                                "counters) take %s more than on disk%s",
                                (unsigned long long)quantized, fused.c_str(), format_bytes(extra).c_str(),
                                int8_note.c_str())
                       : std::string("no quantized Linear: nothing to repack");
  return item;
}

PlanItem context_item(const Inputs& in) {
  PlanItem item{"context", "context (outside the arena)", 0, "", false};
  if (in.device.backend != BackendKind::cuda) {
    item.why = "CPU backend: no device context";
  } else if (in.device.wsl2) {
    item.bytes = kContextWsl2;
    item.why = "CUDA context + cuBLAS handles + driver: 1024 MiB under WSL2 (its paravirtualized driver reserves "
               "more; pinned memory is limited, vLLM disables it)";
  } else {
    const ContextThreads threads = context_threads(in.device);
    item.bytes = cuda_context_bytes(in.device);
    item.why = format("CUDA context %s + stack for %d SMs x %d threads %s%s + cuBLAS and loaded kernels %s (native "
                      "Linux; measured on an H100)",
                      format_bytes(kCudaContextBaseBytes).c_str(), threads.multiprocessors,
                      threads.threads_per_multiprocessor, threads.planned ? "(a planned card: the RTX 4060 Ti's) " : "",
                      format_bytes(context_stack_bytes(in.device)).c_str(), format_bytes(kCudaRuntimeBytes).c_str());
  }
  return item;
}

PlanItem activations_item(const Inputs& in, const PlanOptions& o) {
  const bool gpu = in.device.backend == BackendKind::cuda;
  const int64_t pages = gpu ? block_table_pages(in.config, o.kv_page_tokens) : 0;
  const bool window = kv_groups(in.config.text, windows_in_memory(in)).window_layers > 0;
  auto buffers = activation_buffers(in.config, o.max_batched_tokens, o.max_seqs, *o.activation_dtype, pages, window);
  const char* dtype = activation_dtype_text(*o.activation_dtype);
  return {"activations", "activations", buffers_bytes(buffers),
          format("one step of T=%lld tokens (max_batched_tokens) for %lld seqs: residual, normed, qkv, attn_out, "
                 "gate_up, mlp_act %s; split-KV partials (S,Hq,%llu,D+2) fp32; RoPE cos/sin (T,R/2) fp32 per RoPE kind (R: rotary dims); int32 index "
                 "arrays%s%s",
                 (long long)o.max_batched_tokens, (long long)o.max_seqs, dtype, (unsigned long long)kDecodeSplits,
                 gpu ? format("; block tables (S+1,%lld) int32", (long long)pages).c_str() : "",
                 window ? (gpu ? " (and the sliding layers' own)" : "; the sliding layers' own slots") : ""),
          true};
}

PlanItem vision_item(const Inputs& in, const PlanOptions& o) {
  const VisionConfig& v = in.config.vision;
  auto buffers = vision_buffers(in.config, o.max_image_pixels, o.max_images, *o.activation_dtype);
  uint64_t windows = merge_windows(v, o.max_image_pixels);
  uint64_t patches = windows * uint64_t(v.spatial_merge_size * v.spatial_merge_size);
  const std::string attention =
      v.traits.window_size > 0
          ? format("; window attention (%lld px windows, %zu full blocks) streams its keys: no score matrix",
                   (long long)v.traits.window_size, v.traits.fullatt_block_indexes.size())
          : std::string();
  return {"vision", format("vision (%lld image%s)", (long long)o.max_images, o.max_images == 1 ? "" : "s"),
          buffers_bytes(buffers),
          format("encoder for %lld x %s pixels = %s patches (%s tokens) each: patches, hidden, qkv, mlp, merger "
                 "outputs%s%s",
                 (long long)o.max_images, format_count(uint64_t(o.max_image_pixels)).c_str(),
                 format_count(patches).c_str(), format_count(windows).c_str(),
                 v.deepstack_visual_indexes.empty()
                     ? ""
                     : format(" x %zu (1 + DeepStack)", 1 + v.deepstack_visual_indexes.size()).c_str(),
                 attention.c_str()),
          true};
}

PlanItem logits_item(const Inputs& in, const PlanOptions& o) {
  auto buffers = logits_buffers(in.config, o.max_seqs);
  int64_t rows = std::max(o.max_seqs, kScoringRows);
  return {"logits", "logits", buffers_bytes(buffers),
          format("scoring computes log-probs %lld rows at a time: (%lld, V=%lld) fp32 + sampling (%lld, V) fp32 + ids",
                 (long long)kScoringRows, (long long)rows, (long long)in.config.text.vocab_size,
                 (long long)o.max_seqs),
          true};
}

PlanItem workspace_item(const Inputs& in, const PlanOptions& o) {
  PlanItem item{"workspace", "workspace", 0, "", true};
  if (in.device.backend == BackendKind::cuda) {
    // Repacking goes through a scratch copy of one Linear at a time; dense Linears are used as stored, so only
    // quantized ones count (an untied bf16 lm_head would otherwise reserve a second copy of itself).
    const LinearDesc* largest = nullptr;
    for (const auto& linear : in.weights.linears)
      if (linear.format != WeightFormat::dense && (!largest || linear.bytes > largest->bytes)) largest = &linear;
    uint64_t scratch = largest ? largest->bytes : 0;
    item.bytes = align_up(kCudaWorkspaceBytes + scratch, kPlanAlignment);
    const std::string backend = format("%s cuBLAS workspace + %s attention scratch",
                                       format_bytes(kCudaCublasWorkspaceBytes).c_str(),
                                       format_bytes(kCudaScratchBytes).c_str());
    item.why = largest ? format("%s + repack scratch the size of the largest quantized Linear (%s, %s)", backend.c_str(),
                                largest->name.c_str(), format_bytes(scratch).c_str())
                       : backend + " (no quantized Linear: no repack scratch)";
  } else {
    // The CPU backend's scratch, as make_cpu_backend allocates it for the options Engine::open makes (host memory
    // beside the arena, counted here so that the budget holds it too).
    const CpuBackendOptions backend =
        cpu_backend_options_for(in.config, in.weights, in.draft, *o.activation_dtype, in.device.cpu_threads,
                                in.device.cpu_kernels, in.device.cpu_lm_head);
    const int threads = cpu_threads_or_all(backend.threads);
    item.bytes = align_up(cpu_backend_scratch_bytes(backend), kPlanAlignment);
    item.why = format("CPU backend scratch for %d thread%s%s: attention rows (head_dim %lld) and 16 dequantized weight "
                      "rows of K=%lld fp32 each%s%s%s",
                      threads, threads == 1 ? "" : "s", in.device.cpu_threads > 0 ? " (--threads)" : " (one per hardware thread)",
                      (long long)backend.max_head_dim, (long long)backend.max_quant_in_features,
                      *o.activation_dtype != DType::F32 ? "; one 64-token chunk widened to fp32" : "",
                      backend.int8_activations ? "; one 64-token chunk of W8A8's int8-rounded activations" : "",
                      backend.kernels == CpuKernels::fast_lowp ? "; one 64-token chunk of fast-lowp's quantized activations" : "");
  }
  return item;
}

PlanItem graphs_item(const Inputs& in, const PlanOptions& o) {
  PlanItem item{"graphs", "graphs (outside the arena)", 0, "", false};
  if (in.device.backend != BackendKind::cuda) {
    item.why = "CPU backend: no CUDA graphs";
    return item;
  }
  std::string buckets;
  const std::vector<int64_t> list = decode_graph_buckets(o.max_seqs);
  const uint64_t count = list.size();
  for (int64_t bucket : list) buckets += (buckets.empty() ? "" : ",") + ll(bucket);
  if (count > 6) {  // keep the line short: 1,2,4,...,256
    buckets = "1,2,4,...," + ll(o.max_seqs);
  }
  const uint64_t layers = uint64_t(std::max<int64_t>(in.config.text.num_layers, 0));
  item.bytes = align_up(kGraphPoolBase + kGraphPoolPerLayerBucket * layers * count, kGraphPoolGranularity);
  item.why = format("driver memory of the decode CUDA graphs: 2 MiB + 64 KiB x %llu layers x %llu batch buckets (%s), "
                    "in whole 2 MiB, as measured on an H100 (their buffers are the arena's)",
                    (unsigned long long)layers, (unsigned long long)count, buckets.c_str());
  return item;
}

// A draft model's rows (speculative decoding; the CPU backend, whose checks ran in check_options): its weights
// (memory-mapped), its buffers for a step like the target's, and the distributions it drafted from, which
// verification reads when sampling. Its KV is the "draft_kv" region beside the pages (assemble).
std::vector<PlanItem> draft_items(const Inputs& in, const PlanOptions& o) {
  const PlanInputs& d = *in.draft;
  const std::string name = model_name_of(d.config);
  std::vector<PlanItem> items;
  items.push_back({"draft_weights", format("draft weights (%s)", name.c_str()),
                   align_up(d.weights.total_bytes, kPlanAlignment),
                   format("the draft model's tensors (%s, %llu tensors), memory-mapped, not copied (CPU)",
                          d.weights.exact ? "exact, from headers" : "estimated from config.json",
                          (unsigned long long)d.tensor_count),
                   false});
  auto buffers = activation_buffers(d.config, o.max_batched_tokens, o.max_seqs, *o.activation_dtype, 0);
  items.push_back({"draft_activations", "draft activations", buffers_bytes(buffers),
                   format("the draft's step buffers for T=%lld tokens and %lld seqs, as the target's",
                          (long long)o.max_batched_tokens, (long long)o.max_seqs),
                   true});
  items.push_back({"draft_logits", "draft logits", buffers_bytes(logits_buffers(d.config, o.max_seqs)),
                   format("the draft's logits and sampling rows for %lld seqs", (long long)o.max_seqs), true});
  const uint64_t probs = uint64_t(o.max_seqs) * uint64_t(o.speculative_tokens) * uint64_t(d.config.text.vocab_size) * 4;
  items.push_back({"draft_probs", "draft distributions", align_up(probs, kPlanAlignment),
                   format("(S=%lld x K=%lld, V=%lld) fp32: the distribution each drafted token was drawn from, which "
                          "verifying a sampled draft needs",
                          (long long)o.max_seqs, (long long)o.speculative_tokens, (long long)d.config.text.vocab_size),
                   true});
  return items;
}

// The arena's bytes per KV page: the target's page and, with a draft model, the draft's beside it.
uint64_t kv_page_bytes_all(const Plan& plan) { return plan.kv_page_bytes + plan.draft_kv_page_bytes; }

// The "kv_window" region's bytes (0 without sliding windows in memory): fixed by max_seqs, the window and
// max_batched_tokens, whatever the context.
// (saturated: a hostile config's window could wrap 64 bits; a saturated figure never fits any budget)
uint64_t kv_window_bytes(const Plan& plan) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(plan.kv_window_pages, plan.kv_window_page_bytes, &bytes)) return uint64_t(1) << 62;
  return std::min(bytes, uint64_t(1) << 62);
}

// The "kv" pages one sequence of `tokens` tokens holds at most: all of them, or when those pages keep only windows,
// its window's and one step's (Plan::kv_pages_windowed).
uint64_t sequence_kv_pages(const Plan& plan, int64_t tokens) {
  const uint64_t pages = ceil_div(uint64_t(std::max<int64_t>(tokens, 0)), plan.kv_page_tokens);
  if (!plan.kv_pages_windowed()) return pages;
  return std::min(pages, kv_window_pages_for(int64_t(plan.kv_window), int64_t(plan.kv_page_tokens), 1,
                                             plan.options.max_batched_tokens, tokens));
}

// KV bytes one sequence of `tokens` tokens takes, in whole pages (and, with sliding windows in memory, the window
// pages' region, which every plan of these options has).
uint64_t kv_bytes_for(const Plan& plan, int64_t tokens) {
  return sequence_kv_pages(plan, tokens) * kv_page_bytes_all(plan) +
         (plan.kv_window_pages > 0 ? kv_window_bytes(plan) + kPlanAlignment : 0);
}

// The plan for fully resolved options: items, budget, KV arena and the verdict (no what-if analysis).
Plan assemble(const Inputs& in, const PlanOptions& o) {
  Plan plan;
  plan.device = in.device;
  plan.options = o;
  plan.model_name = model_name_of(in.config);
  plan.arch = in.config.arch;
  plan.items.push_back(weights_item(in, o));
  plan.items.push_back(repack_item(in));
  plan.items.push_back(context_item(in));
  plan.items.push_back(activations_item(in, o));
  if (in.config.vision.present) plan.items.push_back(vision_item(in, o));
  plan.items.push_back(logits_item(in, o));
  plan.items.push_back(workspace_item(in, o));
  plan.items.push_back(graphs_item(in, o));
  if (in.draft)
    for (PlanItem& item : draft_items(in, o)) plan.items.push_back(std::move(item));

  if (in.config.vision.present) {
    const VisionConfig& v = in.config.vision;
    plan.image_pixels_per_token = int64_t(window_pixels(v));
    plan.image_tokens_per_image = int64_t(merge_windows(v, o.max_image_pixels));
    plan.image_patches_per_image = plan.image_tokens_per_image * v.spatial_merge_size * v.spatial_merge_size;
    plan.vision_weights_bytes = in.weights.vision_bytes;
    plan.vision_activation_bytes = plan.item("vision")->bytes;
  }

  plan.weights_bytes = in.weights.total_bytes;
  plan.host_embedding_bytes = host_embedding_bytes(in, o);
  plan.host_staging_bytes = host_staging_bytes(in, o);
  plan.weights_source = in.weights.exact ? "headers" : "config";
  plan.upload_chunk_bytes = in.device.backend == BackendKind::cuda ? kCudaUploadChunkBytes : 0;
  // Every layer has the same KV heads and head_dim: a token's KV splits evenly over the layers (and the groups).
  const KVGroups groups = kv_groups(in.config.text, windows_in_memory(in));
  const uint64_t layers = uint64_t(std::max<int64_t>(in.config.text.num_layers, 1));
  const uint64_t layer_token_bytes = in.config.kv_bytes_per_token(kv_dtype_bytes(o.kv_dtype)) / layers;
  plan.kv_bytes_per_token = layer_token_bytes * (groups.window_layers > 0 ? uint64_t(groups.full_layers) : layers);
  plan.kv_page_tokens = uint64_t(o.kv_page_tokens);
  plan.kv_page_bytes = plan.kv_page_tokens * plan.kv_bytes_per_token;
  if (groups.main_window > 0) plan.kv_window = uint64_t(groups.main_window);
  if (groups.window_layers > 0) {
    plan.kv_window = uint64_t(groups.window);
    plan.kv_window_bytes_per_token = layer_token_bytes * uint64_t(groups.window_layers);
    plan.kv_window_page_bytes = plan.kv_page_tokens * plan.kv_window_bytes_per_token;
    plan.kv_window_pages = kv_window_pages_for(groups.window, o.kv_page_tokens, o.max_seqs, o.max_batched_tokens,
                                               o.max_model_len);
  }
  if (in.draft) {
    plan.draft_model_name = model_name_of(in.draft->config);
    plan.draft_kv_bytes_per_token = in.draft->config.kv_bytes_per_token(kv_dtype_bytes(o.kv_dtype));
    plan.draft_kv_page_bytes = plan.kv_page_tokens * plan.draft_kv_bytes_per_token;
  }
  plan.budget_bytes = budget_for(o.utilization, in.device.total_bytes);
  for (const auto& item : plan.items) plan.fixed_bytes += item.bytes;
  plan.kv_available_bytes = int64_t(plan.budget_bytes) - int64_t(plan.fixed_bytes);
  // (with a draft model its pages' region starts on a region boundary: up to kPlanAlignment - 1 bytes more; so do
  // the sliding windows' pages, which come out of the room first: their count does not depend on the budget)
  const int64_t page_room = plan.kv_available_bytes - (in.draft ? int64_t(kPlanAlignment) : 0) -
                            (plan.kv_window_pages > 0 ? int64_t(kv_window_bytes(plan) + kPlanAlignment) : 0);
  plan.kv_pages = page_room > 0 ? uint64_t(page_room) / kv_page_bytes_all(plan) : 0;
  // An embedded library shares its memory (the CPU's with everything on the machine, a desktop GPU's with the
  // display and other apps, a Jetson's with the OS): take only the pages max_seqs sequences of max_model_len
  // can use, no preemption needed. kv_fill: the whole budget, as vLLM does.
  plan.kv_pages_usable = uint64_t(o.max_seqs) * ceil_div(uint64_t(o.max_model_len), plan.kv_page_tokens);
  // (every layer sliding: the windows of max_seqs sequences and one step, whatever max_model_len)
  if (plan.kv_pages_windowed())
    plan.kv_pages_usable = kv_window_pages_for(groups.main_window, o.kv_page_tokens, o.max_seqs, o.max_batched_tokens,
                                               o.max_model_len);
  if (!o.kv_fill) plan.kv_pages = std::min(plan.kv_pages, plan.kv_pages_usable);
  // (the "draft_kv" region follows "kv" on a region boundary: arena_layout)
  // (and "kv_window" follows "kv" the same way)
  plan.kv_arena_bytes = in.draft ? align_up(plan.kv_pages * plan.kv_page_bytes, kPlanAlignment) +
                                       plan.kv_pages * plan.draft_kv_page_bytes
                        : plan.kv_window_pages > 0
                            ? align_up(plan.kv_pages * plan.kv_page_bytes, kPlanAlignment) + kv_window_bytes(plan)
                            : plan.kv_pages * plan.kv_page_bytes;
  const uint64_t used = plan.fixed_bytes + plan.kv_arena_bytes;  // arena + what the device spends outside it
  plan.free_bytes = plan.budget_bytes > used ? plan.budget_bytes - used : 0;
  plan.kv_tokens = plan.kv_pages * plan.kv_page_tokens;
  plan.max_model_len = o.max_model_len;
  // (a sequence of max_model_len needs its pages, or with every layer sliding its window's and one step's)
  const uint64_t sequence_pages = sequence_kv_pages(plan, o.max_model_len);
  plan.concurrency = plan.kv_pages_windowed() ? double(plan.kv_pages) / double(sequence_pages)
                                              : double(plan.kv_tokens) / double(o.max_model_len);
  plan.fits = plan.kv_available_bytes > 0 && plan.kv_pages >= sequence_pages;
  plan.shortfall_bytes = plan.fits ? 0 : int64_t(kv_bytes_for(plan, o.max_model_len)) - plan.kv_available_bytes;
  return plan;
}

// With options fully resolved for `max_model_len`; max_batched_tokens follows it unless the caller set it.
PlanOptions with_max_model_len(PlanOptions o, const PlanOptions& requested, int64_t max_model_len) {
  o.max_model_len = max_model_len;
  o.max_batched_tokens = requested.max_batched_tokens > 0 ? requested.max_batched_tokens
                                                          : std::min(kDefaultBatchedTokens, max_model_len);
  return o;
}

// The smallest utilization whose budget (as budget_for computes it) holds `bytes`. double(bytes) / double(total)
// is within two ulps of the exact ratio, and each step up adds about `bytes` x 2^-52 to the budget, so a few
// steps up always suffice; the loop is bounded anyway (the old one stepped toward 2.0, i.e. downwards once the
// ratio passed 2, and never ended).
double utilization_for(uint64_t bytes, uint64_t total) {
  if (total == 0) return std::numeric_limits<double>::infinity();
  double u = double(bytes) / double(total);
  for (int step = 0; step < kUtilizationSearchSteps && budget_for(u, total) < bytes; ++step)
    u = std::nextafter(u, std::numeric_limits<double>::infinity());
  return u;
}

// The utilization to print: two decimals, rounded up, and checked to be enough. Only called for needs up to 1.0,
// where 0.01 steps always make progress; bounded anyway.
double printable_utilization(double needed, uint64_t bytes, uint64_t total) {
  double u = std::ceil(needed * 100.0) / 100.0;
  for (int step = 0; step < kUtilizationSearchSteps && budget_for(u, total) < bytes; ++step) u += 0.01;
  return u;
}

void write_advice(const Inputs& in, Plan& plan) {
  const PlanOptions& o = plan.options;
  std::string ratio = format_ratio(o.utilization);
  if (plan.fits) {
    if (plan.kv_pages_windowed())
      plan.advice.push_back(format("KV holds %s tokens of windows (%lld tokens a layer sees): %.1f sequences of %lld.",
                                   format_count(plan.kv_tokens).c_str(), (long long)plan.kv_window, plan.concurrency,
                                   (long long)plan.max_model_len));
    else
      plan.advice.push_back(format("KV holds %s tokens: %.1f sequences of %lld.", format_count(plan.kv_tokens).c_str(),
                                   plan.concurrency, (long long)plan.max_model_len));
    return;
  }
  uint64_t needed = kv_bytes_for(plan, plan.max_model_len);
  plan.advice.push_back(format("Does not fit: KV needs %s for one %lld-token sequence but only %s is left (short by %s).",
                               format_bytes(needed).c_str(), (long long)plan.max_model_len,
                               format_bytes_signed(plan.kv_available_bytes).c_str(),
                               format_bytes(uint64_t(plan.shortfall_bytes)).c_str()));
  if (plan.max_model_len_that_fits > 0)
    plan.advice.push_back(format("Largest max_model_len at utilization %s: %lld (--max-model-len %lld).", ratio.c_str(),
                                 (long long)plan.max_model_len_that_fits, (long long)plan.max_model_len_that_fits));
  else
    plan.advice.push_back(format("No max_model_len fits at utilization %s: the fixed items need %s of the %s budget.",
                                 ratio.c_str(), format_bytes(plan.fixed_bytes).c_str(),
                                 format_bytes(plan.budget_bytes).c_str()));
  uint64_t total_needed = plan.fixed_bytes + needed;
  if (plan.utilization_needed <= 1.0) {
    double shown = printable_utilization(plan.utilization_needed, total_needed, in.device.total_bytes);
    plan.advice.push_back(format("Utilization needed for max_model_len %lld: %.2f (--utilization %.2f).",
                                 (long long)plan.max_model_len, shown, shown));
  } else {
    plan.advice.push_back(format("max_model_len %lld does not fit at any utilization: needs %s more than the whole %s card.",
                                 (long long)plan.max_model_len,
                                 format_bytes(total_needed - in.device.total_bytes).c_str(),
                                 format_bytes(in.device.total_bytes).c_str()));
  }
  if (o.kv_dtype != KVDType::fp8 && plan.max_model_len_that_fits_fp8_kv > plan.max_model_len_that_fits &&
      kv_dtype_storable(in.device.backend, KVDType::fp8)) {
    // One line, one thing to do: the flags it names, together, make the plan fit.
    const bool fp8_alone = plan.max_model_len_that_fits_fp8_kv >= plan.max_model_len;
    const std::string flags =
        fp8_alone ? std::string("--kv-dtype fp8")
                  : format("--kv-dtype fp8 --max-model-len %lld", (long long)plan.max_model_len_that_fits_fp8_kv);
    plan.advice.push_back(format("With %s: fits (KV %s per token instead of %s; max_model_len up to %lld).",
                                 flags.c_str(),
                                 format_bytes(plan.kv_bytes_per_token / uint64_t(kv_dtype_bytes(o.kv_dtype))).c_str(),
                                 format_bytes(plan.kv_bytes_per_token).c_str(),
                                 (long long)plan.max_model_len_that_fits_fp8_kv));
  }
  if (in.config.vision.present) {
    if (plan.image_pixels_that_fit > 0)
      plan.advice.push_back(format("With --max-image-pixels %lld: fits (%s image tokens per image instead of %s).",
                                   (long long)plan.image_pixels_that_fit,
                                   format_count(merge_windows(in.config.vision, plan.image_pixels_that_fit)).c_str(),
                                   format_count(merge_windows(in.config.vision, o.max_image_pixels)).c_str()));
    else
      plan.advice.push_back(format("No image budget makes max_model_len %lld fit: even the smallest (%s pixels) leaves "
                                   "too little for KV.", (long long)plan.max_model_len,
                                   format_count(smallest_image_pixels(in.config)).c_str()));
  }
  if (in.draft) {
    if (plan.speculative_tokens_that_fit > 0)
      plan.advice.push_back(format("With --spec-tokens %lld: fits (the draft's distributions take %s for K=%lld).",
                                   (long long)plan.speculative_tokens_that_fit,
                                   format_bytes(plan.item("draft_probs")->bytes).c_str(),
                                   (long long)o.speculative_tokens));
    else if (plan.fits_without_draft)
      plan.advice.push_back(format("No --spec-tokens fits with the draft model %s; without it (no --draft) the plan "
                                   "fits.", plan.draft_model_name.c_str()));
  }
  const uint64_t table = in.weights.embed_table_bytes;
  if (in.device.backend == BackendKind::cuda && !o.host_embeddings && !in.config.text.tie_word_embeddings &&
      table > 0) {
    // The untied table on the device: one flag takes it off (looked up on the host, a T x H copy a step).
    PlanOptions trial = o;
    trial.host_embeddings = true;
    const Plan with = assemble(in, trial);
    plan.layouts_assembled++;
    const std::string verdict =
        with.fits ? "that alone makes it fit"
                  : format("not enough alone: still short by %s", format_bytes(uint64_t(with.shortfall_bytes)).c_str());
    plan.advice.push_back(format("With --host-embeddings: the untied embedding table (embed_tokens, %s) stays in host "
                                 "memory, %s less on the device (a %s pinned host buffer takes the looked-up rows); %s.",
                                 format_bytes(table).c_str(), format_bytes(plan.fixed_bytes - with.fixed_bytes).c_str(),
                                 format_bytes(with.host_staging_bytes).c_str(), verdict.c_str()));
  }
  if (plan.weights_bytes - plan.host_embedding_bytes >= plan.budget_bytes) {
    // A model that is already quantized is not told to quantize: only a larger card (or budget) helps.
    const bool quantized = std::any_of(in.weights.linears.begin(), in.weights.linears.end(),
                                       [](const LinearDesc& l) { return l.format != WeightFormat::dense; });
    plan.advice.push_back(format("The weights alone (%s%s) exceed the %s budget: %s.",
                                 format_bytes(plan.weights_bytes - plan.host_embedding_bytes).c_str(),
                                 plan.host_embedding_bytes ? " on the device" : "",
                                 format_bytes(plan.budget_bytes).c_str(),
                                 quantized ? "this checkpoint is already quantized, so it needs a larger card"
                                           : "use a quantized checkpoint (W4A16 or FP8) or a larger card"));
  }
  if (in.device.backend == BackendKind::cuda && in.device.wsl2)
    plan.advice.push_back(format("WSL2: the CUDA context is planned at 1024 MiB instead of %s (the paravirtualized "
                                 "driver reserves more, and pinned host memory is limited); native Linux leaves %s "
                                 "more for KV.", format_bytes(cuda_context_bytes(in.device)).c_str(),
                                 format_bytes(kContextWsl2 - cuda_context_bytes(in.device)).c_str()));
}

}  // namespace planning
}  // namespace detail

// ---- buffers ----------------------------------------------------------------------------------------------

std::vector<int64_t> decode_graph_buckets(int64_t max_seqs) {
  std::vector<int64_t> buckets;
  for (int64_t b = 1; max_seqs > 0; b *= 2) {
    buckets.push_back(std::min(b, max_seqs));
    if (buckets.back() == max_seqs) break;
  }
  return buckets;
}

uint64_t buffers_bytes(const std::vector<BufferSpec>& buffers) {
  uint64_t sum = 0;
  for (const auto& b : buffers) sum += b.bytes;
  return sum;
}

int64_t block_table_pages(const ModelConfig& config, int64_t kv_page_tokens) {
  if (kv_page_tokens <= 0) return 0;
  const int64_t positions = detail::planning::context_positions(config.text);
  return int64_t(ceil_div(uint64_t(std::max<int64_t>(positions, 1)), uint64_t(kv_page_tokens)));
}

std::vector<BufferSpec> activation_buffers(const ModelConfig& config, int64_t tokens, int64_t max_seqs,
                                           BackendKind backend) {
  return backend == BackendKind::cuda
             ? activation_buffers(config, tokens, max_seqs, DType::BF16, block_table_pages(config, 16))
             : activation_buffers(config, tokens, max_seqs, DType::F32, 0);
}

KVGroups kv_groups(const TextConfig& text, bool windows_in_memory) {
  KVGroups groups;
  const BlockTraits& block = text.block;
  int64_t sliding = 0;
  for (int64_t l = 0; l < text.num_layers; l++) sliding += block.window_of(l) > 0;
  // Only a mix gets two groups; when every layer slides (mistral / phi3 with sliding_window) the "kv" pages are
  // the windows.
  const bool split = windows_in_memory && sliding > 0 && sliding < text.num_layers;
  if (windows_in_memory && sliding > 0 && sliding == text.num_layers) groups.main_window = block.sliding_window;
  groups.group_layer.assign(size_t(std::max<int64_t>(text.num_layers, 0)), 0);
  for (int64_t l = 0; l < text.num_layers; l++) {
    const bool window = split && block.window_of(l) > 0;
    groups.group_layer[size_t(l)] = window ? groups.window_layers++ : groups.full_layers++;
  }
  if (groups.window_layers > 0) groups.window = block.sliding_window;
  return groups;
}

uint64_t kv_window_pages_for(int64_t window, int64_t page_tokens, int64_t max_seqs, int64_t max_batched_tokens,
                             int64_t max_model_len) {
  if (window <= 0 || page_tokens <= 0 || max_seqs <= 0) return 0;
  const uint64_t P = uint64_t(page_tokens), S = uint64_t(max_seqs);
  const uint64_t held = S * (ceil_div(uint64_t(window), P) + 2) + ceil_div(uint64_t(std::max<int64_t>(max_batched_tokens, 0)), P);
  return std::min(held, S * ceil_div(uint64_t(std::max<int64_t>(max_model_len, 0)), P));
}

std::vector<BufferSpec> activation_buffers(const ModelConfig& config, int64_t tokens, int64_t max_seqs,
                                           DType activation_dtype, int64_t block_table_pages, bool kv_window) {
  using detail::planning::buffer;
  const TextConfig& t = config.text;
  uint64_t T = uint64_t(std::max<int64_t>(tokens, 0)), S = uint64_t(std::max<int64_t>(max_seqs, 0));
  uint64_t H = uint64_t(t.hidden_size), Hq = uint64_t(t.num_heads), Hkv = uint64_t(t.num_kv_heads);
  uint64_t D = uint64_t(t.head_dim), I = uint64_t(t.intermediate_size);
  uint64_t E = dtype_bytes(activation_dtype, 1);
  const char* act = detail::planning::activation_dtype_text(activation_dtype);
  // A GPU's attention batch has one spare sequence: a CUDA graph's padding rows (see TextModel).
  const uint64_t P = uint64_t(std::max<int64_t>(block_table_pages, 0)), spare = P > 0 ? 1 : 0;
  // M-RoPE models carry three position rows (t, h, w) per token.
  bool mrope = !t.rope.mrope_section.empty() || config.uses_mrope();
  // The rotary tables hold R / 2 columns, R = rotary_dim = int(D * partial_rotary_factor) (Phi-4-mini: 3/4 of D);
  // a config that gives no valid R was refused by the parser, so D / 2 is only a fallback.
  const Result<int64_t> rotary_dim = rope_rotary_dim(t.rope, t.head_dim);
  const uint64_t R2 = rotary_dim ? uint64_t(*rotary_dim / 2) : D / 2;
  std::vector<BufferSpec> buffers = {
      // the residual stream, in the activation dtype (as transformers keeps it: fp32 on the CPU reference,
      // bf16 in a bf16 model)
      buffer("hidden", {T, H}, E, "(T, H)", act),
      buffer("normed", {T, H}, E, "(T, H)", act),     // RMSNorm output, input of q/k/v and gate/up
      buffer("qkv", {T, (Hq + 2 * Hkv) * D}, E, "(T, (Hq + 2 Hkv) D)", act),
      buffer("attn_out", {T, Hq * D}, E, "(T, Hq D)", act),
      buffer("gate_up", {T, 2 * I}, E, "(T, 2 I)", act),
      buffer("mlp_act", {T, I}, E, "(T, I)", act),  // silu(gate) * up, input of down_proj
      // Split-KV decode: each (sequence, head, split) writes D outputs + its running max and sum.
      buffer("attn_partials", {S, Hq, detail::planning::kDecodeSplits, D + 2}, 4, "(S, Hq, splits, D + 2)", "fp32"),
      buffer("token_ids", {T}, 4, "(T)", "int32"),
      mrope ? buffer("positions", {3, T}, 4, "(3, T)", "int32") : buffer("positions", {T}, 4, "(T)", "int32"),
      buffer("slot_mapping", {T}, 4, "(T)", "int32"),  // KV slot (page x page_tokens + offset) each token writes
      buffer("seq_index", {T}, 4, "(T)", "int32"),     // which sequence of the batch each token belongs to
      // RoPE cos/sin of each token's position, computed on the host (rope_tables) and copied in.
      buffer("rope_cos", {T, R2}, 4, "(T, R / 2)", "fp32"),
      buffer("rope_sin", {T, R2}, 4, "(T, R / 2)", "fp32"),
      // attention batch: first token of each sequence; cached tokens of each sequence
      spare ? buffer("query_starts", {S + 2}, 4, "(S + 2)", "int32") : buffer("query_starts", {S + 1}, 4, "(S + 1)", "int32"),
      spare ? buffer("context_lens", {S + 1}, 4, "(S + 1)", "int32") : buffer("context_lens", {S}, 4, "(S)", "int32"),
      buffer("logit_rows", {T}, 4, "(T)", "int32"),            // the token rows whose logits are computed
  };
  if (P > 0) buffers.push_back(buffer("block_tables", {S + 1, P}, 4, "(S + 1, P)", "int32"));
  // Sliding windows in memory: the sliding layers' K/V go to their own pages, at their own slots (Plan::kv_window).
  if (kv_window) {
    buffers.push_back(buffer("window_slot_mapping", {T}, 4, "(T)", "int32"));
    if (P > 0) buffers.push_back(buffer("window_block_tables", {S + 1, P}, 4, "(S + 1, P)", "int32"));
  }
  // Gemma-3's sliding layers rotate with their own base (rope_local_base_freq): a second pair of tables.
  // (their RopeConfig is the default of that base: every dimension rotates)
  if (t.block.local_rope_theta > 0) {
    buffers.push_back(buffer("rope_cos_local", {T, D / 2}, 4, "(T, D / 2)", "fp32"));
    buffers.push_back(buffer("rope_sin_local", {T, D / 2}, 4, "(T, D / 2)", "fp32"));
  }
  // Vision models: a step's DeepStack rows, staged from the host and added to the image tokens' hidden states
  // (in the activation dtype; fp32-sized whatever it is).
  if (config.vision.present) buffers.push_back(buffer("deepstack_rows", {T, H}, 4, "(T, H)", "fp32"));
  return buffers;
}

std::vector<BufferSpec> vision_buffers(const ModelConfig& config, int64_t image_pixels, int64_t images,
                                       BackendKind backend) {
  return vision_buffers(config, image_pixels, images, detail::planning::default_activation_dtype(backend));
}

std::vector<BufferSpec> vision_buffers(const ModelConfig& config, int64_t image_pixels, int64_t images,
                                       DType activation_dtype) {
  using detail::planning::buffer;
  const VisionConfig& v = config.vision;
  if (!v.present || image_pixels <= 0 || images <= 0) return {};
  uint64_t merge = uint64_t(v.spatial_merge_size * v.spatial_merge_size);  // patches per merge window
  uint64_t N = detail::planning::merge_windows(v, image_pixels) * merge * uint64_t(images);
  uint64_t patch_values = uint64_t(v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size);
  uint64_t vh = uint64_t(v.hidden_size), vI = uint64_t(v.intermediate_size), out = uint64_t(v.out_hidden_size);
  uint64_t vD = v.num_heads > 0 ? vh / uint64_t(v.num_heads) : 0;  // vision head_dim
  uint64_t E = dtype_bytes(activation_dtype, 1);
  const char* act = detail::planning::activation_dtype_text(activation_dtype);
  uint64_t mergers = 1 + v.deepstack_visual_indexes.size();
  std::vector<BufferSpec> buffers = {
      buffer("pixel_patches", {N, patch_values}, E, "(N, C x frames x patch x patch)", act),
      // The residual stream and the mergers' outputs are in the activation dtype, planned fp32-sized whatever it
      // is (16-bit activations use half), so the GPU plans, which hold them without running the tower, keep the
      // numbers they print.
      buffer("vision_hidden", {N, vh}, 4, "(N, vh)", "fp32"),
      buffer("vision_normed", {N, vh}, E, "(N, vh)", act),
      buffer("vision_qkv", {N, 3 * vh}, E, "(N, 3 vh)", act),
      buffer("vision_attn_out", {N, vh}, E, "(N, vh)", act),
      buffer("vision_mlp", {N, vI}, E, "(N, vI)", act),
      buffer("merger_in", {N / merge, merge * vh}, E, "(N / 4, 4 vh)", act),
      // The final merger's output plus one per DeepStack level, kept until the language model splices them.
      buffer("merged", {mergers, N / merge, out}, 4, "(1 + deepstack, N / 4, out)", "fp32"),
      // 2-D RoPE of each patch (row and column frequencies), computed on the host and copied in.
      buffer("vision_rope_cos", {N, vD / 2}, 4, "(N, vD / 2)", "fp32"),
      buffer("vision_rope_sin", {N, vD / 2}, 4, "(N, vD / 2)", "fp32"),
      buffer("vision_segments", {uint64_t(images) + 1}, 4, "(images + 1)", "int32"),  // attention within each image
  };
  // Bilinear resampling of a learned position table (Qwen3-VL): 4 table rows and their weights per patch.
  if (v.traits.learned_positions) {
    buffers.push_back(buffer("vision_pos_indices", {N, 4}, 4, "(N, 4)", "int32"));
    buffers.push_back(buffer("vision_pos_weights", {N, 4}, 4, "(N, 4)", "fp32"));
  }
  // SwiGLU blocks (Qwen2.5-VL): gate | up before silu(gate) * up lands in vision_mlp.
  if (v.traits.mlp == VisionMlp::swiglu) buffers.push_back(buffer("vision_gate_up", {N, 2 * vI}, E, "(N, 2 vI)", act));
  // Window attention (Qwen2.5-VL): the windows' boundaries (a window holds at least one merge window, so at most
  // N / 4 of them), and each merge window's row in window order, which puts the merger's input back in raster
  // order. Attention itself forms no score matrix (segment_attention streams keys), so the window blocks and the
  // full blocks need the same buffers: the peak is these rows, not N^2 scores.
  if (v.traits.window_size > 0) {
    buffers.push_back(buffer("vision_window_segments", {N / merge + 1}, 4, "(N / 4 + 1)", "int32"));
    buffers.push_back(buffer("vision_window_order", {N / merge}, 4, "(N / 4)", "int32"));
  }
  return buffers;
}

std::vector<BufferSpec> logits_buffers(const ModelConfig& config, int64_t max_seqs) {
  using detail::planning::buffer;
  uint64_t S = uint64_t(std::max<int64_t>(max_seqs, 0));
  uint64_t R = std::max<uint64_t>(S, uint64_t(detail::planning::kScoringRows));
  uint64_t V = uint64_t(config.text.vocab_size);
  return {
      buffer("logits", {R, V}, 4, "(max(S, 32), V)", "fp32"),
      buffer("sampling_probs", {S, V}, 4, "(S, V)", "fp32"),
      buffer("sampling_order", {S, V}, 4, "(S, V)", "int32"),  // the sampler's sort order scratch
      buffer("sampled_ids", {S}, 4, "(S)", "int32"),
      // the GPU sampler's inputs: temperature, top_k, top_p, min_p, the draw and the logits row of each sequence
      buffer("sampling_params", {S, uint64_t(kSamplingParamWords)}, 4, "(S, 6)", "32-bit"),
      buffer("target_ids", {R}, 4, "(max(S, 32))", "int32"),  // scoring: the next tokens whose log-probs are read
      buffer("row_logprobs", {R}, 4, "(max(S, 32))", "fp32"),
  };
}

// ---- the planner ------------------------------------------------------------------------------------------

namespace detail {
namespace planning {

Plan make(const ModelConfig& config, const WeightsSummary& weights, uint64_t tensor_count, const DeviceSpec& device_in,
          const PlanOptions& requested, const PlanInputs* draft) {
  // Every candidate layout the what-fits answers assemble (Plan::layouts_assembled): the searches' cost.
  int64_t assembled = 0;
  auto assemble_counted = [&assembled](const Inputs& inputs, const PlanOptions& options) {
    assembled++;
    return assemble(inputs, options);
  };
  check_config(config);
  check_options(config, device_in, requested, draft);
  DeviceSpec device = device_in;
  if (requested.wsl2) device.wsl2 = *requested.wsl2;
  Inputs in{config, weights, tensor_count, device, draft};
  ModelLimits limits = model_limits(config);

  PlanOptions o = requested;
  o.wsl2 = device.wsl2;
  if (o.max_seqs == 0) o.max_seqs = kDefaultMaxSeqs;
  if (!o.activation_dtype)
    o.activation_dtype = device.backend == BackendKind::cuda && config.text.dtype == DType::F16
                             ? DType::F16
                             : default_activation_dtype(device.backend);
  // The KV cache stores K and V as the activations hold them: a narrower cache would round what a wider
  // activation dtype kept (F32 activations on a GPU with a bf16 cache were 1e-2 off the CPU's logits, measured on
  // an H100), a wider one would spend bytes on bits the activations never had.
  if (o.kv_dtype == KVDType::auto_)
    o.kv_dtype = *o.activation_dtype == DType::F32 ? KVDType::f32
                 : *o.activation_dtype == DType::F16 ? KVDType::f16
                                                     : KVDType::bf16;

  std::string image_rule;
  if (!config.vision.present) {
    o.max_image_pixels = 0;
  } else if (requested.max_image_pixels > 0) {
    image_rule = "requested (--max-image-pixels)";
  } else {
    o.max_image_pixels = std::min(limits.processor_max_pixels, kDefaultImagePixels);
    image_rule = format("kvlite default: min(processor max %s%s, 1024 x 1024) = %s pixels; the processor's max would "
                        "reserve for %s image tokens; --max-image-pixels overrides",
                        format_count(uint64_t(limits.processor_max_pixels)).c_str(),
                        config.max_pixels > 0 ? "" : " (model default)",
                        format_count(uint64_t(o.max_image_pixels)).c_str(),
                        format_count(merge_windows(config.vision, limits.processor_max_pixels)).c_str());
  }

  // max_model_len: as requested, or min(model max, 32768) halved (down to 2048) until it fits.
  std::string rule;
  if (requested.max_model_len > 0) {
    o = with_max_model_len(o, requested, requested.max_model_len);
    rule = "requested";
  } else {
    int64_t start = std::min(limits.max_position, kDefaultMaxModelLen);
    int64_t length = start;
    o = with_max_model_len(o, requested, length);
    while (!assemble_counted(in, o).fits && length > kMinDefaultMaxModelLen) {
      length = std::max(length / 2, kMinDefaultMaxModelLen);
      o = with_max_model_len(o, requested, length);
    }
    rule = limits.max_position > kDefaultMaxModelLen
               ? format("default: model max %lld capped at %lld", (long long)limits.max_position, (long long)start)
               : format("default: model max %lld", (long long)start);
    if (length != start) rule += format(", halved to %lld to fit", (long long)length);
    if (!assemble_counted(in, o).fits) rule += length != start ? " (and still does not)" : " (does not fit)";
  }

  Plan plan = assemble_counted(in, o);
  plan.max_model_len_rule = rule;
  const BlockTraits& block = in.config.text.block;
  if (block.has_sliding_layers() && in.config.text.num_layers > 0 && plan.max_model_len > 0) {
    // KV per token splits evenly over the layers (every layer has the same KV heads and head_dim)
    int64_t sliding = 0;
    for (LayerKind kind : block.layer_kinds) sliding += kind == LayerKind::sliding;
    const int64_t layers = in.config.text.num_layers, length = plan.max_model_len;
    const uint64_t per_layer_token = in.config.kv_bytes_per_token(kv_dtype_bytes(plan.options.kv_dtype)) / uint64_t(layers);
    const uint64_t kept = per_layer_token * uint64_t(layers) * uint64_t(length);
    const uint64_t windowed = per_layer_token * (uint64_t(layers - sliding) * uint64_t(length) +
                                                 uint64_t(sliding) * uint64_t(std::min(block.sliding_window, length)));
    if (plan.kv_pages_windowed()) {
      const uint64_t held = plan.kv_pages_usable * plan.kv_page_bytes;
      plan.sliding_kv_note = format(
          "every layer slides over %lld tokens and keeps only its window: at most %s pages x %llu tokens (the windows "
          "of %lld sequences and one step of %lld tokens), so %lld sequences of %lld tokens take %s instead of %s "
          "with every token's KV kept (%.0f%%)",
          (long long)block.sliding_window, format_count(plan.kv_pages_usable).c_str(),
          (unsigned long long)plan.kv_page_tokens, (long long)plan.options.max_seqs,
          (long long)plan.options.max_batched_tokens, (long long)plan.options.max_seqs, (long long)length,
          format_bytes(held).c_str(), format_bytes(kept * uint64_t(plan.options.max_seqs)).c_str(),
          100.0 * double(held) / double(kept * uint64_t(plan.options.max_seqs)));
    } else if (plan.kv_window > 0) {
      // what the arena holds: the full layers' pages for max_seqs x max_model_len, the window pages for the rest
      const uint64_t full = plan.kv_pages_usable * plan.kv_page_bytes;
      plan.sliding_kv_note = format(
          "%lld of %lld layers slide over %lld tokens and keep only their windows: %s pages x %llu tokens for them "
          "(%s per token, the windows of %lld sequences and one step of %lld tokens), so %lld sequences of %lld "
          "tokens take %s instead of %s with every layer's KV kept (%.0f%%)",
          (long long)sliding, (long long)layers, (long long)block.sliding_window,
          format_count(plan.kv_window_pages).c_str(), (unsigned long long)plan.kv_page_tokens,
          format_bytes(plan.kv_window_bytes_per_token).c_str(), (long long)plan.options.max_seqs,
          (long long)plan.options.max_batched_tokens, (long long)plan.options.max_seqs, (long long)length,
          format_bytes(full + kv_window_bytes(plan)).c_str(), format_bytes(kept * uint64_t(plan.options.max_seqs)).c_str(),
          100.0 * double(full + kv_window_bytes(plan)) / double(kept * uint64_t(plan.options.max_seqs)));
    } else {
      plan.sliding_kv_note = format(
          "%lld of %lld layers slide over %lld tokens but keep their KV for the whole context (a draft model shares "
          "the pages): one %lld-token sequence takes %s, its windows alone would take %s (%.0f%%)",
          (long long)sliding, (long long)layers, (long long)block.sliding_window,
          (long long)length, format_bytes(kept).c_str(), format_bytes(windowed).c_str(),
          100.0 * double(windowed) / double(kept));
    }
  }
  plan.max_image_pixels_rule = image_rule;

  // What would fit, whatever the verdict (from the bytes left, not the pages taken: the CPU caps those).
  // (the sliding windows' pages come first: their count is fixed by the options)
  // (every layer sliding: a sequence of any length holds at most its window's pages, so once those fit, the
  // model's whole context does)
  const int64_t max_position = limits.max_position;
  auto tokens_that_fit = [max_position](const Plan& p) {
    const int64_t window = p.kv_window_pages > 0 ? int64_t(kv_window_bytes(p) + kPlanAlignment) : 0;
    const uint64_t pages = p.kv_available_bytes > window ? uint64_t(p.kv_available_bytes - window) / kv_page_bytes_all(p) : 0;
    if (p.kv_pages_windowed() && pages > 0 && pages >= sequence_kv_pages(p, max_position)) return max_position;
    return int64_t(pages * p.kv_page_tokens);
  };
  plan.max_model_len_that_fits = std::min<int64_t>(tokens_that_fit(plan), limits.max_position);
  uint64_t total_needed = plan.fixed_bytes + kv_bytes_for(plan, plan.max_model_len);
  plan.utilization_needed = utilization_for(total_needed, device.total_bytes);
  if (o.kv_dtype == KVDType::fp8) {
    plan.max_model_len_that_fits_fp8_kv = plan.max_model_len_that_fits;
  } else {
    PlanOptions fp8 = o;
    fp8.kv_dtype = KVDType::fp8;
    plan.max_model_len_that_fits_fp8_kv =
        std::min<int64_t>(tokens_that_fit(assemble_counted(in, fp8)), limits.max_position);
  }
  if (config.vision.present) {
    // The largest image budget (whole merge windows) at which max_model_len fits: binary search, since the
    // vision buffers only grow with the budget.
    uint64_t window = window_pixels(config.vision);
    uint64_t lo = uint64_t(smallest_image_pixels(config)) / window;
    uint64_t hi = uint64_t(limits.processor_max_pixels) / window;
    auto fits_with = [&](uint64_t windows) {
      PlanOptions trial = o;
      trial.max_image_pixels = int64_t(windows * window);
      return assemble_counted(in, trial).fits;
    };
    if (lo <= hi && fits_with(lo)) {
      while (lo < hi) {  // invariant: fits_with(lo)
        uint64_t mid = lo + (hi - lo + 1) / 2;
        if (fits_with(mid)) lo = mid; else hi = mid - 1;
      }
      plan.image_pixels_that_fit = int64_t(lo * window);
    }
  }
  if (draft && !plan.fits) {
    // The draft's distributions grow with K: the largest K at which max_model_len fits (binary search), and
    // whether dropping the draft model would make it fit.
    auto fits_with_k = [&](int64_t k) {
      PlanOptions trial = o;
      trial.speculative_tokens = k;
      return assemble_counted(in, trial).fits;
    };
    int64_t lo = 0, hi = o.speculative_tokens - 1;  // invariant: K = lo fits or lo == 0
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (fits_with_k(mid)) lo = mid; else hi = mid - 1;
    }
    plan.speculative_tokens_that_fit = lo > 0 && fits_with_k(lo) ? lo : 0;
    Inputs alone = in;
    alone.draft = nullptr;
    PlanOptions without = o;
    without.speculative_tokens = 0;
    plan.fits_without_draft = assemble_counted(alone, without).fits;
  }
  plan.layouts_assembled = assembled;
  write_advice(in, plan);
  return plan;
}

}  // namespace planning
}  // namespace detail

Result<Plan> make_plan(const ModelConfig& config, const WeightsSummary& weights, const DeviceSpec& device,
                       const PlanOptions& options) {
  return detail::guard([&] { return detail::planning::make(config, weights, 0, device, options, nullptr); });
}

Result<PlanInputs> read_plan_inputs(const std::string& model_dir) {
  return detail::guard([&]() -> PlanInputs {
    PlanInputs inputs;
    auto config = load_config(model_dir);
    if (!config) throw config.error();
    auto store = TensorStore::open_dir(model_dir);
    if (!store) throw store.error();
    auto weights = summarize_weights(*config, store->empty() ? nullptr : &*store);
    if (!weights) throw weights.error();
    inputs.config = std::move(*config);
    inputs.weights = std::move(*weights);
    inputs.tensor_count = store->tensors().size();
    return inputs;
  });
}

Result<Plan> make_plan(const PlanInputs& inputs, const DeviceSpec& device, const PlanOptions& options) {
  return detail::guard(
      [&] { return detail::planning::make(inputs.config, inputs.weights, inputs.tensor_count, device, options,
                                          inputs.draft.get()); });
}


// ---- presentation -----------------------------------------------------------------------------------------

uint64_t Plan::arena_bytes() const {
  uint64_t sum = kv_arena_bytes;
  for (const auto& item : items)
    if (item.in_arena) sum += item.bytes;
  return sum;
}

const PlanItem* Plan::item(const std::string& key) const {
  for (const auto& it : items)
    if (it.key == key) return &it;
  return nullptr;
}

std::string Plan::table() const {
  using namespace detail::planning;
  using detail::format;
  struct Row { std::string component, bytes, why; };
  std::vector<Row> rows;
  for (const auto& it : items) rows.push_back({it.label, format_bytes(it.bytes), it.why});
  rows.push_back({"fixed", format_bytes(fixed_bytes), "sum of the rows above: needed before any KV"});
  rows.push_back({"budget", format_bytes(budget_bytes),
                  format("budget = %s x %s = %s", format_ratio(options.utilization).c_str(),
                         format_bytes(device.total_bytes).c_str(), format_bytes(budget_bytes).c_str())});
  std::string kv_why = format("%s pages x %llu tokens = %s tokens, %s per token (%s)",
                              format_count(kv_pages).c_str(), (unsigned long long)kv_page_tokens,
                              format_count(kv_tokens).c_str(), format_bytes(kv_bytes_per_token).c_str(),
                              kv_dtype_name(options.kv_dtype));
  if (kv_available_bytes <= 0)
    kv_why = format("nothing left: budget - fixed = %s; %s per token (%s)",
                    format_bytes_signed(kv_available_bytes).c_str(), format_bytes(kv_bytes_per_token).c_str(),
                    kv_dtype_name(options.kv_dtype));
  if (draft_kv_page_bytes > 0)
    kv_why += format("; with the draft model's KV beside each page (%s per token)",
                     format_bytes(draft_kv_bytes_per_token).c_str());
  if (kv_available_bytes > 0) {
    if (options.kv_fill)
      kv_why += "; fills the budget (--kv-fill)";
    else if (kv_pages >= kv_pages_usable && kv_pages_windowed())
      kv_why += format("; what the windows of max_seqs %lld sequences can use (--kv-fill takes the whole budget)",
                       (long long)options.max_seqs);
    else if (kv_pages >= kv_pages_usable)
      kv_why += format("; what max_seqs %lld x max_model_len %lld can use (--kv-fill takes the whole budget)",
                       (long long)options.max_seqs, (long long)max_model_len);
    else
      kv_why += format("; all the budget allows (max_seqs %lld x max_model_len %lld could use %s pages)",
                       (long long)options.max_seqs, (long long)max_model_len, format_count(kv_pages_usable).c_str());
  }
  if (!sliding_kv_note.empty()) kv_why += "; " + sliding_kv_note;
  rows.push_back({"KV arena", format_bytes(kv_arena_bytes), kv_why});
  rows.push_back({"left free", format_bytes(free_bytes),
                  "budget - arena - outside the arena: left to the application and the rest of the system"});
  rows.push_back({"max_model_len", ll(max_model_len), max_model_len_rule});
  if (!max_image_pixels_rule.empty()) {
    rows.push_back({"max_image_pixels", ll(options.max_image_pixels), max_image_pixels_rule});
    rows.push_back({"image tokens", ll(image_tokens_per_image),
                    format("per image, at most: floor(%s pixels / %s per token (patch x merge)^2) = %s merged tokens "
                           "from %s patches; larger images are scaled down to fit; up to %lld image%s per request "
                           "(--max-images)",
                           format_count(uint64_t(options.max_image_pixels)).c_str(),
                           format_count(uint64_t(image_pixels_per_token)).c_str(),
                           format_count(uint64_t(image_tokens_per_image)).c_str(),
                           format_count(uint64_t(image_patches_per_image)).c_str(), (long long)options.max_images,
                           options.max_images == 1 ? "" : "s")});
    rows.push_back({"image budget", format_bytes(vision_activation_bytes + vision_weights_bytes),
                    format("what images cost: encoder activations %s (the vision row: %lld x %s patches) + vision "
                           "weights %s (in the weights row)",
                           format_bytes(vision_activation_bytes).c_str(), (long long)options.max_images,
                           format_count(uint64_t(image_patches_per_image)).c_str(),
                           format_bytes(vision_weights_bytes).c_str())});
  }
  if (options.speculative_tokens > 0 && !draft_model_name.empty()) {
    uint64_t draft_bytes = uint64_t(kv_pages) * draft_kv_page_bytes;
    for (const auto& it : items)
      if (it.key.rfind("draft_", 0) == 0) draft_bytes += it.bytes;
    rows.push_back({"speculative", format_bytes(draft_bytes),
                    format("draft model %s drafts up to %lld tokens per sequence per step, verified in the same "
                           "forward pass: its rows above and its KV in the KV arena (%s in all)",
                           draft_model_name.c_str(), (long long)options.speculative_tokens,
                           format_bytes(draft_bytes).c_str())});
  } else if (options.speculative_tokens > 0)
    rows.push_back({"speculative", format_bytes(0),
                    format("n-gram drafting (prompt lookup, n <= %lld), up to %lld tokens per sequence per step, "
                           "verified in the same forward pass: the K + 1 tokens are inside max_batched_tokens %lld "
                           "and their logits use the logits rows, so it needs no memory of its own",
                           (long long)options.ngram, (long long)options.speculative_tokens,
                           (long long)options.max_batched_tokens)});
  if (prefix_caching)
    rows.push_back({"prefix cache", *prefix_caching ? "on" : "off",
                    *prefix_caching
                        ? std::string("full KV pages stay cached under a hash of their tokens and later requests that "
                                      "start with them reuse them; pages only the cache holds count as free, evicted "
                                      "least recently used: no bytes of its own (hits: EngineStats)")
                        : device.backend == BackendKind::cuda
                              ? std::string("off (CUDA's default: a GEMM row may round differently with its batch; "
                                            "--prefix-cache on turns it on)")
                              : std::string("off (--prefix-cache off)")});
  rows.push_back({"concurrency", format("%.2f", concurrency),
                  format("sequences of %lld tokens the KV arena holds at once", (long long)max_model_len)});
  rows.push_back({"verdict", fits ? "FITS" : "DOES NOT FIT",
                  fits ? format("arena %s + outside the arena %s", format_bytes(arena_bytes()).c_str(),
                                format_bytes(fixed_bytes + kv_arena_bytes - arena_bytes()).c_str())
                       : format("short by %s", format_bytes(uint64_t(shortfall_bytes)).c_str())});

  size_t width0 = std::string("component").size(), width1 = std::string("bytes").size();
  for (const auto& r : rows) {
    width0 = std::max(width0, r.component.size());
    width1 = std::max(width1, r.bytes.size());
  }
  std::string out = format("model %s (%s) | device %s | WSL2 %s | backend %s%s\n", model_name.c_str(),
                           arch_name(arch), device.name.c_str(), device.wsl2 ? "yes" : "no", backend_name(device.backend),
                           backend_rule.empty() ? "" : (" (" + backend_rule + ")").c_str());
  auto line = [&](const std::string& a, const std::string& b, const std::string& c) {
    out += a + std::string(width0 - a.size() + 2, ' ') + std::string(width1 - b.size(), ' ') + b + "  " + c + "\n";
  };
  std::string rule(width0 + width1 + 4 + 40, '-');
  line("component", "bytes", "why");
  out += rule + "\n";
  for (size_t i = 0; i < rows.size(); i++) {
    if (i == items.size() || i == items.size() + 4) out += rule + "\n";
    line(rows[i].component, rows[i].bytes, rows[i].why);
  }
  if (!advice.empty()) {
    out += "advice:\n";
    for (const auto& a : advice) out += "  " + a + "\n";
  }
  return out;
}

std::string Plan::json() const {
  nlohmann::ordered_json j;
  j["model"] = model_name;
  j["arch"] = arch_name(arch);
  j["device"] = {{"name", device.name},        {"backend", backend_name(device.backend)},
                 {"total_bytes", device.total_bytes}, {"free_bytes", device.free_bytes},
                 {"sm", device.sm},             {"wsl2", device.wsl2},
                 {"queried", device.queried}, {"integrated", device.integrated},
                 {"shared_total_bytes", device.shared_total_bytes}};
  j["backend_rule"] = backend_rule;
  nlohmann::ordered_json opts;
  if (options.device_mem) opts["device_mem"] = *options.device_mem; else opts["device_mem"] = nullptr;
  opts["utilization"] = options.utilization;
  opts["max_model_len"] = options.max_model_len;
  opts["max_seqs"] = options.max_seqs;
  opts["max_batched_tokens"] = options.max_batched_tokens;
  opts["kv_dtype"] = kv_dtype_name(options.kv_dtype);
  opts["max_image_pixels"] = options.max_image_pixels;
  opts["max_images"] = options.max_images;
  opts["kv_page_tokens"] = options.kv_page_tokens;
  opts["kv_fill"] = options.kv_fill;
  opts["speculative_tokens"] = options.speculative_tokens;
  opts["ngram"] = options.ngram;
  opts["activation_dtype"] = dtype_name(options.activation_dtype.value_or(DType::F32));
  opts["wsl2"] = options.wsl2.value_or(device.wsl2);
  opts["host_embeddings"] = options.host_embeddings;
  j["options"] = opts;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const auto& it : items)
    list.push_back({{"key", it.key}, {"label", it.label}, {"bytes", it.bytes}, {"why", it.why}, {"in_arena", it.in_arena}});
  j["items"] = list;
  j["weights_bytes"] = weights_bytes;
  j["weights_source"] = weights_source;
  j["upload_chunk_bytes"] = upload_chunk_bytes;
  j["host_embedding_bytes"] = host_embedding_bytes;
  j["host_staging_bytes"] = host_staging_bytes;
  j["kv_dtype"] = kv_dtype_name(options.kv_dtype);
  j["kv_bytes_per_token"] = kv_bytes_per_token;
  j["kv_page_tokens"] = kv_page_tokens;
  j["kv_page_bytes"] = kv_page_bytes;
  if (kv_window > 0) {
    j["kv_window"] = kv_window;
    j["kv_window_bytes_per_token"] = kv_window_bytes_per_token;
    j["kv_window_page_bytes"] = kv_window_page_bytes;
    j["kv_window_pages"] = kv_window_pages;
  }
  if (!draft_model_name.empty()) {
    j["draft_model"] = draft_model_name;
    j["draft_kv_bytes_per_token"] = draft_kv_bytes_per_token;
    j["draft_kv_page_bytes"] = draft_kv_page_bytes;
    j["speculative_tokens_that_fit"] = speculative_tokens_that_fit;
    j["fits_without_draft"] = fits_without_draft;
  }
  j["budget_bytes"] = budget_bytes;
  j["fixed_bytes"] = fixed_bytes;
  j["kv_available_bytes"] = kv_available_bytes;
  j["kv_arena_bytes"] = kv_arena_bytes;
  j["kv_pages"] = kv_pages;
  j["kv_tokens"] = kv_tokens;
  j["kv_pages_usable"] = kv_pages_usable;
  j["free_bytes"] = free_bytes;
  j["arena_bytes"] = arena_bytes();
  j["max_model_len"] = max_model_len;
  j["max_model_len_rule"] = max_model_len_rule;
  j["max_image_pixels_rule"] = max_image_pixels_rule;
  j["concurrency"] = concurrency;
  j["fits"] = fits;
  if (prefix_caching) j["prefix_caching"] = *prefix_caching;
  j["shortfall_bytes"] = shortfall_bytes;
  j["max_model_len_that_fits"] = max_model_len_that_fits;
  j["utilization_needed"] = utilization_needed;
  j["max_model_len_that_fits_fp8_kv"] = max_model_len_that_fits_fp8_kv;
  j["image_pixels_that_fit"] = image_pixels_that_fit;
  if (max_image_pixels_rule.empty()) {
    j["image_budget"] = nullptr;
  } else {
    j["image_budget"] = {{"max_image_pixels", options.max_image_pixels},
                         {"max_images", options.max_images},
                         {"pixels_per_token", image_pixels_per_token},
                         {"patches_per_image", image_patches_per_image},
                         {"tokens_per_image", image_tokens_per_image},
                         {"encoder_activation_bytes", vision_activation_bytes},
                         {"vision_weights_bytes", vision_weights_bytes}};
  }
  j["advice"] = advice;
  return j.dump(2) + "\n";
}

namespace detail {
namespace planning {
std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}
const char* item_colour(const std::string& key) {
  if (key == "weights") return "#4e79a7";
  if (key == "repack") return "#76b7b2";
  if (key == "context") return "#9c9c9c";
  if (key == "activations") return "#f28e2b";
  if (key == "vision") return "#b07aa1";
  if (key == "logits") return "#edc948";
  if (key == "workspace") return "#ff9da7";
  if (key == "graphs") return "#9c755f";
  return "#bab0ac";
}
}  // namespace planning
}  // namespace detail

std::string Plan::svg() const {
  using namespace detail::planning;
  using detail::format;
  // Layout: one bar, left to right in table order, then KV. The scale covers the whole card, or more when the
  // plan overflows it, so the red overflow stays visible.
  const double left = 20, bar_width = 860, bar_y = 60, bar_height = 44, width = 900;
  uint64_t kv_shown = fits ? kv_arena_bytes : kv_bytes_for(*this, max_model_len);
  uint64_t extent = std::max<uint64_t>(device.total_bytes, fixed_bytes + kv_shown);
  auto x_of = [&](uint64_t bytes) { return left + bar_width * double(bytes) / double(extent); };
  size_t legend_rows = items.size() + 2;
  double height = bar_y + bar_height + 50 + 18.0 * double(legend_rows) + 20;

  std::string out = format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                           "font-family=\"sans-serif\" font-size=\"12\">\n", width, height, width, height);
  out += format("<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", width, height);
  out += format("<text x=\"%.0f\" y=\"22\" font-size=\"15\" font-weight=\"bold\">%s</text>\n", left,
                xml_escape(format("%s on %s: %s", model_name.c_str(), device.name.c_str(),
                                  fits ? "FITS" : "DOES NOT FIT")).c_str());
  out += format("<text x=\"%.0f\" y=\"40\">%s</text>\n", left,
                xml_escape(format("max_model_len %lld, KV %s (%s tokens), budget %s x %s = %s", (long long)max_model_len,
                                  format_bytes(kv_arena_bytes).c_str(), format_count(kv_tokens).c_str(),
                                  format_ratio(options.utilization).c_str(), format_bytes(device.total_bytes).c_str(),
                                  format_bytes(budget_bytes).c_str())).c_str());
  // The whole card, as an outline.
  out += format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"#f4f4f4\" stroke=\"#666\"/>\n", left,
                bar_y, x_of(device.total_bytes) - left, bar_height);
  uint64_t offset = 0;
  // Each segment: a rectangle with a tooltip, and its name written inside when there is room for it.
  auto segment = [&](uint64_t bytes, const char* colour, const std::string& name, const std::string& title) {
    if (bytes == 0) return;
    double x = x_of(offset), w = x_of(offset + bytes) - x;
    out += format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>%s</title></rect>\n",
                  x, bar_y, w, bar_height, colour, xml_escape(title).c_str());
    if (w >= 7.0 * double(name.size()) + 6)
      out += format("<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\" fill=\"white\">%s</text>\n", x + w / 2,
                    bar_y + bar_height / 2 + 4, xml_escape(name).c_str());
    offset += bytes;
  };
  for (const auto& it : items) segment(it.bytes, item_colour(it.key), it.key, it.label + ": " + format_bytes(it.bytes));
  if (fits) {
    segment(kv_arena_bytes, "#59a14f", "KV", "KV arena: " + format_bytes(kv_arena_bytes));
  } else {
    // KV one sequence needs, hatched in red past the budget.
    uint64_t start = offset;
    segment(kv_shown, "#8cd17d", "KV", format("KV for one %lld-token sequence: %s", (long long)max_model_len,
                                              format_bytes(kv_shown).c_str()));
    uint64_t overflow_from = std::max(start, budget_bytes);
    if (offset > overflow_from)
      out += format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"#e15759\" fill-opacity=\"0.85\">"
                    "<title>%s</title></rect>\n",
                    x_of(overflow_from), bar_y, x_of(offset) - x_of(overflow_from), bar_height,
                    xml_escape("over the budget by " + format_bytes(offset - overflow_from)).c_str());
  }
  double budget_x = x_of(budget_bytes);
  out += format("<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"black\" stroke-width=\"2\" "
                "stroke-dasharray=\"5,3\"/>\n", budget_x, bar_y - 8, budget_x, bar_y + bar_height + 8);
  out += format("<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"%s\">%s</text>\n", budget_x, bar_y + bar_height + 22,
                budget_x > width / 2 ? "end" : "start",
                xml_escape("budget " + format_bytes(budget_bytes)).c_str());
  // Legend.
  double y = bar_y + bar_height + 46;
  auto legend = [&](const char* colour, const std::string& text) {
    out += format("<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>", left, y - 10, colour);
    out += format("<text x=\"%.0f\" y=\"%.0f\">%s</text>\n", left + 18, y, xml_escape(text).c_str());
    y += 18;
  };
  for (const auto& it : items) legend(item_colour(it.key), it.label + "  " + format_bytes(it.bytes));
  if (fits)
    legend("#59a14f", "KV arena  " + format_bytes(kv_arena_bytes) + " (" + format_count(kv_tokens) + " tokens)");
  else
    legend("#8cd17d", format("KV for one %lld-token sequence  %s", (long long)max_model_len, format_bytes(kv_shown).c_str()));
  if (!fits) legend("#e15759", "over the budget: short by " + format_bytes(uint64_t(shortfall_bytes)));
  out += "</svg>\n";
  return out;
}

}  // namespace kvlite
