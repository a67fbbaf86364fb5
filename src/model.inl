// model: implementation. The forward pass mirrors transformers' modeling_llama.py / modeling_qwen2.py /
// modeling_qwen3.py (and modeling_gemma2.py / modeling_gemma3.py where BlockTraits say so) line by line; the
// PyTorch line is in the comment above each call.
#include <cmath>

namespace kvlite {

namespace detail {
namespace model {

// Throws the error of a failed backend call (forward() runs inside the engine's guard).
inline void check(const Status& status) {
  if (!status) throw status.error();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); i++) text += (i ? ", " : "") + format("%lld", (long long)shape[i]);
  return text + "]";
}

// Looks tensors up by name, collecting the absent ones so that one error lists them all.
class WeightBinder {
 public:
  // Quantized Linears are found from the checkpoint's headers and config together (describe_linears).
  WeightBinder(const ModelConfig& config, const TensorStore& store) : store_(store), origin_(config.origin) {
    if (config.quant.method == QuantMethod::none) return;
    Result<std::vector<LinearDesc>> linears = describe_linears(config, &store);
    if (!linears) throw linears.error();
    for (LinearDesc& linear : *linears)
      if (linear.format != WeightFormat::dense) quantized_.emplace(linear.name, std::move(linear));
  }

  // A view of `name` as [rows, cols] (a 1-D tensor of n elements is [n, 1], Tensor::vector's form).
  Tensor bind(const std::string& name, std::vector<int64_t> shape) {
    if (shape.size() == 1) return bind_as(name, shape, shape[0], 1);
    return bind_as(name, shape, shape[0], shape[1]);
  }
  // A view of `name`, of on-disk `shape`, as [rows, cols] holding all its elements: a vector as [n, 1], a
  // Conv3d kernel [out, C, T, P, P] as the [out, C T P P] weight of the equivalent Linear.
  Tensor bind_as(const std::string& name, const std::vector<int64_t>& shape, int64_t rows, int64_t cols) {
    const TensorInfo* info = store_.find(name);
    if (!info) {
      missing_.push_back(name);
      return {};
    }
    if (info->dtype != DType::BF16 && info->dtype != DType::F16 && info->dtype != DType::F32)
      fail(ErrorCode::unsupported,
           format("tensor '%s' is %s; the CPU engine reads BF16, F16 and F32 weights", name.c_str(),
                  dtype_name(info->dtype)));
    if (info->shape != shape)
      fail(ErrorCode::bad_format,
           format("tensor '%s' has shape %s; the config (%s) makes it %s", name.c_str(), shape_text(info->shape).c_str(),
                  origin_.c_str(), shape_text(shape).c_str()));
    void* data = const_cast<uint8_t*>(store_.data(*info));  // read-only mmap: the ops never write weights
    if (cols == 1) return Tensor::vector(data, info->dtype, rows);
    return Tensor::matrix(data, info->dtype, rows, cols);
  }
  // An nn.Linear: dense views, or the view of its quantized tensors (quant_weight checks each of them).
  LinearWeights linear(const std::string& module, int64_t out_features, int64_t in_features, bool bias) {
    LinearWeights weights;
    auto quantized = quantized_.find(module);
    if (quantized == quantized_.end()) {
      weights.weight = bind(module + ".weight", {out_features, in_features});
      if (bias) weights.bias = bind(module + ".bias", {out_features});
      return weights;
    }
    const LinearDesc& desc = quantized->second;
    if (desc.out_features != out_features || desc.in_features != in_features)
      fail(ErrorCode::bad_format,
           format("'%s' is stored as a %s Linear of [out %lld, in %lld]; the config (%s) makes it [%lld, %lld]",
                  module.c_str(), weight_format_name(desc.format), (long long)desc.out_features,
                  (long long)desc.in_features, origin_.c_str(), (long long)out_features, (long long)in_features));
    Result<QuantWeight> weight = quant_weight(desc, store_);
    if (!weight) throw weight.error();
    if (bias && !weight->bias) missing_.push_back(module + ".bias");
    if (!bias && weight->bias)
      fail(ErrorCode::bad_format, format("'%s.bias' is in the checkpoint but the config (%s) gives that Linear no "
                                         "bias", module.c_str(), origin_.c_str()));
    weights.quant = std::make_shared<const QuantWeight>(std::move(*weight));
    return weights;
  }
  void finish() const {
    if (missing_.empty()) return;
    std::string list;
    for (size_t i = 0; i < missing_.size(); i++) list += (i ? ", " : "") + missing_[i];
    fail(ErrorCode::missing_tensor,
         format("the checkpoint (%s) lacks %zu tensor%s the model needs: %s", files_text().c_str(), missing_.size(),
                missing_.size() == 1 ? "" : "s", list.c_str()));
  }

 private:
  std::string files_text() const {
    if (store_.files().empty()) return "no safetensors files";
    if (store_.files().size() == 1) return store_.files()[0];
    return format("%zu safetensors files", store_.files().size());
  }
  const TensorStore& store_;
  std::string origin_;
  std::map<std::string, LinearDesc> quantized_;  // module name -> its int4 / fp8 descriptor
  std::vector<std::string> missing_;
};


// The planned buffers of arena regions, carved in the planner's order and handed out as views by name, so
// that the plan and the model agree by construction.
class BufferCarver {
 public:
  explicit BufferCarver(Arena& arena) : arena_(arena) {}

  // Internal error unless the arena's `region` holds exactly `specs`.
  void carve(const char* region, const std::vector<BufferSpec>& specs) {
    const ArenaRegion* r = arena_.region(region);
    uint64_t total = buffers_bytes(specs);
    if (!r || r->bytes != total)
      fail(ErrorCode::internal,
           format("the arena's '%s' region holds %llu bytes but the planner's buffers for it sum to %llu: the plan "
                  "and the model disagree",
                  region, (unsigned long long)(r ? r->bytes : 0), (unsigned long long)total));
    uint8_t* next = arena_.base() + r->offset;
    for (const BufferSpec& spec : specs) {
      carved_[spec.name] = {next, spec.bytes};
      next += spec.bytes;
    }
  }
  // A view of a planned buffer; the model's idea of its size must fit the planner's.
  Tensor view(const char* name, DType dtype, int64_t rows, int64_t cols) const {
    auto it = carved_.find(name);
    uint64_t needed = dtype_bytes(dtype, uint64_t(rows * cols));
    if (it == carved_.end() || it->second.second < needed)
      fail(ErrorCode::internal,
           format("the model needs a buffer '%s' of %llu bytes ([%lld, %lld] %s) but the plan %s", name,
                  (unsigned long long)needed, (long long)rows, (long long)cols, dtype_name(dtype),
                  it == carved_.end() ? "has none" : format("gives it %llu", (unsigned long long)it->second.second).c_str()));
    return Tensor::matrix(it->second.first, dtype, rows, cols);
  }
  uint64_t bytes(const char* name) const {  // 0 when the plan has no such buffer
    auto it = carved_.find(name);
    return it == carved_.end() ? 0 : it->second.second;
  }

 private:
  Arena& arena_;
  std::map<std::string, std::pair<uint8_t*, uint64_t>> carved_;  // name -> (start, bytes)
};

}  // namespace model
}  // namespace detail

Result<TextModelWeights> bind_text_weights(const ModelConfig& config, const TensorStore& store) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    const TextConfig& c = config.text;
    const BlockTraits& block = c.block;
    const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size, V = c.vocab_size;
    const int64_t q_width = c.num_heads * D, kv_width = c.num_kv_heads * D;
    const std::string prefix = config.text_prefix();

    detail::model::WeightBinder bind(config, store);
    TextModelWeights w;
    // An RMSNorm weight as the forward pass multiplies by it: the stored w, or Gemma's 1 + w formed in fp32
    // (Gemma2RMSNorm: output * (1.0 + self.weight.float())).
    auto norm = [&](const std::string& name, int64_t n) -> Tensor {
      Tensor stored = bind.bind(name, {n});
      if (block.norm_form == NormForm::weight || stored.data == nullptr) return stored;
      auto one_plus = std::make_shared<std::vector<float>>(size_t(n));
      for (int64_t i = 0; i < n; i++)
        (*one_plus)[size_t(i)] = 1.0f + scale_at(static_cast<const uint8_t*>(stored.data), stored.dtype, i);
      w.computed.push_back(one_plus);
      return Tensor::vector(one_plus->data(), DType::F32, n);
    };
    w.embed_tokens = bind.bind(prefix + "embed_tokens.weight", {V, H});
    w.layers.resize(size_t(c.num_layers));
    for (int64_t l = 0; l < c.num_layers; l++) {
      const std::string layer = prefix + format("layers.%lld.", (long long)l);
      DecoderLayerWeights& lw = w.layers[size_t(l)];
      lw.input_layernorm = norm(layer + "input_layernorm.weight", H);
      if (block.fused_projections) {
        // Phi-3 stores q | k | v as one Linear, in the qkv buffer's column order: bound as the group's one part
        lw.qkv_proj.parts = {bind.linear(layer + "self_attn.qkv_proj", q_width + 2 * kv_width, H, c.attention_bias)};
      } else {
        lw.qkv_proj.parts = {bind.linear(layer + "self_attn.q_proj", q_width, H, c.attention_bias),
                             bind.linear(layer + "self_attn.k_proj", kv_width, H, c.attention_bias),
                             bind.linear(layer + "self_attn.v_proj", kv_width, H, c.attention_bias)};
      }
      if (c.qk_norm) {
        lw.q_norm = norm(layer + "self_attn.q_norm.weight", D);
        lw.k_norm = norm(layer + "self_attn.k_norm.weight", D);
      }
      lw.o_proj = bind.linear(layer + "self_attn.o_proj", H, q_width, c.o_proj_bias);
      if (block.sandwich_norms) {
        lw.attention_output_norm = norm(layer + "post_attention_layernorm.weight", H);
        lw.post_attention_layernorm = norm(layer + "pre_feedforward_layernorm.weight", H);
        lw.mlp_output_norm = norm(layer + "post_feedforward_layernorm.weight", H);
      } else {
        lw.post_attention_layernorm = norm(layer + "post_attention_layernorm.weight", H);
      }
      if (block.fused_projections) {
        // Phi3MLP: gate, up_states = self.gate_up_proj(x).chunk(2, dim=-1): gate first, as the gate_up buffer
        lw.gate_up_proj.parts = {bind.linear(layer + "mlp.gate_up_proj", 2 * I, H, c.mlp_bias)};
      } else {
        lw.gate_up_proj.parts = {bind.linear(layer + "mlp.gate_proj", I, H, c.mlp_bias),
                                 bind.linear(layer + "mlp.up_proj", I, H, c.mlp_bias)};
      }
      lw.down_proj = bind.linear(layer + "mlp.down_proj", H, I, c.mlp_bias);
    }
    w.norm = norm(prefix + "norm.weight", H);
    // KV cache scales (compressed-tensors kv_cache_scheme): every attention layer has both self_attn.k_scale and
    // self_attn.v_scale, or none does and the checkpoint declares no scheme. Anything between is refused here,
    // naming the first missing tensor: K scales alone used to open and then fail every forward, V scales alone
    // were silently ignored.
    auto scale_name = [&](int64_t l, const char* which) {
      return prefix + format("layers.%lld.self_attn.%s", (long long)l, which);
    };
    int64_t present[2] = {0, 0};  // layers with k_scale, with v_scale
    for (int64_t l = 0; l < c.num_layers; l++)
      for (int kind = 0; kind < 2; kind++) present[kind] += store.find(scale_name(l, kind ? "v_scale" : "k_scale")) != nullptr;
    if (config.quant.kv_cache_fp8 || present[0] > 0 || present[1] > 0) {
      for (int64_t l = 0; l < c.num_layers; l++)
        for (const char* which : {"k_scale", "v_scale"})
          if (!store.find(scale_name(l, which)))
            fail(ErrorCode::missing_tensor,
                 format("%s: %s is missing: %s, so every attention layer needs both self_attn.k_scale and "
                        "self_attn.v_scale (this checkpoint has k_scale on %lld and v_scale on %lld of %lld layers)",
                        config.origin.c_str(), scale_name(l, which).c_str(),
                        config.quant.kv_cache_fp8 ? "config.json declares a kv_cache_scheme"
                                                  : "the checkpoint carries KV cache scales",
                        (long long)present[0], (long long)present[1], (long long)c.num_layers));
      for (const char* which : {"k_scale", "v_scale"}) {
        std::vector<float>& scales = which[0] == 'k' ? w.k_scales : w.v_scales;
        for (int64_t l = 0; l < c.num_layers; l++) {
          const std::string name = scale_name(l, which);
          const TensorInfo& info = *store.find(name);
          if (info.numel() != 1 || (info.dtype != DType::F32 && info.dtype != DType::BF16 && info.dtype != DType::F16))
            fail(ErrorCode::bad_format, format("%s: %s must be one F32, BF16 or F16 number (it is %s with %llu "
                                               "elements)", config.origin.c_str(), name.c_str(), dtype_name(info.dtype),
                                               (unsigned long long)info.numel()));
          const float value = scale_at(store.data(info), info.dtype, 0);
          if (!(value > 0) || !std::isfinite(value))
            fail(ErrorCode::bad_format, format("%s: %s is %g; a KV cache scale must be a positive finite number",
                                               config.origin.c_str(), name.c_str(), double(value)));
          scales.push_back(value);
        }
      }
    }
    // Tied: transformers points lm_head at embed_tokens (and save_pretrained drops lm_head.weight).
    if (c.tie_word_embeddings) w.lm_head.weight = w.embed_tokens;
    else w.lm_head = bind.linear("lm_head", V, H, false);
    bind.finish();
    return w;
  });
}

// ---- TextModel --------------------------------------------------------------------------------------------

TextModel::TextModel(const ModelConfig& config, TextModelWeights weights, Backend& backend, Arena& arena,
                     const Plan& plan, DType kv_dtype, const TextModelRegions& regions)
    : config_(config), weights_(std::move(weights)), backend_(backend), arena_(arena), kv_dtype_(kv_dtype),
      regions_(regions) {
  using detail::fail;
  using detail::format;
  const TextConfig& c = config_.text;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size, V = c.vocab_size;
  Result<RotaryEmbedding> rotary = RotaryEmbedding::create(c.rope, D);
  if (!rotary) throw rotary.error();
  rotary_ = std::move(*rotary);
  const int64_t half = rotary_.half();  // R / 2: D / 2, less with partial rotary (Phi-4-mini)
  if (c.block.local_rope_theta > 0) {
    // gemma3: the sliding layers' rotary_emb_local, default RoPE of base rope_local_base_freq (Gemma3's own
    // compute_default_rope_parameters: every dimension rotates, no scaling, whatever the global layers use)
    RopeConfig local;
    local.theta = c.block.local_rope_theta;
    local.max_position_embeddings = c.max_position_embeddings;
    Result<RotaryEmbedding> local_rotary = RotaryEmbedding::create(local, D);
    if (!local_rotary) throw local_rotary.error();
    local_rotary_ = std::move(*local_rotary);
    has_local_rotary_ = true;
  }
  max_tokens_ = plan.options.max_batched_tokens;
  max_seqs_ = plan.options.max_seqs;
  const DType act = backend_.activation_dtype();
  if (!plan.options.activation_dtype || *plan.options.activation_dtype != act)
    fail(ErrorCode::internal, format("the plan sized activations for %s but the %s backend computes in %s",
                                     plan.options.activation_dtype ? dtype_name(*plan.options.activation_dtype) : "(unset)",
                                     backend_.name().c_str(), dtype_name(act)));
  // A GPU reads the step's block tables from its own memory; the CPU reads the pool's in place (as planned).
  const bool device_tables = backend_.kind() == BackendKind::cuda;
  const int64_t table_pages = device_tables ? block_table_pages(config_, plan.options.kv_page_tokens) : 0;
  const int64_t spare = device_tables ? 1 : 0;

  kv_window_ = !regions_.kv_window.empty() && arena_.kv_window() != nullptr;
  kv_groups_ = kv_groups(c, kv_window_);
  if (kv_window_ && kv_groups_.window_layers == 0)
    fail(ErrorCode::internal, "the arena keeps sliding windows in pages of their own but this model has no sliding "
                              "layers beside full ones: the plan and the model disagree");
  kv_layout_ = KVPageLayout{kv_groups_.full_layers, arena_.kv().page_tokens(), c.num_kv_heads, D};
  if (kv_window_) {
    window_layout_ = KVPageLayout{kv_groups_.window_layers, arena_.kv_window()->page_tokens(), c.num_kv_heads, D};
    const ArenaRegion* window_region = arena_.region(regions_.kv_window);
    const uint64_t window_needed =
        dtype_bytes(kv_dtype_, uint64_t(window_layout_.page_elements())) * uint64_t(arena_.kv_window()->num_pages());
    if (!window_region || window_region->bytes != window_needed)
      fail(ErrorCode::internal, format("the arena's '%s' region holds %llu bytes but %llu pages of this model's sliding "
                                       "layers take %llu: the plan and the model disagree",
                                       regions_.kv_window.c_str(), (unsigned long long)(window_region ? window_region->bytes : 0),
                                       (unsigned long long)arena_.kv_window()->num_pages(), (unsigned long long)window_needed));
  }
  // fp8 KV scales in each group's layer order (a KVCacheView's scales are indexed by the layer's index in its pages)
  if (!weights_.k_scales.empty())
    for (int64_t l = 0; l < c.num_layers; l++) {
      const int g = kv_groups_.in_window(c.block, l) ? 1 : 0;
      group_k_scales_[g].push_back(weights_.k_scales[size_t(l)]);
      group_v_scales_[g].push_back(weights_.v_scales[size_t(l)]);
    }
  const ArenaRegion* kv_region = arena_.region(regions_.kv);
  const uint64_t kv_needed = dtype_bytes(kv_dtype_, uint64_t(kv_layout_.page_elements())) * uint64_t(arena_.kv().num_pages());
  if (!kv_region || kv_region->bytes != kv_needed)
    fail(ErrorCode::internal, format("the arena's '%s' region holds %llu bytes but %llu pages of this model's KV take "
                                     "%llu: the plan and the model disagree", regions_.kv.c_str(),
                                     (unsigned long long)(kv_region ? kv_region->bytes : 0),
                                     (unsigned long long)arena_.kv().num_pages(), (unsigned long long)kv_needed));
  detail::model::BufferCarver buffers(arena_);
  buffers.carve(regions_.activations.c_str(),
                activation_buffers(config_, max_tokens_, max_seqs_, act, table_pages, kv_window_));
  buffers.carve(regions_.logits.c_str(), logits_buffers(config_, max_seqs_));
  auto view = [&](const char* name, DType dtype, int64_t rows, int64_t cols) {
    return buffers.view(name, dtype, rows, cols);
  };
  hidden_ = view("hidden", act, max_tokens_, H);
  normed_ = view("normed", act, max_tokens_, H);
  qkv_ = view("qkv", act, max_tokens_, (c.num_heads + 2 * c.num_kv_heads) * D);
  attn_out_ = view("attn_out", act, max_tokens_, c.num_heads * D);
  gate_up_ = view("gate_up", act, max_tokens_, 2 * I);
  mlp_act_ = view("mlp_act", act, max_tokens_, I);
  rope_cos_ = view("rope_cos", DType::F32, max_tokens_, half);
  rope_sin_ = view("rope_sin", DType::F32, max_tokens_, half);
  if (has_local_rotary_) {
    rope_cos_local_ = view("rope_cos_local", DType::F32, max_tokens_, local_rotary_.half());
    rope_sin_local_ = view("rope_sin_local", DType::F32, max_tokens_, local_rotary_.half());
  }
  token_ids_ = view("token_ids", DType::I32, max_tokens_, 1);
  slot_mapping_ = view("slot_mapping", DType::I32, max_tokens_, 1);
  query_starts_ = view("query_starts", DType::I32, max_seqs_ + 1 + spare, 1);
  context_lens_ = view("context_lens", DType::I32, max_seqs_ + spare, 1);
  if (device_tables) block_tables_ = view("block_tables", DType::I32, max_seqs_ + 1, arena_.kv().max_pages_per_seq());
  if (kv_window_) {
    window_slot_mapping_ = view("window_slot_mapping", DType::I32, max_tokens_, 1);
    if (device_tables)
      window_block_tables_ = view("window_block_tables", DType::I32, max_seqs_ + 1, arena_.kv_window()->max_pages_per_seq());
  }
  logit_rows_ = view("logit_rows", DType::I32, max_tokens_, 1);
  if (config_.vision.present) {
    deepstack_levels_ = int64_t(config_.vision.deepstack_visual_indexes.size());
    deepstack_rows_ = view("deepstack_rows", act, max_tokens_, H);
    if (act != DType::F32) image_rows_16bit_.resize(size_t(max_tokens_ * H));
  }
  const int64_t logits_buffer_rows = int64_t(buffers.bytes("logits") / uint64_t(V * 4));
  logits_ = view("logits", act, logits_buffer_rows, V);
  sampling_probs_ = view("sampling_probs", DType::F32, max_seqs_, V);
  sampling_order_ = view("sampling_order", DType::I32, max_seqs_, V);
  sampling_params_ = view("sampling_params", DType::I32, max_seqs_, kSamplingParamWords);
  sampled_ids_ = view("sampled_ids", DType::I32, max_seqs_, 1);
  // The gathered rows go through hidden_ (free after the final norm), so a call takes at most Tmax rows.
  max_logit_rows_ = std::min(logits_buffer_rows, max_tokens_);

  rope_lengths_host_.resize(size_t(max_tokens_));
  const int64_t staged_half = std::max(half, has_local_rotary_ ? local_rotary_.half() : 0);
  cos_host_.resize(size_t(max_tokens_ * staged_half));
  sin_host_.resize(size_t(max_tokens_ * staged_half));
  // self.scaling = self.head_dim ** -0.5   (gemma: config.query_pre_attn_scalar ** -0.5)
  const double scaled_by = c.block.query_pre_attn_scalar > 0 ? c.block.query_pre_attn_scalar : double(D);
  attention_scale_ = float(std::pow(scaled_by, -0.5));
  if (c.block.embedding_scaled) {
    // gemma: self.embed_scale = torch.tensor(hidden_size ** 0.5), used as .to(self.weight.dtype)
    const float normalizer = float(std::sqrt(double(H)));
    const DType table = weights_.embed_tokens.dtype;
    embedding_scale_ = table == DType::BF16   ? bf16_to_float(float_to_bf16(normalizer))
                       : table == DType::F16 ? f16_to_float(float_to_f16(normalizer))
                                             : normalizer;
  }
}

KVCacheView TextModel::kv_cache(bool window) const {
  KVCacheView cache;
  cache.pages = arena_.region_data(window ? regions_.kv_window : regions_.kv);
  cache.dtype = kv_dtype_;
  cache.layout = window ? window_layout_ : kv_layout_;
  cache.num_pages = window ? arena_.kv_window()->num_pages() : arena_.kv().num_pages();
  if (kv_dtype_ == DType::F8_E4M3 && !weights_.k_scales.empty()) {
    cache.k_scales = group_k_scales_[window ? 1 : 0].data();
    cache.v_scales = group_v_scales_[window ? 1 : 0].data();
  }
  return cache;
}

void TextModel::forward(const StepInput& step) {
  stage(step);
  compute(step);
}

void TextModel::stage(const StepInput& step) {
  using detail::fail;
  using detail::format;
  using detail::model::check;
  const int64_t T = step.tokens;
  // The attention batch's buffers hold max_seqs sequences, and a GPU's one spare (CUDA graph padding).
  const int64_t seq_capacity = context_lens_.rows;
  if (T < 1 || T > max_tokens_ || step.seqs < 1 || step.seqs > seq_capacity || step.logit_rows < 0 ||
      step.logit_rows > T)
    fail(ErrorCode::internal,
         format("forward: a step of %lld tokens, %lld sequences and %lld logit rows is outside the plan's %lld "
                "tokens and %lld sequences",
                (long long)T, (long long)step.seqs, (long long)step.logit_rows, (long long)max_tokens_,
                (long long)seq_capacity));
  step_tokens_ = T;

  // The step's indices and RoPE tables, from the host.
  Tensor ids = token_ids_.slice_rows(0, T), slots = slot_mapping_.slice_rows(0, T);
  check(backend_.copy_from_host(step.token_ids, ids));
  // inputs_embeds = self.embed_tokens(input_ids) from a host table (--host-embeddings): the rows are looked up on
  // the host and copied into hidden here, before the step's compute (a CUDA graph's launch), which starts from them
  if (weights_.embed_tokens_on_host)
    check(backend_.gather_host_rows(weights_.embed_tokens, step.token_ids, hidden_.slice_rows(0, T)));
  check(backend_.copy_from_host(step.slots, slots));
  check(backend_.copy_from_host(step.query_starts, query_starts_.slice_rows(0, step.seqs + 1)));
  check(backend_.copy_from_host(step.context_lens, context_lens_.slice_rows(0, step.seqs)));
  if (step.logit_rows > 0) check(backend_.copy_from_host(step.logit_row_ids, logit_rows_.slice_rows(0, step.logit_rows)));
  // cos, sin = self.rotary_emb(hidden_states, position_ids)                  cos, sin [T, R / 2]
  // (qwen3_vl: three position rows, interleaved by mrope_section; yarn, longrope: times the attention factor)
  // dynamic, longrope: the frequencies follow seq_len = max(position_ids) + 1 of each sequence's tokens in this
  // step, as transformers' dynamic_rope_update sees a forward call of the same tokens (cached keys keep theirs).
  const int32_t* rope_lengths = nullptr;
  if (rotary_.depends_on_length()) {
    check(rope_step_lengths(step.positions, T, step.query_starts, step.seqs, rope_lengths_host_.data()));
    rope_lengths = rope_lengths_host_.data();
  }
  check(rotary_.tables(step.positions, step.position_rows, T, rope_lengths, cos_host_.data(), sin_host_.data()));
  Tensor cos = rope_cos_.slice_rows(0, T), sin = rope_sin_.slice_rows(0, T);
  check(backend_.copy_from_host(cos_host_.data(), cos));
  check(backend_.copy_from_host(sin_host_.data(), sin));
  if (has_local_rotary_) {
    // gemma3: position_embeddings_local = self.rotary_emb_local(hidden_states, position_ids)   [T, D / 2]
    check(local_rotary_.tables(step.positions, step.position_rows, T, nullptr, cos_host_.data(), sin_host_.data()));
    check(backend_.copy_from_host(cos_host_.data(), rope_cos_local_.slice_rows(0, T)));
    check(backend_.copy_from_host(sin_host_.data(), rope_sin_local_.slice_rows(0, T)));
  }
  batch_.query_starts = query_starts_.slice_rows(0, step.seqs + 1);
  batch_.context_lens = context_lens_.slice_rows(0, step.seqs);
  batch_.block_tables = stage_block_tables(step.block_tables, step.seqs, block_tables_);
  batch_.max_context = step.max_context;
  if (kv_window_) {
    // the sliding layers' pages: their own slots and block tables, the same sequences
    if (!step.window_slots || !step.window_block_tables.data)
      fail(ErrorCode::internal, "forward: the sliding layers keep their KV in pages of their own but the step has no "
                                "slots or block tables for them");
    check(backend_.copy_from_host(step.window_slots, window_slot_mapping_.slice_rows(0, T)));
    window_batch_ = batch_;
    window_batch_.block_tables = stage_block_tables(step.window_block_tables, step.seqs, window_block_tables_);
  }
}

// A step's block tables [seqs, max_pages_per_seq] as the attention reads them: the host's in place (the CPU), or
// copied into `device` (a GPU's buffer, in the pool's layout).
Tensor TextModel::stage_block_tables(const Tensor& host, int64_t seqs, const Tensor& device) {
  using detail::fail;
  using detail::format;
  using detail::model::check;
  if (device.data == nullptr) return host.slice_rows(0, seqs);
  if (host.cols != device.cols || seqs > device.rows)
    fail(ErrorCode::internal, format("forward: block tables of %lld pages per sequence for %lld sequences do not fit "
                                     "the plan's [%lld, %lld]", (long long)host.cols, (long long)seqs,
                                     (long long)device.rows, (long long)device.cols));
  Tensor device_tables = device.slice_rows(0, seqs);
  if (host.row_stride == host.cols) {
    check(backend_.copy_from_host(host.data, device_tables));
  } else {
    for (int64_t s = 0; s < seqs; s++)
      check(backend_.copy_from_host(host.slice_rows(s, 1).data, device_tables.slice_rows(s, 1)));
  }
  return device_tables;
}

void TextModel::compute(const StepInput& step) {
  using detail::model::check;
  const TextConfig& c = config_.text;
  const int64_t T = step.tokens, D = c.head_dim, I = c.intermediate_size;
  const int64_t q_width = c.num_heads * D, kv_width = c.num_kv_heads * D;
  const float eps = float(c.rms_norm_eps);
  if (T != step_tokens_)
    detail::fail(ErrorCode::internal, detail::format("compute: a step of %lld tokens after stage() of %lld",
                                                     (long long)T, (long long)step_tokens_));
  Tensor ids = token_ids_.slice_rows(0, T), slots = slot_mapping_.slice_rows(0, T);
  const BlockTraits& block = c.block;
  Tensor cos = rope_cos_.slice_rows(0, T), sin = rope_sin_.slice_rows(0, T);
  // the sliding layers' RoPE tables (gemma3), else the same as every layer's
  Tensor local_cos = has_local_rotary_ ? rope_cos_local_.slice_rows(0, T) : cos;
  Tensor local_sin = has_local_rotary_ ? rope_sin_local_.slice_rows(0, T) : sin;
  const GeluApprox gelu_form = block.activation == MlpActivation::gelu ? GeluApprox::none : GeluApprox::tanh;
  // the full-attention layers' pages, and the sliding layers' own when they keep only their windows
  const KVCacheView full_cache = kv_cache(), window_cache = kv_window_ ? kv_cache(true) : full_cache;
  Tensor window_slots = kv_window_ ? window_slot_mapping_.slice_rows(0, T) : slots;

  Tensor hidden = hidden_.slice_rows(0, T);    // [T, H], the residual stream
  Tensor normed = normed_.slice_rows(0, T);    // [T, H]
  Tensor qkv = qkv_.slice_rows(0, T);          // [T, (Hq + 2 Hkv) D]
  Tensor q = qkv.slice_cols(0, q_width);       // [T, Hq D]
  Tensor k = qkv.slice_cols(q_width, kv_width);             // [T, Hkv D]
  Tensor v = qkv.slice_cols(q_width + kv_width, kv_width);  // [T, Hkv D]
  Tensor attn = attn_out_.slice_rows(0, T);    // [T, Hq D]
  Tensor gate_up = gate_up_.slice_rows(0, T);  // [T, 2 I]
  Tensor gate = gate_up.slice_cols(0, I);      // [T, I]
  Tensor up = gate_up.slice_cols(I, I);        // [T, I]
  Tensor act = mlp_act_.slice_rows(0, T);      // [T, I]

  // inputs_embeds = self.embed_tokens(input_ids)   (gemma: * self.embed_scale.to(self.weight.dtype))
  // (a host table's rows are already in hidden: stage() looked them up)
  if (!weights_.embed_tokens_on_host) check(backend_.gather_rows(weights_.embed_tokens, ids, hidden));
  if (embedding_scale_ > 0) check(backend_.scale(hidden, embedding_scale_, hidden));
  // qwen3_vl: inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_embeds)
  // (image features are float host rows: the vision tower's activations widened, so rounding them back to
  // 16-bit activations gives the bits the tower stored)
  for (int64_t r = 0; r < step.image_runs; r++) {
    const ImageRun& run = step.image_run_list[r];
    check(backend_.copy_from_host(host_activation_rows(run.rows, run.count, hidden.cols),
                                  hidden.slice_rows(run.token, run.count)));
  }
  // Whether `hidden` already holds the previous layer's output (normally its MLP output waits in `normed` and
  // the residual add is fused into the next norm).
  bool layer_output_in_hidden = true;
  for (int64_t l = 0; l < c.num_layers; l++) {
    const DecoderLayerWeights& w = weights_.layers[size_t(l)];
    const bool sliding = block.window_of(l) > 0;
    // where the layer's K/V live: its group's pages, at its index among the group's layers
    const bool in_window = kv_groups_.in_window(block, l);
    const KVCacheView& cache = in_window ? window_cache : full_cache;
    const int64_t kv_layer = kv_groups_.group_layer[size_t(l)];
    // the layer kind's attention: sliding_window (mistral, qwen2, phi3, gemma) and gemma2's score soft-cap
    AttentionOptions attention_options;
    attention_options.window = block.window_of(l);
    attention_options.logit_softcap = float(block.attn_logit_softcap);
    // residual = hidden_states; hidden_states = self.input_layernorm(hidden_states)
    // (from layer 1 on, the previous layer's `hidden_states = residual + hidden_states` is fused in: normed
    // holds that layer's MLP output)
    if (layer_output_in_hidden) {
      check(backend_.rms_norm(hidden, w.input_layernorm, eps, normed));
    } else {
      check(backend_.add_rms_norm(normed, hidden, w.input_layernorm, eps, normed));
    }

    // query_states = self.q_proj(hidden_states); key_states = ...; value_states = ...   (+ bias: qwen2)
    // (one call: q | k | v are the qkv buffer's column blocks)                 qkv [T, (Hq + 2 Hkv) D]
    check(backend_.linear(normed, w.qkv_proj, qkv));
    if (c.qk_norm) {
      // qwen3: query_states = self.q_norm(query_states.view(hidden_shape)); the same for keys (per head, over D)
      check(backend_.rms_norm(q, w.q_norm, eps, q));
      check(backend_.rms_norm(k, w.k_norm, eps, k));
    }
    // query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    // (q and k are adjacent column blocks of qkv, Hq + Hkv heads)                 qk [T, (Hq + Hkv) D]
    // key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    // (one call for both: a backend may store each rotated key as it makes it)
    // (gemma3: a sliding layer takes position_embeddings_local)
    check(backend_.rope_kv_write(qkv.slice_cols(0, q_width + kv_width), sliding ? local_cos : cos,
                                 sliding ? local_sin : sin, D, cache, kv_layer, k, v, in_window ? window_slots : slots));
    // attn_output = softmax(query @ key^T * self.scaling + causal_mask) @ value   (GQA: repeat_kv)
    // (the mask of the layer's kind: sliding_window_overlay on a sliding layer; gemma2 soft-caps the scores)
    check(backend_.attention(q, cache, kv_layer, in_window ? window_batch_ : batch_, attention_scale_, attn,
                             attention_options));
    // attn_output = self.o_proj(attn_output)                                  normed [T, H]
    check(backend_.linear(attn, w.o_proj, normed));
    // gemma: hidden_states = self.post_attention_layernorm(hidden_states)  (before the residual add)
    if (w.attention_output_norm.data) check(backend_.rms_norm(normed, w.attention_output_norm, eps, normed));
    // hidden_states = residual + hidden_states; residual = hidden_states
    // hidden_states = self.post_attention_layernorm(hidden_states)   (gemma: self.pre_feedforward_layernorm)
    check(backend_.add_rms_norm(normed, hidden, w.post_attention_layernorm, eps, normed));
    // down_proj(act_fn(gate_proj(x)) * up_proj(x))                            normed [T, H]
    // (gate | up: the gate_up buffer's column blocks)                           gate_up [T, 2 I]
    check(backend_.linear(normed, w.gate_up_proj, gate_up));
    if (block.activation == MlpActivation::silu) check(backend_.silu_mul(gate, up, act));  // SwiGLU
    else check(backend_.gelu_mul(gate, up, gelu_form, act));                                // GeGLU (gemma)
    check(backend_.linear(act, w.down_proj, normed));
    // gemma: hidden_states = self.post_feedforward_layernorm(hidden_states)  (before the residual add)
    if (w.mlp_output_norm.data) check(backend_.rms_norm(normed, w.mlp_output_norm, eps, normed));
    layer_output_in_hidden = false;
    if (l < deepstack_levels_ && step.image_runs > 0) {
      // hidden_states = residual + hidden_states (the layer's output), then qwen3_vl's _deepstack_process:
      // hidden_states[visual_pos_masks, :] = hidden_states[visual_pos_masks, :] + deepstack_visual_embeds[l]
      check(backend_.add(hidden, normed, hidden));
      layer_output_in_hidden = true;
      for (int64_t r = 0; r < step.image_runs; r++) {
        const ImageRun& run = step.image_run_list[r];
        Tensor staged = deepstack_rows_.slice_rows(0, run.count);  // [count, H]
        Tensor rows = hidden.slice_rows(run.token, run.count);
        check(backend_.copy_from_host(
            host_activation_rows(run.rows + (l + 1) * run.level_stride, run.count, c.hidden_size), staged));
        check(backend_.add(rows, staged, rows));
      }
    }
  }
  // hidden_states = residual + hidden_states (last layer); hidden_states = self.norm(hidden_states)
  if (layer_output_in_hidden) {
    check(backend_.rms_norm(hidden, weights_.norm, eps, normed));
  } else {
    check(backend_.add_rms_norm(normed, hidden, weights_.norm, eps, normed));
  }
}

const void* TextModel::host_activation_rows(const float* rows, int64_t count, int64_t cols) {
  const DType act = backend_.activation_dtype();
  if (act == DType::F32) return rows;
  const int64_t n = count * cols;  // <= Tmax * H: a step's image rows are some of its tokens
  for (int64_t i = 0; i < n; i++)
    image_rows_16bit_[size_t(i)] = act == DType::BF16 ? float_to_bf16(rows[i]) : float_to_f16(rows[i]);
  return image_rows_16bit_.data();
}

Tensor TextModel::logits(int64_t first, int64_t count) {
  using detail::model::check;
  if (first < 0 || count < 1 || count > max_logit_rows_)
    detail::fail(ErrorCode::internal, detail::format("logits: rows [%lld, +%lld) outside one call's %lld rows",
                                                     (long long)first, (long long)count, (long long)max_logit_rows_));
  // logits = self.lm_head(hidden_states[:, slice_indices, :]), for the wanted rows only (RMSNorm is per row,
  // so normalising all rows and then selecting is the same as transformers' select-last-then-project).
  // hidden is dead after the final norm: it holds the gathered rows.                gathered [count, H]
  Tensor gathered = hidden_.slice_rows(0, count);
  check(backend_.gather_rows(normed_.slice_rows(0, step_tokens_), logit_rows_.slice_rows(first, count), gathered));
  Tensor out = logits_.slice_rows(0, count);  // [count, V] act (fp32 on the CPU, as transformers' .float())
  check(backend_.linear(gathered, weights_.lm_head, out));
  // gemma2: logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap
  if (config_.text.block.final_logit_softcap > 0)
    check(backend_.soft_cap(out, float(config_.text.block.final_logit_softcap), out));
  check(backend_.synchronize());
  return out;
}

float* TextModel::sampling_probs(int64_t seq) { return static_cast<float*>(sampling_probs_.slice_rows(seq, 1).data); }
int32_t* TextModel::sampling_order(int64_t seq) {
  return static_cast<int32_t*>(sampling_order_.slice_rows(seq, 1).data);
}

}  // namespace kvlite
