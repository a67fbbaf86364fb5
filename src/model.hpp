// ---------------------------------------------------------------------------------------------------------
// model: the decoder-only text transformer of Llama-3, Mistral, Qwen2, Qwen3, Qwen3-VL's language model,
// Gemma-2, Gemma-3 (text) and Phi-3, written once against Backend; the families differ only by the data of
// TextConfig::block (BlockTraits, config.hpp).
//
//   token ids ─► embed_tokens (x sqrt(H): gemma) ─► [ RMSNorm ─► q,k,v (+bias) ─► q/k RMSNorm (qwen3, gemma3)
//       ─► RoPE (the layer kind's base) ─► paged KV ─► causal attention (sliding window, soft-cap: per layer kind)
//       ─► o_proj (─► RMSNorm: gemma) ─► + ─► RMSNorm ─► SwiGLU / GeGLU MLP (─► RMSNorm: gemma) ─► + ] x L
//   ─► final RMSNorm ─► rows whose logits are wanted ─► lm_head (─► soft-cap: gemma2) ─► logits
//
// Gemma's RMSNorm is x * (1 + w): the binder stores 1 + w (in fp32, as Gemma computes it), so every norm
// runs the one rms_norm op.
//
// Qwen3-VL (vision.hpp computes the image features): image tokens' embeddings are replaced by the vision
// tower's merged embeddings, its DeepStack features are added to their hidden states after decoder layers
// 0, 1, 2, ..., and RoPE is interleaved M-RoPE over three position rows (t, h, w).
//
// The engine (engine.hpp) owns the scheduling: it packs the tokens of one step (chunked prefill and decode of
// several sequences mixed) into a StepInput; TextModel runs them and then produces logits for the requested
// rows, a chunk of rows at a time. Every buffer is a view carved from the arena's "activations" and "logits"
// regions by the names the planner lists (activation_buffers, logits_buffers): plan and engine agree by
// construction, and nothing is allocated per step.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// One decoder layer (LlamaDecoderLayer / Qwen2DecoderLayer / Qwen3DecoderLayer), every view in its on-disk
// dtype. Shapes: H hidden, Hq/Hkv heads, D head_dim, I intermediate.
struct DecoderLayerWeights {
  Tensor input_layernorm;                 // [H]  (Gemma: 1 + w, F32, here and in every norm below)
  // q_proj | k_proj | v_proj ([Hq D, H], [Hkv D, H], [Hkv D, H]; biases for qwen2) into the qkv buffer: three
  // parts as bound, one where the CUDA uploader fused them, or Phi-3's stored qkv_proj)
  LinearGroup qkv_proj;
  Tensor q_norm, k_norm;                  // [D] each (qwen3); empty otherwise
  LinearWeights o_proj;                   // [H, Hq D]
  Tensor attention_output_norm;           // [H] Gemma's post_attention_layernorm (of o_proj's output); empty otherwise
  // [H] the norm before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
  Tensor post_attention_layernorm;
  LinearGroup gate_up_proj;               // gate_proj | up_proj, [I, H] each, into the gate_up buffer (as qkv_proj;
                                          // Phi-3's stored gate_up_proj [2 I, H])
  LinearWeights down_proj;                // [H, I]
  Tensor mlp_output_norm;                 // [H] Gemma's post_feedforward_layernorm; empty otherwise
};

struct TextModelWeights {
  Tensor embed_tokens;                     // [V, H]
  // The table is host memory (PlanOptions::host_embeddings: the checkpoint's mmap, also on a GPU): stage() looks
  // the step's rows up with Backend::gather_host_rows into the "hidden" buffer, and compute() starts from them.
  bool embed_tokens_on_host = false;
  std::vector<DecoderLayerWeights> layers;  // [L]
  Tensor norm;                             // [H]
  LinearWeights lm_head;                   // [V, H], no bias; the embed_tokens view when tie_word_embeddings
  // An fp8 KV cache's per-layer scales (compressed-tensors kv_cache_scheme: self_attn.k_scale / v_scale, one
  // number per layer), as floats; empty when the checkpoint declares none (an fp8 cache then uses 1.0).
  std::vector<float> k_scales, v_scales;
  // Host memory behind norm views the binder computed rather than mapped (Gemma's 1 + w in F32).
  std::vector<std::shared_ptr<const std::vector<float>>> computed;
};

// Binds every weight of the text model by its transformers name as a view into the store's mmap (BF16, F16
// or F32, used as stored; a quantized Linear, int4 or fp8 per describe_linears, as its QuantWeight view). All
// absent tensors are reported at once (missing_tensor, listing the names); a tensor of the wrong shape or dtype
// is bad_format naming it, its shape and the expected one. For Qwen3-VL this is the language model (model.language_model.*; the vision tower is bind_vision_weights').
Result<TextModelWeights> bind_text_weights(const ModelConfig& config, const TensorStore& store);

// Image tokens of a step whose rows come from the vision tower rather than the embedding table: step rows
// [token, token + count), the run's rows of the image's host features. Level 0 (the merger's output) replaces
// the rows' token embeddings; level 1 + j (DeepStack) is added to them after decoder layer j.
struct ImageRun {
  int64_t token = 0;            // first row of the run in the step
  int64_t count = 0;
  const float* rows = nullptr;  // [count, H] level 0; level l starts l * level_stride floats later
  int64_t level_stride = 0;
};

// The tokens of one forward step, in host memory, as the engine packed them. Tokens are grouped by sequence
// and sequences follow the order of the attention batch: sequence s is KV-pool slot s, so the pool's block
// tables serve as the batch's (the CPU reads them in place, a GPU gets a copy); a slot with no tokens this step
// has 0 queries and 0 context.
struct StepInput {
  int64_t tokens = 0;                     // T, 1 <= T <= max_batched_tokens
  const int32_t* token_ids = nullptr;     // [T]
  const int32_t* positions = nullptr;     // [position_rows, T] position of each token (0-based)
  int64_t position_rows = 1;              // 1, or 3 for M-RoPE (qwen3_vl: rows t, h, w)
  const int32_t* slots = nullptr;         // [T] KV slot: page * page_tokens + position % page_tokens
  int64_t seqs = 0;                       // S, the attention batch's sequences (pool slots 0 .. S-1)
  const int32_t* query_starts = nullptr;  // [S + 1] first token of each sequence in this step; last = T
  const int32_t* context_lens = nullptr;  // [S] tokens cached for each sequence, this step's included
  int64_t max_context = 0;                // max over context_lens
  Tensor block_tables;                    // I32 [>= S, max_pages_per_seq]: the pool's tables (host memory)
  // Sliding windows in memory (Arena::kv_window): the sliding layers' slots and block tables in their own pages.
  const int32_t* window_slots = nullptr;  // [T]
  Tensor window_block_tables;             // I32 [>= S, max_pages_per_seq] (host memory)
  int64_t logit_rows = 0;                 // R, rows of this step whose logits will be asked for
  const int32_t* logit_row_ids = nullptr;  // [R] token indices in [0, T)
  int64_t image_runs = 0;                  // qwen3_vl: runs of image tokens in this step
  const ImageRun* image_run_list = nullptr;  // [image_runs]
};

// The arena regions a TextModel carves its buffers from and keeps its KV in: the model's own, or a draft
// model's (speculative decoding), which shares the KV pages' ids and block tables with its target and keeps its
// own K/V for them in "draft_kv".
struct TextModelRegions {
  std::string activations = "activations";
  std::string logits = "logits";
  std::string kv = "kv";
  // The sliding layers' own pages (Plan::kv_window), used when the arena has them; a draft model keeps every
  // layer in its "draft_kv" pages (the plan never frees windows beside a draft model).
  std::string kv_window = "kv_window";
  static TextModelRegions draft() { return {"draft_activations", "draft_logits", "draft_kv", ""}; }
};

// The forward pass over a Backend, with its buffers carved from the arena. Not thread-safe (one step at a
// time, like the backend).
class TextModel {
 public:
  // Carves the buffers of plan's activation_buffers() and logits_buffers() from the arena regions
  // "activations" and "logits" (internal error if the arena's regions do not hold exactly those), and
  // prepares the RoPE frequencies. kv_dtype is the element type of the arena's KV pages.
  TextModel(const ModelConfig& config, TextModelWeights weights, Backend& backend, Arena& arena, const Plan& plan,
            DType kv_dtype, const TextModelRegions& regions = {});

  // Runs every layer over the step's tokens, writing their K/V into the cache, and keeps the final hidden
  // states for logits(): stage() then compute(). Throws kvlite::Error (the engine guards it).
  void forward(const StepInput& step);
  // The step's inputs into their buffers (the backend's memory): token ids, KV slots, RoPE tables of the
  // positions, the attention batch (query starts, context lengths, block tables) and the logit rows.
  void stage(const StepInput& step);
  // The layers over the staged step: only backend ops on buffers fixed at construction, with no host copy when
  // the step has no image runs, so a GPU can capture it as a CUDA graph and replay it after each stage() of a
  // step of the same shape (tokens, seqs; max_context at most the captured one).
  void compute(const StepInput& step);
  // Logits of the rows step.logit_row_ids[first, first + count), count <= max_logit_rows(), into the logits
  // buffer: [count, V] in the activation dtype (on the CPU host memory the caller reads directly, widening
  // 16-bit values; a GPU's stays on the device).
  Tensor logits(int64_t first, int64_t count);
  int64_t max_logit_rows() const { return max_logit_rows_; }

  // Host scratch for the CPU sampler, one row of V per sequence slot (the plan's sampling buffers); only on a
  // backend whose memory is the host's.
  float* sampling_probs(int64_t seq);   // [V]
  int32_t* sampling_order(int64_t seq);  // [V]
  // The same buffers as views, for a sampler that runs where the logits are (cuda::sample).
  struct SamplingBuffers {
    Tensor probs;   // "sampling_probs"  [Smax, V] F32 scratch
    Tensor params;  // "sampling_params" [Smax, kSamplingParamWords] I32
    Tensor ids;     // "sampled_ids"     [Smax] I32
  };
  SamplingBuffers sampling_buffers() const { return {sampling_probs_, sampling_params_, sampled_ids_}; }

 private:
  // The pages of layer l's K/V (the sliding layers' own when they have them) and its index among their layers.
  KVCacheView kv_cache(bool window = false) const;
  Tensor stage_block_tables(const Tensor& host, int64_t seqs, const Tensor& device);
  // count x cols float host rows as the activations store them: the rows themselves (F32), or rounded to
  // 16 bits in image_rows_16bit_ (valid until the next call).
  const void* host_activation_rows(const float* rows, int64_t count, int64_t cols);

  ModelConfig config_;
  TextModelWeights weights_;
  Backend& backend_;
  Arena& arena_;
  DType kv_dtype_;
  TextModelRegions regions_;
  KVPageLayout kv_layout_;  // this model's KV shape over the arena pool's pages (the full-attention layers' with kv_window_)
  // Sliding windows in memory: which layers' K/V live in the window pages (Arena::kv_window), their shape there, and
  // each group's fp8 scales in its own layer order.
  KVGroups kv_groups_;
  bool kv_window_ = false;
  KVPageLayout window_layout_;
  std::vector<float> group_k_scales_[2], group_v_scales_[2];
  int64_t max_tokens_ = 0;      // Tmax = max_batched_tokens: rows of every activation buffer
  int64_t max_seqs_ = 0;        // Smax: rows of the per-sequence buffers
  int64_t max_logit_rows_ = 0;  // rows one logits() call computes: min(logits buffer rows, Tmax)
  int64_t step_tokens_ = 0;     // T of the last stage()
  float attention_scale_ = 1.0f;  // head_dim ** -0.5 (query_pre_attn_scalar ** -0.5: gemma)
  float embedding_scale_ = 0.0f;  // > 0: inputs_embeds * this (gemma's normalizer, in the embedding dtype)
  RotaryEmbedding rotary_;        // the config's RoPE (src/rope.hpp), every layer's: R = rotary_dim <= D
  // gemma3: the sliding layers' own (default RoPE of base rope_local_base_freq); has_local_rotary_ false: rotary_
  // serves every layer
  RotaryEmbedding local_rotary_;
  bool has_local_rotary_ = false;
  std::vector<float> cos_host_, sin_host_;  // [Tmax, R / 2] host staging for the rotary tables
  std::vector<int32_t> rope_lengths_host_;  // [Tmax] each token's sequence length as the rotary forward sees it
  // [Tmax, H] image rows rounded to 16-bit activations on the host (vision models with BF16 / F16 activations)
  std::vector<uint16_t> image_rows_16bit_;
  int64_t deepstack_levels_ = 0;            // qwen3_vl: DeepStack features added after layers 0 .. levels - 1

  // Views of the arena's buffers (planner names in quotes), full size; forward() slices the first T rows.
  // Activations (act) are in the backend's activation dtype.
  Tensor hidden_;         // "hidden"       [Tmax, H] act: the residual stream
  Tensor normed_;         // "normed"       [Tmax, H]: RMSNorm outputs, and o_proj / down_proj outputs
  Tensor qkv_;            // "qkv"          [Tmax, (Hq + 2 Hkv) D]: q | k | v column blocks
  Tensor attn_out_;       // "attn_out"     [Tmax, Hq D]
  Tensor gate_up_;        // "gate_up"      [Tmax, 2 I]: gate | up column blocks
  Tensor mlp_act_;        // "mlp_act"      [Tmax, I]
  Tensor rope_cos_;       // "rope_cos"     [Tmax, R / 2] fp32 (R = rotary_dim)
  Tensor rope_sin_;       // "rope_sin"     [Tmax, R / 2] fp32
  Tensor rope_cos_local_;  // "rope_cos_local" [Tmax, D / 2] fp32: the sliding layers' (gemma3); else empty
  Tensor rope_sin_local_;  // "rope_sin_local" [Tmax, D / 2] fp32
  Tensor token_ids_;      // "token_ids"    [Tmax] int32
  Tensor slot_mapping_;   // "slot_mapping" [Tmax] int32
  Tensor query_starts_;   // "query_starts" [Smax + 1] int32 (+ 1 for a GPU's spare sequence)
  Tensor context_lens_;   // "context_lens" [Smax] int32 (+ 1 likewise)
  Tensor block_tables_;   // "block_tables" [Smax + 1, max_pages_per_seq] int32 (GPU); empty on the CPU
  Tensor window_slot_mapping_;  // "window_slot_mapping" [Tmax] int32 (kv_window_)
  Tensor window_block_tables_;  // "window_block_tables" [Smax + 1, max_pages_per_seq] int32 (GPU, kv_window_)
  Tensor logit_rows_;     // "logit_rows"   [Tmax] int32
  Tensor deepstack_rows_;  // "deepstack_rows" [Tmax, H] act, fp32-sized (vision models): a step's DeepStack rows
  Tensor logits_;         // "logits"       [max(Smax, 32), V] act (rows sized for fp32)
  Tensor sampling_probs_;  // "sampling_probs" [Smax, V] fp32
  Tensor sampling_order_;  // "sampling_order" [Smax, V] int32
  Tensor sampling_params_;  // "sampling_params" [Smax, 6] int32
  Tensor sampled_ids_;      // "sampled_ids" [Smax] int32
  AttentionBatch batch_;  // of the last stage()
  AttentionBatch window_batch_;  // the same with the window pages' block tables (kv_window_)
};

}  // namespace kvlite
