// ---------------------------------------------------------------------------------------------------------
// config: config.json (llama, mistral, qwen2, qwen3, qwen3_vl, qwen2_5_vl, gemma2, gemma3_text / gemma3, phi3), the
// family's block and vision traits, quantization_config, and one descriptor per Linear.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// ---- limits on what config.json may declare ------------------------------------------------------------
// A model directory may come from anywhere, so every size it declares is bounded when config.json is read,
// before anything is allocated or looped over: a value past its limit is refused with bad_format naming the
// key, the value and the limit. Each limit is far above every released model (the largest known in brackets)
// and small enough that every product the planner and the model form from them (e.g. layers x positions x
// kv heads x head_dim x 4 bytes, at most 2^10 x 2^24 x 2^10 x 2^10 x 2^2 = 2^56) stays below 2^63.
// To raise one, #define it before the #include of kvlite.hpp in the translation unit that defines
// KVLITE_IMPLEMENTATION.
#ifndef KVLITE_MAX_MODEL_LAYERS
#define KVLITE_MAX_MODEL_LAYERS 1024  // num_hidden_layers, vision depth [Llama-3.1-405B: 126]
#endif
#ifndef KVLITE_MAX_MODEL_WIDTH
#define KVLITE_MAX_MODEL_WIDTH 262144  // hidden_size, intermediate_size, out_hidden_size [405B: 16384 / 53248]
#endif
#ifndef KVLITE_MAX_MODEL_HEADS
#define KVLITE_MAX_MODEL_HEADS 1024  // attention heads, key/value heads [405B: 128]
#endif
#ifndef KVLITE_MAX_HEAD_DIM
#define KVLITE_MAX_HEAD_DIM 1024  // head_dim [Gemma-2: 256]
#endif
#ifndef KVLITE_MAX_VOCAB
#define KVLITE_MAX_VOCAB 4194304  // vocab_size, and every token id [Gemma-3: 262,208]
#endif
#ifndef KVLITE_MAX_POSITIONS
#define KVLITE_MAX_POSITIONS 16777216  // max_position_embeddings [Llama-4-Scout: 10,485,760]
#endif
#ifndef KVLITE_MAX_VISION_PATCH
#define KVLITE_MAX_VISION_PATCH 64  // patch_size, temporal_patch_size, spatial_merge_size, in_channels [16, 2, 2, 3]
#endif
#ifndef KVLITE_MAX_PROCESSOR_PIXELS
#define KVLITE_MAX_PROCESSOR_PIXELS 1073741824  // preprocessor min/max pixels (32768 x 32768) [Qwen3-VL: 16,777,216]
#endif
#ifndef KVLITE_MAX_VISION_POSITIONS
#define KVLITE_MAX_VISION_POSITIONS 1048576  // vision num_position_embeddings [Qwen3-VL: 2304]
#endif
#ifndef KVLITE_MAX_VISION_WINDOW
#define KVLITE_MAX_VISION_WINDOW 65536  // vision window_size in pixels [Qwen2.5-VL: 112]
#endif
// Image normalization (preprocessor_config.json image_mean / image_std / rescale_factor, PreprocessOptions): a
// pixel becomes (pixel x rescale_factor - mean) / std. Published processors use means in [0.4, 0.5], stds in
// [0.2, 0.5] and 1/255; values far outside are a broken file, and refused at load rather than turning every
// image's pixel values into infinities later. The mean may lie up to the margin outside [0, 1].
#ifndef KVLITE_IMAGE_MEAN_MARGIN
#define KVLITE_IMAGE_MEAN_MARGIN 1.0
#endif
#ifndef KVLITE_MIN_IMAGE_STD
#define KVLITE_MIN_IMAGE_STD 1e-3
#endif
#ifndef KVLITE_MAX_IMAGE_STD
#define KVLITE_MAX_IMAGE_STD 1e3
#endif
#ifndef KVLITE_MIN_RESCALE_FACTOR
#define KVLITE_MIN_RESCALE_FACTOR 1e-6  // [1/255 for 8-bit pixels]
#endif
#ifndef KVLITE_MAX_RESCALE_FACTOR
#define KVLITE_MAX_RESCALE_FACTOR 1.0
#endif
namespace limits {
constexpr double image_mean_margin = KVLITE_IMAGE_MEAN_MARGIN;
constexpr double min_image_std = KVLITE_MIN_IMAGE_STD;
constexpr double max_image_std = KVLITE_MAX_IMAGE_STD;
constexpr double min_rescale_factor = KVLITE_MIN_RESCALE_FACTOR;
constexpr double max_rescale_factor = KVLITE_MAX_RESCALE_FACTOR;
constexpr int64_t max_model_layers = KVLITE_MAX_MODEL_LAYERS;
constexpr int64_t max_model_width = KVLITE_MAX_MODEL_WIDTH;
constexpr int64_t max_model_heads = KVLITE_MAX_MODEL_HEADS;
constexpr int64_t max_head_dim = KVLITE_MAX_HEAD_DIM;
constexpr int64_t max_vocab = KVLITE_MAX_VOCAB;
constexpr int64_t max_positions = KVLITE_MAX_POSITIONS;
constexpr int64_t max_vision_patch = KVLITE_MAX_VISION_PATCH;
constexpr int64_t max_vision_positions = KVLITE_MAX_VISION_POSITIONS;
constexpr int64_t max_vision_window = KVLITE_MAX_VISION_WINDOW;
constexpr int64_t max_processor_pixels = KVLITE_MAX_PROCESSOR_PIXELS;
}  // namespace limits

enum class Arch { llama, qwen2, qwen3, qwen3_vl, qwen2_5_vl, mistral, gemma2, gemma3, phi3 };
const char* arch_name(Arch arch);

// Rotary embedding parameters, from either key layout: classic (`rope_theta` + `rope_scaling`) or the one
// newer transformers write (`rope_parameters` = {rope_type, rope_theta, ...}). Each field is the value
// transformers' ROPE_INIT_FUNCTIONS read (modeling_rope_utils.py), defaults included; src/rope.hpp turns them
// into inverse frequencies, attention factors and cos/sin tables.
struct RopeConfig {
  // "default" | "linear" | "dynamic" | "yarn" | "longrope" | "llama3" (others are refused, naming the key)
  std::string type = "default";
  double theta = 10000.0;
  // rotary_dim = int(head_dim * partial_rotary_factor): the first rotary_dim dims of each head are rotated
  double partial_rotary_factor = 1.0;
  // the model's max_position_embeddings: dynamic's base length, and yarn's / longrope's factor when absent
  int64_t max_position_embeddings = 0;
  // linear, dynamic, yarn, llama3; longrope's (for its attention factor only) when given. 0 = absent (yarn,
  // longrope: max_position_embeddings / original_max_position_embeddings, as transformers derives it).
  double factor = 1.0;
  // llama3 scaling
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3, yarn, longrope: the pretraining length (top-level key first, as transformers' standardize does;
  // else the rope parameters' key; else max_position_embeddings)
  int64_t original_max_position_embeddings = 0;
  // yarn, longrope: multiplies cos and sin (so q.k by its square). 0 = absent: derived from factor (yarn:
  // mscale / mscale_all_dim when both are non-zero; longrope: sqrt(1 + ln(factor) / ln(original))).
  double attention_factor = 0.0;
  // yarn: 0 = absent (32 and 1), as transformers' `beta_fast or 32`
  double beta_fast = 0.0;
  double beta_slow = 0.0;
  double mscale = 0.0;          // yarn: 0 = absent
  double mscale_all_dim = 0.0;  // yarn: 0 = absent
  bool truncate = true;         // yarn: floor/ceil the correction range
  // longrope: per-frequency divisors [rotary_dim / 2]; long_factor when the sequence is longer than
  // original_max_position_embeddings, short_factor otherwise
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  // Multimodal RoPE (Qwen2.5-VL, Qwen3-VL): sections of the rotary half (t, h, w), e.g. [24, 20, 20], and how
  // they are laid over the frequencies - a family fact (the modeling file's code, not a config key):
  //   sectioned   (Qwen2-VL, Qwen2.5-VL: apply_multimodal_rotary_pos_emb / recomposition_frequencies): the
  //               first section[0] frequencies take row t, the next section[1] row h, the last section[2] row w
  //   interleaved (Qwen3-VL: apply_interleaved_mrope): h at 1, 4, 7, ... below 3 section[1], w at 2, 5, 8, ...
  //               below 3 section[2], t elsewhere
  std::vector<int> mrope_section;
  bool mrope_interleaved = false;  // the file's key, as written (Qwen3-VL interleaves whatever it says)
  enum class MropeLayout { sectioned, interleaved };
  MropeLayout mrope_layout = MropeLayout::interleaved;
};

// ---- block traits: how a family's decoder block differs from Llama's ----------------------------------------
// One forward pass (model.inl) serves every family; what differs is data read from config.json here, never a
// model_type test in the ops. The facts come from transformers' modeling_{llama,mistral,qwen2,gemma2,gemma3,
// phi3}.py (and llama.cpp's llm_build_* of the same families):
//
//                 norm       act        embed x   sandwich  attn cap  final cap  scaling            layers
//   llama/qwen    x w        silu       -         -         -         -          head_dim^-1/2      full
//   mistral       x w        silu       -         -         -         -          head_dim^-1/2      all sliding if sliding_window
//   qwen2         x w        silu       -         -         -         -          head_dim^-1/2      sliding from max_window_layers on, if use_sliding_window
//   phi3          x w        silu       -         -         -         -          head_dim^-1/2      all sliding if sliding_window; qkv_proj, gate_up_proj fused on disk
//   gemma2        x (1 + w)  gelu tanh  sqrt(H)   yes       50        30         query_pre_attn^-1/2  sliding, full, sliding, ...
//   gemma3_text   x (1 + w)  gelu tanh  sqrt(H)   yes       -         -          query_pre_attn^-1/2  5 sliding : 1 full; q/k norm; local RoPE base
enum class NormForm { weight, one_plus_weight };  // RMSNorm output x * w (Llama) or x * (1 + w) (Gemma)
enum class MlpActivation { silu, gelu_tanh, gelu };  // act_fn in down_proj(act_fn(gate_proj(x)) * up_proj(x))
enum class LayerKind { full, sliding };           // layer_types "full_attention" / "sliding_attention"
struct BlockTraits {
  NormForm norm_form = NormForm::weight;
  MlpActivation activation = MlpActivation::silu;
  bool embedding_scaled = false;  // inputs_embeds * sqrt(hidden_size), the factor in the embedding's dtype (Gemma)
  // Gemma's sandwich: post_attention_layernorm normalises the attention output before the residual add, and
  // pre_feedforward_layernorm / post_feedforward_layernorm wrap the MLP (Llama's post_attention_layernorm is the
  // pre-MLP norm).
  bool sandwich_norms = false;
  double attn_logit_softcap = 0;     // > 0: scores = cap * tanh(scores / cap) before the mask (Gemma-2)
  double final_logit_softcap = 0;    // > 0: logits = cap * tanh(logits / cap) (Gemma-2)
  double query_pre_attn_scalar = 0;  // > 0: attention scaling = query_pre_attn_scalar^-1/2, else head_dim^-1/2
  bool fused_projections = false;    // self_attn.qkv_proj and mlp.gate_up_proj stored fused (Phi-3)
  std::vector<LayerKind> layer_kinds;  // [num_layers]
  int64_t sliding_window = 0;  // W: a sliding layer's query sees the W most recent tokens, itself included
  double local_rope_theta = 0;  // > 0: the sliding layers' own RoPE base (Gemma-3 rope_local_base_freq)
  // max_position_embeddings already counts what the RoPE scaling reaches (Gemma-3: 131072 = its 16K pretraining
  // x the global layers' linear 8), so the planner does not multiply it by the factor again (vLLM's rule skips
  // gemma3 for the same reason)
  bool max_positions_scaled = false;

  bool has_sliding_layers() const {
    for (LayerKind kind : layer_kinds)
      if (kind == LayerKind::sliding) return true;
    return false;
  }
  // The attention window of layer l: W for a sliding layer, 0 (everything) for a full one.
  int64_t window_of(int64_t layer) const {
    return size_t(layer) < layer_kinds.size() && layer_kinds[size_t(layer)] == LayerKind::sliding ? sliding_window : 0;
  }
};

struct TextConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // explicit `head_dim` if given, else hidden_size / num_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (qwen2: always true)
  bool o_proj_bias = false;     // o_proj bias (llama, qwen3: = attention_bias; qwen2: never)
  bool mlp_bias = false;        // gate/up/down biases (llama `mlp_bias`)
  bool qk_norm = false;         // per-head RMSNorm of q and k before RoPE (qwen3, qwen3_vl)
  std::string hidden_act = "silu";
  DType dtype = DType::BF16;  // torch_dtype / dtype of the unquantized weights
  RopeConfig rope;
  BlockTraits block;  // the family's differences from Llama's block
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;
};

// ---- vision traits: how a family's vision tower differs ------------------------------------------------------
// One tower (vision.inl) serves both Qwen vision families; what differs is data set here from model_type, as
// BlockTraits does for the text blocks. The facts come from transformers' modeling_qwen3_vl.py and
// modeling_qwen2_5_vl.py:
//
//               weights        norms      block MLP                     patch bias  positions             attention                          merger
//   qwen3_vl    model.visual.  LayerNorm  fc1 -> GELU (tanh) -> fc2     yes         learned table (bilinear) + 2-D RoPE  per image      norm, linear_fc1, linear_fc2; DeepStack
//   qwen2_5_vl  visual.        RMSNorm    down(silu(gate) * up), biases no          2-D RoPE               windows of window_size pixels,   ln_q, mlp.0, mlp.2
//                                                                                                          per image in fullatt_block_indexes
// Both: patch 14/16 x temporal 2 as a Linear, rope over head_dim / 2 split into row | column frequencies,
// a 2 x 2 merger with GELU (erf), out_hidden_size = the language model's hidden size.
enum class VisionNorm { layer_norm, rms_norm };
enum class VisionMlp { gelu, swiglu };  // fc2(act(fc1 x)) | down(act(gate x) * up x)
struct VisionTraits {
  std::string prefix = "model.visual.";  // the tower's weight names
  VisionNorm norm = VisionNorm::layer_norm;
  VisionMlp mlp = VisionMlp::gelu;
  bool patch_embed_bias = true;
  bool learned_positions = true;  // a learned side x side position table, resampled bilinearly per grid
  // Window attention (Qwen2.5-VL): blocks not in fullatt_block_indexes attend within windows of window_size x
  // window_size pixels (window_size / (patch x merge) merge windows a side); 0 = every block attends per image.
  int64_t window_size = 0;
  std::vector<int64_t> fullatt_block_indexes;
  // The processor's class defaults when preprocessor_config.json says nothing (Qwen2VLImageProcessor: 56 x 56
  // and 28 x 28 x 1280 pixels, OpenAI CLIP's mean / std; Qwen3-VL's own published values otherwise).
  int64_t default_min_pixels = 65536, default_max_pixels = 16777216;

  bool full_attention(int64_t block) const {
    if (window_size <= 0) return true;
    for (int64_t b : fullatt_block_indexes)
      if (b == block) return true;
    return false;
  }
};

struct VisionConfig {
  bool present = false;
  VisionTraits traits;  // the family's differences (above)
  int64_t depth = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_heads = 0;
  int64_t in_channels = 3;
  int64_t patch_size = 16;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t out_hidden_size = 0;
  int64_t num_position_embeddings = 0;
  std::vector<int64_t> deepstack_visual_indexes;
  std::string hidden_act = "gelu_pytorch_tanh";
  double rope_theta = 10000.0;  // the 2-D RoPE's base (rope_parameters.rope_theta)
};

// How a group of Linears is quantized (compressed-tensors `config_groups.*.weights`, Qwen's fp8, or the one
// scheme of an AWQ / GPTQ config).
enum class QuantMethod { none, compressed_tensors, fp8, awq, gptq };
// How an int4 / int8 Linear's tensors are packed on disk (src/quant_formats.hpp describes each); all but
// compressed-tensors' int4 and int-quantized are repacked once at load into the view quant.hpp describes.
enum class IntPacking : uint8_t {
  compressed_tensors,  // weight_packed [N, K/8] (8-bit: [N, K/4]), weight_scale [N, G], weight_zero_point, g_idx
  compressed_tensors_unpacked,  // compressed-tensors "int-quantized": weight I8 [N, K], weight_scale, zero point I8
  awq,                 // AutoAWQ GEMM: qweight [K, N/8] interleaved, qzeros [G, N/8], scales [G, N]
  gptq,                // GPTQ v1: qweight [K/8, N], qzeros [G, N/8] holding zero - 1, scales [G, N], g_idx [K]
  gptq_v2,             // GPTQ v2 (checkpoint_format gptq_v2): as v1 with qzeros holding the zero itself
};
const char* int_packing_name(IntPacking packing);
enum class WeightFormat { dense, fp8, int4, int8 };
enum class ScaleGranularity { none, tensor, channel, group, block };
const char* weight_format_name(WeightFormat format);
const char* scale_granularity_name(ScaleGranularity granularity);

struct QuantScheme {
  std::vector<std::string> targets;  // "Linear", exact module names, or "re:<regex>"
  WeightFormat format = WeightFormat::dense;
  int num_bits = 16;
  bool symmetric = true;
  ScaleGranularity granularity = ScaleGranularity::none;
  int64_t group_size = 0;               // group strategy
  int64_t block_n = 0, block_k = 0;     // block strategy (e.g. 128 x 128)
  bool actorder = false;                // g_idx present (actorder "group"/"dynamic")
  bool dynamic_activations = false;     // activations quantized per token at run time
  IntPacking packing = IntPacking::compressed_tensors;  // int4 / int8: the on-disk packing (AWQ, GPTQ, ...)
};

struct QuantConfig {
  QuantMethod method = QuantMethod::none;
  std::string format;                   // "pack-quantized", "float-quantized", "naive-quantized", "fp8", ...
  std::vector<QuantScheme> schemes;     // compressed-tensors config_groups, in order; fp8: one block scheme
  std::vector<std::string> ignore;      // compressed-tensors `ignore`: exact names or "re:<regex>"
  std::vector<std::string> modules_to_not_convert;  // Qwen fp8: a module stays dense if a listed key is a substring
  // GPTQModel's `dynamic` (AWQ / GPTQ): per-module rules in the config's order; the first whose regex matches the
  // module name from its start (Python re.match, as GPTQModel and vLLM match) decides. scheme < 0: "-:" (left
  // dense); otherwise the index in `schemes` of the base scheme with that rule's fields overridden ("+:" or no
  // prefix). Those schemes have no targets: only their rule selects them.
  struct Rule {
    std::string pattern;
    int scheme = -1;
  };
  std::vector<Rule> rules;
  // compressed-tensors kv_cache_scheme (8-bit float, per tensor, static): the checkpoint carries each layer's
  // self_attn.k_scale and v_scale, which an fp8 KV cache (--kv-dtype fp8) uses as vLLM does.
  bool kv_cache_fp8 = false;
};

struct ModelConfig {
  std::string model_type;  // as written in config.json
  Arch arch = Arch::llama;
  TextConfig text;
  VisionConfig vision;
  QuantConfig quant;
  // qwen3_vl / qwen2_5_vl special tokens (transformers' defaults when absent); -1 for text-only models.
  int64_t image_token_id = -1, video_token_id = -1, vision_start_token_id = -1, vision_end_token_id = -1;
  // Image budget from preprocessor_config.json (min/max pixel counts), when the directory has one.
  int64_t min_pixels = 0, max_pixels = 0;
  // Normalization from preprocessor_config.json (Qwen's published values when absent): pixel x rescale_factor,
  // then (x - mean) / std per channel.
  double image_mean[3] = {0.5, 0.5, 0.5}, image_std[3] = {0.5, 0.5, 0.5};
  double rescale_factor = 1.0 / 255.0;
  std::string origin;  // the config.json path, for messages
  // Parameters on disk that kvlite does not run (Gemma-3's SigLIP vision tower and projector): counted in the
  // weights estimate from config.json, never bound.
  uint64_t unrun_params = 0;

  // Weight-name prefix of the language model: "model." or, for qwen3_vl, "model.language_model.".
  std::string text_prefix() const;
  // Three rows of positions (t, h, w) per token: the Qwen VL families' M-RoPE.
  bool uses_mrope() const { return arch == Arch::qwen3_vl || arch == Arch::qwen2_5_vl; }
  // KV bytes per token over all layers: 2 x layers x kv_heads x head_dim x element bytes.
  uint64_t kv_bytes_per_token(int kv_element_bytes) const;
};

// Parses a config.json text. `origin` names it in errors. Refuses unknown model types, missing or
// non-positive sizes, unknown rope or quantization methods, with the key named.
Result<ModelConfig> parse_config(const std::string& json_text, const std::string& origin);
// Reads a preprocessor_config.json text (`origin` names it in errors) into `config`'s image budget and
// normalization, every key range-checked (the file and key named): what load_config does with the file.
Result<ModelConfig> apply_processor_config(ModelConfig config, const std::string& json_text, const std::string& origin);
namespace detail {
// Why a normalization value is out of its range ("is 1e+308: it must be in [-1, 2] (KVLITE_IMAGE_MEAN_MARGIN)"),
// or "" when it is in range. `key`: "image_mean", "image_std" or "rescale_factor".
std::string normalization_problem(const std::string& key, double value);
}  // namespace detail
// Reads MODEL_DIR/config.json, and preprocessor_config.json if present: `size` {shortest_edge, longest_edge}
// are the min/max PIXEL COUNTS; top-level min_pixels / max_pixels (older files) override them.
Result<ModelConfig> load_config(const std::string& model_dir);

// One Linear layer as it is on disk.
struct LinearDesc {
  std::string name;  // module name, e.g. "model.layers.0.self_attn.q_proj"
  int64_t out_features = 0, in_features = 0;  // N, K
  WeightFormat format = WeightFormat::dense;
  DType weight_dtype = DType::BF16;  // BF16/F16/F32 (dense), F8_E4M3 (fp8), I32 (int4 packed)
  ScaleGranularity granularity = ScaleGranularity::none;
  DType scale_dtype = DType::BF16;
  std::string scale_name;             // "weight_scale" or "weight_scale_inv"
  int64_t group_size = 0;             // int4 group (K for channel)
  int64_t block_n = 0, block_k = 0;   // fp8 block
  IntPacking packing = IntPacking::compressed_tensors;  // int4 / int8: how the tensors are packed on disk
  bool int8_activations = false;      // int8 W8A8: activations quantized to int8 per token at run time
  bool symmetric = true;
  bool has_g_idx = false;
  bool has_bias = false;
  bool vision = false;   // part of the vision tower
  uint64_t bytes = 0;    // bytes of all its tensors on disk (weight, scales, zeros, g_idx, shape, input_scale, bias)
  bool exact = false;    // true: from the safetensors headers; false: estimated from config.json
};

class TensorStore;
// Every Linear of the model with its format and bytes. With a non-empty store the format is decided per
// tensor from the headers and the config together (exact bytes; bad shapes are errors naming the tensor);
// with an empty store (or nullptr) everything is estimated from config.json.
Result<std::vector<LinearDesc>> describe_linears(const ModelConfig& config, const TensorStore* store);

// Is this module excluded from quantization by `ignore` / `modules_to_not_convert`? compressed-tensors `ignore`:
// an entry equal to the name, the class name "Linear", or "re:<regex>" matching at the start of the name
// (Python re.match). Qwen fp8 `modules_to_not_convert`: an entry that is a substring of the name
// (transformers 4.x) or, when it has regex syntax, a regex matching at the start (transformers 5).
bool quant_ignores(const QuantConfig& quant, const std::string& module_name);

// What the weights weigh, for the planner.
struct WeightsSummary {
  uint64_t total_bytes = 0;     // everything the model reads
  uint64_t text_bytes = 0;      // language model, embeddings and lm_head
  uint64_t vision_bytes = 0;    // vision tower and mergers
  uint64_t embedding_bytes = 0; // input embedding table (+ lm_head when untied)
  uint64_t embed_table_bytes = 0;  // the input embedding table alone (embed_tokens), as stored
  bool exact = false;           // "headers" when true, "config" when estimated
  std::vector<LinearDesc> linears;
};
Result<WeightsSummary> summarize_weights(const ModelConfig& config, const TensorStore* store);

namespace detail {
// The same decisions over any source of tensor headers, so they can be tested with in-memory lists.
// `lookup` returns the header of a tensor or nullptr; `data` returns a pointer to its bytes, or nullptr when
// only headers are at hand (may be empty). These throw kvlite::Error (the public calls above guard them).
using TensorLookup = std::function<const TensorInfo*(const std::string& name)>;
using TensorData = std::function<const uint8_t*(const TensorInfo& tensor)>;
std::vector<LinearDesc> describe_linears_from(const ModelConfig& config, const TensorLookup& lookup,
                                              const TensorData& data);
std::vector<LinearDesc> estimate_linears(const ModelConfig& config);
WeightsSummary summarize_weights_from(const ModelConfig& config, const std::vector<TensorInfo>& tensors,
                                      const TensorData& data);
WeightsSummary estimate_weights(const ModelConfig& config);
// The scheme that quantizes this Linear per config.json (nullptr: it stays dense). compressed-tensors order:
// an exact name target wins over a "re:" target, which wins over the class target "Linear".
const QuantScheme* quant_scheme_for(const QuantConfig& quant, const std::string& module_name);
}  // namespace detail

}  // namespace kvlite
