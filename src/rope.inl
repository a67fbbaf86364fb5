// rope: rotary frequencies, attention factors and cos/sin tables as transformers computes them.
namespace kvlite {

namespace detail {
namespace rope {

// base ** (arange(0, dim, 2).float() / dim) for frequency i: the exponent one float32 division, the power taken
// in double and rounded once (torch's float pow is within an ulp of that).
inline float power(double base, int64_t i, int64_t dim) {
  const float exponent = float(2 * i) / float(dim);
  return float(std::pow(double(float(base)), double(exponent)));
}

// 1.0 / (base ** (arange(0, dim, 2) / dim)): `scalar / tensor` is tensor.reciprocal() * scalar in torch.
inline std::vector<float> default_inv_freq(double base, int64_t dim) {
  std::vector<float> inv_freq(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; i++) inv_freq[size_t(i)] = 1.0f / power(base, i, dim);
  return inv_freq;
}

// _compute_llama3_parameters. A Python scalar meeting a float32 tensor becomes a float32 operand, and
// `scalar / tensor` is tensor.reciprocal() * scalar, hence the reciprocals below.
inline void llama3(const RopeConfig& rope, std::vector<float>& inv_freq) {
  if (!(rope.factor > 0) || !(rope.high_freq_factor > rope.low_freq_factor) || rope.low_freq_factor <= 0 ||
      rope.original_max_position_embeddings <= 0)
    fail(ErrorCode::invalid_argument,
         format("rope_frequencies: llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                "original_max_position_embeddings > 0 (got %g, %g, %g, %lld)",
                rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                (long long)rope.original_max_position_embeddings));
  const float factor = float(rope.factor), low = float(rope.low_freq_factor);
  const double old_context = double(rope.original_max_position_embeddings);
  const float low_freq_wavelen = float(old_context / rope.low_freq_factor);
  const float high_freq_wavelen = float(old_context / rope.high_freq_factor);
  const float two_pi = float(6.283185307179586);  // 2 * math.pi
  const float band = float(rope.high_freq_factor - rope.low_freq_factor);
  for (float& f : inv_freq) {
    float wavelen = (1.0f / f) * two_pi;
    // wavelen < high_freq_wavelen: unchanged; wavelen > low_freq_wavelen: divided by factor
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      // smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      float smooth = ((1.0f / wavelen) * float(old_context) - low) / band;
      // (1 - smooth) * inv_freq / factor + smooth * inv_freq
      scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
    }
    f = scaled;
  }
}

// _compute_dynamic_ntk_parameters. seq_len 0 (None, at init) goes through Python floats: the base is then
// theta itself up to double rounding. A positive seq_len is the forward's `max(position_ids) + 1`, a tensor:
// every step below is then a float32 tensor operation, the new base a float32 0-d tensor.
inline std::vector<float> dynamic(const RopeConfig& rope, int64_t dim, int64_t seq_len) {
  const int64_t max_pos = rope.max_position_embeddings;
  if (!(rope.factor > 0) || max_pos <= 0)
    fail(ErrorCode::invalid_argument,
         format("rope_frequencies: dynamic scaling needs factor > 0 and max_position_embeddings > 0 (got %g, %lld)",
                rope.factor, (long long)max_pos));
  const double exponent = double(dim) / double(dim - 2);
  if (seq_len <= 0) {
    const double base = rope.theta * std::pow(rope.factor * double(max_pos) / double(max_pos) - (rope.factor - 1), exponent);
    return default_inv_freq(base, dim);
  }
  const int64_t length = std::max(seq_len, max_pos);  // torch.maximum(seq_len, max_position_embeddings)
  float x = float(rope.factor) * float(length);
  x = x / float(max_pos);
  x = x - float(rope.factor - 1);
  x = float(std::pow(double(x), double(float(exponent))));
  const float base = float(rope.theta) * x;
  std::vector<float> inv_freq(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; i++) {
    const float e = float(2 * i) / float(dim);
    inv_freq[size_t(i)] = 1.0f / float(std::pow(double(base), double(e)));
  }
  return inv_freq;
}

// _compute_yarn_parameters (the correction range in Python doubles, the frequencies in float32).
inline RopeFrequencies yarn(const RopeConfig& rope, int64_t dim) {
  const double base = rope.theta, factor = rope.factor;
  const int64_t original = rope.original_max_position_embeddings;
  if (!(factor > 0) || original <= 0)
    fail(ErrorCode::invalid_argument,
         format("rope_frequencies: yarn scaling needs factor > 0 and original_max_position_embeddings > 0 "
                "(got %g, %lld)", factor, (long long)original));
  auto get_mscale = [](double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; };
  double attention_factor = rope.attention_factor;
  if (!(attention_factor > 0)) {
    if (rope.mscale != 0 && rope.mscale_all_dim != 0)
      attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim);
    else
      attention_factor = get_mscale(factor, 1.0);
  }
  const double beta_fast = rope.beta_fast != 0 ? rope.beta_fast : 32;  // `beta_fast or 32`
  const double beta_slow = rope.beta_slow != 0 ? rope.beta_slow : 1;
  const double pi = 3.141592653589793;
  auto correction_dim = [&](double rotations) {
    return (double(dim) * std::log(double(original) / (rotations * 2 * pi))) / (2 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;  // linear_ramp_factor: prevent singularity

  RopeFrequencies out;
  out.attention_factor = float(attention_factor);
  out.inv_freq.resize(size_t(dim / 2));
  const float low_f = float(low), span = float(high - low);
  for (int64_t i = 0; i < dim / 2; i++) {
    const float pos_freq = power(base, i, dim);
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (float(factor) * pos_freq);
    float ramp = (float(i) - low_f) / span;
    ramp = std::min(std::max(ramp, 0.0f), 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    // interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, each a float32 op
    volatile float a = interpolation * (1.0f - extrapolation_factor);
    volatile float b = extrapolation * extrapolation_factor;
    out.inv_freq[size_t(i)] = a + b;
  }
  return out;
}

// _compute_longrope_parameters.
inline RopeFrequencies longrope(const RopeConfig& rope, int64_t dim, int64_t seq_len) {
  const int64_t original = rope.original_max_position_embeddings;
  if (original <= 0 || int64_t(rope.short_factor.size()) != dim / 2 || int64_t(rope.long_factor.size()) != dim / 2)
    fail(ErrorCode::invalid_argument,
         format("rope_frequencies: longrope needs original_max_position_embeddings > 0 (got %lld) and short_factor "
                "and long_factor of rotary_dim / 2 = %lld entries (got %zu and %zu)",
                (long long)original, (long long)(dim / 2), rope.short_factor.size(), rope.long_factor.size()));
  // factor None: max_position_embeddings / original_max_position_embeddings (Phi-3's convention)
  const double factor = rope.factor > 0 ? rope.factor : double(rope.max_position_embeddings) / double(original);
  double attention_factor = rope.attention_factor;
  if (!(attention_factor > 0))
    attention_factor = factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(double(original)));
  const std::vector<double>& ext = seq_len > original ? rope.long_factor : rope.short_factor;
  RopeFrequencies out;
  out.attention_factor = float(attention_factor);
  out.inv_freq.resize(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; i++) out.inv_freq[size_t(i)] = 1.0f / (float(ext[size_t(i)]) * power(rope.theta, i, dim));
  return out;
}

}  // namespace rope
}  // namespace detail

Result<int64_t> rope_rotary_dim(const RopeConfig& rope, int64_t head_dim) {
  return detail::guard([&]() -> int64_t {
    const int64_t rotary_dim = int64_t(double(head_dim) * rope.partial_rotary_factor);  // Python's int()
    if (head_dim <= 0 || !(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1) || rotary_dim < 2 ||
        rotary_dim % 2 != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("rope_rotary_dim: head_dim %lld and partial_rotary_factor %g give rotary_dim %lld; "
                                  "it must be even and in 2..head_dim",
                                  (long long)head_dim, rope.partial_rotary_factor, (long long)rotary_dim));
    return rotary_dim;
  });
}

bool rope_depends_on_length(const RopeConfig& rope) { return rope.type == "dynamic" || rope.type == "longrope"; }

Result<RopeFrequencies> rope_frequencies(const RopeConfig& rope, int64_t rotary_dim, int64_t seq_len) {
  using detail::fail;
  using detail::format;
  return detail::guard([&]() -> RopeFrequencies {
    if (rotary_dim <= 0 || rotary_dim % 2 != 0)
      fail(ErrorCode::invalid_argument, format("rope_frequencies: rotary_dim %lld must be positive and even", (long long)rotary_dim));
    if (!(rope.theta > 0))
      fail(ErrorCode::invalid_argument, format("rope_frequencies: rope_theta %g must be positive", rope.theta));
    if (seq_len < 0) fail(ErrorCode::invalid_argument, format("rope_frequencies: seq_len %lld is negative", (long long)seq_len));
    RopeFrequencies out;
    if (rope.type == "default") {
      out.inv_freq = detail::rope::default_inv_freq(rope.theta, rotary_dim);
    } else if (rope.type == "linear") {
      // inv_freq /= factor (scaling the frequencies is scaling the positions)
      if (!(rope.factor > 0)) fail(ErrorCode::invalid_argument, format("rope_frequencies: linear factor %g must be positive", rope.factor));
      out.inv_freq = detail::rope::default_inv_freq(rope.theta, rotary_dim);
      for (float& f : out.inv_freq) f = f / float(rope.factor);
    } else if (rope.type == "dynamic") {
      out.inv_freq = detail::rope::dynamic(rope, rotary_dim, seq_len);
    } else if (rope.type == "yarn") {
      out = detail::rope::yarn(rope, rotary_dim);
    } else if (rope.type == "longrope") {
      out = detail::rope::longrope(rope, rotary_dim, seq_len);
    } else if (rope.type == "llama3") {
      out.inv_freq = detail::rope::default_inv_freq(rope.theta, rotary_dim);
      detail::rope::llama3(rope, out.inv_freq);
    } else {
      fail(ErrorCode::unsupported,
           format("rope_frequencies: rope type '%s' is not supported (kvlite runs default, linear, dynamic, yarn, "
                  "longrope and llama3)", rope.type.c_str()));
    }
    return out;
  });
}

Result<RopeFrequencies> rope_frequencies_for_length(const RopeConfig& rope, int64_t rotary_dim, int64_t seq_len) {
  // dynamic_rope_update on a fresh module: dynamic recomputes when seq_len grows past max_position_embeddings
  // (and keeps the init frequencies up to it); longrope takes the long factors past the original length.
  if (rope.type == "dynamic" && seq_len > rope.max_position_embeddings) return rope_frequencies(rope, rotary_dim, seq_len);
  if (rope.type == "longrope" && seq_len > rope.original_max_position_embeddings)
    return rope_frequencies(rope, rotary_dim, rope.original_max_position_embeddings + 1);
  return rope_frequencies(rope, rotary_dim, 0);
}

int64_t rope_context_length(const RopeConfig& rope, int64_t max_position_embeddings) {
  double length = double(max_position_embeddings);
  if (rope.type == "yarn" && rope.original_max_position_embeddings > 0 && rope.factor > 0)
    length = double(rope.original_max_position_embeddings) * rope.factor;
  else if ((rope.type == "linear" || rope.type == "dynamic") && rope.factor > 0)
    length = double(max_position_embeddings) * rope.factor;
  length = std::min(length, double(limits::max_positions));
  return std::max(max_position_embeddings, int64_t(length));
}

Result<std::vector<float>> rope_inv_freq(const RopeConfig& rope, int64_t rotary_dim) {
  Result<RopeFrequencies> frequencies = rope_frequencies(rope, rotary_dim, 0);
  if (!frequencies) return frequencies.error();
  return std::move(frequencies->inv_freq);
}

Status rope_tables(const std::vector<float>& inv_freq, const int32_t* positions, int64_t position_rows,
                   int64_t tokens, const std::vector<int>& mrope_section, float* cos, float* sin,
                   float attention_factor, RopeConfig::MropeLayout layout) {
  return detail::guard([&] {
    const int64_t half = int64_t(inv_freq.size());
    if (position_rows != 1 && position_rows != 3)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("rope_tables: %lld position rows; use 1 (RoPE) or 3 (t, h, w: M-RoPE)",
                                  (long long)position_rows));
    if (position_rows == 3 && mrope_section.size() != 3)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("rope_tables: 3 position rows need a 3-entry mrope_section (t, h, w), got %zu entries",
                                  mrope_section.size()));
    if (tokens < 0 || (tokens > 0 && (positions == nullptr || cos == nullptr || sin == nullptr)))
      detail::fail(ErrorCode::invalid_argument, "rope_tables: null positions or tables, or negative tokens");
    if (!(attention_factor > 0) || !std::isfinite(attention_factor))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("rope_tables: attention_factor %g must be positive and finite", attention_factor));
    for (int64_t t = 0; t < tokens; t++) {
      for (int64_t i = 0; i < half; i++) {
        // Qwen3-VL's apply_interleaved_mrope: h overwrites slots 1, 4, 7, ... below 3 * section[1],
        // w overwrites 2, 5, 8, ... below 3 * section[2]; the rest keep t.
        int64_t row = 0;
        if (position_rows == 3 && layout == RopeConfig::MropeLayout::interleaved) {
          if (i % 3 == 1 && i < 3 * int64_t(mrope_section[1])) row = 1;
          else if (i % 3 == 2 && i < 3 * int64_t(mrope_section[2])) row = 2;
        } else if (position_rows == 3) {
          // Qwen2.5-VL's recomposition_frequencies: torch.cat([m[i % 3] for i, m in
          // enumerate(freq.split(mrope_section, dim=-1))]): section k takes row k % 3
          const int64_t t_end = mrope_section[0], h_end = t_end + mrope_section[1];
          row = i < t_end ? 0 : i < h_end ? 1 : 2;
        }
        // freqs = inv_freq @ position_ids.float(): one float32 product
        float angle = inv_freq[size_t(i)] * float(positions[row * tokens + t]);
        // cos = emb.cos() * self.attention_scaling (a float32 product; exact when the factor is 1)
        cos[t * half + i] = float(std::cos(double(angle))) * attention_factor;
        sin[t * half + i] = float(std::sin(double(angle))) * attention_factor;
      }
    }
  });
}

Status rope_step_lengths(const int32_t* positions, int64_t tokens, const int32_t* query_starts, int64_t seqs,
                         int32_t* lengths) {
  return detail::guard([&] {
    if (tokens < 0 || seqs < 0 || (tokens > 0 && (positions == nullptr || lengths == nullptr)) ||
        (seqs > 0 && query_starts == nullptr))
      detail::fail(ErrorCode::invalid_argument, "rope_step_lengths: null arrays or negative sizes");
    for (int64_t s = 0; s < seqs; s++) {
      const int64_t first = query_starts[s], last = query_starts[s + 1];
      if (first < 0 || last < first || last > tokens)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("rope_step_lengths: sequence %lld's tokens %lld..%lld lie outside the step's %lld",
                                    (long long)s, (long long)first, (long long)last, (long long)tokens));
      int64_t length = 0;
      for (int64_t t = first; t < last; t++) length = std::max(length, int64_t(positions[t]) + 1);
      if (length > limits::max_positions)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("rope_step_lengths: sequence %lld reaches position %lld, above KVLITE_MAX_POSITIONS",
                                    (long long)s, (long long)(length - 1)));
      for (int64_t t = first; t < last; t++) lengths[t] = int32_t(length);
    }
  });
}

Result<RotaryEmbedding> RotaryEmbedding::create(const RopeConfig& rope, int64_t head_dim) {
  return detail::guard([&]() -> RotaryEmbedding {
    RotaryEmbedding r;
    r.rope_ = rope;
    Result<int64_t> rotary_dim = rope_rotary_dim(rope, head_dim);
    if (!rotary_dim) throw rotary_dim.error();
    r.rotary_dim_ = *rotary_dim;
    Result<RopeFrequencies> init = rope_frequencies(rope, r.rotary_dim_, 0);
    if (!init) throw init.error();
    r.init_ = std::move(*init);
    if (rope.type == "longrope") {
      Result<RopeFrequencies> long_frequencies = rope_frequencies(rope, r.rotary_dim_, rope.original_max_position_embeddings + 1);
      if (!long_frequencies) throw long_frequencies.error();
      r.long_ = std::move(*long_frequencies);
    }
    return r;
  });
}

Status RotaryEmbedding::tables(const int32_t* positions, int64_t position_rows, int64_t tokens,
                               const int32_t* lengths, float* cos, float* sin) const {
  if (!depends_on_length())
    return rope_tables(init_.inv_freq, positions, position_rows, tokens, rope_.mrope_section, cos, sin,
                       init_.attention_factor, rope_.mrope_layout);
  return detail::guard([&] {
    if (position_rows != 1 || (tokens > 0 && lengths == nullptr))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("RotaryEmbedding::tables: '%s' RoPE needs one position row and each token's "
                                  "sequence length (got %lld rows, lengths %s)", rope_.type.c_str(),
                                  (long long)position_rows, lengths ? "given" : "null"));
    const int64_t h = half();
    for (int64_t start = 0; start < tokens;) {
      int64_t end = start + 1;
      while (end < tokens && lengths[end] == lengths[start]) end++;
      const int64_t length = lengths[start];
      const RopeFrequencies* frequencies = &init_;
      if (rope_.type == "longrope" && length > rope_.original_max_position_embeddings) {
        frequencies = &long_;
      } else if (rope_.type == "dynamic" && length > rope_.max_position_embeddings) {
        if (cached_length_ != length) {
          Result<RopeFrequencies> computed = rope_frequencies(rope_, rotary_dim_, length);
          if (!computed) throw computed.error();
          cached_ = std::move(*computed);
          cached_length_ = length;
        }
        frequencies = &cached_;
      }
      Status status = rope_tables(frequencies->inv_freq, positions + start, 1, end - start, rope_.mrope_section,
                                  cos + start * h, sin + start * h, frequencies->attention_factor);
      if (!status) throw status.error();
      start = end;
    }
  });
}

}  // namespace kvlite
